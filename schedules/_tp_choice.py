"""How the tensor-parallel rings cut their blocks, what a ring costs against torch's collective, and
which of the two a fused Linear runs (docs/architecture.md section 5; docs/guide.md "Tensor
parallelism").

**Chunks.** A ring cuts each block into chunks whose transfer, by the cost model of the group's link,
lasts at least :data:`MIN_CHUNK_SECONDS` (by device type), at most :data:`MAX_CHUNKS`: each chunk is
one more engine phase, about 1 ms of thread hand-offs beside compute on a busy CPU (the chunked styles
ran 0.83-0.86x the unchunked ones where a block crossed in under 6 ms, docs/results.md 22) and tens of
microseconds beside a GPU. A block that crosses faster than its matmul slice gains nothing by it. A
caller may fix the count instead (the ``chunks`` argument of the primitives, the styles and
``ring_attention``).

**The choice.** A ring hides the transfer of each block behind the matmul of the block before it, but
where the link is fast there is little to hide and its per-step hand-offs are pure cost: the regime
tensor parallelism usually runs in (inside a node, NCCL on NVLink). So each fused Linear of the styles
chooses, the way ``algorithm="auto"`` chooses an all-reduce: from the group's link (``cost.model_for``,
calibrated where ``cost.calibrate`` ran, else the configured rate or the defaults) and the matmul's
time measured on this rank, it predicts both paths (:func:`predict`) and runs the ring only where it
is faster by more than the calibration resolves (``cost.MEASURED_TIE``): torch's own path otherwise,
its code unchanged. The choice is made once per module and input shape (:class:`FusedState`): every
rank measures, one MAX all-reduce makes the matmul time the slowest rank's, and every rank then
computes the same choice from the same numbers (docs/architecture.md section 2, rule 2).

**The agreement check**, once per module and shape: the ranks check what the ring exchanges when a
module's input key (shape, dtype, dimension, whether a gradient flows) differs from the last one
every rank agreed on, not at every forward. Keying on the last agreed key rather than on every key
seen keeps a disagreement safe: a rank whose key changed checks while one whose key did not runs its
ring, and the two wait for different messages, so both raise ``CommTimeoutError`` within the timeout;
they can never both skip the check with different shapes (gloo aborts the process when a message is
longer than its buffer).
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch
import torch.distributed as dist

from commopt.comm import cost
from commopt.comm.engine import wait_work
from commopt.comm.runtime import context

__all__ = ["MIN_CHUNK_SECONDS", "MAX_CHUNKS", "HANDOFF_SECONDS", "ALGORITHMS", "chunk_count", "chunks_for",
           "check_chunks", "check_algorithm", "ring_seconds", "predict", "FusedState", "choices"]

#: The shortest transfer of one chunk (seconds, by device type; others as "cpu") and the most chunks
#: per block: the automatic chunking rule of :func:`chunks_for` (module docstring).
MIN_CHUNK_SECONDS = {"cpu": 5e-3, "cuda": 2e-4}
MAX_CHUNKS = 8
#: What one ring step costs beyond its transfer (an engine phase's hand-off between threads), by
#: device type: charged to the ring in :func:`predict`.
HANDOFF_SECONDS = {"cpu": 1e-3, "cuda": 5e-5}
#: The values of the styles' ``algorithm`` argument.
ALGORITHMS = ("auto", "ring", "torch")
_STATE = "_commopt_tp"  # the attribute of a fused module that holds its FusedState


def _by_device(table: dict[str, float], device_type: str) -> float:
    return table.get(device_type, table["cpu"])


def chunk_count(seconds: float, rows: int, device_type: str) -> int:
    """The chunks of a block of ``rows`` rows whose transfer takes ``seconds``: each chunk's at least
    :data:`MIN_CHUNK_SECONDS` of ``device_type`` long, between 1 and :data:`MAX_CHUNKS` and ``rows`` (the
    rule of :func:`chunks_for`, and of the simulator's rings)."""
    return max(1, min(MAX_CHUNKS, rows, int(seconds / _by_device(MIN_CHUNK_SECONDS, device_type))))


def _link(group) -> cost.LinkModel:
    topo = context().topology(None, group)
    model = cost.model_for(topo)
    return model.inter if topo.num_nodes > 1 else model.intra


def chunks_for(block_bytes: int, rows: int, group, device: torch.device, chunks: int | None = None) -> int:
    """How many chunks the rings cut a block of ``block_bytes`` (``rows`` rows) into on ``group``.

    ``chunks`` given: that many, at most ``rows`` (and at least 1). None: as many as keep each chunk's
    transfer, by ``cost.model_for`` the group's topology (the inter-node link where the group spans
    nodes), at least :data:`MIN_CHUNK_SECONDS` of ``device``'s type long (:func:`chunk_count`). The same
    on every rank of the group (the model is agreed); the first call on a group detects its topology, a
    collective."""
    if chunks is not None:
        return max(1, min(chunks, rows))
    return chunk_count(_link(group).time(block_bytes), rows, device.type)


def check_chunks(name: str, chunks) -> int | None:
    """``chunks`` is None (automatic) or an int >= 1, else ``TypeError`` / ``ValueError`` naming ``name``."""
    if chunks is None:
        return None
    if isinstance(chunks, bool) or not isinstance(chunks, int):
        raise TypeError(f"{name}: chunks must be an int >= 1 or None (cut by the link's speed), got "
                        f"{type(chunks).__name__} {chunks!r}")
    if chunks < 1:
        raise ValueError(f"{name}: chunks must be >= 1 (or None: cut by the link's speed), got {chunks}")
    return chunks


def check_algorithm(name: str, algorithm) -> str:
    if algorithm not in ALGORITHMS:
        raise ValueError(f"{name}: algorithm must be one of {', '.join(map(repr, ALGORITHMS))} (\"auto\": the ring "
                         f"only where it predicts faster than torch's collective), got {algorithm!r}")
    return algorithm


def ring_seconds(matmul: float, hop: float, tp: int, chunks: int, meanwhile: float = 0.0) -> float:
    """Seconds of one all-gather-matmul ring (the reduce-scatter ring is its mirror image): ``tp - 1``
    steps forward one block each, chunk by chunk, back to back (``hop`` seconds a chunk); each chunk's
    slice of ``matmul`` (the whole matmul on this rank) runs once the chunk is in and the slice before
    it is done. ``meanwhile``: local work run as the last step begins."""
    piece = matmul / tp / chunks
    arrived: dict[tuple[int, int], float] = {}
    free = 0.0
    for k in range(tp - 1):  # step k forwards block me - k, chunk by chunk, back to back
        for j in range(chunks):
            free = max(free, arrived.get((k - 1, j), 0.0)) + hop
            arrived[k, j] = free
    t = 0.0
    for k in range(tp):
        if k == tp - 1:
            t += meanwhile
        for j in range(chunks):
            t = max(t, arrived.get((k - 1, j), 0.0)) + piece
    return t


def predict(kind: str, *, tp: int, matmul: float, block_bytes: float, link: cost.LinkModel, chunks: int,
            device_type: str) -> tuple[float, float]:
    """``(ring, torch)``: predicted seconds of one fused Linear's forward as commopt's ring and as
    torch's collective followed (or preceded) by the matmul. The backward mirrors the forward, so the
    forward decides.

    Args:
        kind: ``"all_gather"`` (column-parallel: gather, then multiply), ``"reduce_scatter"``
            (row-parallel, sequence-sharded output) or ``"all_reduce"`` (row-parallel, replicated).
        tp: the group's size.
        matmul: seconds of this rank's whole matmul.
        block_bytes: bytes of one rank's block: the shard gathered, or the block of the product that
            each rank ends with (``all_reduce``: the product over ``tp``).
        link: the group's link.
        chunks: the ring's chunks per block.
        device_type: the tensors' device type (the ring's hand-off cost).
    """
    step = link.time(block_bytes)
    collective = (tp - 1) * step
    handoffs = (tp - 1) * chunks * _by_device(HANDOFF_SECONDS, device_type)
    ring = ring_seconds(matmul, link.time(block_bytes / chunks), tp, chunks) + handoffs
    if kind == "all_reduce":  # a reduce-scatter ring overlapped, then an all-gather ring of the rows alone
        return ring + collective + (tp - 1) * _by_device(HANDOFF_SECONDS, device_type), matmul + 2 * collective
    return ring, matmul + collective


class FusedState:
    """One fused Linear's agreed input key and its choices (module docstring): held by the module,
    read with :func:`choices`.

    Attributes:
        algorithm: the style's ``algorithm``.
        chunks: the style's ``chunks`` (None: cut by the link).
        choices: input key -> ``"ring"`` or ``"torch"``, for every key decided.
        predictions: input key -> ``(ring seconds, torch seconds)`` behind an ``"auto"`` choice.
        checks: how many agreement checks this module has run.
    """

    def __init__(self, algorithm: str, chunks: int | None) -> None:
        self.algorithm, self.chunks = algorithm, chunks
        self.last: tuple | None = None
        self.choices: dict[tuple, str] = {}
        self.predictions: dict[tuple, tuple[float, float]] = {}
        self.checks = 0

    def check(self, key: tuple, agree: Callable[[], None]) -> None:
        """Run ``agree`` (the ring's agreement check, waited for) unless ``key`` is the last key every
        rank agreed on."""
        if key == self.last:
            return
        self.last = None
        self.checks += 1
        agree()
        self.last = key

    def choose(self, name: str, key: tuple, agree: Callable[[], None], *, kind: str, matmul: Callable[[], object],
               scale: int, block_bytes: float, rows: int, group, device: torch.device) -> str:
        """``"ring"`` or ``"torch"`` for ``key`` (checked first): decided once per key from the slowest
        rank's measured ``matmul`` (one call of it takes ``1 / scale`` of the whole matmul) and the
        group's link, the same on every rank."""
        if self.algorithm != "auto":
            if self.algorithm == "ring":
                self.check(key, agree)
            return self.algorithm
        self.check(key, agree)
        choice = self.choices.get(key)
        if choice is not None:
            return choice
        seconds = _slowest(name, _time(matmul, device) * scale, group)
        link = _link(group)
        chunks = chunks_for(int(block_bytes), rows, group, device, self.chunks)
        ring, plain = predict(kind, tp=dist.get_world_size(group), matmul=seconds, block_bytes=block_bytes,
                              link=link, chunks=chunks, device_type=device.type)
        choice = "ring" if ring < (1 - cost.MEASURED_TIE) * plain else "torch"
        self.choices[key], self.predictions[key] = choice, (ring, plain)
        return choice


def _time(fn: Callable[[], object], device: torch.device) -> float:
    """The faster of two timed calls of ``fn`` (the first may pay for allocation), synchronized on CUDA."""
    best = float("inf")
    for _ in range(2):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        best = min(best, time.perf_counter() - start)
    return best


def _slowest(name: str, seconds: float, group) -> float:
    """The largest of the ranks' ``seconds`` (one MAX all-reduce on ``group``, bounded by the group's own
    timeout as the styles' rings are): every rank decides on it."""
    t = torch.tensor([seconds], dtype=torch.float64)
    wait_work(dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group, async_op=True), None,
              op=f"{name}/choose (the ranks' matmul times, to choose between the ring and torch's collective)")
    return float(t)


def state_of(module: torch.nn.Module, algorithm: str, chunks: int | None) -> FusedState:
    """A fresh :class:`FusedState` held by ``module`` (read by :func:`choices`)."""
    state = FusedState(algorithm, chunks)
    setattr(module, _STATE, state)
    return state


def choices(model: torch.nn.Module) -> dict[str, dict[tuple, str]]:
    """What every fused Linear of ``model`` ran, by module name: input key (shape, dtype, ...) ->
    ``"ring"`` or ``"torch"``. Modules that never ran a fused forward map to an empty dict."""
    return {name: dict(getattr(m, _STATE).choices) for name, m in model.named_modules() if hasattr(m, _STATE)}
