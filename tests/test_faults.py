"""The fault matrix rows that belong to the collectives, the engine and the hook (issue 9).

Rows covered here: 2 (op mismatch after 100 good ops), 4 (a rank never enters), 5 (a rank killed
mid-collective), 6 (an exception inside a comm hook), 30 (lifecycle leaks). Rows 1 and 3 are in
test_collectives.py (validation), 7-12 and 23 in test_collectives.py / test_topology.py, 14 and
19-22 in test_hooks.py, 31 in test_mpi.py; the compression, INA and cluster rows in their files.
Timeouts are short and explicit; every pool call has a wall-clock guard of timeout + slack.
"""

from __future__ import annotations

import os
import signal
import threading
import time
import warnings
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from _pool import RankPool
from torch.nn.parallel import DistributedDataParallel as DDP

from commopt.comm import Topology, all_reduce, destroy, hooks
from commopt.comm.errors import CollectiveMismatchError, CommError, CommTimeoutError

TIMEOUT = 4.0  # seconds a collective may take before the survivors give up
# The timeout of the call a peer never enters or dies in (rows 4 and 5): every such case waits it
# out, so it is short; the calls that set a case up (groups made, in step) keep a long one, since
# on 2 busy cores making groups can take longer than this.
ABSENT = 2.0
SETUP = 60.0
SLACK = 10.0  # room for a cold process on 2 busy cores


def _op_mismatch():
    from commopt.comm import all_to_all

    rank = dist.get_rank()
    destroy()  # start the sequence numbers of this process's validated ops from zero
    topo = Topology.from_spec("2x2")
    for i in range(100):
        t = torch.full((8,), float(i))
        all_reduce(t, topology=topo, algorithm="flat", validate=True)
        assert t[0].item() == 4 * i
    x = torch.arange(8.0)
    try:
        if rank == 3:
            all_to_all(torch.empty(8), x, topology=topo, validate=True)
        else:
            all_reduce(x, topology=topo, validate=True)
    except CollectiveMismatchError as exc:
        return exc.seq, exc.ranks, str(exc)
    return None


def test_op_mismatch_after_100_good_ops(ranks):
    """docs/faults.md row 2: names both ops and the sequence number, on every rank."""
    for seq, bad, msg in ranks(4, _op_mismatch, timeout=120):
        assert seq == 100 and bad == [3]
        assert "rank 0: all_reduce #100" in msg and "rank 3: all_to_all #100" in msg


def _never_enters(algo: str, validate: bool):
    rank = dist.get_rank()
    topo = Topology.from_spec("2x2")
    all_reduce(torch.ones(4), topology=topo, algorithm=algo, timeout=SETUP)  # groups made, in step
    if rank == 1:
        time.sleep(ABSENT + 2)
        return None
    start = time.monotonic()
    try:
        all_reduce(torch.ones(1000), topology=topo, algorithm=algo, validate=validate, timeout=ABSENT)
    except CommTimeoutError as exc:
        return time.monotonic() - start, exc.ranks, str(exc)
    return "completed"


@pytest.mark.parametrize("algo,validate", [("flat", False), ("hierarchical", False), ("leader", True),
                                           ("hierarchical", True)])
def test_rank_never_enters(algo, validate):
    """docs/faults.md row 4: the others raise CommTimeoutError between timeout and timeout + slack; with
    validation on, the error names the missing rank."""
    pool = RankPool(4)
    try:
        res = pool.run(_never_enters, algo, validate, timeout=ABSENT + SLACK + 30)
    finally:
        pool.close(graceful=False)
    for rank, r in enumerate(res):
        if rank == 1:
            continue
        assert r != "completed" and r is not None
        elapsed, missing, msg = r
        assert ABSENT - 0.5 <= elapsed <= ABSENT + SLACK, elapsed
        if validate:
            assert missing == [1] and "ranks [1] never arrived" in msg


