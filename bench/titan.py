"""``commopt-bench torchtitan``: torchtitan's own ``Trainer``, tensor parallel 2 x FSDP2 2 on 4 ranks,
torchtitan's TP plan on torch's styles against the same plan on commopt's (docs/guide.md, "Tensor
parallelism"; docs/frameworks.md, "With torchtitan").

Two Trainers are built in the same rank processes from torchtitan 0.3.0's ``llama3_debugmodel()``
(its debug Llama 3: dim 256, 16 heads, vocab 2048, 6 layers unless ``--layers``), with SDPA
attention and the CPU settings below: one as torchtitan builds it (its TP plan on torch's
``ColwiseParallel`` / ``RowwiseParallel`` and DTensor redistributions), one whose ``parallelize_fn``
is ``commopt.comm.integrations.torchtitan.parallelize(fn, comms=None, tensor_parallel=True)`` (the
same plan on commopt's styles, each Linear choosing the ring or torch's collective; ``--styles ring``:
``tensor_parallel="ring"``, the ring forced; FSDP2 keeps its own collectives, since with TP it shards a
strided sub-mesh that commopt's FSDP comms refuse). After ``--warmup`` steps of each, ``--pairs`` pairs are
timed: a pair is ``--steps`` training steps of one Trainer, then as many of the other (the order
alternates from pair to pair), each step the slowest rank's ``Trainer.train_step`` (forward, loss,
backward, gradient clipping, AdamW). Printed per pair: each side's mean step and the ratio
torch_step / commopt_step (above 1: commopt's styles were faster); then the medians. Both sides run
the same documents in the same order, so their losses stay equal (printed: the last step's).

By default 4 local ranks over loopback (``--spawn 4``, rendezvous through a ``FileStore``, gloo on
``lo``); ``--spawn 0`` joins a world started by torchrun or ``commopt-bench cluster``::

    commopt-bench cluster --nodes 2 --ranks-per-node 2 --link-rate 1gbit -- commopt-bench torchtitan --spawn 0

Needs torchtitan 0.3.0 (README, "Set up": the ``oracles`` extra, then torchtitan without its pins).

What torchtitan 0.3.0 needs on a CPU-only machine (:func:`cpu_shims`, :func:`write_assets`,
:func:`on_cpu`; tests/test_torchtitan.py uses the same): a device type and device module (torchtitan
assumes ``cuda`` without an accelerator), ``set_timeout`` (torch 2.13 has none), CUDA graphs off,
``spmd_backend="partial_dtensor"`` (the default ``spmd_types`` backend hands ``fully_shard`` plain
tensors with ``dp_mesh_dims``, which torch 2.13's FSDP2 refuses), SDPA instead of flex attention
(flex has no CPU backward), its test tokenizer and data (not in the wheel: written here), FSDP2's
sum reduction (:func:`force_sum_reduction`: gloo rejects ``PREMUL_SUM``), and, without triton, a
stand-in for the triton kernels of MinimalAsyncEP, which torchtitan imports unconditionally (they
serve expert parallelism on CUDA only).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
import types
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from ._launch import launch
from ._memory import PeakMemory, peak_kind
from ._progress import progress

__all__ = ["main", "cpu_shims", "write_assets", "tiny_llama", "debug_llama", "on_cpu", "force_sum_reduction",
           "captured_losses"]

_INSTALL = ("commopt-bench torchtitan: needs torchtitan 0.3.0, which is not installed here: pip install -e "
            "\".[oracles]\" && pip install --no-deps torchtitan==0.3.0 (README, 'Set up')")


# ------------------------------------------------------------------------------ torchtitan on a CPU
class _CpuDevice:
    """torch.cpu with the calls torchtitan makes on its device module (memory monitor, device name)."""

    def __getattr__(self, name: str) -> Any:
        return getattr(torch.cpu, name)

    def get_device_name(self, *args) -> str:
        return "cpu"

    def get_device_properties(self, *args) -> types.SimpleNamespace:
        return types.SimpleNamespace(name="cpu", total_memory=1 << 34)

    def reset_peak_memory_stats(self, *args) -> None:
        pass

    def empty_cache(self) -> None:
        pass

    def memory_stats(self, *args) -> dict:
        import collections

        return collections.defaultdict(int)

    def current_device(self) -> int:
        return 0


def cpu_shims() -> None:
    """Make torchtitan 0.3.0 run on this process's CPU (module docstring); call it in every rank
    before building a Trainer. Idempotent; changes torchtitan's modules in this process only."""
    if importlib.util.find_spec("triton") is None:
        name = "torchtitan.distributed.minimal_async_ep.kernels"
        stand_in = types.ModuleType(name)

        def kernel(attr: str):
            if attr.startswith("__"):
                raise AttributeError(attr)

            def missing(*args, **kwargs):
                raise NotImplementedError(f"{attr} is a triton kernel of MinimalAsyncEP (CUDA only)")
            return missing

        stand_in.__getattr__ = kernel
        sys.modules[name] = stand_in
    if not hasattr(dist, "set_timeout"):  # torchtitan calls it after its first step; torch 2.13 has none
        dist.set_timeout = lambda timeout, group=None: None
    import torchtitan.tools.utils as utils

    utils.device_type, utils.device_module = "cpu", _CpuDevice()
    utils.get_local_device = lambda: torch.device("cpu")
    import torchtitan.trainer  # noqa: F401 - imports every module that copied device_type at import
    for name, module in list(sys.modules.items()):
        if name.startswith("torchtitan") and getattr(module, "device_type", None) == "cuda":
            module.device_type = "cpu"
        if name.startswith("torchtitan") and getattr(module, "device_module", None) is torch.cuda:
            module.device_module = utils.device_module


