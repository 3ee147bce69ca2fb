"""``commopt-bench kernels``: each packing kernel's throughput against a plain copy of the same bytes.

For every kernel the benchmark counts the bytes it moves (read + written), times it (best of
``--repeat`` runs after a warm-up), and reports bytes per second and the ratio to a torch copy
that moves the same number of bytes (a copy of half as many bytes: it reads and writes each),
measured in the same run, so that machine noise affects both sides alike. On CPU each kernel runs
with numba on one thread and on all threads, next to the torch reference; on CUDA the kernels are
first checked bit for bit against the CPU reference, then timed with CUDA events.

Usage::

    commopt-bench kernels [--device cpu|cuda] [--size N] [--threads 1,all] [--repeat R] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Callable, Sequence

import torch

import commopt.kernels as K

from ._progress import progress

__all__ = ["main", "parity_failures"]


# ---------------------------------------------------------------------------------------------------
# parity (CUDA against the CPU reference)


def _equal(a: torch.Tensor | None, b: torch.Tensor | None) -> bool:
    if a is None or b is None:
        return a is None and b is None
    a, b = a.cpu(), b.cpu()
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    if a.dtype.is_floating_point:
        nan = torch.isnan(a)
        if not torch.equal(nan, torch.isnan(b)):
            return False
        a, b = a[~nan], b[~nan]
        return torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))
    return torch.equal(a, b)


def parity_failures(device: torch.device, sizes: Sequence[int] = (0, 1, 31, 33, 257, 4099, 1 << 20)) -> list[str]:
    """Run every kernel on ``device`` (default dispatch) and on the CPU reference; list mismatches.

    Bit-exact comparison everywhere except pack_signs scales (fp64 means, rtol 1e-6).
    """
    failures: list[str] = []
    gen = torch.Generator().manual_seed(0)
    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        for n in sizes:
            x = (torch.randn(n, generator=gen, dtype=torch.float64) * 3 + 1e-3).to(dtype)
            xd = x.to(device)
            tag = f"{dtype} n={n}"

            def check(what: str, got: object, want: object, tag: str = tag) -> None:
                got = got if isinstance(got, tuple) else (got,)
                want = want if isinstance(want, tuple) else (want,)
                if not all(_equal(g, w) for g, w in zip(got, want)):
                    failures.append(f"{what} {tag}")

            for block in (None, 256, 33):
                bits, scales = K.pack_signs(xd, block=block)
                rbits, rscales = K.pack_signs(x, block=block, backend="reference")
                check(f"pack_signs block={block}", bits, rbits)
                if block is not None:
                    if not torch.allclose(scales.cpu(), rscales, rtol=1e-6, atol=0):
                        failures.append(f"pack_signs scales block={block} {tag}")
                    check(f"unpack_signs block={block}",
                          K.unpack_signs(rbits.to(device), n, rscales.to(device), block=block, dtype=dtype),
                          K.unpack_signs(rbits, n, rscales, block=block, dtype=dtype, backend="reference"))
            for bits_, block in ((8, 256), (8, 33), (4, 256), (4, 6)):
                for stochastic in (True, False):
                    kw = dict(bits=bits_, block=block, seed=3, step=7, stochastic=stochastic)
                    want = K.quantize(x, backend="reference", **kw)
                    check(f"quantize {kw}", K.quantize(xd, **kw), want)
                    check(f"dequantize {kw}",
                          K.dequantize(want[0].to(device), want[1].to(device), n, bits=bits_, block=block, dtype=dtype),
                          K.dequantize(*want, n, bits=bits_, block=block, dtype=dtype, backend="reference"))
            for k in sorted({0, 1, n // 3, n} & set(range(n + 1))):
                want = K.topk_pack(x, k, backend="reference")
                check(f"topk_pack k={k}", K.topk_pack(xd, k), want)
                check(f"scatter_add_unpack k={k}",
                      K.scatter_add_unpack([want.to(device)] * 3, n, dtype=dtype),
                      K.scatter_add_unpack([want] * 3, n, dtype=dtype, backend="reference"))
            parts = [x[: n // 3], x[n // 3 :].reshape(-1, 1).t(), x[:0]]
            check("flatten", K.flatten([p.to(device) for p in parts], align=16)[0],
                  K.flatten(parts, align=16, backend="reference")[0])
            if n:
                splits = [n // 4, 0, n - n // 4]
                check("permute_chunks", K.permute_chunks(xd, splits, [2, 0, 1]),
                      K.permute_chunks(x, splits, [2, 0, 1], backend="reference"))
    return failures


# ---------------------------------------------------------------------------------------------------
# timing


def _timer(device: torch.device) -> Callable[[Callable[[], object], int], float]:
    """Best-of-``repeat`` wall time of a call: CUDA events on a GPU, perf_counter otherwise."""
    if device.type == "cuda":

        def cuda_best(fn: Callable[[], object], repeat: int) -> float:
            fn()
            torch.cuda.synchronize(device)
            best = float("inf")
            for _ in range(repeat):
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                fn()
                end.record()
                end.synchronize()
                best = min(best, start.elapsed_time(end) / 1e3)
            return best

        return cuda_best

    def cpu_best(fn: Callable[[], object], repeat: int) -> float:
        fn()
        best = float("inf")
        for _ in range(repeat):
            t = time.perf_counter()
            fn()
            best = min(best, time.perf_counter() - t)
        return best

    return cpu_best


def _cases(n: int, device: torch.device) -> list[tuple[str, int, Callable[[str | None], object]]]:
    """(name, bytes moved, run(backend)) for every kernel on an fp32 input of n elements."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(n, generator=gen).to(device)
    f = 4
    tensors = list(torch.split(x, [n // 64] * 63 + [n - 63 * (n // 64)]))
    flat = torch.empty(K.flatten(tensors, align=16, backend="reference")[1][-1], device=device)
    dests = [torch.empty_like(t) for t in tensors]
    bits, signs_scales = K.pack_signs(x, block=256, backend="reference")
    codes, scales = K.quantize(x, backend="reference")
    k = max(1, n // 100)
    payloads = [K.topk_pack(x.roll(r), k, backend="reference") for r in range(4)]
    splits = [n // 8 - 3] * 4 + [n // 8 + 3] * 4
    splits[-1] += n - sum(splits)
    order = [3, 7, 0, 5, 1, 6, 2, 4]
    perm_out = torch.empty_like(x)
    s = n // 256 * 4
    dense = torch.empty(n, device=device)  # outputs given with out=, so that page faults of fresh
    # 64 MiB allocations (mmap'd by malloc) are not what is measured
    return [
        ("flatten (64 tensors)", 2 * n * f, lambda b: K.flatten(tensors, flat, backend=b)),
        ("unflatten (64 tensors)", 2 * n * f, lambda b: K.unflatten(flat, dests, backend=b)),
        ("pack_signs", n * f + n // 8, lambda b: K.pack_signs(x, backend=b)),
        ("pack_signs block=256", n * f + n // 8 + s, lambda b: K.pack_signs(x, block=256, backend=b)),
        ("unpack_signs block=256", n // 8 + s + n * f,
         lambda b: K.unpack_signs(bits, n, signs_scales, block=256, out=dense, backend=b)),
        ("quantize int8 stochastic", n * f + n + s, lambda b: K.quantize(x, backend=b)),
        ("quantize int8 nearest", n * f + n + s, lambda b: K.quantize(x, stochastic=False, backend=b)),
        ("quantize int4 stochastic", n * f + n // 2 + s, lambda b: K.quantize(x, bits=4, backend=b)),
        ("dequantize int8", n + s + n * f, lambda b: K.dequantize(codes, scales, n, out=dense, backend=b)),
        ("topk_pack k=n/100", n * f + 8 * k, lambda b: K.topk_pack(x, k, backend=b)),
        ("scatter_add_unpack 4 x k", n * f + 4 * 8 * k,
         lambda b: K.scatter_add_unpack(payloads, n, out=dense, backend=b)),
        ("permute_chunks (8 uneven)", 2 * n * f, lambda b: K.permute_chunks(x, splits, order, out=perm_out, backend=b)),
    ]


def _copy_fn(nbytes: int, device: torch.device) -> Callable[[], object]:
    """A torch copy that moves ``nbytes`` bytes: it reads and writes ``nbytes / 2`` each."""
    half = max(1, nbytes // 2)
    src = torch.ones(half, dtype=torch.uint8, device=device)
    dst = torch.zeros_like(src)
    return lambda: dst.copy_(src)


def _interleaved(fns: dict[str, tuple[Callable[[], object], int]]) -> dict[str, float]:
    """Best time of each function, timed in turn round after round (each with its own number of
    rounds), so that a burst of load from elsewhere hits all of them alike."""
    for fn, _ in fns.values():
        fn()  # warm-up: compilation, first-touch page faults
    best = {name: float("inf") for name in fns}
    for r in range(max(rounds for _, rounds in fns.values())):
        for name, (fn, rounds) in fns.items():
            if r < rounds:
                t = time.perf_counter()
                fn()
                best[name] = min(best[name], time.perf_counter() - t)
    return best


def _bench_cpu(n: int, threads: list[int], repeat: int) -> list[dict]:
    import numba

    rows = []
    cases = _cases(n, torch.device("cpu"))
    bar = progress(len(threads) * len(cases), "kernels", unit="kernel")
    for t in threads:
        numba.set_num_threads(t)
        torch.set_num_threads(t)
        for name, moved, run in cases:
            bar.set_postfix_str(f"{name}, {t} thread(s)")
            best = _interleaved({
                "copy": (_copy_fn(moved, torch.device("cpu")), repeat),
                "numba": (lambda run=run: run("cpu"), repeat),
                # the reference is up to 1000x slower: fewer rounds keep the run short
                "reference": (lambda run=run: run("reference"), min(repeat, 3)),
            })
            copy = moved / best["copy"]
            for backend in ("numba", "reference"):
                rate = moved / best[backend]
                rows.append(dict(kernel=name, backend=backend, threads=t, bytes=moved, gbps=rate / 1e9,
                                 copy_gbps=copy / 1e9, ratio=rate / copy))
            bar.update()
    bar.close()
    return rows


def _bench_cuda(n: int, repeat: int) -> list[dict]:
    device = torch.device("cuda")
    best = _timer(device)
    rows = []
    cases = _cases(n, device)
    bar = progress(len(cases), "kernels", unit="kernel")
    for name, moved, run in cases:
        bar.set_postfix_str(name)
        copy = moved / best(_copy_fn(moved, device), repeat)
        rate = moved / best(lambda run=run: run(None), repeat)
        rows.append(dict(kernel=name, backend="cuda", threads=0, bytes=moved, gbps=rate / 1e9, copy_gbps=copy / 1e9,
                         ratio=rate / copy))
        bar.update()
    bar.close()
    return rows


def _print(rows: list[dict]) -> None:
    print(f"{'kernel':<28}{'backend':<11}{'threads':>8}{'MB moved':>10}{'GB/s':>9}{'copy GB/s':>11}{'x copy':>8}")
    for r in rows:
        print(f"{r['kernel']:<28}{r['backend']:<11}{r['threads']:>8}{r['bytes'] / 1e6:>10.1f}{r['gbps']:>9.2f}"
              f"{r['copy_gbps']:>11.2f}{r['ratio']:>8.3f}")
    numba_rows = {(r["kernel"], r["threads"]): r for r in rows if r["backend"] == "numba"}
    ref_rows = {(r["kernel"], r["threads"]): r for r in rows if r["backend"] == "reference"}
    speedups = [f"{k[0]} ({k[1]} thr): {numba_rows[k]['gbps'] / ref_rows[k]['gbps']:.1f}x"
                for k in numba_rows if k in ref_rows]
    if speedups:
        print("\nnumba / reference:\n  " + "\n  ".join(speedups))


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="commopt-bench kernels", description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--size", type=int, default=1 << 22, help="fp32 elements per kernel call (default 4 Mi)")
    parser.add_argument("--threads", default="1,all", help="CPU thread counts, comma-separated ('all' = every core)")
    parser.add_argument("--repeat", type=int, default=7, help="timed runs per measurement; the best counts")
    parser.add_argument("--json", metavar="PATH", help="also write the rows as JSON")
    args = parser.parse_args(argv)
    if args.size < 1024:
        parser.error("--size must be at least 1024")
    meta = dict(device=args.device, size=args.size, dtype="float32", repeat=args.repeat,
                backends=K.available_backends(), torch=torch.__version__)
    if args.device == "cuda":
        if not torch.cuda.is_available() or K.available_backends()["cuda"] is not None:
            print(f"commopt-bench kernels: CUDA backend unavailable: {K.available_backends()['cuda']}",
                  file=sys.stderr)
            return 2
        failures = parity_failures(torch.device("cuda"))
        print(f"parity against the CPU reference: {'OK' if not failures else 'FAILED'}")
        for f in failures:
            print(f"  mismatch: {f}")
        rows = _bench_cuda(args.size, args.repeat)
        meta["parity_failures"] = failures
        meta["gpu"] = torch.cuda.get_device_name()
    else:
        if K.available_backends()["cpu"] is not None:
            print(f"commopt-bench kernels: numba unavailable: {K.available_backends()['cpu']}", file=sys.stderr)
            return 2
        import numba

        every = int(numba.config.NUMBA_NUM_THREADS)
        try:
            threads = sorted({every if t.strip() == "all" else int(t) for t in args.threads.split(",")})
        except ValueError:
            parser.error(f"--threads {args.threads!r}: comma-separated integers or 'all'")
        if any(t < 1 or t > every for t in threads):
            parser.error(f"--threads values must be in [1, {every}]")
        print(f"# {args.size} fp32 elements, best of {args.repeat}, {os.cpu_count()} CPUs, threads {threads}")
        rows = _bench_cpu(args.size, threads, args.repeat)
        failures = []
    _print(rows)
    if args.json:
        with open(args.json, "w", encoding="utf-8") as fh:
            json.dump(dict(meta=meta, rows=rows), fh, indent=2)
    return 1 if failures else 0



