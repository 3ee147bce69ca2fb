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
running job at the next outer sync. Each rank (``--worker``, the command the cluster runs) reports its
step to the launcher (``report_step``: a step fault fires there), and writes one JSON line per step to
the run's log directory: the wall clock at the end of the step, whether an outer sync committed at it,
``dl.elastic.redone``. From the cluster's ``--events`` file and those logs the driver computes per run
(:func:`run_record`):

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
  was thrown away);
- ``ettr``: the effective training time ratio, the sum over the nodes of median step time x the steps
  that node committed, over 4 x the wall time of the run;
- ``held_out_loss``: of the final global model (``DiLoCo.finalize()``, then 4 held-out batches, as
  ``commopt-bench diloco`` measures it), worker 0; ``no_fault_held_out_loss``: the no-fault run's;
- ``survivor_restarts``: restart events of nodes no fault hit (0: survivors never restart).

It needs what ``commopt-bench cluster`` needs (root, iproute2). torchft's DiLoCo beside it is not run.
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

__all__ = ["main", "SCENARIOS", "scenario_flags", "read_jsonl", "run_record", "FIELDS"]

#: scenario -> (fault kind or None, where in the round it fires: "between" 2.5 H, "sync" 3 H)
SCENARIOS: dict[str, tuple[str | None, str | None]] = {
    "no-fault": (None, None),
    "kill80": ("kill", "between"),
    "kill96": ("kill", "sync"),
    "stop80": ("stop", "between"),
    "linkdown80": ("linkdown", "between"),
}
DEFAULT_SCENARIOS = "no-fault,kill80,kill96"
FAULT_NODE = 2
NODES = 4
RESTART_AFTER_S = 10.0
HEARTBEAT_TIMEOUT_S = 3.0

#: The columns of the printed table and the keys every ``--json`` record has.
FIELDS = ("run", "fault", "steps_lost", "seconds_to_first_commit", "max_stall_s", "seconds_to_rejoin",
          "join_seconds", "recovery_bytes", "transfer_seconds", "ettr", "held_out_loss", "no_fault_held_out_loss",
          "survivor_restarts")


def fault_step(where: str, sync_every: int) -> int:
    """The step a fault fires at: "between" two syncs (2.5 H) or at the outer "sync" of step 3 H."""
    return 3 * sync_every if where == "sync" else 2 * sync_every + sync_every // 2


