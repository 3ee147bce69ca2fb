"""The executor of a schedule on a process group: :func:`run_schedule` (what ``algorithm="synth"`` and
:func:`commopt.comm.synthesis.execute` run; docs/architecture.md, "synthesized collectives")."""

from __future__ import annotations

import heapq
import queue
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed import ReduceOp

from ..errors import CommTimeoutError

__all__ = ["run_schedule"]

_COMBINE = {ReduceOp.SUM: torch.add, ReduceOp.MAX: torch.maximum, ReduceOp.MIN: torch.minimum}


def run_schedule(sched, buf: torch.Tensor, group, red: ReduceOp | None, deadline: float | None, op: str) -> int:
    """Run this rank's steps of ``sched`` on the flat buffer ``buf`` (the collective's whole buffer, see
    the IR), in place, over ``group`` (schedule rank i = group rank i). Returns the bytes sent.

    gloo's point-to-point works have no future and report completion only to ``wait()``, so threads
    wait for them (bounded by the deadline) and wake this one, which starts every step whose
    dependencies are done, in list order. Every receive is posted at the start, but waited for only once
    its step's dependencies are done (then it is the next thing that step needs), so few threads wait
    at once; a peer's sends complete in the order they were issued (one connection per pair, every
    receive already posted), so one thread per peer waits for them in that order.

    Raises:
        CommTimeoutError: a transfer failed or the deadline passed (a peer dead or stalled).
    """
    me = dist.get_rank(group)
    steps = sched.steps[me]
    bounds = sched.bounds(buf.numel())
    combine = _COMBINE[red if red is not None else ReduceOp.SUM]
    tags, counts = [], {}
    for s in steps:  # the k-th message of a (sender, receiver) pair carries tag k, on both sides
        key = ("s" if s.op == "send" else "r", s.peer)
        counts[key] = counts.get(key, -1) + 1
        tags.append(counts[key])
    cond = threading.Condition()
    arrived: dict[int, BaseException | None] = {}
    arrivals: list[int] = []  # arrived, not yet handled (under cond)
    receivers = ThreadPoolExecutor(max_workers=max(1, len(steps)), thread_name_prefix="commopt-synth-recv")
    senders: dict[int, queue.SimpleQueue] = {}

    def watch(i: int, work) -> None:
        error = None
        try:
            work.wait() if deadline is None else work.wait(timedelta(seconds=max(1e-3, deadline - time.monotonic())))
        except RuntimeError as exc:
            error = exc
        with cond:
            arrived[i] = error
            arrivals.append(i)
            cond.notify()

    def sender(q: queue.SimpleQueue) -> None:
        while (item := q.get()) is not None:
            watch(*item)

    payloads: dict[int, torch.Tensor] = {}
    works: dict[int, object] = {}
    # Event-driven: a step starts once its last dependency is done (the ready ones in list order), and
    # each arrival is handled once; a scan of every step per arrival cost O(steps^2) Python, 47 ms for
    # a 192-step schedule of 1 KiB (docs/results.md 31).
    waiting_on = [len(set(s.deps)) for s in steps]
    dependents: list[list[int]] = [[] for _ in steps]
    for i, s in enumerate(steps):
        for d in set(s.deps):
            dependents[d].append(i)
    try:
        for i, s in enumerate(steps):  # every receive posted first
            if s.op != "send":
                payloads[i] = buf.new_empty(sum(bounds[c][1] - bounds[c][0] for c in s.chunks))
                works[i] = dist.irecv(payloads[i], group=group, group_src=s.peer, tag=tags[i])
        ready = [i for i in range(len(steps)) if not waiting_on[i]]
        heapq.heapify(ready)
        sent, left = 0, len(steps)
        while left:
            while ready:
                i = heapq.heappop(ready)
                s = steps[i]
                if s.op == "send":
                    parts = [buf[bounds[c][0]:bounds[c][1]] for c in s.chunks]
                    payloads[i] = parts[0] if len(parts) == 1 else torch.cat(parts)
                    work = dist.isend(payloads[i], group=group, group_dst=s.peer, tag=tags[i])
                    sent += payloads[i].numel() * payloads[i].element_size()
                    if s.peer not in senders:
                        senders[s.peer] = queue.SimpleQueue()
                        threading.Thread(target=sender, args=(senders[s.peer],), daemon=True,
                                         name=f"commopt-synth-send-{s.peer}").start()
                    senders[s.peer].put((i, work))
                else:
                    receivers.submit(watch, i, works[i])
            with cond:
                while not arrivals:
                    wait = None if deadline is None else deadline - time.monotonic()
                    if wait is not None and wait <= 0:
                        pending = [j for j in range(len(steps)) if j not in arrived]
                        raise CommTimeoutError(f"{op}: rank {me} waited past the deadline for steps {pending[:8]} "
                                               f"of its schedule (first: {steps[pending[0]]}); a peer is dead or "
                                               f"stalled", op=op, ranks=[me])
                    cond.wait(wait)
                batch, arrivals[:] = sorted(arrivals), []
                errors = {i: arrived[i] for i in batch}
            for i in batch:
                s = steps[i]
                if errors[i] is not None:
                    raise CommTimeoutError(f"{op}: rank {me}'s {s.op} with rank {s.peer} (step {i}) failed: "
                                           f"{errors[i]}", op=op, ranks=[me]) from errors[i]
                if s.op != "send":
                    pos = 0
                    for c in s.chunks:
                        a, b = bounds[c]
                        piece = payloads[i][pos:pos + b - a]
                        if s.op == "recv":
                            buf[a:b].copy_(piece)
                        else:
                            combine(buf[a:b], piece, out=buf[a:b])
                        pos += b - a
                left -= 1
                for j in dependents[i]:
                    waiting_on[j] -= 1
                    if not waiting_on[j]:
                        heapq.heappush(ready, j)
        return sent
    finally:
        receivers.shutdown(wait=False)  # a failed call's waiters end at the deadline
        for q in senders.values():
            q.put(None)
