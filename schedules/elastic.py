"""Elastic data-parallel replicas: data parallelism that shrinks, carries on and rejoins without a restart
(docs/guide.md, "Elastic training"; docs/architecture.md, "elastic"; docs/faults.md row 42).

Each replica (a node) is its own ``torch.distributed`` world of one rank and one replica of the
coordinator's membership (``commopt.comm.elastic``). :meth:`ElasticReplicas.step` replaces
``optimizer.step()``:

(1) the generation this replica saw last (the heartbeat's view: no coordinator round trip per step) and
    its group; a new group starts with the *hello* (``ReplicaSet``): a replica behind the furthest
    (its last step was applied by the others, a lost replica's gradient included, while its own
    reduction failed) or new (a restarted process) receives the weights, buffers and optimizer state from
    a peer at the furthest step, and this call returns: that step is done;
(2) the gradients' SUM over the group (exact, or through the codec with error feedback on a copy of the
    residuals), with one more element counting the replicas, then the average over the replicas that
    took part;
(3) a reduction that fails, or that cannot complete because its generation lost a member or was
    replaced, is redone in the next generation among the survivors on this step's own gradients;
(4) the optimizer's step.

Which replicas applied a step is settled by the next hello, not by a round trip per step: one that
applied it is ahead, and the replicas behind copy its state. So with no failure a step costs one
all-reduce, as with DDP, and nothing else. The reduction runs after backward (no overlap with it).
"""

from __future__ import annotations

import numbers

import torch
from torch import nn
from torch.distributed import ReduceOp

from commopt.comm import all_reduce
from commopt.comm.compression import Codec, ErrorFeedback, reduce_tensors
from commopt.comm.elastic import Membership, QuorumError
from commopt.comm.elastic.replicas import ReplicaSet, attempt_copies, check_replica_args
from commopt.comm.errors import CommError

__all__ = ["ElasticReplicas"]

_NAME = "ElasticReplicas"


