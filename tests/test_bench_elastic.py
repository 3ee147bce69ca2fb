"""``commopt-bench elastic``'s record computation and options, and the pieces of its torchft runs (the runs
themselves are a benchmark, recorded in docs/results.md, not a test). The oracles are arithmetic on
hand-made events and logs, the cluster's own ``--fault`` / ``--restart`` parsers, torchft's own Lighthouse
client, and, in the one ``netns`` test (a tiny torchft run in the cluster, about 10 s), DiLoCo done by hand
in plain torch."""

from __future__ import annotations

import json
import shutil
import statistics

import pytest
from _netns import needs_netns

from commopt.bench import elastic
from commopt.bench.cluster.faults import parse_fault, parse_restart

T0 = 1_000_000.0
STEP = 0.1  # every worker's normal step
FAULT_AT = T0 + 2.05  # during step 21 of every worker
RESTART_AT = FAULT_AT + 10.0


def _steps(first: int, last: int, start: float, slow: dict[int, float] | None = None) -> list[dict]:
    """Step lines ``first..last`` ending every STEP seconds after ``start``, step s ``slow[s]`` longer."""
    out, t = [], start
    for s in range(first, last + 1):
        t += STEP + (slow or {}).get(s, 0.0)
        out.append({"step": s, "time": t, "synced": s % 8 == 0, "redone": 0})
    return out


def _final(steps: int, trained: int, **extra) -> dict:
    return {"event": "final", "time": 0.0, "steps": steps, "trained": trained, "redone": 0, "recovery_bytes": 0,
            "joined": None, "held_out_loss": None, **extra}


def _job() -> tuple[list[dict], dict]:
    """40 steps, H 8: node 2 killed during step 21, restarted 10 s later and admitted at a sync; node 1
    stalls 3 s on step 24 (the sync after the fault), node 3 0.5 s on step 22, node 0 redid 4 steps."""
    events = [{"time": T0, "event": "start", "node": n} for n in range(4)]
    events += [{"time": FAULT_AT, "event": "fault", "node": 2, "kind": "kill"},
               {"time": RESTART_AT, "event": "restart", "node": 2}]
    logs = {
        (0, 0): [{"event": "begin", "time": T0}, *_steps(1, 40, T0),
                 _final(40, 44, held_out_loss=2.5)],
        (1, 0): [{"event": "begin", "time": T0}, *_steps(1, 40, T0, {24: 3.0}), _final(40, 40)],
        (3, 0): [{"event": "begin", "time": T0}, *_steps(1, 40, T0, {22: 0.5}), _final(40, 40)],
        (2, 0): [{"event": "begin", "time": T0}, *_steps(1, 20, T0)],  # killed in step 21
        (2, 1): [{"event": "joined", "time": RESTART_AT + 2.5, "joined": [5, 2.0], "steps": 32},
                 {"event": "begin", "time": RESTART_AT + 2.5}, *_steps(33, 40, RESTART_AT + 2.5),
                 _final(40, 8, recovery_bytes=123_456, joined=[5, 2.0])],
    }
    return events, logs


