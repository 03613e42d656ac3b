"""Routing policies on replicas whose load the test sets."""

from __future__ import annotations

import dataclasses

from hypothesis import given, settings
from hypothesis import strategies as st

from kvserve.router.policies import (
    CacheAware,
    Decision,
    EstimatedTTFT,
    LeastLoad,
    PrefillRate,
    RoundRobin,
    RouteRequest,
    make_policy,
)
from kvserve.router.replicas import Replica
from kvserve.serving_config import RouterConfig

CONFIG = RouterConfig(prefix_page_tokens=4, balance_abs_threshold=4, balance_rel_threshold=1.5, cache_threshold=0.5,
                      prefix_capacity_tokens=1024)


def replicas(*loads: int) -> list[Replica]:
    return [Replica(f"http://r{i}", models=("m",), healthy=True, in_flight=load) for i, load in enumerate(loads)]


def request(*tokens: int) -> RouteRequest:
    return RouteRequest("m", tuple(tokens))


SYSTEM_A = tuple(range(100, 140))
SYSTEM_B = tuple(range(200, 240))


def test_round_robin_takes_each_in_turn() -> None:
    policy, pool = RoundRobin(), replicas(5, 0, 0)
    assert [policy.choose(request(1), pool).replica.url for _ in range(4)] == ["http://r0", "http://r1", "http://r2",
                                                                               "http://r0"]


def test_least_load_counts_requests_then_queued_tokens_and_shares_ties() -> None:
    policy, pool = LeastLoad(), replicas(3, 1, 1)
    pool[1].queued_prompt_tokens = 500
    assert policy.choose(request(1), pool).replica.url == "http://r2"
    pool[2].reported_running, pool[2].reported_waiting = 2, 3  # the replica reports more than this router sent
    pool[2].in_flight_at_read = 1
    assert pool[2].load == 5 and policy.choose(request(1), pool).replica.url == "http://r1"
    pool[2].in_flight = 0  # this router's request ended after the report: the report's other 4 remain
    assert pool[2].load == 4
    even = replicas(0, 0)
    assert {policy.choose(request(1), even).replica.url for _ in range(2)} == {"http://r0", "http://r1"}


def test_cache_aware_keeps_a_conversation_on_its_replica_and_spreads_new_prefixes() -> None:
    policy, pool = CacheAware(CONFIG), replicas(0, 0)
    first = policy.choose(request(*SYSTEM_A, 1, 2, 3), pool)
    assert first.reason == "miss" and first.estimated_cached_tokens == 0
    first.replica.in_flight += 1
    other = policy.choose(request(*SYSTEM_B, 1, 2, 3), pool)
    assert other.reason == "miss" and other.replica is not first.replica  # the idler one
    again = policy.choose(request(*SYSTEM_A, 1, 2, 3, 4, 5, 6, 7, 8), pool)  # the next turn, whole conversation
    assert again.replica is first.replica and again.reason == "prefix" and again.estimated_cached_tokens == 40


def test_cache_aware_keeps_a_salted_prompt_apart_from_the_same_prompt_unsalted() -> None:
    """A replica shares cached KV only within a cache salt: the routed prompts are remembered so."""
    policy, pool = CacheAware(CONFIG), replicas(0, 0)
    first = policy.choose(RouteRequest("m", SYSTEM_A, cache_salt="tenant-1"), pool)
    first.replica.in_flight += 1
    assert policy.choose(RouteRequest("m", SYSTEM_A), pool).reason == "miss"
    again = policy.choose(RouteRequest("m", SYSTEM_A + (1,), cache_salt="tenant-1"), pool)
    assert again.reason == "prefix" and again.replica is first.replica


def test_cache_aware_keeps_a_lora_adapters_prompts_apart_from_the_base_models() -> None:
    """A replica keeps an adapter's KV apart from the base model's (its /kvserve/info names its adapters)."""
    policy, pool = CacheAware(CONFIG), replicas(0, 0)
    for replica in pool:
        replica.models += ("sql",)
        replica.lora_cache_keys = {"sql": b"\0lora:abc"}
    first = policy.choose(RouteRequest("sql", SYSTEM_A), pool)
    first.replica.in_flight += 1
    assert policy.choose(RouteRequest("m", SYSTEM_A), pool).reason == "miss"
    again = policy.choose(RouteRequest("sql", SYSTEM_A + (1,)), pool)
    assert again.reason == "prefix" and again.replica is first.replica


