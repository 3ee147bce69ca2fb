"""torchtitan: commopt's FSDP2 comms on the modules torchtitan's own parallelize function shards.

torchtitan builds every model on the meta device and hands it to ``ModelSpec.parallelize_fn`` (for
Llama 3, ``parallelize_llama``: tensor/context parallelism, activation checkpointing, compile, then
``fully_shard`` on every block and the root), before it allocates the weights and builds the
optimizer. :func:`parallelize` wraps that function: (1) torchtitan's function runs unchanged, (2)
``commopt.comm.fsdp.register`` sets commopt's reduce-scatter and all-gather on every FSDP module it
created, then the model goes back to torchtitan, which initialises it and trains as usual. With
pipeline parallelism torchtitan calls the function once per stage, and each stage is registered.

Two sets of comms:

- ``comms="exact"`` (the default): :class:`~commopt.comm.fsdp.ReduceScatterComm` and
  :class:`~commopt.comm.fsdp.AllGatherComm` with ``algorithm="hierarchical"`` (reduce-scatter inside
  each node, then across nodes on 1/L of the data; the all-gather in reverse): the same gradients as
  native FSDP2 up to the order of fp32 sums, fewer bytes on the inter-node links.
- ``comms="zero++"``: ZeRO++'s qgZ and qwZ (int4 gradients reduced hierarchically with error
  feedback, int8 weights gathered across nodes), as :func:`commopt.comm.fsdp.shard` registers them.
  Lossy where the compressors touch (docs/architecture.md section 5.4). hpZ (the secondary shard
  inside each node) is not applied: torchtitan chooses ``reshard_after_forward`` itself
  (``--parallelism.fsdp_reshard_after_forward``).

A torchtitan user adds a config function beside torchtitan's (``--module`` names a Python module
holding config functions, ``--config`` the function)::

    # my_configs.py, somewhere on PYTHONPATH
    from commopt.comm.integrations.torchtitan import parallelize
    from torchtitan.models.llama3.config_registry import llama3_8b

    def llama3_8b_commopt():
        config = llama3_8b()
        config.model_spec.parallelize_fn = parallelize(config.model_spec.parallelize_fn)
        return config

    # torchrun --nproc_per_node 8 -m torchtitan.train --module my_configs --config llama3_8b_commopt

Where commopt's comms apply: the FSDP mesh must be every rank, or the ranks of one node (HSDP with
``data_parallel_shard_degree`` = ranks per node); with tensor or context parallelism FSDP shards over
a strided sub-mesh and ``register`` raises ``TopologyError`` on every rank before the first step. The
topology is detected (``COMMOPT_NODES``, else torchrun's ``LOCAL_WORLD_SIZE``), or given as a spec.
The comms count their bytes: :attr:`Parallelize.comms` holds what each call registered
(``link_bytes()``, and ``state_dict()`` for the ZeRO++ residuals, which belong in a checkpoint).

Tensor parallelism (``tensor_parallel=True``, off by default): torchtitan 0.3.0 declares its TP plan
per module (a ``ShardingConfig`` on each sub-module's config: ``colwise_config()`` on ``wqkv`` /
``w1`` / ``w3``, ``rowwise_config()`` on ``wo`` / ``w2``, an all-gather of the sequence shard at the
attention and feed-forward inputs), and its ``Module.parallelize`` applies it inside the
parallelize function. Before that function runs, the wrapper gives each ``Linear`` whose declared
placements on the TP mesh are column-parallel (weight ``Shard(0)``, output ``Shard(-1)``) or
row-parallel (weight ``Shard(1)``, output ``Partial`` reduced to ``Shard(1)`` or ``Replicate``)
:class:`commopt.schedules.tensor_parallel.ColwiseParallel` / ``RowwiseParallel`` on
``parallel_dims.get_mesh("tp")`` instead, and clears its ``ShardingConfig`` so that torchtitan's
``Module.parallelize`` leaves it alone; the same parameters (``Shard(0)`` / ``Shard(1)`` DTensors on
the TP mesh), the same outputs. With sequence parallelism the attention and feed-forward blocks whose
column-parallel inputs were all substituted stop all-gathering their input (the contract of
torchtitan's own dist-GEMM blocks: the sequence shard goes into the projections), so the gather
runs in commopt's all-gather-matmul ring (``wq``/``wk``/``wv`` and ``w1``/``w3`` share one ring),
and ``wo`` / ``w2`` reduce-scatter in the matmul-reduce-scatter ring (matmul-all-reduce without
sequence parallelism). Everything else (embedding, norms, ``lm_head`` and loss parallelism, RoPE,
attention) stays torchtitan's. Only this model instance's configs are changed, before torchtitan's
function sees it: no module global of torchtitan's is swapped, so concurrent calls cannot interfere.
At TP degree 1 the option does nothing. It needs ``--parallelism.spmd_backend partial_dtensor``
(activations are DTensors on the TP mesh; torchtitan's default ``spmd_types`` backend passes plain
tensors, ``full_dtensor`` multi-dimensional ones) and refuses ``--compile.enable_async_tensor_parallel``
(async TP pipelines the same collectives with the matmuls inside the compiled graph: use one of the
two). It is not tested under ``torch.compile``. With FSDP over the TP mesh's complement (TP and
``data_parallel_shard_degree`` > 1 together) commopt's FSDP comms refuse the strided mesh
(``TopologyError``): pass ``comms=None`` to keep FSDP2's own collectives and only the TP styles.

Needs torchtitan (``pip install torchtitan``; see docs/frameworks.md for a CPU-only torch); imported only
when this module is.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Callable

from torch import nn
from torch.distributed.tensor import Partial, Replicate, Shard
from torch.distributed.tensor.parallel import parallelize_module

from ...schedules.tensor_parallel import ColwiseParallel, RowwiseParallel
from ..compression import QuantizeCompressor
from ..fsdp import AllGatherComm, Comms, ReduceScatterComm, register
from ..topology import Topology

try:
    import torchtitan as _torchtitan  # noqa: F401 - the framework this adapter serves
except ImportError:
    raise ImportError("commopt.comm.integrations.torchtitan needs torchtitan: pip install torchtitan "
                      "(see docs/frameworks.md, 'With torchtitan', for a CPU-only torch)") from None

__all__ = ["parallelize", "Parallelize", "COMMS"]

COMMS = ("exact", "zero++", None)


class Parallelize:
    """A ``ModelSpec.parallelize_fn``: torchtitan's function, then commopt's FSDP2 comms registered.

    Args:
        parallelize_fn: torchtitan's parallelize function (``parallelize_llama``, or
            ``config.model_spec.parallelize_fn``); called with the arguments torchtitan passes.
        comms: ``"exact"`` (hierarchical reduce-scatter and all-gather, native FSDP2's gradients),
            ``"zero++"`` (qgZ int4 gradients with error feedback, qwZ int8 weights), or None (FSDP2's
            own collectives; only with ``tensor_parallel``).
        topology: a spec (``"2x4"``), a :class:`~commopt.comm.Topology`, or None (detected when the
            function runs, after torchtitan has initialised the process group).
        algorithm: the exact comms' algorithm (``"hierarchical"``, ``"auto"``, ``"flat"``); the
            ZeRO++ comms use ``"auto"`` unless another is given.
        error_feedback: the ZeRO++ gradients' error feedback.
        timeout: seconds every call may take before ``CommTimeoutError`` (None: no limit of commopt's own).
        tensor_parallel: torchtitan's TP plan run by commopt's
            :class:`~commopt.schedules.tensor_parallel.ColwiseParallel` / ``RowwiseParallel`` (module
            docstring). Off by default: it replaces torchtitan's TP forward (the exact same math,
            its fp32 sums in ring order), needs the ``partial_dtensor`` backend, which is not
            torchtitan 0.3.0's default, and leaves configurations that worked before unchanged. A
            no-op at TP degree 1. True or ``"auto"``: each Linear runs the ring only where it predicts
            faster than torch's collective (the styles' ``algorithm="auto"``); ``"ring"``: always.

    Attributes:
        comms: the :class:`~commopt.comm.fsdp.Comms` registered by each call, in call order (one per
            pipeline stage; one without pipeline parallelism); none with ``comms=None``.
        tp_plans: per call, ``{module name: "colwise" | "rowwise" | "sequence-sharded input"}``: the
            Linears given commopt's styles and the blocks that stopped all-gathering their input
            (empty with ``tensor_parallel`` off or at TP degree 1).

    Raises:
        ValueError: at construction, an unknown ``comms``, or ``comms=None`` without
            ``tensor_parallel``; when called, ``parallelize_fn`` returned a model without FSDP
            modules (``fully_shard`` was not applied) or ``register`` refused it; with
            ``tensor_parallel`` at TP degree > 1, another ``spmd_backend`` than ``partial_dtensor``,
            async TP, or a model with no column- or row-parallel Linear to substitute.
        TypeError: at construction, ``parallelize_fn`` is not callable or ``topology`` of another
            type; with ``tensor_parallel``, a call without torchtitan's ``parallel_dims``.
        TopologyError: when called, the FSDP mesh is not the topology's (FSDP composed with tensor or
            context parallelism on a strided sub-mesh; ``comms=None`` skips the FSDP comms).
    """

    def __init__(self, parallelize_fn: Callable[..., nn.Module], *, comms: str = "exact",
                 topology: str | Topology | None = None, algorithm: str | None = None, error_feedback: bool = True,
                 timeout: float | None = None, tensor_parallel: bool | str = False):
        if not callable(parallelize_fn):
            raise TypeError(f"torchtitan.parallelize: parallelize_fn must be torchtitan's parallelize function "
                            f"(e.g. config.model_spec.parallelize_fn), got {type(parallelize_fn).__name__}")
        if comms not in COMMS:
            raise ValueError(f"torchtitan.parallelize: comms must be one of {COMMS}, got {comms!r}")
        if not isinstance(tensor_parallel, bool) and tensor_parallel not in ("auto", "ring"):
            raise TypeError(f"torchtitan.parallelize: tensor_parallel must be True, False, 'auto' or 'ring', got "
                            f"{type(tensor_parallel).__name__} {tensor_parallel!r}")
        if comms is None and not tensor_parallel:
            raise ValueError("torchtitan.parallelize: comms=None (FSDP2's own collectives) with tensor_parallel=False "
                             "leaves nothing for commopt to do; pass comms='exact' or tensor_parallel=True")
        if topology is not None and not isinstance(topology, (str, Topology)):
            raise TypeError(f"torchtitan.parallelize: topology must be a spec such as '2x4', a Topology or None "
                            f"(detected), got {type(topology).__name__} {topology!r}")
        self.parallelize_fn = parallelize_fn
        self.comms_kind = comms
        self.topology = topology
        self.algorithm = algorithm if algorithm is not None else ("hierarchical" if comms == "exact" else "auto")
        self.error_feedback = error_feedback
        self.timeout = timeout
        self.tensor_parallel = tensor_parallel
        self.comms: list[Comms] = []
        self.tp_plans: list[dict[str, str]] = []
        # Name, docstring and __wrapped__ only: merging parallelize_fn's __dict__ would overwrite these
        # attributes when it is itself a Parallelize.
        functools.update_wrapper(self, parallelize_fn, updated=())

    def __call__(self, model: nn.Module, **kwargs) -> nn.Module:
        algorithm = "auto" if self.tensor_parallel is True else self.tensor_parallel
        plan = _substitute_tp(model, kwargs, algorithm) if self.tensor_parallel else {}
        model = self.parallelize_fn(model, **kwargs)
        self.tp_plans.append(plan)
        if self.comms_kind is not None:
            self.comms.append(self.register(model))
        return model

    def register(self, model: nn.Module) -> Comms:
        """Register this wrapper's comms on ``model`` (already sharded by torchtitan); collective."""
        topo = self._topology()
        if self.comms_kind == "exact":
            rs = ReduceScatterComm(topo, self.algorithm, timeout=self.timeout)
            ag = AllGatherComm(topo, self.algorithm, timeout=self.timeout)
        else:
            rs = ReduceScatterComm(topo, self.algorithm, QuantizeCompressor(4), error_feedback=self.error_feedback,
                                   timeout=self.timeout)
            ag = AllGatherComm(topo, self.algorithm, QuantizeCompressor(8), timeout=self.timeout)
        register(model, reduce_scatter=rs, all_gather=ag)
        return Comms(reduce_scatter=rs, all_gather=ag)

    def _topology(self) -> Topology | None:
        if isinstance(self.topology, str):
            return Topology.from_spec(self.topology)
        return self.topology  # None: each comm detects it (collectively, the same on every rank)

    def link_bytes(self) -> float:
        """Bytes the busiest node link carried (one direction) in every registered comm's calls."""
        return sum(c.link_bytes() for c in self.comms)

    def __repr__(self) -> str:
        name = getattr(self.parallelize_fn, "__qualname__", repr(self.parallelize_fn))
        return (f"Parallelize({name}, comms={self.comms_kind!r}, topology={self.topology!r}, "
                f"algorithm={self.algorithm!r}, tensor_parallel={self.tensor_parallel})")


