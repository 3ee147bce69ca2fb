"""OverlapDataParallel against DDP, the shared issue order, the credit bound, the autotuner.

Oracles are independent of commopt's scheduler: torch's own ``DistributedDataParallel`` with one
optimizer over the whole model (default reduction, or commopt's DDP hook where a compressor is
involved), trained on the same per-rank data. Everything runs in float64; with 2 ranks an average
is exact in binary (a sum of two values times 0.5), so those cases must agree to 1e-12; the 2x2
hierarchical and leader algorithms sum four values in a different association than DDP's ring,
so they agree to 1e-10 after the steps run (a few ulps per step, amplified by AdamW's division).

Checkpointing is checked against the uninterrupted run itself (bit for bit), with a control that
shows the optimizer state matters; the partition / credit rule against a power-of-two search
written here from the rule's definition, on hand-built and on the broadcast cost models.
"""

from __future__ import annotations

import contextlib
import io
import logging
import math
import time

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from commopt.comm import Topology, cost, hooks
from commopt.comm.cost import CostModel, LinkModel
from commopt.schedules import OverlapDataParallel, autotune
from commopt.schedules.priority import credit_for, partition_for

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


KIB, MIB = 1024, 1024 * 1024


def _rule(link: LinkModel, largest: int) -> tuple[int, int]:
    """The partition / credit rule, written independently: the smallest power of two in
    [2 MiB, 16 MiB] whose latency is at most 10 % of its time (alpha <= 0.1 (alpha + P beta)),
    clamped to the largest bucket; the credit is two chunks or alpha / beta bytes."""
    p = 2 * MIB
    while p < 16 * MIB and link.alpha > 0.1 * (link.alpha + p * link.beta):
        p *= 2
    p = min(p, largest)
    return p, max(2 * p, math.ceil(link.alpha / link.beta))


def _agrees(sizes: tuple[int, int], link: LinkModel, largest: int) -> bool:
    """``sizes`` follow :func:`_rule`; a credit set by the bandwidth-delay product may differ from
    ``ceil(alpha / beta)`` by the one byte its rounding leaves open."""
    p, c = _rule(link, largest)
    return sizes[0] == p and (sizes[1] == c or (c > 2 * p and abs(sizes[1] - c) <= 1))


def _params(odp: OverlapDataParallel) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in odp.module.named_parameters()}


def _train(odp: OverlapDataParallel, data) -> None:
    for batches in data:
        for x in batches:
            _loss(odp(x)).backward()


def _body_checkpoint(n: int, m: int) -> dict:
    rank = dist.get_rank()
    data = _data(rank, n + m)
    # Run A: several buckets and chunks; run B: two buckets, partition and credit from the model.
    caps_a = dict(SMALL)
    caps_b = {"bucket_cap_mb": 25, "first_bucket_cap_mb": 1e-3}
    a = OverlapDataParallel(_mlp(), _opt("adamw"), algorithm="flat", replan_every=2, **caps_a)
    try:
        _train(a, data[:1])
        a.synchronize()
        # What a learning-rate scheduler does between steps: the loaded run must continue with it.
        for opt in a.optimizers:
            for g in opt.param_groups:
                g["lr"] = 3e-3
        _train(a, data[1:n])
        buf = io.BytesIO()
        torch.save({"model": a.module.state_dict(), "optimizer": a.optimizer_state_dict()}, buf)
        _train(a, data[n:])
        a.synchronize()
        ref, buckets_a = _params(a), len(a.buckets.buckets)
    finally:
        a.close()

    def resume(load_optimizer: bool):
        buf.seek(0)
        ckpt = torch.load(buf, weights_only=True)
        model = _mlp()
        with torch.no_grad():
            for p in model.parameters():
                p.add_(1.0)  # a different start: loading the module state must matter too
        b = OverlapDataParallel(model, _opt("adamw"), algorithm="flat", replan_every=2, **caps_b)
        try:
            b.module.load_state_dict(ckpt["model"])
            if load_optimizer:
                b.load_optimizer_state_dict(ckpt["optimizer"])
            _train(b, data[n:])
            b.synchronize()
            return _params(b), len(b.buckets.buckets)
        finally:
            b.close()

    got, buckets_b = resume(True)
    control, _ = resume(False)
    return {"ref": ref, "got": got, "control": control, "buckets": (buckets_a, buckets_b)}


