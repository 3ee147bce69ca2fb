"""FSDP2 failures reach the caller (issue 23, item 2): stalls, kills, deadlines, frozen parameters,
NonFiniteError.

Rows covered here for ``commopt.comm.fsdp``: 5 (FSDP2): a rank that stalls before forward (or
before backward, hpZ), or is killed, makes every other rank's next forward (backward) raise within
the timeout plus slack, in training and in an evaluation loop (forward only, no grad), with
prefetched asynchronous all-gathers, and (issue 38) with prefetch off, inside an evaluation forward
(hpZ: the other node evaluates on) and when a part of the recipe is FSDP2's own collective; 5 and 30:
no engine thread outlives destroy() after a stalled or killed peer; 4 (FSDP2): every phase of one
comm call shares the call's deadline, so a call with a slow first phase still raises within its
timeout, FSDP2's own collectives included (``"native"``); 34 and 20 (FSDP2):
frozen (``requires_grad=False``) and unused parameters train with every comm as native FSDP2 /
native HSDP train them (exact comms equal, quantized ones within their bound), error feedback kept
for the trainable ones; 35: with ``check_finite=True`` a ``NonFiniteError`` backward leaves every
residual as it was before it.

Stall and kill cases run in fresh worlds (``RankPool`` made in the test): each case of a matrix
re-initialises the process group on a store of its own, with gloo's own timeout short, as
test_faults.py does, so a timed-out call never leaves its groups to the next case.
"""

from __future__ import annotations

import gc
import os
import signal
import threading
import time
from datetime import timedelta

import torch
import torch.distributed as dist
from _pool import RankPool
from torch import nn
from torch.distributed import ReduceOp

from commopt.comm import Topology, context, destroy, fsdp
from commopt.comm import compression as C
from commopt.comm.errors import CommError, NonFiniteError

TIMEOUT = 3.0  # seconds a comm call may take before the survivors give up
SETUP = 60.0  # the calls that set a case up (groups made, the first step) on busy cores
SLACK = 10.0  # room for a cold process on 2 busy cores
# gloo's own timeout where a case shows that the comms' timeout bounds a wait, not gloo's: longer than
# TIMEOUT + SLACK, short enough that a backend work a case leaves stuck ends soon after.
GLOO_TIMEOUT = TIMEOUT + SLACK + 7
D = 7  # width: no parameter's first dimension divides by 2 or 4 (FSDP pads)


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2, self.ln = nn.Linear(D, 5), nn.Linear(5, D), nn.LayerNorm(D)

    def forward(self, x):
        return x + self.fc2(torch.tanh(self.fc1(self.ln(x))))


class _Net(nn.Module):
    """Root parameters (inp, head) around two blocks (the forward-prefetch chain)."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(3, D)
        self.blocks = nn.ModuleList(_Block() for _ in range(2))
        self.head = nn.Linear(D, 2)

    def forward(self, x):
        h = self.inp(x)
        for b in self.blocks:
            h = b(h)
        return self.head(h)


def _zero_pp() -> dict:
    """The whole ZeRO++ recipe, forced (``fsdp.shard``'s ``"auto"`` decides per model and cluster)."""
    return {"weights": C.QuantizeCompressor(8), "gradients": C.QuantizeCompressor(4), "hpz": True}


def _model(frozen: bool = False) -> nn.Module:
    """The test's own initialisation. ``frozen``: blocks.0 freezes fc1 and its LayerNorm, the root
    its input bias (FSDP2 leaves them out of the reduce-scatter), and blocks.1 holds a trainable
    parameter its forward never uses."""
    torch.manual_seed(0)
    m = _Net()
    with torch.no_grad():
        for p in m.parameters():
            p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())) * 0.1)
    if frozen:
        for p in (m.blocks[0].fc1.weight, m.blocks[0].fc1.bias, m.blocks[0].ln.weight, m.blocks[0].ln.bias,
                  m.inp.bias):
            p.requires_grad_(False)
        m.blocks[1].unused = nn.Parameter(torch.linspace(-1.0, 1.0, 5))
    return m


def _data(rank: int, step: int, n: int = 6) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + 100 * step + rank)
    x = torch.randn(n, 3, generator=g)
    return x, torch.stack([x[:, 0] * x[:, 1], torch.sin(x[:, 2])], dim=1)


def _mesh():
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh("cpu", (dist.get_world_size(),))


