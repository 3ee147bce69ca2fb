"""Topology: which rank lives on which node, and the process groups that follow from it.

A node is a set of ranks joined by a fast link (NVLink, or loopback on one machine); nodes are
joined by slower links (NICs). Ranks of a node need not be contiguous and nodes need not be equal
in size. The constructors (``from_spec``, ``from_nodes``, ``from_env``, ``detect``) need the
process group their ranks refer to, except for a layout of one rank; ``from_env`` takes the
launcher's real placement (torchrun's node-by-node, MPI's as exchanged between the ranks) and
never assumes one the launcher did not promise. A topology is plain data: the derived intra-node
and inter-node "rail" groups (the ranks with the same local index on every node) are created by the
runtime context (``commopt.comm.context().groups(topology, role)``), collectively and in the same
order on every rank, once per layout and role. Each multi-phase algorithm uses one role per phase,
so that every process group only ever carries one phase of one algorithm and the order in which
phases reach a group is the submission order on every rank (docs/architecture.md section 3).
"""

from __future__ import annotations

import hashlib
import json
import numbers
import os
import socket
import sys
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from .engine import wait_work
from .errors import TopologyError
from .links import LinkMap

__all__ = ["Topology", "Groups", "parse_rate", "format_nodes", "ina_switch_from_env"]


