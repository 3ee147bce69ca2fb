"""The coordinator's wire protocol: one UDP datagram, one fixed header, validated field by field.

Like the in-network switch's (:mod:`commopt.comm.ina.protocol`), nothing else crosses the socket: no
pickle, no JSON, no variable-length fields beyond a bounded array of uint32, so the coordinator checks
every field against fixed bounds before it touches any state (docs/faults.md row 45).

Header layout (``!4sBBHQIIQI``, 36 bytes, network byte order)::

    magic       4s  b"CELC"
    version     B   PROTOCOL_VERSION
    kind        B   JOIN, HEARTBEAT, LEAVE, COMMIT, LIVENESS (replica -> coordinator); STATE, DECISION
                    (coordinator -> replica)
    flags       H   none defined: must be 0
    job         Q   the job's id: 64 bits of blake2b of its name (:func:`job_id`)
    replica     I   the replica id, 0 <= replica < MAX_REPLICAS
    generation  I   replica -> coordinator: the last generation it saw; STATE: the current one
    seq         Q   the sender's sequence number: strictly increasing per replica process (it starts
                    at the wall clock in ns, so a restarted process outnumbers its predecessor); a
                    STATE echoes the seq of the message it answers
    length      I   payload bytes that follow (0 from a replica)

A STATE payload is ``!IIIII`` (status, alive, last, min_replicas, store_port) followed by the
generation's member ids as uint32 (``alive`` of the generation's ``last`` members are live; see
:class:`Status`; ``store_port``: the TCP port of the rendezvous store the coordinator hosts on its own
address, 0 for none). A COMMIT payload is ``!Q`` (the round a member of ``generation`` finished); a
DECISION payload is ``!QI`` (that round, its :class:`Verdict`). A LIVENESS header (no payload) is the
first and only thing a replica sends on its TCP connection to the coordinator's port: the connection's
end (a process killed, even by SIGKILL, has its sockets closed by the kernel) drops that replica at
once, without waiting for ``heartbeat_timeout``; its ``seq`` is the replica process's JOIN's, so a
restarted process's old connection never drops the new one. A datagram is at most ``MAX_MESSAGE``
bytes (a generation holds at most ``MAX_MEMBERS`` replicas).
"""

from __future__ import annotations

import hashlib
import struct
from typing import NamedTuple

from ..ina.protocol import ProtocolError

__all__ = [
    "MAGIC",
    "PROTOCOL_VERSION",
    "HEADER",
    "HEADER_SIZE",
    "MAX_REPLICAS",
    "MAX_MEMBERS",
    "MAX_PAYLOAD",
    "MAX_MESSAGE",
    "Kind",
    "Status",
    "Verdict",
    "Message",
    "ProtocolError",
    "job_id",
    "pack",
    "pack_commit",
    "pack_decision",
    "pack_state",
    "parse",
    "parse_commit",
    "parse_decision",
    "parse_state",
]

MAGIC = b"CELC"
PROTOCOL_VERSION = 2
HEADER = struct.Struct("!4sBBHQIIQI")
HEADER_SIZE = HEADER.size  # 36
MAX_REPLICAS = 1 << 16  # replica ids are 0..65535: bounds the coordinator's per-id replay memory
MAX_MEMBERS = 4096  # replicas in one generation
_STATE = struct.Struct("!IIIII")
_COMMIT = struct.Struct("!Q")
_DECISION = struct.Struct("!QI")
MAX_PAYLOAD = _STATE.size + 4 * MAX_MEMBERS
MAX_MESSAGE = HEADER_SIZE + MAX_PAYLOAD  # 16,440 B, well inside one UDP datagram
_MAX_GENERATION = 2**32 - 1


class Kind:
    """Message kinds; the two sets say which side may send which."""

    JOIN = 1
    HEARTBEAT = 2
    LEAVE = 3
    STATE = 4
    COMMIT = 5
    DECISION = 6
    LIVENESS = 7

    TO_COORDINATOR = frozenset({JOIN, HEARTBEAT, LEAVE, COMMIT})  # datagrams
    TO_REPLICA = frozenset({STATE, DECISION})
    OVER_TCP = frozenset({LIVENESS})


