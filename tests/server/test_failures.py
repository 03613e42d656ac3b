"""Failure modes of the shared server, over raw HTTP: error statuses and bodies, odd inputs, disconnects."""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import pytest

from tests.server.conftest import MAX_MODEL_LEN, metric_value

pytestmark = pytest.mark.slow

HI = [{"role": "user", "content": "Hi"}]


def post(base_url: str, endpoint: str, body: object, **kwargs: object) -> httpx.Response:
    path = {"chat": "/v1/chat/completions", "embeddings": "/v1/embeddings"}.get(endpoint, "/v1/completions")
    return httpx.post(f"{base_url}{path}", json=body, timeout=60, **kwargs)  # type: ignore[arg-type]


def assert_error(resp: httpx.Response, status: int, param: str | None, code: str | None = None) -> dict:
    assert resp.status_code == status, resp.text
    error = resp.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["param"] == param and error["message"]
    if param is not None:
        assert param.split("[")[0].split(".")[0] in error["message"]
    if code is not None:
        assert error["code"] == code
    return error


WRONG_TYPES = [
    ("chat", {"messages": "hi"}, "messages"),
    ("chat", {}, "messages"),
    ("chat", {"messages": []}, "messages"),
    ("chat", {"messages": [{"role": "user", "content": 5}]}, "messages[0].content"),
    ("chat", {"messages": [{"content": "hi"}]}, "messages[0].role"),
    ("chat", {"messages": HI, "max_tokens": "5"}, "max_tokens"),
    ("chat", {"messages": HI, "max_tokens": 2.5}, "max_tokens"),
    ("chat", {"messages": HI, "temperature": "hot"}, "temperature"),
    ("chat", {"messages": HI, "n": True}, "n"),
    ("chat", {"messages": HI, "stop": 5}, "stop"),
    ("chat", {"messages": HI, "logprobs": 3}, "logprobs"),
    ("chat", {"messages": HI, "stream": "yes"}, "stream"),
    ("chat", {"messages": HI, "stream_options": {"include_usage": "yes"}}, "stream_options.include_usage"),
    ("chat", {"messages": HI, "seed": "seven"}, "seed"),
    ("completions", {"prompt": 5}, "prompt"),
    ("completions", {"prompt": []}, "prompt"),
    ("completions", {"prompt": ["a", [1]]}, "prompt"),
    ("completions", {"prompt": [1, "a"]}, "prompt"),
    ("completions", {"max_tokens": 3}, "prompt"),
    ("completions", {"prompt": "hi", "logprobs": True}, "logprobs"),
]


@pytest.mark.parametrize(("endpoint", "body", "param"), WRONG_TYPES)
def test_wrong_type_is_400_naming_the_field(base_url, endpoint, body, param) -> None:
    assert_error(post(base_url, endpoint, body), 400, param, "invalid_value")


