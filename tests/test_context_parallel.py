"""Ring and Ulysses attention against attention over the whole sequence (issue 25, item 3).

Oracle: every rank gathers the whole q, k, v and the upstream gradient with plain
``torch.distributed.all_gather``, puts the blocks in sequence order by the test's own index
arithmetic (contiguous: block r at r; zig-zag: rank r's halves at chunks r and 2P - 1 - r), runs
``torch.nn.functional.scaled_dot_product_attention`` and its autograd on the whole sequence, and
takes its own block of the output and of the q/k/v gradients; never a result of the code under test.
fp32 cases against an fp32 oracle with ``assert_close``'s fp32 tolerances, fp64 against fp64 with
fp64's, bf16 against fp64 on the same bf16 inputs with tolerances from bf16's epsilon and the group
size. Each world size runs its whole matrix in one pool call (docs/architecture.md section 9).
docs/faults.md row 39: a rank that never enters, shapes that differ across the group, bad arguments.
"""

from __future__ import annotations

import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from _oracle import close_to, sent_bytes
from _pool import RankPool

from commopt.comm import Topology, context
from commopt.comm.errors import CollectiveMismatchError, CommTimeoutError
from commopt.schedules import ring_attention, ulysses_attention, zigzag_shard, zigzag_unshard
from commopt.schedules import tensor_parallel as tp_module

T = 60.0  # the calls' timeout where nothing is meant to time out
ABSENT = 2.0  # the timeout of a call a peer never enters (row 39)
SLACK = 10.0  # room for a cold process on 2 busy cores (docs/faults.md)


def _rand(shape, dtype: torch.dtype, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=g, dtype=torch.float64).to(dtype)


def _whole(x: torch.Tensor, layout: str, group) -> torch.Tensor:
    """The whole sequence (dim -2) from every rank's block, by plain all_gather and index arithmetic."""
    world = dist.get_world_size(group)
    parts = [torch.empty_like(x) for _ in range(world)]
    dist.all_gather(parts, x.contiguous(), group=group)
    if layout == "contiguous":
        return torch.cat(parts, dim=-2)
    c = x.shape[-2] // 2
    chunks: list = [None] * (2 * world)
    for r, p in enumerate(parts):
        chunks[r], chunks[2 * world - 1 - r] = p[..., :c, :], p[..., c:, :]
    return torch.cat(chunks, dim=-2)


def _mine(full: torch.Tensor, layout: str, group) -> torch.Tensor:
    """This rank's block of the whole sequence ``full`` (dim -2)."""
    world, me = dist.get_world_size(group), dist.get_rank(group)
    if layout == "contiguous":
        s = full.shape[-2] // world
        return full[..., me * s:(me + 1) * s, :]
    c = full.shape[-2] // (2 * world)
    return torch.cat([full[..., me * c:(me + 1) * c, :], full[..., (2 * world - 1 - me) * c:(2 * world - me) * c, :]],
                     dim=-2)


