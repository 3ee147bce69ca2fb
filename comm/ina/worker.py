"""The worker side of in-network aggregation: block floating point, a packet window, retransmission.

One collective (``InaSession.all_reduce``) runs in phases:

(1) **join** (once per session): every worker sends JOIN with a fresh random session tag; the switch
    answers JOIN_OK with the job's new *epoch* once all ``num_workers`` have joined, which frees the
    job's slots from any earlier incarnation (a crashed job, a previous session). Every packet carries
    the job's identity, its id and a 64-bit nonce that all workers share (drawn on rank 0 and agreed
    through the process group by the ``"ina"`` backend and by ``all_reduce(algorithm="ina")``), so two
    independent jobs on one switch never share state.
(2) **agree** on the exponent through the switch's control slot (lane-wise MAX): each worker
    contributes the exponent ``E`` of its largest magnitude (``max|x| < 2**E``), its numel, dtype, op,
    headroom and a per-worker non-finite flag. Every worker gets the same answer, so a NaN/Inf on one
    rank raises :class:`NonFiniteError` on every rank before anything is quantized, and a numel/dtype/op
    mismatch raises :class:`CollectiveMismatchError` on every rank.
(3) **quantize** ``q = round(x * 2**s)`` to int32 with ``s = 30 - h - E_max``, ``h = ceil(log2 n)``
    headroom bits, so each ``|q| <= 2**(30-h)`` and the sum of n of them stays ``<= 2**30``: it cannot
    wrap. (The switch also saturates and flags any sum that would leave int32; a flagged round is
    redone with more headroom on every worker, since every worker sees the same flags.)
(4) **aggregate** through the switch: chunks of ``payload_elems`` lanes, at most ``window`` in
    flight, each on its own data slot; a slot is reused for the chunk ``window`` further on as soon as
    its result arrives (SwitchML's self-clocking), alternating the slot's two copies so that the
    previous result stays available for retransmission. A chunk whose result does not come back in
    time is retransmitted with exponential back-off; after ``max_retries`` unanswered retransmissions,
    or ``timeout`` seconds for the whole call, it raises :class:`CommTimeoutError`, naming the ranks the
    switch says have not contributed.
(5) **dequantize** ``sum(q) * 2**-s`` in float64 (divided by n for ``avg``), rounded once to the
    tensor's dtype.

Error bound (documented, tested): every worker's rounding error is at most ``2**(-s-1)``, so before
the final rounding to the output dtype ``|result - sum_fp64| <= n * 2**(-s-1)`` (``/ n`` for avg),
i.e. about ``n * 2**(h - 31)`` times the largest magnitude; then at most half an ulp of the dtype.
The result is exactly ``dequantize(sum of the workers' int32 codes)``: no other arithmetic touches it.
"""

from __future__ import annotations

import math
import secrets
import select
import socket
import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from ..errors import CollectiveMismatchError, CommError, CommTimeoutError, NonFiniteError
from .faults import FaultConfig, FaultInjector
from .protocol import (
    COUNT_OFFSET,
    CTRL_DTYPE,
    CTRL_EXP,
    CTRL_HEADROOM,
    CTRL_LANES,
    CTRL_NDTYPE,
    CTRL_NHEADROOM,
    CTRL_NNUMEL_HI,
    CTRL_NNUMEL_LO,
    CTRL_NOP,
    CTRL_NPAYLOAD,
    CTRL_NUMEL_HI,
    CTRL_NUMEL_LO,
    CTRL_NWINDOW,
    CTRL_OP,
    CTRL_PAYLOAD,
    CTRL_WINDOW,
    DEFAULT_PAYLOAD_ELEMS,
    DEFAULT_WINDOW,
    DTYPE_BF16,
    DTYPE_FP16,
    DTYPE_FP32,
    ERR_BAD_WORKERS,
    ERR_JOB_RUNNING,
    ERR_NO_PARTITION,
    ERR_PENDING_LIMIT,
    FLAG_RETX,
    FLAG_SATURATED,
    FLAG_SEGMENTED,
    FLAG_SHADOW,
    FLAGS_OFFSET,
    HEADER_SIZE,
    MAX_NONCE,
    MAX_PAYLOAD_ELEMS,
    MAX_WORKERS,
    SEGMENT_BYTES,
    SEGMENT_LANES,
    TAG_OFFSET,
    Header,
    PacketType,
    ProtocolError,
    pack_header,
    parse_header,
)

__all__ = [
    "ZERO_EXPONENT",
    "InaSession",
    "ina_all_reduce",
    "ina_all_reduce_for",
    "draw_identity",
    "agree_identity",
    "identity_tensor",
    "identity_of",
    "max_exponent",
    "headroom_bits",
    "block_shift",
    "quantize",
    "dequantize",
    "error_bound",
]

ZERO_EXPONENT = -(2**30)  # the exponent of an all-zero (or empty) tensor; loses every MAX
_DTYPE_CODES = {torch.float32: DTYPE_FP32, torch.float16: DTYPE_FP16, torch.bfloat16: DTYPE_BF16}
_OP_CODES = {"sum": 1, "avg": 2}
_SOCKET_BUFFER = 4 << 20
_OP = "ina/all_reduce"
_RETX_BURST = 2  # retransmissions per expiry of the window's timers (see _exchange)
_UDP_GRO = getattr(socket, "UDP_GRO", 104)  # linux/udp.h; Python 3.11 lacks the constant


def _scan(x: torch.Tensor) -> tuple[int, bool]:
    """(exponent, has NaN/Inf) in one pass: ``aminmax`` propagates NaN and shows +-Inf."""
    if x.numel() == 0:
        return ZERO_EXPONENT, False
    lo, hi = torch.aminmax(x.detach().reshape(-1))
    m = max(-float(lo), float(hi))
    if not math.isfinite(m):
        return ZERO_EXPONENT, True
    return (math.frexp(m)[1] if m != 0.0 else ZERO_EXPONENT), False


def max_exponent(x: torch.Tensor) -> int:
    """The exponent ``E`` with ``max|x| < 2**E`` (``ZERO_EXPONENT`` for all zeros or no elements)."""
    return _scan(x)[0]


def headroom_bits(num_workers: int) -> int:
    """``ceil(log2 n)``: the bits kept free so that the sum of n int32 codes cannot wrap."""
    return max(0, (num_workers - 1).bit_length())


def block_shift(exponent: int, num_workers: int, headroom: int | None = None) -> int:
    """The scale ``s`` of ``q = round(x * 2**s)``: codes of ``|q| <= 2**(30-h)``, sums ``<= 2**30``."""
    h = headroom_bits(num_workers) if headroom is None else headroom
    return 30 - h - exponent


def _as_float32_numpy(x: torch.Tensor) -> np.ndarray:
    """The tensor's values as a flat float32 numpy array (exact for fp16/bf16; a view when possible)."""
    flat = x.detach().reshape(-1)
    if flat.dtype != torch.float32 or flat.device.type != "cpu":
        flat = flat.to(device="cpu", dtype=torch.float32)
    return flat.numpy()


