"""The wire protocol of the simulated in-network aggregation switch.

One UDP datagram carries one fixed 48-byte header, packed with :mod:`struct` in network byte order,
followed by ``count`` little-endian int32 lanes (or, for a stats reply, ``count`` little-endian
uint64 counters). Nothing else crosses the socket: no pickle, no JSON, no variable-length fields, so
the switch can validate every field against fixed bounds before it touches any state (docs/architecture.md section 10,
docs/faults.md row 28).

Header layout (``!4sBBBBHHHHQIIIIiI``, version 2)::

    magic      4s  b"CINA"
    version    B   PROTOCOL_VERSION
    ptype      B   packet type (JOIN, JOIN_OK, CTRL, CTRL_RESULT, DATA, RESULT, STATUS, ERROR,
                   STATS_REQ, STATS_REPLY, LEAVE)
    flags      B   FLAG_SHADOW (the slot's shadow set), FLAG_RETX (a retransmission),
                   FLAG_SATURATED (the int32 sum saturated), FLAG_SEGMENTED (DATA: send my results as
                   segments; RESULT: this is one segment, ``tag`` = its first lane in the chunk)
    dtype      B   the dtype of the tensor being reduced (DTYPE_FP32/FP16/BF16); payloads are int32
    job_id     H   the job (one process group); jobs share a switch through a partitioned slot pool
    worker_id  H   0 <= worker_id < num_workers
    num_workers H  1 <= num_workers <= MAX_WORKERS (bitmaps are 64-bit)
    slot       H   slot inside the job's partition (0 is the control slot)
    nonce      Q   the job's identity: 64 random bits drawn once per job (on its rank 0, agreed through
                   the process group); the switch keys jobs by (job_id, nonce), so two independent
                   jobs that pick the same job id never share a partition, and a packet whose identity
                   matches no job is refused and counted
    epoch      I   the job's incarnation, agreed through the switch by the JOIN handshake
    round      I   the collective's sequence number within the epoch
    seq        I   the chunk index within the round
    count      I   payload lanes that follow (validated against the datagram length)
    exponent   i   the block-floating-point shift the payload was quantized with (or an error code)
    tag        I   the sender's session tag (JOIN), a bitmap half (STATUS), or a segment's first
                   lane within its chunk (RESULT with FLAG_SEGMENTED)

Payload size. A Python switch spends roughly 10-30 us of interpreter time per datagram whatever its
size (more on a busy machine), while numpy adds 16000 int32 lanes in a few microseconds; so the
per-packet cost, not the bytes, bounds its rate, and the default is the largest payload:
``DEFAULT_PAYLOAD_ELEMS = MAX_PAYLOAD_ELEMS = 16000`` (64,048 B, the hard bound below the 65,507-byte
UDP limit; larger datagrams are rejected), with ``DEFAULT_WINDOW = 8`` packets in flight per worker
(512 KiB, inside the 4 MiB socket buffers we ask for even with several workers, and below the
emulated cluster's tbf queue of ~750 KB). Measured interleaved in the emulated cluster (4 nodes x
200 Mbit/s, busy 2-core host, 16 MiB): 16000 x 8 -> 782 ms median, 16000 x 12 -> 825, 16000 x 16 ->
889, 8192 x 16 -> 817 (more retransmissions with the deeper windows). On links with a 1500-byte MTU
(the emulated cluster's veth pairs) the kernel fragments a 64 KB datagram into 44 fragments and a
lost fragment loses the datagram; retransmission covers it.

Segmented results. Those fragments are what a 32 KiB datagram costs: in the emulated cluster the
kernel spends about 5 us of CPU on each (fragmenting, crossing a veth pair, the bridge and two tbf
qdiscs), about 80 ms per 16 MiB sent, and the switch sends every result to every worker. A worker that
sets FLAG_SEGMENTED in its DATA packets gets its results as ``SEGMENT_BYTES`` datagrams (header +
``SEGMENT_LANES`` lanes each, the last one shorter), which the switch hands to the kernel as one UDP
GSO super-packet (``UDP_SEGMENT``): it crosses the links whole, like a TCP GSO segment, and a worker
socket with ``UDP_GRO`` receives it whole (measured: 16 MiB sent as 64 KiB GSO buffers cost 15 ms of
system time against 70-90 ms as fragmented 32 KiB datagrams). Without GSO/GRO the segments are
ordinary datagrams: each carries its own header and is validated and applied on its own.
"""

