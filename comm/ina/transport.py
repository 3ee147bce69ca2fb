"""One worker's packets to and from the switch: the window, retransmission, the retry budget.

:class:`Transport` owns the worker's UDP socket and everything about packets that is not the
collective's arithmetic (that is :mod:`.session`'s):

- **the window** (:meth:`Transport.exchange`): chunks of ``payload_elems`` lanes, at most ``window``
  in flight, each on its own data slot; a slot is reused for the chunk ``window`` further on as soon
  as its result arrives (SwitchML's self-clocking), alternating the slot's two copies so that the
  previous result stays available for retransmission;
- **retransmission with back-off**: a chunk whose result does not come back within the
  retransmission timeout is resent (flagged RETX, same slot copy) with exponential back-off, at most
  ``_RETX_BURST`` chunks per expiry; the timeout adapts to the measured round trip (RFC 6298, Karn's
  rule: no samples from retransmitted chunks);
- **the bounded retry budget**: after ``max_retries`` unanswered retransmissions of one chunk, or at
  the call's deadline, :class:`CommTimeoutError`, naming the ranks the switch says have not
  contributed (its STATUS answers carry the slot's worker bitmap);
- **the handshake** (:meth:`Transport.handshake`): one request resent with back-off until the
  switch accepts it (the JOIN of a session);
- **segment reassembly**: results the switch sends as MTU-sized segments (one UDP GSO super-packet,
  received whole through ``UDP_GRO``, or one datagram each) are validated and merged back into one
  result, the common case vectorized.

Every header field is read through :mod:`.protocol`, the only module that knows offsets.
"""

from __future__ import annotations

import math
import secrets
import select
import socket
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from ..errors import CommError, CommTimeoutError
from .faults import FaultConfig, FaultInjector
from .protocol import (
    ERR_BAD_WORKERS,
    ERR_JOB_RUNNING,
    ERR_NO_PARTITION,
    ERR_PENDING_LIMIT,
    FLAG_RETX,
    FLAG_SATURATED,
    FLAG_SEGMENTED,
    FLAG_SHADOW,
    HEADER_SIZE,
    SEGMENT_BYTES,
    SEGMENT_LANES,
    Header,
    PacketType,
    ProtocolError,
    pack_header,
    parse_header,
    peek_count,
    peek_flags,
    poke_flags,
    same_but_tag,
    segment_tags,
)

__all__ = ["OP", "Transport"]

OP = "ina/all_reduce"  # the operation every error of a session names
_SOCKET_BUFFER = 4 << 20
_RETX_BURST = 2  # retransmissions per expiry of the window's timers (see Transport.exchange)
_UDP_GRO = getattr(socket, "UDP_GRO", 104)  # linux/udp.h; Python 3.11 lacks the constant
_COUNTERS = ("packets_sent", "packets_received", "payload_bytes", "retransmissions", "timeouts_fired", "results",
             "duplicate_results", "stale_received", "malformed_received")


class _Pending:
    """One chunk in flight on one slot: its packet (kept for retransmission), timers and progress."""

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