def _quantize_np(a: np.ndarray, shift: int, out: np.ndarray | None = None) -> np.ndarray:
    # Scaling by a power of two is exact in float32 here (|a * 2**shift| < 2**31: no overflow, and
    # anything that would underflow rounds to 0 anyway), and float32 integers above 2**24 are already
    # integral, so rint's ties-to-even rounding is the only rounding and the int32 cast is exact.
    scaled = np.ldexp(a, shift)
    np.rint(scaled, out=scaled)
    if out is None:
        return scaled.astype("<i4")
    out[:] = scaled
    return out


def quantize(x: torch.Tensor, shift: int) -> np.ndarray:
    """``round(x * 2**shift)`` (ties to even) as a flat little-endian int32 array.

    The worker quantizes chunk by chunk as packets leave (so that workers stay in step instead of
    all quantizing 16 MiB first); this whole-tensor form gives the same codes and is the oracle of
    the exactness tests.
    """
    return _quantize_np(_as_float32_numpy(x), shift)


def dequantize(codes: np.ndarray | torch.Tensor, shift: int, dtype: torch.dtype, divisor: int = 1) -> torch.Tensor:
    """``codes * 2**-shift / divisor`` computed in float64 and rounded once to ``dtype``."""
    t = codes if isinstance(codes, torch.Tensor) else torch.from_numpy(np.ascontiguousarray(codes))
    out = torch.ldexp(t.to(torch.float64), torch.tensor(float(-shift), dtype=torch.float64))
    if divisor != 1:
        out = out / divisor
    return out.to(dtype)


def error_bound(shift: int, num_workers: int) -> float:
    """The bound on ``|dequantized sum - fp64 sum|`` before rounding to the output dtype."""
    return num_workers * math.ldexp(1.0, -shift - 1)


class _Pending:
    __slots__ = ("chunk", "shadow", "deadline", "backoff", "unanswered", "sent_at", "retransmitted", "packet",
                 "parts", "got")

    def __init__(self, chunk: int, shadow: int, now: float, rto: float):
        self.chunk = chunk
        self.shadow = shadow
        self.deadline = now + rto
        self.backoff = 0
        self.unanswered = 0
        self.sent_at = now
        self.retransmitted = False
        self.packet: bytearray | None = None
        self.parts: set[int] | None = None  # first lanes of the result segments received so far
        self.got = 0  # result lanes received so far


