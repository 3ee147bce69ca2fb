"""Ports for the rendezvous of the tests' own spawned worlds (``MASTER_PORT``).

A port picked by binding 0 and released is in the kernel's ephemeral range, where any later bind(0) in the
machine can take it before the spawned ranks, which import torch for seconds first, bind it: the suite's
other worker (gloo's pairs, the elastic tests' coordinators and stores) did, and a rank then waited 30
minutes on a socket that was not its rendezvous. Below the ephemeral range (Linux: 32768 and up) no
bind(0) lands, so a port found free there stays free unless something names it.
"""

from __future__ import annotations

import random
import socket

__all__ = ["free_ports"]

_LOW, _HIGH = 20000, 32000  # below net.ipv4.ip_local_port_range's default start (32768)


def free_ports(n: int) -> list[int]:
    """``n`` distinct ports below the ephemeral range that are free now (TCP on 127.0.0.1)."""
    found: list[int] = []
    rng = random.Random()
    while len(found) < n:
        port = rng.randrange(_LOW, _HIGH)
        if port in found:
            continue
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        found.append(port)
    return found
