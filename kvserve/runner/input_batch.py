"""Turns a SchedulerOutput into the tensors one forward needs: ids, positions, slots, attention layout.

Token order in the batch:   [ d0 d1 ... d(B-1) | prefill a (q_len_a) | prefill b | ... ]
where the d's are single-token queries (decodes, or one-token prefill chunks), batched in one attention
call; every prefill chunk gets its own span. ``sample_rows[i]`` is the hidden-state row whose logits
sample the next token of ``sample_request_ids[i]``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvserve.batch import ScheduledRequest, SchedulerOutput
from kvserve.model.attention import AttentionMetadata, PagedRuns, PrefillSpan
from kvserve.runner.block_versions import BlockVersions


@dataclass(slots=True)
class ModelInputs:
    input_ids: torch.Tensor  # [num_tokens]
    positions: torch.Tensor  # [num_tokens]
    attn: AttentionMetadata
    sample_rows: torch.Tensor  # [num_samples]
    sample_request_ids: list[str]


def build_inputs(
    out: SchedulerOutput, block_size: int, device: torch.device, cascade_min_tokens: int = 256,
    block_versions: BlockVersions | None = None,
) -> ModelInputs:
    singles = [s for s in out.scheduled if len(s.token_ids) == 1]
    chunks = [s for s in out.scheduled if len(s.token_ids) > 1]

    input_ids: list[int] = []
    positions: list[int] = []
    slots: list[int] = []
    sample_rows: list[int] = []
    sample_ids: list[str] = []

    for row, s in enumerate(singles):
        pos = s.start_position
        input_ids.append(s.token_ids[0])
        positions.append(pos)
        slots.append(s.block_ids[pos // block_size] * block_size + pos % block_size)
        if s.sample:
            sample_rows.append(row)
            sample_ids.append(s.request_id)

    decode_block_table = decode_mask = decode_prefix_blocks = suffix_lens = None
    decode_prefix_runs: PagedRuns | None = None
    decode_prefix_key: tuple[int, ...] | None = None
    if singles:
        kv_lens = [s.start_position + 1 for s in singles]
        # Blocks every decode shares (a common system prompt held once by the prefix cache): their KV is read
        # once for the whole batch instead of once per request.
        num_shared = _shared_prefix_blocks(singles, kv_lens, block_size)
        if num_shared * block_size < cascade_min_tokens:
            num_shared = 0
        else:
            decode_prefix_blocks = torch.tensor(singles[0].block_ids[:num_shared], dtype=torch.long)
            decode_prefix_runs = _paged_runs([singles[0].block_ids[:num_shared]], [num_shared * block_size],
                                             [len(singles)], device)
            if block_versions is not None:
                decode_prefix_key = block_versions.key(singles[0].block_ids[:num_shared])
        max_blocks = -(-max(kv_lens) // block_size) - num_shared
        table = [s.block_ids[num_shared : num_shared + max_blocks] for s in singles]
        table = [row + [0] * (max_blocks - len(row)) for row in table]
        decode_block_table = torch.tensor(table, dtype=torch.int32)
        key_positions = torch.arange(max_blocks * block_size)
        suffix_lens = torch.tensor(kv_lens, dtype=torch.int32) - num_shared * block_size
        # [num_decodes, 1, 1, max_blocks * block_size]: True where the key exists
        decode_mask = (key_positions[None, :] < suffix_lens[:, None])[:, None, None, :]

    spans: list[PrefillSpan] = []
    run_tables: list[list[int]] = []
    q_start = len(singles)
    for s in chunks:
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
        q_start += q_len

    def dev(t: torch.Tensor | None) -> torch.Tensor | None:
        return None if t is None else t.to(device, non_blocking=True)

    for span in spans:
        span.block_ids = dev(span.block_ids)
    prefill_runs = None
    if spans:
        prefill_runs = _paged_runs(run_tables, [span.kv_len for span in spans], [span.q_len for span in spans],
                                   device)
    attn = AttentionMetadata(
        slot_mapping=torch.tensor(slots, dtype=torch.long, device=device),
        num_decode_tokens=len(singles),
        decode_block_table=dev(decode_block_table),
        decode_mask=dev(decode_mask),
        decode_seq_lens=dev(suffix_lens),
        decode_prefix_blocks=dev(decode_prefix_blocks),
        prefills=spans,
        prefill_runs=prefill_runs,
        decode_prefix_runs=decode_prefix_runs,
        decode_prefix_key=decode_prefix_key,
    )
    return ModelInputs(
        input_ids=torch.tensor(input_ids, dtype=torch.long, device=device),
        positions=torch.tensor(positions, dtype=torch.long, device=device),
        attn=attn,
        sample_rows=torch.tensor(sample_rows, dtype=torch.long, device=device),
        sample_request_ids=sample_ids,
    )


def _paged_runs(tables: list[list[int]], kv_lens: list[int], q_lens: list[int], device: torch.device) -> PagedRuns:
    width = max(len(table) for table in tables)
    q_starts = [0]
    for q_len in q_lens:
        q_starts.append(q_starts[-1] + q_len)
    tensors = (torch.tensor([table + [0] * (width - len(table)) for table in tables], dtype=torch.int32),
               torch.tensor(kv_lens, dtype=torch.int32), torch.tensor(q_starts, dtype=torch.int32))
    return PagedRuns(*(t.to(device, non_blocking=True) for t in tensors))


def _shared_prefix_blocks(singles: list[ScheduledRequest], kv_lens: list[int], block_size: int) -> int:
    """Leading blocks all decodes hold in common (the same physical blocks), full in every one of them."""
    if len(singles) < 2:
        return 0
    limit = min(kv_len // block_size for kv_len in kv_lens)
    first = singles[0].block_ids
    n = 0
    while n < limit and all(s.block_ids[n] == first[n] for s in singles):
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