def _native(frozen: bool = False, mesh=None) -> nn.Module:
    """Native FSDP2 (torch's own comms) on the same model: the oracle."""
    from torch.distributed.fsdp import fully_shard

    m = _model(frozen)
    mesh = mesh if mesh is not None else _mesh()
    for b in m.blocks:
        fully_shard(b, mesh=mesh)
    fully_shard(m, mesh=mesh)
    return m


def _native_hsdp(topo: Topology, frozen: bool) -> nn.Module:
    from torch.distributed.device_mesh import DeviceMesh

    grid = torch.tensor([list(n) for n in topo.nodes])
    return _native(frozen, DeviceMesh("cpu", grid, mesh_dim_names=("replicate", "shard")))


def _step(model: nn.Module, opt, step: int) -> None:
    opt.zero_grad()
    x, y = _data(dist.get_rank(), step)
    nn.functional.mse_loss(model(x), y).backward()


def _grads(model: nn.Module) -> dict[str, torch.Tensor | None]:
    return {n: None if p.grad is None else p.grad.full_tensor().detach().clone() for n, p in model.named_parameters()}


def _params(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.full_tensor().detach().clone() for n, p in model.named_parameters()}


def _local_max(model: nn.Module, step: int, frozen: bool) -> dict[str, float]:
    """max |local gradient| over every rank, per parameter, of an unsharded replica at the current
    parameters: what bounds a quantization step of the sum's inputs (blocks restart at every
    parameter, so no block's max exceeds its parameter's)."""
    replica = _model(frozen)
    replica.load_state_dict(_params(model))
    x, y = _data(dist.get_rank(), step)
    nn.functional.mse_loss(replica(x), y).backward()
    out = {}
    for n, p in replica.named_parameters():
        t = torch.tensor([0.0 if p.grad is None else float(p.grad.abs().max())])
        dist.all_reduce(t, op=ReduceOp.MAX)
        out[n] = float(t)
    return out