from __future__ import annotations

import struct
from typing import Any, NamedTuple

__all__ = [
    "MAGIC",
    "PROTOCOL_VERSION",
    "HEADER",
    "HEADER_SIZE",
    "FIELDS",
    "FIELD_INDEX",
    "OFFSETS",
    "FLAGS_OFFSET",
    "COUNT_OFFSET",
    "TAG_OFFSET",
    "MAX_NONCE",
    "MAX_WORKERS",
    "MAX_PAYLOAD_ELEMS",
    "DEFAULT_PAYLOAD_ELEMS",
    "DEFAULT_WINDOW",
    "MAX_DATAGRAM",
    "PacketType",
    "FLAG_SHADOW",
    "FLAG_RETX",
    "FLAG_SATURATED",
    "FLAG_SEGMENTED",
    "SEGMENT_BYTES",
    "SEGMENT_LANES",
    "DTYPE_FP32",
    "DTYPE_FP16",
    "DTYPE_BF16",
    "DTYPE_NAMES",
    "ERR_NO_PARTITION",
    "ERR_BAD_WORKERS",
    "ERR_JOB_RUNNING",
    "ERR_PENDING_LIMIT",
    "STAT_NAMES",
    "CTRL_LANES",
    "Header",
    "ProtocolError",
    "pack_header",
    "pack_header_into",
    "pack_header_of",
    "parse_header",
    "unpack_header",
    "peek_flags",
    "peek_count",
    "poke_flags",
    "TAG_BYTES",
    "segment_tags",
    "set_segment_tags",
    "same_but_tag",
    "encode_stats",
    "decode_stats",
]

MAGIC = b"CINA"
PROTOCOL_VERSION = 2  # 2: the 64-bit job identity (nonce) after ``slot``
# The header's fields in wire order with their struct codes; the struct, the byte offsets and the
# tuple indices below all derive from this one table, so no other module spells out the layout.
_LAYOUT = (("magic", "4s"), ("version", "B"), ("ptype", "B"), ("flags", "B"), ("dtype", "B"),
           ("job_id", "H"), ("worker_id", "H"), ("num_workers", "H"), ("slot", "H"), ("nonce", "Q"),
           ("epoch", "I"), ("round", "I"), ("seq", "I"), ("count", "I"), ("exponent", "i"), ("tag", "I"))
HEADER = struct.Struct("!" + "".join(code for _, code in _LAYOUT))
HEADER_SIZE = HEADER.size  # 48
FIELDS = tuple(name for name, _ in _LAYOUT)
FIELD_INDEX = {name: i for i, name in enumerate(FIELDS)}  # positions in HEADER.unpack's tuple
OFFSETS = {name: struct.calcsize("!" + "".join(code for _, code in _LAYOUT[:i]))
           for i, (name, _) in enumerate(_LAYOUT)}
FLAGS_OFFSET = OFFSETS["flags"]  # one byte
COUNT_OFFSET = OFFSETS["count"]  # big-endian uint32
TAG_OFFSET = OFFSETS["tag"]  # big-endian uint32, the last field
TAG_BYTES = slice(TAG_OFFSET, TAG_OFFSET + 4)  # the tag's bytes within a header
MAX_NONCE = 2**64 - 1
MAX_WORKERS = 64  # per-slot worker bitmaps are 64-bit, as a switch register would be
MAX_PAYLOAD_ELEMS = 16000
DEFAULT_PAYLOAD_ELEMS = MAX_PAYLOAD_ELEMS
DEFAULT_WINDOW = 8
MAX_DATAGRAM = HEADER_SIZE + 4 * MAX_PAYLOAD_ELEMS


