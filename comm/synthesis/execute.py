"""Run a schedule of one's own (written, loaded from JSON or imported from msccl-tools XML) on a process
group: :func:`execute` (the executor ``algorithm="synth"`` runs its synthesized ones with)."""

from __future__ import annotations

import time

import torch
import torch.distributed as dist
from torch.distributed import ReduceOp

from .check import check
from .ir import Schedule, ScheduleError
from .run import run_schedule

__all__ = ["execute"]


def execute(schedule: Schedule, buffer: torch.Tensor, *, group=None, op: ReduceOp.RedOpType = ReduceOp.SUM,
            timeout: float = 60.0) -> torch.Tensor:
    """Run ``schedule`` in place on ``buffer`` over ``group`` (schedule rank i = group rank i); every rank
    calls it with its own buffer of the same size.

    The buffer is the collective's whole buffer (``comm/synthesis/ir.py``): an all-reduce's tensor; a
    reduce-scatter's input, of which this rank's shard holds the result afterwards; an all-gather's
    output, this rank's shard filled before the call.

    Raises:
        ScheduleError: the schedule fails the checker (the message names the broken condition) or is
            for another number of ranks than the group has; before anything is sent.
        TypeError: ``buffer`` is not a contiguous 1-D tensor.
        CommTimeoutError: a peer failed or did not take part within ``timeout`` seconds.
    """
    if not isinstance(buffer, torch.Tensor) or buffer.dim() != 1 or not buffer.is_contiguous():
        raise TypeError(f"execute: buffer must be a contiguous 1-D tensor (the collective's whole buffer), got "
                        f"{type(buffer).__name__} {getattr(buffer, 'shape', '')}")
    check(schedule)
    size = dist.get_world_size(group)
    if schedule.nranks != size:
        raise ScheduleError(f"execute: the schedule is for {schedule.nranks} ranks, the group has {size}; synthesize "
                            f"or write one for this group")
    if op not in (ReduceOp.SUM, ReduceOp.MAX, ReduceOp.MIN):
        raise ValueError(f"execute: op must be SUM, MAX or MIN (average by dividing afterwards), got {op}")
    run_schedule(schedule, buffer, group, op, time.monotonic() + float(timeout), f"{schedule.collective}/execute")
    return buffer
