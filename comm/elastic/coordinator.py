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

7. A replica's process death is seen at once where the kernel closes its sockets (SIGKILL, a crash):
   each replica holds one TCP connection to the coordinator's port (a LIVENESS header, then nothing),
   and its end drops that replica (its incarnation: a restarted process's JOIN replaces the old one,
   which counts as lost). A stopped process or a downed link is seen at ``heartbeat_timeout``. After
   such a drop, decisions wait ``min(0.25 s, heartbeat_timeout / 2)`` more, so that the processes of
   replicas that die together (a switch, a rack) are still judged together (rule 6).
8. The first generation waits for ``initial_replicas`` (default ``min_replicas``): a job that starts
   N workers can start with all N instead of the first ``min_replicas`` to heartbeat.
9. Commits: a member that finished a round of generation g reports it (COMMIT); the verdict on (g,
   round) is COMMIT once every member of g has reported it, ABORT if a member of g is lost first, and
   never changes. Every member that asks gets the same verdict, so no survivor applies a reduction
   that another redoes; a generation that only adds joiners does not abort g's rounds.

The coordinator also hosts a ``torch.distributed.TCPStore`` on its own host (``store=True``): the
rendezvous of each generation's process groups (under a fresh prefix per generation), announced in
every STATE. It outlives every rank, as the coordinator does.

