"""Turns a SchedulerOutput into what one forward needs: ids, positions, and the step's generic rows (slots,
decode rows with their block tables and lengths, prefill chunks, written blocks) that the backend builds its
attention metadata from.

Token order in the batch:   [ d0 d1 ... d(B-1) | prefill a (q_len_a) | prefill b | ... ]
where the d's are single-token queries (decodes, or one-token prefill chunks), batched in one attention
call; every prefill chunk gets its own rows. A decode with speculative drafts takes one d row per token
(its last token, then each draft, at consecutive positions), each row seeing the keys up to its own
position. ``sample_rows`` lists the rows whose logits are sampled: per request of ``sample_request_ids``,
in order, 1 + len(its drafts) rows.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from kvserve.batch import ScheduledRequest, SchedulerOutput
from kvserve.model.backends.base import PrefillChunk, StepRows
from kvserve.model.host_inputs import to_device


@dataclass(slots=True)
class ModelInputs:
    input_ids: torch.Tensor  # [num_tokens]
    positions: torch.Tensor  # [num_tokens]
    rows: StepRows  # the layout the backend builds its attention metadata from
    sample_rows: torch.Tensor  # [num_sample_rows]
    sample_request_ids: list[str]
    sample_drafts: list[list[int]]  # per sampled request: the drafts its rows after the first verify
    # The same layout over the block tables of the other KV groups (kv_layout.py), one per group; empty for
    # a model whose layers all read one table.
    group_rows: list[StepRows] = field(default_factory=list)
    # Per scheduled request: (request id, its first row, the position of that row, its rows of token_ids).
    spans: list[tuple[str, int, int, int]] = field(default_factory=list)


def build_inputs(out: SchedulerOutput, block_size: int, device: torch.device) -> ModelInputs:
    singles = [s for s in out.scheduled if len(s.token_ids) == 1]
    chunks = [s for s in out.scheduled if len(s.token_ids) > 1]

    input_ids: list[int] = []
    positions: list[int] = []
    sample_rows: list[int] = []
    sample_ids: list[str] = []
    sample_drafts: list[list[int]] = []
    spans: list[tuple[str, int, int, int]] = []
    for s in singles:
        tokens = s.token_ids + s.draft_token_ids if s.draft_token_ids else s.token_ids
        first_row = len(input_ids)
        spans.append((s.request_id, first_row, s.start_position, len(s.token_ids)))
        input_ids.extend(tokens)
        positions.extend(range(s.start_position, s.start_position + len(tokens)))
        if s.sample:
            sample_rows.extend(range(first_row, len(input_ids)))
            sample_ids.append(s.request_id)
            sample_drafts.append(s.draft_token_ids)
    for s in chunks:
        assert not s.draft_token_ids, "drafts ride on decodes only"
        spans.append((s.request_id, len(input_ids), s.start_position, len(s.token_ids)))
        input_ids.extend(s.token_ids)
        positions.extend(range(s.start_position, s.start_position + len(s.token_ids)))
        if s.sample:
            sample_rows.append(len(input_ids) - 1)
            sample_ids.append(s.request_id)
            sample_drafts.append([])

    num_groups = len(out.scheduled[0].group_block_ids) if out.scheduled else 0
    return ModelInputs(
        input_ids=to_device(input_ids, device, torch.long),
        positions=to_device(positions, device, torch.long),
        rows=_step_rows(out, singles, chunks, _main_table, block_size, device),
        sample_rows=to_device(sample_rows, device, torch.long),
        sample_request_ids=sample_ids,
        sample_drafts=sample_drafts,
        group_rows=[_step_rows(out, singles, chunks, _group_table(g), block_size, device) for g in range(num_groups)],
        spans=spans,
    )


TableOf = Callable[[ScheduledRequest], list[int]]


def _main_table(s: ScheduledRequest) -> list[int]:
    return s.block_ids


def _group_table(group: int) -> TableOf:
    return lambda s: s.group_block_ids[group]


def _step_rows(out: SchedulerOutput, singles: list[ScheduledRequest], chunks: list[ScheduledRequest],
               table_of: TableOf, block_size: int, device: torch.device) -> StepRows:
    """The step's rows over the block tables ``table_of`` gives (one group's): where each new token's K/V
    goes, each decode row's table and keys, each prefill chunk's blocks."""
    slots: list[int] = []
    row_tables: list[list[int]] = []  # per decode row: its request's block table
    kv_lens: list[int] = []  # per decode row: keys it sees (its own position + 1)
    for s in singles:
        table = table_of(s)
        for pos in range(s.start_position, s.start_position + 1 + len(s.draft_token_ids)):
            slots.append(table[pos // block_size] * block_size + pos % block_size)
            row_tables.append(table)
            kv_lens.append(pos + 1)
    prefills: list[PrefillChunk] = []
    q_start = len(slots)
    for s in chunks:
        table = table_of(s)
        q_len = len(s.token_ids)
        kv_len = s.start_position + q_len
        slots.extend(_chunk_slots(s, table, block_size))
        prefills.append(PrefillChunk(q_start, q_len, kv_len, table[: -(-kv_len // block_size)]))
        q_start += q_len
    return StepRows(
        block_size=block_size,
        slot_mapping=to_device(slots, device, torch.long),
        decode_block_ids=row_tables,
        decode_kv_lens=kv_lens,
        prefills=prefills,
        written_block_ids=written_block_ids(out, block_size, table_of, with_loads=table_of is _main_table),
        num_decode_requests=len(singles),
    )


def written_block_ids(out: SchedulerOutput, block_size: int, table_of: TableOf = _main_table,
                      with_loads: bool = True) -> list[int]:
    """The blocks this step writes in the tables ``table_of`` gives: the tier loads (blocks of the requests'
    own tables, ``with_loads``) and the blocks of every scheduled token and draft."""
    written = [block_id for block_id, _ in out.kv_loads] if with_loads else []
    for s in out.scheduled:
        first = s.start_position // block_size
        last = (s.start_position + len(s.token_ids) + len(s.draft_token_ids) - 1) // block_size
        written.extend(table_of(s)[first : last + 1])
    return written


def _chunk_slots(s: ScheduledRequest, table: list[int], block_size: int) -> list[int]:
    """Slots of positions start..start+len-1, one block-aligned run at a time (no per-token divisions)."""
    slots: list[int] = []
    pos, end = s.start_position, s.start_position + len(s.token_ids)
    while pos < end:
        block, offset = divmod(pos, block_size)
        run = min(block_size - offset, end - pos)
        base = table[block] * block_size + offset
        slots.extend(range(base, base + run))
        pos += run
    return slots
