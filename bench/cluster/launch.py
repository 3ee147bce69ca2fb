"""Running the ranks: one process per rank inside its node's namespace, its output prefixed.

Ranks are placed node by node (or interleaved, the pathological placement); each gets the
environment that ``Topology.from_env()`` and torch's ``env://`` rendezvous read; their output is
copied to the launcher's streams, each line prefixed ``[rank k]`` (a progress bar redrawn in place
on a terminal); the first failing rank's code ends the run and the other ranks are killed (except
with ``--elastic``, where ``faults.run_elastic`` runs them: each node is its own world, and a death is
what the survivors must outlive).
Nothing here reads environment variables (docs/architecture.md section 6.3): the CLI passes the base environment in.
"""

from __future__ import annotations

import json
import signal
import subprocess
import threading
import time
from collections.abc import Sequence
from typing import IO

from ._proc import _close_pipes, _terminate
from .netns import Cluster

__all__ = ["place_ranks", "rank_environments", "run_ranks"]

# Set by the launcher only in some runs: never inherited from an outer launcher.
_OPTIONAL_VARS = ("COMMOPT_LINK_MEASURED_BPS", "COMMOPT_LINK_MAP", "COMMOPT_INA_SWITCH", "COMMOPT_COORDINATOR",
                  "COMMOPT_STEP_DIR", "COMMOPT_REPLICA_ID", "COMMOPT_NUM_REPLICAS", "COMMOPT_RESTART", "GROUP_RANK",
                  "LOCAL_RANK", "LOCAL_WORLD_SIZE")


def place_ranks(nodes: int, ranks_per_node: int, placement: str = "contiguous") -> list[list[int]]:
    """The ranks of every node.

    ``contiguous`` puts ranks node by node (``0,1;2,3``), which is what topology-aware algorithms
    expect; ``interleaved`` puts rank r on node r % N (``0,2;1,3``), the pathology where every
    neighbour of a ring crosses the slow link.

    Args:
        nodes: number of nodes N.
        ranks_per_node: ranks per node L.
        placement: ``"contiguous"`` or ``"interleaved"``.

    Returns:
        ``layout[node]`` = the ranks of that node, ascending.
    """
    if nodes < 1 or ranks_per_node < 1:
        raise ValueError(f"need nodes >= 1 and ranks_per_node >= 1, got {nodes} and {ranks_per_node}")
    world = nodes * ranks_per_node
    if placement == "contiguous":
        return [list(range(n * ranks_per_node, (n + 1) * ranks_per_node)) for n in range(nodes)]
    if placement == "interleaved":
        return [[r for r in range(world) if r % nodes == n] for n in range(nodes)]
    raise ValueError(f"placement must be 'contiguous' or 'interleaved', got {placement!r}")


