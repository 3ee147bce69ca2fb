"""Framework adapters (issue 18): commopt's DDP hook from PyTorch Lightning, Hugging Face ``Trainer``
and accelerate, in real 2-rank runs of each framework on gloo/CPU.

Each framework test starts 2 fresh rank processes laid out as torchrun lays them (``RANK``,
``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``, ``GROUP_RANK``, ``TORCHELASTIC_RUN_ID``, a store on 127.0.0.1),
so the framework initialises the process group itself, as it does for a user: the callbacks are
built before that group exists. The oracle is the same training without the hook (DDP's own
reduction); an exact algorithm must reproduce its parameters, a compressor must train, and the
hook's own counters prove that it ran (Lightning's documented ``ddp_comm_hook`` is silently dropped
on CPU). The blocks marked "README" are the README's "With your framework" snippets, verbatim.
"""

from __future__ import annotations

import importlib.util
import io
import multiprocessing as mp
import os
import queue
import socket
import subprocess
import sys
import time
import traceback

import pytest
import torch

_HAVE_LIGHTNING = importlib.util.find_spec("pytorch_lightning") is not None
_HAVE_TRANSFORMERS = (importlib.util.find_spec("transformers") is not None
                      and importlib.util.find_spec("accelerate") is not None)
_WORLD = 2
_STEPS = 12


# ------------------------------------------------------------------------------------ launcher
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_entry(body, rank: int, world: int, port: int, workdir: str, results) -> None:
    os.environ.update({
        "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": str(rank), "LOCAL_RANK": str(rank),
        "WORLD_SIZE": str(world), "LOCAL_WORLD_SIZE": str(world), "GROUP_RANK": "0", "ROLE_RANK": str(rank),
        "TORCHELASTIC_RUN_ID": "commopt-test", "GLOO_SOCKET_IFNAME": "lo", "OMP_NUM_THREADS": "1",
        "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
    })
    os.chdir(workdir)  # the frameworks' default output folders land in the test's tmp_path
    torch.set_num_threads(1)
    try:
        # Bytes, not tensors: a tensor sent through a multiprocessing queue is shared through a socket
        # that dies with this process.
        buf = io.BytesIO()
        torch.save(body(rank, world), buf)
        results.put((rank, "ok", buf.getvalue()))
    except BaseException as exc:  # noqa: BLE001 - reported to pytest with the traceback
        results.put((rank, "err", f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"))


def _launch(body, workdir, timeout: float) -> list:
    """Run ``body(rank, world)`` in ``_WORLD`` fresh spawned processes; per-rank results in rank order.

    A hang fails naming the ranks that did not finish; a rank's exception is re-raised with its
    traceback.
    """
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_rank_entry, args=(body, r, _WORLD, port, str(workdir), results), daemon=True,
                         name=f"rank{r}") for r in range(_WORLD)]
    for p in procs:
        p.start()
    out, errors = {}, {}
    deadline = time.monotonic() + timeout
    try:
        while len(out) + len(errors) < _WORLD:
            try:
                rank, status, value = results.get(timeout=0.5)
            except queue.Empty:
                missing = sorted(set(range(_WORLD)) - set(out) - set(errors))
                dead = [r for r in missing if not procs[r].is_alive()]
                if dead:
                    raise AssertionError(f"{body.__name__}: ranks {dead} died (exit codes "
                                         f"{[procs[r].exitcode for r in dead]})") from None
                if time.monotonic() > deadline:
                    raise AssertionError(f"{body.__name__}: ranks {missing} did not finish within {timeout:.0f} s"
                                         ) from None
                continue
            if status == "ok":
                out[rank] = torch.load(io.BytesIO(value), weights_only=True)
            else:
                errors[rank] = value
        if errors:
            detail = "".join(f"\n--- rank {r} ---\n{e}" for r, e in sorted(errors.items()))
            raise AssertionError(f"{body.__name__} failed on ranks {sorted(errors)}:{detail}")
        for p in procs:
            p.join(30)
        return [out[r] for r in range(_WORLD)]
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join(5)
        results.close()
        results.cancel_join_thread()


def _params(module) -> list[torch.Tensor]:
    return [p.detach().clone() for p in module.parameters()]


