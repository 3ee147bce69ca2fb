"""Context parallelism: ring attention and Ulysses attention (docs/guide.md, "Context parallelism";
docs/architecture.md sections 3, 4 and 5.8; fault cases in docs/faults.md row 39).

The sequence is split over the ranks of a context-parallel group: ``q``, ``k``, ``v`` are
``[..., S/P, D]`` on every rank (batch and heads leading, ``[B, H, S/P, D]`` typically), this rank's
contiguous block of the sequence (dim -2), block r on group rank r. Both functions return this rank's
block of ``torch.nn.functional.scaled_dot_product_attention`` over the whole sequence, with its
``scale`` and with ``is_causal`` meaning the causal mask of the whole sequence.

- :func:`ring_attention`: the K/V blocks travel around the ring while this rank attends to the block
  it holds. For step k = 0 .. P - 1 (this rank holds the K/V block of rank ``me - k``): (1) submit
  the step's rotation (send the block to the next rank, receive the next one from the previous
  rank), (2) attend to the block held, (3) merge the block's output into the running output with
  its log-sum-exp (online softmax, in fp32; fp64 for fp64 inputs), (4) wait for the rotation. Causal:
  blocks entirely in the future are skipped (their compute; the rotation still runs), the block on
  the diagonal is causal, blocks in the past are attended in full. The backward pass is decomposed
  the same way, as in the standard ring-attention backward: a ``torch.autograd.Function`` whose
  backward rotates K/V around the ring again together with the partial sums of their gradients
  (dK, dV, accumulated in fp32), each block's gradient computed from the whole sequence's output
  and log-sum-exp while the next rotation runs; a block's sum starts on the rank after its owner,
  and after P steps one last rotation brings every block's sum home, where the owner adds its own
  part. dQ stays local. With ``keep_kv=True`` the forward is the chunked all-gather ring of
  ``_ring`` (every chunk of key rows attended as it lands) and keeps every block, and the backward
  moves the partial sums only: the chunked reduce-scatter ring, each chunk's sum sent on while the
  next one's gradient is computed, the own block last, behind the sums coming home. The chunk count
  is the tensor-parallel rings' (``_tp_choice.chunks_for``, from the group's link, or ``chunks``).
- ``layout="zigzag"`` (causal load balancing): with the contiguous layout and ``is_causal`` rank
  P - 1 attends to P blocks and rank 0 to one. With the zig-zag layout the sequence is cut into 2P
  chunks and rank r holds chunks r and 2P - 1 - r (:func:`zigzag_shard` cuts a whole sequence so,
  :func:`zigzag_unshard` puts the ranks' shards back in order), and every rank attends to the same
  amount at every step: the diagonal causally, a block of an earlier rank with the first half of
  its keys, a block of a later rank with the second half of its queries. Never the default.
- :func:`ulysses_attention`: (1) one all-to-all (``commopt.comm.alltoall``; its 2-D algorithm when
  ``topology`` has two levels) turns the sequence-sharded ``[..., H, S/P, D]`` q, k and v (sent
  together) into head-sharded ``[..., H/P, S, D]``, (2) local
  ``scaled_dot_product_attention`` over the whole sequence, (3) the inverse all-to-all. Autograd
  flows through the all-to-alls (the backward of an all-to-all is the inverse all-to-all). H must
  divide by P.

Every rotation is one engine phase (:class:`commopt.comm.engine.Phase`) on the group, submitted from
the calling thread in ring order once the rotation before it has completed, and runs on the group's
engine worker while the caller's thread computes (the ring step of
``commopt.schedules.tensor_parallel``), so the ordering invariant of docs/architecture.md section 3
holds beside data-parallel traffic on other groups. On CPU each block's attention is torch's fused
flash kernel for CPU (the one ``scaled_dot_product_attention`` uses, which also returns the
log-sum-exp the merge needs); elsewhere, and where q's and v's head sizes differ, it is computed
explicitly in fp32 (O(block^2) memory per step).

Checks (docs/faults.md row 39): wrong arguments are ``TypeError`` / ``ValueError`` at the call, on
the calling rank, before anything is sent; then one agreement check on the group
(``commopt.comm.checks.agree``: the shapes, dtype, ``is_causal``, ``scale``, layout and whether
gradients are needed) raises ``CollectiveMismatchError`` on every rank before any payload moves when
the ranks differ, or ``CommTimeoutError`` when a rank never enters within ``timeout``. A world or
group of one is plain ``scaled_dot_product_attention``. Not supported: ``attn_mask``, dropout,
grouped-query attention (k, v with fewer heads than q: repeat them first).
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed import ProcessGroup

from commopt.comm.algorithms import deadline_of
from commopt.comm.alltoall import all_to_all_autograd
from commopt.comm.checks import agree, check_timeout, renamed
from commopt.comm.runtime import context
from commopt.comm.topology import Topology

from . import _ring
from ._tp_choice import check_chunks, chunks_for

__all__ = ["ring_attention", "ulysses_attention", "zigzag_shard", "zigzag_unshard"]

_LAYOUTS = ("contiguous", "zigzag")
# torch's fused flash attention for CPU, which returns the log-sum-exp with the output (None where
# this torch lacks it: every block is then computed explicitly).
_FLASH_CPU = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)
_FLASH_CPU_BACKWARD = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu_backward", None)


# --------------------------------------------------------------------------------- public functions
def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, group: ProcessGroup | None = None,
                   is_causal: bool = False, scale: float | None = None, layout: str = "contiguous",
                   keep_kv: bool = False, timeout: float | None = None, chunks: int | None = None) -> torch.Tensor:
    """This rank's block of ``scaled_dot_product_attention(Q, K, V, is_causal=, scale=)`` over the whole
    sequence, K/V blocks rotating around the group while the block held is attended (module docstring).

    Args:
        q, k, v: ``[..., S/P, D]`` (``v``: ``[..., S/P, Dv]``), this rank's block of the sequence
            (dim -2): block r on group rank r with ``layout="contiguous"``, chunks r and 2P - 1 - r of
            2P with ``layout="zigzag"`` (:func:`zigzag_shard`). The same leading dimensions and
            sequence length for all three, and the same shapes and dtype on every rank.
        group: the context-parallel process group (None: WORLD).
        is_causal: the causal mask of the whole sequence (token i attends to tokens 0 .. i).
        scale: as ``scaled_dot_product_attention``'s (None: ``1 / sqrt(D)``).
        layout: ``"contiguous"`` or ``"zigzag"`` (causal load balancing; the local sequence length
            must then be even).
        keep_kv: keep the K/V blocks that arrive in the forward ring for the backward, which then
            moves only the partial sums of dK and dV (P - 1 per rank, as the all-gathered form's
            reduce-scatter) instead of rotating K/V around the ring again; the memory is then the
            all-gathered form's (every rank's K and V held from forward to backward) rather than two
            blocks. Must be the same on every rank.
        timeout: seconds the call may take, the agreement check and every rotation together, before
            ``CommTimeoutError`` (None: the group's own timeout); the backward pass gets as long.
        chunks: with ``keep_kv``, the pieces of key rows each ring step is cut into (None: by the
            group's link, as the tensor-parallel rings); the same on every rank.

    Returns:
        ``[..., S/P, Dv]``: this rank's block of the attention output, in the layout of ``q``.
        Differentiable: the backward rotates K/V (unless ``keep_kv``) and the partial sums of their
        gradients around the ring again; every rank must run it (with the same ``requires_grad`` on
        q, k and v).

    Raises:
        TypeError, ValueError: a bad argument, at the call (docs/faults.md row 39).
        CollectiveMismatchError: the ranks' shapes, dtypes, ``is_causal``, ``scale``, ``layout``,
            ``keep_kv`` or ``requires_grad`` differ (on every rank, before any payload moves).
        CommTimeoutError: a rank did not enter the call, or a rotation did not finish, within ``timeout``.
    """
    name = "ring_attention"
    _check_qkv(name, q, k, v, min_ndim=2)
    _check_flags(name, is_causal, scale)
    if layout not in _LAYOUTS:
        raise ValueError(f"{name}: layout must be one of {list(_LAYOUTS)}, got {layout!r}")
    if not isinstance(keep_kv, bool):
        raise TypeError(f"{name}: keep_kv must be True or False, got {type(keep_kv).__name__}")
    if layout == "zigzag" and q.shape[-2] % 2:
        raise ValueError(f"{name}: layout='zigzag' needs an even local sequence length (two chunks per rank), "
                         f"got q of shape {list(q.shape)}; cut the sequence into 2 * group size equal chunks "
                         f"(zigzag_shard)")
    _ring.check_group(name, group)
    timeout = check_timeout(name, timeout)
    chunks = check_chunks(name, chunks)
    size = _ring.group_size(name, group)
    if size == 1:
        return F.scaled_dot_product_attention(q, k, v, is_causal=is_causal, scale=scale)
    deadline = deadline_of(timeout)
    _ring.resolve_link(name, group, timeout)  # the chunk count of keep_kv's rings reads the group's link
    gate = _agree(name, "all_gather", "ring", q, k, v, (layout, bool(is_causal), scale, keep_kv, chunks), group,
                  timeout, wait=False)
    return _RingAttention.apply(q, k, v, bool(is_causal), scale, layout, group, timeout, deadline, gate, keep_kv,
                                chunks)


def ulysses_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, group: ProcessGroup | None = None,
                      topology: Topology | None = None, is_causal: bool = False, scale: float | None = None,
                      timeout: float | None = None) -> torch.Tensor:
    """This rank's block of ``scaled_dot_product_attention(Q, K, V, is_causal=, scale=)`` over the whole
    sequence, by all-to-alls between sequence and head sharding (DeepSpeed-Ulysses; module docstring).

    Args:
        q, k, v: ``[..., H, S/P, D]`` (``v``: ``[..., H, S/P, Dv]``), this rank's contiguous block of
            the sequence (dim -2), block r on group rank r, heads on dim -3. H must divide by the
            group size P. The same shapes and dtype on every rank.
        group: the context-parallel process group (None: WORLD).
        topology: the layout of ``group`` (None: detected); with two levels (nodes of equal size,
            more than one rank per node) the all-to-alls use commopt's 2-D algorithm.
        is_causal, scale: passed to ``scaled_dot_product_attention`` on the whole sequence.
        timeout: seconds each all-to-all (and the agreement check) may take before ``CommTimeoutError``.

    Returns:
        ``[..., H, S/P, Dv]``: this rank's block of the attention output. Differentiable: the backward
        of each all-to-all is the inverse all-to-all; every rank must run it.

    Raises:
        TypeError, ValueError: a bad argument, H not divisible by P, at the call (docs/faults.md row 39).
        CollectiveMismatchError: the ranks' shapes, dtypes, ``is_causal``, ``scale``, ``requires_grad`` or
            ``topology`` (two levels or not) differ (every rank, before any payload moves).
        CommTimeoutError: a rank did not enter the call, or an all-to-all did not finish, within ``timeout``.
    """
    name = "ulysses_attention"
    _check_qkv(name, q, k, v, min_ndim=3)
    _check_flags(name, is_causal, scale)
    _ring.check_group(name, group)
    if topology is not None and not isinstance(topology, Topology):
        raise TypeError(f"{name}: topology must be a commopt.comm.Topology or None (detected), got "
                        f"{type(topology).__name__}")
    timeout = check_timeout(name, timeout)
    size = _ring.group_size(name, group)
    heads = q.shape[-3]
    if heads % size:
        raise ValueError(f"{name}: q has {heads} heads (dim -3), which is not divisible by the group size {size}; "
                         f"Ulysses gives every rank H/P whole heads. Use ring_attention, which has no such "
                         f"constraint, or a group whose size divides the head count")
    if size == 1:
        return F.scaled_dot_product_attention(q, k, v, is_causal=is_causal, scale=scale)
    if topology is not None and topology.world_size != size:
        raise ValueError(f"{name}: topology has world_size={topology.world_size} but the group has {size} ranks; "
                         f"pass the topology of the group (Topology.from_spec(spec, group=group))")
    algorithm = "2d" if topology is not None and topology.two_levels else "auto"
    _agree(name, "all_to_all", "ulysses", q, k, v, (bool(is_causal), scale, algorithm), group, timeout)
    dq, dk = q.shape[-1], k.shape[-1]
    # q, k and v travel together: one all-to-all each way instead of three.
    qkv = _seq_to_heads(torch.cat([q, k, v], dim=-1), size, group, topology, algorithm, timeout)
    qh, kh, vh = qkv.split([dq, dk, v.shape[-1]], dim=-1)
    out = F.scaled_dot_product_attention(qh, kh, vh, is_causal=is_causal, scale=scale)
    return _heads_to_seq(out, size, group, topology, algorithm, timeout)


def zigzag_shard(x: torch.Tensor, dim: int = -2, *, group: ProcessGroup | None = None) -> torch.Tensor:
    """This rank's zig-zag shard of a whole sequence, the input layout of ``ring_attention(...,
    layout="zigzag")``: ``x`` cut along ``dim`` into 2P equal chunks, chunks r and 2P - 1 - r
    concatenated (r this rank in ``group``, P its size). No communication; differentiable.

    Use it on everything indexed by the sequence (token ids, position ids, labels, or q/k/v built
    from the whole sequence) so that every rank's rows match its chunks; :func:`zigzag_unshard` is
    the inverse on the ranks' shards concatenated in rank order.

    Raises:
        ValueError: ``x.shape[dim]`` is not divisible by 2P.
    """
    d, size, rank = _zigzag_args("zigzag_shard", x, dim, group)
    c = x.shape[d] // (2 * size)
    return torch.cat([x.narrow(d, rank * c, c), x.narrow(d, (2 * size - 1 - rank) * c, c)], dim=d)


def zigzag_unshard(x: torch.Tensor, dim: int = -2, *, group: ProcessGroup | None = None) -> torch.Tensor:
    """The whole sequence in its natural order from the ranks' zig-zag shards concatenated in rank
    order along ``dim`` (what ``torch.cat(all_gather(shard), dim)`` gives): the inverse of
    :func:`zigzag_shard` over the group. No communication; differentiable.

    Raises:
        ValueError: ``x.shape[dim]`` is not divisible by 2P.
    """
    d, size, _rank = _zigzag_args("zigzag_unshard", x, dim, group)
    c = x.shape[d] // (2 * size)
    # Rank r's shard holds chunk r (its first half) and chunk 2P - 1 - r (its second half): chunk g is
    # piece 2g of x for g < P, piece 2(2P - 1 - g) + 1 otherwise (narrow, not split: c may be 0).
    ordered = [x.narrow(d, (2 * g if g < size else 2 * (2 * size - 1 - g) + 1) * c, c) for g in range(2 * size)]
    return torch.cat(ordered, dim=d)


# --------------------------------------------------------------------------------- ring attention
class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, causal, scale, layout, group, timeout, deadline, gate, keep_kv, chunks):
        q4, k4, v4 = _as4(q), _as4(k), _as4(v)
        kept = None
        if keep_kv:
            out, lse, kept = _gather_forward(q4, k4, v4, causal, scale, layout, group, timeout, deadline, gate,
                                             chunks)
        else:
            out, lse = _ring_forward(q4, k4, v4, causal, scale, layout, group, timeout, deadline, gate)
        ctx.save_for_backward(q4, k4, v4, out, lse)
        ctx.kept = kept  # every rank's K/V block (an intermediate of this call, freed with the graph)
        ctx.args = (causal, scale, layout, group, timeout)
        ctx.chunks = chunks
        ctx.shapes = (q.shape, k.shape, v.shape)
        return out.reshape(tuple(q.shape[:-1]) + (v.shape[-1],))

    @staticmethod
    @_ring.once_differentiable("ring_attention")
    def backward(ctx, g):
        q4, k4, v4, out, lse = ctx.saved_tensors
        causal, scale, layout, group, timeout = ctx.args
        g4 = g.reshape(out.shape)
        if ctx.kept is not None:
            dq, dk, dv = _ring_backward_kept(g4, q4, ctx.kept, k4, v4, out, lse, causal, scale, layout, group,
                                             timeout, deadline_of(timeout), ctx.chunks)
            ctx.kept = None
        else:
            dq, dk, dv = _ring_backward(g4, q4, k4, v4, out, lse, causal, scale, layout, group, timeout,
                                        deadline_of(timeout))
        qs, ks, vs = ctx.shapes
        need = ctx.needs_input_grad
        return (dq.reshape(qs) if need[0] else None, dk.reshape(ks) if need[1] else None,
                dv.reshape(vs) if need[2] else None, None, None, None, None, None, None, None, None, None)


def _block(layout: str, causal: bool, me: int, j: int, s: int) -> tuple[slice, slice, bool] | None:
    """What this rank's queries (block ``me``) attend to in the K/V block of rank ``j``: ``(query rows,
    key rows, causal)`` of the local blocks, or None when nothing (a block entirely in the future).

    Contiguous: earlier blocks in full, the diagonal causally, later ones not at all. Zig-zag (rank r
    holds chunks r and 2P - 1 - r, each ``s / 2`` long): the diagonal block is causal on the local
    rows (both are in increasing global order); of an earlier rank's block (j < r) both chunks
    attend to its chunk j and neither to its chunk 2P - 1 - j > 2P - 1 - r; of a later rank's block
    (j > r) only chunk 2P - 1 - r attends, to both chunks (j < P <= 2P - 1 - r, 2P - 1 - j < 2P - 1 - r).
    """
    every = slice(None)
    if s == 0:
        return None
    if not causal:
        return every, every, False
    if j == me:
        return every, every, True
    if layout == "contiguous":
        return (every, every, False) if j < me else None
    c = s // 2
    return (every, slice(0, c), False) if j < me else (slice(c, None), every, False)


def _ring_forward(q, k, v, causal, scale, layout, group, timeout, deadline,
                  gate: Callable[[], None] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The forward ring on ``[1, N, s, D]`` blocks: ``(output in q's dtype, log-sum-exp in fp32/fp64)``.
    ``gate``: the call's agreement check, which every step waits for before it moves anything and
    this thread before it waits for the first step (the local block is attended meanwhile)."""
    op = "ring_attention"
    size, me = dist.get_world_size(group), dist.get_rank(group)
    engine = context().engine()
    s, acc = q.shape[-2], _acc(q.dtype)
    # K and V travel as one buffer (one phase per step); two buffers alternate between sending and receiving.
    nk = k.numel()
    held = torch.cat([k.reshape(-1), v.reshape(-1)])
    spare = torch.empty_like(held)
    out = q.new_zeros(tuple(q.shape[:-1]) + (v.shape[-1],), dtype=acc)
    lse = q.new_full(tuple(q.shape[:-1]), -math.inf, dtype=acc)
    for step in range(size):
        fut = _ring.step(engine, op, group, held, spare, deadline, gate) if step + 1 < size else None
        plan = _block(layout, causal, me, (me - step) % size, s)
        if plan is not None:
            rows, cols, diag = plan
            kj, vj = held[:nk].view(k.shape), held[nk:].view(v.shape)
            o, block_lse = _attend(q[..., rows, :], kj[..., cols, :], vj[..., cols, :], diag, scale)
            _merge(out[..., rows, :], lse[..., rows], o, block_lse)
        if gate is not None:
            gate()  # the agreement check, on this thread: its error rather than a phase's
            gate = None
        if fut is not None:
            _ring.wait_step(fut, op, timeout, deadline)
            held, spare = spare, held
    return out.to(q.dtype), lse


