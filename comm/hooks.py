"""DDP comm hooks with torch's contract: ``hook(state, bucket) -> Future[Tensor]``.

One hook, :func:`allreduce_hook`, whose :class:`AllReduceState` selects the algorithm (and, with
issue 5, a compressor). The future completes with one tensor shaped like ``bucket.buffer()``
holding the gradients averaged over the group. :func:`register` validates the model first, so
problems surface at registration, not in the middle of ``backward()``::

    from commopt.comm import hooks
    hooks.register(ddp_model, hooks.AllReduceState(algorithm="hierarchical"))

States are checkpointable: ``state_dict()`` holds plain tensors and numbers (loadable with
``torch.load(weights_only=True)``), and pickling drops process groups and the topology.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed import ReduceOp

from .collectives import SUPPORTED_DTYPES, all_reduce
from .topology import Topology

__all__ = ["AllReduceState", "allreduce_hook", "register", "check_result"]


class AllReduceState:
    """State of :func:`allreduce_hook`.

    Args:
        topology: the layout of the process group (None: detected on first use).
        algorithm: any all-reduce algorithm of ``commopt.comm.collectives`` ("auto", "flat",
            "hierarchical", "leader", "ina").
        compressor: a ``commopt.comm.compression`` compressor, or None for exact reduction.
        process_group: the group to reduce over (None: WORLD, as DDP).
        error_feedback: keep the compressor's residuals (ignored without a compressor).
        warmup_steps: exact all-reduce for this many steps before compressing.
        validate: exchange a fingerprint before each bucket's reduction (FAULTS rows 1-3).
        timeout: seconds each phase may take before ``CommTimeoutError`` (None: the group's own).
    """

    def __init__(self, topology: Topology | None = None, algorithm: str = "auto", compressor=None, *,
                 process_group=None, error_feedback: bool = True, warmup_steps: int = 0,
                 validate: bool = False, timeout: float | None = None):
        if warmup_steps < 0:
            raise ValueError(f"warmup_steps must be >= 0, got {warmup_steps}")
        self.topology = topology
        self.algorithm = algorithm
        self.compressor = compressor
        self.process_group = process_group
        self.error_feedback = error_feedback
        self.warmup_steps = int(warmup_steps)
        self.validate = validate
        self.timeout = timeout
        self.step = 0  # completed optimizer steps seen by the hook (bucket 0 marks a new step)
        self.buckets_reduced = 0

    # ----------------------------------------------------------------------------- checkpointing
    def state_dict(self) -> dict:
        """Plain numbers and tensors only, so ``torch.load(weights_only=True)`` accepts it."""
        out = {"step": self.step, "buckets_reduced": self.buckets_reduced, "algorithm": self.algorithm,
               "warmup_steps": self.warmup_steps}
        if self.compressor is not None and hasattr(self.compressor, "state_dict"):
            out["compressor"] = self.compressor.state_dict()
        return out

    def load_state_dict(self, state: dict) -> None:
        if state.get("algorithm", self.algorithm) != self.algorithm:
            raise ValueError(f"checkpoint was taken with algorithm={state['algorithm']!r} but this state "
                             f"uses {self.algorithm!r}; build the state with the same algorithm")
        self.step = int(state["step"])
        self.buckets_reduced = int(state["buckets_reduced"])
        self.warmup_steps = int(state.get("warmup_steps", self.warmup_steps))
        if "compressor" in state:
            if self.compressor is None or not hasattr(self.compressor, "load_state_dict"):
                raise ValueError("checkpoint holds compressor state but this state has no compressor")
            self.compressor.load_state_dict(state["compressor"])

    def __getstate__(self) -> dict:
        # Process groups and topologies hold live communicators: never pickled.
        d = dict(self.__dict__)
        d["process_group"] = None
        d["topology"] = None
        return d

    def __setstate__(self, d: dict) -> None:
        self.__dict__.update(d)


def check_result(bucket, result) -> torch.Tensor:
    """The hook contract DDP relies on, checked before DDP copies the result (FAULTS row 14)."""
    buf = bucket.buffer()
    if isinstance(result, torch.futures.Future):
        raise ValueError(f"comm hook for bucket {bucket.index()} returned a nested Future; return a "
                         f"Future of one tensor")
    if isinstance(result, (list, tuple)) and len(result) == 1:
        result = result[0]
    if not isinstance(result, torch.Tensor):
        raise ValueError(f"comm hook for bucket {bucket.index()} must produce a tensor, got "
                         f"{type(result).__name__}")
    if result.numel() != buf.numel() or result.dtype != buf.dtype:
        raise ValueError(f"comm hook for bucket {bucket.index()} produced numel={result.numel()} "
                         f"dtype={result.dtype}; expected numel={buf.numel()} dtype={buf.dtype} "
                         f"(the shape of bucket.buffer())")
    return result


def allreduce_hook(state: AllReduceState, bucket) -> torch.futures.Future:
    """Average ``bucket.buffer()`` over the group with the state's algorithm (and compressor).

    Returns:
        A future of one tensor shaped like ``bucket.buffer()``.
    """
    buf = bucket.buffer()
    if bucket.is_last():
        state.step += 1
    state.buckets_reduced += 1
    group = state.process_group
    world = dist.get_world_size(group)
    if world == 1:
        fut: torch.futures.Future = torch.futures.Future()
        fut.set_result(buf)
        return fut
    compressor = state.compressor if state.step >= state.warmup_steps else None
    if compressor is not None:
        return compressor.hook(state, bucket)
    fut = all_reduce(buf, ReduceOp.AVG, group=group, topology=state.topology, algorithm=state.algorithm,
                     async_op=True, validate=state.validate, timeout=state.timeout)
    return fut.then(lambda f: check_result(bucket, f.value()))


def register(ddp_model, state: AllReduceState) -> None:
    """Validate ``ddp_model`` for ``state``, then ``ddp_model.register_comm_hook(state, allreduce_hook)``.

    Raises:
        NotImplementedError: the model has sparse gradients (``nn.Embedding(sparse=True)``).
        TypeError: a parameter has a dtype commopt cannot reduce.
    """
    from torch.nn.parallel import DistributedDataParallel

    if not isinstance(ddp_model, DistributedDataParallel):
        raise TypeError(f"register expects a DistributedDataParallel model, got {type(ddp_model).__name__}")
    for name, module in ddp_model.module.named_modules():
        if getattr(module, "sparse", False) is True:
            raise NotImplementedError(
                f"module {name or type(module).__name__} produces sparse gradients, which DDP comm hooks "
                f"cannot reduce; use sparse=False or leave the default DDP reduction for this model")
    for name, param in ddp_model.module.named_parameters():
        if param.requires_grad and param.dtype not in SUPPORTED_DTYPES:
            raise TypeError(f"parameter {name} has dtype {param.dtype}, which commopt does not reduce")
    if state.process_group is None:
        state.process_group = ddp_model.process_group
    if state.process_group is dist.GroupMember.WORLD:
        state.process_group = None
    ddp_model.register_comm_hook(state, allreduce_hook)