def _wide_mlp(extra: bool = False, hidden: int = 16) -> nn.Module:
    torch.manual_seed(0)
    layers = [nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, hidden), nn.Tanh(), nn.Linear(hidden, 16), nn.Tanh(),
              nn.Linear(16, 4)]
    if extra:
        layers.append(nn.Linear(4, 4))
    return nn.Sequential(*layers).double()


class _Records(logging.Handler):
    def __init__(self):
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def _body_sizes(steps: int) -> dict:
    rank = dist.get_rank()
    g = torch.Generator().manual_seed(7 + rank)
    data = [[torch.randn(4, 256, generator=g)] for _ in range(steps)]

    def model():
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(256, 3072), nn.Tanh(), nn.Linear(3072, 8))  # a ~3 MiB fp32 bucket

    log = logging.getLogger("commopt.schedules.overlap")
    records, old_level = _Records(), log.level
    log.addHandler(records)
    log.setLevel(logging.INFO)
    out = {}
    try:
        # Two nodes of one rank on a 250 Mbit/s link: the inter-node level decides.
        topo = Topology.from_spec("2x1", link_rate_bps=250e6)
        odp = OverlapDataParallel(model(), _opt("sgd"), topology=topo, algorithm="flat", replan_every=100)
        try:
            link = cost.model_for(topo).inter
            largest = max(b.nbytes for b in odp.buckets.buckets)
            out["inter"] = {"link": (link.alpha, link.beta), "largest": largest,
                            "sizes": (odp.partition_bytes, odp.credit_bytes), "stats": odp.stats()}
            for x in data:
                _loss(odp(x[0])).backward()
            odp.synchronize()
            prof0 = dict(odp.profiles)[0]
            fit = prof0.service_fit()
            out["replan"] = {"plans": [(s, p.partition, p.credit) for s, p in odp.plans],
                             "log": list(odp.issue_log), "now": (odp.partition_bytes, odp.credit_bytes),
                             "fit": (fit.alpha, fit.beta), "sizes0": sorted(set(prof0.nbytes)),
                             "separates": prof0.separates_alpha()}
        finally:
            odp.close()
        # One node: the intra-node level decides; a partition given by the user is kept.
        topo1 = Topology.from_spec("1x2")
        odp = OverlapDataParallel(model(), _opt("sgd"), topology=topo1, algorithm="flat", partition_mb=0.25)
        try:
            link = cost.model_for(topo1).intra
            out["intra"] = {"link": (link.alpha, link.beta), "largest": max(b.nbytes for b in odp.buckets.buckets),
                            "sizes": (odp.partition_bytes, odp.credit_bytes)}
        finally:
            odp.close()
    finally:
        log.removeHandler(records)
        log.setLevel(old_level)
    out["logged"] = records.lines
    return out


def _body_auto_2x2(steps: int) -> dict:
    rank = dist.get_rank()
    data = _data(rank, steps)
    ref = _ddp_run(_mlp, "adamw", data)
    got, odp = _odp_run(_mlp, "adamw", data, topology=Topology.from_spec("2x2"), algorithm="auto", replan_every=1,
                        bucket_cap_mb=1.5e-3, first_bucket_cap_mb=5e-4)
    plans = [(s, p.partition, p.credit, [(c.bucket, c.start, c.stop) for c in p.chunks]) for s, p in odp.plans]
    return {"diff": _maxdiff(ref, got), "plans": plans, "log": list(odp.issue_log),
            "largest": max(b.nbytes for b in odp.buckets.buckets)}


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
    phase compressed) against DDP with commopt's hook and the same compressor (docs/faults.md row 11, fp64
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
    """``no_sync`` micro-batches then a synchronising one equal DDP's no_sync (docs/faults.md row 19)."""
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
    SGD, as with DDP(find_unused_parameters=True) (docs/faults.md row 20)."""
    out = ranks(2, _body_unused, 3, timeout=60)
    for r in out:
        assert r["diff"] <= EXACT


def test_timeout_when_a_rank_does_not_reduce(ranks):
    """A rank that never enters a step's reduction: the other's next forward raises CommTimeoutError
    after the timeout, naming the op and step, instead of hanging (docs/faults.md row 4); once the late
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


