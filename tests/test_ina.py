"""Simulated in-network aggregation: protocol, switch and worker sessions (docs/faults.md rows 24-30).

One switch process (spawned) serves the whole module; workers are threads of the test process, each
with its own UDP session, so no test pays for importing torch in new processes. Every test uses its
own job id. Every test that runs workers joins them under a wall-clock guard, and the sessions' own
timeouts guarantee the threads end.
"""

from __future__ import annotations

import math
import os
import random
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import torch

from commopt.comm.errors import CollectiveMismatchError, CommTimeoutError, NonFiniteError
from commopt.comm.ina import (
    FaultConfig,
    InaSession,
    LinkFaults,
    Switch,
    SwitchProcess,
    dequantize,
    error_bound,
    ina_all_reduce,
    quantize,
)
from commopt.comm.ina.bfp import block_shift, headroom_bits, max_exponent
from commopt.comm.ina.protocol import (
    ERR_BAD_WORKERS,
    ERR_JOB_RUNNING,
    HEADER,
    MAGIC,
    MAX_PAYLOAD_ELEMS,
    PROTOCOL_VERSION,
    PacketType,
    pack_header,
    parse_header,
)
from commopt.comm.ina.session import draw_identity
from commopt.comm.ina.switch import DEFAULT_MAX_PENDING_PER_SOURCE

GUARD = 60.0  # wall-clock guard per multi-worker run (seconds)
_JOB = iter(range(1000, 60000))


@pytest.fixture(scope="module")
def switch():
    sw = SwitchProcess(partition_size=16)
    try:
        yield sw
    finally:
        code = sw.stop()
        assert code == 0, f"switch exit code {code}"


def _run(n: int, body: Callable[[int], Any], guard: float = GUARD) -> list[Any]:
    """Run ``body(worker)`` on n threads; return results, or re-raise the first worker's exception."""
    results: list[Any] = [None] * n
    errors: list[BaseException | None] = [None] * n

    def target(w: int) -> None:
        try:
            results[w] = body(w)
        except BaseException as e:  # noqa: BLE001 - handed to the test thread
            errors[w] = e

    threads = [threading.Thread(target=target, args=(w,), daemon=True) for w in range(n)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + guard
    for t in threads:
        t.join(max(0.0, deadline - time.monotonic()))
    alive = [w for w, t in enumerate(threads) if t.is_alive()]
    assert not alive, f"workers {alive} did not finish within the {guard:.0f} s guard"
    for e in errors:
        if e is not None:
            raise e
    return results


def _inputs(n: int, numel: int, dtype: torch.dtype, seed: int, scale: float = 1.0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(numel, generator=g, dtype=torch.float64) * scale * (1 + w)).to(dtype)
            for w in range(n)]


def _oracle(xs: list[torch.Tensor], op: str, headroom: int | None = None) -> tuple[torch.Tensor, int]:
    """The exact expected result: dequantize(integer sum of every worker's int32 codes)."""
    n = len(xs)
    e = max(max_exponent(x) for x in xs)
    shift = block_shift(e, n, headroom)
    total = sum(quantize(x, shift).astype(np.int64) for x in xs)
    assert np.abs(total).max(initial=0) < 2**31, "the oracle's integer sum left int32"
    return dequantize(total, shift, xs[0].dtype, n if op == "avg" else 1).view(xs[0].shape), shift


def _check(result: torch.Tensor, xs: list[torch.Tensor], op: str, headroom: int | None = None) -> None:
    expected, shift = _oracle(xs, op, headroom)
    assert torch.equal(result, expected), "not bit-equal to the integer sum of the quantized contributions"
    exact = sum(x.double() for x in xs) / (len(xs) if op == "avg" else 1)
    bound = error_bound(shift, len(xs)) / (len(xs) if op == "avg" else 1)
    half_ulp = exact.abs() * torch.finfo(result.dtype).eps  # rounding once to the output dtype
    assert bool(((result.double() - exact).abs() <= bound + half_ulp + 1e-300).all()), "outside the bound"


def _session(address: tuple[str, int], job: int, w: int, n: int, **kw: Any) -> InaSession:
    kw.setdefault("timeout", 20.0)
    return InaSession(address, job_id=job, worker_id=w, num_workers=n, **kw)


