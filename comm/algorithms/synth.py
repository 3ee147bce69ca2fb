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

**With a compressor** (``codec_phase = INTER_PHASE``: the compressed reduction of
``compression/exchange.py`` keeps the intra-node phases exact, as for ``hierarchical``) the codec's
rounds run on the rail through :class:`RailTransport` (:meth:`Synth.codec_transport`): a round that
all-reduces a summable wire buffer (a cast's fp16/bf16 values, PowerSGD's P and Q, random-k's values,
the exact fallback) runs the rail's synthesized all-reduce on it, a round that all-gathers payloads
(signs, top-k, the quantizer's second shot) the rail's synthesized all-gather; an all-to-all round
(the quantizer's and the 1-bit codec's first shot) stays the direct pairwise exchange, whose every
pair uses its own link. On one rank per node the rail is the whole group and nothing stays exact.

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
import math
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed import ReduceOp

from ..links import CostModel, LinkMap
from ..synthesis.check import check
from ..synthesis.run import run_schedule
from ..synthesis.sim import link_bytes, simulate
from ..synthesis.star import direct_schedule
from ..synthesis.synthesize import synthesize
from ..topology import Topology
from ._transport import deadline_of
from .base import INTER_PHASE, Call, Encoded, Traffic
from .hierarchical import Hierarchical

__all__ = ["Synth", "SYNTH", "RailTransport", "run_schedule", "rail_links", "schedule_for", "codec_rounds",
           "EXECUTOR_ALPHA", "EXECUTOR_STEP"]

_IR = {"allreduce": "allreduce", "reduce_scatter": "reducescatter", "all_gather": "allgather"}

#: Seconds the executor adds to every message (``run_schedule``: a Python step and a thread handing its
#: completion over), on top of the link's own latency: 0.15-0.16 ms per step measured on loopback (3 ranks,
#: 2 cores, 6 to 192 steps of 1 KiB to 64 KiB; docs/results.md 31). The schedules are planned and priced with
#: it, so small buffers get fewer pieces and ``auto`` does not take a schedule whose messages cost more
#: than they save (PowerSGD's factors on a star lost 1.4x with 50 us).
EXECUTOR_ALPHA = 150e-6

#: Seconds of the executor's CPU per step of the busiest rank, which runs its steps one at a time: a
#: schedule is priced no lower than its busiest rank's steps times this (plans are made without it).
#: Measured in the emulated cluster (ranks sharing 2 cores), all-reduces on the 4x1 star with a slow node:
#: 64 KiB, 80 steps, 25.8-29 ms (0.32-0.36 ms a step) where the links alone predict 14 ms and ``flat`` runs
#: in 11-17: priced without it, a model-only ``auto`` took synth there and lost 1.7x; 256 KiB, 160 steps,
#: 45.9 ms (0.29 ms a step, and synth 1.4x flat). A floor must stay below every measured time, hence 0.25 ms
#: (docs/results.md 31, 32). A floor, not a term: it bites only where the steps outweigh the bytes (small
#: buffers), so what ``auto`` chooses from 1 MiB up is unchanged; planning with it (a term, or per-rank CPU
#: in the simulator) cost the 1-2 MiB buffers their gain (docs/results.md 31).
EXECUTOR_STEP = 250e-6


def rail_links(topology: Topology, local: int | None = None) -> LinkMap:
    """The link map rail ``local`` (None: this rank's) sees: the topology's (a uniform star at the
    model's rate where it has none), its nodes in the rail group's order (by the group rank of their
    member of that local index), every rate shared by the node's L rails, each message's latency the
    link's plus the executor's (:data:`EXECUTOR_ALPHA`)."""
    links = topology.links
    n, ways = topology.num_nodes, topology.local_size
    j = topology.local_rank if local is None else local
    if links is None:
        rate = (topology.link_rate_bps or 10e9) / 8
        links = LinkMap.star([rate] * n)
    if links.nodes != n:
        raise ValueError(f"synth: the link map has {links.nodes} nodes, the topology {n} ({topology.layout})")
    order = sorted(range(n), key=lambda i: topology.nodes[i][j])  # rail position -> node index
    alpha = links.alpha + EXECUTOR_ALPHA
    if links.kind == "star":
        links = LinkMap.star([links.up[i] for i in order], [links.down[i] for i in order], alpha=alpha)
    else:
        pos = {node: k for k, node in enumerate(order)}
        links = LinkMap.mesh(n, {(pos[a], pos[b]): r for a, b, r in links.pairs}, alpha=alpha)
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
    """The seconds the schedule for ``nbytes`` is priced at: simulated on ``links``, and no less than its
    busiest rank's steps at :data:`EXECUTOR_STEP` each (``auto`` asks on every call: simulating a large
    schedule takes a good part of a second, so each size is priced once per process).
    ``"all_to_all"``: the direct pairwise exchange of equal blocks (a codec's all-to-all round), whose
    link use is the direct all-gather's."""
    if collective == "all_to_all":
        sched = direct_schedule("allgather", [1] * links.nodes)
    else:
        sched = schedule_for(collective, links, nbytes)
    return max(simulate(sched, links, nbytes), EXECUTOR_STEP * max(len(steps) for steps in sched.steps))


# A codec round's collective, from the prefix of its name (``Codec.rounds``), and the bytes one rank of
# n sends per byte of its buffer with the group's own collective (what the codec's bytes assume).
_ROUND_SHARE = {"all_reduce": lambda n: 2 * (n - 1) / n, "all_gather": lambda n: (n - 1) / n,
                "all_to_all": lambda n: (n - 1) / n}


def codec_rounds(rounds: tuple[str, ...]) -> list[str] | None:
    """The collective of each codec round (``"all_reduce"``, ``"all_gather"``, ``"all_to_all"``: how
    ``synth`` routes it), or None when a round names none of them (``synth`` cannot carry that codec)."""
    kinds = [next((k for k in _ROUND_SHARE if r.startswith(k)), None) for r in rounds]
    return None if None in kinds else kinds


def _round_bytes(codec: Encoded, kinds: list[str], local: int, j: int, n: int) -> float:
    """The buffer of each of section ``j``'s rounds: the codec's bytes (:meth:`Encoded.sent`, counted
    for the group's own collectives) spread evenly over its rounds, per byte of buffer."""
    return codec.sent(local, j, n) / sum(_ROUND_SHARE[k](n) for k in kinds)


@dataclass(frozen=True)
class RailTransport:
    """How a codec's rounds move their payloads along a rail under ``synth``: the rail's synthesized
    all-reduce and all-gather, made for ``links`` (the rail's view, :func:`rail_links`), run on the
    round's group (schedule rank i = group rank i). The compressed reduction hands it to the codecs
    (``compression.exchange.round_all_reduce`` / ``round_all_gather``); every call returns the bytes
    this rank sent and waits no longer than ``timeout`` (``CommTimeoutError``)."""

    links: LinkMap

    def all_reduce(self, buf: torch.Tensor, group, timeout: float | None) -> int:
        """``buf`` = the SUM over ``group`` of every member's ``buf``, in place; identical on every
        member (each chunk summed once, by one owner, in a fixed order, then copied)."""
        if not buf.numel():
            return 0
        sched = schedule_for("allreduce", self.links, buf.numel() * buf.element_size())
        return run_schedule(sched, buf, group, ReduceOp.SUM, deadline_of(timeout), "compress/synth/all_reduce")

    def all_gather(self, out: torch.Tensor, payload: torch.Tensor, group, timeout: float | None) -> int:
        """``out`` = every member's ``payload`` side by side, in group-rank order (equal sizes)."""
        n, me = dist.get_world_size(group), dist.get_rank(group)
        out.view(n, -1)[me].copy_(payload.view(-1))
        if not out.numel():
            return 0
        sched = schedule_for("all_gather", self.links, out.numel() * out.element_size())
        return run_schedule(sched, out, group, None, deadline_of(timeout), "compress/synth/all_gather")


class Synth(Hierarchical):
    """The hierarchical algorithm's phases with each inter-node phase replaced by the rail's schedule."""

    name = "synth"
    collectives = ("allreduce", "reduce_scatter", "all_gather")
    automatic = True
    codec_phase = INTER_PHASE  # with a compressor, the rail rounds are encoded and routed (RailTransport)
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
        links = self._model_links(model, topology)
        return rounds * intra + _simulated(collective, links, int(self._rail_bytes(collective, nbytes, topology)))

    @staticmethod
    def _model_links(model: CostModel, topology: Topology) -> LinkMap:
        """Rail 0's links for every rank (every rank predicts the same); with no map, the model's
        inter-node level as a uniform star, shared by the rails."""
        if topology.links is None:
            return LinkMap.star([1 / model.inter.beta / topology.local_size] * topology.num_nodes,
                                alpha=model.inter.alpha + EXECUTOR_ALPHA)
        return rail_links(topology, 0)

    # ----------------------------------------------------------------------------- with a codec
    def codec_transport(self, topology: Topology) -> RailTransport:
        """What the compressed reduction routes this rank's codec rounds through (its rail's links)."""
        return RailTransport(rail_links(topology))

    def _codec_kinds(self, codec: Encoded) -> list[str]:
        kinds = codec_rounds(tuple(codec.rounds))
        if kinds is None:
            raise ValueError(f"algorithm 'synth' routes codec rounds named all_reduce*, all_gather* or all_to_all*; "
                             f"this codec's rounds are {tuple(codec.rounds)}: use algorithm='hierarchical'")
        return kinds

    def compressed_traffic(self, codec: Encoded, topology: Topology) -> Traffic:
        """Inside each node the exact sections, as ``hierarchical``; on rail j, each round's buffer
        (the codec's encoded bytes of section j) through the schedule of its collective, or direct
        pairwise blocks for an all-to-all round."""
        t = self._intra_compressed_traffic(codec, topology)
        local, n = topology.local_size, topology.num_nodes
        if topology.world_size == 1 or n == 1:
            return t
        kinds = self._codec_kinds(codec)
        for j in range(local):
            rail = sorted(node[j] for node in topology.nodes)
            size = _round_bytes(codec, kinds, local, j, n)
            for kind in kinds:
                if kind == "all_to_all":
                    t.all_pairs(rail, size / n)
                    continue
                sched = schedule_for(kind.replace("all_reduce", "allreduce"), rail_links(topology, j), size)
                for (a, b), v in link_bytes(sched, int(size)).items():
                    t.add(rail[a], rail[b], v)
        return t

    def compressed_cost(self, model: CostModel, codec: Encoded, topology: Topology) -> float:
        """The exact intra-node reduce-scatter and all-gather of the staged vector, then the codec's
        rounds on the rail as :meth:`compressed_traffic` routes them, each simulated on the rail's
        links (the busiest section's rounds: the rails run side by side)."""
        local, n = topology.local_size, topology.num_nodes
        if topology.world_size == 1:
            return 0.0
        nbytes = sum(codec.section_bytes(local, j, n) for j in range(local))
        intra = 2 * model.intra.time((local - 1) / local * nbytes, local - 1) if local > 1 else 0.0
        kinds = codec_rounds(tuple(codec.rounds))
        if kinds is None:
            return math.inf  # rounds it cannot route: never chosen (an explicit choice is refused at the call)
        if n == 1:
            return intra
        size = max(_round_bytes(codec, kinds, local, j, n) for j in range(local))
        if not size:
            return intra
        links = self._model_links(model, topology)
        return intra + sum(_simulated(k.replace("all_reduce", "allreduce"), links, max(1, int(size))) for k in kinds)

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
