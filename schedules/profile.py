"""``StepProfile``: one step's timings on one rank, and the link fit that re-planning reads from them.

``OverlapDataParallel`` records, per synchronised step, when the forward ended, when each bucket
became ready, and when each chunk was issued and completed. Rank 0 fits the link from its own
profile (:meth:`StepProfile.service_fit`) and plans the next step from it; the plan, with the
partition and credit the fit chose, is broadcast (docs/architecture.md section 3, rule 2: local timings never decide
anything on their own rank).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from commopt.comm import cost

__all__ = ["StepProfile"]

_FIT_BETA_FLOOR = 1e-15  # cost.fit clamps beta here when the data show no per-byte cost


@dataclass
class StepProfile:
    """Timings of one step on this rank (seconds, ``time.perf_counter``), the input of re-planning.

    Attributes:
        forward_end: when the forward before this backward returned.
        ready: per bucket, when it became ready.
        issued: per issued chunk (plan order), when it was handed to the network.
        done: per issued chunk, when its reduction completed.
        nbytes: per issued chunk, its size.
    """

    forward_end: float = 0.0
    ready: dict[int, float] = field(default_factory=dict)
    issued: list[float] = field(default_factory=list)
    done: list[float] = field(default_factory=list)
    nbytes: list[int] = field(default_factory=list)

    def busy_periods(self) -> list[tuple[float, int, int]]:
        """``(seconds, bytes, chunks)`` of each interval during which some chunk was in flight."""
        if not self.done or len(self.done) != len(self.issued):
            return []
        out: list[list[float]] = []  # [start, end, bytes, chunks]
        for issued, done, n in sorted(zip(self.issued, self.done, self.nbytes)):
            if out and issued <= out[-1][1]:
                last = out[-1]
                last[1], last[2], last[3] = max(last[1], done), last[2] + n, last[3] + 1
            else:
                out.append([issued, done, n, 1])
        return [(max(end - start, 1e-7), int(n), int(k)) for start, end, n, k in out]

    def service_fit(self) -> cost.LinkModel | None:
        """alpha-beta of the link as this step's chunks saw it (None: nothing was measured).

        Chunks in flight together share the link (two streams), so a chunk's own issue-to-done time
        says little: the later of two finishes last but was served half the time. A busy period
        says more: it took about ``chunks * alpha + bytes * beta``, plus the wait for the slowest
        rank to issue its first chunk. That wait only adds, and a least-squares fit reads it as a
        huge alpha and no beta; so alpha is the lower quartile of the periods' per-chunk excess over
        their mean per-byte time (0 when the periods cannot tell latency from bandwidth apart), and
        beta the byte-weighted median of their per-byte times net of alpha. (With the median excess,
        4-7 ms of rank skew read as latency in some steps, and the re-plan then kept buckets whole.)
        """
        periods = self.busy_periods()
        if not periods:
            return None
        total = sum(n for _, n, _ in periods)
        alpha = 0.0
        if self.separates_alpha():
            beta0 = sum(t for t, _, _ in periods) / max(total, 1)
            excess = sorted((t - n * beta0) / k for t, n, k in periods)
            alpha = max(0.0, excess[len(excess) // 4])
        # The byte-weighted median of the periods' per-byte times: the long backlog periods, where a
        # rank's late start is spread over many chunks, decide.
        seen, beta = 0, 0.0
        for per_byte, n in sorted(((t - k * alpha) / max(n, 1), n) for t, n, k in periods):
            seen, beta = seen + n, per_byte
            if 2 * seen >= total:
                break
        return cost.LinkModel(alpha=alpha, beta=max(beta, _FIT_BETA_FLOOR))

    def separates_alpha(self) -> bool:
        """Whether the busy periods have at least two mean chunk sizes (latency and bandwidth apart)."""
        return len({round(n / k) for _, n, k in self.busy_periods()}) >= 2

    def measured(self, link: cost.LinkModel) -> bool:
        """Whether ``link``, this profile's :meth:`service_fit`, may re-choose partition and credit.

        One chunk size gives no latency term (alpha = 0), and a fit at ``cost.fit``'s floor of beta
        found no per-byte cost at all (noise: small chunks as slow as large ones), which would make
        the bandwidth-delay product, and the credit, unbounded.
        """
        return self.separates_alpha() and link.beta > _FIT_BETA_FLOOR
