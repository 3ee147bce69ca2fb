"""How every multi-rank benchmark starts its ranks: one launcher for all of ``commopt-bench``.

- ``--spawn N``: N local rank processes (spawned, never forked: numba's OpenMP layer is not
  fork-safe), rendezvous through a ``FileStore`` in a temporary directory, gloo bound to loopback
  (docs/architecture.md section 10), one thread each;
- under ``mpirun``: rank and size from the MPI environment, a ``FileStore`` whose path rank 0
  broadcasts with mpi4py, and any failure aborts the whole job (docs/faults.md row 31);
- under ``torchrun`` or ``commopt-bench cluster``: ``env://`` from ``RANK``/``WORLD_SIZE``/``MASTER_*``;
- otherwise a single process (world size 1).

``body(args) -> int`` runs on every rank with the default process group initialised; commopt's
state and the group are torn down afterwards. The exit code is the worst rank's.
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
import time
import traceback
from datetime import timedelta
from typing import Any, Callable

import torch
import torch.distributed as dist

__all__ = ["launch", "topology_of"]

Body = Callable[[Any], int]

# How long a failing rank lets mpirun forward its traceback before MPI_Abort ends the job.
_ABORT_GRACE_S = 1.0


def topology_of(args) -> Any:
    """The benchmarks' topology: ``--topology`` (a spec such as ``2x2``; inside the emulated cluster
    it keeps the cluster's link rate, link map and switch address from ``COMMOPT_NODES``' environment), else
    detected once per group (``COMMOPT_NODES``, the launcher's placement, else host names)."""
    from commopt.comm import Topology, context

    if args.topology:
        extra = {}
        env = Topology.from_env() if os.environ.get("COMMOPT_NODES") else None
        if env is not None:
            extra = {"link_rate_bps": env.link_rate_bps, "ina_switch": env.ina_switch, "links": env.links}
        return Topology.from_spec(args.topology, **extra)
    return context().topology(None, None)


def launch(body: Body, args: Any, *, spawn: int = 0, timeout: float = 120.0, single: bool = True,
           threads: int = 1) -> int:
    """Run ``body(args)`` on every rank of the world this process belongs to (see module doc).

    Args:
        body: a module-level function (spawned ranks import it by reference).
        args: its argument (an ``argparse.Namespace``; must pickle for ``spawn``).
        spawn: start this many local ranks instead of joining an existing world.
        timeout: the process group's timeout in seconds.
        single: allow a world of one process when no launcher is detected (else exit code 2).
        threads: torch's intra-op threads per rank (1: ranks do not oversubscribe the cores).
    """
    torch.set_num_threads(threads)
    if spawn:
        return _spawn(body, args, spawn, timeout, threads)
    mpi = _mpi_world()
    if mpi is not None:
        return _run_mpi(body, args, *mpi, timeout)
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        dist.init_process_group("gloo", timeout=timedelta(seconds=timeout))
        try:
            return body(args)
        finally:
            _shutdown()
    if not single:
        print("commopt-bench: this benchmark needs several ranks: pass --spawn N, or run it under mpirun, "
              "torchrun or commopt-bench cluster", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory(prefix="commopt-bench-") as d:
        dist.init_process_group("gloo", store=dist.FileStore(os.path.join(d, "store"), 1), rank=0, world_size=1)
        try:
            return body(args)
        finally:
            _shutdown()


def _shutdown() -> None:
    from commopt.comm import destroy

    destroy()
    if dist.is_initialized():
        dist.destroy_process_group()


def _mpi_world() -> tuple[int, int] | None:
    for rank_var, size_var in (("PMI_RANK", "PMI_SIZE"), ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE"),
                               ("PMIX_RANK", "PMIX_SIZE")):
        if rank_var in os.environ and size_var in os.environ:
            return int(os.environ[rank_var]), int(os.environ[size_var])
    return None


def _run_mpi(body: Body, args: Any, rank: int, size: int, timeout: float) -> int:
    try:
        from mpi4py import MPI
    except ImportError:
        print("commopt-bench: running under mpirun needs mpi4py: pip install 'commopt[mpi]'", file=sys.stderr)
        return 2
    comm = MPI.COMM_WORLD
    path = tempfile.mkdtemp(prefix="commopt-mpi-") if rank == 0 else None
    path = comm.bcast(path, root=0)
    code = 1
    try:
        store = dist.FileStore(os.path.join(path, "store"), size)
        dist.init_process_group("gloo", store=store, rank=rank, world_size=size, timeout=timedelta(seconds=timeout))
        # The group keeps the store alive; without this reference the store is released with the
        # group, before rank 0 removes its directory below (a FileStore outliving its file can hang).
        del store
        code = body(args)
        _shutdown()
    except BaseException:  # noqa: BLE001 - any failure must end the whole job (docs/faults.md row 31)
        # One write, then a moment for mpirun's proxy to forward it: MPI_Abort kills the job at
        # once, and output still in flight between the proxy and mpirun is dropped (seen in CI:
        # only the traceback's first line arrived).
        sys.stderr.flush()
        os.write(2, traceback.format_exc().encode())
        time.sleep(_ABORT_GRACE_S)
        comm.Abort(1)
    codes = comm.allgather(code)
    if rank == 0:
        shutil.rmtree(path, ignore_errors=True)
    return max(codes)


def _spawn_main(body: Body, args: Any, rank: int, world: int, store_path: str, timeout: float,
                threads: int) -> None:
    # commopt's own ranks stay on loopback (docs/architecture.md section 10)
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    torch.set_num_threads(threads)
    dist.init_process_group("gloo", store=dist.FileStore(store_path, world), rank=rank, world_size=world,
                            timeout=timedelta(seconds=timeout))
    try:
        code = body(args)
    finally:
        _shutdown()
    sys.exit(code)


def _spawn(body: Body, args: Any, world: int, timeout: float, threads: int) -> int:
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    with tempfile.TemporaryDirectory(prefix="commopt-bench-") as d:
        store = os.path.join(d, "store")
        procs = [ctx.Process(target=_spawn_main, args=(body, args, r, world, store, timeout, threads),
                             name=f"rank{r}")
                 for r in range(world)]
        for p in procs:
            p.start()
        code = 0
        try:
            while any(p.is_alive() for p in procs):
                for p in procs:
                    p.join(0.2)
                    if p.exitcode not in (None, 0):
                        code = code or p.exitcode
                if code:
                    break  # one rank failed: the others would wait for it until their timeout
        except KeyboardInterrupt:
            code = 130
        finally:
            for p in procs:
                if p.is_alive():
                    p.terminate()
                p.join(5)
                if p.is_alive():
                    p.kill()
        return code or max(p.exitcode or 0 for p in procs)
