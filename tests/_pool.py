"""A pool of spawned rank processes that runs test bodies (docs/architecture.md section 9).

Importing torch (and numba) costs seconds of CPU per process, so each world size keeps one pool of
rank processes for the whole session; every test body is a module-level function shipped by
reference and run on all ranks at once. Rendezvous goes through a ``FileStore`` in a temporary
directory (never a fixed port). Every call has a wall-clock guard: a hang fails the test naming the
ranks that did not finish, and the pool is replaced. A failure on a rank is re-raised in pytest
with that rank's traceback; after any failure the pool is replaced too, since a half-finished
collective leaves the process groups out of step.

Ranks come from a forkserver, never from a fork of pytest itself (numba's OpenMP layer is not
fork-safe, and pytest's process has run numba kernels): the server is a fresh interpreter that has
imported torch and commopt (never numba) with one OpenMP thread, so a rank costs a fork instead of
the seconds of CPU of importing torch; each rank runs with one thread.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import queue
import shutil
import tempfile
import time
import traceback
from datetime import timedelta
from typing import Any, Callable

__all__ = ["RankPool", "RankFailure", "PoolTimeout"]


class RankFailure(AssertionError):
    """A test body raised on one or more ranks."""


class PoolTimeout(AssertionError):
    """A test body did not finish on some ranks within its wall-clock guard."""


# Imported once, by the forkserver; every rank forked from it has them. Not numba: its threading
# layer must be initialised in the rank itself (it is not fork-safe), and commopt imports it lazily.
_PRELOAD = ["torch", "torch.distributed", "torch.distributed.fsdp", "torch.distributed.tensor", "torch.nn.parallel",
            "commopt.comm", "commopt.comm.compression", "commopt.comm.fsdp"]


def _context():
    """The forkserver context, the server started (or restarted, should it have died) with one
    OpenMP thread: torch's import otherwise starts a BLAS thread, and a process with threads must not
    fork. The variable is set only while the server starts; pytest's own environment is left as it is."""
    from multiprocessing import forkserver

    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(_PRELOAD)
    saved = os.environ.get("OMP_NUM_THREADS")
    os.environ["OMP_NUM_THREADS"] = "1"
    try:
        forkserver.ensure_running()
    finally:
        if saved is None:
            del os.environ["OMP_NUM_THREADS"]
        else:
            os.environ["OMP_NUM_THREADS"] = saved
    return ctx


