"""In-network aggregation through the comm engine: asynchronous, counted, and failing loudly (docs/faults.md row 37).

``all_reduce(..., algorithm="ina", async_op=True)`` and the ``"ina"`` backend's
``dist.all_reduce(t, async_op=True)`` must return before the reduction completes (DDP's backward is
not blocked), complete later with the right sum, and deliver a failure to the caller. The proofs
that a call returned early do not use a clock (docs/architecture.md section 9.4): for the backend,
the peer enters the reduction only after the caller has returned and looked at its future, through
the pool's store; for ``all_reduce``, which returns only once every rank has entered and agreed on
the call, the switch process is paused (SIGSTOP) from before the calls until the caller has looked.
A call that blocked until the reduction completed would wait forever and fail the test by its
timeout.

The engine's byte counter of an INA call must equal ``Ina.traffic()`` (the payload's int32 codes; see
``commopt.comm.algorithms.ina``), for every supported dtype, on a gloo group (the process's engine)
and on an ``"ina"`` group (that group's own engine). The rank pool of docs/architecture.md section 9 runs the bodies (2
ranks, gloo); the switches run in the test process. DDP on the ``"ina"`` backend is
``test_ina_procs.py``'s.
"""

from __future__ import annotations

import os
import secrets
import signal

import pytest
import torch
import torch.distributed as dist

from commopt.comm.ina import SwitchProcess

TIMEOUT = 30.0  # seconds per INA call (the store waits as long)


@pytest.fixture(scope="module")
def switch_process():
    with SwitchProcess(partition_size=16) as sw:
        yield sw


@pytest.fixture(scope="module")
def switch(switch_process):
    return f"{switch_process.address[0]}:{switch_process.address[1]}"


def _topology(address: str | None):
    from commopt.comm import Topology

    rank = dist.get_rank()
    return Topology(nodes=((0,), (1,)), rank=rank, world_size=2, ina_switch=address)


def _after_peer_looked(token: str, rank: int, call):
    """Rank 0 calls first and reports whether its result was still pending; rank 1 calls only then."""
    store = dist.distributed_c10d._get_default_store()
    if rank == 1:
        store.wait([token], dist.constants.default_pg_timeout)
    result = call()
    pending = not (result.done() if isinstance(result, torch.futures.Future) else result.is_completed())
    if rank == 0:
        store.set(token, "called")
    return result, pending


def _while_switch_paused(pid: int, rank: int, call):
    """Both ranks call while the switch is paused (SIGSTOP), from before the calls until rank 0 has
    looked at its future: the reduction cannot complete before the call returns, whatever the timing.
    (The peer enters the call too: ``all_reduce`` returns only once the ranks agree on the call,
    through the gloo group, which needs no switch.)"""
    if rank == 0:
        os.kill(pid, signal.SIGSTOP)
    dist.barrier()
    try:
        result = call()
        pending = not result.done()
        dist.barrier()  # both ranks have looked
    finally:
        if rank == 0:
            os.kill(pid, signal.SIGCONT)
    return result, pending


def _counted_calls(topo, counter, reduce) -> list[tuple[str, int, float, float]]:
    """Bytes the engine counted per call against ``Ina.traffic`` for fp32/fp16/bf16 and odd sizes."""
    from commopt.comm.algorithms import get

    rank = dist.get_rank()
    out = []
    g = torch.Generator().manual_seed(7 + rank)
    for dtype, n in ((torch.float32, 70001), (torch.float16, 20000), (torch.bfloat16, 1)):
        x = (torch.rand(n, generator=g) + 0.5).to(dtype)  # never all zero: the payload really goes out
        before = counter()
        reduce(x)
        expect = get("ina").traffic("allreduce", n * x.element_size(), topo, itemsize=x.element_size()).sent(rank)
        out.append((str(dtype), n, counter() - before, expect))
    return out


def _algorithm_async(address: str, pid: int) -> dict:
    from commopt.comm import all_reduce, context, destroy

    rank = dist.get_rank()
    topo = _topology(address)
    try:
        warm = torch.full((5000,), 1.0 + rank)
        all_reduce(warm, algorithm="ina", topology=topo, timeout=TIMEOUT)  # identity and JOIN: collective
        t = torch.full((70000,), 1.0 + rank)
        fut, pending = _while_switch_paused(pid, rank, lambda: all_reduce(
            t, algorithm="ina", topology=topo, timeout=TIMEOUT, async_op=True))
        got = fut.wait()
        engine = context().engine()
        counted = _counted_calls(topo, lambda: engine.bytes_sent().get("ina", 0),
                                 lambda x: all_reduce(x, algorithm="ina", topology=topo, timeout=TIMEOUT))
        counted += _counted_calls(topo, lambda: engine.bytes_sent().get("ina", 0), lambda x: all_reduce(
            x, algorithm="ina", topology=topo, timeout=TIMEOUT, async_op=True).wait())
        return {"warm": warm.unique().tolist(), "pending": pending, "same": got is t,
                "sum": t.unique().tolist(), "counted": counted}
    finally:
        destroy()  # closes this rank's session: the next body starts from a fresh context


def test_algorithm_ina_async_returns_before_the_reduction(ranks, switch, switch_process):
    """docs/faults.md row 37: all_reduce(t, algorithm="ina", async_op=True) returns a future that is not done
    while the switch cannot aggregate (paused from before the call until the caller has looked), and
    completes with the exact sum once it runs again; the engine counts the payload's int32 codes, which is what
    Ina.traffic() says, for fp32/fp16/bf16, odd sizes, blocking and async calls."""
    results = ranks(2, _algorithm_async, switch, switch_process.pid, timeout=120)
    assert all(r["pending"] for r in results), "algorithm='ina', async_op=True returned an already completed future"
    for rank, r in enumerate(results):
        assert r["warm"] == [3.0] and r["sum"] == [3.0] and r["same"], (rank, r)
        for dtype, n, counted, expect in r["counted"]:
            assert counted == expect == 4 * n, f"rank {rank} {dtype} n={n}: engine {counted} B, traffic {expect} B"


