"""``synth``: a schedule synthesized for the links the cluster really has, run step by step
(docs/architecture.md, "synthesized collectives"; the IR: ``comm/synthesis/ir.py``).

Where the nodes' links differ (a slow node on a star, a direct-connect mesh) a ring paces every step on
the slowest link and the hierarchy cannot help; a schedule made for the link map (``Topology.links``,
a :class:`~commopt.comm.links.LinkMap`) can: an all-reduce whose slow node owns no shard, relays around
a slow pair. The phases are the hierarchical algorithm's with its inter-node phase replaced:

- all-reduce: (1) reduce-scatter inside the node (L > 1), (2) the synthesized all-reduce of this
  rank's 1/L shard along its rail, (3) all-gather inside the node;
- reduce-scatter: (1) the blocks permuted rail by rail and reduce-scattered inside the node, (2) the
  synthesized reduce-scatter along the rail;
- all-gather: (1) the synthesized all-gather along the rail, (2) all-gather inside the node and the
  permute back.

The L rails of a node share its links, so a rail's schedule is synthesized for the link map with every
rate divided by L. The schedule is synthesized once per (collective, map) and cached in the process
(every rank computes the same one: synthesis is deterministic for its seed).

**The executor** (``comm/synthesis/run.py``): every receive of the rank's steps is posted at once into a
buffer of its own (gloo moves a payload only once its receiver is ready: posted late, a receive waits
behind the sender's other traffic), each with a tag numbering the messages of its (sender, receiver)
pair in list order, so that the k-th send pairs with the k-th receive whatever order they are issued
in; gloo's point-to-point works report completion only to ``wait()``, so a thread waits for each
transfer in flight and wakes the caller's; a step starts once its dependencies are done: a send sends
its chunks, a ``recv`` copies the arrived payload into its chunks and an ``rrc`` adds it there. The
schedule's checker (``comm/synthesis/check.py``) proves that each final chunk is reduced in one fixed
order by one owner and only copied to the others, so every rank ends bit-identical. Every wait shares
the call's deadline (``CommTimeoutError``), and the bytes sent are counted.
"""

from __future__ import annotations

import functools

import torch

from ..engine import Phase
from ..links import CostModel, LinkMap
from ..synthesis.check import check
from ..synthesis.run import run_schedule
from ..synthesis.sim import link_bytes, simulate
from ..synthesis.synthesize import synthesize
from ..topology import Topology
from ._transport import deadline_of, exchange_all_gather, exchange_reduce_scatter, remaining, then_finish
from .base import Algorithm, Call, Traffic
from .hierarchical import rail_order
from .roles import HIER_AG_INTRA, HIER_AG_RAIL, HIER_ALL_GATHER, HIER_ALL_REDUCE, HIER_REDUCE_SCATTER, HIER_RS_RAIL

__all__ = ["Synth", "SYNTH", "run_schedule", "rail_links", "schedule_for"]

_IR = {"allreduce": "allreduce", "reduce_scatter": "reducescatter", "all_gather": "allgather"}


def rail_links(topology: Topology, local: int | None = None) -> LinkMap:
    """The link map rail ``local`` (None: this rank's) sees: the topology's (a uniform star at the
    model's rate where it has none), its nodes in the rail group's order (by the group rank of their
    member of that local index), every rate shared by the node's L rails."""
    links = topology.links
    n, ways = topology.num_nodes, topology.local_size
    j = topology.local_rank if local is None else local
    if links is None:
        rate = (topology.link_rate_bps or 10e9) / 8
        links = LinkMap.star([rate] * n)
    if links.nodes != n:
        raise ValueError(f"synth: the link map has {links.nodes} nodes, the topology {n} ({topology.layout})")
    order = sorted(range(n), key=lambda i: topology.nodes[i][j])  # rail position -> node index
    if links.kind == "star":
        links = LinkMap.star([links.up[i] for i in order], [links.down[i] for i in order], alpha=links.alpha)
    else:
        pos = {node: k for k, node in enumerate(order)}
        links = LinkMap.mesh(n, {(pos[a], pos[b]): r for a, b, r in links.pairs}, alpha=links.alpha)
    return links.shared(ways)


