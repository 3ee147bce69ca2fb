"""``commopt-bench cluster``: an emulated multi-node cluster on one Linux box, around a command.

On one machine every rank talks over unshaped loopback, where no topology-aware algorithm can win.
The cluster gives each *node* its own network namespace and joins it to a star fabric through a
rate-limited link, so traffic inside a node stays on loopback (the "NVLink") while traffic between
nodes crosses a real, shaped link (the "NIC"). Then it runs a command once per rank inside its node's
namespace (docs/architecture.md section 5.9)::

    commopt-bench cluster --nodes 2 --ranks-per-node 2 --link-rate 200mbit -- \\
        commopt-bench collectives --op allreduce --algo flat,hierarchical,auto --sizes 1M,4M,16M

The links need not be alike (``fabric``): one rate per node (``--link-rates``), up and down apart
(``--up-rates``, ``--down-rates``), or a direct-connect mesh with a rate per node pair (``--fabric mesh
--pair-rates 0-1:200mbit,1-2:200mbit,0-2:50mbit``); the ranks then get the map (``COMMOPT_LINK_MAP``).

:func:`main`: (1) checks the usage, then the privileges; (2) builds the cluster (``netns``); (3) probes
every directed link's achieved rate (``probe``) and prints it with the configured one; (4) starts the switch and
the membership coordinator where asked, each in its own namespace; (5) runs the ranks, their output
prefixed (``launch``; with ``--elastic``, one world per node, faults injected and nodes restarted while
the survivors run on: ``faults``); (6) tears everything down, whatever happens, a signal included.
Only this module reads environment variables (docs/architecture.md section 6.3), and, inside a rank,
``progress.report_step`` (the launcher's counterpart there).

With ``--elastic`` the ranks are launched the way one torchrun per node launches them, plus the
coordinator's address::

    commopt-bench cluster --nodes 4 --link-rate 200mbit --elastic \
        --fault kill:node=2:at=step=80 --restart node=2:after=10 --events events.jsonl -- python train.py
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import math
import os
import shlex
import shutil
import signal
import sys
import tempfile
import time
from collections.abc import Iterator
from typing import IO

from ._proc import ClusterError
from .fabric import Fabric, parse_fabric
from .faults import Fault, Restart, check_plan, parse_fault, parse_restart, run_elastic
from .host import check_requirements, cleanup_leftovers, parse_cap_eff
from .launch import _is_terminal, _note, place_ranks, rank_environments, run_ranks
from .netns import _MAX_NODES, Cluster
from .probe import LinkProbe

__all__ = ["main"]

# The namespaces are fresh, so nothing listens in them yet: fixed ports below the ephemeral range
# (32768+) are free by construction and cannot collide with gloo's own connections.
_MASTER_PORT = 29500
_SWITCH_PORT = 29600
_COORDINATOR_PORT = 29700
_COORDINATOR_ADDRESS = "10.77.0.253"  # Cluster.coordinator_address
_WARN_DEVIATION = 0.15


class _Interrupted(BaseException):
    """Raised by the signal handlers so that every ``finally`` on the way out runs."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