def test_record_from_events_and_logs():
    """Each figure of a run's record against the arithmetic of a hand-made job: the stall beyond the
    normal step, the longest stall, the rejoin, the joiner's bytes, the steps lost, the ETTR."""
    events, logs = _job()
    rec = elastic.run_record("kill80", "kill", events, logs, 40, no_fault_loss=2.4)
    assert set(elastic.FIELDS) <= set(rec)
    assert rec["run"] == "kill80" and rec["fault"] == "kill" and rec["no_fault_held_out_loss"] == 2.4
    # the first step after the fault ends at T0 + 2.1 (+0.5 on node 3, whose step 22 is slow: still its
    # step 21 that ends first, at T0 + 2.1): 0.05 s after the fault, within the normal step -> 0
    assert rec["seconds_to_first_commit"] == pytest.approx(0.0)
    # node 1's step 24 took 3.1 s, 3.0 beyond its median step
    assert rec["max_stall_s"] == pytest.approx(3.0)
    assert rec["seconds_to_rejoin"] == pytest.approx(2.5)
    assert rec["join_seconds"] == pytest.approx(2.0)
    assert rec["recovery_bytes"] == 123_456
    assert rec["steps_lost"] == 4  # node 0 trained 44 inner steps for 40 counted
    assert rec["held_out_loss"] == 2.5
    assert rec["survivor_restarts"] == 0
    assert rec["exit_ok"] is True
    # ETTR: median step 0.1 on every node; committed steps 40 (x3) + 16 (node 2 to its sync at 16) + 8 (joiner)
    end = max(lines[-2]["time"] for lines in logs.values())
    assert rec["ettr"] == pytest.approx(STEP * (3 * 40 + 16 + 8) / (4 * (end - T0)))


def test_record_stall_beyond_the_normal_step():
    """A survivor whose first step after the fault ends 1.5 s after it, on a 0.1 s step, stalled 1.4 s;
    the largest survivor's stall is the run's."""
    events, logs = _job()
    logs[(3, 0)] = [{"event": "begin", "time": T0}, *_steps(1, 40, T0, {21: 1.45}), _final(40, 40)]
    rec = elastic.run_record("kill96", "kill", events, logs, 40)
    end_of_21 = T0 + 21 * STEP + 1.45
    med = statistics.median([STEP] * 38 + [STEP + 1.45])
    assert rec["seconds_to_first_commit"] == pytest.approx(end_of_21 - FAULT_AT - med)
    assert rec["seconds_to_first_commit"] == pytest.approx(1.4)


def test_record_survivor_restart_and_unfinished_survivor():
    """A restart of a node no fault hit is counted; a survivor without its final line fails the run."""
    events, logs = _job()
    events.append({"time": RESTART_AT, "event": "restart", "node": 1})
    logs[(1, 0)] = logs[(1, 0)][:-1]
    rec = elastic.run_record("kill80", "kill", events, logs, 40)
    assert rec["survivor_restarts"] == 1
    assert rec["exit_ok"] is False
    assert rec["steps_lost"] is None


def test_record_without_fault():
    """No fault: no stall, no rejoin, no recovery; steps lost and ETTR still measured."""
    logs = {(n, 0): [{"event": "begin", "time": T0}, *_steps(1, 40, T0), _final(40, 40)] for n in range(4)}
    rec = elastic.run_record("no-fault", None, [], logs, 40)
    assert rec["seconds_to_first_commit"] is None and rec["seconds_to_rejoin"] is None
    assert rec["recovery_bytes"] is None and rec["steps_lost"] == 0
    assert rec["ettr"] == pytest.approx(1.0)


def test_scenario_flags_are_the_clusters_options():
    """Each scenario's options, read back by the cluster's own parsers: the fault on node 2 at step
    2.5 H (between syncs) or 3 H (the outer sync), the restart 10 s later."""
    assert elastic.scenario_flags("no-fault", 32) == []
    for name, kind, step in (("kill80", "kill", 80), ("kill96", "kill", 96), ("stop80", "stop", 80),
                             ("linkdown80", "linkdown", 80)):
        flags = elastic.scenario_flags(name, 32)
        assert flags[0] == "--fault" and flags[2] == "--restart"
        fault = parse_fault(flags[1])
        assert (fault.kind, fault.node, fault.at_step, fault.duration) == (kind, 2, step, None)
        restart = parse_restart(flags[3])
        assert (restart.node, restart.after) == (2, 10.0)
    assert parse_fault(elastic.scenario_flags("kill96", 8)[1]).at_step == 24
    with pytest.raises(ValueError, match="unknown scenario 'kill7'"):
        elastic.scenario_flags("kill7", 32)


