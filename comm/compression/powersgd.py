"""PowerSGD (Vogels et al. 2019): rank-r approximation by one step of power iteration.

Per matrix M (a gradient reshaped to rows x cols, plus its residual): (1) P = M Q, all-reduce P,
orthogonalize P (Gram-Schmidt in fp32 or fp64 with an epsilon, or QR for r > 2, as torch does);
(2) Q = M^T P, all-reduce Q; the result is P Q^T. Both payloads are summable, so the rounds are
plain all-reduces: (rows + cols) r elements instead of rows x cols. Tensors that are not worth it
(vectors, and matrices with (rows + cols) r x min_compression_rate >= rows x cols, decided from
shapes) ride exactly in round 1's buffer. Same-shaped matrices are batched (one bmm per shape).

Warm start keeps each matrix's averaged Q (identical on every rank) for the next step, keyed by the
parameter's stable key. Initial Q are drawn from a generator seeded with (seed, parameter key[,
step]), identical on every rank, never from the global RNG. Before ``start_iter`` the exchange is an
exact all-reduce, as in torch's hook.

Error feedback: the residual is M - P Q_local^T, this rank's own approximation (P is shared), so that
sum over ranks of what each rank transmitted is exactly the result (torch keeps M - P Q_mean^T,
which conserves only the sum over ranks).
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch.distributed import ReduceOp

from .base import Compressor, Job, Round, derive_seed, wait_work

__all__ = ["PowerSGDCompressor"]


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
        matrices.copy_(torch.nan_to_num(q))
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
        batch_same_shape: batch same-shaped matrices into one bmm.
    """

    name = "powersgd"
    summable = True
    biased = True
    needs_matrices = True
    n_rounds = 2
    align = 1

    def __init__(self, rank: int = 1, start_iter: int = 10, min_compression_rate: float = 2.0,
                 warm_start: bool = True, orthogonalization_epsilon: float = 1e-8, batch_same_shape: bool = True):
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
        self.q_memory: dict[str, torch.Tensor] = {}

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

    def rounds(self) -> list[Round]:
        return [Round("all_reduce_p", self._p_round), Round("all_reduce_q", self._q_round)]

    def _initial_q(self, key: str, cols: int, r: int, job: Job) -> torch.Tensor:
        q = self.q_memory.get(key) if self.warm_start else None
        if q is not None and q.shape == (cols, r):
            return q.to(job.x.dtype)
        gen = torch.Generator().manual_seed(derive_seed(job.seed, self.name, key, 0 if self.warm_start else job.step))
        return torch.randn(cols, r, generator=gen, dtype=torch.float64).to(job.x.dtype).to(job.x.device)

    def _p_round(self, job: Job) -> int:
        x = job.x
        # Elements reduced exactly: tensors not worth compressing. Padding between sections (not in
        # any tensor) is not sent at all.
        exact = torch.zeros(x.numel(), dtype=torch.bool, device=x.device)
        batches: dict[tuple, list] = {}
        for key, off, shape in job.tensors:
            dims = self.matrix_shape(shape)
            if dims is None:
                exact[off: off + math.prod(shape)] = True
                continue
            group_key = dims if self.batch_same_shape else (key,)
            batches.setdefault(group_key, []).append((key, off, dims))
        plan = []
        pieces = [x[exact]]
        for entries in batches.values():
            rows, cols, r = entries[0][2]
            m = torch.stack([x[off: off + rows * cols].view(rows, cols) for _, off, _ in entries])
            q = torch.stack([self._initial_q(key, cols, r, job) for key, _, _ in entries])
            p = torch.bmm(m, q)
            plan.append((entries, m, p))
            pieces.append(p.reshape(-1))
        buf = torch.cat(pieces)
        if buf.numel():
            wait_work(dist.all_reduce(buf, op=ReduceOp.SUM, group=job.group, async_op=True), job.timeout)
        pos = int(exact.sum())
        job.scratch.update(exact=exact, exact_sum=buf[:pos], plan=[])
        for entries, m, p in plan:
            p.view(-1).copy_(buf[pos: pos + p.numel()])
            pos += p.numel()
            job.scratch["plan"].append((entries, m, p))
        return int(2 * (job.n - 1) / job.n * buf.numel() * buf.element_size())

    def _q_round(self, job: Job) -> int:
        x, sc = job.x, job.scratch
        qs = []
        for _, m, p in sc["plan"]:
            orthogonalize(p, self.orthogonalization_epsilon)
            qs.append(torch.bmm(m.transpose(1, 2), p))
        buf = torch.cat([q.reshape(-1) for q in qs]) if qs else x.new_empty(0)
        local = buf.clone() if job.sent is not None else None
        if buf.numel():
            wait_work(dist.all_reduce(buf, op=ReduceOp.SUM, group=job.group, async_op=True), job.timeout)
        exact = sc["exact"]
        job.out.zero_()
        job.out[exact] = sc["exact_sum"]
        if job.sent is not None:
            job.sent.zero_()
            job.sent[exact] = x[exact]
        pos = 0
        for (entries, _, p), q in zip(sc["plan"], qs):
            q_sum = buf[pos: pos + q.numel()].view_as(q)
            approx = torch.bmm(p, q_sum.transpose(1, 2))
            mine = torch.bmm(p, local[pos: pos + q.numel()].view_as(q).transpose(1, 2)) if local is not None else None
            pos += q.numel()
            for i, (key, off, (rows, cols, _)) in enumerate(entries):
                job.out[off: off + rows * cols] = approx[i].reshape(-1)
                if mine is not None:
                    job.sent[off: off + rows * cols] = mine[i].reshape(-1)
                if self.warm_start:
                    self.q_memory[key] = (q_sum[i] / job.n).clone()
        sc.clear()
        return int(2 * (job.n - 1) / job.n * buf.numel() * buf.element_size())

    def payload_bytes(self, numel: int, n: int) -> int:
        raise NotImplementedError("PowerSGD's payload depends on the tensors' shapes; see shapes_bytes()")

    def shapes_bytes(self, shapes: list[tuple[int, ...]], n: int, itemsize: int = 4) -> int:
        """Bytes one rank sends to reduce tensors of ``shapes`` over ``n`` ranks."""
        elems = 0
        for shape in shapes:
            dims = self.matrix_shape(shape)
            elems += math.prod(shape) if dims is None else (dims[0] + dims[1]) * dims[2]
        return int(2 * (n - 1) / n * elems * itemsize)

    def state_dict(self) -> dict:
        out = super().state_dict()
        out["q_memory"] = {k: v.detach().clone() for k, v in self.q_memory.items()}
        return out

    def load_state_dict(self, state: dict) -> None:
        super().load_state_dict(state)
        self.q_memory = {k: v.detach().clone() for k, v in state.get("q_memory", {}).items()}
