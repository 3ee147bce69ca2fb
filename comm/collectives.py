"""Topology-aware all-reduce, reduce-scatter and all-gather with torch's contract.

The contract (DESIGN 7.2): in place, ``group=None`` means WORLD, a group of size 1 returns at once,
``async_op=True`` returns a ``torch.futures.Future`` completing with the result tensor; AVG is SUM
plus a division, done before the reduction for fp16/bf16 (so 4 ranks of 40 000 do not overflow)
and after it for wider types; AVG on integers raises ``TypeError``.

Algorithms live in a registry (:data:`ALGORITHMS`):

- ``flat``: the group's own collective (gloo's ring, NCCL's rings/trees), issued on the caller's
  thread so it keeps the caller's order with the caller's own ``torch.distributed`` calls;
- ``hierarchical``: (1) reduce-scatter intra-node, (2) all-reduce inter-node on 1/L of the data,
  one rail per local index, (3) all-gather intra-node; pipelined over chunks through the engine so
  chunk 2's intra-node phase overlaps chunk 1's inter-node phase. Needs nodes of equal size;
- ``leader``: (1) reduce to each node's first rank, (2) all-reduce among those leaders,
  (3) broadcast intra-node. Works on nodes of any size;
- ``ina``: in-network aggregation through the simulated switch (``commopt.comm.ina``);
- ``auto``: the cheapest applicable one by the cost model (``commopt.comm.cost``).

Each entry is called as ``fn(prepared, reduce_op, group, topology, timeout, blocking=...)`` and
returns a Future; ``blocking`` (the caller waits at once) lets a single-chunk multi-phase algorithm
run on the caller's thread when the engine is idle (``Engine.submit``).
"""

from __future__ import annotations

import itertools
import math
import threading
from dataclasses import dataclass
from typing import Callable, Union

import torch
import torch.distributed as dist
from torch.distributed import ReduceOp

from .. import kernels
from . import cost
from .engine import Phase, all_of, as_timedelta, chain, wait, wrap_error
from .errors import CollectiveMismatchError, CommTimeoutError, TopologyError
from .topology import _REGISTRY, Topology, setup_wait

__all__ = ["all_reduce", "reduce_consistent", "reduce_scatter", "all_gather", "ALGORITHMS", "SUPPORTED_DTYPES",
           "resolve_topology", "engine", "select_algorithm", "validate_same"]

Result = Union[torch.Tensor, torch.futures.Future]

SUPPORTED_DTYPES = (torch.float64, torch.float32, torch.bfloat16, torch.float16, torch.int64,
                    torch.int32, torch.int16, torch.int8, torch.uint8, torch.bool)
_LOW_PRECISION = (torch.float16, torch.bfloat16)
_OPS = {ReduceOp.SUM: "sum", ReduceOp.AVG: "avg", ReduceOp.MAX: "max", ReduceOp.MIN: "min"}

# torch 2.13 renamed the tensor variants; older releases (>= 2.3) have only the old names.
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor

# The smallest chunk the hierarchical pipeline cuts (bytes): below it, per-message latency costs
# more than the overlap gains.
MIN_CHUNK_BYTES = 256 * 1024


def engine():
    """The process's comm engine (kept in commopt's one cache, released by ``destroy()``)."""
    return _REGISTRY.engine()


def resolve_topology(topology: Topology | None, group, timeout: float | None = None) -> Topology:
    """``topology`` itself, or ``Topology.detect(group)`` computed once per group."""
    if topology is not None:
        return topology
    key = id(group) if group is not None else None
    topo = _REGISTRY.detected.get(key)
    if topo is None:
        topo = _REGISTRY.detected[key] = Topology.detect(group, timeout=timeout)
    return topo


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


def check_group(name: str, group) -> None:
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


def fingerprint(kind: str, tensor: torch.Tensor, *, algorithm: str, op: str, group) -> list[int]:
    key = id(group) if group is not None else None
    seq = next(_REGISTRY.validate_seq.setdefault(key, itertools.count()))
    shape_code = hash(tuple(tensor.shape)) & ((1 << 62) - 1)
    return [_FINGERPRINT_OPS.get(kind, 0), seq, _code(algorithm), _code(op), _code(str(tensor.dtype)[6:]),
            _code(tensor.device.type), tensor.dim(), shape_code, tensor.numel()]