def test_bad_options_stop_before_any_cluster(capsys):
    """Too few steps for the faults, or an unknown scenario: exit 2 with the reason, nothing started."""
    assert elastic.main(["--steps", "96", "--sync-every", "32"]) == 2
    assert "more than 3 x --sync-every" in capsys.readouterr().err
    assert elastic.main(["--scenarios", "no-fault,reboot"]) == 2
    assert "unknown scenario 'reboot'" in capsys.readouterr().err


def test_read_jsonl_skips_a_line_cut_by_a_kill(tmp_path):
    """A worker SIGKILLed mid-write leaves half a line: it is skipped; a missing log is empty."""
    path = tmp_path / "node2.attempt0.jsonl"
    path.write_text('{"step": 1, "time": 1.0}\n{"step": 2, "ti', encoding="utf-8")
    assert elastic.read_jsonl(str(path)) == [{"step": 1, "time": 1.0}]
    assert elastic.read_jsonl(str(tmp_path / "absent.jsonl")) == []


# ------------------------------------------------------------------------------------------------
# the static baseline, torchft's runs and the no-fault overhead


def _with_link(logs: dict, per_step: dict[int, int]) -> dict:
    """``logs`` with each survivor's final line given ``link_bytes`` = ``per_step[node]`` x its steps trained."""
    for (node, _attempt), lines in logs.items():
        if lines and lines[-1].get("event") == "final" and node in per_step:
            lines[-1]["link_bytes"] = per_step[node] * lines[-1]["trained"]
    return logs


def test_record_step_time_and_link_bytes():
    """``step_s``: the median over the survivors of their median step; ``mean_step_s``: the median over them
    of (last step - begin) / steps (node 1's 3 s sync counts there, not in the median step);
    ``link_bytes_per_step``: the mean over the survivors of their link bytes over their steps trained."""
    events, logs = _job()
    _with_link(logs, {0: 1000, 1: 2000, 3: 6000, 2: 10**9})  # node 2 (faulted) does not count
    rec = elastic.run_record("kill80", "kill", events, logs, 40)
    assert rec["step_s"] == pytest.approx(STEP)
    means = sorted((logs[k][-2]["time"] - T0) / 40 for k in ((0, 0), (1, 0), (3, 0)))
    assert rec["mean_step_s"] == pytest.approx(means[1])
    assert means[1] == pytest.approx(STEP + 0.5 / 40)  # node 3: 40 steps of 0.1 s and one 0.5 s longer
    assert rec["link_bytes_per_step"] == pytest.approx(3000.0)


def _line(step: int, t: float, synced: bool = False, discarded: bool = False) -> dict:
    return {"step": step, "time": t, "synced": synced, "redone": 0, "discarded": discarded}


def _counter(steps: list[int], start: float, syncs: dict[int, tuple[bool, float]]) -> list[dict]:
    """A torchft worker's step lines: the step counter after each inner step, STEP apart; ``syncs[i]`` =
    (committed, extra seconds) for the i-th line that ends a round."""
    out, t = [], start
    for i, s in enumerate(steps):
        committed, extra = syncs.get(i, (False, 0.0))
        t += STEP + extra
        out.append(_line(s, t, synced=committed, discarded=i in syncs and not committed))
    return out


