"""The pages of the KV groups after the first (kv_layout.py): in requests' tables and under cached blocks.

Group 0's table is the request's ``block_ids``, which the prefix cache keys; every other group keeps a table
of its own (``Request.group_block_ids``), one page per block of tokens, from the same pool. A window group's
pages go back to the pool once every query to come is past them (``drop_out_of_window``), and its table
points at the null page there instead.

When the prefix cache takes a block of group 0, the pages the request holds for that block in the other
groups are *attached* to it and cached with it: a later request whose prefix ends there needs the window
groups' last pages to go on. A prefix hit is therefore cut back to the longest one whose last window of
blocks still has its window pages (``usable_hit``); the cache never serves a freed page.

Reclaiming memory: attached pages go with their block when the prefix tree evicts it
(``on_block_evicted``), and attached window pages no request holds can also go on their own, oldest
first (``evict_idle``), leaving the block cached for longer hits.
"""

from __future__ import annotations

from collections import OrderedDict

from kvserve.block_hash import BlockHash
from kvserve.cache.block_pool import BlockPool
from kvserve.kv_layout import NULL_PAGE, KVLayout
from kvserve.request import Request


class GroupPages:
    def __init__(self, layout: KVLayout, block_size: int, pool: BlockPool) -> None:
        self.layout = layout
        self.block_size = block_size
        self.pool = pool
        self.num_groups = layout.num_groups - 1  # the groups after the first
        self._window_groups = [g for g, windowed in enumerate(layout.windowed[1:]) if windowed]
        # Cached block of group 0 -> its pages in groups 1.. (the null page where a window page is gone).
        self._attached: dict[int, list[int]] = {}
        # Cached blocks whose attached window pages no request holds, in the order they became so.
        self._idle: OrderedDict[int, None] = OrderedDict()

    # --- a request's tables -------------------------------------------------------------------------------
    def allocate(self, request: Request, num_blocks: int) -> None:
        """One new page per group for each of ``num_blocks`` new blocks (the caller made room)."""
        if not request.group_block_ids:
            request.group_block_ids = [[] for _ in range(self.num_groups)]
        pages = self.pool.allocate(num_blocks * self.num_groups)
        for g, table in enumerate(request.group_block_ids):
            table.extend(pages[g * num_blocks : (g + 1) * num_blocks])

    def adopt(self, request: Request, hit_pages: list[list[int]]) -> None:
        """Start a fresh admission's tables with the pages of its prefix hit (acquired by ``take_hit``)."""
        assert not any(request.group_block_ids), f"{request} already holds group pages"
        request.group_block_ids = [list(pages) for pages in hit_pages]

    def drop_out_of_window(self, request: Request) -> None:
        """Give back the window pages no query of the request will read again (its next query is at
        ``num_computed_tokens``). The freed entries form a leading run of each window table."""
        if not request.group_block_ids:
            return
        first = min(self.layout.first_block_in_window(request.num_computed_tokens, self.block_size),
                    len(request.block_ids))
        tables = request.group_block_ids
        probe = tables[self._window_groups[0]]
        i = first
        while i > 0 and probe[i - 1] != NULL_PAGE:
            i -= 1
        for block in range(i, first):
            pages = [tables[g][block] for g in self._window_groups]
            for g in self._window_groups:
                tables[g][block] = NULL_PAGE
            self.pool.release(pages)
            self._note_if_idle(request.block_ids[block])

    def release(self, request: Request) -> None:
        """A finished, aborted or preempted request gives back all its group pages."""
        for table in request.group_block_ids:
            self.pool.release([page for page in table if page != NULL_PAGE])
        for block_id in request.block_ids:
            self._note_if_idle(block_id)
        request.group_block_ids = []

    # --- under the prefix cache ---------------------------------------------------------------------------
    def attach(self, request: Request, start: int, stop: int) -> None:
        """The prefix cache now holds the request's blocks ``start..stop-1``: cache their group pages with them
        (a block the cache took from another request keeps that request's pages)."""
        for i in range(start, stop):
            block_id = request.block_ids[i]
            if not self.pool.cached[block_id] or block_id in self._attached:
                continue
            pages = [table[i] for table in request.group_block_ids]
            for page in pages:
                if page != NULL_PAGE:
                    self.pool.mark_cached(page)
            self._attached[block_id] = pages

    def usable_hit(self, block_ids: list[int]) -> int:
        """How many of a prefix match's blocks can be served: the longest run whose blocks all have their
        pages attached and whose window groups still have the pages of the last window before its end."""
        window_groups = self._window_groups
        missing = [0]  # missing[i]: blocks before i lacking a window page
        for block_id in block_ids:
            pages = self._attached.get(block_id)
            if pages is None:
                break
            missing.append(missing[-1] + any(pages[g] == NULL_PAGE for g in window_groups))
        for n in range(len(missing) - 1, 0, -1):
            first = self.layout.first_block_in_window(n * self.block_size, self.block_size)
            if missing[n] == missing[first]:
                return n
        return 0

    def take_hit(self, block_ids: list[int]) -> list[list[int]]:
        """The group pages of a usable hit, per group and block, each page acquired (the null page for the
        window pages before its last window)."""
        first = self.layout.first_block_in_window(len(block_ids) * self.block_size, self.block_size)
        windowed = set(self._window_groups)
        tables: list[list[int]] = [[] for _ in range(self.num_groups)]
        for i, block_id in enumerate(block_ids):
            pages = self._attached[block_id]
            for g, page in enumerate(pages):
                tables[g].append(NULL_PAGE if g in windowed and i < first else page)
        self.acquire(tables)
        return tables

    def acquire(self, tables: list[list[int]]) -> None:
        for table in tables:
            self.pool.acquire([page for page in table if page != NULL_PAGE])

    def release_pages(self, tables: list[list[int]], block_ids: list[int]) -> None:
        """Give back the pages of a hit that was not used (``block_ids``: its blocks of group 0)."""
        for table in tables:
            self.pool.release([page for page in table if page != NULL_PAGE])
        for block_id in block_ids:
            self._note_if_idle(block_id)

    def on_block_evicted(self, block_id: int, block_hash: BlockHash | None = None, identity: bytes = b"") -> None:
        """The prefix tree evicts a block of group 0: its attached pages go back to the pool with it."""
        pages = self._attached.pop(block_id, None)
        self._idle.pop(block_id, None)
        for page in pages or ():
            if page != NULL_PAGE:
                self.pool.reclaim(page)

    def evict_idle(self, num_pages: int) -> int:
        """Reclaim attached window pages that no request holds, oldest first, until ``num_pages`` are back
        in the pool; their blocks stay cached (for hits ending a window later). Returns the pages reclaimed."""
        reclaimed = 0
        while reclaimed < num_pages and self._idle:
            block_id, _ = self._idle.popitem(last=False)
            pages = self._attached.get(block_id)
            if pages is None or not self._is_idle(pages):
                continue  # evicted meanwhile, or a request took the pages again
            for g in self._window_groups:
                self.pool.reclaim(pages[g])
                pages[g] = NULL_PAGE
                reclaimed += 1
        return reclaimed

    def _is_idle(self, pages: list[int]) -> bool:
        window = [pages[g] for g in self._window_groups]
        return window[0] != NULL_PAGE and all(self.pool.ref_counts[page] == 0 for page in window)

    def _note_if_idle(self, block_id: int) -> None:
        pages = self._attached.get(block_id)
        if pages is not None and self._is_idle(pages):
            self._idle[block_id] = None
            self._idle.move_to_end(block_id)

    # --- integrity ----------------------------------------------------------------------------------------
    @property
    def num_cached_pages(self) -> int:
        return sum(page != NULL_PAGE for pages in self._attached.values() for page in pages)

    def check_invariants(self) -> None:
        for block_id, pages in self._attached.items():
            assert self.pool.cached[block_id], f"block {block_id} has attached pages but is not cached"
            assert len(pages) == self.num_groups, f"block {block_id}: {len(pages)} attached pages"
            for page in pages:
                assert page == NULL_PAGE or self.pool.cached[page], f"attached page {page} is not cached"
