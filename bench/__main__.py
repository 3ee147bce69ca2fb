"""``commopt-bench``: every benchmark of commopt behind one command.

``commopt-bench`` with no arguments runs the main job, which shows what commopt is for: all-reduce
swept over message sizes for ``flat`` (gloo's ring over every rank), ``hierarchical`` and ``auto``,
printed nccl-tests style with the cost model's bound and the speed-up against flat. Where the
emulated cluster can run (root, iproute2, usable network namespaces: probed by building and tearing
down a one-node cluster, tens of milliseconds) it runs inside a 2x2 cluster whose nodes are joined by
200 Mbit/s links, the slow inter-node link the hierarchy is made for; elsewhere it runs 4 local ranks
on a logical 2x2 over loopback and says in one line why the hierarchy cannot win there and which
command shows it. ``commopt-bench SUBCOMMAND --help`` describes each subcommand.
"""

from __future__ import annotations

import importlib
import os
import shlex
import shutil
import sys

__all__ = ["main", "SUBCOMMANDS", "MAIN_JOB_SIZES", "cluster_unavailable", "main_job_argv"]

# subcommand -> (module under commopt.bench, one-line help). Each module has main(argv) -> int.
SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "collectives": ("collectives", "all-reduce / reduce-scatter / all-gather / all-to-all sweep"),
    "cluster": ("cluster", "emulated multi-node cluster (network namespaces + tc) around a command"),
    "moe": ("moe", "MoE layer forward+backward with and without all-to-all / expert overlap"),
    "kernels": ("kernels", "throughput of the packing kernels against a plain copy"),
    "ddp": ("ddp", "a small GPT trained with DDP under each comm hook: step time, bytes, loss"),
    "fsdp": ("fsdp", "the GPT sharded with FSDP2 / HSDP under each commopt comm: step time, link bytes, loss"),
    "diloco": ("diloco", "the GPT trained with DDP against DiLoCo (H 8/32, fp32/int8/int4, streaming): step, "
                         "bytes on the node link, exposed sync, training and held-out loss"),
    "pp": ("pp", "the GPT in pipeline stages across a slow link: torch's Schedule1F1B vs commopt's executor, fp32 / "
                 "int8 / AQ-SGD: step against the floor, bytes per boundary, held-out loss"),
    "tp": ("tp", "a transformer block under tensor + sequence parallelism: torch's plan vs commopt's styles, "
                 "ring / Ulysses attention"),
    "torchtitan": ("titan", "torchtitan's Trainer, TP 2 x FSDP2 2 on its debug Llama 3: torch's styles vs commopt's"),
    "elastic": ("elastic", "elastic DiLoCo in the emulated cluster: a node killed, stopped or cut off and restarted; "
                           "stall, rejoin, recovery bytes, steps lost, ETTR, held-out loss"),
    "coordinator": ("coordinator", "run the elastic membership coordinator (prints its address)"),
    "ina-switch": ("ina_switch", "run the simulated in-network aggregation switch"),
    "ina-overlap": ("ina_overlap", "DDP on the \"ina\" backend: is backward blocked by the switch?"),
    "overlap": ("overlap", "OverlapDataParallel vs DDP interleaved, with the simulator's prediction"),
    "simulate": ("simulate", "iteration simulator: step time and exposed communication per schedule"),
    "traffic": ("traffic", "traffic matrix (bytes between rank pairs) per algorithm, as heatmaps"),
    "plot": ("plot", "PNG of a collectives or ddp --json result (busbw against size, step time and loss)"),
}

#: The main job's sweep: about a minute inside the 2x2 cluster at 200 Mbit/s (16 MiB alone is a
#: second per flat all-reduce there), from where latency still dominates to where bandwidth does.
MAIN_JOB_SIZES = "64K,256K,1M,4M,16M"
_SWEEP = ["--op", "allreduce", "--algo", "flat,hierarchical,auto", "--sizes", MAIN_JOB_SIZES]
_CLUSTER = ["--nodes", "2", "--ranks-per-node", "2", "--link-rate", "200mbit"]
_LINK_RATE_BPS = 200_000_000
# Generous: a minute on a quiet 2-core machine; the bound only makes sure the main job never hangs.
_CLUSTER_TIMEOUT_S = 900
#: The command the main job runs inside the cluster, as a user would type it.
CLUSTER_COMMAND = shlex.join(["commopt-bench", "cluster", *_CLUSTER, "--", "commopt-bench", "collectives", *_SWEEP])