def write_assets(workdir: str | Path, documents: int = 64) -> None:
    """torchtitan's test tokenizer and c4_test are not in its wheel: a word-level tokenizer of 200
    words and ``documents`` documents of 64 of them, in the layouts torchtitan reads
    (``workdir/tokenizer``, a tokenizer folder; ``workdir/c4``, a JSON-lines dataset for
    ``datasets.load_dataset``)."""
    import random

    from tokenizers import Tokenizer, models, pre_tokenizers

    workdir = Path(workdir)
    words = [f"w{i}" for i in range(200)]
    tokenizer = Tokenizer(models.WordLevel({w: i for i, w in enumerate(["<unk>", "<s>", "</s>", *words])},
                                           unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    (workdir / "tokenizer").mkdir()
    tokenizer.save(str(workdir / "tokenizer" / "tokenizer.json"))
    (workdir / "tokenizer" / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<s>", "eos_token": "</s>"}))
    (workdir / "c4").mkdir()
    rng = random.Random(0)  # each document cycles through 8 words: something to learn in a few steps
    docs = [json.dumps({"text": " ".join(rng.sample(words, 8) * 8)}) for _ in range(documents)]
    (workdir / "c4" / "data.json").write_text("\n".join(docs) + "\n")


def tiny_llama():
    """A 2-layer Llama 3 (dim 64, 4 heads, vocab 256) from torchtitan's own builders, SDPA attention."""
    from torchtitan.models.common import ComplexRoPE, Embedding, Linear, RMSNorm
    from torchtitan.models.llama3 import _build_llama3_layers
    from torchtitan.models.llama3.model import Llama3Model

    dim, heads, vocab = 64, 4, 256
    small = {"weight": lambda w: torch.nn.init.normal_(w, std=0.05)}
    layers = _build_llama3_layers(n_layers=2, dim=dim, n_heads=heads, hidden_dim=128, attn_backend="flex",
                                  rope=ComplexRoPE.Config(dim=dim // heads, max_seq_len=64, theta=500000,
                                                          scaling="none"))
    return Llama3Model.Config(
        dim=dim, vocab_size=vocab, layers=_sdpa(layers),
        tok_embeddings=Embedding.Config(num_embeddings=vocab, embedding_dim=dim, param_init=small),
        norm=RMSNorm.Config(normalized_shape=dim, param_init={"weight": torch.nn.init.ones_}),
        lm_head=Linear.Config(in_features=dim, out_features=vocab, param_init=small))


def debug_llama(model, layers: int | None = None):
    """torchtitan's debug Llama 3 config ``model`` (``llama3_debugmodel().model_spec.model``) with SDPA
    attention, cut to its first ``layers`` layers (all of them with None)."""
    model.layers = _sdpa(model.layers[:layers] if layers else model.layers)
    return model


def _sdpa(layers: list) -> list:
    from torchtitan.models.common.attention import ScaledDotProductAttention

    for layer in layers:  # flex attention has no CPU backward
        layer.attention.inner_attention = ScaledDotProductAttention.Config()
    return layers


def on_cpu(config, workdir: str | Path, *, model=None, steps: int = 4, seq_len: int = 32, batch: int = 2,
           lr: float = 1e-2):
    """A torchtitan ``Trainer.Config`` made CPU-ready and small; its ``parallelize_fn`` and
    parallelism are kept.

    Args:
        config: a ``Trainer.Config`` (e.g. ``llama3_debugmodel()``), changed in place.
        workdir: where :func:`write_assets` wrote the tokenizer and documents.
        model: the model config; None: :func:`tiny_llama`.
        steps, seq_len, batch: ``training.steps``, ``training.seq_len``, ``training.local_batch_size``.
        lr: AdamW's learning rate (one warm-up step, no activation checkpointing, no checkpoints,
            validation or tensorboard, fp32 parameters, seed 0).

    Returns:
        ``config``.
    """
    from torchtitan.components.optimizer.optimizer import default_adamw

    config.model_spec.model = tiny_llama() if model is None else model
    config.loss.loss_fn.global_vocab_size = config.model_spec.model.vocab_size
    config.parallelism.spmd_backend = "partial_dtensor"
    config.hf_assets_path = os.path.abspath(os.path.join(workdir, "tokenizer"))
    config.dataloader.dataset_path = os.path.abspath(os.path.join(workdir, "c4"))
    training = config.training
    training.steps, training.seq_len, training.local_batch_size = steps, seq_len, batch
    training.mixed_precision_param = "float32"
    training.disable_cuda_graphs = True
    config.debug.seed = 0
    config.optimizer = default_adamw(lr=lr)
    config.lr_scheduler.warmup_steps = 1
    config.activation_checkpoint = None
    config.validator.enable = False
    config.checkpoint.enable = False
    config.metrics.enable_tensorboard = False
    return config


def force_sum_reduction(trainer) -> None:
    """FSDP2's own reduce-scatter as a sum (gloo has no ``PREMUL_SUM``; commopt's FSDP comms take it)."""
    for part in trainer.model_parts:
        for module in part.modules():
            if hasattr(module, "set_force_sum_reduction_for_comms"):
                module.set_force_sum_reduction_for_comms(True)


# ------------------------------------------------------------------------------ the benchmark
def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="commopt-bench torchtitan", description=__doc__.split("\n\n")[0])
    p.add_argument("--spawn", type=int, default=4, metavar="N",
                   help="spawn N local ranks (default 4); 0: join the world of torchrun / commopt-bench cluster")
    p.add_argument("--tp", type=int, default=2, help="tensor-parallel degree (the rest of the world is FSDP2)")
    p.add_argument("--no-sp", dest="sp", action="store_false", help="without sequence parallelism")
    p.add_argument("--styles", choices=("auto", "ring"), default="auto",
                   help="commopt's styles as they choose (tensor_parallel=True, the default) or with the ring forced")
    p.add_argument("--layers", type=int, default=None, help="the debug model's first LAYERS layers (default: 6)")
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--batch", type=int, default=2, help="local batch per data-parallel rank")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps of each Trainer first")
    p.add_argument("--pairs", type=int, default=5, help="timed pairs (at least 5)")
    p.add_argument("--steps", type=int, default=2, help="steps of each Trainer in one pair")
    p.add_argument("--quick", action="store_true", help="a 2-layer dim-64 Llama, seq 32, one step per turn")
    p.add_argument("--json", default=None, help="write the results as JSON to this file (rank 0)")
    p.add_argument("--timeout", type=float, default=300.0)
    return p


def _timed_steps(trainer, data, steps: int) -> float:
    """Mean seconds per ``Trainer.train_step`` over ``steps`` steps, the slowest rank's."""
    dist.barrier()
    start = time.perf_counter()
    for _ in range(steps):
        trainer.step += 1
        trainer.train_step(data)
    t = torch.tensor([(time.perf_counter() - start) / steps], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t)


def _build(args, workdir: str, commopt: bool):
    """One Trainer (and its data iterator): torchtitan's TP plan, on commopt's styles or torch's."""
    from torchtitan.models.llama3.config_registry import llama3_debugmodel

    from commopt.comm.integrations.torchtitan import parallelize

    config = llama3_debugmodel()
    model = tiny_llama() if args.quick else debug_llama(config.model_spec.model, args.layers)
    total = args.warmup + args.pairs * args.steps + 1  # the last: _last_loss
    on_cpu(config, workdir, model=model, steps=total, seq_len=args.seq_len, batch=args.batch, lr=8e-4)
    config.metrics.log_freq = total + 1  # torchtitan logs step 1 only: no per-step metric collectives
    parallelism = config.parallelism
    parallelism.tensor_parallel_degree = args.tp
    parallelism.data_parallel_shard_degree = dist.get_world_size() // args.tp
    parallelism.enable_sequence_parallel = args.sp
    if commopt:
        config.model_spec.parallelize_fn = parallelize(config.model_spec.parallelize_fn, comms=None,
                                                       tensor_parallel=True if args.styles == "auto" else "ring")
    trainer = config.build()
    force_sum_reduction(trainer)
    return trainer, trainer.batch_generator(trainer.dataloader), captured_losses(trainer)


def captured_losses(trainer) -> list[float]:
    """The list that receives every loss ``trainer`` logs from now on (averaged over the ranks, as
    torchtitan's metrics processor logs it)."""
    losses: list[float] = []
    log = trainer.metrics_processor.log

    def capture(step, avg_loss, max_loss, grad_norm, **kwargs):
        losses.append(float(avg_loss))
        return log(step, avg_loss, max_loss, grad_norm, **kwargs)

    trainer.metrics_processor.log = capture
    return losses


def _last_loss(trainer, data, losses: list[float]) -> float:
    """The loss of one more step, averaged over the data-parallel ranks (as torchtitan logs it)."""
    trainer.metrics_processor.config.log_freq = 1
    trainer.step += 1
    trainer.train_step(data)
    return losses[-1]


def _body(args) -> int:
    rank, world = dist.get_rank(), dist.get_world_size()
    if world % args.tp or world == args.tp:
        if rank == 0:
            print(f"commopt-bench torchtitan: a world of {world} ranks is not TP {args.tp} x FSDP2 (at least 2); "
                  f"use --spawn {2 * args.tp} or --tp {max(1, world // 2)}", file=sys.stderr)
        return 2
    cpu_shims()
    workdir = tempfile.mkdtemp(prefix="commopt-titan-")
    try:
        write_assets(workdir, documents=1024)  # 66 k tokens: the timed steps never loop over them
        runs = {name: _build(args, workdir, commopt) for name, commopt in (("torch", False), ("commopt", True))}
        bar = progress(2 * args.warmup + 2 * args.pairs, "steps", rank=rank, unit="turn")
        for name in ("torch", "commopt"):  # warm-up (the first step builds DTensor's caches and the rings)
            for _ in range(args.warmup):
                _timed_steps(*runs[name][:2], 1)
                bar.update()
        pairs = []
        memory = PeakMemory("cpu")
        for i in range(args.pairs):
            order = ("torch", "commopt") if i % 2 == 0 else ("commopt", "torch")
            pair = {}
            for name in order:
                memory.start()
                pair[name] = _timed_steps(*runs[name][:2], args.steps)
                memory.stop(name)
                bar.update()
            pairs.append(pair)
        bar.close()
        last = {name: _last_loss(*runs[name]) for name in runs}
        for trainer, _, _ in runs.values():
            trainer.close()
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    if rank == 0:
        _report(args, world, pairs, last, memory)
    return 0


def _report(args, world: int, pairs: list[dict[str, float]], last: dict[str, float], memory: PeakMemory) -> None:
    ratios = [p["torch"] / p["commopt"] for p in pairs]
    model = "tiny Llama 3 (2 layers, dim 64)" if args.quick else (
        f"torchtitan's debug Llama 3 ({args.layers or 6} layers, dim 256, SDPA)")
    print(f"# commopt-bench torchtitan: {model}, TP {args.tp} x FSDP2 {world // args.tp} on {world} gloo ranks, "
          f"sequence parallel {'on' if args.sp else 'off'}, seq {args.seq_len}, local batch {args.batch}; "
          f"torchtitan's TP plan on torch's styles vs commopt's ({args.styles}), {args.pairs} interleaved pairs of "
          f"{args.steps} steps each after {args.warmup} warm-up steps (the slowest rank's Trainer.train_step)")
    print(f"{'pair':>4}{'first':>10}{'torch ms':>11}{'commopt ms':>12}{'torch/commopt':>15}")
    for i, (p, r) in enumerate(zip(pairs, ratios)):
        print(f"{i:>4}{('torch' if i % 2 == 0 else 'commopt'):>10}{p['torch'] * 1e3:>11.1f}"
              f"{p['commopt'] * 1e3:>12.1f}{r:>15.3f}")
    med = {name: statistics.median(p[name] for p in pairs) for name in ("torch", "commopt")}
    print(f"{'median':>14}{med['torch'] * 1e3:>11.1f}{med['commopt'] * 1e3:>12.1f}{statistics.median(ratios):>15.3f}")
    print(f"# last step's loss: torch {last['torch']:.6f}, commopt {last['commopt']:.6f}; peak memory "
          f"({peak_kind('cpu')} of rank 0 during a turn): torch {memory.mib('torch'):.1f} MiB, commopt "
          f"{memory.mib('commopt'):.1f} MiB")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"kind": "torchtitan", "world": world,
                       "args": {k: v for k, v in vars(args).items() if isinstance(v, (int, float, str, bool))},
                       "pairs": [{"torch_step_s": p["torch"], "commopt_step_s": p["commopt"], "ratio": r}
                                 for p, r in zip(pairs, ratios)],
                       "median_ratio": statistics.median(ratios),
                       "median_step_s": {"torch": med["torch"], "commopt": med["commopt"]},
                       "last_loss": last, "memory": peak_kind("cpu"),
                       "peak_memory_bytes": {name: memory.peak(name) for name in ("torch", "commopt")}}, fh, indent=1)


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if importlib.util.find_spec("torchtitan") is None:
        print(_INSTALL, file=sys.stderr)
        return 2
    if args.quick:
        args.seq_len, args.batch, args.steps, args.warmup = 32, 2, 1, 1
    if args.pairs < 5 or args.steps < 1 or args.warmup < 1 or args.tp < 2:
        print("commopt-bench torchtitan: needs --pairs >= 5, --steps >= 1, --warmup >= 1, --tp >= 2", file=sys.stderr)
        return 2
    if args.seq_len % args.tp:
        print(f"commopt-bench torchtitan: --seq-len {args.seq_len} does not divide by --tp {args.tp}", file=sys.stderr)
        return 2
    return launch(_body, args, spawn=args.spawn, timeout=args.timeout, single=False)
