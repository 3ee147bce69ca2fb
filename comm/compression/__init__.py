"""commopt.comm.compression: gradient compressors with error feedback (docs/architecture.md sections 5.3 and 2.1).

Every compressor is a codec (``codec.py``: traits, rounds, state; no collective of its own) that
the one compressed reduction (``exchange.py``) drives: alone (``compressor.all_reduce(tensor,
group=None)``, or ``commopt.comm.all_reduce(tensor, compressor=...)``) and through the DDP
hook (``hooks.AllReduceState(compressor=...)``); with ``algorithm="hierarchical"`` only the
inter-node phase is compressed (``exchange.py``). Error feedback is a separate object keyed by
parameter (:class:`ErrorFeedback`), and what a run mutates (PowerSGD's Q memory, call counters) is
a :class:`CompressorState` (``compressor.new_state()``), so one compressor can serve several models.
"""

from __future__ import annotations

from .base import Compressor
from .cast import BF16Compressor, FP16Compressor
from .codec import Codec, CompressorState, Exchange, Result
from .exchange import compressed_all_reduce, reduce_tensors
from .feedback import ErrorFeedback
from .powersgd import PowerSGDCompressor, PowerSGDState
from .quantize import QuantizeCompressor
from .sign import OneBitCompressor, SignCompressor
from .sparse import RandomKCompressor, TopKCompressor

__all__ = ["Compressor", "Codec", "compressed_all_reduce", "CompressorState", "PowerSGDState", "Exchange", "Result",
           "ErrorFeedback", "reduce_tensors", "FP16Compressor", "BF16Compressor", "PowerSGDCompressor",
           "TopKCompressor", "RandomKCompressor", "SignCompressor", "OneBitCompressor", "QuantizeCompressor"]
