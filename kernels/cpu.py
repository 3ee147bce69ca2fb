"""numba kernels for CPUs: the same results as :mod:`.reference`, near memory bandwidth.

How they work, and why:

- Every kernel is ``@njit(parallel=True, cache=True)`` (plus a serial build for ranks allowed one
  thread, see :class:`_Threaded`) and works on numpy *views* of the torch
  tensors' memory (``tensor.numpy()`` on contiguous CPU tensors): no copy in, no copy out. ``cache``
  keeps the one-off compile (about a second per kernel and array type) out of every later process.
- numba has no float16 and numpy no bfloat16, so fp32, fp16 and bf16 data are handed to the kernels
  as raw bit patterns (uint32 / uint16 views) and converted in the kernel: fp16 and bf16 widen
  exactly to fp32; fp32 narrows to fp16 / bf16 with round-to-nearest-even written out in integer
  arithmetic (NaN stays NaN, its payload is not preserved). fp64 inputs of the lossy kernels go to
  the reference implementation (they are not a bandwidth concern); byte copies (flatten, unflatten,
  permute_chunks) handle every dtype.
- Copies go through one kernel that walks a table of (source address, destination address, bytes,
  zero padding) segments, split into fixed-size tasks so that one large tensor still uses every
  thread; each task is one ``memcpy`` / ``memset``. Raw addresses are turned into pointers by two
  small LLVM intrinsics (below); the torch tensors stay alive for the whole call.
- Magnitude maxima are integer maxima of the sign-cleared bit patterns: for IEEE numbers this order
  equals the order of magnitudes, NaN patterns sort above Inf (so NaN propagates, as torch.amax
  does), and integer max reductions vectorise where float ones do not.
- numba's OpenMP / TBB layers are not fork-safe: processes that run these kernels must be spawned,
  never forked after a kernel has run.
"""

from __future__ import annotations

import types as pytypes
from collections.abc import Sequence

import numba
import numpy as np
import torch
from llvmlite import ir
from numba import njit, prange, types
from numba.core import cgutils
from numba.extending import intrinsic, overload

from . import reference
from .reference import DTYPE_CODES, hash_key, topk_layout

__all__ = [
    "flatten",
    "unflatten",
    "pack_signs",
    "unpack_signs",
    "quantize",
    "dequantize",
    "topk_pack",
    "scatter_add_unpack",
    "permute_chunks",
]

_U = np.uint64
_W = np.uint32
_M32 = _U(0xFFFFFFFF)
_M1 = _U(0x85EBCA6B)
_M2 = _U(0xC2B2AE35)
_TWO_M24 = np.float32(2.0**-24)
_TWO_P24 = np.float32(2.0**24)
_KIND = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}
# bytes per copy task: large enough that a task is one efficient memcpy, small enough that one big
# tensor is shared among all threads
_COPY_CHUNK = 1 << 18
# elements per task of the element-wise kernels whose blocks may be huge (one scale per tensor)
_ELEM_CHUNK = 1 << 14
# elements (or bytes, for copies: times 4) below which a kernel runs on the calling thread only
_SERIAL_BELOW = 1 << 16


class _Threaded:
    """A kernel compiled twice: with ``prange`` on numba's thread pool, and serial (``prange`` is
    then ``range``). :func:`_run` picks the serial one when the rank may use one thread: numba's
    OpenMP pool, even asked for one thread at run time, kept waking spinning threads (4 ranks on 2
    cores: a 1 MiB permute took 5-10 ms instead of 0.1 ms)."""

    def __init__(self, fn):
        self.parallel = njit(parallel=True, cache=True, error_model="numpy")(fn)
        serial = pytypes.FunctionType(fn.__code__, fn.__globals__, fn.__name__ + "_serial", fn.__defaults__,
                                    fn.__closure__)
        serial.__qualname__ = fn.__qualname__ + "_serial"  # its own on-disk cache entry
        self.serial = njit(cache=True, error_model="numpy")(serial)


