"""The comm engine's CUDA path (issue 2): work runs on the submitting thread's device, ordered after
the submitting stream by an event, without synchronising the host. Marker ``gpu``: skips without CUDA."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from commopt.comm import Topology, all_reduce
from commopt.comm.engine import Engine, Phase

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


def test_engine_orders_after_the_submitting_stream():
    engine = Engine()
    try:
        x = torch.zeros(1 << 20, device="cuda")
        seen = []
        stream = torch.cuda.Stream()
        with torch.cuda.stream(stream):
            torch.cuda._sleep(50_000_000)  # a long kernel before the write on the submitting stream
            x.fill_(3.0)
            fut = engine.submit([Phase("read", lambda: seen.append(float(x.sum())))], op="test", result=x,
                                device=x.device)
        assert fut.wait() is x
        assert seen == [3.0 * (1 << 20)]
    finally:
        engine.shutdown()


def _gloo_cuda():
    rank = dist.get_rank()
    t = torch.full((100_003,), float(rank + 1), device="cuda")
    all_reduce(t, topology=Topology.from_spec("1x2"), algorithm="hierarchical")
    return float(t[0]), float(t[-1])


def test_gloo_on_cuda_tensors_through_the_engine(ranks):
    assert ranks(2, _gloo_cuda) == [(3.0, 3.0), (3.0, 3.0)]
