"""``commopt-bench`` and ``Topology.from_env()`` under ``mpirun`` (issue 2; docs/faults.md rows 31, 38).

Marker ``mpi``: skips without mpirun/mpi4py.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
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
    """docs/faults.md row 31: a failure on one rank aborts the whole job promptly (no finalize deadlock)."""
    start = time.monotonic()
    res = _mpirun(2, "--sizes", "1K", "--fail-rank", "1", timeout=120)
    assert res.returncode != 0
    assert "failure injected by --fail-rank" in res.stderr
    # Promptly: the whole job ends in seconds (about 2 s here); the subprocess guard above is only
    # the hang backstop, so this bound must sit well inside it to mean anything.
    assert time.monotonic() - start < 30


# One rank of a placement test: rendezvous through a FileStore (no port), then the layout that
# from_env() reads from MPI's real placement; with --split, also from MPI's shared-memory split
# (the launcher's local-rank variables removed, mpi4py imported and initialised).
_PLACEMENT_RANK = """
import json, os, sys
from datetime import timedelta
import torch.distributed as dist
from commopt.comm import Topology, destroy

store, split = sys.argv[1], sys.argv[2] == "--split"
rank, size = int(os.environ["PMI_RANK"]), int(os.environ["PMI_SIZE"])
local = int(os.environ["MPI_LOCALRANKID"])
dist.init_process_group("gloo", store=dist.FileStore(store, size), rank=rank, world_size=size,
                        timeout=timedelta(seconds=60))
env = Topology.from_env(timeout=30)
out = {"rank": rank, "env": env.layout, "detect": Topology.detect(timeout=30).layout, "local": local,
       "local_rank": env.local_rank}
if split:
    del os.environ["MPI_LOCALRANKID"], os.environ["MPI_LOCALNRANKS"]
    from mpi4py import MPI  # noqa: F401 - initialises MPI: from_env() then asks MPI's own split
    out["split"] = Topology.from_env(timeout=30).layout
with open(f"{store}.{rank}.json", "w") as f:  # a file per rank: mpirun interleaves the ranks' stdout
    json.dump(out, f)
destroy()
dist.destroy_process_group()
"""


@pytest.mark.parametrize("hosts,n,layout,split", [
    (None, 2, "0,1", "0,1"),  # mpirun's default: every rank on this host
    # Hydra launches one proxy per -hosts entry; localhost and 127.0.0.1 both resolve to this machine
    # and need no ssh, so they stand for two nodes a and b.
    ("localhost:2,127.0.0.1:2", 4, "0,1;2,3", None),  # node by node
    ("localhost:1,127.0.0.1:1", 4, "0,2;1,3", None),  # round robin: not what local sizes alone suggest
    ("localhost:1,127.0.0.1:2", 4, "0,3;1,2", None),  # 0 -> a, 1, 2 -> b, 3 -> a
], ids=["default", "node-by-node", "round-robin", "irregular"])
def test_mpirun_from_env_gives_the_real_placement(tmp_path, hosts, n, layout, split):
    """docs/faults.md row 38: under a real mpirun, Topology.from_env() and detect() give MPI's placement on
    every rank, never a node-by-node guess; every rank's local rank is MPI's (MPI_LOCALRANKID)."""
    script = tmp_path / "placement_rank.py"
    script.write_text(_PLACEMENT_RANK)
    cmd = ["mpirun"] + (["-hosts", hosts] if hosts else []) + ["-n", str(n), sys.executable, str(script),
                                                              str(tmp_path / "store"), "--split" if split else "-"]
    # docs/architecture.md section 10: these ranks talk over loopback only
    env = dict(os.environ, GLOO_SOCKET_IFNAME="lo")
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=150, stdin=subprocess.DEVNULL, env=env)
    assert res.returncode == 0, res.stdout + res.stderr
    reports = [json.loads(p.read_text()) for p in sorted(tmp_path.glob("store.*.json"))]
    assert sorted(r["rank"] for r in reports) == list(range(n)), res.stdout + res.stderr
    for r in reports:
        assert r["env"] == r["detect"] == layout, r
        assert r["local_rank"] == r["local"], r
        if split:
            assert r["split"] == split, r  # one machine: MPI's shared memory spans every rank
