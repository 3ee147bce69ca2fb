"""Tensor and sequence parallelism whose collectives overlap the matmuls they feed (docs/architecture.md
sections 3 and 5.1; fault cases in docs/faults.md row 39).

Under tensor + sequence parallelism every transformer block all-gathers its activations before the
column-parallel matmuls and reduce-scatters after the row-parallel ones, and nothing computes while
those collectives run. The primitives here (from :mod:`commopt.schedules._decomposed`) split each
collective into the ``P - 1`` point-to-point steps of a ring over the group and the matmul into the
matching pieces, so that step k's transfer runs while piece k is multiplied ("decomposition-based"
overlap: Wang et al., ASPLOS '23; Flux; T3): :func:`all_gather_matmul`, :func:`matmul_reduce_scatter`
and :func:`matmul_all_reduce`, autograd decomposed the same way.

Drop-in styles for torch's ``parallelize_module`` (docs/guide.md, "Drop-in styles"):
:class:`ColwiseParallel`, :class:`RowwiseParallel` and :class:`SequenceParallel` subclass torch's,
take its arguments and make its parameters, and may run the rings where a collective meets a matmul:
a column-parallel Linear fed a sequence-sharded input all-gathers it in :func:`all_gather_matmul`, a
row-parallel Linear reduces in :func:`matmul_reduce_scatter` (sharded output) or
:func:`matmul_all_reduce` (replicated output). Every other case runs torch's own code.

**They never lose to torch's styles by choice**: with ``algorithm="auto"`` (the default) each such
Linear predicts, once per input shape, the ring and torch's collective from the group's link and its
matmul's measured time, and runs the ring only where it is predicted faster by more than the
calibration resolves (:mod:`commopt.schedules._tp_choice`); every rank takes the same choice.
``algorithm="ring"`` always runs the ring, ``"torch"`` always torch's path. The agreement check of
what a ring exchanges runs once per module and input shape, not at every forward; ``chunks`` fixes how
many pieces each ring step is cut into (None: by the link). :func:`choices` says what each module ran.

Under ``torch.compile`` (a block parallelized then compiled, or compiled in place with
``block.compile()`` then parallelized) each fused Linear's choice, agreement check, ring and DTensor
wrapping run eagerly outside dynamo's graphs, one graph break at each such module; the norms,
activations and torch's own paths (torch's collective where it was chosen) compile, and the rings'
backward runs in eager autograd between the compiled backward graphs. The results equal the eager
run's and those of torch's styles compiled the same way, to fp32 rounding (tests/test_compile.py). The
gate is ``torch.compiler.is_compiling()`` with a lazy ``torch._dynamo.disable`` (importing this module
does not import ``torch._dynamo``); without it dynamo traced into the comm engine and cut a block into
dozens of graphs, rebuilt on the second step. ``fullgraph=True`` cannot hold a ring: dynamo raises
``Unsupported`` at the first fused Linear, before anything runs.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from functools import partial, wraps
from types import MethodType

import torch
import torch.distributed.tensor.parallel as _torch_tp
import torch.nn.functional as F
from torch import nn
from torch.distributed import ReduceOp
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_module

from ._decomposed import _agree, _matmul_reduce_scatter, all_gather_matmul, matmul_all_reduce, matmul_reduce_scatter
from ._tp_choice import (
    FusedState,
    check_algorithm,
    check_chunks,
    choices,
    chunk_count,
    chunks_for,
    state_of,
)

__all__ = ["all_gather_matmul", "matmul_reduce_scatter", "matmul_all_reduce", "ColwiseParallel", "RowwiseParallel",
           "SequenceParallel", "choices", "chunks_for", "chunk_count"]

_GATHERED = "_commopt_gathered"  # the attribute of an input tensor that keeps its gathered form (ColwiseParallel)


# --------------------------------------------------------------------------------- drop-in styles
class _Choosing:
    """The two arguments the fused styles add to torch's (``algorithm``, ``chunks``), checked at
    construction."""

    def __init__(self, *, algorithm: str = "auto", chunks: int | None = None, **kwargs) -> None:
        super().__init__(**kwargs)
        self.algorithm = check_algorithm(type(self).__name__, algorithm)
        self.chunks = check_chunks(type(self).__name__, chunks)


class ColwiseParallel(_Choosing, _torch_tp.ColwiseParallel):
    """torch's ``ColwiseParallel`` with the all-gather of a sequence-sharded input decomposed into the
    matmul (:func:`all_gather_matmul`); a drop-in for ``parallelize_module`` plans (docs/guide.md,
    "Tensor parallelism").

    The arguments, the parameters and the results are torch's: ``weight`` and ``bias`` become the
    same ``Shard(0)`` DTensors on the mesh (so ``state_dict``, optimizers and FSDP2 on another mesh
    dimension see what they see under torch's style), the output is sharded on its last dimension
    and then laid out as ``output_layouts`` asks, a local tensor when ``use_local_output``.
    What differs is the forward of an ``nn.Linear`` whose input arrives sharded on a leading
    dimension ``d`` (``input_layouts=Shard(1)`` for a local tensor, or a DTensor placed ``Shard(d)``,
    e.g. the output of ``SequenceParallel``): instead of torch's all-gather followed by the matmul,
    :func:`all_gather_matmul` along ``d`` on the mesh's group, each ring step's transfer overlapped
    with the previous block's matmul, the bias (this rank's shard) added after; its backward
    reduce-scatters the input's gradient in the same kind of ring. Several modules that receive the
    same input object (``wq``, ``wk``, ``wv`` after one norm; ``w1``, ``w3``) gather it once: the
    first call keeps the gathered input on the input tensor (while that tensor lives, is not
    modified in place and no backward pass has run through the ring), the others multiply it without
    communicating, and their gradients join the first call's ring in the backward.

    So the fused form of torch's Llama plan passes ``input_layouts=Shard(1)`` here and drops the
    ``PrepareModuleInput(Shard(1) -> Replicate)`` in front of these modules. With that
    ``PrepareModuleInput`` kept (the tutorial's form) the input arrives replicated, the all-gather
    happens there, unfused (torch's, as before), and this style computes what torch's does: a
    replicated input (local or DTensor) always runs torch's own forward.

    Delegated to torch's ``ColwiseParallel`` unchanged: ``nn.Embedding``; an ``nn.Linear`` subclass
    with its own ``forward``; ``input_layouts`` or ``output_layouts`` other than ``Shard`` /
    ``Replicate`` (at ``parallelize_module``); at run time an input sharded on its last dimension,
    or a DTensor input whose sharded dimension does not divide by the mesh size. A local input
    declared ``Shard(d)`` must have the same shape on every rank (torch assumes so too): otherwise
    :func:`all_gather_matmul`'s agreement check raises ``CollectiveMismatchError`` on every rank.

        input_layouts, output_layouts, use_local_output: torch's ``ColwiseParallel`` arguments.
        algorithm: ``"auto"`` (the ring only where it is predicted faster than torch's collective,
            decided once per input shape, the same on every rank), ``"ring"`` or ``"torch"``.
        chunks: pieces each ring step is cut into (None: by the group's link); the same on every rank.

    Raises:
        ValueError, TypeError: at construction, an unknown ``algorithm`` or a bad ``chunks``; at
            ``parallelize_module``, a device mesh that is not 1-D (pass the tensor-parallel sub-mesh,
            ``mesh["tp"]``), or a module that is neither ``nn.Linear`` nor ``nn.Embedding``
            (docs/faults.md row 39).
    """

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        mesh = _tp_mesh("ColwiseParallel", device_mesh)
        if not isinstance(module, (nn.Linear, nn.Embedding)):
            raise ValueError(f"ColwiseParallel: module {type(module).__name__} is neither torch.nn.Linear nor "
                             f"torch.nn.Embedding; shard its Linear submodules instead (a plan entry for each)")
        if (not _fusable(module) or not _simple(self.input_layouts[0])
                or not _simple(self.output_layouts[0])):
            return super()._apply(module, mesh)
        distribute_module(module, mesh, self._partition_linear_fn)
        state = state_of(module, self.algorithm, self.chunks)
        module.forward = MethodType(partial(_colwise_forward, self, mesh, state), module)
        return module


class RowwiseParallel(_Choosing, _torch_tp.RowwiseParallel):
    """torch's ``RowwiseParallel`` with the reduction of the partial products decomposed into the
    matmul; a drop-in for ``parallelize_module`` plans (docs/guide.md, "Tensor parallelism").

    The arguments, the parameters (``weight`` a ``Shard(1)`` DTensor, ``bias`` a replicated one) and
    the results are torch's. For an ``nn.Linear`` whose input arrives sharded on its last dimension
    (the default: the output of a ``ColwiseParallel``):

    - ``output_layouts=Shard(d)`` (sequence parallelism, ``Shard(1)`` in torch's Llama plan), ``d`` a
      leading dimension: :func:`matmul_reduce_scatter` along ``d`` on the mesh's group instead of
      torch's matmul + reduce-scatter; its backward is an all-gather-matmul ring of the gradient.
    - ``output_layouts=Replicate()`` (the default): :func:`matmul_all_reduce`; its backward is local,
      as torch's is.

    The bias is added once, after the reduction, as in torch; under ``Shard(d)`` its gradient is
    summed from the gradient the backward's ring gathers (replicated, as torch's, with no collective
    of its own).

    Delegated to torch's ``RowwiseParallel`` unchanged: ``nn.Embedding``; an ``nn.Linear`` subclass
    with its own ``forward``; ``input_layouts`` or ``output_layouts`` other than ``Shard`` /
    ``Replicate``; at run time an input that is not sharded on its last dimension (e.g. a replicated
    DTensor), an output sharded on its last dimension, or a scatter dimension whose size does not
    divide by the mesh size (torch pads it).

        input_layouts, output_layouts, use_local_output: torch's ``RowwiseParallel`` arguments.
        algorithm: ``"auto"`` (the ring only where it is predicted faster than torch's collective,
            decided once per input shape, the same on every rank), ``"ring"`` or ``"torch"``.
        chunks: pieces each ring step is cut into (None: by the group's link); the same on every rank.

    Raises:
        ValueError, TypeError: at construction, an unknown ``algorithm`` or a bad ``chunks``; at
            ``parallelize_module``, a device mesh that is not 1-D (pass the tensor-parallel sub-mesh,
            ``mesh["tp"]``), or a module that is neither ``nn.Linear`` nor ``nn.Embedding``
            (docs/faults.md row 39).
    """

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        mesh = _tp_mesh("RowwiseParallel", device_mesh)
        if not isinstance(module, (nn.Linear, nn.Embedding)):
            raise ValueError(f"RowwiseParallel: module {type(module).__name__} is neither torch.nn.Linear nor "
                             f"torch.nn.Embedding; shard its Linear submodules instead (a plan entry for each)")
        if (not _fusable(module) or not _simple(self.input_layouts[0])
                or not _simple(self.output_layouts[0])):
            return super()._apply(module, mesh)
        self.desired_input_layouts = (Shard(-1),)  # torch's, for the runs its own forward serves
        distribute_module(module, mesh, self._partition_linear_fn)
        state = state_of(module, self.algorithm, self.chunks)
        module.forward = MethodType(partial(_rowwise_forward, self, mesh, state), module)
        return module


class SequenceParallel(_torch_tp.SequenceParallel):
    """torch's ``SequenceParallel`` (``sequence_dim=1, use_local_output=False``), unchanged but for
    the mesh check: norms and dropout run on this rank's block of the sequence, their parameters
    replicated. It has no matmul to fuse: the all-gather after it is fused by a
    :class:`ColwiseParallel` that takes its output with ``input_layouts=Shard(1)`` (the DTensor it
    returns is placed ``Shard(sequence_dim)``), and the reduce-scatter before it by a
    :class:`RowwiseParallel` with ``output_layouts=Shard(1)`` (docs/guide.md, "Tensor parallelism").

    Raises:
        ValueError: at ``parallelize_module``, a device mesh that is not 1-D (docs/faults.md row 39).
    """

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        return super()._apply(module, _tp_mesh("SequenceParallel", device_mesh))


def _tp_mesh(style: str, device_mesh) -> DeviceMesh:
    """The 1-D tensor-parallel mesh the style was applied on; its group is the ring's."""
    if not isinstance(device_mesh, DeviceMesh):
        raise ValueError(f"{style}: device_mesh must be a torch.distributed DeviceMesh, got "
                         f"{type(device_mesh).__name__}; pass the 1-D tensor-parallel mesh to parallelize_module")
    if device_mesh.ndim != 1:
        names = f" named {device_mesh.mesh_dim_names}" if device_mesh.mesh_dim_names else ""
        raise ValueError(f"{style}: device_mesh has {device_mesh.ndim} dimensions{names} (shape "
                         f"{tuple(device_mesh.shape)}); tensor parallelism runs on one: pass its 1-D sub-mesh, "
                         f"e.g. mesh['tp'], and compose the other dimension separately (fully_shard(..., "
                         f"mesh=mesh['dp']))")
    return device_mesh


def _fusable(module: nn.Module) -> bool:
    """A plain ``nn.Linear`` forward (a subclass with a forward of its own keeps torch's hooks)."""
    return isinstance(module, nn.Linear) and type(module).forward is nn.Linear.forward


def _simple(placement) -> bool:
    return type(placement) in (Shard, Replicate)


def _shard_dim(placement, ndim: int) -> int | None:
    """The normalised dimension of a plain ``Shard`` placement valid for ``ndim``, else None."""
    if type(placement) is not Shard or not -ndim <= placement.dim < ndim:
        return None
    return placement.dim % ndim


def _contiguous_stride(shape: Sequence[int]) -> tuple[int, ...]:
    stride, acc = [], 1
    for n in reversed(shape):
        stride.append(acc)
        acc *= max(n, 1)
    return tuple(reversed(stride))


def _as_dtensor(local: torch.Tensor, mesh: DeviceMesh, placement, shape: list[int]) -> DTensor:
    return DTensor.from_local(local, mesh, (placement,), run_check=False, shape=torch.Size(shape),
                              stride=_contiguous_stride(shape))


def _outside_graphs(fn: Callable) -> Callable:
    """``fn`` run as it is, and under torch.compile outside dynamo's graphs (module docstring): one
    graph break where it is called, its body and everything it calls eager. The gate is
    ``torch.compiler.is_compiling()`` (a constant to dynamo; eagerly ``fn`` is called directly) and
    ``torch._disable_dynamo`` (torch's ``torch._dynamo.disable`` that imports ``torch._dynamo`` at its
    first call, not here: that import costs seconds)."""
    disabled = torch._disable_dynamo(fn)

    @wraps(fn)
    def call(*args, **kwargs):
        if torch.compiler.is_compiling():
            return disabled(*args, **kwargs)
        return fn(*args, **kwargs)

    return call


def _colwise_forward(style: ColwiseParallel, mesh: DeviceMesh, state: FusedState, module: nn.Linear,
                     x: torch.Tensor):
    """The forward of a Linear under :class:`ColwiseParallel` (installed as the module's ``forward``)."""
    is_dt = isinstance(x, DTensor)
    d = _shard_dim(x.placements[0] if is_dt else style.input_layouts[0], x.dim())
    fusable = not (d is None or d == x.dim() - 1 or (is_dt and x.shape[d] % mesh.size()))
    if fusable and (state.algorithm == "ring" or (state.algorithm == "auto"
                                                   and _colwise_choice(mesh, state, module, x, d) == "ring")):
        return _colwise_fused(style, mesh, state, module, x, d)
    if fusable:  # torch's collective chosen: its all-gather, once for the modules handed the same input
        xt = _torch_gather(mesh, x, d)
    else:  # replicated, sharded on the contraction, or uneven: torch's own hooks and DTensor matmul
        xt = _torch_tp.ColwiseParallel._prepare_input_fn(style.input_layouts, style.desired_input_layouts, module,
                                                         (x,), mesh)
    out = F.linear(xt, module.weight, module.bias)
    return _torch_tp.ColwiseParallel._prepare_output_fn(style.output_layouts, style.use_local_output, module, out,
                                                        mesh)


@_outside_graphs
def _torch_gather(mesh: DeviceMesh, x: torch.Tensor, d: int) -> DTensor:
    """torch's all-gather of an input sharded on ``d`` (DTensor's redistribute to ``Replicate``), kept on
    ``x`` like the ring's gather (:func:`_shared_gather_matmul`) for the next module handed the same
    unmodified ``x``, until a backward pass has reached it. Where the ring is not chosen, the modules
    that share an input (``wq``, ``wk``, ``wv``) then gather it once, as torch's own plans do in a
    ``PrepareModuleInput`` in front of them, not once each (what DTensor's matmul of a ``Shard(d)`` input
    would do: 0.88x torch's plan in torchtitan's block, docs/results.md 26)."""
    local = x.to_local() if isinstance(x, DTensor) else x
    kept = _torch_kept(x, local, mesh, d)
    if kept is not None:
        return kept
    key = ("torch", id(mesh), d, local._version, torch.is_grad_enabled())
    dt = x if isinstance(x, DTensor) else DTensor.from_local(x, mesh, (Shard(d),), run_check=False)
    xt = dt.redistribute(placements=(Replicate(),), async_op=True)
    reached: list[bool] = []  # a backward pass consumed the gather's graph: gather anew
    if xt.requires_grad:
        xt.register_hook(lambda g: reached.append(True))
    setattr(x, _GATHERED, (key, xt, reached))
    return xt


def _torch_kept(x: torch.Tensor, local: torch.Tensor, mesh: DeviceMesh, d: int) -> DTensor | None:
    """The gathered form of ``x`` that :func:`_torch_gather` kept for an earlier module, if still valid."""
    kept = getattr(x, _GATHERED, None)
    key = ("torch", id(mesh), d, local._version, torch.is_grad_enabled())
    return kept[1] if kept is not None and kept[0] == key and not kept[2] else None


def _colwise_key(local: torch.Tensor, d: int, weight: torch.Tensor) -> tuple:
    grad = torch.is_grad_enabled() and (local.requires_grad or weight.requires_grad)
    return ("all_gather", tuple(local.shape), str(local.dtype), d, grad)


@_outside_graphs
def _colwise_choice(mesh: DeviceMesh, state: FusedState, module: nn.Linear, x: torch.Tensor, d: int) -> str:
    """``"ring"`` or ``"torch"`` for this input (``algorithm="auto"``): the ring where the gathered form
    of ``x`` is already kept by a module that shared it (no communication at all; torch's where torch's
    gather is kept), else the choice
    for this shape (:meth:`FusedState.choose`, the agreement check first where the shape changed)."""
    group = mesh.get_group()
    local = x.to_local() if isinstance(x, DTensor) else x
    if _kept(x, local, d, group) is not None:
        return "ring"
    if _torch_kept(x, local, mesh, d) is not None:
        return "torch"  # an earlier module gathered it with torch's collective: no communication at all
    w = module.weight.to_local().t()
    key = _colwise_key(local, d, module.weight)
    return state.choose("ColwiseParallel", key, _style_check("ColwiseParallel", key, local, group, state),
                        kind="all_gather", matmul=lambda: torch.matmul(local.detach(), w.detach()),
                        scale=mesh.size(), block_bytes=local.numel() * local.element_size(),
                        rows=max(1, local.numel() // max(1, local.shape[-1])), group=group, device=local.device)


def _style_check(name: str, key: tuple, t: torch.Tensor, group, state: FusedState) -> Callable[[], None]:
    """The agreement check a style runs where a module's input key changed (``_tp_choice``): the
    primitives' check (``_decomposed._agree``) over the key (what the ring exchanges, and whether its
    backward runs) and ``chunks``, waited for."""
    what = ("the input's shape and dtype, the dimension it is sharded on and whether a gradient flows back "
            "(the backward's ring)")
    return lambda: _agree(name, key[0], t, key, group, None, op="none", chunks=state.chunks, what=what)()


@_outside_graphs
def _colwise_fused(style: ColwiseParallel, mesh: DeviceMesh, state: FusedState, module: nn.Linear,
                   x: torch.Tensor, d: int):
    """:func:`_colwise_forward` for an input sharded on the leading dimension ``d``: the ring."""
    size, group = mesh.size(), mesh.get_group()
    local = x.to_local() if isinstance(x, DTensor) else x
    y = _shared_gather_matmul(x, local, d, module.weight, group, state)
    if module.bias is not None:
        y = y + module.bias.to_local()  # this rank's columns
    last = y.dim() - 1
    out_layout = style.output_layouts[0]
    if style.use_local_output and _shard_dim(out_layout, y.dim()) == last:
        return y  # torch's from_local + to_local: the same tensor, the same gradient
    shape = list(local.shape[:-1]) + [module.out_features]
    shape[d] *= size
    out = _as_dtensor(y, mesh, Shard(last), shape)
    return _torch_tp.ColwiseParallel._prepare_output_fn(style.output_layouts, style.use_local_output, module, out,
                                                        mesh)


def _kept(x: torch.Tensor, local: torch.Tensor, d: int, group) -> torch.Tensor | None:
    """The gathered form of ``local`` that an earlier module kept on ``x`` and that is still valid."""
    kept = getattr(x, _GATHERED, None)
    key = ("ring", group, d, local._version, torch.is_grad_enabled())
    if kept is not None and kept[0] == key and not getattr(kept[1].grad_fn, "ran", False):
        return kept[1]
    return None


def _shared_gather_matmul(x: torch.Tensor, local: torch.Tensor, d: int, weight, group,
                          state: FusedState) -> torch.Tensor:
    """``all_gather(local) @ weight.T``, the gathered input kept on ``x`` (the object the module
    received) for the next module handed the same unmodified ``x`` on the same group and dimension,
    which then multiplies it without communicating, until a backward pass has run through the ring
    that gathered it (its graph is then freed: an input reused across steps is gathered again). Which
    modules share is decided by the program (the same object reaching them), not by a local value,
    so every rank runs the same rings. The ring's agreement check runs where this module's input key
    changed (``state``)."""
    b = weight.to_local().t()
    gathered = _kept(x, local, d, group)
    if gathered is not None:
        return torch.matmul(gathered, b)
    key = _colwise_key(local, d, weight)
    state.check(key, _style_check("ColwiseParallel", key, local, group, state))
    gathered, (y,) = all_gather_matmul(local, [b], gather_dim=d, group=group, return_a=True, chunks=state.chunks,
                                       agreement=False)
    setattr(x, _GATHERED, (("ring", group, d, local._version, torch.is_grad_enabled()), gathered))
    return y


def _rowwise_forward(style: RowwiseParallel, mesh: DeviceMesh, state: FusedState, module: nn.Linear,
                     x: torch.Tensor):
    """The forward of a Linear under :class:`RowwiseParallel` (installed as the module's ``forward``)."""
    size = mesh.size()
    is_dt = isinstance(x, DTensor)
    nd = x.dim()
    out_layout = style.output_layouts[0]
    d = _shard_dim(out_layout, nd)
    fused = _shard_dim(x.placements[0] if is_dt else style.input_layouts[0], nd) == nd - 1
    if not isinstance(out_layout, Replicate) and (d is None or d == nd - 1 or x.shape[d] % size):
        fused = False  # scattered on the last dimension, or unevenly: torch's (padded) reduce-scatter
    if fused and (state.algorithm == "ring" or (state.algorithm == "auto"
                                                 and _rowwise_choice(style, mesh, state, module, x, d) == "ring")):
        return _rowwise_fused(style, mesh, state, module, x, d)
    # An input not sharded on the contraction (e.g. replicated), or torch's collective chosen: torch's
    # hooks and DTensor matmul.
    xt = _torch_tp.RowwiseParallel._prepare_input_fn(style.input_layouts, style.desired_input_layouts, module,
                                                     (x,), mesh)
    out = F.linear(xt, module.weight, module.bias)
    return _torch_tp.RowwiseParallel._prepare_output_fn(style.output_layouts, style.use_local_output, module, out,
                                                        mesh)


def _rowwise_key(style: RowwiseParallel, local: torch.Tensor, module: nn.Linear, d: int | None) -> tuple:
    kind = "all_reduce" if isinstance(style.output_layouts[0], Replicate) else "reduce_scatter"
    grad = torch.is_grad_enabled() and any(t is not None and t.requires_grad
                                           for t in (local, module.weight, module.bias))
    return (kind, tuple(local.shape), str(local.dtype), module.out_features, d, grad)


@_outside_graphs
def _rowwise_choice(style: RowwiseParallel, mesh: DeviceMesh, state: FusedState, module: nn.Linear,
                    x: torch.Tensor, d: int | None) -> str:
    """``"ring"`` or ``"torch"`` for this input (``algorithm="auto"``, :meth:`FusedState.choose`)."""
    group, size = mesh.get_group(), mesh.size()
    local = x.to_local() if isinstance(x, DTensor) else x
    w = module.weight.to_local().t()
    key = _rowwise_key(style, local, module, d)
    rows = max(1, local.numel() // max(1, local.shape[-1]))
    out_bytes = rows * module.out_features * local.element_size()
    return state.choose("RowwiseParallel", key, _style_check("RowwiseParallel", key, local, group, state),
                        kind=key[0], matmul=lambda: torch.matmul(local.detach(), w.detach()), scale=1,
                        block_bytes=out_bytes / size, rows=max(1, rows // size), group=group, device=local.device)


@_outside_graphs
def _rowwise_fused(style: RowwiseParallel, mesh: DeviceMesh, state: FusedState, module: nn.Linear,
                   x: torch.Tensor, d: int | None):
    """:func:`_rowwise_forward` for an input sharded on its last dimension: the ring."""
    size, group = mesh.size(), mesh.get_group()
    out_layout = style.output_layouts[0]
    local = x.to_local() if isinstance(x, DTensor) else x
    w = module.weight.to_local().t()
    bias = module.bias.to_local() if module.bias is not None else None
    key = _rowwise_key(style, local, module, d)
    state.check(key, _style_check("RowwiseParallel", key, local, group, state))
    if isinstance(out_layout, Replicate):
        y = matmul_all_reduce(local, w, group=group, chunks=state.chunks, agreement=False)
        if bias is not None:
            y = y + bias  # once, after the reduction; its gradient is the replicated one's sum
        placement, shape = Replicate(), list(y.shape)
    else:
        y = _matmul_reduce_scatter("RowwiseParallel", local, w, bias, d, group, ReduceOp.SUM, None, state.chunks,
                                   agreement=False)
        placement, shape = Shard(d), list(y.shape)
        shape[d] *= size
    return y if style.use_local_output else _as_dtensor(y, mesh, placement, shape)
