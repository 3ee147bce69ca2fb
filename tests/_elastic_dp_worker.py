"""One elastic data-parallel replica for tests/test_elastic_dp.py, run as a script (its own process and
its own torch.distributed world of one rank).

    python tests/_elastic_dp_worker.py ADDR RID OUT [--steps N] [--kill S] [--restarted] [--gate-in S]

``--kill S``: replica 2 SIGKILLs itself at step S, after its backward and before the reduction.
``--gate-in S``: the survivors wait before step S until replica 2 is back in the generation. Each replica
records, per step, its weights before the step, its own gradient, the gradient it stepped with (what
ElasticReplicas leaves in .grad) and its weights after, and writes them to
OUT (torch.save), with its state right after it joined.
"""

from __future__ import annotations

import argparse
import os
import signal
import time

import torch
import torch.distributed as dist
from torch import nn

from commopt.comm.elastic import Membership
from commopt.schedules import ElasticReplicas

WATCHED = 2


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("addr")
    p.add_argument("rid", type=int)
    p.add_argument("out")
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--kill", type=int, default=0)
    p.add_argument("--gate-in", type=int, default=0)
    p.add_argument("--restarted", action="store_true")
    a = p.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    torch.manual_seed(a.rid)  # replicas start apart: the first generation equalises them
    model = nn.Linear(6, 3)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    m = Membership(a.addr, a.rid, heartbeat_interval=0.05, timeout=20)
    reps = ElasticReplicas(model, opt, min_replicas=2, membership=m, timeout=6)
    joined = {"steps": reps.steps, "model": {k: v.clone() for k, v in model.state_dict().items()},
              "optimizer": opt.state_dict()}
    log = []
    for step in range(reps.steps, a.steps):
        if a.rid != WATCHED and step == a.gate_in:
            deadline = time.monotonic() + 60
            while WATCHED not in m.members or not m.is_member:
                assert time.monotonic() < deadline, m.members
                m.refresh()
                time.sleep(0.02)
        g = torch.Generator().manual_seed(100 * a.rid + step)
        x = torch.randn(8, 6, generator=g)
        opt.zero_grad()
        nn.functional.mse_loss(model(x), torch.cos(x[:, :3])).backward()
        before = [p.detach().clone() for p in model.parameters()]
        grad = [p.grad.clone() for p in model.parameters()]
        if a.rid == WATCHED and not a.restarted and step == a.kill:
            os.kill(os.getpid(), signal.SIGKILL)
        done = reps.step()
        log.append({"step": step, "generation": reps.replicas.gen.generation, "members": list(m.members),
                    "before": before, "grad": grad, "applied": [p.grad.clone() for p in model.parameters()],
                    "after": [p.detach().clone() for p in model.parameters()],
                    "steps": reps.steps})
        del done
    torch.save({"joined": joined, "log": log, "model": model.state_dict(), "optimizer": opt.state_dict(),
                "redone": reps.replicas.redone}, a.out)
    reps.close()
    m.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
