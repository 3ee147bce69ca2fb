"""Faults, restarts and the elastic run of the emulated cluster (``--elastic``, ``--fault``, ``--restart``).

A fault hits every rank of one node, at a time or at a training step:

- ``kill``: SIGKILL (a node that dies);
- ``stop``: SIGSTOP, and SIGCONT after ``for=S`` seconds (a node that hangs, then wakes up);
- ``linkdown``: ``ip link set cn<I> down`` inside the node, and up again after ``for=S`` seconds
  (a pulled cable: the processes run on, cut off).

``at=<seconds>s`` counts from the moment the ranks started; ``at=step=<n>`` fires the first moment
any rank of the node has reported a step >= n (``progress.report_step``, polled every 10 ms while such
a fault is pending). ``--restart node=I:after=S`` starts node I's ranks again S seconds after each of
its faults, with their first environment plus ``COMMOPT_RESTART=<attempt>``; whatever of the node
still runs (stopped, cut off, or woken up again) is SIGKILLed and its link brought up first, as a
real node is rebooted. A fault due at a time when its node has no rank left waits for a pending
restart of that node, or is dropped (and said so).

:func:`run_elastic` runs the ranks of an ``--elastic`` launch: a rank that dies does not take the
others down (each node is its own world; the survivors go on through the coordinator), and the run
ends when every rank, restarted ones included, has exited. Every event is printed on the launcher's
stderr with its time since the ranks started, and written as one JSON line to ``--events FILE``,
whose ``"time"`` (the wall clock at the moment the signal was sent or the link went down) is what
the elastic benchmark measures a stall from. Nothing here reads environment variables.
"""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import IO

from ._proc import _close_pipes, _terminate
from .launch import _Console, _note, _pump
from .netns import Cluster
from .progress import step_file_name

__all__ = ["KINDS", "Fault", "Restart", "check_plan", "parse_fault", "parse_restart", "run_elastic"]

KINDS = ("kill", "stop", "linkdown")
_FAULT_FORM = "KIND:node=I:at=WHEN[:for=S] (KIND kill|stop|linkdown, WHEN <seconds>s or step=<n>)"
_STEP_POLL_S = 0.01  # while a step fault is pending: a fault lands within ~10 ms of the step


@dataclass(frozen=True)
class Fault:
    """``kind`` on every rank of ``node``, at ``at_s`` seconds or at step ``at_step``, for ``duration`` s.

    ``duration`` (``for=``) is None for a fault that is never undone (``kill`` always).
    """

    kind: str
    node: int
    at_s: float | None = None
    at_step: int | None = None
    duration: float | None = None

    def when(self) -> str:
        """The ``at=`` value as given."""
        return f"step={self.at_step}" if self.at_step is not None else f"{self.at_s:g}s"


@dataclass(frozen=True)
class Restart:
    """Start ``node``'s ranks again ``after`` seconds after each of its faults."""

    node: int
    after: float


def _fields(text: str, option: str, parts: Sequence[str], keys: Sequence[str], form: str) -> dict[str, str]:
    """``key=value`` parts -> dict, refusing unknown, repeated and empty keys."""
    out: dict[str, str] = {}
    for part in parts:
        key, sep, value = part.partition("=")
        if not sep or key not in keys or not value:
            raise ValueError(f"{option} {text!r}: cannot read {part!r}; expected {form}")
        if key in out:
            raise ValueError(f"{option} {text!r}: {key}= given twice")
        out[key] = value
    missing = [k for k in keys[:2] if k not in out]
    if missing:
        raise ValueError(f"{option} {text!r}: {' and '.join(k + '=' for k in missing)} missing; expected {form}")
    return out


def _number(text: str, option: str, what: str, value: str, *, integer: bool = False) -> float:
    try:
        number = int(value) if integer else float(value)
    except ValueError:
        number = -1
    if not math.isfinite(number) or number < 0:
        kind = "an integer" if integer else "a number of seconds"
        raise ValueError(f"{option} {text!r}: {what}={value!r} must be {kind} >= 0")
    return number


