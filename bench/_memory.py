"""Peak memory of one benchmark run, measured beside its step time (issue 38, item 7).

hpZ, DiLoCo's backups and the rings' buffers trade memory for bytes on the wire, so every end-to-end
benchmark prints each run's peak beside its speed. One helper, so they all measure alike:

- on CUDA, ``torch.cuda.max_memory_allocated`` of the run's device, its peak reset before each step;
- on CPU, the process's peak resident set (``VmHWM`` in ``/proc/self/status``), reset before each step by
  writing ``5`` to ``/proc/self/clear_refs`` (Linux 4.0 and later). The runs of a benchmark are
  interleaved step by step in one process, so a lifetime peak (``getrusage``) would give every run the
  largest; resetting the high-water mark per step gives each run its own. Where the reset is not allowed,
  the reading is the lifetime peak and :func:`peak_kind` says so.

A step's peak is the process's, model and optimizer included: the difference between two runs is what a
technique costs.
"""

from __future__ import annotations

import torch

__all__ = ["PeakMemory", "peak_kind"]

_STATUS = "/proc/self/status"
_CLEAR_REFS = "/proc/self/clear_refs"


def _hwm_bytes() -> int | None:
    try:
        with open(_STATUS) as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def _reset_hwm() -> bool:
    try:
        with open(_CLEAR_REFS, "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def peak_kind(device: torch.device | str) -> str:
    """What :class:`PeakMemory` reads on ``device``: ``"cuda allocated"``, ``"rss"`` (reset per step) or
    ``"rss, lifetime"`` (the reset was refused: every run shows the process's largest so far)."""
    if torch.device(device).type == "cuda":
        return "cuda allocated"
    return "rss" if _reset_hwm() else "rss, lifetime"


class PeakMemory:
    """Per-run peak memory: ``start()`` before a step, ``stop(run)`` after it; ``peak(run)`` is the largest.

    Args:
        device: the device the runs train on (CUDA: allocated bytes; anything else: the process's RSS).
    """

    def __init__(self, device: torch.device | str = "cpu") -> None:
        self.device = torch.device(device)
        self._peaks: dict[str, int] = {}

    def start(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        else:
            _reset_hwm()

    def stop(self, run: str) -> int:
        """Record the peak since :meth:`start` for ``run``; returns it in bytes (0 where unreadable)."""
        if self.device.type == "cuda":
            value = int(torch.cuda.max_memory_allocated(self.device))
        else:
            value = _hwm_bytes() or 0
        self._peaks[run] = max(self._peaks.get(run, 0), value)
        return value

    def peak(self, run: str) -> int:
        """The largest peak recorded for ``run`` (bytes; 0 if none was)."""
        return self._peaks.get(run, 0)

    def mib(self, run: str) -> float:
        return self.peak(run) / 2**20
