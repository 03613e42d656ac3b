"""Qwen2.5-Coder and Gemma 3 served over HTTP by name, through the official openai client: Qwen with its own
ChatML template, Gemma 3 (a base model without a template) on completions only, chat refused with a 400."""

from __future__ import annotations

import openai
import pytest

from kvserve.config import CacheConfig, EngineConfig, ModelConfig
from kvserve.server.serving import BackgroundServer
from tests.e2e.conftest import installed_model

pytestmark = pytest.mark.slow


def _server(name: str) -> BackgroundServer:
    installed_model(name)
    return BackgroundServer(EngineConfig(model=ModelConfig(model=name, show_progress=False),
                                         cache=CacheConfig(num_kv_blocks=256)))


def test_qwen_chat_uses_its_template_and_equals_the_same_tokens_as_a_completion() -> None:
    server = _server("qwen2.5-coder-0.5b")
    try:
        client = openai.OpenAI(base_url=server.base_url + "/v1", api_key="none")
        assert [m.id for m in client.models.list()] == ["qwen2.5-coder-0.5b"]
        messages = [{"role": "user", "content": "Write a Python one-liner that reverses a string s."}]
        reply = client.chat.completions.create(model="qwen2.5-coder-0.5b", messages=messages, max_tokens=16,
                                               temperature=0)
        tokenizer = server.engine.tokenizer
        prompt = tokenizer.apply_chat_template(messages)
        assert prompt.startswith("<|im_start|>system\nYou are Qwen")
        assert reply.usage.prompt_tokens == len(tokenizer.encode(prompt, add_special_tokens=False))
        same = client.completions.create(model="qwen2.5-coder-0.5b", prompt=prompt, max_tokens=16, temperature=0)
        assert reply.choices[0].message.content == same.choices[0].text and same.choices[0].text.strip()
    finally:
        server.stop()


def test_gemma3_base_model_serves_completions_and_refuses_chat() -> None:
    server = _server("gemma-3-270m")
    try:
        client = openai.OpenAI(base_url=server.base_url + "/v1", api_key="none")
        done = client.completions.create(model="gemma-3-270m", prompt="The capital of France is", max_tokens=8,
                                         temperature=0)
        assert done.choices[0].text.strip() and done.usage.completion_tokens == 8
        with pytest.raises(openai.BadRequestError, match="no chat template"):
            client.chat.completions.create(model="gemma-3-270m", messages=[{"role": "user", "content": "hi"}],
                                           max_tokens=8)
    finally:
        server.stop()
