"""Topology-aware all-reduce, reduce-scatter and all-gather with torch's contract.

The contract (docs/architecture.md section 6.1): in place, ``group=None`` means WORLD, a group of size 1 returns at
once, ``async_op=True`` returns a ``torch.futures.Future`` completing with the result tensor; AVG is SUM
plus a division, done before the reduction for fp16/bf16 (so 4 ranks of 40 000 do not overflow)
and after it for wider types; AVG on integers raises ``TypeError``.

Algorithms are objects in ``commopt.comm.algorithms``'s registry (``flat``, ``hierarchical``,
``leader``, ``ina`` and any registered one), each with its phases, traffic and cost; ``auto`` is the
cheapest applicable candidate by the cost model (``commopt.comm.cost``). This module validates,
agrees, chooses and starts: nothing here is algorithm-specific. A blocking call lets a single-chunk
multi-phase algorithm run on the caller's thread when the engine is idle (``Engine.submit``).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Callable, Union

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup, ReduceOp

from . import algorithms, cost
from .algorithms._transport import LOW_PRECISION, Prepared, done, prepare
from .engine import wait, wait_work
from .errors import CollectiveMismatchError, CommError, CommTimeoutError, TopologyError
from .runtime import context
from .topology import Topology

if TYPE_CHECKING:
    from .compression.base import Compressor

__all__ = ["all_reduce", "reduce_scatter", "all_gather", "SUPPORTED_DTYPES", "select_algorithm",
           "validate_same", "agree", "agreed", "check_group", "check_timeout"]

Result = Union[torch.Tensor, torch.futures.Future]

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
          problem: str | None = None) -> None:
    """The agreement check of a call that is not validated: returns once every rank of ``group`` is
    known to have called the same collective, before any payload byte moves.

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
    try:
        wait_work(dist.all_reduce(header, op=ReduceOp.MAX, group=group, async_op=True), timeout)
    except RuntimeError as exc:
        raise _unagreed(kind, group, timeout, exc) from exc
    got = header.cpu().tolist()
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
            f"shape and dtype; pass validate=True to name the ranks that differ", op=kind)


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


# --------------------------------------------------------------------------------- dispatch
def _deliver(fut: torch.futures.Future, async_op: bool, timeout: float | None, op: str) -> Result:
    if async_op:
        return fut
    return wait(fut, timeout, op=op)


def _source(input: torch.Tensor) -> torch.Tensor:
    """The input of a reduce-scatter or all-gather as a contiguous 1-D view (bool as its bytes)."""
    src = input.detach().contiguous().view(-1)
    return src.view(torch.uint8) if src.dtype == torch.bool else src


def _require(algo: algorithms.Algorithm, topo: Topology, kind: str) -> None:
    reason = algo.supports(topo, kind)
    if reason is not None:
        others = [n for n in algorithms.names(kind) if algorithms.get(n).supports(topo, kind) is None]
        hint = f"use algorithm='auto' (falls back) or one of {others}"
        raise TopologyError(f"{kind}: {reason}; {hint}", op=algo.name)


def select_algorithm(kind: str, algorithm: str, nbytes: int, topo: Topology, timeout: float | None = None) -> str:
    """The algorithm a call would run: ``algorithm`` itself (checked; ``flat`` where it degenerates
    to it on one level), or what ``auto`` picks among the registry's candidates.

    Args:
        kind: "allreduce", "reduce_scatter" or "all_gather".
        algorithm: ``"auto"`` or the name of a registered algorithm that implements ``kind`` over
            the whole group (``algorithms.names(kind)``).
        nbytes: the per-rank buffer (all-reduce) or the whole world-sized buffer (the others).
    """
    known = algorithms.names(kind)
    if algorithm != algorithms.AUTO:
        if algorithm not in known:
            raise ValueError(f"{kind}: unknown algorithm {algorithm!r}; choose one of {known + [algorithms.AUTO]}")
        impl = algorithms.get(algorithm)
        _require(impl, topo, kind)
        return impl.runs(topo, kind)
    if topo.num_nodes == 1 or topo.num_nodes == topo.world_size:
        return "flat"  # one level only: the hierarchy adds phases and saves nothing
    options = [c for c in algorithms.candidates(kind) if algorithms.get(c).supports(topo, kind) is None]
    return cost.choose(options, nbytes, topo, cost.model_for(topo, timeout=timeout), op=kind)