def parse_fault(text: str) -> Fault:
    """Parse one ``--fault`` value, ``KIND:node=I:at=WHEN[:for=S]``.

    Args:
        text: e.g. ``"kill:node=2:at=step=80"``, ``"stop:node=1:at=5s:for=3"``.

    Returns:
        The fault (its node is checked against the cluster by :func:`check_plan`).

    Raises:
        ValueError: naming what is wrong and the expected form.
    """
    kind, *parts = text.split(":")
    if kind not in KINDS:
        raise ValueError(f"--fault {text!r}: unknown kind {kind!r}; use one of {', '.join(KINDS)} "
                         f"(the form is {_FAULT_FORM})")
    # at=step=80 holds a second '=': partition() splits at the first one only.
    opts = _fields(text, "--fault", parts, ("node", "at", "for"), _FAULT_FORM)
    node = int(_number(text, "--fault", "node", opts["node"], integer=True))
    at = opts["at"]
    at_s = at_step = None
    if at.startswith("step="):
        at_step = int(_number(text, "--fault", "at=step", at[len("step="):], integer=True))
    elif at.endswith("s"):
        at_s = _number(text, "--fault", "at", at[:-1])
    else:
        raise ValueError(f"--fault {text!r}: at={at!r} must be <seconds>s (e.g. at=12.5s) or step=<n> "
                         "(e.g. at=step=80)")
    duration = None
    if "for" in opts:
        if kind == "kill":
            raise ValueError(f"--fault {text!r}: for= undoes a stop or a linkdown; a kill cannot be undone "
                             "(use --restart node=I:after=S to start the node again)")
        value = opts["for"]
        duration = _number(text, "--fault", "for", value[:-1] if value.endswith("s") else value)
        if duration <= 0:
            raise ValueError(f"--fault {text!r}: for={value} must be > 0 seconds")
    return Fault(kind, node, at_s, at_step, duration)


def parse_restart(text: str) -> Restart:
    """Parse one ``--restart`` value, ``node=I:after=S`` (``S`` seconds, an optional ``s``).

    Raises:
        ValueError: naming what is wrong and the expected form.
    """
    form = "node=I:after=S (S seconds after each fault of node I)"
    opts = _fields(text, "--restart", text.split(":"), ("node", "after"), form)
    after = opts["after"]
    return Restart(int(_number(text, "--restart", "node", opts["node"], integer=True)),
                   _number(text, "--restart", "after", after[:-1] if after.endswith("s") else after))


def check_plan(faults: Sequence[Fault], restarts: Sequence[Restart], nodes: int) -> None:
    """Check faults and restarts against a cluster of ``nodes`` nodes.

    Raises:
        ValueError: a node out of range, two restarts for one node, or a restart of a node no fault
            hits (it would never happen).
    """
    for what, node in [*(("--fault", f.node) for f in faults), *(("--restart", r.node) for r in restarts)]:
        if not 0 <= node < nodes:
            raise ValueError(f"{what}: node={node} does not exist: the cluster has --nodes {nodes} "
                             f"(nodes 0..{nodes - 1})")
    seen = set()
    for r in restarts:
        if r.node in seen:
            raise ValueError(f"--restart: node={r.node} given twice; one --restart per node applies after "
                             "each of its faults")
        seen.add(r.node)
        if not any(f.node == r.node for f in faults):
            raise ValueError(f"--restart node={r.node}: no --fault hits node {r.node}, so it would never restart")


# --------------------------------------------------------------------------------------------------
# The elastic run


@dataclass
class _Rank:
    """One process of one rank: the first, or a restart."""

    rank: int  # the launcher's rank, the k of "[rank k]"
    node: int
    local: int
    proc: subprocess.Popen
    target: bool = False  # a fault (or a restart) hit it: its exit code does not decide the run
    code: int | None = None  # as the launcher reports it: 128 + S for signal S


@dataclass
class _Timer:
    due: float  # time.monotonic()
    action: str  # "cont", "link_up", "restart"
    node: int
    attempt: int = 0


