"""Bucket and issue plans, the priority policy, the iteration simulator and the traffic matrix.

No process groups: these are pure functions of shapes and timings. Oracles are closed forms:
no overlap = compute + communication; DDP-style overlap with communication shorter than each
layer's backward = compute + the last bucket; an overlapped schedule never beats max(compute,
communication); the traffic matrix's totals equal the per-algorithm byte counts of ``comm.cost``.
"""

from __future__ import annotations

import itertools

import pytest
import torch
from torch import nn

from commopt.comm import Topology, cost
from commopt.schedules import IssuePlan, build_buckets, fifo_plan, priority_plan
from commopt.schedules.plan import partition
from commopt.schedules.priority import shape_priority, simulate_issue
from commopt.schedules.simulator import (
    SCHEDULES,
    Layer,
    Schedule,
    iteration_traffic,
    layers_from_model,
    link_service,
    simulate,
    traffic_matrix,
    transformer_layers,
)

KB = 1024


# ------------------------------------------------------------------------------------ plans
def test_buckets_caps_alignment_and_dtypes():
    shapes = [(100, torch.float32), (50, torch.float32), (10, torch.float64), (300, torch.float32), (7, torch.float32)]
    plan = build_buckets(shapes, cap_bytes=1 * KB, first_cap_bytes=256, align=16)
    seen = sorted(p for b in plan.buckets for p in b.params)
    assert seen == list(range(len(shapes)))
    for b in plan.buckets:
        assert len({shapes[p][1] for p in b.params}) == 1
        assert all(off % 16 == 0 for off in b.offsets)
        assert b.numel % 16 == 0
        for off, n, nxt in zip(b.offsets, b.numels, list(b.offsets[1:]) + [b.numel]):
            assert off + n <= nxt  # no overlap
    # Reverse registration order: the last parameter opens the first bucket, which respects its cap.
    assert plan.buckets[0].params[0] == 4
    assert plan.buckets[0].nbytes <= 256 or len(plan.buckets[0].params) == 1
    with pytest.raises(ValueError):
        build_buckets(shapes, order=[0, 1, 2])
    with pytest.raises(ValueError):
        build_buckets(shapes, cap_bytes=0)


def test_partition_tiles_and_plan_roundtrip():
    plan = build_buckets([(1000, torch.float32), (37, torch.float32), (4096, torch.float32)], cap_bytes=8 * KB,
                         first_cap_bytes=1 * KB)
    pieces = partition(plan, 1 * KB)
    for b, chunks in zip(plan.buckets, pieces):
        assert chunks[0].start == 0 and chunks[-1].stop == b.numel
        assert all(a.stop == c.start for a, c in zip(chunks, chunks[1:]))
        assert all(c.nbytes <= 1 * KB for c in chunks)
    issue = fifo_plan(plan, partition_bytes=1 * KB, credit=2 * KB)
    issue.check(plan)
    again = IssuePlan.decode(issue.encode(), plan)
    assert again == issue
    broken = IssuePlan(issue.chunks[:-1], issue.partition, issue.credit, issue.priority)
    with pytest.raises(ValueError):
        broken.check(plan)


def test_priority_overtakes_queued_chunks_and_credit_holds():
    """With a credit, an urgent bucket that turns ready later overtakes queued chunks of earlier ones
    (ByteScheduler), and the bytes in flight never exceed the credit."""
    # Buckets in backward order: 0 is ready first but needed last by the next forward.
    plan = build_buckets([(4 * KB, torch.uint8)] * 3, cap_bytes=4 * KB, first_cap_bytes=4 * KB, align=1)
    ready = [0.0, 1.0, 2.0]
    service = lambda n: n / KB  # noqa: E731 - 1 s per KiB
    prio = shape_priority(plan)  # bucket 2 holds parameter 0: needed first
    assert prio[2] == 0
    issue = priority_plan(plan, ready_times=ready, service=service, partition_bytes=1 * KB, credit=2 * KB,
                          priority=prio)
    order = [c.bucket for c in issue.chunks]
    fifo = sorted(order)
    assert order != fifo
    assert order.index(2) < max(i for i, b in enumerate(order) if b == 0)  # 2 jumps ahead of 0's tail
    tl = simulate_issue(partition(plan, 1 * KB), ready, service, credit=2 * KB, order=list(issue.chunks))
    assert tl.max_in_flight <= 2 * KB
    # Unbounded credit: everything ready is issued at once and nothing can be overtaken later.
    free = priority_plan(plan, ready_times=ready, service=service, partition_bytes=1 * KB, credit=0, priority=prio)
    assert [c.bucket for c in free.chunks] == fifo


