"""``fsdp.shard``, the ZeRO++ recipe (issues 27 and 38): its ``"auto"`` choice, the FSDP2-native parts it
may choose, its arguments, a run resumed from a checkpoint, and ``commopt-bench fsdp``.

Oracles: FSDP2 without custom comms on the same model and data (the native parts, bit for bit), torch's
own gloo reduce-scatter (commopt's bounded issue of it, bit for bit), and the uninterrupted run (a
resumed one, bit for bit). docs/faults.md rows 33 (arguments refused on every rank before anything
runs), 34 (native parts equal FSDP2), 36 (a resumed run keeps the recipe of the run it resumes).
The model, data and native FSDP2 are tests/test_fsdp.py's.
"""

from __future__ import annotations

import contextlib
import importlib
import io
import json
import math
import subprocess
import sys
import warnings
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
from test_fsdp import _full_grads, _full_params, _model, _native, _steps, _topo, _train
from torch.distributed import ReduceOp
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy

from commopt.comm import Topology, context, fsdp
from commopt.comm import compression as C


# ------------------------------------------------------------------------------------------ shard("auto")
def _body_auto_recipe(spec: str) -> dict:
    """``fsdp.shard(m)`` with its defaults: the recipe it chose and what it registered, its printed line,
    the timeout of hpZ's node groups against WORLD's, 3 training steps; then the argument errors and hpZ
    where it cannot be on."""
    from commopt.comm.fsdp import AUTO_MARGIN
    from commopt.comm.runtime import _backend_timeout

    topo = _topo(spec)
    m = _model()
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        comms = fsdp.shard(m, topology=topo)
    codecs = {"weights": comms.all_gather, "gradients": comms.reduce_scatter}  # "native": FSDP2's own
    hpz_groups = [pg.post_forward_mesh_info.shard_process_group for mod in m.modules() if isinstance(mod, FSDPModule)
                  for pg in mod._get_fsdp_state()._fsdp_param_groups if pg.post_forward_mesh_info is not None]
    timeouts = {str(_backend_timeout(g)) for g in hpz_groups} | {"WORLD " + str(_backend_timeout(dist.group.WORLD))}
    losses = _train(m, 3)
    errors = []
    for kwargs in ({"weights": "int8"}, {"gradients": "yes"}, {"hpz": "on"}):
        try:
            fsdp.shard(_model(), topology=topo, **kwargs)
        except ValueError as exc:
            errors.append(str(exc))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        uneven = fsdp.shard(_model(), topology=Topology.from_nodes([[0, 1, 2], [3]]), weights=None, gradients=None)
    return {"recipe": comms.recipe, "codecs": {k: "native" if c.algorithm == "native" else None if c.compressor is None
                                               else (type(c.compressor).__name__, c.compressor.bits)
                                               for k, c in codecs.items()},
            "printed": printed.getvalue(), "losses": losses, "errors": errors, "margin": AUTO_MARGIN,
            "hpz_groups": len(hpz_groups), "timeouts": timeouts,
            "uneven_recipe": uneven.recipe, "warned": [str(w.message) for w in caught if "hpZ" in str(w.message)]}


def test_shard_auto_decides_once_the_same_everywhere(ranks):
    """Issue 27 item 4b: ``fsdp.shard(model)`` times the largest unit's all-gather and reduce-scatter exact
    and compressed, every rank takes the same decision (the slowest rank's times), the rule is the
    documented one (compressed only at <= AUTO_MARGIN of the exact time), what it registered is what it
    says, rank 0 alone prints it, training runs; hpZ "auto" is on for a 2x2 and silently off on 3+1, and
    its node groups wait as long as WORLD (docs/faults.md row 4: torch made them with its 30-minute default,
    so a collective of FSDP2's own stuck on one held its group for that long);
    a string other than "auto" is a ValueError at the call (docs/faults.md row 33)."""
    out = ranks(4, _body_auto_recipe, "2x2", timeout=180)
    recipe = out[0]["recipe"]
    assert all(o["recipe"] == recipe for o in out)
    secs, margin = recipe["seconds"], out[0]["margin"]
    assert set(secs) == {f"{p}/{label}" for p, c in (("weights", "int8"), ("gradients", "int4"))
                         for label in ("native", "exact", c)}
    assert all(t > 0 for t in secs.values())
    for part, label, bits in (("weights", "int8", 8), ("gradients", "int4", 4)):
        exact = min(("native", "exact"), key=lambda lbl: secs[f"{part}/{lbl}"])
        wins = secs[f"{part}/{label}"] <= margin * secs[f"{part}/{exact}"]
        assert recipe[part] == (label if wins else exact), (part, secs)
        expected = ("QuantizeCompressor", bits) if wins else (None if exact == "exact" else "native")
        assert out[0]["codecs"][part] == expected, (part, out[0]["codecs"], secs)
    assert recipe["hpz"] is True
    for o in out:  # one timeout: WORLD's, also the hpZ groups'
        assert o["hpz_groups"] == 3 and len(o["timeouts"]) == 2, o["timeouts"]
        world = next(t for t in o["timeouts"] if t.startswith("WORLD "))
        assert {world.removeprefix("WORLD "), world} == o["timeouts"], o["timeouts"]
    assert recipe["weights"] in out[0]["printed"] and "fsdp.shard" in out[0]["printed"]
    assert all(o["printed"] == "" for o in out[1:])
    assert all(math.isfinite(v) for o in out for v in o["losses"])
    for o in out:
        assert len(o["errors"]) == 3 and all("fsdp.shard" in e for e in o["errors"]), o["errors"]
        assert o["uneven_recipe"] is None and o["warned"] == []