def main_job_argv(reason: str | None) -> tuple[str, list[str]]:
    """``(subcommand, argv)`` of the main job: the cluster when ``reason`` is None, else loopback.

    Inside the cluster the ranks run this interpreter's ``-m commopt.bench``, so the main job works
    where the ``commopt-bench`` script is not on the ``PATH`` that ``ip netns exec`` passes on.
    """
    if reason is None:
        return "cluster", [*_CLUSTER, "--timeout", str(_CLUSTER_TIMEOUT_S), "--",
                           sys.executable, "-m", "commopt.bench", "collectives", *_SWEEP]
    return "collectives", ["--spawn", "4", "--topology", "2x2", *_SWEEP]


def cluster_unavailable() -> str | None:
    """Why the emulated cluster cannot run here (a short phrase), or None when it can.

    Cheap and safe: the privileges and tools first (no process started), then a one-node cluster
    built and torn down (two namespaces, a bridge, a veth pair, a tbf qdisc), which is exactly what
    the run needs of the kernel; nothing outside those namespaces is touched, and they are removed
    whatever happens (``Cluster`` as a context manager).
    """
    from . import cluster as cl

    ip, tc = shutil.which("ip"), shutil.which("tc")
    try:
        with open("/proc/self/status", encoding="ascii") as f:
            cap_eff = cl.parse_cap_eff(f.read())
    except OSError:
        cap_eff = 0
    if not (cap_eff >> cl.CAP_NET_ADMIN & 1 and cap_eff >> cl.CAP_SYS_ADMIN & 1):
        return "it needs root for network namespaces: CAP_NET_ADMIN and CAP_SYS_ADMIN"
    if ip is None or tc is None:
        return "iproute2's `ip` and `tc` are not installed"
    try:
        with cl.Cluster(1, _LINK_RATE_BPS, ip=ip, tc=tc):
            pass
    except (cl.ClusterError, OSError) as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        return f"network namespaces are not usable here: {first}"
    return None


def _main_job() -> int:
    reason = cluster_unavailable()
    name, argv = main_job_argv(reason)
    if reason is None:
        print("# commopt-bench, the main job: all-reduce in an emulated 2x2 cluster, 2 nodes (network "
              "namespaces) of 2 ranks, each node's link shaped to 200 Mbit/s, loopback inside a node; flat "
              "(gloo's ring over all 4 ranks) against hierarchical and auto, measured interleaved. The same as:\n"
              f"#   {CLUSTER_COMMAND}", flush=True)
        # torch's c10d warns once per rank that the namespaces' addresses have no host name: noise here.
        os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")
    else:
        print(f"# commopt-bench, the main job, on loopback: the emulated cluster cannot run here ({reason}). "
              "4 local ranks form a logical 2x2 whose nodes share this machine's memory: there is no slower "
              "inter-node link for the hierarchy to spare, and its extra phases cost, so it cannot beat flat "
              f"here. To see it win on a 200 Mbit/s link, as root: {CLUSTER_COMMAND}", flush=True)
    module = importlib.import_module(f"commopt.bench.{SUBCOMMANDS[name][0]}")
    return int(module.main(argv) or 0)


def _usage() -> str:
    lines = ["usage: commopt-bench [SUBCOMMAND] [ARGS...]", "",
             "With no subcommand: the main job. Where the emulated cluster can run (root, iproute2):",
             f"  {CLUSTER_COMMAND}",
             "else, on loopback (where the hierarchy cannot win; it says why):",
             "  commopt-bench collectives " + shlex.join(main_job_argv("loopback")[1]), "", "subcommands:"]
    lines += [f"  {name:<14}{text}" for name, (_, text) in SUBCOMMANDS.items()]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv:
        return _main_job()
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
