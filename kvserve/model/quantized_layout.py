"""The interleaved layout of GGUF-quantised weights: sixteen rows at a time, four consecutive weights of each
row side by side, as csrc/quantized_interleaved.cpp's int8 dot products read them (one register: four
weights of sixteen rows). That file's header describes the layout; this module makes it from the blocks as
the file has them, and back. The bytes per row are the planar layout's (``quantized.held_row_bytes``).
"""

from __future__ import annotations

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

GROUP_ROWS = 16

_Q = GGMLQuantizationType
_BLOCKS_OF_32 = {int(_Q.Q4_0), int(_Q.Q4_1), int(_Q.Q5_0), int(_Q.Q5_1), int(_Q.Q8_0)}
_OFFSETS = {int(_Q.Q4_1), int(_Q.Q5_1)}
_HIGH_BIT = {int(_Q.Q5_0), int(_Q.Q5_1), int(_Q.Q5_K)}


def unpack_k_scales(packed: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """[..., 12] packed bytes -> ([..., 8] scales, [..., 8] mins), as ggml's get_scale_min_k4 reads them."""
    low, mid, high = packed[..., 0:4], packed[..., 4:8], packed[..., 8:12]
    scales = np.concatenate([low & 63, (high & 0xF) | ((low >> 6) << 4)], axis=-1)
    mins = np.concatenate([mid & 63, (high >> 4) | ((mid >> 6) << 4)], axis=-1)
    return scales, mins


def pack_k_scales(scales: np.ndarray, mins: np.ndarray) -> np.ndarray:
    low = scales[..., 0:4] | ((scales[..., 4:8] >> 4) << 6)
    mid = mins[..., 0:4] | ((mins[..., 4:8] >> 4) << 6)
    high = (scales[..., 4:8] & 0xF) | ((mins[..., 4:8] & 0xF) << 4)
    return np.concatenate([low, mid, high], axis=-1)


def _file_parts(ggml_type: int, blocks: np.ndarray) -> tuple[dict[str, np.ndarray], np.ndarray, np.ndarray | None]:
    """[rows, row_bytes] file blocks -> (scale parts, each [rows, blocks, bytes]; the weights' low bits
    [rows, chunks, 32] (Q8_0: the signed bytes plus 128); their high bits or None)."""
    rows = blocks.shape[0]
    nbytes = GGML_QUANT_SIZES[_Q(ggml_type)][1]
    b = blocks.reshape(rows, -1, nbytes)
    nb = b.shape[1]
    if ggml_type in _BLOCKS_OF_32:
        parts = {"d": b[..., 0:2]}
        at = 2
        if ggml_type in _OFFSETS:
            parts["m"] = b[..., 2:4]
            at = 4
        high = None
        if ggml_type in _HIGH_BIT:
            qh = b[..., at:at + 4]
            high = np.unpackbits(qh, axis=-1, bitorder="little")  # bit i: weight i
            at += 4
        if ggml_type == int(_Q.Q8_0):
            return parts, b[..., at:] ^ np.uint8(0x80), None
        qs = b[..., at:]
        return parts, np.concatenate([qs & 0xF, qs >> 4], axis=-1), high
    if ggml_type in (int(_Q.Q4_K), int(_Q.Q5_K)):
        scales, mins = unpack_k_scales(b[..., 4:16])
        parts = {"d": b[..., 0:2], "dmin": b[..., 2:4], "sc": scales, "mn": mins}
        qs = b[..., -128:].reshape(rows, nb, 4, 32)  # chunk pair p: 32 bytes, low nibbles chunk 2p
        low = np.stack([qs & 0xF, qs >> 4], axis=3).reshape(rows, nb * 8, 32)
        high = None
        if ggml_type == int(_Q.Q5_K):
            qh = b[..., 16:48]  # [rows, nb, 32]: bit j of byte i is weight i of chunk j
            high = ((qh[:, :, None, :] >> np.arange(8, dtype=np.uint8)[None, None, :, None]) & 1)
            high = high.reshape(rows, nb * 8, 32)
        return parts, low, high
    # Q6_K: ql[128], qh[64], scales[16], d
    ql = b[..., 0:128].reshape(rows, nb, 2, 2, 32)  # [n][k % 2][32]
    qh = b[..., 128:192].reshape(rows, nb, 2, 32)  # [n][32]
    parts = {"d": b[..., 208:210], "sc": b[..., 192:208]}
    low = np.stack([ql & 0xF, ql >> 4], axis=3).reshape(rows, nb * 8, 32)  # [n][k // 2][k % 2]: chunk 4n + k
    high = (qh[:, :, :, None, :] >> (2 * np.arange(4, dtype=np.uint8))[None, None, None, :, None]) & 3
    return parts, low, high.reshape(rows, nb * 8, 32)


def _to_file(ggml_type: int, parts: dict[str, np.ndarray], low: np.ndarray, high: np.ndarray | None,
             rows: int) -> np.ndarray:
    """The inverse of ``_file_parts``."""
    if ggml_type in _BLOCKS_OF_32:
        nb = low.shape[1]
        pieces = [parts["d"]]
        if ggml_type in _OFFSETS:
            pieces.append(parts["m"])
        if high is not None:
            pieces.append(np.packbits(high, axis=-1, bitorder="little"))
        if ggml_type == int(_Q.Q8_0):
            pieces.append(low ^ np.uint8(0x80))
        else:
            pieces.append(low[..., :16] | (low[..., 16:] << 4))
        return np.concatenate(pieces, axis=-1).reshape(rows, -1)
    nb = low.shape[1] // 8
    if ggml_type in (int(_Q.Q4_K), int(_Q.Q5_K)):
        pairs = low.reshape(rows, nb, 4, 2, 32)
        qs = (pairs[:, :, :, 0] | (pairs[:, :, :, 1] << 4)).reshape(rows, nb, 128)
        pieces = [parts["d"], parts["dmin"], pack_k_scales(parts["sc"], parts["mn"])]
        if high is not None:
            bits = high.reshape(rows, nb, 8, 32) << np.arange(8, dtype=np.uint8)[None, None, :, None]
            pieces.append(np.bitwise_or.reduce(bits, axis=2))
        pieces.append(qs)
        return np.concatenate(pieces, axis=-1).reshape(rows, -1)
    nibbles = low.reshape(rows, nb, 2, 2, 2, 32).transpose(0, 1, 2, 4, 3, 5)  # [n][k % 2][k // 2][32]
    ql = (nibbles[:, :, :, :, 0] | (nibbles[:, :, :, :, 1] << 4)).reshape(rows, nb, 128)
    pairs = high.reshape(rows, nb, 2, 4, 32) << (2 * np.arange(4, dtype=np.uint8))[None, None, None, :, None]
    qh = np.bitwise_or.reduce(pairs, axis=3).reshape(rows, nb, 64)
    return np.concatenate([ql, qh, parts["sc"], parts["d"]], axis=-1).reshape(rows, -1)


# A scale part's sixteen rows side by side: [rows, blocks, per block] -> per group [blocks, ...]. fp16 parts
# keep their two bytes together; byte parts (a K-quant's sub-scales) go row-minor per sub-block.
def _interleave_scales(part: np.ndarray, fp16: bool) -> np.ndarray:
    rows, nb, width = part.shape
    g = part.reshape(rows // GROUP_ROWS, GROUP_ROWS, nb, width)
    order = (0, 2, 1, 3) if fp16 else (0, 2, 3, 1)
    return g.transpose(order).reshape(rows // GROUP_ROWS, -1)


def _deinterleave_scales(plane: np.ndarray, nb: int, width: int, fp16: bool) -> np.ndarray:
    groups = plane.shape[0]
    if fp16:
        g = plane.reshape(groups, nb, GROUP_ROWS, width).transpose(0, 2, 1, 3)
    else:
        g = plane.reshape(groups, nb, width, GROUP_ROWS).transpose(0, 3, 1, 2)
    return g.reshape(groups * GROUP_ROWS, nb, width)


def _rows_side_by_side(a: np.ndarray) -> np.ndarray:
    """[groups, 16 rows, ..., 4 bytes] -> [groups, ..., 16 rows, 4 bytes], moving each row's four bytes as one
    32-bit word (a transpose of bytes is several times slower)."""
    words = np.ascontiguousarray(a).view(np.uint32)[..., 0]  # [groups, 16, ...]
    order = (0, *range(2, words.ndim), 1)
    return np.ascontiguousarray(words.transpose(order)).view(np.uint8).reshape(a.shape[0], -1)


def _interleave_weights(ggml_type: int, low: np.ndarray, high: np.ndarray | None) -> list[np.ndarray]:
    rows, chunks, _ = low.shape
    groups = rows // GROUP_ROWS
    planes = []
    if ggml_type == int(_Q.Q8_0):
        return [_rows_side_by_side(low.reshape(groups, GROUP_ROWS, chunks, 8, 4))]
    if high is not None and ggml_type in _HIGH_BIT:
        bits = _rows_side_by_side(high.reshape(groups, GROUP_ROWS, chunks, 8, 4))  # [g, (c, 8, r, j)]
        planes.append(np.packbits(bits.reshape(groups, chunks, 8, 64), axis=-1, bitorder="little").reshape(groups, -1))
    # Bytes are combined where the rows are still apart (contiguous, fast), then the rows interleaved.
    nib = low.reshape(groups, GROUP_ROWS, chunks, 4, 2, 4)
    planes.append(_rows_side_by_side(nib[:, :, :, :, 0] | (nib[:, :, :, :, 1] << 4)))  # [g, r, c, h, j]
    if ggml_type == int(_Q.Q6_K):
        v = high.reshape(groups, GROUP_ROWS, chunks, 2, 4, 4)  # [g, r, c, h, v, j]
        pairs = v[:, :, :, :, 0] | (v[:, :, :, :, 1] << 2) | (v[:, :, :, :, 2] << 4) | (v[:, :, :, :, 3] << 6)
        planes.append(_rows_side_by_side(pairs))
    return planes


def _deinterleave_weights(ggml_type: int, planes: list[np.ndarray], chunks: int
                          ) -> tuple[np.ndarray, np.ndarray | None]:
    groups = planes[0].shape[0]
    rows = groups * GROUP_ROWS
    if ggml_type == int(_Q.Q8_0):
        q = planes[0].reshape(groups, chunks, 8, GROUP_ROWS, 4).transpose(0, 3, 1, 2, 4)
        return q.reshape(rows, chunks, 32), None
    high = None
    if ggml_type in _HIGH_BIT:
        bits = np.unpackbits(planes.pop(0).reshape(groups, chunks, 8, 8), axis=-1, bitorder="little")
        high = bits.reshape(groups, chunks, 8, GROUP_ROWS, 4).transpose(0, 3, 1, 2, 4).reshape(rows, chunks, 32)
    nib = planes[0].reshape(groups, chunks, 4, GROUP_ROWS, 4)
    low = np.stack([nib & 0xF, nib >> 4], axis=-1)  # [g, c, h, r, j, half]
    low = low.transpose(0, 3, 1, 2, 5, 4).reshape(rows, chunks, 32)
    if ggml_type == int(_Q.Q6_K):
        packed = planes[1].reshape(groups, chunks, 2, GROUP_ROWS, 4)
        pairs = (packed[..., None] >> (2 * np.arange(4, dtype=np.uint8))) & 3  # [g, c, hv, r, j, v]
        high = pairs.transpose(0, 3, 1, 2, 5, 4).reshape(rows, chunks, 32)
    return low, high


# Per format, its scale parts in the group's order: (name, bytes per block, fp16).
_SCALE_PARTS: dict[int, tuple[tuple[str, int, bool], ...]] = {
    int(_Q.Q4_0): (("d", 2, True),), int(_Q.Q5_0): (("d", 2, True),), int(_Q.Q8_0): (("d", 2, True),),
    int(_Q.Q4_1): (("d", 2, True), ("m", 2, True)), int(_Q.Q5_1): (("d", 2, True), ("m", 2, True)),
    int(_Q.Q4_K): (("d", 2, True), ("dmin", 2, True), ("sc", 8, False), ("mn", 8, False)),
    int(_Q.Q5_K): (("d", 2, True), ("dmin", 2, True), ("sc", 8, False), ("mn", 8, False)),
    int(_Q.Q6_K): (("d", 2, True), ("sc", 16, False)),
}


def can_interleave(ggml_type: int, rows: int) -> bool:
    return ggml_type in _SCALE_PARTS and rows > 0 and rows % GROUP_ROWS == 0


# Rows converted at a time: each group is independent, and a large matrix's temporaries (several times its
# size) in one piece made an output projection's conversion ten times slower per byte.
_ROWS_AT_A_TIME = 1024


def to_interleaved(ggml_type: int, blocks: np.ndarray) -> np.ndarray:
    """[rows, row_bytes] of the file's blocks (rows a multiple of 16) -> [rows, held_row_bytes], interleaved."""
    rows = blocks.shape[0]
    assert can_interleave(ggml_type, rows), (ggml_type, rows)
    if rows > _ROWS_AT_A_TIME:
        return np.concatenate([_to_interleaved(ggml_type, blocks[r:r + _ROWS_AT_A_TIME])
                               for r in range(0, rows, _ROWS_AT_A_TIME)])
    return _to_interleaved(ggml_type, blocks)


def _to_interleaved(ggml_type: int, blocks: np.ndarray) -> np.ndarray:
    rows = blocks.shape[0]
    parts, low, high = _file_parts(ggml_type, blocks)
    planes = [_interleave_scales(parts[name], fp16) for name, _, fp16 in _SCALE_PARTS[ggml_type]]
    planes += _interleave_weights(ggml_type, low, high)
    # Block-major: each block's parts side by side, so that a group is read as one stream.
    groups, nb = rows // GROUP_ROWS, low.shape[1] * 32 // GGML_QUANT_SIZES[_Q(ggml_type)][0]
    return np.ascontiguousarray(np.concatenate([p.reshape(groups, nb, -1) for p in planes], axis=2).reshape(rows, -1))


def from_interleaved(ggml_type: int, held: np.ndarray, cols: int) -> np.ndarray:
    """The inverse of ``to_interleaved``: the file's blocks, [rows, row_bytes]."""
    rows = held.shape[0]
    values = GGML_QUANT_SIZES[_Q(ggml_type)][0]
    nb, chunks = cols // values, cols // 32
    groups = rows // GROUP_ROWS
    sizes = [GROUP_ROWS * width for _, width, _ in _SCALE_PARTS[ggml_type]]
    chunk_sizes = {int(_Q.Q8_0): [512]}.get(ggml_type, [256])  # a chunk's bytes in each weight plane
    if ggml_type in _HIGH_BIT:
        chunk_sizes = [64, *chunk_sizes]
    if ggml_type == int(_Q.Q6_K):
        chunk_sizes = [256, 128]
    sizes += [size * (chunks // nb) for size in chunk_sizes]
    block = held.reshape(groups, nb, -1)
    assert block.shape[2] == sum(sizes), (block.shape, sizes)
    pieces = np.split(block, np.cumsum(sizes)[:-1], axis=2)
    parts: dict[str, np.ndarray] = {}
    for (name, width, fp16), piece in zip(_SCALE_PARTS[ggml_type], pieces, strict=False):
        parts[name] = _deinterleave_scales(piece.reshape(groups, -1), nb, width, fp16)
    planes = [piece.reshape(groups, -1) for piece in pieces[len(_SCALE_PARTS[ggml_type]):]]
    low, high = _deinterleave_weights(ggml_type, planes, chunks)
    return _to_file(ggml_type, parts, low, high, rows)
