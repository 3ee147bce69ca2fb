"""``ReduceScatterComm``: FSDP2's gradient reduce-scatter through commopt's algorithms
(docs/architecture.md section 5.4).

Exact (``compressor=None``) calls are one more consumer of the algorithm objects: ``flat`` is the
group's own reduce-scatter, ``hierarchical`` is ``algorithms.hierarchical`` ((1) permute the blocks
so that each rail's blocks are contiguous, (2) reduce-scatter intra-node, (3) reduce-scatter
inter-node along the rail on 1/L of the data), ``auto`` asks the cost model and falls back to flat
where the hierarchy does not apply (one level, or nodes of unequal size such as 2+1).

Quantized calls (``compressor=QuantizeCompressor(bits=4 | 8)``) follow ZeRO++'s qgZ, with every sum
in fp32 (never an integer sum, never a sum in the reduce dtype); each level is
``compression.quantize.quantized_reduce_scatter``, the first shot of the DDP hook's exchange too:

(1) quantize, per destination, the chunk that destination reduces (per-block scales, blocks
    restarting at every parameter's segment), with this rank's error-feedback residual added;
(2) intra-node all-to-all of the codes (pairwise transfers);
(3) dequantize and sum in fp32 with this rank's own chunk (which never left it, so it stays exact);
(4) requantize that partial sum per rail peer, (5) inter-node all-to-all along the rail,
(6) dequantize and sum in fp32; scale (AVG / PREMUL_SUM) and cast to the reduce dtype.

Where the hierarchy does not apply (one level, 2+1, ``algorithm="flat"``) steps (1)-(3) run once over
all ranks. Error feedback (default) keeps, per parameter name, the residual of every quantization
this rank performs (level 1: the chunks it sends; level 2: the partial sums it sends) and rounds to
nearest; without it rounding is stochastic (unbiased) and nothing is kept. A group that lies inside
one node (native HSDP's shard group) runs the plain exact exchange; any other group the group's own
reduce-scatter.

``algorithm="native"`` is torch's own reduce-scatter with FSDP2's op, bit for bit what FSDP2 computes
without a custom comm (on gloo an all-reduce of a copy, then this rank's chunk), issued on the caller's
thread and waited for within the call's deadline, its failures commopt's errors.

FSDP2 reduce-scatters only the parameters that require gradients: a frozen parameter
(``requires_grad=False``) has no segment in the buffer and no residual (``Bound.reduced``); trainable
ones keep theirs when another is frozen or unfrozen. Every phase of one call (the finiteness check,
both levels) shares the call's deadline.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed import ReduceOp
from torch.distributed.fsdp._fully_shard._fsdp_api import ReduceScatter

from .. import algorithms
from ..algorithms._transport import (
    LOW_PRECISION,
    deadline_of,
    exchange_reduce_scatter,
    prepare,
    reduce_scatter_single,
    remaining,
)
from ..algorithms.hierarchical import rail_order
from ..algorithms.roles import FSDP_QRS_FLAT, FSDP_QRS_INTRA, FSDP_QRS_RAIL
from ..compression import Compressor
from ..compression.base import derive_seed
from ..compression.quantize import quantized_reduce_scatter
from ..engine import Phase, wait
from ..runtime import context
from ..topology import Topology
from ._common import NATIVE, Bound, BoundComm, CollectiveComm, Layout, done_work, reduction

__all__ = ["ReduceScatterComm"]


class ReduceScatterComm(CollectiveComm, ReduceScatter):
    """torch's ``ReduceScatter`` comm protocol (``FSDPModule.set_custom_reduce_scatter``) on commopt's
    algorithms, exact or qgZ-quantized (see the module docstring for the phases).

    Use it through :func:`commopt.comm.fsdp.register`, which binds it to every FSDP module of a tree
    (quantization blocks then follow parameter boundaries and residuals are keyed by parameter name);
    set directly on a module it runs unbound: blocks over the whole chunk, stochastic rounding and no
    residuals.

    Args:
        topology: the layout of every rank (None: detected once).
        algorithm: ``"auto"``, ``"flat"`` or ``"hierarchical"`` (quantized: two levels where the
            hierarchy applies, else one); ``"native"``: torch's own reduce-scatter with FSDP2's op,
            bit for bit what FSDP2's default comm computes, under ``timeout`` and commopt's errors.
        compressor: None (exact) or ``QuantizeCompressor(bits=8 | 4, block=...)``; any other
            compressor is a ``TypeError`` (docs/faults.md row 33).
        error_feedback: with a compressor, keep residuals per parameter name and round to nearest;
            False rounds stochastically (unbiased) and keeps nothing.
        seed: seeds stochastic rounding, the same on every rank.
        check_finite: agree across ranks (one small all-gather) whether any rank's gradients hold
            NaN/Inf and raise ``NonFiniteError`` on every rank; by default NaN/Inf propagate (into
            their quantization block of the reduced shard) and residuals are left as they were.
        timeout: seconds each transfer may take before ``CommTimeoutError`` (None: the group's own).

    Raises:
        TypeError, ValueError: a bad argument, at construction.
    """

    where = "ReduceScatterComm"
    collective, role = "reduce_scatter", "reduce-scatter"

    def __init__(self, topology: Topology | None = None, algorithm: str = "auto",
                 compressor: Compressor | None = None, *, error_feedback: bool = True, seed: int = 0,
                 check_finite: bool = False, timeout: float | None = None):
        super().__init__(topology, algorithm, compressor, timeout)
        if isinstance(seed, bool) or not isinstance(seed, int):
            raise TypeError(f"{self.where}: seed must be an int (the same on every rank), got {seed!r}")
        self.error_feedback = bool(error_feedback) and self.compressor is not None
        self.seed = seed
        self.finite_check = bool(check_finite)

    @property
    def name(self) -> str:
        if self.compressor is None:
            return self.algorithm
        return f"int{self.compressor.bits}" + ("+ef" if self.error_feedback else "")

    # ----------------------------------------------------------------------------- protocol
    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: dist.ProcessGroup,
                 op=ReduceOp.SUM, async_op: bool = False):
        return self.reduce(output_tensor, input_tensor, group, op, async_op, None)

    def bind(self, bound: Bound) -> _Bound:
        """The view of this comm that :func:`register` sets on one FSDP module."""
        self.feedback.layouts[bound.layout.key] = bound.reduced()
        return _Bound(self, bound)

    # ----------------------------------------------------------------------------- dispatch
    def reduce(self, output: torch.Tensor, input: torch.Tensor, group, op, async_op: bool, bound: Bound | None):
        world = group.size()
        scale, _ = reduction(op, world)
        if world == 1:
            output.copy_(input.view_as(output) * scale if scale != 1 else input.view_as(output))
            return done_work(async_op)
        if input.numel() != world * output.numel():
            raise ValueError(f"{self.where}: input has {input.numel()} elements, expected world_size ({world}) x "
                             f"output ({output.numel()})")
        site = self.site(group)
        deadline = deadline_of(self.timeout)  # the call's: every phase below waits for what is left
        if self.finite_check:
            self.check_finite(input, "reduce_scatter", deadline)
        if self.algorithm == NATIVE:
            self._native(output, input, group, op, deadline)
        elif self.compressor is not None and site.kind == "full" and input.is_floating_point():
            self._quantized(output, input, bound, scale, deadline)
        else:
            self._exact(output, input, group, site.kind, scale, deadline)
        return done_work(async_op)

    # ----------------------------------------------------------------------------- native
    def _native(self, output: torch.Tensor, input: torch.Tensor, group, op, deadline: float | None) -> None:
        """torch's own reduce-scatter with FSDP2's op, as FSDP2's default comm issues it (gloo's is an
        all-reduce of a copy, then this rank's chunk: ``reduce_scatter_single``), waited for within the
        call's deadline."""
        kind = "allreduce" if "gloo" in str(dist.get_backend(group)) else "reduce_scatter"
        work = reduce_scatter_single(output, input, op=op, group=group, async_op=True)
        fut = self.native(work, output, group, kind, input.numel() * input.element_size(), deadline)
        wait(fut, self.timeout, op="fsdp/reduce_scatter/native", deadline=deadline)

    # ----------------------------------------------------------------------------- exact
    def _exact(self, output: torch.Tensor, input: torch.Tensor, group, kind: str, scale: float,
               deadline: float | None) -> None:
        world = group.size()
        src = input.detach().reshape(-1)
        post = scale
        if scale != 1 and src.dtype in LOW_PRECISION:
            # Low precision scales before the sum (FSDP's own rule for fp16; AVG in bf16 likewise).
            src, post = src * scale, 1.0
        target = output.detach()
        work = target if target.is_contiguous() else torch.empty(target.shape, dtype=target.dtype,
                                                                 device=target.device)
        p, red = prepare(work, "sum", world)
        nbytes = src.numel() * src.element_size()
        if kind == "full":
            wait(self.start(p, red, src, group, nbytes, src.element_size(), "rs", True, deadline), self.timeout,
                 op="fsdp/reduce_scatter", deadline=deadline)
        elif kind == "node":
            self.run([Phase("reduce_scatter_node",
                            lambda: exchange_reduce_scatter(p.flat, src, ReduceOp.SUM, group, remaining(deadline)),
                            group)], "fsdp/reduce_scatter/node", src.device, deadline)
        else:
            flat = algorithms.get("flat")
            call = context().call(flat, "reduce_scatter", p, red, group, None, remaining(deadline), True, 1, src)
            wait(flat.start(call), self.timeout, op="reduce_scatter/flat", deadline=deadline)
        if post != 1:
            work.mul_(post)
        if work is not target:
            target.copy_(work)

    # ----------------------------------------------------------------------------- quantized
    def _quantized(self, output: torch.Tensor, input: torch.Tensor, bound: Bound | None, scale: float,
                   deadline: float | None) -> None:
        topo = self.resolve()
        world = topo.world_size
        chunk = input.numel() // world
        layout = bound.reduced() if bound is not None else Layout("", ("<chunk>",), (chunk,))
        if chunk != layout.chunk:
            raise ValueError(
                f"{self.where}: FSDP module {layout.key or '<root>'!r} reduce-scatters {chunk} elements per rank "
                f"but its parameters that require gradients hold {layout.chunk}: a trainable parameter got no "
                f"gradient this step; commopt.comm.fsdp.register turns on set_reduce_scatter_unused_params(True) "
                f"for quantized comms, keep it on")
        ef = self.error_feedback and bound is not None
        self.keep(layout.key)
        if ef:
            self.feedback.use(layout)
        step = self.feedback.steps.get(layout.key, 0)
        self.feedback.steps[layout.key] = step + 1
        segs = [n for n in layout.numels if n]
        x = input.detach().reshape(world, chunk)
        x32 = x if x.dtype == torch.float32 else x.float()
        out32 = torch.empty(chunk, dtype=torch.float32, device=input.device)
        bits = self.compressor.bits
        if self.two_level():
            local, nodes = topo.local_size, topo.num_nodes
            order = torch.tensor(rail_order(topo), device=input.device)
            staged = x32.index_select(0, order).view(local, nodes * chunk)
            mid = torch.empty(nodes * chunk, dtype=torch.float32, device=input.device)
            intra = self.groups(FSDP_QRS_INTRA).intra
            rail = self.groups(FSDP_QRS_RAIL).rail
            # Level 1's rows hold the chunks of a rail's N ranks side by side; level 2's one rank each.
            r1 = self.feedback.rows(layout, "level1", (local, nodes), input.device).view(local, -1) if ef else None
            r2 = self.feedback.rows(layout, "level2", (nodes,), input.device) if ef else None
            self._level(staged, mid, intra, topo.local_rank, segs * nodes, r1, (layout.key, "intra"), step,
                        f"fsdp/reduce_scatter/int{bits}/intra", not ef, deadline)
            self._level(mid.view(nodes, chunk), out32, rail, dist.get_rank(rail), segs, r2, (layout.key, "rail"),
                        step, f"fsdp/reduce_scatter/int{bits}/inter", not ef, deadline)
        else:
            g = self.groups(FSDP_QRS_FLAT, self.flat_topology()).intra
            r = self.feedback.rows(layout, "level1", (world,), input.device) if ef else None
            self._level(x32, out32, g, dist.get_rank(g), segs, r, (layout.key, "flat"), step,
                        f"fsdp/reduce_scatter/int{bits}/flat", not ef, deadline)
        self.add_link_bytes(("qrs", tuple(segs)), lambda: self.traffic(world * chunk * 4, segments=segs))
        if scale != 1:
            out32.mul_(scale)
        output.detach().view(-1).copy_(out32)

    def _level(self, inp: torch.Tensor, out: torch.Tensor, group, me: int, segs: list[int],
               residual: torch.Tensor | None, tag: tuple, step: int, op: str, stochastic: bool,
               deadline: float | None) -> None:
        """One all-to-all level through the engine: row d of ``inp`` goes, quantized, to member d,
        within what is left of the call's ``deadline``."""
        k = inp.shape[0]
        rows = list(inp.unbind(0))
        res = list(residual.unbind(0)) if residual is not None else None

        def exchange() -> int:
            return quantized_reduce_scatter(self.compressor, rows, [segs] * k, out, me, group, residual=res,
                                            seed=derive_seed(self.seed, *tag), step=step, stochastic=stochastic,
                                            timeout=remaining(deadline))

        self.run([Phase("all_to_all", exchange, group)], op, inp.device, deadline)

    # ----------------------------------------------------------------------------- model
    def traffic(self, nbytes: float, topology: Topology | None = None, *, itemsize: int = 4,
                segments: list[int] | None = None) -> algorithms.Traffic:
        """What one call moves: ``nbytes`` is the whole (world, chunk) input in bytes of ``itemsize``.

        Exact: the chosen algorithm's ``traffic()``. Quantized: the codes and scales of every level
        (``segments``: the parameter segments of one rank's chunk; None: one segment), which is what
        the engine counts on each rank.
        """
        topo = topology if topology is not None else self.resolve()
        if self.algorithm == NATIVE:  # torch's ring (gloo's: an all-reduce, see _native)
            kind = "allreduce" if dist.is_initialized() and dist.get_backend() == "gloo" else "reduce_scatter"
            return algorithms.get("flat").traffic(kind, nbytes, topo, itemsize=itemsize)
        if self.compressor is None:
            algo = self.choose(int(nbytes)) if topology is None else (
                "hierarchical" if self.two_level(topo) else "flat")
            return algorithms.get(algo).traffic("reduce_scatter", nbytes, topo, itemsize=itemsize)
        world = topo.world_size
        chunk = int(nbytes // itemsize) // world
        segs = list(segments) if segments is not None else [chunk]
        t = algorithms.Traffic(topo)
        if not self.two_level(topo):
            t.all_pairs(list(range(world)), self.compressor.nbytes(segs))
            return t
        for node in topo.nodes:
            t.all_pairs(node, self.compressor.nbytes(segs * topo.num_nodes))
        for rail in topo.rails:
            t.all_pairs(rail, self.compressor.nbytes(segs))
        return t

    # ----------------------------------------------------------------------------- state
    def _meta(self) -> dict:
        topo = self.resolve()
        return {"world_size": topo.world_size, "layout": topo.layout, "algorithm": self.algorithm,
                "bits": self.compressor.bits if self.compressor else 0,
                "block": self.compressor.block if self.compressor else 0, "error_feedback": self.error_feedback,
                "two_level": self.two_level()}

    def state_dict(self) -> dict:
        """Residuals per parameter name and step counters (``torch.load(weights_only=True)`` loads it)."""
        return self.feedback.module_state_dict(self._meta())

    def load_state_dict(self, state: dict) -> None:
        """Restore :meth:`state_dict` (after :func:`register` bound the same model); training then
        continues bit-identically on CPU.

        Raises:
            ValueError: the checkpoint's world size, layout or compressor settings differ (residuals do
                not transfer: build a fresh comm, a documented reset), or it names unknown parameters.
        """
        self.feedback.load_module_state_dict(state, self._meta(), self.where)

    def __repr__(self) -> str:
        return (f"ReduceScatterComm(algorithm={self.algorithm!r}, compressor={self.compressor!r}, "
                f"error_feedback={self.error_feedback})")


class _Bound(BoundComm, ReduceScatter):
    """A :class:`ReduceScatterComm` bound to one FSDP module (set by :func:`register`)."""

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: dist.ProcessGroup,
                 op=ReduceOp.SUM, async_op: bool = False):
        return self.comm.reduce(output_tensor, input_tensor, group, op, async_op, self.bound)
