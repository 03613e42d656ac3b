"""Physical KV blocks: ids, reference counts and the free list. No torch: the tensors live in the runner.

Every block is exactly one of
    free       ref_count == 0 and not cached       (on the free list)
    used       ref_count >= 1                      (in at least one running request's block table)
    evictable  ref_count == 0 and cached           (held by the prefix tree, reclaimable)
so free + used + evictable == total at all times (``check_invariants``). A pool may reserve block 0 as a
null page (kv_layout.py): it is never handed out and counts in none of the three.
"""

from __future__ import annotations

from collections import deque


class BlockPool:
    def __init__(self, num_blocks: int, reserve_null: bool = False) -> None:
        if num_blocks < 1 + reserve_null:
            raise ValueError(f"num_blocks must be >= {1 + reserve_null}, got {num_blocks}")
        self.num_blocks = num_blocks
        self.ref_counts = [0] * num_blocks
        self.cached = [False] * num_blocks
        self._free: deque[int] = deque(range(int(reserve_null), num_blocks))
        self.num_reserved = int(reserve_null)
        if reserve_null:
            self.ref_counts[0] = 1  # held for good: never free, never evictable
        self._num_evictable = 0

    # --- counts -------------------------------------------------------------------------------------------
    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_evictable(self) -> int:
        return self._num_evictable

    @property
    def num_used(self) -> int:
        return self.num_blocks - self.num_reserved - len(self._free) - self._num_evictable

    @property
    def usage(self) -> float:
        return self.num_used / (self.num_blocks - self.num_reserved)

    # --- allocation -----------------------------------------------------------------------------------------
    def allocate(self, n: int) -> list[int]:
        """Pop ``n`` free blocks with ref_count 1. The caller must have made room (evicted) first."""
        if n > len(self._free):
            raise RuntimeError(f"asked for {n} blocks with only {len(self._free)} free")
        block_ids = [self._free.popleft() for _ in range(n)]
        for block_id in block_ids:
            self.ref_counts[block_id] = 1
        return block_ids

    def acquire(self, block_ids: list[int]) -> None:
        """Add a reference to blocks already holding KV (a prefix-cache hit)."""
        for block_id in block_ids:
            if self.ref_counts[block_id] == 0:
                assert self.cached[block_id], f"block {block_id} is free, not cached"
                self._num_evictable -= 1
            self.ref_counts[block_id] += 1

    def release(self, block_ids: list[int]) -> None:
        """Drop one reference from each block; unreferenced blocks become evictable (cached) or free."""
        for block_id in block_ids:
            count = self.ref_counts[block_id] - 1
            assert count >= 0, f"block {block_id} released more often than acquired"
            self.ref_counts[block_id] = count
            if count == 0:
                if self.cached[block_id]:
                    self._num_evictable += 1
                else:
                    self._free.append(block_id)

    # --- prefix-tree ownership ------------------------------------------------------------------------------
    def mark_cached(self, block_id: int) -> None:
        """The prefix tree takes ownership of a block that a running request holds."""
        assert self.ref_counts[block_id] > 0 and not self.cached[block_id]
        self.cached[block_id] = True

    def uncache(self, block_id: int) -> None:
        """The prefix tree hands a block a request now references over to that request alone (a tail the
        request adopts and writes into)."""
        assert self.cached[block_id] and self.ref_counts[block_id] == 1, f"block {block_id} cannot be handed over"
        self.cached[block_id] = False

    def reclaim(self, block_id: int) -> None:
        """The prefix tree evicts an unreferenced cached block: it goes back to the free list."""
        assert self.cached[block_id] and self.ref_counts[block_id] == 0, f"block {block_id} is not evictable"
        self.cached[block_id] = False
        self._num_evictable -= 1
        self._free.append(block_id)

    # --- integrity ------------------------------------------------------------------------------------------
    def check_invariants(self) -> None:
        free = set(self._free)
        assert len(free) == len(self._free), "a block is on the free list twice"
        for block_id in free:
            assert self.ref_counts[block_id] == 0, f"free block {block_id} is referenced"
            assert not self.cached[block_id], f"free block {block_id} is cached"
        used = sum(1 for c in self.ref_counts if c > 0) - self.num_reserved
        evictable = sum(1 for c, cached in zip(self.ref_counts, self.cached, strict=True) if c == 0 and cached)
        assert evictable == self._num_evictable, f"evictable count {self._num_evictable} != {evictable}"
        assert len(free) + used + evictable + self.num_reserved == self.num_blocks, (
            f"free {len(free)} + used {used} + evictable {evictable} + reserved {self.num_reserved} "
            f"!= total {self.num_blocks}"
        )
        assert not self.num_reserved or (self.ref_counts[0] == 1 and not self.cached[0]), "the null page was taken"
