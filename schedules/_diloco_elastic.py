"""Elastic DiLoCo: outer syncs over the membership's current generation (``DiLoCo(..., elastic=True)``;
docs/guide.md, "Elastic training"; docs/architecture.md, "elastic"; docs/faults.md rows 42-43).

Each worker is its own ``torch.distributed`` world (one torchrun per node) and one replica of the
coordinator's membership (``commopt.comm.elastic``). One outer sync of a fragment is a *round*:

(1) the current generation (one round trip to the coordinator) and its cross-replica group, built from
    the coordinator's store when the generation is new; on a new group, a *hello*: every member says
    whether it holds the job's state and whether it trained since the last round; a member without
    state (a restarted process) receives it from the lowest member that has it, over the group, as
    tensors (``comm.elastic.transfer``): the global weights, the outer optimizers, the shared
    compressor state, the counters and (``join_inner_state``) the inner optimizer's state; its error
    feedback residual starts at zero; its local weights become the global weights;
(2) one small exact all-reduce of (members that trained, members whose weights differ), then the
    pseudo-gradients' SUM (exact, or through the codec with error feedback), divided by the number of
    members that trained: a joiner takes part with zeros and is not counted;
(3) the coordinator's verdict on (generation, round): COMMIT once every member reported it, ABORT if a
    member was lost first. The reduction ran on *copies* of the residuals and the compressor state,
    adopted only on COMMIT: an aborted attempt (or one abandoned because a member of its generation
    was lost, or that raised) leaves nothing behind, and the survivors redo it in the next
    generation on their own, unchanged pseudo-gradients. No inner step is lost;
(4) on COMMIT, the outer step and the adoption, as in the static DiLoCo.

Fewer than ``min_workers`` members, or no quorum at the coordinator: ``QuorumError`` on every survivor.
``delay`` must be 0 (the checks are in ``DiLoCo``). A worker may be a node of L ranks (DDP or FSDP2 inside):
rank r of node n is member ``n * L + r`` and works on the generation's rail r (``ReplicaSet``); every rank
of every member asks the verdict, so a round commits on all of a node's rails or on none, and the ranks
of a node agree on whether any of their pieces differs (a final sync is skipped on all or none).
"""

from __future__ import annotations

import time

import torch

from commopt.comm import all_reduce
from commopt.comm.compression import ErrorFeedback, auto, reduce_tensors
from commopt.comm.elastic import Membership, QuorumError
from commopt.comm.elastic.groups import Generation
from commopt.comm.elastic.replicas import ReplicaSet, attempt_copies, check_replica_args
from commopt.comm.elastic.transfer import local_tree, optimizer_state_like
from commopt.comm.errors import CommError
from commopt.comm.topology import Topology

__all__ = ["ElasticSync", "check_elastic"]

_NAME = "DiLoCo(elastic)"
_SENT = ("steps", "reductions", "offsets", "backups", "outer_optimizers", "compressor_state")


def check_elastic(delay: int, topology, workers, min_workers, membership) -> None:
    """``DiLoCo(elastic=True)``'s own arguments (local checks, before anything is sent)."""
    if delay:
        raise ValueError(f"{_NAME}: elastic=True needs delay=0 (a streamed reduction in flight across a membership "
                         f"change is not supported); got delay={delay}")
    if topology is not None or workers != "node":
        raise ValueError(f"{_NAME}: elastic=True takes its workers from the membership, not topology= or workers=")
    check_replica_args(_NAME, "min_workers", 1 if min_workers is None else min_workers, membership)


