"""The draft model's KV blocks: a block pool and prefix cache of its own, driven by token lists.

A draft model (speculative decoding) keeps KV for each running request of the target, in its own pool. It
is told the request's confirmed tokens (prompt and output) each step and computes what it lacks: after a
rejection it keeps the longest prefix its KV still agrees with (the rejected drafts' KV is overwritten),
after a preemption or on first sight it starts from its prefix cache, so a system prompt every request
shares is computed once. Each request is a shadow ``Request`` in a ``KVCacheManager`` of its own; no
scheduler sees it.

Only confirmed tokens go into the prefix cache: a cached block is shared and never written again, while a
block holding unverified drafts may be rewritten after a rejection.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from kvserve.block_hash import salted_hash_extra
from kvserve.cache.kv_manager import KVCacheManager
from kvserve.request import Request
from kvserve.sampling_params import SamplingParams

_SHADOW_PARAMS = SamplingParams(max_tokens=None)


@dataclass(frozen=True, slots=True)
class DraftSlots:
    """Where a request's draft KV stands: KV is held for its first ``num_computed`` tokens, and
    ``block_ids`` has room for the tokens asked for."""

    num_computed: int
    block_ids: list[int]


class DraftKVCache:
    def __init__(self, num_blocks: int, block_size: int, hash_extra: bytes, enable_prefix_caching: bool = True) -> None:
        self.block_size = block_size
        self.hash_extra = hash_extra
        self.kv = KVCacheManager(num_blocks, block_size, enable_prefix_caching)
        self._requests: dict[str, Request] = {}
        self._confirmed: dict[str, int] = {}  # per request: how many of its shadow's tokens the target confirmed
        self.num_cached_tokens = 0  # prompt tokens found in the draft's prefix cache on first sight

    @property
    def num_requests(self) -> int:
        return len(self._requests)

    def holds(self, request_id: str) -> bool:
        return request_id in self._requests

    def tokens_to_compute(self, request_id: str, token_ids: Sequence[int], salt: str | None = None) -> int:
        """How many of ``token_ids`` a request not held yet would compute: those past what the prefix cache
        holds (at least the last; ``salt``: the request's cache salt). Changes nothing."""
        probe = Request(request_id, list(token_ids), _SHADOW_PARAMS, max_total_tokens=len(token_ids),
                        hash_extra=salted_hash_extra(self.hash_extra, salt))
        cached = self.kv.prefix_cache.match_length(probe, (len(token_ids) - 1) // self.block_size)
        return len(token_ids) - cached * self.block_size

    def prepare(self, request_id: str, token_ids: Sequence[int], num_ahead: int,
                salt: str | None = None) -> DraftSlots | None:
        """Make the request's draft KV ready to extend ``token_ids`` (its confirmed tokens) by ``num_ahead``
        more. At least the last token is left to compute, for its logits. None: the pool has no room now
        (the request gets no drafts this step; nothing changed). ``salt``: the request's cache salt."""
        shadow = self._requests.get(request_id)
        if shadow is None:
            return self._admit(request_id, token_ids, num_ahead, salted_hash_extra(self.hash_extra, salt))
        # The target's confirmed tokens only grow: the shadow agrees with them up to the last confirmed count.
        common = _common_prefix(shadow.all_token_ids, token_ids, self._confirmed[request_id])
        if common < shadow.num_tokens:  # drafts the target rejected (their KV is overwritten from here)
            shadow.truncate(common)
            del shadow.block_hashes[common // self.block_size:]
        shadow.all_token_ids.extend(token_ids[common:])
        shadow.num_computed_tokens = min(shadow.num_computed_tokens, len(token_ids) - 1)
        self._confirmed[request_id] = len(token_ids)
        if not self.kv.allocate(shadow, shadow.num_tokens_to_compute + num_ahead):
            return None
        return DraftSlots(shadow.num_computed_tokens, shadow.block_ids)

    def _admit(self, request_id: str, token_ids: Sequence[int], num_ahead: int, hash_extra: bytes) -> DraftSlots | None:
        shadow = Request(request_id, list(token_ids), _SHADOW_PARAMS, max_total_tokens=len(token_ids) + num_ahead,
                         hash_extra=hash_extra)
        hit = self.kv.lookup(shadow)
        if not self.kv.allocate(shadow, shadow.num_tokens - hit.num_tokens + num_ahead, hit):
            self.kv.release_hit(hit)
            return None
        self.num_cached_tokens += hit.num_tokens
        self._requests[request_id] = shadow
        self._confirmed[request_id] = len(token_ids)
        return DraftSlots(shadow.num_computed_tokens, shadow.block_ids)

    def computed(self, request_id: str, fed_drafts: Sequence[int]) -> None:
        """The draft's forwards ran: KV now covers every token given to ``prepare`` and then ``fed_drafts``
        (the drafts fed back in to propose the next ones). Confirmed full blocks join the prefix cache."""
        shadow = self._requests[request_id]
        shadow.all_token_ids.extend(fed_drafts)
        shadow.num_computed_tokens = shadow.num_tokens
        self.kv.cache_blocks(shadow, self._confirmed[request_id])

    def release(self, request_id: str) -> None:
        """The request finished or was preempted: its blocks go back, its confirmed full blocks stay cached."""
        shadow = self._requests.pop(request_id, None)
        if shadow is None:
            return
        confirmed = self._confirmed.pop(request_id)
        if confirmed < shadow.num_tokens:
            shadow.truncate(confirmed)
            del shadow.block_hashes[confirmed // self.block_size:]
        self.kv.free(shadow)

    def check_invariants(self) -> None:
        self.kv.check_invariants()


def _common_prefix(a: Sequence[int], b: Sequence[int], start: int) -> int:
    """Length of the common prefix of ``a`` and ``b``, known to be at least ``start``."""
    n = min(len(a), len(b))
    i = min(start, n)
    while i < n and a[i] == b[i]:
        i += 1
    return i
