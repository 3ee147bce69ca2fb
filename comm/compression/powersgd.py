"""PowerSGD (Vogels et al. 2019): rank-r approximation by one step of power iteration.

Per matrix M (a gradient reshaped to rows x cols, plus its residual): (1) P = M Q, all-reduce P,
orthogonalize P (Gram-Schmidt in fp32 or fp64 with an epsilon, or QR for r > 2, as torch does);
(2) Q = M^T P, all-reduce Q; the result is P Q^T. Both payloads are summable, so the rounds are
plain all-reduces: (rows + cols) r elements instead of rows x cols. Tensors that are not worth it
(vectors, and matrices with (rows + cols) r x min_compression_rate >= rows x cols, decided from
shapes) ride exactly in round 1's buffer. Same-shaped matrices can be batched (one bmm per shape).

Warm start keeps each matrix's averaged Q (identical on every rank, stored transposed: [r, cols]) for
the next step, keyed by the parameter's stable key, in a :class:`PowerSGDState` (the run's state,
``compressor.new_state()``), not on the compressor: one compressor serves any number of models.
Initial Q are drawn from a generator seeded with (seed, parameter key[, step]), identical on every
rank, never from the global RNG. Before ``start_iter`` the exchange is an exact all-reduce, as in
torch's hook.

Layout: Q is kept as Q^T ([r, cols], contiguous), so every product streams M row by row. While Q is
being all-reduced, the residual (which needs only this rank's Q) is computed: it is off the
critical path.

Error feedback: the residual is M - P Q_local^T, this rank's own approximation (P is shared), so that
sum over ranks of what each rank transmitted is exactly the result (torch keeps M - P Q_mean^T,
which conserves only the sum over ranks). It is one fused product per matrix (``addmm``), written
where the reduction expects what was sent (``Result.residual``).
"""

from __future__ import annotations

import math

import torch

from .base import (
    TAG_LEN,
    Compressor,
    CompressorState,
    Exchange,
    Result,
    Rounds,
    all_finite,
    check_tag,
    derive_seed,
    round_all_reduce,
)

__all__ = ["PowerSGDCompressor", "PowerSGDState"]


class PowerSGDState(CompressorState):
    """PowerSGD's per-run state: the call counter and the warm-start Q memory.

    Attributes:
        q_memory: parameter key -> the averaged Q of its matrix at the last compressed step, stored
            transposed ([r, cols]), identical on every rank.
    """

    def __init__(self, compressor: Compressor) -> None:
        super().__init__(compressor)
        self.q_memory: dict[str, torch.Tensor] = {}

    def state_dict(self) -> dict:
        out = super().state_dict()
        out["q_memory"] = {k: v.detach().clone() for k, v in self.q_memory.items()}
        return out

    def load_state_dict(self, state: dict) -> None:
        super().load_state_dict(state)
        self.q_memory = {k: v.detach().clone() for k, v in state.get("q_memory", {}).items()}


def orthogonalize(matrices: torch.Tensor, epsilon: float = 0.0) -> torch.Tensor:
    """Orthonormalize the columns of a batch of matrices [b, rows, r] in place (fp32 or wider).

    Gram-Schmidt for r <= 2 (dividing by norm + epsilon, so a zero column stays zero instead of
    NaN), QR for wider ones (faster), as torch's ``powerSGD_hook``.
    """
    r = matrices.shape[2]
    if r <= 2:
        for i in range(r):
            col = matrices[:, :, i: i + 1]
            col /= torch.linalg.vector_norm(col, dim=1, keepdim=True) + epsilon
            if i + 1 < r:
                rest = matrices[:, :, i + 1:]
                rest -= torch.sum(col * rest, dim=1, keepdim=True) * col
    else:
        q, _ = torch.linalg.qr(matrices)
        torch.nan_to_num(q, out=matrices)
    return matrices


