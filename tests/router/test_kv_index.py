"""The kv_events index, fed from an engine's block events, equals the engine's true cached block set after
random traffic with evictions; the gateway's block keys are the engine's."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from kvserve.cache.kv_events import KVEventLog
from kvserve.offline import LLM
from kvserve.router.kv_index import KVBlockIndex, block_hashes
from kvserve.router.policies import ReplicaBlocks, RouteRequest
from kvserve.router.replicas import Replica
from kvserve.sampling_params import SamplingParams
from tests.support.lora_adapters import write_adapter
from tests.support.tiny_models import make_tiny_model

BLOCK_SIZE = 4


@pytest.fixture(scope="module")
def llm(tmp_path_factory: pytest.TempPathFactory) -> LLM:
    model = make_tiny_model(tmp_path_factory.mktemp("kv-events"), "llama")
    # A pool of 40 blocks under prompts of up to 15 blocks: the prefix cache evicts all the time.
    return LLM(str(model), dtype="float32", block_size=BLOCK_SIZE, num_kv_blocks=40, max_num_seqs=4)


def true_blocks(llm: LLM) -> set[bytes]:
    return {block_hash for _, block_hash, _ in llm.engine.kv_manager.prefix_cache.cached_blocks()}


def test_the_index_followed_from_events_equals_the_cached_blocks_under_random_traffic(llm: LLM) -> None:
    engine = llm.engine
    # A short log, so that a reader who falls behind gets snapshots as well as events.
    engine_log = KVEventLog(max_events=6)
    engine.kv_manager.prefix_cache.tree.events = engine_log
    prefixes = [[random.Random(p).randrange(1, 500) for _ in range(24)] for p in range(5)]
    rng = random.Random(0)
    index = KVBlockIndex()
    for step in range(300):
        if rng.random() < 0.3:
            prompt = rng.choice(prefixes)[:rng.randrange(4, 25)] + [rng.randrange(1, 500) for _ in range(rng.randrange(0, 36))]
            engine.add_request({"prompt_token_ids": prompt},
                               SamplingParams(max_tokens=rng.randrange(1, 9), temperature=0, ignore_eos=True))
        if engine.has_unfinished_requests():
            engine.step()
        if rng.random() < 0.5:  # the gateway reads at its own pace, through JSON
            index.apply("replica", json.loads(json.dumps(engine_log.read(*reversed(index.cursor("replica"))))))
            assert index.blocks("replica") == true_blocks(llm), step
    assert engine.kv_manager.prefix_cache.num_evicted_blocks > 0
    assert index.cursor("replica")[0] == engine_log.epoch


def test_a_reader_of_another_epoch_or_ahead_gets_a_snapshot() -> None:
    log = KVEventLog()
    log.stored([b"a" * 16, b"b" * 16])
    assert "snapshot" in log.read(0, "another-epoch")
    assert "snapshot" in log.read(5, log.epoch)  # a cursor past the log's end
    assert log.read(0, log.epoch)["events"][0]["kind"] == "stored"
    log.removed([b"a" * 16])
    assert log.read(1, log.epoch)["events"] == [{"seq": 2, "kind": "removed", "tier": "device",
                                                  "block_hashes": [(b"a" * 16).hex()]}]


def test_an_answer_read_before_the_replica_was_forgotten_is_not_applied() -> None:
    """A replica taken out and back is forgotten (its blocks and cursor); a read begun before that must not put
    back the events after its old cursor over the emptied set, with that cursor (no snapshot would follow)."""
    index = KVBlockIndex()
    index.apply("r", {"epoch": "E", "seq": 3, "snapshot": {"device": ["00" * 16]}})
    generation = index.generation("r")
    index.forget("r")
    late = {"epoch": "E", "seq": 5, "events": [{"tier": "device", "kind": "stored", "block_hashes": ["11" * 16]}]}
    index.apply("r", late, generation)
    assert index.cursor("r") == (None, 0) and not index.blocks("r")  # the next read asks for a snapshot
    index.apply("r", late, index.generation("r"))
    assert index.cursor("r") == ("E", 5)


def test_the_gateways_block_keys_are_the_engines_and_find_its_cached_prefix(llm: LLM, tmp_path: Path) -> None:
    engine = llm.engine
    engine.kv_manager.prefix_cache.tree.events = log = KVEventLog()
    prompt = list(range(7, 7 + 33))
    llm.generate([{"prompt_token_ids": prompt}], SamplingParams(max_tokens=1, temperature=0))
    keys = block_hashes(prompt, BLOCK_SIZE, engine.block_hash_extra)
    assert len(keys) == 8 and set(keys) <= true_blocks(llm)
    index = KVBlockIndex()
    index.apply("http://r0", log.read(0, None))
    replica = Replica("http://r0", healthy=True, kv_events=True, block_size=BLOCK_SIZE,
                      block_hash_extra=engine.block_hash_extra)
    other = Replica("http://r1", healthy=True)
    matched = ReplicaBlocks(index).match(RouteRequest(None, tuple(prompt[:30]) + (1, 2)), [replica, other])
    assert matched == {"http://r0": 28, "http://r1": 0}  # 7 whole blocks of the shared 30 tokens
    # A salted request's blocks are keyed as the engine keys them: apart from the unsalted ones, found again.
    salted = RouteRequest(None, tuple(prompt[:30]) + (1, 2), cache_salt="t")
    assert ReplicaBlocks(index).match(salted, [replica]) == {"http://r0": 0}
    llm.generate([{"prompt_token_ids": prompt}], SamplingParams(max_tokens=1, temperature=0, cache_salt="t"))
    index.apply("http://r0", log.read(0, None))
    assert ReplicaBlocks(index).match(salted, [replica]) == {"http://r0": 28}


def test_a_lora_adapters_blocks_are_keyed_as_the_engine_keys_them(llm: LLM, tmp_path: Path) -> None:
    engine = llm.engine
    engine.kv_manager.prefix_cache.tree.events = log = KVEventLog()
    write_adapter(tmp_path / "sql", engine.arch, {(0, "q_proj"): 2, (1, "down_proj"): 2})
    adapter = engine.add_lora("sql", tmp_path / "sql")
    prompt = list(range(301, 301 + 33))  # no other test's prompt
    llm.generate([{"prompt_token_ids": prompt}], SamplingParams(max_tokens=1, temperature=0, lora_name="sql"))
    index = KVBlockIndex()
    index.apply("http://r0", log.read(0, None))
    replica = Replica("http://r0", healthy=True, kv_events=True, block_size=BLOCK_SIZE,
                      block_hash_extra=engine.block_hash_extra, lora_cache_keys={"sql": adapter.cache_key})
    asked = tuple(prompt[:30]) + (1, 2)
    assert ReplicaBlocks(index).match(RouteRequest("sql", asked), [replica]) == {"http://r0": 28}
    assert ReplicaBlocks(index).match(RouteRequest(None, asked), [replica]) == {"http://r0": 0}  # the base model's
    # No cache salt of a base-model request spells an adapter request's block keys.
    spelled = engine.add_request({"prompt_token_ids": prompt}, SamplingParams(
        cache_salt="t" + adapter.cache_key.decode()), request_id="spelled")
    salted = engine.add_request({"prompt_token_ids": prompt}, SamplingParams(cache_salt="t", lora_name="sql"),
                                request_id="salted")
    assert spelled.hash_extra != salted.hash_extra
    assert spelled.full_block_hashes(BLOCK_SIZE)[0] != salted.full_block_hashes(BLOCK_SIZE)[0]
    engine.abort_request("spelled")
    engine.abort_request("salted")
    assert engine.remove_lora("sql")


def test_the_kv_events_policy_routes_on_what_the_replicas_report(tmp_path: Path) -> None:
    """Two in-process kvserve servers behind two kv_events gateways: a prompt sent through one gateway is
    routed where its blocks are by the other (they read the same events), and the gateway's estimate of cached
    tokens is the replica's own count."""
    import httpx
    import openai

    from kvserve.config import CacheConfig, EngineConfig, ModelConfig
    from kvserve.server.serving import BackgroundServer
    from kvserve.serving_config import RouterConfig, ServerConfig
    from tests.router.conftest import BackgroundGateway
    from tests.router.test_gateway import router_metric, wait_until

    model = make_tiny_model(tmp_path, "llama")
    config = EngineConfig(model=ModelConfig(model=str(model), dtype="float32", show_progress=False),
                          cache=CacheConfig(block_size=BLOCK_SIZE, num_kv_blocks=64))
    servers = [BackgroundServer(config, ServerConfig(port=0, served_model_name="tiny")) for _ in range(2)]
    router_config = RouterConfig(replicas=tuple(s.base_url for s in servers), policy="kv_events",
                                 uvicorn_log_level="warning")
    gateways = [BackgroundGateway(router_config) for _ in range(2)]
    try:
        first_client, second_client = (openai.OpenAI(base_url=f"{g.base_url}/v1", api_key="unused", max_retries=0)
                                       for g in gateways)
        prompt = [int(t) for t in range(11, 11 + 41)]
        first = first_client.completions.create(model="tiny", prompt=prompt, max_tokens=2, temperature=0)
        assert first.usage.prompt_tokens_details.cached_tokens == 0
        follower = gateways[1].gateway.kv_events
        wait_until(lambda: any(len(follower.index.blocks(s.base_url)) >= 10 for s in servers))
        again = second_client.completions.create(model="tiny", prompt=prompt, max_tokens=2, temperature=0)
        cached = again.usage.prompt_tokens_details.cached_tokens
        assert cached == 40
        second = gateways[1].base_url
        assert router_metric(second, "routing_decisions_total", 'policy="kv_events",reason="prefix"') == 1
        assert sum(router_metric(second, "estimated_cached_tokens_total", f'replica="{s.base_url}"')
                   for s in servers) == cached
        assert httpx.get(f"{servers[0].base_url}/kvserve/kv_events", params={"after": "x"}).status_code == 400
    finally:
        for gateway in gateways:
            gateway.stop()
        for server in servers:
            server.stop()
