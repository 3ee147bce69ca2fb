"""DiLoCo (issue 26): ``commopt.schedules.DiLoCo`` against independent oracles.

- Oracle 1: inner SGD, ``sync_every=1``, outer SGD with lr 1 and no momentum, exact: the parameters of
  data-parallel SGD over the whole world, the average gradient computed here with plain
  ``torch.distributed`` (2x2 with DDP inside each worker, 1x4 (one worker), 4x1, 2x2 with FSDP2 inside).
- Oracle 2: every worker fed the same data: one model trained alone, followed by Nesterov's outer update
  written out in the test.
- Streaming: each fragment adopts, ``delay`` steps after its turn, the workers' mean of the local weights
  of its turn, mixed with ``alpha``; the other fragments are untouched.
- Compression: int8 stays within its quantization bound of the exact run; top-k with error feedback
  conserves what it is given (fp64: sum of pseudo-gradients = applied + residuals).
- Checkpoint: a round trip mid-run (a reduction in flight; one-rank workers, and FSDP2 inside 2x2
  workers) continues bit for bit, loaded with ``weights_only=True``; another worker layout is a
  ValueError. NaN: ``NonFiniteError`` on every rank, nothing applied. A late worker: ``CommTimeoutError``
  within the timeout. Bad arguments: TypeError / ValueError before anything moves.
docs/faults.md row 40.
"""

from __future__ import annotations

import io
import json
import math
import subprocess
import sys
import time
import warnings

import pytest
import torch
import torch.distributed as dist
from torch import nn

from commopt.bench.models import GPT
from commopt.comm import Topology
from commopt.comm import compression as C
from commopt.comm.errors import CommTimeoutError, NonFiniteError
from commopt.schedules import DiLoCo, worker_group


class _Net(nn.Module):
    """Rows that do not divide by 2 or 4 (padded pieces), and, optionally, a scalar parameter."""

    def __init__(self, scalar: bool = True) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(5, 7), nn.Linear(7, 3)
        self.scale = nn.Parameter(torch.tensor(1.25)) if scalar else None

    def forward(self, x):
        y = self.fc2(torch.tanh(self.fc1(x)))
        return y * self.scale if self.scale is not None else y


