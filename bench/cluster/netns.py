"""The emulated cluster's namespaces, links and processes: :class:`Cluster`.

Layout, for a run whose prefix is ``co-<launcher pid>-<launcher start time>-<tag>``::

    <prefix>-fab   the fabric: bridge ``cbr0``; port ``cf<i>`` per node, ``cfsw`` to the switch
    <prefix>-n<i>  node i: ``lo`` (intra-node traffic) and ``cn<i>`` = 10.77.0.<i+1>/24
    <prefix>-sw    with --switch-node: ``cnsw`` = 10.77.0.254/24
    <prefix>-co    with --coordinator: ``cnco`` = 10.77.0.253/24, an unshaped link (the control plane)

(1) namespaces, bridge and veth pairs are created inside the new namespaces only (the host's root
namespace is never touched, and the 10.77.0.0/24 addresses exist nowhere else); (2) tbf shapes both
ends of every node link, with a burst larger than a 64 KiB GSO super-packet (with a smaller one
tbf must segment every super-packet, or on older kernels drops it and the rate collapses); on a
6.18 kernel the probe then gets 95.5 % of the configured rate, i.e. the full rate less the
Ethernet/IP/TCP headers; (3) everything is torn down whatever happens (what a SIGKILLed launcher
left is found by its prefix: ``host.cleanup_leftovers``).

Nothing here depends on netem: the kernels we run on lack it, so ``delay_ms`` detects its absence and
says so. Nothing here reads environment variables (docs/architecture.md section 6.3).
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import re
import secrets
import signal
import subprocess
import time
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from typing import IO

from ._proc import _CMD_TIMEOUT_S, ClusterError, _close_pipes, _read_line, _terminate
from .host import _process_start_ticks, _remove_namespaces
from .probe import LinkProbe, agent_argv, exchange

__all__ = ["Cluster", "parse_rate"]

_SUBNET = "10.77.0"  # private, and it only ever exists inside this run's namespaces (docs/faults.md row 29)
_SWITCH_HOST = 254
_COORDINATOR_HOST = 253
_MAX_NODES = 200
_MIN_BURST_BYTES = 128 * 1024  # > one 64 KiB GSO super-packet, with room to spare


def parse_rate(text: str) -> int:
    """Parse a link rate such as ``"200mbit"`` or ``"1gbit"`` into bit/s, as an integer.

    The grammar is ``commopt.comm.topology.parse_rate``'s (tc's units: ``bit``/``kbit``/``mbit``/
    ``gbit``/``tbit`` are bits per second, powers of 1000; ``bps``/``kbps``/``mbps``/``gbps`` are
    *bytes* per second; a bare number is bit/s), rounded here to the one integer that both tc and the
    ranks (``COMMOPT_LINK_RATE_BPS``) get, so that they agree.

    Args:
        text: the rate as given on the command line.

    Returns:
        The rate in bit/s, a positive integer.

    Raises:
        ValueError: the text is not a positive rate.
    """
    # Imported here: commopt.comm imports torch, which importing this package (the probe agent
    # runs inside it) must not pay for.
    from commopt.comm.topology import parse_rate as bits_per_second

    value = int(round(bits_per_second(text)))
    if value <= 0:  # e.g. "0.4bit": positive, but no rate tc can shape
        raise ValueError(f"link rate must be positive, got {text!r}")
    return value


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
        coordinator: add the coordinator namespace, joined to the fabric by an *unshaped* link: it is
            the control plane (heartbeats, the membership store), which must not queue behind the
            data traffic it is there to judge, and whose bytes are not the job's to pay for.
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
                 coordinator: bool = False, delay_ms: float = 0.0, ip: str = "ip", tc: str = "tc",
                 tag: str | None = None, shield: Callable[[], AbstractContextManager] = contextlib.nullcontext):
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
        self.coordinator_namespace = f"{self.prefix}-co" if coordinator else None
        self.coordinator_address = f"{_SUBNET}.{_COORDINATOR_HOST}" if coordinator else None
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
        # (namespace, its interface, its fabric-side port, address, rate; None: unshaped)
        links = [(ns, self.ifname(n), f"cf{n}", self.node_address(n), self.link_rate_bps)
                 for n, ns in enumerate(self.node_namespaces)]
        if self.switch_node:
            namespaces.append(self.switch_namespace)
            links.append((self.switch_namespace, "cnsw", "cfsw", self.switch_address,
                          self.link_rate_bps * self.nodes))
        if self.coordinator_namespace is not None:
            namespaces.append(self.coordinator_namespace)
            links.append((self.coordinator_namespace, "cnco", "cfco", self.coordinator_address, None))
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
        self._shape(self.fabric, [(outer, rate) for _, _, outer, _, rate in links if rate is not None])
        for ns, inner, _, _, rate in links:
            if rate is not None:
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

        Call spawn from the main thread: the death signal fires when the *thread* that spawned the
        process ends. Between fork and exec the child runs only the death-signal setup, one libc call
        (:func:`_pdeathsig`), which takes no lock that another thread could hold at the fork (CPython
        re-creates the GIL, the import lock and threading's locks in the child; the output threads'
        stream and console locks are never touched there), so a restart may spawn while the output
        of the other ranks is being copied. Keep it that way: nothing else may run in the child.
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

        One probe agent per node (``commopt.bench.cluster.probe``): node i sends to node (i+1) % N
        while receiving from node i-1, all at once, so in about ``seconds`` every link is crossed
        in both directions (each direction has its own shaper). Needs at least 2 nodes.
        """
        if self.nodes < 2:
            raise ClusterError("the link probe needs at least 2 nodes")
        addresses = [self.node_address(n) for n in range(self.nodes)]
        agents = [self.spawn(n, agent_argv(addresses[n], seconds), stdin=subprocess.PIPE,
                             stderr=subprocess.PIPE) for n in range(self.nodes)]
        try:
            links = exchange(agents, addresses, seconds)
        finally:
            _terminate(agents)
            for agent in agents:
                _close_pipes(agent)
                self._procs.remove(agent)
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
            (``run_ranks(..., extra_streams=...)``): the ranks are spawned before any output thread
            starts (see :meth:`spawn`).
        """
        if self.switch_namespace is None:
            raise ClusterError("start_switch needs Cluster(..., switch_node=True)")
        return self._start_service(self.switch_namespace, argv, env, ready=b"listening on", name="switch",
                                   timeout=timeout, out=out)

    def start_coordinator(self, argv: Sequence[str], env: dict[str, str] | None = None, *,
                          timeout: float = 60.0, out: IO[bytes] | None = None) -> subprocess.Popen:
        """Start the membership coordinator in the coordinator namespace and wait until it serves.

        Args:
            argv: the coordinator command (``commopt-bench coordinator``); it prints one JSON line
                with its ``"address"`` once it serves.
            env: its environment.
            timeout: seconds to wait for that line.
            out: where its output up to readiness goes, prefixed ``[coordinator]``.

        Returns:
            The running process, as :meth:`start_switch` does.
        """
        if self.coordinator_namespace is None:
            raise ClusterError("start_coordinator needs Cluster(..., coordinator=True)")
        return self._start_service(self.coordinator_namespace, argv, env, ready=b'"address"',
                                   name="coordinator", timeout=timeout, out=out)

    def _start_service(self, namespace: str, argv: Sequence[str], env: dict[str, str] | None, *,
                       ready: bytes, name: str, timeout: float, out: IO[bytes] | None) -> subprocess.Popen:
        """Start ``argv`` in ``namespace`` and copy its lines to ``out`` until one contains ``ready``."""
        proc = self.spawn(namespace, argv, env, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + timeout
        while True:
            line = _read_line(proc, deadline, f"{name} {' '.join(argv)!r}")
            if out is not None:
                out.write(f"[{name}] ".encode() + line)
                out.flush()
            if ready in line:
                return proc

    def set_link(self, node: int, up: bool) -> None:
        """Take node ``node``'s link down (as if its cable were pulled) or bring it back up.

        Inside the node: ``ip link set cn<i> down``. Its address stays, and the kernel restores the
        subnet's route when the link comes back, so nothing else has to be redone.
        """
        self._batch([self._ip, "-n", self.node_namespaces[node]],
                    [f"link set {self.ifname(node)} {'up' if up else 'down'}"])

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
