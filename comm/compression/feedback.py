"""Error-feedback memory, keyed by a stable key per parameter.

Biased compressors (top-k, signs, PowerSGD) converge only if what they drop is remembered and added
back next step (Seide et al. 2014; Karimireddy et al. 2019). The memory is keyed by the parameter's
stable key (its name in the model), never by a DDP bucket index: DDP rebuilds its buckets after the
first iteration, and a memory keyed by bucket would then add one parameter's residual to another's
gradient (and keep both layouts alive). So memory stays one tensor per parameter, whatever the
bucket layout.

Two kinds: ``worker`` residuals (this rank's compression error of its own contribution) and
``server`` residuals (the error of re-compressing an aggregated chunk, 1-bit all-reduce). Positions
a rank does not own in the current layout (another local rank's shard in hierarchical mode, another
rank's server chunk) are kept at zero: when the layout changes, residuals of elements that change
owner are dropped (a documented reset), never applied twice.
"""

from __future__ import annotations

import torch

__all__ = ["ErrorFeedback"]

_KINDS = ("worker", "server")


class ErrorFeedback:
    """Residual memory for error feedback, one flat tensor per (kind, key).

    Residuals are created lazily, in the compute dtype (fp32, or fp64 for fp64 gradients), on the
    gradient's device. A key reused with a different size is an error (a parameter changed shape:
    build a new ``ErrorFeedback`` or ``reset()``).
    """

    def __init__(self) -> None:
        self.residuals: dict[str, dict[str, torch.Tensor]] = {k: {} for k in _KINDS}

    def get(self, kind: str, keys: list[str], numels: list[int], dtype: torch.dtype,
            device: torch.device) -> list[torch.Tensor]:
        """The residual tensors of ``keys`` (created as zeros on first use)."""
        store = self.residuals[kind]
        out = []
        for key, numel in zip(keys, numels):
            r = store.get(key)
            if r is None:
                r = store[key] = torch.zeros(numel, dtype=dtype, device=device)
            elif r.numel() != numel:
                raise ValueError(f"error feedback: parameter {key!r} had {r.numel()} elements and now has "
                                 f"{numel}; call ErrorFeedback.reset() after changing the model")
            elif r.dtype != dtype or r.device != device:
                r = store[key] = r.to(dtype=dtype, device=device)
            out.append(r)
        return out

    def adopt(self, kind: str, key: str, residual: torch.Tensor) -> None:
        """Make ``residual`` (a view is fine) the residual of ``key``, without copying it."""
        old = self.residuals[kind].get(key)
        if old is not None and old.numel() != residual.numel():
            raise ValueError(f"error feedback: parameter {key!r} had {old.numel()} elements and now has "
                             f"{residual.numel()}; call ErrorFeedback.reset() after changing the model")
        self.residuals[kind][key] = residual

    def numel(self, kind: str | None = None) -> int:
        """Elements held (for memory checks: O(model), whatever DDP's bucket layout)."""
        kinds = _KINDS if kind is None else (kind,)
        return sum(t.numel() for k in kinds for t in self.residuals[k].values())

    def reset(self) -> None:
        for k in _KINDS:
            self.residuals[k].clear()

    def state_dict(self) -> dict:
        """Nested dicts of tensors (``torch.load(weights_only=True)`` accepts them)."""
        return {k: {key: t.detach().clone() for key, t in self.residuals[k].items()} for k in _KINDS}

    def load_state_dict(self, state: dict) -> None:
        for k in _KINDS:
            self.residuals[k] = {key: t.detach().clone() for key, t in state.get(k, {}).items()}
