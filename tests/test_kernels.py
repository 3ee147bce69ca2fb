"""Tests of commopt.kernels: every backend against the torch reference, and the documented edges.

Parity runs on fresh random data (never zeros), many shapes per test body rather than hundreds of
parametrised cases, so that the suite stays fast (numba compiles once, into its on-disk cache).
Oracles for the shared definitions (the stochastic-rounding hash, the payload layout) are computed
here independently, in plain Python.
"""

from __future__ import annotations

import math
import multiprocessing
import shutil
import subprocess
from pathlib import Path

import pytest
import torch

import commopt.kernels as K
from commopt.kernels import reference
from commopt.kernels._optional import CUPY, NUMBA

needs_numba = pytest.mark.skipif(not NUMBA.available, reason=f"numba unavailable: {NUMBA.error}")
FLOATS = (torch.float32, torch.float16, torch.bfloat16)
SIZES = (0, 1, 7, 31, 32, 33, 255, 256, 257, 1000, 4099)
CU_DIR = Path(K.__file__).parent / "cuda"


def _rand(n: int, dtype: torch.dtype, gen: torch.Generator) -> torch.Tensor:
    # varied magnitudes so that blocks differ in scale, and no exact zeros
    x = torch.randn(n, generator=gen, dtype=torch.float64)
    x = x * torch.exp(torch.randn(n, generator=gen, dtype=torch.float64))
    return (x + torch.where(x >= 0, 1e-3, -1e-3)).to(dtype)


def _bitwise_equal(a: torch.Tensor | None, b: torch.Tensor | None, what: str) -> None:
    if a is None or b is None:
        assert a is None and b is None, what
        return
    assert a.dtype == b.dtype and a.shape == b.shape, f"{what}: {a.dtype}{tuple(a.shape)} vs {b.dtype}{tuple(b.shape)}"
    if a.dtype.is_floating_point:
        nan = torch.isnan(a)
        assert torch.equal(nan, torch.isnan(b)), f"{what}: NaN positions differ"
        a, b = a[~nan], b[~nan]
        a = a.contiguous().view(torch.uint8)
        b = b.contiguous().view(torch.uint8)
    assert torch.equal(a, b), f"{what}: first difference at {(a != b).nonzero()[:5].flatten().tolist()}"


# ---------------------------------------------------------------------------------------------------
# independent oracles


def _fmix32(h: int) -> int:
    h ^= h >> 16
    h = (h * 0x85EBCA6B) % 2**32
    h ^= h >> 13
    h = (h * 0xC2B2AE35) % 2**32
    return h ^ (h >> 16)


def _u(i: int, seed: int, step: int) -> float:
    fold = lambda v: (v ^ (v >> 32)) % 2**32
    key = _fmix32(fold(seed) ^ _fmix32((fold(step) + 0x9E3779B9) % 2**32))
    k = key if i < 2**32 else _fmix32(key ^ (i >> 32))
    return (_fmix32((i % 2**32) ^ k) >> 8) / 2**24


def test_hash_matches_the_documented_definition():
    assert reference.hash_key(0, 0) == _fmix32(_fmix32(0x9E3779B9))
    u = reference._uniform(300, seed=7, step=11, device=torch.device("cpu"))
    assert u.tolist() == [_u(i, 7, 11) for i in range(300)]
    assert 0.0 <= min(u.tolist()) and max(u.tolist()) < 1.0


# ---------------------------------------------------------------------------------------------------
# parity: cpu (numba) against reference, bit for bit


