"""``commopt-bench collectives``: one nccl-tests-style harness for every collective and algorithm.

For each size, every requested algorithm is measured interleaved (iteration by iteration), so
that the ratios printed side by side share the same machine state. Columns follow nccl-tests:
``size count type redop algo time(us) algbw(GB/s) busbw(GB/s) #wrong`` (time: the median over the
iterations, of the slowest rank), then the alpha-beta bound of ``commopt.comm.cost`` where the
topology has several nodes, and, where an inter-node link exists (the emulated cluster, a real
multi-node job; not a logical ``--topology`` on one machine), link-level figures: the bytes one
node's link must carry, link busbw (those bytes / time) and the efficiency against the configured
and the measured link rate. Columns that do not apply to a run are left out. The correctness check
(on by default) compares every element with a value computed from rank arithmetic. ``--json`` keeps
the rows, ``--plot`` draws them (``commopt.bench.plot``).

Launch: under ``mpirun -n N`` (rank and size from MPI; rendezvous through a FileStore whose path
rank 0 broadcasts with mpi4py), under ``torchrun`` or ``commopt-bench cluster`` (env://), or with
``--spawn N`` local ranks (FileStore in a temporary directory; gloo bound to loopback).
"""

from __future__ import annotations

import argparse
import importlib
import json
import math
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist
from torch.distributed import ReduceOp

from commopt.comm import algorithms
from commopt.comm.algorithms._transport import all_gather_single, reduce_scatter_single

from ._launch import launch, topology_of
from ._progress import progress

__all__ = ["main", "parse_sizes", "run_sweep", "algorithm_names"]

_DTYPES = {"float32": torch.float32, "float64": torch.float64, "float16": torch.float16,
           "bfloat16": torch.bfloat16, "int32": torch.int32, "int64": torch.int64}
_REDOPS = {"sum": ReduceOp.SUM, "avg": ReduceOp.AVG, "max": ReduceOp.MAX, "min": ReduceOp.MIN}
_OPS = ("allreduce", "reduce_scatter", "all_gather", "alltoall")
_UNITS = {"": 1, "B": 1, "K": 1 << 10, "KB": 1 << 10, "M": 1 << 20, "MB": 1 << 20, "G": 1 << 30, "GB": 1 << 30}


def parse_sizes(text: str) -> list[int]:
    """``"1K,64K"`` -> [1024, 65536]; ``"1K:16M"`` -> powers of two from 1 KiB to 16 MiB."""

    def one(s: str) -> int:
        s = s.strip().upper()
        digits = s.rstrip("KMGB")
        unit = s[len(digits):]
        if not digits or unit not in _UNITS:
            raise argparse.ArgumentTypeError(f"bad size {s!r}: use e.g. 1K, 64K, 16M")
        return int(float(digits) * _UNITS[unit])

    sizes: list[int] = []
    for part in text.split(","):
        if ":" in part:
            lo, hi = (one(p) for p in part.split(":"))
            s = lo
            while s <= hi:
                sizes.append(s)
                s *= 2
        else:
            sizes.append(one(part))
    return sizes


def _fmt_size(n: int) -> str:
    for unit, div in (("G", 1 << 30), ("M", 1 << 20), ("K", 1 << 10)):
        if n >= div and n % div == 0:
            return f"{n // div}{unit}"
    return str(n)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="commopt-bench collectives", description=__doc__.split("\n\n")[0])
    p.add_argument("--op", default="allreduce", help=f"comma list of {', '.join(_OPS)}")
    per_op = "; ".join(f"{', '.join(algorithms.names(op) + [algorithms.AUTO])} ({op})" for op in _OPS)
    p.add_argument("--algo", default="flat,hierarchical", help=f"comma list of registered algorithms: {per_op}; "
                   "torch: plain torch.distributed, without commopt's agreement check (its cost); MODULE:NAME: "
                   "algorithm NAME, registered by importing MODULE on every rank (an algorithm of your own)")
    p.add_argument("--sizes", default="1K:16M", type=parse_sizes,
                   help="bytes per rank: '1K,64K' or a doubling range '1K:16M' (alltoall: bytes per peer)")
    p.add_argument("--dtype", default="float32", choices=list(_DTYPES))
    p.add_argument("--redop", default="sum", choices=list(_REDOPS))
    p.add_argument("--iters", type=int, default=0, help="timed iterations per size and algorithm "
                   "(0: enough for about 1 s, between 9 and 200)")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--no-check", dest="check", action="store_false", help="skip the correctness check")
    p.add_argument("--topology", default=None, help="impose logical nodes, e.g. 2x2 (default: detect)")
    p.add_argument("--spawn", type=int, default=0, metavar="N", help="spawn N local ranks")
    p.add_argument("--json", default=None, metavar="PATH", help="write the rows and metadata as JSON")
    p.add_argument("--plot", default=None, metavar="PNG", help="draw busbw against size per algorithm, with "
                   "the cost model's bound, as a PNG (matplotlib: pip install commopt[plot]); "
                   "`commopt-bench plot RESULTS.json` draws it later")
    p.add_argument("--validate", action="store_true", help="collectives with validate=True")
    p.add_argument("--compare-validate", action="store_true",
                   help="measure each algorithm with and without validate=True, interleaved")
    p.add_argument("--no-calibrate", dest="calibrate", action="store_false",
                   help="skip measuring the two link levels first (auto then uses the cached or default model)")
    # Fault injection for the test of docs/faults.md row 31 (a failing rank must end the whole job).
    p.add_argument("--fail-rank", type=int, default=None, help=argparse.SUPPRESS)
    p.add_argument("--timeout", type=float, default=120.0, help="seconds before a collective is declared hung")
    return p


