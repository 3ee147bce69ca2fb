"""DDP comm hooks with torch's contract: ``hook(state, bucket) -> Future[Tensor]``.

One hook, :func:`allreduce_hook`, whose :class:`AllReduceState` selects the algorithm and,
optionally, a compressor (``commopt.comm.compression``; error feedback keyed by parameter name).
The future completes with one tensor shaped like ``bucket.buffer()`` holding the gradients averaged
over the group. :func:`register` validates the model first, so
problems surface at registration, not in the middle of ``backward()``::

    from commopt.comm import hooks
    hooks.register(ddp_model, hooks.AllReduceState(algorithm="hierarchical"))

States are checkpointable: ``state_dict()`` holds plain tensors and numbers (loadable with
``torch.load(weights_only=True)``), and pickling drops process groups and the topology.
"""

from __future__ import annotations

import numbers

import torch
import torch.distributed as dist
from torch.distributed import ReduceOp

from . import algorithms
from .collectives import SUPPORTED_DTYPES, all_reduce, check_group, check_timeout, validate_same
from .compression import Compressor, CompressorState, ErrorFeedback, reduce_tensors
from .engine import chain
from .runtime import context
from .topology import Topology

__all__ = ["AllReduceState", "allreduce_hook", "register", "check_result", "check_dense_gradients"]


