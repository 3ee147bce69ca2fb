"""Elastic DiLoCo (``DiLoCo(elastic=True)``): workers lost and restarted without stopping the others.

Each worker is a process of its own with its own torch.distributed world (tests/_elastic_worker.py), the
coordinator a thread of this process. The oracle is a replay with no failure: worker 2 leaves cleanly
before the sync it would miss and its new process joins at the same sync, so the survivors average over
exactly the same workers in every round; a run where worker 2 is SIGKILLed instead (between syncs, or
inside the outer sync after its reduction and before it reports it) must end bit-identical, on every
worker, the joiner included (docs/faults.md rows 42-43).
"""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest
import torch
from _elastic_node import start_node
from _forked import ForkedScript

from commopt.comm.elastic import Coordinator

WORKER = os.path.join(os.path.dirname(__file__), "_elastic_worker.py")
WORKERS = 3
RESTARTED = 2
# Every fault here is a SIGKILL or a clean leave, which the coordinator sees at once (its liveness
# connection closes); the heartbeat timeout only guards against a live worker starved of the CPU for
# seconds by the suite's load being dropped, which would make a run differ from its replay.
HEARTBEAT = 6.0


def _job(tmp_path, name: str, fault: str, *, gate_out: int = 0, gate_in: int = 20, restart: bool = True,
         codec: str = "int8", min_replicas: int = 2, timeout: float = 120.0, extra: tuple = (),
         dead: tuple = (), workers: int = WORKERS, ranks: int = 1) -> dict:
    """Run the job: ``workers`` workers (of ``ranks`` ranks each), worker 2 with ``fault``, restarted once it
    exited (``restart``); the outputs by worker (by (worker, local rank) where ``ranks`` > 1)."""
    outs = {(r, j): str(tmp_path / f"{name}-{r}.{j}.pt") for r in range(workers) for j in range(ranks)}
    with Coordinator(heartbeat_timeout=HEARTBEAT, min_replicas=min_replicas * ranks,
                     initial_replicas=workers * ranks) as coord:
        def start(r: int, *more: str) -> _Worker:
            return _Worker(start_node(lambda j: [sys.executable, WORKER, coord.address, str(r), outs[(r, j)],
                                                        "--codec", codec, "--gate-out", str(gate_out), "--gate-in",
                                                        str(gate_in), *extra, *more], ranks))

        procs = {r: start(r, "--fault", fault) for r in range(workers)}
        deadline = time.monotonic() + timeout
        logs: dict[int, str] = {}
        try:
            while procs[RESTARTED].poll() is None and time.monotonic() < deadline:
                time.sleep(0.05)
            first = procs[RESTARTED]
            logs[-1] = first.communicate(timeout=5)[0] if first.poll() is not None else ""
            if restart:
                procs[RESTARTED] = start(RESTARTED, "--restarted")
            codes = {}
            for r, p in procs.items():
                try:
                    logs[r] = p.communicate(timeout=max(1.0, deadline - time.monotonic()))[0]
                except subprocess.TimeoutExpired:
                    p.kill()
                    logs[r] = p.communicate()[0]
                codes[r] = p.returncode
        finally:
            for p in procs.values():
                if p.poll() is None:
                    p.kill()
        for r in dead:
            assert codes[r] == -9, f"worker {r} should have died (SIGKILL), exited {codes[r]}"
        for r, code in codes.items():
            if r in dead:
                continue
            assert code == 0, f"worker {r} exited {code}:\n{logs.get(r, '')[-3000:]}\nfirst 2:\n{logs[-1][-2000:]}"
        got = {k: torch.load(path, weights_only=True) for k, path in outs.items()
               if k[0] not in dead and os.path.exists(path)}
        return {r: v for (r, _), v in got.items()} if ranks == 1 else got