# ------------------------------------------------------------------------------------------ benchmark
def test_bench_fsdp_quick(tmp_path):
    """``commopt-bench fsdp --quick``: every run asked for (one of each kind: the floor, DDP, torch's FSDP2 and
    HSDP, commopt's exact, ZeRO++ and compressed HSDP comms) appears in the JSON with a step time, its peak
    memory (issue 38: hpZ trades memory for bytes; what it reads is named once), a loss and the simulator's
    two predictions (DDP: one), and the simulator's inputs are recorded; the numbers themselves are the
    benchmark's, not asserted here."""
    path = tmp_path / "fsdp.json"
    asked = ["compute", "ddp", "fsdp2", "hsdp", "hierarchical", "zero++", "hsdp-powersgd"]
    res = subprocess.run([sys.executable, "-m", "commopt.bench", "fsdp", "--spawn", "4", "--topology", "2x2",
                          "--quick", "--steps", "2", "--runs", ",".join(asked), "--json", str(path)],
                         capture_output=True, text=True, timeout=150)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    data = json.loads(path.read_text())
    rows = {r["run"]: r for r in data["results"]}
    from commopt.bench.fsdp import RUNS

    assert list(rows) == asked and set(asked) <= set(RUNS)
    for name, r in rows.items():
        assert "skipped" not in r, r
        assert r["step_ms"] > 0 and math.isfinite(r["final_loss"]), r
        assert isinstance(r["peak_memory_bytes"], int) and r["peak_memory_bytes"] > 0, r
        if name != "compute":
            assert r["predicted_ms"] > 0, r
            assert (name == "ddp") != (r.get("predicted_ms_measured_collectives", 0) > 0), r
    assert rows["fsdp2"]["link_bytes_per_step"] > rows["zero++"]["link_bytes_per_step"] > 0
    inputs = data["simulator_inputs"]
    assert set(inputs["floors_ms"]) == {"ddp", "fsdp", "hsdp"} and len(inputs["units"]) == 3  # root + 2 blocks
    # FSDP2's work between two prefetched all-gathers: some CPU, less than a step
    assert set(inputs["prefetch_gap_ms"]) == {"fsdp", "hsdp"}
    assert all(0 < gap < inputs["floors_ms"]["fsdp"][0] for gap in inputs["prefetch_gap_ms"].values()), inputs
    assert data["peak_memory_kind"] in ("rss", "rss, lifetime"), data["peak_memory_kind"]
    assert "vs fsdp2" in res.stdout and "target" in res.stdout and "peak MiB" in res.stdout


