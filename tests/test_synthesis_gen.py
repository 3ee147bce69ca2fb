"""The synthesizers and the bound (``comm/synthesis/star.py``, ``tacos.py``, ``bound.py``,
``synthesize.py``; docs/architecture.md, "the synthesizers and the bound").

Pure Python, no process groups. Oracles: the checker (``check.py``) and a symbolic replay of this file's
own on every synthesized schedule; the research note's arithmetic (synthesis_landscape.md A.6: a ring's
bandwidth time 2(N - 1)/N S / r_slow on a star, (N - 1) S/N / r_min per phase on the triangle; the cut
bounds S / r_slow and M / 375 Mbit); a bisection on T for the star LP; and the simulator (``sim.py``)
for times, which never beat the cut bound.
"""

from __future__ import annotations

import random

import pytest

from commopt.comm.links import LinkMap
from commopt.comm.synthesis.bound import bound
from commopt.comm.synthesis.check import check
from commopt.comm.synthesis.ir import Schedule, ScheduleError
from commopt.comm.synthesis.sim import simulate, simulate_ring
from commopt.comm.synthesis.star import direct_schedule, integer_weights, shard_fractions, star_allreduce
from commopt.comm.synthesis.synthesize import synthesize
from commopt.comm.synthesis.tacos import tacos_allgather, tacos_allreduce, tacos_reducescatter

MBIT = 1e6 / 8  # bytes/s
M = 16 << 20
COLLS = ("allreduce", "reducescatter", "allgather")


def _replay(s: Schedule) -> None:
    """Run the steps symbolically (a step once its deps ran, a receive once its paired send ran) and
    assert the postcondition: per (rank, chunk) the count of each rank's contribution (all-reduce,
    reduce-scatter) or presence (all-gather), and for all-reduce the one computation every rank copied."""
    n, nch = s.nranks, s.nchunks
    reduce = s.collective != "allgather"
    if reduce:
        val = {(r, c): (tuple(int(q == r) for q in range(n)), ("init", r)) for r in range(n) for c in range(nch)}
    else:
        val = {(r, c): (r == s.shard_of(c), None) for r in range(n) for c in range(nch)}
    done = [[False] * len(x) for x in s.steps]
    slot: dict[tuple[int, int], int] = {}  # (rank, step) -> its index among its pair's sends / receives (list order)
    count: dict[tuple[str, int, int], int] = {}
    for r in range(n):
        for i, st in enumerate(s.steps[r]):
            key = ("s", r, st.peer) if st.op == "send" else ("r", st.peer, r)
            slot[r, i] = count[key] = count.get(key, -1) + 1
    assert {k[1:]: v for k, v in count.items() if k[0] == "s"} == {k[1:]: v for k, v in count.items() if k[0] == "r"}, (
        f"{s.name}: sends and receives per pair differ in number")
    sent: dict[tuple[int, int, int], list] = {}  # (a, b, k) -> the k-th payload a sent b
    progress = True
    while progress:
        progress = False
        for r in range(n):
            for i, st in enumerate(s.steps[r]):
                if done[r][i] or not all(done[r][d] for d in st.deps):
                    continue
                if st.op == "send":
                    sent[r, st.peer, slot[r, i]] = [(c, val[r, c]) for c in st.chunks]
                else:
                    box = sent.get((st.peer, r, slot[r, i]))
                    if box is None:
                        continue
                    assert [c for c, _ in box] == list(st.chunks), f"{s.name}: rank {r} step {i} pairs other chunks"
                    for c, (v, ident) in box:
                        if st.op == "recv":
                            val[r, c] = (v, ident)
                        else:
                            mine = val[r, c][0]
                            val[r, c] = (tuple(a + b for a, b in zip(mine, v)), ("rrc", r, i))
                done[r][i] = progress = True
    assert all(all(d) for d in done), f"{s.name}: steps never ran (deadlock)"
    full = tuple([1] * n)
    for c in range(nch):
        if s.collective == "allgather":
            assert all(val[r, c][0] for r in range(n)), f"{s.name}: chunk {c} missing"
        elif s.collective == "reducescatter":
            o = s.shard_of(c)
            assert val[o, c][0] == full, f"{s.name}: chunk {c} at owner {o} is {val[o, c][0]}"
        else:
            assert all(val[r, c][0] == full for r in range(n)), f"{s.name}: chunk {c}: {[val[r, c] for r in range(n)]}"
            assert len({val[r, c][1] for r in range(n)}) == 1, f"{s.name}: chunk {c} computed more than once"


def _verify(s: Schedule) -> None:
    check(s)
    _replay(s)


