"""Moves KV between device blocks and the tiers below (host, disk, Redis) without stalling the step loop.

The KV manager queues transfers; the scheduler hands them to the runner in its ``SchedulerOutput``
(``take_transfers``) and gives back what the runner copied out (``store_offloaded``)::

    offload  (block_id, block_hash)  the tree evicted the block (write_back), or inserted it (write_through);
                                     the runner copies it out FIRST, before anything writes into the block;
                                     the block's identity (parent hash, token ids) waits here for its KV
    load     (block_id, payload)     a lookup found the run after the device match in a tier: fresh device
                                     blocks are allocated and inserted into the tree at once, the runner
                                     writes their KV before the forward that reads them

Three threads touch the tiers, each store guarding itself with its own lock:

    engine loop    host tier reads and writes (DRAM copies), disk presence (an in-memory index)
    fetch thread   a waiting request's lookup in disk and Redis (Redis is asked even for presence here)
    writer thread  every write to disk and Redis, and the periodic sweep of expired entries

so a Redis that stops answering costs waiting requests their lower-tier hit, never a step of the others.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from typing import Protocol

from kvserve.block_hash import BlockHash
from kvserve.cache.tiers import BlockKV, TieredKVStore
from kvserve.request import Request
from kvserve.storage.base import KVStore, TierStats

logger = logging.getLogger(__name__)

Loaded = list[tuple[str, bytes]]  # (tier name, payload) per block of a run found below device memory
CachedBlock = tuple[int, BlockHash, bytes]  # (block id, chained hash, block_identity) of a full device block
# Payloads queued for the disk and Redis tiers at most: past it a write is dropped (a later miss), not queued.
MAX_QUEUED_WRITE_BYTES = 1 << 30
# KV read from the lower tiers for waiting requests and held until they are admitted, at most: past it a new
# lookup is a miss (the request computes its prefix) instead of one more run held in host memory.
MAX_HELD_FETCH_BYTES = 1 << 30


class Tiers(Protocol):
    """The KV manager's view of the tiers below device memory."""

    names: list[str]
    write_through: bool

    def lookup(self, request: Request, start: int, stop: int) -> Loaded | None:
        """Full blocks start..stop of a waiting request's prefix found below device memory ([] when none), or
        None while they are still being read: ask again at a later step."""
        ...

    def forget(self, request_id: str) -> None: ...

    def wait_for_fetches(self, timeout_s: float) -> None: ...

    def queue_loads(self, loads: list[tuple[int, bytes]]) -> None: ...

    def offload_evicted(self, block_id: int, block_hash: BlockHash, identity: bytes) -> None: ...

    def queue_cached(self, blocks: list[CachedBlock], after_step: bool) -> None: ...

    def step_done(self, offloaded: list[tuple[BlockHash, bytes]]) -> None: ...

    @property
    def has_pending_transfers(self) -> bool: ...

    def pending_load_block_ids(self) -> list[int]: ...

    def take_transfers(self) -> tuple[list[tuple[int, bytes]], list[tuple[int, BlockHash]]]: ...

    def record_admission(self, num_query_tokens: int, tokens_by_tier: dict[str, int]) -> None: ...

    def blocks_to_persist(self, cached: list[CachedBlock]) -> list[CachedBlock]: ...

    def wait_for_writes(self, timeout_s: float | None = None) -> bool: ...

    def close(self, blocks: Iterable[BlockKV]) -> None: ...

    def stats(self) -> dict[str, TierStats]: ...

    def healthy(self) -> dict[str, bool]: ...


class NoTiers:
    """No tiers below device memory: nothing is looked up, queued or written."""

    names: list[str] = []
    write_through = False
    has_pending_transfers = False

    def lookup(self, request: Request, start: int, stop: int) -> Loaded | None:
        return []

    def forget(self, request_id: str) -> None:
        return None

    def wait_for_fetches(self, timeout_s: float) -> None:
        return None

    def queue_loads(self, loads: list[tuple[int, bytes]]) -> None:
        assert not loads, "no tier to load from"

    def offload_evicted(self, block_id: int, block_hash: BlockHash, identity: bytes) -> None:
        return None

    def queue_cached(self, blocks: list[CachedBlock], after_step: bool) -> None:
        return None

    def step_done(self, offloaded: list[tuple[BlockHash, bytes]]) -> None:
        return None

    def pending_load_block_ids(self) -> list[int]:
        return []

    def take_transfers(self) -> tuple[list[tuple[int, bytes]], list[tuple[int, BlockHash]]]:
        return [], []

    def record_admission(self, num_query_tokens: int, tokens_by_tier: dict[str, int]) -> None:
        return None

    def blocks_to_persist(self, cached: list[CachedBlock]) -> list[CachedBlock]:
        return []

    def wait_for_writes(self, timeout_s: float | None = None) -> bool:
        return True

    def close(self, blocks: Iterable[BlockKV]) -> None:
        return None

    def stats(self) -> dict[str, TierStats]:
        return {}

    def healthy(self) -> dict[str, bool]:
        return {}


