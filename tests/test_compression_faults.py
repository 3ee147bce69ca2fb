"""The compression rows of the fault matrix: timeouts, mismatches, leaks and bad input (issue 10).

Rows covered here for the compressed paths (``compressor.all_reduce`` and the DDP hook with a
compressor): 4 (a rank alive but never entering), 1/3 without validation (a size or dtype mismatch
ends loudly, never a normal return with wrong values), 30 (lifecycle leaks) and the preamble's
clear errors for bad input at the call (22: sparse tensors). The plain collectives' rows are in
test_faults.py.

Timeout tests need a fresh ``RankPool(4)`` (a timed-out collective leaves its groups out of step);
to keep them few, one pool runs every case: each case reduces over a parent group of its own
(``dist.new_group`` of all four ranks), so its derived groups are fresh, and the cases of a wave run
at once where they can (the warm ones: one timeout of waiting for all of them; group creation is
serialised, so the cold ones wait one timeout each).
"""

from __future__ import annotations

import gc
import os
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
ABSENT = 2.0  # the timeout of the calls a rank never enters (row 4): every cold case waits it out
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
        ddp, _ = _ddp(topo, name, algo, ABSENT)
        return lambda: ddp(x).sum().backward()
    c = _compressor(name)
    return lambda: c.all_reduce(x.clone(), group=topo.group, topology=topo, algorithm=algo,
                                error_feedback=C.ErrorFeedback(), timeout=ABSENT)


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
        state.timeout = ABSENT
        hooks.append((name, algo, ddp))
    dist.barrier()
    if rank != ABSENT:
        done = []
        for name, algo, c, topo, ef in warm:
            label, start, ev = f"warm/all_reduce/{name}/{algo}", time.monotonic(), threading.Event()
            fut = c.all_reduce(x.clone(), group=topo.group, topology=topo, algorithm=algo, error_feedback=ef, step=1,
                               timeout=ABSENT, async_op=True)

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
            t.join(ABSENT + SLACK + 5)
        for ev in done:
            ev.wait(ABSENT + SLACK + 5)
    dist.barrier()
    return out


def test_compressed_rank_never_enters():
    """docs/faults.md row 4: with one rank alive but never entering, every other rank's compressed
    reduction raises CommTimeoutError after the timeout and before timeout + slack: ``all_reduce``
    and the DDP hook, flat and hierarchical 2x2, cold (the first call, which creates the groups) and
    warm (after a good call; hierarchical PowerSGD once left rank 0 in gloo's reduce-scatter, whose
    ``wait(timeout)`` is unbounded), with fp16, PowerSGD and int8 spread over the cells."""
    pool = RankPool(4)
    try:
        res = pool.run(_never_enters, timeout=5 * (ABSENT + SLACK) + 60)
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
            assert ABSENT - 0.5 <= elapsed <= ABSENT + SLACK, (rank, label, elapsed, msg)


# ------------------------------------------------------------------------------------------ mismatch
def _mismatch_cases():
    """(label, compressor factory, algorithm, this rank's tensors from (rank, generator)), for ranks
    whose inputs differ in a way gloo itself does not notice (equal staged lengths or bytes)."""
    def vec(n, dtype=torch.float32):
        return lambda rank, g: [torch.randn(n, generator=g, dtype=torch.float64).to(dtype)]

    def odd(rank_fn, a, b):  # rank 0 holds ``a``, the others ``b``
        return lambda rank, g: (a if rank_fn(rank) else b)(rank, g)

    cases = []
    for algo in ("flat", "hierarchical"):  # the case: padded to the same staged length
        cases.append((f"int8/[100] vs [200]/{algo}", lambda: C.QuantizeCompressor(8), algo,
                      odd(lambda r: r == 0, vec(100), vec(200))))
    for name, make in (("topk", lambda: C.TopKCompressor(1.0)), ("randomk", lambda: C.RandomKCompressor(1.0)),
                       ("sign", lambda: C.SignCompressor()), ("onebit", lambda: C.OneBitCompressor()),
                       ("int4", lambda: C.QuantizeCompressor(4, 64))):
        cases.append((f"{name}/[100] vs [200]/flat", make, "flat", odd(lambda r: r == 0, vec(100), vec(200))))
    cases.append(("int8/fp64 vs fp32/flat", lambda: C.QuantizeCompressor(8), "flat",
                  odd(lambda r: r == 0, vec(256, torch.float64), vec(256))))
    # Optimistic compressors (no check phase): the same elements in another dtype (flat), and
    # sizes that differ only within a node while every rail agrees (hierarchical, ranks 0/2 vs 1/3).
    for name, make in (("fp16", C.FP16Compressor), ("bf16", C.BF16Compressor)):
        cases.append((f"{name}/fp64 vs fp32/flat", make, "flat",
                      odd(lambda r: r == 0, vec(300, torch.float64), vec(300))))
        cases.append((f"{name}/[99] vs [100] by local rank/hierarchical", make, "hierarchical",
                      odd(lambda r: r % 2 == 0, vec(99), vec(100))))
    # PowerSGD: fp64 [4032] and fp32 [8128] make payloads of equal bytes, 4096 fp64 and 8192 fp32
    # with the tag (gloo then sums the bytes as different dtypes and returns normally), before
    # start_iter (the exact step) and after; by local rank, another tensor in the bucket.
    for start in (10, 0):
        cases.append((f"powersgd(start_iter={start})/fp64 [4032] vs fp32 [8128]/flat",
                      lambda start=start: C.PowerSGDCompressor(rank=2, start_iter=start), "flat",
                      odd(lambda r: r == 0, vec(4032, torch.float64), vec(8128))))
    cases.append(("powersgd/[24x16] vs [24x16, 8] by local rank/hierarchical",
                  lambda: C.PowerSGDCompressor(rank=2, start_iter=0), "hierarchical",
                  lambda rank, g: [torch.randn(24, 16, generator=g)]
                  + ([torch.randn(8, generator=g)] if rank % 2 else [])))
    return cases


