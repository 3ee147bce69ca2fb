"""torch's own pipeline schedules over commopt's boundary group (docs/architecture.md section 5.10;
FAULTS.md row 47).

The oracle: single-process micro-batched training of the whole model with the codec's round trip applied
at each boundary (the fake-quantized reference of ``test_pipeline_parallel``; exact training without a
codec), against torch's unmodified ``ScheduleGPipe``, ``Schedule1F1B`` (one stage per rank) and
``ScheduleInterleaved1F1B`` (two stages per rank) whose ``PipelineStage``s are given the group. Bit for
bit, fp32, one thread per rank. Bytes on the wire: micro-batches x the encoded size, counted from the
shapes (int8: one byte per element and a 4-byte scale per row).
"""

from __future__ import annotations

import os
import time

import pytest
import torch
import torch.distributed as dist
from test_pipeline_parallel import BATCH, MICRO, SEQ, D, _data, _loss, _model, _per_stage, _reference
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B

from commopt.comm.errors import CollectiveMismatchError, CommTimeoutError
from commopt.comm.pipeline import get_codec
from commopt.comm.pipeline.group import boundary_group
from commopt.comm.runtime import context

STEPS = 4
# The group's bound on every wait: long enough that the first step (torch's shape inference, a loaded
# suite) never reaches it, short enough that the stalled case stays cheap.
TIMEOUT, SLACK = 6.0, 10.0
ROWS = BATCH // MICRO * SEQ  # rows of one micro-batch's activation [BATCH / MICRO, SEQ, D]
# Bytes of one boundary message, counted from the shape (not from the codec): fp32, bf16, int8 + fp32 row scales.
WIRE = {None: ROWS * D * 4, "bf16": ROWS * D * 2, "int8": ROWS * D + ROWS * 4}


def _train(schedule: str, fwd: str | None, bwd: str | None) -> tuple[dict, dict, int]:
    """torch's ``schedule`` on a boundary group of the world; (stage -> parameters, the group's bytes by
    direction, the engine's ``pp/group`` bytes)."""
    torch.set_num_threads(1)
    rank = dist.get_rank()
    engine = context().engine()
    before = engine.bytes_sent().get("pp/group", 0)
    loop = schedule == "interleaved"
    pg = boundary_group(forward_codec=fwd or "none", backward_codec=bwd or "none",
                        placement="loop" if loop else "single", timeout=60)
    try:
        n_stages = 4 if loop else 2
        model = _model(n_stages)
        mine = (rank, rank + 2) if loop else (rank,)
        stages = [PipelineStage(model[s], s, n_stages, torch.device("cpu"), group=pg) for s in mine]
        if loop:
            pipe = ScheduleInterleaved1F1B(stages, n_microbatches=MICRO, loss_fn=_loss)
        else:
            pipe = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}[schedule](stages[0], n_microbatches=MICRO,
                                                                             loss_fn=_loss)
        params = [p for s in mine for p in model[s].parameters()]
        opt = torch.optim.SGD(params, lr=0.1)
        for step in range(STEPS):
            x, y = _data(step)
            opt.zero_grad()
            if rank == 0:
                pipe.step(x)
            else:
                pipe.step(target=y)
            opt.step()
        got = {s: [p.detach().clone() for p in model[s].parameters()] for s in mine}
        return got, pg.bytes_sent(), engine.bytes_sent().get("pp/group", 0) - before
    finally:
        dist.destroy_process_group(pg)


def _cases(cases):
    return [_train(*case) for case in cases]


