"""A write counter per KV block, so copies derived from blocks' contents can tell when they are stale."""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from kvserve.batch import SchedulerOutput


class BlockVersions:
    """Every write into a block (a tier's payload loaded into it, or a forward's new KV) bumps its version.

    The runner applies every write to the paged cache, so it keeps the counts. ``key`` names the contents of
    a run of blocks: equal keys mean no block of the run was written in between, so a layout packed from
    them (the attention kernel's packed shared prefix) is still exact. A block id alone is not enough: a
    freed block comes back with other contents.
    """

    def __init__(self) -> None:
        self._versions: dict[int, int] = {}

    def bump(self, block_ids: Iterable[int]) -> None:
        versions = self._versions
        for block_id in block_ids:
            versions[block_id] = versions.get(block_id, 0) + 1

    def bump_written(self, out: SchedulerOutput, block_size: int) -> None:
        """The blocks this step writes: its tier loads and the blocks of every scheduled token and draft."""
        self.bump(block_id for block_id, _ in out.kv_loads)
        for s in out.scheduled:
            first = s.start_position // block_size
            last = (s.start_position + len(s.token_ids) + len(s.draft_token_ids) - 1) // block_size
            self.bump(s.block_ids[first : last + 1])

    def key(self, block_ids: Sequence[int]) -> tuple[int, ...]:
        versions = self._versions
        return (*block_ids, *(versions.get(block_id, 0) for block_id in block_ids))
