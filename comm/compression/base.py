"""The compressor class users build: a codec (``codec.py``) with the standalone ``all_reduce``.

Every compressor (``FP16Compressor``, ``PowerSGDCompressor``, ``QuantizeCompressor``, ...) is a
:class:`Compressor`. What it declares and how it encodes lives in :class:`~.codec.Codec` (see
``codec.py`` for the traits); ``Compressor.all_reduce`` is a thin caller of the one compressed
reduction (``exchange.compressed_all_reduce``), the same one ``commopt.comm.all_reduce(t,
compressor=...)``, the DDP hook and ``OverlapDataParallel`` run. The names of ``codec.py`` are
re-exported here, where they have always been importable from, and so are the two calls a codec
issues its summing all-reduces and its all-gathers through (``round_all_reduce``,
``round_all_gather``): the group's own collective, or the algorithm's route where it has one
(``synth``: the rail's synthesized schedules).
"""

from __future__ import annotations

import torch
from torch.distributed import ProcessGroup, ReduceOp

from ..algorithms._transport import all_gather_single
from ..topology import Topology
from .codec import (
    TAG_LEN,
    Codec,
    CompressorState,
    Exchange,
    Result,
    Rounds,
    all_finite,
    as_bytes,
    check_tag,
    compute_dtype,
    derive_seed,
    tag_of,
)
from .exchange import compressed_all_reduce, round_all_gather, round_all_reduce, routed
from .feedback import ErrorFeedback

__all__ = ["Compressor", "Codec", "CompressorState", "Exchange", "Result", "Rounds", "derive_seed", "all_gather_single",
           "compute_dtype", "as_bytes", "all_finite", "TAG_LEN", "tag_of", "check_tag", "round_all_reduce",
           "round_all_gather", "routed"]


class Compressor(Codec):
    """Base class of the compressors: a :class:`~.codec.Codec` (traits, rounds, per-run state,
    checkpointing) that can also reduce one tensor on its own (:meth:`all_reduce`).

    Subclasses set the class attributes (or override them with properties) and implement
    :meth:`~.codec.Codec.exchange`; one with per-run memory sets :attr:`State` to a :class:`CompressorState`
    subclass. Every trait is what a caller may branch on (see ``codec.py``).
    """

    def all_reduce(self, tensor: torch.Tensor, op: ReduceOp = ReduceOp.SUM, *, group: ProcessGroup | None = None,
                   topology: Topology | None = None, algorithm: str = "flat", async_op: bool = False,
                   error_feedback: ErrorFeedback | None = None, key: str = "tensor", step: int | None = None,
                   seed: int = 0, check_finite: bool = False, timeout: float | None = None,
                   state: CompressorState | None = None) -> torch.Tensor | torch.futures.Future:
        """Reduce ``tensor`` in place over ``group`` through this compressor.

        Integer and bool tensors pass through uncompressed (exact reduction, bit-exact SUM). A
        non-finite value on any rank makes the call an exact all-reduce (NaN propagates) and leaves
        ``error_feedback`` untouched, or raises ``NonFiniteError`` on every rank with
        ``check_finite=True``.

        Args:
            tensor: a dense ``torch.Tensor`` of any shape, contiguous or not (reduced through a copy,
                written back), the same shape and dtype on every rank.
            op: ``ReduceOp.SUM`` or ``ReduceOp.AVG``.
            group: the process group (None: WORLD).
            topology: its layout, built over ``group`` (None: detected when ``algorithm`` needs it).
            algorithm: ``"flat"``, ``"hierarchical"`` (compress the inter-node phase only) or ``"auto"``
                (the one the cost model predicts faster for this compressor and shape: ``auto.choose``).
            async_op: return a Future of ``tensor``.
            error_feedback: an ``ErrorFeedback`` whose residual for ``key`` is added before
                compressing and updated after (biased compressors only); None: no memory.
            key: the stable key of this tensor's residual and warm-start state.
            step: the step number seeding randomness; None counts the state's calls.
            seed: the seed shared by all ranks.
            check_finite: raise ``NonFiniteError`` instead of falling back to an exact reduction.
            timeout: seconds each wait may take, for the creation of the groups on the first call too,
                before ``CommTimeoutError`` (a rank that never enters); None or ``inf``: no bound of
                commopt's own (the group's own timeout still applies).
            state: the per-run state (``new_state()``: warm starts, the call counter); None: this
                compressor's default state.

        Returns:
            ``tensor``, or a Future of it when ``async_op``.

        Raises:
            TypeError: ``tensor`` is not a dense ``torch.Tensor`` (a list, None, a NumPy array, a
                sparse tensor), or another argument has the wrong type; raised at the call, before
                anything moves, and ``tensor`` is left unchanged.
            ValueError: an unsupported ``op`` or ``algorithm``, a negative ``step``, a ``timeout``
                that is not positive, a ``topology`` of another group, or a ``state`` of other settings.
            CollectiveMismatchError: the ranks passed tensors of different sizes, dtypes or shapes
                (or compressors of different settings): raised on every rank, ``tensor`` unchanged.
            CommTimeoutError: a wait passed ``timeout``.
            NonFiniteError: ``check_finite=True`` and a rank holds NaN/Inf.
        """
        return compressed_all_reduce(self, tensor, op, group=group, topology=topology, algorithm=algorithm,
                                     async_op=async_op, error_feedback=error_feedback, key=key, step=step, seed=seed,
                                     check_finite=check_finite, timeout=timeout, state=state)