def _killed(mode: str, algo: str):
    from commopt.comm import all_to_all

    rank = dist.get_rank()
    topo = Topology.from_spec("2x2")
    n = 1 << 21
    all_reduce(torch.ones(8), topology=topo, algorithm=algo if algo != "2d" else "flat", timeout=SETUP)
    if algo == "2d":
        all_to_all(torch.empty(8), torch.ones(8), topology=topo, algorithm="2d")
    if rank == 2:
        if algo == "2d":
            all_to_all(torch.empty(n), torch.ones(n), topology=topo, algorithm="2d", async_op=True)
        else:
            all_reduce(torch.ones(n), topology=topo, algorithm=algo, async_op=True)
        time.sleep(0.02)  # mid-collective: the others are already exchanging with this rank
        if mode == "exit":
            os._exit(1)
        os.kill(os.getpid(), signal.SIGKILL if mode == "kill" else signal.SIGTERM)
        time.sleep(60)
    start = time.monotonic()
    error = None
    try:
        # The first call matches the one the victim issued before dying (on an idle machine the
        # victim may finish its part in time); the second cannot complete.
        for _ in range(2):
            if algo == "2d":
                all_to_all(torch.empty(n), torch.ones(n), topology=topo, algorithm="2d", timeout=ABSENT)
            else:
                all_reduce(torch.ones(n), topology=topo, algorithm=algo, timeout=ABSENT)
    except CommError as exc:
        error = type(exc).__name__
    elapsed = time.monotonic() - start
    destroy()  # the engine's threads must exit even though a peer died mid-phase
    deadline = time.monotonic() + ABSENT + 5  # a phase already waiting ends within its timeout
    while time.monotonic() < deadline and any(t.name.startswith("commopt-engine") and t.is_alive()
                                              for t in threading.enumerate()):
        time.sleep(0.05)
    left = [t.name for t in threading.enumerate() if t.name.startswith("commopt-engine") and t.is_alive()]
    return error, elapsed, left


@pytest.mark.parametrize("mode,algo", [
    ("kill", "hierarchical"), ("term", "flat"),
    # 2-D: the intra-node phase between two survivors can complete after destroy(); its successor
    # once started a fresh worker thread that nothing stopped (Engine._worker now refuses).
    ("exit", "2d"),
])
def test_rank_killed_mid_collective(mode, algo):
    """docs/faults.md row 5: survivors raise within timeout + slack; the engine's threads exit."""
    pool = RankPool(4)
    try:
        res = pool.run(_killed, mode, algo, timeout=ABSENT + SLACK + 40, allow_dead=True)
    finally:
        pool.close(graceful=False)
    assert res[2] is None
    for rank in (0, 1, 3):
        error, elapsed, left = res[rank]
        assert error in ("CommError", "CommTimeoutError"), res[rank]
        assert elapsed <= 2 * ABSENT + SLACK
        assert left == [], left
    assert not [p for p in pool._procs if p.is_alive()]  # no orphans


def _hook_raises():
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    ddp = DDP(model, bucket_cap_mb=0.0001)
    state = hooks.AllReduceState(Topology.from_spec("1x2"), algorithm="flat", timeout=TIMEOUT)
    if rank == 1:
        def failing(st, bucket):  # a user's hook wrapping ours, failing asynchronously at step 1
            step = st.step

            def boom(f):
                value = f.value()
                if step >= 1:
                    raise ZeroDivisionError("injected failure in the comm hook")
                return value

            return hooks.allreduce_hook(st, bucket).then(boom)

        ddp.register_comm_hook(state, failing)
    else:
        hooks.register(ddp, state)
    x = torch.randn(3, 4)
    try:
        for _ in range(3):
            ddp(x).sum().backward()
    except Exception as exc:  # noqa: BLE001 - the test inspects what reached backward()
        return type(exc).__name__, str(exc)
    return None


def test_exception_in_hook_reaches_backward():
    """docs/faults.md row 6: the failing rank's backward carries the original type and message; the others
    raise instead of hanging."""
    pool = RankPool(2)  # the ranks end out of step: processes of their own, not the shared pool's
    try:
        res = pool.run(_hook_raises, timeout=TIMEOUT + SLACK + 60)
    finally:
        pool.close(graceful=False)
    name, msg = res[1]
    assert "ZeroDivisionError" in msg and "injected failure in the comm hook" in msg
    assert res[0] is not None  # rank 0 did not hang: its next collective failed
    assert "CommTimeoutError" in res[0][1] or "CommError" in res[0][1]


