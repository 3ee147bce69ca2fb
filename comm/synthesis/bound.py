"""``bound``: a lower bound on the time of any schedule of a collective over a link map: the cut bound
(ForestColl, arXiv 2402.06787 / 2305.18461; research note synthesis_landscape.md A.2 and A.6;
docs/architecture.md, "the synthesizers and the bound").

For a set S of nodes, neither empty nor all, let out(S) be the capacity (bytes/s) of the fabric from S to
the other nodes and in(S) the capacity into S. On a mesh out(S) is the sum of the directed links leaving
S. On a star the switch is a vertex too; a cut puts it on one side or the other, so out(S) =
min(sum of up_i over S, sum of down_j outside S), the smaller of the two ways to separate S (the bound
maximises over cuts, so it takes the tighter capacity: ForestColl's switch vertices, A.2).

- **all-gather**: every node of S owns its shard, which every node outside S must receive; those bytes
  cross from S to the rest at least once, so T >= (bytes of S's shards) / out(S);
- **reduce-scatter**: the reverse: every shard of a node of S needs the contributions of the nodes
  outside S; for each of its elements something derived from them (a contribution or a partial sum)
  enters S at least once, so T >= (bytes of S's shards) / in(S);
- **all-reduce**: every element needs the contributions of S and of the rest, and its sum must be known
  on both sides. Wherever the sum is first completed, for each element at least one value crosses out
  of S and at least one crosses into S (a partial sum of S's side leaves, or the sum computed in S
  leaves; and symmetrically in), so T >= nbytes / out(S) and T >= nbytes / in(S).

The bound is the largest of these over all S (2^N - 2 sets, vectorised; all of them for N <= 16, for
larger N only the single nodes and their complements, still a valid but weaker bound), and of one
more, the **volume**: every byte a schedule moves takes one up and one down port (star) or one link
(mesh), so T >= (bytes moved) / (the fabric's total capacity: min(sum up, sum down), or the sum of
the links). All-gather and reduce-scatter move each element at least N - 1 times (N - 1 nodes receive
it; N - 1 nodes' contributions leave them); all-reduce at least 2 (N - 1) times: an element's value
must come to depend on all N inputs at every node, which is gossiping, and gossip with one-way
messages takes at least 2N - 2 of them (the first node to depend on all inputs needs a message from
each of the N - 1 others before, each of the N - 1 others one more after). On a uniform star the
volume bound is the ring's 2 (N - 1)/N S / r, the cuts only S / r.

It counts bandwidth only (no alpha) and assumes no reduction inside the network (none exists here) and
no compression. The shards are the IR's equal shards: shard r spans bytes [n r // N, n (r + 1) // N).

It is what no schedule beats, not what one reaches: on the star 200/200/50 Mbit the all-reduce bound is
S / r_slow, which the unequal-shard schedule attains (A.6 case 2); on the triangle A-B 200, B-C 200, A-C
50 Mbit the all-gather bound is M / 375 (Mbit, seconds; the cut {A, B} with 2M/3 leaving over 250), and
the all-reduce bound M / 225 (the volume: 4M over 900 of links; its best cut gives M / 250), below the
2M / 375 of a reduce-scatter then an all-gather.
"""

from __future__ import annotations

import torch

from ..links import LinkMap
from .synthesize import normalize_collective

__all__ = ["bound", "cut_capacities", "ENUMERATE_MAX"]

#: The most nodes whose every subset is enumerated (2^16 sets: milliseconds, vectorised).
ENUMERATE_MAX = 16


def _subsets(n: int) -> torch.Tensor:
    """Rows of 0/1 membership (float64) of the node sets considered: all proper non-empty subsets for
    n <= ENUMERATE_MAX, else the singletons and their complements."""
    if n <= ENUMERATE_MAX:
        ids = torch.arange(1, (1 << n) - 1, dtype=torch.int64)
        return ((ids.unsqueeze(1) >> torch.arange(n)) & 1).to(torch.float64)
    eye = torch.eye(n, dtype=torch.float64)
    return torch.cat([eye, 1 - eye])


def cut_capacities(links: LinkMap, members: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """out(S) and in(S) in bytes/s for each row of ``members`` (0/1 membership over the nodes)."""
    inside, outside = members, 1 - members
    if links.kind == "star":
        up = torch.tensor(links.up, dtype=torch.float64)
        down = torch.tensor(links.down, dtype=torch.float64)
        out = torch.minimum(inside @ up, outside @ down)
        into = torch.minimum(outside @ up, inside @ down)
        return out, into
    n = links.nodes
    rate = torch.zeros(n, n, dtype=torch.float64)
    for i, j, r in links.pairs:
        rate[i, j] += r
    out = ((inside @ rate) * outside).sum(1)  # from a node of S to a node outside
    into = ((outside @ rate) * inside).sum(1)
    return out, into


def bound(collective: str, links: LinkMap, nbytes: int) -> float:
    """A lower bound in seconds on any schedule of ``collective`` on ``links`` for a buffer of ``nbytes``
    bytes (module docstring: what it bounds and why it is valid).

    Args:
        collective: "allreduce" / "all_reduce", "reducescatter" / "reduce_scatter", "allgather" /
            "all_gather".
        links: the link map (star or mesh).
        nbytes: the collective's buffer: the all-reduce's tensor, the reduce-scatter's input (all N
            shards), the all-gather's output.

    Returns:
        The bound; 0 for one node or an empty buffer.

    Raises:
        ValueError: an unknown collective, or a fabric in which some set of nodes cannot send to or
            receive from the rest (no schedule exists).
    """
    coll = normalize_collective(collective)
    n = links.nodes
    if n < 2 or nbytes <= 0:
        return 0.0
    members = _subsets(n)
    out, into = cut_capacities(links, members)
    if coll == "allreduce":
        need_out = need_in = torch.full((members.shape[0],), float(nbytes), dtype=torch.float64)
    else:
        shard = torch.tensor([nbytes * (r + 1) // n - nbytes * r // n for r in range(n)], dtype=torch.float64)
        held = members @ shard
        need_out, need_in = (held, torch.zeros_like(held)) if coll == "allgather" else (torch.zeros_like(held), held)
    if bool(((need_out > 0) & (out <= 0)).any() or ((need_in > 0) & (into <= 0)).any()):
        raise ValueError(f"bound: in the link map {links.to_dict()} some set of nodes has no link out or in: no "
                         f"schedule of {coll} exists")
    t_out = torch.where(need_out > 0, need_out / out.clamp_min(1e-300), torch.zeros_like(out))
    t_in = torch.where(need_in > 0, need_in / into.clamp_min(1e-300), torch.zeros_like(into))
    total = min(sum(links.up), sum(links.down)) if links.kind == "star" else sum(r for _, _, r in links.pairs)
    volume = (2 if coll == "allreduce" else 1) * (n - 1) * nbytes / total
    return max(float(torch.maximum(t_out, t_in).max()), volume)
