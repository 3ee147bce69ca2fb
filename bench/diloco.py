"""``commopt-bench diloco``: the bench GPT trained side by side on the same tokens with DDP over every
rank (the synchronous baseline) and with DiLoCo (``schedules.DiLoCo``: each node a worker training
with DDP inside it, the pseudo-gradient reduced along the rails every H inner steps), H in {8, 32},
outer gradients fp32 / bf16 / int8 / int4, streaming off and on (fp32 and int4; docs/guide.md, "DiLoCo").

Every run trains from the same initial weights on the same tokens (rank r's batch of step t is the
same for every run), one step of each in turn, rotated every step. Printed per run: the mean step
time (inner steps and outer syncs together), the mean step without a sync (the inner step), the
exposed outer sync per step (the difference), the bytes per step the busiest node put on its link as
measured (the interface counters inside the emulated cluster; elsewhere the engine's count of what this
rank sent) and as the algorithms' traffic model counts them (DDP: a ring over every rank; DiLoCo:
``DiLoCo.outer_bytes``, the rail reduction's encoded bytes). The targets are read on the model's
bytes: the counters see a streamed reduction's bytes in whichever run's step they cross the link
during, the model charges them to the run that sent them. Beside the step time, each run's peak memory
(the largest over its steps and the ranks: ``_memory.PeakMemory``), which DiLoCo's backups and outer
state raise. Also printed: the final training loss (mean of the last 5 steps over the ranks, the
workers' local weights) and the held-out loss on batches no run trained on, of the model each run would
save: DDP's final weights; DiLoCo's global model after ``DiLoCo.finalize()`` (the reductions in flight
applied and a last sync of every fragment, so every rank holds the global weights); torchft's model
after its last sync. The setting these methods were made for::

    commopt-bench cluster --nodes 2 --ranks-per-node 2 --link-rate 200mbit -- commopt-bench diloco

``--runs`` takes any ``diloco-H[-bf16|-int8|-int4][-stream][-ring]`` and, where torchft is installed (``pip install
torchft``), ``torchft-H[-stream]``: torchft's own ``DiLoCo`` on the same model and tokens, one torchft
``Manager`` per rank and a Lighthouse per run started by rank 0, its gloo process group between the
nodes; fp32 only (its quantized outer gradients need Triton on CUDA) and one rank per worker
(torchft#171), so on ``--nodes N --ranks-per-node 1``::

    commopt-bench cluster --nodes 4 --ranks-per-node 1 --link-rate 200mbit -- commopt-bench diloco \
        --runs ddp,diloco-32,diloco-32-stream,torchft-32,torchft-32-stream
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import socket
import statistics
import sys
import time
from typing import NamedTuple

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from commopt.comm import algorithms

from ._launch import launch, topology_of
from ._memory import PeakMemory, peak_kind
from ._progress import interleaved
from .cluster.host import wire_bytes

__all__ = ["main", "RUNS", "Spec", "spec"]

_VOCAB = 256

#: The runs by default; any "diloco-H[-bf16|-int8|-int4][-stream][-ring]" or "torchft-H[-stream]" is
#: accepted (``spec``).
RUNS = ("ddp", "diloco-8", "diloco-32", "diloco-32-stream", "diloco-32-int8", "diloco-32-int4",
        "diloco-32-int4-stream")

_NAME = re.compile(r"(diloco|torchft)-([1-9][0-9]*)(?:-(bf16|int8|int4))?(-stream)?(-ring)?")


class Spec(NamedTuple):
    """What a run trains: ``impl`` "commopt" (``schedules.DiLoCo``) or "torchft" (torchft's
    ``local_sgd.DiLoCo``), syncing every ``sync_every`` inner steps, the outer gradients through the
    ``codec`` ("bf16", or "int8" / "int4": the block quantizer; None: fp32), in ``fragments`` fragments
    each applied ``delay`` steps late;
    ``ring``: the rail's own all-reduce even where the cluster's links differ (the baseline of the outer
    sync that weighs a synthesized schedule there)."""

    impl: str
    sync_every: int
    codec: str | None
    fragments: int
    delay: int
    ring: bool = False


def spec(name: str) -> Spec | None:
    """A run's :class:`Spec`; None for "ddp", the synchronous baseline. "diloco-H" syncs every H inner
    steps in fp32, "-int8"/"-int4" sends the outer gradients through that block codec, "-bf16" as bf16
    (both with error feedback), "-stream" syncs 4 fragments at staggered steps, each reduction overlapping
    2 inner steps;
    "torchft-H[-stream]" is the same with torchft's DiLoCo (fp32 only: its quantization needs Triton on
    CUDA; one rank per worker); "-ring" keeps the rail's own outer all-reduce where the links differ.
    Raises ValueError for any other name."""
    if name == "ddp":
        return None
    m = _NAME.fullmatch(name)
    if m is None:
        raise ValueError(f"commopt-bench diloco: unknown run {name!r}; a run is 'ddp', "
                         f"'diloco-H[-bf16|-int8|-int4][-stream][-ring]' or 'torchft-H[-stream]' with H >= 1, "
                         f"for example "
                         f"diloco-16-int4-stream")
    impl = "commopt" if m.group(1) == "diloco" else "torchft"
    if impl == "torchft" and m.group(3):
        raise ValueError(f"commopt-bench diloco: {name!r}: torchft's quantized outer gradients need Triton on "
                         f"CUDA; its runs are fp32 ('torchft-H[-stream]')")
    stream = bool(m.group(4))
    if impl == "torchft" and m.group(5):
        raise ValueError(f"commopt-bench diloco: {name!r}: '-ring' is for commopt's DiLoCo ('diloco-H-ring')")
    return Spec(impl, int(m.group(2)), m.group(3), 4 if stream else 1, 2 if stream else 0, bool(m.group(5)))


def _compressor(codec: str | None):
    """The compressor of a run's ``codec`` (None: fp32)."""
    from commopt.comm.compression import BF16Compressor, QuantizeCompressor

    if codec is None:
        return None
    return BF16Compressor() if codec == "bf16" else QuantizeCompressor(int(codec[3:]))


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="commopt-bench diloco", description=__doc__.split("\n\n")[0])
    p.add_argument("--spawn", type=int, default=0, metavar="N", help="spawn N local ranks")
    p.add_argument("--topology", default=None, help="layout such as 2x2 (default: COMMOPT_NODES or detected)")
    p.add_argument("--runs", default=",".join(RUNS),
                   help=f"comma-separated runs (default {','.join(RUNS)}; any "
                   "diloco-H[-bf16|-int8|-int4][-stream][-ring], torchft-H[-stream])")
    p.add_argument("--steps", type=int, default=64, help="training steps per run (a multiple of 32 ends on a sync)")
    p.add_argument("--batch", type=int, default=4, help="sequences per rank per step")
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--d-model", type=int, default=256,
                   help="the GPT's width (default: the FSDP2 benchmark's 3.3 M-parameter model, whose DDP step is "
                        "link-bound on the emulated cluster)")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--lr", type=float, default=3e-3, help="inner AdamW learning rate")
    p.add_argument("--quick", action="store_true", help="a tiny model, 16 steps, H 4 and 8 (smoke test)")
    p.add_argument("--json", default=None, help="write the results (with the loss curves) as JSON (rank 0)")
    p.add_argument("--timeout", type=float, default=300.0, help="collective timeout in seconds")
    return p


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        for name in args.runs.split(","):
            spec(name)
    except ValueError as e:
        print(e)
        return 2
    if args.quick:
        args.d_model, args.layers, args.seq_len, args.batch, args.steps = 32, 1, 16, 2, 16
    return launch(_rank_body, args, spawn=args.spawn, timeout=args.timeout, single=False)


