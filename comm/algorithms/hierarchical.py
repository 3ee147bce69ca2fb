"""``hierarchical``: two levels, the slow one carrying 1/L of the data. Needs nodes of equal size.

- all-reduce: (1) reduce-scatter intra-node, (2) all-reduce inter-node on 1/L of the data, one
  rail per local index, (3) all-gather intra-node; pipelined over chunks through the engine, so
  chunk 2's intra-node phase overlaps chunk 1's inter-node phase;
- reduce-scatter: (1) permute the blocks so that each rail's blocks are contiguous, (2) reduce-
  scatter intra-node (local rank j keeps the node's sum of rail j's blocks), (3) reduce-scatter
  inter-node along the rail on 1/L of the data;
- all-gather: (1) all-gather inter-node along the rail (1/L of the final data crosses the NIC per
  rank), (2) all-gather intra-node, (3) permute the blocks into rank order.

On gloo the intra-node phases are concurrent point-to-point exchanges (``_transport.pairwise``);
the rail all-reduce is the group's own. The compressed hierarchical reduction
(``compression.exchange``) runs the same intra-node phases.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist

from ..engine import Phase
from ..links import ALGORITHM_FACTORS, CostModel, pad_to, pipeline_time
from ..topology import Topology
from ._transport import (
    deadline_of,
    exchange_all_gather,
    exchange_reduce_scatter,
    pipelined,
    remaining,
    then_finish,
    wait_work,
)
from .base import INTER_PHASE, Algorithm, Call, Encoded, Traffic
from .roles import (
    HIER_AG_INTRA,
    HIER_AG_RAIL,
    HIER_ALL_GATHER,
    HIER_ALL_REDUCE,
    HIER_REDUCE_SCATTER,
    HIER_RS_RAIL,
)

__all__ = ["Hierarchical", "HIERARCHICAL", "rail_order"]

_CHUNK_OPTIONS = (1, 2, 4, 8, 16)


def rail_order(topo: Topology) -> list[int]:
    """Group ranks in the order the hierarchical phases lay their blocks out: local index j major,
    rail position (sorted group rank) minor. The rail groups order members by group rank."""
    return [r for j in range(topo.local_size) for r in sorted(node[j] for node in topo.nodes)]


class Hierarchical(Algorithm):
    name = "hierarchical"
    collectives = ("allreduce", "reduce_scatter", "all_gather")
    needs_uniform = True
    automatic = True
    codec_phase = INTER_PHASE  # with a compressor, only the rail phase is encoded
    flat_on_one_level = ("reduce_scatter", "all_gather")
    all_reduce_op = "hierarchical"  # the engine's label of the all-reduce (its byte counter's key)

    def roles(self, topology: Topology) -> tuple[str, ...]:
        return (HIER_REDUCE_SCATTER, HIER_ALL_REDUCE, HIER_ALL_GATHER, HIER_RS_RAIL, HIER_AG_RAIL, HIER_AG_INTRA)

    # ----------------------------------------------------------------------------- model
    def traffic(self, collective: str, nbytes: float, topology: Topology, *, itemsize: int = 1) -> Traffic:
        t = Traffic(topology)
        p, local = topology.world_size, topology.local_size
        if p == 1 or not nbytes:
            return t
        self._intra_traffic(t, collective, nbytes, itemsize)
        if collective == "allreduce":
            shard = pad_to(nbytes, itemsize, local) / local
            for rail in topology.rails:
                t.ring(rail, ALGORITHM_FACTORS["allreduce"](len(rail)) * shard)
            return t
        # reduce-scatter / all-gather of a world-sized buffer: n blocks per rail position.
        for rail in topology.rails:
            t.all_pairs(rail, nbytes / p)
        return t

    @staticmethod
    def _intra_traffic(t: Traffic, collective: str, nbytes: float, itemsize: int) -> None:
        """The phases inside each node: an all-reduce's reduce-scatter and all-gather of L shards, or the
        N blocks per rail position of a reduce-scatter's or all-gather's world-sized buffer."""
        topology = t.topology
        local = topology.local_size
        per_pair = (2 * pad_to(nbytes, itemsize, local) / local if collective == "allreduce"
                    else topology.num_nodes * nbytes / topology.world_size)
        for node in topology.nodes:
            t.all_pairs(node, per_pair)

    def cost(self, model: CostModel, collective: str, nbytes: float, topology: Topology) -> float:
        if topology.world_size == 1 or not nbytes:
            return 0.0
        if collective != "allreduce":
            local, n = topology.local_size, topology.num_nodes
            intra = model.intra.time((local - 1) / local * nbytes, local - 1) if local > 1 else 0.0
            link = self.link_bytes(collective, nbytes, topology)
            return intra + (model.inter.time(link, n - 1) if n > 1 else 0.0)
        return self._pipeline(model, nbytes, topology, self.chunks(model, collective, nbytes, topology))

    def compressed_traffic(self, codec: Encoded, topology: Topology) -> Traffic:
        """The codec on the inter-node phase only: inside each node every rank sends the others their
        exact sections (reduce-scatter) and its own (all-gather); rail j rings local rank j's section,
        encoded, around the nodes."""
        t = self._intra_compressed_traffic(codec, topology)
        local, n = topology.local_size, topology.num_nodes
        if topology.world_size > 1 and n > 1:
            for j in range(local):
                t.ring([node[j] for node in topology.nodes], codec.sent(local, j, n))
        return t

    @staticmethod
    def _intra_compressed_traffic(codec: Encoded, topology: Topology) -> Traffic:
        """The exact intra-node phases of a compressed reduction: every rank sends the others of its
        node their sections (reduce-scatter) and its own (all-gather)."""
        t = Traffic(topology)
        local, n = topology.local_size, topology.num_nodes
        if topology.world_size == 1:
            return t
        sections = [codec.section_bytes(local, j, n) for j in range(local)]
        for node in topology.nodes:
            for ja, a in enumerate(node):
                for jb, b in enumerate(node):
                    t.add(a, b, sections[jb] + sections[ja])
        return t

    def compressed_cost(self, model: CostModel, codec: Encoded, topology: Topology) -> float:
        """The exact all-reduce of the staged vector in one chunk (the compressed reduction does not
        pipeline), under the model whose inter-node level carries the encoded bytes: its beta scaled
        by the ratio of what every local rank's encoded section puts on the node link to what the
        exact rail all-reduce puts there."""
        local, n = topology.local_size, topology.num_nodes
        nbytes = sum(codec.section_bytes(local, j, n) for j in range(local))
        exact = self.link_bytes("allreduce", nbytes, topology)
        if not exact:
            return 0.0
        compressed = sum(codec.sent(local, j, n) for j in range(local))  # every rail leaves the node
        inter = dataclasses.replace(model.inter, beta=model.inter.beta * compressed / exact)
        return self.cost(dataclasses.replace(model, inter=inter, chunks=1), "allreduce", nbytes, topology)

    def _pipeline(self, model: CostModel, nbytes: float, topology: Topology, chunks: int) -> float:
        local, n = topology.local_size, topology.num_nodes
        c = nbytes / chunks
        intra = model.intra.time((local - 1) / local * c, local - 1) if local > 1 else 0.0
        inter = model.inter.time(self.link_bytes("allreduce", c, topology), 2 * (n - 1)) if n > 1 else 0.0
        return pipeline_time(intra, inter, chunks)

    def chunks(self, model: CostModel, collective: str, nbytes: float, topology: Topology) -> int:
        """Pipelining pays only when one level is slower than the other; on equal levels the extra
        phases' latency makes one chunk best."""
        if collective != "allreduce":
            return 1
        options = [c for c in _CHUNK_OPTIONS if c <= max(1, model.chunks)]
        return min(options, key=lambda c: (self._pipeline(model, nbytes, topology, c), c))

    # ----------------------------------------------------------------------------- phases
    def all_reduce(self, call: Call) -> torch.futures.Future:
        topo, red, timeout = call.topology, call.red, call.timeout
        rs, ar, ag = (call.groups(role) for role in (HIER_REDUCE_SCATTER, HIER_ALL_REDUCE, HIER_ALL_GATHER))
        local = topo.local_size
        deadline = deadline_of(timeout)  # one for every phase of every chunk: the timeout bounds the call

        def phases(chunk: torch.Tensor) -> list[Phase]:
            # This rank's shard is its own block of the chunk (a multiple of L): reduced there,
            # all-reduced there, and sent from there, so no phase copies it.
            shard = chunk.view(local, -1)[topo.local_rank] if local > 1 else chunk
            out = []
            if rs.intra is not None:
                out.append(Phase("reduce_scatter",
                                 lambda: exchange_reduce_scatter(shard, chunk, red, rs.intra, remaining(deadline)),
                                 rs.intra))
            if ar.rail is not None:
                out.append(Phase("all_reduce", lambda: self._rail_all_reduce(call, shard, ar.rail, deadline),
                                 ar.rail))
            if ag.intra is not None:
                out.append(Phase("all_gather", lambda: exchange_all_gather(chunk, shard, ag.intra, remaining(deadline)),
                                 ag.intra))
            return out

        return pipelined(call, local, phases, self.all_reduce_op)

    # The inter-node phase of each collective, along this rank's rail (``synth`` replaces them).
    def _rail_all_reduce(self, call: Call, shard: torch.Tensor, group, deadline) -> int:
        wait_work(dist.all_reduce(shard, op=call.red, group=group, async_op=True), remaining(deadline))
        return int(ALGORITHM_FACTORS["allreduce"](dist.get_world_size(group)) * shard.numel() * shard.element_size())

    def _rail_reduce_scatter(self, call: Call, out: torch.Tensor, mid: torch.Tensor, group, deadline) -> int:
        """``out`` = the rail's reduction of this rank's block of ``mid`` (the node sums, rail by rail)."""
        return exchange_reduce_scatter(out, mid, call.red, group, remaining(deadline))

    def _rail_all_gather(self, call: Call, mid: torch.Tensor, src: torch.Tensor, group, deadline) -> int:
        """``mid`` = every rail member's ``src``, in rail order."""
        return exchange_all_gather(mid, src, group, remaining(deadline))

    def reduce_scatter(self, call: Call) -> torch.futures.Future:
        topo, red, timeout, p = call.topology, call.red, call.timeout, call.prepared
        world, nodes, n = topo.world_size, topo.num_nodes, p.flat.numel()
        staged = call.src.view(world, n)[torch.tensor(rail_order(topo))].reshape(-1)
        rs, rail = call.groups(HIER_REDUCE_SCATTER), call.groups(HIER_RS_RAIL)
        mid = staged if rs.intra is None else staged.new_empty(nodes * n)  # one rank per node: the staged copy
        deadline = deadline_of(timeout)  # one for both phases: the call's timeout bounds the call
        phases = []
        if rs.intra is not None:
            phases.append(Phase("reduce_scatter_intra",
                                lambda: exchange_reduce_scatter(mid, staged, red, rs.intra, remaining(deadline)),
                                rs.intra))
        phases.append(Phase("reduce_scatter_inter",
                            lambda: self._rail_reduce_scatter(call, p.flat, mid, rail.rail, deadline), rail.rail))
        fut = call.engine.submit(phases, op=f"reduce_scatter/{self.name}", device=call.src.device,
                                 blocking=call.blocking)
        return then_finish(fut, p)

    def all_gather(self, call: Call) -> torch.futures.Future:
        topo, timeout, p, src = call.topology, call.timeout, call.prepared, call.src
        world, nodes, n = topo.world_size, topo.num_nodes, src.numel()
        rail, ag = call.groups(HIER_AG_RAIL), call.groups(HIER_AG_INTRA)
        mid = src.new_empty(nodes * n)
        gathered = src.new_empty(world * n) if ag.intra is not None else mid
        order = torch.tensor(rail_order(topo))

        def permute() -> None:
            # gathered holds blocks in rail order; block i belongs to group rank order[i].
            p.flat.view(world, n)[order] = gathered.view(world, n)

        deadline = deadline_of(timeout)  # one for both exchanges: the call's timeout bounds the call
        phases = [Phase("all_gather_inter", lambda: self._rail_all_gather(call, mid, src, rail.rail, deadline),
                        rail.rail)]
        if ag.intra is not None:
            phases.append(Phase("all_gather_intra",
                                lambda: exchange_all_gather(gathered, mid, ag.intra, remaining(deadline)), ag.intra))
        phases.append(Phase("permute", permute))
        fut = call.engine.submit(phases, op=f"all_gather/{self.name}", device=src.device, blocking=call.blocking)
        return then_finish(fut, p)


HIERARCHICAL = Hierarchical()
