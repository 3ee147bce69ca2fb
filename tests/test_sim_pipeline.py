"""The pipeline model (``commopt.schedules.simulator.simulate_pipeline``, issue 41 item 4) and
``commopt-bench simulate --pp-stages``.

No timed test. Oracles: closed forms derived by hand (a free link: ``(M + S - 1)(f + b)`` for GPipe
and 1F1B; torch's 1F1B on two stages across a link of ``t`` per message: ``(M + 1)(f + b) + 2 M t``
with gloo's ready notice behind the receiver's queued payload, ``(M + 1)(f + b + t)`` without;
commopt's with one extra forward: the floor plus the fill and drain ``2 t`` as long as
``t <= (f + b) / 2``; star links on 3 stages, the middle node's ports shared); the definitions of
rendezvous, ready notice, ring, channel and port share checked event by event on the trace; the codec's bytes against
``QuantizeCompressor``; and the order in which torch's own ``Schedule1F1B`` / ``ScheduleGPipe`` run
forwards, backwards and posts on a gloo world of 2 ranks, recorded with hooks.
"""

from __future__ import annotations

import json

import pytest

from commopt.comm.links import LinkModel
from commopt.schedules._sim_pipeline import PP_CODECS, PP_LINKS, PipelineCodec
from commopt.schedules.simulator import pipeline_codec, simulate_pipeline, simulate_pipeline_dp

F, B = 1.0, 2.0
FREE = LinkModel(0.0, 0.0)


def _link(t: float) -> LinkModel:
    """A link on which one message (any size) takes ``t`` seconds."""
    return LinkModel(t, 0.0)


# ------------------------------------------------------------------------------------ closed forms
def test_free_link_is_the_fill_drain_closed_form():
    for S in (1, 2, 3, 4):
        for M in (S, 2 * S + 1):
            for schedule in ("gpipe", "1f1b"):
                for policy in ("torch", "commopt"):
                    r = simulate_pipeline(S, M, F, B, link=FREE, activation_bytes=1 << 20, schedule=schedule,
                                          policy=policy)
                    assert r.step == pytest.approx((M + S - 1) * (F + B)), (S, M, schedule, policy)
                    assert r.floor == pytest.approx(r.step)
                    # Every stage computes M (f + b); the rest of the step it is idle.
                    assert r.idle == pytest.approx([r.step - M * (F + B)] * S)


def test_torch_1f1b_two_stages_closed_form_with_and_without_the_ready_notice():
    """Derived by hand from Schedule1F1B's posts. The last stage posts the receive of forward k + 1
    only after backward k, together with (after) the send of gradient k, so one transfer lies on its
    cycle: without the ready notice the cycle is f + b + t and fill and drain add two more transfers,
    (M + 1)(f + b + t). With it (gloo: the receive's notice to stage 0 travels behind gradient k on
    stage 1's connection), activation k + 1 leaves only once gradient k has arrived, and stage 0's
    notice for gradient k + 1 likewise waits behind activation k + 2 when it posts second: 2 t on the
    cycle for each of the M - 1 steady micro-batches, so (M + 1)(f + b) + 2 M t."""
    for M in (2, 3, 8):
        for t in (0.1, 0.5, 1.0, 3.0):
            r = simulate_pipeline(2, M, F, B, link=_link(t), activation_bytes=1, policy="torch")
            assert r.step == pytest.approx((M + 1) * (F + B) + 2 * M * t), (M, t)
            assert r.floor == pytest.approx((M + 1) * (F + B))
            r = simulate_pipeline(2, M, F, B, link=_link(t), activation_bytes=1, policy="torch", notice=False)
            assert r.step == pytest.approx((M + 1) * (F + B + t)), (M, t)
            assert r.floor == pytest.approx((M + 1) * (F + B))


def test_ready_notice_waits_behind_the_receivers_queued_payload():
    """The notice rule on torch's trace (2 stages, the last one slower, so stage 0 has posted first):
    in steady state stage 1 posts the send of gradient k and the receive of activation k + 1 at one
    instant, and activation k + 1 goes on the wire exactly when gradient k arrives; without the rule
    both go at once."""
    M, t = 5, 0.5
    for notice in (True, False):
        r = simulate_pipeline(2, M, [F, F + 0.25], B, link=_link(t), activation_bytes=1, policy="torch",
                              notice=notice)
        ev = {(e.stage, e.kind, e.mb): e for e in r.trace}
        for k in range(M - 1):
            post = ev[1, "recv_act", k + 1].start
            assert ev[1, "send_grad", k].start == post
            grad = ev[1, "grad", k]
            assert grad.start == pytest.approx(post)
            assert ev[0, "act", k + 1].start == pytest.approx(grad.end if notice else post), (notice, k)


