"""``commopt-bench plot`` and ``--plot`` (bench/plot.py; issue 18, part 3).

The JSON comes from real runs of the benchmarks on two spawned ranks with tiny sizes, so the schema
the plots read is the one the benchmarks write. Each plot function returns what it drew, read back
from the figure's artists; the tests hold those series against the JSON, and check that the PNG
exists and is a PNG of the expected size. No test looks at a time or a rate (docs/architecture.md section 9.4).
"""

from __future__ import annotations

import json
import struct
import subprocess
import sys

import pytest

pytest.importorskip("matplotlib")

from commopt.bench import plot  # noqa: E402

_TIMEOUT = 120.0
_PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def _png_size(path) -> tuple[int, int]:
    """(width, height) from the IHDR chunk of a PNG, failing if the file is not one."""
    data = path.read_bytes()
    assert data[:8] == _PNG_SIGNATURE, f"{path} is not a PNG"
    assert data[12:16] == b"IHDR"
    assert data[-8:-4] == b"IEND"  # written to the end
    return struct.unpack(">II", data[16:24])


def _bench(*argv: str) -> subprocess.CompletedProcess:
    res = subprocess.run([sys.executable, "-m", "commopt.bench", *argv], capture_output=True, text=True,
                         timeout=_TIMEOUT)
    assert res.returncode == 0, res.stdout + res.stderr
    return res


@pytest.fixture(scope="module")
def collectives_run(tmp_path_factory):
    """A real sweep: 2 ranks as a logical 2x1, flat, hierarchical and torch, 3 sizes."""
    d = tmp_path_factory.mktemp("collectives")
    _bench("collectives", "--spawn", "2", "--topology", "2x1", "--algo", "flat,hierarchical,torch",
           "--sizes", "1K,4K,16K", "--iters", "3", "--warmup", "1", "--no-calibrate",
           "--json", str(d / "sweep.json"), "--plot", str(d / "sweep.png"))
    return d


@pytest.fixture(scope="module")
def ddp_run(tmp_path_factory):
    """A real training comparison: 2 ranks, four hooks (fp16 twice: on the default algorithm and named
    on flat), a tiny GPT, four steps."""
    d = tmp_path_factory.mktemp("ddp")
    _bench("ddp", "--spawn", "2", "--hooks", "ddp,exact,fp16,fp16@flat", "--steps", "4", "--warmup-steps", "0",
           "--d-model", "16", "--layers", "1", "--seq-len", "8", "--batch", "2",
           "--json", str(d / "ddp.json"), "--plot", str(d / "ddp.png"))
    return d


def test_collectives_plot_draws_the_json(collectives_run, tmp_path):
    """busbw per algorithm against size, the bound per algorithm (torch's repeats flat's: not drawn)
    and the measured and predicted speed-up against flat, all equal to the JSON's rows; labelled
    axes with units, log-scale sizes, a legend, and a title naming the topology and its link."""
    width, height = _png_size(collectives_run / "sweep.png")  # written by --plot during the run
    assert width > 600 and height > 300
    data = json.loads((collectives_run / "sweep.json").read_text())
    drawn = plot.plot_collectives(data, str(tmp_path / "again.png"))
    assert _png_size(tmp_path / "again.png") == (width, height)
    scale = {"GB/s": 1.0, "MB/s": 1e3}[drawn["unit"]]
    rows = {(r["algo"], r["size"]): r for r in data["rows"]}
    sizes = [1024, 4096, 16384]
    assert sorted(drawn["busbw"]) == ["allreduce/flat", "allreduce/hierarchical", "allreduce/torch"]
    assert sorted(drawn["bound"]) == ["allreduce/flat", "allreduce/hierarchical"]
    assert sorted(drawn["speedup"]) == ["allreduce/hierarchical", "allreduce/torch"]
    for algo in ("flat", "hierarchical", "torch"):
        xs, ys = drawn["busbw"][f"allreduce/{algo}"]
        assert xs == sizes
        assert ys == pytest.approx([rows[(algo, s)]["busbw"] * scale for s in sizes])
    for algo in ("flat", "hierarchical"):
        xs, ys = drawn["bound"][f"allreduce/{algo}"]
        r = [rows[(algo, s)] for s in sizes]
        assert xs == sizes and ys == pytest.approx([x["busbw"] * x["time_us"] / x["bound_us"] * scale for x in r])
    for algo in ("hierarchical", "torch"):
        xs, ys = drawn["speedup"][f"allreduce/{algo}"]
        assert ys == pytest.approx([rows[("flat", s)]["time_us"] / rows[(algo, s)]["time_us"] for s in sizes])
    xs, ys = drawn["predicted_speedup"]["allreduce/hierarchical"]
    assert ys == pytest.approx([rows[("flat", s)]["bound_us"] / rows[("hierarchical", s)]["bound_us"] for s in sizes])
    left, right = drawn["axes"]
    assert left["xscale"] == right["xscale"] == "log" and left["legend"] and right["legend"]
    assert "bytes" in left["xlabel"] and drawn["unit"] in left["ylabel"] and "flat" in right["ylabel"]
    assert "2 ranks" in drawn["title"] and "2x1" in drawn["title"] and "no inter-node link" in drawn["title"]


