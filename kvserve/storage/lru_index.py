"""The index the host and disk tiers share: entries in least-recently-used order, bounded in bytes, each
expiring ``retention_s`` after it was written.

Not thread-safe: the tier that owns an index holds its own lock around every call. The index decides
which entries go; the tier does what their going means (hand a payload down, delete a file) and counts it.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Generic, TypeVar

V = TypeVar("V")


@dataclass(slots=True)
class IndexEntry(Generic[V]):
    size: int  # bytes it counts against the capacity
    created_at: float  # when it was written, on the tier's clock
    value: V  # what the tier keeps in memory for it (the payload, or None when it lives elsewhere)


class LRUIndex(Generic[V]):
    """Keys to entries, least recently used first, with the sum of their sizes."""

    def __init__(self, capacity_bytes: int, retention_s: float) -> None:
        if capacity_bytes < 0:
            raise ValueError(f"capacity_bytes must be >= 0, got {capacity_bytes}")
        if retention_s <= 0:
            raise ValueError(f"retention_s must be > 0, got {retention_s}")
        self.capacity_bytes = capacity_bytes
        self.retention_s = retention_s
        self._entries: OrderedDict[bytes, IndexEntry[V]] = OrderedDict()
        self._used = 0

    # --- sizes ------------------------------------------------------------------------------------------
    @property
    def used_bytes(self) -> int:
        return self._used

    def __len__(self) -> int:
        return len(self._entries)

    def keys(self) -> list[bytes]:
        """Keys from least to most recently used."""
        return list(self._entries)

    # --- lookups ----------------------------------------------------------------------------------------
    def get(self, key: bytes) -> IndexEntry[V] | None:
        """The entry under ``key``, expired or not, without touching the LRU order."""
        return self._entries.get(key)

    def is_expired(self, entry: IndexEntry[V], now: float) -> bool:
        return now - entry.created_at >= self.retention_s

    def pop_if_expired(self, key: bytes, now: float) -> bool:
        """Remove the entry under ``key`` if it has expired; whether it did."""
        entry = self._entries.get(key)
        if entry is None or not self.is_expired(entry, now):
            return False
        self.remove(key)
        return True

    def touch(self, key: bytes) -> None:
        """Mark ``key`` most recently used."""
        self._entries.move_to_end(key)

    # --- changes ----------------------------------------------------------------------------------------
    def put(self, key: bytes, entry: IndexEntry[V]) -> None:
        """Add or replace ``key`` as the most recently used entry."""
        self.remove(key)
        self._entries[key] = entry
        self._used += entry.size

    def remove(self, key: bytes) -> IndexEntry[V] | None:
        entry = self._entries.pop(key, None)
        if entry is not None:
            self._used -= entry.size
        return entry

    def clear(self) -> None:
        self._entries.clear()
        self._used = 0

    def pop_expired(self, now: float) -> list[bytes]:
        """Remove every expired entry; returns their keys."""
        expired = [k for k, e in self._entries.items() if self.is_expired(e, now)]
        for key in expired:
            self.remove(key)
        return expired

    def pop_lru_until_fits(self, incoming: int = 0, keep: bytes | None = None) -> list[tuple[bytes, IndexEntry[V]]]:
        """Remove least-recently-used entries until ``incoming`` more bytes fit under the capacity, never
        the key ``keep`` (passed over to the most recently used end); returns them, LRU first."""
        removed: list[tuple[bytes, IndexEntry[V]]] = []
        while self._entries and self._used + incoming > self.capacity_bytes:
            key = next(iter(self._entries))
            if key == keep:
                if len(self._entries) == 1:
                    break
                self._entries.move_to_end(key)
                continue
            entry = self._entries.pop(key)
            self._used -= entry.size
            removed.append((key, entry))
        return removed