def _build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="commopt-bench cluster",
        usage="commopt-bench cluster --nodes N --ranks-per-node L --link-rate RATE [options] "
              "-- COMMAND...\n       commopt-bench cluster --nodes N --link-rates R0,R1,.. [--up-rates ..] "
              "[--down-rates ..] [options] -- COMMAND...\n       commopt-bench cluster --nodes N --fabric mesh "
              "--pair-rates 0-1:R,1-2:R,0-2:R [options] -- COMMAND...\n       commopt-bench cluster --cleanup",
        description="Emulate N nodes on this machine: one network namespace per node joined to a star "
                    "fabric by a tbf-shaped link, loopback inside a node; run COMMAND once per rank "
                    "inside its node, with RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR, "
                    "MASTER_PORT, GLOO_SOCKET_IFNAME, COMMOPT_NODES, COMMOPT_LINK_RATE_BPS (the slowest "
                    "configured link) and COMMOPT_LINK_MEASURED_BPS (the slowest probed one) set, "
                    "COMMOPT_LINK_MAP where the links are not all alike (and COMMOPT_PROGRESS=1 when this stderr is a "
                    "terminal: rank 0's progress bar is redrawn there). Needs root (CAP_NET_ADMIN, "
                    "CAP_SYS_ADMIN) and iproute2. Returns the first failing rank's exit code (with --elastic: "
                    "of the ranks no fault hit, and of restarted ranks).")
    parser.add_argument("--nodes", type=int, help="number of nodes N")
    parser.add_argument("--ranks-per-node", type=int, default=1, help="ranks per node L (default 1)")
    parser.add_argument("--link-rate", default=None,
                        help="rate of each node's link, each direction, in tc units: 200mbit, 1gbit "
                             "(bps/kbps/mbps are BYTES per second, as in tc). Default 1gbit")
    links = parser.add_argument_group(
        "links that are not all alike",
        "A star (the default: one bridge, one shaped link per node) takes one rate per node; a direct-connect "
        "mesh takes one per node pair. Where the links differ (and for every mesh) each rank gets COMMOPT_LINK_MAP, "
        "the JSON of commopt.comm.links.LinkMap in BYTES per second (tc's configured rates), which "
        "Topology.from_env() reads as Topology.links; COMMOPT_LINK_RATE_BPS is the slowest link's rate. Every "
        "directed link is probed (N-1 rounds of --probe-seconds) and printed beside its configured rate.")
    links.add_argument("--link-rates", default=None, metavar="R0,R1,..",
                       help="a star's rate per node, both directions, in node order (instead of --link-rate), "
                            "e.g. 200mbit,200mbit,50mbit")
    links.add_argument("--up-rates", default=None, metavar="R0,R1,..",
                       help="a star: what each node sends (its own end of its link is shaped at it); replaces that "
                            "direction of --link-rate(s)")
    links.add_argument("--down-rates", default=None, metavar="R0,R1,..",
                       help="a star: what each node receives (the bridge's end of its link); replaces that "
                            "direction of --link-rate(s)")
    links.add_argument("--fabric", choices=("star", "mesh"), default="star",
                       help="star (default): one bridge; mesh: no bridge, one shaped veth pair per node pair, each "
                            "node's address (GLOO_SOCKET_IFNAME) on its own interface with a /32 route to every "
                            "peer over their pair's link. No switch node or coordinator (they join a star's bridge)")
    links.add_argument("--pair-rates", default=None, metavar="I-J:R,..",
                       help="with --fabric mesh: every node pair's rate; I-J:R both directions, I>J:R from I to J "
                            "only, e.g. 0-1:200mbit,1-2:200mbit,0-2:50mbit. Every pair needs a link: gloo connects "
                            "every pair of ranks and the nodes do not forward")
    parser.add_argument("--placement", choices=("contiguous", "interleaved"), default="contiguous",
                        help="contiguous: ranks node by node (0,1;2,3); interleaved: rank r on node "
                             "r %% N (0,2;1,3), the pathological placement")
    parser.add_argument("--switch-node", action="store_true",
                        help="add a switch namespace whose link to the fabric is shaped at N x the node "
                             "rate (a real switch has one NIC-speed port per node); run `commopt-bench "
                             "ina-switch` in it and export COMMOPT_INA_SWITCH=host:port")
    parser.add_argument("--probe-seconds", type=float, default=1.0,
                        help="duration of each round of the link-rate probe before the run (0 skips it); "
                             "default 1. N-1 rounds (in round k node i sends to node i+k) measure every directed "
                             "link; a 2-node cluster needs one. It reports TCP goodput, about 4.5%% below the "
                             "configured rate on a perfect link (tbf counts the headers), and exports the "
                             "slowest link's as COMMOPT_LINK_MEASURED_BPS")
    parser.add_argument("--strict", action="store_true",
                        help="refuse to run when the probed rate is more than 15%% off the configured one")
    parser.add_argument("--delay", type=float, default=0.0, metavar="MS",
                        help="delay in ms added at each shaped link end (a node-to-node packet crosses "
                             "two ends); needs the netem qdisc, which is detected: the kernels we "
                             "target lack it, so this fails clearly there")
    parser.add_argument("--timeout", type=float, default=None, metavar="S",
                        help="kill all ranks after S seconds and return 124")
    elastic = parser.add_argument_group(
        "elastic training and faults",
        "--coordinator runs `commopt-bench coordinator` in its own namespace, joined to the fabric by an "
        f"unshaped link (the control plane) at {_COORDINATOR_ADDRESS}:{_COORDINATOR_PORT}, and gives every rank "
        f"COMMOPT_COORDINATOR={_COORDINATOR_ADDRESS}:{_COORDINATOR_PORT}. --elastic launches each node as its "
        "own torch.distributed world, the way one torchrun per node does: RANK=LOCAL_RANK, "
        "WORLD_SIZE=LOCAL_WORLD_SIZE=L, MASTER_ADDR=127.0.0.1 (the node's loopback), MASTER_PORT=29500, "
        "COMMOPT_NODES=one node of L ranks, COMMOPT_REPLICA_ID=the node's index, COMMOPT_NUM_REPLICAS=N, "
        "GLOO_SOCKET_IFNAME=the node's fabric interface, plus COMMOPT_COORDINATOR; a rank that dies does not "
        "kill the others, and the launcher waits for every rank (restarted ones too). With --fault, every "
        "rank also gets COMMOPT_STEP_DIR, where commopt.bench.cluster.progress.report_step(step) reports its "
        "training step; a restarted rank gets COMMOPT_RESTART=<attempt>. Every event is printed on stderr "
        "as `[cluster] t=<seconds since the ranks started>s ...`.")
    elastic.add_argument("--coordinator", action="store_true",
                         help="run the membership coordinator outside every node (see above)")
    elastic.add_argument("--coordinator-command", default=None, metavar="CMD",
                         help="run CMD (one shell-quoted string) in the coordinator's namespace instead of "
                              "`commopt-bench coordinator`, with the same options appended (--host, --port, "
                              "--heartbeat-timeout, --min-replicas, --initial-replicas, --job); it must print a "
                              "line holding \"address\" once it serves. Another membership service in the same "
                              "place, e.g. torchft's Lighthouse (`commopt-bench elastic`'s torchft runs)")
    elastic.add_argument("--heartbeat-timeout", type=float, default=None, metavar="S",
                         help="the coordinator drops a replica silent for S seconds (default 5)")
    elastic.add_argument("--min-replicas", type=int, default=None, metavar="N",
                         help="the fewest replicas (nodes) a generation may have (default 1; commopt's coordinator "
                              "counts ranks, and is started with N x --ranks-per-node)")
    elastic.add_argument("--initial-replicas", type=int, default=None, metavar="N",
                         help="the replicas (nodes) the first generation waits for (default: --nodes)")
    elastic.add_argument("--job", default=None, metavar="NAME",
                         help="the job's name at the coordinator (default commopt)")
    elastic.add_argument("--elastic", action="store_true",
                         help="one torch.distributed world per node (see above); implies --coordinator")
    elastic.add_argument("--fault", action="append", default=[], metavar="KIND:node=I:at=WHEN[:for=S]",
                         help="repeatable; needs --elastic. KIND: kill (SIGKILL every rank of node I), stop "
                              "(SIGSTOP them; SIGCONT after for=S seconds), linkdown (node I's link down; up "
                              "again after for=S seconds). WHEN: <seconds>s after the ranks start, or "
                              "step=<n>: the first moment a rank of node I reports a step >= n")
    elastic.add_argument("--restart", action="append", default=[], metavar="node=I:after=S",
                         help="repeatable, one per node; needs --elastic. S seconds after each fault of node I, "
                              "SIGKILL what still runs there, bring its link up and start its ranks again with "
                              "COMMOPT_RESTART=<attempt>")
    elastic.add_argument("--events", metavar="FILE",
                         help="with --elastic: write one JSON line per event to FILE (replaced): time (the wall "
                              "clock when the signal was sent or the link went down), t (seconds since the ranks "
                              "started), event (start, fault, cont, link_up, restart, exit), node, kind, step, "
                              "rank, ranks, code")
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
        0, the first failing rank's exit code (with --elastic, only ranks no fault hit and restarted
        ranks count: a rank killed by a fault is expected to die), 124 on --timeout, 128 + signal
        when interrupted, 2 for usage errors, 3 when the cluster cannot be built or --strict refuses
        the link.
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
            layout = place_ranks(args.nodes, args.ranks_per_node, args.placement)
            if not 1 <= args.nodes <= _MAX_NODES:
                raise ValueError(f"--nodes must be in 1..{_MAX_NODES}, got {args.nodes}")
            fabric = parse_fabric(args.nodes, fabric=args.fabric, link_rate=args.link_rate, link_rates=args.link_rates,
                                  up_rates=args.up_rates, down_rates=args.down_rates, pair_rates=args.pair_rates)
            if args.delay < 0 or args.probe_seconds < 0:
                raise ValueError("--delay and --probe-seconds must not be negative")
            plan = _elastic_plan(args)
            if fabric.kind == "mesh" and (args.switch_node or args.coordinator):
                given = "--switch-node" if args.switch_node else "--elastic" if args.elastic else "--coordinator"
                raise ValueError(f"{given} needs the star fabric: the switch and the coordinator join the star's "
                                 "bridge, and a direct-connect mesh has none; drop --fabric mesh (--link-rates and "
                                 "--up-rates/--down-rates make a star's links unequal)")
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
    cluster = Cluster(args.nodes, fabric=fabric, switch_node=args.switch_node, coordinator=args.coordinator,
                      delay_ms=args.delay, ip=ip, tc=tc, shield=interrupts.shield)
    old = {s: signal.signal(s, interrupts.handler) for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}
    try:
        return _run(args, cluster, layout, command, fabric, err, plan)
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


