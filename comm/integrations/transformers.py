"""Hugging Face ``Trainer``: commopt's DDP comm hook through a ``TrainerCallback``.

``TrainingArguments`` has no field for a custom comm hook, and accelerate's
``DistributedDataParallelKwargs(comm_hook=...)`` takes only torch's built-in hooks. The ``Trainer``
wraps the model in ``DistributedDataParallel`` (through ``accelerator.prepare``) just before it fires
``on_train_begin``, but callbacks are handed the unwrapped model, and neither the model nor any other
callback argument refers to the wrapper. What does: during the wrapper's forward, torch marks it
as the active DDP module (``DistributedDataParallel._get_active_ddp_module()``, the hand-off torch
gives TorchDynamo), and the unwrapped model's forward runs inside it. So :class:`CommHookCallback`
puts a one-shot forward pre-hook on the model in ``on_train_begin`` and registers
:func:`commopt.comm.hooks.allreduce_hook` on the wrapper at the first training forward, before the
first backward; it needs nothing but the state::

    from commopt.comm.hooks import AllReduceState
    from commopt.comm.integrations.transformers import CommHookCallback

    state = AllReduceState(algorithm="hierarchical")
    trainer = Trainer(model=model, args=args, train_dataset=data, callbacks=[CommHookCallback(state)])
    trainer.train()

Handed the trainer (``CommHookCallback(state, trainer=trainer)``, the older form), it registers on
``trainer.model_wrapped`` in ``on_train_begin`` itself. The topology is built at registration (the
process group exists from ``TrainingArguments`` on): from ``topology=`` ("2x4", or a list of nodes),
else ``Topology.detect()`` (``COMMOPT_NODES``, torchrun's placement, MPI's, else host names).

Checkpoints hold every rank's hook state: error-feedback residuals and PowerSGD's warm starts differ
from rank to rank, so in ``on_save`` each rank writes its ``AllReduceState.state_dict()`` to
``commopt-rank<r>.pt`` in the checkpoint folder (``<output_dir>/checkpoint-<step>``, beside the
Trainer's own ``rng_state_<r>.pth``). ``trainer.train(resume_from_checkpoint=...)`` restores the
Trainer's step before ``on_train_begin``, where each rank reads its file back, from
``TrainingArguments.resume_from_checkpoint`` when that names a folder, else from
``<output_dir>/checkpoint-<step>`` (callbacks are not told the folder ``train()`` was given; a
checkpoint moved out of ``output_dir`` needs ``args.resume_from_checkpoint`` set to it). Training
then continues bit-identically (on CPU); the files load with ``weights_only=True``. A checkpoint of a
world of another size is a ``ValueError`` on every rank; one without commopt files (written before
the callback was added) starts the hook afresh, with a warning. Hyperparameter search runs (whose
checkpoints go to per-trial folders) are not covered.

Without the ``Trainer``, with accelerate alone, no callback is needed: after
``model = accelerator.prepare(model)`` the model is a DDP module and the process group exists, so
``commopt.comm.hooks.register(model, state)`` is the whole integration (and
``state.state_dict()`` / ``load_state_dict()`` per rank, beside ``accelerator.save_state``).

Sharded training (FSDP) has no DDP module to hook: a ``Trainer`` set up for FSDP
(``TrainingArguments(fsdp=...)``) makes the callback stop when training begins, with a ``TypeError``
that names the route which works. commopt's FSDP2 comms go on the sharded model itself, with
accelerate and without the ``Trainer``: ``Accelerator(cpu=True)`` (it starts the process group),
``fully_shard`` the blocks and the root, :func:`commopt.comm.fsdp.register`, then
``accelerator.prepare(optimizer, loader)`` (not the model: it is sharded already, and ``prepare``
would wrap it in DDP, which fails on ``DTensor`` parameters) and the usual loop; with exact
comms the parameters are bit-identical to the same loop without ``register`` (docs/frameworks.md,
"Frameworks: sharded"). The ``Trainer`` cannot run FSDP on CPU: accelerate (1.15) sets up
FSDP only for accelerator devices (``AcceleratorState`` keeps ``MULTI_CPU``, so
``use_cpu=True`` with ``fsdp=`` silently trains DDP), and a model sharded before it is handed to the
``Trainer`` fails the same way in ``prepare`` (a ``NotImplementedError`` from DDP's first
broadcast). Lightning's ``ModelParallelStrategy`` runs FSDP2 on CPU too
(``commopt.comm.integrations.lightning``).

Needs ``pip install commopt[transformers]``.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule, FullyShardedDataParallel
from torch.nn.parallel import DistributedDataParallel

from ..hooks import AllReduceState
from ._common import TopologyArg, check_arguments, register_on, restore_from_folder, save_rank_file

try:
    from transformers import TrainerCallback as _TrainerCallback
    from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR as _PREFIX
except ImportError:
    raise ImportError("commopt.comm.integrations.transformers needs Hugging Face transformers and accelerate: "
                      "pip install commopt[transformers] (or pip install transformers accelerate)") from None

__all__ = ["CommHookCallback"]

_WHERE = "CommHookCallback"
_WHAT_TO_DO = ("the Trainer wraps the model in DDP when it runs on more than one process without DeepSpeed or FSDP "
               "(torchrun --nproc-per-node N train.py, or accelerate launch --multi_gpu --num_processes N); with one "
               "process there is nothing to reduce: leave the callback out")


_SHARDED_MESSAGE = (
    f"{_WHERE} registers a DDP comm hook, but this Trainer is set up for FSDP (TrainingArguments.fsdp): there is "
    f"no DistributedDataParallel module to hook. commopt's FSDP2 comms go on the sharded model itself, trained "
    f"with accelerate without the Trainer: accelerator = Accelerator(cpu=True); fully_shard each block, then the "
    f"model; commopt.comm.fsdp.register(model, reduce_scatter=fsdp.ReduceScatterComm(...), "
    f"all_gather=fsdp.AllGatherComm(...)); optimizer, loader = accelerator.prepare(optimizer, loader) (not the "
    f"model); or Lightning's ModelParallelStrategy (docs/frameworks.md, 'Frameworks: sharded'). The Trainer "
    f"cannot run FSDP on CPU (accelerate sets FSDP up only on accelerators: with use_cpu=True it trains DDP), and "
    f"its prepare wraps an already sharded model in DDP, which fails on DTensor parameters. For the DDP hook, leave "
    f"fsdp= unset")


def _sharded(model: torch.nn.Module) -> bool:
    """Whether ``model`` holds FSDP-sharded modules (FSDP2's ``fully_shard`` or FSDP1's wrapper)."""
    return any(isinstance(m, (FSDPModule, FullyShardedDataParallel)) for m in model.modules())


class CommHookCallback(_TrainerCallback):
    """Registers ``allreduce_hook`` with ``state`` on the Trainer's DDP wrapper, and keeps every rank's
    hook state in the Trainer's checkpoints.

    Every ``train()`` call fires ``on_train_begin``: the hook is registered once per DDP module (a
    second ``train()`` on the same wrapper keeps the registration; a new wrapper gets the same state).

    Args:
        state: the hook's :class:`commopt.comm.hooks.AllReduceState`; its ``topology`` may be None
            (built when the hook is registered).
        trainer: optional, the ``transformers.Trainer`` this callback belongs to: the hook is then
            registered on ``trainer.model_wrapped`` in ``on_train_begin`` rather than at the first
            training forward. Not needed: ``Trainer(..., callbacks=[CommHookCallback(state)])``.
        topology: how to build the state's topology once the process group exists: a spec
            (``"2x4"``, ``"2+1"``), explicit nodes (``[[0, 2], [1, 3]]``), or None for
            ``Topology.detect()``. Only when ``state.topology`` is None.

    Raises:
        TypeError: at construction, ``state`` is not an ``AllReduceState`` or ``topology`` is of
            another type; when training starts, the Trainer is set up for FSDP (the message names the
            FSDP2 route) or the job is a single process; at the first training forward, the model is
            not run by a DDP module (DeepSpeed, ...).
        ValueError: at construction, both ``state.topology`` and ``topology`` are given; when a
            resumed run starts, the checkpoint was written by a world of another size (or with
            another algorithm, or an incomplete set of rank files).
        FileNotFoundError: when a resumed run starts, the checkpoint folder is not where the callback
            looks (set ``TrainingArguments.resume_from_checkpoint`` to it).
        RuntimeError: at registration, the DDP model already has a comm hook (DDP accepts only one).
        TopologyError: at registration, ``topology`` does not fit the world.
    """

    def __init__(self, state: AllReduceState, trainer=None, *, topology: TopologyArg = None):
        check_arguments(_WHERE, state, topology)
        self.state = state
        self.trainer = trainer
        self.topology = topology
        self._pending = None  # the forward pre-hook waiting for the first training forward

    def on_train_begin(self, args, state, control, model=None, **kwargs) -> None:
        if getattr(args, "fsdp", None) or (model is not None and _sharded(model)):
            raise TypeError(_SHARDED_MESSAGE)
        if state.global_step > 0:  # train(resume_from_checkpoint=...) restored the Trainer's step
            restore_from_folder(_WHERE, self.state, self._checkpoint_folder(args, state), args.device)
        if self.trainer is not None:
            register_on(_WHERE, self.trainer.model_wrapped, self.state, self.topology, _WHAT_TO_DO)
            return
        if isinstance(model, DistributedDataParallel):
            register_on(_WHERE, model, self.state, self.topology, _WHAT_TO_DO)
            return
        if not dist.is_initialized() or dist.get_world_size() == 1:
            raise TypeError(f"{_WHERE} registers a DDP comm hook, but this Trainer runs in a single process, so "
                            f"it does not wrap the model in DistributedDataParallel; {_WHAT_TO_DO}")
        if model is None:
            raise RuntimeError(f"{_WHERE}: on_train_begin was given no model; pass the trainer: "
                               f"CommHookCallback(state, trainer=trainer)")
        if self._pending is not None:
            self._pending.remove()
        self._pending = model.register_forward_pre_hook(self._register_on_active_wrapper)

    def on_save(self, args, state, control, **kwargs) -> None:
        """Every rank writes its hook state into the checkpoint folder the Trainer has just written."""
        save_rank_file(os.path.join(args.output_dir, f"{_PREFIX}-{state.global_step}"), self.state)

    @staticmethod
    def _checkpoint_folder(args, state) -> str:
        named = args.resume_from_checkpoint
        if isinstance(named, str) and os.path.isdir(named):
            return named
        return os.path.join(args.output_dir, f"{_PREFIX}-{state.global_step}")

    def _register_on_active_wrapper(self, module: torch.nn.Module, inputs) -> None:
        """The first training forward of ``module``: register on the DDP module running it."""
        if not module.training or not torch.is_grad_enabled():
            return  # an evaluation pass (the Trainer evaluates the unwrapped model): wait for training
        self._pending.remove()
        self._pending = None
        ddp = DistributedDataParallel._get_active_ddp_module()
        if ddp is None or not any(sub is module for sub in ddp.module.modules()):
            raise TypeError(f"{_WHERE} registers a DDP comm hook, but the model is trained without "
                            f"DistributedDataParallel around it; {_WHAT_TO_DO}")
        register_on(_WHERE, ddp, self.state, self.topology, _WHAT_TO_DO)

    def __getstate__(self) -> dict:
        d = dict(self.__dict__)
        d["_pending"] = None  # a hook handle belongs to this process's model
        return d
