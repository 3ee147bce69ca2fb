"""Topology constructors, validation and derived groups (issue 2; docs/faults.md rows 4, 23, 38).

Row 38 (launchers) is driven here with the variables torchrun and MPI set, in the 4-rank pool, and
in test_mpi.py under a real ``mpirun``; row 4 (a rank never arrives) for group creation.
"""

from __future__ import annotations

import os
import threading
import time

import numpy as np
import pytest
import torch
import torch.distributed as dist

from commopt.comm import Topology, context
from commopt.comm.errors import CommTimeoutError, TopologyError
from commopt.comm.topology import parse_rate

# Every variable from_env() reads for a placement: cleared around each launcher case.
LAUNCHER_VARS = ("COMMOPT_NODES", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "RANK", "WORLD_SIZE",
                 "MPI_LOCALRANKID", "MPI_LOCALNRANKS", "PMI_RANK", "PMI_SIZE", "PMI_HOSTNAME",
                 "OMPI_COMM_WORLD_LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_SIZE", "OMPI_COMM_WORLD_RANK",
                 "OMPI_COMM_WORLD_SIZE", "PMIX_HOSTNAME")


def test_from_spec_and_nodes_without_distributed():
    t = Topology.from_spec("1")
    assert t.nodes == ((0,),) and t.world_size == 1 and t.local_size == 1
    t = Topology.from_nodes([[0]])
    assert t.num_nodes == 1 and t.is_uniform


def test_spec_errors_name_the_numbers():
    # Before init_process_group a 4-rank spec is not compared with a world of one: the group does
    # not exist yet (the world_size mismatch itself is checked in the rank pool, _bad_inputs).
    with pytest.raises(TopologyError, match=r"process group does not exist yet.*'2x2' describes 4 ranks.*"
                                            r"init_process_group\(\) first"):
        Topology.from_spec("2x2")
    with pytest.raises(TopologyError, match="cannot parse"):
        Topology.from_spec("two by two")
    with pytest.raises(TopologyError, match="size <= 0"):
        Topology.from_spec("0x1")
    with pytest.raises(TopologyError, match="size <= 0"):
        Topology.from_spec("1x0")


def test_nodes_must_cover_every_rank_once():
    with pytest.raises(TopologyError, match=r"missing \[\].*duplicated \[0\]"):
        Topology(nodes=((0,), (0,)), rank=0, world_size=1)
    with pytest.raises(TopologyError, match=r"missing \[1\]"):
        Topology(nodes=((0,),), rank=0, world_size=2)
    with pytest.raises(TopologyError, match="empty node"):
        Topology(nodes=((0, 1), ()), rank=0, world_size=2)


def test_parse_rate():
    assert parse_rate("200mbit") == 200e6
    assert parse_rate("1gbit") == 1e9
    assert parse_rate("25MB") == 200e6
    assert parse_rate("1000") == 1000.0
    with pytest.raises(ValueError, match="cannot parse link rate"):
        parse_rate("fast")


def test_from_env(monkeypatch):
    monkeypatch.setenv("COMMOPT_NODES", "0")
    monkeypatch.setenv("COMMOPT_LINK_RATE_BPS", "200000000")
    monkeypatch.setenv("COMMOPT_INA_SWITCH", "127.0.0.1:9999")
    t = Topology.from_env()
    assert t.nodes == ((0,),) and t.link_rate_bps == 200e6 and t.ina_switch == "127.0.0.1:9999"
    monkeypatch.setenv("COMMOPT_NODES", "0;x")
    with pytest.raises(TopologyError, match="malformed"):
        Topology.from_env()
    monkeypatch.delenv("COMMOPT_NODES")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    assert Topology.from_env().nodes == ((0,),)
    monkeypatch.delenv("LOCAL_WORLD_SIZE")
    with pytest.raises(TopologyError, match="gives no layout"):
        Topology.from_env()


