"""In-network aggregation across real processes: the "ina" backend under DDP, and a killed worker;
and the backend's configuration (a one-rank group in this process).

These tests start fresh processes (spawned, never forked) because they must: DDP needs
``init_process_group("ina")`` in new ranks, and a crash needs a process to kill. They are few and
small (docs/architecture.md section 9); each has a wall-clock guard and kills whatever it started.
"""

from __future__ import annotations

import faulthandler
import multiprocessing as mp
import os
import queue
import signal
import tempfile
import threading
import time
from datetime import timedelta
from typing import Any

import pytest
import torch

from commopt.comm.errors import CommTimeoutError
from commopt.comm.ina import InaSession, SwitchProcess

GUARD = 180.0  # generous: spawning ranks that import torch takes tens of seconds on a loaded 2-core box


def _train(backend: str, store_path: str, rank: int, options: Any) -> tuple[list[list[float]], dict]:
    import gc

    import torch.distributed as dist

    dist.init_process_group(backend, store=dist.FileStore(store_path, 2), rank=rank, world_size=2,
                            pg_options=options, timeout=timedelta(seconds=60))
    extra: dict[str, Any] = {}
    ddp = None
    try:
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.Tanh(), torch.nn.Linear(64, 4))
        ddp = torch.nn.parallel.DistributedDataParallel(model, bucket_cap_mb=0.004)  # several buckets
        opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
        g = torch.Generator().manual_seed(100 + rank)
        for _ in range(5):
            x, y = torch.randn(8, 32, generator=g), torch.randn(8, 4, generator=g)
            opt.zero_grad()
            ((ddp(x) - y) ** 2).mean().backward()
            opt.step()
        params = [p.detach().reshape(-1).tolist() for p in model.parameters()]
        if backend == "ina":
            # The rest of the backend: half precision and AVG through the switch, the others via gloo.
            h = torch.full((5,), 1.5 + rank, dtype=torch.float16)
            dist.all_reduce(h)
            b = torch.full((5,), 1.0 + rank, dtype=torch.bfloat16)
            dist.all_reduce(b, op=dist.ReduceOp.AVG)
            i = torch.tensor([rank + 1])
            dist.all_reduce(i)  # integers: the gloo fallback
            m = torch.tensor([float(rank)])
            dist.all_reduce(m, op=dist.ReduceOp.MAX)
            src = torch.tensor([float(rank + 10)])
            dist.broadcast(src, 1)
            gathered = [torch.zeros(1) for _ in range(2)]
            dist.all_gather(gathered, torch.tensor([float(rank)]))
            dist.barrier()
            pg = dist.group.WORLD
            extra = {"half": h.tolist(), "bf16_avg": b.tolist(), "int": i.tolist(), "max": m.tolist(),
                     "bcast": src.tolist(), "gather": [t.item() for t in gathered],
                     "name": pg.getBackendName() if hasattr(pg, "getBackendName") else "",
                     "counters": dict(pg.session.counters)}
            del pg
    finally:
        # Release DDP while the group is still registered, then destroy the group. The other order
        # deadlocked (the old skip of this test): DDP's Reducer then held the last reference to the
        # gloo group, and its pybind deallocator runs ~ProcessGroupGloo with the GIL held; that joins
        # gloo's worker threads, and a worker that had not yet dropped the last backward all-reduce
        # work blocks on the GIL, because the work's captured ThreadLocalState holds a Python object
        # (the context torch's _engine_run_backward stashes in TLS). Dropped by the group's own
        # Python handle (in destroy_process_group), ~ProcessGroupGloo runs with the GIL released.
        ddp = opt = None
        gc.collect()  # a Reducer kept alive by a reference cycle would be freed later, the bad order
        dist.destroy_process_group()
    return params, extra


def _cycles(tmp: str, rank: int, address: str, cycles: int = 10) -> tuple[int, int]:
    """docs/faults.md row 30: init("ina") -> all-reduce -> destroy, repeatedly; returns fds (first, last)."""
    import torch.distributed as dist

    from commopt.comm.ina import InaOptions

    counts = []
    for c in range(cycles):
        dist.init_process_group("ina", store=dist.FileStore(os.path.join(tmp, f"cycle{c}"), 2), rank=rank,
                                world_size=2, pg_options=InaOptions(switch=address, timeout=30))
        t = torch.full((100,), float(rank + c))
        dist.all_reduce(t)
        assert torch.equal(t, torch.full((100,), float(2 * c + 1)))
        dist.destroy_process_group()
        counts.append(len(os.listdir("/proc/self/fd")))
    return counts[0], counts[-1]


