"""Worker scripts started from the rank pool's forkserver (tests/_pool.py) instead of a fresh interpreter:
a fork costs milliseconds where importing torch costs seconds of CPU, and the elastic tests start a dozen
worker processes each (tests/_elastic_node.py).

:func:`start_script` runs ``python SCRIPT ARGS...`` as a child of the forkserver: ``sys.argv``, ``sys.path``
and ``__main__`` as the interpreter would set them, pytest's environment as it is now, stdout and stderr to a
log file, ``atexit`` handlers run at the end (commopt's elastic replicas settle there), the exit code of
``sys.exit`` or 1 for an uncaught exception. The process is in the process group asked for before
:func:`start_script` returns, so that a fault can SIGKILL a whole node at once. :class:`ForkedScript`
answers what the tests ask of a ``subprocess.Popen`` (``pid``, ``poll``, ``wait``, ``communicate``,
``kill``, ``returncode``; a signal's exit code is its negative number)."""

from __future__ import annotations

import os
import subprocess
import tempfile
import time

from _pool import _context

__all__ = ["ForkedScript", "start_script"]


def _script_main(argv: list[str], env: dict, log: str, pgid: int) -> None:
    """In the forked child: the script as ``python argv[0] argv[1:]`` would run it."""
    import atexit
    import runpy
    import sys
    import traceback

    os.setpgid(0, pgid)
    os.environ.clear()
    os.environ.update(env)
    fd = os.open(log, os.O_WRONLY | os.O_APPEND)
    sys.stdout.flush()
    sys.stderr.flush()
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    sys.argv = list(argv)
    sys.path.insert(0, os.path.dirname(os.path.abspath(argv[0])))
    code = 0
    try:
        runpy.run_path(argv[0], run_name="__main__")
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
        if not isinstance(exc.code, (int, type(None))):
            print(exc.code, file=sys.stderr)
    except BaseException:  # noqa: BLE001 - reported as the interpreter would, exit code 1
        traceback.print_exc()
        code = 1
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


class ForkedScript:
    """A script forked by :func:`start_script`, with the parts of ``subprocess.Popen`` the tests use."""

    def __init__(self, proc, log: str):
        self._proc = proc
        self._log = log
        self._out: str | None = None
        self.pid = proc.pid

    def poll(self) -> int | None:
        return self._proc.exitcode

    @property
    def returncode(self) -> int | None:
        return self._proc.exitcode

    def wait(self, timeout: float | None = None) -> int:
        self._proc.join(timeout)
        if self._proc.exitcode is None:
            raise subprocess.TimeoutExpired(self._proc.name, timeout)
        return self._proc.exitcode

    def communicate(self, timeout: float | None = None) -> tuple[str, None]:
        """Its output once it has exited (``subprocess.TimeoutExpired`` while it runs past ``timeout``)."""
        self.wait(timeout)
        if self._out is None:  # read once (the log removed); a second call gives the same text
            with open(self._log, encoding="utf-8", errors="replace") as f:
                self._out = f.read()
            os.unlink(self._log)
        return self._out, None

    def __del__(self) -> None:
        if self._out is None and os.path.exists(self._log):  # never read: the log goes with the handle
            os.unlink(self._log)

    def kill(self) -> None:
        if self._proc.exitcode is None:
            self._proc.kill()


def start_script(argv: list[str], process_group: int = 0) -> ForkedScript:
    """Start ``argv`` (a script's path and its arguments; a leading ``sys.executable`` is dropped) in
    process group ``process_group`` (0: a new group, led by the script's own process)."""
    import sys

    if argv and argv[0] == sys.executable:
        argv = argv[1:]
    fd, log = tempfile.mkstemp(prefix="commopt-forked-", suffix=".log")
    os.close(fd)
    proc = _context().Process(target=_script_main, args=(list(argv), dict(os.environ), log, process_group),
                              daemon=True, name=os.path.basename(argv[0]))
    proc.start()
    want = process_group or proc.pid
    deadline = time.monotonic() + 60
    while True:  # in its group before anyone may signal the group (the child sets it first thing)
        try:
            if os.getpgid(proc.pid) == want:
                break
        except ProcessLookupError:
            break  # already gone: poll() says how
        if proc.exitcode is not None or time.monotonic() > deadline:
            break
        time.sleep(0.001)
    return ForkedScript(proc, log)