def test_star_links_share_the_middle_nodes_ports():
    """commopt's 1F1B, 3 stages, 3 micro-batches, free compute, t per message alone; by hand (ring
    depth 2: stage 1 posts the receive of activation 2 when it consumes activation 0, at t):
    - boundary links: 6 t;
    - star, fair share: at 2 t activation 2 (0 -> 1) and gradient 0 (2 -> 1) share stage 1's downlink
      and both arrive at 4 t; at 4 t stage 1 sends activation 2 and gradient 0 on its one uplink,
      both arrive at 6 t; gradient 1 (4 t, alone) lets stage 1's backward 1 send gradient 1 at 5 t,
      queued on its connection to stage 0 behind gradient 0 until 6 t; gradient 2 (6 t to 7 t) is
      sent on at 7 t: 8 t;
    - star, FIFO per port: activation 2 holds the downlink 2 t to 3 t, gradient 0 follows to 4 t;
      activation 2 goes up at 3 t, gradient 0 (sent at 4 t) after it, and the gradients leave stage 1
      at 4 t, 5 t and 6 t: 7 t.
    On two stages every port carries one direction of the one boundary: the star is the boundary."""
    for t in (0.5, 1.0, 3.0):
        steps = {links: simulate_pipeline(3, 3, 0.0, 0.0, link=_link(t), activation_bytes=1, links=links).step
                 for links in ("boundary", "star", "star-fifo")}
        assert steps == pytest.approx({"boundary": 6 * t, "star": 8 * t, "star-fifo": 7 * t}), t
    link = LinkModel(1e-4, 8 / 50e6)
    for schedule in ("gpipe", "1f1b"):
        for policy in ("torch", "commopt"):
            runs = [simulate_pipeline(2, 5, 0.03, [0.06, 0.07], link=link, activation_bytes=1 << 20,
                                      schedule=schedule, policy=policy, links=links) for links in PP_LINKS]
            assert [r.step for r in runs[1:]] == pytest.approx([runs[0].step] * 2), (schedule, policy)
            assert [r.trace for r in runs[1:]] == [runs[0].trace] * 2


def test_star_shares_a_port_equally_event_by_event():
    """The fair share's definition on 4-stage traces: each message on the wire moves at 1 / (the most
    messages on the wire through its sender's uplink or its receiver's downlink) of its rate alone, so
    the integral of that share over its time on the wire is its time alone; one message at a time
    per connection; a middle node's uplink carries both of its directions (commopt's step, which
    keeps both busy, is longer than with a channel per boundary direction)."""
    S, M, act = 4, 6, 1 << 20
    link = LinkModel(1e-4, 8 / 50e6)
    for policy in ("torch", "commopt"):
        r = simulate_pipeline(S, M, 0.03, 0.06, link=link, activation_bytes=act, policy=policy, links="star")
        wires = [(e.stage, e.stage + 1 if e.kind == "act" else e.stage - 1, e.start, e.end)
                 for e in r.trace if e.kind in ("act", "grad")]
        assert len(wires) == 2 * (S - 1) * M
        cuts = sorted({x for w in wires for x in w[2:]})
        for src, dst, start, end in wires:
            moved = 0.0
            for a, b in zip(cuts, cuts[1:]):
                if start <= a and b <= end:
                    on = [w for w in wires if w[2] <= a and b <= w[3]]
                    moved += (b - a) / max(sum(w[0] == src for w in on), sum(w[1] == dst for w in on))
            assert moved == pytest.approx(link.time(act)), (policy, src, dst, start)
        for src, dst in {w[:2] for w in wires}:
            spans = sorted(w[2:] for w in wires if w[:2] == (src, dst))
            assert all(a[1] <= b[0] + 1e-12 for a, b in zip(spans, spans[1:]))
        boundary = simulate_pipeline(S, M, 0.03, 0.06, link=link, activation_bytes=act, policy=policy)
        assert r.floor == pytest.approx(boundary.floor)
        if policy == "commopt":  # torch's 1F1B never has two transfers through one port (its step is the same)
            assert r.step > boundary.step + link.time(act)


