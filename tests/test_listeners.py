"""docs/faults.md row 29: where commopt launches ranks itself, every listening socket is on loopback.

``commopt-bench collectives --spawn N`` rendezvous through a FileStore and binds gloo to ``lo``; this
test watches the listening TCP sockets of the benchmark's processes while it runs. (The switch's and
the emulated cluster's sockets are checked in test_ina*.py and test_cluster.py.)
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time


def _listening_inodes() -> dict[int, str]:
    """inode -> local address of every TCP socket in LISTEN state (IPv4 and IPv6)."""
    out = {}
    for path, family in (("/proc/net/tcp", socket.AF_INET), ("/proc/net/tcp6", socket.AF_INET6)):
        try:
            lines = open(path).read().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            parts = line.split()
            if parts[3] != "0A":  # LISTEN
                continue
            hex_addr = parts[1].split(":")[0]
            raw = bytes.fromhex(hex_addr)
            if family == socket.AF_INET:
                addr = socket.inet_ntop(family, raw[::-1])
            else:
                addr = socket.inet_ntop(family, b"".join(raw[i:i + 4][::-1] for i in range(0, 16, 4)))
            out[int(parts[9])] = addr
    return out


def _tree(pid: int) -> set[int]:
    pids = {pid}
    changed = True
    while changed:
        changed = False
        for entry in os.listdir("/proc"):
            if not entry.isdigit():
                continue
            try:
                with open(f"/proc/{entry}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            if ppid in pids and int(entry) not in pids:
                pids.add(int(entry))
                changed = True
    return pids


def _socket_inodes(pid: int) -> set[int]:
    inodes = set()
    try:
        for fd in os.listdir(f"/proc/{pid}/fd"):
            try:
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
            except OSError:
                continue
            if target.startswith("socket:["):
                inodes.add(int(target[8:-1]))
    except OSError:
        pass
    return inodes


def test_spawned_benchmark_listens_on_loopback_only():
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    env.pop("GLOO_SOCKET_IFNAME", None)
    proc = subprocess.Popen([sys.executable, "-m", "commopt.bench", "collectives", "--spawn", "2", "--sizes",
                             "1K:4M", "--iters", "5", "--no-calibrate"], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, env=env, text=True)
    seen: dict[int, str] = {}
    try:
        deadline = time.monotonic() + 180
        while proc.poll() is None and time.monotonic() < deadline:
            listening = _listening_inodes()
            for pid in _tree(proc.pid):
                for inode in _socket_inodes(pid):
                    if inode in listening:
                        seen[inode] = listening[inode]
            time.sleep(0.1)
        out = proc.communicate(timeout=60)[0]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, out
    assert seen, "no listening socket was observed: the check would be vacuous"
    assert all(addr in ("127.0.0.1", "::1") for addr in seen.values()), seen
