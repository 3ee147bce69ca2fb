"""``python -m commopt.bench.cluster.probe ADDRESS SECONDS``: the link probe's agent (see the package)."""

from __future__ import annotations

import sys

from . import agent

__all__: list[str] = []

if __name__ == "__main__":
    sys.exit(agent())
