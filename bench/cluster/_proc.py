"""Process plumbing shared by the namespaces, the link probe and the rank launcher.

Every process the cluster starts runs in its own session, so it and its children are stopped as a
group; a line is read from one with a deadline, so a process that never answers fails the run
instead of hanging it. :class:`ClusterError` lives here, below every module that raises it.
"""

from __future__ import annotations

import os
import select
import signal
import subprocess
import time
from collections.abc import Sequence

__all__ = ["ClusterError"]

_CMD_TIMEOUT_S = 15.0  # an `ip`/`tc` batch, a probe agent's first answer
_KILL_GRACE_S = 2.0


class ClusterError(RuntimeError):
    """The emulated cluster cannot be set up, probed or torn down; the message says what to do."""


def _read_line(proc: subprocess.Popen, deadline: float, what: str) -> bytes:
    """Exactly one line from an unbuffered binary stdout pipe, failing at ``deadline`` instead of hanging.

    It reads one byte at a time, so that whatever follows the line stays in the pipe for the next
    reader (the output thread that prefixes every line): reading a chunk would hand back two lines
    at once (a service's warning and its ready line), and the second would lose its prefix. A
    service's start-up output is a few lines, so the cost is nothing.
    """
    fd = proc.stdout.fileno()
    buf = b""
    while not buf.endswith(b"\n"):
        left = deadline - time.monotonic()
        if left <= 0:
            raise ClusterError(f"{what}: no answer in time")
        ready, _, _ = select.select([fd], [], [], left)
        if ready:
            data = os.read(fd, 1)
            if not data:
                raise ClusterError(f"{what}: exited (code {proc.wait()}) before answering; "
                                   f"output: {buf.decode(errors='replace')!r}")
            buf += data
    return buf


def _terminate(procs: Sequence[subprocess.Popen], grace: float = _KILL_GRACE_S) -> None:
    """SIGTERM every live process group, SIGKILL what is left after ``grace`` seconds, reap all."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        live = [p for p in procs if p.poll() is None]
        for p in live:
            try:
                os.killpg(p.pid, sig)  # own session: the group id is the pid
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + (grace if sig == signal.SIGTERM else 10.0)
        while any(p.poll() is None for p in live) and time.monotonic() < deadline:
            time.sleep(0.02)


def _close_pipes(proc: subprocess.Popen) -> None:
    for stream in (proc.stdin, proc.stdout, proc.stderr):
        if stream is not None:
            try:
                stream.close()
            except OSError:
                pass