@needs_numba
def test_cpu_matches_reference_on_every_op_dtype_and_shape():
    gen = torch.Generator().manual_seed(1234)
    for dtype in FLOATS:
        for n in SIZES:
            x = _rand(n, dtype, gen)
            tag = f"{dtype} n={n}"
            for block in (None, 1, 32, 100, 256):
                got = K.pack_signs(x, block=block, backend="cpu")
                want = K.pack_signs(x, block=block, backend="reference")
                _bitwise_equal(got[0], want[0], f"pack_signs bits {tag} block={block}")
                if block is not None:
                    torch.testing.assert_close(got[1], want[1], rtol=1e-6, atol=0)
                    got_u, want_u = (K.unpack_signs(want[0], n, want[1], block=block, dtype=dtype, backend=b)
                                     for b in ("cpu", "reference"))
                    _bitwise_equal(got_u, want_u, f"unpack_signs {tag} block={block}")
                else:
                    _bitwise_equal(K.unpack_signs(got[0], n, dtype=dtype, backend="cpu"),
                                   K.unpack_signs(got[0], n, dtype=dtype, backend="reference"), f"unpack {tag}")
            for bits, block in ((8, 256), (8, 33), (4, 256), (4, 6)):
                for stochastic in (True, False):
                    args = dict(bits=bits, block=block, seed=5, step=n, stochastic=stochastic)
                    got = K.quantize(x, backend="cpu", **args)
                    want = K.quantize(x, backend="reference", **args)
                    what = f"quantize {tag} bits={bits} block={block} stochastic={stochastic}"
                    _bitwise_equal(got[0], want[0], what + " codes")
                    _bitwise_equal(got[1], want[1], what + " scales")
                    for out_dtype in (dtype, torch.float32):
                        _bitwise_equal(
                            K.dequantize(*want, n, bits=bits, block=block, dtype=out_dtype, backend="cpu"),
                            K.dequantize(*want, n, bits=bits, block=block, dtype=out_dtype, backend="reference"),
                            f"dequantize {what} -> {out_dtype}",
                        )
            for k in sorted({0, 1, n // 3, n} & set(range(n + 1))):
                got = K.topk_pack(x, k, backend="cpu")
                want = K.topk_pack(x, k, backend="reference")
                _bitwise_equal(got, want, f"topk_pack {tag} k={k}")
                other = K.topk_pack(-x.flip(0), k, backend="reference")
                for out_dtype in (dtype, torch.float32):
                    got_d, want_d = (K.scatter_add_unpack([want, other, want], n, dtype=out_dtype,
                                                          value_dtype=dtype, backend=b)
                                     for b in ("cpu", "reference"))
                    _bitwise_equal(got_d, want_d, f"scatter_add_unpack {tag} k={k} -> {out_dtype}")


@needs_numba
@pytest.mark.parametrize("threads", [1, 2])
def test_large_sizes_use_every_thread_and_still_match(threads):
    """Both builds of each kernel: the parallel one, and the serial one a rank limited to one torch
    thread gets (kernels.cpu._Threaded)."""
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        _large_sizes_match()
    finally:
        torch.set_num_threads(previous)


def _large_sizes_match():
    gen = torch.Generator().manual_seed(7)
    n = (1 << 20) + 12345
    x = _rand(n, torch.float32, gen)
    for bits in (8, 4):
        got = K.quantize(x, bits=bits, backend="cpu", seed=1, step=2)
        want = K.quantize(x, bits=bits, backend="reference", seed=1, step=2)
        _bitwise_equal(got[0], want[0], f"quantize large bits={bits}")
    _bitwise_equal(K.pack_signs(x, backend="cpu")[0], K.pack_signs(x, backend="reference")[0], "pack large")
    k = n // 100
    _bitwise_equal(K.topk_pack(x, k, backend="cpu"), K.topk_pack(x, k, backend="reference"), "topk large")
    buf, offsets = K.flatten([x, x[:1000]], backend="cpu")
    ref, ref_offsets = K.flatten([x, x[:1000]], backend="reference")
    assert offsets == ref_offsets
    _bitwise_equal(buf, ref, "flatten large")


# ---------------------------------------------------------------------------------------------------
# flatten / unflatten


def _flatten_inputs(dtype: torch.dtype, gen: torch.Generator) -> list[torch.Tensor]:
    def r(*shape: int) -> torch.Tensor:
        if dtype == torch.bool:
            return torch.rand(shape, generator=gen) > 0.5
        if dtype.is_complex:
            return torch.randn(shape, generator=gen, dtype=dtype)
        if not dtype.is_floating_point:
            return torch.randint(-1000, 1000, shape, generator=gen).to(dtype)
        return _rand(math.prod(shape), dtype, gen).view(shape)

    return [
        r(3, 5),
        r(0),  # zero elements: takes no space
        r(7, 4).t(),  # non-contiguous
        r(),  # 0-d
        r(2, 3, 4).permute(2, 0, 1),
        r(33),
        r(4, 6)[:, ::2],  # strided
        r(1),
    ]


@pytest.mark.parametrize("backend", ["reference", pytest.param("cpu", marks=needs_numba)])
def test_flatten_roundtrip_offsets_and_zero_padding(backend):
    gen = torch.Generator().manual_seed(3)
    dtypes = (torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int64, torch.int8, torch.bool,
              torch.complex64)
    for dtype in dtypes:
        for align in (1, 7, 16):
            ts = _flatten_inputs(dtype, gen)
            expected = [0]
            for t in ts:
                expected.append(-(-(expected[-1] + t.numel()) // align) * align)
            # poisoned out, larger than needed: every element must be written (padding and tail zero)
            out = torch.empty(expected[-1] + 5, dtype=dtype)
            out.view(torch.uint8).fill_(0xFF)
            buf, offsets = K.flatten(ts, out, align=align, backend=backend)
            assert buf is out and offsets == expected, (dtype, align, offsets, expected)
            covered = torch.zeros(out.numel(), dtype=torch.bool)
            for t, start in zip(ts, offsets):
                assert torch.equal(buf[start : start + t.numel()], t.reshape(-1)), (dtype, align)
                covered[start : start + t.numel()] = True
            assert not buf[~covered].view(torch.uint8).any(), f"padding not zero for {dtype} align={align}"
            # allocated buffer has exactly offsets[-1] elements
            fresh, same = K.flatten(ts, align=align, backend=backend)
            assert fresh.numel() == expected[-1] and same == expected
            assert torch.equal(fresh, buf[: expected[-1]])
            # back into poisoned, partly non-contiguous destinations
            dests = []
            for t in ts:
                d = torch.empty(t.shape[::-1], dtype=dtype).t() if t.dim() == 2 else torch.empty_like(t)
                if d.is_contiguous():
                    d.view(-1).view(torch.uint8).fill_(0xFF)
                else:
                    d.fill_(True if dtype == torch.bool else 1)
                dests.append(d)
            K.unflatten(buf, dests, offsets, backend=backend)
            for t, d in zip(ts, dests):
                assert torch.equal(t, d), (dtype, align)
            dests2 = [torch.zeros_like(t) for t in ts]
            K.unflatten(buf, dests2, align=align, backend=backend)  # offsets recomputed from align
            assert all(torch.equal(t, d) for t, d in zip(ts, dests2))


@pytest.mark.parametrize("backend", ["reference", pytest.param("cpu", marks=needs_numba)])
def test_flatten_of_views_already_in_place_and_of_tensors_that_require_grad(backend):
    # DDP's gradient_as_bucket_view: the tensors already live at their offsets in the buffer
    buf = torch.randn(64)
    ts = [buf[0:5], buf[16:36].view(4, 5)]
    want = [t.clone() for t in ts]
    out, offsets = K.flatten(ts, buf, backend=backend)
    assert offsets == [0, 16, 48] and out is buf
    assert torch.equal(buf[0:5], want[0]) and torch.equal(buf[16:36], want[1].reshape(-1))
    assert not buf[5:16].any() and not buf[36:].any()
    K.unflatten(buf, ts, offsets, backend=backend)
    assert torch.equal(ts[1], want[1])
    w = torch.randn(3, 3, requires_grad=True)
    flat, _ = K.flatten([w], backend=backend)
    assert torch.equal(flat[:9], w.detach().reshape(-1)) and not flat.requires_grad
    assert K.quantize(w, backend=backend)[0].numel() == 9


def test_flatten_rejects_bad_arguments():
    a, b = torch.ones(3), torch.ones(3, dtype=torch.float16)
    with pytest.raises(ValueError, match="mix dtypes"):
        K.flatten([a, b])
    with pytest.raises(TypeError, match="list or tuple"):
        K.flatten(a)
    with pytest.raises(ValueError, match="at least 32"):
        K.flatten([a, a], torch.empty(20))
    with pytest.raises(ValueError, match="expected torch.float32"):
        K.flatten([a], torch.empty(16, dtype=torch.float64))
    with pytest.raises(ValueError, match="dtype is unknown"):
        K.flatten([])
    out, offsets = K.flatten([], torch.full((4,), 7.0))
    assert offsets == [0] and not out.any()
    with pytest.raises(ValueError, match="align=0"):
        K.flatten([a], align=0)
    with pytest.raises(ValueError, match="runs past the end"):
        K.unflatten(torch.zeros(4), [a, a], [0, 2])
    with pytest.raises(ValueError, match="offsets for"):
        K.unflatten(torch.zeros(40), [a, a], [0])
    with pytest.raises(ValueError, match="mix dtypes"):
        K.unflatten(torch.zeros(40), [b])
    with pytest.raises(ValueError, match="backend"):
        K.flatten([a], backend="gpu")
    with pytest.raises(ValueError, match="cannot run tensors on cpu"):
        K.flatten([a], backend="cuda")


# ---------------------------------------------------------------------------------------------------
# permute_chunks


@pytest.mark.parametrize("backend", ["reference", pytest.param("cpu", marks=needs_numba)])
def test_permute_chunks(backend):
    gen = torch.Generator().manual_seed(5)
    cases = [([3, 0, 5, 2], [2, 0, 3, 1]), ([10], [0]), ([0, 0, 10], [2, 1, 0]), ([1] * 10, list(range(9, -1, -1))),
             ([4, 6], [1, 0]), ([0], [0])]
    for dtype in (torch.float32, torch.bfloat16, torch.int32):
        for splits, order in cases:
            rows = sum(splits)
            for x in (_rand(rows * 6, torch.float64, gen).view(rows, 2, 3).to(dtype),
                      _rand(rows * 6, torch.float64, gen).view(3, 2, rows).permute(2, 1, 0).to(dtype)):
                chunks = torch.split(x, splits)
                want = torch.cat([chunks[o] for o in order])
                out = torch.empty_like(x, memory_format=torch.contiguous_format)
                out.view(torch.uint8).fill_(0xFF)
                got = K.permute_chunks(x, splits, order, out=out, backend=backend)
                assert got is out and torch.equal(got, want), (splits, order)
                assert torch.equal(K.permute_chunks(x, splits, order, backend=backend), want)
    x = torch.arange(6.0)
    with pytest.raises(ValueError, match="sum to 5"):
        K.permute_chunks(x, [2, 3], [1, 0])
    with pytest.raises(ValueError, match="not a permutation"):
        K.permute_chunks(x, [3, 3], [0, 0])
    with pytest.raises(ValueError, match="0-d"):
        K.permute_chunks(torch.tensor(1.0), [1], [0])
    with pytest.raises(ValueError, match="splits\\[0\\]=-1"):
        K.permute_chunks(x, [-1, 7], [0, 1])


# ---------------------------------------------------------------------------------------------------
# outputs are fully written: poison every buffer a backend allocates


@needs_numba
def test_every_output_element_is_written(monkeypatch):
    from commopt.kernels import cpu

    def poisoned(numel: int, dtype: torch.dtype) -> torch.Tensor:
        t = torch.empty(numel, dtype=dtype)
        t.view(torch.uint8).fill_(0xFF)  # NaN for every float format, -1 / 255 for integers
        return t

    monkeypatch.setattr(cpu, "_empty", poisoned)
    gen = torch.Generator().manual_seed(11)
    for dtype in FLOATS:
        for n in (1, 31, 33, 257, 1001):
            x = _rand(n, dtype, gen)
            for block in (None, 32, 7):
                got = K.pack_signs(x, block=block, backend="cpu")
                _bitwise_equal(got[0], K.pack_signs(x, block=block, backend="reference")[0], "pack poisoned")
                if block:
                    assert not torch.isnan(got[1]).any()
                    y = K.unpack_signs(got[0], n, got[1], block=block, dtype=dtype, backend="cpu")
                    assert not torch.isnan(y).any()
            for bits in (8, 4):
                codes, scales = K.quantize(x, bits=bits, block=6, backend="cpu")
                want = K.quantize(x, bits=bits, block=6, backend="reference")
                _bitwise_equal(codes, want[0], "codes poisoned")
                _bitwise_equal(scales, want[1], "scales poisoned")
                y = K.dequantize(codes, scales, n, bits=bits, block=6, dtype=dtype, backend="cpu")
                assert not torch.isnan(y).any()
                for b in ("cpu", "reference"):  # a caller's out, poisoned too
                    out = poisoned(n, dtype)
                    got = K.dequantize(codes, scales, n, bits=bits, block=6, dtype=dtype, out=out, backend=b)
                    assert got is out
                    _bitwise_equal(got, y, f"dequantize out= {b}")
                    out = poisoned(n, dtype)
                    bits_, sc = K.pack_signs(x, block=6, backend="reference")
                    got = K.unpack_signs(bits_, n, sc, block=6, dtype=dtype, out=out, backend=b)
                    _bitwise_equal(got, K.unpack_signs(bits_, n, sc, block=6, dtype=dtype, backend="reference"),
                                   f"unpack_signs out= {b}")
            for k in (1, n // 2, n):
                _bitwise_equal(K.topk_pack(x, k, backend="cpu"), K.topk_pack(x, k, backend="reference"), "topk")


# ---------------------------------------------------------------------------------------------------
# quantisation edges


@pytest.mark.parametrize("backend", ["reference", pytest.param("cpu", marks=needs_numba)])
def test_int4_range_edges_and_rounding(backend):
    # the block's extremes map to +-7 exactly, -8 is never produced, ties round to even
    x = torch.tensor([7.0, -7.0, 2.5, -2.5, 3.5, 0.5, -0.5, 1.5, 6.9999, -6.9999, 0.0, -0.0], dtype=torch.float32)
    codes, scales = K.quantize(x, bits=4, block=12, stochastic=False, backend=backend)
    assert scales.tolist() == [1.0]
    nib = torch.stack([codes & 15, codes >> 4], 1).reshape(-1).to(torch.int64)
    vals = torch.where(nib >= 8, nib - 16, nib).tolist()
    assert vals == [7, -7, 2, -2, 4, 0, 0, 2, 7, -7, 0, 0]
    torch.testing.assert_close(K.dequantize(codes, scales, 12, bits=4, block=12, backend=backend),
                               torch.tensor(vals, dtype=torch.float32))
    # stochastic rounding never leaves [-7, 7], even at the extremes, over many seeds
    y = torch.tensor([1.0, -1.0, 0.999, -0.999] * 4)
    for seed in range(50):
        codes, scales = K.quantize(y, bits=4, block=16, seed=seed, backend=backend)
        nib = torch.stack([codes & 15, codes >> 4], 1).reshape(-1).to(torch.int64)
        v = torch.where(nib >= 8, nib - 16, nib)
        assert v.min() >= -7 and v.max() <= 7 and v[0] == 7 and v[1] == -7
    # int8 extremes
    codes, scales = K.quantize(torch.tensor([127.0, -127.0, 63.5]), bits=8, block=3, stochastic=False,
                               backend=backend)
    assert codes.tolist() == [127, -127, 64] and scales.tolist() == [1.0]
    # an odd tail leaves the last high nibble 0
    codes, _ = K.quantize(torch.tensor([1.0, 2.0, 3.0]), bits=4, block=4, stochastic=False, backend=backend)
    assert codes.numel() == 2 and int(codes[1]) >> 4 == 0


@pytest.mark.parametrize("backend", ["reference", pytest.param("cpu", marks=needs_numba)])
def test_all_zero_blocks_quantize_to_zero(backend):
    x = torch.zeros(40)
    x[8:16] = torch.linspace(-1, 1, 8)
    for bits in (8, 4):
        codes, scales = K.quantize(x, bits=bits, block=8, backend=backend)
        assert scales[0] == 0 and scales[2:].eq(0).all() and scales[1] > 0
        y = K.dequantize(codes, scales, 40, bits=bits, block=8, backend=backend)
        assert not torch.isnan(y).any() and y[:8].eq(0).all() and y[16:].eq(0).all()
    bits_, scales = K.pack_signs(x, block=8, backend=backend)
    assert scales[0] == 0 and not torch.isnan(scales).any()


@pytest.mark.parametrize("backend", ["reference", pytest.param("cpu", marks=needs_numba)])
def test_nonfinite_inputs_produce_what_is_documented(backend):
    nan, inf = float("nan"), float("inf")
    for dtype in FLOATS:
        x = torch.tensor([1.0, nan, 2.0, 3.0, -1.0, inf, 2.0, 3.0, 1.0, -2.0, 0.5, 4.0], dtype=dtype)
        for bits in (8, 4):
            codes, scales = K.quantize(x, bits=bits, block=4, backend=backend)
            assert math.isnan(scales[0]) and math.isinf(scales[1]) and math.isfinite(scales[2])
            y = K.dequantize(codes, scales, 12, bits=bits, block=4, dtype=dtype, backend=backend)
            assert torch.isnan(y[:8]).all(), "a block with NaN or Inf dequantizes to NaN"
            torch.testing.assert_close(y[8:].float(), x[8:].float(), atol=float(scales[2]), rtol=0)
        # signs read the sign bit: +NaN and +inf are positive, -0.0 and -NaN negative
        s = torch.tensor([nan, nan, inf, -inf, 0.0, -0.0, 1.0, -1.0], dtype=dtype)
        s.view(torch.int16 if s.element_size() == 2 else torch.int32)[1] = -1  # all ones: a NaN with sign set
        bits_, scales = K.pack_signs(s, block=4, backend=backend)
        assert int(bits_[0]) == 0b01010101
        assert math.isnan(scales[0]) and scales[1] == 0.5
        # top-k sends NaN first, then Inf
        p = K.topk_pack(torch.tensor([1.0, inf, -5.0, nan], dtype=dtype), 2, backend=backend)
        assert p[reference.topk_layout(2, s.element_size())[1]:].view(torch.int32).tolist() == [1, 3]
        dense = K.scatter_add_unpack([p], 4, dtype=dtype, backend=backend)
        assert math.isinf(dense[1]) and math.isnan(dense[3]) and dense[0] == 0 and dense[2] == 0


@pytest.mark.parametrize("backend", ["reference", pytest.param("cpu", marks=needs_numba)])
def test_stochastic_rounding_is_unbiased_reproducible_and_matches_the_oracle(backend):
    gen = torch.Generator().manual_seed(2)
    x = _rand(64, torch.float32, gen)
    codes, scales = K.quantize(x, bits=4, block=64, seed=9, step=3, backend=backend)
    # the oracle, element by element from the documented definition
    v = (x / scales[0]).tolist()
    want = [max(-7, min(7, math.floor(vi + _u(i, 9, 3)))) for i, vi in enumerate(v)]
    nib = torch.stack([codes & 15, codes >> 4], 1).reshape(-1).to(torch.int64)
    assert torch.where(nib >= 8, nib - 16, nib).tolist() == want
    again = K.quantize(x, bits=4, block=64, seed=9, step=3, backend=backend)
    assert torch.equal(again[0], codes)
    assert not torch.equal(K.quantize(x, bits=4, block=64, seed=9, step=4, backend=backend)[0], codes)
    # Monte-Carlo mean of 10**4 draws per element (200 seeds x 50 copies, each copy at other indices,
    # so other hash draws): within 5 standard errors of x (each draw errs by less than one step)
    copies, n_seeds = 50, 200
    tiled = x.repeat(copies)
    total = torch.zeros(64, dtype=torch.float64)
    for seed in range(n_seeds):
        c, s = K.quantize(tiled, bits=8, block=64, seed=seed, step=0, backend=backend)
        y = K.dequantize(c, s, tiled.numel(), bits=8, block=64, backend=backend)
        total += y.double().view(copies, 64).sum(0)
    draws = copies * n_seeds
    mean = total / draws
    stderr = float(s[0]) * 0.5 / math.sqrt(draws)
    assert (mean - x.double()).abs().max() < 5 * stderr


# ---------------------------------------------------------------------------------------------------
# fp16 / bf16 conversions written in the numba kernels


@needs_numba
def test_half_conversions_match_torch_exhaustively():
    every = torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16)
    for dtype in (torch.float16, torch.bfloat16):
        x = every.view(dtype)
        # widening is exact: block=1 scales are |x| in fp32
        _, scales = K.pack_signs(x, block=1, backend="cpu")
        _bitwise_equal(scales, x.float().abs(), f"{dtype} -> fp32")
        # narrowing rounds to nearest even: unpack_signs(+1 bits) gives the fp32 scales rounded
    gen = torch.Generator().manual_seed(4)
    f = torch.randint(-(2**31), 2**31 - 1, (1 << 16,), generator=gen, dtype=torch.int64).to(torch.int32).view(
        torch.float32
    )
    edges = torch.tensor([65504.0, 65519.99, 65520.0, 2.0**-24, 2.0**-25, 2.0**-25 * 1.0001, 2.0**-14,
                          2.0**-14 * (1 - 2.0**-11), 3.3895e38, 1e-40, float("inf"), 5.960464477539063e-08])
    f = torch.cat([f, edges, -edges])
    bits = torch.full((-(-f.numel() // 32),), -1, dtype=torch.int32).view(torch.uint32)
    for dtype in (torch.float16, torch.bfloat16):
        got = K.unpack_signs(bits, f.numel(), f, block=1, dtype=dtype, backend="cpu")
        _bitwise_equal(got, f.to(dtype), f"fp32 -> {dtype}")


# ---------------------------------------------------------------------------------------------------
# top-k payloads


@pytest.mark.parametrize("backend", ["reference", pytest.param("cpu", marks=needs_numba)])
def test_topk_selection_ties_layout_and_payload_checks(backend):
    x = torch.tensor([1.0, -3.0, 2.0, 3.0, -2.0, 3.0, 0.5], dtype=torch.float16)
    p = K.topk_pack(x, 4, backend=backend)
    values_at, indices_at, total = reference.topk_layout(4, 2)
    assert p.dtype == torch.uint8 and p.numel() == total == 8 + 8 + 16
    assert p[:8].view(torch.int32).tolist() == [4, 1]
    assert p[indices_at:].view(torch.int32).tolist() == [1, 2, 3, 5]  # ties: lower index first
    assert p[values_at : values_at + 8].view(torch.float16).tolist() == [-3.0, 2.0, 3.0, 3.0]
    dense = K.scatter_add_unpack(torch.stack([p, p]), 7, dtype=torch.float16, backend=backend)
    assert dense.tolist() == [0.0, -6.0, 4.0, 6.0, 0.0, 6.0, 0.0]
    for out_dtype in (torch.float16, torch.float32):
        out = torch.full((7,), float("nan"), dtype=out_dtype)
        got = K.scatter_add_unpack([p, p], 7, dtype=out_dtype, value_dtype=torch.float16, out=out, backend=backend)
        assert got is out and out.tolist() == [0.0, -6.0, 4.0, 6.0, 0.0, 6.0, 0.0]
    assert K.topk_pack(x, 0, backend=backend).tolist() == [0, 0, 0, 0, 1, 0, 0, 0]
    assert K.scatter_add_unpack([K.topk_pack(x, 0, backend=backend)], 3, dtype=torch.float16,
                                backend=backend).tolist() == [0, 0, 0]
    assert K.topk_k(p.numel(), 2) == 4 and K.topk_k(p.numel() + 1, 2) == -1
    with pytest.raises(ValueError, match="exceeds"):
        K.topk_pack(x, 8, backend=backend)
    with pytest.raises(ValueError, match="value_dtype"):
        K.scatter_add_unpack([p], 7, dtype=torch.float32, backend=backend)
    with pytest.raises(ValueError, match="no k gives"):
        K.scatter_add_unpack([p[:-1]], 7, dtype=torch.float16, backend=backend)
    with pytest.raises(ValueError, match="outside"):
        K.scatter_add_unpack([p], 4, dtype=torch.float16, backend=backend)
    bad = p.clone()
    bad[4] = 9
    with pytest.raises(ValueError, match="dtype code=9"):
        K.scatter_add_unpack([bad], 7, dtype=torch.float16, backend=backend)
    with pytest.raises(TypeError, match="torch.int32"):
        K.topk_pack(torch.arange(4, dtype=torch.int32), 1, backend=backend)


# ---------------------------------------------------------------------------------------------------
# argument checks and dispatch


def test_bad_arguments_raise_value_or_type_errors():
    x = torch.randn(100)
    b, s = K.pack_signs(x, block=10)
    codes, scales = K.quantize(x, block=10)
    cases = [
        (TypeError, lambda: K.pack_signs(torch.arange(3))),
        (ValueError, lambda: K.pack_signs(x, block=0)),
        (ValueError, lambda: K.unpack_signs(b, 100, s)),  # several scales, no block
        (ValueError, lambda: K.unpack_signs(b, 100, s, block=20)),
        (ValueError, lambda: K.unpack_signs(b, 50)),
        (TypeError, lambda: K.unpack_signs(b.view(torch.int32), 100)),
        (TypeError, lambda: K.unpack_signs(b, 100, dtype=torch.int32)),
        (ValueError, lambda: K.quantize(x, bits=2)),
        (ValueError, lambda: K.quantize(x, bits=4, block=7)),
        (ValueError, lambda: K.quantize(x, seed=-1)),
        (ValueError, lambda: K.quantize(x, step=2**64)),
        (TypeError, lambda: K.quantize(x, block=2.0)),
        (TypeError, lambda: K.quantize(torch.arange(4))),
        (TypeError, lambda: K.dequantize(codes.view(torch.uint8), scales, 100, block=10)),
        (ValueError, lambda: K.dequantize(codes, scales, 99, block=10)),
        (ValueError, lambda: K.dequantize(codes, scales, 100, block=20)),
        (ValueError, lambda: K.scatter_add_unpack(torch.zeros(8, dtype=torch.uint8), 4)),
        (ValueError, lambda: K.scatter_add_unpack([torch.zeros(8)], 4)),
        (TypeError, lambda: K.scatter_add_unpack("payload", 4)),
        (ValueError, lambda: K.dequantize(codes, scales, 100, block=10, out=torch.empty(99))),
        (ValueError, lambda: K.unpack_signs(b, 100, s, block=10, out=torch.empty(100, dtype=torch.float16))),
    ]
    for exc, call in cases:
        with pytest.raises(exc):
            call()


def test_dispatch_defaults_and_forced_backends():
    avail = K.available_backends()
    assert avail["reference"] is None
    x = torch.randn(10)
    assert K._impl("op", x.device, None).__name__.endswith("cpu" if NUMBA.available else "reference")
    assert K._impl("op", torch.device("meta"), None).__name__.endswith("reference")
    with pytest.raises(ValueError, match="cannot run tensors on cpu"):
        K.quantize(x, backend="cuda")
    with pytest.raises(ValueError, match="not one of"):
        K.quantize(x, backend="numba")


# ---------------------------------------------------------------------------------------------------
# spawned processes (numba's threading layers are not fork-safe: the suite spawns, never forks)


def _child(n: int) -> list[int]:
    x = torch.linspace(-1, 1, n)
    return K.quantize(x, seed=1, stochastic=True)[0].tolist()


def _one_thread_rank() -> bool:
    import numba.np.ufunc.parallel as pool

    torch.set_num_threads(1)
    x = torch.linspace(-1, 1, 1 << 20)
    K.quantize(x, seed=1, stochastic=True, backend="cpu")
    K.permute_chunks(x, [1 << 19] * 2, [1, 0], backend="cpu")
    return bool(pool._is_initialized)


@needs_numba
def test_a_rank_with_one_thread_never_starts_numbas_pool():
    """With numba's OpenMP pool merely started, 4 ranks on 2 cores ran a 2-D all-to-all 3x slower
    (kernels.cpu._run): a rank limited to one torch thread must run the serial builds only."""
    with multiprocessing.get_context("spawn").Pool(1) as pool:
        assert pool.apply(_one_thread_rank) is False


@needs_numba
def test_kernels_run_in_a_spawned_process():
    x = torch.linspace(-1, 1, 300)
    want = K.quantize(x, seed=1, stochastic=True)[0].tolist()  # the parent has run numba kernels
    with multiprocessing.get_context("spawn").Pool(1) as pool:
        assert pool.apply(_child, (300,)) == want


# ---------------------------------------------------------------------------------------------------
# CUDA: the sources compile with nvcc wherever it exists; parity wherever a GPU exists


def test_cuda_sources_compile_with_nvcc(tmp_path):
    nvcc = shutil.which("nvcc")
    if nvcc is None:
        pytest.skip("nvcc not on PATH")
    sources = sorted(CU_DIR.glob("*.cu"))
    assert sources, f"no .cu sources under {CU_DIR}"
    for src in sources:
        out = tmp_path / (src.stem + ".ptx")
        run = subprocess.run([nvcc, "--ptx", "-arch=sm_90", "-o", str(out), str(src)], capture_output=True,
                             text=True, timeout=300)
        assert run.returncode == 0, f"nvcc failed on {src.name}:\n{run.stderr}"
        ptx = out.read_text()
        assert ".entry commopt_" in ptx, f"{src.name} defines no commopt_ kernel"


def _gpu_ready() -> bool:
    return torch.cuda.is_available() and CUPY.available


@pytest.mark.gpu
@pytest.mark.cupy
@pytest.mark.skipif(not _gpu_ready(), reason="needs a CUDA device and a working CuPy")
def test_cuda_matches_reference():
    from commopt.bench.kernels import parity_failures

    failures = parity_failures(torch.device("cuda"), sizes=SIZES + (1 << 20,))
    assert not failures, "\n".join(failures)


@pytest.mark.parametrize("backend", ["reference", "cpu"])
def test_scatter_add_unpack_accepts_payloads_at_any_byte_offset(backend):
    """Payloads sliced out of a gathered byte buffer start at arbitrary offsets (fp64 values need 8)."""
    gen = torch.Generator().manual_seed(7)
    x = torch.randn(100, generator=gen, dtype=torch.float64)
    p = K.topk_pack(x, 5)
    for offset in (1, 3, 4, 8):
        big = torch.zeros(p.numel() + offset, dtype=torch.uint8)
        big[offset:] = p
        got = K.scatter_add_unpack([big[offset:]], 100, dtype=torch.float64, backend=backend)
        assert torch.equal(got, K.scatter_add_unpack([p], 100, dtype=torch.float64, backend="reference"))