# ------------------------------------------------------------------------------------ simulator
def _layers(n: int, f: float, b: float, nbytes: int) -> list[Layer]:
    return [Layer(f"l{i}", f, b, nbytes) for i in range(n)]


def _one_bucket_per_layer(kind: str, nbytes: int, **kw) -> Schedule:
    mb = nbytes / (1024 * 1024)
    return Schedule(kind=kind, bucket_cap_mb=mb, first_bucket_cap_mb=mb, **kw)


def test_no_overlap_is_compute_plus_communication():
    layers = _layers(5, 1.0, 2.0, 1000)
    for c in (0.1, 1.0, 7.0):
        r = simulate(layers, lambda n, c=c: c * n / 1000, _one_bucket_per_layer("none", 1000))
        assert r.iteration == pytest.approx(r.compute + r.communication, rel=1e-12)
        assert r.communication == pytest.approx(5 * c, rel=1e-12)


def test_ddp_compute_bound_is_compute_plus_last_bucket():
    """Each bucket's reduction shorter than the next layer's backward: all but the last bucket hide."""
    layers = _layers(6, 1.0, 2.0, 1000)
    for c in (0.25, 1.0, 2.0):
        r = simulate(layers, lambda n, c=c: c * n / 1000, _one_bucket_per_layer("ddp", 1000))
        assert r.iteration == pytest.approx(r.compute + c, rel=1e-12)
        assert r.exposed == pytest.approx(c, rel=1e-12)


def test_overlap_bounds():
    """max(compute, communication) <= iteration for every schedule; the overlapped schedules are never
    slower than DDP's, which is never slower than no overlap."""
    layers = _layers(6, 1.0, 2.0, 4000)
    for c in (0.5, 2.0, 3.0, 6.0):
        svc = lambda n, c=c: c * n / 4000  # noqa: E731
        res = {k: simulate(layers, svc, _one_bucket_per_layer(k, 4000, partition_mb=1000 / 2**20,
                                                              credit_mb=2000 / 2**20)) for k in SCHEDULES}
        for r in res.values():
            assert r.iteration >= max(r.compute, r.communication) - 1e-9
        assert res["none"].iteration >= res["ddp"].iteration - 1e-9
        assert res["ddp"].iteration >= res["fifo"].iteration - 1e-9
        assert res["ddp"].iteration >= res["priority"].iteration - 1e-9
    # Communication-bound: the next forward's overlap is what the priority plan buys.
    svc = lambda n: 3.0 * n / 4000  # noqa: E731
    ddp = simulate(layers, svc, _one_bucket_per_layer("ddp", 4000))
    prio = simulate(layers, svc, _one_bucket_per_layer("priority", 4000, partition_mb=1000 / 2**20,
                                                       credit_mb=2000 / 2**20))
    assert prio.iteration < ddp.iteration


def test_optimizer_steps_on_the_compute_lane_of_the_next_forward():
    """OverlapDataParallel steps a bucket's optimizer in its training thread when the next forward
    first needs the bucket (with every other bucket reduced by then). Two layers, forward 1 s and
    backward 2 s each, 0.5 s of optimizer per bucket. A free link: 2 + 4 + 2 x 0.5 = 7 s for every
    schedule (a lane of its own would hide the first bucket's step behind backward: 6.5 s). 3 s per
    bucket, fifo: backward ends at 6, the buckets are reduced at 7 and 10, both steps run from 10 to
    11, and the next backward ends at 17: 11 s."""
    layers = _layers(2, 1.0, 2.0, 1000)
    for kind in SCHEDULES:
        sched = _one_bucket_per_layer(kind, 1000, optimizer_seconds_per_byte=0.5 / 1000)
        assert simulate(layers, lambda n: 0.0, sched).iteration == pytest.approx(7.0, rel=1e-12), kind
    slow = simulate(layers, lambda n: 3.0 * n / 1000,
                    _one_bucket_per_layer("fifo", 1000, optimizer_seconds_per_byte=0.5 / 1000))
    assert slow.iteration == pytest.approx(11.0, rel=1e-12)
    steps = sorted((s, lane, label) for lane, label, s, _ in slow.timeline if label.startswith("O"))
    # Buckets are numbered in ready order: bucket 0 holds the last layer, reduced first.
    assert [(lane, label) for _, lane, label in steps[:2]] == [("compute", "O0"), ("compute", "O1")]


