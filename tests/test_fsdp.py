"""FSDP2 with commopt's comms (issue 17): ``commopt.comm.fsdp`` against native FSDP2 and native HSDP.

Oracles, each run in the same test from the same seeds on the same data: native FSDP2
(``fully_shard`` with torch's own reduce-scatter and all-gather), native HSDP (a 2-D mesh), and, for
the quantized comms, the per-rank local gradients of an unsharded replica, from which the test
computes the error bound of the block size and bits. The model's parameters do not divide by the
world size (FSDP pads; one has fewer rows than ranks, so some ranks hold an empty shard).
docs/faults.md rows: 33 (register validates on every rank), 34 (padding, a world of 1, empty shards),
35 (NaN/Inf with a compressor), 36 (error-feedback checkpoint). ``fsdp.shard``'s ``"auto"`` choice, its
arguments, its native parts and the benchmark: tests/test_fsdp_recipe.py.
"""

from __future__ import annotations

import io
import math

import pytest
import torch
import torch.distributed as dist
from torch import nn

from commopt.comm import Topology, context, fsdp
from commopt.comm import compression as C
from commopt.comm.errors import TopologyError

D = 13  # width: no parameter's first dimension divides by 3 or 4


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2, self.ln = nn.Linear(D, 9), nn.Linear(9, D), nn.LayerNorm(D)

    def forward(self, x):
        return x + self.fc2(torch.tanh(self.fc1(self.ln(x))))


class _Net(nn.Module):
    """Root parameters (inp, ln, head) around two blocks; head has 2 rows (< world): empty shards."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(5, D)
        self.blocks = nn.ModuleList(_Block() for _ in range(2))
        self.ln = nn.LayerNorm(D)
        self.head = nn.Linear(D, 2)

    def forward(self, x):
        h = self.inp(x)
        for b in self.blocks:
            h = b(h)
        return self.head(self.ln(h))


def _zero_pp() -> dict:
    """The whole ZeRO++ recipe, forced (``fsdp.shard``'s ``"auto"`` decides per model and cluster)."""
    return {"weights": C.QuantizeCompressor(8), "gradients": C.QuantizeCompressor(4), "hpz": True}


def _model() -> nn.Module:
    torch.manual_seed(0)  # the test's own initialisation (the library never touches the global RNG)
    m = _Net()
    with torch.no_grad():
        for p in m.parameters():  # LayerNorms away from 1/0: every parameter carries a gradient
            p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())) * 0.1)
    return m


