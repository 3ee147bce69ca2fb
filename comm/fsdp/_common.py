"""What the FSDP2 comms share: the reduction FSDP asks for, the segments of its flat buffers, and the
base of every comm object (the block codec and the quantized exchange are ``compression.quantize``'s,
the error-feedback memory and the buffer :class:`Layout` ``compression.feedback``'s: the same that
the DDP hook uses).

FSDP2 hands a comm one flat buffer per module (a "parameter group"): the reduce-scatter input is laid
out ``(world, chunk)`` and every row is the concatenation of each parameter's padded shard; the
all-gather input is this rank's row. :class:`Layout` records those per-parameter segments (names
and padded shard sizes, taken from the module when :func:`register` binds a comm to it), so that
quantization blocks never straddle two parameters (a LayerNorm weight of 1.0 beside a matrix of
0.02 would otherwise set the matrix's scale) and residuals are keyed by parameter name. The
all-gather carries every parameter; the reduce-scatter (and the HSDP hook's shard) only those that
require gradients: FSDP2 leaves frozen ones out (:meth:`Bound.reduced`).

Failures reach the caller (docs/faults.md rows 4, 5 for FSDP2): every call computes one deadline from its
``timeout`` when it starts, and every phase and every wait of the call is bounded by what is left
of it; an asynchronous all-gather returns a :class:`CommWork` whose ``wait()`` raises the call's
error (FSDP2 waits on it before it reads the gathered parameters). With ``check_finite=True`` the
state changes of a backward are journalled (:class:`Journal`), so that ``NonFiniteError`` leaves
every residual as it was before that backward.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch.distributed import ReduceOp

from .. import algorithms
from ..algorithms import ALGORITHM_FACTORS
from ..algorithms._transport import Prepared, all_gather_single, flat_future, remaining, wait_work
from ..algorithms.roles import FSDP_CHECK
from ..compression import Compressor, QuantizeCompressor
from ..compression.base import all_finite
from ..compression.feedback import ErrorFeedback, Layout
from ..dispatch import select_algorithm
from ..engine import Phase, wait
from ..errors import NonFiniteError, TopologyError
from ..runtime import context
from ..topology import Topology

__all__ = ["Layout", "Journal", "CommBase", "CollectiveComm", "BoundComm", "Bound", "CommWork",
           "reduction", "done_work", "as_work", "cut_segments", "NATIVE"]

#: ``algorithm=NATIVE``: torch's own collective (FSDP2's default comm issues the same call), under the
#: comm's deadline and with commopt's errors.
NATIVE = "native"


def reduction(op, world: int) -> tuple[float, str]:
    """``(scale, name)``: FSDP's ``op`` as a SUM followed by a multiplication by ``scale``.

    FSDP2 passes ``AVG`` (fp32/bf16 reduce dtypes), ``SUM`` (fp16, or
    ``set_force_sum_reduction_for_comms``, with FSDP dividing before and after itself) or
    ``PREMUL_SUM(1 / factor)`` (``set_gradient_divide_factor``), a ``ReduceOp`` object whose
    ``factor`` multiplies every input; multiplying the sum instead is the same in exact arithmetic.
    """
    factor = getattr(op, "factor", None)
    if factor is not None and getattr(op, "op", None) == ReduceOp.PREMUL_SUM:
        return float(factor), "premul_sum"
    if op == ReduceOp.AVG:
        return 1.0 / world, "avg"
    if op == ReduceOp.SUM:
        return 1.0, "sum"
    raise ValueError(f"reduce op {op!r} is not one FSDP2 passes; commopt's FSDP comms reduce with ReduceOp.SUM, "
                     f"ReduceOp.AVG or ReduceOp.PREMUL_SUM(factor)")


class CommWork(dist.Work):
    """The ``Work`` an asynchronous comm hands FSDP2: ``wait()`` returns once the call's engine
    future has completed, and raises its error (``CommTimeoutError``, ``CommError``) when it failed,
    within what is left of the call's deadline.

    FSDP2 calls ``wait()`` before it reads the all-gather's output (``foreach_all_gather_copy_out``)
    and ignores what it returns; torch's ``_create_work_from_future`` builds a Work whose ``wait()``
    returns True even when the future holds an exception, so a forward whose all-gather had timed
    out computed with whatever the buffer held (docs/faults.md row 5: an evaluation loop never raised).

    Args:
        future: the engine future of the call.
        op: the call's name in errors.
        timeout: the call's timeout (named in a timeout error), None for none of commopt's own.
        deadline: the call's ``time.monotonic()`` deadline, None for none.
    """

    def __init__(self, future: torch.futures.Future, op: str, timeout: float | None = None,
                 deadline: float | None = None):
        super().__init__()
        self._future, self._op, self._timeout, self._deadline = future, op, timeout, deadline

    def wait(self, timeout: timedelta | None = None) -> bool:
        """Block until the call completes; raise its error if it failed or its deadline passed
        (``timeout``, when positive, bounds this wait too)."""
        deadline = self._deadline
        if timeout is not None and timeout.total_seconds() > 0:
            own = time.monotonic() + timeout.total_seconds()
            deadline = own if deadline is None else min(deadline, own)
        wait(self._future, self._timeout, op=self._op, deadline=deadline)
        return True

    def get_future(self) -> torch.futures.Future:
        return self._future

    def is_completed(self) -> bool:
        return self._future.done()

    def is_success(self) -> bool:
        return self._future.done() and self.exception() is None

    def exception(self) -> BaseException | None:
        """The call's error once it has failed, else None."""
        if not self._future.done():
            return None
        try:
            self._future.value()
        except Exception as exc:  # noqa: BLE001 - returned, not handled
            return exc
        return None

    def result(self) -> list[torch.Tensor]:
        self.wait()
        return []

    def synchronize(self) -> None:
        # Engine phases synchronise their side stream before the future completes: the host wait
        # orders the caller after them.
        self.wait()

    def block_current_stream(self) -> None:
        self.wait()


