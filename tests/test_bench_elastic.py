"""``commopt-bench elastic``'s record computation and options (no cluster: the runs themselves are a
benchmark, recorded in docs/results.md, not a test). The oracle is arithmetic on hand-made events and
logs, and the cluster's own ``--fault`` / ``--restart`` parsers."""

from __future__ import annotations

import statistics

import pytest

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
