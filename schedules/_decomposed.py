"""The decomposed tensor-parallel matmuls: all-gather-matmul, matmul-reduce-scatter and
matmul-all-reduce as rings of point-to-point steps, with autograd decomposed the same way
(docs/architecture.md sections 3 and 5.1; fault cases in docs/faults.md row 39). Exported from
:mod:`commopt.schedules.tensor_parallel`, whose drop-in styles run them.


Under tensor + sequence parallelism every transformer block all-gathers its activations before the
column-parallel matmuls and reduce-scatters after the row-parallel ones, and nothing computes while
those collectives run. Here each collective is split into the ``P - 1`` point-to-point steps of a
ring over the group and the matmul into the matching ``P`` pieces, so that step k's transfer runs
while piece k is multiplied ("decomposition-based" overlap: Wang et al., ASPLOS '23; Flux; T3):

- :func:`all_gather_matmul` ``(A_shard, [B1, B2, ..])``: ``[cat(all_gather(A_shard), dim) @ Bi]``.
  (1) multiply this rank's own block while step 1 forwards it to the next rank; (2) for k = 1 ..
  P - 1: wait for the block of rank ``me - k`` from the previous rank, start forwarding it, multiply it.
- :func:`matmul_reduce_scatter` ``(A, B)``: block ``me`` (along ``scatter_dim``) of
  ``sum over ranks of A @ B``. For k = 0 .. P - 1: multiply the piece of block ``me - k - 1`` (while
  the previous step's partial sum travels), add the partial sum received from the previous rank, and
  send the result on; after the last step the accumulator holds every rank's contribution to block
  ``me``.
- :func:`matmul_all_reduce` ``(A, B)``: ``all_reduce(A @ B)``, the row-parallel matmul without
  sequence parallelism: the reduce-scatter ring above over the rows of the product (the
  multiplication overlapped with it), then an all-gather ring of the reduced rows.

Every step is cut into chunks (``chunks``; None: as many as the group's link makes worth it,
:func:`commopt.schedules._tp_choice.chunks_for`), and every chunk's step is one engine phase
(:class:`commopt.comm.engine.Phase`) on the group:
the point-to-point exchange (``pairwise``) runs on the group's engine worker while the caller's
thread multiplies. The all-gather ring submits all its chunk steps at once (the worker runs them in
order, so a chunk is forwarded by the step after the one that received it) and multiplies each chunk
as soon as it is in; the reduce-scatter ring submits a chunk's step as soon as the chunk's partial sum
is computed and the previous rank's is added, and computes the next chunk meanwhile. So the first
slices of a matmul run while the later chunks of the same block travel, where a whole-block ring
could only hide one block's slice behind the next block's transfer. Every rank submits the same steps
in the same order, so the ordering invariant of docs/architecture.md section 3 holds beside
data-parallel traffic on other groups. The bytes are the plain ring's (P - 1 blocks per rank, the
bandwidth-optimal (P - 1)/P of the data).

Autograd is decomposed the same way: the backward of ``all_gather_matmul`` with respect to
``a_shard`` is a matmul-reduce-scatter ring of the gradient (``grad_out @ B.T`` reduce-scattered
along ``gather_dim``), with respect to each B ``gathered_A.T @ grad_out`` (no communication: the
gathered A of the forward is kept); the backward of ``matmul_reduce_scatter`` with respect to A is
an all-gather-matmul ring of the gradient with ``B.T``, with respect to B ``A.T @ gathered_grad``.
``matmul_all_reduce`` follows torch's ``RowwiseParallel`` and Megatron's row-parallel layer: A is
sharded on its last dimension, B on its first, the output is replicated, and its backward is local
(``grad @ B.T`` and ``A.T @ grad``, no communication), the gradient arriving replicated.

Checks (docs/faults.md row 39): wrong arguments are ``TypeError`` / ``ValueError`` at the call, on
the calling rank, before anything is sent; then one agreement check on the group
(``commopt.comm.checks.agree``: the shape and dtype of what the ring exchanges, and whether the
backward's ring will run, i.e. whether the inputs it serves require gradients) raises
``CollectiveMismatchError`` on every rank before any payload moves when the ranks differ, or
``CommTimeoutError`` when a rank never enters within ``timeout``. The check is issued before the ring
and waited for by every step's phase before it moves anything (``agree(wait=False)``), so this
rank's own first slice of the matmul runs while it is on the wire: waited for on the calling thread
first, it cost the block 0.02-0.06x of its step at 1 Gbit/s (docs/results.md 22). The first call on
a group also resolves the group's topology and cost model (:func:`chunks_for`), bounded by the same
timeout. ``agreement=False`` skips the check, for callers whose shapes match by construction (the
styles check once per module and input shape). A world or group of one is a plain matmul.

A double backward (``torch.autograd.grad(..., create_graph=True)`` through a ring, then again) is not
supported: a ring's backward is itself a ring of point-to-point steps that no graph records, so the
backward raises ``NotImplementedError`` naming the call rather than torch's "appears to not have
been used in the graph".
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup, ReduceOp

from commopt.comm.algorithms import deadline_of
from commopt.comm.checks import agree, check_timeout, renamed
from commopt.comm.runtime import context

from . import _ring
from ._tp_choice import check_chunks, chunks_for

__all__ = ["all_gather_matmul", "matmul_reduce_scatter", "matmul_all_reduce"]

_RING = "ring"  # the algorithm name the agreement check carries


# --------------------------------------------------------------------------------- public functions
def all_gather_matmul(a_shard: torch.Tensor, bs: Sequence[torch.Tensor], *, gather_dim: int = 0,
                      group: ProcessGroup | None = None, return_a: bool = False, timeout: float | None = None,
                      chunks: int | None = None,
                      agreement: bool = True) -> list[torch.Tensor] | tuple[torch.Tensor, list[torch.Tensor]]:
    """``[torch.cat(all_gather(a_shard), dim=gather_dim) @ b for b in bs]``, decomposed into a ring.

    The column-parallel matmul of tensor + sequence parallelism: the activations are sharded along
    ``gather_dim`` (the sequence), each B is this rank's column shard of a weight (several Bs: fused
    QKV, gate/up). Each of the P - 1 ring steps forwards one block while the block before it is
    multiplied (module docstring; docs/architecture.md section 3).

    Args:
        a_shard: this rank's block, ``[..., K]`` with at least one leading dimension; the same shape
            and dtype on every rank of the group.
        bs: a list of 2-D ``[K, N_i]`` tensors (this rank's own; N_i may differ between ranks).
        gather_dim: the leading dimension of ``a_shard`` to gather along (negative counts from the
            end); never the last one, which is the contraction.
        group: the tensor-parallel process group (None: WORLD).
        return_a: also return the gathered A (autograd flows through it too).
        timeout: seconds the call may take, the agreement check and every step together, before
            ``CommTimeoutError`` (None: the group's own timeout); the backward pass gets as long.
        chunks: row ranges each block is cut into, one ring step each (None: as many as keep a
            chunk's transfer worth its hand-off on the group's link, ``_tp_choice.chunks_for``); the
            same on every rank.
        agreement: False skips the agreement check: only for callers whose shapes match on every rank
            by construction (a mismatch then fails in the transport, or aborts it).

    Returns:
        The list of products in the order of ``bs``, or ``(gathered_a, products)`` with ``return_a``.

    Raises:
        TypeError, ValueError: a bad argument, at the call (docs/faults.md row 39).
        CollectiveMismatchError: the ranks' ``a_shard`` shapes, dtypes, ``gather_dim`` or
            ``a_shard.requires_grad`` (under grad mode: whether the backward's ring runs) differ (on
            every rank, before any payload moves).
        CommTimeoutError: a rank did not enter the call, or a step did not finish, within ``timeout``.
    """
    name = "all_gather_matmul"
    _check_matrix(name, "a_shard", a_shard, min_ndim=2)
    if isinstance(bs, torch.Tensor) or not isinstance(bs, (list, tuple)):
        raise TypeError(f"{name}: bs must be a list of 2-D tensors (pass [b] for one), got {type(bs).__name__}")
    if not bs:
        raise ValueError(f"{name}: bs is empty; pass at least one 2-D tensor [K, N] to multiply with")
    for i, b in enumerate(bs):
        _check_b(name, f"bs[{i}]", a_shard, "a_shard", b)
    d = _leading_dim(name, "gather_dim", gather_dim, a_shard)
    _ring.check_group(name, group)
    timeout = check_timeout(name, timeout)
    chunks = check_chunks(name, chunks)
    size = _ring.group_size(name, group)
    if size == 1:
        outs = [torch.matmul(a_shard, b) for b in bs]
        return (a_shard, outs) if return_a else outs
    deadline = deadline_of(timeout)
    # Whether the backward's ring runs (a_shard needs a gradient) is part of the call: a rank without it
    # would leave the others in that ring until the timeout.
    grad = torch.is_grad_enabled() and a_shard.requires_grad
    _ring.resolve_link(name, group, timeout)
    gate = (_agree(name, "all_gather", a_shard, (tuple(a_shard.shape), d, grad), group, timeout, chunks=chunks)
            if agreement else None)
    gathered, *outs = _AllGatherMatmul.apply(a_shard, d, group, timeout, deadline, bool(return_a), gate, chunks,
                                             *bs)
    return (gathered, list(outs)) if return_a else list(outs)


def matmul_reduce_scatter(a: torch.Tensor, b: torch.Tensor, *, scatter_dim: int = 0,
                          group: ProcessGroup | None = None, op: ReduceOp.RedOpType = ReduceOp.SUM,
                          timeout: float | None = None, chunks: int | None = None,
                          agreement: bool = True) -> torch.Tensor:
    """This rank's block (along ``scatter_dim``) of the SUM (or AVG) over the group of ``a @ b``,
    decomposed into a ring.

    The row-parallel matmul of tensor + sequence parallelism: A holds this rank's slice of the
    contraction dimension (``K`` may differ between ranks), B this rank's row shard of a weight, and
    the summed product is scattered along ``scatter_dim`` (the sequence). Each of the P ring steps
    multiplies one block's piece while the previous partial sum travels (module docstring).

    Args:
        a: ``[..., K]`` with at least one leading dimension.
        b: ``[K, N]``.
        scatter_dim: the leading dimension of the product to scatter along (negative counts from the
            end); never the last one. Its size must be divisible by the group size.
        group: the tensor-parallel process group (None: WORLD).
        op: ``ReduceOp.SUM`` or ``ReduceOp.AVG``.
        timeout: seconds the call may take before ``CommTimeoutError`` (None: the group's own).
        chunks, agreement: as in :func:`all_gather_matmul`.

    Returns:
        ``[..., size(scatter_dim) / P, ..., N]``: block ``rank`` of the reduced product.

    Raises:
        TypeError, ValueError: a bad argument, at the call (docs/faults.md row 39).
        CollectiveMismatchError: the products' shapes or dtypes, ``scatter_dim``, ``op`` or whether a
            gradient flows back (``a`` or ``b`` requires one, under grad mode) differ across ranks
            (every rank, before any payload moves).
        CommTimeoutError: a rank did not enter the call, or a step did not finish, within ``timeout``.
    """
    return _matmul_reduce_scatter("matmul_reduce_scatter", a, b, None, scatter_dim, group, op, timeout, chunks,
                                  agreement)


def _matmul_reduce_scatter(name: str, a: torch.Tensor, b: torch.Tensor, bias: torch.Tensor | None, scatter_dim: int,
                           group: ProcessGroup | None, op: ReduceOp.RedOpType, timeout: float | None,
                           chunks: int | None = None, agreement: bool = True) -> torch.Tensor:
    """:func:`matmul_reduce_scatter` with an optional ``bias`` ``[N]`` added once to the reduced block
    (RowwiseParallel's bias). Its gradient is the sum of the whole gradient, which the backward's
    all-gather ring already holds on every rank: a replicated bias gets a replicated gradient with
    no communication of its own."""
    _check_matrix(name, "a", a, min_ndim=2)
    _check_b(name, "b", a, "a", b)
    if bias is not None and op != ReduceOp.SUM:
        raise ValueError(f"{name}: a bias is added after a SUM reduction only, got op={op}")
    if bias is not None and (bias.shape != (b.shape[1],) or bias.dtype != b.dtype or bias.device != b.device):
        raise ValueError(f"{name}: bias has shape {list(bias.shape)}, {bias.dtype} on {bias.device}; it must be "
                         f"[{b.shape[1]}], {b.dtype} on {b.device} (one value per output column)")
    d = _leading_dim(name, "scatter_dim", scatter_dim, a)
    if op not in (ReduceOp.SUM, ReduceOp.AVG):
        raise ValueError(f"{name}: op must be ReduceOp.SUM or ReduceOp.AVG (a sum of partial products), got {op}")
    _ring.check_group(name, group)
    timeout = check_timeout(name, timeout)
    chunks = check_chunks(name, chunks)
    size = _ring.group_size(name, group)
    if a.shape[d] % size:
        raise ValueError(f"{name}: scatter_dim {scatter_dim} of the product has size {a.shape[d]}, which is not "
                         f"divisible by the group size {size}; pad that dimension to a multiple of {size} or "
                         f"scatter along another one")
    if size == 1:
        return torch.matmul(a, b) if bias is None else torch.matmul(a, b) + bias
    deadline = deadline_of(timeout)
    shape = tuple(a.shape[:-1]) + (b.shape[1],)
    grad = torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (a, b, bias))
    _ring.resolve_link(name, group, timeout)
    kind = "avg" if op == ReduceOp.AVG else "sum"
    gate = (_agree(name, "reduce_scatter", a, (shape, d, kind, grad), group, timeout, numel=math.prod(shape), op=kind,
                   chunks=chunks) if agreement else None)
    return _MatmulReduceScatter.apply(a, b, d, group, timeout, deadline, op == ReduceOp.AVG, gate, chunks, bias)


def matmul_all_reduce(a: torch.Tensor, b: torch.Tensor, *, group: ProcessGroup | None = None,
                      timeout: float | None = None, chunks: int | None = None,
                      agreement: bool = True) -> torch.Tensor:
    """``all_reduce(a @ b)`` (SUM), decomposed into a ring: the row-parallel matmul of tensor
    parallelism without sequence parallelism.

    Semantics of torch's ``RowwiseParallel``: ``a`` is this rank's slice of the input's last
    dimension, ``b`` the matching rows of the weight, the output is replicated. (1) A reduce-scatter
    ring over the rows of the product, each row block multiplied while the previous partial sum
    travels; (2) an all-gather ring of the reduced row blocks. The backward pass is local, no
    communication: ``grad @ b.T`` and ``a.T @ grad`` (the gradient of a replicated output arrives
    replicated; Megatron's row-parallel layer does the same).

    Args:
        a: ``[..., K]`` (at least 1-D).
        b: ``[K, N]``.
        group: the tensor-parallel process group (None: WORLD).
        timeout: seconds the call may take before ``CommTimeoutError`` (None: the group's own).
        chunks, agreement: as in :func:`all_gather_matmul`.

    Raises:
        TypeError, ValueError: a bad argument, at the call (docs/faults.md row 39).
        CollectiveMismatchError: the products' shapes or dtypes differ across ranks (every rank).
        CommTimeoutError: a rank did not enter the call, or a step did not finish, within ``timeout``.
    """
    name = "matmul_all_reduce"
    _check_matrix(name, "a", a, min_ndim=1)
    _check_b(name, "b", a, "a", b)
    _ring.check_group(name, group)
    timeout = check_timeout(name, timeout)
    chunks = check_chunks(name, chunks)
    size = _ring.group_size(name, group)
    if size == 1:
        return torch.matmul(a, b)
    deadline = deadline_of(timeout)
    shape = tuple(a.shape[:-1]) + (b.shape[1],)
    _ring.resolve_link(name, group, timeout)
    gate = (_agree(name, "all_reduce", a, (shape,), group, timeout, numel=math.prod(shape), chunks=chunks)
            if agreement else None)
    return _MatmulAllReduce.apply(a, b, group, timeout, deadline, gate, chunks)


# --------------------------------------------------------------------------------- autograd
class _AllGatherMatmul(torch.autograd.Function):
    @staticmethod
    def forward(ctx, a_shard, d, group, timeout, deadline, return_a, gate, chunks, *bs):
        gathered, outs = _gather_matmul("all_gather_matmul", a_shard, list(bs), d, group, timeout, deadline,
                                        keep_gathered=True, gate=gate, chunks=chunks)
        ctx.d, ctx.group, ctx.timeout, ctx.chunks = d, group, timeout, chunks
        ctx.shard_shape = tuple(a_shard.shape)
        ctx.save_for_backward(gathered, *bs)
        ctx.set_materialize_grads(False)
        if not return_a:
            ctx.mark_non_differentiable(gathered)
        return (gathered, *outs)

    @staticmethod
    @_ring.once_differentiable("all_gather_matmul")
    def backward(ctx, g_gathered, *g_outs):
        ctx.ran = True  # a gathered input kept for ColwiseParallel's sharing is no longer usable
        gathered, *bs = ctx.saved_tensors
        d, shard_shape = ctx.d, ctx.shard_shape
        s = shard_shape[d]
        grad_bs: list = []

        def weight_grads() -> None:  # no communication: run while the ring's last transfers travel
            flat_a = _flat(gathered)
            for i, g in enumerate(g_outs):
                grad_bs.append(flat_a.t() @ _flat(g) if ctx.needs_input_grad[8 + i] and g is not None else None)

        grad_a = None
        if ctx.needs_input_grad[0]:
            # Every rank joins the ring whenever a_shard needs a gradient, with zeros for outputs that
            # got none: whether a gradient arrived is local, and the ring must run on every rank.
            def partial(c: int, lo: int, hi: int) -> torch.Tensor:
                part = None
                for g, b in zip(g_outs, bs):
                    if g is not None:
                        piece = torch.matmul(g.narrow(d, c * s + lo, hi - lo), b.t())
                        part = piece if part is None else part.add_(piece)
                if g_gathered is not None:
                    block = g_gathered.narrow(d, c * s + lo, hi - lo)
                    part = block.clone() if part is None else part.add_(block)
                if part is None:
                    part = gathered.new_zeros(_resized(shard_shape, d, hi - lo))
                return part.contiguous()

            grad_a = _ring_reduce_scatter("all_gather_matmul/backward", partial,
                                          lambda _c, lo, hi: _resized(shard_shape, d, hi - lo), ctx.group,
                                          ctx.timeout, deadline_of(ctx.timeout), gathered, dim=d,
                                          extent=lambda _c: s, meanwhile=weight_grads, chunks=ctx.chunks)
        else:
            weight_grads()
        return (grad_a, None, None, None, None, None, None, None, *grad_bs)


class _MatmulReduceScatter(torch.autograd.Function):
    @staticmethod
    def forward(ctx, a, b, d, group, timeout, deadline, avg, gate, chunks, bias=None):
        size = dist.get_world_size(group)
        s = a.shape[d] // size

        def partial(c: int, lo: int, hi: int) -> torch.Tensor:
            return torch.matmul(a.narrow(d, c * s + lo, hi - lo), b).contiguous()

        block = tuple(a.shape[:-1]) + (b.shape[1],)
        out = _ring_reduce_scatter("matmul_reduce_scatter", partial, lambda _c, lo, hi: _resized(block, d, hi - lo),
                                   group, timeout, deadline, a, dim=d, extent=lambda _c: s, gate=gate,
                                   chunks=chunks)
        if avg:
            out.div_(size)
        if bias is not None:
            out.add_(bias)  # once, after the reduction (RowwiseParallel's bias)
        ctx.d, ctx.group, ctx.timeout, ctx.avg, ctx.chunks = d, group, timeout, avg, chunks
        ctx.save_for_backward(a, b)
        return out

    @staticmethod
    @_ring.once_differentiable("matmul_reduce_scatter")
    def backward(ctx, g):
        a, b = ctx.saved_tensors
        need_a, need_b = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        need_bias = ctx.needs_input_grad[9]
        if not (need_a or need_b or need_bias):
            return (None,) * 10
        if ctx.avg:
            g = g / dist.get_world_size(ctx.group)
        gathered, outs = _gather_matmul("matmul_reduce_scatter/backward", g, [b.t()] if need_a else [], ctx.d,
                                        ctx.group, ctx.timeout, deadline_of(ctx.timeout),
                                        keep_gathered=need_b or need_bias, chunks=ctx.chunks)
        grad_a = outs[0] if need_a else None
        grad_b = grad_bias = None
        if need_b:
            grad_b = _flat(a).t() @ _flat(gathered)
        if need_bias:
            # Added after the (SUM) reduction: the sum of the whole gradient, which the ring has just
            # gathered, bit for bit the same on every rank (a replicated gradient, no collective).
            grad_bias = _flat(gathered).sum(0)
        return grad_a, grad_b, None, None, None, None, None, None, None, grad_bias


class _MatmulAllReduce(torch.autograd.Function):
    @staticmethod
    def forward(ctx, a, b, group, timeout, deadline, gate, chunks):
        size, me = dist.get_world_size(group), dist.get_rank(group)
        flat = _flat(a)
        rows, n = flat.shape[0], b.shape[1]
        bounds = [rows * r // size for r in range(size + 1)]

        def partial(c: int, lo: int, hi: int) -> torch.Tensor:
            return (flat[bounds[c] + lo:bounds[c] + hi] @ b).contiguous()

        out = a.new_empty((rows, n))
        out[bounds[me]:bounds[me + 1]] = _ring_reduce_scatter(
            "matmul_all_reduce", partial, lambda _c, lo, hi: (hi - lo, n), group, timeout, deadline, a, dim=0,
            extent=lambda c: bounds[c + 1] - bounds[c], gate=gate, chunks=chunks)
        _ring_all_gather_rows("matmul_all_reduce", out, bounds, group, timeout, deadline)
        ctx.save_for_backward(a, b)
        return out.reshape(tuple(a.shape[:-1]) + (n,))

    @staticmethod
    def backward(ctx, g):
        a, b = ctx.saved_tensors
        grad_a = torch.matmul(g, b.t()) if ctx.needs_input_grad[0] else None
        grad_b = None
        if ctx.needs_input_grad[1]:
            grad_b = _flat(a).t() @ _flat(g)
        return grad_a, grad_b, None, None, None, None, None


# --------------------------------------------------------------------------------- rings
def _gather_matmul(op: str, shard: torch.Tensor, bs: list[torch.Tensor], d: int, group, timeout: float | None,
                   deadline: float | None, keep_gathered: bool, gate: Callable[[], None] | None = None,
                   chunks: int | None = None) -> tuple[torch.Tensor | None, list[torch.Tensor]]:
    """The all-gather ring with a matmul per arriving chunk: ``(cat(blocks, d) or None, [cat(blocks, d) @ b])``.

    Blocks arrive in a ``[P, *shard.shape]`` buffer (each block contiguous), cut into row ranges
    (:func:`chunks_for`); the products of block r go to slot r of a ``[P, ..., N]`` buffer.
    Every step of every chunk is submitted at once: the group's engine worker runs them in order (a
    chunk is forwarded by the step after the one that received it), and the caller multiplies each
    chunk as soon as it is in, while the later chunks are still on the wire. Moving the slot
    dimension to ``d`` is a view for ``d == 0`` and one copy otherwise.
    """
    size, me = dist.get_world_size(group), dist.get_rank(group)
    blocks = shard.new_empty((size,) + tuple(shard.shape))
    blocks[me].copy_(shard)
    outs = [shard.new_empty((size,) + tuple(shard.shape[:-1]) + (b.shape[1],)) for b in bs]
    rows, k = math.prod(shard.shape[:-1]), shard.shape[-1]
    rowed = blocks.view(size, rows, k)
    products = [out.view(size, rows, b.shape[1]) for b, out in zip(bs, outs)]
    chunks = chunks_for(rows * k * shard.element_size(), rows, group, shard.device, chunks)
    for src, lo, hi in _ring.all_gather(op, rowed, chunks, group, timeout, deadline, gate):
        for b, product in zip(bs, products):
            torch.matmul(rowed[src, lo:hi], b, out=product[src, lo:hi])
    gathered = _merge(blocks, d) if keep_gathered else None
    return gathered, [_merge(out, d) for out in outs]


def _ring_reduce_scatter(op: str, partial: Callable[[int, int, int], torch.Tensor], shape_of: Callable[..., tuple],
                         group, timeout: float | None, deadline: float | None, like: torch.Tensor, *, dim: int,
                         extent: Callable[[int], int], gate: Callable[[], None] | None = None,
                         meanwhile: Callable[[], None] | None = None, chunks: int | None = None) -> torch.Tensor:
    """``_ring.reduce_scatter`` with every block cut into :func:`chunks_for` the longest block's chunks."""
    longest = max(extent(c) for c in range(dist.get_world_size(group)))
    chunks = chunks_for(longest * math.prod(shape_of(0, 0, 1)) * like.element_size(), longest, group, like.device,
                        chunks)
    return _ring.reduce_scatter(op, partial, shape_of, group, timeout, deadline, like, dim=dim, extent=extent,
                                chunks=chunks, gate=gate, meanwhile=meanwhile)


def _resized(shape: tuple, dim: int, length: int) -> tuple:
    """``shape`` with ``length`` along ``dim``."""
    out = list(shape)
    out[dim] = length
    return tuple(out)


def _ring_all_gather_rows(op: str, out: torch.Tensor, bounds: list[int], group, timeout: float | None,
                          deadline: float | None) -> None:
    """The all-gather ring of row blocks in place: rows ``bounds[r]:bounds[r + 1]`` of ``out`` come
    from rank r (this rank's are already there)."""
    size, me = dist.get_world_size(group), dist.get_rank(group)
    engine = context().engine()
    for k in range(size - 1):
        send, recv = (me - k) % size, (me - k - 1) % size
        fut = _ring.step(engine, op, group, out[bounds[send]:bounds[send + 1]], out[bounds[recv]:bounds[recv + 1]],
                    deadline)
        if fut is not None:
            _ring.wait_step(fut, op, timeout, deadline)


def _flat(t: torch.Tensor) -> torch.Tensor:
    """``[..., n]`` -> ``[rows, n]`` (``reshape(-1, n)`` fails when ``n`` is 0: an empty column shard)."""
    return t.reshape(math.prod(t.shape[:-1]), t.shape[-1])


def _merge(stacked: torch.Tensor, d: int) -> torch.Tensor:
    """``[P, s0, .., s_d, ..]`` -> ``[s0, .., P * s_d, ..]``: block r at position r along ``d``."""
    shape = list(stacked.shape[1:])
    shape[d] *= stacked.shape[0]
    return stacked.movedim(0, d).reshape(shape)


# --------------------------------------------------------------------------------- checks
def _check_matrix(name: str, what: str, t, min_ndim: int) -> None:
    _ring.check_float_tensor(name, what, t)
    if t.dim() < min_ndim:
        need = "a leading dimension and the contraction dimension" if min_ndim == 2 else "the contraction dimension"
        raise ValueError(f"{name}: {what} has shape {list(t.shape)}; it needs at least {min_ndim} dimensions "
                         f"({need}, the last)")


def _check_b(name: str, what: str, a: torch.Tensor, a_name: str, b) -> None:
    if not isinstance(b, torch.Tensor):
        raise TypeError(f"{name}: {what} must be a torch.Tensor, got {type(b).__name__}")
    if b.is_sparse:
        raise TypeError(f"{name}: {what} is sparse; pass a dense tensor (.to_dense())")
    if b.dim() != 2:
        raise ValueError(f"{name}: {what} has shape {list(b.shape)}; it must be 2-D [K, N] (a weight shard, "
                         f"already transposed: pass linear.weight.t() for a torch.nn.Linear)")
    if b.shape[0] != a.shape[-1]:
        raise ValueError(f"{name}: {what} has shape {list(b.shape)} but {a_name} has shape {list(a.shape)}: the "
                         f"first dimension of {what} must equal the last (contraction) dimension of {a_name}, "
                         f"{a.shape[-1]}")
    if b.dtype != a.dtype:
        raise TypeError(f"{name}: {what} has dtype {b.dtype} but {a_name} has {a.dtype}; cast one of them")
    if b.device != a.device:
        raise ValueError(f"{name}: {what} is on {b.device} but {a_name} is on {a.device}; move them to one device")


def _leading_dim(name: str, what: str, dim, a: torch.Tensor) -> int:
    """``dim`` normalised to ``[0, a.dim() - 1)``: a leading dimension, never the contraction."""
    if isinstance(dim, bool) or not isinstance(dim, int):
        raise TypeError(f"{name}: {what} must be an int, got {type(dim).__name__} {dim!r}")
    nd = a.dim()
    if not -nd <= dim < nd:
        raise ValueError(f"{name}: {what}={dim} is out of range for shape {list(a.shape)}; pass one of its "
                         f"leading dimensions, 0 .. {nd - 2} (or {-nd} .. -2)")
    d = dim % nd
    if d == nd - 1:
        raise ValueError(f"{name}: {what}={dim} is the last dimension of shape {list(a.shape)}, the contraction "
                         f"dimension of the matmul; pass a leading dimension, 0 .. {nd - 2}")
    return d


def _agree(name: str, kind: str, t: torch.Tensor, key: tuple, group, timeout: float | None, *,
           numel: int | None = None, op: str = "sum", chunks: int | None = None,
           what: str | None = None) -> Callable[[], None]:
    """Issue the agreement check before the ring (docs/architecture.md section 4) and return its
    completion, the ring's gate: what the ring exchanges (its shape, dtype and dimension) must be the
    same on every rank, or every rank raises from the gate. The ring's phases call the gate before
    they move anything, the caller before it waits for the ring: this rank's first slice of the
    matmul, which needs nothing from the others, runs while the check is on the wire. ``what``: what
    must agree, in the caller's words (the styles'), instead of the primitive's arguments."""
    finish = agree(kind, numel=t.numel() if numel is None else numel, dtype=t.dtype, op=op, algorithm=_RING,
                   group=group, device=t.device, timeout=timeout, signature=_ring.signature((name, *key)),
                   chunks=chunks or 0, wait=False)
    what = what or (
        "a_shard's shape and dtype, gather_dim and whether a_shard requires a gradient" if kind == "all_gather"
        else "the product's shape (a's leading dimensions, b's columns), dtype and dimension, and whether "
             "any of a, b requires a gradient (the backward's ring)" if kind == "reduce_scatter"
        else "the product's shape (a's leading dimensions, b's columns) and dtype")
    return renamed(finish, name, "before the ring started",
                   f"{what} (and chunks, where given) must be the same on every rank of the group")
