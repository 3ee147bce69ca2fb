"""``rail``: one level, over this rank's rail only. Needs nodes of equal size.

A rail is the ranks of one local index, one per node (``Topology.rails``); every rail reduces at
once, side by side, each over its own ranks. This is not an all-reduce over the group: it is the
inter-node level of a reduction whose intra-node level already ran (HSDP, whose shards are already
reduced inside each node, ``fsdp.AllReduceHook``), so its :attr:`~Algorithm.scope` is
:data:`~.base.RAIL_SCOPE` and the public collectives and the DDP hook never run it. It carries a
compressor on all of its bytes (``compression.reduce_tensors(..., algorithm="rail")``); exact, it is
one all-reduce per rail, the group's own, on the rail group of its role. On a topology of one node
every rail has one rank: nothing moves.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ..engine import Phase, wait_work
from ..links import ALGORITHM_FACTORS, CostModel
from ..topology import Topology
from ._transport import deadline_of, remaining, then_finish
from .base import ALL_PHASES, RAIL_SCOPE, Algorithm, Call, Encoded, Traffic
from .roles import RAIL_ALL_REDUCE

__all__ = ["Rail", "RAIL"]


class Rail(Algorithm):
    name = "rail"
    collectives = ("allreduce",)
    needs_uniform = True
    scope = RAIL_SCOPE
    codec_phase = ALL_PHASES

    def roles(self, topology: Topology) -> tuple[str, ...]:
        return (RAIL_ALL_REDUCE,)

    def traffic(self, collective: str, nbytes: float, topology: Topology, *, itemsize: int = 1) -> Traffic:
        """Every rail a ring at once, each member sending 2(n-1)/n of its buffer (n nodes)."""
        t = Traffic(topology)
        if topology.world_size == 1 or not nbytes or topology.num_nodes == 1:
            return t
        t.rail_rings(ALGORITHM_FACTORS["allreduce"](topology.num_nodes) * nbytes)
        return t

    def cost(self, model: CostModel, collective: str, nbytes: float, topology: Topology) -> float:
        n = topology.num_nodes
        if topology.world_size == 1 or not nbytes or n == 1:
            return 0.0
        return model.inter.time(self.link_bytes(collective, nbytes, topology), 2 * (n - 1))

    def compressed_traffic(self, codec: Encoded, topology: Topology) -> Traffic:
        """The codec on every byte: each rank sends its encoded payload around its rail."""
        t = Traffic(topology)
        n = topology.num_nodes
        if topology.world_size > 1 and n > 1:
            t.rail_rings(codec.sent(1, 0, n))
        return t

    def compressed_cost(self, model: CostModel, codec: Encoded, topology: Topology) -> float:
        n = topology.num_nodes
        if topology.world_size == 1 or n == 1:
            return 0.0
        return self.cost(model, "allreduce", codec.sent(1, 0, n) / ALGORITHM_FACTORS["allreduce"](n), topology)

    def all_reduce(self, call: Call) -> torch.futures.Future:
        """(1) all-reduce over this rank's rail group (no phase where the rail has one rank). AVG
        arrives as SUM and the scale ``call.prepared`` carries: a rail's AVG is the caller's to scale
        by the rail's size."""
        p, red = call.prepared, call.red
        g = call.groups(RAIL_ALL_REDUCE)
        deadline = deadline_of(call.timeout)  # one for the call: the timeout bounds the call
        phases = []
        if g.rail is not None:
            n = len(g.rail_ranks)

            def rail_all_reduce() -> int:
                wait_work(dist.all_reduce(p.flat, op=red, group=g.rail, async_op=True), remaining(deadline))
                return int(ALGORITHM_FACTORS["allreduce"](n) * p.flat.numel() * p.flat.element_size())

            phases.append(Phase("all_reduce", rail_all_reduce, g.rail))
        fut = call.engine.submit(phases, op="all_reduce/rail", device=p.flat.device, blocking=call.blocking)
        return then_finish(fut, p)


RAIL = Rail()