BAD_VALUES = [
    ("chat", {"temperature": -1}, "temperature"),
    ("chat", {"top_p": 0}, "top_p"),
    ("chat", {"top_p": 1.5}, "top_p"),
    ("chat", {"top_k": -2}, "top_k"),
    ("chat", {"min_p": 2}, "min_p"),
    ("chat", {"n": 0}, "n"),
    ("chat", {"max_tokens": 0}, "max_tokens"),
    ("chat", {"max_completion_tokens": 0}, "max_completion_tokens"),
    ("chat", {"presence_penalty": 3}, "presence_penalty"),
    ("chat", {"frequency_penalty": -3}, "frequency_penalty"),
    ("chat", {"repetition_penalty": 0}, "repetition_penalty"),
    ("chat", {"min_tokens": 5, "max_tokens": 2}, "min_tokens"),
    ("chat", {"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ("chat", {"top_logprobs": 2}, "top_logprobs"),
    ("chat", {"stop": [""]}, "stop"),
    ("completions", {"logprobs": 21}, "logprobs"),
    ("completions", {"prompt": ""}, "prompt"),
    ("completions", {"prompt": [10**7]}, "prompt"),
    ("chat", {"n": 129}, "n"),  # OpenAI's limit is 128
    ("chat", {"stop": ["x"] * 65}, "stop"),
    ("chat", {"stop": ["x" * 1025]}, "stop"),  # each stop string is searched for after every token
    ("completions", {"stop_token_ids": [0] * 1025}, "stop_token_ids"),
    ("completions", {"structured_outputs": {"choice": 5}}, "structured_outputs"),  # not a list: never iterated
    ("completions", {"structured_outputs": {"choice": "yes"}}, "structured_outputs"),  # not split into letters
    ("completions", {"structured_outputs": {"json_object": "yes"}}, "structured_outputs"),
    # Nested past what is walked (an explicit stack): a 400, not a RecursionError's 500.
    ("chat", {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": json.loads(
        "[" * 400 + "]" * 400)}}}, "response_format"),
    ("chat", {"stream_options": {"include_usage": True}}, "stream_options"),  # without stream
    # Ignored, they would give one ordinary sample where the best of several, a beam, or tools were asked for.
    ("completions", {"best_of": 3}, "best_of"),
    ("chat", {"use_beam_search": True}, "use_beam_search"),
    ("chat", {"functions": [{"name": "f", "parameters": {}}]}, "functions"),
    ("chat", {"function_call": "auto"}, "function_call"),
    ("chat", {"priority": 1}, "priority"),  # ordered by it only under --scheduling-policy priority
    ("completions", {"priority": -1}, "priority"),
    ("chat", {"chat_template": "{{ messages }}"}, "chat_template"),  # the model's template renders every request
    ("chat", {"chat_template_kwargs": {"add_generation_prompt": False}}, "chat_template_kwargs"),
    ("completions", {"allowed_token_ids": []}, "allowed_token_ids"),
    ("completions", {"allowed_token_ids": [49152]}, "allowed_token_ids"),  # past the vocabulary
    ("chat", {"bad_words": [" "]}, "bad_words"),
    ("completions", {"truncate_prompt_tokens": 0}, "truncate_prompt_tokens"),
    ("completions", {"truncate_prompt_tokens": 2, "suffix": "x"}, "truncate_prompt_tokens"),  # the gap's token
    ("completions", {"allowed_token_ids": [2], "min_tokens": 1}, "allowed_token_ids"),  # 2: SmolLM2's EOS
    ("embeddings", {"input": "a", "truncate_prompt_tokens": -5}, "truncate_prompt_tokens"),
    ("chat", {"cache_salt": ""}, "cache_salt"),
    ("embeddings", {"input": "a", "cache_salt": ""}, "cache_salt"),
    ("embeddings", {"input": "a", "priority": -1}, "priority"),  # ordered by it only under the priority policy
    ("chat", {"logit_bias": {"abc": 1}}, "logit_bias"),
    ("chat", {"logit_bias": {"5": 101}}, "logit_bias"),  # OpenAI's range is [-100, 100]
    ("completions", {"logit_bias": {"49152": 1}}, "logit_bias"),  # past the vocabulary
    ("chat", {"response_format": {"type": "xml"}}, "response_format"),  # refused, not ignored
    ("chat", {"response_format": {"type": "json_schema", "json_schema": {"schema": {}}}},
     "response_format.json_schema"),  # a json_schema needs a name, as OpenAI's does
    # More sequences than the server ever queues (256): a 429 would invite retries that cannot succeed.
    ("completions", {"prompt": ["a"] * 257}, "prompt"),
    ("embeddings", {"input": ["a"] * 257}, "input"),  # refused whole, before any input runs
]


@pytest.mark.parametrize(("endpoint", "fields", "param"), BAD_VALUES)
def test_bad_sampling_value_is_400(base_url, endpoint, fields, param) -> None:
    body = {"messages": HI} if endpoint == "chat" else {} if endpoint == "embeddings" else {"prompt": "Hello"}
    assert_error(post(base_url, endpoint, {**body, **fields}), 400, param)


