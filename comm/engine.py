"""The comm engine: one FIFO queue and one worker thread per process group (docs/architecture.md section 3).

A multi-phase collective (hierarchical all-reduce: reduce-scatter, all-reduce, all-gather) is a
list of :class:`Phase` objects, each bound to a process group. ``Engine.submit`` enqueues the first
phase on its group's queue; when a phase completes, its worker enqueues the next phase on that
phase's group. No collective is ever issued from a future callback: callbacks run on whichever
thread completes first, and two operations in flight would then reach a group in different orders
on different ranks (gloo silently crosses data, NCCL hangs).

Why this ordering is the same on every rank: every queue records its *feeder* (direct submission,
or the queue whose phases precede its phases). A queue fed by exactly one FIFO receives items in
that FIFO's completion order, which is its submission order, recursively down to the submitting
thread, whose order is deterministic (DDP launches buckets in index order). A second feeder would
make the order depend on timing, so the engine refuses it; algorithms use one process group per
phase role (``context().groups(topology, role)``) to satisfy that, and different groups still run in parallel:
bucket 2's intra-node reduce-scatter overlaps bucket 1's inter-node all-reduce.

The engine also counts the bytes this rank sends per operation (the "bytes on the wire" of every
benchmark) and labels each phase for ``torch.profiler`` as ``commopt/<op>/<phase>``.
"""

from __future__ import annotations

import heapq
import itertools
import queue
import threading
import time
import warnings
from collections import defaultdict
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Callable

import torch
import torch.distributed as dist

from .errors import CommError, CommTimeoutError

__all__ = ["Engine", "Phase", "wait", "wait_work", "all_of", "chain"]

_DIRECT = "direct submission"


@dataclass
class Phase:
    """One step of a collective.

    Attributes:
        name: label for profiles and errors ("reduce_scatter").
        fn: the work; issues at most one blocking collective on ``group``. Called with no arguments
            on the worker thread of ``group`` (or inline on the previous phase's thread when
            ``group`` is None: local work, or a phase this rank takes no part in). When it returns
            an int, that is the bytes it sent (the transport counts the tensors it posts).
        group: the process group whose queue runs the phase.
        nbytes: the bytes this rank sends in the phase, for an ``fn`` that returns none (counted
            when the phase succeeds).
    """

    name: str
    fn: Callable[[], Any]
    group: Any = None
    nbytes: int = 0


@dataclass
class _Op:
    op: str
    seq: int
    phases: list[Phase]
    future: torch.futures.Future
    result: Any
    rank: int
    device: torch.device | None = None
    event: Any = None
    index: int = 0
    ready: float = 0.0  # when the current phase could start (phase timing only)


class _Worker:
    def __init__(self, engine: Engine, group, name: str):
        self.engine = engine
        self.group = group
        self.queue: queue.SimpleQueue = queue.SimpleQueue()
        self.name = name
        self.feeder: str | None = None
        self.thread = threading.Thread(target=self._loop, name=f"commopt-engine-{name}", daemon=True)
        self.thread.start()

    def _loop(self) -> None:
        stream = None
        while True:
            item = self.queue.get()
            if item is None:
                return
            if item.device is not None and item.device.type == "cuda":
                # Work runs on the submitting thread's device, on a side stream ordered after the
                # submitting stream by an event: the submitting host thread never blocks.
                if stream is None:
                    stream = torch.cuda.Stream(device=item.device)
                with torch.cuda.device(item.device), torch.cuda.stream(stream):
                    stream.wait_event(item.event)
                    self.engine._run(item, self)
                    stream.synchronize()
            else:
                self.engine._run(item, self)