def _lifecycle(store_dir: str, cycles: int):
    import gc

    import torch.distributed as dist

    from commopt.comm import all_to_all
    from commopt.comm.compression import PowerSGDCompressor

    rank = dist.get_rank()
    destroy()  # commopt's groups of earlier tests in this pool, before their parent goes
    dist.destroy_process_group()  # the pool's own group; the pool is replaced after this test

    def census():
        # OS threads (gloo's and the engine's), descriptors (sockets, listeners included).
        return len(os.listdir("/proc/self/fd")), len(os.listdir("/proc/self/task"))

    counts = []
    gc.disable()  # nothing may depend on the collector: no cycle may hold a group, thread or socket
    try:
        for i in range(cycles):
            store = dist.FileStore(os.path.join(store_dir, f"c{i}"), 4)
            dist.init_process_group("gloo", store=store, rank=rank, world_size=4)
            topo = Topology.from_spec("2x2")
            t = torch.ones(1000)
            all_reduce(t, topology=topo, algorithm="hierarchical")
            all_reduce(t, topology=topo, algorithm="leader", async_op=True).wait()
            assert t[0].item() == 16.0
            out = all_to_all(torch.empty(8), torch.full((8,), float(rank)), topology=topo, algorithm="2d")
            assert out.tolist() == [float(r) for r in range(4) for _ in range(2)]
            g = torch.ones(16, 8)
            PowerSGDCompressor(rank=1, start_iter=0).all_reduce(g, topology=topo, algorithm="hierarchical")
            destroy()
            dist.destroy_process_group()
            del store
            counts.append(census())
    finally:
        gc.enable()
    leaked = counts[-1][0] > counts[1][0] + 2 or counts[-1][1] > counts[1][1]
    # Leave the pool's rank with a working WORLD group again for the tests that follow.
    dist.init_process_group("gloo", store=dist.FileStore(os.path.join(store_dir, "final"), 4), rank=rank,
                            world_size=4)
    return counts[1], counts[-1], leaked


def test_lifecycle_leaks_nothing(ranks, tmp_path):
    """docs/faults.md row 30: 20 cycles of init -> hierarchical, async leader, 2-D all-to-all, hierarchical
    PowerSGD -> destroy on a 2x2, with the garbage collector off, leak no OS threads or file
    descriptors (sockets and listeners included). The INA paths: test_ina_procs.py; the other
    compressors: test_compression_faults.py."""
    res = ranks(4, _lifecycle, str(tmp_path), 20, timeout=300)
    for first, last, leaked in res:
        assert not leaked, (first, last)


# --------------------------------------------------------------------------------- every entry point
_ENTRY_POINTS = [
    ("all_reduce", "flat"), ("all_reduce", "hierarchical"), ("all_reduce", "leader"),
    ("reduce_scatter", "flat"), ("reduce_scatter", "hierarchical"),
    ("all_gather", "flat"), ("all_gather", "hierarchical"),
    ("all_to_all", "flat"), ("all_to_all", "2d"),
    ("hook", "flat"), ("hook", "hierarchical"),
]


def _call(entry: str, algo: str, topo, timeout: float, async_op: bool, ddp=None):
    """One call of a public entry point on a 2x2 world (the same on every rank)."""
    from commopt.comm import all_gather, all_to_all, reduce_scatter

    n = 4096
    if entry == "all_reduce":
        out = all_reduce(torch.ones(n), topology=topo, algorithm=algo, timeout=timeout, async_op=async_op)
    elif entry == "reduce_scatter":
        out = reduce_scatter(torch.empty(n), torch.ones(4 * n), topology=topo, algorithm=algo, timeout=timeout,
                             async_op=async_op)
    elif entry == "all_gather":
        out = all_gather(torch.empty(4 * n), torch.ones(n), topology=topo, algorithm=algo, timeout=timeout,
                         async_op=async_op)
    elif entry == "all_to_all":
        out = all_to_all(torch.empty(n), torch.ones(n), topology=topo, algorithm=algo, timeout=timeout,
                         async_op=async_op)
    else:
        ddp(torch.ones(2, 8)).sum().backward()
        return None
    return out.wait() if async_op else out