def test_torch_gpipe_two_stages_closed_form():
    """GPipe on two stages, by hand: stage 1 posts the receive of k + 1 only after forward k, so its
    forward k starts at (k + 1)(f + t) and the forwards end at M (f + t) + f; stage 0 posts the receive
    of gradient k + 1 after backward k, so its backward k starts at M (f + t) + f + b + t + k (b + t):
    the step is M (f + b + 2 t) + f + b."""
    for M in (2, 4):
        for t in (0.25, 0.5):
            r = simulate_pipeline(2, M, F, B, link=_link(t), activation_bytes=1, schedule="gpipe", policy="torch")
            assert r.step == pytest.approx(M * (F + B + 2 * t) + F + B), (M, t)


def test_commopt_extra_forward_hides_transfers_up_to_half_a_cycle():
    """One extra forward in flight hides the transfer while t <= (f + b) / 2 on two stages (only fill
    and drain, 2 t, remain); pre-posting alone (extra=0) does not; past (f + b) / 2 extra=1 does not
    either, and extra=2 does up to f + b."""
    M = 8
    for t in (0.1, 0.75, 1.5):
        r = simulate_pipeline(2, M, F, B, link=_link(t), activation_bytes=1, policy="commopt")
        assert r.step == pytest.approx(r.floor + 2 * t), t
        assert r.floor == pytest.approx((M + 1) * (F + B))
        r0 = simulate_pipeline(2, M, F, B, link=_link(t), activation_bytes=1, policy="commopt", extra=0)
        assert r0.step > r.floor + 2 * t + 1e-9, t
    t = 2.0
    r1 = simulate_pipeline(2, M, F, B, link=_link(t), activation_bytes=1, policy="commopt", extra=1)
    r2 = simulate_pipeline(2, M, F, B, link=_link(t), activation_bytes=1, policy="commopt", extra=2)
    assert r1.step > r1.floor + 2 * t + 1e-9
    assert r2.step == pytest.approx(r2.floor + 2 * t)


def test_extra_per_boundary_hides_every_boundary():
    """On 4 stages the fill and drain cross 3 boundaries (6 t): with one extra forward per boundary
    downstream that is all that shows; with one extra on every stage, the transfers between the first
    stages stay on the cycle."""
    S, M, t = 4, 16, 0.5
    per = simulate_pipeline(S, M, F, B, link=_link(t), activation_bytes=1)  # the executor's rule (default)
    flat = simulate_pipeline(S, M, F, B, link=_link(t), activation_bytes=1, extra_per_boundary=False)
    assert per.floor == pytest.approx((M + S - 1) * (F + B))
    assert per.step == pytest.approx(per.floor + 2 * (S - 1) * t)
    assert flat.step > per.step + t


def test_contention_slows_compute_while_its_transfer_is_on_the_wire():
    """commopt GPipe, 2 stages, 2 micro-batches: forward 1 on stage 0 starts at f with activation 0 on
    the wire for t; at slowdown k it does t / k of its work meanwhile, so it ends at f + t + (f - t / k)."""
    t, k = 0.5, 2.0
    r = simulate_pipeline(2, 2, F, B, link=_link(t), activation_bytes=1, schedule="gpipe", slowdown=k)
    f1 = next(e for e in r.trace if (e.stage, e.kind, e.mb) == (0, "F", 1))
    assert (f1.start, f1.end) == pytest.approx((F, F + t + (F - t / k)))
    plain = simulate_pipeline(2, 2, F, B, link=_link(t), activation_bytes=1, schedule="gpipe")
    assert r.step > plain.step
    assert r.floor == pytest.approx(plain.floor)  # the floor has no transfer to contend with