def test_contention_slows_only_overlapped_compute():
    """Two layers, backward 1 s each, forward free, 1.5 s per bucket, compute half speed while the
    link is busy. DDP: the last layer's bucket goes at t=1 and keeps the link busy to 2.5, so the
    first layer's second of backward does 0.75 s of work by then and ends at 2.75; its bucket ends
    at 4.25. Without contention: 1 + 1.5 + 1.5 = 4. No overlap is untouched (3 + 2 x 1.5 = 5)."""
    layers = _layers(2, 0.0, 1.0, 1000)
    svc = lambda n: 1.5 * n / 1000  # noqa: E731
    assert simulate(layers, svc, _one_bucket_per_layer("ddp", 1000)).iteration == pytest.approx(4.0)
    slow = simulate(layers, svc, _one_bucket_per_layer("ddp", 1000, overlap_slowdown=2.0))
    assert slow.iteration == pytest.approx(4.25, rel=1e-12)
    assert slow.compute == pytest.approx(2.0)  # compute alone, as measured without communication
    none = simulate(layers, svc, _one_bucket_per_layer("none", 1000, overlap_slowdown=2.0))
    assert none.iteration == pytest.approx(2.0 + 3.0, rel=1e-12)
    # Monotone in the slowdown, for every schedule, on a transformer.
    topo = Topology(nodes=((0, 1), (2, 3)), rank=0, world_size=4)
    gpt = transformer_layers("gpt2-124m", tokens=2048, flops=2e12, grad_bytes_per_param=4)
    svc = link_service("hierarchical", topo, cost.CostModel(cost.DEFAULT_INTRA, cost.LinkModel(20e-6, 8 / 4e9)))
    for kind in SCHEDULES:
        times = [simulate(gpt, svc, Schedule(kind=kind, partition_mb=4, credit_mb=16, overlap_slowdown=s)).iteration
                 for s in (1.0, 1.2, 1.5, 2.0)]
        assert all(a <= b + 1e-9 for a, b in zip(times, times[1:])), (kind, times)
    with pytest.raises(ValueError, match="overlap_slowdown"):
        Schedule(overlap_slowdown=0.9)


@pytest.mark.parametrize("kind", SCHEDULES)
def test_monotone_in_bandwidth_and_compute(kind):
    topo = Topology(nodes=((0, 1), (2, 3)), rank=0, world_size=4)
    layers = transformer_layers("gpt2-124m", tokens=2048, flops=2e12, grad_bytes_per_param=4)
    sched = Schedule(kind=kind, bucket_cap_mb=25, first_bucket_cap_mb=1, partition_mb=4, credit_mb=16)
    rates = [1e9, 4e9, 16e9, 64e9]
    times = []
    for rate in rates:
        model = cost.CostModel(cost.DEFAULT_INTRA, cost.LinkModel(20e-6, 8 / rate))
        times.append(simulate(layers, link_service("hierarchical", topo, model), sched).iteration)
    assert all(a >= b - 1e-12 for a, b in zip(times, times[1:])), times
    model = cost.CostModel(cost.DEFAULT_INTRA, cost.LinkModel(20e-6, 8 / 4e9))
    svc = link_service("hierarchical", topo, model)
    by_compute = [simulate(transformer_layers("gpt2-124m", tokens=2048, flops=f, grad_bytes_per_param=4), svc,
                           sched).iteration for f in (8e12, 4e12, 2e12, 1e12)]
    assert all(a <= b + 1e-12 for a, b in zip(by_compute, by_compute[1:])), by_compute


def test_compression_shortens_communication():
    topo = Topology(nodes=((0, 1), (2, 3)), rank=0, world_size=4)
    model = cost.CostModel(cost.DEFAULT_INTRA, cost.LinkModel(20e-6, 8 / 1e9))
    layers = transformer_layers("gpt2-124m", tokens=2048, flops=2e12)
    plain = simulate(layers, link_service("hierarchical", topo, model), Schedule("ddp"))
    half = simulate(layers, link_service("hierarchical", topo, model, ratio=0.5),
                    Schedule("ddp", compression_ratio=0.5))
    assert half.communication < plain.communication
    assert half.iteration <= plain.iteration


def test_layers_from_model_measures_every_parameterised_layer():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 8))
    layers = layers_from_model(model, torch.randn(4, 16), repeats=2)
    assert [layer.grad_bytes for layer in layers] == [(16 * 32 + 32) * 4, (32 * 8 + 8) * 4]
    assert all(layer.forward >= 0 and layer.backward >= 0 for layer in layers)
    assert all(p.grad is None for p in model.parameters())


