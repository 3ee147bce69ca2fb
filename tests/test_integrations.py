"""Framework adapters (issue 18): commopt's DDP hook from PyTorch Lightning, Hugging Face ``Trainer``
and accelerate, in real 2-rank runs of each framework on gloo/CPU.

Each framework test starts 2 fresh rank processes laid out as torchrun lays them (``RANK``,
``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``, ``GROUP_RANK``, ``TORCHELASTIC_RUN_ID``, a store on 127.0.0.1),
so the framework initialises the process group itself, as it does for a user: the callbacks are
built before that group exists. The oracle is the same training without the hook (DDP's own
reduction); an exact algorithm must reproduce its parameters, a compressor must train, and the
hook's own counters prove that it ran (Lightning's documented ``ddp_comm_hook`` is silently dropped
on CPU). Inside the same rank processes each framework also checkpoints a compressed run with error
feedback after 3 steps and resumes it for 3 more with a new model, state and callback; the oracle is
the 6-step run never interrupted, and the parameters must match bit for bit (docs/faults.md row 18).
Sharded training (issue 27, item 4) runs in the same processes: Lightning's ``ModelParallelStrategy``
and accelerate with FSDP2, commopt's exact FSDP2 comms against the same run without them (bit for
bit), and the DDP-hook callbacks refusing a sharded setup with a ``TypeError`` naming that route.
The blocks marked "README" are the "With your framework" snippets of docs/frameworks.md (where the
README sends its readers), verbatim.
"""

from __future__ import annotations

import importlib.util
import io
import os
import re
import subprocess
import sys
import textwrap
import traceback
from pathlib import Path

import pytest
import torch
from _ports import free_ports
from _spawn import run_spawned

_HAVE_LIGHTNING = importlib.util.find_spec("pytorch_lightning") is not None
_HAVE_TRANSFORMERS = (importlib.util.find_spec("transformers") is not None
                      and importlib.util.find_spec("accelerate") is not None)
_WORLD = 2
_STEPS = 12


# ------------------------------------------------------------------------------------ launcher
def _free_port() -> int:
    return free_ports(1)[0]  # below the ephemeral range: see tests/_ports.py


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
    """Run ``body(rank, world)`` in ``_WORLD`` fresh spawned processes; per-rank results in rank order
    (``_spawn.run_spawned``: a hang or a rank's exception fails the test, naming the ranks)."""
    port = _free_port()
    return run_spawned(_rank_entry, lambda r: (body, r, _WORLD, port, str(workdir)), _WORLD, timeout, body.__name__)


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

    import pytorch_lightning
    import torch.distributed as dist

    out = {}
    assert not dist.is_initialized()  # the callbacks below are built before the process group exists
    model, loader = _lightning_model(pytorch_lightning), _lightning_data()
    init, init_loss = _params(model), _full_loss(model.net, loader)

    # README: Lightning, exact
    import pytorch_lightning as pl

    from commopt.comm.hooks import AllReduceState
    from commopt.comm.integrations.lightning import CommHookCallback

    state = AllReduceState(algorithm="hierarchical")
    trainer = pl.Trainer(accelerator="cpu", devices=2, strategy="ddp", max_epochs=1,
                         callbacks=[CommHookCallback(state)])
    trainer.fit(model, loader)
    # end README
    out["exact"] = {"params": _params(model), "step": state.step, "buckets": state.buckets_reduced,
                    "nodes": state.topology.num_nodes, "init_moved": _max_diff(_params(model), init),
                    "init_loss": init_loss}

    # Oracle: the same fit, DDP's own reduction.
    model, loader = _lightning_model(pl), _lightning_data()
    pl.Trainer(accelerator="cpu", devices=2, strategy="ddp", max_epochs=1).fit(model, loader)
    out["plain"] = {"params": _params(model), "loss": _full_loss(model.net, loader)}

    model, loader = _lightning_model(pl), _lightning_data()
    # README: Lightning, compressed
    from commopt.comm.compression import PowerSGDCompressor

    state = AllReduceState(algorithm="hierarchical", compressor=PowerSGDCompressor(rank=4, start_iter=2))
    trainer = pl.Trainer(accelerator="cpu", devices=2, strategy="ddp", max_epochs=1,
                         callbacks=[CommHookCallback(state, topology="2x1")])
    trainer.fit(model, loader)
    # end README
    out["compressed"] = {"params": _params(model), "loss": _full_loss(model.net, loader), "step": state.step,
                         "buckets": state.buckets_reduced, "nodes": state.topology.num_nodes,
                         "memory": sorted(state.compressor_state.q_memory)}

    # ddp_spawn pickles the callback into the ranks it starts.
    copy = pickle.loads(pickle.dumps(CommHookCallback(AllReduceState(algorithm="hierarchical",
                                                                     compressor=PowerSGDCompressor(rank=4)),
                                                      topology="2x1")))
    out["pickled"] = (copy.topology, copy.state.algorithm, copy.state.compressor.rank)

    out["checkpoint"] = _lightning_checkpoint(pl, rank)
    out["sharded"] = _lightning_sharded(pl)

    # A strategy that does not wrap the model in DDP is a clear error at fit start.
    trainer = pl.Trainer(accelerator="cpu", devices=1, strategy=pl.strategies.SingleDeviceStrategy("cpu"),
                         max_steps=1, callbacks=[CommHookCallback(AllReduceState())])
    out["not_ddp"] = "fit raised no TypeError"
    try:
        trainer.fit(_lightning_model(pl), _lightning_data())
    except TypeError as exc:
        out["not_ddp"] = str(exc)
    # A sharded strategy: the callback refuses it in its setup hook (before configure_model and the
    # strategy's own setup), naming the FSDP2 route; the same on every rank, so nothing hangs.
    trainer = pl.Trainer(accelerator="cpu", devices=2, max_steps=1, logger=False, enable_checkpointing=False,
                         strategy=pl.strategies.ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1),
                         callbacks=[CommHookCallback(AllReduceState())])
    out["sharded_hook"] = "fit raised no TypeError"
    try:
        trainer.fit(_lightning_model(pl), _lightning_data())
    except TypeError as exc:
        out["sharded_hook"] = str(exc)
    return out