class ElasticSync:
    """The rounds of one elastic DiLoCo (see the module docstring); owned by ``DiLoCo``.

    Attributes:
        replicas: this worker's membership, generation group and state exchange.
        generation: the generation of the last committed round (0 before).
        members: the workers (node indices) of that round.
        events: ``(kind, worker, step, seconds)`` per change seen at a committed round, ``kind`` one of
            "lost" (a worker of the previous round is not in this one), "joined" (a worker that was not
            is; this worker itself when it joined a running job) and "redone" (this worker redid the
            round after an abandoned or aborted attempt); ``step`` is this worker's inner step and
            ``seconds`` counts from its construction.
        joined: (generation, seconds from the start of the join to its first committed round) for a
            worker that joined a running job, else None.
    """

    def __init__(self, dl, membership: Membership, *, min_workers: int, timeout: float, join_timeout: float,
                 join_inner_state: bool, own: bool):
        self.dl, self.membership = dl, membership
        self.timeout, self.join_timeout, self.join_inner_state = timeout, join_timeout, join_inner_state
        self.replicas = ReplicaSet(membership, name=_NAME, min_replicas=min_workers, timeout=timeout, own=own,
                                   get_state=self._state, load_state=self._load,
                                   progress=lambda: (dl.steps, dl._reductions), local=dl.local_rank,
                                   local_size=dl.local_size)
        self.generation = 0
        self.members: tuple[int, ...] = ()
        self.events: list[tuple[str, int, int, float]] = []
        self._t0 = time.monotonic()
        self.joined: tuple[int, float] | None = None
        self._joining_since: float | None = None

    @property
    def redone(self) -> int:
        """Outer syncs abandoned or aborted and redone."""
        return self.replicas.redone

    @property
    def transfer_seconds(self) -> float | None:
        """Seconds this worker spent receiving the job's state when it joined (None: it did not)."""
        return self.replicas.transfer_seconds

    @property
    def recovery_bytes(self) -> int:
        """Bytes of state this worker sent or received for joiners."""
        return self.replicas.recovery_bytes

    # ------------------------------------------------------------------------------- public
    def join(self) -> None:
        """At construction: wait for a generation, get the job's state; take part in the round the
        running workers are in, if any (a joiner is admitted at an outer sync)."""
        self._joining_since = time.monotonic()
        if self.replicas.current(self.join_timeout):
            self.sync_due(self.dl.steps)
        self._joining_since = None

    def sync_due(self, t: int) -> None:
        """The rounds of the fragments due at step ``t``, one committed round each."""
        for f, off in enumerate(self.dl.offsets):
            if t % self.dl.sync_every == off % self.dl.sync_every:
                self.round(f)

    def round(self, f: int, final: bool = False) -> None:
        """One committed outer sync of fragment ``f`` (``final``: skipped where no worker's weights
        differ from the global ones, as ``DiLoCo.finalize`` does)."""
        dl, rs = self.dl, self.replicas
        redone_before = rs.redone
        while True:
            rs.current(self.timeout)
            gen = rs.gen
            try:
                result = self._attempt(gen, f, final)
                ok = self.membership.commit(gen.generation, dl._reductions, self.timeout)
            except QuorumError:
                raise
            except (CommError, RuntimeError) as exc:
                rs.failed(gen, exc)
                continue
            if not ok:
                rs.failed(gen, "the coordinator aborted the round: a member was lost before it finished")
                continue
            break
        averaged, trained, differs, feedback, state = result
        self._record(gen, redone_before)
        self.generation = gen.generation
        dl._reductions += 1
        dl.error_feedback, dl.compressor_state = feedback, state
        rs.contributes = True
        if self._joining_since is not None and self.joined is None:
            self.joined = (gen.generation, time.monotonic() - self._joining_since)
        if trained == 0 or (final and differs == 0):
            return  # nothing trained since the last sync: an outer step would only apply momentum
        dl._apply_averaged(f, averaged, 0.0 if final else None)  # NonFiniteError on every worker alike

    def _record(self, gen: Generation, redone_before: int) -> None:
        """The events of a committed round: workers that left or joined since the last one, this worker's
        redone attempts (``DiLoCo.events``)."""
        now, step = time.monotonic() - self._t0, self.dl.steps
        me = self.replicas.node
        if self.replicas.redone > redone_before:
            self.events.append(("redone", me, step, now))
        if self.members:
            self.events += [("lost", w, step, now) for w in self.members if w not in gen.members]
            self.events += [("joined", w, step, now) for w in gen.members if w not in self.members]
        elif self._joining_since is not None:
            self.events.append(("joined", me, step, now))
        self.members = gen.members

    def close(self) -> None:
        self.replicas.close()

    # ------------------------------------------------------------------------------- the state
    def _state(self) -> dict:
        sd = self.dl.state_dict()
        out = {k: sd[k] for k in _SENT}
        if self.join_inner_state:  # each rank's own (FSDP2 inside the worker: its shards)
            out["inner_optimizer"] = local_tree(self.dl.inner_optimizer.state_dict())
        return out

    def _load(self, received: dict) -> None:
        dl = self.dl
        state = {k: received.get(k) for k in _SENT}
        state.update(meta=dl._meta(), error_feedback=ErrorFeedback().state_dict(), pending=[])
        dl.load_state_dict(state)  # every entry checked against this worker's model and settings
        dl.error_feedback = ErrorFeedback()
        inner = received.get("inner_optimizer")
        if inner is not None and self.join_inner_state:
            dl.inner_optimizer.load_state_dict(optimizer_state_like(dl.inner_optimizer, inner))
        for f in range(len(dl.fragments)):
            dl._write(f, None, 0.0)  # the joiner's local weights become the global ones

    # ------------------------------------------------------------------------------- one attempt
    @torch.no_grad()
    def _attempt(self, gen: Generation, f: int, final: bool):
        dl = self.dl
        names = dl.fragments[f]
        deltas = [dl.backups[n].to(dl.device) - dl._read_piece(dl._pieces[n], dl.backups[n].dtype) for n in names]
        contributes = self.replicas.contributes
        if not contributes:
            deltas = [torch.zeros_like(d) for d in deltas]
        differs = any(bool(d.any()) for d in deltas)
        if dl.local_size > 1:  # a worker of several ranks: whether any of its pieces differs (one decision)
            differs = not self.replicas.node_all(not differs)
        differs = float(differs)
        counts = torch.tensor([float(contributes), differs], device=dl.device)
        self.replicas.wait(all_reduce(counts, torch.distributed.ReduceOp.SUM, group=gen.group, algorithm="flat",
                              async_op=True, timeout=self.timeout, agreement=False), gen)
        trained, differs = int(counts[0]), int(counts[1])
        feedback, state = attempt_copies(dl.error_feedback, dl.compressor, dl.compressor_state)
        p = gen.size
        topo = Topology(nodes=tuple((i,) for i in range(p)), rank=gen.index, world_size=p)
        dl.outer_bytes += auto.traffic("flat", dl.compressor, [d.numel() for d in deltas],
                                       [tuple(d.shape) for d in deltas], deltas[0].element_size(), topo,
                                       step=dl._reductions).sent(gen.index)
        if dl.compressor is not None:
            self.replicas.wait(reduce_tensors(dl.compressor, deltas, list(names), group=gen.group, algorithm="flat",
                                      average=False, step=dl._reductions, seed=0,
                                      feedback=feedback if dl._use_ef else None, state=state,
                                      timeout=self.timeout), gen)
        else:
            flat = torch.cat([d.reshape(-1) for d in deltas])
            self.replicas.wait(all_reduce(flat, torch.distributed.ReduceOp.SUM, group=gen.group, algorithm="flat",
                                  async_op=True, timeout=self.timeout, agreement=False), gen)
            deltas, pos = [], 0
            for n in names:
                shape = dl._pieces[n].shape
                k = int(torch.Size(shape).numel())
                deltas.append(flat[pos: pos + k].view(shape))
                pos += k
        averaged = [d / max(trained, 1) for d in deltas]
        return averaged, trained, differs, feedback, state