def validate_same(kind: str, tensor: torch.Tensor, *, algorithm: str, op: str, group,
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
        setup_wait(dist.all_gather(gathered, local, group=group, async_op=True), timeout, f"{kind}/validate")
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
_ALGO_CODES = ("flat", "hierarchical", "leader", "ina", "2d")
_HEADER = ("collective", "element count", "dtype", "reduce op", "algorithm", "row bytes")


def agree(kind: str, *, numel: int, dtype: torch.dtype, op: str, algorithm: str, group, device: torch.device,
          timeout: float | None, row_bytes: int = 0, problem: str | None = None) -> torch.futures.Future:
    """Start the cheap mismatch check of a call that is not validated; a Future of None that fails
    with ``CollectiveMismatchError`` when the ranks' calls differ.

    One MAX all-reduce of six (value, -value) pairs (collective, element count, dtype, reduce op,
    algorithm, row width) and a flag on ``group`` itself, issued on the caller's thread just before
    the payload and waited for only with it: ranks agree when every max equals minus the max of the
    negations and no rank raised the flag (``problem``: what this rank
    found wrong with the call against its peers, e.g. split sizes). Without it a mismatch can return
    normally with wrong values: gloo receives a shorter message into a longer buffer without
    complaint, and padding hides a count that differs by less than the node size. Unlike
    ``validate=True`` it cannot name the odd ranks, only the range of values. A mismatch that makes
    gloo receive a longer message than the buffer still aborts that process (gloo's own failure,
    as with plain torch): the check runs beside the payload, not before it. (A group of its own
    for the check measured no faster on gloo and made the first flat call create a group, a
    collective that pairs up wrongly where the ranks' first unvalidated calls differ.)
    """
    values = (_FINGERPRINT_OPS[kind], numel, SUPPORTED_DTYPES.index(dtype), _code(op),
              _ALGO_CODES.index(algorithm), row_bytes)
    header = torch.tensor([v for x in values for v in (x, -x)] + [int(problem is not None)], dtype=torch.int64,
                          device=device if device.type == "cuda" else "cpu")
    engine().count(f"{kind}/agree", cost.ALGORITHM_FACTORS["allreduce"](dist.get_world_size(group))
                   * header.numel() * 8)
    work = dist.all_reduce(header, op=ReduceOp.MAX, group=group, async_op=True)
    fut = work.get_future()
    if timeout is not None:
        fut = engine().watch(fut, timeout, op=f"{kind}/agree")

    def verify(_value) -> None:
        got = header.cpu().tolist()
        diffs = []
        for i, field in enumerate(_HEADER):
            hi, lo = got[2 * i], -got[2 * i + 1]
            if hi != lo:
                if field == "collective":
                    inv = {v: k for k, v in _FINGERPRINT_OPS.items()}
                    lo, hi = inv.get(lo, lo), inv.get(hi, hi)
                elif field == "dtype":
                    lo, hi = SUPPORTED_DTYPES[lo], SUPPORTED_DTYPES[hi]
                elif field == "algorithm":
                    lo, hi = _ALGO_CODES[lo], _ALGO_CODES[hi]
                elif field == "reduce op":
                    lo, hi = (c.to_bytes(7, "little").rstrip(b"\0").decode() for c in (lo, hi))
                diffs.append(f"{field} ({lo} on some rank, {hi} on another)")
        if got[-1]:
            diffs.append("what some rank expects from its peers" + (f" (this rank: {problem})" if problem else ""))
        if diffs:
            raise CollectiveMismatchError(
                f"{kind}: the ranks' calls differ in {', '.join(diffs)}; this rank called it with "
                f"{f'{numel} elements' if numel >= 0 else 'uneven splits'} of {dtype} (op {op}, algorithm "
                f"{algorithm}). Every rank must issue the same "
                f"collective with the same shape and dtype; pass validate=True to name the ranks that differ",
                op=kind)

    return chain(fut, verify)


def checked(payload: torch.futures.Future, check: torch.futures.Future | None) -> torch.futures.Future:
    """``payload``'s outcome once ``check`` (from :func:`agree`) has passed; a mismatch found by the
    check fails the result at once, even while the payload is still in flight (a mismatch can stall
    it), and takes precedence over the payload's own failure. A check that itself failed (timeout, a
    dead peer) leaves the verdict to the payload."""
    if check is None:
        return payload
    out: torch.futures.Future = torch.futures.Future()
    lock = threading.Lock()
    claimed = [False]

    def settle(_f: torch.futures.Future) -> None:
        outcome = None
        with lock:
            if claimed[0] or not check.done():
                return
            try:
                check.value()
            except CollectiveMismatchError as exc:
                outcome = ("err", exc)
            except Exception:  # noqa: BLE001 - the check could not run: the payload decides
                pass
            if outcome is None:
                if not payload.done():
                    return
                try:
                    outcome = ("ok", payload.value())
                except Exception as exc:  # noqa: BLE001 - forwarded unchanged
                    outcome = ("err", exc)
            # Claimed under the lock, delivered outside it (the result's callbacks are the caller's).
            claimed[0] = True
        if outcome[0] == "ok":
            out.set_result(outcome[1])
        else:
            out.set_exception(outcome[1])

    check.add_done_callback(settle)
    payload.add_done_callback(settle)
    return out


# --------------------------------------------------------------------------------- helpers
@dataclass
class _Prepared:
    """A contiguous 1-D working view of the caller's tensor and how to finish the call."""

    tensor: torch.Tensor
    work: torch.Tensor  # contiguous, possibly a copy
    flat: torch.Tensor  # work viewed as 1-D (uint8 view for bool)
    scale_after: float | None
    copy_back: bool


def _prepare(tensor: torch.Tensor, op: str, world: int) -> tuple[_Prepared, ReduceOp]:
    # The reduction writes the storage as torch's own collectives do, invisibly to autograd: through
    # a detached alias, so that AVG's division works on a leaf that requires grad like SUM does.
    result, tensor = tensor, tensor.detach()
    copy_back = not tensor.is_contiguous()
    # A strided tensor is reduced through one packed copy (kernels.flatten) and written back
    # through its strides by kernels.unflatten in _finish.
    work = kernels.flatten([tensor], align=1)[0] if copy_back else tensor
    flat = work.view(-1)
    if flat.dtype == torch.bool:
        # Sum of booleans is logical OR (as in NCCL); reduce their bytes with MAX / MIN.
        flat = flat.view(torch.uint8)
        red = ReduceOp.MIN if op == "min" else ReduceOp.MAX
        return _Prepared(result, work, flat, None, copy_back), red
    red = {"sum": ReduceOp.SUM, "avg": ReduceOp.SUM, "max": ReduceOp.MAX, "min": ReduceOp.MIN}[op]
    scale_after = None
    if op == "avg":
        if flat.dtype in _LOW_PRECISION:
            flat.div_(world)  # before the reduction: fp16 sums of 4 x 40 000 would overflow
        else:
            scale_after = 1.0 / world
    return _Prepared(result, work, flat, scale_after, copy_back), red


def _finish(p: _Prepared) -> torch.Tensor:
    if p.scale_after is not None:
        p.flat.mul_(p.scale_after)
    if p.copy_back:
        kernels.unflatten(p.work, [p.tensor.detach()], [0])
    return p.tensor


def _then_finish(fut: torch.futures.Future, p: _Prepared) -> torch.futures.Future:
    # f.value() re-raises a failed phase; a callback that ignored it would turn a failure into a
    # silently wrong result.
    return chain(fut, lambda _value: _finish(p))


def _done(value: torch.Tensor) -> torch.futures.Future:
    fut: torch.futures.Future = torch.futures.Future()
    fut.set_result(value)
    return fut


def _deliver(fut: torch.futures.Future, async_op: bool, timeout: float | None, op: str) -> Result:
    if async_op:
        return fut
    return wait(fut, timeout, op=op)


def _blocking(fn: Callable[[], object], timeout) -> None:
    """Issue a collective and wait for it, with the engine's timeout."""
    _wait_work(fn(), timeout)


def _wait_work(work, timeout) -> None:
    td = as_timedelta(timeout)
    if td is None:
        work.wait()
    else:
        work.wait(td)


def _chunk_bounds(numel: int, elem: int, multiple: int, chunks: int) -> list[tuple[int, int]]:
    """Cut [0, numel) into at most ``chunks`` pieces, each a multiple of ``multiple`` elements
    except the last, none smaller than MIN_CHUNK_BYTES (except a lone short piece)."""
    min_elems = max(multiple, (MIN_CHUNK_BYTES // elem) // multiple * multiple)
    size = max(min_elems, math.ceil(numel / max(1, chunks) / multiple) * multiple)
    return [(s, min(numel, s + size)) for s in range(0, numel, size)]


# --------------------------------------------------------------------------------- all-reduce
def _flat_all_reduce(p: _Prepared, red: ReduceOp, group, topo: Topology | None, timeout,
                     blocking: bool = False) -> torch.futures.Future:
    world = dist.get_world_size(group)
    nbytes = p.flat.numel() * p.flat.element_size()
    engine().count("flat", cost.ALGORITHM_FACTORS["allreduce"](world) * nbytes)
    work = dist.all_reduce(p.flat, op=red, group=group, async_op=True)
    return _flat_future(work, p, "all_reduce/flat", timeout)


def _flat_future(work, p: _Prepared, op: str, timeout: float | None = None,
                 group=None) -> torch.futures.Future:
    """The group's own async work as a Future of the caller's tensor; failures become CommErrors,
    and with ``timeout`` the future fails with ``CommTimeoutError`` when the work does not finish.

    The work is issued on the caller's thread, keeping the caller's order with its own
    ``torch.distributed`` calls on the same group; the engine's watchdog enforces the deadline.
    """
    rank = dist.get_rank()

    def finish(f: torch.futures.Future) -> None:
        try:
            f.value()
        except Exception as exc:  # noqa: BLE001 - delivered with op and rank
            out.set_exception(wrap_error(exc, op=op, seq=None, rank=rank))
            return
        try:
            out.set_result(_finish(p))
        except Exception as exc:  # noqa: BLE001
            out.set_exception(exc)

    try:
        fut = work.get_future()
    except RuntimeError:
        # Some backends' works have no future (gloo's reduce-scatter): the group's engine worker
        # waits for it, bounded by the timeout (a bare wait() would not be). Only the wait moves to
        # the worker; the work was issued here, in the caller's order.
        # gloo's wait(timeout) on such a work is not reliably bounded either: the deadline is the
        # watchdog's, and the worker is left to the group's own timeout.
        fut = engine().submit([Phase("wait", lambda: _wait_work(work, timeout), group if group is not None
                                     else dist.group.WORLD)], op=op)
    if timeout is not None:
        fut = engine().watch(fut, timeout, op=op)
    out: torch.futures.Future = torch.futures.Future()
    fut.add_done_callback(finish)
    return out


def _pairwise(group, timeout, send: list, recv: list) -> None:
    """Post every send and receive of a pairwise exchange at once, then wait for all of them.

    ``send[j]`` goes to, and ``recv[j]`` comes from, the group's rank j (None: nothing). Direct
    point-to-point transfers measured faster on gloo than its collectives for the intra-node phases
    (2 ranks, 16 MiB: an exchange 12.8 ms, gloo's all-to-all 24 ms, its all-gather 36 ms, its
    reduce-scatter 60 ms, which is an all-reduce in disguise), and they send the optimal (L-1)/L.
    """
    ranks = dist.get_process_group_ranks(group)
    works = []
    for j, peer in enumerate(ranks):
        if send[j] is not None:
            works.append(dist.isend(send[j], peer, group=group))
        if recv[j] is not None:
            works.append(dist.irecv(recv[j], peer, group=group))
    td = as_timedelta(timeout)
    for w in works:
        if td is None:
            w.wait()
        else:
            w.wait(td)


def _exchange_reduce_scatter(out: torch.Tensor, inp: torch.Tensor, red: ReduceOp, group, timeout) -> None:
    """Reduce-scatter over ``group``: ``out`` = the reduction of every rank's block ``me`` of ``inp``.

    ``out`` may be block ``me`` of ``inp`` itself (the hierarchical all-reduce reduces in place).
    """
    size, me = dist.get_world_size(group), dist.get_rank(group)
    blocks = inp.view(size, -1)
    others = [j for j in range(size) if j != me]
    parts = blocks.new_empty(len(others), blocks.shape[1])
    _pairwise(group, timeout, [None if j == me else blocks[j] for j in range(size)],
              [None if j == me else parts[others.index(j)] for j in range(size)])
    combine = {ReduceOp.SUM: torch.add, ReduceOp.MAX: torch.maximum, ReduceOp.MIN: torch.minimum}[red]
    combine(blocks[me], parts[0], out=out)
    for k in range(1, len(others)):
        combine(out, parts[k], out=out)


def _exchange_all_gather(out: torch.Tensor, inp: torch.Tensor, group, timeout) -> None:
    """All-gather over ``group``: block j of ``out`` = rank j's ``inp`` (``inp`` may alias block me)."""
    size, me = dist.get_world_size(group), dist.get_rank(group)
    blocks = out.view(size, -1)
    if blocks[me].data_ptr() != inp.data_ptr():
        blocks[me].copy_(inp)
    _pairwise(group, timeout, [None if j == me else inp for j in range(size)],
              [None if j == me else blocks[j] for j in range(size)])


def _hierarchical_phases(chunk: torch.Tensor, red: ReduceOp, topo: Topology, timeout) -> list[Phase]:
    """The three phases of one chunk; ``chunk`` is a multiple of the node size L."""
    local = topo.local_size
    rs, ar, ag = (topo.groups(role, timeout) for role in ("hier-rs", "hier-ar", "hier-ag"))
    # This rank's shard is its own block of the chunk: reduced there, all-reduced there, and sent
    # from there, so no phase copies it.
    shard = chunk.view(local, -1)[topo.local_rank] if local > 1 else chunk
    esize = chunk.element_size()
    n_rail = len(ar.rail_ranks)
    phases = []
    if rs.intra is not None:
        phases.append(Phase("reduce_scatter", lambda: _exchange_reduce_scatter(shard, chunk, red, rs.intra, timeout),
                            rs.intra, (local - 1) * shard.numel() * esize))
    if ar.rail is not None:
        phases.append(Phase("all_reduce", lambda: _blocking(
            lambda: dist.all_reduce(shard, op=red, group=ar.rail, async_op=True), timeout),
            ar.rail, 2 * (n_rail - 1) / n_rail * shard.numel() * esize))
    if ag.intra is not None:
        phases.append(Phase("all_gather", lambda: _exchange_all_gather(chunk, shard, ag.intra, timeout),
                            ag.intra, (local - 1) * shard.numel() * esize))
    return phases


def _pipelined(p: _Prepared, topo: Topology, multiple: int, make_phases, op_name: str,
               timeout: float | None, blocking: bool) -> torch.futures.Future:
    """Submit one chain per chunk; chunks whose length is not a multiple of ``multiple`` run on a
    zero-padded copy (padding of SUM/MAX/MIN with 0 is harmless: padded slots are discarded).
    A single chunk of a ``blocking`` call may run on the caller's thread (``Engine.submit``)."""
    model = cost.model_for(topo, timeout=timeout)
    flat = p.flat
    fut_list = []
    copies: list[tuple[torch.Tensor, torch.Tensor]] = []
    chunks = cost.chunks_for(op_name, flat.numel() * flat.element_size(), topo, model)
    bounds = _chunk_bounds(flat.numel(), flat.element_size(), multiple, chunks)
    for start, end in bounds:
        piece = flat[start:end]
        if piece.numel() % multiple:
            # kernels.flatten zero-fills the tail up to the alignment: the padding every rank adds.
            padded, _ = kernels.flatten([piece], align=multiple)
            copies.append((piece, padded))
            piece = padded
        fut_list.append(engine().submit(make_phases(piece), op=op_name, result=None, device=flat.device,
                                        blocking=blocking and len(bounds) == 1))

    def finish(_f):
        for dst, src in copies:
            kernels.unflatten(src, [dst], [0])
        return _finish(p)

    return chain(all_of(fut_list, None), finish)


def _hierarchical_all_reduce(p: _Prepared, red: ReduceOp, group, topo: Topology, timeout,
                             blocking: bool = False) -> torch.futures.Future:
    return _pipelined(p, topo, topo.local_size, lambda chunk: _hierarchical_phases(chunk, red, topo, timeout),
                      "hierarchical", timeout, blocking)


def _leader_phases(chunk: torch.Tensor, red: ReduceOp, topo: Topology, timeout) -> list[Phase]:
    lr, la, lb = (topo.groups(role, timeout) for role in ("leader-reduce", "leader-ar", "leader-bcast"))
    leader = topo.group_rank_to_global(topo.nodes[topo.node][0])
    nbytes = chunk.numel() * chunk.element_size()
    phases = []
    if lr.intra is not None:
        phases.append(Phase("reduce", lambda: _blocking(
            lambda: dist.reduce(chunk, dst=leader, op=red, group=lr.intra, async_op=True), timeout),
            lr.intra, nbytes))
    if topo.local_rank == 0 and la.rail is not None:
        n = len(la.rail_ranks)
        phases.append(Phase("all_reduce", lambda: _blocking(
            lambda: dist.all_reduce(chunk, op=red, group=la.rail, async_op=True), timeout),
            la.rail, 2 * (n - 1) / n * nbytes))
    if lb.intra is not None:
        phases.append(Phase("broadcast", lambda: _blocking(
            lambda: dist.broadcast(chunk, src=leader, group=lb.intra, async_op=True), timeout),
            lb.intra, nbytes if topo.local_rank == 0 else 0))
    return phases


def _leader_all_reduce(p: _Prepared, red: ReduceOp, group, topo: Topology, timeout,
                       blocking: bool = False) -> torch.futures.Future:
    return _pipelined(p, topo, 1, lambda chunk: _leader_phases(chunk, red, topo, timeout), "leader", timeout,
                      blocking)


def _ina_all_reduce(p: _Prepared, red: ReduceOp, group, topo: Topology, timeout,
                    blocking: bool = False) -> torch.futures.Future:
    from .ina import ina_all_reduce_for  # optional subsystem; imported on use

    return ina_all_reduce_for(p, red, group, topo, timeout, finish=_finish)


# name -> (implementation, needs a uniform topology)
ALGORITHMS: dict[str, Callable] = {
    "flat": _flat_all_reduce,
    "hierarchical": _hierarchical_all_reduce,
    "leader": _leader_all_reduce,
    "ina": _ina_all_reduce,
}


def _require_uniform(topo: Topology, algorithm: str) -> None:
    if not topo.is_uniform:
        raise TopologyError(
            f"algorithm {algorithm!r} needs nodes of equal size, got node sizes "
            f"{[len(n) for n in topo.nodes]} ({topo.layout}); use algorithm='auto' (falls back) or "
            f"'leader'", op=algorithm)


def select_algorithm(kind: str, algorithm: str, nbytes: int, topo: Topology, timeout: float | None = None) -> str:
    """The algorithm a call would run: ``algorithm`` itself (checked), or what ``auto`` picks.

    Args:
        kind: "allreduce", "reduce_scatter" or "all_gather".
        nbytes: the per-rank buffer (all-reduce) or the whole world-sized buffer (the others).
    """
    candidates = {"allreduce": ["flat", "hierarchical", "leader"],
                  "reduce_scatter": ["flat", "hierarchical"],
                  "all_gather": ["flat", "hierarchical"]}[kind]
    if algorithm != "auto":
        if algorithm not in candidates and not (kind == "allreduce" and algorithm == "ina"):
            raise ValueError(f"{kind}: unknown algorithm {algorithm!r}; choose one of "
                             f"{candidates + ['auto']}")
        if algorithm == "hierarchical":
            _require_uniform(topo, algorithm)
            if kind != "allreduce" and (topo.num_nodes == 1 or topo.local_size == 1):
                return "flat"  # one level: the hierarchical phases degenerate to the flat one
        return algorithm
    if topo.num_nodes == 1 or topo.num_nodes == topo.world_size:
        return "flat"  # one level only: the hierarchy adds phases and saves nothing
    if not topo.is_uniform:
        candidates = [c for c in candidates if c != "hierarchical"]
    return cost.choose(candidates, nbytes, topo, cost.model_for(topo, timeout=timeout), op=kind)


def all_reduce(tensor: torch.Tensor, op=ReduceOp.SUM, *, group=None, topology: Topology | None = None,
               algorithm: str = "auto", compressor=None, async_op: bool = False, validate: bool = False,
               timeout: float | None = None) -> Result:
    """All-reduce ``tensor`` in place over ``group`` with a topology-aware algorithm.

    Args:
        tensor: any supported dtype (fp64/32, bf16, fp16, integers, bool), any shape and numel
            (0 included), contiguous or not (a non-contiguous tensor is reduced through a copy and
            written back).
        op: ``ReduceOp.SUM``, ``AVG``, ``MAX`` or ``MIN``.
        group: the process group (None: WORLD).
        topology: the layout of ``group``; None detects it (once per group).
        algorithm: ``"auto"``, ``"flat"``, ``"hierarchical"``, ``"leader"`` or ``"ina"``.
        compressor: a ``commopt.comm.compression`` compressor; float tensors are then reduced
            through its ``all_reduce`` (error feedback is the caller's, see ``hooks``).
        async_op: return a Future completing with ``tensor`` instead of waiting.
        validate: exchange a fingerprint first; ranks that disagree raise
            ``CollectiveMismatchError`` on every rank before any payload moves, naming the ranks.
            Without it, a small agreement check beside the payload (see :func:`agree`) still raises
            ``CollectiveMismatchError`` on every rank when the ranks' calls differ.
        timeout: seconds each phase may take before ``CommTimeoutError`` (None: the group's own; a
            positive number, or ``inf`` for no bound of commopt's own). Group creation on a first
            call is bounded by it too.

    Returns:
        ``tensor`` (reduced in place), or a ``Future`` of it when ``async_op``.

    Raises:
        CollectiveMismatchError: the ranks' calls differ (with ``validate``: before any payload
            moves, naming the ranks; without it: from the agreement check beside the payload).
        CommTimeoutError: a rank did not arrive within ``timeout``.
        TypeError, ValueError: a bad argument (tensor, group, op, timeout, algorithm).
    """
    return reduce_consistent(tensor, op, group=group, topology=topology, algorithm=algorithm, compressor=compressor,
                             async_op=async_op, validate=validate, timeout=timeout, agree_sizes=True)


def reduce_consistent(tensor: torch.Tensor, op=ReduceOp.SUM, *, group=None, topology: Topology | None = None,
                      algorithm: str = "auto", compressor=None, async_op: bool = False, validate: bool = False,
                      timeout: float | None = None, agree_sizes: bool = False) -> Result:
    """:func:`all_reduce` for callers whose ranks hold the same buffers by construction (DDP's buckets,
    which DDP checks across ranks when it wraps the model; OverlapDataParallel's plan, shared by
    every rank): ``agree_sizes=False`` leaves out the agreement check, an extra small collective
    per call (about one latency: on a CPU-bound loopback it doubled a 1 KiB flat all-reduce)."""
    name = "all_reduce"
    _check_tensor(name, tensor)
    check_group(name, group)
    timeout = check_timeout(name, timeout)
    op_name = _op_name(op)
    if validate and dist.is_initialized() and dist.get_world_size(group) > 1:
        validate_same(name, tensor, algorithm=algorithm, op=op_name, group=group, timeout=timeout)
    _check_op_dtype(name, op_name, tensor.dtype)
    if not dist.is_initialized() or dist.get_world_size(group) == 1 or tensor.numel() == 0:
        return _done(tensor) if async_op else tensor
    if compressor is not None and tensor.is_floating_point():
        return compressor.all_reduce(tensor, op=op, group=group, topology=topology, algorithm=algorithm,
                                     async_op=async_op, timeout=timeout)
    world = dist.get_world_size(group)
    topo = None if algorithm == "flat" else resolve_topology(topology, group, timeout)
    nbytes = tensor.numel() * tensor.element_size()
    algo = "flat" if topo is None else select_algorithm("allreduce", algorithm, nbytes, topo, timeout)
    check = None if validate or not agree_sizes else agree(
        name, numel=tensor.numel(), dtype=tensor.dtype, op=op_name, algorithm=algo, group=group, device=tensor.device,
        timeout=timeout)
    p, red = _prepare(tensor, op_name, world)
    fut = checked(ALGORITHMS[algo](p, red, group, topo, timeout, blocking=not async_op), check)
    return _deliver(fut, async_op, timeout, f"all_reduce/{algo}")


# --------------------------------------------------------------------------------- reduce-scatter
def _rail_order(topo: Topology) -> list[int]:
    """Group ranks in the order the hierarchical phases lay their blocks out: local index j major,
    rail position (sorted group rank) minor. The rail groups order members by group rank."""
    local = topo.local_size
    return [r for j in range(local) for r in sorted(node[j] for node in topo.nodes)]


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


def reduce_scatter(output: torch.Tensor, input: torch.Tensor, op=ReduceOp.SUM, *, group=None,
                   topology: Topology | None = None, algorithm: str = "auto", async_op: bool = False,
                   validate: bool = False, timeout: float | None = None) -> Result:
    """Reduce ``input`` (world_size blocks of ``output.numel()`` elements, in rank order) over the
    group and write this rank's reduced block into ``output``.

    ``hierarchical``: (1) permute the blocks so that each rail's blocks are contiguous,
    (2) reduce-scatter intra-node (local rank j keeps the node's sum of rail j's blocks),
    (3) reduce-scatter inter-node along the rail on 1/L of the data.

    Args are those of :func:`all_reduce` (``output`` and ``input`` on one device, of one dtype;
    ``input.numel() == world_size * output.numel()``): ``validate`` exchanges a fingerprint first,
    and without it the agreement check beside the payload raises ``CollectiveMismatchError`` on every
    rank when the ranks' calls differ; ``timeout`` bounds every wait (``CommTimeoutError``).

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
        return _done(output) if async_op else output
    topo = None if algorithm == "flat" else resolve_topology(topology, group, timeout)
    algo = "flat" if topo is None else select_algorithm("reduce_scatter", algorithm,
                                                input.numel() * input.element_size(), topo, timeout)
    check = None if validate else agree(name, numel=output.numel(), dtype=output.dtype, op=op_name, algorithm=algo,
                                        group=group, device=output.device, timeout=timeout)
    p, red = _prepare(output, op_name, world)
    src = input.detach().contiguous().view(-1)
    if src.dtype == torch.bool:
        src = src.view(torch.uint8)
    if op_name == "avg" and src.dtype in _LOW_PRECISION:
        src = src / world
        p.flat.mul_(world)  # _prepare pre-divided the output, which is overwritten anyway
    n = p.flat.numel()
    esize = p.flat.element_size()
    if algo == "flat":
        engine().count("reduce_scatter/flat", (world - 1) * n * esize)
        fut = _flat_future(_reduce_scatter_single(p.flat, src, op=red, group=group, async_op=True),
                           p, "reduce_scatter/flat", timeout, group)
        return _deliver(checked(fut, check), async_op, timeout, "reduce_scatter/flat")
    local, nodes = topo.local_size, topo.num_nodes
    order = _rail_order(topo)
    staged = src.view(world, n)[torch.tensor(order)].reshape(-1)
    rs, rail = topo.groups("hier-rs", timeout), topo.groups("hier-rs-rail", timeout)
    mid = staged.new_empty(nodes * n)
    phases = [
        Phase("reduce_scatter_intra", lambda: _exchange_reduce_scatter(mid, staged, red, rs.intra, timeout),
              rs.intra, (local - 1) * nodes * n * esize),
        Phase("reduce_scatter_inter", lambda: _exchange_reduce_scatter(p.flat, mid, red, rail.rail, timeout),
              rail.rail, (nodes - 1) * n * esize),
    ]
    fut = engine().submit(phases, op="reduce_scatter/hierarchical", device=input.device, blocking=not async_op)
    return _deliver(checked(_then_finish(fut, p), check), async_op, timeout, "reduce_scatter/hierarchical")


# --------------------------------------------------------------------------------- all-gather
def all_gather(output: torch.Tensor, input: torch.Tensor, *, group=None, topology: Topology | None = None,
               algorithm: str = "auto", async_op: bool = False, validate: bool = False,
               timeout: float | None = None) -> Result:
    """Gather every rank's ``input`` into ``output`` (world_size blocks, in rank order).

    ``hierarchical``: (1) all-gather inter-node along the rail (1/L of the final data crosses the
    NIC per rank), (2) all-gather intra-node, (3) permute the blocks into rank order.

    Args are those of :func:`all_reduce` (``output`` and ``input`` on one device, of one dtype;
    ``output.numel() == world_size * input.numel()``): ``validate`` exchanges a fingerprint first,
    and without it the agreement check beside the payload raises ``CollectiveMismatchError`` on every
    rank when the ranks' calls differ; ``timeout`` bounds every wait (``CommTimeoutError``).

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
        return _done(output) if async_op else output
    topo = None if algorithm == "flat" else resolve_topology(topology, group, timeout)
    algo = "flat" if topo is None else select_algorithm("all_gather", algorithm,
                                                output.numel() * output.element_size(), topo, timeout)
    check = None if validate else agree(name, numel=input.numel(), dtype=input.dtype, op="none", algorithm=algo,
                                        group=group, device=input.device, timeout=timeout)
    p, _ = _prepare(output, "sum", world)
    src = input.detach().contiguous().view(-1)
    if src.dtype == torch.bool:
        src = src.view(torch.uint8)
    n = src.numel()
    esize = src.element_size()
    if algo == "flat":
        engine().count("all_gather/flat", (world - 1) * n * esize)
        fut = _flat_future(_all_gather_single(p.flat, src, group=group, async_op=True),
                           p, "all_gather/flat", timeout, group)
        return _deliver(checked(fut, check), async_op, timeout, "all_gather/flat")
    local, nodes = topo.local_size, topo.num_nodes
    rail, ag = topo.groups("hier-ag-rail", timeout), topo.groups("hier-ag-intra", timeout)
    mid = src.new_empty(nodes * n)
    gathered = src.new_empty(world * n)
    phases = [
        Phase("all_gather_inter", lambda: _exchange_all_gather(mid, src, rail.rail, timeout), rail.rail,
              (nodes - 1) * n * esize),
        Phase("all_gather_intra", lambda: _exchange_all_gather(gathered, mid, ag.intra, timeout), ag.intra,
              (local - 1) * nodes * n * esize),
    ]
    order = torch.tensor(_rail_order(topo))

    def permute():
        # gathered holds blocks in rail order; block i belongs to group rank order[i].
        p.flat.view(world, n)[order] = gathered.view(world, n)

    phases.append(Phase("permute", permute))
    fut = engine().submit(phases, op="all_gather/hierarchical", device=input.device, blocking=not async_op)
    return _deliver(checked(_then_finish(fut, p), check), async_op, timeout, "all_gather/hierarchical")
