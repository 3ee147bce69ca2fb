"""``commopt-bench ina-overlap``: does DDP on the ``"ina"`` backend overlap its all-reduces with backward?

docs/faults.md row 37 asks that the ``"ina"`` backend's ``allreduce`` return a work that completes later, so
that DDP's backward is not blocked by the switch. This benchmark shows whether it is: N local ranks
(spawned, default 2) wrap a model of ``--layers`` layers of ``--layer-mb`` MiB of fp32 parameters each
in DDP on an ``"ina"`` group (``bucket_cap_mb=--layer-mb``: one bucket per layer) and time, per step,
with a barrier before each:

- ``compute``: the backward of the same model without DDP (no communication at all);
- ``allreduce``: one all-reduce of one layer's bytes on the ``"ina"`` group alone;
- ``ddp``: the DDP backward (backward() returns once every bucket is reduced);
- ``delay``: ``ddp - compute``, how long after its last gradient was computed the DDP backward ends,
  also as a fraction of one all-reduce;
- ``gloo``: the same delay of DDP on the default gloo group, side by side;
- ``floor``: the same delay of DDP whose comm hook returns each bucket at once (no communication):
  DDP's own work (copying gradients into buckets and back, its bookkeeping) on this machine, which
  no backend can hide. ``delay - floor`` is what the all-reduces add.

Each layer's backward is padded with a sleep of ``--sleep-ms`` (a custom autograd function on the
layer's input, so it runs after the layer's parameter gradients are ready, as the next layer's
compute would), which keeps the cores free for the switch and the ranks' communication threads.
Synchronous all-reduces add up: ``delay`` is about ``layers x allreduce``. Overlapped ones hide
behind the padding, and only what does not fit behind the last layer's padding shows. The numbers
are the slowest rank's per step; the summary line gives medians. Not a test (docs/architecture.md section 9.4).

Measured on a busy 2-core box, 2 ranks, defaults: with the synchronous backend (before docs/faults.md row 37)
``delay`` was 196-279 ms, 8.0-9.3 all-reduces; with the asynchronous one 18-21 ms, 0.65-0.76 of one
all-reduce (24-32 ms), of which DDP's own work is 14-20 ms (``floor``, gloo's delay is the same): the
all-reduces add 1-4 ms, 0.04-0.17 of one. The floor is DDP's own copying and bookkeeping, not the
switch's, and no backend can remove it.

    commopt-bench ina-overlap                   # 2 ranks, 8 x 4 MiB, 40 ms of padding per layer
    commopt-bench ina-overlap --spawn 4 --sleep-ms 60 --steps 10
"""

from __future__ import annotations

import argparse
import copy
import math
import statistics
import sys
import time
from typing import Any

import torch
import torch.distributed as dist

from ._launch import launch

__all__ = ["main", "PadBackward", "padded_model"]


class PadBackward(torch.autograd.Function):
    """Identity forward; its backward sleeps ``seconds`` (compute that leaves the cores free)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, seconds: float) -> torch.Tensor:  # type: ignore[override]
        ctx.seconds = seconds
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:  # type: ignore[override]
        time.sleep(ctx.seconds)
        return grad, None


class _Padded(torch.nn.Module):
    def __init__(self, layers: int, width: int, seconds: float):
        super().__init__()
        self.layers = torch.nn.ModuleList(torch.nn.Linear(width, width, bias=False) for _ in range(layers))
        self.seconds = seconds

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            # The pad sits on the layer's input: in backward it runs after the layer's weight
            # gradient (AccumulateGrad runs first), where the previous layer's compute would be.
            x = layer(PadBackward.apply(x, self.seconds))
        return x


def padded_model(layers: int, layer_mb: float, sleep_ms: float) -> torch.nn.Module:
    """``layers`` square bias-free linear layers of about ``layer_mb`` MiB of fp32 each, backward padded."""
    width = max(1, math.isqrt(int(layer_mb * 2**20) // 4))
    return _Padded(layers, width, sleep_ms / 1e3)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="commopt-bench ina-overlap", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--spawn", type=int, default=2, help="local ranks to spawn (default 2)")
    p.add_argument("--switch", default=None, metavar="HOST:PORT",
                   help="a running switch (default: start one on loopback for the run)")
    p.add_argument("--layers", type=int, default=8, help="layers of the model (one DDP bucket each)")
    p.add_argument("--layer-mb", type=float, default=4.0, help="MiB of fp32 parameters per layer")
    p.add_argument("--sleep-ms", type=float, default=40.0, help="padding of each layer's backward (ms)")
    p.add_argument("--batch", type=int, default=8, help="rows of the input")
    p.add_argument("--steps", type=int, default=6, help="timed steps")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps first (DDP rebuilds its buckets)")
    p.add_argument("--timeout", type=float, default=120.0, help="seconds per collective")
    p.add_argument("--switch-interval-ms", type=float, default=None,
                   help="the ranks' sys.setswitchinterval (default: Python's 5 ms; a diagnosis knob, see above)")
    p.add_argument("--bucket-view", action="store_true",
                   help="DDP's gradient_as_bucket_view=True (no copies between gradients and buckets)")
    return p


def _no_communication(state, bucket):  # noqa: ANN001, ANN201 - DDP rejects string annotations
    """A DDP comm hook that hands the bucket back at once: DDP's own cost, without communication."""
    fut: torch.futures.Future = torch.futures.Future()
    fut.set_result(bucket.buffer())
    return fut


