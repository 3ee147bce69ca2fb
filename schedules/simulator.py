"""A discrete-event model of data-parallel training iterations, and the traffic matrix
(docs/architecture.md section 5.8).

The model (the quantities ASTRA-sim reports): per-layer forward and backward compute times and
gradient sizes (measured from a model on this machine with :func:`layers_from_model`, or derived
from a transformer configuration with :func:`transformer_layers`), buckets built exactly as
``OverlapDataParallel`` builds them, chunks served first come first served by one link whose time
per chunk comes from ``commopt.comm.cost.predict`` for the chosen algorithm and topology, and a
schedule:

- ``none``: backward, then every bucket's reduction, then the optimizer; no overlap;
- ``ddp``: buckets issued in ready order as backward produces them; the optimizer step and the next
  forward wait for the last bucket (DDP);
- ``fifo``: as ``ddp``, but each layer of the next forward waits only for its own bucket, and then
  steps the optimizer of that bucket and of every other bucket reduced by then, on the compute lane
  (``OverlapDataParallel(plan="fifo")``, whose training thread does so);
- ``priority``: as ``fifo`` with the ByteScheduler plan: partitioned chunks, the next forward's
  order of need, a credit (``OverlapDataParallel(plan="priority")``).

Optionally with compression: a ratio applied to the bytes on the wire and a compute cost per
gradient byte; and with contention: compute runs ``overlap_slowdown`` times slower while the link is
busy (communication driven by the CPU that computes, as gloo is; on GPUs, collective kernels that
take SMs and memory bandwidth). Several iterations are simulated back to back (the next forward
overlaps the previous reduction); the reported iteration time is the steady-state period.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Callable

import torch
from torch import nn

from commopt.comm import algorithms, cost
from commopt.comm.topology import Topology

from ._sim_pipeline import PipelineCodec, PipelineResult, pipeline_codec, simulate_pipeline, simulate_pipeline_dp
from ._tp_choice import chunk_count, ring_seconds
from .plan import BucketPlan, build_buckets, partition
from .priority import fifo_plan, priority_plan, shape_priority, simulate_issue

__all__ = ["Layer", "Schedule", "SimResult", "simulate", "transformer_layers", "layers_from_model",
           "TRANSFORMERS", "traffic_matrix", "iteration_traffic", "SCHEDULES", "link_service", "ShardedPlan",
           "SHARDED_KINDS", "simulate_sharded", "quantized_ratio", "TPResult", "simulate_tensor_parallel",
           "DiLoCoResult", "simulate_diloco", "PipelineCodec", "PipelineResult", "pipeline_codec", "simulate_pipeline",
           "simulate_pipeline_dp"]

_MB = 1024 * 1024
SCHEDULES = ("none", "ddp", "fifo", "priority")


@dataclass(frozen=True)
class Layer:
    """One layer: forward and backward seconds, and the bytes of its gradients."""

    name: str
    forward: float
    backward: float
    grad_bytes: int


@dataclass(frozen=True)
class Schedule:
    """How an iteration communicates (see the module docstring for the kinds).

    Attributes:
        kind: "none", "ddp", "fifo" or "priority".
        bucket_cap_mb, first_bucket_cap_mb: bucket caps, as ``OverlapDataParallel``.
        partition_mb: chunk size of the priority plan (0: whole buckets).
        credit_mb: most MiB in flight for the priority plan (0: unbounded).
        compression_ratio: wire bytes / gradient bytes (1: uncompressed).
        compress_seconds_per_byte: compute cost of compressing and decompressing, per gradient byte.
        optimizer_seconds_per_byte: optimizer step cost per gradient byte.
        overlap_slowdown: compute takes this many times longer while the link is busy (>= 1; measure
            it as compute time with a concurrent reduction over compute time alone).
    """

    kind: str = "priority"
    bucket_cap_mb: float = 25.0
    first_bucket_cap_mb: float = 1.0
    partition_mb: float = 1.0
    credit_mb: float = 4.0
    compression_ratio: float = 1.0
    compress_seconds_per_byte: float = 0.0
    optimizer_seconds_per_byte: float = 0.0
    overlap_slowdown: float = 1.0

    def __post_init__(self) -> None:
        if self.kind not in SCHEDULES:
            raise ValueError(f"schedule kind {self.kind!r}: choose one of {SCHEDULES}")
        if not 0 < self.compression_ratio <= 1:
            raise ValueError(f"compression_ratio must be in (0, 1], got {self.compression_ratio}")
        if not self.overlap_slowdown >= 1.0:
            raise ValueError(f"overlap_slowdown must be >= 1 (a slowdown), got {self.overlap_slowdown}")


@dataclass
class SimResult:
    """The steady-state iteration and its timeline.

    Attributes:
        iteration: seconds between the starts of the last two simulated iterations.
        compute: forward + backward seconds of one iteration.
        communication: link-busy seconds of one iteration's reduction.
        exposed: ``iteration - compute``: communication (and waiting) not hidden.
        timeline: (lane, label, start, end) of the last two iterations, for plotting.
    """

    iteration: float
    compute: float
    communication: float
    exposed: float
    schedule: Schedule | ShardedPlan
    timeline: list[tuple[str, str, float, float]] = field(default_factory=list)

    @property
    def overlap(self) -> float:
        """Fraction of communication hidden behind compute (1 when fully hidden)."""
        if self.communication <= 0:
            return 1.0
        return max(0.0, min(1.0, 1.0 - self.exposed / self.communication))


def link_service(algorithm: str, topology: Topology, model: cost.CostModel | None = None,
                 ratio: float = 1.0) -> Callable[[int], float]:
    """Seconds to all-reduce a chunk of ``n`` bytes (``ratio`` of them on the wire)."""

    def service(n: int) -> float:
        return cost.predict(algorithm, n * ratio, topology, model) if n else 0.0

    return service


def _buckets(layers: Sequence[Layer], sched: Schedule) -> BucketPlan:
    # One "parameter" per layer, counted in bytes: bucket boundaries fall where the model's would
    # (the model's buckets hold whole parameters of one layer or several).
    shapes = [(max(1, layer.grad_bytes), torch.uint8) for layer in layers]
    return build_buckets(shapes, cap_bytes=sched.bucket_cap_mb * _MB, first_cap_bytes=sched.first_bucket_cap_mb * _MB,
                         align=1)


def _compute_end(t: float, work: float, busy: Sequence[tuple[float, float]], slowdown: float) -> float:
    """When ``work`` seconds of compute started at ``t`` end, at ``1 / slowdown`` speed inside ``busy``.

    ``busy``: disjoint link-busy intervals, sorted.
    """
    if slowdown == 1.0 or work <= 0.0:
        return t + work
    for start, end in busy:
        if end <= t:
            continue
        if start > t:  # full speed until the link turns busy
            if t + work <= start:
                return t + work
            work -= start - t
            t = start
        span = (end - t) / slowdown  # work done by the end of this busy interval
        if work <= span:
            return t + work * slowdown
        work -= span
        t = end
    return t + work


def _merge(intervals: Sequence[tuple[float, float]]) -> list[tuple[float, float]]:
    out: list[tuple[float, float]] = []
    for start, end in sorted(intervals):
        if out and start <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], end))
        elif end > start:
            out.append((start, end))
    return out


def simulate(layers: Sequence[Layer], service: Callable[[int], float], schedule: Schedule | None = None, *,
             iterations: int = 4) -> SimResult:
    """Simulate ``iterations`` back-to-back iterations; report the last period.

    Args:
        layers: the model, first layer first.
        service: seconds the link needs per chunk of so many (gradient) bytes, e.g.
            :func:`link_service`; the schedule's compression ratio is applied by the caller's
            ``service`` (see :func:`link_service`'s ``ratio``).
        schedule: the schedule (default: priority).
        iterations: at least 2; the period between the last two iteration starts is reported.
    """
    sched = schedule or Schedule()
    if iterations < 2:
        raise ValueError(f"iterations must be >= 2, got {iterations}")
    plan = _buckets(layers, sched)
    bucket_of = plan.bucket_of()
    nb = len(plan.buckets)
    fwd = [layer.forward for layer in layers]
    bwd = [layer.backward for layer in layers]
    compute = sum(fwd) + sum(bwd)
    overlapped = sched.kind in ("fifo", "priority")
    part = int(sched.partition_mb * _MB) if sched.kind == "priority" else 0
    credit = int(sched.credit_mb * _MB) if sched.kind == "priority" else 0
    pieces = partition(plan, part)
    opt = [b.nbytes * sched.optimizer_seconds_per_byte for b in plan.buckets]
    squeeze = [b.nbytes * sched.compress_seconds_per_byte for b in plan.buckets]
    comm = sum(service(c.nbytes) for chunks in pieces for c in chunks)

    slow = sched.overlap_slowdown
    pending: set[int] = set()  # overlapped schedules: the buckets whose update the forward steps
    reduced = [0.0] * nb  # when each bucket's previous reduction was done
    t = 0.0
    link_free = 0.0
    busy: list[tuple[float, float]] = []  # the link's busy intervals so far
    starts: list[float] = []
    timeline: list[tuple[str, str, float, float]] = []
    issue = None
    for _ in range(iterations):
        starts.append(t)
        # Forward: layer l waits for its bucket's previous reduction, then steps the optimizer of
        # that bucket and of every other one reduced by then (overlapped schedules only; the
        # others stepped everything before this iteration started).
        for i in range(len(layers)):
            if bucket_of[i] in pending:
                t = max(t, reduced[bucket_of[i]])
                for b in sorted((b for b in pending if reduced[b] <= t), key=lambda b: (reduced[b], b)):
                    end = _compute_end(t, opt[b], busy, slow)
                    if end > t:
                        timeline.append(("compute", f"O{b}", t, end))
                    t = end
                    pending.discard(b)
            end = _compute_end(t, fwd[i], busy, slow)
            timeline.append(("compute", f"F{i}", t, end))
            t = end
        forward_end = t
        # Backward and this iteration's reduction slow each other down only through contention:
        # iterate to the fixed point (one pass without contention).
        own: list[tuple[float, float]] = []
        for _ in range(1 if slow == 1.0 else 20):
            t, ready, segments = forward_end, [0.0] * nb, []
            both = _merge([*busy, *own])
            for i in reversed(range(len(layers))):
                end = _compute_end(t, bwd[i], both if sched.kind != "none" else busy, slow)
                segments.append(("compute", f"B{i}", t, end))
                t = end
                b = bucket_of[i]
                ready[b] = max(ready[b], t)
            backward_end = t
            if sched.kind == "none":
                ready = [backward_end] * nb
            ready = [r + s for r, s in zip(ready, squeeze)]
            if issue is None:
                rel = [r - forward_end for r in ready]
                if sched.kind == "priority":
                    issue = priority_plan(plan, ready_times=rel, service=service, partition_bytes=part,
                                          credit=credit, priority=shape_priority(plan, list(range(len(layers)))))
                else:
                    issue = fifo_plan(plan, ready_times=rel, partition_bytes=part, credit=credit)
            tl = simulate_issue(pieces, ready, service, credit=credit, order=list(issue.chunks), link_free=link_free)
            new_own = _merge(zip(tl.started, tl.finished))
            if new_own == own:
                break
            own = new_own
        timeline += segments
        busy = _merge([*busy, *own])
        link_free = max([link_free, *tl.finished])
        for c, s, e in zip(tl.chunks, tl.started, tl.finished):
            timeline.append(("link", f"b{c.bucket}", s, e))
        done = tl.bucket_done()
        if overlapped:
            # Stepped by the next forward as it needs them (every bucket holds some layer's gradients).
            reduced = [done[b] for b in range(nb)]
            pending = set(range(nb))
            t = backward_end
        else:
            t = max(backward_end, max(done.values(), default=backward_end)) + sum(opt)
    period = starts[-1] - starts[-2]
    keep_from = starts[-2]
    timeline = [(lane, label, s - keep_from, e - keep_from) for lane, label, s, e in timeline if e > keep_from]
    return SimResult(period, compute, comm, period - compute, sched, timeline)


# ------------------------------------------------------------------------------------- sharded
SHARDED_KINDS = ("fsdp", "hsdp")


@dataclass(frozen=True)
class ShardedPlan:
    """How a sharded iteration communicates (FSDP2 ``fully_shard`` per layer).

    Attributes:
        kind: "fsdp" shards every layer over all ranks (ZeRO-3); "hsdp" shards inside a node and
            replicates across nodes (the shard's gradient is all-reduced along the rail).
        algorithm: the all-gather / reduce-scatter algorithm of "fsdp" ("flat", "hierarchical").
        reshard_after_forward: all-gather the parameters again before backward (ZeRO-3); False
            keeps them from forward to backward.
        hpz: the backward all-gather reads a secondary shard inside the node (ZeRO++ hpZ,
            ``reshard_after_forward=L``): it never crosses a node link.
        weight_ratio: wire bytes / parameter bytes of every all-gather that crosses nodes (qwZ int8
            with 256-element blocks: (1 + 4/256) / 4).
        grad_ratio: wire bytes / gradient bytes of the gradient reduction (qgZ int4: (0.5 + 4/256)
            / 4; compressed HSDP: the compressor's ratio on the inter-node all-reduce).
        prefetch: the next layer's all-gather is issued before the current layer's compute (GPU
            streams run ahead of compute); False: issued when the layer is reached (gloo on CPU).
        optimizer_seconds_per_byte: optimizer cost per byte of this rank's shard.
        codec_seconds_per_byte: the encode and decode of a compressed collective, per fp32 byte it
            compresses (weights of a quantized all-gather, gradients of a compressed reduction),
            charged to the collective (its worker encodes, sends and decodes in turn).
        grad_codec_seconds_per_byte: the same for the gradient reduction where its codec differs
            from the weights' (ZeRO++: int4 with error feedback beside int8); None: the one above.
        reduce_scatter_as: the collective the backend runs for a reduce-scatter: "allreduce" for
            torch's own on gloo (an all-reduce of the whole buffer, then a copy: twice the bytes).
        blocking_reduce: backward waits for each layer's gradient reduction before it goes on
            (FSDP2 without streams, on CPU: the reduce-scatter, and HSDP's all-reduce hook, return
            only once done); False: the reduction runs behind the next layer's backward (GPUs).
        prefetch_issue_seconds: with ``prefetch``, when a prefetched all-gather is issued. None:
            at once (GPU: the CPU runs ahead of the streams, so the link serves it right after the
            current one). A number: FSDP2 issues it on the training thread only once the current
            layer's all-gather has completed and been copied out, that many seconds after (the
            copy-out, FSDP2's hooks and the next copy-in; on CPU), while the link idles: 1.9-2.2 ms
            a gather for the GPT of ``commopt-bench fsdp`` on the emulated 2x2, which the model
            without it served back to back (docs/results.md 25).
    """

    kind: str = "fsdp"
    algorithm: str = "flat"
    reshard_after_forward: bool = True
    hpz: bool = False
    weight_ratio: float = 1.0
    grad_ratio: float = 1.0
    prefetch: bool = True
    optimizer_seconds_per_byte: float = 0.0
    codec_seconds_per_byte: float = 0.0
    grad_codec_seconds_per_byte: float | None = None
    reduce_scatter_as: str = "reduce_scatter"
    blocking_reduce: bool = False
    prefetch_issue_seconds: float | None = None

    def __post_init__(self) -> None:
        if self.kind not in SHARDED_KINDS:
            raise ValueError(f"sharded plan kind {self.kind!r}: choose one of {SHARDED_KINDS}")
        if self.reduce_scatter_as not in ("reduce_scatter", "allreduce"):
            raise ValueError(f"reduce_scatter_as must be 'reduce_scatter' or 'allreduce', "
                             f"got {self.reduce_scatter_as!r}")
        for name in ("weight_ratio", "grad_ratio"):
            if not 0 < getattr(self, name) <= 1:
                raise ValueError(f"{name} must be in (0, 1], got {getattr(self, name)}")
        for name in ("codec_seconds_per_byte", "grad_codec_seconds_per_byte"):
            value = getattr(self, name)
            if value is not None and not value >= 0:
                raise ValueError(f"{name} must be a cost >= 0 seconds per byte, got {value}")
        gap = self.prefetch_issue_seconds
        if gap is not None and not 0 <= gap < math.inf:
            raise ValueError(f"prefetch_issue_seconds must be None (issued at once) or seconds >= 0, got {gap}")


def quantized_ratio(bits: int, block: int = 256, element_bytes: float = 4) -> float:
    """Wire bytes over data bytes of a block-quantized payload (``QuantizeCompressor(bits, block)``:
    ``bits`` per element plus one fp32 scale per ``block``) for elements of ``element_bytes``."""
    return min(1.0, (bits / 8 + 4 / block) / element_bytes)


def _sharded_times(plan: ShardedPlan, topology: Topology, model: cost.CostModel,
                   lines: dict[str, dict[str, cost.LinkModel]] | None = None):
    """(all-gather before forward, all-gather before backward, gradient reduction) seconds of a layer
    of ``n`` bytes, from the algorithm objects' cost, or from the plan algorithm's measured line of
    that collective on this layout where ``lines`` has one (``cost.calibrate(collectives=...)``)."""
    local, nodes = topology.local_size, topology.num_nodes
    node = Topology(nodes=(tuple(range(local)),), rank=0, world_size=local)
    rail = Topology(nodes=tuple((i,) for i in range(nodes)), rank=0, world_size=nodes)
    flat = algorithms.get("flat")
    codec = plan.codec_seconds_per_byte
    weight_codec = codec if plan.weight_ratio < 1 else 0.0
    grad = codec if plan.grad_codec_seconds_per_byte is None else plan.grad_codec_seconds_per_byte
    grad_codec = grad if plan.grad_ratio < 1 else 0.0
    if plan.kind == "hsdp":
        def gather(n: float) -> float:
            return flat.cost(model, "all_gather", n, node)

        def reduce(n: float) -> float:
            # Every rail all-reduces its 1/local shard at once over the same node link: the link
            # carries the node's n bytes, as one rail of n would.
            return (flat.cost(model, plan.reduce_scatter_as, n, node)
                    + flat.cost(model, "allreduce", n * plan.grad_ratio, rail) + n / local * grad_codec)

        return gather, gather, reduce
    algo = algorithms.get(plan.algorithm)
    reason = algo.supports(topology, "reduce_scatter")
    if reason is not None:
        raise ValueError(f"simulate_sharded: {reason}")

    def timed(collective: str, n: float) -> float:
        line = (lines or {}).get(collective, {}).get(plan.algorithm)
        return line.time(n) if line is not None else algo.cost(model, collective, n, topology)

    def forward_gather(n: float) -> float:
        return timed("all_gather", n * plan.weight_ratio) + n * weight_codec

    def backward_gather(n: float) -> float:
        # hpZ: the secondary shard holds the layer inside the node, sharded L ways.
        return flat.cost(model, "all_gather", n, node) if plan.hpz else forward_gather(n)

    def reduce(n: float) -> float:
        if plan.reduce_scatter_as == "allreduce":  # the whole buffer all-reduced: n bytes per rank
            return timed("allreduce", n * plan.grad_ratio) + n * grad_codec
        return timed("reduce_scatter", n * plan.grad_ratio) + n * grad_codec

    return forward_gather, backward_gather, reduce


def simulate_sharded(layers: Sequence[Layer], topology: Topology, plan: ShardedPlan | None = None,
                     model: cost.CostModel | None = None,
                     collectives: tuple[Callable[[float], float], ...] | None = None,
                     lines: dict[str, dict[str, cost.LinkModel]] | None = None) -> SimResult:
    """One iteration of sharded data parallel: every layer an FSDP unit whose parameters are
    all-gathered before its forward (and again before its backward when resharded), and whose
    gradients are reduce-scattered (HSDP: reduce-scattered inside the node, then all-reduced along
    the rail) right after its backward. Collectives are served first come first served by one link,
    in issue order; compute waits for its layer's all-gather. ``grad_bytes`` of a layer is taken as
    its parameter bytes too (one dtype for both).

    ``collectives``: measured seconds of (the forward all-gather, the backward all-gather, the
    gradient reduction) of a layer of ``n`` bytes, in place of the cost model's (``model`` and the
    plan's ratios then go unused): the schedule alone is then what is modelled.

    ``lines``: collective -> algorithm -> the effective ``alpha + S * beta`` line measured for that
    algorithm's calls on this layout (``cost.measured_lines`` after ``cost.calibrate(topology,
    collectives=(...))``): where the plan's algorithm has one, it replaces the level model's cost of
    that collective (the per-call CPU work of commopt's phases is in the line, not in the levels).
    A :class:`~commopt.comm.links.MeasuredLine` (what calibration keeps) gives the measured times
    between two measured sizes: on the emulated 2x2 the line through three sizes put a block's
    hierarchical reduce-scatter and all-gather at 64 ms, the points at 71 ms (measured alone: 69-72
    ms), and the prediction of the hierarchical run rose from 0.81 to 0.89 of the measured step
    (docs/results.md 25).
    """
    plan = plan or ShardedPlan()
    model = model or cost.CostModel(cost.DEFAULT_INTRA, cost.DEFAULT_INTER)
    forward_gather, backward_gather, reduce = collectives or _sharded_times(plan, topology, model, lines)
    sizes = [layer.grad_bytes for layer in layers]
    link_free = 0.0
    timeline: list[tuple[str, str, float, float]] = []
    comm = 0.0

    def issue(label: str, at: float, seconds: float) -> float:
        nonlocal link_free, comm
        start = max(at, link_free)
        link_free = start + seconds
        comm += seconds
        if seconds:
            timeline.append(("link", label, start, link_free))
        return link_free

    def run(lane_label: str, at: float, seconds: float) -> float:
        timeline.append(("compute", lane_label, at, at + seconds))
        return at + seconds

    t = 0.0
    n = len(layers)
    # When the training thread issues a prefetch: once the current layer's all-gather is done (plus
    # the plan's CPU gap), or, without a gap, at once (served after the current one either way).
    gap = plan.prefetch_issue_seconds
    gathered = {0: issue("g0", 0.0, forward_gather(sizes[0]))} if n else {}
    for i, layer in enumerate(layers):
        if plan.prefetch and i + 1 < n:
            at = t if gap is None else max(t, gathered[i]) + gap
            gathered[i + 1] = issue(f"g{i + 1}", at, forward_gather(sizes[i + 1]))
        t = max(t, gathered[i])
        t = run(f"F{i}", t, layer.forward)
        if not plan.prefetch and i + 1 < n:
            gathered[i + 1] = issue(f"g{i + 1}", t, forward_gather(sizes[i + 1]))
    regather = plan.reshard_after_forward
    # The last layer's parameters are still gathered when backward starts (FSDP2 keeps them).
    ready = {n - 1: t} if regather and n else {}
    last = t
    for i in reversed(range(n)):
        if regather:
            if i not in ready:  # not prefetched: issued when backward reaches the layer
                ready[i] = issue(f"g{i}", t, backward_gather(sizes[i]))
            t = max(t, ready[i])
            if plan.prefetch and i >= 1:  # FSDP2's backward prefetch: the next layer's, one ahead
                ready[i - 1] = issue(f"g{i - 1}", t + (gap or 0.0), backward_gather(sizes[i - 1]))
        t = run(f"B{i}", t, layers[i].backward)
        last = issue(f"r{i}", t, reduce(sizes[i]))
        if plan.blocking_reduce:
            t = last
    shard = sum(sizes) / (topology.local_size if plan.kind == "hsdp" else topology.world_size)
    end = max(t, last)
    end = run("O", end, shard * plan.optimizer_seconds_per_byte) if plan.optimizer_seconds_per_byte else end
    compute = sum(x.forward + x.backward for x in layers)
    return SimResult(end, compute, comm, end - compute, plan, timeline)


# ------------------------------------------------------------------------------------- DiLoCo
@dataclass(frozen=True)
class DiLoCoResult:
    """DiLoCo's average inner step (``schedules.DiLoCo``, docs/guide.md "DiLoCo").

    Attributes:
        step: seconds per inner step, the outer syncs' exposed time spread over the steps between them.
        inner: seconds of one inner step: the worker's own data-parallel training inside its node.
        sync: seconds of one fragment's outer all-reduce along the rails.
        exposed: seconds per inner step the outer syncs add (``step - inner``).
        link_bytes_per_step: bytes per inner step each node's link carries (one direction), averaged.
    """

    step: float
    inner: float
    sync: float
    exposed: float
    link_bytes_per_step: float


def simulate_diloco(layers: Sequence[Layer], topology: Topology, model: cost.CostModel | None = None, *,
                    sync_every: int, fragments: int = 1, delay: int = 0, ratio: float = 1.0,
                    schedule: Schedule | None = None, pseudo_bytes_per_param_byte: float = 1.0) -> DiLoCoResult:
    """DiLoCo on ``topology``: each node is a worker whose ranks train with DDP among themselves
    (``schedule``, default DDP's, over the intra-node link: the node as a one-level topology); every
    ``sync_every`` inner steps each of ``fragments`` equal fragments of the model is all-reduced along
    the rails (each rank its 1/L slice; the node's L rails share its link, which so carries the
    fragment once), ``ratio`` of its bytes on the wire (a codec), overlapped with ``delay`` inner
    steps: a fragment's sync hides behind ``delay`` inner steps and the rest is exposed.

    Args:
        layers: the model (gradient bytes per layer: the pseudo-gradient's, times
            ``pseudo_bytes_per_param_byte`` when it is reduced in another dtype, e.g. 2 for fp32 of bf16).
        topology: nodes x ranks (equal nodes).
        model: the level model (intra-node link for the inner loop, node link for the outer sync).
        sync_every: inner steps between two syncs of a fragment (H).
        fragments: fragments synced at staggered steps (1: plain DiLoCo).
        delay: inner steps a fragment's reduction overlaps before its update is applied.
        ratio: wire bytes / pseudo-gradient bytes (1: fp32 as it is).
    """
    if sync_every < 1 or fragments < 1 or delay < 0 or delay >= sync_every:
        raise ValueError(f"simulate_diloco: need sync_every >= 1, fragments >= 1 and 0 <= delay < sync_every, got "
                         f"sync_every={sync_every}, fragments={fragments}, delay={delay}")
    model = model or cost.CostModel(cost.DEFAULT_INTRA, cost.DEFAULT_INTER)
    local, nodes = topology.local_size, topology.num_nodes
    node = Topology(nodes=(tuple(range(local)),), rank=0, world_size=local)
    rail = Topology(nodes=tuple((i,) for i in range(nodes)), rank=0, world_size=nodes)
    inner_model = cost.CostModel(model.intra, model.intra, model.chunks, model.shared)
    # One rank per node: nothing to reduce inside the worker (the schedule's optimizer cost still counts).
    service = link_service("flat", node, inner_model) if local > 1 else (lambda n: 0.0)
    inner = simulate(layers, service, schedule or Schedule("ddp")).iteration
    fragment = sum(x.grad_bytes for x in layers) * pseudo_bytes_per_param_byte / fragments
    flat = algorithms.get("flat")
    sync = flat.cost(model, "allreduce", fragment * ratio, rail) if nodes > 1 else 0.0
    exposed = fragments * max(0.0, sync - delay * inner) / sync_every
    link = flat.link_bytes("allreduce", fragment * ratio, rail) * fragments / sync_every if nodes > 1 else 0.0
    return DiLoCoResult(inner + exposed, inner, sync, exposed, link)


# ------------------------------------------------------------------------------------- workloads
@dataclass(frozen=True)
class TransformerConfig:
    """A GPT-style decoder: ``n_layer`` blocks of width ``d_model``, vocabulary ``vocab``."""

    n_layer: int
    d_model: int
    vocab: int = 50257
    seq: int = 2048


TRANSFORMERS: dict[str, TransformerConfig] = {
    "gpt2-124m": TransformerConfig(12, 768, seq=1024),
    "gpt-350m": TransformerConfig(24, 1024),
    "gpt-1.3b": TransformerConfig(24, 2048),
    "gpt-6.7b": TransformerConfig(32, 4096),
    "gpt-13b": TransformerConfig(40, 5120),
}


def transformer_layers(config: TransformerConfig | str, *, tokens: int, flops: float,
                       grad_bytes_per_param: int = 2) -> list[Layer]:
    """Layers of a GPT-style model: embedding, ``n_layer`` blocks, head (tied, so no gradient of its own).

    Compute per block and token: ``2 * 12 d^2`` FLOPs for the matrices plus ``4 * seq * d`` for
    attention scores (forward); backward twice the forward. ``flops`` is the sustained rate of one
    rank (peak times achieved utilisation).

    Args:
        config: a :class:`TransformerConfig` or a name in :data:`TRANSFORMERS`.
        tokens: tokens per rank per iteration (micro-batch x sequence length).
        flops: sustained FLOP/s of one rank.
        grad_bytes_per_param: 2 for bf16/fp16 gradients, 4 for fp32.
    """
    cfg = TRANSFORMERS[config] if isinstance(config, str) else config
    d = cfg.d_model
    block_params = 12 * d * d + 13 * d
    block_flops = tokens * (2 * (12 * d * d) + 4 * cfg.seq * d)
    emb_params = cfg.vocab * d + cfg.seq * d
    head_flops = 2 * tokens * cfg.vocab * d
    # The head is tied to the embedding: its compute is charged to the embedding layer, whose gradient
    # is complete only at the very end of backward (after the lookup's backward).
    layers = [Layer("embedding", head_flops / flops, 2 * head_flops / flops, emb_params * grad_bytes_per_param)]
    for i in range(cfg.n_layer):
        layers.append(Layer(f"block{i}", block_flops / flops, 2 * block_flops / flops,
                            block_params * grad_bytes_per_param))
    return layers


@dataclass(frozen=True)
class TPResult:
    """One transformer block's forward + backward on one rank of a tensor + sequence parallel group.

    Attributes:
        step: seconds of the block's forward + backward.
        compute: seconds of its computation alone (1/tp of the block's matrices, its attention heads).
        communication: seconds of its eight collectives alone (two all-gathers and two reduce-scatters
            of the activations forward, the mirrored four backward), one after another.
        exposed: ``step - compute``: the communication nothing hides.
    """

    step: float
    compute: float
    communication: float
    exposed: float


def simulate_tensor_parallel(config: TransformerConfig | str, *, tp: int, tokens: int, flops: float,
                             link: cost.LinkModel, decomposed: bool, activation_bytes: int = 2,
                             ffn: int | None = None, chunks: int | None = None) -> TPResult:
    """One block of ``config`` under tensor + sequence parallelism over ``tp`` ranks joined by ``link``
    (Megatron's layout, docs/guide.md "Tensor parallelism"): all-gather the sequence-sharded
    activations into QKV (3 d^2) and FC1 (d ffn), reduce-scatter out of OUT (d^2) and FC2 (d ffn);
    backward the mirror image (the gradient all-gathered into FC2's and OUT's input gradients,
    reduce-scattered out of FC1's and QKV's), each weight gradient a local matmul.

    Unfused (torch's plan): every collective runs alone, then its matmul: ``compute + 8 collectives``.
    ``decomposed`` (commopt's styles): each collective is a ring of ``tp - 1`` point-to-point steps of
    one block of ``tokens / tp`` rows, each block cut into ``chunks`` (``schedules.tensor_parallel``):
    the chunks cross the link back to back, and each chunk's slice of the matmul runs once the chunk
    is in and the slice before it is done (the reduce-scatter ring modelled as its mirror image).
    With one chunk the pair takes one slice plus ``tp - 1`` times the longer of a slice and a step.
    The backward rings of QKV and FC1 compute their weight gradients as their last step begins,
    behind the transfers still in flight; the attention core, the norms and the other weight
    gradients hide nothing.

    Args:
        config: a :class:`TransformerConfig` or a name in :data:`TRANSFORMERS`.
        tp: the tensor-parallel size.
        tokens: tokens of the TP group's micro-batch (sequence x batch; each rank holds 1/tp of them
            between blocks).
        flops: sustained FLOP/s of one rank.
        link: the TP group's link (inside a node: ``CostModel.intra``).
        decomposed: commopt's decomposed rings instead of the unfused collectives.
        activation_bytes: bytes per activation element (2: bf16).
        ffn: the MLP's hidden units (None: 4 d_model).
        chunks: chunks per block (None: as the styles cut it beside a GPU,
            ``tensor_parallel.chunk_count(..., "cuda")``; on a CPU group ``tensor_parallel.chunks_for``
            says what the styles do).
    """
    cfg = TRANSFORMERS[config] if isinstance(config, str) else config
    if not isinstance(tp, int) or tp < 1:
        raise ValueError(f"simulate_tensor_parallel: tp must be an int >= 1, got {tp!r}")
    d = cfg.d_model
    hidden = 4 * d if ffn is None else ffn
    if isinstance(hidden, bool) or not isinstance(hidden, int) or hidden < 1:
        raise ValueError(f"simulate_tensor_parallel: ffn must be an int >= 1 or None (4 d_model), got {ffn!r}")
    if chunks is not None and (isinstance(chunks, bool) or not isinstance(chunks, int) or chunks < 1):
        raise ValueError(f"simulate_tensor_parallel: chunks must be an int >= 1 or None, got {chunks!r}")
    # Per rank, forward: each matmul's 1/tp; backward: the input gradient (the one beside a
    # collective) and the weight gradient, each as long as the forward matmul.
    mats = [2 * tokens * d * n / tp / flops for n in (3 * d, d, hidden, hidden)]  # QKV, OUT, FC1, FC2
    attention = 4 * tokens * cfg.seq * d / tp / flops  # scores and the weighted sum, this rank's heads
    compute = 3 * (sum(mats) + attention)
    act = tokens * d * activation_bytes  # the block's whole activation
    step_time = link.time(act / tp) if tp > 1 else 0.0  # one ring step: one rank's block
    collective = (tp - 1) * step_time
    communication = 8 * collective
    if not decomposed or tp == 1:
        step = compute + communication
    else:
        n = chunks or chunk_count(link.time(act / tp), tokens // tp, "cuda")
        hop = link.time(act / tp / n)  # one chunk across the link

        def ring(matmul: float, meanwhile: float = 0.0) -> float:
            return ring_seconds(matmul, hop, tp, n, meanwhile)

        # Forward, then backward: the input gradients of QKV and FC1 are reduce-scatter rings that
        # compute their weight gradients behind their last transfers; OUT's and FC2's weight
        # gradients and the attention core hide nothing.
        qkv, out, fc1, fc2 = mats
        paired = sum(ring(m) for m in mats) + ring(qkv, qkv) + ring(out) + ring(fc1, fc1) + ring(fc2)
        step = paired + out + fc2 + 3 * attention
    return TPResult(step, compute, communication, step - compute)


def layers_from_model(module: nn.Module, example: torch.Tensor, *, repeats: int = 5,
                      loss: Callable[[torch.Tensor], torch.Tensor] = lambda y: y.float().pow(2).mean()) -> list[Layer]:
    """Measure each parameterised module's forward and backward on this machine (medians).

    The layers are the modules that own parameters, in the order their forward starts. Every second
    of a step is charged to some layer, so that the layers add up to the measured step: a layer's
    forward runs from its forward pre-hook to the next layer's (the last one's to the end of the
    loss), which charges parameter-free work in between (attention scores, activations, the tied
    head) to the layer before it; its backward runs from the previous gradient-ready event to its
    own, in backward order, the first from the start of backward and the last until ``backward()``
    returns.
    """
    mods = [m for m in module.modules() if any(True for _ in m.parameters(recurse=False))]
    names = {m: n for n, m in module.named_modules()}
    fwd: dict[nn.Module, list[float]] = {m: [] for m in mods}
    bwd: dict[nn.Module, list[float]] = {m: [] for m in mods}
    ready: dict[nn.Module, float] = {}
    starts: list[tuple[nn.Module, float]] = []
    handles = []

    def pre(mod: nn.Module, _args: object) -> None:
        if all(mod is not m for m, _ in starts):
            starts.append((mod, time.perf_counter()))

    for m in mods:
        handles.append(m.register_forward_pre_hook(pre))
        for p in m.parameters(recurse=False):
            if p.requires_grad:
                handles.append(p.register_post_accumulate_grad_hook(
                    lambda p, mod=m: ready.__setitem__(mod, time.perf_counter())))
    order: list[nn.Module] = []
    try:
        for _ in range(repeats + 1):
            module.zero_grad(set_to_none=True)
            ready.clear()
            starts.clear()
            t_start = time.perf_counter()
            value = loss(module(example))
            t_fwd = time.perf_counter()
            value.backward()
            t_end = time.perf_counter()
            order = [m for m, _ in starts]
            marks = [t for _, t in starts]
            marks[0] = t_start
            for i, m in enumerate(order):
                fwd[m].append((marks[i + 1] if i + 1 < len(marks) else t_fwd) - marks[i])
            prev = t_fwd
            by_ready = sorted(ready, key=ready.get)
            for j, m in enumerate(by_ready):
                last = t_end if j == len(by_ready) - 1 else ready[m]
                bwd[m].append(last - prev)
                prev = ready[m]
    finally:
        for h in handles:
            h.remove()
        module.zero_grad(set_to_none=True)

    def median(v: list[float]) -> float:
        v = sorted(v[1:]) or [0.0]  # the first run warms caches up
        return v[len(v) // 2]

    out_layers = []
    for m in order:
        nbytes = sum(p.numel() * p.element_size() for p in m.parameters(recurse=False) if p.requires_grad)
        out_layers.append(Layer(names.get(m, type(m).__name__), median(fwd[m]), median(bwd[m]), nbytes))
    return out_layers


# ------------------------------------------------------------------------------------- traffic
def traffic_matrix(algorithm: str, nbytes: float, topology: Topology, op: str = "allreduce") -> torch.Tensor:
    """Bytes rank i sends to rank j (``[p, p]``, float64) for one ``op`` of an ``nbytes`` buffer per rank:
    the algorithm's own ``traffic()`` (``commopt.comm.algorithms``; its docstring lists the phases).
    ``ina`` sends to a switch: ``[p + 1, p + 1]``, index p the switch."""
    algo = algorithms.get(algorithm)
    reason = algo.supports(topology, op)
    if reason is not None:
        raise ValueError(f"traffic_matrix: {reason}")
    return algo.traffic(op, nbytes, topology).matrix()


def iteration_traffic(layers: Sequence[Layer], algorithm: str, topology: Topology,
                      schedule: Schedule | None = None) -> torch.Tensor:
    """The traffic matrix of one iteration: every bucket's reduction (compression ratio applied)."""
    sched = schedule or Schedule()
    plan = _buckets(layers, sched)
    total = None
    for b in plan.buckets:
        m = traffic_matrix(algorithm, b.nbytes * sched.compression_ratio, topology)
        total = m if total is None else total + m
    return total if total is not None else traffic_matrix(algorithm, 0, topology)