def _torchft_job() -> tuple[list[dict], dict]:
    """torchft's DiLoCo, H 8, 40 steps: node 2 killed inside the outer sync of step 24. Nodes 1 and 3 throw
    that round away (their counter falls back to 16) and train it again; node 0 throws it away too, is left
    out of the redone round's quorum and heals from a peer at its next sync (its redone round replaced);
    node 2, restarted, trains a first round of its own, then heals at the last sync."""
    events = [{"time": T0, "event": "start", "node": n} for n in range(4)]
    fault = T0 + 24 * STEP + 0.01
    events += [{"time": fault, "event": "fault", "node": 2, "kind": "kill"},
               {"time": fault + 10.0, "event": "restart", "node": 2}]
    survivor = [*range(1, 24), 16, *range(17, 41)]  # 24 lines, the discarded sync, then 17..40
    syncs = {7: (True, 0.0), 15: (True, 0.0), 23: (False, 0.2), 31: (True, 0.0), 39: (True, 0.0), 47: (True, 0.0)}
    node0 = [*range(1, 24), 16, *range(17, 24), 32, *range(33, 41)]  # its redo of 17..24 replaced by the heal
    syncs0 = {**syncs, 23: (False, 4.0), 31: (True, 0.0)}
    logs = {
        (0, 0): [{"event": "begin", "time": T0}, *_counter(node0, T0, syncs0),
                 {**_final(40, 48, held_out_loss=2.5), "committed": 32, "healed": 1}],
        (1, 0): [{"event": "begin", "time": T0}, *_counter(survivor, T0, syncs), {**_final(40, 48), "committed": 40}],
        (3, 0): [{"event": "begin", "time": T0}, *_counter(survivor, T0, syncs), {**_final(40, 48), "committed": 40}],
        (2, 0): [{"event": "begin", "time": T0}, *_counter(list(range(1, 24)), T0, {7: (True, 0.0), 15: (True, 0.0)})],
    }
    begin = fault + 13.0
    joiner = _counter([*range(1, 8), 40], begin, {7: (True, 0.0)})
    logs[2, 1] = [{"event": "begin", "time": begin}, *joiner,
                  {**_final(40, 8, recovery_bytes=4096, joined=[None, 0.8]), "committed": 0, "healed": 1}]
    return events, logs


def test_record_of_torchft_rounds_thrown_away():
    """torchft's record (its step counter falls back by H when a round is thrown away, jumps when a replica
    heals): steps lost are the inner steps a survivor trained that no committed outer step kept (trained -
    committed: 8 + 16 + 8), the ETTR counts only those kept, the rejoin ends at the joiner's first commit."""
    events, logs = _torchft_job()
    rec = elastic.run_record("torchft-kill96", "kill", events, logs, 40)
    assert rec["exit_ok"] is True and rec["errors"] == {}
    assert rec["steps_lost"] == (48 - 32) + (48 - 40) + (48 - 40)
    fault = events[4]["time"]
    # node 0's first step after the fault is its failed sync, 4 s longer than a step (its round thrown away):
    # the largest stall and the longest step after the fault
    stall = logs[0, 0][24]["time"] - fault - STEP
    assert stall == pytest.approx(3.89)
    assert rec["seconds_to_first_commit"] == pytest.approx(stall) and rec["max_stall_s"] == pytest.approx(stall)
    assert rec["seconds_to_rejoin"] == pytest.approx(logs[2, 1][8]["time"] - (fault + 10.0))
    assert rec["join_seconds"] == pytest.approx(0.8) and rec["recovery_bytes"] == 4096
    end = max(lines[-2]["time"] for lines in logs.values())
    # kept: 32 (node 0) + 40 + 40 + node 2's 16 before its death (its last committed sync) + 0 (joiner)
    assert rec["ettr"] == pytest.approx(STEP * (32 + 40 + 40 + 16) / (4 * (end - T0)))


def test_record_reports_a_worker_error():
    """A worker that reports an error (a joiner whose quorum never formed: the others had finished) has it
    in the record's ``errors``; a survivor's error fails the run."""
    events, logs = _torchft_job()
    logs[2, 1][-1]["error"] = "TimeoutError: status: Cancelled, message: \"Timeout expired\""
    logs[1, 0][-1].update(steps=32, error="RuntimeError: quorum")
    rec = elastic.run_record("torchft-kill80", "kill", events, logs, 40)
    assert rec["errors"] == {"node2.attempt1": logs[2, 1][-1]["error"], "node1.attempt0": "RuntimeError: quorum"}
    assert rec["exit_ok"] is False


