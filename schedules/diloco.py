"""DiLoCo: the low-communication outer loop, hierarchical and streaming (docs/guide.md, "Training
across slow links: DiLoCo"; docs/architecture.md section 5.8; docs/faults.md row 40).

Workers (the nodes of the topology, or any equal replica grouping) train ``sync_every`` inner steps on
their own: inside a worker the ranks train as usual (one rank, DDP or FSDP2 on :attr:`DiLoCo.worker_group`).
Every ``sync_every`` inner steps each fragment of the model runs one outer step:

(1) pseudo-gradient: this rank's piece of (global weights - local weights), where the global weights
    are the backups kept on ``backup_device``; (2) all-reduce (AVG) of the pieces across workers
    ALONG THE RAILS (the ranks of one local index, one per worker): exact, or through the reduction
    pipeline with a codec and error feedback (``compression.reduce_tensors(..., algorithm="rail")``),
    issued asynchronously; (3) ``delay`` inner steps later: an agreed finiteness check inside the
    worker, the outer optimizer's step on the backups with the averaged pseudo-gradient as ``.grad``;
    (4) the workers adopt the new global weights, mixed as ``(1 - alpha) * global + alpha * local``:
    a DTensor (FSDP2) parameter's local shard directly, a replicated parameter through an all-gather
    of the pieces inside the worker. With ``delay >= 2``, for a fragment with replicated parameters
    in workers of several ranks (DDP inside), (3) runs one inner step before (4) and the all-gather is
    issued then, so that it overlaps that inner step (the adoption's step and values are the same).

A rank's piece is the part it owns: a DTensor parameter's local shard; for a replicated parameter
(one rank per worker, or DDP) a block of ``ceil(rows / L)`` rows of dim 0 (zero-padded), by local
rank, L the worker's size. So the inter-node links carry 1/L of the model per rank, and the
backups and the outer optimizer's state take 1/L of the model per rank too.

The fragments (``fragments=F``: contiguous groups of parameters of about equal size, or explicit
lists of names) sync at staggered inner steps: fragment f at every step t with
``t % sync_every == (f * sync_every) // F``. ``F = 1, delay = 0, alpha = 0`` is plain DiLoCo
(Douillard et al., arXiv 2311.08105); ``F > 1, delay > 0`` is Streaming DiLoCo (arXiv 2501.18512).

Ordering (docs/architecture.md section 3): every collective is issued from the training thread in
:meth:`DiLoCo.step` (or through the engine, for compressed reductions), in the same order on every
rank, because the schedule depends on the step count and the settings only; nothing is issued from
a callback.
"""

from __future__ import annotations

import hashlib
import math
import numbers
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed import ReduceOp
from torch.distributed.tensor import DTensor

from commopt.comm import all_reduce
from commopt.comm.algorithms._transport import all_gather_single
from commopt.comm.algorithms.roles import DILOCO
from commopt.comm.checks import check_timeout
from commopt.comm.compression import Codec, ErrorFeedback, auto, reduce_tensors
from commopt.comm.compression.codec import all_finite
from commopt.comm.dispatch import select_algorithm
from commopt.comm.elastic import Membership
from commopt.comm.elastic.replicas import node_member_id
from commopt.comm.engine import wait, wait_work
from commopt.comm.errors import NonFiniteError
from commopt.comm.runtime import context
from commopt.comm.topology import Topology

from ._diloco_elastic import ElasticSync, check_elastic
from ._diloco_state import Expected, check_state, cloned, fragments_of, outer_optimizers, positive_int
from ._diloco_workers import rail_topology, worker_group, worker_topology

__all__ = ["DiLoCo", "worker_group", "worker_topology"]

OptimizerFactory = Callable[[list], torch.optim.Optimizer]
_NAME = "DiLoCo"


# --------------------------------------------------------------------------------- the pieces
@dataclass
class _Piece:
    """What this rank owns of one parameter.

    Attributes:
        name: the parameter's name in the model.
        param: the parameter (a DTensor for FSDP2).
        sharded: a DTensor: the piece is its local shard (padded to at least one element).
        rows: ``ceil(dim0 / L)`` rows of a replicated parameter (its piece's first dimension).
        shape: the piece's shape (what the backup, the pseudo-gradient and the outer state hold).
    """

    name: str
    param: torch.Tensor
    sharded: bool
    rows: int
    shape: tuple[int, ...]


def _local(p: torch.Tensor) -> torch.Tensor:
    """The tensor this rank holds of ``p``: a DTensor's local shard (the storage itself, writable
    under no_grad), else ``p``."""
    return p.to_local() if hasattr(p, "to_local") else p


class _Pending:
    """One fragment's reduction in flight: the averaged pseudo-gradient pieces and when to apply them;
    once its outer step ran (``stepped``), the worker's all-gather of the new global pieces in flight
    (``gather``: the work, its output and this rank's input), or None (gathered when it lands), and
    ``base``: the old global weights minus the averaged pseudo-gradient (where the workers were at the
    reduction's issue), which :meth:`DiLoCo.finalize` needs; None once restored from a checkpoint."""

    def __init__(self, fragment: int, due: int, deltas: list[torch.Tensor], future, kind: str) -> None:
        self.fragment, self.due, self.deltas, self.future, self.kind = fragment, due, deltas, future, kind
        self.stepped = False
        self.gather: tuple | None = None
        self.base: list[torch.Tensor] | None = None


