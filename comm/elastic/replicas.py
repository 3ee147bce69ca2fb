"""One replica's place in the current generation: its group, the hello, and state for joiners.

What elastic DiLoCo (``schedules/_diloco_elastic.py``) and elastic data-parallel replicas
(``schedules/elastic.py``) share (docs/architecture.md, "elastic"):

(1) :meth:`ReplicaSet.current`: the generation this replica is a member of (with ``fresh``, one round trip
    to the coordinator, so that every member that asks after the same decision sees the same one), and its
    group, built when the generation is new (``groups.Generation``);
(2) on a new group, the *hello*: every member says whether it holds the job's state, whether it
    contributes to the next reduction, and its progress (two counters, e.g. steps and reductions); the
    members without state or behind the furthest are sent the state by the lowest member at the furthest
    progress, as tensors (``transfer.broadcast_state``), and load it;
(3) :meth:`ReplicaSet.wait` for a reduction issued on the group, giving up as soon as the membership shows
    that it cannot complete (a member of its generation lost, or, with ``any_change``, any newer
    generation); :meth:`ReplicaSet.failed` then waits for the generation after it.
"""

from __future__ import annotations

import atexit
import os
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from ..algorithms._transport import all_gather_single
from ..compression import Codec, ErrorFeedback
from ..engine import wait_work
from ..errors import CommError, CommTimeoutError
from .client import ENV_REPLICA_ID, Membership, QuorumError
from .groups import Generation, Superseded, connect_store
from .transfer import broadcast_state

__all__ = ["ReplicaSet", "Lost", "check_replica_args", "attempt_copies", "node_member_id"]


def check_replica_args(name: str, what: str, minimum: object, membership: object) -> None:
    """The arguments every elastic consumer takes (local checks, before anything is sent): the fewest
    replicas (``what``: the argument's name), the membership, and this process's world: the node's ranks
    (a replica of L ranks, rank r's membership id ``node * L + r``)."""
    if isinstance(minimum, bool) or not isinstance(minimum, int) or minimum < 1:
        raise ValueError(f"{name}: {what} must be an int >= 1, got {minimum!r}")
    if membership is not None and not isinstance(membership, Membership):
        raise TypeError(f"{name}: membership must be a commopt.comm.elastic.Membership or None (from the "
                        f"environment), got {type(membership).__name__}")
    if not dist.is_initialized():
        raise ValueError(f"{name}: each replica is its own torch.distributed world (the node's ranks): call "
                         f"init_process_group in every rank first (one torchrun per node)")
    size, rank = dist.get_world_size(), dist.get_rank()
    if membership is not None and membership.replica_id % size != rank:
        raise ValueError(f"{name}: with {size} ranks per replica, rank {rank}'s membership id must be node * {size} "
                         f"+ {rank}, got {membership.replica_id}; or pass membership=None (COMMOPT_REPLICA_ID "
                         f"names the node)")


def node_member_id(size: int, rank: int) -> int:
    """Rank ``rank``'s membership id in a node of ``size`` ranks: ``node * size + rank``, the node from
    COMMOPT_REPLICA_ID (which ``commopt-bench cluster --elastic`` sets; the same on the node's ranks)."""
    text = os.environ.get(ENV_REPLICA_ID, "").strip()
    if not text.isdigit():
        raise ValueError(f"{ENV_REPLICA_ID} must name this node (an int, the same on all its ranks), got {text!r}; "
                         f"set it in every node's launch, or pass membership=")
    return int(text) * size + rank


def attempt_copies(feedback: ErrorFeedback, compressor: Codec | None, state: Any) -> tuple[ErrorFeedback, Any]:
    """Copies of the residuals and the compressor state for one attempt at a reduction: adopted if it
    commits, dropped if it is abandoned (an abandoned attempt's engine thread finishing late writes only
    into its own copies)."""
    fb = ErrorFeedback()
    fb.load_state_dict(feedback.state_dict())
    copy = None
    if state is not None and compressor is not None:
        copy = compressor.new_state()
        copy.load_state_dict(state.state_dict())
    return fb, copy


class Lost(CommError):
    """A reduction was abandoned: its generation lost a member (or was replaced)."""


