"""Links that are not all alike in the emulated cluster (issue 40 item 1): a star with per-node and
per-direction rates (``--link-rates``, ``--up-rates``, ``--down-rates``) and a direct-connect mesh
(``--fabric mesh --pair-rates``); every directed link probed; ``COMMOPT_LINK_MAP`` in every rank.

The oracles are the rates asked for on the command line (rank arithmetic: bit/s / 8 = bytes/s), tc's
own report of its qdiscs, the kernel's routes and sysctls, the interface counters (which link a
payload crossed, in bytes), and plain gloo collectives. No assertion is on a time or a measured rate.
Tests marked ``netns`` build real namespaces and skip without root/CAP_NET_ADMIN/CAP_SYS_ADMIN or
iproute2; every launcher runs under a timeout.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest
from _netns import finish, needs_netns, rank_lines

from commopt.bench import cluster as cl
from commopt.bench.cluster import probe
from commopt.comm.links import LinkMap

__all__: list[str] = []

_TIMEOUT = 120.0
M = 1_000_000
_TRIANGLE = "0-1:200mbit,1-2:200mbit,0-2:50mbit"


def _run_cli(*args: str, command: list[str], timeout: float = _TIMEOUT) -> tuple[int, str, str, int]:
    proc = subprocess.Popen([sys.executable, "-m", "commopt.bench", "cluster", *args, "--", *command],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    code, out, err = finish(proc, timeout)
    return code, out, err, proc.pid


def _leftovers(pid: int) -> list[str]:
    return [n for n in cl.list_namespaces() if n.startswith(f"co-{pid:x}-")]


def _record(out: str) -> dict:
    return next(json.loads(line)["commopt_cluster"] for line in out.splitlines()
                if line.startswith('{"commopt_cluster"'))


def _tbf(ns: str, dev: str) -> dict:
    """The options of the tbf qdisc on ``dev`` in ``ns`` as tc reports them (``rate`` bytes/s, ``lat``: the
    queue's length in microseconds at that rate)."""
    out = subprocess.run(["tc", "-j", "-n", ns, "qdisc", "show", "dev", dev], capture_output=True, text=True,
                         timeout=10, check=True).stdout
    (tbf,) = [q for q in json.loads(out) if q["kind"] == "tbf"]
    return tbf["options"]


def _tbf_rate(ns: str, dev: str, *, host: bool) -> int:
    """The rate of the tbf qdisc on ``dev`` in ``ns``, bytes/s; it asserts the queue: a sending host's
    interface holds 64 MiB (seconds at these rates: it never drops, as a NIC pushes back), a switch
    port 25 ms of traffic (drops beyond)."""
    opts = _tbf(ns, dev)
    rate = int(opts["rate"])
    if host:
        assert opts["lat"] * 1e-6 * rate >= (64 << 20) * 0.95, opts
    else:
        assert abs(opts["lat"] - 25_000) <= 10, opts  # tc rounds to its clock
    return rate


def _in_ns(ns: str, *argv: str) -> str:
    return subprocess.run(["ip", "netns", "exec", ns, *argv], capture_output=True, text=True, timeout=10,
                          check=True).stdout


def _host_links() -> str:
    return subprocess.run(["ip", "-o", "link"], capture_output=True, text=True, timeout=10).stdout


@pytest.fixture
def sweep():
    """After a netns test, remove what dead launchers left, so one failure does not leak namespaces."""
    yield
    cl.cleanup_leftovers(shutil.which("ip") or "ip")


# ------------------------------------------------------------------------------------------------
# pure parts (no privileges needed)


def test_star_rates_per_node_and_direction():
    """--link-rate: every port alike, no map (today's cluster); --link-rates: one per node; --up-rates /
    --down-rates replace one direction; the map is the same rates in bytes/s."""
    alike = cl.parse_fabric(3, link_rate="200mbit")
    assert alike.up == alike.down == (200 * M,) * 3 and alike.link_map() is None and alike.slowest == 200 * M
    assert cl.parse_fabric(2).up == (1000 * M,) * 2  # the default, 1gbit
    per_node = cl.parse_fabric(3, link_rates="200mbit,200mbit,50mbit")
    assert per_node.up == per_node.down == (200 * M, 200 * M, 50 * M)
    split = cl.parse_fabric(3, link_rates="200mbit,200mbit,50mbit", up_rates="200mbit,100mbit,25mbps")
    assert split.up == (200 * M, 100 * M, 200 * M) and split.down == (200 * M, 200 * M, 50 * M)
    assert split.rate(1, 2) == 50 * M and split.rate(2, 1) == 200 * M and split.slowest == 50 * M
    assert LinkMap.from_dict(split.link_map()) == LinkMap.star([25e6, 12.5e6, 25e6], [25e6, 25e6, 6.25e6])
    down_only = cl.parse_fabric(2, link_rate="100mbit", down_rates="100mbit,20mbit")
    assert down_only.up == (100 * M, 100 * M) and down_only.down == (100 * M, 20 * M)
    assert split.configured() == {"n0->n1": 200 * M, "n0->n2": 50 * M, "n1->n0": 100 * M, "n1->n2": 50 * M,
                                  "n2->n0": 200 * M, "n2->n1": 200 * M}


def test_mesh_pair_rates_both_ways_and_one_way():
    """I-J:R is both directions, I>J:R one; the map holds every directed link in bytes/s."""
    tri = cl.parse_fabric(3, fabric="mesh", pair_rates=_TRIANGLE)
    assert {(i, j): tri.rate(i, j) for i, j in tri.directed()} == {
        (0, 1): 200 * M, (1, 0): 200 * M, (1, 2): 200 * M, (2, 1): 200 * M, (0, 2): 50 * M, (2, 0): 50 * M}
    assert LinkMap.from_dict(tri.link_map()) == LinkMap.mesh(3, {(0, 1): 25e6, (1, 0): 25e6, (1, 2): 25e6,
                                                                 (2, 1): 25e6, (0, 2): 6.25e6, (2, 0): 6.25e6})
    one_way = cl.parse_fabric(2, fabric="mesh", pair_rates="0>1:100mbit,1>0:10mbit")
    assert one_way.rate(0, 1) == 100 * M and one_way.rate(1, 0) == 10 * M and one_way.slowest == 10 * M
    # A uniform mesh still has its map: nothing else tells the ranks that its links are independent.
    assert LinkMap.from_dict(cl.parse_fabric(2, fabric="mesh", pair_rates="0-1:1gbit").link_map()).kind == "mesh"


@pytest.mark.parametrize("args, message", [
    (["--nodes", "3", "--link-rates", "200mbit,50mbit"], "--link-rates gives 2 rate(s) for 3 node(s)"),
    (["--nodes", "2", "--link-rates", "200mbit,fast"], "--link-rates: item 1 ('fast', node 1)"),
    (["--nodes", "2", "--up-rates", "1mbit,2mbit,3mbit"], "--up-rates gives 3 rate(s) for 2 node(s)"),
    (["--nodes", "2", "--down-rates", "0mbit,2mbit"], "link rate must be positive"),
    (["--nodes", "2", "--link-rate", "1gbit", "--link-rates", "1gbit,1gbit"], "not both"),
    (["--nodes", "3", "--pair-rates", _TRIANGLE], "--pair-rates gives the links of a direct-connect mesh"),
    (["--nodes", "3", "--fabric", "mesh"], "--fabric mesh needs --pair-rates"),
    (["--nodes", "3", "--fabric", "mesh", "--link-rate", "1gbit", "--pair-rates", _TRIANGLE],
     "--fabric mesh has no ports to shape with --link-rate"),
    (["--nodes", "3", "--fabric", "mesh", "--pair-rates", "0-1:200mbit,1-3:200mbit"],
     "names node 3, but --nodes 3 has nodes 0..2"),
    (["--nodes", "3", "--fabric", "mesh", "--pair-rates", "0-1:200mbit,1:2:200mbit"], "cannot parse '1:2:200mbit'"),
    (["--nodes", "3", "--fabric", "mesh", "--pair-rates", "0-1:200mbit,1-1:200mbit"], "links node 1 to itself"),
    (["--nodes", "3", "--fabric", "mesh", "--pair-rates", "0-1:2mbit,1>0:2mbit"], "the link 1->0 is given twice"),
    (["--nodes", "3", "--fabric", "mesh", "--pair-rates", "0-1:200mbit,1-2:200mbit,2>0:50mbit"],
     "the mesh has no link 0->2"),
    (["--nodes", "3", "--fabric", "mesh", "--pair-rates", "0-1:200mbit,1-2:200mbit"],
     "the mesh has no link 0->2, 2->0"),
    (["--nodes", "3", "--fabric", "mesh", "--pair-rates", "0-1:2mbit,1-2:2mbit,0-2:2mbits"], "cannot parse link rate"),
    (["--nodes", "3", "--fabric", "mesh", "--pair-rates", _TRIANGLE, "--elastic"], "--elastic needs the star fabric"),
    (["--nodes", "3", "--fabric", "mesh", "--pair-rates", _TRIANGLE, "--switch-node"],
     "--switch-node needs the star fabric"),
])
def test_usage_errors_exit_2(args, message, capsys):
    """Wrong counts, units, pairs, an incomplete mesh and options a mesh cannot have exit 2 with a message
    naming the option, before anything is built (no privileges used)."""
    assert cl.main([*args, "--", "true"]) == 2
    err = capsys.readouterr().err
    assert "commopt-bench cluster: error:" in err and message in err, err


def test_rank_environments_carry_the_map_only_where_given():
    """COMMOPT_LINK_MAP is the map's JSON where the links differ; otherwise it is absent, even when an
    outer launcher's environment had one (a uniform cluster's environment stays as it was)."""
    layout = [[0], [1], [2]]
    tri = cl.parse_fabric(3, fabric="mesh", pair_rates=_TRIANGLE)
    stale = {"PATH": "/bin", "COMMOPT_LINK_MAP": json.dumps(LinkMap.star([1.0, 1.0, 1.0]).to_dict())}
    kw = {"master_addr": "10.77.0.1", "master_port": 29500, "ifnames": ["cn0", "cn1", "cn2"]}
    envs = cl.rank_environments(layout, stale, link_rate_bps=tri.slowest, link_map=tri.link_map(), **kw)
    for env in envs:
        assert LinkMap.from_dict(json.loads(env["COMMOPT_LINK_MAP"])) == LinkMap.from_dict(tri.link_map())
        assert env["COMMOPT_LINK_RATE_BPS"] == str(50 * M)
    uniform = cl.rank_environments(layout, stale, link_rate_bps=200 * M, **kw)
    assert all("COMMOPT_LINK_MAP" not in env for env in uniform)


def test_probe_rounds_measure_every_directed_link_over_loopback():
    """Three agents on loopback, two rounds (i -> i+1, i -> i+2): every ordered pair of nodes is reported
    once, each with a positive rate; the per-link deviation is against each link's own configured rate."""
    agents = [subprocess.Popen(probe.agent_argv("127.0.0.1", 0.2), stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, bufsize=0) for _ in range(3)]
    try:
        links = probe.exchange(agents, ["127.0.0.1"] * 3, 0.2, [[1, 2, 0], [2, 0, 1]])
    finally:
        for agent in agents:
            if agent.poll() is None:
                agent.kill()
            agent.communicate(timeout=30)
    assert sorted(name for name, _ in links) == ["n0->n1", "n0->n2", "n1->n0", "n1->n2", "n2->n0", "n2->n1"]
    assert all(rate > 0 for _, rate in links)
    assert [agent.returncode for agent in agents] == [0, 0, 0]
    with pytest.raises(ValueError, match="each receiving once"):
        probe.exchange([], [], 0.1, [[0]])
    measured = cl.LinkProbe(50 * M, [("n0->n1", 180e6), ("n1->n0", 40e6)], 1.0, {"n0->n1": 200 * M, "n1->n0": 50 * M})
    assert measured.bps == 40 * M and measured.deviation == pytest.approx(0.2)
    assert measured.to_json()["configured_links"] == {"n0->n1": 200 * M, "n1->n0": 50 * M}


# ------------------------------------------------------------------------------------------------
# namespaces


@pytest.mark.netns
@needs_netns
def test_star_qdiscs_carry_each_nodes_up_and_down_rate(sweep):
    """Each node's own end is shaped at what it sends (up), the bridge's end at what it receives (down);
    the switch's port at the sums; a host's end never drops and each connection queues at most 128 KiB
    there (TCP's small-queue limit), a switch port queues 25 ms. Nothing is left
    after the teardown (docs/faults.md row 32)."""
    fabric = cl.parse_fabric(3, link_rates="200mbit,200mbit,50mbit", up_rates="200mbit,100mbit,50mbit")
    with cl.Cluster(3, fabric=fabric, switch_node=True) as cluster:
        for n, ns in enumerate(cluster.node_namespaces):
            assert _tbf_rate(ns, cluster.ifname(n), host=True) * 8 == fabric.up[n]
            assert _in_ns(ns, "cat", "/proc/sys/net/ipv4/tcp_limit_output_bytes").strip() == str(128 << 10)
            assert _tbf_rate(cluster.fabric, f"cf{n}", host=False) * 8 == fabric.down[n]
        assert _tbf_rate(cluster.switch_namespace, "cnsw", host=True) * 8 == sum(fabric.down)
        assert _tbf_rate(cluster.fabric, "cfsw", host=False) * 8 == sum(fabric.up)
        assert cluster.link_rate_bps == 50 * M
        prefix = cluster.prefix
    assert not [n for n in cl.list_namespaces() if n.startswith(prefix)]


@pytest.mark.netns
@needs_netns
def test_mesh_links_routes_and_sysctls(sweep):
    """A mesh: no bridge; each node's end of each pair shaped at what it sends to that peer (a queue that never
    drops: the sender's interface is the link's only queue); the route to
    each peer's identity address over that pair's link, from the node's own; rp_filter loose and no
    forwarding; a link taken down and up gets its routes back; nothing in the host's namespace
    (docs/faults.md row 29) and nothing left after the teardown (row 32)."""
    fabric = cl.parse_fabric(3, fabric="mesh", pair_rates="0-1:200mbit,1-2:200mbit,0>2:50mbit,2>0:20mbit")
    with cl.Cluster(3, fabric=fabric) as cluster:
        assert cluster.fabric is None
        assert sorted(n for n in cl.list_namespaces() if n.startswith(cluster.prefix)) == cluster.node_namespaces
        for i, ns in enumerate(cluster.node_namespaces):
            me = cluster.node_address(i)
            addrs = subprocess.run(["ip", "-n", ns, "-o", "-4", "addr", "show", "dev", cluster.ifname(i)],
                                   capture_output=True, text=True, timeout=10).stdout
            assert f"inet {me}/32 " in addrs
            assert _in_ns(ns, "cat", "/proc/sys/net/ipv4/conf/all/rp_filter").strip() == "2"
            assert _in_ns(ns, "cat", "/proc/sys/net/ipv4/ip_forward").strip() == "0"
            assert _in_ns(ns, "cat", "/proc/sys/net/ipv4/tcp_limit_output_bytes").strip() == str(128 << 10)
            for j in range(3):
                if j != i:
                    dev = cluster.pair_ifname(i, j)
                    assert _tbf_rate(ns, dev, host=True) * 8 == fabric.rate(i, j)
                    route = subprocess.run(["ip", "-n", ns, "route", "get", cluster.node_address(j)],
                                           capture_output=True, text=True, timeout=10).stdout
                    assert f"dev {dev} src {me}" in route, route
        cluster.set_link(1, up=False)
        gone = subprocess.run(["ip", "-n", cluster.node_namespaces[1], "route", "show"], capture_output=True,
                              text=True, timeout=10).stdout
        assert cluster.node_address(0) not in gone  # the kernel dropped the routes over the links taken down
        cluster.set_link(1, up=True)
        back = subprocess.run(["ip", "-n", cluster.node_namespaces[1], "route", "get", cluster.node_address(0)],
                              capture_output=True, text=True, timeout=10).stdout
        assert f"dev {cluster.pair_ifname(1, 0)} src {cluster.node_address(1)}" in back
        host = _host_links()
        assert not any(f": {name}" in host for name in ("cp0@", "cp1@", "cn0@", "cn0p@", "cbr0:"))
        prefix = cluster.prefix
    assert not [n for n in cl.list_namespaces() if n.startswith(prefix)]


_ENV_SNIPPET = """
import json, os
print(json.dumps({k: os.environ.get(k) for k in ("COMMOPT_LINK_MAP", "COMMOPT_LINK_RATE_BPS",
                                                 "COMMOPT_LINK_MEASURED_BPS", "GLOO_SOCKET_IFNAME")}))
"""


@pytest.mark.netns
@needs_netns
def test_star_env_map_and_every_directed_link_probed(sweep):
    """A 3-node star at 200/200/50 Mbit/s with node 1 sending at 100: every rank gets the map of those
    rates in bytes/s and the slowest one as COMMOPT_LINK_RATE_BPS; the probe reports and prints all six
    directed links beside their configured rates."""
    code, out, err, pid = _run_cli("--nodes", "3", "--link-rates", "200mbit,200mbit,50mbit", "--up-rates",
                                   "200mbit,100mbit,50mbit", "--probe-seconds", "0.3", "--timeout", "60",
                                   command=[sys.executable, "-c", _ENV_SNIPPET])
    assert code == 0, err
    expected = LinkMap.star([25e6, 12.5e6, 6.25e6], [25e6, 25e6, 6.25e6])
    envs = {r: json.loads(lines[-1]) for r, lines in rank_lines(out).items()}
    assert sorted(envs) == [0, 1, 2]
    record = _record(out)
    for r, env in envs.items():
        assert LinkMap.from_dict(json.loads(env["COMMOPT_LINK_MAP"])) == expected
        assert env["COMMOPT_LINK_RATE_BPS"] == str(50 * M) and env["GLOO_SOCKET_IFNAME"] == f"cn{r}"
        assert env["COMMOPT_LINK_MEASURED_BPS"] == str(record["measured_bps"])
    directed = ["n0->n1", "n0->n2", "n1->n0", "n1->n2", "n2->n0", "n2->n1"]
    assert sorted(record["links"]) == directed and all(v > 0 for v in record["links"].values())
    assert record["configured_links"] == {"n0->n1": 200 * M, "n0->n2": 50 * M, "n1->n0": 100 * M,
                                          "n1->n2": 50 * M, "n2->n0": 50 * M, "n2->n1": 50 * M}
    line = next(x for x in out.splitlines() if x.startswith("[cluster] link probe"))
    assert all(f"{name} " in line for name in directed) and "n1->n0 " in line and "/100," in line
    assert _leftovers(pid) == []


@pytest.mark.netns
@needs_netns
def test_uniform_star_env_stays_as_it_was(sweep):
    """A uniform star (--link-rate, or --link-rates all alike) sets no COMMOPT_LINK_MAP."""
    code, out, err, pid = _run_cli("--nodes", "2", "--link-rates", "200mbit,200mbit", "--probe-seconds", "0",
                                   "--timeout", "60", command=[sys.executable, "-c", _ENV_SNIPPET])
    assert code == 0, err
    envs = [json.loads(lines[-1]) for lines in rank_lines(out).values()]
    assert len(envs) == 2 and all(e["COMMOPT_LINK_MAP"] is None for e in envs)
    assert all(e["COMMOPT_LINK_RATE_BPS"] == str(200 * M) for e in envs)
    assert _leftovers(pid) == []


_MESH_SNIPPET = """
import glob, json, os, torch, torch.distributed as dist
from commopt.comm import Topology

def counters():
    out = {}
    for path in glob.glob("/sys/class/net/cp*"):
        stat = lambda k: int(open(f"{path}/statistics/{k}_bytes").read())
        out[os.path.basename(path)] = (stat("tx"), stat("rx"))
    return out

dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
t = torch.arange(1000, dtype=torch.float64) * (rank + 1)
dist.all_reduce(t)
ok = bool(torch.equal(t, torch.arange(1000, dtype=torch.float64) * (world * (world + 1) // 2)))
for i in range(world):  # a point-to-point send between every ordered pair, in one order on every rank
    for j in range(world):
        if i != j and rank == i:
            dist.send(torch.tensor([10 * i + j]), j)
        elif i != j and rank == j:
            got = torch.zeros(1, dtype=torch.int64)
            dist.recv(got, i)
            ok = ok and int(got) == 10 * i + j
dist.barrier()
before = counters()
payload = 1 << 20  # float32 elements: 4 MiB
if rank == 0:
    dist.send(torch.ones(payload), 1)
elif rank == 1:
    buf = torch.zeros(payload)
    dist.recv(buf, 0)
    ok = ok and bool(buf.eq(1).all())
dist.barrier()
after = counters()
delta = {dev: [a - b for a, b in zip(after[dev], before[dev])] for dev in after}
links = Topology.from_env().links
print(json.dumps({"ok": ok, "delta": delta, "links": links.to_dict() if links else None}))
dist.destroy_process_group()
"""


@pytest.mark.netns
@needs_netns
def test_mesh_gloo_every_pair_and_bytes_on_their_own_link(sweep):
    """A 3-node triangle mesh: gloo (bound to each node's identity interface) all-reduces and sends
    between every pair; the 4 MiB of a 0 -> 1 send appear on the 0-1 pair's interfaces only (node 0's
    ``cp1`` out, node 1's ``cp0`` in), the other links carry at most the barriers' few bytes; every rank's
    Topology.links is the triangle in bytes/s."""
    code, out, err, pid = _run_cli("--nodes", "3", "--fabric", "mesh", "--pair-rates", _TRIANGLE,
                                   "--probe-seconds", "0", "--timeout", "100", command=[sys.executable, "-c",
                                                                                       _MESH_SNIPPET])
    assert code == 0, err
    reports = {r: json.loads(lines[-1]) for r, lines in rank_lines(out).items()}
    assert sorted(reports) == [0, 1, 2]
    payload, small = 4 << 20, 256 << 10
    expected = LinkMap.mesh(3, {(0, 1): 25e6, (1, 0): 25e6, (1, 2): 25e6, (2, 1): 25e6, (0, 2): 6.25e6,
                                (2, 0): 6.25e6})
    for rank, rep in reports.items():
        assert rep["ok"], rep
        assert LinkMap.from_dict(rep["links"]) == expected
        assert sorted(rep["delta"]) == sorted(f"cp{j}" for j in range(3) if j != rank)
        for dev, (tx, rx) in rep["delta"].items():
            assert tx >= payload if (rank, dev) == (0, "cp1") else tx < small, (rank, dev, tx)
            assert rx >= payload if (rank, dev) == (1, "cp0") else rx < small, (rank, dev, rx)
    assert _leftovers(pid) == []
