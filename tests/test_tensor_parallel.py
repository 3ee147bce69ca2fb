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

import pytest
import torch
import torch.distributed as dist
from _pool import RankPool
from torch.distributed import ReduceOp

from commopt.comm import context
from commopt.comm.errors import CollectiveMismatchError, CommTimeoutError
from commopt.schedules import all_gather_matmul, matmul_all_reduce, matmul_reduce_scatter

T = 60.0  # the calls' timeout where nothing is meant to time out
ABSENT = 2.0  # the timeout of a call a peer never enters (row 39)
SLACK = 10.0  # room for a cold process on 2 busy cores (docs/faults.md)


def _rand(shape, dtype: torch.dtype, seed: int, scale: float = 1.0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(shape, generator=g, dtype=torch.float64) * scale).to(dtype)


def _oracle_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float32 if dtype == torch.float32 else torch.float64


def _close(got: torch.Tensor | None, ref: torch.Tensor | None, dtype: torch.dtype, world: int, what: str) -> None:
    assert (got is None) == (ref is None), f"{what}: got {got is None and 'no' or 'a'} gradient"
    if got is None:
        return
    assert got.dtype == dtype and got.shape == ref.shape, f"{what}: {got.dtype} {list(got.shape)} vs {list(ref.shape)}"
    if dtype == torch.float32:
        torch.testing.assert_close(got, ref, msg=lambda m: f"{what}: {m}")
        return
    # bf16: the partial products are rounded once each and the ring sums them in bf16 (world - 1
    # roundings), then the result is rounded: about world + 1 roundings of eps/2 of the magnitude.
    eps = torch.finfo(dtype).eps
    mag = max(1.0, ref.abs().max().item())
    torch.testing.assert_close(got.to(torch.float64), ref.to(torch.float64), rtol=2 * eps,
                               atol=(world + 2) * eps * mag, msg=lambda m: f"{what}: {m}")


def _bytes(op: str) -> int:
    return context().engine().bytes_sent().get(op, 0)


# --------------------------------------------------------------------------------- the cases
def _case_all_gather_matmul(seed: int, dtype: torch.dtype, shard_shape: tuple, dim: int, widths: list[int],
                            return_a: bool, skip_last: bool, group, timeout) -> None:
    """``all_gather_matmul`` against ``dist.all_gather`` + ``torch.matmul``; gradients against local
    autograd on the gathered A, reduce-scattered with ``dist.all_reduce`` (SUM) and a slice."""
    world, me = dist.get_world_size(group), dist.get_rank(group)
    what = f"all_gather_matmul[{dtype}, {shard_shape}, dim={dim}, widths={widths}, return_a={return_a}]"
    k = shard_shape[-1]
    a = _rand(shard_shape, dtype, seed * 100 + me).requires_grad_()
    bs = [_rand((k, n), dtype, seed * 100 + 50 + 10 * i + me, 1 / math.sqrt(k)).requires_grad_()
          for i, n in enumerate(widths)]
    before, before_bw = _bytes("all_gather_matmul"), _bytes("all_gather_matmul/backward")
    res = all_gather_matmul(a, bs, gather_dim=dim, group=group, return_a=return_a, timeout=timeout)
    gathered, outs = res if return_a else (None, res)
    assert isinstance(outs, list) and len(outs) == len(bs), what
    sent = _bytes("all_gather_matmul") - before
    assert sent == (world - 1) * a.numel() * a.element_size(), f"{what}: {sent} bytes sent"
    used = outs[:-1] if skip_last else outs
    grads = [_rand(o.shape, dtype, seed * 100 + 80 + 10 * i + me) for i, o in enumerate(used)]
    g_gathered = _rand(gathered.shape, dtype, seed * 100 + 99 + me) if return_a else None
    torch.autograd.backward(used + ([gathered] if return_a else []), grads + ([g_gathered] if return_a else []))
    sent = _bytes("all_gather_matmul/backward") - before_bw
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
        _close(o, r.detach(), dtype, world, f"{what} output {i}")
    if return_a:
        _close(gathered, full.detach(), dtype, world, f"{what} gathered A")
    _close(a.grad, ref_grad_a, dtype, world, f"{what} a.grad")
    for i, (b, bo) in enumerate(zip(bs, bs_o)):
        _close(b.grad, bo.grad, dtype, world, f"{what} bs[{i}].grad")


