"""``register``: commopt's comms on every FSDP module of a tree, validated first; ``shard`` and
``shard_hsdp``: a model sharded with the ZeRO++ recipe or as compressed HSDP in one call.

``register`` checks everything on every rank before it sets anything (docs/faults.md row 33): a module with more
than one parameter group (torch's custom comms serve one), a mesh that is not the topology's (FSDP
sharding over ranks that are neither the topology's group nor one node; for the HSDP hook, not this
rank's node), a topology the algorithm cannot run on (``hierarchical`` on 2+1), a compressor that
cannot serve the collective (``TypeError`` at the comm's construction, or here for a bare
compressor), ranks that disagree on the model or the comms. The ranks agree on the verdict with one
small all-gather, so a problem found on one rank is an error on every rank, before any training
step. Then every process group and the cost model the comms need are created, collectively, and
one view of each comm is bound to every module (its parameters' names and padded shard sizes).
"""

from __future__ import annotations

import hashlib
import math
import warnings
from dataclasses import dataclass, field
from functools import partial
from typing import Callable

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

from .. import algorithms, cost
from ..algorithms.roles import FSDP_CHECK, FSDP_HSDP_ROLES, FSDP_QRS_FLAT, FSDP_QRS_INTRA, FSDP_QRS_RAIL
from ..compression import Compressor, QuantizeCompressor
from ..engine import wait_work
from ..errors import TopologyError
from ..runtime import align_timeout, context
from ..topology import Topology
from ._common import NATIVE, Bound, Layout
from .all_gather import AllGatherComm
from .hsdp import AllReduceHook
from .reduce_scatter import ReduceScatterComm

__all__ = ["register", "shard", "shard_hsdp", "Comms", "AUTO", "AUTO_MARGIN", "NATIVE"]

AUTO = "auto"
#: The labels of ``shard``'s choice per part (``Comms.recipe``): FSDP2's own, commopt's exact, compressed.
_LABELS = {"weights": (NATIVE, "exact", "int8"), "gradients": (NATIVE, "exact", "int4")}
#: ``shard``'s ``"auto"`` takes a compressed collective when it measured at most this share of the exact one's time.
AUTO_MARGIN = 0.9

_WHERE = "fsdp.register"


@dataclass
class Comms:
    """The comms :func:`shard` / :func:`shard_hsdp` registered; checkpoint them with the model."""

    reduce_scatter: ReduceScatterComm | None = None
    all_gather: AllGatherComm | None = None
    all_reduce: AllReduceHook | None = None
    #: ``shard``'s decision where a part was ``"auto"``: ``{"weights": "native" | "exact" | "int8",
    #: "gradients": "native" | "exact" | "int4", "hpz": bool, "seconds": {"weights/native": s, ...}}``,
    #: else None.
    recipe: dict | None = None
    #: ``shard``'s way back to a saved recipe (:meth:`load_state_dict`); None for ``shard_hsdp``.
    _restore: Callable[[Comms, dict], None] | None = field(default=None, repr=False, compare=False)

    def _stateful(self) -> dict:
        return {k: v for k, v in (("reduce_scatter", self.reduce_scatter), ("all_reduce", self.all_reduce))
                if v is not None}

    def state_dict(self) -> dict:
        """Error-feedback residuals per parameter name, and ``shard``'s ``"auto"`` choice (``"recipe"``:
        the labels of :attr:`recipe` and hpZ), so that a resumed run trains with the comms of the run it
        resumes; ``torch.load(weights_only=True)`` loads it."""
        out = {k: v.state_dict() for k, v in self._stateful().items()}
        if self.recipe is not None:
            out["recipe"] = {k: self.recipe[k] for k in (*_LABELS, "hpz") if k in self.recipe}
        return out

    def load_state_dict(self, state: dict) -> None:
        """Restore :meth:`state_dict`: first ``shard``'s saved choice (a part this ``shard`` decided
        differently, timing this run's cluster again, is registered again with the saved comm, on every
        module: collective, call it on every rank, as the resume path does after ``shard``), then the
        residuals. A resumed run is then bit-identical to the uninterrupted one on CPU.

        Raises:
            ValueError: the checkpoint's residuals were taken with other settings (see
                ``ReduceScatterComm.load_state_dict``), or its recipe cannot be restored (another hpZ
                setting, an unknown label).
        """
        if not isinstance(state, dict):
            raise TypeError(f"Comms.load_state_dict: state must be the dict of Comms.state_dict(), got "
                            f"{type(state).__name__}")
        saved = state.get("recipe")
        if saved is not None and self._restore is not None:
            self._restore(self, saved)
        for k, v in self._stateful().items():
            if k in state:
                v.load_state_dict(state[k])

    def link_bytes(self) -> float:
        """Bytes the busiest node link carried (one direction) in all calls so far."""
        return sum(c.link_bytes() for c in (self.reduce_scatter, self.all_gather, self.all_reduce) if c is not None)

    def reset_link_bytes(self) -> None:
        for c in (self.reduce_scatter, self.all_gather, self.all_reduce):
            if c is not None:
                c.reset_link_bytes()