def _full_params(module) -> list[torch.Tensor]:
    """Every parameter whole (FSDP2's are DTensor shards: gathered, collective over the mesh)."""
    return [(p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone() for p in module.parameters()]


def _lightning_sharded(pl) -> dict:
    """The FSDP2 route: ``ModelParallelStrategy`` on CPU/gloo, ``fully_shard`` in ``configure_model``
    with and without ``fsdp.register`` (exact hierarchical comms on a logical 2x1: the oracle is
    Lightning's native sharded run, bit for bit), and ``fsdp.shard`` (the ZeRO++ recipe: int8
    weights, int4 gradients) against that run's loss."""
    Regression = type(_lightning_model(pl))
    out = {}

    loader = _lightning_data()
    # README: Lightning, sharded
    from pytorch_lightning.strategies import ModelParallelStrategy
    from torch.distributed.fsdp import FSDPModule, fully_shard

    from commopt.comm import Topology, fsdp

    class Sharded(Regression):
        def configure_model(self):  # Lightning calls it on every rank, with the process group up
            if isinstance(self.net, FSDPModule):
                return  # already sharded (an earlier fit)
            mesh = self.device_mesh["data_parallel"]
            for layer in self.net:
                if isinstance(layer, torch.nn.Linear):
                    fully_shard(layer, mesh=mesh)
            fully_shard(self.net, mesh=mesh)
            topology = Topology.from_spec("2x1")  # or None: detected
            self.comms = fsdp.Comms(reduce_scatter=fsdp.ReduceScatterComm(topology, "hierarchical"),
                                    all_gather=fsdp.AllGatherComm(topology, "hierarchical"))
            fsdp.register(self.net, reduce_scatter=self.comms.reduce_scatter, all_gather=self.comms.all_gather)

    strategy = ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1)
    trainer = pl.Trainer(accelerator="cpu", devices=2, strategy=strategy, max_epochs=1)
    trainer.fit(Sharded(), loader)
    # end README
    model = trainer.lightning_module
    out["exact"] = {"params": _full_params(model), "link_bytes": model.comms.link_bytes(),
                    "init_moved": _max_diff(_full_params(model), _params(_lightning_model(pl)))}

    class Native(Regression):
        def configure_model(self):
            if isinstance(self.net, FSDPModule):
                return
            mesh = self.device_mesh["data_parallel"]
            for layer in self.net:
                if isinstance(layer, torch.nn.Linear):
                    fully_shard(layer, mesh=mesh)
            fully_shard(self.net, mesh=mesh)

    def fit(model):
        trainer = pl.Trainer(accelerator="cpu", devices=2, max_epochs=1, logger=False, enable_checkpointing=False,
                             enable_progress_bar=False, enable_model_summary=False,
                             strategy=ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1))
        trainer.fit(model, _lightning_data())
        return model

    model = fit(Native())
    out["native"] = {"params": _full_params(model), "loss": _full_loss(model.net, _lightning_data()),
                     "sharded": all(isinstance(p, torch.distributed.tensor.DTensor) for p in model.parameters())}

    from commopt.comm.compression import QuantizeCompressor

    class ZeroPP(Regression):  # the whole recipe, forced (shard's "auto" decides per model and cluster)
        def configure_model(self):
            if not isinstance(self.net, FSDPModule):
                self.comms = fsdp.shard(self.net, topology=Topology.from_spec("2x1"),
                                        blocks=[m for m in self.net if isinstance(m, torch.nn.Linear)],
                                        weights=QuantizeCompressor(8), gradients=QuantizeCompressor(4))

    model = fit(ZeroPP())
    out["zero"] = {"params": _full_params(model), "loss": _full_loss(model.net, _lightning_data()),
                   "link_bytes": model.comms.link_bytes(),
                   "residuals": sorted(model.comms.state_dict()["reduce_scatter"]["residuals"])}
    return out