class InaSession:
    """One worker's connection to the switch for one job; reused across collectives.

    The UDP socket is connected to the switch (so the kernel drops datagrams from anyone else) and
    stays open until :meth:`close`. Not thread-safe across calls by design of the protocol (every
    worker must issue the same collectives in the same order, DESIGN 2); a lock serialises callers.

    Args:
        address: the switch's (host, port).
        job_id: the job (one process group); 0..65535, the same on every worker.
        nonce: the job's identity with ``job_id`` (64 bits), the same on every worker; two independent
            jobs on one switch must not share (job_id, nonce). The ``"ina"`` backend and
            ``all_reduce(algorithm="ina")`` draw a random one on rank 0 and agree on it through the
            process group; the default 0 suits jobs whose ids are otherwise kept distinct.
        worker_id: this worker, ``0 <= worker_id < num_workers``.
        num_workers: workers in the job (at most 64).
        window: chunks in flight per worker (capped by the switch's partition size - 1).
        payload_elems: int32 lanes per datagram (see ``protocol`` for the default).
        timeout: default seconds a collective may take before :class:`CommTimeoutError`.
        max_retries: retransmissions of one chunk that go unanswered before giving up.
        initial_rto: first retransmission timeout in seconds; adapts to the measured round trip.
        max_rto: cap of the exponential back-off.
        min_rto: floor of the adaptive retransmission timeout (loopback round trips are far shorter,
            but a descheduled peer or switch is not a lost packet).
        headroom: bits of headroom (default ``ceil(log2 n)``); fewer is allowed and is corrected by
            saturation detection and a redone round, which is what tests of FAULTS 27 use.
        faults: seeded fault injection (tests); None sends and receives untouched.
        bind_host: local address; by default the kernel picks the interface that reaches the switch
            (loopback for a loopback switch).
        segmented_results: ask the switch for results as MTU-sized segments sent as UDP GSO
            super-packets, received whole through ``UDP_GRO`` (see ``protocol``: a fragmented 32 KiB
            datagram costs the kernel 5-6x more CPU); segments that arrive one by one work too.
    """

    def __init__(self, address: tuple[str, int], *, job_id: int, worker_id: int, num_workers: int,
                 nonce: int = 0, window: int = DEFAULT_WINDOW, payload_elems: int = DEFAULT_PAYLOAD_ELEMS,
                 timeout: float = 60.0,
                 max_retries: int = 20, initial_rto: float = 0.2, max_rto: float = 1.0,
                 min_rto: float = 0.05, headroom: int | None = None, faults: FaultConfig | None = None,
                 bind_host: str | None = None, segmented_results: bool = True):
        if not 1 <= num_workers <= MAX_WORKERS:
            raise ValueError(f"{_OP}: num_workers={num_workers} must be in 1..{MAX_WORKERS}")
        if not 0 <= worker_id < num_workers:
            raise ValueError(f"{_OP}: worker_id={worker_id} must be in 0..{num_workers - 1}")
        if not 0 <= job_id <= 0xFFFF:
            raise ValueError(f"{_OP}: job_id={job_id} must fit 16 bits")
        if not 0 <= nonce <= MAX_NONCE:
            raise ValueError(f"{_OP}: nonce={nonce} must fit 64 bits (unsigned)")
        if not 1 <= payload_elems <= MAX_PAYLOAD_ELEMS:
            raise ValueError(f"{_OP}: payload_elems={payload_elems} must be in 1..{MAX_PAYLOAD_ELEMS}")
        if window < 1 or max_retries < 0 or timeout <= 0 or not 0 < min_rto <= max_rto or not (
                0 < initial_rto <= max_rto):
            raise ValueError(f"{_OP}: need window >= 1, max_retries >= 0, timeout > 0 and "
                             f"0 < initial_rto <= max_rto (got {window}, {max_retries}, {timeout}, "
                             f"{initial_rto}, {max_rto})")
        self.address = (str(address[0]), int(address[1]))
        self.job_id = job_id
        self.nonce = nonce
        self.worker_id = worker_id
        self.num_workers = num_workers
        self.window = window
        self.payload_elems = payload_elems
        self.timeout = timeout
        self.max_retries = max_retries
        self.max_rto = max_rto
        self.min_rto = min_rto
        self.headroom = headroom
        self.segmented_results = segmented_results
        self._rto = initial_rto
        self._srtt: float | None = None
        self._rttvar = 0.0
        self._faults = FaultInjector(faults, salt=worker_id) if faults is not None else None
        self._tag = secrets.randbits(32) | 1
        self._epoch: int | None = None
        self._joining = False  # a JOIN went out: close() says LEAVE even before JOIN_OK
        self._round = 0
        self._uses: list[int] = []
        self._broken: str | None = None
        self._lock = threading.Lock()
        self._buf = bytearray(65536)
        self._inbox: list[bytes] = []
        self._missing: list[int] | None = None
        self.counters: dict[str, int] = dict.fromkeys(
            ("collectives", "packets_sent", "packets_received", "retransmissions", "timeouts_fired",
             "results", "duplicate_results", "stale_received", "malformed_received", "rescaled_rounds"), 0)
        self._sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        try:
            for opt in (socket.SO_RCVBUF, socket.SO_SNDBUF):
                self._sock.setsockopt(socket.SOL_SOCKET, opt, _SOCKET_BUFFER)
            if bind_host is not None:
                self._sock.bind((bind_host, 0))
            self._sock.connect(self.address)
            self._sock.setblocking(False)
            if segmented_results:
                try:
                    self._sock.setsockopt(socket.IPPROTO_UDP, _UDP_GRO, 1)
                except OSError:
                    pass  # no UDP GRO: the segments arrive one datagram each, which works too
        except OSError:
            self._sock.close()
            raise
        self._poller = select.poll()
        self._poller.register(self._sock, select.POLLIN)

    # -- public ----------------------------------------------------------------------------------

    @property
    def closed(self) -> bool:
        return self._sock.fileno() < 0

    @property
    def seq(self) -> int:
        """The sequence number the next collective will carry (rounds redone for rescaling count)."""
        return self._round

    @property
    def fault_stats(self) -> dict[str, int]:
        return self._faults.stats if self._faults is not None else {}

    def close(self) -> None:
        """Say LEAVE (twice: it is not acknowledged) and close the socket.

        The switch frees the job's partition once every worker of the epoch has left; a lost LEAVE
        only delays that until the job's idle timeout. A session that never got JOIN_OK says LEAVE
        too, which withdraws its JOIN. Nothing else holds the socket (no thread, no reference cycle),
        so it is closed here, not by the garbage collector.
        """
        if self.closed:
            return
        if self._epoch is not None or self._joining:
            leave = pack_header(PacketType.LEAVE, job_id=self.job_id, worker_id=self.worker_id,
                                num_workers=self.num_workers, nonce=self.nonce, epoch=self._epoch or 0,
                                tag=self._tag)
            for _ in range(2):
                try:
                    self._sock.send(leave)
                except OSError:
                    break
        self._sock.close()

    def __enter__(self) -> InaSession:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def all_reduce(self, tensor: torch.Tensor, op: str = "sum", *, timeout: float | None = None) -> torch.Tensor:
        """Sum (or average) ``tensor`` over all workers through the switch, in place.

        Args:
            tensor: fp32, fp16 or bf16, any shape or strides, any device (reduced through host memory).
            op: "sum" or "avg".
            timeout: seconds for the whole call (default: the session's).

        Returns:
            ``tensor``, holding the result.

        Raises:
            TypeError: not a floating tensor of a supported dtype.
            ValueError: unknown op.
            NonFiniteError: some rank's tensor has NaN/Inf (raised on every rank, nothing sent).
            CollectiveMismatchError: ranks disagree on numel, dtype or op (on every rank).
            CommTimeoutError: no result within ``timeout`` or the retry budget.
            CommError: the session is closed or broken by an earlier failure.
        """
        where = f"{_OP} seq={self._round} job {self.job_id} rank {self.worker_id}/{self.num_workers}"
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"{where}: expected a torch.Tensor, got {type(tensor).__name__}")
        if tensor.dtype not in _DTYPE_CODES:
            raise TypeError(f"{where}: dtype {tensor.dtype} (shape {list(tensor.shape)}) is not supported; "
                            "in-network aggregation sums float32, float16 or bfloat16 (reduce integer "
                            "tensors with algorithm='flat')")
        if tensor.is_sparse:
            raise TypeError(f"{where}: sparse tensors are not supported; densify first")
        if op not in _OP_CODES:
            raise ValueError(f"{where}: op={op!r} is not supported; use 'sum' or 'avg' (others: "
                             "algorithm='flat')")
        with self._lock:
            return self._all_reduce(tensor, op, self.timeout if timeout is None else timeout)

    # -- one collective --------------------------------------------------------------------------

    def _ranks(self) -> list[int]:
        return list(range(self.num_workers))

    def _check_usable(self) -> None:
        if self.closed:
            raise CommError(f"{_OP} on job {self.job_id}, worker {self.worker_id}: the session is closed; "
                            "create a new InaSession", op=_OP, seq=self._round, ranks=[self.worker_id])
        if self._broken is not None:
            raise CommError(f"{_OP} on job {self.job_id}, worker {self.worker_id}: the session failed "
                            f"earlier ({self._broken}) and its peers are out of step; close it and create "
                            "a new session on every rank (a new process group)", op=_OP, seq=self._round,
                            ranks=[self.worker_id])

    def _all_reduce(self, tensor: torch.Tensor, op: str, timeout: float) -> torch.Tensor:
        self._check_usable()
        self.counters["collectives"] += 1
        deadline = time.monotonic() + timeout
        x = tensor.detach()
        numel = x.numel()
        scanned_exponent, nonfinite = _scan(x)
        if self.num_workers == 1:
            if nonfinite:
                raise NonFiniteError(self._nonfinite_msg([0], tensor), op=_OP, seq=self._round, ranks=[0])
            return tensor  # the sum and the average over one worker are the input
        try:
            self._ensure_joined(deadline)
            exponent = scanned_exponent
            h = headroom_bits(self.num_workers) if self.headroom is None else self.headroom
            dcode = _DTYPE_CODES[tensor.dtype]
            values: np.ndarray | None = None
            result: torch.Tensor | None = None
            while True:
                rnd = self._round
                self._round += 1
                agreed = self._agree(rnd, exponent, numel, dcode, _OP_CODES[op], h, nonfinite, deadline)
                self._check_agreement(agreed, rnd, tensor, op)
                e_max, h = int(agreed[CTRL_EXP]), int(agreed[CTRL_HEADROOM])
                if numel == 0:
                    return tensor
                if e_max == ZERO_EXPONENT:
                    with torch.no_grad():
                        tensor.zero_()
                    return tensor
                shift = block_shift(e_max, self.num_workers, h)
                if values is None:
                    values = _as_float32_numpy(x)
                if result is None:
                    result = torch.empty(numel, dtype=tensor.dtype)
                saturated = self._aggregate(rnd, values, result, dcode, shift,
                                            self.num_workers if op == "avg" else 1, deadline)
                if not saturated:
                    break
                # Every worker saw the same saturation flags, so every worker redoes the round.
                self.counters["rescaled_rounds"] += 1
                h = max(h + 1, headroom_bits(self.num_workers))
                if h > 30:
                    raise CommError(f"{_OP} seq={rnd} job {self.job_id}: the switch saturated even with "
                                    f"{h} bits of headroom; a worker is sending out-of-range codes",
                                    op=_OP, seq=rnd, ranks=self._ranks())
            with torch.no_grad():  # like torch.distributed: the reduction is not part of the graph
                tensor.copy_(result.view(tensor.shape))  # also scatters into non-contiguous / CUDA tensors
            return tensor
        except CommTimeoutError as e:
            self._broken = f"{type(e).__name__} at seq {e.seq}"
            raise
        except (NonFiniteError, CollectiveMismatchError):
            raise  # every rank raised the same error at the same point: still in step
        except (CommError, OSError) as e:
            self._broken = f"{type(e).__name__}: {e}"
            if isinstance(e, OSError):
                raise CommError(f"{_OP} seq={self._round - 1} job {self.job_id} worker {self.worker_id}: "
                                f"socket error talking to the switch at {self._addr()}: {e}; check that "
                                "the switch runs (commopt-bench ina-switch)", op=_OP, seq=self._round - 1,
                                ranks=[self.worker_id]) from e
            raise

    def _addr(self) -> str:
        return f"{self.address[0]}:{self.address[1]}"

    def _nonfinite_msg(self, ranks: list[int], tensor: torch.Tensor) -> str:
        return (f"{_OP} job {self.job_id}: NaN or Inf in the input of rank(s) {ranks} "
                f"(shape {list(tensor.shape)}, {tensor.dtype}); nothing was quantized or sent. Find where "
                "the non-finite values come from (loss scaling, learning rate) or skip this step on every "
                "rank")

    def _check_agreement(self, agreed: np.ndarray, rnd: int, tensor: torch.Tensor, op: str) -> None:
        flags = agreed[CTRL_LANES:CTRL_LANES + self.num_workers]
        pairs = {"numel": (CTRL_NUMEL_LO, CTRL_NNUMEL_LO), "numel (high bits)": (CTRL_NUMEL_HI, CTRL_NNUMEL_HI),
                 "dtype": (CTRL_DTYPE, CTRL_NDTYPE), "op": (CTRL_OP, CTRL_NOP)}
        bad = [name for name, (a, b) in pairs.items() if int(agreed[a]) != -int(agreed[b])]
        if bad:
            raise CollectiveMismatchError(
                f"{_OP} seq={rnd} job {self.job_id}: ranks disagree on {', '.join(bad)} (this rank: "
                f"numel={tensor.numel()}, shape {list(tensor.shape)}, {tensor.dtype}, op={op}); every rank "
                "must all-reduce the same number of elements of the same dtype with the same op",
                op=_OP, seq=rnd, ranks=self._ranks())
        settings = {"headroom": (CTRL_HEADROOM, CTRL_NHEADROOM), "window": (CTRL_WINDOW, CTRL_NWINDOW),
                    "payload_elems": (CTRL_PAYLOAD, CTRL_NPAYLOAD)}
        bad = [name for name, (a, b) in settings.items() if int(agreed[a]) != -int(agreed[b])]
        if bad:
            raise CollectiveMismatchError(
                f"{_OP} seq={rnd} job {self.job_id}: ranks use different {', '.join(bad)} settings; create "
                "every rank's session with the same ones", op=_OP, seq=rnd, ranks=self._ranks())
        bad_ranks = [r for r in range(self.num_workers) if flags[r]]
        if bad_ranks:
            raise NonFiniteError(self._nonfinite_msg(bad_ranks, tensor), op=_OP, seq=rnd, ranks=bad_ranks)

    # -- phases ----------------------------------------------------------------------------------

    def _ensure_joined(self, deadline: float) -> None:
        if self._epoch is not None:
            return
        ident = dict(job_id=self.job_id, worker_id=self.worker_id, num_workers=self.num_workers,
                     nonce=self.nonce, tag=self._tag)
        join = pack_header(PacketType.JOIN, **ident)
        retx = pack_header(PacketType.JOIN, flags=FLAG_RETX, **ident)
        self._joining = True
        self._tx(join)
        backoff, unanswered = 0, 0
        next_send = time.monotonic() + self._rto
        while True:
            now = time.monotonic()
            if now >= deadline:
                self._raise_timeout("join", self._round, None, unanswered, deadline)
            if now >= next_send:
                unanswered += 1
                if unanswered > self.max_retries:
                    self._raise_timeout("join", self._round, None, unanswered, deadline)
                self._tx(retx)
                backoff += 1
                next_send = now + min(self._rto * 2 ** backoff, self.max_rto)
                continue
            got = self._rx(min(next_send, deadline) - now)
            if got is None:
                continue
            h, payload = got
            if h.job_id != self.job_id or h.nonce != self.nonce:
                self.counters["stale_received"] += 1
                continue
            if h.ptype == PacketType.JOIN_OK and h.num_workers == self.num_workers:
                tags = np.frombuffer(payload, dtype="<u4")
                if len(tags) == self.num_workers and int(tags[self.worker_id]) == self._tag:
                    self._epoch = h.epoch
                    self.window = max(1, min(self.window, h.slot))  # h.slot = data slots in the partition
                    self._uses = [0] * (self.window + 1)
                    return
            elif h.ptype == PacketType.STATUS:
                self._missing = self._bitmap_missing(h)
                unanswered = 0
            elif h.ptype == PacketType.ERROR:
                self._raise_switch_error(h, self._round)
            self.counters["stale_received"] += 1

    def _agree(self, rnd: int, exponent: int, numel: int, dcode: int, opcode: int, headroom: int,
               nonfinite: bool, deadline: float) -> np.ndarray:
        lanes = np.zeros(CTRL_LANES + self.num_workers, dtype="<i4")
        lo, hi = numel & 0x7FFFFFFF, numel >> 31
        lanes[CTRL_EXP] = exponent
        lanes[CTRL_NUMEL_LO], lanes[CTRL_NNUMEL_LO] = lo, -lo
        lanes[CTRL_NUMEL_HI], lanes[CTRL_NNUMEL_HI] = hi, -hi
        lanes[CTRL_DTYPE], lanes[CTRL_NDTYPE] = dcode, -dcode
        lanes[CTRL_OP], lanes[CTRL_NOP] = opcode, -opcode
        lanes[CTRL_HEADROOM], lanes[CTRL_NHEADROOM] = headroom, -headroom
        lanes[CTRL_WINDOW], lanes[CTRL_NWINDOW] = self.window, -self.window
        lanes[CTRL_PAYLOAD], lanes[CTRL_NPAYLOAD] = self.payload_elems, -self.payload_elems
        lanes[CTRL_LANES + self.worker_id] = int(nonfinite)
        out = np.empty_like(lanes)

        def deliver(lo: int, hi: int, payload: memoryview) -> None:
            out[lo:hi] = np.frombuffer(payload, dtype="<i4")

        self._exchange(PacketType.CTRL, rnd, len(lanes), lambda lo, hi: lanes.tobytes(), deliver, dcode, 0,
                       "agree", deadline)
        return out

    def _aggregate(self, rnd: int, values: np.ndarray, result: torch.Tensor, dcode: int, shift: int,
                   divisor: int, deadline: float) -> bool:
        """Quantize chunks as they leave and dequantize results as they arrive, into ``result``.

        Dequantizing per chunk overlaps it with waiting for the other chunks, and computes exactly
        what :func:`dequantize` computes on the whole sum (float64, one rounding to the dtype).
        """
        def payload(lo: int, hi: int) -> bytes:
            return _quantize_np(values[lo:hi], shift).data  # type: ignore[return-value]

        # sum * 2**-shift in float64 is exact (|sum| <= 2**31, and the shifts of fp32/fp16/bf16 inputs
        # keep the product far inside float64's normal range), so multiplying by the power of two is
        # ldexp; the float64 scratch is reused across chunks, and a float32 result is written through
        # a numpy view (one float64 -> float32 rounding, to nearest even, as torch's cast).
        scale = math.ldexp(1.0, -shift)
        scratch = np.empty(min(self.payload_elems, len(values)), dtype=np.float64)
        out32 = result.numpy() if result.dtype == torch.float32 else None

        def deliver(lo: int, hi: int, data: memoryview) -> None:
            f = scratch[: hi - lo]
            np.multiply(np.frombuffer(data, dtype="<i4"), scale, out=f)
            if divisor != 1:
                f /= divisor
            if out32 is not None:
                out32[lo:hi] = f
            else:
                result[lo:hi].copy_(torch.from_numpy(f))

        return self._exchange(PacketType.DATA, rnd, len(values), payload, deliver, dcode, shift, "aggregate",
                              deadline)

    def _exchange(self, ptype: int, rnd: int, total: int, payload_of: Callable[[int, int], bytes],
                  deliver: Callable[[int, int, memoryview], None], dcode: int, exponent: int, phase: str,
                  deadline: float) -> bool:
        """Send ``total`` lanes through the switch; hand each chunk's aggregate to ``deliver(lo, hi, data)``.

        ``payload_of(lo, hi)`` gives the little-endian int32 bytes of lanes ``lo:hi``; it is called once
        per chunk, as the chunk first leaves, and the packet is kept for retransmissions.

        Returns whether any result came back saturated. The window loop: keep ``window`` chunks in
        flight, one per slot; a result frees its slot for the chunk ``window`` further on; an expired
        chunk is retransmitted (flagged RETX, same slot copy) with exponential back-off.
        """
        ctrl = ptype == PacketType.CTRL
        per = total if ctrl else self.payload_elems
        nchunks = 1 if ctrl else -(-total // per)
        slots = [0] if ctrl else list(range(1, 1 + min(self.window, nchunks)))
        result_type = PacketType.CTRL_RESULT if ctrl else PacketType.RESULT
        pending: dict[int, _Pending] = {}
        saturated = False
        next_chunk = 0
        done = 0
        job, nonce, epoch = self.job_id, self.nonce, self._epoch
        assert epoch is not None
        seg = FLAG_SEGMENTED if self.segmented_results and not ctrl else 0
        ident = dict(dtype=dcode, job_id=job, worker_id=self.worker_id, num_workers=self.num_workers, nonce=nonce,
                     epoch=epoch, round=rnd, exponent=exponent, tag=self._tag)

        def send(slot: int, p: _Pending, retx: bool) -> None:
            if p.packet is None:
                lo = p.chunk * per
                hi = min(lo + per, total)
                p.packet = bytearray(pack_header(ptype, flags=p.shadow | seg, slot=slot, seq=p.chunk, count=hi - lo,
                                                 **ident))
                p.packet += payload_of(lo, hi)
            if retx:
                p.packet[FLAGS_OFFSET] = p.shadow | FLAG_RETX | seg
            self._tx(p.packet)

        def start(slot: int, chunk: int, now: float) -> None:
            nonlocal next_chunk
            use = self._uses[slot]
            self._uses[slot] = use + 1
            p = _Pending(chunk, FLAG_SHADOW if use & 1 else 0, now, self._rto)
            next_chunk = max(next_chunk, chunk + 1)
            pending[slot] = p
            send(slot, p, False)

        # The chunk -> slot map is static (chunk c on slot 1 + c % width), as in SwitchML: every
        # worker must put chunk c in the same slot copy, whatever order its results arrive in.
        width = len(slots)
        now = time.monotonic()
        for i, slot in enumerate(slots):
            start(slot, i, now)
        self._missing = None
        while done < nchunks:
            now = time.monotonic()
            if now >= deadline:
                first = min(pending, key=lambda s: pending[s].chunk)
                self._raise_timeout(phase, rnd, pending[first].chunk, pending[first].unanswered, deadline, first)
            earliest = min(p.deadline for p in pending.values())
            # Drain what has arrived before retransmitting anything: a worker that was descheduled for
            # longer than its RTO finds its results already queued, and must not resend the window.
            got = self._rx(min(earliest, deadline) - now)
            if got is None or now > earliest + self.max_rto:
                now = time.monotonic()
                fired = False
                # Oldest first, at most _RETX_BURST per firing: when one peer is late (descheduled on a
                # busy machine), every chunk of the window expires at once, and resending the whole
                # window only queues more data behind the data the switch already holds (measured in
                # the emulated cluster: bursts of whole-window resends, more queueing, more expiries).
                # The first resends' answers (a STATUS naming the late ranks, or the kept result) tell
                # which case it is; the others wait one more RTO.
                expired = sorted((p.chunk, slot) for slot, p in pending.items() if p.deadline <= now)
                for i, (_, slot) in enumerate(expired):
                    p = pending[slot]
                    if i >= _RETX_BURST and now < deadline:
                        p.deadline = now + self._rto
                        continue
                    fired = True
                    self.counters["timeouts_fired"] += 1
                    if now >= deadline or p.unanswered >= self.max_retries:
                        self._raise_timeout(phase, rnd, p.chunk, p.unanswered, deadline, slot)
                    p.unanswered += 1
                    p.backoff += 1
                    p.retransmitted = True
                    self.counters["retransmissions"] += 1
                    send(slot, p, True)
                    p.deadline = now + min(self._rto * 2 ** p.backoff, self.max_rto)
                if fired:
                    # Back off the estimate too (RFC 6298 5.5): Karn's rule takes no samples from
                    # retransmitted chunks, so only a slow chunk that made it in time can lower it again.
                    self._rto = min(self.max_rto, 2 * self._rto)
            if got is None:
                continue
            h, payload = got
            if h.job_id != job or h.nonce != nonce or h.epoch != epoch:
                if h.ptype == PacketType.ERROR and h.job_id == job and h.nonce == nonce:
                    self._raise_switch_error(h, rnd)
                self.counters["stale_received"] += 1
                continue
            p = pending.get(h.slot)
            if h.ptype == PacketType.STATUS:
                if p is not None and h.round == rnd and h.seq == p.chunk:
                    p.unanswered = 0  # the switch is alive and waiting for other workers
                    self._missing = self._bitmap_missing(h)
                    if self.worker_id not in self._missing:
                        # The switch holds this contribution: only a peer is late. Resending it again
                        # soon cannot help; resend after max_rto, in case the result is then lost.
                        p.deadline = max(p.deadline, time.monotonic() + self.max_rto)
                continue
            if h.ptype == PacketType.ERROR:
                self._raise_switch_error(h, rnd)
            if h.ptype != result_type or h.round != rnd or p is None or h.seq != p.chunk:
                if h.ptype == result_type and h.round == rnd and h.seq < next_chunk:
                    self.counters["duplicate_results"] += 1
                else:
                    self.counters["stale_received"] += 1
                continue
            lo = p.chunk * per
            hi = min(lo + per, total)
            if (h.flags & FLAG_SHADOW) != p.shadow:
                self.counters["stale_received"] += 1
                continue
            if h.flags & FLAG_SEGMENTED:
                # Segments of the result (one, or several that arrived as one GRO buffer): lanes
                # tag .. tag+count of the chunk, in SEGMENT_LANES steps; complete once all are in.
                off, k = h.tag, h.count
                if off % SEGMENT_LANES or k == 0 or off + k > hi - lo or (k % SEGMENT_LANES and off + k != hi - lo):
                    self.counters["stale_received"] += 1
                    continue
                if p.parts is None:
                    p.parts = set()
                offs = range(off, off + k, SEGMENT_LANES)
                if p.parts.isdisjoint(offs):
                    deliver(lo + off, lo + off + k, payload)
                    p.parts.update(offs)
                    p.got += k
                else:
                    new = [o for o in offs if o not in p.parts]
                    if not new:
                        self.counters["duplicate_results"] += 1
                        continue
                    for o in new:
                        m = min(SEGMENT_LANES, off + k - o)
                        deliver(lo + o, lo + o + m, payload[4 * (o - off):4 * (o - off + m)])
                        p.parts.add(o)
                        p.got += m
                if h.flags & FLAG_SATURATED:
                    saturated = True
                if p.got < hi - lo:
                    continue
            else:
                if h.count != hi - lo:
                    self.counters["stale_received"] += 1
                    continue
                deliver(lo, hi, payload)
                if h.flags & FLAG_SATURATED:
                    saturated = True
            self.counters["results"] += 1
            if not p.retransmitted:
                self._sample_rtt(now - p.sent_at)
            del pending[h.slot]
            done += 1
            if p.chunk + width < nchunks:
                start(h.slot, p.chunk + width, time.monotonic())
        return saturated

    # -- errors ----------------------------------------------------------------------------------

    def _bitmap_missing(self, h: Header) -> list[int]:
        bitmap = (h.tag & 0xFFFFFFFF) | ((h.exponent & 0xFFFFFFFF) << 32)
        return [r for r in range(self.num_workers) if not bitmap >> r & 1]

    def _raise_timeout(self, phase: str, rnd: int, chunk: int | None, unanswered: int, deadline: float,
                       slot: int | None = None) -> None:
        where = f"chunk {chunk} (slot {slot})" if chunk is not None else "the join handshake"
        if unanswered >= self.max_retries and time.monotonic() < deadline:
            why = (f"{unanswered} retransmissions went unanswered: the switch at {self._addr()} is "
                   "unreachable or the link drops everything")
        else:
            why = "the timeout expired"
        if self._missing:
            who = (f"the switch is still waiting for rank(s) {self._missing}, which died, stalled or "
                   "issued a different collective")
        else:
            who = "the switch gave no sign of which ranks are missing"
        raise CommTimeoutError(
            f"{_OP} seq={rnd} job {self.job_id} worker {self.worker_id}/{self.num_workers}: no {phase} "
            f"result for {where}: {why}; {who}. Check that every rank is alive and issues the same "
            "collectives, and that the switch runs; then recreate the process group (or sessions) on "
            "every rank", op=_OP, seq=rnd, ranks=self._missing if self._missing else None)

    def _raise_switch_error(self, h: Header, rnd: int) -> None:
        if h.exponent == ERR_NO_PARTITION:
            why = ("the switch has no free slot partition for this job; start it with a larger "
                   "--pool-slots or fewer concurrent jobs")
        elif h.exponent == ERR_BAD_WORKERS:
            why = (f"the switch runs job {self.job_id} (this identity) with a different number of workers; "
                   "every rank must pass the same num_workers, and concurrent jobs need distinct identities "
                   "(job_id, nonce)")
        elif h.exponent == ERR_JOB_RUNNING:
            why = (f"the switch refused this JOIN: worker {self.worker_id} of job {self.job_id} (this identity) "
                   "is joined with another session in a running incarnation; a job's identity (job_id, nonce) "
                   "serves one job at a time: close the old sessions first, or use a new identity (a new "
                   "process group draws one)")
        elif h.exponent == ERR_PENDING_LIMIT:
            why = ("the switch refused this JOIN: this address already holds the most incomplete joins the "
                   "switch allows (--max-pending-per-source)")
        else:
            why = f"the switch reported error code {h.exponent}"
        raise CommError(f"{_OP} seq={rnd} job {self.job_id} worker {self.worker_id}: {why}", op=_OP, seq=rnd,
                        ranks=[self.worker_id])

    # -- transport -------------------------------------------------------------------------------

    def _sample_rtt(self, rtt: float) -> None:
        # RFC 6298's estimator; Karn's rule is applied by the caller (no samples from retransmissions).
        if self._srtt is None:
            self._srtt, self._rttvar = rtt, rtt / 2
        else:
            self._rttvar = 0.75 * self._rttvar + 0.25 * abs(self._srtt - rtt)
            self._srtt = 0.875 * self._srtt + 0.125 * rtt
        self._rto = min(self.max_rto, max(self.min_rto, self._srtt + 4 * self._rttvar))

    def _send(self, packet: bytes | bytearray) -> None:
        # The socket is non-blocking (see _rx); a full send buffer waits for room, as a blocking send
        # would, for at most a second, then raises (the caller reports the socket error).
        try:
            self._sock.send(packet)
        except BlockingIOError:
            if not select.select([], [self._sock], [], 1.0)[1]:
                raise
            self._sock.send(packet)

    def _tx(self, packet: bytes) -> None:
        if self._faults is None:
            self._send(packet)
            self.counters["packets_sent"] += 1
            return
        for pkt in self._faults.on_send(bytes(packet)):  # a copy: held packets must not see later edits
            self._send(pkt)
            self.counters["packets_sent"] += 1

    def _rx(self, wait: float) -> tuple[Header, memoryview] | None:
        """One validated packet, or None after ``wait`` seconds (faults applied on the way in).

        The socket stays non-blocking: a packet already queued (the common case while a window is in
        flight) costs one ``recv`` system call; only an empty queue waits in ``poll``. (A socket
        timeout would cost three per packet: the mode switch, a poll and the recv.)
        """
        if not self._inbox:
            try:
                try:
                    nbytes = self._sock.recv_into(self._buf)
                except BlockingIOError:
                    if wait <= 0 or not self._poller.poll(max(1, math.ceil(wait * 1000))):
                        return None
                    nbytes = self._sock.recv_into(self._buf)
            except BlockingIOError:
                return None
            except ConnectionRefusedError:
                return None  # ICMP port unreachable: the switch is not (yet) there; retransmit later
            self.counters["packets_received"] += 1
            if self._faults is None:
                return self._parse(self._buf, nbytes)
            self._inbox.extend(self._faults.on_recv(bytes(self._buf[:nbytes])))
            if not self._inbox:
                return None
        pkt = self._inbox.pop(0)
        return self._parse(pkt, len(pkt))

    def _parse(self, buf: Any, nbytes: int) -> tuple[Header, Any] | None:
        if (nbytes > HEADER_SIZE and buf[FLAGS_OFFSET] & FLAG_SEGMENTED
                and nbytes > HEADER_SIZE + 4 * int.from_bytes(buf[COUNT_OFFSET:COUNT_OFFSET + 4], "big")):
            return self._parse_coalesced(buf, nbytes)
        try:
            h = parse_header(buf, nbytes, allowed=PacketType.TO_WORKER)
        except ProtocolError:
            self.counters["malformed_received"] += 1
            return None
        return h, memoryview(buf)[HEADER_SIZE:nbytes]

    def _merge_segments(self, buf: Any, nbytes: int) -> tuple[Header, bytes] | None:
        """The common case of :meth:`_parse_coalesced`, vectorized: full segments of one result.

        The first segment is validated field by field; the other full ones must repeat its header
        byte for byte except ``tag``, which must step by SEGMENT_LANES; a shorter last segment is
        validated on its own. None when the buffer is anything else (the general path decides).
        """
        nfull, rest = divmod(nbytes, SEGMENT_BYTES)
        if nfull == 0 or (rest and rest < HEADER_SIZE):
            return None
        try:
            h0 = parse_header(buf, SEGMENT_BYTES, allowed=PacketType.TO_WORKER)
        except ProtocolError:
            return None
        if h0.ptype != PacketType.RESULT or not h0.flags & FLAG_SEGMENTED or h0.count != SEGMENT_LANES:
            return None
        rows = np.frombuffer(buf, dtype=np.uint8, count=nfull * SEGMENT_BYTES).reshape(nfull, SEGMENT_BYTES)
        head = np.concatenate((rows[:, :TAG_OFFSET], rows[:, TAG_OFFSET + 4:HEADER_SIZE]), axis=1)
        tags = rows[:, TAG_OFFSET:TAG_OFFSET + 4].copy().view(">u4").ravel()
        if not ((head == head[0]).all() and np.array_equal(
                tags, h0.tag + SEGMENT_LANES * np.arange(nfull, dtype=np.int64))):
            return None
        lanes = rows[:, HEADER_SIZE:].tobytes()
        count = nfull * SEGMENT_LANES
        if rest:
            tail = memoryview(buf)[nfull * SEGMENT_BYTES:nbytes]
            try:
                hl = parse_header(tail, rest, allowed=PacketType.TO_WORKER)
            except ProtocolError:
                return None
            if hl._replace(count=h0.count, tag=h0.tag) != h0 or hl.tag != h0.tag + count:
                return None
            lanes += tail[HEADER_SIZE:]
            count += hl.count
        return h0._replace(count=count), lanes

    def _parse_coalesced(self, buf: Any, nbytes: int) -> tuple[Header, Any] | None:
        """Several datagrams received as one buffer (UDP GRO): split, validate each, merge segments.

        Consecutive result segments of one chunk (the usual content: one GSO super-packet from the
        switch) become one segment covering all their lanes. Anything else is queued datagram by
        datagram, and a piece that fails validation is dropped and counted, as a datagram would be.
        """
        fast = self._merge_segments(buf, nbytes)
        if fast is not None:
            return fast
        view = memoryview(buf)
        pieces: list[tuple[Header, memoryview]] = []
        raw: list[memoryview] = []
        pos = 0
        while pos < nbytes:
            if nbytes - pos < HEADER_SIZE:
                self.counters["malformed_received"] += 1
                break
            length = HEADER_SIZE + 4 * int.from_bytes(view[pos + COUNT_OFFSET:pos + COUNT_OFFSET + 4], "big")
            length = min(length, nbytes - pos)
            try:
                h = parse_header(view[pos:pos + length], length, allowed=PacketType.TO_WORKER)
            except ProtocolError:
                self.counters["malformed_received"] += 1
                break  # the rest cannot be delimited reliably
            pieces.append((h, view[pos + HEADER_SIZE:pos + length]))
            raw.append(view[pos:pos + length])
            pos += length
        if not pieces:
            return None
        h0 = pieces[0][0]
        merged = h0.ptype == PacketType.RESULT and all(
            h.flags & FLAG_SEGMENTED
            and (h.job_id, h.nonce, h.epoch, h.round, h.seq, h.slot, h.flags, h.exponent, h.dtype)
            == (h0.job_id, h0.nonce, h0.epoch, h0.round, h0.seq, h0.slot, h0.flags, h0.exponent, h0.dtype)
            and h.tag == h0.tag + i * SEGMENT_LANES and (h.count == SEGMENT_LANES or i == len(pieces) - 1)
            for i, (h, _) in enumerate(pieces))
        if merged:
            return h0._replace(count=sum(h.count for h, _ in pieces)), b"".join(p for _, p in pieces)
        self._inbox[:0] = [bytes(r) for r in raw[1:]]  # delivered next, in order
        return pieces[0][0], bytes(pieces[0][1])


def ina_all_reduce(tensor: torch.Tensor, *, address: tuple[str, int], job_id: int, worker_id: int,
                   num_workers: int, op: str = "sum", timeout: float = 60.0, nonce: int = 0,
                   session: InaSession | None = None, **session_options: Any) -> torch.Tensor:
    """All-reduce ``tensor`` in place through the in-network aggregation switch at ``address``.

    The thin wrapper over :class:`InaSession` used by ``all_reduce(..., algorithm="ina")`` and the
    DDP hook. Pass a long-lived ``session`` (one per process group and rank) to keep the socket and
    the job's epoch across calls; without one, a session is opened, joined and closed per call, which
    costs one extra round trip (the JOIN handshake) and is correct because every call starts a new
    epoch of the job on the switch (the previous call's sessions have left).

    Args:
        tensor: fp32, fp16 or bf16; reduced in place (non-contiguous tensors too).
        address: the switch's (host, port).
        job_id: the job, the same on every worker.
        worker_id: this worker's rank in the job.
        num_workers: the job's size.
        op: "sum" or "avg".
        timeout: seconds for the call.
        nonce: the rest of the job's identity (see :class:`InaSession`), the same on every worker.
        session: an open session to reuse; it must match address, job_id, nonce, worker_id and
            num_workers.
        **session_options: further :class:`InaSession` arguments (window, faults, ...), used only when
            no session is given.

    Returns:
        ``tensor``.
    """
    if session is not None:
        if (session.address, session.job_id, session.nonce, session.worker_id, session.num_workers) != (
                (str(address[0]), int(address[1])), job_id, nonce, worker_id, num_workers):
            raise ValueError(f"{_OP}: the session is for {session.address} job {session.job_id} (nonce "
                             f"{session.nonce:#x}) worker {session.worker_id}/{session.num_workers}, not "
                             f"{address} job {job_id} (nonce {nonce:#x}) worker {worker_id}/{num_workers}")
        return session.all_reduce(tensor, op, timeout=timeout)
    with InaSession(address, job_id=job_id, worker_id=worker_id, num_workers=num_workers, nonce=nonce,
                    timeout=timeout, **session_options) as s:
        return s.all_reduce(tensor, op, timeout=timeout)


def draw_identity(job_id: int | None = None) -> tuple[int, int]:
    """A fresh job identity (job id, nonce) for rank 0 to share: a random id (unless given) and 64 bits.

    Two independent jobs draw the same identity with probability about 2**-64 (2**-80 with random ids),
    so jobs that share a switch never share a partition, whatever their group names.
    """
    if job_id is None:
        job_id = 1 + secrets.randbelow(0xFFFF)
    if not 0 <= job_id <= 0xFFFF:
        raise ValueError(f"{_OP}: job_id={job_id} must fit 16 bits")
    return job_id, secrets.randbits(64)


def agree_identity(group: Any, device: Any, timeout: float | None, job_id: int | None = None) -> tuple[int, int]:
    """The job identity drawn on ``group``'s rank 0 (:func:`draw_identity`), broadcast to its ranks.

    A collective on ``group`` (every rank calls it at the same point, like the first collective it
    precedes), as an int64 tensor on ``device`` (the group's device: CPU for gloo, the CUDA device for
    NCCL), bounded by ``timeout`` seconds.

    Raises:
        CommTimeoutError: a rank did not arrive within ``timeout``.
    """
    import torch.distributed as dist

    from ..engine import wait_work

    t = identity_tensor(draw_identity(job_id) if dist.get_rank(group) == 0 else (0, 0), device)
    if dist.get_world_size(group) > 1:
        src = dist.get_global_rank(group, 0) if group is not None else 0
        wait_work(dist.broadcast(t, src=src, group=group, async_op=True), timeout, "ina/join")
    return identity_of(t)


def identity_tensor(identity: tuple[int, int], device: Any = "cpu") -> torch.Tensor:
    """(job id, nonce) as two int64 lanes (the nonce in two's complement), to broadcast."""
    job_id, nonce = identity
    return torch.tensor([job_id, nonce - (1 << 64) if nonce >> 63 else nonce], dtype=torch.int64, device=device)


def identity_of(t: torch.Tensor) -> tuple[int, int]:
    """The inverse of :func:`identity_tensor`."""
    job_id, nonce = (int(v) for v in t.tolist())
    return job_id, nonce & MAX_NONCE


_SESSIONS_LOCK = threading.Lock()


def _session_key(pg: Any, address: tuple[str, int], rank: int, size: int) -> tuple:
    return (id(pg), str(getattr(pg, "group_name", "") or "WORLD"), address, rank, size)


def _identity_key(pg: Any) -> tuple:
    return ("ina-identity", id(pg), str(getattr(pg, "group_name", "") or "WORLD"))


def _group_ref(pg: Any) -> Callable[[], Any]:
    import weakref

    try:
        return weakref.ref(pg)
    except TypeError:
        return (lambda: pg)  # noqa: E731 - not weakly referenceable: keep the group alive with it


def _session_for(pg: Any, address: tuple[str, int], rank: int, size: int, device: Any,
                 timeout: float | None, sessions: Any) -> InaSession:
    """The cached session of ``pg`` on the switch at ``address`` (joined on first use).

    Reusing one session saves the JOIN round trip and the socket set-up on every call. The group's
    job identity is agreed once, by a broadcast over ``pg`` on its first INA all-reduce, and kept
    for the group's lifetime: a session dropped after a failure is replaced under the same identity
    without another collective (the ranks may be out of step then), and the switch starts its new
    incarnation once every rank's old session has left. The entries hold a weak reference to the
    group: a destroyed group whose id() is reused by a new one inherits neither.
    """
    key, ikey = _session_key(pg, address, rank, size), _identity_key(pg)
    with _SESSIONS_LOCK:
        entry = sessions.get(key)
        if entry is not None:
            ref, session = entry  # type: ignore[misc]
            if ref() is pg and not session.closed and session._broken is None:
                return session
            sessions.pop(key)
            session.close()
        ident = sessions.get(ikey)
        identity = ident.identity if isinstance(ident, _CachedIdentity) and ident.ref() is pg else None
    if identity is None:
        # Outside the lock: a collective that may wait up to the timeout must not block other groups.
        identity = agree_identity(pg, device, timeout)
    session = InaSession(address, job_id=identity[0], nonce=identity[1], worker_id=rank, num_workers=size)
    with _SESSIONS_LOCK:
        ref = _group_ref(pg)
        sessions.put(ikey, _CachedIdentity(ref, identity))
        old = sessions.put(key, _CachedSession(ref, session))
    if old is not None:
        old.close()  # type: ignore[attr-defined]
    return session


class _CachedSession(tuple):
    """(weak reference to the group, session); ``close()`` closes the session (for destroy())."""

    def __new__(cls, ref: Any, session: InaSession) -> _CachedSession:
        return super().__new__(cls, (ref, session))

    def close(self) -> None:
        self[1].close()


class _CachedIdentity:
    """A group's agreed job identity in the registry; ``close()`` (from destroy()) has nothing to free."""

    __slots__ = ("ref", "identity")

    def __init__(self, ref: Callable[[], Any], identity: tuple[int, int]):
        self.ref = ref
        self.identity = identity

    def close(self) -> None:
        pass


def _drop_session(pg: Any, address: tuple[str, int], rank: int, size: int, session: InaSession,
                  sessions: Any) -> None:
    key = _session_key(pg, address, rank, size)
    with _SESSIONS_LOCK:
        entry = sessions.get(key)
        if entry is not None and entry[1] is session:  # type: ignore[index]
            sessions.pop(key)
    session.close()


def ina_all_reduce_for(prepared: Any, red: Any, group: Any, topology: Any, timeout: float | None, *,
                       finish: Callable[[Any], torch.Tensor], sessions: Any) -> torch.futures.Future:
    """``all_reduce(..., algorithm="ina")``: the adapter the collective layer's registry calls.

    Sums ``prepared.flat`` (contiguous, AVG already turned into SUM plus a scale by the caller)
    through the switch named by ``topology.ina_switch`` ("host:port", from ``Topology.from_env()``
    reading ``COMMOPT_INA_SWITCH``), then runs ``finish(prepared)``. When ``group`` is an ``"ina"``
    process group, its long-lived session is used; otherwise a long-lived session per (group, switch,
    rank) is joined on first use under a job identity (random job id and nonce) that rank 0 draws and
    broadcasts over ``group`` within ``timeout``, kept in commopt's one process-wide cache
    (``sessions``: the runtime context's ``ina_sessions``) and closed by ``commopt.comm.destroy()``. So two
    independent worlds on one switch never share a job, whatever their group names. A session broken
    by a failure (a timeout) is dropped, so the next call joins a new epoch.

    Returns:
        A completed future holding the result, or holding the error (so hooks see it on ``wait()``).
    """
    import torch.distributed as dist

    fut: torch.futures.Future = torch.futures.Future()
    try:
        if red != dist.ReduceOp.SUM:
            raise ValueError(f"{_OP}: in-network aggregation sums (and averages); reduce op {red} is not "
                             "supported, use algorithm='flat'")
        pg = group if group is not None else dist.group.WORLD
        rank, size = dist.get_rank(group), dist.get_world_size(group)
        session = getattr(pg, "session", None)
        if isinstance(session, InaSession):
            session.all_reduce(prepared.flat, "sum", timeout=timeout)
        else:
            spec = getattr(topology, "ina_switch", None)
            if not spec:
                raise CommError(f"{_OP}: no switch address: set COMMOPT_INA_SWITCH=host:port (read by "
                                "Topology.from_env()) or pass a Topology with ina_switch, and run "
                                "`commopt-bench ina-switch`", op=_OP, ranks=[rank])
            host, _, port = str(spec).rpartition(":")
            address = (host.strip("[]"), int(port))
            call_timeout = timeout if timeout is not None else 60.0
            session = _session_for(pg, address, rank, size, prepared.flat.device, call_timeout, sessions)
            try:
                session.all_reduce(prepared.flat, "sum", timeout=call_timeout)
            except BaseException:
                if session._broken is not None or session.closed:
                    _drop_session(pg, address, rank, size, session, sessions)
                raise
        fut.set_result(finish(prepared))
    except (CommError, ValueError, TypeError, OSError) as e:
        fut.set_exception(e)
    return fut
