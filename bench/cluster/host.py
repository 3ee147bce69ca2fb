"""What the emulated cluster needs of the host, and what dead runs left on it.

The requirements (capabilities, iproute2) are checked before anything is created, and each missing
one is named with how to get it. Every namespace of a run starts with the run's prefix
``co-<launcher pid>-<launcher start time>-<tag>``; a launcher killed by SIGKILL cannot tear down, so
:func:`cleanup_leftovers` (``--cleanup``) removes the namespaces whose launcher, pid *and* start
time, is gone. Nothing here reads environment variables (docs/architecture.md section 6.3).
"""

from __future__ import annotations

import glob
import os
import re
import signal
import subprocess
import time
from collections.abc import Callable, Iterable, Sequence

from ._proc import _CMD_TIMEOUT_S, ClusterError

__all__ = [
    "CAP_NET_ADMIN",
    "CAP_SYS_ADMIN",
    "check_requirements",
    "cleanup_leftovers",
    "leftover_prefixes",
    "wire_bytes",
    "list_namespaces",
    "missing_requirements",
    "parse_cap_eff",
]

CAP_NET_ADMIN = 12  # veth pairs, bridges, addresses, tc qdiscs
CAP_SYS_ADMIN = 21  # `ip netns add` bind-mounts the namespace under /run/netns

_NETNS_DIR = "/var/run/netns"  # where `ip netns add` mounts named namespaces (iproute2's NETNS_RUN_DIR)
_PREFIX_RE = re.compile(r"^(co-([0-9a-f]+)-([0-9a-f]+)-[0-9a-f]{4})-(fab|sw|co|n\d+)$")


# --------------------------------------------------------------------------------------------------
# Requirements


def parse_cap_eff(status_text: str) -> int:
    """The effective capability mask from the text of ``/proc/<pid>/status`` (0 when absent)."""
    for line in status_text.splitlines():
        if line.startswith("CapEff:"):
            return int(line.split(":", 1)[1].strip(), 16)
    return 0


def missing_requirements(cap_eff: int, ip_path: str | None, tc_path: str | None) -> list[str]:
    """What this process lacks to build the cluster, each item saying how to get it.

    Takes its inputs instead of reading them so that a test can feed a fake capability set.

    Args:
        cap_eff: the effective capability mask (``CapEff`` of ``/proc/self/status``).
        ip_path: path of iproute2's ``ip``, or None when not found.
        tc_path: path of iproute2's ``tc``, or None when not found.

    Returns:
        Human-readable lines; empty when everything is there.
    """
    missing = []
    how = ("run as root (sudo commopt-bench cluster ...) or in a container started with "
           "--cap-add NET_ADMIN --cap-add SYS_ADMIN (or --privileged)")
    if not cap_eff >> CAP_NET_ADMIN & 1:
        missing.append(f"capability CAP_NET_ADMIN (to create veth pairs, a bridge and tc qdiscs): {how}")
    if not cap_eff >> CAP_SYS_ADMIN & 1:
        missing.append(f"capability CAP_SYS_ADMIN (`ip netns add` mounts /run/netns): {how}")
    for tool, path in (("ip", ip_path), ("tc", tc_path)):
        if path is None:
            missing.append(f"the `{tool}` command of iproute2: install it (apt-get install iproute2, "
                           f"dnf install iproute, apk add iproute2)")
    return missing


def check_requirements(cap_eff: int, ip_path: str | None, tc_path: str | None) -> None:
    """Raise :class:`ClusterError` listing everything :func:`missing_requirements` finds."""
    missing = missing_requirements(cap_eff, ip_path, tc_path)
    if missing:
        raise ClusterError("commopt-bench cluster needs network namespaces and tc, but this process "
                           "lacks:\n  - " + "\n  - ".join(missing))


# --------------------------------------------------------------------------------------------------
# Namespaces: listing, removal, leftovers


def list_namespaces(ip: str = "ip") -> list[str]:
    """Names from ``ip netns list`` (each line is ``NAME`` or ``NAME (id: K)``)."""
    res = subprocess.run([ip, "netns", "list"], capture_output=True, text=True, timeout=_CMD_TIMEOUT_S)
    return [line.split()[0] for line in res.stdout.splitlines() if line.strip()]