# ------------------------------------------------------------------------------------------ frozen
def _body_frozen(steps: int) -> dict:
    """Frozen and unused parameters with every comm, against native FSDP2 (and native HSDP) on the
    same model: exact comms give native's gradients step after step; quantized ones (qgZ int4/int8,
    qwZ, the HSDP hook in int8 and with PowerSGD) train, stay within the quantization bound of the
    first step's gradient, keep frozen parameters bit-identical, and hold residuals for exactly the
    trainable parameters (error feedback on for the trainable parameters of a block that also
    holds frozen ones)."""
    rank = dist.get_rank()
    topo = Topology.from_spec(f"1x{dist.get_world_size()}")
    frozen_names = {n for n, p in _model(True).named_parameters() if not p.requires_grad}
    trainable = {n for n, p in _model(True).named_parameters() if p.requires_grad}
    out = {}

    def run(model, comms=None) -> tuple[list[dict], dict]:
        opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1)
        seen = []
        for s in range(steps):
            _step(model, opt, s)
            seen.append(_grads(model))
            opt.step()
        return seen, _params(model)

    ref_grads, ref_params = run(_native(True))
    for n in frozen_names | {"blocks.1.unused"}:
        assert ref_grads[0][n] is None, n  # native FSDP2 reduces neither

    def same_as_native(grads, params, what):
        for s in range(steps):
            for n, g in grads[s].items():
                r = ref_grads[s][n]
                if r is None:  # frozen: no gradient; unused: none natively, zeros with error feedback on
                    assert g is None or (n not in frozen_names and not g.any()), (what, s, n)
                    continue
                assert torch.allclose(g, r, rtol=1e-5, atol=1e-6 * float(r.abs().max())), (what, s, n)
        for n in params:
            assert torch.allclose(params[n], ref_params[n], rtol=1e-5, atol=1e-6), (what, n)

    # Exact comms, registered; and the recipe without compression (prefetched).
    m = _native(True)
    fsdp.register(m, reduce_scatter=fsdp.ReduceScatterComm(topo), all_gather=fsdp.AllGatherComm(topo))
    same_as_native(*run(m), "exact")
    m = _model(True)
    fsdp.shard(m, topology=topo, weights=None, gradients=None, hpz=False)
    same_as_native(*run(m), "shard exact")

    # Quantized gradients (qgZ, error feedback: round to nearest) with exact weights: the first
    # step's gradient (residuals zero) is within half a quantization step of every sender's block.
    initial = _params(_native(True))
    for bits, qmax in ((4, 7), (8, 127)):
        m = _model(True)
        comms = fsdp.shard(m, topology=topo, weights=None, gradients=C.QuantizeCompressor(bits, 8), hpz=False)
        bound = _local_max(m, 0, True)
        grads, params = run(m)
        for n in trainable:
            g, r = grads[0][n], ref_grads[0][n]
            if r is None:
                assert not g.any(), n
                continue
            err = float((g - r).abs().max())
            assert err <= bound[n] / qmax / 2 + 1e-6, (bits, n, err, bound[n] / qmax / 2)
        for n in frozen_names:
            assert torch.equal(params[n], initial[n]) and all(gs[n] is None for gs in grads), (bits, n)
        names = {k.partition("/")[2] for k in comms.state_dict()["reduce_scatter"]["residuals"]}
        assert names == trainable, (bits, sorted(names ^ trainable))
        out[f"qgz-int{bits}"] = max(float((grads[0][n] - ref_grads[0][n]).abs().max())
                                    for n in trainable if ref_grads[0][n] is not None)
    # The full ZeRO++ recipe (int8 weights too): trains, frozen parameters untouched.
    m = _model(True)
    comms = fsdp.shard(m, topology=topo, **_zero_pp())
    grads, params = run(m)
    assert all(bool(torch.isfinite(g).all()) for gs in grads for g in gs.values() if g is not None)
    assert all(torch.equal(params[n], initial[n]) for n in frozen_names)
    assert {k.partition("/")[2] for k in comms.state_dict()["reduce_scatter"]["residuals"]} == trainable

    # Compressed HSDP across two nodes of one rank each: int8 (the module's shard holds only the
    # trainable parameters) and PowerSGD, against native HSDP; error feedback for the trainable ones.
    hsdp_topo = Topology.from_spec(f"{dist.get_world_size()}x1")
    hsdp_ref, _ = run(_native_hsdp(hsdp_topo, True))
    for name, comp, tol in (("int8", C.QuantizeCompressor(8, 8), 2 / 127),
                            ("powersgd", C.PowerSGDCompressor(rank=64, start_iter=0, min_compression_rate=0), 1e-4)):
        m = _model(True)
        comms = fsdp.shard_hsdp(m, comp, topology=hsdp_topo)
        bound = _local_max(m, 0, True)
        grads, params = run(m)
        for n in trainable:
            if hsdp_ref[0][n] is not None:
                err = float((grads[0][n] - hsdp_ref[0][n]).abs().max())
                assert err <= tol * bound[n] + 1e-6, (name, n, err, tol * bound[n])
        assert all(torch.equal(params[n], initial[n]) for n in frozen_names), name
        state = comms.state_dict()["all_reduce"]
        if name == "int8":
            names = {k.partition("/")[2] for k in state["residuals"]}
            assert names == trainable, (name, sorted(names ^ trainable))
        else:  # PowerSGD: residuals and warm starts of the trainable matrices only
            names = set(state["error_feedback"]["worker"]) | set(state["compressor_state"]["q_memory"])
            assert names and names <= trainable, (name, sorted(names - trainable))
    out["rank"] = rank
    return out


def test_frozen_and_unused_parameters_train_as_native_fsdp2(ranks):
    """docs/faults.md rows 34 and 20 (FSDP2, frozen and unused parameters): every comm accepts the model and
    trains it as native FSDP2 / native HSDP do (see the body); qgZ no longer fails mid-backward
    counting a frozen parameter, and the HSDP hook keeps error feedback for the trainable ones."""
    out = ranks(2, _body_frozen, 2, timeout=150)
    assert out[0]["qgz-int4"] > 0  # quantized: some error, within the bound (checked in the ranks)


# ------------------------------------------------------------------------------------------ NonFiniteError
def _poison(module: nn.Module, rank: int, *, hook: bool = False) -> None:
    """Rank ``rank`` puts a NaN into the module's reduce-scatter input (``hook``: into the shard its
    HSDP hook receives) before commopt's comm sees it."""
    pg = module._get_fsdp_state()._fsdp_param_groups[0]
    if hook:
        inner_hook = pg._all_reduce_hook

        def poisoned_hook(t):
            if dist.get_rank() == rank:
                t.view(-1)[0] = float("nan")
            inner_hook(t)

        pg._all_reduce_hook = poisoned_hook
        return
    inner = pg._reduce_scatter_comm

    class Poisoned:
        def allocate(self, *a, **k):
            return inner.allocate(*a, **k)

        def __call__(self, output_tensor, input_tensor, group, op, async_op=False):
            if dist.get_rank() == rank:
                input_tensor.view(-1)[0] = float("nan")
            return inner(output_tensor, input_tensor, group, op, async_op)

    pg._reduce_scatter_comm = Poisoned()


