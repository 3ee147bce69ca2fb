"""Tensor-parallel styles that never lose to torch's by choice, and the errors of issue 38, item 4
(docs/faults.md row 39).

- ``algorithm="auto"``: each fused Linear runs torch's own collective where the group's link leaves the
  ring nothing to hide (a link model handed to the context, as a calibration would leave it), and the
  ring where the link is slow; the same choice on every rank, torch's styles' results either way.
- The agreement check of what a ring exchanges runs once per module and input shape (counted by the
  engine's ``<kind>/agree`` bytes), again when the shape changes and when it changes back.
- A double backward through a ring says that it is not supported, naming the call.
- A rank that skips the backward of ``ulysses_attention`` makes the others raise ``CommTimeoutError``
  naming ``ulysses_attention``, not only the all-to-all inside it.
"""

from __future__ import annotations

import time
from functools import partial

import pytest
import torch
import torch.distributed as dist
from _pool import RankPool
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard
from torch.distributed.tensor.parallel import ColwiseParallel as TorchColwise
from torch.distributed.tensor.parallel import RowwiseParallel as TorchRowwise
from torch.distributed.tensor.parallel import SequenceParallel as TorchSequence
from torch.distributed.tensor.parallel import parallelize_module
from torch.utils._python_dispatch import TorchDispatchMode

from commopt.comm import context
from commopt.comm.cost import CostModel, LinkModel
from commopt.comm.errors import CollectiveMismatchError, CommTimeoutError
from commopt.schedules import (
    ColwiseParallel,
    RowwiseParallel,
    SequenceParallel,
    _tp_choice,
    all_gather_matmul,
    matmul_reduce_scatter,
    ring_attention,
    ulysses_attention,
)
from commopt.schedules import tensor_parallel as tp

ABSENT = 2.0  # the timeout of a call a peer never enters (row 39)
SLACK = 10.0  # room for a cold process on 2 busy cores (docs/faults.md)
_RINGS = ("all_gather_matmul", "all_gather_matmul/backward", "matmul_reduce_scatter",
          "matmul_reduce_scatter/backward", "matmul_all_reduce")
_CHECKS = ("all_gather/agree", "reduce_scatter/agree", "all_reduce/agree")


class _MLP(nn.Module):
    """Norm, two column-parallel projections sharing their gathered input, a row-parallel one."""

    def __init__(self, dim: int = 48, hidden: int = 96) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.w1, self.w3, self.w2 = nn.Linear(dim, hidden), nn.Linear(dim, hidden), nn.Linear(hidden, dim)

    def forward(self, x):
        h = self.norm(x)
        return self.w2(torch.relu(self.w1(h)) * self.w3(h))


def _plan(col, row, seq) -> dict:
    return {"norm": seq(), "w1": col(input_layouts=Shard(1)), "w3": col(input_layouts=Shard(1)),
            "w2": row(output_layouts=Shard(1))}


class _Collectives(TorchDispatchMode):
    """Counts torch's functional collectives (what DTensor's redistributions run), by name. Not
    ``CommDebugMode``: its module tracker hands each module a new input object (for its backward hooks),
    which hides that two modules were handed the same one."""

    def __init__(self) -> None:
        super().__init__()
        self.counts: dict[str, int] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.__name__.split(".")[0]
        if func.namespace == "_c10d_functional" and name in ("all_gather_into_tensor", "reduce_scatter_tensor",
                                                               "all_reduce", "all_to_all_single"):
            self.counts[name] = self.counts.get(name, 0) + 1
        return func(*args, **(kwargs or {}))


def _sent(ops) -> int:
    sent = context().engine().bytes_sent()
    return sum(sent.get(op, 0) for op in ops)


def _set_link(group, link: LinkModel) -> None:
    """The link ``cost.model_for`` gives ``group`` from now on (what a calibration would leave)."""
    topo = context().topology(None, group)
    context().cost_models.put((topo.layout, id(topo.group)), CostModel(link, link))


