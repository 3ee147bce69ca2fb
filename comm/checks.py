"""What every collective checks before anything moves: its arguments, and that the ranks called the
same collective (docs/architecture.md section 3; docs/faults.md).

``validate_same`` exchanges a fingerprint that names the ranks that differ; :func:`agree` is the
cheap check every unvalidated call runs before its payload. Both raise on every rank, so no rank is
left in a collective its peers never entered. Everything that accepts a collective call from a
user (the exact collectives, the compressed all-reduce, the all-to-all, the DDP hook) checks here,
below all of them, so that none imports another for its checks.
"""

from __future__ import annotations

import math
import threading
from typing import Callable

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup, ReduceOp

from . import algorithms
from .engine import wait_work
from .errors import CollectiveMismatchError, CommError, CommTimeoutError
from .runtime import context

__all__ = ["SUPPORTED_DTYPES", "check_group", "check_timeout", "validate_same", "agree", "agreed", "SPLITS_GIVEN",
           "BOTH_SPLITS_GIVEN"]

SUPPORTED_DTYPES = (torch.float64, torch.float32, torch.bfloat16, torch.float16, torch.int64,
                    torch.int32, torch.int16, torch.int8, torch.uint8, torch.bool)
_OPS = {ReduceOp.SUM: "sum", ReduceOp.AVG: "avg", ReduceOp.MAX: "max", ReduceOp.MIN: "min"}


# --------------------------------------------------------------------------------- validation
def _op_name(op) -> str:
    name = _OPS.get(op)
    if name is None:
        raise ValueError(f"reduce op {op} is not supported by commopt; use ReduceOp.SUM, AVG, MAX or MIN")
    return name


def _check_tensor(name: str, t, what: str = "tensor") -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name}: {what} must be a torch.Tensor, got {type(t).__name__}")
    if t.is_sparse:
        raise TypeError(f"{name}: sparse {what} is not supported; call .to_dense() or use torch's "
                        f"sparse all-reduce")
    if t.dtype not in SUPPORTED_DTYPES:
        raise TypeError(f"{name}: dtype {t.dtype} is not supported; supported: "
                        f"{', '.join(str(d) for d in SUPPORTED_DTYPES)}")


def check_group(name: str, group: ProcessGroup | None) -> None:
    """``group`` must be a ProcessGroup or None (WORLD); a name such as ``"WORLD"`` is not one."""
    if group is not None and not isinstance(group, dist.ProcessGroup):
        raise TypeError(f"{name}: group must be a torch.distributed ProcessGroup or None (WORLD), got "
                        f"{type(group).__name__} {group!r}; pass dist.group.WORLD, None or a group from "
                        f"dist.new_group()")


def check_timeout(name: str, timeout) -> float | None:
    """``timeout`` as seconds: None or ``inf`` wait without a bound of commopt's own (the group's
    timeout still applies); anything else must be a positive finite number."""
    if timeout is None:
        return None
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)):
        raise TypeError(f"{name}: timeout must be a number of seconds or None, got {type(timeout).__name__} "
                        f"{timeout!r}")
    if math.isinf(timeout) and timeout > 0:
        return None
    if not timeout > 0:  # also NaN
        raise ValueError(f"{name}: timeout must be a positive number of seconds (or None / inf for no bound "
                         f"of commopt's own), got {timeout!r}")
    return float(timeout)


def _check_op_dtype(name: str, op: str, dtype: torch.dtype) -> None:
    if op == "avg" and not dtype.is_floating_point:
        raise TypeError(f"{name}: ReduceOp.AVG on {dtype} would truncate; reduce with SUM and divide "
                        f"in floating point, or cast to a floating dtype first")


_FINGERPRINT_OPS = {"all_reduce": 1, "reduce_scatter": 2, "all_gather": 3, "all_to_all": 4}
_FIELDS = ("op", "sequence", "algorithm", "reduce op", "dtype", "device", "ndim", "shape", "numel")


def _code(text: str) -> int:
    return int.from_bytes(text.encode()[:7].ljust(7, b"\0"), "little")


