"""Transport pieces every algorithm shares, written once: the working view of a call, the pairwise
exchange, the block exchanges built on it, the row exchange of the all-to-alls, chunking with
padding, and the future of a work issued on the caller's thread.

Each exchange returns the bytes it sent (the sizes of the tensors it posted): phases return that
to the engine, whose counters are then what really went out.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Callable

import torch
import torch.distributed as dist
from torch.distributed import ReduceOp

from ... import kernels
from ..engine import Engine, Phase, all_of, chain, wait_work, wrap_error

__all__ = ["Prepared", "prepare", "finish", "then_finish", "done", "pairwise", "exchange_reduce_scatter",
           "exchange_all_gather", "exchange_rows", "chunk_bounds", "flat_future", "byte_rows", "row_bytes",
           "pipelined", "deadline_of", "remaining", "MIN_CHUNK_BYTES", "LOW_PRECISION", "all_gather_single",
           "reduce_scatter_single"]

LOW_PRECISION = (torch.float16, torch.bfloat16)

# torch 2.13 renamed the tensor variants of all-gather and reduce-scatter; older releases (>= 2.3)
# have only the old names. Every caller uses these two, never the torch names directly.
all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_torch_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor

# The smallest chunk a pipeline cuts (bytes): below it, per-message latency costs more than the
# overlap gains.
MIN_CHUNK_BYTES = 256 * 1024


# --------------------------------------------------------------------------------- working view
@dataclass
class Prepared:
    """A contiguous 1-D working view of the caller's tensor and how to finish the call."""

    tensor: torch.Tensor
    work: torch.Tensor  # contiguous, possibly a copy
    flat: torch.Tensor  # work viewed as 1-D (uint8 view for bool)
    scale_after: float | None
    copy_back: bool


def prepare(tensor: torch.Tensor, op: str, world: int) -> tuple[Prepared, ReduceOp]:
    """The working view of ``tensor`` for a reduction ``op`` ("sum", "avg", "max", "min") over
    ``world`` ranks, and the ReduceOp the phases apply (AVG becomes SUM and a scale)."""
    # The reduction writes the storage as torch's own collectives do, invisibly to autograd: through
    # a detached alias, so that AVG's division works on a leaf that requires grad like SUM does.
    result, tensor = tensor, tensor.detach()
    copy_back = not tensor.is_contiguous()
    # A strided tensor is reduced through one packed copy (kernels.flatten) and written back
    # through its strides by kernels.unflatten in finish().
    work = kernels.flatten([tensor], align=1)[0] if copy_back else tensor
    flat = work.view(-1)
    if flat.dtype == torch.bool:
        # Sum of booleans is logical OR (as in NCCL); reduce their bytes with MAX / MIN.
        flat = flat.view(torch.uint8)
        red = ReduceOp.MIN if op == "min" else ReduceOp.MAX
        return Prepared(result, work, flat, None, copy_back), red
    red = {"sum": ReduceOp.SUM, "avg": ReduceOp.SUM, "max": ReduceOp.MAX, "min": ReduceOp.MIN}[op]
    scale_after = None
    if op == "avg":
        if flat.dtype in LOW_PRECISION:
            flat.div_(world)  # before the reduction: fp16 sums of 4 x 40 000 would overflow
        else:
            scale_after = 1.0 / world
    return Prepared(result, work, flat, scale_after, copy_back), red


def finish(p: Prepared) -> torch.Tensor:
    if p.scale_after is not None:
        p.flat.mul_(p.scale_after)
    if p.copy_back:
        kernels.unflatten(p.work, [p.tensor.detach()], [0])
    return p.tensor


def then_finish(fut: torch.futures.Future, p: Prepared) -> torch.futures.Future:
    # f.value() re-raises a failed phase; a callback that ignored it would turn a failure into a
    # silently wrong result.
    return chain(fut, lambda _value: finish(p))


def done(value: object) -> torch.futures.Future:
    fut: torch.futures.Future = torch.futures.Future()
    fut.set_result(value)
    return fut


# --------------------------------------------------------------------------------- deadlines
def deadline_of(timeout: float | None) -> float | None:
    """The ``time.monotonic()`` deadline of a call that starts now and may take ``timeout`` seconds
    (None: no bound of commopt's own)."""
    return None if timeout is None else time.monotonic() + timeout