_CKPT_STEPS = 3  # optimizer steps before the checkpoint, and after the resume


def _lightning_checkpoint(pl, rank: int) -> dict:
    """docs/faults.md row 18 through Lightning: hierarchical PowerSGD with error feedback for
    2 x ``_CKPT_STEPS`` steps (two epochs of 3 batches) uninterrupted, against one epoch, a checkpoint,
    and a resume from it (``ckpt_path``, ``weights_only=True``) with a new model, state and callback."""
    import warnings

    import torch.distributed as dist

    from commopt.comm.compression import PowerSGDCompressor
    from commopt.comm.hooks import AllReduceState
    from commopt.comm.integrations.lightning import CommHookCallback

    def fit(epochs: int, ckpt_path=None, trainer_out: list | None = None):
        model, loader = _lightning_model(pl), _lightning_data()
        # start_iter=2: the checkpoint falls after the warm-up, with residuals and a warm start
        state = AllReduceState(algorithm="hierarchical", compressor=PowerSGDCompressor(rank=2, start_iter=2))
        trainer = pl.Trainer(accelerator="cpu", devices=2, strategy="ddp", max_epochs=epochs,
                             limit_train_batches=_CKPT_STEPS, logger=False, enable_checkpointing=False,
                             enable_progress_bar=False, enable_model_summary=False,
                             callbacks=[CommHookCallback(state, topology="2x1")])
        trainer.fit(model, loader, ckpt_path=ckpt_path, weights_only=True if ckpt_path else None)
        if trainer_out is not None:
            trainer_out.append(trainer)
        return model, state

    out = {}
    model, state = fit(2)
    out["whole"] = {"params": _params(model), "step": state.step}
    trainers: list = []
    model, state = fit(1, trainer_out=trainers)
    first = {"step": state.step, "residuals": sorted(state.state_dict()["error_feedback"]["worker"]),
             "memory": sorted(state.compressor_state.q_memory)}
    trainers[0].save_checkpoint("first.ckpt", weights_only=False)  # every rank calls it; rank 0 writes
    out["first"] = first
    model, state = fit(2, "first.ckpt")
    out["resumed"] = {"params": _params(model), "step": state.step}

    # The saved state, as every rank reads it (weights_only) and each of its ranks' entries.
    ckpt = torch.load("first.ckpt", weights_only=True)
    saved = ckpt["callbacks"]["CommHookCallback"]
    out["saved"] = {"world_size": saved["world_size"], "steps": [r["step"] for r in saved["ranks"]],
                    "residuals_differ": any(not torch.equal(a, b) for a, b in zip(
                        saved["ranks"][0]["error_feedback"]["worker"].values(),
                        saved["ranks"][1]["error_feedback"]["worker"].values()))}
    # A world of another size: a ValueError on every rank, before anything is loaded.
    saved["world_size"] = 4
    fresh = CommHookCallback(AllReduceState(algorithm="hierarchical", compressor=PowerSGDCompressor(rank=2)))
    out["other_world"] = "on_load_checkpoint raised no ValueError"
    try:
        fresh.on_load_checkpoint(None, model, ckpt)
    except ValueError as exc:
        out["other_world"] = str(exc)
    # Without commopt's entry (a checkpoint written without the callback): a reset, with a warning;
    # the continuation then differs from the uninterrupted run, which shows the state mattered.
    del ckpt["callbacks"]["CommHookCallback"]
    if rank == 0:
        torch.save(ckpt, "no-commopt.ckpt")
    dist.barrier()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model, state = fit(2, "no-commopt.ckpt")
    out["reset"] = {"params": _params(model), "warned": [str(w.message) for w in caught
                                                         if "holds no commopt hook state" in str(w.message)]}
    return out


