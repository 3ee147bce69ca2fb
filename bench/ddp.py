"""``commopt-bench ddp``: a small GPT trained with DDP under each comm hook, side by side.

For every hook (ours: exact, fp16, bf16, PowerSGD flat and hierarchical, top-k, random-k, sign,
1-bit, int8, int4; torch's: the default all-reduce, ``fp16_compress_hook``, ``powerSGD_hook`` at our
PowerSGD's settings) the same model is trained from the same seed on the same data and the run
prints: median step time, bytes each rank sends per step (from the comm engine's counters for our
hooks; from the payload sizes for torch's, marked ``*``, since torch's hooks bypass our engine),
the ratio against an fp32 ring all-reduce of every gradient, and the final loss next to the
uncompressed run's. Any of commopt's hooks can be named ``HOOK@ALGORITHM`` to run on that algorithm
(``bf16@hierarchical,bf16@synth``: one codec on two algorithms, side by side; the ratio of each to the
first listed is printed at the end). Every hook trains from the same initial state, side by side: one step of each
in turn, rotated every step, so the step-time ratios are measured interleaved. The ratios the
targets are about (ours against torch's fp16 and PowerSGD hooks, hierarchical against flat
PowerSGD) are printed at the end.

Buckets: every hook gets the same DDP buckets (``--bucket-cap-mb``, default 64: one bucket for the
default GPT after DDP's first-iteration rebuild). torch's ``powerSGD_hook`` chains its second
all-reduce from a future callback, so with two buckets in flight on gloo its collectives can cross
(seen here as gloo's "Received data size doesn't match expected size" abort); commopt's hook issues
every round through the comm engine and is safe with any number of buckets.

Launch: ``--spawn N`` local ranks (FileStore in a temporary directory, gloo on loopback), or under
``torchrun`` / ``commopt-bench cluster`` (``RANK``/``WORLD_SIZE``/``MASTER_ADDR`` from the
environment; the topology from ``COMMOPT_NODES``)::

    commopt-bench ddp --spawn 4 --topology 2x2
    commopt-bench cluster --nodes 2 --ranks-per-node 2 --link-rate 200mbit -- commopt-bench ddp
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from ._launch import launch, topology_of
from ._progress import interleaved

__all__ = ["main", "HOOKS"]

#: name -> what it is (the order of the table).
HOOKS = {
    "ddp": "torch: DDP's default fp32 all-reduce",
    "torch-fp16": "torch: fp16_compress_hook",
    "torch-powersgd": "torch: powerSGD_hook (rank, start as ours)",
    "exact": "commopt: allreduce_hook, no compressor",
    "fp16": "commopt: FP16Compressor",
    "bf16": "commopt: BF16Compressor",
    "powersgd": "commopt: PowerSGDCompressor, flat",
    "powersgd-hier": "commopt: PowerSGDCompressor, hierarchical (inter-node only)",
    "topk": "commopt: TopKCompressor(1%)",
    "randomk": "commopt: RandomKCompressor(1%)",
    "sign": "commopt: SignCompressor",
    "onebit": "commopt: OneBitCompressor",
    "int8": "commopt: QuantizeCompressor(8)",
    "int4": "commopt: QuantizeCompressor(4)",
}


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="commopt-bench ddp", description=__doc__.split("\n\n")[0])
    p.add_argument("--spawn", type=int, default=0, metavar="N", help="spawn N local ranks")
    p.add_argument("--hooks", default=",".join(HOOKS), help=f"comma-separated subset of {','.join(HOOKS)}")
    p.add_argument("--topology", default=None, help="layout such as 2x2 (default: COMMOPT_NODES or detected)")
    p.add_argument("--steps", type=int, default=60, help="training steps per hook (the last two thirds are timed)")
    p.add_argument("--batch", type=int, default=8, help="sequences per rank per step")
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--d-model", type=int, default=128)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--lr", type=float, default=3e-3, help="Adam learning rate")
    p.add_argument("--rank", type=int, default=4, help="PowerSGD rank (ours and torch's)")
    p.add_argument("--start-iter", type=int, default=2, help="PowerSGD start iteration (ours and torch's)")
    p.add_argument("--algorithm", default="flat", choices=_codec_algorithms(),
                   help="algorithm of our compressed hooks (powersgd-hier is always hierarchical; a hook "
                   "named HOOK@ALGORITHM runs on ALGORITHM whatever this says)")
    p.add_argument("--warmup-steps", type=int, default=4, help="untimed DDP steps before the first hook")
    p.add_argument("--bucket-cap-mb", type=float, default=64.0, help="DDP bucket size cap (every hook)")
    p.add_argument("--timeout", type=float, default=300.0, help="collective timeout in seconds")
    p.add_argument("--json", default=None, help="write the results as JSON to this file (rank 0)")
    p.add_argument("--plot", default=None, metavar="PNG", help="draw step time and final loss per hook, and "
                   "the loss curves, as a PNG (matplotlib: pip install commopt[plot]); `commopt-bench plot "
                   "RESULTS.json` draws it later")
    return p


def _codec_algorithms() -> list[str]:
    """The algorithms a compressed hook can run on (those that carry a codec), and ``auto``."""
    from commopt.comm import algorithms

    return algorithms.names("allreduce", codec=True) + [algorithms.AUTO]


def _split(hook: str) -> tuple[str, str | None]:
    """``"bf16@synth"`` -> ``("bf16", "synth")``; a plain name -> ``(name, None)``."""
    base, _, algo = hook.partition("@")
    return base, algo or None


def _check_hooks(hooks: list[str]) -> str | None:
    """Why ``hooks`` cannot run, or None. ``NAME@ALGORITHM`` is for commopt's hooks (not torch's, nor
    powersgd-hier, which is hierarchical by definition): the exact one on any all-reduce algorithm, a
    compressed one on an algorithm that carries a codec."""
    from commopt.comm import algorithms

    for h in hooks:
        base, algo = _split(h)
        if base not in HOOKS:
            return f"unknown hook {h!r}; choose from {','.join(HOOKS)} (any of commopt's as HOOK@ALGORITHM)"
        if "@" in h:
            if base == "ddp" or base.startswith("torch-") or base == "powersgd-hier":
                return f"{h!r}: only commopt's hooks take @ALGORITHM ({base} has its own all-reduce)"
            known = (algorithms.names("allreduce") + [algorithms.AUTO] if base == "exact" else _codec_algorithms())
            if algo not in known:
                return f"{h!r}: {base} runs on one of {','.join(known)}, not {algo!r}"
    if len(set(hooks)) != len(hooks):
        return f"a hook is named twice in {','.join(hooks)}"
    return None


# ------------------------------------------------------------------------------------ launching
def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    why = _check_hooks(args.hooks.split(","))
    if why:
        print(f"commopt-bench ddp: {why}", file=sys.stderr)
        return 2
    spawn, args.spawn = args.spawn, 0
    return launch(_rank_body, args, spawn=spawn, timeout=args.timeout, single=False)


# ------------------------------------------------------------------------------------ measuring
def _make_hook(name: str, args, topo, model: nn.Module):
    """(state, hook function, bytes-per-step model or None when the engine counts them)."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as tps

    from commopt.comm import compression as C
    from commopt.comm.hooks import AllReduceState, allreduce_hook

    name, on = _split(name)
    world = dist.get_world_size()
    shapes = [tuple(p.shape) for p in model.parameters()]
    numel = sum(p.numel() for p in model.parameters())
    fp32 = 2 * (world - 1) / world * numel * 4
    if name == "ddp":
        return None, None, fp32
    if name == "torch-fp16":
        return None, default_hooks.fp16_compress_hook, fp32 / 2
    if name == "torch-powersgd":
        state = tps.PowerSGDState(process_group=None, matrix_approximation_rank=args.rank,
                                  start_powerSGD_iter=args.start_iter, min_compression_rate=2,
                                  use_error_feedback=True, warm_start=True, orthogonalization_epsilon=1e-8)
        return state, tps.powerSGD_hook, C.PowerSGDCompressor(rank=args.rank).shapes_bytes(shapes, world)
    compressors = {
        "exact": None, "fp16": C.FP16Compressor(), "bf16": C.BF16Compressor(),
        "powersgd": C.PowerSGDCompressor(rank=args.rank, start_iter=args.start_iter),
        "powersgd-hier": C.PowerSGDCompressor(rank=args.rank, start_iter=args.start_iter),
        "topk": C.TopKCompressor(0.01), "randomk": C.RandomKCompressor(0.01), "sign": C.SignCompressor(),
        "onebit": C.OneBitCompressor(), "int8": C.QuantizeCompressor(8), "int4": C.QuantizeCompressor(4),
    }
    algorithm = "hierarchical" if name == "powersgd-hier" and topo.two_levels else args.algorithm
    if name == "exact":
        algorithm = "auto"
    algorithm = on or algorithm
    return AllReduceState(topo, algorithm, compressors[name]), allreduce_hook, None