def _sync_every(args, name: str) -> int:
    h = spec(name).sync_every
    return max(1, h // 4) if args.quick else h  # --quick: 2 and 8 instead of 8 and 32


def _setup(name: str, args, topo) -> dict:
    from commopt.bench.models import GPT
    from commopt.schedules import DiLoCo, worker_group

    model = GPT(_VOCAB, args.d_model, args.layers, 4, args.seq_len, seed=0)
    s = spec(name)
    run = {"name": name, "spec": s, "sync_every": None if s is None else _sync_every(args, name), "model": model,
           "times": [], "synced": [], "bytes": [], "losses": []}
    if s is None:
        run["wrapped"] = DDP(model)
        run["opt"] = torch.optim.AdamW(model.parameters(), lr=args.lr)
        return run
    if s.impl == "torchft":
        return _setup_torchft(run, args, topo)
    group = worker_group(topo, timeout=args.timeout)
    run["wrapped"] = DDP(model, process_group=group) if group is not None else model
    run["opt"] = torch.optim.AdamW(model.parameters(), lr=args.lr)
    h = run["sync_every"]
    run["diloco"] = DiLoCo(model, run["opt"], sync_every=h, fragments=s.fragments, delay=min(s.delay, h - 1),
                           compressor=_compressor(s.codec),
                           topology=dataclasses.replace(topo, links=None) if s.ring else topo,
                           timeout=args.timeout)
    return run


def _setup_torchft(run: dict, args, topo) -> dict:
    """torchft's DiLoCo (``torchft.local_sgd.DiLoCo``) on ``run``'s model: a torchft ``Manager`` per rank
    (one replica group per node, of one rank), a Lighthouse started by rank 0 for this run, its
    gloo process group over the nodes' addresses, bucketized fp32 all-reduces of the pseudo-gradients,
    the paper's outer optimizer (Nesterov SGD, lr 0.7, momentum 0.9) per fragment; "-stream": the model
    in 4 fragments of whole modules, ``fragment_sync_delay=2``."""
    from datetime import timedelta

    from torch.distributed import TCPStore
    from torchft import Manager, ProcessGroupGloo
    from torchft._torchft import LighthouseServer
    from torchft.local_sgd import DiLoCo as TorchftDiLoCo

    model, s, h = run["model"], run["spec"], run["sync_every"]
    host = _node_address()
    address = [None]
    if dist.get_rank() == 0:
        run["lighthouse"] = LighthouseServer(bind="[::]:0", min_replicas=topo.num_nodes)
        address[0] = f"http://{host}:{run['lighthouse'].address().rsplit(':', 1)[1]}"
    dist.broadcast_object_list(address, src=0)
    run["store"] = TCPStore(host, 0, 1, is_master=True, wait_for_workers=False)
    run["opt"] = torch.optim.AdamW(model.parameters(), lr=args.lr)
    timeout = timedelta(seconds=args.timeout)
    run["manager"] = Manager(
        pg=ProcessGroupGloo(timeout=timeout), min_replica_size=topo.num_nodes,
        load_state_dict=lambda state: (model.load_state_dict(state["model"]), run["opt"].load_state_dict(state["opt"])),
        state_dict=lambda: {"model": model.state_dict(), "opt": run["opt"].state_dict()},
        replica_id=f"{run['name']}-node{topo.node_of(topo.rank)}", store_addr=host, store_port=run["store"].port,
        rank=0, world_size=1, lighthouse_addr=address[0], port=0, hostname=host, use_async_quorum=False,
        timeout=timeout, quorum_timeout=timeout, connect_timeout=timeout,
        init_sync=False)  # every rank builds the same weights (seed 0): torchft's documented setting for it
    if s.fragments == 1:
        fragments = [model]
    else:  # whole modules, in order: the embeddings with the first block, the norm and head with the last
        mods = [model.tok, model.pos, *model.blocks, model.ln, model.head]
        cuts = [len(mods) * i // s.fragments for i in range(s.fragments + 1)]
        fragments = [nn.ModuleList(mods[a:b]) for a, b in zip(cuts, cuts[1:])]
    outers = [torch.optim.SGD(f.parameters(), lr=0.7, momentum=0.9, nesterov=True) for f in fragments]
    run["torchft"] = TorchftDiLoCo(run["manager"], fragments, run["opt"], outers, sync_every=h,
                                   backup_device=torch.device("cpu"), pin_memory=False, use_bucketization=True,
                                   fragment_sync_delay=min(s.delay, h // s.fragments - 1))
    run["torchft"].__enter__()  # its optimizer hooks, until _close
    run["wrapped"] = model
    return run


def _node_address() -> str:
    """This rank's address on the interface its peers reach it by (the node's address inside the emulated
    cluster; the loopback address otherwise)."""
    master = os.environ.get("MASTER_ADDR", "127.0.0.1")
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        sock.connect((master, 1))  # no packet: it only picks the route, and so the source address
        return sock.getsockname()[0]


def _close(run: dict) -> None:
    """torchft's run: its hooks removed, its Manager and (rank 0) Lighthouse shut down."""
    if "torchft" in run:
        run["torchft"].__exit__(None, None, None)
        run["manager"].shutdown(wait=False)
        dist.barrier()
        if "lighthouse" in run:
            run["lighthouse"].shutdown()


def _bytes(topo) -> int:
    """This node's bytes on its link inside the emulated cluster; elsewhere this rank's engine count."""
    if topo.link_rate_bps:
        return wire_bytes()
    from commopt.comm import context

    return sum(context().engine().bytes_sent().values())


def _step(run: dict, step: int, args, topo, memory: PeakMemory) -> None:
    from commopt.bench.models import synthetic_tokens

    data = synthetic_tokens(args.batch, args.seq_len, _VOCAB, seed=10_000 * step + dist.get_rank())
    dist.barrier()
    before = _bytes(topo)
    memory.start()
    t0 = time.perf_counter()
    run["opt"].zero_grad(set_to_none=True)
    logits = run["wrapped"](data[:, :-1])
    loss = nn.functional.cross_entropy(logits.reshape(-1, _VOCAB), data[:, 1:].reshape(-1))
    loss.backward()
    run["opt"].step()
    diloco = run.get("diloco")
    synced = False
    if "torchft" in run:  # its optimizer hook synced a fragment at this step (every H / fragments steps)
        synced = (step + 1) % max(1, run["sync_every"] // run["spec"].fragments) == 0
    if diloco is not None:
        t, h = diloco.steps + 1, diloco.sync_every  # the step DiLoCo is about to count
        synced = any(t % h == o % h or t % h == (o + diloco.delay) % h for o in diloco.offsets)
        diloco.step()
    elapsed = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
    memory.stop(run["name"])
    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)  # the step is as slow as its slowest rank
    run["times"].append(float(elapsed))
    run["synced"].append(synced)
    run["bytes"].append(_bytes(topo) - before)
    mean = loss.detach().clone()
    dist.all_reduce(mean)
    run["losses"].append(float(mean) / dist.get_world_size())


@torch.no_grad()
def _held_out(run: dict, args) -> float:
    """The mean cross-entropy over 4 batches no run trained on, of the model the run would save, averaged
    over the ranks: DiLoCo's global model (``finalize()``: every rank the same weights), DDP's and
    torchft's model as trained."""
    from commopt.bench.models import synthetic_tokens

    if "diloco" in run:
        run["diloco"].finalize()
    total = 0.0
    for i in range(4):
        data = synthetic_tokens(args.batch, args.seq_len, _VOCAB, seed=99_000_000 + 100 * i + dist.get_rank())
        logits = run["model"](data[:, :-1])
        total += float(nn.functional.cross_entropy(logits.reshape(-1, _VOCAB), data[:, 1:].reshape(-1)))
    mean = torch.tensor([total / 4], dtype=torch.float64)
    dist.all_reduce(mean)
    return float(mean) / dist.get_world_size()


def _model_bytes(run: dict, topo) -> float:
    """The busiest node link's bytes per step by the algorithms' traffic model: DDP's gradients in a
    ring over every rank each step; torchft's pseudo-gradients in gloo's ring over the workers every
    H steps; DiLoCo's outer reductions as ``DiLoCo.outer_bytes`` counted them, summed over each node's
    ranks."""
    steps = len(run["times"])
    if "diloco" not in run:
        nbytes = sum(p.numel() * p.element_size() for p in run["model"].parameters() if p.requires_grad)
        ring = algorithms.get("flat").traffic("allreduce", nbytes, topo).link_bytes()
        return ring / run["sync_every"] if "torchft" in run else ring
    sent = torch.zeros(topo.world_size, dtype=torch.float64)
    sent[topo.rank] = run["diloco"].outer_bytes
    dist.all_reduce(sent)
    return max(sum(float(sent[r]) for r in node) for node in topo.nodes) / steps


def _summary(run: dict, args, topo, memory: PeakMemory) -> dict:
    times, synced = run["times"], run["synced"]
    inner = [t for t, s in zip(times, synced) if not s] or times
    nbytes = torch.tensor([statistics.mean(run["bytes"])], dtype=torch.float64)
    dist.all_reduce(nbytes, op=dist.ReduceOp.MAX)  # the busiest node's link
    peak = torch.tensor([memory.peak(run["name"])], dtype=torch.float64)
    dist.all_reduce(peak, op=dist.ReduceOp.MAX)  # the rank that needed the most
    model_bytes = _model_bytes(run, topo)  # the training's outer bytes, before finalize()'s last syncs
    return {"run": run["name"], "step_ms": 1e3 * statistics.mean(times), "inner_ms": 1e3 * statistics.median(inner),
            "exposed_ms": 1e3 * max(statistics.mean(times) - statistics.median(inner), 0.0),
            "peak_memory_bytes": int(peak), "bytes_per_step": float(nbytes), "model_bytes_per_step": model_bytes,
            "final_loss": statistics.mean(run["losses"][-5:]),
            "held_out_loss": _held_out(run, args), "losses": run["losses"],
            "sync_every": run["sync_every"]}


def _warm_codecs(names: list[str], args, topo) -> None:
    """One reduction along the rail through each codec the runs use, before anything is timed: the
    codecs' CPU kernels compile on their first call (about 0.6 s here), which would otherwise land in
    whichever run syncs first."""
    from commopt.comm.compression import reduce_tensors
    from commopt.comm.engine import wait

    if topo.num_nodes < 2:
        return
    for codec in sorted({s.codec for s in map(spec, names) if s is not None and s.codec}):
        t = torch.randn(4096, generator=torch.Generator().manual_seed(0))
        wait(reduce_tensors(_compressor(codec), [t], ["warm-up"], topology=topo, algorithm="rail",
                            timeout=args.timeout), args.timeout, op="commopt-bench diloco/warm-up")


def _torchft_problem(names: list[str], args, topo) -> str | None:
    """Why the torchft runs among ``names`` cannot run here, or None."""
    torchft_runs = [n for n in names if (s := spec(n)) is not None and s.impl == "torchft"]
    if not torchft_runs:
        return None
    try:
        import torchft  # noqa: F401
    except ImportError as exc:
        return (f"torchft is not importable ({exc}); pip install torchft (0.2.0 runs on CPU with gloo; its "
                f"dependencies include opentelemetry)")
    if topo.world_size != topo.num_nodes:
        return (f"torchft's DiLoCo runs one rank per worker (torchft#171), and this world is {topo.layout}; run it "
                f"with --nodes N --ranks-per-node 1")
    for n in torchft_runs:
        h, fragments = _sync_every(args, n), spec(n).fragments
        if fragments > 1 and (h % fragments or h < 2 * fragments):
            return (f"{n}: torchft's streaming syncs one of its {fragments} fragments every sync_every / "
                    f"{fragments} steps, so sync_every ({h}{' with --quick' if args.quick else ''}) must be a "
                    f"multiple of {fragments}, at least {2 * fragments}; e.g. torchft-32-stream")
    return None


def _rank_body(args) -> int:
    topo = topology_of(args)
    names = args.runs.split(",")
    problem = _torchft_problem(names, args, topo)
    if problem is not None:  # the same on every rank: every rank stops before any group is made
        if dist.get_rank() == 0:
            print(f"commopt-bench diloco: {problem}", file=sys.stderr)
        return 2
    runs = [_setup(name, args, topo) for name in names]
    _warm_codecs(names, args, topo)
    memory = PeakMemory(next(runs[0]["model"].parameters()).device)
    interleaved(runs, args.steps, lambda run, step: _step(run, step, args, topo, memory), "runs",
                rank=dist.get_rank())
    results = [_summary(run, args, topo, memory) for run in runs]
    for run in runs:
        _close(run)
    if dist.get_rank() == 0:
        _report(results, args, topo, peak_kind(memory.device))
    return 0


def _held_out_of(name: str) -> str:
    """What a run's held-out loss is measured on."""
    s = spec(name)
    if s is None:
        return "the final weights"
    return "the global model after finalize()" if s.impl == "commopt" else "the model after its last sync"


def _report(results: list[dict], args, topo, kind: str) -> None:
    base = next((r for r in results if r["run"] == "ddp"), results[0])
    link = f", link {topo.link_rate_bps / 1e6:.0f} Mbit/s" if topo.link_rate_bps else ""
    where = "the node's link (interface counters)" if topo.link_rate_bps else "the rank's sends (engine count)"
    print(f"# commopt-bench diloco: GPT d={args.d_model} L={args.layers} seq={args.seq_len} batch={args.batch}/rank, "
          f"{args.steps} steps, world {dist.get_world_size()} ({topo.layout}{link}); one worker per node")
    print(f"# step: mean over every step (inner steps and syncs); peak: the largest peak memory of a step, over the "
          f"steps and the ranks ({kind}); inner: median step without a sync; exposed: the difference; MB/step: "
          f"{where}, the busiest; model MB/step: the traffic model's, the busiest node link; losses: training (last "
          f"5 steps, the workers' local weights) and held-out (DDP: the final weights; DiLoCo: the global model "
          f"after DiLoCo.finalize(); torchft: the model after its last sync)")
    print(f"{'run':<24}{'step ms':>9}{'vs ddp':>8}{'peak MiB':>10}{'inner ms':>10}{'exposed':>9}{'MB/step':>9}"
          f"{'model MB':>10}{'vs ddp':>9}{'train':>8}{'held-out':>10}")
    for r in results:
        model = r["model_bytes_per_step"]
        ratio = base["model_bytes_per_step"] / model if model else float("inf")
        print(f"{r['run']:<24}{r['step_ms']:>9.1f}{base['step_ms'] / r['step_ms']:>7.2f}x"
              f"{r['peak_memory_bytes'] / 2**20:>10.1f}{r['inner_ms']:>10.1f}"
              f"{r['exposed_ms']:>9.1f}{r['bytes_per_step'] / 2**20:>9.2f}{model / 2**20:>10.3f} {ratio:>7.0f}x"
              f"{r['final_loss']:>8.4f}{r['held_out_loss']:>10.4f}")
    by_name = {r["run"]: r for r in results}
    for name, r in by_name.items():  # what streaming hides of the same setting's unstreamed sync
        plain = by_name.get(name.removesuffix("-stream")) if name.endswith("-stream") else None
        if plain is not None and plain["exposed_ms"] > 0:
            print(f"# {name}: exposed {r['exposed_ms']:.1f} ms/step against {plain['exposed_ms']:.1f} unstreamed: "
                  f"hides {100 * (1 - r['exposed_ms'] / plain['exposed_ms']):.0f} % of the outer sync (target >= 90 %)")
    if base["run"] == "ddp":
        for r in results:
            if r is base or r["model_bytes_per_step"] * 100 > base["model_bytes_per_step"]:
                continue
            model = r["model_bytes_per_step"]
            fewer = base["model_bytes_per_step"] / model if model else float("inf")
            print(f"# {r['run']}: {base['step_ms'] / r['step_ms']:.2f}x DDP's step (target >= 4x), "
                  f"{fewer:.0f}x fewer bytes (target >= 100x), loss against DDP's (target within 3 %): training "
                  f"{100 * (r['final_loss'] / base['final_loss'] - 1):+.1f} % (the workers' local weights), "
                  f"held-out {100 * (r['held_out_loss'] / base['held_out_loss'] - 1):+.1f} % "
                  f"({_held_out_of(r['run'])})")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump({"kind": "diloco", "args": vars(args), "layout": topo.layout, "world_size": dist.get_world_size(),
                       "link_rate_bps": topo.link_rate_bps, "memory": kind, "results": results}, f, indent=1)
