"""``flat``: the group's own collective (gloo's ring, NCCL's rings and trees).

Issued on the caller's thread, so it keeps the caller's order with the caller's own
``torch.distributed`` calls on the same group; the engine only enforces its deadline. Modelled as
a ring over the group's ranks in rank order (all-reduce: 2(p-1)/p of the buffer to the next rank;
reduce-scatter and all-gather: (p-1)/p), and the all-to-all as 1/p of the buffer to every rank.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ..links import ALGORITHM_FACTORS, CostModel
from ..topology import Topology
from ._transport import all_gather_single, byte_rows, flat_future, reduce_scatter_single, row_bytes
from .base import ALL_PHASES, Algorithm, Call, Encoded, Traffic

__all__ = ["Flat", "FLAT"]


class Flat(Algorithm):
    name = "flat"
    collectives = ("allreduce", "reduce_scatter", "all_gather", "alltoall")
    automatic = True
    codec_phase = ALL_PHASES  # a compressed flat reduction encodes everything, over every rank

    def supports(self, topology: Topology, collective: str) -> str | None:
        return None if collective in self.collectives else super().supports(topology, collective)

    def traffic(self, collective: str, nbytes: float, topology: Topology, *, itemsize: int = 1) -> Traffic:
        t = Traffic(topology)
        p = topology.world_size
        if p == 1 or not nbytes:
            return t
        if collective == "alltoall":
            for a in range(p):
                for b in range(p):
                    t.add(a, b, nbytes / p)
        else:
            t.ring(list(range(p)), ALGORITHM_FACTORS[collective](p) * nbytes)
        return t

    def cost(self, model: CostModel, collective: str, nbytes: float, topology: Topology) -> float:
        p, n = topology.world_size, topology.num_nodes
        if p == 1 or not nbytes:
            return 0.0
        ia, ea = model.intra, model.inter
        rounds = 2 if collective == "allreduce" else 1
        volume = ALGORITHM_FACTORS[collective](p) * nbytes
        if n == 1:
            return ia.time(volume, rounds * (p - 1))
        link = self.link_bytes(collective, nbytes, topology)
        return rounds * (p - 1) * max(ia.alpha, ea.alpha) + max(volume * ia.beta, link * ea.beta)

    def compressed_traffic(self, codec: Encoded, topology: Topology) -> Traffic:
        """The codec on every byte: each rank sends its encoded payload over the ring of all p ranks."""
        t = Traffic(topology)
        p = topology.world_size
        if p > 1:
            t.ring(list(range(p)), codec.sent(1, 0, p))
        return t

    def compressed_cost(self, model: CostModel, codec: Encoded, topology: Topology) -> float:
        """As the exact all-reduce that sends as many bytes per rank as the encoded payload."""
        p = topology.world_size
        if p == 1:
            return 0.0
        return self.cost(model, "allreduce", codec.sent(1, 0, p) / ALGORITHM_FACTORS["allreduce"](p), topology)

    def all_reduce(self, call: Call) -> torch.futures.Future:
        p = call.prepared
        world = dist.get_world_size(call.group)
        call.engine.count("flat", ALGORITHM_FACTORS["allreduce"](world) * p.flat.numel() * p.flat.element_size())
        work = dist.all_reduce(p.flat, op=call.red, group=call.group, async_op=True)
        return flat_future(call.engine, work, p, "all_reduce/flat", call.timeout)

    def reduce_scatter(self, call: Call) -> torch.futures.Future:
        p, world = call.prepared, dist.get_world_size(call.group)
        call.engine.count("reduce_scatter/flat", (world - 1) * p.flat.numel() * p.flat.element_size())
        work = reduce_scatter_single(p.flat, call.src, op=call.red, group=call.group, async_op=True)
        return flat_future(call.engine, work, p, "reduce_scatter/flat", call.timeout, call.group)

    def all_gather(self, call: Call) -> torch.futures.Future:
        p, world, src = call.prepared, dist.get_world_size(call.group), call.src
        call.engine.count("all_gather/flat", (world - 1) * src.numel() * src.element_size())
        work = all_gather_single(p.flat, src, group=call.group, async_op=True)
        return flat_future(call.engine, work, p, "all_gather/flat", call.timeout, call.group)

    def all_to_all(self, call: Call) -> torch.futures.Future:
        args, src, rank = call.args, call.src, dist.get_rank(call.group)
        call.engine.count("all_to_all/flat", (sum(args.in_splits) - args.in_splits[rank]) * row_bytes(src))
        out = call.prepared.work.view(call.prepared.tensor.shape)  # the contiguous output
        work = dist.all_to_all_single(byte_rows(out), byte_rows(src), args.out_splits,
                                      args.in_splits, group=call.group, async_op=True)
        return flat_future(call.engine, work, call.prepared, "all_to_all/flat", call.timeout, call.group)


FLAT = Flat()
