"""``AllGatherComm``: FSDP2's parameter all-gather through commopt's algorithms (docs/architecture.md section 5.4).

Exact (``compressor=None``): ``flat`` is the group's own all-gather; ``hierarchical`` is
``algorithms.hierarchical`` ((1) all-gather inter-node along the rail, 1/L of the final data per
rank crossing the node link, (2) all-gather intra-node, (3) permute the blocks into rank order);
``auto`` asks the cost model and falls back to flat where the hierarchy does not apply.

Quantized (ZeRO++'s qwZ, ``compressor=QuantizeCompressor(bits=8)``): (1) this rank quantizes its
shard once (per-block scales, blocks restarting at every parameter, round to nearest), (2) the byte
payloads are all-gathered with the same algorithm objects (hierarchical: the rail first, so only
codes and scales cross the node link), (3) every rank dequantizes every shard, its own included.

Which all-gathers are quantized, and why:

- every all-gather over the whole topology: forward's, and backward's when FSDP re-gathers the
  parameters over the whole group (``reshard_after_forward=True``). Rounding is deterministic and
  every rank decodes the same bytes, so all ranks hold identical parameters and backward sees
  exactly the weights forward used;
- never one over a group inside one node: that is hpZ's post-forward group
  (``reshard_after_forward=L``), whose shards are pieces of the parameters forward already
  dequantized. The comm recognises such a group and runs the plain exact exchange: there is no node
  link to spare, and quantizing again would compound the error. So with hpZ, forward's all-gather is
  quantized and backward's is exact and never leaves the node;
- never one of a non-floating buffer (FSDP gathers bytes when a module mixes parameter dtypes).

The optimizer always updates the exact fp32 shards: only the gathered compute copy is lossy.
``algorithm="native"`` is torch's own all-gather, as FSDP2's default comm issues it, under the call's
deadline and commopt's errors.

An asynchronous all-gather returns a ``Work`` whose ``wait()`` raises the call's error (FSDP2 waits
on it before it reads the parameters, so a prefetched all-gather that failed or timed out raises
from the forward or backward that needed it); every phase and every wait of one call share the
deadline the call's ``timeout`` sets when it starts.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.fsdp._fully_shard._fsdp_api import AllGather

from .. import algorithms
from ..algorithms._transport import all_gather_single, deadline_of, exchange_all_gather, prepare, remaining
from ..compression import Compressor
from ..engine import Phase, chain, wait
from ..runtime import context
from ..topology import Topology
from ._common import NATIVE, Bound, BoundComm, CollectiveComm, as_work, done_work

__all__ = ["AllGatherComm"]


class AllGatherComm(CollectiveComm, AllGather):
    """torch's ``AllGather`` comm protocol (``FSDPModule.set_custom_all_gather``) on commopt's
    algorithms, exact or qwZ-quantized (see the module docstring for which calls are quantized).

    Args:
        topology: the layout of every rank (None: detected once).
        algorithm: ``"auto"``, ``"flat"`` or ``"hierarchical"``; ``"native"``: torch's own all-gather,
            as FSDP2's default comm issues it, under ``timeout`` and commopt's errors.
        compressor: None (exact) or ``QuantizeCompressor(bits=8)`` (bits=4 is accepted; weights
            lose more than gradients do at 4 bits).
        timeout: seconds each transfer may take before ``CommTimeoutError`` (None: the group's own).
    """

    where = "AllGatherComm"
    collective, role = "all_gather", "all-gather"

    def __init__(self, topology: Topology | None = None, algorithm: str = "auto",
                 compressor: Compressor | None = None, *, timeout: float | None = None):
        super().__init__(topology, algorithm, compressor, timeout)

    @property
    def name(self) -> str:
        return self.algorithm if self.compressor is None else f"int{self.compressor.bits}"

    # ----------------------------------------------------------------------------- protocol
    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: dist.ProcessGroup,
                 async_op: bool = False):
        return self.gather(output_tensor, input_tensor, group, async_op, None)

    def bind(self, bound: Bound) -> _Bound:
        return _Bound(self, bound)

    # ----------------------------------------------------------------------------- dispatch
    def gather(self, output: torch.Tensor, input: torch.Tensor, group, async_op: bool, bound: Bound | None):
        """Gather ``input`` into ``output``. With ``async_op`` it returns a ``Work`` at once and the
        phases run on the comm engine meanwhile (FSDP2 waits on it before it reads the output: its
        backward prefetch, and forward prefetching, then overlap the gather with computation)."""
        world = group.size()
        if output.numel() != world * input.numel():
            raise ValueError(f"{self.where}: output has {output.numel()} elements, expected world_size ({world}) x "
                             f"input ({input.numel()})")
        if world == 1:
            output.detach().view(-1).copy_(input.detach().reshape(-1))
            return done_work(async_op)
        site = self.site(group)
        blocking = not async_op
        deadline = deadline_of(self.timeout)  # the call's: every phase and wait waits for what is left
        if self.algorithm == NATIVE:  # torch's own all-gather, as FSDP2's default comm issues it
            work = all_gather_single(output, input, group=group, async_op=True)
            fut = self.native(work, output, group, "all_gather", output.numel() * output.element_size(), deadline)
        elif self.compressor is not None and site.kind == "full" and input.is_floating_point():
            fut = self._quantized(output, input, group, bound, blocking, deadline)
        else:
            fut = self._exact(output, input, group, site.kind, blocking, deadline)
        if async_op:
            return as_work(fut, "fsdp/all_gather", self.timeout, deadline)
        wait(fut, self.timeout, op="fsdp/all_gather", deadline=deadline)
        return None

    def _start(self, out: torch.Tensor, src: torch.Tensor, group, tag: str, blocking: bool,
               deadline: float | None) -> torch.futures.Future:
        """All-gather ``src`` into ``out`` (both 1-D, contiguous) over the whole topology."""
        p, _ = prepare(out, "sum", group.size())
        return self.start(p, None, src, group, out.numel() * out.element_size(), out.element_size(), tag, blocking,
                          deadline)

    # ----------------------------------------------------------------------------- exact
    def _exact(self, output: torch.Tensor, input: torch.Tensor, group, kind: str, blocking: bool,
               deadline: float | None) -> torch.futures.Future:
        target = output.detach()
        work = target.view(-1) if target.is_contiguous() else torch.empty(target.numel(), dtype=target.dtype,
                                                                          device=target.device)
        src = input.detach().reshape(-1)
        if kind == "full":
            fut = self._start(work, src, group, "ag", blocking, deadline)
        elif kind == "node":
            fut = self.submit([Phase("all_gather_node",
                                     lambda: exchange_all_gather(work, src, group, remaining(deadline)), group)],
                              "fsdp/all_gather/node", src.device, blocking=blocking)
        else:
            p, _ = prepare(work, "sum", group.size())
            flat = algorithms.get("flat")
            fut = flat.start(context().call(flat, "all_gather", p, None, group, None, remaining(deadline), blocking,
                                            1, src))
        if work.data_ptr() == target.data_ptr():
            return fut
        return chain(fut, lambda _v: target.copy_(work.view(target.shape)))

    # ----------------------------------------------------------------------------- quantized
    def _quantized(self, output: torch.Tensor, input: torch.Tensor, group, bound: Bound | None,
                   blocking: bool, deadline: float | None) -> torch.futures.Future:
        world, chunk = group.size(), input.numel()
        numels = bound.layout.numels if bound is not None and bound.layout.chunk == chunk else (chunk,)
        segs = [n for n in numels if n]
        codec = self.compressor
        nbytes = codec.nbytes(segs)
        src = input.detach().reshape(-1)
        payload = torch.empty(nbytes, dtype=torch.uint8, device=src.device)
        # Round to nearest: the same shard encodes to the same bytes in forward and in backward.
        codec.encode(src if src.dtype == torch.float32 else src.float(), segs, payload)
        gathered = torch.empty(world * nbytes, dtype=torch.uint8, device=src.device)
        out = output.detach().view(world, chunk)

        def decode(_value) -> None:
            # Local work after the gather (docs/architecture.md section 3: no collective here):
            # every shard, this rank's too.
            rows = gathered.view(world, nbytes)
            for b in range(world):
                codec.decode(rows[b], segs, out[b])

        return chain(self._start(gathered, payload, group, "qag", blocking, deadline), decode)

    # ----------------------------------------------------------------------------- model
    def traffic(self, nbytes: float, topology: Topology | None = None, *, itemsize: int = 4,
                segments: list[int] | None = None) -> algorithms.Traffic:
        """What one call over the whole topology moves; ``nbytes``: the gathered (world, chunk) output
        in bytes of ``itemsize``. Quantized: the algorithm's traffic of the byte payloads."""
        topo = topology if topology is not None else self.resolve()
        algo = "hierarchical" if self.two_level(topo) else "flat"  # native: torch's ring, flat's model
        if self.compressor is None:
            return algorithms.get(algo).traffic("all_gather", nbytes, topo, itemsize=itemsize)
        chunk = int(nbytes // itemsize) // topo.world_size
        payload = self.compressor.nbytes(list(segments) if segments is not None else [chunk])
        return algorithms.get(algo).traffic("all_gather", payload * topo.world_size, topo, itemsize=1)

    def __repr__(self) -> str:
        return f"AllGatherComm(algorithm={self.algorithm!r}, compressor={self.compressor!r})"


class _Bound(BoundComm, AllGather):
    """An :class:`AllGatherComm` bound to one FSDP module (set by :func:`register`)."""

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: dist.ProcessGroup,
                 async_op: bool = False):
        return self.comm.gather(output_tensor, input_tensor, group, async_op, self.bound)