# ------------------------------------------------------------------------------------------ native parts
def _body_native(spec: str) -> dict:
    """``weights="native", gradients="native"`` (what "auto" registers where FSDP2's own collective timed
    fastest): FSDP2's own collectives, issued by commopt's comms under a deadline, against FSDP2 without
    custom comms on the same model and data: every step's gradients and the parameters bit for bit, with
    and without prefetch, in fp32 and with a bf16 reduction, and ``shard_hsdp(intra=False)`` too; the
    comms served every call. And gloo's
    reduce-scatter as ``_transport.reduce_scatter_single`` issues it asynchronously (an all-reduce of a
    copy, with a future and a bounded wait), against torch's own call, bit for bit."""
    from commopt.comm.algorithms._transport import _torch_reduce_scatter, reduce_scatter_single

    rank, world = dist.get_rank(), dist.get_world_size()
    g = torch.Generator().manual_seed(rank)
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        for op in (ReduceOp.SUM, ReduceOp.AVG):
            x = torch.randn(world * 37, generator=g).to(dtype)
            ref, got, via_future = (torch.empty(37, dtype=dtype) for _ in range(3))
            _torch_reduce_scatter(ref, x, op=op)
            reduce_scatter_single(got, x, op=op, async_op=True).wait(timedelta(seconds=30))
            reduce_scatter_single(via_future, x, op=op, async_op=True).get_future().wait()
            assert torch.equal(ref, got) and torch.equal(ref, via_future), (dtype, op)
    topo = _topo(spec)
    engine = context().engine()
    out = {}
    for mp in (None, MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16)):
        ref_grads: list = []
        ref = _native(mp=mp)
        _train(ref, 3, every=lambda _s, m=ref, sink=ref_grads: sink.append(_full_grads(m)))
        for prefetch in (True, False):
            m = _model()
            comms = fsdp.shard(m, topology=topo, weights="native", gradients="native", hpz=False, prefetch=prefetch,
                               mp_policy=mp, timeout=60)
            assert comms.reduce_scatter.algorithm == comms.all_gather.algorithm == "native"
            engine.reset_stats()
            grads: list = []
            _train(m, 3, every=lambda _s, m=m, sink=grads: sink.append(_full_grads(m)))
            what = (None if mp is None else "bf16", prefetch)
            for step, (a, b) in enumerate(zip(grads, ref_grads)):
                assert all(torch.equal(a[n], b[n]) for n in b), (what, step)
            ref_params = _full_params(ref)
            assert all(torch.equal(p, ref_params[n]) for n, p in _full_params(m).items()), what
            calls = engine.calls()
            assert calls.get("fsdp/reduce_scatter/native", 0) >= 3 * 3, (what, calls)  # 3 units x 3 steps
            assert calls.get("fsdp/all_gather/native", 0) >= 3 * 3, (what, calls)
            out[str(what)] = calls
        if mp is None:
            # shard_hsdp without ``intra``: FSDP2's own collectives inside the node, the same way (one node:
            # the hook's rail is this rank alone, so this is FSDP2 over the node).
            m = _model()
            comms = fsdp.shard_hsdp(m, None, topology=topo, intra=False, timeout=60)
            assert comms.reduce_scatter.algorithm == comms.all_gather.algorithm == "native"
            engine.reset_stats()
            grads = []
            _train(m, 3, every=lambda _s, m=m, sink=grads: sink.append(_full_grads(m)))
            assert all(torch.equal(a[n], b[n]) for a, b in zip(grads, ref_grads) for n in b), "hsdp, intra=False"
            assert engine.calls().get("fsdp/reduce_scatter/native", 0) >= 3 * 3, engine.calls()
    return out


def test_native_parts_are_fsdp2_own_collectives_bit_for_bit(ranks):
    """docs/faults.md row 34 for the parts ``fsdp.shard`` hands to FSDP2's own collective: they now run
    through commopt's comms (``algorithm="native"``), so that the user's timeout and commopt's errors
    cover them (tests/test_fsdp_faults.py), and keep FSDP2's numerics bit for bit."""
    ranks(2, _body_native, "1x2", timeout=180)


# ------------------------------------------------------------------------------------------ resume
def _shard_timed(topo: Topology, margin: float):
    """``fsdp.shard(model)`` with its "auto" as this cluster times it, but ``AUTO_MARGIN`` set to
    ``margin`` for the call: 1e9 takes every compressed collective, 0 none (the choice a run on another
    day, or under other load, can make)."""
    register = importlib.import_module("commopt.comm.fsdp.register")
    saved = register.AUTO_MARGIN
    register.AUTO_MARGIN = margin
    try:
        m = _model()
        with contextlib.redirect_stdout(io.StringIO()):
            comms = fsdp.shard(m, topology=topo)
    finally:
        register.AUTO_MARGIN = saved
    return m, comms, torch.optim.SGD(m.parameters(), lr=0.1)


