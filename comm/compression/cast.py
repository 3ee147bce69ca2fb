"""fp16 / bf16 casts: half the bytes of fp32, summable.

One round: (1) all-reduce of the cast values. By default this is torch's ``fp16_compress_hook``:
pre-divide by the number of contributing ranks (so the sum is the mean and cannot exceed the largest
input), cast, all-reduce, cast back. No agreed check runs first: the reduced values are identical on
every rank, so "did it overflow, or did some rank send NaN/Inf" is a value every rank agrees on
without another collective (docs/architecture.md section 3, rule 2). If so, the exchange redoes the reduction exactly in
fp32 from the kept input (never a silent inf: a mean above 65504 comes out exact); with
``check_finite=True`` a genuine NaN/Inf raises ``NonFiniteError`` on every rank.

``FP16Compressor(agreed_scale=True)`` adds a tiny all-reduce of ``max |x|`` (and the non-finite flag)
before casting and multiplies by a power of two chosen from it: the largest partial sum then sits
near 2**15, far from fp16's 65504 and far above its subnormals, so tiny gradients (below about 6e-5
after pre-division, which fp16 would flush toward zero) keep their precision, at the cost of that
extra small all-reduce per bucket. A power of two scales exactly. bf16 has fp32's range and needs
only the pre-division. Rounding to nearest is unbiased enough that torch's hook uses no error
feedback; neither do we.

Passes over the data: one fused scale-and-cast into the wire buffer (``torch.mul(x, s, out=wire)``
computes in fp32 and rounds once, as ``(x * s).to(fp16)``), the all-reduce, one sum to test the
reduced result for NaN/Inf, and one decoding copy into the gradients, where the exchange folds the
inverse scale and the averaging into a single factor (exactly 1 for the default mean).
"""

from __future__ import annotations

import math

import torch

from .base import TAG_LEN, Compressor, Exchange, Result, Rounds, all_finite, check_tag, round_all_reduce

__all__ = ["FP16Compressor", "BF16Compressor"]

# The largest |partial sum| an fp16 reduction is scaled to: half of fp16's max leaves a factor of 2
# of headroom for rounding up.
_FP16_TARGET = 2.0 ** 15


class _CastCompressor(Compressor):
    summable = True
    biased = False
    # Element-wise with no per-block scales: tensors need no alignment in the staged vector, and
    # a DDP bucket is cast straight from its buffer.
    align = 1
    layout_free = True
    wire: torch.dtype = torch.float16
    agreed_scale: bool = False

    @property
    def cast_dtype(self) -> torch.dtype:  # type: ignore[override]
        return self.wire

    @property
    def optimistic(self) -> bool:  # type: ignore[override]
        return not self.agreed_scale

    def scale(self, amax: float, ranks: int) -> float:
        """The factor applied before casting: 1/ranks, times a power of two with an agreed scale."""
        s = 1.0 / ranks
        if self.agreed_scale and self.wire == torch.float16 and amax > 0 and math.isfinite(amax):
            # Every partial sum of pre-divided values is at most amax in magnitude.
            s *= 2.0 ** max(-60, min(60, math.floor(math.log2(_FP16_TARGET / amax))))
        return s

    def exchange(self, ex: Exchange) -> Rounds:
        s = self.scale(ex.scale_hint, ex.total_ranks)
        numel = ex.x.numel()
        # Optimistic: the input's tag rides at the end of the wire (TAG_LEN elements), checked
        # right after the all-reduce (no check phase compared the ranks' inputs).
        tail = 0 if ex.tag is None else TAG_LEN
        buf = torch.empty(numel + tail, dtype=self.wire, device=ex.x.device)
        wire = buf[:numel]
        torch.mul(ex.x, s, out=wire)  # computed in fp32, rounded once: (x * s).to(wire)
        if tail:
            buf[numel:].copy_(ex.tag)
        if ex.sent is not None:
            ex.sent.copy_(wire).div_(s)
        sent = round_all_reduce(ex, 0, buf)()  # the group's all-reduce, or the algorithm's route (synth)
        if tail:
            check_tag(ex, buf[numel:], f"compress/{self.name}/all_reduce")
        yield sent
        # The reduction decodes (SUM = wire / s) while writing the result, folded with the averaging.
        return Result(wire, 1.0 / s, nonfinite=self.optimistic and not all_finite(wire))

    def roundtrip(self, x: torch.Tensor, *, step: int = 0, seed: int = 0, salt: int = 0) -> torch.Tensor:
        return x.to(self.wire).to(x.dtype)

    def payload_bytes(self, numel: int, n: int) -> int:
        return int(2 * (n - 1) / n * numel * 2)


class FP16Compressor(_CastCompressor):
    """fp16 all-reduce with pre-division by the number of ranks, as torch's ``fp16_compress_hook``.

    A reduced result that overflowed fp16 (or a NaN/Inf input) is detected from the reduced values,
    identical on every rank, and the bucket is then reduced exactly in fp32: never a silent inf.

    Args:
        agreed_scale: before casting, agree on ``max |x|`` across ranks with one extra small
            all-reduce and scale by a power of two so the largest partial sum sits near 2**15: tiny
            gradients keep fp16's full precision instead of becoming subnormal. Off by default (the
            semantics and cost of torch's hook).
    """

    name = "fp16"
    wire = torch.float16

    def __init__(self, agreed_scale: bool = False) -> None:
        super().__init__()
        self.agreed_scale = bool(agreed_scale)

    def config(self) -> dict:
        out = super().config()
        if self.agreed_scale:
            out["agreed_scale"] = True
        return out


class BF16Compressor(_CastCompressor):
    """bf16 all-reduce with pre-division (bf16 has fp32's range; 8 bits of mantissa)."""

    name = "bf16"
    wire = torch.bfloat16
