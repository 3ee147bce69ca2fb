"""The torch reference of every kernel: the definition of correct.

Every other backend (``cpu.py``, ``cuda.py``) must produce exactly what these functions produce:
bit for bit for packing, rounding and copies, and to floating-point reassociation only for the
per-block means of :func:`pack_signs` scales (accumulated in fp64, rounded once to fp32). The shared
definitions that make this possible live here too: the counter-based hash of stochastic rounding,
the top-k payload layout, the flatten offsets.

The functions of this module take arguments already validated by :mod:`commopt.kernels` (flat
contiguous inputs, allocated outputs); call the public functions there, not these.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

__all__ = [
    "MASK32",
    "TOPK_HEADER_BYTES",
    "DTYPE_CODES",
    "CODE_DTYPES",
    "fmix32",
    "hash_key",
    "flatten_offsets",
    "topk_layout",
    "topk_k",
    "flatten",
    "unflatten",
    "pack_signs",
    "unpack_signs",
    "quantize",
    "dequantize",
    "topk_pack",
    "parse_topk",
    "scatter_add_unpack",
    "permute_chunks",
]

MASK32 = 0xFFFFFFFF
_GOLDEN = 0x9E3779B9
_M1 = 0x85EBCA6B
_M2 = 0xC2B2AE35

#: Payload header of :func:`topk_pack`: uint32 k, uint32 dtype code (little-endian).
TOPK_HEADER_BYTES = 8
DTYPE_CODES = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2, torch.float64: 3}
CODE_DTYPES = {code: dtype for dtype, code in DTYPE_CODES.items()}


# ---------------------------------------------------------------------------------------------------
# shared definitions


def fmix32(h: int) -> int:
    """MurmurHash3's 32-bit finaliser on a Python int (the host side of the hash)."""
    h &= MASK32
    h ^= h >> 16
    h = (h * _M1) & MASK32
    h ^= h >> 13
    h = (h * _M2) & MASK32
    h ^= h >> 16
    return h


def hash_key(seed: int, step: int) -> int:
    """The 32-bit key of stochastic rounding for one (seed, step), computed once on the host.

    Element ``i`` then draws ``h = fmix32((i mod 2**32) ^ k_i)`` with ``k_i = key`` for
    ``i < 2**32`` and ``fmix32(key ^ (i >> 32))`` beyond, and ``u = (h >> 8) * 2**-24`` in [0, 1).
    Every backend evaluates exactly this, so all ranks and all devices round identically.
    """
    fold = lambda v: (v ^ (v >> 32)) & MASK32
    return fmix32(fold(seed) ^ fmix32((fold(step) + _GOLDEN) & MASK32))


