"""Pipeline parallelism on commopt's boundary channel (docs/architecture.md section 5.5d; FAULTS.md row 47).

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


def _reference(stages: int, fwd: str | None, bwd: str | None, steps: int, delta_ids=None,
               error_feedback: bool = False) -> list[torch.Tensor]:
    """Single-process micro-batched training of the whole model, each boundary through the codecs'
    round trips (AQ-SGD's cache per boundary in delta mode); the parameters after ``steps`` SGD steps
    (one thread, as the ranks: a matmul's rounding depends on how it is split across threads)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return _reference_run(stages, fwd, bwd, steps, delta_ids, error_feedback)
    finally:
        torch.set_num_threads(threads)


def _reference_run(stages, fwd, bwd, steps, delta_ids, error_feedback) -> list[torch.Tensor]:
    model = _model(stages)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    fc, bc = get_codec(fwd), get_codec(bwd)
    caches = [dict() for _ in range(stages - 1)]
    residuals: dict = {}

    def backward_rt(s: int, k: int):
        if not error_feedback:
            return bc.roundtrip

        def rt(g):
            body = g + residuals[(s, k)] if (s, k) in residuals else g
            out = bc.roundtrip(body)
            residuals[(s, k)] = body - out
            return out
        return rt

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
                        h = _Reference.apply(h, fc.roundtrip, backward_rt(s, k))
                    else:
                        h = _Reference.apply(h, _delta_roundtrip(fc, caches[s], torch.tensor_split(ids, MICRO)[k]),
                                             backward_rt(s, k))
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


def _train(schedule: str, fwd, bwd, steps: int, delta_ids=None, n_samples=None,
           error_feedback: bool = False) -> list[torch.Tensor]:
    torch.set_num_threads(1)
    stages, stage = dist.get_world_size(), dist.get_rank()
    block = _model(stages)[stage]
    pipe = PipelineSchedule(block, n_microbatches=MICRO, loss_fn=_loss, schedule=schedule, forward_codec=fwd,
                            backward_codec=bwd, delta_samples=n_samples, error_feedback=error_feedback,
                            timeout=60)
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


def _torch_train(schedule: str, steps: int) -> list[torch.Tensor]:
    """The same training under torch's own ``ScheduleGPipe`` / ``Schedule1F1B`` on the same world."""
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

    torch.set_num_threads(1)
    stages, stage = dist.get_world_size(), dist.get_rank()
    block = _model(stages)[stage]
    pstage = PipelineStage(block, stage, stages, torch.device("cpu"))
    sched = (ScheduleGPipe if schedule == "gpipe" else Schedule1F1B)(pstage, n_microbatches=MICRO, loss_fn=_loss)
    opt = torch.optim.SGD(block.parameters(), lr=0.1)
    for step in range(steps):
        x, y = _data(step)
        opt.zero_grad()
        if stage == 0:
            sched.step(x)
        elif stage == stages - 1:
            sched.step(target=y)
        else:
            sched.step()
        opt.step()
    return [p.detach().clone() for p in block.parameters()]


def _exact_case(schedule, fwd, bwd):
    got, sent = _train(schedule, fwd, bwd, STEPS)
    return got, sent, _torch_train(schedule, STEPS)


@pytest.mark.parametrize("world", [2, 4])
def test_exact_equals_single_process_gpipe_and_1f1b(ranks, world):
    """Uncompressed GPipe and 1F1B (2 and 4 stages): the parameters after 10 steps equal single-process
    micro-batched training and torch's own ScheduleGPipe / Schedule1F1B on the same world, bit for bit;
    bytes per step are micro-batches x (payload + trailer)."""
    ref = _per_stage(_reference(world, None, None, STEPS), world)
    payload = BATCH // MICRO * SEQ * D * 4 + 40
    for schedule in ("gpipe", "1f1b"):
        res = ranks(world, _exact_case, schedule, None, None, timeout=120)
        for stage, (got, sent, theirs) in enumerate(res):
            assert all(torch.equal(a, b) for a, b in zip(got, ref[stage])), (schedule, stage)
            assert all(torch.equal(a, b) for a, b in zip(got, theirs)), (schedule, stage, "torch")
            want = {}
            if stage < world - 1:
                want[f"{stage}/fwd"] = STEPS * MICRO * payload
            if stage > 0:
                want[f"{stage - 1}/bwd"] = STEPS * MICRO * payload
            assert sent == want, (schedule, stage, sent)


def _inference() -> torch.Tensor | None:
    torch.set_num_threads(1)
    stage = dist.get_rank()
    pipe = PipelineSchedule(_model(dist.get_world_size())[stage], n_microbatches=MICRO, timeout=60)
    x, _ = _data(0)
    with torch.no_grad():
        return pipe.step(x) if pipe.is_first else pipe.step()


def test_forward_only_returns_the_model_output(ranks):
    """No loss_fn on any stage: forwards only; the last stage returns the whole model's output on the batch,
    bit for bit (micro-batch by micro-batch, concatenated)."""
    out = ranks(2, _inference, timeout=60)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with torch.no_grad():
            want = torch.cat([_model(2)(m) for m in torch.tensor_split(_data(0)[0], MICRO)])
    finally:
        torch.set_num_threads(threads)
    assert out[0] is None and torch.equal(out[1], want)


def _ids(step: int) -> torch.Tensor:
    """A finite set of 16 samples, cycled: a batch of 8 per step, in a different order each cycle."""
    g = torch.Generator().manual_seed(step // 2)
    return torch.randperm(16, generator=g)[(step % 2) * 8:(step % 2 + 1) * 8]


def _codec_cases():
    out = {}
    for name, kw in (("int8-both", dict(fwd="int8", bwd="int8")), ("bf16-int4", dict(fwd="bf16", bwd="int4")),
                     ("int8-ef", dict(fwd="int8", bwd="int8", error_feedback=True)),
                     ("delta-int4-int8", dict(fwd="int4", bwd="int8", delta_ids=_ids, n_samples=16))):
        out[name] = _train("1f1b", kw["fwd"], kw["bwd"], 6, delta_ids=kw.get("delta_ids"),
                           n_samples=kw.get("n_samples"), error_feedback=kw.get("error_feedback", False))[0]
    return out


def test_compressed_and_delta_modes_equal_the_fake_quantized_reference(ranks):
    """int8 both ways, bf16 forward / int4 backward, int8 with error feedback on the gradients, and AQ-SGD's
    delta mode (int4 forward, int8 backward, 16 samples cycled 3 times) on 2 stages: the parameters after 6
    steps equal single-process training with the codecs' round trips (and the delta cache, the residuals)
    at the boundary, bit for bit; and differ from the uncompressed run (the codec is really applied)."""
    res = ranks(2, _codec_cases, timeout=120)
    exact = _per_stage(_reference(2, None, None, 6), 2)
    refs = {"int8-both": _reference(2, "int8", "int8", 6), "bf16-int4": _reference(2, "bf16", "int4", 6),
            "int8-ef": _reference(2, "int8", "int8", 6, error_feedback=True),
            "delta-int4-int8": _reference(2, "int4", "int8", 6, delta_ids=_ids)}
    for name, ref in refs.items():
        ref = _per_stage(ref, 2)
        for stage in range(2):
            got = res[stage][name]
            assert all(torch.equal(a, b) for a, b in zip(got, ref[stage])), (name, stage)
        assert not all(torch.equal(a, b) for a, b in zip(res[0][name], exact[0])), name


def test_actions_orders():
    """The executor's order: torch's warm-up plus ``extra`` on non-last stages, backwards ascending."""
    assert actions("1f1b", 0, 2, 4, extra=1) == [("F", 0), ("F", 1), ("F", 2), ("B", 0), ("F", 3), ("B", 1),
                                                  ("B", 2), ("B", 3)]
    assert actions("1f1b", 1, 2, 4) == [("F", 0), ("B", 0), ("F", 1), ("B", 1), ("F", 2), ("B", 2), ("F", 3),
                                         ("B", 3)]
    assert actions("gpipe", 0, 2, 2) == [("F", 0), ("F", 1), ("B", 0), ("B", 1)]


# --------------------------------------------------------------------------------- faults (row 47)
def _scenario(group, victim: int, fault: str, timeout: float) -> tuple[str, str, float]:
    """Two steps of 4-stage 1F1B on ``group``; in the second, ``victim`` misbehaves (``fault``). Returns
    this stage's (error type, message, seconds from the start of the second step to the error)."""
    import os
    import signal

    stage = dist.get_rank(group)
    block = _model(4)[stage]
    codec = "int8" if fault == "codec-one-side" and stage == victim else None
    pipe = PipelineSchedule(block, n_microbatches=MICRO, loss_fn=_loss, group=group, forward_codec=codec,
                            timeout=timeout)
    calls = [0]

    def hook(_mod, _inp):
        calls[0] += 1
        if stage == victim and calls[0] == MICRO + 2:  # the second step's second forward
            if fault == "kill":
                os.kill(os.getpid(), signal.SIGKILL)
            if fault == "stall":
                time.sleep(timeout + 4)

    block.register_forward_pre_hook(hook)
    t0 = time.monotonic()
    try:
        for step in range(2):
            x, y = _data(step)
            if step == 1:
                t0 = time.monotonic()
                if fault == "shape" and stage == victim:
                    x = x[:, :-1]
            if pipe.is_first:
                pipe.step(x)
            elif pipe.is_last:
                pipe.step(target=y)
            else:
                pipe.step()
    except Exception as exc:  # noqa: BLE001 (the test inspects it)
        return type(exc).__name__, str(exc), time.monotonic() - t0
    return "none", "", time.monotonic() - t0


def _faults(timeout: float) -> list:
    out = []
    for fault, victim in (("codec-one-side", 1), ("shape", 0), ("stall", 2), ("kill", 2)):
        group = dist.new_group(list(range(4)))  # a fresh group: a failed step leaves messages unmatched
        out.append((fault, victim, _scenario(group, victim, fault, timeout)))
    return out


def test_faults_raise_on_every_stage_within_the_timeout():
    """FAULTS.md row 47, on 4 stages: a codec on one side only raises CollectiveMismatchError on both
    sides of that boundary at the first step; a micro-batch whose shape differs from the agreed one
    raises CollectiveMismatchError on the sender and its receiver before the receiver uses it; a stage
    stalled past the timeout, and a stage SIGKILLed mid-step, make every other stage raise
    CommTimeoutError naming the boundary, the micro-batch and the direction (or the stage that failed),
    within the timeout."""
    from _pool import RankPool

    timeout = 5.0  # the first, healthy step must never reach it on a loaded machine
    pool = RankPool(4)
    try:
        res = pool.run(_faults, timeout, timeout=120, allow_dead=True)
    finally:
        pool.close(graceful=False)
    assert res[2] is None  # the killed stage
    by = {fault: {} for fault in ("codec-one-side", "shape", "stall", "kill")}
    for stage, results in enumerate(res):
        for fault, _victim, (kind, msg, took) in results or []:
            by[fault][stage] = (kind, msg, took)
    codec = by["codec-one-side"]
    for s in (0, 1):
        assert codec[s][0] == "CollectiveMismatchError" and "forward codec" in codec[s][1], codec[s]
    shape = by["shape"]
    for s in (0, 1):
        assert shape[s][0] == "CollectiveMismatchError" and "shape" in shape[s][1], shape[s]
    assert shape[3][0] == "CommTimeoutError" and shape[3][2] < timeout, shape  # told by stage 2, at once
    assert codec[3][0] == "CommTimeoutError" and codec[3][2] < timeout, codec
    for fault in ("stall", "kill"):
        for s, (kind, msg, took) in by[fault].items():
            if s == 2:
                continue
            assert kind == "CommTimeoutError", (fault, s, kind, msg)
            assert took < timeout + 2.0, (fault, s, took)
            assert "stage" in msg, msg
        near = [by[fault][s][1] for s in (1, 3)]
        assert all("micro-batch" in m for m in near), near