def _triangle() -> LinkMap:
    a, c = 200 * MBIT, 50 * MBIT
    return LinkMap.mesh(3, {(0, 1): a, (1, 0): a, (1, 2): a, (2, 1): a, (0, 2): c, (2, 0): c})


def _random_links(rng: random.Random, n: int) -> LinkMap:
    alpha = rng.choice([0.0, 50e-6, 1e-3])
    if rng.random() < 0.5:
        up = [rng.choice([50, 100, 200, 400]) * MBIT * rng.uniform(0.8, 1.2) for _ in range(n)]
        down = up if rng.random() < 0.5 else [rng.choice([50, 100, 200]) * MBIT for _ in range(n)]
        return LinkMap.star(up, down, alpha=alpha)
    pairs = {}
    order = list(range(n))
    rng.shuffle(order)
    for i in range(n):  # a ring both ways keeps it strongly connected, the rest at random
        a, b = order[i], order[(i + 1) % n]
        if a != b:
            pairs[a, b] = rng.choice([50, 200]) * MBIT
            pairs[b, a] = rng.choice([50, 200]) * MBIT
    for a in range(n):
        for b in range(n):
            if a != b and (a, b) not in pairs and rng.random() < 0.5:
                pairs[a, b] = rng.uniform(20, 400) * MBIT
    return LinkMap.mesh(n, pairs, alpha=alpha)


# ------------------------------------------------------------------------------------------ star
def test_star_fractions_are_the_lp_optimum():
    """The closed form equals a bisection on T of the LP (minimise T s.t. S (1 + (N - 2) x_i) <= T r_i,
    sum x = 1, x >= 0), its loads fit T, and the integer weights follow the fractions."""
    rng = random.Random(3)
    for _ in range(200):
        n = rng.randint(3, 9)
        up = [rng.uniform(1, 10) for _ in range(n)]
        down = [rng.uniform(1, 10) for _ in range(n)]
        x, t = shard_fractions(LinkMap.star(up, down))
        r = [min(a, b) for a, b in zip(up, down)]
        lo, hi = 0.0, 100.0
        for _ in range(200):  # feasible iff each x_i has room in [0, (T r_i - 1)/(N - 2)] and the rooms sum to 1
            mid = (lo + hi) / 2
            room = [(mid * ri - 1) / (n - 2) for ri in r]
            lo, hi = (lo, mid) if min(room) >= 0 and sum(room) >= 1 else (mid, hi)
        assert t == pytest.approx(hi, rel=1e-9)
        assert sum(x) == pytest.approx(1) and min(x) >= 0
        assert all(1 + (n - 2) * xi <= t * ri * (1 + 1e-9) for xi, ri in zip(x, r))
        w = integer_weights(x)
        assert sum(w) == 1024 * n and all(abs(wi - xi * 1024 * n) < 1 for wi, xi in zip(w, x))


@pytest.mark.parametrize("n, factor", [(3, 4 / 3), (4, 1.5)])
def test_star_allreduce_beats_the_ring(n, factor):
    """Research note A.6 case 2: one node at 1/4 of the others' rate owns nothing, and the all-reduce
    simulates within 5 % of the ring formula's factor (1.33x at N = 3, 1.5x at N = 4); the LP's time is
    the cut bound S / r_slow."""
    rates = [200 * MBIT] * (n - 1) + [50 * MBIT]
    links = LinkMap.star(rates)
    s = synthesize("all_reduce", links)
    _verify(s)
    assert s.meta["shard_weights"][-1] == 0
    ring = 2 * (n - 1) / n * M / (50 * MBIT)
    t = simulate(s, links, M)
    assert ring / t >= 0.95 * factor, (ring / t, s.name)
    assert t >= bound("allreduce", links, M)
    assert bound("allreduce", links, M) == pytest.approx(M / (50 * MBIT))  # S / r_slow
    assert s.meta["seconds_per_byte"] * M == pytest.approx(M / (50 * MBIT))


@pytest.mark.parametrize("rates", [[200, 50], [50, 200], [200, 200, 200], [100] * 4])
def test_star_allreduce_equal_shards_where_nothing_wins(rates):
    """Two nodes (any rates) or a uniform star: equal shards, and never slower than the equal-shard
    direct all-reduce (research note A.6 case 1)."""
    links = LinkMap.star([r * MBIT for r in rates])
    s = synthesize("allreduce", links)
    _verify(s)
    assert len(set(s.meta["shard_weights"])) == 1
    direct = direct_schedule("allreduce", [1] * len(rates))
    _verify(direct)
    assert simulate(s, links, M) <= simulate(direct, links, M) * (1 + 1e-9)
    n, r = len(rates), min(rates) * MBIT
    if len(set(rates)) == 1:  # the volume bound is the ring's time: 2 (N - 1) / N S / r
        assert bound("allreduce", links, M) == pytest.approx(2 * (n - 1) / n * M / r)
    for k in (1, 4):
        _verify(star_allreduce(links, chunks_per_shard=k, serial=k == 4))


