"""torchtitan (issue 27, item 2): commopt's FSDP2 comms registered by a wrapped ``parallelize_fn``, in
real 2-rank runs of torchtitan's own ``Trainer`` on gloo/CPU.

Two fresh rank processes, laid out as torchrun lays them, each build and train torchtitan's
``Trainer`` three times (what ``torchtitan.train`` does, without its command line): native FSDP2
(``llama3_debugmodel()`` as it is), the README's config module parsed by torchtitan's
``ConfigManager`` (``--module my_configs --config llama3_debugmodel_commopt``), and the ZeRO++
comms; each with a 2-layer Llama 3 and 4 steps on the same documents. The oracle is the native run:
the exact comms must give its losses to every digit, the ZeRO++ comms (int4 gradients, int8 weights)
must stay close without being identical, and the comms' byte counters prove that commopt ran.

Tensor parallelism (``parallelize(..., tensor_parallel="ring")``: torchtitan's TP plan on commopt's
styles with the rings forced, since ``True`` lets each Linear keep torch's collective where the ring
cannot win, as at these sizes): two more fresh ranks train with
``tensor_parallel_degree=2`` (``data_parallel_shard_degree=1``: the two ranks are the TP group) and
the ``partial_dtensor`` backend, with and without sequence parallelism, each once with torchtitan's
own TP plan (the oracle) and once with its Linears on commopt's styles; the losses must agree to
1e-4, and the comm engine's byte counters must show commopt's rings (all-gather-matmul and
matmul-reduce-scatter, or matmul-all-reduce) carried exactly the activations the plan implies.

TP 2 x FSDP2 2 (``parallelize(..., comms=None, tensor_parallel="ring")``): four fresh ranks train
torchtitan's TP plan on a 2 x 2 mesh (FSDP2 over the strided complement of each TP group, with its
own collectives), once on torch's styles (the oracle) and once on commopt's, 5 steps; the losses
must agree as above (1e-4 over the steps) and the rings carry what they carry on 2 ranks.

Without torchtitan, ``commopt-bench torchtitan`` says how to install it.

What torchtitan 0.3.0 needs on a CPU-only machine is done in the ranks and nowhere else, by
``commopt.bench.titan`` (its module docstring lists it; ``commopt-bench torchtitan`` uses the same).
"""

from __future__ import annotations

import importlib.util
import io
import os
import re
import sys
import textwrap
import traceback
from pathlib import Path

import pytest
import torch
from _ports import free_ports
from _spawn import run_spawned

from commopt.bench import titan

_HAVE_TORCHTITAN = importlib.util.find_spec("torchtitan") is not None
_NEEDS = "needs torchtitan: pip install -e '.[oracles]' && pip install --no-deps torchtitan==0.3.0 (README, 'Set up')"
_STEPS = 4
_README = Path(__file__).resolve().parents[1] / "docs" / "frameworks.md"  # where the README points
_SECTION = "## With torchtitan"


def _readme_blocks(lang: str) -> list[str]:
    """The ``lang`` code blocks of the README's torchtitan section."""
    text = _README.read_text(encoding="utf-8")
    start = text.find("\n" + _SECTION + "\n")
    assert start >= 0, f"docs/frameworks.md has no {_SECTION!r} section"
    end = text.find("\n## ", start + 1)
    section = text[start:end if end >= 0 else len(text)]
    return [textwrap.dedent(b) for b in re.findall(rf"```{lang}\n(.*?)```", section, re.S)]


# ------------------------------------------------------------------------------------ launcher
def _free_ports(n: int) -> list[int]:
    return free_ports(n)  # below the ephemeral range: see tests/_ports.py


