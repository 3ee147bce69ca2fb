"""cost.calibrate: the level model and the measured all-reduce lines that ``auto`` then follows
(docs/architecture.md section 5.1; docs/results.md: ``auto`` at small sizes)."""

from __future__ import annotations

import time

import numpy as np
import pytest
import torch
import torch.distributed as dist

from commopt.comm import Topology, algorithms, all_reduce, context, cost
from commopt.comm.dispatch import select_algorithm
from commopt.comm.links import LinkModel, fit

SIZES = (1 << 10, 64 << 10, 1 << 20, 16 << 20)


def _forget(topo: Topology) -> None:
    """Later tests in this pool use the level model of the defaults again."""
    ctx = context()
    for collective in _COLLECTIVES:
        ctx.measured_lines.pop(cost.lines_key(collective, topo))
    ctx.cost_models.pop((topo.layout, id(topo.group)))


_COLLECTIVES = ("allreduce", "reduce_scatter", "all_gather")


def _calibrate(cache_dir: str) -> tuple:
    topo = Topology.from_spec("2x2")
    # The candidates of this process's registry (a kept pool may hold a test's toy algorithm too).
    # (synth only where the links differ: Algorithm.considered)
    names = {c: [a for a in algorithms.candidates(c) if algorithms.get(a).supports(topo, c) is None
                 and algorithms.get(a).considered(topo)] for c in _COLLECTIVES}
    try:
        try:
            cost.calibrate(topo, collectives=("allreduce", "broadcast"))
        except ValueError as exc:
            refused = str(exc)
        before = context().engine().bytes_sent().get("all_reduce/agree", 0)
        model = cost.calibrate(topo, cache_dir=cache_dir, sizes=(4096, 65536), reps=2, collectives=_COLLECTIVES)
        # The all-reduce's candidates ran with the agreement check, as the public call runs them.
        assert context().engine().bytes_sent().get("all_reduce/agree", 0) > before
        lines = {c: cost.measured_lines(c, topo) for c in _COLLECTIVES}
        choices = {c: tuple(select_algorithm(c, "auto", s, topo) for s in SIZES) for c in _COLLECTIVES}
        # auto runs, and reduces correctly, with the calibration in place.
        x = torch.full((1000,), float(dist.get_rank() + 1))
        all_reduce(x, topology=topo)
        assert torch.equal(x, torch.full((1000,), 10.0))
    finally:
        _forget(topo)
    return (model.to_dict(), {c: {a: (m.alpha, m.beta, m.points) for a, m in v.items()} for c, v in lines.items()},
            choices, names, refused)


def _expected_time(alpha: float, beta: float, points: tuple, size: float) -> float:
    """A measured call's time at ``size``: straight between the two measured sizes around it,
    the fitted line outside them."""
    sizes = [s for s, _ in points]
    if sizes[0] <= size <= sizes[-1]:
        return float(np.interp(size, sizes, [t for _, t in points]))
    return alpha + beta * size


def test_calibrate_measures_lines_that_auto_follows(ranks, tmp_path):
    """Every candidate that runs on the layout gets a line and its measured points, identical on
    every rank (rank 0's broadcast), and auto picks, at every size, the earliest candidate whose
    measured time (between two measured sizes: the points; outside: the line) is within
    ``cost.MEASURED_TIE`` of the lowest: the oracle is recomputed here from the returned lines."""
    results = ranks(4, _calibrate, str(tmp_path), timeout=120)
    assert all(r == results[0] for r in results), results
    model, lines, choices, expected, refused = results[0]
    assert "cost.calibrate" in refused and "broadcast" in refused
    assert model["intra"]["beta"] > 0 and model["inter"]["beta"] > 0
    for collective in _COLLECTIVES:  # the all-reduce's, and the reduce-scatter's and all-gather's on request
        mine = expected[collective]
        assert {"flat", "hierarchical"} <= set(mine) and sorted(lines[collective]) == sorted(mine), collective
        assert all(alpha >= 0 and beta > 0 for alpha, beta, _ in lines[collective].values()), collective
        # The points: the three sizes measured, ascending, each a positive time.
        assert all([s for s, _ in pts] == sorted(s for s, _ in pts) and len(pts) == 3 and min(t for _, t in pts) > 0
                   for _, _, pts in lines[collective].values()), collective
        for size, choice in zip(SIZES, choices[collective]):
            times = {a: _expected_time(*lines[collective][a], size) for a in mine}
            best = next(a for a in mine if times[a] <= min(times.values()) * (1 + cost.MEASURED_TIE))
            assert choice == best, (collective, size, choice, times)
    assert (tmp_path / next(p.name for p in tmp_path.iterdir())).read_text()  # rank 0 cached the model


def _injected() -> tuple:
    """Lines put in by hand: auto follows them against the level model, and forgets them with them."""
    topo = Topology.from_spec("2x2")
    key = cost.lines_key("allreduce", topo)
    names = [a for a in algorithms.candidates("allreduce") if algorithms.get(a).supports(topo, "allreduce") is None
             and algorithms.get(a).considered(topo)]
    before = tuple(select_algorithm("allreduce", "auto", s, topo) for s in SIZES)
    out = []
    for winner in names:
        # The winner is 1000x cheaper than every other candidate at every size.
        lines = {a: LinkModel(1e-6, 1e-12) if a == winner else LinkModel(1e-3, 1e-9) for a in names}
        context().measured_lines.put(key, lines)
        out.append(tuple(select_algorithm("allreduce", "auto", s, topo) for s in SIZES))
    # Lines that miss a candidate are not used: the level model decides again.
    context().measured_lines.put(key, {names[0]: LinkModel(0.0, 1e-15)})
    partial = tuple(select_algorithm("allreduce", "auto", s, topo) for s in SIZES)
    context().measured_lines.pop(key)
    return names, out, before, partial


