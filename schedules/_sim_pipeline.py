"""A discrete-event model of one pipeline-parallel training step (docs/architecture.md, "The pipeline
model"), re-exported by :mod:`commopt.schedules.simulator`.

One stage per rank, ``S`` stages, ``M`` micro-batches. Each rank runs a *program*: computes (forward,
backward, a codec's encode and decode), posts of point-to-point sends and receives, and waits. A
transfer is rendezvous, as gloo's is: it goes on the wire once its sender has posted the send *and*
its receiver's ready notice is in, and a send completes when its bytes have arrived. The notice
(gloo's NOTIFY_RECV_READY) travels on the receiver's own connection to the sender, behind the
payloads it already had on the wire or queued to that peer (``notice=True``): torch's 1F1B posts the
send of gradient k before the receive of activation k + 1, so that activation leaves only once the
gradient has crossed (2 t on the cycle instead of t). Links (``links``): ``"boundary"``, every
direction of every boundary its own first-come first-served channel (full duplex); ``"star"``, one
node per rank with one uplink and one downlink to a switch (the emulated cluster), a transfer s -> t
crossing s's uplink and t's downlink, one message at a time per connection, the transfers through
a port sharing its rate equally; ``"star-fifo"``, each port one message at a time. A message alone
takes ``alpha + wire_bytes * beta`` (a :class:`~commopt.comm.cost.LinkModel`). With
``slowdown`` > 1, a rank computes that many times slower while one of its own transfers is on the
wire (gloo's threads share the core that computes), exactly, by rescheduling the compute's end
whenever a transfer of that rank starts or ends.

The posting policy is the point of the model:

- ``"torch"``: what ``torch.distributed.pipelining``'s ``ScheduleGPipe`` and ``Schedule1F1B`` (torch
  2.13) post and wait, op for op: 1F1B's warmup of ``min(M, S - stage)`` forwards with the last
  warmup send deferred into the first backward's batch; in steady state ``wait(fwd_sends +
  bwd_recv)``, backward, ``wait(bwd_sends + fwd_recv)``, forward, so the receive of the next forward
  is posted only after the backward and one boundary transfer lies on 1F1B's dependency cycle per
  micro-batch;
- ``"commopt"``: the executor of ``schedules.pipeline_parallel``: receives pre-posted into a ring of
  ``depth`` buffers (the receive of micro-batch ``k + depth`` is posted when ``k`` is consumed),
  sends that never block the caller, and 1F1B with ``extra`` more forwards in flight per boundary
  downstream (warmup ``min(M, S - stage + extra * (S - 1 - stage))``). Pre-posting alone does not hide
  the transfer (the exposure sits on the cycle); the extra forwards do, as long as a transfer takes at
  most ``extra * (f + b) / 2``. ``extra_per_boundary=False`` models ``extra`` on every stage alike,
  which hides only the last boundary's transfers.

:func:`simulate_pipeline_dp` is the 2x2 of pipelines and data parallelism sharing one node link:
two pipelines of two stages, each stage data-parallel with its twin, their all-reduce in chunks on
the same channels as the boundary traffic, served first come first served or boundary traffic first.
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import NamedTuple, Union

from commopt.comm.links import LinkModel

from .pipeline_parallel import actions

__all__ = ["PipelineCodec", "PipelineEvent", "PipelineResult", "PP_CODECS", "PP_LINKS", "PP_POLICIES", "PP_SCHEDULES",
           "pipeline_codec", "simulate_pipeline", "simulate_pipeline_dp"]

PP_POLICIES = ("torch", "commopt")
PP_SCHEDULES = ("gpipe", "1f1b")
PP_CODECS = ("none", "bf16", "int8", "int4")
PP_LINKS = ("boundary", "star", "star-fifo")
_FREE = LinkModel(0.0, 0.0)


@dataclass(frozen=True)
class PipelineCodec:
    """The codec of one direction of a boundary.

    Attributes:
        ratio: wire bytes over fp32 bytes (1: fp32 as it is).
        encode: sender's seconds per fp32 byte, on its compute lane, before the send is posted.
        decode: receiver's seconds per fp32 byte, on its compute lane, after the receive completed.
    """

    ratio: float = 1.0
    encode: float = 0.0
    decode: float = 0.0

    def __post_init__(self) -> None:
        if not 0 < self.ratio <= 1 or self.encode < 0 or self.decode < 0:
            raise ValueError(f"PipelineCodec: need 0 < ratio <= 1 and non-negative encode/decode seconds per byte, "
                             f"got ratio={self.ratio}, encode={self.encode}, decode={self.decode}")


def pipeline_codec(name: str, *, row: int = 256, encode: float = 0.0, decode: float = 0.0) -> PipelineCodec:
    """The codec the boundary channel names ``name``: ``none`` (fp32), ``bf16``, or ``int8`` / ``int4``
    with one fp32 scale per row of ``row`` elements (``QuantizeCompressor(bits, block=row)``'s bytes).

    Args:
        name: one of :data:`PP_CODECS`.
        row: elements per scale (the activation's last dimension, d_model).
        encode, decode: seconds per fp32 byte (0: free; measure them on the machine modelled).
    """
    bits = {"none": 32, "bf16": 16, "int8": 8, "int4": 4}.get(name)
    if bits is None:
        raise ValueError(f"pipeline_codec: unknown codec {name!r}; choose one of {PP_CODECS}")
    scales = 4 / row if bits < 16 else 0.0
    return PipelineCodec(min(1.0, (bits / 8 + scales) / 4), encode, decode)


class PipelineEvent(NamedTuple):
    """One event of the trace.

    ``kind``: ``F``, ``B`` (compute), ``encode_act``, ``decode_act``, ``encode_grad``, ``decode_grad``
    (codec compute); ``send_act``, ``recv_act``, ``send_grad``, ``recv_grad``, ``send_dp``,
    ``recv_dp`` (a post by ``stage``, ``start == end``); ``wait_send_act``, ``wait_recv_act``, ... (one
    per message of a wait, from the wait's start until the stage goes on); ``act``, ``grad``, ``dp``
    (a message on the wire, ``stage`` its sender).
    ``mb``: the micro-batch (for ``dp``: the chunk). A stage's events appear in the trace in the
    order that stage runs them.
    """

    stage: int
    kind: str
    mb: int
    start: float
    end: float


@dataclass
class PipelineResult:
    """One simulated step.

    Attributes:
        step: seconds from the first compute to the last event (compute or message) of the step.
        floor: the same programs with a free link and free codecs (the compute-alone floor).
        idle: per stage (rank), ``step`` minus the seconds it spent computing.
        boundary_bytes: per boundary, (activation, gradient) wire bytes per step.
        trace: every event (:class:`PipelineEvent`).
    """

    step: float
    floor: float
    idle: list[float]
    boundary_bytes: list[tuple[float, float]]
    trace: list[PipelineEvent] = field(default_factory=list, repr=False)

    @property
    def ratio(self) -> float:
        """``step / floor``."""
        return self.step / self.floor if self.floor > 0 else math.inf


# ------------------------------------------------------------------------------------- engine
class _Msg:
    """One message: rendezvous of its two posts, then its channel's turn, then its wire time at the
    share of its ports it gets."""

    __slots__ = ("key", "src", "dst", "channel", "ports", "seconds", "cls", "kind", "mb", "nbytes", "notice",
                 "send_at", "recv_at", "seq", "behind", "left", "rate", "last", "version", "start")

    def __init__(self, key: tuple, src: int, dst: int, channel: tuple, seconds: float, cls: int, kind: str, mb: int,
                 nbytes: float, ports: tuple = (), notice: bool = True) -> None:
        self.key, self.src, self.dst, self.channel, self.seconds, self.cls = key, src, dst, channel, seconds, cls
        self.kind, self.mb, self.nbytes, self.ports, self.notice = kind, mb, nbytes, ports, notice
        self.send_at: float | None = None
        self.recv_at: float | None = None
        self.seq = 0
        self.behind: set = set()  # the receiver's queued payloads its ready notice waits behind
        self.left, self.rate, self.last, self.version, self.start = seconds, 0.0, 0.0, -1, 0.0


# An instruction: ("c", kind, mb, seconds) compute; ("s", key) / ("r", key) post a send / receive;
# ("w", keys) wait until every message in keys has arrived.
_Ins = tuple
_Key = Union[tuple, str]


def _execute(programs: list[list[_Ins]], msgs: dict[_Key, _Msg], slowdown: float,
             priority: bool) -> tuple[list[PipelineEvent], list[float], list[float]]:
    """Run the programs in time order. Returns (trace, finish time per rank, computing seconds per rank).

    A message's ``channel`` is a tuple of resources it holds alone while on the wire (a boundary's
    direction, a connection, a port served first come first served); its ``ports`` are shared: the
    messages on the wire through a port split its rate equally, and a message moves at the share of
    its busiest port (its ``seconds`` are its time alone). Whenever resources free up, the ready
    messages are started in order of readiness (``priority``: the lowest class first), each one
    whose resources are all free. Starts happen after every other event of the same instant, so
    that posts made at that instant compete.

    The ready notice (gloo's NOTIFY_RECV_READY): a receive of a ``notice`` message posted by rank A
    from B counts as posted only once every payload from A to B that was on the wire or queued for it
    when A posted has arrived (the notice travels on A's connection to B, behind them).
    """
    n = len(programs)
    heap: list[tuple] = []
    seq = itertools.count()
    pc = [0] * n
    waiting: list[set | None] = [None] * n
    wait_from = [0.0] * n
    comp: list[list | None] = [None] * n  # [kind, mb, start, work left, last update, rate, version]
    active = [0] * n  # this rank's messages on the wire
    queue: list[_Msg] = []  # ready, not yet on the wire
    wire: list[_Msg] = []
    busy: set = set()
    load: dict = {}  # shared port -> messages on the wire through it
    unsent: dict[tuple[int, int], set] = {}  # (src, dst) -> keys of its ready messages not yet arrived
    notices: dict[_Key, list[_Msg]] = {}  # a message -> the receives whose notice waits for its arrival
    arrived: set[_Key] = set()
    waiters: dict[_Key, list[int]] = {}
    trace: list[PipelineEvent] = []
    finish: list[float | None] = [None] * n
    computing = [0.0] * n

    def push(t: float, order: int, what: str, data: object) -> None:
        heapq.heappush(heap, (t, order, next(seq), what, data))

    def rerate(r: int, t: float) -> None:
        c = comp[r]
        rate = 1.0 / slowdown if active[r] else 1.0
        if c is None or rate == c[5]:
            return
        c[3] -= (t - c[4]) * c[5]
        c[4], c[5], c[6] = t, rate, next(seq)
        push(t + max(0.0, c[3]) / rate, 0, "compute", (r, c[6]))

    def reshare(t: float) -> None:
        for m in wire:
            rate = 1.0 / max((load[p] for p in m.ports), default=1)
            if rate != m.rate:
                m.left -= (t - m.last) * m.rate
                m.last, m.rate, m.version = t, rate, next(seq)
                push(t + max(0.0, m.left) / rate, 0, "arrive", (m, m.version))

    def rendezvous(m: _Msg, t: float) -> None:
        if m.send_at is not None and m.recv_at is not None:
            m.seq = next(seq)
            queue.append(m)
            unsent.setdefault((m.src, m.dst), set()).add(m.key)
            push(t, 1, "start", None)

    def waited(r: int, ins: _Ins, start: float, end: float) -> None:
        for k in ins[1]:
            m = msgs[k]
            trace.append(PipelineEvent(r, ("wait_send_" if m.src == r else "wait_recv_") + m.kind, m.mb, start, end))

    def advance(r: int, t: float) -> None:
        prog = programs[r]
        while pc[r] < len(prog):
            ins = prog[pc[r]]
            pc[r] += 1
            if ins[0] == "c":
                rate = 1.0 / slowdown if active[r] else 1.0
                version = next(seq)  # unique: a superseded end event never ends a later compute
                comp[r] = [ins[1], ins[2], t, ins[3], t, rate, version]
                push(t + ins[3] / rate, 0, "compute", (r, version))
                return
            if ins[0] == "w":
                pending = {k for k in ins[1] if k not in arrived}
                if pending:
                    waiting[r], wait_from[r] = pending, t
                    for k in pending:
                        waiters.setdefault(k, []).append(r)
                    return
                waited(r, ins, t, t)
                continue
            m = msgs[ins[1]]
            trace.append(PipelineEvent(r, ("send_" if ins[0] == "s" else "recv_") + m.kind, m.mb, t, t))
            if ins[0] == "s":
                m.send_at = t
            elif m.notice and unsent.get((r, m.src)):
                m.behind = set(unsent[(r, m.src)])
                for k in m.behind:
                    notices.setdefault(k, []).append(m)
                continue
            else:
                m.recv_at = t
            rendezvous(m, t)
        finish[r] = t

    def start(t: float) -> None:
        order = sorted(queue, key=lambda x: (x.cls, max(x.send_at, x.recv_at), x.seq) if priority
                       else (max(x.send_at, x.recv_at), x.seq))
        for m in order:
            if busy.isdisjoint(m.channel):
                queue.remove(m)
                busy.update(m.channel)
                for p in m.ports:
                    load[p] = load.get(p, 0) + 1
                m.start, m.last, m.rate = t, t, 0.0
                wire.append(m)
                for r in {m.src, m.dst}:
                    active[r] += 1
                    rerate(r, t)
        reshare(t)

    for r in range(n):
        advance(r, 0.0)
    while heap:
        t, _, _, what, data = heapq.heappop(heap)
        if what == "compute":
            r, version = data
            c = comp[r]
            if c is None or c[6] != version:
                continue  # superseded by a change of rate
            trace.append(PipelineEvent(r, c[0], c[1], c[2], t))
            computing[r] += t - c[2]
            comp[r] = None
            advance(r, t)
        elif what == "start":
            start(t)
        else:  # a message arrived
            m, version = data
            if m.version != version:
                continue  # superseded by a change of its share
            key = m.key
            arrived.add(key)
            wire.remove(m)
            busy.difference_update(m.channel)
            for p in m.ports:
                load[p] -= 1
            unsent[(m.src, m.dst)].discard(key)
            reshare(t)
            trace.append(PipelineEvent(m.src, m.kind, m.mb, m.start, t))
            for r in {m.src, m.dst}:
                active[r] -= 1
                rerate(r, t)
            push(t, 1, "start", None)
            for o in notices.pop(key, []):  # a ready notice that waited behind this payload goes out
                o.behind.discard(key)
                if not o.behind:
                    o.recv_at = t
                    rendezvous(o, t)
            for r in waiters.pop(key, []):
                pend = waiting[r]
                if pend is None:
                    continue
                pend.discard(key)
                if not pend:
                    waiting[r] = None
                    waited(r, programs[r][pc[r] - 1], wait_from[r], t)
                    advance(r, t)
    stuck = [r for r in range(n) if finish[r] is None]
    if stuck:
        detail = ", ".join(f"rank {r} at {programs[r][pc[r] - 1]}" for r in stuck)
        raise RuntimeError(f"pipeline model: the programs deadlock ({detail}); a schedule posts a wait whose "
                           f"message is never posted by its peer")
    return trace, [float(f) for f in finish], computing


# ------------------------------------------------------------------------------------- programs
@dataclass(frozen=True)
class _Stage:
    """What one stage's program needs: its index, times, and codec seconds per message."""

    s: int
    S: int
    M: int
    f: float
    b: float
    enc_act: float = 0.0
    dec_act: float = 0.0
    enc_grad: float = 0.0
    dec_grad: float = 0.0
    tag: tuple = ()


def _program(st: _Stage, schedule: str, policy: str, depth: int, extra: int, per_boundary: bool = False) -> list[_Ins]:
    """One stage's instructions under ``policy`` (see the module docstring)."""
    s, S, M = st.s, st.S, st.M
    prev, nxt = s > 0, s < S - 1

    def a_in(k: int) -> tuple:
        return (*st.tag, "act", s - 1, k)

    def a_out(k: int) -> tuple:
        return (*st.tag, "act", s, k)

    def g_in(k: int) -> tuple:
        return (*st.tag, "grad", s, k)

    def g_out(k: int) -> tuple:
        return (*st.tag, "grad", s - 1, k)

    def code(kind: str, k: int, sec: float) -> list[_Ins]:
        return [("c", kind, k, sec)] if sec > 0 else []

    def fwd(k: int) -> list[_Ins]:
        return [*code("decode_act", k, st.dec_act if prev else 0.0), ("c", "F", k, st.f)]

    def bwd(k: int) -> list[_Ins]:
        return [*code("decode_grad", k, st.dec_grad if nxt else 0.0), ("c", "B", k, st.b)]

    def post(sends: list[tuple], recvs: list[tuple]) -> list[_Ins]:
        out: list[_Ins] = []
        for key in sends:  # the drop-in group encodes inside isend, before the batch's next op
            out += code("encode_act" if key[-3] == "act" else "encode_grad", key[-1],
                        st.enc_act if key[-3] == "act" else st.enc_grad)
            out.append(("s", key))
        return out + [("r", key) for key in recvs]

    def wait(keys: list[tuple]) -> list[_Ins]:
        return [("w", tuple(keys))] if keys else []

    prog: list[_Ins] = []
    if policy == "commopt":
        ring = min(depth, M)
        prog += [("r", a_in(k)) for k in range(ring) if prev] + [("r", g_in(k)) for k in range(ring) if nxt]
        order = actions(schedule, s, S, M, extra, per_boundary)  # the executor's own order
        sends = []
        for op, k in order:
            if op == "F":
                if prev:
                    prog += wait([a_in(k)])
                prog += code("decode_act", k, st.dec_act if prev else 0.0)
                if prev and k + depth < M:
                    prog.append(("r", a_in(k + depth)))  # the ring's buffer of k is free again
                prog.append(("c", "F", k, st.f))
                if nxt:
                    prog += post([a_out(k)], [])
                    sends.append(a_out(k))
            else:
                if nxt:
                    prog += wait([g_in(k)])
                prog += code("decode_grad", k, st.dec_grad if nxt else 0.0)
                if nxt and k + depth < M:
                    prog.append(("r", g_in(k + depth)))
                prog.append(("c", "B", k, st.b))
                if prev:
                    prog += post([g_out(k)], [])
                    sends.append(g_out(k))
        return prog + wait(sends)
    if schedule == "gpipe":  # torch's ScheduleGPipe._step_microbatches
        for recv_of, send_of, run, has_recv, has_send in ((a_in, a_out, fwd, prev, nxt), (g_in, g_out, bwd, nxt, prev)):
            sends = []
            for k in range(M):
                if has_recv:
                    prog += post([], [recv_of(k)]) + wait([recv_of(k)])
                prog += run(k)
                if has_send:
                    prog += post([send_of(k)], [])
                    sends.append(send_of(k))
            prog += wait(sends)
        return prog
    # torch's Schedule1F1B._step_microbatches, op for op
    warm = min(M, S - s)
    f_i = b_i = 0
    send_work: list[tuple] = []
    fwd_sends: list[tuple] = []
    for _ in range(warm):
        if prev:
            prog += post([], [a_in(f_i)]) + wait([a_in(f_i)])
        prog += fwd(f_i)
        prog += wait(send_work)
        send_work = []
        fwd_sends = [a_out(f_i)] if nxt else []
        if f_i != warm - 1:
            prog += post(fwd_sends, [])
            send_work = fwd_sends
        f_i += 1
    while True:
        bwd_recvs = [g_in(b_i)] if nxt else []
        prog += post(fwd_sends, bwd_recvs) + wait(fwd_sends + bwd_recvs)
        prog += bwd(b_i)
        bwd_sends = [g_out(b_i)] if prev else []
        b_i += 1
        if f_i == M:
            break
        fwd_recvs = [a_in(f_i)] if prev else []
        prog += post(bwd_sends, fwd_recvs) + wait(bwd_sends + fwd_recvs)
        prog += fwd(f_i)
        fwd_sends = [a_out(f_i)] if nxt else []
        f_i += 1
    prog += post(bwd_sends, [])
    send_work = bwd_sends
    while b_i < M:
        prog += post([], [g_in(b_i)]) + wait([g_in(b_i)])
        prog += bwd(b_i)
        prog += wait(send_work)
        send_work = [g_out(b_i)] if prev else []
        prog += post(send_work, [])
        b_i += 1
    return prog + wait(send_work)


def _per_stage(value: float | Sequence[float], n: int, what: str) -> list[float]:
    vals = [float(value)] * n if isinstance(value, (int, float)) else [float(v) for v in value]
    if len(vals) != n or any(not (v >= 0 and math.isfinite(v)) for v in vals):
        raise ValueError(f"simulate_pipeline: {what} must be one finite value >= 0 or {n} of them, got {value!r}")
    return vals


def _check(stages: int, micro_batches: int, schedule: str, policy: str, depth: int, extra: int,
           slowdown: float) -> None:
    if isinstance(stages, bool) or not isinstance(stages, int) or stages < 1:
        raise ValueError(f"simulate_pipeline: stages must be an int >= 1, got {stages!r}")
    if isinstance(micro_batches, bool) or not isinstance(micro_batches, int) or micro_batches < 1:
        raise ValueError(f"simulate_pipeline: micro_batches must be an int >= 1, got {micro_batches!r}")
    if schedule not in PP_SCHEDULES or policy not in PP_POLICIES:
        raise ValueError(f"simulate_pipeline: schedule {schedule!r} / policy {policy!r}: choose a schedule of "
                         f"{PP_SCHEDULES} and a policy of {PP_POLICIES}")
    if policy == "torch" and schedule == "1f1b" and micro_batches < stages:
        raise ValueError(f"simulate_pipeline: torch's Schedule1F1B needs micro_batches >= stages, got "
                         f"{micro_batches} < {stages}")
    if depth < 1 or extra < 0:
        raise ValueError(f"simulate_pipeline: need depth >= 1 and extra >= 0, got depth={depth}, extra={extra}")
    if not slowdown >= 1.0:
        raise ValueError(f"simulate_pipeline: slowdown must be >= 1 (a slowdown), got {slowdown}")


def _links(link: LinkModel | Sequence[LinkModel], n: int, what: str) -> list[LinkModel]:
    links = [link] * n if isinstance(link, LinkModel) else list(link)
    if len(links) != n:
        raise ValueError(f"simulate_pipeline: one LinkModel or one per {what} ({n}), got {len(links)}")
    return links


def _pair(a: LinkModel, b: LinkModel) -> LinkModel:
    """The path through a sender's uplink and a receiver's downlink: the slower of each term."""
    return a if a is b else LinkModel(max(a.alpha, b.alpha), max(a.beta, b.beta))


def _declare(msgs: dict, key: tuple, src: int, dst: int, channel: tuple, link: LinkModel, nbytes: float,
             cls: int, kind: str, mb: int, ports: tuple = (), notice: bool = True) -> None:
    msgs[key] = _Msg(key, src, dst, channel, link.time(nbytes) if link is not _FREE else 0.0, cls, kind, mb, nbytes,
                     ports, notice)


def _wires(S: int, links: str, link: LinkModel | Sequence[LinkModel]) -> object:
    """``(kind, boundary) -> (channel, ports, link alone)`` of a message, for the topology ``links``."""
    if links == "boundary":
        per = _links(link, S - 1, "boundary")
        return lambda kind, bd: (((kind, bd),), (), per[bd])
    if links not in PP_LINKS:
        raise ValueError(f"simulate_pipeline: unknown links {links!r}; choose one of {PP_LINKS}")
    per = _links(link, S, "rank (links='star': each rank's uplink and downlink)")

    def star(kind: str, bd: int) -> tuple:
        src, dst = (bd, bd + 1) if kind == "act" else (bd + 1, bd)
        ports = (("up", src), ("down", dst))
        if links == "star-fifo":
            return ports, (), _pair(per[src], per[dst])
        return (("conn", src, dst),), ports, _pair(per[src], per[dst])

    return star


def simulate_pipeline(stages: int, micro_batches: int, forward: float | Sequence[float],
                      backward: float | Sequence[float], *, link: LinkModel | Sequence[LinkModel],
                      activation_bytes: float | Sequence[float], schedule: str = "1f1b", policy: str = "commopt",
                      codec_act: PipelineCodec | None = None, codec_grad: PipelineCodec | None = None,
                      slowdown: float = 1.0, depth: int = 2, extra: int = 1, extra_per_boundary: bool = True,
                      links: str = "boundary", notice: bool = True) -> PipelineResult:
    """One training step of a pipeline with one stage per rank.

    Args:
        stages: S, the number of stages (ranks).
        micro_batches: M.
        forward, backward: seconds of one micro-batch's forward / backward, one value or one per stage.
        link: ``links="boundary"``: the link of every boundary, or one per boundary (``S - 1``), full
            duplex. ``links="star"``: every rank's link to the fabric, or one per rank (``S``): an uplink
            and a downlink of that rate.
        activation_bytes: fp32 bytes of one micro-batch's activation per boundary (one value or
            ``S - 1``); its gradient has as many.
        schedule: ``"gpipe"`` or ``"1f1b"``.
        policy: ``"torch"`` (torch's own schedules on gloo) or ``"commopt"`` (the executor).
        codec_act, codec_grad: the codec of each direction (None: fp32).
        slowdown: compute runs this many times slower while a transfer of its rank is on the wire.
        depth: ``"commopt"``: receive buffers posted ahead per boundary and direction.
        extra: ``"commopt"`` 1F1B: forwards in flight beyond torch's warmup on every stage but the last.
        extra_per_boundary: ``"commopt"`` 1F1B: ``extra`` more per boundary downstream instead (warmup
            ``S - stage + extra * (S - 1 - stage)``). A transfer is hidden only where a stage runs
            ``extra`` forwards further ahead than the stage after it: with ``S - stage + extra`` every
            stage but the last two keeps torch's distance of one, and the transfers between them stay on
            the cycle; per boundary, 1F1B hides transfers up to ``extra * (f + b) / 2`` at any depth.
        links: ``"boundary"``: every direction of every boundary is a channel of its own.
            ``"star"``: one node per rank, each with one link to a switch (the emulated cluster, a rack
            with one NIC per node): a transfer s -> t crosses s's uplink and t's downlink, one message at
            a time per connection (s, t), and the transfers through a port share its rate equally
            (TCP's fair share), so a middle stage's activations and gradients split its uplink.
            ``"star-fifo"``: the same ports, each carrying one message at a time, first ready first.
        notice: a receive is ready only once its rank's payloads queued to the sender have arrived
            (gloo's ready notice travels behind them on the same connection); False: at its post.

    Returns:
        A :class:`PipelineResult`; its ``floor`` runs the same programs with a free link and codecs.
    """
    _check(stages, micro_batches, schedule, policy, depth, extra, slowdown)
    S, M = stages, micro_batches
    fs, bs = _per_stage(forward, S, "forward"), _per_stage(backward, S, "backward")
    wires = _wires(S, links, link)
    acts = _per_stage(activation_bytes, S - 1, "activation_bytes")
    ca, cg = codec_act or PipelineCodec(), codec_grad or PipelineCodec()

    def run(free: bool) -> tuple[list[PipelineEvent], list[float], list[float]]:
        msgs: dict = {}
        for bd in range(S - 1):
            for kind, src, dst, ratio in (("act", bd, bd + 1, ca.ratio), ("grad", bd + 1, bd, cg.ratio)):
                channel, ports, ln = wires(kind, bd)
                for k in range(M):
                    _declare(msgs, (kind, bd, k), src, dst, channel, _FREE if free else ln, acts[bd] * ratio, 0,
                             kind, k, ports, notice)
        progs = []
        for s in range(S):
            inb, outb = (acts[s - 1] if s > 0 else 0.0), (acts[s] if s < S - 1 else 0.0)
            st = _Stage(s, S, M, fs[s], bs[s]) if free else _Stage(
                s, S, M, fs[s], bs[s], outb * ca.encode, inb * ca.decode, inb * cg.encode, outb * cg.decode)
            progs.append(_program(st, schedule, policy, depth, extra, extra_per_boundary))
        return _execute(progs, msgs, 1.0 if free else slowdown, False)

    trace, finish, computing = run(False)
    floor_trace, _, _ = run(True)
    step = _end(trace)
    return PipelineResult(step, _end(floor_trace), [step - c for c in computing],
                          [(M * a * ca.ratio, M * a * cg.ratio) for a in acts], trace)


def _end(trace: list[PipelineEvent]) -> float:
    return max((e.end for e in trace), default=0.0)


def simulate_pipeline_dp(micro_batches: int, forward: float | Sequence[float], backward: float | Sequence[float],
                         *, link: LinkModel, activation_bytes: float, dp_bytes: float | Sequence[float],
                         sharing: str = "fifo", dp_issue: str = "bucketed", dp_chunk_bytes: float = 1 << 20,
                         schedule: str = "1f1b", policy: str = "commopt", codec_act: PipelineCodec | None = None,
                         codec_grad: PipelineCodec | None = None, slowdown: float = 1.0, depth: int = 2,
                         extra: int = 1) -> PipelineResult:
    """The 2x2: two pipelines of two stages, stage i of each data-parallel with its twin, on two nodes
    joined by ``link`` (full duplex). Node 0 holds (pipe 0, stage 0) and (pipe 1, stage 1), node 1 the
    other two, so every boundary message and every data-parallel all-reduce crosses the one link.
    Ranks (the trace's ``stage``): ``2 * pipe + stage``.

    Each stage's all-reduce (2 ranks: each sends its ``dp_bytes`` to its twin) goes in chunks of
    ``dp_chunk_bytes``, posted on both twins (a collective's rendezvous), issued ``"after"`` the
    stage's last backward or ``"bucketed"``: chunk i once (i + 1) / n of the last backward has run
    (gradients ready layer by layer, as DDP's buckets). A direction of the link serves its messages
    ``"fifo"`` (in the order they are ready) or with ``"priority"`` (boundary messages before any
    chunk; a chunk on the wire is not preempted).

    Args:
        micro_batches, forward, backward, activation_bytes, schedule, policy, codec_act, codec_grad,
        slowdown, depth, extra: as :func:`simulate_pipeline` (forward / backward: one value or one per
        stage, the same in both pipelines).
        link: one direction of the node link.
        dp_bytes: gradient bytes of a stage (one value or one per stage).
        sharing: ``"fifo"`` or ``"priority"``.
        dp_issue: ``"after"`` or ``"bucketed"``.
        dp_chunk_bytes: bytes per chunk of the all-reduce (a bucket, or the priority plan's partition).

    Returns:
        A :class:`PipelineResult` over the 4 ranks; ``floor``: the same with a free link.
    """
    _check(2, micro_batches, schedule, policy, depth, extra, slowdown)
    if sharing not in ("fifo", "priority") or dp_issue not in ("after", "bucketed") or not dp_chunk_bytes > 0:
        raise ValueError(f"simulate_pipeline_dp: sharing {sharing!r} must be 'fifo' or 'priority', dp_issue "
                         f"{dp_issue!r} 'after' or 'bucketed', dp_chunk_bytes {dp_chunk_bytes} > 0")
    M = micro_batches
    fs, bs = _per_stage(forward, 2, "forward"), _per_stage(backward, 2, "backward")
    grads = _per_stage(dp_bytes, 2, "dp_bytes")
    ca, cg = codec_act or PipelineCodec(), codec_grad or PipelineCodec()
    act = float(activation_bytes)

    def rank(p: int, s: int) -> int:
        return 2 * p + s

    def node(p: int, s: int) -> int:
        return (p + s) % 2

    def run(free: bool) -> tuple[list[PipelineEvent], list[float], list[float]]:
        ln = _FREE if free else link
        msgs: dict = {}
        for p in range(2):
            for k in range(M):
                _declare(msgs, (p, "act", 0, k), rank(p, 0), rank(p, 1), ((node(p, 0), node(p, 1)),), ln,
                         act * ca.ratio, 0, "act", k)
                _declare(msgs, (p, "grad", 0, k), rank(p, 1), rank(p, 0), ((node(p, 1), node(p, 0)),), ln,
                         act * cg.ratio, 0, "grad", k)
        progs: list[list[_Ins]] = [[] for _ in range(4)]
        for p in range(2):
            for s in range(2):
                st = _Stage(s, 2, M, fs[s], bs[s], tag=(p,)) if free else _Stage(
                    s, 2, M, fs[s], bs[s], act * ca.encode if s == 0 else 0.0, act * ca.decode if s else 0.0,
                    act * cg.encode if s else 0.0, act * cg.decode if s == 0 else 0.0, (p,))
                prog = _program(st, schedule, policy, depth, extra)
                chunks = max(1, math.ceil(grads[s] / dp_chunk_bytes))
                sizes = [min(dp_chunk_bytes, grads[s] - i * dp_chunk_bytes) for i in range(chunks)]
                mine, twin = rank(p, s), rank(1 - p, s)
                for i, size in enumerate(sizes):
                    _declare(msgs, ("dp", s, i, p), mine, twin, ((node(p, s), node(1 - p, s)),), ln, size, 1, "dp",
                             i, notice=False)
                at = max(i for i, ins in enumerate(prog) if ins[:3] == ("c", "B", M - 1))
                last = prog[at]
                posts = [[("s", ("dp", s, i, p)), ("r", ("dp", s, i, 1 - p))] for i in range(chunks)]
                if dp_issue == "after":
                    middle = [last, *itertools.chain.from_iterable(posts)]
                else:  # chunk i once (i + 1) / n of the last backward has run
                    middle = []
                    for post in posts:
                        middle += [("c", "B", M - 1, last[3] / chunks), *post]
                keys = tuple(("dp", s, i, q) for i in range(chunks) for q in (0, 1))
                progs[mine] = prog[:at] + middle + prog[at + 1:] + [("w", keys)]
        return _execute(progs, msgs, 1.0 if free else slowdown, sharing == "priority")

    trace, _, computing = run(False)
    floor_trace, _, _ = run(True)
    step = _end(trace)
    return PipelineResult(step, _end(floor_trace), [step - c for c in computing],
                          [(M * act * ca.ratio, M * act * cg.ratio)], trace)
