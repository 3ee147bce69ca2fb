"""The runtime context: everything commopt keeps per process, in one typed object (docs/architecture.md section 5.1).

One :class:`Context` per process holds the comm engine, the derived process groups per layout and
role, the cost models (one typed cache per kind of model), the topologies detected per group, the
sequence numbers of validated collectives and the in-network aggregation sessions, all under one
lock. :func:`context` returns it; :func:`destroy` releases it (threads, groups, sessions) and the
next use starts a fresh one. No other module keeps mutable module-level state (the CuPy module
cache of ``commopt.kernels`` is per device and immutable once built).

Process groups are created collectively: :meth:`Context.prepare` creates every group a set of
algorithms needs before the first collective, so nothing is created inside the data path (a
group created lazily by a first call pairs up wrongly across ranks whose first calls differ, and
a background thread creating one would race the caller's own ``torch.distributed`` calls).
"""

from __future__ import annotations

import ctypes
import itertools
import threading
from collections.abc import Callable, Iterable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from . import algorithms
from .cache import Cache
from .engine import Engine
from .errors import CommTimeoutError, TopologyError
from .links import CostModel, LinkModel
from .topology import Groups, Topology

__all__ = ["Context", "Cache", "context", "destroy", "align_timeout"]

class Context:
    """commopt's per-process state. Use :func:`context`; never construct one yourself.

    Attributes:
        lock: the one (re-entrant) lock of every cache below.
        cost_models: the level model ``auto`` uses, per (layout, parent group id).
        measured_lines: the measured per-algorithm lines of ``cost.calibrate`` (all-reduce) and
            ``alltoall.calibrate``, per (collective, layout, group id): what ``auto`` prefers.
        topologies: topologies detected per group id (None: WORLD).
        ina_sessions: long-lived in-network aggregation sessions and agreed job identities.
    """

    def __init__(self) -> None:
        self.lock = threading.RLock()
        # Group creation blocks on the other ranks; it holds its own lock, never ``lock`` (which
        # engine() and every cache take), so a rank waiting in new_group() blocks no other thread.
        self._create_lock = threading.Lock()
        self._engine: Engine | None = None
        self._groups: dict[tuple, Groups] = {}
        self._role_groups: dict[tuple, dict[str, Groups]] = {}
        self._sequences: dict[int | None, itertools.count] = {}
        self.cost_models: Cache[tuple, CostModel] = Cache(self.lock)
        self.measured_lines: Cache[tuple, dict[str, LinkModel]] = Cache(self.lock)
        self.topologies: Cache[int | None, Topology] = Cache(self.lock)
        self.ina_sessions: Cache[tuple, Any] = Cache(self.lock)
        self._elastic: dict[int, tuple[Any, Callable[[str], Any]]] = {}  # id(group) -> (group, factory)

    @property
    def alltoall_fits(self) -> Cache[tuple, dict[str, LinkModel]]:
        """The all-to-all's entries of :attr:`measured_lines` (the one cache; its keys name the collective)."""
        return self.measured_lines

    # ----------------------------------------------------------------------------- engine
    def engine(self) -> Engine:
        """The process's comm engine (started on first use)."""
        with self.lock:
            if self._engine is None:
                self._engine = Engine()
            return self._engine

    def next_sequence(self, group) -> int:
        """The next sequence number of a validated collective on ``group`` (None: WORLD)."""
        key = id(group) if group is not None else None
        with self.lock:
            return next(self._sequences.setdefault(key, itertools.count()))

    # ----------------------------------------------------------------------------- topologies
    def topology(self, topology: Topology | None, group, timeout: float | None = None) -> Topology:
        """``topology`` itself, or ``Topology.detect(group)`` computed once per group."""
        if topology is not None:
            return topology
        key = id(group) if group is not None else None
        topo = self.topologies.get(key)
        if topo is None:
            topo = Topology.detect(group, timeout=timeout)
            self.topologies.put(key, topo)
        return topo

    # ----------------------------------------------------------------------------- groups
    def register_elastic(self, group, factory: Callable[[str], Any]) -> None:
        """Mark ``group`` as a cross-replica group of one generation (``commopt.comm.elastic``): the
        groups an algorithm derives over it (one node of all its ranks) come from ``factory(role)``,
        which builds them from the coordinator's store, since ``dist.new_group`` would need a WORLD that
        spans the replicas (docs/architecture.md, "elastic")."""
        with self.lock:
            self._elastic[id(group)] = (group, factory)

    def forget_group(self, group) -> None:
        """Drop what this context holds for ``group`` (an elastic generation replaced by the next) and for the
        groups derived over it: their cache entries and engine workers (abandoned if stuck on a dead peer: a
        daemon). The group objects themselves are never destroyed, not even at exit: gloo's destructor of a
        group whose peer died, run on the thread of a callback that held the last reference or at interpreter
        exit, can end in std::terminate; a generation's groups are a few objects per membership change."""
        with self.lock:
            self._elastic.pop(id(group), None)
            gone = [group]
            for key in [k for k in self._groups if k[1] == id(group)]:
                derived = self._groups.pop(key)
                gone.extend(g for g in (derived.intra, derived.rail) if g is not None)
            self._sequences.pop(id(group), None)
            engine = self._engine
        for g in gone:
            if engine is not None:
                engine.release(g, timeout=0.0)
            ctypes.pythonapi.Py_IncRef(ctypes.py_object(g))  # kept alive to the end of the process

    def groups(self, topology: Topology, role: str, timeout: float | None = None) -> Groups:
        """This rank's intra-node and rail groups for ``role``, created once per layout and role.

        Creation is collective over WORLD (torch's rule for ``new_group``): every rank must ask for
        the same roles in the same order, which :meth:`prepare` does up front. The first request of
        a layout and role validates that all ranks agree on the layout (``TopologyError`` on every
        rank otherwise), then creates the groups; threads of one process asking for the same new
        role create it once.

        Args:
            topology: the layout; its ``group`` must span WORLD (torch creates groups over WORLD).
            role: the phase role (one group per phase role, docs/architecture.md section 3).
            timeout: seconds the layout check and each ``new_group`` may wait for the other ranks
                (None: the group's own timeout for the check, torch's default for creation).

        Raises:
            TopologyError: the ranks disagree on the layout, or the topology is over a subgroup.
            CommTimeoutError: a rank did not arrive within ``timeout``; the process groups are then
                out of step across ranks and the process group must be re-initialised.
        """
        key = (topology.layout, id(topology.group) if topology.group is not None else None, role)
        with self.lock:
            cached = self._groups.get(key)
        if cached is not None:
            return cached
        # The lookup is repeated under the creation lock: two threads asking for the same new key
        # would otherwise both create its groups, and this rank's new_group calls would no longer
        # pair with the other ranks'.
        with self._create_lock:
            with self.lock:
                cached = self._groups.get(key)
            if cached is not None:
                return cached
            with self.lock:
                elastic = self._elastic.get(id(topology.group)) if topology.group is not None else None
            result = (_elastic_groups(topology, role, elastic[1]) if elastic is not None
                      else _create_groups(topology, timeout))
            with self.lock:
                self._groups[key] = result
            return result

    def prepare(self, topology: Topology, algorithm_names: Iterable[str] | None = None,
                timeout: float | None = None) -> None:
        """Create every process group the named algorithms need on ``topology``, collectively
        (``algorithm_names`` None: every algorithm ``auto`` may pick, ``algorithms.ALGORITHMS``'
        automatic ones).

        Call it on every rank with the same arguments before the first collective (the public
        entry points call it for the algorithm they run; wrappers such as OverlapDataParallel call
        it at construction), so that no group is created inside the data path. Algorithms the
        topology does not support are skipped (the same decision on every rank: it depends on the
        layout only). A group of one rank needs no derived groups; a topology over a subgroup cannot
        have them (``TopologyError``: torch creates groups over WORLD).
        """
        if topology.world_size == 1 or not dist.is_initialized():
            return
        if algorithm_names is None:
            algorithm_names = [n for n, a in algorithms.ALGORITHMS.items() if a.automatic]
        for name in algorithm_names:
            algo = algorithms.get(name)
            if algo.needs_uniform and not topology.is_uniform:
                continue
            for role in algo.roles(topology):
                self.groups(topology, role, timeout)

    # ----------------------------------------------------------------------------- calls
    def role_groups(self, topology: Topology | None, algorithm: algorithms.Algorithm,
                    timeout: float | None = None) -> dict[str, Groups]:
        """``{role: groups}`` for every role ``algorithm`` uses on ``topology`` (none for a flat call or
        a group of one rank), created collectively on first use like :meth:`groups`."""
        if topology is None or topology.world_size == 1 or not dist.is_initialized():
            return {}
        key = (topology.layout, id(topology.group) if topology.group is not None else None, algorithm.name)
        with self.lock:
            cached = self._role_groups.get(key)
        if cached is None:
            cached = {role: self.groups(topology, role, timeout) for role in algorithm.roles(topology)}
            with self.lock:
                self._role_groups[key] = cached
        return cached

    def call(self, algorithm: algorithms.Algorithm, collective: str, prepared: Any, red: Any, group: Any,
             topology: Topology | None, timeout: float | None, blocking: bool, chunks: int = 1,
             src: torch.Tensor | None = None, args: Any = None) -> algorithms.Call:
        """The :class:`~commopt.comm.algorithms.Call` of one call of ``algorithm``: what it needs of this
        context (the engine, its roles' groups, the algorithms' sessions), handed over so that no
        algorithm reaches the context itself."""
        return algorithms.Call(collective, prepared, red, group, topology, timeout, blocking, self.engine(),
                               self.role_groups(topology, algorithm, timeout), chunks, src, args, self.ina_sessions)

    # ----------------------------------------------------------------------------- lifecycle
    def destroy(self) -> None:
        """Stop the engine, close INA sessions and destroy the derived process groups."""
        with self.lock:
            engine, self._engine = self._engine, None
            groups, self._groups = self._groups, {}
            self._role_groups = {}
            self._sequences = {}
        for cache in (self.cost_models, self.measured_lines, self.topologies):
            cache._drain()
        for entry in self.ina_sessions._drain():
            close = getattr(entry, "close", None)  # sessions; a group's agreed identity holds nothing
            if close is not None:
                close()
        if engine is not None:
            engine.shutdown()
        if dist.is_initialized():
            for g in groups.values():
                for pg in (g.intra, g.rail):
                    if pg is not None:
                        try:
                            dist.destroy_process_group(pg)
                        except (ValueError, RuntimeError, KeyError):
                            pass  # already destroyed with the default group, or an elastic one torch never made


