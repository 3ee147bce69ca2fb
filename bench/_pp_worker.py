"""The ranks of ``commopt-bench pp`` (``--worker``): the bench GPT split into one pipeline stage per rank,
trained by every run side by side, one step of each in turn (``_progress.interleaved``), on the same
tokens from the same initial weights, each run on a process group of its own.

A run is ``torch-1f1b`` / ``torch-gpipe`` (torch's ``Schedule1F1B`` / ``ScheduleGPipe`` over a
``PipelineStage`` on plain gloo) or ``commopt-1f1b`` / ``commopt-gpipe`` with an optional codec suffix
(commopt's executor, ``schedules.pipeline_parallel.PipelineSchedule``): ``-bf16``, ``-fp16``, ``-int8``,
``-int4`` (both directions), ``-aqsgd`` (AQ-SGD's delta mode: int4 activations against the per-sample
cache, int8 gradients). Beside the runs, a ``compute`` pass times each stage's forward and backward of
every micro-batch with no communication at all (every stage at once, so their contention for the cores
is the pipeline's), and from those times the simulator (``schedules.simulator.simulate_pipeline``)
predicts each run's step on this link. Rank 0 writes one record per run (``--json``); ``bench/pp.py``
orchestrates the workers and prints the table.
"""

from __future__ import annotations

import json
import os
import re
import statistics
import time
from typing import NamedTuple

import torch
import torch.distributed as dist
from torch import nn

from ._memory import PeakMemory, peak_kind
from ._progress import interleaved

__all__ = ["RUNS", "RunSpec", "run_spec", "stage_module", "worker_body"]

VOCAB = 256
#: The runs of ``commopt-bench pp`` by default.
RUNS = ("torch-1f1b", "commopt-1f1b", "commopt-1f1b-int8", "commopt-1f1b-aqsgd")
_NAME = re.compile(r"(torch|commopt)-(1f1b|gpipe)(?:-(bf16|fp16|int8|int4|aqsgd))?")
_COMPUTE = "compute"  # the pseudo-run timing the stages with no communication


class RunSpec(NamedTuple):
    """What a run is: ``impl`` "torch" or "commopt", ``schedule`` "1f1b" or "gpipe", the codec of the
    activations (``fwd``) and of their gradients (``bwd``; None: fp32), ``delta``: AQ-SGD's delta mode."""

    impl: str
    schedule: str
    fwd: str | None
    bwd: str | None
    delta: bool


def run_spec(name: str) -> RunSpec:
    """The :class:`RunSpec` of run ``name``; raises ValueError naming the accepted forms otherwise."""
    m = _NAME.fullmatch(name)
    if m is None or (m.group(1) == "torch" and m.group(3)):
        raise ValueError(f"commopt-bench pp: unknown run {name!r}; a run is torch-1f1b, torch-gpipe (torch's "
                         f"schedules, fp32) or commopt-1f1b / commopt-gpipe with an optional -bf16, -fp16, -int8, "
                         f"-int4 (both directions) or -aqsgd (delta int4 forward, int8 backward): commopt-1f1b-int8")
    codec = m.group(3)
    if codec == "aqsgd":
        return RunSpec(m.group(1), m.group(2), "int4", "int8", True)
    return RunSpec(m.group(1), m.group(2), codec, codec, False)


class _Embed(nn.Module):
    def __init__(self, tok: nn.Embedding, pos: nn.Embedding) -> None:
        super().__init__()
        self.tok, self.pos = tok, pos

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.tok(tokens) + self.pos(torch.arange(tokens.shape[1], device=tokens.device))


