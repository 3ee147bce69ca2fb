"""``commopt-bench simulate``: predicted iteration time and exposed communication per schedule.

For a GPT-style model (``--model``, see ``commopt.schedules.simulator.TRANSFORMERS``) on
``--nodes`` x ``--ranks-per-node`` ranks, data parallel, with links given by their rate and
latency, it prints one row per schedule (no overlap, DDP, OverlapDataParallel in ready order,
OverlapDataParallel with the priority plan, and the priority plan with compression when
``--compression-ratio`` < 1), then the same model sharded (FSDP2 per layer flat and hierarchical,
the ZeRO++ recipe, HSDP plain and int8 across nodes), and writes the timeline of two iterations as a PNG (matplotlib, if
installed)::

    commopt-bench simulate --model gpt-1.3b --nodes 128 --ranks-per-node 8 --link-rate 400gbit

Compute comes from FLOPs: ``--tflops`` peak per rank times ``--mfu``; the link model is
``commopt.comm.cost`` (``--algorithm``; the inter-node level is the node's NIC shared by its ranks).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys

from ._plot import pyplot

__all__ = ["main"]


def _parser() -> argparse.ArgumentParser:
    from commopt.schedules.simulator import TRANSFORMERS

    p = argparse.ArgumentParser(prog="commopt-bench simulate", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="gpt-1.3b", choices=sorted(TRANSFORMERS))
    p.add_argument("--nodes", type=int, default=128)
    p.add_argument("--ranks-per-node", type=int, default=8)
    p.add_argument("--link-rate", default="400gbit", help="inter-node rate per node, tc units (400gbit)")
    p.add_argument("--link-latency-us", type=float, default=5.0)
    p.add_argument("--intra-rate", default="3600gbit", help="intra-node rate per rank (NVLink: 3600gbit)")
    p.add_argument("--intra-latency-us", type=float, default=2.0)
    p.add_argument("--algorithm", default="hierarchical", choices=["flat", "hierarchical", "leader"])
    p.add_argument("--tokens", type=int, default=16384, help="tokens per rank per iteration")
    p.add_argument("--tflops", type=float, default=989.0, help="peak TFLOP/s per rank (H100 bf16 dense: 989)")
    p.add_argument("--mfu", type=float, default=0.4, help="achieved fraction of peak")
    p.add_argument("--grad-bytes", type=int, default=2, help="bytes per gradient element (2: bf16)")
    p.add_argument("--bucket-cap-mb", type=float, default=25.0)
    p.add_argument("--first-bucket-cap-mb", type=float, default=1.0)
    p.add_argument("--partition-mb", default="auto", help="chunk size of the priority plan in MiB, or 'auto': "
                   "the best of 1..256 MiB by simulation (at scale each chunk pays the ring's latency)")
    p.add_argument("--credit-mb", type=float, default=0.0, help="MiB in flight (0: 2 x the partition)")
    p.add_argument("--optimizer-gbps", type=float, default=0.0,
                   help="optimizer throughput in GB of gradient per second (0: free)")
    p.add_argument("--compression-ratio", type=float, default=1.0, help="wire bytes / gradient bytes for the "
                   "compressed row (e.g. 0.5 for fp16 of fp32 gradients, 0.03 for 1-bit)")
    p.add_argument("--compress-gbps", type=float, default=0.0, help="compression throughput, GB/s (0: free)")
    p.add_argument("--overlap-slowdown", type=float, default=1.0,
                   help="compute takes this many times longer while the link is busy (SM or CPU contention; "
                        "commopt-bench overlap measures it)")
    p.add_argument("--tp", type=int, default=0, help="also model the blocks under tensor + sequence parallelism "
                   "of this size inside a node: torch's unfused plan against commopt's decomposed styles")
    p.add_argument("--link-rates", default=None, metavar="R0,R1,..",
                   help="links that differ: a star of per-node rates (tc units); prints the collectives' ring, "
                        "synthesized schedule and cut bound instead of the model's iteration (synthesized collectives)")
    p.add_argument("--up-rates", default=None, metavar="R0,R1,..", help="with --link-rates: the nodes' up rates")
    p.add_argument("--pair-rates", default=None, metavar="0-1:R,..",
                   help="links that differ: a direct-connect mesh of pair rates (e.g. 0-1:200mbit,1-2:200mbit,"
                        "0-2:50mbit)")
    p.add_argument("--png", default="simulate-timeline.png", help="timeline PNG ('' to skip)")
    p.add_argument("--json", default=None)
    return p


def run(args) -> list[dict]:
    """Simulate every schedule; return one row per schedule (also printed)."""
    from commopt.comm import Topology, cost
    from commopt.comm.topology import parse_rate
    from commopt.schedules.simulator import SCHEDULES, Schedule, link_service, simulate, transformer_layers

    n, local = args.nodes, args.ranks_per_node
    topo = Topology(nodes=tuple(tuple(range(i * local, (i + 1) * local)) for i in range(n)), rank=0,
                    world_size=n * local)
    model = cost.CostModel(cost.LinkModel(args.intra_latency_us * 1e-6, 8 / parse_rate(args.intra_rate)),
                           cost.LinkModel(args.link_latency_us * 1e-6, 8 / parse_rate(args.link_rate)))
    layers = transformer_layers(args.model, tokens=args.tokens, flops=args.tflops * 1e12 * args.mfu,
                                grad_bytes_per_param=args.grad_bytes)
    opt = 1 / (args.optimizer_gbps * 1e9) if args.optimizer_gbps else 0.0
    service = link_service(args.algorithm, topo, model)

    def sched(kind: str, part: float, **extra) -> Schedule:
        return Schedule(kind, bucket_cap_mb=args.bucket_cap_mb, first_bucket_cap_mb=args.first_bucket_cap_mb,
                        partition_mb=part, credit_mb=args.credit_mb or 2 * (part or args.bucket_cap_mb),
                        optimizer_seconds_per_byte=opt, overlap_slowdown=args.overlap_slowdown, **extra)

    if args.partition_mb == "auto":
        # 0 keeps buckets whole (then the credit is two bucket caps).
        part = min((0, 1, 4, 16, 64, 256), key=lambda m: (simulate(layers, service, sched("priority", m)).iteration, m))
        label = f"{part} MiB" if part else "whole buckets"
        credit = args.credit_mb or 2 * (part or args.bucket_cap_mb)
        print(f"# partition chosen by simulation: {label}, credit {credit:g} MiB")
    else:
        part = float(args.partition_mb)
    inner = sched("ddp", 0)  # DiLoCo's inner loop: DDP inside each node
    runs = [(kind, sched(kind, part), 1.0) for kind in SCHEDULES]
    if args.compression_ratio < 1:
        squeeze = 1 / (args.compress_gbps * 1e9) if args.compress_gbps else 0.0
        runs.append((f"priority+compression x{args.compression_ratio:g}",
                     sched("priority", part, compression_ratio=args.compression_ratio,
                           compress_seconds_per_byte=squeeze), args.compression_ratio))
    grad = sum(x.grad_bytes for x in layers)
    print(f"# {args.model}: {grad / 2**30:.2f} GiB of gradients over {len(layers)} layers; {n} nodes x {local} "
          f"ranks = {n * local}; inter {args.link_rate}, intra {args.intra_rate}; {args.algorithm}; "
          f"{args.tokens} tokens/rank at {args.tflops * args.mfu:.0f} TFLOP/s")
    _header("schedule")
    rows, results = [], {}
    for name, sched, ratio in runs:
        r = simulate(layers, link_service(args.algorithm, topo, model, ratio), sched)
        results[name] = r
        rows.append(_row(name, r))
    rows += _sharded_rows(args, layers, topo, model, opt)
    rows += _diloco_rows(args, layers, topo, model, inner)
    if args.tp > 1:
        rows += _tensor_parallel_rows(args, model)
    if args.png:
        _plot(results, args.png)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "rows": rows}, f, indent=1)
    return rows


def _header(what: str) -> None:
    print(f"{what:<34}{'iter ms':>10}{'compute ms':>12}{'comm ms':>10}{'exposed ms':>12}{'hidden':>8}")


def _row(name: str, r) -> dict:
    """Print one simulated iteration and return it as a JSON row."""
    print(f"{name:<34}{r.iteration * 1e3:>10.1f}{r.compute * 1e3:>12.1f}{r.communication * 1e3:>10.1f}"
          f"{r.exposed * 1e3:>12.1f}{r.overlap:>8.0%}")
    return {"schedule": name, "iteration": r.iteration, "compute": r.compute, "communication": r.communication,
            "exposed": r.exposed, "hidden": r.overlap}


def _sharded_rows(args, layers, topo, model, opt: float) -> list[dict]:
    """The same model sharded (FSDP2 per layer, HSDP, the ZeRO++ recipe), beside the DDP rows."""
    from commopt.schedules.simulator import ShardedPlan, quantized_ratio, simulate_sharded

    def ratio(bits: int) -> float:
        return quantized_ratio(bits, element_bytes=args.grad_bytes)

    local = topo.local_size
    plans = [("fsdp2 (flat)", ShardedPlan("fsdp")),
             ("fsdp2 hierarchical", ShardedPlan("fsdp", "hierarchical")),
             (f"zero++ (int8 ag, hpZ {local}, int4 rs)", ShardedPlan("fsdp", "hierarchical", hpz=True,
                                                                 weight_ratio=ratio(8), grad_ratio=ratio(4))),
             ("hsdp", ShardedPlan("hsdp")),
             ("hsdp, int8 across nodes", ShardedPlan("hsdp", grad_ratio=ratio(8)))]
    _header("sharded")
    return [_row(name, simulate_sharded(layers, topo, dataclasses.replace(plan, optimizer_seconds_per_byte=opt),
                                        model)) for name, plan in plans]


def _diloco_rows(args, layers, topo, model, inner) -> list[dict]:
    """DiLoCo beside the rows above: each node a worker training with DDP inside it (``inner``: DDP's
    schedule, the optimizer's cost included), the pseudo-gradient (fp32, or int8 / int4 blocks)
    all-reduced along the rails every H inner steps, streamed in fragments."""
    from commopt.schedules.simulator import quantized_ratio, simulate_diloco

    pseudo = 4 / args.grad_bytes  # pseudo-gradients travel in fp32 whatever the training dtype
    configs = [("diloco H=8, fp32", 8, 1, 0, 1.0), ("diloco H=32, fp32", 32, 1, 0, 1.0),
               ("diloco H=32, int8", 32, 1, 0, quantized_ratio(8)),
               ("diloco H=32, int4, 4 fragments", 32, 4, 4, quantized_ratio(4))]
    print(f"# diloco: one worker per node (DDP over the node's {args.intra_rate} link inside it), outer syncs "
          f"along the rails over the {args.link_rate} node link; per inner step")
    print(f"{'diloco':<34}{'step ms':>10}{'inner ms':>12}{'sync ms':>10}{'exposed ms':>12}{'link MB':>8}")
    rows = []
    for name, h, frags, delay, ratio in configs:
        r = simulate_diloco(layers, topo, model, sync_every=h, fragments=frags, delay=delay, ratio=ratio,
                            schedule=inner, pseudo_bytes_per_param_byte=pseudo)
        print(f"{name:<34}{r.step * 1e3:>10.1f}{r.inner * 1e3:>12.1f}{r.sync * 1e3:>10.1f}{r.exposed * 1e3:>12.2f}"
              f"{r.link_bytes_per_step / 2**20:>8.1f}")
        rows.append({"schedule": name, "iteration": r.step, "inner": r.inner, "sync": r.sync, "exposed": r.exposed,
                     "link_bytes_per_step": r.link_bytes_per_step})
    return rows


def _tensor_parallel_rows(args, model) -> list[dict]:
    """The model's blocks under tensor + sequence parallelism inside a node (``--tp``): torch's
    unfused plan against commopt's decomposed styles, per iteration (every block, forward + backward)."""
    from commopt.schedules.simulator import TRANSFORMERS, simulate_tensor_parallel

    blocks = TRANSFORMERS[args.model].n_layer
    print(f"# tensor parallel: TP {args.tp} over the intra-node link ({args.intra_rate}), {blocks} blocks, "
          f"{args.tokens} tokens per TP group; the data-parallel rows above are what crosses the nodes")
    _header("tensor parallel (per iteration)")
    rows = []
    for name, decomposed in (("tp: torch plan (unfused)", False), ("tp: commopt styles (decomposed)", True)):
        r = simulate_tensor_parallel(args.model, tp=args.tp, tokens=args.tokens, flops=args.tflops * 1e12 * args.mfu,
                                     link=model.intra, decomposed=decomposed, activation_bytes=args.grad_bytes)
        step, compute, comm, exposed = (blocks * v for v in (r.step, r.compute, r.communication, r.exposed))
        hidden = 1 - exposed / comm if comm else 1.0
        print(f"{name:<34}{step * 1e3:>10.1f}{compute * 1e3:>12.1f}{comm * 1e3:>10.1f}{exposed * 1e3:>12.1f}"
              f"{hidden:>8.0%}")
        rows.append({"schedule": name, "iteration": step, "compute": compute, "communication": comm,
                     "exposed": exposed, "hidden": hidden})
    return rows


def _plot(results: dict, path: str) -> None:
    plt = pyplot("timeline")
    if plt is None:
        return
    fig, axes = plt.subplots(len(results), 1, figsize=(12, 1.4 * len(results) + 1), sharex=True, squeeze=False)
    colors = {"F": "tab:blue", "B": "tab:orange", "O": "tab:red", "b": "tab:green"}
    for ax, (name, r) in zip(axes[:, 0], results.items()):
        for lane, y in (("compute", 1), ("link", 0)):
            bars = [(s * 1e3, (e - s) * 1e3) for ln, _, s, e in r.timeline if ln == lane]
            cols = [colors[label[0]] for ln, label, _, _ in r.timeline if ln == lane]
            ax.broken_barh(bars, (y - 0.4, 0.8), facecolors=cols, edgecolor="white", linewidth=0.3)
        ax.set_yticks([0, 1], ["link", "compute"])
        ax.set_title(f"{name}: {r.iteration * 1e3:.1f} ms/iteration, {r.exposed * 1e3:.1f} ms exposed", fontsize=9)
    axes[-1, 0].set_xlabel("ms (two iterations; blue forward, orange backward, red optimizer, green reductions)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    print(f"# timeline written to {path}")


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.link_rates or args.pair_rates:
        from ._simulate_synth import links_from, run_synth

        try:
            links = links_from(args.link_rates, args.pair_rates, args.up_rates)
        except ValueError as e:
            print(f"commopt-bench simulate: {e}", file=sys.stderr)
            return 2
        rows = run_synth(links)
        if args.json:
            with open(args.json, "w", encoding="utf-8") as f:
                json.dump({"kind": "simulate-synth", "results": rows}, f, indent=1)
        return 0
    run(args)
    return 0
