"""The membership coordinator: heartbeats, a generation counter and the member list, over UDP.

It runs outside every rank (``commopt-bench coordinator``, or a thread of a test or launcher process),
so no rank's death takes it down (docs/faults.md row 44). Replicas (:class:`~.client.Membership`)
JOIN, send a HEARTBEAT every interval, and LEAVE; each message is answered with a STATE (the
generation, its members, and this replica's status).

Rules (the facts of torchft's Lighthouse, docs/architecture.md "elastic"; written anew here):

1. A replica is *live* while its last message is younger than ``heartbeat_timeout``; an older one is
   dropped (its id forgotten but for its last sequence number). A LEAVE drops it at once.
2. A joiner is *admissible* once it has heartbeated after its JOIN: a flood of JOINs that never
   heartbeat changes no generation; such joins are held at most ``max_pending`` at a time and expire
   like any silent replica (docs/faults.md row 45).
3. The first generation forms once ``min_replicas`` admissible replicas are live: all of them.
4. After that, when a member of the current generation is dropped or an admissible joiner waits, the
   next generation forms (generation + 1, members = every admissible live replica, joiners included)
   only if more than half of the current generation's members are live AND at least
   ``min_replicas`` replicas are live. A majority of the last generation must carry over, so two
   disjoint sets of replicas can never both form a quorum (no split brain); newcomers do not count
   towards that majority.
5. Otherwise there is no quorum: every live replica is answered NO_QUORUM with the counts (alive of
   the last generation's members, min_replicas), and its client raises. The coordinator keeps the
   last generation and forms the next only when rule 4 holds again (the lost members came back).
6. Decisions wait while any live replica is *suspect* (silent for more than ``heartbeat_timeout / 2``):
   replicas that die together (within half a timeout of each other) are judged together, so losing 2
   of 4 at once is no quorum rather than two generations of 3 and then 2. Replicas must therefore
   heartbeat well within ``heartbeat_timeout / 2``.

Malformed, oversized, foreign-job, out-of-range and replayed (a sequence number not above the last
one of that replica id) datagrams are refused without an answer and counted by reason in
:attr:`Coordinator.refused`; they change no state (docs/faults.md row 45). The socket binds to
127.0.0.1 unless told otherwise (docs/architecture.md section 9). No pickle, no torch.
"""

from __future__ import annotations

import socket
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

from .protocol import (
    MAX_MEMBERS,
    MAX_MESSAGE,
    Kind,
    ProtocolError,
    Status,
    job_id,
    pack_state,
    parse,
)

__all__ = ["Coordinator", "DEFAULT_JOB", "DEFAULT_MAX_PENDING", "quorum"]

DEFAULT_JOB = "commopt"
DEFAULT_MAX_PENDING = 1024  # joiners that have not heartbeated yet, held at once
_GRAVES = 1 << 16  # dropped replica ids whose last sequence number is remembered (replay refusal)


def quorum(last: tuple[int, ...] | frozenset[int], live: frozenset[int] | set[int], min_replicas: int
           ) -> tuple[bool, str]:
    """Rules 3-4 of the module docstring: may a generation of ``live`` follow one of ``last``?

    Args:
        last: the current generation's members (empty before the first generation).
        live: the admissible live replicas.
        min_replicas: the fewest replicas a generation may have.

    Returns:
        (ok, reason): reason says why not when ok is False ("" otherwise).
    """
    survivors = len(set(last) & set(live))
    if len(live) < min_replicas:
        return False, f"{len(live)} replicas alive, fewer than min_replicas={min_replicas}"
    if last and 2 * survivors <= len(last):
        return False, (f"{survivors} of the last generation's {len(last)} members alive, not more than half "
                       "(a partition or a majority lost: no split brain)")
    return True, ""


@dataclass
class _Replica:
    seq: int
    seen: float
    addr: Any
    admissible: bool = False


