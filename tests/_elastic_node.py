"""What the elastic tests' worker scripts and their launchers share: a node of L ranks, its own
torch.distributed world (``--ranks L --local R --port P``), started as one process group so that a fault
can SIGKILL the whole node (tests/_elastic_worker.py, tests/_elastic_dp_worker.py). The processes are forked
from the rank pool's forkserver (tests/_forked.py), which has imported torch already."""

from __future__ import annotations

import argparse
import datetime
from collections.abc import Callable

import torch.distributed as dist
from _forked import ForkedScript, start_script
from _ports import free_ports

__all__ = ["add_node_args", "init_node_world", "start_node"]


def add_node_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--ranks", type=int, default=1)
    p.add_argument("--local", type=int, default=0)
    p.add_argument("--port", type=int, default=0)


def init_node_world(a: argparse.Namespace) -> None:
    """This rank's node world: a world of one (no rendezvous) or L ranks over 127.0.0.1:``a.port``."""
    if a.ranks == 1:
        store = dist.HashStore()
    else:
        store = dist.TCPStore("127.0.0.1", a.port, a.ranks, is_master=a.local == 0,
                              timeout=datetime.timedelta(seconds=60))
    dist.init_process_group("gloo", store=store, rank=a.local, world_size=a.ranks)


def start_node(argv: Callable[[int], list[str]], ranks: int) -> list[ForkedScript]:
    """The node's ``ranks`` processes, ``argv(local)`` each (plus the node options), in one new process group."""
    port = free_ports(1)[0]
    procs: list[ForkedScript] = []
    for r in range(ranks):
        procs.append(start_script([*argv(r), "--ranks", str(ranks), "--local", str(r), "--port", str(port)],
                                  process_group=procs[0].pid if procs else 0))
    return procs
