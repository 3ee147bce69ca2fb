"""Alpha-beta cost model per link level, used by ``algorithm="auto"`` and by every benchmark.

A message of ``S`` bytes over a link costs ``alpha + S * beta``. Two levels: ``intra`` (inside a
node: NVLink, loopback) and ``inter`` (the node's NIC). Every rank of a node shares its NIC, so the
inter-node time of an algorithm is the bytes it pushes through one node's link times ``beta``: this
is what makes the hierarchical all-reduce win (2(N-1)/N S per node link instead of 2(p-1)/p S per
ring edge, and the ring crosses the node boundary once per node only with contiguous placement).

``auto`` takes, in order: an explicit :class:`CostModel`, the cached calibration of this layout
(:func:`calibrate`), the configured link rate of the emulated cluster, documented defaults
(:data:`DEFAULT_INTRA`, :data:`DEFAULT_INTER`). Whatever the source, rank 0's model is broadcast
once per topology so every rank chooses the same algorithm (DESIGN 2, rule 2).
"""

from __future__ import annotations

import json
import math
import os
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from .topology import _REGISTRY, Topology, setup_wait

__all__ = [
    "LinkModel",
    "CostModel",
    "DEFAULT_INTRA",
    "DEFAULT_INTER",
    "predict",
    "link_bytes",
    "choose",
    "fit",
    "calibrate",
    "model_for",
    "ALGORITHM_FACTORS",
    "COPY_BETA",
    "alltoall_chunks",
]


@dataclass(frozen=True)
class LinkModel:
    """One link level. ``alpha``: seconds per message; ``beta``: seconds per byte."""

    alpha: float
    beta: float

    def time(self, nbytes: float, messages: float = 1.0) -> float:
        return messages * self.alpha + nbytes * self.beta

    @property
    def bandwidth(self) -> float:
        """Bytes per second."""
        return 1.0 / self.beta


@dataclass(frozen=True)
class CostModel:
    """The two levels of a topology, and the pipelining depth of the hierarchical algorithms."""

    intra: LinkModel
    inter: LinkModel
    chunks: int = 8  # the most chunks a pipelined all-reduce is cut into (see chunks_for)
    #: The two levels share one resource, or the node link is no slower than the intra-node level
    #: (measured by :func:`calibrate`; loopback, where every "link" is the same few cores). The
    #: hierarchy then moves the same bytes as flat in more phases and cannot win: ``choose`` picks flat.
    shared: bool = False

    def to_dict(self) -> dict:
        return {"intra": asdict(self.intra), "inter": asdict(self.inter), "chunks": self.chunks,
                "shared": self.shared}

    @classmethod
    def from_dict(cls, d: dict) -> CostModel:
        chunks = int(d.get("chunks", 8))
        # Caches written before the flag: one chunk was set only when the levels shared a resource.
        return cls(LinkModel(**d["intra"]), LinkModel(**d["inter"]), chunks, bool(d.get("shared", chunks == 1)))


# Defaults when nothing was measured: gloo over loopback inside a node (~20 us, ~3 GB/s), and a
# 10 Gbit/s NIC between nodes (~50 us, 1.25 GB/s).
DEFAULT_INTRA = LinkModel(alpha=20e-6, beta=1 / 3e9)
DEFAULT_INTER = LinkModel(alpha=50e-6, beta=1 / 1.25e9)

# Seconds to hand a phase from one engine worker thread to the next (a queue put and a thread
# wake-up on a busy host). Charged per phase of a pipelined chunk: on equal levels it makes one chunk
# (which a blocking call runs on its own thread, with no hand-off) the choice, and it is negligible
# against the inter-node time that pipelining hides on a real link.
PHASE_HANDOFF = 0.2e-3

# Seconds per byte of a local copy (the permutes of the 2-D all-to-all): host memory, ~10 GB/s.
COPY_BETA = 1 / 10e9

