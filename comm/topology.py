"""Topology: which rank lives on which node, and the process groups that follow from it.

A node is a set of ranks joined by a fast link (NVLink, or loopback on one machine); nodes are
joined by slower links (NICs). Ranks of a node need not be contiguous and nodes need not be equal
in size. ``Topology.groups(role)`` creates the intra-node groups and the inter-node "rail" groups
(the ranks with the same local index on every node), collectively and in the same order on every
rank, once per layout and role: the one process-wide cache of commopt, released by
``commopt.comm.destroy()``. Each multi-phase algorithm uses one role per phase, so that every
process group only ever carries one phase of one algorithm and the order in which phases reach a
group is the submission order on every rank (DESIGN 2).
"""

from __future__ import annotations

import hashlib
import os
import socket
import threading
from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist

from .errors import CommTimeoutError, TopologyError

__all__ = ["Topology", "Groups", "parse_rate", "ina_switch_from_env", "destroy", "setup_wait"]


def parse_rate(text: str | int | float) -> float:
    """Parse a link rate such as ``"200mbit"``, ``"1gbit"``, ``"10GB"`` or ``"25e6"`` into bit/s.

    Units follow tc: ``bit``/``kbit``/``mbit``/``gbit`` are bits, ``bps``/``kbps``/``mbps`` ... and
    ``B``/``KB``/``MB``/``GB`` are bytes; a bare number is bits per second.
    """
    if isinstance(text, (int, float)):
        return float(text)
    s = text.strip().lower()
    units = [("gbit", 1e9), ("mbit", 1e6), ("kbit", 1e3), ("bit", 1.0),
             ("gbps", 8e9), ("mbps", 8e6), ("kbps", 8e3), ("bps", 8.0),
             ("gb", 8e9), ("mb", 8e6), ("kb", 8e3), ("b", 8.0)]
    for unit, mult in units:  # noqa: B007 - mult is used after the break
        if s.endswith(unit):
            number = s[: -len(unit)]
            break
    else:
        number, mult = s, 1.0
    try:
        value = float(number) * mult
    except ValueError:
        raise ValueError(f"cannot parse link rate {text!r}: use e.g. '200mbit', '1gbit' or '25MB'") from None
    if value <= 0:
        raise ValueError(f"link rate must be positive, got {text!r}")
    return value


def ina_switch_from_env() -> tuple[str, int] | None:
    """The in-network aggregation switch named by ``COMMOPT_INA_SWITCH`` ("host:port"), or None if unset.

    Needs no layout, unlike :meth:`Topology.from_env` (which calls it): under torchrun the ``"ina"``
    backend finds its switch with this alone, without ``COMMOPT_NODES``. It is the one place that
    reads the variable (DESIGN 7.6). An IPv6 host may be bracketed ("[::1]:5555").

    Raises:
        TopologyError: the variable is set but is not "host:port" with a port in 1..65535.
    """
    text = os.environ.get("COMMOPT_INA_SWITCH", "").strip()
    if not text:
        return None
    host, sep, port = text.rpartition(":")
    host = host.strip("[]")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise TopologyError(f"COMMOPT_INA_SWITCH={text!r} is malformed: expected 'host:port' with a port in "
                            "1..65535, e.g. '127.0.0.1:5555' (the address `commopt-bench ina-switch` prints)")
    return host, int(port)


def _group_rank_size(group) -> tuple[int, int]:
    if not dist.is_available() or not dist.is_initialized():
        if group is not None:
            raise TopologyError("a process group was given but torch.distributed is not initialized")
        return 0, 1
    return dist.get_rank(group), dist.get_world_size(group)


@dataclass(frozen=True)
class Groups:
    """The process groups of one topology and one role.

    Attributes:
        intra: this rank's intra-node group (None when the node has one rank).
        rail: this rank's inter-node group: the ranks with this rank's local index on every node
            that has one (None when it has one member).
        intra_ranks: group ranks (in the topology's group) of ``intra``, in local-rank order.
        rail_ranks: group ranks of ``rail``, in node order.
    """

    intra: object | None
    rail: object | None
    intra_ranks: tuple[int, ...]
    rail_ranks: tuple[int, ...]


