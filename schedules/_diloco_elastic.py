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
``delay`` must be 0 and a worker one rank (the checks are in ``DiLoCo``).
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist

from commopt.comm import all_reduce
from commopt.comm.algorithms._transport import all_gather_single
from commopt.comm.compression import ErrorFeedback, auto, reduce_tensors
from commopt.comm.elastic import Membership, QuorumError
from commopt.comm.elastic.groups import Generation, Superseded, connect_store
from commopt.comm.elastic.transfer import broadcast_state
from commopt.comm.engine import wait_work
from commopt.comm.errors import CommError, CommTimeoutError
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
    if isinstance(min_workers, bool) or not isinstance(min_workers, int) or min_workers < 1:
        raise ValueError(f"{_NAME}: min_workers must be an int >= 1, got {min_workers!r}")
    if membership is not None and not isinstance(membership, Membership):
        raise TypeError(f"{_NAME}: membership must be a commopt.comm.elastic.Membership or None (from the "
                        f"environment), got {type(membership).__name__}")
    if not dist.is_initialized() or dist.get_world_size() != 1:
        raise ValueError(f"{_NAME}: elastic=True runs one rank per worker, each its own torch.distributed world: "
                         f"call init_process_group with world_size=1 in every worker (one torchrun per node, "
                         f"--nproc-per-node 1); got "
                         f"{dist.get_world_size() if dist.is_initialized() else 'no process group'}")


class _Lost(CommError):
    """A member of the attempt's generation was lost: the attempt is abandoned."""