def _plain_training(data, opt_name: str = "adamw") -> list[torch.Tensor]:
    """The oracle of local training: one optimizer over the whole MLP, one step per list of micro-batches."""
    model = _mlp()
    opt = _opt(opt_name)(list(model.parameters()))
    for batches in data:
        for x in batches:
            _loss(model(x)).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return [p.detach().clone() for p in model.parameters()]


def test_single_process_equals_plain_training():
    """Without a process group (world size 1) the wrapper is plain training: no communication, the
    same parameters as one optimizer stepping the model (docs/faults.md row 7)."""
    if dist.is_initialized():
        pytest.skip("needs a process without torch.distributed")
    data = _data(0, STEPS, 2)
    ref = _plain_training(data)
    got, odp = _odp_run(_mlp, "adamw", data, **SMALL)
    assert _maxdiff(ref, got) <= EXACT
    assert odp.stats()["steps"] == STEPS


def test_module_interface_and_evaluation_between_steps():
    """The wrapper is an ``nn.Module`` as DDP is: ``state_dict()`` holds the model's under ``module.``
    and ``buffers()`` its buffers (its gradient buckets, once stored as ``self._buffers``, shadowed
    nn.Module's buffer registry: both raised, and every attribute store of the wrapper compared the
    name with each bucket). An evaluation forward under ``torch.inference_mode()`` between steps,
    without ``synchronize()``, changes no result: the update it triggers runs as outside inference
    mode (SGD's momentum buffer, created inside it, would be an inference tensor that the next
    steps, outside it, cannot update in place)."""
    if dist.is_initialized():
        pytest.skip("needs a process without torch.distributed")
    model = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4)).double()
    odp = OverlapDataParallel(model, _opt("sgd"))
    try:
        want = {f"module.{k}": v for k, v in model.state_dict().items()}
        got = odp.state_dict()
        assert list(got) == list(want) and all(got[k].data_ptr() == want[k].data_ptr() for k in want)
        assert [id(b) for b in odp.buffers()] == [id(b) for b in model.buffers()] and len(want) == 7
        odp.load_state_dict(got)
    finally:
        odp.close()

    data = _data(0, STEPS)
    ref = _plain_training(data, "sgd")
    odp = OverlapDataParallel(_mlp(), _opt("sgd"), **SMALL)
    try:
        for step, (x,) in enumerate(data):
            _loss(odp(x)).backward()
            if step == 0:  # the first update runs in inference mode, the next ones outside it
                with torch.inference_mode():
                    odp(x)
        odp.synchronize()
        assert _maxdiff(ref, [p.detach() for p in odp.module.parameters()]) <= EXACT
    finally:
        odp.close()


def _body_solo_groups(steps: int) -> dict:
    rank = dist.get_rank()
    solo = [dist.new_group([r]) for r in range(dist.get_world_size())]  # collective: every rank makes each
    data = _data(rank, steps)
    ref = _plain_training(data)
    got, odp = _odp_run(_mlp, "adamw", data, process_group=solo[rank], algorithm="flat", **SMALL)
    return {"diff": _maxdiff(ref, got), "steps": odp.stats()["steps"]}


def test_one_rank_group_in_a_larger_world_trains_locally(ranks):
    """docs/faults.md row 7, a group of size 1: a wrapper over a group of one rank (each rank its own)
    reduces nothing and equals plain local training on that rank's data, although WORLD has two
    ranks (it once reduced its chunks over WORLD)."""
    for r in ranks(2, _body_solo_groups, STEPS, timeout=60):
        assert r["diff"] <= EXACT and r["steps"] == STEPS, r


