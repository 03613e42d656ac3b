"""The KV manager's window onto cached KV: a ``PrefixCache`` protocol, the radix cache behind it, and a null
object for when prefix caching is off.

A *handle* is what ``match`` and ``insert`` return: the end of a run of cached full blocks of a request's
tokens. While a handle is locked, every block on its path stays cached and none of them is evicted; the
request that holds the lock may extend the run with ``insert(request, num_blocks, start=handle)``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from kvserve.block_hash import BlockHash
from kvserve.cache.block_pool import BlockPool
from kvserve.cache.kv_events import KVEventLog
from kvserve.cache.radix_cache import EvictHook, RadixCache, RadixNode, TailBlock
from kvserve.request import Request


@dataclass(frozen=True, slots=True)
class PrefixMatch:
    """The longest cached run of full blocks for a request, ending at ``handle``."""

    handle: object
    block_ids: list[int]


class PrefixCache(Protocol):
    """What the KV manager needs of a prefix cache (see the module docstring for handles)."""

    on_evict: EvictHook | None  # called with (block_id, block_hash, identity) before an evicted block is reused

    def match(self, request: Request, max_blocks: int) -> PrefixMatch:
        """Longest run (at most ``max_blocks``) of cached blocks of the request's tokens; touches the LRU."""
        ...

    def match_length(self, request: Request, max_blocks: int) -> int:
        """Blocks ``match`` would find, changing nothing (for cache-aware ordering)."""
        ...

    def lock(self, handle: object) -> None: ...

    def unlock(self, handle: object) -> None: ...

    def insert(self, request: Request, num_blocks: int, start: object | None) -> object:
        """Cache the request's first ``num_blocks`` full blocks (held by the request); returns the new end."""
        ...

    def cached_depth(self, handle: object | None) -> int:
        """Blocks from the start of the sequence to the end of ``handle`` (0 for None)."""
        ...

    def take_tail(self, handle: object, request: Request, start: int, stop: int) -> tuple[TailBlock, int] | None:
        """A partly filled block after ``handle`` whose tokens best continue ``request`` from token ``start``
        (up to ``stop``), detached for this request, and how many of its tokens match."""
        ...

    def restore_tail(self, tail: TailBlock) -> None: ...

    def keep_tail(self, request: Request) -> None:
        """Keep a finishing request's partly filled last block of computed KV, if it is the request's alone."""
        ...

    def evict(self, num_blocks: int) -> int: ...

    def num_evictable_blocks(self) -> int: ...

    def num_locked_nodes(self) -> int: ...

    def cached_blocks(self) -> list[tuple[int, BlockHash, bytes]]: ...

    @property
    def num_cached_blocks(self) -> int:
        """Blocks held: full blocks and partly filled tails."""
        ...

    @property
    def num_evicted_blocks(self) -> int: ...

    def check_invariants(self, other_cached: int = 0) -> None:
        """``other_cached``: blocks marked cached in the pool that something else owns (group pages)."""
        ...