def _assert_same_params(got: list[torch.Tensor], want: list[torch.Tensor], what: str) -> None:
    assert len(got) == len(want)
    for i, (g, w) in enumerate(zip(got, want)):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-6, msg=lambda m, i=i: f"{what}: parameter {i}: {m}")


def _max_diff(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    return max(float((x - y).abs().max()) for x, y in zip(a, b))


# ------------------------------------------------------------------------------------ Lightning
def _lightning_data():
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(_WORLD * 8 * _STEPS, 16, generator=gen)
    y = x[:, :4].sum(1, keepdim=True) - 0.5 * x[:, 4:5]
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=8)


def _full_loss(net, loader) -> float:
    """The loss over the whole data set (both ranks' shards): a steadier measure of training than batches."""
    with torch.no_grad():
        x, y = loader.dataset.tensors
        return float(torch.nn.functional.mse_loss(net(x), y))


def _lightning_model(pl):
    class Regression(pl.LightningModule):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.net = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 32),
                                           torch.nn.Tanh(), torch.nn.Linear(32, 1))

        def training_step(self, batch, batch_idx):
            x, y = batch
            return torch.nn.functional.mse_loss(self.net(x), y)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    return Regression()


def _lightning_body(rank: int, world: int) -> dict:
    import pickle

    import pytorch_lightning as pl
    import torch.distributed as dist

    out = {}
    assert not dist.is_initialized()  # the callbacks below are built before the process group exists
    model, loader = _lightning_model(pl), _lightning_data()
    init, init_loss = _params(model), _full_loss(model.net, loader)

    # README: Lightning, exact
    from commopt.comm.hooks import AllReduceState
    from commopt.comm.integrations.lightning import CommHookCallback

    state = AllReduceState(algorithm="hierarchical")
    trainer = pl.Trainer(accelerator="cpu", devices=2, strategy="ddp", max_steps=12,
                         callbacks=[CommHookCallback(state)])
    trainer.fit(model, loader)
    # end README
    out["exact"] = {"params": _params(model), "step": state.step, "buckets": state.buckets_reduced,
                    "nodes": state.topology.num_nodes, "init_moved": _max_diff(_params(model), init),
                    "init_loss": init_loss}

    # Oracle: the same fit, DDP's own reduction.
    model, loader = _lightning_model(pl), _lightning_data()
    pl.Trainer(accelerator="cpu", devices=2, strategy="ddp", max_steps=12).fit(model, loader)
    out["plain"] = {"params": _params(model), "loss": _full_loss(model.net, loader)}

    model, loader = _lightning_model(pl), _lightning_data()
    # README: Lightning, compressed
    from commopt.comm.compression import PowerSGDCompressor

    state = AllReduceState(algorithm="hierarchical", compressor=PowerSGDCompressor(rank=4, start_iter=2))
    trainer = pl.Trainer(accelerator="cpu", devices=2, strategy="ddp", max_steps=12,
                         callbacks=[CommHookCallback(state, topology="2x1")])
    trainer.fit(model, loader)
    # end README
    out["compressed"] = {"params": _params(model), "loss": _full_loss(model.net, loader), "step": state.step,
                         "buckets": state.buckets_reduced, "nodes": state.topology.num_nodes,
                         "memory": sorted(state.compressor.q_memory)}

    # ddp_spawn pickles the callback into the ranks it starts.
    copy = pickle.loads(pickle.dumps(CommHookCallback(AllReduceState(algorithm="hierarchical",
                                                                     compressor=PowerSGDCompressor(rank=4)),
                                                      topology="2x1")))
    out["pickled"] = (copy.topology, copy.state.algorithm, copy.state.compressor.rank)

    # A strategy that does not wrap the model in DDP is a clear error at fit start.
    trainer = pl.Trainer(accelerator="cpu", devices=1, strategy=pl.strategies.SingleDeviceStrategy("cpu"),
                         max_steps=1, callbacks=[CommHookCallback(AllReduceState())])
    try:
        trainer.fit(_lightning_model(pl), _lightning_data())
    except TypeError as exc:
        out["not_ddp"] = str(exc)
    return out


