"""Hugging Face ``Trainer``: commopt's DDP comm hook through a ``TrainerCallback``.

``TrainingArguments`` has no field for a custom comm hook, accelerate's
``DistributedDataParallelKwargs(comm_hook=...)`` takes only torch's built-in hooks, and callbacks are
handed the unwrapped model. The ``Trainer`` wraps the model in ``DistributedDataParallel`` (through
``accelerator.prepare``) just before it fires ``on_train_begin``, and keeps the wrapper in
``trainer.model_wrapped``; so :class:`CommHookCallback` is given the trainer and registers
:func:`commopt.comm.hooks.allreduce_hook` on that wrapper in ``on_train_begin``, before the first step::

    from commopt.comm.hooks import AllReduceState
    from commopt.comm.integrations.transformers import CommHookCallback

    trainer = Trainer(model=model, args=args, train_dataset=data)
    trainer.add_callback(CommHookCallback(AllReduceState(algorithm="hierarchical"), trainer=trainer))
    trainer.train()

The topology is built at that moment too (the process group exists from ``TrainingArguments`` on):
from ``topology=`` ("2x4", or a list of nodes), else ``Topology.detect()`` (``COMMOPT_NODES``,
torchrun's placement, MPI's, else host names).

Without the ``Trainer``, with accelerate alone, no callback is needed: after
``model = accelerator.prepare(model)`` the model is a DDP module and the process group exists, so
``commopt.comm.hooks.register(model, state)`` is the whole integration.

Needs ``pip install commopt[transformers]``.
"""

from __future__ import annotations

from ..hooks import AllReduceState
from ._common import TopologyArg, check_arguments, register_on

try:
    from transformers import TrainerCallback as _TrainerCallback
except ImportError:
    raise ImportError("commopt.comm.integrations.transformers needs Hugging Face transformers and accelerate: "
                      "pip install commopt[transformers] (or pip install transformers accelerate)") from None

__all__ = ["CommHookCallback"]

_WHAT_TO_DO = ("the Trainer wraps the model in DDP when it runs on more than one process without DeepSpeed or FSDP "
               "(torchrun --nproc-per-node N train.py, or accelerate launch); with one process there is nothing to "
               "reduce: leave the callback out")


class CommHookCallback(_TrainerCallback):
    """Registers ``allreduce_hook`` with ``state`` on ``trainer.model_wrapped`` in ``on_train_begin``.

    Every ``train()`` call fires ``on_train_begin``: the hook is registered once per DDP module (a
    second ``train()`` on the same wrapper keeps the registration; a new wrapper gets the same state).

    Args:
        state: the hook's :class:`commopt.comm.hooks.AllReduceState`; its ``topology`` may be None
            (built when training starts).
        trainer: the ``transformers.Trainer`` this callback belongs to (callbacks are only handed the
            unwrapped model, so the callback reads the DDP wrapper from the trainer). May also be set
            later as ``callback.trainer = trainer``, before ``train()``.
        topology: how to build the state's topology once the process group exists: a spec
            (``"2x4"``, ``"2+1"``), explicit nodes (``[[0, 2], [1, 3]]``), or None for
            ``Topology.detect()``. Only when ``state.topology`` is None.

    Raises:
        TypeError: at construction, ``state`` is not an ``AllReduceState`` or ``topology`` is of
            another type; when training starts, the trainer's model is not a DDP module (a single
            process, DeepSpeed, FSDP, ...).
        ValueError: at construction, both ``state.topology`` and ``topology`` are given.
        RuntimeError: when training starts, no trainer was given, or the DDP model already has a comm
            hook (DDP accepts only one).
        TopologyError: when training starts, ``topology`` does not fit the world.
    """

    def __init__(self, state: AllReduceState, trainer=None, *, topology: TopologyArg = None):
        check_arguments("CommHookCallback", state, topology)
        self.state = state
        self.trainer = trainer
        self.topology = topology

    def on_train_begin(self, args, trainer_state, control, **kwargs) -> None:
        if self.trainer is None:
            raise RuntimeError("CommHookCallback needs its Trainer to reach the DDP-wrapped model (callbacks only "
                               "receive the unwrapped one): trainer.add_callback(CommHookCallback(state, "
                               "trainer=trainer))")
        register_on("CommHookCallback", self.trainer.model_wrapped, self.state, self.topology,
                    _WHAT_TO_DO)
