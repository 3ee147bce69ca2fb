"""commopt's tensor-parallel styles through the checks of torch's own TP style and example tests
(issue 38, item 5: the independent oracles), on torch's testing models from the wheel.

torch's test files (test/distributed/tensor/parallel/test_tp_style.py, test_tp_examples.py) are not in
the wheel; what they check is checked here, on 2 gloo ranks, with commopt's ``ColwiseParallel`` /
``RowwiseParallel`` / ``SequenceParallel`` (``commopt.schedules``) in place of torch's, each case run
with the rings forced (``algorithm="ring"``) and as users get them (``"auto"``):

- each style alone (test_tp_style): column-wise on a replicated and on a batch-sharded input, on an
  ``nn.Embedding``; row-wise with a replicated and a batch-sharded output, on an ``nn.Embedding`` with
  a replicated input; frozen weights stay frozen; sequence parallelism on ``LayerNorm`` (with and
  without affine parameters), torch's ``RMSNormPython``, dropout and a batch-sharded input;
- torch's ``MLPModule`` trained with and without sequence parallelism (SGD), and run under
  ``torch.inference_mode`` (test_tp_examples' MLP tests);
- torch's ``Transformer`` (``ModelArgs(dropout_p=0.0)``: tied embeddings, positional embeddings,
  LayerNorms, biased feed-forward) parallelized by torch's own ``Transformer.parallelize`` with the
  style classes it uses swapped for commopt's, with and without sequence parallelism, fp32 and fp64,
  attention on local heads (torch's fp64 setting; its fp32 one attends on DTensors, which on CPU has no
  sharding rule), trained with Adam (as torch's: 10 steps in fp64, 1 in fp32); and untied with a
  subset of its parameters trainable (test_transformer_req_grad).

The oracles are torch's: the same module and plan on torch's own styles (outputs, DTensor placements
and local values of outputs, input gradients, parameters and parameter gradients must match, fp32 with
``assert_close``'s default tolerances, fp64 with its fp64 ones), and, for the two models, the unsharded
module on one rank, as torch's tests compare (outputs, gradients and parameters after each optimizer
step). Communication counts (torch's ``CommDebugMode``) are not compared: commopt's rings are other
collectives by design; which ran is tested in tests/test_tensor_parallel.py.

Importing torch's testing package disables torch's global backend flags and patches TorchScript in
the importing process, so these bodies run in a rank pool of their own (never the shared one) and
pytest's own process never imports it. It needs ``expecttest`` (in the ``dev`` extra).
"""

from __future__ import annotations

import importlib.util

import pytest
from _pool import RankPool

pytestmark = pytest.mark.skipif(importlib.util.find_spec("expecttest") is None,
                                reason="torch's testing models need expecttest (pip install -e '.[dev]')")

_KINDS = ("ring", "auto")  # commopt's styles: the rings forced, and the choice users get by default


@pytest.fixture(scope="module")
def pool():
    pool = RankPool(2)  # its own ranks: torch.testing._internal changes the process that imports it
    yield pool
    pool.close()


# ------------------------------------------------------------------------------------ in the ranks
def _styles(kind: str) -> tuple:
    """(Colwise, Rowwise, Sequence) style factories: torch's (``kind="torch"``) or commopt's with
    ``algorithm=kind``."""
    from functools import partial

    from torch.distributed.tensor import parallel as torch_tp

    from commopt.schedules import ColwiseParallel, RowwiseParallel, SequenceParallel

    if kind == "torch":
        return torch_tp.ColwiseParallel, torch_tp.RowwiseParallel, torch_tp.SequenceParallel
    return partial(ColwiseParallel, algorithm=kind), partial(RowwiseParallel, algorithm=kind), SequenceParallel


