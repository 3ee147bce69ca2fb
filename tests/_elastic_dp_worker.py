"""One rank of an elastic data-parallel replica (a node) for tests/test_elastic_dp.py, run as a script
(its own process; the node's ranks form their own torch.distributed world).

    python tests/_elastic_dp_worker.py ADDR NODE OUT [--ranks L --local R --port P] [--fsdp] [--steps N]
                                       [--kill S] [--restarted] [--gate-in S]

``--ranks L``: the node has L ranks (this one ``--local R``; rendezvous on 127.0.0.1:P); ``--fsdp``: the model
is sharded with FSDP2 over the node's ranks. ``--kill S``: node 2's rank 0 SIGKILLs the node's process group
at step S, after its backward and before the reduction. ``--gate-in S``: the survivors wait before step S
until node 2 is back in the generation. Each rank records, per step, its weights before the step, its own
gradient, the gradient it stepped with (what ElasticReplicas leaves in .grad) and its weights after (whole
tensors: FSDP2's shards gathered), and writes them to OUT (torch.save), with its state right after it joined.
"""

from __future__ import annotations

import argparse
import os
import signal
import time

import torch
import torch.distributed as dist
from _elastic_node import add_node_args, init_node_world
from torch import nn

from commopt.comm.elastic import Membership
from commopt.schedules import ElasticReplicas

WATCHED = 2


def _whole(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if hasattr(t, "full_tensor") else t.detach().clone()


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("addr")
    p.add_argument("rid", type=int)
    p.add_argument("out")
    add_node_args(p)
    p.add_argument("--fsdp", action="store_true")
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--kill", type=int, default=0)
    p.add_argument("--gate-in", type=int, default=0)
    p.add_argument("--restarted", action="store_true")
    a = p.parse_args()
    torch.set_num_threads(1)
    init_node_world(a)
    torch.manual_seed(a.rid)  # nodes start apart: the first generation equalises them (ranks of a node agree)
    model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))
    if a.fsdp:
        from torch.distributed.fsdp import fully_shard

        fully_shard(model[0])
        fully_shard(model[2])
        fully_shard(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    m = Membership(a.addr, a.rid * a.ranks + a.local, heartbeat_interval=0.05, timeout=20)
    reps = ElasticReplicas(model, opt, min_replicas=2, membership=m, timeout=6)
    joined = {"steps": reps.steps, "model": [_whole(v) for v in model.parameters()]}
    watched = {WATCHED * a.ranks + j for j in range(a.ranks)}
    log = []
    for step in range(reps.steps, a.steps):
        if a.rid != WATCHED and step == a.gate_in:
            deadline = time.monotonic() + 60
            while not watched <= set(m.members) or not m.is_member:
                assert time.monotonic() < deadline, m.members
                m.refresh()
                time.sleep(0.02)
        g = torch.Generator().manual_seed(100 * a.rid + 10 * a.local + step)
        x = torch.randn(8, 6, generator=g)
        opt.zero_grad()
        nn.functional.mse_loss(model(x), torch.cos(x[:, :3])).backward()
        before = [_whole(q) for q in model.parameters()]
        if a.rid == WATCHED and not a.restarted and step == a.kill and a.local == 0:
            os.killpg(os.getpgid(0), signal.SIGKILL)
        grad = [_whole(q.grad) for q in model.parameters()]  # FSDP2: the node's mean (whole), else this rank's
        reps.step()
        log.append({"step": step, "generation": reps.replicas.gen.generation, "members": list(m.members),
                    "before": before, "grad": grad, "applied": [_whole(q.grad) for q in model.parameters()],
                    "after": [_whole(q) for q in model.parameters()], "steps": reps.steps})
    momentum = [_whole(opt.state[q]["momentum_buffer"]) for q in model.parameters()]
    torch.save({"joined": joined, "log": log, "model": [_whole(q) for q in model.parameters()],
                "momentum": momentum, "redone": reps.replicas.redone}, a.out)
    reps.close()
    m.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