class ReplicaSet:
    """This replica's membership, generation group and state exchange (see the module docstring).

    Args:
        membership: this replica's membership.
        name: who is asking (error messages).
        min_replicas: the fewest members a generation may have (``QuorumError`` below).
        timeout: seconds each wait may take.
        own: close ``membership`` in :meth:`close`.
        get_state: the state a joiner needs (a tree of tensors, numbers, strings, lists and dicts).
        load_state: loads what ``get_state`` returned on another replica.
        progress: this replica's two progress counters (members holding the state must agree on the
            furthest; those behind receive it).
        local, local_size: a replica of ``local_size`` ranks (a node), this process its rank ``local``:
            membership ids are ``node * local_size + local``, a node is in a generation when all its
            ranks are, and this set's group is the generation's rail ``local`` (the same rank of every
            node; ranks of one node take the same decisions, as they see the same nodes).

    Attributes:
        gen: the current generation's group (None before the first and after a failure).
        has_state: this replica holds the job's state.
        contributes: this replica trained since it got the state (a joiner contributes from the reduction
            after the one it joined at).
        redone: reductions abandoned or aborted and redone.
        recovery_bytes: bytes of state this replica sent or received.
        transfer_seconds: seconds this replica spent receiving the state (its last transfer), or None.
    """

    def __init__(self, membership: Membership, *, name: str, min_replicas: int, timeout: float, own: bool,
                 get_state: Callable[[], Any], load_state: Callable[[Any], None],
                 progress: Callable[[], tuple[int, int]], local: int = 0, local_size: int = 1):
        self.membership, self.name, self.min_replicas, self.timeout = membership, name, min_replicas, timeout
        self.local, self.local_size = local, local_size
        self.node = membership.replica_id // local_size
        self._own, self._get_state, self._load_state, self._progress = own, get_state, load_state, progress
        self.gen: Generation | None = None
        self.has_state = self.contributes = False
        self.redone = 0
        self.recovery_bytes = 0
        self.transfer_seconds: float | None = None
        self._store = None
        self.received = False  # the last current() loaded a state sent by a peer
        self._settle_until = 0.0  # when every collective left behind by a failure has ended
        self._at_exit = False

    def current(self, wait: float, fresh: bool = True) -> bool:
        """The current generation's group, this replica a member of it, holding the state (waiting up to
        ``wait`` seconds); returns whether it just received the state from a running job.

        A node of several ranks first agrees on the generation (each rank's view, one MAX inside the
        node, until all hold the same one) and after building its rails on whether every rail's group and
        hello succeeded, so that its ranks never act on different generations."""
        m = self.membership
        deadline = time.monotonic() + wait
        self.received = False
        while True:
            if fresh or self.gen is None:
                m.refresh(self.timeout)
            m.check()
            g, ids, member = m.view()
            if not member:
                m.wait_for_generation(after=0, timeout=max(0.1, deadline - time.monotonic()))
                g, ids, member = m.view()
            if self.local_size > 1:
                lo, hi = self._node_views(g if member else 0)
                if lo != hi:  # a rank of this node has not seen the newest generation yet
                    if g < hi:
                        m.wait_for_generation(after=hi - 1, timeout=max(0.1, deadline - time.monotonic()))
                    continue
            members = self.nodes(ids)
            if self.node not in members:  # another rank of this node is not in this generation yet
                m.wait_for_generation(after=g, timeout=max(0.1, deadline - time.monotonic()))
                continue
            if len(members) < self.min_replicas:
                raise QuorumError(f"{self.name}: generation {g} has {len(members)} replicas {list(members)}, fewer "
                                  f"than the minimum {self.min_replicas}; restart the lost replicas (or lower the "
                                  f"minimum)", op="elastic/quorum")
            if self.gen is not None and self.gen.generation == g:
                return False
            if self.gen is not None:
                self.gen.release()
                self.gen = None
            error: BaseException | None = None
            received, adopt = False, None
            try:
                self.gen = self._build(g, members, deadline)
                received, adopt = self._hello()
            except Superseded as exc:
                error = exc
            except QuorumError:
                raise
            except (CommError, RuntimeError) as exc:
                if self.gen is None and time.monotonic() > deadline and self.local_size == 1:
                    raise
                error = exc
            if self.local_size > 1 and not self.node_all(error is None):
                error = error or CommError(f"{self.name}: another rank of this node failed in generation {g}",
                                           op="elastic/round")
            if error is None:
                adopt()  # after the node agreed: loading may be collective inside it
                return received
            if isinstance(error, Superseded) and self.local_size == 1:
                continue  # no group was built: the newer generation is already in view
            self.failed(self.gen, error, after=g)

    def _node_views(self, g: int) -> tuple[int, int]:
        """(lowest, highest) generation the node's ranks hold (one all-reduce inside the node)."""
        t = torch.tensor([-g, g], dtype=torch.int64)
        wait_work(dist.all_reduce(t, dist.ReduceOp.MAX, async_op=True), self.timeout, f"{self.name}/node view")
        return -int(t[0]), int(t[1])

    def node_all(self, ok: bool) -> bool:
        """Whether every rank of the node succeeded (one MIN inside the node)."""
        t = torch.tensor([int(ok)], dtype=torch.int64)
        wait_work(dist.all_reduce(t, dist.ReduceOp.MIN, async_op=True), self.timeout, f"{self.name}/node agree")
        return bool(t.item())

    def nodes(self, members: tuple[int, ...]) -> tuple[int, ...]:
        """The replicas (nodes) of a generation's member ids: those all of whose ranks are members."""
        ids, size = set(members), self.local_size
        return tuple(sorted({i // size for i in ids if all((i // size) * size + j in ids for j in range(size))}))

    def _build(self, g: int, members: tuple[int, ...], deadline: float) -> Generation:
        m = self.membership
        if self._store is None:
            host, port = m.store_address
            self._store = connect_store(host, port, self.timeout)
        return Generation(self._store, f"{m.job:x}", g, members, self.node, f"rail{self.local}", self.timeout,
                          superseded=lambda: m.generation > g, wait=max(self.timeout, deadline - time.monotonic()))

    def failed(self, gen: Generation | None, why: object, after: int | None = None) -> None:
        """A reduction or exchange on ``gen`` failed: drop its group and wait for the generation after it
        (the failure was a member lost or admitted; otherwise it is a real timeout, which surfaces)."""
        self.redone += 1
        # gloo's work cannot be cancelled: what this failure left in flight ends at its own timeout.
        self._settle_until = time.monotonic() + self.timeout + 1.0
        if not self._at_exit:
            atexit.register(self._settle)
            self._at_exit = True
        if after is None:
            after = gen.generation if gen is not None else self.membership.generation
        if gen is not None:
            gen.release()
            if self.gen is gen:
                self.gen = None
        try:
            self.membership.wait_for_generation(after=after, timeout=self.timeout)
        except CommTimeoutError as exc:
            raise CommTimeoutError(f"{self.name}: a reduction in generation {after} failed ({why}) and no new "
                                   f"generation formed within {self.timeout:g} s (no replica was lost: a stall or a "
                                   f"network fault?)", op="elastic/round") from exc

    def _hello(self) -> tuple[bool, Callable[[], None]]:
        """The hello and the transfer; returns (whether this replica receives a running job's state, what
        to adopt once every rank of the node succeeded: the loaded state and the flags)."""
        gen = self.gen
        assert gen is not None
        p0, p1 = self._progress()
        mine = torch.tensor([int(self.has_state), int(self.contributes), p0, p1], dtype=torch.int64)
        rows = mine.new_empty(gen.size * 4)
        wait_work(all_gather_single(rows, mine, group=gen.group, async_op=True), self.timeout,
                  f"{self.name}/hello")
        rows = rows.view(gen.size, 4)
        holders = [i for i in range(gen.size) if rows[i, 0]]
        fresh = not holders
        if holders:
            furthest = max((int(rows[i, 2]), int(rows[i, 3])) for i in holders)
            src = next(i for i in holders if (int(rows[i, 2]), int(rows[i, 3])) == furthest)
            needs = [i for i in range(gen.size) if i != src and (int(rows[i, 0]) == 0 or
                                                                  (int(rows[i, 2]), int(rows[i, 3])) != furthest)]
        else:  # a job's start: the first member's state, as rank 0's weights at a DDP start
            src, needs = 0, list(range(1, gen.size))
        if not needs:
            def adopt_none() -> None:
                self.has_state = True
                self.contributes = self.contributes or fresh  # a joiner that got the state earlier has not trained
            return False, adopt_none
        state = self._get_state() if gen.index == src else None
        t0 = time.monotonic()
        received, nbytes = broadcast_state(state, gen.group, src, self.timeout, needs)
        if gen.index in needs:
            self.transfer_seconds = time.monotonic() - t0
        if gen.index == src or gen.index in needs:
            self.recovery_bytes += nbytes

        def adopt() -> None:
            if gen.index in needs:
                self.received = True
                self._load_state(received)
                self.has_state, self.contributes = True, fresh
            if gen.index == src:
                self.has_state = True
                self.contributes = self.contributes or fresh
        return gen.index in needs and not fresh, adopt

    def wait(self, fut, gen: Generation, any_change: bool = False) -> None:
        """Wait for ``fut`` (issued on ``gen``), giving up (:class:`Lost`) once the membership shows a member
        of ``gen`` lost, or with ``any_change`` any newer generation."""
        m = self.membership
        deadline = time.monotonic() + self.timeout
        while not fut.done():
            m.check()
            newer = m.generation > gen.generation
            if newer and (any_change or not set(gen.members) <= set(self.nodes(m.members))):
                raise Lost(f"{self.name}: generation {gen.generation} was replaced by {m.generation} "
                           f"(members {list(m.members)})", op="elastic/round")
            if time.monotonic() > deadline:
                raise CommTimeoutError(f"{self.name}: a reduction in generation {gen.generation} did not finish "
                                       f"within {self.timeout:g} s", op="elastic/round")
            time.sleep(0.002)
        fut.value()

    def _settle(self) -> None:
        """At interpreter exit (an ``atexit`` handler, registered at the first failure): wait until the
        collectives a failure left in flight have ended, at most ``timeout + 1`` s after it, so usually not
        at all. None may end during finalization, when gloo's thread would take the GIL to release its
        tensors or run its future's callbacks and abort the process; gloo's work cannot be cancelled
        (neither ``abort()`` nor ``shutdown()`` ends it)."""
        pause = self._settle_until - time.monotonic()
        if pause > 0:
            time.sleep(pause)

    def close(self) -> None:
        """Drop the generation's group; leave the membership if this set made it."""
        if self.gen is not None:
            self.gen.release()
            self.gen = None
        if self._own:
            self.membership.close()
