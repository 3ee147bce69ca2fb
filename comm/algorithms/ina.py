"""``ina``: in-network aggregation through the simulated switch (``commopt.comm.ina``).

Each worker sends its buffer once to the switch, as int32 block-floating-point codes, and gets
the sum once: S per node link and direction instead of the ring's 2(p-1)/p S per ring edge. Sums
and averages only; the switch's address comes from the topology (``COMMOPT_INA_SWITCH``).

One call, on a gloo (or NCCL) group: (1) on the caller's thread, the group's long-lived session is
looked up in ``call.sessions`` (the runtime context's ``ina_sessions``, which ``Context.call`` hands
over) or, on the group's first INA call, created under a job identity that rank 0 draws and
broadcasts over the group, and JOINed on the switch (both collectives of every rank, so they stay
in the caller's order); (2) on the comm engine's worker of the group, the session's agreement round
and payload exchange (:mod:`commopt.comm.ina.session`); ``async_op=True`` returns while (2) runs
(docs/faults.md row 37). The group's queue orders its
INA calls, which is the order the session's packets need; a blocking call with nothing else in
flight runs (2) on the caller's thread (``Engine.submit``). On an ``"ina"`` process group the
group's own session and engine serve the call (``InaProcessGroup.submit_all_reduce``), so one
session keeps one order whether DDP or this function issues its all-reduces.

Bytes: the engine counts, per call, the int32 codes of the payload this rank sent, first
transmissions only (the session's ``payload_bytes`` counter), which is what :meth:`Ina.traffic`
models. Left out of both: the 48-byte header of every datagram (0.3 % of a 16000-lane packet), the
agreement round on the control slot (one datagram of 4 (15 + n) bytes each way), JOIN/LEAVE, and
retransmissions (the session's ``counters`` show them). A round the switch saturated is redone and
counted again; an all-zero buffer sends no payload at all (the agreed exponent says so).
"""

from __future__ import annotations

import weakref
from typing import Any, Callable

import torch
import torch.distributed as dist

from ..cache import Cache
from ..engine import Phase
from ..errors import CommError
from ..ina.backend import InaProcessGroup, parse_address
from ..ina.session import DEFAULT_TIMEOUT, InaSession, agree_identity
from ..ina.transport import OP
from ..links import CostModel
from ..topology import Topology
from ._transport import then_finish
from .base import SWITCH, Algorithm, Call, Traffic

__all__ = ["Ina", "INA", "CODE_BYTES"]

CODE_BYTES = 4  # every element travels as one int32 code, whatever its dtype


class Ina(Algorithm):
    name = "ina"
    collectives = ("allreduce",)

    def traffic(self, collective: str, nbytes: float, topology: Topology, *, itemsize: int = 1) -> Traffic:
        """Each rank sends its buffer's int32 codes to the switch and gets as many back (payload only,
        see the module docstring)."""
        t = Traffic(topology)
        if topology.world_size == 1 or not nbytes:
            return t
        codes = nbytes / max(1, itemsize) * CODE_BYTES if itemsize > 1 else nbytes
        for r in range(topology.world_size):
            t.add(r, SWITCH, codes)
            t.add(SWITCH, r, codes)
        return t

    def cost(self, model: CostModel, collective: str, nbytes: float, topology: Topology) -> float:
        if topology.world_size == 1 or not nbytes:
            return 0.0
        return model.inter.time(2 * self.link_bytes(collective, nbytes, topology), 2)

    def all_reduce(self, call: Call) -> torch.futures.Future:
        """Sum ``call.prepared.flat`` through the switch (AVG arrives as SUM and a scale); a Future
        that completes once the engine ran the exchange, or holds the error (so hooks see it on
        ``wait()``)."""
        p = call.prepared
        try:
            if call.red != dist.ReduceOp.SUM:
                raise ValueError(f"{OP}: in-network aggregation sums (and averages); reduce op {call.red} is not "
                                 "supported, use algorithm='flat'")
            pg = call.group if call.group is not None else dist.group.WORLD
            if isinstance(pg, InaProcessGroup):
                fut = pg.submit_all_reduce([p.flat], "sum", timeout=call.timeout, blocking=call.blocking)
            else:
                fut = _submit(call, pg, p.flat)
        except (CommError, ValueError, TypeError, OSError) as e:
            fut = torch.futures.Future()
            fut.set_exception(e)
            return fut
        return then_finish(fut, p)


INA = Ina()


