"""A process group for torch's own pipelining with commopt's wire underneath (docs/architecture.md section 5.5d).

``boundary_group(codec="int8")`` returns a ``dist.ProcessGroup`` to give torch's ``PipelineStage(...,
group=pg)``: ``ScheduleGPipe``, ``Schedule1F1B`` and ``ScheduleInterleaved1F1B`` then run unmodified,
with every floating tensor a stage sends (activations forward, their gradients backward) encoded by a
boundary codec (``commopt.comm.pipeline.codec``) and every wait bounded. torch's pipelining has no
transport hook (its custom functions refuse the send and receive actions, ``P2POp`` accepts only
``isend``/``irecv``); the group its stages are given is the one place all of their traffic passes.

What the group does with each call:

- ``send`` of a floating tensor: encodes it at once into a uint8 payload of ``codec.nbytes(shape,
  dtype)`` (the caller may reuse its tensor as soon as the call returns) and sends the payload;
  ``recv`` of a floating tensor: posts a uint8 buffer of the same size (the receiver knows the shape
  and dtype of the tensor it posts: torch sizes every receive from the sender's description) and
  decodes into the caller's tensor in the work's ``wait()``, which torch's schedules call before they
  read a received tensor. Without a codec the tensor itself travels, as on the wrapped group.
- Non-floating tensors (torch's shape metadata through ``send_object_list``, its warm-up votes) pass
  through exactly, and so does every collective (barrier, broadcast, all-gather, ...): to the wrapped
  group, uncompressed.
- Every work's ``wait()`` is bounded by ``timeout`` and raises :class:`CommTimeoutError` naming the
  peer (group and global rank) and the direction; torch's schedules wait with no timeout of their own,
  so a dead or stopped stage otherwise holds its neighbours for the group's 30-minute default
  (docs/faults.md row 47). After a timeout gloo closes the pair: build a new group to go on.
- Bytes are counted per direction on the group (:meth:`BoundaryGroup.bytes_sent`) and by the comm
  engine under ``pp/group`` (boundary payloads) and ``pp/group/meta`` (everything else it sends).

Which direction a message goes is read from the two ranks, the same rule on both sides, so sender and
receiver always pick the same codec: with one stage per rank (``placement="single"``) a message to a
higher group rank is an activation, to a lower one a gradient; with torch's looped placement (stage i
on group rank ``i % size``: ``ScheduleInterleaved1F1B``, ``ScheduleLoopedBFS``, the interleaved zero
bubble schedules; ``placement="loop"``) a message to the next rank (cyclically) is an activation, to
the previous one a gradient. Where both directions reach the same peer (a looped pipeline on two
ranks; V-shaped placements, ``placement="v"``) the two cannot be told apart -- torch's tags are all 0,
and its send buffers carry nothing that says which -- so one codec must serve both and different
ones are refused.

A codec that one rank uses and its peer does not would make gloo abort the receiving process (a
payload larger than the posted buffer), so ``boundary_group`` agrees the codecs and the placement over
the wrapped group before the first byte: a mismatch raises :class:`CollectiveMismatchError` on every
rank.

The group is registered with torch (``dist.new_group`` with the ``"commopt_pp"`` backend, among the
wrapped group's ranks only), so ``dist.get_rank(pg)``, ``dist.get_global_rank``, ``P2POp`` and
``destroy_process_group(pg)`` work as on any group; it opens no connection of its own. Destroying it
leaves the wrapped group alone.
"""

from __future__ import annotations

import itertools
import threading
import time
import zlib
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from .._pygroup import PythonProcessGroup
from ..engine import wait_work
from ..errors import CollectiveMismatchError, CommTimeoutError
from ..runtime import context
from .codec import CODECS, BoundaryCodec, get_codec

__all__ = ["BACKEND_NAME", "PLACEMENTS", "BoundaryGroup", "BoundaryWork", "boundary_group"]

BACKEND_NAME = "commopt_pp"
PLACEMENTS = ("single", "loop", "v")
_FLOATS = (torch.float32, torch.float64, torch.float16, torch.bfloat16)
_MAGIC = 0x70706770
_KIND = {"fwd": "an activation", "bwd": "a gradient", "fwd+bwd": "a boundary tensor", "meta": "a metadata tensor"}


