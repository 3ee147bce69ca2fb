"""The ring step the decomposed tensor-parallel matmuls and ring attention share (docs/architecture.md
sections 3 and 5.8): one point-to-point exchange with the ring's neighbours as one engine phase on
the group, submitted from the caller's thread in ring order, so that the transfer runs on the group's
engine worker while the caller computes; and the checks of the group and of a floating tensor both
modules make at the call."""

from __future__ import annotations

import hashlib
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from commopt.comm import checks
from commopt.comm.algorithms import pairwise, remaining
from commopt.comm.engine import Engine, Phase, wait

__all__ = ["step", "wait_step", "check_group", "group_size", "signature", "check_float_tensor", "FLOATS"]

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
