"""OverlapDataParallel against DDP, the shared issue order, the credit bound, the autotuner.

Oracles are independent of commopt's scheduler: torch's own ``DistributedDataParallel`` with one
optimizer over the whole model (default reduction, or commopt's DDP hook where a compressor is
involved), trained on the same per-rank data. Everything runs in float64; with 2 ranks an average
is exact in binary (a sum of two values times 0.5), so those cases must agree to 1e-12; the 2x2
hierarchical and leader algorithms sum four values in a different association than DDP's ring,
so they agree to 1e-10 after the steps run (a few ulps per step, amplified by AdamW's division).
"""

from __future__ import annotations

import contextlib
import time

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from commopt.comm import Topology, hooks
from commopt.schedules import OverlapDataParallel, autotune

STEPS = 4
EXACT = 1e-12  # world 2, flat reduction: averaging two values is exact
REASSOC = 1e-10  # world 4, hierarchical / leader: a different summation order


# ------------------------------------------------------------------------------------ helpers
def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(),
                         nn.Linear(16, 4)).double()


def _data(rank: int, steps: int, micro: int = 1) -> list[list[torch.Tensor]]:
    g = torch.Generator().manual_seed(1000 + rank)
    return [[torch.randn(6, 8, generator=g, dtype=torch.float64) for _ in range(micro)] for _ in range(steps)]


def _opt(name: str):
    if name == "sgd":
        return lambda params: torch.optim.SGD(params, lr=0.05, momentum=0.9)
    return lambda params: torch.optim.AdamW(params, lr=1e-2, weight_decay=0.01)


def _loss(y: torch.Tensor) -> torch.Tensor:
    return (y - 0.5).pow(2).mean()


def _ddp_run(make_model, opt: str, data, state=None, **ddp_kwargs) -> list[torch.Tensor]:
    model = make_model()
    ddp = DDP(model, **ddp_kwargs)
    if state is not None:
        hooks.register(ddp, state)
    optimizer = _opt(opt)(list(model.parameters()))
    for batches in data:
        for i, x in enumerate(batches):
            ctx = ddp.no_sync() if i < len(batches) - 1 else contextlib.nullcontext()
            with ctx:
                _loss(ddp(x)).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return [p.detach().clone() for p in model.parameters()]


def _odp_run(make_model, opt: str, data, **kwargs) -> tuple[list[torch.Tensor], OverlapDataParallel]:
    odp = OverlapDataParallel(make_model(), _opt(opt), **kwargs)
    try:
        for batches in data:
            for i, x in enumerate(batches):
                ctx = odp.no_sync() if i < len(batches) - 1 else contextlib.nullcontext()
                with ctx:
                    _loss(odp(x)).backward()
        odp.synchronize()
        return [p.detach().clone() for p in odp.module.parameters()], odp
    finally:
        odp.close()


