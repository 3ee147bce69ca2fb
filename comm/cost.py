"""Calibration and choice: the cost model (``commopt.comm.links``) applied to this cluster, used by
``algorithm="auto"`` and by every benchmark.

The model itself (:class:`~commopt.comm.links.LinkModel`, :class:`~commopt.comm.links.CostModel`,
the defaults, :func:`~commopt.comm.links.fit`) is pure and lives below the algorithms; it is
re-exported here. This module measures it (:func:`calibrate`, :func:`measure_lines`), caches it in
the runtime context (:func:`model_for`) and asks the algorithms' own formulas (:func:`predict`,
:func:`choose`), so it sits above both.

``auto`` takes, in order: an explicit :class:`CostModel`, the cached calibration of this layout
(:func:`calibrate`), the configured link rate of the emulated cluster, documented defaults
(:data:`DEFAULT_INTRA`, :data:`DEFAULT_INTER`). Whatever the source, rank 0's model is broadcast
once per topology so every rank chooses the same algorithm (docs/architecture.md section 3, rule 2).
"""

from __future__ import annotations

import json
import math
import os
import statistics
import threading
import time
from pathlib import Path
from typing import Callable

import torch
import torch.distributed as dist

from . import algorithms
from .algorithms._transport import prepare
from .checks import agree
from .engine import wait, wait_work
from .links import (
    ALGORITHM_FACTORS,
    COPY_BETA,
    DEFAULT_INTER,
    DEFAULT_INTRA,
    PHASE_HANDOFF,
    CostModel,
    LinkModel,
    MeasuredLine,
    fit,
)
from .runtime import context
from .topology import Topology

__all__ = [
    "LinkModel",
    "MeasuredLine",
    "CostModel",
    "DEFAULT_INTRA",
    "DEFAULT_INTER",
    "predict",
    "link_bytes",
    "choose",
    "measure_lines",
    "fit",
    "calibrate",
    "model_for",
    "chunks_for",
    "lines_key",
    "measured_lines",
    "ALGORITHM_FACTORS",
    "COPY_BETA",
    "PHASE_HANDOFF",
    "MEASURED_TIE",
]


#: Measured candidates within this fraction of the fastest are a tie, which goes to the earlier
#: candidate (registry order: flat, then the hierarchy). Two calibrations of the emulated 2x2 moved
#: one algorithm's time by up to 4 % at 512 KiB, where hierarchical and leader lie within 1-4 % of
#: each other: without it ``auto`` ran leader, by the noise, 5 % behind hierarchical (docs/results.md 25).
MEASURED_TIE = 0.05


def link_bytes(algorithm: str, nbytes: float, topo: Topology, op: str = "allreduce") -> float:
    """Bytes the busiest node link carries in each direction for ``op`` of an ``nbytes`` buffer, as
    the algorithm's own :meth:`~commopt.comm.algorithms.Algorithm.traffic` says.

    For reduce-scatter and all-gather, ``nbytes`` is the size of the whole (world-sized) buffer.
    """
    return algorithms.get(algorithm).link_bytes(op, nbytes, topo)


def predict(algorithm: str, nbytes: float, topo: Topology, model: CostModel | None = None,
            op: str = "allreduce") -> float:
    """Predicted seconds of ``op`` with ``algorithm`` on ``nbytes`` (the per-rank buffer for
    all-reduce and all-to-all; the whole world-sized buffer for reduce-scatter and all-gather): the
    algorithm's own :meth:`~commopt.comm.algorithms.Algorithm.cost` (its docstring lists the phases)."""
    algo = algorithms.get(algorithm)
    reason = algo.supports(topo, op)
    if reason is not None:
        raise ValueError(f"no cost formula: {reason}")
    return algo.cost(model or CostModel(DEFAULT_INTRA, DEFAULT_INTER), op, nbytes, topo)


def chunks_for(algorithm: str, nbytes: float, topo: Topology, model: CostModel, op: str = "allreduce") -> int:
    """How many chunks the algorithm pipelines ``op`` over (at most ``model.chunks``): the count
    with the lowest predicted time."""
    return algorithms.get(algorithm).chunks(model, op, nbytes, topo)


