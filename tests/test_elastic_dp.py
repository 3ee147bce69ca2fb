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
import sys

import pytest
import torch
from _elastic_node import start_node
from _forked import ForkedScript

from commopt.comm.elastic import Coordinator

WORKER = os.path.join(os.path.dirname(__file__), "_elastic_dp_worker.py")
KILL, BACK, STEPS = 4, 8, 12
# Every fault here is a SIGKILL or a clean leave, which the coordinator sees at once (its liveness
# connection closes); the heartbeat timeout only guards against a live worker starved of the CPU for
# seconds by the suite's load being dropped, which would make a run differ from its replay.
HEARTBEAT = 6.0


def _run(tmp_path, ranks: int, fsdp: bool) -> dict:
    """Three nodes of ``ranks`` ranks; node 2 SIGKILLed (all its ranks) at step 4 and restarted; what every
    rank saved, by (node, local rank)."""
    keys = [(n, r) for n in range(3) for r in range(ranks)]
    outs = {k: str(tmp_path / f"{k[0]}.{k[1]}.pt") for k in keys}
    with Coordinator(heartbeat_timeout=HEARTBEAT, min_replicas=2, initial_replicas=3 * ranks) as coord:
        def start(node: int, *extra: str) -> list[ForkedScript]:
            return start_node(lambda r: [sys.executable, WORKER, coord.address, str(node), outs[(node, r)],
                                                "--steps", str(STEPS), "--kill", str(KILL), "--gate-in", str(BACK),
                                                *(["--fsdp"] if fsdp else []), *extra], ranks)

        procs = {n: start(n) for n in range(3)}
        try:
            for p in procs[2]:
                assert p.wait(timeout=120) == -9
            procs[2] = start(2, "--restarted")
            logs = {(n, r): p.communicate(timeout=150)[0] for n in procs for r, p in enumerate(procs[n])}
        finally:
            for ps in procs.values():
                for p in ps:
                    if p.poll() is None:
                        p.kill()
    for n in procs:
        for r, p in enumerate(procs[n]):
            assert p.returncode == 0, f"node {n} rank {r}: {logs[(n, r)][-3000:]}"
    return {k: torch.load(outs[k], weights_only=True) for k in keys}


def _check(got: dict, ranks: int, fsdp: bool) -> None:
    """The oracles (see the module docstring)."""
    keys = sorted(got)
    by_step = {k: {e["step"]: e for e in got[k]["log"]} for k in keys}
    for s in range(STEPS):
        logged = [k for k in keys if s in by_step[k]]
        nodes = sorted({n for n, _ in logged})
        assert nodes == ([0, 1] if s < BACK else [0, 1, 2]), (s, logged)  # node 2's first ranks saved nothing
        first = by_step[logged[0]][s]
        for k in logged:  # every rank of every node: the same weights, the same gradient applied
            e = by_step[k][s]
            assert all(torch.equal(a, b) for a, b in zip(e["before"], first["before"])), f"step {s} {k}: weights"
            assert all(torch.equal(a, b) for a, b in zip(e["applied"], first["applied"])), f"step {s} {k}: grads"
        if fsdp:  # each rank logged its node's mean (FSDP2's backward): the replicas' mean of those
            per_node = [by_step[(n, 0)][s]["grad"] for n in nodes]
        else:  # each rank logged its own: the node's SUM (in the reduce-scatter's one addition per pair)
            per_node = []
            for n in nodes:
                gs = [by_step[(n, r)][s]["grad"] for r in range(ranks)]
                per_node.append([sum(x[1:], x[0]) if ranks > 1 else x[0] for x in zip(*gs)])
        div = 1 if fsdp else ranks
        if KILL <= s < BACK:  # the two survivors alone: every operation exact, so is the oracle's
            expect = [(a + b) / (2 * div) for a, b in zip(*per_node)]
            assert all(torch.equal(a, b) for a, b in zip(first["applied"], expect)), f"step {s}: not their mean"
        elif s >= BACK:  # all three again (gloo's summation order is its own)
            mean = [sum(gs) / (3 * div) for gs in zip(*per_node)]
            assert all(torch.allclose(a, b, rtol=1e-6, atol=1e-7) for a, b in zip(first["applied"], mean))
    for r in range(ranks):  # the joiner's ranks start from the survivors' weights, bit for bit
        joiner = got[(2, r)]["joined"]
        assert joiner["steps"] == BACK
        assert all(torch.equal(a, b) for a, b in zip(joiner["model"], by_step[(0, 0)][BACK]["before"]))
    for k in keys:  # and all end alike, momentum included
        assert all(torch.equal(a, b) for a, b in zip(got[k]["model"], got[keys[0]]["model"])), k
        assert all(torch.equal(a, b) for a, b in zip(got[k]["momentum"], got[keys[0]]["momentum"])), k
    assert all(got[(n, r)]["redone"] >= 1 for n in (0, 1) for r in range(ranks))


def test_replica_killed_mid_step_survivors_average_and_joiner_catches_up(tmp_path):
    """One rank per node: node 2 SIGKILLed after its backward at step 4; restarted, admitted at step 8
    (docs/faults.md row 42)."""
    _check(_run(tmp_path, 1, False), 1, False)


@pytest.mark.parametrize("fsdp", [False, True], ids=["replicated", "fsdp2"])
def test_node_of_two_ranks_killed_survivors_average_and_joiner_catches_up(tmp_path, fsdp):
    """Two ranks per node, the model replicated (step() reduces inside the node too) or sharded with FSDP2
    over the node (HSDP): node 2's ranks SIGKILLed together at step 4, restarted and admitted at step 8; the
    gradient every rank applied is the mean over the surviving nodes' ranks, bit for bit
    (docs/faults.md row 42)."""
    _check(_run(tmp_path, 2, fsdp), 2, fsdp)


def test_bad_arguments_are_refused_before_anything_is_sent():
    """Bad input (docs/faults.md row 42): what elastic training cannot run is refused at construction,
    saying what to do, before any membership or group exists."""
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
        with pytest.raises(ValueError, match="its own torch.distributed world"):
            ElasticReplicas(model, opt, min_replicas=2)
    ddp = nn.parallel.DistributedDataParallel.__new__(nn.parallel.DistributedDataParallel)  # no group needed
    with pytest.raises(TypeError, match="not DistributedDataParallel"):
        ElasticReplicas(ddp, opt)
    with pytest.raises(ValueError, match="min_replicas must be an int >= 1"):
        ElasticReplicas(model, opt, min_replicas=True)