# ------------------------------------------------------------------------------------ traffic
@pytest.mark.parametrize("spec", ["2x2", "4x8", "3x2"])
def test_traffic_matrix_matches_closed_form_byte_counts(spec):
    """The algorithms' traffic() against the textbook volumes (node-by-node placement): a flat ring
    crosses each node's link once with 2(p-1)/p S, the hierarchy 2(N-1)/N S per node link, and an
    all-to-all L(p-L)/p S per node link with either algorithm."""
    n, local = (int(v) for v in spec.split("x"))
    p = n * local
    topo = Topology(nodes=tuple(tuple(range(i * local, (i + 1) * local)) for i in range(n)), rank=0, world_size=p)
    s = 1 << 20
    node_of = {r: i for i, nd in enumerate(topo.nodes) for r in nd}

    def off_node(m: torch.Tensor, node: int) -> float:
        return float(sum(m[a, b] for a, b in itertools.product(range(p), range(p))
                         if node_of[a] == node and node_of[b] != node))

    flat = traffic_matrix("flat", s, topo)
    assert torch.allclose(flat.sum(1), torch.full((p,), 2 * (p - 1) / p * s, dtype=torch.float64))
    assert off_node(flat, 0) == pytest.approx(2 * (p - 1) / p * s)
    assert cost.link_bytes("flat", s, topo) == pytest.approx(2 * (p - 1) / p * s)
    hier = traffic_matrix("hierarchical", s, topo)
    assert off_node(hier, 0) == pytest.approx(2 * (n - 1) / n * s)
    assert cost.link_bytes("hierarchical", s, topo) == pytest.approx(2 * (n - 1) / n * s)
    # Hierarchical traffic is rail-aligned: every inter-node byte stays on its local index.
    for a, b in itertools.product(range(p), range(p)):
        if hier[a, b] and node_of[a] != node_of[b]:
            assert topo.nodes[node_of[a]].index(a) == topo.nodes[node_of[b]].index(b)
    a2a = traffic_matrix("flat", s, topo, op="alltoall")
    two_d = traffic_matrix("2d", s, topo, op="alltoall")
    assert off_node(a2a, 0) == pytest.approx(off_node(two_d, 0))  # same inter-node bytes ...
    assert int((two_d > 0).sum()) <= int((a2a > 0).sum())  # ... over fewer pairs
    assert off_node(two_d, 0) == pytest.approx(local * (p - local) / p * s)
    assert cost.link_bytes("2d", s, topo, "alltoall") == pytest.approx(local * (p - local) / p * s)


def test_iteration_traffic_is_sparse_at_scale():
    topo = Topology(nodes=tuple(tuple(range(i * 8, (i + 1) * 8)) for i in range(16)), rank=0, world_size=128)
    layers = transformer_layers("gpt2-124m", tokens=1024, flops=1e14)
    m = iteration_traffic(layers, "hierarchical", topo)
    pairs = (m > 0).float().mean().item()
    assert pairs < 0.1  # rails and nodes only: most pairs exchange nothing
    assert m.sum().item() > 0


def test_simulate_command_rows_and_timeline_with_an_optimizer_cost(tmp_path):
    """The README's ``commopt-bench simulate`` with an optimizer cost: one row per schedule, the
    overlapped ones slower than with a free optimizer (it runs on the compute lane), and the
    timeline PNG (its optimizer segments once had no colour, and drawing raised)."""
    from commopt.bench import simulate as cmd

    def rows(*extra: str) -> dict[str, float]:
        argv = ["--model", "gpt2-124m", "--nodes", "2", "--ranks-per-node", "2", *extra]
        return {r["schedule"]: r["iteration"] for r in cmd.run(cmd._parser().parse_args(argv))}

    png = tmp_path / "timeline.png"
    costly = rows("--optimizer-gbps", "50", "--png", str(png))
    free = rows("--png", "")
    assert list(costly)[:len(SCHEDULES)] == list(SCHEDULES)
    sharded = [k for k in list(costly)[len(SCHEDULES):] if not k.startswith("diloco")]  # DiLoCo: DDP inside
    assert [k for k in costly if k.startswith("diloco")][:2] == ["diloco H=8, fp32", "diloco H=32, fp32"]
    assert sharded[:2] == ["fsdp2 (flat)", "fsdp2 hierarchical"] and any("zero++" in k for k in sharded)
    for kind in ("fifo", "priority", *sharded):
        assert costly[kind] > free[kind]
    if cmd.pyplot("timeline") is not None:
        assert png.stat().st_size > 10_000


