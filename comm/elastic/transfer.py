"""State to a joiner over a process group, as tensors: never pickle.

A restarted replica pulls the job's state (global weights, outer optimizer state, shared compressor
state, counters) from a peer. The state is a tree of dicts, lists, tuples, numbers, strings, None and
tensors; :func:`broadcast_state` sends (1) its skeleton as JSON (the tensors replaced by their index,
dtype and shape; dict keys typed, so an optimizer's integer parameter ids stay ints), (2) every tensor's
bytes in one flat uint8 buffer, from the group's rank ``src`` to the ranks ``dsts`` only, point to point
(a broadcast would send it over the source's link to every member, most of which hold it already). A
receiver parses only JSON and raw bytes: nothing it receives can run code, unlike a pickled
``state_dict``.
"""

from __future__ import annotations

import json
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from ..engine import wait_work

__all__ = ["broadcast_state", "local", "local_tree", "optimizer_state_like"]

_DTYPES = {str(d): d for d in (torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.int64, torch.int32,
                                torch.int16, torch.int8, torch.uint8, torch.bool, torch.complex64, torch.complex128)}


def _encode(obj: Any, tensors: list[torch.Tensor]) -> Any:
    if isinstance(obj, torch.Tensor):
        if str(obj.dtype) not in _DTYPES:
            raise TypeError(f"broadcast_state: a tensor of dtype {obj.dtype} cannot be sent")
        tensors.append(obj.detach().cpu().contiguous())
        return {"t": len(tensors) - 1, "dtype": str(obj.dtype), "shape": list(obj.shape)}
    if isinstance(obj, dict):
        return {"d": [[_key(k), _encode(v, tensors)] for k, v in obj.items()]}
    if isinstance(obj, (list, tuple)):
        return {"l" if isinstance(obj, list) else "u": [_encode(v, tensors) for v in obj]}
    if obj is None or isinstance(obj, (bool, int, float, str)):
        return {"v": obj}
    raise TypeError(f"broadcast_state: {type(obj).__name__} is not a tensor, number, string, list, tuple or dict")


def _key(k: Any) -> list:
    if isinstance(k, bool) or not isinstance(k, (int, str)):
        raise TypeError(f"broadcast_state: dict key {k!r} is neither an int nor a str")
    return ["i" if isinstance(k, int) else "s", k]


def _decode(node: Any, tensors: list[torch.Tensor]) -> Any:
    if not isinstance(node, dict) or len(node) not in (1, 3):
        raise ValueError(f"broadcast_state: malformed skeleton node {str(node)[:80]}")
    if "t" in node:
        return tensors[int(node["t"])]
    (kind, value), = node.items()
    if kind == "d":
        return {(int(k) if t == "i" else str(k)): _decode(v, tensors) for (t, k), v in value}
    if kind == "l":
        return [_decode(v, tensors) for v in value]
    if kind == "u":
        return tuple(_decode(v, tensors) for v in value)
    if kind == "v":
        return value
    raise ValueError(f"broadcast_state: unknown skeleton kind {kind!r}")


def broadcast_state(state: Any, group: dist.ProcessGroup, src: int, timeout: float | None,
                    dsts: list[int] | None = None) -> tuple[Any, int]:
    """Send ``state`` from the group's rank ``src`` to the ranks ``dsts`` of ``group`` (called by ``src``
    and every rank of ``dsts``; the others return at once).

    Args:
        state: the tree to send, on ``src`` (ignored elsewhere).
        group: the process group (a cross-replica generation's group).
        src: the sender's rank in ``group``.
        timeout: seconds each of the three messages may take (``CommTimeoutError``).
        dsts: the receivers' ranks (None: every rank but ``src``).

    Returns:
        (the state: on ``src`` the object given; on a receiver a new tree whose tensors are on the CPU;
        elsewhere None, the bytes the payload held (0 elsewhere)).
    """
    me = dist.get_rank(group)
    dsts = [r for r in range(group.size()) if r != src] if dsts is None else [r for r in dsts if r != src]
    if me != src and me not in dsts:
        return None, 0
    link = _Link(group, src, dsts, timeout)
    tensors: list[torch.Tensor] = []
    if me == src:
        skeleton = json.dumps(_encode(state, tensors)).encode()
        sizes = [t.numel() * t.element_size() for t in tensors]
        head = torch.tensor([len(skeleton), sum(sizes)], dtype=torch.int64)
    else:
        head = torch.zeros(2, dtype=torch.int64)
    link.move(head)
    text = torch.frombuffer(bytearray(skeleton), dtype=torch.uint8) if me == src else torch.empty(
        int(head[0]), dtype=torch.uint8)
    link.move(text)
    if me == src:
        flat = (torch.cat([t.reshape(-1).view(torch.uint8) for t in tensors]) if tensors
                else torch.empty(0, dtype=torch.uint8))
    else:
        flat = torch.empty(int(head[1]), dtype=torch.uint8)
    if flat.numel():
        link.move(flat)
    nbytes = int(head[0]) + int(head[1])
    if me == src:
        return state, nbytes
    tree = json.loads(bytes(text.numpy()).decode())
    out: list[torch.Tensor] = []
    pos = 0
    for spec in _tensor_specs(tree):
        dtype = _DTYPES.get(spec["dtype"])
        if dtype is None:
            raise ValueError(f"broadcast_state: unknown dtype {spec['dtype']!r}")
        shape = [int(s) for s in spec["shape"]]
        n = int(torch.Size(shape).numel()) * torch.empty(0, dtype=dtype).element_size()
        out.append(flat[pos: pos + n].clone().view(dtype).reshape(shape))
        pos += n
    if pos != flat.numel():
        raise ValueError(f"broadcast_state: the payload holds {flat.numel()} bytes, the skeleton {pos}")
    return _decode(tree, out), nbytes


