"""Weights kept in their GGUF block formats (``QuantizedWeight``), for backends whose kernels run them packed.

A quantised GGUF file's projection and embedding matrices reach the model as ``QuantizedWeight``s when the
backend runs their types (``Backend.quantized_types``); everything else (norms, biases, types without a
kernel, ``--quantization none``) is dequantised at load as before. A weight is one or more row segments,
each in one format: fusing Q, K and V (or gate and up) concatenates rows, and the files often store V in a
wider format than Q and K. A segment is held planar (below) or, where the backend's kernels read it so,
interleaved sixteen rows at a time (``quantized_layout``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import dequantize as gguf_dequantize

from kvserve.model.quantized_layout import (
    GROUP_ROWS,
    can_interleave,
    from_interleaved,
    pack_k_scales,
    to_interleaved,
    unpack_k_scales,
)

# The GGML types the quantised kernels take (csrc/quantized.cpp).
KERNEL_TYPES: frozenset[int] = frozenset(int(t) for t in (
    GGMLQuantizationType.Q4_0, GGMLQuantizationType.Q4_1, GGMLQuantizationType.Q5_0, GGMLQuantizationType.Q5_1,
    GGMLQuantizationType.Q8_0, GGMLQuantizationType.Q4_K, GGMLQuantizationType.Q5_K, GGMLQuantizationType.Q6_K,
))


# The types a draft model's wider matrices may be quantised again to, by the name its configuration uses.
REQUANTIZE_TYPES: dict[str, int] = {"q4_0": int(GGMLQuantizationType.Q4_0)}


# Every format is held planar: per row, each part of every block in turn (all the blocks' scales, then all
# their quants, ...), so that the kernels load a run of scales or a pair of chunks' quants at once
# (csrc/quantized.cpp). Blocks of 32 keep their bytes; the K-quants also unpack their 6-bit sub-block scales
# and mins to a byte each (four bytes more per 256 weights), which the kernels then read sixteen at a time.
# Per format: the bytes per block of each held part, in the held order.
_Q = GGMLQuantizationType
HELD_PARTS: dict[int, tuple[int, ...]] = {
    int(_Q.Q4_0): (2, 16), int(_Q.Q4_1): (2, 2, 16), int(_Q.Q5_0): (2, 4, 16), int(_Q.Q5_1): (2, 2, 4, 16),
    int(_Q.Q8_0): (2, 32),
    int(_Q.Q4_K): (2, 2, 8, 8, 128),  # d, dmin, scales, mins, quants
    int(_Q.Q5_K): (2, 2, 8, 8, 32, 128),  # d, dmin, scales, mins, high bits, quants
    int(_Q.Q6_K): (2, 16, 128, 64),  # d, scales, low 4 bits, high 2 bits
}
_K_SCALES = slice(4, 16)  # Q4_K and Q5_K: the twelve bytes packing eight 6-bit scales and eight mins


def _held_parts_of_blocks(ggml_type: int, blocks: np.ndarray) -> list[np.ndarray]:
    """[rows, num_blocks, file block bytes] -> the held parts, each [rows, num_blocks, part bytes]."""
    if ggml_type in (int(_Q.Q4_K), int(_Q.Q5_K)):
        scales, mins = unpack_k_scales(blocks[..., _K_SCALES])
        quants = [blocks[..., 16:48], blocks[..., 48:]] if ggml_type == int(_Q.Q5_K) else [blocks[..., 16:]]
        return [blocks[..., 0:2], blocks[..., 2:4], scales, mins, *quants]
    if ggml_type == int(_Q.Q6_K):
        return [blocks[..., 208:210], blocks[..., 192:208], blocks[..., 0:128], blocks[..., 128:192]]
    starts = np.cumsum((0, *HELD_PARTS[ggml_type]))
    return [blocks[..., a:b] for a, b in zip(starts[:-1], starts[1:], strict=True)]


def _blocks_of_held_parts(ggml_type: int, parts: list[np.ndarray]) -> np.ndarray:
    """The inverse of ``_held_parts_of_blocks``."""
    if ggml_type in (int(_Q.Q4_K), int(_Q.Q5_K)):
        d, dmin, scales, mins, *rest = parts
        return np.concatenate([d, dmin, pack_k_scales(scales, mins), *rest], axis=-1)
    if ggml_type == int(_Q.Q6_K):
        d, scales, low, high = parts
        return np.concatenate([low, high, scales, d], axis=-1)
    return np.concatenate(parts, axis=-1)


def to_planar(ggml_type: int, blocks: np.ndarray) -> np.ndarray:
    """[rows, row_bytes] of the file's blocks -> the held layout (a copy), [rows, held_row_bytes]."""
    _, nbytes = GGML_QUANT_SIZES[GGMLQuantizationType(ggml_type)]
    rows, width = blocks.shape
    parts = _held_parts_of_blocks(ggml_type, blocks.reshape(rows, width // nbytes, nbytes))
    return np.concatenate([p.reshape(rows, -1) for p in parts], axis=1)


def from_planar(ggml_type: int, held: np.ndarray) -> np.ndarray:
    """The inverse of ``to_planar``: the file's blocks."""
    sizes = HELD_PARTS[ggml_type]
    rows, width = held.shape
    num_blocks = width // sum(sizes)
    starts = np.cumsum((0, *(s * num_blocks for s in sizes)))
    parts = [held[:, a:b].reshape(rows, num_blocks, -1) for a, b in zip(starts[:-1], starts[1:], strict=True)]
    return _blocks_of_held_parts(ggml_type, parts).reshape(rows, -1)


def held_row_bytes(ggml_type: int, cols: int) -> int:
    """Bytes of one row of ``cols`` weights in the held layout."""
    values, _ = GGML_QUANT_SIZES[GGMLQuantizationType(ggml_type)]
    return cols // values * sum(HELD_PARTS[ggml_type])


def type_name(ggml_type: int) -> str:
    return GGMLQuantizationType(ggml_type).name


def row_bytes(ggml_type: int, cols: int) -> int:
    values, nbytes = GGML_QUANT_SIZES[GGMLQuantizationType(ggml_type)]
    return cols // values * nbytes


# Set in a segment's type id for the kernels when it is held interleaved (csrc/quantized.h).
INTERLEAVED_FLAG = 0x100


@dataclass(frozen=True, slots=True, eq=False)
class QuantizedSegment:
    """Rows of one format: ``data`` is uint8 [rows, held_row_bytes], the file's blocks held planar, or
    (``interleaved``) sixteen rows at a time interleaved."""

    ggml_type: int
    data: torch.Tensor
    interleaved: bool = False

    @property
    def rows(self) -> int:
        return self.data.shape[0]

    @property
    def kernel_type(self) -> int:
        """The type id the kernels take: the GGML type, flagged when interleaved."""
        return self.ggml_type | (INTERLEAVED_FLAG if self.interleaved else 0)

    def file_blocks(self, cols: int) -> np.ndarray:
        """[rows, row_bytes]: the blocks as the file has them."""
        held = self.data.numpy()
        return from_interleaved(self.ggml_type, held, cols) if self.interleaved else from_planar(self.ggml_type, held)

    def planar(self, cols: int) -> QuantizedSegment:
        if not self.interleaved:
            return self
        return QuantizedSegment(self.ggml_type, torch.from_numpy(to_planar(self.ggml_type, self.file_blocks(cols))))


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
        object.__setattr__(self, "types", tuple(s.kernel_type for s in self.segments))

    @classmethod
    def from_blocks(cls, ggml_type: int, blocks: np.ndarray, cols: int, interleave: bool = False) -> QuantizedWeight:
        """From the file's blocks, [rows, row_bytes] uint8 (copied into the held layout): interleaved if asked
        and the rows are whole groups of sixteen, else planar."""
        assert blocks.dtype == np.uint8 and blocks.ndim == 2 and blocks.shape[1] == row_bytes(ggml_type, cols)
        if interleave and can_interleave(ggml_type, blocks.shape[0]):
            return cls((QuantizedSegment(ggml_type, torch.from_numpy(to_interleaved(ggml_type, blocks)), True),), cols)
        return cls((QuantizedSegment(ggml_type, torch.from_numpy(to_planar(ggml_type, blocks))),), cols)

    @property
    def interleaved(self) -> bool:
        return self.segments[0].interleaved

    @property
    def shape(self) -> tuple[int, int]:
        return (sum(s.rows for s in self.segments), self.cols)

    @property
    def nbytes(self) -> int:
        return sum(s.data.numel() for s in self.segments)

    def numel(self) -> int:
        rows, cols = self.shape
        return rows * cols

    def leading_rows(self, rows: int) -> QuantizedWeight:
        """The first ``rows`` rows, or a few more: an interleaved segment is cut after whole groups of sixteen.
        Views of the same blocks, nothing copied."""
        assert 0 < rows <= self.shape[0]
        kept: list[QuantizedSegment] = []
        for segment in self.segments:
            if rows <= 0:
                break
            take = min(segment.rows, -(-rows // GROUP_ROWS) * GROUP_ROWS if segment.interleaved else rows)
            kept.append(QuantizedSegment(segment.ggml_type, segment.data[:take], segment.interleaved))
            rows -= take
        return QuantizedWeight(tuple(kept), self.cols)

    def gather_rows(self, ids: Sequence[int]) -> QuantizedWeight:
        """The rows ``ids`` (ascending, each once), copied into a weight of their own, held as this one is
        where they make whole groups of sixteen (else planar)."""
        assert list(ids) == sorted(set(ids)) and (not ids or 0 <= ids[0] and ids[-1] < self.shape[0])
        wanted = np.asarray(ids, dtype=np.int64)
        parts: list[QuantizedWeight] = []
        start = 0
        for segment in self.segments:
            local = wanted[(wanted >= start) & (wanted < start + segment.rows)] - start
            if len(local):
                blocks = segment.file_blocks(self.cols)[local]
                parts.append(QuantizedWeight.from_blocks(segment.ggml_type, blocks, self.cols, segment.interleaved))
            start += segment.rows
        assert parts, "no rows gathered"
        gathered = concat_rows(parts)
        assert isinstance(gathered, QuantizedWeight)
        return gathered

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """[rows, cols] values, by gguf's own dequantiser: the reference the kernels are tested against."""
        parts = [torch.from_numpy(gguf_dequantize(s.file_blocks(self.cols), GGMLQuantizationType(s.ggml_type)))
                 for s in self.segments]
        return torch.cat(parts).reshape(self.shape).to(dtype)

    def __repr__(self) -> str:
        types = "+".join(type_name(s.ggml_type) for s in self.segments)
        layout = ", interleaved" if self.interleaved else ""
        return f"QuantizedWeight({types}, shape={self.shape}{layout})"


Weight = torch.Tensor | QuantizedWeight


def concat_rows(parts: Sequence[Weight]) -> Weight:
    """Row-wise concatenation (a fused QKV or gate/up weight) of dense tensors, or of quantised weights, whose
    segments are kept (adjacent segments of one format merge into one). The kernels take a weight whose
    segments are all interleaved or all planar: if the parts differ, the interleaved ones are made planar."""
    if all(isinstance(p, torch.Tensor) for p in parts):
        return torch.cat(list(parts)).contiguous()  # type: ignore[arg-type]
    if not all(isinstance(p, QuantizedWeight) for p in parts):
        # Some parts in block types the kernels take, others not (llama.cpp's Q3_K_M keeps attn_v in Q5_K and
        # attn_q / attn_k in Q3_K): the fused weight runs dense, as the others' dequantised values.
        dense = next(p for p in parts if isinstance(p, torch.Tensor))
        return torch.cat([p.dequantize(dense.dtype).to(dense.device) if isinstance(p, QuantizedWeight) else p
                          for p in parts]).contiguous()
    weights = [p for p in parts if isinstance(p, QuantizedWeight)]
    cols = weights[0].cols
    assert all(w.cols == cols for w in weights)
    segments = [s for w in weights for s in w.segments]
    if len({s.interleaved for s in segments}) > 1:
        segments = [s.planar(cols) for s in segments]
    merged: list[QuantizedSegment] = []
    for segment in segments:
        if merged and merged[-1].ggml_type == segment.ggml_type:
            merged[-1] = QuantizedSegment(segment.ggml_type, torch.cat([merged[-1].data, segment.data]),
                                          segment.interleaved)
        else:
            merged.append(segment)
    return QuantizedWeight(tuple(merged), cols)