class ElasticSync:
    """The rounds of one elastic DiLoCo (see the module docstring); owned by ``DiLoCo``.

    Attributes:
        membership: this worker's membership.
        generation: the generation of the last committed round (0 before).
        redone: attempts abandoned or aborted and redone.
        recovery_bytes: bytes of state this worker sent or received for joiners.
        joined: (generation, seconds from the start of the join to its first committed round) for a
            worker that joined a running job, else None.
    """

    def __init__(self, dl, membership: Membership, *, min_workers: int, timeout: float, join_timeout: float,
                 join_inner_state: bool, own: bool):
        self.dl, self.membership, self._own = dl, membership, own
        self.min_workers, self.timeout, self.join_timeout = min_workers, timeout, join_timeout
        self.join_inner_state = join_inner_state
        self.gen: Generation | None = None
        self.generation = 0
        self.has_state = self.contributes = False
        self.redone = 0
        self.recovery_bytes = 0
        self.joined: tuple[int, float] | None = None
        self._store = None
        self._joining_since: float | None = None

    # ------------------------------------------------------------------------------- public
    def join(self) -> None:
        """At construction: wait for a generation, get the job's state; take part in the round the
        running workers are in, if any (a joiner is admitted at an outer sync)."""
        self._joining_since = time.monotonic()
        follows = self._current(self.join_timeout)
        if follows:
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
        dl = self.dl
        while True:
            gen = self._current_gen()
            try:
                result = self._attempt(gen, f, final)
                ok = self.membership.commit(gen.generation, dl._reductions, self.timeout)
            except QuorumError:
                raise
            except (CommError, RuntimeError) as exc:
                self._failed(gen, exc)
                continue
            if not ok:
                self._failed(gen, "the coordinator aborted the round: a member was lost before it finished")
                continue
            break
        averaged, trained, differs, feedback, state = result
        self.generation = gen.generation
        dl._reductions += 1
        dl.error_feedback, dl.compressor_state = feedback, state
        self.contributes = True
        if self._joining_since is not None and self.joined is None:
            self.joined = (gen.generation, time.monotonic() - self._joining_since)
        if trained == 0 or (final and differs == 0):
            return  # nothing trained since the last sync: an outer step would only apply momentum
        dl._apply_averaged(f, averaged, 0.0 if final else None)  # NonFiniteError on every worker alike

    def close(self) -> None:
        if self.gen is not None:
            self.gen.release()
            self.gen = None
        if self._own:
            self.membership.close()

    # ------------------------------------------------------------------------------- generations
    def _current_gen(self) -> Generation:
        self._current(self.timeout)
        assert self.gen is not None
        return self.gen

    def _current(self, wait: float) -> bool:
        """The current generation's group, this worker a member of it, with the job's state; returns
        whether this worker just received the state of a running job (a round follows)."""
        m = self.membership
        deadline = time.monotonic() + wait
        while True:
            g = m.refresh(self.timeout)
            if not m.is_member:
                g = m.wait_for_generation(after=0, timeout=max(0.1, deadline - time.monotonic()))
            members = m.members
            if len(members) < self.min_workers:
                raise QuorumError(f"{_NAME}: generation {g} has {len(members)} workers {list(members)}, fewer than "
                                  f"min_workers={self.min_workers}; restart the lost workers (or lower "
                                  f"min_workers)", op="elastic/quorum")
            if self.gen is not None and self.gen.generation == g:
                return False
            if self.gen is not None:
                self.gen.release()
                self.gen = None
            try:
                self.gen = self._build(g, members, deadline)
                return self._hello()
            except Superseded:
                continue
            except QuorumError:
                raise
            except (CommError, RuntimeError) as exc:
                if self.gen is None and time.monotonic() > deadline:
                    raise
                self._failed(self.gen, exc)

    def _build(self, g: int, members: tuple[int, ...], deadline: float) -> Generation:
        m = self.membership
        if self._store is None:
            host, port = m.store_address
            self._store = connect_store(host, port, self.timeout)
        wait = max(self.timeout, deadline - time.monotonic())
        return Generation(self._store, f"{m.job:x}", g, members, m.replica_id, "rail0", wait,
                          superseded=lambda: m.generation > g)

    def _failed(self, gen: Generation | None, why: object) -> None:
        """An attempt failed: drop its group and wait for the generation after it (the failure was a
        member lost, or it is a real timeout, which then surfaces)."""
        self.redone += 1
        after = gen.generation if gen is not None else self.membership.generation
        if gen is not None:
            gen.release()
            if self.gen is gen:
                self.gen = None
        try:
            self.membership.wait_for_generation(after=after, timeout=self.timeout)
        except CommTimeoutError as exc:
            raise CommTimeoutError(f"{_NAME}: an outer sync in generation {after} failed ({why}) and no new "
                                   f"generation formed within {self.timeout:g} s (no member was lost: a stall or "
                                   f"a network fault?)", op="elastic/round") from exc

    def _hello(self) -> bool:
        """The new group's first exchange: who holds the state; the state to those without it."""
        dl, gen = self.dl, self.gen
        assert gen is not None
        mine = torch.tensor([int(self.has_state), int(self.contributes), dl.steps, dl._reductions],
                            dtype=torch.int64)
        rows = mine.new_empty(gen.size * 4)
        wait_work(all_gather_single(rows, mine, group=gen.group, async_op=True), self.timeout,
                  f"{_NAME}/hello")
        rows = rows.view(gen.size, 4)
        holders = [i for i in range(gen.size) if rows[i, 0]]
        fresh = not holders
        src = holders[0] if holders else 0  # a job's start: the first member's weights, as worker 0's
        counters = {(int(rows[i, 2]), int(rows[i, 3])) for i in holders}
        if len(counters) > 1:
            raise ValueError(f"{_NAME}: the workers of generation {gen.generation} are out of step (steps, "
                             f"reductions) = {sorted(counters)}: they must all call step() after every inner step")
        needs = [i for i in range(gen.size) if i != src and not rows[i, 0]]
        if not needs:
            self.has_state = self.contributes = True
            return False
        state = self._state() if gen.index == src else None
        received, nbytes = broadcast_state(state, gen.group, src, self.timeout)
        if gen.index == src or gen.index in needs:
            self.recovery_bytes += nbytes
        if gen.index in needs:
            self._load(received)
        if gen.index == src:
            self.has_state = True
        self.contributes = fresh or self.contributes
        return gen.index in needs and not fresh

    def _state(self) -> dict:
        sd = self.dl.state_dict()
        out = {k: sd[k] for k in _SENT}
        if self.join_inner_state:
            out["inner_optimizer"] = self.dl.inner_optimizer.state_dict()
        return out

    def _load(self, received: dict) -> None:
        dl = self.dl
        state = {k: received.get(k) for k in _SENT}
        state.update(meta=dl._meta(), error_feedback=ErrorFeedback().state_dict(), pending=[])
        dl.load_state_dict(state)  # every entry checked against this worker's model and settings
        dl.error_feedback = ErrorFeedback()
        inner = received.get("inner_optimizer")
        if inner is not None and self.join_inner_state:
            dl.inner_optimizer.load_state_dict(inner)
        for f in range(len(dl.fragments)):
            dl._write(f, None, 0.0)  # the joiner's local weights become the global ones
        self.has_state, self.contributes = True, False

    # ------------------------------------------------------------------------------- one attempt
    @torch.no_grad()
    def _attempt(self, gen: Generation, f: int, final: bool):
        dl = self.dl
        names = dl.fragments[f]
        deltas = [dl.backups[n].to(dl.device) - dl._read_piece(dl._pieces[n], dl.backups[n].dtype) for n in names]
        if not self.contributes:
            deltas = [torch.zeros_like(d) for d in deltas]
        differs = float(any(bool(d.any()) for d in deltas))
        counts = torch.tensor([float(self.contributes), differs], device=dl.device)
        self._wait(all_reduce(counts, torch.distributed.ReduceOp.SUM, group=gen.group, algorithm="flat",
                              async_op=True, timeout=self.timeout, agreement=False), gen)
        trained, differs = int(counts[0]), int(counts[1])
        feedback = ErrorFeedback()
        feedback.load_state_dict(dl.error_feedback.state_dict())
        state = None
        if dl.compressor_state is not None:
            state = dl.compressor.new_state()
            state.load_state_dict(dl.compressor_state.state_dict())
        p = gen.size
        topo = Topology(nodes=tuple((i,) for i in range(p)), rank=gen.index, world_size=p)
        dl.outer_bytes += auto.traffic("flat", dl.compressor, [d.numel() for d in deltas],
                                       [tuple(d.shape) for d in deltas], deltas[0].element_size(), topo,
                                       step=dl._reductions).sent(gen.index)
        if dl.compressor is not None:
            self._wait(reduce_tensors(dl.compressor, deltas, list(names), group=gen.group, algorithm="flat",
                                      average=False, step=dl._reductions, seed=0,
                                      feedback=feedback if dl._use_ef else None, state=state,
                                      timeout=self.timeout), gen)
        else:
            flat = torch.cat([d.reshape(-1) for d in deltas])
            self._wait(all_reduce(flat, torch.distributed.ReduceOp.SUM, group=gen.group, algorithm="flat",
                                  async_op=True, timeout=self.timeout, agreement=False), gen)
            deltas, pos = [], 0
            for n in names:
                shape = dl._pieces[n].shape
                k = int(torch.Size(shape).numel())
                deltas.append(flat[pos: pos + k].view(shape))
                pos += k
        averaged = [d / max(trained, 1) for d in deltas]
        return averaged, trained, differs, feedback, state

    def _wait(self, fut, gen: Generation) -> None:
        """Wait for ``fut``, giving up as soon as the membership shows a member of ``gen`` lost."""
        m = self.membership
        deadline = time.monotonic() + self.timeout
        while not fut.done():
            m.check()
            if m.generation > gen.generation and not set(gen.members) <= set(m.members):
                raise _Lost(f"{_NAME}: a member of generation {gen.generation} was lost", op="elastic/round")
            if time.monotonic() > deadline:
                raise CommTimeoutError(f"{_NAME}: an outer sync in generation {gen.generation} did not finish "
                                       f"within {self.timeout:g} s", op="elastic/round")
            time.sleep(0.002)
        fut.value()
