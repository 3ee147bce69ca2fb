"""torch.compile with commopt's comms (docs/faults.md row 41; docs/architecture.md section 5.10).

Each path trains a small model 3 steps on 2 ranks compiled and eagerly, and the oracles are the eager
run and torch's own DDP / FSDP2 (bit for bit on CPU): the DDP comm hook on ``torch.compile(ddp_model)``
(DDP's graph splitting keeps bucket hooks), commopt's FSDP2 comms with each block compiled before
``fully_shard`` (torchtitan's pattern) and with the whole model compiled, and ``OverlapDataParallel``
around a compiled module. Compiled autograd cannot run a DDP bucket hook: it is a clear error on
every rank (at ``register``, or at the first backward), never a hook that silently does not run.
commopt's tensor-parallel styles in a compiled block are checked against torch's own styles compiled
the same way (their rings run eagerly between the graphs).

All cases share one 2-rank pool of their own, closed after the file: the compiled-autograd case
changes process-wide dynamo and Inductor settings (DDP's Python reducer adds a trace rule for good),
which no other test should inherit. Inductor compiles cost seconds per rank, so the models are a few
Linear layers and the compiled graphs repeat (one block's graph serves every FSDP2 case from the
cache). The blocks are 512 wide so that DDP makes several 1 MiB buckets: under torch.compile DDP's
graph splitting refuses ``bucket_cap_mb`` below its 1 MiB first bucket (torch 2.13).
"""

from __future__ import annotations

import pytest
from _pool import RankPool

pytestmark = pytest.mark.frameworks

_WIDTH = 512
_STEPS = 3


@pytest.fixture(scope="module")
def world():
    pool = RankPool(2)
    yield pool
    pool.close()


# ------------------------------------------------------------------------------------ rank bodies
def _setup():
    import torch._dynamo
    import torch._inductor.config as inductor_config
    from torch._dynamo.utils import counters

    inductor_config.compile_threads = 1  # no compile worker processes inside a rank
    # Every case starts from empty dynamo caches (the blocks' code object is shared by all cases, and
    # dynamo caches per code object), and a case that would run eagerly past dynamo's recompile limit
    # fails instead; Inductor's own graph cache still saves the compiles that repeat.
    torch._dynamo.reset()
    torch._dynamo.config.fail_on_recompile_limit_hit = True
    counters.clear()


def _net():
    import torch
    from torch import nn

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(_WIDTH, _WIDTH)

        def forward(self, x):
            return torch.relu(self.lin(x))

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = nn.ModuleList([Block() for _ in range(3)])
            self.head = nn.Linear(_WIDTH, 4)

        def forward(self, x):
            for block in self.layers:
                x = block(x)
            return self.head(x)

    torch.manual_seed(0)
    return Net()


def _train(model, rank: int, optimizer=True, steps: int = _STEPS) -> None:
    import torch

    opt = torch.optim.SGD(model.parameters(), lr=0.1) if optimizer else None
    gen = torch.Generator().manual_seed(100 + rank)
    for _ in range(steps):
        model(torch.randn(4, _WIDTH, generator=gen)).square().sum().backward()
        if opt is not None:
            opt.step()
            opt.zero_grad()


def _params(model) -> list:
    from torch.distributed.tensor import DTensor

    return [(p.full_tensor() if isinstance(p, DTensor) else p).detach().clone() for p in model.parameters()]


def _same(a: list, b: list) -> list[bool]:
    import torch

    return [bool(torch.equal(x, y)) for x, y in zip(a, b)] if len(a) == len(b) else [False]


def _fresh() -> None:
    """Empty dynamo's caches before a compiled run, so that its graph count shows it compiled (a cache
    entry left by an earlier run would serve it without a count)."""
    import torch._dynamo
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()


def _graphs() -> int:
    from torch._dynamo.utils import counters

    return counters["stats"]["unique_graphs"]


