"""Compressors used alone (``compressor.all_reduce``), against independent oracles (issue 5).

Oracles: every rank regenerates every rank's input from its seed and sums them in float64 locally;
lossless settings (top-k / random-k at ratio 1, full-rank PowerSGD) must match it, lossy ones must
stay within their error bound, and error feedback must conserve mass exactly. Many cases run inside
one pool call (docs/architecture.md section 9). docs/faults.md rows: 8, 9, 10, 11, 12, 13, 15, 16, 17.
"""

from __future__ import annotations

import math
import pickle
import warnings

import pytest
import torch
import torch.distributed as dist
from torch.distributed import ReduceOp

from commopt.comm import Topology, algorithms, context
from commopt.comm import compression as C
from commopt.comm.compression import ErrorFeedback, auto
from commopt.comm.errors import NonFiniteError


def _inputs(world: int, shape: tuple[int, ...], dtype: torch.dtype, salt: int) -> list[torch.Tensor]:
    return [(torch.randn(*shape, generator=torch.Generator().manual_seed(1000 * salt + r), dtype=torch.float64)
             * 3).to(dtype) for r in range(world)]


def _lossless():
    return [C.TopKCompressor(1.0), C.RandomKCompressor(1.0),
            C.PowerSGDCompressor(rank=12, start_iter=0, min_compression_rate=0.0)]


def _lossy():
    """(compressor, relative error bound of one reduction of Gaussian data).

    Every bound is below 1.0, the relative error of returning zeros, so a compressor that returned
    nothing fails (measured worst cases over the dtypes and 1x2 / 2x2 flat and hierarchical:
    Q4 0.22, top-k 0.46, sign 0.61, 1-bit 0.83, PowerSGD rank 2 0.91; the data is seeded). Unbiased
    random-k is the exception, checked by projection instead (its one-shot error at ratio 0.5 is
    exactly 1.0: the kept half doubled, the rest dropped).
    """
    return [(C.FP16Compressor(), 2e-3), (C.BF16Compressor(), 1e-2), (C.QuantizeCompressor(8), 3e-2),
            (C.QuantizeCompressor(4, 64), 0.3), (C.TopKCompressor(0.3), 0.6), (C.RandomKCompressor(0.5), None),
            (C.SignCompressor(), 0.75), (C.OneBitCompressor(), 0.9),
            (C.PowerSGDCompressor(rank=2, start_iter=0), 0.95)]


