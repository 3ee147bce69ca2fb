"""DiLoCo's workers: the replica grouping of WORLD that the outer loop averages over
(``schedules/diloco.py``; docs/guide.md, "Training across slow links: DiLoCo")."""

from __future__ import annotations

import torch.distributed as dist

from commopt.comm.algorithms.roles import DILOCO
from commopt.comm.checks import check_timeout
from commopt.comm.errors import TopologyError
from commopt.comm.runtime import context
from commopt.comm.topology import Topology

__all__ = ["worker_group", "worker_topology", "rail_topology"]

_NAME = "DiLoCo"


def worker_topology(topology: Topology | None = None, workers: str | list = "node",
                    timeout: float | None = None) -> Topology:
    """The workers as a :class:`~commopt.comm.Topology` over WORLD: one "node" per worker.

    Args:
        topology: the cluster's layout (None: ``Topology.detect()``, collective over WORLD).
        workers: ``"node"`` (one worker per node of ``topology``) or explicit workers, a list of
            lists of global ranks (e.g. ``[[0, 2], [1, 3]]``), which then replaces the topology.
        timeout: seconds a detection may wait for the other ranks.

    Raises:
        TypeError, ValueError: a bad argument; workers of unequal size (the rails need one rank of
            every local index on every worker); a topology over a subgroup.
    """
    timeout = check_timeout(_NAME, timeout)
    if topology is not None and not isinstance(topology, Topology):
        raise TypeError(f"{_NAME}: topology must be a commopt.comm.Topology or None (detected), got "
                        f"{type(topology).__name__} {topology!r}; e.g. Topology.from_spec('2x2')")
    if isinstance(workers, str):
        if workers != "node":
            raise ValueError(f"{_NAME}: workers must be 'node' (one worker per node of the topology) or a list "
                             f"of lists of ranks (e.g. [[0, 1], [2, 3]]), got {workers!r}")
        if not dist.is_initialized():
            raise ValueError(f"{_NAME}: torch.distributed is not initialised; call init_process_group() "
                             f"before building DiLoCo or its worker group")
        topo = context().topology(topology, None, timeout)
    elif isinstance(workers, (list, tuple)):
        if topology is not None:
            raise ValueError(f"{_NAME}: pass either topology (with workers='node') or explicit workers, not both")
        try:
            topo = Topology.from_nodes([list(w) for w in workers])
        except TopologyError as exc:
            raise ValueError(f"{_NAME}: workers {workers!r} are not a partition of the world's ranks: "
                             f"{exc.message if hasattr(exc, 'message') else exc}") from None
    else:
        raise TypeError(f"{_NAME}: workers must be 'node' or a list of lists of ranks, got "
                        f"{type(workers).__name__} {workers!r}")
    if topo.group is not None:
        raise ValueError(f"{_NAME}: the topology must describe WORLD (group=None): DiLoCo's groups are created "
                         f"over WORLD; build it with Topology.from_spec(spec) without group=")
    if not topo.is_uniform:
        raise ValueError(f"{_NAME}: workers of unequal size {[len(n) for n in topo.nodes]} ({topo.layout!r}): the "
                         f"outer all-reduce runs along the rails (one rank of each local index per worker), so "
                         f"every worker needs the same number of ranks; group the ranks into equal workers "
                         f"(workers=[[...], [...]])")
    return topo


def worker_group(topology: Topology | None = None, workers: str | list = "node", timeout: float | None = None):
    """This rank's worker's process group: what the inner DDP or FSDP2 runs on, built before the model
    is wrapped (``DDP(model, process_group=worker_group())``, ``DeviceMesh.from_group(worker_group(),
    "cpu")``). Collective over WORLD: call it on every rank, with the same arguments; ``DiLoCo`` with
    the same arguments reuses the group (created once per layout, in the runtime context).

    Returns:
        The group, or None where a worker is one rank (train that rank's model as it is: a DDP over
        ``None`` would be WORLD).
    """
    topo = worker_topology(topology, workers, timeout)
    if topo.world_size == 1:
        return None
    return context().groups(topo, DILOCO, timeout).intra


def rail_topology(topology: Topology, rail) -> Topology | None:
    """The topology of this rank's rail (one member per worker, in worker order) where the cluster's
    links differ (``topology.links``), so that the outer all-reduce can weigh a schedule made for them
    (``algorithm="auto"``: ``synth`` where it wins; every rank predicts the same); None elsewhere (the
    rail's own all-reduce, as always). The L rails of a worker share its links: each sees 1/L of them."""
    links = topology.links
    if links is None or links.uniform or rail is None:
        return None
    n = topology.num_nodes
    return Topology(nodes=tuple((i,) for i in range(n)), rank=dist.get_rank(rail), world_size=n, group=rail,
                    links=links.shared(topology.local_size))
