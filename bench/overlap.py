"""``commopt-bench overlap``: OverlapDataParallel against DDP's default, interleaved in one run.

Run it inside the emulated cluster with the link rate chosen so that reducing the gradients takes
about as long as computing them::

    commopt-bench cluster --nodes 2 --ranks-per-node 1 --link-rate 800mbit -- commopt-bench overlap

(on a 2-core machine, 800 Mbit/s gives T_comm / T_compute of about 1 for the default model; the
ratio is printed, so adjust the rate on another machine).

Each rank (1) times T_compute, forward + backward of one step with no communication; (2) fits the
link (alpha, beta) from all-reduces of a few sizes with ``comm.cost.fit`` and times T_comm, the
step's gradient reduction alone (the whole gradient in DDP's 25 MiB buckets, back to back); (3) runs
rounds of K steps of DDP (default hook, one optimizer) and K steps of ``OverlapDataParallel``,
alternating which goes first, and takes the median per-step time of each (for ``OverlapDataParallel``
the steady state, forward end to forward end inside a block: a block's average adds a pipeline fill
and drain that a training loop pays once; both are printed), and, in the same rounds, compute while a
thread reduces gradients back to back (the contention slowdown: where communication runs on the CPU
that computes, overlapped compute is slower) and ``OverlapDataParallel`` over a group of one rank
(its own compute: hooks, bucket copies, threads, with no communication); (4) measures the model's
layers (:func:`commopt.schedules.simulator.layers_from_model`) and predicts both step times with the
simulator from those layers (scaled to T_compute for DDP, to the wrapper's own compute for
``OverlapDataParallel``), the fitted link and the measured slowdown. Times are the slowest rank's
(all-reduce MAX).

``--spawn N`` runs N local ranks instead (a smoke run; loopback has no link to hide).
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import os
import statistics
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from commopt.comm import Topology, all_reduce, cost
from commopt.schedules import Layer, OverlapDataParallel, Schedule, simulate
from commopt.schedules.simulator import layers_from_model

from ._launch import launch
from ._progress import progress

__all__ = ["main", "TinyGPT"]


class _Block(nn.Module):
    def __init__(self, d: int, heads: int):
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.fc, self.out = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, d)
        x = x + self.proj(a)
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class TinyGPT(nn.Module):
    """A GPT-style decoder small enough for one CPU core: embeddings, ``layers`` blocks, tied head."""

    def __init__(self, vocab: int = 512, d: int = 256, layers: int = 6, heads: int = 4, seq: int = 64):
        super().__init__()
        self.tok, self.pos = nn.Embedding(vocab, d), nn.Embedding(seq, d)
        self.blocks = nn.ModuleList(_Block(d, heads) for _ in range(layers))
        self.ln = nn.LayerNorm(d)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1]))
        for blk in self.blocks:
            x = blk(x)
        return self.ln(x) @ self.tok.weight.t()


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="commopt-bench overlap", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", type=int, default=12)
    p.add_argument("--d-model", type=int, default=192)
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--vocab", type=int, default=512)
    p.add_argument("--optimizer", choices=["sgd", "adamw"], default="sgd")
    p.add_argument("--algorithm", default="flat")
    p.add_argument("--plan", choices=["priority", "fifo"], default="priority")
    p.add_argument("--bucket-cap-mb", type=float, default=2.0)
    p.add_argument("--first-bucket-cap-mb", type=float, default=1.0)
    p.add_argument("--partition-mb", type=float, default=None,
                   help="chunk size of the priority plan (default: chosen from the link's cost model)")
    p.add_argument("--credit-mb", type=float, default=None, help="most MiB in flight (default: from the model)")
    p.add_argument("--steps", type=int, default=5, help="steps per timed block")
    p.add_argument("--rounds", type=int, default=10, help="interleaved DDP/overlap rounds")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--json", default=None, help="write the results here (rank 0)")
    p.add_argument("--spawn", type=int, default=0, metavar="N", help="spawn N local ranks (smoke run)")
    p.add_argument("--timeout", type=float, default=300.0)
    p.add_argument("--switch-interval", type=float, default=None, metavar="S",
                   help="sys.setswitchinterval for the ranks (Python's GIL hand-over period, default 0.005)")
    p.add_argument("--trace", default=None, help="write rank 0's per-step issue/ready/done times here (JSON)")
    return p


def _optimizer(name: str):
    if name == "sgd":
        return lambda params: torch.optim.SGD(params, lr=1e-3, momentum=0.9)
    return lambda params: torch.optim.AdamW(params, lr=1e-4)


def _median(v: list[float]) -> float:
    return statistics.median(v) if v else math.nan


def _agreed_max(value: float) -> float:
    t = torch.tensor([value], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t.item())


def _loss(model: nn.Module, idx: torch.Tensor, tgt: torch.Tensor) -> torch.Tensor:
    logits = model(idx)
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), tgt.reshape(-1))


@dataclass
class _Job:
    """What every step of the benchmark shares: the arguments, this rank, the model and its batch."""

    args: argparse.Namespace
    rank: int
    world: int
    log: Callable[..., None]
    base: nn.Module
    idx: torch.Tensor
    tgt: torch.Tensor
    nbytes: int
    topo: Topology


def _setup(args) -> _Job:
    """The model (the same on every rank), this rank's batch and the topology; logs the header."""
    rank, world = dist.get_rank(), dist.get_world_size()
    log = print if rank == 0 else (lambda *a, **k: None)
    torch.manual_seed(0)
    base = TinyGPT(args.vocab, args.d_model, args.layers, seq=args.seq)
    g = torch.Generator().manual_seed(1 + rank)
    idx = torch.randint(0, args.vocab, (args.batch, args.seq), generator=g)
    tgt = torch.randint(0, args.vocab, (args.batch, args.seq), generator=g)
    nbytes = sum(p.numel() * p.element_size() for p in base.parameters())
    topo = Topology.detect() if os.environ.get("COMMOPT_NODES") else Topology.from_spec(f"{world}x1")
    log(f"# overlap benchmark: {world} ranks ({topo.layout}), TinyGPT {args.layers}x{args.d_model}, "
        f"{nbytes / 2**20:.1f} MiB of gradients, batch {args.batch}x{args.seq}, {args.optimizer}, "
        f"algorithm {args.algorithm}, link rate {os.environ.get('COMMOPT_LINK_RATE_BPS', 'loopback')}")
    return _Job(args, rank, world, log, base, idx, tgt, nbytes, topo)


