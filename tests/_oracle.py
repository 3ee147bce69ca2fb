"""Comparisons the tensor- and context-parallel tests share (docs/architecture.md section 9.4)."""

from __future__ import annotations

import torch

from commopt.comm import context

__all__ = ["close_to", "sent_bytes"]


def close_to(got: torch.Tensor | None, ref: torch.Tensor | None, dtype: torch.dtype, world: int, what: str) -> None:
    """``got`` (a result or gradient in ``dtype``, or None) equals the fp64/fp32 oracle ``ref``: to
    ``assert_close``'s defaults for fp32 and fp64; in bf16 within ``world + 2`` roundings of the
    magnitude (each of the ``world`` partial results is rounded once, summed, and rounded again)."""
    assert (got is None) == (ref is None), f"{what}: got {got is None and 'no' or 'a'} gradient"
    if got is None:
        return
    assert got.dtype == dtype and got.shape == ref.shape, f"{what}: {got.dtype} {list(got.shape)} vs {list(ref.shape)}"
    if dtype != torch.bfloat16:
        torch.testing.assert_close(got, ref.to(dtype), msg=lambda m: f"{what}: {m}")
        return
    eps = torch.finfo(dtype).eps
    mag = max(1.0, ref.abs().max().item())
    torch.testing.assert_close(got.to(torch.float64), ref.to(torch.float64), rtol=2 * eps,
                               atol=(world + 2) * eps * mag, msg=lambda m: f"{what}: {m}")


def sent_bytes(op: str) -> int:
    """Bytes this rank's comm engine counted for ``op`` so far."""
    return context().engine().bytes_sent().get(op, 0)
