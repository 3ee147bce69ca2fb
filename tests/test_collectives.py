"""all_reduce / reduce_scatter / all_gather against an independent oracle (issue 2).

The oracle is rank arithmetic: every rank regenerates every rank's input from its seed and reduces
them in float64 locally, so no result of the code under test (nor of gloo) enters the expectation.
Each (topology, algorithm) runs its whole matrix of dtypes x ops x sizes in one pool call
(docs/architecture.md section 9).
docs/faults.md rows: 7 (world/group of size 1), 8 (zero elements), 9 (non-contiguous), 10 (integers and
bool), 11 (each dtype), 12 (fp16 overflow), 23 (2+1 and interleaved topologies).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch.distributed import ReduceOp

from commopt.comm import Topology, all_gather, all_reduce, context, reduce_scatter
from commopt.comm.errors import CollectiveMismatchError, TopologyError

FLOATS = [torch.float64, torch.float32, torch.bfloat16, torch.float16]
INTS = [torch.int32, torch.int64]
OPS = {"sum": ReduceOp.SUM, "avg": ReduceOp.AVG, "max": ReduceOp.MAX, "min": ReduceOp.MIN}
SIZES = [0, 1, 7, 100_003]

TOPOLOGIES = {
    "1x4": ("1x4", 4),
    "2x2": ("2x2", 4),
    "4x1": ("4x1", 4),
    "interleaved": ([[0, 2], [1, 3]], 4),
    "2+1": ("2+1", 3),
}


def _topo(spec) -> Topology:
    return Topology.from_nodes(spec) if isinstance(spec, list) else Topology.from_spec(spec)


def _input(rank: int, numel: int, dtype: torch.dtype, salt: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * salt + rank)
    if dtype.is_floating_point:
        return (torch.randn(numel, generator=g, dtype=torch.float64) * 4).to(dtype)
    return torch.randint(-1000, 1000, (numel,), generator=g, dtype=dtype)


def _oracle(inputs: list[torch.Tensor], op: str) -> torch.Tensor:
    stack = torch.stack([x.to(torch.float64) for x in inputs])
    if op == "sum":
        return stack.sum(0)
    if op == "avg":
        return stack.mean(0)
    return stack.amax(0) if op == "max" else stack.amin(0)


def _close(out: torch.Tensor, ref: torch.Tensor, inputs: list[torch.Tensor], world: int, what: str) -> None:
    if not out.dtype.is_floating_point:
        assert torch.equal(out.to(torch.float64), ref), what
        return
    # Each rounding step costs at most eps x the magnitude of the partial sums; a reduction over
    # `world` ranks does at most world + 2 of them (pre-division, sums, final rounding).
    eps = torch.finfo(out.dtype).eps
    mag = torch.stack([x.to(torch.float64).abs() for x in inputs]).sum(0)
    bound = eps * (world + 2) * mag + torch.finfo(out.dtype).tiny
    err = (out.to(torch.float64) - ref).abs()
    assert bool((err <= bound).all()), f"{what}: max err {err.max().item()} > bound"


def _all_reduce_matrix(spec, algorithm: str) -> int:
    rank, world = dist.get_rank(), dist.get_world_size()
    topo = _topo(spec)
    checked = 0
    cases = [(dt, op, n) for dt in FLOATS + INTS for op in OPS for n in SIZES]
    cases += [(torch.float32, "sum", 1_000_003), (torch.int64, "sum", 1_000_003)]
    for salt, (dtype, op, numel) in enumerate(cases):
        if op == "avg" and not dtype.is_floating_point:
            with pytest.raises(TypeError, match="AVG"):
                all_reduce(_input(rank, numel, dtype, salt), OPS[op], topology=topo, algorithm=algorithm)
            continue
        inputs = [_input(r, numel, dtype, salt) for r in range(world)]
        t = inputs[rank].clone()
        out = all_reduce(t, OPS[op], topology=topo, algorithm=algorithm)
        assert out is t and t.dtype == dtype and t.shape == (numel,)
        _close(t, _oracle(inputs, op), inputs, world, f"{algorithm} {dtype} {op} n={numel}")
        checked += 1
    # Non-contiguous input (docs/faults.md row 9): same result as contiguous, written back in place.
    base = [_input(r, 35, torch.float64, 99).view(7, 5) for r in range(world)]
    t = base[rank].clone().t()
    out = all_reduce(t, topology=topo, algorithm=algorithm)
    assert out is t and not t.is_contiguous()
    _close(t, _oracle([b.t() for b in base], "sum"), [b.t() for b in base], world, "non-contiguous")
    # bool: SUM is logical OR, MIN logical AND (docs/faults.md row 10).
    flags = [torch.tensor([r == 0, True, False, r % 2 == 1]) for r in range(world)]
    t = flags[rank].clone()
    all_reduce(t, topology=topo, algorithm=algorithm)
    assert t.tolist() == [True, True, False, world > 1]
    t = flags[rank].clone()
    all_reduce(t, ReduceOp.MIN, topology=topo, algorithm=algorithm)
    assert t.tolist() == [world == 1, True, False, False]
    # fp16 overflow (docs/faults.md row 12): 40 000 on every rank averages to 40 000, never inf.
    t = torch.full((1000,), 40_000.0, dtype=torch.float16)
    all_reduce(t, ReduceOp.AVG, topology=topo, algorithm=algorithm)
    assert torch.equal(t, torch.full((1000,), 40_000.0, dtype=torch.float16))
    return checked


@pytest.mark.parametrize("algorithm", ["flat", "hierarchical", "leader", "auto"])
@pytest.mark.parametrize("name", list(TOPOLOGIES))
def test_all_reduce_matrix(ranks, name, algorithm):
    spec, world = TOPOLOGIES[name]
    if name == "2+1" and algorithm == "hierarchical":
        pytest.skip("covered by test_hierarchical_rejects_uneven_nodes")
    res = ranks(world, _all_reduce_matrix, spec, algorithm, timeout=240)
    assert res[0] == len(FLOATS) * 4 * len(SIZES) + len(INTS) * 3 * len(SIZES) + 2


def _rs_ag_matrix(spec, algorithm: str) -> int:
    rank, world = dist.get_rank(), dist.get_world_size()
    topo = _topo(spec)
    checked = 0
    for salt, (dtype, op, n) in enumerate((dt, op, n) for dt in FLOATS + INTS for op in OPS
                                          for n in [0, 1, 7, 25_001]):
        if op == "avg" and not dtype.is_floating_point:
            continue
        inputs = [_input(r, world * n, dtype, salt) for r in range(world)]
        out = torch.full((n,), 7, dtype=dtype)
        res = reduce_scatter(out, inputs[rank].clone(), OPS[op], topology=topo, algorithm=algorithm)
        assert res is out
        ref = _oracle(inputs, op)[rank * n:(rank + 1) * n]
        _close(out, ref, [x[rank * n:(rank + 1) * n] for x in inputs], world, f"rs {algorithm} {dtype} {op} {n}")
        # all_gather: every rank's block, in rank order.
        blocks = [_input(r, n, dtype, salt + 7) for r in range(world)]
        gathered = torch.full((world * n,), 3, dtype=dtype)
        res = all_gather(gathered, blocks[rank].clone(), topology=topo, algorithm=algorithm)
        assert res is gathered and torch.equal(gathered, torch.cat(blocks)), f"ag {algorithm} {dtype} {n}"
        checked += 1
    # Shaped output/input and a non-contiguous output.
    x = _input(rank, world * 6, torch.float64, 5)
    out = torch.zeros(3, 2, dtype=torch.float64).t()
    reduce_scatter(out, x.view(world, 6), topology=topo, algorithm=algorithm)
    ref = _oracle([_input(r, world * 6, torch.float64, 5) for r in range(world)], "sum")[rank * 6:(rank + 1) * 6]
    assert not out.is_contiguous() and torch.allclose(out.reshape(-1), ref)
    return checked


@pytest.mark.parametrize("algorithm", ["flat", "hierarchical", "auto"])
@pytest.mark.parametrize("name", ["2x2", "interleaved", "1x4", "4x1"])
def test_reduce_scatter_all_gather_matrix(ranks, name, algorithm):
    spec, world = TOPOLOGIES[name]
    res = ranks(world, _rs_ag_matrix, spec, algorithm, timeout=240)
    assert res[0] > 0


def _uneven_nodes():
    topo = Topology.from_spec("2+1")
    errors = []
    for call in (lambda: all_reduce(torch.ones(4), topology=topo, algorithm="hierarchical"),
                 lambda: reduce_scatter(torch.ones(1), torch.ones(3), topology=topo, algorithm="hierarchical"),
                 lambda: all_gather(torch.ones(3), torch.ones(1), topology=topo, algorithm="hierarchical")):
        with pytest.raises(TopologyError, match=r"needs nodes of equal size, got node sizes \[2, 1\]"):
            call()
        errors.append(True)
    t = torch.ones(4)
    all_reduce(t, topology=topo, algorithm="auto")  # falls back
    return t.tolist()


def test_hierarchical_rejects_uneven_nodes(ranks):
    """docs/faults.md row 23: on 2+1, hierarchical is a clear error on every rank and auto falls back."""
    assert ranks(3, _uneven_nodes) == [[3.0] * 4] * 3


def _world_one():
    # A group of size 1 inside a 2-rank world: identity, no communication (docs/faults.md row 7).
    rank = dist.get_rank()
    solo = [dist.new_group([0]), dist.new_group([1])][rank]
    before = context().engine().bytes_sent()
    t = torch.arange(5.0)
    for algo in ("flat", "hierarchical", "leader", "auto"):
        assert all_reduce(t, ReduceOp.AVG, group=solo, algorithm=algo) is t
    fut = all_reduce(t, group=solo, async_op=True)
    assert fut.wait() is t
    out = torch.empty(5)
    reduce_scatter(out, t, group=solo)
    all_gather(out, t, group=solo)
    assert torch.equal(out, t) and torch.equal(t, torch.arange(5.0))
    assert context().engine().bytes_sent() == before
    return True


def test_group_of_size_one(ranks):
    assert ranks(2, _world_one) == [True, True]


def _in_flight():
    """Eight async hierarchical all-reduces of different sizes in flight, plus leader and RS/AG, and
    blocking calls among them: a blocking call runs on the caller's thread only when the engine is
    idle (Engine.submit), so one issued while others are queued must wait its turn."""
    rank, world = dist.get_rank(), dist.get_world_size()
    topo = Topology.from_spec("2x2")
    sizes = [1, 70_001, 3, 300_000, 17, 150_000, 5, 90_000]
    futs, tensors = [], []
    for i, n in enumerate(sizes):
        algo = "hierarchical" if i % 3 else "leader"
        t = torch.full((n,), float(rank + 1 + i))
        tensors.append(t)
        futs.append(all_reduce(t, topology=topo, algorithm=algo, async_op=True))
        if i == 4:
            ag_out = torch.empty(world * 1000)
            futs.append(all_gather(ag_out, torch.full((1000,), float(rank)), topology=topo,
                                   algorithm="hierarchical", async_op=True))
        if i in (2, 6):
            busy = torch.full((50_001,), float(rank * i))
            all_reduce(busy, topology=topo, algorithm="hierarchical")
            assert torch.equal(busy, torch.full((50_001,), float(i * sum(range(world))))), f"blocking call {i}"
    torch.futures.wait_all(futs)
    for i, (n, t) in enumerate(zip(sizes, tensors)):
        expected = sum(r + 1 + i for r in range(world))
        assert torch.equal(t, torch.full((n,), float(expected))), f"op {i} crossed another op's data"
    assert torch.equal(ag_out, torch.arange(world).repeat_interleave(1000).float())
    idle = torch.full((9,), float(rank))
    assert all_reduce(idle, topology=topo, algorithm="hierarchical") is idle
    assert torch.equal(idle, torch.full((9,), float(sum(range(world)))))
    return True


def test_many_async_ops_in_flight(ranks):
    """The test that catches phases chained from callbacks (docs/architecture.md section 3, rule 1)."""
    for _ in range(3):
        assert ranks(4, _in_flight, timeout=120) == [True] * 4


def _bad_input():
    topo = Topology.from_spec("2x2")
    out = []
    for call, exc in [
        (lambda: all_reduce(torch.ones(3, dtype=torch.complex64), topology=topo), TypeError),
        (lambda: all_reduce(torch.ones(3), ReduceOp.PRODUCT, topology=topo), ValueError),
        (lambda: all_reduce(torch.ones(3, dtype=torch.int32), ReduceOp.AVG, topology=topo), TypeError),
        (lambda: all_reduce([1, 2, 3], topology=topo), TypeError),
        (lambda: all_reduce(torch.ones(3), topology=topo, algorithm="ring"), ValueError),
        (lambda: reduce_scatter(torch.ones(3), torch.ones(10), topology=topo), ValueError),
        (lambda: all_gather(torch.ones(12), torch.ones(3, dtype=torch.float64), topology=topo), TypeError),
        # A compressor that is not one, for an integer tensor (which it would not compress) too.
        (lambda: all_reduce(torch.ones(3, dtype=torch.int64), topology=topo, compressor="fp16"), TypeError),
        (lambda: all_reduce(torch.ones(3), topology=topo, compressor=0.5), TypeError),
    ]:
        with pytest.raises(exc) as info:
            call()
        out.append(str(info.value))
    # The group is still in step after the refusals: nothing was sent.
    t = torch.ones(3)
    all_reduce(t, topology=topo)
    assert t.tolist() == [4.0] * 3
    return out


def test_bad_input_fails_the_same_on_every_rank(ranks):
    res = ranks(4, _bad_input)
    assert all(r == res[0] for r in res)
    assert "complex64 is not supported" in res[0][0]
    assert "use ReduceOp.SUM, AVG, MAX or MIN" in res[0][1]
    assert "has 10 elements but must have world_size (4)" in res[0][5]
    assert all("compressor must be a commopt.comm.compression compressor" in m for m in res[0][7:9])


def _mismatch(kind: str):
    rank = dist.get_rank()
    topo = Topology.from_spec("2x2")
    shape = (20, 2)
    if rank == 2 and kind != "dtype":
        shape = (20, 10) if kind == "shape" else (40,)
    dtype = torch.float64 if kind == "dtype" and rank == 1 else torch.float32
    try:
        all_reduce(torch.ones(shape, dtype=dtype), topology=topo, algorithm="hierarchical", validate=True)
    except CollectiveMismatchError as exc:
        return (exc.ranks, str(exc))
    return None


@pytest.mark.parametrize("kind", ["shape", "ndim", "dtype"])
def test_validation_catches_mismatch(ranks, kind):
    """docs/faults.md rows 1 and 3: shape, ndim or dtype mismatch is a clear error on every rank."""
    res = ranks(4, _mismatch, kind)
    bad = [1] if kind == "dtype" else [2]
    for r in res:
        assert r is not None and r[0] == bad
        assert "ranks issued different collectives" in r[1] and "all_reduce" in r[1]


def _byte_counts():
    topo = Topology.from_spec("2x2")
    context().engine().reset_stats()
    n = 1 << 16  # fp32: 256 KiB, one chunk
    all_reduce(torch.ones(n), topology=topo, algorithm="hierarchical")
    all_reduce(torch.ones(n), topology=topo, algorithm="flat")
    return context().engine().bytes_sent()


def test_bytes_on_the_wire_are_counted(ranks):
    res = ranks(4, _byte_counts)
    nbytes = 4 << 16
    for r in res:
        # RS intra (1/2) + AR on the half over 2 nodes (2 * 1/2 * 1/2) + AG intra (1/2).
        assert r["hierarchical"] == pytest.approx(nbytes * (0.5 + 0.5 + 0.5))
        assert r["flat"] == pytest.approx(nbytes * 2 * 3 / 4)
