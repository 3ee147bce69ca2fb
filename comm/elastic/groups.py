"""Per-generation process groups across replicas, built from the coordinator's store.

A replica (a node: one DiLoCo worker, or one data-parallel replica) is its own ``torch.distributed``
world, with its own rendezvous, as with torchft: a WORLD spanning replicas would die with any of them,
and ``dist.new_group`` needs all of WORLD. What crosses replicas goes through the groups of the current
generation only (docs/architecture.md, "elastic"):

(1) every member of generation g announces itself under the store prefix ``<job>/g<g>/<name>`` and
    waits, polling, for the others, so that a member that learns of a newer generation meanwhile
    (a straddle: it saw g + 1 before the others) gives up at once instead of waiting out a timeout;
(2) then builds a gloo group of the members in member order (rank = index in the sorted member
    list), bounded by ``timeout``; (3) the group is registered with the runtime context as *elastic*,
    so that commopt's algorithms derive the groups they need over it (a compressed reduction's round
    groups) from the same store under ``<prefix>/<role>`` instead of ``dist.new_group``.

A thread of an old generation still blocked on a stalled peer holds only that generation's group (and
its engine queue): the next generation's groups are new objects with new connections, so it never
waits behind it. :meth:`Generation.release` forgets the groups; their stuck work is abandoned, as the
engine's shutdown abandons it (docs/faults.md row 42).

NCCL could shrink a communicator instead (``ncclCommShrink``); gloo has no such thing, so this module
rebuilds. An adapter for a backend that can shrink would replace :func:`build_group` only.
"""

from __future__ import annotations

import datetime
import time
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

from ..errors import CommTimeoutError
from ..runtime import context

__all__ = ["Generation", "Superseded", "build_group", "connect_store"]


class Superseded(Exception):
    """The generation being joined was replaced by a newer one before every member arrived."""


def connect_store(host: str, port: int, timeout: float) -> dist.Store:
    """A client of the store the coordinator hosts (one per process is enough)."""
    if not port:
        raise CommTimeoutError(f"the coordinator at {host} hosts no store (started with --no-store?): elastic "
                               "training needs it; start `commopt-bench coordinator` without --no-store",
                               op="elastic/store")
    return dist.TCPStore(host, port, is_master=False, wait_for_workers=False,
                         timeout=datetime.timedelta(seconds=timeout))


def build_group(store: dist.Store, prefix: str, rank: int, size: int, timeout: float) -> ProcessGroup:
    """A gloo ``ProcessGroup`` of ``size`` members under ``prefix`` of ``store`` (every member calls it
    with its own ``rank``), registered so that ``dist.get_rank(group)`` works on it."""
    pstore = dist.PrefixStore(prefix, store)
    td = datetime.timedelta(seconds=timeout)
    try:
        backend = dist.ProcessGroupGloo(pstore, rank, size, td)
    except RuntimeError as exc:
        raise CommTimeoutError(f"building the cross-replica group {prefix!r} ({size} members) failed within "
                               f"{timeout:g} s: {exc}", op="elastic/group") from exc
    group = dist.ProcessGroup(pstore, rank, size)
    group._set_default_backend(dist.ProcessGroup.BackendType.GLOO)
    group._register_backend(torch.device("cpu"), dist.ProcessGroup.BackendType.GLOO, backend)
    # torch answers dist.get_rank(group) and dist.get_backend(group) (its c10d logger asks on every
    # failure) from these tables, which new_group fills for its own groups.
    world = dist.distributed_c10d._world
    world.pg_group_ranks[group] = {dist.get_rank(): rank}
    world.pg_map[group] = (dist.Backend.GLOO, pstore)
    world.pg_names[group] = prefix
    world.pg_backend_config[group] = "cpu:gloo"
    return group


def _unregister(group: ProcessGroup) -> None:
    world = dist.distributed_c10d._world
    for table in (world.pg_group_ranks, world.pg_map, world.pg_names, world.pg_backend_config):
        table.pop(group, None)


class Generation:
    """This replica's cross-replica group of one generation.

    Args:
        store: the coordinator's store (:func:`connect_store`).
        job: the job's name (the store prefix's first part).
        generation: the generation.
        members: its member replica ids, sorted.
        replica: this replica's id (one of ``members``).
        name: which group of the generation (e.g. ``"rail0"``: one per local index).
        timeout: seconds each of the group's operations may wait (gloo's own timeout).
        wait: seconds to wait for the other members to arrive (None: ``timeout``).
        superseded: called while waiting for the other members: True when a newer generation makes
            this one moot (then :class:`Superseded` is raised).

    Attributes:
        group: the process group (rank = index of this replica in ``members``).
        index: this replica's rank in it.
    """

    def __init__(self, store: dist.Store, job: str, generation: int, members: tuple[int, ...], replica: int,
                 name: str, timeout: float, superseded: Callable[[], bool], wait: float | None = None):
        self.generation, self.members, self.replica = generation, tuple(members), replica
        self.index = self.members.index(replica)
        self.prefix = f"{job}/g{generation}/{name}"
        self.timeout = timeout
        self._store = store
        self._derived: list[ProcessGroup] = []
        store.set(f"{self.prefix}/arrived/{replica}", "1")
        keys = [f"{self.prefix}/arrived/{m}" for m in self.members]
        wait = timeout if wait is None else wait
        deadline = time.monotonic() + wait
        while not store.check(keys):
            if superseded():
                raise Superseded(self.prefix)
            if time.monotonic() > deadline:
                missing = [m for m, k in zip(self.members, keys) if not store.check([k])]
                raise CommTimeoutError(f"generation {generation}: replicas {missing} did not arrive at group "
                                       f"{self.prefix!r} within {wait:g} s", op="elastic/group")
            time.sleep(0.01)
        self.group = build_group(store, self.prefix, self.index, len(self.members), timeout)
        context().register_elastic(self.group, self._derive)

    @property
    def size(self) -> int:
        return len(self.members)

    def _derive(self, role: str) -> ProcessGroup:
        """The group of the same members for ``role`` (the runtime context asks, collectively)."""
        group = build_group(self._store, f"{self.prefix}/{role}", self.index, self.size, self.timeout)
        self._derived.append(group)
        return group

    def release(self) -> None:
        """Forget this generation's groups (their work, if stuck on a dead peer, is abandoned)."""
        context().forget_group(self.group)  # and the groups derived over it; kept alive, never destroyed
        for group in [self.group, *self._derived]:
            _unregister(group)
        self._derived.clear()