def schedule_for(collective: str, links: LinkMap, nbytes: float = 16 << 20):
    """The synthesized schedule of ``collective`` ("allreduce", "reduce_scatter", "all_gather") for
    ``links`` at about ``nbytes`` (the schedule's buffer), checked (``ScheduleError`` if a synthesizer
    wrote a wrong one), cached per process and size class (a power of 4 bytes from 64 KiB to 256 MiB:
    the best chunking depends on the size; every rank asks with the same bytes, so gets the same one)."""
    size = 64 << 10
    while size < min(float(nbytes), 256 << 20) / 2:
        size *= 4
    return _schedule(collective, links, size)


@functools.lru_cache(maxsize=64)
def _schedule(collective: str, links: LinkMap, nbytes: int):
    sched = synthesize(_IR[collective], links, nbytes=nbytes)
    check(sched)
    return sched


@functools.lru_cache(maxsize=256)
def _simulated(collective: str, links: LinkMap, nbytes: int) -> float:
    """The simulated seconds of the schedule for ``nbytes`` (``auto`` asks on every call: simulating a
    large schedule takes a good part of a second, so each size is simulated once per process)."""
    return simulate(schedule_for(collective, links, nbytes), links, nbytes)


class Synth(Algorithm):
    name = "synth"
    collectives = ("allreduce", "reduce_scatter", "all_gather")
    needs_uniform = True
    automatic = True

    def considered(self, topology: Topology) -> bool:
        """``auto`` weighs it only where the links differ (elsewhere a schedule cannot beat the others)."""
        return topology.links is not None and not topology.links.uniform and topology.num_nodes > 1

    def roles(self, topology: Topology) -> tuple[str, ...]:
        return (HIER_REDUCE_SCATTER, HIER_ALL_REDUCE, HIER_ALL_GATHER, HIER_RS_RAIL, HIER_AG_RAIL, HIER_AG_INTRA)

    # ----------------------------------------------------------------------------- model
    def _rail_bytes(self, collective: str, nbytes: float, topology: Topology) -> float:
        """The bytes of the buffer one rail's schedule runs on: the all-reduce's 1/L shard, or the
        rail's N blocks of the world's N * L (reduce-scatter, all-gather)."""
        return nbytes / topology.local_size

    def traffic(self, collective: str, nbytes: float, topology: Topology, *, itemsize: int = 1) -> Traffic:
        t = Traffic(topology)
        p, local = topology.world_size, topology.local_size
        if p == 1 or not nbytes:
            return t
        if local > 1:  # inside the node, as the hierarchical algorithm's phases
            per_pair = 2 * nbytes / local if collective == "allreduce" else topology.num_nodes * nbytes / p
            for node in topology.nodes:
                t.all_pairs(node, per_pair)
        rail_n = self._rail_bytes(collective, nbytes, topology)
        for j in range(local):
            rail = sorted(node[j] for node in topology.nodes)
            sched = schedule_for(collective, rail_links(topology, j), rail_n)
            for (a, b), v in link_bytes(sched, int(rail_n // itemsize) * itemsize, itemsize=itemsize).items():
                t.add(rail[a], rail[b], v)
        return t

    def cost(self, model: CostModel, collective: str, nbytes: float, topology: Topology) -> float:
        if topology.world_size == 1 or not nbytes:
            return 0.0
        local = topology.local_size
        intra = model.intra.time((local - 1) / local * nbytes, local - 1) if local > 1 else 0.0
        rounds = 2 if collective == "allreduce" and local > 1 else 1
        links = rail_links(topology, 0)  # rail 0 for every rank: every rank predicts the same
        if topology.links is None:  # no map: the model's inter-node level, shared by the rails
            links = LinkMap.star([1 / model.inter.beta / local] * topology.num_nodes, alpha=model.inter.alpha)
        return rounds * intra + _simulated(collective, links, int(self._rail_bytes(collective, nbytes, topology)))

    # ----------------------------------------------------------------------------- phases
    def _rail_phase(self, collective: str, call: Call, buf: torch.Tensor, group, deadline) -> Phase:
        sched = schedule_for(collective, rail_links(call.topology), buf.numel() * buf.element_size())
        op = f"{collective}/synth"

        def run() -> int:
            return run_schedule(sched, buf, group, call.red, deadline, op)

        return Phase(f"{collective}_rail", run, group)

    def all_reduce(self, call: Call) -> torch.futures.Future:
        topo, red, p = call.topology, call.red, call.prepared
        rs, ar, ag = (call.groups(role) for role in (HIER_REDUCE_SCATTER, HIER_ALL_REDUCE, HIER_ALL_GATHER))
        local = topo.local_size
        deadline = deadline_of(call.timeout)
        flat = p.flat
        pad = (-flat.numel()) % local
        work = torch.cat([flat, flat.new_zeros(pad)]) if pad else flat
        shard = work.view(local, -1)[topo.local_rank] if local > 1 else work
        phases = []
        if rs.intra is not None:
            phases.append(Phase("reduce_scatter", lambda: exchange_reduce_scatter(shard, work, red, rs.intra,
                                                                                  remaining(deadline)), rs.intra))
        if ar.rail is not None:
            phases.append(self._rail_phase("allreduce", call, shard, ar.rail, deadline))
        if ag.intra is not None:
            phases.append(Phase("all_gather", lambda: exchange_all_gather(work, shard, ag.intra, remaining(deadline)),
                                ag.intra))
        if pad:
            phases.append(Phase("unpad", lambda: flat.copy_(work[:flat.numel()])))
        fut = call.engine.submit(phases, op="all_reduce/synth", device=flat.device, blocking=call.blocking)
        return then_finish(fut, p)

    def reduce_scatter(self, call: Call) -> torch.futures.Future:
        topo, red, p = call.topology, call.red, call.prepared
        world, nodes, n = topo.world_size, topo.num_nodes, p.flat.numel()
        staged = call.src.view(world, n)[torch.tensor(rail_order(topo))].reshape(-1)
        rs, rail = call.groups(HIER_REDUCE_SCATTER), call.groups(HIER_RS_RAIL)
        mid = staged if rs.intra is None else staged.new_empty(nodes * n)
        pos = sorted(node[topo.local_rank] for node in topo.nodes).index(topo.rank)
        deadline = deadline_of(call.timeout)
        phases = []
        if rs.intra is not None:
            phases.append(Phase("reduce_scatter_intra",
                                lambda: exchange_reduce_scatter(mid, staged, red, rs.intra, remaining(deadline)),
                                rs.intra))
        if rail.rail is not None:
            phases.append(self._rail_phase("reduce_scatter", call, mid, rail.rail, deadline))
        phases.append(Phase("copy", lambda: p.flat.copy_(mid.view(nodes, n)[pos])))
        fut = call.engine.submit(phases, op="reduce_scatter/synth", device=call.src.device, blocking=call.blocking)
        return then_finish(fut, p)

    def all_gather(self, call: Call) -> torch.futures.Future:
        topo, p, src = call.topology, call.prepared, call.src
        world, nodes, n = topo.world_size, topo.num_nodes, src.numel()
        rail, ag = call.groups(HIER_AG_RAIL), call.groups(HIER_AG_INTRA)
        pos = sorted(node[topo.local_rank] for node in topo.nodes).index(topo.rank)
        mid = src.new_empty(nodes * n)
        gathered = src.new_empty(world * n) if ag.intra is not None else mid
        order = torch.tensor(rail_order(topo))
        deadline = deadline_of(call.timeout)

        def permute() -> None:
            p.flat.view(world, n)[order] = gathered.view(world, n)

        phases = [Phase("place", lambda: mid.view(nodes, n)[pos].copy_(src))]
        if rail.rail is not None:
            phases.append(self._rail_phase("all_gather", call, mid, rail.rail, deadline))
        if ag.intra is not None:
            phases.append(Phase("all_gather_intra",
                                lambda: exchange_all_gather(gathered, mid, ag.intra, remaining(deadline)), ag.intra))
        phases.append(Phase("permute", permute))
        fut = call.engine.submit(phases, op="all_gather/synth", device=src.device, blocking=call.blocking)
        return then_finish(fut, p)


SYNTH = Synth()