# --------------------------------------------------------------------------------- register
def register(fsdp_module: nn.Module, *, reduce_scatter: ReduceScatterComm | None = None,
             all_gather: AllGatherComm | None = None, all_reduce: AllReduceHook | None = None) -> None:
    """Set commopt's comms on every FSDP module of the tree rooted at ``fsdp_module``.

    Call it on every rank after ``fully_shard`` and before the first step::

        fsdp.register(model, reduce_scatter=fsdp.ReduceScatterComm(algorithm="hierarchical"),
                      all_gather=fsdp.AllGatherComm(algorithm="hierarchical"))

    Args:
        fsdp_module: the root of ``fully_shard``-ed modules.
        reduce_scatter: the gradient reduce-scatter (``set_custom_reduce_scatter``).
        all_gather: the parameter all-gather (``set_custom_all_gather``).
        all_reduce: the compressed HSDP hook (``set_all_reduce_hook``), for 1-D FSDP over each node.

    Raises:
        TypeError: an argument of the wrong type (a bare compressor: wrap it in a comm).
        ValueError: a module with more than one parameter group, or ranks that disagree on the model
            or the comms; on every rank, before anything is set.
        TopologyError: a mesh that is not the topology's, or a topology the comm cannot run on; on
            every rank, before anything is set.
    """
    _check_types(fsdp_module, reduce_scatter, all_gather, all_reduce)
    comms = [c for c in (reduce_scatter, all_gather, all_reduce) if c is not None]
    topos = [c.resolve() for c in comms]  # detection is collective: the same order on every rank
    topo = topos[0]
    problems: list[tuple[type, str]] = []
    if any(t.layout != topo.layout for t in topos):
        problems.append((TopologyError, f"the comms were given different topologies "
                                        f"({[t.layout for t in topos]}); give them one"))
    names = {id(p): n for n, p in fsdp_module.named_parameters()}
    plans = []
    for key, module in fsdp_module.named_modules():
        if not isinstance(module, FSDPModule):
            continue
        groups = list(module._get_fsdp_state()._fsdp_param_groups)
        if len(groups) > 1:
            problems.append((ValueError, f"module {key or '<root>'!r} has {len(groups)} parameter groups (per-"
                                         f"parameter meshes from shard_placement_fn); torch's custom comms and "
                                         f"hooks serve one group per module: shard it over one mesh"))
            continue
        if not groups:
            continue
        pg = groups[0]
        layout = Layout(key, tuple(names.get(id(fp.sharded_param), f"{key}.<param{i}>")
                                   for i, fp in enumerate(pg.fsdp_params)),
                        tuple(fp.padded_sharded_param_size.numel() for fp in pg.fsdp_params),
                        tuple(tuple(fp.padded_sharded_param_size) for fp in pg.fsdp_params))
        problems += _check_mesh(key or "<root>", pg, topo, reduce_scatter, all_gather, all_reduce)
        plans.append((module, Bound(layout, pg)))
    for comm in (reduce_scatter, all_gather):
        if comm is not None and comm.algorithm == "hierarchical" and not topo.is_uniform:
            problems.append((TopologyError, f"{comm.where}(algorithm='hierarchical') needs nodes of equal size, "
                                            f"got {[len(n) for n in topo.nodes]} ({topo.layout}); use "
                                            f"algorithm='auto', which falls back to flat there"))
    if all_reduce is not None and not topo.is_uniform:
        problems.append((TopologyError, f"AllReduceHook (HSDP) needs nodes of equal size, got "
                                        f"{[len(n) for n in topo.nodes]} ({topo.layout})"))
    fingerprint = repr([topo.layout] + [repr(c) for c in comms] + [(b.layout.key, b.layout.numels) for _, b in plans])
    timeouts = [c.timeout for c in comms]
    _agree(problems, fingerprint, None if None in timeouts else max(timeouts))
    _prepare(topo, reduce_scatter, all_gather, all_reduce)
    for module, bound in plans:
        if reduce_scatter is not None:
            module.set_custom_reduce_scatter(reduce_scatter.bind(bound))
        if all_gather is not None:
            module.set_custom_all_gather(all_gather.bind(bound))
        if all_reduce is not None:
            module.set_all_reduce_hook(all_reduce.bind(bound))
        keyed = ((reduce_scatter is not None and reduce_scatter.compressor is not None)
                 or (all_reduce is not None and all_reduce.error_feedback))
        if keyed and hasattr(module, "set_reduce_scatter_unused_params"):
            # A parameter without a gradient would drop out of FSDP's flat buffer and shift every
            # later parameter's blocks and residuals: reduce zeros for it instead (as DDP's
            # find_unused_parameters does), so the layout is the same every step.
            module.set_reduce_scatter_unused_params(True, recurse=False)


