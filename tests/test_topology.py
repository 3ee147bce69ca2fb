"""Topology constructors, validation and derived groups (issue 2; FAULTS row 23)."""

from __future__ import annotations

import pytest
import torch.distributed as dist

from commopt.comm import Topology
from commopt.comm.errors import TopologyError
from commopt.comm.topology import parse_rate


def test_from_spec_and_nodes_without_distributed():
    t = Topology.from_spec("1")
    assert t.nodes == ((0,),) and t.world_size == 1 and t.local_size == 1
    t = Topology.from_nodes([[0]])
    assert t.num_nodes == 1 and t.is_uniform


def test_spec_errors_name_the_numbers():
    with pytest.raises(TopologyError, match=r"describes 4 ranks but the group has world_size=1"):
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
    g = t.groups()
    out["interleaved"] = (t.node, t.local_rank, g.intra_ranks, g.rail_ranks)
    t = Topology.from_spec("3+1")
    g = t.groups()
    out["uneven"] = (t.is_uniform, g.intra_ranks, g.rail_ranks, g.intra is None)
    os.environ["COMMOPT_NODES"] = env_nodes
    try:
        out["env"] = Topology.from_env().layout
        out["detect"] = Topology.detect().layout
    finally:
        del os.environ["COMMOPT_NODES"]
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
        assert out["hostname"] == "0,1,2,3"
    # 3+1: rank 3 alone on node 1; local index 0 rail = {0, 3}; ranks 1, 2 have single-member rails.
    assert res[0]["uneven"] == (False, (0, 1, 2), (0, 3), False)
    assert res[1]["uneven"] == (False, (0, 1, 2), (1,), False)
    assert res[3]["uneven"] == (False, (3,), (0, 3), True)


def _inconsistent():
    r = dist.get_rank()
    topo = Topology.from_spec("2x2") if r != 1 else Topology.from_nodes([[0, 2], [1, 3]])
    try:
        topo.groups("inconsistent")
    except TopologyError as exc:
        return str(exc)
    return None


def test_inconsistent_specs_fail_on_every_rank(ranks):
    """FAULTS row 23: inconsistent topology specs across ranks give a clear error on every rank."""
    res = ranks(4, _inconsistent)
    for msg in res:
        assert msg is not None and "ranks disagree on the topology" in msg
    assert "ranks [1]" in res[0]
