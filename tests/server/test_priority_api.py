"""A request's ``priority`` (vLLM's) reaches the engine from every generation route under the priority
scheduling policy (the OpenAI app called in-process over a tiny model); the other policies refuse it
(tests/server/test_failures.py)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from kvserve.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from kvserve.engine import Engine
from kvserve.server.serving import build_server
from kvserve.serving_config import ServerConfig
from tests.support.app_calls import post
from tests.support.tiny_models import make_tiny_model


@pytest.fixture(scope="module")
def app(tmp_path_factory: pytest.TempPathFactory) -> Iterator[object]:
    model = make_tiny_model(tmp_path_factory.mktemp("priority"), "llama")
    config = EngineConfig(model=ModelConfig(model=str(model), dtype="float32", show_progress=False, max_model_len=256),
                          cache=CacheConfig(num_kv_blocks=32),
                          scheduler=SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=256, policy="priority"))
    engine, async_engine, app = build_server(config, ServerConfig(served_model_name="tiny"))
    yield app
    async_engine.shutdown()
    engine.close()


@pytest.mark.parametrize(("path", "body"), [
    ("/v1/completions", {"prompt": "Hello", "max_tokens": 2}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hello"}], "max_tokens": 2}),
    ("/v1/responses", {"input": "Hello", "max_output_tokens": 2, "store": False}),
    ("/v1/embeddings", {"input": "Hello"}),
])
def test_each_route_gives_the_engine_the_requests_priority(app, monkeypatch, path, body) -> None:
    queued: list[int] = []
    add = Engine.add_processed
    monkeypatch.setattr(Engine, "add_processed",
                        lambda self, processed, **kw: queued.append(processed.sampling_params.priority) or add(
                            self, processed, **kw))
    status, answer = post(app, path, {**body, "priority": -3})
    assert status == 200, answer
    assert queued == [-3]
    status, answer = post(app, path, {**body, "priority": "high"})
    assert status == 400 and answer["error"]["param"] == "priority"
