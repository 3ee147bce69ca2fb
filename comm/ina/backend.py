"""The ``"ina"`` torch.distributed backend: all-reduce through the switch, everything else through gloo.

``dist.init_process_group("ina", store=..., rank=..., world_size=..., pg_options=InaOptions(switch=
"127.0.0.1:5555"))`` gives a process group whose float all-reduce (SUM and AVG; fp32, fp16, bf16)
goes through the simulated in-network aggregation switch, while broadcast, all-gather,
reduce-scatter, barrier, send/recv and any other all-reduce (integer tensors, MAX/MIN/PRODUCT) go to
an internal gloo group built on the same store. DDP therefore runs on it unchanged: it broadcasts
parameters at construction (gloo) and all-reduces gradient buckets (switch).

Where the switch address comes from, in order: ``InaOptions.switch``; ``COMMOPT_INA_SWITCH``, read by
``topology.ina_switch_from_env()`` (the one place that reads it, docs/architecture.md section 6.3; it needs no layout,
so torchrun jobs need not set ``COMMOPT_NODES``). Without either, group creation fails with a
:class:`CommError` saying how to pass it; a malformed variable raises ``TopologyError`` naming it.

The job's identity is agreed when the group is created: rank 0 draws a random job id (or takes
``InaOptions.job_id``) and a random 64-bit nonce and broadcasts both over the internal gloo group,
within the group's timeout. Every packet carries the identity and the switch keys its jobs by it, so
several groups (and several trainings, even with the same job id) share a switch through its
partitioned slot pool without ever sharing a job.

The switch's all-reduces run on the group's own comm engine (:class:`~commopt.comm.engine.Engine`,
one FIFO worker for the group, so they reach the switch in the order they were issued, which the
session's packet order needs), and ``allreduce`` returns at once a :class:`InaWork` that completes
later (docs/faults.md row 37): DDP launches a bucket's all-reduce and goes on with backward, waiting only at
the end. A synchronous ``dist.all_reduce(t)`` (``asyncOp`` false) runs on the calling thread when
nothing else is in flight (the engine's blocking path: no thread hand-off). The session's JOIN, a
collective of every rank through the switch, happens on the calling thread before the first
payload. A failure reaches ``wait()`` as the session's :class:`CommError`, and ``get_future()``
fails with a ``RuntimeError`` whose text starts with that error's type and message (what DDP
re-raises from ``backward()``).

The group owns its engine rather than using ``commopt.comm.context()``'s: the runtime context
imports the algorithm objects, ``ina``'s among them, which import this package, so this module
cannot import the runtime without an import cycle (docs/architecture.md section 1). Its byte counter is
:attr:`InaProcessGroup.engine`'s ``bytes_sent()["ina"]`` (the payload's int32 codes, as
``algorithms.ina.Ina.traffic`` predicts); ``all_reduce(..., algorithm="ina")`` on an ``"ina"``
group goes through the same engine, so one session keeps one order.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import _create_work_from_future
from torch.futures import Future

from .._pygroup import PythonProcessGroup
from ..engine import Engine, Phase, wait
from ..errors import CommError, CommTimeoutError
from ..topology import ina_switch_from_env
from .faults import FaultConfig
from .session import InaSession, draw_identity, identity_of, identity_tensor
from .transport import OP

__all__ = ["BACKEND_NAME", "InaOptions", "InaProcessGroup", "InaWork", "parse_address", "register_backend"]

BACKEND_NAME = "ina"
_INA_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def parse_address(spec: str | tuple[str, int]) -> tuple[str, int]:
    """``"host:port"`` (or a (host, port) tuple) -> (host, port), with a clear error otherwise."""
    if isinstance(spec, tuple):
        host, port = spec
        return str(host), int(port)
    host, sep, port = str(spec).rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"ina switch address {spec!r} is not 'host:port'; pass e.g. '127.0.0.1:5555' as "
                         "InaOptions(switch=...) or COMMOPT_INA_SWITCH")
    return host.strip("[]"), int(port)


@dataclass
class InaOptions:
    """Options of an ``"ina"`` process group (``pg_options=`` of ``init_process_group``/``new_group``).

    Args:
        switch: the switch, "host:port" or (host, port); None reads ``COMMOPT_INA_SWITCH``.
        job_id: the job id on the switch (0..65535); None lets rank 0 draw one. Either way rank 0 adds
            a random nonce, so a fixed id shared by two groups still gives two jobs.
        timeout: seconds per all-reduce; None uses the process group's timeout.
        window: packets in flight per worker.
        payload_elems: int32 lanes per datagram.
        max_retries: unanswered retransmissions of one chunk before CommTimeoutError.
        faults: seeded fault injection (tests only).
        gloo_hostname: address the internal gloo group binds to; None leaves gloo's default (which
            honours ``GLOO_SOCKET_IFNAME``).
    """

    switch: str | tuple[str, int] | None = None
    job_id: int | None = None
    timeout: float | None = None
    # 16 x 8192-lane packets (InaSession's defaults are 8 x 16000). The DDP-test hang once blamed on
    # the larger packets was a gloo teardown deadlock in the test's plain-gloo phase (see
    # tests/test_ina_procs.py::_train); packet settings only changed its timing.
    window: int = 16
    payload_elems: int = 8192
    max_retries: int = 20
    faults: FaultConfig | None = None
    gloo_hostname: str | None = None


def _completed(result: Any) -> Any:
    fut: Future = Future()
    fut.set_result(result)
    return _create_work_from_future(fut)


def _value(fut: Any) -> Any:
    return fut.value()  # re-raises a failure: inside then(), as a C++-level error DDP can see


class InaWork(dist.Work):
    """The work of a switch all-reduce: completes when the group's engine has run it.

    ``wait()`` blocks until then and raises the session's :class:`CommError` (a
    :class:`CommTimeoutError` when the switch or a peer is gone). ``get_future()`` is what DDP's
    reducer (C++) waits on: torch's Python ``Future.set_exception`` is invisible there (the error
    travels as the future's *value*), so that future is a ``then()`` of the engine's whose callback
    re-raises, which C++ sees as a failure carrying the error's type and message.

    Args:
        future: the engine's future of the all-reduce (completes with the reduced tensors).
        op: the operation named by a timeout of ``wait(timeout)``.
    """

    def __init__(self, future: Future, op: str = OP):
        super().__init__()
        self._future = future
        self._op = op
        self._visible = future.then(_value)

    def wait(self, timeout: timedelta | None = None) -> bool:  # type: ignore[override]
        """Block until the all-reduce completed; raise its error. ``timeout`` <= 0 or None: no bound."""
        seconds = timeout.total_seconds() if timeout is not None else 0.0
        wait(self._future, seconds if seconds > 0 else None, op=self._op)
        return True

    def get_future(self) -> Any:  # type: ignore[override]
        return self._visible

    def is_completed(self) -> bool:  # type: ignore[override]
        return self._future.done()

    def is_success(self) -> bool:  # type: ignore[override]
        return self._future.done() and self.exception() is None

    def exception(self) -> BaseException | None:  # type: ignore[override]
        if not self._future.done():
            return None
        try:
            self._future.value()
        except Exception as e:  # noqa: BLE001 - this is the query for it
            return e
        return None

    def result(self) -> list[torch.Tensor]:  # type: ignore[override]
        return self._future.wait()

    @classmethod
    def failed(cls, error: BaseException) -> InaWork:
        """A work that has already failed with ``error`` (a failure before submission)."""
        fut: Future = Future()
        fut.set_exception(error)
        return cls(fut)


def _shutdown(engine: Engine, session: InaSession) -> None:
    """Stop the group's engine after its queued work, then close the session (LEAVE, socket)."""
    try:
        engine.shutdown()
    except RuntimeError:
        pass  # run by the garbage collector on the engine's own worker thread, which cannot join itself
    session.close()


