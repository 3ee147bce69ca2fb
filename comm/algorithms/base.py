"""What every algorithm is: one object with ``supports``, ``roles``, ``traffic``, ``cost`` and ``start``.

An algorithm knows its phases and their bytes; it knows nothing of caches or calibration, and it
imports nothing above itself: its cost is stated in the terms of the pure cost model
(``commopt.comm.links``), and the caller (``collectives``, ``alltoall``, the FSDP2 comms) has the
runtime context build a :class:`Call` holding the prepared tensors, the process groups of the
algorithm's roles, the engine, the pipelining depth the cost model chose and the algorithms' own
long-lived state (INA sessions), and hands it to :meth:`Algorithm.start`, which returns a Future.

An algorithm that can carry a codec (:attr:`Algorithm.codec_phase`) also answers
:meth:`Algorithm.compressed_traffic` and :meth:`Algorithm.compressed_cost` for an :class:`Encoded`
(what the codec makes of each part of the staged vector): the compressed ``auto`` weighs its
candidates by them, and a test holds the traffic equal to the engine's count of a compressed reduction.

Everything that needs to know what an algorithm moves asks :meth:`Algorithm.traffic`: the cost
model's link bytes, ``auto``, the simulator's traffic matrix and the benchmarks' link columns. The
engine counts what each phase actually sends (the bytes of the tensors it posts), and a test holds
the two equal for every algorithm.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
from torch.distributed import ReduceOp

from ..cache import Cache
from ..engine import Engine
from ..links import ALGORITHM_FACTORS, COPY_BETA, PHASE_HANDOFF, CostModel, pad_to, pipeline_time
from ..topology import Groups, Topology
from ._transport import Prepared

__all__ = ["Algorithm", "Call", "Traffic", "Encoded", "SWITCH", "COLLECTIVES", "ALGORITHM_FACTORS", "PHASE_HANDOFF",
           "COPY_BETA", "pipeline_time", "pad_to", "GROUP_SCOPE", "RAIL_SCOPE", "ALL_PHASES", "INTER_PHASE"]

COLLECTIVES = ("allreduce", "reduce_scatter", "all_gather", "alltoall")

SWITCH = -1  # the in-network aggregation switch, as an endpoint of Traffic.pairs

# Algorithm.scope: the ranks one call reduces over.
GROUP_SCOPE = "group"
RAIL_SCOPE = "rail"
# Algorithm.codec_phase: where a compressor applies.
ALL_PHASES = "all"
INTER_PHASE = "inter"


@dataclass
class Traffic:
    """The bytes one call puts on every link: ``pairs[(src, dst)]`` bytes rank ``src`` sends to
    rank ``dst`` (ranks of the topology's group; :data:`SWITCH` for the aggregation switch)."""

    topology: Topology
    pairs: dict[tuple[int, int], float] = field(default_factory=dict)

    def add(self, src: int, dst: int, nbytes: float) -> None:
        if src != dst and nbytes:
            self.pairs[(src, dst)] = self.pairs.get((src, dst), 0.0) + nbytes

    def ring(self, members: list[int], nbytes: float) -> None:
        """A ring over ``members`` (in that order) in which each member sends ``nbytes`` to the next."""
        if len(members) > 1:
            for i, r in enumerate(members):
                self.add(r, members[(i + 1) % len(members)], nbytes)

    def all_pairs(self, members: list[int], nbytes: float) -> None:
        """Every member sends ``nbytes`` to every other member (an all-to-all, or a gather's blocks)."""
        for a in members:
            for b in members:
                self.add(a, b, nbytes)

    def rail_rings(self, nbytes: float) -> None:
        """Every rail of the topology a ring at once, each member sending ``nbytes`` to the next."""
        for rail in self.topology.rails:
            self.ring(rail, nbytes)

    def sent(self, rank: int) -> float:
        """Bytes ``rank`` sends in the call (what the engine counts on that rank)."""
        return sum(v for (s, _), v in self.pairs.items() if s == rank)

    @property
    def uses_switch(self) -> bool:
        return any(SWITCH in pair for pair in self.pairs)

    def matrix(self) -> torch.Tensor:
        """Float64 bytes rank i sends to rank j: ``[p, p]``, or ``[p + 1, p + 1]`` when the traffic
        goes through an aggregation switch (index p: the switch)."""
        p = self.topology.world_size
        size = p + 1 if self.uses_switch else p
        m = torch.zeros(size, size, dtype=torch.float64)
        for (s, d), v in self.pairs.items():
            m[p if s == SWITCH else s, p if d == SWITCH else d] += v
        return m

    def link_bytes(self) -> float:
        """The bytes the busiest node link carries in one direction (the switch is off every node)."""
        node_of = {r: i for i, node in enumerate(self.topology.nodes) for r in node}
        out = [0.0] * len(self.topology.nodes)
        inn = [0.0] * len(self.topology.nodes)
        for (s, d), v in self.pairs.items():
            a, b = node_of.get(s, -1), node_of.get(d, -1)
            if a != b:
                if a >= 0:
                    out[a] += v
                if b >= 0:
                    inn[b] += v
        return max(out + inn, default=0.0)


class Encoded(Protocol):
    """What a codec sends for one reduction, as an algorithm that carries it asks
    (``compression.auto.encoded`` builds one from the codec and the tensors' shapes): the
    algorithm knows which part of the staged vector crosses which link, the codec how many bytes
    that part becomes."""

    def section_bytes(self, sections: int, section: int, ranks: int) -> float:
        """Exact (uncompressed) bytes of section ``section`` of the staged vector laid out in
        ``sections`` sections (one per local rank; tensor-aligned for matrix codecs) for an exchange
        over ``ranks`` ranks."""

    def sent(self, sections: int, section: int, ranks: int) -> float:
        """Bytes one rank sends to exchange that section, encoded, over ``ranks`` ranks."""


@dataclass
class Call:
    """One collective call, prepared by the public entry point for an algorithm
    (``runtime.Context.call`` builds it).

    Attributes:
        collective: one of :data:`COLLECTIVES`.
        prepared: the output's contiguous working view and how to finish the call.
        red: the reduction (SUM, MAX or MIN; AVG was turned into SUM and a scale), None for data
            movement.
        group: the process group (None: WORLD).
        topology: its layout (None for flat calls, which need none).
        timeout: seconds each wait may take (None: the group's own).
        blocking: the caller waits at once (a single chunk may then run on the caller's thread).
        engine: the process's comm engine, which runs every phase.
        role_groups: the derived groups of each of the algorithm's :meth:`Algorithm.roles` on
            ``topology``, created collectively before the call (empty for flat calls).
        chunks: the pipelining depth the cost model chose.
        src: the input as a contiguous 1-D view (reduce-scatter, all-gather), or its rows (all-to-all).
        args: the all-to-all's normalised splits.
        sessions: the algorithms' long-lived per-process state (INA sessions and agreed job
            identities), released by ``commopt.comm.destroy()``; None where the caller has none.
    """

    collective: str
    prepared: Prepared
    red: ReduceOp | None
    group: Any
    topology: Topology | None
    timeout: float | None
    blocking: bool
    engine: Engine
    role_groups: dict[str, Groups] = field(default_factory=dict)
    chunks: int = 1
    src: torch.Tensor | None = None
    args: Any = None
    sessions: Cache | None = None

    def groups(self, role: str) -> Groups:
        """The derived groups of ``role`` (one of the algorithm's :meth:`Algorithm.roles`)."""
        try:
            return self.role_groups[role]
        except KeyError:
            raise KeyError(f"role {role!r} has no groups in this call (it has {sorted(self.role_groups)}): an "
                           f"algorithm must declare every role it uses in roles(topology)") from None


@functools.lru_cache(maxsize=512)
def _link_share(algo: Algorithm, collective: str, nodes: tuple[tuple[int, ...], ...]) -> float:
    """The busiest node link's bytes per byte of buffer (a pure function of the layout, memoised:
    the simulator asks for it on every chunk of 1024-rank layouts)."""
    world = sum(len(n) for n in nodes)
    reference = float(world * max(len(n) for n in nodes) << 20)  # divides evenly: no padding
    topo = Topology(nodes=nodes, rank=0, world_size=world)
    return algo.traffic(collective, reference, topo).link_bytes() / reference


class Algorithm:
    """The interface every algorithm module implements once (docs/architecture.md section 5.2).

    The class attributes are the algorithm's declared traits; every caller that accepts algorithm
    names (the collectives, the DDP hook, the compressed reduction, ``auto``, the FSDP2 comms, the
    benchmarks) asks the registry (``commopt.comm.algorithms``) through them, never a list of its own.

    Attributes:
        name: the ``algorithm=`` string that selects it (unique in the registry; not ``"auto"``).
        collectives: the collectives it implements (a subset of :data:`COLLECTIVES`).
        needs_uniform: runs only on nodes of equal size (``supports`` says so otherwise).
        automatic: ``auto`` weighs it (by :meth:`cost`) for the collectives it implements; ties go
            to the algorithm registered first.
        scope: which ranks one call reduces over: :data:`GROUP_SCOPE` (every rank of the call's group: the
            public collectives and the DDP hook run only these) or :data:`RAIL_SCOPE` (this rank's rail of
            the topology: the inter-node level of a reduction whose intra-node level already ran).
        codec_phase: where a compressor applies when the algorithm carries one: :data:`ALL_PHASES`
            (every byte it moves is encoded), :data:`INTER_PHASE` (only the inter-node phase; the
            intra-node phases stay exact), or None: it cannot carry one.
        flat_on_one_level: the collectives it hands to ``flat`` on a topology of one level (one
            node, or one rank per node), where its phases would degenerate to the flat one.
    """

    name: str = ""
    collectives: tuple[str, ...] = ()
    needs_uniform: bool = False
    automatic: bool = False
    scope: str = GROUP_SCOPE
    codec_phase: str | None = None
    flat_on_one_level: tuple[str, ...] = ()

    def runs(self, topology: Topology, collective: str) -> str:
        """The name of the algorithm a call of ``collective`` on ``topology`` really runs: ``flat``
        where this one degenerates to it on one level (:attr:`flat_on_one_level`), else itself."""
        if collective in self.flat_on_one_level and topology.num_nodes in (1, topology.world_size):
            return "flat"
        return self.name

    def considered(self, topology: Topology) -> bool:
        """Whether ``auto`` weighs this algorithm on ``topology`` at all (beyond :meth:`supports`): an
        algorithm that can only tie or lose somewhere stays out of the choice there."""
        return True

    def roles(self, topology: Topology) -> tuple[str, ...]:
        """The group roles (one process group per phase role, docs/architecture.md section 3) the algorithm uses."""
        return ()

    def supports(self, topology: Topology, collective: str) -> str | None:
        """None when the algorithm runs ``collective`` on ``topology``, else why not."""
        if collective not in self.collectives:
            return f"algorithm {self.name!r} does not implement {collective}"
        if self.needs_uniform and not topology.is_uniform:
            return (f"algorithm {self.name!r} needs nodes of equal size, got node sizes "
                    f"{[len(n) for n in topology.nodes]} ({topology.layout})")
        return None

    def traffic(self, collective: str, nbytes: float, topology: Topology, *, itemsize: int = 1) -> Traffic:
        """What one call moves. ``nbytes``: the per-rank buffer (all-reduce, all-to-all) or the whole
        world-sized buffer (reduce-scatter, all-gather); ``itemsize`` for the padding to whole elements."""
        raise NotImplementedError(f"{type(self).__name__} must say its traffic(): every algorithm does")

    def link_bytes(self, collective: str, nbytes: float, topology: Topology) -> float:
        """``traffic(collective, nbytes, topology).link_bytes()`` without building the traffic of
        every rank pair on every call: traffic is linear in the bytes (but for padding, which a cost
        estimate may ignore), so the busiest link's share is computed once per layout."""
        return nbytes * _link_share(self, collective, topology.nodes)

    def cost(self, model: CostModel, collective: str, nbytes: float, topology: Topology) -> float:
        """Predicted seconds of one call under the level ``model`` (same ``nbytes`` as :meth:`traffic`)."""
        raise NotImplementedError(f"{type(self).__name__} must say its cost(): every algorithm does")

    def compressed_traffic(self, codec: Encoded, topology: Topology) -> Traffic:
        """What one all-reduce carrying ``codec`` on its :attr:`codec_phase` moves (the phases the
        codec does not apply to move the exact bytes)."""
        raise NotImplementedError(f"algorithm {self.name!r} cannot carry a codec (codec_phase is None)")

    def compressed_cost(self, model: CostModel, codec: Encoded, topology: Topology) -> float:
        """Predicted seconds of one all-reduce carrying ``codec`` under the level ``model``."""
        raise NotImplementedError(f"algorithm {self.name!r} cannot carry a codec (codec_phase is None)")

    def codec_transport(self, topology: Topology) -> object | None:
        """What a compressed reduction routes this algorithm's codec rounds through (a
        ``compression.codec.Transport``: ``synth``'s rail schedules), or None: the round groups' own
        collectives."""
        return None

    def chunks(self, model: CostModel, collective: str, nbytes: float, topology: Topology) -> int:
        """The pipelining depth with the lowest predicted time (1 for unpipelined algorithms)."""
        return 1

    def start(self, call: Call) -> torch.futures.Future:
        """Issue the call's phases; a Future of the finished output."""
        fn = {"allreduce": self.all_reduce, "reduce_scatter": self.reduce_scatter, "all_gather": self.all_gather,
              "alltoall": self.all_to_all}[call.collective]
        return fn(call)

    def all_reduce(self, call: Call) -> torch.futures.Future:
        raise NotImplementedError(f"algorithm {self.name!r} does not implement allreduce")

    def reduce_scatter(self, call: Call) -> torch.futures.Future:
        raise NotImplementedError(f"algorithm {self.name!r} does not implement reduce_scatter")

    def all_gather(self, call: Call) -> torch.futures.Future:
        raise NotImplementedError(f"algorithm {self.name!r} does not implement all_gather")

    def all_to_all(self, call: Call) -> torch.futures.Future:
        raise NotImplementedError(f"algorithm {self.name!r} does not implement alltoall")

    def __repr__(self) -> str:
        return f"<algorithm {self.name}>"
