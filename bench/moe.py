"""``commopt-bench moe``: an MoE layer's forward + backward time with and without all-to-all /
expert overlap (``schedules.moe``), for each all-to-all algorithm, measured interleaved.

Runs inside the emulated cluster, where the link time is there to hide::

    commopt-bench cluster --nodes 2 --ranks-per-node 2 --link-rate 200mbit -- commopt-bench moe

or with ``--spawn 4 --topology 2x2`` on loopback (CPU-bound: nothing to hide there).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.distributed as dist

from ._launch import launch
from ._progress import progress

__all__ = ["main"]


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="commopt-bench moe", description=__doc__.split("\n\n")[0])
    p.add_argument("--spawn", type=int, default=0, metavar="N", help="spawn N local ranks")
    p.add_argument("--topology", default=None, help="impose logical nodes, e.g. 2x2 (default: detect)")
    p.add_argument("--algos", default="flat,2d", help="all-to-all algorithms to compare")
    p.add_argument("--degrees", default="1,2,4", help="overlap degrees (1: no overlap)")
    p.add_argument("--tokens", type=int, default=1024, help="tokens per rank")
    p.add_argument("--d-model", type=int, default=256)
    p.add_argument("--d-hidden", type=int, default=512)
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--top-k", type=int, default=2, choices=(1, 2))
    p.add_argument("--capacity-factor", type=float, default=1.25)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--iters", type=int, default=7)
    p.add_argument("--timeout", type=float, default=300.0)
    return p


def _body(args) -> int:
    from commopt.comm import Topology

    from .models import MoE

    rank, world = dist.get_rank(), dist.get_world_size()
    topo = Topology.from_spec(args.topology) if args.topology else Topology.detect()
    configs = [(algo, deg) for algo in args.algos.split(",") for deg in map(int, args.degrees.split(","))]
    layers = {c: MoE(args.d_model, args.d_hidden, args.experts, top_k=args.top_k,
                     capacity_factor=args.capacity_factor, overlap_degree=c[1], topology=topo, algorithm=c[0],
                     seed=1) for c in configs}
    x = torch.randn(args.tokens, args.d_model, generator=torch.Generator().manual_seed(rank)).requires_grad_()
    times: dict[tuple[str, int], list[float]] = {c: [] for c in configs}
    bar = progress(args.warmup + args.iters, f"{len(configs)} configurations", rank=rank, unit="round")
    for it in range(args.warmup + args.iters):
        order = configs[it % len(configs):] + configs[:it % len(configs)]  # interleaved and rotated
        for c in order:
            dist.barrier()
            start = time.perf_counter()
            layers[c](x).square().mean().backward()
            t = torch.tensor([time.perf_counter() - start])
            dist.all_reduce(t, op=dist.ReduceOp.MAX)  # the slowest rank's time
            if it >= args.warmup:
                times[c].append(float(t))
        bar.update()
    bar.close()
    if rank == 0:
        print(f"# MoE forward+backward: {world} ranks, topology {topo.layout!r}, {args.tokens} tokens/rank, "
              f"d={args.d_model}, hidden={args.d_hidden}, {args.experts} experts, top-{args.top_k}, capacity "
              f"factor {args.capacity_factor}; median of {args.iters}, interleaved")
        base = {}
        for c in configs:
            med = statistics.median(times[c])
            base.setdefault(c[0], med if c[1] == 1 else None)
            ref = base.get(c[0])
            speed = f"  speed-up vs no overlap: {ref / med:.2f}x" if ref else ""
            print(f"  algo={c[0]:<5} overlap_degree={c[1]}  {med * 1e3:9.1f} ms  "
                  f"(min {min(times[c]) * 1e3:8.1f}){speed}")
    return 0


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    return launch(_body, args, spawn=args.spawn, timeout=args.timeout, single=False)
