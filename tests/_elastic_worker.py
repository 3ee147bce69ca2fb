"""One rank of an elastic DiLoCo worker for tests/test_elastic_diloco.py, run as a script (its own process;
the worker's ranks form their own torch.distributed world, as one torchrun per node would start them).

    python tests/_elastic_worker.py ADDR RID OUT [--steps N] [--every H] [--codec int8|none]
        [--fault kill@S | leave@S | commit@S] [--fault3 leave@S | hello] [--source-dies] [--gate-out S]
        [--gate-in S] [--restarted] [--ranks L --local R --port P]

``--ranks L``: the worker has L ranks training with DDP inside it (this one ``--local R``, rendezvous on
127.0.0.1:P); a fault that kills SIGKILLs the worker's whole process group (all its ranks).

Faults (on a worker that is not --restarted): ``kill@S`` SIGKILLs itself before inner step S;
``leave@S`` leaves cleanly there (the replay's "sits out"); ``commit@S`` SIGKILLs itself inside the
outer sync at step S, after its reduction and before it reports the round; ``--source-dies``: worker 0
SIGKILLs itself when it starts to send the job's state to a joiner.
``--fault3 hello``: worker 3 SIGKILLs itself in the first collective of a generation formed after the
start (a cascade). Gates (survivors): before the outer sync at step S, wait until worker 2 (and 3, for
out) is out of (``--gate-out``) or in (``--gate-in``) the coordinator's generation, so that a replay and
a failure see the same generations. Writes its final outer state to OUT with torch.save.
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

from commopt.comm.compression import QuantizeCompressor
from commopt.comm.elastic import Membership
from commopt.schedules import DiLoCo

_RANKS = 1  # ranks per worker (--ranks)
WATCHED = 2  # the worker the faults and gates are about
SECOND = 3  # with four workers, the one --fault3 is about


def _data(rid: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * rid + step)
    x = torch.randn(16, 8, generator=g)
    return x, torch.sin(x).sum(dim=1, keepdim=True)


def _die() -> None:
    """SIGKILL this worker: every rank of it (its process group) where it has several."""
    if _RANKS > 1:
        os.killpg(os.getpgid(0), signal.SIGKILL)
    os.kill(os.getpid(), signal.SIGKILL)


def _in(m: Membership, worker: int) -> bool:
    return all(worker * _RANKS + j in m.members for j in range(_RANKS))


def _wait_for(m: Membership, present: bool) -> None:
    deadline = time.monotonic() + 60
    rid = m.replica_id // _RANKS
    while (_in(m, WATCHED) != present or (not present and _in(m, SECOND) and rid != SECOND)
           or not m.is_member):
        if time.monotonic() > deadline:
            raise TimeoutError(f"worker {WATCHED} never {'joined' if present else 'left'}: {m.members}")
        m.refresh()
        time.sleep(0.02)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("addr")
    p.add_argument("rid", type=int)
    p.add_argument("out")
    p.add_argument("--steps", type=int, default=28)
    p.add_argument("--every", type=int, default=4)
    p.add_argument("--codec", default="int8")
    p.add_argument("--fault", default="")
    p.add_argument("--gate-out", type=int, default=0)
    p.add_argument("--gate-in", type=int, default=0)
    p.add_argument("--restarted", action="store_true")
    p.add_argument("--source-dies", action="store_true")
    add_node_args(p)
    p.add_argument("--fault3", default="", help="worker 3's fault: leave@S, kill@S, or hello (it dies in the "
                                                 "first collective of the first new generation after the start)")
    a = p.parse_args()
    torch.set_num_threads(1)
    init_node_world(a)
    torch.manual_seed(a.rid)  # workers start apart: the first generation's broadcast must equalise them
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))
    net = nn.parallel.DistributedDataParallel(model) if a.ranks > 1 else model
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    m = Membership(a.addr, a.rid * a.ranks + a.local, heartbeat_interval=0.05, timeout=20)
    global _RANKS
    _RANKS = a.ranks
    kind, _, at = (a.fault if a.rid == WATCHED else a.fault3 if a.rid == SECOND else "").partition("@")
    fault = "" if a.restarted else kind
    at = int(at or 0)
    if a.source_dies and not a.restarted and a.rid == 0:
        import commopt.comm.elastic.replicas as el

        real = el.broadcast_state

        def dying(state, group, src, timeout, dsts=None):
            if state is not None and state["steps"] > 0:  # the source of a joiner's transfer: die inside it
                _die()
            return real(state, group, src, timeout, dsts)

        el.broadcast_state = dying
    if fault == "hello":
        import commopt.comm.elastic.replicas as rep

        gather = rep.all_gather_single

        def dying_hello(out, mine, **kwargs):
            if int(mine[2]) > 0:  # a hello after the start: the first collective of a new generation
                _die()
            return gather(out, mine, **kwargs)

        rep.all_gather_single = dying_hello
    codec = QuantizeCompressor(8) if a.codec == "int8" else None
    t0 = time.monotonic()
    dl = DiLoCo(model, opt, sync_every=a.every, compressor=codec, elastic=True, min_workers=2, membership=m,
                timeout=6)
    joined = {"steps": dl.steps, "seconds": time.monotonic() - t0,
              "residual": max((float(r.abs().max()) for kind_ in dl.error_feedback.residuals.values()
                               for r in kind_.values()), default=0.0),
              "backups": {n: b.clone() for n, b in dl.backups.items()}}
    for step in range(dl.steps + 1, a.steps + 1):
        if fault == "kill" and step == at:
            _die()
        if fault == "leave" and step == at:
            dl.close()
            m.close()
            dist.destroy_process_group()
            return
        x, y = _data(a.rid * a.ranks + a.local, step)
        opt.zero_grad()
        nn.functional.mse_loss(net(x), y).backward()
        opt.step()
        if a.rid != WATCHED and step == a.gate_out:
            _wait_for(m, present=False)
        if a.rid != WATCHED and step == a.gate_in:
            _wait_for(m, present=True)
        if fault == "commit" and step == at:
            def die(*args, **kwargs):
                _die()
            m.commit = die
        dl.step()
    torch.save({"backups": dl.backups, "outer": dl.outer_optimizers[0].state_dict(), "joined": joined,
                "redone": dl.elastic.redone, "recovery_bytes": dl.elastic.recovery_bytes,
                "generation": dl.generation, "members": list(dl.members), "steps": dl.steps,
                "events": [list(e) for e in dl.events],
                "residuals": dl.error_feedback.state_dict()}, a.out)
    print(f"worker {a.rid}: saved", flush=True)
    dl.close()
    m.close()
    dist.destroy_process_group()
    print(f"worker {a.rid}: closed", flush=True)


if __name__ == "__main__":
    main()
