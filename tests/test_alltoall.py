"""commopt.comm.all_to_all against torch.distributed.all_to_all_single (gloo, CPU).

Each topology runs its whole matrix (algorithms x dtypes x split patterns) in one pool call; the
oracle is ``dist.all_to_all_single`` on the same data, computed in the ranks. docs/faults.md rows covered:
1 (row shapes that differ across ranks, validate=True), 3 (dtype mismatch across ranks), 4 (a rank
never enters: flat, 2-D phases, split exchange), 7 (world size 1), 8 (zero-sized splits, empty
input, zero-width rows), 9 (non-contiguous input and output), 11 (each dtype through each
algorithm), 23 (2+1: auto falls back, explicit 2d raises; interleaved placement: correct). Row 5
for the 2-D all-to-all is in test_faults.py.
"""

from __future__ import annotations

import random

import pytest
import torch
import torch.distributed as dist

from commopt.comm import Topology, cost
from commopt.comm.alltoall import (
    all_to_all,
    all_to_all_autograd,
    calibrate,
    choose_algorithm,
    crossover_bytes,
    exchange_splits,
    link_bytes,
    predict,
    predicted_ratio,
)
from commopt.comm.errors import CollectiveMismatchError, TopologyError

DTYPES = (torch.float64, torch.float32, torch.bfloat16, torch.float16, torch.int64, torch.int32,
          torch.uint8, torch.bool)


def _topology(spec):
    if isinstance(spec, str):
        return Topology.from_spec(spec)
    return Topology.from_nodes(spec)


def _matrix(world: int, seed: int, zero_row: int | None = None) -> list[list[int]]:
    """Rows rank i sends to rank j, the same on every rank (uneven, with zeros)."""
    rng = random.Random(seed)
    m = [[rng.choice([0, 1, 2, 3, 5, 8]) for _ in range(world)] for _ in range(world)]
    if zero_row is not None:
        m[zero_row] = [0] * world
    return m


def _data(rows: int, tail: tuple[int, ...], dtype: torch.dtype, rank: int) -> torch.Tensor:
    # Small integers: exact in every dtype, and different on every rank and row.
    g = torch.Generator().manual_seed(1000 + rank)
    x = torch.randint(0, 100, (rows,) + tail, generator=g)
    return (x % 2).bool() if dtype == torch.bool else x.to(dtype)


def _oracle(inp: torch.Tensor, ins: list[int], outs: list[int]) -> torch.Tensor:
    out = inp.new_empty((sum(outs),) + tuple(inp.shape[1:]))
    dist.all_to_all_single(out, inp.contiguous(), outs, ins)
    return out


