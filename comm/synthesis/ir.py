"""The schedule IR: a collective as, per rank, an ordered list of point-to-point steps over chunks
(docs/architecture.md, "synthesized collectives").

A :class:`Schedule` is what a synthesizer writes, the checker proves (``check.py``), the simulator times
(``sim.py``) and the executor runs (``comm/algorithms/synth.py``). It is two-sided, like MSCCL's XML,
because gloo has no one-sided put: every ``send`` pairs with one ``recv`` or ``rrc`` at the peer.

**The buffer and its chunks.** The collective's buffer (all-reduce: the tensor; reduce-scatter: the
input, the concatenation of the N shards; all-gather: the output, the same) of ``n`` elements is cut
into ``len(weights)`` contiguous chunks; chunk c spans elements ``[n * W_c // W, n * W_{c+1} // W)``,
with ``W_c`` the sum of ``weights[:c]`` and ``W`` the sum of all (integers: every rank cuts alike, for
every ``n``, exactly). For reduce-scatter and all-gather every chunk lies inside one rank's shard:
:meth:`Schedule.shard_of`.

**Pre- and postconditions** (what the checker proves):

- all-reduce: rank r starts with its contribution to every chunk; at the end every rank holds, for
  every chunk, the sum of all N contributions, each counted once, *computed once*: by one rank (the
  chunk's owner) in the order its steps give, and copied to the others (bit-identical everywhere);
- reduce-scatter: rank r starts with its contribution to every chunk; at the end it holds the sum of
  all N contributions to every chunk of shard r (the other chunks' contents are unspecified);
- all-gather: rank r starts with the chunks of shard r; at the end every rank holds every chunk.

**Steps** (:class:`Step`; MSCCL's names where they exist): ``send`` sends the current contents of its
chunks (concatenated in the listed order) to ``peer``; ``recv`` receives them from ``peer`` and copies
them into its chunks; ``rrc`` (receive-reduce-copy) receives them and adds them into its chunks.
``deps`` are indices of earlier steps of the same rank that must have completed before this step
starts (a send: before it reads its chunks; a recv or rrc: before it writes them; a receive may be
*posted* earlier, into its own buffer). Steps of one rank with no path of ``deps`` between them may run
in any order or at once, so two of them touching a common chunk, one writing it, must be ordered by
``deps`` (the checker refuses a race). The k-th send from rank a to rank b pairs with the k-th
receive (recv or rrc) at b from a, in list order; their chunks must be the same list.

JSON (:meth:`Schedule.to_json` / :meth:`Schedule.from_json`) mirrors MSCCL++'s execution plan where
its names apply (``name``, ``collective``, ``inplace``, ``min_message_size``, ``max_message_size``,
``gpus`` with ``id`` and per-rank ``ops`` of ``name``, ``peer``, ``chunks``, ``deps``).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

__all__ = ["Step", "Schedule", "ScheduleError", "COLLECTIVES", "OPS", "chunk_bounds"]

COLLECTIVES = ("allreduce", "reducescatter", "allgather")
OPS = ("send", "recv", "rrc")


class ScheduleError(ValueError):
    """A schedule that is malformed or fails the checker; the message names the broken condition."""


@dataclass(frozen=True)
class Step:
    """One point-to-point step of one rank (see the module docstring).

    Attributes:
        op: "send", "recv" or "rrc".
        peer: the other rank.
        chunks: the chunk ids it carries, in payload order.
        deps: indices of earlier steps of this rank that must complete first.
    """

    op: str
    peer: int
    chunks: tuple[int, ...]
    deps: tuple[int, ...] = ()


@dataclass
class Schedule:
    """A collective's schedule (see the module docstring).

    Attributes:
        collective: "allreduce", "reducescatter" or "allgather".
        nranks: the ranks N (group ranks 0..N-1).
        weights: the chunks' relative sizes (positive ints).
        steps: per rank, its ordered steps.
        name: a label (the synthesizer and its parameters).
        min_message_size, max_message_size: the byte range this schedule is meant for (MSCCL++'s
            selector fields; informative: the executor runs it at any size).
    """

    collective: str
    nranks: int
    weights: list[int]
    steps: list[list[Step]]
    name: str = ""
    min_message_size: int = 0
    max_message_size: int = 2**63 - 1
    meta: dict = field(default_factory=dict)

    @property
    def nchunks(self) -> int:
        return len(self.weights)

    def bounds(self, n: int) -> list[tuple[int, int]]:
        """Each chunk's element range in a buffer of ``n`` elements."""
        return chunk_bounds(n, self.weights)

    def shard_of(self, chunk: int) -> int:
        """Reduce-scatter and all-gather: the rank whose shard holds ``chunk`` (its weight range lies in
        ``[r W / N, (r + 1) W / N)``; ``ScheduleError`` if it straddles two shards)."""
        total = sum(self.weights)
        start = sum(self.weights[:chunk])
        end = start + self.weights[chunk]
        r = start * self.nranks // total
        if end * self.nranks > (r + 1) * total:
            raise ScheduleError(f"chunk {chunk} (weights [{start}, {end}) of {total}) straddles shards {r} and "
                                f"{r + 1}: for {self.collective} every chunk lies inside one rank's shard")
        return r

    # ------------------------------------------------------------------------------- JSON
    def to_json(self) -> str:
        """The schedule as JSON (MSCCL++-like names; :meth:`from_json` reads it back)."""
        return json.dumps({
            "name": self.name, "collective": self.collective, "inplace": True, "nranks": self.nranks,
            "min_message_size": self.min_message_size, "max_message_size": self.max_message_size,
            "chunk_weights": list(self.weights), "meta": self.meta,
            "gpus": [{"id": r, "ops": [{"name": s.op, "peer": s.peer, "chunks": list(s.chunks), "deps": list(s.deps)}
                                       for s in steps]} for r, steps in enumerate(self.steps)],
        }, indent=1)

    @classmethod
    def from_json(cls, text: str) -> Schedule:
        """A schedule from :meth:`to_json`'s format; ``ScheduleError`` naming what is malformed."""
        try:
            doc = json.loads(text)
        except json.JSONDecodeError as e:
            raise ScheduleError(f"schedule JSON does not parse: {e}") from e
        if not isinstance(doc, dict):
            raise ScheduleError("schedule JSON must be an object with 'collective', 'nranks', 'chunk_weights', 'gpus'")
        try:
            gpus = sorted(doc["gpus"], key=lambda g: int(g["id"]))
            sched = cls(collective=str(doc["collective"]), nranks=int(doc["nranks"]),
                        weights=[int(w) for w in doc["chunk_weights"]],
                        steps=[[Step(str(o["name"]), int(o["peer"]), tuple(int(c) for c in o["chunks"]),
                                     tuple(int(d) for d in o.get("deps", ()))) for o in g["ops"]] for g in gpus],
                        name=str(doc.get("name", "")), min_message_size=int(doc.get("min_message_size", 0)),
                        max_message_size=int(doc.get("max_message_size", 2**63 - 1)), meta=dict(doc.get("meta", {})))
        except (KeyError, TypeError, ValueError) as e:
            raise ScheduleError(f"schedule JSON is missing or has a malformed field: {e!r}") from e
        if [int(g["id"]) for g in gpus] != list(range(sched.nranks)):
            raise ScheduleError(f"schedule JSON: 'gpus' must list ids 0..{sched.nranks - 1} once each")
        return sched


def chunk_bounds(n: int, weights: list[int]) -> list[tuple[int, int]]:
    """The element ranges of chunks of relative sizes ``weights`` in a buffer of ``n`` elements."""
    total = sum(weights)
    out, acc = [], 0
    for w in weights:
        out.append((n * acc // total, n * (acc + w) // total))
        acc += w
    return out
