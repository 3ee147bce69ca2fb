"""The all-reduce with unequal shards for a star, and the direct (all-pairs) schedules it is built from
(docs/architecture.md, "the synthesizers and the bound"; research note synthesis_landscape.md A.6 case 2).

On a star every node i has one port to the switch, ``up[i]`` bytes/s out and ``down[i]`` in. A direct
all-reduce in which node i owns the fraction x_i of the reduced vector (it reduces that part and sends
it back out) makes node i send S (1 - x_i) + (N - 1) x_i S = S (1 + (N - 2) x_i) bytes of a buffer of S
bytes, and receive as much; so with r_i = min(up_i, down_i) the ports need

    T >= S (1 + (N - 2) x_i) / r_i   for every i,   sum x_i = 1,   x_i >= 0.

Every node moves at least S each way (x_i = 0), so T >= S / min r; with no x_i at 0 the constraints
summed give T >= 2 (N - 1) S / sum r. The smallest T is the larger of the two (the LP's closed form),
and x_i = max(0, (T r_i / S - 1) / (N - 2)) normalised to sum 1: a node slower than T allows owns
nothing. At N = 3 with one node at a quarter of the others' rate this is S / r_slow, against a ring's
2 (N - 1) / N S / r_slow (1.33x; 1.5x at N = 4). On two nodes or a uniform star the shards are equal and
the schedule is the equal-shard direct all-reduce (nothing beats it there: one node's cut).

The schedule: (1) a direct reduce-scatter (every node sends its contribution to each chunk to the
chunk's owner, which adds them with ``rrc`` in ascending sender order, so the sum is computed once, in
a fixed order), (2) a direct all-gather (the owner sends the reduced chunk to every other node). Each
shard is cut into ``pieces`` chunks sent in order on every (sender, receiver) pair (a dependency chain:
the pair's FIFO), so that the all-gather of piece p overlaps the reduce-scatter of piece p + 1: without
it the slow node's port would idle for the whole other phase and the time double.
"""

from __future__ import annotations

from ..links import LinkMap
from .ir import COLLECTIVES, Schedule, ScheduleError, Step

__all__ = ["star_allreduce", "shard_fractions", "direct_schedule", "integer_weights"]

#: The integer resolution of the shard fractions: weights out of ``WEIGHT_UNIT * N``.
WEIGHT_UNIT = 1024


def shard_fractions(links: LinkMap) -> tuple[list[float], float]:
    """The optimal shard fractions x_i of the direct all-reduce on a star, and its time per byte T / S.

    Args:
        links: a star (``links.kind == "star"``) of N >= 2 nodes.

    Returns:
        ``(x, t)``: the fractions (sum 1; equal on two nodes or a uniform star) and the seconds per byte
        of buffer the busiest port needs (bandwidth only).
    """
    if links.kind != "star":
        raise ValueError(f"shard_fractions: the unequal-shard all-reduce is for a star, got a {links.kind}")
    n = links.nodes
    if n < 2:
        raise ValueError(f"shard_fractions: needs at least 2 nodes, got {n}")
    r = [min(u, d) for u, d in zip(links.up, links.down)]
    if n == 2 or len(set(r)) == 1:  # every split moves S each way (two nodes); symmetry (uniform)
        return [1.0 / n] * n, max(1.0 / min(r), 2 * (n - 1) / sum(r))
    t = max(1.0 / min(r), 2 * (n - 1) / sum(r))
    u = [max(0.0, (t * ri - 1.0) / (n - 2)) for ri in r]
    total = sum(u)
    return [ui / total for ui in u], t


def integer_weights(x: list[float], unit: int = WEIGHT_UNIT) -> list[int]:
    """``x`` (sum 1) as integers summing to ``unit * len(x)`` (largest remainders; ties to the lower index)."""
    total = unit * len(x)
    raw = [xi * total for xi in x]
    w = [int(v) for v in raw]
    order = sorted(range(len(x)), key=lambda i: (-(raw[i] - w[i]), i))
    for i in order[:total - sum(w)]:
        w[i] += 1
    return w