@pytest.mark.frameworks
@pytest.mark.skipif(not _HAVE_LIGHTNING, reason="needs pytorch-lightning (pip install commopt[lightning])")
def test_lightning_callback_registers_hook_on_cpu(tmp_path):
    """A real ``Trainer(accelerator="cpu", devices=2, strategy="ddp")``: with the callback, the exact
    algorithm reproduces DDP's own parameters, and hierarchical PowerSGD on a logical 2x1 trains,
    with the hook's counters showing every step went through it; a checkpoint resumes bit for bit."""
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
    assert "not DistributedDataParallel" in r0["not_ddp"] and "strategy='ddp'" in r0["not_ddp"], r0["not_ddp"]
    _assert_checkpoint_resumes(ranks)
    assert all(r["checkpoint"]["first"]["memory"] for r in ranks), "PowerSGD kept no warm start to save"
    _assert_sharded(ranks)


def _assert_sharded(ranks: list) -> None:
    """ModelParallelStrategy + fully_shard in configure_model: commopt's exact comms registered there
    give Lightning's native sharded parameters bit for bit; the ZeRO++ recipe trains; the DDP-hook
    callback with a sharded strategy is a TypeError naming the FSDP2 route."""
    for rank, r in enumerate(ranks):
        sh = r["sharded"]
        native, exact, zero = sh["native"], sh["exact"], sh["zero"]
        assert native["sharded"], "ModelParallelStrategy + fully_shard left parameters unsharded"
        assert exact["init_moved"] > 1e-3  # it trained
        assert exact["link_bytes"] > 0 and zero["link_bytes"] > 0, "commopt's FSDP comms carried nothing"
        for i, (got, want) in enumerate(zip(exact["params"], native["params"])):
            assert torch.equal(got, want), f"rank {rank}: parameter {i} with commopt's exact FSDP2 comms differs " \
                                           f"by {float((got - want).abs().max())} from Lightning's native run"
        assert zero["residuals"], "the int4 reduce-scatter kept no error-feedback residuals"
        assert _max_diff(zero["params"], native["params"]) > 0  # the quantized comms were used
        assert zero["loss"] < 1.25 * native["loss"], (native["loss"], zero["loss"])
        msg = r["sharded_hook"]
        assert "ModelParallelStrategy" in msg and "fsdp.register" in msg and "configure_model" in msg, msg
    for r in ranks[1:]:
        for key in ("native", "exact", "zero"):
            _assert_same_params(r["sharded"][key]["params"], ranks[0]["sharded"][key]["params"],
                                f"sharded {key}, rank 1 vs 0")


def _assert_checkpoint_resumes(ranks: list) -> None:
    """Both frameworks: 3 steps, checkpoint, resume 3 = 6 uninterrupted steps, bit for bit."""
    for rank, r in enumerate(ranks):
        ck = r["checkpoint"]
        assert ck["first"]["step"] == _CKPT_STEPS and ck["first"]["residuals"], ck["first"]
        assert ck["whole"]["step"] == ck["resumed"]["step"] == 2 * _CKPT_STEPS, (ck["whole"], ck["resumed"])
        for i, (got, want) in enumerate(zip(ck["resumed"]["params"], ck["whole"]["params"])):
            assert torch.equal(got, want), f"rank {rank}: parameter {i} after resuming differs by " \
                                           f"{float((got - want).abs().max())} from the uninterrupted run"
        assert ck["saved"]["world_size"] == _WORLD and ck["saved"]["steps"] == [_CKPT_STEPS] * _WORLD, ck["saved"]
        assert ck["saved"]["residuals_differ"], "the ranks' residuals should differ: each rank's own was saved"
        assert "written by a world of 4 ranks" in ck["other_world"] and "has 2" in ck["other_world"], ck["other_world"]
        assert len(ck["reset"]["warned"]) == 1, ck["reset"]["warned"]
        assert _max_diff(ck["reset"]["params"], ck["whole"]["params"]) > 0, "the restored state made no difference"



# ------------------------------------------------------------------------------------ Hugging Face
_HF_STEPS = 16


class _Sequences(torch.utils.data.Dataset):
    """Token sequences that count up by one from a random start (a bigram a tiny model learns in a few
    steps), labels = inputs."""

    def __init__(self, n: int = _WORLD * 4 * _HF_STEPS, length: int = 16, vocab: int = 64):
        gen = torch.Generator().manual_seed(2)
        start = torch.randint(0, vocab, (n, 1), generator=gen)
        self.ids = (start + torch.arange(length)) % vocab

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def _gpt2(seed: int = 0):
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(seed)
    config = GPT2Config(vocab_size=64, n_positions=16, n_embd=32, n_layer=2, n_head=2, resid_pdrop=0.0,
                        embd_pdrop=0.0, attn_pdrop=0.0)
    return GPT2LMHeadModel(config)