def test_auto_follows_measured_lines_over_the_model(ranks):
    names, out, before, partial = ranks(4, _injected, timeout=60)[0]
    for winner, choices in zip(names, out):
        assert choices == (winner,) * len(SIZES)
    assert partial == before


def test_fit_holds_a_negative_estimate_at_zero_and_refits_the_other():
    """The least-squares line under alpha >= 0 (beta > 0): where the free fit's intercept is negative
    the slope is fitted again through the origin, not kept (flat's all-reduce times of a calibration
    on the emulated 2x2, which grow faster than linearly: 64 KiB, 512 KiB, 4 MiB)."""

    sizes, times = [65536.0, 524288.0, 4194304.0], [3.64e-3, 53.39e-3, 276.82e-3]
    line = fit(sizes, times, relative=True)
    # Oracle: minimise sum (1 - beta s / t)^2 over beta alone.
    r = [s / t for s, t in zip(sizes, times)]
    assert line.alpha == 0.0 and line.beta == pytest.approx(sum(r) / sum(x * x for x in r), rel=1e-9)
    assert line.time(sizes[-1]) == pytest.approx(times[-1], rel=0.01)
    # Absolute errors, and a falling time: beta held at its floor, alpha the mean.
    flat = fit([1.0, 2.0], [1.0, 0.5])
    assert flat.beta == 1e-15 and flat.alpha == pytest.approx(0.75)


def test_measured_line_follows_its_points_and_near_ties_go_to_the_earlier_candidate():
    """A measured call's time is straight between its measured sizes and the fitted line outside
    them; ``choose`` takes the earliest candidate within ``MEASURED_TIE`` of the fastest (by hand)."""
    from commopt.comm.links import MeasuredLine

    line = MeasuredLine(0.001, 1e-8, ((1000.0, 0.002), (3000.0, 0.010), (9000.0, 0.020)))
    assert line.time(1000) == pytest.approx(0.002) and line.time(9000) == pytest.approx(0.020)
    assert line.time(2000) == pytest.approx(0.006) and line.time(6000) == pytest.approx(0.015)
    assert line.time(500) == pytest.approx(0.001 + 500e-8) and line.time(20000) == pytest.approx(0.001 + 2e-4)
    assert line.time(2000, messages=2) == pytest.approx(0.002 + 2000e-8)  # a level formula's use: the line
    topo = Topology(nodes=((0, 1), (2, 3)), rank=0, world_size=4)
    names = ["flat", "hierarchical", "leader"]

    def pick(flat: float, hierarchical: float, leader: float) -> str:
        seconds = {"flat": flat, "hierarchical": hierarchical, "leader": leader}
        return cost.choose(names, 1 << 20, topo, None, measured={a: LinkModel(t, 1e-15) for a, t in seconds.items()})

    assert cost.MEASURED_TIE == 0.05
    assert pick(1.04, 1.00, 0.97) == "hierarchical"  # leader 3 % faster: a tie with hierarchical
    assert pick(1.04, 1.00, 0.90) == "leader"  # 10 % faster: leader
    assert pick(1.02, 1.00, 0.99) == "flat"  # all within 5 %: the first
    assert pick(1.00, 1.00, 1.00) == "flat"


def _timed_as_called() -> dict:
    """``measure_lines`` on fake calls that record their order, back to back and synchronized."""
    topo = Topology.from_spec("2x2")
    order: list = []

    def make_call(name: str, nbytes: int):
        def call() -> None:
            order.append((name, nbytes))
            time.sleep({"a": 0.010, "b": 0.001}[name] * (1 + nbytes // 1000))
        return call

    out = {}
    for synchronized in (False, True):
        order.clear()
        lines = cost.measure_lines(topo, ["a", "b"], make_call, [1000, 3000], 2, synchronized=synchronized)
        out[synchronized] = ({a: (m.alpha, m.beta, m.points) for a, m in lines.items()}, list(order))
    return out


def test_measure_lines_times_calls_as_they_run(ranks):
    """Back to back: each algorithm's calls one after the other, ``reps`` of them after a warm-up.
    Synchronized: the algorithms interleaved, every round each once, at least ``reps`` rounds, the
    same number on every rank. Either way the points are the slowest rank's, the same on every
    rank, and the slower fake call (``a``: ten times ``b``'s sleep) measures slower at every size."""
    results = ranks(4, _timed_as_called, timeout=120)
    points = {k: v[0] for k, v in results[0].items()}
    assert all({k: v[0] for k, v in r.items()} == points for r in results)
    back = results[0][False][1]
    assert back == [(n, s) for s in (1000, 3000) for n in ("a", "b") for _ in range(3)]  # warm-up + 2 reps
    for r in results:
        sync = r[True][1]
        for size in (1000, 3000):
            names = [n for n, s in sync if s == size]
            rounds = [sorted(names[i:i + 2]) for i in range(2, len(names), 2)]
            assert names[:2] == ["a", "b"] and len(rounds) >= 2 and all(x == ["a", "b"] for x in rounds), names
        assert sync == results[0][True][1]  # as many rounds on every rank
    for synchronized in (False, True):
        a, b = points[synchronized]["a"][2], points[synchronized]["b"][2]
        assert [s for s, _ in a] == [1000.0, 3000.0] and all(ta > tb for (_, ta), (_, tb) in zip(a, b)), (a, b)