def test_direct_schedules_check():
    """The direct schedules (unequal shards with empty ones; pieces; serial) pass the checker, and
    equal shards are required for reduce-scatter and all-gather."""
    for coll in COLLS:
        for n in (2, 3, 5):
            for k in (1, 3):
                for serial in (False, True):
                    _verify(direct_schedule(coll, [2] * n, k, serial=serial))
    _verify(direct_schedule("allreduce", [0, 3, 1, 0], 2, serial=True))
    with pytest.raises(ScheduleError, match="equal shards"):
        direct_schedule("reducescatter", [1, 2])


# ------------------------------------------------------------------------------------------ triangle
def test_triangle_bounds_and_tacos_beat_the_ring():
    """Research note A.6 case 4, the triangle A-B 200, B-C 200, A-C 50 Mbit: the all-gather and
    reduce-scatter cut bound is M / 375 (Mbit, seconds), the all-reduce's volume bound M / 225 (4M over
    900 Mbit/s of links; its best cut M / 250); TACOS simulates at
    least 2x a ring in either direction, simulated or by its formula (each pays (N - 1) M/N per phase
    over the 50 Mbit link), for all three collectives, and never below the bound."""
    links = _triangle()
    mbit = M * 8 / 1e6
    assert bound("allgather", links, M) == pytest.approx(mbit / 375)
    assert bound("reduce_scatter", links, M) == pytest.approx(mbit / 375)
    assert bound("allreduce", links, M) == pytest.approx(mbit / 225)
    ring_phase = 2 * (M / 3) / (50 * MBIT)
    for coll, phases in (("allgather", 1), ("reducescatter", 1), ("allreduce", 2)):
        s = synthesize(coll, links)
        _verify(s)
        t = simulate(s, links, M)
        ring = min([phases * ring_phase] + [simulate_ring(coll, links, M, order) for order in ([0, 1, 2], [0, 2, 1])])
        assert ring / t >= 2.0, (coll, ring / t)
        assert t >= bound(coll, links, M) * (1 - 1e-9)


def test_tacos_variants_check():
    """Every TACOS variant (chunks, seeds, chained or not; star ports and meshes; the time-reversed
    reduce-scatter and the all-reduce) passes the checker; a disconnected mesh is refused."""
    rng = random.Random(7)
    maps = [_triangle(), LinkMap.star([200 * MBIT, 50 * MBIT, 100 * MBIT, 200 * MBIT], [100 * MBIT] * 4)]
    maps += [_random_links(rng, rng.randint(2, 5)) for _ in range(6)]
    for links in maps:
        for build in (tacos_allgather, tacos_reducescatter, tacos_allreduce):
            for k in (1, 3):
                for chain in (True, False):
                    _verify(build(links, chunks_per_rank=k, seed=k, chain=chain))
    cut = LinkMap.mesh(3, {(0, 1): 1.0, (1, 0): 1.0, (1, 2): 1.0})
    with pytest.raises(ScheduleError, match="strongly connected"):
        tacos_allgather(cut)
    with pytest.raises(ValueError, match="no link"):
        bound("allgather", cut, 100)


# ------------------------------------------------------------------------------------------ fuzz
def test_fuzz_synthesized_schedules_check_and_respect_the_bound():
    """Random stars (asymmetric ports too) and meshes of 2..6 nodes: every synthesized schedule passes
    the checker, and its simulated time is never below the cut bound, at sizes that divide by nothing."""
    rng = random.Random(11)
    for trial in range(30):
        n = rng.randint(2, 6)
        links = _random_links(rng, n)
        nbytes = rng.choice([1, 1000, 100_003, M + 7])
        for coll in COLLS:
            s = synthesize(coll, links, seed=trial, nbytes=max(nbytes, 1024))
            _verify(s)
            assert simulate(s, links, nbytes) >= bound(coll, links, nbytes) * (1 - 1e-9), (coll, links, nbytes)