def stage_module(stage: int, stages: int, args) -> nn.Sequential:
    """Stage ``stage`` of ``stages`` of the bench GPT (``bench.models.GPT``, seed 0: the same weights on
    every rank and for every run): the embeddings before the first stage's blocks, the blocks split
    evenly, the final norm and the head after the last stage's. Every stage takes and returns one tensor."""
    from .models import GPT

    if args.layers < stages:
        raise ValueError(f"commopt-bench pp: --layers {args.layers} < {stages} stages; each stage needs a block")
    gpt = GPT(VOCAB, args.d_model, args.layers, 4, args.seq_len, seed=0)
    lo, hi = args.layers * stage // stages, args.layers * (stage + 1) // stages
    parts: list[nn.Module] = [_Embed(gpt.tok, gpt.pos)] if stage == 0 else []
    parts += list(gpt.blocks[lo:hi])
    if stage == stages - 1:
        parts += [gpt.ln, gpt.head]
    return nn.Sequential(*parts)


def _loss(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(logits.reshape(-1, VOCAB), target.reshape(-1))


# ------------------------------------------------------------------------------------------- data
def _dataset(args) -> torch.Tensor:
    """The finite training set: ``args.samples`` sequences of ``seq_len + 1`` tokens."""
    from .models import synthetic_tokens

    return synthetic_tokens(args.samples, args.seq_len, VOCAB, seed=1)


def batch_ids(step: int, batch: int, samples: int) -> torch.Tensor:
    """The sample ids of ``step``: the data set cycled in a fresh order every epoch (``samples`` a multiple
    of ``batch``, so a step's ids are distinct), the same for every run."""
    per_epoch = samples // batch
    epoch, k = divmod(step, per_epoch)
    order = torch.randperm(samples, generator=torch.Generator().manual_seed(1000 + epoch))
    return order[k * batch:(k + 1) * batch]


# ------------------------------------------------------------------------------------------- runs
def _setup(name: str, args, stage: int, stages: int) -> dict:
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

    from commopt.schedules.pipeline_parallel import PipelineSchedule

    group = dist.new_group(list(range(stages)))  # every run its own: torch's and commopt's traffic never mix
    module = stage_module(stage, stages, args)
    run = {"name": name, "module": module, "group": group, "times": [], "bytes": [], "wire": [], "losses": []}
    if name == _COMPUTE:
        return run
    spec = run_spec(name)
    run["spec"] = spec
    run["opt"] = torch.optim.AdamW(module.parameters(), lr=args.lr)
    if spec.impl == "torch":
        pstage = PipelineStage(module, stage, stages, torch.device("cpu"), group=group)
        cls = Schedule1F1B if spec.schedule == "1f1b" else ScheduleGPipe
        run["sched"] = cls(pstage, n_microbatches=args.micro, loss_fn=_loss)
    else:
        run["sched"] = PipelineSchedule(module, n_microbatches=args.micro, loss_fn=_loss, group=group,
                                        schedule=spec.schedule, forward_codec=spec.fwd, backward_codec=spec.bwd,
                                        delta_samples=args.samples if spec.delta else None, extra=args.extra,
                                        depth=args.depth, timeout=args.timeout)
    return run


def _wire_bytes(linked: bool) -> int:
    if not linked:
        return 0
    from .cluster.host import wire_bytes

    return wire_bytes()


def _sent(run: dict) -> dict[str, int]:
    """Boundary bytes this rank sent so far, by ``"<boundary>/<fwd|bwd>"``."""
    if run["spec"].impl == "commopt":
        return dict(run["sched"].bytes_sent())
    return {}  # torch's: computed from the activation's size (fp32, no framing) in _boundary_bytes


def _step(run: dict, i: int, args, ctx: dict) -> None:
    stage, stages = ctx["stage"], ctx["stages"]
    ids = batch_ids(i, args.batch, args.samples)
    tokens = ctx["data"][ids]
    x, y = tokens[:, :-1], tokens[:, 1:]
    if run["name"] == _COMPUTE:
        return _compute_step(run, i, args, ctx, x, y)
    spec, sched = run["spec"], run["sched"]
    dist.barrier()
    sent, wire = _sent(run), _wire_bytes(ctx["linked"])
    ctx["memory"].start()
    t0 = time.perf_counter()
    run["opt"].zero_grad(set_to_none=True)
    losses: list = []
    kw = {"sample_ids": ids} if spec.delta else {}
    if stage == 0:
        sched.step(x, **kw)
    elif stage == stages - 1:
        sched.step(target=y, losses=losses, **kw)
    else:
        sched.step(**kw)
    run["opt"].step()
    elapsed = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
    ctx["memory"].stop(run["name"])
    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)  # the step is as slow as its slowest stage
    if losses:
        run["losses"].append(float(torch.stack([v.detach() for v in losses]).mean()))
    if i < args.warmup:
        return
    now = _sent(run)
    run["times"].append(float(elapsed))
    run["bytes"].append({k: v - sent.get(k, 0) for k, v in now.items()})
    run["wire"].append(_wire_bytes(ctx["linked"]) - wire)


