"""The compressed reduction of a list of tensors: layout, agreed checks, error feedback, phases.

One code path serves the DDP hook (a bucket's gradients) and ``Compressor.all_reduce`` (one tensor).
Phases, all through the comm engine (DESIGN 2, rule 1), each on a process group of its own role:

flat:          (1) check   (2..) the compressor's rounds over the whole group   (3) unstage
hierarchical:  (1) check   (2) reduce-scatter intra-node, exact (point-to-point transfers on gloo)
               (3..) the compressor's rounds on the rail (inter-node) group, on this rank's 1/L shard
               (4) all-gather intra-node, exact   (5) unstage

(1) is a tiny all-reduce (MAX of [non-finite flag, max |x|, and the input's signature]) over the
whole group whose bytes are counted: it makes "some rank has a NaN/Inf" and "max |x|" values every
rank agrees on (DESIGN 2, rule 2), for compressors that need an agreed scale (int8/int4,
``FP16Compressor(agreed_scale=True)``), and raises ``CollectiveMismatchError`` on every rank when the
ranks' inputs differ (see "agreement on the input" below). A non-finite step reduces exactly (NaN
propagates, AMP's skipped step) and leaves residuals untouched; ``check_finite=True`` raises
``NonFiniteError`` on every rank instead.

Every wait is bounded by the caller's ``timeout`` (the creation of the groups on the first call
too): ``CommTimeoutError`` when a rank never arrives.

Optimistic compressors (``compressor.optimistic``: the fp16/bf16 casts, PowerSGD) skip (1): their
rounds' reduced results are identical on every rank of the round's group, so "is it non-finite" is
already agreed there. A round that finds NaN/Inf (an fp16 overflow, or a NaN/Inf input) sets
``job.nonfinite``; right after the last round, on the same engine worker, the exchange redoes the
reduction exactly in fp32 from the kept input (this rank's shard without its residual) on a group of
its own role (``cmp-<name>-exact``: only that worker ever issues on it, in its FIFO order) and leaves
the residuals untouched. With ``check_finite=True`` a result still non-finite after that raises
``NonFiniteError`` on every rank: in flat mode right there (the whole group holds the same result);
in hierarchical mode only after the intra-node all-gather, where every rank holds the same full
vector (raising on one rail only would leave the other rail's ranks blocked in the all-gather). In
hierarchical mode residuals are likewise kept only when that full result is finite, so a step that
some rank would skip changes no rank's residuals.

Layout. Element-wise compressors see the tensors staged into one flat vector, each tensor starting
at a multiple of ``compressor.align`` (so per-block scales never mix two tensors, and a tensor of
zeros, e.g. an unused parameter, decodes to zeros). In hierarchical mode the intra-node phase
splits that vector into L equal shards and only the rail exchange of this rank's shard is
compressed. Matrix compressors (PowerSGD) need whole tensors: in hierarchical mode the tensors are
partitioned among the L local ranks by size (largest first onto the least loaded local rank,
deterministic from shapes), each local rank's tensors form one section, sections are padded to the
largest, and the reduce-scatter hands every local rank the node sum of whole matrices.
"""

from __future__ import annotations

import functools
import time
import weakref
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch.distributed import ReduceOp

from ... import kernels
from .. import cost
from ..engine import Phase, wait_work
from ..errors import CollectiveMismatchError, NonFiniteError, TopologyError
from ..runtime import context
from ..topology import Topology
from .base import (
    Compressor,
    CompressorState,
    Job,
    all_finite,
    all_gather_single,
    check_tag,
    compute_dtype,
    derive_seed,
    tag_of,
)
from .feedback import ErrorFeedback

__all__ = ["reduce_tensors", "Layout", "layout_for"]

reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


@dataclass
class Layout:
    """Where each tensor sits in the staged vector, and this rank's shard of it.

    Attributes:
        offsets: start of each tensor in the staged vector.
        total: staged length (a multiple of every chunking the exchange needs).
        lo, hi: this rank's shard (the whole vector in flat mode).
        owned: indices of the tensors lying wholly in the shard (all of them in flat mode).
        plain: offsets are exactly ``kernels.flatten``'s with ``align`` (staging can use it).
    """

    offsets: list[int]
    total: int
    lo: int
    hi: int
    owned: list[int] = field(default_factory=list)
    plain: bool = True