def _heal(module: nn.Module, saved) -> None:
    pg = module._get_fsdp_state()._fsdp_param_groups[0]
    pg._reduce_scatter_comm, pg._all_reduce_hook = saved


def _equal_states(a, b) -> bool:
    """Bit for bit (a residual of -0.0 is not one of 0.0)."""
    if isinstance(a, torch.Tensor):
        return (isinstance(b, torch.Tensor) and a.shape == b.shape and a.dtype == b.dtype
                and torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8)))
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_equal_states(a[k], b[k]) for k in a)
    return a == b


def _body_nonfinite() -> dict:
    """A NaN in one rank's root-module gradient, which FSDP2 reduces last, after both blocks: with
    check_finite=True every rank raises NonFiniteError, and every residual, step counter and warm
    start is bit-identical to what it was before that backward, although the blocks were reduced
    (and, before the journal, had changed theirs). The next clean backward commits its changes,
    and a second NaN backward after it restores those (not the older ones). For qgZ (int4) and
    the HSDP hook (int8 and PowerSGD, on two one-rank nodes)."""
    world = dist.get_world_size()
    engine = context().engine()
    out = {}
    cases = [("qgz", Topology.from_spec(f"1x{world}"), None),
             ("hsdp-int8", Topology.from_spec(f"{world}x1"), C.QuantizeCompressor(8, 8)),
             ("hsdp-powersgd", Topology.from_spec(f"{world}x1"),
              C.PowerSGDCompressor(rank=1, start_iter=0, min_compression_rate=0))]
    for name, topo, comp in cases:
        if comp is None:
            m = _native()
            comm = fsdp.ReduceScatterComm(topo, compressor=C.QuantizeCompressor(4, 8), check_finite=True)
            fsdp.register(m, reduce_scatter=comm)
        else:
            m = _model()
            comm = fsdp.shard_hsdp(m, comp, topology=topo).all_reduce
            comm.finite_check = True
        opt = torch.optim.SGD(m.parameters(), lr=0.1)
        pg = m._get_fsdp_state()._fsdp_param_groups[0]
        clean = (pg._reduce_scatter_comm, pg._all_reduce_hook)
        step = 0
        for _round in range(2):
            for _ in range(2):  # clean steps: residuals move
                _step(m, opt, step)
                opt.step()
                step += 1
            before = comm.state_dict()
            engine.reset_stats()
            _poison(m, 0, hook=comp is not None)
            try:
                _step(m, opt, step)
                raised = "nothing"
            except NonFiniteError as exc:
                raised = str(exc)
                m.reset_iter_state()  # FSDP2's recovery after a backward raised, as the message says
            _heal(m, clean)
            assert "ranks [0]" in raised and "was undone" in raised and "reset_iter_state" in raised, (name, raised)
            reduced = sum(n for op, n in engine.calls().items() if "/check" not in op)
            assert reduced >= 2, (name, engine.calls())  # both blocks were reduced in that backward
            after = comm.state_dict()
            assert _equal_states(before, after), f"{name}: a NaN backward changed the comm's state"
        out[name] = sorted(after.get("residuals", {}))
        # A clean step afterwards changes the state again (committed, not journalled away).
        _step(m, opt, step)
        assert not _equal_states(after, comm.state_dict()), name
    return out


def test_nonfinite_backward_leaves_every_residual_as_it_was(ranks):
    """docs/faults.md row 35 (check_finite=True): NonFiniteError's "no residual was changed" is true for the
    whole backward, not only for the module that held the NaN."""
    out = ranks(2, _body_nonfinite, timeout=120)
    assert out[0]["qgz"] and out[0]["hsdp-int8"]


