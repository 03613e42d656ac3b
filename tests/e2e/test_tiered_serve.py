"""KV tiers through real ``kvserve serve`` processes: a second server on the same redis-server finds the
first one's prefix (a restart that finds it on disk: tests/e2e/test_crash_safety.py). Cached tokens are read the way an OpenAI
client reads them (``usage.prompt_tokens_details.cached_tokens``), the tier from ``timings`` and /metrics."""

from __future__ import annotations

from pathlib import Path

import openai
import pytest

from tests.conftest import RedisServer
from tests.e2e.conftest import LONG_DOCUMENT
from tests.server.conftest import ServerProcess, metric_value

# Heavy, for CI's time: engines sharing Redis are checked in process (test_tiered_cache.py), and the soak
# serves through a Redis tier it kills and restarts.
pytestmark = [pytest.mark.slow, pytest.mark.heavy]

ENGINE_ARGS = ["--dtype", "float32", "--num-kv-blocks", "64", "--max-num-batched-tokens", "512",
               "--served-model-name", "smol", "--kv-write-policy", "write_through"]
PROMPT = LONG_DOCUMENT[:700] + "\nIn one word, the text above is about"


def complete(server: ServerProcess):
    client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0, timeout=120)
    return client.completions.create(model="smol", prompt=PROMPT, max_tokens=4, temperature=0,
                                     extra_body={"return_timings": True})


def cached(response) -> tuple[int, dict[str, int]]:
    details = response.usage.prompt_tokens_details
    tiers = response.model_extra["timings"]["cache_lookup"]["cached_tokens_by_tier"]
    return (details.cached_tokens if details else 0), tiers


def test_a_second_server_finds_the_first_servers_prefix_in_redis(
    tmp_path: Path, redis_server: RedisServer
) -> None:
    shared_redis = ["--kv-redis-url", redis_server.url]
    first = ServerProcess(ENGINE_ARGS + shared_redis, tmp_path / "first.log")
    servers = [first]
    try:
        first.wait_ready()
        cold = complete(first)
        assert cached(cold)[0] == 0
        second = ServerProcess(ENGINE_ARGS + shared_redis, tmp_path / "second.log")  # Redis only
        servers.append(second)
        second.wait_ready()
        shared = complete(second)
        num_cached, tiers = cached(shared)
        assert num_cached > 0 and tiers["redis"] == num_cached and tiers["device"] == 0, tiers
        assert shared.choices[0].text == cold.choices[0].text
        assert metric_value(second.base_url, "kvserve:kv_tier_hit_tokens_total", 'tier="redis"') == num_cached
    finally:
        for server in servers:
            server.stop()
    for server in servers:
        assert "Traceback" not in server.log_tail(10**7), server.log_tail()