def parallelize(parallelize_fn: Callable[..., nn.Module], *, comms: str = "exact",
                topology: str | Topology | None = None, algorithm: str | None = None, error_feedback: bool = True,
                timeout: float | None = None, tensor_parallel: bool = False) -> Parallelize:
    """``parallelize_fn`` followed by commopt's FSDP2 comms: a drop-in ``ModelSpec.parallelize_fn``.

    ``config.model_spec.parallelize_fn = parallelize(config.model_spec.parallelize_fn)``; the
    arguments are :class:`Parallelize`'s (``tensor_parallel=True``: torchtitan's TP plan on
    commopt's tensor-parallel styles as well).
    """
    return Parallelize(parallelize_fn, comms=comms, topology=topology, algorithm=algorithm,
                       error_feedback=error_feedback, timeout=timeout, tensor_parallel=tensor_parallel)


# --------------------------------------------------------------------------------- tensor parallelism
_WHERE = "torchtitan.parallelize(tensor_parallel=True)"


def _substitute_tp(model: nn.Module, kwargs: dict, algorithm: str = "auto") -> dict[str, str]:
    """Give ``model``'s column- and row-parallel Linears commopt's styles on the TP mesh, before
    torchtitan's parallelize function applies the rest of its plan (module docstring); the plan."""
    dims = kwargs.get("parallel_dims")
    if dims is None:
        raise TypeError(f"{_WHERE}: the parallelize function was called without torchtitan's parallel_dims "
                        f"keyword; tensor_parallel serves torchtitan's parallelize functions (parallelize_llama)")
    if getattr(dims, "tp", 1) <= 1:
        return {}
    backend = getattr(kwargs.get("parallelism"), "spmd_backend", None)
    if backend != "partial_dtensor":
        raise ValueError(f"{_WHERE}: needs --parallelism.spmd_backend partial_dtensor (activations as DTensors on "
                         f"the TP mesh, which commopt's styles take), got {backend!r}; or pass "
                         f"tensor_parallel=False for torchtitan's own TP")
    if getattr(kwargs.get("compile_config"), "enable_async_tensor_parallel", False):
        raise ValueError(f"{_WHERE}: --compile.enable_async_tensor_parallel pipelines the same TP collectives with "
                         f"the matmuls inside the compiled graph; commopt's rings replace them: use one of the two")
    from torchtitan.protocols.sharding import resolve_placements

    mesh = dims.get_mesh("tp")

    def placement(layout):
        if layout is None or isinstance(layout, tuple):
            return None
        try:
            (p,) = resolve_placements(layout, mesh)
        except (ValueError, KeyError, TypeError, AttributeError):
            return None
        return p

    plan: dict[str, str] = {}
    for name, module in model.named_modules():
        cfg = getattr(module, "_sharding_config", None)
        if (cfg is None or not isinstance(module, nn.Linear) or type(module).forward is not nn.Linear.forward
                or cfg.local_map is not None or cfg.in_src_shardings or cfg.in_dst_shardings):
            continue  # not a plain Linear, or one whose declared inputs torchtitan redistributes itself
        states = cfg.state_shardings or {}
        weight, out_src, out_dst = (placement(states.get("weight")), placement(cfg.out_src_shardings),
                                    placement(cfg.out_dst_shardings))
        bias = placement(states.get("bias")) if module.bias is not None else None
        if (weight == Shard(0) and _is_last_shard(out_src, 3) and cfg.out_dst_shardings is None
                and bias in (None, Shard(0))):
            style = ColwiseParallel(use_local_output=False, algorithm=algorithm)  # output Shard(-1), a DTensor
        elif (weight == Shard(1) and isinstance(out_src, Partial) and out_dst in (Shard(1), Replicate())
              and bias in (None, Replicate())):
            style = RowwiseParallel(output_layouts=out_dst, use_local_output=False, algorithm=algorithm)
        else:
            continue
        parallelize_module(module, mesh, style)
        module._sharding_config = None  # torchtitan's Module.parallelize now skips it
        plan[name] = "colwise" if isinstance(style, ColwiseParallel) else "rowwise"
    if not plan:
        raise ValueError(f"{_WHERE}: found no Linear whose sharding_config is column- or row-parallel on the TP mesh "
                         f"(torchtitan's colwise_config / rowwise_config); this model's TP plan is not one commopt's "
                         f"styles can run: pass tensor_parallel=False")
    for name, module in model.named_modules():
        key = _gathered_input(module, plan, name)
        if key is None:
            continue
        cfg = module._sharding_config
        if (placement(cfg.in_src_shardings.get(key)) == Shard(1)
                and placement(cfg.in_dst_shardings.get(key)) == Replicate()):
            rest = {k: v for k, v in cfg.in_dst_shardings.items() if k != key}
            module._sharding_config = dataclasses.replace(cfg, in_dst_shardings=rest or None)
            plan[name] = "sequence-sharded input"
    return plan