# ------------------------------------------------------------------------------------------ stalls, kills
def _recipe(kind: str, topo: Topology) -> tuple[nn.Module, fsdp.Comms]:
    """The model under one recipe, its comms made with the set-up timeout (groups made and the first
    step taken on busy cores); :func:`_tighten` gives them the short one of the faulted attempt.
    ``native``: what ``fsdp.shard``'s ``"auto"`` picks for a part where FSDP2's own collective timed
    fastest (small models on loopback), forced; ``/no-prefetch``: ``prefetch=False``."""
    m = _model()
    opts = {"timeout": SETUP, "prefetch": not kind.endswith("/no-prefetch")}
    kind = kind.removesuffix("/no-prefetch")
    if kind == "zero++":
        comms = fsdp.shard(m, topology=topo, **_zero_pp(), **opts)
    elif kind == "zero++/native-gradients":  # int8 weights, hpZ, FSDP2's own reduce-scatter
        comms = fsdp.shard(m, topology=topo, weights=C.QuantizeCompressor(8), gradients="native", hpz=True, **opts)
    elif kind == "native":  # FSDP2's own collectives for both parts, hpZ
        comms = fsdp.shard(m, topology=topo, weights="native", gradients="native", hpz=True, **opts)
    elif kind == "native/exact-flat":  # FSDP2's own all-gather, commopt's flat (gloo's) reduce-scatter
        comms = fsdp.shard(m, topology=topo, weights="native", gradients=None, algorithm="flat", hpz=True, **opts)
    elif kind == "exact-hierarchical":
        comms = fsdp.shard(m, topology=topo, weights=None, gradients=None, algorithm="hierarchical", **opts)
    elif kind == "hsdp-int8":
        comms = fsdp.shard_hsdp(m, C.QuantizeCompressor(8), topology=topo, timeout=SETUP)
    else:
        raise ValueError(kind)
    return m, comms


def _tighten(comms: fsdp.Comms) -> None:
    """Every comm of ``comms`` waits ``TIMEOUT`` from now on (each call reads its timeout when it starts)."""
    for comm in (comms.reduce_scatter, comms.all_gather, comms.all_reduce):
        if comm is not None:
            comm.timeout = TIMEOUT


def _attempt(model: nn.Module, mode: str, step: int) -> tuple[str, str, float, str]:
    """(where it raised: forward / backward / nowhere, the error's type, seconds, message). ``eval``:
    a forward-only loop under no_grad, where it raised: the iteration."""
    rank = dist.get_rank()
    start = time.monotonic()
    where = "forward"
    try:
        if mode == "eval":
            with torch.no_grad():
                for i in range(20):
                    where = f"iteration {i}"
                    model(_data(rank, step + i)[0])
            where = "nowhere"
        else:
            x, y = _data(rank, step)
            loss = nn.functional.mse_loss(model(x), y)
            where = "backward"
            loss.backward()
            where = "nowhere"
    except Exception as exc:  # noqa: BLE001 - the test inspects what was raised and where
        return where, type(exc).__name__, time.monotonic() - start, str(exc)[:400]
    return where, "returned", time.monotonic() - start, ""


def _engine_threads() -> list[str]:
    """The comm engine's threads still alive a while after destroy() (they must exit)."""
    deadline = time.monotonic() + TIMEOUT + 5
    alive = lambda: [t.name for t in threading.enumerate() if t.name.startswith("commopt-engine") and t.is_alive()]
    while alive() and time.monotonic() < deadline:
        time.sleep(0.05)
    return alive()


def _fresh_world(store_dir: str, name: str, pg_timeout: float = TIMEOUT + SLACK) -> dist.FileStore:
    """Re-initialise WORLD on a store of its own, with gloo's own timeout short too (a work a case
    leaves stuck ends in seconds, and destroying the group does not wait for it). A ``pg_timeout``
    longer than ``TIMEOUT + SLACK`` makes a wait that only the group's own timeout bounds fail the case."""
    rank, world = dist.get_rank(), dist.get_world_size()
    destroy()
    dist.destroy_process_group()
    # The last case's groups go now, not at some later collection: destroying a gloo group waits for
    # its work still in flight (a collective of FSDP2's own that a peer never joined runs until the
    # group's timeout), and the stalled rank, which has none, closes its connections, ending the
    # others' at once.
    gc.collect()
    os.makedirs(store_dir, exist_ok=True)
    store = dist.FileStore(os.path.join(store_dir, name), world)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world, timeout=timedelta(seconds=pg_timeout))
    return store


def _barrier(store: dist.FileStore, name: str) -> None:
    """Every rank reaches ``name`` before any goes on (through the store: no collective)."""
    if store.add(name, 1) == dist.get_world_size():
        store.set(f"{name}/go", "1")
    store.wait([f"{name}/go"], timedelta(seconds=120))


def _stall_at_second_call(store: dist.FileStore):
    """A forward pre-hook that stalls its rank at its second call (iteration 1 of an evaluation loop)
    until the others have given up, then stops that forward (a resumed rank would issue collectives
    no peer joins any more, left to the backend's own timeout)."""
    calls = []

    def stall(_module, _args) -> None:
        calls.append(1)
        if len(calls) == 2:
            store.wait(["given-up"], timedelta(seconds=TIMEOUT + SLACK + 30))
            raise RuntimeError("the stalled rank stops here")

    return stall


