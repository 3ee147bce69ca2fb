"""Elastic data-parallel replicas: data parallelism that shrinks, carries on and rejoins without a restart
(docs/guide.md, "Elastic training"; docs/architecture.md, "elastic"; docs/faults.md row 42).

A replica is a node: its own ``torch.distributed`` world (one torchrun per node) of L ranks, and L
members of the coordinator's membership (``commopt.comm.elastic``; rank r of node n is id ``n * L + r``).
Inside the node the model is replicated (a plain module on every rank, as DDP would hold it) or sharded
with FSDP2 (``fully_shard`` over the node's ranks: HSDP's layout). Across nodes, rank r of every node
forms the generation's *rail* r. :meth:`ElasticReplicas.step` replaces ``optimizer.step()``:

(1) the generation this rank saw last (the heartbeat's view: no coordinator round trip per step) and
    its rail; a new rail starts with the *hello* (``ReplicaSet``): a node behind the furthest (its last
    step was applied by the others, a lost node's gradient included, while its own reduction failed) or
    new (a restarted node) receives the state from a peer node at the furthest step (replicated: rail 0
    carries it and the node's rank 0 hands it to its other ranks; sharded: each rail its own shards),
    and this call returns: that step is done;
(2) the node's part: replicated, the gradients' SUM over the node is reduce-scattered, each rank holding
    1/L of it; sharded, FSDP2's backward already left each rank its shard of the node's mean;
(3) that part's SUM over the rail (exact, or through the codec with error feedback on a copy of the
    residuals), with one more element counting the nodes, then every rank of the node agrees that all its
    rails completed (one MIN inside the node; with L = 1 there is nothing to agree); replicated, the
    node all-gathers the parts; the result is the mean over every rank of the nodes that took part;
(4) a reduction that fails on any rail of the node, or that cannot complete because its generation lost
    a member or was replaced, is redone by the whole node in the next generation among the survivors on
    this step's own gradients;
(5) the optimizer's step.

Which nodes applied a step is settled by the next hello, not by a round trip per step: one that applied
it is ahead, and the nodes behind copy its state; the ranks of one node always agree, so every rail
decides alike. With no failure a step costs what hierarchical DDP costs (a reduce-scatter and an
all-gather inside the node, an all-reduce of 1/L of the gradients on each rail) plus one 4-byte MIN
inside the node. The reduction runs after backward (no overlap with it).
"""

from __future__ import annotations

import numbers

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed import ReduceOp
from torch.distributed.tensor import DTensor

from commopt.comm import all_gather, all_reduce, reduce_scatter
from commopt.comm.compression import Codec, ErrorFeedback, reduce_tensors
from commopt.comm.elastic import Membership, QuorumError
from commopt.comm.elastic.replicas import ReplicaSet, attempt_copies, check_replica_args, node_member_id
from commopt.comm.elastic.transfer import broadcast_state, local, local_tree, optimizer_state_like
from commopt.comm.errors import CommError

__all__ = ["ElasticReplicas"]

_NAME = "ElasticReplicas"


