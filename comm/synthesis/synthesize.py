"""``synthesize``: the schedule of a collective for a link map (docs/architecture.md, "the synthesizers
and the bound").

- star, all-reduce: the all-reduce with unequal shards (``star.py``; its pieces per shard chosen by
  simulated time);
- star, reduce-scatter or all-gather: TACOS with ports (``tacos.py``) or the direct equal-shard
  schedule, whichever simulates faster (on a star equal shards cannot beat a ring, research note A.6
  case 3, so this is "never worse");
- mesh: TACOS, the best of several seeds and chunk counts.
"""

from __future__ import annotations

from ..links import LinkMap
from .ir import Schedule
from .sim import simulate
from .star import direct_schedule, star_allreduce
from .tacos import DEFAULT_NBYTES, best_tacos

__all__ = ["synthesize", "normalize_collective"]

_NAMES = {"allreduce": "allreduce", "all_reduce": "allreduce", "reducescatter": "reducescatter",
          "reduce_scatter": "reducescatter", "allgather": "allgather", "all_gather": "allgather"}
#: Pieces per shard tried for the star all-reduce (more pipelines the two phases better, at alpha each).
STAR_PIECES = (1, 2, 4, 8, 16, 32)
#: Up to this many nodes every TACOS plan (4 seeds x chunks 1, 2, 4 per rank) is simulated.
SIMULATE_ALL = 8


def normalize_collective(collective: str) -> str:
    """The IR's name of ``collective`` ("all_reduce" -> "allreduce", ...); ``ValueError`` if unknown."""
    try:
        return _NAMES[collective]
    except KeyError:
        raise ValueError(f"synthesize: unknown collective {collective!r}; use one of {sorted(_NAMES)}") from None


def synthesize(collective: str, links: LinkMap, *, chunks: int | None = None, seed: int = 0,
               nbytes: int = DEFAULT_NBYTES) -> Schedule:
    """A schedule of ``collective`` for the nodes of ``links`` (rank i = node i), deterministic for its
    arguments.

    Args:
        collective: "allreduce" / "all_reduce", "reducescatter" / "reduce_scatter", "allgather" /
            "all_gather".
        links: the link map (a star of per-node port rates or a mesh of directed pair rates).
        chunks: pieces per shard (star all-reduce; each tried with and without serial sends) or chunks
            per rank (TACOS); None: the best by simulated time of pieces 1, 2, 4, ... 32 (at most ~4096
            messages) or of chunks 1, 2, 4 per rank.
        seed: the first TACOS seed tried (4 seeds up to 8 nodes; 2 above, where only the plans with
            the shortest makespan are simulated: 1 for all-reduce, 2 otherwise).
        nbytes: the buffer size the candidates are timed at (alpha against bytes / rate).

    Returns:
        The schedule (``check`` passes on it); ``meta["simulated_seconds"]`` is its simulated time at
        ``nbytes``.
    """
    coll = normalize_collective(collective)
    n = links.nodes
    if n < 1:
        raise ValueError(f"synthesize: the link map has {n} nodes")
    if n == 1:
        return Schedule(coll, 1, [1], [[]], name=f"{coll} on one rank", meta={"simulated_seconds": 0.0})
    if nbytes < 1:
        raise ValueError(f"synthesize: nbytes must be >= 1, got {nbytes}")
    ks = (chunks,) if chunks is not None else None
    cands: list[tuple[Schedule, float]] = []
    if links.kind == "star" and coll == "allreduce":
        for k in ks or _star_pieces(n):
            for serial in (False, True):
                s = star_allreduce(links, chunks_per_shard=k, serial=serial)
                cands.append((s, simulate(s, links, nbytes)))
    else:
        if links.kind == "star":  # first: a tie keeps the simpler schedule
            for k in ks or (1,):
                s = direct_schedule(coll, [1] * n, k, name=f"direct {coll} pieces={k}")
                cands.append((s, simulate(s, links, nbytes)))
        small = n <= SIMULATE_ALL  # above: the plans' makespans pick those simulated (the 1 s budget at 16 ranks)
        seeds = tuple(seed + i for i in range(4 if small else 2))
        cands.append(best_tacos(coll, links, chunks=ks or (1, 2, 4), seeds=seeds, nbytes=nbytes,
                                simulated=None if small else 1 if coll == "allreduce" else 2))
    best = min(t for _, t in cands)
    sched, t = next(st for st in cands if st[1] <= best * (1 + 1e-9))  # ties: the first (the simpler)
    sched.meta["simulated_seconds"] = t
    sched.meta["simulated_bytes"] = nbytes
    return sched


def _star_pieces(n: int) -> tuple[int, ...]:
    # At most ~4096 messages per schedule: the simulator and the executor walk every step.
    return tuple(k for k in STAR_PIECES if 2 * n * (n - 1) * k <= 4096) or (1,)