def _ring_backward(g, q, k, v, out, lse, causal, scale, layout, group, timeout, deadline):
    """The backward ring: ``(dq, dk, dv)`` of this rank's blocks.

    At step k this rank holds the K/V block of rank ``j = me - k`` and computes its contribution to
    block j's gradient. Its own block's (step 0) stays here. Block j's partial sum starts on the rank
    after j (its step 1: that rank's contribution alone) and travels on one rank per step with the
    next K/V block: from step 2 each step's phase sends the partial sum of the block held at the step
    before and receives block j's from the previous rank, to which this rank's contribution is added
    once both are done. Steps 0 and 1 send K/V only (at P = 2, step 1 nothing), steps 2 .. P - 2 both,
    step P - 1 the sum only; a last phase brings every block's sum home, where the owner adds its own
    part. Per rank: P - 1 K/V blocks and P - 1 partial sums (a reduce-scatter's share). Buffers are
    bytes: the sums (fp32; fp64 for fp64) first, then K and V in their dtype, so that one phase
    moves both.
    """
    op = "ring_attention/backward"
    size, me = dist.get_world_size(group), dist.get_rank(group)
    engine = context().engine()
    s, acc = q.shape[-2], _acc(q.dtype)
    held, spare = _Slab(k, v, acc), _Slab(k, v, acc)
    held.k.copy_(k)
    held.v.copy_(v)
    dq = torch.zeros(q.shape, dtype=acc, device=q.device)
    own_dk = torch.zeros(k.shape, dtype=acc, device=k.device)
    own_dv = torch.zeros(v.shape, dtype=acc, device=v.device)
    for step in range(size):
        kv, sums = step + 1 < size, step >= 2
        fut = None
        if kv or sums:
            region = "raw" if kv and sums else "kv" if kv else "sums"
            fut = _ring.step(engine, op, group, getattr(held, region), getattr(spare, region), deadline)
        plan = _block(layout, causal, me, (me - step) % size, s)
        grads = None
        if plan is not None:
            rows, cols, diag = plan
            grads = _attend_backward(g[..., rows, :], q[..., rows, :], held.k[..., cols, :], held.v[..., cols, :],
                                     out[..., rows, :], lse[..., rows], diag, scale)
            dq[..., rows, :] += grads[0]
        if fut is not None:  # None: nothing to move (empty blocks)
            _ring.wait_step(fut, op, timeout, deadline)
        if step == 0:
            dk, dv = own_dk, own_dv
        else:
            dk, dv = spare.dk, spare.dv
            if step == 1:  # block me - 1's partial sum starts here
                dk.zero_()
                dv.zero_()
        if grads is not None:
            dk[..., cols, :] += grads[1]
            dv[..., cols, :] += grads[2]
        held, spare = spare, held
    # ``held`` has the sum of block me + 1 but for its owner's part: send it home, receive ours.
    fut = _ring.step(engine, op, group, held.sums, spare.sums, deadline)
    if fut is not None:
        _ring.wait_step(fut, op, timeout, deadline)
    return dq.to(q.dtype), (spare.dk + own_dk).to(k.dtype), (spare.dv + own_dv).to(v.dtype)


