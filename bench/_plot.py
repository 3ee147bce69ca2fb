"""matplotlib for the benchmarks that draw (an optional dependency: ``pip install commopt[plot]``)."""

from __future__ import annotations

import sys


def pyplot(what: str):
    """``matplotlib.pyplot`` on the file-only Agg backend, or None (with a note on stderr saying
    that ``what`` was not written) when matplotlib is not installed."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print(f"# matplotlib is not installed (pip install commopt[plot]); no {what} written", file=sys.stderr)
        return None
    return plt
