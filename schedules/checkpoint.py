"""The optimizer checkpoint of ``OverlapDataParallel``: one optimizer per bucket, saved by parameter name.

There is no single ``optimizer.state_dict()``: each bucket steps by its own optimizer, and torch
numbers parameters per optimizer. :func:`optimizer_state_dict` therefore keys every state entry and
every parameter group by parameter *name*, with the parameter shapes; :func:`load_optimizer_state_dict`
validates all of it before changing anything and loads it into optimizers over any other bucket
layout of the same model. The result holds only tensors, numbers, strings, lists, tuples and dicts,
so ``torch.load(..., weights_only=True)`` reads it back. The format string names the layout of the
dict; a checkpoint of another format is refused.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

__all__ = ["FORMAT", "optimizer_state_dict", "load_optimizer_state_dict"]

FORMAT = "commopt.OverlapDataParallel.optimizer/1"

_NOT_HYPER = ("params", "param_names")  # what a saved torch param group holds beside hyperparameters


def optimizer_state_dict(optimizers: Sequence[torch.optim.Optimizer], params: Sequence[nn.Parameter],
                         keys: Sequence[str]) -> dict:
    """The state of every optimizer, keyed by the name ``keys[i]`` of ``params[i]``.

    Like torch's ``Optimizer.state_dict()``, its tensors are the live state.

    Returns:
        ``{"format", "shapes": {name: [dims]}, "state": {name: {key: value}},
        "param_groups": [{hyperparameter: value, ..., "params": [names]}]}`` (one group per
        optimizer's group; parameters without state yet have no ``state`` entry).
    """
    name_of = _names(params, keys)
    state: dict[str, dict] = {}
    groups: list[dict] = []
    for opt in optimizers:
        sd = opt.state_dict()
        # torch numbers parameters group by group in param_groups order: zip the two to name them.
        for saved, live in zip(sd["param_groups"], opt.param_groups):
            names = []
            for pid, p in zip(saved["params"], live["params"]):
                name = name_of.get(id(p))
                if name is None:
                    raise ValueError("optimizer_state_dict: a bucket optimizer holds a parameter that is not "
                                     "one of the module's trainable parameters; the optimizer factory must "
                                     "optimize exactly the parameters it is given")
                names.append(name)
                if pid in sd["state"]:
                    state[name] = sd["state"][pid]
            groups.append({**{k: v for k, v in saved.items() if k not in _NOT_HYPER}, "params": names})
    return {"format": FORMAT, "shapes": {k: list(p.shape) for k, p in zip(keys, params)},
            "state": state, "param_groups": groups}


def load_optimizer_state_dict(optimizers: Sequence[torch.optim.Optimizer], params: Sequence[nn.Parameter],
                              keys: Sequence[str], state_dict: Any) -> None:
    """Load what :func:`optimizer_state_dict` returned into ``optimizers`` (possibly another bucket layout).

    Every check runs before anything is changed (``ValueError`` naming the first parameter that
    differs). Hyperparameters are restored per parameter, the state is copied (the checkpoint stays
    independent of the optimizers) and cast by torch's ``Optimizer.load_state_dict``.
    """
    hyper = _validate(state_dict, params, keys)
    saved_state = state_dict["state"]
    name_of = _names(params, keys)
    loads = []
    for opt in optimizers:
        groups, st, pid = [], {}, 0
        for live in opt.param_groups:
            names = [name_of[id(p)] for p in live["params"]]
            h0 = hyper[names[0]] if names else {k: v for k, v in live.items() if k not in _NOT_HYPER}
            for n in names[1:]:
                if not _same_hyper(hyper[n], h0):
                    raise ValueError(f"load_optimizer_state_dict: parameters {names[0]!r} and {n!r} share an "
                                     f"optimizer group here but had different hyperparameters in the checkpoint; "
                                     f"build the optimizers with the same grouping")
            ids = []
            for n in names:
                if n in saved_state:
                    st[pid] = _clone(saved_state[n])
                ids.append(pid)
                pid += 1
            groups.append({**h0, "params": ids})
        loads.append((opt, {"state": st, "param_groups": groups}))
    for opt, sd in loads:
        opt.load_state_dict(sd)


def _validate(state_dict: Any, params: Sequence[nn.Parameter], keys: Sequence[str]) -> dict[str, dict]:
    """Check the checkpoint against this model; returns each parameter's saved hyperparameters."""
    if not isinstance(state_dict, dict) or state_dict.get("format") != FORMAT:
        fmt = state_dict.get("format") if isinstance(state_dict, dict) else type(state_dict).__name__
        raise ValueError(f"load_optimizer_state_dict: not a checkpoint of "
                         f"OverlapDataParallel.optimizer_state_dict() (format {fmt!r}, expected "
                         f"{FORMAT!r}); a plain optimizer's state_dict "
                         f"cannot be loaded, as its parameters are numbered, not named")
    shapes = state_dict["shapes"]
    mine = {k: tuple(p.shape) for k, p in zip(keys, params)}
    missing = [k for k in keys if k not in shapes]
    if missing:
        raise ValueError(f"load_optimizer_state_dict: parameter {missing[0]!r} is not in the checkpoint "
                         f"(missing: {missing}); it was saved from a different model")
    unexpected = [k for k in shapes if k not in mine]
    if unexpected:
        raise ValueError(f"load_optimizer_state_dict: the checkpoint has parameter {unexpected[0]!r}, which this "
                         f"model lacks (unexpected: {unexpected}); it was saved from a different model")
    for k in keys:
        if tuple(shapes[k]) != mine[k]:
            raise ValueError(f"load_optimizer_state_dict: parameter {k!r} has shape {tuple(shapes[k])} in the "
                             f"checkpoint but {mine[k]} in this model")
    extra = [k for k in state_dict["state"] if k not in mine]
    if extra:
        raise ValueError(f"load_optimizer_state_dict: the checkpoint has optimizer state for {extra[0]!r}, "
                         f"which this model lacks")
    hyper: dict[str, dict] = {}
    for g in state_dict["param_groups"]:
        h = {k: v for k, v in g.items() if k != "params"}
        for name in g["params"]:
            hyper[name] = h
    no_hyper = [k for k in keys if k not in hyper]
    if no_hyper:
        raise ValueError(f"load_optimizer_state_dict: parameter {no_hyper[0]!r} is in no parameter group "
                         f"of the checkpoint")
    return hyper


def _names(params: Sequence[nn.Parameter], keys: Sequence[str]) -> dict[int, str]:
    return {id(p): k for p, k in zip(params, keys)}


def _clone(value: Any) -> Any:
    """A copy of a piece of optimizer state: tensors cloned, containers rebuilt, the rest shared."""
    if isinstance(value, torch.Tensor):
        return value.detach().clone()
    if isinstance(value, dict):
        return {k: _clone(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_clone(v) for v in value)
    return value


def _same_hyper(a: dict, b: dict) -> bool:
    """Equal hyperparameter dicts (tensor values, such as a tensor learning rate, compared by value)."""
    if a is b:
        return True
    if a.keys() != b.keys():
        return False
    for k in a:
        x, y = a[k], b[k]
        if isinstance(x, torch.Tensor) or isinstance(y, torch.Tensor):
            if not (isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor) and torch.equal(x, y)):
                return False
        elif x != y:
            return False
    return True
