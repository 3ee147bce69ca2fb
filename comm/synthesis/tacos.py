"""TACOS: a greedy link-chunk matching on the time-expanded network of the measured links
(arXiv 2304.05301; astra-sim/tacos v1.3.0; research note synthesis_landscape.md A.1; docs/architecture.md,
"the synthesizers and the bound").

**All-gather** (:func:`tacos_allgather`). Every rank's shard is cut into ``chunks_per_rank`` equal chunks,
each wanted by every rank. Time advances from event to event (a transfer ending); at each event t:

1. every transfer that ends at t delivers its chunk c at its destination d. If c reached d already by
   another path, the transfer is credited instead to a *replacement* chunk: one that the source held
   when the transfer started and d still lacks (chosen at random); with none, it is dropped;
2. the pairs (chunk, destination) not yet delivered are shuffled, and each in turn is matched to the
   free link into the destination, among those whose source holds the chunk, that delivers it first
   (``t + alpha + chunk / rate``; ties at random); the link is busy until then.

A chunk is relayed only after it arrived (store and forward, chunk by chunk), one chunk at a time per
resource. The resource is the directed link on a mesh; on a star it is the port: a transfer i -> j holds
i's up and j's down port for ``chunk / min(up_i, down_j)`` (the research note's adaptation: TACOS has no
shared ports, and on a star it would count N - 1 links per node).

**Reduce-scatter** (:func:`tacos_reducescatter`) by time reversal: the all-gather synthesized on the
reversed links (a mesh's i -> j becomes j -> i; a star's up and down ports swap) spreads each chunk
from its owner along a tree; run backwards, every transfer s -> d at [t0, t1] becomes d -> s at
[T - t1, T - t0], a send becoming an ``rrc`` at the receiver. Each rank then adds its children's partial
sums in a fixed order (a dependency chain) and sends the result once to its parent: every contribution
counts once and each shard is reduced at its owner only.

**All-reduce** (:func:`tacos_allreduce`): that reduce-scatter, then an all-gather on the same chunks; an
owner sends a chunk once its last ``rrc`` is done, and a rank receives a chunk only after it sent its
partial sum of it.

Steps are listed per rank in the order of the plan's start times, so the k-th send of a pair pairs with
the k-th receive; a relay's send of a chunk depends on its receive of it. With ``chain`` the sends of
each resource (a mesh link; a star's up port) also depend on the previous one there, so they go in the
plan's order. The plan is randomised: the ``best_*`` functions keep the fastest of several seeds and
chunk counts by simulated time.
"""

from __future__ import annotations

import heapq
import random
from collections.abc import Iterable

from ..links import LinkMap
from .ir import Schedule, ScheduleError, Step
from .sim import simulate

__all__ = ["tacos_allgather", "tacos_reducescatter", "tacos_allreduce", "tacos_transfers", "best_tacos",
           "reverse_links", "DEFAULT_NBYTES"]

#: The buffer size a schedule is synthesized for when none is given (16 MiB: the issue's benchmark).
DEFAULT_NBYTES = 16 << 20

# A transfer of the plan: (chunk, src, dst, start, end).
Transfer = tuple[int, int, int, float, float]


def reverse_links(links: LinkMap) -> LinkMap:
    """The links with every direction reversed (a mesh's i -> j at r becomes j -> i at r; a star's up and
    down ports swap): what the reduce-scatter's time reversal synthesizes on."""
    if links.kind == "star":
        return LinkMap.star(list(links.down), list(links.up), alpha=links.alpha)
    return LinkMap.mesh(links.nodes, {(j, i): r for i, j, r in links.pairs}, alpha=links.alpha)


def tacos_transfers(links: LinkMap, chunks_per_rank: int, chunk_bytes: float,
                    seed: int) -> tuple[list[Transfer], float]:
    """TACOS's all-gather plan (module docstring): the transfers that deliver each chunk once to each
    rank, and the plan's makespan. Chunk ``r * chunks_per_rank + k`` starts at rank r.

    Raises:
        ScheduleError: some rank cannot be reached (a mesh that is not strongly connected).
    """
    n, k = links.nodes, chunks_per_rank
    nchunks = n * k
    rng = random.Random(seed)
    # Per-destination in-neighbours and their transfer times.
    dur = [[0.0] * n for _ in range(n)]
    into = [0] * n  # bitmask of in-neighbours
    for s in range(n):
        for d in range(n):
            rate = links.rate(s, d) if s != d else 0.0
            if rate > 0:
                dur[s][d] = links.alpha + chunk_bytes / rate
                into[d] |= 1 << s
    star = links.kind == "star"
    full = (1 << n) - 1
    holders = [1 << (c // k) for c in range(nchunks)]  # who holds each chunk (arrived)
    arrived = [[float("inf")] * n for _ in range(nchunks)]
    for c in range(nchunks):
        arrived[c][c // k] = 0.0
    lacking = [sorted(c for c in range(nchunks) if c // k != d) for d in range(n)]
    missing = sum(len(x) for x in lacking)
    # Resources: star ports (free masks of up and down); mesh links (free in-link mask per destination).
    free_up, free_down = full, full
    free_in = list(into)
    flight: list[tuple[float, int, int, int, float]] = []  # transfers under way: (end, seq, src, dst, start)
    carried: dict[int, int] = {}  # seq -> the chunk it was matched to
    plan: list[Transfer] = []
    seq = 0
    t = 0.0
    while missing:
        # (1) deliveries at t
        while flight and flight[0][0] <= t:
            end, sq, s, d, start = heapq.heappop(flight)
            c = carried.pop(sq)
            if arrived[c][d] != float("inf"):  # delivered already: credit a replacement, or drop
                options = [x for x in lacking[d] if arrived[x][s] <= start]
                c = rng.choice(options) if options else -1
            if c >= 0:
                arrived[c][d] = end
                holders[c] |= 1 << d
                lacking[d].remove(c)
                missing -= 1
                plan.append((c, s, d, start, end))
            if star:
                free_up |= 1 << s
                free_down |= 1 << d
            else:
                free_in[d] |= 1 << s
        if not missing:
            break
        # (2) link-chunk matching at t
        if star:
            pairs = [(c, d) for d in range(n) if free_down >> d & 1 for c in lacking[d]]
        else:
            pairs = [(c, d) for d in range(n) if free_in[d] for c in lacking[d]]
        rng.shuffle(pairs)
        for c, d in pairs:
            if star:  # d's down port and a holder's up port, both free
                cand = holders[c] & free_up & into[d] if free_down >> d & 1 else 0
            else:  # a free link from a holder into d
                cand = holders[c] & free_in[d]
            if not cand:
                continue
            best, ties = float("inf"), []
            for s in _bits(cand):
                if dur[s][d] < best:
                    best, ties = dur[s][d], [s]
                elif dur[s][d] == best:
                    ties.append(s)
            s = ties[0] if len(ties) == 1 else rng.choice(ties)
            if star:
                free_up &= ~(1 << s)
                free_down &= ~(1 << d)
            else:
                free_in[d] &= ~(1 << s)
            heapq.heappush(flight, (t + best, seq, s, d, t))
            carried[seq] = c
            seq += 1
        if not flight:
            unreachable = [d for d in range(n) if lacking[d]]
            raise ScheduleError(f"tacos: ranks {unreachable} cannot be reached from every other rank over the links "
                                f"{links.to_dict()}: the fabric must be strongly connected")
        t = flight[0][0]
    return plan, max((p[4] for p in plan), default=0.0)


def _bits(mask: int) -> Iterable[int]:
    while mask:
        low = mask & -mask
        yield low.bit_length() - 1
        mask ^= low


def _resource(links: LinkMap, s: int, d: int) -> tuple:
    return ("up", s) if links.kind == "star" else ("link", s, d)


def _ag_steps(plan: list[Transfer], links: LinkMap, n: int, chain: bool, base: list[int],
              ready: dict[tuple[int, int], int] | None, written: dict[tuple[int, int], int] | None,
              offset: float = 0.0) -> list[list[tuple]]:
    """Per rank, the all-gather plan's steps as (key, Step) in plan order, with indices shifted by
    ``base[rank]``; ``ready[(rank, chunk)]`` (an owner's last reduction) gates its first sends,
    ``written[(rank, chunk)]`` (a rank's reduce-scatter send) gates its receive."""
    events: list[list[tuple]] = [[] for _ in range(n)]
    for c, s, d, t0, t1 in plan:
        key = (t0 + offset, t1 + offset, c, s, d)
        events[s].append((key, "send", d, c))
        events[d].append((key, "recv", s, c))
    out: list[list[tuple]] = []
    for r in range(n):
        events[r].sort(key=lambda e: (e[0], e[1] == "send"))
        got: dict[int, int] = {}
        last: dict[tuple, int] = {}
        steps = []
        for key, op, peer, c in events[r]:
            idx = base[r] + len(steps)
            deps = []
            if op == "send":
                if c in got:
                    deps.append(got[c])
                elif ready is not None and (r, c) in ready:
                    deps.append(ready[r, c])
                res = _resource(links, r, peer)
                if chain and res in last:
                    deps.append(last[res])
                last[res] = idx
            else:
                got[c] = idx
                if written is not None and (r, c) in written:
                    deps.append(written[r, c])
            steps.append((key, Step(op, peer, (c,), tuple(sorted(set(deps))))))
        out.append(steps)
    return out


def _rs_steps(plan: list[Transfer], makespan: float, links: LinkMap, n: int, chain: bool) -> list[list[tuple]]:
    """Per rank, the reduce-scatter steps of the time reversal of ``plan`` (an all-gather plan on the
    reversed links) as (key, Step): transfer s -> d at [t0, t1] becomes d -> s at [T - t1, T - t0]."""
    events: list[list[tuple]] = [[] for _ in range(n)]
    for c, s, d, t0, t1 in plan:
        key = (makespan - t1, makespan - t0, c, d, s)
        events[d].append((key, "send", s, c))
        events[s].append((key, "rrc", d, c))
    out: list[list[tuple]] = []
    for r in range(n):
        events[r].sort(key=lambda e: (e[0], e[1] == "send"))
        reduced: dict[int, int] = {}  # chunk -> its last rrc here
        last: dict[tuple, int] = {}
        steps = []
        for key, op, peer, c in events[r]:
            idx = len(steps)
            deps = []
            if c in reduced:
                deps.append(reduced[c])  # the fixed order of the additions; the send reads the sum
            if op == "send":
                res = _resource(links, r, peer)
                if chain and res in last:
                    deps.append(last[res])
                last[res] = idx
            else:
                reduced[c] = idx
            steps.append((key, Step(op, peer, (c,), tuple(sorted(set(deps))))))
        out.append(steps)
    return out


def _schedule(collective: str, n: int, k: int, steps: list[list[Step]], name: str, meta: dict) -> Schedule:
    return Schedule(collective, n, [1] * (n * k), steps, name=name, meta=meta)


def tacos_allgather(links: LinkMap, *, chunks_per_rank: int = 1, seed: int = 0, nbytes: int = DEFAULT_NBYTES,
                    chain: bool = True) -> Schedule:
    """TACOS's all-gather for ``links`` (module docstring).

    Args:
        links: a star or mesh of N nodes (a mesh must be strongly connected).
        chunks_per_rank: equal chunks per rank's shard.
        seed: the plan's random seed.
        nbytes: the buffer size the link times are computed for (alpha against chunk / rate).
        chain: the sends of each resource follow the plan's order (dependencies).
    """
    n, k = links.nodes, chunks_per_rank
    plan, makespan = tacos_transfers(links, k, nbytes / (n * k), seed)
    per = _ag_steps(plan, links, n, chain, [0] * n, None, None)
    return _schedule("allgather", n, k, [[s for _, s in r] for r in per],
                     f"tacos allgather chunks={k} seed={seed}{'' if chain else ' unchained'}",
                     {"synthesizer": "tacos", "chunks_per_rank": k, "seed": seed, "plan_seconds": makespan})


def tacos_reducescatter(links: LinkMap, *, chunks_per_rank: int = 1, seed: int = 0, nbytes: int = DEFAULT_NBYTES,
                        chain: bool = True) -> Schedule:
    """TACOS's reduce-scatter for ``links``: the time reversal of its all-gather on the reversed links
    (module docstring). Arguments as :func:`tacos_allgather`."""
    n, k = links.nodes, chunks_per_rank
    plan, makespan = tacos_transfers(reverse_links(links), k, nbytes / (n * k), seed)
    per = _rs_steps(plan, makespan, links, n, chain)
    return _schedule("reducescatter", n, k, [[s for _, s in r] for r in per],
                     f"tacos reducescatter chunks={k} seed={seed}{'' if chain else ' unchained'}",
                     {"synthesizer": "tacos", "chunks_per_rank": k, "seed": seed, "plan_seconds": makespan})


def tacos_allreduce(links: LinkMap, *, chunks_per_rank: int = 1, seed: int = 0, nbytes: int = DEFAULT_NBYTES,
                    chain: bool = True) -> Schedule:
    """TACOS's all-reduce: :func:`tacos_reducescatter` then :func:`tacos_allgather` on the same chunks
    (seeds ``seed`` and ``seed + 1``), each all-gather send of an owner after its last reduction of the
    chunk, each receive after this rank's reduce-scatter send of it. Arguments as :func:`tacos_allgather`."""
    n, k = links.nodes, chunks_per_rank
    chunk_bytes = nbytes / (n * k)
    rplan, rspan = tacos_transfers(reverse_links(links), k, chunk_bytes, seed)
    rs = _rs_steps(rplan, rspan, links, n, chain)
    ready: dict[tuple[int, int], int] = {}
    written: dict[tuple[int, int], int] = {}
    for r in range(n):
        for i, (_, s) in enumerate(rs[r]):
            if s.op == "rrc":
                ready[r, s.chunks[0]] = i
            else:
                written[r, s.chunks[0]] = i
    gplan, gspan = tacos_transfers(links, k, chunk_bytes, seed + 1)
    ag = _ag_steps(gplan, links, n, chain, [len(x) for x in rs], ready, written, offset=rspan)
    steps = [[s for _, s in rs[r]] + [s for _, s in ag[r]] for r in range(n)]
    return _schedule("allreduce", n, k, steps, f"tacos allreduce chunks={k} seed={seed}{'' if chain else ' unchained'}",
                     {"synthesizer": "tacos", "chunks_per_rank": k, "seed": seed, "plan_seconds": rspan + gspan})


_BUILDERS = {"allgather": tacos_allgather, "reducescatter": tacos_reducescatter, "allreduce": tacos_allreduce}


def best_tacos(collective: str, links: LinkMap, *, chunks: Iterable[int] = (1, 2, 4), seeds: Iterable[int] = (0, 1, 2),
               nbytes: int = DEFAULT_NBYTES, simulated: int | None = None) -> tuple[Schedule, float]:
    """The fastest TACOS schedule of ``collective`` by simulated time at ``nbytes`` (``sim.simulate``):
    every (chunk count, seed) is planned, the ``simulated`` plans with the shortest makespan (None: all)
    are simulated chained and unchained, and the fastest is kept (ties: the first). Returns it and its
    simulated seconds."""
    build = _BUILDERS[collective]
    plans = [build(links, chunks_per_rank=k, seed=seed, nbytes=nbytes) for k in chunks for seed in seeds]
    if not plans:
        raise ValueError("best_tacos: no candidate (empty chunks or seeds)")
    plans.sort(key=lambda s: s.meta["plan_seconds"])  # stable: ties keep the order of chunks, then seeds
    best: tuple[Schedule, float] | None = None
    for sched in plans[:simulated]:
        k, seed = sched.meta["chunks_per_rank"], sched.meta["seed"]
        for cand in (sched, build(links, chunks_per_rank=k, seed=seed, nbytes=nbytes, chain=False)):
            t = simulate(cand, links, nbytes)
            if best is None or t < best[1]:
                best = (cand, t)
    assert best is not None
    return best
