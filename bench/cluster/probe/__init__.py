"""The link-rate probe: a short socket transfer around the ring of nodes, before anything runs.

Both sides of one protocol live here. The agent (:func:`agent`, run as
``python -m commopt.bench.cluster.probe ADDRESS SECONDS``, one inside each node's namespace):

(1) listens on ADDRESS only, the namespace's own address (docs/faults.md row 29), and prints ``port P``;
(2) reads ``HOST PORT`` of the next node from stdin;
(3) for SECONDS receives from the previous node while sending to the next;
(4) prints one JSON line: ``tx_bytes``, ``rx_bytes`` and ``rx_bps``, the steady receive rate.

The launcher's side (:func:`exchange`, called by ``Cluster.probe``) reads every agent's port, tells
each agent the next one's address and port, and reads the results. The agent needs only the standard
library, and so does importing this package: a cold torch import would cost each agent seconds on a
busy machine, within the deadline for its first answer.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Sequence

from .._proc import _CMD_TIMEOUT_S, ClusterError, _read_line

__all__ = ["LinkProbe", "agent", "agent_argv", "exchange"]

_CHUNK = 65536
_SLACK_S = 10.0  # how much longer than the transfer the sockets may wait


@dataclasses.dataclass
class LinkProbe:
    """The measured rate of each node's link (TCP goodput, steady state).

    Goodput sits about 4-5 % below the configured rate even on a perfect link: tbf counts Ethernet,
    IP and TCP headers (66 of every 1514 bytes). That is the rate a collective can actually reach,
    hence the one to compare efficiencies against.

    Attributes:
        configured_bps: the configured per-node rate.
        links: ``(name, bit/s)`` per transfer, e.g. ``("n0->n1", 191e6)``; each crosses the sender's
            outbound and the receiver's inbound shaper.
        seconds: duration of the transfer.
    """

    configured_bps: int
    links: list[tuple[str, float]]
    seconds: float

    @property
    def bps(self) -> int:
        """The slowest link's rate: the one a collective is bound by."""
        return int(min(rate for _, rate in self.links))

    @property
    def deviation(self) -> float:
        """Relative distance of :attr:`bps` from the configured rate."""
        return abs(self.bps - self.configured_bps) / self.configured_bps

    def to_json(self) -> dict[str, object]:
        """The record printed as a JSON line and kept with the results."""
        return {"configured_bps": self.configured_bps, "measured_bps": self.bps,
                "ratio": round(self.bps / self.configured_bps, 4), "probe_seconds": self.seconds,
                "links": {name: int(rate) for name, rate in self.links}}


# --------------------------------------------------------------------------------------------------
# The launcher's side


def agent_argv(address: str, seconds: float) -> list[str]:
    """The agent's command line; this interpreter runs it, so it finds this installation."""
    return [sys.executable, "-m", __name__, address, str(seconds)]


def exchange(agents: Sequence[subprocess.Popen], addresses: Sequence[str],
             seconds: float) -> list[tuple[str, float]]:
    """Run the ring transfer among started agents and return each link's rate.

    Agent i sends to agent (i+1) % N while receiving from agent i-1, all at once, so in about
    ``seconds`` every link is crossed in both directions (each direction has its own shaper). The
    caller starts the agents (:func:`agent_argv`, stdin, stdout and stderr unbuffered binary pipes)
    and stops them afterwards, whatever happens here.

    Args:
        agents: one started agent per node, in node order.
        addresses: the address each agent listens on.
        seconds: the duration the agents were started with.

    Returns:
        ``(f"n{i-1}->n{i}", bit/s)`` per node i: what it received from the previous node.

    Raises:
        ClusterError: an agent did not answer in time, failed, or a link moved no data.
    """
    try:
        deadline = time.monotonic() + _CMD_TIMEOUT_S
        ports = [int(_read_line(a, deadline, f"link probe on node {n}").split()[1])
                 for n, a in enumerate(agents)]
        for n, agent in enumerate(agents):
            nxt = (n + 1) % len(agents)
            agent.stdin.write(f"{addresses[nxt]} {ports[nxt]}\n".encode())
            agent.stdin.close()
            agent.stdin = None  # communicate() below must not flush the closed pipe
        links = []
        for n, agent in enumerate(agents):
            out, err = agent.communicate(timeout=seconds + _CMD_TIMEOUT_S)
            if agent.returncode != 0:
                raise ClusterError(f"link probe on node {n} failed (code {agent.returncode}): "
                                   f"{err.decode(errors='replace').strip()}")
            result = json.loads(out.decode().strip().splitlines()[-1])
            prev = (n - 1) % len(agents)
            links.append((f"n{prev}->n{n}", float(result["rx_bps"])))
    except subprocess.TimeoutExpired:
        raise ClusterError(f"link probe did not finish within {seconds + _CMD_TIMEOUT_S:.0f} s") from None
    if min(rate for _, rate in links) <= 0:
        raise ClusterError(f"link probe moved no data: {links}")
    return links