def _round_up(v: int, unit: int) -> int:
    return -(-v // unit) * unit if unit > 1 else v


def layout_for(compressor: Compressor, numels: list[int], *, local_size: int, local_rank: int,
               rail_size: int) -> Layout:
    """The staged layout; ``local_size == 1`` means flat mode (``rail_size`` is then the group size)."""
    align = compressor.align
    if compressor.needs_matrices and local_size > 1:
        sections: list[list[int]] = [[] for _ in range(local_size)]
        loads = [0] * local_size
        for i in sorted(range(len(numels)), key=lambda i: (-numels[i], i)):
            j = min(range(local_size), key=lambda j: (loads[j], j))
            sections[j].append(i)
            loads[j] += numels[i]
        size = max(loads)
        offsets = [0] * len(numels)
        for j, members in enumerate(sections):
            pos = j * size
            for i in sorted(members):
                offsets[i] = pos
                pos += numels[i]
        lo = local_rank * size
        return Layout(offsets, local_size * size, lo, lo + size, sorted(sections[local_rank]), plain=False)
    offs = kernels.reference.flatten_offsets(numels, align)
    unit = align * (rail_size if compressor.chunked else 1) * local_size
    total = _round_up(offs[-1], unit)
    shard = total // local_size
    lo = local_rank * shard
    owned = list(range(len(numels))) if local_size == 1 else []
    return Layout(offs[:-1], total, lo, lo + shard, owned)


def _stage(tensors: list[torch.Tensor], layout: Layout, dtype: torch.dtype, align: int,
           alias: bool = False) -> torch.Tensor:
    """Copy ``tensors`` into a new staged vector of ``dtype`` (zeros between and after them).

    With ``alias``, one contiguous tensor that is already the whole staged vector is used as it is
    (no copy): for optimistic compressors, which never write the staged vector before the last
    phase overwrites the tensors with the result.
    """
    device = tensors[0].device
    one = tensors[0]
    if (alias and len(tensors) == 1 and layout.plain and layout.total == one.numel() and one.dtype == dtype
            and one.is_contiguous()):
        return one.view(-1)
    if layout.plain and all(t.dtype == dtype for t in tensors):
        out = torch.empty(layout.total, dtype=dtype, device=device)
        kernels.flatten(tensors, out, align=align)
        return out
    out = torch.zeros(layout.total, dtype=dtype, device=device)
    for t, off in zip(tensors, layout.offsets):
        out[off: off + t.numel()].copy_(t.reshape(-1))
    return out


def _stage_sum(sources: list[torch.Tensor], residuals: list[torch.Tensor], offsets: list[int], total: int,
               dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A new vector of ``total`` elements: ``sources[i] + residuals[i]`` at ``offsets[i]``, zeros
    elsewhere; one pass (no staged copy of the sources first)."""
    out = torch.empty(total, dtype=dtype, device=device)
    end = 0
    for src, r, off in sorted(zip(sources, residuals, offsets), key=lambda e: e[2]):
        if off > end:
            out[end: off].zero_()
        torch.add(src.reshape(-1), r, out=out[off: off + r.numel()])
        end = off + r.numel()
    out[end:].zero_()
    return out


def _unstage(buf: torch.Tensor, tensors: list[torch.Tensor], layout: Layout) -> None:
    """Write the staged vector back into ``tensors`` (in their dtype)."""
    if not tensors:
        return
    dtype = tensors[0].dtype
    src = buf if buf.dtype == dtype else buf.to(dtype)
    kernels.unflatten(src, tensors, layout.offsets)


def _same_group(a, b) -> bool:
    """Whether two process-group arguments name the same group (None is WORLD)."""
    world = dist.group.WORLD
    return (world if a is None else a) is (world if b is None else b)


def _resolve(algorithm: str, group, topology: Topology | None, timeout: float | None = None) -> Topology | None:
    """The hierarchical topology, or None for a flat exchange (detecting it is bounded by ``timeout``)."""
    if algorithm == "flat":
        return None
    if algorithm not in ("hierarchical", "auto"):
        raise ValueError(f"compressed all-reduce: algorithm {algorithm!r} is not supported; use 'flat', "
                         f"'hierarchical' (compresses the inter-node phase only) or 'auto'")
    topo = context().topology(topology, group, timeout)
    if not topo.is_uniform:
        if algorithm == "hierarchical":
            raise TopologyError(f"compressed hierarchical all-reduce needs nodes of equal size, got "
                                f"{[len(n) for n in topo.nodes]} ({topo.layout}); use algorithm='auto' "
                                f"(falls back to flat) or 'flat'", op="compress")
        return None
    if topo.num_nodes == 1 or topo.local_size == 1:
        return None  # one level only: nothing to keep exact
    return topo


# ----------------------------------------------------------------------------- agreement on the input
# Without validation, ranks holding different tensors must still fail loudly, never return wrong
# values: gloo fails on collectives of different lengths (a C++ abort on one side, an error on the
# other) but not on different tensors of equal staged length (block alignment pads [100] and [200]
# to the same vector), nor on fp32 and fp64 buffers of equal bytes. So every exchange compares a
# signature of its input on every rank, in a collective it runs anyway: the check phase's MAX
# all-reduce carries [s, -s, h, -h] (s = element count and dtype, h = a 52-bit hash of the shapes,
# dtype, compressor settings, step decision and op); optimistic exchanges append a tag of h to their
# first all-reduced payload (``base.tag_of``) and, in hierarchical mode, all-reduce [s, -s, h, -h]
# over the node alongside the intra-node reduce-scatter (no rail collective of its own).
_DTYPES = (torch.float64, torch.float32, torch.bfloat16, torch.float16)


def _dtype_code(dtype: torch.dtype) -> int:
    return _DTYPES.index(dtype) + 1 if dtype in _DTYPES else 15


def _describe(s: int) -> str:
    code = s % 16
    return f"{s // 16} elements of {_DTYPES[code - 1] if 1 <= code <= len(_DTYPES) else 'another dtype'}"


def _signature(compressor: Compressor, dtype: torch.dtype, numels: list[int], shapes: list[tuple[int, ...]],
               active: bool, average: bool) -> tuple[int, int]:
    """(s, h): the element count and dtype code, and a 52-bit hash of everything the exchange's
    collectives depend on (exact in float64, so a MAX all-reduce compares them); the shapes count
    only for matrix compressors (element-wise ones reduce same-sized tensors of any shape alike)."""
    s = sum(numels) * 16 + _dtype_code(dtype)
    h = derive_seed(0, "compress-signature", repr(sorted(compressor.config().items())), str(dtype),
                    int(active), int(average), repr(shapes if compressor.needs_matrices else numels))
    return s, h & ((1 << 52) - 1)


def _agreement(s: int, h: int, device: torch.device) -> torch.Tensor:
    """What a MAX all-reduce of the signature reduces: [s, -s, h, -h] (max and minus min)."""
    return torch.tensor([s, -s, h, -h], dtype=torch.float64, device=device)


def _disagreement(values: torch.Tensor, mine: int, what: str, op: str) -> CollectiveMismatchError | None:
    """The error for MAX-reduced [s, -s, h, -h] whose max and min differ, else None (agreed)."""
    smax, smin, hmax, hmin = (int(v) for v in values.tolist())
    smin, hmin = -smin, -hmin
    if smax == smin and hmax == hmin:
        return None
    if smax != smin:
        detail = f"from {_describe(smin)} to {_describe(smax)}"
    else:
        detail = f"{_describe(mine)} everywhere, but different shapes, compressor settings, steps or ops"
    return CollectiveMismatchError(
        f"the ranks of this compressed all-reduce hold different tensors: {detail} (this rank: {what}); "
        f"pass tensors of the same shapes and dtype, and the same compressor settings, step and op, on every "
        f"rank (AllReduceState(validate=True) names the ranks that differ)", op=op)


def _deadline(timeout: float | None) -> float | None:
    return None if timeout is None else time.monotonic() + timeout


def _wait_until(work, deadline: float | None) -> None:
    """``wait_work`` bounded by a deadline shared by several works (one phase: one timeout)."""
    wait_work(work, None if deadline is None else max(1e-3, deadline - time.monotonic()))


def _post_reduce_scatter(inp: torch.Tensor, group) -> tuple[list, torch.Tensor, torch.Tensor]:
    """Post a reduce-scatter over ``group`` as point-to-point transfers: (works, this rank's own
    block of ``inp``, the other ranks' blocks as received, once the works complete).

    gloo's own reduce-scatter is an all-reduce in disguise (slower than direct transfers, which send
    the optimal (L-1)/L), and its work ignores ``wait(timeout)``: a rank that never arrives would
    block the worker until the group's own timeout. Point-to-point works honour it.
    """
    size, me = dist.get_world_size(group), dist.get_rank(group)
    ranks = dist.get_process_group_ranks(group)
    blocks = inp.view(size, -1)
    others = [j for j in range(size) if j != me]
    parts = blocks.new_empty(len(others), blocks.shape[1])
    works = []
    for k, j in enumerate(others):
        works.append(dist.isend(blocks[j], ranks[j], group=group))
        works.append(dist.irecv(parts[k], ranks[j], group=group))
    return works, blocks[me], parts


@dataclass
class _Ctx:
    nonfinite: bool = False
    amax: float = 0.0
    exact: bool = False
    job: Job | None = None
    shard: torch.Tensor | None = None
    resid: torch.Tensor | None = None
    server: torch.Tensor | None = None
    full_nonfinite: bool = False  # hierarchical, optimistic: the gathered result holds NaN/Inf
    averaged: bool = False  # the division by the world size already happened (before the all-gather)


def reduce_tensors(compressor: Compressor, tensors: list[torch.Tensor], keys: list[str], *, group=None,
                   topology: Topology | None = None, algorithm: str = "flat", average: bool = True,
                   step: int = 0, seed: int = 0, feedback: ErrorFeedback | None = None,
                   state: CompressorState | None = None, check_finite: bool = False,
                   timeout: float | None = None) -> torch.futures.Future:
    """Reduce ``tensors`` (contiguous, one floating dtype) in place over ``group`` through ``compressor``.

    Args:
        compressor: the compressor.
        tensors: the tensors (a DDP bucket's gradients, or one tensor); overwritten with the result.
        keys: one stable key per tensor (error feedback, warm starts, seeds).
        group: the process group (None: WORLD).
        topology: its layout; None detects it when ``algorithm`` is not ``"flat"``.
        algorithm: ``"flat"``, ``"hierarchical"`` or ``"auto"``.
        average: divide the sum by the group size.
        step: the training step (seeds; PowerSGD's start iteration).
        seed: the seed shared by all ranks.
        feedback: residual memory (used by biased compressors), or None.
        state: the compressor's per-run state (``compressor.new_state()``: PowerSGD's warm starts);
            None: the compressor's default state.
        check_finite: raise ``NonFiniteError`` on every rank when any rank holds NaN/Inf.
        timeout: seconds each collective may take.

    Returns:
        A Future completing with None once ``tensors`` hold the result.
    """
    if not isinstance(compressor, Compressor):
        raise TypeError(f"compress: compressor must be a commopt.comm.compression compressor instance, got "
                        f"{type(compressor).__name__}")
    where = f"compress/{compressor.name}"
    if not isinstance(tensors, (list, tuple)) or not tensors or not all(
            isinstance(t, torch.Tensor) and t.layout == torch.strided and t.is_contiguous() for t in tensors):
        raise TypeError(f"{where}: tensors must be a non-empty list of dense, contiguous torch.Tensors, got "
                        f"{[type(t).__name__ for t in tensors] if isinstance(tensors, (list, tuple)) else tensors!r}; "
                        f"for one tensor of any layout use compressor.all_reduce(tensor)")
    if not isinstance(keys, (list, tuple)) or len(keys) != len(tensors) or not all(isinstance(k, str) for k in keys):
        raise TypeError(f"{where}: keys must be a list of {len(tensors)} str (one stable key per tensor), got {keys!r}")
    if len({t.device for t in tensors}) != 1:
        raise ValueError(f"{where}: tensors must be on one device, got {sorted({str(t.device) for t in tensors})}")
    if topology is not None and not _same_group(topology.group, group):
        raise ValueError(f"{where}: the topology describes another process group than "
                         f"group={group!r}; build it over the group reduced over, e.g. "
                         f"Topology.from_spec(spec, group=group), or pass group=topology.group")
    dtypes = {t.dtype for t in tensors}
    if len(dtypes) != 1 or not tensors[0].is_floating_point():
        raise TypeError(f"compress/{compressor.name}: tensors must share one floating dtype, got "
                        f"{sorted(map(str, dtypes))}")
    # Stage tensors in the order of their keys, not DDP's bucket order: the layout (chunk owners,
    # sampling, rounding streams) then depends only on which parameters share the bucket, so the
    # first iteration after a restart (DDP's initial buckets) matches the rebuilt buckets it replaces.
    order = sorted(range(len(keys)), key=lambda i: keys[i])
    tensors, keys = [tensors[i] for i in order], [keys[i] for i in order]
    run_state = compressor.check_state(state, where)
    world = dist.get_world_size(group)
    topo = _resolve(algorithm, group, topology, timeout)
    flat_topo = Topology.from_spec(f"1x{world}", group=group)
    name = compressor.name
    optimistic = bool(compressor.optimistic)
    # Optimistic exchanges start at their first round, checked ones after the check: a queue must
    # keep one feeder (DESIGN 2), so the two modes of one compressor family use groups of their own.
    role = f"cmp-{name}-opt" if optimistic else f"cmp-{name}"
    if topo is not None:
        local, local_rank = topo.local_size, topo.local_rank
        rs_group = context().groups(topo, f"{role}-rs", timeout).intra
        ag_group = context().groups(topo, f"{role}-ag", timeout).intra
        round_groups = [context().groups(topo, f"{role}-{i}", timeout).rail for i in range(compressor.n_rounds)]
        exact_group = context().groups(topo, f"{role}-exact", timeout).rail if optimistic else None
        rail_size = topo.num_nodes
    else:
        local, local_rank, rs_group, ag_group = 1, 0, None, None
        round_groups = [context().groups(flat_topo, f"{role}-{i}", timeout).intra for i in range(compressor.n_rounds)]
        exact_group = context().groups(flat_topo, f"{role}-exact", timeout).intra if optimistic else None
        rail_size = world
    check_group = None if optimistic else context().groups(flat_topo, "cmp-check", timeout).intra

    numels = [t.numel() for t in tensors]
    layout = layout_for(compressor, numels, local_size=local, local_rank=local_rank, rail_size=rail_size)
    cdtype = compute_dtype(tensors[0].dtype)
    device = tensors[0].device
    shapes = [tuple(tensors[i].shape) for i in layout.owned]
    active = compressor.active(step) and compressor.worth(layout.hi - layout.lo, shapes)
    use_ef = feedback is not None and compressor.biased
    uses_server = use_ef and compressor.uses_server_residual
    # Flat and optimistic with error feedback (PowerSGD): the rounds' input, gradient + residual, is
    # built in one pass straight from the tensors (first_round); a staged copy of the plain gradients
    # is made only for an exact step or a fallback (the tensors are not written before the last phase).
    lazy = topo is None and optimistic and use_ef and active
    staged = None if lazy else _stage(tensors, layout, cdtype, compressor.align, alias=optimistic)

    def staged_vec() -> torch.Tensor:
        nonlocal staged
        if staged is None:
            staged = _stage(tensors, layout, cdtype, compressor.align)
        return staged

    salt = derive_seed(seed, keys[0] if keys else "", len(keys), layout.lo)
    ctx = _Ctx()
    esize = cdtype.itemsize
    all_shapes = [tuple(t.shape) for t in tensors] if compressor.needs_matrices else []
    sig, sig_hash = _signature(compressor, tensors[0].dtype, numels, all_shapes, active, average)
    what = (f"{_describe(sig)} in {len(tensors)} tensor(s)"
            + (f" of shapes {all_shapes[:3]}{'...' if len(tensors) > 3 else ''}" if all_shapes else ""))
    tag = tag_of(sig_hash) if optimistic else None
    # gloo's reduce-scatter cannot be waited for with a bound (see _post_reduce_scatter); NCCL's can.
    native_rs = rs_group is not None and dist.get_backend(rs_group) == "nccl"

    def nonfinite_error() -> NonFiniteError:
        return NonFiniteError(
            f"a rank holds NaN or Inf in the tensors of {keys[:3]}{'...' if len(keys) > 3 else ''} "
            f"(step {step}); every rank raises (check_finite=True). Lower the learning rate or use "
            f"a loss scaler, or pass check_finite=False to reduce such steps exactly", op=f"compress/{name}")

    def check() -> int:
        """MAX over the group of [non-finite flag, max |x|, s, -s, h, -h] (the signature: see above)."""
        finite = torch.isfinite(staged)
        flags = torch.zeros(6, dtype=torch.float64, device=device)
        if staged.numel():
            flags[0] = float(not bool(finite.all()))
            flags[1] = float(torch.where(finite, staged.abs(), 0).max())
        flags[2:] = _agreement(sig, sig_hash, device)
        wait_work(dist.all_reduce(flags, op=ReduceOp.MAX, group=check_group, async_op=True), timeout)
        err = _disagreement(flags[2:], sig, what, f"compress/{name}/check")
        if err is not None:
            raise err  # every rank holds the same MAX: every rank raises, before any payload moved
        ctx.nonfinite, ctx.amax = bool(flags[0] > 0), float(flags[1])
        if ctx.nonfinite and check_finite:
            raise nonfinite_error()
        return int(cost.ALGORITHM_FACTORS["allreduce"](world) * flags.numel() * flags.element_size())

    def reduce_scatter() -> int:
        deadline = _deadline(timeout)
        ctx.shard = staged.new_empty(layout.hi - layout.lo)
        nbytes = (local - 1) * ctx.shard.numel() * esize
        agree = None
        if optimistic:  # no check phase ran: the node agrees on its input alongside the exchange
            values = _agreement(sig, sig_hash, device)
            agree = dist.all_reduce(values, op=ReduceOp.MAX, group=rs_group, async_op=True)
            nbytes += int(cost.ALGORITHM_FACTORS["allreduce"](local) * values.numel() * values.element_size())
        if native_rs:
            works = [reduce_scatter_single(ctx.shard, staged, op=ReduceOp.SUM, group=rs_group, async_op=True)]
        else:
            works, mine, parts = _post_reduce_scatter(staged, rs_group)
        err = None
        if agree is not None:
            _wait_until(agree, deadline)
            err = _disagreement(values, sig, what, f"compress/{name}/reduce_scatter")
        for w in works:
            try:
                _wait_until(w, deadline)  # even after a disagreement: no transfer is left writing
            except (RuntimeError, TimeoutError):
                if err is None:
                    raise
        if err is not None:
            raise err  # on every rank of the node; the other nodes' ranks time out on the rail
        if not native_rs:
            torch.add(mine, parts[0], out=ctx.shard)
            for k in range(1, parts.shape[0]):
                ctx.shard.add_(parts[k])
        # Counted apart (op "compress/<name>/intra"): these bytes cross the fast intra-node links,
        # the op's own count is what crosses the scarce inter-node ones.
        context().engine().count(f"compress/{name}/intra", nbytes)
        return 0

    def first_round(group) -> int:
        ctx.exact = ctx.nonfinite or not active
        n = dist.get_world_size(group) if group is not None else 1
        if ctx.exact or group is None:
            # Exact fallback (non-finite step, compression not started or not worth it): the same
            # collective on every rank of the group, because the decision was agreed or shape-made.
            shard = ctx.shard if ctx.shard is not None else staged_vec()[layout.lo: layout.hi]
            ctx.exact = True
            ctx.job = Job(x=shard, out=shard, sent=None, group=group, n=n, rank=0, step=step, seed=seed,
                          tag=tag, what=what)
            if group is None:
                return 0
            if tag is None:  # the check phase compared the ranks' inputs
                if shard.numel():
                    wait_work(dist.all_reduce(shard, op=ReduceOp.SUM, group=group, async_op=True), timeout)
                return int(cost.ALGORITHM_FACTORS["allreduce"](n) * shard.numel() * esize)
            # Optimistic (PowerSGD before start_iter): the tag rides with the payload (a copy; such
            # steps send the whole vector anyway).
            buf = torch.cat([shard, tag.to(dtype=shard.dtype, device=shard.device)])
            wait_work(dist.all_reduce(buf, op=ReduceOp.SUM, group=group, async_op=True), timeout)
            check_tag(ctx.job, buf[shard.numel():], f"compress/{name}/{rounds[0].name}")
            shard.copy_(buf[: shard.numel()])
            return int(cost.ALGORITHM_FACTORS["allreduce"](n) * buf.numel() * esize)
        shard = ctx.shard if ctx.shard is not None or lazy else staged[layout.lo: layout.hi]
        x = shard
        if use_ef and optimistic and (topo is None or compressor.needs_matrices):
            # Whole tensors in the shard: x = gradient + residual in one pass over the owned tensors,
            # read from the tensors themselves in flat mode; the shard is kept for a fallback.
            fb = feedback.get("worker", keys, numels, cdtype, device)
            owned = layout.owned
            srcs = [tensors[i] if shard is None else shard[layout.offsets[i] - layout.lo:][:numels[i]]
                    for i in owned]
            x = _stage_sum(srcs, [fb[i] for i in owned], [layout.offsets[i] - layout.lo for i in owned],
                           layout.hi - layout.lo, cdtype, device)
        elif use_ef:
            ctx.resid = _stage(feedback.get("worker", keys, numels, cdtype, device), layout, cdtype,
                               compressor.align)
            if optimistic:
                x = shard + ctx.resid[layout.lo: layout.hi]  # the shard itself is kept for a fallback
            else:
                shard.add_(ctx.resid[layout.lo: layout.hi])
        if uses_server:
            ctx.server = _stage(feedback.get("server", keys, numels, cdtype, device), layout, cdtype,
                                compressor.align)
        rank = dist.get_rank(group)
        chunk = x.numel() // n if compressor.chunked else 0
        owned = [(keys[i], layout.offsets[i] - layout.lo, tuple(tensors[i].shape)) for i in layout.owned]
        # Flat and lazy: the tensors can take the result themselves (no copy of out into them).
        direct = lazy and all(tensors[i].dtype == cdtype and tensors[i].is_contiguous() for i in layout.owned)
        ctx.job = Job(x=x, out=torch.empty_like(x), sent=torch.empty_like(x) if use_ef else None,
                      group=group, n=n, rank=rank, step=step, seed=seed, salt=salt, tensors=owned,
                      server=(ctx.server[layout.lo + rank * chunk: layout.lo + (rank + 1) * chunk]
                              if uses_server else None),
                      timeout=timeout, scale_hint=ctx.amax, total_ranks=world,
                      dest=[tensors[i] for i in layout.owned] if direct else None,
                      dest_scale=1.0 / world if average else 1.0, tag=tag, what=what, state=run_state)
        return rounds[0].fn(ctx.job)

    def later_round(i: int, group) -> int:
        if ctx.exact or ctx.job.nonfinite:
            return 0  # agreed: the exact path, or an earlier round's reduced result was non-finite
        # Each round issues its collective on its own group (same members, another role): two
        # buckets in flight must never share a queue between two rounds (DESIGN 2, rule 1).
        ctx.job.group = group
        return rounds[i].fn(ctx.job)

    def settle() -> int:
        """After the last round (optimistic compressors): the exact redo of a non-finite result."""
        job, nbytes = ctx.job, 0
        if not ctx.exact and job.nonfinite:
            # Every rank of the group saw the same reduced values, so all of them take this branch.
            shard = ctx.shard if ctx.shard is not None else staged_vec()[layout.lo: layout.hi]
            if exact_group is not None and shard.numel():
                wait_work(dist.all_reduce(shard, op=ReduceOp.SUM, group=exact_group, async_op=True), timeout)
                nbytes = int(cost.ALGORITHM_FACTORS["allreduce"](job.n) * shard.numel() * esize)
            ctx.exact = True
            job.out, job.out_scale = shard, 1.0
        if check_finite and topo is None and ctx.exact and not all_finite(job.out):
            raise nonfinite_error()  # flat: the whole group holds this same result
        return nbytes

    def round_phase(i: int):
        def fn(group) -> int:
            nbytes = first_round(group) if i == 0 else later_round(i, group)
            if optimistic and i == len(rounds) - 1:
                nbytes += settle()
            return nbytes
        return fn

    def keep_residuals() -> None:
        """Residual = what was meant minus what was sent, for the shard; zero where not owned."""
        if ctx.exact or ctx.full_nonfinite or not use_ef:
            return
        job = ctx.job
        fb = feedback.get("worker", keys, numels, cdtype, device)
        if topo is None or compressor.needs_matrices:
            # Each tensor lies wholly in the shard (owned) or wholly outside it (another local rank's
            # section): write each residual directly, one pass (none when the round computed it: the
            # view of sent becomes the residual), and zero the others.
            owned = set(layout.owned)
            for i, (t, off) in enumerate(zip(fb, layout.offsets)):
                if i in owned:
                    lo, hi = off - layout.lo, off - layout.lo + t.numel()
                    if job.sent_is_residual:
                        feedback.adopt("worker", keys[i], job.sent[lo: hi])
                    else:
                        torch.sub(job.x[lo: hi], job.sent[lo: hi], out=t)
                else:
                    t.zero_()
        else:
            keep = torch.zeros_like(ctx.resid)
            keep[layout.lo: layout.hi] = job.sent if job.sent_is_residual else job.x - job.sent
            _unstage(keep, fb, layout)
        if uses_server:
            server = torch.zeros_like(ctx.server)
            rank, chunk = job.rank, job.x.numel() // job.n
            start = layout.lo + rank * chunk
            server[start: start + chunk] = job.server
            _unstage(server, feedback.get("server", keys, numels, cdtype, device), layout)

    def all_gather() -> int:
        job = ctx.job
        out = job.out
        factor = job.out_scale / world if average else job.out_scale
        if out.dtype != staged.dtype or factor != 1.0:
            # Decode and average this shard before gathering (1/L of the data, not all of it).
            out = _scaled(out, factor, staged.dtype, job.out_scale == 1.0 and average, world)
            ctx.averaged = average
        job.out, job.out_scale = staged, 1.0  # the shard's result is gathered into the staged vector
        wait_work(all_gather_single(staged, out.contiguous(), group=ag_group, async_op=True), timeout)
        context().engine().count(f"compress/{name}/intra", (local - 1) * out.numel() * esize)
        if optimistic and (check_finite or use_ef) and not all_finite(staged):
            # Every rank of every rail now holds this same full vector: the decision is agreed.
            ctx.full_nonfinite = True
            if check_finite:
                raise nonfinite_error()
        return 0

    def finish() -> None:
        job = ctx.job
        if job.dest_written:
            return
        out = job.out
        base = 0 if out.numel() == layout.total else layout.lo
        divide = average and not ctx.averaged
        factor = job.out_scale / world if divide else job.out_scale
        for t, off in zip(tensors, layout.offsets):
            src = out[off - base: off - base + t.numel()].view(t.shape)
            if factor == 1.0:
                t.copy_(src)
            elif job.out_scale == 1.0 and divide:
                torch.div(src, world, out=t)
            else:
                torch.mul(src if src.dtype == cdtype else src.to(cdtype), factor, out=t)

    rounds = compressor.rounds()
    if len(rounds) != compressor.n_rounds:
        raise RuntimeError(f"{type(compressor).__name__}.rounds() returned {len(rounds)} rounds but declares "
                           f"n_rounds={compressor.n_rounds}")
    phases = [] if optimistic else [_phase("check", check_group, lambda g: check())]
    if topo is not None:
        phases.append(_phase("reduce_scatter", rs_group, lambda g: reduce_scatter()))
    for i, group in enumerate(round_groups):
        fn = round_phase(i)
        if group is None:  # a rail of one node: the exchange is local (exact)
            fn = first_round if i == 0 else (lambda g: 0)
        phases.append(_phase(rounds[i].name, group, fn))
    if topo is not None:
        phases.append(_phase("all_gather", ag_group, lambda g: all_gather()))
    phases.append(Phase("residuals", keep_residuals))
    phases.append(Phase("unstage", finish))
    return context().engine().submit(phases, op=f"compress/{name}", result=None, device=device)


def _scaled(out: torch.Tensor, factor: float, dtype: torch.dtype, divide: bool, world: int) -> torch.Tensor:
    """``out * factor`` in ``dtype`` (``out / world`` when ``divide``: the plain average), one pass."""
    if factor == 1.0:
        return out.to(dtype)
    if divide:
        return torch.div(out, world)
    return torch.mul(out if out.dtype == dtype else out.to(dtype), factor)


def _phase(name: str, group, body) -> Phase:
    """A phase whose byte count is known only once it ran (it may fall back to an exact reduction).

    Its ``fn`` holds the phase only weakly: a phase whose function refers back to it is a reference
    cycle, which would keep the phase, its closures and their process groups alive after
    ``commopt.comm.destroy()`` until the garbage collector happens to run (sockets and threads).
    """
    phase = Phase(name, None, group)
    phase.fn = functools.partial(_run_counted, weakref.ref(phase), body, group)
    return phase


def _run_counted(phase_ref: weakref.ref, body, group) -> None:
    nbytes = int(body(group) or 0)
    phase = phase_ref()
    if phase is not None:
        phase.nbytes = nbytes