def choose(candidates: list[str], nbytes: float, topo: Topology, model: CostModel | None,
           op: str = "allreduce", *, measured: dict[str, LinkModel] | None = None) -> str:
    """The candidate with the lowest predicted time (ties go to the earlier candidate).

    Args:
        candidates: algorithm names (``algorithms.candidates(op)`` that support ``topo``).
        nbytes: the per-rank buffer (all-reduce, all-to-all) or the whole world-sized one.
        model: the level model the algorithms' ``cost`` predicts under; where its levels share one
            resource (``model.shared``: the hierarchy only adds phases) a reduction runs ``flat``.
        measured: an effective ``alpha + S * beta`` line per algorithm measured on this layout
            (:func:`measure_lines`); when it covers every candidate, the lines decide, not ``model``
            (which may then be None): the earliest candidate within :data:`MEASURED_TIE` of the
            fastest, since measurements closer than that are a tie.
    """
    if measured is not None and all(a in measured for a in candidates):
        times = [measured[a].time(nbytes) for a in candidates]
        return next(a for a, t in zip(candidates, times) if t <= min(times) * (1 + MEASURED_TIE))
    if model is None:
        raise ValueError(f"cost.choose: no model and no measured line for every candidate of {candidates}; pass "
                         f"model=cost.model_for(topology)")
    if model.shared and "flat" in candidates and op != "alltoall":
        return "flat"
    return min(candidates, key=lambda a: (predict(a, nbytes, topo, model, op), candidates.index(a)))


def lines_key(collective: str, topology: Topology) -> tuple:
    """The key of ``collective``'s measured lines for ``topology`` in the runtime context."""
    return (collective, topology.layout, id(topology.group))


def measured_lines(collective: str, topology: Topology) -> dict[str, LinkModel] | None:
    """The per-algorithm lines :func:`calibrate` (all-reduce) or ``alltoall.calibrate`` measured
    for ``collective`` on ``topology`` in this process, or None."""
    return context().measured_lines.get(lines_key(collective, topology))


def measure_lines(topology: Topology, names: list[str], make_call: Callable[[str, int], Callable[[], object]],
                  sizes: list[int], reps: int, *, relative: bool = False,
                  synchronized: bool = False) -> dict[str, MeasuredLine]:
    """Time each named algorithm on this machine and fit it an effective ``alpha + S * beta`` line.

    The level model predicts message counts and bytes; what it cannot see is this machine's cost of
    each extra synchronising phase (thread hand-offs, copies, a CPU shared by many ranks), which
    decides small calls. So: at each of ``sizes`` (bytes), each algorithm runs once (warm-up), then
    is timed; a size's time is the slowest rank's (an all-reduce MAX, so every rank holds the same
    points); :func:`fit` gives each algorithm its line through them, and rank 0's lines are
    broadcast (lstsq may differ in the last bit between processes). Each line keeps its points
    (:class:`MeasuredLine`: between two measured sizes it follows them, not the line). Collective
    over the topology's group.

    Two ways of timing, as the calls run in use:

    - back to back (default; the collectives of a training step): every rank starts together (a
      barrier), then ``reps`` calls, seconds per call. The link stays busy as inside a step. The best
      of single calls fitted lines up to 44 % fast on the emulated 2x2 (the hierarchical
      reduce-scatter of an FSDP2 block at 37 ms where its link needs 66 ms): a rank that started a
      call late found its peers' transfers done, and an idle shaped link lends a burst. With them the
      sharded simulator put commopt's FSDP2 step at 0.64 of the measured one, with these at 0.83.
    - ``synchronized`` (one call at a time, as a user's all-reduce runs: its agreement check lines
      the ranks up): the algorithms interleaved, each call after a barrier, the median; at least
      ``reps`` calls and up to 8x more, as many as fit in about 0.3 s per algorithm and size. Back
      to back, consecutive calls overlap across ranks and favour the algorithms of more phases: at
      64 KiB on the emulated 2x2 leader ran 0-25 % faster than flat back to back and 2-6 % slower
      one call at a time (docs/results.md 25).

    Args:
        topology: the layout timed (its group runs the calls).
        names: the algorithms, in the order every rank times them.
        make_call: ``make_call(name, nbytes)`` -> a callable running one call of ``nbytes``.
        sizes: the sizes in bytes, ascending, each the exact size ``make_call`` moves.
        reps: timed calls per algorithm and size (synchronized: at least).
        relative: fit each line on relative errors (``fit(..., relative=True)``), for sizes that span
            orders of magnitude.
        synchronized: time one call at a time (above).
    """
    group = topology.group
    points: dict[str, list[float]] = {name: [] for name in names}
    for size in sizes:
        calls = {name: make_call(name, size) for name in names}
        if synchronized:
            own = _one_at_a_time(calls, reps, group)
        else:
            own = []
            for call in calls.values():
                call()  # warm-up
                dist.barrier(group=group)
                start = time.perf_counter()
                for _ in range(reps):
                    call()
                own.append((time.perf_counter() - start) / reps)
        slowest = torch.tensor(own, dtype=torch.float64)
        dist.all_reduce(slowest, op=dist.ReduceOp.MAX, group=group)
        for name, seconds in zip(names, slowest.tolist()):
            points[name].append(seconds)
    fits = {name: fit([float(s) for s in sizes], points[name], relative=relative) for name in names}
    flat = torch.tensor([v for a in names for v in (fits[a].alpha, fits[a].beta)], dtype=torch.float64)
    dist.broadcast(flat, src=topology.group_rank_to_global(0), group=group)
    values = flat.tolist()
    return {a: MeasuredLine(values[2 * i], values[2 * i + 1], tuple(zip(map(float, sizes), points[a])))
            for i, a in enumerate(names)}


