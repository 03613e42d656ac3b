"""The scheduler's only window onto KV memory: prefix lookup, block allocation, caching and freeing.

The scheduler sees ``PrefixHit`` (how many tokens are cached) and booleans; the prefix cache
(cache/prefix_cache.py), reference counts and the tiers below device memory (cache/tier_coordinator.py,
which also says how KV moves between them and device blocks) stay behind this class. While a request holds a
hit or runs, the blocks on its path are locked in the prefix cache and cannot be evicted.

A model whose sliding-window layers keep their KV in groups of their own (kv_layout.py) has several pages
per block of tokens; ``GroupPages`` (cache/group_pages.py) keeps those of every group after the first, frees
the window groups' pages as requests move past them and caches them with the prefix cache's blocks. Block
counts below are then counts of pages.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from kvserve.block_hash import BlockHash
from kvserve.cache.block_pool import BlockPool
from kvserve.cache.group_pages import GroupPages
from kvserve.cache.kv_events import KVEventLog
from kvserve.cache.prefix_cache import NoPrefixCache, PrefixCache, RadixPrefixCache
from kvserve.cache.radix_cache import TailBlock
from kvserve.cache.tier_coordinator import CachedBlock, NoTiers, TierCoordinator, Tiers
from kvserve.cache.tiers import BlockKV, TieredKVStore
from kvserve.kv_layout import KVLayout
from kvserve.request import Request

PERSIST_CHUNK_BLOCKS = 64  # device blocks read at a time for a shutdown's persistence

DEVICE = "device"


@dataclass(frozen=True, slots=True)
class PrefixHit:
    """Cached tokens found for a waiting request. Holds a lock until allocated or released.

    ``block_ids`` are the device blocks of the hit, ``loaded`` the (tier, payload) of each block of the
    run found below them; ``tail`` a partly filled block after the device blocks whose first
    ``tail_tokens`` tokens match (it holds a reference until adopted or given back); ``num_tokens``
    counts them all.
    """

    num_tokens: int
    block_ids: list[int] = field(default_factory=list)
    handle: object = None  # the locked end of the device blocks in the prefix cache
    loaded: list[tuple[str, bytes]] = field(default_factory=list)
    # True: part of the prefix is being read from disk or Redis off the engine loop; admit the request
    # later (other requests run meanwhile). Holds no lock.
    pending: bool = False
    tail: TailBlock | None = None
    tail_tokens: int = 0
    # The pages of the other KV groups for ``block_ids`` (per group, per block), acquired with the hit.
    group_block_ids: list[list[int]] = field(default_factory=list)

    def tokens_by_tier(self, block_size: int) -> dict[str, int]:
        out = {DEVICE: len(self.block_ids) * block_size + self.tail_tokens}
        for tier, _ in self.loaded:
            out[tier] = out.get(tier, 0) + block_size
        return out


EMPTY_HIT = PrefixHit(0)
PENDING_HIT = PrefixHit(0, pending=True)


@dataclass(slots=True)
class PrefixCacheStats:
    queries: int = 0  # prompt tokens looked up (first admissions only)
    hits: int = 0  # of which found cached (any tier)
    requests: int = 0
    hits_by_tier: dict[str, int] = field(default_factory=dict)  # tokens, "device" and each lower tier

    @property
    def hit_rate(self) -> float:
        return self.hits / self.queries if self.queries else 0.0


def shares_prefixes(request: Request) -> bool:
    """Whether the request reads and writes the prefix cache. One asking for its prompt's logprobs does
    neither: every prompt row must run (no hit), and its blocks, duplicates of cached ones where the prompt
    was seen before, would hold the cached copies locked beside its own."""
    return request.prompt_logprobs is None


class KVCacheManager:
    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_prefix_caching: bool = True,
        tiers: TieredKVStore | None = None,
        keep_tails: bool = True,
        events: KVEventLog | None = None,
        layout: KVLayout | None = None,
    ) -> None:
        self.block_size = block_size
        grouped = layout is not None and layout.is_grouped
        # Grouped: ``num_blocks`` pages, page 0 the null page the window tables point at once freed.
        self.pool = BlockPool(num_blocks, reserve_null=grouped)
        self.groups = GroupPages(layout, block_size, self.pool) if layout is not None and grouped else None
        self.pages_per_block = layout.num_groups if self.groups is not None and layout is not None else 1
        if self.groups is not None and tiers is not None:
            raise ValueError("KV tiers store whole blocks of every layer: not with grouped KV pages")
        # With the cache off nothing is hashed, locked or kept after a request, and the tiers, which only
        # extend the prefix cache, stay off too. Tails (partly filled blocks) are group 0's alone: not kept
        # when there are other groups.
        self.prefix_cache: PrefixCache = (
            RadixPrefixCache(block_size, self.pool, keep_tails and self.groups is None, events)
            if enable_prefix_caching else NoPrefixCache())
        self.tiers: Tiers = TierCoordinator(tiers, block_size) if tiers is not None and enable_prefix_caching else NoTiers()
        self.prefix_cache.on_evict = (self.groups.on_block_evicted if self.groups is not None
                                      else self.tiers.offload_evicted)
        self.enable_prefix_caching = enable_prefix_caching
        self.tier_names = [DEVICE, *self.tiers.names]
        self.stats = PrefixCacheStats(hits_by_tier=dict.fromkeys(self.tier_names, 0))

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    # --- admission ------------------------------------------------------------------------------------------
    def lookup(self, request: Request) -> PrefixHit:
        """Longest cached prefix of the request, leaving at least its last token to compute (for logits)."""
        if not shares_prefixes(request):
            return EMPTY_HIT
        max_blocks = (request.num_tokens - 1) // self.block_size
        match = self.prefix_cache.match(request, max_blocks)
        group_pages: list[list[int]] = []
        if self.groups is not None and match.block_ids:
            usable = self.groups.usable_hit(match.block_ids)
            if usable < len(match.block_ids):
                match = self.prefix_cache.match(request, usable)
            if match.block_ids:
                group_pages = self.groups.take_hit(match.block_ids)
        num_device = len(match.block_ids)
        loaded: list[tuple[str, bytes]] = []
        if num_device < max_blocks:
            fetched = self.tiers.lookup(request, num_device, max_blocks)
            if fetched is None:
                return PENDING_HIT
            loaded = fetched
        tail, tail_tokens = None, 0
        if not loaded:  # a tail continues the device blocks; the tiers keep full blocks only
            start = num_device * self.block_size
            stop = min(start + self.block_size - 1, request.num_tokens - 1)  # a tail holds less than a block
            found = self.prefix_cache.take_tail(match.handle, request, start, stop)
            if found is not None:
                tail, tail_tokens = found
                self.pool.acquire([tail.block_id])
        if not match.block_ids and not loaded and tail is None:
            return EMPTY_HIT
        handle = None
        if match.block_ids:
            self.prefix_cache.lock(match.handle)
            handle = match.handle
        return PrefixHit((num_device + len(loaded)) * self.block_size + tail_tokens, match.block_ids, handle, loaded,
                         tail=tail, tail_tokens=tail_tokens, group_block_ids=group_pages)

    def wait_for_fetches(self, timeout_s: float) -> None:
        """Block until a pending lower-tier read finishes (or the timeout): for an engine with nothing else
        to run, instead of spinning."""
        self.tiers.wait_for_fetches(timeout_s)

    def cached_prefix_length(self, request: Request) -> int:
        """Tokens a lookup would find now, without locking or touching anything (cache-aware ordering)."""
        if not shares_prefixes(request):
            return 0
        max_blocks = (request.num_tokens - 1) // self.block_size
        return self.prefix_cache.match_length(request, max_blocks) * self.block_size

    def release_hit(self, hit: PrefixHit) -> None:
        """Give back a hit that was not used (the request could not be admitted)."""
        if hit.handle is not None:
            self.prefix_cache.unlock(hit.handle)
        if hit.tail is not None:
            self.prefix_cache.restore_tail(hit.tail)
            self.pool.release([hit.tail.block_id])
        if self.groups is not None and hit.group_block_ids:
            self.groups.release_pages(hit.group_block_ids, hit.block_ids)

    def record_admission(self, request: Request, hit: PrefixHit) -> None:
        """Count a first admission's prefix lookup (re-admissions after preemption are not cache hits) and
        note in the request's metrics which tier each cached token came from."""
        self.stats.requests += 1
        self.stats.queries += request.num_prompt_tokens
        self.stats.hits += hit.num_tokens
        by_tier = hit.tokens_by_tier(self.block_size)
        request.metrics.cached_tokens_by_tier = {name: by_tier.get(name, 0) for name in self.tier_names}
        for name, num_tokens in by_tier.items():
            self.stats.hits_by_tier[name] = self.stats.hits_by_tier.get(name, 0) + num_tokens
        self.tiers.record_admission(request.num_prompt_tokens, by_tier)

    # --- allocation ---------------------------------------------------------------------------------------
    def allocate(self, request: Request, num_new_tokens: int, hit: PrefixHit = EMPTY_HIT) -> bool:
        """Make room for ``num_new_tokens`` more tokens of KV; with ``hit``, adopt the cached blocks first.

        Blocks of the hit found in a lower tier count as needed blocks: they are allocated here, queued
        for loading and inserted into the prefix cache. Returns False (and changes nothing, loads nothing)
        when the pool cannot provide the blocks even after evicting; the caller then releases the hit.
        """
        if self.groups is not None:
            self.groups.drop_out_of_window(request)
        num_existing = len(request.block_ids) + len(hit.block_ids) + (hit.tail is not None)
        num_computed = request.num_computed_tokens + hit.num_tokens
        num_needed = request.num_blocks_needed(num_computed + num_new_tokens, self.block_size) - num_existing
        if num_needed > 0 and not self._make_room(num_needed * self.pages_per_block, hit):
            return False
        if hit.block_ids:
            self.pool.acquire(hit.block_ids)
            request.block_ids.extend(hit.block_ids)
            request.cache_handle = hit.handle
            if self.groups is not None:
                self.groups.adopt(request, hit.group_block_ids)
        if hit.tail is not None:
            # The request writes its own tokens into the rest of the block: it is the request's alone now.
            self.pool.uncache(hit.tail.block_id)
            request.block_ids.append(hit.tail.block_id)
        if num_needed > 0:
            request.block_ids.extend(self.pool.allocate(num_needed))
            if self.groups is not None:
                self.groups.allocate(request, num_needed)
        request.num_computed_tokens += hit.num_tokens
        self.tiers.forget(request.request_id)
        if hit.loaded:
            self._adopt_loaded(request, hit)
        return True

    def _adopt_loaded(self, request: Request, hit: PrefixHit) -> None:
        """Queue the tier payloads into the blocks just allocated after the device hit, and put those blocks
        in the prefix cache at once (their tokens are known), so that concurrent requests share them too.

            block_ids  [ device hit | loaded from tiers | to compute ... ]
                       0            n_device            n_device + n_loaded
        """
        n_device, n_loaded = len(hit.block_ids), len(hit.loaded)
        assert len(request.block_ids) >= n_device + n_loaded and request.num_computed_tokens == hit.num_tokens, (
            f"{request} was not a fresh admission"
        )
        targets = request.block_ids[n_device : n_device + n_loaded]
        self.tiers.queue_loads([(block_id, payload) for block_id, (_, payload) in zip(targets, hit.loaded, strict=True)])
        self._set_handle(request, self.prefix_cache.insert(request, n_device + n_loaded, start=hit.handle))

    def _set_handle(self, request: Request, handle: object) -> None:
        """Move the request's lock to ``handle``, the new end of its cached run."""
        old = request.cache_handle
        if handle is not old:
            self.prefix_cache.lock(handle)
            if old is not None:
                self.prefix_cache.unlock(old)
            request.cache_handle = handle

    def _make_room(self, num_needed: int, hit: PrefixHit) -> bool:
        if num_needed <= self.pool.num_free:
            return True
        # Hit blocks are locked, so they cannot be evicted to make room for themselves.
        reserved = sum(1 for b in hit.block_ids if self.pool.ref_counts[b] == 0)
        if num_needed > self.pool.num_free + self.pool.num_evictable - reserved:
            return False
        # The pool's count is an upper bound: a block no request references can sit in a node another request
        # locks (its own copy of the block went into the tree on top of it). Evicting only to fail would empty
        # the cache for nothing, and again at every step the request waits: where the bound is tight, count
        # what the tree can give (a walk of the tree: not on every allocation of a full cache).
        tight = num_needed > self.pool.num_free + (self.pool.num_evictable - reserved) // 2
        if self.groups is None and tight and num_needed > self.pool.num_free + self.prefix_cache.num_evictable_blocks():
            return False
        # Least recently used prefixes first (each block with its group pages), then window pages no request
        # holds.
        while self.pool.num_free < num_needed:
            short = num_needed - self.pool.num_free
            if (not self.prefix_cache.evict(max(1, short // self.pages_per_block))
                    and not (self.groups is not None and self.groups.evict_idle(short))):
                break
        return num_needed <= self.pool.num_free

    def num_tokens_without_eviction(self, request: Request) -> int:
        """More tokens of KV the request could take from its own blocks and the free ones, evicting nothing."""
        free_blocks = self.pool.num_free // self.pages_per_block
        return (len(request.block_ids) + free_blocks) * self.block_size - request.num_computed_tokens

    # --- caching and freeing ------------------------------------------------------------------------------
    def cache_blocks(self, request: Request, num_tokens: int | None = None) -> None:
        """Insert the request's full blocks up to ``num_tokens`` (default: its computed tokens) into the prefix
        cache, so later and concurrent requests with the same prefix share them.

        The scheduler calls this when it schedules a chunk, before the chunk is computed: a request admitted
        later in the same step then shares those blocks instead of computing them again. That is safe because
        every layer writes the whole step's K/V before any attention reads it, and the blocks stay locked by
        this request. Copies to a write-through tier wait until the step has run (``step_done``)."""
        computing = num_tokens is not None
        num_full = (num_tokens if computing else request.num_computed_tokens) // self.block_size
        if num_full == 0 or not shares_prefixes(request):
            return
        if not self.tiers.write_through:
            start = self.prefix_cache.cached_depth(request.cache_handle)
            self._set_handle(request, self.prefix_cache.insert(request, num_full, start=request.cache_handle))
            if self.groups is not None and self.enable_prefix_caching:
                self.groups.attach(request, start, num_full)
            return
        # Blocks the insert newly hands the prefix cache go down to the tiers once computed (they are full).
        cached = self.pool.cached
        start = self.prefix_cache.cached_depth(request.cache_handle)
        fresh = [i for i in range(start, num_full) if not cached[request.block_ids[i]]]
        self._set_handle(request, self.prefix_cache.insert(request, num_full, start=request.cache_handle))
        hashes = request.full_block_hashes(self.block_size)
        identities = request.block_identities(self.block_size, start, num_full)
        self.tiers.queue_cached([(request.block_ids[i], hashes[i], identities[i - start])
                                 for i in fresh if cached[request.block_ids[i]]], after_step=computing)

    def step_done(self, offloaded: list[tuple[BlockHash, bytes]]) -> None:
        """The scheduled step ran: store the KV the runner copied out for the tiers; the blocks it filled may
        now be copied to a write-through tier."""
        self.tiers.step_done(offloaded)

    def free(self, request: Request) -> None:
        """Release a finished, aborted or preempted request's blocks. Cached blocks stay, evictable."""
        self.tiers.forget(request.request_id)
        self.cache_blocks(request)
        if shares_prefixes(request):
            self.prefix_cache.keep_tail(request)
        self.pool.release(request.block_ids)
        if self.groups is not None:
            self.groups.release(request)
        if request.cache_handle is not None:
            self.prefix_cache.unlock(request.cache_handle)
        request.cache_handle = None
        request.block_ids = []
        request.num_computed_tokens = 0

    # --- transfers to and from the tiers --------------------------------------------------------------------
    @property
    def has_pending_transfers(self) -> bool:
        return self.tiers.has_pending_transfers

    def take_transfers(self) -> tuple[list[tuple[int, bytes]], list[tuple[int, BlockHash]]]:
        """(loads, offloads) queued since the last call, handed to the runner; the queues start empty again."""
        return self.tiers.take_transfers()

    def wait_for_tier_writes(self, timeout_s: float | None = None) -> bool:
        """Block until the KV queued for disk and Redis is written; False if ``timeout_s`` passed first."""
        return self.tiers.wait_for_writes(timeout_s)

    def close(self, read_blocks: Callable[[list[int]], list[bytes]] | None) -> None:
        """Persist the cached KV the tiers that outlive the process lack (read with ``read_blocks``; None:
        nothing of the device's is persisted), then release the tiers."""
        blocks = self.tiers.blocks_to_persist(self.prefix_cache.cached_blocks()) if read_blocks is not None else []
        self.tiers.close(read_in_chunks(blocks, read_blocks) if blocks and read_blocks is not None else iter(()))

    # --- observability ------------------------------------------------------------------------------------
    @property
    def num_cached_blocks(self) -> int:
        """Blocks the prefix cache holds: full blocks and partly filled tails."""
        return self.prefix_cache.num_cached_blocks

    @property
    def num_evicted_blocks(self) -> int:
        return self.prefix_cache.num_evicted_blocks

    def check_invariants(self) -> None:
        self.pool.check_invariants()
        self.prefix_cache.check_invariants(self.groups.num_cached_pages if self.groups is not None else 0)
        if self.groups is not None:
            self.groups.check_invariants()
        for block_id in self.tiers.pending_load_block_ids():
            assert self.pool.ref_counts[block_id] > 0, f"block {block_id} queued for a load is not in use"


def read_in_chunks(blocks: list[CachedBlock], read_blocks: Callable[[list[int]], list[bytes]],
                   chunk: int = PERSIST_CHUNK_BLOCKS) -> Iterator[BlockKV]:
    """Each block's KV, read ``chunk`` blocks at a time as they are written: a shutdown that gathered the whole
    cache at once needed its size again in free device memory (or host memory, two or three times)."""
    for start in range(0, len(blocks), chunk):
        part = blocks[start:start + chunk]
        payloads = read_blocks([block_id for block_id, _, _ in part])
        yield from ((block_hash, identity, payload) for (_, block_hash, identity), payload in zip(part, payloads,
                                                                                                  strict=True))
