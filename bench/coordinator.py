"""``commopt-bench coordinator``: run the elastic membership coordinator in the foreground.

::

    commopt-bench coordinator --host 127.0.0.1 --port 0 --heartbeat-timeout 5 --min-replicas 2 --job myjob
    # prints {"address": "127.0.0.1:PORT", "host": ..., "port": ..., "pid": ..., "job": ..., "store_port": ...}
    # as one JSON line
    # (flushed), serves until SIGTERM/SIGINT, prints its refusal counts as one JSON line, exits 0.

Give the address to every replica in ``COMMOPT_COORDINATOR`` (``Membership.from_env``). The process
outlives any rank; it binds to loopback unless ``--host`` says otherwise (docs/architecture.md section 9).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import threading
from typing import Any

__all__ = ["main", "stop_on_signals"]


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="commopt-bench coordinator", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default: loopback only)")
    p.add_argument("--port", type=int, default=0,
                   help="UDP port, and the TCP port of the replicas' liveness connections (0: pick a free one; "
                        "printed)")
    p.add_argument("--heartbeat-timeout", type=float, default=5.0,
                   help="seconds without a heartbeat after which a replica is dropped")
    p.add_argument("--min-replicas", type=int, default=1, help="the fewest replicas a generation may have")
    p.add_argument("--initial-replicas", type=int, default=None,
                   help="replicas the first generation waits for (default: --min-replicas)")
    p.add_argument("--job", default="commopt", help="the job's name; other jobs' messages are refused")
    p.add_argument("--no-store", action="store_true",
                   help="host no rendezvous store (membership only; elastic training needs the store)")
    return p


def stop_on_signals() -> threading.Event:
    """An event set by SIGTERM or SIGINT: a membership service (this one, or torchft's Lighthouse that
    ``commopt-bench elastic`` starts in its place) serves until it is set."""
    stop = threading.Event()

    def _on_signal(signum: int, frame: Any) -> None:
        stop.set()

    signal.signal(signal.SIGTERM, _on_signal)
    signal.signal(signal.SIGINT, _on_signal)
    return stop


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    stop = stop_on_signals()
    from commopt.comm.elastic import Coordinator

    try:
        coord = Coordinator(args.host, args.port, heartbeat_timeout=args.heartbeat_timeout,
                            min_replicas=args.min_replicas, job=args.job, initial_replicas=args.initial_replicas,
                            store=not args.no_store)
    except (ValueError, OSError) as e:
        print(f"commopt-bench coordinator: error: {e}", flush=True)
        return 2
    with coord:
        host, _, port = coord.address.rpartition(":")
        print(json.dumps({"address": coord.address, "host": host, "port": int(port), "pid": os.getpid(),
                          "job": args.job, "store_port": coord.store_port}), flush=True)
        while not stop.wait(0.2):
            pass
        print(json.dumps({"stopped": coord.address, "generation": coord.generation, "refused": coord.refused}),
              flush=True)
    return 0