def _start(kind: str, algo: str, p: Prepared, red: ReduceOp | None, group, topo: Topology | None,
           timeout: float | None, blocking: bool, nbytes: int, src: torch.Tensor | None = None,
           args=None) -> torch.futures.Future:
    """Build the call for ``algo`` and start it; its groups are created first (collectively, in
    the same order on every rank: the call's own order), never inside a phase."""
    ctx = context()
    impl = algorithms.get(algo)
    chunks = 1
    if topo is not None and algo != "flat":
        ctx.prepare(topo, (algo,), timeout)
        chunks = impl.chunks(cost.model_for(topo, timeout=timeout), kind, nbytes, topo)
    call = algorithms.Call(kind, p, red, group, topo, timeout, blocking, ctx, chunks, src, args)
    return impl.start(call)


# --------------------------------------------------------------------------------- all-reduce
def all_reduce(tensor: torch.Tensor, op: ReduceOp.RedOpType = ReduceOp.SUM, *, group: ProcessGroup | None = None,
               topology: Topology | None = None, algorithm: str = "auto", compressor: Compressor | None = None,
               async_op: bool = False, validate: bool = False, timeout: float | None = None,
               agreement: bool = True) -> Result:
    """All-reduce ``tensor`` in place over ``group`` with a topology-aware algorithm.

    Args:
        tensor: any supported dtype (fp64/32, bf16, fp16, integers, bool), any shape and numel
            (0 included), contiguous or not (a non-contiguous tensor is reduced through a copy and
            written back).
        op: ``ReduceOp.SUM``, ``AVG``, ``MAX`` or ``MIN``.
        group: the process group (None: WORLD).
        topology: the layout of ``group``; None detects it (once per group).
        algorithm: ``"auto"``, or a registered all-reduce algorithm (``algorithms.names("allreduce")``:
            ``"flat"``, ``"hierarchical"``, ``"leader"``, ``"ina"``, and any registered one).
        compressor: a ``commopt.comm.compression`` compressor; float tensors are then reduced
            through its ``all_reduce`` (error feedback is the caller's, see ``hooks``).
        async_op: return a Future completing with ``tensor`` instead of waiting.
        validate: exchange a fingerprint first; ranks that disagree raise
            ``CollectiveMismatchError`` on every rank before any payload moves, naming the ranks.
            Without it, a small agreement check before the payload (see :func:`agree`) still raises
            ``CollectiveMismatchError`` on every rank, before any payload byte moves, when the ranks'
            calls differ (count, dtype, reduce op, algorithm); calls of equal count but different
            shapes reduce alike and agree.
        timeout: seconds the call may take before ``CommTimeoutError`` (None: the group's own; a
            positive number, or ``inf`` for no bound of commopt's own). It bounds the agreement
            check, then the payload: every phase of a multi-phase algorithm waits for what is left
            of one deadline. Group creation on a first call is bounded by it too.
        agreement: run the agreement check (:func:`agree`) when not validating. ``False`` is for
            callers whose ranks hold the same buffers by construction (DDP's buckets, which DDP
            checks across ranks when it wraps the model; OverlapDataParallel's plan, shared by every
            rank): the check is an extra small collective per call (about one latency: on a
            CPU-bound loopback it doubled a 1 KiB flat all-reduce). Ranks that disagree on it
            disagree on the collectives they issue: pass the same value on every rank.

    Returns:
        ``tensor`` (reduced in place), or a ``Future`` of it when ``async_op``.

    Raises:
        CollectiveMismatchError: the ranks' calls differ, on every rank, before any payload moves
            (with ``validate``: naming the ranks).
        CommTimeoutError: a rank did not arrive within ``timeout``.
        CommError: a peer died before the ranks could agree (the tensor is unchanged).
        TypeError, ValueError: a bad argument (tensor, group, op, timeout, algorithm).
    """
    name = "all_reduce"
    _check_tensor(name, tensor)
    check_group(name, group)
    timeout = check_timeout(name, timeout)
    op_name = _op_name(op)
    if validate and dist.is_initialized() and dist.get_world_size(group) > 1:
        validate_same(name, tensor, algorithm=algorithm, op=op_name, group=group, timeout=timeout)
    _check_op_dtype(name, op_name, tensor.dtype)
    if not dist.is_initialized() or dist.get_world_size(group) == 1 or tensor.numel() == 0:
        return done(tensor) if async_op else tensor
    if compressor is not None and tensor.is_floating_point():
        return compressor.all_reduce(tensor, op=op, group=group, topology=topology, algorithm=algorithm,
                                     async_op=async_op, timeout=timeout)
    world = dist.get_world_size(group)
    topo = None if algorithm == "flat" else context().topology(topology, group, timeout)
    nbytes = tensor.numel() * tensor.element_size()
    algo = "flat" if topo is None else select_algorithm("allreduce", algorithm, nbytes, topo, timeout)
    if agreement and not validate:
        failed = agreed(async_op, lambda: agree(name, numel=tensor.numel(), dtype=tensor.dtype, op=op_name,
                                                algorithm=algo, group=group, device=tensor.device, timeout=timeout))
        if failed is not None:
            return failed
    p, red = prepare(tensor, op_name, world)
    fut = _start("allreduce", algo, p, red, group, topo, timeout, not async_op, nbytes)
    return _deliver(fut, async_op, timeout, f"all_reduce/{algo}")