# Per-rank traffic of ring-based collectives on p ranks, as a fraction of the buffer: used by the
# byte counters and the nccl-tests "bus bandwidth" (busbw = algbw * factor).
ALGORITHM_FACTORS = {
    "allreduce": lambda p: 2 * (p - 1) / p,
    "reduce_scatter": lambda p: (p - 1) / p,
    "all_gather": lambda p: (p - 1) / p,
    "alltoall": lambda p: (p - 1) / p,
}


def _ring_crossings(topo: Topology) -> int:
    """The most ring edges (r -> r+1 mod p) that leave one node: the load on its NIC."""
    p = topo.world_size
    worst = 0
    for node in topo.nodes:
        members = set(node)
        worst = max(worst, sum(1 for r in node if (r + 1) % p not in members))
    return worst


def link_bytes(algorithm: str, nbytes: float, topo: Topology, op: str = "allreduce") -> float:
    """Bytes one node's link carries in each direction for ``op`` of an ``nbytes`` buffer.

    For reduce-scatter and all-gather, ``nbytes`` is the size of the whole (world-sized) buffer.
    """
    p, n = topo.world_size, topo.num_nodes
    if n == 1 or p == 1:
        return 0.0
    local = max(len(nd) for nd in topo.nodes)
    if algorithm in ("flat", "ina"):
        if algorithm == "ina":
            # Each worker sends its buffer once to the switch and gets the result once.
            return nbytes * local if op == "allreduce" else 0.0
        ring = ALGORITHM_FACTORS[op](p) if op != "alltoall" else 1.0
        if op == "alltoall":
            # Every rank sends (p - L)/p of its buffer off-node.
            return nbytes * local * (p - local) / p
        return _ring_crossings(topo) * ring * nbytes
    if algorithm == "hierarchical":
        if op == "allreduce":
            return 2 * (n - 1) / n * nbytes
        return (n - 1) / n * nbytes  # rail phase on 1/L of the data, L rails per node
    if algorithm == "leader":
        return 2 * (n - 1) / n * nbytes
    if algorithm == "2d":
        return nbytes * local * (p - local) / p
    raise ValueError(f"no link model for algorithm {algorithm!r}")


def predict(algorithm: str, nbytes: float, topo: Topology, model: CostModel | None = None,
            op: str = "allreduce") -> float:
    """Predicted seconds of ``op`` with ``algorithm`` on ``nbytes`` (the per-rank buffer for
    all-reduce; the whole world-sized buffer for reduce-scatter and all-gather).

    Phases: flat = one ring over p ranks, bottlenecked by the busiest node link; hierarchical =
    (1) intra reduce-scatter, (2) inter all-reduce on 1/L of the data per rail, all rails sharing the
    node link, (3) intra all-gather, pipelined over ``model.chunks`` chunks; leader = (1) intra
    reduce to the leader, (2) leaders' all-reduce, (3) intra broadcast.
    """
    model = model or CostModel(DEFAULT_INTRA, DEFAULT_INTER)
    p, n = topo.world_size, topo.num_nodes
    if p == 1 or nbytes == 0:
        return 0.0
    ia, ea = model.intra, model.inter
    local = max(len(nd) for nd in topo.nodes)
    rounds = 2 if op == "allreduce" else 1
    if algorithm == "flat":
        if n == 1:
            return ia.time(ALGORITHM_FACTORS[op](p) * nbytes, rounds * (p - 1))
        worst_alpha = max(ia.alpha, ea.alpha)
        return rounds * (p - 1) * worst_alpha + max(
            ALGORITHM_FACTORS[op](p) * nbytes * ia.beta, link_bytes("flat", nbytes, topo, op) * ea.beta)
    if algorithm == "hierarchical" and op != "allreduce":
        intra = ia.time((local - 1) / local * nbytes, local - 1) if local > 1 else 0.0
        return intra + (ea.time(link_bytes(algorithm, nbytes, topo, op), n - 1) if n > 1 else 0.0)
    if algorithm in ("hierarchical", "leader"):
        return _pipeline_time(algorithm, nbytes, topo, model, chunks_for(algorithm, nbytes, topo, model))
    if algorithm == "ina":
        return ea.time(2 * nbytes * local, 2)
    if algorithm == "2d" and op == "alltoall":
        return _alltoall_2d(nbytes, topo, model, alltoall_chunks(nbytes, topo, model))
    raise ValueError(f"no cost formula for algorithm {algorithm!r}")