def remaining(deadline: float | None) -> float | None:
    """The seconds left until ``deadline`` (None: no bound), at least 1 ms: a phase that starts after
    its call's deadline fails at once instead of waiting a timeout of its own (every phase of a call
    shares the call's deadline)."""
    return None if deadline is None else max(1e-3, deadline - time.monotonic())


# --------------------------------------------------------------------------------- torch's own
class _ThenWork(dist.Work):
    """A backend ``Work`` followed by local work ``then()`` (run when it completes, before the future
    does): ``get_future()`` and ``wait(timeout)`` are the inner work's, so the wait stays bounded."""

    def __init__(self, work, then: Callable[[], object]):
        super().__init__()
        self._work = work
        self._future = chain(work.get_future(), lambda _value: then())

    def wait(self, timeout: timedelta | None = None) -> bool:
        self._work.wait() if timeout is None else self._work.wait(timeout)
        self._future.wait()  # the local copy, run by the inner future's callback
        return True

    def get_future(self) -> torch.futures.Future:
        return self._future

    def is_completed(self) -> bool:
        return self._future.done()


def reduce_scatter_single(output: torch.Tensor, input: torch.Tensor, op=ReduceOp.SUM, group=None,
                          async_op: bool = False):
    """torch's ``reduce_scatter_single`` (``reduce_scatter_tensor`` before 2.13), whose asynchronous
    ``Work`` on gloo has a future and a bounded ``wait(timeout)``.

    gloo's reduce-scatter is an all-reduce of a copy of ``input`` followed by a copy of this rank's
    chunk into ``output``, handed back as a ``Work`` without a future whose ``wait(timeout)`` ignores
    the timeout: a thread waiting for it after a peer stalled or died stayed blocked for the group's
    own timeout (30 minutes by default), and ``destroy()`` could not end it (docs/faults.md row 5).
    So an asynchronous call on a gloo CPU group issues that all-reduce itself -- the same collective
    with the same op, the same bits (tests/test_fsdp_recipe.py compares them with torch's) -- and
    returns a ``Work`` whose future completes after the copy and whose wait is the all-reduce's,
    bounded by its timeout. Every other call is torch's own.
    """
    gloo = (async_op and input.device.type == "cpu" and group is not dist.GroupMember.NON_GROUP_MEMBER
            and "gloo" in str(dist.get_backend(group)))
    if not gloo:
        return _torch_reduce_scatter(output, input, op=op, group=group, async_op=async_op)
    world, me = dist.get_world_size(group), dist.get_rank(group)
    if input.numel() != world * output.numel():
        raise ValueError(f"reduce_scatter_single: input has {input.numel()} elements, expected world_size "
                         f"({world}) x output ({output.numel()})")
    buffer = input.clone()
    work = dist.all_reduce(buffer, op=op, group=group, async_op=True)
    return _ThenWork(work, lambda: output.copy_(buffer.chunk(world)[me].view_as(output)))


# --------------------------------------------------------------------------------- exchanges
def pairwise(group, timeout: float | None, send: list, recv: list) -> int:
    """Post every send and receive of a pairwise exchange at once, then wait for all of them.

    ``send[j]`` goes to, and ``recv[j]`` comes from, the group's rank j (None: nothing). Direct
    point-to-point transfers measured faster on gloo than its collectives for the intra-node phases
    (2 ranks, 16 MiB: an exchange 12.8 ms, gloo's all-to-all 24 ms, its all-gather 36 ms, its
    reduce-scatter 60 ms, which is an all-reduce in disguise), and they send the optimal (L-1)/L.

    Every receive is posted before any send. gloo moves a payload only once its receiver has said
    it is ready, and that notice travels on the same TCP connection as the receiver's own payload
    to the sender: posted after a send, it waited behind that payload, and between ranks that arrive
    at different times the two directions of an exchange ran one after the other (a block's
    all-gather across the emulated 200 Mbit/s link took 95-120 ms one way, 51-64 ms the other; FSDP2's
    step with the hierarchical comms went from 1.30 s to 0.97 s: docs/results.md 24).

    Returns:
        The bytes sent.
    """
    # Peers by group rank (group_src / group_dst): no translation through global ranks, which a
    # cross-replica group of commopt.comm.elastic does not have (each replica is its own WORLD).
    works, sent = [], 0
    for j, buf in enumerate(recv):
        if buf is not None:
            works.append(dist.irecv(buf, group=group, group_src=j))
    for j, buf in enumerate(send):
        if buf is not None:
            works.append(dist.isend(buf, group=group, group_dst=j))
            sent += buf.numel() * buf.element_size()
    _wait_all(works, timeout)
    return sent


