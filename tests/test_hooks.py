"""The DDP comm hook, exact path: the same parameters as DDP's own reduction (issue 2).

docs/faults.md rows: 7 (world of one), 14 (wrong hook result), 19 (no_sync), 20 (unused parameters),
21 (gradient_as_bucket_view both ways), 22 (sparse gradients refused at registration).
"""

from __future__ import annotations

import io

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

from commopt.comm import Topology, hooks


class _Net(nn.Module):
    def __init__(self, unused: bool = False):
        super().__init__()
        self.a = nn.Linear(8, 32)
        self.b = nn.Linear(32, 16)
        self.c = nn.Linear(16, 4)
        self.unused = nn.Linear(4, 4) if unused else None

    def forward(self, x):
        return self.c(torch.relu(self.b(torch.relu(self.a(x)))))


def _train(hook_algo: str | None, bucket_view: bool, unused: bool, accumulate: int, steps: int = 20,
           state_out: list | None = None):
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = _Net(unused).double()
    ddp = DDP(model, bucket_cap_mb=0.002, gradient_as_bucket_view=bucket_view, find_unused_parameters=unused)
    state = None
    if hook_algo is not None:
        state = hooks.AllReduceState(Topology.from_spec("2x2"), algorithm=hook_algo)
        hooks.register(ddp, state)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05, momentum=0.9)
    gen = torch.Generator().manual_seed(100 + rank)
    for _ in range(steps):
        opt.zero_grad()
        for micro in range(accumulate):
            x = torch.randn(6, 8, generator=gen, dtype=torch.float64)
            y = torch.randn(6, 4, generator=gen, dtype=torch.float64)
            if micro < accumulate - 1:
                with ddp.no_sync():
                    nn.functional.mse_loss(ddp(x), y).backward()
            else:
                nn.functional.mse_loss(ddp(x), y).backward()
        opt.step()
    if state_out is not None:
        state_out.append(state)
    return [p.detach().clone() for p in model.parameters()]


def _compare(algo: str, bucket_view: bool, unused: bool, accumulate: int):
    ref = _train(None, bucket_view, unused, accumulate)
    states: list = []
    got = _train(algo, bucket_view, unused, accumulate, state_out=states)
    diffs = [float((a - b).abs().max()) for a, b in zip(ref, got)]
    state = states[0]
    if unused:
        # The unused layer's parameters never receive a gradient: they stay at initialisation.
        torch.manual_seed(0)
        init = _Net(True).double()
        assert torch.equal(got[-1], init.unused.bias.detach()) and torch.equal(got[-2], init.unused.weight.detach())
    buf = io.BytesIO()
    torch.save(state.state_dict(), buf)
    buf.seek(0)
    loaded = torch.load(buf, weights_only=True)
    restored = hooks.AllReduceState(algorithm=algo)
    restored.load_state_dict(loaded)
    return max(diffs), state.step, restored.step


@pytest.mark.parametrize("algo", ["hierarchical", "flat", "auto"])
def test_ddp_hook_matches_ddp(ranks, algo):
    """docs/faults.md rows 19-21: with and without bucket views, no_sync accumulation, unused parameters."""
    cases = [(True, False, 1), (False, False, 1), (True, True, 1), (False, False, 3)]
    for bucket_view, unused, accumulate in cases:
        res = ranks(4, _compare, algo, bucket_view, unused, accumulate, timeout=180)
        for maxdiff, step, restored_step in res:
            assert maxdiff < 1e-10, (algo, bucket_view, unused, accumulate, maxdiff)
            assert step == 20 and restored_step == 20  # the hook ran on sync steps only


def _pickle_and_checks():
    import pickle

    state = hooks.AllReduceState(Topology.from_spec("1x2"), "hierarchical", process_group=dist.group.WORLD)
    clone = pickle.loads(pickle.dumps(state))
    assert clone.process_group is None and clone.topology is None and clone.algorithm == "hierarchical"
    # Sparse gradients are refused at registration, not mid-backward (docs/faults.md row 22).
    emb = DDP(nn.Embedding(10, 3, sparse=True))
    with pytest.raises(NotImplementedError, match="sparse gradients"):
        hooks.register(emb, hooks.AllReduceState())
    with pytest.raises(TypeError, match="DistributedDataParallel"):
        hooks.register(nn.Linear(2, 2), hooks.AllReduceState())
    with pytest.raises(ValueError, match="warmup_steps"):
        hooks.AllReduceState(warmup_steps=-1)
    with pytest.raises(ValueError, match="algorithm='hierarchical'"):
        hooks.AllReduceState(algorithm="flat").load_state_dict(state.state_dict())
    return True


def test_state_pickling_and_registration_checks(ranks):
    assert ranks(2, _pickle_and_checks) == [True, True]


class _FakeBucket:
    def __init__(self, buf):
        self._buf = buf

    def buffer(self):
        return self._buf

    def index(self):
        return 3


def test_check_result_names_bucket_and_sizes():
    """docs/faults.md row 14: a wrong numel, dtype or a nested future is a ValueError before DDP copies it."""
    bucket = _FakeBucket(torch.zeros(10))
    assert hooks.check_result(bucket, [torch.ones(10)]).shape == (10,)
    with pytest.raises(ValueError, match=r"bucket 3 produced numel=9 dtype=torch.float32; expected numel=10"):
        hooks.check_result(bucket, torch.ones(9))
    with pytest.raises(ValueError, match="dtype=torch.float64"):
        hooks.check_result(bucket, torch.ones(10, dtype=torch.float64))
    with pytest.raises(ValueError, match="nested Future"):
        hooks.check_result(bucket, torch.futures.Future())
