"""The decomposed tensor-parallel matmuls against plain torch.distributed (issue 25, item 1).

Oracle: the unfused composition computed in the ranks with plain ``torch.distributed``
(``all_gather`` / ``all_reduce`` of the product or the gradient + ``torch.matmul`` and local autograd),
never a result of the code under test; fp32 cases are compared with ``assert_close``'s fp32
tolerances against an fp32 composition, bf16 cases against a float64 composition of the same bf16
inputs with tolerances from bf16's epsilon and the group size. ``matmul_all_reduce`` is also checked
against the whole unsharded computation on one rank (every rank's inputs regenerated from their
seeds): that is what fixes its backward as torch's ``RowwiseParallel`` one (local, the gradient
arriving replicated). Each world size runs its whole matrix in one pool call (docs/architecture.md
section 9). docs/faults.md row 39: a rank that never enters, shapes that differ across the group,
bad arguments.
"""

from __future__ import annotations

import math
import time
from datetime import timedelta
from functools import partial

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from _oracle import close_to, sent_bytes
from _pool import RankPool
from torch import nn
from torch.distributed import ReduceOp
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import ColwiseParallel as TorchColwise
from torch.distributed.tensor.parallel import PrepareModuleInput, parallelize_module
from torch.distributed.tensor.parallel import RowwiseParallel as TorchRowwise
from torch.distributed.tensor.parallel import SequenceParallel as TorchSequence

from commopt.comm import context
from commopt.comm.errors import CollectiveMismatchError, CommTimeoutError
from commopt.schedules import (
    ColwiseParallel,
    RowwiseParallel,
    SequenceParallel,
    all_gather_matmul,
    matmul_all_reduce,
    matmul_reduce_scatter,
)

T = 60.0  # the calls' timeout where nothing is meant to time out
ABSENT = 2.0  # the timeout of a call a peer never enters (row 39)
SLACK = 10.0  # room for a cold process on 2 busy cores (docs/faults.md)


def _rand(shape, dtype: torch.dtype, seed: int, scale: float = 1.0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(shape, generator=g, dtype=torch.float64) * scale).to(dtype)


def _oracle_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float32 if dtype == torch.float32 else torch.float64


# --------------------------------------------------------------------------------- the cases
def _case_all_gather_matmul(seed: int, dtype: torch.dtype, shard_shape: tuple, dim: int, widths: list[int],
                            return_a: bool, skip_last: bool, group, timeout, chunks: int | None = None) -> None:
    """``all_gather_matmul`` against ``dist.all_gather`` + ``torch.matmul``; gradients against local
    autograd on the gathered A, reduce-scattered with ``dist.all_reduce`` (SUM) and a slice."""
    world, me = dist.get_world_size(group), dist.get_rank(group)
    what = f"all_gather_matmul[{dtype}, {shard_shape}, dim={dim}, widths={widths}, return_a={return_a}]"
    k = shard_shape[-1]
    a = _rand(shard_shape, dtype, seed * 100 + me).requires_grad_()
    bs = [_rand((k, n), dtype, seed * 100 + 50 + 10 * i + me, 1 / math.sqrt(k)).requires_grad_()
          for i, n in enumerate(widths)]
    before, before_bw = sent_bytes("all_gather_matmul"), sent_bytes("all_gather_matmul/backward")
    res = all_gather_matmul(a, bs, gather_dim=dim, group=group, return_a=return_a, timeout=timeout, chunks=chunks)
    gathered, outs = res if return_a else (None, res)
    assert isinstance(outs, list) and len(outs) == len(bs), what
    sent = sent_bytes("all_gather_matmul") - before
    assert sent == (world - 1) * a.numel() * a.element_size(), f"{what}: {sent} bytes sent"
    used = outs[:-1] if skip_last else outs
    grads = [_rand(o.shape, dtype, seed * 100 + 80 + 10 * i + me) for i, o in enumerate(used)]
    g_gathered = _rand(gathered.shape, dtype, seed * 100 + 99 + me) if return_a else None
    torch.autograd.backward(used + ([gathered] if return_a else []), grads + ([g_gathered] if return_a else []))
    sent = sent_bytes("all_gather_matmul/backward") - before_bw
    assert sent == (world - 1) * a.numel() * a.element_size(), f"{what}: backward sent {sent} bytes"

    odt = _oracle_dtype(dtype)
    parts = [torch.empty(shard_shape, dtype=odt) for _ in range(world)]
    dist.all_gather(parts, a.detach().to(odt), group=group)
    full = torch.cat(parts, dim=dim).requires_grad_()
    bs_o = [b.detach().to(odt).requires_grad_() for b in bs]
    ref_outs = [full @ b for b in bs_o]
    used_o = ref_outs[:-1] if skip_last else ref_outs
    torch.autograd.backward(used_o + ([full] if return_a else []),
                            [g.to(odt) for g in grads] + ([g_gathered.to(odt)] if return_a else []))
    grad_full = full.grad.clone()
    dist.all_reduce(grad_full, group=group)  # the reduce-scatter (SUM) of the gradient, then this rank's block
    s = shard_shape[dim % len(shard_shape)]
    ref_grad_a = grad_full.narrow(dim % len(shard_shape), me * s, s)

    for i, (o, r) in enumerate(zip(outs, ref_outs)):
        close_to(o, r.detach(), dtype, world, f"{what} output {i}")
    if return_a:
        close_to(gathered, full.detach(), dtype, world, f"{what} gathered A")
    close_to(a.grad, ref_grad_a, dtype, world, f"{what} a.grad")
    for i, (b, bo) in enumerate(zip(bs, bs_o)):
        close_to(b.grad, bo.grad, dtype, world, f"{what} bs[{i}].grad")