class ElasticReplicas:
    """Data-parallel replicas (nodes) over the membership's current generation (see the module docstring).

    Construction joins the job: it waits for a generation including this node and gets the job's state
    (a fresh job: the first node's weights, as DDP broadcasts rank 0's; a running job: a peer's weights,
    buffers, optimizer state and step). Then call :meth:`step` instead of ``optimizer.step()`` after every
    backward, and start the loop at ``range(replicas.steps, total)``. Every rank of every node calls both.

    Args:
        model: the module whose gradients are averaged: a plain module (replicated on the node's ranks;
            not wrapped in DistributedDataParallel: :meth:`step` reduces inside the node too) or one
            sharded with FSDP2's ``fully_shard`` over the node's ranks (the node's world).
        optimizer: its optimizer, stepped by :meth:`step` only.
        min_replicas: the fewest nodes a step may average over (``QuorumError`` below).
        membership: this rank's ``Membership``, id ``node * L + rank`` with L the node's ranks (None:
            ``Membership.from_env(node * L + rank)``, the node from COMMOPT_REPLICA_ID, heartbeat 0.25 s,
            closed by :meth:`close`).
        compressor: a ``commopt.comm.compression`` codec for the cross-node reduction (None: exact).
        error_feedback: keep what a biased codec drops for the next step.
        timeout: seconds each reduction or exchange may wait.
        join_timeout: seconds construction waits for a generation and the state.

    Attributes:
        steps: optimizer steps applied (the job's step, the same on every rank after each step).
        replicas: this rank's membership, rail group and state exchange (``redone``, ``recovery_bytes``).
        error_feedback: the residuals of the compressed reduction (of this rank's part).
    """

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, *, min_replicas: int = 1,
                 membership: Membership | None = None, compressor: Codec | None = None, error_feedback: bool = True,
                 timeout: float = 60.0, join_timeout: float = 600.0) -> None:
        if isinstance(model, nn.parallel.DistributedDataParallel):
            raise TypeError(f"{_NAME}: pass the module itself, not DistributedDataParallel: step() reduces the "
                            f"gradients inside the node too (DDP's reduction would run twice)")
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
        self.size, self.rank = dist.get_world_size(), dist.get_rank()
        sharded = [isinstance(p, DTensor) for p in self.params]
        self.sharded = all(sharded)
        if any(sharded) and not self.sharded:
            raise TypeError(f"{_NAME}: some parameters are DTensors and some are not; shard the whole model with "
                            f"fully_shard over the node's ranks, or none of it")
        if self.sharded and any(p.device_mesh.size() != self.size for p in self.params):
            raise ValueError(f"{_NAME}: the model is sharded over a mesh that is not the node's world of "
                             f"{self.size} ranks; shard it with fully_shard over the node's ranks only (the "
                             f"nodes are joined by step())")
        self.model, self.optimizer, self.compressor = model, optimizer, compressor
        self.timeout = float(timeout)
        self.steps = 0
        self.error_feedback = ErrorFeedback()
        self._use_ef = error_feedback and compressor is not None
        self._state = compressor.new_state() if compressor is not None else None
        self._names = [n for n, p in model.named_parameters() if p.requires_grad]
        if membership is None:
            membership = Membership.from_env(node_member_id(self.size, self.rank), heartbeat_interval=0.25)
            own = True
        else:
            own = False
        self.replicas = ReplicaSet(membership, name=_NAME, min_replicas=min_replicas, timeout=self.timeout, own=own,
                                   get_state=self._get_state, load_state=self._load_state,
                                   progress=lambda: (self.steps, 0), local=self.rank, local_size=self.size)
        self._current(float(join_timeout), fresh=True)

    # ------------------------------------------------------------------------------- the step
    def step(self) -> None:
        """Average the gradients over every rank of the current generation's nodes, then step the optimizer
        (instead of ``optimizer.step()``). A parameter without a gradient counts as zeros.

        Raises:
            QuorumError: fewer than ``min_replicas`` nodes, or no quorum at the coordinator (on every
                survivor).
            CommTimeoutError: a reduction failed and no new generation formed within ``timeout``, or the
                node's own ranks did not answer (a rank of this node is gone: restart the node).
        """
        rs = self.replicas
        grads = [local(p.grad) if p.grad is not None else torch.zeros_like(local(p)) for p in self.params]
        while True:
            if self._current(self.timeout, fresh=False):
                return  # this step was applied by nodes ahead of this one; their state replaced ours
            gen = rs.gen
            error: BaseException | None = None
            try:
                result = self._reduce(grads, gen)
            except QuorumError:
                raise
            except (CommError, RuntimeError) as exc:
                error = exc
            if self._agree(error is None) and error is None:
                break
            rs.failed(gen, error or "another rank of this node failed its rail's reduction")
        averaged, feedback, state = result
        if not self.sharded and self.size > 1:
            averaged = self._gather(averaged)
        with torch.no_grad():
            for p, g in zip(self.params, averaged):
                if p.grad is None:
                    g = g.view_as(local(p)).to(p.dtype)
                    p.grad = (DTensor.fromlocal(g, p.device_mesh, p.placements, shape=p.shape, stride=p.stride(),
                                                 run_check=False) if self.sharded else g)
                else:
                    local(p.grad).copy_(g.view_as(local(p)))
        self.error_feedback, self._state = feedback, state
        self.optimizer.step()
        self.steps += 1

    def _current(self, wait: float, fresh: bool) -> bool:
        """The generation's rail (``ReplicaSet.current``); a replicated node that received the state (on
        rail 0: the rails above carry none) hands it from rank 0 to its other ranks. Returns whether this
        node received a running job's state."""
        rs = self.replicas
        received = rs.current(wait, fresh=fresh)
        if rs.received and not self.sharded and self.size > 1:  # the same on every rank of the node
            state = self._get_state(whole=True) if self.rank == 0 else None
            got, _ = broadcast_state(state, dist.group.WORLD, 0, self.timeout, list(range(1, self.size)))
            if self.rank != 0:
                self._load_state(got)
        return received

    def _agree(self, ok: bool) -> bool:
        """Whether every rank of the node completed its rail's reduction (one MIN inside the node)."""
        return ok if self.size == 1 else self.replicas.node_all(ok)

    @torch.no_grad()
    def _part(self, grads: list[torch.Tensor]) -> torch.Tensor:
        """Replicated with L > 1: this rank's 1/L of the node's gradient SUM (flat, fp32, zero-padded)."""
        total = sum(g.numel() for g in grads)
        chunk = -(-total // self.size)
        flat = torch.zeros(chunk * self.size)
        torch.cat([g.detach().reshape(-1).float() for g in grads], out=flat[:total])
        part = torch.empty(chunk)
        reduce_scatter(part, flat, ReduceOp.SUM, algorithm="flat", timeout=self.timeout)
        return part

    @torch.no_grad()
    def _gather(self, parts: list[torch.Tensor]) -> list[torch.Tensor]:
        """Replicated with L > 1: the node's parts of the mean, back into whole gradients."""
        part = parts[0]
        flat = torch.empty(part.numel() * self.size)
        all_gather(flat, part, algorithm="flat", timeout=self.timeout)
        out, pos = [], 0
        for p in self.params:
            out.append(flat[pos: pos + p.numel()])
            pos += p.numel()
        return out

    @torch.no_grad()
    def _reduce(self, grads: list[torch.Tensor], gen):
        """This rank's part of the mean over the rail's nodes (and the node's ranks, replicated)."""
        rs = self.replicas
        split = not self.sharded and self.size > 1
        work = [self._part(grads)] if split else [g.detach().float().contiguous().clone() for g in grads]
        # replicated parts hold the SUM over the node's ranks; FSDP2's and one rank's hold its mean
        scale = self.size if split else 1
        if self.compressor is None:
            ones = work[0].new_ones(1)  # the count of nodes, reduced with them
            flat = torch.cat([w.reshape(-1) for w in work] + [ones])
            rs.wait(all_reduce(flat, ReduceOp.SUM, group=gen.group, algorithm="flat", async_op=True,
                               timeout=self.timeout, agreement=False), gen, any_change=True)
            n = flat[-1] * scale
            out, pos = [], 0
            for w in work:
                out.append(flat[pos: pos + w.numel()] / n)
                pos += w.numel()
            return out, self.error_feedback, self._state
        count = torch.ones(1)
        rs.wait(all_reduce(count, ReduceOp.SUM, group=gen.group, algorithm="flat", async_op=True,
                           timeout=self.timeout, agreement=False), gen, any_change=True)
        feedback, state = attempt_copies(self.error_feedback, self.compressor, self._state)
        names = [f"part{self.rank}"] if split else list(self._names)
        rs.wait(reduce_tensors(self.compressor, work, names, group=gen.group, algorithm="flat",
                               average=False, step=self.steps, seed=0, feedback=feedback if self._use_ef else None,
                               state=state, timeout=self.timeout), gen, any_change=True)
        return [w / (count * scale) for w in work], feedback, state

    # ------------------------------------------------------------------------------- the state
    def _get_state(self, whole: bool = False) -> dict:
        """What a peer node's rank needs: replicated, rail 0 carries the whole state and the other rails
        nothing (the node's rank 0 hands it on, ``whole``); sharded, every rail its rank's shards."""
        if not self.sharded and self.rank != 0 and not whole:
            return {}
        return {"steps": self.steps, "model": local_tree(self.model.state_dict()),
                "optimizer": local_tree(self.optimizer.state_dict())}

    def _load_state(self, received: dict) -> None:
        if not received and not self.sharded and self.rank != 0:
            return  # a rail above 0 of a replicated node: rank 0 hands the state on (_current)
        own = self.model.state_dict()
        model = received.get("model")
        if not isinstance(model, dict) or set(model) != set(own):
            theirs = set(model or {})
            raise ValueError(f"{_NAME}: the peer's model holds other entries than this replica's (missing "
                             f"{sorted(set(own) - theirs)[:5]}, extra {sorted(theirs - set(own))[:5]}); build the "
                             f"same model on every replica")
        for k, v in own.items():
            mine = local(v)
            if not isinstance(model[k], torch.Tensor) or model[k].shape != mine.shape or model[k].dtype != mine.dtype:
                raise ValueError(f"{_NAME}: the peer's {k!r} is not a {mine.dtype} tensor of shape "
                                 f"{list(mine.shape)}; build (and shard) the same model on every replica")
        with torch.no_grad():
            for k, v in own.items():
                local(v).copy_(model[k])
        self.optimizer.load_state_dict(optimizer_state_like(self.optimizer, received["optimizer"]))
        self.steps = int(received["steps"])
        self.error_feedback = ErrorFeedback()  # what this replica's codec dropped before is not the peer's

    def close(self) -> None:
        """Drop the generation's rail; leave the membership if this object made it."""
        self.replicas.close()
