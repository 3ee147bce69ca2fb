"""A worker's session with the switch: join, agree, all-reduce; and the job identity it carries.

One collective (:meth:`InaSession.all_reduce`) runs in phases:

(1) **join** (once per session, :meth:`InaSession.join`): every worker sends JOIN with a fresh random
    session tag; the switch answers JOIN_OK with the job's new *epoch* once all ``num_workers`` have
    joined, which frees the job's slots from any earlier incarnation (a crashed job, a previous
    session). Every packet carries the job's identity, its id and a 64-bit nonce that all workers
    share (drawn on rank 0 and agreed through the process group, :func:`agree_identity`), so two
    independent jobs on one switch never share state.
(2) **agree** on the exponent through the switch's control slot (lane-wise MAX): each worker
    contributes the exponent ``E`` of its largest magnitude (``max|x| < 2**E``), its numel, dtype, op,
    headroom, window, payload size and a per-worker non-finite flag. Every worker gets the same answer,
    so a NaN/Inf on one rank raises :class:`NonFiniteError` on every rank before anything is quantized,
    and a numel/dtype/op mismatch raises :class:`CollectiveMismatchError` on every rank.
(3) **quantize** (:mod:`.bfp`) ``q = round(x * 2**s)`` to int32 with ``s = 30 - h - E_max``, ``h =
    ceil(log2 n)`` headroom bits, so the sum of n codes cannot wrap. (The switch also saturates and
    flags any sum that would leave int32; a flagged round is redone with more headroom on every
    worker, since every worker sees the same flags.)
(4) **aggregate** through the switch (:mod:`.transport`: the window, retransmission with back-off,
    the retry budget): chunks are quantized as they leave and dequantized as their sums arrive.
(5) **dequantize** ``sum(q) * 2**-s`` in float64 (divided by n for ``avg``), rounded once to the
    tensor's dtype: the result is exactly ``dequantize(sum of the workers' int32 codes)``, within
    :func:`.bfp.error_bound` of the fp64 sum.

The collective layer (``algorithm="ina"``) and the ``"ina"`` backend join on the caller's thread,
where the identity was agreed, and run phases (2)-(5) on the comm engine's worker of their group.
"""

from __future__ import annotations

import math
import secrets
import threading
import time
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from ..engine import wait_work
from ..errors import CollectiveMismatchError, CommError, CommTimeoutError, NonFiniteError
from .bfp import ZERO_EXPONENT, as_float32_numpy, block_shift, headroom_bits, quantize_into, scan
from .faults import FaultConfig
from .protocol import (
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
    FLAG_RETX,
    MAX_NONCE,
    MAX_PAYLOAD_ELEMS,
    MAX_WORKERS,
    Header,
    PacketType,
    pack_header,
)
from .transport import OP, Transport

DEFAULT_TIMEOUT = 60.0  # seconds per call when neither the call nor the session is given one

__all__ = [
    "DEFAULT_TIMEOUT",
    "InaSession",
    "ina_all_reduce",
    "draw_identity",
    "agree_identity",
    "identity_tensor",
    "identity_of",
]

_DTYPE_CODES = {torch.float32: DTYPE_FP32, torch.float16: DTYPE_FP16, torch.bfloat16: DTYPE_BF16}
_OP_CODES = {"sum": 1, "avg": 2}


