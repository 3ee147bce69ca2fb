"""``commopt-bench pp`` (issue 41, item 6): its run names, the records it merges from its worker jobs, the
issue's bars it checks, and one tiny real run on loopback (2 spawned stages, a 32-wide GPT, about 15 s)
whose JSON records are checked against arithmetic (the bytes per boundary: micro-batches x the codec's
payload and the channel's 40-byte trailer) and against torch's own ``Schedule1F1B`` (commopt's
uncompressed executor does torch's arithmetic: the same held-out loss, bit for bit). The timed runs are a
benchmark, recorded in docs/results.md, never a test: nothing here asserts a time."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from commopt.bench import pp
from commopt.bench._pp_worker import RunSpec, batch_ids, run_spec

D, SEQ, MB, MICRO, STEPS = 32, 16, 2, 2, 2


def test_run_names():
    """Each accepted run name's schedule and codecs; torch's runs are fp32 only; anything else is refused
    naming the accepted forms."""
    assert run_spec("torch-1f1b") == RunSpec("torch", "1f1b", None, None, False)
    assert run_spec("commopt-gpipe-int8") == RunSpec("commopt", "gpipe", "int8", "int8", False)
    assert run_spec("commopt-1f1b-aqsgd") == RunSpec("commopt", "1f1b", "int4", "int8", True)
    for bad in ("torch-1f1b-int8", "commopt-zb", "commopt-1f1b-int2"):
        with pytest.raises(ValueError, match="commopt-1f1b-int8"):
            run_spec(bad)


def test_batches_cycle_the_finite_set():
    """Every epoch visits each sample once (distinct ids per step), in a new order, the same for every run."""
    epoch = [batch_ids(s, 4, 12) for s in range(3)]
    assert sorted(int(i) for b in epoch for i in b) == list(range(12))
    assert all(len(set(b.tolist())) == 4 for b in epoch)
    assert sorted(int(i) for s in range(3, 6) for i in batch_ids(s, 4, 12)) == list(range(12))
    assert [b.tolist() for b in epoch] != [batch_ids(s, 4, 12).tolist() for s in range(3, 6)]


def _rec(run: str, step: float, loss: float, link: float | None = None, sim: float | None = None) -> dict:
    spec = run_spec(run)
    return {"run": run, "schedule": spec.schedule, "link_mbit": link, "step_s": step, "sim_step_s": sim,
            "held_out_loss": loss, "boundary_bytes": [], "peak_memory_bytes": 0}


def test_merge_and_bars():
    """Floors come from the loopback job (the first), by run name; vs torch is torch's step over the run's,
    on the same link; the held-out loss is compared with commopt's uncompressed run of the same link; the
    simulator's error is predicted over measured minus one. The bars read those figures."""
    floor = {"results": [_rec("torch-1f1b", 1.2, 3.0), _rec("commopt-1f1b", 1.0, 3.0),
                         _rec("commopt-1f1b-int8", 1.0, 3.03)]}
    shaped = {"results": [_rec("torch-1f1b", 1.5, 3.0, 200, 1.5), _rec("commopt-1f1b", 1.1, 3.0, 200, 1.21),
                          _rec("commopt-1f1b-int8", 1.04, 3.06, 200, 1.04)]}
    recs = pp.merge([floor, shaped])
    by = {(r["run"], r["link_mbit"]): r for r in recs}
    r = by[("commopt-1f1b", 200)]
    assert r["floor_s"] == 1.0 and r["x_floor"] == pytest.approx(1.1) and r["vs_torch"] == pytest.approx(1.5 / 1.1)
    assert r["sim_error"] == pytest.approx(0.1) and r["held_out_vs_base"] == 0.0
    assert by[("commopt-1f1b-int8", 200)]["held_out_vs_base"] == pytest.approx(0.02)
    assert by[("commopt-1f1b-int8", None)]["held_out_vs_base"] == pytest.approx(0.01)
    assert by[("torch-1f1b", 200)]["floor_s"] == 1.2 and by[("torch-1f1b", None)]["x_floor"] == 1.0
    at200 = {r["run"]: r for r in recs if r["link_mbit"] == 200}
    results = [pp.check_bar(bar, at200) for bar in pp.BARS if bar[0] == 200]
    assert [(v, ok) for _, v, ok in results] == [(pytest.approx(1.1), True), (pytest.approx(1.5 / 1.1), True),
                                                 (pytest.approx(1.04), True)]
    assert pp.check_bar((50, "faster", "torch-1f1b", "commopt-1f1b-int8", 2.0), {}) is None


def test_loopback_run_writes_one_record_per_run(tmp_path):
    """A real run (2 spawned stages, torch's 1F1B and commopt's fp32, int8 and AQ-SGD): one record per run
    with the issue's fields; on loopback the floor is the run itself; commopt's bytes per boundary and
    direction are micro-batches x (payload + 40-byte trailer), int8 one byte per element and one fp32
    scale per row, AQ-SGD's activations int4 (every measured step revisits cached samples); torch's
    uncompressed run and commopt's reach the same held-out loss, bit for bit."""
    path = tmp_path / "pp.json"
    res = subprocess.run([sys.executable, "-m", "commopt.bench", "pp", "--loopback", "--steps", str(STEPS),
                          "--warmup", "1", "--d-model", str(D), "--layers", "2", "--seq-len", str(SEQ), "--micro",
                          str(MICRO), "--micro-batch", str(MB), "--json", str(path)],
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stdout + res.stderr
    data = json.loads(path.read_text())
    recs = {r["run"]: r for r in data["results"]}
    assert set(recs) == {"torch-1f1b", "commopt-1f1b", "commopt-1f1b-int8", "commopt-1f1b-aqsgd"}
    for r in recs.values():
        for key in ("run", "link_mbit", "step_s", "floor_s", "boundary_bytes", "held_out_loss", "peak_memory_bytes",
                    "sim_step_s"):
            assert key in r, key
        assert r["link_mbit"] is None and r["floor_s"] == r["step_s"] and len(r["step_times_s"]) == STEPS
        assert r["peak_memory_bytes"] > 0 and r["sim_step_s"] > 0 and r["run"] in res.stdout
    rows, elems = MB * SEQ, MB * SEQ * D
    fp32, int8, int4 = elems * 4 + 40, elems + 4 * rows + 40, elems // 2 + 4 * rows + 40
    assert recs["torch-1f1b"]["boundary_bytes"] == [{"fwd": MICRO * elems * 4, "bwd": MICRO * elems * 4}]
    assert recs["commopt-1f1b"]["boundary_bytes"] == [{"fwd": MICRO * fp32, "bwd": MICRO * fp32}]
    assert recs["commopt-1f1b-int8"]["boundary_bytes"] == [{"fwd": MICRO * int8, "bwd": MICRO * int8}]
    assert recs["commopt-1f1b-aqsgd"]["boundary_bytes"] == [{"fwd": MICRO * int4, "bwd": MICRO * int8}]
    assert recs["torch-1f1b"]["held_out_loss"] == recs["commopt-1f1b"]["held_out_loss"]
    assert recs["commopt-1f1b-int8"]["held_out_loss"] != recs["commopt-1f1b"]["held_out_loss"]