def _one_at_a_time(calls: dict[str, Callable[[], object]], reps: int, group) -> list[float]:
    """This rank's median seconds of each call, timed one call at a time after a barrier, the calls
    interleaved (rotated every round, so that each follows every other equally often); as many
    rounds as fit in about 0.3 s for the slowest warm-up, between ``reps`` and ``8 * reps``, agreed
    by every rank."""
    slowest = 0.0
    for call in calls.values():
        start = time.perf_counter()
        call()  # warm-up
        slowest = max(slowest, time.perf_counter() - start)
    agreed = torch.tensor([slowest], dtype=torch.float64)
    dist.all_reduce(agreed, op=dist.ReduceOp.MAX, group=group)
    rounds = min(8 * reps, max(reps, math.ceil(0.3 / max(float(agreed), 1e-6))))
    names = list(calls)
    times: dict[str, list[float]] = {name: [] for name in names}
    for r in range(rounds):
        for name in names[r % len(names):] + names[:r % len(names)]:
            dist.barrier(group=group)
            start = time.perf_counter()
            calls[name]()
            times[name].append(time.perf_counter() - start)
    return [statistics.median(times[name]) for name in names]


def _cache_path(topo: Topology, cache_dir: str | os.PathLike | None) -> Path:
    root = Path(cache_dir) if cache_dir else Path.home() / ".cache" / "commopt"
    rate = f"-{int(topo.link_rate_bps)}" if topo.link_rate_bps else ""
    return root / f"calibration-{topo.layout.replace(';', '_').replace(',', '.')}{rate}.json"


