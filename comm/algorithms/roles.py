"""The group roles: one name per phase that runs on a derived process group (docs/architecture.md section 3).

A role names the process groups ``Context.groups(topology, role)`` creates for one kind of phase:
this rank's node (``.intra``) and this rank's rail (``.rail``). Each phase role gets groups of its
own, so every engine queue has one feeder (section 3, rule 1). The names live here, once: the
algorithms that issue on these groups, the FSDP2 comms that run the same phases, and the code that
creates them up front (``fsdp.register``, ``Context.prepare``) all say the constant, never the
string, so that two users of one role cannot drift apart and two roles cannot collide.
"""

from __future__ import annotations

__all__ = [
    "HIER_REDUCE_SCATTER", "HIER_ALL_REDUCE", "HIER_ALL_GATHER", "HIER_RS_RAIL", "HIER_AG_RAIL", "HIER_AG_INTRA",
    "LEADER_REDUCE", "LEADER_ALL_REDUCE", "LEADER_BROADCAST",
    "A2A_INTRA", "A2A_INTER", "A2A_INTER_B", "A2A_META",
    "RAIL_ALL_REDUCE",
    "FSDP_QRS_INTRA", "FSDP_QRS_RAIL", "FSDP_QRS_FLAT", "FSDP_CHECK", "FSDP_HSDP", "FSDP_HSDP_RS", "FSDP_HSDP_AG",
    "FSDP_HSDP_ROLES", "COMPRESSED_CHECK", "DILOCO",
]

# hierarchical: the three all-reduce phases, then the reduce-scatter's and the all-gather's levels.
HIER_REDUCE_SCATTER = "hier-rs"
HIER_ALL_REDUCE = "hier-ar"
HIER_ALL_GATHER = "hier-ag"
HIER_RS_RAIL = "hier-rs-rail"
HIER_AG_RAIL = "hier-ag-rail"
HIER_AG_INTRA = "hier-ag-intra"

# leader: reduce to the node's first rank, all-reduce among the leaders, broadcast in the node.
LEADER_REDUCE = "leader-reduce"
LEADER_ALL_REDUCE = "leader-ar"
LEADER_BROADCAST = "leader-bcast"

# 2d all-to-all: the intra-node exchange, two alternating rail streams, the split metadata.
A2A_INTRA = "a2a-intra"
A2A_INTER = "a2a-inter"
A2A_INTER_B = "a2a-inter-b"
A2A_META = "a2a-meta"

# rail: the exact all-reduce over this rank's rail.
RAIL_ALL_REDUCE = "rail-ar"

# FSDP2 comms (``commopt.comm.fsdp``): the quantized reduce-scatter's two levels (intra-node, then
# the rail) or its one level over every rank, the finiteness check over every rank, and the HSDP
# hook's rail all-reduce with its two-shot quantized exchange (reduce-scatter, all-gather).
FSDP_QRS_INTRA = "fsdp-qrs-intra"
FSDP_QRS_RAIL = "fsdp-qrs-rail"
FSDP_QRS_FLAT = "fsdp-qrs-flat"
FSDP_CHECK = "fsdp-check"
FSDP_HSDP = "fsdp-hsdp"
FSDP_HSDP_RS = "fsdp-hsdp-rs"
FSDP_HSDP_AG = "fsdp-hsdp-ag"

#: The HSDP hook's rail roles, created together by ``fsdp.register``.
FSDP_HSDP_ROLES = (FSDP_HSDP, FSDP_HSDP_RS, FSDP_HSDP_AG)

# The compressed reduction (``compression.exchange``): the check phase over the reduced level. Its
# rounds' roles are derived from the codec's name (``cmp-<name>-<round>``), one family per codec.
COMPRESSED_CHECK = "cmp-check"

# DiLoCo (``schedules.diloco``): the worker's group (.intra: the inner DDP / FSDP2, the all-gather of
# the new global weights, the finiteness flag) and the rail (.rail: the exact outer all-reduce).
DILOCO = "diloco"
