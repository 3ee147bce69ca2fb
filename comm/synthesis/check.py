"""The schedule checker: a symbolic proof that a :class:`~commopt.comm.synthesis.ir.Schedule` computes its
collective (docs/architecture.md, "the IR and the checker").

:func:`check` proves, in this order, and raises :class:`ScheduleError` at the first broken condition with a
message that starts with the condition's name and names the rank, step, chunk and peer:

1. **well-formed**: a known collective, ``nranks >= 1``, one step list per rank, positive integer weights,
   ops in ``OPS``, peers in range and not the rank itself, chunk ids in range (at least one, none twice in
   a step), deps pointing to earlier steps of the same rank, no ``rrc`` in an all-gather, and for
   reduce-scatter and all-gather every chunk inside one rank's shard (:meth:`Schedule.shard_of`);
2. **pairing**: for every ordered pair (a, b) the sends a -> b and the receives (recv or rrc) at b from
   a are equal in number, and the k-th of each carry the same chunk list;
3. **race**: within a rank, two steps touching a common chunk, one of them writing it (recv and rrc
   write, send reads), are ordered by the transitive closure of ``deps`` (otherwise the executor may run
   them in either order and the result depends on timing);
4. **deadlock**: with every receive posted at the start (the executor's semantics), the graph of
   ``deps`` edges plus one edge from each send to its receive's completion is acyclic;
5. **postcondition** (and **double count** on the way): the steps replayed symbolically in a topological
   order of that graph (any order gives the same result once 1-4 hold: conflicting accesses are ordered
   and data moves only through messages). Each (rank, chunk) holds the set of ranks whose contribution it
   sums (all-reduce, reduce-scatter) and the identity of the computation that produced it: the ``rrc``
   (rank, step) that last added into it, kept by copies. An ``rrc`` adding a contribution the chunk
   already holds is a double count. At the end, all-reduce: every rank holds every chunk's full sum, and
   all ranks hold the *same computation* of it (computed once by one rank, in the order its deps fix, and
   copied: bit-identical everywhere); reduce-scatter: rank r holds the full sum of every chunk of its
   shard; all-gather: every rank holds every chunk (and never sends a chunk it does not hold yet).

Cost: linear in the steps, plus per rank a bitset transitive closure of ``deps`` (steps^2 / 64 words);
16 ranks with a few thousand steps each check in well under a second.
"""

from __future__ import annotations

from collections import defaultdict, deque

from .ir import COLLECTIVES, OPS, Schedule, ScheduleError, Step

__all__ = ["check", "match_messages", "global_order", "infer_deps", "describe"]


def describe(schedule: Schedule, rank: int, index: int) -> str:
    """``"rank r step i (send to p, chunks [..])"``: how the checker's messages name a step."""
    s = schedule.steps[rank][index]
    way = "to" if s.op == "send" else "from"
    return f"rank {rank} step {index} ({s.op} {way} {s.peer}, chunks {list(s.chunks)})"


def check(schedule: Schedule) -> None:
    """Prove that ``schedule`` computes its collective (the conditions of the module docstring).

    Args:
        schedule: the schedule to prove.

    Raises:
        ScheduleError: the first broken condition; the message starts with its name ("well-formed",
            "pairing", "race", "deadlock", "double count", "postcondition") and names the rank, step,
            chunk and peer involved.
    """
    _well_formed(schedule)
    match = match_messages(schedule)
    _no_race(schedule)
    order = global_order(schedule, match)
    _replay(schedule, match, order)