def _gather_forward(q, k, v, causal, scale, layout, group, timeout, deadline, gate: Callable[[], None] | None,
                    chunks: int | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The forward ring of ``keep_kv`` on ``[1, N, s, D]`` blocks: ``(output, log-sum-exp, blocks)``,
    ``blocks`` every rank's K/V as ``[P, s, N, D + Dv]`` (rank j's in slot j, sequence first, so that
    a chunk of key rows is contiguous). The chunked all-gather ring (``_ring.all_gather``, chunks by
    ``_tp_choice.chunks_for``) moves them while this rank attends to its own block, then to each
    chunk of key rows as it lands, merged by the online softmax."""
    op = "ring_attention"
    size, me = dist.get_world_size(group), dist.get_rank(group)
    s, n, d, acc = q.shape[-2], q.shape[1], k.shape[-1], _acc(q.dtype)
    blocks = k.new_empty((size, s, n, d + v.shape[-1]))
    blocks[me, ..., :d] = k[0].transpose(0, 1)
    blocks[me, ..., d:] = v[0].transpose(0, 1)
    out = q.new_zeros(tuple(q.shape[:-1]) + (v.shape[-1],), dtype=acc)
    lse = q.new_full(tuple(q.shape[:-1]), -math.inf, dtype=acc)
    chunks = chunks_for(blocks[0].numel() * blocks.element_size(), s, group, q.device, chunks)
    for src, lo, hi in _ring.all_gather(op, blocks, chunks, group, timeout, deadline, gate):
        plan = _block(layout, causal, me, src, s)
        if plan is None or (src == me and lo > 0):
            continue
        rows, cols, diag = plan
        if src == me:  # the own block whole (the diagonal is causal): it moves nowhere
            kj, vj, (a, b) = k, v, (0, s)
        else:
            a, b = _within(cols, lo, hi, s)
            kj, vj = _kv(blocks[src], a, b, d)
        if a < b:
            o, block_lse = _attend(q[..., rows, :], kj, vj, diag, scale)
            _merge(out[..., rows, :], lse[..., rows], o, block_lse)
    return out.to(q.dtype), lse, blocks


def _ring_backward_kept(g, q, blocks, k, v, out, lse, causal, scale, layout, group, timeout, deadline,
                        chunks: int | None = None):
    """The backward of ``keep_kv`` from the forward's ``blocks``: ``(dq, dk, dv)`` of this rank's blocks,
    with only the partial sums of dK and dV moving: the chunked reduce-scatter ring
    (``_ring.reduce_scatter``, P - 1 blocks of sums per rank, the all-gathered form's bytes). At step
    k this rank computes its contribution to block ``me - k - 1``'s gradient chunk of key rows by
    chunk, each sent on (with the previous rank's partial sum of it added) while the next is computed;
    its own block comes last, computed whole while the other ranks' parts of its sum arrive."""
    op = "ring_attention/backward"
    me = dist.get_rank(group)
    s, n, d, dv_size, acc = q.shape[-2], q.shape[1], k.shape[-1], v.shape[-1], _acc(q.dtype)
    dq = torch.zeros(q.shape, dtype=acc, device=q.device)
    own: list = []

    def attended(c: int, rows: slice, a: int, b: int, kj, vj, diag: bool) -> torch.Tensor:
        """Block c's key rows a:b attended by this rank's query ``rows``: dq added here, ``[b - a, N,
        D + Dv]`` sums of dk and dv returned."""
        dq_c, dk_c, dv_c = _attend_backward(g[..., rows, :], q[..., rows, :], kj, vj, out[..., rows, :],
                                            lse[..., rows], diag, scale)
        dq[..., rows, :] += dq_c
        return torch.cat([dk_c[0], dv_c[0]], dim=-1).transpose(0, 1).to(acc)

    def partial(c: int, lo: int, hi: int) -> torch.Tensor:
        part = torch.zeros((hi - lo, n, d + dv_size), dtype=acc, device=q.device)
        plan = _block(layout, causal, me, c, s)
        if c == me:  # the own block whole, once (the diagonal is causal); its chunks are views of it
            if not own:
                own.append(attended(c, plan[0], 0, s, k, v, plan[2]) if plan is not None else part)
            return own[0][lo:hi]
        if plan is not None:
            rows, cols, _ = plan
            a, b = _within(cols, lo, hi, s)
            if a < b:
                part[a - lo:b - lo] = attended(c, rows, a, b, *_kv(blocks[c], a, b, d), False)
        return part

    chunks = chunks_for(s * n * (d + dv_size) * dq.element_size(), s, group, q.device, chunks)
    sums = _ring.reduce_scatter(op, partial, lambda _c, lo, hi: (hi - lo, n, d + dv_size), group, timeout, deadline,
                                dq, dim=0, extent=lambda _c: s, chunks=chunks)
    dk = sums[..., :d].transpose(0, 1).unsqueeze(0)
    dv = sums[..., d:].transpose(0, 1).unsqueeze(0)
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


def _within(cols: slice, lo: int, hi: int, s: int) -> tuple[int, int]:
    """The key rows of the chunk ``lo:hi`` that ``cols`` (a slice of a block of ``s`` rows) attends to."""
    start, stop, _ = cols.indices(s)
    return max(lo, start), min(hi, stop)


def _kv(block: torch.Tensor, a: int, b: int, d: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Key rows ``a:b`` of a kept ``[s, N, D + Dv]`` block as ``[1, N, b - a, D]`` k and ``[1, N, b - a, Dv]`` v."""
    rows = block[a:b]
    return (rows[..., :d].transpose(0, 1).unsqueeze(0).contiguous(),
            rows[..., d:].transpose(0, 1).unsqueeze(0).contiguous())


class _Slab:
    """One buffer of the backward ring, as bytes: ``[dk | dv]`` in the accumulation dtype, then
    ``[k | v]`` in the inputs' dtype (the sums first, so that every typed view is aligned)."""

    def __init__(self, k: torch.Tensor, v: torch.Tensor, acc: torch.dtype):
        a = torch.empty((), dtype=acc).element_size()
        e = k.element_size()
        nsum = (k.numel() + v.numel()) * a
        self.raw = torch.empty(nsum + (k.numel() + v.numel()) * e, dtype=torch.uint8, device=k.device)
        self.sums, self.kv = self.raw[:nsum], self.raw[nsum:]
        sums, kv = self.sums.view(acc), self.kv.view(k.dtype)
        self.dk, self.dv = sums[:k.numel()].view(k.shape), sums[k.numel():].view(v.shape)
        self.k, self.v = kv[:k.numel()].view(k.shape), kv[k.numel():].view(v.shape)


# --------------------------------------------------------------------------------- one block
def _acc(dtype: torch.dtype) -> torch.dtype:
    """The dtype softmax statistics and sums are kept in: fp64 for fp64, else fp32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def _fused(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> bool:
    # The CPU flash kernel needs one head size for q, k and v, and dies (SIGFPE) on empty blocks.
    return (_FLASH_CPU is not None and q.device.type == "cpu" and q.shape[-1] == v.shape[-1]
            and q.numel() > 0 and k.numel() > 0)


def _attend(q, k, v, causal: bool, scale: float | None) -> tuple[torch.Tensor, torch.Tensor]:
    """One block's attention: ``(softmax(q k^T * scale) v, logsumexp(q k^T * scale))``, causal meaning
    the upper triangle of a square block masked."""
    acc = _acc(q.dtype)
    if _fused(q, k, v):
        o, lse = _FLASH_CPU(q, k, v, 0.0, causal, scale=scale)
        return o, lse.to(acc)
    scores = _scores(q, k, causal, scale, acc)
    lse = torch.logsumexp(scores, dim=-1)
    return torch.matmul(torch.exp(scores - lse.unsqueeze(-1)), v.to(acc)), lse


def _attend_backward(g, q, k, v, out, lse, causal: bool, scale: float | None):
    """One block's ``(dq, dk, dv)`` given the whole sequence's output ``out`` and log-sum-exp ``lse``
    (the block's probabilities are ``exp(scores - lse)``, and the softmax's correction term is
    ``rowsum(g * out)`` over the whole sequence: flash attention's backward, block by block)."""
    acc = _acc(q.dtype)
    if _fused(q, k, v):
        return _FLASH_CPU_BACKWARD(g.contiguous(), q.contiguous(), k.contiguous(), v.contiguous(), out.contiguous(),
                                   lse.contiguous(), 0.0, causal, scale=scale)
    ga, qa, ka, va = g.to(acc), q.to(acc), k.to(acc), v.to(acc)
    p = torch.exp(_scores(q, k, causal, scale, acc) - lse.unsqueeze(-1))
    dv = torch.matmul(p.transpose(-1, -2), ga)
    ds = p * (torch.matmul(ga, va.transpose(-1, -2)) - (ga * out.to(acc)).sum(-1, keepdim=True))
    factor = _scale(scale, q)
    return torch.matmul(ds, ka) * factor, torch.matmul(ds.transpose(-1, -2), qa) * factor, dv


def _scores(q, k, causal: bool, scale: float | None, acc: torch.dtype) -> torch.Tensor:
    scores = torch.matmul(q.to(acc), k.to(acc).transpose(-1, -2)) * _scale(scale, q)
    if causal:
        future = torch.ones(scores.shape[-2:], dtype=torch.bool, device=q.device).triu(1)
        scores = scores.masked_fill(future, -math.inf)
    return scores


def _scale(scale: float | None, q: torch.Tensor) -> float:
    # D = 0: every score is an empty sum, 0 at any scale (scaled_dot_product_attention's uniform weights).
    if scale is None:
        return 1.0 / math.sqrt(q.shape[-1]) if q.shape[-1] else 1.0
    return scale


def _merge(out: torch.Tensor, lse: torch.Tensor, o: torch.Tensor, o_lse: torch.Tensor) -> None:
    """Online softmax, in place on views of the running ``out``/``lse``: rows weighted by
    ``exp(lse_i - logaddexp(lse_1, lse_2))`` (a row seen for the first time has ``lse = -inf``, weight 0)."""
    new = torch.logaddexp(lse, o_lse)
    out.mul_(torch.exp(lse - new).unsqueeze(-1)).add_(o.to(out.dtype) * torch.exp(o_lse - new).unsqueeze(-1))
    lse.copy_(new)


def _as4(x: torch.Tensor) -> torch.Tensor:
    """``[..., s, d]`` as ``[1, N, s, d]`` (the flash kernel's layout), N the product of the leading dims."""
    return x.reshape(1, math.prod(x.shape[:-2]), x.shape[-2], x.shape[-1])


# --------------------------------------------------------------------------------- Ulysses
def _seq_to_heads(x: torch.Tensor, size: int, group, topology, algorithm: str, timeout) -> torch.Tensor:
    """``[..., H, s, D]`` sequence-sharded -> ``[..., H/P, P*s, D]`` head-sharded: head group j goes to
    rank j (rows of the all-to-all), and what rank i sends is block i of the sequence. Its errors, and
    its backward's, name ``ulysses_attention`` and the exchange."""
    *lead, h, s, d = x.shape
    send = x.reshape(*lead, size, h // size, s, d).movedim(-4, 0).contiguous()
    got = all_to_all_autograd(send, group=group, topology=topology, algorithm=algorithm, timeout=timeout,
                              name="ulysses_attention: the all-to-all of q, k and v from sequence to heads")
    return got.movedim(0, -3).reshape(*lead, h // size, size * s, d)


def _heads_to_seq(x: torch.Tensor, size: int, group, topology, algorithm: str, timeout) -> torch.Tensor:
    """The inverse of :func:`_seq_to_heads`: ``[..., H/P, P*s, D]`` -> ``[..., H, s, D]``."""
    *lead, hp, n, d = x.shape
    s = n // size
    send = x.reshape(*lead, hp, size, s, d).movedim(-3, 0).contiguous()
    got = all_to_all_autograd(send, group=group, topology=topology, algorithm=algorithm, timeout=timeout,
                              name="ulysses_attention: the all-to-all of the output from heads to sequence")
    return got.movedim(0, -4).reshape(*lead, size * hp, s, d)


# --------------------------------------------------------------------------------- checks
def _check_qkv(name: str, q, k, v, min_ndim: int) -> None:
    for what, t in (("q", q), ("k", k), ("v", v)):
        _ring.check_float_tensor(name, what, t)
        if t.dim() < min_ndim:
            need = "[..., S/P, D]" if min_ndim == 2 else "[..., H, S/P, D] (heads on dim -3)"
            raise ValueError(f"{name}: {what} has shape {list(t.shape)}; it must be {need}, at least {min_ndim}-D")
    for what, t in (("k", k), ("v", v)):
        if t.dtype != q.dtype:
            raise TypeError(f"{name}: {what} has dtype {t.dtype} but q has {q.dtype}; cast them to one dtype")
        if t.device != q.device:
            raise ValueError(f"{name}: {what} is on {t.device} but q is on {q.device}; move them to one device")
        if t.shape[:-1] != q.shape[:-1]:
            raise ValueError(f"{name}: {what} has shape {list(t.shape)} but q has {list(q.shape)}; q, k and v must "
                             f"have the same leading dimensions and local sequence length (dim -2): this rank's "
                             f"block of one sequence (repeat k and v for grouped-query attention)")
    if k.shape[-1] != q.shape[-1]:
        raise ValueError(f"{name}: k has head size {k.shape[-1]} but q has {q.shape[-1]} (shapes {list(k.shape)}, "
                         f"{list(q.shape)}); q and k must have the same last dimension D")


def _check_flags(name: str, is_causal, scale) -> None:
    if not isinstance(is_causal, bool):
        raise TypeError(f"{name}: is_causal must be a bool, got {type(is_causal).__name__} {is_causal!r}")
    if scale is not None and (isinstance(scale, bool) or not isinstance(scale, numbers.Real)
                              or not math.isfinite(scale)):
        raise TypeError(f"{name}: scale must be a finite number or None (1 / sqrt(D)), got {scale!r}")


def _zigzag_args(name: str, x, dim, group) -> tuple[int, int, int]:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name}: x must be a torch.Tensor, got {type(x).__name__}")
    if isinstance(dim, bool) or not isinstance(dim, int):
        raise TypeError(f"{name}: dim must be an int, got {type(dim).__name__} {dim!r}")
    if not -x.dim() <= dim < x.dim():
        raise ValueError(f"{name}: dim={dim} is out of range for shape {list(x.shape)}")
    _ring.check_group(name, group)
    size = _ring.group_size(name, group)
    rank = dist.get_rank(group) if size > 1 else 0
    d = dim % x.dim()
    if x.shape[d] % (2 * size):
        raise ValueError(f"{name}: dim {dim} has size {x.shape[d]}, which is not divisible by 2 * group size = "
                         f"{2 * size} (the zig-zag layout cuts the sequence into two chunks per rank); pad the "
                         f"sequence to a multiple of {2 * size}")
    return d, size, rank


def _agree(name: str, kind: str, algorithm: str, q, k, v, key: tuple, group, timeout: float | None, *,
           wait: bool = True) -> Callable[[], None]:
    """The agreement check before any payload (docs/architecture.md section 4): shapes, dtype, flags and
    whether gradients flow must be the same on every rank, or every rank raises. ``wait=False``: issued
    only; the returned gate (thread-safe, run once) waits for it and raises, and ring steps given it
    wait for it before they move anything."""
    grads = torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v))
    shapes = (tuple(q.shape), tuple(k.shape), tuple(v.shape), str(q.dtype), grads,
              tuple(t.requires_grad for t in (q, k, v)) if grads else ())
    finish = agree(kind, numel=k.numel() + v.numel(), dtype=q.dtype, op="none", algorithm=algorithm, group=group,
                   device=q.device, timeout=timeout, signature=_ring.signature((name, *shapes, *key)), wait=False)

    which = "layout, keep_kv" if kind == "all_gather" else "topology (one or two levels)"
    gate = renamed(finish, name, "before any payload moved",
                   f"The shapes of q, k and v, their dtype, is_causal, scale, {which} and which of them require "
                   f"gradients must be the same on every rank of the group")
    if wait:
        gate()
    return gate
