"""The links a cluster really has, measured: pairwise probes between the nodes that fill
``Topology.links`` (docs/architecture.md, "synthesized collectives").

:func:`calibrate_links` times a transfer between the first ranks of every ordered pair of nodes, one
pair at a time (N(N-1) probes: seconds at N <= 4 on 200 Mbit/s links), then every node sending to all the
others at once. A node whose fan-out is no faster than its fastest single peer sends through one port
(a star: a switch, each node one link, ``up`` and ``down`` port rates); a fan-out that adds the pairs up
means independent links (a direct-connect mesh). :func:`link_map` makes that call from the measured
seconds, so the classification is a pure function of the timings. A cluster whose pairs all measure
within ``tolerance`` of each other is uniform: the map is None, and nothing changes.
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist

from .engine import wait_work
from .links import LinkMap
from .topology import Topology

__all__ = ["calibrate_links", "link_map"]


def link_map(pair_seconds: torch.Tensor, fan_seconds: torch.Tensor, nbytes: int, *, tolerance: float = 0.15,
             alpha: float = 50e-6) -> LinkMap | None:
    """The link map the probes show, or None where every pair is within ``tolerance`` of the others.

    Args:
        pair_seconds: ``[N, N]`` seconds of ``nbytes`` from node i to node j alone (diagonal ignored).
        fan_seconds: ``[N, N]`` seconds, receiver j's, of ``nbytes`` from i while i sent to every node at once.
        nbytes: the bytes of one probe.
        tolerance: relative spread of the pair rates under which the cluster counts as uniform.
        alpha: the map's per-message latency.
    """
    n = pair_seconds.shape[0]
    rate = [[nbytes / float(pair_seconds[i, j]) if i != j else 0.0 for j in range(n)] for i in range(n)]
    rates = [rate[i][j] for i in range(n) for j in range(n) if i != j]
    if not rates or max(rates) <= min(rates) * (1 + tolerance):
        return None
    fan = [(n - 1) * nbytes / max(float(fan_seconds[i, j]) for j in range(n) if j != i) for i in range(n)]
    shared = all(fan[i] <= 1.5 * max(rate[i][j] for j in range(n) if j != i) for i in range(n))
    if shared:  # one port per node: i -> j runs at min(up_i, down_j)
        up = [max(rate[i][j] for j in range(n) if j != i) for i in range(n)]
        down = [max(rate[i][j] for i in range(n) if i != j) for j in range(n)]
        return LinkMap.star(up, down, alpha=alpha)
    return LinkMap.mesh(n, {(i, j): rate[i][j] for i in range(n) for j in range(n) if i != j}, alpha=alpha)


def calibrate_links(topology: Topology, nbytes: int = 4 << 20, timeout: float = 120.0) -> LinkMap | None:
    """Measure the links between ``topology``'s nodes (collective over its group: call it on every rank);
    the map for ``Topology(..., links=...)``, the same on every rank, or None on a uniform cluster.

    Args:
        topology: the layout; the first rank of each node probes for it.
        nbytes: bytes per probe (large enough to fill the socket buffers: 4 MiB by default).
        timeout: seconds each probe may take (``CommTimeoutError`` past it).
    """
    group, me = topology.group, topology.rank
    leaders = [node[0] for node in topology.nodes]
    n = len(leaders)
    if n < 2:
        return None
    pair = torch.zeros(n, n, dtype=torch.float64)
    fan = torch.zeros(n, n, dtype=torch.float64)
    payload = torch.zeros(nbytes // 4, dtype=torch.float32)
    inbox = torch.empty_like(payload)

    def sync() -> None:
        wait_work(dist.all_reduce(torch.zeros(1), group=group, async_op=True), timeout, "calibrate_links")

    for src in range(n):
        for dst in [d for d in range(n) if d != src] + [None]:  # each pair alone, then the fan-out
            sync()
            t0 = time.perf_counter()
            works = []
            if dst is None:
                if me == leaders[src]:
                    works = [dist.isend(payload, group=group, group_dst=leaders[d]) for d in range(n) if d != src]
                elif me in leaders:
                    works = [dist.irecv(inbox, group=group, group_src=leaders[src])]
            elif me == leaders[src]:
                works = [dist.isend(payload, group=group, group_dst=leaders[dst])]
            elif me == leaders[dst]:
                works = [dist.irecv(inbox, group=group, group_src=leaders[src])]
            for w in works:
                wait_work(w, timeout, "calibrate_links")
            if works and me != leaders[src]:  # the receiver's clock
                (fan if dst is None else pair)[src, leaders.index(me)] = time.perf_counter() - t0
    both = torch.stack([pair, fan])
    wait_work(dist.all_reduce(both, group=group, async_op=True), timeout, "calibrate_links")
    # every rank classifies the same seconds: the same map everywhere
    return link_map(both[0], both[1], nbytes)