def _case_matmul_reduce_scatter(seed: int, dtype: torch.dtype, lead: tuple, k: int, n: int, dim: int, op,
                                group, timeout, chunks: int | None = None) -> None:
    """``matmul_reduce_scatter`` against ``dist.all_reduce`` of ``a @ b`` and a slice; gradients
    against local autograd on ``a @ b`` fed the ``dist.all_gather``-ed gradient. The contraction size
    differs between ranks (``k + rank``), as a row-parallel shard of an uneven weight does."""
    world, me = dist.get_world_size(group), dist.get_rank(group)
    what = f"matmul_reduce_scatter[{dtype}, lead={lead}, dim={dim}, op={op}]"
    kr = k + me
    a = _rand(lead + (kr,), dtype, seed * 100 + me).requires_grad_()
    b = _rand((kr, n), dtype, seed * 100 + 50 + me, 1 / math.sqrt(kr)).requires_grad_()
    before, before_bw = sent_bytes("matmul_reduce_scatter"), sent_bytes("matmul_reduce_scatter/backward")
    out = matmul_reduce_scatter(a, b, scatter_dim=dim, group=group, op=op, timeout=timeout, chunks=chunks)
    assert sent_bytes("matmul_reduce_scatter") - before == (world - 1) * out.numel() * out.element_size(), what
    g = _rand(out.shape, dtype, seed * 100 + 80 + me)
    out.backward(g)
    assert sent_bytes("matmul_reduce_scatter/backward") - before_bw == (world - 1) * g.numel() * g.element_size(), what

    odt = _oracle_dtype(dtype)
    d = dim % (len(lead) + 1)
    a_o, b_o = a.detach().to(odt).requires_grad_(), b.detach().to(odt).requires_grad_()
    p = a_o @ b_o
    total = p.detach().clone()
    dist.all_reduce(total, group=group)
    s = total.shape[d] // world
    ref = total.narrow(d, me * s, s)
    gs = [torch.empty(g.shape, dtype=odt) for _ in range(world)]
    dist.all_gather(gs, g.to(odt), group=group)
    big_g = torch.cat(gs, dim=d)
    if op == ReduceOp.AVG:
        ref, big_g = ref / world, big_g / world
    p.backward(big_g)
    close_to(out, ref, dtype, world, f"{what} output")
    close_to(a.grad, a_o.grad, dtype, world, f"{what} a.grad")
    close_to(b.grad, b_o.grad, dtype, world, f"{what} b.grad")


def _case_matmul_all_reduce(seed: int, dtype: torch.dtype, lead: tuple, k: int, n: int, group, timeout,
                            chunks: int | None = None) -> None:
    """``matmul_all_reduce`` against ``dist.all_reduce(a @ b)``, and against the whole unsharded
    ``A @ B`` (A the ranks' ``a`` concatenated on the last dimension, B their ``b`` on the first) with
    a replicated upstream gradient: each rank's ``a.grad`` / ``b.grad`` must be its slice of the
    whole gradient (torch's RowwiseParallel)."""
    world, me = dist.get_world_size(group), dist.get_rank(group)
    what = f"matmul_all_reduce[{dtype}, lead={lead}]"

    def inputs(r: int):
        kr = k + r
        return (_rand(lead + (kr,), dtype, seed * 100 + r),
                _rand((kr, n), dtype, seed * 100 + 50 + r, 1 / math.sqrt(kr)))

    a, b = (t.requires_grad_() for t in inputs(me))
    out = matmul_all_reduce(a, b, group=group, timeout=timeout, chunks=chunks)
    g = _rand(out.shape, dtype, seed * 100 + 99)  # the same on every rank: the output is replicated
    out.backward(g)

    odt = _oracle_dtype(dtype)
    a_o, b_o = a.detach().to(odt).requires_grad_(), b.detach().to(odt).requires_grad_()
    p = a_o @ b_o
    total = p.detach().clone()
    dist.all_reduce(total, group=group)
    p.backward(g.to(odt))
    close_to(out, total, dtype, world, f"{what} output")
    close_to(a.grad, a_o.grad, dtype, world, f"{what} a.grad")
    close_to(b.grad, b_o.grad, dtype, world, f"{what} b.grad")

    # The unsharded computation (no communication at all): the semantics, not only the composition.
    every = [inputs(r) for r in range(world)]
    big_a = torch.cat([x.to(odt) for x, _ in every], dim=-1).requires_grad_()
    big_b = torch.cat([y.to(odt) for _, y in every], dim=0).requires_grad_()
    whole = big_a @ big_b
    whole.backward(g.to(odt))
    lo = sum(k + r for r in range(me))
    close_to(out, whole.detach(), dtype, world, f"{what} output against the unsharded matmul")
    close_to(a.grad, big_a.grad.narrow(-1, lo, k + me), dtype, world, f"{what} a.grad against the unsharded matmul")
    close_to(b.grad, big_b.grad.narrow(0, lo, k + me), dtype, world, f"{what} b.grad against the unsharded matmul")