# ---------------------------------------------------------------------------------------------- 1
def _well_formed(s: Schedule) -> None:
    if s.collective not in COLLECTIVES:
        raise ScheduleError(f"well-formed: collective {s.collective!r} is not one of {COLLECTIVES}")
    if not isinstance(s.nranks, int) or s.nranks < 1:
        raise ScheduleError(f"well-formed: nranks must be an int >= 1, got {s.nranks!r}")
    if len(s.steps) != s.nranks:
        raise ScheduleError(f"well-formed: {len(s.steps)} step lists for nranks={s.nranks}: give one per rank")
    if not s.weights or any(not isinstance(w, int) or w <= 0 for w in s.weights):
        raise ScheduleError(f"well-formed: chunk weights must be positive ints (at least one), got {s.weights}")
    if s.collective != "allreduce":
        for c in range(s.nchunks):
            try:
                s.shard_of(c)
            except ScheduleError as e:
                raise ScheduleError(f"well-formed: {e}") from None
    n, nchunks = s.nranks, s.nchunks
    for r, steps in enumerate(s.steps):
        for i, st in enumerate(steps):
            where = f"rank {r} step {i}"
            if st.op not in OPS:
                raise ScheduleError(f"well-formed: {where} has op {st.op!r}; ops are {OPS}")
            if not isinstance(st.peer, int) or not 0 <= st.peer < n or st.peer == r:
                raise ScheduleError(f"well-formed: {where} ({st.op}) has peer {st.peer!r}: it must be another rank "
                                    f"in 0..{n - 1}")
            if not st.chunks:
                raise ScheduleError(f"well-formed: {where} ({st.op} with peer {st.peer}) carries no chunk")
            for c in st.chunks:
                if not isinstance(c, int) or not 0 <= c < nchunks:
                    raise ScheduleError(f"well-formed: {where} ({st.op} with peer {st.peer}) names chunk {c!r}; "
                                        f"chunks are 0..{nchunks - 1}")
            if len(set(st.chunks)) != len(st.chunks):
                raise ScheduleError(f"well-formed: {where} ({st.op} with peer {st.peer}) names a chunk twice: "
                                    f"{list(st.chunks)}")
            for d in st.deps:
                if not isinstance(d, int) or not 0 <= d < i:
                    raise ScheduleError(f"well-formed: {where} depends on {d!r}: deps must name earlier steps "
                                        f"(0..{i - 1}) of the same rank")
            if st.op == "rrc" and s.collective == "allgather":
                raise ScheduleError(f"well-formed: {where} is an rrc (receive-reduce) in an all-gather, which "
                                    f"reduces nothing: use recv")


# ---------------------------------------------------------------------------------------------- 2
def match_messages(schedule: Schedule) -> list[list[tuple[int, int]]]:
    """The pairing rule: ``partner[r][i] = (peer, j)``, the step at the other end of step i's message
    (the k-th send a -> b with the k-th receive at b from a, in list order).

    Raises:
        ScheduleError: "pairing: ..." when the numbers differ or the k-th pair's chunk lists differ.
    """
    sends: dict[tuple[int, int], list[int]] = defaultdict(list)
    recvs: dict[tuple[int, int], list[int]] = defaultdict(list)
    for r, steps in enumerate(schedule.steps):
        for i, st in enumerate(steps):
            if st.op == "send":
                sends[(r, st.peer)].append(i)
            else:
                recvs[(st.peer, r)].append(i)
    partner: list[list[tuple[int, int]]] = [[(-1, -1)] * len(steps) for steps in schedule.steps]
    for a, b in sorted(set(sends) | set(recvs)):
        ss, rr = sends.get((a, b), []), recvs.get((a, b), [])
        for k, (i, j) in enumerate(zip(ss, rr)):
            if schedule.steps[a][i].chunks != schedule.steps[b][j].chunks:
                raise ScheduleError(f"pairing: message {k} from rank {a} to rank {b}: {describe(schedule, a, i)} "
                                    f"sends chunks {list(schedule.steps[a][i].chunks)} but "
                                    f"{describe(schedule, b, j)} receives into {list(schedule.steps[b][j].chunks)}; "
                                    f"the k-th send a->b pairs with the k-th receive at b from a")
            partner[a][i] = (b, j)
            partner[b][j] = (a, i)
        if len(ss) != len(rr):
            extra = (f"the first unmatched: {describe(schedule, a, ss[len(rr)])}" if len(ss) > len(rr)
                     else f"the first unmatched: {describe(schedule, b, rr[len(ss)])}")
            raise ScheduleError(f"pairing: rank {a} sends {len(ss)} messages to rank {b} but rank {b} posts "
                                f"{len(rr)} receives from rank {a}; {extra}")
    return partner


# ---------------------------------------------------------------------------------------------- 3
def _no_race(schedule: Schedule) -> None:
    for r, steps in enumerate(schedule.steps):
        anc: list[int] = [0] * len(steps)  # bit i: step i precedes this one through deps
        accessed: dict[int, int] = {}  # chunk -> steps so far that touch it
        written: dict[int, int] = {}  # chunk -> steps so far that write it
        for j, st in enumerate(steps):
            a = 0
            for d in st.deps:
                a |= anc[d] | (1 << d)
            anc[j] = a
            writes = st.op != "send"
            bit = 1 << j
            for c in st.chunks:
                # Deps point to earlier steps, so list order is a topological order: an earlier step that
                # conflicts must be an ancestor.
                bad = (accessed.get(c, 0) if writes else written.get(c, 0)) & ~a
                if bad:
                    i = (bad & -bad).bit_length() - 1
                    if writes and steps[i].op != "send":
                        who = "both write it"
                    else:
                        w, rd = (j, i) if writes else (i, j)
                        who = f"step {w} writes it, step {rd} reads it"
                    raise ScheduleError(f"race at rank {r}: {describe(schedule, r, i)} and {describe(schedule, r, j)} "
                                        f"touch chunk {c} ({who}) and no path of deps orders them: add {i} to the "
                                        f"deps of step {j} (or a chain of deps between them)")
                accessed[c] = accessed.get(c, 0) | bit
                if writes:
                    written[c] = written.get(c, 0) | bit


# ---------------------------------------------------------------------------------------------- 4
def global_order(schedule: Schedule, partner: list[list[tuple[int, int]]] | None = None) -> list[tuple[int, int]]:
    """A topological order of all steps ``(rank, index)`` under the deps edges and the edges from each
    send to its receive (every receive posted at the start, so nothing else waits).

    Raises:
        ScheduleError: "deadlock: ..." naming a cycle of waits.
    """
    if partner is None:
        partner = match_messages(schedule)
    steps = schedule.steps
    indeg = [[len(st.deps) + (st.op != "send") for st in rs] for rs in steps]
    users: list[list[list[int]]] = [[[] for _ in rs] for rs in steps]
    for r, rs in enumerate(steps):
        for i, st in enumerate(rs):
            for d in st.deps:
                users[r][d].append(i)
    ready = deque((r, i) for r, rs in enumerate(steps) for i in range(len(rs)) if indeg[r][i] == 0)
    order: list[tuple[int, int]] = []
    while ready:
        r, i = ready.popleft()
        order.append((r, i))
        for j in users[r][i]:
            indeg[r][j] -= 1
            if indeg[r][j] == 0:
                ready.append((r, j))
        if steps[r][i].op == "send":
            b, j = partner[r][i]
            indeg[b][j] -= 1
            if indeg[b][j] == 0:
                ready.append((b, j))
    total = sum(len(rs) for rs in steps)
    if len(order) < total:
        raise ScheduleError(f"deadlock: {_cycle(schedule, partner, indeg)}")
    return order


def _cycle(schedule: Schedule, partner, indeg) -> str:
    """A cycle among the steps left with waits, as text."""
    start = next((r, i) for r, rs in enumerate(indeg) for i, v in enumerate(rs) if v > 0)
    seen: dict[tuple[int, int], int] = {}
    path: list[tuple[tuple[int, int], str]] = []
    node = start
    while node not in seen:
        seen[node] = len(path)
        r, i = node
        st = schedule.steps[r][i]
        preds = [((r, d), "depends on") for d in st.deps if indeg[r][d] > 0]
        if st.op != "send" and indeg[partner[r][i][0]][partner[r][i][1]] > 0:
            preds.append((partner[r][i], "waits for the message of"))
        nxt, how = preds[0]  # a step still waiting has a predecessor still waiting
        path.append((node, how))
        node = nxt
    loop = path[seen[node]:]
    nodes = [n for n, _ in loop] + [node]
    text = ", which ".join(f"{how} {describe(schedule, *nodes[k + 1])}" for k, (_, how) in enumerate(loop))
    return (f"with every receive posted at the start, these steps wait on each other in a cycle: "
            f"{describe(schedule, *nodes[0])} {text} (the first again)")