# ------------------------------------------------------------------------------------ sharded (FSDP2 / HSDP)
def _grid(n: int, local: int) -> Topology:
    return Topology(nodes=tuple(tuple(range(i * local, (i + 1) * local)) for i in range(n)), rank=0,
                    world_size=n * local)


def test_sharded_iteration_is_the_sum_of_its_collectives_without_compute():
    """With no compute every collective is exposed: the iteration is exactly the sum of the
    all-gathers (forward, and again for backward but for the last layer, which FSDP2 keeps
    gathered) and the reduce-scatters, each priced by the algorithm objects' cost()."""
    from commopt.comm import algorithms
    from commopt.schedules.simulator import ShardedPlan, simulate_sharded

    topo = _grid(2, 2)
    model = cost.CostModel(cost.LinkModel(1e-5, 1e-9), cost.LinkModel(5e-5, 4e-8))
    sizes = [1 << 20, 3 << 20, 2 << 20]
    layers = [Layer(f"l{i}", 0.0, 0.0, s) for i, s in enumerate(sizes)]
    flat = algorithms.get("flat")
    ag = [flat.cost(model, "all_gather", s, topo) for s in sizes]
    rs = [flat.cost(model, "reduce_scatter", s, topo) for s in sizes]
    r = simulate_sharded(layers, topo, ShardedPlan(), model)
    assert r.iteration == pytest.approx(sum(ag) + sum(ag[:-1]) + sum(rs))
    kept = simulate_sharded(layers, topo, ShardedPlan(reshard_after_forward=False), model)
    assert kept.iteration == pytest.approx(sum(ag) + sum(rs))
    assert r.compute == 0 and r.exposed == pytest.approx(r.iteration)


def test_sharded_plans_order_as_their_traffic_says():
    """On a slow node link: hierarchical beats flat, ZeRO++ (quantized, hpZ) beats hierarchical, hpZ
    alone removes the backward all-gather from the node link, HSDP moves only the shard's all-reduce
    across nodes; with compute, prefetching hides more than issuing at the layer."""
    from commopt.schedules.simulator import ShardedPlan, simulate_sharded

    topo = _grid(4, 4)
    model = cost.CostModel(cost.LinkModel(5e-6, 1 / 50e9), cost.LinkModel(2e-5, 1 / 1e9))
    layers = transformer_layers("gpt-350m", tokens=4096, flops=100e12)
    t = {name: simulate_sharded(layers, topo, plan, model).iteration for name, plan in {
        "flat": ShardedPlan(), "hier": ShardedPlan(algorithm="hierarchical"),
        "hpz": ShardedPlan(algorithm="hierarchical", hpz=True),
        "zero++": ShardedPlan(algorithm="hierarchical", hpz=True, weight_ratio=0.25, grad_ratio=0.13),
        "hsdp": ShardedPlan(kind="hsdp"), "hsdp-int8": ShardedPlan(kind="hsdp", grad_ratio=0.25),
        "no-prefetch": ShardedPlan(prefetch=False)}.items()}
    assert t["zero++"] < t["hpz"] < t["hier"] < t["flat"] < t["no-prefetch"]
    assert t["hsdp-int8"] < t["hsdp"]
    with pytest.raises(ValueError, match="needs nodes of equal size"):
        simulate_sharded(layers, Topology(nodes=((0, 1), (2,)), rank=0, world_size=3),
                         ShardedPlan(algorithm="hierarchical"), model)
    with pytest.raises(ValueError, match="kind"):
        ShardedPlan(kind="zero")


