"""``AllReduceHook``: compressed HSDP, the inter-node reduction of 1-D FSDP over each node.

HSDP shards inside a node and replicates across nodes. Natively (a 2-D mesh) FSDP2 reduce-scatters
inside the node and then all-reduces every shard in fp32 along the rail (one rank per node, the same
local index), which is nearly all of the bytes on the node link. Here FSDP2 runs 1-D over the
intra-node group and ``FSDPModule.set_all_reduce_hook`` hands this hook the reduce-scatter output;
the hook reduces it along the rail:

- ``compressor=None``: the rail all-reduce in the reduce dtype, exactly native HSDP's (the same
  gradients, bit for bit);
- ``FP16Compressor`` / ``BF16Compressor``: the shard, pre-divided by the number of nodes, cast and
  all-reduced, then cast back (half the bytes);
- ``QuantizeCompressor(bits=8 | 4)``: two-shot over the rail, every sum in fp32: (1) cut the shard
  into one chunk per node, quantize chunk d for rail peer d (blocks restarting at every parameter),
  exchange, dequantize and sum with the own chunk; (2) requantize that reduced chunk, all-gather
  the codes, and every rank of the rail dequantizes every chunk, its own included (all replicas
  stay identical). With error feedback (default) both roundings are to nearest and their residuals
  are kept per parameter name (worker: the chunks sent; server: the reduced chunk); without, both
  are stochastic (unbiased).

The hook averages over the rail (FSDP averaged inside the node), as native HSDP does; a module with
``set_gradient_divide_factor`` sums instead, as native HSDP's all-reduce does then. NaN/Inf follow
the DDP hook's policy: they propagate (a quantized block holding one decodes to NaN everywhere) and
never poison residuals, or with ``check_finite=True`` every rank raises ``NonFiniteError``.

Other compressors (PowerSGD, top-k, signs) run only through ``commopt.comm.compression``, whose
exchange creates derived process groups for its rounds; the runtime creates those only for the
topology of every rank, not for a rail (a subgroup), so they are refused at construction.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed import ReduceOp

from .. import algorithms
from ..algorithms._transport import pairwise, wait_work
from ..compression import BF16Compressor, Compressor, FP16Compressor, QuantizeCompressor
from ..engine import Phase
from ..errors import TopologyError
from ..topology import Topology
from ._common import Bound, Codec, CommBase, Layout, cut_segments, finite, quantized_exchange, seed_of

__all__ = ["AllReduceHook"]

_CASTS = {FP16Compressor: torch.float16, BF16Compressor: torch.bfloat16}


class AllReduceHook(CommBase):
    """A ``set_all_reduce_hook`` hook for 1-D FSDP over the intra-node group: compressed HSDP.

    Args:
        compressor: None (exact), ``FP16Compressor``, ``BF16Compressor`` or ``QuantizeCompressor``.
        topology: the layout of every rank (None: detected once); nodes of equal size.
        error_feedback: ``QuantizeCompressor``: residuals per parameter name, round to nearest;
            False: stochastic rounding, nothing kept.
        seed: seeds stochastic rounding, the same on every rank.
        check_finite: raise ``NonFiniteError`` on every rank when any rank's gradients hold NaN/Inf.
        timeout: seconds each transfer may take (None: the group's own).

    Raises:
        TypeError: a compressor that cannot run on the rail (see the module docstring).
    """

    where = "AllReduceHook"

    def __init__(self, compressor: Compressor | None = None, topology: Topology | None = None, *,
                 error_feedback: bool = True, seed: int = 0, check_finite: bool = False,
                 timeout: float | None = None):
        super().__init__(topology, timeout)
        if compressor is not None and not isinstance(compressor, (QuantizeCompressor, *_CASTS)):
            what = type(compressor).__name__ if isinstance(compressor, Compressor) else repr(compressor)
            raise TypeError(
                f"{self.where}: {what} cannot reduce along the rail here: commopt.comm.compression creates "
                f"derived process groups for its rounds, and the runtime creates those only over every rank, "
                f"not over a rail (a subgroup); use QuantizeCompressor(bits=8 or 4), FP16Compressor, "
                f"BF16Compressor or None, or DDP's hook (hooks.AllReduceState) for {what}")
        if isinstance(seed, bool) or not isinstance(seed, int):
            raise TypeError(f"{self.where}: seed must be an int (the same on every rank), got {seed!r}")
        self.compressor = compressor
        self.quantized = isinstance(compressor, QuantizeCompressor)
        self.error_feedback = bool(error_feedback) and self.quantized
        self.seed = seed
        self.finite_check = bool(check_finite)
        self.codec = Codec(compressor.bits, compressor.block) if self.quantized else None

    @property
    def name(self) -> str:
        if self.compressor is None:
            return "exact"
        if self.quantized:
            return f"int{self.compressor.bits}" + ("+ef" if self.error_feedback else "")
        return self.compressor.name

    def rail(self, role: str = "fsdp-hsdp"):
        topo = self.resolve()
        if not topo.is_uniform:
            raise TopologyError(f"{self.where}: HSDP needs nodes of equal size, got {[len(n) for n in topo.nodes]} "
                                f"({topo.layout}); shard over every rank instead (ReduceScatterComm)", op=self.where)
        return self.groups(role).rail

    def bind(self, bound: Bound):
        self.memory.layouts[bound.layout.key] = bound.layout

        def hook(reduce_output: torch.Tensor) -> None:
            self.reduce(reduce_output, bound)

        hook.__qualname__ = f"AllReduceHook[{bound.layout.key or '<root>'}]"
        return hook

    def __call__(self, reduce_output: torch.Tensor) -> None:
        self.reduce(reduce_output, None)

    # ----------------------------------------------------------------------------- reduction
    def reduce(self, t: torch.Tensor, bound: Bound | None) -> None:
        topo = self.resolve()
        nodes = topo.num_nodes
        if self.finite_check and self.compressor is not None:
            self.check_finite(t, "hsdp_all_reduce")
        if nodes == 1:
            return
        group = bound.param_group if bound is not None else None
        average = getattr(group, "gradient_divide_factor", None) is None
        flat = t.detach().view(-1)
        if self.quantized:
            self._quantized(flat, bound, average)
            return
        rail = self.rail()
        dtype = _CASTS.get(type(self.compressor), flat.dtype)
        wire = flat if dtype == flat.dtype else (flat / nodes if average else flat).to(dtype)
        op = ReduceOp.AVG if average and wire is flat else ReduceOp.SUM

        def all_reduce() -> int:
            wait_work(dist.all_reduce(wire, op=op, group=rail, async_op=True), self.timeout)
            return int(algorithms.ALGORITHM_FACTORS["allreduce"](nodes) * wire.numel() * wire.element_size())

        self.run([Phase("all_reduce_rail", all_reduce, rail)], f"fsdp/hsdp/{self.name}/inter", flat.device)
        if wire is not flat:
            flat.copy_(wire)
        self.add_link_bytes(("cast", wire.numel(), wire.element_size()),
                            lambda: algorithms.get("hierarchical").traffic(
                                "allreduce", wire.numel() * wire.element_size() * topo.local_size, topo,
                                itemsize=wire.element_size()))

    def _quantized(self, flat: torch.Tensor, bound: Bound | None, average: bool) -> None:
        topo = self.resolve()
        nodes, size = topo.num_nodes, flat.numel()
        layout = bound.layout if bound is not None and bound.layout.chunk == size else Layout("", ("<shard>",), (size,))
        ef = self.error_feedback and bound is not None and bound.layout.chunk == size
        step = self.memory.steps.get(layout.key, 0)
        self.memory.steps[layout.key] = step + 1
        chunk = -(-size // nodes)
        padded = torch.zeros(nodes * chunk, dtype=torch.float32, device=flat.device)
        padded[:size] = flat
        rows = list(padded.view(nodes, chunk).unbind(0))
        segs = [cut_segments(layout.numels, d * chunk, (d + 1) * chunk) for d in range(nodes)]
        rs, ag = self.rail("fsdp-hsdp-rs"), self.rail("fsdp-hsdp-ag")
        me = dist.get_rank(rs)
        worker = server = None
        if ef:
            # Residuals of the padding past the shard's end stay zero (zeros quantize exactly).
            w = self.memory.get(layout, "worker", (), flat.device, width=nodes * chunk)
            s = self.memory.get(layout, "server", (), flat.device, width=nodes * chunk)
            worker = list(w.view(nodes, chunk).unbind(0))
            server = s.view(nodes, chunk)[me]
        reduced = torch.empty(chunk, dtype=torch.float32, device=flat.device)
        stochastic = not ef
        codec = self.codec

        def scatter() -> int:
            return quantized_exchange(codec, rows, segs, reduced, me, rs, residual=worker,
                                      seed=(self.seed, layout.key, "worker"), step=step, stochastic=stochastic,
                                      timeout=self.timeout)

        payloads = [torch.empty(codec.nbytes(segs[d]), dtype=torch.uint8, device=flat.device) for d in range(nodes)]

        def gather() -> int:
            x = reduced if server is None else reduced + server
            codec.encode(x, segs[me], payloads[me], seed=seed_of(self.seed, layout.key, "server", me), step=step,
                         stochastic=stochastic)
            if server is not None and finite(x):
                decoded = torch.empty_like(x)
                codec.decode(payloads[me], segs[me], decoded)
                torch.sub(x, decoded, out=server)
            return pairwise(ag, self.timeout, [None if d == me else payloads[me] for d in range(nodes)],
                            [None if d == me else payloads[d] for d in range(nodes)])

        bits = self.compressor.bits
        self.run([Phase("reduce_scatter_rail", scatter, rs)], f"fsdp/hsdp/int{bits}/inter", flat.device)
        self.run([Phase("all_gather_rail", gather, ag)], f"fsdp/hsdp/int{bits}/inter", flat.device)
        for d in range(nodes):
            codec.decode(payloads[d], segs[d], rows[d])
        if average:
            padded.div_(nodes)
        flat.copy_(padded[:size])
        self.add_link_bytes(("q", size, layout.numels), lambda: self.traffic(size, layout.numels))

    # ----------------------------------------------------------------------------- model
    def traffic(self, numel: int, numels: tuple[int, ...] | None = None) -> algorithms.Traffic:
        """What one quantized call moves on every rail, for a shard of ``numel`` elements laid out by
        the parameter sizes ``numels`` (None: one parameter); what the engine counts on each rank."""
        topo = self.resolve()
        nodes = topo.num_nodes
        chunk = -(-numel // nodes)
        numels = tuple(numels) if numels is not None else (numel,)
        t = algorithms.Traffic(topo)
        sizes = [self.codec.nbytes(cut_segments(numels, d * chunk, (d + 1) * chunk)) for d in range(nodes)]
        for j in range(topo.local_size):
            rail = sorted(node[j] for node in topo.nodes)
            for a_i, a in enumerate(rail):
                for b_i, b in enumerate(rail):
                    t.add(a, b, sizes[b_i] + sizes[a_i])  # a's chunk b (scatter), then a's reduced chunk
        return t

    # ----------------------------------------------------------------------------- state
    def _meta(self) -> dict:
        topo = self.resolve()
        return {"world_size": topo.world_size, "layout": topo.layout, "compressor": self.name,
                "block": getattr(self.compressor, "block", 0)}

    def state_dict(self) -> dict:
        """Residuals per parameter name and step counters (``torch.load(weights_only=True)`` loads it)."""
        return self.memory.state_dict(self._meta())

    def load_state_dict(self, state: dict) -> None:
        """Restore :meth:`state_dict`; ``ValueError`` when world size, layout or compressor differ."""
        self.memory.load_state_dict(state, self._meta(), self.where)

    def __repr__(self) -> str:
        return f"AllReduceHook(compressor={self.compressor!r}, error_feedback={self.error_feedback})"
