"""``algorithm="auto"`` with a compressor: the candidate the cost model predicts fastest.

The candidates are the registry's automatic algorithms that can carry a compressor
(``algorithms.candidates("allreduce", codec=True)``: flat and hierarchical), each predicted by its
``codec_phase``. The hierarchical exchange compresses only its inter-node phase: the intra-node reduce-scatter and
all-gather move the uncompressed shard. The flat exchange compresses everything, over a ring that
crosses the node links. So, for the staged vector of ``S`` bytes (``layout.py``):

- flat: the compressor's payload over all p ranks (``compressor.exchange_bytes``), as the flat
  all-reduce that sends as many bytes per rank (``algorithms.get("flat").cost``);
- hierarchical: the exact hierarchical all-reduce of ``S`` in one chunk (the compressed exchange
  does not pipeline), ``algorithms.get("hierarchical").cost``, under the model whose inter-node
  level carries the compressed bytes instead of the exact ones: its beta scaled by the ratio of
  the bytes every local rank's rail payload puts on the node link (each local rank's own section
  for matrix compressors) to the bytes the exact rail all-reduce puts there.

``flat`` where the model's levels share one resource (``model.shared``: loopback, where the
hierarchy only adds phases), and where the topology has one level. The model is
``cost.model_for(topology)`` (an explicit model, the cached calibration, the configured link rate,
or the documented defaults), which rank 0 broadcasts once per topology; the rest depends only on
shapes: every rank chooses the same (docs/architecture.md section 3, rule 2).
"""

from __future__ import annotations

import dataclasses

import torch

from .. import algorithms, cost
from ..links import ALGORITHM_FACTORS
from ..topology import Topology
from .codec import Codec, compute_dtype
from .layout import layout_for

__all__ = ["choose", "predict"]


def choose(compressor: Codec, tensors: list[torch.Tensor], topology: Topology, *,
           model: cost.CostModel | None = None, timeout: float | None = None) -> str:
    """The algorithm (``"flat"`` or ``"hierarchical"``) for reducing ``tensors`` through ``compressor`` on ``topology``.

    Args:
        compressor: the compressor.
        tensors: the tensors of one reduction (their shapes and dtype count, not their values).
        topology: the layout of the group reduced over.
        model: the level model (None: ``cost.model_for(topology)``, a collective the first time).
        timeout: seconds ``cost.model_for``'s broadcast may take.

    Returns:
        The algorithm with the lowest predicted time; the earlier in the registry (``"flat"``) on a tie.
    """
    if not topology.two_levels:
        return "flat"
    if model is None:
        model = cost.model_for(topology, timeout=timeout)
    if model.shared:
        return "flat"
    numels = [t.numel() for t in tensors]
    shapes = [tuple(t.shape) for t in tensors]
    itemsize = compute_dtype(tensors[0].dtype).itemsize
    options = [a for a in algorithms.candidates("allreduce", codec=True)
               if algorithms.get(a).supports(topology, "allreduce") is None]
    times = [predict(a, compressor, numels, shapes, itemsize, topology, model) for a in options]
    # Ties go to the earlier candidate in the registry (flat).
    return options[min(range(len(options)), key=lambda i: (times[i], i))]


def predict(algorithm: str, compressor: Codec, numels: list[int], shapes: list[tuple[int, ...]],
            itemsize: int, topology: Topology, model: cost.CostModel) -> float:
    """Predicted seconds of the compressed exchange of tensors of ``numels`` / ``shapes`` elements
    (computed in ``itemsize``-byte floats) with ``algorithm`` (see the module docstring)."""
    p, local, nodes = topology.world_size, topology.local_size, topology.num_nodes
    algo = algorithms.get(algorithm)
    if algo.scope != algorithms.GROUP_SCOPE or algo.codec_phase is None:
        known = algorithms.names("allreduce", codec=True)
        raise ValueError(f"compressed auto: no prediction for algorithm {algorithm!r}; one of {known}")
    if algo.codec_phase == algorithms.ALL_PHASES:
        total = layout_for(compressor, numels, local_size=1, local_rank=0, rail_size=p).total
        sent = compressor.exchange_bytes(total, shapes, p)
        return algo.cost(model, "allreduce", sent / ALGORITHM_FACTORS["allreduce"](p), topology)
    compressed = 0
    for j in range(local):  # every local rank's rail leaves the node through its link
        section = layout_for(compressor, numels, local_size=local, local_rank=j, rail_size=nodes)
        compressed += compressor.exchange_bytes(section.hi - section.lo, [shapes[i] for i in section.owned], nodes)
    nbytes = section.total * itemsize
    exact = algo.link_bytes("allreduce", nbytes, topology)
    if not exact:
        return 0.0
    inter = dataclasses.replace(model.inter, beta=model.inter.beta * compressed / exact)
    return algo.cost(dataclasses.replace(model, inter=inter, chunks=1), "allreduce", nbytes, topology)
