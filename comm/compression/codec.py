"""The codec API: what a compressor declares, the state a run mutates, and its exchange rounds.

A compressor turns this rank's contribution ``x`` (a flat floating vector, the gradient plus the
error-feedback residual) into the SUM over a process group of what every rank transmitted. Every
trait a caller branches on is declared on :class:`Codec` with its default, and read as an
attribute (never with ``getattr``); GRACE's compressor/memory split (docs/architecture.md section 5.3):

- ``summable`` (True): its payload can be summed by an all-reduce (casts, random-k with shared
  indices, PowerSGD's factors); otherwise it is exchanged another way (all-gather, all-to-all);
- ``biased`` (False): E[decode(encode(x))] != x, so it needs error feedback to converge (top-k,
  signs, PowerSGD); unbiased ones (random-k scaled by d/k, stochastic quantization) skip it;
- ``needs_matrices`` (False): it compresses whole tensors (PowerSGD), so a topology-aware exchange
  must not cut tensors (the tensor-aligned intra-node partition of ``layout.py``);
- ``rounds`` (``("all_reduce",)``): the names of the collectives it issues per exchange, in order,
  each on a process group of its own role (the comm engine refuses a queue fed by two different
  predecessors, docs/architecture.md section 3);
- ``uses_server_residual`` (False): a round re-compresses an aggregated chunk and keeps that error
  in ``Exchange.server`` (the 1-bit all-reduce's server error feedback);
- ``chunked`` (False): the rounds cut ``x`` into n equal chunks (all-to-all), so ``x`` is padded to
  n * ``align``; ``align`` (16): the element alignment of every tensor in the staged vector;
  ``min_numel`` (0): shorter vectors are reduced exactly;
- ``layout_free`` (False): element-wise with no per-tensor state, so the DDP hook hands it the
  bucket's flat buffer as one tensor;
- ``cast_dtype`` (None): a plain cast, whose payload is the input in this floating dtype (the
  fp16/bf16 casts); a consumer that has a cast of its own (FSDP2's ``reduce_dtype``) says so;
- ``optimistic`` (False): every collective result of its rounds is identical on every rank of the
  group (the all-reduced fp16/bf16 cast, PowerSGD's all-reduced P and Q), so whether that result is
  non-finite is a value every rank already agrees on (docs/architecture.md section 3, rule 2): the exchange then runs no
  agreed check before reducing, and a round that finds its reduced result non-finite sets
  returns ``Result(nonfinite=True)``; the reduction redoes it exactly (fp32) from the kept input.
  With no check to compare the ranks' inputs either, the first round appends ``Exchange.tag``
  (``TAG_LEN`` values) to its all-reduced payload and calls ``check_tag`` on the result.

A compressor holds settings only. What a run mutates (the step counter of standalone calls,
PowerSGD's Q memory) lives in a :class:`CompressorState` (``compressor.new_state()``), so one
compressor can serve two models: each hook state (``hooks.AllReduceState``) holds its own, and
``compressor.all_reduce`` without ``state=`` uses the compressor's default state. The error-feedback
memory is a separate object (``feedback.ErrorFeedback``), keyed by parameter, never by bucket.

``exchange(ex)`` is the codec's whole exchange, read top to bottom: a generator that, for each of
its ``rounds``, computes locally, issues one blocking collective on ``ex.groups[i]`` and yields the
bytes it sent, then returns the :class:`Result`. The reduction runs each round as an engine phase
on the worker of that round's group (the generator resumes there: the rounds never run at once),
so what one round leaves for the next is a local variable, and the reduction learns what the codec
did from the returned :class:`Result` only (an :class:`Exchange` in, a :class:`Result` out).

A :class:`Codec` has no reduction of its own: the compressed reduction (``exchange.py``) drives it,
and :class:`~commopt.comm.compression.base.Compressor` adds the standalone ``all_reduce``, a thin
caller of that reduction. This module imports nothing of the reduction, so every part of it (the
agreement, the layout, ``auto``, the exchange) depends on the codec and never the other way round.
"""

from __future__ import annotations

import hashlib
import warnings
from collections.abc import Generator
from dataclasses import dataclass
from typing import ClassVar, Protocol

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