def _is_last_shard(p, ndim: int) -> bool:
    return isinstance(p, Shard) and p.dim in (-1, ndim - 1)


def _gathered_input(module: nn.Module, plan: dict[str, str], name: str) -> str | None:
    """The input that ``module`` (torchtitan's attention or feed-forward block, with its own forward)
    hands only to Linears now column-parallel under commopt's style, or None."""
    cfg = getattr(module, "_sharding_config", None)
    if cfg is None or cfg.local_map is not None or not cfg.in_src_shardings or not cfg.in_dst_shardings:
        return None
    from torchtitan.models.common.attention import FusedQKVLinear, GQAttention, QKVLinear
    from torchtitan.models.common.feed_forward import FeedForward

    prefix = f"{name}." if name else ""
    if type(module).forward is GQAttention.forward:
        qkv = module.qkv_linear
        if type(qkv).forward is FusedQKVLinear.forward:
            linears = ["qkv_linear.wqkv"]
        elif type(qkv).forward is QKVLinear.forward:
            linears = ["qkv_linear.wq", "qkv_linear.wk", "qkv_linear.wv"]
        else:
            return None
        key = "x_BLD"
    elif type(module).forward is FeedForward.forward:
        linears, key = ["w1", "w3"], "x"
    else:
        return None
    return key if all(plan.get(prefix + lin) == "colwise" for lin in linears) else None
