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
    """The ``LinkMap`` of the options (rates in tc units, as ``commopt-bench cluster`` takes them)."""
    from commopt.comm.links import LinkMap
    from commopt.comm.topology import parse_rate

    if pair_rates:
        pairs: dict = {}
        nodes = 0
        for item in pair_rates.split(","):
            key, _, rate = item.partition(":")
            a, _, b = key.partition("-")
            i, j, r = int(a), int(b), parse_rate(rate) / 8
            pairs[(i, j)] = pairs[(j, i)] = r
            nodes = max(nodes, i + 1, j + 1)
        return LinkMap.mesh(nodes, pairs)
    down = [parse_rate(r) / 8 for r in link_rates.split(",")]
    up = [parse_rate(r) / 8 for r in up_rates.split(",")] if up_rates else down
    return LinkMap.star(up, down)


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
