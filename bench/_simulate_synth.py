"""``commopt-bench simulate --link-rates R0,R1,.. | --pair-rates 0-1:R,..``: collectives on links that
differ (issue 40), by simulation: for each collective and size, the ring (what ``flat`` and the
hierarchical rails run, in rank order and in its best order), the synthesized schedule
(``commopt.comm.synthesis``), the cut bound no schedule beats, and how long synthesis took. One rank
per node (a node of L ranks runs one such schedule per rail, each on 1/L of the link)."""

from __future__ import annotations

import itertools
import time

__all__ = ["links_from", "run_synth"]

_SIZES = (64 << 10, 1 << 20, 16 << 20)
_COLLECTIVES = ("allreduce", "reducescatter", "allgather")


def links_from(link_rates: str | None, pair_rates: str | None, up_rates: str | None = None):
    """The ``LinkMap`` of the options, parsed as ``commopt-bench cluster`` parses them (its
    ``bench/cluster/fabric.py``: tc units, ``I-J:R`` both ways or ``I>J:R`` one, every check).

    Raises:
        ValueError: naming the option at fault.
    """
    from commopt.comm.links import LinkMap

    from .cluster.fabric import parse_fabric

    if pair_rates:
        nodes = 1 + max(int(x) for item in pair_rates.split(",") for x in item.split(":")[0].replace(">", "-")
                        .split("-") if x.strip().isdigit())
        fab = parse_fabric(nodes, fabric="mesh", pair_rates=pair_rates)
    else:
        fab = parse_fabric(len(link_rates.split(",")), link_rates=link_rates, up_rates=up_rates)
    return LinkMap.from_dict(fab.link_map()) if fab.link_map() else LinkMap.star([r / 8 for r in fab.up])


def run_synth(links, log=print) -> list[dict]:
    """Simulate every collective at each size on ``links``; the rows (also printed)."""
    from commopt.comm.synthesis import bound, synthesize
    from commopt.comm.synthesis.sim import simulate, simulate_ring

    n = links.nodes
    orders = [list(p) for p in itertools.permutations(range(1, n))][:120]
    log(f"# commopt-bench simulate: {n} nodes, {links.kind}; ring: rank order and its best order; synth: the "
        f"synthesized schedule; cut: the bound no schedule beats; ms")
    log(f"{'collective':<14}{'size':>9}{'ring':>10}{'best ring':>11}{'synth':>10}{'cut':>10}{'vs best':>9}"
        f"{'synth s':>9}")
    rows = []
    for coll in _COLLECTIVES:
        for size in _SIZES:
            ring = simulate_ring(coll, links, size)
            best = min(simulate_ring(coll, links, size, [0] + o) for o in orders)
            t0 = time.process_time()
            sched = synthesize(coll, links, nbytes=size)
            spent = time.process_time() - t0
            synth = simulate(sched, links, size)
            cut = bound(coll, links, size)
            rows.append({"collective": coll, "size": size, "ring_s": ring, "best_ring_s": best, "synth_s": synth,
                         "cut_s": cut, "synthesis_s": spent, "schedule": sched.name})
            log(f"{coll:<14}{size >> 10:>8}K{ring * 1e3:>10.2f}{best * 1e3:>11.2f}{synth * 1e3:>10.2f}"
                f"{cut * 1e3:>10.2f}{best / synth:>8.2f}x{spent:>9.3f}")
    return rows