class PacketType:
    """Packet types; the two sets below say which side may send which."""

    JOIN = 1
    JOIN_OK = 2
    CTRL = 3
    CTRL_RESULT = 4
    DATA = 5
    RESULT = 6
    STATUS = 7
    ERROR = 8
    STATS_REQ = 9
    STATS_REPLY = 10
    LEAVE = 11

    TO_SWITCH = frozenset({JOIN, CTRL, DATA, STATS_REQ, LEAVE})
    TO_WORKER = frozenset({JOIN_OK, CTRL_RESULT, RESULT, STATUS, ERROR, STATS_REPLY})


FLAG_SHADOW = 0x01
FLAG_RETX = 0x02
FLAG_SATURATED = 0x04
FLAG_SEGMENTED = 0x08
_KNOWN_FLAGS = FLAG_SHADOW | FLAG_RETX | FLAG_SATURATED | FLAG_SEGMENTED

SEGMENT_BYTES = 1472  # a 1500-byte MTU less the IPv4 and UDP headers: segments are never fragmented
SEGMENT_LANES = (SEGMENT_BYTES - HEADER_SIZE) // 4  # 356 int32 lanes after the header

DTYPE_FP32 = 1
DTYPE_FP16 = 2
DTYPE_BF16 = 3
DTYPE_NAMES = {DTYPE_FP32: "float32", DTYPE_FP16: "float16", DTYPE_BF16: "bfloat16"}

# ERROR packets carry one of these in ``exponent``; they go only to the sender of the refused packet.
ERR_NO_PARTITION = 1  # JOIN: every partition is taken
ERR_BAD_WORKERS = 2  # a running job of this identity has another number of workers
ERR_JOB_RUNNING = 3  # JOIN: this worker of the job's running incarnation is joined with another session
ERR_PENDING_LIMIT = 4  # JOIN: this source address already holds the most incomplete jobs allowed

# Control-slot lanes (CTRL packets are aggregated lane-wise with MAX, not SUM): the exponent, and
# each agreed quantity twice, once negated, so max == -max(-x) tells every rank whether all agreed.
# Lanes CTRL_LANES.. hold one non-finite flag per worker.
CTRL_EXP, CTRL_NUMEL_LO, CTRL_NUMEL_HI, CTRL_NNUMEL_LO, CTRL_NNUMEL_HI = 0, 1, 2, 3, 4
CTRL_DTYPE, CTRL_NDTYPE, CTRL_OP, CTRL_NOP, CTRL_HEADROOM, CTRL_NHEADROOM = 5, 6, 7, 8, 9, 10
# Window and payload size must agree too: chunk c lives in slot 1 + c % window on every worker.
CTRL_WINDOW, CTRL_NWINDOW, CTRL_PAYLOAD, CTRL_NPAYLOAD = 11, 12, 13, 14
CTRL_LANES = 15

STAT_NAMES = (
    "packets",
    "data_packets",
    "ctrl_packets",
    "join_packets",
    "results_sent",
    "retransmissions",
    "duplicates_ignored",
    "results_resent",
    "shadow_resends",
    "malformed_dropped",
    "stale_dropped",
    "foreign_dropped",
    "mismatch_dropped",
    "saturated_slots",
    "abandoned_slots",
    "epochs",
    "jobs_active",
    "jobs_refused",
    "jobs_released",
    "stats_requests",
    # job isolation (docs/faults.md rows 25, 28): packets of a job id in use whose identity (nonce) matches no job;
    # JOINs refused (a running job's worker already joined, other parameters, the per-source limit
    # of incomplete jobs); LEAVEs matching no session; incomplete JOINs released by the join timeout
    "identity_refused",
    "joins_refused",
    "leaves_refused",
    "pending_released",
    # malformed_dropped by reason
    "bad_length",
    "bad_magic",
    "bad_version",
    "bad_type",
    "bad_count",
    "bad_worker",
    "bad_slot",
    "bad_dtype",
    "bad_flags",
)


