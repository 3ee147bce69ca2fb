"""The link-rate probe: short socket transfers between the nodes, before anything runs.

Both sides of one protocol live here. The agent (:func:`agent`, run as
``python -m commopt.bench.cluster.probe ADDRESS SECONDS``, one inside each node's namespace):

(1) listens on ADDRESS only, the namespace's own address (docs/faults.md row 29), and prints ``port P``;
(2) reads ``HOST PORT RATE`` of the node to send to from stdin, one line per round (RATE: the link's
    configured bytes/s, at which the sender paces itself, ``SO_MAX_PACING_RATE``; 0: unpaced);
(3) for SECONDS receives from the one node that sends to it this round while sending to HOST;
(4) prints one JSON line: ``tx_bytes``, ``rx_bytes`` and ``rx_bps``, the steady receive rate; then
    waits for the next round's line, and exits at the end of stdin.

The launcher's side (:func:`exchange`, called by ``Cluster.probe``) reads every agent's port, gives
each agent its peer round by round, and reads the results. The agent needs only the standard library,
and so does importing this package: a cold torch import would cost each agent seconds on a busy
machine, within the deadline for its first answer.
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
from collections.abc import Callable, Sequence

from .._proc import _CMD_TIMEOUT_S, ClusterError, _read_line

__all__ = ["LinkProbe", "agent", "agent_argv", "exchange"]

_CHUNK = 65536
_SO_MAX_PACING_RATE = getattr(socket, "SO_MAX_PACING_RATE", 47)  # Linux's number; Python names it from 3.14
_SLACK_S = 10.0  # how much longer than the transfer the sockets may wait


@dataclasses.dataclass
class LinkProbe:
    """The measured rate of each directed link (TCP goodput, steady state).

    Goodput sits about 4-5 % below the configured rate even on a perfect link: tbf counts Ethernet,
    IP and TCP headers (66 of every 1514 bytes). That is the rate a collective can actually reach,
    hence the one to compare efficiencies against.

    Attributes:
        configured_bps: the slowest configured rate (every link's on a uniform cluster).
        links: ``(name, bit/s)`` per transfer, e.g. ``("n0->n1", 191e6)``; in a star each crosses the
            sender's outbound and the receiver's inbound shaper, in a mesh the sender's end of the pair.
        seconds: duration of each transfer.
        configured_links: ``{name: bit/s}``, each link's configured rate, where links differ (None:
            every link is configured at ``configured_bps``).
    """

    configured_bps: int
    links: list[tuple[str, float]]
    seconds: float
    configured_links: dict[str, int] | None = None

    @property
    def bps(self) -> int:
        """The slowest link's rate: the one a collective over every node is bound by."""
        return int(min(rate for _, rate in self.links))

    def configured(self, name: str) -> int:
        """The configured rate of link ``name``."""
        return (self.configured_links or {}).get(name, self.configured_bps)

    @property
    def deviation(self) -> float:
        """The largest relative distance of a link's rate from its configured one (on a uniform
        cluster: of :attr:`bps` from the configured rate)."""
        if not self.configured_links:
            return abs(self.bps - self.configured_bps) / self.configured_bps
        return max(abs(rate - self.configured(name)) / self.configured(name) for name, rate in self.links)

    def to_json(self) -> dict[str, object]:
        """The record printed as a JSON line and kept with the results."""
        record: dict[str, object] = {
            "configured_bps": self.configured_bps, "measured_bps": self.bps,
            "ratio": round(self.bps / self.configured_bps, 4), "probe_seconds": self.seconds,
            "links": {name: int(rate) for name, rate in self.links}}
        if self.configured_links:
            record["configured_links"] = {name: self.configured(name) for name, _ in self.links}
        return record


# --------------------------------------------------------------------------------------------------
# The launcher's side


def agent_argv(address: str, seconds: float) -> list[str]:
    """The agent's command line; this interpreter runs it, so it finds this installation."""
    return [sys.executable, "-m", __name__, address, str(seconds)]