def _wait_all(works: list, timeout: float | None) -> None:
    """Wait for every posted transfer within one deadline (one phase: one timeout), all of them even
    after a failure, so that none is left in flight on buffers the caller may free; the first
    failure is raised."""
    deadline = None if timeout is None else time.monotonic() + timeout
    failure = None
    for w in works:
        try:
            wait_work(w, timeout, deadline=deadline)
        except RuntimeError as exc:
            failure = failure or exc
    if failure is not None:
        raise failure


def exchange_reduce_scatter(out: torch.Tensor, inp: torch.Tensor, red: ReduceOp, group, timeout) -> int:
    """Reduce-scatter over ``group``: ``out`` = the reduction of every rank's block ``me`` of ``inp``.

    ``out`` may be block ``me`` of ``inp`` itself (the hierarchical all-reduce reduces in place).
    Returns the bytes sent.
    """
    size, me = dist.get_world_size(group), dist.get_rank(group)
    blocks = inp.view(size, -1)
    others = [j for j in range(size) if j != me]
    parts = blocks.new_empty(len(others), blocks.shape[1])
    sent = pairwise(group, timeout, [None if j == me else blocks[j] for j in range(size)],
                    [None if j == me else parts[others.index(j)] for j in range(size)])
    combine = {ReduceOp.SUM: torch.add, ReduceOp.MAX: torch.maximum, ReduceOp.MIN: torch.minimum}[red]
    combine(blocks[me], parts[0], out=out)
    for k in range(1, len(others)):
        combine(out, parts[k], out=out)
    return sent


def exchange_all_gather(out: torch.Tensor, inp: torch.Tensor, group, timeout) -> int:
    """All-gather over ``group``: block j of ``out`` = rank j's ``inp`` (``inp`` may alias block me).
    Returns the bytes sent."""
    size, me = dist.get_world_size(group), dist.get_rank(group)
    blocks = out.view(size, -1)
    if blocks[me].data_ptr() != inp.data_ptr():
        blocks[me].copy_(inp)
    return pairwise(group, timeout, [None if j == me else inp for j in range(size)],
                    [None if j == me else blocks[j] for j in range(size)])


def exchange_rows(out_b: torch.Tensor, in_b: torch.Tensor, recv: list[int], send: list[int], group,
                  timeout) -> int:
    """``all_to_all_single(out_b, in_b, recv, send, group)``, blocking; on gloo as concurrent
    point-to-point transfers, every send and receive in flight at once. Returns the bytes sent.

    gloo's all-to-all serves its peers one at a time: on a 2-rank rail group it moved 8 MiB each
    way in 716 ms where isend/irecv took 347 ms (the emulated 200 Mbit/s link, both directions at
    full rate). The 2-D phases run on such small groups (the rail has one rank per node).
    """
    me = dist.get_rank(group)
    row = math.prod(in_b.shape[1:]) * in_b.element_size()
    sent = (sum(send) - send[me]) * row
    if dist.get_backend(group) != "gloo":
        wait_work(dist.all_to_all_single(out_b, in_b, recv, send, group=group, async_op=True), timeout)
        return sent
    ops = []
    i_off = o_off = 0
    for peer, (n_in, n_out) in enumerate(zip(send, recv)):
        if peer == me:
            out_b.narrow(0, o_off, n_out).copy_(in_b.narrow(0, i_off, n_in))
        else:
            if n_out:
                ops.append(dist.P2POp(dist.irecv, out_b.narrow(0, o_off, n_out), group=group, group_peer=peer))
            if n_in:
                ops.append(dist.P2POp(dist.isend, in_b.narrow(0, i_off, n_in), group=group, group_peer=peer))
        i_off += n_in
        o_off += n_out
    _wait_all(dist.batch_isend_irecv(ops) if ops else [], timeout)
    return sent