@pytest.mark.parametrize("fwd,bwd", [(None, None), ("int8", "int8"), ("int8", "bf16")])
def test_torch_schedules_equal_fake_quantized_reference(ranks, fwd, bwd):
    """torch's ScheduleGPipe, Schedule1F1B and (one codec both ways) ScheduleInterleaved1F1B, unmodified, over
    the boundary group: the parameters after 4 steps equal single-process micro-batched training with the
    codecs' round trips at every boundary, bit for bit; each rank's bytes are micro-batches x the encoded
    size in each direction (int8: a quarter of fp32 plus the row scales), counted by the engine too."""
    cases = [("gpipe", fwd, bwd), ("1f1b", fwd, bwd)] + ([("interleaved", fwd, bwd)] if fwd == bwd else [])
    res = ranks(2, _cases, cases, timeout=180)
    refs = {2: _per_stage(_reference(2, fwd, bwd, STEPS), 2)}
    if fwd == bwd:
        refs[4] = _per_stage(_reference(4, fwd, bwd, STEPS), 4)
    if fwd is not None:  # the comparison tells the codec's bits from exact training
        exact = _reference(2, None, None, STEPS)
        assert not all(torch.equal(a, b) for a, b in zip(exact, sum(refs[2], [])))
    for i, (schedule, _, _) in enumerate(cases):
        loop = schedule == "interleaved"
        ref = refs[4 if loop else 2]
        for rank in range(2):
            got, sent, counted = res[rank][i]
            for stage, params in got.items():
                assert all(torch.equal(a, b) for a, b in zip(params, ref[stage], strict=True)), (schedule, stage)
            boundary = {k: v for k, v in sent.items() if k != "meta"}
            if loop:  # per step: 2 activations sent and 1 gradient (rank 0), or 1 activation and 2 gradients
                want = {"fwd+bwd": STEPS * 3 * MICRO * WIRE[fwd]}
            else:
                want = {"fwd": STEPS * MICRO * WIRE[fwd]} if rank == 0 else {"bwd": STEPS * MICRO * WIRE[bwd]}
            assert boundary == want, (schedule, rank, sent)
            assert counted == sum(want.values())
            assert sent["meta"] > 0  # torch's metadata went through, exactly (else no step would have run)


def _refusals() -> dict[str, str]:
    out = {}
    for name, kw in {"loop-2": dict(placement="loop", forward_codec="int8", backward_codec="bf16"),
                     "v": dict(placement="v", codec="bf16", backward_codec="none"),
                     "codec": dict(codec="int3"), "placement": dict(placement="ring"),
                     "timeout": dict(timeout=0)}.items():
        try:
            dist.destroy_process_group(boundary_group(**kw))
            out[name] = "built"
        except ValueError as exc:
            out[name] = str(exc)
    try:  # a codec on one side only: both sides refuse before a byte moves
        dist.destroy_process_group(boundary_group(codec="int8" if dist.get_rank() == 0 else None, timeout=TIMEOUT))
        out["one-sided"] = "built"
    except CollectiveMismatchError as exc:
        out["one-sided"] = str(exc)
    return out


def test_refuses_what_it_cannot_carry(ranks):
    """FAULTS.md row 47: a codec on one side only raises CollectiveMismatchError on both ranks (gloo would
    abort the receiver of a payload larger than its buffer); two codecs where both directions reach the
    same peer (loop placement on 2 ranks, V placement), an unknown codec, placement or timeout: ValueError."""
    for out in ranks(2, _refusals, timeout=60):
        assert "cannot tell an activation from a gradient" in out["loop-2"]
        assert "cannot tell an activation from a gradient" in out["v"]
        assert "int3" in out["codec"] and "ring" in out["placement"] and "timeout" in out["timeout"]
        msg = out["one-sided"]
        assert msg.startswith("CollectiveMismatchError") and "rank 0: forward int8" in msg, msg
        assert "rank 1: forward none" in msg, msg


def _faulty(mode: str, done: str):
    """Rank 1 dies in the middle of step 2 (at its second micro-batch's forward) or stops before it
    until rank 0 has reported (it writes ``done``); rank 0 runs step 2 and reports what it raised and when."""
    torch.set_num_threads(1)
    rank = dist.get_rank()
    pg = boundary_group(codec="int8", timeout=TIMEOUT)
    model = _model(2)
    pipe = Schedule1F1B(PipelineStage(model[rank], rank, 2, torch.device("cpu"), group=pg), n_microbatches=MICRO,
                        loss_fn=_loss)
    x, y = _data(0)
    step_2_forwards = []  # appended to once step 2 starts

    def die_at_second_forward_of_step_2(_module, _args):
        if step_2_forwards:
            step_2_forwards.append(1)
            if len(step_2_forwards) == 3:
                os._exit(1)  # killed mid-step: the pool is replaced (allow_dead)

    if rank == 1 and mode == "killed":
        model[1].register_forward_pre_hook(die_at_second_forward_of_step_2)
    for step in range(2):
        if rank == 1 and step == 1 and mode == "stalled":
            deadline = time.monotonic() + TIMEOUT + SLACK
            while not os.path.exists(done) and time.monotonic() < deadline:  # alive, silent: rank 0 must time out
                time.sleep(0.05)
            os._exit(0)  # the pool is replaced (allow_dead)
        if step == 1:
            step_2_forwards.append(0)
        start = time.monotonic()
        try:
            pipe.step(x) if rank == 0 else pipe.step(target=y)
        except CommTimeoutError as exc:
            took = time.monotonic() - start
            with open(done, "w"):
                pass
            return step, took, str(exc)
    return "completed"