from ..errors import CollectiveMismatchError

__all__ = ["Codec", "CompressorState", "Exchange", "Result", "Rounds", "derive_seed", "all_gather_single",
           "compute_dtype", "as_bytes", "all_finite", "TAG_LEN", "tag_of", "check_tag"]

# torch 2.13 renamed the tensor variant; older releases (>= 2.3) have only the old name.
all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def derive_seed(seed: int, *parts: int | str) -> int:
    """A 63-bit seed from ``seed`` and any ints/strings: the same on every rank for the same parts.

    Randomness that must agree across ranks (random-k indices, PowerSGD's initial Q) is drawn from a
    ``torch.Generator`` seeded with this, never from the global RNG, and is a pure function of
    (seed, step, parameter key): nothing to checkpoint, and the draw order does not matter.
    """
    h = hashlib.blake2b(digest_size=8)
    h.update(str(int(seed)).encode())
    for p in parts:
        h.update(b"\x1f" + str(p).encode())
    return int.from_bytes(h.digest(), "little") >> 1


#: Elements of the tag an optimistic round appends to its first all-reduced payload (see ``Exchange.tag``).
TAG_LEN = 64


def tag_of(signature: int) -> torch.Tensor:
    """The tag of a 32-bit ``signature``: each bit and its complement, as 0/1 values (float64).

    Summed over the ranks, a position where this rank holds 0 stays exactly 0 (in any floating
    dtype, with any number of ranks) only if every rank holds 0 there: every bit agrees.
    """
    bits = [(signature >> k) & 1 for k in range(TAG_LEN // 2)]
    return torch.tensor(bits + [1 - b for b in bits], dtype=torch.float64)


def check_tag(ex: Exchange, reduced: torch.Tensor, op: str) -> None:
    """Raise ``CollectiveMismatchError`` when the reduced tag shows that the ranks' signatures differ.

    Every rank of the group sees it: two ranks that differ in a bit both hold a 1 at one of its two
    positions, which is a 0 on every rank that agrees with either of them.
    """
    if ex.tag is None:
        return
    zero = (ex.tag == 0).to(reduced.device)
    if bool((reduced.ne(0) & zero).any()):
        raise CollectiveMismatchError(
            f"the ranks of this compressed exchange (a group of {ex.n}) hold different tensors, dtypes, "
            f"compressor settings or steps (this rank: {ex.what}); pass tensors of the same shapes and "
            f"dtype, and the same compressor settings and step, on every rank (AllReduceState(validate=True) "
            f"names the ranks that differ)", op=op)


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """fp64 stays fp64 (exact error-feedback accounting); everything else is computed in fp32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def all_finite(t: torch.Tensor) -> bool:
    """Whether every element of ``t`` is finite; exact, and a single cheap reduction in the usual case.

    A sum is finite when every element is (NaN and Inf always propagate through a sum); a non-finite
    sum of finite elements (an overflow of the accumulator) is confirmed element-wise. So ranks that
    hold identical tensors always agree, whatever their thread counts.
    """
    if t.numel() == 0:
        return True
    acc = t.dtype if t.dtype in (torch.float32, torch.float64) else torch.float32
    if bool(torch.isfinite(t.sum(dtype=acc))):
        return True
    return bool(torch.isfinite(t).all())


def as_bytes(*tensors: torch.Tensor) -> torch.Tensor:
    """Concatenate the raw bytes of contiguous tensors into one uint8 payload (one collective)."""
    return torch.cat([t.contiguous().view(-1).view(torch.uint8) for t in tensors])


class Transport(Protocol):
    """How an algorithm routes a codec's rounds over a round's group (``Synth.codec_transport``): in
    place, ``all_reduce``: ``buf`` = the SUM over ``group``; ``all_gather``: ``out`` = every member's
    ``payload`` (equal sizes) in group-rank order; every member ends with the same values, waits at
    most ``timeout`` seconds and gets the bytes it sent."""

    def all_reduce(self, buf: torch.Tensor, group: ProcessGroup, timeout: float | None) -> int: ...

    def all_gather(self, out: torch.Tensor, payload: torch.Tensor, group: ProcessGroup,
                   timeout: float | None) -> int: ...


@dataclass(frozen=True)
class Exchange:
    """What a codec's :meth:`Codec.exchange` reads: one exchange of one flat vector, decided by the
    compressed reduction (``exchange.py``) before the first round; the codec never changes it.

    Attributes:
        x: this rank's contribution, 1-D, fp32 or fp64 (the gradient plus the residual).
        out: a buffer of x's length and dtype the codec may write the SUM into.
        sent: receives what this rank's payload decodes to (error feedback), or None; a codec that
            computes the residual itself, fused with decoding, writes it there instead and says so
            (``Result.residual``).
        groups: the process group of each round, in order (``len(codec.rounds)`` of them; the same
            members, another role: two exchanges in flight never share a queue between two rounds,
            docs/architecture.md section 3, rule 1).
        n: the groups' size; rank: this rank's index in them.
        step: the training step (seeds rounding and sampling).
        seed: the seed shared by all ranks.
        salt: identifies the vector (a hash of its parameter keys), so buckets draw differently.
        tensors: (key, offset into x, shape) of the whole tensors held by x (PowerSGD's matrices).
        server: the server-side residual of the chunk this rank aggregates (``uses_server_residual``),
            updated in place, or None.
        timeout: seconds a collective may take.
        scale_hint: an upper bound on every |partial sum| / total_ranks agreed across ranks (casts).
        total_ranks: ranks contributing to the final sum (the world size, also in hierarchical mode).
        dest: with ``tensors``, where each tensor's final result goes (same order), or None; a codec
            may write ``SUM * dest_scale`` there itself once nothing can fall back any more
            (``Result.written``).
        tag: optimistic codecs only (they run no agreed check first): ``TAG_LEN`` values (``tag_of``
            of the signature of the tensors, dtype, settings and step) that the first round appends
            to its all-reduced payload and checks with ``check_tag`` right after, so that ranks
            holding different tensors raise ``CollectiveMismatchError`` instead of returning wrong
            values. None: no tag (the reduction's check phase compared them).
        what: this rank's tensors in words, for that error.
        state: the per-run state of the codec (PowerSGD's Q memory), or None (no memory).
        transport: what an algorithm routes the rounds through (``synth``'s rail schedules), or None:
            the groups' own collectives. Codecs never read it: they call ``exchange.round_all_reduce``
            / ``round_all_gather``.
    """

    x: torch.Tensor
    out: torch.Tensor
    sent: torch.Tensor | None
    groups: tuple[ProcessGroup | None, ...]
    n: int
    rank: int
    step: int = 0
    seed: int = 0
    salt: int = 0
    tensors: tuple[tuple[str, int, tuple[int, ...]], ...] = ()
    server: torch.Tensor | None = None
    timeout: float | None = None
    scale_hint: float = 0.0
    total_ranks: int = 1
    dest: tuple[torch.Tensor, ...] | None = None
    dest_scale: float = 1.0
    tag: torch.Tensor | None = None
    what: str = ""
    state: CompressorState | None = None
    transport: Transport | None = None


@dataclass(frozen=True)
class Result:
    """What an exchange returns: the SUM over the group of what every rank transmitted.

    Attributes:
        out: the SUM divided by ``scale``'s inverse: ``SUM = out * scale`` (a codec may return its
            reduced wire tensor, in another floating dtype, and leave the decoding scale to the
            reduction, which folds it with the averaging into one pass while writing the result).
        scale: see ``out``.
        residual: ``Exchange.sent`` holds the residual (x minus what was sent), not what was sent.
        written: the codec wrote the result into ``Exchange.dest`` itself.
        nonfinite: optimistic codecs: the reduced result (identical on every rank of the group)
            holds NaN/Inf, ``out`` is not meaningful and the reduction reduces x exactly instead.
    """

    out: torch.Tensor | None
    scale: float = 1.0
    residual: bool = False
    written: bool = False
    nonfinite: bool = False


#: The generator :meth:`Codec.exchange` returns: it yields the bytes each round sent and returns
#: the :class:`Result`.
Rounds = Generator[int, None, Result]


class CompressorState:
    """What a run of a compressor mutates, kept apart from its settings (docs/architecture.md section 5.3).

    One compressor configuration can serve several models: each hook state
    (``hooks.AllReduceState``) holds a state of its own, made by ``compressor.new_state()``, and
    ``Compressor.all_reduce`` without ``state=`` uses the compressor's default state. A state holds
    the settings it was made for as plain data (``config``), not the compressor: no reference cycle
    between the two, and a checkpoint of it names the settings it needs.

    Attributes:
        config: ``compressor.config()`` of the compressor it was made by.
        calls: standalone ``all_reduce`` calls completed (the step of a call with ``step=None``).
    """

    def __init__(self, compressor: Codec) -> None:
        self.config: dict = dict(compressor.config())
        self.calls = 0

    def state_dict(self) -> dict:
        """``{"config", "calls", ...}``: plain tensors and numbers (``torch.load(weights_only=True)``
        accepts it); the format ``Compressor.state_dict()`` has always had."""
        return {"config": dict(self.config), "calls": self.calls}

    def load_state_dict(self, state: dict) -> None:
        """Restore :meth:`state_dict`.

        Raises:
            ValueError: the checkpoint was taken with other compressor settings.
        """
        if state.get("config") != self.config:
            raise ValueError(f"checkpoint was taken with compressor {state.get('config')} but this one is "
                             f"{self.config}; build the compressor with the same settings")
        self.calls = int(state.get("calls", 0))


class Codec:
    """Base class of every compressor: the declared traits, the rounds, the per-run state and
    checkpointing; no reduction of its own (``Compressor`` adds the standalone ``all_reduce``).

    Subclasses set the class attributes (or override them with properties) and implement
    :meth:`exchange`; one with per-run memory sets :attr:`State` to a :class:`CompressorState`
    subclass. Every trait below is what a caller may branch on (see the module docstring).
    """

    name: str = "compressor"
    #: Payloads can be summed by an all-reduce (else all-gathered or exchanged all-to-all).
    summable: bool = True
    #: Needs error feedback to converge (E[decode(encode(x))] != x).
    biased: bool = False
    #: Compresses whole tensors: a hierarchical exchange partitions tensors, never cuts them.
    needs_matrices: bool = False
    #: The names of the collectives of one exchange, in order, each on a process group of its own role.
    rounds: tuple[str, ...] = ("all_reduce",)
    #: A round re-compresses an aggregated chunk and keeps that error in ``Exchange.server``.
    uses_server_residual: bool = False
    #: Element alignment of every tensor in the staged vector (the block of per-block scales, so
    #: that no block straddles two tensors and an all-zero tensor decodes to zeros).
    align: int = 16
    #: The exchange cuts x into n equal chunks (all-to-all), so x is padded to n * align.
    chunked: bool = False
    #: Vectors shorter than this are reduced exactly: compressing them saves less than it costs.
    min_numel: int = 0
    #: Reduce first, no agreed check (see the module docstring); the exchange returns
    #: ``Result(nonfinite=True)`` from its (rank-identical) reduced results and needs no ``scale_hint``.
    optimistic: bool = False
    #: Element-wise with no per-tensor state (no residuals, seeds or block scales): the DDP hook
    #: hands such a compressor the bucket's flat buffer as one tensor, which is then not staged.
    layout_free: bool = False
    #: A plain cast: the payload is the input in this floating dtype (fp16/bf16), else None.
    cast_dtype: torch.dtype | None = None
    #: The class of this compressor's per-run state (``new_state()``).
    State: ClassVar[type[CompressorState]] = CompressorState

    def __init__(self) -> None:
        # Whether the biased-without-error-feedback warning was given: a diagnostic, not run state.
        self._warned = False
        # Made on first use, once the subclass's settings (its config()) exist.
        self._default_state: CompressorState | None = None

    # ------------------------------------------------------------------------------- exchange
    def active(self, step: int) -> bool:
        """Whether this step compresses (decided from the step alone: identical on all ranks)."""
        return True

    def worth(self, numel: int, shapes: list[tuple[int, ...]]) -> bool:
        """Whether a vector of ``numel`` elements holding ``shapes`` is worth compressing.

        Decided from shapes only (docs/architecture.md section 3, rule 2), so every rank decides the same.
        """
        return numel >= max(1, self.min_numel)

    def exchange(self, ex: Exchange) -> Rounds:
        """The exchange of ``ex.x`` over ``ex.groups``: a generator that yields the bytes each of
        :attr:`rounds` sent (one blocking collective each, on ``ex.groups[i]``) and returns the
        :class:`Result` (see the module docstring)."""
        raise NotImplementedError(f"{type(self).__name__} must implement exchange()")
        yield 0  # a generator

    def roundtrip(self, x: torch.Tensor, *, step: int = 0, seed: int = 0, salt: int = 0) -> torch.Tensor:
        """What this rank's payload of ``x`` decodes to, without communicating (tests, analysis)."""
        raise NotImplementedError(f"{type(self).__name__} has no local round trip")

    def payload_bytes(self, numel: int, n: int) -> int:
        """Bytes one rank sends to exchange ``numel`` fp32 elements over ``n`` ranks (estimate)."""
        raise NotImplementedError(f"{type(self).__name__} must say payload_bytes(): algorithm='auto' and the "
                                  f"benchmarks predict from it (docs/architecture.md section 8); or pass "
                                  f"algorithm='flat' or 'hierarchical'")

    def exchange_bytes(self, numel: int, shapes: list[tuple[int, ...]], n: int) -> int:
        """Bytes one rank sends to exchange a staged vector of ``numel`` elements holding whole
        tensors of ``shapes`` over ``n`` ranks: :meth:`payload_bytes` of ``numel`` for element-wise
        compressors; matrix compressors count the shapes (the cost model of ``algorithm="auto"``)."""
        return self.payload_bytes(numel, n)

    # ------------------------------------------------------------------------------- state
    def new_state(self) -> CompressorState:
        """A fresh per-run state for these settings (one per model or hook state)."""
        return self.State(self)

    @property
    def default_state(self) -> CompressorState:
        """The state of standalone calls (``all_reduce`` and ``reduce_tensors`` without ``state=``)."""
        if self._default_state is None:
            self._default_state = self.new_state()
        return self._default_state

    def check_state(self, state: CompressorState | None, where: str) -> CompressorState:
        """``state`` (None: the default state), checked to be a state of these settings."""
        if state is None:
            return self.default_state
        if not isinstance(state, self.State):
            raise TypeError(f"{where}: state must be a {self.State.__name__} (compressor.new_state()) or None, "
                            f"got {type(state).__name__}")
        if state.config != self.config():
            raise ValueError(f"{where}: the state was made for compressor {state.config} but this one is "
                             f"{self.config()}; use compressor.new_state() of this compressor")
        return state

    def warn_biased(self) -> None:
        """Warn once per compressor that it is biased and used without error feedback."""
        if not self._warned:
            self._warned = True
            warnings.warn(f"{type(self).__name__} is a biased compressor used without error feedback: "
                          f"training may stall or diverge; pass an ErrorFeedback (or "
                          f"AllReduceState(error_feedback=True))", stacklevel=3)

    # ------------------------------------------------------------------------------- checkpoints
    def config(self) -> dict:
        """The settings that must match for a checkpoint to load."""
        return {"name": self.name}

    def state_dict(self) -> dict:
        """The default state's :meth:`CompressorState.state_dict` (standalone use)."""
        return self.default_state.state_dict()

    def load_state_dict(self, state: dict) -> None:
        """Restore :meth:`state_dict` into the default state (``ValueError`` for other settings)."""
        self.default_state.load_state_dict(state)

    def __setstate__(self, d: dict) -> None:
        # A compressor pickled before the per-run state moved out of it held its call counter
        # itself: it becomes the default state's (subclasses move their own memory likewise).
        calls = d.pop("_calls", None)
        self.__dict__.update(d)
        self.__dict__.setdefault("_default_state", None)
        self.__dict__.setdefault("_warned", False)
        if calls is not None:
            self.default_state.calls = int(calls)

    def __repr__(self) -> str:
        args = ", ".join(f"{k}={v!r}" for k, v in self.config().items() if k != "name")
        return f"{type(self).__name__}({args})"

