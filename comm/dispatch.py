"""How an exact collective runs once its arguments are checked: the algorithm it takes
(:func:`select_algorithm`: the one named, or ``auto``'s choice), its :class:`~commopt.comm.algorithms.Call`
started on the engine (:func:`start`), and the whole exact all-reduce (:func:`exact_all_reduce`).

The public collectives (``commopt.comm.collectives``) and the compressed all-reduce's pass-through of
integer tensors (``commopt.comm.compression``) both run their exact calls here, below both, so that
neither imports the other.
"""

from __future__ import annotations

from typing import Union

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup, ReduceOp

from . import algorithms, cost
from .algorithms._transport import Prepared, prepare
from .checks import agree, agreed
from .engine import wait
from .errors import TopologyError
from .runtime import context
from .topology import Topology

__all__ = ["Result", "select_algorithm", "start", "exact_all_reduce"]

Result = Union[torch.Tensor, torch.futures.Future]


def _deliver(fut: torch.futures.Future, async_op: bool, timeout: float | None, op: str) -> Result:
    if async_op:
        return fut
    return wait(fut, timeout, op=op)


def _require(algo: algorithms.Algorithm, topo: Topology, kind: str) -> None:
    reason = algo.supports(topo, kind)
    if reason is not None:
        others = [n for n in algorithms.names(kind) if algorithms.get(n).supports(topo, kind) is None]
        hint = f"use algorithm='auto' (falls back) or one of {others}"
        raise TopologyError(f"{kind}: {reason}; {hint}", op=algo.name)


def select_algorithm(kind: str, algorithm: str, nbytes: int, topo: Topology, timeout: float | None = None) -> str:
    """The algorithm a call would run: ``algorithm`` itself (checked; ``flat`` where it degenerates
    to it on one level), or what ``auto`` picks among the registry's candidates.

    Args:
        kind: "allreduce", "reduce_scatter" or "all_gather".
        algorithm: ``"auto"`` or the name of a registered algorithm that implements ``kind`` over
            the whole group (``algorithms.names(kind)``).
        nbytes: the per-rank buffer (all-reduce) or the whole world-sized buffer (the others).
    """
    known = algorithms.names(kind)
    if algorithm != algorithms.AUTO:
        if algorithm not in known:
            raise ValueError(f"{kind}: unknown algorithm {algorithm!r}; choose one of {known + [algorithms.AUTO]}")
        impl = algorithms.get(algorithm)
        _require(impl, topo, kind)
        return impl.runs(topo, kind)
    uneven = topo.links is not None and not topo.links.uniform
    if topo.num_nodes == 1 or (topo.num_nodes == topo.world_size and not uneven):
        return "flat"  # one level of equal links: the hierarchy adds phases and saves nothing
    options = [c for c in algorithms.candidates(kind)
               if algorithms.get(c).supports(topo, kind) is None and algorithms.get(c).considered(topo)]
    # The lines calibration measured for this layout, when it ran, decide; else the level model.
    return cost.choose(options, nbytes, topo, cost.model_for(topo, timeout=timeout), op=kind,
                       measured=cost.measured_lines(kind, topo))


def start(kind: str, algo: str, p: Prepared, red: ReduceOp | None, group, topo: Topology | None,
           timeout: float | None, blocking: bool, nbytes: int, src: torch.Tensor | None = None,
           args=None) -> torch.futures.Future:
    """Build the call for ``algo`` and start it; its groups are created first (collectively, in
    the same order on every rank: the call's own order), never inside a phase."""
    ctx = context()
    impl = algorithms.get(algo)
    chunks = 1
    if topo is not None and algo != "flat":
        ctx.prepare(topo, (algo,), timeout)
        chunks = impl.chunks(cost.model_for(topo, timeout=timeout), kind, nbytes, topo)
    return impl.start(ctx.call(impl, kind, p, red, group, topo, timeout, blocking, chunks, src, args))


def exact_all_reduce(tensor: torch.Tensor, op_name: str, *, group: ProcessGroup | None, topology: Topology | None,
                     algorithm: str, async_op: bool, timeout: float | None, agreement: bool) -> Result:
    """All-reduce ``tensor`` in place, exactly, its arguments already checked (``checks``) and its
    group of more than one rank: the algorithm (:func:`select_algorithm`), the agreement check
    (:func:`~commopt.comm.checks.agree`, when ``agreement``), then the payload through the engine.
    ``op_name`` is one of "sum", "avg", "max", "min"."""
    world = dist.get_world_size(group)
    topo = None if algorithm == "flat" else context().topology(topology, group, timeout)
    nbytes = tensor.numel() * tensor.element_size()
    algo = "flat" if topo is None else select_algorithm("allreduce", algorithm, nbytes, topo, timeout)
    if agreement:
        failed = agreed(async_op, lambda: agree("all_reduce", numel=tensor.numel(), dtype=tensor.dtype, op=op_name,
                                                algorithm=algo, group=group, device=tensor.device, timeout=timeout))
        if failed is not None:
            return failed
    p, red = prepare(tensor, op_name, world)
    fut = start("allreduce", algo, p, red, group, topo, timeout, not async_op, nbytes)
    return _deliver(fut, async_op, timeout, f"all_reduce/{algo}")
