"""Qwen2.5-Coder and Gemma 3 served over HTTP by name, through the official openai client: Qwen with its own
ChatML template and filling in the middle with its FIM tokens, Gemma 3 (a base model without a template) on
completions only, chat refused with a 400."""

from __future__ import annotations

from collections.abc import Iterator

import openai
import pytest

from kvserve.config import CacheConfig, EngineConfig, ModelConfig
from kvserve.infill import FimTokens
from kvserve.server.serving import BackgroundServer
from tests.e2e.conftest import installed_model

pytestmark = pytest.mark.slow


def _server(name: str) -> BackgroundServer:
    installed_model(name)
    return BackgroundServer(EngineConfig(model=ModelConfig(model=name, show_progress=False),
                                         cache=CacheConfig(num_kv_blocks=256)))


@pytest.fixture(scope="module")
def qwen() -> Iterator[BackgroundServer]:
    server = _server("qwen2.5-coder-0.5b")
    yield server
    server.stop()


def test_qwen_chat_uses_its_template_and_equals_the_same_tokens_as_a_completion(qwen: BackgroundServer) -> None:
    client = openai.OpenAI(base_url=qwen.base_url + "/v1", api_key="none")
    assert [m.id for m in client.models.list()] == ["qwen2.5-coder-0.5b"]
    messages = [{"role": "user", "content": "Write a Python one-liner that reverses a string s."}]
    reply = client.chat.completions.create(model="qwen2.5-coder-0.5b", messages=messages, max_tokens=16,
                                           temperature=0)
    tokenizer = qwen.engine.tokenizer
    prompt = tokenizer.apply_chat_template(messages)
    assert prompt.startswith("<|im_start|>system\nYou are Qwen")
    assert reply.usage.prompt_tokens == len(tokenizer.encode(prompt, add_special_tokens=False))
    same = client.completions.create(model="qwen2.5-coder-0.5b", prompt=prompt, max_tokens=16, temperature=0)
    assert reply.choices[0].message.content == same.choices[0].text and same.choices[0].text.strip()


def test_qwen_fills_the_middle_between_a_prompt_and_its_suffix(qwen: BackgroundServer) -> None:
    client = openai.OpenAI(base_url=qwen.base_url + "/v1", api_key="none")
    before, after = "def add(a, b):\n    ", "\n\nprint(add(1, 2))\n"
    filled = client.completions.create(model="qwen2.5-coder-0.5b", prompt=before, suffix=after, max_tokens=8,
                                       temperature=0)
    tokenizer = qwen.engine.tokenizer
    fim = FimTokens.of(tokenizer)
    assert fim is not None and (fim.prefix, fim.suffix, fim.middle) == tuple(
        tokenizer.token_to_id(t) for t in ("<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>"))
    assert tokenizer.token_to_id("<|endoftext|>") in fim.ends
    ids = fim.prompt(tokenizer, before, after)
    assert ids[0] == fim.prefix and ids[-1] == fim.middle and filled.usage.prompt_tokens == len(ids)
    # The same tokens as the laid-out prompt sent by hand with the infill's end tokens.
    by_hand = client.completions.create(model="qwen2.5-coder-0.5b", prompt=ids, max_tokens=8, temperature=0,
                                        extra_body={"stop_token_ids": list(fim.ends)})
    assert filled.choices[0].text == by_hand.choices[0].text
    # The gap's own text: the body, where a plain continuation of the prefix would not know what follows.
    assert filled.choices[0].text.startswith("return a + b")