def _alltoall_2d(nbytes: float, topo: Topology, model: CostModel, chunks: int) -> float:
    """The 2-D all-to-all of an ``nbytes`` per-rank buffer cut into ``chunks`` pipelined chunks.

    Phases: a local permute (one copy), then per chunk (1) intra-node exchange of (L-1)/L of the chunk
    in L-1 messages plus the permute between the phases, (2) inter-node exchange along the rail in N-1
    messages, all rails sharing the node link; the chunks pipeline, so the time is the sum of the
    stages plus (chunks-1) times the slower one; then the final permute (one copy).
    """
    n = topo.num_nodes
    local = max(len(nd) for nd in topo.nodes)
    c = nbytes / chunks
    intra = model.intra.time((local - 1) / local * c, local - 1) + c * COPY_BETA if local > 1 else 0.0
    inter = model.inter.time(link_bytes("2d", c, topo, "alltoall"), n - 1) if n > 1 else 0.0
    handoffs = 2 * chunks * PHASE_HANDOFF if chunks > 1 else 0.0  # a blocking single chunk runs inline
    return 2 * nbytes * COPY_BETA + intra + inter + (chunks - 1) * max(intra, inter) + handoffs


def alltoall_chunks(nbytes: float, topo: Topology, model: CostModel) -> int:
    """The pipelining depth (1..``model.chunks``) the model predicts fastest for a 2-D all-to-all
    of ``nbytes`` per rank: more chunks hide the intra-node phase, each costs N-1 + L-1 more messages.
    """
    best = min(range(1, max(1, model.chunks) + 1), key=lambda k: (_alltoall_2d(nbytes, topo, model, k), k))
    return best


def _pipeline_time(algorithm: str, nbytes: float, topo: Topology, model: CostModel, chunks: int) -> float:
    ia, ea = model.intra, model.inter
    n = topo.num_nodes
    local = max(len(nd) for nd in topo.nodes)
    c = nbytes / chunks
    if algorithm == "hierarchical":
        intra = ia.time((local - 1) / local * c, local - 1) if local > 1 else 0.0
        inter = ea.time(link_bytes("hierarchical", c, topo), 2 * (n - 1)) if n > 1 else 0.0
    else:
        steps = math.ceil(math.log2(local)) if local > 1 else 0
        intra = ia.time(c * steps, steps)
        inter = ea.time(link_bytes("leader", c, topo), 2 * (n - 1)) if n > 1 else 0.0
    # Chunks overlap across levels only: a chunk's reduce-scatter (or reduce) and another chunk's
    # all-gather (or broadcast) share the intra-node link, so the bottleneck per extra chunk is the
    # busier of the intra-node link (both intra phases) and the inter-node link.
    handoffs = 3 * chunks * PHASE_HANDOFF if chunks > 1 else 0.0
    return (intra + inter + intra) + (chunks - 1) * max(2 * intra, inter) + handoffs


def chunks_for(algorithm: str, nbytes: float, topo: Topology, model: CostModel) -> int:
    """How many chunks to pipeline a hierarchical or leader all-reduce over (at most
    ``model.chunks``): the count with the lowest predicted time. Pipelining pays only when one
    level is slower than the other; on equal levels the extra phases' latency makes one chunk best.
    """
    options = [c for c in (1, 2, 4, 8, 16) if c <= max(1, model.chunks)]
    return min(options, key=lambda c: (_pipeline_time(algorithm, nbytes, topo, model, c), c))


def choose(candidates: list[str], nbytes: float, topo: Topology, model: CostModel,
           op: str = "allreduce") -> str:
    """The candidate with the lowest predicted time (ties go to the earlier candidate); ``flat``
    where the model's levels share one resource (``model.shared``: the hierarchy only adds phases)."""
    if model.shared and "flat" in candidates and op != "alltoall":
        return "flat"
    return min(candidates, key=lambda a: (predict(a, nbytes, topo, model, op), candidates.index(a)))