# ------------------------------------------------------------------------------------------ dispatcher
def test_synthesize_names_and_dispatch():
    """Both spellings of each collective; a star all-reduce is the unequal-shard one, a star RS/AG
    the faster of TACOS and direct, a mesh TACOS; one node is an empty schedule; unknown names fail."""
    star = LinkMap.star([200 * MBIT, 200 * MBIT, 50 * MBIT])
    for a, b in (("allreduce", "all_reduce"), ("reducescatter", "reduce_scatter"), ("allgather", "all_gather")):
        s1, s2 = synthesize(a, star), synthesize(b, star)
        assert s1.collective == s2.collective == a and s1.to_json() == s2.to_json()
    assert synthesize("allreduce", star).meta["synthesizer"] == "star_allreduce"
    assert synthesize("allgather", star).meta["synthesizer"] in ("tacos", "direct")
    assert synthesize("allgather", _triangle()).meta["synthesizer"] == "tacos"
    assert synthesize("allreduce", star, chunks=2).meta["pieces"] == 2
    assert synthesize("allgather", _triangle(), chunks=3).nchunks == 9
    one = synthesize("allreduce", LinkMap.star([1.0]))
    _verify(one)
    with pytest.raises(ValueError, match="unknown collective"):
        synthesize("broadcast", star)


def test_synthesis_of_16_ranks():
    """Synthesis for 16 ranks on a star and on a mesh, every collective: a checked schedule (its time is
    the benchmark's to print, never a test's to assert: ``commopt-bench simulate --synth``)."""
    rng = random.Random(5)
    star = LinkMap.star([rng.choice([50, 100, 200]) * MBIT for _ in range(16)])
    mesh = LinkMap.mesh(16, {(i, j): rng.uniform(50, 200) * MBIT for i in range(16) for j in range(16) if i != j})
    for links in (star, mesh):
        for coll in COLLS:
            _verify(synthesize(coll, links))


# ------------------------------------------------------------------------------------------ pricing
@pytest.mark.parametrize("rates, nodes", [([200, 200, 200, 50], [[0], [1], [2], [3]]),
                                          ([200, 200, 50], [[0], [1], [2]]),
                                          ([200, 200, 50], [[0, 1], [2, 3], [4, 5]])])
def test_model_only_auto_prices_the_executors_steps(rates, nodes):
    """A model-only ``auto`` (no calibration: the model the runtime builds from the link map) prices synth
    at the larger of its simulated time and its busiest rank's steps x ``EXECUTOR_STEP``: at 64 KiB on the
    4x1 star the 80-step schedule is priced by its steps and ``auto`` runs a ring (it ran 1.7x slower than
    flat there, docs/results.md 31); from 256 KiB up every star takes synth, from 1 MiB up the bytes alone
    decide its price, as the measurements did. Oracles: the simulator, the schedule's own step count, the
    other algorithms' costs."""
    from commopt.comm import algorithms, cost
    from commopt.comm.algorithms.synth import EXECUTOR_STEP, rail_links, schedule_for
    from commopt.comm.links import CostModel
    from commopt.comm.topology import Topology

    topo = Topology(nodes=nodes, rank=0, world_size=sum(map(len, nodes)),
                    links=LinkMap.star([r * MBIT for r in rates]))
    model = CostModel(cost.DEFAULT_INTRA, cost._inter_default(topo))
    cands = [a for a in algorithms.candidates("allreduce")
             if algorithms.get(a).supports(topo, "allreduce") is None and algorithms.get(a).considered(topo)]
    assert "synth" in cands
    for size in (64 << 10, 256 << 10, 1 << 20, 16 << 20):
        shard = size // len(nodes[0])
        links = rail_links(topo, 0)
        sched = schedule_for("allreduce", links, shard)
        floor = EXECUTOR_STEP * max(len(s) for s in sched.steps)
        sim = simulate(sched, links, shard)
        price = cost.predict("synth", size, topo, model)
        intra = price - max(sim, floor)  # the intra-node phases (none on one rank per node)
        assert intra > 0 if len(nodes[0]) > 1 else intra == pytest.approx(0, abs=1e-12)
        others = min(cost.predict(a, size, topo, model) for a in cands if a != "synth")
        chose = cost.choose(cands, size, topo, model)
        assert (chose == "synth") == (price < others), (size, price, others, chose)
        if size >= 256 << 10:
            assert chose == "synth", (size, price, others)
        if size >= 1 << 20:
            assert floor < sim, (size, floor, sim)  # the bytes decide
    if len(nodes) == 4:  # 64 KiB on 4x1: the steps decide, and a ring runs
        small = schedule_for("allreduce", rail_links(topo, 0), 64 << 10)
        steps = max(len(s) for s in small.steps)
        assert EXECUTOR_STEP * steps > simulate(small, rail_links(topo, 0), 64 << 10)
        assert cost.choose(cands, 64 << 10, topo, model) != "synth"
