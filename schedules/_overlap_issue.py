"""The issue side of :class:`~commopt.schedules.overlap.OverlapDataParallel` (docs/architecture.md
section 5.8): a step's state, and how its chunks reach the comm engine -- the re-plan queued at the
step's first gradient (rank 0's plan, broadcast), ready chunks submitted in plan order (never in
readiness order: docs/architecture.md section 3, rule 2), each started once the credit allows it and
reduced, and the completions counted for the training thread (rule 1: no collective from a callback).
The training side (hooks, waits, optimizer steps) is ``overlap.py``'s; this mixin reads the state that
class sets up.
"""

from __future__ import annotations

import functools
import logging
import time

import torch
from torch.distributed import ReduceOp

from commopt.comm import context
from commopt.comm.collectives import all_reduce
from commopt.comm.compression import reduce_tensors
from commopt.comm.engine import Phase

from .plan import BucketPlan, Chunk, IssuePlan, broadcast_plan
from .priority import fifo_plan, priority_plan, shape_priority
from .profile import StepProfile

__all__ = ["Issuer", "Step", "left"]

_log = logging.getLogger("commopt.schedules.overlap")  # the wrapper's logger: one name for its messages


class Step:
    """The state of one synchronised step, shared by the training thread and the engine's phases."""

    def __init__(self, index: int, plan: BucketPlan):
        nb = len(plan.buckets)
        self.index = index
        self.remaining = [len(b.params) for b in plan.buckets]
        self.ready = [False] * nb  # the training thread's only
        self.got_grad: set[int] = set()
        self.chunks_left = [0] * nb
        self.issue: IssuePlan | None = None  # None while the re-plan queued for the step is on its way
        self.replan: tuple[torch.futures.Future, list[IssuePlan]] | None = None  # its op and result box
        self.submitted = 0  # chunks of the plan handed to the engine (the training thread's only)
        self.applied = [False] * nb  # the training thread's only
        self.error: BaseException | None = None
        self.profile = StepProfile()
        self.counted = False  # chunks_left holds the plan's chunk counts