class ElasticReplicas:
    """Data-parallel replicas over the membership's current generation (see the module docstring).

    Construction joins the job: it waits for a generation including this replica and gets the job's
    state (a fresh job: the first member's weights, as DDP broadcasts rank 0's; a running job: a peer's
    weights, buffers, optimizer state and step). Then call :meth:`step` instead of ``optimizer.step()``
    after every backward, and start the loop at ``range(replicas.steps, total)``.

    Args:
        model: the module (on one device) whose gradients are averaged.
        optimizer: its optimizer, stepped by :meth:`step` only.
        min_replicas: the fewest replicas a step may average over (``QuorumError`` below).
        membership: this replica's ``Membership`` (None: ``Membership.from_env()``, heartbeat 0.25 s,
            closed by :meth:`close`).
        compressor: a ``commopt.comm.compression`` codec for the gradients (None: exact).
        error_feedback: keep what a biased codec drops for the next step.
        timeout: seconds each reduction or exchange may wait.
        join_timeout: seconds construction waits for a generation and the state.

    Attributes:
        steps: optimizer steps applied (the job's step, the same on every replica after each step).
        replicas: the membership, generation group and state exchange (``redone``, ``recovery_bytes``).
        error_feedback: the residuals of the compressed gradients.
    """

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, *, min_replicas: int = 1,
                 membership: Membership | None = None, compressor: Codec | None = None, error_feedback: bool = True,
                 timeout: float = 60.0, join_timeout: float = 600.0) -> None:
        if not isinstance(model, nn.Module):
            raise TypeError(f"{_NAME}: model must be a torch.nn.Module, got {type(model).__name__}")
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(f"{_NAME}: optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}")
        if compressor is not None and not isinstance(compressor, Codec):
            raise TypeError(f"{_NAME}: compressor must be a commopt.comm.compression codec or None, got "
                            f"{type(compressor).__name__}")
        for name, value in (("timeout", timeout), ("join_timeout", join_timeout)):
            if isinstance(value, bool) or not isinstance(value, numbers.Real) or not value > 0:
                raise ValueError(f"{_NAME}: {name} must be a positive number of seconds, got {value!r}")
        check_replica_args(_NAME, "min_replicas", min_replicas, membership)
        self.params = [p for p in model.parameters() if p.requires_grad]
        ids = {id(p) for p in self.params}
        if any(id(p) not in ids for g in optimizer.param_groups for p in g["params"] if p.requires_grad):
            raise ValueError(f"{_NAME}: the optimizer steps tensors that are not the model's trainable parameters")
        if not self.params or any(not p.is_floating_point() for p in self.params):
            raise TypeError(f"{_NAME}: the model needs trainable floating-point parameters")
        self.model, self.optimizer, self.compressor = model, optimizer, compressor
        self.timeout = float(timeout)
        self.steps = 0
        self.error_feedback = ErrorFeedback()
        self._use_ef = error_feedback and compressor is not None
        self._state = compressor.new_state() if compressor is not None else None
        self._names = [n for n, p in model.named_parameters() if p.requires_grad]
        self.replicas = ReplicaSet(membership or Membership.from_env(heartbeat_interval=0.25), name=_NAME,
                                   min_replicas=min_replicas, timeout=self.timeout, own=membership is None,
                                   get_state=self._get_state, load_state=self._load_state,
                                   progress=lambda: (self.steps, 0))
        self.replicas.current(float(join_timeout))

    # ------------------------------------------------------------------------------- the step
    def step(self) -> None:
        """Average the gradients over the current generation's replicas, then step the optimizer (instead
        of ``optimizer.step()``). A parameter without a gradient counts as zeros.

        Raises:
            QuorumError: fewer than ``min_replicas`` replicas, or no quorum at the coordinator (on every
                survivor).
            CommTimeoutError: a reduction failed and no new generation formed within ``timeout``.
        """
        rs = self.replicas
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in self.params]
        while True:
            if rs.current(self.timeout, fresh=False):
                return  # this step was applied by replicas ahead of this one; their state replaced ours
            gen = rs.gen
            try:
                averaged, feedback, state = self._reduce(grads, gen)
            except QuorumError:
                raise
            except (CommError, RuntimeError) as exc:
                rs.failed(gen, exc)
                continue
            break
        with torch.no_grad():
            for p, g in zip(self.params, averaged):
                if p.grad is None:
                    p.grad = g.view_as(p).to(p.dtype)
                else:
                    p.grad.copy_(g.view_as(p))
        self.error_feedback, self._state = feedback, state
        self.optimizer.step()
        self.steps += 1

    @torch.no_grad()
    def _reduce(self, grads: list[torch.Tensor], gen):
        rs = self.replicas
        if self.compressor is None:
            ones = grads[0].new_ones(1, dtype=torch.float32)  # the count of replicas, reduced with them
            flat = torch.cat([g.detach().reshape(-1).float() for g in grads] + [ones])
            rs.wait(all_reduce(flat, ReduceOp.SUM, group=gen.group, algorithm="flat", async_op=True,
                               timeout=self.timeout, agreement=False), gen, any_change=True)
            n = flat[-1]
            out, pos = [], 0
            for g in grads:
                out.append(flat[pos: pos + g.numel()] / n)
                pos += g.numel()
            return out, self.error_feedback, self._state
        count = torch.ones(1)
        rs.wait(all_reduce(count, ReduceOp.SUM, group=gen.group, algorithm="flat", async_op=True,
                           timeout=self.timeout, agreement=False), gen, any_change=True)
        feedback, state = attempt_copies(self.error_feedback, self.compressor, self._state)
        work = [g.detach().float().contiguous().clone() for g in grads]
        rs.wait(reduce_tensors(self.compressor, work, list(self._names), group=gen.group, algorithm="flat",
                               average=False, step=self.steps, seed=0, feedback=feedback if self._use_ef else None,
                               state=state, timeout=self.timeout), gen, any_change=True)
        return [w / count for w in work], feedback, state

    # ------------------------------------------------------------------------------- the state
    def _get_state(self) -> dict:
        return {"steps": self.steps, "model": self.model.state_dict(), "optimizer": self.optimizer.state_dict()}

    def _load_state(self, received: dict) -> None:
        own = self.model.state_dict()
        model = received.get("model")
        if not isinstance(model, dict) or set(model) != set(own):
            theirs = set(model or {})
            raise ValueError(f"{_NAME}: the peer's model holds other entries than this replica's (missing "
                             f"{sorted(set(own) - theirs)[:5]}, extra {sorted(theirs - set(own))[:5]}); build the "
                             f"same model on every replica")
        for k, v in own.items():
            if not isinstance(model[k], torch.Tensor) or model[k].shape != v.shape or model[k].dtype != v.dtype:
                raise ValueError(f"{_NAME}: the peer's {k!r} is not a {v.dtype} tensor of shape {list(v.shape)}; "
                                 f"build the same model on every replica")
        self.model.load_state_dict(model)
        self.optimizer.load_state_dict(received["optimizer"])
        self.steps = int(received["steps"])
        self.error_feedback = ErrorFeedback()  # what this replica's codec dropped before is not the peer's

    def close(self) -> None:
        """Drop the generation's group; leave the membership if this object made it."""
        self.replicas.close()
