"""The scheduler's only window onto KV memory: prefix lookup, block allocation, caching and freeing.

The scheduler sees ``PrefixHit`` (how many tokens are cached) and booleans; the radix tree, reference
counts and the lower storage tiers stay behind this class. While a request holds a hit or runs, the
blocks on its path are locked in the tree and cannot be evicted.

With tiers (``TieredKVStore``), KV moves between device blocks and the tiers as queued transfers that
the scheduler hands the runner in its ``SchedulerOutput`` (``take_transfers``)::

    offload  (block_id, block_hash)  the tree evicted the block (write_back), or inserted it (write_through);
                                     the runner copies it out FIRST, before anything writes into the block,
                                     and the engine stores what it copied (``store_offloaded``)
    load     (block_id, payload)     a lookup found the run after the device match in a tier: fresh device
                                     blocks are allocated and inserted into the tree at once, the runner
                                     writes their KV before the forward that reads them

A block id can appear in both queues of one step (evicted, then reallocated for a load): offloads first.
"""

from __future__ import annotations

from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field

from kvserve.cache.block_pool import BlockPool
from kvserve.cache.radix_cache import RadixCache, RadixNode, TailBlock
from kvserve.cache.tiers import TieredKVStore
from kvserve.request import BlockHash, Request
from kvserve.storage.base import KVStore

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
    node: RadixNode | None = None
    loaded: list[tuple[str, bytes]] = field(default_factory=list)
    # True: part of the prefix is being read from disk or Redis off the engine loop; admit the request
    # later (other requests run meanwhile). Holds no lock.
    pending: bool = False
    tail: TailBlock | None = None
    tail_tokens: int = 0

    def tokens_by_tier(self, block_size: int) -> dict[str, int]:
        out = {DEVICE: len(self.block_ids) * block_size + self.tail_tokens}
        for tier, _ in self.loaded:
            out[tier] = out.get(tier, 0) + block_size
        return out


EMPTY_HIT = PrefixHit(0)
PENDING_HIT = PrefixHit(0, pending=True)


@dataclass(slots=True)
class _TierFetch:
    """A waiting request's lower-tier lookup: blocks start..stop of its prefix, fetched on a worker thread."""

    start: int
    stop: int
    owners: list[KVStore]
    future: Future[list[bytes | None]] | None  # None: no I/O needed (host only) or already finished
    loaded: list[tuple[str, bytes]] | None = None  # set once finished, kept until the request is admitted


@dataclass(slots=True)
class PrefixCacheStats:
    queries: int = 0  # prompt tokens looked up (first admissions only)
    hits: int = 0  # of which found cached (any tier)
    requests: int = 0
    hits_by_tier: dict[str, int] = field(default_factory=dict)  # tokens, "device" and each lower tier

    @property
    def hit_rate(self) -> float:
        return self.hits / self.queries if self.queries else 0.0


