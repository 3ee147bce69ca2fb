"""Import msccl-tools / MSCCLang XML schedules into the IR (docs/architecture.md, "the IR and the checker"),
so that programs written for MSCCL run from PyTorch on any backend through the ``synth`` executor.

**The format** (as msccl-tools writes it: ``msccl/language/ir.py::ir_to_xml``, microsoft/msccl-tools
@030a750, "old format"; the meaning of each step type as the MSCCL runtime's interpreter executes it,
``mscclRunInterpreter`` in microsoft/msccl-executor-nccl)::

    <algo name proto nchannels nchunksperloop ngpus coll inplace [minBytes maxBytes outofplace redop]>
      <gpu id i_chunks o_chunks s_chunks>
        <tb id send recv chan>            a "threadblock": at most one send peer and one recv peer
          <step s type srcbuf srcoff dstbuf dstoff cnt depid deps hasdep/>   run in order within the tb

Buffers are ``i`` (input), ``o`` (output), ``s`` (scratch); offsets and ``cnt`` count chunks, the buffer
of the collective being ``nchunksperloop`` equal chunks. Step types, with their local operands:
``s`` sends ``src``; ``r`` receives into ``dst``; ``rcs`` receives into ``dst`` and forwards it; ``rrc``
receives and stores ``src + received`` into ``dst``; ``rrs`` receives and forwards ``src + received``
without storing it; ``rrcs`` does both; ``cpy`` copies ``src`` to ``dst`` locally; ``re`` reduces locally;
``nop`` only waits. ``depid``/``deps`` name one step (threadblock id, step index) of the same GPU that must
finish first. The k-th send of the tb at a with ``send=b`` on channel ch pairs with the k-th receive of the
tb at b with ``recv=a`` on channel ch.

**The mapping**:

- chunks: ``nchunksperloop`` chunks of weight 1; a (buffer, offset) slot of a rank maps to a chunk id:
  all-reduce: ``i[k]`` and ``o[k]`` are chunk k; all-gather: ``o[k]`` is chunk k and ``i[k]`` rank r's own
  chunk ``r * C + k`` (C = nchunksperloop / ngpus); reduce-scatter: ``i[k]`` is chunk k and ``o[k]`` rank
  r's ``r * C + k``. In-place programs map exactly. Out-of-place ones are imported *onto one buffer*
  (their input and output slots of a chunk become that chunk): exact for programs that never read an
  input slot after writing its output slot (the msccl-tools examples); one that does imports as a
  schedule that ``check`` rejects (whatever passes ``check`` computes the collective), never a wrong one;
- ``s`` -> send; ``r`` -> recv; ``rrc`` -> rrc (its ``src`` and ``dst`` must be one chunk); ``rcs`` -> recv
  then a dependent send of the same chunks; ``rrcs`` -> rrc then a dependent send; ``rrs`` -> rrc into
  ``src`` then a dependent send (the partial sum stays in ``src``, where MSCCL leaves ``src`` unchanged:
  exact when the program overwrites that chunk before reading it again, as rings do); ``cpy`` whose
  source and destination are one chunk (an out-of-place program's own shard) and ``nop`` -> no step,
  their dependencies passed on to the steps that depend on them;
- deps: the previous step of the same threadblock (tbs run in order) and ``depid``/``deps``;
- each rank's IR list is the order of a topological sort of the whole program in which the messages of
  each pair (a, b) keep one order at both ends (the IR pairs the k-th send with the k-th receive, MSCCL
  per channel).

**Not expressible in the IR** (:class:`ScheduleError` naming the element): scratch buffers (``s``, e.g.
msccl-tools' ``allreduce_a100_allpairs`` and ``allreduce_1step``), local ``re`` reductions and ``cpy``
between two chunks (they need IR ops ``copy(src_chunk -> dst_chunk)`` and ``reduce(src_chunk ->
dst_chunk)`` on one rank, plus scratch chunks outside the collective's buffer), a message that lands in
other chunks than it left (the IR moves chunk c into chunk c), ``rrc``/``rrcs`` into another chunk than
their ``src``, and collectives other than all-reduce, reduce-scatter and all-gather (``alltoall``).
"""

