"""The pure cost model: link models, the formulas of the algorithms' phases and their constants
(docs/architecture.md section 5.2).

A message of ``S`` bytes over a link costs ``alpha + S * beta``. Two levels: ``intra`` (inside a
node: NVLink, loopback) and ``inter`` (the node's NIC). Every rank of a node shares its NIC, so the
inter-node time of an algorithm is the bytes it pushes through one node's link times ``beta``: this
is what makes the hierarchical all-reduce win (2(N-1)/N S per node link instead of 2(p-1)/p S per
ring edge, and the ring crosses the node boundary once per node only with contiguous placement).

This module imports nothing of commopt: the algorithms (``commopt.comm.algorithms``) state their
``cost`` in these terms, and calibration, the choice of ``auto`` and the caches of measured models
(``commopt.comm.cost``) sit above the runtime that holds them.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Callable

import torch

__all__ = ["LinkModel", "MeasuredLine", "CostModel", "LinkMap", "DEFAULT_INTRA", "DEFAULT_INTER", "ALGORITHM_FACTORS",
           "PHASE_HANDOFF", "COPY_BETA", "pad_to", "pipeline_time", "fit"]


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
class MeasuredLine(LinkModel):
    """A call's fitted ``alpha + S * beta`` line with the ``(bytes, seconds)`` points it was fitted
    to, sizes ascending: :meth:`time` follows the points (linearly between two) inside their range
    and the line outside it.

    Measured calls need not grow linearly: on the emulated 2x2 flat's all-reduce took 3.6 ms at
    64 KiB and 53 ms at 512 KiB, so the best line through three sizes missed 64 KiB by 10-25 %,
    more than the candidates differ there, and ``auto`` picked by the line's error (docs/results.md 25).
    """

    points: tuple[tuple[float, float], ...] = ()

    def time(self, nbytes: float, messages: float = 1.0) -> float:
        pts = self.points
        if messages != 1.0 or len(pts) < 2 or not pts[0][0] <= nbytes <= pts[-1][0]:
            return super().time(nbytes, messages)
        for (s0, t0), (s1, t1) in zip(pts, pts[1:]):
            if nbytes <= s1:
                return t0 + (t1 - t0) * (nbytes - s0) / (s1 - s0) if s1 > s0 else t1
        return pts[-1][1]


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


@dataclass(frozen=True)
class LinkMap:
    """The links between the nodes of a cluster that is not uniform (docs/architecture.md, "synthesized
    collectives"); absent (None) on a uniform cluster, where nothing changes.

    Two fabrics:

    - ``"star"``: every node has one port to a switch, ``up[i]`` bytes/s out and ``down[i]`` bytes/s in;
      a transfer i -> j is limited by i's up port and j's down port, and transfers through one port
      share its rate (commopt-bench cluster's bridge; ``--link-rates``, ``--up-rates``/``--down-rates``).
    - ``"mesh"``: direct links, ``pairs[(i, j)]`` bytes/s from i to j (a pair absent: no link); every
      directed link is its own resource (``--fabric mesh --pair-rates``).

    ``alpha``: seconds per message on any link. Node indices are the topology's nodes (a schedule over
    one rank per node runs on a rail).
    """

    kind: str
    nodes: int
    up: tuple[float, ...] = ()
    down: tuple[float, ...] = ()
    pairs: tuple[tuple[int, int, float], ...] = ()
    alpha: float = 50e-6

    def __post_init__(self) -> None:
        if self.kind not in ("star", "mesh"):
            raise ValueError(f"LinkMap: kind must be 'star' or 'mesh', got {self.kind!r}")
        if self.nodes < 1:
            raise ValueError(f"LinkMap: nodes must be >= 1, got {self.nodes}")
        if self.kind == "star" and (len(self.up) != self.nodes or len(self.down) != self.nodes
                                    or min(self.up + self.down, default=1) <= 0):
            raise ValueError(f"LinkMap: a star needs {self.nodes} positive up and down rates, got up={self.up}, "
                             f"down={self.down}")
        if self.kind == "mesh":
            for i, j, r in self.pairs:
                if not (0 <= i < self.nodes and 0 <= j < self.nodes and i != j and r > 0):
                    raise ValueError(f"LinkMap: mesh link {i}->{j} at {r} bytes/s is not between two of the "
                                     f"{self.nodes} nodes at a positive rate")

    @classmethod
    def star(cls, up: list[float], down: list[float] | None = None, alpha: float = 50e-6) -> LinkMap:
        """A star of per-node port rates in bytes/s (``down`` None: the same as ``up``)."""
        return cls("star", len(up), tuple(float(x) for x in up), tuple(float(x) for x in (down or up)), (), alpha)

    @classmethod
    def mesh(cls, nodes: int, pairs: dict[tuple[int, int], float], alpha: float = 50e-6) -> LinkMap:
        """A direct-connect mesh: ``pairs[(i, j)]`` bytes/s from i to j (give both directions)."""
        return cls("mesh", nodes, (), (), tuple(sorted((int(i), int(j), float(r)) for (i, j), r in pairs.items())),
                   alpha)

    def rate(self, i: int, j: int) -> float:
        """Bytes/s from node i to node j alone on the fabric (0: no link)."""
        if self.kind == "star":
            return min(self.up[i], self.down[j])
        return next((r for a, b, r in self.pairs if (a, b) == (i, j)), 0.0)

    def shared(self, ways: int) -> LinkMap:
        """The map one of ``ways`` concurrent users sees (every rate divided by ``ways``: a node's L rails)."""
        if ways == 1:
            return self
        return LinkMap(self.kind, self.nodes, tuple(u / ways for u in self.up), tuple(d / ways for d in self.down),
                       tuple((a, b, r / ways) for a, b, r in self.pairs), self.alpha)

    @property
    def uniform(self) -> bool:
        """All links alike (a schedule cannot beat the usual algorithms): a star's ports all of one rate
        (a port slower only one way is shared by everything it sends or receives, so it counts), a mesh's
        pairs all of one rate."""
        if self.kind == "star":
            return len(set(self.up + self.down)) <= 1
        rates = {self.rate(i, j) for i in range(self.nodes) for j in range(self.nodes) if i != j}
        return len(rates) <= 1

    def to_dict(self) -> dict:
        return {"kind": self.kind, "nodes": self.nodes, "up": list(self.up), "down": list(self.down),
                "pairs": [list(p) for p in self.pairs], "alpha": self.alpha}

    @classmethod
    def from_dict(cls, d: dict) -> LinkMap:
        return cls(str(d["kind"]), int(d["nodes"]), tuple(float(x) for x in d.get("up", ())),
                   tuple(float(x) for x in d.get("down", ())),
                   tuple((int(a), int(b), float(r)) for a, b, r in d.get("pairs", ())), float(d.get("alpha", 50e-6)))


# Defaults when nothing was measured: gloo over loopback inside a node (~20 us, ~3 GB/s), and a
# 10 Gbit/s NIC between nodes (~50 us, 1.25 GB/s).
DEFAULT_INTRA = LinkModel(alpha=20e-6, beta=1 / 3e9)
DEFAULT_INTER = LinkModel(alpha=50e-6, beta=1 / 1.25e9)


# Per-rank traffic of ring-based collectives on p ranks, as a fraction of the buffer: the flat
# algorithms' bytes and the nccl-tests "bus bandwidth" (busbw = algbw * factor).
ALGORITHM_FACTORS: dict[str, Callable[[int], float]] = {
    "allreduce": lambda p: 2 * (p - 1) / p,
    "reduce_scatter": lambda p: (p - 1) / p,
    "all_gather": lambda p: (p - 1) / p,
    "alltoall": lambda p: (p - 1) / p,
}

# Seconds to hand a phase from one engine worker thread to the next (a queue put and a thread
# wake-up on a busy host). Charged per phase of a pipelined chunk: on equal levels it makes one chunk
# (which a blocking call runs on its own thread, with no hand-off) the choice, and it is negligible
# against the inter-node time that pipelining hides on a real link.
PHASE_HANDOFF = 0.2e-3
# Seconds per byte of a local copy (the permutes of the 2-D all-to-all): host memory, ~10 GB/s.
COPY_BETA = 1 / 10e9


def pad_to(nbytes: float, itemsize: int, multiple: int) -> float:
    """``nbytes`` rounded up to a whole number of ``multiple`` elements of ``itemsize`` bytes (the
    zero padding the hierarchical phases add to a buffer that does not divide by the node size)."""
    unit = itemsize * multiple
    return math.ceil(nbytes / unit) * unit if unit > 1 else nbytes


def pipeline_time(intra: float, inter: float, chunks: int) -> float:
    """Three-phase pipeline (intra, inter, intra) over ``chunks`` chunks of per-chunk stage times.

    Chunks overlap across levels only: a chunk's first intra-node phase and another chunk's last
    one share the intra-node link, so the bottleneck per extra chunk is the busier of the
    intra-node link (both intra phases) and the inter-node link.
    """
    handoffs = 3 * chunks * PHASE_HANDOFF if chunks > 1 else 0.0
    return (intra + inter + intra) + (chunks - 1) * max(2 * intra, inter) + handoffs


def fit(sizes: list[float], times: list[float], *, messages: float = 1.0,
        bytes_factor: float = 1.0, relative: bool = False) -> LinkModel:
    """Least-squares ``alpha``, ``beta`` from measured ``times`` of ``sizes`` (bytes).

    The model fitted is ``t = messages * alpha + bytes_factor * S * beta``: pass the algorithm's
    message count and byte factor (a ring all-reduce on p ranks: ``2(p-1)`` and ``2(p-1)/p``).
    ``relative``: minimise each time's relative error instead of its absolute one, so that more than
    two sizes spanning orders of magnitude all count (the largest would decide alone otherwise).
    A negative estimate (noise at small sizes, or times that grow faster than linearly) is held at
    zero (beta: a tiny positive value) and the other parameter fitted again alone: the least-squares
    line under that constraint. Clamping alone kept the unconstrained slope: flat's all-reduce on the
    emulated 2x2 (64 KiB to 4 MiB) came out 16 % slow at 4 MiB and 38 % at 64 KiB, the refit within
    0.2 % and 19 % (docs/results.md 24).
    """
    if len(sizes) != len(times) or len(sizes) < 2:
        raise ValueError(f"fit needs at least two (size, time) pairs, got {len(sizes)} sizes and "
                         f"{len(times)} times")
    a = torch.tensor([[messages, bytes_factor * s] for s in sizes], dtype=torch.float64)
    b = torch.tensor(times, dtype=torch.float64).unsqueeze(1)
    if relative:
        scale = 1.0 / b.clamp_min(1e-12)
        a, b = a * scale, b * scale
    sol = torch.linalg.lstsq(a, b).solution.squeeze(1)
    alpha, beta = float(sol[0]), float(sol[1])
    if alpha < 0:
        alpha, beta = 0.0, float(torch.linalg.lstsq(a[:, 1:], b).solution)
    elif beta < 1e-15:
        alpha, beta = float(torch.linalg.lstsq(a[:, :1], b).solution), 1e-15
    return LinkModel(alpha=max(alpha, 0.0), beta=max(beta, 1e-15))