def _case(kind: str, seed: int, dtype: torch.dtype, shape: tuple, dv: int, causal: bool, scale, layout: str,
          group, transposed: bool = False, **kw) -> None:
    """One call of ``ring_attention`` / ``ulysses_attention`` and its backward against the oracle;
    ``transposed``: q, k, v are ``[B, S/P, H, D]`` tensors transposed to ``[B, H, S/P, D]`` (not
    contiguous), as a model's projections give them."""
    world, me = dist.get_world_size(group), dist.get_rank(group)
    what = f"{kind}[{dtype}, {shape}, dv={dv}, causal={causal}, scale={scale}, {layout}, {transposed}, {kw}]"

    def leaf(shape: tuple, seed: int) -> torch.Tensor:
        if not transposed:
            return _rand(shape, dtype, seed).requires_grad_()
        b, h, s, d = shape
        return _rand((b, s, h, d), dtype, seed).transpose(1, 2).requires_grad_()

    q = leaf(shape, seed * 100 + 10 * me)
    k = leaf(shape, seed * 100 + 10 * me + 1)
    v = leaf(shape[:-1] + (dv,), seed * 100 + 10 * me + 2)
    assert q.is_contiguous() != transposed
    fwd, bwd = sent_bytes("ring_attention"), sent_bytes("ring_attention/backward")
    if kind == "ring":
        out = ring_attention(q, k, v, group=group, is_causal=causal, scale=scale, layout=layout, timeout=T, **kw)
    else:
        out = ulysses_attention(q, k, v, group=group, is_causal=causal, scale=scale, timeout=T, **kw)
    assert out.shape == shape[:-1] + (dv,), what
    g = _rand(out.shape, dtype, seed * 100 + 10 * me + 3)
    out.backward(g)
    if kind == "ring":
        kv = (k.numel() + v.numel()) * k.element_size()
        sums = (k.numel() + v.numel()) * (8 if dtype == torch.float64 else 4)
        assert sent_bytes("ring_attention") - fwd == (world - 1) * kv, what
        # keep_kv: the backward moves the gradient sums only (the all-gathered form's reduce-scatter).
        assert sent_bytes("ring_attention/backward") - bwd == (world - 1) * (sums + (0 if kw else kv)), what

    odt = torch.float32 if dtype == torch.float32 else torch.float64
    full_q, full_k, full_v = (_whole(t.detach(), layout, group).to(odt).requires_grad_() for t in (q, k, v))
    ref = F.scaled_dot_product_attention(full_q, full_k, full_v, is_causal=causal, scale=scale)
    ref.backward(_whole(g, layout, group).to(odt))
    close_to(out, _mine(ref.detach(), layout, group), dtype, world, f"{what} output")
    close_to(q.grad, _mine(full_q.grad, layout, group), dtype, world, f"{what} q.grad")
    close_to(k.grad, _mine(full_k.grad, layout, group), dtype, world, f"{what} k.grad")
    close_to(v.grad, _mine(full_v.grad, layout, group), dtype, world, f"{what} v.grad")


