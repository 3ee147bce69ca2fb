"""The compressed reduction of a list of tensors, as a sequence of named stages (docs/architecture.md section 5.3).

One code path serves the DDP hook (a bucket's gradients), ``Compressor.all_reduce`` (one tensor)
and ``OverlapDataParallel``. :class:`CompressedReduction` derives once which path a call takes
(flat or hierarchical, checked or optimistic, with error feedback or without) and runs it as
stages, each a method readable on its own, each phase through the comm engine (docs/architecture.md section 3, rule 1)
on a process group of its own role:

==============  ==========================================================================
stage           on the caller's thread: the tensors into one staged vector (``layout.py``)
agree           (checked compressors) a tiny MAX all-reduce over the whole group: agree on
                finiteness, on ``max |x|`` and on the input's signature (phase "check")
reduce_scatter  (hierarchical) intra-node, exact, the hierarchical algorithm's own transport
                (``algorithms._transport``: concurrent point-to-point transfers)
exchange        per round: the codec's exchange generator (``Codec.exchange``) resumed for its
                next round, over the whole group (flat) or on the rail (inter-node) group on
                this rank's 1/L shard (hierarchical); it reads an ``Exchange`` and returns a
                ``Result``; an optimistic codec's last round settles a non-finite result by an
                exact redo
all_gather      (hierarchical) intra-node, exact, the same transport
apply_feedback  the residuals: what was meant minus what was sent (phase "residuals")
unstage         the result into the tensors, averaged
==============  ==========================================================================

"agree" makes "some rank has a NaN/Inf" and "max |x|" values every rank agrees on (docs/architecture.md section 3, rule
2), for compressors that need an agreed scale (int8/int4, ``FP16Compressor(agreed_scale=True)``),
and raises ``CollectiveMismatchError`` on every rank when the ranks' inputs differ
(``agreement.py``). Its bytes are counted. A non-finite step reduces exactly (NaN propagates,
AMP's skipped step) and leaves residuals untouched; ``check_finite=True`` raises ``NonFiniteError``
on every rank instead.

Every wait is bounded by the caller's ``timeout`` (the creation of the groups on the first call
too): ``CommTimeoutError`` when a rank never arrives.

Optimistic compressors (``compressor.optimistic``: the fp16/bf16 casts, PowerSGD) skip "agree":
their rounds' reduced results are identical on every rank of the round's group, so "is it
non-finite" is already agreed there. A round that finds NaN/Inf (an fp16 overflow, or a NaN/Inf
input) returns ``Result(nonfinite=True)``; right after the last round, on the same engine worker, the exchange
redoes the reduction exactly in fp32 from the kept input (this rank's shard without its residual)
on a group of its own role (``cmp-<name>-exact``: only that worker ever issues on it, in its FIFO
order) and leaves the residuals untouched. With ``check_finite=True`` a result still non-finite
after that raises ``NonFiniteError`` on every rank: in flat mode right there (the whole group holds
the same result); in hierarchical mode only after the intra-node all-gather, where every rank holds
the same full vector (raising on one rail only would leave the other rail's ranks blocked in the
all-gather). In hierarchical mode residuals are likewise kept only when that full result is
finite, so a step that some rank would skip changes no rank's residuals. Without a check phase to
compare the inputs, the optimistic first round carries the input's tag, and the hierarchical
reduce-scatter agrees on the signature over the node alongside its transfers.

``algorithm="auto"`` takes flat, hierarchical or synth, whichever the cost model predicts faster for
the compressor and the shapes (``auto.py``); flat where the levels share one resource or there is one
(synth only where the links differ).

``algorithm="synth"`` is the hierarchical path whose rounds are routed: the algorithm supplies a
:class:`Transport` (``Synth.codec_transport``: the rail's synthesized all-reduce and all-gather), which
the reduction hands the codec in its :class:`Exchange` and uses for its own exact fallbacks; the
codecs issue their summing all-reduces and their all-gathers through :func:`round_all_reduce` and
:func:`round_all_gather`, which run the group's own collective when nothing is routed. On one rank per
node synth is the one-level path over the whole group (its rail), routed the same way.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import numbers
from typing import Callable

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup, ReduceOp

from .. import algorithms
from ..algorithms._transport import done as done_future
from ..algorithms._transport import exchange_all_gather, exchange_reduce_scatter
from ..algorithms.base import INTER_PHASE
from ..algorithms.roles import COMPRESSED_CHECK
from ..checks import _check_op_dtype, _check_tensor, _op_name, agreed, check_group, check_timeout
from ..dispatch import exact_all_reduce
from ..engine import Phase, chain, wait, wait_work
from ..errors import NonFiniteError, TopologyError
from ..links import ALGORITHM_FACTORS
from ..runtime import context
from ..topology import Topology
from . import auto
from .agreement import agree_inputs, agreement, describe, disagreement, signature
from .codec import (
    Codec,
    CompressorState,
    Exchange,
    Result,
    Rounds,
    Transport,
    all_finite,
    all_gather_single,
    check_tag,
    compute_dtype,
    derive_seed,
    tag_of,
)
from .feedback import ErrorFeedback
from .layout import layout_for, stage, stage_sum, unstage

__all__ = ["compressed_all_reduce", "reduce_tensors", "CompressedReduction", "round_all_reduce", "round_all_gather",
           "routed"]


def routed(ex: Exchange) -> Transport | None:
    """The transport routing ``ex``'s rounds, or None (the groups' own collectives)."""
    return ex.transport


def round_all_reduce(ex: Exchange, i: int, buf: torch.Tensor) -> Callable[[], int]:
    """Start the SUM all-reduce of round ``i``'s ``buf`` (in place) over ``ex.groups[i]``: a function
    that waits for it (at most ``ex.timeout``) and returns the bytes this rank sent. The group's own
    all-reduce is issued at once (the caller may compute meanwhile); a routed one runs when waited for."""
    group, n, transport = ex.groups[i], ex.n, routed(ex)
    if transport is not None:
        return functools.partial(transport.all_reduce, buf, group, ex.timeout)
    work = dist.all_reduce(buf, op=ReduceOp.SUM, group=group, async_op=True) if buf.numel() else None

    def finish() -> int:
        if work is not None:
            wait_work(work, ex.timeout)
        return int(2 * (n - 1) / n * buf.numel() * buf.element_size())

    return finish


def round_all_gather(ex: Exchange, i: int, out: torch.Tensor, payload: torch.Tensor) -> int:
    """Round ``i``'s all-gather over ``ex.groups[i]``: ``out`` = every member's ``payload`` (equal
    sizes) in group-rank order; returns the bytes this rank sent."""
    transport = routed(ex)
    if transport is not None:
        return transport.all_gather(out, payload, ex.groups[i], ex.timeout)
    wait_work(all_gather_single(out, payload, group=ex.groups[i], async_op=True), ex.timeout)
    return (ex.n - 1) * payload.numel() * payload.element_size()


def compressed_all_reduce(compressor: Codec, tensor: torch.Tensor, op: ReduceOp = ReduceOp.SUM, *,
                          group: ProcessGroup | None = None, topology: Topology | None = None, algorithm: str = "flat",
                          async_op: bool = False, error_feedback: ErrorFeedback | None = None, key: str = "tensor",
                          step: int | None = None, seed: int = 0, check_finite: bool = False,
                          timeout: float | None = None,
                          state: CompressorState | None = None) -> torch.Tensor | torch.futures.Future:
    """Reduce one ``tensor`` in place over ``group`` through ``compressor``: what
    ``compressor.all_reduce(tensor, ...)`` and ``commopt.comm.all_reduce(tensor, compressor=...)``
    run (the arguments, the errors and the result are those of ``Compressor.all_reduce``).

    Checked at the call on every rank, before anything moves; the ranks' inputs are agreed
    (``agreement.agree_inputs``), then :func:`reduce_tensors` reduces the one tensor.
    """
    if not isinstance(compressor, Codec):
        raise TypeError(f"compressed all-reduce: compressor must be a commopt.comm.compression compressor "
                        f"instance (e.g. FP16Compressor()), got {type(compressor).__name__}")
    name = f"{type(compressor).__name__}.all_reduce"
    timeout = _check_call(name, tensor, group, topology, algorithm, error_feedback, key, step, seed, timeout)
    state = compressor.check_state(state, name)
    if not tensor.is_floating_point():  # integers and bool pass through, exactly (bit-exact SUM)
        _check_tensor(name, tensor)
        op_name = _op_name(op)
        _check_op_dtype(name, op_name, tensor.dtype)
        if not dist.is_initialized() or dist.get_world_size(group) == 1 or tensor.numel() == 0:
            return done_future(tensor) if async_op else tensor
        return exact_all_reduce(tensor, op_name, group=group, topology=topology,
                                algorithm="flat" if algorithm == algorithms.AUTO else algorithm,
                                async_op=async_op, timeout=timeout, agreement=True)
    if op not in (ReduceOp.SUM, ReduceOp.AVG):
        raise ValueError(f"{name}: op {op} is not supported; compressors reduce with ReduceOp.SUM or "
                         f"ReduceOp.AVG")
    if step is None:
        step = state.calls
    if compressor.biased and error_feedback is None:
        compressor.warn_biased()
    if not dist.is_initialized() or dist.get_world_size(group) == 1 or tensor.numel() == 0:
        state.calls += 1
        return done_future(tensor) if async_op else tensor
    # In place like torch.distributed, also on a tensor that requires grad (no autograd record).
    target = tensor.detach()
    work = target if target.is_contiguous() else target.contiguous()
    failed = agreed(async_op, lambda: agree_inputs(compressor, [work], group=group, algorithm=algorithm,
                                                   average=op == ReduceOp.AVG, step=step, timeout=timeout))
    if failed is not None:
        return failed
    fut = reduce_tensors(compressor, [work], [key], group=group, topology=topology, algorithm=algorithm,
                         average=op == ReduceOp.AVG, step=step, seed=seed, feedback=error_feedback,
                         state=state, check_finite=check_finite, timeout=timeout)
    state.calls += 1  # a call refused before anything moved (bad input, a cold timeout) counts no step

    def finish(_value: object = None) -> torch.Tensor:
        if work is not target:
            target.copy_(work)
        return tensor

    if async_op:
        # chain, not Future.then: the caller's wait() re-raises the phase's exception with its
        # type (NonFiniteError, CommTimeoutError, CollectiveMismatchError), not a RuntimeError.
        return chain(fut, finish)
    wait(fut, None, op=f"compress/{compressor.name}")
    return finish()


def _check_call(name: str, tensor: object, group: object, topology: object, algorithm: object,
                error_feedback: object, key: object, step: object, seed: object,
                timeout: object) -> float | None:
    """Every argument of ``all_reduce``, checked at the call on every rank, before anything moves
    or changes; returns the timeout in seconds (None: no bound of commopt's own)."""
    if not isinstance(tensor, torch.Tensor):
        hint = " (convert it with torch.as_tensor(...) and reduce that)" if tensor is not None else ""
        raise TypeError(f"{name}: tensor must be a torch.Tensor, got {type(tensor).__name__}{hint}")
    if tensor.layout != torch.strided:
        raise TypeError(f"{name}: tensors of layout {tensor.layout} are not supported (only dense, strided "
                        f"tensors are compressed); reduce tensor.to_dense(), or the sparse tensor's values "
                        f"with torch.distributed directly")
    check_group(name, group)
    if topology is not None and not isinstance(topology, Topology):
        raise TypeError(f"{name}: topology must be a commopt.comm.Topology or None (detected), got "
                        f"{type(topology).__name__} {topology!r}; e.g. Topology.from_spec('2x2')")
    known = algorithms.names("allreduce", codec=True)
    if not isinstance(algorithm, str) or algorithm not in (*known, algorithms.AUTO):
        raise ValueError(f"{name}: algorithm {algorithm!r} is not supported; use {algorithms.AUTO!r} or one of "
                         f"{known} ('hierarchical' compresses the inter-node phase only)")
    if error_feedback is not None and not isinstance(error_feedback, ErrorFeedback):
        raise TypeError(f"{name}: error_feedback must be a compression.ErrorFeedback or None, got "
                        f"{type(error_feedback).__name__}")
    if not isinstance(key, str):
        raise TypeError(f"{name}: key must be a str (the stable name of this tensor's residual), got "
                        f"{type(key).__name__} {key!r}")
    if step is not None and (isinstance(step, bool) or not isinstance(step, numbers.Integral) or step < 0):
        raise ValueError(f"{name}: step must be an int >= 0 (the same on every rank) or None, got {step!r}")
    if isinstance(seed, bool) or not isinstance(seed, numbers.Integral):
        raise TypeError(f"{name}: seed must be an int (the same on every rank), got {type(seed).__name__}")
    return check_timeout(name, timeout)


def reduce_tensors(compressor: Codec, tensors: list[torch.Tensor], keys: list[str], *,
                   group: ProcessGroup | None = None, topology: Topology | None = None, algorithm: str = "flat",
                   average: bool = True, step: int = 0, seed: int = 0, feedback: ErrorFeedback | None = None,
                   state: CompressorState | None = None, check_finite: bool = False,
                   timeout: float | None = None) -> torch.futures.Future:
    """Reduce ``tensors`` (contiguous, one floating dtype) in place over ``group`` through ``compressor``,
    or with ``algorithm="rail"`` over this rank's rail of ``topology``.

    Args:
        compressor: the compressor.
        tensors: the tensors (a DDP bucket's gradients, or one tensor); overwritten with the result.
        keys: one stable key per tensor (error feedback, warm starts, seeds).
        group: the process group (None: WORLD).
        topology: its layout; None detects it when ``algorithm`` is not ``"flat"``.
        algorithm: ``"flat"``, ``"hierarchical"`` or ``"auto"`` (the one the cost model predicts
            faster for this compressor and these shapes: ``auto.choose``); or ``"rail"``: reduce
            over this rank's rail only (the ranks of the same local index, one per node), every rank
            of the group calling with tensors of the same shapes and the rails running side by side:
            the inter-node level of a reduction whose intra-node level already ran (compressed
            HSDP, ``fsdp.AllReduceHook``). Nodes of equal size; a node of one rank is exact.
        average: divide the sum by the number of ranks reduced over (the group's, or the rail's).
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
    if not isinstance(compressor, Codec):
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
        raise TypeError(f"{where}: tensors must share one floating dtype, got {sorted(map(str, dtypes))}")
    state = compressor.check_state(state, where)
    # Stage tensors in the order of their keys, not DDP's bucket order: the layout (chunk owners,
    # sampling, rounding streams) then depends only on which parameters share the bucket, so the
    # first iteration after a restart (DDP's initial buckets) matches the rebuilt buckets it replaces.
    order = sorted(range(len(keys)), key=lambda i: keys[i])
    tensors, keys = [tensors[i] for i in order], [keys[i] for i in order]
    topo, rails, transport = _resolve(algorithm, compressor, tensors, group, topology, timeout)
    return CompressedReduction(compressor, tensors, keys, group=group, topology=topo, average=average, step=step,
                               seed=seed, feedback=feedback, state=state, check_finite=check_finite,
                               timeout=timeout, rails=rails, transport=transport).submit()


class CompressedReduction:
    """One compressed reduction: its path, decided once, and its stages (see the module docstring).

    Built on the caller's thread, which stages the tensors; :meth:`submit` hands the phases to the
    engine. The phases hold this object (through bound methods); it never holds them, so nothing
    keeps a phase, and with it the process groups, alive past its run (docs/faults.md row 30).

    Attributes set once (the path):
        hierarchical: a two-level exchange (the rail rounds compressed, intra-node phases exact).
        optimistic: no "agree" stage (``compressor.optimistic``).
        use_ef: worker residuals are added and kept (error feedback with a biased compressor).
        uses_server: server residuals too (``compressor.uses_server_residual``).
        whole_tensors: each tensor lies wholly in this rank's shard or wholly outside it (flat mode,
            or the tensor-aligned sections of a matrix compressor).
        active: this step compresses (the compressor's start iteration, its ``worth``).
        lazy: flat, optimistic, with error feedback and active: the first round's input (gradient +
            residual) is built in one pass straight from the tensors, and the plain gradients are
            staged only for an exact step or a fallback (nothing writes the tensors before the end).

    Attributes one stage leaves for the next:
        staged: the staged vector (None while ``lazy``).
        nonfinite, amax: the agreed non-finite flag and max |x| ("agree").
        shard: this rank's node-summed shard (hierarchical "reduce_scatter").
        exact: the rounds reduce exactly (a non-finite or inactive step, or a fallback).
        ex, rounds, result: the codec's :class:`Exchange`, its running generator (``Codec.exchange``)
            and the :class:`Result` it returned (or the exact path's).
        resid, server: the staged worker and server residuals.
        full_nonfinite: hierarchical, optimistic: the gathered result holds NaN/Inf.
        averaged: the division by the world size already happened (before the all-gather).
    """

    def __init__(self, compressor: Codec, tensors: list[torch.Tensor], keys: list[str], *,
                 group: ProcessGroup | None, topology: Topology | None, average: bool, step: int, seed: int,
                 feedback: ErrorFeedback | None, state: CompressorState, check_finite: bool,
                 timeout: float | None, rails: Topology | None = None, transport: Transport | None = None) -> None:
        self.compressor, self.tensors, self.keys = compressor, tensors, keys
        self.transport = transport  # routes the rounds and the exact fallbacks (synth), or None
        self.name = compressor.name
        self.topo = topology
        self.average, self.step, self.seed = average, step, seed
        self.feedback, self.state = feedback, state
        self.check_finite, self.timeout = check_finite, timeout
        # rails: the flat path over this rank's rail of that topology (every phase on rail groups).
        self.world = rails.num_nodes if rails is not None else dist.get_world_size(group)
        self.round_names = tuple(compressor.rounds)
        if not self.round_names or not all(isinstance(r, str) for r in self.round_names):
            raise TypeError(f"{type(compressor).__name__}.rounds must be a non-empty tuple of round names, got "
                            f"{compressor.rounds!r}")
        # The flags that select the path, derived once.
        self.hierarchical = topology is not None
        self.optimistic = bool(compressor.optimistic)
        self.use_ef = feedback is not None and compressor.biased
        self.uses_server = self.use_ef and compressor.uses_server_residual
        self.whole_tensors = not self.hierarchical or compressor.needs_matrices
        self._make_groups(group, rails)
        self.numels = [t.numel() for t in tensors]
        self.layout = layout_for(compressor, self.numels, local_size=self.local, local_rank=self.local_rank,
                                 rail_size=self.rail_size)
        self.cdtype = compute_dtype(tensors[0].dtype)
        self.device = tensors[0].device
        self.esize = self.cdtype.itemsize
        lo, hi = self.layout.lo, self.layout.hi
        self.active = compressor.active(step) and compressor.worth(
            hi - lo, [tuple(tensors[i].shape) for i in self.layout.owned])
        self.lazy = not self.hierarchical and self.optimistic and self.use_ef and self.active
        self.salt = derive_seed(seed, keys[0] if keys else "", len(keys), lo)
        shapes = [tuple(t.shape) for t in tensors] if compressor.needs_matrices else []
        self.sig, self.sig_hash = signature(compressor, tensors[0].dtype, self.numels, shapes, self.active, average)
        self.what = (f"{describe(self.sig)} in {len(tensors)} tensor(s)"
                     + (f" of shapes {shapes[:3]}{'...' if len(tensors) > 3 else ''}" if shapes else ""))
        self.tag = tag_of(self.sig_hash) if self.optimistic else None
        # What the stages leave for each other.
        self.nonfinite, self.amax, self.exact = False, 0.0, False
        self.ex: Exchange | None = None
        self.running: Rounds | None = None
        self.result: Result | None = None
        self.shard: torch.Tensor | None = None
        self.resid: torch.Tensor | None = None
        self.server: torch.Tensor | None = None
        self.full_nonfinite = self.averaged = False
        self.staged = None if self.lazy else self.stage()

    def _make_groups(self, group: ProcessGroup | None, rails: Topology | None) -> None:
        """The process group of every phase role, created collectively (the same order everywhere).

        Optimistic exchanges start at their first round, checked ones after the check: a queue must
        keep one feeder (docs/architecture.md section 3), so the two modes of one compressor family use groups of their
        own. On rails, every group is this rank's rail of its role (the rails of every rank are created
        together, over the whole group).
        """
        ctx, timeout, n = context(), self.timeout, len(self.round_names)
        role = f"cmp-{self.name}-opt" if self.optimistic else f"cmp-{self.name}"
        # One level: every rank of the group as one node (its groups: .intra), or this rank's rail.
        if rails is not None:
            level, pick, suffix = rails, "rail", "-rail"
        else:
            level, pick, suffix = Topology.from_spec(f"1x{self.world}", group=group), "intra", ""

        def level_group(name: str):
            return getattr(ctx.groups(level, name + suffix, timeout), pick)

        if self.topo is not None:
            topo = self.topo
            self.local, self.local_rank, self.rail_size = topo.local_size, topo.local_rank, topo.num_nodes
            self.rs_group = ctx.groups(topo, f"{role}-rs", timeout).intra
            self.ag_group = ctx.groups(topo, f"{role}-ag", timeout).intra
            self.round_groups = [ctx.groups(topo, f"{role}-{i}", timeout).rail for i in range(n)]
            self.exact_group = ctx.groups(topo, f"{role}-exact", timeout).rail if self.optimistic else None
        else:
            self.local, self.local_rank, self.rail_size = 1, 0, self.world
            self.rs_group = self.ag_group = None
            self.round_groups = [level_group(f"{role}-{i}") for i in range(n)]
            self.exact_group = level_group(f"{role}-exact") if self.optimistic else None
        self.check_group = None if self.optimistic else level_group(COMPRESSED_CHECK)

    # ------------------------------------------------------------------------------- phases
    def phases(self) -> list[Phase]:
        """The stages after "stage", as engine phases in order."""
        out = [] if self.optimistic else [_phase("check", self.check_group, self.agree)]
        if self.hierarchical:
            out.append(_phase("reduce_scatter", self.rs_group, self.reduce_scatter))
        for i, group in enumerate(self.round_groups):
            out.append(_phase(self.round_names[i], group, functools.partial(self.exchange, i)))
        if self.hierarchical:
            out.append(_phase("all_gather", self.ag_group, self.all_gather))
        out.append(Phase("residuals", self.apply_feedback))
        out.append(Phase("unstage", self.unstage))
        return out

    def submit(self) -> torch.futures.Future:
        """Hand the phases to the engine: a Future completing with None once the tensors hold the result."""
        return context().engine().submit(self.phases(), op=f"compress/{self.name}", result=None, device=self.device)

    # ------------------------------------------------------------------------------- stage
    def stage(self) -> torch.Tensor:
        """The tensors in one staged vector of the compute dtype; an optimistic compressor, which
        never writes it before the result overwrites the tensors, uses a lone tensor that already
        is that vector in place."""
        return stage(self.tensors, self.layout, self.cdtype, self.compressor.align, alias=self.optimistic)

    def _own_shard(self) -> torch.Tensor:
        """This rank's part of the input, without residuals: the node-summed shard (hierarchical) or
        its section of the staged vector (staged now if the lazy path skipped it)."""
        return self.shard if self.shard is not None else self._staged()[self.layout.lo: self.layout.hi]

    def _staged(self) -> torch.Tensor:
        """The staged vector, staged now if the lazy path skipped it (an exact step or a fallback)."""
        if self.staged is None:
            self.staged = stage(self.tensors, self.layout, self.cdtype, self.compressor.align)
        return self.staged

    # ------------------------------------------------------------------------------- agree
    def agree(self, group: ProcessGroup | None) -> int:
        """MAX over the whole group of [non-finite flag, max |x|, s, -s, h, -h] (the signature)."""
        staged = self.staged
        finite = torch.isfinite(staged)
        flags = torch.zeros(6, dtype=torch.float64, device=self.device)
        if staged.numel():
            flags[0] = float(not bool(finite.all()))
            flags[1] = float(torch.where(finite, staged.abs(), 0).max())
        flags[2:] = agreement(self.sig, self.sig_hash, self.device)
        if group is not None:  # None: a group of one rank (a rail of one node)
            wait_work(dist.all_reduce(flags, op=ReduceOp.MAX, group=group, async_op=True), self.timeout)
        err = disagreement(flags[2:], self.sig, self.what, f"compress/{self.name}/check")
        if err is not None:
            raise err  # every rank holds the same MAX: every rank raises, before any payload moved
        self.nonfinite, self.amax = bool(flags[0] > 0), float(flags[1])
        if self.nonfinite and self.check_finite:
            raise self._nonfinite_error()
        return int(ALGORITHM_FACTORS["allreduce"](self.world) * flags.numel() * flags.element_size())

    # ------------------------------------------------------------------------------- reduce-scatter
    def reduce_scatter(self, group: ProcessGroup | None) -> int:
        """Intra-node, exact: this rank's shard of the node's sum (the hierarchical algorithm's own
        transport); an optimistic compressor's node agrees on its input alongside."""
        self.shard = self.staged.new_empty(self.layout.hi - self.layout.lo)
        nbytes, agree = 0, None
        if self.optimistic:  # no check phase ran: the node agrees on its input alongside the exchange
            values = agreement(self.sig, self.sig_hash, self.device)
            agree = dist.all_reduce(values, op=ReduceOp.MAX, group=group, async_op=True)
            nbytes += int(ALGORITHM_FACTORS["allreduce"](self.local) * values.numel() * values.element_size())
        failure = None
        try:
            nbytes += exchange_reduce_scatter(self.shard, self.staged, ReduceOp.SUM, group, self.timeout)
        except (RuntimeError, TimeoutError) as exc:
            if agree is None:
                raise
            failure = exc  # ranks of another input size fail the transfers: the agreement says why
        if agree is not None:
            wait_work(agree, self.timeout)
            err = disagreement(values, self.sig, self.what, f"compress/{self.name}/reduce_scatter")
            if err is not None:
                raise err  # on every rank of the node; the other nodes' ranks time out on the rail
            if failure is not None:
                raise failure
        # Counted apart (op "compress/<name>/intra"): these bytes cross the fast intra-node links,
        # the op's own count is what crosses the scarce inter-node ones.
        context().engine().count(f"compress/{self.name}/intra", nbytes)
        return 0

    # ------------------------------------------------------------------------------- exchange
    def exchange(self, i: int, group: ProcessGroup | None) -> int:
        """Round ``i`` of the codec's exchange (the generator resumed on this round's worker); after
        the last, the codec's :class:`Result` is in, and an optimistic codec's is settled."""
        if group is None:  # a rail of one node: the exchange is local (exact)
            return self._exact_round(None) if i == 0 else 0
        if i == 0:
            self.exact = self.nonfinite or not self.active
            if self.exact:
                return self._exact_round(group)
            self.ex = self._exchange_inputs()
            self.running = self.compressor.exchange(self.ex)
            if not inspect.isgenerator(self.running):
                raise TypeError(f"{type(self.compressor).__name__}.exchange() must be a generator: yield the bytes "
                                f"each of its rounds {self.round_names} sent, then return a Result "
                                f"(docs/architecture.md section 8)")
        nbytes = self._resume()
        if i == len(self.round_names) - 1:
            self._resume()  # the return after the last round's yield: the Result
            if self.running is not None:
                raise RuntimeError(f"{type(self.compressor).__name__}.exchange() yielded more than its "
                                   f"{len(self.round_names)} rounds {self.round_names}")
            if self.optimistic:
                nbytes += self._settle()
        return nbytes

    def _resume(self) -> int:
        """Run the codec to its next round's end: the bytes it sent (its Result kept at its return)."""
        if self.running is None:
            return 0  # the exact path, or the codec returned early (a non-finite reduced result)
        try:
            return next(self.running)
        except StopIteration as stop:
            self.running = None
            if not isinstance(stop.value, Result):
                raise TypeError(f"{type(self.compressor).__name__}.exchange() must return a Result, got "
                                f"{type(stop.value).__name__}") from None
            self.result = stop.value
            return 0

    def _exact_round(self, group: ProcessGroup | None) -> int:
        """The exact fallback (a non-finite step, compression not started or not worth it): the same
        collective on every rank of the group, because the decision was agreed or shape-made."""
        n = dist.get_world_size(group) if group is not None else 1
        shard = self._own_shard()
        self.exact = True
        self.result = Result(shard)
        if group is None:
            return 0
        ex = Exchange(x=shard, out=shard, sent=None, groups=(group,), n=n, rank=0, timeout=self.timeout,
                            tag=self.tag, what=self.what, transport=self.transport)
        if self.tag is None:  # the check phase compared the ranks' inputs
            return round_all_reduce(ex, 0, shard)()
        # Optimistic (PowerSGD before start_iter): the tag rides with the payload (a copy; such
        # steps send the whole vector anyway).
        buf = torch.cat([shard, self.tag.to(dtype=shard.dtype, device=shard.device)])
        nbytes = round_all_reduce(ex, 0, buf)()
        check_tag(ex, buf[shard.numel():], f"compress/{self.name}/{self.round_names[0]}")
        shard.copy_(buf[: shard.numel()])
        return nbytes

    def _exchange_inputs(self) -> Exchange:
        """The codec's exchange: x = this rank's shard plus its residual, and where the result goes."""
        layout, tensors, keys, cdtype, device = self.layout, self.tensors, self.keys, self.cdtype, self.device
        lo, hi = layout.lo, layout.hi
        groups = tuple(self.round_groups)
        n = dist.get_world_size(groups[0])
        shard = self.shard if self.shard is not None or self.lazy else self.staged[lo: hi]
        x = shard
        if self.use_ef and self.optimistic and self.whole_tensors:
            # Whole tensors in the shard: x = gradient + residual in one pass over the owned tensors,
            # read from the tensors themselves in flat mode; the shard is kept for a fallback.
            fb = self.feedback.get("worker", keys, self.numels, cdtype, device)
            owned = layout.owned
            srcs = [tensors[i] if shard is None else shard[layout.offsets[i] - lo:][: self.numels[i]] for i in owned]
            x = stage_sum(srcs, [fb[i] for i in owned], [layout.offsets[i] - lo for i in owned], hi - lo,
                          cdtype, device)
        elif self.use_ef:
            self.resid = stage(self.feedback.get("worker", keys, self.numels, cdtype, device), layout, cdtype,
                               self.compressor.align)
            if self.optimistic:
                x = shard + self.resid[lo: hi]  # the shard itself is kept for a fallback
            else:
                shard.add_(self.resid[lo: hi])
        if self.uses_server:
            self.server = stage(self.feedback.get("server", keys, self.numels, cdtype, device), layout, cdtype,
                                self.compressor.align)
        rank = dist.get_rank(groups[0])
        chunk = x.numel() // n if self.compressor.chunked else 0
        owned = tuple((keys[i], layout.offsets[i] - lo, tuple(tensors[i].shape)) for i in layout.owned)
        # Flat and lazy: the tensors can take the result themselves (no copy of out into them).
        direct = self.lazy and all(tensors[i].dtype == cdtype and tensors[i].is_contiguous() for i in layout.owned)
        return Exchange(x=x, out=torch.empty_like(x), sent=torch.empty_like(x) if self.use_ef else None,
                              groups=groups, n=n, rank=rank, step=self.step, seed=self.seed, salt=self.salt,
                              tensors=owned,
                              server=(self.server[lo + rank * chunk: lo + (rank + 1) * chunk]
                                      if self.uses_server else None),
                              timeout=self.timeout, scale_hint=self.amax, total_ranks=self.world,
                              dest=tuple(tensors[i] for i in layout.owned) if direct else None,
                              dest_scale=1.0 / self.world if self.average else 1.0, tag=self.tag, what=self.what,
                              state=self.state, transport=self.transport)

    def _settle(self) -> int:
        """After the last round (optimistic codecs): the exact redo of a non-finite result."""
        nbytes = 0
        if not self.exact and self.result.nonfinite:
            # Every rank of the group saw the same reduced values, so all of them take this branch.
            shard = self._own_shard()
            if self.exact_group is not None and shard.numel():
                nbytes = round_all_reduce(dataclasses.replace(self.ex, groups=(self.exact_group,)), 0, shard)()
            self.exact = True
            self.result = Result(shard)
        if self.check_finite and not self.hierarchical and self.exact and not all_finite(self.result.out):
            raise self._nonfinite_error()  # flat: the whole group holds this same result
        return nbytes

    # ------------------------------------------------------------------------------- all-gather
    def all_gather(self, group: ProcessGroup | None) -> int:
        """Intra-node, exact: every rank's decoded (and averaged) shard into the staged vector."""
        res, staged = self.result, self.staged
        out = res.out
        factor = res.scale / self.world if self.average else res.scale
        if out.dtype != staged.dtype or factor != 1.0:
            # Decode and average this shard before gathering (1/L of the data, not all of it).
            out = _scaled(out, factor, staged.dtype, res.scale == 1.0 and self.average, self.world)
            self.averaged = self.average
        self.result = dataclasses.replace(res, out=staged, scale=1.0)  # gathered into the staged vector
        nbytes = exchange_all_gather(staged, out.contiguous(), group, self.timeout)
        context().engine().count(f"compress/{self.name}/intra", nbytes)
        if self.optimistic and (self.check_finite or self.use_ef) and not all_finite(staged):
            # Every rank of every rail now holds this same full vector: the decision is agreed.
            self.full_nonfinite = True
            if self.check_finite:
                raise self._nonfinite_error()
        return 0

    # ------------------------------------------------------------------------------- apply feedback
    def apply_feedback(self) -> None:
        """Residual = what was meant minus what was sent, for the shard; zero where not owned."""
        if self.exact or self.full_nonfinite or not self.use_ef:
            return
        ex, res, layout, keys = self.ex, self.result, self.layout, self.keys
        fb = self.feedback.get("worker", keys, self.numels, self.cdtype, self.device)
        if self.whole_tensors:
            # Each tensor lies wholly in the shard (owned) or wholly outside it (another local rank's
            # section): write each residual directly, one pass (none when the round computed it: the
            # view of sent becomes the residual), and zero the others.
            owned = set(layout.owned)
            for i, (t, off) in enumerate(zip(fb, layout.offsets)):
                if i in owned:
                    lo, hi = off - layout.lo, off - layout.lo + t.numel()
                    if res.residual:
                        self.feedback.adopt("worker", keys[i], ex.sent[lo: hi])
                    else:
                        torch.sub(ex.x[lo: hi], ex.sent[lo: hi], out=t)
                else:
                    t.zero_()
        else:
            keep = torch.zeros_like(self.resid)
            keep[layout.lo: layout.hi] = ex.sent if res.residual else ex.x - ex.sent
            unstage(keep, fb, layout)
        if self.uses_server:
            server = torch.zeros_like(self.server)
            chunk = ex.x.numel() // ex.n
            start = layout.lo + ex.rank * chunk
            server[start: start + chunk] = ex.server
            unstage(server, self.feedback.get("server", keys, self.numels, self.cdtype, self.device), layout)

    # ------------------------------------------------------------------------------- unstage
    def unstage(self) -> None:
        """The result into the tensors, decoded and averaged in one pass (unless a round wrote them)."""
        res, layout = self.result, self.layout
        if res.written:
            return
        out = res.out
        base = 0 if out.numel() == layout.total else layout.lo
        divide = self.average and not self.averaged
        factor = res.scale / self.world if divide else res.scale
        for t, off in zip(self.tensors, layout.offsets):
            src = out[off - base: off - base + t.numel()].view(t.shape)
            if factor == 1.0:
                t.copy_(src)
            elif res.scale == 1.0 and divide:
                torch.div(src, self.world, out=t)
            else:
                torch.mul(src if src.dtype == self.cdtype else src.to(self.cdtype), factor, out=t)

    def _nonfinite_error(self) -> NonFiniteError:
        keys = self.keys
        return NonFiniteError(
            f"a rank holds NaN or Inf in the tensors of {keys[:3]}{'...' if len(keys) > 3 else ''} "
            f"(step {self.step}); every rank raises (check_finite=True). Lower the learning rate or use "
            f"a loss scaler, or pass check_finite=False to reduce such steps exactly", op=f"compress/{self.name}")