@dataclass(frozen=True)
class _Options:
    """What ``boundary_group`` hands torch's group creation (``pg_options``) for the creator."""

    inner: Any
    fwd: BoundaryCodec
    bwd: BoundaryCodec
    placement: str
    timeout: float


class BoundaryWork(dist.Work):
    """A work of a :class:`BoundaryGroup`: the wrapped group's work with a bounded ``wait`` and, for a
    compressed receive, the decode into the caller's tensor.

    Args:
        group: the group that issued it (its timeout and names).
        work: the wrapped group's work.
        what: the operation, for errors ("send of an activation to group rank 1 (global 1)").
        op: the operation's name in errors and counters ("pp/group/recv").
        seq: the operation's sequence number on the group.
        peer: the other end's group rank (None: a collective).
        finish: run once after the wrapped work completed (a receive's decode), or None.
        keep: tensors the wrapped work reads or writes, held until it completed (a send's payload).
    """

    def __init__(self, group: BoundaryGroup, work: Any, what: str, op: str, seq: int, peer: int | None = None,
                 finish: Any = None, keep: Any = None) -> None:
        super().__init__()
        self._group = group
        self._work = work
        self._what = what
        self._op = op
        self._seq = seq
        self._peer = peer
        self._finish = finish
        self._keep = keep
        self._lock = threading.Lock()

    def wait(self, timeout: timedelta | None = None) -> bool:  # type: ignore[override]
        """Wait, at most ``timeout`` (None or zero: the group's timeout); raise
        :class:`CommTimeoutError` when the peer did not answer in time or is gone."""
        seconds = timeout.total_seconds() if timeout is not None else 0.0
        seconds = seconds if seconds > 0 else self._group.timeout
        start = time.monotonic()
        try:
            wait_work(self._work, seconds)
        except RuntimeError as exc:
            g, took = self._group, time.monotonic() - start
            why = (f"did not complete within {seconds:.1f} s" if took >= seconds * 0.99 else
                   f"failed after {took:.1f} s (limit {seconds:.1f} s)")
            raise CommTimeoutError(f"pipeline group rank {g.rank()}: the {self._what} {why} ({type(exc).__name__}: "
                                   f"{str(exc)[:300]}); that stage died, stopped or fell behind (raise "
                                   f"boundary_group(timeout=) for long stages). The group's connection to it is "
                                   f"closed: build a new pipeline group", op=self._op, seq=self._seq,
                                   ranks=[g.rank() if self._peer is None else self._peer]) from exc
        self._complete()
        return True

    def _complete(self) -> None:
        with self._lock:  # two threads may wait for one work: decode once
            finish, self._finish, self._keep = self._finish, None, None
        if finish is not None:
            finish()

    def is_completed(self) -> bool:  # type: ignore[override]
        """The wrapped work's state (gloo's point-to-point works complete only inside ``wait()``, which a
        compressed receive needs anyway: it decodes there)."""
        return self._work.is_completed()

    def is_success(self) -> bool:  # type: ignore[override]
        return self._work.is_success()

    def exception(self) -> Any:  # type: ignore[override]
        return self._work.exception()

    def get_future(self) -> Any:  # type: ignore[override]
        if self._finish is not None:
            raise RuntimeError(f"{self._op}: a compressed receive has no future (gloo's point-to-point works have "
                               f"none); wait() for it")
        return self._work.get_future()

    def result(self) -> Any:  # type: ignore[override]
        return self._work.result()

    def source_rank(self) -> int:  # type: ignore[override]
        return self._work.source_rank()

    def _source_rank(self) -> int:
        return self._work._source_rank()


def _raw(codec: BoundaryCodec) -> bool:
    """The exact codec: the tensor itself travels."""
    return codec.exact and codec.name == "none"


def _through(name: str) -> Any:
    """A collective passed to the wrapped group unchanged, its wait bounded."""

    def call(self: BoundaryGroup, *args: Any, **kwargs: Any) -> Any:
        return BoundaryWork(self, getattr(self._inner, name)(*args, **kwargs), f"collective {name}",
                            f"pp/group/{name}", next(self._seq))

    call.__name__ = name
    call.__doc__ = f"``{name}`` on the wrapped group (uncompressed), its wait bounded by the group's timeout."
    return call


