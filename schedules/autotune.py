"""Autotuning of bucket size (the first bucket separately), partition and credit from measured steps.

The best values depend on the model, the link and the machine (ByteScheduler tunes partition and
credit online with Bayesian optimisation for the same reason). Here the search is a short
coordinate descent: bucket cap, then first-bucket cap, then partition, then credit, each value timed
over a few real training steps of ``OverlapDataParallel`` on a copy of the model (the caller's model
is never stepped). Every rank times its own steps and the slowest rank's time is agreed with one
all-reduce (MAX), so every rank makes the same choice (docs/architecture.md section 3, rule 2) and a rank that is slow
for local reasons is what the choice optimises for. Every trial and the choice are logged.
"""

from __future__ import annotations

import copy
import logging
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, replace
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch import nn

from .overlap import OptimizerFactory, OverlapDataParallel

__all__ = ["TuneConfig", "TuneResult", "autotune"]

_log = logging.getLogger(__name__)


@dataclass(frozen=True)
class TuneConfig:
    """The tuned settings; ``OverlapDataParallel(module, factory, **config.kwargs(), ...)`` uses them."""

    bucket_cap_mb: float = 25.0
    first_bucket_cap_mb: float = 1.0
    partition_mb: float = 1.0
    credit_mb: float = 4.0

    def kwargs(self) -> dict:
        return asdict(self)


@dataclass
class TuneResult:
    """The chosen configuration and every trial's agreed (slowest-rank) step time in seconds."""

    best: TuneConfig
    trials: list[tuple[TuneConfig, float]] = field(default_factory=list)


def _time_trial(module: nn.Module, optimizer_factory: OptimizerFactory, step_fn: Callable[[OverlapDataParallel], Any],
                config: TuneConfig, *, steps: int, warmup: int, group, odp_kwargs: dict) -> float:
    odp = OverlapDataParallel(copy.deepcopy(module), optimizer_factory, process_group=group, **config.kwargs(),
                              **odp_kwargs)
    try:
        for _ in range(warmup):
            step_fn(odp)
        odp.synchronize()
        start = time.perf_counter()
        for _ in range(steps):
            step_fn(odp)
        odp.synchronize()
        elapsed = (time.perf_counter() - start) / steps
    finally:
        odp.close()
    t = torch.tensor([elapsed], dtype=torch.float64)
    if dist.is_initialized() and dist.get_world_size(group) > 1:
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return float(t.item())


def autotune(module: nn.Module, optimizer_factory: OptimizerFactory, step_fn: Callable[[OverlapDataParallel], Any], *,
             bucket_caps_mb: Sequence[float] = (1.0, 4.0, 25.0), first_bucket_caps_mb: Sequence[float] = (0.25, 1.0),
             partitions_mb: Sequence[float] = (0.25, 1.0, 4.0), credit_factors: Sequence[float] = (1.0, 2.0, 4.0),
             steps: int = 3, warmup: int = 2, process_group: Any = None, start: TuneConfig | None = None,
             log: Callable[[str], None] | None = None, **odp_kwargs: Any) -> TuneResult:
    """Choose bucket caps, partition and credit for ``module`` by timing a few steps of each.

    Args:
        module: the model (left untouched: every trial trains a deep copy).
        optimizer_factory: as for ``OverlapDataParallel``.
        step_fn: one training step on the wrapped model, e.g. ``lambda odp: loss(odp(x)).backward()``.
        bucket_caps_mb, first_bucket_caps_mb, partitions_mb: the values tried for each setting.
        credit_factors: credits tried, as multiples of the chosen partition.
        steps, warmup: timed and untimed steps per trial (warm-up includes the re-plan after step 1).
        process_group: the training group (None: WORLD); the slowest rank's time decides.
        start: the configuration the descent starts from (default :class:`TuneConfig` ()).
        log: where to write one line per trial (default: this module's logger at INFO).
        odp_kwargs: further ``OverlapDataParallel`` arguments (algorithm, compressor, plan, ...).

    Returns:
        A :class:`TuneResult`, identical on every rank.
    """
    if steps < 1 or warmup < 0:
        raise ValueError(f"steps must be >= 1 and warmup >= 0, got steps={steps}, warmup={warmup}")
    say = log or _log.info
    best = start or TuneConfig()
    result = TuneResult(best)
    cache: dict[TuneConfig, float] = {}

    def measure(cfg: TuneConfig) -> float:
        if cfg not in cache:
            cache[cfg] = _time_trial(module, optimizer_factory, step_fn, cfg, steps=steps, warmup=warmup,
                                     group=process_group, odp_kwargs=odp_kwargs)
            result.trials.append((cfg, cache[cfg]))
            say(f"commopt autotune: bucket {cfg.bucket_cap_mb:g} MiB, first {cfg.first_bucket_cap_mb:g} MiB, "
                f"partition {cfg.partition_mb:g} MiB, credit {cfg.credit_mb:g} MiB -> {cache[cfg] * 1e3:.2f} ms/step")
        return cache[cfg]

    axes: list[tuple[str, Callable[[TuneConfig], list[TuneConfig]]]] = [
        ("bucket_cap_mb", lambda c: [replace(c, bucket_cap_mb=v) for v in bucket_caps_mb]),
        ("first_bucket_cap_mb", lambda c: [replace(c, first_bucket_cap_mb=v) for v in first_bucket_caps_mb]),
        ("partition_mb", lambda c: [replace(c, partition_mb=v, credit_mb=v * c.credit_mb / c.partition_mb)
                                    for v in partitions_mb]),
        ("credit_mb", lambda c: [replace(c, credit_mb=c.partition_mb * f) for f in credit_factors]),
    ]
    for _name, candidates in axes:
        # Ties go to the earlier candidate: the choice must not depend on float noise order.
        options = candidates(best)
        times = [measure(c) for c in options]
        best = options[min(range(len(options)), key=lambda i: (times[i], i))]
    result.best = best
    say(f"commopt autotune: chose {best} ({cache[best] * 1e3:.2f} ms/step)")
    return result
