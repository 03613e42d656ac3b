"""The runner's step inputs: decode rows (with speculative drafts), prefill spans, slots and sampled rows,
and the decode layout a backend builds from them."""

from __future__ import annotations

import torch

from kvserve.batch import ScheduledRequest, SchedulerOutput
from kvserve.config import ArchConfig, BackendConfig
from kvserve.model.backends.base import PrefillChunk
from kvserve.model.backends.torch_ref import TorchRefBackend
from kvserve.runner.input_batch import build_inputs

BLOCK = 4
ARCH = ArchConfig("llama", vocab_size=64, hidden_size=64, intermediate_size=128, num_layers=1, num_heads=2,
                  num_kv_heads=1, head_dim=32, max_position_embeddings=64)


def metadata(out: SchedulerOutput, cascade_min_tokens: int):
    inputs = build_inputs(out, BLOCK, torch.device("cpu"))
    backend = TorchRefBackend(ARCH, torch.device("cpu"), BackendConfig(cascade_min_tokens=cascade_min_tokens))
    return inputs, backend.build_metadata(inputs.rows)


def test_draft_rows_follow_their_decode_at_consecutive_positions() -> None:
    # a: decode at position 6 with drafts at 7 and 8 (crossing into its third block); b: plain decode at 2;
    # c: a 3-token prefill chunk from position 4.
    a = ScheduledRequest("a", [11], 6, [5, 9, 2], sample=True, draft_token_ids=[12, 13])
    b = ScheduledRequest("b", [21], 2, [7], sample=True)
    c = ScheduledRequest("c", [31, 32, 33], 4, [3, 8], sample=True)
    inputs, attn = metadata(SchedulerOutput(scheduled=[a, b, c]), cascade_min_tokens=10**9)

    assert inputs.input_ids.tolist() == [11, 12, 13, 21, 31, 32, 33]
    assert inputs.positions.tolist() == [6, 7, 8, 2, 4, 5, 6]
    # slot = block_ids[pos // 4] * 4 + pos % 4
    assert attn.slot_mapping.tolist() == [9 * 4 + 2, 9 * 4 + 3, 2 * 4 + 0, 7 * 4 + 2, 8 * 4 + 0, 8 * 4 + 1,
                                          8 * 4 + 2]
    assert attn.num_decode_tokens == 4
    # Each draft row sees the keys up to its own position; rows of one request share its block table.
    assert attn.decode_seq_lens.tolist() == [7, 8, 9, 3]
    assert attn.decode_block_table.tolist() == [[5, 9, 2], [5, 9, 2], [5, 9, 2], [7, 0, 0]]
    # Every row of a is sampled (to verify its drafts), one of b, the chunk's last row of c.
    assert inputs.sample_rows.tolist() == [0, 1, 2, 3, 6]
    assert inputs.sample_request_ids == ["a", "b", "c"]
    assert inputs.sample_drafts == [[12, 13], [], []]
    # The generic rows every backend starts from, and the blocks the step writes (drafts included).
    rows = inputs.rows
    assert rows.decode_kv_lens == [7, 8, 9, 3] and rows.decode_block_ids == [[5, 9, 2]] * 3 + [[7]]
    assert rows.prefills == [PrefillChunk(4, 3, 7, [3, 8])]
    assert rows.written_block_ids == [9, 2, 7, 8]


def test_draft_rows_read_a_shared_prefix_once() -> None:
    # Two requests share blocks 0 and 1 (a cached prefix); a carries two drafts.
    a = ScheduledRequest("a", [1], 9, [0, 1, 4], sample=True, draft_token_ids=[2, 3])
    b = ScheduledRequest("b", [5], 10, [0, 1, 6], sample=True)
    _, attn = metadata(SchedulerOutput(scheduled=[a, b]), cascade_min_tokens=8)
    assert attn.decode_prefix_blocks.tolist() == [0, 1]
    # Suffix lengths are what each row sees past the 8 prefix tokens.
    assert attn.decode_seq_lens.tolist() == [2, 3, 4, 3]
    assert attn.decode_block_table.tolist() == [[4], [4], [4], [6]]
    # The reference attention's padding mask covers the same suffix keys.
    assert attn.decode_mask.sum(dim=-1).flatten().tolist() == [2, 3, 4, 3]