def rank_environments(layout: Sequence[Sequence[int]], base_env: dict[str, str], *,
                      master_addr: str, master_port: int, ifnames: Sequence[str],
                      link_rate_bps: int, measured_bps: int | None = None, link_map: dict | None = None,
                      ina_switch: str | None = None, coordinator: str | None = None,
                      elastic: bool = False, step_dir: str | None = None) -> list[dict[str, str]]:
    """The environment of every rank (index = the launcher's rank, the ``k`` of ``[rank k]``).

    Everything ``Topology.from_env()`` and torch's ``env://`` rendezvous need: ``RANK``,
    ``WORLD_SIZE``, ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``, ``MASTER_ADDR``/``MASTER_PORT`` (node 0),
    ``GLOO_SOCKET_IFNAME`` (the node's veth: gloo then binds the node address, so intra-node pairs
    go over local routing and inter-node pairs over the shaped link), ``COMMOPT_NODES`` (so
    interleaved placement is expressible), ``COMMOPT_LINK_RATE_BPS`` and, when probed,
    ``COMMOPT_LINK_MEASURED_BPS`` (the slowest link's rates where links differ);
    ``COMMOPT_LINK_MAP`` where the links are not all alike (``Topology.links``);
    ``COMMOPT_INA_SWITCH`` with a switch node;
    ``COMMOPT_COORDINATOR`` with a coordinator; ``COMMOPT_STEP_DIR`` where faults wait for a step
    (``progress.report_step`` writes there).

    With ``elastic``, each node is its own ``torch.distributed`` world, as with one torchrun per
    node: ``RANK`` = ``LOCAL_RANK``, ``WORLD_SIZE`` = ``LOCAL_WORLD_SIZE`` = the node's ranks,
    ``MASTER_ADDR`` = 127.0.0.1 (the node's own loopback; ``master_addr`` is not used),
    ``COMMOPT_NODES`` = one node (``"0,1"``), and ``COMMOPT_REPLICA_ID`` = the node's index,
    ``COMMOPT_NUM_REPLICAS`` = the number of nodes. Cross-node traffic then goes only through what
    the ranks build from the coordinator, over ``GLOO_SOCKET_IFNAME``: a world spanning nodes
    would die with any of them.

    Values inherited from ``base_env`` for these names (and ``COMMOPT_RESTART``, which only a
    restart sets) are replaced or removed, so an outer launcher cannot leak in.
    ``PYTHONUNBUFFERED=1`` is defaulted so prefixed output arrives line by line, not at exit.

    Args:
        layout: ``layout[node]`` = ranks of that node.
        base_env: the environment to start from (the CLI passes ``os.environ``).
        master_addr: node 0's address inside the fabric.
        master_port: the rendezvous port on node 0 (with ``elastic``: on every node's loopback).
        ifnames: the veth name of every node inside its namespace.
        link_rate_bps: the configured per-node link rate (the slowest link's, where they differ).
        measured_bps: the probed rate, or None when not probed.
        link_map: ``commopt.comm.links.LinkMap.to_dict()`` of the links (bytes/s), or None on a uniform
            cluster (whose environment then stays as it always was).
        ina_switch: ``"host:port"`` of the in-network aggregation switch, or None.
        coordinator: ``"host:port"`` of the membership coordinator, or None.
        elastic: one world per node (see above).
        step_dir: the directory where ranks report their step, or None.

    Returns:
        One environment per rank.
    """
    # Imported here: commopt.comm imports torch, which importing this package must not pay for.
    from commopt.comm.topology import format_nodes

    world = sum(len(node) for node in layout)
    ranks = sorted(r for node in layout for r in node)
    if ranks != list(range(world)):
        raise ValueError(f"layout {format_nodes(layout)!r} must hold every rank 0..{world - 1} once")
    nodes_text = format_nodes(layout)
    envs: list[dict[str, str]] = [{} for _ in range(world)]
    for node, node_ranks in enumerate(layout):
        for local, rank in enumerate(node_ranks):
            env = dict(base_env)
            for stale in _OPTIONAL_VARS:
                env.pop(stale, None)
            env.update({
                "RANK": str(local if elastic else rank),
                "WORLD_SIZE": str(len(node_ranks) if elastic else world),
                "LOCAL_RANK": str(local),
                "LOCAL_WORLD_SIZE": str(len(node_ranks)),
                "MASTER_ADDR": "127.0.0.1" if elastic else master_addr,
                "MASTER_PORT": str(master_port),
                "GLOO_SOCKET_IFNAME": ifnames[node],
                "COMMOPT_NODES": format_nodes([list(range(len(node_ranks)))]) if elastic else nodes_text,
                "COMMOPT_LINK_RATE_BPS": str(int(link_rate_bps)),
            })
            optional = {"COMMOPT_LINK_MEASURED_BPS": None if measured_bps is None else str(int(measured_bps)),
                        "COMMOPT_LINK_MAP": None if link_map is None else json.dumps(link_map),
                        "COMMOPT_INA_SWITCH": ina_switch, "COMMOPT_COORDINATOR": coordinator,
                        "COMMOPT_STEP_DIR": step_dir,
                        "COMMOPT_REPLICA_ID": str(node) if elastic else None,
                        "COMMOPT_NUM_REPLICAS": str(len(layout)) if elastic else None}
            env.update({k: v for k, v in optional.items() if v is not None})
            env.setdefault("PYTHONUNBUFFERED", "1")
            envs[rank] = env
    return envs