class Engine:
    """Runs multi-phase collectives in a rank-consistent order. One per process (see topology)."""

    def __init__(self):
        self._lock = threading.Lock()
        self._workers: dict[Any, _Worker] = {}
        self._seq = itertools.count()
        self._bytes: dict[str, int] = defaultdict(int)
        self._calls: dict[str, int] = defaultdict(int)
        self._closed = False
        self._watchdog: _Watchdog | None = None
        self._inflight = 0  # submitted ops whose future is not yet set
        self._timing: dict[str, list[float]] | None = None  # phase label -> [calls, run s, wait s]

    # ----------------------------------------------------------------------------- submission
    def submit(self, phases: list[Phase], *, op: str, result: Any = None,
               device: torch.device | None = None, blocking: bool = False) -> torch.futures.Future:
        """Run ``phases`` in order; the returned future completes with ``result`` after the last.

        Args:
            phases: the steps; each phase starts when its predecessor has completed.
            op: the operation's name for profiles, byte counters and errors ("hierarchical").
            result: the value the future completes with (usually the in-place tensor).
            device: the tensors' device; for CUDA, the work is ordered after the current stream.
            blocking: the caller waits for this future right away and submits nothing meanwhile.
                When no other op is in flight, a CPU op then runs on the calling thread: every
                earlier op has completed, so its phases reach each group in the order the queues
                would give them, without three thread hand-offs (each a scheduler wake-up: about
                1 ms on a loaded host, 10 % of a 16 MiB hierarchical all-reduce on loopback).

        Returns:
            A ``torch.futures.Future`` that completes with ``result`` or fails with a
            :class:`CommError` naming the op, its sequence number, this rank and the phase.
        """
        if self._closed:
            raise CommError("the comm engine was shut down (commopt.comm.destroy()); create a new "
                            "topology after re-initialising", op=op)
        fut: torch.futures.Future = torch.futures.Future()
        rank = dist.get_rank() if dist.is_initialized() else 0
        item = _Op(op=op, seq=next(self._seq), phases=list(phases), future=fut, result=result, rank=rank)
        if self._timing is not None:
            item.ready = time.perf_counter()
        if device is not None and device.type == "cuda":
            item.device = device
            item.event = torch.cuda.Event()
            item.event.record(torch.cuda.current_stream(device))
        with self._lock:
            self._calls[op] += 1
            inline = blocking and item.device is None and self._inflight == 0
            self._inflight += 1
        if inline:
            for phase in item.phases:
                if not self._run_phase(item, phase):
                    return fut
            self._finish(item)
            return fut
        self._advance(item, feeder=_DIRECT, current=None)
        return fut

    def _retire(self) -> None:
        # Before the future is set, so that a caller woken by it finds the engine idle.
        with self._lock:
            self._inflight -= 1

    def _advance(self, item: _Op, feeder: str, current: _Worker | None) -> None:
        """Hand ``item``'s next phase to its group's queue, or run inline phases right here."""
        while item.index < len(item.phases):
            phase = item.phases[item.index]
            if phase.group is None:
                if item.device is not None and current is None:
                    # Inline phase on the submitting thread of a CUDA op: hand it to a worker of
                    # its own so the submitting thread does not wait for the stream.
                    worker = self._worker(("inline", feeder), f"inline<{feeder}>", feeder)
                    worker.queue.put(item)
                    return
                if not self._run_phase(item, phase):
                    return
                item.index += 1
                continue
            worker = self._worker(phase.group, _group_name(phase.group), feeder)
            worker.queue.put(item)
            return
        self._finish(item)

    def _worker(self, key, name: str, feeder: str) -> _Worker:
        with self._lock:
            if self._closed:
                # A phase that completed after shutdown() must not start a worker for its successor:
                # nothing would ever stop that thread (shutdown has already signalled the others).
                raise CommError("the comm engine was shut down (commopt.comm.destroy()) before this phase "
                                "could be queued", op=name)
            w = self._workers.get(key)
            if w is None:
                w = self._workers[key] = _Worker(self, key, name)
            if w.feeder is None:
                w.feeder = feeder
            elif w.feeder != feeder:
                # Two feeders would make this queue's order depend on timing (docs/architecture.md section 3, rule 1).
                raise RuntimeError(
                    f"commopt engine: queue {name} is fed by both {w.feeder!r} and {feeder!r}; "
                    f"use a separate process group per phase role (context().groups(topology, role))")
            return w

    def _run(self, item: _Op, worker: _Worker) -> None:
        """Worker side: run the item's current phase, then advance it."""
        phase = item.phases[item.index]
        if self._closed:
            # Shut down: queued phases are failed, not run, so no worker starts a new collective
            # (which could wait for a dead peer) after destroy().
            self._fail(item, phase, CommError("the comm engine was shut down (commopt.comm.destroy()) before "
                                              "this phase ran", op=f"{item.op}/{phase.name}", seq=item.seq))
            return
        if not self._run_phase(item, phase):
            return
        item.index += 1
        try:
            self._advance(item, feeder=worker.name, current=worker)
        except Exception as exc:  # noqa: BLE001 - any failure must fail the future, not the thread
            self._fail(item, phase, exc)

    def _run_phase(self, item: _Op, phase: Phase) -> bool:
        timing = self._timing
        start = time.perf_counter() if timing is not None else 0.0
        try:
            with torch.profiler.record_function(f"commopt/{item.op}/{phase.name}"):
                sent = phase.fn()
        except Exception as exc:  # noqa: BLE001 - forwarded to the future with its type and text
            self._fail(item, phase, exc)
            return False
        if timing is not None:
            end = time.perf_counter()
            with self._lock:
                entry = timing.setdefault(f"{item.op}/{phase.name}", [0, 0.0, 0.0])
                entry[0] += 1
                entry[1] += end - start
                entry[2] += max(0.0, start - item.ready) if item.ready else 0.0
            item.ready = end
        nbytes = sent if isinstance(sent, int) and not isinstance(sent, bool) else phase.nbytes
        if nbytes:
            with self._lock:
                self._bytes[item.op] += int(nbytes)
        return True

    def _finish(self, item: _Op) -> None:
        if not item.future.done():
            self._retire()
            item.future.set_result(item.result)

    def _fail(self, item: _Op, phase: Phase, exc: BaseException) -> None:
        if item.future.done():
            return
        self._retire()
        item.future.set_exception(wrap_error(exc, op=f"{item.op}/{phase.name}", seq=item.seq,
                                             rank=item.rank))

    # ----------------------------------------------------------------------------- deadlines
    def watch(self, future: torch.futures.Future, timeout: float, *, op: str) -> torch.futures.Future:
        """A future that mirrors ``future`` but fails with ``CommTimeoutError`` after ``timeout`` s.

        For work issued on the caller's thread (a flat collective keeps the caller's order that
        way): the backend cannot cancel it, but the caller, or DDP waiting on a hook's future, gets
        control back. One watchdog thread serves every deadline.
        """
        out: torch.futures.Future = torch.futures.Future()
        rank = dist.get_rank() if dist.is_initialized() else 0
        lock = threading.Lock()

        def settle(f: torch.futures.Future) -> None:
            with lock:
                if out.done():
                    return
                try:
                    out.set_result(f.value())
                except Exception as exc:  # noqa: BLE001 - forwarded with op and rank
                    out.set_exception(wrap_error(exc, op=op, seq=None, rank=rank))

        def expire() -> None:
            with lock:
                if not out.done():
                    out.set_exception(CommTimeoutError(
                        f"did not complete within {timeout:.1f} s on rank {rank}; a rank may not have entered "
                        f"the collective or may have died", op=op, ranks=[rank]))

        with self._lock:
            if self._watchdog is None:
                self._watchdog = _Watchdog()
            watchdog = self._watchdog
        watchdog.add(time.monotonic() + timeout, expire)
        future.add_done_callback(settle)
        return out

    # ----------------------------------------------------------------------------- statistics
    def bytes_sent(self) -> dict[str, int]:
        """Bytes this rank has sent per operation since the last ``reset_stats()``."""
        with self._lock:
            return dict(self._bytes)

    def calls(self) -> dict[str, int]:
        """Operations submitted per name since the last ``reset_stats()``."""
        with self._lock:
            return dict(self._calls)

    def count(self, op: str, nbytes: int) -> None:
        """Count bytes sent by work that bypasses the queues (a flat collective on its own group)."""
        with self._lock:
            self._bytes[op] += int(nbytes)
            self._calls[op] += 1

    def reset_stats(self) -> None:
        with self._lock:
            self._bytes.clear()
            self._calls.clear()
            if self._timing is not None:
                self._timing = {}

    def time_phases(self, on: bool = True) -> None:
        """Start (and clear) or stop timing every phase: :meth:`phase_times` then says where an
        operation's time goes (a diagnostic; off by default, it costs two clock reads per phase)."""
        with self._lock:
            self._timing = {} if on else None

    def phase_times(self) -> dict[str, tuple[int, float, float]]:
        """``{"<op>/<phase>": (calls, seconds running, seconds waiting)}`` since :meth:`time_phases`:
        waiting is from the moment the phase could start (its op submitted, or its predecessor done)
        until it started: the queue and the thread hand-off."""
        with self._lock:
            return {k: (int(v[0]), v[1], v[2]) for k, v in (self._timing or {}).items()}

    # ----------------------------------------------------------------------------- lifecycle
    def threads(self) -> list[threading.Thread]:
        with self._lock:
            return [w.thread for w in self._workers.values()]

    def release(self, group, timeout: float = 5.0) -> None:
        """Stop the worker of ``group``'s queue after the work already queued (a wrapper that owns a
        private group calls it when it closes, so that no idle thread outlives the group)."""
        with self._lock:
            worker = self._workers.pop(group, None)
        if worker is not None:
            worker.queue.put(None)
            worker.thread.join(timeout)

    def shutdown(self, timeout: float = 5.0) -> list[str]:
        """Stop every worker after the work already queued (queued phases fail instead of running),
        waiting ``timeout`` seconds in all, never longer.

        A worker still inside a collective after that cannot be interrupted (a backend wait whose
        peer stalled or died, bounded only by the group's own timeout, 30 minutes by default): it
        is abandoned -- a daemon thread, so it never keeps the process alive, never joined again; it
        exits when its wait ends, and fails what was queued behind it -- and reported with a
        ``RuntimeWarning`` naming it (docs/faults.md rows 5 and 30). commopt's own phases wait for
        what is left of their call's deadline, so with a timeout none outlives it.

        Returns:
            The names of the threads abandoned (empty when every worker exited).
        """
        end = time.monotonic() + timeout
        with self._lock:
            self._closed = True
            workers, self._workers = list(self._workers.values()), {}
            watchdog, self._watchdog = self._watchdog, None
        if watchdog is not None:
            watchdog.stop(max(0.0, end - time.monotonic()))
        for w in workers:
            w.queue.put(None)
        abandoned = []
        for w in ([watchdog] if watchdog is not None else []) + workers:
            w.thread.join(max(0.0, end - time.monotonic()))
            if w.thread.is_alive():
                abandoned.append(w.thread.name)
        if abandoned:
            warnings.warn(f"commopt.comm.destroy(): {len(abandoned)} comm engine thread(s) still inside a "
                          f"collective after {timeout:g} s ({', '.join(abandoned)}): a peer stalled or died; they "
                          f"are abandoned (daemon threads, they end with the backend's own timeout or the process). "
                          f"Give the comms a timeout to bound every wait", RuntimeWarning, stacklevel=3)
        return abandoned