def _model(scalar: bool = True, dtype=torch.float32, seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return _Net(scalar).to(dtype)


def _data(rank: int, step: int, dtype=torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + rank)
    x = torch.randn(6, 5, generator=g, dtype=dtype)
    return x, torch.stack([x[:, 0] * x[:, 1], torch.sin(x[:, 2]), x[:, 3]], dim=1)


def _inner_step(model, opt, rank: int, step: int, dtype=torch.float32) -> None:
    x, y = _data(rank, step, dtype)
    opt.zero_grad()
    nn.functional.mse_loss(model(x), y).backward()
    opt.step()


def _params(model: nn.Module) -> dict[str, torch.Tensor]:
    """Full parameters (DTensors gathered), by name without DDP's ``module.`` prefix."""
    out = {}
    for n, p in model.named_parameters():
        t = p.full_tensor() if hasattr(p, "full_tensor") else p
        out[n.removeprefix("module.")] = t.detach().clone()
    return out


def _global(d: DiLoCo) -> dict[str, torch.Tensor]:
    """``d.global_state_dict()`` as whole tensors (DTensors gathered), by name without ``module.``."""
    return {k.removeprefix("module."): (v.full_tensor() if hasattr(v, "full_tensor") else v)
            for k, v in d.global_state_dict().items()}


def _same_on_every_rank(tensors: dict[str, torch.Tensor]) -> None:
    for n, t in tensors.items():
        parts = [torch.empty_like(t) for _ in range(dist.get_world_size())]
        dist.all_gather(parts, t.contiguous())
        assert all(torch.equal(q, t) for q in parts), f"{n} differs between ranks"


def _mean_over_ranks(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The mean of every rank's tensors (plain torch.distributed): the workers' mean where the ranks of a
    worker hold the same weights (DDP, FSDP2's full tensors)."""
    out = {}
    for n, t in tensors.items():
        total = t.clone()
        dist.all_reduce(total)
        out[n] = total / dist.get_world_size()
    return out


def _close(a: dict, b: dict, what: str, rtol: float = 1e-5, atol: float = 1e-6) -> None:
    assert a.keys() == b.keys(), what
    for k in a:
        assert torch.allclose(a[k], b[k], rtol=rtol, atol=atol), (
            f"{what}: {k} differs by {float((a[k] - b[k]).abs().max()):.3g}")


# --------------------------------------------------------------------------------- world of 4
def _ddp_oracle(steps: int, lr: float, scalar: bool) -> dict[str, torch.Tensor]:
    """SGD on the average gradient of every rank's batch (plain torch.distributed)."""
    model = _model(scalar)
    world = dist.get_world_size()
    for step in range(steps):
        model.zero_grad()
        x, y = _data(dist.get_rank(), step)
        nn.functional.mse_loss(model(x), y).backward()
        with torch.no_grad():
            for p in model.parameters():
                dist.all_reduce(p.grad)
                p -= lr * p.grad / world
    return _params(model)


def _oracle_case(case: str, steps: int, lr: float) -> dict[str, torch.Tensor]:
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import fully_shard
    from torch.nn.parallel import DistributedDataParallel as DDP

    spec, inner = case.split("-")
    topo = Topology.from_spec(spec)
    wg = worker_group(topo)
    model = _model(scalar=inner != "fsdp")
    if inner == "ddp":
        model = DDP(model, process_group=wg)
    elif inner == "fsdp":
        fully_shard(model, mesh=DeviceMesh.from_group(wg, "cpu"))
    else:
        assert wg is None  # one rank per worker: nothing to wrap
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    d = DiLoCo(model, opt, outer_optimizer=lambda ps: torch.optim.SGD(ps, lr=1.0), sync_every=1, topology=topo)
    assert d.worker_group is wg and d.num_workers == topo.num_nodes
    for step in range(steps):
        _inner_step(model, opt, dist.get_rank(), step)
        d.step()
    return _params(model)


def _body_world4() -> None:
    steps, lr = 3, 0.1
    for case in ("2x2-ddp", "1x4-ddp", "4x1-none", "2x2-fsdp"):
        got = _oracle_case(case, steps, lr)
        want = _ddp_oracle(steps, lr, scalar=not case.endswith("fsdp"))
        _close(got, want, case)
    _int8_within_bound(Topology.from_spec("2x2"), ddp=True)
    # Sharded pieces in a checkpoint; a world of another size (4x1, no FSDP) refuses it.
    saved = _checkpoint_round_trip("2x2-fsdp")
    m = _model(scalar=False)
    other = DiLoCo(m, torch.optim.SGD(m.parameters(), lr=0.1), sync_every=2, fragments=2, delay=1, alpha=0.25,
                   compressor=C.TopKCompressor(ratio=0.4), topology=Topology.from_spec("4x1"))
    with pytest.raises(ValueError, match="workers"):
        other.load_state_dict(torch.load(io.BytesIO(saved), weights_only=True)["diloco"])
    # DDP inside the workers with delay 2: streaming's oracle, a checkpoint taken between a fragment's
    # outer step and its adoption, and NaN raised at the early outer step on every rank.
    _streaming_body("2x2")
    _checkpoint_round_trip("2x2-ddp")
    _nonfinite_early()
    # Unequal workers cannot pair up along rails: a clear error on every rank, before any group.
    m = _model()
    with pytest.raises(ValueError, match="unequal"):
        DiLoCo(m, torch.optim.SGD(m.parameters(), lr=0.1), workers=[[0, 1, 2], [3]])
    with pytest.raises(ValueError, match="unequal"):
        DiLoCo(m, torch.optim.SGD(m.parameters(), lr=0.1), topology=Topology.from_spec("3+1"))


def test_four_ranks_data_parallel_oracle_int8_and_sharded_checkpoint(ranks):
    """Oracle 1 on 2x2 (DDP inside each worker), 1x4, 4x1 and 2x2 with FSDP2 inside; int8 on 2x2 with DDP;
    a checkpoint round trip with FSDP2 inside (sharded pieces) and a 4x1 world refusing it; streaming with
    DDP inside and delay 2 (the outer step a step early): its oracle, a checkpoint between outer step and
    adoption, NaN at the early outer step; unequal workers."""
    ranks(4, _body_world4, timeout=120)


# --------------------------------------------------------------------------------- world of 2
def _same_data_body() -> None:
    """Oracle 2: with the same data everywhere, DiLoCo = one model alone + Nesterov outer steps."""
    rank = dist.get_rank()
    H, rounds, lr_out, mom = 3, 2, 0.7, 0.9
    model = _model()
    opt = torch.optim.Adam(model.parameters(), lr=0.05)
    d = DiLoCo(model, opt, sync_every=H, workers=[[0], [1]])  # default outer: Nesterov SGD(0.7, 0.9)
    alone = _model()
    alone_opt = torch.optim.Adam(alone.parameters(), lr=0.05)
    glob = {n: p.detach().clone() for n, p in alone.named_parameters()}
    buf = {}
    for r in range(rounds):
        for s in range(H):
            _inner_step(model, opt, 0, r * H + s)  # rank 0's data on every rank
            d.step()
            _inner_step(alone, alone_opt, 0, r * H + s)
        with torch.no_grad():
            for n, p in alone.named_parameters():
                g = glob[n] - p
                buf[n] = g.clone() if n not in buf else mom * buf[n] + g
                glob[n] = glob[n] - lr_out * (g + mom * buf[n])
                p.copy_(glob[n])
    _close(_params(model), _params(alone), f"same data, rank {rank}")
    # finalize() right after a sync has nothing left to sync: no outer step (with momentum, one on a zero
    # pseudo-gradient would still move the weights). One inner step later: one more Nesterov step.
    d.finalize()
    _close(_params(model), _params(alone), f"finalize at a sync, rank {rank}")
    _inner_step(model, opt, 0, rounds * H)
    _inner_step(alone, alone_opt, 0, rounds * H)
    d.finalize()
    with torch.no_grad():
        for n, p in alone.named_parameters():
            g = glob[n] - p
            buf[n] = mom * buf[n] + g
            p.copy_(glob[n] - lr_out * (g + mom * buf[n]))
    _close(_params(model), _params(alone), f"finalize after an inner step, rank {rank}")
    _close(_global(d), _params(alone), f"global_state_dict after finalize, rank {rank}")


def _streaming_body(layout: str = "2x1") -> None:
    """Each fragment, ``delay`` steps after its turn, adopts (1-alpha) * mean of the workers' local
    weights at its turn + alpha * its current local weights; the others are untouched at every step.
    ``layout``: two one-rank workers, delay 1; one worker of two ranks with FSDP2 inside ("1x2-fsdp"),
    delay 1; or 2x2 with DDP inside each worker, delay 2 (the outer step runs a step early and the
    worker's all-gather of the new pieces overlaps the last inner step).

    The global model (``global_state_dict()``) at every step: with outer SGD(lr=1), each fragment's
    global weights are the workers' mean at its last issue whose outer step ran, the same on every rank,
    while the model's own weights differ from them between syncs. ``finalize()`` at the end: the model
    holds the workers' mean of every fragment (FAULTS.md row 40's streamed state, the global model)."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import fully_shard
    from torch.nn.parallel import DistributedDataParallel as DDP

    rank, world = dist.get_rank(), dist.get_world_size()
    model = _model(scalar=layout != "1x2-fsdp")
    if layout == "2x1":
        H, F, delay, alpha, where = 2, 2, 1, 0.3, {"workers": [[0], [1]]}
        net = model
    elif layout == "1x2-fsdp":
        H, F, delay, alpha, where = 2, 2, 1, 0.3, {"workers": [[0, 1]]}
        fully_shard(model, mesh=DeviceMesh.from_group(worker_group(**where), "cpu"))
        net = model
    else:
        H, F, delay, alpha, where = 4, 2, 2, 0.3, {"topology": Topology.from_spec(layout)}
        net = DDP(model, process_group=worker_group(**where))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    d = DiLoCo(net, opt, outer_optimizer=lambda ps: torch.optim.SGD(ps, lr=1.0), sync_every=H, fragments=F,
               delay=delay, alpha=alpha, **where)
    names = [n for n, _ in model.named_parameters()]
    assert sorted(n.removeprefix("module.") for f in d.fragments for n in f) == sorted(names)
    assert set(d.global_state_dict()) == set(net.state_dict())
    assert len(d.fragments) == F
    frag_of = {n.removeprefix("module."): f for f, frag in enumerate(d.fragments) for n in frag}
    early = 1 if layout == "2x2" else 0  # the outer step a step before the adoption (DDP inside, delay 2)
    glob, differs = _params(model), False
    means = {}
    for t in range(1, 4 * H + 1):
        _inner_step(net, opt, rank, t)
        before = _params(model)
        gathered = {}
        for n, p in before.items():
            parts = [torch.empty_like(p) for _ in range(world)]
            dist.all_gather(parts, p)
            gathered[n] = torch.stack(parts).mean(0)
        means[t] = gathered
        d.step()
        after = _params(model)
        for n in names:
            f = frag_of[n]
            issued = t - delay
            if issued >= 1 and issued % H == (f * H) // F:
                want = (1 - alpha) * means[issued][n] + alpha * before[n]
                assert torch.allclose(after[n], want, rtol=1e-5, atol=1e-6), (t, n)
            else:
                assert torch.equal(after[n], before[n]), (t, n)
            ran = t - delay + early  # the issue whose outer step ran at this step
            if ran >= 1 and ran % H == (f * H) // F:
                glob[n] = means[ran][n]
        got = _global(d)
        assert got.keys() == glob.keys(), (sorted(got), sorted(glob))
        _close(got, glob, f"global_state_dict at step {t}")
        _same_on_every_rank(got)
        differs = differs or any(not torch.equal(after[n], glob[n]) for n in names)
    assert differs, "streamed training: the model's weights should differ from the global ones between syncs"
    mean = _mean_over_ranks(_params(model))
    d.finalize()
    _close(_params(model), mean, f"{layout}: finalize() is the workers' mean")
    _close(_global(d), _params(model), f"{layout}: the global model after finalize()", rtol=0, atol=0)
    _same_on_every_rank(_params(model))
    if layout != "2x1":
        return
    # One fragment and no delay is plain DiLoCo: the explicit one-fragment schedule gives the same bits.
    runs = []
    for fragments in (1, [names]):
        m = _model()
        o = torch.optim.SGD(m.parameters(), lr=0.1)
        dd = DiLoCo(m, o, sync_every=2, fragments=fragments, workers=[[0], [1]])
        for t in range(4):
            _inner_step(m, o, rank, t)
            dd.step()
        runs.append(_params(m))
    for n in names:
        assert torch.equal(runs[0][n], runs[1][n]), n


def _finalize_cases(layout: str, cases: list[tuple[int, float, int]]) -> None:
    """``finalize()`` after S inner steps, for each ``(delay, alpha, S)``, against the workers' mean of
    their local weights at the call (outer SGD(lr=1), no momentum, exact: every inner step in the final
    weights). H 4, 2 fragments (syncs at steps 4, 8 and 2, 6): S falls before any sync, on a reduction
    issued at this step or a step before (in flight: FAULTS.md row 40's streamed state; with DDP inside
    and delay 2, its outer step already ran), on an adoption, between syncs. Every rank then holds the
    same model, equal to ``global_state_dict()``; training goes on (a step, then finalize again)."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    rank = dist.get_rank()

    def check(model, d, case: str) -> None:
        mean = _mean_over_ranks(_params(model))
        d.finalize()
        assert not d._pending, case
        _close(_params(model), mean, f"{case}: finalize() is the workers' mean")
        _close(_global(d), _params(model), f"{case}: global_state_dict()", rtol=0, atol=0)
        _same_on_every_rank(_params(model))

    for delay, alpha, stop in cases:
        model = _model()
        where = {"workers": [[0], [1]]} if layout == "2x1" else {"topology": Topology.from_spec(layout)}
        net = model if layout == "2x1" else DDP(model, process_group=worker_group(**where))
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        d = DiLoCo(net, opt, outer_optimizer=lambda ps: torch.optim.SGD(ps, lr=1.0), sync_every=4, fragments=2,
                   delay=delay, alpha=alpha, **where)
        for t in range(stop):
            _inner_step(net, opt, rank, t)
            d.step()
        case = f"{layout} delay={delay} alpha={alpha} S={stop}"
        if layout != "2x1" and delay == 2 and stop % 4 == 3:
            assert any(p.stepped for p in d._pending), f"{case}: meant to finalize after an early outer step"
        check(model, d, case)
        _inner_step(net, opt, rank, stop)
        d.step()
        check(model, d, f"{case}, then one step more")


def _no_future_warning_body() -> None:
    """commopt's own calls print no FutureWarning (torch 2.13 deprecates ``all_gather_into_tensor``, which
    the adoption's all-gather inside a worker of several ranks used): one worker of two ranks with DDP
    inside, streamed, through global_state_dict() and finalize() too."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    rank, where = dist.get_rank(), {"workers": [[0, 1]]}
    model = _model()
    net = DDP(model, process_group=worker_group(**where))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        d = DiLoCo(net, opt, sync_every=2, fragments=2, delay=1, **where)
        for t in range(4):
            _inner_step(net, opt, rank, t)
            d.step()
        d.global_state_dict()
        d.finalize()
    future = [f"{w.filename}:{w.lineno}: {w.message}" for w in caught if issubclass(w.category, FutureWarning)]
    assert not future, future


def _int8_within_bound(topo: Topology, ddp: bool) -> None:
    """int8 outer gradients stay within their quantization bound of the exact run, and differ from it."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    rank = dist.get_rank()
    H, rounds = 2, 3
    finals, bound = {}, 0.0
    for name, comp in (("exact", None), ("int8", C.QuantizeCompressor(8))):
        model = _model()
        if ddp:
            model = DDP(model, process_group=worker_group(topo))
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        d = DiLoCo(model, opt, outer_optimizer=lambda ps: torch.optim.SGD(ps, lr=1.0), sync_every=H,
                   compressor=comp, topology=topo)
        glob = _params(model)
        for t in range(H * rounds):
            _inner_step(model, opt, rank, t)
            if name == "exact" and (t + 1) % H == 0:
                local = _params(model)
                amax = torch.tensor([max(float((glob[n] - local[n]).abs().max()) for n in glob)])
                dist.all_reduce(amax, op=dist.ReduceOp.MAX)
                bound += float(amax) / 127 * 2  # a quantization step per block, every worker's share
            d.step()
            if (t + 1) % H == 0:
                glob = _params(model)
        finals[name] = _params(model)
    diff = max(float((finals["int8"][n] - finals["exact"][n]).abs().max()) for n in finals["exact"])
    assert 0 < diff <= 2 * bound, (topo, diff, bound)


def _compressed_body() -> None:
    """int8 within its quantization bound of the exact run; top-k + error feedback conserves (fp64)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    H, rounds = 2, 3
    _int8_within_bound(Topology.from_spec("2x1"), ddp=False)

    # Conservation: sum over workers and syncs of the pseudo-gradients = n * applied + residuals.
    model = _model(dtype=torch.float64)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    d = DiLoCo(model, opt, outer_optimizer=lambda ps: torch.optim.SGD(ps, lr=1.0), sync_every=H,
               compressor=C.TopKCompressor(ratio=0.3), workers=[[0], [1]])
    sent = {n: torch.zeros_like(p) for n, p in model.named_parameters()}
    applied = {n: torch.zeros_like(p) for n, p in model.named_parameters()}
    glob = {n: p.detach().clone() for n, p in model.named_parameters()}
    for t in range(H * rounds):
        _inner_step(model, opt, rank, t, torch.float64)
        if (t + 1) % H == 0:
            for n, p in model.named_parameters():
                sent[n] += glob[n] - p.detach()
        d.step()
        if (t + 1) % H == 0:
            for n, p in model.named_parameters():
                applied[n] += glob[n] - p.detach()
                glob[n] = p.detach().clone()
    residuals = d.error_feedback.residuals["worker"]
    assert set(residuals) == set(sent) and any(float(r.abs().max()) > 0 for r in residuals.values())
    for n in sent:
        total = sent[n].clone()
        dist.all_reduce(total)
        kept = residuals[n].reshape(sent[n].shape).clone()
        dist.all_reduce(kept)
        assert torch.allclose(world * applied[n] + kept, total, rtol=1e-12, atol=1e-12), n


def _local(p: torch.Tensor) -> torch.Tensor:
    return p.to_local() if hasattr(p, "to_local") else p


def _run_for_checkpoint(layout: str, stop: int | None, total: int, saved: bytes | None):
    """Train ``total`` steps; with ``stop``: return the checkpoint taken after that step (a reduction in
    flight); with ``saved``: a fresh model, optimizer and DiLoCo resume from it. ``layout``: two one-rank
    workers with inner Adam, 2x2 with FSDP2 inside each worker (sharded pieces), or 2x2 with DDP inside
    and delay 2 (gathered pieces; the outer step a step before the adoption)."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import fully_shard
    from torch.nn.parallel import DistributedDataParallel as DDP

    rank = dist.get_rank()
    fsdp, ddp = layout == "2x2-fsdp", layout == "2x2-ddp"
    model = _model(scalar=not fsdp, seed=0 if saved is None else 7)  # a fresh model unlike the saved one
    where = {"topology": Topology.from_spec("2x2")} if fsdp or ddp else {"workers": [[0], [1]]}
    if fsdp:
        fully_shard(model, mesh=DeviceMesh.from_group(worker_group(**where), "cpu"))
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
    else:
        opt = torch.optim.Adam(model.parameters(), lr=0.05)
    # 2x2-ddp: delay 2, so that the checkpoint after step 5 holds fragment 0 stepped but not yet adopted.
    sync_every, delay = (4, 2) if ddp else (2, 1)
    net = DDP(model, process_group=worker_group(**where)) if ddp else model
    d = DiLoCo(net, opt, sync_every=sync_every, fragments=2, delay=delay, alpha=0.25,
               compressor=C.TopKCompressor(ratio=0.4), **where)
    start = 0
    if saved is not None:
        state = torch.load(io.BytesIO(saved), weights_only=True)
        with torch.no_grad():
            for n, p in model.named_parameters():
                _local(p).copy_(state["model"][n])
        opt.load_state_dict(state["inner"])
        d.load_state_dict(state["diloco"])
        start = d.steps
    for t in range(start, total):
        _inner_step(net, opt, rank, t)
        d.step()
        if stop is not None and t + 1 == stop:
            assert d._pending, "the checkpoint is meant to hold a reduction in flight"
            assert any(p.stepped for p in d._pending) == ddp, "2x2-ddp: an outer step taken, its adoption due"
            buf = io.BytesIO()
            local = {n: _local(p).detach().clone() for n, p in model.named_parameters()}
            torch.save({"model": local, "inner": opt.state_dict(), "diloco": d.state_dict()}, buf)
            return buf.getvalue()
    d.synchronize()
    return {n: _local(p).detach().clone() for n, p in model.named_parameters()}, dict(d.backups)


def _checkpoint_round_trip(layout: str) -> bytes:
    """A checkpoint mid-run continues bit for bit; returns the checkpoint."""
    total = 12 if layout == "2x2-ddp" else 8
    want, want_backups = _run_for_checkpoint(layout, None, total, None)
    saved = _run_for_checkpoint(layout, 5, total, None)
    got, got_backups = _run_for_checkpoint(layout, None, total, saved)
    for n in want:
        assert torch.equal(got[n], want[n]), (layout, n)
    for n in want_backups:
        assert torch.equal(got_backups[n], want_backups[n]), (layout, n)
    return saved


def _checkpoint_body() -> None:
    saved = _checkpoint_round_trip("2x1")
    # Another worker layout (one worker of two ranks) is a clear error.
    state = torch.load(io.BytesIO(saved), weights_only=True)["diloco"]
    m = _model()
    other = DiLoCo(m, torch.optim.SGD(m.parameters(), lr=0.1), sync_every=2, fragments=2, delay=1,
                   compressor=C.TopKCompressor(ratio=0.4), workers=[[0, 1]])
    with pytest.raises(ValueError, match="workers"):
        other.load_state_dict(state)
    # Outer state of another optimizer type (a KeyError inside torch) or a partial dict: a ValueError, nothing loaded.
    m = _model()
    adam = DiLoCo(m, torch.optim.SGD(m.parameters(), lr=0.1), outer_optimizer=lambda ps: torch.optim.Adam(ps),
                  sync_every=2, fragments=2, delay=1, compressor=C.TopKCompressor(ratio=0.4), workers=[[0], [1]])
    backups = {n: b.clone() for n, b in adam.backups.items()}
    with pytest.raises(ValueError, match="outer_optimizer"):
        adam.load_state_dict(state)
    assert all(not o.state and isinstance(o, torch.optim.Adam) for o in adam.outer_optimizers)
    assert all(torch.equal(b, backups[n]) for n, b in adam.backups.items()) and adam.steps == 0
    with pytest.raises(ValueError, match="missing"):
        adam.load_state_dict({"meta": state["meta"]})


def _nonfinite_body() -> None:
    """NaN in one worker's weights: NonFiniteError on every rank, nothing applied."""
    rank = dist.get_rank()
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    d = DiLoCo(model, opt, sync_every=2, workers=[[0], [1]])
    _inner_step(model, opt, rank, 0)
    d.step()
    if rank == 1:
        with torch.no_grad():
            model.fc1.weight[0, 0] = float("nan")
    _inner_step(model, opt, rank, 1)
    backups = {n: b.clone() for n, b in d.backups.items()}
    with pytest.raises(NonFiniteError):
        d.step()
    for n, b in d.backups.items():
        assert torch.equal(b, backups[n]), n
    assert not d.outer_optimizers[0].state  # the outer optimizer never stepped


def _nonfinite_early() -> None:
    """2x2 with DDP inside, delay 2: the outer step runs one inner step before the adoption, and NaN in
    one worker's weights raises NonFiniteError there, on every rank, with nothing applied."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    rank, topo = dist.get_rank(), Topology.from_spec("2x2")
    model = DDP(_model(), process_group=worker_group(topo))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    d = DiLoCo(model, opt, sync_every=4, delay=2, topology=topo)
    for t in range(4):  # issued after step 4, due at step 6: the outer step at step 5
        if t == 3 and rank >= 2:
            with torch.no_grad():
                model.module.fc1.weight[0, 0] = float("nan")
        _inner_step(model, opt, rank, t)
        d.step()
    _inner_step(model, opt, rank, 4)
    backups = {n: b.clone() for n, b in d.backups.items()}
    with pytest.raises(NonFiniteError, match="fragment 0"):
        d.step()
    assert d.steps == 5 and not d._pending
    for n, b in d.backups.items():
        assert torch.equal(b, backups[n]), n
    assert not d.outer_optimizers[0].state  # the outer optimizer never stepped


def _late_worker_body() -> None:
    """A worker that does not reach the outer sync in time: CommTimeoutError on the other within the
    timeout. The late one arrives afterwards, so its reduction pairs with the abandoned one and the
    process groups stay in step for the tests after this one."""
    rank, timeout = dist.get_rank(), 1.0
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    d = DiLoCo(model, opt, sync_every=1, workers=[[0], [1]], timeout=timeout)
    _inner_step(model, opt, rank, 0)
    if rank == 1:
        time.sleep(timeout + 1.0)
        d.step()
    else:
        began = time.monotonic()
        with pytest.raises(CommTimeoutError):
            d.step()
        assert time.monotonic() - began < timeout + 0.9
    dist.barrier()


def _bad_arguments_body() -> None:
    m = _model()
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    w = {"workers": [[0], [1]]}
    c = nn.Linear(2, 2).to(torch.complex64)
    cases = [
        (TypeError, "model", lambda: DiLoCo("model", opt)),
        (TypeError, "inner_optimizer", lambda: DiLoCo(m, None)),
        (ValueError, "inner_optimizer", lambda: DiLoCo(m, torch.optim.SGD(_model().parameters(), lr=0.1))),
        (TypeError, "outer_optimizer", lambda: DiLoCo(m, opt, outer_optimizer=0.7)),
        (ValueError, "sync_every", lambda: DiLoCo(m, opt, sync_every=0)),
        (TypeError, "sync_every", lambda: DiLoCo(m, opt, sync_every=2.0)),
        (ValueError, "delay", lambda: DiLoCo(m, opt, sync_every=4, delay=4)),
        (ValueError, "delay", lambda: DiLoCo(m, opt, delay=-1)),
        (TypeError, "delay", lambda: DiLoCo(m, opt, sync_every=4, delay=1.0)),
        (ValueError, "alpha", lambda: DiLoCo(m, opt, alpha=1.0)),
        (TypeError, "alpha", lambda: DiLoCo(m, opt, alpha="0.5")),
        (TypeError, "complex", lambda: DiLoCo(c, torch.optim.SGD(c.parameters(), lr=0.1), **w)),
        (TypeError, "closure", lambda: DiLoCo(m, opt, outer_optimizer=torch.optim.LBFGS, **w)),
        (ValueError, "fragments", lambda: DiLoCo(m, opt, fragments=0)),
        (ValueError, "fragments", lambda: DiLoCo(m, opt, fragments=99)),
        (ValueError, "exactly once", lambda: DiLoCo(m, opt, fragments=[["fc1.weight"]])),
        (ValueError, "exactly once", lambda: DiLoCo(m, opt, fragments=[[n for n, _ in m.named_parameters()],
                                                                       ["fc1.weight"]])),
        (TypeError, "compressor", lambda: DiLoCo(m, opt, compressor="int8")),
        (TypeError, "error_feedback", lambda: DiLoCo(m, opt, error_feedback=1)),
        (ValueError, "backup_device", lambda: DiLoCo(m, opt, backup_device="nowhere")),
        (ValueError, "timeout", lambda: DiLoCo(m, opt, timeout=0)),
        (TypeError, "topology", lambda: DiLoCo(m, opt, topology="2x1")),
        (ValueError, "workers", lambda: DiLoCo(m, opt, workers="rack")),
        (ValueError, "partition", lambda: DiLoCo(m, opt, workers=[[0, 1], [1]])),
        (ValueError, "not both", lambda: DiLoCo(m, opt, topology=Topology.from_spec("2x1"), **w)),
        (ValueError, "exactly", lambda: DiLoCo(m, opt, outer_optimizer=lambda ps: torch.optim.SGD(
            _model().parameters(), lr=1.0), **w)),
    ]
    for exc, words, make in cases:
        with pytest.raises(exc, match=words):
            make()
    # An empty trainable parameter is not synchronised, and an inner optimizer over model.parameters() holding it
    # is no stranger.
    m.empty = nn.Parameter(torch.zeros(0))
    d = DiLoCo(m, torch.optim.SGD(m.parameters(), lr=0.1), sync_every=1, **w)
    assert "empty" not in d.backups and len(d.backups) == 5
    d.step()


def _body_world2() -> None:
    _same_data_body()
    _streaming_body()
    _compressed_body()
    _checkpoint_body()
    _nonfinite_body()
    _late_worker_body()
    _bad_arguments_body()


def test_outer_loop_oracles_streaming_compression_checkpoint_and_errors(ranks):
    """Oracle 2, streaming, compression, checkpoint, NaN and bad arguments on two one-rank workers."""
    ranks(2, _body_world2, timeout=120)


def _global_world2() -> None:
    _finalize_cases("2x1", [(0, 0.3, 2), (0, 0.0, 4), (1, 0.5, 1), (2, 0.0, 2), (2, 0.0, 3), (2, 0.0, 4),
                            (2, 0.3, 4), (2, 0.3, 5)])
    _streaming_body("1x2-fsdp")
    _no_future_warning_body()


def test_global_model_finalize_and_no_future_warning(ranks):
    """Issue 38: the global model of a streamed run (FAULTS.md row 40's in-flight state) on two ranks.
    ``finalize()`` against the workers' mean, at every kind of step (before any sync, on a reduction
    issued now or in flight, on an adoption, between syncs), one-rank workers; ``global_state_dict()``
    against the workers' mean at each fragment's last outer step, and finalize, with FSDP2 inside one
    worker of two ranks (DTensor pieces); no FutureWarning from commopt's calls (a worker of two ranks
    with DDP inside: the adoption's all-gather)."""
    ranks(2, _global_world2, timeout=120)


def _global_world4() -> None:
    _finalize_cases("2x2", [(2, 0.3, 3), (2, 0.0, 7)])


def test_finalize_after_an_early_outer_step_four_ranks(ranks):
    """Issue 38, FAULTS.md row 40: ``finalize()`` on 2x2 with DDP inside and delay 2, right after a
    fragment's outer step ran a step early (its all-gather in flight): still the workers' mean, the same
    on every rank (the early step keeps where the workers were at the issue)."""
    ranks(4, _global_world4, timeout=120)


def test_bench_diloco_quick(tmp_path):
    """``commopt-bench diloco --quick`` on 4 spawned ranks as a 2x2: every run asked for trains on the same
    tokens and reports its step, its peak memory, inner step, exposed sync, bytes and losses (held-out: of
    DiLoCo's global model after finalize()); DiLoCo's syncs move fewer
    bytes per step than DDP's every-step all-reduce is not asserted (no timing or rate in tests), but each
    row's exposed time follows from its own step times and every loss is finite."""
    path = tmp_path / "diloco.json"
    res = subprocess.run([sys.executable, "-m", "commopt.bench", "diloco", "--spawn", "4", "--topology", "2x2",
                          "--quick", "--runs", "ddp,diloco-8,diloco-32-int4-stream", "--json", str(path)],
                         capture_output=True, text=True, timeout=180)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    data = json.loads(path.read_text())
    rows = {r["run"]: r for r in data["results"]}
    assert list(rows) == ["ddp", "diloco-8", "diloco-32-int4-stream"]
    assert rows["ddp"]["sync_every"] is None and rows["diloco-8"]["sync_every"] == 2
    for r in rows.values():
        assert len(r["losses"]) == 16 and all(math.isfinite(v) for v in r["losses"])
        assert math.isfinite(r["held_out_loss"]) and r["step_ms"] > 0 and r["inner_ms"] > 0
        assert r["exposed_ms"] == pytest.approx(max(r["step_ms"] - r["inner_ms"], 0.0))
        # Peak memory beside the step time (issue 38): every run's, measured around its own steps.
        assert isinstance(r["peak_memory_bytes"], int) and r["peak_memory_bytes"] > 0, r["run"]
    assert data["memory"] in ("rss", "rss, lifetime") and "peak MiB" in res.stdout
    assert "diloco-32-int4-stream" in res.stdout
    # The held-out loss is the global model's where DiLoCo trained (finalize()), and says so.
    assert "DiLoCo: the global model after DiLoCo.finalize()" in res.stdout
    # The traffic model's bytes per step on the busiest node link, against rank arithmetic (N: the
    # model's fp32 bytes): DDP rings every gradient over 4 ranks each step, node 0's link carrying
    # 2(p-1)/p N = 1.5 N; DiLoCo H=2 exact reduces each rank's 1/2 along a rail of 2 nodes every other
    # step (2(n-1)/n = 1 of its piece: N per node per sync, N/2 per step, up to the pieces' padding);
    # int4 with H=8 over 4 fragments: N/8 per step, encoded in 4 bits plus block scales.
    n = 4 * sum(p.numel() for p in GPT(256, 32, 1, 4, 16, seed=0).parameters())
    assert rows["ddp"]["model_bytes_per_step"] == pytest.approx(1.5 * n)
    assert rows["diloco-8"]["model_bytes_per_step"] == pytest.approx(n / 2, rel=0.02)
    assert n / 8 / 8 < rows["diloco-32-int4-stream"]["model_bytes_per_step"] < n / 8 / 4


def test_bench_diloco_run_names(capsys):
    """The bench's runs are "ddp", "diloco-H[-bf16|-int8|-int4][-stream][-ring]" or "torchft-H[-stream]": what each
    name trains, and a clear refusal (exit code 2, before any rank starts) of any other name."""
    from commopt.bench import diloco as bench

    assert bench.spec("ddp") is None
    assert bench.spec("diloco-8") == ("commopt", 8, None, 1, 0, False)
    assert bench.spec("diloco-16-int4-stream") == ("commopt", 16, "int4", 4, 2, False)
    assert bench.spec("diloco-32-int8") == ("commopt", 32, "int8", 1, 0, False)
    assert bench.spec("diloco-8-bf16-ring") == ("commopt", 8, "bf16", 1, 0, True)
    assert type(bench._compressor("bf16")).__name__ == "BF16Compressor"
    assert [bench._compressor(c).bits for c in ("int8", "int4")] == [8, 4]
    assert bench.spec("diloco-13-stream") == ("commopt", 13, None, 4, 2, False)
    assert bench.spec("torchft-32-stream") == ("torchft", 32, None, 4, 2, False)
    assert bench.spec("diloco-8-ring") == ("commopt", 8, None, 1, 0, True)  # the rail's own outer all-reduce
    assert all(bench.spec(name) is not None for name in bench.RUNS if name != "ddp")
    for bad in ("diloco-0", "diloco-16-int2", "diloco-16-fp16", "diloco-16-stream-int4", "diloco", "DDP", "diloco-08x",
                "torchft"):
        with pytest.raises(ValueError, match="a run is 'ddp', 'diloco-H"):
            bench.spec(bad)
    for bad in ("torchft-32-int4", "torchft-32-bf16"):
        with pytest.raises(ValueError, match="torchft's quantized outer gradients need Triton"):
            bench.spec(bad)
    with pytest.raises(ValueError, match="'-ring' is for commopt's DiLoCo"):
        bench.spec("torchft-32-ring")
    assert bench.main(["--runs", "ddp,diloco-16-int2"]) == 2
    assert "unknown run 'diloco-16-int2'" in capsys.readouterr().out


def test_bench_diloco_torchft_beside(tmp_path):
    """Where torchft is installed: ``--runs torchft-H`` trains torchft's own DiLoCo beside commopt's on the
    same model and tokens (4 spawned ranks as 4x1). torchft is an independent oracle here: plain DiLoCo
    in fp32 (one fragment, no delay, the paper's outer optimizer) must train the same, so every step's
    loss and the final held-out loss agree to rounding, and the traffic model's bytes per step are the
    same; on 2x2 (several ranks per worker, which torchft's DiLoCo does not run) a clear refusal with
    exit code 2."""
    pytest.importorskip("torchft")
    path = tmp_path / "diloco.json"
    res = subprocess.run([sys.executable, "-m", "commopt.bench", "diloco", "--spawn", "4", "--topology", "4x1",
                          "--quick", "--runs", "diloco-32,torchft-32", "--json", str(path)],
                         capture_output=True, text=True, timeout=180)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    rows = {r["run"]: r for r in json.loads(path.read_text())["results"]}
    assert list(rows) == ["diloco-32", "torchft-32"]
    ours, theirs = rows["diloco-32"], rows["torchft-32"]
    assert len(ours["losses"]) == 16 and all(math.isfinite(v) for v in ours["losses"])
    assert theirs["losses"] == pytest.approx(ours["losses"], rel=1e-5)
    assert theirs["held_out_loss"] == pytest.approx(ours["held_out_loss"], rel=1e-5)
    assert rows["torchft-32"]["model_bytes_per_step"] == pytest.approx(rows["diloco-32"]["model_bytes_per_step"])
    res = subprocess.run([sys.executable, "-m", "commopt.bench", "diloco", "--spawn", "4", "--topology", "2x2",
                          "--quick", "--runs", "torchft-32"], capture_output=True, text=True, timeout=120)
    assert res.returncode == 2 and "one rank per worker" in res.stderr, res.stderr[-2000:]