class Status:
    """A STATE's ``status``: what the coordinator says to the replica it answers.

    MEMBER: the replica is a member of ``generation``. WAITING: joined, admitted at the next
    generation. NO_QUORUM: the generation after ``generation`` cannot form: ``alive`` of the last
    generation's ``last`` members are alive (a new one needs more than half) or fewer than
    ``min_replicas`` replicas are alive; the job must stop. UNKNOWN: the coordinator holds no live
    replica of this id (it was dropped after missing heartbeats, or never joined).
    """

    MEMBER = 0
    WAITING = 1
    NO_QUORUM = 2
    UNKNOWN = 3
    NAMES = {MEMBER: "member", WAITING: "waiting", NO_QUORUM: "no_quorum", UNKNOWN: "unknown"}


_FIXED = {Kind.COMMIT: _COMMIT, Kind.DECISION: _DECISION}


class Verdict:
    """A DECISION's verdict on (generation, round): PENDING (not every member of the generation has
    reported it yet), COMMIT (every member has: apply it), ABORT (a member of the generation was lost
    before every member reported: redo the round in the next generation, with its state rolled back).
    A verdict once COMMIT or ABORT never changes."""

    PENDING = 0
    COMMIT = 1
    ABORT = 2
    NAMES = {PENDING: "pending", COMMIT: "commit", ABORT: "abort"}


class Message(NamedTuple):
    """A parsed, validated header."""

    kind: int
    job: int
    replica: int
    generation: int
    seq: int
    length: int


def job_id(job: str | int) -> int:
    """The 64-bit wire id of a job: an int in [0, 2**64) as is, a name hashed (blake2b, 8 bytes)."""
    if isinstance(job, int):
        if not 0 <= job < 2**64:
            raise ValueError(f"job id {job} is outside [0, 2**64); pass a name or a 64-bit id")
        return job
    return int.from_bytes(hashlib.blake2b(str(job).encode(), digest_size=8).digest(), "big")


def pack(kind: int, *, job: int, replica: int, generation: int, seq: int, payload: bytes = b"") -> bytes:
    """One datagram; ``struct`` raises if a field is out of its wire range."""
    return HEADER.pack(MAGIC, PROTOCOL_VERSION, kind, 0, job, replica, generation, seq, len(payload)) + payload


def pack_state(*, job: int, replica: int, generation: int, seq: int, status: int, alive: int, last: int,
               min_replicas: int, members: tuple[int, ...], store_port: int = 0) -> bytes:
    """A STATE datagram (see the module docstring)."""
    members = members[:MAX_MEMBERS]
    payload = (_STATE.pack(status, alive, last, min_replicas, store_port)
               + struct.pack(f"!{len(members)}I", *members))
    return pack(Kind.STATE, job=job, replica=replica, generation=generation, seq=seq, payload=payload)