class BoundaryGroup(PythonProcessGroup):
    """A process group whose point-to-point floating tensors travel through boundary codecs (see the
    module docstring); build it with :func:`boundary_group`.

    Args:
        rank: this rank in the group (the wrapped group's rank).
        size: the group's size (the wrapped group's).
        options: the wrapped group, the codecs, the placement and the timeout.
    """

    backend_name = BACKEND_NAME

    def __init__(self, rank: int, size: int, options: _Options) -> None:
        super().__init__(rank, size)
        self._inner = options.inner
        self._fwd, self._bwd = options.fwd, options.bwd
        self._placement = options.placement
        self._timeout = options.timeout
        self._seq = itertools.count()
        self._bytes: dict[str, int] = {}
        self._bytes_lock = threading.Lock()

    # -- what the group is -----------------------------------------------------------------------
    @property
    def timeout(self) -> float:
        """Seconds any one wait may take."""
        return self._timeout

    @property
    def codecs(self) -> tuple[BoundaryCodec, BoundaryCodec]:
        """(activation codec, gradient codec)."""
        return self._fwd, self._bwd

    @property
    def wrapped(self) -> Any:
        """The group that carries the bytes."""
        return self._inner

    def bytes_sent(self) -> dict[str, int]:
        """Bytes this rank sent through the group since it was built: ``"fwd"`` (activations),
        ``"bwd"`` (their gradients), ``"fwd+bwd"`` (boundary tensors whose direction the placement
        cannot tell) and ``"meta"`` (non-floating tensors: torch's metadata and votes)."""
        with self._bytes_lock:
            return dict(self._bytes)

    # -- direction ---------------------------------------------------------------------------------
    def _direction(self, src: int, dst: int) -> str:
        """"fwd", "bwd" or "fwd+bwd" for a message from group rank ``src`` to ``dst``: a function of
        the two ranks alone, so that both ends pick the same codec."""
        size = self.size()
        if self._placement == "loop" and size > 2:
            if dst == (src + 1) % size:
                return "fwd"
            if dst == (src - 1) % size:
                return "bwd"
        elif self._placement != "single":
            return "fwd+bwd"  # one codec serves both (checked by boundary_group)
        return "fwd" if dst > src else "bwd"

    def _codec(self, direction: str) -> BoundaryCodec:
        return self._bwd if direction == "bwd" else self._fwd

    def _peer(self, r: int) -> str:
        try:
            return f"group rank {r} (global {dist.get_global_rank(self, r)})"
        except (ValueError, RuntimeError, KeyError):
            return f"group rank {r}"

    def _count(self, key: str, n: int) -> None:
        with self._bytes_lock:
            self._bytes[key] = self._bytes.get(key, 0) + n
        context().engine().count("pp/group" if key != "meta" else "pp/group/meta", n)

    @staticmethod
    def _one(tensors: Any, op: str) -> torch.Tensor:
        tensors = [tensors] if isinstance(tensors, torch.Tensor) else list(tensors)
        if len(tensors) != 1:
            raise ValueError(f"{op}: the pipeline group sends one tensor per call, got {len(tensors)}")
        return tensors[0]

    @staticmethod
    def _boundary(t: torch.Tensor) -> bool:
        return t.dtype in _FLOATS and t.numel() > 0

    # -- point to point ----------------------------------------------------------------------------
    def send(self, tensors: Any, dstRank: int, tag: int = 0) -> BoundaryWork:  # noqa: N803 (torch's name)
        """Send one tensor to group rank ``dstRank``: a floating one encoded by its direction's codec."""
        t = self._one(tensors, "send")
        seq, me = next(self._seq), self.rank()
        if self._boundary(t):
            direction = self._direction(me, dstRank)
            codec = self._codec(direction)
            kind = _KIND[direction]
            if _raw(codec):
                payload = t  # the tensor's own bytes: no copy
            else:
                payload = torch.empty(codec.nbytes(tuple(t.shape), t.dtype), dtype=torch.uint8, device=t.device)
                codec.encode(t.detach(), payload)
        else:
            direction, kind, payload = "meta", _KIND["meta"], t
        what = f"send of {kind} ({tuple(t.shape)} {t.dtype}) to {self._peer(dstRank)}"
        work = self._post(lambda: self._inner.send([payload], dstRank, tag), what, "pp/group/send", seq, dstRank)
        self._count(direction, payload.numel() * payload.element_size())
        return BoundaryWork(self, work, what, "pp/group/send", seq, dstRank, keep=payload)

    def recv(self, tensors: Any, srcRank: int, tag: int = 0) -> BoundaryWork:  # noqa: N803 (torch's name)
        """Receive one tensor from group rank ``srcRank``: a floating one as its direction's codec's
        payload, decoded into ``tensors[0]`` when the work is waited for."""
        t = self._one(tensors, "recv")
        seq, me = next(self._seq), self.rank()
        if self._boundary(t):
            direction = self._direction(srcRank, me)
            return self._recv_coded(t, self._codec(direction), srcRank, tag, seq, _KIND[direction])
        what = f"receive of {_KIND['meta']} ({tuple(t.shape)} {t.dtype}) from {self._peer(srcRank)}"
        work = self._post(lambda: self._inner.recv([t], srcRank, tag), what, "pp/group/recv", seq, srcRank)
        return BoundaryWork(self, work, what, "pp/group/recv", seq, srcRank)

    def _recv_coded(self, t: torch.Tensor, codec: BoundaryCodec, src: int, tag: int, seq: int,
                    kind: str) -> BoundaryWork:
        what = f"receive of {kind} ({tuple(t.shape)} {t.dtype}) from {self._peer(src)}"
        if _raw(codec):
            work = self._post(lambda: self._inner.recv([t], src, tag), what, "pp/group/recv", seq, src)
            return BoundaryWork(self, work, what, "pp/group/recv", seq, src)
        shape, dtype = tuple(t.shape), t.dtype
        payload = torch.empty(codec.nbytes(shape, dtype), dtype=torch.uint8, device=t.device)

        def decode() -> None:
            with torch.no_grad():  # torch's activation buffers require grad; the copy is not part of any graph
                t.copy_(codec.decode(payload, shape, dtype))

        work = self._post(lambda: self._inner.recv([payload], src, tag), what, "pp/group/recv", seq, src)
        return BoundaryWork(self, work, what, "pp/group/recv", seq, src, finish=decode, keep=payload)

    def recv_anysource(self, tensors: Any, tag: int = 0) -> BoundaryWork:
        """A receive from any rank: only where one codec serves both directions (the sender is unknown)."""
        t = self._one(tensors, "recv_anysource")
        seq = next(self._seq)
        if self._boundary(t):
            if self._fwd.name != self._bwd.name:
                raise ValueError("pipeline group: a receive from any source cannot tell an activation from a "
                                 f"gradient, whose codecs differ ({self._fwd.name}, {self._bwd.name}); name the "
                                 "source rank")
            codec = self._fwd
            if not _raw(codec):
                raise ValueError(f"pipeline group: a receive from any source of a {codec.name}-coded tensor is not "
                                 f"supported (the payload's sender is needed to decode it); name the source rank")
        what = f"receive of {tuple(t.shape)} {t.dtype} from any rank"
        work = self._post(lambda: self._inner.recv_anysource([t], tag), what, "pp/group/recv", seq, None)
        return BoundaryWork(self, work, what, "pp/group/recv", seq)

    def _post(self, post: Any, what: str, op: str, seq: int, peer: int | None) -> Any:
        """Post on the wrapped group; a peer already gone fails here, with the same error as a wait."""
        try:
            return post()
        except RuntimeError as exc:
            raise CommTimeoutError(f"pipeline group rank {self.rank()}: the {what} could not be posted "
                                   f"({type(exc).__name__}: {str(exc)[:300]}); that stage died or its connection "
                                   f"closed: build a new pipeline group", op=op, seq=seq,
                                   ranks=[self.rank() if peer is None else peer]) from exc

    # -- everything else: the wrapped group, uncompressed ----------------------------------------
    broadcast = _through("broadcast")
    allreduce = _through("allreduce")
    allreduce_coalesced = _through("allreduce_coalesced")
    allgather = _through("allgather")
    allgather_coalesced = _through("allgather_coalesced")
    _allgather_base = _through("_allgather_base")
    allgather_into_tensor_coalesced = _through("allgather_into_tensor_coalesced")
    reduce = _through("reduce")
    reduce_scatter = _through("reduce_scatter")
    _reduce_scatter_base = _through("_reduce_scatter_base")
    reduce_scatter_tensor_coalesced = _through("reduce_scatter_tensor_coalesced")
    alltoall = _through("alltoall")
    alltoall_base = _through("alltoall_base")
    gather = _through("gather")
    scatter = _through("scatter")
    barrier = _through("barrier")
    monitored_barrier = _through("monitored_barrier")

    def all_gather_single(self, *args: Any, **kwargs: Any) -> BoundaryWork:
        return self._allgather_base(*args, **kwargs)

    def reduce_scatter_single(self, *args: Any, **kwargs: Any) -> BoundaryWork:
        return self._reduce_scatter_base(*args, **kwargs)

    def all_to_all_single(self, *args: Any, **kwargs: Any) -> BoundaryWork:
        return self.alltoall_base(*args, **kwargs)

    # -- lifecycle ---------------------------------------------------------------------------------
    def shutdown(self) -> None:
        """Nothing to release: the wrapped group belongs to the caller (``destroy_process_group(pg)``
        removes this group only)."""

    def abort(self) -> None:
        self.shutdown()


