"""Sparsifiers: random-k (summable, unbiased) and top-k (gathered, biased, needs error feedback).

Random-k: every rank keeps the same k indices, drawn from a generator seeded with (seed, step, the
vector's keys) identically on every rank, so the k values can be summed by one all-reduce; they are
scaled by d/k, which makes E[decode(encode(x))] = x (no error feedback needed).

Top-k: every rank keeps its own k largest magnitudes, so the payloads (``kernels.topk_pack``: values
and indices in one byte buffer of a size known from k) are all-gathered and accumulated with
``kernels.scatter_add_unpack``. Biased: what is dropped goes to the error-feedback residual.
"""

from __future__ import annotations

import math

import torch

from ... import kernels
from .base import Compressor, Exchange, Result, Rounds, derive_seed, round_all_gather, round_all_reduce

__all__ = ["RandomKCompressor", "TopKCompressor"]


def _k(ratio: float, d: int, at_least_one: bool) -> int:
    if d == 0:
        return 0
    k = math.ceil(ratio * d)
    return min(d, max(1, k) if at_least_one else k)


class RandomKCompressor(Compressor):
    """Keep k = ceil(ratio * d) elements at indices shared by all ranks, scaled by d/k (unbiased).

    Args:
        ratio: fraction of elements kept, in (0, 1].
    """

    name = "randomk"
    summable = True
    biased = False

    def __init__(self, ratio: float = 0.01) -> None:
        super().__init__()
        if not 0 < ratio <= 1:
            raise ValueError(f"RandomKCompressor: ratio={ratio} must be in (0, 1]")
        self.ratio = float(ratio)

    def config(self) -> dict:
        return {"name": self.name, "ratio": self.ratio}

    def indices(self, d: int, *, step: int, seed: int, salt: int) -> torch.Tensor:
        """The k indices of step ``step``: identical on every rank, different across steps."""
        gen = torch.Generator().manual_seed(derive_seed(seed, self.name, step, salt))
        return torch.randperm(d, generator=gen)[: _k(self.ratio, d, True)]

    def exchange(self, ex: Exchange) -> Rounds:
        x, d = ex.x, ex.x.numel()
        idx = self.indices(d, step=ex.step, seed=ex.seed, salt=ex.salt).to(x.device)
        values = x[idx] * (d / max(1, idx.numel()))
        if ex.sent is not None:
            ex.sent.zero_()
            ex.sent[idx] = values
        sent = round_all_reduce(ex, 0, values)()  # the group's all-reduce, or the algorithm's route (synth)
        ex.out.zero_()
        ex.out[idx] = values
        yield sent
        return Result(ex.out)

    def roundtrip(self, x: torch.Tensor, *, step: int = 0, seed: int = 0, salt: int = 0) -> torch.Tensor:
        flat = x.reshape(-1)
        d = flat.numel()
        idx = self.indices(d, step=step, seed=seed, salt=salt).to(x.device)
        out = torch.zeros_like(flat)
        out[idx] = flat[idx] * (d / max(1, idx.numel()))
        return out.view_as(x)

    def payload_bytes(self, numel: int, n: int) -> int:
        return int(2 * (n - 1) / n * _k(self.ratio, numel, True) * 4)


class TopKCompressor(Compressor):
    """Keep each rank's k = ceil(ratio * d) largest magnitudes; all-gather and scatter-add them.

    Args:
        ratio: fraction of elements kept, in [0, 1] (0 sends nothing: everything goes to the residual).
    """

    name = "topk"
    summable = False
    biased = True

    def __init__(self, ratio: float = 0.01) -> None:
        super().__init__()
        if not 0 <= ratio <= 1:
            raise ValueError(f"TopKCompressor: ratio={ratio} must be in [0, 1]")
        self.ratio = float(ratio)

    def config(self) -> dict:
        return {"name": self.name, "ratio": self.ratio}

    rounds = ("all_gather",)

    def exchange(self, ex: Exchange) -> Rounds:
        x, d = ex.x, ex.x.numel()
        payload = kernels.topk_pack(x, _k(self.ratio, d, False))
        if ex.sent is not None:
            ex.sent.copy_(kernels.scatter_add_unpack([payload], d, dtype=x.dtype))
        gathered = payload.new_empty(ex.n * payload.numel())
        sent = round_all_gather(ex, 0, gathered, payload)  # the group's all-gather, or the algorithm's route
        ex.out.copy_(kernels.scatter_add_unpack(gathered.view(ex.n, -1), d, dtype=x.dtype))
        yield sent
        return Result(ex.out)

    def roundtrip(self, x: torch.Tensor, *, step: int = 0, seed: int = 0, salt: int = 0) -> torch.Tensor:
        flat = x.reshape(-1)
        payload = kernels.topk_pack(flat, _k(self.ratio, flat.numel(), False))
        return kernels.scatter_add_unpack([payload], flat.numel(), dtype=x.dtype).view_as(x)

    def payload_bytes(self, numel: int, n: int) -> int:
        k = _k(self.ratio, numel, False)
        return (n - 1) * (8 + -(-k * 4 // 4) * 4 + 4 * k)