def _elastic_plan(args: argparse.Namespace) -> tuple[list[Fault], list[Restart]]:
    """Check the elastic options (filling in their defaults) and parse the faults and restarts.

    Raises:
        ValueError: saying which option is wrong and what to give instead.
    """
    faults = [parse_fault(text) for text in args.fault]
    restarts = [parse_restart(text) for text in args.restart]
    if not args.elastic:
        for option, given in (("--fault", faults), ("--restart", restarts), ("--events", args.events)):
            if given:
                raise ValueError(f"{option} needs --elastic: without it every node is one torch.distributed world "
                                 "and the launcher kills every rank at the first death, so there is nothing to "
                                 "survive a fault; add --elastic (each node its own world, as one torchrun per node)")
    elif args.placement != "contiguous":
        raise ValueError("--elastic launches each node as its own world, so ranks are placed node by node; "
                         "drop --placement interleaved")
    args.coordinator = args.coordinator or args.elastic
    if not args.coordinator:
        given = [o for o, v in (("--heartbeat-timeout", args.heartbeat_timeout), ("--min-replicas", args.min_replicas),
                                ("--initial-replicas", args.initial_replicas), ("--job", args.job),
                                ("--coordinator-command", args.coordinator_command)) if v is not None]
        if given:
            raise ValueError(f"{', '.join(given)} configure the coordinator: add --coordinator (or --elastic)")
    args.heartbeat_timeout = 5.0 if args.heartbeat_timeout is None else args.heartbeat_timeout
    args.min_replicas = 1 if args.min_replicas is None else args.min_replicas
    args.initial_replicas = args.nodes if args.initial_replicas is None else args.initial_replicas
    args.job = "commopt" if args.job is None else args.job
    if not (args.heartbeat_timeout > 0 and math.isfinite(args.heartbeat_timeout)):
        raise ValueError(f"--heartbeat-timeout must be a positive number of seconds, got {args.heartbeat_timeout}")
    if not 1 <= args.min_replicas <= args.initial_replicas <= args.nodes:
        raise ValueError(f"need 1 <= --min-replicas ({args.min_replicas}) <= --initial-replicas "
                         f"({args.initial_replicas}) <= --nodes ({args.nodes}): otherwise no generation can form")
    if not args.job:
        raise ValueError("--job must not be empty")
    if args.coordinator_command is not None and not shlex.split(args.coordinator_command):
        raise ValueError("--coordinator-command must name a command, e.g. --coordinator-command "
                         "'python -m my_service'")
    check_plan(faults, restarts, args.nodes)
    return faults, restarts


