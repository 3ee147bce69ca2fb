"""The progress bar of every long benchmark (docs/architecture.md section 5.9): one helper, so they all behave alike.

A bar is drawn on stderr by rank 0 only, and only where someone watches: when stderr is a terminal.
CI logs and redirected runs stay quiet. ``COMMOPT_PROGRESS=1`` forces the bar on, ``=0`` off:
``commopt-bench cluster`` sets ``1`` for its ranks when its own stderr is a terminal (a rank's
stderr is a pipe that the launcher copies to the terminal, redrawing the bar in place).
"""

from __future__ import annotations

import os
import sys
from typing import Callable

from tqdm import tqdm

__all__ = ["progress", "progress_enabled", "interleaved"]


def progress_enabled(rank: int = 0) -> bool:
    """Whether :func:`progress` draws for ``rank`` (see the module docstring)."""
    if rank != 0:
        return False
    setting = os.environ.get("COMMOPT_PROGRESS", "").strip()
    if setting in ("0", "1"):
        return setting == "1"
    isatty = getattr(sys.stderr, "isatty", None)
    return bool(isatty and isatty())


def progress(total: int, desc: str, *, rank: int = 0, unit: str = "it") -> tqdm:
    """A tqdm bar of ``total`` steps on stderr, or a disabled one (same methods, draws nothing).

    Args:
        total: the number of ``update()`` calls the benchmark will make.
        desc: what it counts, e.g. ``"sweep"``.
        rank: this process's rank; only rank 0 draws.
        unit: the name of one step.
    """
    # leave=False: the bar is gone when the table is printed; the table is what stays on screen.
    return tqdm(total=total, desc=desc, unit=unit, file=sys.stderr, leave=False,
                disable=not progress_enabled(rank), dynamic_ncols=True)


def interleaved(runs: list, steps: int, step: Callable[[object, int], None], what: str, *, rank: int = 0) -> None:
    """``step(run, i)`` for every run at every step ``i``, one step of each in turn, the order rotated
    every step: a load spike on a shared machine hits every run alike, so the ratios between them stay
    honest (the training benchmarks' side-by-side runs)."""
    bar = progress(steps, f"training {len(runs)} {what}", rank=rank, unit="step")
    for i in range(steps):
        k = i % len(runs)
        for run in runs[k:] + runs[:k]:
            step(run, i)
        bar.update()
    bar.close()