def _fit_link(job: _Job) -> tuple[cost.LinkModel, cost.CostModel]:
    """(1) the link, fitted from all-reduces of a few sizes (comm.cost.fit), and the model of it."""
    args, topo = job.args, job.topo
    sizes = [1 << 18, 1 << 20, 1 << 22, 1 << 24]
    times = []
    for s in sizes:
        buf = torch.zeros(s // 4)
        all_reduce(buf, algorithm=args.algorithm, topology=topo)
        reps = []
        for _ in range(3):
            t0 = time.perf_counter()
            all_reduce(buf, algorithm=args.algorithm, topology=topo)
            reps.append(time.perf_counter() - t0)
        times.append(_agreed_max(_median(reps)))
    p = job.world
    link = cost.fit([float(s) for s in sizes], times, messages=2 * (p - 1), bytes_factor=2 * (p - 1) / p)
    job.log(f"# link fit: alpha {link.alpha * 1e6:.0f} us, {8 / link.beta / 1e6:.0f} Mbit/s")
    return link, cost.CostModel(cost.DEFAULT_INTRA, link, chunks=1)


class _Blocks:
    """(2) the kinds of timed block, each ``block(n) -> seconds per step`` of ``n`` steps started
    together on every rank: compute only (T_compute: forward + backward; the optimizer timed apart),
    the gradient reduction only (T_comm: DDP's 25 MiB buckets back to back), DDP default,
    OverlapDataParallel, compute beside a reducing thread, and the wrapper over a group of one rank."""

    def __init__(self, job: _Job):
        args, base, rank, nbytes = job.args, job.base, job.rank, job.nbytes
        self.job = job
        self.plain = copy.deepcopy(base)
        self.plain_opt = _optimizer(args.optimizer)(list(self.plain.parameters()))
        self.grads = [torch.zeros(max(1, min(nbytes, 25 << 20) // 4))
                      for _ in range(max(1, math.ceil(nbytes / (25 << 20))))]
        ddp_model = copy.deepcopy(base)
        self.ddp = DDP(ddp_model)
        self.ddp_opt = _optimizer(args.optimizer)(list(ddp_model.parameters()))
        self.odp = OverlapDataParallel(copy.deepcopy(base), _optimizer(args.optimizer), topology=job.topo,
                                       algorithm=args.algorithm, bucket_cap_mb=args.bucket_cap_mb,
                                       first_bucket_cap_mb=args.first_bucket_cap_mb, plan=args.plan,
                                       partition_mb=args.partition_mb, credit_mb=args.credit_mb, replan_every=10)
        # The same wrapper over a group of this rank alone: its compute (hooks, bucket copies, threads,
        # per-bucket optimizer steps) without any communication, the input of its prediction.
        solo = [dist.new_group([r]) for r in range(job.world)]
        self.odp_solo = OverlapDataParallel(copy.deepcopy(base), _optimizer(args.optimizer), process_group=solo[rank],
                                            algorithm=args.algorithm, bucket_cap_mb=args.bucket_cap_mb,
                                            first_bucket_cap_mb=args.first_bucket_cap_mb, plan=args.plan,
                                            partition_mb=self.odp.partition_bytes / 2**20,
                                            credit_mb=self.odp.credit_bytes / 2**20, replan_every=0)
        self.opt_t: list[float] = []  # the plain model's optimizer steps
        self.steady: list[float] = []  # OverlapDataParallel's steady-state step per block

    def all(self) -> dict[str, Callable[[int], float]]:
        return {"compute": self.compute, "comm": self.comm, "ddp": self.ddp_block, "overlap": self.overlap,
                "contended": self.contended, "wrapper": self.wrapper}

    def compute(self, n: int) -> float:
        job = self.job
        dist.barrier()
        total = 0.0
        for _ in range(n):
            t0 = time.perf_counter()
            _loss(self.plain, job.idx, job.tgt).backward()
            t1 = time.perf_counter()
            self.plain_opt.step()
            self.plain_opt.zero_grad(set_to_none=True)
            self.opt_t.append(time.perf_counter() - t1)
            total += t1 - t0
        return total / n

    def contended(self, n: int) -> float:
        """Compute only, while a thread reduces gradients back to back (the contention the simulator
        charges to compute that overlaps communication). The thread stops when every rank is done."""
        job, algorithm = self.job, self.job.args.algorithm
        done = torch.zeros(1)
        dist.barrier()

        def reduce_until_all_done() -> None:
            while True:
                for gbuf in self.grads:
                    all_reduce(gbuf, algorithm=algorithm, topology=job.topo)
                flag = done.clone()
                all_reduce(flag, algorithm="flat", topology=job.topo)
                if flag.item() >= job.world:
                    return

        thread = threading.Thread(target=reduce_until_all_done, name="contention")
        thread.start()
        total = 0.0
        try:
            for _ in range(n):
                t0 = time.perf_counter()
                _loss(self.plain, job.idx, job.tgt).backward()
                total += time.perf_counter() - t0
                self.plain.zero_grad(set_to_none=True)
        finally:
            done.fill_(1.0)
            thread.join()
        return total / n

    @staticmethod
    def _per_step(n: int, step: Callable[[], None], drain: Callable[[], None] = lambda: None) -> float:
        """Seconds per step of ``n`` steps started together on every rank, ``drain`` included."""
        dist.barrier()
        t0 = time.perf_counter()
        for _ in range(n):
            step()
        drain()
        return (time.perf_counter() - t0) / n

    def wrapper(self, n: int) -> float:
        job = self.job
        return self._per_step(n, lambda: _loss(self.odp_solo, job.idx, job.tgt).backward(), self.odp_solo.synchronize)

    def comm(self, n: int) -> float:
        def reduce_step() -> None:
            for gbuf in self.grads:
                all_reduce(gbuf, algorithm=self.job.args.algorithm, topology=self.job.topo)

        return self._per_step(n, reduce_step)

    def ddp_block(self, n: int) -> float:
        def ddp_step() -> None:
            _loss(self.ddp, self.job.idx, self.job.tgt).backward()
            self.ddp_opt.step()
            self.ddp_opt.zero_grad(set_to_none=True)

        return self._per_step(n, ddp_step)

    def overlap(self, n: int) -> float:
        job, odp = self.job, self.odp
        odp.synchronize()
        elapsed = self._per_step(n, lambda: _loss(odp, job.idx, job.tgt).backward(), odp.synchronize)
        # The steady-state step: forward end to forward end inside the block. The block's average
        # also holds a pipeline fill and a drain (synchronize() at both ends: nothing overlaps the
        # first forward or the last step's reduction), which a training loop pays once, not every
        # n steps; DDP has nothing to fill or drain (each of its steps ends with its reduction).
        ends = [prof.forward_end for _, prof in list(odp.profiles)[-n:]]
        self.steady.append(_median([b - a for a, b in zip(ends, ends[1:])]) if n > 1 else elapsed)
        return elapsed


def _measure(job: _Job, blocks: _Blocks) -> dict[str, list[float]]:
    """(3) a warm-up of every block, then the blocks interleaved round by round (the order rotates,
    because the machine is shared); per round and block the slowest rank's time."""
    args = job.args
    kinds = blocks.all()
    bar = progress(1 + args.rounds, "warm-up, then rounds", rank=job.rank, unit="round")
    for fn in kinds.values():
        fn(args.warmup)
    bar.update()
    blocks.opt_t.clear()
    blocks.steady.clear()
    res: dict[str, list[float]] = {k: [] for k in kinds}
    names = list(kinds)
    for r in range(args.rounds):
        for k in names[r % len(names):] + names[: r % len(names)]:
            res[k].append(_agreed_max(kinds[k](args.steps)))
        bar.update()
    bar.close()
    res["overlap-steady"] = [_agreed_max(x) for x in blocks.steady]
    return res


def _write_trace(path: str, odp: OverlapDataParallel) -> None:
    """Rank 0's per-step issue/ready/done times of OverlapDataParallel (``--trace``)."""
    with open(path, "w") as f:
        plans = dict(odp.plans)
        json.dump([{"step": i, "forward_end": p.forward_end, "ready": p.ready, "issued": p.issued, "done": p.done,
                    "nbytes": p.nbytes, "bucket": [c.bucket for c in plans[i].chunks]}
                   for i, p in odp.profiles], f)


@dataclass
class _Summary:
    """The medians of the rounds, and the ratios taken round by round (the blocks of a round ran
    minutes apart at most, on a machine whose speed drifts), then their median."""

    t_compute: float
    t_comm: float
    slowdown: float
    t_opt: float
    m_ddp: float
    m_block: float
    m_odp: float
    per_round_bound: list[float]
    per_round_speedup: list[float]


def _summarise(res: dict[str, list[float]], opt_t: list[float]) -> _Summary:
    t_compute, t_comm = _median(res["compute"]), _median(res["comm"])
    slowdown = max(1.0, _median([c / x for c, x in zip(res["contended"], res["compute"])]))
    return _Summary(
        t_compute=t_compute, t_comm=t_comm, slowdown=slowdown, t_opt=_agreed_max(_median(opt_t)),
        m_ddp=_median(res["ddp"]), m_block=_median(res["overlap"]), m_odp=_median(res["overlap-steady"]),
        per_round_bound=[o / max(c, m) for o, c, m in zip(res["overlap-steady"], res["compute"], res["comm"])],
        per_round_speedup=[d / o for d, o in zip(res["ddp"], res["overlap-steady"])])


@dataclass
class _Prediction:
    """The simulator's step times and what they were computed from."""

    layers: list[Layer]
    scale: float
    t_wrapper: float
    wrap: float
    ddp: float
    overlap: float
    none: float


def _predict(job: _Job, res: dict[str, list[float]], sm: _Summary, model: cost.CostModel, partition_mb: float,
             credit_mb: float) -> _Prediction:
    """(4) the simulator's predictions from measured layers and the fitted link."""
    args, tgt = job.args, job.tgt
    measured = layers_from_model(copy.deepcopy(job.base), job.idx, repeats=5,
                                 loss=lambda y: F.cross_entropy(y.reshape(-1, y.shape[-1]), tgt.reshape(-1)))
    # The per-layer profile is taken once, at one moment of a shared machine: keep its shape, scale
    # it to this run's interleaved T_compute.
    scale = sm.t_compute / max(1e-9, sum(x.forward + x.backward for x in measured))
    layers = [Layer(x.name, x.forward * scale, x.backward * scale, x.grad_bytes) for x in measured]
    # OverlapDataParallel's prediction starts from its own compute without communication (the
    # optimizer, which the simulator steps in the next forward, taken out).
    t_wrapper = _median(res["wrapper"])
    wrap = max(1e-9, _median([(w - sm.t_opt) / x for w, x in zip(res["wrapper"], res["compute"])]))
    odp_layers = [Layer(x.name, x.forward * wrap, x.backward * wrap, x.grad_bytes) for x in layers]
    opt_per_byte = sm.t_opt / max(1, job.nbytes)

    def service(n: int) -> float:
        return cost.predict(args.algorithm if args.algorithm != "auto" else "flat", n, job.topo, model) if n else 0.0

    pred_ddp = simulate(layers, service, Schedule("ddp", bucket_cap_mb=25, first_bucket_cap_mb=1,
                                                  optimizer_seconds_per_byte=opt_per_byte,
                                                  overlap_slowdown=sm.slowdown))
    pred_odp = simulate(odp_layers, service, Schedule(args.plan, bucket_cap_mb=args.bucket_cap_mb,
                                                      first_bucket_cap_mb=args.first_bucket_cap_mb,
                                                      partition_mb=partition_mb, credit_mb=credit_mb,
                                                      optimizer_seconds_per_byte=opt_per_byte,
                                                      overlap_slowdown=sm.slowdown))
    pred_none = simulate(layers, service, Schedule("none", optimizer_seconds_per_byte=opt_per_byte))
    return _Prediction(layers, scale, t_wrapper, wrap, pred_ddp.iteration, pred_odp.iteration, pred_none.iteration)


def _report(job: _Job, res: dict[str, list[float]], sm: _Summary, pred: _Prediction, stats) -> None:
    """The table of measured against predicted step times, and the figures behind it (rank 0)."""
    args, log = job.args, job.log
    bound = max(sm.t_compute, sm.t_comm)
    rows = [("DDP default", sm.m_ddp, pred.ddp), (f"OverlapDataParallel ({args.plan})", sm.m_odp, pred.overlap),
            (f"  same, per block of {args.steps} steps", sm.m_block, math.nan),
            ("no overlap (predicted only)", math.nan, pred.none)]
    log(f"{'schedule':<34}{'measured ms':>12}{'predicted ms':>14}{'pred/meas':>11}")

    def cell(value: float, width: int, digits: int) -> str:
        return f"{value:>{width}.{digits}f}" if value == value else f"{'-':>{width}}"  # nan: not measured / predicted

    for name, meas, pr in rows:
        log(f"{name:<34}{cell(meas * 1e3, 12, 1)}{cell(pr * 1e3, 14, 1)}{cell(pr / meas, 11, 3)}")
    for k, v in res.items():
        log(f"# per-round {k} ms: {[round(t * 1e3, 1) for t in v]}")
    log(f"# T_compute {sm.t_compute * 1e3:.1f} ms, T_comm {sm.t_comm * 1e3:.1f} ms (ratio "
        f"{sm.t_comm / sm.t_compute:.2f}), optimizer {sm.t_opt * 1e3:.1f} ms; layer profile scaled by "
        f"{pred.scale:.2f}; plan {stats}")
    log(f"# compute during a concurrent reduction: {_median(res['contended']) * 1e3:.1f} ms, slowdown "
        f"{sm.slowdown:.2f}x (median of rounds; the simulator's overlap_slowdown for the overlapped schedules)")
    log(f"# OverlapDataParallel without communication (a group of one rank): {pred.t_wrapper * 1e3:.1f} ms per step "
        f"with its optimizer steps, {pred.wrap:.2f}x T_compute without them (median of rounds; its prediction's "
        f"compute)")
    log(f"# OverlapDataParallel's step: the steady state, forward end to forward end within a block; the block "
        f"average ({sm.m_block * 1e3:.1f} ms) adds a pipeline fill and drain every {args.steps} steps (synchronize())")
    log(f"# overlap / max(T_compute, T_comm) = {sm.m_odp / bound:.3f} of the medians, "
        f"{_median(sm.per_round_bound):.3f} median of rounds (target <= 1.15; per round "
        f"{[round(x, 3) for x in sm.per_round_bound]})")
    log(f"# DDP / overlap = {sm.m_ddp / sm.m_odp:.3f} of the medians, {_median(sm.per_round_speedup):.3f} median of "
        f"rounds (target >= 1.15; per round {[round(x, 3) for x in sm.per_round_speedup]})")
    log(f"# prediction error: DDP {pred.ddp / sm.m_ddp - 1:+.1%}, overlap {pred.overlap / sm.m_odp - 1:+.1%}")


def _write_json(path: str, args, res: dict[str, list[float]], sm: _Summary, pred: _Prediction,
                link: cost.LinkModel) -> None:
    with open(path, "w") as f:
        json.dump({"t_compute": sm.t_compute, "t_comm": sm.t_comm, "t_opt": sm.t_opt, "slowdown": sm.slowdown,
                   "wrapper": pred.t_wrapper, "rounds": res,
                   "overlap_steady": sm.m_odp, "overlap_block": sm.m_block,
                   "layers": [[x.name, x.forward, x.backward, x.grad_bytes] for x in pred.layers],
                   "pred_ddp": pred.ddp, "pred_overlap": pred.overlap,
                   "pred_none": pred.none, "link": [link.alpha, link.beta], "args": vars(args)}, f,
                  indent=1)


def _run(args) -> int:
    """One rank of the benchmark: set up, fit the link, time the blocks interleaved, predict, report."""
    if args.switch_interval:
        sys.setswitchinterval(args.switch_interval)
    job = _setup(args)
    link, model = _fit_link(job)
    blocks = _Blocks(job)
    res = _measure(job, blocks)
    odp = blocks.odp
    stats = odp.stats()
    if job.rank == 0 and args.trace:
        _write_trace(args.trace, odp)
    odp.close()
    blocks.odp_solo.close()
    sm = _summarise(res, blocks.opt_t)
    pred = _predict(job, res, sm, model, odp.partition_bytes / 2**20, odp.credit_bytes / 2**20)
    _report(job, res, sm, pred, stats)
    if job.rank == 0 and args.json:
        _write_json(args.json, args, res, sm, pred, link)
    return 0


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    spawn, args.spawn = args.spawn, 0
    return launch(_run, args, spawn=spawn, timeout=args.timeout, single=False)