def done_work(async_op: bool) -> CommWork | None:
    """What a comm that finished before returning gives back: None, or for ``async_op`` a
    completed ``Work`` (the reduce-scatter always finishes: FSDP2 reads its output right after)."""
    if not async_op:
        return None
    fut: torch.futures.Future = torch.futures.Future()
    fut.set_result(None)
    return CommWork(fut, "fsdp")


def as_work(fut: torch.futures.Future, op: str, timeout: float | None = None,
            deadline: float | None = None) -> CommWork:
    """The ``Work`` FSDP2 waits on before it reads an asynchronous all-gather's output: it
    completes with ``fut`` and its ``wait()`` raises ``fut``'s error (see :class:`CommWork`)."""
    return CommWork(fut, op, timeout, deadline)


# --------------------------------------------------------------------------------- layout
def cut_segments(numels: tuple[int, ...] | list[int], lo: int, hi: int) -> list[int]:
    """The parameter segments (lengths) of the element range [lo, hi) of a row laid out by ``numels``;
    a range past the row's end is one trailing padding segment."""
    out, pos = [], 0
    for n in numels:
        a, b = max(lo, pos), min(hi, pos + n)
        if b > a:
            out.append(b - a)
        pos += n
    if hi > max(lo, pos):
        out.append(hi - max(lo, pos))
    return out


def _graph_task() -> int:
    """The id of the autograd graph task (one backward) running this call; -1 outside backward."""
    current = getattr(torch._C, "_current_graph_task_id", None)
    return -1 if current is None else int(current())