def _backend_async(address: str, token: str) -> dict:
    from commopt.comm import all_reduce, destroy
    from commopt.comm.ina import InaOptions, InaWork

    rank = dist.get_rank()
    g = dist.new_group(backend="ina", pg_options=InaOptions(switch=address, timeout=TIMEOUT))
    try:
        warm = torch.full((1000,), 1.0 + rank)
        dist.all_reduce(warm, group=g)  # the JOIN, on this thread, before the first payload
        t = torch.full((50000,), 1.0 + rank)
        work, pending = _after_peer_looked(token, rank, lambda: dist.all_reduce(t, group=g, async_op=True))
        work.wait()
        future_value = work.get_future().wait()
        topo = _topology(None)
        counted = _counted_calls(topo, lambda: g.engine.bytes_sent().get("ina", 0),
                                 lambda x: dist.all_reduce(x, group=g, async_op=True).wait())
        # all_reduce(algorithm="ina") on an "ina" group goes through the group's session and engine.
        counted += _counted_calls(topo, lambda: g.engine.bytes_sent().get("ina", 0), lambda x: all_reduce(
            x, algorithm="ina", group=g, topology=topo, timeout=TIMEOUT))
        return {"warm": warm.unique().tolist(), "pending": pending, "kind": isinstance(work, InaWork),
                "sum": t.unique().tolist(), "future": future_value[0] is t, "counted": counted,
                "name": g.group_name}
    finally:
        destroy()
        dist.destroy_process_group(g)


def test_ina_backend_async_work_completes_later(ranks, switch):
    """docs/faults.md row 37: on the "ina" backend, dist.all_reduce(t, async_op=True) returns a work that is not
    completed while the peer has not entered the call; wait() gives the exact sum and get_future()
    holds the reduced tensor; the group's engine counts what Ina.traffic() says, and algorithm="ina"
    on that group goes through the same session and engine; the group (a new_group) is destroyed."""
    results = ranks(2, _backend_async, switch, f"ina-backend-{secrets.token_hex(4)}", timeout=120)
    assert results[0]["pending"], "the 'ina' backend returned an already completed work"
    for rank, r in enumerate(results):
        assert r["kind"] and r["future"] and r["name"], (rank, r)
        assert r["warm"] == [3.0] and r["sum"] == [3.0], (rank, r)
        for dtype, n, counted, expect in r["counted"]:
            assert counted == expect == 4 * n, f"rank {rank} {dtype} n={n}: engine {counted} B, traffic {expect} B"


def _switch_gone(address: str, pid: int) -> dict:
    """Both paths against a switch that rank 0 stops after the warm-up: the failures reach the caller."""
    import os
    import signal

    from commopt.comm import all_reduce, destroy
    from commopt.comm.errors import CommError, CommTimeoutError
    from commopt.comm.ina import InaOptions, query_stats

    rank = dist.get_rank()
    topo = _topology(address)
    g = dist.new_group(backend="ina", pg_options=InaOptions(switch=address, timeout=3.0, max_retries=3))
    out: dict = {}
    try:
        all_reduce(torch.ones(1000), algorithm="ina", topology=topo, timeout=TIMEOUT)
        dist.all_reduce(torch.ones(1000), group=g)
        if rank == 0:
            host, _, port = address.rpartition(":")
            os.kill(pid, signal.SIGTERM)
            while True:  # gone once it no longer answers (it closes its socket on the way out)
                try:
                    query_stats((host, int(port)), 0.5)
                except TimeoutError:
                    break
        dist.barrier()
        fut = all_reduce(torch.ones(40000), algorithm="ina", topology=topo, timeout=3.0, async_op=True)
        work = dist.all_reduce(torch.ones(40000), group=g, async_op=True)
        for name, wait in (("algorithm", fut.wait), ("backend", work.wait)):
            try:
                wait()
                out[name] = "returned"
            except CommError as e:
                out[name] = (type(e).__name__, isinstance(e, CommTimeoutError), str(e)[:300])
        try:
            work.get_future().wait()
            out["future"] = "returned"
        except RuntimeError as e:  # what DDP's reducer sees: the error's type and text, in its message
            out["future"] = (type(e).__name__, "CommTimeoutError" in str(e))
        return out
    finally:
        destroy()
        dist.destroy_process_group(g)


def test_ina_failure_reaches_the_caller(ranks):
    """docs/faults.md row 37: with the switch gone after a warm-up, an async all_reduce(algorithm="ina") and an
    async "ina"-backend all-reduce fail on wait() with CommTimeoutError (a CommError), and the
    backend work's future fails with a RuntimeError naming CommTimeoutError (what DDP re-raises)."""
    with SwitchProcess(partition_size=16) as sw:  # its own: rank 0 stops it mid-test
        results = ranks(2, _switch_gone, f"{sw.address[0]}:{sw.address[1]}", sw.pid, timeout=120)
    for rank, r in enumerate(results):
        for name in ("algorithm", "backend"):
            assert r[name] != "returned" and r[name][1], f"rank {rank} {name}: {r[name]}"
        assert r["future"] == ("RuntimeError", True), (rank, r)