def _adapter(tmp: str, rank: int, address: str) -> list[float]:
    """The collective layer's entry point, all_reduce(..., algorithm="ina"), on a gloo group."""
    import torch.distributed as dist

    from commopt.comm import Topology, all_reduce, destroy

    dist.init_process_group("gloo", store=dist.FileStore(os.path.join(tmp, "adapter"), 2), rank=rank,
                            world_size=2)
    try:
        t = torch.full((3000,), 1.0 + rank)
        topo = Topology(nodes=((0,), (1,)), rank=rank, world_size=2, ina_switch=address)
        fut = all_reduce(t, algorithm="ina", topology=topo, timeout=30.0, async_op=True)
        return fut.wait()[:2].tolist()
    finally:
        destroy()
        dist.destroy_process_group()


def _ddp_rank(rank: int, tmp: str, address: str, results: Any) -> None:
    faulthandler.dump_traceback_later(GUARD - 10, exit=True)  # a hang shows where, on stderr
    try:
        torch.set_num_threads(1)
        from commopt.comm.ina import InaOptions

        ina, extra = _train("ina", os.path.join(tmp, "ina_store"), rank, InaOptions(switch=address, timeout=60))
        extra["fds"] = _cycles(tmp, rank, address)
        ref, _ = _train("gloo", os.path.join(tmp, "gloo_store"), rank, None)
        extra["adapter"] = _adapter(tmp, rank, address)
        results.put((rank, "ok", (ina, ref, extra)))
    except BaseException as e:  # noqa: BLE001 - reported to the test with its text
        import traceback

        results.put((rank, "err", f"{type(e).__name__}: {e}\n{traceback.format_exc()}"))


def _collect(procs: list[Any], results: Any, count: int, guard: float) -> list[Any]:
    out: list[Any] = []
    deadline = time.monotonic() + guard
    while len(out) < count:
        left = deadline - time.monotonic()
        assert left > 0, f"processes did not report within {guard:.0f} s: got {[r[0] for r in out]}"
        try:
            item = results.get(timeout=min(1.0, left))
        except queue.Empty:
            dead = [p.name for p in procs if p.exitcode not in (None, 0)]
            assert not dead, f"processes died: {dead}"
            continue
        assert item[1] == "ok", f"rank {item[0]} failed:\n{item[2]}"
        out.append(item)
    return sorted(out, key=lambda r: r[0])


def _run(procs: list[Any], results: Any) -> list[Any]:
    """Start ``procs``, collect one report from each within the guard, and reap them whatever happens."""
    for p in procs:
        p.start()
    try:
        return _collect(procs, results, len(procs), GUARD)
    finally:
        _reap(procs)


def _reap(procs: list[Any]) -> None:
    for p in procs:
        p.join(10)
        if p.is_alive():
            p.kill()
            p.join(5)


def test_ddp_on_ina_backend_matches_gloo():
    """docs/faults.md rows 24 and 30 (end to end): DDP on init_process_group("ina") (2 spawned ranks, FileStore
    in a tmp dir) trains 5 steps to the same parameters as gloo DDP, within the quantization
    tolerance; fp16/bf16/AVG all-reduce go through the switch and the other collectives through gloo;
    10 init -> all-reduce -> destroy cycles leak no file descriptors; the collective layer's adapter
    (algorithm="ina") works on a gloo group."""
    ctx = mp.get_context("spawn")
    with SwitchProcess() as sw, tempfile.TemporaryDirectory() as tmp:
        results = ctx.Queue()
        address = f"{sw.address[0]}:{sw.address[1]}"
        procs = [ctx.Process(target=_ddp_rank, args=(r, tmp, address, results), daemon=True, name=f"rank{r}")
                 for r in range(2)]
        out = _run(procs, results)
        stats = sw.stats()
    for rank, _, (ina, ref, extra) in out:
        for a, b in zip(ina, ref):
            diff = max(abs(x - y) for x, y in zip(a, b))
            assert diff <= 1e-5, f"rank {rank}: ina DDP differs from gloo DDP by {diff}"
        assert extra["half"] == [4.0] * 5 and extra["bf16_avg"] == [1.5] * 5
        assert extra["int"] == [3] and extra["max"] == [1.0] and extra["bcast"] == [11.0]
        assert extra["gather"] == [0.0, 1.0] and extra["name"] == "ina"
        assert extra["counters"]["results"] > 0
        assert extra["adapter"] == [3.0, 3.0]
        first, last = extra["fds"]
        assert last <= first, f"rank {rank}: file descriptors grew from {first} to {last} over init/destroy cycles"
    assert stats["results_sent"] > 0 and stats["epochs"] >= 12  # DDP + 10 cycles + the adapter