def _ddp_hook_case(rank: int) -> dict:
    """Plain DDP, DDP with commopt's exact hook eagerly, and the same compiled."""
    import torch
    from torch.nn.parallel import DistributedDataParallel as DDP

    from commopt.comm import context, hooks

    _setup()
    plain = DDP(_net(), bucket_cap_mb=1)
    _train(plain, rank)
    eager = DDP(_net(), bucket_cap_mb=1)
    eager_state = hooks.AllReduceState(algorithm="flat")
    hooks.register(eager, eager_state)
    _train(eager, rank)
    compiled = DDP(_net(), bucket_cap_mb=1)
    state = hooks.AllReduceState(algorithm="flat")
    hooks.register(compiled, state)
    engine = context().engine()
    engine.reset_stats()
    _fresh()
    _train(torch.compile(compiled), rank)
    return {"vs_plain": _same(_params(plain), _params(compiled)), "vs_eager": _same(_params(eager), _params(compiled)),
            "buckets": (eager_state.buckets_reduced, state.buckets_reduced), "graphs": _graphs(),
            "calls": engine.calls(), "bytes": sum(engine.bytes_sent().values()),
            "grad_bytes": sum(p.numel() * p.element_size() for p in compiled.parameters())}


def _fsdp_case(rank: int) -> dict:
    """Native FSDP2, commopt's exact comms and its ZeRO++ recipe, each eager, with every block compiled
    before ``fully_shard`` and with the whole model compiled."""
    import torch
    from torch.distributed.fsdp import fully_shard

    from commopt.comm import context, fsdp
    from commopt.comm.compression import QuantizeCompressor

    _setup()
    native = _net()
    for block in native.layers:
        fully_shard(block)
    fully_shard(native)
    _train(native, rank)
    out: dict = {}
    params: dict = {"native": _params(native)}
    engine = context().engine()
    for recipe in ("exact", "zero++"):
        for how in ("eager", "blocks", "whole"):
            model = _net()
            if how == "blocks":  # torchtitan: compile each block, put it back, then shard
                for i, block in enumerate(model.layers):
                    model.layers.register_module(str(i), torch.compile(block, fullgraph=True))
            if recipe == "exact":
                fsdp.shard(model, weights=None, gradients=None, hpz=False, algorithm="flat")
            else:
                fsdp.shard(model, weights=QuantizeCompressor(8), gradients=QuantizeCompressor(4), hpz=True)
            engine.reset_stats()
            _fresh()
            _train(torch.compile(model) if how == "whole" else model, rank)
            params[recipe, how] = _params(model)
            out[recipe, how] = {"calls": engine.calls(), "graphs": _graphs()}
    for recipe in ("exact", "zero++"):
        for how in ("blocks", "whole"):
            out[recipe, how]["vs_eager"] = _same(params[recipe, "eager"], params[recipe, how])
        out[recipe, "vs_native"] = {how: _same(params["native"], params[recipe, how])
                                    for how in ("eager", "blocks", "whole")}
    return out


def _overlap_case(rank: int) -> dict:
    """Plain DDP, and OverlapDataParallel around the model eagerly, around ``torch.compile(model)`` and
    around a model whose blocks are compiled."""
    import torch
    from torch.nn.parallel import DistributedDataParallel as DDP

    from commopt.schedules import OverlapDataParallel

    _setup()
    plain = DDP(_net(), bucket_cap_mb=1)
    _train(plain, rank)
    reference = _params(plain)
    out: dict = {}
    params: dict = {}
    for how in ("eager", "compiled", "blocks"):
        model = _net()
        inner = torch.compile(model) if how == "compiled" else model
        if how == "blocks":
            for i, block in enumerate(model.layers):
                model.layers.register_module(str(i), torch.compile(block))
        odp = OverlapDataParallel(inner, lambda ps: torch.optim.SGD(ps, lr=0.1), algorithm="flat",
                                  bucket_cap_mb=1, first_bucket_cap_mb=1, timeout=60)
        _fresh()
        _train(odp, rank, optimizer=False)
        odp.synchronize()
        params[how] = _params(model)
        out[how] = {"chunks": len(odp.issue_log), "buckets": len(odp.buckets.buckets), "graphs": _graphs(),
                    "vs_ddp": _same(reference, params[how])}
        odp.close()
    for how in ("compiled", "blocks"):
        out[how]["vs_eager"] = _same(params["eager"], params[how])
    return out