def direct_schedule(collective: str, shard_weights: list[int], pieces: int = 1, *, serial: bool = False,
                    name: str = "") -> Schedule:
    """The direct (all-pairs) schedule of ``collective`` with shard r of relative size ``shard_weights[r]``
    (0: rank r owns nothing), each shard cut into ``pieces`` equal chunks.

    Reduce-scatter (and the first phase of all-reduce): rank i sends its contribution to piece p of shard
    j to j; j adds the N - 1 contributions with ``rrc`` in ascending sender order (a dependency chain).
    All-gather (and the second phase): the owner sends each piece to every other rank; for all-reduce a
    piece is sent once its last ``rrc`` is done, and received at a rank only after that rank sent its own
    contribution to it (a receive overwrites the chunk the send reads). The sends of each (sender,
    receiver) pair form a chain in piece order, so the pieces go one after the other and the phases
    overlap. With ``serial`` each rank's reduce-scatter sends form one chain (one piece of one shard at
    a time through its port): the first reduced piece is then N - 1 times smaller, and so is the time the
    all-gather waits for it (a slow node's down port idles that long).

    Args:
        collective: "allreduce", "reducescatter" or "allgather" (the last two need equal weights: the
            IR's shards are equal).
        shard_weights: one non-negative integer per rank, at least one positive.
        pieces: chunks per shard (>= 1).
        serial: chain all of a rank's reduce-scatter sends (else one chain per receiver).
        name: the schedule's label.
    """
    if collective not in COLLECTIVES:
        raise ScheduleError(f"direct_schedule: collective must be one of {COLLECTIVES}, got {collective!r}")
    n = len(shard_weights)
    if n < 1 or min(shard_weights) < 0 or max(shard_weights) <= 0 or pieces < 1:
        raise ScheduleError(f"direct_schedule: needs non-negative shard weights with one positive and pieces >= 1, "
                            f"got {shard_weights} and {pieces}")
    if collective != "allreduce" and len(set(shard_weights)) != 1:
        raise ScheduleError(f"direct_schedule: {collective} has equal shards, got weights {shard_weights}")
    owners = [r for r in range(n) if shard_weights[r] > 0]
    weights: list[int] = []
    chunk: dict[tuple[int, int], int] = {}
    for r in owners:
        for p in range(pieces):
            chunk[r, p] = len(weights)
            weights.append(shard_weights[r])
    rs = collective in ("allreduce", "reducescatter")
    ag = collective in ("allreduce", "allgather")
    steps: list[list[Step]] = [[] for _ in range(n)]
    for i in range(n):
        out = steps[i]
        last_send: dict[int, int] = {}  # peer -> index of the last send to it (the pair's chain)
        last_rs: int | None = None  # the last reduce-scatter send (serial)
        sent_rs: dict[int, int] = {}  # chunk -> index of this rank's reduce-scatter send of it
        for p in range(pieces):
            peers = [(i + k) % n for k in range(1, n)]  # staggered: not everyone to rank 0 first
            if rs:
                for j in peers:
                    if (j, p) in chunk:
                        c = chunk[j, p]
                        sent_rs[c] = len(out)
                        out.append(Step("send", j, (c,), _dep(last_rs if serial else last_send.get(j))))
                        last_send[j] = sent_rs[c]
                        last_rs = sent_rs[c]
                if (i, p) in chunk:
                    prev = None
                    for j in range(n):
                        if j != i:
                            out.append(Step("rrc", j, (chunk[i, p],), _dep(prev)))
                            prev = len(out) - 1
                    reduced = prev
            if ag:
                if (i, p) in chunk:
                    for j in peers:
                        deps = tuple(d for d in (last_send.get(j), reduced if rs else None) if d is not None)
                        last_send[j] = len(out)
                        out.append(Step("send", j, (chunk[i, p],), tuple(sorted(set(deps)))))
                for j in peers:
                    if (j, p) in chunk:
                        c = chunk[j, p]
                        out.append(Step("recv", j, (c,), _dep(sent_rs.get(c))))
    return Schedule(collective, n, weights, steps, name=name or f"direct {collective} pieces={pieces}",
                    meta={"synthesizer": "direct", "shard_weights": list(shard_weights), "pieces": pieces,
                          "serial": serial})


def star_allreduce(links: LinkMap, *, chunks_per_shard: int = 1, serial: bool = False) -> Schedule:
    """The all-reduce with unequal shards for a star (module docstring): shard fractions from
    :func:`shard_fractions` as integer weights out of 1024 N, then :func:`direct_schedule`.

    Args:
        links: a star of N >= 2 nodes (per-node up and down rates).
        chunks_per_shard: pieces each shard is cut into (pipelining the two phases).
        serial: each rank's reduce-scatter sends in one chain (:func:`direct_schedule`).

    Returns:
        The schedule; ``meta["fractions"]`` holds the x_i, ``meta["seconds_per_byte"]`` the LP's T / S.
    """
    x, t = shard_fractions(links)
    w = integer_weights(x)
    sched = direct_schedule("allreduce", w, chunks_per_shard, serial=serial,
                            name=f"star_allreduce shards={w} pieces={chunks_per_shard}{' serial' if serial else ''}")
    sched.meta.update({"synthesizer": "star_allreduce", "fractions": x, "seconds_per_byte": t})
    return sched


def _dep(i: int | None) -> tuple[int, ...]:
    return () if i is None else (i,)
