"""commopt.comm.pipeline: pipeline parallelism's stage-to-stage traffic (docs/architecture.md section 5.5d).

``codec.py``: what crosses a boundary (exact, bf16/fp16, int8/int4 with per-row scales, AQ-SGD's delta
cache); ``channel.py``: a stage's boundary traffic with its neighbours (receives posted ahead, sends that
never block, bounded waits, a trailer per message); ``group.py``: a process group for torch's own
``PipelineStage`` and schedules with commopt's wire underneath. The schedules that drive a channel are
in ``commopt.schedules.pipeline_parallel``.
"""

from __future__ import annotations

from .channel import Agreement, StageLinks
from .codec import CODECS, BoundaryCodec, DeltaCache, get_codec
from .group import BoundaryGroup, boundary_group

__all__ = ["Agreement", "StageLinks", "CODECS", "BoundaryCodec", "DeltaCache", "get_codec", "BoundaryGroup",
           "boundary_group"]
