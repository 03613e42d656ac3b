"""Weights kept in their GGUF block formats (``QuantizedWeight``), for backends whose kernels run them packed.

A quantised GGUF file's projection and embedding matrices reach the model as ``QuantizedWeight``s when the
backend runs their types (``Backend.quantized_types``); everything else (norms, biases, types without a
kernel, ``--quantization none``) is dequantised at load as before. A weight is one or more row segments,
each in one format: fusing Q, K and V (or gate and up) concatenates rows, and the files often store V in a
wider format than Q and K.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import dequantize as gguf_dequantize

# The GGML types the quantised kernels take (csrc/quantized.cpp).
KERNEL_TYPES: frozenset[int] = frozenset(int(t) for t in (
    GGMLQuantizationType.Q4_0, GGMLQuantizationType.Q4_1, GGMLQuantizationType.Q5_0, GGMLQuantizationType.Q5_1,
    GGMLQuantizationType.Q8_0, GGMLQuantizationType.Q4_K, GGMLQuantizationType.Q5_K, GGMLQuantizationType.Q6_K,
))


# Blocks of 32 are held planar: per row, every block's fp16 scale, then every offset (Q4_1, Q5_1), every
# 32-bit high-bit word (Q5_0, Q5_1), every block's quants, so that the kernels load a run of scales or a
# pair of blocks' quants at once (csrc/quantized.cpp). Bytes per block of each part, in the file's order.
_PLANAR_PARTS: dict[int, tuple[int, ...]] = {
    int(GGMLQuantizationType.Q4_0): (2, 16), int(GGMLQuantizationType.Q4_1): (2, 2, 16),
    int(GGMLQuantizationType.Q5_0): (2, 4, 16), int(GGMLQuantizationType.Q5_1): (2, 2, 4, 16),
    int(GGMLQuantizationType.Q8_0): (2, 32),
}


def to_planar(ggml_type: int, blocks: np.ndarray) -> np.ndarray:
    """[rows, row_bytes] of the file's blocks -> the same bytes in the held layout (a copy)."""
    parts = _PLANAR_PARTS.get(ggml_type)
    if parts is None:
        return np.array(blocks)
    rows, width = blocks.shape
    per_block = blocks.reshape(rows, width // sum(parts), sum(parts))
    starts = np.cumsum((0, *parts))
    return np.concatenate([per_block[:, :, a:b].reshape(rows, -1) for a, b in zip(starts[:-1], starts[1:], strict=True)], axis=1)


def from_planar(ggml_type: int, held: np.ndarray) -> np.ndarray:
    """The inverse of ``to_planar``: the file's blocks."""
    parts = _PLANAR_PARTS.get(ggml_type)
    if parts is None:
        return held
    rows, width = held.shape
    num_blocks = width // sum(parts)
    starts = np.cumsum((0, *(p * num_blocks for p in parts)))
    pieces = [held[:, a:b].reshape(rows, num_blocks, -1) for a, b in zip(starts[:-1], starts[1:], strict=True)]
    return np.concatenate(pieces, axis=2).reshape(rows, width)


def type_name(ggml_type: int) -> str:
    return GGMLQuantizationType(ggml_type).name


def row_bytes(ggml_type: int, cols: int) -> int:
    values, nbytes = GGML_QUANT_SIZES[GGMLQuantizationType(ggml_type)]
    return cols // values * nbytes


@dataclass(frozen=True, slots=True, eq=False)
class QuantizedSegment:
    """Rows of one format: ``data`` is uint8 [rows, row_bytes], the file's blocks (blocks of 32 planar)."""

    ggml_type: int
    data: torch.Tensor

    @property
    def rows(self) -> int:
        return self.data.shape[0]


@dataclass(frozen=True, slots=True, eq=False)
class QuantizedWeight:
    """A [rows, cols] weight in GGUF block formats, as row segments in order."""

    segments: tuple[QuantizedSegment, ...]
    cols: int
    # The kernels' arguments, kept so that a call builds nothing: each segment's blocks and GGML type.
    data: tuple[torch.Tensor, ...] = field(init=False)
    types: tuple[int, ...] = field(init=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "data", tuple(s.data for s in self.segments))
        object.__setattr__(self, "types", tuple(s.ggml_type for s in self.segments))

    @classmethod
    def from_blocks(cls, ggml_type: int, blocks: np.ndarray, cols: int) -> QuantizedWeight:
        """From the file's blocks, [rows, row_bytes] uint8 (copied into the held layout)."""
        assert blocks.dtype == np.uint8 and blocks.ndim == 2 and blocks.shape[1] == row_bytes(ggml_type, cols)
        return cls((QuantizedSegment(ggml_type, torch.from_numpy(to_planar(ggml_type, blocks))),), cols)

    @property
    def shape(self) -> tuple[int, int]:
        return (sum(s.rows for s in self.segments), self.cols)

    @property
    def nbytes(self) -> int:
        return sum(s.data.numel() for s in self.segments)

    def numel(self) -> int:
        rows, cols = self.shape
        return rows * cols

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """[rows, cols] values, by gguf's own dequantiser: the reference the kernels are tested against."""
        parts = [torch.from_numpy(gguf_dequantize(from_planar(s.ggml_type, s.data.numpy()),
                                                  GGMLQuantizationType(s.ggml_type)))
                 for s in self.segments]
        return torch.cat(parts).reshape(self.shape).to(dtype)

    def __repr__(self) -> str:
        types = "+".join(type_name(t) for t in self.types)
        return f"QuantizedWeight({types}, shape={self.shape})"


Weight = torch.Tensor | QuantizedWeight


def concat_rows(parts: Sequence[Weight]) -> Weight:
    """Row-wise concatenation (a fused QKV or gate/up weight) of dense tensors, or of quantised weights, whose
    segments are kept (adjacent segments of one format merge into one)."""
    if all(isinstance(p, torch.Tensor) for p in parts):
        return torch.cat(list(parts)).contiguous()  # type: ignore[arg-type]
    if not all(isinstance(p, QuantizedWeight) for p in parts):
        raise TypeError("cannot fuse a quantised weight with a dense one")
    weights = [p for p in parts if isinstance(p, QuantizedWeight)]
    cols = weights[0].cols
    assert all(w.cols == cols for w in weights)
    merged: list[QuantizedSegment] = []
    for segment in (s for w in weights for s in w.segments):
        if merged and merged[-1].ggml_type == segment.ggml_type:
            merged[-1] = QuantizedSegment(segment.ggml_type, torch.cat([merged[-1].data, segment.data]))
        else:
            merged.append(segment)
    return QuantizedWeight(tuple(merged), cols)
