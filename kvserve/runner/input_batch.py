"""Turns a SchedulerOutput into the tensors one forward needs: ids, positions, slots, attention layout.

Token order in the batch:   [ d0 d1 ... d(B-1) | prefill a (q_len_a) | prefill b | ... ]
where the d's are single-token queries (decodes, or one-token prefill chunks), batched in one attention
call; every prefill chunk gets its own span. A decode with speculative drafts takes one d row per token
(its last token, then each draft, at consecutive positions), each row seeing the keys up to its own
position. ``sample_rows`` lists the rows whose logits are sampled: per request of ``sample_request_ids``,
in order, 1 + len(its drafts) rows.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvserve.batch import ScheduledRequest, SchedulerOutput
from kvserve.model.attention import AttentionMetadata, PagedRuns, PrefillSpan
from kvserve.runner.block_versions import BlockVersions

# The AMX attention kernel takes keys in steps of 32: a shared prefix it keeps packed is a whole number of them.
PREFIX_KEY_STEP = 32


@dataclass(slots=True)
class ModelInputs:
    input_ids: torch.Tensor  # [num_tokens]
    positions: torch.Tensor  # [num_tokens]
    attn: AttentionMetadata
    sample_rows: torch.Tensor  # [num_sample_rows]
    sample_request_ids: list[str]
    sample_drafts: list[list[int]]  # per sampled request: the drafts its rows after the first verify


def build_inputs(
    out: SchedulerOutput, block_size: int, device: torch.device, cascade_min_tokens: int = 256,
    block_versions: BlockVersions | None = None, shared_prefill_min_tokens: int = 256,
) -> ModelInputs:
    singles = [s for s in out.scheduled if len(s.token_ids) == 1]
    chunks = [s for s in out.scheduled if len(s.token_ids) > 1]

    input_ids: list[int] = []
    positions: list[int] = []
    slots: list[int] = []
    sample_rows: list[int] = []
    sample_ids: list[str] = []
    sample_drafts: list[list[int]] = []

    row_tables: list[list[int]] = []  # per decode row: its request's block table
    kv_lens: list[int] = []  # per decode row: keys it sees (its own position + 1)
    for s in singles:
        tokens = s.token_ids + s.draft_token_ids if s.draft_token_ids else s.token_ids
        first_row = len(input_ids)
        for pos, token_id in enumerate(tokens, s.start_position):
            input_ids.append(token_id)
            positions.append(pos)
            slots.append(s.block_ids[pos // block_size] * block_size + pos % block_size)
            row_tables.append(s.block_ids)
            kv_lens.append(pos + 1)
        if s.sample:
            sample_rows.extend(range(first_row, len(input_ids)))
            sample_ids.append(s.request_id)
            sample_drafts.append(s.draft_token_ids)

    num_decode_rows = len(input_ids)
    decode_block_table = decode_mask = decode_prefix_blocks = suffix_lens = None
    decode_prefix_runs: PagedRuns | None = None
    decode_prefix_key: tuple[int, ...] | None = None
    if singles:
        # Blocks every decode shares (a common system prompt held once by the prefix cache): their KV is read
        # once for the whole batch instead of once per request.
        num_shared = _shared_prefix_blocks(row_tables, kv_lens, block_size)
        if num_shared * block_size < cascade_min_tokens:
            num_shared = 0
        else:
            shared = row_tables[0][:num_shared]
            decode_prefix_blocks = torch.tensor(shared, dtype=torch.long)
            decode_prefix_runs = _paged_runs([shared], [num_shared * block_size], [num_decode_rows], device)
            if block_versions is not None:
                decode_prefix_key = block_versions.key(shared)
        max_blocks = -(-max(kv_lens) // block_size) - num_shared
        table = [blocks[num_shared : num_shared + max_blocks] for blocks in row_tables]
        table = [row + [0] * (max_blocks - len(row)) for row in table]
        decode_block_table = torch.tensor(table, dtype=torch.int32)
        key_positions = torch.arange(max_blocks * block_size)
        suffix_lens = torch.tensor(kv_lens, dtype=torch.int32) - num_shared * block_size
        # [num_decodes, 1, 1, max_blocks * block_size]: True where the key exists
        decode_mask = (key_positions[None, :] < suffix_lens[:, None])[:, None, None, :]

    spans: list[PrefillSpan] = []
    run_tables: list[list[int]] = []
    q_start = num_decode_rows
    for s in chunks:
        assert not s.draft_token_ids, "drafts ride on decodes only"
        q_len = len(s.token_ids)
        start = s.start_position
        kv_len = start + q_len
        input_ids.extend(s.token_ids)
        positions.extend(range(start, kv_len))
        slots.extend(_chunk_slots(s, block_size))
        blocks = s.block_ids[: -(-kv_len // block_size)]
        run_tables.append(blocks)
        if start == 0:
            spans.append(PrefillSpan(q_start, q_len, kv_len))
        else:
            spans.append(PrefillSpan(q_start, q_len, kv_len, torch.tensor(blocks)))
        if s.sample:
            sample_rows.append(q_start + q_len - 1)
            sample_ids.append(s.request_id)
            sample_drafts.append([])
        q_start += q_len

    def dev(t: torch.Tensor | None) -> torch.Tensor | None:
        return None if t is None else t.to(device, non_blocking=True)

    for span in spans:
        span.block_ids = dev(span.block_ids)
    prefill_runs = None
    prefill_prefix_keys, prefill_prefix_table, prefill_prefix_key = 0, None, None
    if spans:
        prefill_runs = _paged_runs(run_tables, [span.kv_len for span in spans], [span.q_len for span in spans],
                                   device)
        # Keys every chunk holds in the same blocks, in whole 32-key steps of the AMX kernel: packed once per
        # layer and kept while the blocks are unchanged, instead of once per chunk and head every step.
        shared_blocks = _shared_prefix_blocks(run_tables, [span.kv_len for span in spans], block_size)
        shared_keys = shared_blocks * block_size // PREFIX_KEY_STEP * PREFIX_KEY_STEP
        if shared_keys >= shared_prefill_min_tokens and block_versions is not None:
            shared = run_tables[0][: -(-shared_keys // block_size)]
            prefill_prefix_keys = shared_keys
            prefill_prefix_table = torch.tensor(shared, dtype=torch.int32, device=device)
            prefill_prefix_key = (shared_keys, *block_versions.key(shared))
    attn = AttentionMetadata(
        slot_mapping=torch.tensor(slots, dtype=torch.long, device=device),
        num_decode_tokens=num_decode_rows,
        decode_block_table=dev(decode_block_table),
        decode_mask=dev(decode_mask),
        decode_seq_lens=dev(suffix_lens),
        decode_prefix_blocks=dev(decode_prefix_blocks),
        prefills=spans,
        prefill_runs=prefill_runs,
        decode_prefix_runs=decode_prefix_runs,
        decode_prefix_key=decode_prefix_key,
        prefill_prefix_keys=prefill_prefix_keys,
        prefill_prefix_table=prefill_prefix_table,
        prefill_prefix_key=prefill_prefix_key,
    )
    return ModelInputs(
        input_ids=torch.tensor(input_ids, dtype=torch.long, device=device),
        positions=torch.tensor(positions, dtype=torch.long, device=device),
        attn=attn,
        sample_rows=torch.tensor(sample_rows, dtype=torch.long, device=device),
        sample_request_ids=sample_ids,
        sample_drafts=sample_drafts,
    )


def _paged_runs(tables: list[list[int]], kv_lens: list[int], q_lens: list[int], device: torch.device) -> PagedRuns:
    width = max(len(table) for table in tables)
    q_starts = [0]
    for q_len in q_lens:
        q_starts.append(q_starts[-1] + q_len)
    tensors = (torch.tensor([table + [0] * (width - len(table)) for table in tables], dtype=torch.int32),
               torch.tensor(kv_lens, dtype=torch.int32), torch.tensor(q_starts, dtype=torch.int32))
    return PagedRuns(*(t.to(device, non_blocking=True) for t in tensors))


def _shared_prefix_blocks(tables: list[list[int]], kv_lens: list[int], block_size: int) -> int:
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


def _chunk_slots(s: ScheduledRequest, block_size: int) -> list[int]:
    """Slots of positions start..start+len-1, one block-aligned run at a time (no per-token divisions)."""
    slots: list[int] = []
    pos, end = s.start_position, s.start_position + len(s.token_ids)
    while pos < end:
        block, offset = divmod(pos, block_size)
        run = min(block_size - offset, end - pos)
        base = s.block_ids[block] * block_size + offset
        slots.extend(range(base, base + run))
        pos += run
    return slots
