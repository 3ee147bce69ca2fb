"""``commopt-bench ina-switch``: run the simulated in-network aggregation switch, or measure it.

Serve (the default)::

    commopt-bench ina-switch --host 127.0.0.1 --port 0
    # prints "commopt ina switch listening on 127.0.0.1:PORT ..." and serves until SIGTERM/SIGINT,
    # then prints its counters and exits 0.

Measure loopback throughput (not a test; numbers depend on the machine)::

    commopt-bench ina-switch --bench 2,4 --size 16M --iters 5

spawns a switch and N worker processes per entry, all-reduces ``--size`` bytes of fp32 ``--iters``
times after one warm-up, and prints per-worker throughput (bytes of the tensor / time per all-reduce)
with the switch's retransmission counters. It first measures the switch's own work per datagram
in-process (no scheduling noise): the bound a Python switch puts on throughput. ``local(ms)`` is the
workers' own exponent + quantize + dequantize time for the tensor, for comparison. The switch
binds to loopback unless ``--host`` says otherwise (docs/faults.md row 29).
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import multiprocessing as mp
import os
import sys
import time
import types
from typing import Any

from ._progress import progress

__all__ = ["main"]


def _size(text: str) -> int:
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    text = text.strip().upper().rstrip("B")
    if text and text[-1] in units:
        return int(float(text[:-1]) * units[text[-1]])
    return int(text)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="commopt-bench ina-switch", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default: loopback only)")
    p.add_argument("--port", type=int, default=0, help="UDP port (0: pick a free one; printed)")
    p.add_argument("--pool-slots", type=int, default=1024, help="slots in the pool")
    p.add_argument("--partition-size", type=int, default=64, help="slots per job (slot 0 is control)")
    p.add_argument("--job-idle-timeout", type=float, default=300.0,
                   help="seconds after which an idle job's partition is reclaimed")
    p.add_argument("--join-timeout", type=float, default=5.0,
                   help="seconds after its last JOIN that an incomplete join releases its partition")
    p.add_argument("--max-pending-per-source", type=int, default=2,
                   help="incomplete jobs one source address (host, port) may hold at once")
    p.add_argument("--send-threads", type=int, default=2,
                   help="threads that send datagrams (0: the receiving thread sends)")
    p.add_argument("--recv-threads", type=int, default=1, help="threads that receive datagrams")
    p.add_argument("--bench", default=None, metavar="N[,N...]",
                   help="measure instead of serving: all-reduce with N local worker processes")
    p.add_argument("--size", default="16M", help="bytes of fp32 per all-reduce (--bench)")
    p.add_argument("--iters", type=int, default=5, help="timed all-reduces after one warm-up (--bench)")
    p.add_argument("--window", type=int, default=8, help="packets in flight per worker (--bench)")
    p.add_argument("--payload", type=int, default=16000, help="int32 lanes per datagram (--bench)")
    return p


def _light_switch_module() -> types.ModuleType:
    """``commopt.comm.ina.launcher`` (with ``switch`` and ``protocol``) loaded without running
    ``commopt.comm``'s package imports.

    The switch needs only numpy; importing the package would load torch and all of commopt first,
    seconds of start-up for nothing. ``find_spec`` of ``commopt.comm`` imports only the (namespace)
    parent, so it locates the folder without executing it. The module has ``Switch`` and
    ``serve_main``.
    """
    spec = importlib.util.find_spec("commopt.comm")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError("commopt-bench ina-switch: commopt.comm is not installed (pip install -e .)")
    folder = os.path.join(list(spec.submodule_search_locations)[0], "ina")
    name = "_commopt_ina_switch_pkg"
    if name not in sys.modules:
        pkg = types.ModuleType(name)
        pkg.__path__ = [folder]
        sys.modules[name] = pkg
    return importlib.import_module(f"{name}.launcher")


def _bench_worker(address: tuple[str, int], job_id: int, worker: int, n: int, numel: int, iters: int,
                  window: int, payload: int, queue: Any) -> None:
    import torch

    from commopt.comm.ina.session import InaSession

    torch.set_num_threads(1)
    x = torch.randn(numel, generator=torch.Generator().manual_seed(worker))
    buf = x.clone()
    with InaSession(address, job_id=job_id, worker_id=worker, num_workers=n, window=window,
                    payload_elems=payload, timeout=120.0) as s:
        s.all_reduce(buf)  # warm-up: join, first exponent round
        times = []
        for _ in range(iters):
            buf.copy_(x)
            t0 = time.perf_counter()
            s.all_reduce(buf)
            times.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        for _ in range(iters):
            q = s_quant(buf, x)
        t_local = (time.perf_counter() - t0) / iters
        del q
        queue.put((worker, times, t_local, dict(s.counters)))


def s_quant(buf: Any, x: Any) -> Any:
    """The worker-local part of one all-reduce (exponent, quantize, dequantize), for the breakdown."""
    from commopt.comm.ina.bfp import block_shift, dequantize, max_exponent, quantize

    shift = block_shift(max_exponent(x), 4)
    return buf.copy_(dequantize(quantize(x, shift), shift, x.dtype))


def _switch_cost(n: int, payload: int, rounds: int = 256) -> float:
    """Seconds the switch spends per DATA packet (parse, aggregate, and on completion n sends).

    Measured in this process on pre-built packets, so it isolates the switch's own work from the
    workers' and from scheduling: the bound a Python switch puts on throughput.
    """
    import socket

    import numpy as np

    mod = _light_switch_module()
    proto = sys.modules[mod.__name__.rsplit(".", 1)[0] + ".protocol"]
    sw = mod.Switch()
    sinks = [socket.socket(socket.AF_INET, socket.SOCK_DGRAM) for _ in range(n)]
    try:
        for s in sinks:
            s.bind(("127.0.0.1", 0))
        addrs = [s.getsockname() for s in sinks]
        for w in range(n):
            join = bytearray(proto.pack_header(proto.PacketType.JOIN, job_id=1, worker_id=w, num_workers=n,
                                               tag=w + 1))
            sw.handle(join, len(join), addrs[w])
        epoch = sw.jobs[(1, 0)].epoch  # jobs are keyed by identity: (job id, nonce)
        body = np.arange(payload, dtype="<i4").tobytes()
        width = sw.partition_size - 1
        packets = [(bytearray(proto.pack_header(proto.PacketType.DATA, flags=(c // width) & 1, dtype=1, job_id=1,
                                                worker_id=w, num_workers=n, slot=1 + c % width, epoch=epoch,
                                                seq=c, count=payload, tag=w + 1) + body), addrs[w])
                   for c in range(rounds) for w in range(n)]
        t0 = time.perf_counter()
        for pkt, addr in packets:
            sw.handle(pkt, len(pkt), addr)
        return (time.perf_counter() - t0) / len(packets)
    finally:
        for s in sinks:
            s.close()
        sw.close()


def _bench(args: argparse.Namespace) -> int:
    from commopt.comm.ina.launcher import SwitchProcess

    nbytes = _size(args.size)
    numel = nbytes // 4
    ctx = mp.get_context("spawn")
    print(f"# ina loopback benchmark: fp32 all-reduce of {nbytes / 2**20:.1f} MiB, {args.iters} iterations, "
          f"window {args.window} x {args.payload * 4 // 1024} KiB datagrams; one Python switch process",
          flush=True)
    counts = [int(v) for v in args.bench.split(",") if v.strip()]
    for n in counts:
        cost = _switch_cost(n, args.payload)
        print(f"# switch work per datagram with {n} workers: {cost * 1e6:.1f} us -> it can absorb "
              f"{args.payload * 4 / cost / 1e6:.0f} MB/s in total, {args.payload * 4 / cost / 1e6 / n:.0f} MB/s "
              "per worker", flush=True)
    print(f"{'workers':>7} {'time(ms)':>9} {'MB/s/worker':>12} {'local(ms)':>10} {'retx':>6} "
          f"{'sw_pkts':>8} {'sw_retx':>8}", flush=True)
    bar = progress(len(counts), "worker counts", unit="run")
    for n in counts:
        with SwitchProcess(args.host, 0, pool_slots=args.pool_slots, partition_size=args.partition_size) as sw:
            queue = ctx.Queue()
            procs = [ctx.Process(target=_bench_worker, args=(sw.address, 100 + n, w, n, numel, args.iters,
                                                             args.window, args.payload, queue))
                     for w in range(n)]
            for p in procs:
                p.start()
            try:
                results = [queue.get(timeout=600) for _ in procs]
            finally:
                for p in procs:
                    p.join(30)
                    if p.is_alive():
                        p.kill()
                        p.join()
            stats = sw.stats()
        t = max(sorted(r[1])[len(r[1]) // 2] for r in results)  # median per worker, slowest worker
        local = max(r[2] for r in results)
        retx = sum(r[3]["retransmissions"] for r in results)
        bar.clear()  # the row goes where the bar was; the bar comes back below it
        print(f"{n:>7} {t * 1e3:>9.1f} {nbytes / t / 1e6:>12.1f} {local * 1e3:>10.1f} {retx:>6} "
              f"{stats['packets']:>8} {stats['retransmissions']:>8}", flush=True)
        bar.update()
    bar.close()
    return 0


def main(argv: list[str]) -> int:
    args = _parser().parse_args(argv)
    if args.bench:
        return _bench(args)
    serve_argv = ["--host", args.host, "--port", str(args.port), "--pool-slots", str(args.pool_slots),
                  "--partition-size", str(args.partition_size), "--job-idle-timeout", str(args.job_idle_timeout),
                  "--join-timeout", str(args.join_timeout),
                  "--max-pending-per-source", str(args.max_pending_per_source),
                  "--send-threads", str(args.send_threads), "--recv-threads", str(args.recv_threads)]
    return int(_light_switch_module().serve_main(serve_argv))


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
