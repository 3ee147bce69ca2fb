"""commopt.comm.ina: simulated in-network aggregation (SwitchML/SHARP-style).

- :mod:`.protocol`: the fixed binary packet format (struct, validated field by field, no pickle).
- :mod:`.switch`: the switch process (slot pool with shadow copies, worker bitmaps, int32 sums).
- :mod:`.worker`: :class:`InaSession` and :func:`ina_all_reduce` (block floating point, a window of
  packets, retransmission with back-off, a bounded retry budget).
- :mod:`.faults`: seeded loss, bursts, duplication and reordering in each direction.
- :mod:`.backend`: the ``"ina"`` torch.distributed backend, registered on import (idempotent).

Run a switch with ``commopt-bench ina-switch --host 127.0.0.1 --port 0`` (or :class:`SwitchProcess`).
"""

from __future__ import annotations

from .backend import BACKEND_NAME, InaOptions, InaProcessGroup, parse_address, register_backend
from .faults import FaultConfig, FaultInjector, LinkFaults
from .switch import Switch, SwitchProcess, query_stats
from .worker import InaSession, dequantize, error_bound, ina_all_reduce, ina_all_reduce_for, quantize

__all__ = [
    "BACKEND_NAME",
    "InaOptions",
    "InaProcessGroup",
    "InaSession",
    "ina_all_reduce",
    "ina_all_reduce_for",
    "quantize",
    "dequantize",
    "error_bound",
    "Switch",
    "SwitchProcess",
    "query_stats",
    "FaultConfig",
    "FaultInjector",
    "LinkFaults",
    "parse_address",
    "register_backend",
]

register_backend()