def _mismatches() -> dict:
    from commopt.comm.errors import CollectiveMismatchError

    rank, world = dist.get_rank(), dist.get_world_size()
    out = {}
    for label, make, algo, inputs in _mismatch_cases():
        topo = _fresh_topology()
        tensors = inputs(rank, torch.Generator().manual_seed(rank))
        before = [t.clone() for t in tensors]
        c = make()
        keys = [f"t{i}" for i in range(len(tensors))]
        try:
            C.reduce_tensors(c, tensors, keys, group=topo.group, topology=topo, algorithm=algo,
                             feedback=C.ErrorFeedback(), timeout=20).wait()
            got = "returned normally"
        except CollectiveMismatchError as exc:
            got = "CollectiveMismatchError" if "hold different tensors" in str(exc) else str(exc)
        except Exception as exc:  # noqa: BLE001 - reported to the test
            got = f"{type(exc).__name__}: {exc}"
        unchanged = all(torch.equal(a, b) for a, b in zip(tensors, before))
        # The groups are still in step: the same compressor on agreeing inputs is right (rank + 1
        # everywhere: every compressor here reduces constant blocks exactly, up to rounding).
        y = torch.full((1024,), rank + 1.0)  # whole sign and quantization blocks, no padding
        c.all_reduce(y, group=topo.group, topology=topo, algorithm=algo, error_feedback=C.ErrorFeedback(),
                     step=20, timeout=20)
        out[label] = (got, unchanged, float((y - world * (world + 1) / 2).abs().max()))
    return out


def test_mismatch_without_validation_raises_everywhere(ranks):
    """docs/faults.md rows 1 and 3 without validation: ranks whose inputs differ in size, dtype or shape
    but whose staged payloads have equal lengths (which gloo does not notice) raise
    CollectiveMismatchError on every rank, with the input unchanged, instead of returning wrong
    values; the groups stay in step (the next call is right). Checked compressors carry the input's
    signature in their check phase; optimistic ones (fp16, bf16, PowerSGD) in their first payload
    and, in hierarchical mode, in a node-wide agreement beside the reduce-scatter."""
    res = ranks(4, _mismatches, timeout=180)
    labels = [label for label, *_ in _mismatch_cases()]
    for rank, got in enumerate(res):
        assert list(got) == labels
        for label, (outcome, unchanged, err) in got.items():
            assert outcome == "CollectiveMismatchError", (rank, label, outcome)
            assert unchanged, (rank, label, "a failed call changed its input")
            assert err <= 1e-5 * 10, (rank, label, "the call after the mismatch is wrong", err)


def _sizes_differ_flat_fp16():
    rank = dist.get_rank()
    y = torch.randn(100 if rank == 0 else 200)
    before = y.clone()
    try:
        C.FP16Compressor().all_reduce(y, timeout=TIMEOUT)
    except Exception as exc:  # noqa: BLE001 - the test inspects it
        return f"raised {type(exc).__name__}", torch.equal(y, before)
    return "returned normally", torch.equal(y, before)