def median_seconds(fn: Callable[[], object], *, group=None, reps: int = 5) -> float:
    """The median seconds of ``fn()`` over ``reps`` calls after one untimed call (warm-up), every
    rank of ``group`` (None: WORLD) starting each call together (a barrier before each). Collective:
    every rank of ``group`` calls it with the same ``reps``.

    Raises:
        TypeError: ``fn`` is not callable.
        ValueError: ``reps`` is not an int >= 1.
    """
    if not callable(fn):
        raise TypeError(f"median_seconds: fn must be a callable taking no arguments, got {type(fn).__name__}")
    if isinstance(reps, bool) or not isinstance(reps, int) or reps < 1:
        raise ValueError(f"median_seconds: reps must be an int >= 1 (the timed calls), got {reps!r}")
    fn()
    times = []
    for _ in range(reps):
        dist.barrier(group=group)
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _time_allreduce(group, nbytes: int, reps: int, sync_group) -> float | None:
    """Median time of an all-reduce of ``nbytes`` on ``group`` (None: this rank only keeps step).

    A barrier on the topology's whole group precedes every repetition, so that every rail (or every
    node) runs at the same time, as in a real hierarchical phase.
    """
    t = torch.ones(max(1, nbytes // 4), dtype=torch.float32)
    if group is not None:
        dist.all_reduce(t, group=group)  # warm-up: connections, allocation
    times = []
    for _ in range(reps):
        dist.barrier(group=sync_group)
        if group is None:
            continue
        start = time.perf_counter()
        dist.all_reduce(t, group=group)
        times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2] if times else None


def _time_both(intra, rail, nbytes: int, reps: int, sync_group) -> float | None:
    """Median time of an intra-node and a rail all-reduce of ``nbytes`` each, issued at once from
    two threads (the two levels of one pipelined step). None where a level is missing."""
    if intra is None or rail is None:
        for _ in range(reps):
            dist.barrier(group=sync_group)
        return None
    a, b = (torch.ones(max(1, nbytes // 4), dtype=torch.float32) for _ in range(2))
    times = []
    for _ in range(reps):
        dist.barrier(group=sync_group)
        start = time.perf_counter()
        side = threading.Thread(target=dist.all_reduce, args=(a,), kwargs={"group": intra}, daemon=True)
        side.start()
        dist.all_reduce(b, group=rail)
        side.join()
        times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2]


def calibrate(topology: Topology, *, cache_dir: str | os.PathLike | None = None,
              sizes: tuple[int, int] = (64 << 10, 4 << 20), reps: int = 5,
              collectives: tuple[str, ...] = ("allreduce",)) -> CostModel:
    """Measure this machine's two levels (about a second) and cache the result per layout.

    The large size (4 MiB) is well past a shaped link's burst allowance, so the fit sees the
    sustained rate, not the token bucket's head start.

    Collective over the topology's group: every rank times all-reduces on its intra-node and rail
    groups at two sizes; rank 0's fit is broadcast so that all ranks hold the same model, and rank
    0 writes it to ``~/.cache/commopt`` (or ``cache_dir``).

    It also times both levels at once: pipelining chunks pays only when one level's transfer hides
    behind the other's. Where the levels take comparable times alone (within 5x) and together more
    than the slower one plus half the faster one (loopback: every "link" is the same few cores), they
    share one resource: the model keeps one chunk (``chunks=1``) and says so (``shared``), and ``auto``
    then runs flat (the hierarchy moves the same bytes in more phases).

    Then, for each of ``collectives`` (``"allreduce"``, ``"reduce_scatter"``, ``"all_gather"``), it
    times the automatic candidates themselves at three sizes and keeps their lines
    (:func:`measured_lines`): ``auto`` follows them, and the sharded simulator takes them for
    commopt's own collectives (``simulate_sharded(..., lines=)``). Only the all-reduce by default:
    each collective adds a few seconds on a shaped link.
    """
    unknown = [c for c in collectives if c not in ("allreduce", "reduce_scatter", "all_gather")]
    if unknown:
        raise ValueError(f"cost.calibrate: collectives {unknown} cannot be measured; choose from 'allreduce', "
                         f"'reduce_scatter', 'all_gather'")
    groups = context().groups(topology, "calibrate")
    levels, large = {}, {}
    for name, group, size in (("intra", groups.intra, topology.local_size),
                              ("inter", groups.rail, len(groups.rail_ranks))):
        if size < 2:
            group = None  # still keeps step with the barriers of the ranks that measure
        times = [_time_allreduce(group, s, reps, topology.group) for s in sizes]
        if group is None:
            levels[name] = None
            continue
        large[name] = times[-1]
        # Every rail is timed at the same time, as in a real hierarchical phase, so one rail's
        # bytes/s is the node link's share: the node link carries local_size times that.
        share = topology.local_size if name == "inter" else 1
        levels[name] = fit(list(sizes), times, messages=2 * (size - 1), bytes_factor=2 * (size - 1) / size * share)
    both = _time_both(groups.intra if topology.local_size > 1 else None,
                      groups.rail if len(groups.rail_ranks) > 1 else None, sizes[-1], reps, topology.group)
    chunks, shared = CostModel.chunks, False
    slow, fast = max(large.values(), default=0.0), min(large.values(), default=0.0)
    # Judged only on comparable levels: next to a level five times slower, the fast one's time is
    # within the slow one's noise (and pipelining there costs little).
    if both is not None and fast >= 0.2 * slow and both > slow + 0.5 * fast:
        chunks, shared = 1, True
    # A node link no slower than the intra-node level (loopback, where the rails' concurrent
    # transfers even look faster than one intra-node pair): the hierarchy saves nothing there. The
    # timing test above alone missed it in one of two calibrations of the same logical 2x2.
    if levels["intra"] is not None and levels["inter"] is not None and levels["inter"].beta <= levels["intra"].beta:
        shared = True
    model = CostModel(levels["intra"] or DEFAULT_INTRA, levels["inter"] or _inter_default(topology), chunks,
                      shared)
    model = _broadcast_model(model, topology)
    if topology.rank == 0:
        path = _cache_path(topology, cache_dir)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(model.to_dict()))
    context().cost_models.put((topology.layout, id(topology.group)), model)
    for collective in collectives:
        _measure(collective, topology, model, sizes, reps)
    return model


def _measure(collective: str, topology: Topology, model: CostModel, sizes: tuple[int, int], reps: int) -> None:
    """Time ``auto``'s candidates for ``collective`` on this layout and keep their lines.

    The level fit sees two link levels; what it cannot see is this machine's cost of each extra
    phase of a call (thread hand-offs, copies, a CPU shared by every rank of a node), which decides
    small calls: on the emulated 2x2 the level model let ``auto`` run hierarchical at 64 KiB at 0.87x
    of flat, and it predicted commopt's FSDP2 collectives 30 % too fast. The lines are of the calls
    themselves (blocking, each candidate's own pipelining depth), so ``auto`` picks what measured
    faster (docs/results.md). Sizes are the per-rank buffer (all-reduce) or the world-sized one.

    The all-reduce's candidates are timed as the public ``all_reduce`` runs them, one call at a time
    with its agreement check (``measure_lines(synchronized=True)``); the reduce-scatter's and
    all-gather's, which FSDP2 issues back to back inside a step without a check, back to back.
    """
    options = [a for a in algorithms.candidates(collective)
               if algorithms.get(a).supports(topology, collective) is None and algorithms.get(a).considered(topology)]
    if len(options) < 2 and collective == "allreduce":
        return  # nothing for auto to choose; the sharded simulator asks for the others' lines
    if not options:
        return
    ctx, world, group = context(), topology.world_size, topology.group
    ctx.prepare(topology, options)
    checked = collective == "allreduce"

    def make_call(name: str, nbytes: int) -> Callable[[], object]:
        run = algorithms.get(name).runs(topology, collective)  # flat where it degenerates to it
        impl = algorithms.get(run)
        chunks = impl.chunks(model, collective, nbytes, topology) if run != "flat" else 1
        topo = topology if run != "flat" else None
        whole = torch.ones(nbytes // 4, dtype=torch.float32)
        part = torch.ones(nbytes // 4 // world, dtype=torch.float32)
        out, src = {"allreduce": (whole, None), "reduce_scatter": (part, whole),
                    "all_gather": (whole, part)}[collective]

        def call() -> object:
            if checked:  # as the public all_reduce runs it (dispatch.exact_all_reduce)
                agree("all_reduce", numel=out.numel(), dtype=out.dtype, op="sum", algorithm=run, group=group,
                      device=out.device, timeout=None)
            p, red = prepare(out, "sum", world)
            red = None if collective == "all_gather" else red
            return wait(impl.start(ctx.call(impl, collective, p, red, group, topo, None, True, chunks, src)), None)
        return call

    # Three sizes, the middle one where the candidates' times cross, fitted on relative errors: two
    # sizes left the middle to the line, and auto picked leader there 6 % behind hierarchical.
    lo, hi = sizes[0], sizes[-1]
    spread = [lo, int(math.sqrt(lo * hi)), hi]
    unit = 4 * (1 if collective == "allreduce" else world)  # whole fp32 elements, a whole block per rank
    exact = [max(1, s // unit) * unit for s in spread]
    lines = measure_lines(topology, options, make_call, exact, reps, relative=True, synchronized=checked)
    ctx.measured_lines.put(lines_key(collective, topology), lines)


def _inter_default(topo: Topology) -> LinkModel:
    if topo.links is not None:  # links that differ: a ring is paced by the slowest
        n = topo.links.nodes
        slowest = min(r for i in range(n) for j in range(n) if i != j and (r := topo.links.rate(i, j)) > 0)
        return LinkModel(alpha=DEFAULT_INTER.alpha, beta=1.0 / slowest)
    if topo.link_rate_bps:
        return LinkModel(alpha=DEFAULT_INTER.alpha, beta=8.0 / topo.link_rate_bps)
    return DEFAULT_INTER


def _broadcast_model(model: CostModel, topo: Topology, timeout: float | None = None) -> CostModel:
    if topo.world_size == 1:
        return model
    t = torch.tensor([model.intra.alpha, model.intra.beta, model.inter.alpha, model.inter.beta,
                      float(model.chunks), float(model.shared)], dtype=torch.float64)
    wait_work(dist.broadcast(t, src=topo.group_rank_to_global(0), group=topo.group, async_op=True), timeout,
               "cost.model_for")
    v = t.tolist()
    return CostModel(LinkModel(v[0], v[1]), LinkModel(v[2], v[3]), int(v[4]), bool(v[5]))


def model_for(topology: Topology, *, cache_dir: str | os.PathLike | None = None,
              timeout: float | None = None) -> CostModel:
    """The model ``auto`` uses for ``topology``: cached calibration, else link rate, else defaults.

    Resolved once per topology (one tiny broadcast from rank 0), then kept in commopt's cache.
    """
    key = (topology.layout, id(topology.group))
    model = context().cost_models.get(key)
    if model is not None:
        return model
    model = CostModel(DEFAULT_INTRA, _inter_default(topology))
    if topology.rank == 0:
        path = _cache_path(topology, cache_dir)
        if path.exists():
            try:
                model = CostModel.from_dict(json.loads(path.read_text()))
            except (ValueError, KeyError, TypeError):
                pass  # a corrupt cache falls back to defaults; calibrate() rewrites it
    model = _broadcast_model(model, topology, timeout)
    context().cost_models.put(key, model)
    return model
