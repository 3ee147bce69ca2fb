"""Models used by the benchmarks and examples (docs/architecture.md section 5.9):
a small GPT-style model and an MoE layer.

Nothing in commopt imports this module (``bench`` is the top of the dependency order).
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch import nn

from commopt.comm import Topology
from commopt.comm.alltoall import all_to_all
from commopt.schedules.moe import exchange_compute, permute_rows

__all__ = ["MoE", "GPT", "synthetic_tokens"]


# ---------------------------------------------------------------------------------------------------
# MoE: an expert-parallel mixture-of-experts feed-forward layer over commopt's all-to-all.


class MoE(nn.Module):
    """Mixture-of-experts feed-forward layer with experts spread over the ranks of ``group``.

    Rank r holds experts ``r * E/p ... (r+1) * E/p - 1``; the gate is replicated. Forward phases:
    (1) gate: softmax over the E experts, top-k (k=1 as in Switch, k=2 as in GShard, the two gates
    renormalised to sum to 1); (2) capacity: each expert takes at most ``ceil(capacity_factor * k * T
    / E)`` of this rank's T tokens, first choices before second choices and tokens in order, so that
    routing is a deterministic function of the gate; tokens over capacity are dropped for that expert
    (they contribute zero: add a residual outside); (3) dispatch: kept (token, expert) rows sorted by
    expert and sent with an uneven all-to-all (the per-expert counts are exchanged first, one small
    all-to-all, because real routing is uneven); (4) each local expert, a two-layer GELU MLP, on its
    rows; (5) combine: the reverse all-to-all; (6) each token's output is the gate-weighted sum of its
    experts' rows. With ``overlap_degree`` > 1, (3)-(5) are chunked and overlapped
    (``commopt.schedules.moe.exchange_compute``).

    Args:
        d_model: token width.
        d_hidden: expert MLP hidden width.
        num_experts: E, a multiple of the group's size.
        top_k: 1 or 2.
        capacity_factor: slack over a perfectly balanced load (1.0: exactly k*T/E per expert).
        overlap_degree: chunks in flight for the all-to-all / expert overlap (1: unchunked).
        group, topology, algorithm: passed to ``commopt.comm.all_to_all``.
        seed: every rank draws all E experts and the gate from this seed and keeps its own experts,
            so all ranks hold one consistent model whatever their number.
        dtype: parameter dtype.
    """

    def __init__(self, d_model: int, d_hidden: int, num_experts: int, *, top_k: int = 1,
                 capacity_factor: float = 1.25, overlap_degree: int = 1, group=None,
                 topology: Topology | None = None, algorithm: str = "auto", seed: int = 0,
                 dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        world = dist.get_world_size(group) if dist.is_initialized() else 1
        rank = dist.get_rank(group) if dist.is_initialized() else 0
        if top_k not in (1, 2):
            raise ValueError(f"MoE: top_k={top_k}; supported: 1 (Switch) and 2 (GShard)")
        if num_experts < top_k or num_experts % world:
            raise ValueError(f"MoE: num_experts={num_experts} must be >= top_k and a multiple of the group "
                             f"size {world} (each rank holds num_experts / world_size experts)")
        if capacity_factor <= 0:
            raise ValueError(f"MoE: capacity_factor={capacity_factor} must be positive")
        self.d_model, self.num_experts, self.top_k = d_model, num_experts, top_k
        self.capacity_factor, self.overlap_degree = capacity_factor, overlap_degree
        self.world, self.local_experts = world, num_experts // world
        self.comm = {"group": group, "topology": topology, "algorithm": algorithm}
        g = torch.Generator().manual_seed(seed)
        self.gate = nn.Linear(d_model, num_experts, bias=False, dtype=dtype)
        mine = slice(rank * self.local_experts, (rank + 1) * self.local_experts)
        with torch.no_grad():
            self.gate.weight.copy_(torch.randn(num_experts, d_model, generator=g, dtype=dtype) / d_model ** 0.5)
            w1 = torch.randn(num_experts, d_model, d_hidden, generator=g, dtype=dtype) / d_model ** 0.5
            b1 = torch.randn(num_experts, d_hidden, generator=g, dtype=dtype) * 0.1
            w2 = torch.randn(num_experts, d_hidden, d_model, generator=g, dtype=dtype) / d_hidden ** 0.5
            b2 = torch.randn(num_experts, d_model, generator=g, dtype=dtype) * 0.1
        self.w1, self.b1 = nn.Parameter(w1[mine].clone()), nn.Parameter(b1[mine].clone())
        self.w2, self.b2 = nn.Parameter(w2[mine].clone()), nn.Parameter(b2[mine].clone())

    def capacity(self, tokens: int) -> int:
        """Rows each expert accepts from one rank's ``tokens`` tokens."""
        return math.ceil(self.capacity_factor * self.top_k * tokens / self.num_experts)

    def route(self, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Phases (1)-(2): ``(expert, token, gate)`` of every kept assignment, sorted by expert (stable,
        so first choices precede second choices and tokens keep their order within an expert)."""
        probs = torch.softmax(self.gate(tokens), dim=-1)
        top_p, top_e = probs.topk(self.top_k, dim=-1)
        gates = top_p / top_p.sum(dim=-1, keepdim=True) if self.top_k > 1 else top_p
        t = tokens.shape[0]
        experts = top_e.t().reshape(-1)  # choice-major: every first choice before any second
        token_ids = torch.arange(t, device=tokens.device).repeat(self.top_k)
        weights = gates.t().reshape(-1)
        onehot = torch.nn.functional.one_hot(experts, self.num_experts)
        position = onehot.cumsum(0).gather(1, experts[:, None]).squeeze(1) - 1
        keep = position < self.capacity(t)
        experts, token_ids, weights = experts[keep], token_ids[keep], weights[keep]
        order = torch.argsort(experts, stable=True)
        return experts[order], token_ids[order], weights[order]

    def _experts(self, rows: torch.Tensor, segments: list) -> torch.Tensor:
        """Phase (4) on rows grouped source-major, expert-minor (``segments[s][j]`` rows)."""
        local, sources = self.local_experts, len(segments)
        sizes = [segments[s][j] for s in range(sources) for j in range(local)]
        by_expert = [s * local + j for j in range(local) for s in range(sources)]
        x = permute_rows(rows, sizes, by_expert)
        per_expert = [sum(segments[s][j] for s in range(sources)) for j in range(local)]
        outs = []
        for j, part in enumerate(x.split(per_expert)):
            hidden = torch.nn.functional.gelu(part @ self.w1[j] + self.b1[j])
            outs.append(hidden @ self.w2[j] + self.b2[j])
        y = torch.cat(outs) if outs else x
        back = [0] * len(by_expert)
        for i, o in enumerate(by_expert):
            back[o] = i
        return permute_rows(y, [sizes[o] for o in by_expert], back)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` of shape ``(..., d_model)`` -> the same shape."""
        shape = x.shape
        tokens = x.reshape(-1, self.d_model)
        experts, token_ids, weights = self.route(tokens)
        counts = torch.bincount(experts, minlength=self.num_experts).view(self.world, self.local_experts)
        # Phase (3)'s metadata: how many rows of each of my experts every rank sends.
        recv_counts = all_to_all(None, counts, **self.comm)
        rows = tokens[token_ids]
        back = exchange_compute(rows, counts.tolist(), recv_counts.tolist(), self._experts,
                                degree=self.overlap_degree, **self.comm)
        out = torch.zeros_like(tokens).index_add(0, token_ids, back * weights[:, None])
        return out.reshape(shape)


# ---------------------------------------------------------------------------------------------------
# GPT: a small decoder-only transformer, the model of ``commopt-bench ddp``.


class _Block(nn.Module):
    def __init__(self, d_model: int, n_heads: int) -> None:
        super().__init__()
        self.n_heads = n_heads
        self.ln1, self.ln2 = nn.LayerNorm(d_model), nn.LayerNorm(d_model)
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.proj = nn.Linear(d_model, d_model)
        self.fc1, self.fc2 = nn.Linear(d_model, 4 * d_model), nn.Linear(4 * d_model, d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=-1)
        heads = lambda z: z.view(b, t, self.n_heads, d // self.n_heads).transpose(1, 2)
        att = torch.nn.functional.scaled_dot_product_attention(heads(q), heads(k), heads(v), is_causal=True)
        x = x + self.proj(att.transpose(1, 2).reshape(b, t, d))
        return x + self.fc2(torch.nn.functional.gelu(self.fc1(self.ln2(x))))


class GPT(nn.Module):
    """A small GPT-style language model: token and position embeddings, ``n_layers`` pre-norm blocks
    (causal self-attention, GELU MLP), a final norm and an untied output head.

    Its gradients are mostly large matrices (attention, MLP, embeddings, head) plus a few vectors
    (biases, norms): the mix that gradient compressors meet in practice.

    Args:
        vocab: vocabulary size.
        d_model: width (a multiple of ``n_heads``).
        n_layers: transformer blocks.
        n_heads: attention heads.
        seq_len: longest sequence (position embeddings).
        seed: parameters are drawn from this seed (a private generator), identical on every rank.
    """

    def __init__(self, vocab: int = 256, d_model: int = 128, n_layers: int = 2, n_heads: int = 4,
                 seq_len: int = 64, *, seed: int = 0) -> None:
        super().__init__()
        if d_model % n_heads:
            raise ValueError(f"GPT: d_model={d_model} must be a multiple of n_heads={n_heads}")
        self.tok = nn.Embedding(vocab, d_model)
        self.pos = nn.Embedding(seq_len, d_model)
        self.blocks = nn.ModuleList(_Block(d_model, n_heads) for _ in range(n_layers))
        self.ln = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, vocab, bias=False)
        g = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for name, p in self.named_parameters():
                if p.dim() >= 2:
                    p.copy_(torch.randn(p.shape, generator=g) * 0.02)
                elif name.endswith("weight"):
                    p.fill_(1.0)
                else:
                    p.zero_()

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """``tokens`` (batch, time) int64 -> logits (batch, time, vocab)."""
        pos = torch.arange(tokens.shape[1], device=tokens.device)
        x = self.tok(tokens) + self.pos(pos)
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln(x))


def synthetic_tokens(batch: int, seq_len: int, vocab: int, *, seed: int) -> torch.Tensor:
    """A learnable synthetic language: each token is (7 x previous + 3) mod vocab with probability
    0.9, else uniform. Returns ``(batch, seq_len + 1)`` int64 tokens (inputs and shifted targets)."""
    g = torch.Generator().manual_seed(seed)
    out = torch.empty(batch, seq_len + 1, dtype=torch.int64)
    out[:, 0] = torch.randint(vocab, (batch,), generator=g)
    noise = torch.rand(batch, seq_len, generator=g) < 0.1
    rand = torch.randint(vocab, (batch, seq_len), generator=g)
    for t in range(seq_len):
        nxt = (out[:, t] * 7 + 3) % vocab
        out[:, t + 1] = torch.where(noise[:, t], rand[:, t], nxt)
    return out