def _setup(name: str, args, topo) -> dict:
    """One hook's run: the model (same seed for every hook), DDP with the hook, Adam, and its logs."""
    from commopt.bench.models import GPT
    from commopt.comm.hooks import AllReduceState, register

    model = GPT(256, args.d_model, args.layers, 4, args.seq_len, seed=0)
    ddp = DDP(model, bucket_cap_mb=args.bucket_cap_mb)
    state, hook, modelled = _make_hook(name, args, topo, model)
    if isinstance(state, AllReduceState):
        register(ddp, state)
    elif hook is not None:
        ddp.register_comm_hook(state, hook)
    return {"name": name, "model": model, "ddp": ddp, "opt": torch.optim.Adam(ddp.parameters(), lr=args.lr),
            "modelled": modelled, "times": [], "sent": [], "inter": [], "losses": []}


def _step(run: dict, step: int, args) -> None:
    """One timed training step of ``run`` on the data of ``step`` (the same for every hook)."""
    from commopt.bench.models import synthetic_tokens
    from commopt.comm import context

    vocab = 256
    data = synthetic_tokens(args.batch, args.seq_len, vocab, seed=10_000 * step + dist.get_rank())
    then = context().engine().bytes_sent()
    before = sum(then.values())
    before_inter = sum(v for k, v in then.items() if not k.endswith("/intra"))
    ddp, opt = run["ddp"], run["opt"]
    dist.barrier()
    t0 = time.perf_counter()
    opt.zero_grad(set_to_none=True)
    logits = ddp(data[:, :-1])
    loss = nn.functional.cross_entropy(logits.reshape(-1, vocab), data[:, 1:].reshape(-1))
    loss.backward()
    opt.step()
    run["times"].append(time.perf_counter() - t0)
    now = context().engine().bytes_sent()
    run["sent"].append(sum(now.values()) - before)
    run["inter"].append(sum(v for k, v in now.items() if not k.endswith("/intra")) - before_inter)
    mean = loss.detach().clone()
    dist.all_reduce(mean)
    run["losses"].append(float(mean) / dist.get_world_size())