def fingerprint(kind: str, tensor: torch.Tensor, *, algorithm: str, op: str, group: ProcessGroup | None) -> list[int]:
    seq = context().next_sequence(group)
    shape_code = hash(tuple(tensor.shape)) & ((1 << 62) - 1)
    return [_FINGERPRINT_OPS.get(kind, 0), seq, _code(algorithm), _code(op), _code(str(tensor.dtype)[6:]),
            _code(tensor.device.type), tensor.dim(), shape_code, tensor.numel()]


def validate_same(kind: str, tensor: torch.Tensor, *, algorithm: str, op: str, group: ProcessGroup | None,
                  extra: str = "", timeout: float | None = None) -> None:
    """Exchange a fingerprint of this collective; ``CollectiveMismatchError`` on every rank if the
    ranks disagree on op, sequence number, algorithm, reduce op, dtype, device or shape.

    Costs one small all-gather (9 int64 per rank) on ``group`` before the collective, on the
    calling thread; always on a CPU tensor so it never depends on the payload's device.
    """
    mine = fingerprint(kind, tensor, algorithm=algorithm, op=op, group=group)
    size = dist.get_world_size(group)
    # NCCL groups only move CUDA tensors; gloo moves both.
    local = torch.tensor(mine, dtype=torch.int64, device=tensor.device if tensor.is_cuda else "cpu")
    gathered = [torch.zeros_like(local) for _ in range(size)]
    arrival = _Arrival(group, mine[1]) if timeout is not None else None
    try:
        wait_work(dist.all_gather(gathered, local, group=group, async_op=True), timeout, f"{kind}/validate")
    except CommTimeoutError as exc:
        missing = arrival.missing() if arrival is not None else None
        if not missing:
            raise
        raise CommTimeoutError(
            f"ranks {missing} never arrived at {kind} #{mine[1]} within {timeout:.1f} s (a rank that skipped "
            f"the collective, hangs before it, or died); the others raise this error too",
            op=kind, seq=mine[1], ranks=missing) from exc
    rows = [g.cpu().tolist() for g in gathered]
    diffs = [f for i, f in enumerate(_FIELDS) if len({row[i] for row in rows}) > 1]
    if diffs:
        majority = max(rows, key=rows.count)
        odd = [r for r, row in enumerate(rows) if row != majority]
        described = "; ".join(_describe(r, row) for r, row in enumerate(rows))
        raise CollectiveMismatchError(
            f"ranks issued different collectives ({', '.join(diffs)} differ): {described}. Every rank "
            f"must issue the same collectives in the same order with the same shape and dtype{extra}",
            op=kind, seq=mine[1], ranks=odd)


class _Arrival:
    """Arrival marks in the group's store, so a timed-out rank can name who never came.

    Written only for validated collectives with a timeout (one small store write each); each rank
    deletes its previous mark, so the store holds at most one key per rank and group.
    """

    def __init__(self, group, seq: int):
        self.store = dist.distributed_c10d._get_default_store()
        g = group if group is not None else dist.group.WORLD
        self.ranks = dist.get_process_group_ranks(g)
        self.prefix = f"commopt/arrive/{_group_key(g)}"
        self.seq = seq
        me = dist.get_rank()
        self.store.set(f"{self.prefix}/{seq}/{me}", "1")
        if seq > 0:
            self.store.delete_key(f"{self.prefix}/{seq - 1}/{me}")

    def missing(self) -> list[int]:
        return [r for r in self.ranks if not self.store.check([f"{self.prefix}/{self.seq}/{r}"])]


def _group_key(group) -> str:
    try:
        return str(dist.distributed_c10d._get_process_group_name(group))
    except (AttributeError, KeyError, RuntimeError):
        return ",".join(str(r) for r in dist.get_process_group_ranks(group))


def _describe(rank: int, row: list[int]) -> str:
    inv_ops = {v: k for k, v in _FINGERPRINT_OPS.items()}

    def text(code: int) -> str:
        return code.to_bytes(7, "little").rstrip(b"\0").decode(errors="replace")

    return (f"rank {rank}: {inv_ops.get(row[0], '?')} #{row[1]} algo={text(row[2])} op={text(row[3])} "
            f"dtype={text(row[4])} device={text(row[5])} ndim={row[6]} numel={row[8]}")


