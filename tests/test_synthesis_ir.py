"""The schedule IR, its checker, its simulator and the msccl-tools XML importer (comm/synthesis: ir.py,
check.py, sim.py, msccl.py). FAULTS row 46 ("a schedule that fails its checker: a missing chunk, a
double-counted contribution, unpaired sends, a cycle ... refused, naming the broken condition"): the
checker's half, each condition's message (the executor's refusal is tested with the executor).

Pure Python, no process groups. Oracles: the ring written by hand from rank arithmetic, and random relay
and reduction trees built from their edges, are correct by construction and must pass; each broken
condition is made by hand and must be refused with its name; the ring's time is the closed form
``steps * (alpha + S / (N rate))``; shared ports are checked against closed forms of max-min sharing; the
XML programs are msccl-tools' own compiler output.
"""

from __future__ import annotations

import random

import pytest

from commopt.comm.links import LinkMap
from commopt.comm.synthesis.check import check, infer_deps
from commopt.comm.synthesis.ir import Schedule, ScheduleError, Step
from commopt.comm.synthesis.msccl import from_msccl_xml
from commopt.comm.synthesis.sim import link_bytes, ring_schedule, simulate, simulate_ring

COLLS = ("allreduce", "reducescatter", "allgather")
RATE, ALPHA = 1e6, 1e-4  # bytes/s, seconds per message


def _hand_ring(coll: str, n: int) -> Schedule:
    """The ring on ranks 0..N-1 (rank r sends to r + 1), one chunk per rank, written from its arithmetic:
    reduce-scatter step s: send chunk r - s - 1, add chunk r - s - 2 arriving from r - 1 (after N - 1 steps
    rank r holds the sum of chunk r); all-gather step s: send chunk r - s, receive chunk r - s - 1. Every
    step depends on the one before it (a chain: race-free, and no slower in lockstep)."""
    steps = []
    for r in range(n):
        ops = []
        if coll != "allgather":
            for s in range(n - 1):
                ops += [("send", (r + 1) % n, (r - s - 1) % n), ("rrc", (r - 1) % n, (r - s - 2) % n)]
        if coll != "reducescatter":
            for s in range(n - 1):
                ops += [("send", (r + 1) % n, (r - s) % n), ("recv", (r - 1) % n, (r - s - 1) % n)]
        steps.append([Step(op, peer, (c,), (i - 1,) if i else ()) for i, (op, peer, c) in enumerate(ops)])
    return Schedule(coll, n, [1] * n, steps, name="hand ring")


def _uniform(kind: str, n: int) -> LinkMap:
    if kind == "star":
        return LinkMap.star([RATE] * n, alpha=ALPHA)
    return LinkMap.mesh(n, {(i, j): RATE for i in range(n) for j in range(n) if i != j}, alpha=ALPHA)


def _random_trees(coll: str, n: int, per_rank: int, rng: random.Random):
    """A random valid schedule and its transfers (sender, receiver, chunk, op): every chunk's reduction
    runs up a random tree to its owner (a random rank for all-reduce, the shard's rank otherwise), each
    node adding its children's partial sums before sending its own up; then it spreads from the owner
    along a random relay tree. The chunks' transfers are interleaved at random; deps by infer_deps."""
    nchunks = n * per_rank
    if coll == "allreduce":
        weights = [rng.randint(1, 5) for _ in range(nchunks)]
    else:  # random chunk sizes, every shard of weight 12
        weights = []
        for _ in range(n):
            cuts = sorted(rng.sample(range(1, 12), per_rank - 1))
            weights += [b - a for a, b in zip([0] + cuts, cuts + [12])]
    seqs = []
    for c in range(nchunks):
        owner = rng.randrange(n) if coll == "allreduce" else c // per_rank
        others = [r for r in range(n) if r != owner]
        seq = []
        if coll != "allgather":
            placed, parent = [owner], {}
            for v in rng.sample(others, n - 1):
                parent[v] = rng.choice(placed)
                placed.append(v)
            seq += [(v, parent[v], c, "rrc") for v in reversed(placed[1:])]
        if coll != "reducescatter":
            have = [owner]
            for v in rng.sample(others, n - 1):
                seq.append((rng.choice(have), v, c, "recv"))
                have.append(v)
        seqs.append(seq)
    transfers, pos, live = [], [0] * nchunks, [c for c in range(nchunks) if seqs[c]]
    while live:
        c = rng.choice(live)
        transfers.append(seqs[c][pos[c]])
        pos[c] += 1
        if pos[c] == len(seqs[c]):
            live.remove(c)
    return _from_transfers(coll, n, weights, transfers), transfers


def _from_transfers(coll, n, weights, transfers) -> Schedule:
    steps = [[] for _ in range(n)]
    for u, v, c, op in transfers:
        steps[u].append(Step("send", v, (c,)))
        steps[v].append(Step(op, u, (c,)))
    return Schedule(coll, n, list(weights), infer_deps(steps))


def _simulate_above_link_loads(sched: Schedule, rng: random.Random) -> None:
    """On a random mesh and a random star the simulated time is at least every link's (port's) bytes over
    its rate (each byte crosses it once, at most at its rate) plus one alpha."""
    n, nbytes = sched.nranks, 1 << 16
    loads = link_bytes(sched, nbytes)
    mesh = LinkMap.mesh(n, {(i, j): rng.uniform(1e5, 1e7) for i in range(n) for j in range(n) if i != j}, alpha=ALPHA)
    floor = max(b / mesh.rate(i, j) for (i, j), b in loads.items())
    assert simulate(sched, mesh, nbytes) >= floor + ALPHA - 1e-12
    up = [rng.uniform(1e5, 1e7) for _ in range(n)]
    star = LinkMap.star(up, [rng.uniform(1e5, 1e7) for _ in range(n)], alpha=ALPHA)
    port = [sum(b for (i, _), b in loads.items() if i == r) / star.up[r] for r in range(n)]
    port += [sum(b for (_, j), b in loads.items() if j == r) / star.down[r] for r in range(n)]
    assert simulate(sched, star, nbytes) >= max(port) + ALPHA - 1e-12


def _refused(sched: Schedule, *needles: str) -> str:
    with pytest.raises(ScheduleError) as e:
        check(sched)
    msg = str(e.value)
    for needle in needles:
        assert needle in msg, msg
    return msg