def test_exactness_all_dtypes_ops_sizes(switch):
    """docs/faults.md row 24 (no faults): bit-equal to the integer sum of the quantized contributions, within
    the documented bound of the fp64 sum; fp32/fp16/bf16, sum/avg, 0..multi-window sizes, 3 workers
    (not a power of two), non-contiguous tensors, and an all-zero tensor."""
    n, job = 3, next(_JOB)
    cases = [(dtype, op, numel) for dtype in (torch.float32, torch.float16, torch.bfloat16)
             for op in ("sum", "avg") for numel in (0, 1, 1000, 9000)]
    inputs = [_inputs(n, numel, dtype, seed=i) for i, (dtype, op, numel) in enumerate(cases)]

    def body(w: int) -> list[torch.Tensor]:
        out = []
        with _session(switch.address, job, w, n, payload_elems=1024, window=3) as s:
            for (_, op, _), xs in zip(cases, inputs):
                t = xs[w].clone()
                assert s.all_reduce(t, op) is t
                out.append(t)
            base = torch.arange(40, dtype=torch.float32).reshape(4, 10) * (w + 1)
            view = base[:, ::2]  # non-contiguous: reduced in place, the other columns untouched
            s.all_reduce(view)
            out.append(base)
            z = torch.zeros(5)
            s.all_reduce(z)
            out.append(z)
        return out

    results = _run(n, body)
    for i, ((_, op, _), xs) in enumerate(zip(cases, inputs)):
        for w in range(n):
            _check(results[w][i], xs, op)
    base = torch.arange(40, dtype=torch.float32).reshape(4, 10)
    for w in range(n):
        got = results[w][len(cases)]
        assert torch.equal(got[:, ::2], base[:, ::2] * 6) and torch.equal(got[:, 1::2], base[:, 1::2] * (w + 1))
        assert torch.equal(results[w][-1], torch.zeros(5))


def _faulty_run(switch: SwitchProcess, n: int, faults: Callable[[int], FaultConfig], rounds: int = 2,
                numel: int = 24000) -> tuple[list[dict[str, int]], list[dict[str, int]], dict[str, int]]:
    job = next(_JOB)
    inputs = [_inputs(n, numel, torch.float32, seed=100 + r) for r in range(rounds)]
    before = switch.stats()

    def body(w: int) -> tuple[dict[str, int], dict[str, int]]:
        with _session(switch.address, job, w, n, payload_elems=1024, window=8, faults=faults(w),
                      initial_rto=0.05) as s:
            for xs in inputs:
                t = xs[w].clone()
                s.all_reduce(t)
                _check(t, xs, "sum")
            return dict(s.counters), s.fault_stats

    out = _run(n, body)
    after = switch.stats()
    return [o[0] for o in out], [o[1] for o in out], {k: after[k] - before.get(k, 0) for k in after}


@pytest.mark.parametrize("direction", ["send", "recv"])
@pytest.mark.parametrize("loss", [0.01, 0.05, 0.10])
def test_loss_each_direction_exact(switch, loss, direction):
    """docs/faults.md row 24: 1 %, 5 %, 10 % loss worker->switch or switch->worker: results stay exactly the
    integer sum; retransmissions are counted and bounded by the retry budget."""
    link = LinkFaults(loss=loss)

    def faults(w: int) -> FaultConfig:
        return FaultConfig(seed=7, **{direction: link})

    counters, fstats, sw = _faulty_run(switch, 2, faults)
    dropped = sum(f[f"{direction}_dropped"] for f in fstats)
    retx = sum(c["retransmissions"] for c in counters)
    packets = sum(c["packets_sent"] for c in counters)
    if dropped:
        assert retx >= 1 and sw["retransmissions"] >= 1
    # Bounded: never more than the budget per chunk, and in practice a small multiple of the losses.
    assert retx <= 20 * (2 * 24 + 2) * 2
    assert retx <= 4 * dropped + packets // 2 + 8, (retx, dropped, packets)


def test_bursts_duplicates_reordering(switch):
    """docs/faults.md rows 24 and 25: loss bursts in both directions, duplicated and reordered packets in both
    directions: exact results; the switch ignores and counts the duplicates."""
    def faults(w: int) -> FaultConfig:
        link = LinkFaults(burst_start=0.02, burst_length=4, duplicate=0.1, reorder=0.1)
        return FaultConfig(seed=11, send=link, recv=link)

    counters, fstats, sw = _faulty_run(switch, 3, faults)
    assert sum(f["send_duplicated"] for f in fstats) > 0 and sum(f["send_reordered"] for f in fstats) > 0
    assert sw["duplicates_ignored"] > 0
    assert sum(c["duplicate_results"] + c["stale_received"] for c in counters) > 0


def test_lost_result_recovered_from_shadow_copy(switch):
    """docs/faults.md row 24: the result packet of chunk 0 is lost on its way to worker 0; worker 0's
    retransmission is answered from the slot's kept copy while the peer already uses the other copy."""
    n, job = 2, next(_JOB)
    xs = _inputs(n, 8 * 512, torch.float32, seed=3)
    before = switch.stats()

    def body(w: int) -> torch.Tensor:
        drop = ((PacketType.RESULT, 0, 0),) if w == 0 else ()
        # Worker 0 waits half a second before retransmitting, so its peer has long moved chunk 2
        # into the slot's other copy: the answer must come from the kept (shadow) copy.
        rto = 0.5 if w == 0 else 0.05
        with _session(switch.address, job, w, n, payload_elems=512, window=2,
                      faults=FaultConfig(drop_once=drop), initial_rto=rto, min_rto=rto) as s:
            t = xs[w].clone()
            s.all_reduce(t)
            return t

    for t in _run(n, body):
        _check(t, xs, "sum")
    after = switch.stats()
    assert after["results_resent"] > before["results_resent"]
    assert after["shadow_resends"] > before["shadow_resends"]