def _fail(message: str, code: int) -> int:
    print(f"commopt-bench cluster: error: {message}", file=sys.stderr, flush=True)
    return code


def _run(args: argparse.Namespace, cluster: Cluster, layout: list[list[int]], command: list[str],
         fabric: Fabric, err: IO[bytes], plan: tuple[list[Fault], list[Restart]]) -> int:
    """Open the run's files, then build, probe, run (the part of main() that its teardown guards).

    The events file is opened first, so that a path that cannot be written fails before anything is
    built; the step directory (with faults) is removed once the ranks are gone.
    """
    with contextlib.ExitStack() as stack:
        events = None
        if args.events:
            try:
                events = stack.enter_context(open(args.events, "w", encoding="utf-8"))
            except OSError as e:
                raise ClusterError(f"--events {args.events}: cannot write it ({e}); give a writable path") from None
        step_dir = stack.enter_context(tempfile.TemporaryDirectory(prefix="commopt-steps-")) if plan[0] else None
        return _build_and_run(args, cluster, layout, command, fabric, err, plan, events, step_dir)


def _build_and_run(args: argparse.Namespace, cluster: Cluster, layout: list[list[int]], command: list[str],
                   fabric: Fabric, err: IO[bytes], plan: tuple[list[Fault], list[Restart]], events: IO[str] | None,
                   step_dir: str | None) -> int:
    from commopt.comm.topology import format_nodes  # already imported by parse_rate()

    t0 = time.monotonic()
    cluster.up()
    _note(err, f"{args.nodes} node(s) x {args.ranks_per_node} rank(s), {args.placement}, {fabric.describe()}, "
               f"layout {format_nodes(layout)}, prefix {cluster.prefix}, up in {time.monotonic() - t0:.2f} s")
    rate = fabric.slowest
    record: dict[str, object] = {"nodes": args.nodes, "ranks_per_node": args.ranks_per_node,
                                 "placement": args.placement, "layout": format_nodes(layout),
                                 "link_rate_bps": rate, "switch_node": args.switch_node, "fabric": fabric.kind}
    if fabric.kind == "mesh" or not fabric.uniform_links:
        record["configured_links"] = fabric.configured()
    measured = None
    if args.probe_seconds > 0 and args.nodes >= 2:
        probe = cluster.probe(args.probe_seconds)
        measured = probe.bps
        record.update(probe.to_json())
        line, warning = _probe_report(probe, fabric)
        print(line, flush=True)
        if warning:
            banner = "!" * 78
            print(f"{banner}\n[cluster] WARNING: {warning}\n[cluster] Figures measured in this cluster will not "
                  f"reflect the configured links (busy CPUs? try lower rates).\n{banner}", file=sys.stderr, flush=True)
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
    coordinator = None
    if args.coordinator:
        service = (shlex.split(args.coordinator_command) if args.coordinator_command
                   else [sys.executable, "-m", "commopt.bench", "coordinator"])
        # commopt's membership counts ranks (rank r of node n is member n * L + r): its counts are nodes x L
        per = 1 if args.coordinator_command else args.ranks_per_node
        coordinator_argv = [*service, "--host", str(cluster.coordinator_address), "--port", str(_COORDINATOR_PORT),
                            "--heartbeat-timeout", f"{args.heartbeat_timeout:g}", "--min-replicas",
                            str(args.min_replicas * per), "--initial-replicas", str(args.initial_replicas * per),
                            "--job", args.job]
        proc = cluster.start_coordinator(coordinator_argv, dict(os.environ), out=err)
        coordinator = f"{cluster.coordinator_address}:{_COORDINATOR_PORT}"
        extra.append((proc.stdout, err, b"[coordinator] "))
    base_env = dict(os.environ)
    if _is_terminal(err):
        # The ranks' stderr is a pipe, so their progress bars would stay off; the pumps redraw them
        # in place on this terminal (see _Console). An explicit COMMOPT_PROGRESS wins.
        base_env.setdefault("COMMOPT_PROGRESS", "1")
    envs = rank_environments(layout, base_env, master_addr=cluster.node_address(0),
                             master_port=_MASTER_PORT,
                             ifnames=[cluster.ifname(n) for n in range(args.nodes)],
                             link_rate_bps=rate, measured_bps=measured, link_map=fabric.link_map(), ina_switch=ina,
                             coordinator=coordinator, elastic=args.elastic, step_dir=step_dir)
    if not args.elastic:
        return run_ranks(cluster, layout, command, envs, timeout=args.timeout, stdout=sys.stdout.buffer,
                         stderr=err, extra_streams=extra)
    faults, restarts = plan
    return run_elastic(cluster, layout, command, envs, faults=faults, restarts=restarts, step_dir=step_dir,
                       timeout=args.timeout, stdout=sys.stdout.buffer, stderr=err, events=events,
                       extra_streams=extra)


