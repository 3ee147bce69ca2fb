"""commopt.kernels: bucketing and packing kernels (torch reference, numba CPU, CuPy CUDA).

Compression and the 2-D all-to-all spend their time packing, not sending, unless packing runs near
memory bandwidth. Each operation is one public function with one signature; it validates its
arguments here, once, and then runs on a backend:

- ``"reference"``: plain torch (:mod:`.reference`), the definition of correct;
- ``"cpu"``: numba kernels (:mod:`.cpu`), zero-copy through numpy views;
- ``"cuda"``: CuPy ``RawModule`` kernels (:mod:`.cuda`) on torch's current stream.

Dispatch (``backend=None``): a CUDA tensor goes to ``"cuda"`` when CuPy works, else to
``"reference"``; a CPU tensor goes to ``"cpu"`` when numba imports, else to ``"reference"``; any other
device to ``"reference"``. ``backend=`` forces one; forcing a backend that cannot run the tensor's
device, or whose dependency is missing, is a ``ValueError`` that says why. Every backend returns
bit-identical results (the one exception, documented at :func:`pack_signs`, is a per-block mean).

Kernels raise only ``ValueError`` / ``TypeError``, for bad arguments. They compute; they do not police
finiteness (that is ``commopt.comm``'s policy): each function documents what NaN and Inf produce.
"""

from __future__ import annotations

import importlib
from collections.abc import Sequence
from types import ModuleType
from typing import Union

import torch

from ._optional import CUPY, NUMBA
from .reference import flatten_offsets, topk_k, topk_layout

__all__ = [
    "BACKENDS",
    "available_backends",
    "flatten",
    "unflatten",
    "pack_signs",
    "unpack_signs",
    "quantize",
    "dequantize",
    "topk_pack",
    "scatter_add_unpack",
    "topk_k",
    "topk_layout",
    "permute_chunks",
]

BACKENDS = ("reference", "cpu", "cuda")
_FLOATS = (torch.float32, torch.float16, torch.bfloat16, torch.float64)

Payloads = Union[torch.Tensor, Sequence[torch.Tensor]]


# ---------------------------------------------------------------------------------------------------
# dispatch


def available_backends() -> dict[str, str | None]:
    """Each backend mapped to ``None`` when it can run here, else the reason it cannot."""
    return {"reference": None, "cpu": NUMBA.error, "cuda": CUPY.error}


def _impl(op: str, device: torch.device, backend: str | None) -> ModuleType:
    if backend is None:
        if device.type == "cuda" and CUPY.available:
            backend = "cuda"
        elif device.type == "cpu" and NUMBA.available:
            backend = "cpu"
        else:
            backend = "reference"
    elif backend not in BACKENDS:
        raise ValueError(f"{op}: backend={backend!r} is not one of {BACKENDS} (or None to dispatch)")
    elif backend != "reference":
        if device.type != backend:
            raise ValueError(
                f"{op}: backend={backend!r} cannot run tensors on {device}; move them to "
                f"{backend!r}, or pass backend=None to dispatch on the device"
            )
        gate = NUMBA if backend == "cpu" else CUPY
        if not gate.available:
            raise ValueError(
                f"{op}: backend={backend!r} is unavailable ({gate.error}); install "
                f"{'numba' if backend == 'cpu' else 'cupy-cuda12x or cupy-cuda13x'} or pass "
                "backend='reference'"
            )
    return importlib.import_module(f"{__name__}.{backend}")


# ---------------------------------------------------------------------------------------------------
# argument checks (shared by every backend so that errors are the same everywhere)


def _tensor(op: str, name: str, t: object) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{op}: {name} must be a torch.Tensor, got {type(t).__name__}")
    if t.layout != torch.strided:
        raise TypeError(f"{op}: {name} has layout {t.layout}; pass a dense tensor (.to_dense())")
    return t


def _int(op: str, name: str, v: object, low: int, high: int | None = None) -> int:
    if isinstance(v, bool) or not isinstance(v, int):
        raise TypeError(f"{op}: {name} must be an int, got {type(v).__name__}")
    if v < low or (high is not None and v >= high):
        bound = f">= {low}" if high is None else f"in [{low}, {high})"
        raise ValueError(f"{op}: {name}={v} must be {bound}")
    return v