class Transport:
    """A worker's connected UDP socket to the switch, and the job identity every packet carries.

    The socket is connected to the switch (so the kernel drops datagrams from anyone else),
    non-blocking, and stays open until :meth:`close`. Not thread-safe: its session serialises calls.

    Args:
        address: the switch's (host, port).
        job_id, nonce, worker_id, num_workers: the job identity and this worker (see
            :class:`~.session.InaSession`).
        window: chunks in flight (capped once the switch says its partition size, :meth:`joined`).
        payload_elems: int32 lanes per datagram.
        max_retries: retransmissions of one chunk that go unanswered before giving up.
        initial_rto, max_rto, min_rto: the first retransmission timeout, the back-off's cap and the
            adaptive timeout's floor (seconds).
        faults: seeded fault injection (tests); None sends and receives untouched.
        bind_host: local address; by default the kernel picks the interface that reaches the switch.
        segmented_results: ask for results as segments received through ``UDP_GRO``.
        counters: the dict to count into (the session's, which adds its own counters).
    """

    def __init__(self, address: tuple[str, int], *, job_id: int, nonce: int, worker_id: int, num_workers: int,
                 window: int, payload_elems: int, max_retries: int, initial_rto: float, max_rto: float,
                 min_rto: float, faults: FaultConfig | None, bind_host: str | None, segmented_results: bool,
                 counters: dict[str, int]):
        self.address = address
        self.job_id = job_id
        self.nonce = nonce
        self.worker_id = worker_id
        self.num_workers = num_workers
        self.window = window
        self.payload_elems = payload_elems
        self.max_retries = max_retries
        self.max_rto = max_rto
        self.min_rto = min_rto
        self.segmented_results = segmented_results
        self.tag = secrets.randbits(32) | 1  # this session's tag: the switch tells sessions apart by it
        self.epoch: int | None = None  # the job's incarnation, once the JOIN handshake completed
        self.joining = False  # a JOIN went out: close() says LEAVE even before JOIN_OK
        self.counters = counters
        for name in _COUNTERS:
            counters.setdefault(name, 0)
        self._rto = initial_rto
        self._srtt: float | None = None
        self._rttvar = 0.0
        self._faults = FaultInjector(faults, salt=worker_id) if faults is not None else None
        self._uses: list[int] = []
        self._buf = bytearray(65536)
        self._inbox: list[bytes] = []
        self.missing: list[int] | None = None  # ranks the switch last said it waits for
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

    # -- lifecycle -------------------------------------------------------------------------------

    @property
    def closed(self) -> bool:
        return self._sock.fileno() < 0

    @property
    def fault_stats(self) -> dict[str, int]:
        return self._faults.stats if self._faults is not None else {}

    def joined(self, epoch: int, partition_slots: int) -> None:
        """The handshake completed: the job's epoch, and the window capped by the data slots."""
        self.epoch = epoch
        self.window = max(1, min(self.window, partition_slots))
        self._uses = [0] * (self.window + 1)

    def close(self) -> None:
        """Say LEAVE (twice: it is not acknowledged) when a JOIN went out, and close the socket."""
        if self.closed:
            return
        if self.epoch is not None or self.joining:
            leave = pack_header(PacketType.LEAVE, job_id=self.job_id, worker_id=self.worker_id,
                                num_workers=self.num_workers, nonce=self.nonce, epoch=self.epoch or 0, tag=self.tag)
            for _ in range(2):
                try:
                    self._sock.send(leave)
                except OSError:
                    break
        self._sock.close()

    def addr(self) -> str:
        return f"{self.address[0]}:{self.address[1]}"

    # -- a request answered once -------------------------------------------------------------------

    def handshake(self, first: bytes, retx: bytes, accept: Callable[[Header, Any], bool], *, phase: str,
                  rnd: int, deadline: float) -> None:
        """Send ``first``, then ``retx`` with exponential back-off, until ``accept(header, payload)`` of
        a packet of this job is true; STATUS answers (who the switch still waits for) reset the retry
        budget, ERROR answers raise, anything else is counted stale.

        Raises:
            CommTimeoutError: ``deadline`` passed or ``max_retries`` resends went unanswered.
            CommError: the switch refused the request.
        """
        self.tx(first)
        backoff, unanswered = 0, 0
        next_send = time.monotonic() + self._rto
        while True:
            now = time.monotonic()
            if now >= deadline:
                self.raise_timeout(phase, rnd, None, unanswered, deadline)
            if now >= next_send:
                unanswered += 1
                if unanswered > self.max_retries:
                    self.raise_timeout(phase, rnd, None, unanswered, deadline)
                self.tx(retx)
                backoff += 1
                next_send = now + min(self._rto * 2 ** backoff, self.max_rto)
                continue
            got = self.rx(min(next_send, deadline) - now)
            if got is None:
                continue
            h, payload = got
            if h.job_id != self.job_id or h.nonce != self.nonce:
                self.counters["stale_received"] += 1
                continue
            if accept(h, payload):
                return
            if h.ptype == PacketType.STATUS:
                self.missing = self._bitmap_missing(h)
                unanswered = 0
            elif h.ptype == PacketType.ERROR:
                self.raise_switch_error(h, rnd)
            self.counters["stale_received"] += 1

    # -- the window --------------------------------------------------------------------------------

    def exchange(self, ptype: int, rnd: int, total: int, payload_of: Callable[[int, int], bytes],
                 deliver: Callable[[int, int, memoryview], None], dcode: int, exponent: int, phase: str,
                 deadline: float) -> bool:
        """Send ``total`` lanes through the switch; hand each chunk's aggregate to ``deliver(lo, hi, data)``.

        ``payload_of(lo, hi)`` gives the little-endian int32 bytes of lanes ``lo:hi``; it is called once
        per chunk, as the chunk first leaves, and the packet is kept for retransmissions. A CTRL
        exchange is one chunk on the control slot 0.

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
        job, nonce, epoch = self.job_id, self.nonce, self.epoch
        assert epoch is not None
        seg = FLAG_SEGMENTED if self.segmented_results and not ctrl else 0
        ident = dict(dtype=dcode, job_id=job, worker_id=self.worker_id, num_workers=self.num_workers, nonce=nonce,
                     epoch=epoch, round=rnd, exponent=exponent, tag=self.tag)
        counters = self.counters

        def send(slot: int, p: _Pending, retx: bool) -> None:
            if p.packet is None:
                lo = p.chunk * per
                hi = min(lo + per, total)
                p.packet = bytearray(pack_header(ptype, flags=p.shadow | seg, slot=slot, seq=p.chunk, count=hi - lo,
                                                 **ident))
                p.packet += payload_of(lo, hi)
                if not ctrl:
                    counters["payload_bytes"] += 4 * (hi - lo)  # first transmissions only (see Ina.traffic)
            if retx:
                poke_flags(p.packet, p.shadow | FLAG_RETX | seg)
            self.tx(p.packet)

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
        self.missing = None
        while done < nchunks:
            now = time.monotonic()
            if now >= deadline:
                first = min(pending, key=lambda s: pending[s].chunk)
                self.raise_timeout(phase, rnd, pending[first].chunk, pending[first].unanswered, deadline, first)
            earliest = min(p.deadline for p in pending.values())
            # Drain what has arrived before retransmitting anything: a worker that was descheduled for
            # longer than its RTO finds its results already queued, and must not resend the window.
            got = self.rx(min(earliest, deadline) - now)
            if got is None or now > earliest + self.max_rto:
                self._expire(pending, send, phase, rnd, deadline)
            if got is None:
                continue
            h, payload = got
            if h.job_id != job or h.nonce != nonce or h.epoch != epoch:
                if h.ptype == PacketType.ERROR and h.job_id == job and h.nonce == nonce:
                    self.raise_switch_error(h, rnd)
                counters["stale_received"] += 1
                continue
            p = pending.get(h.slot)
            if h.ptype == PacketType.STATUS:
                if p is not None and h.round == rnd and h.seq == p.chunk:
                    p.unanswered = 0  # the switch is alive and waiting for other workers
                    self.missing = self._bitmap_missing(h)
                    if self.worker_id not in self.missing:
                        # The switch holds this contribution: only a peer is late. Resending it again
                        # soon cannot help; resend after max_rto, in case the result is then lost.
                        p.deadline = max(p.deadline, time.monotonic() + self.max_rto)
                continue
            if h.ptype == PacketType.ERROR:
                self.raise_switch_error(h, rnd)
            if h.ptype != result_type or h.round != rnd or p is None or h.seq != p.chunk:
                if h.ptype == result_type and h.round == rnd and h.seq < next_chunk:
                    counters["duplicate_results"] += 1
                else:
                    counters["stale_received"] += 1
                continue
            lo = p.chunk * per
            hi = min(lo + per, total)
            if (h.flags & FLAG_SHADOW) != p.shadow:
                counters["stale_received"] += 1
                continue
            if h.flags & FLAG_SEGMENTED:
                if not self._reassemble(p, h, payload, lo, hi, deliver):
                    continue
                complete = p.got >= hi - lo
            elif h.count != hi - lo:
                counters["stale_received"] += 1
                continue
            else:
                deliver(lo, hi, payload)
                complete = True
            if h.flags & FLAG_SATURATED:
                saturated = True
            if not complete:
                continue
            counters["results"] += 1
            if not p.retransmitted:
                self._sample_rtt(now - p.sent_at)
            del pending[h.slot]
            done += 1
            if p.chunk + width < nchunks:
                start(h.slot, p.chunk + width, time.monotonic())
        return saturated

    def _expire(self, pending: dict[int, _Pending], send: Callable[[int, _Pending, bool], None], phase: str,
                rnd: int, deadline: float) -> None:
        """Retransmit the expired chunks, oldest first, at most ``_RETX_BURST`` per firing.

        When one peer is late (descheduled on a busy machine), every chunk of the window expires at
        once, and resending the whole window only queues more data behind the data the switch
        already holds (measured in the emulated cluster: bursts of whole-window resends, more
        queueing, more expiries). The first resends' answers (a STATUS naming the late ranks, or the
        kept result) tell which case it is; the others wait one more RTO.
        """
        now = time.monotonic()
        fired = False
        expired = sorted((p.chunk, slot) for slot, p in pending.items() if p.deadline <= now)
        for i, (_, slot) in enumerate(expired):
            p = pending[slot]
            if i >= _RETX_BURST and now < deadline:
                p.deadline = now + self._rto
                continue
            fired = True
            self.counters["timeouts_fired"] += 1
            if now >= deadline or p.unanswered >= self.max_retries:
                self.raise_timeout(phase, rnd, p.chunk, p.unanswered, deadline, slot)
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

    def _reassemble(self, p: _Pending, h: Header, payload: Any, lo: int, hi: int,
                    deliver: Callable[[int, int, memoryview], None]) -> bool:
        """Deliver the new lanes of a result segment (one, or several merged from one GRO buffer).

        A segment covers lanes ``tag .. tag+count`` of the chunk, in SEGMENT_LANES steps; the chunk
        is complete once all are in. Returns False for a segment that does not fit the chunk or
        brings nothing new (counted).
        """
        off, k = h.tag, h.count
        if off % SEGMENT_LANES or k == 0 or off + k > hi - lo or (k % SEGMENT_LANES and off + k != hi - lo):
            self.counters["stale_received"] += 1
            return False
        if p.parts is None:
            p.parts = set()
        offs = range(off, off + k, SEGMENT_LANES)
        if p.parts.isdisjoint(offs):
            deliver(lo + off, lo + off + k, payload)
            p.parts.update(offs)
            p.got += k
            return True
        new = [o for o in offs if o not in p.parts]
        if not new:
            self.counters["duplicate_results"] += 1
            return False
        for o in new:
            m = min(SEGMENT_LANES, off + k - o)
            deliver(lo + o, lo + o + m, payload[4 * (o - off):4 * (o - off + m)])
            p.parts.add(o)
            p.got += m
        return True

    # -- errors ----------------------------------------------------------------------------------

    def _bitmap_missing(self, h: Header) -> list[int]:
        bitmap = (h.tag & 0xFFFFFFFF) | ((h.exponent & 0xFFFFFFFF) << 32)
        return [r for r in range(self.num_workers) if not bitmap >> r & 1]

    def raise_timeout(self, phase: str, rnd: int, chunk: int | None, unanswered: int, deadline: float,
                      slot: int | None = None) -> None:
        """Raise the :class:`CommTimeoutError` of ``phase``: why (budget or deadline) and who is missing."""
        where = f"chunk {chunk} (slot {slot})" if chunk is not None else "the join handshake"
        if unanswered >= self.max_retries and time.monotonic() < deadline:
            why = (f"{unanswered} retransmissions went unanswered: the switch at {self.addr()} is "
                   "unreachable or the link drops everything")
        else:
            why = "the timeout expired"
        if self.missing:
            who = (f"the switch is still waiting for rank(s) {self.missing}, which died, stalled or "
                   "issued a different collective")
        else:
            who = "the switch gave no sign of which ranks are missing"
        raise CommTimeoutError(
            f"{OP} seq={rnd} job {self.job_id} worker {self.worker_id}/{self.num_workers}: no {phase} "
            f"result for {where}: {why}; {who}. Check that every rank is alive and issues the same "
            "collectives, and that the switch runs; then recreate the process group (or sessions) on "
            "every rank", op=OP, seq=rnd, ranks=self.missing if self.missing else None)

    def raise_switch_error(self, h: Header, rnd: int) -> None:
        """Raise the :class:`CommError` an ERROR packet of the switch stands for."""
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
        raise CommError(f"{OP} seq={rnd} job {self.job_id} worker {self.worker_id}: {why}", op=OP, seq=rnd,
                        ranks=[self.worker_id])

    # -- datagrams -------------------------------------------------------------------------------

    def _sample_rtt(self, rtt: float) -> None:
        # RFC 6298's estimator; Karn's rule is applied by the caller (no samples from retransmissions).
        if self._srtt is None:
            self._srtt, self._rttvar = rtt, rtt / 2
        else:
            self._rttvar = 0.75 * self._rttvar + 0.25 * abs(self._srtt - rtt)
            self._srtt = 0.875 * self._srtt + 0.125 * rtt
        self._rto = min(self.max_rto, max(self.min_rto, self._srtt + 4 * self._rttvar))

    def _send(self, packet: bytes | bytearray) -> None:
        # The socket is non-blocking (see rx); a full send buffer waits for room, as a blocking send
        # would, for at most a second, then raises (the caller reports the socket error).
        try:
            self._sock.send(packet)
        except BlockingIOError:
            if not select.select([], [self._sock], [], 1.0)[1]:
                raise
            self._sock.send(packet)

    def tx(self, packet: bytes | bytearray) -> None:
        """Send one datagram (through the fault injector, when there is one)."""
        if self._faults is None:
            self._send(packet)
            self.counters["packets_sent"] += 1
            return
        for pkt in self._faults.on_send(bytes(packet)):  # a copy: held packets must not see later edits
            self._send(pkt)
            self.counters["packets_sent"] += 1

    def rx(self, wait: float) -> tuple[Header, Any] | None:
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
        if (nbytes > HEADER_SIZE and peek_flags(buf) & FLAG_SEGMENTED
                and nbytes > HEADER_SIZE + 4 * peek_count(buf)):
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
        if not (same_but_tag(rows) and np.array_equal(
                segment_tags(rows), h0.tag + SEGMENT_LANES * np.arange(nfull, dtype=np.int64))):
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
            length = min(HEADER_SIZE + 4 * peek_count(view, pos), nbytes - pos)
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
