"""Routing policies: which healthy replica takes a request.

Each is a ``RoutingPolicy``: ``choose`` picks one of the candidates (never empty) and says why;
``forget`` drops what the policy knew of a replica whose cache may have changed behind its back (it went
down, or came back). Policies run on the gateway's event loop, one call at a time.

- ``round_robin``: each in turn.
- ``least_load``: fewest requests (``Replica.load``: the router's own count plus others' reported), then fewest
  uncached prompt tokens still waiting for a first byte.
- ``cache_aware``: the replica holding the longest prefix of the whole rendered prompt (ApproximatePrefixIndex),
  when it holds at least ``cache_threshold`` of it; else the least-loaded one.
- ``kv_events``: ``cache_aware``'s rule over what the replicas report holding (KVBlockIndex).
- ``ttft``: the lowest estimated time to first token (EstimatedTTFT).

Every policy chooses within the load bound (``WithinLoadBound``): a replica that the request would leave
``balance_abs_threshold`` requests above the idlest (and ``balance_rel_threshold`` times as many) does not
compete, so no request is sent past the bound while a replica idles, and among those left the prefix still
decides: rebalancing keeps what affinity it can.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from kvserve.block_hash import salted_hash_extra
from kvserve.router.kv_index import KVBlockIndex, block_hashes
from kvserve.router.prefix_index import ApproximatePrefixIndex, page_keys
from kvserve.router.replicas import DEFAULT_CAPACITY_TOKENS, Replica
from kvserve.serving_config import RouterConfig


@dataclass(frozen=True, slots=True)
class RouteRequest:
    """What a policy may know of a request: its model and the token ids of its whole rendered prompt."""

    model: str | None
    token_ids: tuple[int, ...]
    cache_salt: str | None = None  # its cached KV is shared only with requests of the same salt


def index_salt(request: RouteRequest, candidates: Sequence[Replica]) -> str | None:
    """What keeps a request's prompts apart in an approximate prefix index: its cache salt, and its LoRA adapter
    where its model is one (an adapter's KV is its own on a replica)."""
    if request.model is None or not any(request.model in r.lora_cache_keys for r in candidates):
        return request.cache_salt
    return f"{request.cache_salt or ''}\0lora:{request.model}"


def cache_salt_of(payload: dict[str, Any]) -> str | None:
    """A request body's ``cache_salt`` (vLLM's), where it is a string; the replica judges any other value."""
    salt = payload.get("cache_salt")
    return salt if isinstance(salt, str) and salt else None


@dataclass(frozen=True, slots=True)
class Decision:
    replica: Replica
    reason: str  # a label of the router's routing-decision metric
    estimated_cached_tokens: int = 0
    work_tokens: int = 0  # ttft: prompt tokens the replica had to compute before this one's first token


class RoutingPolicy(Protocol):
    name: str

    def choose(self, request: RouteRequest, candidates: Sequence[Replica]) -> Decision: ...

    def forget(self, replica: Replica) -> None: ...

    def observe_ttft(self, decision: Decision, seconds: float) -> None:
        """A streamed answer's first chunk came ``seconds`` after it was sent."""


class _Stateless:
    """A policy that learns nothing from what happens to its choices."""

    def forget(self, replica: Replica) -> None:
        pass

    def observe_ttft(self, decision: Decision, seconds: float) -> None:
        pass


class RoundRobin(_Stateless):
    name = "round_robin"

    def __init__(self) -> None:
        self._turn = itertools.count()

    def choose(self, request: RouteRequest, candidates: Sequence[Replica]) -> Decision:
        return Decision(candidates[next(self._turn) % len(candidates)], "turn")


def least_loaded(candidates: Sequence[Replica], turn: int) -> Replica:
    """Fewest requests, then fewest queued prompt tokens; ties taken in turn, so equal replicas share."""
    n = len(candidates)
    rotated = [candidates[(turn + i) % n] for i in range(n)]
    return min(rotated, key=lambda r: (r.load, r.queued_prompt_tokens))


class LeastLoad(_Stateless):
    name = "least_load"

    def __init__(self) -> None:
        self._turn = itertools.count()

    def choose(self, request: RouteRequest, candidates: Sequence[Replica]) -> Decision:
        return Decision(least_loaded(candidates, next(self._turn)), "least_load")


class PrefixMatcher(Protocol):
    """Which replica holds how much of a request's prompt."""

    def match(self, request: RouteRequest, candidates: Sequence[Replica]) -> dict[str, int]:
        """Per candidate URL, the tokens of the request's prompt prefix it holds."""
        ...

    def routed(self, replica: Replica, request: RouteRequest) -> None:
        """The request was sent to ``replica`` (the last one ``match`` saw)."""
        ...

    def forget(self, replica: Replica) -> None: ...


class ReplicaPrefixes:
    """Approximate: the prompts routed to each replica (ApproximatePrefixIndex), as a PrefixMatcher."""

    def __init__(self, config: RouterConfig) -> None:
        self._capacity = config.prefix_capacity_tokens
        self.index = ApproximatePrefixIndex(config.prefix_page_tokens)
        self._known: dict[str, int] = {}  # replica -> the capacity its index was sized for
        self._last: tuple[RouteRequest, list[int]] | None = None

    def match(self, request: RouteRequest, candidates: Sequence[Replica]) -> dict[str, int]:
        for replica in candidates:
            capacity = self._capacity or replica.kv_capacity_tokens or DEFAULT_CAPACITY_TOKENS
            if self._known.get(replica.url) != capacity:  # new, or its capacity became known
                self.index.add_replica(replica.url, capacity)
                self._known[replica.url] = capacity
        keys = page_keys(request.token_ids, self.index.page_tokens, index_salt(request, candidates))
        self._last = (request, keys)
        pages = self.index.match(keys, (r.url for r in candidates))
        return {url: n * self.index.page_tokens for url, n in pages.items()}

    def routed(self, replica: Replica, request: RouteRequest) -> None:
        if self._last is not None and self._last[0] is request:
            keys = self._last[1]
        else:
            keys = page_keys(request.token_ids, self.index.page_tokens, index_salt(request, [replica]))
        self.index.insert(replica.url, keys)

    def forget(self, replica: Replica) -> None:
        self.index.remove_replica(replica.url)
        self._known.pop(replica.url, None)


class ReplicaBlocks:
    """Precise: the blocks each kvserve replica reported holding (KVBlockIndex, fed by a KVEventFollower), as
    a PrefixMatcher. A replica that publishes no events holds nothing here."""

    def __init__(self, index: KVBlockIndex) -> None:
        self.index = index

    def match(self, request: RouteRequest, candidates: Sequence[Replica]) -> dict[str, int]:
        hashes: dict[tuple[int, bytes], list[bytes]] = {}
        matched = {}
        for replica in candidates:
            if not replica.kv_events or replica.block_size is None:
                matched[replica.url] = 0
                continue
            adapter_key = replica.lora_cache_keys.get(request.model, b"") if request.model is not None else b""
            key = (replica.block_size, salted_hash_extra(replica.block_hash_extra, request.cache_salt, adapter_key))
            if key not in hashes:
                hashes[key] = block_hashes(request.token_ids, *key)
            matched[replica.url] = self.index.match(hashes[key], [replica.url])[replica.url] * replica.block_size
        return matched

    def routed(self, replica: Replica, request: RouteRequest) -> None:
        pass  # the replica's events will say what it stored

    def forget(self, replica: Replica) -> None:
        self.index.forget(replica.url)


class CacheAware:
    """``cache_aware`` over the approximate index of routed prompts; ``kv_events`` over the replicas' own
    block events: the same rule, a different view of where the prefixes are."""

    def __init__(self, config: RouterConfig, matcher: PrefixMatcher | None = None,
                 name: str = "cache_aware") -> None:
        self._config = config
        self.name = name
        self.prefixes: PrefixMatcher = matcher or ReplicaPrefixes(config)
        self._turn = itertools.count()

    def choose(self, request: RouteRequest, candidates: Sequence[Replica]) -> Decision:
        matched = self.prefixes.match(request, candidates)
        best = max(candidates, key=lambda r: (matched[r.url], -r.load))
        if request.token_ids and matched[best.url] >= self._config.cache_threshold * len(request.token_ids):
            decision = Decision(best, "prefix", matched[best.url])
        else:
            chosen = least_loaded(candidates, next(self._turn))
            decision = Decision(chosen, "miss", matched[chosen.url])
        self.prefixes.routed(decision.replica, request)
        return decision

    def forget(self, replica: Replica) -> None:
        self.prefixes.forget(replica)

    def observe_ttft(self, decision: Decision, seconds: float) -> None:
        pass


class EstimatedTTFT:
    """The replica with the lowest estimated time to first token: its seconds per token times the work, the
    prompt tokens it must compute first (uncached tokens of requests it has not yet answered, then this
    request's uncached tokens; a prefix another replica of its shared-tier group holds counts
    ``shared_tier_cost`` per token). The rate is measured per replica from the first chunks of streamed answers;
    until a replica has answered, it gets the fleet's (or the configured prior)."""

    name = "ttft"

    def __init__(self, config: RouterConfig) -> None:
        self._config = config
        self.prefixes = ReplicaPrefixes(config)
        self._fits: dict[str, PrefillRate] = {}
        self._fleet = PrefillRate(config.prefill_seconds_per_token)

    def estimate(self, replica: Replica, work_tokens: int) -> float:
        return self._fits.get(replica.url, self._fleet).predict(work_tokens)

    def choose(self, request: RouteRequest, candidates: Sequence[Replica]) -> Decision:
        matched = self.prefixes.match(request, candidates)
        in_group = {group: max(matched[r.url] for r in candidates if r.shared_kv_group == group)
                    for group in {r.shared_kv_group for r in candidates} if group is not None}
        best: tuple[float, int, Replica, int, int] | None = None
        for replica in candidates:
            cached = matched[replica.url]
            group = replica.shared_kv_group
            shared = in_group[group] - cached if group is not None else 0
            own = len(request.token_ids) - cached - shared
            work = replica.queued_prompt_tokens + own + round(shared * self._config.shared_tier_cost)
            key = (self.estimate(replica, work), replica.load, replica, cached + shared, work)
            if best is None or key[:2] < best[:2]:
                best = key
        assert best is not None
        _, _, chosen, cached, work = best
        self.prefixes.routed(chosen, request)
        return Decision(chosen, "ttft", cached, work)

    def forget(self, replica: Replica) -> None:
        self.prefixes.forget(replica)

    def observe_ttft(self, decision: Decision, seconds: float) -> None:
        self._fits.setdefault(decision.replica.url, PrefillRate(self._config.prefill_seconds_per_token)).add(
            decision.work_tokens, seconds)
        self._fleet.add(decision.work_tokens, seconds)


class PrefillRate:
    """Seconds per token of work, as the exponentially weighted ratio of first-chunk times to work tokens,
    starting from the prior as one observation of ``PRIOR_TOKENS``. A ratio of sums, not a fitted line: a
    line's intercept, fitted per replica on few and noisy points, decided routing more than the queues did."""

    DECAY = 0.95
    PRIOR_TOKENS = 1000.0

    def __init__(self, prior_seconds_per_token: float) -> None:
        self._tokens = self.PRIOR_TOKENS
        self._seconds = prior_seconds_per_token * self.PRIOR_TOKENS

    def add(self, work_tokens: float, seconds: float) -> None:
        self._tokens = self.DECAY * self._tokens + max(work_tokens, 1.0)
        self._seconds = self.DECAY * self._seconds + seconds

    def predict(self, work_tokens: float) -> float:
        return self._seconds / self._tokens * work_tokens


class WithinLoadBound:
    """A policy choosing only among the replicas the request would not overload: one competes unless taking
    the request leaves it more than ``balance_abs_threshold`` requests above the idlest replica and more than
    ``balance_rel_threshold`` times the idlest's load. The idlest always competes, so the pool is never empty; when
    the bound left a replica out, the decision's reason says so (``balance_`` before the policy's own)."""

    def __init__(self, policy: RoutingPolicy, config: RouterConfig) -> None:
        self.policy = policy
        self.name = policy.name
        self._abs = config.balance_abs_threshold
        self._rel = config.balance_rel_threshold

    def within(self, candidates: Sequence[Replica]) -> list[Replica]:
        idlest = min(r.load for r in candidates)
        return [r for r in candidates
                if not (r.load + 1 - idlest > self._abs and r.load + 1 > self._rel * idlest)]

    def choose(self, request: RouteRequest, candidates: Sequence[Replica]) -> Decision:
        pool = self.within(candidates)
        decision = self.policy.choose(request, pool)
        if len(pool) < len(candidates):
            return dataclasses.replace(decision, reason=f"balance_{decision.reason}")
        return decision

    def forget(self, replica: Replica) -> None:
        self.policy.forget(replica)

    def observe_ttft(self, decision: Decision, seconds: float) -> None:
        self.policy.observe_ttft(decision, seconds)


def make_policy(config: RouterConfig, kv_index: KVBlockIndex | None = None) -> RoutingPolicy:
    """The configured policy, within the load bound; ``kv_events`` reads ``kv_index``, which the caller keeps
    fed."""
    policy: RoutingPolicy
    if config.policy == "kv_events":
        assert kv_index is not None, "the kv_events policy needs a KVBlockIndex"
        policy = CacheAware(config, ReplicaBlocks(kv_index), name="kv_events")
    elif config.policy == "round_robin":
        policy = RoundRobin()
    elif config.policy == "least_load":
        policy = LeastLoad()
    elif config.policy == "ttft":
        policy = EstimatedTTFT(config)
    else:
        policy = CacheAware(config)
    return WithinLoadBound(policy, config)