class InaSession:
    """One worker's connection to the switch for one job; reused across collectives.

    The UDP socket (:class:`~.transport.Transport`) is connected to the switch and stays open until
    :meth:`close`. Not thread-safe across calls by design of the protocol (every worker must issue the
    same collectives in the same order, docs/architecture.md section 3); a lock serialises callers.

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
            saturation detection and a redone round, which is what tests of docs/faults.md row 27 use.
        faults: seeded fault injection (tests); None sends and receives untouched.
        bind_host: local address; by default the kernel picks the interface that reaches the switch
            (loopback for a loopback switch).
        segmented_results: ask the switch for results as MTU-sized segments sent as UDP GSO
            super-packets, received whole through ``UDP_GRO`` (see ``protocol``: a fragmented 32 KiB
            datagram costs the kernel 5-6x more CPU); segments that arrive one by one work too.
    """

    def __init__(self, address: tuple[str, int], *, job_id: int, worker_id: int, num_workers: int,
                 nonce: int = 0, window: int = DEFAULT_WINDOW, payload_elems: int = DEFAULT_PAYLOAD_ELEMS,
                 timeout: float = DEFAULT_TIMEOUT,
                 max_retries: int = 20, initial_rto: float = 0.2, max_rto: float = 1.0,
                 min_rto: float = 0.05, headroom: int | None = None, faults: FaultConfig | None = None,
                 bind_host: str | None = None, segmented_results: bool = True):
        if not 1 <= num_workers <= MAX_WORKERS:
            raise ValueError(f"{OP}: num_workers={num_workers} must be in 1..{MAX_WORKERS}")
        if not 0 <= worker_id < num_workers:
            raise ValueError(f"{OP}: worker_id={worker_id} must be in 0..{num_workers - 1}")
        if not 0 <= job_id <= 0xFFFF:
            raise ValueError(f"{OP}: job_id={job_id} must fit 16 bits")
        if not 0 <= nonce <= MAX_NONCE:
            raise ValueError(f"{OP}: nonce={nonce} must fit 64 bits (unsigned)")
        if not 1 <= payload_elems <= MAX_PAYLOAD_ELEMS:
            raise ValueError(f"{OP}: payload_elems={payload_elems} must be in 1..{MAX_PAYLOAD_ELEMS}")
        if window < 1 or max_retries < 0 or timeout <= 0 or not 0 < min_rto <= max_rto or not (
                0 < initial_rto <= max_rto):
            raise ValueError(f"{OP}: need window >= 1, max_retries >= 0, timeout > 0 and "
                             f"0 < initial_rto <= max_rto (got {window}, {max_retries}, {timeout}, "
                             f"{initial_rto}, {max_rto})")
        self.address = (str(address[0]), int(address[1]))
        self.job_id = job_id
        self.nonce = nonce
        self.worker_id = worker_id
        self.num_workers = num_workers
        self.timeout = timeout
        self.max_retries = max_retries
        self.max_rto = max_rto
        self.min_rto = min_rto
        self.headroom = headroom
        self.segmented_results = segmented_results
        self._round = 0
        self._broken: str | None = None
        self._lock = threading.Lock()
        self.counters: dict[str, int] = dict.fromkeys(("collectives", "rescaled_rounds"), 0)
        self._t = Transport(self.address, job_id=job_id, nonce=nonce, worker_id=worker_id,
                            num_workers=num_workers, window=window, payload_elems=payload_elems,
                            max_retries=max_retries, initial_rto=initial_rto, max_rto=max_rto, min_rto=min_rto,
                            faults=faults, bind_host=bind_host, segmented_results=segmented_results,
                            counters=self.counters)

    # -- public ----------------------------------------------------------------------------------

    @property
    def closed(self) -> bool:
        return self._t.closed

    @property
    def broken(self) -> str | None:
        """Why the session failed (its peers are out of step), or None while it is usable."""
        return self._broken

    @property
    def epoch(self) -> int | None:
        """The job's incarnation the session joined, or None before :meth:`join`."""
        return self._t.epoch

    @property
    def window(self) -> int:
        """Chunks in flight (the asked-for window, capped by the switch's partition once joined)."""
        return self._t.window

    @property
    def payload_elems(self) -> int:
        return self._t.payload_elems

    @property
    def seq(self) -> int:
        """The sequence number the next collective will carry (rounds redone for rescaling count)."""
        return self._round

    @property
    def fault_stats(self) -> dict[str, int]:
        return self._t.fault_stats

    def close(self) -> None:
        """Say LEAVE (twice: it is not acknowledged) and close the socket.

        The switch frees the job's partition once every worker of the epoch has left; a lost LEAVE
        only delays that until the job's idle timeout. A session that never got JOIN_OK says LEAVE
        too, which withdraws its JOIN. Nothing else holds the socket (no thread, no reference cycle),
        so it is closed here, not by the garbage collector.
        """
        self._t.close()

    def __enter__(self) -> InaSession:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def join(self, timeout: float | None = None) -> None:
        """Join the job's next incarnation now (phase 1); a no-op once joined or for one worker.

        It returns once every worker has joined, so it is as collective as the identity agreement
        before it: the collective layer and the ``"ina"`` backend call it on the caller's thread
        before their first payload, and :meth:`all_reduce` joins by itself when it was not called.

        Raises:
            CommTimeoutError: not every worker joined within ``timeout`` (default: the session's).
            CommError: the switch refused the JOIN, or the session is closed or broken.
        """
        with self._lock:
            self._check_usable()
            if self.num_workers == 1 or self._t.epoch is not None:
                return
            deadline = time.monotonic() + (self.timeout if timeout is None else timeout)
            self._guarded(lambda: self._ensure_joined(deadline))

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
        where = f"{OP} seq={self._round} job {self.job_id} rank {self.worker_id}/{self.num_workers}"
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

    def exchange(self, tensors: list[torch.Tensor], op: str, timeout: float | None = None) -> int:
        """:meth:`all_reduce` every tensor in turn; the payload bytes this worker sent (the int32
        codes, what ``algorithms.ina``'s ``traffic()`` models): an engine phase's count."""
        before = self.counters["payload_bytes"]
        for t in tensors:
            self.all_reduce(t, op, timeout=timeout)
        return self.counters["payload_bytes"] - before

    # -- one collective --------------------------------------------------------------------------

    def _ranks(self) -> list[int]:
        return list(range(self.num_workers))

    def _check_usable(self) -> None:
        if self.closed:
            raise CommError(f"{OP} on job {self.job_id}, worker {self.worker_id}: the session is closed; "
                            "create a new InaSession", op=OP, seq=self._round, ranks=[self.worker_id])
        if self._broken is not None:
            raise CommError(f"{OP} on job {self.job_id}, worker {self.worker_id}: the session failed "
                            f"earlier ({self._broken}) and its peers are out of step; close it and create "
                            "a new session on every rank (a new process group)", op=OP, seq=self._round,
                            ranks=[self.worker_id])

    def _guarded(self, body: Any) -> Any:
        """Run ``body()``; a failure that leaves the workers out of step breaks the session.

        A timeout or a socket error does (peers may be anywhere in the protocol); a non-finite input or
        a mismatch does not: every rank raised the same error at the same point.
        """
        try:
            return body()
        except CommTimeoutError as e:
            self._broken = f"{type(e).__name__} at seq {e.seq}"
            raise
        except (NonFiniteError, CollectiveMismatchError):
            raise
        except (CommError, OSError) as e:
            self._broken = f"{type(e).__name__}: {e}"
            if isinstance(e, OSError):
                raise CommError(f"{OP} seq={self._round - 1} job {self.job_id} worker {self.worker_id}: "
                                f"socket error talking to the switch at {self._t.addr()}: {e}; check that "
                                "the switch runs (commopt-bench ina-switch)", op=OP, seq=self._round - 1,
                                ranks=[self.worker_id]) from e
            raise

    def _all_reduce(self, tensor: torch.Tensor, op: str, timeout: float) -> torch.Tensor:
        self._check_usable()
        self.counters["collectives"] += 1
        deadline = time.monotonic() + timeout
        scanned_exponent, nonfinite = scan(tensor.detach())
        if self.num_workers == 1:
            if nonfinite:
                raise NonFiniteError(self._nonfinite_msg([0], tensor), op=OP, seq=self._round, ranks=[0])
            return tensor  # the sum and the average over one worker are the input
        return self._guarded(lambda: self._reduce(tensor, op, scanned_exponent, nonfinite, deadline))

    def _reduce(self, tensor: torch.Tensor, op: str, exponent: int, nonfinite: bool, deadline: float) -> torch.Tensor:
        """Phases (1)-(5) of one collective; rounds are redone with more headroom after saturation."""
        self._ensure_joined(deadline)
        x = tensor.detach()
        numel = x.numel()
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
                values = as_float32_numpy(x)
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
                raise CommError(f"{OP} seq={rnd} job {self.job_id}: the switch saturated even with "
                                f"{h} bits of headroom; a worker is sending out-of-range codes",
                                op=OP, seq=rnd, ranks=self._ranks())
        with torch.no_grad():  # like torch.distributed: the reduction is not part of the graph
            tensor.copy_(result.view(tensor.shape))  # also scatters into non-contiguous / CUDA tensors
        return tensor

    def _nonfinite_msg(self, ranks: list[int], tensor: torch.Tensor) -> str:
        return (f"{OP} job {self.job_id}: NaN or Inf in the input of rank(s) {ranks} "
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
                f"{OP} seq={rnd} job {self.job_id}: ranks disagree on {', '.join(bad)} (this rank: "
                f"numel={tensor.numel()}, shape {list(tensor.shape)}, {tensor.dtype}, op={op}); every rank "
                "must all-reduce the same number of elements of the same dtype with the same op",
                op=OP, seq=rnd, ranks=self._ranks())
        settings = {"headroom": (CTRL_HEADROOM, CTRL_NHEADROOM), "window": (CTRL_WINDOW, CTRL_NWINDOW),
                    "payload_elems": (CTRL_PAYLOAD, CTRL_NPAYLOAD)}
        bad = [name for name, (a, b) in settings.items() if int(agreed[a]) != -int(agreed[b])]
        if bad:
            raise CollectiveMismatchError(
                f"{OP} seq={rnd} job {self.job_id}: ranks use different {', '.join(bad)} settings; create "
                "every rank's session with the same ones", op=OP, seq=rnd, ranks=self._ranks())
        bad_ranks = [r for r in range(self.num_workers) if flags[r]]
        if bad_ranks:
            raise NonFiniteError(self._nonfinite_msg(bad_ranks, tensor), op=OP, seq=rnd, ranks=bad_ranks)

    # -- phases ----------------------------------------------------------------------------------

    def _ensure_joined(self, deadline: float) -> None:
        t = self._t
        if t.epoch is not None:
            return
        ident = dict(job_id=self.job_id, worker_id=self.worker_id, num_workers=self.num_workers,
                     nonce=self.nonce, tag=t.tag)
        join = pack_header(PacketType.JOIN, **ident)
        retx = pack_header(PacketType.JOIN, flags=FLAG_RETX, **ident)

        def accept(h: Header, payload: Any) -> bool:
            if h.ptype != PacketType.JOIN_OK or h.num_workers != self.num_workers:
                return False
            tags = np.frombuffer(payload, dtype="<u4")
            if len(tags) != self.num_workers or int(tags[self.worker_id]) != t.tag:
                return False
            t.joined(h.epoch, h.slot)  # h.slot = data slots in the partition
            return True

        t.joining = True
        t.handshake(join, retx, accept, phase="join", rnd=self._round, deadline=deadline)

    def _agree(self, rnd: int, exponent: int, numel: int, dcode: int, opcode: int, headroom: int,
               nonfinite: bool, deadline: float) -> np.ndarray:
        lanes = np.zeros(CTRL_LANES + self.num_workers, dtype="<i4")
        lo, hi = numel & 0x7FFFFFFF, numel >> 31
        window, payload_elems = self._t.window, self._t.payload_elems
        lanes[CTRL_EXP] = exponent
        lanes[CTRL_NUMEL_LO], lanes[CTRL_NNUMEL_LO] = lo, -lo
        lanes[CTRL_NUMEL_HI], lanes[CTRL_NNUMEL_HI] = hi, -hi
        lanes[CTRL_DTYPE], lanes[CTRL_NDTYPE] = dcode, -dcode
        lanes[CTRL_OP], lanes[CTRL_NOP] = opcode, -opcode
        lanes[CTRL_HEADROOM], lanes[CTRL_NHEADROOM] = headroom, -headroom
        lanes[CTRL_WINDOW], lanes[CTRL_NWINDOW] = window, -window
        lanes[CTRL_PAYLOAD], lanes[CTRL_NPAYLOAD] = payload_elems, -payload_elems
        lanes[CTRL_LANES + self.worker_id] = int(nonfinite)
        out = np.empty_like(lanes)

        def deliver(lo: int, hi: int, payload: memoryview) -> None:
            out[lo:hi] = np.frombuffer(payload, dtype="<i4")

        self._t.exchange(PacketType.CTRL, rnd, len(lanes), lambda lo, hi: lanes.tobytes(), deliver, dcode, 0,
                         "agree", deadline)
        return out

    def _aggregate(self, rnd: int, values: np.ndarray, result: torch.Tensor, dcode: int, shift: int,
                   divisor: int, deadline: float) -> bool:
        """Quantize chunks as they leave and dequantize results as they arrive, into ``result``.

        Dequantizing per chunk overlaps it with waiting for the other chunks, and computes exactly
        what :func:`.bfp.dequantize` computes on the whole sum (float64, one rounding to the dtype).
        """
        def payload(lo: int, hi: int) -> bytes:
            return quantize_into(values[lo:hi], shift).data  # type: ignore[return-value]

        # sum * 2**-shift in float64 is exact (|sum| <= 2**31, and the shifts of fp32/fp16/bf16 inputs
        # keep the product far inside float64's normal range), so multiplying by the power of two is
        # ldexp; the float64 scratch is reused across chunks, and a float32 result is written through
        # a numpy view (one float64 -> float32 rounding, to nearest even, as torch's cast).
        scale = math.ldexp(1.0, -shift)
        scratch = np.empty(min(self._t.payload_elems, len(values)), dtype=np.float64)
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

        return self._t.exchange(PacketType.DATA, rnd, len(values), payload, deliver, dcode, shift, "aggregate",
                                deadline)