class InaProcessGroup(PythonProcessGroup):
    """A process group whose float SUM/AVG all-reduce goes through the in-network aggregation switch.

    Args:
        store: the group's store (a prefix store from ``init_process_group``).
        rank: this rank in the group.
        size: the group's size.
        timeout: the group's timeout.
        options: see :class:`InaOptions`.
    """

    backend_name = BACKEND_NAME

    def __init__(self, store: dist.Store, rank: int, size: int, timeout: timedelta,
                 options: InaOptions | None = None):
        super().__init__(rank, size)
        options = options or InaOptions()
        if options.switch is not None:
            address = parse_address(options.switch)
        else:
            found = ina_switch_from_env()  # layout-free: works under torchrun without COMMOPT_NODES
            if found is None:
                raise CommError("init_process_group('ina'): no switch address; pass pg_options=InaOptions("
                                "switch='host:port') or set COMMOPT_INA_SWITCH=host:port; start the switch "
                                "with `commopt-bench ina-switch`", op="init/ina", seq=0, ranks=[rank])
            address = found
        self._gloo = self._make_gloo(store, rank, size, timeout, options.gloo_hostname)
        job_id, nonce = self._agree_identity(rank, timeout, options.job_id)
        self._session = InaSession(address, job_id=job_id, nonce=nonce, worker_id=rank, num_workers=size,
                                   timeout=options.timeout or timeout.total_seconds(), window=options.window,
                                   payload_elems=options.payload_elems, max_retries=options.max_retries,
                                   faults=options.faults)
        self._engine = Engine()
        self._finalizer = weakref.finalize(self, _shutdown, self._engine, self._session)

    def _agree_identity(self, rank: int, timeout: timedelta, job_id: int | None) -> tuple[int, int]:
        """(job id, nonce) drawn on rank 0 and broadcast over the internal gloo group.

        A broadcast rather than the store: a store reused by a later group of the same name could
        hand a rank the previous group's key before rank 0 overwrote it.
        """
        t = identity_tensor(draw_identity(job_id) if rank == 0 else (0, 0))
        opts = dist.BroadcastOptions()
        opts.rootRank, opts.rootTensor = 0, 0
        try:
            self._gloo.broadcast([t], opts).wait(timeout)
        except RuntimeError as e:
            raise CommTimeoutError(f"init_process_group('ina'): agreeing on the job identity failed on rank "
                                   f"{rank}: {e}; every rank must create the group", op="init/ina", seq=0,
                                   ranks=[rank]) from e
        return identity_of(t)

    @staticmethod
    def _make_gloo(store: dist.Store, rank: int, size: int, timeout: timedelta,
                   hostname: str | None) -> Any:
        prefix = dist.PrefixStore("commopt_ina_gloo", store)
        if hostname is None:
            return dist.ProcessGroupGloo(prefix, rank, size, timeout)
        opts = dist.ProcessGroupGloo._Options()
        opts._timeout = timeout
        opts._devices = [dist.ProcessGroupGloo.create_device(hostname=hostname)]
        return dist.ProcessGroupGloo(prefix, rank, size, opts)

    @property
    def session(self) -> InaSession:
        """This rank's switch session (its ``counters`` count packets and retransmissions)."""
        return self._session

    @property
    def engine(self) -> Engine:
        """The group's comm engine: one FIFO worker for its switch all-reduces; ``bytes_sent()["ina"]``."""
        return self._engine

    @property
    def job_id(self) -> int:
        return self._session.job_id

    # -- the one collective the switch does ------------------------------------------------------

    def allreduce(self, tensors: Any, opts: Any = None) -> Any:
        tensors = [tensors] if isinstance(tensors, torch.Tensor) else list(tensors)
        if opts is None:
            opts = dist.AllreduceOptions()
        elif isinstance(opts, dist.ReduceOp) or not hasattr(opts, "reduceOp"):
            op, opts = opts, dist.AllreduceOptions()
            opts.reduceOp = op
        red = opts.reduceOp
        op = "sum" if red == dist.ReduceOp.SUM else "avg" if red == dist.ReduceOp.AVG else None
        if op is None or any(t.dtype not in _INA_DTYPES or t.is_sparse for t in tensors):
            if op == "avg":
                raise CommError(f"ina all_reduce: AVG of {[str(t.dtype) for t in tensors]} is not supported by "
                                "the gloo fallback; use SUM and divide", op=OP,
                                seq=self._session.seq, ranks=[self.rank()])
            return self._gloo.allreduce(tensors, opts)
        return self._work(tensors, op, blocking=not getattr(opts, "asyncOp", True))

    def submit_all_reduce(self, tensors: list[torch.Tensor], op: str, *, timeout: float | None = None,
                          blocking: bool = False) -> Future:
        """Queue a switch all-reduce of ``tensors`` (in place, one after the other) on the group's engine.

        Joins the session first, on this thread, when it has not joined yet (every rank's first
        all-reduce: JOIN returns once all ranks joined). Returns the engine's future of ``tensors``;
        ``blocking`` lets the engine run it right here when nothing else is in flight.

        Raises:
            CommError: the JOIN failed (the session is then broken, as the group is).
        """
        session = self._session
        call_timeout = timeout if timeout is not None else session.timeout
        if session.epoch is None:  # joined sessions fail on the engine (InaWork.wait), not here
            session.join(call_timeout)  # no payload can be in flight before the first join

        def exchange() -> int:
            return session.exchange(tensors, op, call_timeout)

        return self._engine.submit([Phase("all_reduce", exchange, self)], op="ina", result=tensors,
                                   device=tensors[0].device if tensors else None, blocking=blocking)

    def _work(self, tensors: list[torch.Tensor], op: str, *, blocking: bool) -> InaWork:
        try:
            return InaWork(self.submit_all_reduce(tensors, op, blocking=blocking))
        except CommError as e:
            return InaWork.failed(e)

    def allreduce_coalesced(self, tensors: Any, opts: Any = None) -> Any:
        opts = opts if opts is not None else dist.AllreduceCoalescedOptions()
        red = opts.reduceOp
        if red in (dist.ReduceOp.SUM, dist.ReduceOp.AVG) and all(t.dtype in _INA_DTYPES for t in tensors):
            op = "sum" if red == dist.ReduceOp.SUM else "avg"
            return self._work(list(tensors), op, blocking=not getattr(opts, "asyncOp", True))
        return self._gloo.allreduce_coalesced(tensors, opts)

    # -- everything else goes to gloo ------------------------------------------------------------

    def broadcast(self, *args: Any, **kwargs: Any) -> Any:
        return self._gloo.broadcast(*args, **kwargs)

    def allgather(self, *args: Any, **kwargs: Any) -> Any:
        return self._gloo.allgather(*args, **kwargs)

    def allgather_coalesced(self, *args: Any, **kwargs: Any) -> Any:
        return self._gloo.allgather_coalesced(*args, **kwargs)

    def _allgather_base(self, *args: Any, **kwargs: Any) -> Any:
        return self._gloo._allgather_base(*args, **kwargs)

    def all_gather_single(self, *args: Any, **kwargs: Any) -> Any:
        return self._gloo._allgather_base(*args, **kwargs)

    def all_gather_single_coalesced(self, outputs: list[torch.Tensor], inputs: list[torch.Tensor],
                                    opts: Any = None) -> Any:
        return self._sequential([(o, i) for o, i in zip(outputs, inputs)], self._gloo._allgather_base,
                                opts if opts is not None else dist.AllgatherOptions(), outputs)

    allgather_into_tensor_coalesced = all_gather_single_coalesced

    def reduce_scatter(self, *args: Any, **kwargs: Any) -> Any:
        return self._gloo.reduce_scatter(*args, **kwargs)

    def _reduce_scatter_base(self, *args: Any, **kwargs: Any) -> Any:
        return self._gloo._reduce_scatter_base(*args, **kwargs)

    def reduce_scatter_single(self, *args: Any, **kwargs: Any) -> Any:
        return self._gloo._reduce_scatter_base(*args, **kwargs)

    def reduce_scatter_single_coalesced(self, outputs: list[torch.Tensor], inputs: list[torch.Tensor],
                                        opts: Any = None) -> Any:
        return self._sequential([(o, i) for o, i in zip(outputs, inputs)], self._gloo._reduce_scatter_base,
                                opts if opts is not None else dist.ReduceScatterOptions(), outputs)

    reduce_scatter_tensor_coalesced = reduce_scatter_single_coalesced

    def alltoall(self, *args: Any, **kwargs: Any) -> Any:
        return self._gloo.alltoall(*args, **kwargs)

    def alltoall_base(self, *args: Any, **kwargs: Any) -> Any:
        return self._gloo.alltoall_base(*args, **kwargs)

    def all_to_all_single(self, *args: Any, **kwargs: Any) -> Any:
        return self._gloo.alltoall_base(*args, **kwargs)

    def barrier(self, *args: Any, **kwargs: Any) -> Any:
        return self._gloo.barrier(*args, **kwargs)

    def monitored_barrier(self, *args: Any, **kwargs: Any) -> Any:
        return self._gloo.monitored_barrier(*args, **kwargs)

    def gather(self, *args: Any, **kwargs: Any) -> Any:
        return self._gloo.gather(*args, **kwargs)

    def scatter(self, *args: Any, **kwargs: Any) -> Any:
        return self._gloo.scatter(*args, **kwargs)

    def reduce(self, *args: Any, **kwargs: Any) -> Any:
        return self._gloo.reduce(*args, **kwargs)

    def send(self, *args: Any, **kwargs: Any) -> Any:
        return self._gloo.send(*args, **kwargs)

    def recv(self, *args: Any, **kwargs: Any) -> Any:
        return self._gloo.recv(*args, **kwargs)

    def recv_anysource(self, *args: Any, **kwargs: Any) -> Any:
        return self._gloo.recv_anysource(*args, **kwargs)

    def _sequential(self, pairs: list[tuple[torch.Tensor, torch.Tensor]], fn: Any, opts: Any,
                    result: Any) -> Any:
        # Gloo has no coalesced form of these; issue them one by one in the same order on every rank.
        for out, inp in pairs:
            fn(out, inp, opts).wait()
        return _completed(result)

    # -- lifecycle -------------------------------------------------------------------------------

    def shutdown(self) -> None:
        """Stop the group's engine (after the all-reduces it holds), close the switch session and the
        gloo group (called by ``destroy_process_group``)."""
        self._finalizer()
        shutdown = getattr(self._gloo, "shutdown", None)
        if shutdown is not None:
            shutdown()

    def abort(self) -> None:
        self.shutdown()


def _create(common: Any, options: Any) -> InaProcessGroup:
    """The creator torch calls (extended API: it receives ``pg_options``)."""
    if options is not None and not isinstance(options, InaOptions):
        raise TypeError(f"init_process_group('ina'): pg_options must be commopt.comm.ina.InaOptions, not "
                        f"{type(options).__name__}")
    return InaProcessGroup(common.store, common.group_rank, common.group_size, common.timeout, options)


def register_backend() -> None:
    """Register ``"ina"`` with torch.distributed (idempotent; importing ``commopt.comm.ina`` calls it)."""
    if BACKEND_NAME.upper() in dist.Backend._plugins:  # torch keeps no public "is registered" query
        return
    dist.Backend.register_backend(BACKEND_NAME, _create, extended_api=True, devices=["cpu", "cuda"])