# --------------------------------------------------------------------------------- reduce-scatter
def _check_rs_ag(name: str, big: torch.Tensor, small: torch.Tensor, world: int, big_name: str,
                 small_name: str) -> None:
    _check_tensor(name, big, big_name)
    _check_tensor(name, small, small_name)
    if big.dtype != small.dtype:
        raise TypeError(f"{name}: {big_name} dtype {big.dtype} differs from {small_name} dtype {small.dtype}")
    if big.device != small.device:
        raise ValueError(f"{name}: {big_name} is on {big.device} but {small_name} on {small.device}")
    if big.numel() != world * small.numel():
        raise ValueError(f"{name}: {big_name} has {big.numel()} elements but must have world_size "
                         f"({world}) x {small_name}.numel() ({small.numel()}) = {world * small.numel()}")


def reduce_scatter(output: torch.Tensor, input: torch.Tensor, op: ReduceOp.RedOpType = ReduceOp.SUM, *,
                   group: ProcessGroup | None = None, topology: Topology | None = None, algorithm: str = "auto",
                   async_op: bool = False, validate: bool = False, timeout: float | None = None) -> Result:
    """Reduce ``input`` (world_size blocks of ``output.numel()`` elements, in rank order) over the
    group and write this rank's reduced block into ``output``.

    ``hierarchical``: (1) permute the blocks so that each rail's blocks are contiguous,
    (2) reduce-scatter intra-node (local rank j keeps the node's sum of rail j's blocks),
    (3) reduce-scatter inter-node along the rail on 1/L of the data.

    Args are those of :func:`all_reduce` (``output`` and ``input`` on one device, of one dtype;
    ``input.numel() == world_size * output.numel()``): ``validate`` exchanges a fingerprint first,
    and without it the agreement check before the payload raises ``CollectiveMismatchError`` on every
    rank when the ranks' calls differ (before any payload byte moves); ``timeout`` bounds every wait
    (``CommTimeoutError``).

    Returns:
        ``output``, or a ``Future`` of it when ``async_op``.
    """
    name = "reduce_scatter"
    check_group(name, group)
    timeout = check_timeout(name, timeout)
    world = dist.get_world_size(group) if dist.is_initialized() else 1
    _check_rs_ag(name, input, output, world, "input", "output")
    op_name = _op_name(op)
    if validate and world > 1:
        validate_same(name, input, algorithm=algorithm, op=op_name, group=group, timeout=timeout)
    _check_op_dtype(name, op_name, input.dtype)
    if world == 1 or output.numel() == 0:
        if world == 1:
            output.detach().copy_(input.reshape(output.shape))
        return done(output) if async_op else output
    topo = None if algorithm == "flat" else context().topology(topology, group, timeout)
    algo = "flat" if topo is None else select_algorithm("reduce_scatter", algorithm,
                                                input.numel() * input.element_size(), topo, timeout)
    if not validate:
        failed = agreed(async_op, lambda: agree(name, numel=output.numel(), dtype=output.dtype, op=op_name,
                                                algorithm=algo, group=group, device=output.device, timeout=timeout))
        if failed is not None:
            return failed
    p, red = prepare(output, op_name, world)
    src = _source(input)
    if op_name == "avg" and src.dtype in LOW_PRECISION:
        src = src / world
        p.flat.mul_(world)  # prepare() pre-divided the output, which is overwritten anyway
    fut = _start("reduce_scatter", algo, p, red, group, topo, timeout, not async_op,
                 input.numel() * input.element_size(), src)
    return _deliver(fut, async_op, timeout, f"reduce_scatter/{algo}")