def _rank_entry(body, rank: int, world: int, nodes: str | None, ports: list[int], workdir: str, results) -> None:
    os.environ.update({
        "MASTER_ADDR": "127.0.0.1", "COMMOPT_TEST_PORTS": ",".join(map(str, ports)),
        "RANK": str(rank), "LOCAL_RANK": str(rank),
        "WORLD_SIZE": str(world), "LOCAL_WORLD_SIZE": str(world), "GROUP_RANK": "0",
        "TORCHELASTIC_RUN_ID": "commopt-test", "GLOO_SOCKET_IFNAME": "lo", "OMP_NUM_THREADS": "1",
        "HF_HUB_OFFLINE": "1", "WANDB_MODE": "disabled",
    })
    if nodes is not None:
        os.environ["COMMOPT_NODES"] = nodes
    os.chdir(workdir)
    sys.path.insert(0, workdir)  # the README's config module, as torchtitan's --module finds it
    torch.set_num_threads(1)
    try:
        buf = io.BytesIO()  # bytes, not tensors: a queued tensor's shared memory dies with this process
        torch.save(body(rank), buf)
        results.put((rank, "ok", buf.getvalue()))
    except BaseException as exc:  # noqa: BLE001 - reported to pytest with the traceback
        results.put((rank, "err", f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"))


def _launch(body, workdir, timeout: float, runs: int = 3, world: int = 2, nodes: str | None = "0;1") -> list:
    """``body(rank)`` in ``world`` fresh spawned processes (``_spawn.run_spawned``: a hang fails naming
    the ranks that did not finish, a rank's exception is re-raised with its traceback). ``nodes``:
    ``COMMOPT_NODES``; by default two logical nodes of one rank, so that the hierarchical comms cross
    a node link, whose bytes they count (on one node there is no such link and the counter stays 0);
    None: torchrun's layout (one node)."""
    ports = _free_ports(runs)  # one rendezvous per run
    return run_spawned(_rank_entry, lambda r: (body, r, world, nodes, ports, str(workdir)), world, timeout,
                       body.__name__)


# ------------------------------------------------------------------------------------ in the ranks
def _on_cpu(config, steps: int = _STEPS):
    """``titan.on_cpu`` in the rank's working directory (where ``titan.write_assets`` wrote the
    tokenizer and documents): the tiny Llama, ``steps`` steps of 2 x 32 tokens per data-parallel rank."""
    return titan.on_cpu(config, os.getcwd(), steps=steps)


def _train(config, fsdp2_comms: bool, sent: dict | None = None) -> list[float]:
    """torchtitan's own run (``train.py`` without its CLI): build the Trainer, train, close; the
    losses it logs (averaged over the ranks). ``fsdp2_comms``: FSDP2 runs its own collectives
    (gloo has no ``PREMUL_SUM``: they sum; commopt's comms take it). ``sent`` receives the bytes this
    rank's comm engine counted per operation (before ``commopt.comm.destroy`` drops the engine)."""
    import torch.distributed as dist

    import commopt.comm

    trainer = config.build()  # initialises the process group, then model, parallelize_fn, optimizer
    if fsdp2_comms:
        titan.force_sum_reduction(trainer)
    losses = titan.captured_losses(trainer)
    try:
        trainer.train()
    finally:
        trainer.close()
        if sent is not None:
            sent.update(commopt.comm.context().engine().bytes_sent())
        commopt.comm.destroy()  # its groups belong to this process group
        dist.destroy_process_group()
    return losses


def _torchtitan_body(rank: int) -> dict:
    titan.cpu_shims()
    from torchtitan.config import ConfigManager
    from torchtitan.models.llama3 import parallelize_llama
    from torchtitan.models.llama3.config_registry import llama3_debugmodel

    from commopt.comm.integrations.torchtitan import Parallelize, parallelize

    ports = os.environ["COMMOPT_TEST_PORTS"].split(",")
    os.environ["MASTER_PORT"] = ports[0]
    native = _train(_on_cpu(llama3_debugmodel()), fsdp2_comms=True)
    # The README's lines, through torchtitan's own command-line parsing.
    config = ConfigManager().parse_args(["--module", "my_configs", "--config", "llama3_debugmodel_commopt"])
    readme_fn = config.model_spec.parallelize_fn
    assert isinstance(readme_fn, Parallelize) and readme_fn.parallelize_fn is parallelize_llama, readme_fn
    os.environ["MASTER_PORT"] = ports[1]
    exact = _train(_on_cpu(config), fsdp2_comms=False)
    config = llama3_debugmodel()
    zero = config.model_spec.parallelize_fn = parallelize(config.model_spec.parallelize_fn, comms="zero++")
    os.environ["MASTER_PORT"] = ports[2]
    quantized = _train(_on_cpu(config), fsdp2_comms=False)
    topo = readme_fn.comms[0].reduce_scatter.topology
    return {"native": native, "exact": exact, "zero++": quantized, "registered": len(readme_fn.comms),
            "exact_bytes": readme_fn.link_bytes(), "zero_bytes": zero.link_bytes(),
            "nodes": [list(n) for n in topo.nodes], "algorithm": readme_fn.algorithm}


_TP_SEQ, _TP_BATCH, _TP_DIM, _TP_LAYERS = 32, 2, 64, 2  # titan.on_cpu's and titan.tiny_llama's sizes


def _tp_body(rank: int) -> dict:
    """torchtitan's TP plan (the oracle) and the same plan on commopt's styles, with and without
    sequence parallelism: four runs, TP degree 2 over both ranks."""
    titan.cpu_shims()
    from torchtitan.models.llama3.config_registry import llama3_debugmodel

    from commopt.comm.integrations.torchtitan import parallelize

    ports = os.environ["COMMOPT_TEST_PORTS"].split(",")
    out: dict = {}
    for i, (sp, commopt) in enumerate([(True, False), (True, True), (False, False), (False, True)]):
        config = _on_cpu(llama3_debugmodel())
        parallelism = config.parallelism
        parallelism.tensor_parallel_degree, parallelism.data_parallel_shard_degree = 2, 1
        parallelism.enable_sequence_parallel = sp
        assert (config.training.seq_len, config.training.local_batch_size) == (_TP_SEQ, _TP_BATCH)
        if commopt:  # the rings forced ("auto" may keep torch's collectives at these sizes): their bytes are checked
            fn = config.model_spec.parallelize_fn = parallelize(config.model_spec.parallelize_fn,
                                                                tensor_parallel="ring")
        os.environ["MASTER_PORT"] = ports[i]
        sent: dict = {}
        key = f"{'sp' if sp else 'nosp'}/{'commopt' if commopt else 'native'}"
        out[key] = _train(config, fsdp2_comms=not commopt, sent=sent)
        out[key + "/sent"] = {k: v for k, v in sent.items() if not k.endswith("/agree")}
        if commopt:
            out[key + "/plan"] = fn.tp_plans
            out[key + "/fsdp_bytes"] = fn.link_bytes()
    return out


# ------------------------------------------------------------------------------------ the test
@pytest.mark.frameworks
@pytest.mark.skipif(not _HAVE_TORCHTITAN, reason=_NEEDS)
def test_torchtitan_parallelize_fn_registers_commopt_comms(tmp_path):
    """The README's config function gives torchtitan's Trainer a parallelize_fn whose FSDP2 modules
    run commopt's comms: exact ones reproduce native FSDP2's losses, ZeRO++'s stay within 0.1 of them."""
    (module,) = _readme_blocks("python")
    (tmp_path / "my_configs.py").write_text(module, encoding="utf-8")
    titan.write_assets(tmp_path)
    ranks = _launch(_torchtitan_body, tmp_path, timeout=300)
    r0 = ranks[0]
    for r in ranks[1:]:
        assert r["native"] == r0["native"] and r["exact"] == r0["exact"], ranks
    assert r0["registered"] == 1 and r0["algorithm"] == "hierarchical" and r0["nodes"] == [[0], [1]], r0
    assert r0["exact"] == r0["native"], (r0["exact"], r0["native"])  # two-rank fp32 sums: the same bits
    diffs = [abs(a - b) for a, b in zip(r0["zero++"], r0["native"])]
    assert 0 < max(diffs) < 0.1, diffs  # quantized (so not identical), and close (0.03 measured)
    assert r0["native"][-1] < r0["native"][0] - 0.05, r0["native"]  # it trained
    # Every step all-gathers and reduce-scatters every parameter over the node link; ZeRO++ sends
    # int8/int4 codes (and scales) instead of fp32.
    assert r0["exact_bytes"] > 0 and 0 < r0["zero_bytes"] < r0["exact_bytes"] / 2, r0


@pytest.mark.frameworks
@pytest.mark.skipif(not _HAVE_TORCHTITAN, reason=_NEEDS)
def test_torchtitan_tensor_parallel_runs_on_commopt_styles(tmp_path):
    """``tensor_parallel`` puts torchtitan's column- and row-parallel Linears on commopt's styles
    (``"ring"``: the rings forced): the losses of torchtitan's own TP plan, through commopt's rings."""
    titan.write_assets(tmp_path)
    ranks = _launch(_tp_body, tmp_path, timeout=300, runs=4)
    r0 = ranks[0]
    for r in ranks[1:]:
        assert all(r[k] == r0[k] for k in ("sp/native", "sp/commopt", "nosp/native", "nosp/commopt")), ranks
    for sp in ("sp", "nosp"):
        native, ours = r0[f"{sp}/native"], r0[f"{sp}/commopt"]
        assert len(native) == _STEPS and len(set(native)) == _STEPS, native  # every step updated the weights
        # The same math, its fp32 sums in another order (the rings multiply per block; with two ranks
        # each reduction is one commutative addition): equal to 1e-4 absolute over four Adam steps,
        # room for another BLAS's blocking (measured: identical with sequence parallelism, 5e-7
        # without). Scaling the row-parallel outputs by 1 + 1e-3 moved the losses by 1.4e-3; a lost
        # reduction or a block in the wrong place moves them by far more.
        diffs = [abs(a - b) for a, b in zip(ours, native)]
        assert len(ours) == _STEPS and max(diffs) <= 1e-4, (sp, ours, native, diffs)
        assert r0[f"{sp}/native/sent"] == {}, r0  # the oracle ran torch's collectives only
        (plan,) = r0[f"{sp}/commopt/plan"]  # one call: no pipeline parallelism
        for layer in range(_TP_LAYERS):
            p = f"layers.{layer}."
            assert {k: v for k, v in plan.items() if k.startswith(p)} == {
                p + "attention.qkv_linear.wqkv": "colwise", p + "feed_forward.w1": "colwise",
                p + "feed_forward.w3": "colwise", p + "attention.wo": "rowwise", p + "feed_forward.w2": "rowwise",
                **({p + "attention": "sequence-sharded input", p + "feed_forward": "sequence-sharded input"}
                   if sp == "sp" else {})}, plan
        assert r0[f"{sp}/commopt/fsdp_bytes"] == 0  # FSDP over one rank: nothing crosses a link
    # What the rings sent, per rank: half of a [batch, seq, dim] fp32 activation per ring step,
    # one ring step (two ranks). With sequence parallelism each block all-gathers its input once for
    # the attention (wqkv) and once for the feed-forward (w1 and w3 share the ring), and reduce-
    # scatters after wo and w2; the backward runs the opposite rings. Without it, wo and w2 all-reduce
    # (a reduce-scatter ring, then an all-gather ring) and the backward is local.
    half = _TP_BATCH * _TP_SEQ * _TP_DIM * 4 // 2
    per_run = _STEPS * _TP_LAYERS * 2 * half
    assert r0["sp/commopt/sent"] == {"all_gather_matmul": per_run, "all_gather_matmul/backward": per_run,
                                     "matmul_reduce_scatter": per_run,
                                     "matmul_reduce_scatter/backward": per_run}, r0["sp/commopt/sent"]
    assert r0["nosp/commopt/sent"] == {"matmul_all_reduce": 2 * per_run}, r0["nosp/commopt/sent"]


_TP_FSDP_STEPS = 5


def _tp_fsdp_body(rank: int) -> dict:
    """TP 2 x FSDP2 2 on four ranks: torchtitan's TP plan on torch's styles (the oracle), then on
    commopt's (``comms=None``: FSDP2 keeps its own collectives on the strided sub-mesh)."""
    titan.cpu_shims()
    from torchtitan.models.llama3.config_registry import llama3_debugmodel

    from commopt.comm.integrations.torchtitan import parallelize

    ports = os.environ["COMMOPT_TEST_PORTS"].split(",")
    out: dict = {}
    for i, commopt in enumerate((False, True)):
        config = _on_cpu(llama3_debugmodel(), steps=_TP_FSDP_STEPS)
        parallelism = config.parallelism
        parallelism.tensor_parallel_degree, parallelism.data_parallel_shard_degree = 2, 2
        assert parallelism.enable_sequence_parallel  # torchtitan's default
        if commopt:  # the rings forced, as in _tp_body
            fn = config.model_spec.parallelize_fn = parallelize(config.model_spec.parallelize_fn, comms=None,
                                                                tensor_parallel="ring")
        os.environ["MASTER_PORT"] = ports[i]
        sent: dict = {}
        key = "commopt" if commopt else "native"
        out[key] = _train(config, fsdp2_comms=True, sent=sent)
        out[key + "/sent"] = {k: v for k, v in sent.items() if not k.endswith("/agree")}
        if commopt:
            out["plan"], out["registered"] = fn.tp_plans, len(fn.comms)
    return out


@pytest.mark.frameworks
@pytest.mark.skipif(not _HAVE_TORCHTITAN, reason=_NEEDS)
def test_torchtitan_tp_fsdp_2x2_matches_torch_styles(tmp_path):
    """TP 2 x FSDP2 2 (4 ranks): torchtitan's TP plan on commopt's styles, FSDP2 sharding the strided
    complement of each TP group with its own collectives, gives the losses of the same plan on
    torch's styles over 5 steps (1e-4, as the TP-only test)."""
    titan.write_assets(tmp_path)
    ranks = _launch(_tp_fsdp_body, tmp_path, timeout=300, runs=2, world=4, nodes=None)
    r0 = ranks[0]
    for r in ranks[1:]:  # torchtitan logs the loss averaged over the data-parallel ranks
        assert r["native"] == r0["native"] and r["commopt"] == r0["commopt"], ranks
    native, ours = r0["native"], r0["commopt"]
    assert len(native) == _TP_FSDP_STEPS and len(set(native)) == _TP_FSDP_STEPS, native  # every step updated
    diffs = [abs(a - b) for a, b in zip(ours, native)]
    assert len(ours) == _TP_FSDP_STEPS and max(diffs) <= 1e-4, (ours, native, diffs)
    assert r0["registered"] == 0  # comms=None: FSDP2's own collectives on both sides
    assert r0["native/sent"] == {}, r0  # the oracle ran torch's collectives only
    # The rings inside each TP group of 2, as in the TP-only test: per rank, half of a [batch, seq,
    # dim] fp32 activation per ring step; each block gathers twice and reduce-scatters twice per step.
    per_run = _TP_FSDP_STEPS * _TP_LAYERS * 2 * (_TP_BATCH * _TP_SEQ * _TP_DIM * 4 // 2)
    assert all(r["commopt/sent"] == {"all_gather_matmul": per_run, "all_gather_matmul/backward": per_run,
                                     "matmul_reduce_scatter": per_run, "matmul_reduce_scatter/backward": per_run}
               for r in ranks), [r["commopt/sent"] for r in ranks]
    (plan,) = r0["plan"]  # the TP plan's Linears on commopt's styles, on every rank
    for layer in range(_TP_LAYERS):
        p = f"layers.{layer}."
        assert {k: v for k, v in plan.items() if k.startswith(p)} == {
            p + "attention.qkv_linear.wqkv": "colwise", p + "feed_forward.w1": "colwise",
            p + "feed_forward.w3": "colwise", p + "attention.wo": "rowwise", p + "feed_forward.w2": "rowwise",
            p + "attention": "sequence-sharded input", p + "feed_forward": "sequence-sharded input"}, plan
    assert all(r["plan"] == r0["plan"] for r in ranks), ranks


@pytest.mark.skipif(not _HAVE_TORCHTITAN, reason=_NEEDS)
def test_tensor_parallel_option_checks_what_it_cannot_serve():
    """``tensor_parallel=True``: nothing at TP degree 1; at TP degree > 1 a clear error, on every
    rank before torchtitan's function runs, for a backend without DTensor activations on the TP mesh
    or async TP; ``comms=None`` only with it."""
    import types

    from commopt.comm.integrations.torchtitan import parallelize

    calls = []

    def parallelize_llama(model, **kwargs):
        calls.append(kwargs)
        return model

    def dims(tp, backend="partial_dtensor", async_tp=False):
        return {"parallel_dims": types.SimpleNamespace(tp=tp),
                "parallelism": types.SimpleNamespace(spmd_backend=backend),
                "compile_config": types.SimpleNamespace(enable_async_tensor_parallel=async_tp)}

    fn = parallelize(parallelize_llama, comms=None, tensor_parallel=True)
    model = torch.nn.Linear(4, 4)
    assert fn(model, **dims(1, backend="spmd_types")) is model and fn.tp_plans == [{}] and fn.comms == []
    assert len(calls) == 1 and "tensor_parallel=True" in repr(fn)
    with pytest.raises(ValueError, match="spmd_backend partial_dtensor"):
        fn(model, **dims(2, backend="spmd_types"))
    with pytest.raises(ValueError, match="enable_async_tensor_parallel"):
        fn(model, **dims(2, async_tp=True))
    with pytest.raises(TypeError, match="parallel_dims"):
        fn(model)
    assert len(calls) == 1  # refused before torchtitan's function ran
    assert parallelize(parallelize_llama).tensor_parallel is False  # off unless asked for
    with pytest.raises(ValueError, match="leaves nothing for commopt to do"):
        parallelize(parallelize_llama, comms=None)
    with pytest.raises(TypeError, match="tensor_parallel must be True, False, 'auto' or 'ring'"):
        parallelize(parallelize_llama, tensor_parallel="yes")


@pytest.mark.skipif(not _HAVE_TORCHTITAN, reason=_NEEDS)
def test_parallelize_arguments_are_checked_when_built():
    """Bad arguments fail in the config function (the launching process), not inside every rank."""
    from commopt.comm import Topology
    from commopt.comm.integrations.torchtitan import parallelize

    def parallelize_llama(model, **kwargs):  # torchtitan's, without importing its models (triton)
        return model

    fn = parallelize(parallelize_llama)
    assert fn.__name__ == "parallelize_llama" and fn.__wrapped__ is parallelize_llama
    assert fn.algorithm == "hierarchical" and fn.comms == []
    assert parallelize(parallelize_llama, comms="zero++").algorithm == "auto"
    parallelize(parallelize_llama, topology=Topology.from_spec("1x1"))  # a built topology is kept as given
    with pytest.raises(ValueError, match="comms must be one of"):
        parallelize(parallelize_llama, comms="zero3")
    with pytest.raises(TypeError, match="parallelize_fn must be"):
        parallelize("parallelize_llama")
    with pytest.raises(TypeError, match="topology must be a spec"):
        parallelize(parallelize_llama, topology=[[0], [1]])


_IMPORT_CHECK = r"""
import sys
sys.modules["torchtitan"] = None  # as if not installed
try:
    import commopt.comm.integrations.torchtitan
except ImportError as exc:
    assert "pip install torchtitan" in str(exc), str(exc)
    assert exc.__cause__ is None and exc.__suppress_context__, "the message should stand alone"
else:
    raise AssertionError("commopt.comm.integrations.torchtitan imported without torchtitan")
import commopt.comm.integrations
assert "torchtitan" not in getattr(commopt.comm.integrations, "__dict__", {})
print("ok")
"""


def test_without_torchtitan_the_import_says_how_to_install_it():
    """Checked in a fresh interpreter, with torchtitan hidden: an ImportError naming the install line."""
    import subprocess

    proc = subprocess.run([sys.executable, "-c", _IMPORT_CHECK], capture_output=True, text=True, timeout=120,
                          cwd=os.path.dirname(os.path.abspath(__file__)))
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stdout + proc.stderr


def test_bench_without_torchtitan_says_how_to_install_it(monkeypatch, capsys):
    """``commopt-bench torchtitan`` where torchtitan is missing: exit code 2 and the install line,
    before any rank starts."""
    monkeypatch.setitem(sys.modules, "torchtitan", None)  # as if not installed
    assert titan.main(["--quick"]) == 2
    err = capsys.readouterr().err
    assert "needs torchtitan 0.3.0" in err and "pip install --no-deps torchtitan==0.3.0" in err, err


def test_readme_torchtitan_command_names_the_tested_module():
    """The README's launch line names the config module and function its Python block defines."""
    if "\n" + _SECTION + "\n" not in _README.read_text(encoding="utf-8"):
        pytest.skip(f"docs/frameworks.md has no {_SECTION!r} section")
    (module,) = _readme_blocks("python")
    commands = "\n".join(_readme_blocks("bash"))
    assert "def llama3_debugmodel_commopt():" in module
    assert "--module my_configs --config llama3_debugmodel_commopt" in commands, commands
