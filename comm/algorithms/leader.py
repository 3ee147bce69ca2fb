"""``leader``: (1) reduce to each node's first rank, (2) all-reduce among those leaders,
(3) broadcast intra-node. Works on nodes of any size (where ``hierarchical`` cannot), at the cost
of the whole buffer on every intra-node hop; pipelined over chunks like ``hierarchical``.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from ..engine import Phase
from ..links import ALGORITHM_FACTORS, CostModel, pipeline_time
from ..topology import Topology
from ._transport import pipelined, wait_work
from .base import Algorithm, Call, Traffic
from .roles import LEADER_ALL_REDUCE, LEADER_BROADCAST, LEADER_REDUCE

__all__ = ["Leader", "LEADER"]

_CHUNK_OPTIONS = (1, 2, 4, 8, 16)


class Leader(Algorithm):
    name = "leader"
    collectives = ("allreduce",)
    automatic = True

    def roles(self, topology: Topology) -> tuple[str, ...]:
        return (LEADER_REDUCE, LEADER_ALL_REDUCE, LEADER_BROADCAST)

    def traffic(self, collective: str, nbytes: float, topology: Topology, *, itemsize: int = 1) -> Traffic:
        t = Traffic(topology)
        if topology.world_size == 1 or not nbytes:
            return t
        for node in topology.nodes:
            for r in node[1:]:
                t.add(r, node[0], nbytes)  # reduce
                t.add(node[0], r, nbytes)  # broadcast
        leaders = sorted(node[0] for node in topology.nodes)
        t.ring(leaders, ALGORITHM_FACTORS["allreduce"](len(leaders)) * nbytes)
        return t

    def _pipeline(self, model: CostModel, nbytes: float, topology: Topology, chunks: int) -> float:
        n = topology.num_nodes
        local = max(len(nd) for nd in topology.nodes)
        c = nbytes / chunks
        steps = math.ceil(math.log2(local)) if local > 1 else 0
        intra = model.intra.time(c * steps, steps)
        inter = model.inter.time(self.link_bytes("allreduce", c, topology), 2 * (n - 1)) if n > 1 else 0.0
        return pipeline_time(intra, inter, chunks)

    def cost(self, model: CostModel, collective: str, nbytes: float, topology: Topology) -> float:
        if topology.world_size == 1 or not nbytes:
            return 0.0
        return self._pipeline(model, nbytes, topology, self.chunks(model, collective, nbytes, topology))

    def chunks(self, model: CostModel, collective: str, nbytes: float, topology: Topology) -> int:
        options = [c for c in _CHUNK_OPTIONS if c <= max(1, model.chunks)]
        return min(options, key=lambda c: (self._pipeline(model, nbytes, topology, c), c))

    def all_reduce(self, call: Call) -> torch.futures.Future:
        topo, red, timeout = call.topology, call.red, call.timeout
        lr, la, lb = (call.groups(role) for role in (LEADER_REDUCE, LEADER_ALL_REDUCE, LEADER_BROADCAST))
        leader = topo.group_rank_to_global(topo.nodes[topo.node][0])
        is_leader = topo.local_rank == 0

        def phases(chunk: torch.Tensor) -> list[Phase]:
            nbytes = chunk.numel() * chunk.element_size()
            out = []
            if lr.intra is not None:
                def reduce() -> int:
                    wait_work(dist.reduce(chunk, dst=leader, op=red, group=lr.intra, async_op=True), timeout)
                    return 0 if is_leader else nbytes

                out.append(Phase("reduce", reduce, lr.intra))
            if is_leader and la.rail is not None:
                n = len(la.rail_ranks)

                def all_reduce() -> int:
                    wait_work(dist.all_reduce(chunk, op=red, group=la.rail, async_op=True), timeout)
                    return int(ALGORITHM_FACTORS["allreduce"](n) * nbytes)

                out.append(Phase("all_reduce", all_reduce, la.rail))
            if lb.intra is not None:
                def broadcast() -> int:
                    wait_work(dist.broadcast(chunk, src=leader, group=lb.intra, async_op=True), timeout)
                    return (len(lb.intra_ranks) - 1) * nbytes if is_leader else 0

                out.append(Phase("broadcast", broadcast, lb.intra))
            return out

        return pipelined(call, 1, phases, "leader")


LEADER = Leader()