class Issuer:
    """The issuing methods of ``OverlapDataParallel`` (a mixin: the wrapper holds the state)."""

    def _submit(self, phase: Phase, step: Step | None = None) -> torch.futures.Future:
        """Queue ``phase`` as one engine op on the private group's queue (inline without one); its
        failure, such as an engine shut down by ``commopt.comm.destroy()``, fails ``step``."""
        try:
            fut = context().engine().submit([phase], op="overlap", device=self._device)
        except Exception as exc:  # noqa: BLE001 - delivered like the op's own failure
            fut = torch.futures.Future()
            fut.set_exception(exc)
        self._tail = fut
        if step is not None:
            fut.add_done_callback(functools.partial(self._op_done, step))
        return fut

    def _op_done(self, step: Step, fut: torch.futures.Future) -> None:
        try:
            fut.value()
        except Exception as exc:  # noqa: BLE001 - handed to the training thread
            self._fail(step, exc)

    def _start_step(self, step: Step, prev: Step | None) -> None:
        """Training thread, first gradient of ``step``: queue its re-plan when one is due (the old
        issuer's point: behind the previous step's chunks, once this rank has begun the step), else
        take the plan in use."""
        index = step.index
        if prev is not None and self.replan_every and (index == 1 or index % self.replan_every == 0):
            box: list[IssuePlan] = []
            fut = self._submit(Phase("plan", functools.partial(self._plan, prev, list(self._first_use), box),
                                     self._group))
            fut.add_done_callback(lambda _f: self._wake())
            step.replan = (fut, box)
        else:
            self._take(step)

    def _take(self, step: Step) -> None:
        """Adopt the step's plan (its re-plan's result, or the plan in use) and count its chunks."""
        try:
            if step.replan is not None:
                fut, box = step.replan
                fut.value()  # a failed broadcast fails the step
                self._adopt(step.index, box[0])
        except Exception as exc:  # noqa: BLE001 - delivered to the training thread at its next wait
            self._fail(step, exc)
        finally:
            step.issue = self.issue_plan
            with self._cv:
                for c in step.issue.chunks:
                    step.chunks_left[c.bucket] += 1
                step.counted = True
                self._cv.notify_all()
            self.plans.append((step.index, step.issue))
            self.profiles.append((step.index, step.profile))

    def _catch_up(self, step: Step, deadline: float | None) -> bool:
        """Wait until the step's re-plan arrived, then submit its ready chunks (False: not by ``deadline``).
        The re-plan stays queued after a timeout: a later wait picks it up once the late rank caught up."""
        fut = step.replan[0]
        with self._cv:
            self._cv.wait_for(lambda: fut.done() or self._closed, left(deadline))
        if not fut.done():
            return self._closed
        self._submit_ready(step)
        return True

    def _adopt(self, index: int, new: IssuePlan) -> None:
        self.issue_plan = new
        if self.plan_kind == "priority" and (new.partition, new.credit) != (self._partition, self._credit):
            _log.info("commopt overlap: step %d: partition %d B, credit %d B (was %d B, %d B), from rank 0's "
                      "profile", index, new.partition, new.credit, self._partition, self._credit)
        # The broadcast values, so that every rank holds the same ones (rank 0 plans with them next).
        self._partition, self._credit = new.partition, new.credit
        _log.debug("commopt overlap: step %d re-planned: %d chunks, partition %d B, credit %d B", index,
                   len(new.chunks), new.partition, new.credit)

    def _submit_ready(self, step: Step) -> None:
        """Training thread: hand the engine, in plan order, every chunk not yet submitted whose bucket
        is ready, up to the first whose bucket is not (docs/architecture.md section 3, rule 2: never in readiness
        order). Chunks that become issuable together go as one op (one queue hand-off, not one per chunk:
        each costs ~30 us of the training thread inside backward on a loaded 2-core host). A step
        whose re-plan has not arrived yet submits nothing (it is checked again at each ready bucket,
        and waited for at the next wait)."""
        if step.issue is None:
            if not step.replan[0].done():
                return
            self._take(step)
        if step.error is not None:
            return
        chunks, first = step.issue.chunks, step.submitted
        while step.submitted < len(chunks) and step.ready[chunks[step.submitted].bucket]:
            step.submitted += 1
        if step.submitted > first:
            batch = chunks[first: step.submitted]
            self._submit(Phase("issue", functools.partial(self._issue, step, batch), self._group), step)

    def _plan(self, prev: Step, first_use: list[int], box: list[IssuePlan]) -> None:
        """Engine phase, at the first gradient of a re-planning step: rank 0's plan, on every rank.
        Rank 0 plans from its own profile of the previous step."""
        mine = None
        if self._rank == 0:
            with self._cv:
                self._cv.wait_for(lambda: prev.error is not None or all(
                    n == 0 for n in prev.chunks_left) or self._closed)
            mine = self._plan_from(prev, first_use)
        box.append(broadcast_plan(mine, self.buckets, src=self._src, group=self._group) if self._distributed
                   else mine)

    def _wake(self) -> None:
        with self._cv:
            self._cv.notify_all()

    def _plan_from(self, prev: Step, first_use: list[int]) -> IssuePlan:
        prof = prev.profile
        t0 = prof.forward_end or min(prof.ready.values(), default=0.0)
        ready = [prof.ready.get(b, t0) - t0 for b in range(len(self.buckets.buckets))]
        if self.plan_kind == "fifo":
            return fifo_plan(self.buckets, ready_times=ready, partition_bytes=self._partition, credit=self._credit)
        link = prof.service_fit()
        if link is None:
            return self.issue_plan
        part, credit = self._partition, self._credit
        if (self._user_partition is None or self._user_credit is None) and prof.measured(link):
            part, credit = self._sizes(link)
            _log.debug("commopt overlap: profiled link alpha %.3g s, beta %.3g s/B -> partition %d B, credit %d B",
                       link.alpha, link.beta, part, credit)
        prio = shape_priority(self.buckets, first_use or None)
        return priority_plan(self.buckets, ready_times=ready, service=lambda n: link.time(n),
                             partition_bytes=part, credit=credit, priority=prio)

    def _issue(self, step: Step, batch: tuple[Chunk, ...]) -> None:
        """Engine phase, in plan order: start each chunk of ``batch`` once the credit allows it."""
        for c in batch:
            if not self._issue_one(step, c):
                return

    def _issue_one(self, step: Step, c: Chunk) -> bool:
        credit = step.issue.credit
        with self._cv:
            self._cv.wait_for(lambda: self._closed or step.error is not None or (
                not credit or self._in_flight == 0 or self._in_flight + c.nbytes <= credit))
            if self._closed or step.error is not None:
                return False
            self._in_flight += c.nbytes
            self.max_in_flight = max(self.max_in_flight, self._in_flight)
            self.issue_log.append((step.index, c.bucket, c.start, c.stop))
            step.profile.issued.append(time.perf_counter())
            step.profile.nbytes.append(c.nbytes)
            step.profile.done.append(0.0)
            k = len(step.profile.issued) - 1
        try:
            fut = self._reduce(step, c, k)
        except Exception as exc:  # noqa: BLE001 - counted as the chunk's completion, handed on
            fut = torch.futures.Future()
            fut.set_exception(exc)
        fut.add_done_callback(functools.partial(self._chunk_done, step, c, k))
        return True

    def _reduce(self, step: Step, c: Chunk, k: int) -> torch.futures.Future:
        """Reduce chunk ``c``, the ``k``-th of the step's plan (which picks its stream)."""
        buf = self._flat[c.bucket]
        if not self._distributed:  # one rank in the group: its gradient is the average
            fut: torch.futures.Future = torch.futures.Future()
            fut.set_result(None)
            return fut
        if self.compressor is not None:
            bucket = self.buckets.buckets[c.bucket]
            views = [self._views[i] for i in bucket.params]
            keys = [self._keys[i] for i in bucket.params]
            # The user's group, not the private one: the compressed exchange runs on groups derived
            # per role from it, and the engine requires one feeder per queue, which one derived check
            # group per process (not one per wrapper) keeps true.
            return reduce_tensors(self.compressor, views, keys, group=self._process_group, topology=self._topology,
                                  algorithm=self.algorithm, average=True, step=step.index, seed=self.seed,
                                  feedback=self._feedback, state=self._compressor_state, timeout=self.timeout)
        # Chunks come from the plan every rank shares: no agreement check per chunk. Flat ones are
        # issued right here, so both streams see them in this queue's order.
        return all_reduce(buf[c.start: c.stop], ReduceOp.AVG, group=self._streams[k % 2], topology=self._topology,
                          algorithm=self.algorithm, async_op=True, timeout=self.timeout, agreement=False)

    def _chunk_done(self, step: Step, c: Chunk, k: int, fut: torch.futures.Future) -> None:
        # Bookkeeping only (docs/architecture.md section 3, rule 1): the training thread steps the optimizer.
        try:
            fut.value()
            err = None
        except Exception as exc:  # noqa: BLE001 - handed to the training thread
            err = exc
        with self._cv:
            self._in_flight -= c.nbytes
            step.profile.done[k] = time.perf_counter()
            step.chunks_left[c.bucket] -= 1
            if err is not None and step.error is None:
                step.error = err
            self._cv.notify_all()

    def _fail(self, step: Step, exc: BaseException) -> None:
        with self._cv:
            if step.error is None:
                step.error = exc
            self._cv.notify_all()


def left(deadline: float | None) -> float | None:
    """Seconds until ``deadline`` (None: no bound)."""
    return None if deadline is None else max(0.0, deadline - time.monotonic())