# --------------------------------------------------------------------------------- DiLoCo
class DiLoCo:
    """The DiLoCo outer loop around the user's inner training (see the module docstring).

    Call :meth:`step` after every inner optimizer step, on every rank; at the end, :meth:`finalize` (the
    last syncs; the model then holds the global weights), or :meth:`global_state_dict` to evaluate or
    save the global model at any step without changing the run. Construction is collective over
    WORLD: it creates the worker and rail groups (or reuses :func:`worker_group`'s), checks that every
    rank holds the same model and settings, and broadcasts the starting weights of worker 0 to every
    worker, which become the first global weights.

    Args:
        model: the module being trained (plain, DDP-wrapped, or FSDP2-sharded over the worker group).
            Parameters with ``requires_grad=False`` or no elements are not synchronised, nor are buffers
            (e.g. BatchNorm statistics); the synchronised ones must be real floating point.
        inner_optimizer: the optimizer of the inner steps, stepped by the user; it must optimise the
            model's parameters (built after wrapping). DiLoCo never steps it or keeps its state.
        outer_optimizer: ``params -> torch.optim.Optimizer``, called once per fragment with the backup
            pieces of that fragment (None: Nesterov SGD, lr 0.7, momentum 0.9). Elementwise optimizers
            only (SGD, Adam...): each rank steps 1/L of every parameter; one whose step needs a closure
            (LBFGS) is a TypeError.
        sync_every: inner steps between two outer steps of a fragment (H), >= 1.
        fragments: the number of fragments (contiguous groups of parameters in ``named_parameters()``
            order, of about equal size), or explicit fragments: lists of parameter names that cover every
            synchronised parameter exactly once.
        delay: inner steps between a fragment's reduction being issued and its adoption (0 <= delay <
            sync_every): the reduction overlaps that many inner steps (``delay - 1``, and the worker's
            all-gather of the new weights the last, where the module docstring says).
        alpha: the local weights' share when the global ones are adopted, in [0, 1) (0: replace).
        compressor: a ``commopt.comm.compression`` codec for the pseudo-gradients (None: exact).
        error_feedback: keep what a biased codec drops (per parameter name) for the next outer step.
        topology: the cluster's layout (None: detected).
        workers: ``"node"`` or explicit equal workers (lists of global ranks).
        backup_device: where the global weights and the outer optimizer's state live (default CPU).
        timeout: seconds each collective of DiLoCo may wait (``CommTimeoutError``); None: the group's
            (elastic: 60).
        elastic: the workers of each outer sync are the current generation of the coordinator's
            membership (``schedules/_diloco_elastic.py``): workers may die and rejoin without a restart.
            Each worker is its own world, a node's ranks (one torchrun per node; DDP or FSDP2 inside,
            over that world); ``delay`` 0; not ``topology`` / ``workers``. A joiner's error-feedback
            residual starts at zero.
        min_workers: elastic: the fewest workers an outer sync may have (``QuorumError`` below; None: 1,
            any generation the coordinator's quorum rule allows).
        membership: elastic: this worker's ``commopt.comm.elastic.Membership`` (None:
            ``Membership.from_env(node * L + rank)``, heartbeat 0.25 s, closed by :meth:`close`).
        join_timeout: elastic: seconds a joiner waits for the running workers' next outer sync.
        join_inner_state: elastic: a joiner also copies its peer's inner optimizer state (True, the
            default: Adam's moments are a better start than zeros); False: its inner optimizer's own.

    Attributes:
        worker_group: this rank's worker's process group (None for one-rank workers).
        topology: the workers, one "node" each.
        fragments: the parameter names of each fragment.
        outer_optimizers: one per fragment.
        error_feedback: the residuals of the compressed pseudo-gradients, by parameter name.
        steps: inner steps counted so far.
        outer_bytes: the bytes this rank's outer reductions have sent to other workers so far, as the
            traffic model of the algorithm that ran counts them (the rail's; where the links differ,
            what ``auto`` took on the rail, e.g. ``synth``; the encoded bytes where a codec ran): a
            streamed reduction's bytes, which cross the link while later inner steps run, are counted
            when it is issued. A worker's link carries the sum over its ranks.
    """

    def __init__(self, model: nn.Module, inner_optimizer: torch.optim.Optimizer, *,
                 outer_optimizer: OptimizerFactory | None = None, sync_every: int = 32,
                 fragments: int | list[list[str]] = 1, delay: int = 0, alpha: float = 0.0,
                 compressor: Codec | None = None, error_feedback: bool = True, topology: Topology | None = None,
                 workers: str | list = "node", backup_device: str | torch.device = "cpu",
                 timeout: float | None = None, elastic: bool = False, min_workers: int | None = None,
                 membership: Membership | None = None, join_timeout: float = 600.0,
                 join_inner_state: bool = True) -> None:
        # Local checks first: every rank raises the same error before anything is sent.
        if not isinstance(model, nn.Module):
            raise TypeError(f"{_NAME}: model must be a torch.nn.Module, got {type(model).__name__}")
        if not isinstance(inner_optimizer, torch.optim.Optimizer):
            raise TypeError(f"{_NAME}: inner_optimizer must be a torch.optim.Optimizer over the model's parameters, "
                            f"got {type(inner_optimizer).__name__}")
        if outer_optimizer is not None and not callable(outer_optimizer):
            raise TypeError(f"{_NAME}: outer_optimizer must be a factory params -> torch.optim.Optimizer (e.g. "
                            f"lambda ps: torch.optim.SGD(ps, lr=0.7, momentum=0.9, nesterov=True)) or None, got "
                            f"{type(outer_optimizer).__name__}")
        self.sync_every = positive_int("sync_every", sync_every, "e.g. sync_every=32")
        if isinstance(delay, bool) or not isinstance(delay, numbers.Integral):
            raise TypeError(f"{_NAME}: delay must be an int with 0 <= delay < sync_every ({self.sync_every}), got "
                            f"{type(delay).__name__} {delay!r}; e.g. delay=0 (apply at the sync) or delay=2")
        if not 0 <= delay < self.sync_every:
            raise ValueError(f"{_NAME}: delay must be an int with 0 <= delay < sync_every ({self.sync_every}): a "
                             f"fragment's outer step must land before its next sync; got {delay!r}")
        self.delay = int(delay)
        if isinstance(alpha, bool) or not isinstance(alpha, numbers.Real):
            raise TypeError(f"{_NAME}: alpha must be a number in [0, 1) (the local weights' share when the global "
                            f"ones are adopted; 0 replaces them), got {type(alpha).__name__} {alpha!r}")
        if not 0.0 <= float(alpha) < 1.0:
            raise ValueError(f"{_NAME}: alpha must be a number in [0, 1) (the local weights' share when the "
                             f"global ones are adopted; 0 replaces them), got {alpha!r}")
        self.alpha = float(alpha)
        if compressor is not None and not isinstance(compressor, Codec):
            raise TypeError(f"{_NAME}: compressor must be a commopt.comm.compression codec instance (e.g. "
                            f"QuantizeCompressor(8), PowerSGDCompressor(rank=4)) or None, got "
                            f"{type(compressor).__name__}")
        if not isinstance(error_feedback, bool):
            raise TypeError(f"{_NAME}: error_feedback must be a bool, got {type(error_feedback).__name__}")
        try:
            self.backup_device = torch.device(backup_device)
        except (RuntimeError, TypeError):
            raise ValueError(f"{_NAME}: backup_device must name a torch device such as 'cpu' or 'cuda:0', got "
                             f"{backup_device!r}") from None
        self.timeout = check_timeout(_NAME, timeout)
        self.model, self.inner_optimizer = model, inner_optimizer
        self.compressor = compressor
        named = [(n, p) for n, p in model.named_parameters() if p.requires_grad and p.numel() > 0]
        if not named:
            raise ValueError(f"{_NAME}: the model has no trainable parameters with elements to synchronise")
        odd = [f"{n} ({p.dtype})" for n, p in named if not p.is_floating_point()]
        if odd:
            raise TypeError(f"{_NAME}: trainable parameters must be real floating point (the pseudo-gradients are "
                            f"reduced as floats), got {odd[:5]}; keep them real (e.g. torch.view_as_real) or freeze "
                            f"them (requires_grad_(False): not synchronised)")
        ids = {id(p) for p in model.parameters() if p.requires_grad}  # empty ones too: unsynchronised, not strangers
        inner = [p for g in inner_optimizer.param_groups for p in g["params"]]
        strangers = [i for i, p in enumerate(inner) if id(p) not in ids and p.requires_grad]
        if strangers:
            raise ValueError(f"{_NAME}: inner_optimizer optimises {len(strangers)} tensor(s) that are not trainable "
                             f"parameters of the model (it was built before the model was wrapped or sharded?); "
                             f"build it after wrapping, over model.parameters()")
        devices = {_local(p).device for _, p in named}
        if len(devices) != 1:
            raise ValueError(f"{_NAME}: the model's parameters are on several devices {sorted(map(str, devices))}; "
                             f"put them on one device")
        self.device = devices.pop()
        if self.backup_device.type not in ("cpu", self.device.type):
            raise ValueError(f"{_NAME}: backup_device {self.backup_device} is neither 'cpu' nor the model's "
                             f"device type ({self.device.type})")
        self.fragments = fragments_of(fragments, named)
        self.offsets = [(f * self.sync_every) // len(self.fragments) for f in range(len(self.fragments))]

        if not isinstance(elastic, bool):
            raise TypeError(f"{_NAME}: elastic must be a bool, got {type(elastic).__name__}")
        if elastic:
            check_elastic(self.delay, topology, workers, min_workers, membership)
            self.timeout = 60.0 if self.timeout is None else self.timeout
        # Collective from here on, in the same order on every rank.
        # elastic: this world is one worker (a node of L ranks); the workers are the membership's generation
        self.topology = (Topology(nodes=(tuple(range(dist.get_world_size())),), rank=dist.get_rank(),
                                  world_size=dist.get_world_size()) if elastic
                         else worker_topology(topology, workers, self.timeout))
        topo = self.topology
        self.num_workers, self.local_size, self.local_rank = topo.num_nodes, topo.local_size, topo.local_rank
        groups = context().groups(topo, DILOCO, self.timeout) if topo.world_size > 1 else None
        self.worker_group = groups.intra if groups is not None else None
        self._rail = groups.rail if groups is not None else None
        self._rail_src = groups.rail_ranks[0] if groups is not None and groups.rail is not None else None
        self._intra_src = groups.intra_ranks[0] if groups is not None and groups.intra is not None else None
        self._rail_topology = rail_topology(topo, self._rail)  # links that differ: auto may run synth
        by_name = dict(named)
        self._pieces = {n: self._piece(n, by_name[n]) for frag in self.fragments for n in frag}
        self._agree_settings(named)
        self._broadcast_start()
        self.backups: dict[str, torch.Tensor] = {n: self._read_piece(pc).to(self.backup_device, copy=True)
                                                for n, pc in self._pieces.items()}
        self.outer_optimizers = outer_optimizers(outer_optimizer, [[self.backups[n] for n in frag]
                                                                   for frag in self.fragments])
        self.error_feedback = ErrorFeedback()
        self.compressor_state = compressor.new_state() if compressor is not None else None
        self._use_ef = error_feedback and compressor is not None
        self.steps = 0
        self._reductions = 0
        self.outer_bytes = 0.0
        self._pending: list[_Pending] = []
        self.elastic: ElasticSync | None = None
        if elastic:
            self.elastic = ElasticSync(self, membership or Membership.from_env(
                                           node_member_id(dist.get_world_size(), dist.get_rank()),
                                           heartbeat_interval=0.25),
                                       min_workers=min_workers or 1, timeout=self.timeout, join_timeout=join_timeout,
                                       join_inner_state=bool(join_inner_state), own=membership is None)
            self.elastic.join()

    # ------------------------------------------------------------------------------- set-up
    def _piece(self, name: str, p: torch.Tensor) -> _Piece:
        if hasattr(p, "to_local"):
            local = p.to_local()
            return _Piece(name, p, True, 0, tuple(local.shape) if local.numel() else (1,))
        rows0 = p.shape[0] if p.dim() else 1
        rows = -(-rows0 // self.local_size)
        return _Piece(name, p, False, rows, (rows, *p.shape[1:]) if p.dim() else (1,))

    def _read_piece(self, pc: _Piece, dtype: torch.dtype | None = None) -> torch.Tensor:
        """This rank's piece of ``pc``'s current values, zero-padded, in the backup dtype."""
        dtype = dtype or _backup_dtype(pc.param.dtype)
        if pc.sharded:
            local = pc.param.to_local().detach()
            if local.numel() == 0:
                return torch.zeros(pc.shape, dtype=dtype, device=local.device)
            return local.to(dtype, copy=True).contiguous()
        p = pc.param.detach()
        flat = p.reshape(-1, *p.shape[1:]) if p.dim() else p.reshape(1)
        lo = self.local_rank * pc.rows
        part = flat[lo: lo + pc.rows]
        out = torch.zeros(pc.shape, dtype=dtype, device=p.device)
        if part.shape[0]:
            out[: part.shape[0]] = part
        return out

    def _agree_settings(self, named: list) -> None:
        """One MAX all-reduce over WORLD of a fingerprint of the model and the settings: ranks that differ
        raise ``ValueError`` on every rank (a silent mismatch would average unrelated tensors)."""
        text = repr(([(n, tuple(p.shape), str(p.dtype)) for n, p in named], self.fragments, self.sync_every,
                     self.delay, self.alpha, None if self.compressor is None else self.compressor.config(),
                     self.topology.layout))
        h = int.from_bytes(hashlib.sha1(text.encode()).digest()[:7], "little")
        mine = torch.tensor([h, -h], dtype=torch.int64, device=self.device)  # NCCL reduces device tensors only
        if self.topology.world_size > 1:
            wait_work(dist.all_reduce(mine, op=ReduceOp.MAX, async_op=True), self.timeout, f"{_NAME}/agree")
            if int(mine[0]) != -int(mine[1]):
                raise ValueError(f"{_NAME}: the ranks' models or settings differ (parameter names, shapes or dtypes, "
                                 f"fragments, sync_every, delay, alpha, compressor or workers); build the same "
                                 f"model and DiLoCo on every rank")

    @torch.no_grad()
    def _broadcast_start(self) -> None:
        """Every worker starts from worker 0's weights: along the rails (shards and replicas), then, for
        replicated parameters, inside the worker from its first rank (which DDP does too)."""
        if self.topology.world_size == 1:
            return
        pieces = list(self._pieces.values())
        for group, src, todo in ((self._rail, self._rail_src, pieces),
                                 (self.worker_group, self._intra_src, [pc for pc in pieces if not pc.sharded])):
            if group is None or not todo:
                continue
            tensors = [_local(pc.param).detach() for pc in todo]
            flat = torch.cat([t.reshape(-1) for t in tensors]) if tensors else None
            if flat is None or flat.numel() == 0:
                continue
            wait_work(dist.broadcast(flat, src=src, group=group, async_op=True), self.timeout,
                      f"{_NAME}/broadcast")
            pos = 0
            for t in tensors:
                t.copy_(flat[pos: pos + t.numel()].view_as(t))
                pos += t.numel()

    # ------------------------------------------------------------------------------- the loop
    def step(self) -> None:
        """After each inner optimizer step, on every rank: apply the outer steps now due, then issue the
        reductions of the fragments whose turn it is (applied now when ``delay`` is 0).

        Raises:
            NonFiniteError: an averaged pseudo-gradient holds NaN/Inf, on every rank, at its outer step
                (the adoption's step, or the step before it: module docstring); nothing is applied
                (the backups, the outer state and the residuals are unchanged; the local weights stay).
            CommTimeoutError: a worker did not reach the sync within ``timeout``.
        """
        self.steps += 1
        t = self.steps
        if self.elastic is not None:
            self.elastic.sync_due(t)
            return
        for pending in [p for p in self._pending if p.due <= t]:
            self._apply(pending)
        if self.delay >= 2 and self.worker_group is not None:
            # The outer step of a fragment due at the next step now, so that the worker's all-gather of
            # its new pieces overlaps that inner step instead of waiting in front of it.
            for pending in [p for p in self._pending
                            if p.due == t + 1 and not p.stepped and self._replicated(p.fragment)]:
                self._outer_step(pending, gather_async=True)
        for f, off in enumerate(self.offsets):
            if t % self.sync_every == off % self.sync_every:
                pending = self._issue(f, t + self.delay)
                if self.delay == 0:
                    self._apply(pending)

    def synchronize(self) -> None:
        """Wait for every reduction in flight and apply it now (before its due step), its adoption mixed
        with ``alpha`` as at its due step. The model still holds local weights where fragments trained
        since their last sync: :meth:`global_state_dict` and :meth:`finalize` give the global model."""
        for pending in list(self._pending):
            self._apply(pending)

    @torch.no_grad()
    def global_state_dict(self) -> dict[str, torch.Tensor]:
        """The global model, to evaluate or save at any step; training is unchanged. Collective inside the
        worker where it has several ranks holding replicated parameters (DDP inside): one all-gather of
        the global pieces on :attr:`worker_group` (call it on every rank, at the same step); no
        communication otherwise. A reduction still in flight is not in it: call :meth:`synchronize`
        first to include it, or :meth:`finalize` for the final model.

        Returns:
            ``model.state_dict()`` with every synchronised parameter replaced by its global weights as of
            its fragment's last outer step (the weights the outer optimizer holds), in the parameter's
            dtype, on the model's device, copied (later outer steps do not change them): the same on
            every rank of every worker, whatever the workers trained since. FSDP2 parameters come as
            DTensors sharded as the model's (the same ``full_tensor()`` everywhere; save them with
            ``torch.distributed.checkpoint``), the others as whole tensors. What is not synchronised
            (buffers such as BatchNorm statistics, frozen parameters) is this rank's own, sharing storage
            with the model as in ``model.state_dict()``.
        """
        state = self.model.state_dict()
        keys: dict[int, list[str]] = {}  # a tied parameter is in the state_dict under each of its names
        for n, p in self.model.named_parameters(remove_duplicate=False):
            keys.setdefault(id(p), []).append(n)
        pieces = self._replicated()
        gather = self._gather_issue(pieces)
        full = self._gathered(gather, pieces) if gather is not None else {}
        for n, pc in self._pieces.items():
            p = pc.param
            if pc.sharded:
                local = p.to_local()
                mine = self.backups[n].to(self.device, p.dtype, copy=True)
                mine = mine.view_as(local) if local.numel() else torch.empty_like(local)
                value = DTensor.from_local(mine, p.device_mesh, p.placements, run_check=False, shape=p.shape,
                                           stride=p.stride())
            elif n in full:
                value = full[n].clone()
            else:
                value = self.backups[n].to(self.device, p.dtype, copy=True).reshape(p.shape)
            names = [k for k in keys.get(id(p), [n]) if k in state]
            if not names:
                raise ValueError(f"{_NAME}: model.state_dict() has no entry for the synchronised parameter {n!r} "
                                 f"(a state_dict hook renames or drops it); read the global weights of the "
                                 f"parameters from the model's own names")
            for k in names:
                state[k] = value
        return state

    @torch.no_grad()
    def finalize(self) -> None:
        """The end of training: every fragment's last sync, then the model holds the global weights.

        (1) Every reduction in flight is waited for and applied; (2) every fragment whose workers
        trained since its last reduction was issued runs one more outer step, of what they trained since
        (for one whose reduction was in flight, of what they trained after its issue), so that no inner
        step is lost; (3) the model's synchronised parameters are set to the global weights, with no
        ``alpha`` mixing: every rank of every worker then holds the same model, equal to
        :meth:`global_state_dict`. With outer ``SGD(lr=1)`` without momentum and exact reductions, that
        is the mean of the workers' local weights at the call. A fragment whose local weights are its
        global ones on every rank (agreed by one small MAX all-reduce over WORLD), or that synced at this
        step, takes no further outer step: one on a zero pseudo-gradient would still move the weights by
        the momentum.

        Training may go on after it, on the usual schedule (the syncs it ran are extra outer steps; to
        evaluate mid-run without changing the run, use :meth:`global_state_dict`). Collective like
        :meth:`step`: call it on every rank, after the same step. A reduction in flight restored from a
        checkpoint taken after its outer step ran early (``delay >= 2`` with DDP inside) is adopted
        instead: its workers' last ``delay - 1`` inner steps are dropped, as its adoption would.

        Raises:
            NonFiniteError, CommTimeoutError: as :meth:`step` (the fragments synced before it keep their
                global weights; the others keep their local weights).
        """
        t = self.steps
        if t == 0:
            return  # nothing trained: the model holds the start's weights, the global ones
        if self.elastic is not None:
            for f, off in enumerate(self.offsets):
                if t % self.sync_every != off % self.sync_every:
                    self.elastic.round(f, final=True)
                elif self.alpha:
                    self._write(f, None, 0.0)
            return
        equal: set[int] = set()  # fragments whose model weights are their global ones
        carried: dict[int, list[torch.Tensor]] = {}  # this rank's pseudo-gradient of what trained since the issue
        for pending in list(self._pending):
            f, names = pending.fragment, self.fragments[pending.fragment]
            issued_now = pending.due - self.delay == t
            if not issued_now and not pending.stepped:
                pending.base = [self.backups[n].to(self.device) - d for n, d in zip(names, self._averaged(pending))]
            if issued_now or pending.base is None:
                self._apply(pending, alpha=0.0)
                equal.add(f)
                continue
            carried[f] = [b - self._read_piece(self._pieces[n], b.dtype) for n, b in zip(names, pending.base)]
            if not pending.stepped:
                self._outer_step(pending, gather_async=False)
            if pending.gather is not None:  # its weights are superseded by the last sync's
                wait_work(pending.gather[0], self.timeout, f"{_NAME}/gather")
            self._pending.remove(pending)
        # Which fragments' local weights differ from their global ones, agreed over WORLD (a rank's own
        # piece may be unchanged where another's is not).
        rest = [f for f in range(len(self.fragments)) if f not in equal and f not in carried]
        differs = torch.zeros(len(self.fragments), device=self.device)
        for f in rest:
            differs[f] = float(any(not torch.equal(self._read_piece(pc, pc.param.dtype), self.backups[pc.name].to(
                self.device, pc.param.dtype)) for pc in map(self._pieces.get, self.fragments[f])))
        if self.topology.world_size > 1 and rest:
            wait_work(dist.all_reduce(differs, op=ReduceOp.MAX, async_op=True), self.timeout, f"{_NAME}/finalize")
        todo = sorted(carried)
        for f in rest:
            if not differs[f]:
                continue
            if self.delay == 0 and self.alpha and t % self.sync_every == self.offsets[f] % self.sync_every:
                self._write(f, None, 0.0)  # synced at this step, mixed with alpha: nothing trained since
            else:
                todo.append(f)
        todo.sort()
        issued = [self._issue(f, t, carried.get(f)) for f in todo]  # the rail reductions overlap one another
        for pending in issued:
            self._outer_step(pending, gather_async=False)
            self._adopt(pending, alpha=0.0)

    @torch.no_grad()
    def _issue(self, f: int, due: int, deltas: list[torch.Tensor] | None = None) -> _Pending:
        """Fragment ``f``'s pseudo-gradient pieces (``deltas``, default global - local), reduced (AVG)
        along the rail, asynchronously."""
        names = self.fragments[f]
        if deltas is None:
            deltas = [self.backups[n].to(self.device) - self._read_piece(self._pieces[n], self.backups[n].dtype)
                      for n in names]
        step = self._reductions
        self._reductions += 1
        # Where the links differ the reduction runs on the rail's own topology, and auto may take synth
        # there: the bytes are counted with the algorithm that runs (every rank of a rail picks the same).
        rails = self._rail_topology
        numels, shapes = [d.numel() for d in deltas], [tuple(d.shape) for d in deltas]
        algo, where = "rail", self.topology
        if rails is not None and self.num_workers > 1:
            where = rails
            algo = (auto.choose(self.compressor, deltas, rails, timeout=self.timeout) if self.compressor is not None
                    else select_algorithm("allreduce", "auto", sum(numels) * deltas[0].element_size(), rails,
                                          self.timeout))
        traffic = auto.traffic(algo, self.compressor, numels, shapes, deltas[0].element_size(), where, step=step)
        self.outer_bytes += traffic.sent(where.rank)
        if self.num_workers == 1:
            fut, kind = None, "local"
        elif self.compressor is not None:
            fut = reduce_tensors(self.compressor, deltas, list(names), group=self._rail if rails else None,
                                 topology=where, algorithm=algo, average=True, step=step, seed=0,
                                 feedback=self.error_feedback if self._use_ef else None,
                                 state=self.compressor_state, timeout=self.timeout)
            kind = "compressed"
        else:
            flat = torch.cat([d.reshape(-1) for d in deltas])
            # agreement=False: the pieces match along the rail by construction (_agree_settings); a check
            # here would queue behind a reduction still in flight on the rail group and block this thread.
            fut = all_reduce(flat, ReduceOp.AVG, group=self._rail, topology=rails,
                             algorithm="flat" if rails is None else algo, async_op=True,
                             timeout=self.timeout, agreement=False)
            deltas = [flat]
            kind = "exact"
        pending = _Pending(f, due, deltas, fut, kind)
        self._pending.append(pending)
        return pending

    def _averaged(self, pending: _Pending) -> list[torch.Tensor]:
        """The averaged pieces of ``pending`` (waiting for its reduction)."""
        if pending.future is not None:
            wait(pending.future, self.timeout, op=f"{_NAME}/rail")
            pending.future = None
        if pending.kind == "exact":
            flat, out, pos = pending.deltas[0], [], 0
            for n in self.fragments[pending.fragment]:
                shape = self._pieces[n].shape
                k = math.prod(shape)
                out.append(flat[pos: pos + k].view(shape))
                pos += k
            pending.deltas, pending.kind = out, "done"
        return pending.deltas

    @property
    def generation(self) -> int:
        """Elastic: the membership generation of the last committed outer sync (0 before); static: 0."""
        return self.elastic.generation if self.elastic is not None else 0

    @property
    def members(self) -> tuple[int, ...]:
        """The workers of the last outer sync (elastic: its generation's nodes; static: every worker)."""
        return self.elastic.members if self.elastic is not None else tuple(range(self.num_workers))

    @property
    def events(self) -> list[tuple[str, int, int, float]]:
        """Elastic: ``(kind, worker, step, seconds)``, workers "lost" and "joined" and syncs "redone" as seen
        at the committed syncs (``ElasticSync.events``); static: []."""
        return list(self.elastic.events) if self.elastic is not None else []

    def close(self) -> None:
        """Elastic: leave the membership (if DiLoCo made it) and drop the generation's group; the model
        and the state stay usable. No-op otherwise."""
        if self.elastic is not None:
            self.elastic.close()

    def _apply_averaged(self, f: int, averaged: list[torch.Tensor], alpha: float | None) -> None:
        """Fragment ``f``'s outer step on an averaged pseudo-gradient reduced elsewhere, and its adoption."""
        pending = _Pending(f, self.steps, averaged, None, "done")
        self._pending.append(pending)
        self._apply(pending, alpha)

    @torch.no_grad()
    def _apply(self, pending: _Pending, alpha: float | None = None) -> None:
        """Fragment ``pending``'s outer step (unless it ran a step before) and the adoption of the new
        global weights (mixed with ``alpha``, default the run's)."""
        if not pending.stepped:
            self._outer_step(pending, gather_async=False)
        self._adopt(pending, alpha)

    @torch.no_grad()
    def _outer_step(self, pending: _Pending, gather_async: bool) -> None:
        """Wait for the reduction, agree inside the worker that it is finite, step the outer optimizer on
        the backups; with ``gather_async``, issue the worker's all-gather of the new global pieces."""
        deltas = self._averaged(pending)
        f = pending.fragment
        names = self.fragments[f]
        # Rail j's average is the same on every worker; the worker's ranks agree on every rail's
        # flag, so every rank of the world takes the same branch.
        bad = torch.tensor([0.0 if all(all_finite(d) for d in deltas) else 1.0], device=self.device)
        if self.worker_group is not None:
            wait_work(dist.all_reduce(bad, op=ReduceOp.MAX, group=self.worker_group, async_op=True), self.timeout,
                      f"{_NAME}/finite")
        if float(bad) > 0:
            self._pending.remove(pending)
            raise NonFiniteError(f"{_NAME}: the averaged pseudo-gradient of fragment {f} holds NaN/Inf (a worker's "
                                 f"weights diverged); nothing was applied: the global weights, the outer optimizer "
                                 f"and the residuals are unchanged and the workers keep their local weights. Lower "
                                 f"the inner learning rate or restore a checkpoint", op=f"{_NAME}/outer_step")
        opt = self.outer_optimizers[f]
        if gather_async:  # adopted at the next step: what finalize() would need before then
            pending.base = [self.backups[n].to(self.device) - d for n, d in zip(names, deltas)]
        for n, d in zip(names, deltas):
            backup = self.backups[n]
            backup.grad = d.to(self.backup_device, backup.dtype)
        opt.step()
        opt.zero_grad(set_to_none=True)
        pending.stepped, pending.deltas = True, []
        if gather_async:
            pending.gather = self._gather_issue(self._replicated(f))

    def _replicated(self, f: int | None = None) -> list[_Piece]:
        """Fragment ``f``'s (None: every fragment's) pieces of replicated parameters in a worker of several
        ranks: what an all-gather inside the worker assembles."""
        if self.worker_group is None:
            return []
        names = [n for frag in self.fragments for n in frag] if f is None else self.fragments[f]
        return [self._pieces[n] for n in names if not self._pieces[n].sharded]

    def _gather_issue(self, pieces: list[_Piece]) -> tuple | None:
        """The worker's all-gather of the global weights of ``pieces`` (replicated parameters), issued:
        ``(work, output, this rank's input)``, or None when there are none."""
        if not pieces:
            return None
        mine = torch.cat([self.backups[pc.name].to(self.device, pc.param.dtype).reshape(-1) for pc in pieces])
        out = mine.new_empty(self.local_size * mine.numel())
        # The backend's own all-gather, as the start's broadcast: the pieces match inside the worker by
        # construction (_agree_settings), so commopt's agreement check and engine hop would only add a
        # round trip and a thread hand-off.
        return all_gather_single(out, mine, group=self.worker_group, async_op=True), out, mine

    def _gathered(self, gather: tuple, pieces: list[_Piece]) -> dict[str, torch.Tensor]:
        """The whole global weights of ``pieces`` once ``gather`` (their all-gather) lands: views of its
        output, by name, shaped as the parameters."""
        work, out, mine = gather
        wait_work(work, self.timeout, f"{_NAME}/gather")
        rows, full, pos = out.view(self.local_size, mine.numel()), {}, 0
        for pc in pieces:
            k = math.prod(pc.shape)
            whole = rows[:, pos: pos + k].reshape(self.local_size * pc.rows, *pc.shape[1:])
            n0 = pc.param.shape[0] if pc.param.dim() else 1
            full[pc.name] = whole[:n0].reshape(pc.param.shape)  # the padding rows dropped
            pos += k
        return full

    def _adopt(self, pending: _Pending, alpha: float | None = None) -> None:
        """The workers adopt fragment ``pending``'s new global weights, mixed with their local ones
        (``alpha``, default the run's)."""
        gather, pending.gather = pending.gather, None
        self._pending.remove(pending)
        self._write(pending.fragment, gather, self.alpha if alpha is None else alpha)

    @torch.no_grad()
    def _write(self, f: int, gather: tuple | None, alpha: float) -> None:
        """Fragment ``f``'s global weights into the model, mixed with the local ones: ``(1 - alpha) *
        global + alpha * local`` (``gather``: the all-gather of its replicated pieces, if issued)."""
        pieces = self._replicated(f)
        if gather is None:
            gather = self._gather_issue(pieces)
        full = self._gathered(gather, pieces) if gather is not None else {}
        for n in self.fragments[f]:
            pc = self._pieces[n]
            p = pc.param.detach()
            if pc.sharded:
                local = pc.param.to_local()
                if local.numel():
                    local.copy_(self._mixed(self.backups[n].to(self.device, p.dtype).view_as(local), local, alpha))
            elif n in full:
                p.copy_(self._mixed(full[n], p, alpha))
            else:  # one rank per worker: the piece is the whole parameter
                p.copy_(self._mixed(self.backups[n].to(self.device, p.dtype).reshape(p.shape), p, alpha))

    @staticmethod
    def _mixed(new: torch.Tensor, local: torch.Tensor, alpha: float) -> torch.Tensor:
        """``(1 - alpha) * new + alpha * local`` (``new`` itself for alpha 0)."""
        return (1.0 - alpha) * new + alpha * local if alpha else new

    # ------------------------------------------------------------------------------- state
    def _meta(self) -> dict:
        return {"world_size": self.topology.world_size, "workers": self.topology.layout,
                "rank": self.topology.rank, "fragments": [list(f) for f in self.fragments],
                "sync_every": self.sync_every, "delay": self.delay,
                "compressor": None if self.compressor is None else dict(self.compressor.config())}

    def state_dict(self) -> dict:
        """This rank's outer state: its backup pieces, the outer optimizers, the residuals, the compressor's
        state, the step, the fragment schedule and the reductions in flight (waited for and kept, to be
        applied at their due steps after a restart). A copy (training on does not change it); tensors,
        numbers and strings only (``torch.load(weights_only=True)`` reads it); one per rank, like a
        sharded checkpoint."""
        pending = []
        for p in self._pending:
            # A fragment whose outer step ran (due at the next step) keeps no deltas: its new weights are
            # in the backups, gathered again when it lands after a restart.
            deltas = [] if p.stepped else self._averaged(p)
            pending.append({"fragment": p.fragment, "due": p.due, "stepped": p.stepped,
                            "deltas": [d.detach().clone() for d in deltas]})
        return {"meta": self._meta(), "steps": self.steps, "reductions": self._reductions,
                "offsets": list(self.offsets),
                "backups": {n: b.detach().clone() for n, b in self.backups.items()},
                "outer_optimizers": [cloned(opt.state_dict()) for opt in self.outer_optimizers],
                "error_feedback": self.error_feedback.state_dict(),
                "compressor_state": None if self.compressor_state is None else self.compressor_state.state_dict(),
                "pending": pending}

    def load_state_dict(self, state: dict) -> None:
        """Restore :meth:`state_dict` of the same rank, world, workers and settings (the model's own
        weights and the inner optimizer are the user's checkpoint). Every entry is checked first (see
        ``schedules/_diloco_state.py``): the keys, the settings, and every tensor's shape and dtype
        against this rank's pieces of the model, the fragments, the reductions in flight and the outer
        optimizers' parameters; a failed load leaves this DiLoCo as it was. Tensors may be on any device
        (they are copied to DiLoCo's); ``state`` is not kept (nothing aliases it).

        Raises:
            ValueError: the checkpoint was taken with another world size, worker layout, rank, fragments,
                sync_every, delay or compressor, or holds other parameters, or an entry of another shape,
                dtype or kind than this run's (naming it, e.g. ``state['pending'][0]['deltas'][1]: shape
                [3, 4], expected [6, 4] (this rank's piece of 'fc.weight')``), or a missing or unknown key,
                or outer optimizer states that do not load into this DiLoCo's outer optimizers (another
                type), or is not a whole :meth:`state_dict`. Nothing is loaded.
        """
        pieces = {n: (tuple(b.shape), b.dtype) for n, b in self.backups.items()}
        names = {id(b): n for n, b in self.backups.items()}
        check_state(state, Expected(self._meta(), pieces, self.fragments, self.outer_optimizers, names,
                                    self.sync_every, self.delay, list(self.offsets), self.compressor))
        # What is in flight here lands first: a compressed reduction writes the residuals when it completes.
        for p in self._pending:
            if p.future is not None:
                wait(p.future, self.timeout, op=f"{_NAME}/rail")
                p.future = None
            if p.gather is not None:  # every rank of the worker issued it
                wait_work(p.gather[0], self.timeout, f"{_NAME}/gather")
                p.gather = None
        # The outer optimizers first: one that does not take its state (another type) leaves every one as it was.
        before = [opt.state_dict() for opt in self.outer_optimizers]
        for f, (opt, sd) in enumerate(zip(self.outer_optimizers, state["outer_optimizers"])):
            try:
                opt.load_state_dict(cloned(sd))
            except (KeyError, ValueError, TypeError, RuntimeError) as exc:
                for o, old in zip(self.outer_optimizers, before):
                    o.load_state_dict(old)
                raise ValueError(f"{_NAME}: the checkpoint's outer optimizer state of fragment {f} does not load into "
                                 f"this {type(opt).__name__} ({type(exc).__name__}: {exc}); build DiLoCo with the "
                                 f"outer_optimizer the checkpoint was taken with") from None
        with torch.no_grad():
            for n, b in state["backups"].items():
                self.backups[n].copy_(b)
        self.error_feedback.load_state_dict(state["error_feedback"])
        if self.compressor_state is not None and state.get("compressor_state") is not None:
            self.compressor_state.load_state_dict(state["compressor_state"])
        self.steps, self._reductions = int(state["steps"]), int(state["reductions"])
        self._pending = []
        for p in state["pending"]:
            deltas = [d.to(self.device, copy=True) for d in p["deltas"]]
            pending = _Pending(int(p["fragment"]), int(p["due"]), deltas, None, "done")
            pending.stepped = bool(p.get("stepped", False))
            self._pending.append(pending)


# --------------------------------------------------------------------------------- helpers
def _backup_dtype(dtype: torch.dtype) -> torch.dtype:
    """The global weights in at least fp32: the outer step's small updates would vanish in bf16/fp16."""
    return torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype
