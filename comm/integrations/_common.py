"""What the framework adapters share: the topology argument, registration on a wrapped model, and
every rank's hook state in the framework's checkpoints.

Each adapter finds the ``DistributedDataParallel`` model its framework built and hands it to
:func:`register_on`, at a moment when the process group exists: only then can a topology be built
(``Topology.from_spec`` needs the group's size; ``Topology.detect`` exchanges host names over it).

Error-feedback residuals and PowerSGD's warm starts differ from rank to rank, while the frameworks
write one rank's view of a checkpoint. Two routes, one per framework's habit, both holding only what
``torch.load(weights_only=True)`` accepts (tensors on the CPU, numbers, strings):

- inside the checkpoint (Lightning): :func:`gather_states` collects every rank's
  ``AllReduceState.state_dict()`` on rank 0, which writes the checkpoint; on resume every rank reads
  that checkpoint and :func:`restore_from_gathered` takes its own entry;
- one file per rank beside it (Hugging Face, as its ``rng_state_<rank>.pth``): :func:`save_rank_file`
  and :func:`restore_from_folder`.

A checkpoint written by a world of another size is a ``ValueError`` on every rank (residuals belong
to ranks; there is no meaningful way to spread them over more or fewer); a checkpoint without commopt
state (written before the callback was added) is a documented reset: the state starts fresh, with a
warning.
"""

from __future__ import annotations

import glob
import io
import os
import warnings
from typing import Union

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from ..hooks import AllReduceState, allreduce_hook, register
from ..topology import Topology

__all__ = ["TopologyArg", "check_arguments", "register_on", "FORMAT", "gather_states", "restore_from_gathered",
           "rank_file", "save_rank_file", "restore_from_folder"]

# A spec ("2x4", "2+1"), explicit nodes ([[0, 2], [1, 3]]), a built Topology, or None (detected).
TopologyArg = Union[str, list, tuple, Topology, None]


def check_arguments(where: str, state, topology: TopologyArg) -> None:
    """The callback's arguments, checked when it is built (before the framework starts any process)."""
    if not isinstance(state, AllReduceState):
        raise TypeError(f"{where} expects a commopt.comm.hooks.AllReduceState, got {type(state).__name__} "
                        f"{state!r}; e.g. {where}(hooks.AllReduceState(algorithm='hierarchical'))")
    if topology is not None and not isinstance(topology, (str, list, tuple, Topology)):
        raise TypeError(f"{where}: topology must be a spec such as '2x4', a list of nodes such as "
                        f"[[0, 2], [1, 3]], a Topology or None (detected once the process group exists), got "
                        f"{type(topology).__name__} {topology!r}")
    if topology is not None and state.topology is not None:
        raise ValueError(f"{where}: the state already has a topology ({state.topology!r}) and topology="
                         f"{topology!r} was given too; pass one of them")


def _resolve(topology: TopologyArg, group) -> Topology:
    """The topology over ``group`` (None: WORLD); needs the process group, so call it after init."""
    if isinstance(topology, Topology):
        return topology
    if isinstance(topology, str):
        return Topology.from_spec(topology, group)
    if topology is not None:
        return Topology.from_nodes([list(node) for node in topology], group)
    # COMMOPT_NODES, then torchrun's or MPI's placement, else host names exchanged over the group.
    return Topology.detect(group)


def register_on(where: str, model, state: AllReduceState, topology: TopologyArg, what_to_do: str) -> None:
    """Build ``state.topology`` (unless it has one) and register ``allreduce_hook`` on ``model``.

    Args:
        where: the adapter's name, for messages.
        model: the model the framework trains; it must be a ``DistributedDataParallel`` model.
        state: the hook's state; its ``topology`` is set here when it was None.
        topology: the adapter's ``topology`` argument (see :data:`TopologyArg`).
        what_to_do: how to get a DDP model in this framework, appended to the error.

    Raises:
        TypeError: ``model`` is not a ``DistributedDataParallel`` model.
        RuntimeError: ``model`` already has another comm hook (DDP takes only one); with this state's
            ``allreduce_hook`` already registered it returns without doing anything.
        TopologyError: the topology does not fit the process group.
    """
    if not isinstance(model, DistributedDataParallel):
        raise TypeError(f"{where} registers a DDP comm hook, but the model being trained is "
                        f"{type(model).__name__}, not DistributedDataParallel; {what_to_do}")
    # DDP keeps the registered (hook, state) pairs; registering twice would fail inside the reducer.
    present = list(getattr(model, "_comm_hooks", None) or [])
    if any(hook is allreduce_hook and hook_state is state for hook, hook_state in present):
        return  # already registered on this very DDP module (the framework called us twice)
    if present:
        hook = present[0][0]
        raise RuntimeError(f"{where}: this DDP model already has the comm hook "
                           f"{getattr(hook, '__qualname__', hook)!r} and DDP accepts only one; give the state to "
                           f"{where} alone (not also ddp_comm_hook=/ddp_comm_state= or register_comm_hook)")
    group = state.process_group if state.process_group is not None else model.process_group
    if group is dist.GroupMember.WORLD:
        group = None  # as hooks.register stores it: the topology must be of the group the hook reduces over
    if state.topology is None:
        state.topology = _resolve(topology, group)
    register(model, state)


# ------------------------------------------------------------------------------------ checkpoints
FORMAT = 1  # the layout of what the adapters save; bump it when it changes
_RANK_FILE = "commopt-rank{rank}.pt"


def _world() -> tuple[int, int]:
    """(rank, world size) of WORLD: checkpoints are written and read by every rank of the job."""
    if not dist.is_initialized():
        return 0, 1
    return dist.get_rank(), dist.get_world_size()


def _to(obj, device: torch.device | str):
    """``obj`` (nested dicts, lists, tuples) with every tensor moved to ``device``."""
    if isinstance(obj, torch.Tensor):
        return obj.to(device)
    if isinstance(obj, dict):
        return {k: _to(v, device) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_to(v, device) for v in obj)
    return obj


def _bytes_device() -> torch.device:
    """Where WORLD's backend moves bytes: the CPU under gloo (also ``cpu:gloo,cuda:nccl``), else the
    current accelerator (NCCL reduces CUDA tensors only)."""
    backend = str(dist.get_backend())
    if "gloo" in backend or not torch.accelerator.is_available():
        return torch.device("cpu")
    return torch.accelerator.current_accelerator()


def gather_states(state: AllReduceState) -> dict | None:
    """Every rank's ``state.state_dict()`` (tensors on the CPU), on rank 0; collective over WORLD.

    Serialised with ``torch.save`` and moved as bytes (no pickle), one gather to rank 0 (not an
    all-gather: the residuals of every rank then sit on rank 0 only, and only while it saves).

    Returns:
        On rank 0 ``{"format", "world_size", "ranks": [state dict of rank 0, 1, ...]}``; None elsewhere.
    """
    rank, world = _world()
    mine = _to(state.state_dict(), "cpu")
    if world == 1:
        return {"format": FORMAT, "world_size": 1, "ranks": [mine]}
    buf = io.BytesIO()
    torch.save(mine, buf)
    device = _bytes_device()
    payload = torch.frombuffer(bytearray(buf.getvalue()), dtype=torch.uint8).to(device)
    sizes = [torch.zeros(1, dtype=torch.int64, device=device) for _ in range(world)]
    dist.all_gather(sizes, torch.tensor([payload.numel()], dtype=torch.int64, device=device))
    longest = max(int(n) for n in sizes)
    padded = torch.zeros(longest, dtype=torch.uint8, device=device)  # gather needs equal sizes
    padded[:payload.numel()] = payload
    gathered = [torch.empty(longest, dtype=torch.uint8, device=device) for _ in range(world)] if rank == 0 else None
    dist.gather(padded, gathered, dst=0)
    if rank != 0:
        return None
    ranks = [torch.load(io.BytesIO(b[:int(n)].cpu().numpy().tobytes()), weights_only=True)
             for b, n in zip(gathered, sizes)]
    return {"format": FORMAT, "world_size": world, "ranks": ranks}


