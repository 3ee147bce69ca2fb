"""``AllReduceHook``: compressed HSDP, the inter-node reduction of 1-D FSDP over each node.

HSDP shards inside a node and replicates across nodes. Natively (a 2-D mesh) FSDP2 reduce-scatters
inside the node and then all-reduces every shard in fp32 along the rail (one rank per node, the same
local index), which is nearly all of the bytes on the node link. Here FSDP2 runs 1-D over the
intra-node group and ``FSDPModule.set_all_reduce_hook`` hands this hook the reduce-scatter output;
the hook reduces it along the rail:

- ``compressor=None``: the rail all-reduce in the reduce dtype, exactly native HSDP's (the same
  gradients, bit for bit);
- ``QuantizeCompressor(bits=8 | 4)``: ``compression.quantize``'s two-shot exchange over the rail
  (the one the DDP hook and the reduce-scatter run), every sum in fp32: (1) cut the shard into one
  chunk per node, quantize chunk d for rail peer d (blocks restarting at every parameter),
  exchange, dequantize and sum with the own chunk; (2) requantize that reduced chunk, all-gather
  the codes, and every rank of the rail dequantizes every chunk, its own included (all replicas
  stay identical). With error feedback (default) both roundings are to nearest and their residuals
  are kept per parameter name (worker: the chunks sent; server: the reduced chunk); without, both
  are stochastic (unbiased).
- any other commopt compressor (``FP16Compressor``, ``BF16Compressor``, ``PowerSGDCompressor``,
  ``TopKCompressor``, the sign compressors): ``compression.reduce_tensors(..., algorithm="rail")``
  on every parameter's shard, viewed in its padded shard shape (FSDP2 shards dim 0, so a weight's
  shard is a ``(rows / L, cols)`` matrix, and the rail peers hold the same rows: PowerSGD
  approximates the sum of the same matrix). Error feedback per parameter name where the compressor
  is biased (PowerSGD, top-k, signs), PowerSGD's warm starts likewise; both checkpointed.

The hook averages over the rail (FSDP averaged inside the node), as native HSDP does; a module with
``set_gradient_divide_factor`` sums instead, as native HSDP's all-reduce does then. NaN/Inf follow
the DDP hook's policy: they propagate (a quantized block holding one decodes to NaN everywhere; a
rail holding one reduces exactly) and never poison residuals, or with ``check_finite=True`` every
rank raises ``NonFiniteError``, leaving every residual and warm start as it was before that
backward (the changes of the modules reduced before the one that held the NaN are undone).

The shard FSDP2 hands the hook holds only the parameters that require gradients (frozen ones are
left out of the reduce-scatter): residuals follow that layout, so error feedback stays on for the
trainable parameters of a module that also holds frozen ones. Every phase of one call shares the
call's deadline.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed import ReduceOp

from .. import algorithms
from ..algorithms._transport import deadline_of, remaining, wait_work
from ..algorithms.rail import RAIL
from ..algorithms.roles import FSDP_HSDP, FSDP_HSDP_AG, FSDP_HSDP_RS
from ..compression import Compressor, QuantizeCompressor, auto, reduce_tensors
from ..compression.base import derive_seed
from ..compression.quantize import quantized_all_gather, quantized_reduce_scatter
from ..engine import Phase, wait
from ..errors import TopologyError
from ..topology import Topology
from ._common import Bound, CommBase, Layout, cut_segments

__all__ = ["AllReduceHook"]


class AllReduceHook(CommBase):
    """A ``set_all_reduce_hook`` hook for 1-D FSDP over the intra-node group: compressed HSDP.

    Args:
        compressor: None (exact), or any commopt compressor (see the module docstring).
        topology: the layout of every rank (None: detected once); nodes of equal size.
        error_feedback: keep residuals per parameter name (``QuantizeCompressor``: and round to
            nearest; False: stochastic rounding, nothing kept); other compressors keep them where
            they are biased (PowerSGD, top-k, signs).
        seed: seeds stochastic rounding and random projections, the same on every rank.
        check_finite: raise ``NonFiniteError`` on every rank when any rank's gradients hold NaN/Inf.
        timeout: seconds each transfer may take (None: the group's own).

    Raises:
        TypeError: a compressor that is not a commopt compressor, or a seed that is not an int.
    """

    where = "AllReduceHook"

    def __init__(self, compressor: Compressor | None = None, topology: Topology | None = None, *,
                 error_feedback: bool = True, seed: int = 0, check_finite: bool = False,
                 timeout: float | None = None):
        super().__init__(topology, timeout)
        if compressor is not None and not isinstance(compressor, Compressor):
            raise TypeError(f"{self.where}: compressor must be None or a commopt.comm.compression compressor "
                            f"(QuantizeCompressor, FP16Compressor, PowerSGDCompressor, ...), got "
                            f"{type(compressor).__name__} {compressor!r}")
        if isinstance(seed, bool) or not isinstance(seed, int):
            raise TypeError(f"{self.where}: seed must be an int (the same on every rank), got {seed!r}")
        self.compressor = compressor
        self.quantized = isinstance(compressor, QuantizeCompressor)
        self.error_feedback = bool(error_feedback) and compressor is not None and (
            self.quantized or compressor.biased)
        self.seed = seed
        self.finite_check = bool(check_finite)
        general = compressor is not None and not self.quantized
        # The other compressors' per-run memory: residuals per parameter name (per key, in the comm's
        # one ErrorFeedback), warm starts.
        self.keyed = general and self.error_feedback
        self.compressor_state = compressor.new_state() if general else None

    @property
    def name(self) -> str:
        if self.compressor is None:
            return "exact"
        name = f"int{self.compressor.bits}" if self.quantized else self.compressor.name
        return name + ("+ef" if self.error_feedback else "")

    def rail(self, role: str = FSDP_HSDP):
        topo = self.resolve()
        if not topo.is_uniform:
            raise TopologyError(f"{self.where}: HSDP needs nodes of equal size, got {[len(n) for n in topo.nodes]} "
                                f"({topo.layout}); shard over every rank instead (ReduceScatterComm)", op=self.where)
        return self.groups(role).rail

    def bind(self, bound: Bound):
        self.feedback.layouts[bound.layout.key] = bound.reduced()

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
        deadline = deadline_of(self.timeout)  # the call's: every phase below waits for what is left
        if self.finite_check and self.compressor is not None:
            self.check_finite(t, "hsdp_all_reduce", deadline)
        if nodes == 1:
            return
        group = bound.param_group if bound is not None else None
        average = getattr(group, "gradient_divide_factor", None) is None
        flat = t.detach().view(-1)
        if self.quantized:
            self._quantized(flat, bound, average, deadline)
        elif self.compressor is not None:
            self._compressed(flat, bound, average, deadline)
        else:
            self._exact(flat, average, deadline)

    def _layout(self, bound: Bound | None, size: int, keyed: bool) -> Layout:
        """The layout of the ``size``-element shard FSDP2 handed the hook: the module's parameters
        that require gradients (one segment when unbound; a clear error when residuals are keyed by
        parameter and the shard does not match them)."""
        if bound is not None:
            layout = bound.reduced()
            if layout.chunk == size:
                return layout
            if keyed:
                raise ValueError(f"{self.where}: FSDP module {layout.key or '<root>'!r} handed the hook a shard of "
                                 f"{size} elements but its parameters that require gradients hold {layout.chunk}: "
                                 f"a trainable parameter got no gradient this step; commopt.comm.fsdp.register "
                                 f"turns on set_reduce_scatter_unused_params(True) for error feedback, keep it on")
        return Layout(bound.layout.key if bound is not None else "", ("<shard>",), (size,))

    def _exact(self, flat: torch.Tensor, average: bool, deadline: float | None) -> None:
        """Native HSDP's rail all-reduce, in the reduce dtype."""
        topo = self.resolve()
        rail = self.rail()

        def all_reduce() -> int:
            wait_work(dist.all_reduce(flat, op=ReduceOp.AVG if average else ReduceOp.SUM, group=rail,
                                      async_op=True), self.timeout, deadline=deadline)
            return int(algorithms.ALGORITHM_FACTORS["allreduce"](topo.num_nodes) * flat.numel() * flat.element_size())

        self.run([Phase("all_reduce_rail", all_reduce, rail)], "fsdp/hsdp/exact/inter", flat.device, deadline)
        nbytes = flat.numel() * flat.element_size()
        self.add_link_bytes(("exact", nbytes), lambda: RAIL.traffic("allreduce", nbytes, topo))

    def _compressed(self, flat: torch.Tensor, bound: Bound | None, average: bool, deadline: float | None) -> None:
        """Any other compressor: ``reduce_tensors`` along the rail on every parameter's shard."""
        topo = self.resolve()
        size = flat.numel()
        layout = self._layout(bound, size, self.keyed)
        shapes = layout.shapes or tuple((n,) for n in layout.numels)
        tensors, keys, pos = [], [], 0
        for name, n, shape in zip(layout.names, layout.numels, shapes):
            if n:
                tensors.append(flat[pos: pos + n].view(shape))
                keys.append(name)
            pos += n
        if self.finite_check:
            self.keep(layout.key)
            for kind in ("worker", "server") if self.keyed else ():
                for key in keys:
                    self.journal.keep(self.feedback.residuals[kind], key)
            if self.compressor_state is not None:
                self.journal.keep_state(self.compressor_state)
        step = self.feedback.steps.get(layout.key, 0)
        self.feedback.steps[layout.key] = step + 1
        if not tensors:
            return
        fut = reduce_tensors(self.compressor, tensors, keys, topology=topo, algorithm="rail", average=average,
                             step=step, seed=self.seed, feedback=self.feedback if self.keyed else None,
                             state=self.compressor_state, timeout=remaining(deadline))
        wait(fut, self.timeout, op=f"fsdp/hsdp/{self.name}/inter", deadline=deadline)
        shapes = [tuple(t.shape) for t in tensors]
        numels = [t.numel() for t in tensors]
        self.add_link_bytes(("cmp", self.compressor.active(step), tuple(shapes)),  # worth(): by the shapes
                            lambda: auto.traffic("rail", self.compressor, numels, shapes, 4, topo, step=step))

    def _quantized(self, flat: torch.Tensor, bound: Bound | None, average: bool, deadline: float | None) -> None:
        topo = self.resolve()
        nodes, size = topo.num_nodes, flat.numel()
        ef = self.error_feedback and bound is not None
        layout = self._layout(bound, size, ef)
        self.keep(layout.key)
        if ef:
            # The server residual belongs to this rank's chunk of the shard, which moves when the
            # layout does: it restarts from zero then (the worker residual moves with its columns).
            self.feedback.use(layout, reset=("server",))
        step = self.feedback.steps.get(layout.key, 0)
        self.feedback.steps[layout.key] = step + 1
        chunk = -(-size // nodes)
        padded = torch.zeros(nodes * chunk, dtype=torch.float32, device=flat.device)
        padded[:size] = flat
        rows = list(padded.view(nodes, chunk).unbind(0))
        segs = [cut_segments(layout.numels, d * chunk, (d + 1) * chunk) for d in range(nodes)]
        rs, ag = self.rail(FSDP_HSDP_RS), self.rail(FSDP_HSDP_AG)
        me = dist.get_rank(rs)
        worker = server = None
        if ef:
            # Residuals of the padding past the shard's end stay zero (zeros quantize exactly).
            w = self.feedback.rows(layout, "worker", (), flat.device, width=nodes * chunk)
            s = self.feedback.rows(layout, "server", (), flat.device, width=nodes * chunk)
            worker = list(w.view(nodes, chunk).unbind(0))
            server = s.view(nodes, chunk)[me]
        reduced = torch.empty(chunk, dtype=torch.float32, device=flat.device)
        stochastic = not ef
        codec = self.compressor

        def scatter() -> int:
            return quantized_reduce_scatter(codec, rows, segs, reduced, me, rs, residual=worker,
                                            seed=derive_seed(self.seed, layout.key, "worker"), step=step,
                                            stochastic=stochastic, timeout=remaining(deadline))

        def gather() -> int:
            # Every rank of the rail decodes every reduced chunk, its own included: replicas stay identical.
            return quantized_all_gather(codec, reduced, segs, rows, me, ag, residual=server,
                                        seed=derive_seed(self.seed, layout.key, "server", me), step=step,
                                        stochastic=stochastic, timeout=remaining(deadline))

        bits = codec.bits
        self.run([Phase("reduce_scatter_rail", scatter, rs)], f"fsdp/hsdp/int{bits}/inter", flat.device, deadline)
        self.run([Phase("all_gather_rail", gather, ag)], f"fsdp/hsdp/int{bits}/inter", flat.device, deadline)
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
        sizes = [self.compressor.nbytes(cut_segments(numels, d * chunk, (d + 1) * chunk)) for d in range(nodes)]
        for rail in topo.rails:
            for a_i, a in enumerate(rail):
                for b_i, b in enumerate(rail):
                    t.add(a, b, sizes[b_i] + sizes[a_i])  # a's chunk b (scatter), then a's reduced chunk
        return t

    # ----------------------------------------------------------------------------- state
    def _meta(self) -> dict:
        topo = self.resolve()
        return {"world_size": topo.world_size, "layout": topo.layout, "compressor": self.name,
                "block": self.compressor.block if self.quantized else 0}

    def state_dict(self) -> dict:
        """Residuals per parameter name, step counters and (other compressors) the compressor's
        state, e.g. PowerSGD's warm starts (``torch.load(weights_only=True)`` loads it)."""
        out = self.feedback.module_state_dict(self._meta())
        if self.keyed:
            out["error_feedback"] = self.feedback.state_dict()
        if self.compressor_state is not None:
            out["compressor_state"] = self.compressor_state.state_dict()
        return out

    def load_state_dict(self, state: dict) -> None:
        """Restore :meth:`state_dict`; ``ValueError`` when world size, layout or compressor differ."""
        self.feedback.load_module_state_dict(state, self._meta(), self.where)
        if self.keyed:
            self.feedback.load_state_dict(state.get("error_feedback", {}))
        if self.compressor_state is not None and "compressor_state" in state:
            self.compressor_state.load_state_dict(state["compressor_state"])

    def __repr__(self) -> str:
        return f"AllReduceHook(compressor={self.compressor!r}, error_feedback={self.error_feedback})"