def test_deeply_nested_values_anywhere_are_400(base_url) -> None:
    deep = "[" * 400 + "]" * 400
    for endpoint, raw in (("chat", '{"messages": [{"role": "user", "content": "hi", "x": DEEP}]}'),
                          ("completions", '{"prompt": "hi", "structured_outputs": {"json": {"a": DEEP}}}')):
        raw = raw.replace("DEEP", deep)
        path = "/v1/chat/completions" if endpoint == "chat" else "/v1/completions"
        resp = httpx.post(f"{base_url}{path}", content=raw, headers={"Content-Type": "application/json"})
        assert resp.status_code == 400, resp.text
        assert "deep" in resp.json()["error"]["message"]
    # A schema sent as text nests only once as a value: parsed later, it is held to the same bound.
    for fields, param in (({"guided_json": deep}, "guided_json"),
                          ({"guided_json": "[" * 5000 + "]" * 5000}, "guided_json"),
                          ({"structured_outputs": {"json": '{"a": ' + deep + "}"}}, "structured_outputs"),
                          ({"response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": deep}}},
                           "response_format.json_schema.schema")):
        error = assert_error(post(base_url, "completions", {"prompt": "hi", **fields}), 400, param)
        assert "more than 100 deep" in error["message"]
    # Tool-call arguments in the history too deep to parse (or to render parsed) are kept as their text: the
    # deepest then makes a prompt past the context, the other is answered.
    for arguments, status in (("[" * 100_000 + "]" * 100_000, 400), ("[" * 150 + "]" * 150, 200)):
        call = {"id": "1", "type": "function", "function": {"name": "f", "arguments": arguments}}
        body = {"messages": [*HI, {"role": "assistant", "content": None, "tool_calls": [call]},
                             {"role": "tool", "tool_call_id": "1", "content": "ok"}],
                "tools": [{"type": "function", "function": {"name": "f"}}], "max_tokens": 1}
        resp = post(base_url, "chat", body)
        assert resp.status_code == status, resp.text
        if status == 400:
            assert resp.json()["error"]["code"] == "context_length_exceeded"


def test_malformed_json_and_non_object_body(base_url) -> None:
    for content in (b'{"messages": [', b"not json", b""):
        resp = httpx.post(f"{base_url}/v1/chat/completions", content=content,
                          headers={"Content-Type": "application/json"})
        assert_error(resp, 400, None)
    assert_error(post(base_url, "completions", [1, 2, 3]), 400, None)


def test_context_length_exceeded(base_url) -> None:
    error = assert_error(post(base_url, "completions", {"prompt": [504] * MAX_MODEL_LEN}), 400, "prompt",
                         "context_length_exceeded")
    assert str(MAX_MODEL_LEN) in error["message"]
    assert_error(post(base_url, "completions", {"prompt": [504] * 100, "max_tokens": MAX_MODEL_LEN}), 400,
                 "max_tokens", "context_length_exceeded")
    error = assert_error(post(base_url, "chat", {"messages": HI, "max_completion_tokens": 5000}), 400,
                         "max_completion_tokens", "context_length_exceeded")
    assert "max_completion_tokens asks for 5000" in error["message"]
    # Too long however it tokenizes: refused by its length in characters, before tokenizing.
    for endpoint, body in (("completions", {"prompt": "a " * 100_000}),
                           ("chat", {"messages": [{"role": "user", "content": "a " * 100_000}]})):
        error = assert_error(post(base_url, endpoint, body), 400, "prompt", "context_length_exceeded")
        assert "characters" in error["message"]


LONE_SURROGATES = [
    ("completions", {"prompt": "\ud800"}, "prompt"),
    ("completions", {"prompt": ["ok", "\udfff"]}, "prompt"),
    ("chat", {"messages": [{"role": "user", "content": "\ud800"}]}, "messages"),
    ("chat", {"messages": [{"role": "user", "content": [{"type": "text", "text": "x\udc00"}]}]}, "messages"),
    ("chat", {"messages": [{"role": "\ud800", "content": "hi"}]}, "messages"),
    ("chat", {"messages": HI, "model": "\ud800"}, "model"),
    ("chat", {"messages": HI, "stop": ["\ud800"]}, "stop"),
]


