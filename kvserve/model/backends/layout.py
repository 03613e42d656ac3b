"""The part of a step's attention layout every backend builds alike from the runner's rows: the decode
block tables, split at the blocks all decodes share (cascade attention), and the prefill spans."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvserve.model.backends.base import PrefillSpan, StepRows, WindowLayout
from kvserve.model.host_inputs import to_device


@dataclass(frozen=True, slots=True)
class DecodeSplit:
    """The decode rows' keys, split at the leading blocks they all hold.

        row i's keys:  [ shared_block_ids (read once for every row) | block_table[i], seq_lens[i] keys ]
    """

    shared_block_ids: list[int]  # empty: no split
    block_table: torch.Tensor  # int32 [num_decode_rows, max_blocks]: the blocks after the shared ones, padded with 0
    seq_lens: torch.Tensor  # int32 [num_decode_rows]: keys each row sees after the shared ones


def split_decodes(rows: StepRows, min_shared_tokens: int) -> DecodeSplit | None:
    """The decode rows' tables (on the host), split when their shared blocks hold at least
    ``min_shared_tokens`` keys; None without decode rows."""
    if not rows.num_decode_rows:
        return None
    block_size = rows.block_size
    tables, kv_lens = rows.decode_block_ids, rows.decode_kv_lens
    # Blocks every decode shares (a common system prompt held once by the prefix cache): their KV is read
    # once for the whole batch instead of once per request. Not the rows of one request alone (its drafts):
    # split, their attention would round differently from its plain decode step's, which is not split, and
    # verification would no longer see the logits plain decoding computes.
    num_shared = shared_prefix_blocks(tables, kv_lens, block_size) if (rows.num_decode_requests or 0) > 1 else 0
    if num_shared * block_size < min_shared_tokens:
        num_shared = 0
    return _split_at(rows, num_shared)


def whole_decodes(rows: StepRows) -> DecodeSplit | None:
    """The decode rows' whole tables, nothing split off (for kernels that read every row's own table);
    None without decode rows."""
    return _split_at(rows, 0) if rows.num_decode_rows else None


def _split_at(rows: StepRows, num_shared: int) -> DecodeSplit:
    """The decode rows' tables after their first ``num_shared`` blocks, padded with block 0."""
    block_size, tables, kv_lens = rows.block_size, rows.decode_block_ids, rows.decode_kv_lens
    max_blocks = -(-max(kv_lens) // block_size) - num_shared
    table = [blocks[num_shared : num_shared + max_blocks] for blocks in tables]
    table = [row + [0] * (max_blocks - len(row)) for row in table]
    suffix_lens = torch.tensor(kv_lens, dtype=torch.int32) - num_shared * block_size
    return DecodeSplit(tables[0][:num_shared], torch.tensor(table, dtype=torch.int32), suffix_lens)


def prefill_spans(rows: StepRows, device: torch.device) -> list[PrefillSpan]:
    """One span per prefill chunk; a chunk on cached history carries its block ids."""
    spans = []
    for chunk in rows.prefills:
        if chunk.kv_len == chunk.q_len:  # from position 0
            spans.append(PrefillSpan(chunk.q_start, chunk.q_len, chunk.kv_len))
        else:
            block_ids = to_device(chunk.block_ids, device, torch.long)
            spans.append(PrefillSpan(chunk.q_start, chunk.q_len, chunk.kv_len, block_ids))
    return spans


def shared_prefix_blocks(tables: list[list[int]], kv_lens: list[int], block_size: int) -> int:
    """Leading blocks all rows (decode rows, or prefill chunks) hold in common (the same physical blocks),
    full in every one of them."""
    if len(tables) < 2:
        return 0
    limit = min(kv_len // block_size for kv_len in kv_lens)
    first = tables[0]
    n = 0
    while n < limit and all(table is first or table[n] == first[n] for table in tables):
        n += 1
    return n


def window_layout(rows: StepRows, window: int, device: torch.device) -> WindowLayout | None:
    """What a sliding-window layer reads this step, or None when no row holds more than ``window`` keys (the
    window then hides nothing and the layer runs like any other)."""
    if not window:
        return None
    longest = max([*rows.decode_kv_lens, *(chunk.kv_len for chunk in rows.prefills)], default=0)
    if longest <= window:
        return None
    if not rows.num_decode_rows:
        return WindowLayout(window, None, None)
    # A decode row's query is at position kv_len - 1 and sees keys kv_len - window .. kv_len - 1: its table
    # starts at the block holding the first of them.
    block_size = rows.block_size
    starts = [max(0, kv_len - window) // block_size for kv_len in rows.decode_kv_lens]
    tables = [blocks[start : -(-kv_len // block_size)]
              for blocks, kv_len, start in zip(rows.decode_block_ids, rows.decode_kv_lens, starts, strict=True)]
    width = max(len(table) for table in tables)
    table = torch.tensor([row + [0] * (width - len(row)) for row in tables], dtype=torch.long)
    kv_lens = torch.tensor(rows.decode_kv_lens)[:, None]
    keys = torch.arange(width * block_size)[None, :] + torch.tensor(starts)[:, None] * block_size
    mask = ((keys < kv_lens) & (keys >= kv_lens - window))[:, None, None, :]
    return WindowLayout(window, to_device(table, device), to_device(mask, device))
