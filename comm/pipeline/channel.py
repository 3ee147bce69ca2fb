"""The boundary channel: a pipeline stage's point-to-point traffic with its two neighbours
(docs/architecture.md section 5.5d).

One stage per rank of ``group``; stage ``s`` receives activations from ``s - 1`` and sends their
gradients back, and sends activations to ``s + 1`` and receives theirs. Four rules make the traffic
cheap and safe across a slow link:

- **Receives are posted ahead**, ``depth`` micro-batches deep, in micro-batch order, each into its
  own buffer. gloo (and NCCL) point-to-point is a rendezvous: a payload moves only once its receiver
  is ready, so a receive posted when the data is needed (torch's single-stage 1F1B) puts the whole
  transfer on the critical path. Posting early also sends the "ready" notice before this rank's own
  outgoing payload, behind which it would otherwise wait on the same connection.
- **Sends never block the caller**: a send is posted and retired later (its buffer is held until
  then); only the end of a step waits for them, bounded.
- **Every wait is bounded** by ``timeout`` and raises :class:`CommTimeoutError` naming the boundary,
  the micro-batch and the direction; a peer that died (its sockets closed) raises at once.
- **Every payload carries a trailer** (status, step, micro-batch, a checksum of the sample ids), so a
  stage whose micro-batch shape differs from the one agreed at the first step, or that failed, tells
  its neighbours with the message they are waiting for: both sides raise, nobody hangs. The first
  step's shapes, dtypes and configuration are agreed by one small exchange per boundary (the sender's
  description, the receiver's answer).

Bytes are counted per boundary and direction (and by the comm engine under ``pp/<direction>``).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from ..engine import wait_work
from ..errors import CollectiveMismatchError, CommError, CommTimeoutError
from ..runtime import context
from .codec import BoundaryCodec, DeltaCache, get_codec

__all__ = ["StageLinks", "Agreement"]

_TAG = {"fwd": 0, "bwd": 1, "meta": 2, "ack": 3}
_OK, _SHAPE, _ABORT = 0, 1, 2
_MAGIC = 0x7070
_TRAILER = 5  # int64: magic, status, step, micro-batch, ids checksum
_META = 24  # int64 slots of the first step's description
_DTYPES = [torch.float32, torch.float64, torch.bfloat16, torch.float16]
_MAX_DIMS = 8


@dataclass(frozen=True)
class Agreement:
    """What both sides of a boundary must share, checked at the first step: the micro-batch count,
    the schedule, the codecs of both directions and the delta mode (the shape and dtype of the
    activation travel with it)."""

    n_micro: int
    schedule: int
    fwd_codec: str
    bwd_codec: str
    delta: bool

    def encode(self) -> list[int]:
        codes = ["none", "bf16", "fp16", "int8", "int4"]
        return [self.n_micro, self.schedule, codes.index(self.fwd_codec) if self.fwd_codec in codes else 99,
                codes.index(self.bwd_codec) if self.bwd_codec in codes else 99, int(self.delta)]


@dataclass
class _Posted:
    mb: int
    buf: torch.Tensor
    work: object


@dataclass
class _Direction:
    """One direction of one boundary on this rank: an inbox (posted receives) or an outbox."""

    peer: int  # group rank
    kind: str  # "fwd" | "bwd"
    boundary: int
    codec: BoundaryCodec
    posted: list[_Posted] = field(default_factory=list)
    next_post: int = 0  # the next micro-batch to post a receive for
    sends: list = field(default_factory=list)  # (work, buf) in flight
    sent: int = 0  # micro-batches sent this step
    bytes: int = 0


def _pad8(n: int) -> int:
    return -(-n // 8) * 8


class StageLinks:
    """The boundary traffic of one pipeline stage (this rank) with its neighbours.

    Args:
        group: the pipeline's process group (one stage per rank, in rank order).
        agreement: the configuration every stage must share.
        timeout: seconds any one wait may take.
        delta_capacity: AQ-SGD delta mode on the activations (None: off): the number of distinct
            sample ids, whose cache each side of each boundary keeps.
        error_feedback: keep a residual per micro-batch index for the gradients this stage sends.
        depth: receives posted ahead per direction.
        backward: gradients travel back (False: forwards only, no gradient receive is ever posted: a
            receive left posted would take a later pipeline's message on the same group).
    """

    def __init__(self, group, agreement: Agreement, *, timeout: float, delta_capacity: int | None = None,
                 error_feedback: bool = False, depth: int = 2, backward: bool = True) -> None:
        self.group = group
        self.stage = dist.get_rank(group)
        self.stages = dist.get_world_size(group)
        self.agreement = agreement
        self.timeout = float(timeout)
        self.depth = depth
        fwd, bwd = get_codec(agreement.fwd_codec), get_codec(agreement.bwd_codec)
        s, last = self.stage, self.stage == self.stages - 1
        self.act_in = _Direction(s - 1, "fwd", s - 1, fwd) if s > 0 else None
        self.grad_out = _Direction(s - 1, "bwd", s - 1, bwd) if s > 0 and backward else None
        self.act_out = _Direction(s + 1, "fwd", s, fwd) if not last else None
        self.grad_in = _Direction(s + 1, "bwd", s, bwd) if not last and backward else None
        self.in_meta: tuple[tuple[int, ...], torch.dtype] | None = None  # the activation this stage receives
        self.out_meta: tuple[tuple[int, ...], torch.dtype] | None = None  # the activation it sends
        self.delta_in = DeltaCache(delta_capacity) if delta_capacity and s > 0 else None
        self.delta_out = DeltaCache(delta_capacity) if delta_capacity and not last else None
        self.residuals: dict[int, torch.Tensor] | None = {} if error_feedback else None
        self.step = 0
        self.ids: list[torch.Tensor | None] = []
        self.broken: str | None = None
        self._deadline = 0.0

    # ------------------------------------------------------------------------------- step frame
    def start(self, step: int) -> None:
        """Start step ``step`` (before anything of it can fail, so that a failure is relayed as this
        step's); refused after a failure."""
        if self.broken:
            raise CommError(f"pipeline stage {self.stage}: the pipeline failed earlier ({self.broken}); its "
                            f"boundaries may hold unmatched messages: create a new schedule on a new process group",
                            op="pp")
        self.step, self.ids = step, [None] * self.agreement.n_micro
        for d in (self.act_in, self.grad_out, self.act_out, self.grad_in):
            if d is not None:
                d.posted, d.next_post, d.sent = [], 0, 0

    def begin(self, ids: list[torch.Tensor | None]) -> None:
        """Post the step's receives the agreed shapes allow (the first step's activations wait for their
        description), given its micro-batches' sample ids (or Nones)."""
        self.ids = ids
        if self.in_meta is not None:
            self._top_up(self.act_in)
        if self.out_meta is not None:
            self._top_up(self.grad_in)

    def end(self) -> None:
        """Wait for this step's sends (bounded): every receiver consumes them within the step."""
        for d in (self.grad_out, self.act_out, self.act_in):
            if d is not None:
                self._retire(d, keep=0)

    def fail(self, exc: BaseException) -> None:
        """This stage's step failed: tell each neighbour that may still wait for a message from it,
        with that message (best effort, never blocking), and refuse later steps."""
        if self.broken:
            return
        self.broken = f"step {self.step}: {type(exc).__name__}: {str(exc)[:300]}"
        self._relay()
        # gloo drops a pending send whose work is freed: deliver what is queued (the neighbours wait for
        # exactly these messages) before the caller drops this object, for a short while at most.
        for d in (self.grad_out, self.act_out, self.act_in):
            if d is not None:
                try:
                    self._retire(d, keep=0, limit=min(self.timeout, 2.0))
                except CommError:
                    pass

    def _relay(self) -> None:
        n = self.agreement.n_micro
        if self.act_out is not None and self.act_out.sent < n:
            if self.out_meta is None:
                self._send_meta(status=_ABORT)
            else:
                self._send_status(self.act_out, self.out_meta, _ABORT, self.act_out.sent)
        if self.grad_out is not None and self.grad_out.sent < n and self.in_meta is not None:
            self._send_status(self.grad_out, self.in_meta, _ABORT, self.grad_out.sent)

    # ------------------------------------------------------------------------------- forward
    def recv_activation(self, mb: int) -> torch.Tensor:
        """Micro-batch ``mb``'s activation from the previous stage (the first step agrees its shape)."""
        if self.in_meta is None:
            self._recv_meta()
            self._top_up(self.act_in)
        payload = self._wait(self.act_in, mb)
        shape, dtype = self.in_meta
        ids = self.ids[mb]
        if self.delta_in is not None:
            delta = self.delta_in.cached(ids)
            x = self.delta_in.update(ids, self._codec(self.act_in, delta).decode(payload, shape, dtype),
                                     delta=delta).clone()
        else:
            x = self.act_in.codec.decode(payload, shape, dtype)  # may view the buffer: each is used once
        self._top_up(self.act_in)
        return x

    def send_activation(self, mb: int, x: torch.Tensor) -> None:
        """Send micro-batch ``mb``'s activation to the next stage (never blocks)."""
        x = x.detach()
        if self.out_meta is None:
            self._agree_out(x)
            self._top_up(self.grad_in)
        self._check_shape(x, self.out_meta, "activation", mb)
        ids = self.ids[mb]
        if self.delta_out is not None:
            delta = self.delta_out.cached(ids)
            codec = self._codec(self.act_out, delta)
            body = self.delta_out.delta(x, ids) if delta else x
            self._send(self.act_out, codec, body, mb,
                       after=lambda buf: self.delta_out.update(ids, codec.decode(buf, tuple(x.shape), x.dtype),
                                                               delta=delta))
        else:
            self._send(self.act_out, self.act_out.codec, x, mb)

    # ------------------------------------------------------------------------------- backward
    def recv_gradient(self, mb: int) -> torch.Tensor:
        """Micro-batch ``mb``'s activation gradient from the next stage."""
        payload = self._wait(self.grad_in, mb)
        shape, dtype = self.out_meta
        g = self.grad_in.codec.decode(payload, shape, dtype)
        self._top_up(self.grad_in)
        return g

    def send_gradient(self, mb: int, g: torch.Tensor | None) -> None:
        """Send micro-batch ``mb``'s input gradient to the previous stage (zeros for None, as torch does)."""
        shape, dtype = self.in_meta
        g = torch.zeros(shape, dtype=dtype) if g is None else g.detach()
        self._check_shape(g, self.in_meta, "gradient", mb)
        codec = self.grad_out.codec
        if self.residuals is None or codec.exact:
            self._send(self.grad_out, codec, g, mb)
            return
        r = self.residuals.get(mb)
        body = g if r is None else g + r
        self._send(self.grad_out, codec, body, mb,
                   after=lambda buf: self.residuals.__setitem__(mb, body - codec.decode(buf, shape, dtype)))

    # ------------------------------------------------------------------------------- plumbing
    def _codec(self, d: _Direction, delta: bool) -> BoundaryCodec:
        """Delta mode: a sample's first visit goes exact, later ones through the direction's codec."""
        return d.codec if delta else get_codec(None)

    def _size(self, d: _Direction, mb: int, meta) -> int:
        """A message's bytes. Delta mode: whether a micro-batch goes exact or as a delta is known from the
        cache before the step (the samples of one step are distinct: checked), so both sides agree."""
        shape, dtype = meta
        codec = d.codec
        if d.kind == "fwd" and (self.delta_in if d is self.act_in else self.delta_out) is not None:
            cache = self.delta_in if d is self.act_in else self.delta_out
            codec = self._codec(d, cache.cached(self.ids[mb]))
        return _pad8(codec.nbytes(shape, dtype)) + 8 * _TRAILER

    def _top_up(self, d: _Direction | None) -> None:
        """Post receives until ``depth`` are outstanding (this step's micro-batches only)."""
        if d is None:
            return
        meta = self.in_meta if d is self.act_in else self.out_meta
        while len(d.posted) < self.depth and d.next_post < self.agreement.n_micro:
            mb = d.next_post
            buf = torch.empty(self._size(d, mb, meta), dtype=torch.uint8)
            work = dist.irecv(buf, group=self.group, group_src=d.peer, tag=_TAG[d.kind])
            d.posted.append(_Posted(mb, buf, work))
            d.next_post += 1

    def _wait(self, d: _Direction, mb: int) -> torch.Tensor:
        if not d.posted or d.posted[0].mb != mb:
            raise CommError(f"pipeline stage {self.stage}: micro-batch {mb} {d.kind} was not posted in order "
                            f"(a schedule bug)", op="pp")
        p = d.posted.pop(0)
        what = (f"boundary {d.boundary} (stage {d.boundary} -> {d.boundary + 1}), micro-batch {mb}, "
                f"{'activation' if d.kind == 'fwd' else 'gradient'} from stage {d.peer}, step {self.step}")
        try:
            wait_work(p.work, None, deadline=time.monotonic() + self.timeout)
        except RuntimeError as exc:
            raise CommTimeoutError(f"pipeline stage {self.stage}: no {what} within {self.timeout:.1f} s ({exc}); "
                                   f"stage {d.peer} died, stopped or fell behind (raise timeout= for long stages)",
                                   op=f"pp/{d.kind}", ranks=[self.stage]) from exc
        trailer = p.buf[-8 * _TRAILER:].view(torch.int64)
        magic, status, step, got_mb, check = (int(v) for v in trailer)
        if magic != _MAGIC:
            raise CommError(f"pipeline stage {self.stage}: the {what} is not a commopt boundary message; another "
                            f"sender shares this process group's tags: give the pipeline its own group", op="pp")
        if status == _ABORT:
            raise CommTimeoutError(f"pipeline stage {self.stage}: stage {d.peer} failed during step {step} and "
                                   f"abandoned the {what}; see that stage's error", op=f"pp/{d.kind}",
                                   ranks=[d.peer])
        if status == _SHAPE:
            raise CollectiveMismatchError(f"pipeline stage {self.stage}: stage {d.peer} sent a micro-batch whose "
                                          f"shape differs from the one agreed at the first step ({what}); shapes "
                                          f"are fixed per stage: split batches evenly, pad the last one, or build a "
                                          f"new schedule", op=f"pp/{d.kind}", ranks=[d.peer, self.stage])
        if step != self.step or got_mb != mb:
            raise CollectiveMismatchError(f"pipeline stage {self.stage}: expected step {self.step} micro-batch {mb} "
                                          f"from stage {d.peer}, got step {step} micro-batch {got_mb}: the stages "
                                          f"run different step counts or schedules", op=f"pp/{d.kind}")
        ids = self.ids[mb]
        if ids is not None and d.kind == "fwd" and check != _checksum(ids):
            raise CollectiveMismatchError(f"pipeline stage {self.stage}: micro-batch {mb}'s sample ids differ "
                                          f"from stage {d.peer}'s; pass the same sample_ids to every stage",
                                          op="pp/fwd", ranks=[d.peer, self.stage])
        return p.buf[: p.buf.numel() - 8 * _TRAILER]

    def _send(self, d: _Direction, codec: BoundaryCodec, x: torch.Tensor, mb: int, after=None) -> None:
        n = codec.nbytes(tuple(x.shape), x.dtype)
        buf = torch.empty(_pad8(n) + 8 * _TRAILER, dtype=torch.uint8)
        codec.encode(x, buf[:n])
        if after is not None:
            after(buf[:n])
        ids = self.ids[mb]
        buf[-8 * _TRAILER:].view(torch.int64).copy_(torch.tensor(
            [_MAGIC, _OK, self.step, mb, _checksum(ids) if ids is not None else 0], dtype=torch.int64))
        self._post_send(d, buf)

    def _send_status(self, d: _Direction, meta, status: int, mb: int) -> None:
        try:
            size = self._size(d, mb, meta)
        except Exception:  # noqa: BLE001 (best effort: the cache state may be what failed)
            return
        buf = torch.zeros(size, dtype=torch.uint8)
        buf[-8 * _TRAILER:].view(torch.int64).copy_(torch.tensor([_MAGIC, status, self.step, mb, 0]))
        try:
            self._post_send(d, buf)
        except RuntimeError:
            pass  # the peer is gone: nothing to tell

    def _post_send(self, d: _Direction, buf: torch.Tensor) -> None:
        self._retire(d, keep=None)
        work = dist.isend(buf, group=self.group, group_dst=d.peer, tag=_TAG[d.kind])
        d.sends.append((work, buf))
        d.sent += 1
        d.bytes += buf.numel()
        context().engine().count(f"pp/{d.kind}", buf.numel())

    def _retire(self, d: _Direction, keep: int | None, limit: float | None = None) -> None:
        """Drop completed sends; with ``keep`` (0 at the end of a step), wait until at most that many
        are left in flight (within ``limit`` seconds, the timeout by default)."""
        d.sends = [(w, b) for w, b in d.sends if not w.is_completed()]
        if keep is None:
            return
        deadline = time.monotonic() + (self.timeout if limit is None else limit)
        while len(d.sends) > keep:
            work, _ = d.sends[0]
            try:
                wait_work(work, None, deadline=deadline)
            except RuntimeError as exc:
                raise CommTimeoutError(f"pipeline stage {self.stage}: a {d.kind} send to stage {d.peer} did not "
                                       f"complete within {self.timeout:.1f} s in step {self.step} ({exc}); stage "
                                       f"{d.peer} died or stopped", op=f"pp/{d.kind}", ranks=[d.peer]) from exc
            d.sends.pop(0)

    def _check_shape(self, x: torch.Tensor, meta, what: str, mb: int) -> None:
        shape, dtype = meta
        if tuple(x.shape) == shape and x.dtype == dtype:
            return
        d = self.act_out if what == "activation" else self.grad_out
        self._send_status(d, meta, _SHAPE, mb)  # the receiver raises too, before using anything
        peer = d.peer
        raise CollectiveMismatchError(f"pipeline stage {self.stage}: micro-batch {mb}'s {what} for stage {peer} is "
                                      f"{tuple(x.shape)} {x.dtype}, but {shape} {dtype} was agreed at the first "
                                      f"step; shapes are fixed per stage: split batches evenly, pad the last one, "
                                      f"or build a new schedule", op=f"pp/{d.kind}", ranks=[self.stage, peer])

    # ------------------------------------------------------------------------------- first step
    def _meta(self, x: torch.Tensor | None, status: int) -> torch.Tensor:
        m = torch.zeros(_META, dtype=torch.int64)
        m[0], m[1] = _MAGIC, status
        m[2:7] = torch.tensor(self.agreement.encode())
        if x is not None:
            m[7] = _DTYPES.index(x.dtype) if x.dtype in _DTYPES else -1
            m[8] = x.dim()
            m[9: 9 + x.dim()] = torch.tensor(x.shape)
        return m

    def _send_meta(self, status: int, x: torch.Tensor | None = None) -> None:
        """Send the first step's description (or, relaying a failure, its "failed" form: then a peer
        already gone is nothing to tell, and its error is swallowed)."""
        meta = self._meta(x, status)
        try:
            w = dist.isend(meta, group=self.group, group_dst=self.act_out.peer, tag=_TAG["meta"])
        except RuntimeError:
            if status != _ABORT:
                raise
            return
        self.act_out.sends.append((w, meta))

    def _agree_out(self, x: torch.Tensor) -> None:
        """Describe the activation to the next stage and wait for its answer (first step only)."""
        if x.dtype not in _DTYPES or x.dim() > _MAX_DIMS:
            raise ValueError(f"pipeline stage {self.stage}: a boundary carries a floating tensor of at most "
                             f"{_MAX_DIMS} dimensions; got {x.dtype} of {x.dim()}")
        self._send_meta(_OK, x)
        ack = torch.zeros(_META, dtype=torch.int64)
        work = dist.irecv(ack, group=self.group, group_src=self.act_out.peer, tag=_TAG["ack"])
        self._meta_wait(work, "answer to its activation's description", self.act_out.peer)
        if int(ack[1]) != _OK:
            raise CollectiveMismatchError(f"pipeline stage {self.stage}: stage {self.act_out.peer} refused the "
                                          f"configuration: {self._diff(ack)}; every stage must use the same "
                                          f"n_microbatches, schedule and codecs", op="pp/meta",
                                          ranks=[self.stage, self.act_out.peer])
        self.out_meta = (tuple(x.shape), x.dtype)

    def _recv_meta(self) -> None:
        m = torch.zeros(_META, dtype=torch.int64)
        work = dist.irecv(m, group=self.group, group_src=self.act_in.peer, tag=_TAG["meta"])
        self._meta_wait(work, "description of its first activation", self.act_in.peer)
        if int(m[1]) == _ABORT:
            raise CommTimeoutError(f"pipeline stage {self.stage}: stage {self.act_in.peer} failed before sending "
                                   f"its first activation (step {self.step}); see that stage's error",
                                   op="pp/meta", ranks=[self.act_in.peer])
        mine = self._meta(None, _OK)
        ok = bool(torch.equal(m[2:7], mine[2:7]))
        answer = self._meta(None, _OK if ok else _SHAPE)
        w = dist.isend(answer, group=self.group, group_dst=self.act_in.peer, tag=_TAG["ack"])
        self.act_in.sends.append((w, answer))
        if not ok:
            raise CollectiveMismatchError(f"pipeline stage {self.stage}: stage {self.act_in.peer}'s configuration "
                                          f"differs: {self._diff(m)}; every stage must use the same "
                                          f"n_microbatches, schedule and codecs", op="pp/meta",
                                          ranks=[self.stage, self.act_in.peer])
        nd = int(m[8])
        dtype = _DTYPES[int(m[7])]
        self.in_meta = (tuple(int(v) for v in m[9: 9 + nd]), dtype)

    def _diff(self, theirs: torch.Tensor) -> str:
        names = ["n_microbatches", "schedule", "forward codec", "backward codec", "delta mode"]
        mine = self.agreement.encode()
        return ", ".join(f"{n}: theirs {int(t)}, ours {o}" for n, t, o in zip(names, theirs[2:7], mine)
                         if int(t) != o) or "a different configuration"

    def _meta_wait(self, work, what: str, peer: int) -> None:
        try:
            wait_work(work, None, deadline=time.monotonic() + self.timeout)
        except RuntimeError as exc:
            raise CommTimeoutError(f"pipeline stage {self.stage}: no {what} from stage {peer} within "
                                   f"{self.timeout:.1f} s ({exc}); it died, stopped, or is not running the same "
                                   f"schedule", op="pp/meta", ranks=[peer]) from exc

    # ------------------------------------------------------------------------------- accounting
    def bytes(self) -> dict[str, int]:
        """Bytes this stage sent since it was built, by ``"<boundary>/<direction>"``."""
        return {f"{d.boundary}/{d.kind}": d.bytes for d in (self.grad_out, self.act_out) if d is not None}


def _checksum(ids: torch.Tensor) -> int:
    ids = ids.to(torch.int64)
    return int((ids * 1000003 + 7).remainder(2**61 - 1).sum()) if ids.numel() else 0