def _stall_matrix(store_dir: str, spec: str, cases: list[tuple[str, str, str, int]],
                  pg_timeout: float = TIMEOUT + SLACK) -> list:
    """Each case in a fresh world on these processes: one warm training step on every rank, then
    rank ``stalled`` stays alive but stops (before forward; after forward: before backward; or
    ``inside`` the second forward of its own evaluation loop, at its second block) until the others
    have given up; the others attempt a training step (or an evaluation loop). Then every rank calls
    destroy(). Returns each case's attempt on this rank, with the engine threads alive shortly after
    destroy() (None on the stalled rank)."""
    rank = dist.get_rank()
    world = dist.get_world_size()
    results = []
    for i, (kind, mode, when, stalled) in enumerate(cases):
        store = _fresh_world(store_dir, f"case{i}", pg_timeout)
        topo = Topology.from_spec(spec)
        model, comms = _recipe(kind, topo)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        _step(model, opt, 0)  # warm: every group made, every rank in step
        opt.step()
        _tighten(comms)
        outcome = None
        if rank == stalled:
            if when == "backward":
                nn.functional.mse_loss(model(_data(rank, 1)[0]), _data(rank, 1)[1])  # forward, then stop
            if when == "inside":
                hook = model.blocks[1].register_forward_pre_hook(_stall_at_second_call(store), prepend=True)
                _attempt(model, mode, 1)
                hook.remove()
            else:
                store.wait(["given-up"], timedelta(seconds=TIMEOUT + SLACK + 30))
        else:
            outcome = _attempt(model, mode, 1)
            if store.add("gave-up", 1) == world - 1:
                store.set("given-up", "1")
        destroy()
        results.append(None if outcome is None else outcome + (_engine_threads(),))
        del model, comms, opt  # collected with the case's groups by the next _fresh_world
    _fresh_world(store_dir, "final", pg_timeout)  # a working WORLD for the pool's next call
    return results


def _trained_once(kind: str, spec: str) -> tuple[nn.Module, torch.optim.Optimizer]:
    """A recipe's model after one optimizer step on every rank, its comms' timeout tightened, the
    ranks together again: where the fault cases start."""
    model, comms = _recipe(kind, Topology.from_spec(spec))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    _step(model, opt, 0)
    opt.step()
    _tighten(comms)
    dist.barrier()
    return model, opt


def _killed_eval(spec: str, victim: int) -> tuple | None:
    """The ZeRO++ recipe trains a step on every rank; then ``victim`` is SIGKILLed and the others
    run an evaluation loop (forward only, no_grad): it must raise at its first forward; the engine's
    threads exit after destroy()."""
    rank = dist.get_rank()
    model, _ = _trained_once("zero++", spec)
    if rank == victim:
        os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(60)
    time.sleep(0.2)  # the victim is gone
    outcome = _attempt(model, "eval", 1)
    destroy()
    return outcome + (_engine_threads(),)


def _killed_train(spec: str, kind: str, victim: int) -> tuple | None:
    """A recipe trains a step on every rank; in the next step ``victim`` is SIGKILLed at the start of
    its backward (mid-training: its forward's all-gathers done, no reduce-scatter yet), while the
    others train on: their backward must raise commopt's error; the engine's threads exit after
    destroy(). Returns (the first attempt that did not return, the threads alive after destroy())."""
    rank = dist.get_rank()
    model, _ = _trained_once(kind, spec)
    if rank == victim:
        x, y = _data(rank, 1)
        out = model(x)
        out.register_hook(lambda _grad: os.kill(os.getpid(), signal.SIGKILL))
        nn.functional.mse_loss(out, y).backward()
        time.sleep(60)
    for step in range(1, 4):
        outcome = _attempt(model, "train", step)
        if outcome[1] != "returned":
            break
    destroy()
    return outcome + (_engine_threads(),)


def _check_raised(outcome, where: str | tuple[str, ...], what: str) -> None:
    """Raised commopt's error at ``where`` (or one of them) within the timeout plus slack, and (where
    checked) no engine thread outlived destroy()."""
    got_where, kind, elapsed, msg = outcome[:4]
    assert got_where in ((where,) if isinstance(where, str) else where), (what, outcome)
    assert kind in ("CommTimeoutError", "CommError") or (
        kind == "RuntimeError" and ("CommTimeoutError" in msg or "CommError" in msg)), (what, outcome)
    assert elapsed <= TIMEOUT + SLACK, (what, outcome)
    assert len(outcome) < 5 or outcome[4] == [], (what, "engine threads alive after destroy()", outcome)