# ------------------------------------------------------------------------------------ launching
def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    spawn, args.spawn = args.spawn, 0
    return launch(_rank_body, args, spawn=spawn, timeout=args.timeout)


# ------------------------------------------------------------------------------------ measuring
def _expected(op: str, redop: str, world: int, rank: int, count: int, dtype) -> torch.Tensor:
    """What every element must be, from rank arithmetic: rank r contributes (r + 1) + (i % 7)."""
    base = torch.arange(count, dtype=torch.float64) % 7
    contrib = [(r + 1) + base for r in range(world)]
    if op == "allreduce":
        stack = torch.stack(contrib)
        ref = {"sum": stack.sum(0), "avg": stack.mean(0), "max": stack.amax(0), "min": stack.amin(0)}[redop]
    elif op == "reduce_scatter":
        stack = torch.stack([(r + 1) + torch.arange(world * count, dtype=torch.float64) % 7 for r in range(world)])
        red = {"sum": stack.sum(0), "avg": stack.mean(0), "max": stack.amax(0), "min": stack.amin(0)}[redop]
        ref = red[rank * count:(rank + 1) * count]
    elif op == "all_gather":
        ref = torch.cat(contrib)
    else:  # alltoall: block from peer p is p's block for this rank
        ref = torch.cat([(p + 1) + (torch.arange(count, dtype=torch.float64) % 7) + 10 * rank for p in range(world)])
    return ref.to(dtype)


def _make_call(op: str, algo: str, count: int, dtype, redop, topo, validate: bool, timeout: float):
    """Buffers and a closure running one collective; ``check()`` counts wrong elements."""
    from commopt.comm import all_gather, all_reduce, reduce_scatter

    rank, world = dist.get_rank(), dist.get_world_size()
    base = torch.arange(count, dtype=torch.float64) % 7
    if op == "allreduce":
        src = ((rank + 1) + base).to(dtype)
        buf = src.clone()

        def call():
            buf.copy_(src)
            if algo == "torch":
                dist.all_reduce(buf, redop)
            else:
                all_reduce(buf, redop, topology=topo, algorithm=algo, validate=validate, timeout=timeout)

        out = buf
    elif op == "reduce_scatter":
        src = ((rank + 1) + torch.arange(world * count, dtype=torch.float64) % 7).to(dtype)
        out = torch.empty(count, dtype=dtype)

        def call():
            if algo == "torch":
                reduce_scatter_single(out, src, redop)
            else:
                reduce_scatter(out, src, redop, topology=topo, algorithm=algo, validate=validate, timeout=timeout)
    elif op == "all_gather":
        src = ((rank + 1) + base).to(dtype)
        out = torch.empty(world * count, dtype=dtype)

        def call():
            if algo == "torch":
                all_gather_single(out, src)
            else:
                all_gather(out, src, topology=topo, algorithm=algo, validate=validate, timeout=timeout)
    else:
        from commopt.comm.alltoall import all_to_all

        src = torch.cat([((rank + 1) + base + 10 * p) for p in range(world)]).to(dtype)
        out = torch.empty(world * count, dtype=dtype)

        def call():
            if algo == "torch":
                dist.all_to_all_single(out, src)
            else:
                all_to_all(out, src, topology=topo, algorithm=algo, validate=validate)

    def check(expected: torch.Tensor) -> int:
        if dtype.is_floating_point:
            tol = 1e-2 if dtype in (torch.float16, torch.bfloat16) else 1e-5
            return int((~torch.isclose(out.to(torch.float64), expected.to(torch.float64), rtol=tol)).sum())
        return int((out != expected).sum())

    return call, check