class _Watchdog:
    """One thread firing deadline callbacks in time order."""

    def __init__(self):
        self._cond = threading.Condition()
        self._heap: list[tuple[float, int, Callable[[], None]]] = []
        self._ids = itertools.count()
        self._stopped = False
        self.thread = threading.Thread(target=self._loop, name="commopt-engine-watchdog", daemon=True)
        self.thread.start()

    def add(self, deadline: float, callback: Callable[[], None]) -> None:
        with self._cond:
            heapq.heappush(self._heap, (deadline, next(self._ids), callback))
            self._cond.notify()

    def _loop(self) -> None:
        while True:
            with self._cond:
                while not self._stopped and (not self._heap or self._heap[0][0] > time.monotonic()):
                    wait = self._heap[0][0] - time.monotonic() if self._heap else None
                    self._cond.wait(wait)
                if self._stopped:
                    return
                _, _, callback = heapq.heappop(self._heap)
            callback()

    def stop(self, timeout: float) -> None:
        with self._cond:
            self._stopped = True
            self._cond.notify()
        self.thread.join(timeout)  # a callback still running is abandoned by Engine.shutdown


def _group_name(group) -> str:
    """The queue's name, which is also its identity as a feeder: unique per group."""
    try:
        name = dist.distributed_c10d._get_process_group_name(group)
    except (AttributeError, KeyError, RuntimeError, TypeError):
        name = "None"
    return f"pg{name}" if name != "None" else f"pg{id(group):x}"  # "None": not a registered group