def test_sharded_measured_collectives_codec_and_shared_rails():
    """Given measured collective times and no prefetch, a step is every layer's compute plus its
    collectives, in sequence, plus the last reduction (the schedule alone, by hand), and with
    blocking reductions every reduction on the critical path; the codec cost
    adds bytes x seconds/byte to every compressed collective only; HSDP's rails share the node link:
    its inter-node time is that of one rail carrying the whole node's bytes."""
    from commopt.comm.algorithms import get
    from commopt.schedules.simulator import Layer, ShardedPlan, simulate_sharded

    topo = _grid(2, 2)
    model = cost.CostModel(cost.LinkModel(1e-5, 1 / 10e9), cost.LinkModel(1e-4, 1 / 1e8))
    layers = [Layer(f"l{i}", 0.01 * (i + 1), 0.02 * (i + 1), 1 << 20) for i in range(3)]
    fg, bg, red = 0.003, 0.002, 0.005
    plan = ShardedPlan(prefetch=False)
    r = simulate_sharded(layers, topo, plan, model, (lambda n: fg, lambda n: bg, lambda n: red))
    n = len(layers)
    # forward: gather, compute, per layer; backward: regather (not the last layer), compute, and
    # the reductions queue on the link behind the regathers (the last one ends the step).
    fwd = sum(fg + x.forward for x in layers)
    t = fwd
    link = fwd  # link free time
    for i in reversed(range(n)):
        if i != n - 1:
            start = max(t, link)
            link = start + bg
            t = link
        t += layers[i].backward
        link = max(t, link) + red
    assert r.iteration == pytest.approx(max(t, link))
    # Blocking reductions (FSDP2 on CPU): backward resumes only once its layer's reduction is done.
    # Without regathers, backward otherwise runs ahead while the reductions queue on the link.
    measured = (lambda n: fg, lambda n: bg, lambda n: red)
    kept = dict(prefetch=False, reshard_after_forward=False)
    ahead = simulate_sharded(layers, topo, ShardedPlan(**kept), model, measured).iteration
    blocking = simulate_sharded(layers, topo, ShardedPlan(**kept, blocking_reduce=True), model, measured).iteration
    backward = sum(x.backward for x in layers)
    assert blocking == pytest.approx(fwd + backward + n * red)
    link = fwd
    t = fwd
    for i in reversed(range(n)):
        t += layers[i].backward
        link = max(t, link) + red
    assert ahead == pytest.approx(link) and ahead < blocking
    # The codec: only compressed collectives pay it (bytes x seconds per byte).
    base = simulate_sharded(layers, topo, ShardedPlan(grad_ratio=0.25), model).iteration
    coded = simulate_sharded(layers, topo, ShardedPlan(grad_ratio=0.25, codec_seconds_per_byte=1e-9), model).iteration
    exact = simulate_sharded(layers, topo, ShardedPlan(codec_seconds_per_byte=1e-9), model).iteration
    assert coded > base and exact == simulate_sharded(layers, topo, ShardedPlan(), model).iteration
    # A gradient codec of its own replaces the codec on the reduction only (bytes x the difference).
    from commopt.schedules.simulator import _sharded_times

    both = dict(weight_ratio=0.25, grad_ratio=0.25, codec_seconds_per_byte=1e-9)
    g1, b1, r1 = _sharded_times(ShardedPlan(**both), topo, model)
    g2, b2, r2 = _sharded_times(ShardedPlan(**both, grad_codec_seconds_per_byte=3e-9), topo, model)
    m = float(1 << 20)
    assert g2(m) == g1(m) and b2(m) == b1(m) and r2(m) == pytest.approx(r1(m) + m * 2e-9)
    for bad in (dict(codec_seconds_per_byte=-1e-9), dict(grad_codec_seconds_per_byte=float("nan"))):
        with pytest.raises(ValueError, match="must be a cost >= 0 seconds per byte"):
            ShardedPlan(**bad)
    # HSDP: the rail level of one layer is the flat all-reduce of the node's bytes on a rail.
    _, _, reduce = _sharded_times(ShardedPlan("hsdp"), topo, model)
    node = Topology(nodes=((0, 1),), rank=0, world_size=2)
    rail = Topology(nodes=((0,), (1,)), rank=0, world_size=2)
    nbytes = 1 << 20
    want = get("flat").cost(model, "reduce_scatter", nbytes, node) + get("flat").cost(model, "allreduce", nbytes, rail)
    assert reduce(nbytes) == pytest.approx(want)