def parse_rate(text: str | int | float) -> float:
    """Parse a link rate such as ``"200mbit"``, ``"1gbit"``, ``"10GB"`` or ``"25e6"`` into bit/s.

    Units follow tc: ``bit``/``kbit``/``mbit``/``gbit``/``tbit`` are bits, ``bps``/``kbps``/``mbps`` ...
    and ``B``/``KB``/``MB``/``GB`` are bytes; a bare number is bits per second. The one grammar of a
    rate given as text, here and in ``commopt-bench cluster --link-rate``.
    """
    if isinstance(text, (int, float)):
        return float(text)
    s = text.strip().lower()
    units = [("tbit", 1e12), ("gbit", 1e9), ("mbit", 1e6), ("kbit", 1e3), ("bit", 1.0),
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
        value = float("nan")
    if not value < float("inf"):  # not a number, or "nan"/"inf": no rate tc or the cost model can use
        raise ValueError(f"cannot parse link rate {text!r}: use e.g. '200mbit', '1gbit' or '25MB'")
    if value <= 0:
        raise ValueError(f"link rate must be positive, got {text!r}")
    return value


def format_nodes(nodes: list[list[int]] | tuple[tuple[int, ...], ...]) -> str:
    """The ``COMMOPT_NODES`` text of a layout, e.g. ``"0,1;2,3"``: nodes by ``;``, their ranks by ``,``."""
    return ";".join(",".join(str(r) for r in node) for node in nodes)


def ina_switch_from_env() -> tuple[str, int] | None:
    """The in-network aggregation switch named by ``COMMOPT_INA_SWITCH`` ("host:port"), or None if unset.

    Needs no layout, unlike :meth:`Topology.from_env` (which calls it): under torchrun the ``"ina"``
    backend finds its switch with this alone, without ``COMMOPT_NODES``. It is the one place that
    reads the variable (docs/architecture.md section 6.3). An IPv6 host may be bracketed ("[::1]:5555").

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


def _check_group(group, where: str) -> None:
    """``TypeError`` unless ``group`` is a ``ProcessGroup`` or None (a string such as "WORLD" is not)."""
    pg_type = getattr(dist, "ProcessGroup", None)
    if group is None or (pg_type is not None and isinstance(group, pg_type)):
        return
    raise TypeError(f"{where}: group must be a torch.distributed ProcessGroup or None (meaning WORLD), got "
                    f"{type(group).__name__} {group!r}; pass the group returned by dist.new_group(), "
                    "dist.group.WORLD, or None")


def _require_initialized(where: str, what: str, n: int) -> None:
    """A layout of more than one rank needs the process group its ranks refer to."""
    if n > 1 and not (dist.is_available() and dist.is_initialized()):
        raise TopologyError(f"{where}: the process group does not exist yet: {what} describes {n} ranks but "
                            "torch.distributed is not initialized; call torch.distributed.init_process_group() "
                            "first, then build the Topology")


def _group_rank_size(group, where: str = "Topology") -> tuple[int, int]:
    _check_group(group, where)
    if not dist.is_available() or not dist.is_initialized():
        if group is not None:
            raise TopologyError(f"{where}: a process group was given but torch.distributed is not initialized; "
                                "call torch.distributed.init_process_group() first")
        return 0, 1
    rank = dist.get_rank(group)
    if rank < 0:
        raise TopologyError(f"{where}: this process (global rank {dist.get_rank()}) is not a member of the given "
                            "group; build the topology only on the group's members")
    return rank, dist.get_world_size(group)


def _as_rank(x) -> int | None:
    """``x`` as a rank: a Python int or an integer numpy/torch scalar; None for anything else (bool too)."""
    if isinstance(x, bool):
        return None
    if isinstance(x, torch.Tensor):
        if x.dim() == 0 and not x.is_floating_point() and not x.is_complex() and x.dtype != torch.bool:
            return int(x.item())
        return None
    if isinstance(x, numbers.Integral):  # int and numpy's integer scalars (numpy's bool_ is not Integral)
        return int(x)
    return None


def _canonical_nodes(nodes, where: str, *, sort: bool) -> tuple[tuple[int, ...], ...]:
    """``nodes`` as a tuple of tuples of Python ints; ``TypeError`` naming the first element that is not.

    ``int()`` would turn ``0.9`` into 0 and ``"01"`` into 1: a silently different layout, so ranks
    must already be integers and nodes must be lists or tuples (a string is not a node).
    """
    example = "e.g. [[0, 2], [1, 3]]"
    if not isinstance(nodes, (list, tuple)):
        raise TypeError(f"{where}: nodes must be a list of nodes, each a list of int ranks ({example}), got "
                        f"{type(nodes).__name__} {nodes!r}")
    out = []
    for i, node in enumerate(nodes):
        if not isinstance(node, (list, tuple, range)):
            raise TypeError(f"{where}: node {i} is {type(node).__name__} {node!r}; each node must be a list or "
                            f"tuple of int ranks ({example}), not a string or a single number")
        ranks = []
        for j, x in enumerate(node):
            r = _as_rank(x)
            if r is None:
                raise TypeError(f"{where}: rank {x!r} (node {i}, position {j}) is a {type(x).__name__}; ranks must "
                                "be ints (a Python int or an integer numpy/torch scalar, not bool, float or str), "
                                f"{example}")
            ranks.append(r)
        out.append(tuple(sorted(ranks)) if sort else tuple(ranks))
    return tuple(out)


def _name_hash(name: str) -> int:
    return int.from_bytes(hashlib.sha1(name.encode()).digest()[:8], "little", signed=True)


# Launchers whose variables give the placement, in the order from_env() consults them: (name, local
# rank, local size, node rank, launcher rank, launcher world size, the launcher's name of the host).
# MPI says which ranks share a host, never that they are contiguous: its placement is exchanged.
# Hydra (mpich's mpirun) names each host of `-hosts a:1,b:1` in PMI_HOSTNAME, which tells hosts apart
# even where they resolve to one machine; socket.gethostname() is the fallback.
_LAUNCHERS = (
    ("torchrun", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "RANK", "WORLD_SIZE", None),
    ("mpich", "MPI_LOCALRANKID", "MPI_LOCALNRANKS", None, "PMI_RANK", "PMI_SIZE", "PMI_HOSTNAME"),
    ("openmpi", "OMPI_COMM_WORLD_LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_SIZE", None, "OMPI_COMM_WORLD_RANK",
     "OMPI_COMM_WORLD_SIZE", "PMIX_HOSTNAME"),
)
_NO_LAUNCHER, _MPI4PY = "none", "mpi4py"
_LAUNCHER_CODES = [_NO_LAUNCHER] + [name for name, *_ in _LAUNCHERS] + [_MPI4PY]
_TO_DO = "set COMMOPT_NODES (e.g. '0,2;1,3') on every rank to give the layout explicitly"


@dataclass(frozen=True)
class _Placement:
    """What this rank's launcher says about where it runs (-1: not said)."""

    launcher: str
    source: str  # the variables (or the MPI call) it came from, for messages
    local_rank: int
    local_size: int
    node_rank: int = -1
    launcher_rank: int = -1
    launcher_world: int = -1
    host: str = ""

    def row(self) -> list[int]:
        return [_LAUNCHER_CODES.index(self.launcher), _name_hash(self.host or socket.gethostname()),
                self.local_rank, self.local_size, self.node_rank, self.launcher_rank, self.launcher_world]


def _env_int(var: str, minimum: int) -> int:
    text = os.environ[var].strip()
    try:
        value = int(text)
    except ValueError:
        value = minimum - 1
    if value < minimum:
        raise TopologyError(f"{var}={text!r} is malformed: expected an integer >= {minimum}; unset it or {_TO_DO}")
    return value


def _launcher_placement() -> _Placement | None:
    """This rank's placement from torchrun's or MPI's variables, else MPI's shared-memory split, else None."""
    for name, lr_var, ls_var, node_var, rank_var, world_var, host_var in _LAUNCHERS:
        has_size, has_rank = bool(os.environ.get(ls_var)), bool(os.environ.get(lr_var))
        # torchrun is recognised by LOCAL_WORLD_SIZE alone: other tools set a bare LOCAL_RANK.
        if not has_size and (name == "torchrun" or not has_rank):
            continue
        if not has_size:  # an MPI local rank without its local size
            split = _mpi4py_placement()
            if split is not None:
                return split
            raise TopologyError(f"{lr_var} is set but {ls_var} is not, so MPI's placement is unknown; {_TO_DO}")
        local_size = _env_int(ls_var, 1)
        if not has_rank and name != "torchrun":
            split = _mpi4py_placement()
            if split is not None:
                return split
            raise TopologyError(f"{ls_var} is set but {lr_var} is not, so MPI's placement is unknown (MPI does not "
                                f"promise node-by-node placement); {_TO_DO}")
        local_rank = _env_int(lr_var, 0) if has_rank else -1
        if local_rank >= local_size:
            raise TopologyError(f"{lr_var}={local_rank} is not below {ls_var}={local_size}; {_TO_DO}")
        optional = {var: _env_int(var, 0) for var in (node_var, rank_var, world_var)
                    if var and os.environ.get(var)}
        return _Placement(name, f"{lr_var}/{ls_var}", local_rank, local_size,
                          optional.get(node_var, -1) if node_var else -1, optional.get(rank_var, -1),
                          optional.get(world_var, -1), os.environ.get(host_var, "") if host_var else "")
    return _mpi4py_placement()


def _mpi4py_placement() -> _Placement | None:
    """MPI's own node split (``COMM_TYPE_SHARED``), where the program has imported and initialised mpi4py.

    Never imports or initialises MPI itself. The split is an MPI collective over ``COMM_WORLD``
    (MPI has no timeout for it): every MPI rank must call ``from_env``/``detect`` together.
    """
    mpi = sys.modules.get("mpi4py.MPI")
    if mpi is None:
        return None
    try:
        if not mpi.Is_initialized() or mpi.Is_finalized() or mpi.COMM_WORLD.Get_size() <= 1:
            return None
        world = mpi.COMM_WORLD
        shared = world.Split_type(mpi.COMM_TYPE_SHARED)
        try:
            local_rank, local_size = shared.Get_rank(), shared.Get_size()
        finally:
            shared.Free()
    except mpi.Exception as exc:
        raise TopologyError(f"MPI's shared-memory split (COMM_TYPE_SHARED) failed: {exc}; {_TO_DO}") from exc
    return _Placement(_MPI4PY, "MPI.COMM_WORLD.Split_type(COMM_TYPE_SHARED)", local_rank, local_size,
                      launcher_rank=world.Get_rank(), launcher_world=world.Get_size())


def _exchange_rows(row: list[int], group, timeout: float | None, op: str) -> list[list[int]]:
    """All-gather one small int64 row per rank over ``group``, bounded by ``timeout`` seconds."""
    size = dist.get_world_size(group)
    mine = torch.tensor(row, dtype=torch.int64)
    out = [torch.zeros_like(mine) for _ in range(size)]
    wait_work(dist.all_gather(out, mine, group=group, async_op=True), timeout, op)
    return [[int(v) for v in t.tolist()] for t in out]


def _nodes_from_rows(rows: list[list[int]], group) -> list[list[int]]:
    """The nodes (group ranks) that every rank's placement row describes; the same on every rank.

    Every check below reads the gathered rows only, so an inconsistency raises the same
    ``TopologyError`` on every rank.
    """
    size = len(rows)
    launchers = [_LAUNCHER_CODES[row[0]] for row in rows]
    if len(set(launchers)) > 1:
        seen: dict[str, list[int]] = {}
        for r, name in enumerate(launchers):
            seen.setdefault(name, []).append(r)
        detail = ", ".join(f"ranks {rs} see {name!r}" for name, rs in seen.items())
        raise TopologyError(f"ranks disagree on their launcher ({detail}): their environments differ; start every "
                            f"rank with the same launcher or {_TO_DO}", op="topology.from_env")
    launcher = launchers[0]
    host = [row[1] for row in rows]
    if launcher == _NO_LAUNCHER:  # host names only: one node per host
        by_host: dict[int, list[int]] = {}
        for r, h in enumerate(host):
            by_host.setdefault(h, []).append(r)
        return list(by_host.values())
    local_rank, local_size, node_rank, launcher_rank, launcher_world = ([row[i] for row in rows] for i in range(2, 7))
    whole = size == dist.get_world_size()  # the group is all of WORLD: the launcher's view is complete
    if whole:
        worlds = sorted({w for w in launcher_world if w >= 0})
        if worlds and worlds != [size]:
            raise TopologyError(f"the {launcher} variables describe a world of {worlds} ranks but the process "
                                f"group has {size}: they were probably inherited from an outer launcher; unset "
                                f"them or {_TO_DO}", op="topology.from_env")
        if min(launcher_rank) >= 0 and len(set(launcher_rank)) != size:
            dup = sorted({v for v in launcher_rank if launcher_rank.count(v) > 1})
            raise TopologyError(f"several ranks report the same {launcher} rank {dup}: the variables were "
                                f"probably inherited from an outer launcher; unset them or {_TO_DO}",
                                op="topology.from_env")
    if launcher == "torchrun":
        return _torchrun_nodes(local_rank, local_size, node_rank, group, whole)
    return _mpi_nodes(launcher, host, local_rank, local_size, launcher_rank, whole)


def _torchrun_nodes(local_rank, local_size, node_rank, group, whole: bool) -> list[list[int]]:
    """torchrun places node by node (``GROUP_RANK``); checked against every rank's ``LOCAL_RANK``."""
    size = len(local_rank)
    glob = [dist.get_global_rank(group, r) if group is not None else r for r in range(size)]
    if min(node_rank) >= 0:
        node_of = node_rank
    elif len(set(local_size)) == 1:
        node_of = [g // local_size[0] for g in glob]
    else:
        raise TopologyError(f"LOCAL_WORLD_SIZE differs across ranks ({local_size}) and GROUP_RANK is not set, so "
                            f"the nodes are unknown; {_TO_DO}", op="topology.from_env")
    by_node: dict[int, list[int]] = {}
    for r in sorted(range(size), key=lambda r: glob[r]):
        by_node.setdefault(node_of[r], []).append(r)
    nodes = [by_node[k] for k in sorted(by_node)]
    bad = "the torchrun variables (GROUP_RANK, LOCAL_RANK, LOCAL_WORLD_SIZE) are inconsistent"
    for k, node in zip(sorted(by_node), nodes):
        sizes = sorted({local_size[r] for r in node})
        locs = [local_rank[r] for r in node]
        if len(sizes) > 1:
            raise TopologyError(f"{bad}: the ranks {node} of node {k} report LOCAL_WORLD_SIZE {sizes}; {_TO_DO}",
                                op="topology.from_env", ranks=node)
        known = [v for v in locs if v >= 0]
        if len(set(known)) != len(known):
            raise TopologyError(f"{bad}: the ranks {node} of node {k} report LOCAL_RANK {locs} (repeated); the "
                                f"variables were probably inherited from an outer launcher; {_TO_DO}",
                                op="topology.from_env", ranks=node)
        if whole:
            first = glob[node[0]]
            expected = list(range(first, first + sizes[0]))
            if [glob[r] for r in node] != expected or any(v >= 0 and v != i for i, v in enumerate(locs)):
                raise TopologyError(f"{bad}: node {k} holds global ranks {[glob[r] for r in node]} with LOCAL_RANK "
                                    f"{locs}, but torchrun places node by node (ranks {expected} with LOCAL_RANK "
                                    f"0..{sizes[0] - 1}); {_TO_DO}", op="topology.from_env", ranks=node)
    if whole and [glob[r] for node in nodes for r in node] != list(range(size)):
        raise TopologyError(f"{bad}: the nodes {nodes} in GROUP_RANK order are not node by node; {_TO_DO}",
                            op="topology.from_env")
    return nodes


def _mpi_nodes(launcher, host, local_rank, local_size, launcher_rank, whole: bool) -> list[list[int]]:
    """MPI's placement from every rank's (host, local rank, local size); never assumes contiguity.

    Ranks with the same host and local size share a host; where one host holds several nodes (hosts
    that resolve to one machine) the k-th rank, in MPI rank order, with local rank ``l`` belongs to
    that host's k-th node, which is exact for block and round-robin placements. Each node must then
    hold local ranks 0..L-1 exactly, L being every member's local size.
    """
    size = len(local_rank)
    order = sorted(range(size), key=lambda r: launcher_rank[r] if min(launcher_rank) >= 0 else r)
    buckets: dict[tuple[int, int], list[int]] = {}
    for r in order:
        buckets.setdefault((host[r], local_size[r]), []).append(r)
    nodes: list[list[int]] = []
    for (_, lsize), members in buckets.items():
        count: dict[int, int] = {}
        sub: list[list[int]] = []
        for r in members:
            k = count.get(local_rank[r], 0)
            count[local_rank[r]] = k + 1
            if k == len(sub):
                sub.append([])
            sub[k].append(r)
        if not whole and len(sub) > 1:
            raise TopologyError(f"the ranks {sorted(members)} of this subgroup share one host with local size {lsize} "
                                "and repeated local ranks: which of them share a node cannot be told apart from "
                                "MPI's local ranks on a subgroup; build the Topology on WORLD and derive the "
                                f"subgroup's nodes with from_nodes, or {_TO_DO}", op="topology.from_env")
        for node in sub:
            locs = sorted(local_rank[r] for r in node)
            if whole and locs != list(range(lsize)):
                raise TopologyError(f"MPI's placement is inconsistent ({launcher}): ranks {sorted(node)} of one host "
                                    f"hold local ranks {locs}, but each of them reports local size {lsize}; the "
                                    f"variables were probably set by hand or inherited; {_TO_DO}",
                                    op="topology.from_env", ranks=sorted(node))
        nodes.extend(sorted(node) for node in sub)
    return sorted(nodes, key=min)


def _env_extra() -> dict:
    extra: dict = {}
    rate = os.environ.get("COMMOPT_LINK_RATE_BPS")
    if rate:
        extra["link_rate_bps"] = parse_rate(rate)
    links = os.environ.get("COMMOPT_LINK_MAP")
    if links:
        try:
            extra["links"] = LinkMap.from_dict(json.loads(links))
        except (ValueError, KeyError, TypeError) as e:
            raise TopologyError(f"COMMOPT_LINK_MAP is not a link map ({e!r}): it must be the JSON of "
                                f"commopt.comm.links.LinkMap.to_dict(), as commopt-bench cluster writes it; unset it "
                                f"or fix it", op="topology.from_env") from e
    switch = ina_switch_from_env()
    if switch is not None:
        host, port = switch
        extra["ina_switch"] = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    return extra


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
        links: the per-node (star) or per-pair (mesh) link rates of a cluster whose links are not
            all equal (``commopt.comm.links.LinkMap``; from ``COMMOPT_LINK_MAP``, which the emulated
            cluster sets, or :func:`commopt.comm.calibrate_links`); None on a uniform cluster.
    """

    nodes: tuple[tuple[int, ...], ...]
    rank: int = 0
    world_size: int = 1
    group: object | None = field(default=None, compare=False, hash=False)
    link_rate_bps: float | None = None
    ina_switch: str | None = None
    links: LinkMap | None = None

    def __post_init__(self):
        _check_group(self.group, "Topology")
        object.__setattr__(self, "nodes", _canonical_nodes(self.nodes, "Topology", sort=False))
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
    # Every constructor reads its rank and size from ``group`` (None: WORLD), so a layout of more than
    # one rank needs an initialised process group: before init_process_group it raises TopologyError
    # saying so, rather than comparing the layout with a world of one.
    @classmethod
    def from_nodes(cls, nodes: list[list[int]], group=None, **extra) -> Topology:
        """A topology from an explicit list of nodes, each a list of ranks of ``group``.

        Args:
            nodes: the ranks of every node, e.g. ``[[0, 2], [1, 3]]``: a list (or tuple) of lists (or
                tuples) of ranks, each a Python int or an integer numpy/torch scalar (not bool, float
                or str: ``0.9`` or ``"01"`` is refused, never rounded or split). Ranks of a node need
                not be contiguous and nodes need not be equal in size; every rank of ``group`` appears
                exactly once. Node order is kept; ranks within a node are sorted.
            group: the process group the ranks refer to: a ``ProcessGroup``, or None for WORLD.
            **extra: ``link_rate_bps``, ``ina_switch``, ``links``.

        Raises:
            TypeError: ``nodes`` is not a list of lists of int ranks, or ``group`` is neither a
                ``ProcessGroup`` nor None.
            TopologyError: the nodes do not cover ranks 0..world_size-1 exactly once, or they hold more
                than one rank and ``torch.distributed.init_process_group`` has not been called yet.
        """
        return cls._build(nodes, group, "Topology.from_nodes", None, extra)

    @classmethod
    def _build(cls, nodes, group, where: str, what: str | None, extra: dict) -> Topology:
        """The topology of ``nodes`` over ``group``; ``what`` names the source in messages (None: the nodes)."""
        _check_group(group, where)
        canon = _canonical_nodes(nodes, where, sort=True)
        if what is None:
            what = "nodes " + repr(";".join(",".join(str(r) for r in n) for n in canon))
        _require_initialized(where, what, sum(len(n) for n in canon))
        rank, size = _group_rank_size(group, where)
        return cls(nodes=canon, rank=rank, world_size=size, group=group, **extra)

    @classmethod
    def from_spec(cls, spec: str, group=None, **extra) -> Topology:
        """A topology from a spec: ``"2x4"`` (2 nodes of 4 contiguous ranks) or ``"2+1"`` (sizes).

        ``"NxL"`` and ``"a+b+..."`` place ranks node by node; for other placements use
        :meth:`from_nodes` or ``COMMOPT_NODES``.

        Args:
            spec: a ``str``, ``"NxL"`` or node sizes joined by ``"+"``; the sizes must add up to the
                size of ``group``.
            group: a ``ProcessGroup``, or None for WORLD.
            **extra: ``link_rate_bps``, ``ina_switch``, ``links``.

        Raises:
            TypeError: ``spec`` is not a str (e.g. None or 3), or ``group`` is neither a
                ``ProcessGroup`` nor None.
            TopologyError: ``spec`` does not parse, has a node of size <= 0, describes more than one
                rank before ``torch.distributed.init_process_group``, or does not add up to the
                group's world size.
        """
        where = "Topology.from_spec"
        _check_group(group, where)
        if not isinstance(spec, str):
            raise TypeError(f"{where}: spec must be a str such as '2x4' (2 nodes of 4 ranks) or '2+1' (node sizes), "
                            f"got {type(spec).__name__} {spec!r}; for explicit nodes use "
                            "Topology.from_nodes([[0, 2], [1, 3]])")
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
        _require_initialized(where, f"topology spec {spec!r}", sum(sizes))
        rank, size = _group_rank_size(group, where)
        if sum(sizes) != size:
            raise TopologyError(f"topology spec {spec!r} describes {sum(sizes)} ranks but the group has "
                                f"world_size={size}; pass a spec whose sizes add up to {size}")
        nodes, start = [], 0
        for k in sizes:
            nodes.append(list(range(start, start + k)))
            start += k
        return cls._build(nodes, group, where, f"topology spec {spec!r}", extra)

    @classmethod
    def from_env(cls, group=None, *, timeout: float | None = None) -> Topology:
        """The topology the launcher's environment describes; the one place commopt reads its variables.

        In order:

        1. ``COMMOPT_NODES`` ("0,2;1,3": nodes separated by ';', ranks by ','), read locally.
        2. torchrun (``LOCAL_WORLD_SIZE``, with ``LOCAL_RANK`` and ``GROUP_RANK``): torchrun places
           node by node, so ``GROUP_RANK`` gives the nodes (or, without it, ``rank // LOCAL_WORLD_SIZE``);
           every rank's ``LOCAL_RANK`` and ``LOCAL_WORLD_SIZE`` is checked against that.
        3. MPI's placement: mpich's ``MPI_LOCALRANKID``/``MPI_LOCALNRANKS`` (with Hydra's
           ``PMI_HOSTNAME``, ``PMI_RANK``) or Open MPI's ``OMPI_COMM_WORLD_LOCAL_RANK``/``_LOCAL_SIZE``;
           where neither is set but the program has already imported and initialised ``mpi4py``
           (``COMM_WORLD`` larger than one), MPI's shared-memory split (``COMM_TYPE_SHARED``), an MPI
           collective without a timeout. MPI never promises node-by-node placement (``-hosts a:1,b:1
           -n 4`` gives ``0,2;1,3``), so nothing is assumed: ranks with the same host name and local
           size share a host, and where several nodes share one host name (hosts that resolve to one
           machine) the k-th rank, in MPI rank order, with local rank ``l`` is on that host's k-th
           node (exact for block and round-robin placements; for others set ``COMMOPT_NODES``).

        For 2 and 3 every rank's (launcher, host-name hash, local rank, local size, node rank,
        launcher rank, launcher world size) is all-gathered over ``group`` as int64 tensors, so this
        call is collective over ``group`` and the result, or the error, is the same on every rank.

        Also reads ``COMMOPT_LINK_RATE_BPS`` and ``COMMOPT_INA_SWITCH`` (through
        :func:`ina_switch_from_env`).

        Args:
            group: a ``ProcessGroup``, or None for WORLD.
            timeout: seconds the placement exchange may take before ``CommTimeoutError`` (None: the
                group's own timeout).

        Raises:
            TypeError: ``group`` is neither a ``ProcessGroup`` nor None.
            TopologyError: the environment gives no layout (a plain spawn; :meth:`detect` then works),
                a variable is malformed, the ranks' placements contradict each other or the launcher
                (e.g. variables inherited from an outer launcher), or the layout has more than one
                rank and ``torch.distributed.init_process_group`` has not been called yet.
            CommTimeoutError: a rank did not join the exchange within ``timeout``.
        """
        topo = cls._from_launcher(group, timeout, "Topology.from_env", fallback=False)
        if topo is None:
            raise TopologyError("the environment gives no layout: set COMMOPT_NODES (e.g. '0,1;2,3') or run "
                                "under torchrun or mpirun, or call Topology.detect()")
        return topo

    @classmethod
    def detect(cls, group=None, *, timeout: float | None = None) -> Topology:
        """``from_env()`` when the environment gives the layout, else host-name hashes exchanged.

        Without launcher variables every rank's host-name hash is all-gathered over ``group`` and each
        host is one node. Network namespaces of one machine share a host name, so inside the emulated
        cluster the environment (``COMMOPT_NODES``) is what tells nodes apart. Collective over
        ``group`` when it has more than one rank.

        Args:
            group: a ``ProcessGroup``, or None for WORLD.
            timeout: seconds the exchange may take before ``CommTimeoutError`` (None: the group's own).

        Raises:
            TypeError: ``group`` is neither a ``ProcessGroup`` nor None.
            TopologyError: as :meth:`from_env`, except that an environment without a layout is not an
                error; before ``torch.distributed.init_process_group`` a process without launcher
                variables is a world of one.
            CommTimeoutError: a rank did not join the exchange within ``timeout``.
        """
        return cls._from_launcher(group, timeout, "Topology.detect", fallback=True)

    @classmethod
    def _from_launcher(cls, group, timeout: float | None, where: str, *, fallback: bool) -> Topology | None:
        _check_group(group, where)
        extra = _env_extra()
        text = os.environ.get("COMMOPT_NODES")
        if text:
            try:
                nodes = [[int(r) for r in node.split(",") if r.strip()] for node in text.split(";")
                         if node.strip()]
            except ValueError:
                raise TopologyError(f"COMMOPT_NODES={text!r} is malformed: use '0,1;2,3'") from None
            if group is not None and group is not dist.group.WORLD and dist.is_initialized():
                # COMMOPT_NODES names global ranks: a sub-group's layout is its members' nodes, in
                # group ranks (the cover check of _build still catches a member it does not name).
                index = {g: i for i, g in enumerate(dist.get_process_group_ranks(group))}
                nodes = [kept for kept in ([index[r] for r in node if r in index] for node in nodes) if kept]
            return cls._build(nodes, group, where, f"COMMOPT_NODES={text!r}", extra)
        placement = _launcher_placement()
        if placement is None and not fallback:
            return None
        if placement is not None:
            _require_initialized(where, f"the {placement.launcher} placement ({placement.source})",
                                 max(placement.local_size, placement.launcher_world))
        rank, size = _group_rank_size(group, where)
        if size == 1:
            return cls(nodes=((0,),), rank=0, world_size=1, group=group, **extra)
        if placement is None:
            placement = _Placement(_NO_LAUNCHER, "host names", -1, -1)
        op = "topology.detect" if placement.launcher == _NO_LAUNCHER else "topology.from_env"
        rows = _exchange_rows(placement.row(), group, timeout, op)
        return cls._build(_nodes_from_rows(rows, group), group, where, "the exchanged placement", extra)

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
    def rails(self) -> list[list[int]]:
        """Rail j: the j-th rank of every node that has one, sorted (the order torch gives the
        members of a new group); one rail per local index of the largest node."""
        return [sorted(node[j] for node in self.nodes if len(node) > j) for j in range(max(len(n) for n in self.nodes))]

    @property
    def is_uniform(self) -> bool:
        """All nodes have the same number of ranks."""
        return len({len(n) for n in self.nodes}) == 1

    @property
    def two_levels(self) -> bool:
        """Nodes of equal size, more than one of them, of more than one rank each: where a
        hierarchy (an intra-node level and a rail level) applies."""
        return self.is_uniform and self.num_nodes > 1 and self.local_size > 1

    @property
    def layout(self) -> str:
        """A canonical string of the nodes, e.g. ``"0,1;2,3"`` (the ``COMMOPT_NODES`` format)."""
        return format_nodes(self.nodes)

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
        wait_work(dist.all_gather(out, mine, group=self.group, async_op=True), timeout, "topology.validate")
        values = [int(t.item()) for t in out]
        if len(set(values)) > 1:
            mine_v = values[self.rank]
            others = [r for r, v in enumerate(values) if v != mine_v]
            raise TopologyError(
                f"ranks disagree on the topology: rank {self.rank} has nodes {self.layout!r}, ranks "
                f"{others} have a different layout; build the topology from the same spec (or "
                f"COMMOPT_NODES) on every rank", op="topology.groups", ranks=others)

    def group_rank_to_global(self, rank: int) -> int:
        if self.group is None or not dist.is_initialized():
            return rank
        return dist.get_global_rank(self.group, rank)