@dataclass(frozen=True)
class Topology:
    """The node of every rank of a process group.

    Attributes:
        nodes: the ranks (in ``group``) of every node; node order is the order given, ranks in a
            node are sorted; every rank of the group appears exactly once.
        rank: this process's rank in ``group``.
        world_size: the size of ``group``.
        group: the process group the ranks refer to (None means WORLD).
        link_rate_bps: the configured inter-node link rate in bit/s, when known (emulated cluster).
        ina_switch: the address ``"host:port"`` of an in-network aggregation switch, when known.
    """

    nodes: tuple[tuple[int, ...], ...]
    rank: int = 0
    world_size: int = 1
    group: object | None = field(default=None, compare=False, hash=False)
    link_rate_bps: float | None = None
    ina_switch: str | None = None

    def __post_init__(self):
        seen = sorted(r for node in self.nodes for r in node)
        if seen != list(range(self.world_size)):
            missing = sorted(set(range(self.world_size)) - set(seen))
            extra = sorted(r for r in set(seen) if r >= self.world_size or r < 0)
            dup = sorted({r for r in seen if seen.count(r) > 1})
            raise TopologyError(
                f"nodes {[list(n) for n in self.nodes]} do not cover ranks 0..{self.world_size - 1} exactly "
                f"once (missing {missing}, out of range {extra}, duplicated {dup}); list every rank of "
                f"the group in exactly one node")
        if any(len(n) == 0 for n in self.nodes):
            raise TopologyError(f"nodes {[list(n) for n in self.nodes]} contain an empty node; drop it")

    # ----------------------------------------------------------------------------- constructors
    @classmethod
    def from_nodes(cls, nodes: list[list[int]], group=None, **extra) -> Topology:
        """A topology from an explicit list of nodes, each a list of ranks of ``group``."""
        rank, size = _group_rank_size(group)
        try:
            canon = tuple(tuple(sorted(int(r) for r in node)) for node in nodes)
        except (TypeError, ValueError):
            raise TopologyError(f"nodes must be a list of lists of ranks, got {nodes!r}") from None
        return cls(nodes=canon, rank=rank, world_size=size, group=group, **extra)

    @classmethod
    def from_spec(cls, spec: str, group=None, **extra) -> Topology:
        """A topology from a spec: ``"2x4"`` (2 nodes of 4 contiguous ranks) or ``"2+1"`` (sizes).

        ``"NxL"`` and ``"a+b+..."`` place ranks node by node; for other placements use
        :meth:`from_nodes` or ``COMMOPT_NODES``.
        """
        rank, size = _group_rank_size(group)
        s = spec.strip().lower()
        try:
            if "x" in s:
                n, local = (int(p) for p in s.split("x"))
                sizes = [local] * n
            else:
                sizes = [int(p) for p in s.split("+")]
        except ValueError:
            raise TopologyError(f"cannot parse topology spec {spec!r}: use 'NxL' (e.g. '2x4') "
                                f"or node sizes joined by '+' (e.g. '2+1')") from None
        if not sizes or any(k <= 0 for k in sizes):
            raise TopologyError(f"topology spec {spec!r} has no nodes or a node of size <= 0")
        if sum(sizes) != size:
            raise TopologyError(f"topology spec {spec!r} describes {sum(sizes)} ranks but the group has "
                                f"world_size={size}; pass a spec whose sizes add up to {size}")
        nodes, start = [], 0
        for k in sizes:
            nodes.append(list(range(start, start + k)))
            start += k
        return cls.from_nodes(nodes, group=group, **extra)

    @classmethod
    def from_env(cls, group=None) -> Topology:
        """The topology the environment describes; the one place commopt reads its variables.

        In order: ``COMMOPT_NODES`` ("0,1;2,3": nodes separated by ';', ranks by ','), then
        torchrun's ``LOCAL_WORLD_SIZE``, then MPI's local size (``MPI_LOCALNRANKS``,
        ``OMPI_COMM_WORLD_LOCAL_SIZE``), all assuming node-by-node placement for the latter two.
        Also reads ``COMMOPT_LINK_RATE_BPS`` and ``COMMOPT_INA_SWITCH`` (through
        :func:`ina_switch_from_env`). Raises ``TopologyError`` when the environment gives no layout, or
        a malformed value.
        """
        extra = {}
        rate = os.environ.get("COMMOPT_LINK_RATE_BPS")
        if rate:
            extra["link_rate_bps"] = parse_rate(rate)
        switch = ina_switch_from_env()
        if switch is not None:
            host, port = switch
            extra["ina_switch"] = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
        text = os.environ.get("COMMOPT_NODES")
        if text:
            try:
                nodes = [[int(r) for r in node.split(",") if r.strip()] for node in text.split(";")
                         if node.strip()]
            except ValueError:
                raise TopologyError(f"COMMOPT_NODES={text!r} is malformed: use '0,1;2,3'") from None
            return cls.from_nodes(nodes, group=group, **extra)
        for var in ("LOCAL_WORLD_SIZE", "MPI_LOCALNRANKS", "OMPI_COMM_WORLD_LOCAL_SIZE"):
            if os.environ.get(var):
                local = int(os.environ[var])
                _, size = _group_rank_size(group)
                if local <= 0 or size % local:
                    raise TopologyError(f"world_size={size} is not divisible by local_size={local} "
                                        f"(from {var}); set COMMOPT_NODES to describe uneven nodes")
                return cls.from_spec(f"{size // local}x{local}", group=group, **extra)
        raise TopologyError("the environment gives no layout: set COMMOPT_NODES (e.g. '0,1;2,3') or run "
                            "under torchrun or mpirun, or call Topology.detect()")

    @classmethod
    def detect(cls, group=None, *, timeout: float | None = None) -> Topology:
        """``from_env()`` when the environment gives the layout, else host-name hashes exchanged.

        Network namespaces of one machine share a host name, so inside the emulated cluster the
        environment (``COMMOPT_NODES``) is what tells nodes apart.
        """
        try:
            return cls.from_env(group)
        except TopologyError:
            if "COMMOPT_NODES" in os.environ:
                raise
        rank, size = _group_rank_size(group)
        if size == 1:
            return cls(nodes=((0,),), rank=0, world_size=1, group=group)
        digest = hashlib.sha1(socket.gethostname().encode()).digest()[:8]
        mine = torch.tensor([int.from_bytes(digest, "little", signed=True)], dtype=torch.int64)
        out = [torch.zeros_like(mine) for _ in range(size)]
        setup_wait(dist.all_gather(out, mine, group=group, async_op=True), timeout, "topology.detect")
        by_host: dict[int, list[int]] = {}
        for r, t in enumerate(out):
            by_host.setdefault(int(t.item()), []).append(r)
        return cls.from_nodes(list(by_host.values()), group=group)

    # ----------------------------------------------------------------------------- properties
    @property
    def num_nodes(self) -> int:
        return len(self.nodes)

    def node_of(self, rank: int) -> int:
        for i, node in enumerate(self.nodes):
            if rank in node:
                return i
        raise TopologyError(f"rank {rank} is not in this topology of world_size={self.world_size}")

    @property
    def node(self) -> int:
        """This rank's node index."""
        return self.node_of(self.rank)

    @property
    def local_rank(self) -> int:
        return self.nodes[self.node].index(self.rank)

    @property
    def local_size(self) -> int:
        return len(self.nodes[self.node])

    @property
    def is_uniform(self) -> bool:
        """All nodes have the same number of ranks."""
        return len({len(n) for n in self.nodes}) == 1

    @property
    def layout(self) -> str:
        """A canonical string of the nodes, e.g. ``"0,1;2,3"`` (the ``COMMOPT_NODES`` format)."""
        return ";".join(",".join(str(r) for r in n) for n in self.nodes)

    def __repr__(self) -> str:
        return f"Topology(nodes={self.layout!r}, rank={self.rank}, world_size={self.world_size})"

    # ----------------------------------------------------------------------------- groups
    def validate(self, timeout: float | None = None) -> None:
        """Check that every rank of the group holds the same layout; ``TopologyError`` on all if not.

        One tiny all-gather (a 64-bit hash of the layout) on the topology's group; ``timeout``
        seconds (None: the group's own) before ``CommTimeoutError``.
        """
        if self.world_size == 1:
            return
        digest = hashlib.sha1(self.layout.encode()).digest()[:8]
        mine = torch.tensor([int.from_bytes(digest, "little", signed=True)], dtype=torch.int64)
        out = [torch.zeros_like(mine) for _ in range(self.world_size)]
        setup_wait(dist.all_gather(out, mine, group=self.group, async_op=True), timeout, "topology.validate")
        values = [int(t.item()) for t in out]
        if len(set(values)) > 1:
            mine_v = values[self.rank]
            others = [r for r, v in enumerate(values) if v != mine_v]
            raise TopologyError(
                f"ranks disagree on the topology: rank {self.rank} has nodes {self.layout!r}, ranks "
                f"{others} have a different layout; build the topology from the same spec (or "
                f"COMMOPT_NODES) on every rank", op="topology.groups", ranks=others)

    def groups(self, role: str = "default", timeout: float | None = None) -> Groups:
        """This rank's intra-node and rail groups for ``role``, created once per layout and role.

        Creation is collective over WORLD (torch's rule for ``new_group``): every rank must call
        ``groups`` with the same roles in the same order. The first call of a layout validates that
        all ranks agree on it (``TopologyError`` on every rank otherwise).
        """
        return _REGISTRY.groups(self, role, timeout)

    def group_rank_to_global(self, rank: int) -> int:
        if self.group is None or not dist.is_initialized():
            return rank
        return dist.get_global_rank(self.group, rank)


