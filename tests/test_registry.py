"""The registry is the only list of algorithm names (issue 24, item 4; docs/architecture.md section 7).

A toy algorithm, a ring all-reduce in reversed rank order, is defined in this one module and added
with ``algorithms.register``; nothing else of the library names it. It then runs through
``all_reduce(..., algorithm="toy")``, the DDP hook, ``auto``'s candidates and choice, the simulator's
traffic matrix and ``commopt-bench collectives --algo MODULE:toy``. Oracles: plain
``torch.distributed`` (the all-reduce, DDP's own reduction) and rank arithmetic (the ring's bytes).
The toy costs what flat costs (times :data:`DISCOUNT`, 1 outside the one check that lowers it), so
in the rank processes the suite keeps, where it stays registered, ``auto`` never prefers it (ties go
to the algorithm registered first).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from commopt.bench import collectives as bench
from commopt.comm import Topology, algorithms, all_reduce, compression, context, cost, hooks
from commopt.comm.algorithms import ALGORITHM_FACTORS, Algorithm, Call, Traffic
from commopt.comm.collectives import select_algorithm
from commopt.comm.engine import Phase
from commopt.schedules.simulator import traffic_matrix

#: The toy's cost as a fraction of flat's; lowered only inside the check of auto's choice.
DISCOUNT = [1.0]


def _ring(flat: torch.Tensor, red: dist.ReduceOp, group, timeout: float | None) -> int:
    """Ring all-reduce of ``flat`` in place over ``group`` with the ranks in reversed order: a
    reduce-scatter then an all-gather, p - 1 steps each, every rank sending to the rank below it."""
    p, rank = dist.get_world_size(group), dist.get_rank(group)
    order = list(range(p))[::-1]
    pos = order.index(rank)
    nxt, prv = order[(pos + 1) % p], order[(pos - 1) % p]
    segs = list(flat.tensor_split(p))
    combine = {dist.ReduceOp.SUM: torch.add, dist.ReduceOp.MAX: torch.maximum, dist.ReduceOp.MIN: torch.minimum}[red]
    world = group if group is not None else dist.group.WORLD
    sent = 0

    def step(send: torch.Tensor, recv: torch.Tensor) -> int:
        sends, recvs = [None] * p, [None] * p
        sends[nxt], recvs[prv] = send, recv
        return algorithms.pairwise(world, timeout, sends, recvs)

    for s in range(p - 1):
        mine, theirs = (pos - s) % p, (pos - s - 1) % p
        buf = torch.empty_like(segs[theirs])
        sent += step(segs[mine], buf)
        segs[theirs].copy_(combine(segs[theirs], buf))
    for s in range(p - 1):
        sent += step(segs[(pos + 1 - s) % p], segs[(pos - s) % p])
    return sent


class ReversedRing(Algorithm):
    name = "toy"
    collectives = ("allreduce",)
    automatic = True

    def traffic(self, collective: str, nbytes: float, topology: Topology, *, itemsize: int = 1) -> Traffic:
        t = Traffic(topology)
        p = topology.world_size
        if p > 1 and nbytes:
            t.ring(list(range(p))[::-1], ALGORITHM_FACTORS["allreduce"](p) * nbytes)
        return t

    def cost(self, model: cost.CostModel, collective: str, nbytes: float, topology: Topology) -> float:
        return algorithms.get("flat").cost(model, collective, nbytes, topology) * DISCOUNT[0]

    def all_reduce(self, call: Call) -> torch.futures.Future:
        p, deadline = call.prepared, algorithms.deadline_of(call.timeout)
        # One phase on no group: it runs on the caller's thread, like flat, in the caller's order.
        phase = Phase("ring", lambda: _ring(p.flat, call.red, call.group, algorithms.remaining(deadline)))
        fut = call.engine.submit([phase], op="all_reduce/toy", device=p.flat.device, blocking=call.blocking)
        return algorithms.then_finish(fut, p)


TOY = algorithms.register(ReversedRing())


# ------------------------------------------------------------------------------------ in-process
def test_the_toy_is_listed_wherever_names_are_read():
    assert algorithms.register(TOY) is TOY  # a second import registers nothing new
    assert "toy" in algorithms.names("allreduce") and "toy" in algorithms.candidates("allreduce")
    assert "toy" not in algorithms.names("reduce_scatter") and "toy" not in algorithms.names("allreduce", codec=True)
    # rail reduces over a rail, not the group: a codec carrier for compressed HSDP, never a public choice.
    assert "rail" in algorithms.names("allreduce", scope=None, codec=True)
    assert "rail" not in algorithms.names("allreduce")
    hooks.AllReduceState(algorithm="toy")
    with pytest.raises(ValueError, match="cannot carry a compressor"):
        hooks.AllReduceState(algorithm="toy", compressor=compression.FP16Compressor())
    with pytest.raises(ValueError, match="already registered"):
        algorithms.register(ReversedRing())
    with pytest.raises(TypeError, match="register an instance"):
        algorithms.register(ReversedRing)


def test_simulator_traffic_matrix_of_the_toy():
    """Every rank sends 2(p-1)/p of the buffer to the rank below it, nothing else (rank arithmetic)."""
    s = float(1 << 20)
    for p in (2, 4, 5):
        topo = Topology(nodes=tuple((r,) for r in range(p)), rank=0, world_size=p)
        expect = torch.zeros(p, p, dtype=torch.float64)
        for r in range(p):
            expect[r, (r - 1) % p] = 2 * (p - 1) / p * s
        assert torch.equal(traffic_matrix("toy", s, topo), expect)
        assert cost.predict("toy", s, topo) == cost.predict("flat", s, topo)


# ------------------------------------------------------------------------------------ on ranks
def _toy_everywhere() -> list:
    rank, world = dist.get_rank(), dist.get_world_size()
    topo = Topology.from_spec("2x2")
    engine = context().engine()
    out = []
    # all_reduce(algorithm="toy"), against plain torch.distributed, bytes against traffic().
    for dtype in (torch.float32, torch.int64):
        for n in (1000, 4096):
            avg = (dist.ReduceOp.AVG,) if dtype.is_floating_point else ()
            for op in (dist.ReduceOp.SUM, dist.ReduceOp.MAX, *avg):
                x = ((torch.arange(n) * (rank + 3)) % 11 - 5 * rank).to(dtype)
                ref = x.clone()
                dist.all_reduce(ref, op=dist.ReduceOp.SUM if op == dist.ReduceOp.AVG else op)
                if op == dist.ReduceOp.AVG:
                    ref /= world
                engine.reset_stats()
                got = all_reduce(x.clone(), op, topology=topo, algorithm="toy")
                sent = engine.bytes_sent().get("all_reduce/toy", 0)
                expect = TOY.traffic("allreduce", n * x.element_size(), topo).sent(rank)
                out.append(("all_reduce", str(dtype), n, str(op), torch.equal(got, ref) if dtype == torch.int64
                            else torch.allclose(got, ref), sent == expect))
    # auto: the toy is a candidate; with the discount it is the cheapest on the 2x2 and runs. Under
    # the documented default model (levels that do not share a resource), whatever an earlier test
    # of this kept rank process left in the cache, which is put back after.
    key = (topo.layout, id(topo.group))
    kept = context().cost_models.put(key, cost.CostModel(cost.DEFAULT_INTRA, cost.DEFAULT_INTER))
    DISCOUNT[0] = 0.5
    try:
        picked = select_algorithm("allreduce", "auto", 1 << 20, topo)
        engine.reset_stats()
        x = torch.full((1 << 18,), float(rank))
        all_reduce(x, topology=topo)
        ran = "all_reduce/toy" in engine.calls()
        out.append(("auto", picked, ran, torch.equal(x, torch.full_like(x, sum(range(world))))))
        DISCOUNT[0] = 1.0
        out.append(("auto without discount", select_algorithm("allreduce", "auto", 1 << 20, topo) != "toy"))
    finally:
        DISCOUNT[0] = 1.0
        if kept is not None:
            context().cost_models.put(key, kept)
        else:
            context().cost_models.pop(key)
    # The DDP hook with algorithm="toy" against DDP's own reduction.
    torch.manual_seed(0)
    net = nn.Linear(8, 4)
    ref_net = nn.Linear(8, 4)
    ref_net.load_state_dict(net.state_dict())
    ddp, ref = DDP(net), DDP(ref_net)
    hooks.register(ddp, hooks.AllReduceState(topology=topo, algorithm="toy"))
    inp = torch.randn(5, 8, generator=torch.Generator().manual_seed(rank))
    for model in (ddp, ref):
        model(inp).square().sum().backward()
    out.append(("ddp", all(torch.allclose(a.grad, b.grad) for a, b in zip(net.parameters(), ref_net.parameters()))))
    # commopt-bench collectives --algo MODULE:toy, its sweep on these ranks.
    args = bench._parser().parse_args(["--algo", f"{__name__}:toy,flat", "--sizes", "4K", "--iters", "2",
                                       "--warmup", "1", "--no-calibrate"])
    rows = bench.run_sweep(args, topo, log=lambda *a, **k: None)
    out.append(("bench", sorted((r["algo"], r["wrong"], r.get("chosen")) for r in rows)))
    return out


def test_toy_runs_through_all_reduce_auto_the_ddp_hook_and_the_benchmark(ranks):
    res = ranks(4, _toy_everywhere, timeout=120)
    assert all(r == res[0] for r in res)
    for row in res[0]:
        if row[0] == "all_reduce":
            assert row[-2:] == (True, True), row
    rows = {row[0]: row[1:] for row in res[0]}
    assert rows["auto"] == ("toy", True, True)
    assert rows["auto without discount"] == (True,)
    assert rows["ddp"] == (True,)
    assert rows["bench"] == ([("flat", 0, "flat"), ("toy", 0, "toy")],)
