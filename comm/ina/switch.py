"""The simulated in-network aggregation switch: a UDP process that sums int32 payloads in its slots.

It behaves like a SwitchML program on a programmable switch, in Python:

- a **pool of slots**, partitioned between jobs: each job that JOINs gets a partition of
  ``partition_size`` slots (slot 0 is the job's control slot, the rest hold data), so several process
  groups share one switch without touching each other's state. A job is its *identity*, the pair
  (job id, nonce): the nonce is 64 random bits its rank 0 drew and the process group agreed on, so two
  independent worlds that pick the same job id (the same group name) get two partitions, and a packet
  whose identity matches no job is refused and counted (``foreign_dropped``; ``identity_refused`` when
  its job id is in use under another identity);
- every slot has **two copies** (the shadow-set bit of the header picks one): while workers fill a
  slot's next use in one copy, the other keeps the previous result, so a worker whose result packet
  was lost gets it again by retransmitting its contribution;
- a **per-slot worker bitmap** tells a first contribution from a retransmission or a duplicate;
- aggregation in **int32 with saturation detection** (sums are formed exactly in an int64 scratch,
  then saturated to int32 and flagged, like a saturating switch register), or lane-wise MAX for the
  control slot, where workers agree on the block-floating-point exponent first;
- once all workers contributed, the result goes to **every worker**;
- **counters** (packets, retransmissions, duplicates ignored, malformed/stale/foreign dropped, ...),
  returned to a ``STATS_REQ`` packet and printed on exit.

A job's partition is freed when every worker of its epoch has sent LEAVE (a closed session), or
after ``job_idle_timeout`` seconds without traffic (a crashed job), and reused by the next job.

Each job's incarnation (its *epoch*) is agreed through the switch by a JOIN handshake: every worker
of a new session sends JOIN with a fresh random session tag; when all ``num_workers`` have joined with
new tags, the epoch advances, the job's slots are freed, and JOIN_OK goes to everyone. Packets of an
older epoch are stale and dropped. So a job whose worker crashed mid-aggregation leaves no half-filled
slots behind once its next incarnation joins, and idle jobs' partitions are reclaimed after
``job_idle_timeout`` seconds.

JOINs cannot disturb a running job (docs/faults.md row 28). An incarnation is *running* while all its workers are
joined, none has sent LEAVE and it had traffic within ``job_idle_timeout``; a JOIN for it from one of
its workers with another session tag, or with another number of workers, is refused and counted
(``joins_refused``) and answered with an ERROR to its sender only: the running job's worker count,
epoch, slots and addresses stay as they were. (A new incarnation of the same identity therefore
starts once the previous one is over: a worker left, as a closed or failed session does, or it went
idle.) A LEAVE that matches no session of the job is ignored and counted (``leaves_refused``).
JOINs that never complete cannot hold the pool: an incomplete job, or an incomplete set of JOINs for a
job's next incarnation, is released ``join_timeout`` seconds after its last JOIN
(``pending_released``; joining workers retransmit JOIN well within that), and one source address may
hold at most ``max_pending_per_source`` incomplete jobs at a time.

The switch binds to 127.0.0.1 unless told otherwise (docs/faults.md row 29). It never imports torch. Its process
(:class:`~.launcher.SwitchProcess`, the command line, the stats query) is :mod:`.launcher`'s.
"""

from __future__ import annotations

import errno
import queue
import socket
import sys
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any

import numpy as np

from .protocol import (
    CTRL_LANES,
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
    STAT_NAMES,
    Header,
    PacketType,
    ProtocolError,
    encode_stats,
    pack_header,
    pack_header_into,
    pack_header_of,
    parse_header,
    set_segment_tags,
    unpack_header,
)

__all__ = [
    "DEFAULT_POOL_SLOTS",
    "DEFAULT_PARTITION_SIZE",
    "DEFAULT_JOB_IDLE_TIMEOUT",
    "DEFAULT_JOIN_TIMEOUT",
    "DEFAULT_MAX_PENDING_PER_SOURCE",
    "DEFAULT_RECV_THREADS",
    "DEFAULT_SEND_THREADS",
    "Switch",
    "format_stats",
]