def _create(common: Any, options: Any) -> BoundaryGroup:
    """The creator torch's ``new_group`` calls (extended API: it receives ``pg_options``)."""
    if not isinstance(options, _Options):
        raise TypeError(f"backend {BACKEND_NAME!r}: build the group with commopt.comm.pipeline.boundary_group(...), "
                        f"not new_group(backend={BACKEND_NAME!r}) (got pg_options={type(options).__name__})")
    inner = options.inner
    if common.group_rank != inner.rank() or common.group_size != inner.size():
        raise RuntimeError(f"boundary_group: torch made rank {common.group_rank} of {common.group_size}, the wrapped "
                           f"group has rank {inner.rank()} of {inner.size()}")
    return BoundaryGroup(common.group_rank, common.group_size, options)


def _register_backend() -> None:
    """Register ``"commopt_pp"`` with torch.distributed (idempotent)."""
    if BACKEND_NAME.upper() in dist.Backend._plugins:  # torch keeps no public "is registered" query
        return
    dist.Backend.register_backend(BACKEND_NAME, _create, extended_api=True, devices=["cpu", "cuda"])


def _code(codec: BoundaryCodec) -> int:
    return zlib.crc32(codec.name.encode()) & 0x7FFFFFFF


def _agree(inner: Any, fwd: BoundaryCodec, bwd: BoundaryCodec, placement: str, timeout: float) -> None:
    """Every rank of ``inner`` must use the same codecs and placement: a payload larger than the buffer
    its receiver posted makes gloo abort the receiving process, so this is checked before any byte."""
    mine = torch.tensor([_MAGIC, _code(fwd), _code(bwd), PLACEMENTS.index(placement)], dtype=torch.int64)
    size = dist.get_world_size(inner)
    rows = [torch.zeros_like(mine) for _ in range(size)]
    wait_work(dist.all_gather(rows, mine, group=inner, async_op=True), timeout, op="pp/group/agree")
    differ = [r for r, row in enumerate(rows) if not torch.equal(row, rows[0])]
    if differ:
        names = {_code(get_codec(n)): n for n in CODECS} | {_code(fwd): fwd.name, _code(bwd): bwd.name}

        def said(row: torch.Tensor) -> str:
            p = int(row[3])
            return (f"forward {names.get(int(row[1]), 'another codec')}, backward "
                    f"{names.get(int(row[2]), 'another codec')}, placement "
                    f"{PLACEMENTS[p] if 0 <= p < len(PLACEMENTS) else '?'}")

        seen = "; ".join(f"rank {r}: {said(row)}" for r, row in enumerate(rows))
        raise CollectiveMismatchError(f"boundary_group: the ranks disagree on the codecs or the placement ({seen}); "
                                      f"every rank of a pipeline must pass the same codec, forward_codec, "
                                      f"backward_codec and placement", op="pp/group/agree", ranks=[0, *differ])