def _submit(call: Call, pg: Any, flat: torch.Tensor) -> torch.futures.Future:
    """Phase (1) here, phase (2) on the engine (see the module docstring)."""
    rank, size = dist.get_rank(call.group), dist.get_world_size(call.group)
    spec = getattr(call.topology, "ina_switch", None)
    if not spec:
        raise CommError(f"{OP}: no switch address: set COMMOPT_INA_SWITCH=host:port (read by "
                        "Topology.from_env()) or pass a Topology with ina_switch, and run "
                        "`commopt-bench ina-switch`", op=OP, ranks=[rank])
    address = parse_address(str(spec))
    timeout = call.timeout if call.timeout is not None else DEFAULT_TIMEOUT
    sessions = call.sessions
    session = _session_for(sessions, pg, address, rank, size, flat.device, timeout)

    def exchange() -> int:
        try:
            return session.exchange([flat], "sum", timeout)
        except BaseException:
            if session.broken is not None or session.closed:
                _drop_session(sessions, pg, address, rank, size, session)
            raise

    return call.engine.submit([Phase("all_reduce", exchange, pg)], op="ina", result=None, device=flat.device,
                              blocking=call.blocking)


# --------------------------------------------------------------------------------- sessions
def _session_key(pg: Any, address: tuple[str, int], rank: int, size: int) -> tuple:
    return (id(pg), str(getattr(pg, "group_name", "") or "WORLD"), address, rank, size)


def _identity_key(pg: Any) -> tuple:
    return ("ina-identity", id(pg), str(getattr(pg, "group_name", "") or "WORLD"))


def _group_ref(pg: Any) -> Callable[[], Any]:
    try:
        return weakref.ref(pg)
    except TypeError:
        return (lambda: pg)  # noqa: E731 - not weakly referenceable: keep the group alive with it


def _session_for(sessions: Cache, pg: Any, address: tuple[str, int], rank: int, size: int, device: Any,
                 timeout: float) -> InaSession:
    """The cached, joined session of ``pg`` on the switch at ``address`` (created on first use).

    Reusing one session saves the JOIN round trip and the socket set-up on every call. The group's
    job identity is agreed once, by a broadcast over ``pg`` on its first INA all-reduce, and kept
    for the group's lifetime: a session dropped after a failure is replaced under the same identity
    without another collective (the ranks may be out of step then), and the switch starts its new
    incarnation once every rank's old session has left. The entries hold a weak reference to the
    group: a destroyed group whose id() is reused by a new one inherits neither. A new session JOINs
    here, on the caller's thread, before its first payload is queued.
    """
    key, ikey = _session_key(pg, address, rank, size), _identity_key(pg)
    with sessions.lock:
        entry = sessions.get(key)
        if entry is not None:
            ref, session = entry  # type: ignore[misc]
            if ref() is pg and not session.closed and session.broken is None:
                return session
            sessions.pop(key)
            session.close()
        ident = sessions.get(ikey)
        identity = ident.identity if isinstance(ident, _CachedIdentity) and ident.ref() is pg else None
    ref = _group_ref(pg)
    if identity is None:
        # Outside the lock: a collective that may wait up to the timeout must not block other groups.
        identity = agree_identity(pg, device, timeout)
        sessions.put(ikey, _CachedIdentity(ref, identity))  # kept even if the JOIN below fails
    session = InaSession(address, job_id=identity[0], nonce=identity[1], worker_id=rank, num_workers=size)
    try:
        session.join(timeout)  # every rank's; outside the lock for the same reason
    except BaseException:
        session.close()
        raise
    old = sessions.put(key, _CachedSession(ref, session))
    if old is not None:
        old.close()  # type: ignore[attr-defined]
    return session


class _CachedSession(tuple):
    """(weak reference to the group, session); ``close()`` closes the session (for destroy())."""

    def __new__(cls, ref: Any, session: InaSession) -> _CachedSession:
        return super().__new__(cls, (ref, session))

    def close(self) -> None:
        self[1].close()


class _CachedIdentity:
    """A group's agreed job identity in the context (nothing to close: destroy() just drops it)."""

    __slots__ = ("ref", "identity")

    def __init__(self, ref: Callable[[], Any], identity: tuple[int, int]):
        self.ref = ref
        self.identity = identity


def _drop_session(sessions: Cache, pg: Any, address: tuple[str, int], rank: int, size: int,
                  session: InaSession) -> None:
    key = _session_key(pg, address, rank, size)
    with sessions.lock:
        entry = sessions.get(key)
        if entry is not None and entry[1] is session:  # type: ignore[index]
            sessions.pop(key)
    session.close()
