"""commopt.comm.synthesis: collective schedules synthesized for the links a cluster really has
(docs/architecture.md, "synthesized collectives"; issue 40).

- the IR (:class:`Schedule`, :class:`Step`; JSON with MSCCL++-like names) and its checker
  (:func:`check`: the postcondition, the send/recv pairing, no race, no deadlock; a
  :class:`ScheduleError` names the broken condition);
- :func:`execute`: a schedule of one's own run on a process group;
- :func:`from_msccl_xml`: msccl-tools / MSCCLang XML programs, made runnable from PyTorch on any backend;
- the synthesizers behind :func:`synthesize`: the unequal-shard all-reduce for stars and TACOS's greedy
  link-chunk matching for meshes (pure Python, no solver);
- :func:`simulate` (a schedule's time on a link map) and :func:`bound` (the cut bound no schedule beats).

``all_reduce / reduce_scatter / all_gather(..., algorithm="synth")`` run them
(``comm/algorithms/synth.py``); ``auto`` weighs it where ``Topology.links`` shows links that differ.
"""

from __future__ import annotations

from .bound import bound
from .check import check
from .execute import execute
from .ir import Schedule, ScheduleError, Step
from .msccl import from_msccl_xml
from .sim import simulate
from .synthesize import synthesize

__all__ = ["Schedule", "Step", "ScheduleError", "check", "execute", "from_msccl_xml", "simulate", "bound",
           "synthesize"]
