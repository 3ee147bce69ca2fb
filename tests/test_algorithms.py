"""The algorithm objects (``commopt.comm.algorithms``, issue 16): what the engine counts equals what
``traffic()`` predicts, for every algorithm and collective.

The engine's counters are the bytes each phase reports it sent, summed by the transport from the
tensors it actually posted (padding and pipelining chunks included); ``traffic()`` is the
algorithm's model of the same call, which ``cost``, ``auto``, the simulator and the benchmarks read.
The two are computed independently, so a phase that sends more (or less) than the model says, or a
model that forgets padding, fails here. The ``ina`` algorithm is checked in test_ina_async.py (it
needs a switch). docs/faults.md row 23 (2+1, interleaved and one-level topologies).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from commopt.comm import Topology, algorithms, all_gather, all_reduce, all_to_all, context, cost, reduce_scatter
from commopt.comm.collectives import select_algorithm

# Sizes: odd (the hierarchy pads to a multiple of the node size), and 4 MiB of fp32 under a model
# that pipelines it over several chunks.
SIZES = (1001, 1 << 20)


def _pipelining_model(topo: Topology) -> None:
    """Two levels of equal, slow rates and room for 8 chunks: hierarchical and leader cut 4 MiB into
    several (each level's transfer then hides behind the other's)."""
    model = cost.CostModel(cost.LinkModel(5e-6, 1 / 1e8), cost.LinkModel(2e-5, 1 / 1e8), chunks=8)
    context().cost_models.put((topo.layout, id(topo.group)), model)


def _sent() -> float:
    # The agreement check's header is not the algorithm's traffic.
    return float(sum(v for k, v in context().engine().bytes_sent().items() if not k.endswith("/agree")))


def _counted_against_traffic(spec) -> list[tuple]:
    rank, world = dist.get_rank(), dist.get_world_size()
    topo = Topology.from_nodes(spec) if isinstance(spec, list) else Topology.from_spec(spec)
    _pipelining_model(topo)
    rows = []
    engine = context().engine()
    for dtype in (torch.float32, torch.float16):
        for n in SIZES:
            esize = torch.empty(0, dtype=dtype).element_size()
            for algo in ("flat", "hierarchical", "leader"):
                if algorithms.get(algo).supports(topo, "allreduce") is not None:
                    continue
                engine.reset_stats()
                all_reduce(torch.ones(n, dtype=dtype), topology=topo, algorithm=algo)
                expect = algorithms.get(algo).traffic("allreduce", n * esize, topo, itemsize=esize).sent(rank)
                chunks = engine.calls().get(algo, 1)
                rows.append(("allreduce", algo, str(dtype), n, chunks, _sent(), expect))
            for kind in ("reduce_scatter", "all_gather"):
                for algo in ("flat", "hierarchical"):
                    if algorithms.get(algo).supports(topo, kind) is not None:
                        continue
                    ran = select_algorithm(kind, algo, world * n * esize, topo)
                    engine.reset_stats()
                    if kind == "reduce_scatter":
                        reduce_scatter(torch.empty(n, dtype=dtype), torch.ones(world * n, dtype=dtype), topology=topo,
                                       algorithm=algo)
                    else:
                        all_gather(torch.empty(world * n, dtype=dtype), torch.ones(n, dtype=dtype), topology=topo,
                                   algorithm=algo)
                    expect = algorithms.get(ran).traffic(kind, world * n * esize, topo, itemsize=esize).sent(rank)
                    rows.append((kind, ran, str(dtype), n, 1, _sent(), expect))
        for algo in ("flat", "2d"):
            if algorithms.get(algo).supports(topo, "alltoall") is not None:
                continue
            x = torch.ones(world * 37, 3, dtype=dtype)
            engine.reset_stats()
            all_to_all(torch.empty_like(x), x, topology=topo, algorithm=algo)
            nbytes = x.numel() * x.element_size()
            ran = "flat" if topo.num_nodes in (1, world) else algo
            expect = algorithms.get(ran).traffic("alltoall", nbytes, topo, itemsize=x.element_size()).sent(rank)
            rows.append(("alltoall", ran, str(dtype), x.shape[0], 1, _sent(), expect))
    return rows


@pytest.mark.parametrize("spec,world", [("2x2", 4), ([[0, 2], [1, 3]], 4), ("1x4", 4), ("4x1", 4), ("2+1", 3)])
def test_engine_counted_bytes_equal_traffic(ranks, spec, world):
    res = ranks(world, _counted_against_traffic, spec, timeout=240)
    pipelined = set()
    for rank, rows in enumerate(res):
        assert rows, "no algorithm ran"
        for kind, algo, dtype, n, chunks, counted, expect in rows:
            assert counted == pytest.approx(expect, rel=1e-9, abs=1.0), (
                f"rank {rank}: {kind}/{algo} {dtype} n={n}: engine counted {counted} B, traffic() says {expect} B")
            if chunks > 1:
                pipelined.add(algo)
    if spec == "2x2":
        # The comparison covered pipelined calls too (one engine op per chunk).
        assert {"hierarchical", "leader"} <= pipelined


def test_traffic_is_what_every_consumer_reads():
    """cost.link_bytes, cost.predict and the simulator's matrix come from the algorithm objects, and
    each algorithm's traffic on a 2x2 is the textbook volume per node link."""
    from commopt.schedules.simulator import traffic_matrix

    topo = Topology(nodes=((0, 1), (2, 3)), rank=0, world_size=4)
    s = float(1 << 20)
    expected = {("flat", "allreduce"): 1.5 * s, ("hierarchical", "allreduce"): s, ("leader", "allreduce"): s,
                ("ina", "allreduce"): 2 * s, ("flat", "alltoall"): s, ("2d", "alltoall"): s,
                ("hierarchical", "reduce_scatter"): s / 2, ("flat", "reduce_scatter"): 0.75 * s}
    for (name, kind), link in expected.items():
        algo = algorithms.get(name)
        assert algo.traffic(kind, s, topo).link_bytes() == pytest.approx(link), (name, kind)
        assert cost.link_bytes(name, s, topo, kind) == pytest.approx(link), (name, kind)
        assert cost.predict(name, s, topo, op=kind) == algo.cost(cost.CostModel(cost.DEFAULT_INTRA, cost.DEFAULT_INTER),
                                                                 kind, s, topo)
        m = traffic_matrix(name, s, topo, op=kind)
        assert float(m.sum()) == pytest.approx(sum(algo.traffic(kind, s, topo).pairs.values()))
    assert traffic_matrix("ina", s, topo).shape == (5, 5)  # the switch is index p
    with pytest.raises(ValueError, match="needs nodes of equal size"):
        traffic_matrix("hierarchical", s, Topology(nodes=((0, 1), (2,)), rank=0, world_size=3))
    with pytest.raises(ValueError, match="unknown algorithm"):
        algorithms.get("ring")