def _absent_matrix(store_dir: str, cases: list, timeout: float):
    """Each case in a fresh 4-rank world: rank 1 is alive but never enters the call (cold: the first
    call of its kind, groups not yet made; warm: after one good call, made with a long timeout). The
    others must raise a CommError (CommTimeoutError where commopt's own bound fired) within timeout +
    slack. The last case's world is left as it is, stuck work and all: the pool is replaced after
    every batch, so no rank waits for gloo's own timeout to end what the absent rank left stuck (an
    asynchronous case, or a hook's, leaves such a work; destroying its group waits for it)."""
    rank = dist.get_rank()
    dist.destroy_process_group()  # the pool's own group; the pool is replaced after this test
    results = []
    for i, (entry, algo, warm, async_op) in enumerate(cases):
        os.makedirs(store_dir, exist_ok=True)
        store = dist.FileStore(os.path.join(store_dir, f"case{i}"), 4)
        # gloo's own operation timeout short too: a work left stuck by the case ends in seconds, so
        # that destroy_process_group() does not wait for it long.
        dist.init_process_group("gloo", store=store, rank=rank, world_size=4,
                                timeout=timedelta(seconds=timeout + SLACK))
        topo = Topology.from_spec("2x2")
        ddp = state = None
        if entry == "hook":
            torch.manual_seed(0)
            ddp = DDP(nn.Linear(8, 4))
            state = hooks.AllReduceState(topo, algorithm=algo, timeout=SETUP)
            hooks.register(ddp, state)
        # Warm DDP: two steps, so that DDP's own bucket rebuild (a broadcast of its own at the second
        # forward) is behind us and the only collectives left are the hook's.
        for _ in range(warm * (2 if entry == "hook" else 1)):
            _call(entry, algo, topo, SETUP, async_op, ddp)
        if state is not None:
            state.timeout = timeout
        outcome = None
        if rank == 1:
            # Alive, and holding its connections open until the others have given up.
            store.wait(["given-up"], timedelta(seconds=timeout + SLACK + 30))
        else:
            start = time.monotonic()
            try:
                _call(entry, algo, topo, timeout, async_op, ddp)
                outcome = ("returned", time.monotonic() - start, "")
            except Exception as exc:  # noqa: BLE001 - the test inspects what was raised
                outcome = (type(exc).__name__, time.monotonic() - start, str(exc)[:300])
            if store.add("gave-up", 1) == 3:
                store.set("given-up", "1")
        results.append(outcome)
        if ddp is not None:
            # Never freed in this process (the pool is replaced after a hook case): DDP's reducer
            # holds WORLD's gloo group, whose destructor joins its worker thread while holding the
            # GIL, and that thread, ending the call left stuck by the absent rank (gloo's own
            # timeout), runs a Python done-callback that needs the GIL: a deadlock whenever the
            # reducer is freed before gloo's timeout fires (see the report of issue 27, item 6).
            _HELD.append(ddp)
        if i < len(cases) - 1:
            destroy()
            dist.destroy_process_group()
    return results


_HELD: list = []  # per rank process: the DDP models of the hook cases (see _absent_matrix)


def test_every_entry_point_bounded_by_its_timeout(tmp_path):
    """docs/faults.md row 4, for every public entry point and algorithm, cold (group creation) and warm, sync and
    async: with one rank alive but absent, every other rank raises within timeout + slack (never a
    hang: gloo's future-less reduce-scatter and the creation of derived groups are bounded too)."""
    timeout = 1.5
    cases = [(e, a, warm, False) for e, a in _ENTRY_POINTS if e != "hook" for warm in (False, True)]
    # An asynchronous case leaves a work stuck until gloo's own timeout (timeout + SLACK), which
    # the next case's teardown would wait for: each is the last of its batch (see _absent_matrix).
    asynchronous = [("reduce_scatter", "flat", True, True), ("all_reduce", "hierarchical", False, True),
                    ("all_to_all", "2d", True, True)]
    # DDP is not reusable in a process once a backward has failed (its reducer keeps the failed
    # step), so each hook case gets processes of its own.
    batches = [cases + asynchronous[:1]] + [[c] for c in asynchronous[1:]]
    batches += [[("hook", a, warm, False)] for e, a in _ENTRY_POINTS if e == "hook" for warm in (False, True)]
    pool = RankPool(4)
    res: list[list] = [[] for _ in range(4)]
    try:
        for i, batch in enumerate(batches):
            if i:
                pool.restart()
            got = pool.run(_absent_matrix, str(tmp_path / f"batch{i}"), batch, timeout,
                           timeout=len(batch) * (timeout + SLACK) + 60)
            for rank in range(4):
                res[rank] += got[rank]
    finally:
        pool.close(graceful=False)
    cases = [c for batch in batches for c in batch]
    for rank in (0, 2, 3):
        assert len(res[rank]) == len(cases), (rank, len(res[rank]), len(cases))
        for case, (kind, elapsed, msg) in zip(cases, res[rank]):
            assert kind in ("CommTimeoutError", "CommError", "RuntimeError"), (rank, case, kind, msg)
            if kind == "RuntimeError":  # DDP wraps a hook's failure; the original type stays in its text
                assert case[0] == "hook" and ("CommTimeoutError" in msg or "CommError" in msg), (rank, case, msg)
            assert elapsed <= timeout + SLACK, (rank, case, elapsed)