class Coordinator:
    """The membership coordinator (see the module docstring for its rules), served by one thread.

    Args:
        host: address to bind; loopback unless told otherwise.
        port: UDP port; 0 picks a free one (read :attr:`address`).
        heartbeat_timeout: seconds without a message after which a replica is dropped.
        min_replicas: the fewest replicas a generation may have.
        job: the job's name (or 64-bit id); datagrams of another job are refused (``foreign_job``).
        max_pending: joiners that have not heartbeated yet held at once; more are refused
            (``pending_limit``).

    Use as a context manager, or call :meth:`close`; the thread and the socket go with it.
    """

    def __init__(self, host: str = "127.0.0.1", port: int = 0, *, heartbeat_timeout: float = 5.0,
                 min_replicas: int = 1, job: str | int = DEFAULT_JOB, max_pending: int = DEFAULT_MAX_PENDING):
        if not heartbeat_timeout > 0:
            raise ValueError(f"heartbeat_timeout={heartbeat_timeout} must be > 0 seconds")
        if not 1 <= min_replicas <= MAX_MEMBERS:
            raise ValueError(f"min_replicas={min_replicas} must be in [1, {MAX_MEMBERS}]")
        if max_pending < 1:
            raise ValueError(f"max_pending={max_pending} must be >= 1")
        self.heartbeat_timeout = float(heartbeat_timeout)
        self.min_replicas = int(min_replicas)
        self.max_pending = int(max_pending)
        self.job = job_id(job)
        self._lock = threading.Lock()
        self._replicas: dict[int, _Replica] = {}
        self._graves: OrderedDict[int, int] = OrderedDict()  # dropped id -> its last seq
        self._generation = 0
        self._members: tuple[int, ...] = ()
        self._no_quorum: tuple[int, int, str] | None = None  # (alive of last, last, reason) while blocked
        self._refused: dict[str, int] = {}
        self._stop = threading.Event()
        self._sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        try:
            self._sock.bind((host, port))
        except OSError:
            self._sock.close()
            raise
        self._sock.settimeout(min(0.05, self.heartbeat_timeout / 10))
        bound_host, bound_port = self._sock.getsockname()[:2]
        self._address = f"{bound_host}:{bound_port}"
        self._thread = threading.Thread(target=self._serve, name="commopt-elastic-coordinator", daemon=True)
        self._thread.start()

    # -- public -------------------------------------------------------------------------------------

    @property
    def address(self) -> str:
        """``"host:port"`` of the bound socket (give it to replicas, e.g. as COMMOPT_COORDINATOR)."""
        return self._address

    @property
    def generation(self) -> int:
        """The current generation (0 before the first forms)."""
        with self._lock:
            return self._generation

    @property
    def members(self) -> tuple[int, ...]:
        """The current generation's member replica ids, sorted."""
        with self._lock:
            return self._members

    @property
    def refused(self) -> dict[str, int]:
        """Refused datagrams by reason (a copy)."""
        with self._lock:
            return dict(self._refused)

    @property
    def pending(self) -> int:
        """Live replicas not yet admissible (joined, never heartbeated)."""
        with self._lock:
            return self._pending_count()

    @property
    def live(self) -> tuple[int, ...]:
        """Every live replica id (admissible or not), sorted."""
        with self._lock:
            return tuple(sorted(self._replicas))

    def close(self) -> None:
        """Stop the serving thread and close the socket (idempotent). Replicas see it as gone."""
        self._stop.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join()
        self._sock.close()

    def __enter__(self) -> Coordinator:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- serving ------------------------------------------------------------------------------------

    def _serve(self) -> None:
        buf = bytearray(MAX_MESSAGE + 1)  # one more byte than allowed, so an oversized datagram shows
        while not self._stop.is_set():
            try:
                nbytes, addr = self._sock.recvfrom_into(buf)
            except socket.timeout:
                nbytes, addr = -1, None
            except OSError:
                if self._stop.is_set():
                    return
                continue
            with self._lock:
                now = time.monotonic()
                reply = self._handle(buf, nbytes, addr, now) if nbytes >= 0 else None
                self._update(now)
            if reply is not None:
                try:
                    self._sock.sendto(reply, addr)
                except OSError:
                    pass  # the replica's socket is gone; it will be dropped for silence

    def _refuse(self, reason: str) -> None:
        self._refused[reason] = self._refused.get(reason, 0) + 1

    def _handle(self, buf: bytearray, nbytes: int, addr: Any, now: float) -> bytes | None:
        try:
            msg = parse(buf, nbytes, allowed=Kind.TO_COORDINATOR, job=self.job)
        except ProtocolError as e:
            self._refuse(e.reason)
            return None
        if msg.generation > self._generation:
            self._refuse("out_of_range")  # claims a generation that never formed
            return None
        rep = self._replicas.get(msg.replica)
        last_seq = rep.seq if rep is not None else self._graves.get(msg.replica, 0)
        if msg.seq <= last_seq:
            self._refuse("replayed")
            return None
        if msg.kind == Kind.JOIN:
            if rep is None and self._pending_count() >= self.max_pending:
                self._refuse("pending_limit")
                return None
            # A JOIN of a live id is a restarted process of that replica: its old incarnation is gone.
            self._replicas[msg.replica] = _Replica(msg.seq, now, addr)
            self._graves.pop(msg.replica, None)
        elif rep is None:
            if msg.kind == Kind.LEAVE:
                return None
            return self._state(msg, Status.UNKNOWN)  # dropped for silence: it must not carry on
        elif msg.kind == Kind.LEAVE:
            self._drop(msg.replica, msg.seq)
            return None
        else:
            rep.seq, rep.seen, rep.addr, rep.admissible = msg.seq, now, addr, True
        return self._reply(msg)

    def _pending_count(self) -> int:
        return sum(not r.admissible for r in self._replicas.values())

    def _reply(self, msg: Any) -> bytes:
        if self._no_quorum is not None:
            return self._state(msg, Status.NO_QUORUM)
        return self._state(msg, Status.MEMBER if msg.replica in self._members else Status.WAITING)

    def _state(self, msg: Any, status: int) -> bytes:
        alive, last = (self._no_quorum[0], self._no_quorum[1]) if self._no_quorum else (
            len(set(self._members) & set(self._replicas)), len(self._members))
        return pack_state(job=self.job, replica=msg.replica, generation=self._generation, seq=msg.seq,
                          status=status, alive=alive, last=last, min_replicas=self.min_replicas,
                          members=self._members)

    def _drop(self, replica: int, seq: int) -> None:
        del self._replicas[replica]
        self._graves[replica] = seq
        if len(self._graves) > _GRAVES:
            self._graves.popitem(last=False)

    def _update(self, now: float) -> None:
        """Rules 1, 3, 4 and 5: drop the silent, then form the next generation or record no quorum."""
        for rid in [rid for rid, r in self._replicas.items() if now - r.seen > self.heartbeat_timeout]:
            self._drop(rid, self._replicas[rid].seq)
        live = frozenset(rid for rid, r in self._replicas.items() if r.admissible)
        if self._no_quorum is None and live == frozenset(self._members):
            return
        if self._generation == 0 and len(live) < self.min_replicas:
            return  # rule 3: still gathering the first generation
        if any(now - self._replicas[rid].seen > self.heartbeat_timeout / 2 for rid in live):
            return  # rule 6: a suspect replica is either about to be dropped or to heartbeat: wait for it
        ok, reason = quorum(self._members, live, self.min_replicas)
        if ok:
            self._generation += 1
            self._members = tuple(sorted(live))[:MAX_MEMBERS]
            self._no_quorum = None
        elif self._no_quorum is None or self._no_quorum[2] != reason:
            self._no_quorum = (len(set(self._members) & live), len(self._members), reason)