# --------------------------------------------------------------------------------------------------
# Output: prefixed, progress bars redrawn in place


class _Console:
    """The launcher's own streams, shared by the threads that copy the ranks' output to them.

    Where a stream is a terminal, the line a rank keeps redrawing with carriage returns (its progress
    bar: ``COMMOPT_PROGRESS=1``, see ``commopt.bench._progress``) is redrawn in place, prefixed, as
    each redraw arrives; a whole line from any rank clears it first and draws it again afterwards,
    so bars and lines never mix on one row. A stream whose reader went away (``| head``) is
    written no more; the ranks' pipes are still drained, so no rank stalls on a full pipe.
    """

    _CLEAR = b"\r\x1b[K"  # to the start of the row, erase it

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._bar: tuple[IO[bytes], bytes] | None = None  # (stream, row) redrawn in place now
        self.closed: set[int] = set()  # id() of the streams that failed

    def line(self, out: IO[bytes], data: bytes) -> None:
        """Write one whole line (``data`` ends with a newline) to ``out``."""
        with self._lock:
            bar = self._bar
            if bar is not None:
                self._write(bar[0], self._CLEAR)
            self._write(out, data)
            if bar is not None:
                self._write(bar[0], self._CLEAR + bar[1])

    def redraw(self, out: IO[bytes], row: bytes | None) -> None:
        """Draw ``row`` in place of the bar on ``out``; None erases the bar."""
        with self._lock:
            self._write(out, self._CLEAR + (row or b""))
            self._bar = (out, row) if row else None

    def _write(self, out: IO[bytes], data: bytes) -> None:
        if id(out) in self.closed:
            return
        try:
            out.write(data)
            out.flush()
        except (BrokenPipeError, ValueError):
            self.closed.add(id(out))  # the launcher's reader went away; the rank must not stall


def _is_terminal(stream: IO[bytes] | None) -> bool:
    try:
        return stream is not None and stream.isatty()
    except (AttributeError, ValueError, OSError):
        return False


def _last_row(text: bytes) -> bytes:
    """What a terminal shows of ``text`` redrawn with carriage returns: its last non-blank part."""
    parts = [p for p in text.split(b"\r") if p.strip()]
    return parts[-1] if parts else b""


def _pump(stream: IO[bytes], out: IO[bytes] | None, prefix: bytes, console: _Console) -> None:
    """Copy ``stream`` to ``out`` line by line, each line prefixed (a rank's stdout or stderr).

    Where ``out`` is a terminal, a row the rank redraws with carriage returns is shown as it is
    redrawn (see :class:`_Console`); elsewhere lines are copied as they are, carriage returns and all.
    """
    live = _is_terminal(out)
    read = getattr(stream, "read1", None) or stream.read  # whatever the pipe holds, up to 64 KiB
    pending = b""
    drawn = False  # this stream's bar is on the terminal
    with stream:
        while True:
            data = read(65536)
            if not data:
                break
            if out is None or id(out) in console.closed:
                continue  # keep draining: a full pipe would block the rank
            pending += data
            *lines, pending = pending.split(b"\n")
            for line in lines:
                if drawn:
                    console.redraw(out, None)
                    drawn = False
                console.line(out, prefix + (_last_row(line) if live and b"\r" in line else line) + b"\n")
            if live and b"\r" in pending:
                # Keep only the row being drawn: a bar that never ends a line must not pile up here.
                pending = pending[pending.rindex(b"\r"):]
                row = _last_row(pending)
                console.redraw(out, prefix + row if row else None)
                drawn = bool(row)
        if out is not None:
            if drawn:
                console.redraw(out, None)
            if live and b"\r" in pending:
                pending = _last_row(pending)
            if pending:
                console.line(out, prefix + pending + b"\n")


