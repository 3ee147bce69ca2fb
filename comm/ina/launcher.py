"""The switch's process: :class:`SwitchProcess`, the ``serve_main`` command line, the stats query.

The switch itself (:mod:`.switch`) is a packet handler bound to a socket; this module runs it as a
process of its own and talks to it from outside:

- :func:`serve_main`: the command line (``commopt-bench ina-switch``): serve until SIGTERM/SIGINT,
  then print the counters;
- :func:`launch_command` and :class:`SwitchProcess`: a light child process that imports only this
  folder's numpy-only modules (never torch, never a forked copy of the caller), stopped for sure;
- :func:`query_stats`: a STATS_REQ datagram to any running switch.

Like the switch, it never imports torch (the light child imports it).
"""

from __future__ import annotations

import argparse
import os
import select
import signal
import socket
import subprocess
import sys
import time
from typing import Any

from .protocol import HEADER_SIZE, PacketType, ProtocolError, decode_stats, pack_header, parse_header
from .switch import (
    DEFAULT_JOB_IDLE_TIMEOUT,
    DEFAULT_JOIN_TIMEOUT,
    DEFAULT_MAX_PENDING_PER_SOURCE,
    DEFAULT_PARTITION_SIZE,
    DEFAULT_POOL_SLOTS,
    DEFAULT_RECV_THREADS,
    DEFAULT_SEND_THREADS,
    Switch,
    format_stats,
)

__all__ = ["SwitchProcess", "query_stats", "serve_main", "launch_command"]


def query_stats(address: tuple[str, int], timeout: float = 2.0) -> dict[str, int]:
    """Ask a running switch for its counters (a STATS_REQ datagram, retried until ``timeout``).

    Raises:
        TimeoutError: the switch did not answer.
    """
    deadline = time.monotonic() + timeout
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.bind(("127.0.0.1" if address[0] in ("127.0.0.1", "localhost") else "", 0))
        buf = bytearray(65536)
        req = pack_header(PacketType.STATS_REQ)
        while time.monotonic() < deadline:
            s.sendto(req, address)
            s.settimeout(min(0.2, max(0.01, deadline - time.monotonic())))
            try:
                nbytes, _ = s.recvfrom_into(buf)
            except socket.timeout:
                continue
            try:
                h = parse_header(buf, nbytes, allowed=frozenset({PacketType.STATS_REPLY}))
            except ProtocolError:
                continue
            return decode_stats(memoryview(buf)[HEADER_SIZE:nbytes], h.count)
    raise TimeoutError(f"ina switch at {address[0]}:{address[1]} did not answer a stats request within "
                       f"{timeout:.1f}s; is it running (commopt-bench ina-switch)?")


def serve_main(argv: list[str]) -> int:
    """The switch's command line (``commopt-bench ina-switch`` without ``--bench``).

    Prints ``commopt ina switch listening on HOST:PORT ...`` (flushed), serves until SIGTERM or
    SIGINT, prints its counters, and returns 0.
    """
    stop = {"flag": False}

    def _on_signal(signum: int, frame: Any) -> None:
        stop["flag"] = True

    signal.signal(signal.SIGTERM, _on_signal)
    signal.signal(signal.SIGINT, _on_signal)
    p = argparse.ArgumentParser(prog="commopt-bench ina-switch",
                                description="Run the simulated in-network aggregation switch (UDP).")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default: loopback only)")
    p.add_argument("--port", type=int, default=0, help="UDP port (0: pick a free one; printed)")
    p.add_argument("--pool-slots", type=int, default=DEFAULT_POOL_SLOTS, help="slots in the pool")
    p.add_argument("--partition-size", type=int, default=DEFAULT_PARTITION_SIZE,
                   help="slots per job (slot 0 is the job's control slot)")
    p.add_argument("--job-idle-timeout", type=float, default=DEFAULT_JOB_IDLE_TIMEOUT,
                   help="seconds after which an idle job's partition is reclaimed")
    p.add_argument("--join-timeout", type=float, default=DEFAULT_JOIN_TIMEOUT,
                   help="seconds after its last JOIN that an incomplete join releases its partition")
    p.add_argument("--max-pending-per-source", type=int, default=DEFAULT_MAX_PENDING_PER_SOURCE,
                   help="incomplete jobs one source address (host, port) may hold at once")
    p.add_argument("--send-threads", type=int, default=DEFAULT_SEND_THREADS,
                   help="threads that send datagrams (0: the receiving thread sends; see Switch.serve)")
    p.add_argument("--recv-threads", type=int, default=DEFAULT_RECV_THREADS,
                   help="threads that receive datagrams (each handles its own under one lock)")
    args = p.parse_args(argv)
    switch = Switch(args.host, args.port, pool_slots=args.pool_slots, partition_size=args.partition_size,
                    job_idle_timeout=args.job_idle_timeout, join_timeout=args.join_timeout,
                    max_pending_per_source=args.max_pending_per_source)
    host, port = switch.address
    print(f"commopt ina switch listening on {host}:{port} (pool {args.pool_slots} slots, "
          f"{switch.num_partitions} partitions of {args.partition_size}, pid {os.getpid()})", flush=True)
    try:
        switch.serve(lambda: stop["flag"], send_threads=max(0, args.send_threads),
                     recv_threads=max(1, args.recv_threads))
    finally:
        print(f"commopt ina switch on {host}:{port} stopped: {format_stats(switch.stats())}", flush=True)
        switch.close()
    return 0