def test_tensor_parallel_block_limits():
    """simulate_tensor_parallel against arithmetic: a free link hides nothing and costs nothing; free
    compute leaves exactly the eight collectives' steps (decomposed or not); in between, the decomposed
    rings hide what a slice of each matmul covers, never more than the communication, never less than 0."""
    from commopt.comm.cost import LinkModel
    from commopt.schedules.simulator import TransformerConfig, simulate_tensor_parallel

    cfg = TransformerConfig(n_layer=2, d_model=64, seq=128)
    tokens, tp = 256, 4
    act = tokens * 64 * 2
    free = LinkModel(0.0, 0.0)
    for dec in (False, True):
        r = simulate_tensor_parallel(cfg, tp=tp, tokens=tokens, flops=1e9, link=free, decomposed=dec)
        # (the decomposed step sums the same seconds in another order: equal to rounding)
        assert r.communication == 0 and r.exposed == pytest.approx(0, abs=1e-12) and r.step == pytest.approx(r.compute)
    link = LinkModel(1e-5, 1e-8)
    comm = 8 * (tp - 1) * (1e-5 + act / tp * 1e-8)
    for dec in (False, True):
        r = simulate_tensor_parallel(cfg, tp=tp, tokens=tokens, flops=1e30, link=link, decomposed=dec)
        assert r.communication == pytest.approx(comm) and r.step == pytest.approx(comm, rel=1e-9)
    unfused = simulate_tensor_parallel(cfg, tp=tp, tokens=tokens, flops=1e9, link=link, decomposed=False)
    dec = simulate_tensor_parallel(cfg, tp=tp, tokens=tokens, flops=1e9, link=link, decomposed=True)
    assert unfused.step == pytest.approx(unfused.compute + comm)
    assert dec.compute == unfused.compute and 0 <= dec.exposed < unfused.exposed
    one = simulate_tensor_parallel(cfg, tp=1, tokens=tokens, flops=1e9, link=link, decomposed=True)
    assert one.communication == 0 and one.compute == pytest.approx(tp * unfused.compute)
    with pytest.raises(ValueError, match="tp must be"):
        simulate_tensor_parallel(cfg, tp=0, tokens=tokens, flops=1e9, link=link, decomposed=True)
    # ffn: the MLP's two matmuls scale with it and nothing else does (the default is 4 d_model).
    wide = simulate_tensor_parallel(cfg, tp=tp, tokens=tokens, flops=1e9, link=free, decomposed=False, ffn=512)
    default = simulate_tensor_parallel(cfg, tp=tp, tokens=tokens, flops=1e9, link=free, decomposed=False, ffn=256)
    assert default.compute == pytest.approx(unfused.compute)
    assert wide.compute - default.compute == pytest.approx(3 * 2 * 2 * tokens * 64 * 256 / tp / 1e9)
    for bad in (0, 2.5, True):
        with pytest.raises(ValueError, match="ffn must be"):
            simulate_tensor_parallel(cfg, tp=tp, tokens=tokens, flops=1e9, link=link, decomposed=True, ffn=bad)

    # Chunks at TP 2, a link without latency: the chunks of the other block arrive at (j + 1) M / n
    # (M: a block's transfer), its slices of P / n each (P: a block's matmul) follow them, after this
    # rank's own block: a ring takes max(2 P, P + M / n, M + P / n) -- 3 P at M = 2 P unchunked. The
    # backward rings of QKV and FC1 also compute the weight gradient (2 P) as their last step begins:
    # max(4 P, P + M / n, M + P / n).
    bw = LinkModel(0.0, 2e-8)
    two = simulate_tensor_parallel(cfg, tp=2, tokens=tokens, flops=1e9, link=bw, decomposed=False)
    mats = [2 * tokens * 64 * w / 2 / 1e9 for w in (3 * 64, 64, 256, 256)]
    # What hides nothing: OUT's and FC2's weight gradients and the attention core.
    others = two.compute - 2 * sum(mats) - mats[0] - mats[2]
    m = bw.time(tokens * 64 * 2 / 2)
    for n in (1, 2, 4):
        def ring(x, weights=False, n=n):
            return max((4 if weights else 2) * (x / 2), x / 2 + m / n, m + x / 2 / n)

        want = sum(ring(x) for x in mats) + sum(ring(x, i in (0, 2)) for i, x in enumerate(mats)) + others
        got = simulate_tensor_parallel(cfg, tp=2, tokens=tokens, flops=1e9, link=bw, decomposed=True, chunks=n)
        assert got.step == pytest.approx(want) and got.communication == pytest.approx(two.communication)
    for bad in (0, 1.5, True):
        with pytest.raises(ValueError, match="chunks must be"):
            simulate_tensor_parallel(cfg, tp=2, tokens=tokens, flops=1e9, link=bw, decomposed=True, chunks=bad)


def test_sharded_prefetch_waits_for_the_current_gather_and_fsdp2s_gap():
    """``prefetch_issue_seconds``: each prefetched all-gather is issued only once the current one is
    done, that many seconds later (FSDP2's copy-out and hooks on CPU), so with gathers longer than
    compute every prefetched gather on the critical path adds the gap; None keeps the issue at once.
    The timelines by hand: 3 layers, forward 1 ms, backward 2 ms, gathers 10 ms, reductions 5 ms
    (blocking), gap 4 ms."""
    from commopt.schedules.simulator import Layer, ShardedPlan, simulate_sharded

    topo = _grid(2, 2)
    layers = [Layer(f"l{i}", 0.001, 0.002, 1 << 20) for i in range(3)]
    measured = (lambda n: 0.010, lambda n: 0.010, lambda n: 0.005)

    def step(gap):
        plan = ShardedPlan(blocking_reduce=True, prefetch_issue_seconds=gap)
        return simulate_sharded(layers, topo, plan, collectives=measured).iteration

    # At once: g1 and g2 follow g0 on the link (ends 10, 20, 30 ms); F2 ends 31; backward prefetches
    # g1 (41), r2 queues behind it (46), g0 (56), r1 (61), B0 (63), r0 (68).
    assert step(None) == pytest.approx(0.068)
    assert step(0.0) == pytest.approx(0.068)
    # With the gap: g1 issued at 10 + 4 (ends 24), g2 at 24 + 4 (ends 38); F2 ends 39; g1 at 43 (53),
    # r2 (58), g0 at 62 (72), r1 (77), B0 (79), r0 (84): four gaps on the critical path.
    assert step(0.004) == pytest.approx(0.084)
    for bad in (-0.001, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="prefetch_issue_seconds"):
            ShardedPlan(prefetch_issue_seconds=bad)


