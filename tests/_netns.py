"""What the emulated cluster's tests share: ``needs_netns`` (their skip marker: root and iproute2),
``rank_lines`` (the launcher's output, by rank) and ``finish`` (a launcher's exit, bounded)."""

from __future__ import annotations

import shutil
import subprocess

import pytest

from commopt.bench import cluster as cl

__all__ = ["needs_netns", "rank_lines", "finish"]


def _have_netns() -> bool:
    with open("/proc/self/status", encoding="ascii") as f:
        caps = cl.parse_cap_eff(f.read())
    return not cl.missing_requirements(caps, shutil.which("ip"), shutil.which("tc"))


needs_netns = pytest.mark.skipif(not _have_netns(),
                                 reason="needs root (CAP_NET_ADMIN, CAP_SYS_ADMIN) and iproute2")


def rank_lines(out: str) -> dict[int, list[str]]:
    """The launcher's ``[rank k] ...`` lines, by rank, the prefix removed."""
    lines: dict[int, list[str]] = {}
    for line in out.splitlines():
        if line.startswith("[rank "):
            head, _, rest = line.partition("] ")
            lines.setdefault(int(head[len("[rank "):]), []).append(rest)
    return lines


def finish(proc: subprocess.Popen, timeout: float) -> tuple[int, str, str]:
    """The launcher's exit code, stdout and stderr; killed, and the test failed, past ``timeout``."""
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate()
        pytest.fail(f"launcher did not finish within {timeout} s\nstdout:\n{out}\nstderr:\n{err}")
    return proc.returncode, out, err