def _matrix() -> int:
    """Every case on WORLD; at 4 ranks also the 1x4 and 2x2 topologies for Ulysses and one case of
    each on subgroups of non-adjacent ranks, {0, 2} and {1, 3}."""
    world = dist.get_world_size()
    seed, checked = 0, 0
    # The zig-zag helpers against the test's own index arithmetic.
    whole = _rand((2, 4 * world, 3), torch.float32, 7)
    assert torch.equal(zigzag_shard(whole, 1), _mine(whole, "zigzag", None))
    parts = [torch.empty(2, 4, 3) for _ in range(world)]
    dist.all_gather(parts, zigzag_shard(whole, -2))
    assert torch.equal(zigzag_unshard(torch.cat(parts, dim=1), 1), whole)
    empty = torch.empty(2, 0, 3)  # an empty sequence: empty shards, and back
    assert zigzag_shard(empty, 1).shape == (2, 0, 3) and zigzag_unshard(empty, 1).shape == (2, 0, 3)
    checked += 1
    # ring: [B, H, s, D] fp32 with and without causal, scale default and given, both layouts.
    for causal in (False, True):
        for scale in (None, 0.3):
            for layout in ("contiguous", "zigzag"):
                seed += 1
                _case("ring", seed, torch.float32, (2, 2, 4, 8), 8, causal, scale, layout, None)
                checked += 1
    # fp64 and other ranks of input: 3-D and 2-D; v's head size other than q's (the explicit block path).
    for shape, dv, causal, layout in (((3, 4, 8), 8, True, "zigzag"), ((4, 6), 6, True, "contiguous"),
                                      ((2, 4, 8), 5, True, "zigzag"), ((2, 4, 8), 5, False, "contiguous")):
        seed += 1
        _case("ring", seed, torch.float64, shape, dv, causal, None, layout, None)
        checked += 1
    seed += 1
    _case("ring", seed, torch.float32, (2, 6, 8), 3, True, 0.5, "contiguous", None)
    seed += 1
    _case("ring", seed, torch.float32, (2, 3, 4, 8), 8, True, None, "zigzag", None, transposed=True)
    checked += 2
    for layout in ("contiguous", "zigzag"):
        seed += 1
        _case("ring", seed, torch.bfloat16, (2, 2, 4, 8), 8, True, None, layout, None)
        checked += 1
    # keep_kv (the backward from the kept K/V blocks, sums only): causal in both layouts, not causal with
    # a scale, fp64 with v's head size other than q's (the explicit block path), bf16, an empty block.
    for dtype, shape, dv, causal, scale, layout in (
            (torch.float32, (2, 2, 4, 8), 8, True, None, "contiguous"),
            (torch.float32, (2, 2, 4, 8), 8, True, None, "zigzag"),
            (torch.float32, (2, 2, 4, 8), 8, False, 0.3, "contiguous"),
            (torch.float64, (2, 4, 8), 5, True, None, "zigzag"),
            (torch.bfloat16, (2, 2, 4, 8), 8, True, None, "zigzag"),
            (torch.float32, (2, 2, 0, 8), 8, True, None, "contiguous")):
        seed += 1
        _case("ring", seed, dtype, shape, dv, causal, scale, layout, None, keep_kv=True)
        checked += 1
    # keep_kv's rings cut into chunks of key rows (one per row: the zig-zag halves and the causal
    # diagonal fall across chunk boundaries), against the same oracle.
    assert tp_module.chunks_for(2 * 6 * 16 * 4, 6, None, torch.device("cpu"), 64) == 6  # one chunk per key row
    for causal, layout, dv in ((True, "zigzag", 8), (True, "contiguous", 5), (False, "contiguous", 8)):
        seed += 1
        _case("ring", seed, torch.float32, (2, 2, 6, 8), dv, causal, None, layout, None, keep_kv=True, chunks=64)
        checked += 1
    # Empty blocks: no tokens, no batch (nothing moves; shapes and empty gradients as torch's); a head
    # size of 0 (every score 0: uniform weights, as scaled_dot_product_attention's default scale gives).
    for shape, kind in (((2, 2, 0, 8), "ring"), ((0, 4, 8), "ring"), ((2, 2 * world, 0, 8), "ulysses"),
                        ((2, 4, 0), "ring")):
        seed += 1
        _case(kind, seed, torch.float32, shape, 8, True, None, "contiguous", None)
        checked += 1
    # Ulysses: heads 2 per rank; topology detected, and given.
    heads = 2 * world
    for causal, scale in ((False, None), (True, 0.3)):
        seed += 1
        _case("ulysses", seed, torch.float32, (2, heads, 3, 8), 8, causal, scale, "contiguous", None)
        checked += 1
    seed += 1
    _case("ulysses", seed, torch.float32, (2, heads, 3, 8), 8, True, None, "contiguous", None, transposed=True)
    checked += 1
    seed += 1
    _case("ulysses", seed, torch.float64, (heads, 2, 8), 5, True, None, "contiguous", None)
    seed += 1
    _case("ulysses", seed, torch.bfloat16, (1, heads, 4, 8), 8, True, None, "contiguous", None)
    checked += 2
    if world == 4:
        for spec, two_d in (("1x4", False), ("2x2", True)):
            before = sent_bytes("all_to_all/2d")
            seed += 1
            _case("ulysses", seed, torch.float32, (2, 4, 3, 8), 8, True, None, "contiguous", None,
                  topology=Topology.from_spec(spec))
            # Two all-to-alls forward, two backward: through the 2-D algorithm exactly when it has two levels.
            assert (sent_bytes("all_to_all/2d") > before) == two_d, spec
            checked += 1
        # Topologies that differ across the group (the 2-D all-to-all on some ranks only): every rank raises.
        x = _rand((1, 4, 2, 8), torch.float32, 95)
        with pytest.raises(CollectiveMismatchError, match="ulysses_attention: .*topology"):
            ulysses_attention(x, x, x, topology=Topology.from_spec("2x2") if dist.get_rank() < 2 else None, timeout=T)
        cp = [dist.new_group(members, timeout=timedelta(seconds=T)) for members in ([0, 2], [1, 3])]
        mine = cp[dist.get_rank() % 2]
        other = cp[1 - dist.get_rank() % 2]  # dist.new_group's NON_GROUP_MEMBER on this rank
        try:
            for fn in (ring_attention, ulysses_attention):
                with pytest.raises(ValueError, match=f"{fn.__name__}: this rank .* is not a member of the group"):
                    fn(x, x, x, group=other, timeout=T)
            with pytest.raises(ValueError, match="zigzag_shard: this rank .* is not a member of the group"):
                zigzag_shard(x, group=other)
            _case("ring", 90, torch.float32, (2, 2, 4, 8), 8, True, None, "zigzag", mine)
            _case("ulysses", 91, torch.float32, (2, 2, 4, 8), 8, True, None, "contiguous", mine)
            checked += 2
        finally:
            context().engine().release(mine)  # its worker thread, then the group (a kept pool lives on)
            dist.destroy_process_group(mine)
    return checked


