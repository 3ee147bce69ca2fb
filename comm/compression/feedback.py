"""The one error-feedback memory, keyed by parameter name: one per consumer state, checkpointable.

Biased compressors (top-k, signs, PowerSGD), and quantizers that round to nearest, converge only if
what they drop is remembered and added back next step (Seide et al. 2014; Karimireddy et al. 2019).
The memory is keyed by the parameter's stable key (its name in the model), never by a DDP bucket
index: DDP rebuilds its buckets after the first iteration, and a memory keyed by bucket would then add
one parameter's residual to another's gradient (and keep both layouts alive).

Every consumer holds one :class:`ErrorFeedback` (a DDP hook state, a standalone ``all_reduce``'s
caller, each FSDP2 comm, the HSDP hook), which stores residuals in one of two ways, both keyed by
parameter name in its checkpoints:

- per key (the DDP hook, ``all_reduce``, ``reduce_tensors``): one flat tensor per (kind, parameter);
  kinds ``worker`` (this rank's compression error of its own contribution) and ``server`` (the
  error of re-compressing an aggregated chunk, the 1-bit all-reduce). Positions a rank does not own
  in the current layout (another local rank's shard in hierarchical mode, another rank's server
  chunk) are kept at zero: when the layout changes, residuals of elements that change owner are
  dropped (a documented reset), never applied twice. :meth:`state_dict` is
  ``{"worker": {name: Tensor}, "server": {name: Tensor}}``;
- per module (the FSDP2 comms, which quantize a module's flat buffer level by level): the residuals
  of a module's parameters side by side as FSDP lays out one rank's row (:class:`Layout`), one fp32
  tensor ``(*rows, width)`` per level, so that an exchange reads a row of residuals as one vector;
  with the module's step counter. :meth:`module_state_dict` is ``{"meta": {...}, "residuals":
  {"<level>/<name>": Tensor[*rows, numel]}, "steps": {"<module>": int}}`` (a parameter's columns
  of every row).

Both hold plain tensors, ints and strings only (``torch.load(weights_only=True)`` accepts them).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["ErrorFeedback", "Layout"]

_KINDS = ("worker", "server")


@dataclass(frozen=True)
class Layout:
    """One FSDP module's flat buffer: every parameter's name and padded shard size, in FSDP's order.

    Attributes:
        key: the module's name in the model ("" for the root).
        names: parameter names (from the root), in the order FSDP concatenates them.
        numels: each parameter's padded shard size (elements of one rank's row).
        shapes: each parameter's padded shard shape (FSDP2 shards dim 0: ``(ceil(rows / world),
            *rest)``), what matrix compressors (PowerSGD) see; empty when unknown.
    """

    key: str
    names: tuple[str, ...]
    numels: tuple[int, ...]
    shapes: tuple[tuple[int, ...], ...] = ()

    @property
    def chunk(self) -> int:
        """Elements of one rank's row of the buffer."""
        return sum(self.numels)

    def offsets(self) -> list[int]:
        out, pos = [], 0
        for n in self.numels:
            out.append(pos)
            pos += n
        return out


