"""PyTorch Lightning: commopt's DDP comm hook through a ``Callback``, on any device.

Lightning's own route, ``DDPStrategy(ddp_comm_state=..., ddp_comm_hook=...)``, registers the hook only
when the root device is CUDA: on CPU it is silently ignored. And the moments a ``LightningModule``
sees are either too early (``setup()``: the model is not wrapped yet) or need Lightning's internals.
:class:`CommHookCallback` registers :func:`commopt.comm.hooks.allreduce_hook` in ``on_fit_start``,
which Lightning calls after the strategy has initialised the process group and wrapped the model in
``DistributedDataParallel`` and before the first training step, on every rank and device::

    from commopt.comm.hooks import AllReduceState
    from commopt.comm.integrations.lightning import CommHookCallback

    trainer = pl.Trainer(accelerator="cpu", devices=2, strategy="ddp",
                         callbacks=[CommHookCallback(AllReduceState(algorithm="hierarchical"))])

The topology is built then too, since no constructor works before ``init_process_group``: from
``topology=`` ("2x4", or a list of nodes), else ``Topology.detect()`` (``COMMOPT_NODES``, torchrun's
or MPI's placement, else host names). Lightning itself sets no ``LOCAL_WORLD_SIZE``, so ranks spawned
on one machine (``strategy="ddp_spawn"``, or ``"ddp"`` started with ``python train.py``) are one
node: for a logical layout on one machine pass ``topology="2x2"`` or set ``COMMOPT_NODES``.

Checkpoints hold every rank's hook state. Error-feedback residuals and PowerSGD's warm starts differ
from rank to rank, but Lightning writes one file, from rank 0, with rank 0's callback state; so the
callback's ``state_dict()`` (which Lightning calls on every rank while it saves, ``ModelCheckpoint``
or ``trainer.save_checkpoint`` alike) gathers every rank's ``AllReduceState.state_dict()`` on rank 0,
and on resume (``trainer.fit(..., ckpt_path=...)``, where every rank reads the checkpoint) each rank
loads its own entry, before the first step: training continues bit-identically (on CPU), and the
checkpoint loads with ``weights_only=True`` (CPU tensors and numbers only). The checkpoint then
holds one copy of the residuals per rank (gathered through rank 0's memory while it saves). A
checkpoint written by a world of another size is a ``ValueError`` on every rank; one without commopt
state (written before the callback was added) starts the hook afresh, with a warning.

Works with the stock strategies that wrap in DDP (``"ddp"``, ``"ddp_spawn"``, ``"ddp_notebook"``,
``DDPStrategy(...)``) from ``pytorch_lightning`` or ``lightning.pytorch``. With ``"ddp_spawn"`` each
rank trains with a pickled copy of the state: read its counters inside the ranks (for example in
``on_fit_end``), not in the launching process.

A sharded model has no DDP module to hook: with ``ModelParallelStrategy``, ``FSDPStrategy`` or
``DeepSpeedStrategy`` the callback stops in its ``setup`` hook (before the model is built) with a
``TypeError`` that names the route which works. commopt's FSDP2 comms need no callback: under
``ModelParallelStrategy(data_parallel_size=N, tensor_parallel_size=1)`` (which runs on CPU/gloo as
on CUDA; ``FSDPStrategy`` refuses the CPU), the ``LightningModule``'s ``configure_model`` calls
``fully_shard`` and then :func:`commopt.comm.fsdp.register` (or :func:`commopt.comm.fsdp.shard`, the
ZeRO++ recipe, when the data-parallel mesh is every rank); the process group exists there, so a
``Topology`` can be built, and registration happens before the optimizer and the first step. With
exact comms the parameters are bit-identical to the same run without ``register``
(docs/architecture.md section 5.6; docs/frameworks.md, "Frameworks: sharded").

Needs ``pip install commopt[lightning]``.
"""

from __future__ import annotations

from torch.distributed.fsdp import FSDPModule

from ..hooks import AllReduceState
from ._common import TopologyArg, check_arguments, gather_states, register_on, restore_from_gathered

try:  # the standalone package first (commopt's extra), then the unified one
    import pytorch_lightning as _pl
except ImportError:
    try:
        import lightning.pytorch as _pl
    except ImportError:
        raise ImportError("commopt.comm.integrations.lightning needs PyTorch Lightning: "
                          "pip install commopt[lightning] (or pip install pytorch-lightning)") from None

__all__ = ["CommHookCallback"]

_WHAT_TO_DO = ("use a strategy that wraps the model in DDP: strategy='ddp', 'ddp_spawn' or DDPStrategy(...) "
               "with devices > 1 (with one device there is nothing to reduce: leave the callback out)")


# Lightning's strategies that shard the model instead of wrapping it in DDP, by class name (the same
# classes exist in pytorch_lightning and lightning.pytorch).
_SHARDED = ("ModelParallelStrategy", "FSDPStrategy", "DeepSpeedStrategy")


