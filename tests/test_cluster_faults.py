"""Faults in the emulated cluster: ``--elastic``, ``--fault``, ``--restart``, ``--coordinator``, ``--events``.

docs/faults.md row 42 (a node of the emulated cluster is killed, stopped, or its link goes down). The
ranks are tiny Python loops (no training): they print what they saw with their own wall clock, and the
oracles are that output, the launcher's events file (the same clock) and ``/proc``. Tests marked
``netns`` build real namespaces and skip without root/CAP_NET_ADMIN/CAP_SYS_ADMIN or iproute2; every
launcher runs under a timeout so that nothing hangs. No assertion is on a duration, only on order
and on what happened inside a fault's window.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import uuid

import pytest
from _netns import finish, needs_netns, rank_lines

from commopt.bench import cluster as cl
from commopt.bench.cluster import faults, progress

__all__: list[str] = []


_TIMEOUT = 90.0
_BASE = ["--nodes", "2", "--link-rate", "200mbit", "--probe-seconds", "0", "--elastic", "--timeout", "60"]


@pytest.fixture
def sweep():
    """After a netns test, remove what dead launchers left, so one failure does not leak namespaces."""
    yield
    cl.cleanup_leftovers(shutil.which("ip") or "ip")


def _run(tmp_path, snippet: str, *args: str, timeout: float = _TIMEOUT) -> tuple[int, str, str, list[dict], str]:
    """Run the launcher with ``snippet`` as every rank; returns (code, stdout, stderr, events, marker).

    Every rank gets a marker argument unique to this run, by which leftover processes are found.
    """
    marker = f"cf-marker-{uuid.uuid4().hex}"
    events = tmp_path / "events.jsonl"
    argv = [sys.executable, "-m", "commopt.bench", "cluster", *_BASE, "--events", str(events), *args,
            "--", sys.executable, "-c", snippet, marker]
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    _, out, err = finish(proc, timeout)
    assert [n for n in cl.list_namespaces() if n.startswith(f"co-{proc.pid:x}-")] == []
    assert _alive_with(marker) == [], "rank processes outlived the launcher"
    lines = events.read_text().splitlines() if events.exists() else []
    return proc.returncode, out, err, [json.loads(line) for line in lines], marker


def _alive_with(marker: str) -> list[int]:
    """Pids of live processes whose command line holds ``marker``."""
    pids = []
    for entry in os.listdir("/proc"):
        if entry.isdigit() and int(entry) != os.getpid():
            try:
                with open(f"/proc/{entry}/cmdline", "rb") as f:
                    if marker.encode() in f.read():
                        pids.append(int(entry))
            except OSError:  # gone meanwhile
                pass
    return pids


def _one(events: list[dict], **match: object) -> dict:
    found = [e for e in events if all(e[k] == v for k, v in match.items())]
    assert len(found) == 1, (match, events)
    return found[0]


# ------------------------------------------------------------------------------------------------
# pure parts (no privileges needed)


def test_fault_and_restart_specs():
    """docs/faults.md row 42: the --fault / --restart grammar, and every malformed spec refused with
    a message naming what is wrong."""
    assert faults.parse_fault("kill:node=2:at=step=80") == faults.Fault("kill", 2, None, 80, None)
    assert faults.parse_fault("stop:node=1:at=5s:for=3") == faults.Fault("stop", 1, 5.0, None, 3.0)
    assert faults.parse_fault("linkdown:node=0:at=0.5s:for=2.5s") == faults.Fault("linkdown", 0, 0.5, None, 2.5)
    assert faults.parse_restart("node=2:after=10") == faults.Restart(2, 10.0)
    assert faults.parse_restart("node=0:after=0.5s") == faults.Restart(0, 0.5)
    for bad, needle in [("reboot:node=1:at=1s", "unknown kind 'reboot'"), ("kill:node=1", "at= missing"),
                        ("kill:at=1s", "node= missing"), ("kill:node=1:at=5", "at='5'"),
                        ("kill:node=1:at=step=x", "at=step='x'"), ("kill:node=-1:at=1s", "node='-1'"),
                        ("kill:node=1:at=1s:for=2", "a kill cannot be undone"),
                        ("stop:node=1:at=1s:for=0", "for=0 must be > 0"),
                        ("stop:node=1:at=1s:at=2s", "at= given twice"), ("stop:node=1:at=1s:when=3", "'when=3'")]:
        with pytest.raises(ValueError, match=None) as info:
            faults.parse_fault(bad)
        assert needle in str(info.value) and bad in str(info.value), (bad, str(info.value))
    with pytest.raises(ValueError, match="after= missing"):
        faults.parse_restart("node=1")
    kill1 = faults.parse_fault("kill:node=1:at=1s")
    faults.check_plan([kill1], [faults.Restart(1, 1.0)], nodes=2)
    with pytest.raises(ValueError, match=r"node=9 does not exist: the cluster has --nodes 2"):
        faults.check_plan([faults.parse_fault("kill:node=9:at=1s")], [], nodes=2)
    with pytest.raises(ValueError, match="no --fault hits node 0"):
        faults.check_plan([kill1], [faults.Restart(0, 1.0)], nodes=2)
    with pytest.raises(ValueError, match="given twice"):
        faults.check_plan([kill1], [faults.Restart(1, 1.0), faults.Restart(1, 2.0)], nodes=2)


def test_elastic_environments_one_world_per_node():
    """--elastic: each node is its own world as under one torchrun per node (RANK = LOCAL_RANK, the
    node's loopback as master, one node in COMMOPT_NODES), with its replica id, the coordinator and the
    step directory; an outer launcher's COMMOPT_RESTART / COMMOPT_REPLICA_ID never leak in."""
    layout = cl.place_ranks(3, 2)
    base = {"PATH": "/bin", "COMMOPT_RESTART": "4", "COMMOPT_REPLICA_ID": "7", "COMMOPT_COORDINATOR": "stale:1"}
    envs = cl.rank_environments(layout, base, master_addr="10.77.0.1", master_port=29500,
                                ifnames=["cn0", "cn1", "cn2"], link_rate_bps=10**8, coordinator="10.77.0.253:29700",
                                elastic=True, step_dir="/tmp/steps")
    for rank, env in enumerate(envs):
        node, local = divmod(rank, 2)
        assert (env["RANK"], env["LOCAL_RANK"], env["WORLD_SIZE"], env["LOCAL_WORLD_SIZE"]) == (str(local),
                                                                                                str(local), "2", "2")
        assert (env["MASTER_ADDR"], env["MASTER_PORT"], env["COMMOPT_NODES"]) == ("127.0.0.1", "29500", "0,1")
        assert (env["COMMOPT_REPLICA_ID"], env["COMMOPT_NUM_REPLICAS"]) == (str(node), "3")
        assert env["GLOO_SOCKET_IFNAME"] == f"cn{node}" and env["COMMOPT_COORDINATOR"] == "10.77.0.253:29700"
        assert env["COMMOPT_STEP_DIR"] == "/tmp/steps" and "COMMOPT_RESTART" not in env
    plain = cl.rank_environments(layout, base, master_addr="10.77.0.1", master_port=29500,
                                 ifnames=["cn0", "cn1", "cn2"], link_rate_bps=10**8)
    for key in ("COMMOPT_RESTART", "COMMOPT_REPLICA_ID", "COMMOPT_COORDINATOR", "COMMOPT_STEP_DIR"):
        assert all(key not in env for env in plain), key
    assert [env["RANK"] for env in plain] == [str(r) for r in range(6)]


def test_report_step_in_both_launch_modes(tmp_path, monkeypatch):
    """report_step writes <dir>/node<I>.rank<local> atomically, I from COMMOPT_REPLICA_ID (--elastic)
    or from the node of RANK in COMMOPT_NODES (one world, interleaved here); without COMMOPT_STEP_DIR
    it writes nothing; a rank it cannot place is a clear error."""
    for var in ("COMMOPT_STEP_DIR", "COMMOPT_REPLICA_ID", "COMMOPT_NODES", "RANK", "LOCAL_RANK"):
        monkeypatch.delenv(var, raising=False)
    progress.report_step(3)  # no directory: nothing, no error
    monkeypatch.setenv("COMMOPT_STEP_DIR", str(tmp_path))
    monkeypatch.setenv("COMMOPT_REPLICA_ID", "2")
    monkeypatch.setenv("LOCAL_RANK", "1")
    progress.report_step(7)
    progress.report_step(8)
    assert sorted(os.listdir(tmp_path)) == ["node2.rank1"] and (tmp_path / "node2.rank1").read_text() == "8"
    monkeypatch.delenv("COMMOPT_REPLICA_ID")
    monkeypatch.setenv("COMMOPT_NODES", "0,2;1,3")
    monkeypatch.setenv("RANK", "3")
    progress.report_step(5)
    assert (tmp_path / "node1.rank1").read_text() == "5"
    monkeypatch.setenv("RANK", "4")
    with pytest.raises(ValueError, match="RANK=4 is in no node"):
        progress.report_step(1)
    monkeypatch.delenv("LOCAL_RANK")
    with pytest.raises(ValueError, match="COMMOPT_STEP_DIR is set"):
        progress.report_step(1)


@pytest.mark.parametrize("args, needle", [
    (["--elastic", "--fault", "kill:node=9:at=1s"], "node=9 does not exist"),
    (["--elastic", "--fault", "explode:node=1:at=1s"], "unknown kind 'explode'"),
    (["--fault", "kill:node=1:at=1s"], "--fault needs --elastic"),
    (["--restart", "node=1:after=1"], "--restart needs --elastic"),
    (["--min-replicas", "2"], "add --coordinator"),
    (["--elastic", "--min-replicas", "3"], "--min-replicas (3)"),
    (["--elastic", "--placement", "interleaved"], "drop --placement interleaved"),
])
def test_usage_errors(args, needle, capsys):
    """docs/faults.md row 42: a fault on a node that does not exist, an unknown kind, faults without
    --elastic (where the first death kills everyone), coordinator options without a coordinator:
    exit 2 naming the problem, before anything is built."""
    code = cl.main(["--nodes", "2", *args, "--", "true"])
    err = capsys.readouterr().err
    assert code == 2, err
    assert needle in err and "error:" in err


# ------------------------------------------------------------------------------------------------
# in the cluster

_STEPS = """
import os, sys, time
from commopt.bench.cluster.progress import report_step
node, restart = int(os.environ["COMMOPT_REPLICA_ID"]), os.environ.get("COMMOPT_RESTART")
print("env", restart, os.environ["COMMOPT_STEP_DIR"], flush=True)
steps = {SURVIVOR_STEPS} if node == 0 else ({RESTARTED_STEPS} if restart else {NODE1_STEPS})
for k in range(steps):
    print("step", k, repr(time.time()), flush=True)
    report_step(k)
    time.sleep(0.05)
sys.exit({SURVIVOR_CODE} if node == 0 else 0)
"""


def _steps(lines: list[str]) -> list[tuple[int, float]]:
    return [(int(p[1]), float(p[2])) for p in (line.split() for line in lines) if p[0] == "step"]


@pytest.mark.netns
@needs_netns
def test_kill_at_step_restart_and_events(tmp_path, sweep):
    """docs/faults.md row 42 (kill, restart): node 1 is SIGKILLed the moment it reports step 10, the
    survivor runs on and exits 0, node 1 comes back 0.5 s later with COMMOPT_RESTART=1 and exits 0, the
    launcher returns 0; the events file has fault < exit (SIGKILL) < restart < exit in time; the step
    directory is gone and no rank process outlives the launcher."""
    snippet = _STEPS.format(SURVIVOR_STEPS=30, NODE1_STEPS=400, RESTARTED_STEPS=5, SURVIVOR_CODE=0)
    code, out, err, events, _ = _run(tmp_path, snippet, "--fault", "kill:node=1:at=step=10",
                                     "--restart", "node=1:after=0.5")
    assert code == 0, err
    lines = rank_lines(out)
    starts = [i for i, line in enumerate(lines[1]) if line.startswith("env ")]
    assert len(starts) == 2, lines[1]  # the first process and the restarted one
    first, restarted = lines[1][:starts[1]], lines[1][starts[1]:]
    assert restarted[0].split()[1] == "1" and first[0].split()[1] == "None"  # COMMOPT_RESTART
    killed_at = _steps(first)[-1][0]
    assert 10 <= killed_at < 20, first  # 20 steps = 1 s of slack for the launcher's 10 ms poll
    assert [k for k, _ in _steps(restarted)] == list(range(5))
    assert [k for k, _ in _steps(lines[0])] == list(range(30))  # the survivor was not touched
    assert not os.path.exists(first[0].split()[2])  # COMMOPT_STEP_DIR removed at teardown
    fault = _one(events, event="fault")
    assert (fault["node"], fault["kind"], fault["ranks"]) == (1, "kill", [1]) and 10 <= fault["step"] <= killed_at
    killed = _one(events, event="exit", rank=1, code=137)
    assert killed["kind"] == "SIGKILL"
    restart = _one(events, event="restart")
    assert restart["node"] == 1 and restart["ranks"] == [1]
    back = _one(events, event="exit", rank=1, code=0)
    survivor = _one(events, event="exit", rank=0)
    assert survivor["code"] == 0
    assert fault["time"] <= killed["time"] <= restart["time"] <= back["time"]
    assert restart["time"] - fault["time"] >= 0.5  # --restart after=0.5: not before
    assert [e["time"] for e in events] == sorted(e["time"] for e in events)
    assert [e["t"] for e in events] == sorted(e["t"] for e in events)
    assert _steps(first)[-1][1] <= fault["time"] + 0.05  # nothing ran after the signal (one step's sleep)
    assert "fault kill node 1 (step" in err and "restart node 1 (attempt 1)" in err
    assert "rank 1 exited with SIGKILL" in err


@pytest.mark.netns
@needs_netns
def test_stop_for_pauses_then_continues(tmp_path, sweep):
    """docs/faults.md row 42 (stop): node 1 SIGSTOPped at step 10 for 1 s makes no step while stopped
    and then finishes; node 0 steps meanwhile and its own failure (code 3) neither stops node 1 nor is
    hidden: the launcher returns 3, since node 0 was no fault's target."""
    snippet = _STEPS.format(SURVIVOR_STEPS=30, NODE1_STEPS=30, RESTARTED_STEPS=0, SURVIVOR_CODE=3)
    code, out, err, events, _ = _run(tmp_path, snippet, "--fault", "stop:node=1:at=step=10:for=1")
    assert code == 3, err
    fault, cont = _one(events, event="fault"), _one(events, event="cont")
    assert (fault["kind"], fault["node"]) == ("stop", 1) and cont["node"] == 1
    assert cont["time"] - fault["time"] >= 1.0
    stopped = _steps(rank_lines(out)[1])
    assert [k for k, _ in stopped] == list(range(30))  # it went on to the end after SIGCONT
    inside = [k for k, t in stopped if fault["time"] < t < cont["time"]]
    assert len(inside) <= 1, inside  # at most the step whose clock was read as the signal went
    survivor = [k for k, t in _steps(rank_lines(out)[0]) if fault["time"] < t < cont["time"]]
    assert len(survivor) >= 3  # node 0 was not stopped
    assert _one(events, event="exit", rank=0)["code"] == 3 and _one(events, event="exit", rank=1)["code"] == 0
    assert _one(events, event="exit", rank=0)["time"] < _one(events, event="exit", rank=1)["time"]


_LINK = """
import json, os, socket, time
from commopt.bench.cluster.progress import report_step
server = ("10.77.0.1", 29800)
if os.environ["COMMOPT_REPLICA_ID"] == "0":
    srv = socket.create_server(server)
    srv.settimeout(30)
    while True:
        c, _ = srv.accept()
        if c.recv(3) == b"bye":
            break
        c.close()
else:
    own = socket.create_server(("10.77.0.2", 29800))  # this node's fabric address, as gloo binds it
    seen = []
    for k in range(400):
        t0 = time.time()
        try:
            socket.create_connection(server, timeout=0.5).close()
            ok = True
        except OSError:
            ok = False
        try:
            socket.create_connection(("10.77.0.2", 29800), timeout=0.5).close()
            own.accept()[0].close()
            self_ok = True
        except OSError:
            self_ok = False
        print(json.dumps({"start": t0, "end": time.time(), "ok": ok, "self_ok": self_ok}), flush=True)
        if ok or seen:  # node 0's server is up
            seen.append(ok)
            report_step(len(seen))
        if False in seen and seen[-2:] == [True, True]:
            break
        time.sleep(0.05)
    socket.create_connection(server, timeout=5).sendall(b"bye")
"""


@pytest.mark.netns
@needs_netns
def test_linkdown_cuts_the_node_off_then_restores_it(tmp_path, sweep):
    """docs/faults.md row 42 (linkdown): node 1's connects to node 0 succeed before its link goes down
    (at its 5th connect), every connect made while it is down fails, and they succeed again after the
    link is back up, while connects inside node 1 to its own fabric address (where gloo binds its
    intra-node pairs) work throughout, as a node's internal links do when its cable is pulled; both
    ranks exit 0."""
    code, out, err, events, _ = _run(tmp_path, _LINK, "--fault", "linkdown:node=1:at=step=5:for=1")
    assert code == 0, err
    down, up = _one(events, event="fault"), _one(events, event="link_up")
    assert (down["kind"], down["node"], up["node"]) == ("linkdown", 1, 1)
    tries = [json.loads(line) for line in rank_lines(out)[1]]
    tries = tries[[t["ok"] for t in tries].index(True):]  # from the first connect that found the server up
    before = [t["ok"] for t in tries if t["end"] < down["time"]]
    assert len(before) >= 5 and all(before)
    while_down = [t["ok"] for t in tries if t["start"] > down["time"] and t["end"] < up["time"] - 0.2]
    assert len(while_down) >= 3 and not any(while_down)  # 0.2 s: the link came up while `ip` ran
    assert all(t["self_ok"] for t in tries)
    after = [t["ok"] for t in tries if t["start"] > up["time"]]
    assert after and after[-1]  # restored: the last connect, one or more after the link came up (the load decides)
    assert _one(events, event="exit", rank=0)["code"] == 0


_COORD = """
import json, os
import torch, torch.distributed as dist
from commopt.comm.elastic import Membership
from commopt.comm.elastic.replicas import node_member_id
dist.init_process_group("gloo")
t = torch.tensor([float(dist.get_rank() + 1)])
dist.all_reduce(t)
report = {"world": dist.get_world_size(), "sum": t.item(),
          "env": {k: os.environ.get(k) for k in ("RANK", "COMMOPT_COORDINATOR", "COMMOPT_REPLICA_ID",
                                                 "COMMOPT_NUM_REPLICAS", "MASTER_ADDR", "COMMOPT_NODES",
                                                 "GLOO_SOCKET_IFNAME")}}
m = Membership.from_env(node_member_id(dist.get_world_size(), dist.get_rank()), heartbeat_interval=0.2, timeout=5)
report["generation"] = m.wait_for_generation(timeout=30)
report["members"] = list(m.members)
dist.barrier()
m.close()
print(json.dumps(report), flush=True)
dist.destroy_process_group()
"""


@pytest.mark.netns
@needs_netns
def test_coordinator_reachable_one_world_per_node(tmp_path, sweep):
    """--elastic 2x2: every rank has the coordinator's address and joins it as member node * 2 + rank; each
    gets a generation >= 1 holding all four (the coordinator waits for --initial-replicas = --nodes = 2
    nodes, times the 2 ranks of each); each node
    is a world of 2 (an all-reduce of rank + 1 gives 1 + 2 = 3, not the 10 of one world of 4); the
    coordinator's output is prefixed and it is gone after the run."""
    code, out, err, _, _ = _run(tmp_path, _COORD, "--ranks-per-node", "2", "--heartbeat-timeout", "5")
    assert code == 0, err
    reports = {r: json.loads(lines[-1]) for r, lines in rank_lines(out).items()}
    assert sorted(reports) == [0, 1, 2, 3]
    for rank, rep in reports.items():
        node, local = divmod(rank, 2)
        assert rep["world"] == 2 and rep["sum"] == 3.0, rep
        assert rep["env"] == {"RANK": str(local), "COMMOPT_COORDINATOR": "10.77.0.253:29700",
                              "COMMOPT_REPLICA_ID": str(node), "COMMOPT_NUM_REPLICAS": "2",
                              "MASTER_ADDR": "127.0.0.1", "COMMOPT_NODES": "0,1", "GLOO_SOCKET_IFNAME": f"cn{node}"}
        assert rep["generation"] >= 1 and rep["members"] == [0, 1, 2, 3], rep
    started = next(json.loads(line.partition("] ")[2]) for line in err.splitlines()
                   if line.startswith("[coordinator] {") and '"address"' in line)
    assert started["address"] == "10.77.0.253:29700"
    assert not os.path.exists(f"/proc/{started['pid']}")