def _agree_iters(seconds: float, requested: int) -> int:
    if requested:
        return requested
    t = torch.tensor([seconds], dtype=torch.float64)
    dist.all_reduce(t, op=ReduceOp.MAX)  # every rank must run the same number of iterations
    return int(min(200, max(9, math.ceil(1.0 / max(float(t), 1e-6)))))


def algorithm_names(text: str) -> list[str]:
    """The ``--algo`` list as algorithm names; ``MODULE:NAME`` imports MODULE first (on this rank),
    whose import registers NAME with ``commopt.comm.algorithms.register``."""
    out = []
    for item in (a.strip() for a in text.split(",")):
        module, sep, name = item.rpartition(":")
        if sep:
            try:
                importlib.import_module(module)
            except ImportError as exc:
                raise SystemExit(f"--algo {item}: cannot import {module!r} ({exc}); put it on PYTHONPATH "
                                 f"or install it") from exc
            if name not in algorithms.ALGORITHMS:
                raise SystemExit(f"--algo {item}: importing {module!r} registered no algorithm {name!r}; "
                                 f"registered: {sorted(algorithms.ALGORITHMS)}")
        out.append(name)
    return out


def run_sweep(args, topo, log=print) -> list[dict]:
    """Measure every (op, size, algorithm) and return one row per combination."""
    from commopt.comm import context, cost
    from commopt.comm.collectives import select_algorithm

    rank, world = dist.get_rank(), dist.get_world_size()
    dtype = _DTYPES[args.dtype]
    redop = _REDOPS[args.redop]
    esize = torch.empty((), dtype=dtype).element_size()
    ops = [o.strip() for o in args.op.split(",")]
    algos = algorithm_names(args.algo)
    variants = [(a, v) for a in algos for v in ((False, True) if args.compare_validate else (args.validate,))]
    model = cost.model_for(topo) if world > 1 else None
    rows: list[dict] = []
    bar = progress(len(ops) * len(args.sizes), "sweep", rank=rank, unit="size")
    for op in ops:
        if op not in _OPS:
            raise SystemExit(f"unknown --op {op!r}; choose from {', '.join(_OPS)}")
        for size in args.sizes:
            count = max(1, size // esize)
            calls = {}
            for algo, val in variants:
                calls[(algo, val)] = _make_call(op, algo, count, dtype, redop, topo, val, args.timeout)
            # Warm-up (connections, group creation, allocation) and a first timing to size the loop.
            first = 0.0
            for (_algo, _val), (call, _check) in calls.items():
                for _ in range(args.warmup):
                    call()
                t0 = time.perf_counter()
                call()
                first = max(first, time.perf_counter() - t0)
            iters = _agree_iters(first, args.iters)
            times = {k: [] for k in calls}
            context().engine().reset_stats()
            keys = list(calls)
            for it in range(iters):
                # Interleaved, rotated every iteration and reversed every other round, so that every
                # algorithm follows every other one equally often (a shaped link's token bucket,
                # caches and the previous call's finishing threads carry over between calls).
                order = keys[it % len(keys):] + keys[:it % len(keys)]
                for key in order[::-1] if (it // len(keys)) % 2 else order:
                    call = calls[key][0]
                    dist.barrier()
                    t0 = time.perf_counter()
                    call()
                    times[key].append(time.perf_counter() - t0)
            expected = _expected(op, args.redop, world, rank, count, dtype) if args.check else None
            for key, (call, check) in calls.items():
                algo, val = key
                # The median over iterations resists the noise of a shared machine; the slowest
                # rank's median defines the collective's time.
                mean = torch.tensor([statistics.median(times[key])], dtype=torch.float64)
                dist.all_reduce(mean, op=ReduceOp.MAX)
                wrong = torch.tensor([0], dtype=torch.int64)
                if expected is not None:
                    call()
                    wrong += check(expected)
                dist.all_reduce(wrong)
                rows.append(_row(op, algo, val, size, count, dtype, args.redop, float(mean), int(wrong), world,
                                 topo, model, select_algorithm, cost))
            bar.update()
    bar.close()
    return rows


def _row(op, algo, val, size, count, dtype, redop, seconds, wrong, world, topo, model, select_algorithm, cost):
    nbytes = count * torch.empty((), dtype=dtype).element_size()
    total = nbytes * world if op in ("reduce_scatter", "all_gather", "alltoall") else nbytes
    factor = cost.ALGORITHM_FACTORS[op if op != "alltoall" else "alltoall"](world) if world > 1 else 0.0
    algbw = total / seconds / 1e9
    row = {"op": op, "algo": algo, "validate": val, "size": nbytes, "count": count, "type": str(dtype)[6:],
           "redop": redop if op in ("allreduce", "reduce_scatter") else "none", "time_us": seconds * 1e6,
           "algbw": algbw, "busbw": algbw * factor, "wrong": wrong}
    if world > 1 and topo.num_nodes > 1:
        kind = {"allreduce": "allreduce", "reduce_scatter": "reduce_scatter", "all_gather": "all_gather",
                "alltoall": "alltoall"}[op]
        chosen = "flat" if algo == "torch" else algo  # torch's own collective: what flat issues
        if algo == "auto" and op != "alltoall":
            chosen = select_algorithm(kind, "auto", total, topo)
        row["chosen"] = chosen
        try:
            if op == "alltoall":
                from commopt.comm import alltoall as a2a

                if algo == "auto":  # what the call itself chose (the calibrated lines, when measured)
                    row["chosen"] = chosen = a2a.choose_algorithm(total, topo)
                bound = a2a.predict(chosen, total, topo, model)
                link = a2a.link_bytes(chosen, total, topo)
            else:
                bound = cost.predict(chosen, total, topo, model, op=kind)
                link = cost.link_bytes(chosen, total, topo, op=kind)
        except (ValueError, AttributeError, ImportError):
            return row  # no model for this combination: its columns stay empty, never nan
        row["bound_us"] = bound * 1e6
        if topo.links is not None and op != "alltoall":  # what no schedule beats on these links
            from commopt.comm.synthesis.bound import bound as cut_bound

            row["cut_us"] = cut_bound(kind, topo.links, total) * 1e6
        row["link_bytes"] = link
        row["link_busbw"] = link / seconds / 1e9
        if topo.link_rate_bps:
            row["eff_cfg"] = row["link_busbw"] * 8e9 / topo.link_rate_bps
    return row


def _columns(rows: list[dict], link: bool, measured_bps: float | None) -> list[tuple[str, int, object]]:
    """The table's columns as (header, width, cell of a row): nccl-tests' own, then the bound where a
    cost model gave one, then the link figures where an inter-node link exists (no column of nan)."""

    def algo(r: dict) -> str:
        if r.get("chosen") and r["algo"] == "auto":
            return f"auto>{r['chosen'][:4]}"
        return r["algo"] + ("+v" if r.get("validate") else "")

    cols: list[tuple[str, int, object]] = [
        ("size", 10, lambda r: f"{r['size']}"), ("count", 10, lambda r: f"{r['count']}"),
        ("type", 8, lambda r: r["type"]), ("redop", 6, lambda r: r["redop"]), ("algo", 13, algo),
        ("time(us)", 11, lambda r: f"{r['time_us']:.1f}"), ("algbw(GB/s)", 11, lambda r: f"{r['algbw']:.4f}"),
        ("busbw(GB/s)", 11, lambda r: f"{r['busbw']:.4f}"), ("#wrong", 7, lambda r: f"{r['wrong']}")]

    def every(key: str) -> bool:
        return bool(rows) and all(key in r for r in rows)

    if every("bound_us"):
        cols.append(("bound(us)", 10, lambda r: f"{r['bound_us']:.1f}"))
    if every("cut_us"):  # the cut bound of the cluster's link map (comm/synthesis/bound.py)
        cols.append(("cut(us)", 10, lambda r: f"{r['cut_us']:.1f}"))
    if link and every("link_bytes"):
        cols += [("link(MB)", 9, lambda r: f"{r['link_bytes'] / 1e6:.2f}"),
                 ("linkbw(GB/s)", 12, lambda r: f"{r['link_busbw']:.4f}")]
        if every("eff_cfg"):
            cols.append(("eff(cfg)", 8, lambda r: f"{r['eff_cfg']:.3f}"))
        if measured_bps:
            cols.append(("eff(meas)", 9, lambda r: f"{r['link_busbw'] * 8e9 / measured_bps:.3f}"))
    return cols


def _print_table(rows: list[dict], measured_bps: float | None, log=print, *, link: bool = True) -> None:
    """nccl-tests' columns, then those of :func:`_columns` that apply to this run.

    Args:
        rows: :func:`run_sweep`'s rows.
        measured_bps: the probed link rate (``COMMOPT_LINK_MEASURED_BPS``), or None.
        log: where lines go.
        link: whether an inter-node link exists (False for a logical topology on one host).
    """
    cols = _columns(rows, link, measured_bps)
    head = " ".join(f"{name:>{width}}" for name, width, _ in cols)
    log("#" + head[1:])
    for r in rows:
        log(" ".join(f"{cell(r):>{width}}" for _, width, cell in cols))


def _inter_node_link(args, topo) -> bool:
    """Whether the topology's nodes are joined by a real link whose figures mean something.

    A layout imposed with ``--topology`` where neither the environment (``COMMOPT_NODES``: the
    emulated cluster, a launcher) nor a link rate says it is real is taken as logical: under
    ``--spawn`` its "nodes" share one machine's memory, and no byte crosses a link.
    """
    if topo.num_nodes < 2:
        return False
    return bool(topo.link_rate_bps) or not args.topology or bool(os.environ.get("COMMOPT_NODES"))


def _print_ratios(rows: list[dict], log=print) -> None:
    by = {}
    for r in rows:
        by.setdefault((r["op"], r["size"]), {})[(r["algo"], r.get("validate", False))] = r["time_us"]
    keys = sorted({k for v in by.values() for k in v})
    if len(keys) < 2:
        return
    ref = ("flat", False) if ("flat", False) in keys else keys[0]
    log(f"# speed-up against {ref[0]} (time of {ref[0]} / time of each), measured interleaved in this run")
    for (op, size), times in by.items():
        parts = [f"{a}{'+v' if v else ''}={times[ref] / t:.3f}x" for (a, v), t in times.items() if (a, v) != ref]
        log(f"#   {op:>14} {_fmt_size(size):>6}: " + "  ".join(parts))
    chosen = {(r["op"], r["size"]): r["chosen"] for r in rows
              if r["algo"] == "auto" and r.get("chosen") and not r.get("validate", False)}
    if chosen:  # its choice apart from its own timing (two timings of one algorithm differ by noise)
        log("# auto's choice against the algorithms timed in this run")
        for (op, size), ran in chosen.items():
            others = {a: t for (a, v), t in by[(op, size)].items() if not v and a != "auto"}
            if ran not in others:
                log(f"#   {op:>14} {_fmt_size(size):>6}: ran {ran} (not timed on its own here)")
                continue
            fastest = min(others, key=others.get)
            verdict = ("the fastest" if fastest == ran
                       else f"{fastest} was {others[ran] / others[fastest]:.3f}x faster")
            log(f"#   {op:>14} {_fmt_size(size):>6}: ran {ran}, {verdict}")
    if any(v for (_a, v) in keys) and any(not v for (_a, v) in keys):
        log("# cost of validate=True (time with / time without), measured interleaved in this run")
        for (op, size), times in by.items():
            parts = [f"{a}={times[(a, True)] / times[(a, False)]:.3f}x" for (a, v) in times
                     if not v and (a, True) in times]
            log(f"#   {op:>14} {_fmt_size(size):>6}: " + "  ".join(parts))


def _print_fit(rows: list[dict], topo, log=print) -> None:
    """Fit alpha and beta of the inter-node link from each algorithm's sweep (inside a cluster)."""
    from commopt.comm import cost

    for (op, algo) in sorted({(r["op"], r["algo"]) for r in rows if r.get("link_bytes")}):
        pts = [(r["link_bytes"], r["time_us"] * 1e-6) for r in rows if r["op"] == op and r["algo"] == algo
               and not r.get("validate") and r.get("link_bytes")]
        if len(pts) < 2:
            continue
        lm = cost.fit([p[0] for p in pts], [p[1] for p in pts])
        log(f"# fit {op}/{algo}: alpha={lm.alpha * 1e6:.1f} us, beta={lm.beta * 1e9:.3f} ns/B "
            f"(link {8 / lm.beta / 1e6:.1f} Mbit/s)")


def _print_alltoall_scale(log=print) -> None:
    """The cost model's 2-D / flat all-to-all time ratio at scale, with this run's fitted model."""
    from commopt.comm import alltoall as a2a
    from commopt.comm import context

    fitted = next(iter(context().cost_models.values()), None)
    for label, model in (("defaults", None), ("this run's model", fitted)):
        if label != "defaults" and model is None:
            continue
        for nodes, local in ((16, 8), (128, 8)):
            ratios = "  ".join(f"{_fmt_size(b)}/peer={a2a.predicted_ratio(nodes, local, b * nodes * local, model):.3f}"
                               for b in (1 << 10, 16 << 10, 256 << 10, 4 << 20))
            cross = a2a.crossover_bytes(nodes, local, model)  # per-rank buffer; per peer is / (N * L)
            where = "none in range" if cross is None else f"{cross / (nodes * local) / 1024:.0f} KiB/peer"
            log(f"# predicted 2d/flat all-to-all time at {nodes}x{local} ({label}): {ratios}; crossover {where}")


def _rank_body(args) -> int:
    rank, world = dist.get_rank(), dist.get_world_size()
    if args.fail_rank == rank:
        raise RuntimeError(f"rank {rank}: failure injected by --fail-rank")
    topo = topology_of(args)
    measured = float(os.environ.get("COMMOPT_LINK_MEASURED_BPS", "0") or 0) or None
    log = print if rank == 0 else (lambda *a, **k: None)
    log(f"# commopt-bench collectives: world_size={world} topology={topo.layout!r} "
        f"ops={args.op} algos={args.algo} dtype={args.dtype}")
    if topo.link_rate_bps:
        log(f"# link rate: configured {topo.link_rate_bps / 1e6:.1f} Mbit/s"
            + (f", measured {measured / 1e6:.1f} Mbit/s" if measured else ""))
    if topo.links is not None:
        m = topo.links
        rates = (", ".join(f"{i}: up {u * 8e-6:.0f} down {d * 8e-6:.0f}" for i, (u, d) in enumerate(zip(m.up, m.down)))
                 if m.kind == "star" else ", ".join(f"{a}-{b}: {r * 8e-6:.0f}" for a, b, r in m.pairs))
        log(f"# link map ({m.kind}, Mbit/s): {rates}; cut(us): the cut bound no schedule beats on it")
    if args.calibrate and world > 1 and topo.num_nodes > 1:
        from commopt.comm import cost

        m = cost.calibrate(topo)
        log(f"# calibrated: intra alpha={m.intra.alpha * 1e6:.1f} us, {m.intra.bandwidth / 1e9:.3f} GB/s; "
            f"inter alpha={m.inter.alpha * 1e6:.1f} us, {m.inter.bandwidth / 1e9:.3f} GB/s; "
            f"pipelining up to {m.chunks} chunk(s)" + ("" if m.chunks > 1 else " (the levels do not overlap here)"))
        lines = cost.measured_lines("allreduce", topo) or {}
        if lines:  # what auto follows: each candidate's calls as measured, ms at each size
            log("# auto's all-reduce candidates, measured (ms): " + "; ".join(
                f"{a} " + " ".join(f"{_fmt_size(int(s))}={1e3 * t:.2f}" for s, t in line.points)
                for a, line in lines.items()))
    if "alltoall" in args.op and args.calibrate and world > 1 and topo.num_nodes > 1:
        from commopt.comm import alltoall as a2a

        a2a.calibrate(topo)  # measured flat / 2-D lines for this layout, which auto then prefers
    link = _inter_node_link(args, topo)
    rows = run_sweep(args, topo, log)
    _print_table(rows, measured, log, link=link)
    _print_ratios(rows, log)
    if topo.link_rate_bps:
        _print_fit(rows, topo, log)
    if "alltoall" in args.op and world > 1 and topo.num_nodes > 1:
        _print_alltoall_scale(log)
    wrong = sum(r["wrong"] for r in rows)
    log(f"# Out of bounds values : {wrong} {'OK' if wrong == 0 else 'FAILED'}")
    if rank == 0 and (args.json or args.plot):
        meta = {"world_size": world, "topology": topo.layout, "num_nodes": topo.num_nodes,
                "link_rate_bps": topo.link_rate_bps, "link_measured_bps": measured, "inter_node_link": link,
                "dtype": args.dtype, "argv": sys.argv[1:]}
        results = {"meta": meta, "rows": rows}
        if args.json:
            with open(args.json, "w") as f:
                json.dump(results, f, indent=1)
        if args.plot:
            from .plot import plot_collectives

            if plot_collectives(results, args.plot) is not None:
                log(f"# plot: {args.plot}")
    sys.stdout.flush()
    return 1 if wrong else 0
