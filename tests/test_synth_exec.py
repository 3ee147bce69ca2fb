"""The executor of synthesized schedules (``algorithm="synth"``, ``comm/algorithms/synth.py``) against
gloo's own collectives (issue 40).

Integer-valued inputs make every summation order exact, so the executor's results must equal gloo's
bit for bit (``torch.equal``) for all-reduce, reduce-scatter and all-gather, on N in {2, 3, 4} nodes of
L in {1, 2} ranks, at sizes that divide by nothing, in place and out of place; float inputs are
identical on every rank (each chunk reduced once by its owner) and close to gloo's. A hand-written
schedule checks :func:`run_schedule` on its own; a dead peer is a ``CommTimeoutError``
(docs/faults.md row 46).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch.distributed import ReduceOp

from commopt.comm import Topology, all_gather, all_reduce, reduce_scatter
from commopt.comm.algorithms.synth import run_schedule
from commopt.comm.errors import CommTimeoutError
from commopt.comm.links import LinkMap
from commopt.comm.synthesis.ir import Schedule, Step

SIZES = [1, 7, 1000, 100_003]


def _direct_allreduce(n: int) -> Schedule:
    """Every rank sends chunk c to its owner c, which adds them in rank order, then sends the sum back."""
    steps: list[list[Step]] = [[] for _ in range(n)]
    for r in range(n):
        for c in range(n):
            if c != r:
                steps[r].append(Step("send", c, (c,)))
        for src in range(n):
            if src != r:
                prev = (len(steps[r]) - 1,) if steps[r] and steps[r][-1].op == "rrc" else ()
                steps[r].append(Step("rrc", src, (r,), prev))
        reduced = (len(steps[r]) - 1,) if n > 1 else ()
        for c in range(n):
            if c != r:
                steps[r].append(Step("send", c, (r,), reduced))
        for c in range(n):
            if c != r:
                sent_own = tuple(i for i, s in enumerate(steps[r]) if s.op == "send" and s.chunks == (c,)
                                 and i < n)  # after this rank sent its contribution to chunk c
                steps[r].append(Step("recv", c, (c,), sent_own))
    return Schedule("allreduce", n, [3, 1, 2, 5][:n] if n <= 4 else [1] * n, steps, name="direct")


def _links(n: int, local: int, mesh: bool) -> LinkMap:
    if mesh:
        pairs = {(i, j): (6.25e6 if {i, j} == {0, n - 1} else 25e6) for i in range(n) for j in range(n) if i != j}
        return LinkMap.mesh(n, pairs)
    return LinkMap.star([25e6] * (n - 1) + [6.25e6])


def _hand_written() -> None:
    rank, world = dist.get_rank(), dist.get_world_size()
    sched = _direct_allreduce(world)
    for numel in SIZES:
        inputs = [torch.randint(-1000, 1000, (numel,), generator=torch.Generator().manual_seed(r))
                  for r in range(world)]
        buf = inputs[rank].clone()
        run_schedule(sched, buf, None, ReduceOp.SUM, None, "test")
        assert torch.equal(buf, sum(inputs[1:], inputs[0])), numel


def test_run_schedule_hand_written(ranks):
    """A hand-written direct all-reduce with unequal chunks equals the integer sum on every rank."""
    ranks(3, _hand_written, timeout=120)


def _matrix(spec, mesh: bool) -> int:
    rank, world = dist.get_rank(), dist.get_world_size()
    base = Topology.from_nodes(spec) if isinstance(spec, list) else Topology.from_spec(spec)
    topo = Topology(nodes=base.nodes, rank=base.rank, world_size=base.world_size,
                    links=_links(base.num_nodes, base.local_size, mesh))
    checked = 0
    for salt, numel in enumerate(SIZES):
        ints = [torch.randint(-1000, 1000, (numel,), generator=torch.Generator().manual_seed(100 * salt + r))
                for r in range(world)]
        ref = ints[rank].clone()
        dist.all_reduce(ref)
        t = ints[rank].clone()
        assert all_reduce(t, topology=topo, algorithm="synth") is t
        assert torch.equal(t, ref), f"all_reduce {spec} n={numel}"
        # reduce-scatter and all-gather, out of place (and all-gather in place: the input is a block of the output)
        full = [torch.randint(-1000, 1000, (world * numel,), generator=torch.Generator().manual_seed(7 * salt + r))
                for r in range(world)]
        out, want = torch.zeros(numel, dtype=torch.int64), torch.zeros(numel, dtype=torch.int64)
        dist.reduce_scatter_tensor(want, full[rank].clone()) if False else None
        total = sum(full[1:], full[0])
        reduce_scatter(out, full[rank].clone(), topology=topo, algorithm="synth")
        assert torch.equal(out, total[rank * numel:(rank + 1) * numel]), f"reduce_scatter {spec} n={numel}"
        gathered = torch.zeros(world * numel, dtype=torch.int64)
        gathered[rank * numel:(rank + 1) * numel] = ints[rank]
        all_gather(gathered, gathered[rank * numel:(rank + 1) * numel], topology=topo, algorithm="synth")
        assert torch.equal(gathered, torch.cat(ints)), f"all_gather {spec} n={numel}"
        # floats: the same bits on every rank, close to gloo's
        x = torch.randn(numel, generator=torch.Generator().manual_seed(rank + 50 * salt))
        y = x.clone()
        all_reduce(x, topology=topo, algorithm="synth")
        dist.all_reduce(y)
        every = [torch.empty_like(x) for _ in range(world)]
        dist.all_gather(every, x)
        assert all(torch.equal(e, x) for e in every) and torch.allclose(x, y, rtol=1e-5, atol=1e-5)
        checked += 1
    return checked


@pytest.mark.parametrize("spec,world", [("2x1", 2), ("3x1", 3), ("4x1", 4), ("2x2", 4), ("3x2", 6),
                                        ([[0, 3], [1, 2], [4, 5]], 6)])  # rail 1 in another node order
@pytest.mark.parametrize("mesh", [False, True], ids=["star", "mesh"])
def test_synth_equals_gloo(ranks, spec, world, mesh):
    """docs/faults.md row 46: bit-exact against gloo on integers; floats identical on every rank."""
    assert ranks(world, _matrix, spec, mesh, timeout=300)[0] == len(SIZES)


def _dead_peer() -> str:
    rank = dist.get_rank()
    sched = _direct_allreduce(3)
    if rank == 2:
        return "absent"
    import time

    t0 = time.monotonic()
    with pytest.raises(CommTimeoutError, match="past the deadline|failed"):
        run_schedule(sched, torch.ones(30), None, ReduceOp.SUM, time.monotonic() + 2.0, "test")
    assert time.monotonic() - t0 < 10
    return "raised"


def test_dead_peer_is_a_timeout():
    """docs/faults.md row 46: a rank that never takes part leaves the others with CommTimeoutError
    within the deadline (never a hang). Processes of its own: gloo closes a pair whose wait timed out,
    so the group is not reusable afterwards."""
    from _pool import RankPool

    pool = RankPool(3)
    try:
        assert pool.run(_dead_peer, timeout=60) == ["raised", "raised", "absent"]
    finally:
        pool.close(graceful=False)


def _diloco(links: bool) -> list:
    from torch import nn

    from commopt.comm import context
    from commopt.schedules import DiLoCo

    rank = dist.get_rank()
    base = Topology.from_spec("3x1")
    topo = Topology(nodes=base.nodes, rank=base.rank, world_size=3, links=_links(3, 1, False) if links else None)
    torch.manual_seed(0)
    model = nn.Linear(300, 300)  # 360 KB of pseudo-gradient: where the schedule beats the ring (auto weighs it)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    before = context().engine().bytes_sent().get("all_reduce/synth", 0)
    dl = DiLoCo(model, opt, sync_every=2, topology=topo)
    for step in range(4):
        x = torch.randn(8, 300, generator=torch.Generator().manual_seed(10 * rank + step))
        opt.zero_grad()
        model(x).pow(2).mean().backward()
        opt.step()
        dl.step()
    ran = context().engine().bytes_sent().get("all_reduce/synth", 0) > before
    return [ran] + [b.clone() for b in dl.backups.values()]


def test_diloco_outer_sync_runs_on_synth_where_links_differ(ranks):
    """DiLoCo's exact outer all-reduce weighs synth where the links differ (a 3x1 star with a slow node):
    it runs there, every worker holds the same global weights, close to the outer sync on gloo's ring."""
    on = ranks(3, _diloco, True, timeout=120)
    off = ranks(3, _diloco, False, timeout=120)
    assert all(r[0] for r in on) and not any(r[0] for r in off)
    for r in on:
        assert all(torch.equal(a, b) for a, b in zip(r[1:], on[0][1:]))
    assert all(torch.allclose(a, b, rtol=1e-5, atol=1e-6) for a, b in zip(on[0][1:], off[0][1:]))