def test_collectives_plot_titles_the_link(tmp_path):
    """Inside the cluster the title names the configured and the measured link rate (rows as the
    cluster run writes them: with link figures)."""
    row = {"op": "allreduce", "validate": False, "size": 1 << 20, "count": 1 << 18, "type": "float32",
           "redop": "sum", "wrong": 0, "link_bytes": 1.5e6, "link_busbw": 0.02, "eff_cfg": 0.9}
    data = {"meta": {"world_size": 4, "topology": "0,1;2,3", "num_nodes": 2, "link_rate_bps": 200_000_000,
                     "link_measured_bps": 191_000_000, "inter_node_link": True, "dtype": "float32"},
            "rows": [{**row, "algo": "flat", "time_us": 7e4, "algbw": 0.015, "busbw": 0.0225, "bound_us": 7.1e4},
                     {**row, "algo": "auto", "chosen": "hierarchical", "time_us": 4.7e4, "algbw": 0.022,
                      "busbw": 0.033, "bound_us": 4.7e4}]}
    drawn = plot.plot_collectives(data, str(tmp_path / "c.png"))
    assert "2x2" in drawn["title"] and "200 Mbit/s inter-node link (191 measured)" in drawn["title"]
    assert drawn["unit"] == "MB/s" and drawn["busbw"]["allreduce/auto"][1] == pytest.approx([33.0])
    assert drawn["speedup"]["allreduce/auto"][1] == pytest.approx([7e4 / 4.7e4])
    _png_size(tmp_path / "c.png")


def test_ddp_plot_draws_the_json(ddp_run, tmp_path):
    """Step time and final loss per hook and every loss curve, equal to the JSON's results."""
    width, height = _png_size(ddp_run / "ddp.png")
    assert width > 600 and height > 400
    data = json.loads((ddp_run / "ddp.json").read_text())
    assert data["world_size"] == 2
    drawn = plot.plot_ddp(data, str(tmp_path / "again.png"))
    _png_size(tmp_path / "again.png")
    results = {r["hook"]: r for r in data["results"]}
    assert list(drawn["step_ms"]) == ["ddp", "exact", "fp16", "fp16@flat"]
    # HOOK@ALGORITHM: fp16 named on flat, the default algorithm, trains to the same bits with the same bytes
    assert results["fp16@flat"]["losses"] == results["fp16"]["losses"]
    assert results["fp16@flat"]["bytes_per_step"] == results["fp16"]["bytes_per_step"]
    for hook, r in results.items():
        assert drawn["step_ms"][hook] == pytest.approx(r["step_ms"])
        assert drawn["final_loss"][hook] == pytest.approx(r["losses"][-1])
        steps, losses = drawn["loss"][hook]
        assert steps == list(range(4)) and losses == pytest.approx(r["losses"])
    step_axes, loss_axes, curve_axes = drawn["axes"]
    assert "ms" in step_axes["xlabel"] and step_axes["legend"] and "loss" in loss_axes["xlabel"]
    assert curve_axes["xlabel"] == "training step" and curve_axes["legend"]
    assert "2 ranks" in drawn["title"] and "d=16" in drawn["title"]