def test_stalled_or_killed_rank_fails_the_next_forward(tmp_path):
    """docs/faults.md row 5 (FSDP2), 2 ranks: with the ZeRO++ recipe (int8 weights gathered asynchronously
    and prefetched), a rank that stalls before forward makes the other's training forward raise
    CommTimeoutError from the forward itself (not garbage losses until the next reduce-scatter), and
    its evaluation loop (forward only, no_grad) raise at its first iteration, within the timeout plus
    slack; after a SIGKILL, the survivor's evaluation loop raises at its first forward and its engine
    threads exit."""
    cases = [("zero++", "train", "forward", 1), ("zero++", "eval", "forward", 1)]
    pool = RankPool(2)
    try:
        res = pool.run(_stall_matrix, str(tmp_path / "stall"), "1x2", cases,
                       timeout=len(cases) * (TIMEOUT + SLACK) + 90)
        killed = pool.run(_killed_eval, "1x2", 1, timeout=TIMEOUT + SLACK + 60, allow_dead=True)
    finally:
        pool.close(graceful=False)
    for case, outcome in zip(cases, res[0]):
        _check_raised(outcome, "forward" if case[1] == "train" else "iteration 0", str(case))
    assert killed[1] is None
    _check_raised(killed[0], "iteration 0", "killed, eval")
    assert killed[0][4] == [], killed[0]


def _deadline_calls(store_dir: str) -> list:
    """docs/faults.md row 4 (FSDP2): one deadline per comm call. Three calls whose first phase is slow (a
    peer enters it ``late`` seconds after the others) and whose second phase never completes (a
    rank stays ``absent``): the quantized two-level reduce-scatter (intra-node, then the rail), the
    exact hierarchical reduce-scatter (the same order) and the exact hierarchical all-gather (the
    rail, then intra-node). Each call has groups of its own; all ranks start each call together
    (a store barrier). With one timeout per phase, rank 0 would raise after late + timeout."""
    rank, world = dist.get_rank(), dist.get_world_size()
    store = _fresh_world(store_dir, "deadline")
    topo = Topology.from_spec("2x2")
    late = 0.6 * TIMEOUT
    n = 24  # elements per rank's chunk
    makers = [
        ("qgz", lambda t: fsdp.ReduceScatterComm(topo, "hierarchical", C.QuantizeCompressor(4, 8),
                                                 error_feedback=False, timeout=t), 1, 2),
        ("hierarchical-rs", lambda t: fsdp.ReduceScatterComm(topo, "hierarchical", timeout=t), 1, 2),
        ("hierarchical-ag", lambda t: fsdp.AllGatherComm(topo, "hierarchical", timeout=t), 2, 1),
    ]

    def call(comm) -> None:
        if isinstance(comm, fsdp.ReduceScatterComm):
            comm(torch.empty(n), torch.ones(world * n), dist.group.WORLD, ReduceOp.AVG)
        else:
            comm(torch.empty(world * n), torch.ones(n), dist.group.WORLD)

    for _, make, _, _ in makers:
        # Warm, on every rank: the groups (cached per layout and role, shared by every comm of this
        # topology) made outside any deadline, as register makes them before training.
        call(make(None))
    out = []
    for i, (name, make, slow, absent) in enumerate(makers):
        comm = make(TIMEOUT)
        _barrier(store, f"start{i}")
        if rank == absent:
            out.append(None)
            continue
        if rank == slow:
            time.sleep(late)
        start = time.monotonic()
        try:
            call(comm)  # nothing else in flight: its phases run on this thread, one after the other
            out.append((name, "returned", time.monotonic() - start))
        except CommError as exc:
            out.append((name, type(exc).__name__, time.monotonic() - start))
    _barrier(store, "end")
    _fresh_world(store_dir, "final")  # a working WORLD for the pool's next call
    return out