def boundary_group(group: Any = None, *, codec: str | BoundaryCodec | None = None,
                   forward_codec: str | BoundaryCodec | None = None, backward_codec: str | BoundaryCodec | None = None,
                   placement: str = "single", timeout: float = 300.0) -> BoundaryGroup:
    """A process group for torch's ``PipelineStage(..., group=pg)`` whose boundary tensors travel
    compressed and whose waits are bounded (see the module docstring).

    Collective over ``group``: every rank of it calls this, with the same arguments (checked).

    Args:
        group: the group that carries the bytes, one pipeline's ranks (None: the world). Point-to-point
            traffic of others on the same group and tag would be matched against the pipeline's: give
            the pipeline a group of its own when something else sends point-to-point on these ranks.
        codec: the codec of both directions: None or "none" (exact), "bf16", "fp16", "int8", "int4"
            (``commopt.comm.pipeline.CODECS``), or a ``BoundaryCodec``.
        forward_codec, backward_codec: the activations' and the gradients' codec where they differ from
            ``codec`` (None: ``codec``; "none": exact).
        placement: where torch puts the stages: "single" (one per rank: ``ScheduleGPipe``,
            ``Schedule1F1B``), "loop" (stage i on rank ``i % size``: ``ScheduleInterleaved1F1B``,
            ``ScheduleLoopedBFS``, ``ScheduleInterleavedZeroBubble``) or "v" (``ScheduleZBVZeroBubble``,
            ``ScheduleDualPipeV``). "v", and "loop" on two ranks, send both directions to the same peer:
            there the two codecs must be the same.
        timeout: seconds any one wait may take before :class:`CommTimeoutError`.

    Returns:
        The group, registered with torch; ``dist.destroy_process_group(pg)`` removes it (the wrapped
        group stays).

    Raises:
        ValueError: an unknown codec or placement, a timeout that is not positive, two codecs where
            the placement cannot tell the directions apart, a rank outside ``group``.
        CollectiveMismatchError: the ranks passed different codecs or placements (on every rank).
        CommTimeoutError: a rank of ``group`` did not call this within ``timeout``.
    """
    if not dist.is_initialized():
        raise RuntimeError("boundary_group: torch.distributed is not initialized; call dist.init_process_group first")
    if placement not in PLACEMENTS:
        raise ValueError(f"boundary_group: placement={placement!r}; use one of {PLACEMENTS}")
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not timeout > 0:
        raise ValueError(f"boundary_group: timeout={timeout!r} must be a positive number of seconds")
    fwd = get_codec(forward_codec if forward_codec is not None else codec)
    bwd = get_codec(backward_codec if backward_codec is not None else codec)
    inner = group if group is not None else dist.group.WORLD
    if inner is dist.GroupMember.NON_GROUP_MEMBER:
        raise ValueError("boundary_group: this rank is not in the group; only the group's ranks call boundary_group")
    try:
        ranks = dist.get_process_group_ranks(inner)
    except KeyError as exc:
        raise ValueError("boundary_group: the group is not registered with torch.distributed; wrap a group made by "
                         "init_process_group or new_group") from exc
    size = len(ranks)
    if fwd.name != bwd.name and (placement == "v" or (placement == "loop" and size == 2)):
        where = "" if placement == "v" else f" on {size} ranks"
        raise ValueError(f"boundary_group: forward_codec={fwd.name!r} and backward_codec={bwd.name!r} differ, but with "
                         f"placement={placement!r}{where} both directions go to the same peer and the group "
                         f"cannot tell an activation from a gradient (torch tags every message 0); pass one codec= "
                         f"for both")
    _agree(inner, fwd, bwd, placement, float(timeout))
    _register_backend()
    options = _Options(inner, fwd, bwd, placement, float(timeout))
    try:
        # Among the group's ranks only (a hashed name): each pipeline of a 2x2 job makes its own.
        pg = dist.new_group(ranks, backend=BACKEND_NAME, pg_options=options, use_local_synchronization=True,
                            group_desc="commopt_pp")
    except ValueError as exc:
        if "already been created" not in str(exc):
            raise
        raise ValueError(f"boundary_group: a group over ranks {ranks} made with use_local_synchronization (another "
                         f"boundary_group, say) still exists in this process; destroy it first "
                         f"(dist.destroy_process_group(pg)) or reuse it") from exc
    return pg
