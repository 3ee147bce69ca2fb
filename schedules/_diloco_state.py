"""DiLoCo's state: its fragments, and its checkpoints' validation (``DiLoCo.load_state_dict``;
docs/faults.md row 40).

The fragments (:func:`fragments_of`) are the groups of parameters that sync together: the schedule
and every checkpoint follow them.

Every entry of a :meth:`DiLoCo.state_dict <commopt.schedules.DiLoCo.state_dict>` is checked against
the run loading it before anything loads, so that a checkpoint that does not fit is a ``ValueError``
naming the entry (``state['pending'][0]['deltas'][1]: shape [3, 4], expected [6, 4] (this rank's piece
of 'fc.weight')``) instead of an error deep in torch at the next outer step, and a failed load leaves
the run as it was. What is checked:

- the keys: every key :meth:`state_dict` writes, nothing else (``offsets`` and ``compressor_state``
  may be absent: older checkpoints);
- ``meta``: the world, worker layout, rank, fragments, ``sync_every``, ``delay`` and compressor;
- ``steps`` and ``reductions``: ints >= 0; ``offsets``: the fragments' schedule;
- ``backups``: this rank's piece of every synchronised parameter, shape and dtype (any device: it is
  copied to ``backup_device``);
- ``outer_optimizers``: one per fragment; its ``param_groups`` of the same count and sizes as the
  optimizer's; its per-parameter state: a tensor is a scalar (``step``) or has the shape and dtype of
  that parameter's piece;
- ``error_feedback``: residuals of known parameters, floating point, of the piece's size;
- ``compressor_state``: loads into a fresh state of this run's compressor (None without one);
- ``pending``: the reductions in flight: a fragment each (at most one per fragment), due within
  ``delay`` steps after ``steps`` and issued at one of that fragment's sync steps; an averaged
  pseudo-gradient per piece (shape and dtype) unless its outer step already ran (``stepped``: then
  none, due at the next step).

An optimizer of another type whose state passes these checks is refused by DiLoCo itself, which
restores every outer optimizer (torch raises while loading).
"""

from __future__ import annotations

import inspect
import math
import numbers
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch

from commopt.comm.compression import Codec

__all__ = ["Expected", "check_state", "cloned", "fragments_of", "outer_optimizers", "positive_int"]

_NAME = "DiLoCo"
_REQUIRED = ("meta", "steps", "reductions", "backups", "outer_optimizers", "error_feedback", "pending")
_OPTIONAL = ("offsets", "compressor_state")
_PENDING = ("fragment", "due", "deltas")
_HINT = ("load the state_dict that this rank's DiLoCo.state_dict() returned, into a DiLoCo built with the same "
         "model, settings and outer_optimizer")


@dataclass(frozen=True)
class Expected:
    """What a checkpoint must hold to load into one DiLoCo.

    Attributes:
        meta: ``DiLoCo._meta()`` of the run loading it.
        pieces: per synchronised parameter name: its piece's shape and the backups' dtype.
        fragments: the parameter names of each fragment.
        optimizers: the outer optimizer of each fragment.
        names: ``id(backup)`` -> the parameter's name, for the optimizers' parameters.
        sync_every, delay, offsets: the fragments' schedule.
        compressor: the outer reductions' codec, or None.
    """

    meta: dict
    pieces: dict[str, tuple[tuple[int, ...], torch.dtype]]
    fragments: list[list[str]]
    optimizers: list[torch.optim.Optimizer]
    names: dict[int, str]
    sync_every: int
    delay: int
    offsets: list[int]
    compressor: Codec | None


def _fail(key: str, what: str) -> ValueError:
    return ValueError(f"{_NAME}: {key}: {what}; {_HINT} (nothing was loaded)")


def _shape(shape) -> str:
    return str(list(shape))


def _int(key: str, value: object, low: int = 0) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise _fail(key, f"{type(value).__name__} {value!r}, expected an int")
    if value < low:
        raise _fail(key, f"{value}, expected an int >= {low}")
    return int(value)


def _dict(key: str, value: object) -> dict:
    if not isinstance(value, dict):
        raise _fail(key, f"a {type(value).__name__}, expected a dict")
    return value


def _list(key: str, value: object, length: int | None = None) -> list:
    if not isinstance(value, (list, tuple)):
        raise _fail(key, f"a {type(value).__name__}, expected a list")
    if length is not None and len(value) != length:
        raise _fail(key, f"{len(value)} entries, expected {length}")
    return list(value)


def _keys(key: str, value: dict, required: tuple, optional: tuple = ()) -> None:
    missing = [k for k in required if k not in value]
    extra = [k for k in value if k not in required and k not in optional]
    if missing or extra:
        raise _fail(key, f"missing keys {missing}, unexpected keys {extra}")