# ---------------------------------------------------------------------------------------------- 5
def _replay(schedule: Schedule, partner, order) -> None:
    n, coll, steps = schedule.nranks, schedule.collective, schedule.steps
    nchunks = schedule.nchunks
    if coll == "allgather":
        shard = [schedule.shard_of(c) for c in range(nchunks)]
        have = [[shard[c] == r for c in range(nchunks)] for r in range(n)]
        for r, i in order:
            st = steps[r][i]
            if st.op == "send":
                for c in st.chunks:
                    if not have[r][c]:
                        raise ScheduleError(f"postcondition (allgather): {describe(schedule, r, i)} sends chunk {c}, "
                                            f"which rank {r} does not hold yet (it starts with shard {r} only and no "
                                            f"receive before this send wrote chunk {c})")
            else:
                for c in st.chunks:
                    have[r][c] = True
        for r in range(n):
            for c in range(nchunks):
                if not have[r][c]:
                    raise ScheduleError(f"postcondition (allgather): rank {r} never receives chunk {c} (shard "
                                        f"{shard[c]}): every rank must end with every chunk")
        return
    # all-reduce, reduce-scatter: (contributors bitmask, computation id) per (rank, chunk). The id of a
    # rank's own contribution is (rank, -1); an rrc at (rank, step) makes a new value (rank, step).
    mask = [[1 << r] * nchunks for r in range(n)]
    ident = [[(r, -1)] * nchunks for r in range(n)]
    payload: dict[tuple[int, int], list[tuple[int, tuple[int, int]]]] = {}
    for r, i in order:
        st = steps[r][i]
        if st.op == "send":
            payload[partner[r][i]] = [(mask[r][c], ident[r][c]) for c in st.chunks]
            continue
        data = payload.pop((r, i))
        for c, (m, idv) in zip(st.chunks, data):
            if st.op == "recv":
                mask[r][c], ident[r][c] = m, idv
                continue
            both = mask[r][c] & m
            if both:
                raise ScheduleError(f"double count at {describe(schedule, r, i)}, chunk {c}: the contributions of "
                                    f"ranks {_ranks(both)} are already in rank {r}'s chunk (it holds "
                                    f"{_ranks(mask[r][c])}) and arrive again (the message holds {_ranks(m)})")
            mask[r][c] |= m
            ident[r][c] = (r, i)
    full = (1 << n) - 1
    if coll == "reducescatter":
        for c in range(nchunks):
            r = schedule.shard_of(c)
            if mask[r][c] != full:
                raise ScheduleError(f"postcondition (reducescatter): rank {r} ends with chunk {c} of its shard lacking "
                                    f"the contributions of ranks {_ranks(full & ~mask[r][c])}")
        return
    for c in range(nchunks):
        for r in range(n):
            if mask[r][c] != full:
                raise ScheduleError(f"postcondition (allreduce): rank {r} ends with chunk {c} lacking the "
                                    f"contributions of ranks {_ranks(full & ~mask[r][c])}")
        ids = {ident[r][c] for r in range(n)}
        if len(ids) > 1:
            (a, i), (b, j) = sorted(ids)[:2]
            holders = {idv: [r for r in range(n) if ident[r][c] == idv] for idv in sorted(ids)}
            raise ScheduleError(f"postcondition (allreduce): chunk {c}'s full sum is computed more than once: by "
                                f"{describe(schedule, a, i)} and by {describe(schedule, b, j)} (ranks holding each: "
                                f"{list(holders.values())}); compute it once at one owner and copy it to the others, "
                                f"or the ranks may differ in the last bits")


def _ranks(bits: int) -> list[int]:
    return [r for r in range(bits.bit_length()) if bits >> r & 1]


# ---------------------------------------------------------------------------------------------- helper
def infer_deps(steps: list[list[Step]]) -> list[list[Step]]:
    """The steps with the deps that make each rank's list order its meaning: a step depends on the last
    earlier step writing any of its chunks and, if it writes, on every step that read them since.

    For writing a schedule as a program (every rank's steps in a sensible order) and getting the least
    deps that keep it race-free; deps a step already has are kept.

    Args:
        steps: per rank, its ordered steps.

    Returns:
        The same steps, deps added.
    """
    out: list[list[Step]] = []
    for rank_steps in steps:
        last_write: dict[int, int] = {}
        readers: dict[int, list[int]] = defaultdict(list)
        new: list[Step] = []
        for i, st in enumerate(rank_steps):
            deps = set(st.deps)
            writes = st.op != "send"
            for c in st.chunks:
                if c in last_write:
                    deps.add(last_write[c])
                if writes:
                    deps.update(readers.pop(c, ()))
            for c in st.chunks:
                if writes:
                    last_write[c] = i
                else:
                    readers[c].append(i)
            new.append(Step(st.op, st.peer, tuple(st.chunks), tuple(sorted(deps))))
        out.append(new)
    return out
