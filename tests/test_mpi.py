"""``commopt-bench`` under ``mpirun`` (issue 2; FAULTS row 31). Marker ``mpi``: skips without mpirun/mpi4py."""

from __future__ import annotations

import importlib.util
import shutil
import subprocess
import time

import pytest

pytestmark = [
    pytest.mark.mpi,
    pytest.mark.skipif(shutil.which("mpirun") is None or importlib.util.find_spec("mpi4py") is None,
                       reason="needs mpirun and mpi4py (pip install 'commopt[mpi]')"),
]


def _mpirun(n: int, *args: str, timeout: float = 180) -> subprocess.CompletedProcess:
    return subprocess.run(["mpirun", "-n", str(n), "commopt-bench", "collectives", *args],
                          capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL)


def test_mpirun_collectives_sweep_is_correct():
    res = _mpirun(4, "--sizes", "1K,64K")
    assert res.returncode == 0, res.stdout + res.stderr
    rows = [line.split() for line in res.stdout.splitlines() if line and not line.startswith("#")]
    assert len(rows) == 4  # 2 sizes x flat, hierarchical
    assert {r[4] for r in rows} == {"flat", "hierarchical"}
    assert all(r[8] == "0" for r in rows)  # the #wrong column
    assert "world_size=4" in res.stdout


def test_mpirun_failure_on_one_rank_ends_the_job():
    """FAULTS row 31: a failure on one rank aborts the whole job promptly (no finalize deadlock)."""
    start = time.monotonic()
    res = _mpirun(2, "--sizes", "1K", "--fail-rank", "1", timeout=120)
    assert res.returncode != 0
    assert "failure injected by --fail-rank" in res.stderr
    assert time.monotonic() - start < 120
