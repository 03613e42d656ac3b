"""The scheduler's only window onto KV memory: prefix lookup, block allocation, caching and freeing.

The scheduler sees ``PrefixHit`` (how many tokens are cached) and booleans; the radix tree, reference
counts and (later) lower storage tiers stay behind this class. While a request holds a hit or runs, the
blocks on its path are locked in the tree and cannot be evicted.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvserve.cache.block_pool import BlockPool
from kvserve.cache.radix_cache import RadixCache, RadixNode
from kvserve.request import Request


@dataclass(frozen=True, slots=True)
class PrefixHit:
    """Cached tokens found for a waiting request. Holds a lock until allocated or released."""

    num_tokens: int
    block_ids: list[int] = field(default_factory=list)
    node: RadixNode | None = None


EMPTY_HIT = PrefixHit(0)


@dataclass(slots=True)
class PrefixCacheStats:
    queries: int = 0  # prompt tokens looked up (first admissions only)
    hits: int = 0  # of which found cached
    requests: int = 0

    @property
    def hit_rate(self) -> float:
        return self.hits / self.queries if self.queries else 0.0


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True) -> None:
        self.block_size = block_size
        self.pool = BlockPool(num_blocks)
        # With the cache off there is no tree at all: nothing is hashed, locked or kept after a request.
        self.tree = RadixCache(block_size, self.pool) if enable_prefix_caching else None
        self.stats = PrefixCacheStats()

    @property
    def enable_prefix_caching(self) -> bool:
        return self.tree is not None

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    # --- admission ------------------------------------------------------------------------------------------
    def lookup(self, request: Request) -> PrefixHit:
        """Longest cached prefix of the request, leaving at least its last token to compute (for logits)."""
        if self.tree is None:
            return EMPTY_HIT
        max_blocks = (request.num_tokens - 1) // self.block_size
        if max_blocks == 0:
            return EMPTY_HIT
        hashes = request.full_block_hashes(self.block_size)
        match = self.tree.match_prefix(hashes, request.all_token_ids, max_blocks)
        if not match.block_ids:
            return EMPTY_HIT
        self.tree.lock(match.node)
        return PrefixHit(len(match.block_ids) * self.block_size, match.block_ids, match.node)

    def cached_prefix_length(self, request: Request) -> int:
        """Tokens a lookup would find now, without locking or touching anything (cache-aware ordering)."""
        if self.tree is None:
            return 0
        max_blocks = (request.num_tokens - 1) // self.block_size
        hashes = request.full_block_hashes(self.block_size)
        return self.tree.match_length(hashes, request.all_token_ids, max_blocks) * self.block_size

    def release_hit(self, hit: PrefixHit) -> None:
        """Give back a hit that was not used (the request could not be admitted)."""
        if hit.node is not None and self.tree is not None:
            self.tree.unlock(hit.node)

    def record_admission(self, request: Request, hit: PrefixHit) -> None:
        """Count a first admission's prefix lookup (re-admissions after preemption are not cache hits)."""
        self.stats.requests += 1
        self.stats.queries += request.num_prompt_tokens
        self.stats.hits += hit.num_tokens

    # --- allocation ---------------------------------------------------------------------------------------
    def allocate(self, request: Request, num_new_tokens: int, hit: PrefixHit = EMPTY_HIT) -> bool:
        """Make room for ``num_new_tokens`` more tokens of KV; with ``hit``, adopt the cached blocks first.

        Returns False (and changes nothing) when the pool cannot provide the blocks even after evicting.
        """
        num_existing = len(request.block_ids) + len(hit.block_ids)
        num_computed = request.num_computed_tokens + hit.num_tokens
        num_needed = request.num_blocks_needed(num_computed + num_new_tokens, self.block_size) - num_existing
        if num_needed > 0 and not self._make_room(num_needed, hit):
            return False
        if hit.block_ids:
            self.pool.acquire(hit.block_ids)
            request.block_ids.extend(hit.block_ids)
            request.num_computed_tokens += hit.num_tokens
            request.cache_handle = hit.node
        if num_needed > 0:
            request.block_ids.extend(self.pool.allocate(num_needed))
        return True

    def _make_room(self, num_needed: int, hit: PrefixHit) -> bool:
        if num_needed <= self.pool.num_free:
            return True
        if self.tree is None:
            return False
        # Hit blocks are locked, so they cannot be evicted to make room for themselves.
        reserved = sum(1 for b in hit.block_ids if self.pool.ref_counts[b] == 0)
        if num_needed > self.pool.num_free + self.pool.num_evictable - reserved:
            return False
        self.tree.evict(num_needed - self.pool.num_free)
        return num_needed <= self.pool.num_free

    def can_fit(self, num_blocks: int) -> bool:
        return num_blocks <= self.pool.num_free + self.pool.num_evictable

    # --- caching and freeing ------------------------------------------------------------------------------
    def cache_computed_blocks(self, request: Request) -> None:
        """Insert the request's newly computed full blocks into the tree, so later (and concurrent)
        requests with the same prefix share them. Called after every step the request ran in."""
        if self.tree is None:
            return
        num_full = request.num_computed_tokens // self.block_size
        node: RadixNode | None = request.cache_handle  # type: ignore[assignment]
        if num_full == 0 or (node is not None and node.depth >= num_full):
            return
        hashes = request.full_block_hashes(self.block_size)
        new_node = self.tree.insert(hashes, request.all_token_ids, request.block_ids[:num_full], start=node)
        if new_node is not node:
            self.tree.lock(new_node)
            if node is not None:
                self.tree.unlock(node)
            request.cache_handle = new_node

    def free(self, request: Request) -> None:
        """Release a finished, aborted or preempted request's blocks. Cached blocks stay, evictable."""
        self.cache_computed_blocks(request)
        self.pool.release(request.block_ids)
        if request.cache_handle is not None and self.tree is not None:
            self.tree.unlock(request.cache_handle)  # type: ignore[arg-type]
        request.cache_handle = None
        request.block_ids = []
        request.num_computed_tokens = 0

    # --- observability ------------------------------------------------------------------------------------
    @property
    def num_cached_blocks(self) -> int:
        return self.tree.num_cached_blocks if self.tree is not None else 0

    @property
    def num_evicted_blocks(self) -> int:
        return self.tree.num_evicted_blocks if self.tree is not None else 0

    def check_invariants(self) -> None:
        self.pool.check_invariants()
        if self.tree is not None:
            self.tree.check_invariants()
