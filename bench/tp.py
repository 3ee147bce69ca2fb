"""``commopt-bench tp``: a transformer block under tensor + sequence parallelism, forward + backward,
torch's plan against the same plan with commopt's styles, and ring attention (rotating, and with
``keep_kv=True``) and Ulysses attention against all-gathered attention, measured interleaved in one run
(docs/guide.md, "Tensor parallelism").

The TP group is the whole world. Printed per variant: its step (the slowest rank's forward +
backward, median over the iterations), the compute alone (the same rank-local shapes with no
communication), the communication alone (the variant's collectives with nothing to overlap), the
step against max(compute, communication) -- 1.00 is perfect overlap -- the exposed
communication (step minus compute), and for the block's two plans the step
``schedules.simulator.simulate_tensor_parallel`` predicts (torch's plan unfused, commopt's styles
decomposed) with its FLOP rate and link fitted to this run's compute alone and communication alone,
so that ``sim/meas`` checks the model's overlap and nothing else. Where the communication is
link-bound it has something to hide behind; the setting that shows the most is two nodes of one rank
each in the emulated cluster, with the link rate chosen so that communication alone is about equal
to compute alone (1 Gbit/s for the default block on the development machine, docs/results.md 22)::

    commopt-bench cluster --nodes 2 --ranks-per-node 1 --link-rate 1gbit -- commopt-bench tp

or ``--spawn 2`` on loopback (CPU-bound there: both "links" are the same two cores).
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import sys
import time
from typing import Callable

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from commopt.comm.algorithms._transport import all_gather_single, reduce_scatter_single
from commopt.schedules.tensor_parallel import choices, chunks_for

from ._launch import launch
from ._memory import PeakMemory, peak_kind
from ._progress import progress

__all__ = ["main", "Block", "plan"]


class Block(nn.Module):
    """A pre-norm transformer block: LayerNorm, fused QKV (laid out head by head, so a column
    shard holds whole heads), attention, output projection, LayerNorm, a GELU MLP; residuals.

    ``heads`` and ``ffn`` are this module's own: a TP-sharded block runs ``heads / P`` heads and
    ``ffn / P`` hidden units per rank, which is what the compute-alone model is built with.
    """

    def __init__(self, d_model: int, heads: int, head_dim: int, ffn: int, *, seed: int = 0) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.head_dim = head_dim
        self.norm1 = nn.LayerNorm(d_model)
        self.qkv = nn.Linear(d_model, 3 * heads * head_dim)
        self.out = nn.Linear(heads * head_dim, d_model)
        self.norm2 = nn.LayerNorm(d_model)
        self.fc1 = nn.Linear(d_model, ffn)
        self.fc2 = nn.Linear(ffn, d_model)

    def attend(self, h: torch.Tensor) -> torch.Tensor:
        b, s, _ = h.shape
        q, k, v = self.qkv(h).view(b, s, -1, 3, self.head_dim).permute(3, 0, 2, 1, 4)  # [3, B, H, S, hd]
        return self.out(F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(b, s, -1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attend(self.norm1(x))
        return x + self.fc2(F.gelu(self.fc1(self.norm2(x))))


def plan(colwise: type, rowwise: type, sequence: type) -> dict:
    """The sequence-parallel plan of :class:`Block` with these style classes (torch's or commopt's):
    norms sequence-parallel, the activations all-gathered into QKV and FC1 (their input arrives
    sharded on the sequence), reduce-scattered out of OUT and FC2."""
    from torch.distributed.tensor import Shard

    return {"norm1": sequence(), "qkv": colwise(input_layouts=Shard(1)), "out": rowwise(output_layouts=Shard(1)),
            "norm2": sequence(), "fc1": colwise(input_layouts=Shard(1)), "fc2": rowwise(output_layouts=Shard(1))}


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="commopt-bench tp", description=__doc__.split("\n\n")[0])
    p.add_argument("--spawn", type=int, default=0, metavar="N", help="spawn N local ranks")
    p.add_argument("--d-model", type=int, default=512)
    p.add_argument("--heads", type=int, default=8, help="attention heads (divisible by the TP size)")
    p.add_argument("--ffn", type=int, default=2048, help="MLP hidden units (divisible by the TP size)")
    p.add_argument("--seq-len", type=int, default=1024, help="the whole sequence (divisible by the TP size)")
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--causal", action="store_true", help="causal attention in the attention comparison")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--iters", type=int, default=7)
    p.add_argument("--quick", action="store_true", help="tiny shapes, two iterations (smoke test)")
    p.add_argument("--json", default=None, help="write the results as JSON to this file (rank 0)")
    p.add_argument("--timeout", type=float, default=300.0)
    return p


def _timed(fn: Callable[[], object]) -> float:
    """Seconds of ``fn`` on the slowest rank, every rank starting together."""
    dist.barrier()
    start = time.perf_counter()
    fn()
    t = torch.tensor([time.perf_counter() - start], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t)


def _block_cases(args, rank: int, world: int) -> tuple[dict[str, tuple[Callable[[], object], str]], dict]:
    """name -> (one forward + backward, its group: "block"), the compute- and communication-alone
    references included; and what each Linear of the default styles chose (``choices``)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, SequenceParallel, parallelize_module

    from commopt.schedules import tensor_parallel as tp

    d, h, f, s, b = args.d_model, args.heads, args.ffn, args.seq_len, args.batch
    hd = d // h
    mesh = init_device_mesh("cpu", (world,))
    ring = (functools.partial(tp.ColwiseParallel, algorithm="ring"),
            functools.partial(tp.RowwiseParallel, algorithm="ring"), tp.SequenceParallel)
    models = {"torch plan": parallelize_module(Block(d, h, hd, f), mesh, plan(ColwiseParallel, RowwiseParallel,
                                                                             SequenceParallel)),
              # algorithm="auto" (the default): each Linear's ring only where it predicts faster
              "commopt styles": parallelize_module(Block(d, h, hd, f), mesh, plan(tp.ColwiseParallel,
                                                                                 tp.RowwiseParallel,
                                                                                 tp.SequenceParallel)),
              "commopt ring": parallelize_module(Block(d, h, hd, f), mesh, plan(*ring))}
    local = Block(d, h // world, hd, f // world)  # this rank's compute, no communication
    gen = torch.Generator().manual_seed(rank)
    x_shard = torch.randn(b, s // world, d, generator=gen)
    ref, *got = (m(x_shard) for m in models.values())  # the same block: the styles must agree with torch's
    for out in got:
        torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-4,
                                   msg=lambda m: f"commopt's styles differ from torch's: {m}")
    chosen = choices(models["commopt styles"])  # what each Linear of the default styles runs
    x_full = torch.randn(b, s, d, generator=gen)
    full, shard = torch.empty(b * s * d), torch.empty(b * s * d // world)

    def step(model: nn.Module, x: torch.Tensor) -> Callable[[], object]:
        return lambda: model(x.detach().requires_grad_()).square().mean().backward()

    def comm() -> None:  # 2 all-gathers and 2 reduce-scatters of the activations, forward and backward
        for _ in range(4):
            all_gather_single(full, shard)
            reduce_scatter_single(shard, full)

    cases = {name: (step(m, x_shard), "block") for name, m in models.items()}
    cases["compute alone"] = (step(local, x_full), "block")
    cases["communication alone"] = (comm, "block")
    return cases, chosen


def _attention_cases(args, rank: int, world: int) -> dict[str, tuple[Callable[[], object], str]]:
    """Attention over the whole sequence from this rank's block of it: gathered (K and V
    all-gathered, their gradients reduce-scattered), ring and Ulysses."""
    from commopt.schedules import context_parallel as cp

    d, h, s, b = args.d_model, args.heads, args.seq_len, args.batch
    hd = d // h
    gen = torch.Generator().manual_seed(100 + rank)
    q, k, v = (torch.randn(b, h, s // world, hd, generator=gen) for _ in range(3))
    kv_full = torch.randn(b, h, s, hd, generator=gen)
    causal = args.causal

    def run(fn: Callable[..., torch.Tensor], *tensors: torch.Tensor) -> Callable[[], object]:
        def go() -> None:
            leaves = [t.detach().requires_grad_() for t in tensors]
            fn(*leaves).square().mean().backward()
        return go

    def gathered(q_, k_, v_):
        return _local_attention(q_, _Gather.apply(k_), _Gather.apply(v_), causal, rank, s // world)

    kv_full_buf, kv_shard = torch.empty(2 * k.numel() * world), torch.empty(2 * k.numel())

    def comm() -> None:  # K and V gathered forward, their gradients reduce-scattered backward
        all_gather_single(kv_full_buf, kv_shard)
        reduce_scatter_single(kv_shard, kv_full_buf)

    variants = {"ring attention": functools.partial(cp.ring_attention, is_causal=causal),
                "ring attention keep_kv": functools.partial(cp.ring_attention, is_causal=causal, keep_kv=True)}
    if h % world == 0:
        variants["ulysses attention"] = functools.partial(cp.ulysses_attention, is_causal=causal)
    ref = gathered(q, k, v)  # every variant computes the same attention: checked once, before timing
    for name, fn in variants.items():
        torch.testing.assert_close(fn(q, k, v), ref, rtol=1e-4, atol=1e-4,
                                   msg=lambda m, n=name: f"{n} differs from all-gathered attention: {m}")
    cases = {"attention gathered": (run(gathered, q, k, v), "attention")}
    cases.update({name: (run(fn, q, k, v), "attention") for name, fn in variants.items()})
    cases["attention compute alone"] = (
        run(lambda q_, k_, v_: _local_attention(q_, k_, v_, causal, rank, s // world), q, kv_full, kv_full),
        "attention")
    cases["attention communication alone"] = (comm, "attention")
    return cases


class _Gather(torch.autograd.Function):
    """All-gather along the sequence (dim 2) forward, reduce-scatter of the gradient backward: the
    unfused composition attention runs without context parallelism."""

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        world = dist.get_world_size()
        out = x.new_empty((world * x.shape[0], *x.shape[1:]))
        all_gather_single(out, x.contiguous())
        return torch.cat(out.view(world, *x.shape).unbind(0), dim=2)

    @staticmethod
    def backward(ctx, g: torch.Tensor) -> torch.Tensor:
        world = dist.get_world_size()
        parts = torch.cat(g.chunk(world, dim=2), dim=0).contiguous()
        out = g.new_empty((parts.shape[0] // world, *parts.shape[1:]))
        reduce_scatter_single(out, parts)
        return out


def _local_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, rank: int,
                     block: int) -> torch.Tensor:
    """This rank's block of queries against the whole sequence's keys (the global causal mask)."""
    if not causal:
        return F.scaled_dot_product_attention(q, k, v)
    rows = torch.arange(rank * block, (rank + 1) * block).unsqueeze(1)
    mask = rows >= torch.arange(k.shape[-2]).unsqueeze(0)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


def _body(args) -> int:
    rank, world = dist.get_rank(), dist.get_world_size()
    for what, n in (("--heads", args.heads), ("--ffn", args.ffn), ("--seq-len", args.seq_len)):
        if n % world:
            if rank == 0:
                print(f"commopt-bench tp: {what} {n} does not divide by the TP size {world}", file=sys.stderr)
            return 2
    block, chosen = _block_cases(args, rank, world)
    cases = {**block, **_attention_cases(args, rank, world)}
    names = list(cases)
    times: dict[str, list[float]] = {n: [] for n in names}
    memory = PeakMemory("cpu")
    bar = progress(args.warmup + args.iters, f"{len(names)} cases", rank=rank, unit="round")
    for it in range(args.warmup + args.iters):
        for name in names[it % len(names):] + names[: it % len(names)]:  # interleaved and rotated
            memory.start()
            t = _timed(cases[name][0])
            memory.stop(name)
            if it >= args.warmup:
                times[name].append(t)
        bar.update()
    bar.close()
    # The chunks the styles cut the block's activations into (collective: every rank asks).
    chunks = chunks_for(args.seq_len * args.batch * args.d_model * 4 // world, args.seq_len * args.batch // world,
                        None, torch.device("cpu"))
    if rank == 0:
        _report(args, world, {n: statistics.median(v) for n, v in times.items()},
                {n: c[1] for n, c in cases.items()}, chunks, memory, chosen)
    return 0


def _simulated(args, world: int, compute: float, comm: float, chunks: int) -> dict[str, float]:
    """``simulate_tensor_parallel``'s step for the block's two plans (torch's: unfused; commopt's
    styles: decomposed, in the ``chunks`` per block they cut), with its FLOP rate and link fitted to
    this run's compute alone and communication alone: what is left to the model is how the plan
    overlaps them."""
    from commopt.comm.links import LinkModel
    from commopt.schedules.simulator import TransformerConfig, simulate_tensor_parallel
    if world < 2 or compute <= 0 or comm <= 0:
        return {}
    cfg = TransformerConfig(1, args.d_model, seq=args.seq_len)
    tokens = args.seq_len * args.batch
    act = tokens * args.d_model * 4  # fp32 activations
    unit = simulate_tensor_parallel(cfg, tp=world, tokens=tokens, flops=1.0, link=LinkModel(0.0, 0.0),
                                    decomposed=False, activation_bytes=4, ffn=args.ffn)
    link = LinkModel(0.0, comm / (8 * (world - 1) * act / world))

    def step(decomposed: bool) -> float:
        return simulate_tensor_parallel(cfg, tp=world, tokens=tokens, flops=unit.compute / compute, link=link,
                                        decomposed=decomposed, activation_bytes=4, ffn=args.ffn,
                                        chunks=chunks).step

    return {"torch plan": step(False), "commopt ring": step(True)}


def _report(args, world: int, med: dict[str, float], groups: dict[str, str], chunks: int, memory: PeakMemory,
            chosen: dict) -> None:
    rows = []
    print(f"# commopt-bench tp: block d={args.d_model} heads={args.heads} ffn={args.ffn} seq={args.seq_len} "
          f"batch={args.batch}, TP {world} (forward + backward, the slowest rank, median of {args.iters}, "
          f"interleaved; peak memory: rank 0's {peak_kind('cpu')} during the step)")
    ran = {name: "/".join(sorted(set(c.values()))) or "shared gather" for name, c in chosen.items()}
    print("# commopt styles (algorithm='auto') ran: " + ", ".join(f"{n} {r}" for n, r in ran.items()))
    print(f"{'variant':<24}{'step ms':>10}{'compute ms':>12}{'comm ms':>10}{'step/max':>10}{'exposed ms':>12}"
          f"{'vs first':>10}{'sim ms':>9}{'sim/meas':>9}{'peak MiB':>10}")
    sim = _simulated(args, world, med["compute alone"], med["communication alone"], chunks)
    paths = {p for c in chosen.values() for p in c.values()}
    if sim and paths in ({"ring"}, {"torch"}):  # the default styles ran one path everywhere: its model
        sim["commopt styles"] = sim["commopt ring" if paths == {"ring"} else "torch plan"]
    for group, compute, comm in (("block", "compute alone", "communication alone"),
                                 ("attention", "attention compute alone", "attention communication alone")):
        variants = [n for n, g in groups.items() if g == group and n not in (compute, comm)]
        first = med[variants[0]]
        for name in variants:
            step, c, m = med[name], med[compute], med[comm]
            row = {"variant": name, "group": group, "step_s": step, "compute_s": c, "comm_s": m,
                   "step_over_max": step / max(c, m), "exposed_s": max(step - c, 0.0), "speedup": first / step,
                   "sim_s": sim.get(name), "peak_memory_bytes": memory.peak(name)}
            rows.append(row)
            predicted = (f"{row['sim_s'] * 1e3:>9.1f}{row['sim_s'] / step:>9.2f}" if row["sim_s"] is not None
                         else f"{'-':>9}{'-':>9}")
            print(f"{name:<24}{step * 1e3:>10.1f}{c * 1e3:>12.1f}{m * 1e3:>10.1f}{row['step_over_max']:>10.2f}"
                  f"{row['exposed_s'] * 1e3:>12.1f}{row['speedup']:>9.2f}x" + predicted + f"{memory.mib(name):>10.1f}")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"kind": "tp", "world": world, "args": {k: v for k, v in vars(args).items()
                                                              if isinstance(v, (int, float, str, bool))},
                       "memory": peak_kind("cpu"), "choices": ran, "results": rows}, fh, indent=1)


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.quick:
        args.d_model, args.heads, args.ffn, args.seq_len, args.batch = 32, 4, 64, 16, 1
        args.warmup, args.iters = 1, 2
    if args.d_model % args.heads:
        print(f"commopt-bench tp: --d-model {args.d_model} does not divide by --heads {args.heads}", file=sys.stderr)
        return 2
    return launch(_body, args, spawn=args.spawn, timeout=args.timeout, single=False)
