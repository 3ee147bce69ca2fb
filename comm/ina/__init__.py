"""commopt.comm.ina: simulated in-network aggregation (SwitchML/SHARP-style).

- :mod:`.protocol`: the fixed binary packet format (struct, validated field by field, no pickle);
  the only module that knows header field offsets.
- :mod:`.switch`: the switch (slot pool with shadow copies, worker bitmaps, int32 sums);
  :mod:`.launcher`: its process (:class:`SwitchProcess`, the ``serve_main`` command line).
- :mod:`.bfp`: float <-> int32 block floating point with an agreed exponent.
- :mod:`.transport`: a worker's packets: the window, retransmission with back-off, the retry budget,
  segment reassembly.
- :mod:`.session`: :class:`InaSession` (join, agree, all-reduce), :func:`ina_all_reduce`, and the job
  identity a process group agrees on.
- :mod:`.faults`: seeded loss, bursts, duplication and reordering in each direction.
- :mod:`.backend`: the ``"ina"`` torch.distributed backend, registered on import (idempotent).

``all_reduce(..., algorithm="ina")`` is the algorithm object ``commopt.comm.algorithms.ina``, which
keeps one session per process group in the runtime context. Run a switch with
``commopt-bench ina-switch --host 127.0.0.1 --port 0`` (or :class:`SwitchProcess`).
"""

from __future__ import annotations

from .backend import BACKEND_NAME, InaOptions, InaProcessGroup, InaWork, parse_address, register_backend
from .bfp import dequantize, error_bound, quantize
from .faults import FaultConfig, FaultInjector, LinkFaults
from .launcher import SwitchProcess, query_stats
from .session import InaSession, ina_all_reduce
from .switch import Switch

__all__ = [
    "BACKEND_NAME",
    "InaOptions",
    "InaProcessGroup",
    "InaWork",
    "InaSession",
    "ina_all_reduce",
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