def test_run_names_and_baselines():
    """``static`` (the static DiLoCo, no fault), ``torchft-<scenario>`` and the scenarios; each compared
    with its own implementation's no-fault run; --compare's runs all parse; torchft's scenarios get the
    same cluster options as commopt's, read back by the cluster's parser."""
    assert elastic.parse_run("static") == ("static", "no-fault")
    assert elastic.parse_run("kill96") == ("commopt", "kill96")
    assert elastic.parse_run("torchft-kill96") == ("torchft", "kill96")
    assert elastic.baseline("torchft-kill80") == "torchft-no-fault" and elastic.baseline("torchft-no-fault") is None
    assert elastic.baseline("static") == "no-fault" and elastic.baseline("no-fault") is None
    assert elastic.baseline("linkdown80") == "no-fault"
    assert [elastic.parse_run(n)[0] for n in elastic.COMPARE.split(",")].count("torchft") == 3
    assert elastic.scenario_flags("static", 32) == [] == elastic.scenario_flags("torchft-no-fault", 32)
    assert parse_fault(elastic.scenario_flags("torchft-kill96", 32)[1]).at_step == 96
    for bad in ("torchft-reboot", "torchft-static", "static-kill80", "hsdp-kill80"):
        with pytest.raises(ValueError, match="unknown scenario"):
            elastic.parse_run(bad)
    # the HSDP runs: their own baseline, node 2 killed at step 40 and restarted
    assert elastic.parse_run("hsdp-kill") == ("hsdp", "kill80") and elastic.parse_run("hsdp-no-fault")[0] == "hsdp"
    assert elastic.baseline("hsdp-kill") == "hsdp-no-fault" and elastic.baseline("hsdp-no-fault") is None
    flags = elastic.scenario_flags("hsdp-kill", 32)
    assert parse_fault(flags[1]).at_step == 40 and parse_restart(flags[3]).after == elastic.RESTART_AFTER_S
    assert elastic.scenario_flags("hsdp-no-fault", 32) == []


def test_overhead_against_static():
    """The no-fault overhead: each no-fault run's mean and median step over ``static``'s, and its extra link
    bytes per step; nothing without a static run; a missing figure stays None."""
    def rec(name, mean, median, link):
        return {"run": name, "mean_step_s": mean, "step_s": median, "link_bytes_per_step": link}

    records = [rec("static", 0.200, 0.180, 1_000_000), rec("no-fault", 0.204, 0.18, 1_000_250),
               rec("kill80", 0.3, 0.2, 2e6), rec("torchft-no-fault", 0.21, 0.189, None)]
    over = elastic.overhead(records)
    assert [o["run"] for o in over] == ["no-fault", "torchft-no-fault"]
    assert over[0]["mean_step_ratio"] == pytest.approx(1.02) and over[0]["median_step_ratio"] == pytest.approx(1.0)
    assert over[0]["extra_link_bytes_per_step"] == pytest.approx(250)
    assert over[1]["median_step_ratio"] == pytest.approx(1.05) and over[1]["extra_link_bytes_per_step"] is None
    assert elastic.overhead(records[1:]) == []


def test_torchft_problems_are_reasons_not_rows():
    """Where torchft's runs cannot run, the reason: its quantized outer gradients are CUDA-only, and a run
    ends on a committed outer step; with torchft installed, exact and a whole number of rounds: None."""
    from commopt.bench import _elastic_torchft as tft

    assert "Triton kernels on CUDA" in tft.problem("int8", 192, 32)
    assert "multiple of --sync-every" in tft.problem("none", 200, 32)
    pytest.importorskip("torchft")
    assert tft.problem("none", 192, 32) is None


