"""``commopt-bench``: every benchmark of commopt behind one command.

``commopt-bench`` with no arguments runs the main job: 4 local ranks on a logical 2x2 topology,
all-reduce swept from 1 KiB to 16 MiB for ``flat`` and ``hierarchical``, printed nccl-tests style.
``commopt-bench SUBCOMMAND --help`` describes each subcommand.
"""

from __future__ import annotations

import importlib
import sys

__all__ = ["main", "SUBCOMMANDS"]

# subcommand -> (module under commopt.bench, one-line help). Each module has main(argv) -> int.
SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "collectives": ("collectives", "all-reduce / reduce-scatter / all-gather / all-to-all sweep"),
    "cluster": ("cluster", "emulated multi-node cluster (network namespaces + tc) around a command"),
    "moe": ("moe", "MoE layer forward+backward with and without all-to-all / expert overlap"),
    "kernels": ("kernels", "throughput of the packing kernels against a plain copy"),
    "ddp": ("ddp", "a small GPT trained with DDP under each comm hook: step time, bytes, loss"),
    "ina-switch": ("ina_switch", "run the simulated in-network aggregation switch"),
    "overlap": ("overlap", "OverlapDataParallel vs DDP interleaved, with the simulator's prediction"),
    "simulate": ("simulate", "iteration simulator: step time and exposed communication per schedule"),
    "traffic": ("traffic", "traffic matrix (bytes between rank pairs) per algorithm, as heatmaps"),
}

_MAIN_JOB = ["collectives", "--spawn", "4", "--topology", "2x2", "--op", "allreduce",
             "--algo", "flat,hierarchical", "--sizes", "1K:16M"]


def _usage() -> str:
    lines = ["usage: commopt-bench [SUBCOMMAND] [ARGS...]", "",
             "With no subcommand: " + " ".join(_MAIN_JOB), "", "subcommands:"]
    lines += [f"  {name:<14}{text}" for name, (_, text) in SUBCOMMANDS.items()]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv:
        argv = list(_MAIN_JOB)
    if argv[0] in ("-h", "--help"):
        print(_usage())
        return 0
    name, rest = argv[0], argv[1:]
    if name not in SUBCOMMANDS:
        print(f"commopt-bench: unknown subcommand {name!r}\n\n{_usage()}", file=sys.stderr)
        return 2
    module = importlib.import_module(f"commopt.bench.{SUBCOMMANDS[name][0]}")
    return int(module.main(rest) or 0)


if __name__ == "__main__":
    sys.exit(main())