def exchange(agents: Sequence[subprocess.Popen], addresses: Sequence[str], seconds: float,
             rounds: Sequence[Sequence[int]] | None = None,
             pace: Callable[[int, int], float] | None = None) -> list[tuple[str, float]]:
    """Run the transfers among started agents, round by round, and return each link's rate.

    In a round, agent i sends to agent ``targets[i]`` while receiving from the one agent that sends
    to it, all at once, for about ``seconds``; the next round starts once every agent has reported.
    The caller starts the agents (:func:`agent_argv`, stdin, stdout and stderr unbuffered binary
    pipes) and stops them afterwards, whatever happens here.

    Args:
        agents: one started agent per node, in node order.
        addresses: the address each agent listens on.
        seconds: the duration the agents were started with.
        rounds: ``targets`` per round, a permutation of the nodes without a fixed point (each agent
            receives exactly once); None: one round around the ring, i to (i + 1) % N.
        pace: ``pace(i, j)``, the bytes/s at which node i's transfer to node j is paced (its link's
            configured rate), or None: unpaced. Where ports differ a sender faster than the receiver's
            port overfills it, and that port's queue then drops the acknowledgements of the receiver's
            own transfer: on a 3x1 star at 200/200/50 Mbit/s unpaced, a slow node's link read 15-33 of
            50 Mbit/s in about half of the probes, paced 47.3-47.8 in all (docs/results.md 32).

    Returns:
        ``(f"n{j}->n{i}", bit/s)`` per round and per receiving node i, in that order.

    Raises:
        ClusterError: an agent did not answer in time, failed, or a link moved no data.
    """
    n = len(agents)
    for targets in rounds or ():
        if sorted(targets) != list(range(n)) or any(t == i for i, t in enumerate(targets)):
            raise ValueError(f"a probe round sends from every node to another one, each receiving once; got {targets}")
    rounds = [[(i + 1) % n for i in range(n)]] if rounds is None else [list(t) for t in rounds]
    deadline = time.monotonic() + _CMD_TIMEOUT_S
    ports = [int(_read_line(a, deadline, f"link probe on node {i}").split()[1]) for i, a in enumerate(agents)]
    links = []
    for targets in rounds:
        for i, agent in enumerate(agents):
            rate = int(pace(i, targets[i])) if pace is not None else 0
            agent.stdin.write(f"{addresses[targets[i]]} {ports[targets[i]]} {rate}\n".encode())
        deadline = time.monotonic() + seconds + _CMD_TIMEOUT_S
        results = [json.loads(_answer(agent, deadline, f"link probe on node {i}")) for i, agent in enumerate(agents)]
        source = {t: i for i, t in enumerate(targets)}
        links += [(f"n{source[i]}->n{i}", float(results[i]["rx_bps"])) for i in range(n)]
    for agent in agents:
        agent.stdin.close()
        agent.stdin = None  # communicate() below must not flush the closed pipe
    for i, agent in enumerate(agents):
        try:
            _, err = agent.communicate(timeout=_CMD_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            raise ClusterError(f"link probe on node {i} did not exit within {_CMD_TIMEOUT_S:.0f} s") from None
        if agent.returncode != 0:
            raise ClusterError(f"link probe on node {i} failed (code {agent.returncode}): "
                               f"{err.decode(errors='replace').strip()}")
    if min(rate for _, rate in links) <= 0:
        raise ClusterError(f"link probe moved no data: {links}")
    return links


def _answer(agent: subprocess.Popen, deadline: float, what: str) -> bytes:
    """The agent's report of a round; a failed agent's error output says why it has none."""
    try:
        return _read_line(agent, deadline, what)
    except ClusterError as e:
        if agent.poll() is None:
            raise
        err = agent.stderr.read().decode(errors="replace").strip()
        raise ClusterError(f"{what} failed (code {agent.returncode}): {err or e}") from None


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


def _round(server: socket.socket, host: str, port: int, seconds: float, timeout: float,
           pace: int) -> dict[str, float]:
    """One round: send to ``host:port`` for ``seconds`` (paced at ``pace`` bytes/s where positive)
    while taking one connection on ``server``."""
    rx: dict[str, float] = {}
    thread = threading.Thread(target=_receive, args=(server, timeout, rx))
    thread.start()
    out = socket.create_connection((host, port), timeout=timeout)
    if pace > 0:
        out.setsockopt(socket.SOL_SOCKET, _SO_MAX_PACING_RATE, pace)
    chunk = b"\0" * _CHUNK
    sent, deadline = 0, time.monotonic() + seconds
    while time.monotonic() < deadline:
        out.sendall(chunk)
        sent += len(chunk)
    out.shutdown(socket.SHUT_WR)
    out.close()
    thread.join(seconds + _SLACK_S + 5)
    return {"tx_bytes": sent, "rx_bytes": rx.get("bytes", 0), "rx_bps": rx.get("bps", 0.0)}


def agent(argv: Sequence[str] | None = None) -> int:
    """The probe agent's entry point (``python -m commopt.bench.cluster.probe``); see the module."""
    parser = argparse.ArgumentParser(
        prog=f"python -m {__name__}",
        description="One node's side of the emulated cluster's link probe: print 'port P'; then for each "
                    "'HOST PORT RATE' line read from stdin, send to HOST for SECONDS (paced at RATE bytes/s, "
                    "0: unpaced) while receiving one connection, and print one JSON line (tx_bytes, rx_bytes, "
                    "rx_bps); exit at the end of stdin.")
    parser.add_argument("address", help="the address to listen on (the node's own, nothing wider)")
    parser.add_argument("seconds", type=float, help="how long to send")
    args = parser.parse_args(argv)
    timeout = args.seconds + _SLACK_S
    server = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    server.bind((args.address, 0))
    server.listen(1)
    server.settimeout(timeout)
    print("port", server.getsockname()[1], flush=True)
    for line in sys.stdin:
        host, port, rate = line.split()
        print(json.dumps(_round(server, host, int(port), args.seconds, timeout, int(rate))), flush=True)
    server.close()
    return 0