# Runs the switch without importing the commopt package: a bare package object over this folder
# makes ``launcher``, ``switch`` and ``protocol`` importable (they need only numpy), so the switch starts in a
# fraction of a second instead of paying for torch and the rest of commopt, and carries no torch
# state. argv: [this folder, switch arguments...].
_LAUNCHER = (
    "import importlib, sys, types\n"
    "pkg = types.ModuleType('_commopt_ina_switch_pkg')\n"
    "pkg.__path__ = [sys.argv[1]]\n"
    "sys.modules[pkg.__name__] = pkg\n"
    "sys.exit(importlib.import_module(pkg.__name__ + '.launcher').serve_main(sys.argv[2:]))\n"
)


def launch_command(host: str = "127.0.0.1", port: int = 0, **options: Any) -> list[str]:
    """The argv that starts a light switch process (see ``_LAUNCHER``)."""
    cmd = [sys.executable, "-c", _LAUNCHER, os.path.dirname(os.path.abspath(__file__)), "--host", host,
           "--port", str(port)]
    for key, value in options.items():
        cmd += [f"--{key.replace('_', '-')}", str(value)]
    return cmd


class SwitchProcess:
    """A switch in a child process, for tests, the backend's users and benchmarks.

    The child runs :func:`serve_main` through ``launch_command`` (exec'd, never a forked copy of
    this interpreter). Use as a context manager; ``stop()`` sends SIGTERM and, if the child does not
    exit, SIGKILL, so nothing is left behind (docs/faults.md row 30).

    Args:
        host: bind address (loopback by default).
        port: 0 picks a free port.
        start_timeout: seconds to wait for the child to print its address.
        **options: ``pool_slots``, ``partition_size``, ``job_idle_timeout``, ``join_timeout``,
            ``max_pending_per_source`` (see :class:`Switch`).
    """

    def __init__(self, host: str = "127.0.0.1", port: int = 0, *, start_timeout: float = 60.0,
                 **options: Any):
        unknown = set(options) - {"pool_slots", "partition_size", "job_idle_timeout", "join_timeout",
                                  "max_pending_per_source"}
        if unknown:
            raise TypeError(f"SwitchProcess: unknown options {sorted(unknown)}")
        self.final_line = ""
        self._proc = subprocess.Popen(launch_command(host, port, **options), stdout=subprocess.PIPE,
                                      stdin=subprocess.DEVNULL, text=True)
        assert self._proc.stdout is not None
        ready, _, _ = select.select([self._proc.stdout], [], [], start_timeout)
        line = self._proc.stdout.readline() if ready else ""
        marker = "listening on "
        if marker not in line:
            self.stop()
            raise RuntimeError(f"ina switch process did not start within {start_timeout:.0f}s (exit code "
                               f"{self._proc.returncode}, said {line!r}); see its stderr")
        addr = line.split(marker, 1)[1].split()[0]
        host_part, _, port_part = addr.rpartition(":")
        self.address: tuple[str, int] = (host_part, int(port_part))

    @property
    def pid(self) -> int:
        return self._proc.pid

    def is_alive(self) -> bool:
        return self._proc.poll() is None

    def stats(self, timeout: float = 2.0) -> dict[str, int]:
        return query_stats(self.address, timeout)

    def stop(self, timeout: float = 5.0) -> int | None:
        """Stop the switch (SIGTERM, then SIGKILL after ``timeout``); returns its exit code."""
        if self._proc.poll() is None:
            self._proc.send_signal(signal.SIGTERM)
            try:
                self._proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait(timeout)
        if self._proc.stdout is not None and not self._proc.stdout.closed:
            self.final_line = self._proc.stdout.read().strip()
            self._proc.stdout.close()
        return self._proc.returncode

    def __enter__(self) -> SwitchProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
