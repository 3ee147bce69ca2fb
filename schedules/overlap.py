"""``OverlapDataParallel``: gradient reduction overlapped with backward *and* the next forward.

DDP hides communication behind backward, but its optimizer step waits for the last bucket and the
next forward waits for the step. Here (docs/architecture.md section 5.8, ByteScheduler's idea on plain PyTorch):

(1) backward: as each parameter's gradient is accumulated, it is copied into its bucket's flat
    buffer; a bucket whose gradients are all in is *ready*;
(2) the chunks of a shared :class:`~commopt.schedules.plan.IssuePlan` (partitioned, ordered by the
    next forward's need, at most ``credit`` bytes in flight) go to the comm engine in plan order,
    never in local readiness order (docs/architecture.md section 3, rule 2): when a bucket becomes ready, the training
    thread submits every chunk of the plan whose bucket, and whose predecessors' buckets, are
    ready (those that became issuable together as one engine op). All of them go to one engine
    queue, the wrapper's private group's, whose worker starts them in that order, each once the
    credit allows it; flat chunks alternate between two private groups, both issued from that
    queue, hierarchical ones enter the algorithm's own queues from it.
    The plan comes from shapes for the first step, then from timings profiled on rank 0 and
    broadcast, re-planned every ``replan_every`` steps: the broadcast is queued in the same queue
    when the step's backward begins, behind the previous step's chunks, so every rank's engine
    runs it at the same point of its issue sequence, and the step's chunks follow once it arrived
    (the training thread checks at each ready bucket and waits for it at its next wait);
(3) next forward: a pre-hook on every module with parameters waits only for the buckets holding
    that module's parameters, so layer 1 computes while layer 7's gradients are still on the wire.
    When the bucket it waits for is reduced, the training thread runs that bucket's own optimizer
    (``optimizer_factory(params)``, one per bucket; with it every other bucket already reduced)
    and clears its gradients. Each bucket steps by its own optimizer over disjoint parameters, so
    the result does not depend on timing. Nothing issues a collective from a future callback
    (rule 1): callbacks only count completions;
(4) a tensor hook on every parameter makes the next backward apply its bucket's previous update
    before accumulating into it, and the end of that backward applies what no forward or gradient
    needed (so no update is ever skipped).

Why the training thread steps the optimizer, not a thread of its own: such a thread makes no update
sooner, as the update's compute runs on the device that runs forward and backward (the same core on
a CPU, the same GPU's queue otherwise), and it adds a wake-up and hand-offs of the interpreter lock
for every bucket. The update runs under the thread-local state it would have had on a thread of its
own: gradients off (the optimizer's doing), inference mode and autocast off.

The training loop has no ``optimizer.step()``: ``loss = f(odp(x)); loss.backward()`` is one step.
Gradient accumulation: run the first micro-batches under ``with odp.no_sync():``. ``synchronize()``
waits for the pending step (before evaluation, checkpointing or reading parameters directly).

Partition and credit, unless given: chosen from the alpha-beta model of the link the chunks cross
(``comm.cost.model_for(topology)``: the inter-node level on more than one node, else the intra-node
one), by :func:`~commopt.schedules.priority.partition_for` (the smallest power of two ``P`` with
``P >= 9 alpha / beta``, i.e. latency at most ~10 % of a chunk's time, clamped to [2 MiB, 16 MiB]
and to the largest bucket) and :func:`~commopt.schedules.priority.credit_for` (two chunks or the
bandwidth-delay product ``alpha / beta``, the larger). The model is broadcast from rank 0, so every
rank gets the same numbers. A re-plan applies the same rule to rank 0's fit of its profiled busy
periods (:meth:`StepProfile.service_fit`, when periods of two mean chunk sizes or more were measured
and the fit found a per-byte cost) and broadcasts the result with the plan; local timings never decide
anything on their own rank (docs/architecture.md section 3, rule 2). ``partition_bytes`` and ``credit_bytes`` give the
numbers in use; the choice is logged (``logging``, this module's logger, INFO).

Checkpointing: the optimizer is one per bucket, so there is no single ``optimizer.state_dict()``.
``optimizer_state_dict()`` returns the state of all of them keyed by parameter *name*
(:mod:`commopt.schedules.checkpoint`), which ``load_optimizer_state_dict()`` loads into a wrapper of
the same model built with any bucket caps; it survives ``torch.save`` /
``torch.load(weights_only=True)``. Save ``odp.module.state_dict()`` beside it. Compressor error
feedback is not part of it (a resumed compressed run restarts its residuals from zero).

Assumptions, as in ByteScheduler: a module's forward reads its own parameters (a forward that reads
another module's parameters functionally should call ``synchronize()`` first); gradient clipping by
global norm is not available (each bucket steps on its own); parameters without a gradient in a
step contribute zeros and are stepped with the averaged gradient (DDP's behaviour for parameters
unused on some ranks; for parameters unused on every rank a stateful optimizer still updates its
moments).
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import sys
import threading
import time
from collections import deque
from collections.abc import Iterator
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed import ProcessGroup

from commopt.comm import algorithms, context, cost
from commopt.comm.collectives import select_algorithm
from commopt.comm.compression import Compressor, ErrorFeedback
from commopt.comm.engine import wait
from commopt.comm.errors import CommError, CommTimeoutError
from commopt.comm.hooks import check_dense_gradients
from commopt.comm.topology import Topology

from . import checkpoint
from ._overlap_issue import Issuer, Step, left
from .plan import IssuePlan, build_buckets
from .priority import credit_for, fifo_plan, partition_for
from .profile import StepProfile

__all__ = ["OverlapDataParallel", "OptimizerFactory", "StepProfile"]

_MB = 1024 * 1024
_log = logging.getLogger(__name__)
_CLOSE_WAIT = 10.0  # seconds close() waits for the wrapper's queued engine work before releasing its groups

OptimizerFactory = Callable[[list[nn.Parameter]], torch.optim.Optimizer]


class OverlapDataParallel(Issuer, nn.Module):
    """Data parallelism with per-bucket optimizer steps and priority-planned, overlapped reduction.

    The chunks' reductions go through the comm engine: the training thread submits them in plan
    order, the engine queue of the wrapper's private group starts them one after another (each when
    the credit allows it), and the plan broadcasts of re-planning run in the same queue. So there
    is no scheduler beside the engine: one queue, fed by one thread, orders everything the wrapper
    issues, and every rank issues the same sequence (docs/architecture.md section 3). Measured against the private
    issuer thread this replaced (2 ranks, gloo loopback, a 6-layer TinyGPT, interleaved rounds): the same
    steady step time within +-3 % (flat with the model's sizes, flat with 256 KiB chunks under a
    512 KiB credit, hierarchical on 1x2) and bit-identical parameters.

    Args:
        module: the model (identical structure on every rank; rank 0's parameters and buffers are
            broadcast at construction, as DDP does).
        optimizer_factory: ``params -> optimizer``; called once per bucket with that bucket's
            parameters (per-parameter optimizers such as SGD and AdamW then behave exactly as one
            optimizer over the whole model).
        topology: layout of the process group (None: detected).
        algorithm: any all-reduce algorithm of ``commopt.comm`` ("auto", "flat", "hierarchical",
            "leader"); with a compressor "auto", "flat" or "hierarchical".
        compressor: a ``commopt.comm.compression`` compressor (buckets are then reduced whole, as the
            compressors and their error feedback work on whole tensors).
        bucket_cap_mb: bucket size cap in MiB.
        first_bucket_cap_mb: cap of the first bucket (small, so reduction starts early in backward).
        plan: "priority" (partition, next-forward priority, credit) or "fifo" (ready order, whole
            buckets, no credit: DDP's order, still overlapped with the next forward).
        partition_mb: chunk size of the priority plan in MiB (None: chosen from the cost model of
            the topology, then from rank 0's profile at each re-plan; see the module docstring;
            0: whole buckets).
        credit_mb: the most MiB in flight (None: two chunks or the link's bandwidth-delay product,
            whichever is larger, from the same model and, at each re-plan, from rank 0's profile;
            0: unbounded). ``partition_bytes`` / ``credit_bytes`` give the values in use and
            ``link_model`` the model they were first chosen from.
        replan_every: re-plan from rank 0's profile after the first step and then every so many
            steps (0: keep the shape-only plan).
        process_group: the group to train over (None: WORLD). A private copy of it carries the
            flat reductions and plan broadcasts, so the training loop's own collectives on WORLD
            can never interleave with them.
        error_feedback: residual memory for biased compressors (keyed by parameter name).
        seed: seed of compressor randomness, identical on every rank.
        timeout: seconds a wait for a reduction may take before ``CommTimeoutError`` (None: the
            backend's own timeout).
    """

    def __init__(self, module: nn.Module, optimizer_factory: OptimizerFactory, *, topology: Topology | None = None,
                 algorithm: str = "auto", compressor: Compressor | None = None, bucket_cap_mb: float = 25,
                 first_bucket_cap_mb: float = 1, plan: str = "priority", partition_mb: float | None = None,
                 credit_mb: float | None = None, replan_every: int = 100, process_group: ProcessGroup | None = None,
                 error_feedback: bool = True, seed: int = 0, timeout: float | None = None):
        super().__init__()
        if plan not in ("priority", "fifo"):
            raise ValueError(f"plan={plan!r}: choose 'priority' or 'fifo'")
        if replan_every < 0:
            raise ValueError(f"replan_every must be >= 0, got {replan_every}")
        self.module = module
        self.algorithm = algorithm
        self.compressor = compressor
        self.plan_kind = plan
        self.replan_every = int(replan_every)
        self.seed = int(seed)
        self.timeout = timeout
        names = {id(p): n for n, p in module.named_parameters()}
        self._params = [p for p in module.parameters() if p.requires_grad]
        for p in self._params:
            if not p.is_floating_point():
                raise TypeError(f"parameter {names.get(id(p))} has dtype {p.dtype}; OverlapDataParallel "
                                f"reduces floating-point gradients only")
        check_dense_gradients(module, "OverlapDataParallel")
        self._keys = [names.get(id(p), f"param{i}") for i, p in enumerate(self._params)]
        self._distributed = dist.is_initialized() and dist.get_world_size(process_group) > 1
        self._group: ProcessGroup | None = None
        self._streams: list[ProcessGroup] = []
        self._process_group = process_group
        if self._distributed:
            ranks = None if process_group is None else dist.get_process_group_ranks(process_group)
            self._group = dist.new_group(ranks)
            # Flat reductions alternate between two private groups, chunk by chunk in plan order (the
            # same on every rank): one group runs its collectives one after another, and the gap
            # between two (both ranks post, the first bytes ramp up) left the link idle between chunks.
            self._streams = [self._group, dist.new_group(ranks)]
            self._src = 0 if process_group is None else dist.get_global_rank(process_group, 0)
            self._rank = dist.get_rank(process_group)
            # The user's topology (or the detected one) keeps its group: hierarchical phases run on
            # its derived role groups; only flat reductions and plan broadcasts use the private group.
            self._topology = context().topology(topology, process_group) if algorithm != "flat" else topology
            with torch.no_grad():
                for t in itertools.chain(module.parameters(), module.buffers()):
                    dist.broadcast(t.data, src=self._src, group=self._group)
        else:
            self._src, self._rank, self._topology = 0, 0, topology
        self._feedback = ErrorFeedback() if compressor is not None and error_feedback else None
        # This wrapper's own per-run compressor state (PowerSGD's Q memory): a compressor
        # configuration may serve other models too.
        self._compressor_state = compressor.new_state() if compressor is not None else None
        shapes = [(p.numel(), p.dtype) for p in self._params]
        self.buckets = build_buckets(shapes, cap_bytes=bucket_cap_mb * _MB, first_cap_bytes=first_bucket_cap_mb * _MB)
        self._bucket_of = self.buckets.bucket_of()
        device = self._params[0].device if self._params else torch.device("cpu")
        # The engine orders CUDA work after the submitting stream; one process runs its phases inline.
        self._device = device if self._distributed else None
        self._flat = [torch.zeros(b.numel, dtype=b.dtype, device=device) for b in self.buckets.buckets]
        # Each parameter's gradient slot, a view of its bucket's buffer, made once (hooks run per
        # parameter and step).
        self._views: list[torch.Tensor] = [torch.empty(0)] * len(self._params)
        for b in self.buckets.buckets:
            for i, off, n in zip(b.params, b.offsets, b.numels):
                self._views[i] = self._flat[b.index][off: off + n].view(self._params[i].shape)
        self.optimizers = [optimizer_factory([self._params[i] for i in b.params]) for b in self.buckets.buckets]
        # The user's fixed values (None: chosen from the link model, and again at each re-plan).
        self._user_partition = None if partition_mb is None else int(partition_mb * _MB)
        self._user_credit = None if credit_mb is None else int(credit_mb * _MB)
        self.link_model: cost.LinkModel | None = None  # the model the sizes were chosen from, if any
        if plan == "priority" and compressor is None:
            if self._user_partition is None or self._user_credit is None:
                self.link_model, where = self._model_link()
                part, credit = self._sizes(self.link_model)
                _log.info("commopt overlap: partition %d B%s, credit %d B%s, from the cost model of the %s "
                          "(alpha %.3g s, beta %.3g s/B, %.4g Gbit/s)", part,
                          "" if self._user_partition is None else " (given)", credit,
                          "" if self._user_credit is None else " (given)", where, self.link_model.alpha,
                          self.link_model.beta, 8e-9 / self.link_model.beta if self.link_model.beta > 0 else 0.0)
            else:
                part, credit = self._user_partition, self._user_credit
        else:
            part, credit = 0, 0
        self._partition, self._credit = part, credit
        # Step 0 knows shapes only: ready order is the bucket order (built in expected-ready order)
        # and nothing is reordered until rank 0 has timings to simulate with.
        self.issue_plan = fifo_plan(self.buckets, partition_bytes=part, credit=credit)
        self._first_use: list[int] = []
        self._prepare()

        self._cv = threading.Condition()
        self._in_flight = 0
        self.max_in_flight = 0
        # What tests and benchmarks inspect: (step, bucket, start, stop) per issued chunk, the plan
        # each step followed, and this rank's profile of recent steps.
        self.issue_log: deque[tuple[int, int, int, int]] = deque(maxlen=100_000)
        self.plans: deque[tuple[int, IssuePlan]] = deque(maxlen=1000)
        self.profiles: deque[tuple[int, StepProfile]] = deque(maxlen=100)
        self._steps = 0
        self._last: Step | None = None
        self._guard: Step | None = None
        self._current: Step | None = None
        self._sync = True
        self._closed = False
        self._forward_end = 0.0
        self._forward_use: list[int] | None = None
        self._in_backward = False
        # The last op submitted (the queue is FIFO: when it is done, so is all the wrapper's work).
        self._tail: torch.futures.Future | None = None
        # The body of every forward pre-hook; forward() hides it from torch.compile once it is in use.
        self._before_module: Callable[[list[int], list[int]], None] = self._wait_for
        self._hidden = False
        self._handles = []
        for i, p in enumerate(self._params):
            self._handles.append(p.register_hook(self._make_guard(i)))
            self._handles.append(p.register_post_accumulate_grad_hook(self._make_ready(i)))
        index = {id(p): i for i, p in enumerate(self._params)}
        for m in module.modules():
            mine = sorted({index[id(p)] for p in m.parameters(recurse=False) if id(p) in index})
            if mine:
                self._handles.append(m.register_forward_pre_hook(self._make_pre_hook(mine)))

    # ----------------------------------------------------------------------------- public API
    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """The module's forward; each module first waits for its own parameters' pending update."""
        self._check_open()
        if not self._hidden and "torch._dynamo" in sys.modules:
            # torch.compile is in use in this process (it imports torch._dynamo): a compiled module would
            # trace the pre-hooks' waits and optimizer steps into its graphs, cut them in pieces and
            # rebuild them as the steps progress; they run eagerly, one graph break each
            # (docs/architecture.md section 5.10). Not done up front: importing torch._dynamo costs seconds.
            self._before_module = torch.compiler.disable(self._wait_for)
            self._hidden = True
        self._forward_use = []
        out = self.module(*args, **kwargs)
        self._forward_end = time.perf_counter()
        return out

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Accumulate gradients locally (no reduction, no step) for the backward passes inside."""
        old, self._sync = self._sync, False
        try:
            yield
        finally:
            self._sync = old

    def synchronize(self) -> None:
        """Wait until the last step's reductions and optimizer steps are all done; re-raise failures."""
        step = self._last
        if step is None:
            return
        for b in range(len(self.buckets.buckets)):
            self._wait_applied(step, b)

    def close(self) -> None:
        """Finish pending work, remove the hooks and release the private groups."""
        if self._closed:
            return
        try:
            self.synchronize()
        finally:
            with self._cv:
                self._closed = True  # chunks still queued (a failed step) are skipped, not issued
                self._cv.notify_all()
            tail = self._tail
            if tail is not None:
                with contextlib.suppress(Exception):
                    wait(tail, _CLOSE_WAIT, op="overlap/close")
            for h in self._handles:
                h.remove()
            self._handles = []
            engine = context().engine()
            for g in self._streams:
                engine.release(g, _CLOSE_WAIT)
                with contextlib.suppress(ValueError, RuntimeError):
                    dist.destroy_process_group(g)
            self._group, self._streams = None, []

    @property
    def partition_bytes(self) -> int:
        """The chunk size of the plan in use, in bytes (0: whole buckets; always 0 for ``plan="fifo"``
        and with a compressor). Identical on every rank."""
        return self.issue_plan.partition

    @property
    def credit_bytes(self) -> int:
        """The most bytes in flight under the plan in use (0: unbounded). Identical on every rank."""
        return self.issue_plan.credit

    def optimizer_state_dict(self) -> dict:
        """The state of every bucket's optimizer, keyed by parameter name, for a checkpoint.

        Waits for the pending step first (``synchronize()``), so no update is half applied. The
        result does not depend on the bucket layout: it loads into a wrapper of the same model built
        with other bucket caps. Like torch's ``Optimizer.state_dict()``, its tensors are the live
        state (save it, or copy it, before training on). Holds only tensors, numbers, strings,
        lists, tuples and dicts, so ``torch.load(..., weights_only=True)`` reads it back.

        Returns:
            ``{"format", "shapes": {name: [dims]}, "state": {name: {key: value}},
            "param_groups": [{hyperparameter: value, ..., "params": [names]}]}`` (one group per
            bucket optimizer's group; parameters without state yet have no ``state`` entry).
        """
        self.synchronize()
        return checkpoint.optimizer_state_dict(self.optimizers, self._params, self._keys)

    def load_optimizer_state_dict(self, state_dict: dict) -> None:
        """Load what :meth:`optimizer_state_dict` returned (possibly by a wrapper with other buckets).

        Waits for the pending step first. Every check runs before anything is changed: the
        checkpoint must name exactly this wrapper's trainable parameters with the same shapes
        (``ValueError`` naming the first parameter that differs otherwise), and parameters that
        share an optimizer group here must have had the same hyperparameters. Hyperparameters (a
        learning rate a scheduler changed, say) are restored per parameter, the state is copied (the
        checkpoint stays independent of this wrapper) and cast to each parameter's dtype and device
        as torch's ``Optimizer.load_state_dict`` does.

        Args:
            state_dict: the checkpoint, e.g. ``torch.load(path, weights_only=True)["optimizer"]``.
        """
        self.synchronize()
        checkpoint.load_optimizer_state_dict(self.optimizers, self._params, self._keys, state_dict)

    def stats(self) -> dict:
        """Steps, the current plan's chunk count, partition, credit and the most bytes seen in flight."""
        return {"steps": self._steps, "chunks": len(self.issue_plan.chunks), "buckets": len(self.buckets.buckets),
                "partition": self.issue_plan.partition, "credit": self.issue_plan.credit,
                "max_in_flight": self.max_in_flight}

    # ----------------------------------------------------------------------------- setup
    def _model_link(self) -> tuple[cost.LinkModel, str]:
        """The link level chunks cross, from the model every rank shares (rank 0's, broadcast)."""
        if not self._distributed:
            return cost.DEFAULT_INTRA, "intra-node defaults (one process: nothing is sent)"
        topo = self._topology
        if topo is None:  # flat without a topology: detect one for the model (collective, as all ranks construct)
            topo = context().topology(None, self._process_group, self.timeout)
        model = cost.model_for(topo, timeout=self.timeout)
        if topo.num_nodes > 1:
            return model.inter, f"inter-node link ({topo!r})"
        return model.intra, f"intra-node link (one node, {topo!r})"

    def _sizes(self, link: cost.LinkModel) -> tuple[int, int]:
        """Partition and credit from ``link``; values the user fixed are kept."""
        largest = max((b.nbytes for b in self.buckets.buckets), default=0)
        part = self._user_partition
        if part is None:
            part = partition_for(link, largest_bucket=largest)
        credit = self._user_credit
        if credit is None:
            credit = credit_for(link, min(part, largest) if part else largest)
        return part, credit

    def _prepare(self) -> None:
        """Everything collective that the reductions need besides themselves, now, on the training
        thread (every rank constructs the wrapper at the same point of its program), never later on
        the engine's worker: the algorithm's checks (a known name, a topology it supports), every
        process group of every algorithm a chunk may run with ("auto" may pick another one for the
        chunk sizes of a re-plan), the layout check their creation runs, and the cost model's
        broadcast. (The topology was detected above. A compressed reduction creates the groups of
        its own exchange on its first call: ``commopt.comm.compression`` names no roles up front.)"""
        topo = self._topology
        if not self._distributed or topo is None:
            return
        largest = max((b.nbytes for b in self.buckets.buckets), default=0)
        select_algorithm("allreduce", self.algorithm, largest, topo, self.timeout)
        if self.compressor is not None:
            return
        if self.algorithm != "auto":
            names: tuple[str, ...] = (self.algorithm,)
        elif topo.num_nodes in (1, topo.world_size):
            names = ()  # one level: auto runs flat (select_algorithm), which needs nothing
        else:
            names = tuple(n for n in algorithms.candidates("allreduce")
                          if algorithms.get(n).supports(topo, "allreduce") is None)
        names = tuple(n for n in names if n != "flat")
        if names:
            context().prepare(topo, names, self.timeout)
            cost.model_for(topo, timeout=self.timeout)

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("OverlapDataParallel was closed; build a new one")

    # ----------------------------------------------------------------------------- hooks
    def _make_pre_hook(self, params: list[int]) -> Callable:
        buckets = sorted({self._bucket_of[i] for i in params})

        def hook(_module: nn.Module, _args: Any) -> None:
            self._before_module(params, buckets)

        return hook

    def _wait_for(self, params: list[int], buckets: list[int]) -> None:
        """A module's forward pre-hook: note its parameters' first use, wait for their buckets' update."""
        if self._forward_use is not None:
            self._forward_use.extend(params)
        step = self._last
        if step is not None:
            for b in buckets:
                self._wait_applied(step, b)

    def _begin_backward(self) -> None:
        """First gradient of a backward pass: remember which step's updates it must wait for, and
        open a new step when this backward synchronises."""
        prev = self._guard = self._last
        torch.autograd.Variable._execution_engine.queue_callback(self._end_backward)
        if prev is not None and prev.issue is None:
            # The previous step's chunks still wait for its re-plan: they go to the queue before
            # anything of this step (every rank's queue holds the steps in order).
            deadline = None if self.timeout is None else time.monotonic() + self.timeout
            if not self._catch_up(prev, deadline):
                raise self._timed_out(prev, "its plan")
        if not self._sync:
            self._current = None
            return
        step = Step(self._steps, self.buckets)
        step.profile.forward_end = self._forward_end
        self._steps += 1
        self._current = step
        self._last = step
        if self._forward_use:
            self._first_use = list(dict.fromkeys(self._forward_use))
        self._start_step(step, prev)

    def _make_guard(self, i: int) -> Callable:
        b = self._bucket_of[i]

        def guard(grad: torch.Tensor) -> None:
            if not self._in_backward:
                self._in_backward = True
                self._begin_backward()
            # The previous step may still be updating this parameter and clearing its gradient:
            # accumulating before it has finished would mix two steps.
            if self._guard is not None:
                self._wait_applied(self._guard, b)
            return None

        return guard

    def _make_ready(self, i: int) -> Callable:
        b, view = self._bucket_of[i], self._views[i]

        def ready(param: torch.Tensor) -> None:
            step = self._current
            if step is None:
                return  # no_sync: the gradient stays in param.grad and accumulates
            view.copy_(param.grad.detach())  # detached: nothing recorded even under create_graph
            param.grad = None  # consumed: the bucket's reduced gradient replaces it at the step
            step.got_grad.add(i)
            step.remaining[b] -= 1
            if step.remaining[b] == 0:
                self._mark_ready(step, b)

        return ready

    def _mark_ready(self, step: Step, b: int) -> None:
        step.ready[b] = True
        step.profile.ready[b] = time.perf_counter()
        self._submit_ready(step)

    def _end_backward(self) -> None:
        """Autograd's end-of-backward callback: buckets with gradients that never arrived (unused
        parameters) are completed with zeros, so every rank issues every bucket; first, the previous
        step's update of such a bucket, which no forward and no gradient needed, is applied."""
        self._in_backward = False
        step, prev, self._current, self._guard = self._current, self._guard, None, None
        if step is None:
            return
        for b, bucket in enumerate(self.buckets.buckets):
            if step.ready[b]:
                continue
            if prev is not None:  # its reduction may still read this buffer, and its update is due
                self._wait_applied(prev, b)
            for i in bucket.params:
                if i in step.got_grad:
                    continue
                p = self._params[i]
                if p.grad is not None:  # accumulated under no_sync but unused in this backward
                    self._views[i].copy_(p.grad.detach())
                    p.grad = None
                else:
                    self._views[i].zero_()
            self._mark_ready(step, b)

    # ----------------------------------------------------------------------------- waiting
    def _wait_applied(self, step: Step, b: int) -> None:
        """Return once bucket ``b`` of ``step`` is reduced and its optimizer has stepped. The steps run
        here, in the calling thread, for ``b`` and every other bucket of the step already reduced."""
        if not step.applied[b] and step.error is None:
            deadline = None if self.timeout is None else time.monotonic() + self.timeout
            if step.issue is None and not self._catch_up(step, deadline):
                raise self._timed_out(step, f"bucket {b}")
            with self._cv:
                ok = self._cv.wait_for(lambda: step.error is not None or self._closed or (
                    step.counted and step.chunks_left[b] == 0), left(deadline))
                due = [x for x, done in enumerate(step.applied)
                       if not done and step.counted and step.chunks_left[x] == 0]
            if not ok:
                raise self._timed_out(step, f"bucket {b}")
            for x in due if step.error is None else ():
                try:
                    self._apply(x)
                except Exception as exc:  # noqa: BLE001 - raised below, and by every later wait of the step
                    self._fail(step, exc)
                    break
                step.applied[x] = True
        if step.error is not None:
            err = step.error
            if isinstance(err, (CommError, TypeError, ValueError)):
                raise err
            raise CommError(f"step {step.index} failed on rank {self._rank}: {type(err).__name__}: {err}",
                            op="overlap", seq=step.index, ranks=[self._rank]) from err

    def _timed_out(self, step: Step, what: str) -> CommTimeoutError:
        return CommTimeoutError(f"{what} of step {step.index} was not reduced within {self.timeout} s; a rank may "
                                f"have stopped training or died", op="overlap/wait", seq=step.index, ranks=[self._rank])

    # ----------------------------------------------------------------------------- optimizer
    def _apply(self, b: int) -> None:
        """The bucket's optimizer step on its reduced gradients, then the gradients are cleared.

        It may run inside a forward under ``torch.inference_mode()`` or autocast (a forward pre-hook
        of an evaluation the user did not ``synchronize()`` before): the update is made as outside
        them, so that no optimizer state becomes an inference tensor and no update is cast."""
        bucket = self.buckets.buckets[b]
        with torch.inference_mode(False), torch.autocast(self._flat[b].device.type, enabled=False):
            for i in bucket.params:
                self._params[i].grad = self._views[i]
            self.optimizers[b].step()
            for i in bucket.params:
                self._params[i].grad = None