# ------------------------------------------------------------------------------ in the rank pool
def _layouts(env_nodes):
    import os

    r = dist.get_rank()
    out = {}
    t = Topology.from_spec("2x2")
    out["spec"] = (t.node, t.local_rank, t.local_size, t.layout)
    t = Topology.from_nodes([[0, 2], [1, 3]])
    g = context().groups(t, "default")
    out["interleaved"] = (t.node, t.local_rank, g.intra_ranks, g.rail_ranks)
    t = Topology.from_spec("3+1")
    g = context().groups(t, "default")
    out["uneven"] = (t.is_uniform, g.intra_ranks, g.rail_ranks, g.intra is None)
    os.environ["COMMOPT_NODES"] = env_nodes
    pairs = [dist.new_group(members) for members in ([0, 1], [2, 3], [0, 3], [1, 2])]
    try:
        out["env"] = Topology.from_env().layout
        out["detect"] = Topology.detect().layout
        # A sub-group's layout: its members' nodes of COMMOPT_NODES (global ranks), in group ranks.
        mine = [g for g, members in zip(pairs, ([0, 1], [2, 3], [0, 3], [1, 2])) if r in members]
        out["sub"] = [(t.world_size, t.num_nodes, t.rank) for t in (Topology.from_env(group=g) for g in mine)]
    finally:
        del os.environ["COMMOPT_NODES"]
        for g in pairs:
            dist.destroy_process_group(g)
    # Without any layout in the environment, detect() groups by host name: one machine, one node.
    out["hostname"] = Topology.detect().layout
    out["rank"] = r
    return out