def _check_types(root, rs, ag, ar) -> None:
    if not isinstance(root, FSDPModule):
        raise TypeError(f"{_WHERE}: {type(root).__name__} is not an FSDP2 module; call "
                        f"torch.distributed.fsdp.fully_shard on it (and its blocks) first")
    for name, value, cls in (("reduce_scatter", rs, ReduceScatterComm), ("all_gather", ag, AllGatherComm),
                             ("all_reduce", ar, AllReduceHook)):
        if value is None or isinstance(value, cls):
            continue
        if isinstance(value, Compressor):
            serves = name == "all_reduce" or isinstance(value, QuantizeCompressor)
            what = "is a compressor, not a comm" if serves else "cannot serve a reduce-scatter"
            raise TypeError(f"{_WHERE}: {name}={type(value).__name__}(...) {what}; pass {name}="
                            f"{cls.__name__}(compressor=...) (reduce-scatter and all-gather take QuantizeCompressor)")
        raise TypeError(f"{_WHERE}: {name} must be a commopt.comm.fsdp.{cls.__name__} or None, got "
                        f"{type(value).__name__}")
    if rs is None and ag is None and ar is None:
        raise ValueError(f"{_WHERE}: nothing to register; pass reduce_scatter=, all_gather= or all_reduce=")


def _check_mesh(key: str, pg, topo: Topology, rs, ag, ar) -> list[tuple[type, str]]:
    out: list[tuple[type, str]] = []
    info = pg.mesh_info
    shard_group = getattr(info, "shard_process_group", None)
    native_replicate = getattr(info, "replicate_process_group", None) is not None
    if shard_group is None:
        return [(TopologyError, f"module {key!r} is not sharded (a replicate-only mesh); commopt's FSDP comms "
                                f"serve sharded modules")]
    ranks = tuple(dist.get_process_group_ranks(shard_group))
    for comm in (rs, ag):
        if comm is not None and comm.site(shard_group).kind == "other":
            out.append((TopologyError, f"module {key!r}: FSDP shards over ranks {list(ranks)}, which is neither the "
                                       f"topology's group ({topo.layout}) nor one of its nodes: the mesh is not the "
                                       f"topology's; shard over every rank (or one node), or pass the topology "
                                       f"of this mesh"))
            break
    if ar is not None:
        node = tuple(topo.group_rank_to_global(r) for r in topo.nodes[topo.node])
        if native_replicate:
            out.append((TopologyError, f"module {key!r} is native HSDP (a 2-D mesh), which already all-reduces "
                                       f"across nodes; the HSDP hook needs 1-D FSDP over each node's ranks "
                                       f"(fsdp.shard_hsdp builds it)"))
        elif ranks != node:
            out.append((TopologyError, f"module {key!r}: FSDP shards over ranks {list(ranks)}, not this rank's node "
                                       f"{list(node)} ({topo.layout}): the mesh is not the topology's; the HSDP hook "
                                       f"needs 1-D FSDP over the intra-node group (fsdp.shard_hsdp builds it)"))
    return out