def test_optimistic_sizes_differ_flat_ends_loudly():
    """docs/faults.md row 1 without validation, optimistic flat: fp16 payloads of different lengths
    (no check phase runs before the payload) used to end in gloo's own failure, which aborted the
    rank that received too much; a standalone call now agrees on its input first, so every rank
    raises CollectiveMismatchError with its tensor unchanged and no process dies."""
    pool = RankPool(2)
    try:
        res = pool.run(_sizes_differ_flat_fp16, timeout=TIMEOUT + SLACK + 20)
    finally:
        pool.close(graceful=False)
    assert res == [("raised CollectiveMismatchError", True)] * 2, res


# ------------------------------------------------------------------------------------------ lifecycle
def _census() -> tuple[int, int]:
    """(open file descriptors, OS threads) of this process: gloo's sockets, listeners and threads
    are C++ ones, invisible to ``threading``."""
    return len(os.listdir("/proc/self/fd")), len(os.listdir("/proc/self/task"))


def _compressed_lifecycle(store_dir: str, spec: str, cycles: int) -> dict:
    from commopt.comm import destroy
    from commopt.comm.compression.exchange import CompressedReduction
    from commopt.comm.engine import Phase

    rank, world = dist.get_rank(), dist.get_world_size()
    destroy()  # what earlier tests left in this pool's process (its derived groups die next)
    dist.destroy_process_group()  # the pool's own group; a fresh one is made at the end
    gc.collect()
    gc.disable()  # whatever a reference cycle holds stays held: it shows in the census
    counts = []
    try:
        for i in range(cycles):
            store = dist.FileStore(os.path.join(store_dir, f"{spec}-{i}"), world)
            dist.init_process_group("gloo", store=store, rank=rank, world_size=world)
            topo = Topology.from_spec(spec)
            for make in (C.FP16Compressor, lambda: C.PowerSGDCompressor(rank=1, start_iter=0), C.QuantizeCompressor):
                for algo in ("flat", "hierarchical"):
                    t = torch.full((24, 16), rank + 1.0)  # rank-1 and constant: every compressor is exact
                    make().all_reduce(t, topology=topo, algorithm=algo, error_feedback=C.ErrorFeedback(), step=i,
                                      timeout=60)
                    assert torch.allclose(t, torch.full((24, 16), world * (world + 1) / 2), rtol=1e-4), (make, algo)
            destroy()
            dist.destroy_process_group()
            del store, topo, t
            counts.append(_census())
        # What the cycles left for the collector: none of it may be ours (numba's first compile
        # leaves some of its own).
        gc.set_debug(gc.DEBUG_SAVEALL)
        gc.collect()
        held = sorted({type(o).__name__ for o in gc.garbage
                       if isinstance(o, (dist.ProcessGroup, Phase, C.Exchange, CompressedReduction))})
        gc.garbage.clear()
    finally:
        gc.set_debug(0)
        gc.enable()
    dist.init_process_group("gloo", store=dist.FileStore(os.path.join(store_dir, f"{spec}-final"), world),
                            rank=rank, world_size=world)
    return {"first": counts[1], "last": counts[-1], "held": held}


def test_compressed_lifecycle_leaks_nothing(ranks, tmp_path):
    """docs/faults.md row 30 for the compressed paths: cycles of init -> fp16, PowerSGD and int8 reductions
    (flat and hierarchical) -> ``commopt.comm.destroy()`` -> ``destroy_process_group()`` with the
    garbage collector off grow neither file descriptors (gloo's sockets and listeners) nor OS
    threads, and no reference cycle holds a process group, phase, reduction (``CompressedReduction``)
    or job (a phase whose function referred back to it kept every process group of its exchange
    alive: +40 fds and +24 OS threads per cycle on 2 ranks).
    20 cycles on 2 ranks (where 'hierarchical' on one node is flat), 6 on a 2x2."""
    for world, spec, cycles in ((2, "1x2", 20), (4, "2x2", 6)):
        for got in ranks(world, _compressed_lifecycle, str(tmp_path), spec, cycles, timeout=240):
            assert got["last"] == got["first"], (spec, got)
            assert got["held"] == [], (spec, got)


