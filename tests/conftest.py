"""Shared fixtures: the rank pools of docs/architecture.md section 9 (see ``_pool.py``)."""

from __future__ import annotations

import pytest
from _pool import RankPool

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