@dataclass
class _Events:
    """Prints each event on the launcher's stderr and writes it as a JSON line to the events file.

    An event is stamped when :meth:`emit` is called: right after the signal was sent or the ``ip``
    command returned for a fault, cont, link_up or restart; when the launcher saw the exit (within
    one poll) for an exit.
    """

    stderr: IO[bytes] | None
    file: IO[str] | None
    t0: float = field(default_factory=time.monotonic)  # the ranks started

    def emit(self, event: str, text: str, *, node: int | None = None, kind: str | None = None,
             step: int | None = None, rank: int | None = None, ranks: Sequence[int] = (),
             code: int | None = None) -> None:
        """Record an event that has just happened (the clocks are read first, before any output)."""
        wall, t = time.time(), time.monotonic() - self.t0
        _note(self.stderr, f"t={t:.3f}s {text}")
        if self.file is not None:
            self.file.write(json.dumps({"time": wall, "t": round(t, 6), "event": event, "node": node, "kind": kind,
                                        "step": step, "rank": rank, "ranks": list(ranks), "code": code}) + "\n")
            self.file.flush()


def _signal_name(signum: int) -> str:
    try:
        return signal.Signals(signum).name
    except ValueError:  # a real-time signal has no name
        return f"signal {signum}"


class _ElasticRun:
    """The state of one elastic run; :func:`run_elastic` is its entry point."""

    def __init__(self, cluster: Cluster, layout: Sequence[Sequence[int]], command: Sequence[str],
                 envs: Sequence[dict[str, str]], faults: Sequence[Fault], restarts: Sequence[Restart],
                 step_dir: str | None, stdout: IO[bytes] | None, stderr: IO[bytes] | None,
                 events: IO[str] | None):
        if any(f.at_step is not None for f in faults) and step_dir is None:
            raise ValueError("a fault at a step needs step_dir, where the ranks report their steps")
        self.cluster, self.layout, self.command, self.envs = cluster, layout, list(command), envs
        self.pending = list(faults)
        self.restart_after = {r.node: r.after for r in restarts}
        self.step_dir = step_dir
        self.stdout, self.stderr = stdout, stderr
        self.events = _Events(stderr, events)
        self.console = _Console()
        self.ranks: list[_Rank] = []
        self.threads: list[threading.Thread] = []
        self.timers: list[_Timer] = []
        self.stopped: set[int] = set()  # nodes whose ranks are SIGSTOPped now
        self.cut: set[int] = set()  # nodes whose link is down now
        self.attempts = dict.fromkeys(range(len(layout)), 0)
        self.failure: int | None = None

    # ---- processes

    def _spawn(self, node: int, attempt: int) -> list[_Rank]:
        """Start node's ranks (from the main thread: see Cluster.spawn); their pumps start after."""
        started = []
        for local, rank in enumerate(self.layout[node]):
            env = dict(self.envs[rank])
            if attempt:
                env["COMMOPT_RESTART"] = str(attempt)
            proc = self.cluster.spawn(node, self.command, env)
            started.append(_Rank(rank, node, local, proc))
        self.ranks += started
        return started

    def _pump(self, started: Sequence[_Rank]) -> None:
        for r in started:
            for stream, out in ((r.proc.stdout, self.stdout), (r.proc.stderr, self.stderr)):
                thread = threading.Thread(target=_pump, args=(stream, out, f"[rank {r.rank}] ".encode(), self.console),
                                          daemon=True)
                thread.start()
                self.threads.append(thread)

    def _live(self, node: int | None = None) -> list[_Rank]:
        return [r for r in self.ranks if r.code is None and (node is None or r.node == node)]

    def _signal(self, ranks: Sequence[_Rank], sig: int) -> None:
        for r in ranks:
            try:
                os.killpg(r.proc.pid, sig)  # own session: the rank and whatever it started
            except ProcessLookupError:
                pass

    def _reap(self) -> None:
        """Record every rank that has exited since the last look."""
        for r in self._live():
            code = r.proc.poll()
            if code is None:
                continue
            r.code = code if code >= 0 else 128 - code
            name = _signal_name(-code) if code < 0 else None
            self.events.emit("exit", f"rank {r.rank} exited with {name or f'code {code}'}"
                             + (" (a fault's target)" if r.target else ""),
                             node=r.node, kind=name, rank=r.rank, ranks=[r.rank], code=r.code)
            if not r.target and r.code != 0 and self.failure is None:
                self.failure = r.code

    # ---- faults and timers

    def _reached(self, fault: Fault) -> int | None:
        """The highest step any live rank of the fault's node has reported, if it reaches the fault's."""
        best = None
        for r in self._live(fault.node):
            try:
                with open(os.path.join(self.step_dir, step_file_name(r.node, r.local)), encoding="ascii") as f:
                    step = int(f.read())
            except (OSError, ValueError):  # nothing reported yet
                continue
            best = step if best is None else max(best, step)
        return best if best is not None and best >= fault.at_step else None

    def _fire(self, fault: Fault, step: int | None) -> None:
        node = fault.node
        targets = self._live(node)
        for r in targets:
            r.target = True
        if fault.kind == "kill":
            self._signal(targets, signal.SIGKILL)
        elif fault.kind == "stop":
            self._signal(targets, signal.SIGSTOP)
            self.stopped.add(node)
        else:
            self.cluster.set_link(node, up=False)
            self.cut.add(node)
        reason = f"step {step} reached" if step is not None else f"at {fault.at_s:g} s"
        names = " ".join(str(r.rank) for r in targets) or "- (none alive)"
        self.events.emit("fault", f"fault {fault.kind} node {node} ({reason}): ranks {names}", node=node,
                         kind=fault.kind, step=step, ranks=[r.rank for r in targets])
        now = time.monotonic()
        if fault.duration is not None:
            self.timers.append(_Timer(now + fault.duration, "cont" if fault.kind == "stop" else "link_up", node))
        if node in self.restart_after:
            self.attempts[node] += 1
            self.timers.append(_Timer(now + self.restart_after[node], "restart", node, self.attempts[node]))

    def _cont(self, node: int) -> None:
        if node not in self.stopped:
            return
        self.stopped.discard(node)
        targets = self._live(node)
        self._signal(targets, signal.SIGCONT)
        self.events.emit("cont", f"cont node {node}: ranks {' '.join(str(r.rank) for r in targets) or '-'}",
                         node=node, ranks=[r.rank for r in targets])

    def _link_up(self, node: int) -> None:
        if node not in self.cut:
            return
        self.cut.discard(node)
        self.cluster.set_link(node, up=True)
        self.events.emit("link_up", f"link up node {node}", node=node, ranks=[r.rank for r in self._live(node)])

    def _restart(self, node: int, attempt: int) -> None:
        """Reboot node: SIGKILL what still runs there (stopped or cut off), link up, start its ranks again."""
        self.timers = [t for t in self.timers if not (t.node == node and t.action in ("cont", "link_up"))]
        self._link_up(node)
        self.stopped.discard(node)
        old = self._live(node)
        for r in old:
            r.target = True
        self._signal(old, signal.SIGKILL)
        deadline = time.monotonic() + 10.0
        while any(r.proc.poll() is None for r in old) and time.monotonic() < deadline:
            time.sleep(0.005)
        self._reap()
        if self.step_dir is not None:  # the new processes report afresh
            for local in range(len(self.layout[node])):
                try:
                    os.remove(os.path.join(self.step_dir, step_file_name(node, local)))
                except FileNotFoundError:
                    pass
        started = self._spawn(node, attempt)
        self.events.emit("restart", f"restart node {node} (attempt {attempt}): ranks "
                                    f"{' '.join(str(r.rank) for r in started)}",
                         node=node, ranks=[r.rank for r in started])
        self._pump(started)

    # ---- the loop

    def run(self, timeout: float | None, poll_interval: float,
            extra_streams: Sequence[tuple[IO[bytes], IO[bytes] | None, bytes]]) -> int:
        for node in range(len(self.layout)):
            self._spawn(node, 0)  # all of them before any output thread exists (see Cluster.spawn)
        self.events.t0 = time.monotonic()
        for node in range(len(self.layout)):
            self.events.emit("start", f"start node {node}: ranks {' '.join(map(str, self.layout[node]))}",
                             node=node, ranks=list(self.layout[node]))
        self._pump(self.ranks)
        for stream, out, prefix in extra_streams:
            threading.Thread(target=_pump, args=(stream, out, prefix, self.console), daemon=True).start()
        deadline = None if timeout is None else self.events.t0 + timeout
        while True:
            self._reap()
            now = time.monotonic()
            for fault in list(self.pending):
                step = self._reached(fault) if fault.at_step is not None else None
                if step is None and (fault.at_s is None or now - self.events.t0 < fault.at_s):
                    continue
                if not self._live(fault.node):
                    if any(t.action == "restart" and t.node == fault.node for t in self.timers):
                        continue  # due while the node is down: it hits the restarted ranks
                    self.pending.remove(fault)
                    _note(self.stderr, f"fault {fault.kind} node {fault.node} at {fault.when()} dropped: "
                                       "the node has no rank left")
                    continue
                self.pending.remove(fault)
                self._fire(fault, step)
            for timer in sorted((t for t in self.timers if t.due <= time.monotonic()), key=lambda t: t.due):
                if timer not in self.timers:  # a restart cancelled it
                    continue
                self.timers.remove(timer)
                if timer.action == "cont":
                    self._cont(timer.node)
                elif timer.action == "link_up":
                    self._link_up(timer.node)
                else:
                    self._restart(timer.node, timer.attempt)
            if not self._live() and not any(t.action == "restart" for t in self.timers):
                break
            if deadline is not None and time.monotonic() > deadline:
                _note(self.stderr, f"timeout after {timeout} s; killing all ranks")
                return 124
            step_pending = any(f.at_step is not None for f in self.pending)
            time.sleep(_STEP_POLL_S if step_pending else poll_interval)
        for fault in self.pending:
            _note(self.stderr, f"fault {fault.kind} node {fault.node} at {fault.when()} never fired: every rank "
                               "exited first")
        return self.failure or 0

    def close(self) -> None:
        """Kill whatever still runs (stopped ranks at once: a stopped process ignores SIGTERM), reap, close."""
        self._signal([r for r in self._live() if r.node in self.stopped], signal.SIGKILL)
        procs = [r.proc for r in self.ranks]
        _terminate(procs)
        for thread in self.threads:
            thread.join(timeout=2.0)
        for proc in procs:
            _close_pipes(proc)
            self.cluster._procs.remove(proc)