def _floating(op: str, name: str, dtype: object, allowed: Sequence[torch.dtype] = _FLOATS) -> torch.dtype:
    if not isinstance(dtype, torch.dtype) or dtype not in allowed:
        names = ", ".join(str(d) for d in allowed)
        raise TypeError(f"{op}: {name} is {dtype}; supported: {names} (cast with .to())")
    return dtype


def _flat(x: torch.Tensor) -> torch.Tensor:
    """A flat contiguous view, copying only when ``x`` is not contiguous."""
    return x.reshape(-1) if x.is_contiguous() else x.contiguous().reshape(-1)


def _same(op: str, tensors: Sequence[torch.Tensor], dtype: torch.dtype, device: torch.device, what: str) -> None:
    dtypes = sorted({str(t.dtype) for t in tensors} | {str(dtype)})
    if len(dtypes) > 1:
        raise ValueError(
            f"{op}: {what} mix dtypes {dtypes}; one buffer holds one dtype, so group tensors by "
            "dtype (one call per dtype) or cast them"
        )
    devices = sorted({str(t.device) for t in tensors} | {str(device)})
    if len(devices) > 1:
        raise ValueError(f"{op}: {what} live on different devices {devices}; move them to one device")


def _buffer(op: str, name: str, t: object, dtype: torch.dtype, device: torch.device, numel: int) -> torch.Tensor:
    t = _tensor(op, name, t)
    if t.dtype != dtype or t.device != device:
        raise ValueError(f"{op}: {name} is {t.dtype} on {t.device}; expected {dtype} on {device}")
    if t.dim() != 1 or not t.is_contiguous():
        raise ValueError(f"{op}: {name} must be 1-D and contiguous, got shape {tuple(t.shape)}")
    if t.numel() < numel:
        raise ValueError(f"{op}: {name} holds {t.numel()} elements; it needs at least {numel}")
    return t