def _world_rank(world: str, rank: int, tmp: str, address: str, value: float, barrier: Any, results: Any) -> None:
    """One rank of one of two independent 2-rank worlds: the public all_reduce(algorithm="ina")."""
    faulthandler.dump_traceback_later(GUARD - 10, exit=True)
    try:
        import gc

        os.environ["COMMOPT_INA_SWITCH"] = address
        os.environ["COMMOPT_NODES"] = "0,1"
        torch.set_num_threads(1)
        import torch.distributed as dist

        from commopt.comm import Topology, all_reduce, context, destroy
        from commopt.comm.ina import InaSession

        def init(name: str) -> None:
            dist.init_process_group("gloo", store=dist.FileStore(os.path.join(tmp, f"{world}-{name}"), 2),
                                    rank=rank, world_size=2, timeout=timedelta(seconds=60))

        def identities() -> list[tuple[int, int]]:
            return [(e[1].job_id, e[1].nonce) for e in context().ina_sessions.values() if isinstance(e, tuple)]

        init("main")
        sums = []
        for _ in range(5):
            barrier.wait(GUARD / 2)  # each call of one world overlaps a call of the other
            t = torch.full((5000,), value)
            all_reduce(t, algorithm="ina", topology=Topology.from_env(), timeout=30)
            sums.append(sorted(set(t.tolist())))
        identity = identities()
        destroy()
        dist.destroy_process_group()
        # docs/faults.md row 30, the INA part: init -> ina all_reduce -> destroy with the collector off leaks no
        # socket, file descriptor or thread (sessions close explicitly; nothing cyclic holds them).
        gc.disable()
        counts = []
        for c in range(4):
            init(f"cycle{c}")
            t = torch.full((100,), value)
            all_reduce(t, algorithm="ina", topology=Topology.from_env(), timeout=30)
            assert torch.equal(t, torch.full((100,), 2 * value))
            destroy()
            dist.destroy_process_group()
            counts.append((len(os.listdir("/proc/self/fd")), threading.active_count()))
        open_sessions = sum(1 for o in gc.get_objects() if isinstance(o, InaSession) and not o.closed)
        gc.enable()
        results.put((rank if world == "A" else 2 + rank, "ok", (world, sums, identity, counts, open_sessions)))
    except BaseException as e:  # noqa: BLE001 - reported to the test with its text
        import traceback

        results.put((rank if world == "A" else 2 + rank, "err", f"{type(e).__name__}: {e}\n{traceback.format_exc()}"))


def test_two_worlds_on_one_switch_never_share_a_job():
    """docs/faults.md row 25: two independent 2-rank worlds (spawned, each with its own FileStore; their
    WORLD groups have the same name, from which job ids used to be derived) call
    all_reduce(t, algorithm="ina", topology=Topology.from_env()) at the same time on one switch:
    world A sends 1.0 and world B 100.0, and on every call A gets exactly 2.0 and B exactly 200.0; the
    ranks of a world agree on one job identity and the two worlds never share it. Then (docs/faults.md row 30,
    INA part) init -> ina all_reduce -> destroy cycles with the garbage collector off leave no file
    descriptor, thread or open session behind."""
    ctx = mp.get_context("spawn")
    with SwitchProcess() as sw, tempfile.TemporaryDirectory() as tmp:
        results = ctx.Queue()
        barrier = ctx.Barrier(4)
        address = f"{sw.address[0]}:{sw.address[1]}"
        procs = [ctx.Process(target=_world_rank, args=(world, r, tmp, address, value, barrier, results),
                             daemon=True, name=f"{world}{r}")
                 for world, value in (("A", 1.0), ("B", 100.0)) for r in range(2)]
        out = _run(procs, results)
        stats = sw.stats()
    by_world: dict[str, list[Any]] = {"A": [], "B": []}
    for _, _, (world, sums, identity, counts, open_sessions) in out:
        expected = 2.0 if world == "A" else 200.0
        assert sums == [[expected]] * 5, f"world {world}: got {sums}, expected only {expected} on every call"
        assert len(identity) == 1, identity
        by_world[world].append(identity[0])
        first, last = counts[0], counts[-1]
        assert last[0] <= first[0] and last[1] == first[1], f"world {world}: fds/threads {counts}"
        assert open_sessions == 0
    id_a0, id_a1 = by_world["A"]
    id_b0, id_b1 = by_world["B"]
    assert id_a0 == id_a1 and id_b0 == id_b1, "the ranks of a world must share one job identity"
    assert id_a0 != id_b0, f"two independent worlds share the job identity {id_a0}"
    assert stats["foreign_dropped"] == 0 and stats["joins_refused"] == 0, stats
    assert stats["epochs"] == 2 + 2 * 4 and stats["jobs_active"] == 0, stats