def fit(sizes: list[float], times: list[float], *, messages: float = 1.0,
        bytes_factor: float = 1.0) -> LinkModel:
    """Least-squares ``alpha``, ``beta`` from measured ``times`` of ``sizes`` (bytes).

    The model fitted is ``t = messages * alpha + bytes_factor * S * beta``: pass the algorithm's
    message count and byte factor (a ring all-reduce on p ranks: ``2(p-1)`` and ``2(p-1)/p``).
    Negative estimates (noise at small sizes) are clamped to zero / a tiny positive beta.
    """
    if len(sizes) != len(times) or len(sizes) < 2:
        raise ValueError(f"fit needs at least two (size, time) pairs, got {len(sizes)} sizes and "
                         f"{len(times)} times")
    a = torch.tensor([[messages, bytes_factor * s] for s in sizes], dtype=torch.float64)
    b = torch.tensor(times, dtype=torch.float64).unsqueeze(1)
    sol = torch.linalg.lstsq(a, b).solution.squeeze(1)
    alpha, beta = float(sol[0]), float(sol[1])
    return LinkModel(alpha=max(alpha, 0.0), beta=max(beta, 1e-15))


def _cache_path(topo: Topology, cache_dir: str | os.PathLike | None) -> Path:
    root = Path(cache_dir) if cache_dir else Path.home() / ".cache" / "commopt"
    rate = f"-{int(topo.link_rate_bps)}" if topo.link_rate_bps else ""
    return root / f"calibration-{topo.layout.replace(';', '_').replace(',', '.')}{rate}.json"