def _agree(problems: list[tuple[type, str]], fingerprint: str, timeout: float | None) -> None:
    """One small all-gather over WORLD: every rank raises when any rank found a problem, or when the
    ranks' models or comms differ (within the comms' ``timeout``: ``CommTimeoutError`` otherwise)."""
    code = max((2 if cls is TopologyError else 1 for cls, _ in problems), default=0)
    digest = int.from_bytes(hashlib.sha1(fingerprint.encode()).digest()[:7], "little")
    mine = torch.tensor([code, digest], dtype=torch.int64)
    if dist.is_initialized() and dist.get_world_size() > 1:
        rows = [torch.zeros_like(mine) for _ in range(dist.get_world_size())]
        wait_work(dist.all_gather(rows, mine, async_op=True), timeout, op=_WHERE)
    else:
        rows = [mine]
    codes = [int(r[0]) for r in rows]
    worst = max(codes)
    if worst:
        cls = TopologyError if worst == 2 else ValueError
        bad = [r for r, c in enumerate(codes) if c]
        text = "; ".join(msg for _, msg in problems) or f"ranks {bad} refused the registration (see their errors)"
        message = f"{_WHERE}: {text}. Nothing was registered (ranks with a problem: {bad})"
        raise cls(message, op=_WHERE, ranks=bad) if cls is TopologyError else cls(message)
    if len({int(r[1]) for r in rows}) > 1:
        raise ValueError(f"{_WHERE}: the ranks registered different models or comms (their parameter layouts or "
                         f"comm settings differ); build the same model and comms on every rank")


def _prepare(topo: Topology, rs, ag, ar) -> None:
    """Create every group and the cost model the comms will use, collectively (docs/architecture.md section 5.1)."""
    ctx = context()
    # From the layout alone (local_size differs between the nodes of 2+1): auto consults the cost
    # model whenever there is more than one level.
    two_level = 1 < topo.num_nodes < topo.world_size
    for comm in (rs, ag):
        if comm is None:
            continue
        if comm.algorithm not in ("flat", NATIVE):
            # Every algorithm the comm may run (auto's candidates, or the one named), not flat.
            names = algorithms.candidates(comm.collective) if comm.algorithm == algorithms.AUTO else [comm.algorithm]
            ctx.prepare(topo, [n for n in names if n != "flat"], comm.timeout)
            if comm.algorithm == "auto" and two_level:
                cost.model_for(topo, timeout=comm.timeout)
    if rs is not None and rs.compressor is not None:
        if rs.two_level():
            rs.groups(FSDP_QRS_INTRA)
            rs.groups(FSDP_QRS_RAIL)
        else:
            rs.groups(FSDP_QRS_FLAT, rs.flat_topology())
    for comm in (rs, ar):
        if comm is not None and comm.finite_check:
            comm.groups(FSDP_CHECK, comm.flat_topology())
    if ar is not None:
        for role in FSDP_HSDP_ROLES:
            ar.rail(role)


# --------------------------------------------------------------------------------- recipes
class _Default:
    def __repr__(self) -> str:
        return "<default>"


_DEFAULT = _Default()


def _blocks(model: nn.Module, blocks) -> list[nn.Module]:
    if blocks is not None:
        return list(blocks)
    return [m for child in model.modules() if isinstance(child, nn.ModuleList) for m in child]


def _device_type(model: nn.Module) -> str:
    p = next(model.parameters(), None)
    return p.device.type if p is not None else "cpu"