# --------------------------------------------------------------------------------- agreement
_HEADER = ("collective", "element count", "dtype", "reduce op", "algorithm", "row bytes", "pipelining chunks",
           "signature (shapes, compressor settings, step)")


def agree(kind: str, *, numel: int, dtype: torch.dtype, op: str, algorithm: str, group: ProcessGroup | None,
          device: torch.device, timeout: float | None, row_bytes: int = 0, chunks: int = 0, signature: int = 0,
          problem: str | None = None, wait: bool = True) -> Callable[[], None] | None:
    """The agreement check of a call that is not validated: returns once every rank of ``group`` is
    known to have called the same collective, before any payload byte moves.

    ``wait=False`` issues the check and returns its completion instead: a callable that waits for it
    and raises what ``agree`` would; thread-safe, its outcome kept, so that the caller's thread and an
    engine phase that must not move payload before it can both call it (the tensor-parallel rings run
    their first slice of the matmul meanwhile).

    One MAX all-reduce of eight (value, -value) pairs (collective, element count, dtype, reduce op,
    algorithm, row width, pipelining depth, and a caller's ``signature``: a compressed reduction's hash
    of shapes, settings and step, below 2**62) and a flag, issued and waited for on the caller's thread on ``group``
    itself: the ranks agree when every max equals minus the max of the negations and no rank raised
    the flag (``problem``: what this rank found wrong with its own arguments or with what its peers
    send, e.g. split sizes). The header has the same size on every rank whatever the call, so a disagreement can
    never make gloo receive more bytes than a buffer holds (it aborts the process then) or leave a
    shorter message in a longer buffer (it returns uninitialised memory then): every rank raises
    ``CollectiveMismatchError`` and the group stays usable. Unlike ``validate=True`` it cannot name
    the odd ranks, only the range of values. It costs one small-message latency per call; callers
    whose buffers match by construction (the DDP hook, OverlapDataParallel, the FSDP2 comms) skip it.

    Raises:
        CollectiveMismatchError: the ranks' calls differ (on every rank).
        CommTimeoutError: the check did not complete within ``timeout`` (a peer never arrived).
        CommError: the check failed (a peer died); the payload never started.
    """
    values = (_FINGERPRINT_OPS[kind], numel, SUPPORTED_DTYPES.index(dtype), _code(op), _code(algorithm), row_bytes,
              chunks, signature)
    header = torch.tensor([v for x in values for v in (x, -x)] + [int(problem is not None)], dtype=torch.int64,
                          device=device if device.type == "cuda" else "cpu")
    context().engine().count(f"{kind}/agree", algorithms.ALGORITHM_FACTORS["allreduce"](dist.get_world_size(group))
                             * header.numel() * 8)
    work = dist.all_reduce(header, op=ReduceOp.MAX, group=group, async_op=True)

    def finish() -> None:
        try:
            wait_work(work, timeout)
        except RuntimeError as exc:
            raise _unagreed(kind, group, timeout, exc) from exc
        _compare(kind, header.cpu().tolist(), numel, dtype, op, algorithm, problem)

    if wait:
        finish()
        return None
    return _once(finish)


_VALIDATE_HINT = "; pass validate=True to name the ranks that differ"


def renamed(finish: Callable[[], None], name: str, when: str, what: str) -> Callable[[], None]:
    """An ``agree(wait=False)`` completion whose errors speak of the call ``name`` rather than of the
    collective it checks: ``"{name}: {when}: {message}. {what}"`` with the same type, sequence and
    ranks, and without agree's hint at ``validate=True``, which such calls do not have."""
    def gate() -> None:
        try:
            finish()
        except CommError as exc:
            raise type(exc)(f"{name}: {when}: {exc.message.replace(_VALIDATE_HINT, '')}. {what}", op=name,
                            seq=exc.seq, ranks=exc.ranks) from exc

    return gate


def _once(fn: Callable[[], None]) -> Callable[[], None]:
    """``fn`` run at most once, from any thread: later calls (concurrent ones wait for the first)
    return or raise as the first did."""
    lock = threading.Lock()
    outcome: list = []

    def call() -> None:
        with lock:
            if not outcome:
                try:
                    fn()
                    outcome.append(None)
                except BaseException as exc:
                    outcome.append(exc)
        if outcome[0] is not None:
            raise outcome[0]

    return call


