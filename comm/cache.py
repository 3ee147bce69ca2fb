"""A typed cache of the runtime context (``commopt.comm.runtime``): a dict guarded by a lock.

It lives below the algorithms so that a :class:`~commopt.comm.algorithms.Call` can carry the one
the algorithms keep their long-lived state in (INA sessions) without the algorithms importing the
runtime.
"""

from __future__ import annotations

import threading
from typing import Generic, TypeVar

__all__ = ["Cache"]

K = TypeVar("K")
V = TypeVar("V")


class Cache(Generic[K, V]):
    """One typed cache of the context: a dict guarded by the context's lock.

    Entries with a ``close()`` method (INA sessions) are closed by :meth:`Context.destroy`; others
    are dropped.
    Compound updates take :attr:`lock` around several calls (it is re-entrant).
    """

    def __init__(self, lock: threading.RLock):
        self._lock = lock
        self._data: dict[K, V] = {}

    @property
    def lock(self) -> threading.RLock:
        """The lock every call takes (the context's one lock), for compound updates."""
        return self._lock

    def get(self, key: K) -> V | None:
        with self._lock:
            return self._data.get(key)

    def put(self, key: K, value: V) -> V | None:
        """Store ``value``; returns the entry it replaced (the caller closes it if it must)."""
        with self._lock:
            old = self._data.get(key)
            self._data[key] = value
            return old

    def pop(self, key: K, expected: V | None = None) -> V | None:
        """Remove ``key`` (only if it still holds ``expected``, when given); returns what was removed."""
        with self._lock:
            value = self._data.get(key)
            if value is None or (expected is not None and value is not expected):
                return None
            del self._data[key]
            return value

    def values(self) -> list[V]:
        with self._lock:
            return list(self._data.values())

    def _drain(self) -> list[V]:
        with self._lock:
            values, self._data = list(self._data.values()), {}
            return values