def _rank_main(rank: int, world: int, store_path: str, tasks, results, env: dict) -> None:
    # pytest's environment as it is now (a spawned rank's), not the forkserver's from its start.
    os.environ.clear()
    os.environ.update(env)
    os.environ["OMP_NUM_THREADS"] = "1"
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    try:
        store = dist.FileStore(store_path, world)
        # A short backend timeout: a test that leaves a collective half-done fails in minutes, not 30.
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world, timeout=timedelta(seconds=90))
    except BaseException as exc:  # noqa: BLE001 - the pool starts its ranks again (see RankPool._await_ready)
        results.put((rank, "init-failed", f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"))
        return
    results.put((rank, "ready", None))
    while True:
        task = tasks.get()
        if task is None:
            break
        fn, args, kwargs = task
        try:
            value = fn(*args, **kwargs)
            results.put((rank, "ok", value))
        except BaseException as exc:  # noqa: BLE001 - reported to pytest with the traceback
            results.put((rank, "err", f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"))
    from commopt.comm import destroy

    destroy()
    dist.destroy_process_group()


class RankPool:
    """``world`` spawned ranks with an initialised gloo WORLD group."""

    def __init__(self, world: int):
        self.world = world
        self._start()

    def _start(self) -> None:
        self._ready: set[int] = set()
        ctx = _context()
        self._dir = tempfile.mkdtemp(prefix="commopt-pool-")
        store = os.path.join(self._dir, "store")
        self._tasks = [ctx.Queue() for _ in range(self.world)]
        self._results = ctx.Queue()
        env = dict(os.environ)
        self._procs = [ctx.Process(target=_rank_main, args=(r, self.world, store, self._tasks[r], self._results, env),
                                   daemon=True, name=f"rank{r}") for r in range(self.world)]
        for p in self._procs:
            p.start()

    def _await_ready(self, attempts: int = 3, guard: float = 120.0) -> None:
        """Wait until every rank has its WORLD group, starting the ranks again when one failed to
        make it (no test code has run yet). Gloo's full-mesh connect, rarely, fails at once with
        "Connection closed by peer" when a pool starts right after the one it replaces was killed
        (forked ranks start within milliseconds of the kill; spawned ones took seconds)."""
        for attempt in range(attempts):
            deadline = time.monotonic() + guard
            failed: dict[int, str] = {}
            while len(self._ready) < self.world and not failed:
                dead = [p.name for r, p in enumerate(self._procs) if r not in self._ready and not p.is_alive()]
                if dead:
                    failed[-1] = f"processes died while starting: {dead}"
                    break
                if time.monotonic() > deadline:
                    failed[-1] = f"not started within {guard:.0f} s"
                    break
                try:
                    rank, status, value = self._results.get(timeout=0.5)
                except queue.Empty:
                    continue
                if status == "ready":
                    self._ready.add(rank)
                else:
                    failed[rank] = value
            if not failed:
                return
            self.restart()
            if attempt == attempts - 1:
                detail = "".join(f"\n--- rank {r} ---\n{e}" for r, e in sorted(failed.items()))
                raise PoolTimeout(f"a pool of {self.world} ranks did not start in {attempts} attempts:{detail}")

    def run(self, fn: Callable, *args: Any, timeout: float = 60.0, per_rank: list | None = None,
            allow_dead: bool = False, **kwargs: Any) -> list[Any]:
        """Run ``fn(*args, **kwargs)`` on every rank; return the per-rank results in rank order.

        Args:
            fn: a module-level function (shipped by reference).
            timeout: wall-clock guard in seconds for all ranks together.
            per_rank: optional list of per-rank argument tuples appended to ``args``.
            allow_dead: a rank may die (fault-injection tests): its result is ``None`` and the
                survivors' results are still collected; the pool is replaced afterwards.
        """
        self._await_ready()
        for r in range(self.world):
            extra = tuple(per_rank[r]) if per_rank is not None else ()
            self._tasks[r].put((fn, args + extra, kwargs))
        out: dict[int, Any] = {}
        errors: dict[int, str] = {}
        deadline = time.monotonic() + timeout
        while len(out) + len(errors) < self.world:
            left = deadline - time.monotonic()
            dead = [p.name for p in self._procs if not p.is_alive()]
            if allow_dead and dead and left > 0:
                alive = {r for r, p in enumerate(self._procs) if p.is_alive()}
                if alive <= set(out) | set(errors):
                    for r in set(range(self.world)) - alive - set(out) - set(errors):
                        out[r] = None
                    self.restart()
                    break
                dead = []
            if left <= 0 or dead:
                missing = sorted(set(range(self.world)) - set(out) - set(errors))
                self.restart()
                why = f"processes died: {dead}" if dead else f"did not finish within {timeout:.0f} s"
                detail = "".join(f"\n--- rank {r} ---\n{e}" for r, e in sorted(errors.items()))
                raise PoolTimeout(f"{fn.__name__}: ranks {missing} {why}{detail}")
            try:
                rank, status, value = self._results.get(timeout=min(left, 0.5))
            except queue.Empty:
                continue
            (out if status == "ok" else errors)[rank] = value
        if errors:
            self.restart()
            detail = "".join(f"\n--- rank {r} ---\n{e}" for r, e in sorted(errors.items()))
            raise RankFailure(f"{fn.__name__} failed on ranks {sorted(errors)}:{detail}")
        return [out[r] for r in range(self.world)]

    def restart(self) -> None:
        self.close(graceful=False)
        self._start()

    def threads(self) -> int:
        """The most OS threads any rank process holds (Linux's /proc; 0 where it cannot be read)."""
        counts = [0]
        for p in self._procs:
            try:
                counts.append(len(os.listdir(f"/proc/{p.pid}/task")))
            except OSError:
                pass
        return max(counts)

    def recycle(self, max_threads: int) -> bool:
        """Replace the ranks when one holds more than ``max_threads`` threads; True if it did.

        Every gloo process group keeps a polling loop thread and two worker threads, and an idle
        loop still costs CPU (200 idle groups: about a third of a core per process). A kept pool
        accumulates the groups of every test it serves, so on 2 cores the suite would slow down as
        it runs; fresh processes between tests start from none.
        """
        if self.threads() <= max_threads:
            return False
        self.restart()
        return True

    def close(self, graceful: bool = True) -> None:
        if graceful:
            for q in self._tasks:
                q.put(None)
            for p in self._procs:
                p.join(10)
        for p in self._procs:
            if p.is_alive():
                p.kill()
                p.join(5)
        for q in self._tasks + [self._results]:
            q.close()
            q.cancel_join_thread()
        shutil.rmtree(self._dir, ignore_errors=True)
