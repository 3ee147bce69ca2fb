"""MoE all-to-all overlapped with expert computation (docs/architecture.md section 5.8, moe.py).

An MoE layer's expert-parallel step is ``combine(experts(dispatch(x)))``: an all-to-all that sends
each token to the rank holding its expert, the experts, and the reverse all-to-all. Unchunked, the
experts wait for the whole dispatch and the combine waits for all experts. :func:`exchange_compute`
cuts the exchange into ``degree`` chunks so that (forward) chunk c's experts run while chunk c+1's
dispatch and chunk c-1's combine are on the wire, and (backward) chunk c's expert backward runs
while the other chunks' gradient exchanges are in flight.

Phases of the forward pass: (1) a local permute (``kernels.permute_chunks``) that makes each chunk
contiguous; (2) all dispatch all-to-alls issued asynchronously, in chunk order; (3) for each chunk:
wait for its dispatch, run the experts, issue its combine asynchronously; (4) wait for the combines
and permute back. The backward pass mirrors it with the gradient. Every rank issues the same
collectives in the same order (chunk order; docs/architecture.md section 3), whatever the local timing.

Chunking is by rows inside every (peer, segment) block -- a segment is one expert's rows -- so every
chunk carries a share of every expert's tokens. For a row-wise ``compute`` (an MLP applied to each
token) each output row is the same function of the same input row as in the unchunked path; the
only numerical difference is that GEMMs see a different number of rows and weight gradients are
summed over chunks, so results agree to floating-point reassociation (bit-identical when the BLAS
is row-deterministic).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Callable

import torch

from commopt.comm.alltoall import all_to_all, all_to_all_autograd
from commopt.comm.topology import Topology
from commopt.kernels import permute_chunks

__all__ = ["exchange_compute", "permute_rows", "chunk_layout"]

Segments = Sequence[Sequence[int]]
Compute = Callable[[torch.Tensor, list], torch.Tensor]


# --------------------------------------------------------------------------------- permutes
class _PermuteRows(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, splits, order):
        ctx.splits, ctx.order = splits, order
        return permute_chunks(x, splits, order)

    @staticmethod
    def backward(ctx, grad):
        splits, order = ctx.splits, ctx.order
        return permute_chunks(grad.contiguous(), [splits[o] for o in order], _inverse(order)), None, None


def permute_rows(x: torch.Tensor, splits: Sequence[int], order: Sequence[int]) -> torch.Tensor:
    """Differentiable ``kernels.permute_chunks``: chunks of ``splits`` rows concatenated in ``order``;
    the backward pass applies the inverse permutation."""
    return _PermuteRows.apply(x, list(splits), list(order))


def _part(rows: int, c: int, degree: int) -> int:
    return rows * (c + 1) // degree - rows * c // degree


def chunk_layout(segments: Segments, degree: int) -> tuple[list[int], list[int], list[list[list[int]]]]:
    """How :func:`exchange_compute` cuts a buffer of (peer, segment) blocks into ``degree`` chunks.

    Block (p, j) of ``segments[p][j]`` rows contributes rows ``[n*c//degree, n*(c+1)//degree)`` to
    chunk c. Returns ``(sizes, order, per_chunk)``: the piece sizes in buffer order (p, j, c), the
    permute order that makes the chunks contiguous (c, p, j), and each chunk's segments.
    """
    peers = len(segments)
    sizes = [_part(n, c, degree) for row in segments for n in row for c in range(degree)]
    index, k = {}, 0
    for p in range(peers):
        for j in range(len(segments[p])):
            for c in range(degree):
                index[(p, j, c)] = k
                k += 1
    order = [index[(p, j, c)] for c in range(degree) for p in range(peers) for j in range(len(segments[p]))]
    per_chunk = [[[_part(n, c, degree) for n in row] for row in segments] for c in range(degree)]
    return sizes, order, per_chunk


def _inverse(order: list[int]) -> list[int]:
    inv = [0] * len(order)
    for i, o in enumerate(order):
        inv[o] = i
    return inv


# --------------------------------------------------------------------------------- pipeline
class _Pipelined(torch.autograd.Function):
    """Forward and backward of the chunked exchange; see the module docstring for the phases.

    The experts' parameters are not inputs of this function: their gradients are accumulated into
    ``.grad`` by the per-chunk ``torch.autograd.backward`` calls (so use ``loss.backward()``, not
    ``torch.autograd.grad`` with the parameters as inputs).
    """

    @staticmethod
    def forward(ctx, x, in_segments, out_segments, compute, degree, comm, build_graph):
        in_sizes, in_order, in_chunks = chunk_layout(in_segments, degree)
        out_sizes, out_order, out_chunks = chunk_layout(out_segments, degree)
        staged = permute_chunks(x.contiguous(), in_sizes, in_order)
        ins = [[sum(row) for row in seg] for seg in in_chunks]
        outs = [[sum(row) for row in seg] for seg in out_chunks]
        # (2) every dispatch in flight at once, in chunk order.
        dispatch = [all_to_all(None, piece, in_splits=ins[c], out_splits=outs[c], async_op=True, **comm)
                    for c, piece in enumerate(staged.split([sum(i) for i in ins]))]
        graphs, combine = [], []
        for c in range(degree):
            recv = dispatch[c].wait()
            # The experts' graph is built only when the caller records one (not under no_grad).
            with torch.set_grad_enabled(build_graph):
                xc = recv.detach().requires_grad_(build_graph)
                yc = compute(xc, out_chunks[c])
            if yc.shape[0] != xc.shape[0]:
                raise ValueError(f"exchange_compute: compute returned {yc.shape[0]} rows for {xc.shape[0]}; it "
                                 f"must return one row per input row")
            if build_graph:
                graphs.append((xc, yc))
            # (3) this chunk's combine overlaps the next chunk's experts.
            combine.append(all_to_all(None, yc.detach(), in_splits=outs[c], out_splits=ins[c], async_op=True,
                                      **comm))
        back = torch.cat([f.wait() for f in combine]) if degree > 1 else combine[0].wait()
        ctx.graphs, ctx.comm = graphs, comm
        ctx.layout = (in_sizes, in_order, ins, outs)
        return permute_chunks(back, [in_sizes[o] for o in in_order], _inverse(in_order))

    @staticmethod
    def backward(ctx, grad):
        in_sizes, in_order, ins, outs = ctx.layout
        comm, graphs = ctx.comm, ctx.graphs
        staged = permute_chunks(grad.contiguous(), in_sizes, in_order)
        # The reverse of the combine, every chunk in flight, then each chunk's expert backward
        # overlapping the others' exchanges, then the reverse of the dispatch.
        rev = [all_to_all(None, piece, in_splits=ins[c], out_splits=outs[c], async_op=True, **comm)
               for c, piece in enumerate(staged.split([sum(i) for i in ins]))]
        back = []
        for c, (xc, yc) in enumerate(graphs):
            gy = rev[c].wait()
            if yc.requires_grad:
                torch.autograd.backward(yc, gy)
            gx = xc.grad if xc.grad is not None else torch.zeros_like(xc)
            back.append(all_to_all(None, gx, in_splits=outs[c], out_splits=ins[c], async_op=True, **comm))
        ctx.graphs = None  # free the experts' graphs
        g = torch.cat([f.wait() for f in back])
        return (permute_chunks(g, [in_sizes[o] for o in in_order], _inverse(in_order)),
                None, None, None, None, None, None)


def exchange_compute(x: torch.Tensor, in_segments: Segments, out_segments: Segments, compute: Compute, *,
                     degree: int = 1, group=None, topology: Topology | None = None,
                     algorithm: str = "auto") -> torch.Tensor:
    """``all_to_all^-1(compute(all_to_all(x)))`` with the exchange overlapped with ``compute``.

    Args:
        x: rows to send, grouped by destination rank, then by segment: ``in_segments[d][j]`` rows
            for segment j (an expert) of rank d.
        in_segments: per destination rank, the rows of each segment (all ranks' lists agree:
            ``in_segments[d][j]`` on rank s equals ``out_segments[s][j]`` on rank d).
        out_segments: per source rank, the rows of each segment this rank receives.
        compute: ``compute(rows, segments)`` for the received rows (source-major, segment-minor,
            ``segments[s][j]`` rows each) returning one row per input row; must be row-wise (each
            output row depends on its input row and segment only) for chunking to be exact.
        degree: the overlap degree: chunks in flight; 1 is the plain, unchunked path.
        group, topology, algorithm: passed to :func:`commopt.comm.all_to_all`.

    Returns:
        ``compute``'s rows sent back to where they came from, in ``x``'s layout. Differentiable in
        ``x`` and in whatever ``compute`` uses (gradients accumulate in ``.grad``).
    """
    if isinstance(degree, bool) or not isinstance(degree, int) or degree < 1:
        raise ValueError(f"exchange_compute: degree={degree!r} must be a positive int")
    in_segments = [list(map(int, row)) for row in in_segments]
    out_segments = [list(map(int, row)) for row in out_segments]
    rows = sum(map(sum, in_segments))
    if rows != x.shape[0]:
        raise ValueError(f"exchange_compute: in_segments cover {rows} rows but x has {x.shape[0]}")
    comm = {"group": group, "topology": topology, "algorithm": algorithm}
    if degree == 1:
        ins = [sum(row) for row in in_segments]
        outs = [sum(row) for row in out_segments]
        recv = all_to_all_autograd(x, ins, outs, **comm)
        return all_to_all_autograd(compute(recv, out_segments), outs, ins, **comm)
    return _Pipelined.apply(x, in_segments, out_segments, compute, degree, comm, torch.is_grad_enabled())