def _probe_report(probe: LinkProbe, fabric: Fabric) -> tuple[str, str | None]:
    """The probe's line, and the warning when a link is more than 15 % off its configured rate (or None).

    On a uniform star the line gives the slowest link against the one configured rate; elsewhere every
    directed link is printed against its own configured rate.
    """
    rate, measured = fabric.slowest, probe.bps
    if not probe.configured_links:
        links = ", ".join(f"{name} {bps / 1e6:.1f}" for name, bps in probe.links)
        line = (f"[cluster] link probe: {measured / 1e6:.1f} Mbit/s measured vs {rate / 1e6:g} Mbit/s configured "
                f"(ratio {measured / rate:.3f}; per link, Mbit/s: {links})")
        warning = (f"the measured link rate ({measured / 1e6:.1f} Mbit/s) is {probe.deviation:.0%} off the configured "
                   f"{rate / 1e6:g} Mbit/s (> 15 %).")
        return line, warning if probe.deviation > _WARN_DEVIATION else None
    parts, off = [], []
    for name, bps in sorted(probe.links):
        cfg = probe.configured(name)
        parts.append(f"{name} {bps / 1e6:.1f}/{cfg / 1e6:g}")
        if abs(bps - cfg) / cfg > _WARN_DEVIATION:
            off.append(f"{name} {bps / 1e6:.1f} of {cfg / 1e6:g} Mbit/s ({abs(bps - cfg) / cfg:.0%} off)")
    line = (f"[cluster] link probe ({fabric.kind}), every directed link, Mbit/s measured/configured: "
            f"{', '.join(parts)}; slowest {measured / 1e6:.1f} measured vs {rate / 1e6:g} configured")
    return line, (f"link(s) more than 15 % off their configured rate: {', '.join(off)}." if off else None)


def _emit_record(record: dict[str, object], path: str | None) -> None:
    line = json.dumps({"commopt_cluster": record}, sort_keys=True)
    print(line, flush=True)
    if path:
        with open(path, "a", encoding="utf-8") as f:
            f.write(line + "\n")