def _data(rank: int, step: int, n: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(10_000 + 100 * step + rank)
    x = torch.randn(n, 5, generator=g)
    return x, torch.stack([x[:, 0] * x[:, 1], torch.sin(x[:, 2])], dim=1)


def _loss(model, x, y):
    return nn.functional.mse_loss(model(x), y)


def _mesh(world: int | None = None):
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh("cpu", (world or dist.get_world_size(),))


def _native(reshard=True, mp=None, mesh=None) -> nn.Module:
    from torch.distributed.fsdp import fully_shard

    m = _model()
    kw = {"mesh": mesh if mesh is not None else _mesh(), "reshard_after_forward": reshard}
    if mp is not None:
        kw["mp_policy"] = mp
    for b in m.blocks:
        fully_shard(b, **kw)
    fully_shard(m, **kw)
    return m


def _full_grads(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.grad.full_tensor().detach().clone() for n, p in model.named_parameters()}


def _full_params(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.full_tensor().detach().clone() for n, p in model.named_parameters()}


def _train(model: nn.Module, steps: int, *, lr: float = 0.05, accumulate: int = 1, every=None) -> list[float]:
    """SGD on every rank's data; ``every(step)`` after each backward (grads still in place)."""
    rank = dist.get_rank()
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    losses = []
    for step in range(steps):
        opt.zero_grad()
        total = 0.0
        for micro in range(accumulate):
            model.set_requires_gradient_sync(micro == accumulate - 1)
            x, y = _data(rank, step * accumulate + micro)
            loss = _loss(model, x, y) / accumulate
            loss.backward()
            total += loss.item()
        if every is not None:
            every(step)
        opt.step()
        mean = torch.tensor([total])
        dist.all_reduce(mean)
        losses.append(float(mean) / dist.get_world_size())
    return losses


def _close(a: dict, b: dict, rtol: float, atol: float, what: str) -> None:
    """Element-wise within ``rtol`` of ``b``, or within ``atol`` times the tensor's largest magnitude
    (sums in another order round differently, by a fraction of the largest partial sum's ulp)."""
    for k in a:
        scale = float(b[k].abs().max()) or 1.0
        assert torch.allclose(a[k], b[k], rtol=rtol, atol=atol * scale), (
            f"{what}: {k} differs by {float((a[k] - b[k]).abs().max()):.3g} (largest |value| {scale:.3g})")


# ------------------------------------------------------------------------------------------ exact
def _topo(spec: str) -> Topology:
    """``"2x2"``/``"2+1"`` node by node, or explicit nodes such as ``"0,2;1,3"`` (interleaved)."""
    if ";" in spec:
        return Topology.from_nodes([[int(r) for r in node.split(",")] for node in spec.split(";")])
    return Topology.from_spec(spec)


def _body_exact(spec: str, steps: int) -> list[str]:
    """Exact comms (every algorithm that applies, hpZ's node-local all-gather) give native FSDP2's
    gradients step after step."""
    topo = _topo(spec)
    checked = []
    reference = _native()
    ref_grads: list[dict] = []
    _train(reference, steps, every=lambda s: ref_grads.append(_full_grads(reference)))
    ref_params = _full_params(reference)
    two_level = topo.num_nodes > 1 and topo.local_size > 1
    cases = [("flat", True), ("auto", True)]
    if topo.is_uniform:
        cases.append(("hierarchical", True))
        if two_level:
            cases.append(("hierarchical", topo.local_size))  # hpZ: backward's all-gather inside the node
    for algorithm, reshard in cases:
        model = _native(reshard)
        fsdp.register(model, reduce_scatter=fsdp.ReduceScatterComm(topo, algorithm),
                      all_gather=fsdp.AllGatherComm(topo, algorithm))
        grads: list[dict] = []
        _train(model, steps, every=lambda s, m=model, g=grads: g.append(_full_grads(m)))
        for s in range(steps):
            _close(grads[s], ref_grads[s], 1e-5, 1e-6, f"{spec} {algorithm} reshard={reshard} step {s}")
        _close(_full_params(model), ref_params, 1e-5, 1e-6, f"{spec} {algorithm} params")
        checked.append(f"{algorithm}/{reshard}")
    # fsdp.shard with exact comms: asynchronous all-gathers prefetched in forward and backward
    # (and hpZ where the topology has two levels) change nothing either.
    model = _model()
    fsdp.shard(model, topology=topo, weights=None, gradients=None, hpz=two_level and topo.is_uniform)
    grads = []
    _train(model, steps, every=lambda s, m=model, g=grads: g.append(_full_grads(m)))
    for s in range(steps):
        _close(grads[s], ref_grads[s], 1e-5, 1e-6, f"{spec} shard(prefetch) step {s}")
    checked.append("shard")
    return checked


@pytest.mark.parametrize("world,spec", [(4, "2x2"), (4, "1x4"), (4, "4x1"), (4, "0,2;1,3"), (3, "2+1")])
def test_exact_comms_give_native_fsdp2_gradients(ranks, world, spec):
    """docs/faults.md row 34: parameters that do not divide by the world (padding, empty shards) reduce exactly
    as native FSDP2 over several steps, for flat, auto, hierarchical and hpZ where they apply."""
    out = ranks(world, _body_exact, spec, 3, timeout=120)
    assert out[0] and all(o == out[0] for o in out)


# ------------------------------------------------------------------------------------------ quantized
def _blockmax(v: torch.Tensor, block: int) -> torch.Tensor:
    """Per element of the 1-D ``v``: max |v| over its block (blocks of ``block`` from v's start)."""
    n = v.numel()
    padded = torch.cat([v.abs(), v.new_zeros((-n) % block)])
    return padded.view(-1, block).amax(1, keepdim=True).expand(-1, block).reshape(-1)[:n]


def _rows(full: torch.Tensor, world: int) -> torch.Tensor:
    """FSDP's padded layout of a parameter: row c is rank c's shard (dim 0 padded to the world)."""
    rows = -(-full.shape[0] // world)
    padded = full.new_zeros((rows * world, *full.shape[1:]))
    padded[: full.shape[0]] = full
    return padded.reshape(world, -1)


def _bound(local: torch.Tensor, topo: Topology, block: int, qmax: int) -> torch.Tensor:
    """The largest error of the quantized reduce-scatter (stochastic rounding: under one quantization
    step, max|block| / qmax, per quantized contribution), per element, for the mean of ``local``
    (``[world, world, seg]``: rank s's padded shard rows). Two levels: at each node every rank but the
    owner's rail peer sends quantized (level 1); the rail peers of other nodes send their partial
    sum requantized (level 2), bounded by |exact partial sum| + the level-1 steps. One level: every
    rank but the owner."""
    world = topo.world_size
    out = torch.zeros(local.shape[1:], dtype=torch.float64)
    two = topo.is_uniform and topo.num_nodes > 1 and topo.local_size > 1
    for c in range(world):
        steps = lambda s, c=c: _blockmax(local[s, c], block).double() / qmax
        if not two:
            out[c] = sum(steps(s) for s in range(world) if s != c) / world
            continue
        j = topo.nodes[topo.node_of(c)].index(c)
        total = torch.zeros_like(out[c])
        for n, node in enumerate(topo.nodes):
            senders = [s for s in node if s != node[j]]
            level1 = sum((steps(s) for s in senders), torch.zeros_like(out[c]))
            total += level1
            if n != topo.node_of(c):
                envelope = sum(local[s, c].double() for s in node).abs() + level1
                total += _blockmax(envelope, block) / qmax
        out[c] = total / world
    return out


def _local_grads(model: nn.Module, step: int) -> dict[str, torch.Tensor]:
    """Every rank's own gradient of the current parameters (an unsharded replica: the oracle)."""
    replica = _model()
    replica.load_state_dict(_full_params(model))
    x, y = _data(dist.get_rank(), step)
    _loss(replica, x, y).backward()
    out = {}
    for n, p in replica.named_parameters():
        rows = [torch.zeros_like(p.grad) for _ in range(dist.get_world_size())]
        dist.all_gather(rows, p.grad)
        out[n] = torch.stack(rows)
    return out


def _body_quantized_bound(spec: str, steps: int) -> dict:
    """Quantized reduce-scatter (no error feedback: stochastic rounding) against the bound computed
    from every rank's local gradients, the block size and the bits, at every step."""
    topo = _topo(spec)
    block = 8  # several blocks per parameter shard
    worst = {}
    for bits, qmax in ((4, 7), (8, 127)):
        model = _native()
        rs = fsdp.ReduceScatterComm(topo, "auto", C.QuantizeCompressor(bits, block), error_feedback=False)
        fsdp.register(model, reduce_scatter=rs)
        seen = []

        def check(step, model=model, bits=bits, qmax=qmax, seen=seen):
            local = _local_grads(model, step)
            ours = _full_grads(model)
            for name, g in local.items():
                world = topo.world_size
                rows = torch.stack([_rows(g[s], world) for s in range(world)])
                exact = rows.double().mean(0)
                err = (_rows(ours[name], world).double() - exact).abs()
                bound = _bound(rows, topo, block, qmax) + 1e-6 * float(rows.abs().max())
                assert bool((err <= bound).all()), (
                    f"{spec} int{bits} step {step} {name}: error {float((err - bound).max()):.3g} over the bound")
                seen.append((float(err.sum()), float(bound.sum())))

        _train(model, steps, every=check)
        err_total, bound_total = sum(e for e, _ in seen), sum(b for _, b in seen)
        assert err_total > 0, f"{spec} int{bits}: no quantization error at all (was the comm used?)"
        worst[bits] = err_total / bound_total
    return worst


@pytest.mark.parametrize("world,spec", [(4, "2x2"), (4, "1x4"), (4, "4x1"), (3, "2+1")])
def test_quantized_reduce_scatter_within_the_bound(ranks, world, spec):
    """int4 and int8 qgZ (two levels on 2x2, one elsewhere; 2+1 falls back to one level): every
    step's gradient error is within the bound of the data, block size and bits (docs/faults.md row 34: shards
    padded, some empty)."""
    out = ranks(world, _body_quantized_bound, spec, 3, timeout=120)
    for bits, ratio in out[0].items():
        assert 0 < ratio < 1, (bits, ratio)


def _body_quantized_weights(spec: str) -> float:
    """qwZ: the gathered weights (what forward computes with) are within half a quantization step of
    the exact parameters, identical on every rank and in every gather; the shards stay exact."""
    topo = _topo(spec)
    block, world = 8, topo.world_size
    model = _native(reshard=False)
    ag = fsdp.AllGatherComm(topo, "auto", C.QuantizeCompressor(8, block))
    fsdp.register(model, all_gather=ag)
    exact = _full_params(model)
    x, y = _data(dist.get_rank(), 0)
    loss = _loss(model, x, y)  # reshard_after_forward=False: the gathered parameters stay in place
    gathered = {n: p.detach().clone() for n, p in model.named_parameters()}
    loss.backward()
    ratio = 0.0
    for name, full in exact.items():
        rows = _rows(full, world)
        bound = torch.stack([_blockmax(r, block) for r in rows]) / 127 / 2 + 1e-7
        err = (_rows(gathered[name], world) - rows).abs()
        assert bool((err <= bound).all()), f"{spec} {name}: weight error over half a step"
        ratio = max(ratio, float((err / bound).max()))
        copies = [torch.zeros_like(gathered[name]) for _ in range(world)]
        dist.all_gather(copies, gathered[name])
        assert all(torch.equal(c, copies[0]) for c in copies), f"{spec} {name}: ranks gathered different weights"
    # The same shard encodes to the same bytes: a second gather (backward's, without hpZ) is identical.
    pg = model._get_fsdp_state()._fsdp_param_groups[0]
    shard = torch.randn(24)
    outs = [torch.empty(24 * world) for _ in range(2)]
    for out in outs:
        pg._all_gather_comm(out, shard, dist.group.WORLD)
    assert torch.equal(outs[0], outs[1])
    return ratio


@pytest.mark.parametrize("world,spec", [(4, "2x2"), (4, "1x4"), (3, "2+1")])
def test_quantized_all_gather_within_half_a_step(ranks, world, spec):
    """qwZ's int8 weights: within max|block| / 127 / 2 of the exact ones, the same on every rank."""
    out = ranks(world, _body_quantized_weights, spec, timeout=90)
    assert 0 < out[0] <= 1


# ------------------------------------------------------------------------------------------ training
def _hsdp_native(topo: Topology) -> nn.Module:
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import fully_shard

    grid = torch.tensor([list(n) for n in topo.nodes])
    mesh = DeviceMesh("cpu", grid, mesh_dim_names=("replicate", "shard"))
    m = _model()
    for b in m.blocks:
        fully_shard(b, mesh=mesh)
    fully_shard(m, mesh=mesh)
    return m


def _body_training(spec: str, steps: int) -> dict:
    """30 steps of the ZeRO++ recipe (with and without error feedback) against native FSDP2, and of
    compressed HSDP (int8, fp16, PowerSGD rank 1 and top-k 25 %, both with error feedback) against
    native HSDP: the final losses."""
    topo = _topo(spec)
    lr = 0.1
    out = {"fsdp2": _train(_native(), steps, lr=lr)[-1]}
    for name, kwargs in (("zero++", {}), ("zero++/no-ef", {"error_feedback": False})):
        m = _model()
        fsdp.shard(m, topology=topo, **_zero_pp(), **kwargs)
        out[name] = _train(m, steps, lr=lr)[-1]
    if topo.is_uniform and topo.num_nodes > 1:
        out["hsdp"] = _train(_hsdp_native(topo), steps, lr=lr)[-1]
        for name, comp in (("hsdp-int8", C.QuantizeCompressor(8)), ("hsdp-fp16", C.FP16Compressor()),
                           ("hsdp-powersgd", C.PowerSGDCompressor(rank=1, start_iter=2, min_compression_rate=0)),
                           ("hsdp-topk", C.TopKCompressor(0.25))):
            m = _model()
            fsdp.shard_hsdp(m, comp, topology=topo)
            out[name] = _train(m, steps, lr=lr)[-1]
    return out


@pytest.mark.parametrize("world,spec", [(4, "2x2"), (3, "2+1")])
def test_compressed_training_within_two_percent(ranks, world, spec):
    """30 steps: the ZeRO++ recipe (int8 weights, hpZ, int4 gradients; error feedback or not) ends
    within 2 % of native FSDP2's loss, compressed HSDP within 2 % of native HSDP's."""
    out = ranks(world, _body_training, spec, 30, timeout=150)[0]
    for name, loss in out.items():
        ref = out["hsdp"] if name.startswith("hsdp-") else out["fsdp2"]
        assert math.isfinite(loss) and abs(loss - ref) <= 0.02 * ref, (name, loss, ref, out)


# ------------------------------------------------------------------------------------------ precision, ops
def _body_precision(spec: str, steps: int) -> None:
    """MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32) and a bf16 reduction; gradient
    accumulation with set_requires_gradient_sync(False); every op FSDP passes (AVG, SUM with its own
    pre/post division for fp16 and with set_force_sum_reduction_for_comms, PREMUL_SUM from
    set_gradient_divide_factor): exact hierarchical comms against native FSDP2."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    topo = _topo(spec)
    cases = [
        # (name, case, rtol); atol below is relative to each tensor's largest magnitude
        ("bf16/fp32", {"mp": MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)}, 1e-5),
        ("bf16/bf16", {"mp": MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16)}, 2 ** -8),
        ("fp16/fp16", {"mp": MixedPrecisionPolicy(param_dtype=torch.float16, reduce_dtype=torch.float16)}, 2 ** -11),
        ("accumulate", {"accumulate": 3}, 1e-5),
        ("force-sum", {"setup": lambda m: m.set_force_sum_reduction_for_comms(True)}, 1e-5),
    ]
    for name, case, tol in cases:
        grads = []
        for ours in (False, True):
            m = _native(mp=case.get("mp"))
            for mod in [m, *m.blocks]:
                case.get("setup", lambda _m: None)(mod)
            if ours:
                fsdp.register(m, reduce_scatter=fsdp.ReduceScatterComm(topo, "hierarchical" if topo.is_uniform
                                                                        else "auto"),
                              all_gather=fsdp.AllGatherComm(topo, "auto"))
            seen = []
            _train(m, steps, accumulate=case.get("accumulate", 1),
                   every=lambda s, m=m, seen=seen: seen.append(_full_grads(m)))
            grads.append(seen)
        for s in range(steps):
            # A low-precision reduction rounds each of world_size inputs (pre-divided) and each
            # partial sum, in another order than gloo's: world_size ulps of the largest magnitude.
            low = {"bf16/bf16": 2.0 ** -8, "fp16/fp16": 2.0 ** -11}.get(name)
            atol = topo.world_size * low if low else 1e-6
            _close({k: v.float() for k, v in grads[1][s].items()}, {k: v.float() for k, v in grads[0][s].items()},
                   tol, atol, f"{spec} {name} step {s}")
    # PREMUL_SUM: gloo has no such op, so native FSDP2 cannot run it; its oracle is native AVG's
    # gradient times world / factor.
    world, factor = topo.world_size, 3.0
    ref = _native()
    ref_grads = []
    _train(ref, 1, every=lambda s: ref_grads.append(_full_grads(ref)))
    m = _native()
    for mod in [m, *m.blocks]:
        mod.set_gradient_divide_factor(factor)
    fsdp.register(m, reduce_scatter=fsdp.ReduceScatterComm(topo))
    grads = []
    _train(m, 1, every=lambda s: grads.append(_full_grads(m)))
    _close(grads[0], {k: v * world / factor for k, v in ref_grads[0].items()}, 1e-5, 1e-6, f"{spec} premul_sum")


@pytest.mark.parametrize("world,spec", [(4, "2x2"), (3, "2+1")])
def test_precision_accumulation_and_ops_match_native(ranks, world, spec):
    ranks(world, _body_precision, spec, 2, timeout=150)


# ------------------------------------------------------------------------------------------ HSDP
def _body_hsdp_exact(spec: str, steps: int) -> None:
    """The HSDP hook without a compressor over 1-D FSDP per node gives native HSDP's gradients bit
    for bit (the same reduce-scatter, the same rail all-reduce); with commopt's exchange inside the
    node too, up to the order of fp32 sums. Compressors that are exact at their limit go through
    the same path as their lossy settings (``reduce_tensors`` along the rail, every parameter's
    shard in its shard shape): PowerSGD of full rank (its power step spans every column: P P^T M = M)
    and top-k keeping every element give native HSDP's gradients up to rounding."""
    topo = _topo(spec)
    ref = _hsdp_native(topo)
    ref_grads = []
    _train(ref, steps, every=lambda s: ref_grads.append(_full_grads(ref)))
    cases = [(None, False), (None, True),
             (C.PowerSGDCompressor(rank=64, start_iter=0, min_compression_rate=0), True),
             (C.TopKCompressor(1.0), True)]
    for comp, intra in cases:
        m = _model()
        comms = fsdp.shard_hsdp(m, comp, topology=topo, intra=intra)
        grads = []
        _train(m, steps, every=lambda s, m=m, g=grads: g.append(_full_grads(m)))
        for s in range(steps):
            if comp is not None:
                _close(grads[s], ref_grads[s], 1e-4, 1e-5, f"{spec} hsdp {comp.name} step {s}")
            elif intra:
                _close(grads[s], ref_grads[s], 1e-5, 1e-6, f"{spec} hsdp intra step {s}")
            else:
                for k in grads[s]:
                    assert torch.equal(grads[s][k], ref_grads[s][k]), f"{spec} hsdp step {s}: {k} differs"
        if isinstance(comp, C.PowerSGDCompressor):
            # Every weight went through the power step (not the exact fallback): Q warm starts of
            # the padded shard shapes, one per matrix, on every rank.
            q = comms.all_reduce.compressor_state.q_memory
            assert sorted(q) == sorted(n for n, p in m.named_parameters() if p.dim() == 2), sorted(q)


@pytest.mark.parametrize("world,spec", [(4, "2x2"), (4, "0,2;1,3")])
def test_hsdp_hook_gives_native_hsdp_gradients(ranks, world, spec):
    ranks(world, _body_hsdp_exact, spec, 2, timeout=90)


# ------------------------------------------------------------------------------------------ bytes
def _body_traffic(spec: str) -> None:
    """Every quantized comm's traffic() is what the engine counts on each rank (and the exact ones',
    which are the algorithms')."""
    from torch.distributed import ReduceOp

    from commopt.comm.fsdp._common import Bound, Layout

    topo = _topo(spec)
    rank, world = dist.get_rank(), topo.world_size
    numels = (21, 5, 10)
    chunk = sum(numels)
    layout = Bound(Layout("m", ("a", "b", "c"), numels))
    engine = context().engine()

    def counted(fn) -> int:
        engine.reset_stats()
        fn()
        return sum(engine.bytes_sent().values())

    for algorithm in ("auto", "flat") + (("hierarchical",) if topo.is_uniform else ()):
        for comp in (None, C.QuantizeCompressor(4, 8), C.QuantizeCompressor(8, 8)):
            rs = fsdp.ReduceScatterComm(topo, algorithm, comp)
            view = rs.bind(layout)
            inp, out = torch.randn(world * chunk), torch.empty(chunk)
            sent = counted(lambda v=view, o=out, i=inp: v(o, i, dist.group.WORLD, ReduceOp.AVG))
            assert sent == rs.traffic(world * chunk * 4, segments=list(numels)).sent(rank), (algorithm, comp)
            ag = fsdp.AllGatherComm(topo, algorithm, comp)
            gview = ag.bind(layout)
            big = torch.empty(world * chunk)
            sent = counted(lambda v=gview, o=big, i=inp: v(o, i[:chunk], dist.group.WORLD))
            assert sent == ag.traffic(world * chunk * 4, segments=list(numels)).sent(rank), (algorithm, comp)
    if topo.is_uniform and topo.num_nodes > 1:
        hook = fsdp.AllReduceHook(C.QuantizeCompressor(8, 8), topo)
        hview = hook.bind(layout)
        shard = torch.randn(chunk)
        sent = counted(lambda: hview(shard))
        assert sent == hook.traffic(chunk, numels).sent(rank)


@pytest.mark.parametrize("world,spec", [(4, "2x2"), (4, "1x4"), (3, "2+1")])
def test_traffic_is_what_the_engine_counts(ranks, world, spec):
    ranks(world, _body_traffic, spec, timeout=60)


# ------------------------------------------------------------------------------------------ faults
def _default_comm(m: nn.Module) -> str:
    return type(m._get_fsdp_state()._fsdp_param_groups[0]._reduce_scatter_comm).__name__


def _body_register_errors(spec: str) -> list[str]:
    """docs/faults.md row 33: every refusal is an error on every rank at register (or at the comm's
    construction), before any step; nothing is registered and the model still trains natively."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.fsdp._fully_shard._fsdp_common import FSDPMeshInfo, ShardPlacementResult
    from torch.distributed.tensor import Shard

    topo = _topo(spec)
    rank, world = dist.get_rank(), topo.world_size
    seen = []

    def refused(exc_type, fn, words: str) -> None:
        with pytest.raises(exc_type) as info:
            fn()
        assert words in str(info.value), (words, str(info.value))
        seen.append(f"{exc_type.__name__}: {words}")

    # A compressor that cannot serve the collective.
    refused(TypeError, lambda: fsdp.ReduceScatterComm(topo, compressor=C.PowerSGDCompressor()), "cannot serve")
    refused(TypeError, lambda: fsdp.ReduceScatterComm(topo, compressor=C.TopKCompressor(0.1)), "cannot serve")
    refused(TypeError, lambda: fsdp.AllGatherComm(topo, compressor=C.FP16Compressor()), "cannot serve")
    refused(TypeError, lambda: fsdp.AllReduceHook("powersgd", topo), "must be None or a commopt")
    m = _native()
    refused(TypeError, lambda: fsdp.register(m, reduce_scatter=C.SignCompressor()), "cannot serve a reduce-scatter")
    refused(TypeError, lambda: fsdp.register(m, reduce_scatter=C.QuantizeCompressor(4)), "ReduceScatterComm(compressor")
    # More than one parameter group (a per-parameter mesh from shard_placement_fn).
    net = _model()
    info = FSDPMeshInfo(DeviceMesh.from_group(dist.new_group(list(range(world))), "cpu"), shard_mesh_dim=0)
    fully_shard(net, mesh=_mesh(), shard_placement_fn=lambda p, n=net: ShardPlacementResult(Shard(0), info)
                if p is n.head.weight else None)
    refused(ValueError, lambda: fsdp.register(net, reduce_scatter=fsdp.ReduceScatterComm(topo)), "parameter groups")
    # The ranks disagree (rank 0 builds another compressor).
    bits = 8 if rank == 0 else 4
    refused(ValueError, lambda: fsdp.register(m, reduce_scatter=fsdp.ReduceScatterComm(
        topo, compressor=C.QuantizeCompressor(bits))), "different models or comms")
    if topo.is_uniform and topo.num_nodes > 1:
        # FSDP over a group that spans nodes but is not the whole topology.
        across = [[n[j] for n in topo.nodes] for j in range(topo.local_size)]
        cross = DeviceMesh("cpu", torch.tensor(across).t().contiguous(), mesh_dim_names=("a", "b"))["a"]
        odd = _native(mesh=cross)
        refused(TopologyError, lambda: fsdp.register(odd, reduce_scatter=fsdp.ReduceScatterComm(topo)),
                "the mesh is not the topology's")
        # The HSDP hook over every rank (not one node), and over native HSDP's 2-D mesh.
        refused(TopologyError, lambda: fsdp.register(m, all_reduce=fsdp.AllReduceHook(C.QuantizeCompressor(8), topo)),
                "the mesh is not the topology's")
        refused(TopologyError, lambda: fsdp.register(_hsdp_native(topo), all_reduce=fsdp.AllReduceHook(None, topo)),
                "native HSDP")
    if not topo.is_uniform:
        refused(TopologyError, lambda: fsdp.register(m, reduce_scatter=fsdp.ReduceScatterComm(topo, "hierarchical")),
                "needs nodes of equal size")
        refused(TopologyError, lambda: fsdp.register(m, all_reduce=fsdp.AllReduceHook(None, topo)),
                "needs nodes of equal size")
        refused(TopologyError, lambda: C.reduce_tensors(C.TopKCompressor(1.0), [torch.ones(4)], ["a"], topology=topo,
                                                        algorithm="rail"), "needs nodes of equal size")
    # Nothing was registered: torch's own comm, and native training still works.
    assert _default_comm(m) == "DefaultReduceScatter"
    ref = _native()
    assert _train(m, 1) == _train(ref, 1)
    return seen


@pytest.mark.parametrize("world,spec", [(4, "2x2"), (3, "2+1")])
def test_register_refuses_on_every_rank_before_any_step(ranks, world, spec):
    out = ranks(world, _body_register_errors, spec, timeout=90)
    assert all(o == out[0] for o in out) and len(out[0]) >= 8


def _inject(module: nn.Module, rank: int, index: int, *, hook: bool = False) -> None:
    """Rank ``rank`` puts a NaN at ``index`` of the module's reduce-scatter input (``hook``: of the
    shard its HSDP hook receives) before commopt's comm sees it."""
    pg = module._get_fsdp_state()._fsdp_param_groups[0]
    inner = pg._reduce_scatter_comm
    if hook:
        reduce = pg._all_reduce_hook

        def poisoned_hook(t):
            if dist.get_rank() == rank:
                t.view(-1)[index] = float("nan")
            reduce(t)

        pg._all_reduce_hook = poisoned_hook
        return

    class Poisoned:
        def allocate(self, *a, **k):
            return inner.allocate(*a, **k)

        def __call__(self, output_tensor, input_tensor, group, op, async_op=False):
            if dist.get_rank() == rank:
                input_tensor.view(-1)[index] = float("nan")
            return inner(output_tensor, input_tensor, group, op, async_op)

    pg._reduce_scatter_comm = Poisoned()


def _nan_positions(grads: dict) -> dict:
    return {k: torch.nonzero(torch.isnan(v.reshape(-1))).view(-1).tolist() for k, v in grads.items()
            if bool(torch.isnan(v).any())}


def _body_nonfinite(spec: str) -> dict:
    """docs/faults.md row 35: a NaN in rank 0's gradient propagates into its quantization block of the reduced
    shard (never silently zeroed; through compressed HSDP, int8 or PowerSGD, into that element
    only), leaves every residual finite, and with check_finite=True raises NonFiniteError on every
    rank."""
    topo = _topo(spec)
    block = 8
    rows = -(-D // topo.world_size)  # rows of inp.weight per rank: rank 1's shard starts at rows * 5
    out = {"expect": {"inp.weight": list(range(rows * 5, rows * 5 + block))}}
    for check in (False, True):
        m = _native()
        rs = fsdp.ReduceScatterComm(topo, "auto", C.QuantizeCompressor(4, block), check_finite=check)
        fsdp.register(m, reduce_scatter=rs)
        _train(m, 1)
        _inject(m, 0, _chunk_offset(m, 1))  # the first element of rank 1's chunk: inp.weight's
        if check:
            with pytest.raises(Exception) as info:
                _train(m, 1)
            assert "NonFiniteError" in str(info.value) and "ranks [0]" in str(info.value), str(info.value)
            out["check"] = type(info.value).__name__
            continue
        grads = []
        _train(m, 1, every=lambda s, m=m, g=grads: g.append(_full_grads(m)))
        out["nan"] = _nan_positions(grads[0])
        residuals = rs.state_dict()["residuals"]
        assert residuals and all(bool(torch.isfinite(t).all()) for t in residuals.values())
    two_level = topo.is_uniform and topo.num_nodes > 1
    hsdp = [("int8", C.QuantizeCompressor(8, block)),
            ("powersgd", C.PowerSGDCompressor(rank=1, start_iter=0, min_compression_rate=0))] if two_level else []
    for name, comp in hsdp:
        for check in (False, True):
            m = _model()
            comms = fsdp.shard_hsdp(m, comp, topology=topo)
            comms.all_reduce.finite_check = check
            _train(m, 1)
            _inject(m, 0, -1, hook=True)  # rank 0's shard of the root's last parameter: head.bias[0]
            if check:
                with pytest.raises(Exception) as info:
                    _train(m, 1)
                assert "NonFiniteError" in str(info.value), str(info.value)
                continue
            grads = []
            _train(m, 1, every=lambda s, m=m, g=grads: g.append(_full_grads(m)))
            out[f"hsdp-nan/{name}"] = _nan_positions(grads[0])
            state = comms.state_dict()["all_reduce"]
            residuals = state["residuals"] if name == "int8" else state["error_feedback"]["worker"]
            assert residuals and all(bool(torch.isfinite(t).all()) for t in residuals.values()), name
    return out


def _chunk_offset(m: nn.Module, owner: int) -> int:
    """Index, in the root module's reduce-scatter input, of the first element of ``owner``'s chunk."""
    pg = m._get_fsdp_state()._fsdp_param_groups[0]
    return owner * sum(fp.padded_sharded_param_size.numel() for fp in pg.fsdp_params)


@pytest.mark.parametrize("world,spec", [(4, "2x2"), (4, "1x4"), (3, "2+1")])
def test_nonfinite_gradients_propagate_or_raise_and_never_poison_residuals(ranks, world, spec):
    out = ranks(world, _body_nonfinite, spec, timeout=90)
    for o in out:
        assert o["nan"] == o["expect"], o
        assert o["check"]
        for name in ("int8", "powersgd"):
            if f"hsdp-nan/{name}" in o:
                assert o[f"hsdp-nan/{name}"] == {"head.bias": [0]}, o


# ------------------------------------------------------------------------------------------ checkpoint
def _recipe(topo: Topology, kind: str = "zero++"):
    m = _model()
    if kind == "zero++":
        comms = fsdp.shard(m, topology=topo, **_zero_pp())
    else:  # compressed HSDP with PowerSGD: residuals and warm starts
        comms = fsdp.shard_hsdp(m, C.PowerSGDCompressor(rank=1, start_iter=1, min_compression_rate=0), topology=topo)
    return m, comms, torch.optim.SGD(m.parameters(), lr=0.1)


def _steps(m, opt, start: int, stop: int) -> None:
    for step in range(start, stop):
        opt.zero_grad()
        x, y = _data(dist.get_rank(), step)
        _loss(m, x, y).backward()
        opt.step()


def _body_checkpoint(spec: str, total: int, split: int, kind: str = "zero++") -> bytes:
    """docs/faults.md row 36: the ZeRO++ recipe with error feedback (or compressed HSDP with PowerSGD: residuals
    and warm starts), checkpointed at ``split`` (shards and the comms' state, torch.save), rebuilt
    from scratch and restored with weights_only=True, continues bit-identically to the uninterrupted
    run; without the comms' state it does not."""
    topo = _topo(spec)
    m, comms, opt = _recipe(topo, kind)
    _steps(m, opt, 0, total)
    straight = {n: p.to_local().clone() for n, p in m.named_parameters()}
    m, comms, opt = _recipe(topo, kind)
    _steps(m, opt, 0, split)
    buf = io.BytesIO()
    torch.save({"model": {n: p.to_local().clone() for n, p in m.named_parameters()}, "comms": comms.state_dict()}, buf)
    saved = buf.getvalue()
    if kind == "zero++":
        assert comms.state_dict()["reduce_scatter"]["residuals"]
    else:
        state = comms.state_dict()["all_reduce"]
        assert state["error_feedback"]["worker"] and state["compressor_state"]["q_memory"], sorted(state)
    for restore_comms in (True, False):
        m, comms, opt = _recipe(topo, kind)
        state = torch.load(io.BytesIO(saved), weights_only=True)
        with torch.no_grad():
            for n, p in m.named_parameters():
                p.to_local().copy_(state["model"][n])
        if restore_comms:
            comms.load_state_dict(state["comms"])
        _steps(m, opt, split, total)
        same = all(torch.equal(p.to_local(), straight[n]) for n, p in m.named_parameters())
        assert same == restore_comms, f"restored residuals: {restore_comms}, bit-identical: {same}"
    return saved


def _body_load_elsewhere(saved: bytes, spec: str) -> str:
    """The residuals of another world size are a clear error, not silently misapplied."""
    m, comms, _ = _recipe(_topo(spec))
    state = torch.load(io.BytesIO(saved), weights_only=True)
    with pytest.raises(ValueError) as info:
        comms.load_state_dict(state["comms"])
    return str(info.value)


def test_error_feedback_checkpoint_restores_bit_identically(ranks):
    ranks(4, _body_checkpoint, "2x2", 5, 3, "hsdp-powersgd", timeout=120)
    saved = ranks(4, _body_checkpoint, "2x2", 6, 3, timeout=120)
    messages = ranks(3, _body_load_elsewhere, saved[0], "2+1", timeout=60)
    assert all("world_size" in msg and "documented reset" in msg for msg in messages), messages[0]


# ------------------------------------------------------------------------------------------ world of one
def _body_world_one() -> None:
    """docs/faults.md row 34: a world of one: the comms are identities (no communication), and the recipe trains
    exactly as native FSDP2 does."""
    from torch.distributed import ReduceOp

    topo = Topology.from_spec("1x1")
    for comm in (fsdp.ReduceScatterComm(topo, compressor=C.QuantizeCompressor(4)),
                 fsdp.AllGatherComm(topo, compressor=C.QuantizeCompressor(8))):
        x, out = torch.randn(10), torch.empty(10)
        engine = context().engine()
        engine.reset_stats()
        if isinstance(comm, fsdp.ReduceScatterComm):
            comm(out, x, dist.group.WORLD, ReduceOp.AVG)
        else:
            comm(out, x, dist.group.WORLD)
        assert torch.equal(out, x) and not engine.bytes_sent()
    ref = _native()
    m = _model()
    fsdp.shard(m, topology=topo)  # "auto": a world of one is exact
    assert _train(m, 3) == _train(ref, 3)


def test_world_of_one(ranks):
    ranks(1, _body_world_one, timeout=60)