# ---------------------------------------------------------------------------------------------------
# LLVM intrinsics: raw memcpy / memset by address, and float <-> bits casts


@intrinsic
def _memcpy(typingctx, dst, src, nbytes):
    def codegen(context, builder, signature, args):
        d = builder.inttoptr(args[0], cgutils.voidptr_t)
        s = builder.inttoptr(args[1], cgutils.voidptr_t)
        cgutils.raw_memcpy(builder, d, s, args[2], context.get_constant(types.intp, 1))
        return context.get_dummy_value()

    return types.void(types.int64, types.int64, types.int64), codegen


@intrinsic
def _memzero(typingctx, dst, nbytes):
    def codegen(context, builder, signature, args):
        d = builder.inttoptr(args[0], cgutils.voidptr_t)
        cgutils.memset(builder, d, args[1], 0)
        return context.get_dummy_value()

    return types.void(types.int64, types.int64), codegen


@intrinsic
def _byte_ptr(typingctx, addr):
    """A uint8 pointer from an address, for numba.carray."""

    def codegen(context, builder, signature, args):
        return builder.inttoptr(args[0], context.get_value_type(types.CPointer(types.uint8)))

    return types.CPointer(types.uint8)(types.int64), codegen


@intrinsic
def _as_f32(typingctx, bits):
    """The float32 whose bit pattern is the low 32 bits of ``bits`` (a uint64)."""

    def codegen(context, builder, signature, args):
        low = builder.trunc(args[0], ir.IntType(32))
        return builder.bitcast(low, ir.FloatType())

    return types.float32(types.uint64), codegen


@intrinsic
def _f32_bits(typingctx, value):
    """The bit pattern of a float32, zero-extended to uint64."""

    def codegen(context, builder, signature, args):
        return builder.zext(builder.bitcast(args[0], ir.IntType(32)), ir.IntType(64))

    return types.uint64(types.float32), codegen


# ---------------------------------------------------------------------------------------------------
# scalar helpers. The element format travels in the numpy view's dtype, so that each kernel is
# compiled per format with no format branch left in its loops: uint32 = fp32 bits, uint16 = fp16
# bits, int16 = bf16 bits (numpy has no bfloat16; the signed type only tells the formats apart).


def _widen(bits):  # pragma: no cover - a stub that only numba's overload below implements
    raise NotImplementedError


def _store(out, i, value):  # pragma: no cover - idem
    raise NotImplementedError


@njit(cache=True, error_model="numpy")
def _f16_to_f32(b):
    sign = (b & _U(0x8000)) << _U(16)
    e = (b >> _U(10)) & _U(0x1F)
    m = b & _U(0x3FF)
    sub = _f32_bits(np.float32(m) * _TWO_M24)  # subnormal halves are m * 2**-24, exact in fp32
    normal = ((e + _U(112)) << _U(23)) | (m << _U(13))
    special = _U(0x7F800000) | (m << _U(13))
    r = special if e == _U(31) else (sub if e == _U(0) else normal)
    return _as_f32(r | sign)


@njit(cache=True, error_model="numpy")
def _f32_to_f16(value):
    u = _f32_bits(value)
    a = u & _U(0x7FFFFFFF)
    sign = (u >> _U(16)) & _U(0x8000)
    r = a - _U(0x38000000)  # rebias the exponent from 127 to 15 (normal range only)
    normal = (r + _U(0xFFF) + ((r >> _U(13)) & _U(1))) >> _U(13)
    # below 2**-14 the half is subnormal: its bits are |x| * 2**24 rounded to nearest even (exact
    # scaling by a power of two, then rint)
    sub = _U(np.rint(abs(value) * _TWO_P24)) if a < _U(0x38800000) else _U(0)
    r = normal if a >= _U(0x38800000) else sub
    r = _U(0x7C00) if a >= _U(0x477FF000) else r  # >= 65520 rounds to inf
    r = _U(0x7E00) if a > _U(0x7F800000) else r
    return r | sign


