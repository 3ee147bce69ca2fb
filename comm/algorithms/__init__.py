"""commopt.comm.algorithms: every algorithm, one object each, and the registry (docs/architecture.md section 5.2).

``flat``, ``hierarchical``, ``leader``, ``2d`` (all-to-all), ``ina``, ``rail`` and ``synth``; each says which
topologies and collectives it ``supports``, the group ``roles`` it needs, the ``traffic`` it puts
on every link, its ``cost`` under a level model, and ``start``s a prepared call. Its traits
(``automatic``, ``scope``, ``codec_phase``, ``flat_on_one_level``: :class:`Algorithm`) say where
it may run. The registry is the only list of algorithm names: every caller that accepts an
``algorithm=`` string asks :func:`get`, :func:`names` or :func:`candidates`, so an algorithm added
with :func:`register` runs through ``all_reduce``, the DDP hook, ``auto``, the simulator and
``commopt-bench collectives`` without another file changing (docs/architecture.md section 7).

The group role names live in :mod:`.roles`; the transport pieces an algorithm builds its phases
from are re-exported here (``then_finish``, ``flat_future``, ``pipelined``, ``deadline_of``,
``remaining``, the exchanges).
"""

from __future__ import annotations

from . import roles
from ._transport import (
    deadline_of,
    exchange_all_gather,
    exchange_reduce_scatter,
    flat_future,
    pairwise,
    pipelined,
    remaining,
    then_finish,
)
from .base import (
    ALGORITHM_FACTORS,
    ALL_PHASES,
    COLLECTIVES,
    GROUP_SCOPE,
    INTER_PHASE,
    RAIL_SCOPE,
    SWITCH,
    Algorithm,
    Call,
    Encoded,
    Traffic,
)
from .flat import FLAT
from .hierarchical import HIERARCHICAL
from .ina import INA
from .leader import LEADER
from .rail import RAIL
from .synth import SYNTH
from .two_d import TWO_D

__all__ = ["Algorithm", "Call", "Traffic", "Encoded", "SWITCH", "COLLECTIVES", "ALGORITHM_FACTORS", "ALGORITHMS",
           "GROUP_SCOPE", "RAIL_SCOPE", "ALL_PHASES", "INTER_PHASE", "AUTO", "roles", "register", "get", "names",
           "candidates", "then_finish", "flat_future", "pipelined", "deadline_of", "remaining", "pairwise",
           "exchange_reduce_scatter", "exchange_all_gather"]

#: The name that asks the cost model to choose; never an algorithm's own.
AUTO = "auto"

#: Every algorithm by name, in registration order (``auto`` breaks ties in this order). Filled by
#: :func:`register` only, at import time: the registrations are the same on every rank as long as
#: every rank imports the same modules (the rank processes of a job run the same program).
ALGORITHMS: dict[str, Algorithm] = {}


def register(algorithm: Algorithm) -> Algorithm:
    """Add ``algorithm`` to the registry under ``algorithm.name`` and return it.

    Call it once per process, at import time of the module that defines the algorithm, on every
    rank (a rank that lacks it refuses the name; ranks that choose differently with ``auto`` would
    issue different collectives). Registering the same object again is a no-op (a module imported
    twice).

    Raises:
        TypeError: ``algorithm`` is not an :class:`Algorithm` instance.
        ValueError: its name is empty or ``"auto"``, another algorithm holds the name, or a trait
            has a value the callers do not know.
    """
    if not isinstance(algorithm, Algorithm):
        hint = " (a class: register an instance)" if isinstance(algorithm, type) else ""
        raise TypeError(f"algorithms.register: expected an Algorithm instance, got "
                        f"{type(algorithm).__name__} {algorithm!r}{hint}; subclass "
                        f"commopt.comm.algorithms.Algorithm")
    name = algorithm.name
    if not isinstance(name, str) or not name or name == AUTO:
        raise ValueError(f"algorithms.register: {type(algorithm).__name__} needs a name of its own (a non-empty "
                         f"string other than {AUTO!r}), got {name!r}; set the class attribute name")
    held = ALGORITHMS.get(name)
    if held is algorithm:
        return algorithm
    if held is not None:
        raise ValueError(f"algorithms.register: the name {name!r} is already registered to {held!r}; give "
                         f"{type(algorithm).__name__} another name")
    unknown = [c for c in algorithm.collectives if c not in COLLECTIVES]
    if unknown or not algorithm.collectives:
        raise ValueError(f"algorithms.register: {name!r} declares collectives {tuple(algorithm.collectives)}; "
                         f"it must implement at least one of {COLLECTIVES} and nothing else")
    if algorithm.scope not in (GROUP_SCOPE, RAIL_SCOPE):
        raise ValueError(f"algorithms.register: {name!r} has scope {algorithm.scope!r}; use GROUP_SCOPE or "
                         f"RAIL_SCOPE")
    if algorithm.codec_phase not in (None, ALL_PHASES, INTER_PHASE):
        raise ValueError(f"algorithms.register: {name!r} has codec_phase {algorithm.codec_phase!r}; use None, "
                         f"ALL_PHASES or INTER_PHASE")
    ALGORITHMS[name] = algorithm
    return algorithm


for _algorithm in (FLAT, HIERARCHICAL, LEADER, TWO_D, INA, RAIL, SYNTH):
    register(_algorithm)


def get(name: str) -> Algorithm:
    """The algorithm called ``name``; ``ValueError`` listing the known ones otherwise."""
    algo = ALGORITHMS.get(name)
    if algo is None:
        raise ValueError(f"unknown algorithm {name!r}; known: {sorted(ALGORITHMS)}")
    return algo


def names(collective: str, *, scope: str | None = GROUP_SCOPE, codec: bool = False) -> list[str]:
    """The algorithms that implement ``collective``, in registry order.

    Args:
        collective: one of :data:`COLLECTIVES`.
        scope: only those of this scope (default: reductions over the whole group, what the public
            collectives run); None: any.
        codec: only those that can carry a compressor (``codec_phase`` set).
    """
    return [n for n, a in ALGORITHMS.items() if collective in a.collectives
            and (scope is None or a.scope == scope) and (not codec or a.codec_phase is not None)]


def candidates(collective: str, *, codec: bool = False) -> list[str]:
    """The algorithms ``auto`` weighs for ``collective`` (``automatic`` ones over the whole group;
    with ``codec``, those that can carry a compressor), in registry order: the order of preference
    on a tie."""
    return [n for n in names(collective, codec=codec) if ALGORITHMS[n].automatic]