def shard(model: nn.Module, *, topology: Topology | str | None = None, blocks=None, weights=AUTO, gradients=AUTO,
          hpz: bool | str = AUTO, algorithm: str = "auto", error_feedback: bool = True, prefetch: bool = True,
          mp_policy: MixedPrecisionPolicy | None = None, seed: int = 0, timeout: float | None = None) -> Comms:
    """Shard ``model`` over every rank with the ZeRO++ recipe, in place, and register commopt's comms.

    (1) ``fully_shard`` every block (default: every module held in an ``nn.ModuleList``) and the
    root; (2) hpZ: ``reshard_after_forward=L`` (L ranks per node), so that after forward each node
    keeps a secondary shard and backward's all-gather never leaves the node; (3) qwZ: the forward
    all-gather in int8 (``weights``); (4) qgZ: the gradient reduce-scatter in int4 (``gradients``),
    hierarchical where the topology allows, with error feedback; (5) with ``prefetch``, every block's
    forward prefetches the next block's parameters and all-gathers run asynchronously, so that they
    overlap computation (FSDP2's backward prefetch too). ``weights=None, gradients=None, hpz=False``
    is plain FSDP2 with commopt's exact (``algorithm``) reduce-scatter and all-gather;
    ``weights="native"`` / ``gradients="native"`` is FSDP2's own collective for that part.

    ``"auto"`` (the default of ``weights``, ``gradients`` and ``hpz``) decides per model whether each
    part pays, so that the one-liner is not slower than FSDP2 where compression cannot win (a small
    model whose collectives are latency- or CPU-bound, a fast link): the largest unit's forward
    all-gather and gradient reduce-scatter are timed on this cluster three ways -- FSDP2's own
    collective (``"native"``), commopt's exact one with ``algorithm`` (``"exact"``) and commopt's
    compressed one (``"int8"`` / ``"int4"``) --, three calls each after a warm-up, the slowest rank's
    time counting. The compressed collective is taken when it took at most ``AUTO_MARGIN`` of the
    faster exact one's time (the margin covers what a training step adds: the codec competes with
    compute for the cores), else the faster exact one. Every rank takes the same decision (the times
    are agreed with a MAX all-reduce); rank 0 prints it once, and ``Comms.recipe`` holds it with the
    times; ``Comms.state_dict()`` saves it and ``Comms.load_state_dict`` restores it, so that a run
    resumed from a checkpoint trains with the comms of the run it resumes, whatever this run's timing
    says. ``hpz="auto"`` is on wherever it can be (nodes of equal size, consecutive ranks, more than
    one node and more than one rank per node), off without a warning elsewhere; ``hpz=True`` warns
    where it cannot be on.

    ``"native"`` registers :class:`ReduceScatterComm` / :class:`AllGatherComm` with
    ``algorithm="native"``: torch's own collective with FSDP2's arguments, bit for bit what FSDP2
    computes without a custom comm, but waited for within ``timeout`` and failing with commopt's
    errors (``timeout`` bounds every part, whichever is chosen: FSDP2's own waits are bounded only by
    the process group's timeout, 30 minutes by default, which hpZ's node groups get whatever WORLD's
    is).

    hpZ needs nodes of equal size whose ranks are consecutive (node-by-node placement: FSDP2's
    post-forward groups are consecutive ranks); elsewhere it is left off. On one node it is ZeRO-3's
    own resharding, on one rank per node no resharding at all. FSDP2 makes hpZ's node groups with
    torch's default timeout (30 minutes); ``shard`` gives them WORLD's, as commopt's own groups have
    (``runtime.align_timeout``). Under hpZ an evaluation loop (forward only) gathers across nodes
    once, in its first forward after a backward: later forwards gather inside the node, so a peer
    that stalls or dies on another node stops nobody on this one (its node peers raise).

    Args:
        model: the model, sharded in place.
        topology: the layout of every rank: a ``Topology``, a spec string such as ``"2x2"``
            (``Topology.from_spec``), or None (detected).
        weights, gradients: ``"auto"``, ``"native"``, None (commopt's exact collective) or a
            ``QuantizeCompressor``.
        timeout: seconds every comm call may take, whichever part is chosen (None: the group's own).

    Returns:
        The registered :class:`Comms` (their state belongs in the checkpoint).

    Raises:
        TypeError, ValueError: a bad argument, on every rank, before anything collective (whichever
            part ``"auto"`` would have chosen).
    """
    _check_shard(model, topology, weights, gradients, hpz, algorithm, error_feedback, prefetch, mp_policy, seed,
                 timeout)
    topo = _topology(topology, timeout, "fsdp.shard")
    make = partial(_part_comm, topo=topo, algorithm=algorithm, error_feedback=error_feedback, seed=seed,
                   timeout=timeout)
    recipe = None
    chosen = {"weights": weights, "gradients": gradients}
    auto = [p for p, v in chosen.items() if v == AUTO]
    if auto:
        recipe = _choose_recipe(model, blocks, topo, algorithm, auto, error_feedback, timeout)
        chosen.update({p: recipe[p] for p in auto})
    rs, ag = make("gradients", chosen["gradients"]), make("weights", chosen["weights"])
    reshard: bool | int = True
    local, world = topo.local_size, topo.world_size
    forced = hpz is True
    if hpz == AUTO:
        hpz = 1 < local < world
    if hpz:
        consecutive = [sorted(topo.group_rank_to_global(r) for r in n) for n in topo.nodes] == [
            list(range(i * local, (i + 1) * local)) for i in range(topo.num_nodes)]
        if not topo.is_uniform or not consecutive:
            if forced:
                warnings.warn(f"fsdp.shard: hpZ needs nodes of equal size with consecutive ranks, got {topo.layout}; "
                              f"it is off (reshard_after_forward=True)", stacklevel=2)
        else:
            reshard = True if local == world else (False if local == 1 else local)
    if recipe is not None:
        recipe["hpz"] = reshard is not True
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh(_device_type(model), (topo.world_size,))
    chain = _fully_shard(model, blocks, mp_policy, mesh=mesh, reshard_after_forward=reshard)
    _align_timeouts(model)
    register(model, reduce_scatter=rs, all_gather=ag)
    if prefetch:
        _prefetch(model, chain)
    restore = partial(_restore_recipe, model=model, make=make, auto=tuple(auto)) if auto else None
    return Comms(reduce_scatter=rs, all_gather=ag, recipe=recipe, _restore=restore)