def test_plot_command(collectives_run, ddp_run, tmp_path, capsys):
    """`commopt-bench plot RESULTS.json` writes RESULTS.png beside it (or -o); what it cannot read is
    exit code 2 with the reason."""
    sweep = tmp_path / "sweep.json"
    sweep.write_text((collectives_run / "sweep.json").read_text())
    assert plot.main([str(sweep)]) == 0
    _png_size(tmp_path / "sweep.png")
    assert plot.main([str(ddp_run / "ddp.json"), "-o", str(tmp_path / "d.png")]) == 0
    _png_size(tmp_path / "d.png")
    assert "ddp results" in capsys.readouterr().out
    other = tmp_path / "other.json"
    other.write_text(json.dumps({"rounds": {}}))
    assert plot.main([str(other)]) == 2
    assert "expected `commopt-bench collectives --json`" in capsys.readouterr().err
    assert plot.main([str(tmp_path / "missing.json")]) == 2
    assert not (tmp_path / "other.png").exists() and not (tmp_path / "missing.png").exists()


def test_bench_tp_quick_and_its_plot(tmp_path):
    """``commopt-bench tp --quick`` on 2 spawned ranks: the block (torch's plan, commopt's styles as they
    choose and with the ring forced, which the benchmark itself checks equal torch's output) and
    attention (all-gathered, ring, Ulysses) each with their compute-alone and communication-alone
    references; each row's derived columns follow from its own times, and each has its peak memory
    (issue 38 item 7); the JSON says what the default styles ran; the plot draws the JSON's steps and
    references."""
    path = tmp_path / "tp.json"
    res = subprocess.run([sys.executable, "-m", "commopt.bench", "tp", "--spawn", "2", "--quick", "--json", str(path)],
                         capture_output=True, text=True, timeout=_TIMEOUT)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    data = json.loads(path.read_text())
    assert data["kind"] == "tp" and data["world"] == 2
    rows = {r["variant"]: r for r in data["results"]}
    assert list(rows) == ["torch plan", "commopt styles", "commopt ring", "attention gathered", "ring attention",
                          "ring attention keep_kv", "ulysses attention"]
    assert data["memory"] in ("rss", "rss, lifetime")
    assert set(data["choices"]) == {"qkv", "out", "fc1", "fc2"}
    assert all(set(c.split("/")) <= {"ring", "torch"} for c in data["choices"].values()), data["choices"]
    for r in rows.values():
        assert r["step_s"] > 0 and r["compute_s"] > 0 and r["comm_s"] > 0
        assert r["peak_memory_bytes"] > 2**20, r  # the process's resident set: torch alone is larger
        assert r["step_over_max"] == pytest.approx(r["step_s"] / max(r["compute_s"], r["comm_s"]))
        assert r["exposed_s"] == pytest.approx(max(r["step_s"] - r["compute_s"], 0.0))
    assert rows["torch plan"]["speedup"] == 1.0 and rows["attention gathered"]["speedup"] == 1.0
    # The simulator's step for the block's two plans, fitted to this run's compute and communication
    # alone: unfused is their sum, decomposed no more than that and no less than the larger.
    # The default styles' row takes the model of the path they ran (both where the Linears differ: none).
    torch_plan, ring = rows["torch plan"], rows["commopt ring"]
    assert torch_plan["sim_s"] == pytest.approx(torch_plan["compute_s"] + torch_plan["comm_s"], rel=1e-6)
    assert max(ring["compute_s"], ring["comm_s"]) * (1 - 1e-6) <= ring["sim_s"] <= torch_plan["sim_s"]
    paths = set("/".join(data["choices"].values()).split("/"))
    expected = {frozenset({"ring"}): ring["sim_s"], frozenset({"torch"}): torch_plan["sim_s"]}.get(frozenset(paths))
    assert rows["commopt styles"]["sim_s"] == expected
    assert all(rows[v]["sim_s"] is None for v in ("attention gathered", "ring attention", "ring attention keep_kv",
                                                  "ulysses attention"))
    assert "commopt styles" in res.stdout and "ring attention" in res.stdout
    drawn = plot.plot(data, str(tmp_path / "tp.png"))
    _png_size(tmp_path / "tp.png")
    assert drawn["step_ms"] == pytest.approx({v: 1e3 * r["step_s"] for v, r in rows.items()})
    assert drawn["compute_ms"]["block"] == pytest.approx(1e3 * rows["torch plan"]["compute_s"])
    assert drawn["comm_ms"]["attention"] == pytest.approx(1e3 * rows["ring attention"]["comm_s"])
    assert "TP 2" in drawn["title"]