def _output(op: str, out: object, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor | None:
    """Check a caller's ``out`` (None lets the backend allocate)."""
    if out is None:
        return None
    out = _buffer(op, "out", out, dtype, device, numel)
    if out.numel() != numel:
        raise ValueError(f"{op}: out holds {out.numel()} elements; expected exactly {numel}")
    return out


# ---------------------------------------------------------------------------------------------------
# flatten / unflatten


def flatten(
    tensors: Sequence[torch.Tensor],
    out: torch.Tensor | None = None,
    *,
    align: int = 16,
    backend: str | None = None,
) -> tuple[torch.Tensor, list[int]]:
    """Copy many tensors into one 1-D buffer in one pass (a gradient bucket).

    Tensor ``i`` lands, flattened in row-major order, at ``buffer[offsets[i] : offsets[i] + numel_i]``.
    Each start offset is a multiple of ``align`` **elements** (not bytes), so with the default 16 every
    tensor starts 64-byte aligned in fp32 and 32-byte aligned in fp16 -- what vector loads and
    collectives that split the buffer want. ``offsets`` has ``len(tensors) + 1`` entries: the last is
    the padded total ``offsets[-1] = round_up(offsets[-2] + numel_last, align)``, the length of the
    buffer when ``out`` is None. A zero-element tensor takes no space (its offset equals the next
    one). Every element not covered by a tensor (padding between tensors, after the last one, and the
    tail of a larger ``out``) is set to zero, because collectives reduce over the whole buffer.

    Args:
        tensors: tensors of one dtype (any dtype, bool and complex included) on one device; any
            shapes, non-contiguous and zero-element tensors allowed.
        out: optional 1-D contiguous buffer of that dtype and device with at least ``offsets[-1]``
            elements; it is returned, fully written.
        align: alignment of each start offset, in elements (>= 1; 1 packs densely).
        backend: force ``"reference"``, ``"cpu"`` or ``"cuda"``; None dispatches on the device.

    Returns:
        ``(buffer, offsets)``.

    Raises:
        ValueError: mixed dtypes or devices, an ``out`` that is too small, of another dtype or not
            1-D contiguous, or no tensors and no ``out`` (the dtype would be unknown).
        TypeError: ``tensors`` is a single tensor or holds non-tensors.
    """
    op = "flatten"
    if isinstance(tensors, torch.Tensor) or not isinstance(tensors, Sequence):
        raise TypeError(f"{op}: tensors must be a list or tuple of tensors, got {type(tensors).__name__}")
    tensors = [_tensor(op, f"tensors[{i}]", t) for i, t in enumerate(tensors)]
    align = _int(op, "align", align, 1)
    if not tensors:
        if out is None:
            raise ValueError(f"{op}: no tensors and no out; the buffer's dtype is unknown, pass out=")
        out = _tensor(op, "out", out)
        _buffer(op, "out", out, out.dtype, out.device, 0).zero_()
        return out, [0]
    dtype, device = tensors[0].dtype, tensors[0].device
    _same(op, tensors, dtype, device, "tensors")
    offsets = flatten_offsets([t.numel() for t in tensors], align)
    if out is None:
        out = torch.empty(offsets[-1], dtype=dtype, device=device)
    else:
        out = _buffer(op, "out", out, dtype, device, offsets[-1])
    _impl(op, device, backend).flatten(tensors, out, offsets)
    return out, offsets


def unflatten(
    buffer: torch.Tensor,
    tensors: Sequence[torch.Tensor],
    offsets: Sequence[int] | None = None,
    *,
    align: int = 16,
    backend: str | None = None,
) -> None:
    """Copy slices of a flatten buffer back into ``tensors``, in place, in one pass.

    Tensor ``i`` receives ``buffer[offsets[i] : offsets[i] + numel_i]`` reshaped to its shape
    (non-contiguous destinations are written through their strides).

    Args:
        buffer: 1-D contiguous buffer of the tensors' dtype and device.
        tensors: destinations, one dtype and device.
        offsets: start offsets in elements, as returned by :func:`flatten` (``len(tensors)`` or
            ``len(tensors) + 1`` entries; a trailing total is ignored). None recomputes them from the
            tensors' sizes and ``align``, as :func:`flatten` did.
        align: used only when ``offsets`` is None; must match the one given to :func:`flatten`.
        backend: force a backend; None dispatches on the device.

    Raises:
        ValueError: mismatched dtypes or devices, offsets of the wrong length, or a slice that runs
            past the end of ``buffer``.
        TypeError: non-tensor arguments.
    """
    op = "unflatten"
    buffer = _tensor(op, "buffer", buffer)
    if isinstance(tensors, torch.Tensor) or not isinstance(tensors, Sequence):
        raise TypeError(f"{op}: tensors must be a list or tuple of tensors, got {type(tensors).__name__}")
    tensors = [_tensor(op, f"tensors[{i}]", t) for i, t in enumerate(tensors)]
    _buffer(op, "buffer", buffer, buffer.dtype, buffer.device, 0)
    _same(op, tensors, buffer.dtype, buffer.device, "buffer and tensors")
    if offsets is None:
        offsets = flatten_offsets([t.numel() for t in tensors], _int(op, "align", align, 1))
    else:
        offsets = [_int(op, f"offsets[{i}]", o, 0) for i, o in enumerate(offsets)]
        if len(offsets) not in (len(tensors), len(tensors) + 1):
            raise ValueError(
                f"{op}: {len(offsets)} offsets for {len(tensors)} tensors; pass the offsets flatten returned"
            )
    for i, t in enumerate(tensors):
        if offsets[i] + t.numel() > buffer.numel():
            raise ValueError(
                f"{op}: tensors[{i}] ({t.numel()} elements at offset {offsets[i]}) runs past the end of "
                f"buffer ({buffer.numel()} elements); pass the offsets and align flatten used"
            )
    if tensors:
        _impl(op, buffer.device, backend).unflatten(buffer, tensors, offsets[: len(tensors)])


# ---------------------------------------------------------------------------------------------------
# signs


def pack_signs(
    x: torch.Tensor, *, block: int | None = None, backend: str | None = None
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Pack the sign of every element into one bit (signSGD / 1-bit compression).

    Bit ``j`` of word ``w`` (LSB first) describes element ``32 * w + j`` of ``x`` flattened row-major:
    it is 1 when the element's sign bit is clear (+0.0, positive, +inf, or a NaN with clear sign bit)
    and 0 otherwise (-0.0 and negatives); reading the IEEE sign bit rather than comparing with zero
    makes the result identical on every backend and defined for NaN. Unused bits of the last word are
    0. With ``block``, each block of ``block`` consecutive elements also gets a scale, the mean of
    ``|x|`` over the block (the last block may be shorter and is averaged over its own length), so that
    ``unpack_signs`` restores the block's L1 norm (the EF-signSGD estimator). Means are accumulated in
    fp64 and rounded once to fp32, so backends agree to fp64 reassociation (in practice, exactly). A
    block holding NaN gets a NaN scale; one holding Inf (and no NaN), an Inf scale.

    Args:
        x: floating tensor (fp32, fp16, bf16, fp64), any shape; non-contiguous input is copied first.
        block: elements per scale, or None for no scales.
        backend: force a backend; None dispatches on the device.

    Returns:
        ``(bits, scales)``: uint32 tensor of ``ceil(numel / 32)`` words, and fp32 scales of
        ``ceil(numel / block)`` entries or None.
    """
    op = "pack_signs"
    x = _tensor(op, "x", x)
    _floating(op, "x.dtype", x.dtype)
    if block is not None:
        block = _int(op, "block", block, 1)
    return _impl(op, x.device, backend).pack_signs(_flat(x), block)


def unpack_signs(
    bits: torch.Tensor,
    numel: int,
    scales: torch.Tensor | None = None,
    *,
    block: int | None = None,
    dtype: torch.dtype = torch.float32,
    out: torch.Tensor | None = None,
    backend: str | None = None,
) -> torch.Tensor:
    """Expand packed sign bits back into +-1 (or +-scale) values.

    Element ``i`` is ``+s`` when its bit is set and ``-s`` otherwise, where ``s`` is 1 or
    ``scales[i // block]``, computed in fp32 and rounded once (to nearest even) to ``dtype``. A NaN or
    Inf scale yields NaN or +-Inf for its whole block.

    Args:
        bits: uint32 words from :func:`pack_signs` (exactly ``ceil(numel / 32)`` of them).
        numel: number of elements to produce.
        scales: fp32 per-block scales from :func:`pack_signs`, or None.
        block: the ``block`` given to :func:`pack_signs`; required when ``scales`` has more than one
            entry (it cannot be inferred: several block sizes give the same number of blocks).
        dtype: output dtype (fp32, fp16, bf16, fp64).
        out: optional 1-D contiguous result of ``numel`` elements of ``dtype`` (e.g. the gradient
            buffer itself, which also saves the page faults of a fresh allocation).
        backend: force a backend; None dispatches on the device.

    Returns:
        1-D tensor of ``numel`` elements on ``bits``' device (``out`` when given).
    """
    op = "unpack_signs"
    bits = _tensor(op, "bits", bits)
    numel = _int(op, "numel", numel, 0)
    _floating(op, "dtype", dtype)
    if bits.dtype != torch.uint32:
        raise TypeError(f"{op}: bits is {bits.dtype}; pass the uint32 words pack_signs returned")
    words = -(-numel // 32)
    if bits.numel() != words:
        raise ValueError(f"{op}: bits holds {bits.numel()} words; numel={numel} needs exactly {words}")
    if scales is not None:
        scales = _tensor(op, "scales", scales)
        if scales.dtype != torch.float32 or scales.device != bits.device:
            raise ValueError(
                f"{op}: scales is {scales.dtype} on {scales.device}; expected float32 on {bits.device}"
            )
        if block is None:
            if scales.numel() > 1:
                raise ValueError(
                    f"{op}: {scales.numel()} scales but no block; pass block= (the value given to pack_signs)"
                )
            block = max(numel, 1)
        block = _int(op, "block", block, 1)
        if scales.numel() != -(-numel // block):
            raise ValueError(
                f"{op}: {scales.numel()} scales but numel={numel} with block={block} needs "
                f"{-(-numel // block)}; pass the block given to pack_signs"
            )
        scales = _flat(scales)
    out = _output(op, out, numel, dtype, bits.device)
    return _impl(op, bits.device, backend).unpack_signs(_flat(bits), numel, scales, block, dtype, out)


# ---------------------------------------------------------------------------------------------------
# quantisation


def _check_quant(op: str, bits: int, block: int) -> tuple[int, int]:
    if isinstance(bits, bool) or bits not in (8, 4):
        raise ValueError(f"{op}: bits={bits!r}; supported: 8 (int8) and 4 (int4, two per byte)")
    block = _int(op, "block", block, 1)
    if bits == 4 and block % 2:
        raise ValueError(f"{op}: block={block} must be even for bits=4, so that no byte spans two blocks")
    return bits, block


def quantize(
    x: torch.Tensor,
    *,
    bits: int = 8,
    block: int = 256,
    seed: int = 0,
    step: int = 0,
    stochastic: bool = True,
    backend: str | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric per-block quantisation to int8 or int4 with shared, reproducible rounding.

    (1) per block of ``block`` consecutive elements (the last may be shorter):
    ``scale = max|x| / qmax`` in fp32, with ``qmax`` 127 (int8) or 7 (int4; -8 is never used, so the
    range is symmetric); (2) per element ``v = x / scale`` (IEEE fp32 division); (3) the code is
    ``floor(v + u)`` with ``u`` uniform in [0, 1) drawn from a counter-based hash of
    ``(seed, step, element index)`` (unbiased: ``E[code * scale] = x``), or ``rint(v)`` (half to even)
    when ``stochastic=False``; (4) the code is clamped to ``[-qmax, qmax]``. The hash
    (:func:`commopt.kernels.reference.hash_key`) is evaluated identically by every backend, so every
    rank and every device produce the same bits for the same seed and step: pass the training step so
    that rounding errors do not repeat, and the same seed on every rank.

    NaN and Inf: a block containing NaN gets a NaN scale, one containing Inf (no NaN) an Inf scale;
    wherever ``v`` is NaN (NaN input, Inf / Inf, 0 / 0 for an all-zero block) the code is 0. So an
    all-zero block has scale 0 and codes 0 (dequantizes to zeros), and a block with any NaN or Inf
    dequantizes to NaN everywhere (0 * NaN, 0 * Inf): non-finite input propagates to its block, never
    silently to zero.

    Args:
        x: floating tensor (fp32, fp16, bf16, fp64; computed in fp32), any shape.
        bits: 8 or 4.
        block: elements per scale (>= 1; even for int4).
        seed: seed shared by all ranks, in [0, 2**64).
        step: step counter, in [0, 2**64).
        stochastic: stochastic rounding (True) or round to nearest even (False).
        backend: force a backend; None dispatches on the device.

    Returns:
        ``(codes, scales)``: int8 codes of ``numel`` elements (bits=8) or uint8 of ``ceil(numel / 2)``
        bytes holding two's-complement nibbles, element ``2j`` in the low nibble of byte ``j``
        (bits=4; an unused high nibble is 0); fp32 scales of ``ceil(numel / block)`` entries.
    """
    op = "quantize"
    x = _tensor(op, "x", x)
    _floating(op, "x.dtype", x.dtype)
    bits, block = _check_quant(op, bits, block)
    seed = _int(op, "seed", seed, 0, 1 << 64)
    step = _int(op, "step", step, 0, 1 << 64)
    return _impl(op, x.device, backend).quantize(_flat(x), bits, block, seed, step, bool(stochastic))


def dequantize(
    codes: torch.Tensor,
    scales: torch.Tensor,
    numel: int,
    *,
    bits: int = 8,
    block: int = 256,
    dtype: torch.dtype = torch.float32,
    out: torch.Tensor | None = None,
    backend: str | None = None,
) -> torch.Tensor:
    """Inverse of :func:`quantize`: ``code * scale`` in fp32, rounded once to ``dtype``.

    Args:
        codes: int8 (bits=8, ``numel`` of them) or uint8 (bits=4, ``ceil(numel / 2)`` bytes).
        scales: fp32, ``ceil(numel / block)`` of them.
        numel: number of elements to produce.
        bits: 8 or 4, as given to :func:`quantize`.
        block: as given to :func:`quantize`.
        dtype: output dtype (fp32, fp16, bf16, fp64).
        out: optional 1-D contiguous result of ``numel`` elements of ``dtype``.
        backend: force a backend; None dispatches on the device.

    Returns:
        1-D tensor of ``numel`` elements (``out`` when given). NaN/Inf scales give NaN (code 0) or
        +-Inf for their block.
    """
    op = "dequantize"
    codes = _tensor(op, "codes", codes)
    scales = _tensor(op, "scales", scales)
    numel = _int(op, "numel", numel, 0)
    bits, block = _check_quant(op, bits, block)
    _floating(op, "dtype", dtype)
    want_dtype, want = (torch.int8, numel) if bits == 8 else (torch.uint8, -(-numel // 2))
    if codes.dtype != want_dtype:
        raise TypeError(f"{op}: codes is {codes.dtype}; bits={bits} codes are {want_dtype}")
    if codes.numel() != want:
        raise ValueError(f"{op}: codes holds {codes.numel()} elements; numel={numel} with bits={bits} needs {want}")
    nblocks = -(-numel // block)
    if scales.dtype != torch.float32 or scales.device != codes.device or scales.numel() != nblocks:
        raise ValueError(
            f"{op}: scales is {scales.numel()} x {scales.dtype} on {scales.device}; numel={numel} with "
            f"block={block} needs {nblocks} x float32 on {codes.device} (pass the block given to quantize)"
        )
    out = _output(op, out, numel, dtype, codes.device)
    return _impl(op, codes.device, backend).dequantize(_flat(codes), _flat(scales), numel, bits, block, dtype,
                                                       out)


# ---------------------------------------------------------------------------------------------------
# sparse


def topk_pack(x: torch.Tensor, k: int, *, backend: str | None = None) -> torch.Tensor:
    """Select the ``k`` largest-magnitude elements and pack them into one byte buffer.

    Selection is fully determined, so every backend picks the same set: elements are ranked by
    ``|x|`` (compared as IEEE magnitudes, NaN above Inf, so NaN is always sent rather than silently
    dropped), ties broken by lower index; the selected indices are stored in ascending order.

    Layout (little-endian), see :func:`commopt.kernels.reference.topk_layout`: bytes 0-3 ``k`` as
    uint32; bytes 4-7 the value dtype code (0 fp32, 1 fp16, 2 bf16, 3 fp64) as uint32; then the ``k``
    values in ``x``'s dtype from byte 8; zero padding to a multiple of 4 bytes; then ``k`` int32 indices
    into ``x`` flattened row-major. Total ``8 + round_up(k * itemsize, 4) + 4 * k`` bytes, known from
    ``k`` and the dtype alone, so payloads of equal ``k`` can be all-gathered without a size exchange.

    Args:
        x: floating tensor (fp32, fp16, bf16, fp64) of fewer than 2**31 elements, any shape.
        k: number of elements to keep, ``0 <= k <= numel``.
        backend: force a backend; None dispatches on the device.

    Returns:
        1-D uint8 tensor on ``x``'s device.
    """
    op = "topk_pack"
    x = _tensor(op, "x", x)
    _floating(op, "x.dtype", x.dtype)
    if x.numel() >= 1 << 31:
        raise ValueError(f"{op}: x has {x.numel()} elements; int32 indices address fewer than 2**31, split it")
    k = _int(op, "k", k, 0)
    if k > x.numel():
        raise ValueError(f"{op}: k={k} exceeds x.numel()={x.numel()}")
    return _impl(op, x.device, backend).topk_pack(_flat(x), k)


def scatter_add_unpack(
    payloads: Payloads,
    numel: int,
    *,
    dtype: torch.dtype = torch.float32,
    value_dtype: torch.dtype | None = None,
    out: torch.Tensor | None = None,
    backend: str | None = None,
) -> torch.Tensor:
    """Accumulate many top-k payloads (e.g. all-gathered from every rank) into one dense tensor.

    ``out[idx] += value`` for every (index, value) of every payload, in payload order, accumulated in
    fp32 (fp64 when ``dtype`` is fp64) and rounded once to ``dtype``; elements no payload names are 0.
    NaN and Inf values propagate to their index.

    Args:
        payloads: 1-D uint8 buffers from :func:`topk_pack`, or a 2-D uint8 tensor with one per row.
        numel: length of the dense output; every index must be below it.
        dtype: output dtype (fp32, fp16, bf16, fp64).
        value_dtype: dtype the payloads' values were packed in; None means ``dtype``. CPU backends
            check each header against it (``ValueError`` on a mismatch or an index out of range); the
            CUDA backend cannot read headers without a host synchronisation, so it derives ``k`` from
            the payload length and, on device, adds NaN at the indices of a payload whose header
            disagrees and skips indices out of range.
        out: optional 1-D contiguous result of ``numel`` elements of ``dtype``; it is overwritten
            (zeroed, then accumulated into), which spares a fresh allocation per call.
        backend: force a backend; None dispatches on the device.

    Returns:
        1-D tensor of ``numel`` elements on the payloads' device.
    """
    op = "scatter_add_unpack"
    numel = _int(op, "numel", numel, 0)
    _floating(op, "dtype", dtype)
    value_dtype = _floating(op, "value_dtype", dtype if value_dtype is None else value_dtype)
    if isinstance(payloads, torch.Tensor):
        _tensor(op, "payloads", payloads)
        if payloads.dim() != 2:
            raise ValueError(f"{op}: a payloads tensor must be 2-D (one payload per row), got {payloads.dim()}-D")
        payloads = list(payloads.contiguous().unbind(0))
    elif not isinstance(payloads, Sequence):
        raise TypeError(f"{op}: payloads must be a list of uint8 tensors or a 2-D uint8 tensor")
    payloads = [_tensor(op, f"payloads[{i}]", p) for i, p in enumerate(payloads)]
    if not payloads:
        if out is not None:
            return _output(op, out, numel, dtype, out.device).zero_()
        return torch.zeros(numel, dtype=dtype)
    device = payloads[0].device
    out = _output(op, out, numel, dtype, device)
    for i, p in enumerate(payloads):
        if p.dtype != torch.uint8 or p.dim() != 1 or p.device != device:
            raise ValueError(
                f"{op}: payloads[{i}] is {p.dim()}-D {p.dtype} on {p.device}; expected the 1-D uint8 "
                f"buffers of topk_pack, all on {device}"
            )
        if topk_k(p.numel(), value_dtype.itemsize) < 0:
            raise ValueError(
                f"{op}: payloads[{i}] has {p.numel()} bytes, which no k gives for {value_dtype} values; "
                "pass the buffers topk_pack returned and the dtype they were packed in (value_dtype=)"
            )
    # The payload's int32 header, values and indices are read through typed views, which need the
    # buffer to start 8-byte aligned; a payload sliced out of a larger buffer at any offset is copied.
    payloads = [p.contiguous() if p.storage_offset() % 8 == 0 else p.clone() for p in payloads]
    return _impl(op, device, backend).scatter_add_unpack(payloads, numel, dtype, value_dtype, out)


# ---------------------------------------------------------------------------------------------------
# permutation


def permute_chunks(
    x: torch.Tensor,
    splits: Sequence[int],
    order: Sequence[int],
    *,
    out: torch.Tensor | None = None,
    backend: str | None = None,
) -> torch.Tensor:
    """Reorder the chunks of ``x`` along dim 0 (the local permute of the 2-D all-to-all).

    ``x`` is split along dim 0 into ``len(splits)`` consecutive chunks of ``splits[0], splits[1], ...``
    rows (uneven and zero sizes allowed; ``sum(splits) == x.shape[0]``); the result is those chunks
    concatenated in the order ``order`` (a permutation of ``range(len(splits))``):
    ``out = cat([chunk[order[0]], chunk[order[1]], ...])``. One pass, no per-chunk launches.

    Args:
        x: tensor of at least one dimension, any dtype; non-contiguous input is copied first.
        splits: rows per chunk.
        order: the chunk to place at each position.
        out: optional contiguous result of ``x``'s shape, dtype and device (must not overlap ``x``).
        backend: force a backend; None dispatches on the device.

    Returns:
        A tensor shaped like ``x`` (``out`` when given).
    """
    op = "permute_chunks"
    x = _tensor(op, "x", x)
    if x.dim() == 0:
        raise ValueError(f"{op}: x is 0-d; chunks are taken along dim 0, pass at least a 1-D tensor")
    if isinstance(splits, torch.Tensor):
        splits = splits.tolist()
    if isinstance(order, torch.Tensor):
        order = order.tolist()
    splits = [_int(op, f"splits[{i}]", s, 0) for i, s in enumerate(splits)]
    order = [_int(op, f"order[{i}]", o, 0) for i, o in enumerate(order)]
    if sum(splits) != x.shape[0]:
        raise ValueError(f"{op}: splits sum to {sum(splits)} but x has {x.shape[0]} rows along dim 0")
    if sorted(order) != list(range(len(splits))):
        raise ValueError(f"{op}: order={order} is not a permutation of range({len(splits)})")
    if out is None:
        out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    else:
        _tensor(op, "out", out)
        if out.shape != x.shape or out.dtype != x.dtype or out.device != x.device or not out.is_contiguous():
            raise ValueError(
                f"{op}: out is {tuple(out.shape)} {out.dtype} on {out.device}; expected a contiguous "
                f"{tuple(x.shape)} {x.dtype} on {x.device}"
            )
    x = x if x.is_contiguous() else x.contiguous()
    return _impl(op, x.device, backend).permute_chunks(x, splits, order, out)