def leftover_prefixes(names: Iterable[str], launcher_alive: Callable[[int, int], bool]) -> list[str]:
    """Run prefixes among namespace names whose launcher is gone.

    A prefix encodes the launcher's pid *and* its start time, so a recycled pid is recognised as a
    different process and its leftovers are still collected; namespaces of a live launcher (another
    run in progress) are never touched.

    Args:
        names: namespace names (``ip netns list``).
        launcher_alive: ``launcher_alive(pid, start_ticks)`` is True when that process still runs.

    Returns:
        Sorted prefixes to remove.
    """
    found = {}
    for name in names:
        match = _PREFIX_RE.match(name)
        if match:
            found[match.group(1)] = (int(match.group(2), 16), int(match.group(3), 16))
    return sorted(p for p, (pid, start) in found.items() if not launcher_alive(pid, start))


def cleanup_leftovers(ip: str = "ip") -> list[str]:
    """Remove the namespaces (and their processes) of clusters whose launcher is gone.

    This is what ``--cleanup`` does after a launcher was killed with SIGKILL, the one death that
    leaves no chance to tear down. Clusters of launchers still running are left alone.

    Returns:
        The namespaces removed.
    """
    names = list_namespaces(ip)
    removed = []
    errors = []
    for prefix in leftover_prefixes(names, _launcher_alive):
        mine = [n for n in names if n.startswith(prefix + "-")]
        # Nodes before the fabric, the reverse of creation order.
        mine.sort(key=lambda n: n.endswith("-fab"))
        errors += _remove_namespaces(ip, mine)
        removed += mine
    if errors:
        raise ClusterError("cleanup incomplete: " + "; ".join(errors))
    return removed


def _process_start_ticks(pid: int) -> int | None:
    """Start time of a process in clock ticks since boot (field 22 of /proc/pid/stat), or None."""
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii", errors="replace") as f:
            stat = f.read()
    except OSError:
        return None
    # The command name (field 2) may hold spaces and parentheses: split after the last ')'.
    return int(stat.rsplit(")", 1)[1].split()[19])


def _launcher_alive(pid: int, start_ticks: int) -> bool:
    return _process_start_ticks(pid) == start_ticks


def _ns_pids(namespaces: Iterable[str]) -> list[int]:
    """Pids of the processes inside any of the named namespaces.

    What ``ip netns pids`` does (compare the device and inode of ``/proc/<pid>/ns/net`` with
    the namespace's bind mount), for all namespaces in one pass instead of one ``ip`` per namespace.
    """
    wanted = set()
    for ns in namespaces:
        try:
            st = os.stat(os.path.join(_NETNS_DIR, ns))
        except OSError:
            continue
        wanted.add((st.st_dev, st.st_ino))
    pids = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                st = os.stat(f"/proc/{entry}/ns/net")
            except OSError:  # gone meanwhile, or a kernel thread
                continue
            if (st.st_dev, st.st_ino) in wanted:
                pids.append(int(entry))
    return pids


def _remove_namespaces(ip: str, namespaces: Sequence[str]) -> list[str]:
    """Kill whatever still runs in the namespaces, then delete them; returns the errors."""
    existing = set(list_namespaces(ip))
    targets = [ns for ns in namespaces if ns in existing]
    if not targets:
        return []
    for _ in range(100):  # a dying process can still be listed for a moment
        pids = _ns_pids(targets)
        if not pids:
            break
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        time.sleep(0.02)
    script = "".join(f"netns del {ns}\n" for ns in targets)
    try:
        # -force: go on past a failing line, so one stuck namespace does not keep the others.
        res = subprocess.run([ip, "-force", "-batch", "-"], input=script, capture_output=True,
                             text=True, timeout=_CMD_TIMEOUT_S)
    except (OSError, subprocess.SubprocessError) as e:
        return [f"ip netns del: {e}"]
    left = sorted(set(targets) & set(list_namespaces(ip)))
    return [f"ip netns del {ns}: {res.stderr.strip()}" for ns in left]


def wire_bytes() -> int:
    """Bytes this process's network namespace has sent on its interfaces other than loopback: inside
    the emulated cluster, what this node put on its node link (headers included), a measurement."""
    total = 0
    for path in glob.glob("/sys/class/net/*/statistics/tx_bytes"):
        if path.split("/")[-3] != "lo":
            with open(path, encoding="ascii") as f:
                total += int(f.read())
    return total