_CONTEXT_LOCK = threading.Lock()
_CONTEXT: list[Context] = []  # the process's context; a list so that destroy() can replace it


def context() -> Context:
    """The process's runtime context (created on first use, replaced after :func:`destroy`)."""
    with _CONTEXT_LOCK:
        if not _CONTEXT:
            _CONTEXT.append(Context())
        return _CONTEXT[0]


def destroy() -> None:
    """Release commopt's process-wide state: derived process groups, the engine's threads, INA
    sessions, cached models and topologies.

    Call before ``dist.destroy_process_group()``; safe to call twice.
    """
    with _CONTEXT_LOCK:
        current = _CONTEXT.pop() if _CONTEXT else None
    if current is not None:
        current.destroy()


# --------------------------------------------------------------------------------- group creation
def _elastic_groups(topo: Topology, role: str, factory: Callable[[str], Any]) -> Groups:
    """The derived groups of an elastic generation's group: one node of all its ranks only."""
    if topo.num_nodes != 1:
        raise TopologyError(f"a cross-replica (elastic) group is one level: derived groups of layout {topo.layout!r} "
                            f"over it are not supported; use algorithm='flat' on it", op="topology.groups")
    ranks = tuple(range(topo.world_size))
    return Groups(intra=factory(role) if topo.world_size > 1 else None, rail=None, intra_ranks=ranks,
                  rail_ranks=(topo.rank,))