def _is_timeout(exc: BaseException) -> bool:
    text = str(exc).lower()
    return isinstance(exc, TimeoutError) or "timed out" in text or "timeout" in text


def wrap_error(exc: BaseException, *, op: str, seq: int | None, rank: int) -> BaseException:
    """A CommError for a failure inside a phase, keeping the original type and message in its text."""
    if isinstance(exc, CommError):
        return exc
    if isinstance(exc, (TypeError, ValueError)):
        return exc
    cls = CommTimeoutError if _is_timeout(exc) else CommError
    what = "timed out" if cls is CommTimeoutError else "failed"
    err = cls(f"{what} on rank {rank}: {type(exc).__name__}: {exc}. A peer may have died or issued a "
              f"different collective; check the other ranks' errors", op=op, seq=seq, ranks=[rank])
    err.__cause__ = exc
    return err


def chain(future: torch.futures.Future, fn: Callable[[Any], Any]) -> torch.futures.Future:
    """``future.then`` that keeps exception types: ``fn(value)`` on success, else the same error.

    torch's ``Future.then`` turns an exception raised in the callback into a ``RuntimeError``
    ("Got the following error when running the callback"), which would hide a
    ``CommTimeoutError`` from the caller. ``fn`` does local work only (docs/architecture.md section 3, rule 1).
    """
    out: torch.futures.Future = torch.futures.Future()

    def done(f: torch.futures.Future) -> None:
        try:
            value = fn(f.value())
        except Exception as exc:  # noqa: BLE001 - forwarded unchanged
            out.set_exception(exc)
            return
        out.set_result(value)

    future.add_done_callback(done)
    return out