@pytest.mark.parametrize("world", [2, 3, 4])
def test_ring_and_ulysses_match_attention_over_the_whole_sequence(ranks, world):
    """CP 2, 3 and 4: ring attention (contiguous and zig-zag layouts) and Ulysses attention (topology
    detected, 1x4 and 2x2 at 4 ranks) give this rank's block of scaled_dot_product_attention over the
    whole sequence, output and q/k/v gradients, causal and not, scale default and given, fp32, fp64
    and bf16, 2-D to 4-D, transposed (non-contiguous) and empty inputs (a head size of 0 too); on
    subgroups too, a group this rank is not in a ValueError, topologies that differ across the group
    (at 4 ranks) a CollectiveMismatchError on every rank; the ring sends
    exactly (P - 1) K/V blocks forward and (P - 1) K/V blocks plus P - 1 gradient sums backward, the
    sums only with keep_kv (whose rings cut into chunks of key rows give the same results)."""
    counts = ranks(world, _matrix, timeout=120)
    assert counts == [counts[0]] * world and counts[0] == 35 + 4 * (world == 4)


# --------------------------------------------------------------------------------- faults (row 39)
def _mismatches() -> list:
    """Calls whose arguments differ between the two ranks: each must raise CollectiveMismatchError on
    both, naming the function, and leave the group usable."""
    rank = dist.get_rank()
    seen = []

    def expect(case: str, fn) -> None:
        try:
            fn()
        except CollectiveMismatchError as exc:
            seen.append((case, "CollectiveMismatchError", case.split(":")[0] in str(exc)))
        else:
            seen.append((case, "returned", False))
        # The group is still usable: a call whose ranks agree gives the oracle's result.
        x = _rand((2, 3, 8), torch.float32, 40 + rank)
        out = ring_attention(x, x, x, is_causal=True, timeout=T)
        full = _whole(x, "contiguous", None)
        torch.testing.assert_close(out, _mine(F.scaled_dot_product_attention(full, full, full, is_causal=True),
                                              "contiguous", None))

    def qkv(shape, dtype=torch.float32, grad=False):
        t = torch.randn(shape, dtype=dtype, requires_grad=grad)
        return t, t, t

    expect("ring_attention: sequence length", lambda: ring_attention(*qkv((2, 4 + 2 * rank, 8)), timeout=T))
    expect("ring_attention: same numel, other shape",
           lambda: ring_attention(*qkv((2, 4, 8) if rank else (4, 2, 8)), timeout=T))
    expect("ring_attention: head size", lambda: ring_attention(*qkv((2, 4, 8 + rank)), timeout=T))
    expect("ring_attention: dtype",
           lambda: ring_attention(*qkv((2, 4, 8), torch.bfloat16 if rank else torch.float32), timeout=T))
    expect("ring_attention: is_causal", lambda: ring_attention(*qkv((2, 4, 8)), is_causal=bool(rank), timeout=T))
    expect("ring_attention: scale", lambda: ring_attention(*qkv((2, 4, 8)), scale=0.5 if rank else None, timeout=T))
    expect("ring_attention: layout", lambda: ring_attention(*qkv((2, 4, 8)), is_causal=True,
                                                            layout="zigzag" if rank else "contiguous", timeout=T))
    expect("ring_attention: keep_kv", lambda: ring_attention(*qkv((2, 4, 8)), keep_kv=bool(rank), timeout=T))
    expect("ring_attention: requires_grad", lambda: ring_attention(*qkv((2, 4, 8), grad=bool(rank)), timeout=T))
    expect("ulysses_attention: heads, same numel",
           lambda: ulysses_attention(*qkv((1, 4, 2, 8) if rank else (1, 2, 4, 8)), timeout=T))
    expect("ulysses_attention: is_causal", lambda: ulysses_attention(*qkv((1, 2, 4, 8)), is_causal=bool(rank),
                                                                      timeout=T))
    # Wrong in itself on every rank: a ValueError at the call, naming the head count and ring_attention.
    try:
        ulysses_attention(*qkv((1, 3, 4, 8)), timeout=T)
        seen.append(("indivisible", "returned", ""))
    except ValueError as exc:
        seen.append(("indivisible", "ValueError", str(exc)))
    return seen