@njit(cache=True, error_model="numpy")
def _f32_to_bf16(value):
    u = _f32_bits(value)
    if (u & _U(0x7FFFFFFF)) > _U(0x7F800000):
        return _U(0x7FC0)  # the canonical NaN of torch's scalar conversion
    return (u + _U(0x7FFF) + ((u >> _U(16)) & _U(1))) >> _U(16)


@overload(_widen)
def _widen_impl(bits):
    """Raw bits to float32, exactly (fp16 and bf16 widen without rounding)."""
    if bits == types.uint32:
        return lambda bits: _as_f32(_U(bits))
    if bits == types.uint16:
        return lambda bits: _f16_to_f32(_U(bits))
    if bits == types.int16:
        return lambda bits: _as_f32((_U(bits) & _U(0xFFFF)) << _U(16))
    return None


@overload(_store)
def _store_impl(out, i, value):
    """out[i] = value (a float32), narrowed with round to nearest even to out's format."""
    if out.dtype == types.uint32:
        def impl(out, i, value):
            out[i] = _f32_bits(value)
    elif out.dtype == types.uint16:
        def impl(out, i, value):
            out[i] = _f32_to_f16(value)
    elif out.dtype == types.int16:
        def impl(out, i, value):
            out[i] = _f32_to_bf16(value)
    else:
        return None
    return impl


def _widen_like(bits, like):  # pragma: no cover - idem
    raise NotImplementedError


@overload(_widen_like)
def _widen_like_impl(bits, like):
    """Bits held in a uint64 to float32, in the format of the array ``like``."""
    if like.dtype == types.uint32:
        return lambda bits, like: _as_f32(bits)
    if like.dtype == types.uint16:
        return lambda bits, like: _f16_to_f32(bits)
    if like.dtype == types.int16:
        return lambda bits, like: _as_f32(bits << _U(16))
    return None


def _narrow_like(value, like):  # pragma: no cover - idem
    raise NotImplementedError


@overload(_narrow_like)
def _narrow_like_impl(value, like):
    """The bits of float32 ``value`` in the format of the array ``like`` (uint64)."""
    if like.dtype == types.uint32:
        return lambda value, like: _f32_bits(value)
    if like.dtype == types.uint16:
        return lambda value, like: _f32_to_f16(value)
    if like.dtype == types.int16:
        return lambda value, like: _f32_to_bf16(value)
    return None


@njit(cache=True, error_model="numpy")
def _fmix32(h):
    # uint32 arithmetic with explicit truncation: LLVM then vectorises 16 lanes of 32-bit
    # multiplies instead of 8 lanes of 64-bit ones (1.7x on the whole quantize loop)
    h = _W(h)
    h = _W(h ^ (h >> _W(16)))
    h = _W(h * _W(0x85EBCA6B))
    h = _W(h ^ (h >> _W(13)))
    h = _W(h * _W(0xC2B2AE35))
    return _W(h ^ (h >> _W(16)))


@njit(cache=True, error_model="numpy")
def _draw(iu, k):
    """u in [0, 1) for element ``iu`` given its per-element key ``k``."""
    return np.float32(np.int32(_fmix32(_W(iu) ^ _W(k)) >> _W(8))) * _TWO_M24


@njit(cache=True, error_model="numpy")
def _uniform(i, key):
    """u in [0, 1) for element ``i``: reference.hash_key's per-element draw."""
    iu = _U(i)
    hi = iu >> _U(32)
    k = _W(key) if hi == _U(0) else _fmix32(_W(key) ^ _W(hi))
    return _draw(iu, k)


@njit(cache=True, error_model="numpy")
def _round(v, u, q, stochastic):
    f = np.floor(v + u) if stochastic else np.rint(v)
    f = q if f > q else f
    f = -q if f < -q else f
    return np.int32(np.float32(0.0) if v != v else f)