class ErrorFeedback:
    """Residual memory for error feedback, keyed by parameter name (see the module docstring).

    Per-key residuals are created lazily, in the compute dtype (fp32, or fp64 for fp64 gradients), on
    the gradient's device. A key reused with a different size is an error (a parameter changed shape:
    build a new ``ErrorFeedback`` or ``reset()``). Per-module residuals are fp32.

    Attributes:
        residuals: per key: ``{kind: {name: Tensor}}``.
        layouts: per module: the :class:`Layout` its residuals follow now.
        buffers: per module: ``{level: Tensor(*rows, width)}``.
        steps: per module: the calls made so far (seeds rounding).
    """

    def __init__(self) -> None:
        self.residuals: dict[str, dict[str, torch.Tensor]] = {k: {} for k in _KINDS}
        self.layouts: dict[str, Layout] = {}
        self.buffers: dict[str, dict[str, torch.Tensor]] = {}
        self.steps: dict[str, int] = {}

    def __setstate__(self, d: dict) -> None:
        # An ErrorFeedback pickled before it held per-module residuals too.
        self.__dict__.update(d)
        for name in ("layouts", "buffers", "steps"):
            self.__dict__.setdefault(name, {})

    # ------------------------------------------------------------------------------- per key
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
        per_key = sum(t.numel() for k in kinds if k in self.residuals for t in self.residuals[k].values())
        per_module = sum(t.numel() for levels in self.buffers.values() for level, t in levels.items()
                         if kind is None or level == kind)
        return per_key + per_module

    def reset(self) -> None:
        """Forget every residual (and step counter): a documented reset after changing the model."""
        for k in _KINDS:
            self.residuals[k].clear()
        self.layouts.clear()
        self.buffers.clear()
        self.steps.clear()

    def state_dict(self) -> dict:
        """The per-key residuals: nested dicts of tensors (``torch.load(weights_only=True)`` accepts them)."""
        return {k: {key: t.detach().clone() for key, t in self.residuals[k].items()} for k in _KINDS}

    def load_state_dict(self, state: dict) -> None:
        """Restore :meth:`state_dict` (the per-key residuals)."""
        for k in _KINDS:
            self.residuals[k] = {key: t.detach().clone() for key, t in state.get(k, {}).items()}

    # ------------------------------------------------------------------------------- per module
    def rows(self, layout: Layout, level: str, rows: tuple[int, ...], device: torch.device,
             width: int | None = None) -> torch.Tensor:
        """The ``(*rows, width)`` residual of ``level`` of module ``layout.key`` (``width``: the row
        length, default the layout's chunk; a wider row holds zero padding past the last parameter)."""
        width = layout.chunk if width is None else width
        store = self.buffers.setdefault(layout.key, {})
        t = store.get(level)
        if t is not None and tuple(t.shape[:-1]) == tuple(rows) and t.shape[-1] <= width:
            if t.shape[-1] < width or t.device != device:
                grown = torch.zeros(*rows, width, dtype=torch.float32, device=device)
                grown[..., : t.shape[-1]] = t
                t = store[level] = grown
            return t
        t = store[level] = torch.zeros(*rows, width, dtype=torch.float32, device=device)
        return t

    def use(self, layout: Layout, reset: tuple[str, ...] = ()) -> None:
        """Lay the residuals of module ``layout.key`` out by ``layout``: the parameters FSDP2 reduces in
        this call (those that require gradients; freezing or unfreezing one changes it).

        A parameter in both layouts keeps its residual (moved to its new columns); one that joins
        starts from zero; one that leaves (frozen: it is never sent again) drops its residual. The
        levels named in ``reset`` start from zero when the layout changes (a residual whose columns
        change owner with it, such as the HSDP hook's server residual of this rank's chunk).
        """
        old = self.layouts.get(layout.key)
        self.layouts[layout.key] = layout
        levels = self.buffers.get(layout.key)
        if old is None or old == layout or not levels:
            return
        where = {name: (off, n) for name, off, n in zip(old.names, old.offsets(), old.numels)}
        moved = {}
        for level, t in levels.items():
            new = t.new_zeros(*t.shape[:-1], layout.chunk)
            if level not in reset:
                for name, off, n in zip(layout.names, layout.offsets(), layout.numels):
                    if name in where and where[name][1] == n:
                        src = where[name][0]
                        new[..., off: off + n] = t[..., src: src + n]
            moved[level] = new
        self.buffers[layout.key] = moved

    def module_state_dict(self, meta: dict) -> dict:
        """The per-module residuals per parameter name, and the step counters, with ``meta`` (the
        settings a checkpoint must match): the FSDP2 comms' checkpoint format."""
        residuals = {}
        for key, levels in self.buffers.items():
            layout = self.layouts[key]
            for level, t in levels.items():
                for name, off, n in zip(layout.names, layout.offsets(), layout.numels):
                    residuals[f"{level}/{name}"] = t[..., off: off + n].detach().clone().cpu()
        return {"meta": dict(meta), "residuals": residuals, "steps": dict(self.steps)}

    def load_module_state_dict(self, state: dict, meta: dict, where: str) -> None:
        """Restore :meth:`module_state_dict` into the modules laid out so far (:meth:`use`).

        Raises:
            ValueError: the checkpoint's ``meta`` differs from ``meta`` (residuals do not transfer
                between world sizes, layouts or compressors), or it names a parameter no module holds.
        """
        saved = state.get("meta", {})
        if saved != meta:
            diff = {k: (saved.get(k), meta.get(k)) for k in sorted(set(saved) | set(meta))
                    if saved.get(k) != meta.get(k)}
            raise ValueError(f"{where}: the checkpoint was taken with other settings ({diff}, saved vs now): "
                             f"residuals do not transfer between world sizes, layouts or compressors; build a "
                             f"fresh comm (a documented reset) or resume with the saved settings")
        by_param = {}
        for key, layout in self.layouts.items():
            for name, off, n in zip(layout.names, layout.offsets(), layout.numels):
                by_param[name] = (key, off, n)
        new: dict[str, dict[str, torch.Tensor]] = {}
        for full, t in state.get("residuals", {}).items():
            level, _, name = full.partition("/")
            if name not in by_param:
                raise ValueError(f"{where}: the checkpoint holds a residual of parameter {name!r}, which no "
                                 f"module registered with this comm reduces (it is not in the model, or it is "
                                 f"frozen: requires_grad=False); register the same model, with the same "
                                 f"parameters frozen, first")
            key, off, n = by_param[name]
            if t.dim() < 1 or t.shape[-1] != n:
                raise ValueError(f"{where}: residual {full!r} has shape {tuple(t.shape)}, expected (..., {n})")
            buf = new.setdefault(key, {}).get(level)
            if buf is None:
                buf = new[key][level] = torch.zeros(*t.shape[:-1], self.layouts[key].chunk, dtype=torch.float32)
            buf[..., off: off + n] = t
        self.buffers = new
        self.steps = {k: int(v) for k, v in state.get("steps", {}).items()}