def test_optimizer_checkpoint_resumes_bit_identical(ranks):
    """Train N steps (AdamW, a learning rate changed as a scheduler would), checkpoint the module and
    the per-bucket optimizers by parameter name through torch.save / torch.load(weights_only=True),
    train M more; a fresh wrapper with other bucket caps that loads the checkpoint and trains the
    same M steps ends bit-identical. Without the optimizer state it does not (the state matters)."""
    out = ranks(2, _body_checkpoint, 3, 3, timeout=120)
    for r in out:
        a, b = r["buckets"]
        assert a != b and a > 2, r["buckets"]  # really a different bucket layout
        assert r["got"].keys() == r["ref"].keys()
        for name, ref in r["ref"].items():
            assert torch.equal(r["got"][name], ref), (name, float((r["got"][name] - ref).abs().max()))
        assert any(not torch.equal(r["control"][k], v) for k, v in r["ref"].items())
    for name in out[0]["ref"]:
        assert torch.equal(out[0]["ref"][name], out[1]["ref"][name])


def test_optimizer_checkpoint_rejects_mismatch():
    """A checkpoint of another model is refused before anything changes, naming the parameter: a
    shape that differs, a parameter the checkpoint lacks, one this model lacks; and a plain
    optimizer's state_dict is refused as such."""
    if dist.is_initialized():
        pytest.skip("needs a process without torch.distributed")
    src = OverlapDataParallel(_wide_mlp(), _opt("adamw"), **SMALL)
    try:
        _train(src, _data(0, 2))
        buf = io.BytesIO()
        torch.save(src.optimizer_state_dict(), buf)
    finally:
        src.close()
    buf.seek(0)
    ckpt = torch.load(buf, weights_only=True)
    assert set(ckpt["shapes"]) == {n for n, _ in _wide_mlp().named_parameters()}

    cases = [(_wide_mlp(hidden=12), r"parameter '2\.weight' has shape \(16, 16\) in the checkpoint but \(12, 16\)"),
             (_wide_mlp(extra=True), r"parameter '7\.(weight|bias)' is not in the checkpoint"),
             (nn.Sequential(*list(_wide_mlp())[:5]).double(), r"checkpoint has parameter '6\.(weight|bias)'")]
    for model, pattern in cases:
        dst = OverlapDataParallel(model, _opt("adamw"), **SMALL)
        try:
            _train(dst, [[torch.randn(6, 8, dtype=torch.float64)]])  # some state that must survive
            dst.synchronize()
            before = [{k: {n: v.clone() for n, v in st.items()} for k, st in o.state.items()} for o in dst.optimizers]
            assert any(before)
            lrs = [[g["lr"] for g in o.param_groups] for o in dst.optimizers]
            with pytest.raises(ValueError, match=pattern):
                dst.load_optimizer_state_dict(ckpt)
            after = [{k: dict(st) for k, st in o.state.items()} for o in dst.optimizers]
            assert [[g["lr"] for g in o.param_groups] for o in dst.optimizers] == lrs
            for old, new in zip(before, after):
                assert old.keys() == new.keys()
                for k in old:
                    assert all(torch.equal(old[k][n], new[k][n]) for n in old[k])
        finally:
            dst.close()
    plain = torch.optim.AdamW(_wide_mlp().parameters())
    dst = OverlapDataParallel(_wide_mlp(), _opt("adamw"))
    try:
        with pytest.raises(ValueError, match="not a checkpoint of"):
            dst.load_optimizer_state_dict(plain.state_dict())
    finally:
        dst.close()


