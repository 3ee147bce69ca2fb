"""Exceptions of commopt.

Every message names the operation, its sequence number, the ranks and the shapes/dtypes involved,
and says what to do (docs/architecture.md section 6.2, docs/faults.md). Errors raised inside the comm engine's worker
threads travel through futures; DDP wraps an asynchronous hook failure in a ``RuntimeError`` whose text keeps the
``str()`` of the original, so every subclass puts its class name at the start of its message.
"""

from __future__ import annotations

__all__ = [
    "CommError",
    "CollectiveMismatchError",
    "CommTimeoutError",
    "NonFiniteError",
    "TopologyError",
]


class CommError(RuntimeError):
    """Base class of commopt's communication errors.

    Args:
        message: what went wrong and what to do.
        op: the operation ("all_reduce", "hierarchical/reduce_scatter", ...).
        seq: the operation's sequence number on its group, when known.
        ranks: the ranks involved (for a timeout: the ones that did not arrive, when known).
    """

    def __init__(self, message: str, *, op: str | None = None, seq: int | None = None,
                 ranks: list[int] | None = None):
        self.op = op
        self.seq = seq
        self.ranks = list(ranks) if ranks is not None else None
        where = []
        if op is not None:
            where.append(f"op={op}")
        if seq is not None:
            where.append(f"seq={seq}")
        if ranks is not None:
            where.append(f"ranks={self.ranks}")
        prefix = f"{type(self).__name__}"
        if where:
            prefix += f" [{', '.join(where)}]"
        self.message = message
        super().__init__(f"{prefix}: {message}")

    def __reduce__(self):
        # Keep the structured fields when the error crosses a process boundary (test pools, spawn).
        return (_rebuild, (type(self), self.message, self.op, self.seq, self.ranks))


def _rebuild(cls, message, op, seq, ranks):
    return cls(message, op=op, seq=seq, ranks=ranks)


class CollectiveMismatchError(CommError):
    """Ranks issued different collectives (op, shape, dtype, device or algorithm) at the same point."""


class CommTimeoutError(CommError):
    """A collective did not complete in time: a rank never arrived, died, or the link stalled."""


class NonFiniteError(CommError):
    """NaN or Inf found in a tensor where ``check_finite=True`` asked for an error."""


class TopologyError(CommError):
    """The topology is invalid, inconsistent across ranks, or unsuitable for the algorithm."""