DEFAULT_POOL_SLOTS = 1024
DEFAULT_SEND_THREADS = 2  # see Switch.serve
DEFAULT_RECV_THREADS = 1  # see Switch.serve (2 measured slower: more reordering and retransmissions)
DEFAULT_PARTITION_SIZE = 64  # 1 control slot + 63 data slots: windows up to 63 packets per worker
DEFAULT_JOB_IDLE_TIMEOUT = 300.0
# Joining workers retransmit JOIN at least every max_rto (1 s by default), so an incomplete join that
# has been silent this long was abandoned (a crashed joiner, or a flood of forged JOINs).
DEFAULT_JOIN_TIMEOUT = 5.0
# A worker session has one socket and joins one job, so a source address (host, port) with more than
# one incomplete job at a time is not one of ours; 2 leaves room for a port the kernel reused.
DEFAULT_MAX_PENDING_PER_SOURCE = 2
_INT32_MIN = -(2**31)
_INT32_MAX = 2**31 - 1
_SOCKET_BUFFER = 4 << 20  # the kernel caps this at net.core.rmem_max / wmem_max
_RETIRED_TAGS = 256
_GRAVES = 4096  # released jobs whose epoch and retired tags are remembered
_UDP_SEGMENT = getattr(socket, "UDP_SEGMENT", 103)  # linux/udp.h; Python 3.11 lacks the constant
_GSO_SEGMENTS = 40  # segments per GSO super-packet: 40 x 1472 B stays below the 65,507-byte limit
_GSO_CMSG = [(socket.IPPROTO_UDP, _UDP_SEGMENT, SEGMENT_BYTES.to_bytes(2, sys.byteorder))]


def _newer(a: tuple[int, int], b: tuple[int, int]) -> bool:
    """True when chunk identity ``a`` (round, seq) comes after ``b``; rounds use serial arithmetic."""
    if a[0] != b[0]:
        return 0 < ((a[0] - b[0]) & 0xFFFFFFFF) < 0x80000000
    return a[1] > b[1]


def _status(job: _Job, h: Header, bitmap: int) -> bytes:
    """A STATUS packet: which workers have contributed (64-bit bitmap split over tag and exponent)."""
    hi = (bitmap >> 32) & 0xFFFFFFFF
    return pack_header(PacketType.STATUS, job_id=job.job_id, num_workers=job.n, slot=h.slot,
                       nonce=job.nonce, epoch=job.epoch, round=h.round, seq=h.seq, tag=bitmap & 0xFFFFFFFF,
                       exponent=hi - (1 << 32) if hi >> 31 else hi)


def _segment(result: bytearray, count: int) -> bytearray:
    """``result`` (header + ``count`` lanes) as consecutive SEGMENT_BYTES datagrams (FLAG_SEGMENTED).

    Segment i repeats the header with ``count`` = its lanes and ``tag`` = its first lane in the chunk.
    The full segments are built as rows of one numpy array (no per-segment Python work).
    """
    h = unpack_header(result)  # built by _complete: no validation needed
    h = h._replace(flags=h.flags | FLAG_SEGMENTED)
    nfull, rest = divmod(count, SEGMENT_LANES)
    out = bytearray(nfull * SEGMENT_BYTES + (HEADER_SIZE + 4 * rest if rest else 0))
    if nfull:
        rows = np.frombuffer(out, dtype=np.uint8, count=nfull * SEGMENT_BYTES).reshape(nfull, SEGMENT_BYTES)
        rows[:, :HEADER_SIZE] = np.frombuffer(pack_header_of(h._replace(count=SEGMENT_LANES, tag=0)), dtype=np.uint8)
        set_segment_tags(rows, np.arange(nfull, dtype=np.uint32) * SEGMENT_LANES)
        rows[:, HEADER_SIZE:] = np.frombuffer(result, dtype=np.uint8, count=4 * nfull * SEGMENT_LANES,
                                              offset=HEADER_SIZE).reshape(nfull, 4 * SEGMENT_LANES)
    if rest:
        pos, lo = nfull * SEGMENT_BYTES, nfull * SEGMENT_LANES
        out[pos:pos + HEADER_SIZE] = pack_header_of(h._replace(count=rest, tag=lo))
        out[pos + HEADER_SIZE:] = memoryview(result)[HEADER_SIZE + 4 * lo:HEADER_SIZE + 4 * count]
    return out