def _check_shard(model, topology, weights, gradients, hpz, algorithm, error_feedback, prefetch, mp_policy, seed,
                 timeout) -> None:
    """Every argument of :func:`shard`, before anything collective: each comm ``"auto"`` may choose (and
    the exact one) is built once, unbound, nothing detected, so that a bad ``seed``, ``timeout`` or
    ``algorithm`` is refused whichever part the timing would pick."""
    where = "fsdp.shard"
    if not isinstance(model, nn.Module):
        raise TypeError(f"{where}: model must be a torch.nn.Module, got {type(model).__name__}")
    _topology_type(topology, where)
    for name, value in (("weights", weights), ("gradients", gradients)):
        if isinstance(value, str) and value not in (AUTO, NATIVE):
            raise ValueError(f"{where}: {name}={value!r}; pass {AUTO!r}, {NATIVE!r} (FSDP2's own collective), None "
                             f"(commopt's exact one) or a compressor instance such as QuantizeCompressor(8)")
    if hpz not in (True, False, AUTO) or isinstance(hpz, (int, float)) and not isinstance(hpz, bool):
        raise ValueError(f"{where}: hpz={hpz!r}; pass True, False or {AUTO!r}")
    for name, value in (("error_feedback", error_feedback), ("prefetch", prefetch)):
        if not isinstance(value, bool):
            raise TypeError(f"{where}: {name} must be True or False, got {type(value).__name__} {value!r}")
    if mp_policy is not None and not isinstance(mp_policy, MixedPrecisionPolicy):
        raise TypeError(f"{where}: mp_policy must be a torch.distributed.fsdp.MixedPrecisionPolicy or None, got "
                        f"{type(mp_policy).__name__}")
    for part, value in (("gradients", gradients), ("weights", weights)):
        # None: the exact comm, which checks ``algorithm`` even where no part will use it.
        options = [NATIVE, None, QuantizeCompressor(8 if part == "weights" else 4)] if value == AUTO else [value, None]
        for option in options:
            try:
                _part_comm(part, option, topo=None, algorithm=algorithm, error_feedback=error_feedback, seed=seed,
                           timeout=timeout)
            except (TypeError, ValueError) as exc:
                raise type(exc)(f"{where}: {exc}") from None


def _topology_type(topology, where: str) -> None:
    if topology is not None and not isinstance(topology, (Topology, str)):
        raise TypeError(f"{where}: topology must be a commopt.comm.Topology, a spec string such as '2x2' "
                        f"(Topology.from_spec) or None (detected), got {type(topology).__name__} {topology!r}")


def _topology(topology, timeout: float | None, where: str) -> Topology:
    """The recipes' topology: given, parsed from a spec string, or detected (collective)."""
    _topology_type(topology, where)
    if isinstance(topology, str):
        return Topology.from_spec(topology)
    return topology if topology is not None else context().topology(None, None, timeout)


def _part_comm(part: str, value, *, topo: Topology | None, algorithm: str, error_feedback: bool, seed: int,
               timeout: float | None) -> ReduceScatterComm | AllGatherComm:
    """The comm of one part of :func:`shard` for ``value``: a label of :data:`_LABELS`, None (exact) or a
    compressor."""
    codec = {"int8": QuantizeCompressor(8), "int4": QuantizeCompressor(4)}.get(value) if isinstance(value, str) \
        else value
    algo = NATIVE if value == NATIVE else algorithm
    if part == "gradients":
        return ReduceScatterComm(topo, algo, codec, error_feedback=error_feedback, seed=seed, timeout=timeout)
    return AllGatherComm(topo, algo, codec, timeout=timeout)