class KVCacheManager:
    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_prefix_caching: bool = True,
        tiers: TieredKVStore | None = None,
    ) -> None:
        self.block_size = block_size
        self.pool = BlockPool(num_blocks)
        # With the cache off there is no tree at all: nothing is hashed, locked or kept after a request.
        self.tree = RadixCache(block_size, self.pool) if enable_prefix_caching else None
        # Tiers only extend the prefix cache: without a tree there is nothing to look up or offload.
        self.tiers = tiers if self.tree is not None else None
        self.tier_names = [DEVICE] + (self.tiers.names if self.tiers is not None else [])
        self.stats = PrefixCacheStats(hits_by_tier=dict.fromkeys(self.tier_names, 0))
        self.pending_loads: list[tuple[int, bytes]] = []
        self.pending_offloads: list[tuple[int, BlockHash]] = []
        # Write-through copies of blocks scheduled but not yet computed (see cache_blocks).
        self._offloads_after_step: list[tuple[int, BlockHash]] = []
        self._write_through = self.tiers is not None and self.tiers.write_through
        # Lower-tier lookups of waiting requests, by request id. Disk and Redis reads run on one worker thread
        # while the engine keeps stepping; a finished lookup is kept until its request is admitted, so a
        # request that waits for memory does not re-read its run every step.
        self._fetches: dict[str, _TierFetch] = {}
        self._fetch_pool = (ThreadPoolExecutor(1, thread_name_prefix="kvserve-tier-fetch")
                            if self.tiers is not None and self.tiers.lower else None)
        if self.tiers is not None and self.tree is not None and not self._write_through:
            self.tree.on_evict = self._offload_evicted

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
        hashes = request.full_block_hashes(self.block_size)
        match = self.tree.match_prefix(hashes, request.all_token_ids, max_blocks)
        num_device = len(match.block_ids)
        loaded: list[tuple[str, bytes]] = []
        if self.tiers is not None and num_device < max_blocks:
            fetched = self._tier_lookup(request, hashes, num_device, max_blocks)
            if fetched is None:
                return PENDING_HIT
            loaded = fetched
        tail, tail_tokens = None, 0
        if not loaded and match.node.tails:  # a tail continues the device blocks; the tiers keep full blocks only
            start = num_device * self.block_size
            stop = min(start + self.block_size - 1, request.num_tokens - 1)  # a tail holds less than a block
            found = self.tree.take_tail(match.node, request.all_token_ids[start:stop], request.hash_extra)
            if found is not None:
                tail, tail_tokens = found
                self.pool.acquire([tail.block_id])
        if not match.block_ids and not loaded and tail is None:
            return EMPTY_HIT
        node = None
        if match.block_ids:
            self.tree.lock(match.node)
            node = match.node
        return PrefixHit((num_device + len(loaded)) * self.block_size + tail_tokens, match.block_ids, node, loaded,
                         tail=tail, tail_tokens=tail_tokens)

    def _tier_lookup(
        self, request: Request, hashes: list[BlockHash], start: int, stop: int
    ) -> list[tuple[str, bytes]] | None:
        """Blocks start..stop from the lower tiers, or None while they are still being read."""
        assert self.tiers is not None
        fetch = self._fetches.get(request.request_id)
        if fetch is None or (fetch.start, fetch.stop) != (start, stop):
            owners = self.tiers.locate(hashes[start:stop])
            if not owners:
                self._fetches.pop(request.request_id, None)
                return []
            future = None
            if self._fetch_pool is not None and self.tiers.needs_io(owners):
                future = self._fetch_pool.submit(self.tiers.fetch, hashes[start:stop], owners)
            else:
                payloads = self.tiers.fetch(hashes[start:stop], owners)
            fetch = self._fetches[request.request_id] = _TierFetch(start, stop, owners, future)
            if future is None:
                fetch.loaded = self.tiers.finish(hashes[start:stop], owners, payloads)
        if fetch.loaded is None:
            assert fetch.future is not None
            if not fetch.future.done():
                return None
            fetch.loaded = self.tiers.finish(hashes[start:stop], fetch.owners, fetch.future.result())
        return fetch.loaded

    def wait_for_fetches(self, timeout_s: float) -> None:
        """Block until a pending lower-tier read finishes (or the timeout): for an engine with nothing else
        to run, instead of spinning."""
        futures = [f.future for f in self._fetches.values() if f.future is not None and f.loaded is None]
        if futures:
            wait(futures, timeout=timeout_s, return_when=FIRST_COMPLETED)

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
        if hit.tail is not None and self.tree is not None:
            self.tree.restore_tail(hit.tail)
            self.pool.release([hit.tail.block_id])

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
        if self.tiers is not None:
            self.tiers.record_admission(request.num_prompt_tokens, by_tier)

    # --- allocation ---------------------------------------------------------------------------------------
    def allocate(self, request: Request, num_new_tokens: int, hit: PrefixHit = EMPTY_HIT) -> bool:
        """Make room for ``num_new_tokens`` more tokens of KV; with ``hit``, adopt the cached blocks first.

        Blocks of the hit found in a lower tier count as needed blocks: they are allocated here, queued
        for loading and inserted into the tree. Returns False (and changes nothing, loads nothing) when the
        pool cannot provide the blocks even after evicting; the caller then releases the hit.
        """
        num_existing = len(request.block_ids) + len(hit.block_ids) + (hit.tail is not None)
        num_computed = request.num_computed_tokens + hit.num_tokens
        num_needed = request.num_blocks_needed(num_computed + num_new_tokens, self.block_size) - num_existing
        if num_needed > 0 and not self._make_room(num_needed, hit):
            return False
        if hit.block_ids:
            self.pool.acquire(hit.block_ids)
            request.block_ids.extend(hit.block_ids)
            request.cache_handle = hit.node
        if hit.tail is not None:
            # The request writes its own tokens into the rest of the block: it is the request's alone now.
            self.pool.uncache(hit.tail.block_id)
            request.block_ids.append(hit.tail.block_id)
        if num_needed > 0:
            request.block_ids.extend(self.pool.allocate(num_needed))
        request.num_computed_tokens += hit.num_tokens
        self._fetches.pop(request.request_id, None)
        if hit.loaded:
            self._adopt_loaded(request, hit)
        return True

    def _adopt_loaded(self, request: Request, hit: PrefixHit) -> None:
        """Queue the tier payloads into the blocks just allocated after the device hit, and put those blocks
        in the tree at once (their tokens are known), so that concurrent requests share them too.

            block_ids  [ device hit | loaded from tiers | to compute ... ]
                       0            n_device            n_device + n_loaded
        """
        assert self.tree is not None
        n_device, n_loaded = len(hit.block_ids), len(hit.loaded)
        assert len(request.block_ids) >= n_device + n_loaded and request.num_computed_tokens == hit.num_tokens, (
            f"{request} was not a fresh admission"
        )
        targets = request.block_ids[n_device : n_device + n_loaded]
        self.pending_loads.extend((block_id, payload) for block_id, (_, payload) in zip(targets, hit.loaded, strict=True))
        node: RadixNode | None = hit.node
        hashes = request.full_block_hashes(self.block_size)
        new_node = self.tree.insert(hashes, request.all_token_ids, request.block_ids[: n_device + n_loaded], start=node)
        if new_node is not node:
            self.tree.lock(new_node)
            if node is not None:
                self.tree.unlock(node)
            request.cache_handle = new_node

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

    def num_tokens_without_eviction(self, request: Request) -> int:
        """More tokens of KV the request could take from its own blocks and the free ones, evicting nothing."""
        return (len(request.block_ids) + self.pool.num_free) * self.block_size - request.num_computed_tokens

    def can_fit(self, num_blocks: int) -> bool:
        return num_blocks <= self.pool.num_free + self.pool.num_evictable

    # --- caching and freeing ------------------------------------------------------------------------------
    def cache_blocks(self, request: Request, num_tokens: int | None = None) -> None:
        """Insert the request's full blocks up to ``num_tokens`` (default: its computed tokens) into the tree,
        so later and concurrent requests with the same prefix share them.

        The scheduler calls this when it schedules a chunk, before the chunk is computed: a request admitted
        later in the same step then shares those blocks instead of computing them again. That is safe because
        every layer writes the whole step's K/V before any attention reads it, and the blocks stay locked by
        this request. Copies to a write-through tier wait for ``mark_step_computed``."""
        if self.tree is None:
            return
        computing = num_tokens is not None
        num_full = (num_tokens if computing else request.num_computed_tokens) // self.block_size
        node: RadixNode | None = request.cache_handle  # type: ignore[assignment]
        if num_full == 0 or (node is not None and node.depth >= num_full):
            return
        hashes = request.full_block_hashes(self.block_size)
        if self._write_through:
            # Blocks the insert below newly hands the tree go down to the tiers once computed (they are full).
            start = node.depth if node is not None else 0
            fresh = [i for i in range(start, num_full) if not self.pool.cached[request.block_ids[i]]]
        new_node = self.tree.insert(hashes, request.all_token_ids, request.block_ids[:num_full], start=node)
        if self._write_through:
            queue = self._offloads_after_step if computing else self.pending_offloads
            queue.extend((request.block_ids[i], hashes[i]) for i in fresh if self.pool.cached[request.block_ids[i]])
        if new_node is not node:
            self.tree.lock(new_node)
            if node is not None:
                self.tree.unlock(node)
            request.cache_handle = new_node

    def mark_step_computed(self) -> None:
        """The scheduled step ran: the blocks it filled may now be copied to a write-through tier."""
        if self._offloads_after_step:
            self.pending_offloads.extend(self._offloads_after_step)
            self._offloads_after_step.clear()

    def free(self, request: Request) -> None:
        """Release a finished, aborted or preempted request's blocks. Cached blocks stay, evictable."""
        self._fetches.pop(request.request_id, None)
        self.cache_blocks(request)
        self._keep_tail(request)
        self.pool.release(request.block_ids)
        if request.cache_handle is not None and self.tree is not None:
            self.tree.unlock(request.cache_handle)  # type: ignore[arg-type]
        request.cache_handle = None
        request.block_ids = []
        request.num_computed_tokens = 0

    def _keep_tail(self, request: Request) -> None:
        """Hand the tree the request's last, partly filled block of computed KV (see ``TailBlock``): the
        next turn of a conversation starts with those tokens."""
        if self.tree is None:
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

    # --- transfers to and from the tiers --------------------------------------------------------------------
    def _offload_evicted(self, block_id: int, block_hash: BlockHash) -> None:
        """Tree eviction hook (write_back): copy the block out before it is reused, unless the first local
        tier already holds it (it was loaded from there, or offloaded before)."""
        assert self.tiers is not None
        if not self.tiers.holds(block_hash):
            self.pending_offloads.append((block_id, block_hash))

    @property
    def has_pending_transfers(self) -> bool:
        return bool(self.pending_loads or self.pending_offloads)

    def take_transfers(self) -> tuple[list[tuple[int, bytes]], list[tuple[int, BlockHash]]]:
        """(loads, offloads) queued since the last call, handed to the runner; the queues start empty again."""
        loads, offloads = self.pending_loads, self.pending_offloads
        self.pending_loads, self.pending_offloads = [], []
        return loads, offloads

    def blocks_to_persist(self) -> list[tuple[int, BlockHash]]:
        """Cached device blocks the lower tiers may not hold yet: what a shutdown must copy out."""
        if self.tree is None or self.tiers is None or not self.tiers.lower:
            return []
        return [(block_id, block_hash) for block_id, block_hash in self.tree.cached_blocks()
                if not self.tiers.holds(block_hash)]

    def store_offloaded(self, blocks: list[tuple[BlockHash, bytes]]) -> None:
        """Blocks the runner copied out of device memory: into the tiers."""
        if self.tiers is not None and blocks:
            self.tiers.put_blocks(blocks)

    # --- observability ------------------------------------------------------------------------------------
    @property
    def num_cached_blocks(self) -> int:
        """Blocks the prefix cache holds: full blocks in the tree and partly filled tails."""
        return self.tree.num_cached_blocks + self.tree.num_tail_blocks if self.tree is not None else 0

    @property
    def num_evicted_blocks(self) -> int:
        return self.tree.num_evicted_blocks if self.tree is not None else 0

    def check_invariants(self) -> None:
        self.pool.check_invariants()
        if self.tree is not None:
            self.tree.check_invariants()
        for block_id, _ in self.pending_loads:
            assert self.pool.ref_counts[block_id] > 0, f"block {block_id} queued for a load is not in use"