def _posting_order() -> tuple[list[tuple[str, int]], list[float]]:
    from commopt.comm.algorithms._transport import exchange_all_gather

    posted = []
    real = dist.isend, dist.irecv

    def recorded(kind, fn):
        def post(tensor, *args, **kwargs):  # the peer by group rank (group_src / group_dst), or positional
            posted.append((kind, kwargs.get("group_src", kwargs.get("group_dst", args[0] if args else None))))
            return fn(tensor, *args, **kwargs)
        return post

    dist.isend, dist.irecv = recorded("send", real[0]), recorded("recv", real[1])
    try:
        world, rank = dist.get_world_size(), dist.get_rank()
        out = torch.empty(world * 5)
        exchange_all_gather(out, torch.full((5,), float(rank)), dist.group.WORLD, 30.0)
    finally:
        dist.isend, dist.irecv = real
    return posted, out.tolist()


def test_pairwise_posts_every_receive_before_any_send(ranks):
    """gloo moves a point-to-point payload only once the receiver has said it is ready, and that
    notice shares the TCP connection with the receiver's own payload to the same peer: a send posted
    before the matching receive queued the notice behind it, and a two-way exchange between ranks that
    arrived at different times ran one direction after the other (a block's all-gather in an FSDP2
    step took 95-120 ms one way where the link needs 66 ms). Every receive is posted first
    (docs/results.md 24)."""
    for rank, (posted, out) in enumerate(ranks(3, _posting_order)):
        assert out == [float(j) for j in range(3) for _ in range(5)], f"rank {rank}: wrong all-gather {out}"
        kinds = [kind for kind, _ in posted]
        assert sorted(peer for kind, peer in posted if kind == "recv") == [p for p in range(3) if p != rank]
        assert kinds == ["recv", "recv", "send", "send"], f"rank {rank} posted {posted}"