def _close(got, ref, what: str) -> None:
    """The same kind of result: both DTensors with the same placements and shape and equal local
    values, or both plain tensors, equal."""
    import torch
    from torch.distributed.tensor import DTensor

    assert isinstance(got, DTensor) == isinstance(ref, DTensor), (what, type(got), type(ref))
    if isinstance(got, DTensor):
        assert got.placements == ref.placements and got.shape == ref.shape, (what, got.placements, ref.placements)
        got, ref = got.to_local(), ref.to_local()
    assert got.shape == ref.shape, (what, got.shape, ref.shape)
    torch.testing.assert_close(got, ref, msg=lambda m: f"{what}: {m}")


def _same_params(got, ref, what: str) -> None:
    """Parameters and their gradients as torch's styles left them: names, ``requires_grad``,
    placements, values."""
    got_p, ref_p = dict(got.named_parameters()), dict(ref.named_parameters())
    assert got_p.keys() == ref_p.keys(), (what, sorted(got_p), sorted(ref_p))
    for name, p in got_p.items():
        r = ref_p[name]
        assert p.requires_grad == r.requires_grad, (what, name)
        _close(p.detach(), r.detach(), f"{what} {name}")
        assert (p.grad is None) == (r.grad is None), (what, name, p.grad is None)
        if p.grad is not None:
            _close(p.grad, r.grad, f"{what} {name}.grad")


def _full(t):
    from torch.distributed.tensor import DTensor

    return t.full_tensor() if isinstance(t, DTensor) else t


def _like_unsharded(got, single, what: str, grads: bool = False) -> None:
    """``got``'s parameters (or gradients) gathered equal ``single``'s, the unsharded module's."""
    import torch

    ref = dict(single.named_parameters())
    for name, p in got.named_parameters():
        if grads and p.grad is None:
            assert ref[name].grad is None, (what, name)
            continue
        torch.testing.assert_close(_full(p.grad if grads else p.detach()),
                                   ref[name].grad if grads else ref[name].detach(),
                                   msg=lambda m, name=name: f"{what} {name}{'.grad' if grads else ''}: {m}")


