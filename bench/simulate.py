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

With ``--pp-stages`` it answers "how many pipeline stages across how slow a link" instead: one step
of a pipeline, one stage per rank, each boundary across a link of each ``--link-rates`` (or
``--link-rate``), torch's ``Schedule1F1B`` / ``ScheduleGPipe`` posting against commopt's executor,
per boundary codec, step against the compute-alone floor (``commopt.schedules.simulator.
simulate_pipeline``); ``--pp-dp`` adds the 2x2 of two 2-stage pipelines data-parallel over one link,
first come first served against boundary traffic first. The model's forward and backward come from
``--pp-forward-ms`` / ``--pp-backward-ms`` (the whole model, one micro-batch, split evenly over the
stages), or are measured on this machine from the bench GPT (one thread)::

    commopt-bench simulate --pp-stages 2,4,8 --pp-micro 8 --link-rates 200mbit,50mbit --codec none,int8
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
    pp = p.add_argument_group("pipeline parallelism (--pp-stages; then --link-rates lists the boundary links)")
    pp.add_argument("--pp-stages", default=None, metavar="S0,S1,..", help="model pipelines of these stage counts")
    pp.add_argument("--pp-micro", type=int, default=8, help="micro-batches per step")
    pp.add_argument("--pp-schedule", default="1f1b", choices=["1f1b", "gpipe"])
    pp.add_argument("--codec", default="none,int8", help="boundary codecs, both directions (none, bf16, int8, int4)")
    pp.add_argument("--pp-forward-ms", type=float, default=None, help="the whole model's forward per micro-batch "
                    "(default: measured from the bench GPT)")
    pp.add_argument("--pp-backward-ms", type=float, default=None, help="the whole model's backward per micro-batch")
    pp.add_argument("--pp-layers", type=int, default=4, help="bench GPT blocks (measured model)")
    pp.add_argument("--pp-d-model", type=int, default=256)
    pp.add_argument("--pp-seq", type=int, default=128)
    pp.add_argument("--pp-micro-batch", type=int, default=8, help="sequences per micro-batch")
    pp.add_argument("--pp-codec-gbps", type=float, default=None, help="encode and decode throughput each, GB of "
                    "fp32 per second (default: measured with the model, else free)")
    pp.add_argument("--pp-depth", type=int, default=2, help="commopt: receive buffers posted ahead")
    pp.add_argument("--pp-extra", type=int, default=1, help="commopt 1F1B: forwards in flight beyond torch's")
    pp.add_argument("--pp-dp", action="store_true", help="also the 2x2 (two 2-stage pipelines, data parallel "
                    "stage by stage over one link): FIFO against boundary traffic first")
    pp.add_argument("--pp-dp-chunk-mb", type=float, default=1.0, help="2x2: all-reduce chunk (bucket) in MiB")
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