@pytest.mark.parametrize("mode", ["killed", "stalled"])
def test_peer_killed_or_stalled_raises_comm_timeout(ranks, mode, tmp_path):
    """FAULTS.md row 47: a stage killed mid-step, or stopped, makes its neighbour (inside torch's
    Schedule1F1B) raise CommTimeoutError within the group's timeout, naming the peer and the direction."""
    res = ranks(2, _faulty, mode, str(tmp_path / "done"), timeout=2 * (TIMEOUT + SLACK) + 30, allow_dead=True)
    assert res[1] is None
    step, elapsed, msg = res[0]
    assert step == 1
    assert elapsed <= TIMEOUT + SLACK, elapsed
    if mode == "stalled":
        assert elapsed >= TIMEOUT - 0.5, elapsed  # it waited for the bound, not for the group's 90 s
    assert msg.startswith("CommTimeoutError [op=pp/group/") and "ranks=[1]]" in msg, msg
    assert "group rank 1 (global 1)" in msg and ("activation" in msg or "gradient" in msg), msg


def _passthrough():
    rank = dist.get_rank()
    pg = boundary_group(codec="int8", timeout=30)
    try:
        out = {"rank": dist.get_rank(pg), "size": dist.get_world_size(pg), "backend": dist.get_backend(pg)}
        t = torch.arange(4.0) + 10 * rank
        dist.all_reduce(t, group=pg)
        u = torch.full((3,), 1.0 + rank)
        dist.all_reduce(u, group=pg, async_op=True).get_future().wait()
        out["all_reduce"] = (t, u)
        b = torch.arange(5.0) * (rank + 1)
        dist.broadcast(b, group_src=1, group=pg)
        objs = [None, None]
        dist.all_gather_object(objs, {"rank": rank}, group=pg)
        dist.barrier(group=pg)
        out.update(broadcast=b, objects=objs)
        # a mixed batch (torch loops isend/irecv for a Python group): floats through int8, ints exactly
        x = torch.randn(3, 8, generator=torch.Generator().manual_seed(rank))
        got, ids = torch.empty(3, 8), torch.empty(4, dtype=torch.int64)
        peer = 1 - rank
        works = dist.batch_isend_irecv([dist.P2POp(dist.irecv, got, group_peer=peer, group=pg),
                                        dist.P2POp(dist.irecv, ids, group_peer=peer, group=pg),
                                        dist.P2POp(dist.isend, x, group_peer=peer, group=pg),
                                        dist.P2POp(dist.isend, torch.arange(4) + 100 * rank, group_peer=peer,
                                                   group=pg)])
        for w in works:
            w.wait()
        out.update(sent=x, got=got, ids=ids)
        return out
    finally:
        dist.destroy_process_group(pg)


def test_other_calls_pass_through(ranks):
    """Collectives on the group are the wrapped group's, uncompressed (the sums, the broadcast, the gathered
    objects are plain torch's); a mixed ``batch_isend_irecv`` delivers floats as the codec's round trip
    and integers exactly."""
    res = ranks(2, _passthrough, timeout=60)
    codec = get_codec("int8")
    for rank, out in enumerate(res):
        assert (out["rank"], out["size"], out["backend"]) == (rank, 2, "commopt_pp")
        t, u = out["all_reduce"]
        assert torch.equal(t, torch.arange(4.0) * 2 + 10) and torch.equal(u, torch.full((3,), 3.0))
        assert torch.equal(out["broadcast"], torch.arange(5.0) * 2)
        assert out["objects"] == [{"rank": 0}, {"rank": 1}]
        peer = res[1 - rank]
        assert torch.equal(out["got"], codec.roundtrip(peer["sent"]))
        assert not torch.equal(out["got"], peer["sent"])
        assert torch.equal(out["ids"], torch.arange(4) + 100 * (1 - rank))
