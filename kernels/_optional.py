"""The one gate for the optional dependencies of :mod:`commopt.kernels` (numba, CuPy).

Importing commopt must never fail because numba or CuPy is missing or broken (docs/architecture.md section 5.7), and
importing either costs hundreds of milliseconds, so each dependency is imported lazily, once, on
first use. The gate stores the outcome: ``available`` and, when the import failed, the error, so a
forced backend can say exactly why it cannot run. These two gates and the compiled-module caches of
``cuda.py`` are the only module-level state of the package.
"""

from __future__ import annotations

import importlib
import threading
from types import ModuleType
from typing import Callable

__all__ = ["Gate", "NUMBA", "CUPY"]


class Gate:
    """Lazily imports an optional module and remembers whether that worked.

    Args:
        name: the module to import.
        probe: an optional check run once after a successful import; it returns ``None`` when the
            module is usable, or a reason string (CuPy imports without a GPU, but cannot launch).
    """

    def __init__(self, name: str, probe: Callable[[ModuleType], str | None] | None = None) -> None:
        self.name = name
        self._probe = probe
        self._lock = threading.Lock()
        self._done = False
        self._module: ModuleType | None = None
        self._error: str | None = None

    def _load(self) -> None:
        with self._lock:
            if self._done:
                return
            try:
                module = importlib.import_module(self.name)
            except Exception as exc:  # any import failure (ImportError, a broken binary, OSError)
                self._error = f"{type(exc).__name__}: {exc}"
            else:
                reason = None
                if self._probe is not None:
                    try:
                        reason = self._probe(module)
                    except Exception as exc:  # a driver error while probing means "not usable"
                        reason = f"{type(exc).__name__}: {exc}"
                if reason is None:
                    self._module = module
                else:
                    self._error = reason
            self._done = True

    @property
    def available(self) -> bool:
        """Whether the module imported (and passed its probe)."""
        self._load()
        return self._module is not None

    @property
    def error(self) -> str | None:
        """Why the module is not available, or ``None`` when it is."""
        self._load()
        return self._error

    @property
    def module(self) -> ModuleType:
        """The imported module; raises ``ImportError`` with the stored reason when unavailable."""
        self._load()
        if self._module is None:
            raise ImportError(f"{self.name} is not available: {self._error}")
        return self._module


def _probe_cupy(cupy: ModuleType) -> str | None:
    count = cupy.cuda.runtime.getDeviceCount()
    return None if count > 0 else "CuPy imported but sees no CUDA device"


NUMBA = Gate("numba")
CUPY = Gate("cupy", _probe_cupy)
