"""The emulated cluster's namespaces, links and processes: :class:`Cluster`.

Layout, for a run whose prefix is ``co-<launcher pid>-<launcher start time>-<tag>``. A star (the default)::

    <prefix>-fab   the fabric: bridge ``cbr0``; port ``cf<i>`` per node, ``cfsw`` to the switch
    <prefix>-n<i>  node i: ``lo`` (intra-node traffic) and ``cn<i>`` = 10.77.0.<i+1>/24
    <prefix>-sw    with --switch-node: ``cnsw`` = 10.77.0.254/24
    <prefix>-co    with --coordinator: ``cnco`` = 10.77.0.253/24, an unshaped link (the control plane)

A direct-connect mesh (``--fabric mesh``) has no fabric namespace and no bridge::

    <prefix>-n<i>  node i: ``lo``; ``cn<i>`` = 10.77.0.<i+1>/32, its identity address (GLOO_SOCKET_IFNAME),
                   on one end of a veth pair whose other end ``cn<i>p`` stays unused in the node (a dummy
                   interface in effect: the kernels we run on lack the dummy driver); ``cp<j>``: its end of
                   the veth pair to node j, with the route 10.77.0.<j+1>/32 dev cp<j> src 10.77.0.<i+1>

so traffic to a peer leaves on that pair's link only, whatever address a socket is bound to, and
arrives on the link whose route leads back to its source. Reverse-path filtering is set loose (2)
in every node rather than left to what the host gives new namespaces (``devconf_inherit_init_net``
can make it strict): the routes are symmetric, so strict filtering passes this traffic too, but
nothing should hang on that. Forwarding is set off: traffic between two nodes is never relayed by a
third one's kernel, only by a schedule.

(1) namespaces, bridge and veth pairs are created inside the new namespaces only (the host's root
namespace is never touched, and the 10.77.0.0/24 addresses exist nowhere else); (2) tbf shapes both
ends of every link (a star: the node's end what it sends, the bridge's end what it receives; a mesh:
each end what its node sends to that peer), with a burst larger than a 64 KiB GSO super-packet (with
a smaller one tbf must segment every super-packet, or on older kernels drops it and the rate
collapses); on a 6.18 kernel the probe then gets 95.5 % of the configured rate, i.e. the full rate
less the Ethernet/IP/TCP headers; a switch port (the bridge's end) queues 25 ms of traffic and drops
beyond it, a sending host's interface never drops (a NIC pushes back; ``_HOST_QUEUE``) and each
connection may queue 128 KiB there (``_HOST_TSQ``); (3) everything is torn down whatever happens
(what a SIGKILLed launcher left is found by its prefix: ``host.cleanup_leftovers``).

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
from .fabric import Fabric, parse_rate
from .host import _process_start_ticks, _remove_namespaces
from .probe import LinkProbe, agent_argv, exchange

__all__ = ["Cluster", "parse_rate"]

_SUBNET = "10.77.0"  # private, and it only ever exists inside this run's namespaces (docs/faults.md row 29)
_SWITCH_HOST = 254
_COORDINATOR_HOST = 253
_MAX_NODES = 200
_MIN_BURST_BYTES = 128 * 1024  # > one 64 KiB GSO super-packet, with room to spare
#: The queue of a switch port (tbf on the fabric's end of a node's link): 25 ms of traffic, drops beyond.
_PORT_QUEUE = "latency 25ms"
#: The queue of a sending host's own interface: deep enough never to drop. A NIC does not drop what its
#: host sends (its driver stops the queue and TCP's small-queue limit, tcp_limit_output_bytes, 1-4 MiB a
#: connection, holds the rest in the socket); tbf cannot push back, so its queue must hold what the node's
#: connections may put there at once. With 25 ms there, 20-50 packets a call were dropped on the slow
#: node's own interface under the synthesized all-reduce on 3x2 (four connections sending at once), and a
#: connection whose last packet was dropped there waited for a timer: 10-40 % of the calls took twice as
#: long (docs/results.md 32).
_HOST_QUEUE = f"limit {64 << 20}"
#: TCP's small-queue limit in every node (``net.ipv4.tcp_limit_output_bytes``, per namespace): the bytes a
#: connection may have in its host's queue. Hosts set 1-4 MiB for NICs of 10-100 Gbit/s, well under a
#: millisecond there; at this cluster's Mbit/s the same bytes are seconds, and a node's acknowledgements
#: of what it receives wait behind them in its host queue: the 4x1 star's synthesized all-reduce of
#: 16 MiB took 3372 ms under 4 MiB, 2980 under 128 KiB (two 64 KiB GSO packets; docs/results.md 32).
_HOST_TSQ = 128 << 10


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
        link_rate_bps: the rate of each node's link, in both directions (a uniform star); or None
            with ``fabric``.
        fabric: the links when they are not all alike: a star of per-node up and down rates or a
            direct-connect mesh (:class:`~commopt.bench.cluster.fabric.Fabric`, ``fabric.nodes`` =
            ``nodes``); give it or ``link_rate_bps``, not both.
        switch_node: add the switch namespace, linked at the sum of the node rates (a real switch has
            one port per node, each as fast as that node's NIC). A star only.
        coordinator: add the coordinator namespace, joined to the fabric by an *unshaped* link: it is
            the control plane (heartbeats, the membership store), which must not queue behind the
            data traffic it is there to judge, and whose bytes are not the job's to pay for. A star
            only: a mesh has no shared segment to join it to.
        delay_ms: one-way delay per shaped link end; needs netem, which is detected, never assumed.
        ip: path of ``ip``.
        tc: path of ``tc``.
        tag: 4 hex digits that tell apart clusters of one process (random by default).
        shield: a context manager factory that defers interrupts; every ``ip``/``tc`` command and
            every process start runs inside it. An exception raised in the middle of ``Popen``
            leaves its child running untracked (an ``ip netns add`` finishing after the teardown
            looked, a rank nobody kills), so the CLI's signal handlers wait for these to finish.
    """

    def __init__(self, nodes: int, link_rate_bps: int | None = None, *, fabric: Fabric | None = None,
                 switch_node: bool = False, coordinator: bool = False, delay_ms: float = 0.0, ip: str = "ip",
                 tc: str = "tc", tag: str | None = None,
                 shield: Callable[[], AbstractContextManager] = contextlib.nullcontext):
        if not 1 <= nodes <= _MAX_NODES:
            raise ValueError(f"nodes must be in 1..{_MAX_NODES}, got {nodes}")
        if (link_rate_bps is None) == (fabric is None):
            raise ValueError("give the cluster link_rate_bps (every node alike) or fabric, exactly one")
        if fabric is None:
            if link_rate_bps <= 0:
                raise ValueError(f"link rate must be positive, got {link_rate_bps}")
            fabric = Fabric.uniform(nodes, int(link_rate_bps))
        if fabric.nodes != nodes:
            raise ValueError(f"the fabric has {fabric.nodes} nodes, the cluster {nodes}")
        if fabric.kind == "mesh" and (switch_node or coordinator):
            raise ValueError("a switch node and a coordinator join a star's bridge; a mesh has none (use the star)")
        self.nodes = nodes
        #: The configured links (bit/s).
        self.links = fabric
        #: The slowest configured rate (bit/s): all of them on a uniform star.
        self.link_rate_bps = fabric.slowest
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
        #: The fabric's namespace (a star's bridge); None for a mesh.
        self.fabric = f"{self.prefix}-fab" if fabric.kind == "star" else None
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
        """The interface holding node ``node``'s address inside its namespace (``GLOO_SOCKET_IFNAME``):
        its veth to the bridge in a star, its identity interface in a mesh."""
        return f"cn{node}"

    def pair_ifname(self, node: int, peer: int) -> str:
        """In a mesh, node ``node``'s end of its link to ``peer`` (inside ``node``'s namespace)."""
        return f"cp{peer}"

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
        """Create the namespaces and the shaped links (the caller must call down()).

        Commands go in one ``ip -batch`` / ``tc -batch`` per namespace and step: each ``ip`` start
        costs tens of ms on a busy 2-core machine, and a 2-node cluster needs about 25 commands.
        """
        if self.links.kind == "mesh":
            self._up_mesh()
        else:
            self._up_star()

    def _up_star(self) -> None:
        """The bridge, one veth per node (and per switch / coordinator), tbf on both ends."""
        up, down = self.links.up, self.links.down
        namespaces = [self.fabric, *self.node_namespaces]
        # (namespace, its interface, its fabric-side port, address, what it sends, what it receives;
        # None: unshaped)
        links = [(ns, self.ifname(n), f"cf{n}", self.node_address(n), up[n], down[n])
                 for n, ns in enumerate(self.node_namespaces)]
        if self.switch_node:
            namespaces.append(self.switch_namespace)
            # It sends to every node (their down ports) and receives from every node (their up ports).
            links.append((self.switch_namespace, "cnsw", "cfsw", self.switch_address, sum(down), sum(up)))
        if self.coordinator_namespace is not None:
            namespaces.append(self.coordinator_namespace)
            links.append((self.coordinator_namespace, "cnco", "cfco", self.coordinator_address, None, None))
        self._created += namespaces  # first: a signal right after the add must not leak one
        self._batch([self._ip], [f"netns add {ns}" for ns in namespaces])
        # The pairs are created inside the fabric, each peer straight in its namespace: no
        # interface ever appears in the host's root namespace.
        fabric = ["link add cbr0 type bridge", "link set cbr0 up"]
        for ns, inner, outer, *_ in links:
            fabric += [f"link add {outer} type veth peer name {inner} netns {ns}",
                       f"link set {outer} master cbr0", f"link set {outer} up"]
        self._batch([self._ip, "-n", self.fabric], fabric)
        for ns, inner, _, address, *_ in links:
            # No IPv6 link-local address: gloo takes the interface's first address; it must be ours.
            self._batch([self._ip, "-n", ns], [f"link set {inner} addrgenmode none",
                                               f"addr add {address}/24 dev {inner}",
                                               f"link set {inner} up", "link set lo up"])
        # Both ends: the node's side shapes what it sends, the fabric's side what it receives.
        self._shape(self.fabric, [(outer, rx) for _, _, outer, _, _, rx in links if rx is not None], host=False)
        for ns, inner, _, _, tx, _ in links:
            if tx is not None:
                self._shape(ns, [(inner, tx)], host=True)

    def _up_mesh(self) -> None:
        """One veth pair per node pair, each end shaped at what its node sends to that peer; the
        identity addresses and their /32 routes (see the module)."""
        n = self.nodes
        self._created += self.node_namespaces
        self._batch([self._ip], [f"netns add {ns}" for ns in self.node_namespaces])
        # (1) every interface, each created from the lower node's side, its peer straight in the other node
        for i, ns in enumerate(self.node_namespaces):
            holder = self.ifname(i)
            self._batch([self._ip, "-n", ns], [f"link add {holder} type veth peer name {holder}p"] + [
                f"link add {self.pair_ifname(i, j)} type veth peer name {self.pair_ifname(j, i)} "
                f"netns {self.node_namespaces[j]}" for j in range(i + 1, n)])
        # (2) addresses, links up, then the routes (a route needs its device up)
        for i, ns in enumerate(self.node_namespaces):
            holder, me = self.ifname(i), self.node_address(i)
            ends = [self.pair_ifname(i, j) for j in range(n) if j != i]
            lines = [f"link set {dev} addrgenmode none" for dev in (holder, f"{holder}p", *ends)]
            lines += [f"addr add {me}/32 dev {holder}", f"link set {holder}p up", f"link set {holder} up",
                      "link set lo up"] + [f"link set {dev} up" for dev in ends]
            lines += self._mesh_routes(i)
            self._batch([self._ip, "-n", ns], lines)
        # (3) loose reverse-path filtering, no forwarding, in every node (see the module)
        self._batch([self._ip], [f"netns exec {ns} sh -c 'echo 2 > /proc/sys/net/ipv4/conf/all/rp_filter && "
                                 f"echo 0 > /proc/sys/net/ipv4/ip_forward'" for ns in self.node_namespaces])
        for i, ns in enumerate(self.node_namespaces):
            self._shape(ns, [(self.pair_ifname(i, j), self.links.rate(i, j)) for j in range(n) if j != i],
                        host=True)  # a direct link: the sender's interface is its only queue

    def _mesh_routes(self, node: int) -> list[str]:
        """``ip`` lines: node's route to each peer's identity address over their pair's link."""
        me = self.node_address(node)
        return [f"route replace {self.node_address(j)}/32 dev {self.pair_ifname(node, j)} src {me}"
                for j in range(self.nodes) if j != node]

    def _shape(self, ns: str, devices: list[tuple[str, int]], *, host: bool) -> None:
        """tbf at ``rate`` on each ``(device, rate)`` of ``ns``: a sending host's interfaces (``host``) with
        :data:`_HOST_QUEUE` and the host's TCP connections limited to :data:`_HOST_TSQ` of it, else a switch
        port's :data:`_PORT_QUEUE`; netem below it with --delay."""
        # burst: more than one GSO super-packet, and ~4 ms of traffic at high rates so the bucket
        # never starves the sender between timer ticks. A switch port's queue is bounded (drops beyond
        # it are TCP's business, as on a real switch port); a host's is not (see _HOST_QUEUE).
        lines = [f"qdisc add dev {dev} root handle 1: tbf rate {rate}bit "
                 f"burst {max(_MIN_BURST_BYTES, rate // 8 // 250)} {_HOST_QUEUE if host else _PORT_QUEUE}"
                 for dev, rate in devices]
        try:
            self._batch([self._tc, "-n", ns], lines)
        except ClusterError as e:
            raise ClusterError(f"{e}\nThe kernel needs the tbf qdisc (CONFIG_NET_SCH_TBF, "
                               f"module sch_tbf).") from None
        if host:
            self._batch([self._ip], [f"netns exec {ns} sh -c 'echo {_HOST_TSQ} > "
                                     f"/proc/sys/net/ipv4/tcp_limit_output_bytes'"])
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
        """Measure every directed link's achieved rate with socket transfers between the nodes.

        One probe agent per node (``commopt.bench.cluster.probe``), N - 1 rounds of about ``seconds``
        each: in round k node i sends to node (i + k) % N while receiving from node (i - k) % N, all
        at once, so every port of a star carries one transfer each way per round (a transfer
        measures its link, not a share of a port) and after the last round every directed pair has
        been measured. Each sender paces itself at its link's configured rate, so that a fast node
        never overfills a slow node's port (which would drop the acknowledgements of that node's own
        transfer). Each transfer is reported with its configured rate. Needs at least 2 nodes.
        """
        if self.nodes < 2:
            raise ClusterError("the link probe needs at least 2 nodes")
        n = self.nodes
        addresses = [self.node_address(i) for i in range(n)]
        rounds = [[(i + k) % n for i in range(n)] for k in range(1, n)]
        agents = [self.spawn(i, agent_argv(addresses[i], seconds), stdin=subprocess.PIPE,
                             stderr=subprocess.PIPE) for i in range(n)]
        try:
            links = exchange(agents, addresses, seconds, rounds, pace=lambda i, j: self.links.rate(i, j) / 8)
        finally:
            _terminate(agents)
            for agent in agents:
                _close_pipes(agent)
                self._procs.remove(agent)
        return LinkProbe(self.link_rate_bps, links, seconds, self.links.configured())

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

        A star: inside the node, ``ip link set cn<i> down``. Its address stays, and the kernel restores
        the subnet's route when the link comes back, so nothing else has to be redone. A mesh: every
        link of the node (``cp<j>``); the kernel drops the routes over a link taken down, so they are
        put back when it comes up. Either way the node's address stays, and traffic inside the node
        (over loopback) goes on.
        """
        state = "up" if up else "down"
        if self.links.kind == "star":
            self._batch([self._ip, "-n", self.node_namespaces[node]], [f"link set {self.ifname(node)} {state}"])
            return
        ends = [self.pair_ifname(node, j) for j in range(self.nodes) if j != node]
        self._batch([self._ip, "-n", self.node_namespaces[node]],
                    [f"link set {dev} {state}" for dev in ends] + (self._mesh_routes(node) if up else []))

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