def _case_matmul_reduce_scatter(seed: int, dtype: torch.dtype, lead: tuple, k: int, n: int, dim: int, op,
                                group, timeout) -> None:
    """``matmul_reduce_scatter`` against ``dist.all_reduce`` of ``a @ b`` and a slice; gradients
    against local autograd on ``a @ b`` fed the ``dist.all_gather``-ed gradient. The contraction size
    differs between ranks (``k + rank``), as a row-parallel shard of an uneven weight does."""
    world, me = dist.get_world_size(group), dist.get_rank(group)
    what = f"matmul_reduce_scatter[{dtype}, lead={lead}, dim={dim}, op={op}]"
    kr = k + me
    a = _rand(lead + (kr,), dtype, seed * 100 + me).requires_grad_()
    b = _rand((kr, n), dtype, seed * 100 + 50 + me, 1 / math.sqrt(kr)).requires_grad_()
    before, before_bw = _bytes("matmul_reduce_scatter"), _bytes("matmul_reduce_scatter/backward")
    out = matmul_reduce_scatter(a, b, scatter_dim=dim, group=group, op=op, timeout=timeout)
    assert _bytes("matmul_reduce_scatter") - before == (world - 1) * out.numel() * out.element_size(), what
    g = _rand(out.shape, dtype, seed * 100 + 80 + me)
    out.backward(g)
    assert _bytes("matmul_reduce_scatter/backward") - before_bw == (world - 1) * g.numel() * g.element_size(), what

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
    _close(out, ref, dtype, world, f"{what} output")
    _close(a.grad, a_o.grad, dtype, world, f"{what} a.grad")
    _close(b.grad, b_o.grad, dtype, world, f"{what} b.grad")


def _case_matmul_all_reduce(seed: int, dtype: torch.dtype, lead: tuple, k: int, n: int, group, timeout) -> None:
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
    out = matmul_all_reduce(a, b, group=group, timeout=timeout)
    g = _rand(out.shape, dtype, seed * 100 + 99)  # the same on every rank: the output is replicated
    out.backward(g)

    odt = _oracle_dtype(dtype)
    a_o, b_o = a.detach().to(odt).requires_grad_(), b.detach().to(odt).requires_grad_()
    p = a_o @ b_o
    total = p.detach().clone()
    dist.all_reduce(total, group=group)
    p.backward(g.to(odt))
    _close(out, total, dtype, world, f"{what} output")
    _close(a.grad, a_o.grad, dtype, world, f"{what} a.grad")
    _close(b.grad, b_o.grad, dtype, world, f"{what} b.grad")

    # The unsharded computation (no communication at all): the semantics, not only the composition.
    every = [inputs(r) for r in range(world)]
    big_a = torch.cat([x.to(odt) for x, _ in every], dim=-1).requires_grad_()
    big_b = torch.cat([y.to(odt) for _, y in every], dim=0).requires_grad_()
    whole = big_a @ big_b
    whole.backward(g.to(odt))
    lo = sum(k + r for r in range(me))
    _close(out, whole.detach(), dtype, world, f"{what} output against the unsharded matmul")
    _close(a.grad, big_a.grad.narrow(-1, lo, k + me), dtype, world, f"{what} a.grad against the unsharded matmul")
    _close(b.grad, big_b.grad.narrow(0, lo, k + me), dtype, world, f"{what} b.grad against the unsharded matmul")


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
    if groups:
        tp = [dist.new_group(members, timeout=timedelta(seconds=T)) for members in ([0, 1], [2, 3])]
        mine = tp[dist.get_rank() // 2]
        try:
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
    scatter dims 0 and 1, several Bs, return_a, uneven weight shards; at 4 ranks also on TP subgroups."""
    counts = ranks(world, _matrix, world == 4, timeout=120)
    assert counts == [counts[0]] * world and counts[0] == 16 + 3 * (world == 4)


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
    # Wrong in itself on every rank: a ValueError at the call, naming the dim and the group size.
    try:
        matmul_reduce_scatter(torch.randn(3, 4, 5), torch.randn(5, 2), scatter_dim=0, timeout=T)
        seen.append(("indivisible", "returned", ""))
    except ValueError as exc:
        seen.append(("indivisible", "ValueError", str(exc)))
    return seen


def test_shapes_that_differ_across_the_group_fail_on_every_rank(ranks):
    """docs/faults.md row 39: shapes (or dtype, or the gather/scatter dim) that differ across the TP
    group raise CollectiveMismatchError on every rank, naming the function, before any result; the
    group stays usable; a scatter dim not divisible by the group size is a ValueError at the call."""
    for seen in ranks(2, _mismatches, timeout=60):
        *cases, (_, kind, msg) = seen
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
