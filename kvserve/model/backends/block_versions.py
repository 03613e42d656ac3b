"""A write counter per KV block, so copies derived from blocks' contents can tell when they are stale."""

from __future__ import annotations

from collections.abc import Iterable, Sequence


class BlockVersions:
    """Every write into a block (a tier's payload loaded into it, or a forward's new KV) bumps its version.

    The runner reports every block a step rewrites (``StepRows.written_block_ids``), so the counts see every
    write. ``key`` names the contents of a run of blocks: equal keys mean no block of the run was written in
    between, so a layout packed from them (the AMX attention kernel's packed shared prefix) is still exact.
    A block id alone is not enough: a freed block comes back with other contents.
    """

    def __init__(self) -> None:
        self._versions: dict[int, int] = {}

    def bump(self, block_ids: Iterable[int]) -> None:
        versions = self._versions
        for block_id in block_ids:
            versions[block_id] = versions.get(block_id, 0) + 1

    def key(self, block_ids: Sequence[int]) -> tuple[int, ...]:
        versions = self._versions
        return (*block_ids, *(versions.get(block_id, 0) for block_id in block_ids))