def _hf_args(workdir: str, optim: str = "sgd", steps: int = _HF_STEPS, save_steps: int | None = None,
             folder: str = "hf"):
    """SGD without clipping for the exact runs: the update is proportional to the reduced gradient, so
    a hook that averaged wrongly could not hide behind Adam's or clipping's normalisation. AdamW (the
    Trainer's default) where the point is that training progresses."""
    from transformers import TrainingArguments

    lr = 0.5 if optim == "sgd" else 1e-2
    save = {"save_strategy": "no"} if save_steps is None else {"save_strategy": "steps", "save_steps": save_steps}
    return TrainingArguments(output_dir=os.path.join(workdir, folder), use_cpu=True, max_steps=steps,
                             per_device_train_batch_size=4, optim=optim, learning_rate=lr,
                             lr_scheduler_type="constant", max_grad_norm=0.0, logging_steps=1,
                             report_to="none", disable_tqdm=True, seed=0, dataloader_num_workers=0, **save)


def _lm_loss(model, data) -> float:
    with torch.no_grad():
        ids = data.ids
        return float(model(input_ids=ids, labels=ids).loss)


def _transformers_body(rank: int, world: int) -> dict:
    import torch.distributed as dist

    out = {}
    data = _Sequences()
    init_loss = _lm_loss(_gpt2(), data)

    model, args = _gpt2(), _hf_args(os.getcwd())
    # README: Trainer
    from transformers import Trainer

    from commopt.comm.hooks import AllReduceState
    from commopt.comm.integrations.transformers import CommHookCallback

    state = AllReduceState(algorithm="hierarchical")
    trainer = Trainer(model=model, args=args, train_dataset=data, callbacks=[CommHookCallback(state)])
    trainer.train()
    # end README
    assert dist.is_initialized() and dist.get_world_size() == world
    out["exact"] = {"params": _params(model), "step": state.step, "buckets": state.buckets_reduced,
                    "nodes": state.topology.num_nodes, "tied": model.lm_head.weight is model.transformer.wte.weight,
                    "init_moved": _max_diff(_params(model), _params(_gpt2()))}

    model = _gpt2()  # oracle: the same Trainer without the hook
    Trainer(model=model, args=_hf_args(os.getcwd()), train_dataset=data).train()
    out["plain"] = {"params": _params(model)}
    model = _gpt2()  # and with AdamW, for the compressed run
    Trainer(model=model, args=_hf_args(os.getcwd(), "adamw_torch"), train_dataset=data).train()
    out["plain_adamw"] = {"params": _params(model), "loss": _lm_loss(model, data)}

    model, args = _gpt2(), _hf_args(os.getcwd(), "adamw_torch")
    # README: Trainer, compressed
    from commopt.comm.compression import FP16Compressor

    state = AllReduceState(algorithm="hierarchical", compressor=FP16Compressor())
    trainer = Trainer(model=model, args=args, train_dataset=data,
                      callbacks=[CommHookCallback(state, topology="2x1")])
    trainer.train()
    # end README
    out["compressed"] = {"params": _params(model), "loss": _lm_loss(model, data), "init_loss": init_loss,
                         "step": state.step, "buckets": state.buckets_reduced, "nodes": state.topology.num_nodes}

    # A model trained without DDP around it: a clear error at the first training forward, before
    # any backward (the callback driven as the Trainer drives it, with no wrapper).
    from transformers import TrainerControl, TrainerState

    plain, callback = _gpt2(), CommHookCallback(AllReduceState())
    callback.on_train_begin(args, TrainerState(), TrainerControl(), model=plain)
    out["not_ddp"] = "the forward raised no TypeError"
    try:
        plain(input_ids=data.ids[:2], labels=data.ids[:2])
    except TypeError as exc:
        out["not_ddp"] = str(exc)

    out["checkpoint"] = _hf_checkpoint(rank, data)

    out["accelerate"] = {"hooked": _accelerate_hooked(), "plain": _accelerate_plain()}
    out["registered_topology"] = _registered_topology()
    out["sharded"] = {"commopt": _accelerate_sharded(True), "native": _accelerate_sharded(False)}
    out["fsdp_hook"] = _trainer_fsdp_refused(data)
    return out