# --------------------------------------------------------------------------------------------------
# The run


def run_ranks(cluster: Cluster, layout: Sequence[Sequence[int]], command: Sequence[str],
              envs: Sequence[dict[str, str]], *, timeout: float | None = None,
              stdout: IO[bytes] | None = None, stderr: IO[bytes] | None = None,
              extra_streams: Sequence[tuple[IO[bytes], IO[bytes] | None, bytes]] = (),
              poll_interval: float = 0.05) -> int:
    """Run ``command`` once per rank in its node's namespace and wait for all of them.

    Output lines are prefixed ``[rank k]`` (stdout to ``stdout``, stderr to ``stderr``; on a
    terminal, a rank's progress bar is redrawn in place, see :class:`_Console`). When a
    rank fails, the others are killed (a collective would otherwise wait forever for it) and the
    first failure's code is returned; a rank killed by signal S counts as 128 + S. An exception
    raised into this function (KeyboardInterrupt from a signal handler) kills all ranks first.

    Args:
        cluster: a cluster that is up.
        layout: ``layout[node]`` = ranks of that node.
        command: the argv every rank runs.
        envs: ``envs[rank]`` (see :func:`rank_environments`).
        timeout: seconds after which all ranks are killed and 124 is returned (None: no limit).
        stdout: the launcher's binary stdout.
        stderr: the launcher's binary stderr.
        extra_streams: more ``(stream, out, prefix)`` to copy while the ranks run, e.g. the
            switch's output (started here, after the ranks are spawned; see Cluster.spawn).
        poll_interval: seconds between checks of the ranks.

    Returns:
        0 when every rank succeeded, else the first failing rank's code (124 on timeout).
    """
    node_of = {rank: node for node, ranks in enumerate(layout) for rank in ranks}
    procs: list[subprocess.Popen] = []
    threads: list[threading.Thread] = []
    console = _Console()
    try:
        # Spawn all before any output thread exists (see Cluster.spawn).
        for rank in range(len(envs)):
            procs.append(cluster.spawn(node_of[rank], command, envs[rank]))
        pumps = [(stream, out, f"[rank {rank}] ".encode()) for rank, proc in enumerate(procs)
                 for stream, out in ((proc.stdout, stdout), (proc.stderr, stderr))]
        for stream, out, prefix in pumps + list(extra_streams):
            thread = threading.Thread(target=_pump, args=(stream, out, prefix, console), daemon=True)
            thread.start()
            threads.append(thread)
        deadline = None if timeout is None else time.monotonic() + timeout
        result = 0
        while True:
            codes = [p.poll() for p in procs]
            failed = [(r, c) for r, c in enumerate(codes) if c not in (None, 0)]
            if failed:
                rank, code = failed[0]
                result = code if code > 0 else 128 - code
                how = f"code {code}" if code > 0 else f"{signal.Signals(-code).name} (code {result})"
                _note(stderr, f"rank {rank} exited with {how}; killing the other ranks")
                break
            if all(c == 0 for c in codes):
                break
            if deadline is not None and time.monotonic() > deadline:
                _note(stderr, f"timeout after {timeout} s; killing all ranks")
                result = 124
                break
            time.sleep(poll_interval)
        return result
    finally:
        _terminate(procs)
        for thread in threads[: 2 * len(procs)]:  # extra streams end only when their process does
            thread.join(timeout=2.0)
        for proc in procs:
            _close_pipes(proc)
            cluster._procs.remove(proc)


def _note(stream: IO[bytes] | None, text: str) -> None:
    if stream is not None:
        stream.write(f"[cluster] {text}\n".encode())
        stream.flush()