class ProtocolError(ValueError):
    """A datagram failed validation; ``reason`` is one of the ``bad_*`` counter names."""

    def __init__(self, reason: str, detail: str):
        self.reason = reason
        super().__init__(f"{reason}: {detail}")


class Header(NamedTuple):
    """A parsed, validated header (see the module docstring for each field).

    A NamedTuple rather than a dataclass: the switch builds one per datagram, and tuple
    construction is several times cheaper than a frozen dataclass's.
    """

    ptype: int
    flags: int
    dtype: int
    job_id: int
    worker_id: int
    num_workers: int
    slot: int
    nonce: int
    epoch: int
    round: int
    seq: int
    count: int
    exponent: int
    tag: int


def pack_header(ptype: int, *, flags: int = 0, dtype: int = 0, job_id: int = 0, worker_id: int = 0,
                num_workers: int = 1, slot: int = 0, nonce: int = 0, epoch: int = 0, round: int = 0,
                seq: int = 0, count: int = 0, exponent: int = 0, tag: int = 0) -> bytes:
    """Pack one header; ``struct`` raises if a field is out of its wire range."""
    return HEADER.pack(MAGIC, PROTOCOL_VERSION, ptype, flags, dtype, job_id, worker_id, num_workers,
                       slot, nonce, epoch & 0xFFFFFFFF, round & 0xFFFFFFFF, seq, count, exponent, tag)


def pack_header_into(buf: bytearray | memoryview, ptype: int, **fields: int) -> None:
    """Pack a header (the fields of :func:`pack_header`) into the first HEADER_SIZE bytes of ``buf``."""
    buf[:HEADER_SIZE] = pack_header(ptype, **fields)


def pack_header_of(h: Header) -> bytes:
    """Pack a :class:`Header` (one this process parsed or built, with some fields replaced)."""
    return pack_header(**h._asdict())


def unpack_header(buf: bytes | bytearray | memoryview, pos: int = 0) -> Header:
    """The header at ``pos`` *without* validation: only for packets this process built itself."""
    return Header(*HEADER.unpack_from(buf, pos)[2:])  # after magic and version: Header's order


# Single fields read or written in place, where a whole parse would cost more than the packet's
# work (a datagram's fast path, a retransmission's flag); every offset comes from _LAYOUT.

def peek_flags(buf: bytes | bytearray | memoryview, pos: int = 0) -> int:
    """The ``flags`` byte of the (unvalidated) header at ``pos``."""
    return buf[pos + FLAGS_OFFSET]


def peek_count(buf: bytes | bytearray | memoryview, pos: int = 0) -> int:
    """The ``count`` field of the (unvalidated) header at ``pos``: the datagram's payload lanes."""
    return int.from_bytes(buf[pos + COUNT_OFFSET:pos + COUNT_OFFSET + 4], "big")


def poke_flags(buf: bytearray | memoryview, flags: int, pos: int = 0) -> None:
    """Overwrite the ``flags`` byte of the header at ``pos`` (a kept packet resent with FLAG_RETX)."""
    buf[pos + FLAGS_OFFSET] = flags


# Segmented results as rows of a uint8 numpy array, one SEGMENT_BYTES datagram per row: the
# headers of one result's segments differ only in ``tag`` (and the last one's ``count``).

def segment_tags(rows: Any) -> Any:
    """The ``tag`` of every row's header, as a flat uint32 array."""
    return rows[:, TAG_BYTES].copy().view(">u4").ravel()


def set_segment_tags(rows: Any, tags: Any) -> None:
    """Write ``tags`` (one integer per row) into every row's header."""
    rows[:, TAG_BYTES] = tags.astype(">u4").view("u1").reshape(-1, 4)


