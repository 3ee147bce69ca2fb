"""Shared fixtures: the rank pools of docs/architecture.md section 9 (see ``_pool.py``)."""

from __future__ import annotations

import pytest
from _pool import RankPool

_POOLS: dict[int, RankPool] = {}


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