class _Slot:
    """One copy of one slot: the current use's identity, bitmap, accumulator and kept result."""

    __slots__ = ("ident", "bitmap", "nseen", "count", "exponent", "dtype", "acc", "complete", "result",
                 "segmented")

    def __init__(self) -> None:
        self.ident: tuple[int, int] | None = None
        self.bitmap = 0
        self.nseen = 0
        self.count = 0
        self.exponent = 0
        self.dtype = 0
        self.acc: np.ndarray | None = None
        self.complete = False
        self.result: bytearray | None = None
        self.segmented: bytearray | None = None  # the result as SEGMENT_BYTES datagrams, when asked for

    def free(self) -> None:
        self.ident = None
        self.bitmap = 0
        self.nseen = 0
        self.complete = False
        self.result = None
        self.segmented = None


class _Job:
    """One job identity's partition and incarnation state."""

    def __init__(self, job_id: int, nonce: int, partition: int, num_workers: int, partition_size: int,
                 creator: Any = None):
        self.job_id = job_id
        self.nonce = nonce
        self.partition = partition
        self.n = num_workers
        self.epoch = 0
        self.established = False  # an incarnation whose workers all joined exists
        self.creator = creator  # the source address whose JOIN created the job (pending-job limit)
        self.tags: list[int | None] = [None] * num_workers
        self.addrs: list[Any] = [None] * num_workers
        self.segmented = [False] * num_workers  # whose last DATA packet asked for segmented results
        self.pending: dict[int, int] = {}
        self.pending_n = num_workers
        self.pending_addrs: dict[int, Any] = {}
        self.pending_active = time.monotonic()  # the pending set's last JOIN (join_timeout)
        self.retired: deque[tuple[int, int]] = deque(maxlen=_RETIRED_TAGS)
        self.slots = [[_Slot() for _ in range(partition_size)] for _ in range(2)]
        self.last_active = time.monotonic()
        self.left = 0  # bitmap of workers of the current epoch that sent LEAVE

    def running(self, now: float, idle_timeout: float) -> bool:
        """All workers joined, none left, traffic within the idle timeout: no JOIN may touch it."""
        return self.established and self.left == 0 and now - self.last_active <= idle_timeout

    def reset(self, num_workers: int) -> None:
        self.n = num_workers
        self.left = 0
        self.addrs = [None] * num_workers
        self.segmented = [False] * num_workers
        for copy in self.slots:
            for st in copy:
                st.free()


