"""The MoE layer (bench/models.py) and the all-to-all / expert overlap (schedules/moe.py).

The oracle is a single-process computation written independently here: every rank gathers all
ranks' tokens and all experts' parameters with plain ``torch.distributed``, routes token by token
with explicit loops (capacity counted first choices first, tokens in order) and applies each expert
to each row. Output and gradients (tokens, gate, experts) of the distributed layer must equal it
(float64); the overlapped variant must equal the unchunked one. docs/faults.md rows covered: 8 (experts and
ranks that receive no tokens: capacity drops and uneven routing give zero-sized splits), 23
(interleaved placement for the 2-D exchange).
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist

from commopt.bench.models import MoE
from commopt.comm import Topology
from commopt.schedules.moe import chunk_layout, exchange_compute

D, H, E, T = 6, 10, 8, 13


def _gather(t: torch.Tensor) -> list[torch.Tensor]:
    out = [torch.empty_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(out, t.contiguous())
    return out


def _reference(xs, gate_w, w1, b1, w2, b2, top_k, capacity_factor):
    """Single-process MoE over every rank's tokens; loops, no vectorised routing."""
    outs = []
    for x in xs:
        probs = torch.softmax(x @ gate_w.t(), dim=-1)
        top_p, top_e = probs.topk(top_k, dim=-1)
        gates = top_p / top_p.sum(-1, keepdim=True) if top_k == 2 else top_p
        capacity = math.ceil(capacity_factor * top_k * x.shape[0] / E)
        used = [0] * E
        rows = [torch.zeros(D, dtype=x.dtype) for _ in range(x.shape[0])]
        for level in range(top_k):
            for t in range(x.shape[0]):
                e = int(top_e[t, level])
                if used[e] >= capacity:
                    continue
                used[e] += 1
                h = torch.nn.functional.gelu(x[t:t + 1] @ w1[e] + b1[e])
                rows[t] = rows[t] + gates[t, level] * (h @ w2[e] + b2[e])[0]
        outs.append(torch.stack(rows))
    return outs


