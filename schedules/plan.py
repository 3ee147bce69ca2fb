"""Bucket plans and issue plans, shared by every rank (docs/architecture.md section 3 rule 2, section 5.8).

A *bucket plan* groups the gradients of a model into flat buffers: parameters are taken in the order
their gradients are expected to become ready (the reverse of registration order, as DDP does), a
bucket closes when adding the next parameter would exceed its cap (the first bucket has its own,
smaller cap so that communication starts early in backward), and every parameter starts at a
multiple of ``align`` elements (aligned kernel access; chunk boundaries fall between aligned slots).
A bucket holds one dtype only.

An *issue plan* is the order in which the chunks of those buckets are handed to the network: large
buckets are partitioned into chunks of at most ``partition`` bytes, and at most ``credit`` bytes may
be in flight at once. Which chunk goes next is never decided from local readiness (bucket readiness
differs between ranks, and a reorder by local readiness reorders differently on each rank): the
order is computed once from shapes and profiled timings, on one rank, and broadcast
(:func:`broadcast_plan`), so every rank issues exactly the same sequence of collectives.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

__all__ = ["Bucket", "BucketPlan", "Chunk", "IssuePlan", "build_buckets", "partition", "broadcast_plan"]

_MB = 1024 * 1024


def _round_up(value: int, unit: int) -> int:
    return -(-value // unit) * unit


@dataclass(frozen=True)
class Bucket:
    """One flat gradient buffer.

    Attributes:
        index: position in the bucket plan (bucket 0 is expected ready first).
        params: indices (into the plan's parameter list) of the parameters it holds, in layout order.
        offsets: element offset of each parameter in the buffer (multiples of the plan's alignment).
        numels: element count of each parameter.
        numel: padded buffer length in elements (a multiple of the alignment).
        dtype: the gradients' dtype.
    """

    index: int
    params: tuple[int, ...]
    offsets: tuple[int, ...]
    numels: tuple[int, ...]
    numel: int
    dtype: torch.dtype

    @property
    def element_size(self) -> int:
        return torch.empty((), dtype=self.dtype).element_size()

    @property
    def nbytes(self) -> int:
        return self.numel * self.element_size


@dataclass(frozen=True)
class BucketPlan:
    """The buckets of a model, and the alignment they were built with."""

    buckets: tuple[Bucket, ...]
    align: int = 16

    def bucket_of(self) -> dict[int, int]:
        """Parameter index -> bucket index."""
        return {p: b.index for b in self.buckets for p in b.params}

    @property
    def nbytes(self) -> int:
        return sum(b.nbytes for b in self.buckets)


def build_buckets(shapes: Sequence[tuple[int, torch.dtype]], order: Sequence[int] | None = None, *,
                  cap_bytes: float = 25 * _MB, first_cap_bytes: float = 1 * _MB, align: int = 16) -> BucketPlan:
    """Group parameters into buckets (DDP's rule: caps in bytes, expected-ready order, one dtype each).

    Args:
        shapes: ``(numel, dtype)`` of every parameter, indexed as the caller's parameter list.
        order: the order gradients are expected to become ready (default: reverse of ``shapes``,
            as backward visits layers last to first).
        cap_bytes: a bucket closes when the next parameter would take it past this size (a
            parameter larger than the cap gets a bucket of its own).
        first_cap_bytes: the cap of the first bucket: small, so the first reduction starts early.
        align: every parameter starts at a multiple of ``align`` elements.

    Returns:
        A :class:`BucketPlan`; identical on every rank for identical shapes.
    """
    if align < 1:
        raise ValueError(f"align must be >= 1, got {align}")
    if cap_bytes <= 0 or first_cap_bytes <= 0:
        raise ValueError(f"bucket caps must be positive, got cap_bytes={cap_bytes}, "
                         f"first_cap_bytes={first_cap_bytes}")
    order = list(range(len(shapes) - 1, -1, -1)) if order is None else list(order)
    if sorted(order) != list(range(len(shapes))):
        raise ValueError(f"order must be a permutation of range({len(shapes)}), got {order}")
    buckets: list[Bucket] = []
    # One open bucket per dtype (DDP does the same): parameters of other dtypes do not close it.
    open_: dict[torch.dtype, list[int]] = {}
    used: dict[torch.dtype, int] = {}

    def close(dtype: torch.dtype) -> None:
        members = open_.pop(dtype, [])
        used.pop(dtype, None)
        if not members:
            return
        offsets, pos = [], 0
        for i in members:
            offsets.append(pos)
            pos = _round_up(pos + shapes[i][0], align)
        buckets.append(Bucket(len(buckets), tuple(members), tuple(offsets),
                              tuple(shapes[i][0] for i in members), max(pos, align), dtype))

    for i in order:
        numel, dtype = shapes[i]
        esize = torch.empty((), dtype=dtype).element_size()
        size = _round_up(max(numel, 1), align) * esize
        cap = first_cap_bytes if not buckets else cap_bytes
        if open_.get(dtype) and used[dtype] + size > cap:
            close(dtype)
        open_.setdefault(dtype, []).append(i)
        used[dtype] = used.get(dtype, 0) + size
    for dtype in list(open_):
        close(dtype)
    return BucketPlan(tuple(buckets), align)


@dataclass(frozen=True)
class Chunk:
    """A contiguous piece ``[start, stop)`` (elements) of one bucket: the unit of issue."""

    bucket: int
    start: int
    stop: int
    nbytes: int


def partition(plan: BucketPlan, partition_bytes: int | None) -> list[list[Chunk]]:
    """The chunks of every bucket (outer list: bucket index; inner: chunk order).

    ``None`` or ``0`` keeps each bucket whole. Chunk boundaries are multiples of the plan's
    alignment, so a chunk is never narrower than one aligned slot.
    """
    out: list[list[Chunk]] = []
    for b in plan.buckets:
        esize = b.element_size
        if not partition_bytes or b.nbytes <= partition_bytes:
            out.append([Chunk(b.index, 0, b.numel, b.nbytes)])
            continue
        step = max(plan.align, (int(partition_bytes) // esize) // plan.align * plan.align)
        out.append([Chunk(b.index, s, min(b.numel, s + step), (min(b.numel, s + step) - s) * esize)
                    for s in range(0, b.numel, step)])
    return out


@dataclass(frozen=True)
class IssuePlan:
    """The order every rank issues chunks in, and the in-flight bound.

    Attributes:
        chunks: every chunk of every bucket exactly once, in issue order.
        partition: the chunk size in bytes it was cut with (0: whole buckets).
        credit: at most this many bytes in flight (0: unbounded). A chunk larger than the credit is
            issued alone.
        priority: per bucket, its rank in the next forward's order of need (0: needed first).
    """

    chunks: tuple[Chunk, ...]
    partition: int = 0
    credit: int = 0
    priority: tuple[int, ...] = ()

    def check(self, plan: BucketPlan) -> None:
        """Raise ``ValueError`` unless every element of every bucket is covered exactly once."""
        per: dict[int, list[tuple[int, int]]] = {}
        for c in self.chunks:
            per.setdefault(c.bucket, []).append((c.start, c.stop))
        for b in plan.buckets:
            spans = sorted(per.pop(b.index, []))
            pos = 0
            for s, e in spans:
                if s != pos or e <= s:
                    raise ValueError(f"issue plan: bucket {b.index} chunks {spans} do not tile [0, {b.numel})")
                pos = e
            if pos != b.numel:
                raise ValueError(f"issue plan: bucket {b.index} chunks {spans} do not tile [0, {b.numel})")
        if per:
            raise ValueError(f"issue plan names buckets {sorted(per)} that the bucket plan lacks")

    def encode(self) -> torch.Tensor:
        """The plan as one int64 tensor: [n, partition, credit, nb, priority..., (b, start, stop)...]."""
        head = [len(self.chunks), self.partition, self.credit, len(self.priority), *self.priority]
        body = [v for c in self.chunks for v in (c.bucket, c.start, c.stop)]
        return torch.tensor(head + body, dtype=torch.int64)

    @classmethod
    def decode(cls, t: torch.Tensor, plan: BucketPlan) -> IssuePlan:
        v = t.tolist()
        n, part, credit, nb = v[:4]
        prio = tuple(v[4: 4 + nb])
        body = v[4 + nb: 4 + nb + 3 * n]
        chunks = []
        for i in range(n):
            b, s, e = body[3 * i: 3 * i + 3]
            chunks.append(Chunk(b, s, e, (e - s) * plan.buckets[b].element_size))
        out = cls(tuple(chunks), part, credit, prio)
        out.check(plan)
        return out


def broadcast_plan(issue: IssuePlan | None, plan: BucketPlan, *, src: int = 0, group=None) -> IssuePlan:
    """Rank ``src``'s issue plan on every rank of ``group`` (two small broadcasts: length, body).

    Args:
        issue: the plan on ``src`` (ignored elsewhere; may be None there).
        plan: the bucket plan, identical on every rank (built from shapes).
        src: the global rank that computed the plan.
        group: the process group (None: WORLD).
    """
    if not dist.is_initialized() or dist.get_world_size(group) == 1:
        if issue is None:
            raise ValueError("broadcast_plan: no plan on the only rank")
        return issue
    mine = issue.encode() if dist.get_rank() == src else None
    size = torch.tensor([mine.numel() if mine is not None else 0], dtype=torch.int64)
    dist.broadcast(size, src=src, group=group)
    body = mine if mine is not None else torch.zeros(int(size.item()), dtype=torch.int64)
    dist.broadcast(body, src=src, group=group)
    return IssuePlan.decode(body, plan)