def ina_all_reduce(tensor: torch.Tensor, *, address: tuple[str, int], job_id: int, worker_id: int,
                   num_workers: int, op: str = "sum", timeout: float = DEFAULT_TIMEOUT, nonce: int = 0,
                   session: InaSession | None = None, **session_options: Any) -> torch.Tensor:
    """All-reduce ``tensor`` in place through the in-network aggregation switch at ``address``.

    The thin wrapper over :class:`InaSession` for scripts that hold no process group. Pass a
    long-lived ``session`` (one per job and rank) to keep the socket and the job's epoch across
    calls; without one, a session is opened, joined and closed per call, which costs one extra round
    trip (the JOIN handshake) and is correct because every call starts a new epoch of the job on the
    switch (the previous call's sessions have left).

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
            raise ValueError(f"{OP}: the session is for {session.address} job {session.job_id} (nonce "
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
        raise ValueError(f"{OP}: job_id={job_id} must fit 16 bits")
    return job_id, secrets.randbits(64)


def agree_identity(group: Any, device: Any, timeout: float | None, job_id: int | None = None) -> tuple[int, int]:
    """The job identity drawn on ``group``'s rank 0 (:func:`draw_identity`), broadcast to its ranks.

    A collective on ``group`` (every rank calls it at the same point, like the first collective it
    precedes), as an int64 tensor on ``device`` (the group's device: CPU for gloo, the CUDA device for
    NCCL), bounded by ``timeout`` seconds.

    Raises:
        CommTimeoutError: a rank did not arrive within ``timeout``.
    """
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
