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
- ``hsdp-powersgd``: compressed HSDP with PowerSGD across nodes (rank 16, exact for the first 20
  steps, error feedback, warm starts: ``fsdp.shard_hsdp(model, PowerSGDCompressor(rank=16,
  start_iter=20))``; rank 8 from step 10 ends 5 % above the exact loss after 60 AdamW steps,
  rank 16 from step 2 2.1 %, rank 32 0.6 % but 2.2x instead of 2.6x).

Each step runs every variant once, in an order rotated every step, so that load on a shared machine
hits them alike; the first ``--warmup`` steps are untimed. Printed per run: the median step time
(slowest rank), the peak memory of a timed step beside it (the largest over the steps and the ranks,
``_memory.PeakMemory``: hpZ trades memory for bytes), bytes the busiest node link carries per step in
one direction (commopt's comms: the algorithms' ``traffic()`` of each call they ran, equal to the
engine's counters by the tests; torch's: the same model applied to the calls of its comm objects,
which the benchmark wraps only to count them, and to HSDP's rail all-reduce and DDP's bucket, marked
``*``), the bytes each rank sent
as counted by commopt's engine, and the loss at the end (mean of the last five steps' training
losses, the same batches in every run) against the exact run (``fsdp2``; ``hsdp`` for the HSDP
rows). Beside each measured step, what the simulator predicts for it (``simulate_sharded``, DDP:
``simulate``) from this cluster's own measurements, taken after training on every rank at once:
``cost.calibrate``, each FSDP unit's forward and backward scaled to the run's floor (for the sharded
runs FSDP2 with comms that move nothing but wait for every rank of the group, trained as hidden runs
interleaved with the others), the optimizer's step and the codecs' cost per byte;
and again with each collective's time measured alone in place of the cost model's (``sim*``;
``--no-predict`` skips both). The issue's targets are printed as ratios at the end::

    commopt-bench fsdp --spawn 4 --topology 2x2 --quick
    commopt-bench cluster --nodes 2 --ranks-per-node 2 --link-rate 200mbit -- commopt-bench fsdp
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import math
import statistics
import sys
import time

import torch
import torch.distributed as dist
from torch import nn

from ._launch import launch, topology_of
from ._memory import PeakMemory, peak_kind
from ._progress import progress
from .cluster.host import wire_bytes

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
    "shard-auto": "fsdp.shard(model) as it comes: each part of the recipe where it timed faster (\"auto\")",
    "hsdp-int8": "fsdp.shard_hsdp: FSDP2 inside a node, int8 across nodes, error feedback",
    "hsdp-int8/no-ef": "fsdp.shard_hsdp: the same without error feedback (stochastic rounding)",
    "hsdp-powersgd": "fsdp.shard_hsdp: FSDP2 inside a node, PowerSGD across nodes (--powersgd-rank), error feedback",
}
_TARGETS = (("hierarchical", "fsdp2", 1.35), ("zero++", "fsdp2", 4.0), ("zero++", "ddp", 1.0),
            ("hsdp-int8", "hsdp", 2.0), ("hsdp-powersgd", "hsdp", 2.0))