def test_sharded_simulator_takes_measured_lines():
    """simulate_sharded(lines=): where the plan's algorithm has a measured line for a collective, the
    line is that collective's time (the oracle: the same schedule given those times directly); without
    lines, or for another algorithm's, the level model's."""
    from commopt.comm.cost import CostModel, LinkModel
    from commopt.schedules.simulator import Layer, ShardedPlan, simulate_sharded

    topo = Topology(nodes=((0, 1), (2, 3)), rank=0, world_size=4)
    layers = [Layer(f"l{i}", 0.01, 0.02, 4 << 20) for i in range(3)]
    model = CostModel(LinkModel(1e-5, 1e-10), LinkModel(1e-4, 1e-8))
    plan = ShardedPlan("fsdp", "hierarchical")
    line = LinkModel(3e-3, 2e-9)
    lines = {"all_gather": {"hierarchical": line}, "reduce_scatter": {"hierarchical": line}}
    got = simulate_sharded(layers, topo, plan, model, lines=lines)
    want = simulate_sharded(layers, topo, plan, model, collectives=(line.time, line.time, line.time))
    assert got.iteration == pytest.approx(want.iteration) and got.communication == pytest.approx(want.communication)
    plain = simulate_sharded(layers, topo, plan, model)
    other = simulate_sharded(layers, topo, plan, model, lines={"all_gather": {"flat": line}})
    assert other.iteration == plain.iteration and plain.iteration != pytest.approx(got.iteration)


def test_diloco_simulation_against_arithmetic():
    """simulate_diloco: one node never syncs; a sync of the whole model costs the flat all-reduce of its
    bytes along the rails, spread over H inner steps; a delay long enough hides it; fragments sync
    1/F of the bytes F times per H; a codec's ratio scales the bytes; bad schedules are ValueErrors."""
    from commopt.comm.cost import CostModel, LinkModel, predict
    from commopt.schedules.simulator import Layer, simulate_diloco

    layers = [Layer(f"l{i}", 0.01, 0.02, 8 << 20) for i in range(4)]
    model = CostModel(LinkModel(1e-5, 1e-10), LinkModel(1e-4, 1e-8))
    total = 4 * (8 << 20)
    compute = 4 * 0.03
    one_node = simulate_diloco(layers, Topology(nodes=((0, 1, 2, 3),), rank=0, world_size=4), model, sync_every=4)
    assert one_node.sync == 0 and one_node.exposed == 0 and one_node.step == one_node.inner
    topo = Topology(nodes=((0,), (1,), (2,), (3,)), rank=0, world_size=4)
    rail = Topology(nodes=((0,), (1,), (2,), (3,)), rank=0, world_size=4)
    r = simulate_diloco(layers, topo, model, sync_every=8)
    assert r.inner == pytest.approx(compute) and r.sync == pytest.approx(predict("flat", total, rail, model))
    assert r.step == pytest.approx(compute + r.sync / 8)
    hidden = simulate_diloco(layers, topo, model, sync_every=8, delay=int(r.sync / compute) + 1)
    assert hidden.exposed == 0 and hidden.step == pytest.approx(compute)
    frag = simulate_diloco(layers, topo, model, sync_every=8, fragments=4, ratio=0.25)
    assert frag.sync == pytest.approx(predict("flat", total / 4 * 0.25, rail, model))
    assert frag.exposed == pytest.approx(4 * frag.sync / 8) and frag.link_bytes_per_step < r.link_bytes_per_step
    for bad in ({"sync_every": 0}, {"sync_every": 4, "delay": 4}, {"sync_every": 4, "fragments": 0}):
        with pytest.raises(ValueError, match="simulate_diloco"):
            simulate_diloco(layers, topo, model, **bad)