def _restore_recipe(comms: Comms, saved: dict, *, model: nn.Module, make: Callable, auto: tuple[str, ...]) -> None:
    """``Comms.load_state_dict``'s first step: register again, on every module, each part that this
    ``shard`` decided (``auto``) differently from the checkpoint's run."""
    where = "Comms.load_state_dict"
    if not isinstance(saved, dict):
        raise ValueError(f"{where}: the checkpoint's recipe must be a dict such as {{'weights': 'int8', 'gradients': "
                         f"'native', 'hpz': True}}, got {type(saved).__name__}")
    if "hpz" in saved and comms.recipe is not None and saved["hpz"] != comms.recipe.get("hpz"):
        raise ValueError(f"{where}: the checkpoint was trained with hpZ {'on' if saved['hpz'] else 'off'}, this model "
                         f"is sharded with it {'on' if comms.recipe.get('hpz') else 'off'}; pass "
                         f"hpz={bool(saved['hpz'])} to fsdp.shard")
    changed = {}
    for part in auto:
        label = saved.get(part)
        if label is None or label == comms.recipe[part]:
            continue
        if label not in _LABELS[part]:
            raise ValueError(f"{where}: the checkpoint's {part} were served by {label!r}, not one of "
                             f"{list(_LABELS[part])}")
        changed[part] = label
    if not changed:
        return
    rs = make("gradients", changed["gradients"]) if "gradients" in changed else comms.reduce_scatter
    ag = make("weights", changed["weights"]) if "weights" in changed else comms.all_gather
    register(model, reduce_scatter=rs, all_gather=ag)
    comms.reduce_scatter, comms.all_gather = rs, ag
    comms.recipe.update(changed)