def scenario_flags(name: str, sync_every: int) -> list[str]:
    """The ``commopt-bench cluster`` options of scenario ``name``: its fault on node 2 and the restart.

    Raises:
        ValueError: an unknown scenario name (the message lists the known ones).
    """
    if name not in SCENARIOS:
        raise ValueError(f"commopt-bench elastic: unknown scenario {name!r}; use any of {', '.join(SCENARIOS)}")
    kind, where = SCENARIOS[name]
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
               total_steps: int, no_fault_loss: float | None = None) -> dict:
    """One run's record from the cluster's events and the workers' logs.

    Args:
        name: the scenario.
        fault: its fault kind, or None.
        events: the ``--events`` lines (``time``, ``event``, ``node``, ...).
        logs: the log lines of each (node, attempt): ``{"step", "time", "synced", "redone"}`` per step,
            one ``{"event": "begin", "time"}`` before the first step, ``{"event": "joined", "time",
            "joined"}`` when a joiner's first sync committed in its constructor, and ``{"event": "final",
            "steps", "trained", "redone", "recovery_bytes", "held_out_loss"}`` at the end.
        total_steps: the steps the run trains.
        no_fault_loss: the no-fault run's held-out loss, if it ran.

    Returns:
        The record (the keys of :data:`FIELDS` and ``exit_ok``); a figure that cannot be computed
        (no fault, no restart, a worker that never finished) is None.
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
    lost = [finals[k]["trained"] - finals[k]["steps"] for k in survivors if finals[k] is not None]
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
    begins = [r["time"] for key, lines in logs.items() if key[1] == 0 for r in lines if r.get("event") == "begin"]
    ends = [steps_of[key][-1]["time"] for key in logs if steps_of[key]]
    if begins and ends:
        useful = 0.0
        for node in {n for n, _ in logs}:
            keys = [k for k in logs if k[0] == node]
            med = [m for k in keys if (m := _median_step(steps_of[k])) is not None]
            useful += (statistics.median(med) if med else 0.0) * _committed(node, keys, steps_of, finals)
        rec["ettr"] = useful / (NODES * (max(ends) - min(begins)))
    return rec


def _committed(node: int, keys: list[tuple[int, int]], steps_of: dict, finals: dict) -> int:
    """The inner steps node ``node`` trained that a committed outer sync (or the final one) kept."""
    total = 0
    for key in keys:
        lines = steps_of[key]
        if not lines:
            continue
        start = lines[0]["step"] - 1
        if finals[key] is not None:
            end = finals[key]["steps"]
        else:  # killed: what it trained up to its last committed sync
            end = max((r["step"] for r in lines if r.get("synced")), default=start)
        total += max(0, end - start)
    return total


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="commopt-bench elastic", description=__doc__.split("\n\n")[0])
    p.add_argument("--scenarios", default=DEFAULT_SCENARIOS,
                   help=f"comma-separated runs (default {DEFAULT_SCENARIOS}; any of {', '.join(SCENARIOS)})")
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
    names = [n for n in args.scenarios.split(",") if n]
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
    with tempfile.TemporaryDirectory(prefix="commopt-elastic-") as tmp:
        root = args.keep or tmp
        records = []
        _header(args)
        for name in names:
            rec = _run(name, args, os.path.join(root, name))
            base = next((r for r in records if r["run"] == "no-fault"), None)
            rec["no_fault_held_out_loss"] = base["held_out_loss"] if base else None
            records.append(rec)
            _row(rec)
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump({"kind": "elastic", "args": vars(args), "results": records}, f, indent=1)
    return 0 if all(r["exit_ok"] for r in records) else 1


def _run(name: str, args, directory: str) -> dict:
    """One scenario in the cluster; its record."""
    os.makedirs(directory, exist_ok=True)
    events_path = os.path.join(directory, "events.jsonl")
    worker = [sys.executable, "-m", "commopt.bench", "elastic", "--worker", "--log-dir", directory,
              "--steps", str(args.steps), "--sync-every", str(args.sync_every), "--codec", args.codec,
              "--batch", str(args.batch), "--seq-len", str(args.seq_len), "--d-model", str(args.d_model),
              "--layers", str(args.layers), "--lr", str(args.lr)]
    cmd = [sys.executable, "-m", "commopt.bench", "cluster", "--nodes", str(NODES), "--ranks-per-node", "1",
           "--link-rate", args.link_rate, "--elastic", "--heartbeat-timeout", f"{HEARTBEAT_TIMEOUT_S:g}",
           "--min-replicas", "2", "--probe-seconds", "0", "--timeout", f"{args.run_timeout:g}",
           *scenario_flags(name, args.sync_every), "--events", events_path, "--", *worker]
    env = dict(os.environ, TORCH_CPP_LOG_LEVEL=os.environ.get("TORCH_CPP_LOG_LEVEL", "ERROR"))
    with open(os.path.join(directory, "cluster.log"), "wb") as out:
        print(f"# {name}: {shlex.join(cmd)}", flush=True)
        code = subprocess.run(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, check=False).returncode
    logs = {}
    for entry in sorted(os.listdir(directory)):
        if entry.startswith("node") and entry.endswith(".jsonl"):
            node, attempt = entry[len("node"):-len(".jsonl")].split(".attempt")
            logs[(int(node), int(attempt))] = read_jsonl(os.path.join(directory, entry))
    rec = run_record(name, SCENARIOS[name][0], read_jsonl(events_path), logs, args.steps)
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
          "committed sync; held-out: worker 0's global model after finalize()")
    print(f"{'run':<12}{'lost':>5}{'stall s':>9}{'max st s':>9}{'rejoin s':>9}{'join s':>8}{'recov MB':>9}"
          f"{'xfer s':>7}{'ettr':>6}{'held-out':>9}{'no-fault':>9}{'vs':>8}{'surv rst':>9}", flush=True)


def _row(r: dict) -> None:
    def f(v, fmt: str, scale: float = 1.0) -> str:
        return "-" if v is None else format(v * scale if scale != 1.0 else v, fmt)

    exit_note = f"  (cluster exit {r['cluster_exit']})" if r.get("cluster_exit") else ""
    vs = (f"{100 * (r['held_out_loss'] / r['no_fault_held_out_loss'] - 1):+.2f}%"
          if r["held_out_loss"] and r["no_fault_held_out_loss"] else "-")
    print(f"{r['run']:<12}{f(r['steps_lost'], 'd'):>5}{f(r['seconds_to_first_commit'], '.2f'):>9}"
          f"{f(r['max_stall_s'], '.2f'):>9}{f(r['seconds_to_rejoin'], '.2f'):>9}{f(r['join_seconds'], '.2f'):>8}"
          f"{f(r['recovery_bytes'], '.2f', 1 / 2**20):>9}{f(r.get('transfer_seconds'), '.2f'):>7}"
          f"{f(r['ettr'], '.2f'):>6}{f(r['held_out_loss'], '.4f'):>9}"
          f"{f(r['no_fault_held_out_loss'], '.4f'):>9}{vs:>8}{f(r['survivor_restarts'], 'd'):>9}"
          f"{'' if r['exit_ok'] else '  (a survivor did not finish)'}{exit_note}", flush=True)


def _worker(args) -> int:
    """One node's rank: its own world of one rank, elastic DiLoCo, a JSON line per step."""
    import torch
    import torch.distributed as dist
    from torch import nn

    from commopt.comm.compression import QuantizeCompressor
    from commopt.schedules import DiLoCo

    from .cluster.progress import report_step
    from .diloco import _VOCAB, _held_out
    from .models import GPT, synthetic_tokens

    node = int(os.environ["COMMOPT_REPLICA_ID"])
    attempt = int(os.environ.get("COMMOPT_RESTART", "0") or 0)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    model = GPT(_VOCAB, args.d_model, args.layers, 4, args.seq_len, seed=0)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr)
    log = open(os.path.join(args.log_dir, f"node{node}.attempt{attempt}.jsonl"), "a", encoding="utf-8")

    def write(**fields) -> None:
        log.write(json.dumps(fields) + "\n")
        log.flush()

    dl = DiLoCo(model, opt, sync_every=args.sync_every, compressor=QuantizeCompressor(8) if args.codec == "int8"
                else None, elastic=True, min_workers=2, timeout=60.0)
    if dl.elastic.joined is not None:  # a restarted worker: admitted at the running job's outer sync
        write(event="joined", time=time.time(), joined=list(dl.elastic.joined), steps=dl.steps)
    write(event="begin", time=time.time(), steps=dl.steps)
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
        write(step=dl.steps, time=time.time(), synced=dl.steps % args.sync_every == 0, redone=dl.elastic.redone)
    steps = dl.steps
    held_out = _held_out({"diloco": dl, "model": model}, args)
    write(event="final", time=time.time(), steps=steps, trained=trained, redone=dl.elastic.redone,
          recovery_bytes=dl.elastic.recovery_bytes, joined=list(dl.elastic.joined) if dl.elastic.joined else None,
          transfer_seconds=dl.elastic.transfer_seconds,
          held_out_loss=held_out if node == 0 else None)
    log.close()
    dl.close()
    dist.destroy_process_group()
    return 0