def _compiled_autograd_case(rank: int) -> dict:
    """Compiled autograd and the DDP hook: every way in is a clear error, and no hook silently runs less."""
    import torch
    import torch._dynamo.config as dynamo_config
    import torch._inductor.config as inductor_config
    from torch._dynamo import compiled_autograd
    from torch.nn.parallel import DistributedDataParallel as DDP

    from commopt.comm import context, hooks

    _setup()
    engine = context().engine()
    out: dict = {}
    keep = []  # DDP models outlive the case (freeing a reducer mid-error can wait on gloo)

    def attempt(name, fn):
        engine.reset_stats()
        try:
            fn()
            out[name] = ("ok", "")
        except Exception as exc:  # noqa: BLE001 - the case reports what was raised
            out[name] = (type(exc).__name__, str(exc))
        out[name + "/bytes"] = sum(engine.bytes_sent().values())

    # 1. Compiled autograd with DDP's C++ reducer (the default): torch refuses it at the first backward.
    cpp = DDP(_net(), bucket_cap_mb=1)
    hooks.register(cpp, hooks.AllReduceState(algorithm="flat"))
    keep.append(cpp)
    before = _params(cpp)

    def with_compiled_autograd(model):
        with compiled_autograd._enable(torch.compile(backend="eager")):
            _train(model, rank, steps=1)

    attempt("cpp_reducer", lambda: with_compiled_autograd(cpp))
    out["cpp_reducer/unchanged"] = _same(before, _params(cpp))

    # 2. DDP built for compiled autograd (the Python reducer): register says no, before any step.
    saved = (dynamo_config.optimize_ddp, inductor_config._fuse_ddp_communication,
             inductor_config._fuse_ddp_bucket_size)
    try:
        dynamo_config.optimize_ddp = "python_reducer"
        py = DDP(_net(), bucket_cap_mb=1)
        keep.append(py)
        attempt("register", lambda: hooks.register(py, hooks.AllReduceState(algorithm="flat")))
        # 3. The hook registered directly: the first backward raises, compiled autograd or not.
        py.register_comm_hook(hooks.AllReduceState(algorithm="flat"), hooks.allreduce_hook)
        before = _params(py)
        attempt("direct/eager_backward", lambda: _train(py, rank, steps=1))
        attempt("direct/compiled_autograd", lambda: with_compiled_autograd(py))
        out["direct/unchanged"] = _same(before, _params(py))
    finally:
        (dynamo_config.optimize_ddp, inductor_config._fuse_ddp_communication,
         inductor_config._fuse_ddp_bucket_size) = saved
        torch._dynamo.reset()
    torch.distributed.barrier()
    return out


_TP_DIM, _TP_HIDDEN, _TP_STEPS = 8, 16, 2
_RINGS = ("all_gather_matmul", "all_gather_matmul/backward", "matmul_reduce_scatter", "matmul_reduce_scatter/backward",
          "matmul_all_reduce")


def _tp_block():
    """A tiny block whose plan meets every ring of commopt's styles: a sequence-parallel norm, two
    fused Colwise modules sharing one gathered input, a reduce-scattering Rowwise, then a fused
    Colwise and a Rowwise with a replicated output (``matmul_all_reduce``)."""
    import torch
    import torch.nn.functional as F
    from torch import nn

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.norm = nn.LayerNorm(_TP_DIM)
            self.w1, self.w3 = nn.Linear(_TP_DIM, _TP_HIDDEN, bias=False), nn.Linear(_TP_DIM, _TP_HIDDEN)
            self.w2 = nn.Linear(_TP_HIDDEN, _TP_DIM)
            self.out1, self.out2 = nn.Linear(_TP_DIM, _TP_HIDDEN), nn.Linear(_TP_HIDDEN, _TP_DIM)

        def forward(self, x):
            n = self.norm(x)
            h = x + self.w2(F.silu(self.w1(n)) * self.w3(n))
            return self.out2(torch.relu(self.out1(h)))

    torch.manual_seed(0)
    return Block()