def _tensor(key: str, value: object, shape: tuple[int, ...], dtype: torch.dtype, name: str) -> None:
    """``value`` is a tensor holding data, of ``shape`` and ``dtype`` (this rank's piece of ``name``)."""
    piece = f"this rank's piece of {name!r}"
    if not isinstance(value, torch.Tensor):
        raise _fail(key, f"a {type(value).__name__}, expected a tensor of shape {_shape(shape)} and dtype {dtype} "
                         f"({piece})")
    if value.is_meta:
        raise _fail(key, f"a tensor on the meta device (no values), expected one holding {piece}")
    if tuple(value.shape) != tuple(shape):
        raise _fail(key, f"shape {_shape(value.shape)}, expected {_shape(shape)} ({piece})")
    if value.dtype != dtype:
        raise _fail(key, f"dtype {value.dtype}, expected {dtype} ({piece})")


def check_state(state: object, exp: Expected) -> None:
    """Raise ``ValueError`` naming the first entry of ``state`` that does not fit ``exp`` (module docstring).

    Reads only: neither ``state`` nor the run is modified.
    """
    if not isinstance(state, dict) or "meta" not in state:
        raise ValueError(f"{_NAME}: not a DiLoCo state_dict (no 'meta'); pass what DiLoCo.state_dict() returned")
    missing = [k for k in _REQUIRED if k not in state]
    if missing:
        raise ValueError(f"{_NAME}: not a whole DiLoCo state_dict (missing {missing}); pass what "
                         f"DiLoCo.state_dict() returned")
    _keys("state", state, _REQUIRED, _OPTIONAL)
    saved = _dict("state['meta']", state["meta"])
    if saved != exp.meta:
        now = exp.meta
        diff = {k: (saved.get(k), now.get(k)) for k in sorted(set(saved) | set(now)) if saved.get(k) != now.get(k)}
        raise ValueError(f"{_NAME}: the checkpoint was taken with another layout or settings ({diff}, saved vs "
                         f"now): DiLoCo's state is per rank and per worker layout; resume on the same world and "
                         f"workers with the same settings, each rank loading its own state_dict")
    steps = _int("state['steps']", state["steps"])
    _int("state['reductions']", state["reductions"])
    if "offsets" in state and list(_list("state['offsets']", state["offsets"])) != list(exp.offsets):
        raise _fail("state['offsets']", f"{state['offsets']}, expected the fragments' sync offsets {exp.offsets}")
    _check_backups(state["backups"], exp)
    _check_optimizers(state["outer_optimizers"], exp)
    _check_feedback(state["error_feedback"], exp)
    _check_compressor(state.get("compressor_state"), "compressor_state" in state, exp)
    _check_pending(state["pending"], steps, exp)


def cloned(sd: dict) -> dict:
    """An optimizer's ``state_dict()`` with its state tensors copied: torch's shares the live ones (and
    ``load_state_dict`` keeps the given ones where device and dtype match)."""
    state = {k: {n: v.detach().clone() if isinstance(v, torch.Tensor) else v for n, v in per.items()}
             for k, per in sd["state"].items()}
    return {**sd, "state": state}


def _check_backups(backups: object, exp: Expected) -> None:
    backups = _dict("state['backups']", backups)
    if set(backups) != set(exp.pieces):
        raise _fail("state['backups']", f"the backups of other parameters: missing "
                                        f"{sorted(set(exp.pieces) - set(backups))[:5]}, unexpected "
                                        f"{sorted(set(backups) - set(exp.pieces))[:5]}")
    for n, b in backups.items():
        _tensor(f"state['backups'][{n!r}]", b, *exp.pieces[n], n)


def _check_optimizers(states: object, exp: Expected) -> None:
    states = _list("state['outer_optimizers']", states, len(exp.optimizers))
    for f, (opt, sd) in enumerate(zip(exp.optimizers, states)):
        key = f"state['outer_optimizers'][{f}]"
        sd = _dict(key, sd)
        _keys(key, sd, ("state", "param_groups"))
        groups = _list(f"{key}['param_groups']", sd["param_groups"], len(opt.param_groups))
        ids: dict[object, str] = {}  # the checkpoint's parameter ids -> this optimizer's parameters' names
        for g, (group, saved) in enumerate(zip(opt.param_groups, groups)):
            gkey = f"{key}['param_groups'][{g}]"
            saved = _dict(gkey, saved)
            if "params" not in saved:
                raise _fail(gkey, "no 'params'")
            params = _list(f"{gkey}['params']", saved["params"], len(group["params"]))
            for i, p in zip(params, group["params"]):
                if i in ids or not isinstance(i, numbers.Integral) or isinstance(i, bool):
                    raise _fail(f"{gkey}['params']", f"parameter id {i!r} is not a unique int")
                ids[i] = exp.names[id(p)]
        for i, per_param in _dict(f"{key}['state']", sd["state"]).items():
            pkey = f"{key}['state'][{i!r}]"
            if i not in ids:
                raise _fail(pkey, f"the state of a parameter that is not in its param_groups (ids {list(ids)})")
            name = ids[i]
            shape, dtype = exp.pieces[name]
            for k, v in _dict(pkey, per_param).items():
                # A scalar (Adam's 'step') is per parameter, not per element; anything else is per element.
                if isinstance(v, torch.Tensor) and v.dim():
                    _tensor(f"{pkey}[{k!r}]", v, shape, dtype, name)


