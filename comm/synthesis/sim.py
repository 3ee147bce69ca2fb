"""The schedule simulator: a schedule's time on a :class:`~commopt.comm.links.LinkMap`, its bytes per link,
and the plain ring as the baseline (docs/architecture.md, "the IR and the checker").

**The model** is the executor's semantics (``comm/algorithms/synth.py``) on the link map:

- every receive is posted at the start; a step starts once its deps are done; a send then issues its
  message; a recv or rrc completes once its deps are done and its message has arrived (the local copy or
  add costs nothing here); a send completes when its message has arrived;
- a message of b bytes from i to j waits its turn on the (i, j) connection (gloo keeps one connection per
  pair: one message at a time, FIFO in issue order, ties by step index), then takes ``alpha`` (latency,
  using no bandwidth) and then moves its b bytes as a fluid flow;
- **mesh**: each directed link is its own resource and carries only its pair's messages, so a message
  takes exactly ``alpha + b / rate(i, j)`` once it is at the head of its connection;
- **star**: a flow i -> j holds i's up port and j's down port, and the flows through one port share its
  rate **max-min fairly** (recomputed whenever a flow starts or ends). Not serialization: a tbf-shaped
  port is a token bucket feeding one queue that the senders' TCP flows fill together, so concurrent flows
  progress together and share the rate (each ~ 1/k of it, less where a flow is held back by its other
  port, the slack going to the others: the fluid model of TCP through one bottleneck). Serializing them
  would make a node that sends to two peers at once finish one transfer early and the other late, which
  a shaped port does not do.

The simulation is deterministic (no randomness, ties by rank and step index).
"""

from __future__ import annotations

import heapq
from collections import deque

from ..links import LinkMap
from .check import infer_deps, match_messages
from .ir import Schedule, ScheduleError, Step

__all__ = ["simulate", "link_bytes", "ring_schedule", "simulate_ring", "chunk_bytes"]

_EPS = 1e-9  # relative: a flow with less than this fraction of its bytes left has finished


