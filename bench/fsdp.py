"""``commopt-bench fsdp``: the GPT of bench/models.py sharded with FSDP2 under each comm, side by side.

Runs (all from the same seed, on the same batches, AdamW):

- ``compute``: one rank's forward, backward and step with no communication at all (the floor);
- ``ddp``: DDP's default fp32 all-reduce (the reference the ZeRO++ recipe must beat);
- ``fsdp2``: FSDP2 ZeRO-3, ``fully_shard`` per block and root, torch's own comms (gloo's);
- ``hsdp``: native HSDP, a 2-D mesh (replicate across nodes, shard inside);
- ``hierarchical``: FSDP2 with commopt's exact hierarchical reduce-scatter and all-gather;
- ``zero++`` / ``zero++/no-ef``: ``commopt.comm.fsdp.shard``: int8 all-gather (qwZ), hpZ
  (``reshard_after_forward=L``), int4 hierarchical reduce-scatter (qgZ), with / without error feedback;
- ``hsdp-int8`` / ``hsdp-int8/no-ef``: compressed HSDP (``fsdp.shard_hsdp``): FSDP2 inside each node,
  int8 across nodes, with / without error feedback;
- ``hsdp-powersgd``: not run (listed with the reason): PowerSGD across nodes needs
  ``commopt.comm.compression`` on the rail group, which the runtime does not create.

Each step runs every variant once, in an order rotated every step, so that load on a shared machine
hits them alike; the first ``--warmup`` steps are untimed. Printed per run: the median step time
(slowest rank), bytes the busiest node link carries per step in one direction (commopt's comms:
the algorithms' ``traffic()`` of each call they ran, equal to the engine's counters by the tests;
torch's: the same model applied to the calls of its comm objects, which the benchmark wraps only to
count them, and to HSDP's rail all-reduce and DDP's bucket, marked ``*``), the bytes each rank sent
as counted by commopt's engine, and the loss at the end (mean of the last five steps' training
losses, the same batches in every run) against the exact run (``fsdp2``; ``hsdp`` for the HSDP
rows). The issue's targets are printed as ratios at the end::

    commopt-bench fsdp --spawn 4 --topology 2x2 --quick
    commopt-bench cluster --nodes 2 --ranks-per-node 2 --link-rate 200mbit -- commopt-bench fsdp
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch
import torch.distributed as dist
from torch import nn

from ._launch import launch, topology_of
from ._progress import progress

__all__ = ["main", "RUNS"]

#: name -> what it is (the order of the table).
RUNS = {
    "compute": "no communication: one rank's forward, backward and AdamW step (the floor)",
    "ddp": "torch DDP, fp32 all-reduce",
    "fsdp2": "torch FSDP2 ZeRO-3 (per block + root), torch's comms",
    "hsdp": "torch HSDP: 2-D mesh, shard inside a node, replicate across",
    "hierarchical": "FSDP2 + commopt hierarchical reduce-scatter / all-gather (exact)",
    "zero++": "fsdp.shard: int8 all-gather + hpZ + int4 reduce-scatter, error feedback",
    "zero++/no-ef": "fsdp.shard: the same without error feedback (stochastic rounding)",
    "hsdp-int8": "fsdp.shard_hsdp: FSDP2 inside a node, int8 across nodes, error feedback",
    "hsdp-int8/no-ef": "fsdp.shard_hsdp: the same without error feedback (stochastic rounding)",
    "hsdp-powersgd": "compressed HSDP with PowerSGD",
}
_TARGETS = (("hierarchical", "fsdp2", 1.35), ("zero++", "fsdp2", 4.0), ("zero++", "ddp", 1.0),
            ("hsdp-int8", "hsdp", 2.0))
_VOCAB = 256


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="commopt-bench fsdp", description=__doc__.split("\n\n")[0])
    p.add_argument("--spawn", type=int, default=0, metavar="N", help="spawn N local ranks")
    p.add_argument("--topology", default=None, help="layout such as 2x2 (default: COMMOPT_NODES or detected)")
    p.add_argument("--runs", default=",".join(RUNS), help=f"comma-separated subset of {','.join(RUNS)}")
    p.add_argument("--steps", type=int, default=60, help="timed training steps per run")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps per run first")
    p.add_argument("--batch", type=int, default=4, help="sequences per rank per step")
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--d-model", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--lr", type=float, default=3e-3, help="AdamW learning rate")
    p.add_argument("--quick", action="store_true", help="a tiny model for a few steps (smoke test)")
    p.add_argument("--timeout", type=float, default=300.0, help="collective timeout in seconds")
    p.add_argument("--json", default=None, help="write the results as JSON to this file (rank 0)")
    return p


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.quick:
        args.d_model, args.layers, args.seq_len, args.batch = 32, 2, 16, 2
        args.steps, args.warmup = min(args.steps, 6), 1
    unknown = [r for r in args.runs.split(",") if r not in RUNS]
    if unknown:
        print(f"commopt-bench fsdp: unknown runs {unknown}; choose from {','.join(RUNS)}", file=sys.stderr)
        return 2
    spawn, args.spawn = args.spawn, 0
    return launch(_rank_body, args, spawn=spawn, timeout=args.timeout, single=False)


# ------------------------------------------------------------------------------------------ link model
def _rail_traffic(topo, nbytes: float, factor: float):
    """Every rail's ring all-reduce of ``nbytes`` per rank at once (HSDP's replicate all-reduce)."""
    from commopt.comm.algorithms import Traffic

    t = Traffic(topo)
    for j in range(topo.local_size):
        t.ring(sorted(node[j] for node in topo.nodes), factor * nbytes)
    return t


class _Counted:
    """torch's own FSDP comm objects, wrapped only to count their calls (the link model's input)."""

    def __init__(self, inner, log: list, kind: str):
        self.inner, self.log, self.kind = inner, log, kind

    def allocate(self, size, *, dtype, device):
        return self.inner.allocate(size, dtype=dtype, device=device)

    def __call__(self, output_tensor, input_tensor, group, *args, **kwargs):
        big = input_tensor if self.kind == "reduce_scatter" else output_tensor
        self.log.append((self.kind, big.numel() * big.element_size(), tuple(dist.get_process_group_ranks(group)),
                         output_tensor.numel() * output_tensor.element_size()))
        return self.inner(output_tensor, input_tensor, group, *args, **kwargs)


def _native_link_bytes(log: list, topo, hsdp: bool) -> float:
    """The busiest node link's bytes of torch's calls: a ring over the call's group (every group of
    a kind runs at once: one per node for HSDP's shard group), plus HSDP's rail all-reduce."""
    from commopt.comm.algorithms import ALGORITHM_FACTORS, FLAT

    total = 0.0
    world = tuple(range(topo.world_size))
    for kind, nbytes, ranks, out_bytes in log:
        if ranks == world:  # a group inside one node (HSDP's shard group) crosses no node link
            total += FLAT.link_bytes(kind, nbytes, topo)
        if hsdp and kind == "reduce_scatter":
            total += _rail_traffic(topo, out_bytes, ALGORITHM_FACTORS["allreduce"](topo.num_nodes)).link_bytes()
    return total


# ------------------------------------------------------------------------------------------ runs
def _gpt(args):
    from commopt.bench.models import GPT

    return GPT(_VOCAB, args.d_model, args.layers, 4, args.seq_len, seed=0)


def _setup(name: str, args, topo) -> dict:
    from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.nn.parallel import DistributedDataParallel as DDP

    from commopt.comm import compression as C
    from commopt.comm import fsdp

    run = {"name": name, "comms": None, "log": None, "hsdp": False, "skip": None}
    model = _gpt(args)
    two_level = topo.is_uniform and topo.num_nodes > 1 and topo.local_size > 1
    if name == "compute":
        run["module"] = model
    elif name == "ddp":
        run["module"] = DDP(model, bucket_cap_mb=64)
    elif name in ("fsdp2", "hsdp"):
        if name == "hsdp":
            if not two_level:
                run["skip"] = "needs two levels of equal nodes"
                return run
            grid = torch.tensor([[topo.group_rank_to_global(r) for r in n] for n in topo.nodes])
            mesh = DeviceMesh("cpu", grid, mesh_dim_names=("replicate", "shard"))
            run["hsdp"] = True
        else:
            mesh = init_device_mesh("cpu", (topo.world_size,))
        for block in model.blocks:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
        from torch.distributed.fsdp._fully_shard._fsdp_collectives import DefaultAllGather, DefaultReduceScatter

        run["log"] = log = []
        for m in [model, *model.blocks]:
            m.set_custom_reduce_scatter(_Counted(DefaultReduceScatter(), log, "reduce_scatter"))
            m.set_custom_all_gather(_Counted(DefaultAllGather(), log, "all_gather"))
        run["module"] = model
    elif name == "hierarchical":
        if not topo.is_uniform:
            run["skip"] = "needs nodes of equal size"
            return run
        run["comms"] = fsdp.shard(model, topology=topo, weights=None, gradients=None, hpz=False,
                                  algorithm="hierarchical")
        run["module"] = model
    elif name in ("zero++", "zero++/no-ef"):
        run["comms"] = fsdp.shard(model, topology=topo, error_feedback=name == "zero++")
        run["module"] = model
    elif name in ("hsdp-int8", "hsdp-int8/no-ef"):
        if not two_level:
            run["skip"] = "needs two levels of equal nodes"
            return run
        run["comms"] = fsdp.shard_hsdp(model, C.QuantizeCompressor(8), topology=topo,
                                       error_feedback=name == "hsdp-int8")
        run["module"] = model
    elif name == "hsdp-powersgd":
        try:
            fsdp.AllReduceHook(C.PowerSGDCompressor(rank=4), topo)
        except TypeError as exc:
            run["skip"] = str(exc).split(": ", 1)[-1].split(";")[0]
            return run
    run["opt"] = torch.optim.AdamW(run["module"].parameters(), lr=args.lr)
    run.update(times=[], link=[], sent=[], losses=[])
    return run


def _step(run: dict, step: int, args, topo, timed: bool) -> None:
    from commopt.bench.models import synthetic_tokens
    from commopt.comm import context

    compute_only = run["name"] == "compute"
    data = synthetic_tokens(args.batch, args.seq_len, _VOCAB, seed=10_000 * step + dist.get_rank())
    engine = context().engine()
    before = sum(engine.bytes_sent().values())
    if run["comms"] is not None:
        run["comms"].reset_link_bytes()
    if run["log"] is not None:
        run["log"].clear()
    dist.barrier()
    t0 = time.perf_counter()
    run["opt"].zero_grad(set_to_none=True)
    logits = run["module"](data[:, :-1])
    loss = nn.functional.cross_entropy(logits.reshape(-1, _VOCAB), data[:, 1:].reshape(-1))
    loss.backward()
    run["opt"].step()
    elapsed = time.perf_counter() - t0
    if not timed:
        return
    run["times"].append(elapsed)
    run["sent"].append(sum(engine.bytes_sent().values()) - before)
    if run["comms"] is not None:
        run["link"].append(run["comms"].link_bytes())
    elif run["log"] is not None:
        run["link"].append(_native_link_bytes(run["log"], topo, run["hsdp"]))
    elif run["name"] == "ddp":
        from commopt.comm.algorithms import FLAT

        grads = sum(p.numel() * p.element_size() for p in run["module"].parameters())
        run["link"].append(FLAT.traffic("allreduce", grads, topo).link_bytes())
    else:
        run["link"].append(0.0)
    mean = loss.detach().clone()
    if not compute_only:
        dist.all_reduce(mean)
        mean /= dist.get_world_size()
    run["losses"].append(float(mean))


def _summary(run: dict) -> dict:
    if run["skip"]:
        return {"run": run["name"], "skipped": run["skip"]}
    worst = torch.tensor([statistics.median(run["times"]), statistics.median(run["sent"])], dtype=torch.float64)
    dist.all_reduce(worst, op=dist.ReduceOp.MAX)  # the step is as slow as its slowest rank
    tail = run["losses"][-5:]
    return {"run": run["name"], "step_ms": 1e3 * float(worst[0]), "link_bytes_per_step": statistics.median(run["link"]),
            "link_modelled": run["comms"] is None, "sent_bytes_per_step": float(worst[1]),
            "final_loss": sum(tail) / len(tail), "losses": run["losses"],
            "step_ms_rank0": [1e3 * t for t in run["times"]]}


def _rank_body(args) -> int:
    torch.set_num_threads(1)
    topo = topology_of(args)
    runs = [_setup(name, args, topo) for name in args.runs.split(",")]
    active = [r for r in runs if not r["skip"]]
    total = args.warmup + args.steps
    bar = progress(total, f"training {len(active)} runs", rank=dist.get_rank(), unit="step")
    for step in range(total):
        k = step % max(1, len(active))
        for run in active[k:] + active[:k]:
            _step(run, step, args, topo, timed=step >= args.warmup)
        bar.update()
    bar.close()
    results = [_summary(r) for r in runs]
    if dist.get_rank() == 0:
        _report(results, args, topo)
    return 0


def _report(results: list[dict], args, topo) -> None:
    by = {r["run"]: r for r in results}
    n_params = sum(p.numel() for p in _gpt(args).parameters())
    link = f", node link {topo.link_rate_bps / 1e6:.0f} Mbit/s" if topo.link_rate_bps else ""
    print(f"# commopt-bench fsdp: GPT d={args.d_model} L={args.layers} ({n_params / 1e6:.2f} M parameters, "
          f"{4 * n_params / 2**20:.1f} MiB fp32) seq={args.seq_len} batch={args.batch}/rank, AdamW lr={args.lr}, "
          f"{args.steps} timed steps after {args.warmup}, world {dist.get_world_size()} ({topo.layout}{link}), "
          f"interleaved")
    print("# link MB: bytes the busiest node link carries per step, one direction (* = torch's calls under the "
          "same ring model); sent MB: bytes per rank counted by commopt's engine (- : torch's comms, not counted); "
          "loss: mean of the last 5 steps")
    base = by.get("fsdp2")
    print(f"{'run':<15}{'step(ms)':>10}{'vs fsdp2':>10}{'link MB':>10}{'sent MB':>9}{'loss':>9}{'vs exact':>10}"
          f"   description")
    for r in results:
        if "skipped" in r:
            print(f"{r['run']:<15}{'-':>10}{'':>10}{'':>10}{'':>9}{'':>9}{'':>10}   not run: {r['skipped']}")
            continue
        ref = by.get("hsdp") if r["run"].startswith("hsdp") and "step_ms" in by.get("hsdp", {}) else base
        speed = f"{base['step_ms'] / r['step_ms']:>9.2f}x" if base and "step_ms" in base else f"{'':>10}"
        rel = (f"{100 * (r['final_loss'] - ref['final_loss']) / ref['final_loss']:>+9.2f}%"
               if ref and "final_loss" in ref and r["run"] != "compute" else f"{'':>10}")
        mark = "*" if r["link_modelled"] and r["run"] not in ("compute",) else " "
        sent = f"{r['sent_bytes_per_step'] / 1e6:>9.2f}" if not r["link_modelled"] else f"{'-':>9}"
        print(f"{r['run']:<15}{r['step_ms']:>10.1f}{speed}{r['link_bytes_per_step'] / 1e6:>9.2f}{mark}"
              f"{sent}{r['final_loss']:>9.4f}{rel}   {RUNS[r['run']]}")
    for ours, theirs, target in _TARGETS:
        a, b = by.get(ours, {}), by.get(theirs, {})
        if "step_ms" in a and "step_ms" in b:
            ratio = b["step_ms"] / a["step_ms"]
            ref = by.get("hsdp" if ours.startswith("hsdp") else "fsdp2", {})
            loss = (f"; loss {a['final_loss']:.4f} vs exact {ref['final_loss']:.4f} "
                    f"({100 * (a['final_loss'] - ref['final_loss']) / ref['final_loss']:+.2f} %)" if "final_loss" in ref
                    else "")
            verdict = "met" if ratio >= target else "NOT met"
            print(f"# {ours} vs {theirs}: {ratio:.2f}x faster (target >= {target:g}x: {verdict}){loss}")
    data = {"args": vars(args), "layout": topo.layout, "world_size": dist.get_world_size(),
            "link_rate_bps": topo.link_rate_bps, "parameters": n_params, "results": results}
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(data, f, indent=1)