def _train(model: nn.Module, steps: int, seq: int = 8) -> tuple[list[torch.Tensor], dict]:
    me = dist.get_rank()
    outs = []
    for step in range(steps):
        x = torch.randn(2, seq, 48, generator=torch.Generator().manual_seed(10 * step)).chunk(2, dim=1)[me]
        x.requires_grad_()
        out = model(x)
        out.square().sum().backward()
        outs.append(torch.cat([out.detach().reshape(-1), x.grad.reshape(-1)]))
    grads = {k: p.grad.to_local().clone() for k, p in model.named_parameters()}
    return outs, grads


def _choice_case() -> dict:
    mesh = init_device_mesh("cpu", (2,))
    group = mesh.get_group()
    # Every matmul "measured" at 50 ms: the choice then depends on the link alone, not on this host.
    timed = _tp_choice._time
    _tp_choice._time = lambda fn, device: 0.05
    ours = (ColwiseParallel, RowwiseParallel, SequenceParallel)
    torch.manual_seed(7)
    ref = _train(parallelize_module(_MLP(), mesh, _plan(TorchColwise, TorchRowwise, TorchSequence)), 2)
    out: dict = {}
    for name, link in (("fast", LinkModel(alpha=1e-6, beta=1e-13)), ("slow", LinkModel(alpha=1e-3, beta=5e-5))):
        _set_link(group, link)
        torch.manual_seed(7)
        model = parallelize_module(_MLP(), mesh, _plan(*ours))
        before = _sent(_RINGS)
        got = _train(model, 2)
        equal = all(torch.allclose(a, b, rtol=1e-5, atol=1e-5) for a, b in zip(got[0], ref[0]))
        equal = equal and all(torch.allclose(got[1][k], ref[1][k], rtol=1e-5, atol=1e-5) for k in ref[1])
        out[name] = {"choices": tp.choices(model), "ring_bytes": _sent(_RINGS) - before, "equal_to_torch": equal}
        # torch's collectives in one more forward: w1 and w3 share one gathered input on either path.
        x = torch.randn(2, 8, 48).chunk(2, dim=1)[dist.get_rank()]
        with _Collectives() as comms:
            model(x)
        out[name]["torch_collectives"] = dict(comms.counts)
    _tp_choice._time = timed
    context().engine().release(group)
    return out


def test_predict_by_hand():
    """The two predictions ``auto`` compares, computed by hand for TP 2 and one chunk: the ring hides the
    transfer of the other rank's block behind the own block's half of the matmul and pays one hand-off;
    torch's path pays the transfer, then the matmul (all-reduce: the transfer twice, the ring an
    all-gather of the rows it cannot hide)."""
    link = LinkModel(alpha=0.0, beta=1e-6)  # 10 000 bytes: 10 ms
    ring, plain = _tp_choice.predict("all_gather", tp=2, matmul=0.04, block_bytes=10_000, link=link, chunks=1,
                                     device_type="cuda")
    assert ring == pytest.approx(0.02 + 0.02 + 5e-5) and plain == pytest.approx(0.04 + 0.01)
    ring, plain = _tp_choice.predict("all_gather", tp=2, matmul=0.004, block_bytes=10_000, link=link, chunks=1,
                                     device_type="cpu")  # the transfer outlasts the first half: it waits
    assert ring == pytest.approx(0.01 + 0.002 + 1e-3) and plain == pytest.approx(0.014)
    ring, plain = _tp_choice.predict("all_reduce", tp=2, matmul=0.04, block_bytes=10_000, link=link, chunks=1,
                                     device_type="cuda")
    assert ring == pytest.approx(0.04 + 5e-5 + 0.01 + 5e-5) and plain == pytest.approx(0.04 + 0.02)
    # Two chunks: the second chunk arrives 10 ms after the first, each chunk's slice takes 10 ms.
    ring, _ = _tp_choice.predict("all_gather", tp=2, matmul=0.04, block_bytes=20_000, link=link, chunks=2,
                                 device_type="cuda")
    assert ring == pytest.approx(0.04 + 2 * 5e-5)