def _diloco_bf16(links: bool) -> list:
    """DiLoCo with a bf16 outer sync on the 4x1 star, pseudo-gradients of small integers: exact in bf16
    (pre-divided by 4, then summed), whatever the order of the sums."""
    from torch import nn

    from commopt.comm import context
    from commopt.comm.compression import BF16Compressor
    from commopt.schedules import DiLoCo

    rank = dist.get_rank()
    base = Topology.from_spec("4x1")
    topo = Topology(nodes=base.nodes, rank=base.rank, world_size=4, links=_links(4, 1, False) if links else None)
    model = nn.Linear(300, 300)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randint(-8, 9, p.shape, generator=torch.Generator().manual_seed(1)))
    engine = context().engine()
    before = engine.bytes_sent().get("compress/bf16", 0)
    dl = DiLoCo(model, torch.optim.SGD(model.parameters(), lr=0.1), sync_every=2, topology=topo,
                compressor=BF16Compressor(), error_feedback=False,
                outer_optimizer=lambda params: torch.optim.SGD(params, lr=1.0))  # weights stay on a grid of 1/4
    for step in range(4):
        with torch.no_grad():  # the inner step: new integer weights (the pseudo-gradient stays integer)
            for i, p in enumerate(model.parameters()):
                g = torch.Generator().manual_seed(100 * rank + 10 * step + i)
                p.add_(torch.randint(-4, 5, p.shape, generator=g).to(p.dtype))
        dl.step()
    sent = engine.bytes_sent().get("compress/bf16", 0) - before
    return [sent, dl.outer_bytes] + [b.clone() for b in dl.backups.values()]


