"""Routing policies: which healthy replica takes a request.

Each is a ``RoutingPolicy``: ``choose`` picks one of the candidates (never empty) and says why;
``forget`` drops what the policy knew of a replica whose cache may have changed behind its back (it went
down, or came back). Policies run on the gateway's event loop, one call at a time.

- ``round_robin``: each in turn.
- ``least_load``: fewest requests (the router's own count, or the replica's report if higher), then fewest
  prompt tokens still waiting for a first byte.
- ``cache_aware``: the replica holding the longest prefix of the whole rendered prompt (ApproximatePrefixIndex),
  when it holds at least ``cache_threshold`` of it; else the least-loaded one. When load is imbalanced (the
  busiest has ``balance_abs_threshold`` more requests than the idlest and ``balance_rel_threshold`` times as
  many), only replicas within ``balance_abs_threshold`` of the idlest compete, and among them the prefix still
  decides: rebalancing keeps what affinity it can.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from kvserve.config import RouterConfig
from kvserve.router.prefix_index import ApproximatePrefixIndex, page_keys
from kvserve.router.replicas import DEFAULT_CAPACITY_TOKENS, Replica


@dataclass(frozen=True, slots=True)
class RouteRequest:
    """What a policy may know of a request: its model and the token ids of its whole rendered prompt."""

    model: str | None
    token_ids: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class Decision:
    replica: Replica
    reason: str  # a label of the router's routing-decision metric
    estimated_cached_tokens: int = 0


class RoutingPolicy(Protocol):
    name: str

    def choose(self, request: RouteRequest, candidates: Sequence[Replica]) -> Decision: ...

    def forget(self, replica: Replica) -> None: ...


class RoundRobin:
    name = "round_robin"

    def __init__(self) -> None:
        self._turn = itertools.count()

    def choose(self, request: RouteRequest, candidates: Sequence[Replica]) -> Decision:
        return Decision(candidates[next(self._turn) % len(candidates)], "turn")

    def forget(self, replica: Replica) -> None:
        pass


def least_loaded(candidates: Sequence[Replica], turn: int) -> Replica:
    """Fewest requests, then fewest queued prompt tokens; ties taken in turn, so equal replicas share."""
    n = len(candidates)
    rotated = [candidates[(turn + i) % n] for i in range(n)]
    return min(rotated, key=lambda r: (r.load, r.queued_prompt_tokens))


class LeastLoad:
    name = "least_load"

    def __init__(self) -> None:
        self._turn = itertools.count()

    def choose(self, request: RouteRequest, candidates: Sequence[Replica]) -> Decision:
        return Decision(least_loaded(candidates, next(self._turn)), "least_load")

    def forget(self, replica: Replica) -> None:
        pass


class CacheAware:
    name = "cache_aware"

    def __init__(self, config: RouterConfig) -> None:
        self._config = config
        self.index = ApproximatePrefixIndex(config.prefix_page_tokens)
        self._known: set[str] = set()
        self._turn = itertools.count()

    def choose(self, request: RouteRequest, candidates: Sequence[Replica]) -> Decision:
        for replica in candidates:
            if replica.url not in self._known:
                capacity = self._config.prefix_capacity_tokens or replica.kv_capacity_tokens or DEFAULT_CAPACITY_TOKENS
                self.index.add_replica(replica.url, capacity)
                self._known.add(replica.url)
        c = self._config
        idlest = min(r.load for r in candidates)
        busiest = max(r.load for r in candidates)
        balancing = busiest - idlest > c.balance_abs_threshold and busiest > c.balance_rel_threshold * idlest
        pool = [r for r in candidates if r.load <= idlest + c.balance_abs_threshold] if balancing else candidates
        keys = page_keys(request.token_ids, self.index.page_tokens)
        matched = self.index.match(keys, (r.url for r in pool))
        best = max(pool, key=lambda r: (matched[r.url], -r.load))
        best_tokens = matched[best.url] * self.index.page_tokens
        if request.token_ids and best_tokens >= c.cache_threshold * len(request.token_ids):
            decision = Decision(best, "balance_prefix" if balancing else "prefix", best_tokens)
        else:
            chosen = least_loaded(pool, next(self._turn))
            reason = "balance" if balancing else "miss"
            decision = Decision(chosen, reason, matched[chosen.url] * self.index.page_tokens)
        self.index.insert(decision.replica.url, keys)
        return decision

    def forget(self, replica: Replica) -> None:
        self.index.remove_replica(replica.url)
        self._known.discard(replica.url)


def make_policy(config: RouterConfig) -> RoutingPolicy:
    if config.policy == "round_robin":
        return RoundRobin()
    if config.policy == "least_load":
        return LeastLoad()
    return CacheAware(config)