def _tp_plan(col, row, seq) -> dict:
    from torch.distributed.tensor import Shard

    return {"norm": seq(), "w1": col(input_layouts=Shard(1)), "w3": col(input_layouts=Shard(1)),
            "w2": row(output_layouts=Shard(1)), "out1": col(input_layouts=Shard(1)), "out2": row()}


def _tp_case(rank: int) -> dict:
    """torch's styles and commopt's in one plan, each parallelized then compiled ("after") and
    compiled in place (``block.compile()``) then parallelized ("before"); commopt's also eagerly and
    with ``fullgraph=True``. Every comparison runs here (``close_to``); the failures come back as text."""
    from functools import partial

    import torch
    import torch.distributed.tensor.parallel as torch_tp
    from _oracle import close_to
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import parallelize_module

    from commopt.comm import context
    from commopt.schedules import ColwiseParallel, RowwiseParallel, SequenceParallel

    _setup()
    mesh = init_device_mesh("cpu", (2,))
    engine = context().engine()
    # commopt's rings forced (algorithm="ring"): the choice between them and torch's collective is
    # tests/test_tp_choice.py's.
    styles = {"torch": (torch_tp.ColwiseParallel, torch_tp.RowwiseParallel, torch_tp.SequenceParallel),
              "commopt": (partial(ColwiseParallel, algorithm="ring"), partial(RowwiseParallel, algorithm="ring"),
                          SequenceParallel)}
    inputs = [torch.randn(2, 4, _TP_DIM, generator=torch.Generator().manual_seed(200 + s)).chunk(2, dim=1)[rank]
              for s in range(_TP_STEPS)]

    def run(name: str, how: str) -> dict:
        block = _tp_block()
        if how == "before":  # torch's in-place compile (a torch.compile wrapper hides the plan's names)
            block.compile()
        parallelize_module(block, mesh, _tp_plan(*styles[name]))
        model = torch.compile(block) if how == "after" else block
        engine.reset_stats()
        _fresh()
        outs, x_grads, graphs = [], [], []
        for x in inputs:  # the gradients accumulate over the steps
            x = x.clone().requires_grad_()
            out = model(x)
            out.square().sum().backward()
            outs.append(out.detach().clone())
            x_grads.append(x.grad)
            graphs.append(_graphs())
        sent = engine.bytes_sent()
        params = {k: (p.placements, p.grad.placements, p.grad.to_local()) for k, p in block.named_parameters()}
        return {"outs": outs, "x_grads": x_grads, "graphs": graphs, "sent": {op: sent.get(op, 0) for op in _RINGS},
                "params": params}

    runs = {(name, how): run(name, how) for name, how in (("commopt", "eager"), ("torch", "after"),
                                                          ("commopt", "after"), ("torch", "before"),
                                                          ("commopt", "before"))}

    def differences(got: dict, ref: dict, what: str) -> list[str]:
        bad = []

        def check(g, r, item):
            try:
                close_to(g, r, torch.float32, 2, f"{what}: {item}")
            except AssertionError as exc:
                bad.append(str(exc))

        for step in range(_TP_STEPS):
            check(got["outs"][step], ref["outs"][step], f"output, step {step}")
            check(got["x_grads"][step], ref["x_grads"][step], f"input grad, step {step}")
        if got["params"].keys() != ref["params"].keys():
            return bad + [f"{what}: parameters {sorted(got['params'])} vs {sorted(ref['params'])}"]
        for k, (placements, grad_placements, grad) in got["params"].items():
            if (placements, grad_placements) != ref["params"][k][:2]:
                bad.append(f"{what}: {k} placed {placements, grad_placements} vs {ref['params'][k][:2]}")
            check(grad, ref["params"][k][2], f"{k}.grad")
        return bad

    out: dict = {"shard_bytes": inputs[0].numel() * inputs[0].element_size()}
    for how in ("after", "before"):
        mine = runs["commopt", how]
        out[how] = {"vs_torch": differences(mine, runs["torch", how], f"{how}, vs torch's styles"),
                    "vs_eager": differences(mine, runs["commopt", "eager"], f"{how}, vs commopt eager"),
                    "graphs": mine["graphs"], "torch_graphs": runs["torch", how]["graphs"], "sent": mine["sent"],
                    "torch_sent": sum(runs["torch", how]["sent"].values())}
    out["eager_sent"] = runs["commopt", "eager"]["sent"]

    # fullgraph=True cannot hold a ring (it runs eagerly, outside the graphs): dynamo refuses it at the
    # first fused Linear, before anything runs.
    block = parallelize_module(_tp_block(), mesh, _tp_plan(*styles["commopt"]))
    engine.reset_stats()
    _fresh()
    try:
        torch.compile(block, fullgraph=True)(inputs[0])
        out["fullgraph"] = ("ok", "")
    except Exception as exc:  # noqa: BLE001 - the case reports what was raised
        out["fullgraph"] = (type(exc).__name__, str(exc))
    out["fullgraph/bytes"] = sum(engine.bytes_sent().values())
    return out