@njit(cache=True, error_model="numpy")
def _codes(xbits, lo, hi, scale, q, stochastic, key, codes):
    """int8 codes of elements [lo, hi) of one block; one loop per case, so that each vectorises."""
    base = _U(lo)
    zero = np.float32(0.0)
    if (lo >> 32) != ((hi - 1) >> 32):
        # a block that straddles a multiple of 2**32 elements: per-element keys
        for j in range(hi - lo):
            iu = base + _U(j)
            codes[iu] = _round(_widen(xbits[iu]) / scale, _uniform(iu, key), q, stochastic)
    elif stochastic:
        hi32 = base >> _U(32)
        k = _W(key) if hi32 == _U(0) else _fmix32(_W(key) ^ _W(hi32))
        for j in range(hi - lo):
            iu = base + _U(j)
            codes[iu] = _round(_widen(xbits[iu]) / scale, _draw(iu, k), q, True)
    else:
        for j in range(hi - lo):
            iu = base + _U(j)
            codes[iu] = _round(_widen(xbits[iu]) / scale, zero, q, False)


# ---------------------------------------------------------------------------------------------------
# kernels. Hot loops index arrays with unsigned integers: numba then omits the negative-index
# wraparound check, which otherwise blocks vectorisation (a 10x difference on simple loops).


@njit(cache=True, error_model="numpy")
def _copy_bytes(dst_addr, src_addr, nbytes):
    # libc's memcpy (rep movsb on some CPUs) runs at half speed when source and destination are
    # misaligned relative to each other (chunks of an odd number of rows); a plain loop of unaligned
    # vector loads and stores does not care
    d = numba.carray(_byte_ptr(dst_addr), (nbytes,))
    s = numba.carray(_byte_ptr(src_addr), (nbytes,))
    for i in range(nbytes):
        d[_U(i)] = s[_U(i)]


@_Threaded
def _copy_segments(src, dst, nbytes, pad, chunk):
    nseg = src.shape[0]
    first = np.empty(nseg + 1, np.int64)
    first[0] = 0
    for s in range(nseg):
        first[s + 1] = first[s] + (nbytes[s] + pad[s] + chunk - 1) // chunk
    for t in prange(first[nseg]):
        s = np.searchsorted(first, t, side="right") - 1
        lo = (t - first[s]) * chunk
        hi = min(lo + chunk, nbytes[s] + pad[s])
        n = nbytes[s]
        if lo < n:
            if (dst[s] - src[s]) & 63 == 0:
                _memcpy(dst[s] + lo, src[s] + lo, min(hi, n) - lo)
            else:
                _copy_bytes(dst[s] + lo, src[s] + lo, min(hi, n) - lo)
        if hi > n:
            start = max(lo, n)
            _memzero(dst[s] + start, hi - start)