@pytest.mark.parametrize(("endpoint", "body", "param"), LONE_SURROGATES)
def test_unpaired_surrogates_are_400_and_the_connection_stays_usable(base_url, endpoint, body, param) -> None:
    """JSON's "\\ud800" escape decodes to a lone surrogate, which is not text: a 400 naming the field, not a
    500 from the tokenizer (which also closed the keep-alive connection)."""
    with httpx.Client(base_url=base_url, timeout=60) as client:
        path = "/v1/chat/completions" if endpoint == "chat" else "/v1/completions"
        raw = json.dumps({**body, "max_tokens": 2})  # ASCII, with "\\ud800" escapes (httpx's json= cannot)
        assert_error(client.post(path, content=raw, headers={"Content-Type": "application/json"}), 400, param,
                     "invalid_value")
        assert client.post("/v1/chat/completions", json={"messages": HI, "max_tokens": 2}).status_code == 200


def test_vanishing_temperature_or_top_p_samples_greedily(base_url) -> None:
    """1e-40 is 0 in float32: dividing logits by it gave NaN and the token 0, over and over."""
    def text(fields: dict) -> str:
        resp = post(base_url, "chat", {"messages": HI, "max_tokens": 8, "ignore_eos": True, **fields})
        assert resp.status_code == 200, resp.text
        return resp.json()["choices"][0]["message"]["content"]

    greedy = text({"temperature": 0})
    assert text({"temperature": 1e-40}) == greedy
    assert text({"temperature": 1.0, "top_p": 1e-300}) == greedy
    resp = post(base_url, "completions", {"prompt": "Hello", "max_tokens": 4, "temperature": 1.0, "logprobs": 1,
                                          "repetition_penalty": 1e-308})
    assert resp.status_code == 200, resp.text
    assert all(lp > -9999 for lp in resp.json()["choices"][0]["logprobs"]["token_logprobs"])


def test_an_oversized_body_is_413(base_url) -> None:
    """Over --max-request-body-bytes (16 MiB by default): refused from Content-Length without reading it,
    and a chunked body (no length) once the limit is crossed."""
    url = f"{base_url}/v1/completions"
    headers = {"Content-Type": "application/json"}
    big = b'{"prompt": "' + b"a" * (16 * 1024 * 1024) + b'"}'
    assert_error(httpx.post(url, content=big, headers=headers, timeout=60), 413, None, "request_too_large")
    assert_error(httpx.post(f"{base_url}/tokenize", content=big, headers=headers, timeout=60), 413, None,
                 "request_too_large")

    def chunked():
        yield b'{"prompt": "'
        for _ in range(17):
            yield b"a" * (1024 * 1024)
        yield b'"}'

    assert_error(httpx.post(url, content=chunked(), headers=headers, timeout=60), 413, None, "request_too_large")
    small = (piece for piece in (b'{"prompt": "Hi", ', b'"max_tokens": 2}'))  # chunked, under the limit
    assert httpx.post(url, content=small, headers=headers, timeout=60).status_code == 200


def test_unknown_model_is_404_and_unknown_route_is_404(base_url) -> None:
    error = assert_error(post(base_url, "chat", {"messages": HI, "model": "gpt-4o"}), 404, "model", "model_not_found")
    assert "gpt-4o" in error["message"]
    assert httpx.get(f"{base_url}/v1/nothing-here").status_code == 404


