"""torchtitan: commopt's FSDP2 comms on the modules torchtitan's own parallelize function shards.

torchtitan builds every model on the meta device and hands it to ``ModelSpec.parallelize_fn`` (for
Llama 3, ``parallelize_llama``: tensor/context parallelism, activation checkpointing, compile, then
``fully_shard`` on every block and the root), before it allocates the weights and builds the
optimizer. :func:`parallelize` wraps that function: (1) torchtitan's function runs unchanged, (2)
``commopt.comm.fsdp.register`` sets commopt's reduce-scatter and all-gather on every FSDP module it
created, then the model goes back to torchtitan, which initialises it and trains as usual. With
pipeline parallelism torchtitan calls the function once per stage, and each stage is registered.

Two sets of comms:

- ``comms="exact"`` (the default): :class:`~commopt.comm.fsdp.ReduceScatterComm` and
  :class:`~commopt.comm.fsdp.AllGatherComm` with ``algorithm="hierarchical"`` (reduce-scatter inside
  each node, then across nodes on 1/L of the data; the all-gather in reverse): the same gradients as
  native FSDP2 up to the order of fp32 sums, fewer bytes on the inter-node links.
- ``comms="zero++"``: ZeRO++'s qgZ and qwZ (int4 gradients reduced hierarchically with error
  feedback, int8 weights gathered across nodes), as :func:`commopt.comm.fsdp.shard` registers them.
  Lossy where the compressors touch (docs/architecture.md section 5.4). hpZ (the secondary shard
  inside each node) is not applied: torchtitan chooses ``reshard_after_forward`` itself
  (``--parallelism.fsdp_reshard_after_forward``).

A torchtitan user adds a config function beside torchtitan's (``--module`` names a Python module
holding config functions, ``--config`` the function)::

    # my_configs.py, somewhere on PYTHONPATH
    from commopt.comm.integrations.torchtitan import parallelize
    from torchtitan.models.llama3.config_registry import llama3_8b

    def llama3_8b_commopt():
        config = llama3_8b()
        config.model_spec.parallelize_fn = parallelize(config.model_spec.parallelize_fn)
        return config

    # torchrun --nproc_per_node 8 -m torchtitan.train --module my_configs --config llama3_8b_commopt

Where commopt's comms apply: the FSDP mesh must be every rank, or the ranks of one node (HSDP with
``data_parallel_shard_degree`` = ranks per node); with tensor or context parallelism FSDP shards over
a strided sub-mesh and ``register`` raises ``TopologyError`` on every rank before the first step. The
topology is detected (``COMMOPT_NODES``, else torchrun's ``LOCAL_WORLD_SIZE``), or given as a spec.
The comms count their bytes: :attr:`Parallelize.comms` holds what each call registered
(``link_bytes()``, and ``state_dict()`` for the ZeRO++ residuals, which belong in a checkpoint).

Needs torchtitan (``pip install torchtitan``; see docs/frameworks.md for a CPU-only torch); imported only
when this module is.
"""

from __future__ import annotations

import functools
from typing import Callable

from torch import nn

from ..compression import QuantizeCompressor
from ..fsdp import AllGatherComm, Comms, ReduceScatterComm, register
from ..topology import Topology

try:
    import torchtitan as _torchtitan  # noqa: F401 - the framework this adapter serves
except ImportError:
    raise ImportError("commopt.comm.integrations.torchtitan needs torchtitan: pip install torchtitan "
                      "(see docs/frameworks.md, 'With torchtitan', for a CPU-only torch)") from None

__all__ = ["parallelize", "Parallelize", "COMMS"]

COMMS = ("exact", "zero++")


