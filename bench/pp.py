"""``commopt-bench pp``: pipeline parallelism across a slow link (issue 41, item 6). The bench GPT split into
``--stages`` stages, one per node of ``commopt-bench cluster --nodes S --ranks-per-node 1``, trained by
torch's ``Schedule1F1B`` (a ``PipelineStage`` over plain gloo) and by commopt's executor
(``schedules.pipeline_parallel.PipelineSchedule``) uncompressed and compressed, side by side on the same
tokens from the same initial weights (``bench/_pp_worker.py``)::

    commopt-bench pp --stages 2 --link-rates 200mbit,50mbit --json pp2.json

With no launcher around it, it orchestrates: the workers run once on loopback (``--spawn S`` local ranks:
the compute-alone floor, each run's own schedule with the link unshaped) and once inside the emulated
cluster per rate of ``--link-rates``; it then prints, per link and run, the step (the median of the
measured steps) against its floor and against torch's, the simulator's prediction for the same
configuration (the per-stage forward and backward measured in the run itself with no communication, the
codecs' measured cost, the cluster's probed link rate), the bytes per boundary and direction, the
held-out loss against the uncompressed run and the peak memory. Where the cluster cannot run (it needs
root and iproute2) it says why and runs the loopback floor only; ``--loopback`` asks for that.

``--loss-steps N`` is the loss comparison instead: N steps on loopback (the codecs' arithmetic does not
depend on the link) over a finite data set cycled at least 3 times (so AQ-SGD's cache is used), the
held-out loss of each run against the uncompressed one.

``--worker`` is one rank's part (under ``--spawn N``, torchrun or the cluster); ``--json FILE`` writes one
record per run (``run``, ``link_mbit``, ``step_s``, ``floor_s``, ``boundary_bytes``, ``held_out_loss``, ...).
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import tempfile

from ._pp_worker import RUNS, run_spec

__all__ = ["main", "merge", "baseline", "check_bar", "BARS"]

#: The issue's bars at a link (Mbit/s): ("floor", run, most x floor) or ("faster", slower run, run, least speed-up).
BARS = ((200, "floor", "commopt-1f1b", 1.12), (200, "faster", "torch-1f1b", "commopt-1f1b", 1.15),
        (200, "floor", "commopt-1f1b-int8", 1.05), (50, "faster", "commopt-1f1b", "commopt-1f1b-int8", 1.5),
        (50, "faster", "torch-1f1b", "commopt-1f1b-int8", 2.0))
_LOSS_BARS = {"commopt-1f1b-int8": 0.01, "commopt-1f1b-aqsgd": 0.02}
_SIM_BAR = 0.15


def check_bar(bar: tuple, by: dict[str, dict]) -> tuple[str, float, bool] | None:
    """One of :data:`BARS` on the records of its link (by run name): (what, value, met), None where a run
    it needs is missing."""
    if bar[1] == "floor":
        r = by.get(bar[2])
        if r is None or not r.get("x_floor"):
            return None
        return f"{bar[2]} <= {bar[3]:g}x its floor", r["x_floor"], r["x_floor"] <= bar[3]
    slow, fast = by.get(bar[2]), by.get(bar[3])
    if slow is None or fast is None or not slow.get("step_s") or not fast.get("step_s"):
        return None
    v = slow["step_s"] / fast["step_s"]
    return f"{bar[3]} >= {bar[4]:g}x faster than {bar[2]}", v, v >= bar[4]


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="commopt-bench pp", description=__doc__.split("\n\n")[0])
    p.add_argument("--stages", type=int, default=2, help="pipeline stages, one per node (2: 2x1, 4: 4x1)")
    p.add_argument("--link-rates", default="200mbit,50mbit", help="node link rates of the cluster runs (tc units)")
    p.add_argument("--loopback", action="store_true", help="only the loopback runs (the floor); no cluster")
    p.add_argument("--runs", default=",".join(RUNS), help=f"comma-separated runs (default {','.join(RUNS)}; also "
                                                          "torch-gpipe, commopt-gpipe[-CODEC], -bf16, -int4)")
    p.add_argument("--steps", type=int, default=10, help="measured steps per run")
    p.add_argument("--warmup", type=int, default=3, help="steps per run before the measured ones")
    p.add_argument("--loss-steps", type=int, default=0, metavar="N",
                   help="the loss comparison instead: N steps on loopback over a finite set cycled >= 3 times")
    p.add_argument("--d-model", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--micro", type=int, default=8, help="micro-batches per step")
    p.add_argument("--micro-batch", type=int, default=None,
                   help="sequences per micro-batch (default 8; 2 with --loss-steps)")
    p.add_argument("--samples", type=int, default=None,
                   help="size of the finite training set (default: the warm-up's sequences, so the measured steps "
                        "revisit them; with --loss-steps: a quarter of the sequences trained on, cycled 4 times)")
    p.add_argument("--eval-sequences", type=int, default=64, help="held-out sequences the loss is measured on")
    p.add_argument("--lr", type=float, default=3e-3, help="AdamW learning rate of every stage")
    p.add_argument("--extra", type=int, default=1, help="commopt 1F1B: warm-up forwards beyond torch's per boundary")
    p.add_argument("--depth", type=int, default=2, help="commopt: receives posted ahead per direction")
    p.add_argument("--sim-alpha", type=float, default=1e-4, help="simulator: seconds per boundary message")
    p.add_argument("--sim-slowdown", type=float, default=1.0,
                   help="simulator: compute slowdown while a rank's transfer is on the wire")
    p.add_argument("--sim-goodput", type=float, default=0.955,
                   help="simulator: TCP goodput over the configured link rate (tbf counts the headers; the cluster's "
                        "probe reads 0.955 on a quiet link)")
    p.add_argument("--json", default=None, help="write one record per run (JSON)")
    p.add_argument("--keep", default=None, metavar="DIR", help="keep the workers' JSON and logs in DIR")
    p.add_argument("--timeout", type=float, default=300.0, help="seconds any one wait may take")
    p.add_argument("--run-timeout", type=float, default=1800.0, help="seconds one cluster run may take")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--spawn", type=int, default=0, help=argparse.SUPPRESS)
    return p


def _resolve(args) -> str | None:
    """Fill the defaults that depend on the mode; a message when the options do not fit together."""
    if args.micro_batch is None:
        args.micro_batch = 2 if args.loss_steps else 8
    args.batch = args.micro_batch * args.micro
    if args.samples is None:
        trained = args.loss_steps * args.batch if args.loss_steps else args.warmup * args.batch
        args.samples = max(args.batch, trained // 4 // args.batch * args.batch) if args.loss_steps else max(
            args.batch, trained)
    if args.samples % args.batch:
        return f"--samples {args.samples} must be a multiple of the batch ({args.micro} x {args.micro_batch})"
    if args.stages < 2 or args.layers < args.stages:
        return f"--stages {args.stages} needs 2 or more stages and --layers >= stages (got {args.layers})"
    if not args.loss_steps and (args.steps < 1 or args.warmup < 0):
        return "--steps must be >= 1 and --warmup >= 0"
    try:
        for name in args.runs.split(","):
            run_spec(name)
    except ValueError as e:
        return str(e)
    return None


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = _parser().parse_args(argv)
    args.argv = argv
    problem = _resolve(args)
    if problem is not None:
        print(f"commopt-bench pp: {problem}", file=sys.stderr)
        return 2
    if args.worker:
        from ._launch import launch
        from ._pp_worker import worker_body

        return launch(worker_body, args, spawn=args.spawn, timeout=args.timeout, single=False)
    with tempfile.TemporaryDirectory(prefix="commopt-pp-") as tmp:
        root = args.keep or tmp
        os.makedirs(root, exist_ok=True)
        return _orchestrate(args, root)


def _worker_argv(args, json_path: str) -> list[str]:
    """The workers' command: this command's own options (the workers resolve them as this process did),
    then ``--worker`` and their JSON (the later option wins)."""
    return [sys.executable, "-m", "commopt.bench", "pp", *args.argv, "--worker", "--json", json_path]


def _run_worker(args, root: str, rate: str | None) -> dict | None:
    """One worker job: ``--spawn S`` on loopback (``rate`` None) or inside the cluster at ``rate``; its JSON."""
    label = rate or "loopback"
    path = os.path.join(root, f"{label}.json")
    worker = _worker_argv(args, path)
    if rate is None:
        cmd = [*worker, "--spawn", str(args.stages)]
    else:
        cmd = [sys.executable, "-m", "commopt.bench", "cluster", "--nodes", str(args.stages), "--ranks-per-node", "1",
               "--link-rate", rate, "--timeout", f"{args.run_timeout:g}", "--", *worker]
    env = dict(os.environ, TORCH_CPP_LOG_LEVEL=os.environ.get("TORCH_CPP_LOG_LEVEL", "ERROR"))
    log = os.path.join(root, f"{label}.log")
    print(f"# {label}: {shlex.join(cmd)}", flush=True)
    with open(log, "wb") as out:
        code = subprocess.run(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, check=False).returncode
    if code != 0 or not os.path.exists(path):
        with open(log, "rb") as f:
            tail = f.read()[-3000:].decode(errors="replace")
        print(f"# {label}: the workers exited with {code}; their output ends:\n{tail}", file=sys.stderr)
        return None
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def _orchestrate(args, root: str) -> int:
    rates = [] if args.loopback or args.loss_steps else [r for r in args.link_rates.split(",") if r]
    if rates:
        from .__main__ import cluster_unavailable

        reason = cluster_unavailable()
        if reason is not None:
            print(f"# commopt-bench pp: the emulated cluster cannot run here ({reason}); the loopback runs only "
                  f"(the floor). As root with iproute2: commopt-bench pp --stages {args.stages}", flush=True)
            rates = []
    floor = _run_worker(args, root, None)
    if floor is None:
        return 1
    workers = [floor]
    code = 0
    for rate in rates:
        w = _run_worker(args, root, rate)
        if w is None:
            code = 1
            continue
        workers.append(w)
    records = merge(workers)
    _report(args, workers, records)
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump({"kind": "pp", "mode": "loss" if args.loss_steps else "timing", "args": vars(args),
                       "stages": args.stages,
                       "workers": [{k: v for k, v in w.items() if k != "results"} for w in workers],
                       "results": records}, f, indent=1)
    return code


def baseline(name: str, names: set[str]) -> str:
    """The uncompressed run ``name``'s loss is compared with: commopt's uncompressed run of the same schedule
    (torch's uncompressed runs do the same arithmetic), else ``name`` itself."""
    base = f"commopt-{run_spec(name).schedule}"
    return base if base in names else name


def merge(workers: list[dict]) -> list[dict]:
    """The records of every worker job, the first one the loopback floor: each record gets ``floor_s`` (its
    run's loopback step), ``x_floor``, ``vs_torch`` (torch's step of the same schedule and link over its
    own), ``sim_error`` (predicted over measured, minus 1) and ``held_out_vs_base`` (its held-out loss over
    the uncompressed run's, same link, minus 1)."""
    floors = {r["run"]: r["step_s"] for r in workers[0]["results"]}
    out = []
    for w in workers:
        by = {r["run"]: r for r in w["results"]}
        for r in w["results"]:
            rec = dict(r)
            rec["floor_s"] = floors.get(r["run"])
            rec["x_floor"] = rec["step_s"] / rec["floor_s"] if rec["floor_s"] and rec["step_s"] else None
            torch_run = by.get(f"torch-{r['schedule']}")
            rec["vs_torch"] = (torch_run["step_s"] / rec["step_s"] if torch_run and torch_run.get("step_s")
                               and rec["step_s"] else None)
            sim = r.get("sim_step_s")
            rec["sim_error"] = sim / rec["step_s"] - 1 if sim and rec["step_s"] else None
            base = by[baseline(r["run"], set(by))]
            rec["held_out_vs_base"] = r["held_out_loss"] / base["held_out_loss"] - 1
            out.append(rec)
    return out


def _fmt(v, spec: str, width: int, scale: float = 1.0) -> str:
    return ("-" if v is None else format(v * scale, spec)).rjust(width)


def _link_label(r: dict) -> str:
    return "loopback" if r["link_mbit"] is None else f"{r['link_mbit']:g} Mbit/s"


def _report(args, workers: list[dict], records: list[dict]) -> None:
    stages = args.stages
    print(f"# commopt-bench pp: bench GPT d_model {args.d_model}, {args.layers} blocks, seq {args.seq_len}; {stages} "
          f"stages ({stages}x1, one rank per node, one thread per rank); {args.micro} micro-batches of "
          f"{args.micro_batch} sequences; " + (f"{args.loss_steps} steps over {args.samples} sequences "
                                                f"({args.loss_steps * args.batch / args.samples:.1f} epochs)"
                                                if args.loss_steps else
                                                f"{args.steps} measured steps after {args.warmup} warm-up "
                                                f"(step: the median)") +
          f"; commopt extra {args.extra}, depth {args.depth}")
    for w in workers:
        c = w.get("compute")
        if c:
            link = "loopback" if not w["link_rate_bps"] else f"{w['link_rate_bps'] / 1e6:g} Mbit/s"
            probe = f" (probed {w['link_measured_bps'] / 1e6:.1f})" if w.get("link_measured_bps") else ""
            fb = " ".join(f"{f * 1e3:.0f}/{b * 1e3:.0f}" for f, b in zip(c["forward_s"], c["backward_s"]))
            print(f"# {link}{probe}: per-stage forward/backward per micro-batch, ms, no communication: {fb}")
    if args.loss_steps:
        print(f"# loopback only (the codecs' arithmetic does not depend on the link); MiB/boundary: per step, the mean "
              f"over every step (AQ-SGD's first epoch goes exact); held-out: the trained model's exact loss on "
              f"{args.eval_sequences} held-out sequences, vs fp32: against commopt's uncompressed run")
    else:
        print("# x floor: the step over the same run on loopback (another job: a load change between the jobs "
              "moves it); x cpu: the step over the compute-alone floor of this job ((M + S - 1) x the stages' "
              "forward + backward timed with no communication, the simulator's floor); vs torch: torch's step (same "
              "schedule and link) over this one; sim: the simulator's step for this run; MiB/boundary: per step, "
              f"activations/gradients (the busiest boundary); held-out: the trained model's exact loss on "
              f"{args.eval_sequences} held-out sequences, vs fp32: against commopt's uncompressed run; peak: the "
              f"largest RSS of a step over the stages ({workers[0].get('memory')})")
    print(f"{'link':<13}{'run':<22}{'step ms':>9}{'floor':>8}{'x floor':>8}{'x cpu':>7}{'vs torch':>9}{'sim ms':>8}"
          f"{'sim err':>8}{'MiB fwd/bwd':>13}{'held-out':>9}{'vs fp32':>8}{'peak MiB':>10}")
    for r in records:
        bb = max(r["boundary_bytes"], key=lambda b: b["fwd"] + b["bwd"]) if r["boundary_bytes"] else None
        mib = f"{bb['fwd'] / 2**20:.2f}/{bb['bwd'] / 2**20:.2f}" if bb else "-"
        print(f"{_link_label(r):<13}{r['run']:<22}{_fmt(r['step_s'], '.0f', 9, 1e3)}{_fmt(r['floor_s'], '.0f', 8, 1e3)}"
              f"{_fmt(r['x_floor'], '.3f', 8)}{_fmt(r.get('x_compute_floor'), '.3f', 7)}{_fmt(r['vs_torch'], '.2f', 9)}"
              f"{_fmt(r.get('sim_step_s'), '.0f', 8, 1e3)}"
              f"{_fmt(r['sim_error'], '+.1%', 8)}{mib:>13}{r['held_out_loss']:>9.4f}"
              f"{_fmt(r['held_out_vs_base'], '+.2%', 8)}{r['peak_memory_bytes'] / 2**20:>10.0f}")
    if args.loss_steps:
        for name, bar in _LOSS_BARS.items():
            r = next((x for x in records if x["run"] == name), None)
            if r is not None:
                ok = abs(r["held_out_vs_base"]) <= bar
                print(f"# {name}: held-out loss {r['held_out_vs_base']:+.2%} against the uncompressed run "
                      f"(bar: within {bar:.0%}): {'met' if ok else 'MISSED'}")
        return
    for bar in BARS:
        by = {r["run"]: r for r in records if r["link_mbit"] is not None and abs(r["link_mbit"] - bar[0]) < 0.5}
        res = check_bar(bar, by)
        if res is not None:
            cpu = ""
            if bar[1] == "floor" and by[bar[2]].get("x_compute_floor"):
                x = by[bar[2]]["x_compute_floor"]
                cpu = f" (against this job's compute-alone floor: {x:.3f}, {'met' if x <= bar[3] else 'MISSED'})"
            print(f"# {bar[0]} Mbit/s: {res[0]}: {res[1]:.3f}: {'met' if res[2] else 'MISSED'}{cpu}")
    errors = [r for r in records if r["link_mbit"] is not None and r["sim_error"] is not None]
    if errors:
        worst = max(errors, key=lambda r: abs(r["sim_error"]))
        print(f"# simulator within {_SIM_BAR:.0%} of every shaped step: "
              f"{sum(abs(r['sim_error']) <= _SIM_BAR for r in errors)}/{len(errors)}; worst {worst['run']} at "
              f"{_link_label(worst)}: {worst['sim_error']:+.1%}")