def _matrix(groups: bool) -> int:
    """Every case on WORLD; with ``groups`` (4 ranks) a few again on two TP groups of 2, {0, 1} and {2, 3}."""
    world = dist.get_world_size()
    seed, checked = 0, 0
    for dtype in (torch.float32, torch.bfloat16):
        # all_gather_matmul: 3-D A gathered along 0 and 1, 2-D A along -2; several Bs, one of them of a
        # width that differs between ranks (column shards of an uneven weight); return_a both ways.
        for shape, dim, return_a, skip_last in (((2, 3, 8), 0, True, False), ((2, 3, 8), 1, False, True),
                                                ((3, 8), -2, True, True)):
            seed += 1
            widths = [6, 4 + dist.get_rank(), 5][: 3 if dim == 1 else 2]
            _case_all_gather_matmul(seed, dtype, shape, dim, widths, return_a, skip_last, None,
                                    T if seed % 2 else None)
            checked += 1
        # matmul_reduce_scatter: 3-D product scattered along 0 and 1 (both divisible), SUM and AVG.
        for dim, op in ((0, ReduceOp.SUM), (1, ReduceOp.AVG), (-2, ReduceOp.SUM)):
            seed += 1
            _case_matmul_reduce_scatter(seed, dtype, (world, 2 * world), 6, 5, dim, op, None, T if seed % 2 else None)
            checked += 1
        # matmul_all_reduce: 3-D, and 1-D A (one row: the row blocks of most ranks are empty).
        for lead in ((2, 3), ()):
            seed += 1
            _case_matmul_all_reduce(seed, dtype, lead, 6, 5, None, T)
            checked += 1
    # The rings cut into chunks (``chunks`` above the rows: one per row or position; matmul_all_reduce's
    # row blocks of unequal lengths at 4 ranks), both directions of each, against the same oracle.
    _case_all_gather_matmul(80, torch.float32, (2, 3, 8), 1, [6, 4 + dist.get_rank()], True, False, None, T,
                            chunks=64)
    _case_matmul_reduce_scatter(81, torch.float32, (world, 2 * world), 6, 5, 1, ReduceOp.AVG, None, T, chunks=64)
    _case_matmul_all_reduce(82, torch.float32, (2, 3), 6, 5, None, T, chunks=3)
    checked += 3
    if groups:
        tp = [dist.new_group(members, timeout=timedelta(seconds=T)) for members in ([0, 1], [2, 3])]
        mine = tp[dist.get_rank() // 2]
        other = tp[1 - dist.get_rank() // 2]  # dist.new_group's NON_GROUP_MEMBER on this rank
        try:
            with pytest.raises(ValueError, match="all_gather_matmul: this rank .* is not a member of the group"):
                all_gather_matmul(torch.randn(2, 4), [torch.randn(4, 3)], group=other, timeout=T)
            _case_all_gather_matmul(90, torch.float32, (2, 3, 8), 1, [6, 5], True, False, mine, T)
            _case_matmul_reduce_scatter(91, torch.float32, (2, 4), 6, 5, 1, ReduceOp.SUM, mine, T)
            _case_matmul_all_reduce(92, torch.float32, (2, 3), 6, 5, mine, T)
            checked += 3
        finally:
            context().engine().release(mine)  # its worker thread, then the group (a kept pool lives on)
            dist.destroy_process_group(mine)
    return checked


@pytest.mark.parametrize("world", [2, 3, 4])
def test_matches_torch_distributed_composition(ranks, world):
    """TP 2, 3 and 4: outputs, a.grad and every b.grad of the three decomposed matmuls equal the
    unfused torch.distributed composition (fp32 to rounding, bf16 within its tolerance), gather and
    scatter dims 0 and 1, several Bs, return_a, uneven weight shards, the all-gather ring in chunks;
    at 4 ranks also on TP subgroups."""
    counts = ranks(world, _matrix, world == 4, timeout=120)
    assert counts == [counts[0]] * world and counts[0] == 19 + 3 * (world == 4)


def _edges() -> int:
    """Empty blocks (no rows, an empty contraction), a non-contiguous A that needs no gradient beside a
    B that does (the backward's ring is skipped on every rank alike), against the composition."""
    world = dist.get_world_size()
    (o,) = all_gather_matmul(torch.randn(0, 4), [torch.randn(4, 3)], timeout=T)
    assert o.shape == (0, 3)
    (o,) = all_gather_matmul(torch.randn(2, 0), [torch.randn(0, 3)], timeout=T)
    assert o.shape == (2 * world, 3) and not o.any()
    o = matmul_reduce_scatter(torch.randn(2 * world, 0), torch.randn(0, 3), timeout=T)
    assert o.shape == (2, 3) and not o.any()
    assert matmul_all_reduce(torch.randn(0, 3), torch.randn(3, 2), timeout=T).shape == (0, 2)
    a = _rand((4, 6), torch.float32, 5 + dist.get_rank()).t()  # [6, 4], not contiguous
    b = _rand((4, 5), torch.float32, 6 + dist.get_rank()).requires_grad_()
    (o,) = all_gather_matmul(a, [b], timeout=T)
    g = _rand(o.shape, torch.float32, 7 + dist.get_rank())
    o.backward(g)
    parts = [torch.empty(6, 4) for _ in range(world)]
    dist.all_gather(parts, a.contiguous())
    full = torch.cat(parts)
    torch.testing.assert_close(o, full @ b.detach())
    torch.testing.assert_close(b.grad, full.t() @ g)
    b.grad = None
    o = matmul_reduce_scatter(a, b, timeout=T)
    g = _rand(o.shape, torch.float32, 8 + dist.get_rank())
    o.backward(g)
    gs = [torch.empty_like(g) for _ in range(world)]
    dist.all_gather(gs, g)
    torch.testing.assert_close(b.grad, a.t() @ torch.cat(gs))
    return 1


def test_empty_blocks_and_inputs_without_gradient(ranks):
    """Empty blocks and partly frozen, non-contiguous inputs at TP 2: shapes, zeros and gradients as
    the torch.distributed composition gives them."""
    assert ranks(2, _edges, timeout=60) == [1, 1]


# --------------------------------------------------------------------------------- faults (row 39)
def _mismatches() -> list:
    rank = dist.get_rank()
    seen = []

    def expect(case: str, fn) -> None:
        try:
            fn()
        except CollectiveMismatchError as exc:
            seen.append((case, "CollectiveMismatchError", case.split(":")[0] in str(exc)))
        else:
            seen.append((case, "returned", False))
        # The group is still usable: a call whose ranks agree gives the composition's result.
        a = _rand((2, 4), torch.float32, 7 + rank)
        b = _rand((4, 3), torch.float32, 8 + rank)
        (out,) = all_gather_matmul(a, [b], timeout=T)
        parts = [torch.empty(2, 4) for _ in range(2)]
        dist.all_gather(parts, a)
        torch.testing.assert_close(out, torch.cat(parts) @ b)

    b5 = torch.randn(5, 2)
    expect("all_gather_matmul: leading size", lambda: all_gather_matmul(torch.randn(3 + rank, 5), [b5], timeout=T))
    expect("all_gather_matmul: same numel, other shape",
           lambda: all_gather_matmul(torch.randn((2, 6, 5) if rank else (6, 2, 5)), [b5], timeout=T))
    expect("all_gather_matmul: gather_dim", lambda: all_gather_matmul(torch.randn(2, 2, 5), [b5], gather_dim=rank,
                                                                      timeout=T))
    expect("all_gather_matmul: dtype", lambda: all_gather_matmul(
        torch.randn(2, 5, dtype=torch.bfloat16 if rank else torch.float32),
        [b5.to(torch.bfloat16 if rank else torch.float32)], timeout=T))
    expect("matmul_reduce_scatter: product width", lambda: matmul_reduce_scatter(
        torch.randn(4, 3), torch.randn(3, 2 + rank), timeout=T))
    expect("matmul_reduce_scatter: scatter_dim", lambda: matmul_reduce_scatter(
        torch.randn(2, 2, 3), torch.randn(3, 2), scatter_dim=rank, timeout=T))
    expect("matmul_all_reduce: rows", lambda: matmul_all_reduce(torch.randn(3 + rank, 4), torch.randn(4, 2), timeout=T))
    # Whether the backward's ring will run: a rank without it would leave the other in that ring.
    expect("all_gather_matmul: requires_grad", lambda: all_gather_matmul(
        torch.randn(2, 5, requires_grad=bool(rank)), [b5], timeout=T))
    expect("matmul_reduce_scatter: requires_grad", lambda: matmul_reduce_scatter(
        torch.randn(4, 3), torch.randn(3, 2, requires_grad=bool(rank)), timeout=T))
    # Wrong in itself on every rank: a ValueError at the call, naming the dim and the group size.
    try:
        matmul_reduce_scatter(torch.randn(3, 4, 5), torch.randn(5, 2), scatter_dim=0, timeout=T)
        seen.append(("indivisible", "returned", ""))
    except ValueError as exc:
        seen.append(("indivisible", "ValueError", str(exc)))
    return seen


def test_shapes_that_differ_across_the_group_fail_on_every_rank(ranks):
    """docs/faults.md row 39: shapes (or dtype, or the gather/scatter dim, or whether the backward's
    ring runs: requires_grad) that differ across the TP group raise CollectiveMismatchError on every
    rank, naming the function, before any result; the group stays usable; a scatter dim not
    divisible by the group size is a ValueError at the call."""
    for seen in ranks(2, _mismatches, timeout=60):
        *cases, (_, kind, msg) = seen
        assert len(cases) == 9, cases
        for case, error, named in cases:
            assert error == "CollectiveMismatchError" and named, (case, error)
        assert kind == "ValueError", kind
        assert "matmul_reduce_scatter" in msg and "scatter_dim 0" in msg and "size 3" in msg and "group size 2" in msg


def _never_enters() -> dict:
    rank = dist.get_rank()
    sub = dist.new_group([0, 1], timeout=timedelta(seconds=T))
    dist.barrier()
    seen: dict = {}
    # (1) Both ranks run the forward; rank 1 never enters the backward's ring.
    a = torch.randn(2, 3, 4, requires_grad=True)
    (out,) = all_gather_matmul(a, [torch.randn(4, 5)], timeout=ABSENT)
    if rank == 1:
        return seen  # and never enters (2) either
    start = time.monotonic()
    try:
        out.sum().backward()
        seen["backward"] = "completed"
    except CommTimeoutError as exc:
        seen["backward"] = (time.monotonic() - start, str(exc))
    # (2) Rank 1 never enters the call at all (on a group of its own: (1) left WORLD out of step).
    start = time.monotonic()
    try:
        matmul_reduce_scatter(torch.randn(4, 3), torch.randn(3, 2), group=sub, timeout=ABSENT)
        seen["forward"] = "completed"
    except CommTimeoutError as exc:
        seen["forward"] = (time.monotonic() - start, str(exc))
    return seen


def test_rank_that_never_enters_times_out():
    """docs/faults.md row 39: a rank that never enters the decomposed matmul (its forward, or the
    ring of its backward) -> CommTimeoutError on the others within the timeout plus slack, naming
    the function. A pool of its own: the abandoned calls leave the groups out of step."""
    pool = RankPool(2)
    try:
        res = pool.run(_never_enters, timeout=2 * ABSENT + SLACK + 30)
    finally:
        pool.close(graceful=False)
    assert res[1] == {}
    for case, name in (("backward", "all_gather_matmul"), ("forward", "matmul_reduce_scatter")):
        got = res[0][case]
        assert got != "completed", case
        elapsed, msg = got
        assert ABSENT - 0.5 <= elapsed <= ABSENT + SLACK, (case, elapsed)
        assert msg.startswith("CommTimeoutError") and name in msg, msg


def test_bad_arguments_are_errors_at_the_call():
    """docs/faults.md row 39: bad arguments raise TypeError / ValueError at the call (in-process, no
    process group: nothing could be sent), naming the function and what was wrong; a world of one is
    a plain matmul with plain gradients."""
    a, b = torch.randn(2, 3, 4), torch.randn(4, 5)
    cases = [
        (TypeError, "all_gather_matmul: a_shard must be a torch.Tensor", lambda: all_gather_matmul([[1.0]], [b])),
        (TypeError, "list of 2-D tensors", lambda: all_gather_matmul(a, b)),
        (ValueError, "bs is empty", lambda: all_gather_matmul(a, [])),
        (TypeError, "bs[1] must be a torch.Tensor", lambda: all_gather_matmul(a, [b, "w"])),
        (ValueError, "bs[0] has shape [4, 5, 1]; it must be 2-D", lambda: all_gather_matmul(a, [b[..., None]])),
        (ValueError, "first dimension of bs[0] must equal the last", lambda: all_gather_matmul(a, [torch.randn(3, 5)])),
        (ValueError, "gather_dim=3 is out of range", lambda: all_gather_matmul(a, [b], gather_dim=3)),
        (ValueError, "gather_dim=-4 is out of range", lambda: all_gather_matmul(a, [b], gather_dim=-4)),
        (ValueError, "gather_dim=-1 is the last dimension", lambda: all_gather_matmul(a, [b], gather_dim=-1)),
        (ValueError, "gather_dim=2 is the last dimension", lambda: all_gather_matmul(a, [b], gather_dim=2)),
        (TypeError, "gather_dim must be an int", lambda: all_gather_matmul(a, [b], gather_dim=0.0)),
        (ValueError, "a_shard has shape [4]; it needs at least 2 dimensions",
         lambda: all_gather_matmul(torch.randn(4), [b])),
        (TypeError, "a_shard has dtype torch.int64", lambda: all_gather_matmul(a.long(), [b.long()])),
        (TypeError, "bs[0] has dtype torch.float64 but a_shard has torch.float32",
         lambda: all_gather_matmul(a, [b.double()])),
        (ValueError, "timeout must be a positive number", lambda: all_gather_matmul(a, [b], timeout=-1)),
        (TypeError, "group must be a torch.distributed ProcessGroup", lambda: all_gather_matmul(a, [b], group="tp")),
        (TypeError, "matmul_reduce_scatter: b must be a torch.Tensor", lambda: matmul_reduce_scatter(a, None)),
        (ValueError, "scatter_dim=5 is out of range", lambda: matmul_reduce_scatter(a, b, scatter_dim=5)),
        (ValueError, "scatter_dim=-1 is the last dimension", lambda: matmul_reduce_scatter(a, b, scatter_dim=-1)),
        (ValueError, "op must be ReduceOp.SUM or ReduceOp.AVG", lambda: matmul_reduce_scatter(a, b, op=ReduceOp.MAX)),
        (ValueError, "b has shape [5, 4] but a has shape [2, 3, 4]", lambda: matmul_reduce_scatter(a, b.t())),
        (ValueError, "matmul_all_reduce: b has shape [4]; it must be 2-D", lambda: matmul_all_reduce(a, b[:, 0])),
        (TypeError, "matmul_all_reduce: a must be a torch.Tensor", lambda: matmul_all_reduce(3.0, b)),
    ]
    for error, text, call in cases:
        with pytest.raises(error) as info:
            call()
        assert text in str(info.value), (text, str(info.value))
        assert any(f in str(info.value) for f in ("all_gather_matmul", "matmul_reduce_scatter", "matmul_all_reduce"))

    # A world of one: the plain matmul, forward and backward.
    x = torch.randn(2, 3, 4, requires_grad=True)
    ws = [torch.randn(4, 5, requires_grad=True), torch.randn(4, 2, requires_grad=True)]
    gathered, outs = all_gather_matmul(x, ws, gather_dim=1, return_a=True)
    assert gathered is x
    y = matmul_reduce_scatter(x, ws[0], scatter_dim=1, op=ReduceOp.AVG)
    z = matmul_all_reduce(x, ws[1])
    (outs[0].sum() + 2 * outs[1].sum() + 3 * y.sum() + 4 * z.sum()).backward()
    x2, w2 = x.detach().requires_grad_(), [w.detach().requires_grad_() for w in ws]
    (4 * (x2 @ w2[0]).sum() + 6 * (x2 @ w2[1]).sum()).backward()
    # assert_close's fp32 tolerances, without its first-use import of torch.distributed.tensor (seconds
    # of CPU in this process; the ranks have it preloaded).
    for got, ref in ((outs[0], x2 @ w2[0]), (outs[1], x2 @ w2[1]), (y, x2 @ w2[0]), (z, x2 @ w2[1]),
                     (x.grad, x2.grad), (ws[0].grad, w2[0].grad), (ws[1].grad, w2[1].grad)):
        assert got.shape == ref.shape and torch.allclose(got, ref, rtol=1.3e-6, atol=1e-5)


# --------------------------------------------------------------------------------- drop-in styles (item 2)
# The oracle is torch's own ColwiseParallel / RowwiseParallel / SequenceParallel on the same module
# from the same seeded weights: outputs, parameters (the same DTensors, the same placements) and
# every parameter's gradient, fp32 with assert_close's default tolerances. The engine's byte
# counters show the decomposed rings ran where they should (and nowhere under torch's plan).
class _RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


class _Attention(nn.Module):
    """Causal attention whose head count follows wq's (local) width: the same code serves the
    unsharded module and any TP size that divides the heads. Biased projections (as Qwen's QKV)."""

    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.head_dim = dim // heads
        self.wq, self.wk, self.wv, self.wo = (nn.Linear(dim, dim, bias=True) for _ in range(4))

    def forward(self, x):
        b, s = x.shape[0], x.shape[1]

        def heads(t):
            return t.view(b, s, -1, self.head_dim).transpose(1, 2)

        o = F.scaled_dot_product_attention(heads(self.wq(x)), heads(self.wk(x)), heads(self.wv(x)), is_causal=True)
        return self.wo(o.transpose(1, 2).reshape(b, s, -1))


class _FeedForward(nn.Module):
    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.w1, self.w3 = nn.Linear(dim, hidden, bias=False), nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class _Pair(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.a, self.b = nn.Linear(dim, 12), nn.Linear(dim, 12, bias=False)

    def forward(self, x):
        return self.a(x) * self.b(x)


class _Block(nn.Module):
    """A Llama-style block, names as in torch's tensor-parallel tutorial."""

    def __init__(self, dim: int = 24, heads: int = 12, hidden: int = 48):
        super().__init__()
        self.attention_norm, self.ffn_norm = _RMSNorm(dim), _RMSNorm(dim)
        self.attention = _Attention(dim, heads)
        self.feed_forward = _FeedForward(dim, hidden)

    def forward(self, x):
        h = x + self.attention(self.attention_norm(x))
        return h + self.feed_forward(self.ffn_norm(h))


def _llama_plan(col, row, seq, fused: bool) -> dict:
    """The block's plan of torch's TP tutorial, with the given styles; ``fused``: no
    PrepareModuleInput, the Colwise modules take the norms' Shard(1) output themselves."""
    plan = {"attention_norm": seq(), "ffn_norm": seq(),
            "attention.wo": row(output_layouts=Shard(1)), "feed_forward.w2": row(output_layouts=Shard(1))}
    for name in ("attention.wq", "attention.wk", "attention.wv", "feed_forward.w1", "feed_forward.w3"):
        plan[name] = col(input_layouts=Shard(1)) if fused else col()
    if not fused:
        for name in ("attention", "feed_forward"):
            plan[name] = PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),))
    return plan