class RadixPrefixCache:
    """The radix tree (``RadixCache``) seen through the ``PrefixCache`` protocol, with tails."""

    def __init__(self, block_size: int, pool: BlockPool, keep_tails: bool = True,
                 events: KVEventLog | None = None) -> None:
        self.block_size = block_size
        self.pool = pool
        self.tree = RadixCache(block_size, pool, events=events)
        self.keep_tails = keep_tails

    @property
    def on_evict(self) -> EvictHook | None:
        return self.tree.on_evict

    @on_evict.setter
    def on_evict(self, hook: EvictHook | None) -> None:
        self.tree.on_evict = hook

    def match(self, request: Request, max_blocks: int) -> PrefixMatch:
        hashes = request.full_block_hashes(self.block_size)
        found = self.tree.match_prefix(hashes, request.all_token_ids, max_blocks)
        return PrefixMatch(found.node, found.block_ids)

    def match_length(self, request: Request, max_blocks: int) -> int:
        return self.tree.match_length(request.full_block_hashes(self.block_size), request.all_token_ids, max_blocks)

    def lock(self, handle: object) -> None:
        assert isinstance(handle, RadixNode)
        self.tree.lock(handle)

    def unlock(self, handle: object) -> None:
        assert isinstance(handle, RadixNode)
        self.tree.unlock(handle)

    def insert(self, request: Request, num_blocks: int, start: object | None) -> object:
        assert start is None or isinstance(start, RadixNode)
        if start is not None and start.depth >= num_blocks:
            return start  # already cached up to there: no hashing, no walk
        hashes = request.full_block_hashes(self.block_size)
        return self.tree.insert(hashes, request.all_token_ids, request.block_ids[:num_blocks], start=start)

    def cached_depth(self, handle: object | None) -> int:
        return handle.depth if isinstance(handle, RadixNode) else 0

    def take_tail(self, handle: object, request: Request, start: int, stop: int) -> tuple[TailBlock, int] | None:
        assert isinstance(handle, RadixNode)
        if not handle.tails:
            return None
        return self.tree.take_tail(handle, request.all_token_ids[start:stop], request.hash_extra)

    def restore_tail(self, tail: TailBlock) -> None:
        self.tree.restore_tail(tail)

    def keep_tail(self, request: Request) -> None:
        """Hand the tree the request's last, partly filled block (see ``TailBlock``): the next turn of a
        conversation starts with those tokens."""
        if not self.keep_tails:
            return
        computed = request.num_computed_tokens
        num_full, num_tail = divmod(computed, self.block_size)
        if num_tail == 0 or len(request.block_ids) <= num_full:
            return
        block_id = request.block_ids[num_full]
        if self.pool.ref_counts[block_id] != 1 or self.pool.cached[block_id]:
            return  # shared with another request, which may still write into it
        node = request.cache_handle if num_full else self.tree.root
        if not isinstance(node, RadixNode) or node.depth != num_full:
            return  # the tree does not hold this request's full blocks up to the tail
        start = num_full * self.block_size
        self.tree.add_tail(node, request.all_token_ids[start:computed], block_id, request.hash_extra)

    def evict(self, num_blocks: int) -> int:
        return self.tree.evict(num_blocks)

    def num_evictable_blocks(self) -> int:
        return self.tree.num_evictable_blocks()

    def num_locked_nodes(self) -> int:
        return self.tree.num_locked_nodes()

    def cached_blocks(self) -> list[tuple[int, BlockHash, bytes]]:
        return self.tree.cached_blocks()

    @property
    def num_cached_blocks(self) -> int:
        return self.tree.num_cached_blocks + self.tree.num_tail_blocks

    @property
    def num_evicted_blocks(self) -> int:
        return self.tree.num_evicted_blocks

    def check_invariants(self, other_cached: int = 0) -> None:
        self.tree.check_invariants(other_cached)


class NoPrefixCache:
    """Prefix caching off: nothing is hashed, matched, kept or evicted; a request's blocks are its own."""

    on_evict: EvictHook | None = None
    num_cached_blocks = 0
    num_evicted_blocks = 0

    def match(self, request: Request, max_blocks: int) -> PrefixMatch:
        return PrefixMatch(None, [])

    def match_length(self, request: Request, max_blocks: int) -> int:
        return 0

    def lock(self, handle: object) -> None:
        raise AssertionError("nothing is cached, so nothing is locked")

    def unlock(self, handle: object) -> None:
        raise AssertionError("nothing is cached, so nothing is locked")

    def insert(self, request: Request, num_blocks: int, start: object | None) -> object:
        return start

    def cached_depth(self, handle: object | None) -> int:
        return 0

    def take_tail(self, handle: object, request: Request, start: int, stop: int) -> tuple[TailBlock, int] | None:
        return None

    def restore_tail(self, tail: TailBlock) -> None:
        raise AssertionError("no tails are handed out")

    def keep_tail(self, request: Request) -> None:
        return None

    def evict(self, num_blocks: int) -> int:
        return 0

    def num_evictable_blocks(self) -> int:
        return 0

    def num_locked_nodes(self) -> int:
        return 0

    def cached_blocks(self) -> list[tuple[int, BlockHash, bytes]]:
        return []

    def check_invariants(self, other_cached: int = 0) -> None:
        return None