# --------------------------------------------------------------------------------------------------
# The agent


def _steady_bps(samples: list[tuple[float, int]], total: int) -> float:
    """The receive rate from ``(time, bytes so far)`` samples, past the start of the transfer."""
    t0, t1 = samples[0][0], samples[-1][0]
    # Skip the first quarter: tbf's initial burst and TCP's slow start are not the steady rate.
    warm = t0 + 0.25 * (t1 - t0)
    tw, bw = next(s for s in samples if s[0] >= warm)
    if t1 - tw > 0.05:
        return (total - bw) * 8 / (t1 - tw)
    return total * 8 / max(t1 - t0, 1e-9)


def _receive(server: socket.socket, timeout: float, rx: dict[str, float]) -> None:
    """Take one connection and read it to its end; ``rx`` gets ``bytes`` and ``bps``."""
    conn, _ = server.accept()
    conn.settimeout(timeout)
    samples, total = [], 0
    with conn:
        while True:
            data = conn.recv(1 << 20)
            if not data:
                break
            total += len(data)
            samples.append((time.monotonic(), total))
    rx.update(bytes=total, bps=_steady_bps(samples, total) if len(samples) >= 2 else 0.0)


def agent(argv: Sequence[str] | None = None) -> int:
    """The probe agent's entry point (``python -m commopt.bench.cluster.probe``); see the module."""
    parser = argparse.ArgumentParser(
        prog=f"python -m {__name__}",
        description="One node's side of the emulated cluster's link probe: print 'port P', read 'HOST "
                    "PORT' of the next node from stdin, send to it for SECONDS while receiving from "
                    "the previous node, print one JSON line (tx_bytes, rx_bytes, rx_bps).")
    parser.add_argument("address", help="the address to listen on (the node's own, nothing wider)")
    parser.add_argument("seconds", type=float, help="how long to send")
    args = parser.parse_args(argv)
    timeout = args.seconds + _SLACK_S
    server = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    server.bind((args.address, 0))
    server.listen(1)
    server.settimeout(timeout)
    print("port", server.getsockname()[1], flush=True)
    host, port = sys.stdin.readline().split()
    rx: dict[str, float] = {}
    thread = threading.Thread(target=_receive, args=(server, timeout, rx))
    thread.start()
    out = socket.create_connection((host, int(port)), timeout=timeout)
    chunk = b"\0" * _CHUNK
    sent, deadline = 0, time.monotonic() + args.seconds
    while time.monotonic() < deadline:
        out.sendall(chunk)
        sent += len(chunk)
    out.shutdown(socket.SHUT_WR)
    out.close()
    thread.join(args.seconds + _SLACK_S + 5)
    server.close()
    print(json.dumps({"tx_bytes": sent, "rx_bytes": rx.get("bytes", 0), "rx_bps": rx.get("bps", 0.0)}),
          flush=True)
    return 0
