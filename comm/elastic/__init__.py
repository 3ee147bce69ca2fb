"""commopt.comm.elastic: membership of replicas that may leave and rejoin (docs/architecture.md "elastic").

- :mod:`.protocol`: the fixed binary message format (struct, validated field by field, no pickle).
- :mod:`.coordinator`: :class:`Coordinator`, heartbeats, the generation counter and the member list,
  with its quorum rules (no split brain); ``commopt-bench coordinator`` runs one as its own process.
- :mod:`.client`: :class:`Membership`, a replica's join, heartbeat thread and generations;
  :class:`QuorumError` and :class:`CoordinatorError`.
"""

from __future__ import annotations

from .client import ENV_COORDINATOR, CoordinatorError, Membership, QuorumError, parse_address
from .coordinator import Coordinator, quorum

__all__ = ["Coordinator", "Membership", "QuorumError", "CoordinatorError", "ENV_COORDINATOR", "parse_address",
           "quorum"]