def _raw_socket() -> socket.socket:
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    s.bind(("127.0.0.1", 0))
    return s


def test_stale_and_foreign_packets_ignored(switch):
    """docs/faults.md row 25: packets of a foreign job id and stale packets of an earlier epoch are ignored and
    counted, while a job runs to exact results."""
    n, job = 2, next(_JOB)
    xs = _inputs(n, 3000, torch.float32, seed=5)
    payload = np.ones(10, dtype="<i4").tobytes()
    before = switch.stats()
    with _raw_socket() as raw:
        # A foreign job that never joined.
        raw.sendto(pack_header(PacketType.DATA, dtype=1, job_id=next(_JOB), num_workers=2, slot=1, count=10)
                   + payload, switch.address)
        sessions = [_session(switch.address, job, w, n) for w in range(n)]
        try:
            for t in _run(n, lambda w: sessions[w].all_reduce(xs[w].clone())):
                _check(t, xs, "sum")
            # The job is at epoch >= 1 now: epoch 0 (and a wrong session tag) is stale.
            raw.sendto(pack_header(PacketType.DATA, dtype=1, job_id=job, num_workers=2, slot=1, epoch=0,
                                   count=10) + payload, switch.address)
            raw.sendto(pack_header(PacketType.CTRL, dtype=1, job_id=job, num_workers=2, slot=0, epoch=0,
                                   count=13) + np.zeros(13, dtype="<i4").tobytes(), switch.address)
            for t in _run(n, lambda w: sessions[w].all_reduce(xs[w].clone())):
                _check(t, xs, "sum")
        finally:
            for sess in sessions:
                sess.close()
    after = switch.stats()
    assert after["foreign_dropped"] - before["foreign_dropped"] >= 1
    assert after["stale_dropped"] - before["stale_dropped"] >= 2
    # Consecutive one-shot calls (a new session, hence a new epoch, per call) stay correct.
    for seed in (6, 7):
        ys = _inputs(n, 500, torch.float32, seed=seed)
        outs = _run(n, lambda w, ys=ys: ina_all_reduce(ys[w].clone(), address=switch.address, job_id=job,
                                                        worker_id=w, num_workers=n, timeout=20.0))
        for t in outs:
            _check(t, ys, "sum")


def test_stalled_worker_then_next_job(switch):
    """docs/faults.md row 26: a worker stalls mid-job (stops after one collective): the others raise
    CommTimeoutError within timeout + slack naming it; the job's slots are freed when its next
    incarnation joins, and that next job succeeds."""
    n, job, timeout = 3, next(_JOB), 2.0
    xs = _inputs(n, 20000, torch.float32, seed=9)

    def body(w: int) -> tuple[str, float]:
        with _session(switch.address, job, w, n, timeout=timeout, payload_elems=1024, window=4,
                      initial_rto=0.05) as s:
            s.all_reduce(xs[w].clone())
            if w == 2:
                return "stalled", 0.0
            t0 = time.monotonic()
            try:
                s.all_reduce(xs[w].clone())
            except CommTimeoutError as e:
                assert e.ranks == [2], e
                assert "seq=" in str(e) and "rank(s) [2]" in str(e)
                return "timeout", time.monotonic() - t0
            return "finished", 0.0

    out = _run(n, body)
    assert out[2][0] == "stalled"
    for w in (0, 1):
        assert out[w][0] == "timeout" and out[w][1] < timeout + 3.0, out
    before = switch.stats()
    for t in _run(n, lambda w: _session(switch.address, job, w, n).all_reduce(xs[w].clone())):
        _check(t, xs, "sum")
    after = switch.stats()
    assert after["epochs"] > before["epochs"]


def test_overflow_headroom_and_rescale(switch):
    """docs/faults.md row 27: inputs at the top of their exponent on every worker, all the same sign, whose
    naive int32 sum would wrap: the agreed exponent's headroom keeps the sum in range; with the
    headroom removed the switch saturates, flags it, and every worker redoes the round with headroom
    instead of wrapping."""
    n = 4
    big = torch.full((3000,), 0.999 * 2.0**10)
    xs = [big.clone() for _ in range(n)]
    e = max_exponent(big)
    naive = int(np.int64(quantize(big, 30 - e)[0]) * n)
    assert naive > 2**31, "the naive (no headroom) sum must overflow int32 for this test"
    for headroom in (None, 0):
        job = next(_JOB)
        before = switch.stats()
        out = _run(n, lambda w, job=job, headroom=headroom: (
            lambda s: (s.all_reduce(xs[w].clone()), dict(s.counters)))(
                _session(switch.address, job, w, n, headroom=headroom)))
        for t, counters in out:
            _check(t, xs, "sum", headroom=headroom_bits(n))
            assert counters["rescaled_rounds"] == (1 if headroom == 0 else 0)
        if headroom == 0:
            assert switch.stats()["saturated_slots"] > before["saturated_slots"]