def _accelerate_sharded(with_commopt: bool) -> dict:
    """FSDP2 with accelerate, without the Trainer: ``fully_shard`` GPT-2's blocks and the root, commopt's
    exact hierarchical comms on a logical 2x1 (``fsdp.register``) or none (the oracle: FSDP2's own),
    ``prepare(optimizer, loader)``, SGD."""
    model = _gpt2()
    loader = torch.utils.data.DataLoader(_Sequences(), batch_size=4)
    rs = None
    if with_commopt:
        # README: accelerate, sharded
        from accelerate import Accelerator
        from torch.distributed.fsdp import fully_shard

        from commopt.comm import Topology, fsdp

        accelerator = Accelerator(cpu=True)  # starts the process group; on GPUs: Accelerator()
        for block in model.transformer.h:
            fully_shard(block)
        fully_shard(model)
        topology = Topology.from_spec("2x1")  # or None: detected
        rs, ag = fsdp.ReduceScatterComm(topology, "hierarchical"), fsdp.AllGatherComm(topology, "hierarchical")
        fsdp.register(model, reduce_scatter=rs, all_gather=ag)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
        optimizer, loader = accelerator.prepare(optimizer, loader)  # not the model: it is sharded already
        # end README
    else:
        from accelerate import Accelerator
        from torch.distributed.fsdp import fully_shard

        accelerator = Accelerator(cpu=True)
        for block in model.transformer.h:
            fully_shard(block)
        fully_shard(model)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
        optimizer, loader = accelerator.prepare(optimizer, loader)
    for batch in loader:
        loss = model(**batch).loss
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
    params = [p.full_tensor().detach().clone() for p in model.parameters()]  # collective: every rank
    return {"params": params, "link_bytes": rs.link_bytes() if rs is not None else 0.0,
            "tied": model.lm_head.weight is model.transformer.wte.weight,
            "sharded": all(isinstance(p, torch.distributed.tensor.DTensor) for p in model.parameters())}


def _trainer_fsdp_refused(data) -> str:
    """A Trainer set up for FSDP (on CPU accelerate trains DDP instead): the DDP-hook callback stops when
    training begins, on every rank, naming the FSDP2 route. Last in the ranks: accelerate keeps the
    FSDP choice in the environment (restored here all the same)."""
    from transformers import Trainer, TrainingArguments

    from commopt.comm.hooks import AllReduceState
    from commopt.comm.integrations.transformers import CommHookCallback

    saved = dict(os.environ)
    args = TrainingArguments(output_dir=os.path.join(os.getcwd(), "hf-fsdp"), use_cpu=True, max_steps=1,
                             per_device_train_batch_size=4, report_to="none", disable_tqdm=True, save_strategy="no",
                             fsdp=True, fsdp_config={"transformer_layer_cls_to_wrap": ["GPT2Block"]})
    try:
        Trainer(model=_gpt2(), args=args, train_dataset=data, callbacks=[CommHookCallback(AllReduceState())]).train()
    except TypeError as exc:
        return str(exc)
    finally:
        os.environ.clear()
        os.environ.update(saved)
    return "train raised no TypeError"


def _registered_topology() -> dict:
    """What ``hooks.register`` leaves in ``state.topology`` when it was None (no training step)."""
    from torch.nn.parallel import DistributedDataParallel

    from commopt.comm import hooks

    out = {}
    for algorithm in ("hierarchical", "flat"):
        state = hooks.AllReduceState(algorithm=algorithm)
        hooks.register(DistributedDataParallel(torch.nn.Linear(4, 2)), state)
        topo = state.topology
        out[algorithm] = None if topo is None else (topo.world_size, topo.num_nodes, topo.rank)
    return out


