"""Paged attention in Triton, for the CUDA backend: decode rows and prefill chunks read their keys in place
from the block tables (no gather copy), as the CPU kernels do.

- **KV write** (``write_kv``): each new token's K/V row into its slot; a negative slot is a padding row
  (a CUDA graph's batch padded to its captured size) and writes nothing.
- **Decode** (``paged_decode``): one program per (sequence, KV head, key split) takes the KV head's query
  heads together (grouped-query attention reads each key once for all of them), an online softmax over
  the split's blocks; a second kernel merges a sequence's splits by log-sum-exp, reading only the splits
  its keys reach, so that a few long sequences still fill the GPU (split-KV) and a block table padded wider
  than the step needs (a CUDA graph's) costs little. With one split the first kernel writes the output.
- **Prefill** (``paged_prefill``): one program per (chunk, tile of query rows, query head), causal over the
  chunk's history and itself; the chunk's own keys are in the cache already (written before attention).
- **Cascade decode** (``paged_decode`` with a ``SharedPrefix``): when the decode rows share leading blocks
  (a common system prompt held once by the prefix cache), one program per (KV head, tile of query rows, key
  split) reads each shared block once for a tile of every row's query heads (a matrix product, not one
  matrix-vector product per row); the rows' own blocks after it run the decode kernel above, and the merge
  takes both kinds of partial results. The prefix's length is read on the device, so a CUDA graph holds
  every prefix up to its buffer's width (no prefix: its programs exit at once).

Under ``TRITON_INTERPRET=1`` the same kernels run on CPU tensors (Triton's interpreter), which is how the
tests check them without a GPU; there the tiles are widened to float32 before their products (the
interpreter's bf16 products are wrong). On a GPU bf16 tiles multiply as they are, with float32 sums, and
the softmax's weights are rounded to the values' dtype before the second product, as FlashAttention does.
Both take a sliding window (a layer's last ``window`` keys; the blocks before them are not read); a window
layer never takes a shared prefix.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kvserve.model.attention import TorchAttentionMetadata, TorchPagedAttention

# Keys per decode work item: long enough to amortise a program's start, short enough that one long
# sequence still spreads over the GPU.
DECODE_SPLIT_BLOCKS = 16
PREFILL_TILE_ROWS = 16
# Keys per shared-prefix work item: several rows' queries share each program, so a split can be long.
PREFIX_SPLIT_BLOCKS = 32
MAX_PREFIX_TILE_ROWS = 64  # query rows (requests x query heads of a KV head) per shared-prefix program
MIN_DOT = 16  # tl.dot's smallest operand dimension on a GPU


# Whether the kernels below are Triton's interpreter's (decided as they are decorated, at import).
INTERPRETED = os.environ.get("TRITON_INTERPRET", "0") == "1"


@triton.jit
def _dot(a, b, FP32: tl.constexpr):
    # float32 tiles multiply in full precision (a GPU's default for them is TF32, 10-bit mantissas).
    if FP32:
        return tl.dot(a, b, input_precision="ieee")
    return tl.dot(a, b)


@triton.jit
def _online_softmax_step(q, k, v, visible, scale, m_i, l_i, acc, UPCAST: tl.constexpr):
    """One block of keys k, values v (rows of the block) into the query rows' running max m_i, sum l_i and
    output acc; ``visible`` masks the scores."""
    if UPCAST:
        k = k.to(tl.float32)
        v = v.to(tl.float32)
    scores = tl.where(visible, _dot(q, tl.trans(k), UPCAST) * scale, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(scores, 1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row that has seen no key yet (a window's edge)
    alpha = tl.exp(m_i - m_safe)
    p = tl.exp(scores - m_safe[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + _dot(p.to(v.dtype), v, UPCAST)
    return m_new, l_i, acc


@triton.jit
def _write_kv_kernel(k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, slots_ptr, stride_k, stride_v,
                     ROW: tl.constexpr, ROW_PAD: tl.constexpr):
    token = tl.program_id(0)
    slot = tl.load(slots_ptr + token)
    if slot < 0:  # a padding row
        return
    i = tl.arange(0, ROW_PAD)
    inside = i < ROW
    at = slot.to(tl.int64) * ROW + i
    tl.store(k_cache_ptr + at, tl.load(k_ptr + token * stride_k + i, mask=inside), mask=inside)
    tl.store(v_cache_ptr + at, tl.load(v_ptr + token * stride_v + i, mask=inside), mask=inside)


@triton.jit
def _first_block(seq_len, window, BLOCK_SIZE: tl.constexpr):
    """The first key a decode row sees (window 0: none hidden) and the block that holds it."""
    first_key = tl.where(window > 0, tl.maximum(seq_len - window, 0), 0)
    return first_key, first_key // BLOCK_SIZE


@triton.jit
def _decode_kernel(q_ptr, k_ptr, v_ptr, table_ptr, lens_ptr, acc_ptr, m_ptr, l_ptr, out_ptr, scale, max_blocks,
                   split_blocks, window, stride_block, stride_token,
                   NUM_KV_HEADS: tl.constexpr, GROUP: tl.constexpr, GROUP_PAD: tl.constexpr,
                   HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr, NUM_SPLITS: tl.constexpr,
                   PREFIX_SLOTS: tl.constexpr, UPCAST: tl.constexpr):
    """A row's own keys, split by split_blocks; its partial results at slots PREFIX_SLOTS... of NUM_SPLITS
    (the ones before are the shared prefix's), or with one slot in all its output."""
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(lens_ptr + seq)
    first_key, first_block = _first_block(seq_len, window, BLOCK_SIZE)
    first = first_block + split * split_blocks  # splits count from the window's first block
    last = tl.minimum(first + split_blocks, tl.cdiv(seq_len, BLOCK_SIZE))
    if (split > 0) & (first >= last):  # past the sequence's keys: the merge does not read this split
        return
    g = tl.arange(0, GROUP_PAD)
    d = tl.arange(0, HEAD_DIM)
    t = tl.arange(0, BLOCK_SIZE)
    q = tl.load(q_ptr + ((seq * NUM_KV_HEADS + kv_head) * GROUP + g[:, None]) * HEAD_DIM + d[None, :],
                mask=g[:, None] < GROUP, other=0.0)
    if UPCAST:
        q = q.to(tl.float32)
    m_i = tl.full([GROUP_PAD], float("-inf"), tl.float32)
    l_i = tl.zeros([GROUP_PAD], tl.float32)
    acc = tl.zeros([GROUP_PAD, HEAD_DIM], tl.float32)
    for j in range(first, last):
        block = tl.load(table_ptr + seq * max_blocks + j).to(tl.int64)
        offsets = block * stride_block + t[:, None] * stride_token + kv_head * HEAD_DIM + d[None, :]
        key = j * BLOCK_SIZE + t
        visible = ((key < seq_len) & (key >= first_key))[None, :]
        m_i, l_i, acc = _online_softmax_step(q, tl.load(k_ptr + offsets), tl.load(v_ptr + offsets), visible,
                                             scale, m_i, l_i, acc, UPCAST)
    if NUM_SPLITS == 1:
        _store_heads(out_ptr, seq, kv_head, acc / l_i[:, None], g, d, NUM_KV_HEADS, GROUP, HEAD_DIM)
    else:
        part = (seq * NUM_KV_HEADS + kv_head) * NUM_SPLITS + PREFIX_SLOTS + split
        tl.store(acc_ptr + (part * GROUP_PAD + g[:, None]) * HEAD_DIM + d[None, :], acc)
        tl.store(m_ptr + part * GROUP_PAD + g, m_i)
        tl.store(l_ptr + part * GROUP_PAD + g, l_i)


@triton.jit
def _prefix_kernel(q_ptr, k_ptr, v_ptr, prefix_ptr, num_prefix_ptr, acc_ptr, m_ptr, l_ptr, scale, batch,
                   split_blocks, stride_block, stride_token,
                   NUM_KV_HEADS: tl.constexpr, GROUP: tl.constexpr, GROUP_PAD: tl.constexpr,
                   HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr, NUM_SPLITS: tl.constexpr,
                   TILE_ROWS: tl.constexpr, UPCAST: tl.constexpr):
    """A split of the shared prefix's blocks (all full, all visible to every row) for a tile of query rows:
    row r is request r // GROUP's query head r % GROUP of this KV head. Partial results at slot ``split``."""
    kv_head = tl.program_id(0)
    tile = tl.program_id(1)
    split = tl.program_id(2)
    first = split * split_blocks
    last = tl.minimum(first + split_blocks, tl.load(num_prefix_ptr))
    if first >= last:  # past the prefix (or no prefix this step): the merge does not read this slot
        return
    r = tile * TILE_ROWS + tl.arange(0, TILE_ROWS)
    seq = r // GROUP
    g = r % GROUP
    row_ok = seq < batch
    d = tl.arange(0, HEAD_DIM)
    t = tl.arange(0, BLOCK_SIZE)
    q = tl.load(q_ptr + ((seq * NUM_KV_HEADS + kv_head) * GROUP + g)[:, None] * HEAD_DIM + d[None, :],
                mask=row_ok[:, None], other=0.0)
    if UPCAST:
        q = q.to(tl.float32)
    m_i = tl.full([TILE_ROWS], float("-inf"), tl.float32)
    l_i = tl.zeros([TILE_ROWS], tl.float32)
    acc = tl.zeros([TILE_ROWS, HEAD_DIM], tl.float32)
    visible = (t < BLOCK_SIZE)[None, :]
    for j in range(first, last):
        block = tl.load(prefix_ptr + j).to(tl.int64)
        offsets = block * stride_block + t[:, None] * stride_token + kv_head * HEAD_DIM + d[None, :]
        m_i, l_i, acc = _online_softmax_step(q, tl.load(k_ptr + offsets), tl.load(v_ptr + offsets), visible,
                                             scale, m_i, l_i, acc, UPCAST)
    part = (seq * NUM_KV_HEADS + kv_head) * NUM_SPLITS + split
    tl.store(acc_ptr + (part * GROUP_PAD + g)[:, None] * HEAD_DIM + d[None, :], acc, mask=row_ok[:, None])
    tl.store(m_ptr + part * GROUP_PAD + g, m_i, mask=row_ok)
    tl.store(l_ptr + part * GROUP_PAD + g, l_i, mask=row_ok)


@triton.jit
def _store_heads(out_ptr, seq, kv_head, out, g, d, NUM_KV_HEADS: tl.constexpr, GROUP: tl.constexpr,
                 HEAD_DIM: tl.constexpr):
    """A KV head's query heads' outputs (rows g, padded past GROUP) into out [B, num_heads, D]."""
    tl.store(out_ptr + ((seq * NUM_KV_HEADS + kv_head) * GROUP + g[:, None]) * HEAD_DIM + d[None, :],
             out.to(out_ptr.dtype.element_ty), mask=g[:, None] < GROUP)


@triton.jit
def _merge_kernel(acc_ptr, m_ptr, l_ptr, lens_ptr, num_prefix_ptr, out_ptr, split_blocks, prefix_split_blocks,
                  window, NUM_KV_HEADS: tl.constexpr, GROUP: tl.constexpr, GROUP_PAD: tl.constexpr,
                  HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr, NUM_SPLITS: tl.constexpr,
                  PREFIX_SLOTS: tl.constexpr):
    """A sequence's slots that hold keys (the shared prefix's splits, then its own blocks' splits), merged
    by log-sum-exp."""
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    seq_len = tl.load(lens_ptr + seq)
    _, first_block = _first_block(seq_len, window, BLOCK_SIZE)
    num_own = tl.maximum(1, tl.cdiv(tl.cdiv(seq_len, BLOCK_SIZE) - first_block, split_blocks))
    num_prefix = 0
    if PREFIX_SLOTS > 0:
        num_prefix = tl.cdiv(tl.load(num_prefix_ptr), prefix_split_blocks)
    g = tl.arange(0, GROUP_PAD)
    d = tl.arange(0, HEAD_DIM)
    head = g < GROUP  # the rows past a KV head's query heads are padding (the prefix's slots leave them unset)
    first_part = (seq * NUM_KV_HEADS + kv_head) * NUM_SPLITS
    top = tl.full([GROUP_PAD], float("-inf"), tl.float32)
    for s in range(0, num_prefix):
        top = tl.maximum(top, tl.load(m_ptr + (first_part + s) * GROUP_PAD + g, mask=head, other=float("-inf")))
    for s in range(0, num_own):
        top = tl.maximum(top, tl.load(m_ptr + (first_part + PREFIX_SLOTS + s) * GROUP_PAD + g, mask=head,
                                      other=float("-inf")))
    top = tl.where(head, top, 0.0)
    total = tl.zeros([GROUP_PAD], tl.float32)
    out = tl.zeros([GROUP_PAD, HEAD_DIM], tl.float32)
    for s in range(0, num_prefix):
        total, out = _merge_part(acc_ptr, m_ptr, l_ptr, first_part + s, top, total, out, g, d, head, GROUP_PAD,
                                 HEAD_DIM)
    for s in range(0, num_own):
        total, out = _merge_part(acc_ptr, m_ptr, l_ptr, first_part + PREFIX_SLOTS + s, top, total, out, g, d,
                                 head, GROUP_PAD, HEAD_DIM)
    _store_heads(out_ptr, seq, kv_head, out / tl.where(head, total, 1.0)[:, None], g, d, NUM_KV_HEADS, GROUP,
                 HEAD_DIM)


@triton.jit
def _merge_part(acc_ptr, m_ptr, l_ptr, part, top, total, out, g, d, head, GROUP_PAD: tl.constexpr,
                HEAD_DIM: tl.constexpr):
    """One slot's partial results into the running total and output, scaled to the common maximum."""
    m = tl.load(m_ptr + part * GROUP_PAD + g, mask=head, other=float("-inf"))
    weight = tl.exp(m - top)  # 0 for a slot that saw no key, and for padding rows
    total += tl.load(l_ptr + part * GROUP_PAD + g, mask=head, other=0.0) * weight
    out += tl.load(acc_ptr + (part * GROUP_PAD + g[:, None]) * HEAD_DIM + d[None, :], mask=head[:, None],
                   other=0.0) * weight[:, None]
    return total, out


@triton.jit
def _prefill_kernel(q_ptr, k_ptr, v_ptr, o_ptr, table_ptr, q_starts_ptr, q_lens_ptr, kv_lens_ptr, scale,
                    max_blocks, window, stride_block, stride_token, stride_q, stride_o,
                    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr,
                    TILE_ROWS: tl.constexpr, UPCAST: tl.constexpr):
    chunk = tl.program_id(0)
    tile = tl.program_id(1)
    head = tl.program_id(2)
    q_len = tl.load(q_lens_ptr + chunk)
    if tile * TILE_ROWS >= q_len:
        return
    q_start = tl.load(q_starts_ptr + chunk)
    kv_len = tl.load(kv_lens_ptr + chunk)
    kv_head = head // GROUP
    rows = tile * TILE_ROWS + tl.arange(0, TILE_ROWS)
    d = tl.arange(0, HEAD_DIM)
    t = tl.arange(0, BLOCK_SIZE)
    row_ok = rows < q_len
    q = tl.load(q_ptr + (q_start + rows)[:, None] * stride_q + head * HEAD_DIM + d[None, :],
                mask=row_ok[:, None], other=0.0)
    if UPCAST:
        q = q.to(tl.float32)
    positions = kv_len - q_len + rows  # each query row's own key position
    m_i = tl.full([TILE_ROWS], float("-inf"), tl.float32)
    l_i = tl.zeros([TILE_ROWS], tl.float32)
    acc = tl.zeros([TILE_ROWS, HEAD_DIM], tl.float32)
    keys_seen = tl.minimum(kv_len, kv_len - q_len + (tile + 1) * TILE_ROWS)  # by the tile's last row
    # A window hides the keys more than ``window`` behind a row: from the tile's first row's first key.
    first_key = tl.where(window > 0, tl.maximum(kv_len - q_len + tile * TILE_ROWS - window + 1, 0), 0)
    for j in range(first_key // BLOCK_SIZE, tl.cdiv(keys_seen, BLOCK_SIZE)):
        block = tl.load(table_ptr + chunk * max_blocks + j).to(tl.int64)
        offsets = block * stride_block + t[:, None] * stride_token + kv_head * HEAD_DIM + d[None, :]
        key_positions = j * BLOCK_SIZE + t
        visible = (key_positions[None, :] <= positions[:, None]) & (key_positions[None, :] < kv_len)
        visible = visible & ((window == 0) | (key_positions[None, :] > positions[:, None] - window))
        m_i, l_i, acc = _online_softmax_step(q, tl.load(k_ptr + offsets), tl.load(v_ptr + offsets), visible,
                                             scale, m_i, l_i, acc, UPCAST)
    out = acc / tl.where(l_i == 0, 1.0, l_i)[:, None]  # rows past the chunk saw nothing (and are not stored)
    tl.store(o_ptr + (q_start + rows)[:, None] * stride_o + head * HEAD_DIM + d[None, :],
             out.to(o_ptr.dtype.element_ty), mask=row_ok[:, None])


def write_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """k, v [num_tokens, H_kv, D] into caches [num_blocks, block_size, H_kv, D] (contiguous) at slot_mapping
    [num_tokens]; a negative slot writes nothing."""
    k, v = _rows_contiguous(k), _rows_contiguous(v)
    row = k.shape[1] * k.shape[2]
    _write_kv_kernel[(k.shape[0],)](k, v, k_cache, v_cache, slot_mapping, k.stride(0), v.stride(0),
                                    ROW=row, ROW_PAD=triton.next_power_of_2(row))


def _rows_contiguous(x: torch.Tensor) -> torch.Tensor:
    """x [T, H, D] with each row's H * D values contiguous (any row stride)."""
    return x if x.stride(2) == 1 and x.stride(1) == x.shape[2] else x.contiguous()


@dataclass(frozen=True, slots=True)
class SharedPrefix:
    """Leading blocks every decode row of a step holds (full, the same physical blocks), on the device."""

    block_ids: torch.Tensor  # int32 [capacity]: the first num_blocks are the prefix's
    num_blocks: torch.Tensor  # int32 [1]


def paged_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_table: torch.Tensor,
                 seq_lens: torch.Tensor, scale: float, window: int = 0,
                 prefix: SharedPrefix | None = None) -> torch.Tensor:
    """q [B, num_heads, D] (a KV head's query heads adjacent); caches [num_blocks, block_size, H_kv, D];
    block_table int32 [B, max_blocks]; seq_lens int32 [B]; ``window``: each row sees its last ``window`` keys
    only (0: all of them; the blocks before them are not read). With a ``prefix``, every row's keys are the
    prefix's blocks and then its own table's seq_lens keys (none, possibly); without one, seq_lens are at
    least 1. Returns [B, num_heads, D] in q's dtype. Nothing here reads a device value on the host: a CUDA
    graph can hold it."""
    assert prefix is None or not window, "a window layer takes no shared prefix"
    batch, num_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    group = num_heads // num_kv_heads
    group_pad = max(MIN_DOT, triton.next_power_of_2(group))
    max_blocks = block_table.shape[1]
    prefix_slots = 0 if prefix is None else triton.cdiv(prefix.block_ids.shape[0], PREFIX_SPLIT_BLOCKS)
    own_splits = max(1, triton.cdiv(max_blocks, DECODE_SPLIT_BLOCKS))
    num_splits = prefix_slots + own_splits
    parts = (batch, num_kv_heads, num_splits, group_pad)
    acc = torch.empty((*parts, head_dim), dtype=torch.float32, device=q.device)
    m = torch.empty(parts, dtype=torch.float32, device=q.device)
    l = torch.empty(parts, dtype=torch.float32, device=q.device)  # noqa: E741
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    q = q.contiguous()
    upcast = INTERPRETED or q.dtype == torch.float32
    shape = dict(NUM_KV_HEADS=num_kv_heads, GROUP=group, GROUP_PAD=group_pad, HEAD_DIM=head_dim,
                 BLOCK_SIZE=block_size, NUM_SPLITS=num_splits)
    if prefix is not None and prefix_slots:
        tile_rows = min(MAX_PREFIX_TILE_ROWS, max(MIN_DOT, triton.next_power_of_2(batch * group)))
        _prefix_kernel[(num_kv_heads, triton.cdiv(batch * group, tile_rows), prefix_slots)](
            q, k_cache, v_cache, prefix.block_ids, prefix.num_blocks, acc, m, l, scale, batch,
            PREFIX_SPLIT_BLOCKS, k_cache.stride(0), k_cache.stride(1), **shape, TILE_ROWS=tile_rows,
            UPCAST=upcast,
        )
    _decode_kernel[(batch, num_kv_heads, own_splits)](
        q, k_cache, v_cache, block_table, seq_lens, acc, m, l, out, scale, max_blocks,
        DECODE_SPLIT_BLOCKS, window, k_cache.stride(0), k_cache.stride(1), **shape, PREFIX_SLOTS=prefix_slots,
        UPCAST=upcast,
    )
    if num_splits > 1:
        num_prefix = seq_lens if prefix is None else prefix.num_blocks  # read only with prefix slots
        _merge_kernel[(batch, num_kv_heads)](acc, m, l, seq_lens, num_prefix, out, DECODE_SPLIT_BLOCKS,
                                             PREFIX_SPLIT_BLOCKS, window, **shape, PREFIX_SLOTS=prefix_slots)
    return out


def paged_prefill(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, out: torch.Tensor,
                  spans: PrefillTables, scale: float, window: int = 0) -> None:
    """Every prefill chunk's rows of q [num_tokens, num_heads, D] attend causally to their keys (all in the
    cache); the outputs land in the same rows of ``out`` (q's shape). Each row's heads contiguous in both;
    their row strides may differ (q is a view of the QKV projection's output). ``window``: each row sees
    its last ``window`` keys only (0: all)."""
    q = _rows_contiguous(q)
    _, num_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    grid = (spans.q_starts.shape[0], triton.cdiv(spans.max_q_len, PREFILL_TILE_ROWS), num_heads)
    _prefill_kernel[grid](
        q, k_cache, v_cache, out, spans.block_table, spans.q_starts, spans.q_lens, spans.kv_lens, scale,
        spans.block_table.shape[1], window, k_cache.stride(0), k_cache.stride(1), q.stride(0), out.stride(0),
        GROUP=num_heads // num_kv_heads, HEAD_DIM=head_dim, BLOCK_SIZE=block_size, TILE_ROWS=PREFILL_TILE_ROWS,
        UPCAST=INTERPRETED or q.dtype == torch.float32,
    )


@dataclass(frozen=True, slots=True)
class PrefillTables:
    """A step's prefill chunks as the prefill kernel reads them, on the device."""

    q_starts: torch.Tensor  # int32 [num_chunks]: each chunk's first row in the step
    q_lens: torch.Tensor  # int32 [num_chunks]
    kv_lens: torch.Tensor  # int32 [num_chunks]: keys 0..kv_len-1, the chunk's own last
    block_table: torch.Tensor  # int32 [num_chunks, max_blocks], padded with block 0
    max_q_len: int


@dataclass
class TritonAttentionMetadata(TorchAttentionMetadata):
    """The reference layout, plus the prefill chunks' tables for the Triton kernel and the decode rows' shared
    prefix (their tables then start after it)."""

    prefill_tables: PrefillTables | None = None
    decode_shared_prefix: SharedPrefix | None = None


class TritonPagedAttention(TorchPagedAttention):
    """The reference attention with its KV write, decode (cascade decode included) and prefill on the Triton
    kernels, a sliding-window layer's window applied by them; the reference's own layouts and head sizes the
    tiles cannot take stay on the reference paths."""

    def write_kv(self, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 slot_mapping: torch.Tensor) -> None:
        write_kv(k, v, k_cache, v_cache, slot_mapping)

    def _decode(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                meta: TorchAttentionMetadata) -> torch.Tensor:
        if meta.decode_prefix_blocks is not None or head_size_unsupported(self.head_dim):
            return super()._decode(q, k_cache, v_cache, meta)
        assert meta.decode_block_table is not None and meta.decode_seq_lens is not None
        return paged_decode(q, k_cache, v_cache, meta.decode_block_table, meta.decode_seq_lens, self.scale,
                            self.sliding_window or 0, getattr(meta, "decode_shared_prefix", None))

    def _prefill(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                 v_cache: torch.Tensor, meta: TorchAttentionMetadata) -> torch.Tensor:
        tables = getattr(meta, "prefill_tables", None)
        if tables is None or head_size_unsupported(self.head_dim):
            return super()._prefill(q, k, v, k_cache, v_cache, meta)
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        paged_prefill(q, k_cache, v_cache, out, tables, self.scale, self.sliding_window or 0)
        return out[meta.num_decode_tokens :]


def head_size_unsupported(head_dim: int) -> bool:
    """The kernels' tiles take power-of-two head sizes of at least 16."""
    return head_dim < MIN_DOT or head_dim & (head_dim - 1) != 0
