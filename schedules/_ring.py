"""The rings the decomposed tensor-parallel matmuls and ring attention share (docs/architecture.md
sections 3 and 5.8): the ring step, one point-to-point exchange with the ring's neighbours as one
engine phase on the group, submitted from the caller's thread in ring order, so that the transfer runs
on the group's engine worker while the caller computes; the chunked all-gather ring (:func:`all_gather`,
the caller computing on each chunk as it lands) and reduce-scatter ring (:func:`reduce_scatter`, each
chunk's partial sum sent on as soon as it is computed) built of such steps; and the checks both
modules make at the call."""

from __future__ import annotations

import functools
import hashlib
from collections.abc import Callable, Iterator

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from commopt.comm import checks, cost
from commopt.comm.algorithms import pairwise, remaining
from commopt.comm.engine import Engine, Phase, wait
from commopt.comm.errors import CommError
from commopt.comm.runtime import context

__all__ = ["step", "wait_step", "all_gather", "reduce_scatter", "resolve_link", "check_group", "group_size",
           "signature", "check_float_tensor", "once_differentiable", "FLOATS"]

FLOATS = (torch.float32, torch.float64, torch.bfloat16, torch.float16)


def step(engine: Engine, op: str, group, send: torch.Tensor, recv: torch.Tensor,
          deadline: float | None, gate: Callable[[], None] | None = None) -> torch.futures.Future | None:
    """Submit one ring step as an engine phase on ``group``: ``send`` to the next rank, ``recv`` from
    the previous one (empty blocks are skipped on both sides: both know the sizes). None: nothing to
    move. ``gate``: the call's agreement check (``checks.agree(wait=False)``), which the phase waits
    for, and raises with, before it moves anything."""
    size, me = dist.get_world_size(group), dist.get_rank(group)
    nxt, prv = (me + 1) % size, (me - 1) % size
    sends: list = [None] * size
    recvs: list = [None] * size
    if send.numel():
        sends[nxt] = send
    if recv.numel():
        recvs[prv] = recv
    if sends[nxt] is None and recvs[prv] is None:
        return None
    pg = group if group is not None else dist.group.WORLD

    def run() -> int:
        if gate is not None:
            gate()
        sent = pairwise(pg, remaining(deadline), sends, recvs)
        if recv.is_cuda:
            # The caller's stream reads the block once the future completes: the transfer must be done.
            torch.cuda.current_stream(recv.device).synchronize()
        return sent

    return engine.submit([Phase("ring-step", run, pg)], op=op, result=None, device=send.device)


def wait_step(fut: torch.futures.Future, op: str, timeout: float | None, deadline: float | None) -> None:
    if deadline is None:
        fut.wait()
    else:
        wait(fut, timeout, op=op, deadline=deadline)