class AllReduceState:
    """State of :func:`allreduce_hook`.

    Args:
        topology: the layout of the process group (None: detected on first use).
        algorithm: "auto" or any all-reduce algorithm of the registry
            (``commopt.comm.algorithms.names("allreduce")``: "flat", "hierarchical", "leader", "ina",
            "synth", and any registered one); with a compressor: "auto" or one that can carry it
            (``names("allreduce", codec=True)``: "flat", "hierarchical", where only the inter-node
            phase is compressed, "synth", the same with the rail's rounds on its synthesized schedules).
        compressor: a ``commopt.comm.compression`` compressor, or None for exact reduction.
        process_group: the group to reduce over (None: WORLD, as DDP).
        error_feedback: keep residual memory for biased compressors, keyed by parameter name (a
            biased compressor without it warns: it may not converge).
        warmup_steps: exact all-reduce for this many steps before compressing.
        validate: exchange a fingerprint before each bucket's reduction (docs/faults.md rows 1-3).
        timeout: seconds each phase may take before ``CommTimeoutError`` (None: the group's own).
        seed: the seed of all compressor randomness, identical on every rank (never the global RNG).
        check_finite: with a compressor, raise ``NonFiniteError`` on every rank when any rank's bucket
            holds NaN/Inf; by default such a step is reduced exactly (NaN propagates, residuals kept).

    Attributes:
        compressor_state: the compressor's per-run state for this hook (PowerSGD's warm-start Q
            memory), made by ``compressor.new_state()``: one compressor instance can serve several
            models, each through a state of its own. None without a compressor.

    Raises:
        TypeError: ``topology`` is not a ``Topology`` (a spec string is not: build it with
            ``Topology.from_spec`` once the process group exists), ``compressor`` is not a compressor
            instance, ``process_group`` is not a ProcessGroup, or ``seed`` is not an int.
        ValueError: an unknown ``algorithm`` (or one that cannot carry the compressor), a negative
            ``warmup_steps``, or a ``timeout`` that is not positive.
    """

    def __init__(self, topology: Topology | None = None, algorithm: str = "auto",
                 compressor: Compressor | None = None, *, process_group: dist.ProcessGroup | None = None,
                 error_feedback: bool = True, warmup_steps: int = 0,
                 validate: bool = False, timeout: float | None = None, seed: int = 0,
                 check_finite: bool = False):
        _check_arguments(topology, algorithm, compressor, process_group, warmup_steps, timeout, seed)
        self.topology = topology
        self.algorithm = algorithm
        self.compressor = compressor
        self.compressor_state: CompressorState | None = compressor.new_state() if compressor is not None else None
        self.process_group = process_group
        self.error_feedback = error_feedback
        self.feedback: ErrorFeedback | None = ErrorFeedback() if error_feedback else None
        self.warmup_steps = int(warmup_steps)
        self.validate = validate
        self.timeout = check_timeout("AllReduceState", timeout)
        self.seed = int(seed)
        self.check_finite = bool(check_finite)
        self.step = 0  # optimizer steps completed (the last bucket of a step advances it)
        self.buckets_reduced = 0
        self.world_size: int | None = None
        # id(parameter) -> stable key (its name in the model, recorded by register()).
        self.param_keys: dict[int, str] = {}
        if compressor is not None and compressor.biased and not error_feedback:
            compressor.warn_biased()

    def key_of(self, param: torch.Tensor) -> str:
        """The stable key of ``param``: its name when :func:`register` saw the model, else the order of
        first appearance (deterministic, but only stable for the same model and bucket order)."""
        key = self.param_keys.get(id(param))
        if key is None:
            key = self.param_keys[id(param)] = f"param{len(self.param_keys)}"
        return key

    # ----------------------------------------------------------------------------- checkpointing
    def state_dict(self) -> dict:
        """Plain numbers and tensors only, so ``torch.load(weights_only=True)`` accepts it."""
        out = {"step": self.step, "buckets_reduced": self.buckets_reduced, "algorithm": self.algorithm,
               "warmup_steps": self.warmup_steps, "seed": self.seed, "world_size": self.world_size}
        if self.compressor_state is not None:
            out["compressor"] = self.compressor_state.state_dict()
        if self.feedback is not None:
            out["error_feedback"] = self.feedback.state_dict()
        return out

    def load_state_dict(self, state: dict) -> None:
        """Restore a :meth:`state_dict`; training then continues bit-identically (on CPU).

        Raises:
            ValueError: the checkpoint's algorithm, compressor settings or world size differ.
                Residuals are keyed by parameter name, so a different DDP bucket layout loads fine.
        """
        if state.get("algorithm", self.algorithm) != self.algorithm:
            raise ValueError(f"checkpoint was taken with algorithm={state['algorithm']!r} but this state "
                             f"uses {self.algorithm!r}; build the state with the same algorithm")
        saved_world = state.get("world_size")
        world = dist.get_world_size(self.process_group) if dist.is_initialized() else None
        if saved_world is not None and world is not None and saved_world != world and "error_feedback" in state:
            raise ValueError(f"checkpoint was taken with world_size={saved_world} but this job has "
                             f"world_size={world}: residuals and warm starts do not transfer; build a fresh "
                             f"AllReduceState (a documented reset) or resume on {saved_world} ranks")
        self.step = int(state["step"])
        self.buckets_reduced = int(state["buckets_reduced"])
        self.warmup_steps = int(state.get("warmup_steps", self.warmup_steps))
        self.seed = int(state.get("seed", self.seed))
        if "compressor" in state:
            if self.compressor_state is None:
                raise ValueError("checkpoint holds compressor state but this state has no compressor")
            self.compressor_state.load_state_dict(state["compressor"])
        if "error_feedback" in state and self.feedback is not None:
            self.feedback.load_state_dict(state["error_feedback"])

    def __getstate__(self) -> dict:
        # Process groups and topologies hold live communicators, and ids mean nothing elsewhere.
        d = dict(self.__dict__)
        d["process_group"] = None
        d["topology"] = None
        d["param_keys"] = {}
        return d

    def __setstate__(self, d: dict) -> None:
        self.__dict__.update(d)
        if "compressor_state" not in d:
            # Pickled before the per-run state moved off the compressor: it ran on the compressor's
            # (now default) state, so it continues there.
            self.compressor_state = self.compressor.default_state if self.compressor is not None else None


def _check_arguments(topology, algorithm, compressor, process_group, warmup_steps, timeout, seed) -> None:
    """Every argument of :class:`AllReduceState` checked when it is built, not mid-backward."""
    name = "AllReduceState"
    if topology is not None and not isinstance(topology, Topology):
        raise TypeError(f"{name}: topology must be a commopt.comm.Topology or None (detected), got "
                        f"{type(topology).__name__} {topology!r}; build one after init_process_group, e.g. "
                        f"Topology.from_spec('2x2') or Topology.from_env()")
    known = [algorithms.AUTO, *algorithms.names("allreduce")]
    if not isinstance(algorithm, str) or algorithm not in known:
        raise ValueError(f"{name}: unknown algorithm {algorithm!r}; choose one of {known}")
    if compressor is not None:
        if not isinstance(compressor, Compressor):
            hint = " (a class: instantiate it)" if isinstance(compressor, type) else ""
            raise TypeError(f"{name}: compressor must be a commopt.comm.compression compressor instance or None, "
                            f"got {type(compressor).__name__} {compressor!r}{hint}; e.g. "
                            f"compression.FP16Compressor() or compression.PowerSGDCompressor(rank=4)")
        compressible = [algorithms.AUTO, *algorithms.names("allreduce", codec=True)]
        if algorithm not in compressible:
            raise ValueError(f"{name}: algorithm {algorithm!r} cannot carry a compressor; with a compressor use "
                             f"one of {compressible} ('hierarchical' compresses the inter-node phase only)")
    check_group(name, process_group)
    if isinstance(warmup_steps, bool) or not isinstance(warmup_steps, numbers.Integral) or warmup_steps < 0:
        raise ValueError(f"{name}: warmup_steps must be an int >= 0, got {warmup_steps!r}")
    if isinstance(seed, bool) or not isinstance(seed, numbers.Integral):
        raise TypeError(f"{name}: seed must be an int (the same on every rank), got {type(seed).__name__}")
    check_timeout(name, timeout)


