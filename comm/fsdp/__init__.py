"""commopt.comm.fsdp: commopt's algorithms for FSDP2 (``torch.distributed.fsdp.fully_shard``), on any backend.

One call shards a model with the ZeRO++ recipe (per-block ``fully_shard``, hpZ's secondary shard
inside each node, int8 weights across nodes, int4 gradients reduced hierarchically with error
feedback), each part where it pays on this cluster for this model (``"auto"``: timed at the call)::

    from commopt.comm import fsdp
    comms = fsdp.shard(model)                 # ZeRO++ where it pays; comms.state_dict() goes in the checkpoint
    comms = fsdp.shard(model, weights=QuantizeCompressor(8), gradients=QuantizeCompressor(4), hpz=True)  # forced
    comms = fsdp.shard(model, weights=None, gradients=None, hpz=False)   # exact, hierarchical where it pays
    comms = fsdp.shard_hsdp(model)            # HSDP: FSDP2 inside each node, int8 across nodes

or, on modules already sharded with ``fully_shard``::

    fsdp.register(model, reduce_scatter=fsdp.ReduceScatterComm(algorithm="hierarchical"),
                  all_gather=fsdp.AllGatherComm(algorithm="hierarchical"))

- :class:`ReduceScatterComm` / :class:`AllGatherComm`: torch's ``ReduceScatter`` / ``AllGather`` comm
  protocols (``FSDPModule.set_custom_reduce_scatter`` / ``set_custom_all_gather``): ``flat``,
  ``hierarchical`` and ``auto`` run the algorithm objects of ``commopt.comm.algorithms``; with
  ``compressor=QuantizeCompressor(...)`` the reduce-scatter is qgZ (int4/int8 all-to-all per level,
  fp32 sums) and the all-gather qwZ (int8 weights across nodes); ``native`` is torch's own collective
  (FSDP2's numerics bit for bit) under the comm's timeout and commopt's errors, what ``shard``
  registers for a part where FSDP2's own collective timed fastest.
- :class:`AllReduceHook`: compressed HSDP through ``set_all_reduce_hook``.
- :func:`register`: validates on every rank first (docs/faults.md row 33), then binds the comms to every module.

What is lossy: only what a compressor touches. Quantized all-gathers change the weights forward and
backward compute with (never the fp32 shards the optimizer updates), quantized reduce-scatters and
the compressed HSDP hook the gradients (bounded per block by max|block| / qmax, halved when
rounding to nearest, and with error feedback the loss is carried into the next step). Exact comms
give native FSDP2's gradients up to the order of fp32 sums (the HSDP hook without a compressor:
native HSDP's, bit for bit).
"""

from __future__ import annotations

from .all_gather import AllGatherComm
from .hsdp import AllReduceHook
from .reduce_scatter import ReduceScatterComm
from .register import AUTO_MARGIN, Comms, register, shard, shard_hsdp

__all__ = ["ReduceScatterComm", "AllGatherComm", "AllReduceHook", "register", "shard", "shard_hsdp", "Comms",
           "AUTO_MARGIN"]
