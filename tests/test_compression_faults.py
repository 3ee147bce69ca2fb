"""The compression rows of the fault matrix: timeouts, mismatches, leaks and bad input (issue 10).

Rows covered here for the compressed paths (``compressor.all_reduce`` and the DDP hook with a
compressor): 4 (a rank alive but never entering), 1/3 without validation (a size or dtype mismatch
ends loudly, never a normal return with wrong values), 30 (lifecycle leaks) and bad input at the
call. The plain collectives' rows are in test_faults.py.

Timeout tests need a fresh ``RankPool(4)`` (a timed-out collective leaves its groups out of step);
to keep them few, one pool runs every case: each case reduces over a parent group of its own
(``dist.new_group`` of all four ranks), so its derived groups are fresh, and the cases of a wave run
at once where they can (the warm ones: one timeout of waiting for all of them; group creation is
serialised, so the cold ones wait one timeout each).
"""

from __future__ import annotations

import threading
import time

import torch
import torch.distributed as dist
from _pool import RankPool
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from commopt.comm import Topology
from commopt.comm import compression as C
from commopt.comm.hooks import AllReduceState, register

TIMEOUT = 3.0  # seconds a compressed collective may take before the survivors give up
SLACK = 10.0  # room for a cold process on 2 busy cores
ABSENT = 1  # the rank that stays alive but never enters (node 0 of the 2x2, beside rank 0)


def _compressor(name: str):
    return {"fp16": lambda: C.FP16Compressor(),
            "powersgd": lambda: C.PowerSGDCompressor(rank=1, start_iter=0, min_compression_rate=0),
            "int8": lambda: C.QuantizeCompressor(8, 64)}[name]()


def _fresh_topology() -> Topology:
    """A 2x2 over a new parent group of all ranks: its derived groups (keyed by parent) are new."""
    return Topology.from_spec("2x2", group=dist.new_group(list(range(dist.get_world_size()))))


def _timed(fn) -> tuple[str, float, str]:
    start = time.monotonic()
    try:
        fn()
    except Exception as exc:  # noqa: BLE001 - the test inspects what the call raised
        return type(exc).__name__, time.monotonic() - start, str(exc)
    return "completed", time.monotonic() - start, ""


def _ddp(topo: Topology, name: str, algo: str, timeout: float):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 48), nn.ReLU(), nn.Linear(48, 4))
    ddp = DDP(model, process_group=topo.group)
    state = AllReduceState(topo, algo, _compressor(name), process_group=topo.group, timeout=timeout)
    register(ddp, state)
    return ddp, state


def _first_call(entry: str, name: str, algo: str, topo: Topology, x: torch.Tensor):
    """The first compressed reduction of a case (set up here, on every rank), as a callable."""
    if entry == "hook":
        ddp, _ = _ddp(topo, name, algo, TIMEOUT)
        return lambda: ddp(x).sum().backward()
    c = _compressor(name)
    return lambda: c.all_reduce(x.clone(), group=topo.group, topology=topo, algorithm=algo,
                                error_feedback=C.ErrorFeedback(), timeout=TIMEOUT)