def _time_allreduce(group, nbytes: int, reps: int, sync_group) -> float | None:
    """Median time of an all-reduce of ``nbytes`` on ``group`` (None: this rank only keeps step).

    A barrier on the topology's whole group precedes every repetition, so that every rail (or every
    node) runs at the same time, as in a real hierarchical phase.
    """
    t = torch.ones(max(1, nbytes // 4), dtype=torch.float32)
    if group is not None:
        dist.all_reduce(t, group=group)  # warm-up: connections, allocation
    times = []
    for _ in range(reps):
        dist.barrier(group=sync_group)
        if group is None:
            continue
        start = time.perf_counter()
        dist.all_reduce(t, group=group)
        times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2] if times else None


def _time_both(intra, rail, nbytes: int, reps: int, sync_group) -> float | None:
    """Median time of an intra-node and a rail all-reduce of ``nbytes`` each, issued at once from
    two threads (the two levels of one pipelined step). None where a level is missing."""
    if intra is None or rail is None:
        for _ in range(reps):
            dist.barrier(group=sync_group)
        return None
    a, b = (torch.ones(max(1, nbytes // 4), dtype=torch.float32) for _ in range(2))
    times = []
    for _ in range(reps):
        dist.barrier(group=sync_group)
        start = time.perf_counter()
        side = threading.Thread(target=dist.all_reduce, args=(a,), kwargs={"group": intra}, daemon=True)
        side.start()
        dist.all_reduce(b, group=rail)
        side.join()
        times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2]


def calibrate(topology: Topology, *, cache_dir: str | os.PathLike | None = None,
              sizes: tuple[int, int] = (64 << 10, 4 << 20), reps: int = 5) -> CostModel:
    """Measure this machine's two levels (about a second) and cache the result per layout.

    The large size (4 MiB) is well past a shaped link's burst allowance, so the fit sees the
    sustained rate, not the token bucket's head start.

    Collective over the topology's group: every rank times all-reduces on its intra-node and rail
    groups at two sizes; rank 0's fit is broadcast so that all ranks hold the same model, and rank
    0 writes it to ``~/.cache/commopt`` (or ``cache_dir``).

    It also times both levels at once: pipelining chunks pays only when one level's transfer hides
    behind the other's. Where the levels take comparable times alone (within 5x) and together more
    than the slower one plus half the faster one (loopback: every "link" is the same few cores), they
    share one resource: the model keeps one chunk (``chunks=1``) and says so (``shared``), and ``auto``
    then runs flat (the hierarchy moves the same bytes in more phases).
    """
    groups = topology.groups("calibrate")
    levels, large = {}, {}
    for name, group, size in (("intra", groups.intra, topology.local_size),
                              ("inter", groups.rail, len(groups.rail_ranks))):
        if size < 2:
            group = None  # still keeps step with the barriers of the ranks that measure
        times = [_time_allreduce(group, s, reps, topology.group) for s in sizes]
        if group is None:
            levels[name] = None
            continue
        large[name] = times[-1]
        # Every rail is timed at the same time, as in a real hierarchical phase, so one rail's
        # bytes/s is the node link's share: the node link carries local_size times that.
        share = topology.local_size if name == "inter" else 1
        levels[name] = fit(list(sizes), times, messages=2 * (size - 1), bytes_factor=2 * (size - 1) / size * share)
    both = _time_both(groups.intra if topology.local_size > 1 else None,
                      groups.rail if len(groups.rail_ranks) > 1 else None, sizes[-1], reps, topology.group)
    chunks, shared = CostModel.chunks, False
    slow, fast = max(large.values(), default=0.0), min(large.values(), default=0.0)
    # Judged only on comparable levels: next to a level five times slower, the fast one's time is
    # within the slow one's noise (and pipelining there costs little).
    if both is not None and fast >= 0.2 * slow and both > slow + 0.5 * fast:
        chunks, shared = 1, True
    # A node link no slower than the intra-node level (loopback, where the rails' concurrent
    # transfers even look faster than one intra-node pair): the hierarchy saves nothing there. The
    # timing test above alone missed it in one of two calibrations of the same logical 2x2.
    if levels["intra"] is not None and levels["inter"] is not None and levels["inter"].beta <= levels["intra"].beta:
        shared = True
    model = CostModel(levels["intra"] or DEFAULT_INTRA, levels["inter"] or _inter_default(topology), chunks,
                      shared)
    model = _broadcast_model(model, topology)
    if topology.rank == 0:
        path = _cache_path(topology, cache_dir)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(model.to_dict()))
    _REGISTRY.models[(topology.layout, id(topology.group))] = model
    return model


def _inter_default(topo: Topology) -> LinkModel:
    if topo.link_rate_bps:
        return LinkModel(alpha=DEFAULT_INTER.alpha, beta=8.0 / topo.link_rate_bps)
    return DEFAULT_INTER


def _broadcast_model(model: CostModel, topo: Topology, timeout: float | None = None) -> CostModel:
    if topo.world_size == 1:
        return model
    t = torch.tensor([model.intra.alpha, model.intra.beta, model.inter.alpha, model.inter.beta,
                      float(model.chunks), float(model.shared)], dtype=torch.float64)
    setup_wait(dist.broadcast(t, src=topo.group_rank_to_global(0), group=topo.group, async_op=True), timeout,
               "cost.model_for")
    v = t.tolist()
    return CostModel(LinkModel(v[0], v[1]), LinkModel(v[2], v[3]), int(v[4]), bool(v[5]))


def model_for(topology: Topology, *, cache_dir: str | os.PathLike | None = None,
              timeout: float | None = None) -> CostModel:
    """The model ``auto`` uses for ``topology``: cached calibration, else link rate, else defaults.

    Resolved once per topology (one tiny broadcast from rank 0), then kept in commopt's cache.
    """
    key = (topology.layout, id(topology.group))
    model = _REGISTRY.models.get(key)
    if model is not None:
        return model
    model = CostModel(DEFAULT_INTRA, _inter_default(topology))
    if topology.rank == 0:
        path = _cache_path(topology, cache_dir)
        if path.exists():
            try:
                model = CostModel.from_dict(json.loads(path.read_text()))
            except (ValueError, KeyError, TypeError):
                pass  # a corrupt cache falls back to defaults; calibrate() rewrites it
    model = _broadcast_model(model, topology, timeout)
    _REGISTRY.models[key] = model
    return model
