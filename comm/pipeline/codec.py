"""What crosses a pipeline boundary: one codec per direction (docs/architecture.md section 5.5d).

A stage boundary carries one activation tensor forward and its gradient backward per micro-batch.
Across a slow link those bytes are the step's critical path, so each direction can be encoded:

- ``None`` / ``"none"``: the tensor's own bytes (exact);
- ``"bf16"`` / ``"fp16"``: a cast (2 bytes per element);
- ``"int8"`` / ``"int4"``: ``comm/compression``'s block codec with one fp32 scale per row (the last
  dimension), rounded to nearest: 1 (or 1/2) byte per element plus 4 per row. A row of an activation
  is one token's hidden vector, whose magnitude varies from token to token far more than inside it.

A codec's round trip (:meth:`BoundaryCodec.roundtrip`) is bit for bit what the receiver decodes, so a
test (or a user) can build the fake-quantized reference: single-process training with the round trip
applied at the boundary.

:class:`DeltaCache` is AQ-SGD's delta mode (Wang et al., arXiv 2206.01299) for fine-tuning on samples
that come back every epoch: both sides of a boundary keep, per sample, the last activation the
receiver reconstructed; a sample's first visit is sent exact (and fills the cache), every later one
as the codec's encoding of the change since the cached value, which shrinks as training converges.
Its memory is one activation per sample on each side (seq x d x 4 bytes in fp32: 128 KiB for the
bench GPT's 128 x 256), kept as the activation's dtype on the stage's device.
"""

from __future__ import annotations

import math

import torch

from ..compression.quantize import QuantizeCompressor

__all__ = ["BoundaryCodec", "Raw", "Cast", "RowQuant", "get_codec", "DeltaCache", "CODECS"]

CODECS = ("none", "bf16", "fp16", "int8", "int4")