def _pp_compute(args) -> tuple[float, float, float, list[float]]:
    """The whole model's forward and backward seconds per micro-batch, the codec's seconds per fp32
    byte (encode and decode each) and the gradient bytes of each half of the model: given, or
    measured from the bench GPT on this machine with one thread (a stage's rank has one core)."""
    import time

    import torch

    from commopt.schedules.simulator import layers_from_model

    from .models import GPT

    torch.manual_seed(0)
    model = GPT(vocab=256, d_model=args.pp_d_model, n_layers=args.pp_layers, n_heads=4, seq_len=args.pp_seq)
    params = [p.numel() * 4 for p in model.parameters()]
    blocks = [sum(p.numel() * 4 for p in b.parameters()) for b in model.blocks]
    half = len(blocks) // 2
    rest = sum(params) - sum(blocks)  # embeddings (stage 0), final norm and head (last stage)
    head = sum(p.numel() * 4 for p in (*model.ln.parameters(), *model.head.parameters()))
    grads = [sum(blocks[:half]) + rest - head, sum(blocks[half:]) + head]
    gbps = args.pp_codec_gbps
    if args.pp_forward_ms is not None and args.pp_backward_ms is not None:
        per_byte = 1 / (gbps * 1e9) if gbps else 0.0
        return args.pp_forward_ms / 1e3, args.pp_backward_ms / 1e3, per_byte, grads
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        tokens = torch.randint(256, (args.pp_micro_batch, args.pp_seq))
        layers = layers_from_model(model, tokens)
        act = torch.randn(args.pp_micro_batch * args.pp_seq, args.pp_d_model)
        if gbps:
            per_byte = 1 / (gbps * 1e9)
        else:  # int8 with a scale per row, both ways: the boundary channel's codec
            from commopt.comm.compression import QuantizeCompressor

            codec = QuantizeCompressor(8, block=args.pp_d_model)
            times = []
            for _ in range(6):
                t0 = time.perf_counter()
                codec.roundtrip(act)
                times.append(time.perf_counter() - t0)
            per_byte = sorted(times)[len(times) // 2] / 2 / (act.numel() * 4)
    finally:
        torch.set_num_threads(threads)
    fwd, bwd = sum(x.forward for x in layers), sum(x.backward for x in layers)
    print(f"# bench GPT d_model {args.pp_d_model}, {args.pp_layers} blocks, micro-batch {args.pp_micro_batch} x "
          f"{args.pp_seq}, measured here with one thread: forward {fwd * 1e3:.1f} ms, backward {bwd * 1e3:.1f} ms; "
          f"codec {per_byte * 4e9:.2f} ms per M fp32 values each way")
    return fwd, bwd, per_byte, grads


def run_pp(args) -> list[dict]:
    """Simulate the pipeline rows (``--pp-stages``); return them (also printed)."""
    from commopt.comm import cost
    from commopt.comm.topology import parse_rate
    from commopt.schedules.simulator import pipeline_codec, simulate_pipeline

    stages = [int(x) for x in args.pp_stages.split(",")]
    rates = (args.link_rates or args.link_rate).split(",")
    codecs = args.codec.split(",")
    fwd, bwd, per_byte, grads = _pp_compute(args)
    act = args.pp_micro_batch * args.pp_seq * args.pp_d_model * 4
    M = args.pp_micro
    print(f"# {M} micro-batches of {act / 2**20:.2f} MiB of fp32 activations per boundary; {args.pp_schedule}; "
          f"compute split evenly over the stages; link latency {args.link_latency_us:g} us; overlap slowdown "
          f"{args.overlap_slowdown:g}")
    print(f"{'stages':>6} {'link':>9} {'codec':>6} {'policy':<16}{'step ms':>10}{'floor ms':>10}{'step/floor':>11}"
          f"{'MiB/dir':>9}")
    rows = []
    for S in stages:
        policies = [("torch", "torch", False), ("commopt", "commopt", True)]
        if S > 2:  # what one extra on every stage alike would give (it hides only the last boundary's)
            policies.append(("commopt/flat", "commopt", False))
        for rate in rates:
            link = cost.LinkModel(args.link_latency_us * 1e-6, 8 / parse_rate(rate))
            for name in codecs:
                codec = pipeline_codec(name, row=args.pp_d_model, encode=per_byte if name != "none" else 0.0,
                                       decode=per_byte if name != "none" else 0.0)
                for label, policy, per_boundary in policies:
                    r = simulate_pipeline(S, M, fwd / S, bwd / S, link=link, activation_bytes=act,
                                          schedule=args.pp_schedule, policy=policy, codec_act=codec,
                                          codec_grad=codec, slowdown=args.overlap_slowdown, depth=args.pp_depth,
                                          extra=args.pp_extra, extra_per_boundary=per_boundary)
                    mib = r.boundary_bytes[0][0] / 2**20 if r.boundary_bytes else 0.0
                    print(f"{S:>6} {rate:>9} {name:>6} {label:<16}{r.step * 1e3:>10.1f}{r.floor * 1e3:>10.1f}"
                          f"{r.ratio:>11.3f}{mib:>9.2f}")
                    rows.append({"kind": "pp", "stages": S, "link": rate, "codec": name, "policy": label,
                                 "micro_batches": M, "schedule": args.pp_schedule, "step_s": r.step,
                                 "floor_s": r.floor, "idle_s": r.idle, "boundary_bytes": r.boundary_bytes})
    if args.pp_dp:
        rows += _pp_dp_rows(args, rates, fwd / 2, bwd / 2, act, grads)
    return rows


def _pp_dp_rows(args, rates: list[str], fwd: float, bwd: float, act: float, grads: list[float]) -> list[dict]:
    """The 2x2 (issue 41 item 5): FIFO against boundary traffic first on the one node link."""
    from commopt.comm import cost
    from commopt.comm.topology import parse_rate
    from commopt.schedules.simulator import simulate_pipeline_dp

    print(f"# 2x2: two 2-stage pipelines, each stage all-reducing {grads[0] / 2**20:.1f} / {grads[1] / 2**20:.1f} "
          f"MiB with its twin in {args.pp_dp_chunk_mb:g} MiB chunks over the same link; commopt, fp32")
    print(f"{'link':>9} {'dp issue':<10}{'fifo ms':>10}{'priority ms':>13}{'floor ms':>10}{'gain':>8}")
    rows = []
    for rate in rates:
        link = cost.LinkModel(args.link_latency_us * 1e-6, 8 / parse_rate(rate))
        for issue in ("bucketed", "after"):
            r = {sharing: simulate_pipeline_dp(args.pp_micro, fwd, bwd, link=link, activation_bytes=act,
                                               dp_bytes=grads, sharing=sharing, dp_issue=issue,
                                               dp_chunk_bytes=args.pp_dp_chunk_mb * 2**20,
                                               schedule=args.pp_schedule, slowdown=args.overlap_slowdown,
                                               depth=args.pp_depth, extra=args.pp_extra)
                 for sharing in ("fifo", "priority")}
            gain = r["fifo"].step / r["priority"].step - 1
            print(f"{rate:>9} {issue:<10}{r['fifo'].step * 1e3:>10.1f}{r['priority'].step * 1e3:>13.1f}"
                  f"{r['fifo'].floor * 1e3:>10.1f}{gain:>8.1%}")
            rows.append({"kind": "pp-dp", "link": rate, "dp_issue": issue, "fifo_s": r["fifo"].step,
                         "priority_s": r["priority"].step, "floor_s": r["fifo"].floor, "gain": gain})
    return rows


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.pp_stages:
        try:
            rows = run_pp(args)
        except ValueError as e:
            print(f"commopt-bench simulate: {e}", file=sys.stderr)
            return 2
        if args.json:
            with open(args.json, "w", encoding="utf-8") as f:
                json.dump({"kind": "simulate-pp", "rows": rows}, f, indent=1)
        return 0
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
