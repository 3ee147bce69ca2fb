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
    job_id,
    pack,
    parse,
    parse_state,
)

__all__ = ["Membership", "QuorumError", "CoordinatorError", "ENV_COORDINATOR", "parse_address"]

ENV_COORDINATOR = "COMMOPT_COORDINATOR"


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
        self._seq = time.time_ns()
        self._cond = threading.Condition()
        self._generation = 0
        self._members: tuple[int, ...] = ()
        self._status = Status.WAITING
        self._error: CommError | None = None
        self._last_answer = time.monotonic()
        self._answered = False
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

    @classmethod
    def from_env(cls, replica_id: int, **kwargs: object) -> Membership:
        """A membership at the coordinator named by COMMOPT_COORDINATOR ("host:port").

        The one place the elastic package reads an environment variable (docs/architecture.md
        section 7.6); ``kwargs`` are the constructor's.
        """
        address = os.environ.get(ENV_COORDINATOR)
        if not address:
            raise CommError(f"{ENV_COORDINATOR} is not set: start a coordinator (`commopt-bench coordinator`) "
                            f"and set {ENV_COORDINATOR} to the address it printed, or pass it to Membership")
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

    @property
    def is_member(self) -> bool:
        """Whether this replica is a member of :attr:`generation`."""
        with self._cond:
            return self._status == Status.MEMBER

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

    def __enter__(self) -> Membership:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- heartbeat thread ------------------------------------------------------------------------------

    def _send(self, kind: int) -> None:
        with self._send_lock:
            self._seq += 1
            seq = self._seq
            try:
                self._sock.sendto(pack(kind, job=self.job, replica=self.replica_id, generation=self._generation,
                                       seq=seq), self._peer)
            except OSError:
                pass  # unreachable now: the timeout decides

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
                status, alive, last, min_replicas, members = parse_state(buf, msg)
            except ProtocolError:
                continue  # not the coordinator's answer to us: ignored
            if msg.replica != self.replica_id or msg.seq <= last_seq:
                continue  # a stale or foreign answer
            last_seq = msg.seq
            kind = Kind.HEARTBEAT
            with self._cond:
                self._last_answer = time.monotonic()
                self._answered = True
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