from __future__ import annotations

import heapq
import os
import xml.etree.ElementTree as ET
from collections import defaultdict, deque
from pathlib import Path

from .ir import Schedule, ScheduleError, Step

__all__ = ["from_msccl_xml"]

_COLL = {"allreduce": "allreduce", "all_reduce": "allreduce", "allgather": "allgather", "all_gather": "allgather",
         "reducescatter": "reducescatter", "reduce_scatter": "reducescatter"}
# XML step type -> the IR steps it becomes: (op, which local operand carries the chunks)
_EXPAND = {
    "s": (("send", "src"),),
    "r": (("recv", "dst"),),
    "rcs": (("recv", "dst"), ("send", "dst")),
    "rrc": (("rrc", "dst"),),
    "rrs": (("rrc", "src"), ("send", "src")),
    "rrcs": (("rrc", "dst"), ("send", "dst")),
    "cpy": (),
    "nop": (),
}


def _int(elem: ET.Element, attr: str, where: str, default: int | None = None) -> int:
    v = elem.get(attr)
    if v is None:
        if default is None:
            raise ScheduleError(f"msccl xml: {where} has no {attr!r} attribute")
        return default
    try:
        return int(v)
    except ValueError:
        raise ScheduleError(f"msccl xml: {where} has {attr}={v!r}, not an integer") from None