def test_diloco_compressed_outer_sync_runs_on_synth_where_links_differ(ranks):
    """DiLoCo's compressed (bf16) outer sync on the 4x1 star with a slow node: auto takes synth on the rail,
    the slow node sends less than on the ring (the unequal shards: it owns none of the vector), the
    global weights are bit-identical on every worker and to the ring's (integer pseudo-gradients are
    exact in bf16), and ``outer_bytes`` is what the engine counted on the wire (but for the input's
    64-value tag, which the traffic model leaves out: 0.1 % here)."""
    on = ranks(4, _diloco_bf16, True, timeout=120)
    off = ranks(4, _diloco_bf16, False, timeout=120)
    for r in on + off:
        assert r[0] > 0 and abs(r[1] - r[0]) <= 2e-3 * r[0], (r[0], r[1])
    assert on[3][0] < 0.8 * off[3][0], (on[3][0], off[3][0])  # the slow node: S against the ring's 1.5 S
    for r in on + off:
        assert all(torch.equal(a, b) for a, b in zip(r[2:], on[0][2:]))


def _imported(name: str) -> bool:
    import test_synthesis_ir as xml

    from commopt.comm.synthesis import ScheduleError, execute, from_msccl_xml

    rank, world = dist.get_rank(), dist.get_world_size()
    sched = from_msccl_xml(getattr(xml, name))
    ints = [torch.randint(-1000, 1000, (1001,), generator=torch.Generator().manual_seed(r)) for r in range(world)]
    buf = ints[rank].clone()
    assert execute(sched, buf, timeout=60) is buf and torch.equal(buf, sum(ints[1:], ints[0])), name
    # a schedule that fails its checker is refused on every rank before anything is sent
    broken = Schedule(sched.collective, sched.nranks, sched.weights, [list(s) for s in sched.steps])
    broken.steps[0] = broken.steps[0][:-1]  # rank 0 drops its last step: its partner's message has no pair
    with pytest.raises(ScheduleError, match="pairing"):
        execute(broken, ints[rank].clone(), timeout=10)
    # a schedule for another world size, refused the same way
    from commopt.comm.synthesis import synthesize

    with pytest.raises(ScheduleError, match=f"is for 2 ranks, the group has {world}"):
        execute(synthesize("allreduce", LinkMap.star([25e6, 6.25e6])), ints[rank].clone(), timeout=10)
    return True


@pytest.mark.parametrize("name,world", [("AR_RING_3", 3), ("AR_HALVING_DOUBLING_4", 4)])
def test_msccl_xml_programs_run_from_pytorch(ranks, name, world):
    """msccl-tools XML all-reduce programs, imported, checked and executed on gloo: the integer sum on
    every rank; a broken one is a ScheduleError naming the condition, on every rank, never a hang."""
    assert ranks(world, _imported, name, timeout=120) == [True] * world


def _ddp_hook() -> list:
    from torch import nn

    from commopt.comm import hooks

    rank = dist.get_rank()
    base = Topology.from_spec("3x1")
    topo = Topology(nodes=base.nodes, rank=base.rank, world_size=3, links=_links(3, 1, False))
    grads = []
    for algorithm in ("synth", "flat"):
        torch.manual_seed(0)
        model = nn.parallel.DistributedDataParallel(nn.Linear(64, 64))
        hooks.register(model, hooks.AllReduceState(topology=topo, algorithm=algorithm))
        x = torch.randint(-8, 8, (16, 64), generator=torch.Generator().manual_seed(rank)).float()
        model(x).sum().backward()  # integer-valued gradients: every summation order exact
        grads.append([p.grad.clone() for p in model.parameters()])
    return [all(torch.equal(a, b) for a, b in zip(*grads))]


def test_ddp_hook_runs_on_synth(ranks):
    """The DDP comm hook with algorithm="synth" on a star with a slow node: the same averaged gradients,
    bit for bit, as with gloo's ring (integer-valued gradients)."""
    assert ranks(3, _ddp_hook, timeout=120) == [[True]] * 3