def test_auto_runs_torchs_collective_where_the_ring_cannot_win(ranks):
    """Issue 38 item 1, row 39: with ``algorithm="auto"`` (the default) every fused Linear runs torch's
    collective on a link too fast for the ring to hide anything (no byte through commopt's rings), and
    the ring on a slow one whose transfers last as long as the matmuls (each matmul's measured time
    fixed at 50 ms in the ranks, so that the choice is the link's alone); every rank takes the same
    choice, and the outputs, input gradients and parameter gradients equal torch's styles' either way.
    Where torch's collective runs, the two projections that share an input gather it once (torch's
    functional collectives counted), as torch's own plan does in front of them."""
    res = ranks(2, _choice_case, timeout=120)
    assert res[0]["fast"]["choices"] == res[1]["fast"]["choices"]
    assert res[0]["slow"]["choices"] == res[1]["slow"]["choices"]
    for r in res:
        fast, slow = r["fast"], r["slow"]
        # w1 and w3 share one gathered input: w3 multiplies w1's (torch's or the ring's), choosing nothing.
        assert {m: set(c.values()) for m, c in fast["choices"].items()} == \
            {"w1": {"torch"}, "w3": set(), "w2": {"torch"}}, fast["choices"]
        assert fast["ring_bytes"] == 0, fast
        # torch's path gathers once for both (as torch's plan with a PrepareModuleInput), then one
        # reduce-scatter: never more collectives than torch's own plan.
        assert fast["torch_collectives"] == {"all_gather_into_tensor": 1, "reduce_scatter_tensor": 1}, fast
        assert slow["torch_collectives"] == {}, slow
        assert set(slow["choices"]["w1"].values()) == {"ring"} and set(slow["choices"]["w2"].values()) == {"ring"}
        assert slow["ring_bytes"] > 0, slow
        assert fast["equal_to_torch"] and slow["equal_to_torch"], r


def _checks_case() -> dict:
    mesh = init_device_mesh("cpu", (2,))
    me = dist.get_rank()
    model = parallelize_module(_MLP(), mesh, _plan(partial(ColwiseParallel, algorithm="ring"),
                                                   partial(RowwiseParallel, algorithm="ring"), SequenceParallel))
    counts = []
    for seq in (8, 8, 8, 12, 12, 8):  # the shape changes at the 4th forward and back at the 6th
        before = _sent(_CHECKS)
        x = torch.randn(2, seq, 48, generator=torch.Generator().manual_seed(seq)).chunk(2, dim=1)[me]
        model(x.requires_grad_()).sum().backward()
        counts.append(_sent(_CHECKS) - before)
    # A shape that differs across the ranks at a change: both check, both raise, naming the style.
    x = torch.randn(2, 4 + 2 * me, 48).chunk(2, dim=1)[0]
    try:
        model(x)
        mismatch = "completed"
    except CollectiveMismatchError as exc:
        mismatch = str(exc)
    context().engine().release(mesh.get_group())
    return {"counts": counts, "mismatch": mismatch}


def test_agreement_check_runs_once_per_module_and_shape(ranks):
    """Issue 38 item 1, row 39: the styles check what their rings exchange where a module's input shape
    changes, not at every forward (the DDP hook's and FSDP2 comms' rule): the first forward checks once
    per fused module (w1 and w2: w3 multiplies w1's gathered input), the next two not at all, a new
    shape once more, and the old shape again (the check is against the last agreed shape, so that two
    ranks can never skip it with different shapes). Shapes that differ across the ranks still raise
    CollectiveMismatchError on every rank, naming the style."""
    for r in ranks(2, _checks_case, timeout=120):
        first, *rest = r["counts"]
        assert first > 0, r
        assert rest == [0, 0, first, 0, first], r  # every check is one header of the same size
        assert r["mismatch"].startswith("CollectiveMismatchError") and "ColwiseParallel" in r["mismatch"], r


