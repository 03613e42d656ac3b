"""vLLM's chat template controls, ``chat_template_kwargs`` and ``documents``: what the model's template is given
beside the messages, on the chat route and on /tokenize (the OpenAI app called in-process over a tiny model
whose template uses them)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pytest

from kvserve.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from kvserve.server.serving import build_server
from kvserve.serving_config import ServerConfig
from tests.support.app_calls import post
from tests.support.tiny_models import make_tiny_model

TEMPLATE = ("{% if greeting is defined %}[{{ greeting }}]{% endif %}"
            "{% for d in documents or [] %}<doc>{{ d['text'] }}</doc>{% endfor %}"
            "{% for m in messages %}{{ m['content'] }}{% endfor %}")


@pytest.fixture(scope="module")
def app(tmp_path_factory: pytest.TempPathFactory) -> Iterator[object]:
    model = make_tiny_model(tmp_path_factory.mktemp("template"), "llama")
    config_path = model / "tokenizer_config.json"
    config_path.write_text(json.dumps({**json.loads(config_path.read_text()), "chat_template": TEMPLATE}))
    config = EngineConfig(model=ModelConfig(model=str(model), dtype="float32", show_progress=False, max_model_len=256),
                          cache=CacheConfig(num_kv_blocks=32),
                          scheduler=SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=256))
    engine, async_engine, app = build_server(config, ServerConfig(served_model_name="tiny"))
    yield app
    async_engine.shutdown()
    engine.close()


def rendered(app: object, **fields: Any) -> str:
    status, answer = post(app, "/tokenize", {"messages": [{"role": "user", "content": "Hello"}], **fields})
    assert status == 200, answer
    status, text = post(app, "/detokenize", {"tokens": answer["tokens"]})
    assert status == 200, text
    return text["prompt"]


def test_template_kwargs_and_documents_reach_the_template(app) -> None:
    assert rendered(app) == "Hello"
    both = {"chat_template_kwargs": {"greeting": "hi"}, "documents": [{"text": "D1"}, {"text": "D2"}]}
    assert rendered(app, **both) == "[hi]<doc>D1</doc><doc>D2</doc>Hello"
    # Any name a template may read, also one the renderer's own Python signature has.
    assert rendered(app, chat_template_kwargs={"self": 1, "greeting": "yo"}) == "[yo]Hello"
    status, reply = post(app, "/v1/chat/completions", {"messages": [{"role": "user", "content": "Hello"}],
                                                        "max_tokens": 2, **both})
    assert status == 200 and reply["usage"]["prompt_tokens"] == post(
        app, "/tokenize", {"messages": [{"role": "user", "content": "Hello"}], **both})[1]["count"]
    for fields, param in (({"chat_template_kwargs": {"messages": []}}, "chat_template_kwargs"),
                          ({"chat_template": "{{ 1 }}"}, "chat_template")):
        for path in ("/tokenize", "/v1/chat/completions"):
            status, error = post(app, path, {"messages": [{"role": "user", "content": "Hello"}], **fields})
            assert (status, error["error"]["param"]) == (400, param)