class PowerSGDCompressor(Compressor):
    """Rank-r PowerSGD with warm start, a start iteration and a minimum compression rate.

    Args:
        rank: the approximation rank r (capped at min(rows, cols) per matrix).
        start_iter: steps reduced exactly before compressing (torch's ``start_powerSGD_iter``).
        min_compression_rate: compress a matrix only if rows x cols > (rows + cols) r x this.
        warm_start: reuse the previous step's Q (better approximation for the same bytes).
        orthogonalization_epsilon: added to column norms (0 in torch's default; >0 avoids NaN for an
            all-zero gradient).
        batch_same_shape: batch same-shaped matrices into one bmm. Off by default, as in torch: the
            batch is a copy of the matrices (torch.stack), which on CPU costs more than the per-matrix
            products it replaces; on a GPU it saves kernel launches for models with many small layers.
    """

    name = "powersgd"
    summable = True
    biased = True
    needs_matrices = True
    rounds = ("all_reduce_p", "all_reduce_q")
    align = 1
    optimistic = True  # P and Q are all-reduced: identical on every rank
    State = PowerSGDState

    def __init__(self, rank: int = 1, start_iter: int = 10, min_compression_rate: float = 2.0,
                 warm_start: bool = True, orthogonalization_epsilon: float = 1e-8,
                 batch_same_shape: bool = False) -> None:
        super().__init__()
        if isinstance(rank, bool) or not isinstance(rank, int) or rank < 1:
            raise ValueError(f"PowerSGDCompressor: rank={rank!r} must be an int >= 1")
        if start_iter < 0:
            raise ValueError(f"PowerSGDCompressor: start_iter={start_iter} must be >= 0")
        if orthogonalization_epsilon < 0:
            raise ValueError(f"PowerSGDCompressor: orthogonalization_epsilon={orthogonalization_epsilon} "
                             f"must be >= 0")
        self.rank = rank
        self.start_iter = int(start_iter)
        self.min_compression_rate = float(min_compression_rate)
        self.warm_start = bool(warm_start)
        self.orthogonalization_epsilon = float(orthogonalization_epsilon)
        self.batch_same_shape = bool(batch_same_shape)

    def __setstate__(self, d: dict) -> None:
        q_memory = d.pop("q_memory", None)  # pickled before the warm starts moved to the state
        super().__setstate__(d)
        if q_memory is not None:
            self.default_state.q_memory = dict(q_memory)

    def config(self) -> dict:
        return {"name": self.name, "rank": self.rank, "start_iter": self.start_iter,
                "min_compression_rate": self.min_compression_rate, "warm_start": self.warm_start,
                "orthogonalization_epsilon": self.orthogonalization_epsilon}

    def active(self, step: int) -> bool:
        return step >= self.start_iter

    def matrix_shape(self, shape: tuple[int, ...]) -> tuple[int, int, int] | None:
        """(rows, cols, r) when a tensor of ``shape`` is worth compressing, else None."""
        if len(shape) < 2:
            return None
        rows, cols = shape[0], math.prod(shape[1:])
        r = min(rows, cols, self.rank)
        if r == 0 or (rows + cols) * r * self.min_compression_rate >= rows * cols:
            return None
        return rows, cols, r

    def _initial_q(self, key: str, cols: int, r: int, ex: Exchange) -> torch.Tensor:
        """Q for ``key``, stored transposed: [r, cols], contiguous (see :meth:`exchange`): the run's
        warm-start memory (``ex.state``) when it holds one of that shape, else a seeded draw."""
        memory = ex.state.q_memory if self.warm_start and isinstance(ex.state, PowerSGDState) else {}
        q = memory.get(key)
        if q is not None and q.shape == (r, cols):
            return q.to(ex.x.dtype)
        gen = torch.Generator().manual_seed(derive_seed(ex.seed, self.name, key, 0 if self.warm_start else ex.step))
        q = torch.randn(cols, r, generator=gen, dtype=torch.float64).t()
        return q.to(dtype=ex.x.dtype, device=ex.x.device, memory_format=torch.contiguous_format)

    def exchange(self, ex: Exchange) -> Rounds:
        # Q is kept transposed, [r, cols] contiguous, and every product reads M row by row:
        # P = M (Q^T)^T, Q^T = P^T M, result = P Q^T. The same products with Q as [cols, r] (M^T P
        # in particular) run 3-5x slower on CPU BLAS: a skinny output with r columns.
        x, n = ex.x, ex.n

        # ---- (1) P = M Q, all-reduced together with the tensors reduced exactly.
        # Elements reduced exactly: tensors not worth compressing (as slices of x, no mask over all
        # of it). Padding between sections (not in any tensor) is not sent at all.
        exact: list[tuple[int, int, str]] = []
        batches: dict[tuple, list] = {}
        for key, off, shape in ex.tensors:
            dims = self.matrix_shape(shape)
            if dims is None:
                exact.append((off, math.prod(shape), key))
                continue
            group_key = dims if self.batch_same_shape else (key,)
            batches.setdefault(group_key, []).append((key, off, dims))
        n_exact = sum(n for _, n, _ in exact)
        sizes = [len(entries) * entries[0][2][0] * entries[0][2][2] for entries in batches.values()]
        # One buffer: the exact elements, then every batch's P, computed straight into it, then the
        # input's tag (checked right after the all-reduce: no check phase compared the inputs).
        tail = 0 if ex.tag is None else TAG_LEN
        buf = x.new_empty(n_exact + sum(sizes) + tail)
        if tail:
            buf[buf.numel() - tail:].copy_(ex.tag)
        pos = 0
        for off, size, _ in exact:
            buf[pos: pos + size].copy_(x[off: off + size])
            pos += size
        plan = []
        for entries, size in zip(batches.values(), sizes):
            rows, cols, r = entries[0][2]
            p = buf[pos: pos + size].view(len(entries), rows, r)
            pos += size
            if len(entries) == 1:  # views, no copy
                m = x[entries[0][1]: entries[0][1] + rows * cols].view(1, rows, cols)
                qt = self._initial_q(entries[0][0], cols, r, ex).unsqueeze(0)
            else:
                m = torch.stack([x[off: off + rows * cols].view(rows, cols) for _, off, _ in entries])
                qt = torch.stack([self._initial_q(key, cols, r, ex) for key, _, _ in entries])
            torch.bmm(m, qt.transpose(1, 2), out=p)
            plan.append((entries, m, p))
        sent = round_all_reduce(ex, 0, buf)()  # the group's all-reduce, or the algorithm's route (synth)
        if tail:
            check_tag(ex, buf[buf.numel() - tail:], f"compress/{self.name}/all_reduce_p")
        exact_sum = buf[:n_exact]
        yield sent
        # The reduced buffer is identical on every rank: NaN/Inf anywhere in x reaches it (through
        # the exact elements or P's rows), so every rank agrees to fall back (optimistic).
        if not all_finite(buf):
            return Result(None, nonfinite=True)

        # ---- (2) Q = M^T P (P orthogonalized), all-reduced.
        sizes = [p.shape[0] * p.shape[2] * m.shape[2] for _, m, p in plan]
        buf = x.new_empty(sum(sizes))
        qts, pos = [], 0
        for (_, m, p), size in zip(plan, sizes):
            orthogonalize(p, self.orthogonalization_epsilon)
            qt = buf[pos: pos + size].view(p.shape[0], p.shape[2], m.shape[2])
            torch.bmm(p.transpose(1, 2), m, out=qt)
            qts.append(qt)
            pos += size
        local = buf.clone() if ex.sent is not None else None
        finish = round_all_reduce(ex, 1, buf)  # started now where the group's own (a route runs at finish())
        # While Q is being reduced, everything that needs only this rank's values: the exact
        # elements' sums (from round 1), zeros in the padding, and the error feedback, which
        # ``sent`` receives as the residual itself: x - P Q_local^T, one fused product per matrix
        # (the exact elements were sent as they are: residual zero). A non-finite Q discards it.
        out, sent = ex.out, ex.sent
        covered = []
        pos = 0
        for off, size, _ in exact:
            if ex.dest is None:
                out[off: off + size].copy_(exact_sum[pos: pos + size])
            if sent is not None:
                sent[off: off + size].zero_()
            covered.append((off, size))
            pos += size
        pos = 0
        for (entries, _, p), qt in zip(plan, qts):
            mine = local[pos: pos + qt.numel()].view_as(qt) if local is not None else None
            pos += qt.numel()
            for i, (_, off, (rows, cols, _)) in enumerate(entries):
                if mine is not None:
                    torch.addmm(x[off: off + rows * cols].view(rows, cols), p[i], mine[i], alpha=-1,
                                out=sent[off: off + rows * cols].view(rows, cols))
                covered.append((off, rows * cols))
        # Padding between sections (hierarchical) is in no tensor: zeros, never stale memory.
        end = 0
        for off, size in sorted(covered):
            if off > end:
                out[end: off].zero_()
                if sent is not None:
                    sent[end: off].zero_()
            end = max(end, off + size)
        if end < out.numel():
            out[end:].zero_()
            if sent is not None:
                sent[end:].zero_()
        yield finish()
        if not all_finite(buf):
            return Result(None, nonfinite=True)  # identical on every rank: reduced exactly instead

        # ---- The result, P Q^T: into the tensors themselves when the reduction offers them
        # (ex.dest, scaled there: the average), else into out; the averaged Q is the next warm start.
        dest = dict(zip((key for key, _, _ in ex.tensors), ex.dest)) if ex.dest is not None else None
        memory = ex.state.q_memory if self.warm_start and isinstance(ex.state, PowerSGDState) else None
        scale = ex.dest_scale if dest is not None else 1.0
        if dest is not None:
            pos = 0
            for _, size, key in exact:
                torch.mul(exact_sum[pos: pos + size], scale, out=dest[key].view(-1))
                pos += size
        for (entries, _, p), qt_sum in zip(plan, qts):  # qt_sum: a view of the reduced buffer
            for i, (key, off, (rows, cols, _)) in enumerate(entries):
                if dest is not None:
                    torch.mm(p[i], qt_sum[i] * scale, out=dest[key].view(rows, cols))
                else:
                    torch.mm(p[i], qt_sum[i], out=out[off: off + rows * cols].view(rows, cols))
                if memory is not None:
                    memory[key] = qt_sum[i] / n
        return Result(out, residual=sent is not None, written=dest is not None)

    def payload_bytes(self, numel: int, n: int) -> int:
        raise NotImplementedError("PowerSGD's payload depends on the tensors' shapes; see shapes_bytes()")

    def exchange_bytes(self, numel: int, shapes: list[tuple[int, ...]], n: int) -> int:
        return self.shapes_bytes(shapes, n)

    def shapes_bytes(self, shapes: list[tuple[int, ...]], n: int, itemsize: int = 4) -> int:
        """Bytes one rank sends to reduce tensors of ``shapes`` over ``n`` ranks."""
        elems = 0
        for shape in shapes:
            dims = self.matrix_shape(shape)
            elems += math.prod(shape) if dims is None else (dims[0] + dims[1]) * dims[2]
        return int(2 * (n - 1) / n * elems * itemsize)
