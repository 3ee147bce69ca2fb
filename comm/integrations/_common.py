"""What the framework adapters share: the topology argument and registration on a wrapped model.

Each adapter finds the ``DistributedDataParallel`` model its framework built and hands it to
:func:`register_on`, at a moment when the process group exists: only then can a topology be built
(``Topology.from_spec`` needs the group's size; ``Topology.detect`` exchanges host names over it).
"""

from __future__ import annotations

from typing import Union

import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from ..hooks import AllReduceState, allreduce_hook, register
from ..topology import Topology

__all__ = ["TopologyArg", "check_arguments", "register_on"]

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
