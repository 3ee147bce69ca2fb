"""A replica's side of the membership: :class:`Membership` joins, heartbeats and follows generations.

One UDP socket and one heartbeat thread per replica. Every heartbeat is answered by the coordinator
with the generation, its members and this replica's status; the client keeps the newest answer.
Failures end in an error on every survivor, never a hang (docs/faults.md row 44):

- no quorum (the coordinator's rule 4-5: a majority of the last generation lost, or fewer than
  ``min_replicas`` alive): :class:`QuorumError`, saying how many of how many are alive;
- this replica dropped by the coordinator (it missed heartbeats): :class:`QuorumError`;
- no answer from the coordinator for ``timeout`` seconds (its process died, or the link):
  :class:`CoordinatorError`.

The error is kept and raised by :meth:`Membership.check` and :meth:`Membership.wait_for_generation`.

Besides the datagrams, the client holds one TCP connection to the coordinator's port (a LIVENESS
header, then silence), so that its process's death, which closes it, is seen at once (the coordinator's
rule 7). :meth:`Membership.commit` asks the coordinator's verdict on a round (rule 9).
"""

from __future__ import annotations

import os
import socket
import threading
import time

from ..errors import CommError, CommTimeoutError
from .coordinator import DEFAULT_JOB
from .protocol import (
    MAX_MESSAGE,
    MAX_REPLICAS,
    Kind,
    ProtocolError,
    Status,
    Verdict,
    job_id,
    pack,
    pack_commit,
    parse,
    parse_decision,
    parse_state,
)

__all__ = ["Membership", "QuorumError", "CoordinatorError", "ENV_COORDINATOR", "ENV_REPLICA_ID", "parse_address"]

ENV_COORDINATOR = "COMMOPT_COORDINATOR"
ENV_REPLICA_ID = "COMMOPT_REPLICA_ID"


class QuorumError(CommError):
    """No quorum: the job cannot go on with this membership (or this replica was dropped from it)."""


class CoordinatorError(CommTimeoutError):
    """The coordinator did not answer within the timeout: its process is gone or unreachable."""


def parse_address(spec: str) -> tuple[str, int]:
    """``"host:port"`` -> (host, port), with a clear error otherwise."""
    host, sep, port = str(spec).rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"coordinator address {spec!r} is not 'host:port'; pass the address that "
                         f"`commopt-bench coordinator` printed, e.g. '127.0.0.1:5555' (or set {ENV_COORDINATOR})")
    return host.strip("[]"), int(port)


