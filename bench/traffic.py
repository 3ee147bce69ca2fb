"""``commopt-bench traffic``: which rank pairs exchange how many bytes, per algorithm.

Computes the traffic matrix of one training iteration (every gradient bucket of ``--model``
all-reduced) for the flat and hierarchical all-reduce, and of one all-to-all of ``--alltoall-mb``
per rank (MoE dispatch) for the flat and 2-D all-to-all, from each algorithm's phases and sizes
(``commopt.schedules.simulator.traffic_matrix``). Prints, per algorithm, the bytes that cross node
links, the share of rank pairs that exchange nothing, and the share of inter-node bytes that stay on
rails; draws the matrices as heatmaps (matplotlib, if installed)::

    commopt-bench traffic --nodes 8 --ranks-per-node 8 --model gpt2-124m

A survey of LLM training infrastructure (arXiv 2407.20018) reports that 99 % of GPU pairs exchange
nothing in GPT-scale training: hierarchical and 2-D traffic is that sparse and rail-aligned.
"""

from __future__ import annotations

import argparse
import json

from ._plot import pyplot

__all__ = ["main"]


def _parser() -> argparse.ArgumentParser:
    from commopt.schedules.simulator import TRANSFORMERS

    p = argparse.ArgumentParser(prog="commopt-bench traffic", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--nodes", type=int, default=8)
    p.add_argument("--ranks-per-node", type=int, default=8)
    p.add_argument("--model", default="gpt2-124m", choices=sorted(TRANSFORMERS))
    p.add_argument("--grad-bytes", type=int, default=2)
    p.add_argument("--bucket-cap-mb", type=float, default=25.0)
    p.add_argument("--alltoall-mb", type=float, default=64.0, help="per-rank all-to-all buffer, MiB")
    p.add_argument("--png", default="traffic.png", help="heatmaps ('' to skip)")
    p.add_argument("--json", default=None)
    return p


def run(args) -> dict:
    """Compute the matrices and their summaries; returns {name: summary}."""
    import torch

    from commopt.comm import Topology
    from commopt.schedules.simulator import Schedule, iteration_traffic, traffic_matrix, transformer_layers

    n, local = args.nodes, args.ranks_per_node
    p = n * local
    topo = Topology(nodes=tuple(tuple(range(i * local, (i + 1) * local)) for i in range(n)), rank=0, world_size=p)
    layers = transformer_layers(args.model, tokens=1, flops=1.0, grad_bytes_per_param=args.grad_bytes)
    sched = Schedule("ddp", bucket_cap_mb=args.bucket_cap_mb)
    a2a = args.alltoall_mb * 2**20
    mats = {
        "all-reduce flat (ring)": iteration_traffic(layers, "flat", topo, sched),
        "all-reduce hierarchical": iteration_traffic(layers, "hierarchical", topo, sched),
        "all-to-all flat": traffic_matrix("flat", a2a, topo, op="alltoall"),
        "all-to-all 2-D": traffic_matrix("2d", a2a, topo, op="alltoall"),
    }
    node = torch.tensor([i for i in range(n) for _ in range(local)])
    lrank = torch.tensor([j for _ in range(n) for j in range(local)])
    cross = node[:, None] != node[None, :]
    rail = lrank[:, None] == lrank[None, :]
    off_diag = ~torch.eye(p, dtype=torch.bool)
    print(f"# {p} ranks = {n} nodes x {local}; {args.model} gradients "
          f"{sum(x.grad_bytes for x in layers) / 2**20:.0f} MiB in {args.bucket_cap_mb:g} MiB buckets; "
          f"all-to-all {args.alltoall_mb:g} MiB per rank")
    print(f"{'algorithm':<26}{'total GiB':>10}{'inter-node GiB':>16}{'idle pairs':>12}{'on rails':>10}"
          f"{'max pair MiB':>14}")
    summary = {}
    for name, m in mats.items():
        inter = float(m[cross].sum())
        idle = float((m[off_diag] == 0).float().mean())
        on_rail = float(m[cross & rail].sum()) / inter if inter else 1.0
        summary[name] = {"total": float(m.sum()), "inter_node": inter, "idle_pairs": idle, "on_rails": on_rail,
                         "max_pair": float(m.max())}
        print(f"{name:<26}{float(m.sum()) / 2**30:>10.2f}{inter / 2**30:>16.2f}{idle:>12.1%}{on_rail:>10.1%}"
              f"{float(m.max()) / 2**20:>14.1f}")
    if args.png:
        _plot(mats, args.png)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "summary": summary}, f, indent=1)
    return summary


def _plot(mats: dict, path: str) -> None:
    plt = pyplot("heatmap")
    if plt is None:
        return
    from matplotlib.colors import LogNorm
    fig, axes = plt.subplots(1, len(mats), figsize=(4.2 * len(mats), 4.2))
    for ax, (name, m) in zip(axes, mats.items()):
        data = m.numpy() / 2**20
        positive = data[data > 0]
        norm = LogNorm(vmin=max(positive.min(), 1e-6), vmax=positive.max()) if positive.size else None
        masked = data.copy()
        masked[masked <= 0] = float("nan")
        im = ax.imshow(masked, norm=norm, cmap="viridis", interpolation="nearest")
        ax.set_title(name, fontsize=9)
        ax.set_xlabel("to rank")
        ax.set_ylabel("from rank")
        fig.colorbar(im, ax=ax, fraction=0.046, pad=0.04, label="MiB")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    print(f"# heatmaps written to {path} (white: no traffic)")


def main(argv: list[str] | None = None) -> int:
    run(_parser().parse_args(argv))
    return 0