def _timed_backward(module: torch.nn.Module, x: torch.Tensor) -> float:
    out = module(x).sum()
    t0 = time.perf_counter()
    out.backward()
    return time.perf_counter() - t0


def _rank(args: argparse.Namespace) -> int:
    from commopt.comm.ina import InaOptions

    rank, world = dist.get_rank(), dist.get_world_size()
    if args.switch_interval_ms is not None:
        sys.setswitchinterval(args.switch_interval_ms / 1e3)
    ina = dist.new_group(backend="ina", pg_options=InaOptions(switch=args.switch, timeout=args.timeout))
    torch.manual_seed(0)
    local = padded_model(args.layers, args.layer_mb, args.sleep_ms)
    def wrap(group: Any) -> torch.nn.Module:
        return torch.nn.parallel.DistributedDataParallel(copy.deepcopy(local), process_group=group,
                                                         bucket_cap_mb=args.layer_mb,
                                                         gradient_as_bucket_view=args.bucket_view)

    ddp, gloo, floor = wrap(ina), wrap(None), wrap(None)
    floor.register_comm_hook(None, _no_communication)
    width = local.layers[0].in_features
    x = torch.randn(args.batch, width, requires_grad=True)  # so the first layer's pad runs too
    buf = torch.randn(width * width)
    rows = []
    for step in range(args.warmup + args.steps):
        dist.barrier()
        compute = _timed_backward(local, x)
        dist.barrier()
        t0 = time.perf_counter()
        dist.all_reduce(buf, group=ina)
        allreduce = time.perf_counter() - t0
        dist.barrier()
        overlapped = _timed_backward(ddp, x)
        dist.barrier()
        reference = _timed_backward(gloo, x)
        dist.barrier()
        bare = _timed_backward(floor, x)
        for m in (local, ddp, gloo, floor):
            m.zero_grad(set_to_none=True)
        x.grad = None
        mine = torch.tensor([compute, allreduce, overlapped, overlapped - compute, reference - compute,
                             bare - compute], dtype=torch.float64)
        dist.all_reduce(mine, op=dist.ReduceOp.MAX)  # the slowest rank's (on the default gloo group)
        if step >= args.warmup:
            rows.append(mine.tolist())
            if rank == 0:
                c, a, d, delay, ref, low = (v * 1e3 for v in rows[-1])
                print(f"{step - args.warmup + 1:>4} {c:>12.1f} {a:>13.1f} {d:>11.1f} {delay:>10.1f} {ref:>9.1f} "
                      f"{low:>9.1f} {delay / a:>9.2f}", flush=True)
    if rank == 0:
        med = [statistics.median(r[i] for r in rows) * 1e3 for i in range(6)]
        print(f"median compute {med[0]:.1f} ms, allreduce {med[1]:.1f} ms, ddp {med[2]:.1f} ms: last gradient "
              f"ready delay {med[3]:.1f} ms = {med[3] / med[1]:.2f} x one all-reduce; gloo DDP's delay "
              f"{med[4]:.1f} ms; DDP's own (no communication) {med[5]:.1f} ms, so the all-reduces add "
              f"{med[3] - med[5]:.1f} ms = {(med[3] - med[5]) / med[1]:.2f} x one all-reduce "
              f"({world} ranks, {args.layers} buckets)", flush=True)
    del ddp, gloo, floor  # DDP releases its groups first (see tests/test_ina_procs.py::_train)
    dist.destroy_process_group(ina)
    return 0


def main(argv: list[str]) -> int:
    args = _parser().parse_args(argv)
    head = (f"# ina overlap: {args.spawn} ranks, DDP on the 'ina' backend, {args.layers} layers x "
            f"{args.layer_mb:g} MiB fp32 (bucket_cap_mb={args.layer_mb:g}: one bucket per layer), backward padded "
            f"with {args.sleep_ms:g} ms per layer; slowest rank per step\n"
            f"{'step':>4} {'compute(ms)':>12} {'allreduce(ms)':>13} {'ddp(ms)':>11} {'delay(ms)':>10} "
            f"{'gloo(ms)':>9} {'floor(ms)':>9} {'delay/ar':>9}")
    if args.switch is not None:
        print(f"{head.replace('# ina overlap:', f'# ina overlap (switch {args.switch}):', 1)}", flush=True)
        return launch(_rank, args, spawn=args.spawn, timeout=args.timeout, single=False)
    from commopt.comm.ina import SwitchProcess

    with SwitchProcess() as sw:
        args.switch = f"{sw.address[0]}:{sw.address[1]}"
        print(head, flush=True)
        code = launch(_rank, args, spawn=args.spawn, timeout=args.timeout, single=False)
        stats = sw.stats()
    print(f"# switch: {stats.get('packets', 0)} packets, {stats.get('retransmissions', 0)} retransmissions "
          f"received, {stats.get('results_resent', 0)} results resent", flush=True)
    return code


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
