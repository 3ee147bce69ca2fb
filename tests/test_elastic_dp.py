"""Elastic data-parallel replicas (``schedules.ElasticReplicas``): a replica killed mid-step, the survivors
carrying on, its restarted process rejoining (docs/faults.md row 42).

Three replicas, each its own process and world (tests/_elastic_dp_worker.py), the coordinator a thread
here. Oracles computed here from what each replica logged: the gradient every replica stepped with is the
average of the gradients of the replicas that took part (exactly, where two took part); the joiner starts
from its peer's weights and optimizer state bit for bit, and every replica ends with the same weights and
optimizer state.
"""

from __future__ import annotations

import os
import subprocess
import sys

import torch

from commopt.comm.elastic import Coordinator

WORKER = os.path.join(os.path.dirname(__file__), "_elastic_dp_worker.py")
KILL, BACK, STEPS = 4, 8, 12


def test_replica_killed_mid_step_survivors_average_and_joiner_catches_up(tmp_path):
    """Replica 2 SIGKILLed after its backward at step 4; restarted, admitted at step 8 (docs/faults.md row 42)."""
    outs = {r: str(tmp_path / f"{r}.pt") for r in range(3)}
    with Coordinator(heartbeat_timeout=2.0, min_replicas=2, initial_replicas=3) as coord:
        def start(r: int, *extra: str) -> subprocess.Popen:
            return subprocess.Popen([sys.executable, WORKER, coord.address, str(r), outs[r], "--steps", str(STEPS),
                                     "--kill", str(KILL), "--gate-in", str(BACK), *extra],
                                    stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)

        procs = [start(r) for r in range(3)]
        try:
            assert procs[2].wait(timeout=90) == -9
            procs[2] = start(2, "--restarted")
            logs = [p.communicate(timeout=120)[0] for p in procs]
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
    for r, p in enumerate(procs):
        assert p.returncode == 0, f"replica {r}: {logs[r][-3000:]}"
    got = {r: torch.load(outs[r], weights_only=True) for r in range(3)}
    by_step = {r: {e["step"]: e for e in got[r]["log"]} for r in range(3)}
    for s in range(STEPS):
        logged = [r for r in range(3) if s in by_step[r]]
        assert logged == ([0, 1] if s < BACK else [0, 1, 2]), (s, logged)  # 2's first process saved nothing
        first = by_step[0][s]
        for r in logged:
            e = by_step[r][s]
            assert all(torch.equal(a, b) for a, b in zip(e["before"], first["before"])), f"step {s}: other weights"
            assert all(torch.equal(a, b) for a, b in zip(e["applied"], first["applied"])), f"step {s}: other grads"
        grads = [by_step[r][s]["grad"] for r in logged]
        if KILL <= s < BACK:  # the survivors alone: the SUM of two is exact, so is the oracle's mean
            expect = [(a + b) / 2 for a, b in zip(*grads)]
            assert all(torch.equal(a, b) for a, b in zip(first["applied"], expect)), f"step {s}: not their mean"
        elif s >= BACK:  # all three again (gloo's summation order is its own)
            mean = [sum(gs) / 3 for gs in zip(*grads)]
            assert all(torch.allclose(a, b, rtol=1e-6, atol=1e-7) for a, b in zip(first["applied"], mean))
    joiner = got[2]["joined"]
    assert joiner["steps"] == BACK
    survivor_before = by_step[0][BACK]["before"]
    assert all(torch.equal(a, b) for a, b in zip(joiner["model"].values(), survivor_before))
    for r in (0, 1):
        for k in got[2]["model"]:
            assert torch.equal(got[r]["model"][k], got[2]["model"][k]), f"replica {r} ends with other weights"
        for i, st in got[r]["optimizer"]["state"].items():
            assert torch.equal(st["momentum_buffer"], got[2]["optimizer"]["state"][i]["momentum_buffer"])
    assert got[0]["redone"] >= 1 and got[1]["redone"] >= 1



def test_bad_arguments_are_refused_before_anything_is_sent():
    """Bad input (docs/faults.md row 42): what elastic training cannot run is refused at construction,
    saying what to do, before any membership or group exists."""
    import pytest
    from torch import nn

    from commopt.schedules import DiLoCo, ElasticReplicas

    model = nn.Linear(2, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ValueError, match="delay=0"):
        DiLoCo(model, opt, sync_every=4, delay=2, elastic=True)
    with pytest.raises(ValueError, match="not topology= or workers="):
        DiLoCo(model, opt, sync_every=4, workers=[[0]], elastic=True)
    with pytest.raises(ValueError, match="min_workers must be an int >= 1"):
        DiLoCo(model, opt, sync_every=4, elastic=True, min_workers=0)
    with pytest.raises(TypeError, match="membership must be"):
        ElasticReplicas(model, opt, membership="127.0.0.1:1")
    if not torch.distributed.is_initialized():  # this process's own world, when a test left one, is size 1
        with pytest.raises(ValueError, match="world of one rank"):
            ElasticReplicas(model, opt, min_replicas=2)
    with pytest.raises(ValueError, match="min_replicas must be an int >= 1"):
        ElasticReplicas(model, opt, min_replicas=True)