def check_result(bucket: dist.GradBucket, result: object) -> torch.Tensor:
    """The hook contract DDP relies on, checked before DDP copies the result (docs/faults.md row 14)."""
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


def _views(bucket: dist.GradBucket, buf: torch.Tensor) -> list[torch.Tensor]:
    """Each parameter's gradient as a view of the bucket buffer (DDP lays them out back to back)."""
    params = bucket.parameters()
    total = sum(p.numel() for p in params)
    if total != buf.numel():
        raise ValueError(f"bucket {bucket.index()}: parameters hold {total} elements but the buffer has "
                         f"{buf.numel()}; this DDP layout is not supported with a compressor")
    out, pos = [], 0
    for p in params:
        out.append(buf[pos: pos + p.numel()].view(p.shape))
        pos += p.numel()
    return out


def allreduce_hook(state: AllReduceState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """Average ``bucket.buffer()`` over the group with the state's algorithm (and compressor).

    With a compressor, floating buckets go through ``compression.reduce_tensors`` (agreed
    non-finite check, compressed exchange, error feedback keyed by parameter name); integer buckets,
    warm-up steps and a world of one rank reduce exactly.

    Returns:
        A future of one tensor shaped like ``bucket.buffer()``.
    """
    if not isinstance(bucket, dist.GradBucket):
        raise RuntimeError(_python_reducer_error("allreduce_hook was called with a "
                                                 f"{type(bucket).__name__} instead of a GradBucket"))
    buf = bucket.buffer()
    step = state.step
    if bucket.is_last():
        state.step += 1
    state.buckets_reduced += 1
    group = state.process_group
    world = dist.get_world_size(group)
    if state.world_size is None:
        state.world_size = world
    if world == 1:
        fut: torch.futures.Future = torch.futures.Future()
        fut.set_result(buf)
        return fut
    compressor = state.compressor if step >= state.warmup_steps else None
    if compressor is not None and buf.is_floating_point() and buf.numel():
        if state.validate:
            validate_same("all_reduce", buf, algorithm=f"{state.algorithm}+{compressor.name}", op="avg",
                          group=group, timeout=state.timeout)
        keys = [state.key_of(p) for p in bucket.parameters()]
        if compressor.layout_free:  # one flat vector, cast in place of a staged copy (casts)
            more = ", ..." if len(keys) > 3 else ""
            tensors, keys = [buf], [f"bucket {bucket.index()} ({', '.join(keys[:3])}{more})"]
        else:
            tensors = _views(bucket, buf)
        fut = reduce_tensors(compressor, tensors, keys, group=group, topology=state.topology,
                             algorithm=state.algorithm, average=True, step=step, seed=state.seed,
                             feedback=state.feedback, state=state.compressor_state, check_finite=state.check_finite,
                             timeout=state.timeout)
        return chain(fut, lambda _value: check_result(bucket, buf))
    # DDP's buckets match across ranks by construction: no agreement check per bucket.
    fut = all_reduce(buf, ReduceOp.AVG, group=group, topology=state.topology, algorithm=state.algorithm,
                     async_op=True, validate=state.validate, timeout=state.timeout, agreement=False)
    return chain(fut, lambda value: check_result(bucket, value))


# DDP compares the hook's annotations with the objects themselves (``dist.GradBucket``,
# ``Future[Tensor]``); postponed annotations are strings, so the resolved ones are set here.
allreduce_hook.__annotations__.update(bucket=dist.GradBucket, state=AllReduceState,
                                      **{"return": torch.futures.Future[torch.Tensor]})


def _python_reducer_error(what: str) -> str:
    """What to say when DDP runs its Python reducer (docs/faults.md row 41)."""
    return (f"{what}: DDP was built with torch._dynamo.config.optimize_ddp='python_reducer', the mode compiled "
            f"autograd needs, where DDP calls a comm hook once per parameter with (grad, param) and drops the "
            f"Future it returns, so commopt's bucket hook (its algorithm, compressor and error feedback) cannot "
            f"run; build the DDP model with the default optimize_ddp and use torch.compile(model) without "
            f"compiled autograd (DDP's graph splitting keeps bucket hooks), or leave the commopt hook off")


def check_dense_gradients(module: torch.nn.Module, reducer: str, hint: str = "use sparse=False") -> None:
    """Raise ``NotImplementedError`` when a submodule of ``module`` produces sparse gradients
    (``nn.Embedding(sparse=True)``, ``nn.EmbeddingBag(sparse=True)``), which ``reducer`` (the
    dense reduction that would meet them, e.g. "DDP comm hooks") cannot reduce; ``hint`` says what to
    do instead. Checked when a model is wrapped or a hook registered, never mid-backward."""
    for name, sub in module.named_modules():
        if getattr(sub, "sparse", False) is True:
            raise NotImplementedError(f"module {name or type(sub).__name__} produces sparse gradients, which "
                                      f"{reducer} cannot reduce; {hint}")


def register(ddp_model: torch.nn.parallel.DistributedDataParallel, state: AllReduceState) -> None:
    """Validate ``ddp_model`` for ``state``, then ``ddp_model.register_comm_hook(state, allreduce_hook)``.

    A ``state.topology`` of None is set to the layout the hook will use (``Topology.detect`` over the
    state's group, collective like DDP's construction), so it can be read back; ``"flat"`` needs none.

    ``torch.compile(ddp_model)`` keeps the hook (DDP's graph splitting runs it per bucket, as eagerly);
    compiled autograd cannot run it (docs/architecture.md section 5.10).

    Raises:
        NotImplementedError: the model has sparse gradients (``nn.Embedding(sparse=True)``), or DDP was
            built for compiled autograd (``torch._dynamo.config.optimize_ddp="python_reducer"``), where
            it would call the hook per parameter and drop its result.
        TypeError: ``ddp_model`` is not a ``DistributedDataParallel`` model, ``state`` is not an
            :class:`AllReduceState`, or a parameter has a dtype commopt cannot reduce.
    """
    from torch.nn.parallel import DistributedDataParallel

    if not isinstance(ddp_model, DistributedDataParallel):
        raise TypeError(f"register expects a DistributedDataParallel model, got {type(ddp_model).__name__}")
    if not isinstance(state, AllReduceState):
        raise TypeError(f"register expects an AllReduceState as its state, got {type(state).__name__} {state!r}; "
                        f"pass hooks.AllReduceState(...) (for a hook of your own use "
                        f"ddp_model.register_comm_hook)")
    if getattr(ddp_model, "_use_python_reducer", False):
        raise NotImplementedError(_python_reducer_error("hooks.register"))
    check_dense_gradients(ddp_model.module, "DDP comm hooks", "use sparse=False or leave the default DDP "
                          "reduction for this model")
    for name, param in ddp_model.module.named_parameters():
        if param.requires_grad and param.dtype not in SUPPORTED_DTYPES:
            raise TypeError(f"parameter {name} has dtype {param.dtype}, which commopt does not reduce")
    if state.process_group is None:
        state.process_group = ddp_model.process_group
    if state.process_group is dist.GroupMember.WORLD:
        state.process_group = None
    # Error feedback and warm starts are keyed by the parameter's name: stable across DDP's bucket
    # rebuild and across restarts (a bucket index is neither).
    state.param_keys = {id(p): name for name, p in ddp_model.module.named_parameters()}
    state.world_size = dist.get_world_size(state.process_group)
    if state.topology is None and state.algorithm != "flat":
        # The layout every bucket would detect (once per group, cached), kept where the user can read it.
        state.topology = context().topology(None, state.process_group, state.timeout)
    ddp_model.register_comm_hook(state, allreduce_hook)
