"""The approximate prefix index of the ``cache_aware`` policy: which replica was recently sent which prompt
prefixes.

Prompts are cut into pages of ``page_tokens`` token ids (a replica's KV block), each keyed by a chained hash
of its tokens and its parent's key, as a replica keys its blocks. A replica holds a page if a prompt routed to
it contained that page, until it is forgotten in least-recently-routed order once the replica's capacity is
reached. It is approximate: the replica's own cache may have evicted the page sooner or kept it longer, and a
hash collision (64 bits) may claim a page that was never sent.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence

ROOT_KEY = 0


def page_keys(token_ids: Sequence[int], page_tokens: int, salt: str | None = None) -> list[int]:
    """The chained key of every full page of ``token_ids`` (a partly filled last page has none); a request's
    cache salt roots its chain apart, as the replica keeps its KV apart."""
    keys: list[int] = []
    parent = ROOT_KEY if salt is None else hash((ROOT_KEY, salt))
    for start in range(0, len(token_ids) - page_tokens + 1, page_tokens):
        parent = hash((parent, tuple(token_ids[start:start + page_tokens])))
        keys.append(parent)
    return keys


class ApproximatePrefixIndex:
    """Per replica, the pages of the prompts routed to it, forgotten least recently routed first."""

    def __init__(self, page_tokens: int) -> None:
        self.page_tokens = page_tokens
        self._holders: dict[int, set[str]] = {}  # page key -> replicas holding it
        self._pages: dict[str, OrderedDict[int, None]] = {}  # replica -> its pages, least recently routed first
        self._capacity: dict[str, int] = {}  # replica -> pages it may hold

    def add_replica(self, replica: str, capacity_tokens: int) -> None:
        self._pages.setdefault(replica, OrderedDict())
        self._capacity[replica] = max(1, capacity_tokens // self.page_tokens)
        self._evict(replica)

    def remove_replica(self, replica: str) -> None:
        """Forget everything routed to ``replica`` (it restarted, or left the pool)."""
        for key in self._pages.pop(replica, {}):
            self._drop_holder(key, replica)
        self._capacity.pop(replica, None)

    def num_pages(self, replica: str) -> int:
        return len(self._pages.get(replica, ()))

    def match(self, keys: Sequence[int], replicas: Iterable[str]) -> dict[str, int]:
        """For each of ``replicas``: how many leading pages of ``keys`` it holds."""
        matched = dict.fromkeys(replicas, 0)
        alive = set(matched)
        for depth, key in enumerate(keys):
            alive &= self._holders.get(key, set())
            if not alive:
                break
            for replica in alive:
                matched[replica] = depth + 1
        return matched

    def insert(self, replica: str, keys: Sequence[int]) -> None:
        """``replica`` was sent a prompt with these pages. The first page becomes the most recent, so a
        prompt's tail is forgotten before its head, which other prompts may share."""
        pages = self._pages[replica]
        for key in reversed(keys):
            if key in pages:
                pages.move_to_end(key)
            else:
                pages[key] = None
                self._holders.setdefault(key, set()).add(replica)
        self._evict(replica)

    def _evict(self, replica: str) -> None:
        pages, capacity = self._pages[replica], self._capacity[replica]
        while len(pages) > capacity:
            key, _ = pages.popitem(last=False)
            self._drop_holder(key, replica)

    def _drop_holder(self, key: int, replica: str) -> None:
        holders = self._holders.get(key)
        if holders is not None:
            holders.discard(replica)
            if not holders:
                del self._holders[key]