def _compute_step(run: dict, i: int, args, ctx: dict, x: torch.Tensor, y: torch.Tensor) -> None:
    """Every micro-batch's forward and backward of this stage, 1F1B's steady order, no communication:
    the per-stage compute the simulator is given (every stage computes at once, as in the pipeline)."""
    stage, stages, module = ctx["stage"], ctx["stages"], run["module"]
    mb = args.batch // args.micro
    g = torch.Generator().manual_seed(i)
    dist.barrier()
    fwd, bwd = [], []
    for k in range(args.micro):
        if stage == 0:
            inp = x[k * mb:(k + 1) * mb]
        else:
            inp = torch.randn(mb, args.seq_len, args.d_model, generator=g).requires_grad_(True)
        t0 = time.perf_counter()
        out = module(inp)
        t1 = time.perf_counter()
        if stage == stages - 1:
            _loss(out, y[k * mb:(k + 1) * mb]).backward()
        else:
            out.backward(torch.randn(out.shape, generator=g))
        t2 = time.perf_counter()
        fwd.append(t1 - t0)
        bwd.append(t2 - t1)
    module.zero_grad(set_to_none=True)
    if i >= args.warmup:
        run["times"].append((statistics.median(fwd), statistics.median(bwd)))


def _codec_costs(args) -> dict[str, tuple[float, float]]:
    """Seconds per fp32 byte of each codec's encode and decode on one micro-batch's activation, measured
    here (median of 5): what the simulator charges the sender and the receiver. ``delta-int4`` adds AQ-SGD's
    subtraction from and addition to the cache."""
    from commopt.comm.pipeline import get_codec

    mb = args.batch // args.micro
    x = torch.randn(mb, args.seq_len, args.d_model, generator=torch.Generator().manual_seed(0))
    nbytes = x.numel() * 4
    out = {}
    for name in ("none", "bf16", "fp16", "int8", "int4"):
        codec = get_codec(name)
        buf = torch.empty(codec.nbytes(tuple(x.shape), x.dtype), dtype=torch.uint8)
        enc, dec = [], []
        for _ in range(5):
            t0 = time.perf_counter()
            codec.encode(x, buf)
            t1 = time.perf_counter()
            codec.decode(buf, tuple(x.shape), x.dtype).clone()
            dec.append(time.perf_counter() - t1)
            enc.append(t1 - t0)
        out[name] = (statistics.median(enc) / nbytes, statistics.median(dec) / nbytes)
    adds = []
    for _ in range(5):
        t0 = time.perf_counter()
        (x - x).add_(x)
        adds.append(time.perf_counter() - t0)
    add = statistics.median(adds) / 2 / nbytes
    out["delta-int4"] = (out["int4"][0] + add, out["int4"][1] + add)
    return out