# ------------------------------------------------------------------------------------ the trace
def _check_trace(r, S: int, M: int, fb: tuple[float, float], link: LinkModel, act: float, codec: PipelineCodec,
                 policy: str, depth: int, slowdown: float) -> None:
    ev = {(e.stage, e.kind, e.mb): e for e in r.trace}
    assert len(ev) == len(r.trace)  # each event once
    wire = act * codec.ratio
    for s in range(S):
        for k in range(M):
            f, b = ev[s, "F", k], ev[s, "B", k]
            assert fb[0] - 1e-12 <= f.end - f.start <= slowdown * fb[0] + 1e-12
            assert fb[1] - 1e-12 <= b.end - b.start <= slowdown * fb[1] + 1e-12
            assert b.start >= f.end - 1e-12
            if s > 0:  # the activation arrived (and was decoded) before the forward
                arrive = ev[s - 1, "act", k]
                assert f.start >= arrive.end - 1e-12
                if codec.decode:
                    dec = ev[s, "decode_act", k]
                    assert dec.start >= arrive.end - 1e-12 and f.start >= dec.end - 1e-12
            if s < S - 1:
                assert b.start >= ev[s + 1, "grad", k].end - 1e-12
                for kind, src, dst in (("act", s, s + 1), ("grad", s + 1, s)):
                    m = ev[src, kind, k]
                    # Rendezvous: on the wire only once both sides posted.
                    assert m.start >= ev[src, f"send_{kind}", k].start - 1e-12
                    assert m.start >= ev[dst, f"recv_{kind}", k].start - 1e-12
                    assert m.end - m.start == pytest.approx(link.time(wire))
                    # The ready notice: behind every payload the receiver had on the wire to the sender.
                    post, back = ev[dst, f"recv_{kind}", k].start, "grad" if kind == "act" else "act"
                    for j in range(M):
                        x = ev[dst, back, j]
                        if x.start <= post < x.end:
                            assert m.start >= x.end - 1e-12
                assert ev[s, "send_act", k].start >= f.end - 1e-12
                if codec.encode:
                    assert ev[s, "send_act", k].start >= ev[s, "encode_act", k].end - 1e-12
                if policy == "commopt" and k >= depth:  # the ring: k's buffer is posted once k - depth was consumed
                    consumed = ev[s + 1, "decode_act", k - depth] if codec.decode else ev[s + 1, "F", k - depth]
                    assert ev[s + 1, "recv_act", k].start >= consumed.start - 1e-12
        computes = sorted((e.start, e.end) for e in r.trace if e.stage == s and e.kind[0] in "FBed")
        assert all(a[1] <= b[0] + 1e-12 for a, b in zip(computes, computes[1:]))  # one compute at a time
    for bd in range(S - 1):  # one message at a time per direction of a boundary
        for kind in ("act", "grad"):
            spans = sorted((e.start, e.end) for e in r.trace if e.kind == kind and e.stage == (bd if kind == "act"
                                                                                                else bd + 1))
            assert len(spans) == M
            assert all(a[1] <= b[0] + 1e-12 for a, b in zip(spans, spans[1:]))
    assert r.step == pytest.approx(max(e.end for e in r.trace))


def test_trace_respects_every_dependency():
    act = 1 << 20
    link = LinkModel(1e-4, 8 / 200e6)
    int8 = pipeline_codec("int8", encode=2e-10, decode=1e-10)
    for S, M in ((2, 5), (3, 4), (4, 8)):
        for schedule in ("gpipe", "1f1b"):
            for policy in ("torch", "commopt"):
                for codec, slowdown, depth in ((PipelineCodec(), 1.0, 2), (int8, 1.5, 3)):
                    r = simulate_pipeline(S, M, 0.03, 0.06, link=link, activation_bytes=act, schedule=schedule,
                                          policy=policy, codec_act=codec, codec_grad=codec, slowdown=slowdown,
                                          depth=depth)
                    _check_trace(r, S, M, (0.03, 0.06), link, act, codec, policy, depth, slowdown)


def test_bytes_per_boundary_and_codec_ratios():
    from commopt.comm.compression import QuantizeCompressor

    n, row = 8 * 128 * 256, 256
    for bits in (8, 4):
        assert pipeline_codec(f"int{bits}", row=row).ratio * 4 * n == QuantizeCompressor(bits, block=row).nbytes([n])
    assert pipeline_codec("bf16").ratio == 0.5 and pipeline_codec("none").ratio == 1.0
    assert set(PP_CODECS) == {"none", "bf16", "int8", "int4"}
    int8 = pipeline_codec("int8", row=row)
    r = simulate_pipeline(3, 6, F, B, link=LinkModel(0, 1e-9), activation_bytes=[4 * n, 2 * n], codec_act=int8)
    assert r.boundary_bytes == [(6 * 4 * n * int8.ratio, 6 * 4 * n), (6 * 2 * n * int8.ratio, 6 * 2 * n)]