def test_shapes_that_differ_across_the_group_fail_on_every_rank(ranks):
    """docs/faults.md row 39: shapes (sequence length, head size, heads, the same numel in another
    shape), dtype, is_causal, scale, layout, keep_kv or requires_grad that differ across the context-parallel
    group raise CollectiveMismatchError on every rank, naming the function, before any result; the
    group stays usable; heads not divisible by the group size are a ValueError at the call."""
    for seen in ranks(2, _mismatches, timeout=60):
        *cases, (_, kind, msg) = seen
        assert len(cases) == 11
        for case, error, named in cases:
            assert error == "CollectiveMismatchError" and named, (case, error)
        assert kind == "ValueError", kind
        assert "ulysses_attention" in msg and "3 heads" in msg and "group size 2" in msg and "ring_attention" in msg


def _never_enters() -> dict:
    rank = dist.get_rank()
    subs = [dist.new_group([0, 1], timeout=timedelta(seconds=T)) for _ in range(2)]
    dist.barrier()
    seen: dict = {}
    # (1) Both ranks run the forward; rank 1 never enters the backward's ring.
    q = torch.randn(2, 4, 8, requires_grad=True)
    out = ring_attention(q, q, q, is_causal=True, timeout=ABSENT)
    if rank == 1:
        return seen  # and never enters (2) or (3) either
    start = time.monotonic()
    try:
        out.sum().backward()
        seen["ring_attention/backward"] = "completed"
    except CommTimeoutError as exc:
        seen["ring_attention/backward"] = (time.monotonic() - start, str(exc))
    # (2), (3) Rank 1 never enters the call at all (each on a group of its own: (1) left WORLD out of step).
    for name, fn, group in (("ring_attention", ring_attention, subs[0]), ("ulysses_attention", ulysses_attention,
                                                                          subs[1])):
        x = torch.randn(1, 2, 4, 8)
        start = time.monotonic()
        try:
            fn(x, x, x, group=group, timeout=ABSENT)
            seen[name] = "completed"
        except CommTimeoutError as exc:
            seen[name] = (time.monotonic() - start, str(exc))
    return seen


def test_rank_that_never_enters_times_out():
    """docs/faults.md row 39: a rank that never enters ring or Ulysses attention (the call, or the ring
    of ring attention's backward) -> CommTimeoutError on the others within the timeout plus slack,
    naming the function. A pool of its own: the abandoned calls leave the groups out of step."""
    pool = RankPool(2)
    try:
        res = pool.run(_never_enters, timeout=3 * ABSENT + SLACK + 30)
    finally:
        pool.close(graceful=False)
    assert res[1] == {}
    for case in ("ring_attention/backward", "ring_attention", "ulysses_attention"):
        got = res[0][case]
        assert got != "completed", case
        elapsed, msg = got
        assert ABSENT - 0.5 <= elapsed <= ABSENT + SLACK, (case, elapsed)
        assert msg.startswith("CommTimeoutError") and case.split("/")[0] in msg, msg


