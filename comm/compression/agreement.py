"""Agreement on the input of a compressed reduction: the ranks hold the same tensors, or all raise.

Without validation, ranks holding different tensors must still fail loudly, never return wrong
values: gloo fails on collectives of different lengths (a C++ abort on one side, an error on the
other) but not on different tensors of equal staged length (block alignment pads [100] and [200]
to the same vector), nor on fp32 and fp64 buffers of equal bytes. So every exchange compares a
signature of its input on every rank, in a collective it runs anyway: the check phase's MAX
all-reduce carries [s, -s, h, -h] (s = element count and dtype, h = a 52-bit hash of the shapes,
dtype, compressor settings, step decision and op); optimistic exchanges append a tag of h to their
first all-reduced payload (``base.tag_of``) and, in hierarchical mode, all-reduce [s, -s, h, -h]
over the node alongside the intra-node reduce-scatter (no rail collective of its own).

A standalone call (``Compressor.all_reduce``), whose ranks may pass anything, agrees first
(:func:`agree_inputs`), before the algorithm's choice and its groups depend on the sizes.
"""

from __future__ import annotations

import torch
from torch.distributed import ProcessGroup

from ..checks import agree
from ..errors import CollectiveMismatchError
from .codec import Codec, derive_seed

__all__ = ["signature", "agreement", "disagreement", "describe", "agree_inputs"]

_DTYPES = (torch.float64, torch.float32, torch.bfloat16, torch.float16)


def _dtype_code(dtype: torch.dtype) -> int:
    return _DTYPES.index(dtype) + 1 if dtype in _DTYPES else 15


def describe(s: int) -> str:
    """The element count and dtype that ``s`` (of :func:`signature`) encodes, in words."""
    code = s % 16
    return f"{s // 16} elements of {_DTYPES[code - 1] if 1 <= code <= len(_DTYPES) else 'another dtype'}"


def signature(compressor: Codec, dtype: torch.dtype, numels: list[int], shapes: list[tuple[int, ...]],
              active: bool, average: bool) -> tuple[int, int]:
    """(s, h): the element count and dtype code, and a 52-bit hash of everything the exchange's
    collectives depend on (exact in float64, so a MAX all-reduce compares them); the shapes count
    only for matrix compressors (element-wise ones reduce same-sized tensors of any shape alike)."""
    s = sum(numels) * 16 + _dtype_code(dtype)
    h = derive_seed(0, "compress-signature", repr(sorted(compressor.config().items())), str(dtype),
                    int(active), int(average), repr(shapes if compressor.needs_matrices else numels))
    return s, h & ((1 << 52) - 1)


def agreement(s: int, h: int, device: torch.device) -> torch.Tensor:
    """What a MAX all-reduce of the signature reduces: [s, -s, h, -h] (max and minus min)."""
    return torch.tensor([s, -s, h, -h], dtype=torch.float64, device=device)


def disagreement(values: torch.Tensor, mine: int, what: str, op: str) -> CollectiveMismatchError | None:
    """The error for MAX-reduced [s, -s, h, -h] whose max and min differ, else None (agreed)."""
    smax, smin, hmax, hmin = (int(v) for v in values.tolist())
    smin, hmin = -smin, -hmin
    if smax == smin and hmax == hmin:
        return None
    if smax != smin:
        detail = f"from {describe(smin)} to {describe(smax)}"
    else:
        detail = f"{describe(mine)} everywhere, but different shapes, compressor settings, steps or ops"
    return CollectiveMismatchError(
        f"the ranks of this compressed all-reduce hold different tensors: {detail} (this rank: {what}); "
        f"pass tensors of the same shapes and dtype, and the same compressor settings, step and op, on every "
        f"rank (AllReduceState(validate=True) names the ranks that differ)", op=op)


def agree_inputs(compressor: Codec, tensors: list[torch.Tensor], *, group: ProcessGroup | None, algorithm: str,
                 average: bool, step: int, timeout: float | None) -> None:
    """``CollectiveMismatchError`` on every rank of ``group`` unless every rank reduces tensors of the
    same sizes (shapes, for matrix compressors) and dtype with the same settings, step and algorithm.

    The exact collectives' agreement check (``checks.agree``, whose header is the same on every
    call, so a rank reducing integers exactly meets it too) with ``agreement.signature``'s hash, on
    ``group`` and the caller's thread, before any choice or group creation that depends on the sizes:
    ranks that differ would otherwise pick different algorithms, create different groups, or make
    gloo abort on a payload longer than its buffer.
    """
    shapes = [tuple(t.shape) for t in tensors] if compressor.needs_matrices else []
    _, h = signature(compressor, tensors[0].dtype, [t.numel() for t in tensors], shapes, compressor.active(step),
                     average)
    agree("all_reduce", numel=sum(t.numel() for t in tensors), dtype=tensors[0].dtype,
                      op="avg" if average else "sum", algorithm=algorithm, group=group, device=tensors[0].device,
                      timeout=timeout, signature=derive_seed(h, "step", step) & ((1 << 52) - 1))