def _same_up_to_rounding(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal, or apart by float64 rounding only: at most 64 ulps of the tensor's scale.

    Not bitwise: a chunk's experts see fewer rows, and torch's CPU GEMM picks kernels by batch size
    (rows of ``gelu(x @ w1 + b1) @ w2`` differ by ~4e-16 between batch sizes in one process), and
    weight gradients are sums over chunks, i.e. reassociated.
    """
    if torch.equal(a, b):
        return True
    scale = float(b.abs().max()) if b.numel() else 0.0
    return float((a - b).abs().max()) <= 64 * torch.finfo(torch.float64).eps * scale


def _run_layer(layer: MoE, x: torch.Tensor, w: torch.Tensor):
    x = x.clone().requires_grad_()
    layer.zero_grad()
    y = layer(x)
    (y * w).sum().backward()
    return y.detach(), x.grad, {n: p.grad.clone() for n, p in layer.named_parameters()}


def _moe_matrix(spec) -> int:
    rank, world = dist.get_rank(), dist.get_world_size()
    topo = Topology.from_spec(spec) if isinstance(spec, str) else Topology.from_nodes(spec)
    checked = 0
    failures: list[str] = []
    diffs: dict[str, float] = {}
    for top_k, cf in ((1, 1.0), (2, 1.25), (2, 0.5)):
        g = torch.Generator().manual_seed(100 + rank)
        # Tokens of different count per rank; a skewed mix so some experts overflow and some get none.
        x = torch.randn(T + rank, D, dtype=torch.float64, generator=g)
        x[: 4] += 2.0
        w = torch.randn(T + rank, D, dtype=torch.float64, generator=g)
        results = {}
        for algo in ("flat", "2d"):
            for degree in (1, 2, 3):
                layer = MoE(D, H, E, top_k=top_k, capacity_factor=cf, overlap_degree=degree, topology=topo,
                            algorithm=algo, seed=7, dtype=torch.float64)
                results[(algo, degree)] = _run_layer(layer, x, w)
        # The oracle, from gathered tokens and parameters.
        layer = MoE(D, H, E, top_k=top_k, capacity_factor=cf, seed=7, dtype=torch.float64, topology=topo,
                    algorithm="flat")
        longest = T + world - 1  # ranks hold T + rank tokens: gather padded, then trim
        xs = [p[: T + r] for r, p in enumerate(_gather(torch.cat([x, x.new_zeros(longest - x.shape[0], D)])))]
        ws = [p[: T + r] for r, p in enumerate(_gather(torch.cat([w, w.new_zeros(longest - w.shape[0], D)])))]
        leaves = {"gate.weight": layer.gate.weight.detach().clone()}
        for name in ("w1", "b1", "w2", "b2"):
            leaves[name] = torch.cat(_gather(getattr(layer, name).detach()))
        for t in leaves.values():
            t.requires_grad_()
        xs = [t.clone().requires_grad_() for t in xs]
        ref = _reference(xs, leaves["gate.weight"], leaves["w1"], leaves["b1"], leaves["w2"], leaves["b2"],
                         top_k, cf)
        sum((r * wr).sum() for r, wr in zip(ref, ws)).backward()
        mine = slice(rank * (E // world), (rank + 1) * (E // world))
        want_params = {"gate.weight": leaves["gate.weight"].grad}
        want_params.update({n: leaves[n].grad[mine] for n in ("w1", "b1", "w2", "b2")})
        if not (cf > 1 or any(bool((r.detach().abs().sum(1) == 0).any()) for r in ref)):
            failures.append(f"top{top_k} cf={cf}: no token was dropped; the capacity path is untested")
        for (algo, degree), (y, gx, gp) in results.items():
            what = f"top{top_k} cf={cf} {algo} degree={degree}"
            tol = {"rtol": 1e-10, "atol": 1e-12}
            gate_grad = gp["gate.weight"].clone()
            dist.all_reduce(gate_grad)  # the gate is replicated: its gradient is the sum over ranks
            # Failures are collected, not raised, so that every rank runs the same collectives.
            if not torch.allclose(y, ref[rank].detach(), **tol):
                failures.append(f"{what}: output differs from the oracle")
            if not torch.allclose(gx, xs[rank].grad, **tol):
                failures.append(f"{what}: token gradient differs from the oracle")
            if not torch.allclose(gate_grad, want_params["gate.weight"], **tol):
                failures.append(f"{what}: gate gradient differs from the oracle")
            for n in ("w1", "b1", "w2", "b2"):
                if not torch.allclose(gp[n], want_params[n], **tol):
                    failures.append(f"{what}: {n} gradient differs from the oracle")
            # The overlapped variant against the unchunked path of the same algorithm.
            y1, gx1, gp1 = results[(algo, 1)]
            for name, a, b in [("output", y, y1), ("token gradient", gx, gx1)] + [
                    (f"{n} gradient", gp[n], gp1[n]) for n in gp]:
                worst = float(((a - b).abs() / b.abs().clamp_min(1e-300)).max()) if a.numel() else 0.0
                diffs[name] = max(diffs.get(name, 0.0), worst)
                if not _same_up_to_rounding(a, b):
                    failures.append(f"{what}: {name} differs from the unchunked path (max rel {worst:.2e})")
            # The exchange itself moves bytes exactly: flat and 2-D give bit-identical results.
            yf, gxf, gpf = results[("flat", degree)]
            if not (torch.equal(y, yf) and torch.equal(gx, gxf) and all(torch.equal(gp[n], gpf[n]) for n in gp)):
                failures.append(f"{what}: differs bitwise from flat at the same degree")
            checked += 1
    return checked, failures, diffs


@pytest.mark.parametrize("spec", ["2x2", [[0, 2], [1, 3]]], ids=["2x2", "interleaved"])
def test_moe_matches_single_process(ranks, spec):
    """Output and gradients equal a single-process MoE; overlap degrees 2 and 3 equal degree 1."""
    per_rank = ranks(4, _moe_matrix, spec, timeout=120)
    for rank, (checked, failures, _) in enumerate(per_rank):
        assert not failures, f"rank {rank}: " + "; ".join(failures)
        assert checked == 18


def _generic_pipeline() -> bool:
    """exchange_compute with a row-wise compute and zero-sized segments, for every degree."""
    rank, world = dist.get_rank(), dist.get_world_size()
    seg = [[(rank + d + j) % 3 for j in range(2)] for d in range(world)]  # rows rank -> d, segment j
    recv = [[(s + rank + j) % 3 for j in range(2)] for s in range(world)]
    x = torch.randn(sum(map(sum, seg)), 4, dtype=torch.float64, generator=torch.Generator().manual_seed(rank))
    scale = torch.tensor([1.5, -2.0], dtype=torch.float64, requires_grad=True)

    def compute(rows, segments):
        # Row-wise: each row times its segment's scale, plus the source rank it came from.
        factors = torch.cat([scale[j].expand(segments[s][j]) + s
                             for s in range(len(segments)) for j in range(2)]) if rows.shape[0] else scale[:0]
        return rows * factors[:, None]

    outs = []
    for degree in (1, 2, 4):
        xg = x.clone().requires_grad_()
        scale.grad = None
        y = exchange_compute(xg, seg, recv, compute, degree=degree, algorithm="flat")
        y.pow(2).sum().backward()
        outs.append((y.detach(), xg.grad, scale.grad.clone()))
    for y, gx, gs in outs[1:]:
        assert torch.equal(y, outs[0][0]) and torch.equal(gx, outs[0][1])
        assert torch.allclose(gs, outs[0][2], rtol=1e-13)
    with torch.no_grad():  # inference: no graph is built, same values
        y = exchange_compute(x, seg, recv, compute, degree=3, algorithm="flat")
    assert not y.requires_grad and torch.equal(y, outs[0][0])
    # The oracle: my rows to rank d segment j come back times (scale[j] + rank).
    want = torch.cat([x[sum(map(sum, seg[:d])) + sum(seg[d][:j]):][: seg[d][j]] * (scale[j].item() + rank)
                      for d in range(world) for j in range(2)])
    assert torch.allclose(outs[0][0], want, rtol=1e-14)
    return True


def test_exchange_compute_generic(ranks):
    """The pipeline with a toy row-wise compute: degrees 1, 2, 4 agree and match a rank-arithmetic oracle."""
    assert all(ranks(4, _generic_pipeline, timeout=60))


def test_chunk_layout():
    sizes, order, per_chunk = chunk_layout([[3, 0], [1, 4]], 2)
    assert sizes == [1, 2, 0, 0, 0, 1, 2, 2]
    assert [sizes[o] for o in order] == [1, 0, 0, 2, 2, 0, 1, 2]
    assert per_chunk == [[[1, 0], [0, 2]], [[2, 0], [1, 2]]]
    with pytest.raises(ValueError, match="degree"):
        exchange_compute(torch.zeros(1, 1), [[1]], [[1]], lambda r, s: r, degree=0)


def test_moe_single_process():
    """World size 1 (docs/faults.md row 7): the layer runs without a process group, degree 2 equals degree 1."""
    x = torch.randn(9, D, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    a = MoE(D, H, E, top_k=2, seed=3, dtype=torch.float64)(x)
    b = MoE(D, H, E, top_k=2, seed=3, dtype=torch.float64, overlap_degree=2)(x)
    assert a.shape == x.shape and _same_up_to_rounding(b.detach(), a.detach())
    with pytest.raises(ValueError, match="top_k"):
        MoE(D, H, E, top_k=3)
