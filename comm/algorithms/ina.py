"""``ina``: in-network aggregation through the simulated switch (``commopt.comm.ina``).

Each worker sends its buffer once to the switch, as int32 block-floating-point codes, and gets
the sum once: S per node link and direction instead of the ring's 2(p-1)/p S per ring edge. Sums
and averages only; the switch's address comes from the topology (``COMMOPT_INA_SWITCH``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from ..ina import ina_all_reduce_for
from ..topology import Topology
from ._transport import finish
from .base import SWITCH, Algorithm, Call, Traffic

if TYPE_CHECKING:
    from ..cost import CostModel

__all__ = ["Ina", "INA", "CODE_BYTES"]

CODE_BYTES = 4  # every element travels as one int32 code, whatever its dtype


class Ina(Algorithm):
    name = "ina"
    collectives = ("allreduce",)

    def traffic(self, collective: str, nbytes: float, topology: Topology, *, itemsize: int = 1) -> Traffic:
        t = Traffic(topology)
        if topology.world_size == 1 or not nbytes:
            return t
        codes = nbytes / max(1, itemsize) * CODE_BYTES if itemsize > 1 else nbytes
        for r in range(topology.world_size):
            t.add(r, SWITCH, codes)
            t.add(SWITCH, r, codes)
        return t

    def cost(self, model: CostModel, collective: str, nbytes: float, topology: Topology) -> float:
        if topology.world_size == 1 or not nbytes:
            return 0.0
        return model.inter.time(2 * self.traffic(collective, nbytes, topology).link_bytes(), 2)

    def all_reduce(self, call: Call) -> torch.futures.Future:
        return ina_all_reduce_for(call.prepared, call.red, call.group, call.topology, call.timeout, finish=finish,
                                  sessions=call.context.ina_sessions)


INA = Ina()