class BoundaryCodec:
    """Encodes one boundary tensor into a uint8 payload of a size fixed by its shape and dtype (so
    the receiver can post its buffer before the payload exists)."""

    name = "none"
    exact = True

    def nbytes(self, shape: tuple[int, ...], dtype: torch.dtype) -> int:
        """Payload bytes of a tensor of ``shape`` and ``dtype``."""
        raise NotImplementedError

    def encode(self, x: torch.Tensor, out: torch.Tensor) -> None:
        """Write ``x``'s payload into the uint8 tensor ``out`` (``nbytes`` long)."""
        raise NotImplementedError

    def decode(self, payload: torch.Tensor, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """The tensor the payload stands for (a new tensor, or a view of ``payload``'s bytes)."""
        raise NotImplementedError

    def roundtrip(self, x: torch.Tensor) -> torch.Tensor:
        """``decode(encode(x))``: exactly what the receiver gets for ``x``."""
        buf = torch.empty(self.nbytes(tuple(x.shape), x.dtype), dtype=torch.uint8, device=x.device)
        self.encode(x, buf)
        return self.decode(buf, tuple(x.shape), x.dtype).clone()

    def __repr__(self) -> str:
        return self.name


class Raw(BoundaryCodec):
    """The tensor's own bytes."""

    def nbytes(self, shape, dtype) -> int:
        return math.prod(shape) * torch.empty((), dtype=dtype).element_size()

    def encode(self, x, out) -> None:
        out.view(x.dtype).view(x.shape).copy_(x)

    def decode(self, payload, shape, dtype):
        return payload.view(dtype).view(shape)


class Cast(Raw):
    """A cast to ``wire`` (bf16 or fp16) and back."""

    exact = False

    def __init__(self, wire: torch.dtype) -> None:
        self.wire = wire
        self.name = {torch.bfloat16: "bf16", torch.float16: "fp16"}[wire]

    def nbytes(self, shape, dtype) -> int:
        return math.prod(shape) * 2

    def encode(self, x, out) -> None:
        out.view(self.wire).view(x.shape).copy_(x)

    def decode(self, payload, shape, dtype):
        return payload.view(self.wire).view(shape).to(dtype)


class RowQuant(BoundaryCodec):
    """int8 / int4 with one fp32 scale per row (the last dimension), rounded to nearest, through
    ``comm/compression``'s block codec (a row is one block; an odd row width is padded by one zero)."""

    exact = False

    def __init__(self, bits: int) -> None:
        self.bits = bits
        self.name = f"int{bits}"

    @staticmethod
    def _rows(shape) -> tuple[int, int]:
        cols = shape[-1] if len(shape) else 1
        return (math.prod(shape) // cols if cols else 0), cols

    def _codec(self, cols: int) -> tuple[QuantizeCompressor, int]:
        width = cols + (cols % 2)  # the block codec's blocks are even
        return QuantizeCompressor(self.bits, block=max(2, width)), max(2, width)

    def nbytes(self, shape, dtype) -> int:
        rows, cols = self._rows(shape)
        codec, width = self._codec(cols)
        return codec.nbytes([rows * width])

    def encode(self, x, out) -> None:
        rows, cols = self._rows(tuple(x.shape))
        codec, width = self._codec(cols)
        flat = x.reshape(rows, cols).float()
        if width != cols:
            flat = torch.nn.functional.pad(flat, (0, width - cols))
        codec.encode(flat.reshape(-1), [rows * width], out, stochastic=False)

    def decode(self, payload, shape, dtype):
        rows, cols = self._rows(shape)
        codec, width = self._codec(cols)
        out = codec.decode(payload, [rows * width], dtype=torch.float32).view(rows, width)
        return out[:, :cols].to(dtype).reshape(shape)


def get_codec(spec: str | BoundaryCodec | None) -> BoundaryCodec:
    """The codec named ``spec`` (one of :data:`CODECS`, or None for ``"none"``), or ``spec`` itself."""
    if isinstance(spec, BoundaryCodec):
        return spec
    if spec is None or spec == "none":
        return Raw()
    if spec in ("bf16", "fp16"):
        return Cast(torch.bfloat16 if spec == "bf16" else torch.float16)
    if spec in ("int8", "int4"):
        return RowQuant(int(spec[3:]))
    raise ValueError(f"pipeline boundary codec {spec!r} is not known; use one of {CODECS} (None: exact)")


class DeltaCache:
    """AQ-SGD's per-sample cache of one side of one boundary direction (see the module docstring).

    Both sides hold the same values: the sender encodes ``x - cache[ids]`` and adds what the receiver
    will decode to its cache; the receiver adds what it decoded. A micro-batch whose samples were
    not all seen before is sent exact and its cache rows set to it.

    Args:
        capacity: how many samples (ids ``0 .. capacity - 1``) it can hold.
    """

    def __init__(self, capacity: int) -> None:
        if isinstance(capacity, bool) or not isinstance(capacity, int) or capacity < 1:
            raise ValueError(f"DeltaCache: capacity={capacity!r} must be a positive int (the number of distinct "
                             f"sample ids, 0 .. capacity - 1)")
        self.capacity = capacity
        self.values: torch.Tensor | None = None  # [capacity, *sample shape]
        self.seen: torch.Tensor | None = None

    def check_ids(self, ids: torch.Tensor, rows: int) -> torch.Tensor:
        """``ids`` as int64 on CPU, checked against the micro-batch's ``rows`` samples and the capacity."""
        ids = torch.as_tensor(ids).reshape(-1).to(torch.int64).cpu()
        if ids.numel() != rows:
            raise ValueError(f"AQ-SGD delta mode: {ids.numel()} sample ids for a micro-batch of {rows} samples; "
                             f"pass one id per sample (dimension 0 of the stage's input)")
        if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= self.capacity):
            raise ValueError(f"AQ-SGD delta mode: sample ids must lie in [0, {self.capacity}) (the cache's capacity); "
                             f"got [{int(ids.min())}, {int(ids.max())}]")
        if ids.unique().numel() != ids.numel():
            raise ValueError("AQ-SGD delta mode: a micro-batch repeats a sample id; each sample needs its own id")
        return ids

    def cached(self, ids: torch.Tensor) -> bool:
        """Whether every sample of ``ids`` was seen before (the micro-batch goes as a delta)."""
        return self.seen is not None and bool(self.seen[ids].all())

    def _alloc(self, like: torch.Tensor) -> None:
        if self.values is None:
            self.values = torch.zeros((self.capacity, *like.shape[1:]), dtype=like.dtype, device=like.device)
            self.seen = torch.zeros(self.capacity, dtype=torch.bool)
        elif tuple(self.values.shape[1:]) != tuple(like.shape[1:]) or self.values.dtype != like.dtype:
            raise ValueError(f"AQ-SGD delta mode: a sample's activation changed from {tuple(self.values.shape[1:])} "
                             f"{self.values.dtype} to {tuple(like.shape[1:])} {like.dtype}; the cache holds one "
                             f"shape per boundary")

    def delta(self, x: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """What the sender encodes for a cached micro-batch: ``x - cache[ids]``."""
        self._alloc(x)
        return x - self.values[ids]

    def update(self, ids: torch.Tensor, decoded: torch.Tensor, *, delta: bool) -> torch.Tensor:
        """Fold what the receiver decoded into the cache; returns the reconstructed activation."""
        self._alloc(decoded)
        if delta:
            self.values[ids] += decoded
        else:
            self.values[ids] = decoded
            self.seen[ids] = True
        return self.values[ids]

    def nbytes(self) -> int:
        """The cache's memory (0 before its first micro-batch)."""
        return 0 if self.values is None else self.values.numel() * self.values.element_size()