def _double_backward_case() -> dict:
    me = dist.get_rank()
    seen = {}
    calls = {
        "all_gather_matmul": lambda a, b: all_gather_matmul(a, [b], gather_dim=0)[0],
        "matmul_reduce_scatter": lambda a, b: matmul_reduce_scatter(a, b, scatter_dim=0),
        "ring_attention": lambda a, b: ring_attention(a, a, a),
    }
    for name, call in calls.items():
        a = torch.randn(4, 6, generator=torch.Generator().manual_seed(me)).requires_grad_()
        b = torch.randn(6, 3).requires_grad_()
        out = call(a, b)
        try:
            (g,) = torch.autograd.grad(out.square().sum(), a, create_graph=True)
            g.sum().backward()
            seen[name] = "completed"
        except NotImplementedError as exc:
            seen[name] = str(exc)
        # A plain backward still works afterwards (nothing moved: the refusal came before the ring).
        a2 = a.detach().requires_grad_()
        call(a2, b).sum().backward()
        seen[name + "/plain"] = a2.grad is not None
    return seen


def test_double_backward_says_it_is_not_supported(ranks):
    """Issue 38 item 4: a double backward (``create_graph=True``) through ``all_gather_matmul``,
    ``matmul_reduce_scatter`` or ``ring_attention`` raises NotImplementedError on every rank, naming
    the call and saying it is not supported (torch's own message was "appears to not have been used in
    the graph"); the group stays usable."""
    for seen in ranks(2, _double_backward_case, timeout=60):
        for name in ("all_gather_matmul", "matmul_reduce_scatter", "ring_attention"):
            assert seen[name].startswith(f"{name}: a double backward is not supported"), seen
            assert seen[name + "/plain"], seen


def _ulysses_skips_backward() -> dict:
    rank = dist.get_rank()
    dist.barrier()
    q = torch.randn(1, 2, 4, 8, requires_grad=True)
    out = ulysses_attention(q, q, q, timeout=ABSENT)
    if rank == 1:
        return {}  # and never enters the backward's all-to-alls
    start = time.monotonic()
    try:
        out.sum().backward()
        return {"backward": "completed"}
    except CommTimeoutError as exc:
        return {"backward": (time.monotonic() - start, str(exc), exc.op)}


def test_ulysses_errors_name_the_call():
    """Issue 38 item 4, row 39: a rank that skips the backward of ``ulysses_attention`` makes the others
    raise CommTimeoutError within the timeout, whose message and op name ``ulysses_attention`` and the
    exchange (the all-to-all's own error said only ``all_to_all/agree``). A pool of its own: the
    abandoned call leaves WORLD out of step."""
    pool = RankPool(2)
    try:
        res = pool.run(_ulysses_skips_backward, timeout=ABSENT + SLACK + 30)
    finally:
        pool.close(graceful=False)
    assert res[1] == {}
    elapsed, msg, op = res[0]["backward"]
    assert ABSENT - 0.5 <= elapsed <= ABSENT + SLACK, elapsed
    assert msg.startswith("CommTimeoutError") and "ulysses_attention" in msg and "(backward)" in msg, msg
    assert op.startswith("ulysses_attention/"), op


def test_style_and_primitive_arguments_are_checked():
    """Row 39: ``algorithm`` and ``chunks`` of the styles are checked at construction, ``chunks`` of the
    primitives at the call (no process group needed: nothing could be sent), each naming the call."""
    cases = [
        (ValueError, "ColwiseParallel: algorithm must be one of", lambda: ColwiseParallel(algorithm="fast")),
        (ValueError, "RowwiseParallel: chunks must be >= 1", lambda: RowwiseParallel(chunks=0)),
        (TypeError, "ColwiseParallel: chunks must be an int >= 1 or None", lambda: ColwiseParallel(chunks=2.5)),
        (TypeError, "all_gather_matmul: chunks must be an int", lambda: all_gather_matmul(
            torch.randn(2, 4), [torch.randn(4, 3)], chunks="4")),
        (ValueError, "ring_attention: chunks must be >= 1", lambda: ring_attention(
            torch.randn(2, 4), torch.randn(2, 4), torch.randn(2, 4), chunks=-1)),
    ]
    for kind, text, call in cases:
        with pytest.raises(kind, match=text):
            call()
    style = ColwiseParallel(chunks=3, algorithm="ring", input_layouts=Shard(1))
    assert (style.chunks, style.algorithm, style.input_layouts) == (3, "ring", (Shard(1),))

