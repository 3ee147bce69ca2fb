"""``commopt-bench cluster``: an emulated multi-node cluster on one Linux box (docs/architecture.md section 5.9).

One network namespace per node, joined to a fabric by a tbf-shaped link (a star), or to every other
node by one (a mesh), loopback inside a node. By concern: ``fabric`` (the configured links and their
options: :class:`Fabric`), ``netns`` (the namespaces, links and processes: :class:`Cluster`), ``host``
(what the cluster needs of the host, and what dead runs left on it), ``probe`` (the link-rate probe, a module run with
``python -m``), ``launch`` (the ranks, their environments and output) and ``cli`` (``main``).
Importing this package imports no torch: the probe agent runs inside it, in every node.
"""

from __future__ import annotations

from ._proc import ClusterError
from .cli import main
from .fabric import Fabric, parse_fabric
from .host import (
    CAP_NET_ADMIN,
    CAP_SYS_ADMIN,
    check_requirements,
    cleanup_leftovers,
    leftover_prefixes,
    list_namespaces,
    missing_requirements,
    parse_cap_eff,
    wire_bytes,
)
from .launch import place_ranks, rank_environments, run_ranks
from .netns import Cluster, parse_rate
from .probe import LinkProbe

__all__ = [
    "CAP_NET_ADMIN",
    "CAP_SYS_ADMIN",
    "Cluster",
    "ClusterError",
    "Fabric",
    "LinkProbe",
    "check_requirements",
    "cleanup_leftovers",
    "leftover_prefixes",
    "wire_bytes",
    "list_namespaces",
    "main",
    "missing_requirements",
    "parse_cap_eff",
    "parse_fabric",
    "parse_rate",
    "place_ranks",
    "rank_environments",
    "run_ranks",
]
