"""A request's ``priority`` (vLLM's) reaches the engine from every generation route under the priority
scheduling policy (the OpenAI app called in-process over a tiny model: ``tiny_app``); the other policies refuse
it (tests/server/test_failures.py)."""

from __future__ import annotations

import pytest

from kvserve.engine import Engine
from tests.support.app_calls import post


@pytest.mark.parametrize(("path", "body"), [
    ("/v1/completions", {"prompt": "Hello", "max_tokens": 2}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hello"}], "max_tokens": 2}),
    ("/v1/responses", {"input": "Hello", "max_output_tokens": 2, "store": False}),
    ("/v1/embeddings", {"input": "Hello"}),
])
def test_each_route_gives_the_engine_the_requests_priority(tiny_app, monkeypatch, path, body) -> None:
    queued: list[int] = []
    add = Engine.add_processed
    monkeypatch.setattr(Engine, "add_processed",
                        lambda self, processed, **kw: queued.append(processed.sampling_params.priority) or add(
                            self, processed, **kw))
    status, answer = post(tiny_app, path, {**body, "priority": -3})
    assert status == 200, answer
    assert queued == [-3]
    status, answer = post(tiny_app, path, {**body, "priority": "high"})
    assert status == 400 and answer["error"]["param"] == "priority"