def _check_feedback(state: object, exp: Expected) -> None:
    state = _dict("state['error_feedback']", state)
    _keys("state['error_feedback']", state, (), ("worker", "server"))
    for kind, residuals in state.items():
        for n, r in _dict(f"state['error_feedback'][{kind!r}]", residuals).items():
            key = f"state['error_feedback'][{kind!r}][{n!r}]"
            if n not in exp.pieces:
                raise _fail(key, "the residual of a parameter that is not synchronised here")
            numel = math.prod(exp.pieces[n][0])
            if not isinstance(r, torch.Tensor) or r.is_meta or not r.is_floating_point() or r.numel() != numel:
                what = (f"a {type(r).__name__}" if not isinstance(r, torch.Tensor) else
                        f"a {r.dtype} tensor of {r.numel()} elements{' on the meta device' if r.is_meta else ''}")
                raise _fail(key, f"{what}, expected a floating-point tensor of {numel} elements (the residual of "
                                 f"this rank's piece of {n!r})")


def _check_compressor(state: object, present: bool, exp: Expected) -> None:
    key = "state['compressor_state']"
    if exp.compressor is None:
        if state is not None:
            raise _fail(key, "a compressor's state, but this DiLoCo has no compressor")
        return
    if not present:
        return  # an older checkpoint: the compressor's state starts afresh
    if state is None:
        raise _fail(key, f"None, expected the state of {type(exp.compressor).__name__}")
    try:
        exp.compressor.new_state().load_state_dict(_dict(key, state))
    except (KeyError, ValueError, TypeError, AttributeError, RuntimeError) as exc:
        raise _fail(key, f"does not load into {type(exp.compressor).__name__}'s state ({type(exc).__name__}: "
                         f"{exc})") from None


def _check_pending(pending: object, steps: int, exp: Expected) -> None:
    seen: set[int] = set()
    for j, p in enumerate(_list("state['pending']", pending)):
        key = f"state['pending'][{j}]"
        p = _dict(key, p)
        _keys(key, p, _PENDING, ("stepped",))
        f = _int(f"{key}['fragment']", p["fragment"])
        if f >= len(exp.fragments):
            raise _fail(f"{key}['fragment']", f"{f}, but this DiLoCo has {len(exp.fragments)} fragments")
        if f in seen:
            raise _fail(f"{key}['fragment']", f"fragment {f} twice (one reduction in flight per fragment: "
                                              f"delay < sync_every)")
        seen.add(f)
        due = _int(f"{key}['due']", p["due"])
        issued = due - exp.delay
        if not steps < due <= steps + exp.delay:
            raise _fail(f"{key}['due']", f"{due}, expected a step in ({steps}, {steps + exp.delay}] (after "
                                         f"state['steps'], within delay={exp.delay})")
        if issued < 1 or issued % exp.sync_every != exp.offsets[f] % exp.sync_every:
            raise _fail(f"{key}['due']", f"{due}: fragment {f} would have been issued at step {issued}, not one "
                                         f"of its sync steps (t % {exp.sync_every} == "
                                         f"{exp.offsets[f] % exp.sync_every})")
        stepped = p.get("stepped", False)
        if not isinstance(stepped, bool):
            raise _fail(f"{key}['stepped']", f"{type(stepped).__name__} {stepped!r}, expected a bool")
        names = exp.fragments[f]
        deltas = _list(f"{key}['deltas']", p["deltas"], 0 if stepped else len(names))
        if stepped and due != steps + 1:
            raise _fail(f"{key}['due']", f"{due}: an outer step taken early is due at the next step ({steps + 1})")
        for i, (n, d) in enumerate(zip(names, deltas)):
            _tensor(f"{key}['deltas'][{i}]", d, *exp.pieces[n], n)