class Parallelize:
    """A ``ModelSpec.parallelize_fn``: torchtitan's function, then commopt's FSDP2 comms registered.

    Args:
        parallelize_fn: torchtitan's parallelize function (``parallelize_llama``, or
            ``config.model_spec.parallelize_fn``); called with the arguments torchtitan passes.
        comms: ``"exact"`` (hierarchical reduce-scatter and all-gather, native FSDP2's gradients) or
            ``"zero++"`` (qgZ int4 gradients with error feedback, qwZ int8 weights).
        topology: a spec (``"2x4"``), a :class:`~commopt.comm.Topology`, or None (detected when the
            function runs, after torchtitan has initialised the process group).
        algorithm: the exact comms' algorithm (``"hierarchical"``, ``"auto"``, ``"flat"``); the
            ZeRO++ comms use ``"auto"`` unless another is given.
        error_feedback: the ZeRO++ gradients' error feedback.
        timeout: seconds every call may take before ``CommTimeoutError`` (None: no limit of commopt's own).

    Attributes:
        comms: the :class:`~commopt.comm.fsdp.Comms` registered by each call, in call order (one per
            pipeline stage; one without pipeline parallelism).

    Raises:
        ValueError: at construction, an unknown ``comms``; when called, ``parallelize_fn`` returned a
            model without FSDP modules (``fully_shard`` was not applied) or ``register`` refused it.
        TypeError: at construction, ``parallelize_fn`` is not callable or ``topology`` of another type.
        TopologyError: when called, the FSDP mesh is not the topology's (tensor or context parallelism).
    """

    def __init__(self, parallelize_fn: Callable[..., nn.Module], *, comms: str = "exact",
                 topology: str | Topology | None = None, algorithm: str | None = None, error_feedback: bool = True,
                 timeout: float | None = None):
        if not callable(parallelize_fn):
            raise TypeError(f"torchtitan.parallelize: parallelize_fn must be torchtitan's parallelize function "
                            f"(e.g. config.model_spec.parallelize_fn), got {type(parallelize_fn).__name__}")
        if comms not in COMMS:
            raise ValueError(f"torchtitan.parallelize: comms must be one of {COMMS}, got {comms!r}")
        if topology is not None and not isinstance(topology, (str, Topology)):
            raise TypeError(f"torchtitan.parallelize: topology must be a spec such as '2x4', a Topology or None "
                            f"(detected), got {type(topology).__name__} {topology!r}")
        self.parallelize_fn = parallelize_fn
        self.comms_kind = comms
        self.topology = topology
        self.algorithm = algorithm if algorithm is not None else ("hierarchical" if comms == "exact" else "auto")
        self.error_feedback = error_feedback
        self.timeout = timeout
        self.comms: list[Comms] = []
        # Name, docstring and __wrapped__ only: merging parallelize_fn's __dict__ would overwrite these
        # attributes when it is itself a Parallelize.
        functools.update_wrapper(self, parallelize_fn, updated=())

    def __call__(self, model: nn.Module, **kwargs) -> nn.Module:
        model = self.parallelize_fn(model, **kwargs)
        self.comms.append(self.register(model))
        return model

    def register(self, model: nn.Module) -> Comms:
        """Register this wrapper's comms on ``model`` (already sharded by torchtitan); collective."""
        topo = self._topology()
        if self.comms_kind == "exact":
            rs = ReduceScatterComm(topo, self.algorithm, timeout=self.timeout)
            ag = AllGatherComm(topo, self.algorithm, timeout=self.timeout)
        else:
            rs = ReduceScatterComm(topo, self.algorithm, QuantizeCompressor(4), error_feedback=self.error_feedback,
                                   timeout=self.timeout)
            ag = AllGatherComm(topo, self.algorithm, QuantizeCompressor(8), timeout=self.timeout)
        register(model, reduce_scatter=rs, all_gather=ag)
        return Comms(reduce_scatter=rs, all_gather=ag)

    def _topology(self) -> Topology | None:
        if isinstance(self.topology, str):
            return Topology.from_spec(self.topology)
        return self.topology  # None: each comm detects it (collectively, the same on every rank)

    def link_bytes(self) -> float:
        """Bytes the busiest node link carried (one direction) in every registered comm's calls."""
        return sum(c.link_bytes() for c in self.comms)

    def __repr__(self) -> str:
        name = getattr(self.parallelize_fn, "__qualname__", repr(self.parallelize_fn))
        return (f"Parallelize({name}, comms={self.comms_kind!r}, topology={self.topology!r}, "
                f"algorithm={self.algorithm!r})")


def parallelize(parallelize_fn: Callable[..., nn.Module], *, comms: str = "exact",
                topology: str | Topology | None = None, algorithm: str | None = None, error_feedback: bool = True,
                timeout: float | None = None) -> Parallelize:
    """``parallelize_fn`` followed by commopt's FSDP2 comms: a drop-in ``ModelSpec.parallelize_fn``.

    ``config.model_spec.parallelize_fn = parallelize(config.model_spec.parallelize_fn)``; the
    arguments are :class:`Parallelize`'s.
    """
    return Parallelize(parallelize_fn, comms=comms, topology=topology, algorithm=algorithm,
                       error_feedback=error_feedback, timeout=timeout)
