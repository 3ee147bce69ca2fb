"""``algorithm="auto"`` with a compressor: the candidate the cost model predicts fastest.

The candidates are the registry's automatic algorithms that can carry a compressor
(``algorithms.candidates("allreduce", codec=True)``: flat, hierarchical and synth) that the topology
supports and that weigh themselves there (``Algorithm.considered``: synth only where the links
differ), each predicted by its own ``compressed_cost`` for an :class:`Encoding` of the tensors (what
the compressor makes of each section of the staged vector, ``layout.py``): the flat exchange
compresses everything, over a ring that crosses the node links; the hierarchical one only its
inter-node phase, the intra-node reduce-scatter and all-gather moving the exact sections
(``commopt.comm.algorithms.hierarchical``); synth the same phases with the codec's rounds run by the
rail's synthesized schedules, simulated on the link map (``commopt.comm.algorithms.synth``).

``flat`` where the model's levels share one resource (``model.shared``: loopback, where the
hierarchy only adds phases), and where the topology has one level (one rank per node counts as two
where the links differ, as for the exact ``auto``). The model is
``cost.model_for(topology)`` (an explicit model, the cached calibration, the configured link rate,
or the documented defaults), which rank 0 broadcasts once per topology; the rest depends only on
shapes: every rank chooses the same (docs/architecture.md section 3, rule 2).
"""

from __future__ import annotations

import torch

from .. import algorithms, cost
from ..algorithms.synth import codec_rounds
from ..topology import Topology
from .codec import Codec, compute_dtype
from .layout import layout_for

__all__ = ["choose", "predict", "Encoding", "uneven", "round_kinds", "SYNTH_TIE"]

#: ``synth`` is taken only where its prediction beats every other candidate's by more than this
#: fraction: a codec whose rounds a schedule cannot speed up (a quantizer's all-to-all and equal-shard
#: all-gather on a star) is predicted within 0.2 % of ``flat`` by second-order terms, and the schedule's
#: executor pays a Python step per message that the model leaves out. The exact ``auto``'s measured
#: lines use the same margin (``cost.MEASURED_TIE``).
SYNTH_TIE = cost.MEASURED_TIE


def uneven(topology: Topology) -> bool:
    """Whether the topology's nodes have links that differ (``Topology.links``): there even one rank
    per node has a second level to weigh (a schedule made for the links, ``synth``)."""
    return topology.links is not None and not topology.links.uniform and topology.num_nodes > 1


def round_kinds(compressor: Codec) -> list[str] | None:
    """The collective of each of ``compressor``'s rounds, from their names (``"all_reduce"``,
    ``"all_gather"``, ``"all_to_all"``), or None when a round names none of them."""
    return codec_rounds(tuple(compressor.rounds))


def choose(compressor: Codec, tensors: list[torch.Tensor], topology: Topology, *,
           model: cost.CostModel | None = None, timeout: float | None = None) -> str:
    """The algorithm (``"flat"``, ``"hierarchical"`` or ``"synth"``) for reducing ``tensors`` through
    ``compressor`` on ``topology``.

    Args:
        compressor: the compressor.
        tensors: the tensors of one reduction (their shapes and dtype count, not their values).
        topology: the layout of the group reduced over.
        model: the level model (None: ``cost.model_for(topology)``, a collective the first time).
        timeout: seconds ``cost.model_for``'s broadcast may take.

    Returns:
        The algorithm with the lowest predicted time; the earlier in the registry (``"flat"``) on a tie,
        and ``synth`` only where it is faster than every other by more than :data:`SYNTH_TIE`.
    """
    if not (topology.two_levels or (topology.is_uniform and uneven(topology))):
        return "flat"
    if model is None:
        model = cost.model_for(topology, timeout=timeout)
    if model.shared:
        return "flat"
    numels = [t.numel() for t in tensors]
    shapes = [tuple(t.shape) for t in tensors]
    itemsize = compute_dtype(tensors[0].dtype).itemsize
    options = [a for a in algorithms.candidates("allreduce", codec=True)
               if algorithms.get(a).supports(topology, "allreduce") is None and algorithms.get(a).considered(topology)]
    times = [predict(a, compressor, numels, shapes, itemsize, topology, model) for a in options]
    # Ties go to the earlier candidate in the registry (flat).
    best = min(range(len(options)), key=lambda i: (times[i], i))
    if options[best] == "synth":
        others = [t for a, t in zip(options, times) if a != "synth"]
        if others and min(others) <= times[best] * (1 + SYNTH_TIE):  # a tie: the group's own collectives
            return options[min(range(len(options)), key=lambda i: (options[i] == "synth", times[i], i))]
    return options[best]


def predict(algorithm: str, compressor: Codec, numels: list[int], shapes: list[tuple[int, ...]],
            itemsize: int, topology: Topology, model: cost.CostModel) -> float:
    """Predicted seconds of the compressed exchange of tensors of ``numels`` / ``shapes`` elements
    (computed in ``itemsize``-byte floats) with ``algorithm``: its ``compressed_cost``."""
    algo = algorithms.get(algorithm)
    if algo.scope != algorithms.GROUP_SCOPE or algo.codec_phase is None:
        known = algorithms.names("allreduce", codec=True)
        raise ValueError(f"compressed auto: no prediction for algorithm {algorithm!r}; one of {known}")
    return algo.compressed_cost(model, Encoding(compressor, numels, shapes, itemsize), topology)


def traffic(algorithm: str, compressor: Codec | None, numels: list[int], shapes: list[tuple[int, ...]], itemsize: int,
            topology: Topology, *, step: int) -> algorithms.Traffic:
    """What one reduction of tensors of ``numels`` / ``shapes`` elements (``itemsize``-byte floats)
    with ``algorithm`` moves at ``step``: the codec's encoded bytes where it is active at that step
    and worth it for these shapes, as the reduction decides, else (or with no codec) the exact
    all-reduce's."""
    algo = algorithms.get(algorithm)
    if compressor is not None and compressor.active(step) and compressor.worth(sum(numels), shapes):
        return algo.compressed_traffic(Encoding(compressor, numels, shapes, itemsize), topology)
    return algo.traffic("allreduce", sum(numels) * itemsize, topology)


class Encoding:
    """What ``compressor`` sends for tensors of ``numels`` / ``shapes`` elements computed in
    ``itemsize``-byte floats: an :class:`commopt.comm.algorithms.Encoded` for the algorithms'
    ``compressed_traffic`` and ``compressed_cost`` (the layout of ``layout.py``, the bytes of
    ``compressor.exchange_bytes``)."""

    def __init__(self, compressor: Codec, numels: list[int], shapes: list[tuple[int, ...]], itemsize: int) -> None:
        self.compressor, self.numels, self.shapes, self.itemsize = compressor, list(numels), list(shapes), itemsize

    @property
    def rounds(self) -> tuple[str, ...]:
        """The codec's rounds (``Codec.rounds``): an algorithm that routes them (synth) prices each by its
        collective."""
        return tuple(self.compressor.rounds)

    def _section(self, sections: int, section: int, ranks: int):
        return layout_for(self.compressor, self.numels, local_size=sections, local_rank=section, rail_size=ranks)

    def section_bytes(self, sections: int, section: int, ranks: int) -> float:
        s = self._section(sections, section, ranks)
        return float((s.hi - s.lo) * self.itemsize)

    def sent(self, sections: int, section: int, ranks: int) -> float:
        s = self._section(sections, section, ranks)
        return float(self.compressor.exchange_bytes(s.hi - s.lo, [self.shapes[i] for i in s.owned], ranks))