# --------------------------------------------------------------------------------- mismatch, no validation
def _mismatch_cases(world: int, spec: str) -> list[tuple[str, str]]:
    """(case, what differs) for one world and topology: every collective x algorithm x the ways its
    ranks' calls can differ (count, shape, dtype, block, rows, width, split mode, splits)."""
    two_level = spec == "2x2"
    ar = ["flat", "auto"] + (["hierarchical", "leader"] if two_level else [])
    rs_ag = ["flat"] + (["hierarchical"] if two_level else [])
    a2a = ["flat"] + (["2d"] if two_level else [])
    cases = []
    for algo in ar:
        cases += [(f"all_reduce {algo}", d) for d in ("count 7 vs 8", "shape [20,2] vs [20,10]", "ndim [8] vs [2,8]",
                                                      "dtype fp32 vs fp64", "dtype fp32 vs int32", "op sum vs max")]
    for algo in rs_ag:
        cases += [(f"reduce_scatter {algo}", d) for d in ("block 7 vs 8", "dtype fp32 vs bf16")]
        cases += [(f"all_gather {algo}", d) for d in ("count 4 vs 5", "dtype fp32 vs fp64")]
    for algo in a2a:
        cases += [(f"all_to_all {algo}", d) for d in ("rows 8 vs 4", "width 2 vs 3", "dtype fp32 vs int32",
                                                      "splits given vs even", "out_splits disagree",
                                                      "output rows vs what peers send", "bad in_splits on one rank")]
    for algo in ["flat"] + (["hierarchical"] if two_level else []):
        cases += [(f"powersgd {algo}", d) for d in ("width [16,4] vs [16,8]", "count [16,4] vs [20,4]")]
        cases += [(f"fp16 {algo}", "count 99 vs 100"), (f"int8 {algo}", "count 100 vs 300"),
                  (f"int8 {algo}", "dtype fp32 vs int32")]
    return cases


def _mismatched_call(case: str, differs: str, odd: bool, topo):
    """One call whose arguments differ on the ``odd`` rank (``validate=False``): returns or raises."""
    from commopt.comm import all_to_all, compression, reduce_scatter
    from commopt.comm.collectives import all_gather

    kind, algo = case.split()
    world = topo.world_size

    def tensor(default, other):
        shape, dtype = other if odd else default
        return torch.ones(shape, dtype=dtype)

    f32, f64 = torch.float32, torch.float64
    if kind == "all_reduce":
        op = dist.ReduceOp.MAX if odd and differs == "op sum vs max" else dist.ReduceOp.SUM
        t = {"count 7 vs 8": lambda: tensor((7, f32), (8, f32)),
             "shape [20,2] vs [20,10]": lambda: tensor(((20, 2), f32), ((20, 10), f32)),
             "ndim [8] vs [2,8]": lambda: tensor(((8,), f32), ((2, 8), f32)),
             "dtype fp32 vs fp64": lambda: tensor((8, f32), (8, f64)),
             "dtype fp32 vs int32": lambda: tensor((8, f32), (8, torch.int32)),
             "op sum vs max": lambda: tensor((8, f32), (8, f32))}[differs]()
        return all_reduce(t, op, topology=topo, algorithm=algo, timeout=TIMEOUT)
    if kind == "reduce_scatter":
        n, dtype = (8, torch.bfloat16 if differs.startswith("dtype") else f32) if odd else (7 if "block" in differs
                                                                                            else 8, f32)
        return reduce_scatter(torch.empty(n, dtype=dtype), torch.ones(world * n, dtype=dtype), topology=topo,
                              algorithm=algo, timeout=TIMEOUT)
    if kind == "all_gather":
        n, dtype = (5 if "count" in differs else 4, f64 if "dtype" in differs else f32) if odd else (4, f32)
        return all_gather(torch.empty(world * n, dtype=dtype), torch.ones(n, dtype=dtype), topology=topo,
                          algorithm=algo, timeout=TIMEOUT)
    if kind == "all_to_all":
        rows, width, dtype = 2 * world, 2, f32
        kw = {}
        if differs == "rows 8 vs 4" and odd:
            rows = world
        elif differs == "width 2 vs 3" and odd:
            width = 3
        elif differs == "dtype fp32 vs int32" and odd:
            dtype = torch.int32
        elif differs == "splits given vs even" and odd:
            kw = {"in_splits": [2] * world}
        elif differs == "out_splits disagree":
            kw = {"in_splits": [2] * world, "out_splits": [3] + [2] * (world - 2) + [1] if odd else [2] * world}
        elif differs == "bad in_splits on one rank":
            kw = {"in_splits": [3] + [2] * (world - 1) if odd else [2] * world}  # sums to 2 * world + 1
        elif differs == "output rows vs what peers send":
            kw = {"in_splits": [2] * world}
            out = torch.empty(2 * world + (1 if odd else 0), width)
            return all_to_all(out, torch.ones(rows, width), topology=topo, algorithm=algo, timeout=TIMEOUT, **kw)
        return all_to_all(torch.empty(rows, width, dtype=dtype), torch.ones(rows, width, dtype=dtype), topology=topo,
                          algorithm=algo, timeout=TIMEOUT, **kw)
    make = {"powersgd": lambda: compression.PowerSGDCompressor(rank=2, start_iter=0),
            "fp16": compression.FP16Compressor, "int8": lambda: compression.QuantizeCompressor(8)}[kind]
    t = {"width [16,4] vs [16,8]": lambda: tensor(((16, 4), f32), ((16, 8), f32)),
         "count [16,4] vs [20,4]": lambda: tensor(((16, 4), f32), ((20, 4), f32)),
         "count 99 vs 100": lambda: tensor((99, f32), (100, f32)),
         "count 100 vs 300": lambda: tensor((100, f32), (300, f32)),
         "dtype fp32 vs int32": lambda: tensor((256, f32), (256, torch.int32))}[differs]()
    return all_reduce(t, topology=topo, algorithm=algo, compressor=make(), timeout=TIMEOUT)