Malformed, oversized, foreign-job, out-of-range and replayed (a sequence number not above the last
one of that replica id) datagrams are refused without an answer and counted by reason in
:attr:`Coordinator.refused`; they change no state (docs/faults.md row 45). The socket binds to
127.0.0.1 unless told otherwise (docs/architecture.md section 9). No pickle; torch only for the store.
"""

from __future__ import annotations

import selectors
import socket
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

from .protocol import (
    HEADER_SIZE,
    MAX_MEMBERS,
    MAX_MESSAGE,
    Kind,
    ProtocolError,
    Status,
    Verdict,
    job_id,
    pack_decision,
    pack_state,
    parse,
    parse_commit,
)

__all__ = ["Coordinator", "DEFAULT_JOB", "DEFAULT_MAX_PENDING", "quorum"]

DEFAULT_JOB = "commopt"
DEFAULT_MAX_PENDING = 1024  # joiners that have not heartbeated yet, held at once
_GRAVES = 1 << 16  # dropped replica ids whose last sequence number is remembered (replay refusal)
_ROUNDS = 4096  # (generation, round) verdicts remembered: far more than are ever asked about twice
_HISTORY = 64  # past generations whose members are remembered (commits of a generation just replaced)


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
    incarnation: int  # its JOIN's sequence number: a restarted process has another
    admissible: bool = False


class Coordinator:
    """The membership coordinator (see the module docstring for its rules), served by one thread.

    Args:
        host: address to bind; loopback unless told otherwise.
        port: the UDP port, and the TCP port of the replicas' liveness connections; 0 picks one free
            for both (read :attr:`address`).
        heartbeat_timeout: seconds without a message after which a replica is dropped.
        min_replicas: the fewest replicas a generation may have.
        job: the job's name (or 64-bit id); datagrams of another job are refused (``foreign_job``).
        max_pending: joiners that have not heartbeated yet held at once; more are refused
            (``pending_limit``).
        initial_replicas: the replicas the first generation waits for (None: ``min_replicas``).
        store: host a ``torch.distributed.TCPStore`` on ``host`` (a free port, announced in every
            STATE) for the generations' process groups; False: none (membership only).

    Use as a context manager, or call :meth:`close`; the thread, the sockets and the store go with it.
    """

    def __init__(self, host: str = "127.0.0.1", port: int = 0, *, heartbeat_timeout: float = 5.0,
                 min_replicas: int = 1, job: str | int = DEFAULT_JOB, max_pending: int = DEFAULT_MAX_PENDING,
                 initial_replicas: int | None = None, store: bool = True):
        if not heartbeat_timeout > 0:
            raise ValueError(f"heartbeat_timeout={heartbeat_timeout} must be > 0 seconds")
        if not 1 <= min_replicas <= MAX_MEMBERS:
            raise ValueError(f"min_replicas={min_replicas} must be in [1, {MAX_MEMBERS}]")
        if max_pending < 1:
            raise ValueError(f"max_pending={max_pending} must be >= 1")
        initial = min_replicas if initial_replicas is None else initial_replicas
        if not min_replicas <= initial <= MAX_MEMBERS:
            raise ValueError(f"initial_replicas={initial_replicas} must be in [min_replicas={min_replicas}, "
                             f"{MAX_MEMBERS}]")
        self.heartbeat_timeout = float(heartbeat_timeout)
        self.min_replicas = int(min_replicas)
        self.initial_replicas = int(initial)
        self.max_pending = int(max_pending)
        self.job = job_id(job)
        self._lock = threading.Lock()
        self._replicas: dict[int, _Replica] = {}
        self._graves: OrderedDict[int, int] = OrderedDict()  # dropped id -> its last seq
        self._generation = 0
        self._members: tuple[int, ...] = ()
        self._incarnations: dict[int, int] = {}  # the current generation's members' incarnations
        self._history: OrderedDict[int, dict[int, int]] = OrderedDict()  # generation -> {member: incarnation}
        self._votes: OrderedDict[tuple[int, int], set[int]] = OrderedDict()  # (generation, round) -> reporters
        self._verdicts: OrderedDict[tuple[int, int], int] = OrderedDict()
        self._no_quorum: tuple[int, int, str] | None = None  # (alive of last, last, reason) while blocked
        self._refused: dict[str, int] = {}
        self._settle_until = 0.0  # rule 7: decisions wait until then after a liveness drop
        self._stop = threading.Event()
        self._sock, self._listener = self._bind(host, port)
        bound_host, bound_port = self._sock.getsockname()[:2]
        self._address = f"{bound_host}:{bound_port}"
        self._store = None
        self.store_port = 0
        if store:
            from torch.distributed import TCPStore  # the one torch dependency: the groups' rendezvous
            try:
                self._store = TCPStore(bound_host, 0, is_master=True, wait_for_workers=False,
                                       timeout=__import__("datetime").timedelta(seconds=60))
            except Exception:
                self._sock.close()
                self._listener.close()
                raise
            self.store_port = int(self._store.port)
        self._conns: dict[socket.socket, tuple[int, int] | None] = {}  # liveness connection -> (id, incarnation)
        self._selector = selectors.DefaultSelector()
        self._selector.register(self._sock, selectors.EVENT_READ)
        self._selector.register(self._listener, selectors.EVENT_READ)
        self._thread = threading.Thread(target=self._serve, name="commopt-elastic-coordinator", daemon=True)
        self._thread.start()

    @staticmethod
    def _bind(host: str, port: int) -> tuple[socket.socket, socket.socket]:
        """The UDP socket and a TCP listener on the same port (a free pair when ``port`` is 0)."""
        for _ in range(32 if port == 0 else 1):
            udp = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
            tcp = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            tcp.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                udp.bind((host, port))
                tcp.bind((host, udp.getsockname()[1]))
                tcp.listen(128)
                tcp.setblocking(False)
                return udp, tcp
            except OSError:
                udp.close()
                tcp.close()
                if port:
                    raise
        raise OSError(f"no free port on {host} for both UDP and TCP after 32 tries")

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

    def verdict(self, generation: int, round: int) -> int:
        """The :class:`~.protocol.Verdict` on (``generation``, ``round``) so far."""
        with self._lock:
            return self._verdicts.get((generation, round), Verdict.PENDING)

    def close(self) -> None:
        """Stop the serving thread, close the sockets and the store (idempotent). Replicas see it as gone."""
        self._stop.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join()
        for conn in list(self._conns):
            conn.close()
        self._conns.clear()
        self._selector.close()
        self._sock.close()
        self._listener.close()
        self._store = None  # torch's TCPStore server stops with its last reference

    def __enter__(self) -> Coordinator:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- serving ------------------------------------------------------------------------------------

    def _serve(self) -> None:
        buf = bytearray(MAX_MESSAGE + 1)  # one more byte than allowed, so an oversized datagram shows
        tick = min(0.05, self.heartbeat_timeout / 10)
        while not self._stop.is_set():
            try:
                events = self._selector.select(tick)
            except (OSError, ValueError):
                if self._stop.is_set():
                    return
                continue
            for key, _ in events:
                sock = key.fileobj
                if sock is self._sock:
                    self._datagram(buf)
                elif sock is self._listener:
                    self._accept()
                else:
                    self._liveness(sock)  # type: ignore[arg-type]
            with self._lock:
                self._update(time.monotonic())

    def _datagram(self, buf: bytearray) -> None:
        try:
            nbytes, addr = self._sock.recvfrom_into(buf)
        except OSError:
            return
        with self._lock:
            reply = self._handle(buf, nbytes, addr, time.monotonic())
        if reply is not None:
            try:
                self._sock.sendto(reply, addr)
            except OSError:
                pass  # the replica's socket is gone; it will be dropped for silence

    def _accept(self) -> None:
        try:
            conn, _ = self._listener.accept()
        except OSError:
            return
        if len(self._conns) >= self.max_pending + MAX_MEMBERS:
            conn.close()
            self._refuse("pending_limit")
            return
        conn.setblocking(False)
        self._conns[conn] = None
        self._selector.register(conn, selectors.EVENT_READ)

    def _liveness(self, conn: socket.socket) -> None:
        """A liveness connection is readable: its LIVENESS header, or its end (rule 7)."""
        who = self._conns.get(conn)
        try:
            data = conn.recv(HEADER_SIZE if who is None else 1, socket.MSG_PEEK if who is None else 0)
        except BlockingIOError:
            return
        except OSError:
            data = b""
        if who is None and len(data) == HEADER_SIZE:
            conn.recv(HEADER_SIZE)
            try:
                msg = parse(data, len(data), allowed=Kind.OVER_TCP, job=self.job)
            except ProtocolError as e:
                with self._lock:
                    self._refuse(e.reason)
                data = b""
            else:
                self._conns[conn] = (msg.replica, msg.seq)
                return
        if data and who is None:
            return  # part of the header: wait for the rest
        if data:
            with self._lock:
                self._refuse("bad_length")  # nothing may follow the header
        self._selector.unregister(conn)
        del self._conns[conn]
        conn.close()
        if who is not None:
            with self._lock:
                rep = self._replicas.get(who[0])
                if rep is not None and rep.incarnation == who[1]:
                    self._drop(who[0], rep.seq)
                    self._settle_until = time.monotonic() + min(0.25, self.heartbeat_timeout / 2)

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
            if rep is not None and rep.addr == addr:  # the same process again (its answer was lost)
                rep.seq, rep.seen = msg.seq, now
                return self._reply(msg)
            # A JOIN of a live id from another socket is a restarted process of that replica: its old
            # incarnation is gone (rule 7). The JOIN that creates the record names the incarnation.
            self._replicas[msg.replica] = _Replica(msg.seq, now, addr, msg.seq)
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
        if msg.kind == Kind.COMMIT:
            return self._commit(msg, parse_commit(buf))
        return self._reply(msg)

    def _commit(self, msg: Any, round_: int) -> bytes | None:
        """Rule 9: record ``msg.replica``'s report of (generation, round) and answer the verdict."""
        key = (msg.generation, round_)
        members = self._history.get(msg.generation)
        rep = self._replicas[msg.replica]
        if members is None or members.get(msg.replica) != rep.incarnation:
            self._refuse("out_of_range")  # not a member of that generation (or one long forgotten)
            return None
        verdict = self._verdicts.get(key)
        if verdict is None:
            votes = self._votes.setdefault(key, set())
            votes.add(msg.replica)
            if len(self._votes) > _ROUNDS:
                self._votes.popitem(last=False)
            verdict = self._judge(key, members)
        return pack_decision(job=self.job, replica=msg.replica, generation=msg.generation, seq=msg.seq,
                             round=round_, verdict=verdict)

    def _judge(self, key: tuple[int, int], members: dict[int, int]) -> int:
        """The verdict on ``key`` now: ABORT if a member's incarnation is gone, COMMIT if all reported."""
        lost = any(self._replicas.get(m) is None or self._replicas[m].incarnation != inc for m, inc in members.items())
        if lost:
            verdict = Verdict.ABORT
        elif self._votes.get(key, set()) >= set(members):
            verdict = Verdict.COMMIT
        else:
            return Verdict.PENDING
        self._votes.pop(key, None)
        self._verdicts[key] = verdict
        if len(self._verdicts) > _ROUNDS:
            self._verdicts.popitem(last=False)
        return verdict

    def _pending_count(self) -> int:
        return sum(not r.admissible for r in self._replicas.values())

    def _reply(self, msg: Any) -> bytes:
        if self._no_quorum is not None:
            return self._state(msg, Status.NO_QUORUM)
        return self._state(msg, Status.MEMBER if msg.replica in self._members else Status.WAITING)

    def _state(self, msg: Any, status: int) -> bytes:
        alive, last = (self._no_quorum[0], self._no_quorum[1]) if self._no_quorum else (
            len(set(self._members) & set(self._alive_members())), len(self._members))
        return pack_state(job=self.job, replica=msg.replica, generation=self._generation, seq=msg.seq,
                          status=status, alive=alive, last=last, min_replicas=self.min_replicas,
                          members=self._members, store_port=self.store_port)

    def _alive_members(self) -> set[int]:
        """The current generation's members whose incarnation is still live."""
        return {m for m, inc in self._incarnations.items()
                if m in self._replicas and self._replicas[m].incarnation == inc}

    def _drop(self, replica: int, seq: int) -> None:
        del self._replicas[replica]
        self._graves[replica] = seq
        if len(self._graves) > _GRAVES:
            self._graves.popitem(last=False)
        for key in list(self._votes):  # rule 9: a round this replica's generation had not finished
            members = self._history.get(key[0])
            if members:
                self._judge(key, members)

    def _update(self, now: float) -> None:
        """Rules 1, 3, 4 and 5: drop the silent, then form the next generation or record no quorum."""
        for rid in [rid for rid, r in self._replicas.items() if now - r.seen > self.heartbeat_timeout]:
            self._drop(rid, self._replicas[rid].seq)
        live = frozenset(rid for rid, r in self._replicas.items() if r.admissible)
        survivors = self._alive_members()
        if self._no_quorum is None and live == frozenset(self._members) and survivors == set(self._members):
            return
        if self._generation == 0 and len(live) < self.initial_replicas:
            return  # rules 3 and 8: still gathering the first generation
        if now < self._settle_until or any(now - self._replicas[rid].seen > self.heartbeat_timeout / 2 for rid in live):
            return  # rule 6: a suspect replica is either about to be dropped or to heartbeat: wait for it
        # A member whose process restarted is a newcomer, not a survivor: it stands in `last` under an id
        # that no live replica has, so it counts towards the last generation's size but not its majority.
        last = tuple(m if m in survivors else -1 - m for m in self._members)
        ok, reason = quorum(last, live, self.min_replicas)
        if ok:
            self._generation += 1
            self._members = tuple(sorted(live))[:MAX_MEMBERS]
            self._incarnations = {m: self._replicas[m].incarnation for m in self._members}
            self._history[self._generation] = dict(self._incarnations)
            if len(self._history) > _HISTORY:
                self._history.popitem(last=False)
            self._no_quorum = None
        elif self._no_quorum is None or self._no_quorum[2] != reason:
            self._no_quorum = (len(set(self._members) & survivors), len(self._members), reason)