def test_layouts_and_groups(ranks):
    res = ranks(4, _layouts, "0,3;1,2")
    for r, out in enumerate(res):
        assert out["spec"] == (r // 2, r % 2, 2, "0,1;2,3")
        node = 0 if r in (0, 2) else 1
        assert out["interleaved"][:2] == (node, 0 if r < 2 else 1)
        assert out["interleaved"][2] == ((0, 2) if node == 0 else (1, 3))
        assert out["interleaved"][3] == ((0, 1) if r < 2 else (2, 3))
        assert out["env"] == out["detect"] == "0,3;1,2"
        # COMMOPT_NODES "0,3;1,2": {0, 1} and {2, 3} span both nodes, {0, 3} and {1, 2} share one.
        first, second = ([0, 1], [0, 3]) if r == 0 else ([0, 1], [1, 2]) if r == 1 else \
            ([2, 3], [1, 2]) if r == 2 else ([2, 3], [0, 3])
        assert out["sub"] == [(2, 2, first.index(r)), (2, 1, second.index(r))], (r, out["sub"])
        assert out["hostname"] == "0,1,2,3"
    # 3+1: rank 3 alone on node 1; local index 0 rail = {0, 3}; ranks 1, 2 have single-member rails.
    assert res[0]["uneven"] == (False, (0, 1, 2), (0, 3), False)
    assert res[1]["uneven"] == (False, (0, 1, 2), (1,), False)
    assert res[3]["uneven"] == (False, (3,), (0, 3), True)


def _inconsistent():
    r = dist.get_rank()
    topo = Topology.from_spec("2x2") if r != 1 else Topology.from_nodes([[0, 2], [1, 3]])
    try:
        context().groups(topo, "inconsistent")
    except TopologyError as exc:
        return str(exc)
    return None


def test_inconsistent_specs_fail_on_every_rank(ranks):
    """docs/faults.md row 23: inconsistent topology specs across ranks give a clear error on every rank."""
    res = ranks(4, _inconsistent)
    for msg in res:
        assert msg is not None and "ranks disagree on the topology" in msg
    assert "ranks [1]" in res[0]


# ------------------------------------------------------------------ before init_process_group (row 38)
def test_constructors_before_init_process_group(monkeypatch):
    """Every constructor, for a layout of more than one rank, says the process group does not exist
    yet and to call init_process_group first; a layout of one rank still works without it."""
    if dist.is_initialized():
        pytest.skip("needs a process without torch.distributed initialised")
    for var in LAUNCHER_VARS:
        monkeypatch.delenv(var, raising=False)
    not_yet = r"process group does not exist yet.*describes (2|4) ranks.*init_process_group\(\) first"
    for make in (lambda: Topology.from_spec("2x2"), lambda: Topology.from_spec("1+1"),
                 lambda: Topology.from_nodes([[0, 1]]), lambda: Topology.from_nodes([[0], [1]])):
        with pytest.raises(TopologyError, match=not_yet):
            make()
    launchers = {
        "COMMOPT_NODES": {"COMMOPT_NODES": "0,1;2,3"},
        "torchrun": {"LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "2", "GROUP_RANK": "0", "RANK": "0", "WORLD_SIZE": "2"},
        "mpich": {"MPI_LOCALRANKID": "0", "MPI_LOCALNRANKS": "1", "PMI_RANK": "0", "PMI_SIZE": "2"},
        "openmpi": {"OMPI_COMM_WORLD_LOCAL_RANK": "0", "OMPI_COMM_WORLD_LOCAL_SIZE": "2"},
    }
    for env in launchers.values():
        for var, value in env.items():
            monkeypatch.setenv(var, value)
        for make in (Topology.from_env, Topology.detect):
            with pytest.raises(TopologyError, match=not_yet):
                make()
        for var in env:
            monkeypatch.delenv(var)
    assert Topology.from_spec("1").nodes == Topology.from_nodes([[0]]).nodes == ((0,),)
    assert Topology.detect().nodes == ((0,),)  # a plain process is a world of one
    monkeypatch.setenv("MPI_LOCALRANKID", "0")
    monkeypatch.setenv("MPI_LOCALNRANKS", "1")
    assert Topology.from_env().nodes == ((0,),)


def test_bad_input_types_say_what_to_pass():
    """Class 6: wrong types are a TypeError that says what was wrong and what to pass, never a
    silently different layout (0.9 is not rank 0, "01" is not ranks 0 and 1)."""
    with pytest.raises(TypeError, match=r"spec must be a str such as '2x4'.*got NoneType None"):
        Topology.from_spec(None)
    with pytest.raises(TypeError, match=r"spec must be a str.*got int 3.*from_nodes"):
        Topology.from_spec(3)
    with pytest.raises(TypeError, match=r"rank 0.9 \(node 0, position 0\) is a float; ranks must be ints"):
        Topology.from_nodes([[0.9], [1.9], [2.9]])
    with pytest.raises(TypeError, match=r"node 0 is str '01'.*not a string"):
        Topology.from_nodes(["01", "2"])
    with pytest.raises(TypeError, match=r"nodes must be a list of nodes.*got str"):
        Topology.from_nodes("0")
    with pytest.raises(TypeError, match=r"node 0 is int 0"):
        Topology.from_nodes([0])
    for bad in (True, np.bool_(False), "0", 0.0, torch.tensor(0.0), torch.tensor([0]), torch.tensor(True), None):
        with pytest.raises(TypeError, match=r"ranks must be ints"):
            Topology.from_nodes([[bad]])
    with pytest.raises(TypeError, match="ranks must be ints"):
        Topology(nodes=((0.0,),), rank=0, world_size=1)
    for ok in (0, np.int64(0), np.uint8(0), torch.tensor(0), torch.tensor(0, dtype=torch.int32)):
        t = Topology.from_nodes([[ok]])
        assert t.nodes == ((0,),) and type(t.nodes[0][0]) is int
    assert Topology.from_nodes(((0,),)).nodes == ((0,),)
    for make in (lambda: Topology.from_spec("1", group="WORLD"), lambda: Topology.from_nodes([[0]], group="WORLD"),
                 lambda: Topology.from_env(group="WORLD"), lambda: Topology.detect(group="WORLD"),
                 lambda: Topology(nodes=((0,),), group="WORLD")):
        with pytest.raises(TypeError, match=r"group must be a torch.distributed ProcessGroup or None.*got str 'WORLD'"):
            make()


# ------------------------------------------------------------------ launchers in the rank pool (row 38)
def _torchrun(group_rank, local_rank, local_size, rank, world):
    return {"GROUP_RANK": group_rank, "LOCAL_RANK": local_rank, "LOCAL_WORLD_SIZE": local_size, "RANK": rank,
            "WORLD_SIZE": world}


def _mpich(local_rank, local_size, rank, host=None):
    env = {"MPI_LOCALRANKID": local_rank, "MPI_LOCALNRANKS": local_size, "PMI_RANK": rank, "PMI_SIZE": 4}
    if host is not None:
        env["PMI_HOSTNAME"] = host
    return env


def _launcher_env(case: str, r: int) -> dict:
    """The variables each launcher sets on rank r of 4, written from the placement by hand."""
    return {
        # torchrun, node by node: 2 nodes of 2, and 3 + 1.
        "torchrun 2x2": _torchrun(r // 2, r % 2, 2, r, 4),
        "torchrun 3+1": _torchrun(0 if r < 3 else 1, r if r < 3 else 0, 3 if r < 3 else 1, r, 4),
        # LOCAL_RANK contradicts node-by-node placement (rank 0 says it is local rank 1).
        "torchrun swapped": _torchrun(r // 2, 1 - r % 2, 2, r, 4),
        # Variables of an outer 2-rank torchrun job inherited by every rank of this world.
        "torchrun inherited": _torchrun(0, 0, 2, 0, 2),
        # mpirun -hosts a:2,b:2 -n 4 (node by node) and -hosts a:1,b:1 -n 4 (round robin: 0,2;1,3), the
        # hosts resolving to one machine (one host name, no PMI_HOSTNAME): split by local rank.
        "mpich block": _mpich(r % 2, 2, r),
        "mpich round-robin": _mpich(r // 2, 2, r),
        # mpirun -hosts a:3,b:1 -n 4: uneven nodes.
        "mpich 3+1": _mpich((0, 1, 2, 0)[r], 3 if r < 3 else 1, r),
        # mpirun -hosts a:1,b:2 -n 4 places 0 on a, 1 and 2 on b, 3 on a: Hydra's PMI_HOSTNAME tells.
        "mpich hostname": _mpich((0, 0, 1, 1)[r], 2, r, host="ab"[r in (1, 2)]),
        # Open MPI, round robin (--map-by node).
        "openmpi round-robin": {"OMPI_COMM_WORLD_LOCAL_RANK": r // 2, "OMPI_COMM_WORLD_LOCAL_SIZE": 2,
                                "OMPI_COMM_WORLD_RANK": r, "OMPI_COMM_WORLD_SIZE": 4},
        # Local ranks that no placement gives with a local size of 2.
        "mpich inconsistent": _mpich((0, 0, 0, 1)[r], 2, r),
        # Rank 0 started by torchrun, the others by mpirun.
        "mixed": _torchrun(0, 0, 1, 0, 4) if r == 0 else _mpich(r - 1, 3, r),
        # A plain spawn: no launcher variables at all.
        "plain": {},
    }[case]


# case -> ("layout", what it describes) or ("error", what every rank's TopologyError must say)
LAUNCHER_CASES = {
    "torchrun 2x2": ("layout", "0,1;2,3"),
    "torchrun 3+1": ("layout", "0,1,2;3"),
    "torchrun swapped": ("error", r"torchrun variables .* are inconsistent: node 0 holds global ranks \[0, 1\] "
                                  r"with LOCAL_RANK \[1, 0\]"),
    "torchrun inherited": ("error", r"describe a world of \[2\] ranks but the process group has 4.*COMMOPT_NODES"),
    "mpich block": ("layout", "0,1;2,3"),
    "mpich round-robin": ("layout", "0,2;1,3"),
    "mpich 3+1": ("layout", "0,1,2;3"),
    "mpich hostname": ("layout", "0,3;1,2"),
    "openmpi round-robin": ("layout", "0,2;1,3"),
    "mpich inconsistent": ("error", r"MPI's placement is inconsistent \(mpich\): ranks \[1\] of one host hold local "
                                    r"ranks \[0\], but each of them reports local size 2"),
    "mixed": ("error", r"ranks disagree on their launcher \(ranks \[0\] see 'torchrun', ranks \[1, 2, 3\] see "
                       r"'mpich'\)"),
    "plain": ("error", "the environment gives no layout"),
}


def _launchers(cases):
    r = dist.get_rank()
    saved = {var: os.environ.pop(var) for var in LAUNCHER_VARS if var in os.environ}
    out = {}
    try:
        for case in cases:
            env = {k: str(v) for k, v in _launcher_env(case, r).items()}
            os.environ.update(env)
            try:
                t = Topology.from_env(timeout=20)
                d = Topology.detect(timeout=20)
                local = env.get("MPI_LOCALRANKID", env.get("OMPI_COMM_WORLD_LOCAL_RANK", env.get("LOCAL_RANK")))
                out[case] = (t.layout, d.layout, t.local_rank, int(local))
            except TopologyError as exc:
                # Where the environment gives no layout, detect() groups by host name: one machine.
                out[case] = (str(exc), Topology.detect(timeout=20).layout if case == "plain" else None)
            finally:
                for var in env:
                    del os.environ[var]
    finally:
        os.environ.update(saved)
    return out


def test_launcher_placements(ranks):
    """docs/faults.md row 38: from_env() and detect() give torchrun's node-by-node placement and MPI's real
    placement (round robin included), a clear error on every rank where the variables contradict
    each other, and on a plain spawn from_env() raises while detect() works."""
    import re

    res = ranks(4, _launchers, list(LAUNCHER_CASES), timeout=90)
    for r, out in enumerate(res):
        for case, (kind, expected) in LAUNCHER_CASES.items():
            got = out[case]
            if kind == "layout":
                layout, detected, local_rank, launcher_local = got
                assert layout == detected == expected, (case, r, got)
                assert local_rank == launcher_local, (case, r, got)  # the launcher's own local rank
            else:
                assert re.search(expected, got[0]), (case, r, got)
    assert all(out["plain"][1] == "0,1,2,3" for out in res)


def _bad_inputs():
    """Class 6 on every rank of an initialised world, and the world_size mismatch of a spec."""
    seen = {}
    for name, make in (("spec None", lambda: Topology.from_spec(None)),
                       ("floats", lambda: Topology.from_nodes([[0.9], [1.9], [2.9], [3.9]])),
                       ("strings", lambda: Topology.from_nodes(["01", "23"])),
                       ("group str", lambda: Topology.from_spec("2x2", group="WORLD")),
                       ("group str env", lambda: Topology.detect(group="WORLD")),
                       ("spec size", lambda: Topology.from_spec("2x1"))):
        try:
            make()
            seen[name] = None
        except (TypeError, TopologyError) as exc:
            seen[name] = (type(exc).__name__, str(exc))
    # Integer numpy/torch scalars are ranks; the node order is kept.
    seen["numpy"] = Topology.from_nodes([[np.int64(0), 2], (np.int32(1), torch.tensor(3))]).layout
    return seen


def test_bad_inputs_fail_on_every_rank(ranks):
    for seen in ranks(4, _bad_inputs, timeout=60):
        assert seen["spec None"][0] == "TypeError" and "spec must be a str" in seen["spec None"][1]
        assert seen["floats"][0] == "TypeError" and "ranks must be ints" in seen["floats"][1]
        assert seen["strings"][0] == "TypeError" and "not a string" in seen["strings"][1]
        for key in ("group str", "group str env"):
            assert seen[key][0] == "TypeError" and "ProcessGroup or None" in seen[key][1]
        assert seen["spec size"] == ("TopologyError", "TopologyError: topology spec '2x1' describes 2 ranks but the "
                                     "group has world_size=4; pass a spec whose sizes add up to 4")
        assert seen["numpy"] == "0,2;1,3"


# ------------------------------------------------------------------ group creation (rows 4, 23)
def _same_key_from_two_threads():
    """Two threads of every rank ask for the same new role at once: it is created once."""
    topo = Topology.from_spec("2x2")
    got, errors = [], []

    def ask():
        try:
            got.append(context().groups(topo, "two-threads", timeout=20))
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(repr(exc))

    threads = [threading.Thread(target=ask) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(40)
    assert not errors and len(got) == 2, errors
    g = got[0]
    x = torch.tensor([float(dist.get_rank() + 1)])
    dist.all_reduce(x, group=g.intra)  # the group works, and pairs with the peer's
    return got[0] is got[1], g.intra_ranks, x.item()


def test_groups_created_once_under_concurrent_lookups(ranks):
    for r, (same, intra, total) in enumerate(ranks(4, _same_key_from_two_threads, timeout=60)):
        assert same and intra == ((0, 1) if r < 2 else (2, 3))
        assert total == (1 + 2 if r < 2 else 3 + 4)


CREATE_TIMEOUT = 3.0
SLACK = 10.0


def _one_rank_stays_away(flag_dir):
    """Rank 3 stays alive but never calls groups(); the others must raise within the timeout."""
    r = dist.get_rank()
    out = {}
    # (1) Rank 3 never calls groups(): the layout check times out. On a copy of WORLD, so that WORLD
    # itself stays usable for the barrier below.
    copy = dist.new_group(list(range(4)))
    if r != 3:
        start = time.monotonic()
        try:
            context().groups(Topology.from_spec("2x2", group=copy), "stays-away-1", timeout=CREATE_TIMEOUT)
            out["validate"] = None
        except CommTimeoutError as exc:
            out["validate"] = (time.monotonic() - start, str(exc))
    dist.barrier()
    # (2) Rank 3 takes part in the layout check, then never creates the groups: new_group must
    # honour the timeout too.
    topo = Topology.from_spec("2x2")
    if r == 3:
        topo.validate(timeout=30)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and len(os.listdir(flag_dir)) < 3:
            time.sleep(0.1)
        os._exit(0)  # the others' process groups are out of step: the pool is replaced (allow_dead)
    start = time.monotonic()
    try:
        context().groups(topo, "stays-away-2", timeout=CREATE_TIMEOUT)
        out["create"] = None
    except CommTimeoutError as exc:
        out["create"] = (time.monotonic() - start, exc.ranks, str(exc))
    finally:
        open(os.path.join(flag_dir, f"done{r}"), "w").close()
    return out


def test_group_creation_is_bounded_by_its_timeout(ranks, tmp_path):
    """docs/faults.md row 4: a rank alive but never calling groups(): the others raise CommTimeoutError after
    the timeout and before timeout + slack, both in the layout check and in new_group."""
    res = ranks(4, _one_rank_stays_away, str(tmp_path), timeout=2 * (CREATE_TIMEOUT + SLACK) + 30, allow_dead=True)
    assert res[3] is None
    for r in range(3):
        elapsed, msg = res[r]["validate"]
        assert CREATE_TIMEOUT - 0.5 <= elapsed < CREATE_TIMEOUT + SLACK, (r, elapsed)
        assert "CommTimeoutError" in msg and "op=topology.validate" in msg
        elapsed, group_ranks, msg = res[r]["create"]
        assert CREATE_TIMEOUT - 0.5 <= elapsed < CREATE_TIMEOUT + SLACK, (r, elapsed)
        # Rank 2 waits for rank 3 in its node's group; ranks 0 and 1 then wait for rank 2 in their rails.
        assert group_ranks == [[0, 2], [1, 3], [2, 3]][r], (r, msg)
        assert "op=topology.groups" in msg and "did not reach the same group creation" in msg and "destroy()" in msg