def setup_wait(work, timeout: float | None, op: str) -> None:
    """Wait for a setup collective (layout check, model broadcast) within ``timeout`` seconds.

    Setup runs on the calling thread before any payload moves; without a bound it would wait for
    the group's own timeout (30 minutes by default) when a rank never arrives.
    """
    try:
        if timeout is None:
            work.wait()
        else:
            work.wait(timedelta(seconds=timeout))
    except RuntimeError as exc:
        rank = dist.get_rank() if dist.is_initialized() else 0
        raise CommTimeoutError(f"setup collective failed or timed out on rank {rank}: {type(exc).__name__}: "
                               f"{exc}. Another rank did not reach this collective or died", op=op,
                               ranks=[rank]) from exc


class _Registry:
    """The one process-wide cache of commopt (DESIGN 3): derived process groups and the engine.

    Keyed by (layout, parent group, role). Released by ``destroy()``.
    """

    def __init__(self):
        self._lock = threading.Lock()
        self._groups: dict[tuple, Groups] = {}
        self._engine = None
        # Cost models resolved per (layout, parent group) and topologies detected per group: both
        # agreed across ranks by a collective, so they are computed once, not on every call.
        self.models: dict[tuple, object] = {}
        self.detected: dict[int | None, Topology] = {}
        # Per-group sequence numbers of validated collectives (validate=True fingerprints).
        self.validate_seq: dict[int | None, object] = {}
        # Long-lived in-network aggregation sessions of all_reduce(algorithm="ina"), one per
        # (group, switch) (see comm/ina/worker.py); closed here, by destroy().
        self.ina_sessions: dict[tuple, object] = {}

    def groups(self, topo: Topology, role: str, timeout: float | None = None) -> Groups:
        parent_key = id(topo.group) if topo.group is not None else None
        key = (topo.layout, parent_key, role)
        with self._lock:
            cached = self._groups.get(key)
        if cached is not None:
            return cached
        if topo.group is not None and dist.get_world_size(topo.group) != dist.get_world_size():
            raise TopologyError(
                f"derived groups of a topology over a subgroup (size {topo.world_size} of "
                f"{dist.get_world_size()}) are not supported: torch creates groups collectively over "
                f"WORLD; use algorithm='flat' on subgroups", op="topology.groups")
        # Every rank reaches this point for a new key together (creation is collective), so every
        # rank validates: a check skipped on one rank only would leave the others waiting.
        topo.validate(timeout)
        td = None if timeout is None else timedelta(seconds=timeout)
        to_global = topo.group_rank_to_global
        intra = rail = None
        intra_ranks: tuple[int, ...] = ()
        rail_ranks: tuple[int, ...] = ()
        # Every rank creates every group, in the same order (node order, then rail order).
        for node in topo.nodes:
            ranks = [to_global(r) for r in node]
            g = dist.new_group(ranks, timeout=td) if len(node) > 1 else None
            if topo.rank in node:
                intra, intra_ranks = g, tuple(node)
        max_local = max(len(n) for n in topo.nodes)
        for j in range(max_local):
            members = [n[j] for n in topo.nodes if len(n) > j]
            g = dist.new_group([to_global(r) for r in members], timeout=td) if len(members) > 1 else None
            if topo.rank in members:
                rail, rail_ranks = g, tuple(members)
        result = Groups(intra=intra, rail=rail, intra_ranks=intra_ranks, rail_ranks=rail_ranks)
        with self._lock:
            self._groups[key] = result
        return result

    def engine(self):
        from .engine import Engine

        with self._lock:
            if self._engine is None:
                self._engine = Engine()
            return self._engine

    def destroy(self) -> None:
        with self._lock:
            engine, self._engine = self._engine, None
            groups, self._groups = self._groups, {}
            self.models = {}
            self.detected = {}
            self.validate_seq = {}
            sessions, self.ina_sessions = self.ina_sessions, {}
        for session in sessions.values():
            session.close()  # type: ignore[attr-defined]
        if engine is not None:
            engine.shutdown()
        if dist.is_initialized():
            for g in groups.values():
                for pg in (g.intra, g.rail):
                    if pg is not None:
                        try:
                            dist.destroy_process_group(pg)
                        except (ValueError, RuntimeError):
                            pass  # already destroyed with the default group


_REGISTRY = _Registry()


def destroy() -> None:
    """Release commopt's process-wide state: derived process groups and the engine's threads.

    Call before ``dist.destroy_process_group()``; safe to call twice.
    """
    _REGISTRY.destroy()
