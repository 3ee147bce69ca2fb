"""ByteScheduler-style issue plans: partition, priority of the next forward, credit (docs/architecture.md section 5.8).

Backward produces gradients last layer first, but the next forward needs them first layer first.
Issued in ready order (DDP), the first layer's gradients wait behind everything else and the next
forward waits for the whole reduction. ByteScheduler's policy fixes that: (1) partition large
buckets into chunks, so a late, urgent bucket never waits behind a whole large one; (2) among the
chunks that are ready, issue the one the next forward needs first; (3) keep at most ``credit`` bytes
in flight, so that chunks not yet issued can still be overtaken by more urgent ones.

Applied to *local* readiness, step (2) would issue in a different order on every rank (docs/architecture.md section 3,
rule 2). Here the policy runs once, as a small discrete-event simulation over shapes and timings
(profiled on one rank), and its output is an :class:`~commopt.schedules.plan.IssuePlan`: a fixed
order that every rank then follows, waiting for a chunk's bucket when it is not yet ready locally.
Misestimated timings cost idle time, never a mismatch.

The partition and the credit themselves come from the link's alpha-beta model when the user does
not fix them (:func:`partition_for`, :func:`credit_for`): the smallest chunk whose per-message
latency is at most a tenth of its transfer time, and enough bytes in flight to keep about two chunks
on the wire or fill the link's bandwidth-delay product. Both are pure functions of the model, so
ranks that share the model (``comm.cost.model_for`` broadcasts it) or the plan (a re-plan from rank
0's profile is broadcast with its partition and credit) get the same numbers.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Callable

from commopt.comm.cost import LinkModel

from .plan import BucketPlan, Chunk, IssuePlan, partition

__all__ = ["fifo_plan", "priority_plan", "simulate_issue", "shape_priority", "IssueTimeline", "partition_for",
           "credit_for", "MIN_PARTITION", "MAX_PARTITION"]

# Below this, per-chunk costs the fitted alpha misses dominate (ranks issuing a chunk at slightly
# different times, thread and GIL hand-offs, a CPU-driven transport's work per collective): in
# OverlapDataParallel on a 500 Mbit/s link, 256 KiB chunks kept the link at 65 % of its rate while
# busy, 1.8 MiB chunks at 95 %; at 800 Mbit/s, where compute and gloo share each rank's core, 1 MiB
# chunks (25 per step) took 381-387 ms per step and whole 1.8 MB buckets (13) 360-370 ms.
MIN_PARTITION = 2 * 1024 * 1024
MAX_PARTITION = 16 * 1024 * 1024  # above this, an urgent chunk waits too long behind a large one


def partition_for(link: LinkModel, *, largest_bucket: int | None = None, latency_share: float = 0.1,
                  bounds: tuple[int, int] = (MIN_PARTITION, MAX_PARTITION)) -> int:
    """The chunk size for ``link``: the smallest whose latency is at most ``latency_share`` of its time.

    A chunk of ``P`` bytes costs ``alpha + P * beta``; its latency is at most the share ``f`` of that
    when ``P >= (1 - f) / f * alpha / beta`` (``9 alpha / beta`` for 10 %). Smaller chunks give the
    priority order finer control but pay more latency; larger ones make urgent chunks wait. The
    bound is rounded up to a power of two, clamped to ``bounds``, then to the largest bucket (a
    partition at least as large as every bucket keeps buckets whole).

    Args:
        link: the alpha-beta model of the link the chunks cross (``comm.cost``, or a fit of
            profiled chunk times).
        largest_bucket: bytes of the largest bucket (None: no such clamp).
        latency_share: the largest share of a chunk's time its latency may take, in (0, 1).
        bounds: the smallest and largest partition in bytes.

    Returns:
        The partition in bytes; a pure function of its arguments (identical on ranks that agree on
        the model).
    """
    if not 0.0 < latency_share < 1.0:
        raise ValueError(f"latency_share must be in (0, 1), got {latency_share}")
    lo, hi = (int(b) for b in bounds)
    if not 0 < lo <= hi:
        raise ValueError(f"bounds must satisfy 0 < low <= high, got {bounds}")
    if link.alpha <= 0.0:
        need = 0.0
    elif link.beta <= 0.0:
        need = math.inf  # latency only: no chunk is large enough, take the largest allowed
    else:
        need = (1.0 - latency_share) / latency_share * link.alpha / link.beta
    size = hi if need > hi else min(hi, max(lo, 1 << max(0, _ceil(need) - 1).bit_length()))
    if largest_bucket is not None and largest_bucket > 0:
        size = min(size, int(largest_bucket))
    return int(size)


def credit_for(link: LinkModel, chunk_bytes: int, *, chunks: int = 2) -> int:
    """The most bytes in flight: ``chunks`` chunks or the link's bandwidth-delay product, the larger.

    Two chunks keep the link busy while the next one is issued (the second one hides the per-chunk
    latency of the first); on a long, fast link the bandwidth-delay product ``alpha / beta`` is
    what it takes to fill the pipe. A smaller credit lets urgent chunks overtake sooner; a larger
    one would only queue chunks at the network, where they can no longer be reordered.

    Args:
        link: the alpha-beta model of the link.
        chunk_bytes: the largest chunk the plan issues (the partition, or the largest bucket when
            buckets stay whole).
        chunks: how many chunks may be in flight at least.
    """
    if chunk_bytes < 0 or chunks < 1:
        raise ValueError(f"chunk_bytes must be >= 0 and chunks >= 1, got {chunk_bytes}, {chunks}")
    bdp = link.alpha / link.beta if link.beta > 0.0 else 0.0
    return int(max(chunks * int(chunk_bytes), _ceil(bdp)))


def _ceil(x: float) -> int:
    """``ceil`` that ignores the last bits of float noise (9 * alpha / beta of 2**18 stays 2**18)."""
    return math.ceil(x - 1e-13 * abs(x))


def shape_priority(plan: BucketPlan, first_use: Sequence[int] | None = None) -> tuple[int, ...]:
    """Each bucket's rank in the next forward's order of need (0: needed first).

    Args:
        plan: the bucket plan.
        first_use: parameter indices in the order the forward first uses them (profiled); default
            registration order, which is the forward order of a sequential model.
    """
    n = sum(len(b.params) for b in plan.buckets)
    position = {p: i for i, p in enumerate(first_use)} if first_use is not None else {p: p for p in range(n)}
    need = [min(position.get(p, n + p) for p in b.params) for b in plan.buckets]
    ranked = sorted(range(len(need)), key=lambda b: (need[b], b))
    out = [0] * len(need)
    for r, b in enumerate(ranked):
        out[b] = r
    return tuple(out)


def fifo_plan(plan: BucketPlan, *, ready_times: Sequence[float] | None = None, partition_bytes: int = 0,
              credit: int = 0) -> IssuePlan:
    """Chunks in ready order (DDP's order), each bucket's chunks in order."""
    pieces = partition(plan, partition_bytes)
    ready = list(ready_times) if ready_times is not None else [float(b.index) for b in plan.buckets]
    order = sorted(range(len(pieces)), key=lambda b: (ready[b], b))
    return IssuePlan(tuple(c for b in order for c in pieces[b]), int(partition_bytes or 0), int(credit),
                     shape_priority(plan))


class IssueTimeline:
    """What :func:`simulate_issue` computed: per chunk (in issue order) its issue, start, end time."""

    def __init__(self) -> None:
        self.chunks: list[Chunk] = []
        self.issued: list[float] = []
        self.started: list[float] = []
        self.finished: list[float] = []
        self.max_in_flight = 0

    def bucket_done(self) -> dict[int, float]:
        """Bucket index -> time its last chunk finished."""
        out: dict[int, float] = {}
        for c, t in zip(self.chunks, self.finished):
            out[c.bucket] = max(out.get(c.bucket, 0.0), t)
        return out


def simulate_issue(chunks_by_bucket: Sequence[Sequence[Chunk]], ready_times: Sequence[float],
                   service: Callable[[int], float], *, credit: int = 0,
                   priority: Sequence[int] | None = None, order: Sequence[Chunk] | None = None,
                   link_free: float = 0.0) -> IssueTimeline:
    """Simulate a link that serves issued chunks first come, first served.

    Either ``priority`` (choose among ready chunks by it: the policy) or ``order`` (follow a fixed
    issue order, waiting for each chunk's bucket: what a rank does with a plan) drives issue.

    Args:
        chunks_by_bucket: each bucket's chunks in order.
        ready_times: when each bucket's gradients are ready (seconds from any common origin).
        service: seconds the link needs for a chunk of so many bytes.
        credit: the most bytes in flight (issued, not finished); 0: unbounded.
        priority: per bucket, lower goes first among ready chunks (ties: bucket, then chunk order).
        order: a fixed issue order instead of the policy.
        link_free: when the link finishes earlier work (the previous iteration's tail).
    """
    if (priority is None) == (order is None):
        raise ValueError("simulate_issue needs exactly one of priority and order")
    tl = IssueTimeline()
    pending = [list(c) for c in chunks_by_bucket]
    fixed = list(order) if order is not None else None
    total = sum(len(c) for c in pending)
    in_flight: list[tuple[float, int]] = []  # (finish, bytes)
    issued = 0
    t = min(ready_times) if len(ready_times) else 0.0
    while issued < total:
        in_flight = [(f, n) for f, n in in_flight if f > t]
        busy = sum(n for _, n in in_flight)
        if fixed is not None:
            nxt = fixed[issued]
            candidate = nxt if ready_times[nxt.bucket] <= t else None
        else:
            ready = [b for b in range(len(pending)) if pending[b] and ready_times[b] <= t]
            candidate = pending[min(ready, key=lambda b: (priority[b], b))][0] if ready else None
        if candidate is not None and (not credit or not in_flight or busy + candidate.nbytes <= credit):
            if fixed is None:
                pending[candidate.bucket].pop(0)
            start = max(t, link_free)
            link_free = start + service(candidate.nbytes)
            in_flight.append((link_free, candidate.nbytes))
            tl.max_in_flight = max(tl.max_in_flight, busy + candidate.nbytes)
            tl.chunks.append(candidate)
            tl.issued.append(t)
            tl.started.append(start)
            tl.finished.append(link_free)
            issued += 1
            continue
        # Nothing can go now: advance to the next event (a bucket turning ready, a chunk finishing).
        events = [f for f, _ in in_flight]
        if fixed is not None:
            events.append(ready_times[fixed[issued].bucket])
        else:
            events += [ready_times[b] for b in range(len(pending)) if pending[b]]
        t = min(e for e in events if e > t) if any(e > t for e in events) else t
    return tl


def priority_plan(plan: BucketPlan, *, ready_times: Sequence[float], service: Callable[[int], float],
                  partition_bytes: int = 0, credit: int = 0,
                  priority: Sequence[int] | None = None) -> IssuePlan:
    """The ByteScheduler policy, simulated once, as a fixed issue order.

    Args:
        plan: the bucket plan.
        ready_times: estimated (or rank 0's profiled) time each bucket becomes ready in backward.
        service: seconds the link needs per chunk of so many bytes (``comm.cost`` or a fit of
            profiled chunk times).
        partition_bytes: chunk size (0: whole buckets).
        credit: the most bytes in flight (0: unbounded, which reduces the policy to ready order
            except for chunks that become ready at the same instant).
        priority: per bucket, its rank in the next forward's need (default :func:`shape_priority`).

    Returns:
        An :class:`IssuePlan` to broadcast; computing it on one rank and sharing it is what makes the
        order identical everywhere.
    """
    prio = tuple(priority) if priority is not None else shape_priority(plan)
    pieces = partition(plan, partition_bytes)
    tl = simulate_issue(pieces, ready_times, service, credit=credit, priority=prio)
    out = IssuePlan(tuple(tl.chunks), int(partition_bytes or 0), int(credit), prio)
    out.check(plan)
    return out
