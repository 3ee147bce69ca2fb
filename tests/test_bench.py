"""``commopt-bench`` itself: the main job's choice of where to run (issue 18, part 2), the columns of
the collectives table (none of nan: what does not apply is left out), and the one progress-bar
helper every long benchmark uses (issue 18, part 4).

The main job's sweep itself is a benchmark (a minute in the emulated cluster) and never runs here:
the tests check what it would run, by catching the subcommand it hands over to. The emulated
cluster's own probe is tested in test_cluster.py (it needs root).
"""

from __future__ import annotations

import io
import json
import shutil
import subprocess
import sys

import pytest
import torch

from commopt.bench import __main__ as bench_main
from commopt.bench import cluster as cl
from commopt.bench import collectives as coll
from commopt.bench._progress import progress, progress_enabled
from commopt.bench.cluster.cli import _build_parser

_SPAWN_TIMEOUT = 120.0


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


# ------------------------------------------------------------------------------------------------
# progress


def _draw(monkeypatch, stream: io.StringIO, setting: str | None, rank: int = 0) -> str:
    monkeypatch.setattr(sys, "stderr", stream)
    if setting is None:
        monkeypatch.delenv("COMMOPT_PROGRESS", raising=False)
    else:
        monkeypatch.setenv("COMMOPT_PROGRESS", setting)
    bar = progress(3, "sweep", rank=rank, unit="size")
    for _ in range(3):
        bar.update()
        bar.refresh()  # tqdm draws at most every 0.1 s by itself
    bar.close()
    return stream.getvalue()


def test_progress_bar_on_a_terminal_only_for_rank_0(monkeypatch):
    """A bar on stderr where it is a terminal, for rank 0 only; nothing in a log (CI)."""
    drawn = _draw(monkeypatch, _Terminal(), None)
    assert "sweep" in drawn and "3/3" in drawn and "size" in drawn
    assert _draw(monkeypatch, io.StringIO(), None) == ""          # a log file, a CI pipe
    assert _draw(monkeypatch, _Terminal(), None, rank=1) == ""    # other ranks never draw
    monkeypatch.setattr(sys, "stderr", io.StringIO())
    assert not progress_enabled(0)


def test_progress_setting_overrides_the_terminal_check(monkeypatch):
    """COMMOPT_PROGRESS=1 draws into a pipe (the emulated cluster's ranks), =0 keeps a terminal quiet."""
    assert "2/3" in _draw(monkeypatch, io.StringIO(), "1")
    assert _draw(monkeypatch, _Terminal(), "0") == ""
    assert _draw(monkeypatch, io.StringIO(), "1", rank=2) == ""


# ------------------------------------------------------------------------------------------------
# the main job


def _capture_subcommand(monkeypatch, module, code: int = 0) -> list[list[str]]:
    calls: list[list[str]] = []
    monkeypatch.setattr(module, "main", lambda argv: calls.append(list(argv)) or code)
    return calls


def test_main_job_runs_the_sweep_in_the_cluster_where_it_can(monkeypatch, capsys):
    """Where the cluster can run, the main job is `commopt-bench cluster` 2x2 at 200 Mbit/s around
    the collectives sweep of flat, hierarchical and auto, as the printed command says."""
    monkeypatch.setattr(bench_main, "cluster_unavailable", lambda: None)
    monkeypatch.delenv("TORCH_CPP_LOG_LEVEL", raising=False)  # the main job quiets c10d; restored after
    calls = _capture_subcommand(monkeypatch, cl, code=7)
    assert bench_main.main([]) == 7  # the cluster's exit code is the main job's
    assert len(calls) == 1
    argv = calls[0]
    cut = argv.index("--")
    launcher = _build_parser().parse_args(argv[:cut])
    assert (launcher.nodes, launcher.ranks_per_node, cl.parse_rate(launcher.link_rate)) == (2, 2, 200_000_000)
    assert launcher.placement == "contiguous" and launcher.timeout > 0  # the main job can never hang
    inner = argv[cut + 1:]
    assert inner[:4] == [sys.executable, "-m", "commopt.bench", "collectives"]
    sweep = coll._parser().parse_args(inner[4:])
    assert (sweep.op, sweep.algo) == ("allreduce", "flat,hierarchical,auto")
    assert sweep.sizes == coll.parse_sizes(bench_main.MAIN_JOB_SIZES) and max(sweep.sizes) == 16 << 20
    out = capsys.readouterr().out
    assert bench_main.CLUSTER_COMMAND in out and "200 Mbit/s" in out
    # The command shown is the one run, as a user would type it.
    assert bench_main.CLUSTER_COMMAND.split() == ["commopt-bench", "cluster", *argv[:cut - 2], "--",
                                                  "commopt-bench", "collectives", *inner[4:]]