def _summary(run: dict, args) -> dict:
    name, model, modelled = run["name"], run["model"], run["modelled"]
    steady = slice(max(args.start_iter, args.steps // 3), None)
    counted = modelled if modelled is not None else statistics.median(run["sent"][steady])
    counted_inter = modelled if modelled is not None else statistics.median(run["inter"][steady])
    worst = torch.tensor([counted, counted_inter, statistics.median(run["times"][steady])], dtype=torch.float64)
    dist.all_reduce(worst, op=dist.ReduceOp.MAX)  # ranks of a hierarchy send different amounts
    numel = sum(p.numel() for p in model.parameters())
    world = dist.get_world_size()
    matrices = [tuple(p.shape) for p in model.parameters() if p.dim() >= 2]
    matrix_ratio = None
    if "powersgd" in name:
        from commopt.comm.compression import PowerSGDCompressor

        full = 2 * (world - 1) / world * sum(math.prod(s) for s in matrices) * 4
        matrix_ratio = full / PowerSGDCompressor(rank=args.rank).shapes_bytes(matrices, world)
    return {"hook": name, "step_ms": 1e3 * float(worst[2]), "bytes_per_step": float(worst[0]),
            "inter_bytes_per_step": float(worst[1]),
            "matrix_ratio": matrix_ratio,
            "bytes_modelled": modelled is not None, "fp32_bytes": 2 * (world - 1) / world * numel * 4,
            "losses": run["losses"], "step_ms_rank0": [1e3 * t for t in run["times"]]}


def _rank_body(args) -> int:
    topo = topology_of(args)
    names = args.hooks.split(",")
    if args.warmup_steps:
        # Untimed: connections, allocator and kernel caches warm up here, not in the first hook's row.
        warm = _setup("ddp", args, topo)
        for step in range(args.warmup_steps):
            _step(warm, step, args)
    # Every hook trains side by side, one step each in turn (rotated every step), so that a load
    # spike on a shared machine hits all of them alike and the ratios between them stay honest.
    runs = [_setup(name, args, topo) for name in names]
    interleaved(runs, args.steps, lambda run, step: _step(run, step, args), "hooks", rank=dist.get_rank())
    results = [_summary(run, args) for run in runs]
    if dist.get_rank() == 0:
        _report(results, args, topo)
    return 0


def _describe(hook: str) -> str:
    base, algo = _split(hook)
    return HOOKS[base] + (f", on {algo}" if algo else "")


def _report(results: list[dict], args, topo) -> None:
    base = next((r for r in results if r["hook"] == "ddp"), results[0])
    link = f", link {topo.link_rate_bps / 1e6:.0f} Mbit/s" if topo.link_rate_bps else ""
    print(f"# commopt-bench ddp: GPT d={args.d_model} L={args.layers} seq={args.seq_len} batch={args.batch}/rank, "
          f"{args.steps} steps, world {dist.get_world_size()} ({topo.layout}{link})")
    print("# bytes: per rank per step (max over ranks); * = from payload sizes (torch's hooks bypass the engine); "
          "ratio = fp32 ring all-reduce / bytes")
    print("# inter-node: bytes of the compressed (rail) phases only; commopt's hierarchical runs keep the "
          "intra-node phases exact (fp32), counted apart")
    print(f"{'hook':<20}{'step(ms)':>10}{'vs ddp':>8}{'bytes/step':>14}{'ratio':>8}{'inter-node':>12}{'ratio':>8}"
          f"{'final loss':>12}{'vs ddp':>9}   description")
    for r in results:
        ratio = r["fp32_bytes"] / r["bytes_per_step"] if r["bytes_per_step"] else math.inf
        inter = r["inter_bytes_per_step"]
        inter_ratio = r["fp32_bytes"] / inter if inter else math.inf
        mark = "*" if r["bytes_modelled"] else " "
        print(f"{r['hook']:<20}{r['step_ms']:>10.1f}{r['step_ms'] / base['step_ms']:>7.2f}x"
              f"{r['bytes_per_step']:>13.0f}{mark}{ratio:>7.1f}x{inter:>12.0f}{inter_ratio:>7.1f}x"
              f"{r['losses'][-1]:>12.4f}"
              f"{r['losses'][-1] - base['losses'][-1]:>+9.4f}   {_describe(r['hook'])}")
    for r in results:
        if r.get("matrix_ratio"):
            print(f"# {r['hook']}: rank-{args.rank} factors of the GPT's matrices alone: {r['matrix_ratio']:.1f}x "
                  f"fewer bytes than fp32")
    marks = sorted({0, len(base["losses"]) // 4, len(base["losses"]) // 2, 3 * len(base["losses"]) // 4,
                    len(base["losses"]) - 1})
    print("# loss curve at steps " + ", ".join(str(m) for m in marks))
    for r in results:
        print(f"{r['hook']:<20}" + "".join(f"{r['losses'][m]:>9.4f}" for m in marks))
    by = {r["hook"]: r for r in results}
    pairs = (("fp16", "torch-fp16", "target <= 1.05"), ("powersgd", "torch-powersgd", "target <= 1.0"),
             ("powersgd-hier", "powersgd", "target < 1.0"))
    for ours, theirs, target in pairs:
        if ours in by and theirs in by:
            a, b = by[ours], by[theirs]
            print(f"# step time {ours} / {theirs} = {a['step_ms'] / b['step_ms']:.3f} ({target}, interleaved); "
                  f"final loss {a['losses'][-1]:.4f} vs {b['losses'][-1]:.4f}")
    first: dict[str, dict] = {}
    for r in results:  # one hook on several algorithms: each against the first listed, interleaved
        b = first.setdefault(_split(r["hook"])[0], r)
        if b is not r:
            print(f"# step time {r['hook']} / {b['hook']} = {r['step_ms'] / b['step_ms']:.3f} (interleaved); "
                  f"final loss {r['losses'][-1]:.4f} vs {b['losses'][-1]:.4f}")
    data = {"args": vars(args), "layout": topo.layout, "world_size": dist.get_world_size(),
            "link_rate_bps": topo.link_rate_bps, "results": results}
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(data, f, indent=1)
    if args.plot:
        from .plot import plot_ddp

        if plot_ddp(data, args.plot) is not None:
            print(f"# plot: {args.plot}")
