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
import torch.distributed as dist

from ..links import CostModel, LinkMap
from ..synthesis.check import check
from ..synthesis.run import run_schedule
from ..synthesis.sim import link_bytes, simulate
from ..synthesis.synthesize import synthesize
from ..topology import Topology
from .base import Call, Traffic
from .hierarchical import Hierarchical

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


class Synth(Hierarchical):
    """The hierarchical algorithm's phases with each inter-node phase replaced by the rail's schedule."""

    name = "synth"
    collectives = ("allreduce", "reduce_scatter", "all_gather")
    automatic = True
    codec_phase = None
    flat_on_one_level = ()
    all_reduce_op = "all_reduce/synth"

    def considered(self, topology: Topology) -> bool:
        """``auto`` weighs it only where the links differ (elsewhere a schedule cannot beat the others)."""
        return topology.links is not None and not topology.links.uniform and topology.num_nodes > 1

    def runs(self, topology: Topology, collective: str) -> str:
        return "flat" if topology.num_nodes == 1 else self.name  # one node: nothing crosses a link

    def chunks(self, model: CostModel, collective: str, nbytes: float, topology: Topology) -> int:
        return 1  # a schedule pipelines its own chunks

    # ----------------------------------------------------------------------------- model
    def _rail_bytes(self, collective: str, nbytes: float, topology: Topology) -> float:
        """The bytes of the buffer one rail's schedule runs on: the all-reduce's 1/L shard, or the
        rail's N blocks of the world's N * L (reduce-scatter, all-gather)."""
        return nbytes / topology.local_size

    def traffic(self, collective: str, nbytes: float, topology: Topology, *, itemsize: int = 1) -> Traffic:
        t = Traffic(topology)
        if topology.world_size == 1 or not nbytes:
            return t
        if topology.local_size > 1:
            self._intra_traffic(t, collective, nbytes, itemsize)
        rail_n = self._rail_bytes(collective, nbytes, topology)
        for j in range(topology.local_size):
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

    # ----------------------------------------------------------------------------- the rail phases
    def _run(self, collective: str, call: Call, buf: torch.Tensor, group, deadline) -> int:
        sched = schedule_for(collective, rail_links(call.topology), buf.numel() * buf.element_size())
        return run_schedule(sched, buf, group, call.red, deadline, f"{collective}/synth")

    def _rail_all_reduce(self, call: Call, shard: torch.Tensor, group, deadline) -> int:
        return self._run("allreduce", call, shard, group, deadline)

    def _rail_reduce_scatter(self, call: Call, out: torch.Tensor, mid: torch.Tensor, group, deadline) -> int:
        sent = self._run("reduce_scatter", call, mid, group, deadline)  # in place: this rank's block is reduced
        out.copy_(mid.view(dist.get_world_size(group), -1)[dist.get_rank(group)])
        return sent

    def _rail_all_gather(self, call: Call, mid: torch.Tensor, src: torch.Tensor, group, deadline) -> int:
        mid.view(dist.get_world_size(group), -1)[dist.get_rank(group)].copy_(src)
        return self._run("all_gather", call, mid, group, deadline)


SYNTH = Synth()