def parse(buf: bytes | bytearray | memoryview, nbytes: int, *, allowed: frozenset[int], job: int) -> Message:
    """Validate a datagram field by field, cheapest first, and return its header.

    Why every check: the coordinator is a long-lived process reachable by anything that can send it a
    datagram; the first failing check names the reason it counts.

    Args:
        buf: the receive buffer (at least ``MAX_MESSAGE + 1`` bytes, so an oversized datagram shows).
        nbytes: bytes received.
        allowed: kinds this receiver accepts (``Kind.TO_COORDINATOR`` or ``Kind.TO_REPLICA``).
        job: this receiver's job id; another one is ``foreign_job``.

    Raises:
        ProtocolError: ``reason`` is one of oversized, bad_length, bad_magic, bad_version, bad_kind,
            bad_flags, foreign_job, out_of_range.
    """
    if nbytes > MAX_MESSAGE:
        raise ProtocolError("oversized", f"{nbytes} bytes > the {MAX_MESSAGE}-byte bound")
    if nbytes < HEADER_SIZE:
        raise ProtocolError("bad_length", f"{nbytes} bytes is shorter than the {HEADER_SIZE}-byte header")
    magic, version, kind, flags, job_, replica, generation, seq, length = HEADER.unpack_from(buf, 0)
    if magic != MAGIC:
        raise ProtocolError("bad_magic", f"magic {magic!r} != {MAGIC!r}")
    if version != PROTOCOL_VERSION:
        raise ProtocolError("bad_version", f"version {version} != {PROTOCOL_VERSION}")
    if kind not in allowed:
        raise ProtocolError("bad_kind", f"kind {kind} not accepted here")
    if flags:
        raise ProtocolError("bad_flags", f"unknown flag bits {flags:#x}")
    if length > MAX_PAYLOAD:
        raise ProtocolError("oversized", f"payload length {length} > {MAX_PAYLOAD}")
    if nbytes != HEADER_SIZE + length:
        raise ProtocolError("bad_length", f"{nbytes} bytes != header + {length} payload bytes")
    if kind == Kind.STATE:
        if length < _STATE.size or (length - _STATE.size) % 4:
            raise ProtocolError("bad_length", f"STATE payload of {length} bytes")
    elif kind in _FIXED:
        if length != _FIXED[kind].size:
            raise ProtocolError("bad_length", f"kind {kind} carries {_FIXED[kind].size} payload bytes, got {length}")
    elif length:
        raise ProtocolError("bad_length", f"kind {kind} carries no payload, got {length} bytes")
    if job_ != job:
        raise ProtocolError("foreign_job", f"job {job_:#x} is not this coordinator's {job:#x}")
    if replica >= MAX_REPLICAS or seq == 0:
        raise ProtocolError("out_of_range", f"replica {replica} (max {MAX_REPLICAS - 1}) or seq {seq} (must be > 0)")
    return Message(kind, job_, replica, generation, seq, length)


def parse_state(buf: bytes | bytearray | memoryview, msg: Message
                ) -> tuple[int, int, int, int, int, tuple[int, ...]]:
    """A validated STATE's payload: (status, alive, last, min_replicas, store_port, members)."""
    status, alive, last, min_replicas, store_port = _STATE.unpack_from(buf, HEADER_SIZE)
    if status not in Status.NAMES or store_port >= 65536:
        raise ProtocolError("out_of_range", f"status {status} unknown or store port {store_port} out of range")
    n = (msg.length - _STATE.size) // 4
    members = struct.unpack_from(f"!{n}I", buf, HEADER_SIZE + _STATE.size)
    return status, alive, last, min_replicas, store_port, members


def pack_commit(*, job: int, replica: int, generation: int, seq: int, round: int) -> bytes:
    """A COMMIT datagram: ``replica``, a member of ``generation``, finished ``round`` in it."""
    return pack(Kind.COMMIT, job=job, replica=replica, generation=generation, seq=seq, payload=_COMMIT.pack(round))


def parse_commit(buf: bytes | bytearray | memoryview) -> int:
    """A validated COMMIT's round."""
    return _COMMIT.unpack_from(buf, HEADER_SIZE)[0]


def pack_decision(*, job: int, replica: int, generation: int, seq: int, round: int, verdict: int) -> bytes:
    """A DECISION datagram: the :class:`Verdict` on (``generation``, ``round``), echoing ``seq``."""
    return pack(Kind.DECISION, job=job, replica=replica, generation=generation, seq=seq,
                payload=_DECISION.pack(round, verdict))


def parse_decision(buf: bytes | bytearray | memoryview) -> tuple[int, int]:
    """A validated DECISION's (round, verdict)."""
    round_, verdict = _DECISION.unpack_from(buf, HEADER_SIZE)
    if verdict not in Verdict.NAMES:
        raise ProtocolError("out_of_range", f"verdict {verdict} unknown")
    return round_, verdict
