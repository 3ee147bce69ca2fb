"""commopt.comm.compression: gradient compressors with error feedback (DESIGN 3, 10).

Every compressor is usable alone (``compressor.all_reduce(tensor, group=None)``) and through the DDP
hook (``hooks.AllReduceState(compressor=...)``); with ``algorithm="hierarchical"`` only the
inter-node phase is compressed (``exchange.py``). Error feedback is a separate object keyed by
parameter (:class:`ErrorFeedback`).
"""

from __future__ import annotations

from .base import Compressor, Job, Round
from .cast import BF16Compressor, FP16Compressor
from .exchange import reduce_tensors
from .feedback import ErrorFeedback
from .powersgd import PowerSGDCompressor
from .quantize import QuantizeCompressor
from .sign import OneBitCompressor, SignCompressor
from .sparse import RandomKCompressor, TopKCompressor

__all__ = ["Compressor", "Job", "Round", "ErrorFeedback", "reduce_tensors", "FP16Compressor",
           "BF16Compressor", "PowerSGDCompressor", "TopKCompressor", "RandomKCompressor", "SignCompressor",
           "OneBitCompressor", "QuantizeCompressor"]
