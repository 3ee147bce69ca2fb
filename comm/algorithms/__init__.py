"""commopt.comm.algorithms: every algorithm, one object each (docs/architecture.md section 5.2).

``flat``, ``hierarchical``, ``leader``, ``2d`` (all-to-all) and ``ina``; each says which
topologies and collectives it ``supports``, the group ``roles`` it needs, the ``traffic`` it puts
on every link, its ``cost`` under a level model, and ``start``s a prepared call. Look one up with
:func:`get`; :func:`candidates` lists those ``auto`` weighs for a collective.
"""

from __future__ import annotations

from .base import ALGORITHM_FACTORS, COLLECTIVES, SWITCH, Algorithm, Call, Traffic
from .flat import FLAT
from .hierarchical import HIERARCHICAL
from .ina import INA
from .leader import LEADER
from .two_d import TWO_D

__all__ = ["Algorithm", "Call", "Traffic", "SWITCH", "COLLECTIVES", "ALGORITHM_FACTORS", "ALGORITHMS", "get",
           "candidates", "names"]

ALGORITHMS: dict[str, Algorithm] = {a.name: a for a in (FLAT, HIERARCHICAL, LEADER, TWO_D, INA)}

# What ``auto`` weighs, in order of preference on a tie (ina needs a switch: never automatic).
_AUTO = ("flat", "hierarchical", "leader", "2d")


def get(name: str) -> Algorithm:
    """The algorithm called ``name``; ``ValueError`` listing the known ones otherwise."""
    algo = ALGORITHMS.get(name)
    if algo is None:
        raise ValueError(f"unknown algorithm {name!r}; known: {sorted(ALGORITHMS)}")
    return algo


def names(collective: str) -> list[str]:
    """Every algorithm that implements ``collective``, in registry order."""
    return [n for n, a in ALGORITHMS.items() if collective in a.collectives]


def candidates(collective: str) -> list[str]:
    """The algorithms ``auto`` weighs for ``collective``."""
    return [n for n in _AUTO if collective in ALGORITHMS[n].collectives]
