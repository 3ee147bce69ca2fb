"""Pipeline parallelism on commopt's boundary channel (docs/architecture.md section 5.10; FAULTS.md row 47).

The oracles: single-process micro-batched training of the whole model (with the codec's round trip
applied at each boundary for the compressed and delta modes: the fake-quantized reference, built here
from the codec's encode/decode), and torch's own ``ScheduleGPipe`` / ``Schedule1F1B`` on the same world.
Bit for bit, fp32, one thread per rank.
"""

from __future__ import annotations

import time

import pytest
import torch
import torch.distributed as dist
from torch import nn

from commopt.comm.errors import CollectiveMismatchError, CommTimeoutError
from commopt.comm.pipeline import get_codec
from commopt.schedules.pipeline_parallel import PipelineSchedule, actions

D, SEQ, BATCH, MICRO, STEPS = 16, 6, 8, 4, 10


class Block(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.fc1 = nn.Linear(d, 2 * d)
        self.fc2 = nn.Linear(2 * d, d)

    def forward(self, x):
        return x + self.fc2(torch.tanh(self.fc1(self.norm(x))))


def _model(stages: int) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(*[Block(D) for _ in range(stages)])


def _data(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    return torch.randn(BATCH, SEQ, D, generator=g), torch.randn(BATCH, SEQ, D, generator=g)


def _loss(out, y):
    return ((out - y) ** 2).mean()


class _Reference(torch.autograd.Function):
    """The boundary of the fake-quantized reference: forward the codec's round trip of the activation,
    backward the round trip of its gradient."""

    @staticmethod
    def forward(ctx, x, fwd, bwd):
        ctx.bwd = bwd
        return fwd(x)

    @staticmethod
    def backward(ctx, g):
        return ctx.bwd(g), None, None


def _reference(stages: int, fwd: str | None, bwd: str | None, steps: int, delta_ids=None) -> list[torch.Tensor]:
    """Single-process micro-batched training of the whole model, each boundary through the codecs'
    round trips (AQ-SGD's cache per boundary in delta mode); the parameters after ``steps`` SGD steps
    (one thread, as the ranks: a matmul's rounding depends on how it is split across threads)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return _reference_run(stages, fwd, bwd, steps, delta_ids)
    finally:
        torch.set_num_threads(threads)


def _reference_run(stages, fwd, bwd, steps, delta_ids) -> list[torch.Tensor]:
    model = _model(stages)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    fc, bc = get_codec(fwd), get_codec(bwd)
    caches = [dict() for _ in range(stages - 1)]
    for step in range(steps):
        x, y = _data(step)
        opt.zero_grad()
        ids = None if delta_ids is None else delta_ids(step)
        for k, (xm, ym) in enumerate(zip(torch.tensor_split(x, MICRO), torch.tensor_split(y, MICRO))):
            h = xm
            for s, block in enumerate(model):
                h = block(h)
                if s < stages - 1:
                    if ids is None:
                        h = _Reference.apply(h, fc.roundtrip, bc.roundtrip)
                    else:
                        h = _Reference.apply(h, _delta_roundtrip(fc, caches[s], torch.tensor_split(ids, MICRO)[k]),
                                             bc.roundtrip)
            _loss(h, ym).backward()
        for p in model.parameters():
            p.grad.div_(MICRO)
        opt.step()
    return [p.detach().clone() for p in model.parameters()]


def _delta_roundtrip(codec, cache: dict, ids: torch.Tensor):
    def rt(x):
        if all(int(i) in cache for i in ids):
            base = torch.stack([cache[int(i)] for i in ids])
            out = base + codec.roundtrip(x - base)
        else:
            out = x.clone()
        for j, i in enumerate(ids):
            cache[int(i)] = out[j].clone()
        return out
    return rt


def _train(schedule: str, fwd, bwd, steps: int, delta_ids=None, n_samples=None) -> list[torch.Tensor]:
    torch.set_num_threads(1)
    stages, stage = dist.get_world_size(), dist.get_rank()
    block = _model(stages)[stage]
    pipe = PipelineSchedule(block, n_microbatches=MICRO, loss_fn=_loss, schedule=schedule, forward_codec=fwd,
                            backward_codec=bwd, delta_samples=n_samples, timeout=60)
    opt = torch.optim.SGD(block.parameters(), lr=0.1)
    for step in range(steps):
        x, y = _data(step)
        opt.zero_grad()
        kw = {} if delta_ids is None else {"sample_ids": delta_ids(step)}
        if pipe.is_first:
            pipe.step(x, **kw)
        elif pipe.is_last:
            pipe.step(target=y, **kw)
        else:
            pipe.step(**kw)
        opt.step()
    return [p.detach().clone() for p in block.parameters()], pipe.bytes_sent()


def _per_stage(ref: list[torch.Tensor], stages: int) -> list[list[torch.Tensor]]:
    per = len(ref) // stages
    return [ref[i * per:(i + 1) * per] for i in range(stages)]


def _exact_case(schedule, fwd, bwd):
    got, sent = _train(schedule, fwd, bwd, STEPS)
    return got, sent


@pytest.mark.parametrize("world", [2, 4])
def test_exact_equals_single_process_gpipe_and_1f1b(ranks, world):
    """Uncompressed GPipe and 1F1B (2 and 4 stages): the parameters after 10 steps equal single-process
    micro-batched training bit for bit; bytes per step are micro-batches x (payload + trailer)."""
    ref = _per_stage(_reference(world, None, None, STEPS), world)
    payload = BATCH // MICRO * SEQ * D * 4 + 40
    for schedule in ("gpipe", "1f1b"):
        res = ranks(world, _exact_case, schedule, None, None, timeout=120)
        for stage, (got, sent) in enumerate(res):
            assert all(torch.equal(a, b) for a, b in zip(got, ref[stage])), (schedule, stage)
            want = {}
            if stage < world - 1:
                want[f"{stage}/fwd"] = STEPS * MICRO * payload
            if stage > 0:
                want[f"{stage - 1}/bwd"] = STEPS * MICRO * payload
            assert sent == want, (schedule, stage, sent)


def test_actions_orders():
    """The executor's order: torch's warm-up plus ``extra`` on non-last stages, backwards ascending."""
    assert actions("1f1b", 0, 2, 4, extra=1) == [("F", 0), ("F", 1), ("F", 2), ("B", 0), ("F", 3), ("B", 1),
                                                  ("B", 2), ("B", 3)]
    assert actions("1f1b", 1, 2, 4) == [("F", 0), ("B", 0), ("F", 1), ("B", 1), ("F", 2), ("B", 2), ("F", 3),
                                         ("B", 3)]
    assert actions("gpipe", 0, 2, 2) == [("F", 0), ("F", 1), ("B", 0), ("B", 1)]


def _time_case():
    t0 = time.monotonic()
    return time.monotonic() - t0