_TORCH = (TorchColwise, TorchRowwise, TorchSequence)


# commopt's styles with the ring forced: these tests check the rings against torch's styles (the choice
# between them, algorithm="auto", is tested on its own).
_RING_STYLES = (partial(ColwiseParallel, algorithm="ring"), partial(RowwiseParallel, algorithm="ring"),
                SequenceParallel)


def _ring_bytes() -> dict[str, int]:
    sent = context().engine().bytes_sent()
    return {op: sent.get(op, 0) for op in ("all_gather_matmul", "all_gather_matmul/backward", "matmul_reduce_scatter",
                                           "matmul_reduce_scatter/backward", "matmul_all_reduce")}


def _run_styled(make, plan, mesh, x: torch.Tensor, g: torch.Tensor | int, replicated: bool = False):
    """Parallelize a fresh seeded module with ``plan``, run forward + backward (``g``, or a random
    gradient of the local output's shape seeded with ``g``, and with the rank unless the output is
    ``replicated``); return the module, its output, the input's gradient and the ring bytes the run
    sent through commopt."""
    torch.manual_seed(1234)
    model = parallelize_module(make(), mesh, plan)
    before = _ring_bytes()
    x = x.detach().clone().requires_grad_()
    out = model(x)
    local = out.to_local() if isinstance(out, DTensor) else out
    seed = 0 if isinstance(g, torch.Tensor) else 1000 * g + (0 if replicated else dist.get_rank())
    local.backward(g if isinstance(g, torch.Tensor) else _rand(local.shape, torch.float32, seed))
    after = _ring_bytes()
    return model, out, x.grad, {op: after[op] - before[op] for op in after}