def test_nonfinite_mismatch_and_bad_dtypes(switch):
    """docs/faults.md row 27 (and rows 1, 3 for INA): NaN/Inf on one rank raises NonFiniteError on every rank
    before quantizing; a numel mismatch raises CollectiveMismatchError on every rank; the session stays
    usable after both; integer tensors and unknown ops are rejected up front."""
    n, job = 3, next(_JOB)

    def body(w: int) -> list[str]:
        seen = []
        with _session(switch.address, job, w, n) as s:
            with pytest.raises(TypeError):
                s.all_reduce(torch.ones(3, dtype=torch.int32))
            with pytest.raises(ValueError):
                s.all_reduce(torch.ones(3), "max")
            t = torch.ones(4)
            if w == 1:
                t[2] = float("nan")
            try:
                s.all_reduce(t)
            except NonFiniteError as e:
                assert e.ranks == [1] and e.seq is not None
                seen.append("nonfinite")
            try:
                s.all_reduce(torch.ones(5 + (w == 2)))
            except CollectiveMismatchError as e:
                assert "numel" in str(e)
                seen.append("mismatch")
            t = torch.full((7,), float(w))
            s.all_reduce(t, "avg")
            assert torch.equal(t, torch.full((7,), 1.0))
            seen.append("ok")
        return seen

    assert _run(n, body) == [["nonfinite", "mismatch", "ok"]] * n

    # Sessions that would map chunks to slots differently are caught before any data moves.
    job = next(_JOB)

    def windows(w: int) -> str:
        with _session(switch.address, job, w, n, window=4 + w) as s:
            with pytest.raises(CollectiveMismatchError, match="window"):
                s.all_reduce(torch.ones(10))
        return "mismatch"

    assert _run(n, windows) == ["mismatch"] * n


def _malformed(rng: random.Random) -> list[tuple[str, bytes]]:
    ok = dict(dtype=1, job_id=1, num_workers=2, slot=1, count=4)
    p4 = b"\0" * 16
    hdr = pack_header(PacketType.DATA, **ok)
    return [
        ("bad_length", hdr[:20]),
        ("bad_magic", b"XINA" + hdr[4:] + p4),
        ("bad_version", MAGIC + bytes([PROTOCOL_VERSION + 1]) + hdr[5:] + p4),
        ("bad_type", pack_header(PacketType.RESULT, **ok) + p4),
        ("bad_type", pack_header(77, **ok) + p4),
        ("bad_count", pack_header(PacketType.DATA, **{**ok, "count": MAX_PAYLOAD_ELEMS + 1}) + p4),
        ("bad_length", hdr + p4 + b"\0"),  # payload longer than count says
        ("bad_length", hdr + p4[:-4]),  # shorter
        ("bad_length", pack_header(PacketType.DATA, **ok) + b"\0" * 65000),  # oversized datagram
        ("bad_worker", pack_header(PacketType.DATA, **{**ok, "worker_id": 2}) + p4),
        ("bad_worker", pack_header(PacketType.DATA, **{**ok, "num_workers": 0}) + p4),
        ("bad_worker", pack_header(PacketType.DATA, **{**ok, "num_workers": 65}) + p4),
        ("bad_slot", pack_header(PacketType.DATA, **{**ok, "slot": 16}) + p4),
        ("bad_slot", pack_header(PacketType.DATA, **{**ok, "slot": 0}) + p4),  # data on the control slot
        ("bad_dtype", pack_header(PacketType.DATA, **{**ok, "dtype": 9}) + p4),
        ("bad_flags", pack_header(PacketType.DATA, **{**ok, "flags": 0x80}) + p4),
    ]