# ------------------------------------------------------------------------------------------- JSON
def test_json_round_trip_keeps_every_field():
    sched = _hand_ring("allreduce", 3)
    sched.meta = {"seed": 7}
    sched.min_message_size, sched.max_message_size = 1024, 1 << 30
    back = Schedule.from_json(sched.to_json())
    assert back == sched
    check(back)
    with pytest.raises(ScheduleError, match="does not parse"):
        Schedule.from_json("{")


# ------------------------------------------------------------------------------------------- correct ones
@pytest.mark.parametrize("coll", COLLS)
@pytest.mark.parametrize("n", [2, 3, 4])
def test_rings_pass_and_take_the_ring_formula(coll, n):
    """The hand ring and the library's ring pass; on a uniform star and mesh both take the closed form
    steps * (alpha + S / (N rate)), steps = 2(N - 1) for all-reduce, N - 1 otherwise; each ring edge
    carries (N - 1)/N S per pass."""
    nbytes = 12 * 1024
    passes = 2 if coll == "allreduce" else 1
    formula = passes * (n - 1) * (ALPHA + nbytes / n / RATE)
    for sched in (_hand_ring(coll, n), ring_schedule(coll, n)):
        check(sched)
        for kind in ("star", "mesh"):
            assert simulate(sched, _uniform(kind, n), nbytes) == pytest.approx(formula, rel=1e-9)
        edges = {(r, (r + 1) % n): passes * (n - 1) * nbytes // n for r in range(n)}
        assert link_bytes(sched, nbytes) == edges
    order = list(range(n))[::-1]
    check(ring_schedule(coll, n, order))
    assert simulate_ring(coll, _uniform("star", n), nbytes, order) == pytest.approx(formula, rel=1e-9)


def test_one_rank_and_multi_chunk_messages():
    check(Schedule("allreduce", 1, [3, 1], [[]]))
    # all-gather of 2 ranks with two chunks per shard, each shard sent in one message
    steps = [[Step("send", 1, (0, 1)), Step("recv", 1, (2, 3))], [Step("recv", 0, (0, 1)), Step("send", 0, (2, 3))]]
    sched = Schedule("allgather", 2, [1, 2, 2, 1], steps)
    check(sched)
    assert link_bytes(sched, 28) == {(0, 1): 14, (1, 0): 14}  # chunk edges at bytes 0, 4, 14, 23, 28
    assert link_bytes(sched, 28, itemsize=4) == {(0, 1): 12, (1, 0): 16}  # 7 elements: edges at 0, 1, 3, 5, 7


# ------------------------------------------------------------------------------------------- broken ones
def test_well_formed_conditions_are_named():
    ok = _hand_ring("allgather", 3)

    def with_step(rank, index, step, coll="allgather"):
        steps = [list(s) for s in ok.steps]
        steps[rank][index] = step
        return Schedule(coll, 3, [1, 1, 1], steps)

    _refused(Schedule("alltoall", 3, [1, 1, 1], ok.steps), "well-formed", "alltoall")
    _refused(Schedule("allgather", 3, [1, 0, 1], ok.steps), "well-formed", "positive")
    _refused(Schedule("allgather", 3, [1, 1, 1], ok.steps[:2]), "well-formed", "one per rank")
    _refused(with_step(1, 0, Step("put", 2, (1,))), "well-formed", "rank 1 step 0", "'put'")
    _refused(with_step(1, 0, Step("send", 1, (1,))), "well-formed", "rank 1 step 0", "peer 1")
    _refused(with_step(1, 0, Step("send", 2, (3,))), "well-formed", "rank 1 step 0", "chunk 3")
    _refused(with_step(1, 0, Step("send", 2, ())), "well-formed", "carries no chunk")
    _refused(with_step(1, 0, Step("send", 2, (1, 1))), "well-formed", "twice")
    _refused(with_step(1, 1, Step("recv", 0, (0,), (1,))), "well-formed", "rank 1 step 1", "depends on 1")
    _refused(with_step(1, 1, Step("rrc", 0, (0,), (0,))), "well-formed", "rrc", "all-gather")


def test_straddling_chunk_is_refused():
    # reduce-scatter over 2 ranks: shards are weights [0, 1.5) and [1.5, 3); chunk 1 spans [1, 2)
    steps = [[Step("send", 1, (1, 2)), Step("rrc", 1, (0,))], [Step("rrc", 0, (1, 2)), Step("send", 0, (0,))]]
    _refused(Schedule("reducescatter", 2, [1, 1, 1], steps), "well-formed", "chunk 1", "straddles shards 0 and 1")


def test_wrong_pairing_is_refused():
    """FAULTS 46: unpaired sends (another chunk; one receive too few)."""
    ok = _hand_ring("allgather", 3)
    steps = [list(s) for s in ok.steps]
    steps[0][0] = Step("send", 1, (2,))  # rank 1 step 1 receives chunk 0 from rank 0
    _refused(Schedule("allgather", 3, [1, 1, 1], steps), "pairing: message 0 from rank 0 to rank 1",
             "rank 0 step 0 (send to 1, chunks [2])", "rank 1 step 1 (recv from 0, chunks [0])")
    steps = [list(s) for s in ok.steps]
    steps[2] = steps[2][:-1]  # rank 2 drops its last receive from rank 1
    _refused(Schedule("allgather", 3, [1, 1, 1], steps), "pairing: rank 1 sends 2 messages to rank 2 but rank 2 "
             "posts 1 receives from rank 1", "the first unmatched: rank 1 step 2 (send to 2")


def test_race_is_refused():
    # rank 1 relays chunk 0 to rank 2 without waiting for its arrival from rank 0
    steps = [[Step("send", 1, (0,))], [Step("recv", 0, (0,)), Step("send", 2, (0,)), Step("recv", 2, (2,))],
             [Step("recv", 1, (0,)), Step("send", 1, (2,))]]
    msg = _refused(Schedule("allgather", 3, [1, 1, 1], steps), "race at rank 1",
                   "rank 1 step 0 (recv from 0, chunks [0])", "rank 1 step 1 (send to 2, chunks [0])",
                   "chunk 0", "add 0 to the deps of step 1")
    assert "step 0 writes it, step 1 reads it" in msg
    steps[1][1] = Step("send", 2, (0,), (0,))
    with pytest.raises(ScheduleError, match="postcondition"):  # no race now; the rest is not an all-gather
        check(Schedule("allgather", 3, [1, 1, 1], steps))
    # two receives into one chunk, unordered
    two = [[Step("send", 1, (0,))], [Step("recv", 0, (0,)), Step("recv", 2, (0,))], [Step("send", 1, (0,))]]
    _refused(Schedule("allreduce", 3, [1], two), "race at rank 1", "both write it")


def test_deadlock_is_refused_with_its_cycle():
    """FAULTS 46: a cycle, named step by step (the simulator stalls on it too)."""
    # each rank waits for the other's chunk before sending its own
    steps = [[Step("recv", 1, (1,)), Step("send", 1, (0,), (0,))], [Step("recv", 0, (0,)), Step("send", 0, (1,), (0,))]]
    sched = Schedule("allgather", 2, [1, 1], steps)
    msg = _refused(sched, "deadlock", "cycle")
    for step in ("rank 0 step 0 (recv from 1", "rank 0 step 1 (send to 1", "rank 1 step 0 (recv from 0",
                 "rank 1 step 1 (send to 0"):
        assert step in msg, msg
    with pytest.raises(ScheduleError, match="deadlock"):
        simulate(sched, _uniform("star", 2), 1000)


def test_double_count_is_refused():
    """FAULTS 46: a double-counted contribution."""
    # rank 0's contribution to chunk 0 reaches rank 1 twice
    steps = [[Step("send", 1, (0,)), Step("send", 1, (0,))], [Step("rrc", 0, (0,)), Step("rrc", 0, (0,), (0,))]]
    _refused(Schedule("reducescatter", 2, [1, 1], steps), "double count at rank 1 step 1 (rrc from 0, chunks [0])",
             "chunk 0", "ranks [0]")


def test_missing_chunk_and_contribution_are_refused():
    """FAULTS 46: a missing chunk (all-gather) or contribution (all-reduce, reduce-scatter)."""
    # the ring all-gather of 3 ranks without its last transfer, 2 -> 0 of chunk 1
    ring = [(r, (r + 1) % 3, r, "recv") for r in range(3)] + [(r, (r + 1) % 3, (r - 1) % 3, "recv") for r in range(2)]
    _refused(_from_transfers("allgather", 3, [1, 1, 1], ring), "postcondition (allgather): rank 0 never receives "
             "chunk 1 (shard 1)")
    # all-gather: a relay that forwards a chunk it does not hold yet
    steps = [[Step("send", 1, (1,))], [Step("recv", 0, (1,))]]
    _refused(Schedule("allgather", 2, [1, 1], steps), "postcondition (allgather): rank 0 step 0 (send to 1, "
             "chunks [1]) sends chunk 1, which rank 0 does not hold yet")
    # all-reduce with the reduce-scatter only: rank 1 lacks chunk 0's sum (rank 0 holds it)
    rs = _hand_ring("reducescatter", 2)
    _refused(Schedule("allreduce", 2, [1, 1], rs.steps), "postcondition (allreduce): rank 1 ends with chunk 0 lacking "
             "the contributions of ranks [0]")
    _refused(Schedule("reducescatter", 2, [1, 1], [[], []]), "postcondition (reducescatter): rank 0 ends with chunk 0")


def test_sum_computed_by_two_ranks_is_refused():
    """Both ranks add the other's contribution: each holds the full sum, computed twice (a + b and b + a
    may differ in the last bits in floating point)."""
    steps = [[Step("send", 1, (0,)), Step("rrc", 1, (0,), (0,))], [Step("send", 0, (0,)), Step("rrc", 0, (0,), (0,))]]
    _refused(Schedule("allreduce", 2, [1], steps), "postcondition (allreduce): chunk 0's full sum is computed more "
             "than once", "rank 0 step 1 (rrc from 1", "rank 1 step 1 (rrc from 0", "compute it once at one owner")


# ------------------------------------------------------------------------------------------- fuzz
@pytest.mark.parametrize("coll", COLLS)
def test_fuzz_random_trees_pass_and_single_mutations_are_caught(coll):
    rng = random.Random(f"synth-ir-{coll}")
    for trial in range(40):
        n = rng.randint(2, 6)
        sched, transfers = _random_trees(coll, n, rng.randint(1, 3), rng)
        check(sched)
        _simulate_above_link_loads(sched, rng)
        kind = rng.choice(["chunk", "peer", "drop", "race"] + (["double"] if coll != "allgather" else []))
        steps = [list(s) for s in sched.steps]
        if kind == "chunk":  # a send carries another chunk than its receive expects
            r = rng.choice([r for r in range(n) if any(s.op == "send" for s in steps[r])])
            i = rng.choice([i for i, s in enumerate(steps[r]) if s.op == "send"])
            c = rng.choice([c for c in range(sched.nchunks) if c != steps[r][i].chunks[0]])
            steps[r][i] = Step("send", steps[r][i].peer, (c,), steps[r][i].deps)
            expect, bad = "pairing", Schedule(coll, n, sched.weights, steps)
        elif kind == "peer":
            r = rng.choice([r for r in range(n) if any(s.op == "send" for s in steps[r])])
            i = rng.choice([i for i, s in enumerate(steps[r]) if s.op == "send"])
            if n == 2:
                steps[r][i] = Step("recv", steps[r][i].peer, steps[r][i].chunks, steps[r][i].deps)
            else:
                p = rng.choice([p for p in range(n) if p not in (r, steps[r][i].peer)])
                steps[r][i] = Step("send", p, steps[r][i].chunks, steps[r][i].deps)
            expect, bad = "pairing", Schedule(coll, n, sched.weights, steps)
        elif kind == "drop":  # a transfer of the trees goes missing
            k = rng.randrange(len(transfers))
            expect, bad = "postcondition", _from_transfers(coll, n, sched.weights, transfers[:k] + transfers[k + 1:])
        elif kind == "race":  # a relay's send stops waiting for the receive of its chunk
            relays = [(r, i) for r in range(n) for i, s in enumerate(steps[r]) if s.op == "send" and any(
                steps[r][d].op != "send" and set(steps[r][d].chunks) & set(s.chunks) for d in s.deps)]
            if not relays:
                continue
            r, i = rng.choice(relays)
            steps[r][i] = Step("send", steps[r][i].peer, steps[r][i].chunks, ())
            expect, bad = "race", Schedule(coll, n, sched.weights, steps)
        else:  # a reduction edge into the owner (all-reduce: any edge) runs twice
            u, v, c, _ = rng.choice([t for t in transfers if t[3] == "rrc"])
            if coll == "reducescatter":
                u, v, c, _ = rng.choice([t for t in transfers if t[3] == "rrc" and t[1] == sched.shard_of(t[2])])
            expect, bad = "double count", _from_transfers(coll, n, sched.weights, transfers + [(u, v, c, "rrc")])
        with pytest.raises(ScheduleError) as e:
            check(bad)
        assert str(e.value).startswith(expect), (trial, kind, str(e.value))


def test_large_schedules_check_and_simulate():
    """16 ranks, thousands of steps: the checker's bitset closure and the simulator's event loop (the
    durations are reported, not asserted)."""
    rng = random.Random(16)
    sched, _ = _random_trees("allreduce", 16, 12, rng)
    assert sum(len(s) for s in sched.steps) == 16 * 12 * 30 * 2
    check(sched)
    mesh = LinkMap.mesh(16, {(i, j): rng.uniform(1e6, 4e6) for i in range(16) for j in range(16) if i != j})
    assert simulate(sched, mesh, 1 << 24) > 0


# ------------------------------------------------------------------------------------------- simulator
def test_star_ports_share_max_min_fairly():
    """Rank 0 sends b to rank 1 and 3b to rank 2 at once through one up port of rate R: both at R/2 until
    the first ends at 2b/R, then the second alone at R: (b + 3b)/R in all, alpha paid once by each."""
    b = 1000
    steps = [[Step("send", 1, (0,)), Step("send", 2, (1, 2, 3))], [Step("recv", 0, (0,))], [Step("recv", 0, (1, 2, 3))]]
    sched = Schedule("allreduce", 3, [1, 1, 1, 1], steps)
    star = LinkMap.star([RATE] * 3, alpha=ALPHA)
    assert simulate(sched, star, 4 * b) == pytest.approx(ALPHA + 4 * b / RATE)
    # on a mesh the two links are independent: the larger message decides
    assert simulate(sched, _uniform("mesh", 3), 4 * b) == pytest.approx(ALPHA + 3 * b / RATE)
    # a slow down port at rank 2 (R/4) holds its flow there; rank 1's flow takes the rest of the up port
    slow = LinkMap.star([RATE] * 3, [RATE, RATE, RATE / 4], alpha=ALPHA)
    assert simulate(sched, slow, 4 * b) == pytest.approx(ALPHA + 3 * b / (RATE / 4))
    # one direction per port: 0 -> 1 and 1 -> 0 at once do not share anything
    pair = Schedule("allgather", 2, [1, 1], [[Step("send", 1, (0,)), Step("recv", 1, (1,))],
                                             [Step("send", 0, (1,)), Step("recv", 0, (0,))]])
    assert simulate(pair, LinkMap.star([RATE] * 2, alpha=ALPHA), 2 * b) == pytest.approx(ALPHA + b / RATE)


def test_messages_of_a_pair_go_one_at_a_time_and_links_must_exist():
    b = 1000
    steps = [[Step("send", 1, (0,)), Step("send", 1, (1,))], [Step("recv", 0, (0,)), Step("recv", 0, (1,))]]
    sched = Schedule("allreduce", 2, [1, 1], steps)
    for kind in ("star", "mesh"):  # both sends start at 0; the second waits for the first
        assert simulate(sched, _uniform(kind, 2), 2 * b) == pytest.approx(2 * (ALPHA + b / RATE))
    with pytest.raises(ScheduleError, match="no link 0->1"):
        simulate(sched, LinkMap.mesh(2, {(1, 0): RATE}), 2 * b)
    with pytest.raises(ScheduleError, match="3 nodes"):
        simulate(sched, _uniform("star", 3), 2 * b)


def test_relay_beats_the_slow_link_on_the_triangle():
    """Direct-connect triangle A-B 200, B-C 200, A-C 50 (research note A.6 case 4): an all-gather that
    relays A <-> C through B is faster than one that uses the slow link, as the simulator must show."""
    mbit = 1e6 / 8
    tri = LinkMap.mesh(3, {(0, 1): 200 * mbit, (1, 0): 200 * mbit, (1, 2): 200 * mbit, (2, 1): 200 * mbit,
                           (0, 2): 50 * mbit, (2, 0): 50 * mbit}, alpha=0.0)
    direct = _from_transfers("allgather", 3, [1, 1, 1], [(0, 1, 0, "recv"), (0, 2, 0, "recv"), (1, 0, 1, "recv"),
                                                          (1, 2, 1, "recv"), (2, 0, 2, "recv"), (2, 1, 2, "recv")])
    relay = _from_transfers("allgather", 3, [1, 1, 1], [(0, 1, 0, "recv"), (2, 1, 2, "recv"), (1, 0, 1, "recv"),
                                                         (1, 2, 1, "recv"), (1, 2, 0, "recv"), (1, 0, 2, "recv")])
    for sched in (direct, relay):
        check(sched)
    m = 3 << 20
    assert simulate(direct, tri, m) == pytest.approx(m / 3 / (50 * mbit))  # A -> C alone on the slow link
    assert simulate(relay, tri, m) == pytest.approx(2 * (m / 3) / (200 * mbit))  # two shards per B link, in turn


# ------------------------------------------------------------------------------------------- msccl XML
def test_msccl_ring_allreduce_imports_checks_and_runs_as_the_ring():
    sched = from_msccl_xml(AR_RING_3)
    check(sched)
    assert (sched.collective, sched.nranks, sched.weights, sched.name) == ("allreduce", 3, [1, 1, 1],
                                                                           "allreduce_ring_inplace")
    # rank 0's one threadblock (send 1, recv 2): s i0, rrs i2, rrcs i1, rcs i0, r i2
    assert [(s.op, s.peer, s.chunks) for s in sched.steps[0]] == [
        ("send", 1, (0,)), ("rrc", 2, (2,)), ("send", 1, (2,)), ("rrc", 2, (1,)), ("send", 1, (1,)),
        ("recv", 2, (0,)), ("send", 1, (0,)), ("recv", 2, (2,))]
    assert all(s.deps == ((i - 1,) if i else ()) for i, s in enumerate(sched.steps[0]))  # a tb runs in order
    star, nbytes = _uniform("star", 3), 3 * 4096
    assert simulate(sched, star, nbytes) == pytest.approx(simulate_ring("allreduce", star, nbytes), rel=1e-9)
    assert Schedule.from_json(sched.to_json()) == sched


def test_msccl_ring_allgather_imports_and_checks():
    sched = from_msccl_xml(AG_RING_4)
    check(sched)
    assert (sched.collective, sched.nranks, sched.nchunks) == ("allgather", 4, 4)
    assert [(s.op, s.peer, s.chunks) for s in sched.steps[1]] == [
        ("send", 2, (1,)), ("recv", 0, (0,)), ("send", 2, (0,)), ("recv", 0, (3,)), ("send", 2, (3,)),
        ("recv", 0, (2,))]
    mesh, nbytes = _uniform("mesh", 4), 4 * 4096
    assert simulate(sched, mesh, nbytes) == pytest.approx(3 * (ALPHA + nbytes / 4 / RATE))


def test_msccl_halving_doubling_and_out_of_place_ring_import(tmp_path):
    """Recursive halving-doubling (``rrc`` of two chunks, dependencies across threadblocks) and an
    out-of-place all-gather whose chunks between one pair travel on three channels (one ordered stream in
    the IR) and whose own shard is copied input -> output (no IR step)."""
    hd = from_msccl_xml(AR_HALVING_DOUBLING_4)
    check(hd)
    assert ("rrc", 2, (0, 1)) in [(s.op, s.peer, s.chunks) for s in hd.steps[0]]
    path = tmp_path / "ag.xml"
    path.write_text(AG_RING_OUT_OF_PLACE_4)
    ag = from_msccl_xml(path)
    check(ag)
    assert sum(len(s) for s in ag.steps) == 2 * 4 * 3  # 12 transfers; the 4 copies vanished
    assert [s.chunks for s in ag.steps[0] if s.op == "send"] == [(0,), (3,), (2,)]
    assert [s.chunks for s in ag.steps[1] if s.op != "send"] == [(0,), (3,), (2,)]


def _xml(steps0: str, steps1: str, coll: str = "allreduce", extra: str = "") -> str:
    return (f'<algo name="t" proto="Simple" nchannels="2" nchunksperloop="2" ngpus="2" coll="{coll}" inplace="1">'
            f'<gpu id="0" i_chunks="2" o_chunks="2" s_chunks="2">{steps0}</gpu>'
            f'<gpu id="1" i_chunks="2" o_chunks="2" s_chunks="2">{steps1}{extra}</gpu></algo>')


def _st(s: int, typ: str, buf: str = "i", off: int = 0, dbuf: str | None = None, doff: int | None = None,
        dep: tuple[int, int] = (-1, -1), cnt: int = 1) -> str:
    return (f'<step s="{s}" type="{typ}" srcbuf="{buf}" srcoff="{off}" dstbuf="{dbuf or buf}" '
            f'dstoff="{off if doff is None else doff}" cnt="{cnt}" depid="{dep[0]}" deps="{dep[1]}" hasdep="0"/>')


def test_msccl_constructs_the_ir_cannot_express_are_named():
    send = f'<tb id="0" send="1" recv="-1" chan="0">{_st(0, "s")}</tb>'
    recv = f'<tb id="0" send="-1" recv="0" chan="0">{_st(0, "r")}</tb>'
    ok = _xml(send, recv)
    with pytest.raises(ScheduleError, match="postcondition"):  # imports; an incomplete all-reduce
        check(from_msccl_xml(ok))
    cases = [
        (ok.replace('coll="allreduce"', 'coll="alltoall"'), "coll='alltoall'"),
        (_xml(send, f'<tb id="0" send="-1" recv="0" chan="0">{_st(0, "r", "s")}</tb>'), "scratch buffer"),
        (_xml(send, recv, extra=f'<tb id="1" send="-1" recv="-1" chan="0">{_st(0, "re", "i", 0, "i", 1)}</tb>'),
         "type='re'"),
        (_xml(send, recv, extra=f'<tb id="1" send="-1" recv="-1" chan="0">{_st(0, "cpy", "i", 0, "i", 1)}</tb>'),
         "local copy op"),
        (_xml(send, f'<tb id="0" send="-1" recv="0" chan="0">{_st(0, "rrc", "i", 0, "i", 1)}</tb>'), "local copy op"),
        (_xml(send, f'<tb id="0" send="-1" recv="0" chan="0">{_st(0, "r", "i", 1)}</tb>'), "same chunk only"),
        (_xml(send, f'<tb id="0" send="-1" recv="0" chan="1">{_st(0, "r")}</tb>'), "sends 1 messages to GPU 1 on "
         "channel 0 but GPU 1 receives 0"),
        (_xml(f'<tb id="0" send="-1" recv="1" chan="0">{_st(0, "s")}</tb>', recv), "its threadblock has send=-1"),
        (ok.replace("<algo", "<algorithm").replace("</algo>", "</algorithm>"), "expected <algo>"),
        (ok[:-3], "does not parse"),
    ]
    for text, needle in cases:
        with pytest.raises(ScheduleError, match="msccl xml") as e:
            from_msccl_xml(text)
        assert needle in str(e.value), (needle, str(e.value))


def test_msccl_program_order_the_ir_cannot_keep_is_named():
    """GPU 0 sends chunk 0 (channel 0) and then chunk 1 (channel 1); GPU 1 takes chunk 1 first and chunk
    0 only after it: fine on MSCCL's per-channel connections, but the IR pairs the k-th send with the k-th
    receive of a pair; and a program whose steps wait on each other in a cycle."""
    g0 = (f'<tb id="0" send="1" recv="-1" chan="0">{_st(0, "s", off=0)}</tb>'
          f'<tb id="1" send="1" recv="-1" chan="1">{_st(0, "s", off=1, dep=(0, 0))}</tb>')
    g1 = (f'<tb id="0" send="-1" recv="0" chan="1">{_st(0, "r", off=1)}</tb>'
          f'<tb id="1" send="-1" recv="0" chan="0">{_st(0, "r", off=0, dep=(0, 0))}</tb>')
    with pytest.raises(ScheduleError, match="in another order than GPU 0 sends"):
        from_msccl_xml(_xml(g0, g1))
    g0 = f'<tb id="0" send="1" recv="1" chan="0">{_st(0, "r", off=1)}{_st(1, "s", off=0)}</tb>'
    g1 = f'<tb id="0" send="0" recv="0" chan="0">{_st(0, "r", off=0)}{_st(1, "s", off=1)}</tb>'
    with pytest.raises(ScheduleError, match="deadlocks"):
        from_msccl_xml(_xml(g0, g1))


# ------------------------------------------------------------------------------------------- XML texts
# Generated by msccl-tools' MSCCLang compiler (microsoft/msccl-tools @030a750, msccl/language/ir.py
# ir_to_xml, the format the MSCCL runtime reads), running the repository's own example programs with
# `PYTHONPATH=. python <example> <args>`; verbatim except that the <algo> tag is wrapped at 120 columns.
# `python examples/mscclang/simple/allreduce_ring.py 3 1`
AR_RING_3 = """\
<algo name="allreduce_ring_inplace" proto="Simple" nchannels="1" nchunksperloop="3"
      ngpus="3" coll="allreduce" inplace="1">
  <gpu id="0" i_chunks="3" o_chunks="0" s_chunks="0">
    <tb id="0" send="1" recv="2" chan="0">
      <step s="0" type="s" srcbuf="i" srcoff="0" dstbuf="i" dstoff="0" cnt="1" depid="-1" deps="-1" hasdep="0"/>
      <step s="1" type="rrs" srcbuf="i" srcoff="2" dstbuf="i" dstoff="2" cnt="1" depid="-1" deps="-1" hasdep="0"/>
      <step s="2" type="rrcs" srcbuf="i" srcoff="1" dstbuf="i" dstoff="1" cnt="1" depid="-1" deps="-1" hasdep="0"/>
      <step s="3" type="rcs" srcbuf="i" srcoff="0" dstbuf="i" dstoff="0" cnt="1" depid="-1" deps="-1" hasdep="0"/>
      <step s="4" type="r" srcbuf="i" srcoff="2" dstbuf="i" dstoff="2" cnt="1" depid="-1" deps="-1" hasdep="0"/>
    </tb>
  </gpu>
  <gpu id="1" i_chunks="3" o_chunks="0" s_chunks="0">
    <tb id="0" send="2" recv="0" chan="0">
      <step s="0" type="s" srcbuf="i" srcoff="1" dstbuf="i" dstoff="1" cnt="1" depid="-1" deps="-1" hasdep="0"/>
      <step s="1" type="rrs" srcbuf="i" srcoff="0" dstbuf="i" dstoff="0" cnt="1" depid="-1" deps="-1" hasdep="0"/>
      <step s="2" type="rrcs" srcbuf="i" srcoff="2" dstbuf="i" dstoff="2" cnt="1" depid="-1" deps="-1" hasdep="0"/>
      <step s="3" type="rcs" srcbuf="i" srcoff="1" dstbuf="i" dstoff="1" cnt="1" depid="-1" deps="-1" hasdep="0"/>
      <step s="4" type="r" srcbuf="i" srcoff="0" dstbuf="i" dstoff="0" cnt="1" depid="-1" deps="-1" hasdep="0"/>
    </tb>
  </gpu>
  <gpu id="2" i_chunks="3" o_chunks="0" s_chunks="0">
    <tb id="0" send="0" recv="1" chan="0">
      <step s="0" type="s" srcbuf="i" srcoff="2" dstbuf="i" dstoff="2" cnt="1" depid="-1" deps="-1" hasdep="0"/>
      <step s="1" type="rrs" srcbuf="i" srcoff="1" dstbuf="i" dstoff="1" cnt="1" depid="-1" deps="-1" hasdep="0"/>
      <step s="2" type="rrcs" srcbuf="i" srcoff="0" dstbuf="i" dstoff="0" cnt="1" depid="-1" deps="-1" hasdep="0"/>
      <step s="3" type="rcs" srcbuf="i" srcoff="2" dstbuf="i" dstoff="2" cnt="1" depid="-1" deps="-1" hasdep="0"/>
      <step s="4" type="r" srcbuf="i" srcoff="1" dstbuf="i" dstoff="1" cnt="1" depid="-1" deps="-1" hasdep="0"/>
    </tb>
  </gpu>
</algo>
"""

# `python examples/mscclang/allgather_ring.py 4 1 1 --protocol Simple`
AG_RING_4 = """\
<algo name="allgather_ring_1channelsperring" proto="Simple" nchannels="1" nchunksperloop="4"
      ngpus="4" coll="allgather" inplace="1">
  <gpu id="0" i_chunks="0" o_chunks="4" s_chunks="0">
    <tb id="0" send="1" recv="3" chan="0">
      <step s="0" type="s" srcbuf="o" srcoff="0" dstbuf="o" dstoff="0" cnt="1" depid="-1" deps="-1" hasdep="0"/>
      <step s="1" type="rcs" srcbuf="o" srcoff="3" dstbuf="o" dstoff="3" cnt="1" depid="-1" deps="-1" hasdep="0"/>
      <step s="2" type="rcs" srcbuf="o" srcoff="2" dstbuf="o" dstoff="2" cnt="1" depid="-1" deps="-1" hasdep="0"/>
      <step s="3" type="r" srcbuf="o" srcoff="1" dstbuf="o" dstoff="1" cnt="1" depid="-1" deps="-1" hasdep="0"/>
    </tb>
  </gpu>
  <gpu id="1" i_chunks="0" o_chunks="4" s_chunks="0">
    <tb id="0" send="2" recv="0" chan="0">
      <step s="0" type="s" srcbuf="o" srcoff="1" dstbuf="o" dstoff="1" cnt="1" depid="-1" deps="-1" hasdep="0"/>
      <step s="1" type="rcs" srcbuf="o" srcoff="0" dstbuf="o" dstoff="0" cnt="1" depid="-1" deps="-1" hasdep="0"/>
      <step s="2" type="rcs" srcbuf="o" srcoff="3" dstbuf="o" dstoff="3" cnt="1" depid="-1" deps="-1" hasdep="0"/>
      <step s="3" type="r" srcbuf="o" srcoff="2" dstbuf="o" dstoff="2" cnt="1" depid="-1" deps="-1" hasdep="0"/>
    </tb>
  </gpu>
  <gpu id="2" i_chunks="0" o_chunks="4" s_chunks="0">
    <tb id="0" send="3" recv="1" chan="0">
      <step s="0" type="s" srcbuf="o" srcoff="2" dstbuf="o" dstoff="2" cnt="1" depid="-1" deps="-1" hasdep="0"/>
      <step s="1" type="rcs" srcbuf="o" srcoff="1" dstbuf="o" dstoff="1" cnt="1" depid="-1" deps="-1" hasdep="0"/>
      <step s="2" type="rcs" srcbuf="o" srcoff="0" dstbuf="o" dstoff="0" cnt="1" depid="-1" deps="-1" hasdep="0"/>
      <step s="3" type="r" srcbuf="o" srcoff="3" dstbuf="o" dstoff="3" cnt="1" depid="-1" deps="-1" hasdep="0"/>
    </tb>
  </gpu>
  <gpu id="3" i_chunks="0" o_chunks="4" s_chunks="0">
    <tb id="0" send="0" recv="2" chan="0">
      <step s="0" type="s" srcbuf="o" srcoff="3" dstbuf="o" dstoff="3" cnt="1" depid="-1" deps="-1" hasdep="0"/>
      <step s="1" type="rcs" srcbuf="o" srcoff="2" dstbuf="o" dstoff="2" cnt="1" depid="-1" deps="-1" hasdep="0"/>
      <step s="2" type="rcs" srcbuf="o" srcoff="1" dstbuf="o" dstoff="1" cnt="1" depid="-1" deps="-1" hasdep="0"/>
      <step s="3" type="r" srcbuf="o" srcoff="0" dstbuf="o" dstoff="0" cnt="1" depid="-1" deps="-1" hasdep="0"/>
    </tb>
  </gpu>
</algo>
"""

# `python examples/mscclang/allreduce_recursive_doubling_halving.py 4 1`
AR_HALVING_DOUBLING_4 = """\
<algo name="allreduce_recursive_doubling_halving" proto="LL" nchannels="1" nchunksperloop="4"
      ngpus="4" coll="allreduce" inplace="1">
  <gpu id="0" i_chunks="4" o_chunks="0" s_chunks="0">
    <tb id="0" send="1" recv="1" chan="0">
      <step s="0" type="s" srcbuf="i" srcoff="1" dstbuf="i" dstoff="1" cnt="1" depid="1" deps="1" hasdep="0"/>
      <step s="1" type="rrc" srcbuf="i" srcoff="0" dstbuf="i" dstoff="0" cnt="1" depid="-1" deps="-1" hasdep="0"/>
      <step s="2" type="s" srcbuf="i" srcoff="0" dstbuf="i" dstoff="0" cnt="1" depid="-1" deps="-1" hasdep="0"/>
      <step s="3" type="r" srcbuf="i" srcoff="1" dstbuf="i" dstoff="1" cnt="1" depid="-1" deps="-1" hasdep="1"/>
    </tb>
    <tb id="1" send="2" recv="2" chan="0">
      <step s="0" type="s" srcbuf="i" srcoff="2" dstbuf="i" dstoff="2" cnt="2" depid="-1" deps="-1" hasdep="0"/>
      <step s="1" type="rrc" srcbuf="i" srcoff="0" dstbuf="i" dstoff="0" cnt="2" depid="-1" deps="-1" hasdep="1"/>
      <step s="2" type="s" srcbuf="i" srcoff="0" dstbuf="i" dstoff="0" cnt="2" depid="0" deps="3" hasdep="0"/>
      <step s="3" type="r" srcbuf="i" srcoff="2" dstbuf="i" dstoff="2" cnt="2" depid="-1" deps="-1" hasdep="0"/>
    </tb>
  </gpu>
  <gpu id="1" i_chunks="4" o_chunks="0" s_chunks="0">
    <tb id="0" send="0" recv="0" chan="0">
      <step s="0" type="s" srcbuf="i" srcoff="0" dstbuf="i" dstoff="0" cnt="1" depid="1" deps="1" hasdep="0"/>
      <step s="1" type="rrc" srcbuf="i" srcoff="1" dstbuf="i" dstoff="1" cnt="1" depid="-1" deps="-1" hasdep="0"/>
      <step s="2" type="s" srcbuf="i" srcoff="1" dstbuf="i" dstoff="1" cnt="1" depid="-1" deps="-1" hasdep="0"/>
      <step s="3" type="r" srcbuf="i" srcoff="0" dstbuf="i" dstoff="0" cnt="1" depid="-1" deps="-1" hasdep="1"/>
    </tb>
    <tb id="1" send="3" recv="3" chan="0">
      <step s="0" type="s" srcbuf="i" srcoff="2" dstbuf="i" dstoff="2" cnt="2" depid="-1" deps="-1" hasdep="0"/>
      <step s="1" type="rrc" srcbuf="i" srcoff="0" dstbuf="i" dstoff="0" cnt="2" depid="-1" deps="-1" hasdep="1"/>
      <step s="2" type="s" srcbuf="i" srcoff="0" dstbuf="i" dstoff="0" cnt="2" depid="0" deps="3" hasdep="0"/>
      <step s="3" type="r" srcbuf="i" srcoff="2" dstbuf="i" dstoff="2" cnt="2" depid="-1" deps="-1" hasdep="0"/>
    </tb>
  </gpu>
  <gpu id="2" i_chunks="4" o_chunks="0" s_chunks="0">
    <tb id="0" send="0" recv="0" chan="0">
      <step s="0" type="s" srcbuf="i" srcoff="0" dstbuf="i" dstoff="0" cnt="2" depid="-1" deps="-1" hasdep="0"/>
      <step s="1" type="rrc" srcbuf="i" srcoff="2" dstbuf="i" dstoff="2" cnt="2" depid="-1" deps="-1" hasdep="1"/>
      <step s="2" type="s" srcbuf="i" srcoff="2" dstbuf="i" dstoff="2" cnt="2" depid="1" deps="3" hasdep="0"/>
      <step s="3" type="r" srcbuf="i" srcoff="0" dstbuf="i" dstoff="0" cnt="2" depid="-1" deps="-1" hasdep="0"/>
    </tb>
    <tb id="1" send="3" recv="3" chan="0">
      <step s="0" type="s" srcbuf="i" srcoff="3" dstbuf="i" dstoff="3" cnt="1" depid="0" deps="1" hasdep="0"/>
      <step s="1" type="rrc" srcbuf="i" srcoff="2" dstbuf="i" dstoff="2" cnt="1" depid="-1" deps="-1" hasdep="0"/>
      <step s="2" type="s" srcbuf="i" srcoff="2" dstbuf="i" dstoff="2" cnt="1" depid="-1" deps="-1" hasdep="0"/>
      <step s="3" type="r" srcbuf="i" srcoff="3" dstbuf="i" dstoff="3" cnt="1" depid="-1" deps="-1" hasdep="1"/>
    </tb>
  </gpu>
  <gpu id="3" i_chunks="4" o_chunks="0" s_chunks="0">
    <tb id="0" send="1" recv="1" chan="0">
      <step s="0" type="s" srcbuf="i" srcoff="0" dstbuf="i" dstoff="0" cnt="2" depid="-1" deps="-1" hasdep="0"/>
      <step s="1" type="rrc" srcbuf="i" srcoff="2" dstbuf="i" dstoff="2" cnt="2" depid="-1" deps="-1" hasdep="1"/>
      <step s="2" type="s" srcbuf="i" srcoff="2" dstbuf="i" dstoff="2" cnt="2" depid="1" deps="3" hasdep="0"/>
      <step s="3" type="r" srcbuf="i" srcoff="0" dstbuf="i" dstoff="0" cnt="2" depid="-1" deps="-1" hasdep="0"/>
    </tb>
    <tb id="1" send="2" recv="2" chan="0">
      <step s="0" type="s" srcbuf="i" srcoff="2" dstbuf="i" dstoff="2" cnt="1" depid="0" deps="1" hasdep="0"/>
      <step s="1" type="rrc" srcbuf="i" srcoff="3" dstbuf="i" dstoff="3" cnt="1" depid="-1" deps="-1" hasdep="0"/>
      <step s="2" type="s" srcbuf="i" srcoff="3" dstbuf="i" dstoff="3" cnt="1" depid="-1" deps="-1" hasdep="0"/>
      <step s="3" type="r" srcbuf="i" srcoff="2" dstbuf="i" dstoff="2" cnt="1" depid="-1" deps="-1" hasdep="1"/>
    </tb>
  </gpu>
</algo>
"""

# `python examples/mscclang/simple/allgather_ring.py`
AG_RING_OUT_OF_PLACE_4 = """\
<algo name="allgather_ring" proto="Simple" nchannels="4" nchunksperloop="4"
      ngpus="4" coll="allgather" inplace="0">
  <gpu id="0" i_chunks="1" o_chunks="4" s_chunks="0">
    <tb id="0" send="-1" recv="-1" chan="0">
      <step s="0" type="cpy" srcbuf="i" srcoff="0" dstbuf="o" dstoff="0" cnt="1" depid="-1" deps="-1" hasdep="1"/>
    </tb>
    <tb id="1" send="-1" recv="3" chan="1">
      <step s="0" type="r" srcbuf="o" srcoff="1" dstbuf="o" dstoff="1" cnt="1" depid="-1" deps="-1" hasdep="0"/>
    </tb>
    <tb id="2" send="1" recv="-1" chan="0">
      <step s="0" type="s" srcbuf="o" srcoff="0" dstbuf="o" dstoff="0" cnt="1" depid="0" deps="0" hasdep="0"/>
    </tb>
    <tb id="3" send="1" recv="3" chan="2">
      <step s="0" type="rcs" srcbuf="o" srcoff="2" dstbuf="o" dstoff="2" cnt="1" depid="-1" deps="-1" hasdep="0"/>
    </tb>
    <tb id="4" send="1" recv="3" chan="3">
      <step s="0" type="rcs" srcbuf="o" srcoff="3" dstbuf="o" dstoff="3" cnt="1" depid="-1" deps="-1" hasdep="0"/>
    </tb>
  </gpu>
  <gpu id="1" i_chunks="1" o_chunks="4" s_chunks="0">
    <tb id="0" send="-1" recv="-1" chan="0">
      <step s="0" type="cpy" srcbuf="i" srcoff="0" dstbuf="o" dstoff="1" cnt="1" depid="-1" deps="-1" hasdep="1"/>
    </tb>
    <tb id="1" send="-1" recv="0" chan="2">
      <step s="0" type="r" srcbuf="o" srcoff="2" dstbuf="o" dstoff="2" cnt="1" depid="-1" deps="-1" hasdep="0"/>
    </tb>
    <tb id="2" send="2" recv="-1" chan="1">
      <step s="0" type="s" srcbuf="o" srcoff="1" dstbuf="o" dstoff="1" cnt="1" depid="0" deps="0" hasdep="0"/>
    </tb>
    <tb id="3" send="2" recv="0" chan="0">
      <step s="0" type="rcs" srcbuf="o" srcoff="0" dstbuf="o" dstoff="0" cnt="1" depid="-1" deps="-1" hasdep="0"/>
    </tb>
    <tb id="4" send="2" recv="0" chan="3">
      <step s="0" type="rcs" srcbuf="o" srcoff="3" dstbuf="o" dstoff="3" cnt="1" depid="-1" deps="-1" hasdep="0"/>
    </tb>
  </gpu>
  <gpu id="2" i_chunks="1" o_chunks="4" s_chunks="0">
    <tb id="0" send="-1" recv="-1" chan="0">
      <step s="0" type="cpy" srcbuf="i" srcoff="0" dstbuf="o" dstoff="2" cnt="1" depid="-1" deps="-1" hasdep="1"/>
    </tb>
    <tb id="1" send="-1" recv="1" chan="3">
      <step s="0" type="r" srcbuf="o" srcoff="3" dstbuf="o" dstoff="3" cnt="1" depid="-1" deps="-1" hasdep="0"/>
    </tb>
    <tb id="2" send="3" recv="-1" chan="2">
      <step s="0" type="s" srcbuf="o" srcoff="2" dstbuf="o" dstoff="2" cnt="1" depid="0" deps="0" hasdep="0"/>
    </tb>
    <tb id="3" send="3" recv="1" chan="0">
      <step s="0" type="rcs" srcbuf="o" srcoff="0" dstbuf="o" dstoff="0" cnt="1" depid="-1" deps="-1" hasdep="0"/>
    </tb>
    <tb id="4" send="3" recv="1" chan="1">
      <step s="0" type="rcs" srcbuf="o" srcoff="1" dstbuf="o" dstoff="1" cnt="1" depid="-1" deps="-1" hasdep="0"/>
    </tb>
  </gpu>
  <gpu id="3" i_chunks="1" o_chunks="4" s_chunks="0">
    <tb id="0" send="-1" recv="-1" chan="0">
      <step s="0" type="cpy" srcbuf="i" srcoff="0" dstbuf="o" dstoff="3" cnt="1" depid="-1" deps="-1" hasdep="1"/>
    </tb>
    <tb id="1" send="-1" recv="2" chan="0">
      <step s="0" type="r" srcbuf="o" srcoff="0" dstbuf="o" dstoff="0" cnt="1" depid="-1" deps="-1" hasdep="0"/>
    </tb>
    <tb id="2" send="0" recv="-1" chan="3">
      <step s="0" type="s" srcbuf="o" srcoff="3" dstbuf="o" dstoff="3" cnt="1" depid="0" deps="0" hasdep="0"/>
    </tb>
    <tb id="3" send="0" recv="2" chan="1">
      <step s="0" type="rcs" srcbuf="o" srcoff="1" dstbuf="o" dstoff="1" cnt="1" depid="-1" deps="-1" hasdep="0"/>
    </tb>
    <tb id="4" send="0" recv="2" chan="2">
      <step s="0" type="rcs" srcbuf="o" srcoff="2" dstbuf="o" dstoff="2" cnt="1" depid="-1" deps="-1" hasdep="0"/>
    </tb>
  </gpu>
</algo>
"""