# ------------------------------------------------------------------------------------------ bad input
def _bad_inputs() -> dict:
    import numpy as np
    from torch.distributed import ReduceOp

    rank, world = dist.get_rank(), dist.get_world_size()
    other = dist.new_group(list(range(world)))
    makes = [C.FP16Compressor, C.BF16Compressor, lambda: C.PowerSGDCompressor(start_iter=0),
             lambda: C.TopKCompressor(1.0), lambda: C.RandomKCompressor(1.0), C.SignCompressor,
             C.OneBitCompressor, C.QuantizeCompressor]
    dense = torch.arange(6.0).view(2, 3)
    calls = {  # label -> (tensor, keyword arguments, expected exception, words the message must hold)
        "list": ([1.0, 2.0], {}, TypeError, ["torch.Tensor", "list", "torch.as_tensor"]),
        "None": (None, {}, TypeError, ["torch.Tensor", "NoneType"]),
        "ndarray": (np.ones(4, dtype=np.float32), {}, TypeError, ["torch.Tensor", "ndarray", "torch.as_tensor"]),
        "sparse coo": (dense.to_sparse(), {}, TypeError, ["sparse_coo", "to_dense()"]),
        "sparse csr": (dense.to_sparse_csr(), {}, TypeError, ["sparse_csr", "to_dense()"]),
        "op MAX": (dense, {"op": ReduceOp.MAX}, ValueError, ["ReduceOp.SUM", "AVG"]),
        "algorithm": (dense, {"algorithm": "ring"}, ValueError, ["'ring'", "'hierarchical'"]),
        "error_feedback": (dense, {"error_feedback": {}}, TypeError, ["ErrorFeedback"]),
        "key": (dense, {"key": 3}, TypeError, ["key must be a str"]),
        "step": (dense, {"step": -1}, ValueError, ["step must be an int >= 0"]),
        "timeout": (dense, {"timeout": 0}, ValueError, ["positive number of seconds"]),
        "topology str": (dense, {"topology": "1x2"}, TypeError, ["Topology.from_spec"]),
        "state": (dense, {"state": {}}, TypeError, ["new_state()"]),
        "group str": (dense, {"group": "WORLD"}, TypeError, ["ProcessGroup"]),
        "topology of another group": (dense, {"topology": Topology.from_spec(f"1x{world}", group=other)},
                                      ValueError, ["another process group", "group=topology.group"]),
    }
    out = {}
    for make in makes:
        c = make()
        for label, (tensor, kwargs, kind, words) in calls.items():
            before = tensor.clone() if isinstance(tensor, torch.Tensor) else None
            for async_op in (False, True):
                try:
                    c.all_reduce(tensor, async_op=async_op, **kwargs)
                    got = "returned"
                except kind as exc:
                    missing = [w for w in words if w not in str(exc)]
                    got = "ok" if not missing else f"message lacks {missing}: {exc}"
                except Exception as exc:  # noqa: BLE001 - reported
                    got = f"{type(exc).__name__}: {exc}"
                if before is not None and not torch.equal(tensor.to_dense(), before.to_dense()):
                    got = "input changed"
                out[f"{c!r}/{label}/async={async_op}"] = got
        # Nothing moved and nothing was counted: the next good call (lossless on constants) is right.
        y = torch.full((1024,), rank + 1.0)
        c.all_reduce(y, error_feedback=C.ErrorFeedback())
        out[f"{c!r}/after"] = "ok" if torch.allclose(y, torch.full((1024,), world * (world + 1) / 2),
                                                     rtol=1e-5) else f"wrong: {y[:4]}"
        out[f"{c!r}/calls"] = "ok" if c.state_dict()["calls"] == 1 else f"counted {c.state_dict()['calls']}"
    # The tensor-list entry point of the hook.
    for label, args in (("reduce_tensors list of lists", ([[1.0]], ["a"])),
                        ("reduce_tensors keys", ([torch.ones(4)], [1])),
                        ("reduce_tensors non-contiguous", ([torch.ones(4, 4).t()], ["a"]))):
        try:
            C.reduce_tensors(C.FP16Compressor(), *args)
            out[label] = "returned"
        except TypeError:
            out[label] = "ok"
    return out


def test_bad_input_is_a_clear_error_at_the_call(ranks):
    """docs/faults.md preamble ("fails the same way on every rank, quickly, ... says what to do") and row 22
    (sparse tensors) for bad input: ``compressor.all_reduce`` of a list, None, a NumPy array or a sparse tensor, and
    each bad argument, raises TypeError/ValueError at the call (also with ``async_op=True``), on
    every rank, saying what to do; the input is unchanged, the step counter did not move, and the
    next good call is right (nothing was sent)."""
    for got in ranks(2, _bad_inputs, timeout=120):
        bad = {label: outcome for label, outcome in got.items() if outcome != "ok"}
        assert not bad, bad