def _sharded(strategy) -> bool:
    return any(cls.__name__ in _SHARDED for cls in type(strategy).__mro__)


def _sharded_message(strategy: str) -> str:
    return (f"CommHookCallback registers a DDP comm hook, but the strategy is {strategy}, which shards the model: "
            f"there is no DistributedDataParallel module to hook. For commopt's comms on a sharded model use its "
            f"FSDP2 comms and leave CommHookCallback out: strategy=ModelParallelStrategy(data_parallel_size=N, "
            f"tensor_parallel_size=1) (CPU or CUDA), and in the LightningModule's configure_model call fully_shard "
            f"and then commopt.comm.fsdp.register(module, reduce_scatter=fsdp.ReduceScatterComm(...), "
            f"all_gather=fsdp.AllGatherComm(...)), or commopt.comm.fsdp.shard(module) (docs/frameworks.md, "
            f"'Frameworks: sharded'). For a DDP hook, use strategy='ddp', 'ddp_spawn' or DDPStrategy(...)")


class CommHookCallback(_pl.Callback):
    """Registers ``allreduce_hook`` with ``state`` once Lightning's DDP strategy has wrapped the model.

    Lightning calls callbacks by hook name, so the same instance works with ``pytorch_lightning``
    and ``lightning.pytorch`` trainers. Each ``fit`` wraps the model in a new DDP module, and the hook
    is registered on each with the same state (its counters and error-feedback memory carry on).
    Checkpoints hold every rank's state (:meth:`state_dict`), and ``fit(..., ckpt_path=...)`` gives
    each rank its own back (:meth:`on_load_checkpoint`).

    Args:
        state: the hook's :class:`commopt.comm.hooks.AllReduceState`; its ``topology`` may be None
            (built at fit start).
        topology: how to build the state's topology once the process group exists: a spec
            (``"2x4"``, ``"2+1"``: ``Topology.from_spec``), explicit nodes (``[[0, 2], [1, 3]]``:
            ``Topology.from_nodes``), or None for ``Topology.detect()``. Only when ``state.topology``
            is None.

    Raises:
        TypeError: at construction, ``state`` is not an ``AllReduceState`` or ``topology`` is of
            another type; in ``setup``, the strategy shards the model (``ModelParallelStrategy``,
            ``FSDPStrategy``, ``DeepSpeedStrategy``: the message names the FSDP2 route); at fit
            start, the strategy did not wrap the model in DDP (a single device, ...).
        ValueError: at construction, both ``state.topology`` and ``topology`` are given; on resume,
            the checkpoint was written by a world of another size (or with another algorithm).
        RuntimeError: at fit start, the DDP model already has a comm hook (for instance
            ``DDPStrategy(ddp_comm_hook=...)`` on CUDA): DDP accepts only one.
        TopologyError: at fit start, ``topology`` does not fit the world (``"2x2"`` on 2 ranks).
    """

    def __init__(self, state: AllReduceState, *, topology: TopologyArg = None):
        check_arguments("CommHookCallback", state, topology)
        self.state = state
        self.topology = topology

    def setup(self, trainer, pl_module, stage: str) -> None:
        """Refuse a sharded strategy at once when fitting, before ``configure_model`` and the strategy's
        own setup (whose errors would not say what to use instead); validate/test/predict need no hook."""
        if stage == "fit" and _sharded(trainer.strategy):
            raise TypeError(_sharded_message(type(trainer.strategy).__name__))

    def on_fit_start(self, trainer, pl_module) -> None:
        model = trainer.strategy.model
        if _sharded(trainer.strategy) or any(isinstance(m, FSDPModule) for m in model.modules()):
            raise TypeError(_sharded_message(type(trainer.strategy).__name__))
        register_on("CommHookCallback", model, self.state, self.topology,
                    f"the strategy is {type(trainer.strategy).__name__}: {_WHAT_TO_DO}")

    def state_dict(self) -> dict:
        """Every rank's hook state, gathered on rank 0 (``{"format", "world_size", "ranks": [...]}``).

        Collective over WORLD: Lightning calls it on every rank while saving a checkpoint and writes
        rank 0's; the other ranks return an empty dict, which Lightning drops.
        """
        gathered = gather_states(self.state)
        return gathered if gathered is not None else {}

    def on_load_checkpoint(self, trainer, pl_module, checkpoint: dict) -> None:
        """Load this rank's entry of the gathered states (every rank reads the whole checkpoint).

        Here rather than in ``load_state_dict``, which Lightning skips for a checkpoint without this
        callback's entry: that case is a reset, and it warns.

        Raises:
            ValueError: the checkpoint was written by a world of another size, with another
                algorithm, or with a compressor where this state has none.
        """
        saved = (checkpoint.get("callbacks") or {}).get(self.state_key)
        restore_from_gathered("CommHookCallback", self.state, saved, pl_module.device, "the checkpoint")