# ------------------------------------------------------------------------------------------- results
@torch.no_grad()
def _held_out(run: dict, args, stage: int, stages: int) -> float:
    """The mean cross-entropy of the trained stages on ``args.eval_sequences`` held-out sequences no run
    trained on, in micro-batch-sized pieces, the whole model run exactly (fp32 point-to-point on the world,
    no codec): the model the run would save."""
    from .models import synthetic_tokens

    module, total = run["module"], 0.0
    mb = args.batch // args.micro
    pieces = max(1, args.eval_sequences // mb)
    for i in range(pieces):
        data = synthetic_tokens(mb, args.seq_len, VOCAB, seed=99_000_000 + i)
        if stage == 0:
            h = module(data[:, :-1])
        else:
            h = torch.empty(mb, args.seq_len, args.d_model)
            dist.recv(h, stage - 1)
            h = module(h)
        if stage < stages - 1:
            dist.send(h.contiguous(), stage + 1)
        else:
            total += float(_loss(h, data[:, 1:]))
    mean = torch.tensor([total / pieces], dtype=torch.float64)
    dist.broadcast(mean, stages - 1)
    return float(mean)


def _boundary_bytes(run: dict, args, stages: int) -> list[dict[str, float]]:
    """Per boundary, the mean bytes per step of each direction (activations ``fwd``, gradients ``bwd``):
    commopt's as its channel counted them (payload and trailer), torch's from the activation's size."""
    if run["spec"].impl == "torch":
        one = args.micro * (args.batch // args.micro) * args.seq_len * args.d_model * 4
        return [{"fwd": float(one), "bwd": float(one)} for _ in range(stages - 1)]
    mine = {k: statistics.mean(b.get(k, 0) for b in run["bytes"]) for k in (run["bytes"][0] if run["bytes"] else {})}
    everyone: list = [None] * stages
    dist.all_gather_object(everyone, mine)
    merged: dict[str, float] = {}
    for d in everyone:
        merged.update(d)
    return [{"fwd": merged.get(f"{b}/fwd", 0.0), "bwd": merged.get(f"{b}/bwd", 0.0)} for b in range(stages - 1)]


def _predict(spec: RunSpec, args, compute: dict, costs: dict, link_bps: float | None) -> tuple[float, float]:
    """The simulator's step and floor for ``spec`` with the measured per-stage compute, the codecs' measured
    costs and this link (``link_bps`` bit/s of TCP goodput: the configured rate less tbf's header share,
    ``--sim-goodput``, as the cluster's probe measures on a quiet link; None: loopback, a free link).

    The links are the cluster's star (``links="star"``: every node one shaped link to the fabric, so a
    middle stage's activations and gradients share its uplink), and gloo's ready notice waits behind the
    receiver's own queued payloads to the sender (``notice``, the model's default)."""
    from commopt.comm.links import LinkModel
    from commopt.schedules.simulator import PipelineCodec, pipeline_codec, simulate_pipeline

    def codec(name: str | None, delta: bool) -> PipelineCodec:
        if spec.impl == "torch":
            return PipelineCodec()
        enc, dec = costs["delta-int4" if delta else (name or "none")]
        return pipeline_codec(name or "none", row=args.d_model, encode=enc, decode=dec)

    link = LinkModel(args.sim_alpha, 8.0 / link_bps) if link_bps else LinkModel(0.0, 0.0)
    act = (args.batch // args.micro) * args.seq_len * args.d_model * 4
    r = simulate_pipeline(len(compute["forward_s"]), args.micro, compute["forward_s"], compute["backward_s"], link=link,
                          activation_bytes=act, schedule=spec.schedule, policy=spec.impl,
                          codec_act=codec(spec.fwd, spec.delta), codec_grad=codec(spec.bwd, False),
                          slowdown=args.sim_slowdown, depth=args.depth, extra=args.extra, links="star")
    return r.step, r.floor


def worker_body(args) -> int:
    """One rank of ``commopt-bench pp --worker`` (under ``_launch.launch``): every run, interleaved; rank 0
    writes ``args.json``."""
    torch.set_num_threads(1)
    stage, stages = dist.get_rank(), dist.get_world_size()
    if stages < 2:
        raise SystemExit("commopt-bench pp --worker: needs at least 2 ranks (one pipeline stage each)")
    names = args.runs.split(",")
    timing = not args.loss_steps
    total = args.loss_steps or args.warmup + args.steps
    if not timing:
        args.warmup = 0
    linked = bool(os.environ.get("COMMOPT_LINK_RATE_BPS"))
    ctx = {"stage": stage, "stages": stages, "data": _dataset(args), "linked": linked,
           "memory": PeakMemory("cpu")}
    runs = [_setup(n, args, stage, stages) for n in names]
    if timing:
        runs.append(_setup(_COMPUTE, args, stage, stages))
    costs = _codec_costs(args) if timing else {}
    interleaved(runs, total, lambda run, i: _step(run, i, args, ctx), "runs", rank=stage)
    compute = None
    if timing:
        mine = torch.tensor([statistics.median(f for f, _ in runs[-1]["times"]),
                             statistics.median(b for _, b in runs[-1]["times"])], dtype=torch.float64)
        per = [torch.zeros(2, dtype=torch.float64) for _ in range(stages)]
        dist.all_gather(per, mine)
        compute = {"forward_s": [float(p[0]) for p in per], "backward_s": [float(p[1]) for p in per]}
    configured = float(os.environ.get("COMMOPT_LINK_RATE_BPS", "0") or 0) or None
    measured = float(os.environ.get("COMMOPT_LINK_MEASURED_BPS", "0") or 0) or None
    records = []
    for run in runs:
        if run["name"] == _COMPUTE:
            continue
        rec = _record(run, args, stage, stages, ctx["memory"], configured, measured)
        if compute is not None:
            goodput = configured * args.sim_goodput if configured else None
            rec["sim_step_s"], rec["sim_floor_s"] = _predict(run["spec"], args, compute, costs, goodput)
            rec["x_compute_floor"] = rec["step_s"] / rec["sim_floor_s"]
        records.append(rec)
    if stage == 0 and args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump({"kind": "pp-worker", "stages": stages, "link_rate_bps": configured,
                       "link_measured_bps": measured, "memory": peak_kind("cpu"), "compute": compute,
                       "codec_s_per_byte": costs, "config": _config(args), "results": records}, f, indent=1)
    return 0


def _record(run: dict, args, stage: int, stages: int, memory: PeakMemory, configured: float | None,
            measured: float | None) -> dict:
    spec = run["spec"]
    peak = torch.tensor([memory.peak(run["name"])], dtype=torch.float64)
    dist.all_reduce(peak, op=dist.ReduceOp.MAX)  # the stage that needed the most
    losses: list = [run["losses"]]
    dist.broadcast_object_list(losses, stages - 1)
    wires: list = [None] * stages
    dist.all_gather_object(wires, statistics.mean(run["wire"]) if run["wire"] else 0.0)
    times = run["times"]
    return {"run": run["name"], "impl": spec.impl, "schedule": spec.schedule, "fwd_codec": spec.fwd,
            "bwd_codec": spec.bwd, "delta": spec.delta, "stages": stages, "micro_batches": args.micro,
            "link_mbit": configured / 1e6 if configured else None,
            "link_measured_mbit": measured / 1e6 if measured else None,
            "step_s": statistics.median(times) if times else None,
            "step_mean_s": statistics.mean(times) if times else None, "step_times_s": times,
            "boundary_bytes": _boundary_bytes(run, args, stages),
            "link_tx_bytes_per_node": wires if configured else None,
            "peak_memory_bytes": int(peak[0]), "held_out_loss": _held_out(run, args, stage, stages),
            "train_loss": statistics.mean(losses[0][-5:]) if losses[0] else None, "train_losses": losses[0]}


def _config(args) -> dict:
    return {k: getattr(args, k) for k in ("d_model", "layers", "seq_len", "batch", "micro", "samples", "steps",
                                          "warmup", "loss_steps", "eval_sequences", "lr", "extra", "depth", "sim_alpha",
                                          "sim_slowdown", "sim_goodput")}