def _copy(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.detach().clone()
    if isinstance(value, dict):
        return {k: _copy(v) for k, v in value.items()}
    return value


class Journal:
    """The state changes of one backward, kept so that they can be undone (``check_finite=True``).

    FSDP2 reduces module after module in one backward; with ``check_finite=True`` a NaN found in a
    later module's gradients raises ``NonFiniteError`` after the modules reduced before it have
    updated their residuals. The step is then skipped, so it must leave every residual (and step
    counter, and warm start) as it was before that backward: :meth:`keep` records an entry's value
    the first time a call of the backward is about to change it, :meth:`undo` puts every recorded
    value back. A call of another backward (another autograd graph task), or any call outside
    backward, starts a new journal: the previous backward's changes stay (they are committed).
    """

    def __init__(self) -> None:
        self._task: int | None = None
        self._undo: dict[tuple, Callable[[], None]] = {}

    def begin(self) -> None:
        """Start a call: continue this backward's journal, or commit it and start a new one."""
        task = _graph_task()
        if task < 0 or task != self._task:
            self._undo = {}
        self._task = task

    def keep(self, mapping: dict, key: Any) -> None:
        """Record ``mapping[key]`` (a tensor, a dict of tensors, a number; or its absence)."""
        ident = ("entry", id(mapping), key)
        if ident in self._undo:
            return
        had = key in mapping
        value = _copy(mapping[key]) if had else None

        def restore() -> None:
            if had:
                mapping[key] = value
            else:
                mapping.pop(key, None)

        self._undo[ident] = restore

    def keep_state(self, obj: Any) -> None:
        """Record an object with ``state_dict()`` / ``load_state_dict()`` (a compressor's state)."""
        ident = ("state", id(obj))
        if ident not in self._undo:
            saved = obj.state_dict()
            self._undo[ident] = lambda: obj.load_state_dict(saved)

    def undo(self) -> None:
        """Put back everything recorded since the backward began, newest first."""
        for restore in reversed(list(self._undo.values())):
            restore()
        self._undo = {}


# --------------------------------------------------------------------------------- base
@dataclass
class _Site:
    """What a comm knows about one process group FSDP calls it with."""

    kind: str  # "full" (the topology's group), "node" (inside one node), "other"
    ranks: tuple[int, ...]


class CommBase:
    """Topology, groups and bookkeeping shared by the reduce-scatter, all-gather and all-reduce comms.

    A comm object is both usable directly (``module.set_custom_reduce_scatter(comm)``) and through
    :func:`register`, which binds one view of it to every FSDP module (:meth:`bind`), so that
    residuals are keyed by parameter name and quantization blocks follow parameter boundaries.
    """

    where = "fsdp"
    finite_check = False  # check_finite=True (the reduce-scatter and HSDP comms): journal each backward

    def __init__(self, topology: Topology | None, timeout: float | None):
        if topology is not None and not isinstance(topology, Topology):
            raise TypeError(f"{self.where}: topology must be a commopt.comm.Topology or None (detected), got "
                            f"{type(topology).__name__} {topology!r}; e.g. Topology.from_spec('2x2') once the "
                            f"process group exists")
        if timeout is not None and (isinstance(timeout, bool) or not isinstance(timeout, (int, float))
                                    or not timeout > 0):
            raise ValueError(f"{self.where}: timeout must be a positive number of seconds or None, got {timeout!r}")
        self.topology = topology
        self.timeout = None if timeout is None or math.isinf(timeout) else float(timeout)
        self.feedback = ErrorFeedback()  # residuals per parameter name, step counters per module
        self.journal = Journal()
        self._sites: dict[int, _Site] = {}
        self._flat_topo: Topology | None = None
        self._link_bytes = 0.0
        self._link_cache: dict[tuple, float] = {}

    # ----------------------------------------------------------------------------- topology
    def resolve(self) -> Topology:
        """The topology (over WORLD), detected once when none was given."""
        if self.topology is None:
            self.topology = context().topology(None, None, self.timeout)
        topo = self.topology
        if topo.group is not None and dist.get_world_size(topo.group) != dist.get_world_size():
            raise TopologyError(f"{self.where}: the topology describes a subgroup of {topo.world_size} ranks; "
                                f"FSDP comms need the topology of every rank (build it over WORLD)", op=self.where)
        return topo

    def flat_topology(self) -> Topology:
        """All ranks as one node: the layout whose derived groups carry one-level exchanges."""
        if self._flat_topo is None:
            self._flat_topo = Topology.from_nodes([list(range(dist.get_world_size()))])
        return self._flat_topo

    def site(self, group) -> _Site:
        """Classify ``group`` against the topology: the whole topology, inside one node, or other."""
        s = self._sites.get(id(group))
        if s is None:
            topo = self.resolve()
            ranks = tuple(dist.get_process_group_ranks(group))
            world = tuple(topo.group_rank_to_global(r) for r in range(topo.world_size))
            node_of = {topo.group_rank_to_global(r): i for i, node in enumerate(topo.nodes) for r in node}
            if ranks == world:
                kind = "full"
            elif len({node_of.get(r, -1) for r in ranks}) == 1 and ranks[0] in node_of:
                kind = "node"
            else:
                kind = "other"
            s = self._sites[id(group)] = _Site(kind, ranks)
        return s

    def groups(self, role: str, topo: Topology | None = None):
        return context().groups(topo or self.resolve(), role, self.timeout)

    # ----------------------------------------------------------------------------- protocol
    def allocate(self, size, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """FSDP2's ``Comm.allocate``: a plain buffer."""
        return torch.empty(*size, dtype=dtype, device=device)

    # ----------------------------------------------------------------------------- bookkeeping
    def add_link_bytes(self, key: tuple, compute) -> None:
        """Add the busiest node link's bytes of one call (``compute()`` -> Traffic, cached by ``key``)."""
        v = self._link_cache.get(key)
        if v is None:
            v = self._link_cache[key] = float(compute().link_bytes())
        self._link_bytes += v

    def link_bytes(self) -> float:
        """Bytes the busiest node link carried (one direction) in this comm's calls so far, from the
        algorithms' ``traffic()`` of what each call ran (the same on every rank)."""
        return self._link_bytes

    def reset_link_bytes(self) -> None:
        self._link_bytes = 0.0

    def run(self, phases: list[Phase], op: str, device: torch.device, deadline: float | None) -> None:
        """Run phases through the comm engine (their bytes counted under ``op``) and wait, until the
        call's ``deadline`` at most (the phases themselves wait for what is left of it)."""
        wait(self.submit(phases, op, device, blocking=True), self.timeout, op=op, deadline=deadline)

    def submit(self, phases: list[Phase], op: str, device: torch.device, *, blocking: bool) -> torch.futures.Future:
        """Queue phases on the comm engine (bytes counted under ``op``); a Future of their end."""
        return context().engine().submit(phases, op=op, device=device, blocking=blocking)

    def check_finite(self, x: torch.Tensor, what: str, deadline: float | None) -> None:
        """``check_finite=True``: agree on every rank whether any rank's input holds NaN/Inf (one small
        all-gather over WORLD on a group of its own) and raise ``NonFiniteError`` on every rank if so,
        after undoing what this backward's earlier calls changed (:class:`Journal`)."""
        self.journal.begin()
        bad = torch.tensor([0 if all_finite(x) else 1], dtype=torch.int64)
        g = self.groups(FSDP_CHECK, self.flat_topology()).intra
        flags = torch.zeros(dist.get_world_size(), dtype=torch.int64)

        def gather() -> int:
            wait_work(all_gather_single(flags, bad, group=g, async_op=True), self.timeout,
                      deadline=deadline)
            return 8 * (dist.get_world_size() - 1)

        self.run([Phase("check_finite", gather, g)], f"fsdp/{what}/check", x.device, deadline)
        ranks = [r for r, f in enumerate(flags.tolist()) if f]
        if ranks:
            self.journal.undo()
            raise NonFiniteError(f"{what}: ranks {ranks} hold NaN/Inf in their gradients (check_finite=True); "
                                 f"no residual, step counter or warm start was changed by this backward (what "
                                 f"the modules reduced before this one changed was undone); skip the step: call "
                                 f"reset_iter_state() on the root FSDP module (FSDP2's recovery after a backward "
                                 f"raised), zero the gradients (e.g. lower the loss scale) and go on",
                                 op=f"fsdp/{what}", ranks=ranks)

    def keep(self, key: str) -> None:
        """Before a call of ``check_finite=True`` changes module ``key``'s residuals and step counter:
        record them in this backward's journal."""
        if self.finite_check:
            for mapping in (self.feedback.buffers, self.feedback.steps, self.feedback.layouts):
                self.journal.keep(mapping, key)


@dataclass
class Bound:
    """One comm bound to one FSDP module by :func:`register` (its layout and parameter group)."""

    layout: Layout
    param_group: object = field(default=None, repr=False)
    _reduced: dict = field(default_factory=dict, repr=False, compare=False)

    def reduced(self) -> Layout:
        """The layout of what FSDP2 reduces for this module now: its parameters that require
        gradients, in order. FSDP2 leaves ``requires_grad=False`` parameters out of the
        reduce-scatter (and so of the HSDP hook's shard); trainable ones without a gradient are in it,
        as zeros, once :func:`register` has turned ``set_reduce_scatter_unused_params`` on. The
        all-gather carries every parameter (:attr:`layout`)."""
        fsdp_params = getattr(self.param_group, "fsdp_params", None)
        if fsdp_params is None or len(fsdp_params) != len(self.layout.names):
            return self.layout
        mask = tuple(bool(fp.sharded_param.requires_grad) for fp in fsdp_params)
        if all(mask):
            return self.layout
        out = self._reduced.get(mask)
        if out is None:
            def pick(values: tuple) -> tuple:
                return tuple(v for v, m in zip(values, mask) if m)

            lay = self.layout
            out = self._reduced[mask] = Layout(lay.key, pick(lay.names), pick(lay.numels),
                                               pick(lay.shapes) if lay.shapes else ())
        return out


# --------------------------------------------------------------------------------- reduce-scatter / all-gather
class CollectiveComm(CommBase):
    """What the reduce-scatter and all-gather comms share: the exact algorithm (``auto``, ``flat``,
    ``hierarchical``), the optional ``QuantizeCompressor`` (the block codec), and the start of an
    exact call over the whole topology through the algorithm objects.

    Subclasses set ``collective`` (``"reduce_scatter"``, ``"all_gather"``) and ``role`` (its name in
    errors).
    """

    collective = ""
    role = ""

    def __init__(self, topology: Topology | None, algorithm: str, compressor: Compressor | None,
                 timeout: float | None):
        super().__init__(topology, timeout)
        # With a compressor, only the algorithms that can carry one (its flat or two-level exchange);
        # without, torch's own collective too (NATIVE).
        known = [algorithms.AUTO, *algorithms.names(self.collective, codec=compressor is not None)]
        known += [] if compressor is not None else [NATIVE]
        if not isinstance(algorithm, str) or algorithm not in known:
            raise ValueError(f"{self.where}: algorithm {algorithm!r} is not supported; use one of {known}"
                             + (f" ({NATIVE!r} is exact: compressor=None)" if algorithm == NATIVE else ""))
        self.algorithm = algorithm
        self.compressor = self._check_compressor(compressor)

    def _check_compressor(self, compressor) -> QuantizeCompressor | None:
        if compressor is None or isinstance(compressor, QuantizeCompressor):
            return compressor
        if isinstance(compressor, Compressor):
            hint = ("for a bf16/fp16 reduction use MixedPrecisionPolicy(reduce_dtype=...) instead"
                    if compressor.cast_dtype is not None else
                    "its payloads cannot be reduce-scattered or gathered block by block (PowerSGD needs whole "
                    "matrices and two all-reduces, top-k/sign payloads are not split by destination); use it "
                    "across nodes in HSDP with AllReduceHook")
            raise TypeError(f"{self.where}: {type(compressor).__name__} cannot serve a {self.role}: {hint}; pass "
                            f"compressor=QuantizeCompressor(bits=8 or 4) or None")
        raise TypeError(f"{self.where}: compressor must be None or a commopt.comm.compression.QuantizeCompressor, "
                        f"got {type(compressor).__name__} {compressor!r}")

    def choose(self, nbytes: int) -> str:
        """The exact algorithm of a call over the whole topology (``auto``: the cost model's pick)."""
        if self.algorithm == "flat":
            return "flat"
        return select_algorithm(self.collective, self.algorithm, nbytes, self.resolve(), self.timeout)

    def two_level(self, topo: Topology | None = None) -> bool:
        """Whether calls over the whole topology run two levels (not ``flat`` or ``native``, and the
        hierarchy applies)."""
        return self.algorithm not in ("flat", NATIVE) and (topo or self.resolve()).two_levels

    def native(self, work, out: torch.Tensor, group, kind: str, nbytes: int,
               deadline: float | None) -> torch.futures.Future:
        """The future of torch's own collective ``work`` (``algorithm="native"``), issued by the caller
        on its thread with FSDP2's own arguments, as FSDP2's default comm issues it: the same
        collective, the same bits, written into ``out``. It fails with commopt's ``CommTimeoutError``
        once the call's ``deadline`` passes (the engine's watchdog: the backend's own wait is bounded
        only by the group's timeout, 30 minutes by default, which hpZ's node groups get whatever
        WORLD's is) and with ``CommError`` naming the op when the backend fails (a peer died), never
        with the backend's bare ``RuntimeError``. Counts the bytes of a ring ``kind`` over the
        group's whole buffer of ``nbytes`` (gloo's reduce-scatter is an all-reduce): this rank's, and
        for a call over the whole topology the node links'."""
        op = f"fsdp/{self.collective}/native"
        engine = context().engine()
        engine.count(op, int(ALGORITHM_FACTORS[kind](group.size()) * nbytes))
        if self.site(group).kind == "full":
            topo = self.resolve()
            self.add_link_bytes(("native", kind, nbytes), lambda: algorithms.get("flat").traffic(kind, nbytes, topo))
        # Nothing to finish: the collective wrote ``out`` itself (no scale, no copy back).
        return flat_future(engine, work, Prepared(out, out, out, None, False), op, remaining(deadline), group)

    def start(self, prepared, red, src: torch.Tensor, group, nbytes: int, itemsize: int, tag: str,
              blocking: bool, deadline: float | None) -> torch.futures.Future:
        """Start the exact collective over the whole topology on the algorithm ``choose`` picks for
        the world-sized buffer of ``nbytes``, and count its node-link bytes under ``tag``; its phases
        share what is left of the call's ``deadline``."""
        topo, ctx = self.resolve(), context()
        algo = self.choose(nbytes)
        if algo != "flat":
            ctx.prepare(topo, (algo,), self.timeout)
        impl = algorithms.get(algo)
        call = ctx.call(impl, self.collective, prepared, red, group, topo if algo != "flat" else None,
                        remaining(deadline), blocking, 1, src)
        self.add_link_bytes((tag, algo, nbytes, itemsize),
                            lambda: impl.traffic(self.collective, nbytes, topo, itemsize=itemsize))
        return impl.start(call)


class BoundComm:
    """A comm bound to one FSDP module (set by :func:`register`): the comm and the module's layout;
    the subclasses' ``__call__`` passes both on."""

    def __init__(self, comm: CommBase, bound: Bound):
        self.comm, self.bound = comm, bound

    def allocate(self, size, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return self.comm.allocate(size, dtype=dtype, device=device)

    def __repr__(self) -> str:
        return f"{self.comm!r} bound to {self.bound.layout.key or '<root>'!r}"
