"""Where each tensor of a compressed reduction sits in its staged vector, and this rank's shard.

Element-wise compressors see the tensors staged into one flat vector, each tensor starting at a
multiple of ``compressor.align`` (so per-block scales never mix two tensors, and a tensor of zeros,
e.g. an unused parameter, decodes to zeros). In hierarchical mode the intra-node phase splits that
vector into L equal shards and only the rail exchange of this rank's shard is compressed. Matrix
compressors (PowerSGD) need whole tensors: in hierarchical mode the tensors are partitioned among
the L local ranks by size (largest first onto the least loaded local rank, deterministic from
shapes), each local rank's tensors form one section, sections are padded to the largest, and the
reduce-scatter hands every local rank the node sum of whole matrices.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ... import kernels
from .codec import Codec

__all__ = ["Layout", "layout_for", "stage", "stage_sum", "unstage"]


@dataclass
class Layout:
    """Where each tensor sits in the staged vector, and this rank's shard of it.

    Attributes:
        offsets: start of each tensor in the staged vector.
        total: staged length (a multiple of every chunking the exchange needs).
        lo, hi: this rank's shard (the whole vector in flat mode).
        owned: indices of the tensors lying wholly in the shard (all of them in flat mode).
        plain: offsets are exactly ``kernels.flatten``'s with ``align`` (staging can use it).
    """

    offsets: list[int]
    total: int
    lo: int
    hi: int
    owned: list[int] = field(default_factory=list)
    plain: bool = True


def _round_up(v: int, unit: int) -> int:
    return -(-v // unit) * unit if unit > 1 else v


def layout_for(compressor: Codec, numels: list[int], *, local_size: int, local_rank: int,
               rail_size: int) -> Layout:
    """The staged layout; ``local_size == 1`` means flat mode (``rail_size`` is then the group size)."""
    align = compressor.align
    if compressor.needs_matrices and local_size > 1:
        sections: list[list[int]] = [[] for _ in range(local_size)]
        loads = [0] * local_size
        for i in sorted(range(len(numels)), key=lambda i: (-numels[i], i)):
            j = min(range(local_size), key=lambda j: (loads[j], j))
            sections[j].append(i)
            loads[j] += numels[i]
        size = max(loads)
        offsets = [0] * len(numels)
        for j, members in enumerate(sections):
            pos = j * size
            for i in sorted(members):
                offsets[i] = pos
                pos += numels[i]
        lo = local_rank * size
        return Layout(offsets, local_size * size, lo, lo + size, sorted(sections[local_rank]), plain=False)
    offs = kernels.reference.flatten_offsets(numels, align)
    unit = align * (rail_size if compressor.chunked else 1) * local_size
    total = _round_up(offs[-1], unit)
    shard = total // local_size
    lo = local_rank * shard
    owned = list(range(len(numels))) if local_size == 1 else []
    return Layout(offs[:-1], total, lo, lo + shard, owned)


def stage(tensors: list[torch.Tensor], layout: Layout, dtype: torch.dtype, align: int,
          alias: bool = False) -> torch.Tensor:
    """Copy ``tensors`` into a new staged vector of ``dtype`` (zeros between and after them).

    With ``alias``, one contiguous tensor that is already the whole staged vector is used as it is
    (no copy): for optimistic compressors, which never write the staged vector before the last
    phase overwrites the tensors with the result.
    """
    device = tensors[0].device
    one = tensors[0]
    if (alias and len(tensors) == 1 and layout.plain and layout.total == one.numel() and one.dtype == dtype
            and one.is_contiguous()):
        return one.view(-1)
    if layout.plain and all(t.dtype == dtype for t in tensors):
        out = torch.empty(layout.total, dtype=dtype, device=device)
        kernels.flatten(tensors, out, align=align)
        return out
    out = torch.zeros(layout.total, dtype=dtype, device=device)
    for t, off in zip(tensors, layout.offsets):
        out[off: off + t.numel()].copy_(t.reshape(-1))
    return out


def stage_sum(sources: list[torch.Tensor], residuals: list[torch.Tensor], offsets: list[int], total: int,
              dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A new vector of ``total`` elements: ``sources[i] + residuals[i]`` at ``offsets[i]``, zeros
    elsewhere; one pass (no staged copy of the sources first)."""
    out = torch.empty(total, dtype=dtype, device=device)
    end = 0
    for src, r, off in sorted(zip(sources, residuals, offsets), key=lambda e: e[2]):
        if off > end:
            out[end: off].zero_()
        torch.add(src.reshape(-1), r, out=out[off: off + r.numel()])
        end = off + r.numel()
    out[end:].zero_()
    return out


def unstage(buf: torch.Tensor, tensors: list[torch.Tensor], layout: Layout) -> None:
    """Write the staged vector back into ``tensors`` (in their dtype)."""
    if not tensors:
        return
    dtype = tensors[0].dtype
    src = buf if buf.dtype == dtype else buf.to(dtype)
    kernels.unflatten(src, tensors, layout.offsets)
