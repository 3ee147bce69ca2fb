"""Fresh rank processes for the framework tests (Lightning, transformers, torchtitan), which need
processes of their own rather than a pool's (docs/architecture.md section 9.1): forked from the rank
pool's forkserver (torch already imported; the framework is imported in the rank).

:func:`run_spawned` starts ``world`` processes of ``entry`` and collects what each puts on the results
queue: ``(rank, "ok", bytes of torch.save)`` or ``(rank, "err", traceback)``. A hang fails naming the
ranks that did not finish, a dead rank names its exit code, a rank's exception is re-raised with its
traceback; every process is killed on the way out.
"""

from __future__ import annotations

import io
import queue
import time
from typing import Callable

import torch

__all__ = ["run_spawned"]


def run_spawned(entry: Callable, args_of: Callable[[int], tuple], world: int, timeout: float, what: str) -> list:
    """Run ``entry(*args_of(rank), results)`` in ``world`` spawned processes; per-rank results in rank order."""
    from _pool import _context

    ctx = _context()
    results = ctx.Queue()
    procs = [ctx.Process(target=entry, args=(*args_of(r), results), daemon=True, name=f"rank{r}")
             for r in range(world)]
    for p in procs:
        p.start()
    out, errors = {}, {}
    deadline = time.monotonic() + timeout
    try:
        while len(out) + len(errors) < world:
            try:
                rank, status, value = results.get(timeout=0.5)
            except queue.Empty:
                missing = sorted(set(range(world)) - set(out) - set(errors))
                dead = [r for r in missing if not procs[r].is_alive()]
                if dead:
                    raise AssertionError(f"{what}: ranks {dead} died (exit codes "
                                         f"{[procs[r].exitcode for r in dead]})") from None
                if time.monotonic() > deadline:
                    raise AssertionError(f"{what}: ranks {missing} did not finish within {timeout:.0f} s") from None
                continue
            if status == "ok":
                out[rank] = torch.load(io.BytesIO(value), weights_only=True)
            else:
                errors[rank] = value
        if errors:
            detail = "".join(f"\n--- rank {r} ---\n{e}" for r, e in sorted(errors.items()))
            raise AssertionError(f"{what} failed on ranks {sorted(errors)}:{detail}")
        for p in procs:
            p.join(30)
        return [out[r] for r in range(world)]
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join(5)
        results.close()
        results.cancel_join_thread()
