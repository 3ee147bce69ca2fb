"""Block floating point: floats <-> int32 codes with one exponent that every worker agreed on.

A switch adds integers, so every worker turns its floats into int32 codes at one common scale and
the switch sums the codes; the sum, scaled back, is the sum of the floats up to a bound fixed by that
scale. The scale comes from the largest magnitude of *all* workers' tensors (agreed through the
switch's control slot, see :mod:`.session`):

- each worker finds the exponent ``E`` of its largest magnitude (``max|x| < 2**E``, :func:`max_exponent`);
- the agreed ``E_max`` is the largest of them, and ``h = ceil(log2 n)`` bits are kept free
  (:func:`headroom_bits`) so the sum of n codes cannot wrap;
- **quantize** ``q = round(x * 2**s)`` to int32 with ``s = 30 - h - E_max`` (:func:`block_shift`):
  every ``|q| <= 2**(30-h)`` and the sum of n of them stays ``<= 2**30``;
- **dequantize** ``sum(q) * 2**-s`` in float64 (divided by n for an average), rounded once to the
  tensor's dtype (:func:`dequantize`).

Error bound (documented, tested): every worker's rounding error is at most ``2**(-s-1)``, so before
the final rounding to the output dtype ``|result - sum_fp64| <= n * 2**(-s-1)`` (``/ n`` for avg),
about ``n * 2**(h - 31)`` times the largest magnitude (:func:`error_bound`); then at most half an
ulp of the dtype. The result is exactly ``dequantize(sum of the workers' int32 codes)``.

Pure functions of numpy arrays and tensors: no sockets, no state.
"""

from __future__ import annotations

import math

import numpy as np
import torch

__all__ = [
    "ZERO_EXPONENT",
    "scan",
    "max_exponent",
    "headroom_bits",
    "block_shift",
    "as_float32_numpy",
    "quantize_into",
    "quantize",
    "dequantize",
    "error_bound",
]

ZERO_EXPONENT = -(2**30)  # the exponent of an all-zero (or empty) tensor; loses every MAX


def scan(x: torch.Tensor) -> tuple[int, bool]:
    """(exponent, has NaN/Inf) in one pass: ``aminmax`` propagates NaN and shows +-Inf."""
    if x.numel() == 0:
        return ZERO_EXPONENT, False
    lo, hi = torch.aminmax(x.detach().reshape(-1))
    m = max(-float(lo), float(hi))
    if not math.isfinite(m):
        return ZERO_EXPONENT, True
    return (math.frexp(m)[1] if m != 0.0 else ZERO_EXPONENT), False


def max_exponent(x: torch.Tensor) -> int:
    """The exponent ``E`` with ``max|x| < 2**E`` (``ZERO_EXPONENT`` for all zeros or no elements)."""
    return scan(x)[0]


def headroom_bits(num_workers: int) -> int:
    """``ceil(log2 n)``: the bits kept free so that the sum of n int32 codes cannot wrap."""
    return max(0, (num_workers - 1).bit_length())


def block_shift(exponent: int, num_workers: int, headroom: int | None = None) -> int:
    """The scale ``s`` of ``q = round(x * 2**s)``: codes of ``|q| <= 2**(30-h)``, sums ``<= 2**30``."""
    h = headroom_bits(num_workers) if headroom is None else headroom
    return 30 - h - exponent


def as_float32_numpy(x: torch.Tensor) -> np.ndarray:
    """The tensor's values as a flat float32 numpy array (exact for fp16/bf16; a view when possible)."""
    flat = x.detach().reshape(-1)
    if flat.dtype != torch.float32 or flat.device.type != "cpu":
        flat = flat.to(device="cpu", dtype=torch.float32)
    return flat.numpy()


def quantize_into(a: np.ndarray, shift: int, out: np.ndarray | None = None) -> np.ndarray:
    """``round(a * 2**shift)`` of a float32 array as little-endian int32 (into ``out`` when given).

    The worker quantizes chunk by chunk as packets leave, with this, so that workers stay in step
    instead of all quantizing 16 MiB first.
    """
    # Scaling by a power of two is exact in float32 here (|a * 2**shift| < 2**31: no overflow, and
    # anything that would underflow rounds to 0 anyway), and float32 integers above 2**24 are already
    # integral, so rint's ties-to-even rounding is the only rounding and the int32 cast is exact.
    scaled = np.ldexp(a, shift)
    np.rint(scaled, out=scaled)
    if out is None:
        return scaled.astype("<i4")
    out[:] = scaled
    return out


def quantize(x: torch.Tensor, shift: int) -> np.ndarray:
    """``round(x * 2**shift)`` (ties to even) as a flat little-endian int32 array.

    The whole-tensor form of :func:`quantize_into`: the same codes, and the oracle of the exactness
    tests.
    """
    return quantize_into(as_float32_numpy(x), shift)


def dequantize(codes: np.ndarray | torch.Tensor, shift: int, dtype: torch.dtype, divisor: int = 1) -> torch.Tensor:
    """``codes * 2**-shift / divisor`` computed in float64 and rounded once to ``dtype``."""
    t = codes if isinstance(codes, torch.Tensor) else torch.from_numpy(np.ascontiguousarray(codes))
    out = torch.ldexp(t.to(torch.float64), torch.tensor(float(-shift), dtype=torch.float64))
    if divisor != 1:
        out = out / divisor
    return out.to(dtype)


def error_bound(shift: int, num_workers: int) -> float:
    """The bound on ``|dequantized sum - fp64 sum|`` before rounding to the output dtype."""
    return num_workers * math.ldexp(1.0, -shift - 1)