def test_cluster_coordinator_command_needs_a_coordinator(capsys):
    """``commopt-bench cluster --coordinator-command`` (torchft's Lighthouse in the coordinator's place) is
    a coordinator option: without --coordinator or --elastic, or empty, exit 2 naming the problem, before
    anything is built."""
    from commopt.bench import cluster as cl

    assert cl.main(["--nodes", "2", "--coordinator-command", "python -m x", "--", "true"]) == 2
    assert "--coordinator-command configure the coordinator: add --coordinator" in capsys.readouterr().err
    assert cl.main(["--nodes", "2", "--elastic", "--coordinator-command", " ", "--", "true"]) == 2
    assert "--coordinator-command must name a command" in capsys.readouterr().err


def test_torchft_transport_advertises_the_node_and_counts_what_it_receives():
    """The checkpoint transport of torchft's runs: its address names the given host (not the hostname every
    node of the emulated cluster shares), and a checkpoint sent by one is received by another equal, with
    its tensors' bytes counted (the joiner's recovery_bytes)."""
    pytest.importorskip("torchft")
    from datetime import timedelta

    import torch

    from commopt.bench import _elastic_torchft as tft

    cls = tft._transport_class()
    src, dst = cls("127.0.0.1", timedelta(seconds=10)), cls("127.0.0.1", timedelta(seconds=10))
    try:
        assert src.metadata().startswith("http://127.0.0.1:") and src.metadata().endswith("/checkpoint/")
        state = {"model": {"w": torch.arange(12.0).reshape(3, 4), "b": torch.ones(5, dtype=torch.float64)},
                 "torchft": {"step": 3}}
        src.send_checkpoint([1], 3, state, timedelta(seconds=10))
        got = dst.recv_checkpoint(0, src.metadata(), 3, timedelta(seconds=10))
        for name in ("w", "b"):
            assert torch.equal(got["model"][name], state["model"][name])
        assert got["torchft"] == {"step": 3}
        assert dst.received_bytes == 12 * 4 + 5 * 8 and src.received_bytes == 0
    finally:
        src.shutdown()
        dst.shutdown()


