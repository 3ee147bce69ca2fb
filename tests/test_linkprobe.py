"""Link calibration (``commopt.comm.linkprobe``): the map the probes' timings show (issue 40).

The classification is a pure function of the measured seconds, tested here on timings written from
known fabrics (rank arithmetic, no clock): a star's fan-out is no faster than its fastest pair (one
port), a mesh's adds the pairs up; pairs within the tolerance are a uniform cluster (None). The probes
themselves run on a real world of 3 ranks.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from commopt.comm import Topology
from commopt.comm.linkprobe import calibrate_links, link_map

MB = 4 << 20


def _star(up, down):
    n = len(up)
    pair = torch.tensor([[MB / min(up[i], down[j]) if i != j else 0.0 for j in range(n)] for i in range(n)])
    # fan-out: i's port shared by n - 1 flows
    fan = torch.tensor([[(n - 1) * MB / up[i] if i != j else 0.0 for j in range(n)] for i in range(n)])
    return pair, fan


def test_star_with_a_slow_node():
    up = [25e6, 25e6, 6.25e6]
    m = link_map(*_star(up, up), MB)
    assert m is not None and m.kind == "star"
    assert [round(x) for x in m.up] == [25e6, 25e6, 6.25e6] and [round(x) for x in m.down] == [25e6, 25e6, 6.25e6]


def test_asymmetric_star():
    m = link_map(*_star([25e6, 25e6, 6.25e6], [25e6, 25e6, 25e6]), MB)
    assert m.kind == "star" and round(m.up[2]) == 6.25e6 and round(m.down[2]) == 25e6


def test_mesh_triangle():
    rate = {(0, 1): 25e6, (1, 0): 25e6, (1, 2): 25e6, (2, 1): 25e6, (0, 2): 6.25e6, (2, 0): 6.25e6}
    pair = torch.tensor([[MB / rate[(i, j)] if i != j else 0.0 for j in range(3)] for i in range(3)])
    fan = pair.clone()  # independent links: the fan-out takes as long as its slowest pair alone
    m = link_map(pair, fan, MB)
    assert m is not None and m.kind == "mesh"
    assert {(a, b): round(r) for a, b, r in m.pairs} == rate


def test_uniform_is_none():
    pair, fan = _star([25e6] * 4, [25e6] * 4)
    assert link_map(pair * torch.tensor(1.05), fan, MB) is None


def _probe() -> bool:
    topo = Topology.from_spec("3x1")
    m = calibrate_links(topo, nbytes=1 << 20, timeout=60)
    # loopback: every pair alike within noise, or a map; either way every rank holds the same answer
    answers = [None] * dist.get_world_size()
    dist.all_gather_object(answers, None if m is None else m.to_dict())
    return all(a == answers[0] for a in answers)


def test_calibration_runs_on_a_world_and_agrees(ranks):
    """The probes run (N(N-1) pairs and N fan-outs) and every rank gets the same map."""
    assert ranks(3, _probe, timeout=120) == [True] * 3