def test_malformed_and_random_packets_counted(switch):
    """docs/faults.md row 28: truncated, bad magic/version, oversized length, worker or slot out of range,
    unknown dtype, and 10^4 random byte strings are rejected and counted, and the switch keeps
    serving (no pickle on that path: the header is struct-parsed and bounds-checked)."""
    rng = random.Random(28)
    crafted = _malformed(rng)
    before = switch.stats()
    with _raw_socket() as raw:
        for _, pkt in crafted:
            raw.sendto(pkt, switch.address)
        switch.stats()  # the reply comes after every earlier datagram was handled
        sent = 0
        while sent < 10_000:
            for _ in range(500):
                size = rng.choice([0, 1, 39, 40, 41, rng.randrange(0, 2000)])
                raw.sendto(rng.randbytes(size), switch.address)
                sent += 1
            switch.stats()  # pace: keep the switch's receive buffer from overflowing
    after = switch.stats()
    delta = {k: after[k] - before.get(k, 0) for k in after}
    assert delta["malformed_dropped"] == len(crafted) + 10_000, delta
    for reason in {r for r, _ in crafted}:
        assert delta[reason] >= sum(1 for r, _ in crafted if r == reason), (reason, delta)
    # Still serving.
    n, job = 2, next(_JOB)
    xs = _inputs(n, 100, torch.float32, seed=28)
    for t in _run(n, lambda w: _session(switch.address, job, w, n).all_reduce(xs[w].clone())):
        _check(t, xs, "sum")