def from_msccl_xml(source: str | os.PathLike, *, collective: str | None = None) -> Schedule:
    """A schedule from an msccl-tools / MSCCLang XML program (the mapping of the module docstring).

    Args:
        source: the XML text (starting with ``<``) or the path of a file holding it.
        collective: overrides the ``coll`` attribute (older files have none): "allreduce",
            "reducescatter"/"reduce_scatter" or "allgather".

    Returns:
        The schedule (``meta`` records the source's name, protocol and in-place flag); run ``check`` on it.

    Raises:
        ScheduleError: the XML is malformed or uses something the IR cannot express (named in the message).
    """
    text = source if isinstance(source, str) and source.lstrip().startswith("<") else Path(source).read_text()
    try:
        root = ET.fromstring(text)
    except ET.ParseError as e:
        raise ScheduleError(f"msccl xml: does not parse: {e}") from None
    if root.tag != "algo":
        raise ScheduleError(f"msccl xml: the root element is <{root.tag}>, expected <algo>")
    name = root.get("name", "")
    coll_attr = collective or root.get("coll")
    if coll_attr is None:
        raise ScheduleError(f"msccl xml: <algo name={name!r}> has no coll attribute: pass collective=")
    coll = _COLL.get(coll_attr.lower())
    if coll is None:
        raise ScheduleError(f"msccl xml: <algo name={name!r}> is coll={coll_attr!r}; the IR has allreduce, "
                            f"reducescatter and allgather")
    gpus = root.findall("gpu")
    n = _int(root, "ngpus", "<algo>", len(gpus))
    if sorted(_int(g, "id", "<gpu>") for g in gpus) != list(range(n)) or n < 1:
        raise ScheduleError(f"msccl xml: ngpus={n} but the <gpu> ids are "
                            f"{sorted(_int(g, 'id', '<gpu>') for g in gpus)}: expected 0..{n - 1} once each")
    nchunks = _int(root, "nchunksperloop", "<algo>")
    if nchunks < 1 or (coll != "allreduce" and nchunks % n):
        raise ScheduleError(f"msccl xml: nchunksperloop={nchunks} for {coll} on {n} GPUs: it must be positive and, "
                            f"for reducescatter and allgather, a multiple of ngpus")
    per_rank = nchunks // n

    def chunks_of(rank: int, buf: str, off: int, cnt: int, writes: bool, where: str) -> tuple[int, ...]:
        if buf == "s":
            raise ScheduleError(f"msccl xml: {where} uses the scratch buffer; the IR has no scratch chunks "
                                f"(it would need them and local copy/reduce ops)")
        if buf not in ("i", "o"):
            raise ScheduleError(f"msccl xml: {where} names buffer {buf!r}; expected i, o or s")
        own = (coll == "allgather" and buf == "i") or (coll == "reducescatter" and buf == "o")
        size = per_rank if own else nchunks
        if off < 0 or cnt < 1 or off + cnt > size:
            raise ScheduleError(f"msccl xml: {where} covers chunks [{off}, {off + cnt}) of buffer {buf!r}, which "
                                f"has {size}")
        if own and writes and coll == "allgather":
            raise ScheduleError(f"msccl xml: {where} writes the input buffer of an all-gather")
        base = rank * per_rank if own else 0
        return tuple(range(base + off, base + off + cnt))

    # ------------------------------------------------------------------ read the program, expand the steps
    protos: list[dict] = []  # the IR steps: rank, op, peer, chunks, tb, s, deps (proto ids), prior xml steps
    first: dict[tuple[int, int, int], int] = {}  # xml step -> its first proto
    last: dict[tuple[int, int, int], int] = {}  # xml step -> its last proto
    waits: dict[tuple[int, int, int], list[tuple[int, int, int]]] = {}  # xml step -> xml steps it waits for
    channels: dict[tuple[str, int, int, int], tuple[int, int]] = {}  # ("send", a, b, ch) -> (rank, tb)
    tb_protos: dict[tuple[int, int], list[int]] = defaultdict(list)
    for g in gpus:
        r = _int(g, "id", "<gpu>")
        tbs = g.findall("tb")
        ids = [_int(tb, "id", f"<gpu id={r}> <tb>") for tb in tbs]
        if len(set(ids)) != len(ids):
            raise ScheduleError(f"msccl xml: <gpu id={r}> has threadblock ids {ids}: each once")
        for tb, t in zip(tbs, ids):
            wtb = f"<gpu id={r}> <tb id={t}>"
            send, recv, ch = _int(tb, "send", wtb, -1), _int(tb, "recv", wtb, -1), _int(tb, "chan", wtb, 0)
            for kind, peer in (("send", send), ("recv", recv)):
                if peer == -1:
                    continue
                if not 0 <= peer < n or peer == r:
                    raise ScheduleError(f"msccl xml: {wtb} has {kind}={peer}: not another of the {n} GPUs")
                a, b = (r, peer) if kind == "send" else (peer, r)
                key = (kind, a, b, ch)
                if key in channels:
                    raise ScheduleError(f"msccl xml: {wtb} and <tb id={channels[key][1]}> of <gpu id={r}> both "
                                        f"{kind} {'to' if kind == 'send' else 'from'} GPU {peer} on channel {ch}")
                channels[key] = (r, t)
            for k, st in enumerate(tb):
                where = f"{wtb} <{st.tag} s={st.get('s')}>"
                if st.tag != "step":
                    raise ScheduleError(f"msccl xml: {where}: expected <step> elements (msccl-tools' old format)")
                if _int(st, "s", where) != k:
                    raise ScheduleError(f"msccl xml: {where} is the step at position {k} of its threadblock")
                typ = st.get("type", "")
                if typ not in _EXPAND:
                    need = ("a local reduce op (reduce(src_chunk -> dst_chunk) on one rank)" if typ == "re"
                            else "a step type the MSCCL runtime and the IR share")
                    raise ScheduleError(f"msccl xml: {where} has type={typ!r}, which the IR cannot express: it "
                                        f"needs {need}")
                cnt = _int(st, "cnt", where, 1)
                xkey = (r, t, k)
                waits[xkey] = [(r, t, k - 1)] if k else []
                depid, deps = _int(st, "depid", where, -1), _int(st, "deps", where, -1)
                if depid >= 0:
                    if depid not in ids or not 0 <= deps < len(tbs[ids.index(depid)]):
                        raise ScheduleError(f"msccl xml: {where} depends on <tb id={depid}> step {deps}, which "
                                            f"<gpu id={r}> does not have")
                    waits[xkey].append((r, depid, deps))
                parts = _EXPAND[typ]
                if typ in ("cpy", "rrc", "rrcs"):  # a local operand and a local destination: one chunk in the IR
                    src = chunks_of(r, st.get("srcbuf", ""), _int(st, "srcoff", where), cnt, False, where)
                    dst = chunks_of(r, st.get("dstbuf", ""), _int(st, "dstoff", where), cnt, True, where)
                    if src != dst:
                        raise ScheduleError(f"msccl xml: {where} ({typ}) reads chunks {list(src)} and writes "
                                            f"{list(dst)}: the IR needs a local copy op (copy(src_chunk -> "
                                            f"dst_chunk) on one rank) for that")
                prev = None
                for op, operand in parts:
                    peer = send if op == "send" else recv
                    if peer == -1:
                        raise ScheduleError(f"msccl xml: {where} ({typ}) {op}s but its threadblock has "
                                            f"{'send' if op == 'send' else 'recv'}=-1")
                    chunks = chunks_of(r, st.get(f"{operand}buf", ""), _int(st, f"{operand}off", where), cnt,
                                       op != "send", where)
                    pid = len(protos)
                    protos.append({"rank": r, "op": op, "peer": peer, "chunks": chunks, "key": (r, t, k, len(
                        tb_protos[(r, t)])), "deps": set() if prev is None else {prev}, "ch": ch, "where": where})
                    tb_protos[(r, t)].append(pid)
                    if prev is None:
                        first[xkey] = pid
                    last[xkey] = prev = pid

    # ------------------------------------------------------------------ deps through steps with no IR step
    done: dict[tuple[int, int, int], frozenset[int]] = {}  # xml step -> the protos its completion means

    def completion(x: tuple[int, int, int]) -> frozenset[int]:
        stack, visiting = [(x, False)], set()  # an iterative depth-first search: `visiting` is its path
        while stack:
            y, expanded = stack.pop()
            if y in done:
                continue
            if y in last:
                done[y] = frozenset((last[y],))
            elif expanded:
                done[y] = frozenset().union(*(done[w] for w in waits[y]))
                visiting.discard(y)
            else:
                visiting.add(y)
                stack.append((y, True))
                for w in waits[y]:
                    if w in visiting:
                        raise ScheduleError(f"msccl xml: steps without transfers wait on each other in a cycle "
                                            f"through <gpu id={w[0]}> <tb id={w[1]}> step {w[2]}")
                    if w not in done:
                        stack.append((w, False))
        return done[x]

    for x, pid in first.items():
        for w in waits[x]:
            protos[pid]["deps"] |= completion(w)

    # ------------------------------------------------------------------ pair the messages per channel
    peer_of: dict[int, int] = {}
    for kind, a, b, ch in channels:
        if kind != "send":
            continue
        sr, st_ = channels[("send", a, b, ch)]
        sends = [p for p in tb_protos[(sr, st_)] if protos[p]["op"] == "send"]
        rr = channels.get(("recv", a, b, ch))
        recvs = [p for p in tb_protos[rr] if protos[p]["op"] != "send"] if rr else []
        if len(sends) != len(recvs):
            raise ScheduleError(f"msccl xml: GPU {a} sends {len(sends)} messages to GPU {b} on channel {ch} but GPU "
                                f"{b} receives {len(recvs)} from GPU {a} there")
        for ps, pr in zip(sends, recvs):
            if protos[ps]["chunks"] != protos[pr]["chunks"]:
                raise ScheduleError(f"msccl xml: {protos[ps]['where']} sends chunks {list(protos[ps]['chunks'])} "
                                    f"that {protos[pr]['where']} receives into chunks {list(protos[pr]['chunks'])}; "
                                    f"the IR moves a chunk into the same chunk only")
            peer_of[ps], peer_of[pr] = pr, ps
    for kind, a, b, ch in channels:
        if kind == "recv" and ("send", a, b, ch) not in channels:
            rr = channels[("recv", a, b, ch)]
            if any(protos[p]["op"] != "send" for p in tb_protos[rr]):
                raise ScheduleError(f"msccl xml: GPU {b} receives from GPU {a} on channel {ch} but GPU {a} sends "
                                    f"nothing to GPU {b} there")
    return _serialize(protos, peer_of, n, coll, nchunks, root, name)


