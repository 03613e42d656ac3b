"""/tokenize and /detokenize (vLLM's spelling) on the real server: a prompt's and a conversation's counts are
the prompt tokens the generation routes bill for them, ids round-trip to text, and bad bodies are 400s naming
the field."""

from __future__ import annotations

import json

import httpx
import openai
import pytest

WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
MESSAGES = [{"role": "system", "content": "You answer in one word."},
            {"role": "user", "content": "What colour is the sky on a clear day?"}]


@pytest.fixture
def client(base_url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0)


def tokenize(base_url: str, **body: object) -> dict:
    response = httpx.post(f"{base_url}/tokenize", json=body, timeout=60)
    assert response.status_code == 200, response.text
    return response.json()


def test_a_prompts_count_is_what_completions_bill_and_its_ids_round_trip(client, base_url) -> None:
    prompt = "The paged KV cache stores keys and values in blocks of sixteen tokens."
    served = client.models.list().data[0].id
    answer = tokenize(base_url, model=served, prompt=prompt, return_token_strs=True)
    completion = client.completions.create(model=served, prompt=prompt, max_tokens=1, temperature=0)
    assert completion.usage is not None and answer["count"] == completion.usage.prompt_tokens > 10
    assert len(answer["tokens"]) == len(answer["token_strs"]) == answer["count"]
    assert answer["max_model_len"] > answer["count"]
    by_ids = client.completions.create(model=None, prompt=answer["tokens"], max_tokens=8, temperature=0)
    by_text = client.completions.create(model=None, prompt=prompt, max_tokens=8, temperature=0)
    assert by_ids.choices[0].text == by_text.choices[0].text
    detokenized = httpx.post(f"{base_url}/detokenize", json={"tokens": answer["tokens"]}, timeout=60)
    assert detokenized.status_code == 200 and detokenized.json() == {"prompt": prompt}


@pytest.mark.parametrize("tools", [None, [WEATHER_TOOL]], ids=["plain", "tools"])
def test_a_conversations_count_is_what_chat_completions_bill(client, base_url, tools) -> None:
    options = {"tools": tools} if tools else {}
    answer = tokenize(base_url, messages=MESSAGES, **options)
    chat = client.chat.completions.create(model=None, messages=MESSAGES, max_tokens=1, temperature=0,
                                          **options)  # type: ignore[arg-type]
    assert chat.usage is not None and answer["count"] == chat.usage.prompt_tokens
    assert answer["token_strs"] is None
    without_prompt = tokenize(base_url, messages=MESSAGES, add_generation_prompt=False, **options)
    assert answer["tokens"][:without_prompt["count"]] == without_prompt["tokens"]
    assert without_prompt["count"] < answer["count"]
    if tools:  # the tool's description is in the rendered conversation
        plain = tokenize(base_url, messages=MESSAGES)
        text = httpx.post(f"{base_url}/detokenize", json={"tokens": answer["tokens"]}, timeout=60).json()["prompt"]
        assert answer["count"] > plain["count"] and "get_weather" in text


@pytest.mark.parametrize(("path", "body", "status", "param"), [
    ("/tokenize", {"prompt": "a", "messages": MESSAGES}, 400, "messages"),
    ("/tokenize", {}, 400, "prompt"),
    ("/tokenize", {"prompt": "a", "model": "no-such-model"}, 404, "model"),
    ("/tokenize", {"prompt": 5}, 400, "prompt"),
    ("/tokenize", {"prompt": "bad \ud800 text"}, 400, "prompt"),
    ("/tokenize", {"messages": MESSAGES, "tools": [{"type": "function", "function": {"name": "a b"}}]}, 400,
     "tools[0].function.name"),
    ("/detokenize", {"tokens": [1, 10**9]}, 400, "tokens"),
    ("/detokenize", {"tokens": [-1]}, 400, "tokens"),
    ("/detokenize", {"tokens": [True]}, 400, "tokens"),
    ("/detokenize", {}, 400, "tokens"),
])
def test_bad_bodies_are_errors_naming_the_field(base_url, path, body, status, param) -> None:
    # ASCII JSON: a lone surrogate travels as its escape, as a client's JSON encoder may send it.
    response = httpx.post(f"{base_url}{path}", content=json.dumps(body), timeout=60,
                          headers={"content-type": "application/json"})
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["param"] is not None and error["param"].startswith(param), error