@pytest.mark.frameworks
@pytest.mark.skipif(not _HAVE_LIGHTNING, reason="needs pytorch-lightning (pip install commopt[lightning])")
def test_lightning_callback_registers_hook_on_cpu(tmp_path):
    """A real ``Trainer(accelerator="cpu", devices=2, strategy="ddp")``: with the callback, the exact
    algorithm reproduces DDP's own parameters, and hierarchical PowerSGD on a logical 2x1 trains,
    with the hook's counters showing every step went through it."""
    ranks = _launch(_lightning_body, tmp_path, timeout=240)
    r0 = ranks[0]
    for r in ranks[1:]:  # DDP keeps the replicas equal, with or without the hook
        _assert_same_params(r["exact"]["params"], r0["exact"]["params"], "exact run, rank 1 vs rank 0")
        _assert_same_params(r["compressed"]["params"], r0["compressed"]["params"], "compressed run, rank 1 vs 0")

    exact, plain, comp = r0["exact"], r0["plain"], r0["compressed"]
    assert exact["init_moved"] > 1e-3  # it trained
    _assert_same_params(exact["params"], plain["params"], "hierarchical hook vs DDP's own all-reduce")
    for run in (exact, comp):  # one bucket: the hook reduced every step's gradients
        assert run["step"] == _STEPS and run["buckets"] >= _STEPS, run
    assert exact["nodes"] == 1  # torchrun's layout: one node of 2
    assert comp["nodes"] == 2  # topology="2x1", built once the process group existed
    assert comp["memory"], "PowerSGD compressed no matrix"
    assert _max_diff(comp["params"], plain["params"]) > 1e-5  # the compressed reduction was used
    # It trains: the loss over the whole data set falls as far as without compression, give or take.
    assert comp["loss"] < 0.5 * exact["init_loss"], (exact["init_loss"], comp["loss"])
    assert comp["loss"] < 1.25 * plain["loss"], (plain["loss"], comp["loss"])
    assert r0["pickled"] == ("2x1", "hierarchical", 4)
    assert "not DistributedDataParallel" in r0["not_ddp"] and "strategy='ddp'" in r0["not_ddp"]


# ------------------------------------------------------------------------------------ without the frameworks
_IMPORT_CHECK = r"""
import sys
import commopt.comm.integrations
heavy = [m for m in ("pytorch_lightning", "lightning", "transformers", "accelerate") if m in sys.modules]
assert not heavy, f"importing commopt.comm.integrations imported {heavy}"
for blocked in ("pytorch_lightning", "lightning", "lightning.pytorch", "transformers"):
    sys.modules[blocked] = None  # as if not installed: importing it raises ImportError
for name, extra in (("lightning", "lightning"), ("transformers", "transformers")):
    try:
        __import__(f"commopt.comm.integrations.{name}")
    except ImportError as exc:
        assert f"pip install commopt[{extra}]" in str(exc), str(exc)
        assert exc.__cause__ is None and exc.__suppress_context__, "the message should stand alone"
    else:
        raise AssertionError(f"commopt.comm.integrations.{name} imported without its framework")
print("ok")
"""


def test_integrations_import_lazily_and_say_which_extra_is_missing():
    """``commopt.comm.integrations`` imports no framework; each adapter without its framework is an
    ImportError naming the extra to install (checked in a fresh interpreter)."""
    proc = subprocess.run([sys.executable, "-c", _IMPORT_CHECK], capture_output=True, text=True, timeout=120,
                          cwd=os.path.dirname(os.path.abspath(__file__)))
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stdout + proc.stderr


def test_callback_arguments_are_checked_when_built():
    """Bad arguments fail at construction, in the launching process, not at fit start in every rank."""
    from commopt.comm import Topology
    from commopt.comm.hooks import AllReduceState
    from commopt.comm.integrations._common import check_arguments

    check_arguments("CommHookCallback", AllReduceState(), "2x4")  # a spec is resolved later
    check_arguments("CommHookCallback", AllReduceState(), [[0, 2], [1, 3]])
    with pytest.raises(TypeError, match="AllReduceState"):
        check_arguments("CommHookCallback", "flat", None)
    with pytest.raises(TypeError, match="topology must be a spec"):
        check_arguments("CommHookCallback", AllReduceState(), 4)
    one = Topology.from_spec("1x1")  # a world of one needs no process group
    with pytest.raises(ValueError, match="pass one of them"):
        check_arguments("CommHookCallback", AllReduceState(topology=one), "1x1")