def _mismatch_matrix(specs: list[str]):
    """Every case of :func:`_mismatch_cases` in this one world, back to back: after each, a good call
    shows that the group is still in step and usable."""
    rank, world = dist.get_rank(), dist.get_world_size()
    warnings.simplefilter("ignore")  # PowerSGD without error feedback warns; what it returns is the point
    out = {}
    for spec in specs:
        topo = Topology.from_spec(spec)
        for case, differs in _mismatch_cases(world, spec):
            start = time.monotonic()
            try:
                value = _mismatched_call(case, differs, rank == world - 1, topo)
                got = ("returned", str(value.tolist())[:200])
            except Exception as exc:  # noqa: BLE001 - the test inspects what was raised
                got = (type(exc).__name__, str(exc)[:600])
            elapsed = time.monotonic() - start
            check = all_reduce(torch.full((3,), rank + 1.0), topology=topo, algorithm="flat", timeout=TIMEOUT).tolist()
            out[f"{spec} {case}: {differs}"] = got + (elapsed, check)
    return out


@pytest.mark.parametrize("world,specs", [(2, ["1x2"]), (4, ["1x4", "2x2"])])
def test_mismatch_without_validation_raises_everywhere_before_any_byte_moves(world, specs):
    """docs/faults.md rows 1-3 with validation off (issue 23): for every collective x algorithm x {count,
    shape, dtype, block, rows, width, split mode, splits} disagreement, on 2 and 4 ranks, flat and
    2x2, every rank raises CollectiveMismatchError (the rank with a bad argument of its own:
    ValueError) at once, no process dies (gloo never sees a payload longer than its buffer: the ranks
    agree before any byte moves), no rank returns, and the group is still usable afterwards. A fresh
    world, since a process may die."""
    pool = RankPool(world)
    try:
        res = pool.run(_mismatch_matrix, specs, timeout=300)
    finally:
        pool.close(graceful=False)
    expect = [float(world * (world + 1) / 2)] * 3
    odd = world - 1
    for rank in range(world):
        assert list(res[rank]) == list(res[0])
        for case, (kind, detail, elapsed, check) in res[rank].items():
            bad_argument = rank == odd and "bad in_splits" in case
            assert kind == ("ValueError" if bad_argument else "CollectiveMismatchError"), (rank, case, kind, detail)
            assert elapsed < TIMEOUT, (rank, case, elapsed, "not at once: the agreement timed out")
            assert check == expect, (rank, case, check, "the group is out of step after the mismatch")
            if bad_argument:
                assert "sums to" in detail and "the other ranks raise CollectiveMismatchError" in detail, detail
            elif "disagree" in case or "output rows" in case:  # the split check names the ranks
                assert "split sizes disagree across ranks" in detail, detail
            else:
                assert "No payload byte moved" in detail and "pass validate=True" in detail, detail
    got = {case.split(" ", 1)[1]: v[1] for case, v in res[0].items() if case.startswith(specs[-1])}
    assert "element count (7 on some rank, 8 on another)" in got["all_reduce flat: count 7 vs 8"]
    assert "reduce op (sum on some rank, max on another)" in got["all_reduce flat: op sum vs max"]
    assert "dtype (torch.float32 on some rank, torch.int32 on another)" in got["all_reduce auto: dtype fp32 vs int32"]
    assert f"rank 0 sends 2 rows to rank {odd}, which expects 3" in got["all_to_all flat: out_splits disagree"]
    assert "uneven splits (in_splits only) on some rank" in got["all_to_all flat: splits given vs even"]
    if world == 4:
        assert "signature" in got["powersgd hierarchical: width [16,4] vs [16,8]"]
        assert "algorithm" not in got["all_reduce hierarchical: count 7 vs 8"].split("differ in")[1].split(";")[0]


