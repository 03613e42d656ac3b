"""KV block events: which full blocks the device prefix cache holds, as a log a gateway can follow.

The engine thread records a ``stored`` event when blocks enter the prefix cache and a ``removed`` event when
they are evicted from it; a reader (the HTTP thread, for ``GET /kvserve/kv_events``) asks for everything after
the sequence number it has seen. The log also keeps the current set of cached hashes, updated under the same
lock, so a reader that is new, or has fallen behind the retained events, or follows an earlier incarnation
of the server, gets a consistent snapshot instead of a gap.
"""

from __future__ import annotations

import threading
import uuid
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from kvserve.block_hash import BlockHash

DEVICE_TIER = "device"


@dataclass(frozen=True, slots=True)
class KVEvent:
    seq: int
    kind: str  # "stored" | "removed"
    tier: str
    block_hashes: tuple[BlockHash, ...]


class KVEventLog:
    """Thread-safe: written by the engine thread, read by any other."""

    def __init__(self, max_events: int = 4096) -> None:
        self.epoch = uuid.uuid4().hex  # a reader that saw another epoch follows an earlier process: snapshot
        self._events: deque[KVEvent] = deque(maxlen=max_events)
        self._held: dict[str, set[BlockHash]] = {DEVICE_TIER: set()}
        self._seq = 0
        self._lock = threading.Lock()

    def stored(self, block_hashes: Iterable[BlockHash], tier: str = DEVICE_TIER) -> None:
        self._record("stored", tier, tuple(block_hashes))

    def removed(self, block_hashes: Iterable[BlockHash], tier: str = DEVICE_TIER) -> None:
        self._record("removed", tier, tuple(block_hashes))

    def _record(self, kind: str, tier: str, block_hashes: tuple[BlockHash, ...]) -> None:
        if not block_hashes:
            return
        with self._lock:
            held = self._held.setdefault(tier, set())
            if kind == "stored":
                held.update(block_hashes)
            else:
                held.difference_update(block_hashes)
            self._seq += 1
            self._events.append(KVEvent(self._seq, kind, tier, block_hashes))

    def read(self, after: int, epoch: str | None) -> dict[str, Any]:
        """What a reader that has applied everything up to ``after`` (of ``epoch``) needs next, as JSON-able
        data: ``{"epoch", "seq", "events": [...]}``, or ``{"epoch", "seq", "snapshot": {tier: [hash, ...]}}``
        when the events after ``after`` are no longer all retained (or never were: another epoch)."""
        with self._lock:
            oldest = self._events[0].seq if self._events else self._seq + 1
            if epoch == self.epoch and 0 <= after <= self._seq and after + 1 >= oldest:
                events = [{"seq": e.seq, "kind": e.kind, "tier": e.tier,
                           "block_hashes": [h.hex() for h in e.block_hashes]}
                          for e in self._events if e.seq > after]
                return {"epoch": self.epoch, "seq": self._seq, "events": events}
            snapshot = {tier: [h.hex() for h in held] for tier, held in self._held.items()}
            return {"epoch": self.epoch, "seq": self._seq, "snapshot": snapshot}