def flatten_offsets(numels: Sequence[int], align: int) -> list[int]:
    """Start offsets (in elements) of each tensor in a flatten buffer, plus the padded total."""
    offsets = [0]
    for n in numels:
        offsets.append(-(-(offsets[-1] + n) // align) * align)
    return offsets


def topk_layout(k: int, itemsize: int) -> tuple[int, int, int]:
    """Byte offsets of the values and the indices in a top-k payload, and its total size.

    Values come first, right after the 8-byte header, so that they are aligned for every dtype
    (up to fp64); the int32 indices follow at the next multiple of 4 bytes.
    """
    values_at = TOPK_HEADER_BYTES
    indices_at = values_at + -(-k * itemsize // 4) * 4
    return values_at, indices_at, indices_at + 4 * k


def topk_k(nbytes: int, itemsize: int) -> int:
    """``k`` of a top-k payload of ``nbytes`` bytes holding ``itemsize``-byte values (-1 if none)."""
    body = nbytes - TOPK_HEADER_BYTES
    if body < 0:
        return -1
    # the size 4 * ceil(k * s / 4) + 4 k grows with k: solve without the padding, then look nearby
    k = body // (itemsize + 4)
    for cand in (k, k - 1, k + 1):
        if cand >= 0 and topk_layout(cand, itemsize)[2] == nbytes:
            return cand
    return -1


def _fmix32_t(h: torch.Tensor) -> torch.Tensor:
    """fmix32 on an int64 tensor holding uint32 values.

    torch lacks uint32 arithmetic, and an int64 product of two 32-bit numbers can exceed 2**63
    (signed overflow), so each multiply is split into 16-bit halves whose partial products stay
    below 2**49; the low 32 bits are then exact.
    """

    def mul(a: torch.Tensor, m: int) -> torch.Tensor:
        lo = a * (m & 0xFFFF)
        hi = ((a * (m >> 16)) & 0xFFFF) << 16
        return (lo + hi) & MASK32

    h = h ^ (h >> 16)
    h = mul(h, _M1)
    h = h ^ (h >> 13)
    h = mul(h, _M2)
    return h ^ (h >> 16)


def _uniform(n: int, seed: int, step: int, device: torch.device) -> torch.Tensor:
    key = hash_key(seed, step)
    i = torch.arange(n, dtype=torch.int64, device=device)
    if n > 1 << 32:
        hi = i >> 32
        k = torch.where(hi == 0, torch.full_like(hi, key), _fmix32_t(hi ^ key))
    else:
        k = key
    h = _fmix32_t((i & MASK32) ^ k)
    return (h >> 8).to(torch.float32) * (2.0**-24)


def _into(result: torch.Tensor, out: torch.Tensor | None) -> torch.Tensor:
    if out is None:
        return result
    return out.copy_(result)


def _abs_bits(x: torch.Tensor) -> torch.Tensor:
    """|x| as ordered integer keys: IEEE magnitudes sort like their bit patterns, NaN above inf."""
    size = x.element_size()
    if size == 2:
        return x.view(torch.int16).to(torch.int64) & 0x7FFF
    if size == 4:
        return x.view(torch.int32).to(torch.int64) & 0x7FFFFFFF
    return x.view(torch.int64) & 0x7FFFFFFFFFFFFFFF


# ---------------------------------------------------------------------------------------------------
# kernels


@torch.no_grad()
def flatten(tensors: Sequence[torch.Tensor], out: torch.Tensor, offsets: Sequence[int]) -> None:
    """Copy ``tensors`` into ``out`` at ``offsets``; every other element of ``out`` becomes zero."""
    for t, start, end in zip(tensors, offsets, offsets[1:]):
        n = t.numel()
        out[start : start + n].view(t.shape).copy_(t)
        out[start + n : end].zero_()
    out[offsets[len(tensors)] :].zero_()


@torch.no_grad()
def unflatten(buffer: torch.Tensor, tensors: Sequence[torch.Tensor], offsets: Sequence[int]) -> None:
    """Copy the slices of ``buffer`` at ``offsets`` back into ``tensors`` (in place)."""
    for t, start in zip(tensors, offsets):
        t.copy_(buffer[start : start + t.numel()].view(t.shape))


def pack_signs(x: torch.Tensor, block: int | None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Sign bits (bit set = sign bit clear), 32 per uint32, LSB first; optional mean-|x| scales."""
    n = x.numel()
    words = -(-n // 32)
    positive = torch.zeros(words * 32, dtype=torch.int64, device=x.device)
    positive[:n] = ~torch.signbit(x)
    shifts = torch.arange(32, dtype=torch.int64, device=x.device)
    w = (positive.view(words, 32) << shifts).sum(1)
    w = torch.where(w >= 1 << 31, w - (1 << 32), w)
    bits = w.to(torch.int32).view(torch.uint32)
    if block is None:
        return bits, None
    nblocks = -(-n // block)
    a = torch.zeros(nblocks * block, dtype=torch.float64, device=x.device)
    a[:n] = x.abs()
    counts = torch.full((nblocks,), float(block), dtype=torch.float64, device=x.device)
    if nblocks:
        counts[-1] = n - (nblocks - 1) * block
    return bits, (a.view(nblocks, block).sum(1) / counts).to(torch.float32)


def unpack_signs(
    bits: torch.Tensor,
    numel: int,
    scales: torch.Tensor | None,
    block: int | None,
    dtype: torch.dtype,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """+1 / -1 (times the block's scale) per bit, computed in fp32 and rounded once to ``dtype``."""
    i = torch.arange(numel, dtype=torch.int64, device=bits.device)
    words = bits.view(torch.int32).to(torch.int64)
    bit = (words[i >> 5] >> (i & 31)) & 1
    one = torch.ones((), dtype=torch.float32, device=bits.device)
    v = torch.where(bit == 1, one, -one)
    if scales is not None:
        v = v * scales[i // block]
    return _into(v.to(dtype), out)


def quantize(
    x: torch.Tensor, bits: int, block: int, seed: int, step: int, stochastic: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric per-block quantisation; see :func:`commopt.kernels.quantize` for the contract."""
    qmax = (1 << (bits - 1)) - 1
    n = x.numel()
    nblocks = -(-n // block)
    xf = torch.zeros(nblocks * block, dtype=torch.float32, device=x.device)
    xf[:n] = x
    amax = xf.abs().view(nblocks, block).amax(1)
    # a tensor divisor, never a Python scalar: torch's CUDA division by a scalar multiplies by the
    # reciprocal, which is not the IEEE quotient the other backends compute
    scales = amax / torch.full_like(amax, float(qmax))
    v = (xf.view(nblocks, block) / scales[:, None]).reshape(-1)[:n]
    if stochastic:
        f = torch.floor(v + _uniform(n, seed, step, x.device))
    else:
        f = torch.round(v)  # half to even, like rint
    c = torch.where(torch.isnan(v), torch.zeros_like(v), f.clamp(-qmax, qmax)).to(torch.int64)
    if bits == 8:
        return c.to(torch.int8), scales
    pairs = torch.zeros(-(-n // 2) * 2, dtype=torch.int64, device=x.device)
    pairs[:n] = c & 0xF
    packed = pairs[0::2] | (pairs[1::2] << 4)
    return packed.to(torch.uint8), scales


def dequantize(
    codes: torch.Tensor,
    scales: torch.Tensor,
    numel: int,
    bits: int,
    block: int,
    dtype: torch.dtype,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """code * scale in fp32, rounded once to ``dtype``."""
    if bits == 8:
        c = codes.to(torch.float32)
    else:
        b = codes.to(torch.int64)
        nib = torch.stack([b & 0xF, b >> 4], dim=1).reshape(-1)[:numel]
        c = torch.where(nib >= 8, nib - 16, nib).to(torch.float32)
    i = torch.arange(numel, dtype=torch.int64, device=codes.device)
    return _into((c * scales[i // block]).to(dtype), out)


def topk_pack(x: torch.Tensor, k: int) -> torch.Tensor:
    """The ``k`` largest-magnitude elements (ties: lower index first; NaN counts as largest)."""
    n = x.numel()
    size = x.element_size()
    if k == n:
        idx = torch.arange(n, dtype=torch.int64, device=x.device)
    elif k == 0:
        idx = torch.zeros(0, dtype=torch.int64, device=x.device)
    else:
        key = _abs_bits(x)
        threshold = torch.kthvalue(key, n - k + 1).values
        above = (key > threshold).nonzero().flatten()
        ties = (key == threshold).nonzero().flatten()[: k - above.numel()]
        idx = torch.cat([above, ties]).sort().values
    values_at, indices_at, total = topk_layout(k, size)
    payload = torch.zeros(total, dtype=torch.uint8, device=x.device)
    header = torch.tensor([k, DTYPE_CODES[x.dtype]], dtype=torch.int32)
    payload[:TOPK_HEADER_BYTES] = header.view(torch.uint8).to(x.device)
    payload[values_at : values_at + k * size].view(x.dtype).copy_(x[idx])
    payload[indices_at:].view(torch.int32).copy_(idx.to(torch.int32))
    return payload


def parse_topk(payload: torch.Tensor, value_dtype: torch.dtype, i: int = 0) -> tuple[int, torch.dtype]:
    """Read and check a top-k payload header on the host; raises ``ValueError`` when malformed."""
    if payload.numel() < TOPK_HEADER_BYTES:
        raise ValueError(
            f"payloads[{i}] of {payload.numel()} bytes is shorter than its {TOPK_HEADER_BYTES}-byte "
            "header; pass the buffers returned by topk_pack"
        )
    k, code = payload[:TOPK_HEADER_BYTES].cpu().view(torch.int32).tolist()
    if code not in CODE_DTYPES or k < 0:
        raise ValueError(
            f"payloads[{i}] header (k={k}, dtype code={code}) is not one topk_pack writes; pass "
            "the buffers returned by topk_pack, unmodified"
        )
    dtype = CODE_DTYPES[code]
    if dtype != value_dtype:
        raise ValueError(
            f"payloads[{i}] holds {dtype} values but value_dtype is {value_dtype}; pass "
            f"value_dtype={dtype} (or dtype=) to scatter_add_unpack"
        )
    expected = topk_layout(k, dtype.itemsize)[2]
    if payload.numel() != expected:
        raise ValueError(
            f"payloads[{i}] holds {payload.numel()} bytes but its header (k={k}, {dtype}) needs "
            f"{expected}; pass the buffers returned by topk_pack, unmodified"
        )
    return k, dtype


def scatter_add_unpack(
    payloads: Sequence[torch.Tensor],
    numel: int,
    dtype: torch.dtype,
    value_dtype: torch.dtype,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Sum of all payloads' values at their indices, accumulated in payload order."""
    acc = torch.float64 if dtype == torch.float64 else torch.float32
    result = out
    out = torch.zeros(numel, dtype=acc, device=payloads[0].device)
    for i, p in enumerate(payloads):
        k, vdtype = parse_topk(p, value_dtype, i)
        values_at, indices_at, _ = topk_layout(k, vdtype.itemsize)
        idx = p[indices_at:].view(torch.int32).to(torch.int64)
        if k and (int(idx.min()) < 0 or int(idx.max()) >= numel):
            raise ValueError(
                f"top-k payload has indices in [{int(idx.min())}, {int(idx.max())}] outside "
                f"[0, {numel}); pass the numel of the tensor topk_pack was called on"
            )
        out.index_add_(0, idx, p[values_at : values_at + k * vdtype.itemsize].view(vdtype).to(acc))
    return _into(out.to(dtype), result)


def permute_chunks(
    x: torch.Tensor, splits: Sequence[int], order: Sequence[int], out: torch.Tensor
) -> torch.Tensor:
    """Chunks of ``x`` along dim 0, concatenated in ``order`` into ``out``."""
    chunks = torch.split(x, list(splits), dim=0)
    torch.cat([chunks[o] for o in order], dim=0, out=out)
    return out


# ---------------------------------------------------------------------------------------------------
# segment tables, shared by the numba and CUDA backends' one-pass copies


Segment = tuple  # (source address, destination address, bytes to copy, bytes to zero after it)


def plain(t: torch.Tensor) -> bool:
    """Whether ``t``'s raw memory is its value in row-major order (no lazy conj / neg views)."""
    return t.is_contiguous() and not t.is_conj() and not t.is_neg()


@torch.no_grad()
def flatten_segments(tensors: Sequence[torch.Tensor], out: torch.Tensor, offsets: Sequence[int]) -> list[Segment]:
    """The copies and zero-fills of :func:`flatten` as one segment table.

    Strided (or lazily conjugated) tensors are copied here by torch, which walks their strides; their
    padding still goes through the table.
    """
    size = out.element_size()
    base = out.data_ptr()
    segments = []
    for t, start, end in zip(tensors, offsets, offsets[1:]):
        n = t.numel()
        if n and not plain(t):
            out[start : start + n].view(t.shape).copy_(t)
            segments.append((0, base + (start + n) * size, 0, (end - start - n) * size))
        else:
            segments.append((t.data_ptr() if n else 0, base + start * size, n * size, (end - start - n) * size))
    tail = out.numel() - offsets[len(tensors)]
    if tail:
        segments.append((0, base + offsets[len(tensors)] * size, 0, tail * size))
    return segments


@torch.no_grad()
def unflatten_segments(buffer: torch.Tensor, tensors: Sequence[torch.Tensor], offsets: Sequence[int]) -> list[Segment]:
    """The copies of :func:`unflatten` as one segment table (strided destinations copied by torch)."""
    size = buffer.element_size()
    base = buffer.data_ptr()
    segments = []
    for t, start in zip(tensors, offsets):
        n = t.numel()
        if not n:
            continue
        if plain(t):
            segments.append((base + start * size, t.data_ptr(), n * size, 0))
        else:
            t.copy_(buffer[start : start + n].view(t.shape))
    return segments