def _check(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    assert got.dtype == want.dtype and got.shape == want.shape, f"{what}: {got.shape} {got.dtype} vs {want.shape}"
    assert torch.equal(got, want), f"{what}: values differ"


def _run_matrix(spec) -> int:
    """The whole matrix for one topology; returns the number of cases checked."""
    topo = _topology(spec)
    rank, world = dist.get_rank(), dist.get_world_size()
    algos = ["flat", "auto"] + (["2d"] if topo.is_uniform else [])
    cases = 0
    for algo in algos:
        for dtype in DTYPES:
            # Even splits, 3-D rows.
            inp = _data(3 * world, (2, 3), dtype, rank)
            want = _oracle(inp, [3] * world, [3] * world)
            out = torch.empty_like(inp)
            res = all_to_all(out, inp, topology=topo, algorithm=algo)
            assert res is out
            _check(out, want, f"{algo} {dtype} even")
            # Uneven splits with zeros; both splits given.
            m = _matrix(world, 7)
            ins, outs = m[rank], [m[i][rank] for i in range(world)]
            inp = _data(sum(ins), (4,), dtype, rank)
            want = _oracle(inp, ins, outs)
            out = inp.new_empty((sum(outs), 4))
            all_to_all(out, inp, in_splits=ins, out_splits=outs, topology=topo, algorithm=algo)
            _check(out, want, f"{algo} {dtype} uneven")
            cases += 2
        # Only in_splits: output splits exchanged; output allocated; rank 0 sends nothing.
        m = _matrix(world, 11, zero_row=0)
        ins, outs = m[rank], [m[i][rank] for i in range(world)]
        inp = _data(sum(ins), (3,), torch.float32, rank)
        want = _oracle(inp, ins, outs)
        _check(all_to_all(None, inp, in_splits=ins, topology=topo, algorithm=algo), want, f"{algo} exchanged")
        out = inp.new_empty((sum(outs), 3))
        all_to_all(out, inp, in_splits=torch.tensor(ins), topology=topo, algorithm=algo)
        _check(out, want, f"{algo} exchanged, tensor splits")
        # 1-D, async, validate on the good path.
        inp = _data(2 * world, (), torch.float64, rank)
        fut = all_to_all(torch.empty_like(inp), inp, topology=topo, algorithm=algo, async_op=True, validate=True)
        _check(fut.wait(), _oracle(inp, [2] * world, [2] * world), f"{algo} 1-D async validated")
        # Uneven, validated, 2-D pipelined over 3 chunks (flat ignores chunks).
        m = _matrix(world, 13)
        ins, outs = m[rank], [m[i][rank] for i in range(world)]
        inp = _data(sum(ins), (5,), torch.float32, rank)
        got = all_to_all(None, inp, in_splits=ins, out_splits=outs, topology=topo, algorithm=algo, chunks=3,
                         validate=True)
        _check(got, _oracle(inp, ins, outs), f"{algo} chunked validated")
        # Even splits pipelined over more chunks than some blocks have rows.
        inp = _data(4 * world, (7,), torch.float32, rank)
        got = all_to_all(None, inp, topology=topo, algorithm=algo, chunks=3)
        _check(got, _oracle(inp, [4] * world, [4] * world), f"{algo} even chunked")
        # Non-contiguous input (a transpose) and output (a column slice): docs/faults.md row 9.
        base = _data(6, (2 * world,), torch.float32, rank)
        inp = base.t()  # (2*world, 6), not contiguous
        want = _oracle(inp, [2] * world, [2] * world)
        holder = torch.zeros(2 * world, 9)
        out = holder[:, 1:7]
        all_to_all(out, inp, topology=topo, algorithm=algo)
        _check(out, want, f"{algo} non-contiguous")
        assert torch.equal(holder[:, 0], torch.zeros(2 * world)), "wrote outside the output view"
        # Empty: nobody sends anything; and zero-width rows: docs/faults.md row 8.
        z = torch.zeros(0, 3, dtype=torch.float16)
        got = all_to_all(None, z, in_splits=[0] * world, out_splits=[0] * world, topology=topo, algorithm=algo)
        assert got.shape == (0, 3) and got.dtype == torch.float16
        w0 = torch.zeros(2 * world, 0)
        got = all_to_all(torch.empty(2 * world, 0), w0, topology=topo, algorithm=algo)
        assert got.shape == (2 * world, 0)
        cases += 8
    return cases


@pytest.mark.parametrize("spec", ["1x4", "2x2", "4x1", [[0, 2], [1, 3]]], ids=["1x4", "2x2", "4x1", "interleaved"])
def test_matches_all_to_all_single_4_ranks(ranks, spec):
    """Every algorithm, dtype and split pattern equals gloo's all_to_all_single (docs/faults.md rows 8, 9, 11, 23)."""
    counts = ranks(4, _run_matrix, spec, timeout=120)
    assert counts[0] > 0 and len(set(counts)) == 1


def _two_plus_one() -> str:
    topo = Topology.from_spec("2+1")
    rank = dist.get_rank()
    n = _run_matrix("2+1")
    assert n > 0
    inp = _data(3, (2,), torch.float32, rank)
    try:
        all_to_all(None, inp, topology=topo, algorithm="2d")
    except TopologyError as exc:
        assert "equal size" in str(exc) and "auto" in str(exc)
        return str(exc)
    raise AssertionError("2d on 2+1 did not raise TopologyError")


def test_non_uniform_2_plus_1(ranks):
    """docs/faults.md row 23: on 2+1, auto falls back to flat (and is correct); explicit 2d raises on every rank."""
    msgs = ranks(3, _two_plus_one, timeout=90)
    assert all("TopologyError" in m for m in msgs), msgs


def _bad_inputs() -> dict:
    """Bad splits: errors on every rank, never a hang (docs/faults.md rows 1, 3, plus split disagreement)."""
    rank = dist.get_rank()
    topo = Topology.from_spec("2x2")
    seen: dict[str, str] = {}

    def expect(key, exc_type, fn, *args, **kwargs):
        try:
            fn(*args, **kwargs)
        except exc_type as exc:
            seen[key] = str(exc)
            return
        raise AssertionError(f"{key}: no {exc_type.__name__} on rank {rank}")

    x = torch.arange(8.0).reshape(8, 1)
    # Every rank passes splits that do not sum to dim 0 / negative splits (no validation needed).
    expect("sum", ValueError, all_to_all, None, x, in_splits=[1, 1, 1, 1], out_splits=[2] * 4)
    expect("negative", ValueError, all_to_all, None, x, in_splits=[4, -1, 3, 2], out_splits=[2] * 4)
    expect("length", ValueError, all_to_all, None, x, in_splits=[4, 4], out_splits=[2] * 4)
    expect("not divisible", ValueError, all_to_all, None, torch.zeros(6, 2))
    for algo in ("flat", "2d"):
        # Only rank 1 is wrong; with validate=True every rank raises.
        bad = [1, 1, 1, 1] if rank == 1 else [2, 2, 2, 2]
        expect(f"one-rank sum {algo}", ValueError, all_to_all,
            None, x, in_splits=bad, out_splits=[2] * 4, topology=topo, algorithm=algo, validate=True)
        neg = [4, -2, 4, 2] if rank == 2 else [2, 2, 2, 2]
        expect(f"one-rank negative {algo}", ValueError, all_to_all,
            None, x, in_splits=neg, out_splits=[2] * 4, topology=topo, algorithm=algo, validate=True)
        # Splits that are valid locally but disagree across ranks.
        ins = [3, 1, 2, 2] if rank == 0 else [2, 2, 2, 2]
        expect(f"disagree {algo}", CollectiveMismatchError, all_to_all,
            None, x, in_splits=ins, out_splits=[2] * 4, topology=topo, algorithm=algo, validate=True)
        # An output too small for what the peers send (splits exchanged by the validation).
        out = torch.empty(9 if rank == 3 else 8, 1)
        expect(f"output rows {algo}", CollectiveMismatchError, all_to_all,
            out, x, in_splits=[2] * 4, topology=topo, algorithm=algo, validate=True)
        # docs/faults.md row 1: row shapes differ across ranks ([8, 2] vs [8, 10]); row 3: dtypes differ.
        y = torch.zeros(8, 10 if rank == 1 else 2)
        expect(f"shape {algo}", CollectiveMismatchError, all_to_all,
            None, y, topology=topo, algorithm=algo, validate=True)
        y = torch.zeros(8, 2, dtype=torch.float64 if rank == 0 else torch.float32)
        expect(f"dtype {algo}", CollectiveMismatchError, all_to_all,
            None, y, topology=topo, algorithm=algo, validate=True)
        # Different ndim.
        y = torch.zeros(8) if rank == 3 else torch.zeros(8, 1)
        expect(f"ndim {algo}", CollectiveMismatchError, all_to_all,
            None, y, topology=topo, algorithm=algo, validate=True)
    expect("exchange", ValueError, exchange_splits, [1, -1, 0, 0] if rank == 0 else [0] * 4, validate=True)
    # The group still works afterwards.
    got = all_to_all(None, x, topology=topo, algorithm="2d", validate=True)
    assert torch.equal(got, _oracle(x, [2] * 4, [2] * 4))
    return seen


def test_bad_input_fails_on_every_rank(ranks):
    """Bad splits raise a clear error on every rank; with validate=True even if only one rank is wrong."""
    per_rank = ranks(4, _bad_inputs, timeout=60)
    for rank, seen in enumerate(per_rank):
        assert "sums to 4" in seen["sum"] and "input.shape[0]" in seen["sum"], seen["sum"]
        assert "negative" in seen["negative"]
        assert "world_size=4" in seen["length"]
        assert "not divisible" in seen["not divisible"]
        for algo in ("flat", "2d"):
            assert "ranks [1]" in seen[f"one-rank sum {algo}"], seen[f"one-rank sum {algo}"]
            assert "ranks [2]" in seen[f"one-rank negative {algo}"]
            assert "rank 0 sends 3 rows to rank 0, which expects 2" in seen[f"disagree {algo}"]
            assert "rank 3's output has 9 rows" in seen[f"output rows {algo}"]
            assert "shape" in seen[f"shape {algo}"] and "all_to_all" in seen[f"shape {algo}"]
            assert "dtype" in seen[f"dtype {algo}"]
            assert "ndim" in seen[f"ndim {algo}"]
        if rank == 1:
            assert "this rank" in seen["one-rank sum flat"]


def _autograd(spec) -> int:
    """Gradients through all_to_all_autograd equal those through the reference (float64)."""
    topo = _topology(spec)
    rank, world = dist.get_rank(), dist.get_world_size()
    checked = 0
    for algo in ("flat", "2d", "auto"):
        for seed, only_in in ((3, False), (5, True)):
            m = _matrix(world, seed)
            ins, outs = m[rank], [m[i][rank] for i in range(world)]
            g = torch.Generator().manual_seed(rank + 10 * seed)
            x = torch.randn(sum(ins), 3, dtype=torch.float64, generator=g, requires_grad=True)
            w = torch.randn(sum(outs), 3, dtype=torch.float64, generator=g)
            y = all_to_all_autograd(x, ins, None if only_in else outs, topology=topo, algorithm=algo)
            (y * w).sum().backward()
            # Reference: the value through all_to_all_single; the gradient of sum(w * A(x)) is A^T(w),
            # the reverse exchange of w, computed independently with all_to_all_single.
            assert torch.equal(y.detach(), _oracle(x.detach(), ins, outs))
            want = _oracle(w, outs, ins)
            assert torch.equal(x.grad, want), f"{algo} seed {seed}: gradient differs"
            checked += 1
        # Through a non-linearity on both sides (even splits): d/dx sum(w * tanh(A(x^2))).
        x = torch.randn(2 * world, 2, dtype=torch.float64, generator=torch.Generator().manual_seed(rank),
                        requires_grad=True)
        w = torch.randn(2 * world, 2, dtype=torch.float64, generator=torch.Generator().manual_seed(50 + rank))
        (w * torch.tanh(all_to_all_autograd(x * x, topology=topo, algorithm=algo))).sum().backward()
        a = _oracle((x * x).detach(), [2] * world, [2] * world)
        want = 2 * x.detach() * _oracle(w * (1 - torch.tanh(a) ** 2), [2] * world, [2] * world)
        assert torch.allclose(x.grad, want, rtol=1e-12, atol=1e-14), f"{algo}: chained gradient differs"
        checked += 1
    return checked


@pytest.mark.parametrize("spec", ["2x2", [[0, 2], [1, 3]]], ids=["2x2", "interleaved"])
def test_autograd_gradients(ranks, spec):
    """Backward of the autograd all-to-all is the reverse exchange (float64, exact)."""
    assert len(set(ranks(4, _autograd, spec, timeout=90))) == 1


def _calibrated() -> tuple:
    from commopt.comm import context
    from commopt.comm.alltoall import _calibration_key

    topo = Topology.from_spec("2x2")
    fits = calibrate(topo, sizes=(4096, 65536), reps=1)
    try:
        assert set(fits) == {"flat", "2d"} and all(m.alpha >= 0 and m.beta > 0 for m in fits.values())
        choices = tuple(choose_algorithm(s, topo) for s in (1024, 1 << 16, 1 << 24))
        # The measured lines decide: each choice is flat unless 2d measured more than a tie faster.
        for size, choice in zip((1024, 1 << 16, 1 << 24), choices):
            flat, two_d = fits["flat"].time(size), fits["2d"].time(size)
            assert choice == ("flat" if flat <= two_d * (1 + cost.MEASURED_TIE) else "2d"), (size, flat, two_d)
        # auto runs (and is correct) with the calibration in place.
        x = _data(8, (3,), torch.float32, dist.get_rank())
        assert torch.equal(all_to_all(None, x, topology=topo), _oracle(x, [2] * 4, [2] * 4))
        assert calibrate(Topology.from_spec("1x4")) == {}
    finally:
        context().alltoall_fits.pop(_calibration_key(topo))  # later tests use the level model
    return choices, tuple((m.alpha, m.beta) for m in fits.values())


def test_calibrate_is_rank_consistent(ranks):
    """calibrate() fits per-algorithm lines from the slowest rank's times: identical on every rank,
    so auto's choice is too (docs/architecture.md section 3, rule 2). No time is asserted."""
    results = ranks(4, _calibrated, timeout=60)
    assert len(set(results)) == 1, results


def test_world_size_one():
    """docs/faults.md row 7: without a process group, all_to_all is a copy and the autograd one an identity."""
    x = torch.arange(6.0).reshape(3, 2)
    out = torch.empty_like(x)
    assert all_to_all(out, x) is out and torch.equal(out, x)
    assert torch.equal(all_to_all(None, x, in_splits=[3], out_splits=[3]), x)
    assert torch.equal(all_to_all(None, x, algorithm="2d", async_op=True).wait(), x)
    with pytest.raises(ValueError, match="sums to 2"):
        all_to_all(None, x, in_splits=[2])
    with pytest.raises(TypeError, match="dtype"):
        all_to_all(torch.empty(3, 2, dtype=torch.float64), x)
    with pytest.raises(ValueError, match="unknown algorithm|0-d"):
        all_to_all(None, torch.tensor(1.0))
    xg = x.clone().requires_grad_()
    all_to_all_autograd(xg).sum().backward()
    assert torch.equal(xg.grad, torch.ones_like(x))


def test_cost_figures():
    """The figures the benchmark prints: equal link bytes, a ratio below 1 for small messages at
    scale, and a crossover that exists (no timing is asserted)."""
    topo = Topology(nodes=((0, 1), (2, 3)), rank=0, world_size=4)
    assert link_bytes("flat", 1 << 20, topo) == link_bytes("2d", 1 << 20, topo) == (1 << 20)
    assert predicted_ratio(16, 8, 128 * 1024) < 1.0
    cross = crossover_bytes(16, 8)
    assert cross is None or cross > 128 * 1024
    model = cost.CostModel(cost.DEFAULT_INTRA, cost.DEFAULT_INTER)
    assert choose_algorithm(1 << 20, Topology(nodes=((0, 1, 2, 3),), rank=0, world_size=4), model) == "flat"
    assert choose_algorithm(1 << 20, Topology(nodes=((0, 1), (2,)), rank=0, world_size=3), model) == "flat"
    tiny, big = choose_algorithm(4 * 64, topo, model), choose_algorithm(1 << 30, topo, model)
    assert tiny == ("2d" if predicted_ratio(2, 2, 4 * 64) < 1 else "flat")
    assert big == ("2d" if predicted_ratio(2, 2, 1 << 30) < 1 else "flat")
    for size in (256, 1 << 20, 1 << 30):
        assert predict("auto", size, topo, model) == min(predict(a, size, topo, model) for a in ("flat", "2d"))
    with pytest.raises(ValueError, match="unknown algorithm"):
        predict("ring", 1, topo)


def _a2a_never_enters(timeout: float):
    import time

    from commopt.comm.errors import CommTimeoutError

    rank = dist.get_rank()
    topo = Topology.from_spec("2x2")
    x = torch.ones(8, 2)
    cases = {"flat": {"algorithm": "flat"}, "2d": {"algorithm": "2d"},  # engine phases time out
             "2d exchanged": {"algorithm": "2d", "in_splits": [2, 2, 2, 2]}}  # the split exchange does
    for kw in cases.values():
        all_to_all(None, x, topology=topo, timeout=60, **kw)  # groups made, in step (a long timeout: setup)
    if rank == 1:
        time.sleep(len(cases) * timeout + 3)
        return None
    out = {}
    for name, kw in cases.items():
        start = time.monotonic()
        try:
            all_to_all(None, x, topology=topo, timeout=timeout, **kw)
            out[name] = "completed"
        except CommTimeoutError as exc:
            out[name] = (time.monotonic() - start, str(exc))
    return out


def test_rank_never_enters_all_to_all():
    """docs/faults.md row 4 for the all-to-all (flat; 2d in its engine phases; 2d in its split exchange): the
    others raise CommTimeoutError after the timeout, before timeout + slack, naming the operation.
    Fresh processes: the group is left out of step."""
    from _pool import RankPool

    timeout, slack = 2.0, 10.0  # every case waits the timeout out: short
    pool = RankPool(4)
    try:
        res = pool.run(_a2a_never_enters, timeout, timeout=3 * (timeout + slack) + 60)  # + cold start
    finally:
        pool.close(graceful=False)
    for rank, per_case in enumerate(res):
        if rank == 1:
            continue
        for name, r in per_case.items():
            assert r != "completed", (rank, name)
            elapsed, msg = r
            assert timeout - 0.5 <= elapsed <= timeout + slack, (rank, name, elapsed)
            assert "all_to_all" in msg, msg
