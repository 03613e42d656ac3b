"""Per-block write counts (the cpu_kernels backend's, from the blocks the runner says each step writes):
what makes a packed shared prefix safe to keep across steps."""

from __future__ import annotations

from kvserve.batch import ScheduledRequest, SchedulerOutput
from kvserve.model.backends.block_versions import BlockVersions
from kvserve.runner.input_batch import written_block_ids


def bump_written(versions: BlockVersions, out: SchedulerOutput, block_size: int) -> None:
    versions.bump(written_block_ids(out, block_size))


def scheduled(block_ids: list[int], start: int, num_tokens: int) -> ScheduledRequest:
    return ScheduledRequest("r", list(range(num_tokens)), start, block_ids, sample=True)


def test_a_key_changes_exactly_when_one_of_its_blocks_is_written() -> None:
    versions = BlockVersions()
    before = versions.key([4, 7, 9])
    versions.bump([11])  # another block
    assert versions.key([4, 7, 9]) == before
    versions.bump([7])
    assert versions.key([4, 7, 9]) != before
    assert versions.key([4, 9]) != versions.key([9, 4])  # the order of the run is part of its contents


def test_a_step_bumps_its_loads_and_every_block_its_tokens_land_in() -> None:
    versions = BlockVersions()
    prefix = [0, 1, 2]
    key = versions.key(prefix)
    # Decodes writing past the prefix, and a chunk of 20 tokens from position 40 (blocks 2 and 3 of 16).
    decode = scheduled([0, 1, 5], 32, 1)
    bump_written(versions, SchedulerOutput(scheduled=[decode]), block_size=16)
    assert versions.key(prefix) == key
    chunk = scheduled([0, 1, 2, 3], 40, 20)
    bump_written(versions, SchedulerOutput(scheduled=[chunk]), block_size=16)
    assert versions.key([0, 1]) == key[:2] + key[3:5]
    assert versions.key(prefix) != key and versions.key([3]) != (3, 0)
    # A payload loaded from a lower tier rewrites its block too.
    key = versions.key(prefix)
    bump_written(versions, SchedulerOutput(kv_loads=[(1, b"kv")]), block_size=16)
    assert versions.key(prefix) != key


def test_drafts_bump_the_blocks_they_are_written_into() -> None:
    versions = BlockVersions()
    # A decode at position 30 (block 1 of 16) with 3 drafts at 31..33: they reach block 2.
    decode = ScheduledRequest("r", [7], 30, [0, 1, 2], sample=True, draft_token_ids=[8, 9, 10])
    bump_written(versions, SchedulerOutput(scheduled=[decode]), block_size=16)
    assert versions.key([0]) == (0, 0)
    assert versions.key([1, 2]) == (1, 2, 1, 1)