def _maxdiff(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    return max(float((x - y).abs().max()) for x, y in zip(a, b))


# Small caps so the 7-layer model spans several buckets and several chunks per bucket, and a credit
# of two chunks so the bound binds.
SMALL = {"bucket_cap_mb": 1.5e-3, "first_bucket_cap_mb": 5e-4, "partition_mb": 5e-4, "credit_mb": 1e-3}


# ------------------------------------------------------------------------------------ rank bodies
def _body_matches_ddp(steps: int) -> dict:
    rank = dist.get_rank()
    data = _data(rank, steps)
    out = {}
    for opt in ("sgd", "adamw"):
        ref = _ddp_run(_mlp, opt, data)
        for plan in ("priority", "fifo"):
            got, odp = _odp_run(_mlp, opt, data, algorithm="flat", plan=plan, replan_every=2, **SMALL)
            out[(opt, plan)] = (_maxdiff(ref, got), odp.stats())
        # Flat fp16 on 2 ranks: one fp16 addition per element, commutative, so the parameter order in
        # the bucket cannot matter (on 4 ranks the ring's summation order depends on the position).
        out[(opt, "fp16/flat")] = _compressed(opt, data, Topology.from_spec("1x2"), "flat", ref)
    return out


def _body_algorithms(steps: int) -> dict:
    rank = dist.get_rank()
    topo = Topology.from_spec("2x2")
    data = _data(rank, steps)
    out = {}
    for opt in ("sgd", "adamw"):
        ref = _ddp_run(_mlp, opt, data)
        for algo in ("flat", "hierarchical", "leader", "auto"):
            got, _ = _odp_run(_mlp, opt, data, topology=topo, algorithm=algo, replan_every=2, **SMALL)
            out[(opt, algo)] = _maxdiff(ref, got)
        # Compressed: the oracle is DDP with commopt's hook and the same compressor. One bucket on both
        # sides (the model is far below both caps). Hierarchical on 2x2 sums two values per level, so
        # the order of parameters inside the bucket (DDP re-orders after step 1) cannot change a bit.
        out[(opt, "fp16/hierarchical")] = _compressed(opt, data, topo, "hierarchical", ref)
    return out


def _compressed(opt: str, data, topo, algo: str, ref) -> tuple[float, float]:
    from commopt.comm.compression import FP16Compressor

    state = hooks.AllReduceState(topology=topo, algorithm=algo, compressor=FP16Compressor())
    ref_c = _ddp_run(_mlp, opt, data, state=state)
    got, _ = _odp_run(_mlp, opt, data, topology=topo, algorithm=algo, compressor=FP16Compressor())
    return _maxdiff(ref_c, got), _maxdiff(ref, got)


def _body_accumulation(steps: int, micro: int) -> dict:
    rank = dist.get_rank()
    data = _data(rank, steps, micro)
    out = {}
    for opt in ("sgd", "adamw"):
        ref = _ddp_run(_mlp, opt, data)
        got, odp = _odp_run(_mlp, opt, data, algorithm="flat", replan_every=1, **SMALL)
        out[opt] = (_maxdiff(ref, got), odp.stats()["steps"])
    return out


class _SleepGrad(torch.autograd.Function):
    """Identity whose backward sleeps: a rank whose backward is slow at one point."""

    @staticmethod
    def forward(ctx, x, seconds):
        ctx.seconds = seconds
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        time.sleep(ctx.seconds)
        return grad, None


class _Branches(nn.Module):
    """Two independent branches whose forward order, and hence backward order, depends on the rank."""

    def __init__(self, swap: bool, delay: float):
        super().__init__()
        torch.manual_seed(0)
        self.inp = nn.Linear(8, 16)
        self.a1, self.a2 = nn.Linear(16, 16), nn.Linear(16, 16)
        self.b1, self.b2 = nn.Linear(16, 16), nn.Linear(16, 16)
        self.out = nn.Linear(32, 4)
        self.swap, self.delay = swap, delay
        self.double()

    def forward(self, x):
        h = torch.tanh(self.inp(x))

        def a():
            return self.a2(torch.tanh(self.a1(_SleepGrad.apply(h, self.delay) if self.delay else h)))

        def b():
            return self.b2(torch.tanh(self.b1(h)))

        if self.swap:
            yb = b()
            ya = a()
        else:
            ya = a()
            yb = b()
        return self.out(torch.cat([ya, yb], dim=1))


def _body_order(steps: int) -> dict:
    rank = dist.get_rank()
    # Rank 1 runs branch b first (so b's gradients become ready last there, first on rank 0) and
    # sleeps inside branch a's backward: its buckets become ready in a different order, later.
    make = lambda: _Branches(swap=rank == 1, delay=0.05 if rank == 1 else 0.0)  # noqa: E731
    data = _data(rank, steps)
    ref = _ddp_run(make, "adamw", data)
    got, odp = _odp_run(make, "adamw", data, algorithm="flat", replan_every=1, bucket_cap_mb=2.2e-3,
                        first_bucket_cap_mb=1e-3, partition_mb=5e-4, credit_mb=1e-3)
    ready_orders = [sorted(p.ready, key=p.ready.get) for _, p in odp.profiles]
    plans = {s: [(c.bucket, c.start, c.stop) for c in plan.chunks] for s, plan in odp.plans}
    per_step: dict[int, list] = {}
    for s, b, lo, hi in odp.issue_log:
        per_step.setdefault(s, []).append((b, lo, hi))
    chunk_max = max(c.nbytes for _, plan in odp.plans for c in plan.chunks)
    return {"diff": _maxdiff(ref, got), "log": list(odp.issue_log), "ready": ready_orders, "plans": plans,
            "per_step": per_step, "stats": odp.stats(), "chunk_max": chunk_max}


def _body_unused(steps: int) -> dict:
    rank = dist.get_rank()

    class Partly(nn.Module):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.l1, self.l2, self.never, self.sometimes = (nn.Linear(8, 8), nn.Linear(8, 4), nn.Linear(8, 4),
                                                            nn.Linear(8, 4))
            self.double()

        def forward(self, x):
            y = self.l2(torch.tanh(self.l1(x)))
            return y + self.sometimes(x) if rank == 0 else y

    data = _data(rank, steps)
    ref = _ddp_run(Partly, "sgd", data, find_unused_parameters=True)
    got, _ = _odp_run(Partly, "sgd", data, algorithm="flat", bucket_cap_mb=1e-3, first_bucket_cap_mb=2e-4)
    return {"diff": _maxdiff(ref, got)}


def _body_timeout(timeout: float) -> dict:
    from commopt.comm.errors import CommTimeoutError

    rank = dist.get_rank()
    x = _data(rank, 1)[0][0]
    odp = OverlapDataParallel(_mlp(), _opt("sgd"), algorithm="flat", timeout=timeout)
    out = {"raised": None, "elapsed": None}
    try:
        _loss(odp(x)).backward()  # step 0 on both ranks
        if rank == 0:
            _loss(odp(x)).backward()  # step 1: rank 1 never enters its reduction (yet)
            start = time.perf_counter()
            try:
                odp(x)
            except CommTimeoutError as exc:
                out["raised"] = str(exc)
            out["elapsed"] = time.perf_counter() - start
        dist.barrier()
        if rank == 1:
            _loss(odp(x)).backward()  # now it does: the pending reduction completes on both ranks
        odp.synchronize()
    finally:
        odp.close()
    return out


def _body_autotune() -> dict:
    rank = dist.get_rank()
    x = _data(rank, 1)[0][0]
    lines: list[str] = []
    res = autotune(_mlp(), _opt("sgd"), lambda odp: _loss(odp(x)).backward(), bucket_caps_mb=(5e-4, 25.0),
                   first_bucket_caps_mb=(2e-4, 1.0), partitions_mb=(2.5e-4, 1.0), credit_factors=(1.0, 4.0),
                   steps=1, warmup=1, log=lines.append, algorithm="flat")
    return {"best": res.best, "trials": [c for c, _ in res.trials], "times": [t for _, t in res.trials],
            "lines": len(lines)}


# ------------------------------------------------------------------------------------ tests
def test_matches_ddp_sgd_adamw(ranks):
    """Same parameters as DDP after N steps, both plans, several buckets and chunks, credit bound; an
    FP16 compressor matches DDP with commopt's hook and the same compressor."""
    out = ranks(2, _body_matches_ddp, STEPS, timeout=120)
    for rank_out in out:
        same_hook, vs_exact = rank_out.pop(("sgd", "fp16/flat"))
        assert same_hook <= EXACT and 0 < vs_exact < 1e-2, (same_hook, vs_exact)
        same_hook, vs_exact = rank_out.pop(("adamw", "fp16/flat"))
        assert same_hook <= EXACT and 0 < vs_exact < 1e-2, (same_hook, vs_exact)
        for key, (diff, stats) in rank_out.items():
            assert diff <= EXACT, (key, diff)
            assert stats["steps"] == STEPS
            if stats["credit"]:
                assert stats["max_in_flight"] <= stats["credit"], (key, stats)
            assert stats["buckets"] > 1


def test_algorithms_and_compressor_2x2(ranks):
    """Each algorithm on a 2x2 topology, and an FP16 compressor (hierarchical: only the inter-node
    phase compressed) against DDP with commopt's hook and the same compressor (FAULTS row 11, fp64
    through each algorithm)."""
    out = ranks(4, _body_algorithms, STEPS, timeout=170)
    for rank_out in out:
        for (opt, algo), value in rank_out.items():
            if algo.startswith("fp16"):
                same_hook, vs_exact = value
                # The same compressor on the same tensors: identical arithmetic.
                assert same_hook <= EXACT, (opt, algo, same_hook)
                # and fp16's rounding is visible but bounded against the exact reduction.
                assert 0 < vs_exact < 1e-2, (opt, algo, vs_exact)
            else:
                tol = EXACT if algo == "flat" else REASSOC
                assert value <= tol, (opt, algo, value)
    assert out[0] == out[1] == out[2] == out[3]


def test_gradient_accumulation(ranks):
    """``no_sync`` micro-batches then a synchronising one equal DDP's no_sync (FAULTS row 19)."""
    out = ranks(2, _body_accumulation, 3, 3, timeout=90)
    for rank_out in out:
        for opt, (diff, steps) in rank_out.items():
            assert diff <= EXACT, (opt, diff)
            assert steps == 3  # one reduction per synchronising backward, none under no_sync


def test_issue_order_shared_when_readiness_differs(ranks):
    """The issue order follows the broadcast plan and is identical on both ranks, although rank 1's
    buckets become ready in a different order and later (a sleep in its backward); the bytes in
    flight never exceed the credit; the result still equals DDP."""
    out = ranks(2, _body_order, 4, timeout=90)
    r0, r1 = out
    # The premise: readiness orders differ between the ranks.
    assert any(a != b for a, b in zip(r0["ready"], r1["ready"])), (r0["ready"], r1["ready"])
    assert r0["log"] == r1["log"]
    assert r0["plans"] == r1["plans"]
    for r in out:
        for step, chunks in r["per_step"].items():
            assert chunks == r["plans"][step], step
        credit = r["stats"]["credit"]
        assert credit and r["chunk_max"] <= credit
        assert r["stats"]["max_in_flight"] <= credit
        assert r["diff"] <= EXACT


def test_unused_parameters(ranks):
    """A parameter unused on one rank is averaged with zeros; one unused everywhere stays put under
    SGD, as with DDP(find_unused_parameters=True) (FAULTS row 20)."""
    out = ranks(2, _body_unused, 3, timeout=60)
    for r in out:
        assert r["diff"] <= EXACT


def test_timeout_when_a_rank_does_not_reduce(ranks):
    """A rank that never enters a step's reduction: the other's next forward raises CommTimeoutError
    after the timeout, naming the op and step, instead of hanging (FAULTS row 4); once the late
    rank catches up, both finish cleanly."""
    out = ranks(2, _body_timeout, 1.0, timeout=120)
    assert out[0]["raised"] is not None and "overlap/wait" in out[0]["raised"], out[0]
    assert "step 1" in out[0]["raised"]
    assert out[0]["elapsed"] >= 1.0
    assert out[1]["raised"] is None


def test_autotune_agrees_across_ranks(ranks):
    """Every rank chooses the same configuration from the agreed (slowest-rank) step times."""
    out = ranks(2, _body_autotune, timeout=120)
    assert out[0]["best"] == out[1]["best"]
    assert out[0]["times"] == out[1]["times"]
    assert out[0]["best"] in out[0]["trials"]
    assert out[0]["lines"] == len(out[0]["trials"]) + 1


def test_single_process_equals_plain_training():
    """Without a process group (world size 1) the wrapper is plain training: no communication, the
    same parameters as one optimizer stepping the model (FAULTS row 7)."""
    if dist.is_initialized():
        pytest.skip("needs a process without torch.distributed")
    data = _data(0, STEPS, 2)
    model = _mlp()
    opt = _opt("adamw")(list(model.parameters()))
    for batches in data:
        for x in batches:
            _loss(model(x)).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    ref = [p.detach().clone() for p in model.parameters()]
    got, odp = _odp_run(_mlp, "adamw", data, **SMALL)
    assert _maxdiff(ref, got) <= EXACT
    assert odp.stats()["steps"] == STEPS