def _serialize(protos: list[dict], peer_of: dict[int, int], n: int, coll: str, nchunks: int, root: ET.Element,
               name: str) -> Schedule:
    """The IR lists: a topological sort of the program (deps, and each send before its receive) in which the
    messages of each pair (a, b) come in one order at both ends."""
    m = len(protos)
    preds = [set(p["deps"]) for p in protos]
    for p, q in peer_of.items():
        if protos[p]["op"] != "send":
            preds[p].add(q)  # a receive's position comes after its send
    succ: list[list[int]] = [[] for _ in range(m)]
    for p in range(m):
        for q in preds[p]:
            succ[q].append(p)
    # Levels (longest path from a source) order the ready steps, so that the messages of a pair are
    # emitted in the order the program would run them.
    indeg = [len(x) for x in preds]
    level = [0] * m
    ready = deque(p for p in range(m) if indeg[p] == 0)
    seen = 0
    while ready:
        p = ready.popleft()
        seen += 1
        for q in succ[p]:
            level[q] = max(level[q], level[p] + 1)
            indeg[q] -= 1
            if indeg[q] == 0:
                ready.append(q)
    if seen < m:
        stuck = next(p for p in range(m) if indeg[p] > 0)
        raise ScheduleError(f"msccl xml: the program deadlocks: {protos[stuck]['where']} ({protos[stuck]['op']}) "
                            f"waits, through dependencies and messages, on itself")
    indeg = [len(x) for x in preds]
    queue: dict[tuple[int, int], deque[int]] = defaultdict(deque)  # pair -> sends emitted, receive not yet
    waiting: set[int] = set()  # receives whose preds are emitted but whose message is not first in line
    heap = [(level[p], protos[p]["key"], p) for p in range(m) if indeg[p] == 0]
    heapq.heapify(heap)
    emitted: list[int] = []

    def ready_recv(p: int) -> None:
        q = protos[p]
        if queue[(q["peer"], q["rank"])] and queue[(q["peer"], q["rank"])][0] == peer_of[p]:
            heapq.heappush(heap, (level[p], q["key"], p))
        else:
            waiting.add(p)

    while heap:
        _, _, p = heapq.heappop(heap)
        emitted.append(p)
        q = protos[p]
        pair = (q["rank"], q["peer"]) if q["op"] == "send" else (q["peer"], q["rank"])
        if q["op"] == "send":
            queue[pair].append(p)
        else:
            queue[pair].popleft()
        head = queue[pair][0] if queue[pair] else None
        if head is not None and peer_of[head] in waiting:
            waiting.discard(peer_of[head])
            heapq.heappush(heap, (level[peer_of[head]], protos[peer_of[head]]["key"], peer_of[head]))
        for s in succ[p]:
            indeg[s] -= 1
            if indeg[s] == 0:
                if protos[s]["op"] == "send":
                    heapq.heappush(heap, (level[s], protos[s]["key"], s))
                else:
                    ready_recv(s)
    if len(emitted) < m:
        p = min(waiting) if waiting else next(p for p in range(m) if p not in set(emitted))
        q = protos[p]
        raise ScheduleError(f"msccl xml: {q['where']} receives from GPU {q['peer']} in another order than GPU "
                            f"{q['peer']} sends on its channels; the IR has one ordered stream of messages per "
                            f"pair")
    index: dict[int, int] = {}
    steps: list[list[Step]] = [[] for _ in range(n)]
    for p in emitted:
        q = protos[p]
        index[p] = len(steps[q["rank"]])
        steps[q["rank"]].append(Step(q["op"], q["peer"], q["chunks"], tuple(sorted(index[d] for d in q["deps"]))))
    meta = {"source": "msccl-xml", "name": name, "proto": root.get("proto", ""), "inplace": root.get("inplace", "")}
    lo, hi = root.get("minBytes"), root.get("maxBytes")
    return Schedule(coll, n, [1] * nchunks, steps, name=name or "msccl", min_message_size=int(lo or 0),
                    max_message_size=int(hi) if hi else 2**63 - 1, meta=meta)