def test_main_job_on_loopback_says_why_in_one_line(monkeypatch, capsys):
    """Elsewhere: 4 local ranks on a logical 2x2, and one line saying why the hierarchy cannot win
    there and which command shows it."""
    monkeypatch.setattr(bench_main, "cluster_unavailable", lambda: "it needs root: CAP_NET_ADMIN")
    calls = _capture_subcommand(monkeypatch, coll)
    assert bench_main.main([]) == 0
    args = coll._parser().parse_args(calls[0])
    assert (args.spawn, args.topology, args.op, args.algo) == (4, "2x2", "allreduce", "flat,hierarchical,auto")
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 1
    assert "(it needs root: CAP_NET_ADMIN)" in lines[0] and "cannot beat flat" in lines[0]
    assert lines[0].endswith(bench_main.CLUSTER_COMMAND)


def test_cluster_probe_reports_what_is_missing(monkeypatch):
    """Without the capabilities or iproute2 the probe says so without starting anything."""
    monkeypatch.setattr(cl.Cluster, "up", lambda self: pytest.fail("the probe built a cluster"))
    monkeypatch.setattr(cl, "parse_cap_eff", lambda text: 0)
    assert "root" in bench_main.cluster_unavailable()
    monkeypatch.setattr(cl, "parse_cap_eff", lambda text: (1 << cl.CAP_NET_ADMIN) | (1 << cl.CAP_SYS_ADMIN))
    monkeypatch.setattr(shutil, "which", lambda name: None)
    assert "iproute2" in bench_main.cluster_unavailable()


def test_cluster_probe_reports_unusable_namespaces(monkeypatch):
    """Privileges and tools present, but the kernel refuses: the failure's first line is the reason,
    and the probe's namespaces are torn down (down() runs)."""
    downs = []

    def refuse(self):
        raise cl.ClusterError("`ip -batch -` failed (code 2) on\nnetns add ...\nOperation not permitted")

    monkeypatch.setattr(cl, "parse_cap_eff", lambda text: (1 << cl.CAP_NET_ADMIN) | (1 << cl.CAP_SYS_ADMIN))
    monkeypatch.setattr(shutil, "which", lambda name: f"/sbin/{name}")
    monkeypatch.setattr(cl.Cluster, "up", refuse)
    monkeypatch.setattr(cl.Cluster, "down", lambda self: downs.append(self.prefix))
    reason = bench_main.cluster_unavailable()
    assert reason.startswith("network namespaces are not usable here") and "`ip -batch -` failed" in reason
    assert "\n" not in reason and len(downs) == 1


# ------------------------------------------------------------------------------------------------
# the collectives table: no column of nan


def _rows(topo, algos=("flat", "hierarchical", "torch")) -> list[dict]:
    from commopt.comm import cost
    from commopt.comm.collectives import select_algorithm

    return [coll._row("allreduce", algo, False, 1 << 20, 1 << 18, torch.float32, "sum", 0.05, 0,
                      topo.world_size, topo, None, select_algorithm, cost) for algo in algos]


def test_table_columns_follow_the_link_and_the_model():
    """Inside a cluster: the bound, link bytes and rate, both efficiencies; a logical 2x2 on one
    machine: the bound only; one node: nccl-tests' columns only. Never a nan."""
    from commopt.comm import Topology

    def table(rows, measured, link) -> list[str]:
        lines: list[str] = []
        coll._print_table(rows, measured, lines.append, link=link)
        return lines

    shaped = Topology(nodes=((0, 1), (2, 3)), rank=0, world_size=4, link_rate_bps=2e8)
    inside = table(_rows(shaped), 1.9e8, True)
    assert inside[0].split()[1:] == ["size", "count", "type", "redop", "algo", "time(us)", "algbw(GB/s)",
                                     "busbw(GB/s)", "#wrong", "bound(us)", "link(MB)", "linkbw(GB/s)",
                                     "eff(cfg)", "eff(meas)"]
    flat, hier = (line.split() for line in inside[1:3])
    assert float(flat[-4]) == pytest.approx(2 * 3 / 4 * (1 << 20) / 1e6, rel=1e-2)  # flat's ring on the link
    assert float(hier[-4]) == pytest.approx((1 << 20) / 1e6, rel=1e-2)              # 1/L of it per rail, x L
    unprobed = table(_rows(shaped), None, True)
    assert unprobed[0].split()[-1] == "eff(cfg)"
    logical = table(_rows(Topology(nodes=((0, 1), (2, 3)), rank=0, world_size=4)), None, False)
    assert logical[0].split()[-1] == "bound(us)"
    single = table(_rows(Topology(nodes=((0, 1, 2, 3),), rank=0, world_size=4), ("flat", "torch")), None, False)
    assert single[0].split()[-1] == "#wrong"
    for lines in (inside, unprobed, logical, single):
        assert all(len(line.split()) == len(lines[0].split()) - 1 for line in lines[1:])  # '#' heads the header
        assert "nan" not in "\n".join(lines)


