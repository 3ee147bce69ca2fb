"""commopt.comm: topology, the comm engine, collectives, compression, hooks, in-network aggregation.

Re-exports the public entry points (docs/architecture.md section 2.1): ``Topology``, ``all_reduce``, ``reduce_scatter``,
``all_gather``, ``all_to_all``, ``destroy``, ``calibrate_links`` (the link map of a cluster whose links
differ), and the submodules ``hooks``, ``compression``, ``errors`` and ``cost``.
"""

from __future__ import annotations

from . import algorithms, compression, cost, errors, hooks
from .alltoall import all_to_all
from .collectives import all_gather, all_reduce, reduce_scatter
from .linkprobe import calibrate_links
from .runtime import context, destroy
from .topology import Topology

__all__ = ["Topology", "all_reduce", "reduce_scatter", "all_gather", "all_to_all", "context", "destroy", "hooks",
           "compression", "errors", "cost", "algorithms", "calibrate_links"]
