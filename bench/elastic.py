"""``commopt-bench elastic``: elastic DiLoCo (``DiLoCo(elastic=True)``) in the emulated cluster, a node
lost and restarted while the others train on (issue 39, docs/guide.md "DiLoCo").

With no arguments it runs its scenarios one after the other, each a ``commopt-bench cluster --elastic``
run of 4 nodes x 1 rank at 200 Mbit/s (one torch.distributed world per node, the coordinator outside
every node) training the bench GPT (``bench/models.py``, the model and tokens of ``commopt-bench
diloco``) with DiLoCo H=32 for 192 steps, exact outer gradients (``diloco-32``, the main DiLoCo row of
``commopt-bench diloco``; ``--codec int8`` for the block codec with error feedback)::

    no-fault       nothing happens
    kill80         node 2 SIGKILLed at inner step 2.5 H (80: between two outer syncs)
    kill96         node 2 SIGKILLed at step 3 H (96: inside the outer reduction)
    stop80         node 2 SIGSTOPped at step 2.5 H and never continued
    linkdown80     node 2's link taken down at step 2.5 H

and in each faulted run node 2 is restarted 10 s after its fault (``--restart``), which joins the
running job at the next outer sync. Two more kinds of run, by name (``--compare`` runs ``static``, the
default scenarios and their torchft runs)::

    static              the static DiLoCo (``DiLoCo(elastic=False)``): one world across the 4 nodes, as
                        ``commopt-bench cluster`` launches it without ``--elastic``; no fault (the baseline
                        of the no-fault overhead)
    torchft-<scenario>  torchft's DiLoCo on the same schedule and scenario (``bench/_elastic_torchft.py``):
                        its Lighthouse where the coordinator runs, a Manager per node, ``min_replicas=2``;
                        where torchft cannot run (not installed, ``--codec int8``) the reason is printed
                        instead of its row
    hsdp-no-fault       elastic data parallelism, HSDP (``bench/_elastic_dp.py``): 3 nodes x 2 ranks, the
    hsdp-kill           bench GPT at d=128, 2 layers sharded with FSDP2 inside each node and
                        ``ElasticReplicas`` across the nodes, 96 steps; ``hsdp-kill``: node 2 SIGKILLed at
                        step 40 and restarted 10 s later (3 nodes, not 2: with 2, one lost is not a majority
                        of the last generation, and the coordinator's quorum rule ends the job)

Each rank (``--worker``, the command the cluster runs) reports its step to the launcher (``report_step``:
a step fault fires there), and writes one JSON line per step to the run's log directory: the wall clock at
the end of the step, whether an outer sync committed at it, ``dl.elastic.redone``. From the cluster's
``--events`` file and those logs the driver computes per run (:func:`run_record`):

- ``seconds_to_first_commit``: the survivors' stall, from the fault to the end of the first step each
  completes after it, beyond its median step time (the largest over the survivors; the issue's
  definition, so a fault between syncs stalls no inner step); ``max_stall_s``: the longest step of a
  survivor after the fault beyond its median step (where a fault between syncs does stall: the next
  outer sync, which waits for the coordinator to drop the lost node);
- ``seconds_to_rejoin``: from the restart event to the joiner's first committed outer sync;
  ``join_seconds``: the joiner's own count (``dl.elastic.joined``), from the start of its join;
- ``recovery_bytes``: the state the joiner received (``dl.elastic.recovery_bytes``); ``transfer_seconds``:
  the time it spent receiving it (``dl.elastic.transfer_seconds``; against ``recovery_bytes`` / link rate);
- ``steps_lost``: the inner steps the survivors trained that ``dl.steps`` does not count (0: no round
  was thrown away; torchft: those no committed outer step kept, a round thrown away or replaced when the
  replica heals from a peer);
- ``ettr``: the effective training time ratio, the sum over the nodes of median step time x the steps
  that node committed, over 4 x the wall time of the run;
- ``held_out_loss``: of the final global model (``DiLoCo.finalize()``, then 4 held-out batches, as
  ``commopt-bench diloco`` measures it; torchft: the model after its last commit), worker 0;
  ``no_fault_held_out_loss``: the no-fault run's of the same implementation (``static``: commopt's);
- ``survivor_restarts``: restart events of nodes no fault hit (0: survivors never restart);
- ``step_s``: the survivors' median step (the median over them of each one's median step time);
  ``mean_step_s``: their mean step, outer syncs included (from the worker's begin to its last step, over the
  steps it ran; the median over the survivors): where a per-sync cost shows;
- ``link_bytes_per_step``: what crossed a survivor's node link (its interface counters inside the node's
  namespace, sent + received, heartbeats and membership included) from its first to its last step, over
  the steps it ran, the mean over the survivors.

After the runs, where ``static`` ran beside ``no-fault`` (or ``torchft-no-fault``), the no-fault overhead:
the ratio of their mean (and median) step times and the extra link bytes per step (issue 39's target:
at most 5 % and 0.15 MB per step).

It needs what ``commopt-bench cluster`` needs (root, iproute2); torchft's runs need torchft.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
import time

__all__ = ["main", "SCENARIOS", "COMPARE", "parse_run", "baseline", "scenario_flags", "read_jsonl", "run_record",
           "overhead", "FIELDS"]

#: scenario -> (fault kind or None, where in the round it fires: "between" 2.5 H, "sync" 3 H)
SCENARIOS: dict[str, tuple[str | None, str | None]] = {
    "no-fault": (None, None),
    "kill80": ("kill", "between"),
    "kill96": ("kill", "sync"),
    "stop80": ("stop", "between"),
    "linkdown80": ("linkdown", "between"),
}
DEFAULT_SCENARIOS = "no-fault,kill80,kill96"
#: ``--compare``: the static baseline, commopt's default scenarios and torchft's on the same schedule.
COMPARE = "static,no-fault,kill80,kill96,torchft-no-fault,torchft-kill80,torchft-kill96"
STATIC = "static"
TORCHFT = "torchft-"
#: the HSDP runs: their fault (kind, step) or None; 3 nodes x 2 ranks, a smaller GPT, fewer steps
HSDP_RUNS: dict[str, tuple[str, int] | None] = {"hsdp-no-fault": None, "hsdp-kill": ("kill", 40)}
HSDP_NODES, HSDP_RANKS, HSDP_STEPS, HSDP_D_MODEL, HSDP_LAYERS = 3, 2, 96, 128, 2
FAULT_NODE = 2
NODES = 4
RESTART_AFTER_S = 10.0
HEARTBEAT_TIMEOUT_S = 3.0

#: The columns of the printed table and the keys every ``--json`` record has.
FIELDS = ("run", "fault", "steps_lost", "seconds_to_first_commit", "max_stall_s", "seconds_to_rejoin",
          "join_seconds", "recovery_bytes", "transfer_seconds", "ettr", "held_out_loss", "no_fault_held_out_loss",
          "survivor_restarts", "step_s", "mean_step_s", "link_bytes_per_step")


def fault_step(where: str, sync_every: int) -> int:
    """The step a fault fires at: "between" two syncs (2.5 H) or at the outer "sync" of step 3 H."""
    return 3 * sync_every if where == "sync" else 2 * sync_every + sync_every // 2


def parse_run(name: str) -> tuple[str, str]:
    """``(implementation, scenario)`` of run ``name``: ``"commopt"`` (elastic DiLoCo, ``name`` a scenario),
    ``"static"`` (``static``: the static DiLoCo, no fault) or ``"torchft"`` (``torchft-<scenario>``).

    Raises:
        ValueError: an unknown run name (the message lists the known ones).
    """
    if name == STATIC:
        return "static", "no-fault"
    if name in HSDP_RUNS:
        return "hsdp", "no-fault" if HSDP_RUNS[name] is None else "kill80"
    impl, scenario = ("torchft", name[len(TORCHFT):]) if name.startswith(TORCHFT) else ("commopt", name)
    if scenario not in SCENARIOS:
        raise ValueError(f"commopt-bench elastic: unknown scenario {name!r}; use any of {', '.join(SCENARIOS)}, "
                         f"{STATIC}, or {TORCHFT}<any of those> (torchft's DiLoCo)")
    return impl, scenario


def baseline(name: str) -> str | None:
    """The run whose held-out loss run ``name``'s is compared with: its implementation's no-fault run
    (``static``'s: commopt's elastic no-fault run, which it should match); None for that run itself."""
    impl, _ = parse_run(name)
    base = {"torchft": f"{TORCHFT}no-fault", "hsdp": "hsdp-no-fault"}.get(impl, "no-fault")
    return None if base == name else base


def scenario_flags(name: str, sync_every: int) -> list[str]:
    """The ``commopt-bench cluster`` options of run ``name``'s scenario: its fault on node 2 and the restart.

    Raises:
        ValueError: an unknown run name (the message lists the known ones).
    """
    if name in HSDP_RUNS:
        fault = HSDP_RUNS[name]
        return [] if fault is None else ["--fault", f"{fault[0]}:node={FAULT_NODE}:at=step={fault[1]}",
                                         "--restart", f"node={FAULT_NODE}:after={RESTART_AFTER_S:g}"]
    kind, where = SCENARIOS[parse_run(name)[1]]
    if kind is None:
        return []
    return ["--fault", f"{kind}:node={FAULT_NODE}:at=step={fault_step(where, sync_every)}",
            "--restart", f"node={FAULT_NODE}:after={RESTART_AFTER_S:g}"]


def read_jsonl(path: str) -> list[dict]:
    """The JSON lines of ``path`` (a line cut short by a SIGKILL is skipped); [] if it does not exist."""
    out = []
    try:
        with open(path, encoding="utf-8") as f:
            for line in f:
                try:
                    out.append(json.loads(line))
                except json.JSONDecodeError:
                    continue
    except FileNotFoundError:
        return []
    return out


def _median_step(steps: list[dict]) -> float | None:
    times = [r["time"] for r in steps]
    gaps = [b - a for a, b in zip(times, times[1:])]
    return statistics.median(gaps) if gaps else None


def run_record(name: str, fault: str | None, events: list[dict], logs: dict[tuple[int, int], list[dict]],
               total_steps: int, no_fault_loss: float | None = None, nodes: int = NODES) -> dict:
    """One run's record from the cluster's events and the workers' logs.

    Args:
        name: the scenario.
        fault: its fault kind, or None.
        events: the ``--events`` lines (``time``, ``event``, ``node``, ...).
        logs: the log lines of each (node, attempt): ``{"step", "time", "synced", "redone"}`` per step,
            one ``{"event": "begin", "time"}`` before the first step, ``{"event": "joined", "time",
            "joined"}`` when a joiner's first sync committed in its constructor, and ``{"event": "final",
            "steps", "trained", "redone", "recovery_bytes", "held_out_loss"}`` at the end, with
            ``"link_bytes"`` (its node link's bytes over its steps), and ``"committed"`` (the inner steps
            of its own that a committed outer step kept; then ``steps_lost`` counts ``trained - committed``)
            and ``"error"`` (what ended its training early) where the worker reports them (torchft's: its
            step counter falls back by H when a round is thrown away, and jumps when a replica heals).
        total_steps: the steps the run trains.
        no_fault_loss: the no-fault run's held-out loss, if it ran.
        nodes: the nodes of the run (the ETTR's denominator).

    Returns:
        The record (the keys of :data:`FIELDS`, ``exit_ok`` and ``errors``: the ``error`` of each worker
        that reported one, by ``node<N>.attempt<A>``); a figure that cannot be computed (no fault, no
        restart, a worker that never finished) is None.
    """
    faults = [e for e in events if e.get("event") == "fault"]
    faulted = {e["node"] for e in faults}
    fault_time = faults[0]["time"] if faults else None
    rec: dict = {k: None for k in FIELDS}
    rec.update(run=name, fault=fault, no_fault_held_out_loss=no_fault_loss)
    finals = {key: next((r for r in lines if r.get("event") == "final"), None) for key, lines in logs.items()}
    steps_of = {key: [r for r in lines if "step" in r and "event" not in r] for key, lines in logs.items()}
    survivors = [key for key in logs if key[0] not in faulted]
    rec["exit_ok"] = all(finals[k] is not None and finals[k]["steps"] == total_steps for k in survivors)
    kept = {k: f["steps"] if f.get("committed") is None else f["committed"] for k, f in finals.items() if f}
    lost = [finals[k]["trained"] - kept[k] for k in survivors if finals[k] is not None]
    rec["errors"] = {f"node{n}.attempt{a}": finals[n, a]["error"] for n, a in logs
                     if finals[n, a] is not None and finals[n, a].get("error")}
    rec["steps_lost"] = sum(lost) if len(lost) == len(survivors) else None
    worker0 = finals.get((0, 0))
    rec["held_out_loss"] = worker0.get("held_out_loss") if worker0 else None
    rec["survivor_restarts"] = sum(1 for e in events if e.get("event") == "restart" and e.get("node") not in faulted)
    if fault_time is not None:
        stalls, worst = [], []
        for key in survivors:
            med = _median_step(steps_of[key])
            after = [r for r in steps_of[key] if r["time"] > fault_time]
            if med is None or not after:
                continue
            stalls.append(max(0.0, after[0]["time"] - fault_time - med))
            prev = [fault_time] + [r["time"] for r in after]
            worst.append(max(0.0, max(b - a for a, b in zip(prev, prev[1:])) - med))
        rec["seconds_to_first_commit"] = max(stalls) if stalls else None
        rec["max_stall_s"] = max(worst) if worst else None
    restarts = [e for e in events if e.get("event") == "restart" and e.get("node") in faulted]
    joiner = next(((n, a) for (n, a) in logs if n in faulted and a > 0), None)
    if restarts and joiner is not None:
        lines = logs[joiner]
        first = next((r for r in lines if r.get("event") == "joined" or r.get("synced")), None)
        if first is not None:
            rec["seconds_to_rejoin"] = first["time"] - restarts[0]["time"]
        if finals[joiner] is not None:
            rec["recovery_bytes"] = finals[joiner]["recovery_bytes"]
            rec["transfer_seconds"] = finals[joiner].get("transfer_seconds")
            joined = finals[joiner].get("joined")
            rec["join_seconds"] = joined[1] if joined else None
    meds = [m for key in survivors if (m := _median_step(steps_of[key])) is not None]
    rec["step_s"] = statistics.median(meds) if meds else None
    means = []
    for key in survivors:
        begin = next((r["time"] for r in logs[key] if r.get("event") == "begin"), None)
        if begin is not None and steps_of[key]:
            means.append((steps_of[key][-1]["time"] - begin) / len(steps_of[key]))
    rec["mean_step_s"] = statistics.median(means) if means else None
    link = [finals[k]["link_bytes"] / finals[k]["trained"] for k in survivors
            if finals[k] is not None and finals[k].get("link_bytes") is not None and finals[k]["trained"]]
    rec["link_bytes_per_step"] = statistics.mean(link) if link else None
    begins = [r["time"] for key, lines in logs.items() if key[1] == 0 for r in lines if r.get("event") == "begin"]
    ends = [steps_of[key][-1]["time"] for key in logs if steps_of[key]]
    if begins and ends:
        useful = 0.0
        for node in {n for n, _ in logs}:
            keys = [k for k in logs if k[0] == node]
            med = [m for k in keys if (m := _median_step(steps_of[k])) is not None]
            useful += (statistics.median(med) if med else 0.0) * _committed(node, keys, steps_of, finals)
        rec["ettr"] = useful / (nodes * (max(ends) - min(begins)))
    return rec


def _committed(node: int, keys: list[tuple[int, int]], steps_of: dict, finals: dict) -> int:
    """The inner steps node ``node`` trained that a committed outer sync (or the final one) kept."""
    total = 0
    for key in keys:
        lines = steps_of[key]
        if not lines:
            continue
        if finals[key] is not None and finals[key].get("committed") is not None:  # the worker's own count
            total += finals[key]["committed"]
            continue
        start = lines[0]["step"] - 1
        if finals[key] is not None:
            end = finals[key]["steps"]
        else:  # killed: what it trained up to its last committed sync
            end = max((r["step"] for r in lines if r.get("synced")), default=start)
        total += max(0, end - start)
    return total


def overhead(records: list[dict]) -> list[dict]:
    """The no-fault overhead of each no-fault run (``no-fault``, ``torchft-no-fault``) against ``static``.

    Returns:
        One ``{"run", "against", "mean_step_ratio", "median_step_ratio", "extra_link_bytes_per_step"}`` per
        no-fault run that ran beside ``static``; a figure whose inputs are missing is None.
    """
    static = next((r for r in records if r["run"] == STATIC), None)
    if static is None:
        return []
    out = []
    for r in records:
        if r["run"] not in ("no-fault", f"{TORCHFT}no-fault"):
            continue
        extra = (r["link_bytes_per_step"] - static["link_bytes_per_step"]
                 if r["link_bytes_per_step"] is not None and static["link_bytes_per_step"] is not None else None)
        out.append({"run": r["run"], "against": STATIC, "mean_step_ratio": _ratio(r, static, "mean_step_s"),
                    "median_step_ratio": _ratio(r, static, "step_s"), "extra_link_bytes_per_step": extra})
    return out


def _ratio(run: dict, base: dict, key: str) -> float | None:
    return run[key] / base[key] if run[key] is not None and base[key] else None


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="commopt-bench elastic", description=__doc__.split("\n\n")[0])
    p.add_argument("--scenarios", default=DEFAULT_SCENARIOS,
                   help=f"comma-separated runs (default {DEFAULT_SCENARIOS}; any of {', '.join(SCENARIOS)}, "
                        f"{STATIC} (the static DiLoCo), {TORCHFT}<scenario> (torchft's DiLoCo))")
    p.add_argument("--compare", action="store_true",
                   help=f"run {COMPARE} (in place of --scenarios): the no-fault overhead against the static "
                        "DiLoCo, and torchft's DiLoCo beside commopt's")
    p.add_argument("--steps", type=int, default=192, help="inner steps per run (more than 3 x --sync-every)")
    p.add_argument("--sync-every", type=int, default=32, help="DiLoCo's H (default 32)")
    p.add_argument("--link-rate", default="200mbit", help="each node's link, in tc units (default 200mbit)")
    p.add_argument("--codec", choices=("none", "int8"), default="none",
                   help="outer gradients exact (none, default) or int8 block codec with error feedback")
    p.add_argument("--batch", type=int, default=4, help="sequences per worker per step")
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--d-model", type=int, default=256, help="the GPT's width (default: commopt-bench diloco's)")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--lr", type=float, default=3e-3, help="inner AdamW learning rate")
    p.add_argument("--run-timeout", type=float, default=600.0, help="seconds before a run is killed")
    p.add_argument("--json", default=None, help="write one record per run to this file")
    p.add_argument("--keep", default=None, metavar="DIR", help="keep the runs' events and logs in DIR")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--impl", choices=("commopt", "static", "torchft", "hsdp"), default="commopt",
                   help=argparse.SUPPRESS)
    p.add_argument("--log-dir", default=None, help=argparse.SUPPRESS)
    return p


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.sync_every < 1 or args.steps <= 3 * args.sync_every:
        print(f"commopt-bench elastic: --steps ({args.steps}) must be more than 3 x --sync-every "
              f"({args.sync_every}): the faults fire at steps 2.5 H and 3 H", file=sys.stderr)
        return 2
    if args.worker:
        return _worker(args)
    names = [n for n in (COMPARE if args.compare else args.scenarios).split(",") if n]
    try:
        for n in names:
            scenario_flags(n, args.sync_every)
    except ValueError as e:
        print(e, file=sys.stderr)
        return 2
    from .__main__ import cluster_unavailable

    reason = cluster_unavailable()
    if reason is not None:
        print(f"commopt-bench elastic: the emulated cluster cannot run here ({reason})", file=sys.stderr)
        return 2
    not_run: dict[str, str] = {}
    torchft = any(parse_run(n)[0] == "torchft" for n in names)
    if torchft:
        from ._elastic_torchft import problem

        reason = problem(args.codec, args.steps, args.sync_every)
        if reason is not None:
            not_run = {n: reason for n in names if parse_run(n)[0] == "torchft"}
    with tempfile.TemporaryDirectory(prefix="commopt-elastic-") as tmp:
        root = args.keep or tmp
        records = []
        _header(args)
        for name in names:
            if name in not_run:
                print(f"{name:<20}not run: {not_run[name]}", flush=True)
                continue
            rec = _run(name, args, os.path.join(root, name))
            records.append(rec)
            _fill_baselines(records)
            _row(rec)
    _fill_baselines(records)
    over = overhead(records)
    for o in over:
        _overhead_row(o, records)
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump({"kind": "elastic", "args": vars(args), "results": records, "overhead": over,
                       "not_run": not_run}, f, indent=1)
    return 0 if all(r["exit_ok"] for r in records) else 1


def _fill_baselines(records: list[dict]) -> None:
    """Each record's ``no_fault_held_out_loss``: its :func:`baseline` run's held-out loss, once that ran."""
    by_name = {r["run"]: r for r in records}
    for r in records:
        base = by_name.get(baseline(r["run"]) or "")
        r["no_fault_held_out_loss"] = base["held_out_loss"] if base else None


def _run(name: str, args, directory: str) -> dict:
    """One run in the cluster; its record."""
    os.makedirs(directory, exist_ok=True)
    impl, scenario = parse_run(name)
    events_path = os.path.join(directory, "events.jsonl")
    hsdp = impl == "hsdp"
    steps = HSDP_STEPS if hsdp else args.steps
    worker = [sys.executable, "-m", "commopt.bench", "elastic", "--worker", "--impl", impl, "--log-dir", directory,
              "--steps", str(steps), "--sync-every", str(args.sync_every if not hsdp else steps // 4),
              "--codec", args.codec,
              "--batch", str(args.batch), "--seq-len", str(args.seq_len),
              "--d-model", str(HSDP_D_MODEL if hsdp else args.d_model),
              "--layers", str(HSDP_LAYERS if hsdp else args.layers), "--lr", str(args.lr)]
    nodes = HSDP_NODES if hsdp else NODES
    cmd = [sys.executable, "-m", "commopt.bench", "cluster", "--nodes", str(nodes),
           "--ranks-per-node", str(HSDP_RANKS if hsdp else 1),
           "--link-rate", args.link_rate, "--probe-seconds", "0", "--timeout", f"{args.run_timeout:g}"]
    if impl != "static":  # one world per node, the coordinator (or torchft's Lighthouse) outside the nodes
        cmd += ["--elastic", "--heartbeat-timeout", f"{HEARTBEAT_TIMEOUT_S:g}", "--min-replicas", "2",
                *scenario_flags(name, args.sync_every), "--events", events_path]
        if impl == "torchft":
            cmd += ["--coordinator-command", shlex.join([sys.executable, "-m", "commopt.bench._elastic_torchft"])]
    cmd += ["--", *worker]
    env = dict(os.environ, TORCH_CPP_LOG_LEVEL=os.environ.get("TORCH_CPP_LOG_LEVEL", "ERROR"))
    with open(os.path.join(directory, "cluster.log"), "wb") as out:
        print(f"# {name}: {shlex.join(cmd)}", flush=True)
        code = subprocess.run(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, check=False).returncode
    logs = {}
    for entry in sorted(os.listdir(directory)):
        if entry.startswith("node") and entry.endswith(".jsonl"):
            node, attempt = entry[len("node"):-len(".jsonl")].split(".attempt")
            logs[(int(node), int(attempt))] = read_jsonl(os.path.join(directory, entry))
    rec = run_record(name, SCENARIOS[scenario][0], read_jsonl(events_path), logs, steps, nodes=nodes)
    rec["cluster_exit"] = code  # non-zero also when a survivor that wrote its final record died after it
    if code != 0:
        with open(os.path.join(directory, "cluster.log"), "rb") as f:
            tail = f.read()[-3000:].decode(errors="replace")
        print(f"# {name}: the cluster exited with {code}; its output ends:\n{tail}", file=sys.stderr)
    return rec


def _header(args) -> None:
    codec = "exact" if args.codec == "none" else "int8 + error feedback"
    print(f"# commopt-bench elastic: {NODES}x1 at {args.link_rate}, DiLoCo H={args.sync_every} ({codec}), "
          f"{args.steps} steps, GPT d={args.d_model} L={args.layers} seq={args.seq_len} batch={args.batch}; "
          f"faults on node {FAULT_NODE}, restarted {RESTART_AFTER_S:g} s later; heartbeat timeout "
          f"{HEARTBEAT_TIMEOUT_S:g} s")
    print("# stall: seconds_to_first_commit (survivors' first step after the fault, beyond their median step); "
          "max stall: their longest step after it, beyond the median; rejoin: restart -> the joiner's first "
          "committed sync; held-out: worker 0's global model after finalize(); vs: against the no-fault run of "
          "the same implementation; step ms: the survivors' median step; mean ms: their mean step, syncs "
          "included; MB/step: their node link's bytes (sent + received) per step")
    print(f"{'run':<20}{'lost':>5}{'stall s':>9}{'max st s':>9}{'rejoin s':>9}{'join s':>8}{'recov MB':>9}"
          f"{'xfer s':>7}{'ettr':>6}{'held-out':>9}{'no-fault':>9}{'vs':>8}{'surv rst':>9}{'step ms':>8}"
          f"{'mean ms':>8}{'MB/step':>8}", flush=True)


def _fmt(v, fmt: str, scale: float = 1.0) -> str:
    return "-" if v is None else format(v * scale if scale != 1.0 else v, fmt)


def _row(r: dict) -> None:
    f = _fmt
    exit_note = f"  (cluster exit {r['cluster_exit']})" if r.get("cluster_exit") else ""
    exit_note += "".join(f"  ({who}: {error[:160]})" for who, error in (r.get("errors") or {}).items())
    vs = (f"{100 * (r['held_out_loss'] / r['no_fault_held_out_loss'] - 1):+.2f}%"
          if r["held_out_loss"] and r["no_fault_held_out_loss"] else "-")
    print(f"{r['run']:<20}{f(r['steps_lost'], 'd'):>5}{f(r['seconds_to_first_commit'], '.2f'):>9}"
          f"{f(r['max_stall_s'], '.2f'):>9}{f(r['seconds_to_rejoin'], '.2f'):>9}{f(r['join_seconds'], '.2f'):>8}"
          f"{f(r['recovery_bytes'], '.2f', 1 / 2**20):>9}{f(r.get('transfer_seconds'), '.2f'):>7}"
          f"{f(r['ettr'], '.2f'):>6}{f(r['held_out_loss'], '.4f'):>9}"
          f"{f(r['no_fault_held_out_loss'], '.4f'):>9}{vs:>8}{f(r['survivor_restarts'], 'd'):>9}"
          f"{f(r['step_s'], '.1f', 1e3):>8}{f(r['mean_step_s'], '.1f', 1e3):>8}"
          f"{f(r['link_bytes_per_step'], '.3f', 1e-6):>8}"
          f"{'' if r['exit_ok'] else '  (a survivor did not finish)'}{exit_note}", flush=True)


def _overhead_row(o: dict, records: list[dict]) -> None:
    by_name = {r["run"]: r for r in records}
    run, static = by_name[o["run"]], by_name[o["against"]]
    f = _fmt
    print(f"# no-fault overhead, {o['run']} against {o['against']}: mean step x{f(o['mean_step_ratio'], '.3f')} "
          f"({f(run['mean_step_s'], '.1f', 1e3)} vs {f(static['mean_step_s'], '.1f', 1e3)} ms), median step "
          f"x{f(o['median_step_ratio'], '.3f')}; link bytes per step {f(o['extra_link_bytes_per_step'], '+.4f', 1e-6)}"
          f" MB ({f(run['link_bytes_per_step'], '.4f', 1e-6)} vs {f(static['link_bytes_per_step'], '.4f', 1e-6)} MB;"
          " target: at most 5 % and 0.15 MB)", flush=True)


def _link_bytes() -> int:
    """Bytes this process's network namespace has sent and received on its interfaces other than loopback:
    inside the emulated cluster, what crossed this node's link (headers included), a measurement."""
    import glob

    total = 0
    for path in glob.glob("/sys/class/net/*/statistics/[rt]x_bytes"):
        if path.split("/")[-3] != "lo":
            with open(path, encoding="ascii") as f:
                total += int(f.read())
    return total


def _held_out_one(model, args) -> float:
    """``model``'s mean cross-entropy on the 4 held-out batches of ``commopt-bench diloco``'s ``_held_out`` on a
    one-rank world (rank 0's batches), with no collective: the same batches for every run of this bench."""
    import torch
    from torch import nn

    from .diloco import _VOCAB
    from .models import synthetic_tokens

    total = 0.0
    with torch.no_grad():
        for i in range(4):
            data = synthetic_tokens(args.batch, args.seq_len, _VOCAB, seed=99_000_000 + 100 * i)
            logits = model(data[:, :-1])
            total += float(nn.functional.cross_entropy(logits.reshape(-1, _VOCAB), data[:, 1:].reshape(-1)))
    return total / 4


def _worker(args) -> int:
    """One node's rank: elastic DiLoCo in its own world of one rank (``--impl commopt``), the static DiLoCo in
    one world across the nodes (``static``) or torchft's DiLoCo (``torchft``); a JSON line per step."""
    if args.impl == "hsdp":
        from ._elastic_dp import worker as hsdp_worker

        return hsdp_worker(args, _link_bytes)
    static = args.impl == "static"
    node = int(os.environ["RANK"]) if static else int(os.environ["COMMOPT_REPLICA_ID"])  # static: 1 rank per node
    attempt = int(os.environ.get("COMMOPT_RESTART", "0") or 0)
    log = open(os.path.join(args.log_dir, f"node{node}.attempt{attempt}.jsonl"), "a", encoding="utf-8")

    def write(**fields) -> None:
        log.write(json.dumps(fields) + "\n")
        log.flush()

    try:
        if args.impl == "torchft":
            from ._elastic_torchft import worker

            return worker(args, node, write, _link_bytes, _held_out_one)
        return _commopt_worker(args, node, static, write)
    finally:
        log.close()


def _commopt_worker(args, node: int, static: bool, write) -> int:
    """commopt's DiLoCo, elastic (its own world of one rank) or static (one world across the nodes)."""
    import torch
    import torch.distributed as dist
    from torch import nn

    from commopt.comm.compression import QuantizeCompressor
    from commopt.schedules import DiLoCo

    from .cluster.progress import report_step
    from .diloco import _VOCAB
    from .models import GPT, synthetic_tokens

    torch.set_num_threads(1)
    if static:
        dist.init_process_group("gloo")  # env://: the world across the nodes, as the cluster launches it
    else:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    model = GPT(_VOCAB, args.d_model, args.layers, 4, args.seq_len, seed=0)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr)
    compressor = QuantizeCompressor(8) if args.codec == "int8" else None
    if static:
        dl = DiLoCo(model, opt, sync_every=args.sync_every, compressor=compressor, timeout=60.0)
    else:
        dl = DiLoCo(model, opt, sync_every=args.sync_every, compressor=compressor, elastic=True, min_workers=2,
                    timeout=60.0)
    elastic = None if static else dl.elastic
    if elastic is not None and elastic.joined is not None:  # a restarted worker: admitted at the job's outer sync
        write(event="joined", time=time.time(), joined=list(elastic.joined), steps=dl.steps)
    write(event="begin", time=time.time(), steps=dl.steps)
    link0 = _link_bytes()
    trained = 0
    for step in range(dl.steps + 1, args.steps + 1):
        data = synthetic_tokens(args.batch, args.seq_len, _VOCAB, seed=10_000 * step + node)
        opt.zero_grad(set_to_none=True)
        logits = model(data[:, :-1])
        nn.functional.cross_entropy(logits.reshape(-1, _VOCAB), data[:, 1:].reshape(-1)).backward()
        opt.step()
        trained += 1
        report_step(step)  # after the inner step, before the outer sync: a fault at step=3H lands inside it
        dl.step()
        write(step=dl.steps, time=time.time(), synced=dl.steps % args.sync_every == 0,
              redone=elastic.redone if elastic is not None else 0)
    link = _link_bytes() - link0
    steps = dl.steps
    dl.finalize()
    held_out = _held_out_one(model, args) if node == 0 else None
    write(event="final", time=time.time(), steps=steps, trained=trained,
          redone=elastic.redone if elastic is not None else 0,
          recovery_bytes=elastic.recovery_bytes if elastic is not None else None,
          joined=list(elastic.joined) if elastic is not None and elastic.joined else None,
          transfer_seconds=elastic.transfer_seconds if elastic is not None else None,
          link_bytes=link, held_out_loss=held_out)
    dl.close()
    dist.destroy_process_group()
    return 0