def test_auto_choice_is_judged_against_the_algorithms_timed():
    """Below the speed-ups, what auto ran at each size against the others' times in the same run
    (its own timing of the same algorithm differs from theirs by noise): the fastest, how much
    faster another was, or that what it ran was not timed on its own."""
    rows = []
    for size, (flat, hier, auto), ran in ((65536, (100.0, 120.0, 110.0), "flat"),
                                          (1 << 20, (200.0, 150.0, 190.0), "leader"),
                                          (4 << 20, (300.0, 200.0, 290.0), "flat")):
        rows += [{"op": "allreduce", "size": size, "algo": "flat", "time_us": flat},
                 {"op": "allreduce", "size": size, "algo": "hierarchical", "time_us": hier},
                 {"op": "allreduce", "size": size, "algo": "auto", "time_us": auto, "chosen": ran}]
    lines: list[str] = []
    coll._print_ratios(rows, lines.append)
    head = lines.index("# auto's choice against the algorithms timed in this run")
    assert [" ".join(line.split()[1:]) for line in lines[head + 1:]] == [
        "allreduce 64K: ran flat, the fastest",
        "allreduce 1M: ran leader (not timed on its own here)",
        "allreduce 4M: ran flat, hierarchical was 1.500x faster"]


def _spawned(tmp_path, *args: str) -> tuple[str, dict]:
    path = tmp_path / "rows.json"
    res = subprocess.run([sys.executable, "-m", "commopt.bench", "collectives", "--spawn", "2", "--iters", "3",
                          "--warmup", "1", "--no-calibrate", "--sizes", "1K,8K", "--json", str(path), *args],
                         capture_output=True, text=True, timeout=_SPAWN_TIMEOUT)
    assert res.returncode == 0, res.stdout + res.stderr
    return res.stdout, json.loads(path.read_text())


def test_spawned_sweep_leaves_out_what_does_not_apply(tmp_path):
    """Real runs on loopback (2 ranks): one node has no bound and no link columns; a logical 2x1 has
    the model's bound but no link columns (no bytes cross a link); --algo torch runs beside ours.
    Nothing prints nan and the JSON holds no NaN (it stays valid JSON)."""
    out, data = _spawned(tmp_path, "--algo", "flat,torch")
    header = next(line for line in out.splitlines() if line.split()[:2] == ["#", "size"])
    assert header.split()[-1] == "#wrong" and "nan" not in out
    assert {r["algo"] for r in data["rows"]} == {"flat", "torch"} and all(r["wrong"] == 0 for r in data["rows"])
    assert "bound_us" not in data["rows"][0] and data["meta"]["inter_node_link"] is False

    out, data = _spawned(tmp_path, "--topology", "2x1", "--algo", "flat,hierarchical,torch")
    header = next(line for line in out.splitlines() if line.split()[:2] == ["#", "size"])
    assert header.split()[-1] == "bound(us)" and "link(MB)" not in header and "nan" not in out
    assert all(r["bound_us"] > 0 for r in data["rows"])
    assert data["meta"]["inter_node_link"] is False and data["meta"]["num_nodes"] == 2
    assert "NaN" not in json.dumps(data)


def test_ddp_hook_at_algorithm_names_what_can_run():
    """``commopt-bench ddp --hooks HOOK@ALGORITHM``: commopt's hooks on any algorithm that carries them
    (the exact one on any all-reduce algorithm); a torch hook, an unknown algorithm, a codec on an
    algorithm that cannot carry it, or a hook named twice is refused before anything starts, naming why
    (exit code 2)."""
    from commopt.bench import ddp
    from commopt.comm import algorithms

    assert ddp._check_hooks(["ddp", "bf16@hierarchical", "bf16@synth", "int8@auto", "exact@synth"]) is None
    carry = set(algorithms.names("allreduce", codec=True))
    exact_only = [a for a in algorithms.names("allreduce") if a not in carry]
    for hooks, why in ((["torch-fp16@synth"], "only commopt's hooks"), (["ddp@flat"], "only commopt's hooks"),
                       (["powersgd-hier@synth"], "only commopt's hooks"), (["bf16@ring9"], "not 'ring9'"),
                       (["bf16", "bf16"], "named twice"), (["nope@flat"], "unknown hook")):
        assert why in ddp._check_hooks(hooks), hooks
    for a in exact_only:  # exact runs on them; a codec does not
        assert ddp._check_hooks([f"exact@{a}"]) is None
        assert "bf16 runs on one of" in ddp._check_hooks([f"bf16@{a}"])
    assert ddp.main(["--hooks", "fp16@nowhere"]) == 2
