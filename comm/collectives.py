"""Topology-aware all-reduce, reduce-scatter and all-gather with torch's contract.

The contract (docs/architecture.md section 6.1): in place, ``group=None`` means WORLD, a group of size 1 returns at
once, ``async_op=True`` returns a ``torch.futures.Future`` completing with the result tensor; AVG is SUM
plus a division, done before the reduction for fp16/bf16 (so 4 ranks of 40 000 do not overflow)
and after it for wider types; AVG on integers raises ``TypeError``.

Algorithms are objects in ``commopt.comm.algorithms``'s registry (``flat``, ``hierarchical``,
``leader``, ``ina`` and any registered one), each with its phases, traffic and cost; ``auto`` is the
cheapest applicable candidate by the cost model (``commopt.comm.cost``). This module is the public
face: it checks and agrees (``commopt.comm.checks``), then hands the call to ``commopt.comm.dispatch``
(exact) or to the compressed all-reduce (``commopt.comm.compression``, with ``compressor=``);
nothing here is algorithm-specific. A blocking call lets a single-chunk multi-phase algorithm run
on the caller's thread when the engine is idle (``Engine.submit``).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup, ReduceOp

from .algorithms._transport import LOW_PRECISION, done, prepare
from .checks import (
    SUPPORTED_DTYPES,
    _check_op_dtype,
    _check_tensor,
    _op_name,
    agree,
    agreed,
    check_group,
    check_timeout,
    validate_same,
)
from .compression import Codec, Compressor, compressed_all_reduce
from .dispatch import Result, _deliver, exact_all_reduce, select_algorithm, start
from .runtime import context
from .topology import Topology

# The checks and the dispatch are re-exported: they were always importable from here.
__all__ = ["all_reduce", "reduce_scatter", "all_gather", "SUPPORTED_DTYPES", "select_algorithm",
           "validate_same", "agree", "agreed", "check_group", "check_timeout", "Result"]


# --------------------------------------------------------------------------------- helpers
def _source(input: torch.Tensor) -> torch.Tensor:
    """The input of a reduce-scatter or all-gather as a contiguous 1-D view (bool as its bytes)."""
    src = input.detach().contiguous().view(-1)
    return src.view(torch.uint8) if src.dtype == torch.bool else src


# --------------------------------------------------------------------------------- all-reduce
def all_reduce(tensor: torch.Tensor, op: ReduceOp.RedOpType = ReduceOp.SUM, *, group: ProcessGroup | None = None,
               topology: Topology | None = None, algorithm: str = "auto", compressor: Compressor | None = None,
               async_op: bool = False, validate: bool = False, timeout: float | None = None,
               agreement: bool = True) -> Result:
    """All-reduce ``tensor`` in place over ``group`` with a topology-aware algorithm.

    Args:
        tensor: any supported dtype (fp64/32, bf16, fp16, integers, bool), any shape and numel
            (0 included), contiguous or not (a non-contiguous tensor is reduced through a copy and
            written back).
        op: ``ReduceOp.SUM``, ``AVG``, ``MAX`` or ``MIN``.
        group: the process group (None: WORLD).
        topology: the layout of ``group``; None detects it (once per group).
        algorithm: ``"auto"``, or a registered all-reduce algorithm (``algorithms.names("allreduce")``:
            ``"flat"``, ``"hierarchical"``, ``"leader"``, ``"ina"``, and any registered one).
        compressor: a ``commopt.comm.compression`` compressor; float tensors are then reduced
            through the compressed all-reduce (``compression.compressed_all_reduce``, what
            ``compressor.all_reduce`` runs; error feedback is the caller's, see ``hooks``), integer
            and bool tensors exactly.
        async_op: return a Future completing with ``tensor`` instead of waiting.
        validate: exchange a fingerprint first; ranks that disagree raise
            ``CollectiveMismatchError`` on every rank before any payload moves, naming the ranks.
            Without it, a small agreement check before the payload (see :func:`agree`) still raises
            ``CollectiveMismatchError`` on every rank, before any payload byte moves, when the ranks'
            calls differ (count, dtype, reduce op, algorithm); calls of equal count but different
            shapes reduce alike and agree.
        timeout: seconds the call may take before ``CommTimeoutError`` (None: the group's own; a
            positive number, or ``inf`` for no bound of commopt's own). It bounds the agreement
            check, then the payload: every phase of a multi-phase algorithm waits for what is left
            of one deadline. Group creation on a first call is bounded by it too.
        agreement: run the agreement check (:func:`agree`) when not validating. ``False`` is for
            callers whose ranks hold the same buffers by construction (DDP's buckets, which DDP
            checks across ranks when it wraps the model; OverlapDataParallel's plan, shared by every
            rank): the check is an extra small collective per call (about one latency: on a
            CPU-bound loopback it doubled a 1 KiB flat all-reduce). Ranks that disagree on it
            disagree on the collectives they issue: pass the same value on every rank.

    Returns:
        ``tensor`` (reduced in place), or a ``Future`` of it when ``async_op``.

    Raises:
        CollectiveMismatchError: the ranks' calls differ, on every rank, before any payload moves
            (with ``validate``: naming the ranks).
        CommTimeoutError: a rank did not arrive within ``timeout``.
        CommError: a peer died before the ranks could agree (the tensor is unchanged).
        TypeError, ValueError: a bad argument (tensor, group, op, timeout, algorithm, compressor).
    """
    name = "all_reduce"
    _check_tensor(name, tensor)
    check_group(name, group)
    timeout = check_timeout(name, timeout)
    op_name = _op_name(op)
    if compressor is not None and not isinstance(compressor, Codec):
        raise TypeError(f"{name}: compressor must be a commopt.comm.compression compressor instance (e.g. "
                        f"FP16Compressor(), PowerSGDCompressor(rank=4)) or None, got {type(compressor).__name__} "
                        f"{compressor!r}")
    if validate and dist.is_initialized() and dist.get_world_size(group) > 1:
        validate_same(name, tensor, algorithm=algorithm, op=op_name, group=group, timeout=timeout)
    _check_op_dtype(name, op_name, tensor.dtype)
    if not dist.is_initialized() or dist.get_world_size(group) == 1 or tensor.numel() == 0:
        return done(tensor) if async_op else tensor
    if compressor is not None and tensor.is_floating_point():
        return compressed_all_reduce(compressor, tensor, op, group=group, topology=topology, algorithm=algorithm,
                                     async_op=async_op, timeout=timeout)
    return exact_all_reduce(tensor, op_name, group=group, topology=topology, algorithm=algorithm, async_op=async_op,
                            timeout=timeout, agreement=agreement and not validate)


# --------------------------------------------------------------------------------- reduce-scatter
def _check_rs_ag(name: str, big: torch.Tensor, small: torch.Tensor, world: int, big_name: str,
                 small_name: str) -> None:
    _check_tensor(name, big, big_name)
    _check_tensor(name, small, small_name)
    if big.dtype != small.dtype:
        raise TypeError(f"{name}: {big_name} dtype {big.dtype} differs from {small_name} dtype {small.dtype}")
    if big.device != small.device:
        raise ValueError(f"{name}: {big_name} is on {big.device} but {small_name} on {small.device}")
    if big.numel() != world * small.numel():
        raise ValueError(f"{name}: {big_name} has {big.numel()} elements but must have world_size "
                         f"({world}) x {small_name}.numel() ({small.numel()}) = {world * small.numel()}")


def reduce_scatter(output: torch.Tensor, input: torch.Tensor, op: ReduceOp.RedOpType = ReduceOp.SUM, *,
                   group: ProcessGroup | None = None, topology: Topology | None = None, algorithm: str = "auto",
                   async_op: bool = False, validate: bool = False, timeout: float | None = None) -> Result:
    """Reduce ``input`` (world_size blocks of ``output.numel()`` elements, in rank order) over the
    group and write this rank's reduced block into ``output``.

    ``hierarchical``: (1) permute the blocks so that each rail's blocks are contiguous,
    (2) reduce-scatter intra-node (local rank j keeps the node's sum of rail j's blocks),
    (3) reduce-scatter inter-node along the rail on 1/L of the data.

    Args are those of :func:`all_reduce` (``output`` and ``input`` on one device, of one dtype;
    ``input.numel() == world_size * output.numel()``): ``validate`` exchanges a fingerprint first,
    and without it the agreement check before the payload raises ``CollectiveMismatchError`` on every
    rank when the ranks' calls differ (before any payload byte moves); ``timeout`` bounds every wait
    (``CommTimeoutError``).

    Returns:
        ``output``, or a ``Future`` of it when ``async_op``.
    """
    name = "reduce_scatter"
    check_group(name, group)
    timeout = check_timeout(name, timeout)
    world = dist.get_world_size(group) if dist.is_initialized() else 1
    _check_rs_ag(name, input, output, world, "input", "output")
    op_name = _op_name(op)
    if validate and world > 1:
        validate_same(name, input, algorithm=algorithm, op=op_name, group=group, timeout=timeout)
    _check_op_dtype(name, op_name, input.dtype)
    if world == 1 or output.numel() == 0:
        if world == 1:
            output.detach().copy_(input.reshape(output.shape))
        return done(output) if async_op else output
    topo = None if algorithm == "flat" else context().topology(topology, group, timeout)
    algo = "flat" if topo is None else select_algorithm("reduce_scatter", algorithm,
                                                input.numel() * input.element_size(), topo, timeout)
    if not validate:
        failed = agreed(async_op, lambda: agree(name, numel=output.numel(), dtype=output.dtype, op=op_name,
                                                algorithm=algo, group=group, device=output.device, timeout=timeout))
        if failed is not None:
            return failed
    p, red = prepare(output, op_name, world)
    src = _source(input)
    if op_name == "avg" and src.dtype in LOW_PRECISION:
        src = src / world
        p.flat.mul_(world)  # prepare() pre-divided the output, which is overwritten anyway
    fut = start("reduce_scatter", algo, p, red, group, topo, timeout, not async_op,
                 input.numel() * input.element_size(), src)
    return _deliver(fut, async_op, timeout, f"reduce_scatter/{algo}")


# --------------------------------------------------------------------------------- all-gather
def all_gather(output: torch.Tensor, input: torch.Tensor, *, group: ProcessGroup | None = None,
               topology: Topology | None = None, algorithm: str = "auto",
               async_op: bool = False, validate: bool = False, timeout: float | None = None) -> Result:
    """Gather every rank's ``input`` into ``output`` (world_size blocks, in rank order).

    ``hierarchical``: (1) all-gather inter-node along the rail (1/L of the final data crosses the
    NIC per rank), (2) all-gather intra-node, (3) permute the blocks into rank order.

    Args are those of :func:`all_reduce` (``output`` and ``input`` on one device, of one dtype;
    ``output.numel() == world_size * input.numel()``): ``validate`` exchanges a fingerprint first,
    and without it the agreement check before the payload raises ``CollectiveMismatchError`` on every
    rank when the ranks' calls differ (before any payload byte moves); ``timeout`` bounds every wait
    (``CommTimeoutError``).

    Returns:
        ``output``, or a ``Future`` of it when ``async_op``.
    """
    name = "all_gather"
    check_group(name, group)
    timeout = check_timeout(name, timeout)
    world = dist.get_world_size(group) if dist.is_initialized() else 1
    _check_rs_ag(name, output, input, world, "output", "input")
    if validate and world > 1:
        validate_same(name, input, algorithm=algorithm, op="none", group=group, timeout=timeout)
    if world == 1 or input.numel() == 0:
        if world == 1:
            output.detach().copy_(input.reshape(output.shape))
        return done(output) if async_op else output
    topo = None if algorithm == "flat" else context().topology(topology, group, timeout)
    algo = "flat" if topo is None else select_algorithm("all_gather", algorithm,
                                                output.numel() * output.element_size(), topo, timeout)
    if not validate:
        failed = agreed(async_op, lambda: agree(name, numel=input.numel(), dtype=input.dtype, op="none",
                                                algorithm=algo, group=group, device=input.device, timeout=timeout))
        if failed is not None:
            return failed
    p, _ = prepare(output, "sum", world)
    src = _source(input)
    fut = start("all_gather", algo, p, None, group, topo, timeout, not async_op,
                 output.numel() * output.element_size(), src)
    return _deliver(fut, async_op, timeout, f"all_gather/{algo}")