def test_cache_aware_below_the_threshold_goes_to_the_least_loaded_replica() -> None:
    policy, pool = CacheAware(CONFIG), replicas(0, 0)
    held = policy.choose(request(*SYSTEM_A[:8]), pool).replica
    held.in_flight = 2
    long_prompt = request(*SYSTEM_A[:8], *range(1000, 1040))  # 8 of 48 tokens held: under half
    decision = policy.choose(long_prompt, pool)
    assert decision.reason == "miss" and decision.replica is not held and decision.estimated_cached_tokens == 0


def test_cache_aware_rebalances_among_replicas_within_the_bound_and_keeps_affinity_there() -> None:
    policy, pool = make_policy(CONFIG), replicas(0, 0, 0)
    homes = {}
    for name, system in (("a", SYSTEM_A), ("b", SYSTEM_B)):
        homes[name] = policy.choose(request(*system), pool).replica
        homes[name].in_flight += 1
    assert homes["a"] is not homes["b"]
    homes["a"].in_flight = 10  # a's home is overloaded: b's home (1) and the idle one (0) are within the bound
    decision = policy.choose(request(*SYSTEM_B, 7), pool)
    assert decision.replica is homes["b"] and decision.reason == "balance_prefix"
    decision = policy.choose(request(*SYSTEM_A, 7), pool)
    assert decision.replica is not homes["a"] and decision.reason == "balance_miss"


def test_the_bound_counts_the_request_being_placed() -> None:
    policy, pool = make_policy(CONFIG), replicas(0, 0)
    home = policy.choose(request(*SYSTEM_A), pool).replica
    home.in_flight = CONFIG.balance_abs_threshold - 1  # one more keeps it within the bound
    assert policy.choose(request(*SYSTEM_A, 1), pool) == Decision(home, "prefix", 40)
    home.in_flight = CONFIG.balance_abs_threshold  # one more would put it past the bound while the other idles
    moved = policy.choose(request(*SYSTEM_A, 2), pool)
    assert moved.replica is not home and moved.reason == "balance_miss"


def test_the_relative_threshold_lets_busy_replicas_keep_their_prefixes() -> None:
    policy, pool = make_policy(CONFIG), replicas(0, 0)
    home = policy.choose(request(*SYSTEM_A), pool).replica
    other = pool[1] if home is pool[0] else pool[0]
    home.in_flight, other.in_flight = 14, 10  # 5 above the idlest, but not 1.5 times its load
    assert policy.choose(request(*SYSTEM_A, 1), pool).replica is home


def test_forgetting_a_replica_drops_its_prefixes() -> None:
    policy, pool = CacheAware(CONFIG), replicas(0, 0)
    home = policy.choose(request(*SYSTEM_A), pool).replica
    policy.forget(home)
    home.in_flight = 1
    assert policy.choose(request(*SYSTEM_A), pool).replica is not home


def test_a_replica_capacity_learnt_late_bounds_what_its_index_remembers() -> None:
    policy, pool = CacheAware(dataclasses.replace(CONFIG, prefix_capacity_tokens=None)), replicas(0)
    policy.choose(request(*SYSTEM_A), pool)
    policy.choose(request(*SYSTEM_B), pool)  # no capacity known yet: both remembered
    assert policy.choose(request(*SYSTEM_A), pool).estimated_cached_tokens == 40
    pool[0].kv_capacity_tokens = 40  # reported later (a Ray Serve replica's routing stats): room for one prompt
    assert policy.choose(request(*SYSTEM_B), pool).estimated_cached_tokens == 0  # routed least recently: gone
    assert policy.choose(request(*SYSTEM_B), pool).estimated_cached_tokens == 40


@settings(max_examples=200, deadline=None)
@given(policy_name=st.sampled_from(["round_robin", "least_load", "cache_aware", "ttft"]),
       loads=st.lists(st.integers(0, 40), min_size=2, max_size=5),
       steps=st.lists(st.tuples(st.sampled_from([SYSTEM_A, SYSTEM_B, SYSTEM_A[:12]]), st.integers(-1, 4)),
                      min_size=1, max_size=30))
