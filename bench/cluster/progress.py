"""A rank's training step, reported to the emulated cluster's launcher (``--fault KIND:...:at=step=N``).

The training loop calls :func:`report_step` once per step. Outside the cluster, or in a run without
faults, ``COMMOPT_STEP_DIR`` is unset and the call costs one environment lookup. In a run with faults,
the launcher sets ``COMMOPT_STEP_DIR`` to a directory it removes at teardown, and the call writes the
step to ``<dir>/node<I>.rank<local>``, which the launcher polls to fire a step fault the moment any
rank of node I reaches its step (bench/cluster/faults.py). The file is written atomically (a
temporary file, then ``os.replace``), so the launcher never reads half a number.

Like the benchmark CLIs, this module reads the launcher's variables itself (docs/architecture.md
section 6.3): it is the launcher's counterpart inside the rank, and imports no torch.
"""

from __future__ import annotations

import os

__all__ = ["report_step", "step_file_name"]

ENV_STEP_DIR = "COMMOPT_STEP_DIR"


def step_file_name(node: int, local_rank: int) -> str:
    """The name of the file where local rank ``local_rank`` of node ``node`` reports its step."""
    return f"node{node}.rank{local_rank}"


def report_step(step: int) -> None:
    """Tell the emulated cluster's launcher that this rank has reached training step ``step``.

    A no-op unless ``COMMOPT_STEP_DIR`` is set. The node is ``COMMOPT_REPLICA_ID`` (``--elastic``:
    one world per node) or, without it, the node of ``RANK`` in ``COMMOPT_NODES`` (one world over
    every node); the local rank is ``LOCAL_RANK``. The launcher sets all of these.

    Args:
        step: the step just reached (an int >= 0; the launcher compares it with ``at=step=N``).

    Raises:
        ValueError: ``COMMOPT_STEP_DIR`` is set but the variables that place this rank are missing
            or malformed (the rank was not started by ``commopt-bench cluster``); unset it.
    """
    directory = os.environ.get(ENV_STEP_DIR)
    if not directory:
        return
    path = os.path.join(directory, step_file_name(*_placement()))
    tmp = path + ".tmp"  # one writer per path: the rank itself
    with open(tmp, "w", encoding="ascii") as f:
        f.write(str(int(step)))
    os.replace(tmp, path)


def _placement() -> tuple[int, int]:
    """(node, local rank) of this rank, from the launcher's variables."""
    env = os.environ
    try:
        local = int(env["LOCAL_RANK"])
        if env.get("COMMOPT_REPLICA_ID"):
            return int(env["COMMOPT_REPLICA_ID"]), local
        rank = int(env["RANK"])
        for node, ranks in enumerate(env["COMMOPT_NODES"].split(";")):
            if rank in (int(r) for r in ranks.split(",")):
                return node, local
    except (KeyError, ValueError) as e:
        raise ValueError(f"{ENV_STEP_DIR} is set, but this rank's placement cannot be read ({e!r}): it needs "
                         "LOCAL_RANK and COMMOPT_REPLICA_ID, or RANK and COMMOPT_NODES, as `commopt-bench "
                         f"cluster` sets them; unset {ENV_STEP_DIR} outside the emulated cluster") from None
    raise ValueError(f"{ENV_STEP_DIR} is set, but RANK={env['RANK']} is in no node of "
                     f"COMMOPT_NODES={env['COMMOPT_NODES']!r}; unset {ENV_STEP_DIR} outside the emulated cluster")
