"""CUDA kernels through CuPy: the same results as :mod:`.reference`, on torch's current stream.

How, and why:

- The sources live in ``kernels/cuda/*.cu`` (package data) and are compiled by CuPy's ``RawModule``
  (NVRTC) once per device, with ``--fmad=false`` so that no multiply-add is fused: the reference
  rounds every operation separately. The compiled modules are cached per device index (the only
  module-level state besides the optional-dependency gate). CuPy for CUDA 12 (``cupy-cuda12x``) and
  13 (``cupy-cuda13x``) both work: the sources use no headers and only long-standing intrinsics.
- Every launch goes onto torch's current stream (``cupy.cuda.ExternalStream``), tensors are handed
  over zero-copy through DLPack, and nothing waits for the device: no host synchronisation, so the
  kernels compose with torch's stream semantics and CUDA graphs of the caller's making.
- ``flatten`` / ``unflatten`` / ``permute_chunks`` are one launch for any number of tensors: a
  table of (source, destination, bytes, zero padding) segments is built on the host, copied to the
  device from pinned memory without blocking, and each CUDA block copies one fixed-size task.
- Top-k selection uses torch's own device top-k on keys that make the selection unique (magnitude
  bits, then lower index first); a CUDA kernel writes the payload. fp64 lossy kernels run the
  reference (they are not a bandwidth concern).
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from importlib import resources

import numpy as np
import torch

from . import reference
from ._optional import CUPY
from .reference import DTYPE_CODES, hash_key, topk_k, topk_layout

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
    "source",
]

_SOURCE_FILES = ("commopt_kernels.cu",)
_OPTIONS = ("--fmad=false",)
_THREADS = 256
_COPY_CHUNK = 1 << 16  # bytes per CUDA block of the segment copy
_MAX_BLOCKS = 65535 * 16  # grid-stride kernels need no more blocks than this to fill a GPU
_SUFFIX = {torch.float32: "f32", torch.float16: "f16", torch.bfloat16: "bf16"}

_modules: dict[int, object] = {}  # device index -> cupy.RawModule, compiled once per device
_lock = threading.Lock()


def source() -> str:
    """The CUDA source text of all kernels (package data)."""
    folder = resources.files(__package__) / "cuda"
    return "\n".join((folder / name).read_text(encoding="utf-8") for name in _SOURCE_FILES)


def _module(index: int) -> object:
    module = _modules.get(index)
    if module is None:
        with _lock:
            module = _modules.get(index)
            if module is None:
                cupy = CUPY.module
                with cupy.cuda.Device(index):
                    module = cupy.RawModule(code=source(), options=_OPTIONS)
                    module.compile()  # compile for this device now, not inside a later launch
                _modules[index] = module
    return module


def _index(device: torch.device) -> int:
    return device.index if device.index is not None else torch.cuda.current_device()


def _dl(t: torch.Tensor) -> object:
    """A zero-copy CuPy view of a contiguous tensor, through DLPack.

    Views that DLPack consumers reliably support are used (bf16 and uint32 are reinterpreted as
    16- and 32-bit integers): the kernels read raw bits anyway.
    """
    cupy = CUPY.module
    if t.numel() == 0:
        return np.uint64(0)  # a null pointer: kernels never dereference an empty argument
    if t.dtype in (torch.bfloat16, torch.float16):
        t = t.view(torch.int16)
    elif t.dtype in (torch.uint32, torch.float32):
        t = t.view(torch.int32)
    elif t.dtype == torch.int8:
        t = t.view(torch.uint8)
    return cupy.from_dlpack(t.detach())


def _launch(device: torch.device, name: str, blocks: int, args: tuple) -> None:
    if blocks <= 0:
        return
    cupy = CUPY.module
    index = _index(device)
    with cupy.cuda.Device(index):
        kernel = _module(index).get_function(name)
        stream = cupy.cuda.ExternalStream(torch.cuda.current_stream(device).cuda_stream)
        with stream:
            kernel((blocks,), (_THREADS,), tuple(_dl(a) if isinstance(a, torch.Tensor) else a for a in args))


def _grid(n: int) -> int:
    return min(-(-n // _THREADS), _MAX_BLOCKS)


def _i64(v: int) -> np.int64:
    return np.int64(v)


# ---------------------------------------------------------------------------------------------------
# copies


def _run_segments(device: torch.device, segments: list[tuple[int, int, int, int]]) -> None:
    # a tensor that already is a view at its place in the buffer (DDP's gradient_as_bucket_view)
    # needs no copy, only its padding
    segments = [(0, d + n, 0, p) if s == d else (s, d, n, p) for s, d, n, p in segments]
    segments = [seg for seg in segments if seg[2] + seg[3] > 0]
    if not segments:
        return
    table = np.zeros((len(segments), 5), dtype=np.int64)
    table[:, :4] = np.array(segments, dtype=np.int64)
    tasks = -(-(table[:, 2] + table[:, 3]) // _COPY_CHUNK)
    table[1:, 4] = np.cumsum(tasks)[:-1]
    # pinned + non_blocking: the upload is queued on the stream, the host does not wait; torch's
    # caching host allocator keeps the pinned block alive until the copy has run
    host = torch.from_numpy(table).pin_memory()
    dev = host.to(device, non_blocking=True)
    # the device table may be freed as soon as this returns: the caching allocator hands its memory
    # only to later work on this same stream, which runs after the kernel
    _launch(device, "commopt_copy_segments", int(tasks.sum()), (dev, np.int32(len(segments)), _i64(_COPY_CHUNK)))


def flatten(tensors: Sequence[torch.Tensor], out: torch.Tensor, offsets: Sequence[int]) -> None:
    _run_segments(out.device, reference.flatten_segments(tensors, out, offsets))


def unflatten(buffer: torch.Tensor, tensors: Sequence[torch.Tensor], offsets: Sequence[int]) -> None:
    _run_segments(buffer.device, reference.unflatten_segments(buffer, tensors, offsets))


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
        segments.append((src + int(starts[o]) * row, dst + at * row, splits[o] * row, 0))
        at += splits[o]
    _run_segments(x.device, segments)
    return out


# ---------------------------------------------------------------------------------------------------
# signs and quantisation


def pack_signs(x: torch.Tensor, block: int | None) -> tuple[torch.Tensor, torch.Tensor | None]:
    if x.dtype not in _SUFFIX:
        return reference.pack_signs(x, block)
    n = x.numel()
    bits = torch.empty(-(-n // 32), dtype=torch.uint32, device=x.device)
    width = "b32" if x.element_size() == 4 else "b16"
    # one thread per element, no grid stride: every warp must reach the ballot together
    _launch(x.device, f"commopt_pack_signs_{width}", -(-n // _THREADS), (x, bits, _i64(n)))
    if block is None:
        return bits, None
    scales = torch.empty(-(-n // block), dtype=torch.float32, device=x.device)
    _launch(x.device, f"commopt_abs_mean_{_SUFFIX[x.dtype]}", scales.numel(), (x, scales, _i64(n), _i64(block)))
    return bits, scales


def unpack_signs(
    bits: torch.Tensor,
    numel: int,
    scales: torch.Tensor | None,
    block: int | None,
    dtype: torch.dtype,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    if dtype not in _SUFFIX:
        return reference.unpack_signs(bits, numel, scales, block, dtype, out)
    out = torch.empty(numel, dtype=dtype, device=bits.device) if out is None else out
    has = scales is not None
    s = scales if has else torch.ones(1, dtype=torch.float32, device=bits.device)
    _launch(bits.device, f"commopt_unpack_signs_{_SUFFIX[dtype]}", _grid(numel),
            (bits, s, _i64(block if has else max(numel, 1)), np.int32(has), out, _i64(numel)))
    return out


def quantize(
    x: torch.Tensor, bits: int, block: int, seed: int, step: int, stochastic: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    if x.dtype not in _SUFFIX:
        return reference.quantize(x, bits, block, seed, step, stochastic)
    n = x.numel()
    int4 = bits == 4
    codes = torch.empty(-(-n // 2) if int4 else n, dtype=torch.uint8 if int4 else torch.int8, device=x.device)
    scales = torch.empty(-(-n // block), dtype=torch.float32, device=x.device)
    _launch(x.device, f"commopt_quantize_{_SUFFIX[x.dtype]}", scales.numel(),
            (x, codes, scales, _i64(n), _i64(block), np.int32((1 << (bits - 1)) - 1), np.int32(stochastic),
             np.uint32(hash_key(seed, step)), np.int32(int4)))
    return codes, scales


def dequantize(
    codes: torch.Tensor,
    scales: torch.Tensor,
    numel: int,
    bits: int,
    block: int,
    dtype: torch.dtype,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    if dtype not in _SUFFIX:
        return reference.dequantize(codes, scales, numel, bits, block, dtype, out)
    out = torch.empty(numel, dtype=dtype, device=codes.device) if out is None else out
    _launch(codes.device, f"commopt_dequantize_{_SUFFIX[dtype]}", _grid(numel),
            (codes, scales, _i64(numel), _i64(block), np.int32(bits == 4), out))
    return out


# ---------------------------------------------------------------------------------------------------
# sparse


def topk_pack(x: torch.Tensor, k: int) -> torch.Tensor:
    if x.dtype not in _SUFFIX:
        return reference.topk_pack(x, k)
    n = x.numel()
    size = x.element_size()
    values_at, indices_at, total = topk_layout(k, size)
    payload = torch.empty(total, dtype=torch.uint8, device=x.device)
    if k == n:
        idx = torch.arange(n, dtype=torch.int64, device=x.device)
    elif k == 0:
        idx = torch.zeros(0, dtype=torch.int64, device=x.device)
    else:
        # unique keys: magnitude bits (NaN above inf) in the high word, then the complement of the
        # index, so that ties go to the lower index whatever torch.topk's tie order
        raw = x.view(torch.int16 if size == 2 else torch.int32).to(torch.int64)
        mag = raw & (0x7FFF if size == 2 else 0x7FFFFFFF)
        pos = torch.arange(n, dtype=torch.int64, device=x.device)
        key = (mag << 32) | (0xFFFFFFFF - pos)
        top = torch.topk(key, k, sorted=False).values
        idx = torch.sort(0xFFFFFFFF - (top & 0xFFFFFFFF)).values
    _launch(x.device, f"commopt_topk_gather_{'b32' if size == 4 else 'b16'}", max(1, _grid(k)),
            (x, idx, _i64(k), np.uint32(DTYPE_CODES[x.dtype]), payload, _i64(values_at), _i64(indices_at)))
    return payload


def scatter_add_unpack(
    payloads: Sequence[torch.Tensor],
    numel: int,
    dtype: torch.dtype,
    value_dtype: torch.dtype,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    if value_dtype not in _SUFFIX or dtype == torch.float64:
        return reference.scatter_add_unpack(payloads, numel, dtype, value_dtype, out)
    device = payloads[0].device
    result = out
    if out is not None and dtype == torch.float32:
        out.zero_()
    else:
        out = torch.zeros(numel, dtype=torch.float32, device=device)
    size = value_dtype.itemsize
    for p in payloads:
        k = topk_k(p.numel(), size)
        if k <= 0:
            continue
        values_at, indices_at, _ = topk_layout(k, size)
        _launch(device, f"commopt_scatter_add_{_SUFFIX[value_dtype]}", _grid(k),
                (p, _i64(k), np.uint32(DTYPE_CODES[value_dtype]), _i64(values_at), _i64(indices_at), out,
                 _i64(numel)))
    if result is None:
        return out if dtype == torch.float32 else out.to(dtype)
    return result if result is out else result.copy_(out)