class Membership:
    """This replica's membership in the coordinator's generations.

    Joins at construction (raises :class:`CoordinatorError` if the coordinator does not answer
    within ``timeout``), then heartbeats from a thread until :meth:`leave` or :meth:`close`.

    Args:
        address: the coordinator's ``"host:port"`` (:meth:`from_env` reads it from COMMOPT_COORDINATOR).
        replica_id: this replica's id, 0 <= id < 65536; a restarted process of a replica reuses its id.
        job: the job's name or 64-bit id; it must be the coordinator's.
        heartbeat_interval: seconds between heartbeats; keep it well under the coordinator's
            ``heartbeat_timeout / 2`` (None: ``timeout / 10``).
        timeout: seconds without an answer after which the coordinator counts as gone.
    """

    def __init__(self, address: str, replica_id: int, *, job: str | int = DEFAULT_JOB,
                 heartbeat_interval: float | None = None, timeout: float = 10.0):
        if not 0 <= replica_id < MAX_REPLICAS:
            raise ValueError(f"replica_id={replica_id} must be in [0, {MAX_REPLICAS})")
        if not timeout > 0:
            raise ValueError(f"timeout={timeout} must be > 0 seconds")
        self.address = address
        self.replica_id = int(replica_id)
        self.job = job_id(job)
        self.timeout = float(timeout)
        self.heartbeat_interval = float(heartbeat_interval) if heartbeat_interval is not None else self.timeout / 10
        if not 0 < self.heartbeat_interval < self.timeout:
            raise ValueError(f"heartbeat_interval={self.heartbeat_interval} must be in (0, timeout={self.timeout})")
        self._peer = parse_address(address)
        # Wall-clock nanoseconds: a restarted process of this replica starts above its predecessor, whose
        # old datagrams the coordinator then refuses as replayed.
        self._seq = self._seq0 = time.time_ns()
        self._cond = threading.Condition()
        self._generation = 0
        self._members: tuple[int, ...] = ()
        self._status = Status.WAITING
        self._error: CommError | None = None
        self._last_answer = time.monotonic()
        self._answered = False
        self._answered_seq = 0  # the newest message of ours the coordinator answered
        self._store_port = 0
        self._decisions: dict[tuple[int, int], int] = {}
        self._liveness: socket.socket | None = None
        self._stop = threading.Event()
        self._sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self._sock.bind(("127.0.0.1" if self._peer[0] in ("127.0.0.1", "localhost") else "", 0))
        self._send_lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, name=f"commopt-elastic-heartbeat-{replica_id}",
                                        daemon=True)
        self._thread.start()
        with self._cond:
            self._cond.wait_for(lambda: self._answered or self._error is not None, timeout + 1.0)
        if self._error is not None:
            err = self._error
            self.close(leave=False)
            raise err
        if not self._answered:
            self.close(leave=False)
            raise CoordinatorError(f"replica {self.replica_id}: the coordinator at {address} did not answer the "
                                   f"JOIN within {timeout:.1f}s; is `commopt-bench coordinator` running there?",
                                   op="elastic/join")

    @classmethod
    def from_env(cls, replica_id: int | None = None, **kwargs: object) -> Membership:
        """A membership at the coordinator named by COMMOPT_COORDINATOR ("host:port"), as replica
        ``replica_id`` (None: COMMOPT_REPLICA_ID, which ``commopt-bench cluster --elastic`` sets to the
        node's index).

        The one place the elastic package reads environment variables (docs/architecture.md
        section 7.6); ``kwargs`` are the constructor's.
        """
        address = os.environ.get(ENV_COORDINATOR)
        if not address:
            raise CommError(f"{ENV_COORDINATOR} is not set: start a coordinator (`commopt-bench coordinator`) "
                            f"and set {ENV_COORDINATOR} to the address it printed, or pass it to Membership")
        if replica_id is None:
            text = os.environ.get(ENV_REPLICA_ID, "")
            if not text.isdigit():
                raise CommError(f"{ENV_REPLICA_ID}={text!r} is not a replica id: set it to this replica's index "
                                f"(e.g. the node's: one replica per node), or pass replica_id")
            replica_id = int(text)
        return cls(address, replica_id, **kwargs)  # type: ignore[arg-type]

    # -- state ---------------------------------------------------------------------------------------

    @property
    def generation(self) -> int:
        """The newest generation the coordinator reported (0 before the first forms)."""
        with self._cond:
            return self._generation

    @property
    def members(self) -> tuple[int, ...]:
        """That generation's member replica ids, sorted."""
        with self._cond:
            return self._members

    def view(self) -> tuple[int, tuple[int, ...], bool]:
        """(generation, its members, whether this replica is one of them), read at once (the heartbeat
        thread may replace the generation between separate reads of the properties)."""
        with self._cond:
            return self._generation, self._members, self._status == Status.MEMBER

    @property
    def is_member(self) -> bool:
        """Whether this replica is a member of :attr:`generation`."""
        with self._cond:
            return self._status == Status.MEMBER

    @property
    def store_address(self) -> tuple[str, int]:
        """(host, port) of the rendezvous store the coordinator hosts (port 0: it hosts none)."""
        with self._cond:
            return self._peer[0], self._store_port

    def refresh(self, timeout: float | None = None) -> int:
        """Ask the coordinator now (one round trip) and return the current generation: the view every
        member that asks after the same decision sees, instead of the last heartbeat's.

        Raises:
            QuorumError / CoordinatorError: as :meth:`check`.
        """
        wait = self.timeout if timeout is None else timeout
        deadline = time.monotonic() + wait
        with self._cond:
            while True:
                if self._error is not None:
                    raise self._error
                seq = self._send(Kind.HEARTBEAT)
                if self._cond.wait_for(lambda seq=seq: self._error is not None or self._answered_seq >= seq,
                                       min(0.1, max(0.0, deadline - time.monotonic()))):
                    if self._error is not None:
                        raise self._error
                    return self._generation
                if time.monotonic() > deadline:  # a lost datagram is sent again, until the timeout
                    raise CoordinatorError(f"replica {self.replica_id}: no answer from the coordinator at "
                                           f"{self.address} within {wait:.1f}s", op="elastic/refresh")

    def commit(self, generation: int, round: int, timeout: float | None = None) -> bool:
        """Report that this replica finished ``round`` in ``generation`` and wait for the verdict (the
        coordinator's rule 9): True when every member of that generation has reported it (apply the
        round), False when a member was lost first (roll back and redo it in the next generation).
        Every member gets the same answer.

        Raises:
            QuorumError / CoordinatorError: as :meth:`check`.
            CommTimeoutError: no verdict within ``timeout`` (None: this membership's ``timeout``).
        """
        wait = self.timeout if timeout is None else timeout
        deadline = time.monotonic() + wait
        key = (int(generation), int(round))
        with self._cond:
            self._decisions.setdefault(key, Verdict.PENDING)
            while True:
                if self._error is not None:
                    self._decisions.pop(key, None)
                    raise self._error
                if self._decisions[key] != Verdict.PENDING:
                    return self._decisions.pop(key) == Verdict.COMMIT
                if time.monotonic() > deadline:
                    self._decisions.pop(key, None)
                    raise CommTimeoutError(
                        f"replica {self.replica_id}: no verdict on round {round} of generation {generation} within "
                        f"{wait:.1f}s (a member neither reported it nor was found lost)", op="elastic/commit")
                self._send(Kind.COMMIT, key[0], key[1])
                self._cond.wait(min(0.05, max(0.001, deadline - time.monotonic())))

    def check(self) -> None:
        """Raise the membership's error (no quorum, dropped, coordinator gone), if any."""
        with self._cond:
            if self._error is not None:
                raise self._error

    def wait_for_generation(self, after: int = 0, timeout: float | None = None) -> int:
        """Wait until a generation newer than ``after`` includes this replica; return it.

        Args:
            after: a generation already seen (0: any).
            timeout: seconds to wait (None: this membership's ``timeout``).

        Raises:
            QuorumError / CoordinatorError: as :meth:`check`, as soon as it happens.
            CommTimeoutError: no such generation within ``timeout`` (e.g. fewer than min_replicas joined).
        """
        wait = self.timeout if timeout is None else timeout
        with self._cond:
            done = self._cond.wait_for(
                lambda: self._error is not None or (self._status == Status.MEMBER and self._generation > after), wait)
            if self._error is not None:
                raise self._error
            if not done:
                raise CommTimeoutError(
                    f"replica {self.replica_id}: no generation after {after} included it within {wait:.1f}s "
                    f"(now generation {self._generation}, members {list(self._members)}); are enough replicas "
                    f"(min_replicas) running and joined to {self.address}?", op="elastic/wait_for_generation")
            return self._generation

    # -- lifecycle -----------------------------------------------------------------------------------

    def leave(self) -> None:
        """Tell the coordinator this replica leaves (it is dropped at once), and stop heartbeating."""
        self.close(leave=True)

    def close(self, leave: bool = True) -> None:
        """Stop the heartbeat thread and close the socket (idempotent); no thread is left behind.

        Args:
            leave: send LEAVE first (a clean exit); False just goes silent, as a crash would.
        """
        if self._stop.is_set():
            return
        self._stop.set()
        if self._thread is not threading.current_thread():
            self._thread.join()
        if leave:
            self._send(Kind.LEAVE)
        self._sock.close()
        if self._liveness is not None:
            self._liveness.close()

    def __enter__(self) -> Membership:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- heartbeat thread ------------------------------------------------------------------------------

    def _send(self, kind: int, generation: int | None = None, round: int = 0) -> int:
        with self._send_lock:
            self._seq += 1
            seq = self._seq
            header = dict(job=self.job, replica=self.replica_id, seq=seq,
                          generation=self._generation if generation is None else generation)
            data = pack_commit(round=round, **header) if kind == Kind.COMMIT else pack(kind, **header)
            try:
                self._sock.sendto(data, self._peer)
            except OSError:
                pass  # unreachable now: the timeout decides
            return seq

    def _connect_liveness(self, incarnation: int) -> None:
        """Rule 7's connection, opened once the JOIN is answered; a coordinator that does not take it
        still sees this replica's death at its heartbeat timeout."""
        try:
            conn = socket.create_connection(self._peer, timeout=min(2.0, self.timeout))
            conn.sendall(pack(Kind.LIVENESS, job=self.job, replica=self.replica_id, generation=0, seq=incarnation))
        except OSError:
            return
        self._liveness = conn

    def _fail(self, err: CommError) -> None:
        with self._cond:
            if self._error is None:
                self._error = err
            self._cond.notify_all()

    def _run(self) -> None:
        buf = bytearray(MAX_MESSAGE + 1)
        last_seq = self._seq  # answers to an earlier process's messages are older
        next_send = 0.0
        kind = Kind.JOIN
        while not self._stop.is_set():
            now = time.monotonic()
            if now >= next_send:
                self._send(kind)
                next_send = now + self.heartbeat_interval
            if now - self._last_answer > self.timeout:
                self._fail(CoordinatorError(
                    f"replica {self.replica_id}: the coordinator at {self.address} did not answer for "
                    f"{self.timeout:.1f}s (it died, or the network to it is down); the job cannot go on: "
                    "restart the coordinator (`commopt-bench coordinator`) and the replicas",
                    op="elastic/heartbeat"))
                return
            self._sock.settimeout(max(0.001, min(next_send, self._last_answer + self.timeout) - time.monotonic()))
            try:
                nbytes, _ = self._sock.recvfrom_into(buf)
            except (socket.timeout, OSError):
                continue
            try:
                msg = parse(buf, nbytes, allowed=Kind.TO_REPLICA, job=self.job)
                if msg.kind == Kind.DECISION:
                    round_, verdict = parse_decision(buf)
                else:
                    status, alive, last, min_replicas, store_port, members = parse_state(buf, msg)
            except ProtocolError:
                continue  # not the coordinator's answer to us: ignored
            if msg.replica != self.replica_id or msg.seq <= self._seq0:
                continue  # a foreign answer, or one to an earlier process
            if msg.kind == Kind.DECISION:
                with self._cond:
                    self._last_answer = time.monotonic()
                    key = (msg.generation, round_)
                    if key in self._decisions:
                        self._decisions[key] = verdict
                    self._cond.notify_all()
                continue
            if msg.seq <= last_seq:
                continue  # a stale answer
            last_seq = msg.seq
            if kind == Kind.JOIN:
                self._connect_liveness(msg.seq)
            kind = Kind.HEARTBEAT
            with self._cond:
                self._last_answer = time.monotonic()
                self._answered = True
                self._answered_seq = msg.seq
                self._store_port = store_port
                self._generation, self._members, self._status = msg.generation, tuple(members), status
                self._cond.notify_all()
            if status == Status.NO_QUORUM:
                self._fail(QuorumError(
                    f"replica {self.replica_id}: no quorum after generation {msg.generation}: {alive} of its "
                    f"{last} members alive (a new generation needs more than half) and min_replicas="
                    f"{min_replicas}; this replica must stop (restart the lost replicas, or lower min_replicas "
                    "for the next run)", op="elastic/quorum"))
                return
            if status == Status.UNKNOWN:
                self._fail(QuorumError(
                    f"replica {self.replica_id}: the coordinator dropped this replica (no heartbeat within its "
                    "heartbeat_timeout: a stall, or the network); it is no longer a member of generation "
                    f"{msg.generation}: restart it to rejoin", op="elastic/quorum"))
                return