def _eq(got: torch.Tensor, ref: torch.Tensor, what: str) -> None:
    torch.testing.assert_close(got, ref, msg=lambda m: f"{what}: {m}")


def _same_module(got: nn.Module, ref: nn.Module, what: str) -> int:
    """The same parameter names, DTensor placements and values, and the same gradients."""
    got_p, ref_p = dict(got.named_parameters()), dict(ref.named_parameters())
    assert got_p.keys() == ref_p.keys(), what
    for name, p in got_p.items():
        r = ref_p[name]
        assert isinstance(p, DTensor) and isinstance(r, DTensor), (what, name)
        assert p.placements == r.placements and p.shape == r.shape, (what, name, p.placements, r.placements)
        torch.testing.assert_close(p.to_local(), r.to_local(), rtol=0, atol=0)
        assert (p.grad is None) == (r.grad is None), (what, name)
        assert p.grad.placements == r.grad.placements, (what, name, p.grad.placements, r.grad.placements)
        _eq(p.grad.to_local(), r.grad.to_local(), f"{what} {name}.grad")
    assert got.state_dict().keys() == ref.state_dict().keys(), what
    return len(got_p)


def _styles_matrix(tp: int) -> list[str]:
    """Each case parallelized with torch's styles and with commopt's, the same plan otherwise, on a
    TP mesh of ``tp`` ranks."""
    if tp == dist.get_world_size():
        mesh = init_device_mesh("cpu", (tp,))
    else:  # TP groups of a 2-D mesh, not WORLD (each runs the matrix on its own)
        mesh = init_device_mesh("cpu", (dist.get_world_size() // tp, tp), mesh_dim_names=("dp", "tp"))["tp"]
    try:
        return _styles_cases(mesh)
    finally:
        if mesh.get_group() is not dist.group.WORLD:
            context().engine().release(mesh.get_group())


def _styles_cases(mesh) -> list[str]:
    world, me = mesh.size(), mesh.get_local_rank()
    ours, theirs = _RING_STYLES, _TORCH
    done = []
    batch, seq, dim = 2, 2 * world, 24
    x_full = _rand((batch, seq, dim), torch.float32, 300)
    x_local = x_full.chunk(world, dim=1)[me]
    g_local = _rand((batch, seq, dim), torch.float32, 301).chunk(world, dim=1)[me]
    x_bytes = x_local.numel() * 4

    # (1) The Llama block: the tutorial's plan (PrepareModuleInput) and the fused one, each against
    # torch's styles in the same plan and, for the fused one, against torch's tutorial plan too.
    ref = {fused: _run_styled(_Block, _llama_plan(*theirs, fused), mesh, x_local, g_local) for fused in (False, True)}
    for fused in (False, True):
        assert not any(ref[fused][3].values()), ref[fused][3]  # torch's plan sends nothing through commopt
        model, out, x_grad, sent = _run_styled(_Block, _llama_plan(*ours, fused), mesh, x_local, g_local)
        for oracle in (ref[fused], ref[False]):
            what = f"llama block (fused={fused}) at TP {world}"
            _eq(out, oracle[1], f"{what} output")
            _eq(x_grad, oracle[2], f"{what} input grad")
            _same_module(model, oracle[0], what)
        # One ring per matmul that is adjacent to a collective: wo and w2 reduce-scatter; in the
        # fused plan wq/wk/wv gather their input once, w1/w3 once (each ring moves (P-1)/P).
        rs = 2 * (world - 1) * x_bytes
        assert sent["matmul_reduce_scatter"] == rs and sent["matmul_reduce_scatter/backward"] == rs, sent
        ag = 2 * (world - 1) * x_bytes if fused else 0
        assert sent["all_gather_matmul"] == ag and sent["all_gather_matmul/backward"] == ag, sent
        assert sent["matmul_all_reduce"] == 0, sent
        done.append(f"llama fused={fused}")

    # (2) TP without sequence parallelism: a biased MLP on a replicated input, Rowwise's default
    # Replicate output (matmul_all_reduce, the bias added once after it), DTensor outputs.
    def mlp():
        return nn.Sequential(nn.Linear(dim, 36), nn.GELU(), nn.Linear(36, dim))

    for local_out in (True, False):
        def plan(col, row, seq, local_out=local_out):
            return {"0": col(), "2": row(use_local_output=local_out)}

        xr = _rand((batch, 3, dim), torch.float32, 302)  # replicated: the same on every rank
        gr = _rand((batch, 3, dim), torch.float32, 303)
        r_model, r_out, r_grad, _ = _run_styled(mlp, plan(*theirs), mesh, xr, gr)
        model, out, x_grad, sent = _run_styled(mlp, plan(*ours), mesh, xr, gr)
        what = f"mlp use_local_output={local_out} at TP {world}"
        assert isinstance(out, DTensor) == isinstance(r_out, DTensor), what
        if isinstance(out, DTensor):
            assert out.placements == r_out.placements and out.shape == r_out.shape, (what, out.placements)
            out, r_out = out.to_local(), r_out.to_local()
        _eq(out, r_out, f"{what} output")
        _eq(x_grad, r_grad, f"{what} input grad")
        _same_module(model, r_model, what)
        assert sent["matmul_all_reduce"] > 0 and sent["all_gather_matmul"] == 0, sent
        done.append(what)

    # (3) A fused Colwise whose output is laid out otherwise (the tutorial's output projection:
    # Shard(1) in, Replicate out), a DTensor output sharded on its last dimension (loss_parallel's)
    # of a width that does not divide by P, and an MLP whose Rowwise scatters the batch (Shard(0)).
    cases = (("head, replicate out", lambda: nn.Linear(dim, 30),
              lambda col, row, seq: col(input_layouts=Shard(1), output_layouts=Replicate()), x_local),
             ("head, uneven DTensor out", lambda: nn.Linear(dim, 2 * world + 1),
              lambda col, row, seq: col(input_layouts=Shard(1), use_local_output=False), x_local),
             ("mlp, Shard(0) out", mlp, lambda col, row, seq: {"0": col(), "2": row(output_layouts=Shard(0))},
              _rand((world, 3, dim), torch.float32, 305)))
    for what, make, plan, x in cases:
        what = f"{what} at TP {world}"
        rep = "replicate out" in what
        r_model, r_out, r_grad, _ = _run_styled(make, plan(*theirs), mesh, x, 306, rep)
        model, out, x_grad, sent = _run_styled(make, plan(*ours), mesh, x, 306, rep)
        assert isinstance(out, DTensor) == isinstance(r_out, DTensor), what
        if isinstance(out, DTensor):
            assert out.placements == r_out.placements and out.shape == r_out.shape, (what, out.placements, out.shape)
            out, r_out = out.to_local(), r_out.to_local()
        _eq(out, r_out, f"{what} output")
        _eq(x_grad, r_grad, f"{what} input grad")
        _same_module(model, r_model, what)
        assert sent["all_gather_matmul" if "head" in what else "matmul_reduce_scatter"] > 0, (what, sent)
        done.append(what)

    # A DTensor input whose sequence does not divide by P: torch's own path (uneven shards), no ring.
    xu = distribute_tensor(_rand((batch, world + 1, dim), torch.float32, 310), mesh, [Shard(1)])
    outs = []
    for styles in (theirs, ours):
        torch.manual_seed(1234)
        lin = parallelize_module(nn.Linear(dim, 12), mesh, styles[0](input_layouts=Shard(1)))
        before = _ring_bytes()
        outs.append((lin, lin(xu), _ring_bytes() == before))
        outs[-1][1].sum().backward()
    _eq(outs[1][1], outs[0][1], f"uneven DTensor input at TP {world} output")
    _same_module(outs[1][0], outs[0][0], f"uneven DTensor input at TP {world}")
    assert outs[1][2], "an uneven DTensor input went through the ring"
    done.append("uneven DTensor input")

    # (4) Two fused Colwise modules handed the same leaf input, over two steps with the same input
    # (the gathered input is shared within a step, gathered again after a backward).
    outs = []
    for styles in (theirs, ours):
        torch.manual_seed(1234)
        pair = parallelize_module(_Pair(dim), mesh, {"a": styles[0](input_layouts=Shard(1)),
                                                     "b": styles[0](input_layouts=Shard(1))})
        x = x_local.detach().clone().requires_grad_()
        before = _ring_bytes()["all_gather_matmul"]
        for step in range(2):
            y = pair(x)
            y.backward(_rand(y.shape, torch.float32, 309 + step + 10 * me))
        outs.append((pair, y, x.grad, _ring_bytes()["all_gather_matmul"] - before))
    what = f"two Colwise on one input, two steps, at TP {world}"
    _eq(outs[1][1], outs[0][1], f"{what} output")
    _eq(outs[1][2], outs[0][2], f"{what} input grad")
    _same_module(outs[1][0], outs[0][0], what)
    assert outs[0][3] == 0 and outs[1][3] == 2 * (world - 1) * x_bytes, (what, outs[1][3])
    done.append(what)

    # (5) nn.Embedding is torch's style unchanged (the tutorial's token embedding, and Colwise).
    ids = torch.randint(0, 16, (batch, seq), generator=torch.Generator().manual_seed(307))
    for what, plan in (("embedding rowwise", lambda col, row, seq: row(input_layouts=Replicate(),
                                                                      output_layouts=Shard(1))),
                       ("embedding colwise", lambda col, row, seq: col())):
        outs = []
        for styles in (theirs, ours):
            torch.manual_seed(1234)
            emb = parallelize_module(nn.Embedding(16, dim), mesh, plan(*styles))
            out = emb(ids)
            out.backward(_rand(out.shape, torch.float32, 308 + me))
            outs.append((emb, out))
        _eq(outs[1][1], outs[0][1], f"{what} output")
        _same_module(outs[1][0], outs[0][0], what)
        done.append(what)
    return done


@pytest.mark.parametrize("tp", [2, 4])
def test_styles_match_torch_styles(ranks, tp):
    """docs/faults.md row 39 (exactness): commopt's ColwiseParallel / RowwiseParallel /
    SequenceParallel in torch's plans -- the Llama block of torch's TP tutorial with its
    PrepareModuleInput, the fused form (Colwise taking Shard(1)), TP without SP (Replicate out,
    biases), an output projection, uneven and DTensor outputs, a batch scatter, two modules sharing
    one gathered input over two steps, nn.Embedding -- give
    torch's styles' outputs, input gradients, parameters (the same DTensors) and parameter gradients,
    the rings running where a collective is adjacent to a matmul. TP 4 on WORLD, TP 2 on the two TP
    groups of a 2 x 2 mesh; both in the 4-rank pool (its ranks pay DTensor's first use once)."""
    done = ranks(4, _styles_matrix, tp, timeout=120)
    assert done == [done[0]] * 4 and len(done[0]) == 11, done


class _Stack(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList([_Block(), _Block()])

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x


def _two_d(steps: int) -> list[str]:
    """TP 2 x FSDP2 2 on 4 ranks: two blocks, each parallelized on mesh["tp"] then fully_shard-ed on
    mesh["dp"] (torch's 2-D recipe), ``steps`` SGD steps with momentum on batches that differ per
    data-parallel rank; torch's styles against commopt's in the tutorial's plan and the fused one."""
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    tp, dp = mesh["tp"], mesh["dp"]
    dp_rank, tp_rank = dp.get_local_rank(), tp.get_local_rank()
    ours = _RING_STYLES
    runs = {}
    try:
        for name, styles, fused in (("torch", _TORCH, False), ("commopt", ours, False), ("commopt fused", ours, True)):
            torch.manual_seed(1234)
            model = _Stack()
            for layer in model.layers:
                parallelize_module(layer, tp, _llama_plan(*styles, fused))
                fully_shard(layer, mesh=dp)
            fully_shard(model, mesh=dp)
            opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
            before = _ring_bytes()
            for step in range(steps):
                x = _rand((2, 4, 24), torch.float32, 700 + 10 * step + dp_rank).chunk(2, dim=1)[tp_rank]
                model(x).square().mean().backward()
                opt.step()
                opt.zero_grad()
            sent = sum(_ring_bytes().values()) - sum(before.values())
            assert (sent > 0) == name.startswith("commopt"), (name, sent)
            runs[name] = {k: v for k, v in model.named_parameters()}
        done = []
        for name in ("commopt", "commopt fused"):
            assert runs[name].keys() == runs["torch"].keys(), name
            for k, p in runs[name].items():
                r = runs["torch"][k]
                assert p.device_mesh.ndim == 2 and p.placements == r.placements, (name, k, p.placements, r.placements)
                _eq(p.to_local(), r.to_local(), f"{name} {k} after {steps} steps")
            done.append(name)
        return done
    finally:
        context().engine().release(tp.get_group())


def test_styles_compose_with_fsdp2_on_a_2d_mesh(ranks):
    """TP 2 x FSDP2 2 on 4 ranks, 5 optimizer steps: commopt's styles (the tutorial's plan and the
    fused one) leave every parameter -- 2-D DTensors, the same placements -- equal to torch's 2-D
    composition with its own styles; commopt's rings ran beside FSDP2's collectives."""
    done = ranks(4, _two_d, 5, timeout=120)
    assert done == [["commopt", "commopt fused"]] * 4, done


def _bad_arguments() -> list[str]:
    mesh2d = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    mesh = mesh2d["tp"]
    seen = []
    before = _ring_bytes()
    cases = [
        (["ColwiseParallel: device_mesh has 2 dimensions named ('dp', 'tp')", "mesh['tp']"],
         lambda: ColwiseParallel()._apply(nn.Linear(4, 4), mesh2d)),
        (["RowwiseParallel: device_mesh has 2 dimensions", "mesh['tp']"],
         lambda: parallelize_module(nn.Linear(4, 4), mesh2d, RowwiseParallel())),
        (["SequenceParallel: device_mesh has 2 dimensions", "mesh['tp']"],
         lambda: parallelize_module(nn.LayerNorm(4), mesh2d, SequenceParallel())),
        (["ColwiseParallel: device_mesh must be a torch.distributed DeviceMesh, got NoneType"],
         lambda: ColwiseParallel()._apply(nn.Linear(4, 4), None)),
        (["ColwiseParallel: module Conv1d is neither torch.nn.Linear nor torch.nn.Embedding", "Linear submodules"],
         lambda: parallelize_module(nn.Conv1d(4, 4, 1), mesh, ColwiseParallel())),
        (["RowwiseParallel: module LayerNorm is neither"],
         lambda: parallelize_module(nn.Sequential(nn.LayerNorm(4)), mesh, {"0": RowwiseParallel()})),
    ]
    for texts, call in cases:
        try:
            call()
            seen.append(f"no error: {texts[0]}")
        except ValueError as exc:
            seen.append("ok" if all(t in str(exc) for t in texts) else f"wrong message for {texts}: {exc}")
    # A mesh where the functions take a group: a TypeError that names its process group.
    try:
        all_gather_matmul(torch.randn(2, 4), [torch.randn(4, 3)], group=mesh)
        seen.append("no error: a DeviceMesh as group")
    except TypeError as exc:
        seen.append("ok" if "all_gather_matmul" in str(exc) and "mesh.get_group()" in str(exc) else f"{exc}")
    assert _ring_bytes() == before
    context().engine().release(mesh.get_group())
    return seen


def test_bad_style_arguments_are_value_errors(ranks):
    """docs/faults.md row 39: a 2-D mesh handed to a style (directly or through parallelize_module),
    no mesh, a module that is neither Linear nor Embedding -> ValueError at parallelize_module,
    naming the style and what to pass, before any parameter is distributed; a DeviceMesh passed to a
    function as its group -> TypeError naming mesh.get_group()."""
    for seen in ranks(4, _bad_arguments, timeout=60):
        assert seen == ["ok"] * 7, seen