def all_of(futures: list[torch.futures.Future], result: Any) -> torch.futures.Future:
    """A future completing with ``result`` once all ``futures`` have; the first failure fails it."""
    out: torch.futures.Future = torch.futures.Future()
    if not futures:
        out.set_result(result)
        return out
    remaining = [len(futures)]
    lock = threading.Lock()

    def done(f: torch.futures.Future) -> None:
        # A callback only does bookkeeping; it never issues a collective (docs/architecture.md section 3, rule 1).
        try:
            f.value()
        except Exception as exc:  # noqa: BLE001 - forwarded
            with lock:
                if not out.done():
                    out.set_exception(exc)
            return
        with lock:
            remaining[0] -= 1
            if remaining[0] == 0 and not out.done():
                out.set_result(result)

    for f in futures:
        f.add_done_callback(done)
    return out


def wait(future: torch.futures.Future, timeout: float | None = None, *, op: str = "wait",
         deadline: float | None = None) -> Any:
    """Wait for an engine future; with ``timeout``, raise ``CommTimeoutError`` when it passes.

    Waiting with a timeout polls the future's state: a collective stuck in the backend cannot be
    cancelled, but the caller gets control back and the error names the operation. ``deadline`` (a
    ``time.monotonic()`` deadline of the whole call, which ``timeout`` then only names in the error)
    bounds the wait by what is left of it.
    """
    if timeout is None and deadline is None:
        return future.wait()
    done = threading.Event()
    future.add_done_callback(lambda _f: done.set())
    left = timeout if deadline is None else max(0.0, deadline - time.monotonic())
    if timeout is None:
        timeout = left
    if not done.wait(left):
        raise CommTimeoutError(f"did not complete within {timeout:.1f} s; a rank may not have entered "
                               f"the collective or may have died", op=op,
                               ranks=[dist.get_rank()] if dist.is_initialized() else None)
    return future.wait()


def wait_work(work, timeout: float | None, op: str | None = None, *, deadline: float | None = None) -> None:
    """Wait for a backend work (``dist.*(async_op=True)``): the one wait with a timeout.

    Args:
        work: the backend's work.
        timeout: seconds (None: the group's own timeout).
        op: for setup collectives on the caller's thread (layout checks, model broadcasts, split
            exchanges): any failure becomes a ``CommTimeoutError`` naming ``op`` and saying what to
            check. None inside an engine phase, which wraps failures itself.
        deadline: a ``time.monotonic()`` deadline shared by several works of one phase (one
            phase, one timeout); overrides ``timeout``.

    gloo's ``wait(timedelta)`` is bounded for every work with a future; its reduce-scatter's is not
    (``collectives`` hands such works to the engine and its watchdog, compression avoids them).
    """
    if deadline is not None:
        timeout = max(1e-3, deadline - time.monotonic())
    try:
        if timeout is None:
            work.wait()
        else:
            work.wait(timedelta(seconds=float(timeout)))
    except RuntimeError as exc:
        if op is None:
            raise
        rank = dist.get_rank() if dist.is_initialized() else 0
        raise CommTimeoutError(f"setup collective failed or timed out on rank {rank}: {type(exc).__name__}: "
                               f"{exc}. Another rank did not reach this collective or died", op=op,
                               ranks=[rank]) from exc