# ------------------------------------------------------------------------------------ tests
def _all(flags: list[bool]) -> bool:
    return bool(flags) and all(flags)


def test_ddp_hook_under_torch_compile_matches_eager_and_plain_ddp(world):
    """Row 41, DDP hook: ``torch.compile(ddp_model)`` with commopt's exact hook gives the eager hooked
    run's and plain DDP's parameters bit for bit, and the hook ran for every bucket (engine counters)."""
    for r, res in enumerate(world.run(_ddp_hook_case, per_rank=[(0,), (1,)], timeout=300)):
        assert _all(res["vs_eager"]), (r, res["vs_eager"])
        assert _all(res["vs_plain"]), (r, res["vs_plain"])
        eager_buckets, compiled_buckets = res["buckets"]
        # Several buckets a step, each through the hook (the counts need not equal the eager run's:
        # eagerly, DDP rebuilds its buckets in gradient order after the first step).
        assert compiled_buckets >= 2 * _STEPS and eager_buckets >= 2 * _STEPS, res["buckets"]
        assert res["calls"].get("flat") == compiled_buckets, res["calls"]
        # Every step's gradients went through commopt's engine: flat all-reduce on 2 ranks sends the
        # whole buffer once per step at least.
        assert res["bytes"] >= _STEPS * res["grad_bytes"], res
        assert res["graphs"] >= 1, res  # it ran compiled


def test_fsdp_comms_with_compiled_blocks_and_compiled_model_match_eager(world):
    """Row 41, FSDP2: blocks compiled before ``fully_shard`` (torchtitan's pattern) and the whole model
    compiled give the eager run's parameters bit for bit, with commopt's exact comms (= native FSDP2)
    and with its ZeRO++ recipe, and commopt's comms served every step as eagerly."""
    for r, res in enumerate(world.run(_fsdp_case, per_rank=[(0,), (1,)], timeout=300)):
        for recipe in ("exact", "zero++"):
            eager_calls = res[recipe, "eager"]["calls"]
            assert any(k.startswith(("reduce_scatter", "fsdp/reduce_scatter")) for k in eager_calls), eager_calls
            for how in ("blocks", "whole"):
                case = res[recipe, how]
                assert _all(case["vs_eager"]), (r, recipe, how, case["vs_eager"])
                assert case["calls"] == eager_calls, (r, recipe, how, case["calls"], eager_calls)
                assert case["graphs"] >= 1, (recipe, how, case)
        assert all(_all(v) for v in res["exact", "vs_native"].values()), (r, res["exact", "vs_native"])


def test_overlap_data_parallel_around_compiled_module_matches_eager(world):
    """Row 41, OverlapDataParallel: around ``torch.compile(model)`` and around compiled blocks, the
    parameters equal the eager wrapper's and plain DDP's bit for bit, and every chunk was issued."""
    res_all = world.run(_overlap_case, per_rank=[(0,), (1,)], timeout=300)
    for r, res in enumerate(res_all):
        assert _all(res["eager"]["vs_ddp"]), (r, res["eager"])
        assert res["eager"]["buckets"] > 1, res["eager"]
        for how in ("compiled", "blocks"):
            assert _all(res[how]["vs_eager"]), (r, how, res[how])
            assert _all(res[how]["vs_ddp"]), (r, how, res[how])
            assert res[how]["chunks"] == res["eager"]["chunks"] > 0, (how, res[how], res["eager"])
            assert res[how]["graphs"] >= 1, (how, res[how])