def test_odd_but_valid_requests_never_hurt_the_engine(base_url) -> None:
    odd = [
        ("chat", {"messages": HI, "temperature": 1e-30}),
        ("chat", {"messages": HI, "temperature": 1.0, "seed": 2**80}),
        ("chat", {"messages": HI, "temperature": 1.0, "seed": -(2**70)}),
        ("chat", {"messages": HI, "top_k": 10**9, "temperature": 1.0}),
        # No filter (2**63) batched with a real top_k: the sampler's int64 tensor of them overflowed.
        ("chat", {"messages": HI, "top_k": 2**63, "temperature": 1.0}),
        ("chat", {"messages": HI, "top_k": 40, "temperature": 1.0}),
        ("chat", {"messages": HI, "repetition_penalty": 1e-9}),
        ("chat", {"messages": HI, "repetition_penalty": 1e9, "presence_penalty": 2, "frequency_penalty": -2}),
        ("chat", {"messages": HI, "n": 4, "temperature": 2.0, "top_p": 0.01, "min_p": 1.0}),
        ("chat", {"messages": HI, "logprobs": True, "top_logprobs": 20, "stop": ["a", "e", "!"],
                  "include_stop_str_in_output": True}),
        ("chat", {"messages": HI, "min_tokens": 3, "stop_token_ids": [0, 2, 49151]}),
        ("chat", {"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
                               {"role": "assistant", "content": "Hello"},
                               {"role": "user", "content": [{"type": "text", "text": "Again"}]}]}),
        ("completions", {"prompt": "<|im_start|><|im_end|><|endoftext|>", "logprobs": 20}),
        ("completions", {"prompt": "\u00e9\u4e2d\U0001f600", "skip_special_tokens": False}),
        ("completions", {"prompt": [0], "ignore_eos": True}),
    ]

    async def run() -> list[httpx.Response]:
        async with httpx.AsyncClient(base_url=base_url, timeout=60) as c:
            calls = [c.post("/v1/chat/completions" if ep == "chat" else "/v1/completions",
                            json={**body, "max_tokens": 3}) for ep, body in odd]
            calls += [c.post("/v1/chat/completions", json={"messages": HI, "max_tokens": 3, "stream": True,
                                                           "n": 2, "logprobs": True})]
            return await asyncio.gather(*calls)

    for resp in asyncio.run(run()):
        assert resp.status_code == 200, resp.text
    assert httpx.get(f"{base_url}/health").status_code == 200
    assert post(base_url, "chat", {"messages": HI, "max_tokens": 2}).status_code == 200


def _wait_until(predicate, timeout: float = 20.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.1)
    return predicate()


def test_disconnected_clients_abort_and_free_their_blocks(base_url) -> None:
    aborted_before = metric_value(base_url, "kvserve:request_success_total", 'finished_reason="abort"')
    num_streams = 50

    async def stream_then_leave(c: httpx.AsyncClient, i: int) -> str:
        body = {"prompt": f"Request {i}: tell me a long story about", "max_tokens": 300, "ignore_eos": True,
                "stream": True, "temperature": 0}
        async with c.stream("POST", "/v1/completions", json=body) as r:
            assert r.status_code == 200
            async for line in r.aiter_lines():
                if line.startswith("data: {"):
                    return line  # leave mid-stream: the response is closed unread
        raise AssertionError("stream ended before any chunk")

    async def wait_then_leave(c: httpx.AsyncClient) -> None:
        body = {"messages": HI, "max_tokens": 300, "ignore_eos": True}
        with pytest.raises(httpx.ReadTimeout):
            await c.post("/v1/chat/completions", json=body, timeout=httpx.Timeout(60, read=1.5))

    async def run() -> None:
        limits = httpx.Limits(max_connections=num_streams + 1)
        async with httpx.AsyncClient(base_url=base_url, timeout=60, limits=limits) as c:
            await asyncio.gather(*(stream_then_leave(c, i) for i in range(num_streams)), wait_then_leave(c))

    asyncio.run(run())

    def all_freed() -> bool:
        return (metric_value(base_url, "kvserve:kv_blocks_used") == 0
                and metric_value(base_url, "kvserve:num_requests_running") == 0
                and metric_value(base_url, "kvserve:num_requests_waiting") == 0)

    assert _wait_until(all_freed), httpx.get(f"{base_url}/metrics").text[-3000:]
    aborted = metric_value(base_url, "kvserve:request_success_total", 'finished_reason="abort"') - aborted_before
    assert aborted == num_streams + 1  # none of them ran to its 300 tokens
    assert post(base_url, "chat", {"messages": HI, "max_tokens": 2}).status_code == 200