def test_torchft_lighthouse_serves_where_the_cluster_starts_it():
    """The Lighthouse that ``commopt-bench cluster --coordinator-command`` starts with the coordinator's
    options: it prints the address it serves on (the bound port, not the hostname torchft names itself by),
    keeps --min-replicas and --heartbeat-timeout (two replicas together get a quorum from it; once they are
    silent past the timeout, one alone does not: torchft's own client is the oracle), and exits 0 on SIGTERM."""
    pytest.importorskip("torchft")
    import json
    import signal
    import subprocess
    import sys
    import time
    from concurrent.futures import ThreadPoolExecutor
    from datetime import timedelta

    from torchft.coordination import LighthouseClient

    proc = subprocess.Popen([sys.executable, "-m", "commopt.bench._elastic_torchft", "--host", "127.0.0.1",
                             "--port", "0", "--heartbeat-timeout", "1", "--min-replicas", "2",
                             "--initial-replicas", "2", "--job", "commopt"],
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        info = json.loads(proc.stdout.readline())
        assert info["address"].startswith("http://127.0.0.1:") and not info["address"].endswith(":0")
        assert info["min_replicas"] == 2 and info["heartbeat_timeout_ms"] == 1000

        def quorum(replica: str, seconds: float):
            client = LighthouseClient(addr=info["address"], connect_timeout=timedelta(seconds=5))
            return client.quorum(replica_id=replica, timeout=timedelta(seconds=seconds), address=replica,
                                 store_address=f"{replica}:1", step=0, world_size=1, shrink_only=False)

        with ThreadPoolExecutor(2) as pool:
            got = [f.result() for f in [pool.submit(quorum, r, 20.0) for r in ("a", "b")]]
        assert [sorted(m.replica_id for m in q.participants) for q in got] == [["a", "b"], ["a", "b"]]
        time.sleep(1.5)  # a and b silent past the heartbeat timeout: "alone" is the one healthy replica
        with pytest.raises(Exception, match="[Tt]imeout"):  # with --min-replicas 1 it would get a quorum
            quorum("alone", 1.0)
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0


def _plain_diloco_held_out(steps: int, h: int, d_model: int, layers: int, batch: int, seq_len: int,
                           lr: float) -> float:
    """The oracle: DiLoCo by hand in plain torch, 4 workers in turn in one process (each its GPT of seed 0,
    its AdamW and its tokens, the bench's seeds), every H steps the mean pseudo-gradient as the grad of an
    outer Nesterov SGD (lr 0.7, momentum 0.9) on the global weights, which every worker then takes; the
    held-out loss of the final global weights on the bench's held-out batches."""
    import torch
    from torch import nn

    from commopt.bench.diloco import _VOCAB
    from commopt.bench.models import GPT, synthetic_tokens

    def loss(model, data):
        return nn.functional.cross_entropy(model(data[:, :-1]).reshape(-1, _VOCAB), data[:, 1:].reshape(-1))

    workers = [GPT(_VOCAB, d_model, layers, 4, seq_len, seed=0) for _ in range(4)]
    inner = [torch.optim.AdamW(w.parameters(), lr=lr) for w in workers]
    glob = GPT(_VOCAB, d_model, layers, 4, seq_len, seed=0)
    outer = torch.optim.SGD(glob.parameters(), lr=0.7, momentum=0.9, nesterov=True)
    for step in range(1, steps + 1):
        for node, (model, opt) in enumerate(zip(workers, inner)):
            opt.zero_grad(set_to_none=True)
            loss(model, synthetic_tokens(batch, seq_len, _VOCAB, seed=10_000 * step + node)).backward()
            opt.step()
        if step % h == 0:
            with torch.no_grad():
                for g, *ws in zip(glob.parameters(), *(w.parameters() for w in workers)):
                    g.grad = sum(g - w for w in ws) / len(ws)
                outer.step()
                for w in workers:
                    for g, p in zip(glob.parameters(), w.parameters()):
                        p.copy_(g)
    with torch.no_grad():
        return sum(float(loss(glob, synthetic_tokens(batch, seq_len, _VOCAB, seed=99_000_000 + 100 * i)))
                   for i in range(4)) / 4


@pytest.fixture
def sweep():
    """After a netns test, remove what dead launchers left, so one failure does not leak namespaces."""
    yield
    from commopt.bench import cluster as cl

    cl.cleanup_leftovers(shutil.which("ip") or "ip")


@pytest.mark.netns
@needs_netns
def test_torchft_run_in_the_cluster_is_plain_diloco(tmp_path, sweep):
    """``torchft-no-fault`` end to end, tiny (4x1, a 1-layer GPT, H 8, 32 steps): torchft's Lighthouse in
    the coordinator's namespace, a Manager per node over the fabric, every node committing every round
    (no step lost), its node link's bytes counted, and worker 0's held-out loss that of DiLoCo done by
    hand in plain torch on the same tokens (the oracle: :func:`_plain_diloco_held_out`)."""
    pytest.importorskip("torchft")
    opts = dict(steps=32, h=8, d_model=32, layers=1, batch=2, seq_len=16, lr=3e-3)
    out = tmp_path / "run.json"
    code = elastic.main(["--scenarios", "torchft-no-fault", "--steps", "32", "--sync-every", "8", "--d-model", "32",
                         "--layers", "1", "--batch", "2", "--seq-len", "16", "--lr", "0.003", "--run-timeout", "120",
                         "--json", str(out), "--keep", str(tmp_path / "runs")])
    log = (tmp_path / "runs" / "torchft-no-fault" / "cluster.log").read_text(errors="replace")
    assert code == 0, log[-3000:]
    (rec,) = json.loads(out.read_text())["results"]
    assert '"service": "torchft-lighthouse"' in log
    assert rec["exit_ok"] and rec["steps_lost"] == 0 and rec["errors"] == {} and rec["link_bytes_per_step"] > 0
    assert rec["held_out_loss"] == pytest.approx(_plain_diloco_held_out(**opts), rel=1e-6)
