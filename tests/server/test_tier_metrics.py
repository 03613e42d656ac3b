"""The per-tier KV storage series of /metrics, rendered from an EngineStats snapshot (no server process)."""

from __future__ import annotations

from kvserve.engine import EngineStats
from kvserve.server.metrics import ServerMetrics
from kvserve.storage.base import TierStats


def samples(metrics: ServerMetrics) -> dict[str, float]:
    text = metrics.render()[0].decode()
    return {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1])
            for line in text.splitlines() if line and not line.startswith("#")}


def test_tier_series_are_labelled_by_tier_and_absent_gauges_are_skipped() -> None:
    stats = EngineStats(*([0] * 14))
    metrics = ServerMetrics(lambda: stats, lambda: True)
    assert not any("kv_tier_hit" in name for name in samples(metrics))  # tiers off: no tier samples

    stats.cached_tokens_by_tier = {"device": 32, "host": 64, "redis": 16}
    stats.tiers = {
        "host": TierStats(hits=64, misses=16, bytes_read=4096, entries=3, bytes_held=3000, evictions=2),
        "redis": TierStats(hits=16, errors=5, entries=None, bytes_held=None, load_latency_s=0.25, load_count=4),
    }
    stats.tiers_healthy = {"host": True, "redis": False}
    got = samples(metrics)
    assert got['kvserve:kv_cached_tokens_by_tier_total{tier="device"}'] == 32
    assert got['kvserve:kv_tier_hit_tokens_total{tier="host"}'] == 64
    assert got['kvserve:kv_tier_miss_tokens_total{tier="host"}'] == 16
    assert got['kvserve:kv_tier_read_bytes_total{tier="host"}'] == 4096
    assert got['kvserve:kv_tier_evictions_total{tier="host"}'] == 2
    assert got['kvserve:kv_tier_errors_total{tier="redis"}'] == 5
    assert got['kvserve:kv_tier_load_seconds_total{tier="redis"}'] == 0.25
    assert got['kvserve:kv_tier_entries{tier="host"}'] == 3 and got['kvserve:kv_tier_bytes{tier="host"}'] == 3000
    assert 'kvserve:kv_tier_entries{tier="redis"}' not in got  # a shared Redis cannot count its entries
    assert got['kvserve:kv_tier_healthy{tier="redis"}'] == 0 and got['kvserve:kv_tier_healthy{tier="host"}'] == 1