def _check_saved(where: str, saved: dict, what: str) -> None:
    if not isinstance(saved, dict) or saved.get("format") != FORMAT:
        got = saved.get("format") if isinstance(saved, dict) else type(saved).__name__
        raise ValueError(f"{where}: {what} holds commopt state of format {got!r}, this commopt reads format "
                         f"{FORMAT}; resume with the commopt version that wrote it")
    rank, world = _world()
    if saved.get("world_size") != world:
        raise ValueError(f"{where}: {what} was written by a world of {saved.get('world_size')} ranks, this job "
                         f"has {world}: error-feedback residuals and warm starts belong to ranks and do not "
                         f"transfer; resume on {saved.get('world_size')} ranks, or start from the model weights "
                         f"alone with a fresh AllReduceState")


def restore_from_gathered(where: str, state: AllReduceState, saved: dict | None, device, what: str) -> bool:
    """Load this rank's entry of a :func:`gather_states` dict into ``state``, tensors onto ``device``.

    Returns:
        True when restored; False when ``saved`` is None (a checkpoint without commopt state: ``state``
        is left fresh, with a warning).

    Raises:
        ValueError: another format, or a world of another size (:meth:`AllReduceState.load_state_dict`
            adds its own checks: the same algorithm, a compressor where one was saved).
    """
    if saved is None:
        _warn_reset(where, what)
        return False
    _check_saved(where, saved, what)
    rank, _ = _world()
    state.load_state_dict(_to(saved["ranks"][rank], device))
    return True


def rank_file(folder: str, rank: int) -> str:
    """The file that holds rank ``rank``'s hook state in a checkpoint folder."""
    return os.path.join(folder, _RANK_FILE.format(rank=rank))


def save_rank_file(folder: str, state: AllReduceState) -> str:
    """Write this rank's ``state.state_dict()`` (tensors on the CPU) to :func:`rank_file` in ``folder``.

    Written to a temporary name and renamed, so a crash mid-write never leaves a truncated file that
    a resume would read. Returns the path.
    """
    rank, world = _world()
    os.makedirs(folder, exist_ok=True)
    path = rank_file(folder, rank)
    tmp = f"{path}.tmp"
    torch.save({"format": FORMAT, "world_size": world, "rank": rank, "state": _to(state.state_dict(), "cpu")}, tmp)
    os.replace(tmp, path)
    return path


def restore_from_folder(where: str, state: AllReduceState, folder: str, device) -> bool:
    """Load this rank's :func:`save_rank_file` from ``folder`` into ``state``, tensors onto ``device``.

    The decision is the same on every rank, from the files alone: no commopt file at all is a
    checkpoint written without commopt (a reset, with a warning, returning False); files of a world
    of another size, or this rank's file missing beside others, raise.

    Raises:
        FileNotFoundError: ``folder`` does not exist.
        ValueError: another format or world size, or this rank's file is missing while others exist.
    """
    if not os.path.isdir(folder):
        raise FileNotFoundError(f"{where}: the checkpoint folder {folder} does not exist")
    rank, world = _world()
    path = rank_file(folder, rank)
    if not os.path.exists(path):
        others = sorted(glob.glob(os.path.join(glob.escape(folder), _RANK_FILE.format(rank="*"))))
        if not others:
            _warn_reset(where, folder)
            return False
        saved = torch.load(others[0], weights_only=True)
        _check_saved(where, saved, folder)  # a smaller world wrote it: that is the message to give
        raise ValueError(f"{where}: {folder} holds commopt state of ranks {[os.path.basename(p) for p in others]} "
                         f"but not of rank {rank} ({os.path.basename(path)}); the checkpoint is incomplete")
    saved = torch.load(path, weights_only=True)
    _check_saved(where, saved, path)
    if saved.get("rank") != rank:
        raise ValueError(f"{where}: {path} holds the state of rank {saved.get('rank')}, not of rank {rank}")
    state.load_state_dict(_to(saved["state"], device))
    return True


def _warn_reset(where: str, what: str) -> None:
    warnings.warn(f"{where}: {what} holds no commopt hook state (written without the callback?): the hook "
                  f"starts afresh (no error-feedback residuals, no warm start, step 0), so this run will not "
                  f"continue bit-identically", stacklevel=3)