def test_switch_binds_loopback_by_default(switch):
    """docs/faults.md row 29: the switch (object, spawned process and CLI) binds to 127.0.0.1 unless told
    otherwise; the CLI prints its address, answers stats, and exits 0 on SIGTERM."""
    sw = Switch()
    try:
        assert sw.sock.getsockname()[0] == "127.0.0.1"
    finally:
        sw.close()
    assert switch.address[0] == "127.0.0.1"
    proc = subprocess.Popen([sys.executable, "-m", "commopt.bench", "ina-switch", "--port", "0"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        timer = threading.Timer(GUARD, proc.kill)
        timer.start()
        line = proc.stdout.readline()
        timer.cancel()
        assert "listening on 127.0.0.1:" in line, line + proc.stderr.read()
        port = int(line.split("listening on 127.0.0.1:")[1].split()[0])
        from commopt.comm.ina import query_stats

        assert query_stats(("127.0.0.1", port))["stats_requests"] == 1
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=20) == 0
        assert "stats_requests=1" in proc.stdout.read()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        proc.stdout.close()
        proc.stderr.close()


def test_session_lifecycle_no_leaks(switch):
    """docs/faults.md row 30: 20 cycles of session open -> all-reduce -> close leak no file descriptors or
    threads."""
    n, job = 2, next(_JOB)

    def cycle(w: int) -> None:
        with _session(switch.address, job, w, n) as s:
            t = torch.full((10,), 1.0 + w)
            s.all_reduce(t)
            assert torch.equal(t, torch.full((10,), 3.0))
        assert s.closed

    _run(n, cycle)  # warm up (lazily created fds of the interpreter)
    fds = len(os.listdir("/proc/self/fd"))
    threads = threading.active_count()
    for _ in range(20):
        _run(n, cycle)
    assert len(os.listdir("/proc/self/fd")) <= fds
    assert threading.active_count() == threads
    stats = switch.stats()  # every cycle's LEAVEs freed its partition
    assert stats["jobs_released"] >= 21


def test_protocol_header_roundtrip():
    """docs/faults.md row 28: the header is a fixed 48-byte struct (version 2: with the 64-bit job identity);
    packing then validating gives the fields back, the published offsets point at the fields' bytes,
    and struct refuses out-of-range values at the sender."""
    from commopt.comm.ina.protocol import (
        COUNT_OFFSET,
        FLAGS_OFFSET,
        OFFSETS,
        TAG_OFFSET,
        pack_header_of,
        parse_header,
        peek_count,
        peek_flags,
        poke_flags,
        same_but_tag,
        segment_tags,
        set_segment_tags,
        unpack_header,
    )

    pkt = pack_header(PacketType.DATA, flags=1, dtype=3, job_id=65535, worker_id=63, num_workers=64, slot=5,
                      nonce=2**64 - 1, epoch=2**32 - 1, round=7, seq=9, count=2, exponent=-5, tag=123) + b"\0" * 8
    assert HEADER.size == 48 and PROTOCOL_VERSION == 2
    h = parse_header(pkt, len(pkt), allowed=PacketType.TO_SWITCH, max_slot=16)
    assert (h.job_id, h.worker_id, h.num_workers, h.slot, h.nonce, h.epoch, h.exponent, h.tag) == (
        65535, 63, 64, 5, 2**64 - 1, 2**32 - 1, -5, 123)
    # Independent of the table: read the fields back from the bytes at the published offsets.
    assert pkt[FLAGS_OFFSET] == 1 and int.from_bytes(pkt[COUNT_OFFSET:COUNT_OFFSET + 4], "big") == 2
    assert int.from_bytes(pkt[TAG_OFFSET:TAG_OFFSET + 4], "big") == 123 and TAG_OFFSET + 4 == HEADER.size
    assert pkt[OFFSETS["nonce"]:OFFSETS["nonce"] + 8] == b"\xff" * 8
    # The named accessors every other module uses read and write the same bytes.
    buf = bytearray(pkt)
    assert peek_flags(buf) == 1 and peek_count(buf) == 2 and unpack_header(buf) == h
    poke_flags(buf, 3)
    assert buf[FLAGS_OFFSET] == 3 and pack_header_of(unpack_header(buf)) == bytes(buf[:HEADER.size])
    rows = np.frombuffer(bytearray(pkt[:HEADER.size] * 3), dtype=np.uint8).reshape(3, HEADER.size).copy()
    set_segment_tags(rows, np.array([0, 356, 712]))
    assert segment_tags(rows).tolist() == [0, 356, 712] and same_but_tag(rows)
    rows[2, COUNT_OFFSET] ^= 1
    assert not same_but_tag(rows)
    with pytest.raises(struct.error):
        pack_header(PacketType.DATA, job_id=70000)
    with pytest.raises(struct.error):
        pack_header(PacketType.DATA, nonce=2**64)
    # The identity travels as int64 lanes in the agreeing broadcast: every nonce survives the trip.
    from commopt.comm.ina.session import identity_of, identity_tensor

    for ident in ((1, 0), (65535, 2**64 - 1), (7, 2**63), (3, 2**63 - 1)):
        assert identity_of(identity_tensor(ident)) == ident
    assert math.isclose(error_bound(30, 2), 2.0**-30)


def test_quantize_matches_float64_reference():
    """docs/faults.md row 27: the float32 quantizer gives exactly round-half-even(x * 2**s) computed in float64
    (an independent oracle), for every dtype, magnitudes from tiny to large, and shifts of both signs."""
    g = torch.Generator().manual_seed(27)
    scales = {torch.float32: (1e-30, 1e-3, 1.0, 1e4, 3e37), torch.float16: (1e-3, 1.0, 1e3),
              torch.bfloat16: (1e-30, 1.0, 3e37)}
    for dtype, dtype_scales in scales.items():
        for scale in dtype_scales:
            x = (torch.randn(4096, generator=g, dtype=torch.float64) * scale).to(dtype)
            shift = block_shift(max_exponent(x), 2)
            ties = torch.tensor([0.5, 1.5, -2.5], dtype=torch.float64)  # exact ties: to even
            x[:3] = torch.ldexp(ties, torch.tensor(-shift, dtype=torch.float64)).to(dtype)
            assert block_shift(max_exponent(x), 2) == shift
            ref = torch.round(torch.ldexp(x.double(), torch.tensor(shift, dtype=torch.float64))).to(torch.int64)
            assert ref.abs().max() < 2**30
            got = quantize(x, shift).astype(np.int64)
            assert np.array_equal(got, ref.numpy()), (dtype, scale)
            if bool((x[:3] != 0).all()):  # the ties survived the cast to the dtype
                assert got[:3].tolist() == [0, 2, -2]


def test_jobs_share_the_switch_through_partitions():
    """docs/faults.md row 25: two jobs of different sizes aggregate concurrently on one switch, each exactly,
    in their own partitions; a job beyond the pool's partitions is refused with a clear error, and
    gets one once another job leaves."""
    from commopt.comm.errors import CommError

    with SwitchProcess(pool_slots=32, partition_size=16) as sw:  # two partitions
        xa, xb = _inputs(2, 30000, torch.float32, seed=1), _inputs(3, 20000, torch.float16, seed=2)
        members = [("a", 0), ("a", 1), ("b", 0), ("b", 1), ("b", 2)]
        sessions = [_session(sw.address, 11 if j == "a" else 12, w, 2 if j == "a" else 3, payload_elems=2048,
                             window=8) for j, w in members]
        try:
            out = _run(5, lambda i: sessions[i].all_reduce((xa if members[i][0] == "a" else xb)[members[i][1]]
                                                           .clone()))
            for i, (j, _) in enumerate(members):
                _check(out[i], xa if j == "a" else xb, "sum")
            with _session(sw.address, 13, 0, 2, timeout=5.0) as extra:  # refused at its JOIN
                with pytest.raises(CommError, match="no free slot partition"):
                    extra.all_reduce(torch.ones(4))
        finally:
            for s in sessions[:2]:
                s.close()  # job 11 leaves: its partition is freed
        for s in sessions[2:]:
            s.close()
        assert sw.stats()["jobs_refused"] == 1 and sw.stats()["jobs_released"] == 2
        ys = _inputs(2, 100, torch.float32, seed=3)
        for t in _run(2, lambda w: _session(sw.address, 13, w, 2).all_reduce(ys[w].clone())):
            _check(t, ys, "sum")


def _delta(before: dict[str, int], after: dict[str, int]) -> dict[str, int]:
    return {k: after[k] - before.get(k, 0) for k in after}


def test_two_jobs_sharing_a_job_id_stay_apart(switch):
    """docs/faults.md row 25: two independent jobs with the same job id (as two worlds with the same group
    name had) but their own drawn nonces aggregate at the same time on one switch: job A sends 1.0
    and job B 100.0 on every call, and each gets exactly its own sum, 2.0 and 200.0, on every call;
    the two identities differ; packets with the job id and a foreign nonce are refused and counted."""
    job = next(_JOB)
    nonces = (draw_identity()[1], draw_identity()[1])
    assert nonces[0] != nonces[1]
    members = [(j, w) for j in (0, 1) for w in (0, 1)]
    values = (1.0, 100.0)
    before = switch.stats()
    sessions = [_session(switch.address, job, w, 2, nonce=nonces[j], payload_elems=1024, window=4)
                for j, w in members]
    barrier = threading.Barrier(4)

    def body(i: int) -> list[torch.Tensor]:
        out = []
        for _ in range(4):
            barrier.wait(GUARD / 2)  # every call of one job overlaps a call of the other
            t = torch.full((3000,), values[members[i][0]])
            sessions[i].all_reduce(t)
            out.append(t)
        return out

    try:
        results = _run(4, body)
        during = switch.stats()
        with _raw_socket() as raw:
            foreign = (nonces[0] ^ nonces[1]) or 1
            raw.sendto(pack_header(PacketType.DATA, dtype=1, job_id=job, num_workers=2, slot=1, nonce=foreign,
                                   epoch=sessions[0].epoch, count=10) + np.ones(10, dtype="<i4").tobytes(),
                       switch.address)
        for t in _run(4, lambda i: sessions[i].all_reduce(torch.full((3000,), values[members[i][0]]))):
            assert t.unique().numel() == 1
    finally:
        for sess in sessions:
            sess.close()
    for i, (j, _) in enumerate(members):
        for t in results[i]:
            assert torch.equal(t, torch.full((3000,), 2 * values[j])), (j, t[:3])
    d = _delta(before, during)
    assert d["epochs"] == 2 and d["jobs_active"] == 2 and d["foreign_dropped"] == 0, d
    d = _delta(during, switch.stats())
    assert d["identity_refused"] == 1 and d["foreign_dropped"] == 1 and d["jobs_released"] == 2, d


def test_forged_join_and_leave_cannot_touch_a_running_job(switch):
    """docs/faults.md row 28: forged JOINs for a running job (the issue's one-worker JOIN, re-JOINs of its
    workers with other sessions, a JOIN with more workers) and forged LEAVEs of its workers are refused
    and counted, each JOIN answered with an ERROR to the forger only; the running job keeps its epoch
    and worker count and its next all-reduces are exact. The forger knows the job's identity here,
    the worst case."""
    n, job = 2, next(_JOB)
    nonce = draw_identity()[1]
    xs = _inputs(n, 5000, torch.float32, seed=31)
    sessions = [_session(switch.address, job, w, n, nonce=nonce, payload_elems=1024, window=4) for w in range(n)]
    forged = [dict(worker_id=0, num_workers=1), dict(worker_id=0, num_workers=2),
              dict(worker_id=1, num_workers=2), dict(worker_id=2, num_workers=3)]
    try:
        for t in _run(n, lambda w: sessions[w].all_reduce(xs[w].clone())):
            _check(t, xs, "sum")
        epoch = sessions[0].epoch
        before = switch.stats()
        codes = []
        with _raw_socket() as raw:
            raw.settimeout(10.0)
            for i, fields in enumerate(forged):
                raw.sendto(pack_header(PacketType.JOIN, job_id=job, nonce=nonce, tag=0xF00D + i, **fields),
                           switch.address)
            for w in range(n):
                raw.sendto(pack_header(PacketType.LEAVE, job_id=job, worker_id=w, num_workers=n, nonce=nonce,
                                       epoch=epoch, tag=0xBAD0 + w), switch.address)
            buf = bytearray(65536)
            for _ in forged:
                nbytes = raw.recv_into(buf)
                h = parse_header(buf, nbytes, allowed=PacketType.TO_WORKER)
                assert h.ptype == PacketType.ERROR and (h.job_id, h.nonce) == (job, nonce), h
                codes.append(h.exponent)
        assert sorted(codes) == sorted([ERR_BAD_WORKERS, ERR_JOB_RUNNING, ERR_JOB_RUNNING, ERR_BAD_WORKERS])
        d = _delta(before, switch.stats())
        assert d["joins_refused"] == len(forged) and d["leaves_refused"] == n and d["epochs"] == 0, d
        for seed in (32, 33, 34):
            ys = _inputs(n, 5000, torch.float32, seed=seed)
            for t in _run(n, lambda w, ys=ys: sessions[w].all_reduce(ys[w].clone())):
                _check(t, ys, "sum")
        assert [s.epoch for s in sessions] == [epoch] * n
        assert _delta(before, switch.stats())["epochs"] == 0
    finally:
        for sess in sessions:
            sess.close()


def _wait_for(switch: SwitchProcess, pred: Callable[[dict[str, int]], bool], seconds: float) -> dict[str, int]:
    deadline = time.monotonic() + seconds
    while True:
        stats = switch.stats()
        if pred(stats) or time.monotonic() > deadline:
            return stats
        time.sleep(0.1)


def _reduce_once(address: tuple[str, int], job: int, w: int, x: torch.Tensor, **kw: Any) -> torch.Tensor:
    with _session(address, job, w, 2, **kw) as s:  # closed: its LEAVE frees the partition
        return s.all_reduce(x.clone())


def test_join_flood_is_bounded_and_released_within_seconds():
    """docs/faults.md row 28: a flood of JOINs that never complete: sixteen for unused job ids from one socket
    (the issue's attack) take at most max_pending_per_source partitions and the rest are refused and
    counted, while a real job still joins at once; sixteen from eight sockets take the pool's four
    partitions, and every abandoned JOIN releases its partition within seconds (the join timeout),
    after which a real job succeeds."""
    join_timeout = 1.0
    with SwitchProcess(pool_slots=64, partition_size=16, join_timeout=join_timeout) as sw:  # 4 partitions
        with _raw_socket() as raw:
            for j in range(16):
                raw.sendto(pack_header(PacketType.JOIN, job_id=100 + j, num_workers=2, tag=1), sw.address)
            s = sw.stats()
            assert s["jobs_active"] == DEFAULT_MAX_PENDING_PER_SOURCE, s
            assert s["joins_refused"] == 16 - DEFAULT_MAX_PENDING_PER_SOURCE and s["jobs_refused"] == 0, s
            xs = _inputs(2, 2000, torch.float32, seed=40)
            for t in _run(2, lambda w: _reduce_once(sw.address, 100, w, xs[w], nonce=7)):
                _check(t, xs, "sum")
        s = _wait_for(sw, lambda st: st["jobs_active"] == 0, join_timeout + 8.0)
        assert s["jobs_active"] == 0 and s["pending_released"] == DEFAULT_MAX_PENDING_PER_SOURCE, s
        socks = [_raw_socket() for _ in range(8)]
        try:
            before = sw.stats()
            for i, sock in enumerate(socks):
                for k in range(2):
                    sock.sendto(pack_header(PacketType.JOIN, job_id=200 + 2 * i + k, num_workers=3, tag=1),
                                sw.address)
            d = _delta(before, sw.stats())
            assert d["jobs_active"] == 4 and d["jobs_refused"] == 12, d
        finally:
            for sock in socks:
                sock.close()
        s = _wait_for(sw, lambda st: st["jobs_active"] == 0, join_timeout + 8.0)
        assert s["jobs_active"] == 0 and _delta(before, s)["pending_released"] == 4, s
        assert sw.is_alive()
        ys = _inputs(2, 2000, torch.float32, seed=41)
        for t in _run(2, lambda w: _reduce_once(sw.address, 200, w, ys[w])):
            _check(t, ys, "sum")


def test_abandoned_join_for_an_ended_job_is_released():
    """docs/faults.md row 28: the JOIN of a job's next incarnation that never completes (worker 0 left and
    rejoined, worker 1 left and never came back) holds the job's partition only until the join
    timeout; then the pending JOIN is dropped and the partition freed, and both are counted."""
    sw = Switch(pool_slots=32, partition_size=16, join_timeout=0.2)  # in-process: handle() directly
    sinks = [_raw_socket() for _ in range(2)]
    try:
        addrs = [s.getsockname() for s in sinks]

        def feed(ptype: int, w: int, tag: int, epoch: int = 0) -> None:
            pkt = bytearray(pack_header(ptype, job_id=5, worker_id=w, num_workers=2, nonce=9, epoch=epoch, tag=tag))
            sw.handle(pkt, len(pkt), addrs[w])

        feed(PacketType.JOIN, 0, 10)
        feed(PacketType.JOIN, 1, 11)
        assert sw.stats()["epochs"] == 1 and sw.stats()["jobs_active"] == 1
        feed(PacketType.LEAVE, 0, 10, epoch=1)  # worker 0's session closed: the incarnation is over
        feed(PacketType.JOIN, 0, 20)  # its next session joins; worker 1's never does
        feed(PacketType.LEAVE, 1, 11, epoch=1)  # every worker left, but a JOIN is pending
        s = sw.stats()
        assert s["jobs_active"] == 1 and s["joins_refused"] == 0 and s["jobs_released"] == 0, s
        time.sleep(0.3)
        sw._housekeeping()
        s = sw.stats()
        assert s["jobs_active"] == 0 and s["pending_released"] == 1 and s["jobs_released"] == 1, s
        assert s["epochs"] == 1 and s["leaves_refused"] == 0
    finally:
        sw.close()
        for sock in sinks:
            sock.close()