def test_bad_arguments_say_what_is_wrong():
    with pytest.raises(ValueError, match="micro_batches >= stages"):
        simulate_pipeline(4, 3, F, B, link=FREE, activation_bytes=1, policy="torch")
    with pytest.raises(ValueError, match="policy"):
        simulate_pipeline(2, 4, F, B, link=FREE, activation_bytes=1, policy="fast")
    with pytest.raises(ValueError, match="one per boundary"):
        simulate_pipeline(3, 4, F, B, link=[FREE], activation_bytes=1)
    with pytest.raises(ValueError, match="forward"):
        simulate_pipeline(3, 4, [F, F], B, link=FREE, activation_bytes=1)
    with pytest.raises(ValueError, match="unknown codec"):
        pipeline_codec("int3")


# ------------------------------------------------------------------------------------ the 2x2
def _ready(ev: dict, e) -> float:
    """When both sides of wire event ``e`` had posted (a chunk: its sender and its twin, rank ^ 2)."""
    dst = {"act": e.stage + 1, "grad": e.stage - 1, "dp": e.stage ^ 2}[e.kind]
    return max(ev[e.stage, f"send_{e.kind}", e.mb].start, ev[dst, f"recv_{e.kind}", e.mb].start)


def test_two_by_two_fifo_and_priority_serve_as_defined():
    """Each direction of the node link picks, when free, the earliest ready message (FIFO) or the
    earliest ready boundary message before any all-reduce chunk (priority), one at a time; the free
    link is the pipeline's own floor; the all-reduce moves every chunk of both stages both ways."""
    M, act, grads = 6, 1 << 20, [3 << 20, 5 << 19]
    link = LinkModel(1e-4, 8 / 200e6)
    node = {0: 0, 1: 1, 2: 1, 3: 0}  # of rank 2 pipe + stage
    sizes = [1 << 20] * 3 + [1 << 20, 1 << 20, 1 << 19]  # stage 0's chunks, stage 1's
    steps = {}
    for issue in ("after", "bucketed"):
        for sharing in ("fifo", "priority"):
            r = simulate_pipeline_dp(M, 0.03, 0.06, link=link, activation_bytes=act, dp_bytes=grads,
                                     sharing=sharing, dp_issue=issue, dp_chunk_bytes=1 << 20)
            steps[issue, sharing] = r.step
            assert r.floor == pytest.approx((M + 1) * 0.09)
            ev = {(e.stage, e.kind, e.mb): e for e in r.trace if e.kind != "B"}
            dp = [e for e in r.trace if e.kind == "dp"]
            assert sorted(e.end - e.start for e in dp) == pytest.approx(sorted(2 * [link.time(n) for n in sizes]))
            wires = [e for e in r.trace if e.kind in ("act", "grad", "dp")]
            assert len(wires) == len(dp) + 2 * 2 * M
            for src in (0, 1):
                on = sorted((e for e in wires if node[e.stage] == src), key=lambda e: e.start)
                assert all(a.end <= b.start + 1e-12 for a, b in zip(on, on[1:]))
                for i, e in enumerate(on):  # nothing the policy ranks first was ready and left waiting
                    for o in on[i + 1:]:
                        if _ready(ev, o) < e.start - 1e-12:
                            if sharing == "fifo":
                                assert _ready(ev, o) >= _ready(ev, e) - 1e-12, (issue, e, o)
                            else:
                                assert o.kind == "dp" or e.kind != "dp", (issue, e, o)
    assert steps["after", "priority"] < steps["after", "fifo"]