@dataclass(slots=True)
class _TierFetch:
    """A waiting request's lower-tier lookup of blocks start..stop, kept until the request is admitted, so
    that a request waiting for memory does not read its run again every step."""

    start: int
    stop: int  # the blocks read: the ones asked for, or fewer where the bound on held reads cut the run
    block_hashes: list[BlockHash]
    identities: list[bytes]
    future: Future[tuple[list[KVStore], list[bytes | None]]] | None  # None: read on the engine loop
    loaded: Loaded | None = None
    asked_stop: int = 0  # the run's end the lookup asked for (a lookup asking the same is this fetch)


def _payload_bytes(entries: Sequence[tuple[bytes, bytes]]) -> int:
    return sum(len(value) for _, value in entries)


def _cancel(fetch: _TierFetch | None) -> None:
    """Drop a fetch's read if it has not started (no-op once it has)."""
    if fetch is not None and fetch.future is not None:
        fetch.future.cancel()


class TierWriter:
    """One thread that runs write jobs in order; ``drain`` waits until every queued job has run. At most
    ``max_queued_bytes`` of payloads wait: a write that would go past it is dropped (the tiers are a cache: a
    dropped write costs a later miss), so that a tier slower than the step loop cannot fill the host's memory."""

    def __init__(self, name: str = "kvserve-tier-writer", max_queued_bytes: int = MAX_QUEUED_WRITE_BYTES) -> None:
        self._jobs: deque[tuple[Callable[[], object], int]] = deque()
        self._cond = threading.Condition()
        self._num_unfinished = 0
        self._queued_bytes = 0
        self._max_queued_bytes = max_queued_bytes
        self.num_dropped = 0  # write jobs dropped for want of room
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    @property
    def num_pending(self) -> int:
        """Jobs queued or running."""
        return self._num_unfinished

    def submit(self, job: Callable[[], object], num_bytes: int = 0) -> bool:
        """Queue ``job`` (writing ``num_bytes`` of payloads); False if it was dropped for want of room."""
        with self._cond:
            # A job is always taken when nothing waits (however large); past the bound, the tier is behind.
            if num_bytes and self._queued_bytes and self._queued_bytes + num_bytes > self._max_queued_bytes:
                self.num_dropped += 1
                if self.num_dropped % 1000 == 1:
                    logger.warning("KV tier writes are %d bytes behind: a write was dropped (%d so far); the tier "
                                   "is slower than the blocks come", self._queued_bytes, self.num_dropped)
                return False
            self._jobs.append((job, num_bytes))
            self._queued_bytes += num_bytes
            self._num_unfinished += 1
            self._cond.notify_all()
            return True

    def drain(self, timeout_s: float | None = None) -> bool:
        """True once every job submitted so far has run; False if ``timeout_s`` passed first."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        with self._cond:
            while self._num_unfinished:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return False
                self._cond.wait(left)
        return True

    def stop(self, timeout_s: float | None = None) -> None:
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        self._thread.join(timeout_s)

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._jobs and not self._stopping:
                    self._cond.wait()
                if not self._jobs:
                    return
                job, num_bytes = self._jobs.popleft()
            try:
                job()
            except Exception:  # the tiers never raise by contract; a bug here must not end the thread
                logger.exception("a KV tier write failed")
            finally:
                with self._cond:
                    self._num_unfinished -= 1
                    self._queued_bytes -= num_bytes
                    self._cond.notify_all()


class TierCoordinator:
    """The transfer queues, the write policy, the fetch and writer threads, and persistence for a
    ``TieredKVStore`` (see the module docstring)."""

    def __init__(self, store: TieredKVStore, block_size: int, clock: Callable[[], float] = time.monotonic) -> None:
        self.store = store
        self.block_size = block_size
        self.names = list(store.names)
        self.write_through = store.write_through
        self._clock = clock
        self._pending_loads: list[tuple[int, bytes]] = []
        self._pending_offloads: list[CachedBlock] = []
        # Write-through copies of blocks scheduled but not yet computed (see queue_cached).
        self._offloads_after_step: list[CachedBlock] = []
        # The identities of the blocks the runner copies out this step, by block hash: taken with the transfers,
        # read when their payloads come back (an interrupted step's are replaced by the next step's).
        self._offload_identities: dict[BlockHash, bytes] = {}
        self._fetches: dict[str, _TierFetch] = {}
        self._block_bytes = store.identity_nbytes + (store.payload_nbytes or 0)
        self._fetch_pool = ThreadPoolExecutor(1, thread_name_prefix="kvserve-tier-fetch")
        self._writer = TierWriter()
        self._next_sweep = clock() + store.sweep_interval_s

    # --- lookups ------------------------------------------------------------------------------------------
    def lookup(self, request: Request, start: int, stop: int) -> Loaded | None:
        request_id = request.request_id
        fetch = self._fetches.get(request_id)
        if fetch is None or (fetch.start, fetch.asked_stop) != (start, stop):
            _cancel(fetch)  # a read for a range no longer wanted must not hold up the others' on the one thread
            self._fetches.pop(request_id, None)
            # The run is read as far as the bound on held reads leaves room for (its first blocks are what a hit
            # needs most); none at all: a miss.
            room = (MAX_HELD_FETCH_BYTES - self._held_fetch_bytes()) // max(1, self._block_bytes)
            read_stop = min(stop, start + max(0, room))
            if read_stop <= start:
                return []
            block_hashes = request.full_block_hashes(self.block_size)[start:read_stop]
            identities = request.block_identities(self.block_size, start, read_stop)
            fetch = self._start_fetch(block_hashes, identities, start, read_stop)
            if fetch is None:
                return []
            fetch.asked_stop = stop
            self._fetches[request_id] = fetch
        if fetch.loaded is None:
            assert fetch.future is not None
            if not fetch.future.done():
                return None
            owners, payloads = fetch.future.result()
            fetch.loaded = self._finish(fetch.block_hashes, fetch.identities, owners, payloads)
        return fetch.loaded

    def _held_fetch_bytes(self) -> int:
        """What the waiting requests' lookups hold or will hold once read (a run's blocks at their size)."""
        return sum((f.stop - f.start) * self._block_bytes for f in self._fetches.values())

    def _start_fetch(self, block_hashes: list[BlockHash], identities: list[bytes], start: int,
                     stop: int) -> _TierFetch | None:
        store = self.store
        if store.remote:
            # Even presence is a round trip to Redis: the whole lookup runs on the fetch thread.
            future = self._fetch_pool.submit(self._locate_and_fetch, block_hashes)
            return _TierFetch(start, stop, block_hashes, identities, future)
        owners = store.locate(block_hashes)
        if not owners:
            return None
        if store.needs_io(owners):
            future = self._fetch_pool.submit(lambda: (owners, store.fetch(block_hashes, owners)))
            return _TierFetch(start, stop, block_hashes, identities, future)
        loaded = self._finish(block_hashes, identities, owners, store.fetch(block_hashes, owners))
        return _TierFetch(start, stop, block_hashes, identities, None, loaded)

    def _locate_and_fetch(self, block_hashes: list[BlockHash]) -> tuple[list[KVStore], list[bytes | None]]:
        owners = self.store.locate(block_hashes)
        return owners, self.store.fetch(block_hashes, owners) if owners else []

    def _finish(self, block_hashes: list[BlockHash], identities: list[bytes], owners: list[KVStore],
                payloads: list[bytes | None]) -> Loaded:
        loaded = self.store.finish(block_hashes, identities, owners, payloads) if owners else []
        self._write_handed_down()  # promotion into the host tier may have pushed entries down
        refused = self.store.take_refused()
        # The host tier's in memory, at once (a recomputed block may be stored there before the writer runs);
        # disk and Redis on the writer thread, in order before any later write of the same key.
        self.store.delete_refused([r for r in refused if r[0] is self.store.host])
        lower = [r for r in refused if r[0] is not self.store.host]
        if lower:
            self._writer.submit(lambda: self.store.delete_refused(lower))
        return loaded

    def forget(self, request_id: str) -> None:
        _cancel(self._fetches.pop(request_id, None))

    def wait_for_fetches(self, timeout_s: float) -> None:
        """Block until a pending lower-tier read finishes (or the timeout): for an engine with nothing else
        to run, instead of spinning."""
        futures = [f.future for f in self._fetches.values() if f.future is not None and f.loaded is None]
        if futures:
            wait(futures, timeout=timeout_s, return_when=FIRST_COMPLETED)

    # --- transfer queues ----------------------------------------------------------------------------------
    def queue_loads(self, loads: list[tuple[int, bytes]]) -> None:
        self._pending_loads.extend(loads)

    def offload_evicted(self, block_id: int, block_hash: BlockHash, identity: bytes) -> None:
        """Tree eviction hook (write_back): copy the block out before it is reused, unless the first local
        tier already holds it (it was loaded from there, or offloaded before)."""
        if not self.write_through and not self.store.holds(block_hash):
            self._pending_offloads.append((block_id, block_hash, identity))

    def queue_cached(self, blocks: list[CachedBlock], after_step: bool) -> None:
        """Write-through: blocks the tree just took go down to every tier, once their KV is computed
        (``after_step``: the step that computes them is still to run)."""
        (self._offloads_after_step if after_step else self._pending_offloads).extend(blocks)

    def step_done(self, offloaded: list[tuple[BlockHash, bytes]]) -> None:
        """After a step: store what the runner copied out, release the write-through copies of the blocks
        the step filled, and now and then sweep expired entries."""
        if offloaded:
            blocks = [(block_hash, self._offload_identities[block_hash], payload)
                      for block_hash, payload in offloaded if block_hash in self._offload_identities]
            direct = self.store.put_host(blocks)
            if direct:
                self._writer.submit(lambda: self.store.write_lower(direct), _payload_bytes(direct))
            self._write_handed_down()
        if self._offloads_after_step:
            self._pending_offloads.extend(self._offloads_after_step)
            self._offloads_after_step.clear()
        now = self._clock()
        if now >= self._next_sweep:
            self._writer.submit(self.store.sweep)
            self._next_sweep = now + self.store.sweep_interval_s

    def _write_handed_down(self) -> None:
        handed_down = self.store.take_handed_down()
        if handed_down:
            self._writer.submit(lambda: self.store.write_down(handed_down), _payload_bytes(handed_down))

    @property
    def has_pending_transfers(self) -> bool:
        return bool(self._pending_loads or self._pending_offloads)

    def pending_load_block_ids(self) -> list[int]:
        return [block_id for block_id, _ in self._pending_loads]

    def take_transfers(self) -> tuple[list[tuple[int, bytes]], list[tuple[int, BlockHash]]]:
        """(loads, offloads) queued since the last call, handed to the runner; the queues start empty again."""
        loads, offloads = self._pending_loads, self._pending_offloads
        self._pending_loads, self._pending_offloads = [], []
        self._offload_identities = {block_hash: identity for _, block_hash, identity in offloads}
        return loads, [(block_id, block_hash) for block_id, block_hash, _ in offloads]

    # --- accounting, persistence, shutdown ------------------------------------------------------------------
    def record_admission(self, num_query_tokens: int, tokens_by_tier: dict[str, int]) -> None:
        self.store.record_admission(num_query_tokens, tokens_by_tier)

    def blocks_to_persist(self, cached: list[CachedBlock]) -> list[CachedBlock]:
        """Cached device blocks the lower tiers may not hold yet: what a shutdown must copy out."""
        if not self.store.lower:
            return []
        self.wait_for_writes()
        return [block for block in cached if not self.store.holds(block[1])]

    @property
    def num_pending_writes(self) -> int:
        return self._writer.num_pending

    def wait_for_writes(self, timeout_s: float | None = None) -> bool:
        return self._writer.drain(timeout_s)

    def close(self, blocks: Iterable[BlockKV]) -> None:
        """Write what is queued, persist ``blocks`` and the host tier's entries to disk and Redis, release."""
        self.wait_for_writes()
        self.store.persist(blocks)
        self._writer.stop()
        self._fetch_pool.shutdown(wait=False, cancel_futures=True)
        self.store.close()

    def stats(self) -> dict[str, TierStats]:
        return self.store.stats()

    def healthy(self) -> dict[str, bool]:
        return self.store.healthy()