def chunk_bytes(schedule: Schedule, nbytes: int, *, itemsize: int = 1) -> list[int]:
    """Each chunk's bytes in a buffer of ``nbytes`` bytes of ``itemsize``-byte elements (the executor cuts
    ``nbytes // itemsize`` elements by :meth:`Schedule.bounds`)."""
    return [(hi - lo) * itemsize for lo, hi in schedule.bounds(int(nbytes) // itemsize)]


def link_bytes(schedule: Schedule, nbytes: int, *, itemsize: int = 1) -> dict[tuple[int, int], int]:
    """The bytes each ordered pair (sender, receiver) carries when ``schedule`` runs on a buffer of
    ``nbytes`` bytes (pairs that carry nothing are absent).

    Args:
        schedule: the schedule.
        nbytes: the collective's buffer in bytes (see the IR's "the buffer and its chunks").
        itemsize: the element size in bytes.
    """
    size = chunk_bytes(schedule, nbytes, itemsize=itemsize)
    out: dict[tuple[int, int], int] = {}
    for r, steps in enumerate(schedule.steps):
        for st in steps:
            if st.op == "send":
                out[(r, st.peer)] = out.get((r, st.peer), 0) + sum(size[c] for c in st.chunks)
    return out


def _maxmin(flows: list[tuple[int, int]], up: tuple[float, ...], down: tuple[float, ...]) -> dict:
    """Max-min fair rates of ``flows`` (pairs i -> j) through up port i and down port j, by progressive
    filling: the port with the least capacity per unfrozen flow fixes its flows at that share. A port's
    share only grows as others freeze flows, so a lazy heap finds the least one."""
    n = len(up)
    members: dict[int, list[tuple[int, int]]] = {}  # port (i: i's up port, n + j: j's down port) -> flows
    for f in flows:
        for port in (f[0], n + f[1]):
            m = members.get(port)
            if m is None:
                members[port] = [f]
            else:
                m.append(f)
    cap = {p: (up[p] if p < n else down[p - n]) for p in members}  # capacity left
    count = {p: len(m) for p, m in members.items()}  # flows not yet fixed
    heap = [(cap[p] / count[p], p) for p in members]
    heapq.heapify(heap)
    rate: dict[tuple[int, int], float] = {}
    while heap:
        share, port = heapq.heappop(heap)
        k = count[port]
        if not k:
            continue
        now = max(cap[port], 0.0) / k
        if now > share * (1 + 1e-12):  # stale: others fixed flows here since, leaving more per flow
            heapq.heappush(heap, (now, port))
            continue
        for f in members[port]:
            if f not in rate:
                rate[f] = now
                a, b = f[0], n + f[1]
                cap[a] -= now
                count[a] -= 1
                cap[b] -= now
                count[b] -= 1
    return rate


def simulate(schedule: Schedule, links: LinkMap, nbytes: int, *, itemsize: int = 1) -> float:
    """The time in seconds that ``schedule`` takes on ``links`` for a buffer of ``nbytes`` bytes (the
    model of the module docstring).

    Args:
        schedule: a schedule over ``links.nodes`` ranks (rank i = node i); it should pass ``check``.
        links: the link map.
        nbytes: the collective's buffer in bytes (all-reduce: the tensor; reduce-scatter: the input;
            all-gather: the output).
        itemsize: the element size in bytes (chunk edges fall on whole elements).

    Returns:
        The time at which the last step completes.

    Raises:
        ScheduleError: the schedule does not fit the map (rank count, a mesh pair with no link), its
            messages do not pair, or it stalls (a deadlock).
    """
    n = schedule.nranks
    if links.nodes != n:
        raise ScheduleError(f"simulate: the schedule has {n} ranks but the link map {links.nodes} nodes")
    partner = match_messages(schedule)
    size = chunk_bytes(schedule, nbytes, itemsize=itemsize)
    steps = schedule.steps
    star = links.kind == "star"
    mesh_rate = {(a, b): r for a, b, r in links.pairs}
    alpha = links.alpha

    pending = [[len(st.deps) for st in rs] for rs in steps]
    users: list[list[list[int]]] = [[[] for _ in rs] for rs in steps]
    for r, rs in enumerate(steps):
        for i, st in enumerate(rs):
            for d in st.deps:
                users[r][d].append(i)
            if st.op == "send" and not star and mesh_rate.get((r, st.peer), 0.0) <= 0:
                raise ScheduleError(f"simulate: rank {r} step {i} sends to rank {st.peer} but the mesh has no link "
                                    f"{r}->{st.peer}")
    started = [[False] * len(rs) for rs in steps]
    done = [[False] * len(rs) for rs in steps]
    arrived = [[False] * len(rs) for rs in steps]  # receives whose message has arrived
    left = sum(len(rs) for rs in steps)

    msg = [[sum(size[c] for c in st.chunks) for st in rs] for rs in steps]
    queues: dict[tuple[int, int], list[tuple[float, int]]] = {}  # pair -> heap of (issue time, send index)
    busy: set[tuple[int, int]] = set()  # pairs with a message in latency or in flight
    flows: dict[tuple[int, int], list] = {}  # star: pair -> [bytes left, done below this, rate, send index]
    # (time, seq, kind, pair, send index); kind 0: the latency is over, the bytes start to flow (star);
    # kind 1: delivered (mesh, where a message owns its link: alpha + b / rate)
    events: list[tuple[float, int, int, tuple[int, int], int]] = []
    seq = 0
    now = 0.0
    rates_stale = False
    work: deque[tuple[int, int]] = deque()  # steps done at `now`
    dirty: set[tuple[int, int]] = set()  # pairs that may start their next message at `now`

    def start(r: int, i: int) -> None:
        started[r][i] = True
        st = steps[r][i]
        if st.op == "send":
            heapq.heappush(queues.setdefault((r, st.peer), []), (now, i))
            dirty.add((r, st.peer))
        elif arrived[r][i]:
            work.append((r, i))

    for r, rs in enumerate(steps):
        for i in range(len(rs)):
            if pending[r][i] == 0:
                start(r, i)
    while True:
        while work:  # steps done at `now`: release their dependents
            r, i = work.popleft()
            done[r][i] = True
            left -= 1
            for j in users[r][i]:
                pending[r][j] -= 1
                if pending[r][j] == 0:
                    start(r, j)
        for pair in sorted(dirty):  # idle connections take their next message
            q = queues.get(pair)
            if pair not in busy and q:
                _, i = heapq.heappop(q)
                busy.add(pair)
                seq += 1
                if star:
                    heapq.heappush(events, (now + alpha, seq, 0, pair, i))
                else:
                    heapq.heappush(events, (now + alpha + msg[pair[0]][i] / mesh_rate[pair], seq, 1, pair, i))
        dirty.clear()
        if rates_stale and flows:
            for pair, rate in _maxmin(sorted(flows), links.up, links.down).items():
                flows[pair][2] = rate
        rates_stale = False
        if not events and not flows:
            break
        t = events[0][0] if events else float("inf")
        for f in flows.values():
            t = min(t, now + f[0] / f[2])
        delivered = []
        if flows:
            for pair, f in flows.items():
                f[0] -= f[2] * (t - now)
                if f[0] <= f[1]:
                    delivered.append((pair, f[3]))
            for pair, _ in delivered:
                del flows[pair]
                rates_stale = True
        now = t
        while events and events[0][0] <= now:
            _, _, kind, pair, i = heapq.heappop(events)
            if kind == 1:
                delivered.append((pair, i))
                continue
            b = float(msg[pair[0]][i])
            if b <= 0:
                delivered.append((pair, i))
            else:
                flows[pair] = [b, _EPS * b, 0.0, i]
                rates_stale = True
        for pair, i in delivered:
            busy.discard(pair)
            dirty.add(pair)
            work.append((pair[0], i))  # the send is done
            b, j = partner[pair[0]][i]
            arrived[b][j] = True
            if started[b][j]:
                work.append((b, j))
    if left:
        r, i = next((r, i) for r, rs in enumerate(steps) for i in range(len(rs)) if not done[r][i])
        raise ScheduleError(f"simulate: deadlock: the simulation stalls with {left} steps left, among them rank {r} "
                            f"step {i} ({steps[r][i].op} with peer {steps[r][i].peer}); run check() for the cycle")
    return now


def ring_schedule(collective: str, nranks: int, order: list[int] | None = None) -> Schedule:
    """The plain ring as a schedule: one chunk per rank (chunk k = rank k's shard), N - 1 steps of
    reduce-scatter (each position sends the partial sum it last received on to the next and adds what
    arrives from the previous) and/or N - 1 steps of all-gather; the all-reduce is both, and each chunk's
    sum is completed once by its owner and copied around.

    Args:
        collective: "allreduce", "reducescatter" or "allgather".
        nranks: N.
        order: the ring, position -> rank (default 0, 1, ..., N - 1); messages go from position p to p + 1.

    Returns:
        The schedule (deps by :func:`~commopt.comm.synthesis.check.infer_deps`).
    """
    if collective not in ("allreduce", "reducescatter", "allgather"):
        raise ValueError(f"ring_schedule: collective {collective!r} is not allreduce, reducescatter or allgather")
    order = list(range(nranks)) if order is None else list(order)
    if sorted(order) != list(range(nranks)):
        raise ValueError(f"ring_schedule: order {order} is not a permutation of 0..{nranks - 1}")
    n = nranks
    steps: list[list[Step]] = [[] for _ in range(n)]
    for p in range(n):
        me, nxt, prv = order[p], order[(p + 1) % n], order[(p - 1) % n]
        if collective in ("allreduce", "reducescatter"):
            for s in range(n - 1):
                steps[me].append(Step("send", nxt, (order[(p - s - 1) % n],)))
                steps[me].append(Step("rrc", prv, (order[(p - s - 2) % n],)))
        if collective in ("allreduce", "allgather"):
            for s in range(n - 1):
                steps[me].append(Step("send", nxt, (order[(p - s) % n],)))
                steps[me].append(Step("recv", prv, (order[(p - s - 1) % n],)))
    return Schedule(collective, n, [1] * n, infer_deps(steps), name=f"ring{order}")


def simulate_ring(collective: str, links: LinkMap, nbytes: int, order: list[int] | None = None, *,
                  itemsize: int = 1) -> float:
    """:func:`simulate` of :func:`ring_schedule` (the baseline a synthesized schedule is compared with)."""
    return simulate(ring_schedule(collective, links.nodes, order), links, nbytes, itemsize=itemsize)