def run_elastic(cluster: Cluster, layout: Sequence[Sequence[int]], command: Sequence[str],
                envs: Sequence[dict[str, str]], *, faults: Sequence[Fault] = (), restarts: Sequence[Restart] = (),
                step_dir: str | None = None, timeout: float | None = None, stdout: IO[bytes] | None = None,
                stderr: IO[bytes] | None = None, events: IO[str] | None = None,
                extra_streams: Sequence[tuple[IO[bytes], IO[bytes] | None, bytes]] = (),
                poll_interval: float = 0.05) -> int:
    """Run ``command`` once per rank, inject ``faults``, restart nodes, and wait for every rank.

    Unlike :func:`launch.run_ranks`, a rank that dies does not end the run: each node is its own
    world and the survivors carry on (the coordinator tells them who is left), so the launcher waits
    until every rank, restarted ones included, has exited, or ``timeout``. Output lines are prefixed
    ``[rank k]`` (a restarted rank keeps its k); events go to ``stderr`` and ``events`` (see
    :class:`_Events`): ``start``, ``fault``, ``cont``, ``link_up``, ``restart``, ``exit``.

    Args:
        cluster: a cluster that is up.
        layout: ``layout[node]`` = the launcher's ranks of that node.
        command: the argv every rank runs.
        envs: ``envs[rank]`` (``rank_environments(..., elastic=True)``); a restart adds ``COMMOPT_RESTART``.
        faults: what to inject (:func:`parse_fault`; checked by :func:`check_plan`).
        restarts: which nodes start again after their faults (:func:`parse_restart`).
        step_dir: where the ranks report their steps (``COMMOPT_STEP_DIR``); needed by step faults.
        timeout: seconds after which every rank is killed and 124 returned (None: no limit).
        stdout: the launcher's binary stdout.
        stderr: the launcher's binary stderr.
        events: a text file that gets one JSON line per event, or None.
        extra_streams: more ``(stream, out, prefix)`` to copy, e.g. the coordinator's output.
        poll_interval: seconds between checks of the ranks while no step fault is pending.

    Returns:
        0 when every rank that no fault hit, and every restarted rank, exited 0; else the first such
        rank's failing code (128 + S for signal S); 124 on timeout.
    """
    run = _ElasticRun(cluster, layout, command, envs, faults, restarts, step_dir, stdout, stderr, events)
    try:
        return run.run(timeout, poll_interval, extra_streams)
    finally:
        run.close()