def _hf_checkpoint(rank: int, data) -> dict:
    """docs/faults.md row 18 through the Trainer: top-k with error feedback for 2 x ``_CKPT_STEPS``
    steps uninterrupted (the callback handed the trainer, the older form), against 3 steps that save
    ``checkpoint-3`` and ``train(resume_from_checkpoint=...)`` with a new model, state and callback."""
    import shutil
    import warnings

    import torch.distributed as dist
    from transformers import Trainer, TrainerControl, TrainerState

    from commopt.comm.compression import TopKCompressor
    from commopt.comm.hooks import AllReduceState
    from commopt.comm.integrations.transformers import CommHookCallback

    def train(steps: int, folder: str, resume=None, save_steps=None, with_trainer=False):
        model, state = _gpt2(), AllReduceState(algorithm="flat", compressor=TopKCompressor(0.05))
        args = _hf_args(os.getcwd(), steps=steps, save_steps=save_steps, folder=folder)
        trainer = Trainer(model=model, args=args, train_dataset=data)
        trainer.add_callback(CommHookCallback(state, trainer=trainer if with_trainer else None))
        trainer.train(resume_from_checkpoint=resume)
        return model, state

    out = {}
    model, state = train(2 * _CKPT_STEPS, "hf-whole", with_trainer=True)
    out["whole"] = {"params": _params(model), "step": state.step}
    model, state = train(_CKPT_STEPS, "hf-ckpt", save_steps=_CKPT_STEPS)
    folder = os.path.join(os.getcwd(), "hf-ckpt", f"checkpoint-{_CKPT_STEPS}")
    out["first"] = {"step": state.step, "residuals": sorted(state.state_dict()["error_feedback"]["worker"])}
    model, state = train(2 * _CKPT_STEPS, "hf-ckpt", resume=folder)
    out["resumed"] = {"params": _params(model), "step": state.step}

    mine = torch.load(os.path.join(folder, f"commopt-rank{rank}.pt"), weights_only=True)
    dist.barrier()  # both ranks have written their files before either reads the other's
    theirs = torch.load(os.path.join(folder, f"commopt-rank{1 - rank}.pt"), weights_only=True)
    out["saved"] = {"world_size": mine["world_size"], "steps": [mine["state"]["step"], theirs["state"]["step"]],
                    "residuals_differ": any(not torch.equal(a, b) for a, b in zip(
                        mine["state"]["error_feedback"]["worker"].values(),
                        theirs["state"]["error_feedback"]["worker"].values()))}
    # A world of another size (each rank's file rewritten as if 4 ranks had written it): a ValueError
    # on every rank when the resumed run starts, before anything is loaded.
    other = os.path.join(os.getcwd(), f"other-world-{rank}")
    os.makedirs(other)
    torch.save({**mine, "world_size": 4}, os.path.join(other, f"commopt-rank{rank}.pt"))
    args = _hf_args(os.getcwd(), folder="hf-ckpt")
    args.resume_from_checkpoint = other
    fresh = CommHookCallback(AllReduceState(algorithm="flat", compressor=TopKCompressor(0.05)))
    out["other_world"] = "on_train_begin raised no ValueError"
    try:
        fresh.on_train_begin(args, TrainerState(global_step=_CKPT_STEPS), TrainerControl(), model=_gpt2())
    except ValueError as exc:
        out["other_world"] = str(exc)
    # Without commopt's files (a checkpoint written without the callback): a reset, with a warning;
    # the continuation then differs from the uninterrupted run, which shows the state mattered.
    bare = os.path.join(os.getcwd(), "hf-bare", f"checkpoint-{_CKPT_STEPS}")
    if rank == 0:
        shutil.copytree(folder, bare, ignore=shutil.ignore_patterns("commopt-*"))
    dist.barrier()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model, _ = train(2 * _CKPT_STEPS, "hf-bare", resume=bare)
    out["reset"] = {"params": _params(model), "warned": [str(w.message) for w in caught
                                                         if "holds no commopt hook state" in str(w.message)]}
    return out


def _accelerate_inputs():
    model = _gpt2()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    return model, optimizer, torch.utils.data.DataLoader(_Sequences(), batch_size=4)


def _accelerate_train(accelerator, model, optimizer, loader) -> list[torch.Tensor]:
    for batch in loader:
        loss = model(**batch).loss
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
    return _params(accelerator.unwrap_model(model))


def _accelerate_hooked() -> dict:
    model, optimizer, loader = _accelerate_inputs()
    # README: accelerate
    from accelerate import Accelerator

    from commopt.comm import Topology, hooks

    accelerator = Accelerator(cpu=True)  # on GPUs: Accelerator()
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    state = hooks.AllReduceState(algorithm="hierarchical", topology=Topology.from_spec("2x1"))
    hooks.register(model, state)
    # end README
    params = _accelerate_train(accelerator, model, optimizer, loader)
    return {"params": params, "step": state.step, "buckets": state.buckets_reduced}


def _accelerate_plain() -> dict:
    from accelerate import Accelerator

    model, optimizer, loader = _accelerate_inputs()
    accelerator = Accelerator(cpu=True)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    return {"params": _accelerate_train(accelerator, model, optimizer, loader)}


@pytest.mark.frameworks
@pytest.mark.skipif(not _HAVE_TRANSFORMERS, reason="needs transformers and accelerate (pip install "
                    "commopt[transformers])")