def _choose_recipe(model: nn.Module, blocks, topo: Topology, algorithm: str, parts: list[str],
                   error_feedback: bool, timeout: float | None) -> dict:
    """``shard``'s ``"auto"`` for ``parts``: time the largest unit's forward all-gather and gradient
    reduce-scatter (FSDP2's own, commopt's exact, commopt's compressed: each the comm that would
    serve it) on this cluster (see :func:`shard`), agree on the times, decide, print once. Returns
    the recipe: each part's label (:data:`_LABELS`) and the times."""
    world = topo.world_size
    units = _blocks(model, blocks) + [model]
    inside = {id(p) for b in units[:-1] for p in b.parameters()}

    def params(unit: nn.Module) -> list[tuple[str, nn.Parameter]]:
        own = unit is model
        return [(n, p) for n, p in unit.named_parameters() if not own or id(p) not in inside]

    unit = max((params(u) for u in units), key=lambda ps: sum(p.numel() for _, p in ps))
    if not unit or world == 1:  # nothing to move: exact, commopt's comms (a world of one copies)
        return {"seconds": {}, **{p: "exact" for p in parts}}
    shapes = tuple((-(-p.shape[0] // world), *p.shape[1:]) if p.dim() else (1,) for _, p in unit)
    layout = Layout("commopt.shard.auto", tuple(n for n, _ in unit), tuple(math.prod(s) for s in shapes), shapes)
    chunk = layout.chunk
    full, out = torch.randn(world * chunk, generator=torch.Generator().manual_seed(0)), torch.empty(world * chunk)
    part_out = torch.empty(chunk)
    group = topo.group if topo.group is not None else dist.group.WORLD
    candidates: dict[tuple[str, str], Callable[[], object]] = {}  # (part, label) -> one call
    for part in parts:
        for label in _LABELS[part]:
            comm = _part_comm(part, label, topo=topo, algorithm=algorithm, error_feedback=error_feedback, seed=0,
                              timeout=timeout).bind(Bound(layout))
            candidates[(part, label)] = ((lambda c=comm: c(out, full[:chunk], group)) if part == "weights" else
                                         (lambda c=comm: c(part_out, full, group, dist.ReduceOp.AVG)))
    seconds = torch.tensor([cost.median_seconds(c, group=group, reps=3) for c in candidates.values()],
                           dtype=torch.float64)
    # The slowest rank's: the same on every rank.
    wait_work(dist.all_reduce(seconds, op=dist.ReduceOp.MAX, group=group, async_op=True), timeout, op="fsdp.shard")
    times = dict(zip(candidates, seconds.tolist()))
    recipe: dict = {"seconds": {f"{p}/{label}": t for (p, label), t in times.items()}}
    for p in parts:
        native, exact, compressed = [(label, times[(q, label)]) for q, label in times if q == p]
        best = min((native, exact), key=lambda x: x[1])  # FSDP2's own on a tie
        recipe[p] = compressed[0] if compressed[1] <= AUTO_MARGIN * best[1] else best[0]
    if dist.get_rank() == (topo.group_rank_to_global(0) if topo.group is not None else 0):
        said = "; ".join(f"{p} {recipe[p]} (" + ", ".join(f"{label} {t * 1e3:.1f} ms" for (q, label), t in times.items()
                                                           if q == p) + ")" for p in parts)
        print(f"commopt fsdp.shard: {said}; timed on its largest unit ({sum(layout.numels) * world / 1e6:.2f} M "
              f"parameters), compressed where it took at most {AUTO_MARGIN:.0%} of the faster exact one",
              flush=True)
    return recipe


def _fully_shard(model: nn.Module, blocks, mp_policy: MixedPrecisionPolicy | None, **kwargs) -> list[nn.Module]:
    """``fully_shard`` every block, then the root, with ``kwargs`` (and ``mp_policy`` when given);
    returns the blocks in order (the forward-prefetch chain)."""
    if mp_policy is not None:
        kwargs["mp_policy"] = mp_policy
    chain = _blocks(model, blocks)
    for block in chain:
        fully_shard(block, **kwargs)
    fully_shard(model, **kwargs)
    return chain


def _align_timeouts(model: nn.Module) -> None:
    """Give the groups the recipes' ``fully_shard`` made (hpZ's post-forward groups, HSDP's node groups)
    WORLD's timeout instead of torch's 30-minute default (``runtime.align_timeout``)."""
    for module in model.modules():
        if isinstance(module, FSDPModule):
            for pg in module._get_fsdp_state()._fsdp_param_groups:
                for info in (pg.mesh_info, getattr(pg, "post_forward_mesh_info", None)):
                    align_timeout(getattr(info, "shard_process_group", None))


def _prefetch(model: nn.Module, chain: list[nn.Module]) -> None:
    """Overlap all-gathers with computation: each block's forward prefetches the next block's
    parameters (``set_modules_to_forward_prefetch``), and FSDP2 issues its pre-forward and
    pre-backward all-gathers with ``async_op=True`` (``FSDPModule._set_unshard_async_op``), which
    commopt's all-gather serves asynchronously (FSDP2 waits for it before using the parameters).
    Without it, on a backend without streams (CPU) every all-gather blocks the training thread."""
    for block, following in zip(chain, chain[1:]):
        block.set_modules_to_forward_prefetch([following])
    set_async = getattr(model, "_set_unshard_async_op", None)
    if set_async is not None:
        set_async(True)


def shard_hsdp(model: nn.Module, compressor: Compressor | None = _DEFAULT, *, topology: Topology | str | None = None,
               blocks=None, error_feedback: bool = True, intra: bool = True, prefetch: bool = True,
               mp_policy: MixedPrecisionPolicy | None = None, seed: int = 0, timeout: float | None = None) -> Comms:
    """Compressed HSDP in place: FSDP2 over each node's ranks, ``compressor`` across nodes.

    (1) ``fully_shard`` every block and the root over a 1-D mesh of this rank's node; (2) the
    gradient shard is reduced along the rail by :class:`AllReduceHook` (default int8, error
    feedback); (3) with ``intra`` the node's reduce-scatter and all-gather run commopt's exact
    exchange (point-to-point on gloo), without it the backend's own collectives (``algorithm=
    "native"``: FSDP2's numerics, under ``timeout`` too), and with ``prefetch`` (which needs
    ``intra``) the all-gathers overlap computation as in :func:`shard`.

    Returns:
        The registered :class:`Comms`.
    """
    from torch.distributed.device_mesh import DeviceMesh

    topo = _topology(topology, timeout, "fsdp.shard_hsdp")
    compressor = QuantizeCompressor(8) if compressor is _DEFAULT else compressor
    hook = AllReduceHook(compressor, topo, error_feedback=error_feedback, seed=seed, timeout=timeout)
    if not topo.is_uniform:
        raise TopologyError(f"fsdp.shard_hsdp: HSDP needs nodes of equal size, got {[len(n) for n in topo.nodes]} "
                            f"({topo.layout}); use fsdp.shard", op="fsdp.shard_hsdp")
    grid = torch.tensor([[topo.group_rank_to_global(r) for r in node] for node in topo.nodes])
    mesh = DeviceMesh(_device_type(model), grid, mesh_dim_names=("replicate", "shard"))["shard"]
    chain = _fully_shard(model, blocks, mp_policy, mesh=mesh)
    _align_timeouts(model)
    intra_algorithm = "auto" if intra else NATIVE  # without intra: the backend's own, under the timeout too
    rs = ReduceScatterComm(topo, intra_algorithm, timeout=timeout)
    ag = AllGatherComm(topo, intra_algorithm, timeout=timeout)
    register(model, reduce_scatter=rs, all_gather=ag, all_reduce=hook)
    if prefetch and intra:
        _prefetch(model, chain)
    return Comms(reduce_scatter=rs, all_gather=ag, all_reduce=hook)