def _doomed_worker(address: tuple[str, int], job: int, started: Any) -> None:
    torch.set_num_threads(1)
    with InaSession(address, job_id=job, worker_id=2, num_workers=3, timeout=60.0) as s:
        while True:
            s.all_reduce(torch.ones(50000))
            started.set()


def test_killed_worker_survivors_raise_then_next_job(tmp_path):
    """docs/faults.md row 26: a worker process is SIGKILLed mid-job: the two survivors raise CommTimeoutError
    within timeout + slack, naming it; the job's slots are freed when its next incarnation (2 workers,
    same job id) joins, and that job succeeds."""
    timeout, job = 3.0, 4242
    ctx = mp.get_context("spawn")
    with SwitchProcess() as sw:
        started = ctx.Event()
        child = ctx.Process(target=_doomed_worker, args=(sw.address, job, started), daemon=True,
                            name="doomed")
        child.start()
        outcome: dict[int, Any] = {}
        killed_at: list[float] = []

        def survivor(w: int) -> None:
            try:
                with InaSession(sw.address, job_id=job, worker_id=w, num_workers=3, timeout=timeout) as s:
                    s.all_reduce(torch.ones(50000), timeout=GUARD / 2)  # waits for the child's start-up
                    while True:
                        s.all_reduce(torch.ones(50000))
            except CommTimeoutError as e:
                outcome[w] = (e, time.monotonic())
            except BaseException as e:  # noqa: BLE001 - reported below
                outcome[w] = (e, time.monotonic())

        threads = [threading.Thread(target=survivor, args=(w,), daemon=True) for w in (0, 1)]
        try:
            for t in threads:
                t.start()
            assert started.wait(GUARD / 2), "the doomed worker never completed an all-reduce"
            time.sleep(0.2)
            os.kill(child.pid, signal.SIGKILL)
            killed_at.append(time.monotonic())
            for t in threads:
                t.join(timeout + 15)
            assert not any(t.is_alive() for t in threads), "survivors did not raise within the guard"
        finally:
            if child.is_alive():
                child.kill()
            child.join(5)
        for w in (0, 1):
            err, when = outcome[w]
            assert isinstance(err, CommTimeoutError), f"worker {w}: {type(err).__name__}: {err}"
            assert when - killed_at[0] <= timeout + 3.0, f"worker {w} raised {when - killed_at[0]:.1f}s after kill"
            assert err.ranks in ([2], None) and "seq=" in str(err)
        before = sw.stats()
        done: dict[int, torch.Tensor] = {}

        def next_job(w: int) -> None:
            with InaSession(sw.address, job_id=job, worker_id=w, num_workers=2, timeout=20.0) as s:
                t = torch.full((20000,), float(w + 1))
                s.all_reduce(t)
                done[w] = t

        threads = [threading.Thread(target=next_job, args=(w,), daemon=True) for w in (0, 1)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
        assert sorted(done) == [0, 1]
        for t in done.values():
            assert torch.equal(t, torch.full((20000,), 3.0))
        after = sw.stats()
        assert after["epochs"] == before["epochs"] + 1
        # The dead job's partition was reset by the new epoch and freed when both sessions left.
        assert after["jobs_released"] == before["jobs_released"] + 1
        assert after["jobs_active"] == before["jobs_active"] - 1


def test_backend_switch_address_from_options_or_environment(tmp_path, monkeypatch):
    """docs/faults.md row 29 (configuration): init_process_group("ina") takes the switch from InaOptions, or
    from COMMOPT_INA_SWITCH alone (no layout variables, as under torchrun without COMMOPT_NODES), and
    says what to do when neither names one."""
    import torch.distributed as dist

    from commopt.comm.errors import CommError
    from commopt.comm.ina import InaOptions

    if dist.is_initialized():
        pytest.skip("this process already has a default process group")
    for var in ("COMMOPT_INA_SWITCH", "COMMOPT_NODES", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(var, raising=False)
    with pytest.raises(CommError, match="no switch address.*COMMOPT_INA_SWITCH"):
        dist.init_process_group("ina", store=dist.FileStore(str(tmp_path / "a"), 1), rank=0, world_size=1)
    with SwitchProcess() as switch:  # its own: a one-rank job on it
        address = f"{switch.address[0]}:{switch.address[1]}"
        for i, options in enumerate((InaOptions(switch=address), None)):
            if options is None:
                monkeypatch.setenv("COMMOPT_INA_SWITCH", address)  # and no COMMOPT_NODES / LOCAL_WORLD_SIZE
            dist.init_process_group("ina", store=dist.FileStore(str(tmp_path / f"s{i}"), 1), rank=0, world_size=1,
                                    pg_options=options)
            try:
                assert dist.get_backend() == "ina"
                pg = dist.group.WORLD
                assert pg.session.address == switch.address
                t = torch.ones(3, dtype=torch.bfloat16)
                dist.all_reduce(t)
                assert torch.equal(t, torch.ones(3, dtype=torch.bfloat16))
            finally:
                dist.destroy_process_group()


def test_ina_switch_from_env_needs_no_layout(monkeypatch):
    """docs/faults.md row 29 (configuration): COMMOPT_INA_SWITCH is read without any layout variable; unset
    gives None; a malformed value is a TopologyError naming the variable and the 'host:port' form,
    from the accessor, from Topology.from_env() and from init_process_group("ina")."""
    import torch.distributed as dist

    from commopt.comm import Topology
    from commopt.comm.errors import TopologyError
    from commopt.comm.topology import ina_switch_from_env

    for var in ("COMMOPT_INA_SWITCH", "COMMOPT_NODES", "LOCAL_WORLD_SIZE", "MPI_LOCALNRANKS",
                "OMPI_COMM_WORLD_LOCAL_SIZE"):
        monkeypatch.delenv(var, raising=False)
    assert ina_switch_from_env() is None
    monkeypatch.setenv("COMMOPT_INA_SWITCH", "")
    assert ina_switch_from_env() is None
    for text, expected in (("127.0.0.1:5555", ("127.0.0.1", 5555)), (" switch.local:65535 ", ("switch.local", 65535)),
                           ("[::1]:9", ("::1", 9))):
        monkeypatch.setenv("COMMOPT_INA_SWITCH", text)
        assert ina_switch_from_env() == expected
    monkeypatch.setenv("COMMOPT_NODES", "0")
    monkeypatch.setenv("COMMOPT_INA_SWITCH", "127.0.0.1:5555")
    assert Topology.from_env().ina_switch == "127.0.0.1:5555"  # from_env() reads it through the accessor
    monkeypatch.delenv("COMMOPT_NODES")
    for bad in ("127.0.0.1", "127.0.0.1:", ":5555", "host:port", "host:0", "host:65536", "host:-1", "[]:80"):
        monkeypatch.setenv("COMMOPT_INA_SWITCH", bad)
        with pytest.raises(TopologyError) as info:
            ina_switch_from_env()
        text = str(info.value)
        assert f"COMMOPT_INA_SWITCH={bad!r}" in text and "'host:port'" in text and "malformed" in text, text
    monkeypatch.setenv("COMMOPT_INA_SWITCH", "127.0.0.1")
    if not dist.is_initialized():
        with tempfile.TemporaryDirectory() as tmp:
            with pytest.raises(TopologyError, match="COMMOPT_INA_SWITCH='127.0.0.1' is malformed"):
                dist.init_process_group("ina", store=dist.FileStore(os.path.join(tmp, "s"), 1), rank=0,
                                        world_size=1)
        assert not dist.is_initialized()


@pytest.mark.parametrize("dummy", [0])
def test_import_registers_backend_idempotently(dummy):
    """docs/faults.md row 30: importing commopt.comm.ina registers "ina" once; registering again is a no-op."""
    import torch.distributed as dist

    import commopt.comm.ina as ina

    ina.register_backend()
    ina.register_backend()
    assert "ina" in dist.Backend.backend_list and dist.Backend.backend_list.count("ina") == 1