def test_transformers_trainer_and_accelerate_register_hook(tmp_path):
    """A real ``transformers.Trainer`` on a tiny random GPT-2, 2 processes on gloo: with the callback
    (``Trainer(callbacks=[CommHookCallback(state)])``, no trainer handed over), the exact algorithm
    reproduces the Trainer's own parameters and hierarchical fp16 on a logical 2x1 trains; the
    accelerate route (``prepare``, then ``hooks.register``) likewise; ``hooks.register`` shows the
    topology it detected; a checkpoint resumes bit for bit."""
    ranks = _launch(_transformers_body, tmp_path, timeout=300)
    r0 = ranks[0]
    for r in ranks[1:]:
        _assert_same_params(r["exact"]["params"], r0["exact"]["params"], "Trainer exact run, rank 1 vs 0")
        _assert_same_params(r["compressed"]["params"], r0["compressed"]["params"], "Trainer fp16 run, rank 1 vs 0")

    exact, plain, comp = r0["exact"], r0["plain"], r0["compressed"]
    assert exact["init_moved"] > 1e-3  # it trained
    _assert_same_params(exact["params"], plain["params"], "Trainer: hierarchical hook vs DDP's own all-reduce")
    for run in (exact, comp):
        assert run["step"] == _HF_STEPS and run["buckets"] >= _HF_STEPS, run
    assert exact["tied"]  # GPT-2's lm_head is still the embedding
    assert exact["nodes"] == 1 and comp["nodes"] == 2
    assert comp["loss"] < 0.6 * comp["init_loss"], (comp["init_loss"], comp["loss"])
    adamw = r0["plain_adamw"]
    assert comp["loss"] < 1.1 * adamw["loss"], (adamw["loss"], comp["loss"])
    assert _max_diff(comp["params"], adamw["params"]) > 0  # the fp16 reduction was used
    assert "without DistributedDataParallel" in r0["not_ddp"] and "torchrun" in r0["not_ddp"], r0["not_ddp"]
    _assert_checkpoint_resumes(ranks)

    for rank, r in enumerate(ranks):  # register shows the layout it detected: torchrun's, one node of 2
        assert r["registered_topology"] == {"hierarchical": (_WORLD, 1, rank), "flat": None}, r["registered_topology"]

    acc = r0["accelerate"]
    steps = len(_Sequences()) // (_WORLD * 4)
    assert acc["hooked"]["step"] == steps and acc["hooked"]["buckets"] >= steps
    _assert_same_params(acc["hooked"]["params"], acc["plain"]["params"], "accelerate: hook vs DDP's own")
    assert _max_diff(acc["plain"]["params"], _params(_gpt2())) > 1e-3  # it trained

    for rank, r in enumerate(ranks):  # FSDP2 under accelerate: commopt's exact comms = FSDP2's own, bit for bit
        mine, native = r["sharded"]["commopt"], r["sharded"]["native"]
        assert mine["sharded"] and native["sharded"] and mine["tied"], (mine["sharded"], mine["tied"])
        assert mine["link_bytes"] > 0, "commopt's FSDP comms carried nothing"
        for i, (got, want) in enumerate(zip(mine["params"], native["params"])):
            assert torch.equal(got, want), f"rank {rank}: parameter {i} with commopt's exact FSDP2 comms differs " \
                                           f"by {float((got - want).abs().max())} from FSDP2's own under accelerate"
        _assert_same_params(mine["params"], r0["sharded"]["commopt"]["params"], f"sharded, rank {rank} vs 0")
        msg = r["fsdp_hook"]
        assert "set up for FSDP" in msg and "fsdp.register" in msg and "accelerator.prepare" in msg, msg
    assert _max_diff(r0["sharded"]["native"]["params"], _params(_gpt2())) > 1e-3  # it trained

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



# ------------------------------------------------------------------------------------ README
_SECTION = "## With your framework"


def _readme_snippets(text: str) -> list[str] | None:
    """The python blocks of the framework section of docs/frameworks.md (None: it has no such section)."""
    start = text.find("\n" + _SECTION + "\n")
    if start < 0:
        return None
    end = text.find("\n## ", start + 1)
    section = text[start:end if end >= 0 else len(text)]
    return [textwrap.dedent(b).strip() for b in re.findall(r"```python\n(.*?)```", section, re.S)]


def _tested_snippets() -> list[str]:
    """The blocks of this file between ``# README: ...`` and ``# end README``, dedented."""
    source = Path(__file__).read_text(encoding="utf-8")
    return [textwrap.dedent(b).strip() for b in re.findall(r"# README: [^\n]*\n(.*?)\n[ ]*# end README", source, re.S)]


def test_readme_framework_snippets_are_the_tested_code():
    """Every python snippet of the framework section of docs/frameworks.md is code the framework tests
    above run, and every block those tests mark as README code is there: the two cannot drift apart."""
    tested = _tested_snippets()
    assert len(tested) == 7, tested  # Lightning x3 (DDP x2, sharded), Trainer x2, accelerate x2
    page = Path(__file__).resolve().parents[1] / "docs" / "frameworks.md"
    snippets = _readme_snippets(page.read_text(encoding="utf-8"))
    if snippets is None:
        pytest.skip(f"docs/frameworks.md has no {_SECTION!r} section")
    for snippet in snippets:
        assert snippet in tested, f"this snippet of docs/frameworks.md is not run by this file:\n{snippet}"
    for block in tested:
        assert block in snippets, f"this block is marked as README code but docs/frameworks.md lacks it:\n{block}"