def _tensor_specs(node: Any) -> list[dict]:
    """The skeleton's tensor entries in index order (the order the sender concatenated them)."""
    found: list[dict] = []

    def walk(n: Any) -> None:
        if isinstance(n, dict):
            if "t" in n:
                found.append(n)
                return
            for kind, value in n.items():
                if kind == "d":
                    for _, v in value:
                        walk(v)
                elif kind in ("l", "u"):
                    for v in value:
                        walk(v)

    walk(node)
    found.sort(key=lambda s: int(s["t"]))
    if [int(s["t"]) for s in found] != list(range(len(found))):
        raise ValueError("broadcast_state: the skeleton's tensor indices are not 0..n-1")
    return found


class _Link:
    """The source's sends to every receiver (posted together), or a receiver's receive from the source."""

    def __init__(self, group: dist.ProcessGroup, src: int, dsts: list[int], timeout: float | None):
        self.group, self.src, self.dsts, self.timeout = group, src, dsts, timeout
        self.me = dist.get_rank(group)

    def move(self, t: torch.Tensor) -> None:
        if self.me == self.src:
            works = [dist.isend(t, group=self.group, group_dst=d) for d in self.dsts]
        else:
            works = [dist.irecv(t, group=self.group, group_src=self.src)]
        for w in works:
            wait_work(w, self.timeout, "elastic/transfer")


def local(t: torch.Tensor) -> torch.Tensor:
    """The tensor this rank holds: a DTensor's (an FSDP2 shard's) local tensor, the storage itself, else ``t``."""
    return t._local_tensor if isinstance(t, DTensor) else t


def local_tree(tree: Any) -> Any:
    """``tree`` with every DTensor replaced by this rank's local tensor (:func:`local`): what a rank sends
    its peer of the same local index (the same shards)."""
    if isinstance(tree, torch.Tensor):
        return local(tree)
    if isinstance(tree, dict):
        return {k: local_tree(v) for k, v in tree.items()}
    if isinstance(tree, (list, tuple)):
        return type(tree)(local_tree(v) for v in tree)
    return tree


def optimizer_state_like(optimizer: torch.optim.Optimizer, sd: dict) -> dict:
    """A received optimizer ``state_dict`` (its shards as local tensors, :func:`local_tree`) with every
    tensor shaped like its DTensor parameter's shard a DTensor like that parameter again, so that
    ``optimizer.load_state_dict`` keeps the state sharded as the parameters are."""
    params = [p for g in optimizer.param_groups for p in g["params"]]
    if not any(isinstance(p, DTensor) for p in params):
        return sd
    state = {}
    for idx, entry in sd.get("state", {}).items():
        p = params[int(idx)]
        if not isinstance(p, DTensor):
            state[idx] = entry
            continue
        state[idx] = {k: (DTensor.from_local(v, p.device_mesh, p.placements, shape=p.shape, stride=p.stride(),
                                             run_check=False)
                          if isinstance(v, torch.Tensor) and v.dim() > 0 and v.shape == local(p).shape else v)
                      for k, v in entry.items()}
    return {**sd, "state": state}