# --------------------------------------------------------------------------------- helpers
def _same_group(a: ProcessGroup | None, b: ProcessGroup | None) -> bool:
    """Whether two process-group arguments name the same group (None is WORLD)."""
    world = dist.group.WORLD
    return (world if a is None else a) is (world if b is None else b)


def _resolve(algorithm: str, compressor: Codec, tensors: list[torch.Tensor], group: ProcessGroup | None,
             topology: Topology | None,
             timeout: float | None = None) -> tuple[Topology | None, Topology | None, Transport | None]:
    """``(hierarchical, rails, transport)``: the topology of a hierarchical exchange, or the one whose
    rails carry a rail-scope reduction (both None for a flat exchange; detecting the topology is
    bounded by ``timeout``), and what routes the rounds (``synth``), or None.

    The path follows the algorithm's declared traits (``commopt.comm.algorithms``): its ``scope``
    (the whole group, or this rank's rail) and its ``codec_phase`` (every phase encoded: one level;
    the inter-node phase only: two levels). ``auto`` asks the cost model (``auto.choose``): the same
    answer on every rank, from shapes and the model rank 0 broadcast. An algorithm that routes its
    rail itself (``synth``) keeps its route on one rank per node, where the rail is the whole group.
    """
    if algorithm == algorithms.AUTO:
        algo = None
    else:
        known = algorithms.names("allreduce", scope=None, codec=True)
        if algorithm not in known:
            raise ValueError(f"compressed all-reduce: algorithm {algorithm!r} is not supported; use "
                             f"{algorithms.AUTO!r} or one that can carry a compressor: {known} ('hierarchical' "
                             f"compresses the inter-node phase only; 'rail' reduces over this rank's rail)")
        algo = algorithms.get(algorithm)
        if algo.scope == algorithms.GROUP_SCOPE and algo.codec_phase == algorithms.ALL_PHASES:
            return None, None, None  # one level over the whole group: no topology needed
    topo = context().topology(topology, group, timeout)
    if algo is not None and algo.supports(topo, "allreduce") is not None:
        hint = ("a rail is one rank per node" if algo.scope == algorithms.RAIL_SCOPE else
                "use algorithm='auto' (falls back to flat) or 'flat'")
        raise TopologyError(f"compressed all-reduce: {algo.supports(topo, 'allreduce')}; {hint}", op="compress")
    if algo is None and not topo.is_uniform:
        return None, None, None
    if algo is not None and algo.scope == algorithms.RAIL_SCOPE:
        return None, topo, None
    if topo.num_nodes == 1 or not (topo.two_levels or auto.uneven(topo) or _transport_of(algo, topo)):
        return None, None, None  # one level only: nothing to keep exact, nothing to route
    if algo is None:
        algo = algorithms.get(auto.choose(compressor, tensors, topo, timeout=timeout))
    if algo.codec_phase == algorithms.ALL_PHASES:
        return None, None, None
    transport = _transport_of(algo, topo)
    if transport is not None and auto.round_kinds(compressor) is None:  # every rank, before anything moves
        raise ValueError(f"compressed all-reduce: algorithm {algo.name!r} routes codec rounds named all_reduce*, "
                         f"all_gather* or all_to_all*; {type(compressor).__name__}'s rounds are "
                         f"{tuple(compressor.rounds)}: use algorithm='hierarchical' (or 'flat')")
    if not topo.two_levels:  # one rank per node: a routed rail is the whole group; else flat
        return (None, topo, transport) if transport is not None else (None, None, None)
    return topo, None, transport


def _transport_of(algo, topo: Topology) -> Transport | None:
    """What an algorithm routes a codec's rail rounds through (``Synth.codec_transport``), or None."""
    if algo is None or algo.codec_phase != INTER_PHASE or topo.num_nodes == 1:
        return None
    return algo.codec_transport(topo)


def _scaled(out: torch.Tensor, factor: float, dtype: torch.dtype, divide: bool, world: int) -> torch.Tensor:
    """``out * factor`` in ``dtype`` (``out / world`` when ``divide``: the plain average), one pass."""
    if factor == 1.0:
        return out.to(dtype)
    if divide:
        return torch.div(out, world)
    return torch.mul(out if out.dtype == dtype else out.to(dtype), factor)


def _phase(name: str, group: ProcessGroup | None, body: Callable[[ProcessGroup | None], int]) -> Phase:
    """A phase whose byte count is known only once it ran (it may fall back to an exact reduction):
    ``body`` returns the bytes it sent, which the engine counts.

    The phase holds the reduction through ``body`` (a bound method); the reduction never holds the
    phase, so no reference cycle keeps the phase and its process groups alive after
    ``commopt.comm.destroy()`` (docs/faults.md row 30).
    """
    return Phase(name, functools.partial(body, group), group)