def _style_cases(kind: str) -> list[str]:
    """test_tp_style's cases: each style alone on a Linear, an Embedding or a norm, commopt's against
    torch's from the same weights and inputs."""
    import copy

    import torch
    from torch import nn
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor
    from torch.distributed.tensor.parallel import parallelize_module
    from torch.testing._internal.distributed._tensor.common_dtensor import RMSNormPython

    mesh = init_device_mesh("cpu", (2,))
    world, me = 2, mesh.get_local_rank()
    done = []

    def run(make, style_of, x, shape):
        """``make()`` parallelized with torch's style and with commopt's, forward, ``sum().backward()``."""
        torch.manual_seed(0)
        base = make()
        outs = []
        for k in ("torch", kind):
            model = parallelize_module(copy.deepcopy(base), mesh, style_of(*_styles(k)))
            xk = x.detach().clone().requires_grad_(x.is_floating_point())
            out = model(xk)
            assert tuple(out.shape) == shape, (k, tuple(out.shape), shape)
            out.sum().backward()
            outs.append((model, out, xk.grad))
        (tm, tout, tgrad), (cm, cout, cgrad) = outs
        return tm, tout, tgrad, cm, cout, cgrad

    def check(what, make, style_of, x, shape):
        tm, tout, tgrad, cm, cout, cgrad = run(make, style_of, x, shape)
        _close(cout, tout, f"{what} output")
        if tgrad is not None or cgrad is not None:
            _close(cgrad, tgrad, f"{what} input grad")
        _same_params(cm, tm, what)
        done.append(what)
        return cm

    g = torch.Generator().manual_seed(10 + me)  # a different input per rank where it is a shard
    x_rep = torch.rand(8, 16, generator=torch.Generator().manual_seed(9))
    x_local = torch.rand(8, 16, generator=g)
    check("colwise, replicated input", lambda: nn.Linear(16, 16), lambda c, r, s: c(), x_rep, (8, 16 // world))
    check("colwise, Shard(0) input", lambda: nn.Linear(16, 16), lambda c, r, s: c(input_layouts=Shard(0)),
          x_local, (8 * world, 16 // world))
    ids = torch.arange(8).reshape(4, 2)
    check("colwise embedding", lambda: nn.Embedding(16, 16), lambda c, r, s: c(), ids, (4, 2, 16 // world))
    check("rowwise, replicated output", lambda: nn.Linear(16, 16), lambda c, r, s: r(), x_local[:, :8], (8, 16))
    check("rowwise, Shard(0) output", lambda: nn.Linear(16, 16), lambda c, r, s: r(output_layouts=Shard(0)),
          x_local[:, :8], (8 // world, 16))
    check("rowwise embedding, replicated output", lambda: nn.Embedding(16, 16),
          lambda c, r, s: r(input_layouts=Replicate()), ids, (4, 2, 16))
    check("rowwise embedding, Shard(1) output", lambda: nn.Embedding(16, 16),
          lambda c, r, s: r(input_layouts=Replicate(), output_layouts=Shard(1)), torch.arange(8), (8, 16 // world))

    def frozen_weight():
        lin = nn.Linear(16, 16)
        lin.weight.requires_grad = False
        return lin

    for what, style_of, x in (("colwise, frozen weight", lambda c, r, s: c(), x_rep),
                              ("rowwise, frozen weight", lambda c, r, s: r(), x_local[:, :8])):
        model = check(what, frozen_weight, style_of, x, (8, 16 // world) if "colwise" in what else (8, 16))
        assert not model.weight.requires_grad and model.bias.requires_grad, what

    # Sequence parallelism: a DTensor input sharded on the sequence (or, last, on the batch), output
    # Shard(1) as torch's; the unsharded norm's output and gradients as well.
    global_input = torch.rand(20, 8 * world, 12, generator=torch.Generator().manual_seed(11))
    norms = [("layernorm", lambda: nn.LayerNorm(12)),
             ("layernorm without affine", lambda: nn.LayerNorm(12, elementwise_affine=False)),
             ("rmsnorm", lambda: RMSNormPython(12))]
    for (what, make), layout in [*((n, Shard(1)) for n in norms), (norms[2], Shard(0))]:
        what = f"sequence parallel {what}, input {layout}"
        x = distribute_tensor(global_input, mesh, [layout])
        tm, tout, tgrad, cm, cout, cgrad = run(make, lambda c, r, s: s(), x, tuple(global_input.shape))
        assert cout.placements == (Shard(1),), (what, cout.placements)
        _close(cout, tout, f"{what} output")
        _close(cgrad, tgrad, f"{what} input grad")
        _same_params(cm, tm, what)
        single = make()
        xs = global_input.clone().requires_grad_()
        ref = single(xs)
        ref.sum().backward()
        torch.testing.assert_close(cout.full_tensor(), ref)
        torch.testing.assert_close(cgrad.full_tensor(), xs.grad)
        _like_unsharded(cm, single, what, grads=True)
        done.append(what)
    x = distribute_tensor(global_input, mesh, [Shard(1)])
    outs = []
    for k in ("torch", kind):  # dropout: the same random stream under both styles
        drop = parallelize_module(nn.Dropout(0.5), mesh, _styles(k)[2]())
        torch.manual_seed(5)
        outs.append(drop(x))
    assert outs[1].placements == (Shard(1),), outs[1].placements
    _close(outs[1], outs[0], "sequence parallel dropout output")
    done.append("sequence parallel dropout")
    return done


def _mlp_cases(kind: str) -> list[str]:
    """test_tp_examples' MLP: ``MLPModule`` trained one SGD step with and without sequence
    parallelism (outputs, gradients, parameters, the next output), against the unsharded module and
    against torch's styles; and inference under ``torch.inference_mode``."""
    import copy

    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.parallel import parallelize_module
    from torch.testing._internal.distributed._tensor.common_dtensor import MLPModule

    mesh = init_device_mesh("cpu", (2,))
    done = []
    for sp in (True, False):
        torch.manual_seed(dist.get_rank() if sp else 0)  # a batch shard per rank under SP, else the same input
        inp, nxt = torch.rand(8, 10), torch.rand(8, 10)
        single = MLPModule("cpu")
        runs = {}
        for k in ("torch", kind):
            col, row, _ = _styles(k)
            plan = {"net1": col(input_layouts=Shard(0)) if sp else col(),
                    "net2": row(output_layouts=Shard(0)) if sp else row()}
            model = parallelize_module(copy.deepcopy(single), mesh, plan)
            opt = torch.optim.SGD(model.parameters(), lr=0.25)
            out = model(inp)
            out.sum().backward()
            runs[k] = (model, opt, out)
        s_opt = torch.optim.SGD(single.parameters(), lr=0.25)
        ref = single(inp)
        ref.sum().backward()
        if sp:  # the unsharded module saw one rank's batch: the TP gradients are the sum over the ranks'
            for p in single.parameters():
                dist.all_reduce(p.grad)
        what = f"mlp sequence_parallel={sp}"
        model, opt, out = runs[kind]
        _close(out, runs["torch"][2], f"{what} output")
        torch.testing.assert_close(out, ref)
        _same_params(model, runs["torch"][0], what)
        _like_unsharded(model, single, what, grads=True)
        for _, o, _ in runs.values():
            o.step()
        s_opt.step()
        _same_params(model, runs["torch"][0], f"{what} after SGD")
        _like_unsharded(model, single, f"{what} after SGD")
        torch.testing.assert_close(model(nxt), single(nxt))
        done.append(what)
    with torch.inference_mode():
        torch.manual_seed(0)
        inp = torch.rand(8, 10)
        single = MLPModule("cpu")
        col, row, _ = _styles(kind)
        model = parallelize_module(copy.deepcopy(single), mesh, {"net1": col(), "net2": row()})
        torch.testing.assert_close(model(inp), single(inp))
    done.append("mlp inference")
    return done


def _transformer_cases(kind: str) -> list[str]:
    """test_tp_examples' Transformer: torch's ``Transformer.parallelize`` with its style classes
    swapped for commopt's (its plan otherwise: ``PrepareModuleInput``, tied embeddings, ``output``
    column-parallel to a replicated output), Adam steps on the same tokens; against torch's styles and
    the unsharded model."""
    import copy
    from unittest import mock

    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.experimental import implicit_replication
    from torch.testing._internal.distributed._tensor import common_dtensor
    from torch.testing._internal.distributed._tensor.common_dtensor import ModelArgs, Transformer

    mesh = init_device_mesh("cpu", (2,))
    made: list[str] = []

    def counted(style, name):
        def make(*args, **kwargs):
            made.append(name)
            return style(*args, **kwargs)
        return make

    def parallelized(model, k, sp):
        # Attention on each rank's heads as local tensors (torch's fp64 case; its fp32 case attends on
        # DTensors, on GPUs only: on CPU DTensor has no sharding rule for SDPA's fused kernel, and its
        # math kernel adds a plain causal mask to DTensors).
        if k == "torch":
            return Transformer.parallelize(model, mesh, sp, local_output_for_attn=True)
        col, row, seq = _styles(k)
        with mock.patch.multiple(common_dtensor, ColwiseParallel=counted(col, "colwise"),
                                 RowwiseParallel=counted(row, "rowwise"), SequenceParallel=counted(seq, "sequence")):
            return Transformer.parallelize(model, mesh, sp, local_output_for_attn=True)

    thaw = ("tok_embeddings.weight", "layers.0.attention.wv.weight", "layers.0.feed_forward.w1.bias",
            "layers.1.ffn_norm.bias", "layers.1.feed_forward.w2.weight", "output.weight")
    cases = [(sp, dtype, None) for sp in (True, False) for dtype in (torch.float32, torch.float64)]
    cases.append((True, torch.float32, thaw))
    done = []
    for sp, dtype, trainable in cases:
        what = f"transformer sequence_parallel={sp} {dtype} {'thaw subset' if trainable else 'all trainable'}"
        args = ModelArgs(dropout_p=0.0, weight_tying=trainable is None)
        torch.manual_seed(0)
        single = Transformer(args).to(dtype=dtype)
        models = {k: parallelized(copy.deepcopy(single), k, sp) for k in ("torch", kind)}
        if trainable is not None:
            for m in (single, *models.values()):
                for n, p in m.named_parameters():
                    p.requires_grad_(n in trainable)
        opts = {k: torch.optim.Adam(m.parameters(), lr=0.25) for k, m in models.items()}
        s_opt = torch.optim.Adam(single.parameters(), lr=0.25)
        torch.manual_seed(0)
        # torch's steps: 10 in fp64, 1 in fp32, where Adam at lr 0.25 turns the fp32 rounding of any
        # two orders of summation (torch's own TP against one rank as much as commopt's against
        # torch's: 1e-4 on the second step's gradients) into differences beyond fp32's tolerances
        for step in range(10 if dtype is torch.float64 else 1):
            tokens = torch.randint(args.vocab_size, (8, 8))
            ref = single(tokens)
            outs = {k: m(tokens) for k, m in models.items()}
            _close(outs[kind], outs["torch"], f"{what} step {step} output")
            torch.testing.assert_close(outs[kind], ref, msg=lambda m, w=f"{what} step {step}": f"{w}: {m}")
            ref.sum().backward()
            for out in outs.values():
                out.sum().backward()
            _same_params(models[kind], models["torch"], f"{what} step {step}")
            _like_unsharded(models[kind], single, f"{what} step {step}", grads=True)
            s_opt.step()
            with implicit_replication():  # as torch's test: some parameters are plain tensors
                for opt in opts.values():
                    opt.step()
            _same_params(models[kind], models["torch"], f"{what} after Adam step {step}")
            _like_unsharded(models[kind], single, f"{what} after Adam step {step}")
            for opt in (s_opt, *opts.values()):
                opt.zero_grad()
        done.append(what)
    # torch's plan per layer: wq, wk, wv, w1 column-wise and wo, w2 row-wise; at the root the two
    # embeddings row-wise, the output column-wise (and norms sequence-parallel under SP)
    per_model = {"colwise": 2 * 4 + 1, "rowwise": 2 * 2 + 2}
    expected = {name: n * len(cases) for name, n in per_model.items()}
    expected["sequence"] = 3 * (2 * 2 + 1)  # the three SP cases: two norms per layer and the final one
    assert {name: made.count(name) for name in expected} == expected, made
    return done


# ------------------------------------------------------------------------------------ the tests
@pytest.mark.parametrize("kind", _KINDS)
def test_styles_pass_torchs_style_checks(pool, kind):
    """docs/faults.md row 39 (exactness): commopt's styles one at a time, as torch's test_tp_style
    checks them -- column- and row-wise on Linears and Embeddings with each input and output layout,
    frozen weights, sequence parallelism on norms and dropout -- give torch's styles' outputs (shapes,
    DTensor placements, values), input gradients, parameters and parameter gradients."""
    done = pool.run(_style_cases, kind, timeout=120)
    assert done == [done[0]] * 2 and len(done[0]) == 14, done


@pytest.mark.parametrize("kind", _KINDS)
def test_styles_train_torchs_mlp_like_torch(pool, kind):
    """test_tp_examples' MLP with commopt's styles: the unsharded module's outputs, gradients and
    SGD-updated parameters (with and without sequence parallelism), torch's styles' placements;
    inference under ``torch.inference_mode``."""
    done = pool.run(_mlp_cases, kind, timeout=120)
    assert done == [done[0]] * 2 and len(done[0]) == 3, done


@pytest.mark.parametrize("kind", _KINDS)
def test_styles_train_torchs_transformer_like_torch(pool, kind):
    """test_tp_examples' Transformer through torch's own ``Transformer.parallelize`` on commopt's
    styles: Adam steps (10 in fp64, 1 in fp32) with and without sequence parallelism, and with only
    some parameters trainable, give the unsharded model's outputs, gradients and parameters, and
    torch's styles' placements and values."""
    done = pool.run(_transformer_cases, kind, timeout=180)
    assert done == [done[0]] * 2 and len(done[0]) == 5, done