def _never_enters() -> dict:
    """Rank ABSENT takes part in every setup step but never in the timed calls."""
    rank = dist.get_rank()
    out: dict[str, tuple[str, float, str]] = {}
    x = torch.randn(48, 32, generator=torch.Generator().manual_seed(rank))

    # Cold: the first call creates the groups, which is collective and serialised (one at a time).
    cold = [("all_reduce", "fp16", "flat"), ("all_reduce", "powersgd", "hierarchical"),
            ("hook", "int8", "flat"), ("hook", "fp16", "hierarchical")]
    for entry, name, algo in cold:
        call = _first_call(entry, name, algo, _fresh_topology(), x)
        dist.barrier()
        if rank != ABSENT:
            out[f"cold/{entry}/{name}/{algo}"] = _timed(call)
        dist.barrier()

    # Warm: one good call first, with a long timeout (the groups are made with it, so only
    # commopt's own bound on each wait can end the next call); then every case at once: the
    # all-reduces in flight, the hooks' backward passes in threads of their own.
    cases = [(name, algo) for name in ("fp16", "powersgd", "int8") for algo in ("flat", "hierarchical")]
    warm = []
    for name, algo in cases:
        c, topo, ef = _compressor(name), _fresh_topology(), C.ErrorFeedback()
        c.all_reduce(x.clone(), group=topo.group, topology=topo, algorithm=algo, error_feedback=ef, timeout=60)
        warm.append((name, algo, c, topo, ef))
    hooks = []
    for name, algo in (("powersgd", "hierarchical"), ("fp16", "flat")):
        ddp, state = _ddp(_fresh_topology(), name, algo, 60)
        for _ in range(2):  # DDP rebuilds its buckets (a collective of its own) in the 2nd forward
            ddp(x).sum().backward()
        state.timeout = TIMEOUT
        hooks.append((name, algo, ddp))
    dist.barrier()
    if rank != ABSENT:
        done = []
        for name, algo, c, topo, ef in warm:
            label, start, ev = f"warm/all_reduce/{name}/{algo}", time.monotonic(), threading.Event()
            fut = c.all_reduce(x.clone(), group=topo.group, topology=topo, algorithm=algo, error_feedback=ef, step=1,
                               timeout=TIMEOUT, async_op=True)

            def settle(f, label=label, start=start, ev=ev):
                try:
                    f.value()
                    out[label] = ("completed", time.monotonic() - start, "")
                except Exception as exc:  # noqa: BLE001 - inspected by the test
                    out[label] = (type(exc).__name__, time.monotonic() - start, str(exc))
                ev.set()

            fut.add_done_callback(settle)
            done.append(ev)
        threads = []
        for name, algo, ddp in hooks:
            def backward(ddp=ddp, label=f"warm/hook/{name}/{algo}"):
                out[label] = _timed(lambda: ddp(x).sum().backward())
            threads.append(threading.Thread(target=backward))
        for t in threads:
            t.start()
        for t in threads:
            t.join(TIMEOUT + SLACK + 5)
        for ev in done:
            ev.wait(TIMEOUT + SLACK + 5)
    dist.barrier()
    return out


def test_compressed_rank_never_enters():
    """FAULTS row 4: with one rank alive but never entering, every other rank's compressed
    reduction raises CommTimeoutError after the timeout and before timeout + slack: ``all_reduce``
    and the DDP hook, flat and hierarchical 2x2, cold (the first call, which creates the groups) and
    warm (after a good call; hierarchical PowerSGD once left rank 0 in gloo's reduce-scatter, whose
    ``wait(timeout)`` is unbounded), with fp16, PowerSGD and int8 spread over the cells."""
    pool = RankPool(4)
    try:
        res = pool.run(_never_enters, timeout=5 * (TIMEOUT + SLACK) + 60)
    finally:
        pool.close(graceful=False)
    assert res[ABSENT] == {}
    labels = {"cold/all_reduce/fp16/flat", "cold/all_reduce/powersgd/hierarchical", "cold/hook/int8/flat",
              "cold/hook/fp16/hierarchical", "warm/hook/powersgd/hierarchical", "warm/hook/fp16/flat"}
    labels |= {f"warm/all_reduce/{name}/{algo}" for name in ("fp16", "powersgd", "int8")
               for algo in ("flat", "hierarchical")}
    for rank, got in enumerate(res):
        if rank == ABSENT:
            continue
        assert set(got) == labels, (rank, "did not finish:", sorted(labels - set(got)), got)
        for label, (kind, elapsed, msg) in sorted(got.items()):
            if "/hook/" in label:  # DDP re-raises a hook's failure as RuntimeError with its text
                assert "CommTimeoutError" in msg, (rank, label, kind, msg)
            else:
                assert kind == "CommTimeoutError", (rank, label, kind, msg)
            assert TIMEOUT - 0.5 <= elapsed <= TIMEOUT + SLACK, (rank, label, elapsed, msg)