_VOCAB = 256


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="commopt-bench fsdp", description=__doc__.split("\n\n")[0])
    p.add_argument("--spawn", type=int, default=0, metavar="N", help="spawn N local ranks")
    p.add_argument("--topology", default=None, help="layout such as 2x2 (default: COMMOPT_NODES or detected)")
    p.add_argument("--runs", default=",".join(r for r in RUNS if r != "shard-auto"),
                   help=f"comma-separated subset of {','.join(RUNS)} (default: all but shard-auto, which has no "
                        f"simulator plan: its recipe is decided at the call)")
    p.add_argument("--steps", type=int, default=60, help="timed training steps per run")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps per run first")
    p.add_argument("--batch", type=int, default=4, help="sequences per rank per step")
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--d-model", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--lr", type=float, default=3e-3, help="AdamW learning rate")
    p.add_argument("--quick", action="store_true", help="a tiny model for a few steps (smoke test)")
    p.add_argument("--timeout", type=float, default=300.0, help="collective timeout in seconds")
    p.add_argument("--powersgd-rank", type=int, default=16, help="PowerSGD's rank (hsdp-powersgd)")
    p.add_argument("--powersgd-start", type=int, default=20, help="PowerSGD's exact first steps (hsdp-powersgd)")
    p.add_argument("--no-predict", dest="predict", action="store_false",
                   help="skip the simulator's prediction of every run (calibrates this cluster after training)")
    p.add_argument("--json", default=None, help="write the results as JSON to this file (rank 0)")
    p.add_argument("--profile", type=int, default=0, metavar="STEPS",
                   help="after the timed steps, run STEPS more steps of each run of commopt's comms under "
                        "torch.profiler, then the run's collectives alone, and print each engine phase's "
                        "mean time inside a step against alone (where a collective's time goes in a step)")
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
    a kind runs at once: one per node for HSDP's shard group), plus HSDP's rail all-reduce. gloo's
    ``reduce_scatter_tensor`` is an all-reduce of the whole buffer followed by a copy (the interface
    counters of the emulated cluster show 39.9 MB per step where a ring reduce-scatter moves 29.3)."""
    from commopt.comm.algorithms import ALGORITHM_FACTORS, FLAT, Traffic

    total = 0.0
    world = tuple(range(topo.world_size))
    gloo = dist.get_backend() == "gloo"
    for kind, nbytes, ranks, out_bytes in log:
        if ranks == world:  # a group inside one node (HSDP's shard group) crosses no node link
            total += FLAT.link_bytes("allreduce" if gloo and kind == "reduce_scatter" else kind, nbytes, topo)
        if hsdp and kind == "reduce_scatter":  # every rail's ring all-reduce of the shard, at once
            rails = Traffic(topo)
            rails.rail_rings(ALGORITHM_FACTORS["allreduce"](topo.num_nodes) * out_bytes)
            total += rails.link_bytes()
    return total


# ------------------------------------------------------------------------------------------ runs
def _gpt(args):
    from commopt.bench.models import GPT

    return GPT(_VOCAB, args.d_model, args.layers, 4, args.seq_len, seed=0)


def _setup(name: str, args, topo) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.nn.parallel import DistributedDataParallel as DDP

    from commopt.comm import compression as C
    from commopt.comm import fsdp

    run = {"name": name, "comms": None, "log": None, "hsdp": False, "skip": None}
    model = _gpt(args)
    if name == "compute":
        run["module"] = model
    elif name == "ddp":
        run["module"] = DDP(model, bucket_cap_mb=64)
    elif name in ("fsdp2", "hsdp"):
        if name == "hsdp":
            if not topo.two_levels:
                run["skip"] = "needs two levels of equal nodes"
                return run
            mesh = _node_mesh(topo)
            run["hsdp"] = True
        else:
            mesh = init_device_mesh("cpu", (topo.world_size,))
        from torch.distributed.fsdp._fully_shard._fsdp_collectives import DefaultAllGather, DefaultReduceScatter

        run["log"] = log = []
        _fully_shard(model, mesh, lambda: _Counted(DefaultReduceScatter(), log, "reduce_scatter"),
                     lambda: _Counted(DefaultAllGather(), log, "all_gather"))
        run["module"] = model
    elif name in ("floor/fsdp", "floor/hsdp"):
        # The simulator's floor of the sharded runs over WORLD ("floor/fsdp") or over this rank's node
        # ("floor/hsdp"): FSDP2 with comms that move nothing but wait for their group (_OwnDataOnly),
        # trained among the runs it is the floor of, so that it sees the same load of the shared
        # machine. Measured once after training, it swung by 30 % between runs of the benchmark
        # (251-366 ms), and the prediction of the ZeRO++ recipe, mostly compute, with it
        # (docs/results.md 25).
        mesh = _node_mesh(topo)["shard"] if name == "floor/hsdp" else init_device_mesh("cpu", (topo.world_size,))
        _fully_shard(model, mesh, _OwnDataOnly, _OwnDataOnly)
        run["module"] = model
    elif name == "hierarchical":
        if not topo.is_uniform:
            run["skip"] = "needs nodes of equal size"
            return run
        run["comms"] = fsdp.shard(model, topology=topo, weights=None, gradients=None, hpz=False,
                                  algorithm="hierarchical")
        run["module"] = model
    elif name in ("zero++", "zero++/no-ef"):
        run["comms"] = fsdp.shard(model, topology=topo, weights=C.QuantizeCompressor(8),
                                  gradients=C.QuantizeCompressor(4), hpz=True, error_feedback=name == "zero++")
        run["module"] = model
    elif name == "shard-auto":
        run["comms"] = fsdp.shard(model, topology=topo)
        run["module"] = model
    elif name in ("hsdp-int8", "hsdp-int8/no-ef"):
        if not topo.two_levels:
            run["skip"] = "needs two levels of equal nodes"
            return run
        run["comms"] = fsdp.shard_hsdp(model, C.QuantizeCompressor(8), topology=topo,
                                       error_feedback=name == "hsdp-int8")
        run["module"] = model
    elif name == "hsdp-powersgd":
        if not topo.two_levels:
            run["skip"] = "needs two levels of equal nodes"
            return run
        comp = C.PowerSGDCompressor(rank=args.powersgd_rank, start_iter=args.powersgd_start)
        run["comms"] = fsdp.shard_hsdp(model, comp, topology=topo)
        run["module"] = model
    run["opt"] = torch.optim.AdamW(run["module"].parameters(), lr=args.lr)
    run.update(times=[], opt_times=[], link=[], sent=[], wire=[], losses=[])
    return run


def _node_mesh(topo):
    """The 2-D mesh of an HSDP run: replicate across nodes, shard inside each node."""
    from torch.distributed.device_mesh import DeviceMesh

    grid = torch.tensor([[topo.group_rank_to_global(r) for r in n] for n in topo.nodes])
    return DeviceMesh("cpu", grid, mesh_dim_names=("replicate", "shard"))


def _fully_shard(model: nn.Module, mesh, reduce_scatter, all_gather) -> None:
    """FSDP2 per block and root on ``mesh``, each FSDP module with comms of its own
    (``reduce_scatter()``, ``all_gather()``)."""
    from torch.distributed.fsdp import fully_shard

    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    for m in [model, *model.blocks]:
        m.set_custom_reduce_scatter(reduce_scatter())
        m.set_custom_all_gather(all_gather())


def _step(run: dict, step: int, args, topo, timed: bool, memory: PeakMemory | None = None) -> None:
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
    wire = wire_bytes() if topo.link_rate_bps else 0
    if timed and memory is not None:
        memory.start()
    t0 = time.perf_counter()
    run["opt"].zero_grad(set_to_none=True)
    logits = run["module"](data[:, :-1])
    loss = nn.functional.cross_entropy(logits.reshape(-1, _VOCAB), data[:, 1:].reshape(-1))
    loss.backward()
    t1 = time.perf_counter()
    run["opt"].step()
    t2 = time.perf_counter()
    elapsed = t2 - t0
    if not timed:
        return
    if memory is not None:
        memory.stop(run["name"])
    run["times"].append(elapsed)
    run["opt_times"].append(t2 - t1)
    run["wire"].append(wire_bytes() - wire if topo.link_rate_bps else 0)
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


def _summary(run: dict, memory: PeakMemory) -> dict:
    if run["skip"]:
        return {"run": run["name"], "skipped": run["skip"]}
    worst = torch.tensor([statistics.median(run["times"]), statistics.median(run["sent"]),
                          statistics.median(run["wire"]), memory.peak(run["name"])], dtype=torch.float64)
    # The step is as slow as its slowest rank; its peak memory the largest rank's.
    dist.all_reduce(worst, op=dist.ReduceOp.MAX)
    tail = run["losses"][-5:]
    return {"run": run["name"], "step_ms": 1e3 * float(worst[0]), "link_bytes_per_step": statistics.median(run["link"]),
            "link_modelled": run["comms"] is None, "sent_bytes_per_step": float(worst[1]),
            "wire_bytes_per_step": float(worst[2]) if float(worst[2]) > 0 else None,
            "peak_memory_bytes": int(worst[3]), "final_loss": sum(tail) / len(tail), "losses": run["losses"],
            "recipe": getattr(run["comms"], "recipe", None),
            "step_ms_rank0": [1e3 * t for t in run["times"]]}


def _rank_body(args) -> int:
    torch.set_num_threads(1)
    topo = topology_of(args)
    memory = PeakMemory("cpu")  # every run trains on CPU (gloo)
    runs = [_setup(name, args, topo) for name in args.runs.split(",")]
    active = [r for r in runs if not r["skip"]]
    # The simulator's floors of the sharded runs train among them (see _setup).
    kinds = (["floor/fsdp"] if topo.world_size > 1 else []) + (["floor/hsdp"] if topo.two_levels else [])
    floors = [_setup(kind, args, topo) for kind in kinds] if args.predict else []
    total = args.warmup + args.steps
    bar = progress(total, f"training {len(active)} runs", rank=dist.get_rank(), unit="step")
    for step in range(total):
        k = step % max(1, len(active) + len(floors))
        for run in (active + floors)[k:] + (active + floors)[:k]:
            _step(run, step, args, topo, timed=step >= args.warmup, memory=memory)
        bar.update()
    bar.close()
    results = [_summary(r, memory) for r in runs]
    if args.profile:
        _profile(active, args, topo)
    measured = {r["run"]: r["step_ms"] / 1e3 for r in results if "step_ms" in r}
    sharded = {run["name"].split("/")[1]: _floor(run, args) for run in floors}
    predicted, inputs = _predict(args, topo, measured, sharded) if args.predict else ({}, {})
    for r in results:
        if r["run"] in predicted:
            r["predicted_ms"] = 1e3 * predicted[r["run"]]
        if r["run"] + "/measured-collectives" in predicted:
            r["predicted_ms_measured_collectives"] = 1e3 * predicted[r["run"] + "/measured-collectives"]
    if dist.get_rank() == 0:
        _report(results, args, topo, inputs, peak_kind(memory.device))
    return 0


# ------------------------------------------------------------------------------------------ prediction
def _plans(args, topo, shapes: list[tuple[int, ...]]) -> dict:
    """Each run as the simulator's plan (None: DDP's schedule), on gloo: FSDP2's own all-gathers are
    issued when a block is reached; commopt's (``fsdp.shard``) are prefetched."""
    from commopt.comm import compression as C
    from commopt.schedules.simulator import ShardedPlan, quantized_ratio

    numel = sum(math.prod(s) for s in shapes)
    local = topo.local_size
    native_rs = "allreduce" if dist.get_backend() == "gloo" else "reduce_scatter"  # see _native_link_bytes
    rows = [(-(-s[0] // local), math.prod(s[1:])) if len(s) > 1 else (math.prod(s),) for s in shapes]
    # Payload over fp32 bytes of the shard (n=2: the ring factor is 1).
    psgd = C.PowerSGDCompressor(rank=args.powersgd_rank).shapes_bytes(rows, 2) / (4 * numel / local)
    zero = ShardedPlan("fsdp", "hierarchical", hpz=True, weight_ratio=quantized_ratio(8), grad_ratio=quantized_ratio(4))
    plans = {
        "ddp": None,
        "fsdp2": ShardedPlan("fsdp", "flat", prefetch=False, reduce_scatter_as=native_rs),
        "hsdp": ShardedPlan("hsdp", prefetch=False, reduce_scatter_as=native_rs),
        "hierarchical": ShardedPlan("fsdp", "hierarchical"),
        "zero++": zero,
        "zero++/no-ef": zero,
        "hsdp-int8": ShardedPlan("hsdp", grad_ratio=quantized_ratio(8)),
        "hsdp-int8/no-ef": ShardedPlan("hsdp", grad_ratio=quantized_ratio(8)),
        "hsdp-powersgd": ShardedPlan("hsdp", grad_ratio=min(1.0, psgd)),
    }
    # On CPU (no streams) FSDP2's backward waits for every reduction (torch's and commopt's).
    return {k: v if v is None else dataclasses.replace(v, blocking_reduce=True) for k, v in plans.items()}


def _predict(args, topo, measured: dict[str, float],
             sharded: dict[str, tuple[float, float, float]]) -> tuple[dict[str, float], dict]:
    """Seconds per step the simulator predicts for each measured run, and what it was given, from
    what this cluster measures (on every rank at once, as training runs): the cost model
    (``cost.calibrate``: the node link as gloo drives it), each FSDP unit's share of forward and
    backward (``layers_from_model`` grouped by block, the root's layers as the first unit), scaled
    to the run's floor (DDP: the measured ``compute`` run; sharded runs: FSDP2 itself with comms
    that move nothing but synchronise, trained among the runs), the optimizer's step, and the block
    codec's encode + decode per byte (the weights': int8; the gradients': the run's own bits, with
    its error feedback; PowerSGD: its three products). Collective; rank 0's numbers."""
    from commopt.bench.models import synthetic_tokens
    from commopt.comm import cost
    from commopt.comm.compression import QuantizeCompressor
    from commopt.comm.compression.quantize import encode_with_feedback
    from commopt.schedules.simulator import Layer, Schedule, layers_from_model, link_service, simulate, simulate_sharded

    # The levels, and the lines of commopt's own reduce-scatter and all-gather calls (their per-call
    # CPU work is not in the levels: without them the model put commopt's FSDP2 steps 30 % fast).
    collectives = ("allreduce", "reduce_scatter", "all_gather")
    small = dict(sizes=(4 << 10, 64 << 10), reps=2) if args.quick else {}  # --quick: a smoke test
    model = cost.calibrate(topo, collectives=collectives, **small)
    lines = {c: cost.measured_lines(c, topo) or {} for c in collectives}
    gpt = _gpt(args)
    data = synthetic_tokens(args.batch, args.seq_len, _VOCAB, seed=dist.get_rank())
    dist.barrier()
    raw = layers_from_model(gpt, data[:, :-1], repeats=5, loss=lambda y: nn.functional.cross_entropy(
        y.reshape(-1, _VOCAB), data[:, 1:].reshape(-1)))
    units: dict[str, list[Layer]] = {}
    for layer in raw:
        parts = layer.name.split(".")
        units.setdefault(".".join(parts[:2]) if parts[0] == "blocks" else "", []).append(layer)
    layers = [Layer(k or "<root>", sum(x.forward for x in v), sum(x.backward for x in v), sum(x.grad_bytes for x in v))
              for k, v in units.items()]
    layers = [layers[-1], *layers[:-1]] if layers[0].name != "<root>" else layers
    nbytes = sum(x.grad_bytes for x in layers)

    timed = cost.median_seconds
    for p in gpt.parameters():
        p.grad = torch.randn_like(p)
    opt = torch.optim.AdamW(gpt.parameters(), lr=args.lr)
    optimizer = timed(opt.step) / nbytes
    # The codecs, timed on a block's own layout: blocks restart at every parameter, and each segment
    # costs its own kernel calls (int4 with error feedback: 1.6x the cost per byte of one segment).
    segments = [-(-p.shape[0] // topo.world_size) * math.prod(p.shape[1:]) for p in gpt.blocks[0].parameters()]
    x = torch.randn(sum(segments))

    def codec_cost(bits: int, feedback: bool, stochastic: bool, add: bool) -> float:
        """Seconds per fp32 byte of an encode as the exchanges run it (``feedback``: the residual
        added before and updated after) and a decode (``add``: into a running sum)."""
        codec = QuantizeCompressor(bits, 256)
        payload, sums = torch.empty(codec.nbytes(segments), dtype=torch.uint8), torch.zeros_like(x)
        residual = torch.zeros_like(x) if feedback else None
        return timed(lambda: (encode_with_feedback(codec, x, segments, payload, residual, 0, 0, stochastic),
                              codec.decode(payload, segments, sums, add=add))) / (4 * x.numel())

    quantize = codec_cost(8, False, False, False)  # the weights' (qwZ: nearest, nothing kept)
    # The gradients' (error feedback rounds to nearest, no feedback stochastically): qgZ's two levels
    # encode and decode (W - 1)/W of a layer on each rank, as a flat reduce-scatter would; compressed
    # HSDP's rail all-reduce, its shard.
    share = (topo.world_size - 1) / topo.world_size
    grad_codecs = {"zero++": share * codec_cost(4, True, False, True),
                   "zero++/no-ef": share * codec_cost(4, False, True, True),
                   "hsdp-int8": codec_cost(8, True, False, True), "hsdp-int8/no-ef": codec_cost(8, False, True, True)}
    d = args.d_model
    m, qm = torch.randn(4 * d // topo.local_size, d), torch.randn(d, args.powersgd_rank)
    psgd = timed(lambda: (m @ qm, m.t() @ (m @ qm), (m @ qm) @ qm.t())) / (4 * m.numel())
    own = sum(x.forward + x.backward for x in layers)

    def scaled(step: float, opt_seconds: float) -> list[Layer]:
        """The units scaled so that forward + backward + the optimizer's ``opt_seconds`` is ``step``."""
        k = (step - opt_seconds) / own
        return [Layer(x.name, x.forward * k, x.backward * k, x.grad_bytes) for x in layers]

    # The floors: DDP's is the measured compute run; a sharded run's (``sharded``: step, optimizer
    # step, prefetch gap) is FSDP2 itself without any communication (comms that only copy this
    # rank's own data, once every rank of the group has arrived), which adds FSDP2's copies in and
    # out of its flat buffers, DTensor dispatch, the optimizer on 1/world of the parameters and the
    # waits for the slowest rank; and each prefetched all-gather's issue waits for FSDP2's work
    # between two gathers, measured on the same floor (:func:`_prefetch_gap`).
    floors = {"ddp": (measured.get("compute", own + optimizer * nbytes), optimizer * nbytes)}
    floors.update({kind: (step, opt_step) for kind, (step, opt_step, _) in sharded.items()})
    gaps = {kind: gap for kind, (_, _, gap) in sharded.items()}
    inputs = {"cost_model": model.to_dict(), "optimizer_s_per_byte": optimizer,
              "measured_lines": {c: {a: [line.alpha, line.beta, [list(p) for p in line.points]]
                                     for a, line in v.items()} for c, v in lines.items()},
              "floors_ms": {k: [1e3 * v for v in f] for k, f in floors.items()},
              "prefetch_gap_ms": {k: 1e3 * v for k, v in gaps.items()},
              "int8_codec_s_per_byte": quantize, "grad_codec_s_per_byte": grad_codecs, "powersgd_s_per_byte": psgd,
              "units": [{"name": x.name, "forward_ms": 1e3 * x.forward, "backward_ms": 1e3 * x.backward,
                         "bytes": x.grad_bytes} for x in layers]}
    shapes = [tuple(p.shape) for p in gpt.parameters()]
    in_blocks = {id(p) for p in gpt.blocks.parameters()}
    unit_params = {sum(p.numel() * 4 for p in group.values()): group for group in (
        dict(gpt.blocks[0].named_parameters()),
        {n: p for n, p in gpt.named_parameters() if id(p) not in in_blocks})}
    out: dict[str, float] = {}
    inputs["measured_collectives_ms"] = {}
    for name, plan in _plans(args, topo, shapes).items():
        if name not in measured:
            continue
        if plan is None:
            step, opt_seconds = floors["ddp"]
            sched = Schedule("ddp", bucket_cap_mb=64, first_bucket_cap_mb=64,
                             optimizer_seconds_per_byte=opt_seconds / nbytes)
            out[name] = simulate(scaled(step, opt_seconds), link_service("flat", topo, model), sched).iteration
            continue
        if plan.kind not in floors:
            continue
        step, opt_seconds = floors[plan.kind]
        shard_bytes = nbytes / (topo.local_size if plan.kind == "hsdp" else topo.world_size)
        per_byte = psgd if name == "hsdp-powersgd" else quantize
        plan = dataclasses.replace(plan, optimizer_seconds_per_byte=opt_seconds / shard_bytes,
                                   codec_seconds_per_byte=per_byte, grad_codec_seconds_per_byte=grad_codecs.get(name),
                                   prefetch_issue_seconds=gaps[plan.kind] if plan.prefetch else None)
        layers_k = scaled(step, opt_seconds)
        native = name in ("fsdp2", "hsdp")  # torch's own collectives: the levels model them
        out[name] = simulate_sharded(layers_k, topo, plan, model, lines=None if native else lines).iteration
        # Each unit's collectives measured at its own size (the root's and a block's).
        table = {unit: _collective_seconds(name, topo, params, args) for unit, params in unit_params.items()}
        inputs["measured_collectives_ms"][name] = {str(u): [1e3 * t for t in v] for u, v in table.items()}
        seconds = tuple((lambda n, i=i, t=table: t[int(n)][i]) for i in range(3))
        out[name + "/measured-collectives"] = simulate_sharded(layers_k, topo, plan, model, seconds).iteration
    return out, inputs


def _profile(active: list[dict], args, topo) -> None:
    """Where a collective's time goes inside a training step: every engine phase's mean time running
    and waiting to start (its queue and thread hand-off) in ``args.profile`` steps of each run with
    commopt's comms, against the same phases of the run's collectives alone (a block's, as ``sim*``
    measures them); ``Engine.time_phases``. Printed by rank 0."""
    from commopt.comm import context

    engine = context().engine()
    block = dict(_gpt(args).blocks[0].named_parameters())
    for run in active:
        if run["comms"] is None and not run["name"].startswith("hsdp-"):
            continue  # torch's own comms: no engine phases to show
        engine.time_phases()
        for step in range(args.profile):
            _step(run, 10_000 + step, args, topo, timed=False)
        inside = engine.phase_times()
        engine.time_phases()
        _collective_seconds(run["name"], topo, block, args)
        alone = engine.phase_times()
        engine.time_phases(False)
        if dist.get_rank() != 0:
            continue
        print(f"# profile {run['name']}: engine phases per call, mean ms running and waiting to start (queue, "
              f"thread hand-off), inside a step ({args.profile} steps) and alone (a block's collectives; rank 0)")
        print(f"#   {'phase':<50}{'calls/step':>11}{'run':>8}{'wait':>8}{'alone run':>10}{'wait':>8}{'ratio':>7}")
        for key in sorted(inside, key=lambda k: -(inside[k][1] + inside[k][2])):
            calls, run_s, wait_s = inside[key]
            a_calls, a_run, a_wait = alone.get(key, (0, 0.0, 0.0))
            in_ms, wait_ms = 1e3 * run_s / calls, 1e3 * wait_s / calls
            a_ms = 1e3 * a_run / a_calls if a_calls else 0.0
            a_wait_ms = 1e3 * a_wait / a_calls if a_calls else 0.0
            whole = a_ms + a_wait_ms
            ratio = f"{(in_ms + wait_ms) / whole:7.2f}" if a_calls and whole > 0 else f"{'-':>7}"
            print(f"#   {key:<50}{calls / args.profile:11.1f}{in_ms:8.2f}{wait_ms:8.2f}"
                  + (f"{a_ms:10.2f}{a_wait_ms:8.2f}" if a_calls else f"{'-':>10}{'-':>8}") + ratio)


class _OwnDataOnly:
    """An FSDP2 reduce-scatter / all-gather that moves nothing: this rank's own data in place of
    every rank's (the timing floor of FSDP2 itself; its results are not the collective's), after a
    barrier on the collective's group: every collective waits for the group's slowest rank, and on
    a machine whose ranks share cores those waits add up over a step's 15 collectives (the floor of
    the GPT on the emulated 2x2: 181-193 ms without them, 292 ms with). Without the waits the
    simulator put the ZeRO++ recipe's step at 0.42-0.58 of the measured one, torch's FSDP2 at
    0.82-0.91 (docs/results.md 24).

    ``marks``: a list this comm appends ``("issue", t)`` to when an all-gather is called and
    ``("wait", t)`` when FSDP2's wait for it returns (``time.perf_counter()``), to time FSDP2's
    own work between two all-gathers (:func:`_prefetch_gap`)."""

    def __init__(self, marks: list | None = None):
        self.marks = marks

    def allocate(self, size, *, dtype, device):
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(self, output_tensor, input_tensor, group, op=None, async_op=False):
        from commopt.comm.fsdp._common import done_work

        out, inp = output_tensor.detach().view(-1), input_tensor.detach().view(-1)
        gather = out.numel() >= inp.numel()
        if gather and self.marks is not None:
            self.marks.append(("issue", time.perf_counter()))
        dist.barrier(group=group)
        if gather:  # all-gather: every row is this rank's shard (its own row is the input itself:
            out.view(-1, inp.numel()).copy_(inp.clone())  # FSDP2 gathers in place)
        else:  # reduce-scatter: this rank's row of the input
            out.copy_(inp.view(-1, out.numel())[group.rank()])
        work = done_work(async_op)
        return _MarkedWork(work, self.marks) if gather and work is not None and self.marks is not None else work


class _MarkedWork(dist.Work):
    """A completed ``Work`` whose ``wait()`` appends ``("wait", time.perf_counter())`` to ``marks``."""

    def __init__(self, inner: dist.Work, marks: list):
        super().__init__()
        self.inner, self.marks = inner, marks

    def wait(self, timeout=None) -> bool:
        self.inner.wait()
        self.marks.append(("wait", time.perf_counter()))
        return True


def _floor(run: dict, args) -> tuple[float, float, float]:
    """(step, optimizer step, prefetch gap) seconds of a floor run after training: the slowest
    rank's medians, and :func:`_prefetch_gap` on its model. Collective."""
    worst = torch.tensor([statistics.median(run["times"]), statistics.median(run["opt_times"])], dtype=torch.float64)
    dist.all_reduce(worst, op=dist.ReduceOp.MAX)
    return float(worst[0]), float(worst[1]), _prefetch_gap(run["module"], args)


def _prefetch_gap(model: nn.Module, args) -> float:
    """Seconds from FSDP2's wait for an all-gather returning to its issuing the next one, with the
    prefetching commopt's comms set (``fsdp.shard``: each block prefetches the next, asynchronous
    unshards): the copy-out, FSDP2's hooks and the next copy-in, on the training thread, while the
    link idles (``ShardedPlan.prefetch_issue_seconds``). The median over three steps' gaps (a
    step's longest, forward's last block to backward's first, holds compute and is no gap); the
    slowest rank's."""
    from commopt.bench.models import synthetic_tokens
    from commopt.comm.fsdp.register import _prefetch

    marks: list = []
    for m in [model, *model.blocks]:
        m.set_custom_all_gather(_OwnDataOnly(marks))
    _prefetch(model, list(model.blocks))
    gaps = []
    for i in range(3):
        data = synthetic_tokens(args.batch, args.seq_len, _VOCAB, seed=20_000 + 10_000 * i + dist.get_rank())
        dist.barrier()
        marks.clear()
        logits = model(data[:, :-1])
        nn.functional.cross_entropy(logits.reshape(-1, _VOCAB), data[:, 1:].reshape(-1)).backward()
        gaps += [b[1] - a[1] for a, b in zip(marks, marks[1:]) if a[0] == "wait" and b[0] == "issue"]
    slowest = torch.tensor([statistics.median(gaps) if gaps else 0.0], dtype=torch.float64)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
    return float(slowest)


def _collective_seconds(name: str, topo, block: dict, args) -> tuple[float, float, float]:
    """Seconds of one FSDP unit's (forward all-gather, backward all-gather, gradient reduction) with
    the run's own comms on this cluster, alone (medians of 3, every rank at once); ``block``: the
    unit's parameters by name."""
    from torch.distributed import ReduceOp

    from commopt.comm import compression as C
    from commopt.comm import context, cost, fsdp
    from commopt.comm.algorithms._transport import all_gather_single, reduce_scatter_single
    from commopt.comm.fsdp._common import Bound, Layout

    world, local = topo.world_size, topo.local_size
    groups = context().groups(topo, "bench-fsdp-sim")
    node = groups.intra if groups.intra is not None else dist.group.WORLD
    names = list(block)
    shards = [-(-p.shape[0] // (local if name.startswith("hsdp") else world)) * math.prod(p.shape[1:])
              for p in block.values()]
    shapes = [(-(-p.shape[0] // local), *p.shape[1:]) for p in block.values()]
    chunk = sum(shards)
    full = torch.randn(world * chunk)
    bound = Bound(Layout("sim", tuple(names), tuple(shards), tuple(shapes)))

    timed = functools.partial(cost.median_seconds, reps=3)

    def native_gather(group, n: int):
        out = torch.empty(n * chunk)
        return lambda: all_gather_single(out, full[:chunk], group=group)

    def native_scatter(group, n: int):
        out = torch.empty(chunk)
        return lambda: reduce_scatter_single(out, full[: n * chunk], group=group)

    def comm_gather(comm, group, n: int):
        comm = comm.bind(bound)
        out = torch.empty(n * chunk)
        return lambda: comm(out, full[:chunk], group)

    def comm_scatter(comm, group, n: int):
        comm = comm.bind(bound)
        out = torch.empty(chunk)
        return lambda: comm(out, full[: n * chunk], group, ReduceOp.AVG)

    def then(*fns):
        return lambda: [fn() for fn in fns]

    world_group = dist.group.WORLD
    if name == "fsdp2":
        fg = bg = timed(native_gather(world_group, world))
        red = timed(native_scatter(world_group, world))
    elif name == "hsdp":
        shard = torch.empty(chunk)
        fg = bg = timed(native_gather(node, local))
        red = timed(then(native_scatter(node, local), lambda: dist.all_reduce(shard, group=groups.rail)))
    elif name == "hierarchical":
        fg = bg = timed(comm_gather(fsdp.AllGatherComm(topo, "hierarchical"), world_group, world))
        red = timed(comm_scatter(fsdp.ReduceScatterComm(topo, "hierarchical"), world_group, world))
    elif name.startswith("zero++"):
        fg = timed(comm_gather(fsdp.AllGatherComm(topo, "auto", C.QuantizeCompressor(8)), world_group, world))
        bg = timed(comm_gather(fsdp.AllGatherComm(topo), node, local))
        red = timed(comm_scatter(fsdp.ReduceScatterComm(topo, "auto", C.QuantizeCompressor(4),
                                                        error_feedback=name == "zero++"), world_group, world))
    else:  # compressed HSDP: commopt's exchange inside the node, the hook across
        comp = (C.PowerSGDCompressor(rank=args.powersgd_rank, start_iter=0) if name == "hsdp-powersgd"
                else C.QuantizeCompressor(8))
        hook = fsdp.AllReduceHook(comp, topo, error_feedback=not name.endswith("no-ef"))
        hook = hook.bind(bound)
        shard = torch.randn(chunk)
        fg = bg = timed(comm_gather(fsdp.AllGatherComm(topo), node, local))
        red = timed(then(comm_scatter(fsdp.ReduceScatterComm(topo), node, local), lambda: hook(shard)))
    return fg, bg, red


def _report(results: list[dict], args, topo, inputs: dict, kind: str) -> None:
    by = {r["run"]: r for r in results}
    n_params = sum(p.numel() for p in _gpt(args).parameters())
    link = f", node link {topo.link_rate_bps / 1e6:.0f} Mbit/s" if topo.link_rate_bps else ""
    print(f"# commopt-bench fsdp: GPT d={args.d_model} L={args.layers} ({n_params / 1e6:.2f} M parameters, "
          f"{4 * n_params / 2**20:.1f} MiB fp32) seq={args.seq_len} batch={args.batch}/rank, AdamW lr={args.lr}, "
          f"{args.steps} timed steps after {args.warmup}, world {dist.get_world_size()} ({topo.layout}{link}), "
          f"interleaved")
    print(f"# peak MiB: the largest peak memory of a timed step, over the steps and the ranks ({kind}: the process's, "
          f"model and optimizer included; hpZ keeps a node's secondary shard)")
    print("# link MB: bytes the busiest node link carries per step, one direction, as the algorithms' traffic "
          "model says (* = torch's calls under the same model; gloo's reduce-scatter is an all-reduce); wire MB: "
          "the same measured on the busiest node's interface counters (emulated cluster only, headers included); "
          "sent MB: bytes per rank counted by commopt's engine (- : torch's comms, not counted); "
          "loss: mean of the last 5 steps; sim: the simulator's step time from this cluster's calibration "
          "(simulate_sharded; DDP: simulate; commopt's reduce-scatter and all-gather from their measured lines, "
          "cost.calibrate(collectives=...)), and its ratio to the measured one; sim*: the same schedule with "
          "each collective's time measured alone at each unit's size instead")
    base = by.get("fsdp2")
    print(f"{'run':<15}{'step(ms)':>10}{'peak MiB':>10}{'vs fsdp2':>10}{'link MB':>10}{'wire MB':>9}{'sent MB':>9}"
          f"{'loss':>9}{'vs exact':>10}"
          f"{'sim(ms)':>9}{'sim/meas':>9}{'sim*/meas':>10}   description")
    for r in results:
        if "skipped" in r:
            print(f"{r['run']:<15}{'-':>10}{'':>10}{'':>10}{'':>10}{'':>9}{'':>9}{'':>9}{'':>10}{'':>28}   "
                  f"not run: {r['skipped']}")
            continue
        sim = (f"{r['predicted_ms']:>9.1f}{r['predicted_ms'] / r['step_ms']:>9.2f}" if "predicted_ms" in r
               else f"{'':>18}")
        sim += (f"{r['predicted_ms_measured_collectives'] / r['step_ms']:>10.2f}"
                if "predicted_ms_measured_collectives" in r else f"{'':>10}")
        ref = by.get("hsdp") if r["run"].startswith("hsdp") and "step_ms" in by.get("hsdp", {}) else base
        speed = f"{base['step_ms'] / r['step_ms']:>9.2f}x" if base and "step_ms" in base else f"{'':>10}"
        rel = (f"{100 * (r['final_loss'] - ref['final_loss']) / ref['final_loss']:>+9.2f}%"
               if ref and "final_loss" in ref and r["run"] != "compute" else f"{'':>10}")
        mark = "*" if r["link_modelled"] and r["run"] not in ("compute",) else " "
        sent = f"{r['sent_bytes_per_step'] / 1e6:>9.2f}" if not r["link_modelled"] else f"{'-':>9}"
        wire = f"{r['wire_bytes_per_step'] / 1e6:>9.2f}" if r["wire_bytes_per_step"] else f"{'-':>9}"
        print(f"{r['run']:<15}{r['step_ms']:>10.1f}{r['peak_memory_bytes'] / 2**20:>10.1f}{speed}"
              f"{r['link_bytes_per_step'] / 1e6:>9.2f}{mark}"
              f"{wire}{sent}{r['final_loss']:>9.4f}{rel}{sim}   {RUNS[r['run']]}")
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
            "link_rate_bps": topo.link_rate_bps, "parameters": n_params, "results": results, "peak_memory_kind": kind,
            "simulator_inputs": inputs}
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(data, f, indent=1)