def test_tensor_parallel_styles_under_torch_compile_match_torch_styles(world):
    """Row 41, tensor parallelism: a block parallelized with commopt's ColwiseParallel /
    RowwiseParallel / SequenceParallel and then compiled, or compiled in place (``block.compile()``)
    and then parallelized, 2 forward + backward steps. Oracle: the same block with torch's own styles
    compiled the same way, and commopt's eager run: outputs, input gradients, parameter and gradient
    placements and every parameter gradient equal (``close_to``, fp32). Every ring ran, compiled,
    with the eager run's bytes (the shared gather too), and torch's plan sent nothing through commopt;
    the rings are graph breaks, so the block compiles a few graphs, the same on the second step (no
    recompile). ``fullgraph=True`` is dynamo's ``Unsupported`` at the first fused Linear, nothing sent."""
    for r, res in enumerate(world.run(_tp_case, per_rank=[(0,), (1,)], timeout=300)):
        eager = res["eager_sent"]
        assert all(eager[op] > 0 for op in _RINGS), eager
        # Two gathers a step (w1 and w3 share one), each ring moves the other rank's shard.
        assert eager["all_gather_matmul"] == 2 * _TP_STEPS * res["shard_bytes"], eager
        for how in ("after", "before"):
            case = res[how]
            assert case["vs_torch"] == [], (r, how, case["vs_torch"])
            assert case["vs_eager"] == [], (r, how, case["vs_eager"])
            assert case["sent"] == eager, (r, how, case["sent"], eager)
            assert case["torch_sent"] == 0, (r, how, case["torch_sent"])
            assert case["torch_graphs"][0] >= 1, (how, case)  # torch's styles ran compiled
            # It ran compiled, one graph at most per stretch between the five rings (the comm engine
            # is not traced into pieces), and the second step reused them.
            graphs = case["graphs"]
            assert 1 <= graphs[0] <= 6 and graphs == [graphs[0]] * _TP_STEPS, (r, how, graphs)
        kind, msg = res["fullgraph"]
        assert kind == "Unsupported" and "_colwise_fused" in msg, (r, res["fullgraph"])
        assert res["fullgraph/bytes"] == 0, (r, res["fullgraph/bytes"])


def test_compiled_autograd_is_a_clear_error_on_every_rank(world):
    """Row 41, compiled autograd: DDP's C++ reducer refuses it (torch's error, at the first backward);
    a DDP model built for it (``optimize_ddp="python_reducer"``, which would call the hook per
    parameter and drop its Future) is refused by ``hooks.register`` before any step, and the hook
    registered directly raises at the first backward, with or without compiled autograd. Every rank
    raises, no byte moves through commopt and no parameter changes."""
    for r, res in enumerate(world.run(_compiled_autograd_case, per_rank=[(0,), (1,)], timeout=300)):
        kind, msg = res["cpp_reducer"]
        assert kind == "RuntimeError" and "Compiled autograd is not compatible with C++ DDP Reducer" in msg, (r, res)
        assert res["cpp_reducer/bytes"] == 0 and _all(res["cpp_reducer/unchanged"]), (r, res)
        kind, msg = res["register"]
        assert kind == "NotImplementedError" and "hooks.register" in msg and "python_reducer" in msg, (r, res)
        assert "torch.compile(model) without compiled autograd" in msg, msg
        for name in ("direct/eager_backward", "direct/compiled_autograd"):
            kind, msg = res[name]
            assert kind != "ok" and "allreduce_hook was called with a tuple" in msg and "python_reducer" in msg, \
                (r, name, res[name])
            assert res[name + "/bytes"] == 0, (r, name, res)
        assert _all(res["direct/unchanged"]), (r, res)

