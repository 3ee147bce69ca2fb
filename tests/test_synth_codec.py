"""Compressed reductions on ``algorithm="synth"`` (issue 40, item 5): the codec's rounds run by the rail's
synthesized schedules (``comm/algorithms/synth.py``, ``RailTransport``), the intra-node phases exact.

Oracles, each chosen to be bit-exact where the codec's arithmetic allows it:

- bf16 cast: integer-valued inputs in [-16, 16] on 4 ranks, so the pre-divided values (x / 4) and every
  partial sum are exact in bf16 whatever the order: the result is the exact mean, and equals
  ``hierarchical`` (2x2) or ``flat`` (4x1) with the same codec bit for bit;
- int8 quantize: its first shot (the pairwise all-to-all) is the same transfer on both algorithms, its
  second moves bytes only (synth's all-gather copies), with the same seeds: equal to ``hierarchical`` /
  ``flat`` bit for bit;
- PowerSGD in fp64: P and Q are summed in another order than gloo's ring, so equal to ``hierarchical`` /
  ``flat`` within fp64 rounding (1e-9), never bit for bit;

and every rank holds the same bits (each chunk summed once, by one owner, then copied). The DDP hook
trains on synth with a compressor like on hierarchical; ``auto`` with a compressor never weighs synth on
uniform links, and takes it where its cost model says it wins. docs/faults.md row 46 (a codec whose
rounds a schedule cannot carry is refused on every rank before anything moves).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn

from commopt.comm import Topology, all_reduce, context, hooks
from commopt.comm import compression as C
from commopt.comm.algorithms.synth import rail_links, schedule_for
from commopt.comm.compression import auto
from commopt.comm.compression.base import TAG_LEN
from commopt.comm.links import CostModel, LinkMap, LinkModel
from commopt.comm.synthesis.sim import link_bytes

SLOW, FAST = 6.25e6, 25e6


def _topology(spec: str, links: LinkMap | None) -> Topology:
    base = Topology.from_spec(spec)
    return Topology(nodes=base.nodes, rank=base.rank, world_size=base.world_size, links=links)


def _star(n: int) -> LinkMap:
    return LinkMap.star([FAST] * (n - 1) + [SLOW])


def _same_everywhere(t: torch.Tensor) -> bool:
    every = [torch.empty_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(every, t)
    return all(torch.equal(e, t) for e in every)


def _reduced(t: torch.Tensor, make, topo: Topology, algorithm: str) -> torch.Tensor:
    """``t`` averaged through a fresh compressor (``make()``: step 0, no warm start carried over)."""
    out = t.clone()
    assert all_reduce(out, dist.ReduceOp.AVG, topology=topo, algorithm=algorithm, compressor=make(),
                      timeout=60) is out
    return out


def _int8() -> C.QuantizeCompressor:
    return C.QuantizeCompressor(8, 64)


def _powersgd() -> C.PowerSGDCompressor:
    return C.PowerSGDCompressor(rank=2, start_iter=0)


def _codecs(spec: str, other: str) -> dict:
    """Each codec on synth and on ``other`` (hierarchical on 2x2, flat on 4x1, where hierarchical is flat)."""
    rank = dist.get_rank()
    topo = _topology(spec, _star(Topology.from_spec(spec).num_nodes))
    out = {}
    engine = context().engine()
    for numel in (1, 1000, 70_001):
        g = torch.Generator().manual_seed(10 * numel + rank)
        ints = torch.randint(-16, 17, (numel,), generator=g).float()
        want = ints.clone()
        dist.all_reduce(want)
        want /= 4
        before = engine.bytes_sent().get("compress/bf16", 0)
        got = _reduced(ints, C.BF16Compressor, topo, "synth")
        sent = engine.bytes_sent().get("compress/bf16", 0) - before
        assert torch.equal(got, want), f"bf16 {spec} {numel}: not the exact mean"
        assert torch.equal(got, _reduced(ints, C.BF16Compressor, topo, other)), f"bf16 {spec} {numel}"
        assert _same_everywhere(got)
        if topo.local_size == 1:  # the rail is the world: what this rank sends is its part of the schedule
            wire = (numel + TAG_LEN) * 2  # bf16 values and the input's tag
            sched = schedule_for("allreduce", rail_links(topo), wire)
            assert sent == sum(v for (src, _), v in link_bytes(sched, wire, itemsize=2).items() if src == rank)
        x = torch.randn(numel, generator=g)
        got = _reduced(x, _int8, topo, "synth")
        assert torch.equal(got, _reduced(x, _int8, topo, other)), f"int8 {spec} {numel}"
        assert _same_everywhere(got)
    # PowerSGD (fp64): a matrix compressed, a vector exact, both through the synthesized all-reduces.
    for shape in ((64, 48), (5,)):
        m = torch.randn(*shape, generator=torch.Generator().manual_seed(rank), dtype=torch.float64)
        got = _reduced(m, _powersgd, topo, "synth")
        ref = _reduced(m, _powersgd, topo, other)
        assert _same_everywhere(got)
        assert torch.allclose(got, ref, rtol=1e-9, atol=1e-12), f"powersgd {spec} {shape}"
        if len(shape) == 1:
            exact = m.clone()
            dist.all_reduce(exact)
            assert torch.allclose(got, exact / 4, rtol=1e-12, atol=1e-14)
        else:
            assert not torch.allclose(got, m, atol=1e-3)  # compressed: not the input, a rank-2 approximation
    out["ok"] = True
    return out


@pytest.mark.parametrize("spec,other", [("2x2", "hierarchical"), ("4x1", "flat")])
def test_codecs_on_synth_equal_their_oracle(ranks, spec, other):
    """bf16 (exact mean), int8 (bit-exact to the other algorithm), PowerSGD fp64 (1e-9 of it), identical on
    every rank, with the rail rounds run by synthesized schedules on a star with a slow node."""
    assert ranks(4, _codecs, spec, other, timeout=300) == [{"ok": True}] * 4


class _Unroutable(C.BF16Compressor):
    """A codec whose round names no collective synth knows how to route."""

    rounds = ("exchange",)


def _refused() -> list:
    topo = _topology("4x1", _star(4))
    t = torch.ones(100)
    with pytest.raises(ValueError, match="use algorithm='hierarchical'"):
        all_reduce(t, topology=topo, algorithm="synth", compressor=_Unroutable(), timeout=30)
    assert torch.equal(t, torch.ones(100))  # nothing moved, nothing written
    # the same group still works afterwards: no rank was left inside a collective
    return [_reduced(t, C.BF16Compressor, topo, "synth")[0].item()]


def test_unroutable_codec_is_refused_on_every_rank(ranks):
    """docs/faults.md row 46: a codec whose rounds a schedule cannot carry is refused on every rank,
    naming what to use instead, before any byte moves."""
    assert ranks(4, _refused, timeout=120) == [[1.0]] * 4


def _hook(codec: str) -> list:
    make = {"int8": _int8, "powersgd": lambda: C.PowerSGDCompressor(2, start_iter=1)}[codec]
    rank = dist.get_rank()
    topo = _topology("2x2", _star(2))
    params = []
    for algorithm in ("synth", "hierarchical"):
        torch.manual_seed(0)
        model = nn.parallel.DistributedDataParallel(nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4)))
        hooks.register(model, hooks.AllReduceState(topology=topo, algorithm=algorithm, compressor=make()))
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        for step in range(4):
            x = torch.randn(16, 16, generator=torch.Generator().manual_seed(100 * step + rank))
            opt.zero_grad()
            model(x).pow(2).mean().backward()
            opt.step()
        params.append([p.detach().clone() for p in model.parameters()])
    synth, hier = params
    assert all(_same_everywhere(p) for p in synth)
    return [max(float((a - b).abs().max()) for a, b in zip(synth, hier)),
            all(torch.equal(a, b) for a, b in zip(synth, hier))]


@pytest.mark.parametrize("codec", ["int8", "powersgd"])
def test_ddp_hook_with_a_compressor_on_synth(ranks, codec):
    """The DDP hook on synth with a compressor trains as on hierarchical: int8 bit for bit (the same
    transfers and seeds), PowerSGD within fp32 rounding of the P and Q sums."""
    out = ranks(4, _hook, codec, timeout=120)
    if codec == "int8":
        assert all(r[1] for r in out)
    else:
        assert all(r[0] < 1e-4 for r in out), out


def _model(inter_rate: float) -> CostModel:
    return CostModel(LinkModel(20e-6, 1 / 3e9), LinkModel(50e-6, 1 / inter_rate))


@pytest.mark.parametrize("spec", ["2x2", "4x1", "3x2"])
def test_auto_with_a_compressor_weighs_synth_only_where_links_differ(spec):
    """auto with a compressor: never synth on uniform links (or none); where they differ, synth exactly
    when its predicted time is below every other candidate's by more than the tie margin (a quantizer,
    whose rounds a star's schedules cannot speed up, stays on the group's own collectives)."""
    nodes = {"2x2": [[0, 1], [2, 3]], "4x1": [[0], [1], [2], [3]], "3x2": [[0, 1], [2, 3], [4, 5]]}[spec]
    n, world = len(nodes), sum(map(len, nodes))
    tensors = [torch.empty(256, 256), torch.empty(1000)]
    codecs = [C.BF16Compressor(), C.QuantizeCompressor(8), C.PowerSGDCompressor(2), C.TopKCompressor(0.01)]
    picked = []
    model = _model(SLOW)  # the level model's inter-node level: the slowest node link (a ring is paced by it)
    for links in (None, LinkMap.star([FAST] * n), LinkMap.mesh(n, {(i, j): FAST for i in range(n) for j in range(n)
                                                                   if i != j})):
        topo = Topology(nodes=nodes, rank=0, world_size=world, links=links)
        for c in codecs:
            assert auto.choose(c, tensors, topo, model=model) != "synth", (links, c)
    for links in (_star(n), LinkMap.mesh(n, {(i, j): SLOW if {i, j} == {0, n - 1} else FAST
                                             for i in range(n) for j in range(n) if i != j})):
        topo = Topology(nodes=nodes, rank=0, world_size=world, links=links)
        weighed = not links.uniform  # a 2-node mesh of one slow pair is uniform: synth stays out
        for c in codecs:
            choice = auto.choose(c, tensors, topo, model=model)
            numels, shapes = [t.numel() for t in tensors], [tuple(t.shape) for t in tensors]
            times = {a: auto.predict(a, c, numels, shapes, 4, topo, model) for a in ("flat", "hierarchical", "synth")}
            wins = times["synth"] * (1 + auto.SYNTH_TIE) < min(v for a, v in times.items() if a != "synth")
            assert (choice == "synth") == (weighed and wins), (times, c, links, choice)
            picked.append(choice)
    if n > 2:
        assert "synth" in picked  # a slow node among three or more: unequal shards win
        # the quantizer's rounds (an all-to-all, an equal-shard all-gather) gain nothing on a star
        assert auto.choose(C.QuantizeCompressor(8), tensors, Topology(nodes=nodes, rank=0, world_size=world,
                                                                      links=_star(n)), model=model) != "synth"