# --------------------------------------------------------------------------------- bad input
def _bad_input():
    rank = dist.get_rank()
    errors = {}
    t = torch.ones(4)
    for label, call in [
        ("group='WORLD'", lambda: all_reduce(t, group="WORLD")),
        ("timeout=-1", lambda: all_reduce(t, timeout=-1)),
        ("timeout='3'", lambda: all_reduce(t, timeout="3")),
        ("AllReduceState(compressor='fp16')", lambda: hooks.AllReduceState(compressor="fp16")),
        ("AllReduceState(topology='2x2')", lambda: hooks.AllReduceState(topology="2x2")),
        ("AllReduceState(process_group='x')", lambda: hooks.AllReduceState(process_group="x")),
        ("AllReduceState(algorithm='ring')", lambda: hooks.AllReduceState(algorithm="ring")),
    ]:
        try:
            call()
            errors[label] = None
        except (TypeError, ValueError) as exc:
            errors[label] = (type(exc).__name__, str(exc))
    ddp = DDP(nn.Linear(4, 2))
    for label, state in [("register(ddp, {})", {}), ("register(ddp, None)", None)]:
        try:
            hooks.register(ddp, state)
            errors[label] = None
        except TypeError as exc:
            errors[label] = ("TypeError", str(exc))
    # timeout=inf means no bound of commopt's own; a leaf that requires grad averages like torch's
    # own collectives write it (invisibly to autograd), and SUM and AVG agree.
    inf = all_reduce(torch.full((3,), float(rank)), timeout=float("inf")).tolist()
    leaf = torch.full((5,), float(rank + 1), requires_grad=True)
    all_reduce(leaf, dist.ReduceOp.AVG)
    return errors, inf, leaf.detach().tolist(), leaf.requires_grad, leaf.is_leaf


def test_bad_input_is_a_clear_error_on_every_rank(ranks):
    """Bad arguments (the matrix's clear-error rule, row 3 for types): a TypeError or ValueError at the
    call, on every rank, saying what to pass; nothing hangs, and the input is not changed."""
    for errors, inf, leaf, requires_grad, is_leaf in ranks(2, _bad_input, timeout=60):
        for label, err in errors.items():
            assert err is not None, f"{label} was accepted"
        assert errors["group='WORLD'"][0] == "TypeError" and "ProcessGroup or None" in errors["group='WORLD'"][1]
        assert errors["timeout=-1"][0] == "ValueError"
        assert errors["timeout='3'"][0] == "TypeError"
        assert "FP16Compressor()" in errors["AllReduceState(compressor='fp16')"][1]
        assert "Topology.from_spec('2x2')" in errors["AllReduceState(topology='2x2')"][1]
        assert errors["AllReduceState(algorithm='ring')"][0] == "ValueError"
        assert "AllReduceState" in errors["register(ddp, {})"][1]
        assert inf == [1.0, 1.0, 1.0]
        assert leaf == [1.5] * 5 and requires_grad and is_leaf