def row_bytes(t: torch.Tensor) -> int:
    return math.prod(t.shape[1:]) * t.element_size()


def byte_rows(t: torch.Tensor) -> torch.Tensor:
    """``t`` (contiguous) as a (rows, row_bytes) uint8 view: every dtype moves exactly as bytes."""
    return t.reshape(t.shape[0], math.prod(t.shape[1:])).view(torch.uint8)


# --------------------------------------------------------------------------------- chunks
def chunk_bounds(numel: int, elem: int, multiple: int, chunks: int) -> list[tuple[int, int]]:
    """Cut [0, numel) into at most ``chunks`` pieces, each a multiple of ``multiple`` elements
    except the last, none smaller than MIN_CHUNK_BYTES (except a lone short piece)."""
    min_elems = max(multiple, (MIN_CHUNK_BYTES // elem) // multiple * multiple)
    size = max(min_elems, math.ceil(numel / max(1, chunks) / multiple) * multiple)
    return [(s, min(numel, s + size)) for s in range(0, numel, size)]


# --------------------------------------------------------------------------------- caller's thread
def flat_future(engine: Engine, work, p: Prepared, op: str, timeout: float | None = None,
                group=None) -> torch.futures.Future:
    """The group's own async work as a Future of the caller's tensor; failures become CommErrors,
    and with ``timeout`` the future fails with ``CommTimeoutError`` when the work does not finish.

    The work is issued on the caller's thread, keeping the caller's order with its own
    ``torch.distributed`` calls on the same group; the engine's watchdog enforces the deadline.
    """
    rank = dist.get_rank()
    out: torch.futures.Future = torch.futures.Future()

    def complete(f: torch.futures.Future) -> None:
        try:
            f.value()
        except Exception as exc:  # noqa: BLE001 - delivered with op and rank
            out.set_exception(wrap_error(exc, op=op, seq=None, rank=rank))
            return
        try:
            out.set_result(finish(p))
        except Exception as exc:  # noqa: BLE001
            out.set_exception(exc)

    try:
        fut = work.get_future()
    except RuntimeError:
        # Some backends' works have no future (gloo's reduce-scatter gets one from
        # reduce_scatter_single above): the group's engine worker waits for it. Only the wait moves
        # to the worker; the work was issued here, in the caller's order. Such a wait(timeout) need
        # not be bounded: the deadline is the watchdog's, the worker is left to the group's own
        # timeout, and destroy() abandons it (Engine.shutdown).
        fut = engine.submit([Phase("wait", lambda: wait_work(work, timeout), group if group is not None
                                   else dist.group.WORLD)], op=op)
    if timeout is not None:
        fut = engine.watch(fut, timeout, op=op)
    fut.add_done_callback(complete)
    return out


def pipelined(call, multiple: int, make_phases, op_name: str) -> torch.futures.Future:
    """Submit one chain of phases per chunk (``call.chunks`` at most); chunks whose length is not a
    multiple of ``multiple`` run on a zero-padded copy (padding of SUM/MAX/MIN with 0 is harmless:
    padded slots are discarded). A single chunk of a blocking call may run on the caller's thread
    (``Engine.submit``)."""
    p = call.prepared
    flat = p.flat
    futures = []
    copies: list[tuple[torch.Tensor, torch.Tensor]] = []
    bounds = chunk_bounds(flat.numel(), flat.element_size(), multiple, call.chunks)
    for start, end in bounds:
        piece = flat[start:end]
        if piece.numel() % multiple:
            # kernels.flatten zero-fills the tail up to the alignment: the padding every rank adds.
            padded, _ = kernels.flatten([piece], align=multiple)
            copies.append((piece, padded))
            piece = padded
        futures.append(call.engine.submit(make_phases(piece), op=op_name, result=None, device=flat.device,
                                          blocking=call.blocking and len(bounds) == 1))

    def complete(_value):
        for dst, src in copies:
            kernels.unflatten(src, [dst], [0])
        return finish(p)

    return chain(all_of(futures, None), complete)