def test_partition_credit_rule():
    """The rule on hand-built cost models: latency at most 10 % of a chunk's time, power of two,
    [2 MiB, 16 MiB], the largest bucket; credit two chunks or the bandwidth-delay product."""
    intra = LinkModel(alpha=20e-6, beta=1 / 3e9)
    slow = CostModel(intra, LinkModel(alpha=0.5e-3, beta=8 / 250e6))  # 250 Mbit/s, 0.5 ms
    fast = CostModel(intra, LinkModel(alpha=10e-6, beta=8 / 400e9))  # 400 Gbit/s, 10 us
    ten = CostModel(intra, LinkModel(alpha=50e-6, beta=8 / 10e9))  # 10 Gbit/s, 50 us
    # 9 alpha / beta = 140625 B -> the 2 MiB floor; credit 2 x 2 MiB > alpha / beta = 15625 B.
    assert partition_for(slow.inter) == 2 * MIB
    assert credit_for(slow.inter, 2 * MIB) == 4 * MIB
    # 9 alpha / beta = 4.5 MB -> 8 MiB; credit 16 MiB > 500 kB.
    assert partition_for(fast.inter) == 8 * MIB
    assert credit_for(fast.inter, 8 * MIB) == 16 * MIB
    assert partition_for(ten.inter) == 2 * MIB  # 562.5 kB -> 2 MiB
    for link in (slow.inter, fast.inter, ten.inter, intra, LinkModel(1e-4, 1e-9), LinkModel(3e-5, 8 / 100e9)):
        p = partition_for(link)
        assert (p, credit_for(link, p)) == _rule(link, 1 << 40), link
        if 2 * MIB < p < 16 * MIB:  # unclamped: the smallest power of two that meets the bound
            assert link.alpha <= 0.1 * link.time(p) and link.alpha > 0.1 * link.time(p // 2)
        for largest in (100_000, 300 * KIB, 64 * MIB):  # the largest bucket clamps last
            assert partition_for(link, largest_bucket=largest) == _rule(link, largest)[0]
    # Clamps: no latency -> the floor; a huge latency -> the ceiling, and then the bandwidth-delay
    # product (10 ms at 400 Gbit/s: 500 MB) is the credit.
    assert partition_for(LinkModel(0.0, 1e-9)) == 2 * MIB
    far = LinkModel(alpha=10e-3, beta=8 / 400e9)
    assert partition_for(far) == 16 * MIB
    assert credit_for(far, 16 * MIB) == 500_000_000
    # A bound met exactly by a power of two keeps it (no float noise pushes it to the next one).
    assert partition_for(LinkModel(alpha=(2 * MIB) / 9 * 1e-9, beta=1e-9)) == 2 * MIB
    with pytest.raises(ValueError):
        partition_for(slow.inter, latency_share=0.0)


def test_service_fit_reads_shared_link_from_busy_periods():
    """Re-planning reads the link from a step's chunks. Two chunks in flight share the link (the
    smaller one finishes first), and a chunk alone also waits for the slowest rank to issue it;
    the oracle is the link that produced the timings (a per-chunk fit read 175-300 Mbit/s off a
    478 Mbit/s link and planned idle gaps into every step)."""
    from commopt.schedules.overlap import StepProfile

    alpha, beta, skew = 0.2e-3, 8 / 478e6, 5e-3
    prof, t = StepProfile(), 0.0

    def add(issued: float, done: float, n: int) -> None:
        prof.issued.append(issued)
        prof.done.append(done)
        prof.nbytes.append(n)

    add(t, t + skew + alpha + 595_200 * beta, 595_200)  # alone: waits for the peer first
    for _ in range(4):  # pairs on two streams, processor-shared: the smaller finishes first
        t += 0.05
        a, b = 1 << 20, 730_880
        add(t, t + alpha + (a + b) * beta, a)
        add(t, t + alpha + 2 * b * beta, b)
    t += 0.05
    free = t  # a backlog: 18 chunks back to back
    for k in range(18):
        n = (1 << 20) if k % 2 == 0 else 730_880
        free += alpha + n * beta
        add(t, free, n)
    periods = prof.busy_periods()
    assert [k for _, _, k in periods] == [1, 2, 2, 2, 2, 18]
    assert sum(n for _, n, _ in periods) == sum(prof.nbytes)
    assert prof.separates_alpha()
    fit = prof.service_fit()
    assert fit.beta == pytest.approx(beta, rel=0.03), 8 / fit.beta / 1e6
    assert 0.0 <= fit.alpha <= skew
    # Half the periods single chunks that waited for a slow rank: still not read as latency (a
    # 5 ms alpha makes the re-plan keep 1.8 MB buckets whole).
    for _ in range(4):
        t = free + 0.05
        free = t + skew + alpha + (1 << 20) * beta
        add(t, free, 1 << 20)
    fit = prof.service_fit()
    assert fit.beta == pytest.approx(beta, rel=0.05), 8 / fit.beta / 1e6
    assert fit.alpha < 1e-3, fit.alpha
    # One chunk size throughout: latency and bandwidth cannot be told apart -> alpha 0, mean beta.
    same = StepProfile(issued=[0.0, 1.0], done=[0.01, 1.01], nbytes=[1000, 1000])
    assert not same.separates_alpha()
    assert same.service_fit() == LinkModel(alpha=0.0, beta=pytest.approx(0.02 / 2000))
    assert StepProfile().service_fit() is None


def test_partition_credit_from_model_agree_across_ranks(ranks):
    """Without partition_mb / credit_mb the sizes follow the rule on the broadcast cost model (the
    inter-node level on two nodes, the intra-node one on one node), identically on every rank; the
    re-plan applies the rule to rank 0's fit of its profile and broadcasts it; the choice is logged."""
    out = ranks(2, _body_sizes, 3, timeout=120)
    r0, r1 = out
    for key in ("inter", "intra"):
        assert r0[key]["link"] == r1[key]["link"]  # the model is rank 0's, broadcast
        assert r0[key]["sizes"] == r1[key]["sizes"]
    inter = r0["inter"]
    assert inter["largest"] > 2 * MIB  # the rule, not the bucket clamp, decides
    assert _agrees(inter["sizes"], LinkModel(*inter["link"]), inter["largest"]), inter
    assert inter["stats"]["chunks"] >= 2
    intra = r0["intra"]
    assert intra["sizes"] == (256 * KIB, _rule(LinkModel(*intra["link"]), 256 * KIB)[1])
    # Re-plan at step 1 from rank 0's step-0 fit (chunks of two sizes were measured), shared by all.
    rp0, rp1 = r0["replan"], r1["replan"]
    assert rp0["plans"] == rp1["plans"] and rp0["log"] == rp1["log"] and rp0["now"] == rp1["now"]
    assert len(rp0["sizes0"]) >= 2
    assert [s for s, _, _ in rp0["plans"]] == [0, 1, 2]
    assert rp0["plans"][1][1:] == rp0["plans"][2][1:] == rp0["now"]
    if rp0["separates"] and rp0["fit"][1] > 1e-15:
        assert _agrees(rp0["now"], LinkModel(*rp0["fit"]), inter["largest"]), (rp0["now"], rp0["fit"])
    else:  # one chunk size per busy period, or no per-byte cost (noise): the model's numbers stay
        assert rp0["now"] == inter["sizes"], (rp0["now"], rp0["fit"])
    assert rp0["plans"][0] == (0, *inter["sizes"])
    assert any("partition" in line and "cost model" in line for line in r0["logged"]), r0["logged"]


def test_model_sizes_auto_2x2(ranks):
    """Partition and credit left to the model and re-planned every step, under ``auto`` on 2x2
    (candidate algorithms' groups made at construction): every rank follows the same plans, and the
    result equals DDP."""
    out = ranks(4, _body_auto_2x2, STEPS, timeout=120)
    for r in out:
        assert r["diff"] <= REASSOC, r["diff"]
        assert r["plans"] == out[0]["plans"] and r["log"] == out[0]["log"]
        # The model is far below 256 KiB: the largest bucket clamps the partition, buckets stay whole.
        assert all(part == r["largest"] and credit >= 2 * part for _, part, credit, _ in r["plans"])