def _body_resume(spec: str, total: int, split: int) -> dict:
    """A run whose "auto" chose int8 weights and int4 gradients (error feedback) is checkpointed at
    ``split`` (shards, and ``comms.state_dict()`` with the recipe, torch.save); the resumed run, rebuilt
    from scratch, times a choice of no compression at all; the documented resume path (shard, then
    ``comms.load_state_dict`` of the ``weights_only=True`` load) registers the saved choice again on every
    module and restores the residuals: the continuation is bit-identical to the uninterrupted run.
    Without the comms' state (the resumed run's own choice) it is not."""
    topo = _topo(spec)
    m, comms, opt = _shard_timed(topo, 1e9)
    assert (comms.recipe["weights"], comms.recipe["gradients"]) == ("int8", "int4"), comms.recipe
    _steps(m, opt, 0, total)
    straight = {n: p.to_local().clone() for n, p in m.named_parameters()}
    m, comms, opt = _shard_timed(topo, 1e9)
    _steps(m, opt, 0, split)
    buf = io.BytesIO()
    torch.save({"model": {n: p.to_local().clone() for n, p in m.named_parameters()}, "comms": comms.state_dict()}, buf)
    out = {}
    for restore_comms in (True, False):
        m, comms, opt = _shard_timed(topo, 0.0)
        chosen = (comms.recipe["weights"], comms.recipe["gradients"])
        assert "int8" not in chosen and "int4" not in chosen, comms.recipe
        state = torch.load(io.BytesIO(buf.getvalue()), weights_only=True)
        with torch.no_grad():
            for n, p in m.named_parameters():
                p.to_local().copy_(state["model"][n])
        if restore_comms:
            assert state["comms"]["recipe"] == {"weights": "int8", "gradients": "int4", "hpz": comms.recipe["hpz"]}
            comms.load_state_dict(state["comms"])
            assert (comms.recipe["weights"], comms.recipe["gradients"]) == ("int8", "int4"), comms.recipe
            assert comms.reduce_scatter.compressor.bits == 4 and comms.all_gather.compressor.bits == 8
        _steps(m, opt, split, total)
        same = all(torch.equal(p.to_local(), straight[n]) for n, p in m.named_parameters())
        assert same == restore_comms, f"restored comms: {restore_comms}, bit-identical: {same} (resumed with {chosen})"
        out[restore_comms] = chosen
    return out


def test_a_resumed_run_keeps_the_recipe_of_the_run_it_resumes(ranks):
    """docs/faults.md row 36 with ``fsdp.shard``'s "auto": the timed choice is saved in ``comms.state_dict()``
    and restored by ``load_state_dict`` whatever the resumed run's own timing says, so a run resumed from a
    checkpoint is bit-identical to the uninterrupted one (before, it trained with the comms its own timing
    chose: a differently rounded run, or a ValueError on the residuals)."""
    ranks(2, _body_resume, "1x2", 5, 2, timeout=150)


# ------------------------------------------------------------------------------------------ arguments
def _body_arguments(spec: str) -> dict:
    """Every bad argument of ``fsdp.shard`` is refused on every rank before anything collective or timed
    (nothing printed, the model not sharded), whichever part "auto" would have chosen: before, ``seed``
    was checked only by a reduce-scatter comm that "auto" registered, never where it chose FSDP2's own. A
    topology spec string is taken (``Topology.from_spec``), by ``shard_hsdp`` too; another type is a
    TypeError naming Topology (before: AttributeError)."""
    bad = [({"seed": "x"}, TypeError, "seed"), ({"timeout": -1}, ValueError, "timeout"),
           ({"algorithm": "bogus"}, ValueError, "bogus"), ({"error_feedback": "yes"}, TypeError, "error_feedback"),
           ({"prefetch": None}, TypeError, "prefetch"), ({"mp_policy": "bf16"}, TypeError, "mp_policy"),
           ({"weights": C.PowerSGDCompressor()}, TypeError, "PowerSGD"), ({"gradients": "int4"}, ValueError, "int4"),
           ({"hpz": 1}, ValueError, "hpz"), ({"topology": 4}, TypeError, "Topology"),
           ({"topology": [[0, 1]]}, TypeError, "Topology")]
    errors = []
    for kwargs, cls, word in bad:
        for parts in ({}, {"weights": "native", "gradients": "native"}):
            m = _model()
            printed = io.StringIO()
            with contextlib.redirect_stdout(printed), pytest.raises(cls) as info:
                fsdp.shard(m, **{**parts, **kwargs})
            assert word in str(info.value) and "fsdp.shard" in str(info.value), (kwargs, parts, str(info.value))
            assert printed.getvalue() == "" and not isinstance(m, FSDPModule), (kwargs, parts)
            errors.append(str(info.value))
    for call in (lambda: fsdp.shard_hsdp(_model(), topology=2.0), lambda: fsdp.shard_hsdp(_model(), topology=b"2x1")):
        with pytest.raises(TypeError, match="Topology"):
            call()
    comms = fsdp.shard(_model(), topology=spec, weights=None, gradients=None)
    hsdp = fsdp.shard_hsdp(_model(), topology="2x1")
    return {"errors": errors, "layouts": [comms.reduce_scatter.resolve().layout, hsdp.all_reduce.resolve().layout],
            "expected": [Topology.from_spec(spec).layout, Topology.from_spec("2x1").layout]}


def test_shard_refuses_bad_arguments_whichever_part_is_chosen(ranks):
    """docs/faults.md row 33 for ``fsdp.shard``: bad arguments are a clear error on every rank, the same
    everywhere, before any timing or sharding; a topology may be given as a spec string."""
    out = ranks(2, _body_arguments, "1x2", timeout=120)
    assert out[0]["errors"] == out[1]["errors"]
    for o in out:
        assert o["layouts"] == o["expected"], o