def same_but_tag(rows: Any) -> bool:
    """Whether every row's header equals the first row's in every byte outside ``tag``."""
    same = rows[:, :HEADER_SIZE] == rows[0, :HEADER_SIZE]
    same[:, TAG_BYTES] = True
    return bool(same.all())


def parse_header(buf: bytes | bytearray | memoryview, nbytes: int, *, allowed: frozenset[int],
                 max_slot: int | None = None, payload_width: int = 4) -> Header:
    """Validate a datagram field by field and return its header.

    Why every check: the switch is a long-lived shared process reachable by anything that can send it
    a datagram; one unchecked index would corrupt another job's slots or crash the switch. The order
    is cheapest first, and the first failure names the counter that is incremented.

    Args:
        buf: the receive buffer.
        nbytes: bytes actually received into ``buf``.
        allowed: packet types this receiver accepts (``PacketType.TO_SWITCH`` or ``TO_WORKER``).
        max_slot: slots must be ``< max_slot`` (the switch's partition size); None skips the check.
        payload_width: bytes per payload lane (4 for int32, 8 for a stats reply).

    Raises:
        ProtocolError: the reason is a ``bad_*`` counter name.
    """
    if nbytes < HEADER_SIZE:
        raise ProtocolError("bad_length", f"{nbytes} bytes is shorter than the {HEADER_SIZE}-byte header")
    (magic, version, ptype, flags, dtype, job_id, worker_id, num_workers, slot, nonce, epoch, rnd, seq,
     count, exponent, tag) = HEADER.unpack_from(buf, 0)
    if magic != MAGIC:
        raise ProtocolError("bad_magic", f"magic {magic!r} != {MAGIC!r}")
    if version != PROTOCOL_VERSION:
        raise ProtocolError("bad_version", f"version {version} != {PROTOCOL_VERSION}")
    if ptype not in allowed:
        raise ProtocolError("bad_type", f"packet type {ptype} not accepted here")
    if flags & ~_KNOWN_FLAGS:
        raise ProtocolError("bad_flags", f"unknown flag bits {flags:#x}")
    width = 8 if ptype == PacketType.STATS_REPLY else payload_width
    if count > MAX_PAYLOAD_ELEMS:
        raise ProtocolError("bad_count", f"count {count} > {MAX_PAYLOAD_ELEMS}")
    if nbytes != HEADER_SIZE + width * count:
        raise ProtocolError("bad_length", f"{nbytes} bytes != header + {count} lanes of {width} bytes")
    if not 1 <= num_workers <= MAX_WORKERS or worker_id >= num_workers:
        raise ProtocolError("bad_worker", f"worker {worker_id} of {num_workers} (max {MAX_WORKERS})")
    if max_slot is not None and slot >= max_slot:
        raise ProtocolError("bad_slot", f"slot {slot} >= partition size {max_slot}")
    if ptype in (PacketType.DATA, PacketType.CTRL, PacketType.RESULT, PacketType.CTRL_RESULT) and (
            dtype not in DTYPE_NAMES):
        raise ProtocolError("bad_dtype", f"dtype code {dtype} unknown")
    return Header(ptype, flags, dtype, job_id, worker_id, num_workers, slot, nonce, epoch, rnd, seq, count,
                  exponent, tag)


def encode_stats(values: dict[str, int]) -> bytes:
    """Encode counters as little-endian uint64 lanes in ``STAT_NAMES`` order (never pickle)."""
    return struct.pack(f"<{len(STAT_NAMES)}Q", *(max(0, int(values.get(k, 0))) for k in STAT_NAMES))


def decode_stats(payload: bytes | memoryview, count: int) -> dict[str, int]:
    """Decode a stats reply; names beyond what this version knows are ignored."""
    vals = struct.unpack_from(f"<{count}Q", payload, 0)
    return {name: int(v) for name, v in zip(STAT_NAMES, vals)}
