"""A state dict as JSON metadata plus one raw byte buffer (no pickle, no safetensors copy).

The shared-memory transports (``shm://``, ``cuda-ipc://``) lay a state dict out
in one flat buffer: every tensor's bytes, contiguous, at an offset aligned to
:data:`ALIGN_BYTES`. The table that says where each tensor lives is JSON:

    {"format": "online-sao-layout/1", "data_bytes": N,
     "tensors": [{"name": ..., "dtype": "bfloat16", "shape": [..], "offset": .., "nbytes": ..}, ...]}

A table read back is untrusted until checked: :meth:`Layout.from_json` refuses
unknown dtypes, sizes that disagree with the shape, misaligned, overlapping or
out-of-bounds entries and duplicate names, raising :class:`CorruptWeights`.
"""

from __future__ import annotations

import math
from typing import Literal

import torch
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from online_sao.weights.store import CorruptWeights

ALIGN_BYTES = 64
"""Every tensor starts at a multiple of this many bytes: enough for any dtype's alignment and for
vectorised copies; the padding costs at most this much per tensor."""

MAX_TABLE_BYTES = 64 * 1024 * 1024
"""Largest table accepted when reading: a bound checked before parsing JSON that came from outside
the process (a model with 100k tensors needs about 15 MB)."""

LAYOUT_FORMAT = "online-sao-layout/1"
"""The ``format`` field of a table; a reader refuses any other."""

DTYPES: dict[str, torch.dtype] = {
    "float64": torch.float64, "float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16,
    "int64": torch.int64, "int32": torch.int32, "int16": torch.int16, "int8": torch.int8, "uint8": torch.uint8,
    "bool": torch.bool,
}
"""The dtypes a layout can hold, by the name written in the table."""

_DTYPE_NAMES = {dtype: name for name, dtype in DTYPES.items()}


def align(n: int) -> int:
    """``n`` rounded up to a multiple of :data:`ALIGN_BYTES`."""
    return -(-n // ALIGN_BYTES) * ALIGN_BYTES


class TensorEntry(BaseModel):
    """Where one tensor's bytes sit in the data buffer."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    name: str = Field(min_length=1)
    dtype: str
    shape: tuple[int, ...]
    offset: int = Field(ge=0)
    nbytes: int = Field(ge=0)


class Layout(BaseModel):
    """The table of a packed state dict: what :func:`pack_bytes` writes and :func:`unpack` reads."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    format: Literal["online-sao-layout/1"] = LAYOUT_FORMAT
    data_bytes: int = Field(ge=0)
    tensors: tuple[TensorEntry, ...]

    @classmethod
    def of(cls, state: dict[str, torch.Tensor]) -> Layout:
        """The layout of ``state``, tensors in its order; refuses dtypes outside :data:`DTYPES`."""
        entries, offset = [], 0
        for name, tensor in state.items():
            if tensor.dtype not in _DTYPE_NAMES:
                raise ValueError(f"tensor {name}: dtype {tensor.dtype} cannot be published through shared memory")
            nbytes = tensor.numel() * tensor.element_size()
            entries.append(TensorEntry(name=name, dtype=_DTYPE_NAMES[tensor.dtype], shape=tuple(tensor.shape),
                                       offset=offset, nbytes=nbytes))
            offset = align(offset + nbytes)
        return cls(data_bytes=offset, tensors=tuple(entries))

    def to_json(self) -> bytes:
        """Compact JSON, fields in a fixed order: the same layout always gives the same bytes."""
        return self.model_dump_json().encode("utf-8")

    @classmethod
    def from_json(cls, data: bytes | bytearray | memoryview, data_bytes: int | None = None) -> Layout:
        """Parse and check a table; ``data_bytes`` (when known) must match the buffer it describes."""
        if len(data) > MAX_TABLE_BYTES:
            raise CorruptWeights(f"layout table of {len(data)} bytes exceeds {MAX_TABLE_BYTES}")
        try:
            layout = cls.model_validate_json(bytes(data))
        except ValidationError as exc:
            raise CorruptWeights(f"bad layout table: {exc.errors()[0]['msg']}") from None
        layout.check(data_bytes)
        return layout

    def check(self, data_bytes: int | None = None) -> None:
        """Raise :class:`CorruptWeights` unless every entry is a well-formed, disjoint slice of the buffer."""
        if data_bytes is not None and data_bytes != self.data_bytes:
            raise CorruptWeights(f"layout says {self.data_bytes} data bytes, the buffer holds {data_bytes}")
        names: set[str] = set()
        end = 0
        for e in sorted(self.tensors, key=lambda t: t.offset):
            if e.name in names:
                raise CorruptWeights(f"tensor {e.name} appears twice in the layout")
            names.add(e.name)
            dtype = DTYPES.get(e.dtype)
            if dtype is None:
                raise CorruptWeights(f"tensor {e.name}: unknown dtype {e.dtype!r}")
            if any(d < 0 for d in e.shape) or math.prod(e.shape) * dtype.itemsize != e.nbytes:
                raise CorruptWeights(f"tensor {e.name}: shape {list(e.shape)} of {e.dtype} is not {e.nbytes} bytes")
            if e.offset % ALIGN_BYTES or e.offset < end or e.offset + e.nbytes > self.data_bytes:
                raise CorruptWeights(f"tensor {e.name}: bytes [{e.offset}, {e.offset + e.nbytes}) misplaced")
            end = e.offset + e.nbytes


def tensor_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """The bytes of a tensor as a flat uint8 tensor on its device (a view when already contiguous)."""
    return tensor.detach().contiguous().reshape(-1).view(torch.uint8)


def pack(state: dict[str, torch.Tensor], layout: Layout, out: torch.Tensor) -> None:
    """Copy every tensor of ``state`` into the uint8 buffer ``out`` (any device) where ``layout`` says."""
    if out.dtype != torch.uint8 or out.dim() != 1 or out.numel() < layout.data_bytes:
        raise ValueError(f"need a flat uint8 buffer of at least {layout.data_bytes} bytes")
    start = 0
    for entry in layout.tensors:
        if entry.offset > start:  # zero the padding: the checksum covers it
            out[start:entry.offset].zero_()
        out[entry.offset:entry.offset + entry.nbytes].copy_(tensor_bytes(state[entry.name]))
        start = entry.offset + entry.nbytes
    if layout.data_bytes > start:
        out[start:layout.data_bytes].zero_()


def unpack(layout: Layout, data: torch.Tensor) -> dict[str, torch.Tensor]:
    """Tensors viewing the flat uint8 buffer ``data`` (any device), as ``layout`` describes them.

    ``layout`` must have been checked against ``data`` (:meth:`Layout.from_json` or
    :meth:`Layout.check`); the views keep ``data`` alive.
    """
    if data.dtype != torch.uint8 or data.dim() != 1 or data.numel() < layout.data_bytes:
        raise CorruptWeights(f"data buffer of {data.numel()} bytes is shorter than the layout's {layout.data_bytes}")
    return {e.name: data[e.offset:e.offset + e.nbytes].view(DTYPES[e.dtype]).reshape(e.shape)
            for e in layout.tensors}
