"""Host (DRAM) tier: a bounded LRU of payloads in this process's memory.

Payloads are kept unframed: memory of this process cannot be truncated or written by another model, so
there is nothing to verify. When a put pushes the tier over capacity, least-recently-used entries are
evicted and handed to ``on_evict(key, value)`` so the hierarchy can write them down to disk / Redis
(write-back). Expired entries are dropped, not handed down.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence

from kvserve.storage.base import TierStats
from kvserve.storage.lru_index import IndexEntry, LRUIndex

logger = logging.getLogger(__name__)

EvictCallback = Callable[[bytes, bytes], None]


class HostKVStore:
    """Bounded in-memory LRU. ``capacity_bytes`` bounds the sum of payload lengths (key and per-entry
    overhead are not counted). Thread-safe; ``on_evict`` is called outside the lock, in the thread whose
    put caused the eviction.
    """

    def __init__(
        self,
        capacity_bytes: int,
        retention_s: float,
        *,
        clock: Callable[[], float] = time.time,
        on_evict: EvictCallback | None = None,
        name: str = "host",
    ) -> None:
        self._index: LRUIndex[bytes] = LRUIndex(capacity_bytes, retention_s)  # entries hold the payloads
        self.name = name
        self.on_evict = on_evict
        self._clock = clock
        self._lock = threading.Lock()
        self._stats = TierStats()

    # --- sizes ------------------------------------------------------------------------------------------
    @property
    def capacity_bytes(self) -> int:
        return self._index.capacity_bytes

    @property
    def used_bytes(self) -> int:
        return self._index.used_bytes

    @property
    def num_entries(self) -> int:
        return len(self._index)

    @property
    def healthy(self) -> bool:
        return True

    def keys(self) -> list[bytes]:
        """Keys from least to most recently used (for tests and debugging)."""
        with self._lock:
            return self._index.keys()

    # --- reads ------------------------------------------------------------------------------------------
    def _live(self, key: bytes, now: float) -> IndexEntry[bytes] | None:
        """The entry under ``key`` if present and not expired; drops it if expired. Caller holds the lock."""
        if self._index.pop_if_expired(key, now):
            self._stats.expirations += 1
            return None
        return self._index.get(key)

    def contains(self, key: bytes) -> bool:
        """Presence without touching LRU order."""
        with self._lock:
            return self._live(key, self._clock()) is not None

    def contains_many(self, keys: Sequence[bytes]) -> list[bool]:
        with self._lock:
            now = self._clock()
            return [self._live(key, now) is not None for key in keys]

    def get(self, key: bytes) -> bytes | None:
        return self.get_many([key])[0]

    def get_many(self, keys: Sequence[bytes]) -> list[bytes | None]:
        start = time.perf_counter()
        out: list[bytes | None] = []
        with self._lock:
            now = self._clock()
            for key in keys:
                entry = self._live(key, now)
                if entry is None:
                    self._stats.misses += 1
                    out.append(None)
                    continue
                self._index.touch(key)
                self._stats.hits += 1
                self._stats.bytes_read += len(entry.value)
                out.append(entry.value)
            self._stats.load_latency_s += time.perf_counter() - start
            self._stats.load_count += 1
        return out

    # --- writes -----------------------------------------------------------------------------------------
    def put(self, key: bytes, value: bytes) -> bool:
        return self.put_many([(key, value)]) == 1

    def put_many(self, items: Sequence[tuple[bytes, bytes]]) -> int:
        evicted: list[tuple[bytes, bytes]] = []
        num_stored = 0
        with self._lock:
            now = self._clock()
            for key, value in items:
                if not isinstance(value, bytes):
                    value = bytes(value)  # own the memory: the caller may reuse its buffer
                if len(value) > self._index.capacity_bytes:
                    continue
                self._index.put(key, IndexEntry(len(value), now, value))
                self._stats.bytes_written += len(value)
                num_stored += 1
                evicted.extend(self._evict_over_capacity(now))
        self._hand_down(evicted)
        return num_stored

    def delete(self, key: bytes) -> None:
        with self._lock:
            self._index.remove(key)

    def sweep(self) -> int:
        """Drop every expired entry; returns how many."""
        with self._lock:
            expired = self._index.pop_expired(self._clock())
            self._stats.expirations += len(expired)
            return len(expired)

    def clear(self) -> None:
        with self._lock:
            self._index.clear()

    # --- internals --------------------------------------------------------------------------------------
    def _evict_over_capacity(self, now: float) -> list[tuple[bytes, bytes]]:
        """Pop LRU entries until within capacity; returns the live ones to hand down. Caller holds the lock."""
        evicted: list[tuple[bytes, bytes]] = []
        for key, entry in self._index.pop_lru_until_fits():
            if self._index.is_expired(entry, now):
                self._stats.expirations += 1
            else:
                self._stats.evictions += 1
                evicted.append((key, entry.value))
        return evicted

    def _hand_down(self, evicted: list[tuple[bytes, bytes]]) -> None:
        callback = self.on_evict
        if callback is None:
            return
        for key, value in evicted:
            try:
                callback(key, value)
            except Exception as e:  # a lower tier's bug must not fail the put that evicted
                with self._lock:
                    self._stats.errors += 1
                logger.warning("%s: on_evict callback failed for key %s: %r", self.name, key.hex(), e)

    # --- reporting --------------------------------------------------------------------------------------
    def stats(self) -> TierStats:
        with self._lock:
            snapshot = self._stats.copy()
            snapshot.entries = len(self._index)
            snapshot.bytes_held = self._index.used_bytes
            return snapshot

    def close(self) -> None:
        self.clear()