def _create_groups(topo: Topology, timeout: float | None) -> Groups:
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
        g = _new_group([to_global(r) for r in node], td) if len(node) > 1 else None
        if topo.rank in node:
            intra, intra_ranks = g, tuple(node)
    max_local = max(len(n) for n in topo.nodes)
    for j in range(max_local):
        members = [n[j] for n in topo.nodes if len(n) > j]
        g = _new_group([to_global(r) for r in members], td) if len(members) > 1 else None
        if topo.rank in members:
            rail, rail_ranks = g, tuple(members)
    return Groups(intra=intra, rail=rail, intra_ranks=intra_ranks, rail_ranks=rail_ranks)


def _new_group(ranks: list[int], timeout: timedelta | None):
    """``dist.new_group(ranks, timeout=...)``, its failure a ``CommTimeoutError`` naming the group.

    On gloo a member waits in the group's full-mesh rendezvous for every other member, bounded by
    ``timeout`` (torch's default, 30 minutes, when None); non-members return at once. The group's
    operations then time out as WORLD's do.
    """
    try:
        group = dist.new_group(ranks, timeout=timeout)
    except RuntimeError as exc:  # gloo: "Wait timeout"; the store: DistStoreError (a RuntimeError)
        rank = dist.get_rank()
        after = "" if timeout is None else f" within {timeout.total_seconds():g} s"
        raise CommTimeoutError(
            f"creating the process group of ranks {ranks} failed{after} on rank {rank}: {type(exc).__name__}: "
            f"{exc}. A rank of {ranks} did not reach the same group creation for this layout and role, or "
            "died; the ranks' process groups are now out of step: call commopt.comm.destroy() and "
            "torch.distributed.destroy_process_group(), then start again", op="topology.groups",
            ranks=ranks) from exc
    if timeout is not None:
        # The creation timeout bounded the rendezvous; the group's later collectives get WORLD's
        # timeout, not the first caller's (a 2 s bound for one call must not become every call's).
        align_timeout(group)
    return group


def align_timeout(group) -> None:
    """Give ``group``'s later operations WORLD's timeout (the one chosen at ``init_process_group``).

    torch creates every other group with its own default (30 minutes) whatever WORLD's is: FSDP2's
    hpZ post-forward groups and a 2-D mesh's node groups among them. A backend collective stuck on
    such a group after a peer stalled (a call gives up at its own deadline, the backend's work does
    not) then holds the group's worker, and the group's destruction, for 30 minutes. No-op for
    WORLD, a group this rank is not in, and a backend that keeps no timeout.
    """
    if group is None or group is dist.group.WORLD or group is dist.GroupMember.NON_GROUP_MEMBER:
        return
    world_timeout = _backend_timeout(dist.group.WORLD)
    if world_timeout is not None:
        dist.distributed_c10d._set_pg_timeout(world_timeout, group)


def _backend_timeout(group) -> timedelta | None:
    """The operation timeout ``group`` was created with (gloo and NCCL keep it in their options)."""
    try:
        backend = group._get_backend(torch.device("cpu") if dist.get_backend(group) == "gloo"
                                     else torch.device("cuda"))
        return backend.options._timeout
    except (AttributeError, RuntimeError, ValueError):
        return None