def test_every_phase_of_a_comm_call_shares_its_deadline(tmp_path):
    """docs/faults.md row 4 (FSDP2), on a 2x2: a comm call raises CommTimeoutError within its timeout even
    when its first phase took most of it (one deadline for the call, every phase waiting for what is
    left of it); before, rank 0 raised one timeout after its slow first phase. And docs/faults.md row 5
    (FSDP2) where the hierarchy matters, in the same fresh processes: exact hierarchical comms with
    prefetch and a rank stalled before forward, the ZeRO++ recipe (hpZ) with a rank stalled between
    forward and backward."""
    pool = RankPool(4)
    try:
        res = pool.run(_deadline_calls, str(tmp_path), timeout=3 * (TIMEOUT + SLACK) + 90)
        stalls = [("exact-hierarchical", "train", "forward", 1), ("zero++", "train", "backward", 1)]
        stalled = pool.run(_stall_matrix, str(tmp_path / "stall"), "2x2", stalls,
                           timeout=len(stalls) * (TIMEOUT + SLACK) + 90)
    finally:
        pool.close(graceful=False)
    late = 0.6 * TIMEOUT
    for rank in range(4):
        for outcome in res[rank]:
            if outcome is None:
                continue
            name, kind, elapsed = outcome
            assert kind == "CommTimeoutError", (rank, outcome)
            # One deadline: within the timeout, well before late + timeout (a phase of its own).
            assert TIMEOUT - 0.5 <= elapsed < TIMEOUT + late - 0.5, (rank, outcome)
    for rank in (0, 2, 3):
        # Exact hierarchical comms with prefetch: every survivor's forward raises. ZeRO++ with hpZ,
        # a rank stalled after forward: its node peer's backward (hpZ's all-gather inside the node,
        # prefetched), and the other node's backward (the reduce-scatter), raise.
        _check_raised(stalled[rank][0], "forward", f"rank {rank} exact hierarchical")
        _check_raised(stalled[rank][1], "backward", f"rank {rank} zero++ hpZ")


def test_a_stalled_or_killed_peer_is_bounded_whichever_part_is_native(tmp_path):
    """docs/faults.md rows 4 and 5 (FSDP2, 2x2, the ZeRO++ recipe with ``timeout=3``) where a part runs FSDP2's
    own collective, as ``fsdp.shard``'s "auto" picks it for a small model on loopback (forced here), and
    row 30: rank 3 stalls, alive, before a training forward with prefetch off, and before an evaluation
    loop (no_grad): ranks 0, 1 and 2 raise commopt's error from that forward within the timeout plus
    slack, although gloo's own timeout is GLOO_TIMEOUT here (30 minutes by default, which hpZ's node groups
    got whatever WORLD's was); before, they waited for it. Rank 3 stalls inside an evaluation forward: its node
    peer, rank 2, raises; ranks 0 and 1 finish their loop (hpZ: after its first forward an evaluation loop
    gathers inside the node only; the documented behaviour). Rank 2 SIGKILLed mid-training, with FSDP2's
    own reduce-scatter beside int8 weights, and with commopt's flat (gloo's) reduce-scatter beside FSDP2's
    own all-gather: every survivor's backward raises commopt's error, never gloo's bare RuntimeError or a
    hang. After every case destroy() leaves no engine thread alive (before, gloo's reduce-scatter held one
    until the group's own timeout)."""
    stalls = [("native/no-prefetch", "train", "forward", 3), ("native", "eval", "forward", 3),
              ("native", "eval", "inside", 3)]
    kills = ["zero++/native-gradients", "native/exact-flat"]
    pool = RankPool(4)
    try:
        stalled = pool.run(_stall_matrix, str(tmp_path / "stall"), "2x2", stalls, GLOO_TIMEOUT,
                           timeout=len(stalls) * (TIMEOUT + SLACK) + 90)
        killed = [pool.run(_killed_train, "2x2", kind, 2, timeout=TIMEOUT + SLACK + 60, allow_dead=True)
                  for kind in kills]
    finally:
        pool.close(graceful=False)
    assert stalled[3] == [None] * len(stalls)
    for rank in (0, 1, 2):
        _check_raised(stalled[rank][0], "forward", f"rank {rank}: rank 3 stalled before forward, prefetch off")
        _check_raised(stalled[rank][1], "iteration 0", f"rank {rank}: rank 3 stalled before evaluation")
    # Inside the evaluation loop: rank 3's node peer raises at the next gather it shares with rank 3 (the
    # stalled iteration's prefetch was issued, so the next iteration's at the latest) ...
    _check_raised(stalled[2][2], ("iteration 1", "iteration 2"), "rank 2: rank 3 stalled inside evaluation")
    for rank in (0, 1):  # ... and the other node, gathering inside its own node, evaluates on
        assert stalled[rank][2][:2] == ("nowhere", "returned") and stalled[rank][2][4] == [], stalled[rank][2]
    for kind, res in zip(kills, killed):
        assert res[2] is None
        for rank in (0, 1, 3):
            _check_raised(res[rank], "backward", f"rank {rank}: rank 2 killed mid-training ({kind})")
