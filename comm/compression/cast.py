"""fp16 / bf16 casts with overflow-safe scaling: half the bytes of fp32, summable.

One round: (1) all-reduce of the cast values. Before casting, the values are pre-divided by the
number of contributing ranks (so the sum is the mean and cannot exceed the largest input) and, for
fp16, multiplied by a power of two chosen from ``max |x|`` agreed across ranks by the exchange's
check phase: the largest partial sum then sits near 2**15, far from fp16's 65504 (no overflow, even
for 4 ranks of 40 000) and far above its subnormals (small gradients keep their precision). A power
of two scales exactly. bf16 has fp32's range and needs only the pre-division. Rounding to nearest is
unbiased enough that torch's ``fp16_compress_hook`` uses no error feedback; neither do we.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch.distributed import ReduceOp

from .base import Compressor, Job, Round, wait_work

__all__ = ["FP16Compressor", "BF16Compressor"]

# The largest |partial sum| an fp16 reduction is scaled to: half of fp16's max leaves a factor of 2
# of headroom for rounding up.
_FP16_TARGET = 2.0 ** 15


class _CastCompressor(Compressor):
    summable = True
    biased = False
    n_rounds = 1
    wire: torch.dtype = torch.float16

    def rounds(self) -> list[Round]:
        return [Round("all_reduce", self._exchange)]

    def scale(self, amax: float, ranks: int) -> float:
        """The factor applied before casting: 1/ranks times a power of two for fp16."""
        s = 1.0 / ranks
        if self.wire == torch.float16 and amax > 0 and math.isfinite(amax):
            # Every partial sum of pre-divided values is at most amax in magnitude.
            s *= 2.0 ** max(-60, min(60, math.floor(math.log2(_FP16_TARGET / amax))))
        return s

    def _exchange(self, job: Job) -> int:
        s = self.scale(job.scale_hint, job.total_ranks)
        wire = (job.x * s).to(self.wire)
        if job.sent is not None:
            job.sent.copy_(wire.to(job.x.dtype).div_(s))
        wait_work(dist.all_reduce(wire, op=ReduceOp.SUM, group=job.group, async_op=True), job.timeout)
        job.out.copy_(wire.to(job.out.dtype).div_(s))
        return self.payload_bytes(job.x.numel(), job.n)

    def roundtrip(self, x: torch.Tensor, *, step: int = 0, seed: int = 0, salt: int = 0) -> torch.Tensor:
        return x.to(self.wire).to(x.dtype)

    def payload_bytes(self, numel: int, n: int) -> int:
        return int(2 * (n - 1) / n * numel * 2)


class FP16Compressor(_CastCompressor):
    """fp16 all-reduce with pre-division and an agreed power-of-two scale (never a silent inf)."""

    name = "fp16"
    wire = torch.float16


class BF16Compressor(_CastCompressor):
    """bf16 all-reduce with pre-division (bf16 has fp32's range; 8 bits of mantissa)."""

    name = "bf16"
    wire = torch.bfloat16
