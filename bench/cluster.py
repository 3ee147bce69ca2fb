"""``commopt-bench cluster``: an emulated multi-node cluster on one Linux box.

On one machine every rank talks over unshaped loopback, where no topology-aware algorithm can win.
This module gives each *node* its own network namespace and joins it to a star fabric through a
rate-limited link, so traffic inside a node stays on loopback (the "NVLink") while traffic between
nodes crosses a real, shaped link (the "NIC"). Then it runs a command once per rank inside its node's
namespace (DESIGN 6)::

    commopt-bench cluster --nodes 2 --ranks-per-node 2 --link-rate 200mbit -- \\
        commopt-bench collectives --op allreduce --algo flat,hierarchical,auto --sizes 1M,4M,16M

Layout, for a run whose prefix is ``co-<launcher pid>-<launcher start time>-<tag>``::

    <prefix>-fab   the fabric: bridge ``cbr0``; port ``cf<i>`` per node, ``cfsw`` to the switch
    <prefix>-n<i>  node i: ``lo`` (intra-node traffic) and ``cn<i>`` = 10.77.0.<i+1>/24
    <prefix>-sw    with --switch-node: ``cnsw`` = 10.77.0.254/24

(1) namespaces, bridge and veth pairs are created inside the new namespaces only (the host's root
namespace is never touched, and the 10.77.0.0/24 addresses exist nowhere else); (2) tbf shapes both
ends of every node link, with a burst larger than a 64 KiB GSO super-packet (with a smaller one
tbf must segment every super-packet, or on older kernels drops it and the rate collapses); on a
6.18 kernel the probe then gets 95.5 % of the configured rate, i.e. the full rate less the
Ethernet/IP/TCP headers; (3) a short socket transfer around the ring of nodes measures each link's
achieved rate before anything runs; (4) the ranks run, their output prefixed; (5) everything is torn
down, whatever happens.

Nothing here depends on netem: the kernels we run on lack it, so ``--delay`` detects its absence and
says so. Only the CLI (:func:`main`) reads environment variables (DESIGN 7.6).
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import dataclasses
import importlib.util
import json
import os
import re
import secrets
import select
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import AbstractContextManager
from typing import IO

__all__ = [
    "CAP_NET_ADMIN",
    "CAP_SYS_ADMIN",
    "Cluster",
    "ClusterError",
    "LinkProbe",
    "check_requirements",
    "cleanup_leftovers",
    "format_layout",
    "leftover_prefixes",
    "list_namespaces",
    "main",
    "missing_requirements",
    "parse_cap_eff",
    "parse_rate",
    "place_ranks",
    "rank_environments",
    "run_ranks",
]

CAP_NET_ADMIN = 12  # veth pairs, bridges, addresses, tc qdiscs
CAP_SYS_ADMIN = 21  # `ip netns add` bind-mounts the namespace under /run/netns

_SUBNET = "10.77.0"  # private, and it only ever exists inside this run's namespaces (FAULTS row 29)
_SWITCH_HOST = 254
_MAX_NODES = 200
# The namespaces are fresh, so nothing listens in them yet: fixed ports below the ephemeral range
# (32768+) are free by construction and cannot collide with gloo's own connections.
_MASTER_PORT = 29500
_SWITCH_PORT = 29600
_NETNS_DIR = "/var/run/netns"  # where `ip netns add` mounts named namespaces (iproute2's NETNS_RUN_DIR)
_MIN_BURST_BYTES = 128 * 1024  # > one 64 KiB GSO super-packet, with room to spare
_PREFIX_RE = re.compile(r"^(co-([0-9a-f]+)-([0-9a-f]+)-[0-9a-f]{4})-(fab|sw|n\d+)$")
_CMD_TIMEOUT_S = 15.0
_KILL_GRACE_S = 2.0
_WARN_DEVIATION = 0.15


class ClusterError(RuntimeError):
    """The emulated cluster cannot be set up, probed or torn down; the message says what to do."""


# --------------------------------------------------------------------------------------------------
# Pure helpers: parsing, placement, environments, requirement checks


def parse_rate(text: str) -> int:
    """Parse a link rate such as ``"200mbit"`` or ``"1gbit"`` into bit/s.

    Units follow tc (and ``commopt.comm.topology.parse_rate``): ``bit``/``kbit``/``mbit``/``gbit``/
    ``tbit`` are bits per second (powers of 1000); ``bps``/``kbps``/``mbps``/``gbps`` are *bytes* per
    second, as in tc; a bare number is bit/s. The result is what both tc and the ranks
    (``COMMOPT_LINK_RATE_BPS``) get, so they agree on one integer.

    Args:
        text: the rate as given on the command line.

    Returns:
        The rate in bit/s, a positive integer.

    Raises:
        ValueError: the text is not a positive rate.
    """
    s = text.strip().lower()
    units = [("tbit", 10**12), ("gbit", 10**9), ("mbit", 10**6), ("kbit", 10**3), ("bit", 1),
             ("gbps", 8 * 10**9), ("mbps", 8 * 10**6), ("kbps", 8 * 10**3), ("bps", 8)]
    number, mult = s, 1
    for unit, factor in units:
        if s.endswith(unit):
            number, mult = s[: -len(unit)], factor
            break
    try:
        value = int(round(float(number) * mult))
    except ValueError:
        raise ValueError(f"cannot parse link rate {text!r}: use e.g. '200mbit' or '1gbit'") from None
    if value <= 0:
        raise ValueError(f"link rate must be positive, got {text!r}")
    return value


def place_ranks(nodes: int, ranks_per_node: int, placement: str = "contiguous") -> list[list[int]]:
    """The ranks of every node.

    ``contiguous`` puts ranks node by node (``0,1;2,3``), which is what topology-aware algorithms
    expect; ``interleaved`` puts rank r on node r % N (``0,2;1,3``), the pathology where every
    neighbour of a ring crosses the slow link.

    Args:
        nodes: number of nodes N.
        ranks_per_node: ranks per node L.
        placement: ``"contiguous"`` or ``"interleaved"``.

    Returns:
        ``layout[node]`` = the ranks of that node, ascending.
    """
    if nodes < 1 or ranks_per_node < 1:
        raise ValueError(f"need nodes >= 1 and ranks_per_node >= 1, got {nodes} and {ranks_per_node}")
    world = nodes * ranks_per_node
    if placement == "contiguous":
        return [list(range(n * ranks_per_node, (n + 1) * ranks_per_node)) for n in range(nodes)]
    if placement == "interleaved":
        return [[r for r in range(world) if r % nodes == n] for n in range(nodes)]
    raise ValueError(f"placement must be 'contiguous' or 'interleaved', got {placement!r}")


def format_layout(layout: Sequence[Sequence[int]]) -> str:
    """``COMMOPT_NODES`` for a layout: nodes separated by ``;``, ranks of a node by ``,``."""
    return ";".join(",".join(str(r) for r in node) for node in layout)


def rank_environments(layout: Sequence[Sequence[int]], base_env: dict[str, str], *,
                      master_addr: str, master_port: int, ifnames: Sequence[str],
                      link_rate_bps: int, measured_bps: int | None = None,
                      ina_switch: str | None = None) -> list[dict[str, str]]:
    """The environment of every rank (index = rank).

    Everything ``Topology.from_env()`` and torch's ``env://`` rendezvous need: ``RANK``,
    ``WORLD_SIZE``, ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``, ``MASTER_ADDR``/``MASTER_PORT`` (node 0),
    ``GLOO_SOCKET_IFNAME`` (the node's veth: gloo then binds the node address, so intra-node pairs
    go over local routing and inter-node pairs over the shaped link), ``COMMOPT_NODES`` (so
    interleaved placement is expressible), ``COMMOPT_LINK_RATE_BPS`` and, when probed,
    ``COMMOPT_LINK_MEASURED_BPS``; ``COMMOPT_INA_SWITCH`` with a switch node. Values inherited from
    ``base_env`` for these names are replaced or removed, so an outer launcher cannot leak in.
    ``PYTHONUNBUFFERED=1`` is defaulted so prefixed output arrives line by line, not at exit.

    Args:
        layout: ``layout[node]`` = ranks of that node.
        base_env: the environment to start from (the CLI passes ``os.environ``).
        master_addr: node 0's address inside the fabric.
        master_port: the rendezvous port on node 0.
        ifnames: the veth name of every node inside its namespace.
        link_rate_bps: the configured per-node link rate.
        measured_bps: the probed rate, or None when not probed.
        ina_switch: ``"host:port"`` of the in-network aggregation switch, or None.

    Returns:
        One environment per rank.
    """
    world = sum(len(node) for node in layout)
    ranks = sorted(r for node in layout for r in node)
    if ranks != list(range(world)):
        raise ValueError(f"layout {format_layout(layout)!r} must hold every rank 0..{world - 1} once")
    nodes_text = format_layout(layout)
    envs: list[dict[str, str]] = [{} for _ in range(world)]
    for node, node_ranks in enumerate(layout):
        for local, rank in enumerate(node_ranks):
            env = dict(base_env)
            for stale in ("COMMOPT_LINK_MEASURED_BPS", "COMMOPT_INA_SWITCH", "GROUP_RANK",
                          "LOCAL_RANK", "LOCAL_WORLD_SIZE"):
                env.pop(stale, None)
            env.update({
                "RANK": str(rank),
                "WORLD_SIZE": str(world),
                "LOCAL_RANK": str(local),
                "LOCAL_WORLD_SIZE": str(len(node_ranks)),
                "MASTER_ADDR": master_addr,
                "MASTER_PORT": str(master_port),
                "GLOO_SOCKET_IFNAME": ifnames[node],
                "COMMOPT_NODES": nodes_text,
                "COMMOPT_LINK_RATE_BPS": str(int(link_rate_bps)),
            })
            if measured_bps is not None:
                env["COMMOPT_LINK_MEASURED_BPS"] = str(int(measured_bps))
            if ina_switch is not None:
                env["COMMOPT_INA_SWITCH"] = ina_switch
            env.setdefault("PYTHONUNBUFFERED", "1")
            envs[rank] = env
    return envs


def parse_cap_eff(status_text: str) -> int:
    """The effective capability mask from the text of ``/proc/<pid>/status`` (0 when absent)."""
    for line in status_text.splitlines():
        if line.startswith("CapEff:"):
            return int(line.split(":", 1)[1].strip(), 16)
    return 0


def missing_requirements(cap_eff: int, ip_path: str | None, tc_path: str | None) -> list[str]:
    """What this process lacks to build the cluster, each item saying how to get it.

    Takes its inputs instead of reading them so that a test can feed a fake capability set.

    Args:
        cap_eff: the effective capability mask (``CapEff`` of ``/proc/self/status``).
        ip_path: path of iproute2's ``ip``, or None when not found.
        tc_path: path of iproute2's ``tc``, or None when not found.

    Returns:
        Human-readable lines; empty when everything is there.
    """
    missing = []
    how = ("run as root (sudo commopt-bench cluster ...) or in a container started with "
           "--cap-add NET_ADMIN --cap-add SYS_ADMIN (or --privileged)")
    if not cap_eff >> CAP_NET_ADMIN & 1:
        missing.append(f"capability CAP_NET_ADMIN (to create veth pairs, a bridge and tc qdiscs): {how}")
    if not cap_eff >> CAP_SYS_ADMIN & 1:
        missing.append(f"capability CAP_SYS_ADMIN (`ip netns add` mounts /run/netns): {how}")
    for tool, path in (("ip", ip_path), ("tc", tc_path)):
        if path is None:
            missing.append(f"the `{tool}` command of iproute2: install it (apt-get install iproute2, "
                           f"dnf install iproute, apk add iproute2)")
    return missing


def check_requirements(cap_eff: int, ip_path: str | None, tc_path: str | None) -> None:
    """Raise :class:`ClusterError` listing everything :func:`missing_requirements` finds."""
    missing = missing_requirements(cap_eff, ip_path, tc_path)
    if missing:
        raise ClusterError("commopt-bench cluster needs network namespaces and tc, but this process "
                           "lacks:\n  - " + "\n  - ".join(missing))


def leftover_prefixes(names: Iterable[str], launcher_alive: Callable[[int, int], bool]) -> list[str]:
    """Run prefixes among namespace names whose launcher is gone.

    A prefix encodes the launcher's pid *and* its start time, so a recycled pid is recognised as a
    different process and its leftovers are still collected; namespaces of a live launcher (another
    run in progress) are never touched.

    Args:
        names: namespace names (``ip netns list``).
        launcher_alive: ``launcher_alive(pid, start_ticks)`` is True when that process still runs.

    Returns:
        Sorted prefixes to remove.
    """
    found = {}
    for name in names:
        match = _PREFIX_RE.match(name)
        if match:
            found[match.group(1)] = (int(match.group(2), 16), int(match.group(3), 16))
    return sorted(p for p, (pid, start) in found.items() if not launcher_alive(pid, start))


def _process_start_ticks(pid: int) -> int | None:
    """Start time of a process in clock ticks since boot (field 22 of /proc/pid/stat), or None."""
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii", errors="replace") as f:
            stat = f.read()
    except OSError:
        return None
    # The command name (field 2) may hold spaces and parentheses: split after the last ')'.
    return int(stat.rsplit(")", 1)[1].split()[19])


def _launcher_alive(pid: int, start_ticks: int) -> bool:
    return _process_start_ticks(pid) == start_ticks


def _pdeathsig() -> Callable[[], None]:
    """A ``preexec_fn`` making the child die with SIGKILL when the launcher dies (even by SIGKILL).

    The ctypes lookup happens here, in the parent: the child then only makes one libc call
    before exec, which is safe even though it runs between fork and exec.
    """
    prctl = ctypes.CDLL(None, use_errno=True).prctl
    pr_set_pdeathsig = 1

    def _set() -> None:
        prctl(pr_set_pdeathsig, int(signal.SIGKILL), 0, 0, 0)

    return _set


# --------------------------------------------------------------------------------------------------
# The link probe

# Run with ``python -c`` inside a node namespace, so it needs nothing but the standard library.
# argv: ADDR SECONDS. Prints "port P", reads "HOST PORT" (the next node) from stdin, then receives
# from the previous node while sending to the next for SECONDS, and prints one JSON line. Binds to
# the namespace address only (FAULTS row 29).
_PROBE_AGENT = r"""
import json, socket, sys, threading, time
addr, seconds = sys.argv[1], float(sys.argv[2])
srv = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
srv.bind((addr, 0))
srv.listen(1)
srv.settimeout(seconds + 10)
print("port", srv.getsockname()[1], flush=True)
host, port = sys.stdin.readline().split()
rx = {}
def receive():
    conn, _ = srv.accept()
    conn.settimeout(seconds + 10)
    samples, total = [], 0
    with conn:
        while True:
            data = conn.recv(1 << 20)
            if not data:
                break
            total += len(data)
            samples.append((time.monotonic(), total))
    if len(samples) < 2:
        rx.update(bytes=total, bps=0.0)
        return
    t0, t1 = samples[0][0], samples[-1][0]
    # Skip the first quarter: tbf's initial burst and TCP's slow start are not the steady rate.
    warm = t0 + 0.25 * (t1 - t0)
    tw, bw = next(s for s in samples if s[0] >= warm)
    if t1 - tw > 0.05:
        bps = (total - bw) * 8 / (t1 - tw)
    else:
        bps = total * 8 / max(t1 - t0, 1e-9)
    rx.update(bytes=total, bps=bps)