def all_gather(op: str, rowed: torch.Tensor, chunks: int, group, timeout: float | None, deadline: float | None,
               gate: Callable[[], None] | None = None) -> Iterator[tuple[int, int, int]]:
    """The all-gather ring of ``rowed``, ``[P, rows, ...]`` with this rank's block in slot ``me``, each
    block cut into ``chunks`` row ranges: yields ``(src, lo, hi)`` for every chunk of every block in
    ring order (this rank's own block first), each once it has arrived, so that the caller computes on
    it while the later chunks are on the wire. Every step of every chunk is submitted at once: the
    group's engine worker runs them in order, so a chunk is forwarded by the step after the one that
    received it. ``gate``: the call's agreement check, waited for by every step's phase before it moves
    anything and by this thread before it waits for the first step."""
    size, me = dist.get_world_size(group), dist.get_rank(group)
    engine = context().engine()
    rows = rowed.shape[1]
    cuts = [(rows * j // chunks, rows * (j + 1) // chunks) for j in range(chunks)]
    steps = {}
    for k in range(size - 1):  # step k forwards the block of rank me - k, chunk by chunk
        send, recv = rowed[(me - k) % size], rowed[(me - k - 1) % size]
        for c, (lo, hi) in enumerate(cuts):
            steps[k, c] = step(engine, op, group, send[lo:hi], recv[lo:hi], deadline, gate)
    for k in range(size):
        if k == 1 and gate is not None:
            gate()  # the agreement check, on this thread: its error rather than a phase's
        for c, (lo, hi) in enumerate(cuts):
            fut = steps.get((k - 1, c))
            if fut is not None:  # the chunk arrived (None: nothing to move, or this rank's own block)
                wait_step(fut, op, timeout, deadline)
            yield (me - k) % size, lo, hi


def reduce_scatter(op: str, partial: Callable[[int, int, int], torch.Tensor], shape_of: Callable[..., tuple],
                   group, timeout: float | None, deadline: float | None, like: torch.Tensor, *, dim: int,
                   extent: Callable[[int], int], chunks: int, gate: Callable[[], None] | None = None,
                   meanwhile: Callable[[], None] | None = None) -> torch.Tensor:
    """The reduce-scatter ring: returns the sum over the group of every rank's block ``me``.

    Block c is ``extent(c)`` long along ``dim`` and cut into ``chunks`` chunks (the same number on
    every rank); ``partial(c, lo, hi)`` returns a fresh contiguous tensor of ``shape_of(c, lo, hi)``
    (of ``like``'s dtype and device): this rank's contribution to positions ``lo:hi`` of block c (it is
    added to in place). At step k this rank computes block ``c = me - k - 1`` chunk by chunk; each
    chunk, once the partial sum of that chunk from the previous rank is in, gets it added and goes on
    to the next rank while the next chunk is computed. At the last step c is ``me`` and the chunks,
    joined along ``dim``, are the result. ``gate``: the call's agreement check, waited for by every
    step's phase before it moves anything and by this thread before it waits for the first step.
    ``meanwhile``: local work run once the last step begins, behind the transfers still in flight.
    """
    size, me = dist.get_world_size(group), dist.get_rank(group)
    engine = context().engine()

    def cuts(c: int) -> list[tuple[int, int]]:
        e = extent(c)
        return [(e * j // chunks, e * (j + 1) // chunks) for j in range(chunks)]

    futs: list = [None] * chunks
    incoming: list = [None] * chunks
    for k in range(size):
        c = (me - k - 1) % size
        last = k + 1 == size
        if last and meanwhile is not None:
            meanwhile()
        after = cuts((me - k - 2) % size)
        done = []
        for j, (lo, hi) in enumerate(cuts(c)):
            part = partial(c, lo, hi)
            if k == 1 and j == 0 and gate is not None:
                gate()  # the agreement check, on this thread: its error rather than a phase's
            if futs[j] is not None:
                wait_step(futs[j], op, timeout, deadline)
                futs[j] = None
            if incoming[j] is not None:
                part.add_(incoming[j])
            if last:
                done.append(part)
            else:
                incoming[j] = like.new_empty(shape_of((me - k - 2) % size, *after[j]))
                futs[j] = step(engine, op, group, part, incoming[j], deadline, gate)
        if last:
            return done[0] if chunks == 1 else torch.cat(done, dim)
    raise AssertionError("unreachable: the ring's last step returns")


def resolve_link(name: str, group, timeout: float | None) -> None:
    """The group's topology and cost model, which the rings' chunk count reads
    (``tensor_parallel.chunks_for``), resolved before the ring: the first call on a group detects them
    with collectives of their own, bounded by the call's ``timeout`` and named after the call (later
    calls find them cached)."""
    try:
        cost.model_for(context().topology(None, group, timeout), timeout=timeout)
    except CommError as exc:
        raise type(exc)(f"{name}: before the ring started, resolving the group's topology and link: {exc.message}",
                        op=name, seq=exc.seq, ranks=exc.ranks) from exc


def check_group(name: str, group) -> None:
    """``group`` is a ProcessGroup of which this rank is a member, or None (WORLD); else ``ValueError``
    for what ``dist.new_group`` hands a rank outside the group, ``TypeError`` for anything else (a
    DeviceMesh: its ``get_group()``)."""
    if group is dist.GroupMember.NON_GROUP_MEMBER:
        raise ValueError(f"{name}: this rank (global rank {dist.get_rank()}) is not a member of the group "
                         f"(dist.new_group returned GroupMember.NON_GROUP_MEMBER here); call it only on the "
                         f"group's ranks")
    if isinstance(group, DeviceMesh):
        raise TypeError(f"{name}: group must be a torch.distributed ProcessGroup or None (WORLD), got a DeviceMesh; "
                        f"pass its process group, mesh.get_group() (a 1-D mesh, or mesh['name'] first)")
    checks.check_group(name, group)


def group_size(name: str, group) -> int:
    if not dist.is_initialized():
        return 1
    if dist.get_rank(group if group is not None else dist.group.WORLD) < 0:
        raise ValueError(f"{name}: this rank (global rank {dist.get_rank()}) is not a member of the group; call it "
                         f"only on the group's ranks")
    return dist.get_world_size(group)


def signature(key: tuple) -> int:
    """A hash of ``key`` that is the same in every process (Python's own hash of strings is not), below 2**62."""
    digest = hashlib.blake2b(repr(key).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & ((1 << 62) - 1)


def check_float_tensor(name: str, what: str, t) -> None:
    """``t`` is a dense floating torch.Tensor, else ``TypeError`` naming ``name``'s argument ``what``."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name}: {what} must be a torch.Tensor, got {type(t).__name__}")
    if t.is_sparse:
        raise TypeError(f"{name}: {what} is sparse; pass a dense tensor (.to_dense())")
    if t.dtype not in FLOATS:
        raise TypeError(f"{name}: {what} has dtype {t.dtype}; pass float32, float64, bfloat16 or float16")


def once_differentiable(name: str) -> Callable[[Callable], Callable]:
    """torch's ``once_differentiable`` for the backward of a ring, with a double backward refused by name.

    A ring's backward is itself a ring of point-to-point steps that no autograd graph records, so its
    gradients cannot be differentiated again. Under ``create_graph=True`` (grad mode on inside the
    backward) it raises ``NotImplementedError`` naming ``name`` on every rank (each runs the same
    backward), before anything moves, instead of torch's later "appears to not have been used in the
    graph"."""
    def wrap(backward: Callable) -> Callable:
        inner = torch.autograd.function.once_differentiable(backward)

        @functools.wraps(backward)
        def call(ctx, *grads):
            if torch.is_grad_enabled():
                raise NotImplementedError(
                    f"{name}: a double backward is not supported: this backward ran with create_graph=True (grad "
                    f"mode on), but its gradient is a ring of point-to-point steps that autograd cannot "
                    f"differentiate again. Compute higher-order gradients without {name} (torch's own collectives "
                    f"or styles), or call backward without create_graph")
            return inner(ctx, *grads)

        return call

    return wrap