# ------------------------------------------------------------------------------------------ bodies
def _body_matrix(topo_spec: str, algorithm: str) -> dict:
    rank, world = dist.get_rank(), dist.get_world_size()
    topo = Topology.from_spec(topo_spec)
    report = {}
    for dtype in (torch.float64, torch.float32, torch.bfloat16, torch.float16):
        inputs = _inputs(world, (40, 12), dtype, salt=1)
        exact = torch.stack([x.double() for x in inputs]).sum(0)
        eps = torch.finfo(dtype).eps
        for c in _lossless():
            for op in (ReduceOp.SUM, ReduceOp.AVG):
                y = inputs[rank].clone()
                out = c.all_reduce(y, op, topology=topo, algorithm=algorithm, error_feedback=ErrorFeedback())
                assert out is y and y.dtype == dtype
                ref = exact / world if op == ReduceOp.AVG else exact
                err = ((y.double() - ref).abs().max() / ref.abs().max()).item()
                assert err <= 8 * max(eps, 1e-6) * world, (c, dtype, op, err)
        for c, bound in _lossy():
            y = inputs[rank].clone()
            c.all_reduce(y, topology=topo, algorithm=algorithm, error_feedback=ErrorFeedback())
            err = ((y.double() - exact).norm() / exact.norm()).item()
            if bound is None:
                # Unbiased: the projection onto the exact sum is 1 in expectation (zeros give 0), and
                # every kept coordinate is the exact sum over the keep ratio.
                proj = (torch.dot(y.double().flatten(), exact.flatten()) / exact.norm() ** 2).item()
                kept = y.double() != 0
                assert 0.6 <= proj <= 1.4 and 0.3 <= kept.double().mean().item() <= 0.7, (c, dtype, proj)
                scale = 1 / c.ratio
                assert torch.allclose(y.double()[kept], exact[kept] * scale, rtol=8 * eps * world, atol=8 * eps), c
            else:
                assert bound < 1.0 and math.isfinite(err) and err <= bound + 4 * eps, (c, dtype, err)
            report[f"{c!r}/{dtype}"] = err
    # PowerSGD at full rank over several tensors (two of one shape, and a vector reduced exactly):
    # exact with and without batching same-shaped matrices into one bmm.
    from commopt.comm.compression.exchange import reduce_tensors

    shapes = [(20, 12), (20, 12), (7,)]
    for batch in (False, True):
        ts = [_inputs(world, s, torch.float64, salt=30 + i)[rank] for i, s in enumerate(shapes)]
        ps = C.PowerSGDCompressor(rank=12, start_iter=0, min_compression_rate=0.0, batch_same_shape=batch)
        reduce_tensors(ps, ts, ["a", "b", "c"], topology=topo, algorithm=algorithm, average=False,
                       feedback=ErrorFeedback()).wait()
        for i, (t, s) in enumerate(zip(ts, shapes)):
            ref = torch.stack(_inputs(world, s, torch.float64, salt=30 + i)).sum(0)
            assert torch.allclose(t, ref, rtol=0, atol=1e-9 * ref.abs().max().item()), (batch, s)
    # docs/faults.md row 9: a transposed (non-contiguous) input gives the contiguous result, in place.
    for make in (lambda: C.PowerSGDCompressor(rank=3, start_iter=0), C.FP16Compressor,
                 lambda: C.TopKCompressor(0.2), C.OneBitCompressor):
        base = _inputs(world, (12, 40), torch.float32, salt=2)[rank]
        a, b = base.clone().t(), base.t().contiguous()
        assert not a.is_contiguous()
        out = make().all_reduce(a, topology=topo, algorithm=algorithm, step=3, error_feedback=ErrorFeedback())
        make().all_reduce(b, topology=topo, algorithm=algorithm, step=3, error_feedback=ErrorFeedback())
        assert out is a and torch.equal(a, b), make
    # docs/faults.md row 8: zero elements and k = 0 are no-ops of the right dtype, with no NaN.
    for c in _lossless() + [C.TopKCompressor(0.0), C.SignCompressor(), C.QuantizeCompressor()]:
        e = torch.empty(0, 5, dtype=torch.float16)
        assert c.all_reduce(e, topology=topo, algorithm=algorithm) is e and e.dtype == torch.float16
    z = _inputs(world, (64,), torch.float32, salt=3)[rank]
    ef = ErrorFeedback()
    zc = z.clone()
    C.TopKCompressor(0.0).all_reduce(zc, topology=topo, algorithm=algorithm, error_feedback=ef, key="z")
    assert torch.equal(zc, torch.zeros(64)), "k = 0 sends nothing"
    kept = ef.residuals["worker"]["z"].clone()
    dist.all_reduce(kept)  # hierarchical: each rank keeps the node sum of its shard
    assert torch.allclose(kept, sum(_inputs(world, (64,), torch.float32, salt=3)), atol=1e-5), \
        "k = 0: everything stays in the residuals"
    zero = torch.zeros(8, 6)
    C.PowerSGDCompressor(start_iter=0, min_compression_rate=0).all_reduce(zero, topology=topo, algorithm=algorithm)
    assert torch.equal(zero, torch.zeros(8, 6)), "an all-zero matrix must not produce NaN"
    # docs/faults.md row 10: integers pass through, SUM bit-exact; AVG on integers raises TypeError.
    for c in (C.FP16Compressor(), C.TopKCompressor(0.1), C.QuantizeCompressor()):
        i = torch.full((33,), rank + 1, dtype=torch.int64)
        c.all_reduce(i, topology=topo, algorithm=algorithm)
        assert torch.equal(i, torch.full((33,), world * (world + 1) // 2, dtype=torch.int64))
        with pytest.raises(TypeError):
            c.all_reduce(torch.ones(3, dtype=torch.int32), ReduceOp.AVG, topology=topo, algorithm=algorithm)
    return report


def _body_fp16_overflow() -> None:
    """docs/faults.md row 12: fp16 gradients of 40 000 on 4 ranks average to 40 000, never inf."""
    rank, world = dist.get_rank(), dist.get_world_size()
    for algorithm, topo in (("flat", None), ("hierarchical", Topology.from_spec("2x2"))):
        for dtype in (torch.float16, torch.float32):
            y = torch.full((1000,), 40_000.0, dtype=dtype)
            C.FP16Compressor().all_reduce(y, ReduceOp.AVG, topology=topo, algorithm=algorithm)
            assert torch.equal(y, torch.full((1000,), 40_000.0, dtype=dtype)), (algorithm, dtype, y[:3])
        # Beyond fp16's range altogether (fp32 input): scaled by an agreed power of two.
        y = torch.full((100,), 3e6 * (rank + 1))
        C.FP16Compressor().all_reduce(y, ReduceOp.SUM, topology=topo, algorithm=algorithm)
        ref = 3e6 * world * (world + 1) / 2
        assert torch.isfinite(y).all() and ((y - ref).abs() / ref).max() < 1e-3, (algorithm, y[:3])


def _gathered_equal(t: torch.Tensor) -> bool:
    """Whether ``t`` is bit-identical on every rank."""
    all_t = [torch.empty_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(all_t, t.contiguous())
    return all(torch.equal(a, t) for a in all_t)


def _body_optimistic_fallback() -> dict:
    """The optimistic fp16 path (no check phase): a mean above 65504 overflows the reduced fp16 on
    every rank alike, and the exchange redoes it exactly in fp32: the exact mean on every rank, bit-
    identical, flat and hierarchical 2x2; PowerSGD and the agreed-scale variant alongside."""
    rank, world = dist.get_rank(), dist.get_world_size()
    out = {}
    for algorithm, topo in (("flat", None), ("hierarchical", Topology.from_spec("2x2"))):
        # Pre-divided by 4 each input fits fp16, but their sum (the mean, > 65504) does not.
        base = torch.linspace(66_000.0, 90_000.0, 999, dtype=torch.float64)
        xs = [(base + 1000.0 * r).float() for r in range(world)]
        exact = torch.stack([x.double() for x in xs]).sum(0)
        for op, ref in ((ReduceOp.AVG, exact / world), (ReduceOp.SUM, exact)):
            y = xs[rank].clone()
            C.FP16Compressor().all_reduce(y, op, topology=topo, algorithm=algorithm)
            assert torch.isfinite(y).all(), (algorithm, op, "a silent inf")
            assert torch.equal(y, ref.float()), (algorithm, op, (y.double() - ref).abs().max().item())
            assert _gathered_equal(y), (algorithm, op, "ranks disagree")
        # Overflow on one rail only (hierarchical: the rails hold different halves): the other rail's
        # fp16 result stands, the overflowing half is exact; every rank holds the same vector.
        y = torch.cat([torch.full((500,), 1.0), xs[rank][:500]]) + 0.25 * rank
        ref = torch.cat([torch.full((500,), 1.0) * world, exact[:500]]) + 0.25 * sum(range(world))
        C.FP16Compressor().all_reduce(y, ReduceOp.SUM, topology=topo, algorithm=algorithm)
        assert torch.equal(y[500:], ref[500:].float()), algorithm
        assert torch.allclose(y.double(), ref, rtol=1e-3), algorithm
        assert _gathered_equal(y), algorithm
        # fp16 inputs above fp16's range after summing: exact in fp32, rounded once to fp16.
        h = torch.full((64,), 60_000.0, dtype=torch.float16)
        C.FP16Compressor().all_reduce(h, ReduceOp.AVG, topology=topo, algorithm=algorithm)
        assert torch.equal(h, torch.full((64,), 60_000.0, dtype=torch.float16)), algorithm
        # PowerSGD's P overflowing fp32 (a 1e38 gradient): exact fallback, residual untouched.
        ef = ErrorFeedback()
        m = _inputs(world, (24, 16), torch.float32, salt=40)[rank]
        C.PowerSGDCompressor(rank=2, start_iter=0).all_reduce(m.clone(), topology=topo, algorithm=algorithm,
                                                             error_feedback=ef, key="m", step=0)
        before = ef.residuals["worker"]["m"].clone()
        big = m.clone()
        big[0, :] = 3e38
        C.PowerSGDCompressor(rank=2, start_iter=0).all_reduce(big, topology=topo, algorithm=algorithm,
                                                             error_feedback=ef, key="m", step=1)
        assert torch.equal(ef.residuals["worker"]["m"], before), (algorithm, "residual changed by a fallback")
        assert _gathered_equal(big), algorithm
        # The agreed scale keeps tiny gradients' precision where pre-division alone flushes them.
        tiny = _inputs(world, (4096,), torch.float64, salt=41)
        ref = torch.stack(tiny).mean(0) * 1e-6
        errs = {}
        for label, c in (("default", C.FP16Compressor()), ("agreed", C.FP16Compressor(agreed_scale=True))):
            y = (tiny[rank] * 1e-6).float()
            c.all_reduce(y, ReduceOp.AVG, topology=topo, algorithm=algorithm)
            errs[label] = ((y.double() - ref).norm() / ref.norm()).item()
            assert _gathered_equal(y), (algorithm, label)
        assert errs["agreed"] <= 1e-3 < errs["default"], (algorithm, errs)
        out[algorithm] = errs
    return out


def _body_optimistic_check_finite() -> dict:
    """check_finite=True without a check phase: NaN (or Inf) on the last rank only raises
    NonFiniteError on every rank, also in hierarchical mode where only that rank's rail sees it before
    the all-gather; residuals untouched everywhere; the next finite step works."""
    import time

    rank, world = dist.get_rank(), dist.get_world_size()
    topo = Topology.from_spec("2x2")
    took = {}
    for algorithm in ("flat", "hierarchical"):
        for make in (C.FP16Compressor, C.BF16Compressor, lambda: C.PowerSGDCompressor(rank=2, start_iter=0)):
            c = make()
            ef = ErrorFeedback()
            shapes = [(32, 16), (16,), (48, 16)]
            xs = [_inputs(world, s, torch.float32, salt=50 + i)[rank] for i, s in enumerate(shapes)]
            c.all_reduce(xs[0].clone(), topology=topo, algorithm=algorithm, error_feedback=ef, key="a", step=0)
            c.all_reduce(xs[2].clone(), topology=topo, algorithm=algorithm, error_feedback=ef, key="c", step=0)
            before = {k: {n: t.clone() for n, t in d.items()} for k, d in ef.residuals.items()}
            for bad in (float("nan"), float("inf")):
                for i, x in enumerate(xs):
                    y = x.clone()
                    if rank == world - 1:
                        y.view(-1)[7] = bad
                    t0 = time.monotonic()
                    with pytest.raises(NonFiniteError):
                        c.all_reduce(y, topology=topo, algorithm=algorithm, error_feedback=ef,
                                     key="abc"[i], step=1, check_finite=True, timeout=20)
                    took[f"{algorithm}/{c.name}/{i}"] = time.monotonic() - t0
                    for k, d in ef.residuals.items():
                        for n, t in d.items():
                            if n in before[k]:
                                assert torch.equal(t, before[k][n]), (algorithm, c, k, n)
            # Several in flight at once, one of them poisoned: every rank raises for that one only.
            ys = [x.clone() for x in xs]
            if rank == 0:
                ys[1][3] = float("nan")
            futs = [c.all_reduce(y, topology=topo, algorithm=algorithm, error_feedback=ef, key="abc"[i], step=2,
                                 check_finite=True, async_op=True, timeout=20) for i, y in enumerate(ys)]
            raised = []
            for f in futs:
                try:
                    f.wait()
                    raised.append(False)
                except Exception as exc:  # noqa: BLE001 - a chained future wraps NonFiniteError
                    assert "NonFiniteError" in str(exc) or isinstance(exc, NonFiniteError), exc
                    raised.append(True)
            assert raised == [False, True, False], (algorithm, c, raised)
            z = xs[0].clone()
            c.all_reduce(z, topology=topo, algorithm=algorithm, error_feedback=ef, key="a", step=3,
                         check_finite=True)
            assert torch.isfinite(z).all() and _gathered_equal(z), (algorithm, c)
    return took


def _body_conservation(algorithm: str, topo_spec: str, steps: int) -> dict:
    """docs/faults.md row 15: sum of results + final residuals (worker and server) = sum of inputs, fp64."""
    rank, world = dist.get_rank(), dist.get_world_size()
    topo = Topology.from_spec(topo_spec)
    worst = {}
    for c in (C.TopKCompressor(0.05), C.SignCompressor(block=64), C.OneBitCompressor(block=64),
              C.PowerSGDCompressor(rank=1, start_iter=0, min_compression_rate=1.0)):
        ef = ErrorFeedback()
        total_in = torch.zeros(30, 20, dtype=torch.float64)
        total_out = torch.zeros(30, 20, dtype=torch.float64)
        for step in range(steps):
            xs = _inputs(world, (30, 20), torch.float64, salt=10_000 + step)
            total_in += torch.stack(xs).sum(0)
            y = xs[rank].clone()
            c.all_reduce(y, topology=topo, algorithm=algorithm, error_feedback=ef, key="w", step=step)
            total_out += y
        left = sum(ef.residuals[k]["w"] for k in ("worker", "server") if "w" in ef.residuals[k]).view(30, 20)
        dist.all_reduce(left)  # exact fp64 sum over ranks
        err = ((total_out + left - total_in).abs().max() / total_in.abs().max()).item()
        assert err <= 1e-12, (c, err)
        assert ef.numel("worker") == 600, "one residual per key, O(tensor)"
        worst[c.name] = err
    return worst


def _body_nonfinite(algorithm: str, topo_spec: str) -> None:
    """docs/faults.md row 13: NaN/Inf on one rank only propagates (exact fallback) and leaves residuals as
    they were; check_finite=True raises NonFiniteError on every rank."""
    rank, world = dist.get_rank(), dist.get_world_size()
    topo = Topology.from_spec(topo_spec)
    comps = [C.FP16Compressor(), C.BF16Compressor(), C.TopKCompressor(0.1), C.RandomKCompressor(0.1),
             C.SignCompressor(), C.OneBitCompressor(), C.QuantizeCompressor(8),
             C.PowerSGDCompressor(rank=1, start_iter=0)]
    for c in comps:
        ef = ErrorFeedback()
        x = _inputs(world, (16, 32), torch.float32, salt=5)[rank]
        c.all_reduce(x.clone(), topology=topo, algorithm=algorithm, error_feedback=ef, key="w", step=0)
        before = {k: {n: t.clone() for n, t in d.items()} for k, d in ef.residuals.items()}
        for bad in (float("nan"), float("inf")):
            y = x.clone()
            if rank == world - 1:
                y[3, 5] = bad
            c.all_reduce(y, topology=topo, algorithm=algorithm, error_feedback=ef, key="w", step=1)
            assert not torch.isfinite(y[3, 5]), (c, bad, "the non-finite value must reach every rank")
            assert torch.isfinite(y.view(-1)[:10]).all() or math.isnan(bad), c
            for k, d in ef.residuals.items():
                for n, t in d.items():
                    assert torch.equal(t, before[k][n]), (c, "residual poisoned or changed by a skipped step")
            z = x.clone()
            if rank == 0:
                z[0, 0] = bad
            with pytest.raises(NonFiniteError):
                c.all_reduce(z, topology=topo, algorithm=algorithm, error_feedback=ef, key="w", step=1,
                             check_finite=True)
        # The next finite step compresses again and updates the residual.
        c.all_reduce(x.clone(), topology=topo, algorithm=algorithm, error_feedback=ef, key="w", step=2)
        assert all(torch.isfinite(t).all() for d in ef.residuals.values() for t in d.values()), c


def _body_randomness() -> dict:
    """docs/faults.md row 17: random-k indices and PowerSGD's Q agree across ranks and change across
    steps; the global RNG is untouched."""
    rank = dist.get_rank()
    rng = torch.get_rng_state()
    rk = C.RandomKCompressor(0.1)
    idx = [rk.indices(1000, step=s, seed=7, salt=3) for s in range(3)]
    assert not torch.equal(idx[0], idx[1]) and not torch.equal(idx[1], idx[2])
    gathered = [torch.zeros_like(idx[0]) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, idx[0])
    assert all(torch.equal(g, idx[0]) for g in gathered)
    # Random-k through the exchange: the result is non-zero exactly at shared indices on every rank.
    y = _inputs(2, (512,), torch.float32, salt=8)[rank].abs() + 1
    rk.all_reduce(y, seed=7, step=4)
    support = (y != 0).nonzero().view(-1)
    sup = [torch.zeros_like(support) for _ in range(dist.get_world_size())]
    dist.all_gather(sup, support)
    assert support.numel() == 52 and all(torch.equal(s, support) for s in sup)
    qs = []
    for warm in (True, False):
        ps = C.PowerSGDCompressor(rank=2, start_iter=0, warm_start=warm)
        steps = []
        for step in range(2):
            m = _inputs(2, (24, 16), torch.float32, salt=20 + step)[rank]
            ps.all_reduce(m, step=step, error_feedback=ErrorFeedback(), key="m")
            if warm:
                steps.append(ps.default_state.q_memory["m"].clone())
            else:
                ex = C.Exchange(x=m.view(-1), out=m.view(-1), sent=None, groups=(None,), n=2, rank=rank, step=step)
                steps.append(ps._initial_q("m", 16, 2, ex))
        assert not torch.equal(steps[0], steps[1]), warm
        for q in steps:
            all_q = [torch.zeros_like(q) for _ in range(dist.get_world_size())]
            dist.all_gather(all_q, q)
            assert all(torch.equal(a, q) for a in all_q), "Q differs across ranks"
        qs.append(steps)
    # Stochastic rounding and the rest: nothing drew from the global RNG.
    C.QuantizeCompressor().all_reduce(torch.randn(300, generator=torch.Generator().manual_seed(rank)), step=1)
    assert torch.equal(torch.get_rng_state(), rng), "a compressor used the global RNG"
    return {"ok": True}


def _body_auto() -> dict:
    """algorithm="auto" with a compressor on a logical 2x2 follows the cost model (the one in
    commopt's cache for this layout, which cost.model_for returns): a model whose levels share one
    resource runs flat; one with a slow inter-node link runs hierarchical (only the rail phase
    compressed). Each time, auto's result and bytes are bit-identical to the algorithm it chose."""
    from commopt.comm import cost
    from commopt.comm.compression import auto

    rank = dist.get_rank()
    topo = Topology.from_spec("2x2")
    key = (topo.layout, id(topo.group))
    saved = context().cost_models.get(key)
    fast = cost.LinkModel(alpha=1e-6, beta=1 / 100e9)
    slow = cost.LinkModel(alpha=50e-6, beta=1 / 12.5e6)  # a 100 Mbit/s node link
    models = {"shared": cost.CostModel(fast, fast, shared=True), "slow inter": cost.CostModel(fast, slow)}
    makes = {"fp16": C.FP16Compressor, "int8": lambda: C.QuantizeCompressor(8, 64),
             "topk": lambda: C.TopKCompressor(0.1), "onebit": lambda: C.OneBitCompressor(64),
             "powersgd": lambda: C.PowerSGDCompressor(rank=2, start_iter=0)}
    chosen = {}
    try:
        for label, model in models.items():
            context().cost_models.put(key, model)
            expect = "flat" if label == "shared" else "hierarchical"
            for name, make in makes.items():
                x = _inputs(4, (64, 48), torch.float32, salt=60)[rank]
                chosen[f"{label}/{name}"] = auto.choose(make(), [x], topo)
                assert chosen[f"{label}/{name}"] == expect, (label, name)
                if label != "shared":
                    numels, shapes = [x.numel()], [tuple(x.shape)]
                    times = {a: auto.predict(a, make(), numels, shapes, 4, topo, model)
                             for a in ("flat", "hierarchical")}
                    assert times["hierarchical"] < times["flat"], (label, name, times)
                runs = {}
                for algorithm in ("auto", expect):
                    y = x.clone()
                    context().engine().reset_stats()
                    make().all_reduce(y, topology=topo, algorithm=algorithm, error_feedback=ErrorFeedback(), key="x",
                                      step=0)
                    runs[algorithm] = (y, context().engine().bytes_sent())
                (got, sent), (ref, ref_sent) = runs["auto"], runs[expect]
                assert torch.equal(got, ref) and sent == ref_sent, (label, name, sent, ref_sent)
                intra = f"compress/{make().name}/intra"
                assert (intra in sent) == (expect == "hierarchical"), (label, name, sent)
    finally:
        if saved is None:
            context().cost_models.pop(key)
        else:
            context().cost_models.put(key, saved)
    return chosen


# ------------------------------------------------------------------------------------------ tests
def test_compressors_match_oracle_flat(ranks):
    """docs/faults.md rows 8, 9, 10, 11: every compressor and dtype on 2 ranks: lossless settings equal the
    float64 oracle, lossy ones stay within their bound; non-contiguous, empty, k=0, integer inputs."""
    ranks(2, _body_matrix, "1x2", "flat", timeout=120)


def test_compressors_match_oracle_hierarchical(ranks):
    """docs/faults.md rows 8-11 on 4 ranks as 2x2 with only the inter-node phase compressed (and 4x1/1x4
    through auto, which must fall back to flat)."""
    ranks(4, _body_matrix, "2x2", "hierarchical", timeout=180)


def test_fp16_overflow_four_ranks(ranks):
    """docs/faults.md row 12: 40 000 on 4 ranks through the fp16 compressor, flat and hierarchical."""
    ranks(4, _body_fp16_overflow)


def test_optimistic_fp16_overflow_falls_back_exactly(ranks):
    """fp16 without a check phase: a mean above 65504 is the exact fp32 result on every rank (flat and
    2x2), bit-identical across ranks, also when only one rail overflows; PowerSGD's fp32 overflow
    falls back exactly with its residual untouched; the agreed scale keeps tiny gradients' precision."""
    ranks(4, _body_optimistic_fallback, timeout=120)


def test_optimistic_check_finite_raises_everywhere(ranks):
    """NaN/Inf on one rank only with check_finite=True: NonFiniteError on every rank, flat and
    hierarchical (decided after the all-gather, so no rail is left in it), within the guard."""
    took = ranks(4, _body_optimistic_check_finite, timeout=120)
    assert max(max(t.values()) for t in took) < 20, took


@pytest.mark.parametrize("algorithm,world,spec,steps", [("flat", 2, "1x2", 200), ("hierarchical", 4, "2x2", 40)])
def test_error_feedback_conservation(ranks, algorithm, world, spec, steps):
    """docs/faults.md row 15: over 200 fp64 steps (40 on the slower 2x2 pool), sum of results + final
    residuals (worker and server) = sum of inputs to 1e-12."""
    ranks(world, _body_conservation, algorithm, spec, steps, timeout=180)


@pytest.mark.parametrize("algorithm,world,spec", [("flat", 2, "1x2"), ("hierarchical", 4, "2x2")])
def test_nonfinite_one_rank(ranks, algorithm, world, spec):
    """docs/faults.md row 13: NaN/Inf on one rank with each compressor: propagates, residuals unpoisoned,
    check_finite raises NonFiniteError on every rank."""
    ranks(world, _body_nonfinite, algorithm, spec, timeout=120)


def test_randomness_shared_and_global_rng_untouched(ranks):
    """docs/faults.md row 17: random-k indices and PowerSGD's Q identical across ranks, different across steps."""
    ranks(2, _body_randomness)


def test_auto_follows_the_cost_model(ranks):
    """algorithm="auto" with a compressor chooses by predicted time on a logical 2x2: flat under a
    model whose levels share one resource, hierarchical under a slow inter-node link; the same
    choice on every rank, and the result of the chosen algorithm."""
    res = ranks(4, _body_auto, timeout=120)
    assert all(r == res[0] for r in res), res


class _DoubledSum(C.Compressor):
    """A codec of one's own, as docs/architecture.md section 8 says to write one: two rounds (a
    MAX all-reduce of |x|, then the all-reduce of x sent doubled), its result a wire tensor with a
    decoding scale; exact, so the oracle is the plain sum."""

    name = "doubled"
    rounds = ("amax", "all_reduce")
    align = 1

    def exchange(self, ex):
        amax = ex.x.abs().max().reshape(1)
        dist.all_reduce(amax, op=ReduceOp.MAX, group=ex.groups[0])
        yield 8
        wire = ex.x * 2
        if ex.sent is not None:
            ex.sent.copy_(ex.x)
        dist.all_reduce(wire, group=ex.groups[1])
        yield wire.numel() * 4
        return C.Result(wire, 0.5)

    def payload_bytes(self, numel: int, n: int) -> int:
        return int(2 * (n - 1) / n * numel * 4)


class _NotAGenerator(_DoubledSum):
    name = "not-a-generator"

    def exchange(self, ex):
        return C.Result(ex.out)


def _body_codec_of_ones_own() -> dict:
    """A codec written outside the package runs through all_reduce flat and hierarchical (the sum),
    and one whose exchange is not a generator is a TypeError on every rank, the tensor unchanged."""
    rank, world = dist.get_rank(), dist.get_world_size()
    topo = Topology.from_spec("2x2")
    for algorithm in ("flat", "hierarchical"):
        t = torch.arange(10, dtype=torch.float32) * (rank + 1)
        _DoubledSum().all_reduce(t, topology=topo, algorithm=algorithm, timeout=60)
        assert torch.equal(t, torch.arange(10, dtype=torch.float32) * world * (world + 1) / 2), (algorithm, t)
    t = torch.ones(10)
    with pytest.raises(TypeError, match="must be a generator"):
        _NotAGenerator().all_reduce(t, timeout=60)
    assert torch.equal(t, torch.ones(10))
    return {"ok": True}


def test_a_codec_of_ones_own_runs_through_the_pipeline(ranks):
    """docs/architecture.md section 8: a compressor defined in a test module (two named rounds, a
    result with a decoding scale) reduces exactly, flat and hierarchical on a logical 2x2; an
    exchange that is not a generator is a clear TypeError on every rank."""
    assert ranks(4, _body_codec_of_ones_own, timeout=120) == [{"ok": True}] * 4


def test_unbiased_monte_carlo():
    """docs/faults.md row 16: random-k (scaled d/k) and stochastic int8/int4 quantization are unbiased: the
    mean of 10^4 seeds is within 5 standard errors of the input, element by element."""
    x = torch.randn(64, generator=torch.Generator().manual_seed(0), dtype=torch.float64).float() * 2
    n = 10_000
    rk = C.RandomKCompressor(0.25)
    acc = torch.zeros(64, dtype=torch.float64)
    for s in range(n):
        acc += rk.roundtrip(x, step=s, seed=1).double()
    se = x.double().abs() * math.sqrt(64 / 16 - 1) / math.sqrt(n)
    assert ((acc / n - x.double()).abs() <= 5 * se + 1e-9).all()
    for bits, block in ((8, 16), (4, 16)):
        q = C.QuantizeCompressor(bits, block)
        acc.zero_()
        for s in range(n):
            acc += q.roundtrip(x, step=s, seed=2).double()
        qmax = 127 if bits == 8 else 7
        scale = x.double().view(-1, block).abs().amax(1, keepdim=True).expand(-1, block).reshape(-1) / qmax
        se = scale / 2 / math.sqrt(n)  # a rounding error in [0, scale) has std <= scale / 2
        assert ((acc / n - x.double()).abs() <= 5 * se + 1e-7).all(), bits
        # and it is not the deterministic rounding in disguise:
        assert not torch.equal(q.roundtrip(x, step=0, seed=2), q.roundtrip(x, step=1, seed=2))


def test_biased_without_error_feedback_warns():
    """Biased compressors without error feedback warn (they may not converge); unbiased ones do not."""
    from commopt.comm.hooks import AllReduceState

    for c in (C.TopKCompressor(), C.SignCompressor(), C.OneBitCompressor(), C.PowerSGDCompressor()):
        with pytest.warns(UserWarning, match="without error feedback"):
            AllReduceState(compressor=c, error_feedback=False)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for c in (C.RandomKCompressor(), C.QuantizeCompressor(), C.FP16Compressor()):
            AllReduceState(compressor=c, error_feedback=False)
        AllReduceState(compressor=C.TopKCompressor(), error_feedback=True)


def test_declarations_and_bytes():
    """The declared properties, and the byte ratios against an fp32 ring all-reduce (4 ranks)."""
    assert C.PowerSGDCompressor().needs_matrices and C.PowerSGDCompressor().summable
    assert not C.TopKCompressor().summable and C.TopKCompressor().biased
    assert C.RandomKCompressor().summable and not C.RandomKCompressor().biased
    assert not C.QuantizeCompressor().summable and not C.QuantizeCompressor().biased
    # Every trait a caller branches on is declared on the base, with its default.
    for trait, default in (("summable", True), ("biased", False), ("needs_matrices", False),
                           ("rounds", ("all_reduce",)), ("uses_server_residual", False), ("chunked", False),
                           ("optimistic", False), ("layout_free", False), ("min_numel", 0)):
        assert getattr(C.Compressor, trait) == default, trait
    assert C.OneBitCompressor().uses_server_residual and not C.SignCompressor().uses_server_residual
    assert C.FP16Compressor().optimistic and not C.FP16Compressor(agreed_scale=True).optimistic
    assert C.PowerSGDCompressor().rounds == ("all_reduce_p", "all_reduce_q")
    assert C.QuantizeCompressor().rounds == C.OneBitCompressor().rounds == ("all_to_all", "all_gather")
    # A state of other settings is refused (its memory would not fit them).
    with pytest.raises(ValueError, match="new_state"):
        C.PowerSGDCompressor(rank=2).check_state(C.PowerSGDCompressor(rank=4).new_state(), "test")
    d, n = 1 << 20, 4
    fp32 = 2 * (n - 1) / n * d * 4
    assert fp32 / C.FP16Compressor().payload_bytes(d, n) == pytest.approx(2)
    assert fp32 / C.QuantizeCompressor(8).payload_bytes(d, n) >= 3.5
    assert fp32 / C.OneBitCompressor().payload_bytes(d, n) >= 20
    shapes = [(512, 128), (128, 512), (128, 128), (128,)]
    full = 2 * (n - 1) / n * sum(math.prod(s) for s in shapes) * 4
    assert full / C.PowerSGDCompressor(rank=4).shapes_bytes(shapes, n) >= 20


def _body_engine_bytes() -> dict:
    """Bytes counted by the engine for one 2x2 hierarchical reduction: only the rail phase shrinks."""
    topo = Topology.from_spec("2x2")
    out = {}
    for label, c in (("fp16", C.FP16Compressor()), ("fp16-agreed", C.FP16Compressor(agreed_scale=True)),
                     ("quantize", C.QuantizeCompressor(8)), ("onebit", C.OneBitCompressor())):
        context().engine().reset_stats()
        c.all_reduce(torch.randn(1 << 16, generator=torch.Generator().manual_seed(dist.get_rank())),
                     topology=topo, algorithm="hierarchical", error_feedback=ErrorFeedback())
        sent = context().engine().bytes_sent()
        # What the algorithm says it moves with this codec (the cost model's and auto's figure).
        pairs = algorithms.get("hierarchical").compressed_traffic(auto.Encoding(c, [1 << 16], [(1 << 16,)], 4),
                                                                  topo).pairs
        node = set(topo.nodes[topo.node])
        model = (sum(v for (s, d), v in pairs.items() if s == topo.rank and d not in node),
                 sum(v for (s, d), v in pairs.items() if s == topo.rank and d in node))
        out[label] = (sent[f"compress/{c.name}"], sent[f"compress/{c.name}/intra"], model)
    return out


def test_engine_counts_compressed_bytes(ranks):
    """Bytes on the wire come from the engine's counters: intra-node phases exact (fp32, counted
    under "compress/<name>/intra"), the inter-node phase compressed, the agreed check a few bytes
    (none for the optimistic fp16 default, whose finite result needs no agreement: it carries its
    input's 64-element tag in the fp16 payload and agrees on the input within the node instead).
    The hierarchical algorithm's ``compressed_traffic`` (what ``auto`` weighs) is held to the same
    counts."""
    res = ranks(4, _body_engine_bytes)[0]
    d, local = 1 << 16, 2
    intra = 2 * (local - 1) * (d // local) * 4  # reduce-scatter + all-gather, exact fp32
    # The check: MAX of 6 float64 (non-finite flag, max |x|, and the input's signature [s, -s, h, -h]).
    check = int(2 * 3 / 4 * 6 * 8)
    fp16 = 2 * 1 / 2 * (d // 2 + 64) * 2
    node_agreement = int(2 * 1 / 2 * 4 * 8)  # optimistic: [s, -s, h, -h] over the node
    expected = {"fp16": fp16, "fp16-agreed": check + 2 * 1 / 2 * (d // 2) * 2,
                "quantize": check + 2 * 1 * (d // 4 + d // 4 // 256 * 4),
                "onebit": check + 2 * 1 * (d // 4 // 8 + d // 4 // 256 * 4)}
    assert set(res) == set(expected)
    for name, (inter_bytes, intra_bytes, (model_inter, model_intra)) in res.items():
        assert intra_bytes == intra + (node_agreement if name == "fp16" else 0), (name, intra_bytes, intra)
        assert inter_bytes == expected[name], (name, inter_bytes, expected[name])
        # The algorithm's compressed traffic is the engine's count less the agreement: the check
        # phase, or the fp16 default's 64-element tag and node agreement.
        assert model_intra == intra, (name, model_intra)
        assert model_inter == inter_bytes - (2 * 1 / 2 * 64 * 2 if name == "fp16" else check), (name, model_inter)


def _body_in_flight() -> None:
    """Several reductions in flight at once (as DDP's buckets are): each round keeps to its own
    group, so multi-round compressors neither hang nor cross data; results equal one-at-a-time."""
    rank = dist.get_rank()
    for make in (lambda: C.QuantizeCompressor(8, 64), lambda: C.OneBitCompressor(32),
                 lambda: C.PowerSGDCompressor(rank=2, start_iter=0)):
        shapes = [(16, 4), (100, 4), (32, 4), (8, 4), (200, 4)]
        xs = [torch.randn(*s, generator=torch.Generator().manual_seed(rank * 10 + i)) for i, s in enumerate(shapes)]
        a, b = make(), make()
        ea, eb = ErrorFeedback(), ErrorFeedback()
        for step in range(3):
            ya = [x.clone() for x in xs]
            futs = [a.all_reduce(y, async_op=True, key=f"k{i}", step=step, error_feedback=ea) for i, y in enumerate(ya)]
            for f in futs:
                f.wait()
            yb = [x.clone() for x in xs]
            for i, y in enumerate(yb):
                b.all_reduce(y, key=f"k{i}", step=step, error_feedback=eb)
            assert all(torch.equal(p, q) for p, q in zip(ya, yb)), make


def test_reductions_in_flight(ranks):
    """docs/architecture.md section 3 rule 1: multi-round compressors with many reductions in flight
    (docs/faults.md row 15's residuals included) give the one-at-a-time results."""
    ranks(2, _body_in_flight, timeout=60)


def test_compressor_pickled_before_the_state_split_continues_on_its_default_state():
    """A compressor pickled when it still held its call counter (and PowerSGD its warm starts)
    itself unpickles with both in its default state, the format's only migration."""

    c = C.PowerSGDCompressor(rank=2)
    old = {k: v for k, v in c.__dict__.items() if k != "_default_state"}
    old.update(_calls=7, q_memory={"w": torch.ones(2, 3)})
    fresh = C.PowerSGDCompressor.__new__(C.PowerSGDCompressor)
    fresh.__setstate__(dict(old))
    assert fresh.default_state.calls == 7 and torch.equal(fresh.default_state.q_memory["w"], torch.ones(2, 3))
    again = pickle.loads(pickle.dumps(fresh))
    assert again.default_state.calls == 7 and again.config() == c.config()
    plain = C.FP16Compressor.__new__(C.FP16Compressor)
    plain.__setstate__({k: v for k, v in C.FP16Compressor().__dict__.items() if k != "_default_state"} | {"_calls": 3})
    assert plain.default_state.calls == 3


def test_block_codec_restarts_blocks_at_every_segment():
    """The one int8/int4 block codec (QuantizeCompressor.encode / decode): blocks restart at every
    segment, so a segment of large values beside one of small values does not set its scale; the
    payload is every segment's fp32 scales, then every segment's codes, padded to 4 bytes; it decodes
    at any byte offset of a larger buffer, and adds into a vector as well as overwriting one."""
    for bits, qmax in ((8, 127), (4, 7)):
        q = C.QuantizeCompressor(bits, 16)
        small = torch.randn(21, generator=torch.Generator().manual_seed(1)) * 0.02
        big = torch.full((10,), 1.0)
        x = torch.cat([big, small])
        segs = [10, 21]
        payload = q.encode(x, segs)
        code_bytes = 31 if bits == 8 else 5 + 11
        assert payload.dtype == torch.uint8 and payload.numel() == q.nbytes(segs) == -(-(4 * 3 + code_bytes) // 4) * 4
        scales = payload[:12].view(torch.float32)
        # Segment 1's blocks (elements 0-15 and 16-20 of the small segment) own their scales.
        assert scales[0] == 1.0 / qmax
        assert torch.allclose(scales[1:], torch.stack([small[:16].abs().max(), small[16:].abs().max()]) / qmax)
        got = q.decode(payload, segs)
        assert ((got - x).abs() <= scales.repeat_interleave(torch.tensor([10, 16, 5])) / 2 + 1e-12).all(), bits
        # One block over both segments instead: the small values lose their precision.
        whole = q.decode(q.encode(x, [31]), [31])
        assert (whole[10:] - small).abs().max() > (got[10:] - small).abs().max()
        shifted = torch.cat([torch.zeros(3, dtype=torch.uint8), payload])[3:]
        assert torch.equal(q.decode(shifted, segs), got)
        acc = torch.ones(31, dtype=torch.float64)
        assert torch.equal(q.decode(payload, segs, acc, add=True), got.double() + 1)
        # Stochastic rounding is reproducible from (seed, step) and differs between steps.
        a = q.encode(x, segs, seed=5, step=1, stochastic=True)
        assert torch.equal(a, q.encode(x, segs, seed=5, step=1, stochastic=True))
        assert not torch.equal(a, q.encode(x, segs, seed=5, step=2, stochastic=True))


def test_error_feedback_pickled_before_the_merge_loads():
    """An ErrorFeedback pickled when it held per-key residuals only (before the FSDP2 comms' memory
    moved into it) unpickles with its residuals and empty per-module residuals, and keeps working."""
    ef = ErrorFeedback()
    ef.get("worker", ["w"], [4], torch.float32, torch.device("cpu"))[0].fill_(2.0)
    for name in ("layouts", "buffers", "steps"):
        delattr(ef, name)
    back = pickle.loads(pickle.dumps(ef))
    assert torch.equal(back.residuals["worker"]["w"], torch.full((4,), 2.0))
    assert back.layouts == {} and back.buffers == {} and back.steps == {}
    assert back.numel() == 4 and back.state_dict()["worker"]["w"].sum() == 8
