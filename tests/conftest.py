"""Shared fixtures: the rank pools of docs/architecture.md section 9 (see ``_pool.py``)."""

from __future__ import annotations

import importlib.util
import os

import pytest
from _pool import RankPool

# The independent oracles (README, "Tests"): torchft's DiLoCo, torchtitan's Trainer, torch's testing
# models (expecttest). Locally their tests skip without them; in CI (CI=true) a missing one ends the run
# at once, since an oracle test that skips in CI checks nothing.
_ORACLES = ("torchft", "torchtitan", "expecttest")


def pytest_sessionstart(session):
    if os.environ.get("CI", "").lower() in ("1", "true", "yes"):
        missing = [m for m in _ORACLES if importlib.util.find_spec(m) is None]
        if missing:
            raise pytest.UsageError(f"CI: the oracles {missing} are not installed, so their tests would skip; install "
                                    f"them as the README's test section says (pip install -e '.[oracles]' && pip "
                                    f"install --no-deps torchtitan==0.3.0)")

_POOLS: dict[int, RankPool] = {}
# Threads a kept rank process may hold between tests before it is replaced (see RankPool.recycle):
# about 35 gloo process groups.
_MAX_THREADS = 120


@pytest.fixture(scope="session")
def ranks():
    """``ranks(world_size, fn, *args, timeout=60, **kwargs)`` runs ``fn`` on every rank of a kept pool.

    Returns the per-rank results in rank order; re-raises a rank's failure with its traceback and
    fails (naming the ranks) when the wall-clock guard passes.
    """

    def run(world: int, fn, *args, **kwargs):
        pool = _POOLS.get(world)
        if pool is None:
            pool = _POOLS[world] = RankPool(world)
        return pool.run(fn, *args, **kwargs)

    yield run
    for pool in _POOLS.values():
        pool.close()
    _POOLS.clear()


@pytest.fixture(autouse=True)
def _recycle_heavy_pools():
    """After each test, replace a kept pool whose ranks have accumulated many process groups (their
    idle polling threads would tax every later test on a 2-core machine); only between tests, so a
    test that calls ``ranks`` twice keeps its processes."""
    yield
    for pool in _POOLS.values():
        pool.recycle(_MAX_THREADS)


# The longest files first: pytest-xdist (``--dist loadfile``) hands whole files to its workers in
# collection order, so the run ends soon after the work does instead of waiting for a long file that
# started last (longest processing time first). Per-file totals from ``--durations=0`` of a clean-clone CI run
# (stop 46, 1177 s of tests in 600 s on two workers; test_elastic_diloco.py 81 s since its workers fork).
_LONG_FIRST = ("test_faults.py", "test_elastic_diloco.py", "test_fsdp_faults.py", "test_fsdp.py", "test_cluster.py",
               "test_torchtitan.py", "test_collectives.py", "test_diloco.py", "test_compression_faults.py",
               "test_mpi.py", "test_kernels.py", "test_compression.py", "test_fsdp_recipe.py", "test_elastic_dp.py",
               "test_cluster_faults.py", "test_elastic_coordinator.py", "test_plot.py", "test_ina_procs.py",
               "test_integrations.py", "test_synth_exec.py", "test_compile.py", "test_pipeline_parallel.py")


def pytest_collection_modifyitems(config, items):
    order = {name: i for i, name in enumerate(_LONG_FIRST)}
    items.sort(key=lambda item: order.get(item.path.name, len(order)))  # stable: each file's own order kept