def test_no_policy_leaves_a_replica_idle_while_it_sends_another_past_the_bound(
        policy_name: str, loads: list[int], steps: list[tuple[tuple[int, ...], int]]) -> None:
    """Requests arrive and finish in random order; a request never lands where it puts its replica more than
    the bound above an idle one, unless that replica was already there before it arrived."""
    policy = make_policy(dataclasses.replace(CONFIG, policy=policy_name))
    pool = replicas(*loads)
    for prompt, finished in steps:
        if 0 <= finished < len(pool) and pool[finished].in_flight > 0:
            pool[finished].in_flight -= 1
        decision = policy.choose(request(*prompt), pool)
        if min(r.load for r in pool) == 0:
            assert decision.replica.load + 1 <= CONFIG.balance_abs_threshold
        decision.replica.in_flight += 1


def test_ttft_weighs_the_queue_against_the_prefix() -> None:
    policy, pool = EstimatedTTFT(CONFIG), replicas(0, 0)
    home = policy.choose(request(*SYSTEM_A), pool).replica
    other = pool[1] if home is pool[0] else pool[0]
    again = policy.choose(request(*SYSTEM_A, 1, 2, 3, 4), pool)
    assert again.replica is home and again.estimated_cached_tokens == 40 and again.work_tokens == 4
    home.queued_prompt_tokens = 1000  # its queue costs more than the 44 uncached tokens elsewhere
    moved = policy.choose(request(*SYSTEM_A, 9, 9, 9, 9), pool)
    assert moved.replica is other and moved.work_tokens == 44


def test_ttft_counts_a_prefix_held_elsewhere_as_cheap_on_replicas_that_share_a_tier() -> None:
    policy, pool = EstimatedTTFT(CONFIG), replicas(0, 0)
    home = policy.choose(request(*SYSTEM_A), pool).replica
    other = pool[1] if home is pool[0] else pool[0]
    home.shared_kv_group = other.shared_kv_group = "redis-a/model-x"
    home.queued_prompt_tokens = 30  # more than 0.2 x 40 tokens loaded from the shared tier + 4 computed
    decision = policy.choose(request(*SYSTEM_A, 1, 2, 3, 4), pool)
    assert decision.replica is other and decision.work_tokens == 4 + 8 and decision.estimated_cached_tokens == 40


def test_ttft_counts_a_prefix_as_shared_only_within_its_holders_tier_group() -> None:
    """A replica on another Redis, or keeping another kind of KV (another dtype or numerics), cannot read the
    holder's KV: the prefix is 44 tokens of work there."""
    policy, pool = EstimatedTTFT(CONFIG), replicas(0, 0)
    home = policy.choose(request(*SYSTEM_A), pool).replica
    other = pool[1] if home is pool[0] else pool[0]
    home.shared_kv_group, other.shared_kv_group = "redis-a/model-x", "redis-a/model-x-int8"
    home.queued_prompt_tokens = 30
    decision = policy.choose(request(*SYSTEM_A, 1, 2, 3, 4), pool)
    assert decision.replica is home and decision.estimated_cached_tokens == 40 and decision.work_tokens == 30 + 4


def test_ttft_learns_each_replicas_speed_from_first_chunks() -> None:
    policy, pool = EstimatedTTFT(CONFIG), replicas(0, 0)
    slow, fast = pool
    for _ in range(100):
        for work in (10, 200, 400, 800):
            policy.observe_ttft(Decision(slow, "ttft", 0, work), 0.004 * work)
            policy.observe_ttft(Decision(fast, "ttft", 0, work), 0.001 * work)
    assert abs(policy.estimate(slow, 500) - 2.0) < 0.01 and abs(policy.estimate(fast, 500) - 0.5) < 0.01
    fast.queued_prompt_tokens = 1000  # 0.001 x 1048 on the fast one against 0.004 x 48 on the slow one
    assert policy.choose(request(*SYSTEM_B, 1, 2, 3, 4, 5, 6, 7, 8), pool).replica is slow
    fast.queued_prompt_tokens = 100
    assert policy.choose(request(*SYSTEM_A, 1, 2, 3, 4, 5, 6, 7, 8), pool).replica is fast


def test_a_prefill_rate_starts_at_its_prior_and_moves_to_what_it_sees() -> None:
    rate = PrefillRate(0.002)
    assert rate.predict(100) == 0.2
    rate.add(1000, 0.5)  # as many tokens as the prior's weight, at a quarter of its rate
    assert abs(rate.predict(1000) - (0.95 * 2.0 + 0.5) / (0.95 * 1000 + 1000) * 1000) < 1e-9