class Switch:
    """The switch's state and packet handler, bound to one UDP socket.

    Args:
        host: address to bind; 127.0.0.1 by default so that nothing off the machine reaches it.
        port: UDP port; 0 picks a free one (read it back from ``address``).
        pool_slots: total slots in the pool.
        partition_size: slots per job (slot 0 of each partition is the control slot).
        job_idle_timeout: seconds after which an idle job's partition may be reclaimed.
        join_timeout: seconds after its last JOIN that an incomplete join (a job, or a running job's
            next incarnation, that not all workers joined) is released; more than the workers'
            ``max_rto``, their longest gap between JOIN retransmissions.
        max_pending_per_source: incomplete jobs one source address (host, port) may hold at once.
    """

    def __init__(self, host: str = "127.0.0.1", port: int = 0, *, pool_slots: int = DEFAULT_POOL_SLOTS,
                 partition_size: int = DEFAULT_PARTITION_SIZE, job_idle_timeout: float = DEFAULT_JOB_IDLE_TIMEOUT,
                 join_timeout: float = DEFAULT_JOIN_TIMEOUT,
                 max_pending_per_source: int = DEFAULT_MAX_PENDING_PER_SOURCE):
        if partition_size < 2 or pool_slots < partition_size:
            raise ValueError(f"switch: partition_size={partition_size} must be >= 2 and <= "
                             f"pool_slots={pool_slots}; pass a larger pool or a smaller partition")
        if not join_timeout > 0 or not job_idle_timeout > 0 or max_pending_per_source < 1:
            raise ValueError(f"switch: need job_idle_timeout > 0, join_timeout > 0 and max_pending_per_source "
                             f">= 1 (got {job_idle_timeout}, {join_timeout}, {max_pending_per_source})")
        self.partition_size = partition_size
        self.num_partitions = pool_slots // partition_size
        self.job_idle_timeout = job_idle_timeout
        self.join_timeout = join_timeout
        self.max_pending_per_source = max_pending_per_source
        self.jobs: dict[tuple[int, int], _Job] = {}  # by identity (job id, nonce)
        self._free_partitions = list(range(self.num_partitions - 1, -1, -1))
        self._graves: dict[tuple[int, int], tuple[int, deque[tuple[int, int]]]] = {}
        self.counters: dict[str, int] = dict.fromkeys(STAT_NAMES, 0)
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        for opt in (socket.SO_RCVBUF, socket.SO_SNDBUF):
            self.sock.setsockopt(socket.SOL_SOCKET, opt, _SOCKET_BUFFER)
        self.sock.bind((host, port))
        self.address: tuple[str, int] = self.sock.getsockname()[:2]
        self._buf = bytearray(65536)  # larger than MAX_DATAGRAM, so oversized datagrams show their size
        self._sendq: queue.SimpleQueue | None = None  # set while serve() runs sender threads
        self._gso = True  # cleared when the kernel refuses UDP_SEGMENT: segments then go one by one

    # -- lifecycle -------------------------------------------------------------------------------

    def close(self) -> None:
        self.sock.close()

    def serve(self, should_stop: Callable[[], bool], *, poll: float = 0.2,
              send_threads: int = DEFAULT_SEND_THREADS, recv_threads: int = DEFAULT_RECV_THREADS) -> None:
        """Handle packets until ``should_stop()`` is true (checked at least every ``poll`` seconds).

        Threads. Most of the switch's CPU time is the kernel's, not Python's: in the emulated cluster
        a 32 KiB datagram is 23 IP fragments, each crossing a veth pair, the bridge and two tbf
        qdiscs (measured before segmented results: about 300 of 400 ms of CPU per 16 MiB all-reduce
        over 4 workers was system time, nearly all of it in ``sendto``). System calls release the GIL,
        so with ``send_threads > 0`` datagrams leave through sender threads, and ``recv_threads``
        threads receive, each handling its datagram under one lock: the kernel's work runs on the
        other core (or, on a busy machine, in the threads' own scheduler shares) while one thread
        parses and sums. The protocol tolerates the reordering this may cause.
        """
        lock = threading.Lock()
        senders = self._start_senders(send_threads)
        receivers = [threading.Thread(target=self._receive_loop, args=(should_stop, poll, lock, bytearray(65536)),
                                      name=f"ina-switch-recv{i + 1}", daemon=True)
                     for i in range(max(0, recv_threads - 1))]
        self.sock.settimeout(poll)
        try:
            for t in receivers:
                t.start()
            self._receive_loop(should_stop, poll, lock, self._buf, housekeeping=True)
        finally:
            for t in receivers:
                t.join(poll + 5.0)
            self._stop_senders(senders)

    def _receive_loop(self, should_stop: Callable[[], bool], poll: float, lock: threading.Lock,
                      buf: bytearray, housekeeping: bool = False) -> None:
        sock = self.sock
        last_housekeeping = time.monotonic()
        while not should_stop():
            try:
                nbytes, addr = sock.recvfrom_into(buf)
            except socket.timeout:
                if housekeeping:
                    with lock:
                        self._housekeeping()
                    last_housekeeping = time.monotonic()
                continue
            except OSError:
                # ICMP port-unreachable from a worker that went away surfaces here on Linux.
                continue
            with lock:
                self.handle(buf, nbytes, addr)
            # Under steady traffic (even a trickle faster than ``poll``) the socket never times out;
            # abandoned joins must still be released within about half a second of their join timeout.
            # (One clock read per datagram is noise next to parsing it.)
            if housekeeping and time.monotonic() - last_housekeeping > 0.5:
                with lock:
                    self._housekeeping()
                last_housekeeping = time.monotonic()

    def _start_senders(self, count: int) -> list[threading.Thread]:
        if count <= 0:
            return []
        q: queue.SimpleQueue = queue.SimpleQueue()
        threads = [threading.Thread(target=self._sender, args=(q,), name=f"ina-switch-send{i}", daemon=True)
                   for i in range(count)]
        for t in threads:
            t.start()
        self._sendq = q
        return threads

    def _stop_senders(self, threads: list[threading.Thread]) -> None:
        q, self._sendq = self._sendq, None
        if q is None:
            return
        for _ in threads:
            q.put(None)
        for t in threads:
            t.join(5.0)

    def _sender(self, q: queue.SimpleQueue) -> None:
        while True:
            item = q.get()
            if item is None:
                return
            self._transmit(*item)

    def _transmit(self, data: bytes | bytearray, addr: Any, segmented: bool = False) -> None:
        try:
            if not segmented or len(data) <= SEGMENT_BYTES:
                self.sock.sendto(data, addr)
                return
            view = memoryview(data)
            if self._gso:
                # One GSO super-packet per at most _GSO_SEGMENTS segments (the kernel caps a UDP
                # datagram, super-packets included, below 64 KiB).
                step = _GSO_SEGMENTS * SEGMENT_BYTES
                try:
                    for off in range(0, len(data), step):
                        self.sock.sendmsg([view[off:off + step]], _GSO_CMSG, 0, addr)
                    return
                except OSError as e:
                    if e.errno not in (errno.EINVAL, errno.EIO, errno.ENOPROTOOPT, errno.EOPNOTSUPP):
                        raise
                    self._gso = False  # no UDP GSO here (or an MTU below 1500): one datagram each
            for off in range(0, len(data), SEGMENT_BYTES):
                self.sock.sendto(view[off:off + SEGMENT_BYTES], addr)
        except OSError:
            pass  # a worker that vanished; its peers will time out and say so

    def stats(self) -> dict[str, int]:
        out = dict(self.counters)
        out["jobs_active"] = len(self.jobs)
        return out

    # -- packet handling -------------------------------------------------------------------------

    def handle(self, buf: bytearray, nbytes: int, addr: Any) -> None:
        """Validate one datagram and act on it; malformed input is counted, never raised."""
        c = self.counters
        c["packets"] += 1
        try:
            h = parse_header(buf, nbytes, allowed=PacketType.TO_SWITCH, max_slot=self.partition_size)
        except ProtocolError as e:
            c["malformed_dropped"] += 1
            c[e.reason] += 1
            return
        if h.ptype == PacketType.DATA or h.ptype == PacketType.CTRL:
            self._on_contribution(h, buf, addr)
        elif h.ptype == PacketType.JOIN:
            self._on_join(h, addr)
        elif h.ptype == PacketType.LEAVE:
            self._on_leave(h)
        else:  # STATS_REQ
            c["stats_requests"] += 1
            payload = encode_stats(self.stats())
            self._send(pack_header(PacketType.STATS_REPLY, count=len(STAT_NAMES)) + payload, addr)

    def _send(self, data: bytes | bytearray, addr: Any, segmented: bool = False) -> None:
        # ``data`` is never modified once handed here (a completed slot's result is a new bytearray
        # per use), so a sender thread may read it later.
        q = self._sendq
        if q is not None:
            q.put((data, addr, segmented))
        else:
            self._transmit(data, addr, segmented)

    def _error(self, h: Header, code: int, addr: Any) -> None:
        """An ERROR to the sender of ``h`` only: a refused packet never reaches the job's workers."""
        self._send(pack_header(PacketType.ERROR, job_id=h.job_id, worker_id=h.worker_id,
                               num_workers=h.num_workers, nonce=h.nonce, exponent=code), addr)

    def _on_join(self, h: Header, addr: Any) -> None:
        """A worker's new session asks to join its job's next incarnation (see the module docstring).

        Order of the checks: an unknown identity takes a partition (within the per-source limit of
        incomplete jobs); a late JOIN of a retired session is stale; a lost JOIN_OK is resent; a JOIN
        that would change a running incarnation is refused; otherwise it joins the pending set, and the
        set's last worker starts the new epoch.
        """
        c = self.counters
        c["join_packets"] += 1
        key = (h.job_id, h.nonce)
        w = h.worker_id
        now = time.monotonic()
        job = self.jobs.get(key)
        if job is None:
            grave = self._graves.get(key)
            if grave is not None and (w, h.tag) in grave[1]:
                c["stale_dropped"] += 1  # a late copy of a JOIN of this job's last incarnation
                return
            held = sum(1 for j in self.jobs.values() if not j.established and j.creator == addr)
            if held >= self.max_pending_per_source:
                c["joins_refused"] += 1
                self._error(h, ERR_PENDING_LIMIT, addr)
                return
            part = self._allocate()
            if part is None:
                c["jobs_refused"] += 1
                self._error(h, ERR_NO_PARTITION, addr)
                return
            job = self.jobs[key] = _Job(h.job_id, h.nonce, part, h.num_workers, self.partition_size, addr)
            grave = self._graves.pop(key, None)
            if grave is not None:
                job.epoch, job.retired = grave
        if (w, h.tag) in job.retired:
            c["stale_dropped"] += 1
            return
        if job.established and h.num_workers == job.n and job.tags[w] == h.tag:
            # JOIN_OK was lost: resend it. (Duplicates of a completed JOIN land here too.)
            job.addrs[w] = addr
            self._send(self._join_ok(job), addr)
            c["results_resent"] += 1
            return
        if job.running(now, self.job_idle_timeout):
            # Worker w of the running incarnation is joined with another session, or the JOIN counts
            # other workers: a forgery, a stray, or a second job reusing this identity. Only its
            # sender hears of it; the running job's count, epoch, slots and addresses are untouched.
            c["joins_refused"] += 1
            self._error(h, ERR_BAD_WORKERS if h.num_workers != job.n else ERR_JOB_RUNNING, addr)
            return
        if job.pending and h.num_workers != job.pending_n:
            # The incomplete set was started with another worker count; it is released by the join
            # timeout if it was abandoned, and this JOIN's retransmissions then start a new one.
            c["joins_refused"] += 1
            return
        job.pending_n = h.num_workers
        job.pending_active = now
        if job.pending.get(w) == h.tag:
            c["retransmissions" if h.flags & FLAG_RETX else "duplicates_ignored"] += 1
            if h.flags & FLAG_RETX:
                self._send(_status(job, h, sum(1 << i for i in job.pending)), addr)
            return
        job.pending[w] = h.tag
        job.pending_addrs[w] = addr
        if len(job.pending) < job.pending_n:
            return
        # Everyone joined with a new session: a new incarnation, with every slot freed.
        for wid, tag in enumerate(job.tags):
            if tag is not None:
                job.retired.append((wid, tag))
        job.reset(job.pending_n)
        job.epoch = (job.epoch + 1) & 0xFFFFFFFF
        job.tags = [job.pending[i] for i in range(job.n)]
        for i in range(job.n):
            job.addrs[i] = job.pending_addrs[i]
        job.pending.clear()
        job.pending_addrs.clear()
        job.established = True
        job.last_active = now
        c["epochs"] += 1
        msg = self._join_ok(job)
        for a in job.addrs:
            self._send(msg, a)

    def _on_leave(self, h: Header) -> None:
        """A worker closed its session; when every worker of the epoch has, the partition is freed.

        Only a LEAVE carrying a session's identity and tag counts; anything else is refused and
        counted, so a forged LEAVE cannot end a running job.
        """
        c = self.counters
        key = (h.job_id, h.nonce)
        w = h.worker_id
        job = self.jobs.get(key)
        if job is None:
            grave = self._graves.get(key)
            if grave is not None and (w, h.tag) in grave[1]:
                c["duplicates_ignored"] += 1  # the second copy of the LEAVE that released the job
            else:
                c["leaves_refused"] += 1
            return
        if job.pending.get(w) == h.tag:
            # A session that gave up joining (it sends LEAVE on close too): an incomplete job nobody
            # else joined is released now rather than at its join timeout.
            del job.pending[w]
            job.pending_addrs.pop(w, None)
            if not job.established and not job.pending:
                self._release(key)
                c["pending_released"] += 1
                return
        elif job.established and h.num_workers == job.n and job.tags[w] == h.tag:
            if job.left >> w & 1:
                c["duplicates_ignored"] += 1
            job.left |= 1 << w
        elif (w, h.tag) in job.retired:
            c["duplicates_ignored"] += 1
            return
        else:
            c["leaves_refused"] += 1
            return
        if job.established and job.left == (1 << job.n) - 1 and not job.pending:
            self._release(key)
            c["jobs_released"] += 1

    def _release(self, key: tuple[int, int]) -> None:
        job = self.jobs.pop(key)
        self._free_partitions.append(job.partition)
        # Remember the epoch and the retired session tags, so that a later incarnation of this identity
        # still tells its predecessors' late packets from its own. (A job that never had an incarnation
        # and no past leaves nothing to remember: a flood of unknown identities cannot push out the
        # graves of real jobs.)
        for wid, tag in enumerate(job.tags):
            if tag is not None:
                job.retired.append((wid, tag))
        if not job.established and job.epoch == 0 and not job.retired:
            return
        self._graves[key] = (job.epoch, job.retired)
        while len(self._graves) > _GRAVES:
            self._graves.pop(next(iter(self._graves)))

    def _join_ok(self, job: _Job) -> bytes:
        tags = np.array([t or 0 for t in job.tags], dtype="<u4")
        return pack_header(PacketType.JOIN_OK, job_id=job.job_id, num_workers=job.n,
                           slot=self.partition_size - 1, nonce=job.nonce, epoch=job.epoch,
                           count=job.n) + tags.tobytes()

    def _on_contribution(self, h: Header, buf: bytearray, addr: Any) -> None:
        c = self.counters
        is_ctrl = h.ptype == PacketType.CTRL
        c["ctrl_packets" if is_ctrl else "data_packets"] += 1
        if is_ctrl != (h.slot == 0):
            c["malformed_dropped"] += 1
            c["bad_slot"] += 1
            return
        job = self.jobs.get((h.job_id, h.nonce))
        if job is None or h.num_workers != job.n:
            c["foreign_dropped"] += 1
            if job is None:
                if any(k[0] == h.job_id for k in self.jobs):
                    c["identity_refused"] += 1  # the job id is in use, by another identity
            elif job.established and h.epoch == job.epoch:
                self._error(h, ERR_BAD_WORKERS, addr)
            return
        w = h.worker_id
        if h.epoch != job.epoch or h.tag != job.tags[w]:
            c["stale_dropped"] += 1
            return
        if is_ctrl and h.count < CTRL_LANES + job.n:
            c["mismatch_dropped"] += 1
            return
        job.last_active = time.monotonic()
        job.addrs[w] = addr
        job.segmented[w] = bool(h.flags & FLAG_SEGMENTED)
        shadow = h.flags & FLAG_SHADOW
        st = job.slots[shadow][h.slot]
        ident = (h.round, h.seq)
        bit = 1 << w
        payload = np.frombuffer(buf, dtype="<i4", count=h.count, offset=HEADER_SIZE)
        if st.ident == ident:
            if st.bitmap & bit:
                if h.flags & FLAG_RETX:
                    c["retransmissions"] += 1
                else:
                    c["duplicates_ignored"] += 1
                if st.complete:
                    assert st.result is not None
                    if st.segmented is not None and job.segmented[w]:
                        self._send(st.segmented, addr, True)
                    else:
                        self._send(st.result, addr)
                    c["results_resent"] += 1
                    other = job.slots[1 - shadow][h.slot].ident
                    if other is not None and _newer(other, ident):
                        c["shadow_resends"] += 1
                elif h.flags & FLAG_RETX:
                    # Tell the worker who is missing, so its timeout can name the ranks.
                    self._send(_status(job, h, st.bitmap), addr)
                return
            if h.count != st.count or h.exponent != st.exponent or h.dtype != st.dtype:
                c["mismatch_dropped"] += 1
                return
            acc = st.acc
            assert acc is not None
            if is_ctrl:
                np.maximum(acc[: h.count], payload, out=acc[: h.count])
            else:
                np.add(acc[: h.count], payload, out=acc[: h.count])
        elif st.ident is None or _newer(ident, st.ident):
            if st.ident is not None and not st.complete:
                c["abandoned_slots"] += 1
            st.ident = ident
            st.bitmap = 0
            st.nseen = 0
            st.complete = False
            st.result = None
            st.count = h.count
            st.exponent = h.exponent
            st.dtype = h.dtype
            if st.acc is None or st.acc.shape[0] < h.count:
                st.acc = np.empty(max(h.count, 1), dtype=np.int64)
            st.acc[: h.count] = payload
        else:
            c["stale_dropped"] += 1
            return
        st.bitmap |= bit
        st.nseen += 1
        if st.nseen == job.n:
            self._complete(job, st, h, shadow, is_ctrl)

    def _complete(self, job: _Job, st: _Slot, h: Header, shadow: int, is_ctrl: bool) -> None:
        acc = st.acc
        assert acc is not None
        view = acc[: st.count]
        flags = shadow
        if not is_ctrl and st.count and (int(view.max()) > _INT32_MAX or int(view.min()) < _INT32_MIN):
            np.clip(view, _INT32_MIN, _INT32_MAX, out=view)
            flags |= FLAG_SATURATED
            self.counters["saturated_slots"] += 1
        ptype = PacketType.CTRL_RESULT if is_ctrl else PacketType.RESULT
        result = bytearray(HEADER_SIZE + 4 * st.count)
        pack_header_into(result, ptype, flags=flags, dtype=st.dtype, job_id=job.job_id, num_workers=job.n,
                         slot=h.slot, nonce=job.nonce, epoch=job.epoch, round=h.round, seq=h.seq,
                         count=st.count, exponent=st.exponent)
        np.frombuffer(result, dtype="<i4", offset=HEADER_SIZE)[:] = view
        st.result = result
        st.segmented = None
        if not is_ctrl and st.count > SEGMENT_LANES and any(job.segmented):
            st.segmented = _segment(result, st.count)
        st.complete = True
        self.counters["results_sent"] += 1
        for a, seg in zip(job.addrs, job.segmented):
            if a is not None:
                if seg and st.segmented is not None:
                    self._send(st.segmented, a, True)
                else:
                    self._send(result, a)

    # -- partitions ------------------------------------------------------------------------------

    def _allocate(self) -> int | None:
        if not self._free_partitions:
            self._housekeeping()
        return self._free_partitions.pop() if self._free_partitions else None

    def _housekeeping(self) -> None:
        """Release idle jobs, abandoned incomplete jobs and abandoned pending sets."""
        now = time.monotonic()
        c = self.counters
        for key, job in list(self.jobs.items()):
            if not job.established:
                if now - job.pending_active > self.join_timeout:
                    self._release(key)
                    c["pending_released"] += 1
                continue
            if now - job.last_active > self.job_idle_timeout:
                self._release(key)
                continue
            if job.pending and now - job.pending_active > self.join_timeout:
                job.pending.clear()
                job.pending_addrs.clear()
                c["pending_released"] += 1
                if job.left == (1 << job.n) - 1:
                    self._release(key)
                    c["jobs_released"] += 1


def format_stats(stats: dict[str, int]) -> str:
    """One line of ``name=value`` pairs, zero counters left out."""
    return " ".join(f"{k}={v}" for k, v in stats.items() if v)