# ------------------------------------------------------------------------------------ torch's order
def _torch_order(M: int, kind: str) -> list[tuple[str, int]]:
    """Run torch's own single-stage schedule on this rank's stage (2 ranks, a Linear each) and record
    what it runs, posts and waits for in the second step: ('F', k), ('B', k), ('send_act', k), ...,
    ('wait_recv_grad', k), ...; the p2p ops through ``schedules._batch_p2p`` and
    ``schedules._wait_batch_p2p``, where both schedules post and wait for every op."""
    import torch
    import torch.distributed as dist
    import torch.distributed.pipelining.schedules as sch
    from torch import nn
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

    rank = dist.get_rank()
    torch.manual_seed(0)
    stage = PipelineStage(nn.Linear(4, 4), rank, 2, torch.device("cpu"))
    schedule = (Schedule1F1B if kind == "1f1b" else ScheduleGPipe)(stage, M, loss_fn=lambda y, t: (y - t).pow(2).mean())
    log: list[tuple[str, int]] = []
    counts: dict[str, int] = {}
    post, wait, fwd, bwd = sch._batch_p2p, sch._wait_batch_p2p, stage.forward_one_chunk, stage.backward_one_chunk
    label: dict[int, tuple[str, int]] = {}  # id of a Work -> the op it is for

    def posted(ops, desc=None):
        labels = []
        for op in ops:
            send = op.op is dist.isend
            what = ("send_" if send else "recv_") + ("act" if send == (rank == 0) else "grad")
            labels.append((what, counts.get(what, 0)))
            counts[what] = counts.get(what, 0) + 1
        log.extend(labels)
        works = post(ops, desc)
        label.update((id(w), x) for w, x in zip(works, labels))
        return works

    def waited(works):
        log.extend((f"wait_{label[id(w)][0]}", label[id(w)][1]) for w in works)
        return wait(works)

    def forward(i, *a, **k):
        log.append(("F", i))
        return fwd(i, *a, **k)

    def backward(i, *a, **k):
        log.append(("B", i))
        return bwd(i, *a, **k)

    x, target = torch.randn(2 * M, 4), torch.randn(2 * M, 4)
    stage.forward_one_chunk, stage.backward_one_chunk = forward, backward
    sch._batch_p2p, sch._wait_batch_p2p = posted, waited
    try:
        for _ in range(2):  # the first step also exchanges shapes
            log.clear()
            counts.clear()
            if rank == 0:
                schedule.step(x)
            else:
                schedule.step(target=target)
    finally:
        sch._batch_p2p, sch._wait_batch_p2p = post, wait
    return log


def _torch_orders(cases: list[tuple[int, str]]) -> list[list[tuple[str, int]]]:
    return [_torch_order(M, kind) for M, kind in cases]


def test_torch_policy_runs_and_posts_in_torchs_order(ranks):
    """The "torch" policy's forwards, backwards, sends, receives and waits, per stage, in the order
    torch's own Schedule1F1B and ScheduleGPipe run, post and wait for them (gloo, 2 ranks; 1F1B with M = S, where the
    deferred warmup send is the last forward's, and beyond)."""
    cases = [(2, "1f1b"), (3, "1f1b"), (5, "1f1b"), (3, "gpipe")]
    got = ranks(2, _torch_orders, cases, timeout=120)
    for i, (M, kind) in enumerate(cases):
        r = simulate_pipeline(2, M, F, B, link=_link(0.4), activation_bytes=1, schedule=kind, policy="torch")
        for s in range(2):
            order = [(e.kind, e.mb) for e in r.trace if e.stage == s and e.kind.startswith(("F", "B", "send_",
                                                                                              "recv_", "wait_"))]
            assert order == [tuple(x) for x in got[s][i]], (M, kind, s)


# ------------------------------------------------------------------------------------ the CLI
def test_bench_simulate_pp_rows(tmp_path, capsys):
    """``commopt-bench simulate --pp-stages``: the torch row on 2 stages is the closed form (with the
    ready notice, (M + 1)(f + b) + 2 M t) with t the link's time for the bench GPT's 1 MiB activation;
    the int8 rows carry the codec's bytes."""
    from commopt.bench.simulate import main

    out = tmp_path / "pp.json"
    assert main(["--pp-stages", "2,3", "--pp-micro", "4", "--link-rates", "200mbit,50mbit", "--codec", "none,int8",
                 "--pp-forward-ms", "60", "--pp-backward-ms", "120", "--link-latency-us", "100", "--pp-dp",
                 "--json", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    pp = [r for r in rows if r["kind"] == "pp"]
    assert len(pp) == 2 * 2 * 2 + 2 * 2 * 3  # (stages 2: 2 policies, 3: 3) x links x codecs
    act = 8 * 128 * 256 * 4
    for row in pp:
        if row["stages"] == 2 and row["policy"] == "torch" and row["codec"] == "none":
            t = 100e-6 + act * 8 / (200e6 if row["link"] == "200mbit" else 50e6)
            assert row["step_s"] == pytest.approx(5 * (0.03 + 0.06) + 2 * 4 * t)
            assert row["floor_s"] == pytest.approx(5 * 0.09)
        ratio = pipeline_codec(row["codec"]).ratio
        assert row["boundary_bytes"][0] == pytest.approx([4 * act * ratio] * 2)
    assert {r["dp_issue"] for r in rows if r["kind"] == "pp-dp"} == {"after", "bucketed"}
    assert "commopt/flat" in capsys.readouterr().out