@_Threaded
def _pack_signs(xbits, shift, out, chunk):
    n = xbits.shape[0]
    nw = out.shape[0]
    sh = _U(shift)
    for c in prange((nw + chunk - 1) // chunk):
        for w in range(c * chunk, min(nw, (c + 1) * chunk)):
            base = _U(w) * _U(32)
            acc = _U(0)
            if base + _U(32) <= _U(n):
                for j in range(32):
                    acc |= ((_U(xbits[base + _U(j)]) >> sh) ^ _U(1)) << _U(j)
            else:
                for j in range(n - w * 32):
                    acc |= ((_U(xbits[base + _U(j)]) >> sh) ^ _U(1)) << _U(j)
            out[_U(w)] = acc


@_Threaded
def _abs_mean(xbits, block, out):
    n = xbits.shape[0]
    for b in prange(out.shape[0]):
        lo = b * block
        hi = min(lo + block, n)
        # four partial sums break the fp64 add latency chain; fp64 keeps the mean exact to well
        # below fp32 resolution whatever the order
        s0 = s1 = s2 = s3 = 0.0
        i = _U(lo)
        while i + _U(4) <= _U(hi):
            s0 += abs(np.float64(_widen(xbits[i])))
            s1 += abs(np.float64(_widen(xbits[i + _U(1)])))
            s2 += abs(np.float64(_widen(xbits[i + _U(2)])))
            s3 += abs(np.float64(_widen(xbits[i + _U(3)])))
            i += _U(4)
        while i < _U(hi):
            s0 += abs(np.float64(_widen(xbits[i])))
            i += _U(1)
        out[b] = np.float32(((s0 + s1) + (s2 + s3)) / (hi - lo))


@_Threaded
def _unpack_signs(bits, scales, block, out, chunk):
    # word by word (chunk is a multiple of 32): +s is narrowed once per scale block and -s is the
    # same bits with the sign bit set (narrowing is symmetric), so a word inside one block is a
    # fixed 32-iteration loop of integer operations that vectorises
    n = out.shape[0]
    sign = _U(8 * out.itemsize - 1)
    for c in prange((n + chunk - 1) // chunk):
        lo = c * chunk
        end = min(lo + chunk, n)
        b = lo // block
        bound = (b + 1) * block
        pos = _narrow_like(scales[b], out)
        for w in range(lo // 32, (end + 31) // 32):
            base = w * 32
            m = min(32, end - base)
            word = _U(bits[_U(w)]) ^ _U(0xFFFFFFFF)  # set bit = negative
            if base >= bound:
                b = base // block
                bound = (b + 1) * block
                pos = _narrow_like(scales[b], out)
            if m == 32 and base + 32 <= bound:
                for j in range(32):
                    out[_U(base) + _U(j)] = pos ^ (((word >> _U(j)) & _U(1)) << sign)
            else:
                for j in range(m):
                    if base + j >= bound:
                        b += 1
                        bound += block
                        pos = _narrow_like(scales[b], out)
                    out[_U(base) + _U(j)] = pos ^ (((word >> _U(j)) & _U(1)) << sign)


@_Threaded
def _quantize(xbits, absmask, block, qmax, stochastic, key, codes, scales):
    n = xbits.shape[0]
    q = np.float32(qmax)
    for b in prange(scales.shape[0]):
        lo = b * block
        hi = min(lo + block, n)
        m = _U(0)
        for j in range(hi - lo):
            m = max(m, _U(xbits[_U(lo) + _U(j)]) & absmask)
        scale = _widen_like(m, xbits) / q
        scales[b] = scale
        _codes(xbits, lo, hi, scale, q, stochastic, key, codes)


@_Threaded
def _pack_nibbles(codes, out, chunk):
    """int4 packing of int8 codes: element 2j in the low nibble of byte j (a second, vectorised
    pass; computing pairs in the quantize loop itself defeats the vectoriser)."""
    n = codes.shape[0]
    nb = out.shape[0]
    full = n // 2
    for c in prange((nb + chunk - 1) // chunk):
        lo = c * chunk
        hi = min(lo + chunk, full)
        for j in range(max(hi - lo, 0)):
            p = _U(lo) + _U(j)
            out[p] = (codes[p * _U(2)] & 15) | ((codes[p * _U(2) + _U(1)] & 15) << 4)
    if n % 2:
        out[nb - 1] = codes[n - 1] & 15


@_Threaded
def _dequantize(codes, scales, block, int4, out, chunk):
    n = out.shape[0]
    for c in prange((n + chunk - 1) // chunk):
        lo = c * chunk
        end = min(lo + chunk, n)
        while lo < end:
            b = lo // block
            hi = min(end, (b + 1) * block)
            s = scales[b]
            if int4:
                for j in range(hi - lo):
                    iu = _U(lo) + _U(j)
                    nib = (np.int32(codes[iu >> _U(1)]) >> np.int32((iu & _U(1)) * _U(4))) & 15
                    _store(out, iu, np.float32(nib - 16 if nib >= 8 else nib) * s)
            else:
                for j in range(hi - lo):
                    iu = _U(lo) + _U(j)
                    _store(out, iu, np.float32(np.int8(codes[iu])) * s)
            lo = hi


@njit(cache=True, error_model="numpy")
def _kth_bin(hist, k):
    """The bin holding the k-th largest key, and how many keys lie in higher bins."""
    above = 0
    for b in range(hist.shape[0] - 1, -1, -1):
        if above + hist[b] >= k:
            return b, above
        above += hist[b]
    return 0, above


@_Threaded
def _topk_select(xbits, absmask, wide, k, ntask, values, indices):
    n = xbits.shape[0]
    per = (n + ntask - 1) // ntask
    # (1) histogram of the top 16 bits of |x|; (2) for fp32, of the low 16 bits inside the bin that
    # holds the k-th largest; this pins the threshold key exactly
    hist = np.zeros((ntask, 65536), np.int64)
    top = _U(16) if wide else _U(0)
    for t in prange(ntask):
        for i in range(t * per, min(n, (t + 1) * per)):
            hist[t, (_U(xbits[_U(i)]) & absmask) >> top] += 1
    b, above = _kth_bin(hist.sum(axis=0), k)
    threshold = _U(b) << top
    if wide:
        hist[:, :] = 0
        for t in prange(ntask):
            for i in range(t * per, min(n, (t + 1) * per)):
                key = _U(xbits[_U(i)]) & absmask
                if key >> _U(16) == _U(b):
                    hist[t, key & _U(0xFFFF)] += 1
        low, above2 = _kth_bin(hist.sum(axis=0), k - above)
        threshold |= _U(low)
        above += above2
    need = k - above  # ties at the threshold to take, lowest index first
    # (3) count, then (4) write in index order: an element's slot is the number of selected
    # elements before it
    gt = np.zeros(ntask + 1, np.int64)
    eq = np.zeros(ntask + 1, np.int64)
    for t in prange(ntask):
        g = 0
        e = 0
        for i in range(t * per, min(n, (t + 1) * per)):
            key = _U(xbits[_U(i)]) & absmask
            if key > threshold:
                g += 1
            elif key == threshold:
                e += 1
        gt[t + 1] = g
        eq[t + 1] = e
    gt = np.cumsum(gt)
    eq = np.cumsum(eq)
    for t in prange(ntask):
        g = gt[t]
        e = eq[t]
        for i in range(t * per, min(n, (t + 1) * per)):
            key = _U(xbits[_U(i)]) & absmask
            if key > threshold:
                slot = g + min(e, need)
                values[_U(slot)] = xbits[_U(i)]
                indices[_U(slot)] = i
                g += 1
            elif key == threshold:
                if e < need:
                    values[_U(g + e)] = xbits[_U(i)]
                    indices[_U(g + e)] = i
                e += 1


@_Threaded
def _scatter_add(vbits, indices, out):
    n = out.shape[0]
    bad = 0
    for j in prange(indices.shape[0]):
        i = indices[_U(j)]
        if i < 0 or i >= n:
            bad += 1
        else:
            out[i] += _widen(vbits[_U(j)])
    return bad


# ---------------------------------------------------------------------------------------------------
# wrappers: numpy views, segment tables, fallbacks


def _run(kernel: _Threaded, work: int, *args):
    """Launch ``kernel`` with at most as many threads as torch's intra-op setting; below
    ``_SERIAL_BELOW`` units of work, or with one thread allowed, its serial build on this thread.

    Distributed launchers give each rank its share of the cores through torch's setting (torchrun
    sets ``OMP_NUM_THREADS=1``; commopt's launcher ``torch.set_num_threads``); numba's pool would
    otherwise run one OpenMP thread per core in every rank. Waking the other threads also costs tens
    of microseconds on an idle machine, far more than a small kernel's work.
    """
    allowed = torch.get_num_threads()
    if work < _SERIAL_BELOW or allowed == 1:
        # Before asking numba anything: numba.get_num_threads() starts its thread pool.
        return kernel.serial(*args)
    previous = numba.get_num_threads()
    want = min(previous, allowed)
    if want == previous:
        return kernel.parallel(*args)
    numba.set_num_threads(want)  # per calling thread in numba
    try:
        return kernel.parallel(*args)
    finally:
        numba.set_num_threads(previous)


def _empty(numel: int, dtype: torch.dtype) -> torch.Tensor:
    """Every output this module allocates; the tests poison it to prove every element is written."""
    return torch.empty(numel, dtype=dtype)


def _bits(t: torch.Tensor) -> np.ndarray:
    """The view that carries ``t``'s format: uint32 (fp32), uint16 (fp16) or int16 (bf16) bits."""
    t = t.detach()  # .numpy() refuses tensors that require grad; the kernels never differentiate
    if t.dtype == torch.float16:
        return t.view(torch.int16).numpy().view(np.uint16)
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy()
    return t.view(torch.int32).numpy().view(np.uint32)


def _raw(t: torch.Tensor) -> np.ndarray:
    """Unsigned bits of a 16- or 32-bit tensor, for kernels that only move or compare bits."""
    t = t.detach()
    if t.element_size() == 2:
        return t.view(torch.int16).numpy().view(np.uint16)
    return t.view(torch.int32).numpy().view(np.uint32)


def _run_segments(segments: list[tuple[int, int, int, int]]) -> None:
    # a tensor that already is a view at its place in the buffer (DDP's gradient_as_bucket_view)
    # needs no copy, only its padding
    segments = [(0, d + n, 0, p) if s == d else (s, d, n, p) for s, d, n, p in segments]
    segments = [seg for seg in segments if seg[2] + seg[3] > 0]
    if segments:
        table = np.array(segments, dtype=np.int64).reshape(-1, 4)
        _run(_copy_segments, int(table[:, 2:].sum()) // 4, table[:, 0].copy(), table[:, 1].copy(),
             table[:, 2].copy(), table[:, 3].copy(), _COPY_CHUNK)


def flatten(tensors: Sequence[torch.Tensor], out: torch.Tensor, offsets: Sequence[int]) -> None:
    _run_segments(reference.flatten_segments(tensors, out, offsets))


def unflatten(buffer: torch.Tensor, tensors: Sequence[torch.Tensor], offsets: Sequence[int]) -> None:
    _run_segments(reference.unflatten_segments(buffer, tensors, offsets))


def pack_signs(x: torch.Tensor, block: int | None) -> tuple[torch.Tensor, torch.Tensor | None]:
    if x.dtype not in _KIND:
        return reference.pack_signs(x, block)
    n = x.numel()
    bits = _empty(-(-n // 32), torch.uint32)
    _run(_pack_signs, n, _raw(x), 8 * x.element_size() - 1, bits.view(torch.int32).numpy().view(np.uint32),
         _ELEM_CHUNK // 32)
    if block is None:
        return bits, None
    scales = _empty(-(-n // block), torch.float32)
    _run(_abs_mean, n, _bits(x), block, scales.numpy())
    return bits, scales


def unpack_signs(
    bits: torch.Tensor,
    numel: int,
    scales: torch.Tensor | None,
    block: int | None,
    dtype: torch.dtype,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    if dtype not in _KIND:
        return reference.unpack_signs(bits, numel, scales, block, dtype, out)
    out = _empty(numel, dtype) if out is None else out
    if scales is None:
        s, block = np.ones(1, np.float32), max(numel, 1)
    else:
        s = scales.numpy()
    _run(_unpack_signs, numel, bits.view(torch.int32).numpy().view(np.uint32), s, block, _bits(out), _ELEM_CHUNK)
    return out


def quantize(
    x: torch.Tensor, bits: int, block: int, seed: int, step: int, stochastic: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    if x.dtype not in _KIND:
        return reference.quantize(x, bits, block, seed, step, stochastic)
    n = x.numel()
    scales = _empty(-(-n // block), torch.float32)
    absmask = 0x7FFF if x.element_size() == 2 else 0x7FFFFFFF
    codes = _empty(n, torch.int8)
    _run(_quantize, n, _bits(x), _U(absmask), block, (1 << (bits - 1)) - 1, stochastic, _U(hash_key(seed, step)),
         codes.view(torch.uint8).numpy(), scales.numpy())
    if bits == 8:
        return codes, scales
    packed = _empty(-(-n // 2), torch.uint8)
    _run(_pack_nibbles, n, codes.view(torch.uint8).numpy(), packed.numpy(), _ELEM_CHUNK)
    return packed, scales


def dequantize(
    codes: torch.Tensor,
    scales: torch.Tensor,
    numel: int,
    bits: int,
    block: int,
    dtype: torch.dtype,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    if dtype not in _KIND:
        return reference.dequantize(codes, scales, numel, bits, block, dtype, out)
    out = _empty(numel, dtype) if out is None else out
    _run(_dequantize, numel, codes.view(torch.uint8).numpy(), scales.numpy(), block, bits == 4, _bits(out),
         _ELEM_CHUNK)
    return out


def topk_pack(x: torch.Tensor, k: int) -> torch.Tensor:
    if x.dtype not in _KIND:
        return reference.topk_pack(x, k)
    n = x.numel()
    size = x.element_size()
    values_at, indices_at, total = topk_layout(k, size)
    payload = _empty(total, torch.uint8)
    payload[:8].view(torch.int32).copy_(torch.tensor([k, DTYPE_CODES[x.dtype]], dtype=torch.int32))
    payload[values_at + k * size : indices_at] = 0
    if k:
        values = payload[values_at : values_at + k * size]
        indices = payload[indices_at:].view(torch.int32).numpy()
        ntask = max(1, min(torch.get_num_threads(), n >> 16))  # numba.get_num_threads() starts its pool
        wide = size == 4
        _run(_topk_select, n, _raw(x), _U(0x7FFFFFFF if wide else 0x7FFF), wide, k, ntask,
             _raw(values.view(x.dtype)), indices)
    return payload


def scatter_add_unpack(
    payloads: Sequence[torch.Tensor],
    numel: int,
    dtype: torch.dtype,
    value_dtype: torch.dtype,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    if value_dtype not in _KIND or dtype == torch.float64:
        return reference.scatter_add_unpack(payloads, numel, dtype, value_dtype, out)
    result = out
    if out is not None and dtype == torch.float32:
        out.zero_()  # accumulate straight into the caller's fp32 buffer
    else:
        out = torch.zeros(numel, dtype=torch.float32)
    o = out.numpy()
    for i, p in enumerate(payloads):
        k, vdtype = reference.parse_topk(p, value_dtype, i)
        if not k:
            continue
        values_at, indices_at, _ = topk_layout(k, vdtype.itemsize)
        values = p[values_at : values_at + k * vdtype.itemsize].view(vdtype)
        indices = p[indices_at:].view(torch.int32).numpy()
        if _run(_scatter_add, k, _bits(values), indices, o):
            raise ValueError(
                f"payloads[{i}] has indices outside [0, {numel}); pass the numel of the tensor "
                "topk_pack was called on"
            )
    if result is None:
        return out if dtype == torch.float32 else out.to(dtype)
    return result if result is out else result.copy_(out)


def permute_chunks(
    x: torch.Tensor, splits: Sequence[int], order: Sequence[int], out: torch.Tensor
) -> torch.Tensor:
    if x.is_conj() or x.is_neg():
        return reference.permute_chunks(x, splits, order, out)
    row = (x.numel() // x.shape[0] if x.shape[0] else 0) * x.element_size()
    starts = np.concatenate([[0], np.cumsum(splits)]).astype(np.int64)
    src, dst = x.data_ptr(), out.data_ptr()
    segments = []
    at = 0
    for o in order:
        rows = splits[o]
        if rows:
            segments.append((src + int(starts[o]) * row, dst + at * row, rows * row, 0))
        at += rows
    _run_segments(segments)
    return out
