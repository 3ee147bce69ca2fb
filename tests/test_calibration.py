"""cost.calibrate: the level model and the measured all-reduce lines that ``auto`` then follows
(docs/architecture.md section 5.1; docs/results.md: ``auto`` at small sizes)."""

from __future__ import annotations

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
    names = {c: [a for a in algorithms.candidates(c) if algorithms.get(a).supports(topo, c) is None]
             for c in _COLLECTIVES}
    try:
        try:
            cost.calibrate(topo, collectives=("allreduce", "broadcast"))
        except ValueError as exc:
            refused = str(exc)
        model = cost.calibrate(topo, cache_dir=cache_dir, sizes=(4096, 65536), reps=2, collectives=_COLLECTIVES)
        lines = {c: cost.measured_lines(c, topo) for c in _COLLECTIVES}
        choices = {c: tuple(select_algorithm(c, "auto", s, topo) for s in SIZES) for c in _COLLECTIVES}
        # auto runs, and reduces correctly, with the calibration in place.
        x = torch.full((1000,), float(dist.get_rank() + 1))
        all_reduce(x, topology=topo)
        assert torch.equal(x, torch.full((1000,), 10.0))
    finally:
        _forget(topo)
    return (model.to_dict(), {c: {a: (m.alpha, m.beta) for a, m in v.items()} for c, v in lines.items()}, choices,
            names, refused)


def test_calibrate_measures_lines_that_auto_follows(ranks, tmp_path):
    """Every candidate that runs on the layout gets a line, identical on every rank (rank 0's
    broadcast), and auto picks, at every size, the algorithm whose measured line is lowest (ties: the
    earlier candidate): the oracle is recomputed here from the returned lines."""
    results = ranks(4, _calibrate, str(tmp_path), timeout=120)
    assert all(r == results[0] for r in results), results
    model, lines, choices, expected, refused = results[0]
    assert "cost.calibrate" in refused and "broadcast" in refused
    assert model["intra"]["beta"] > 0 and model["inter"]["beta"] > 0
    for collective in _COLLECTIVES:  # the all-reduce's, and the reduce-scatter's and all-gather's on request
        mine = expected[collective]
        assert {"flat", "hierarchical"} <= set(mine) and sorted(lines[collective]) == sorted(mine), collective
        assert all(alpha >= 0 and beta > 0 for alpha, beta in lines[collective].values()), collective
        for size, choice in zip(SIZES, choices[collective]):
            times = {a: LinkModel(*lines[collective][a]).time(size) for a in mine}
            best = min(mine, key=lambda a: (times[a], mine.index(a)))
            assert choice == best, (collective, size, choice, times)
    assert (tmp_path / next(p.name for p in tmp_path.iterdir())).read_text()  # rank 0 cached the model


def _injected() -> tuple:
    """Lines put in by hand: auto follows them against the level model, and forgets them with them."""
    topo = Topology.from_spec("2x2")
    key = cost.lines_key("allreduce", topo)
    names = [a for a in algorithms.candidates("allreduce") if algorithms.get(a).supports(topo, "allreduce") is None]
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