def _compare(kind: str, got: list[int], numel: int, dtype: torch.dtype, op: str, algorithm: str,
             problem: str | None) -> None:
    """Raise ``CollectiveMismatchError`` unless the agreed header says every rank called the same."""
    diffs = []
    for i, field in enumerate(_HEADER):
        hi, lo = got[2 * i], -got[2 * i + 1]
        if hi != lo:
            diffs.append(f"{field} ({_field_text(kind, field, lo)} on some rank, {_field_text(kind, field, hi)} "
                         f"on another)")
    if got[-1]:
        diffs.append("the arguments of some rank (invalid there, or not what its peers send)"
                     + (f" (this rank: {problem})" if problem else ""))
    if diffs:
        raise CollectiveMismatchError(
            f"{kind}: the ranks' calls differ in {', '.join(diffs)}; this rank called it with "
            f"{_count_text(kind, numel)} of {dtype} (op {op}, algorithm {algorithm}). No payload byte moved and "
            f"the process group is still usable. Every rank must issue the same collective with the same "
            f"shape and dtype{_VALIDATE_HINT}", op=kind)


#: The element count an all-to-all agrees on: its rows with even splits, else one of these codes,
#: so that ranks that pass splits and ranks that do not (different setup exchanges) disagree first.
SPLITS_GIVEN, BOTH_SPLITS_GIVEN = -1, -2


def _count_text(kind: str, numel: int) -> str:
    if kind == "all_to_all" and numel < 0:
        return "in_splits only" if numel == SPLITS_GIVEN else "in_splits and out_splits"
    return f"{numel} rows" if kind == "all_to_all" else f"{numel} elements"


def _field_text(kind: str, field: str, value: int) -> object:
    """A header value in words (the codes of :func:`agree` back to names)."""
    if field == "collective":
        return {v: k for k, v in _FINGERPRINT_OPS.items()}.get(value, value)
    if field == "dtype":
        return SUPPORTED_DTYPES[value] if 0 <= value < len(SUPPORTED_DTYPES) else value
    if field == "algorithm":
        return {_code(n): n for n in (*algorithms.ALGORITHMS, algorithms.AUTO)}.get(value, value)
    if field == "reduce op":
        return value.to_bytes(7, "little").rstrip(b"\0").decode(errors="replace")
    if field == "element count" and kind == "all_to_all" and value < 0:
        return "uneven splits (in_splits only)" if value == SPLITS_GIVEN else "uneven splits (both given)"
    return value


def _unagreed(kind: str, group: ProcessGroup | None, timeout: float | None, exc: BaseException) -> CommError:
    """The error of an agreement check that could not complete: which peers, and what it means."""
    rank = dist.get_rank()
    peers = [r for r in dist.get_process_group_ranks(group if group is not None else dist.group.WORLD)
             if r != rank]
    text = str(exc).lower()
    cls = CommTimeoutError if isinstance(exc, TimeoutError) or "timeout" in text or "timed out" in text else CommError
    bound = f"within {timeout:.1f} s" if timeout is not None else "within the group's timeout"
    what = f"did not complete {bound}" if cls is CommTimeoutError else "failed"
    return cls(f"{kind}: the agreement check before the payload {what} on rank {rank} ({type(exc).__name__}: "
               f"{exc}); a peer among ranks {peers} never entered the call or died. No payload byte moved (the "
               f"tensor is unchanged), but the process group may no longer be usable: destroy it and "
               f"initialise a new one", op=f"{kind}/agree", ranks=peers)


def agreed(async_op: bool, check: Callable[[], None]) -> torch.futures.Future | None:
    """Run an agreement ``check`` (:func:`agree`); its ``CommError`` is raised, or, for ``async_op``,
    returned as a failed Future, where every later failure of the call arrives too. None: agreed."""
    try:
        check()
    except CommError as exc:
        if not async_op:
            raise
        fut: torch.futures.Future = torch.futures.Future()
        fut.set_exception(exc)
        return fut
    return None