thread = threading.Thread(target=receive)
thread.start()
out = socket.create_connection((host, int(port)), timeout=seconds + 10)
chunk = b"\0" * 65536
sent, deadline = 0, time.monotonic() + seconds
while time.monotonic() < deadline:
    out.sendall(chunk)
    sent += len(chunk)
out.shutdown(socket.SHUT_WR)
out.close()
thread.join(seconds + 15)
print(json.dumps({"tx_bytes": sent, "rx_bytes": rx.get("bytes", 0), "rx_bps": rx.get("bps", 0.0)}),
      flush=True)
"""


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


def _read_line(proc: subprocess.Popen, deadline: float, what: str) -> bytes:
    """One line from an unbuffered binary stdout pipe, failing at ``deadline`` instead of hanging."""
    fd = proc.stdout.fileno()
    buf = b""
    while not buf.endswith(b"\n"):
        left = deadline - time.monotonic()
        if left <= 0:
            raise ClusterError(f"{what}: no answer in time")
        ready, _, _ = select.select([fd], [], [], left)
        if ready:
            data = os.read(fd, 4096)
            if not data:
                raise ClusterError(f"{what}: exited (code {proc.wait()}) before answering; "
                                   f"output: {buf.decode(errors='replace')!r}")
            buf += data
    return buf


# --------------------------------------------------------------------------------------------------
# The cluster


class Cluster:
    """The namespaces, links and processes of one emulated cluster.

    Use as a context manager (or call :meth:`up` and, always, :meth:`down`)::

        with Cluster(2, 200_000_000) as cluster:
            probe = cluster.probe(1.0)
            proc = cluster.spawn(0, ["python", "-c", "print('hi')"], env)

    Args:
        nodes: number of node namespaces.
        link_rate_bps: the rate of each node's link, in both directions.
        switch_node: add the switch namespace, linked at ``nodes`` x the node rate (a real switch has
            one port per node, each as fast as that node's NIC).
        delay_ms: one-way delay per shaped link end; needs netem, which is detected, never assumed.
        ip: path of ``ip``.
        tc: path of ``tc``.
        tag: 4 hex digits that tell apart clusters of one process (random by default).
        shield: a context manager factory that defers interrupts; every ``ip``/``tc`` command and
            every process start runs inside it. An exception raised in the middle of ``Popen``
            leaves its child running untracked (an ``ip netns add`` finishing after the teardown
            looked, a rank nobody kills), so the CLI's signal handlers wait for these to finish.
    """

    def __init__(self, nodes: int, link_rate_bps: int, *, switch_node: bool = False,
                 delay_ms: float = 0.0, ip: str = "ip", tc: str = "tc", tag: str | None = None,
                 shield: Callable[[], AbstractContextManager] = contextlib.nullcontext):
        if not 1 <= nodes <= _MAX_NODES:
            raise ValueError(f"nodes must be in 1..{_MAX_NODES}, got {nodes}")
        if link_rate_bps <= 0:
            raise ValueError(f"link rate must be positive, got {link_rate_bps}")
        self.nodes = nodes
        self.link_rate_bps = int(link_rate_bps)
        self.switch_node = switch_node
        self.delay_ms = float(delay_ms)
        self._ip, self._tc = ip, tc
        self._shield = shield
        pid = os.getpid()
        start = _process_start_ticks(pid) or 0
        tag = tag if tag is not None else secrets.token_hex(2)
        if not re.fullmatch(r"[0-9a-f]{4}", tag):
            raise ValueError(f"tag must be 4 lowercase hex digits, got {tag!r}")
        #: Every namespace of this run starts with it; --cleanup finds leftovers by it.
        self.prefix = f"co-{pid:x}-{start:x}-{tag}"
        self.fabric = f"{self.prefix}-fab"
        self.node_namespaces = [f"{self.prefix}-n{i}" for i in range(nodes)]
        self.switch_namespace = f"{self.prefix}-sw" if switch_node else None
        self.switch_address = f"{_SUBNET}.{_SWITCH_HOST}" if switch_node else None
        self._created: list[str] = []
        self._procs: list[subprocess.Popen] = []

    # ---- addressing

    def node_address(self, node: int) -> str:
        """Node ``node``'s address; it exists only inside this cluster's namespaces."""
        return f"{_SUBNET}.{node + 1}"

    def ifname(self, node: int) -> str:
        """Node ``node``'s veth, as seen inside its namespace (``GLOO_SOCKET_IFNAME``)."""
        return f"cn{node}"

    def netns_argv(self, namespace: str, argv: Sequence[str]) -> list[str]:
        """``argv`` run inside ``namespace`` (``ip netns exec`` execs it: the pid stays the same)."""
        return [self._ip, "netns", "exec", namespace, *argv]

    # ---- lifecycle

    def __enter__(self) -> Cluster:
        try:
            self.up()
        except BaseException:
            self.down()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.down()

    def up(self) -> None:
        """Create the namespaces, the bridge and the shaped links (the caller must call down()).

        Commands go in one ``ip -batch`` / ``tc -batch`` per namespace and step: each ``ip`` start
        costs tens of ms on a busy 2-core machine, and a 2-node cluster needs about 25 commands.
        """
        namespaces = [self.fabric, *self.node_namespaces]
        # (namespace, its interface, its fabric-side port, address, rate)
        links = [(ns, self.ifname(n), f"cf{n}", self.node_address(n), self.link_rate_bps)
                 for n, ns in enumerate(self.node_namespaces)]
        if self.switch_node:
            namespaces.append(self.switch_namespace)
            links.append((self.switch_namespace, "cnsw", "cfsw", self.switch_address,
                          self.link_rate_bps * self.nodes))
        self._created += namespaces  # first: a signal right after the add must not leak one
        self._batch([self._ip], [f"netns add {ns}" for ns in namespaces])
        # The pairs are created inside the fabric, each peer straight in its namespace: no
        # interface ever appears in the host's root namespace.
        fabric = ["link add cbr0 type bridge", "link set cbr0 up"]
        for ns, inner, outer, _, _ in links:
            fabric += [f"link add {outer} type veth peer name {inner} netns {ns}",
                       f"link set {outer} master cbr0", f"link set {outer} up"]
        self._batch([self._ip, "-n", self.fabric], fabric)
        for ns, inner, _, address, _ in links:
            # No IPv6 link-local address: gloo takes the interface's first address; it must be ours.
            self._batch([self._ip, "-n", ns], [f"link set {inner} addrgenmode none",
                                               f"addr add {address}/24 dev {inner}",
                                               f"link set {inner} up", "link set lo up"])
        # Both ends: the node's side shapes what it sends, the fabric's side what it receives.
        self._shape(self.fabric, [(outer, rate) for _, _, outer, _, rate in links])
        for ns, inner, _, _, rate in links:
            self._shape(ns, [(inner, rate)])

    def _shape(self, ns: str, devices: list[tuple[str, int]]) -> None:
        """tbf at ``rate`` on each ``(device, rate)`` of ``ns``; netem below it with --delay."""
        # burst: more than one GSO super-packet, and ~4 ms of traffic at high rates so the bucket
        # never starves the sender between timer ticks. latency bounds the queue (drops beyond it
        # are TCP's business, as on a real switch port).
        lines = [f"qdisc add dev {dev} root handle 1: tbf rate {rate}bit "
                 f"burst {max(_MIN_BURST_BYTES, rate // 8 // 250)} latency 25ms"
                 for dev, rate in devices]
        try:
            self._batch([self._tc, "-n", ns], lines)
        except ClusterError as e:
            raise ClusterError(f"{e}\nThe kernel needs the tbf qdisc (CONFIG_NET_SCH_TBF, "
                               f"module sch_tbf).") from None
        if self.delay_ms > 0:
            try:
                self._batch([self._tc, "-n", ns],
                            [f"qdisc add dev {dev} parent 1:1 handle 10: netem delay {self.delay_ms}ms"
                             for dev, _ in devices])
            except ClusterError as e:
                raise ClusterError(f"--delay needs the netem qdisc, which this kernel lacks "
                                   f"(CONFIG_NET_SCH_NETEM, module sch_netem): {e}\n"
                                   f"Run without --delay; nothing else depends on netem.") from None

    def down(self) -> None:
        """Kill every process started here and in the namespaces, then delete the namespaces.

        Safe to call twice and after a partial :meth:`up`. Goes on past a failure, so that one
        stuck namespace does not leave the others behind, and raises all failures at the end.
        """
        _terminate(self._procs)
        for proc in self._procs:
            _close_pipes(proc)
        self._procs.clear()
        errors = _remove_namespaces(self._ip, list(reversed(self._created)))
        self._created.clear()
        if errors:
            raise ClusterError("teardown incomplete: " + "; ".join(errors))

    # ---- processes

    def spawn(self, node: int | str, argv: Sequence[str], env: dict[str, str] | None = None, *,
              stdin: int | None = subprocess.DEVNULL, stdout: int | None = subprocess.PIPE,
              stderr: int | None = subprocess.PIPE) -> subprocess.Popen:
        """Start ``argv`` inside node ``node``'s namespace (or the namespace named ``node``).

        The process gets its own session (so it and its children are killed as a group) and dies
        with the launcher even when the launcher is SIGKILLed. Pipes are unbuffered binary.

        Call spawn from the main thread (the death signal fires when the *thread* that spawned the
        process ends), and before starting threads that write to the launcher's own streams (the
        death-signal setup runs between fork and exec, where another thread's lock would deadlock).
        """
        ns = self.node_namespaces[node] if isinstance(node, int) else node
        with self._shield():
            proc = subprocess.Popen(self.netns_argv(ns, argv), env=env, stdin=stdin, stdout=stdout,
                                    stderr=stderr, bufsize=0, start_new_session=True,
                                    preexec_fn=_pdeathsig())
            self._procs.append(proc)
        return proc

    def probe(self, seconds: float = 1.0) -> LinkProbe:
        """Measure each link's achieved rate with a socket transfer around the ring of nodes.

        Node i sends to node (i+1) % N while receiving from node i-1, all at once, so in about
        ``seconds`` every link is crossed in both directions (each direction has its own shaper).
        Needs at least 2 nodes.
        """
        if self.nodes < 2:
            raise ClusterError("the link probe needs at least 2 nodes")
        agents = [self.spawn(n, [sys.executable, "-c", _PROBE_AGENT, self.node_address(n),
                                 str(seconds)], stdin=subprocess.PIPE, stderr=subprocess.PIPE)
                  for n in range(self.nodes)]
        try:
            deadline = time.monotonic() + _CMD_TIMEOUT_S
            ports = [int(_read_line(a, deadline, f"link probe on node {n}").split()[1])
                     for n, a in enumerate(agents)]
            for n, agent in enumerate(agents):
                nxt = (n + 1) % self.nodes
                agent.stdin.write(f"{self.node_address(nxt)} {ports[nxt]}\n".encode())
                agent.stdin.close()
                agent.stdin = None  # communicate() below must not flush the closed pipe
            links = []
            for n, agent in enumerate(agents):
                out, err = agent.communicate(timeout=seconds + _CMD_TIMEOUT_S)
                if agent.returncode != 0:
                    raise ClusterError(f"link probe on node {n} failed (code {agent.returncode}): "
                                       f"{err.decode(errors='replace').strip()}")
                result = json.loads(out.decode().strip().splitlines()[-1])
                prev = (n - 1) % self.nodes
                links.append((f"n{prev}->n{n}", float(result["rx_bps"])))
        except subprocess.TimeoutExpired:
            raise ClusterError(f"link probe did not finish within {seconds + _CMD_TIMEOUT_S:.0f} s") from None
        finally:
            _terminate(agents)
            for agent in agents:
                _close_pipes(agent)
                self._procs.remove(agent)
        if min(rate for _, rate in links) <= 0:
            raise ClusterError(f"link probe moved no data: {links}")
        return LinkProbe(self.link_rate_bps, links, seconds)

    def start_switch(self, argv: Sequence[str], env: dict[str, str] | None = None, *,
                     timeout: float = 60.0, out: IO[bytes] | None = None) -> subprocess.Popen:
        """Start the in-network aggregation switch in the switch namespace and wait until it listens.

        Args:
            argv: the switch command; it must print a line containing ``listening on``.
            env: its environment.
            timeout: seconds to wait for that line (a cold torch import on 2 busy cores is slow).
            out: where its output up to readiness goes, prefixed ``[switch]``.

        Returns:
            The running process; :meth:`down` stops it. Its later output is the caller's to read
            (``run_ranks(..., extra_streams=...)``), since no thread may exist while ranks are
            spawned (see :meth:`spawn`).
        """
        if self.switch_namespace is None:
            raise ClusterError("start_switch needs Cluster(..., switch_node=True)")
        proc = self.spawn(self.switch_namespace, argv, env, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + timeout
        while True:
            line = _read_line(proc, deadline, f"switch {' '.join(argv)!r}")
            if out is not None:
                out.write(b"[switch] " + line)
                out.flush()
            if b"listening on" in line:
                return proc

    def _batch(self, argv: list[str], lines: list[str]) -> None:
        """Run ``lines`` through ``argv -batch -``; it stops at the first failing line."""
        script = "".join(line + "\n" for line in lines)
        try:
            with self._shield():
                res = subprocess.run([*argv, "-batch", "-"], input=script, capture_output=True,
                                     text=True, timeout=_CMD_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            raise ClusterError(f"`{' '.join(argv)} -batch` did not finish in {_CMD_TIMEOUT_S} s") from None
        if res.returncode != 0:
            raise ClusterError(f"`{' '.join(argv)} -batch -` failed (code {res.returncode}) on\n"
                               f"{script}{res.stderr.strip()}")


def _terminate(procs: Sequence[subprocess.Popen], grace: float = _KILL_GRACE_S) -> None:
    """SIGTERM every live process group, SIGKILL what is left after ``grace`` seconds, reap all."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        live = [p for p in procs if p.poll() is None]
        for p in live:
            try:
                os.killpg(p.pid, sig)  # own session: the group id is the pid
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + (grace if sig == signal.SIGTERM else 10.0)
        while any(p.poll() is None for p in live) and time.monotonic() < deadline:
            time.sleep(0.02)


def _close_pipes(proc: subprocess.Popen) -> None:
    for stream in (proc.stdin, proc.stdout, proc.stderr):
        if stream is not None:
            try:
                stream.close()
            except OSError:
                pass


def _ns_pids(namespaces: Iterable[str]) -> list[int]:
    """Pids of the processes inside any of the named namespaces.

    What ``ip netns pids`` does (compare the device and inode of ``/proc/<pid>/ns/net`` with
    the namespace's bind mount), for all namespaces in one pass instead of one ``ip`` per namespace.
    """
    wanted = set()
    for ns in namespaces:
        try:
            st = os.stat(os.path.join(_NETNS_DIR, ns))
        except OSError:
            continue
        wanted.add((st.st_dev, st.st_ino))
    pids = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                st = os.stat(f"/proc/{entry}/ns/net")
            except OSError:  # gone meanwhile, or a kernel thread
                continue
            if (st.st_dev, st.st_ino) in wanted:
                pids.append(int(entry))
    return pids


def _remove_namespaces(ip: str, namespaces: Sequence[str]) -> list[str]:
    """Kill whatever still runs in the namespaces, then delete them; returns the errors."""
    existing = set(list_namespaces(ip))
    targets = [ns for ns in namespaces if ns in existing]
    if not targets:
        return []
    for _ in range(100):  # a dying process can still be listed for a moment
        pids = _ns_pids(targets)
        if not pids:
            break
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        time.sleep(0.02)
    script = "".join(f"netns del {ns}\n" for ns in targets)
    try:
        # -force: go on past a failing line, so one stuck namespace does not keep the others.
        res = subprocess.run([ip, "-force", "-batch", "-"], input=script, capture_output=True,
                             text=True, timeout=_CMD_TIMEOUT_S)
    except (OSError, subprocess.SubprocessError) as e:
        return [f"ip netns del: {e}"]
    left = sorted(set(targets) & set(list_namespaces(ip)))
    return [f"ip netns del {ns}: {res.stderr.strip()}" for ns in left]


def list_namespaces(ip: str = "ip") -> list[str]:
    """Names from ``ip netns list`` (each line is ``NAME`` or ``NAME (id: K)``)."""
    res = subprocess.run([ip, "netns", "list"], capture_output=True, text=True, timeout=_CMD_TIMEOUT_S)
    return [line.split()[0] for line in res.stdout.splitlines() if line.strip()]


def cleanup_leftovers(ip: str = "ip") -> list[str]:
    """Remove the namespaces (and their processes) of clusters whose launcher is gone.

    This is what ``--cleanup`` does after a launcher was killed with SIGKILL, the one death that
    leaves no chance to tear down. Clusters of launchers still running are left alone.

    Returns:
        The namespaces removed.
    """
    names = list_namespaces(ip)
    removed = []
    errors = []
    for prefix in leftover_prefixes(names, _launcher_alive):
        mine = [n for n in names if n.startswith(prefix + "-")]
        # Nodes before the fabric, the reverse of creation order.
        mine.sort(key=lambda n: n.endswith("-fab"))
        errors += _remove_namespaces(ip, mine)
        removed += mine
    if errors:
        raise ClusterError("cleanup incomplete: " + "; ".join(errors))
    return removed


# --------------------------------------------------------------------------------------------------
# Running the ranks


class _Console:
    """The launcher's own streams, shared by the threads that copy the ranks' output to them.

    Where a stream is a terminal, the line a rank keeps redrawing with carriage returns (its progress
    bar: ``COMMOPT_PROGRESS=1``, see ``commopt.bench._progress``) is redrawn in place, prefixed, as
    each redraw arrives; a whole line from any rank clears it first and draws it again afterwards,
    so bars and lines never mix on one row. A stream whose reader went away (``| head``) is
    written no more; the ranks' pipes are still drained, so no rank stalls on a full pipe.
    """

    _CLEAR = b"\r\x1b[K"  # to the start of the row, erase it

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._bar: tuple[IO[bytes], bytes] | None = None  # (stream, row) redrawn in place now
        self.closed: set[int] = set()  # id() of the streams that failed

    def line(self, out: IO[bytes], data: bytes) -> None:
        """Write one whole line (``data`` ends with a newline) to ``out``."""
        with self._lock:
            bar = self._bar
            if bar is not None:
                self._write(bar[0], self._CLEAR)
            self._write(out, data)
            if bar is not None:
                self._write(bar[0], self._CLEAR + bar[1])

    def redraw(self, out: IO[bytes], row: bytes | None) -> None:
        """Draw ``row`` in place of the bar on ``out``; None erases the bar."""
        with self._lock:
            self._write(out, self._CLEAR + (row or b""))
            self._bar = (out, row) if row else None

    def _write(self, out: IO[bytes], data: bytes) -> None:
        if id(out) in self.closed:
            return
        try:
            out.write(data)
            out.flush()
        except (BrokenPipeError, ValueError):
            self.closed.add(id(out))  # the launcher's reader went away; the rank must not stall


def _is_terminal(stream: IO[bytes] | None) -> bool:
    try:
        return stream is not None and stream.isatty()
    except (AttributeError, ValueError, OSError):
        return False


def _last_row(text: bytes) -> bytes:
    """What a terminal shows of ``text`` redrawn with carriage returns: its last non-blank part."""
    parts = [p for p in text.split(b"\r") if p.strip()]
    return parts[-1] if parts else b""


def _pump(stream: IO[bytes], out: IO[bytes] | None, prefix: bytes, console: _Console) -> None:
    """Copy ``stream`` to ``out`` line by line, each line prefixed (a rank's stdout or stderr).

    Where ``out`` is a terminal, a row the rank redraws with carriage returns is shown as it is
    redrawn (see :class:`_Console`); elsewhere lines are copied as they are, carriage returns and all.
    """
    live = _is_terminal(out)
    read = getattr(stream, "read1", None) or stream.read  # whatever the pipe holds, up to 64 KiB
    pending = b""
    drawn = False  # this stream's bar is on the terminal
    with stream:
        while True:
            data = read(65536)
            if not data:
                break
            if out is None or id(out) in console.closed:
                continue  # keep draining: a full pipe would block the rank
            pending += data
            *lines, pending = pending.split(b"\n")
            for line in lines:
                if drawn:
                    console.redraw(out, None)
                    drawn = False
                console.line(out, prefix + (_last_row(line) if live and b"\r" in line else line) + b"\n")
            if live and b"\r" in pending:
                # Keep only the row being drawn: a bar that never ends a line must not pile up here.
                pending = pending[pending.rindex(b"\r"):]
                row = _last_row(pending)
                console.redraw(out, prefix + row if row else None)
                drawn = bool(row)
        if out is not None:
            if drawn:
                console.redraw(out, None)
            if live and b"\r" in pending:
                pending = _last_row(pending)
            if pending:
                console.line(out, prefix + pending + b"\n")


def run_ranks(cluster: Cluster, layout: Sequence[Sequence[int]], command: Sequence[str],
              envs: Sequence[dict[str, str]], *, timeout: float | None = None,
              stdout: IO[bytes] | None = None, stderr: IO[bytes] | None = None,
              extra_streams: Sequence[tuple[IO[bytes], IO[bytes] | None, bytes]] = (),
              poll_interval: float = 0.05) -> int:
    """Run ``command`` once per rank in its node's namespace and wait for all of them.

    Output lines are prefixed ``[rank k]`` (stdout to ``stdout``, stderr to ``stderr``; on a
    terminal, a rank's progress bar is redrawn in place, see :class:`_Console`). When a
    rank fails, the others are killed (a collective would otherwise wait forever for it) and the
    first failure's code is returned; a rank killed by signal S counts as 128 + S. An exception
    raised into this function (KeyboardInterrupt from a signal handler) kills all ranks first.

    Args:
        cluster: a cluster that is up.
        layout: ``layout[node]`` = ranks of that node.
        command: the argv every rank runs.
        envs: ``envs[rank]`` (see :func:`rank_environments`).
        timeout: seconds after which all ranks are killed and 124 is returned (None: no limit).
        stdout: the launcher's binary stdout.
        stderr: the launcher's binary stderr.
        extra_streams: more ``(stream, out, prefix)`` to copy while the ranks run, e.g. the
            switch's output (started here, after the ranks are spawned; see Cluster.spawn).
        poll_interval: seconds between checks of the ranks.

    Returns:
        0 when every rank succeeded, else the first failing rank's code (124 on timeout).
    """
    node_of = {rank: node for node, ranks in enumerate(layout) for rank in ranks}
    procs: list[subprocess.Popen] = []
    threads: list[threading.Thread] = []
    console = _Console()
    try:
        # Spawn all before any output thread exists (see Cluster.spawn).
        for rank in range(len(envs)):
            procs.append(cluster.spawn(node_of[rank], command, envs[rank]))
        pumps = [(stream, out, f"[rank {rank}] ".encode()) for rank, proc in enumerate(procs)
                 for stream, out in ((proc.stdout, stdout), (proc.stderr, stderr))]
        for stream, out, prefix in pumps + list(extra_streams):
            thread = threading.Thread(target=_pump, args=(stream, out, prefix, console), daemon=True)
            thread.start()
            threads.append(thread)
        deadline = None if timeout is None else time.monotonic() + timeout
        result = 0
        while True:
            codes = [p.poll() for p in procs]
            failed = [(r, c) for r, c in enumerate(codes) if c not in (None, 0)]
            if failed:
                rank, code = failed[0]
                result = code if code > 0 else 128 - code
                how = f"code {code}" if code > 0 else f"{signal.Signals(-code).name} (code {result})"
                _note(stderr, f"rank {rank} exited with {how}; killing the other ranks")
                break
            if all(c == 0 for c in codes):
                break
            if deadline is not None and time.monotonic() > deadline:
                _note(stderr, f"timeout after {timeout} s; killing all ranks")
                result = 124
                break
            time.sleep(poll_interval)
        return result
    finally:
        _terminate(procs)
        for thread in threads[: 2 * len(procs)]:  # extra streams end only when their process does
            thread.join(timeout=2.0)
        for proc in procs:
            _close_pipes(proc)
            cluster._procs.remove(proc)


def _note(stream: IO[bytes] | None, text: str) -> None:
    if stream is not None:
        stream.write(f"[cluster] {text}\n".encode())
        stream.flush()


# --------------------------------------------------------------------------------------------------
# CLI


class _Interrupted(BaseException):
    """Raised by the signal handlers so that every ``finally`` on the way out runs."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


def _build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="commopt-bench cluster",
        usage="commopt-bench cluster --nodes N --ranks-per-node L --link-rate RATE [options] "
              "-- COMMAND...\n       commopt-bench cluster --cleanup",
        description="Emulate N nodes on this machine: one network namespace per node joined to a star "
                    "fabric by a tbf-shaped link, loopback inside a node; run COMMAND once per rank "
                    "inside its node, with RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR, "
                    "MASTER_PORT, GLOO_SOCKET_IFNAME, COMMOPT_NODES, COMMOPT_LINK_RATE_BPS and "
                    "COMMOPT_LINK_MEASURED_BPS set (and COMMOPT_PROGRESS=1 when this stderr is a "
                    "terminal: rank 0's progress bar is redrawn there). Needs root (CAP_NET_ADMIN, "
                    "CAP_SYS_ADMIN) and iproute2. Returns the first failing rank's exit code.")
    parser.add_argument("--nodes", type=int, help="number of nodes N")
    parser.add_argument("--ranks-per-node", type=int, default=1, help="ranks per node L (default 1)")
    parser.add_argument("--link-rate", default="1gbit",
                        help="rate of each node's link, each direction, in tc units: 200mbit, 1gbit "
                             "(bps/kbps/mbps are BYTES per second, as in tc). Default 1gbit")
    parser.add_argument("--placement", choices=("contiguous", "interleaved"), default="contiguous",
                        help="contiguous: ranks node by node (0,1;2,3); interleaved: rank r on node "
                             "r %% N (0,2;1,3), the pathological placement")
    parser.add_argument("--switch-node", action="store_true",
                        help="add a switch namespace whose link to the fabric is shaped at N x the node "
                             "rate (a real switch has one NIC-speed port per node); run `commopt-bench "
                             "ina-switch` in it and export COMMOPT_INA_SWITCH=host:port")
    parser.add_argument("--probe-seconds", type=float, default=1.0,
                        help="duration of the link-rate probe before the run (0 skips it); default 1. "
                             "It reports TCP goodput, about 4.5%% below the configured rate on a "
                             "perfect link (tbf counts the headers), and exports it as "
                             "COMMOPT_LINK_MEASURED_BPS")
    parser.add_argument("--strict", action="store_true",
                        help="refuse to run when the probed rate is more than 15%% off the configured one")
    parser.add_argument("--delay", type=float, default=0.0, metavar="MS",
                        help="delay in ms added at each shaped link end (a node-to-node packet crosses "
                             "two ends); needs the netem qdisc, which is detected: the kernels we "
                             "target lack it, so this fails clearly there")
    parser.add_argument("--timeout", type=float, default=None, metavar="S",
                        help="kill all ranks after S seconds and return 124")
    parser.add_argument("--record", metavar="FILE",
                        help="append the cluster/probe JSON record to FILE (it is also printed)")
    parser.add_argument("--cleanup", action="store_true",
                        help="remove namespaces and processes left by launchers that died (SIGKILL), "
                             "then exit; clusters of running launchers are left alone")
    return parser


class _Interrupts:
    """SIGINT/SIGTERM/SIGHUP handling: raise :class:`_Interrupted`, except inside :meth:`shield`.

    Inside a shield (a process start, an ``ip`` command: milliseconds) the signal is remembered
    and raised when the outermost shield exits, once what was started is tracked for teardown.
    """

    def __init__(self):
        self._depth = 0
        self._pending: int | None = None

    def handler(self, signum: int, frame: object) -> None:
        if self._depth:
            self._pending = self._pending or signum
            return
        raise _Interrupted(signum)

    @contextlib.contextmanager
    def shield(self) -> Iterator[None]:
        self._depth += 1
        try:
            yield
        finally:
            self._depth -= 1
            if not self._depth and self._pending is not None:
                signum, self._pending = self._pending, None
                raise _Interrupted(signum)


def main(argv: list[str]) -> int:
    """Entry point of ``commopt-bench cluster``; see ``--help``.

    Returns:
        0, the first failing rank's exit code, 124 on --timeout, 128 + signal when interrupted,
        2 for usage errors, 3 when the cluster cannot be built or --strict refuses the link.
    """
    argv = list(argv)
    command: list[str] = []
    if "--" in argv:
        cut = argv.index("--")
        argv, command = argv[:cut], argv[cut + 1:]
    parser = _build_parser()
    args = parser.parse_args(argv)
    err = sys.stderr.buffer
    # Usage first, so that a typo is reported as such even without privileges.
    if not args.cleanup:
        if args.nodes is None or not command:
            parser.print_usage(sys.stderr)
            return _fail("--nodes and a COMMAND after `--` are required", 2)
        try:
            rate = parse_rate(args.link_rate)
            layout = place_ranks(args.nodes, args.ranks_per_node, args.placement)
            if not 1 <= args.nodes <= _MAX_NODES:
                raise ValueError(f"--nodes must be in 1..{_MAX_NODES}, got {args.nodes}")
            if args.delay < 0 or args.probe_seconds < 0:
                raise ValueError("--delay and --probe-seconds must not be negative")
        except ValueError as e:
            return _fail(str(e), 2)
        if args.switch_node and importlib.util.find_spec("commopt.bench.ina_switch") is None:
            return _fail("--switch-node runs `commopt-bench ina-switch`, which this installation "
                         "does not have yet (commopt.bench.ina_switch is missing)", 3)
    ip, tc = shutil.which("ip"), shutil.which("tc")
    try:
        with open("/proc/self/status", encoding="ascii") as f:
            cap_eff = parse_cap_eff(f.read())
    except OSError:
        cap_eff = 0
    try:
        check_requirements(cap_eff, ip, tc)
    except ClusterError as e:
        return _fail(str(e), 3)

    if args.cleanup:
        try:
            removed = cleanup_leftovers(ip)
        except ClusterError as e:
            return _fail(str(e), 3)
        print(f"[cluster] removed {len(removed)} leftover namespace(s)"
              + (": " + " ".join(removed) if removed else ""), flush=True)
        return 0

    interrupts = _Interrupts()
    cluster = Cluster(args.nodes, rate, switch_node=args.switch_node, delay_ms=args.delay, ip=ip, tc=tc,
                      shield=interrupts.shield)
    old = {s: signal.signal(s, interrupts.handler) for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}
    try:
        return _run(args, cluster, layout, command, rate, err)
    except _Interrupted as e:
        _note(err, f"interrupted by {signal.Signals(e.signum).name}; tearing down")
        return 128 + e.signum
    except ClusterError as e:
        return _fail(str(e), 3)
    finally:
        # A second Ctrl-C must not cut the teardown short.
        for s in old:
            signal.signal(s, signal.SIG_IGN)
        t0 = time.monotonic()
        try:
            cluster.down()
        except ClusterError as e:
            _fail(f"{e}\nRun `commopt-bench cluster --cleanup` as root.", 3)
        _note(err, f"torn down in {time.monotonic() - t0:.2f} s")
        for s, handler in old.items():
            signal.signal(s, handler)


def _fail(message: str, code: int) -> int:
    print(f"commopt-bench cluster: error: {message}", file=sys.stderr, flush=True)
    return code


def _run(args: argparse.Namespace, cluster: Cluster, layout: list[list[int]], command: list[str],
         rate: int, err: IO[bytes]) -> int:
    """Build, probe, run (the part of main() that the teardown in main() guards)."""
    t0 = time.monotonic()
    cluster.up()
    _note(err, f"{args.nodes} node(s) x {args.ranks_per_node} rank(s), {args.placement}, link "
               f"{rate / 1e6:g} Mbit/s, layout {format_layout(layout)}, prefix {cluster.prefix}, "
               f"up in {time.monotonic() - t0:.2f} s")
    record: dict[str, object] = {"nodes": args.nodes, "ranks_per_node": args.ranks_per_node,
                                 "placement": args.placement, "layout": format_layout(layout),
                                 "link_rate_bps": rate, "switch_node": args.switch_node}
    measured = None
    if args.probe_seconds > 0 and args.nodes >= 2:
        probe = cluster.probe(args.probe_seconds)
        measured = probe.bps
        record.update(probe.to_json())
        links = ", ".join(f"{name} {bps / 1e6:.1f}" for name, bps in probe.links)
        print(f"[cluster] link probe: {measured / 1e6:.1f} Mbit/s measured vs {rate / 1e6:g} Mbit/s "
              f"configured (ratio {measured / rate:.3f}; per link, Mbit/s: {links})", flush=True)
        if probe.deviation > _WARN_DEVIATION:
            banner = "!" * 78
            print(f"{banner}\n[cluster] WARNING: the measured link rate ({measured / 1e6:.1f} Mbit/s) is "
                  f"{probe.deviation:.0%} off the configured {rate / 1e6:g} Mbit/s (> 15 %).\n"
                  f"[cluster] Figures measured in this cluster will not reflect the configured link "
                  f"(busy CPUs? try a lower --link-rate).\n{banner}", file=sys.stderr, flush=True)
            if args.strict:
                _fail("--strict: refusing to run on this link", 3)
                record["refused"] = True
                _emit_record(record, args.record)
                return 3
    elif args.nodes < 2:
        _note(err, "one node: no link to probe")
    _emit_record(record, args.record)
    ina, extra = None, []
    if args.switch_node:
        switch_argv = [sys.executable, "-m", "commopt.bench", "ina-switch", "--host",
                       str(cluster.switch_address), "--port", str(_SWITCH_PORT)]
        switch = cluster.start_switch(switch_argv, dict(os.environ), out=err)
        ina = f"{cluster.switch_address}:{_SWITCH_PORT}"
        extra.append((switch.stdout, err, b"[switch] "))
    base_env = dict(os.environ)
    if _is_terminal(err):
        # The ranks' stderr is a pipe, so their progress bars would stay off; the pumps redraw them
        # in place on this terminal (see _Console). An explicit COMMOPT_PROGRESS wins.
        base_env.setdefault("COMMOPT_PROGRESS", "1")
    envs = rank_environments(layout, base_env, master_addr=cluster.node_address(0),
                             master_port=_MASTER_PORT,
                             ifnames=[cluster.ifname(n) for n in range(args.nodes)],
                             link_rate_bps=rate, measured_bps=measured, ina_switch=ina)
    return run_ranks(cluster, layout, command, envs, timeout=args.timeout, stdout=sys.stdout.buffer,
                     stderr=err, extra_streams=extra)


def _emit_record(record: dict[str, object], path: str | None) -> None:
    line = json.dumps({"commopt_cluster": record}, sort_keys=True)
    print(line, flush=True)
    if path:
        with open(path, "a", encoding="utf-8") as f:
            f.write(line + "\n")
