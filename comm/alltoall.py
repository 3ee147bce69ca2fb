"""All-to-all with torch's contract: ``flat`` and topology-aware ``2d``, even and uneven splits.

``all_to_all(output, input)`` sends rows ``input[sum(in_splits[:j]) : sum(in_splits[:j+1])]`` to rank
``j`` and stores what rank ``i`` sent at ``output[sum(out_splits[:i]) : ...]``, like
``torch.distributed.all_to_all_single``. Splits are in rows (dim 0); any dtype and trailing shape; the
data moves as raw bytes, so every dtype is exact.

Algorithms (the registry's all-to-all ones, ``algorithms.names("alltoall")``):

- ``flat``: the group's own all-to-all, issued on the caller's thread (every rank sends p - 1
  messages, p - L of them across its node's link);
- ``2d`` (Tutel-style hierarchical): (0) a local permute that groups the input by the destination's
  local index, (1) an intra-node exchange so that local rank j holds everything its node sends to the
  ranks of local index j (its rail), (1b) a local permute that groups that by destination node, (2)
  one inter-node exchange along the rail, (3) a local permute into source-rank order (permutes by
  ``kernels.permute_chunks``; when pipelined, (0) and (3) gather/scatter each chunk's rows so that
  they overlap the other chunks' exchanges; skipped where they are the identity). Every rank sends
  L - 1 + N - 1 messages instead of N*L - 1, and the same bytes cross the node link as with ``flat``,
  so it wins where per-message cost dominates (many ranks per node, small messages). Phases (1)-(2)
  run through the comm engine (one role per phase, docs/architecture.md section 3) and are pipelined over chunks (depth
  from the cost model): chunk 2's intra-node exchange overlaps chunk 1's inter-node one, and
  alternate chunks use two rail streams so the node link stays busy while one synchronises. Needs
  nodes of equal size;
- ``auto``: ``flat`` on one-level or non-uniform topologies, else the cheaper by the measured lines
  of :func:`calibrate` when it ran for the layout, else by the level cost model; always from a size
  all ranks agree on (docs/architecture.md section 3, rule 2).

Before any payload byte moves, every rank knows that the calls agree (``collectives.agree``: rows
or split mode, dtype, row width, algorithm), and with uneven splits (MoE routing) every rank holds
every rank's splits (one small all-gather, which also gives each rank its output splits when only
``in_splits`` is given): a disagreement raises on every rank instead of aborting a process in gloo or
returning uninitialised rows. Setup exchanges and phases honour ``timeout`` (``CommTimeoutError``
instead of a hang).

Also here: :func:`all_to_all_autograd`, whose backward is the reverse all-to-all (for MoE layers),
and what the benchmark prints: :func:`link_bytes` (bytes crossing a node link, equal for both),
:func:`predict`, :func:`choose_algorithm`, :func:`predicted_ratio` and :func:`crossover_bytes` (the
level model's 2-D/flat ratio and crossover for N nodes x L ranks), :func:`calibrate`.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Callable, Union

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

from . import algorithms, cost
from .algorithms._transport import Prepared, done, row_bytes
from .checks import (
    BOTH_SPLITS_GIVEN,
    SPLITS_GIVEN,
    _check_tensor,
    agree,
    agreed,
    check_group,
    check_timeout,
    validate_same,
)
from .dispatch import _deliver
from .engine import wait_work
from .errors import CollectiveMismatchError, CommError, TopologyError
from .runtime import context
from .topology import Topology

__all__ = [
    "all_to_all",
    "all_to_all_autograd",
    "exchange_splits",
    "link_bytes",
    "predict",
    "choose_algorithm",
    "calibrate",
    "predicted_ratio",
    "crossover_bytes",
]

Result = Union[torch.Tensor, torch.futures.Future]
Splits = Union[Sequence[int], torch.Tensor, None]

_NAME = "all_to_all"


# --------------------------------------------------------------------------------- arguments
def _as_list(name: str, splits: Splits) -> list[int] | None:
    if splits is None:
        return None
    if isinstance(splits, torch.Tensor):
        splits = splits.tolist()
    out = []
    for i, s in enumerate(splits):
        if isinstance(s, bool) or not isinstance(s, int):
            raise TypeError(f"{_NAME}: {name}[{i}] must be an int, got {type(s).__name__}")
        out.append(s)
    return out


def _check_splits(name: str, splits: list[int], world: int, rows: int | None, tensor_name: str) -> str | None:
    """The problem with ``splits``, or None."""
    if len(splits) != world:
        return f"{name} has {len(splits)} entries but the group has world_size={world}; pass one per rank"
    neg = [i for i, s in enumerate(splits) if s < 0]
    if neg:
        return f"{name} has negative entries at ranks {neg} ({[splits[i] for i in neg]}); split sizes count rows"
    if rows is not None and sum(splits) != rows:
        return (f"{name}={splits} sums to {sum(splits)} but {tensor_name} has {rows} rows along dim 0; "
                f"the splits must add up to {tensor_name}.shape[0]")
    return None


def _even(rows: int, world: int, tensor_name: str) -> tuple[list[int], str | None]:
    if rows % world:
        return [0] * world, (f"{tensor_name} has {rows} rows, not divisible by world_size={world}; pass "
                             f"explicit splits for an uneven all-to-all")
    return [rows // world] * world, None


@dataclass
class _Args:
    """One call's arguments, normalised; ``problem`` is this rank's argument error (None if fine)."""

    in_splits: list[int]
    out_splits: list[int] | None  # None: exchanged from the peers' in_splits
    even: bool
    problem: str | None


def _normalise(output: torch.Tensor | None, input: torch.Tensor, in_splits: Splits, out_splits: Splits,
               world: int) -> _Args:
    ins, outs = _as_list("in_splits", in_splits), _as_list("out_splits", out_splits)
    if input.dim() == 0:
        return _Args([0] * world, None, False, "input is 0-d; all_to_all splits dim 0, pass at least a 1-D tensor")
    if output is not None and (output.dim() == 0 or output.shape[1:] != input.shape[1:]):
        return _Args([0] * world, None, False,
                     f"output shape {tuple(output.shape)} and input shape {tuple(input.shape)} differ beyond "
                     f"dim 0; every row sent must fit a row received")
    problem = None
    even = ins is None and outs is None
    if ins is None:
        ins, problem = _even(input.shape[0], world, "input")
    else:
        problem = _check_splits("in_splits", ins, world, input.shape[0], "input")
    if problem is None:
        if outs is not None:
            rows = output.shape[0] if output is not None else None
            problem = _check_splits("out_splits", outs, world, rows, "output")
        elif in_splits is None:
            # torch's rule: splits not given on a side split that side evenly.
            rows = output.shape[0] if output is not None else input.shape[0]
            outs, problem = _even(rows, world, "output")
            if problem is None and even and rows != input.shape[0]:
                # Even on every rank means rank i sends input_i.rows / p to rank j, which expects
                # output_j.rows / p: consistent only when every input and output has the same rows.
                problem = (f"output has {rows} rows but input {input.shape[0]}; with even splits both must "
                           f"have the same rows (pass in_splits/out_splits for an uneven exchange)")
    return _Args(ins, outs, even, problem)


# --------------------------------------------------------------------------------- split exchange
def exchange_splits(in_splits: Splits, *, group: ProcessGroup | None = None, validate: bool = False,
                    timeout: float | None = None) -> list[int]:
    """Every rank's ``in_splits[rank]``: the rows this rank will receive from each peer.

    One all-to-all of ``world_size`` int64 on ``group``, on the caller's thread (``CommTimeoutError``
    after ``timeout`` seconds). Collective.
    """
    world = dist.get_world_size(group) if dist.is_initialized() else 1
    ins = _as_list("in_splits", in_splits)
    problem = _check_splits("in_splits", ins, world, None, "input")
    if validate and world > 1:
        return _agree_splits(problem, ins, None, None, False, group, world, timeout)[0]
    if problem:
        raise ValueError(f"{_NAME}: {problem}")
    if world == 1:
        return list(ins)
    send = torch.tensor(ins, dtype=torch.int64)
    recv = torch.empty_like(send)
    wait_work(dist.all_to_all_single(recv, send, group=group, async_op=True), timeout, f"{_NAME}/splits")
    return recv.tolist()


def _agree_splits(problem: str | None, ins: list[int], outs: list[int] | None, out_rows: int | None, even: bool,
                  group, world: int, timeout: float | None) -> tuple[list[int], int]:
    """The check of the splits (``validate=True``, and every uneven call): one all-gather of every
    rank's splits.

    Every rank learns every rank's in/out splits and argument status, so every rank raises the same
    error for a bad argument anywhere, or for splits that disagree (rank i sends k rows to rank j but
    j expects m), instead of the bad rank raising alone and the others hanging. Returns this rank's
    out_splits (derived from the peers' in_splits when not given) and the rows sent by all ranks.
    """
    rank = dist.get_rank(group)
    row = [1 if problem else 0, -1 if out_rows is None else out_rows, int(even)]
    row += ins if len(ins) == world and not problem else [0] * world
    row += outs if outs is not None and len(outs) == world and not problem else [-1] * world
    mine = torch.tensor(row, dtype=torch.int64)
    gathered = [torch.empty_like(mine) for _ in range(world)]
    wait_work(dist.all_gather(gathered, mine, group=group, async_op=True), timeout, f"{_NAME}/splits")
    rows = [g.tolist() for g in gathered]
    bad = [r for r in range(world) if rows[r][0]]
    if bad:
        mine_text = f" (this rank: {problem})" if problem else ""
        raise ValueError(f"{_NAME}: ranks {bad} passed invalid arguments{mine_text}; fix the splits "
                         f"or tensor shapes on those ranks")
    send = [rows[r][3:3 + world] for r in range(world)]
    recv = [rows[r][3 + world:] for r in range(world)]
    diffs, odd = [], set()
    evens = [r for r in range(world) if rows[r][2]]
    if 0 < len(evens) < world:
        # The even path skips the split metadata the uneven one exchanges: both must be the same.
        diffs.append(f"ranks {evens} passed no splits (even) but the others passed splits; pass splits "
                     f"on every rank or on none")
        odd.update(evens)
    for i in range(world):
        for j in range(world):
            if recv[j][i] >= 0 and recv[j][i] != send[i][j]:
                diffs.append(f"rank {i} sends {send[i][j]} rows to rank {j}, which expects {recv[j][i]}")
                odd.update((i, j))
    for j in range(world):
        expected = rows[j][1]
        if recv[j][0] < 0 and expected >= 0 and expected != sum(send[i][j] for i in range(world)):
            diffs.append(f"rank {j}'s output has {expected} rows but the peers send it "
                         f"{sum(send[i][j] for i in range(world))}")
            odd.add(j)
    if diffs:
        shown = "; ".join(diffs[:6]) + (f"; ... ({len(diffs)} in all)" if len(diffs) > 6 else "")
        odd = sorted(odd)
        raise CollectiveMismatchError(
            f"split sizes disagree across ranks: {shown}. in_splits[j] on rank i must equal out_splits[i] "
            f"on rank j (or pass only in_splits and let all_to_all exchange them)", op=_NAME, ranks=odd)
    total = sum(map(sum, send))
    return (outs if outs is not None else [send[i][rank] for i in range(world)]), total


def _agree_call(mode: int, input: torch.Tensor, algorithm: str, chunks: int | None, group, timeout: float | None,
                bad_argument: str | None) -> None:
    """:func:`collectives.agree` for an all-to-all. ``bad_argument``: this rank's own argument error,
    raised here as ``ValueError`` once its peers know of it (they raise ``CollectiveMismatchError``)."""
    try:
        agree(_NAME, numel=mode, dtype=input.dtype, op="none", algorithm=algorithm, group=group, device=input.device,
              timeout=timeout, row_bytes=row_bytes(input), chunks=chunks or 0, problem=bad_argument)
    except CollectiveMismatchError:
        if bad_argument is not None:
            raise ValueError(f"{_NAME}: {bad_argument} (the other ranks raise CollectiveMismatchError)") from None
        raise


# --------------------------------------------------------------------------------- algorithms
def _mean_bytes(input: torch.Tensor, group, world: int, timeout: float | None) -> float:
    """The mean per-rank input size, agreed by every rank through one 8-byte all-reduce: uneven
    splits make local sizes differ, and a choice made from a local size would differ across ranks."""
    total = torch.tensor([input.shape[0] * row_bytes(input)], dtype=torch.int64)
    context().engine().count(f"{_NAME}/agree", 8)
    wait_work(dist.all_reduce(total, group=group, async_op=True), timeout, f"{_NAME}/agree")
    return float(total.item()) / world


def _known(algorithm: str) -> None:
    """``ValueError`` unless ``algorithm`` is ``"auto"`` or a registered all-to-all algorithm."""
    known = algorithms.names("alltoall")
    if algorithm != algorithms.AUTO and algorithm not in known:
        raise ValueError(f"{_NAME}: unknown algorithm {algorithm!r}; choose one of {known + [algorithms.AUTO]}")


def _choose(algorithm: str, input: torch.Tensor, topology: Topology | None, group, world: int,
            agreed_bytes: float | None, timeout: float | None) -> tuple[str, Topology | None, float | None]:
    _known(algorithm)
    if algorithm == "flat":
        return "flat", None, agreed_bytes
    topo = context().topology(topology, group, timeout)
    if algorithm != algorithms.AUTO:
        impl = algorithms.get(algorithm)
        reason = impl.supports(topo, "alltoall")
        if reason is not None:
            raise TopologyError(f"{reason}; use algorithm='auto' (falls back to flat) or 'flat'",
                                op=f"{_NAME}/{algorithm}")
        # One level: the 2-D phases degenerate to the flat exchange (``flat_on_one_level``).
        return impl.runs(topo, "alltoall"), topo, agreed_bytes
    if topo.num_nodes == 1 or topo.num_nodes == topo.world_size or not topo.is_uniform:
        return "flat", topo, agreed_bytes
    if agreed_bytes is None:
        agreed_bytes = _mean_bytes(input, group, world, timeout)
    return choose_algorithm(agreed_bytes, topo, timeout=timeout), topo, agreed_bytes


# --------------------------------------------------------------------------------- public
def all_to_all(output: torch.Tensor | None, input: torch.Tensor, *, in_splits: Splits = None,
               out_splits: Splits = None, group: ProcessGroup | None = None, topology: Topology | None = None,
               algorithm: str = "auto", async_op: bool = False, validate: bool = False, timeout: float | None = None,
               chunks: int | None = None) -> Result:
    """Exchange rows of ``input`` with every rank of ``group``, like ``all_to_all_single``.

    Args:
        output: receives ``sum(out_splits)`` rows shaped like ``input``'s rows (written in place;
            non-contiguous is fine), or None to allocate it (the result is returned).
        input: any supported dtype, at least 1-D; rows (dim 0) go to ranks in ``in_splits`` order.
        in_splits: rows for each rank (None: ``input.shape[0] / world_size`` each).
        out_splits: rows from each rank. None with ``in_splits`` given: learnt from the peers'
            in_splits (the split check below); None with ``in_splits`` None: even.
        group: the process group (None: WORLD).
        topology: the layout of ``group``; None detects it (once per group).
        algorithm: ``"auto"``, ``"flat"`` or ``"2d"`` (``TopologyError`` on unequal nodes).
        async_op: return a Future completing with the output instead of waiting (it returns once
            the ranks have agreed, before the payload completes).
        validate: before any payload moves, exchange a fingerprint (op, sequence number, dtype,
            device, row shape) that names the ranks that differ. Without it, the call still agrees
            before any payload byte moves: one small all-reduce (even rows or which splits were
            passed, dtype, row width, algorithm, chunks, and whether any rank's arguments were bad)
            and, for uneven splits, one small all-gather of every rank's splits. Either way, ranks
            whose calls differ raise ``CollectiveMismatchError`` on every rank, a bad argument on any
            rank raises ``ValueError`` there and an error on every other rank, and splits that
            disagree (rank i sends k rows to rank j, which expects m; an output of other rows than
            the peers send) raise ``CollectiveMismatchError`` on every rank naming the ranks.
        timeout: seconds the exchange (each 2-D phase) may take before ``CommTimeoutError``.
        chunks: pipelining depth of ``2d``, the same on every rank. None: chosen by the cost model
            from the mean per-rank size (known to all for even splits, read from the split exchange
            when there is one, else agreed by one 8-byte all-reduce).

    Returns:
        The output tensor, or a Future of it when ``async_op``.

    Raises:
        ValueError: splits that do not sum to dim 0, negative or of the wrong length, shapes that
            disagree beyond dim 0, or rows not divisible by the world size for even splits.
        TopologyError: ``algorithm="2d"`` on nodes of unequal size.
    """
    _check_tensor(_NAME, input, "input")
    check_group(_NAME, group)
    timeout = check_timeout(_NAME, timeout)
    if output is not None:
        _check_tensor(_NAME, output, "output")
        if output.dtype != input.dtype:
            raise TypeError(f"{_NAME}: output dtype {output.dtype} differs from input dtype {input.dtype}")
        if output.device != input.device:
            raise ValueError(f"{_NAME}: output is on {output.device} but input on {input.device}")
    if chunks is not None and (isinstance(chunks, bool) or not isinstance(chunks, int) or chunks < 1):
        raise ValueError(f"{_NAME}: chunks={chunks!r} must be a positive int (or None)")
    world = dist.get_world_size(group) if dist.is_initialized() else 1
    args = _normalise(output, input, in_splits, out_splits, world)
    agreed_bytes = None
    if validate and world > 1:
        validate_same(_NAME, input[:0] if input.dim() else input, algorithm=algorithm, op="none", group=group,
                      timeout=timeout)
        args.out_splits, total_rows = _agree_splits(args.problem, args.in_splits, args.out_splits,
                                             None if output is None else output.shape[0], args.even, group, world,
                                             timeout)
        agreed_bytes = total_rows * row_bytes(input) / world
    elif args.problem and world == 1:
        raise ValueError(f"{_NAME}: {args.problem}")
    elif world > 1:
        # Before anything else moves, the ranks agree on the call (even rows, or which splits were
        # passed: only the uneven paths exchange splits), the row width, the dtype, the algorithm
        # asked for and the depth; a bad argument on any rank fails every rank. Uneven splits are
        # then checked by every rank against every rank's (one small all-gather), so that every rank
        # reaches the same verdict before any payload moves (a row count larger than the buffer
        # would make gloo abort, a smaller one return uninitialised rows).
        given = out_splits is not None and not args.even
        mode = input.shape[0] if args.even else (BOTH_SPLITS_GIVEN if given else SPLITS_GIVEN)

        def check() -> None:
            nonlocal agreed_bytes
            _agree_call(mode, input, algorithm, chunks, group, timeout, args.problem)
            if not args.even:
                args.out_splits, total_rows = _agree_splits(None, args.in_splits, args.out_splits,
                                                            None if output is None else output.shape[0], False,
                                                            group, world, timeout)
                agreed_bytes = total_rows * row_bytes(input) / world

        failed = agreed(async_op, check)
        if failed is not None:
            return failed
    if args.out_splits is None:  # world_size 1
        args.out_splits = list(args.in_splits)
    if args.even:
        agreed_bytes = input.shape[0] * row_bytes(input)
    rows_out = sum(args.out_splits)
    if output is None:
        output = input.new_empty((rows_out,) + tuple(input.shape[1:]))
    elif output.shape[0] != rows_out:
        raise ValueError(f"{_NAME}: output has {output.shape[0]} rows but the peers send {rows_out} "
                         f"(out_splits={args.out_splits}); allocate sum(out_splits) rows or pass output=None")
    if world == 1 or row_bytes(input) == 0:
        # One rank: a copy. Zero-width rows: nothing to move on any rank (row shapes agree).
        if world == 1 and rows_out:
            output.copy_(input)
        return done(output) if async_op else output
    algo, topo, agreed_bytes = _choose(algorithm, input, topology, group, world, agreed_bytes, timeout)
    copy_back = not output.is_contiguous()
    out_work = output.contiguous() if copy_back else output
    # _finish writes a copy back through the caller's strides from a 1-D work buffer.
    p = Prepared(output, out_work.view(-1), out_work.view(-1), None, copy_back)
    ctx = context()
    if algo != "flat":
        ctx.prepare(topo, (algo,), timeout)
        if chunks is None:
            if agreed_bytes is None:
                agreed_bytes = _mean_bytes(input, group, world, timeout)
            chunks = algorithms.get(algo).chunks(cost.model_for(topo, timeout=timeout), "alltoall", agreed_bytes, topo)
    impl = algorithms.get(algo)
    call = ctx.call(impl, "alltoall", p, None, group, topo, timeout, not async_op, chunks or 1, input.contiguous(),
                    args)
    fut = impl.start(call)
    return _deliver(fut, async_op, timeout, f"{_NAME}/{algo}")


# --------------------------------------------------------------------------------- autograd
class _AllToAll(torch.autograd.Function):
    """Forward: all-to-all with (in_splits, out_splits); backward: the reverse all-to-all of the
    gradient with the splits swapped (rank j's gradient rows for what rank i sent go back to i)."""

    @staticmethod
    def forward(ctx, input, in_splits, out_splits, group, topology, algorithm, chunks, timeout, name):
        with _named(name, "forward"):
            out = all_to_all(None, input, in_splits=in_splits, out_splits=out_splits, group=group,
                             topology=topology, algorithm=algorithm, chunks=chunks, timeout=timeout)
        ctx.splits = (in_splits, out_splits)
        ctx.comm = (group, topology, algorithm, chunks, timeout, name)
        return out

    @staticmethod
    def backward(ctx, grad):
        in_splits, out_splits = ctx.splits
        group, topology, algorithm, chunks, timeout, name = ctx.comm
        with _named(name, "backward"):
            g = all_to_all(None, grad.contiguous(), in_splits=out_splits, out_splits=in_splits, group=group,
                           topology=topology, algorithm=algorithm, chunks=chunks, timeout=timeout)
        return g, None, None, None, None, None, None, None, None


@contextlib.contextmanager
def _named(name: str | None, direction: str):
    """``CommError``s raised inside re-raised with the same type, sequence and ranks, their message
    prefixed by the caller's ``name`` and the pass (``forward`` / ``backward``), so that an error names
    the call the user made (``ulysses_attention``) rather than only the all-to-all inside it."""
    if name is None:
        yield
        return
    try:
        yield
    except CommError as exc:
        raise type(exc)(f"{name} ({direction}): {exc.message}", op=f"{name.split(':')[0]}/{exc.op or _NAME}",
                        seq=exc.seq, ranks=exc.ranks) from exc


def all_to_all_autograd(input: torch.Tensor, in_splits: Splits = None, out_splits: Splits = None, *,
                        group: ProcessGroup | None = None, topology: Topology | None = None, algorithm: str = "auto",
                        chunks: int | None = None, timeout: float | None = None,
                        name: str | None = None) -> torch.Tensor:
    """A differentiable :func:`all_to_all` that allocates its output (for MoE dispatch and combine).

    The backward pass is the reverse all-to-all: splits swapped, same algorithm. When only
    ``in_splits`` is given, the output splits are exchanged once in the forward pass and reused.

    Args:
        input: rows to send (dim 0), any floating dtype for gradients.
        in_splits, out_splits: as in :func:`all_to_all`.
        group, topology, algorithm, chunks, timeout: as in :func:`all_to_all`.
        name: the caller's operation (``"ulysses_attention: ..."``): errors of the exchange, forward
            and backward, name it first.

    Returns:
        The received rows, ``sum(out_splits)`` of them.
    """
    world = dist.get_world_size(group) if dist.is_initialized() else 1
    ins = _as_list("in_splits", in_splits)
    outs = _as_list("out_splits", out_splits)
    if ins is None and outs is None:
        ins, problem = _even(input.shape[0] if input.dim() else 0, world, "input")
        if problem:
            raise ValueError(f"{_NAME}: {problem}")
        outs = list(ins)
    elif outs is None:
        outs = exchange_splits(ins, group=group, timeout=timeout)
    elif ins is None:
        ins, problem = _even(input.shape[0] if input.dim() else 0, world, "input")
        if problem:
            raise ValueError(f"{_NAME}: {problem}")
    return _AllToAll.apply(input, ins, outs, group, topology, algorithm, chunks, timeout, name)


# --------------------------------------------------------------------------------- figures
def _grid_topology(num_nodes: int, ranks_per_node: int) -> Topology:
    p = num_nodes * ranks_per_node
    nodes = tuple(tuple(range(k * ranks_per_node, (k + 1) * ranks_per_node)) for k in range(num_nodes))
    return Topology(nodes=nodes, rank=0, world_size=p)


def link_bytes(algorithm: str, nbytes: float, topology: Topology) -> float:
    """Bytes one node's link carries in each direction for an even all-to-all of ``nbytes`` per rank.

    Equal for ``flat`` and ``2d`` (each of a node's L ranks sends (p - L)/p of its buffer off-node,
    the 2-D one just in fewer, larger messages); ``auto`` is whichever it picks.
    """
    _known(algorithm)
    return cost.link_bytes("flat" if algorithm == "auto" else algorithm, nbytes, topology, "alltoall")


def predict(algorithm: str, nbytes: float, topology: Topology, model: cost.CostModel | None = None) -> float:
    """Predicted seconds of an even all-to-all of ``nbytes`` per rank (the whole input buffer, p
    blocks) with ``algorithm`` (``"auto"``: what :func:`choose_algorithm` picks) under the level
    model (``model`` None: the documented defaults). ``2d`` on a one-level topology runs ``flat``."""
    model = model or cost.CostModel(cost.DEFAULT_INTRA, cost.DEFAULT_INTER)
    if algorithm == "auto":
        algorithm = choose_algorithm(nbytes, topology, model)
    _known(algorithm)
    algorithm = algorithms.get(algorithm).runs(topology, "alltoall")  # 2d on one level runs flat
    return cost.predict(algorithm, nbytes, topology, model, op="alltoall")


def choose_algorithm(nbytes: float, topology: Topology, model: cost.CostModel | None = None, *,
                     timeout: float | None = None) -> str:
    """What ``algorithm="auto"`` runs for an all-to-all of ``nbytes`` per rank on ``topology``.

    In order: ``flat`` on one-level or non-uniform topologies; with an explicit ``model``, its
    prediction; the measured per-algorithm lines of :func:`calibrate` for this layout, when it ran;
    the level model ``auto`` uses for every collective (``cost.model_for``: collective on first use).
    """
    if topology.num_nodes in (1, topology.world_size) or not topology.is_uniform:
        return "flat"
    options = [a for a in algorithms.candidates("alltoall") if algorithms.get(a).supports(topology, "alltoall") is None]
    if model is None:
        fitted = context().measured_lines.get(_calibration_key(topology))
        if fitted is not None and all(a in fitted for a in options):
            return cost.choose(options, nbytes, topology, None, op="alltoall", measured=fitted)
        model = cost.model_for(topology, timeout=timeout)
    return cost.choose(options, nbytes, topology, model, op="alltoall")


def _calibration_key(topology: Topology) -> tuple:
    return cost.lines_key("alltoall", topology)


def calibrate(topology: Topology, *, sizes: tuple[int, int] = (16 * 1024, 4 << 20), reps: int = 3,
              chunks: int | None = None) -> dict[str, cost.LinkModel]:
    """Time ``auto``'s all-to-all candidates (``flat`` and ``2d``) on this machine and let ``auto``
    choose from the measurements.

    ``cost.measure_lines`` times each at two per-rank sizes (``reps`` calls back to back after a
    warm-up and a barrier, the slowest rank's seconds per call) and fits each an effective
    ``alpha + S * beta`` line, rank 0's broadcast: what the level model cannot see is this machine's
    cost of each extra synchronising phase (thread hand-offs, the copies, a CPU shared by many
    ranks), which decides small exchanges. Stored in commopt's one cache per layout (released by
    ``destroy()``); collective over the topology's group.

    Returns:
        ``{"flat": LinkModel, "2d": LinkModel}``, or ``{}`` where ``auto`` is always ``flat``.
    """
    if topology.world_size == 1 or topology.num_nodes in (1, topology.world_size) or not topology.is_uniform:
        return {}
    world, group = topology.world_size, topology.group

    def make_call(algo: str, nbytes: int) -> Callable[[], object]:
        x = torch.zeros(nbytes // 4, dtype=torch.float32)
        out = torch.empty_like(x)
        return lambda: all_to_all(out, x, topology=topology, algorithm=algo, chunks=chunks, group=group)

    # Whole float32 rows, at least one per rank: the bytes each call really moves.
    exact = [max(1, s // (4 * world)) * 4 * world for s in sizes]
    fits = cost.measure_lines(topology, algorithms.candidates("alltoall"), make_call, exact, reps)
    context().measured_lines.put(_calibration_key(topology), fits)
    return fits


def predicted_ratio(num_nodes: int, ranks_per_node: int, nbytes: float, model: cost.CostModel | None = None) -> float:
    """Predicted time of ``2d`` over ``flat`` (below 1: 2-D faster) for ``nbytes`` per rank on
    ``num_nodes`` x ``ranks_per_node`` ranks, under ``model`` (default: the documented defaults)."""
    model = model or cost.CostModel(cost.DEFAULT_INTRA, cost.DEFAULT_INTER)
    topo = _grid_topology(num_nodes, ranks_per_node)
    return predict("2d", nbytes, topo, model) / predict("flat", nbytes, topo, model)


def crossover_bytes(num_nodes: int, ranks_per_node: int, model: cost.CostModel | None = None,
                    lo: float = 64.0, hi: float = float(1 << 40)) -> float | None:
    """The per-rank buffer size (bytes) above which the model predicts ``flat`` at least as fast as
    ``2d``; None when one of them wins over the whole range [lo, hi]."""
    def ratio(s: float) -> float:
        return predicted_ratio(num_nodes, ranks_per_node, s, model)

    if (ratio(lo) < 1) == (ratio(hi) < 1):
        return None
    a, b = lo, hi
    for _ in range(200):
        mid = math.sqrt(a * b)
        if (ratio(mid) < 1) == (ratio(lo) < 1):
            a = mid
        else:
            b = mid
        if b / a < 1.001:
            break
    return b