# --------------------------------------------------------------------------------- the fragments
def positive_int(name: str, value: object, hint: str) -> int:
    """``value`` as an int >= 1 (``TypeError`` / ``ValueError`` naming ``name`` otherwise)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{_NAME}: {name} must be an int >= 1 ({hint}), got {type(value).__name__} {value!r}")
    if value < 1:
        raise ValueError(f"{_NAME}: {name} must be >= 1 ({hint}), got {value!r}")
    return int(value)


def fragments_of(fragments: int | Iterable, named: list) -> list[list[str]]:
    """The fragments as lists of names: ``F`` contiguous groups of about equal numel, or the given ones,
    checked to cover every synchronised parameter exactly once."""
    names = [n for n, _ in named]
    if isinstance(fragments, bool) or not isinstance(fragments, (numbers.Integral, list, tuple)):
        raise TypeError(f"{_NAME}: fragments must be an int >= 1 or a list of lists of parameter names, got "
                        f"{type(fragments).__name__} {fragments!r}")
    if isinstance(fragments, numbers.Integral):
        count = positive_int("fragments", fragments, "e.g. fragments=4")
        if count > len(names):
            raise ValueError(f"{_NAME}: fragments={count} but the model has {len(names)} synchronised parameters; "
                             f"use at most {len(names)} fragments")
        prefix = [0]
        for _, p in named:
            prefix.append(prefix[-1] + p.numel())
        # Cut k (k = 1..F-1) after the parameter whose prefix sum is nearest k/F of the total,
        # leaving at least one parameter to every fragment.
        cuts = [0]
        for k in range(1, count):
            lo, hi = cuts[-1] + 1, len(names) - (count - k)
            target = prefix[-1] * k / count
            cuts.append(min(range(lo, hi + 1), key=lambda b: (abs(prefix[b] - target), b)))
        cuts.append(len(names))
        return [names[a:b] for a, b in zip(cuts, cuts[1:])]
    groups = [list(g) for g in fragments] if all(isinstance(g, (list, tuple)) for g in fragments) else None
    if not groups or any(not g or not all(isinstance(n, str) for n in g) for g in groups):
        raise TypeError(f"{_NAME}: explicit fragments must be a non-empty list of non-empty lists of parameter "
                        f"names (str), got {fragments!r}")
    seen = [n for g in groups for n in g]
    dup = sorted({n for n in seen if seen.count(n) > 1})
    missing = [n for n in names if n not in seen]
    unknown = [n for n in seen if n not in names]
    if dup or missing or unknown:
        raise ValueError(f"{_NAME}: fragments must cover every trainable parameter exactly once: missing "
                         f"{missing[:5]}, unknown {unknown[:5]} (frozen or not in the model), duplicated {dup[:5]}; "
                         f"names are those of model.named_parameters()")
    return groups


def _default_outer(params: list) -> torch.optim.Optimizer:
    """DiLoCo's outer optimizer: Nesterov SGD, lr 0.7, momentum 0.9 (arXiv 2311.08105)."""
    return torch.optim.SGD(params, lr=0.7, momentum=0.9, nesterov=True)


def _needs_closure(opt: torch.optim.Optimizer) -> bool:
    """Whether ``opt.step()`` cannot run without a closure (LBFGS)."""
    try:
        closure = inspect.signature(opt.step).parameters.get("closure")
    except (TypeError, ValueError):
        return False
    return closure is not None and closure.default is inspect.Parameter.empty


def outer_optimizers(factory: Callable[[list], torch.optim.Optimizer] | None,
                     fragments: list[list[torch.Tensor]]) -> list[torch.optim.Optimizer]:
    """One outer optimizer per fragment, over that fragment's backups (``factory`` None: Nesterov SGD,
    lr 0.7, momentum 0.9), each checked: an optimizer, elementwise (no closure), over exactly those."""
    out = []
    for f, params in enumerate(fragments):
        opt = (factory or _default_outer)(params)
        if not isinstance(opt, torch.optim.Optimizer):
            raise TypeError(f"DiLoCo: outer_optimizer returned {type(opt).__name__}, not a torch.optim.Optimizer")
        if _needs_closure(opt):
            raise TypeError(f"DiLoCo: outer_optimizer returned {type(opt).__name__}, whose step() needs a "
                            f"closure (it re-evaluates a loss); the outer step has only the averaged "
                            f"pseudo-gradient: use an elementwise optimizer such as SGD or Adam")
        got = {id(p) for g in opt.param_groups for p in g["params"]}
        if got != {id(p) for p in params}:
            raise ValueError(f"DiLoCo: outer_optimizer must optimise exactly the params it is given (fragment "
                             f"{f}'s backups); it returned an optimizer over other tensors")
        out.append(opt)
    return out