def test_bad_arguments_are_errors_at_the_call():
    """docs/faults.md row 39: bad arguments raise TypeError / ValueError at the call (in-process, no
    process group: nothing could be sent), naming the function and what was wrong; a world of one is
    scaled_dot_product_attention itself, and the zig-zag helpers are the identity order."""
    q = torch.randn(2, 4, 6, 8)
    v5 = torch.randn(2, 4, 6, 5)
    cases = [
        (TypeError, "ring_attention: q must be a torch.Tensor", lambda: ring_attention([[1.0]], q, q)),
        (TypeError, "ring_attention: v must be a torch.Tensor", lambda: ring_attention(q, q, None)),
        (TypeError, "k has dtype torch.int64", lambda: ring_attention(q, q.long(), q)),
        (TypeError, "v has dtype torch.float64 but q has torch.float32", lambda: ring_attention(q, q, q.double())),
        (ValueError, "q has shape [8]; it must be [..., S/P, D]", lambda: ring_attention(q[0, 0, 0], q, q)),
        (ValueError, "k has shape [2, 4, 5, 8] but q has [2, 4, 6, 8]", lambda: ring_attention(q, q[..., :5, :], q)),
        (ValueError, "v has shape [2, 3, 6, 8] but q has", lambda: ring_attention(q, q, q[:, :3])),
        (ValueError, "k has head size 5 but q has 8", lambda: ring_attention(q, v5, v5)),
        (TypeError, "is_causal must be a bool", lambda: ring_attention(q, q, q, is_causal=1)),
        (TypeError, "scale must be a finite number", lambda: ring_attention(q, q, q, scale="0.1")),
        (TypeError, "scale must be a finite number", lambda: ring_attention(q, q, q, scale=float("nan"))),
        (ValueError, "layout must be one of", lambda: ring_attention(q, q, q, layout="striped")),
        (ValueError, "layout='zigzag' needs an even local sequence length",
         lambda: ring_attention(q[..., :5, :], q[..., :5, :], q[..., :5, :], layout="zigzag")),
        (ValueError, "timeout must be a positive number", lambda: ring_attention(q, q, q, timeout=0)),
        (TypeError, "ring_attention: keep_kv must be True or False", lambda: ring_attention(q, q, q, keep_kv=1)),
        (TypeError, "group must be a torch.distributed ProcessGroup", lambda: ring_attention(q, q, q, group="cp")),
        (ValueError, "ulysses_attention: q has shape [6, 8]; it must be [..., H, S/P, D]",
         lambda: ulysses_attention(q[0, 0], q[0, 0], q[0, 0])),
        (ValueError, "ulysses_attention: k has head size 5", lambda: ulysses_attention(q, v5, v5)),
        (TypeError, "ulysses_attention: topology must be a commopt.comm.Topology", lambda: ulysses_attention(
            q, q, q, topology="2x2")),
        (TypeError, "ulysses_attention: q is sparse", lambda: ulysses_attention(q.to_sparse(), q, q)),
        (ValueError, "zigzag_shard: dim 1 has size 5, which is not divisible by 2 * group size = 2",
         lambda: zigzag_shard(torch.randn(2, 5, 3), 1)),
        (TypeError, "zigzag_shard: dim must be an int", lambda: zigzag_shard(q, 1.0)),
        (ValueError, "zigzag_unshard: dim=3 is out of range", lambda: zigzag_unshard(q[0], 3)),
    ]
    for error, text, call in cases:
        with pytest.raises(error) as info:
            call()
        assert text in str(info.value), (text, str(info.value))

    # A world of one: scaled_dot_product_attention, forward and backward, v's head size other than q's.
    for causal, scale in ((False, None), (True, 0.3)):
        for fn in (ring_attention, ulysses_attention):
            x = [torch.randn(2, 4, 6, d, requires_grad=True) for d in (8, 8, 5)]
            out = fn(*x, is_causal=causal, scale=scale)
            ref_in = [t.detach().requires_grad_() for t in x]
            ref = F.scaled_dot_product_attention(*ref_in, is_causal=causal, scale=scale)
            g = torch.randn_like(ref)
            out.backward(g)
            ref.backward(g)
            for got, want in [(out, ref)] + [(t.grad, r.grad) for t, r in zip(x, ref_in)]:
                assert got.shape == want.shape and torch.allclose(got, want, rtol=1.3e-6, atol=1e-5)
    seq = torch.arange(12.0).reshape(1, 12, 1)
    assert torch.equal(zigzag_shard(seq, 1), seq) and torch.equal(zigzag_unshard(seq, 1), seq)
    empty = torch.empty(1, 0, 3)
    assert zigzag_shard(empty, 1).shape == (1, 0, 3) and zigzag_unshard(empty, 1).shape == (1, 0, 3)
