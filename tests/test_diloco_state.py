"""DiLoCo's checkpoints (issue 38; docs/faults.md row 40): ``DiLoCo.load_state_dict`` refuses, at load and
on every rank, a checkpoint that does not fit the run (a ``ValueError`` naming the entry), and a refused
load leaves the run as it was; a load keeps nothing of the given state (no tensor shared with it).

Oracle: the run's own ``state_dict()`` before and after (every tensor equal), and the run's own shapes
(the pieces of the model's parameters, the fragments, the outer optimizers' parameters). Before, a
reduction in flight or an outer optimizer's momentum of the wrong shape loaded, and the next step failed
deep in torch ("attempting to assign a gradient of size [6, 7] to a tensor of size [3, 7]").
"""

from __future__ import annotations

import copy
import io

import pytest
import torch
import torch.distributed as dist
from test_diloco import _inner_step, _model

from commopt.comm import compression as C
from commopt.schedules import DiLoCo


def _same(a: object, b: object, where: str = "state") -> None:
    """``a`` and ``b`` hold the same values (tensors equal, with their dtypes)."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b), where
    elif isinstance(a, dict):
        assert isinstance(b, dict) and a.keys() == b.keys(), (where, sorted(map(str, a)), sorted(map(str, b)))
        for k in a:
            _same(a[k], b[k], f"{where}[{k!r}]")
    elif isinstance(a, (list, tuple)):
        assert isinstance(b, (list, tuple)) and len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            _same(x, y, f"{where}[{i}]")
    else:
        assert a == b, (where, a, b)


def _set(path: tuple, value: object):
    """A corruption: the entry at ``path`` of the state_dict replaced by ``value`` (a callable: of the old one)."""
    def apply(state: dict) -> None:
        *head, last = path
        for k in head:
            state = state[k]
        state[last] = value(state[last]) if callable(value) else value
    return apply


def _drop(path: tuple):
    def apply(state: dict) -> None:
        *head, last = path
        for k in head:
            state = state[k]
        del state[last]
    return apply


def _cases() -> list[tuple[str, object]]:
    """(what the error names, the corruption) for a checkpoint after step 5 of the run below: fragments
    [scale, fc1.weight] and [fc1.bias, fc2.weight (3 x 7), fc2.bias], fragment 1's reduction in flight
    (issued at step 5, due at step 6), Nesterov momentum in both outer optimizers, top-k residuals."""
    pend, opt1 = ("pending", 0), ("outer_optimizers", 1)
    piece = r"\(this rank's piece of 'fc2.weight'\)"
    return [
        # The two: a reduction in flight and an outer optimizer's momentum of the wrong shape.
        (rf"state\['pending'\]\[0\]\['deltas'\]\[1\]: shape \[6, 7\], expected \[3, 7\] {piece}",
         _set((*pend, "deltas", 1), torch.zeros(6, 7))),
        (rf"state\['outer_optimizers'\]\[1\]\['state'\]\[1\]\['momentum_buffer'\]: shape \[6, 7\], expected "
         rf"\[3, 7\] {piece}", _set((*opt1, "state", 1, "momentum_buffer"), torch.zeros(6, 7))),
        # dtypes
        (r"state\['pending'\]\[0\]\['deltas'\]\[1\]: dtype torch.float64, expected torch.float32",
         _set((*pend, "deltas", 1), lambda t: t.double())),
        (r"\['momentum_buffer'\]: dtype torch.float64, expected torch.float32",
         _set((*opt1, "state", 1, "momentum_buffer"), lambda t: t.double())),
        (r"state\['backups'\]\['fc1.weight'\]: dtype torch.float64",
         _set(("backups", "fc1.weight"), lambda t: t.double())),
        (r"state\['backups'\]\['scale'\]: a tensor on the meta device",
         _set(("backups", "scale"), lambda t: t.to("meta"))),
        # counts: deltas, param groups and their sizes, outer optimizers (one per fragment), pending fragments
        (r"state\['pending'\]\[0\]\['deltas'\]: 2 entries, expected 3", _set((*pend, "deltas"), lambda d: d[:2])),
        (r"state\['outer_optimizers'\]\[1\]\['param_groups'\]: 2 entries, expected 1",
         _set((*opt1, "param_groups"), lambda g: g + [copy.deepcopy(g[0])])),
        (r"state\['outer_optimizers'\]\[1\]\['param_groups'\]\[0\]\['params'\]: 2 entries, expected 3",
         _set((*opt1, "param_groups", 0, "params"), lambda p: p[:2])),
        (r"state\['outer_optimizers'\]\[1\]\['state'\]\[9\]: the state of a parameter that is not in its "
         r"param_groups", _set((*opt1, "state", 9), {"momentum_buffer": torch.zeros(3)})),
        (r"state\['outer_optimizers'\]: 1 entries, expected 2", _set(("outer_optimizers",), lambda o: o[:1])),
        (r"state\['outer_optimizers'\]\[0\]: a list, expected a dict", _set(("outer_optimizers", 0), [])),
        (r"state\['pending'\]\[0\]\['fragment'\]: 5, but this DiLoCo has 2 fragments", _set((*pend, "fragment"), 5)),
        (r"state\['pending'\]\[1\]\['fragment'\]: fragment 1 twice", _set(("pending",), lambda p: p + p)),
        # keys: missing and unknown
        (r"state: missing keys \[\], unexpected keys \['extra'\]", _set(("extra",), 1)),
        (r"state\['backups'\]: the backups of other parameters: missing \['scale'\]", _drop(("backups", "scale"))),
        (r"state\['pending'\]\[0\]: missing keys \['deltas'\]", _drop((*pend, "deltas"))),
        (r"state\['pending'\]\[0\]: missing keys \[\], unexpected keys \['future'\]", _set((*pend, "future"), 0)),
        (r"state\['outer_optimizers'\]\[1\]: missing keys \['state'\]", _drop((*opt1, "state"))),
        # the schedule: due within delay after the step, issued at one of the fragment's sync steps
        (r"state\['pending'\]\[0\]\['due'\]: 9, expected a step in \(5, 6\]", _set((*pend, "due"), 9)),
        (r"state\['pending'\]\[0\]\['due'\]: 6: fragment 0 would have been issued at step 5, not one of its sync "
         r"steps", _set((*pend, "fragment"), 0)),
        (r"state\['pending'\]\[0\]\['deltas'\]: 3 entries, expected 0", _set((*pend, "stepped"), True)),
        (r"state\['steps'\]: -1, expected an int >= 0", _set(("steps",), -1)),
        (r"state\['steps'\]: float 5.0, expected an int", _set(("steps",), 5.0)),
        (r"state\['offsets'\]: \[0, 0\], expected the fragments' sync offsets \[0, 1\]", _set(("offsets",), [0, 0])),
        # the residuals and the compressor's state
        (r"state\['error_feedback'\]\['worker'\]\['fc2.weight'\]: a torch.float32 tensor of 5 elements, expected "
         r"a floating-point tensor of 21 elements", _set(("error_feedback", "worker", "fc2.weight"), torch.zeros(5))),
        (r"state\['error_feedback'\]\['worker'\]\['ghost'\]: the residual of a parameter that is not synchronised",
         _set(("error_feedback", "worker", "ghost"), torch.zeros(3))),
        (r"state\['compressor_state'\]: None, expected the state of TopKCompressor", _set(("compressor_state",), None)),
    ]


def _refusals_body() -> None:
    rank = dist.get_rank()
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    # The default outer optimizer (Nesterov) keeps momentum; top-k keeps residuals; delay 1 keeps a reduction
    # in flight after every step.
    d = DiLoCo(model, opt, sync_every=2, fragments=2, delay=1, compressor=C.TopKCompressor(ratio=0.4),
               workers=[[0], [1]])
    assert d.fragments == [["scale", "fc1.weight"], ["fc1.bias", "fc2.weight", "fc2.bias"]]
    for t in range(5):
        _inner_step(model, opt, rank, t)
        d.step()
    buf = io.BytesIO()
    torch.save(d.state_dict(), buf)
    saved = torch.load(io.BytesIO(buf.getvalue()), weights_only=True)
    assert [p["fragment"] for p in saved["pending"]] == [1] and all(o["state"] for o in saved["outer_optimizers"])
    _inner_step(model, opt, rank, 5)  # the run moves on: a partial load would show
    d.step()
    before = d.state_dict()
    for words, corrupt in _cases():
        state = copy.deepcopy(saved)
        corrupt(state)
        with pytest.raises(ValueError, match=words):
            d.load_state_dict(state)
        _same(d.state_dict(), before)
    # The checkpoint itself loads, and nothing of it is shared with the run afterwards.
    d.load_state_dict(saved)
    _same(d.state_dict(), saved)
    for o in saved["outer_optimizers"]:
        for per in o["state"].values():
            per["momentum_buffer"].add_(1.0)
    for p in saved["pending"]:
        for t in p["deltas"]:
            t.add_(1.0)
    saved["backups"]["scale"].add_(1.0)
    _same(d.state_dict()["pending"], torch.load(io.BytesIO(buf.getvalue()), weights_only=True)["pending"])
    _same(d.state_dict(), torch.load(io.BytesIO(buf.getvalue()), weights_only=True))
    _inner_step(model, opt, rank, 5)
    d.step()


def test_checkpoint_that_does_not_fit_is_refused_at_load_and_loads_nothing(ranks):
    """FAULTS.md row 40 (checkpoints): every entry that does not fit (the shape or dtype of a reduction in
    flight, an outer optimizer's momentum, a backup; a backup without values; counts of deltas, param groups,
    outer optimizers; missing and unknown keys; a reduction in flight off the schedule or twice; residuals
    and the compressor's state) is a ValueError naming it, on both ranks, with the run's state_dict equal
    before and after; the checkpoint itself then loads, and later changes to it do not reach the run."""
    ranks(2, _refusals_body, timeout=60)