class _Worker:
    """A worker's processes (its ranks) as one: it has exited when all have; its code is the first's."""

    def __init__(self, procs: list[ForkedScript]):
        self.procs = procs

    def poll(self):
        codes = [p.poll() for p in self.procs]
        return None if any(c is None for c in codes) else self.procs[0].returncode

    @property
    def returncode(self):
        return self.poll()

    def communicate(self, timeout: float | None = None) -> tuple[str, None]:
        deadline = None if timeout is None else time.monotonic() + timeout
        out = []
        for p in self.procs:
            left = None if deadline is None else max(0.1, deadline - time.monotonic())
            out.append(p.communicate(timeout=left)[0] or "")
        return "\n".join(out), None

    def kill(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.kill()


def _same(a: dict, b: dict, what: str) -> None:
    for n in a["backups"]:
        assert torch.equal(a["backups"][n], b["backups"][n]), f"{what}: global weights {n} differ"
    sa, sb = a["outer"]["state"], b["outer"]["state"]
    for i in sa:
        assert torch.equal(sa[i]["momentum_buffer"], sb[i]["momentum_buffer"]), f"{what}: outer momentum {i} differs"


@pytest.fixture(scope="module")
def replay(tmp_path_factory):
    """Worker 2 leaves cleanly after the sync at step 8 and its new process joins at step 20's sync."""
    return _job(tmp_path_factory.mktemp("replay"), "replay", "leave@10", gate_out=12)


def test_replay_every_worker_holds_the_same_state(replay):
    """After a rejoin the global weights and the outer optimizer are bit-identical on every worker, and
    the joiner's residual was zero when it joined (docs/faults.md rows 42-43)."""
    for r in range(WORKERS):
        _same(replay[0], replay[r], f"worker {r} vs worker 0")
        assert replay[r]["steps"] == 28
    joiner = replay[RESTARTED]["joined"]
    assert joiner["steps"] == 20 and joiner["residual"] == 0.0
    assert replay[RESTARTED]["recovery_bytes"] > 0


@pytest.mark.parametrize("fault", ["kill@10", "commit@12"])
def test_killed_worker_rejoins_bit_identical_to_replay(tmp_path, replay, fault):
    """A worker SIGKILLed between syncs (step 10) or inside the outer sync (step 12, after its reduction,
    before it reports it) and restarted: every worker ends bit-identical to the replay in which it sat
    out the same rounds; the survivors redid the aborted sync and lost no inner step (docs/faults.md
    row 42)."""
    got = _job(tmp_path, fault.replace("@", "-"), fault)
    for r in range(WORKERS):
        _same(replay[r], got[r], f"{fault}: worker {r} vs the replay")
        assert got[r]["steps"] == 28
    if fault.startswith("commit"):
        assert got[0]["redone"] >= 1 and got[1]["redone"] >= 1  # the round of step 12 was redone
    assert got[RESTARTED]["joined"]["residual"] == 0.0
    for r in range(WORKERS):  # DiLoCo.members / .events: what each worker saw at its committed syncs
        assert got[r]["members"] == [0, 1, 2] and got[r]["generation"] == got[0]["generation"]
    for r in (0, 1):
        seen = [(kind, w, step) for kind, w, step, _ in got[r]["events"] if kind != "redone"]
        assert seen == [("lost", RESTARTED, 12), ("joined", RESTARTED, 20)], got[r]["events"]
        if fault.startswith("commit"):  # (a kill between syncs may be found inside the next one, too)
            assert any(kind == "redone" and step == 12 for kind, _, step, _ in got[r]["events"]), got[r]["events"]
    assert [(k, w, s) for k, w, s, _ in got[RESTARTED]["events"]] == [("joined", RESTARTED, 20)]


def test_recovery_source_dies_mid_transfer_joiner_retries_another_peer(tmp_path):
    """docs/faults.md row 43: worker 0, the joiner's source, is SIGKILLed as it starts sending the state;
    the joiner gets it from worker 1 in the next generation and both finish with the same state."""
    got = _job(tmp_path, "source", "leave@10", gate_out=12, extra=("--source-dies",), dead=(0,))
    _same(got[1], got[RESTARTED], "worker 2 (joiner) vs worker 1")
    assert got[RESTARTED]["joined"]["steps"] == 20 and got[RESTARTED]["steps"] == 28
    assert got[1]["redone"] >= 1


def test_cascade_a_kill_inside_the_new_generations_first_collective(tmp_path):
    """docs/faults.md row 42, the cascade: of four workers, worker 2 is SIGKILLed between syncs and worker 3
    dies inside the first collective of the generation that follows (its hello); workers 0 and 1 form the
    next one and end bit-identical to a replay in which 2 and 3 left cleanly before the same sync."""
    got = _job(tmp_path, "cascade", "kill@10", restart=False, workers=4, extra=("--fault3", "hello"),
               dead=(2, 3), gate_in=0)
    clean = _job(tmp_path, "cascade-replay", "leave@10", gate_out=12, restart=False, workers=4,
                 extra=("--fault3", "leave@10"), gate_in=0)
    for r in (0, 1):
        _same(clean[r], got[r], f"cascade: worker {r} vs the replay")
        assert got[r]["steps"] == 28 and got[r]["redone"] >= 1


def test_worker_of_two_ranks_killed_rejoins_bit_identical_to_replay(tmp_path):
    """Workers of two ranks (DDP inside each, every rank a member and its rail's end): worker 2's ranks
    SIGKILLed together between syncs (step 10) and restarted; every rank of every worker ends bit-identical
    to the replay in which worker 2 sat out the same rounds, and the joiner's ranks hold the peers' pieces
    (docs/faults.md row 42)."""
    clean = _job(tmp_path, "replay2", "leave@10", gate_out=12, ranks=2)
    got = _job(tmp_path, "kill2", "kill@10", ranks=2)
    for key in sorted(clean):
        _same(clean[key], got[key], f"worker {key[0]} rank {key[1]} vs the replay")
        _same(got[(0, key[1])], got[key], f"worker {key[0]} rank {key[1]} vs worker 0")
        assert got[key]["steps"] == 28
    for j in range(2):
        assert got[(RESTARTED, j)]["joined"]["steps"] == 20 and got[(RESTARTED, j)]["joined"]["residual"] == 0.0