# --------------------------------------------------------------------------------- all-gather
def all_gather(output: torch.Tensor, input: torch.Tensor, *, group: ProcessGroup | None = None,
               topology: Topology | None = None, algorithm: str = "auto",
               async_op: bool = False, validate: bool = False, timeout: float | None = None) -> Result:
    """Gather every rank's ``input`` into ``output`` (world_size blocks, in rank order).

    ``hierarchical``: (1) all-gather inter-node along the rail (1/L of the final data crosses the
    NIC per rank), (2) all-gather intra-node, (3) permute the blocks into rank order.

    Args are those of :func:`all_reduce` (``output`` and ``input`` on one device, of one dtype;
    ``output.numel() == world_size * input.numel()``): ``validate`` exchanges a fingerprint first,
    and without it the agreement check before the payload raises ``CollectiveMismatchError`` on every
    rank when the ranks' calls differ (before any payload byte moves); ``timeout`` bounds every wait
    (``CommTimeoutError``).

    Returns:
        ``output``, or a ``Future`` of it when ``async_op``.
    """
    name = "all_gather"
    check_group(name, group)
    timeout = check_timeout(name, timeout)
    world = dist.get_world_size(group) if dist.is_initialized() else 1
    _check_rs_ag(name, output, input, world, "output", "input")
    if validate and world > 1:
        validate_same(name, input, algorithm=algorithm, op="none", group=group, timeout=timeout)
    if world == 1 or input.numel() == 0:
        if world == 1:
            output.detach().copy_(input.reshape(output.shape))
        return done(output) if async_op else output
    topo = None if algorithm == "flat" else context().topology(topology, group, timeout)
    algo = "flat" if topo is None else select_algorithm("all_gather", algorithm,
                                                output.numel() * output.element_size(), topo, timeout)
    if not validate:
        failed = agreed(async_op, lambda: agree(name, numel=input.numel(), dtype=input.dtype, op="none",
                                                algorithm=algo, group=group, device=input.device, timeout=timeout))
        if failed is not None:
            return failed
    p, _ = prepare(output, "sum", world)
    src = _source(input)
    fut = _start("all_gather", algo, p, None, group, topo, timeout, not async_op,
                 output.numel() * output.element_size(), src)
    return _deliver(fut, async_op, timeout, f"all_gather/{algo}")
