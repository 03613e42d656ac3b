"""The OpenAI app called in-process (server/in_process.py), as a Ray Serve replica calls the engine it holds:
answers and streams are the server's own, errors keep their status and body, and a caller that stops reading
mid-stream aborts its engine request with nothing left behind."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator

import pytest
from starlette.types import Message, Receive, Scope, Send

from kvserve.async_engine import AsyncEngine
from kvserve.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from kvserve.server.in_process import call_app
from kvserve.server.serving import build_server
from kvserve.serving_config import ServerConfig
from tests.support.tiny_models import make_tiny_model

MODEL_NAME = "tiny"
ALIAS = "tiny-alias"  # a second --served-model-name


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[AsyncEngine, object]]:
    model = make_tiny_model(tmp_path_factory.mktemp("in-process"), "llama")
    config = EngineConfig(model=ModelConfig(model=str(model), dtype="float32", show_progress=False, max_model_len=512),
                          cache=CacheConfig(num_kv_blocks=64),
                          scheduler=SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=256))
    engine, async_engine, app = build_server(config, ServerConfig(served_model_name=(MODEL_NAME, ALIAS)))
    yield async_engine, app
    async_engine.shutdown()
    engine.close()


async def collect(app: object, path: str, body: dict[str, object]) -> tuple[int, str, list[bytes]]:
    answer = call_app(app, "POST", path, json.dumps(body).encode(), {"content-type": "application/json"})
    status, content_type = await answer.__anext__()
    return status, content_type, [chunk async for chunk in answer]


def test_a_streamed_answer_says_what_the_whole_answer_says(server) -> None:
    _, app = server
    request = {"model": MODEL_NAME, "prompt": [5, 6, 7, 8], "max_tokens": 8, "temperature": 0, "ignore_eos": True}

    status, content_type, chunks = asyncio.run(collect(app, "/v1/completions", {**request, "stream": True}))
    assert (status, content_type.split(";")[0]) == (200, "text/event-stream")
    events = [line.removeprefix(b"data: ") for line in b"".join(chunks).splitlines() if line.startswith(b"data: ")]
    assert events[-1] == b"[DONE]"
    streamed = "".join(json.loads(e)["choices"][0]["text"] for e in events[:-1] if json.loads(e)["choices"])

    status, content_type, chunks = asyncio.run(collect(app, "/v1/completions", request))
    assert (status, content_type) == (200, "application/json")
    whole = json.loads(b"".join(chunks))
    assert whole["usage"]["completion_tokens"] == 8
    assert whole["choices"][0]["text"] == streamed


def test_errors_keep_their_status_and_openai_body(server) -> None:
    _, app = server
    status, _, chunks = asyncio.run(collect(app, "/v1/completions", {"model": "other", "prompt": "hi"}))
    assert status == 404
    assert "'other' does not exist" in json.loads(b"".join(chunks))["error"]["message"]
    status, _, chunks = asyncio.run(collect(app, "/v1/completions", {"model": MODEL_NAME, "prompt": "hi",
                                                                     "max_tokens": -1}))
    assert status == 400 and json.loads(b"".join(chunks))["error"]["message"]


def test_every_served_name_is_the_model_and_a_response_names_the_one_it_was_sent(server) -> None:
    _, app = server

    async def get(path: str) -> tuple[int, dict]:
        answer = call_app(app, "GET", path, b"", {})
        status, _ = await answer.__anext__()
        return status, json.loads(b"".join([chunk async for chunk in answer]))

    status, listed = asyncio.run(get("/v1/models"))
    assert status == 200 and [card["id"] for card in listed["data"]] == [MODEL_NAME, ALIAS]
    assert asyncio.run(get(f"/v1/models/{ALIAS}")) [1]["id"] == ALIAS
    status, error = asyncio.run(get("/v1/models/other"))
    assert status == 404 and f"'{MODEL_NAME}', '{ALIAS}'" in error["error"]["message"]
    status, _, chunks = asyncio.run(collect(app, "/v1/completions", {"model": ALIAS, "prompt": [5, 6], "max_tokens": 2}))
    assert status == 200 and json.loads(b"".join(chunks))["model"] == ALIAS  # as vLLM: the name it was sent
    status, _, chunks = asyncio.run(collect(app, "/v1/completions", {"prompt": [5, 6], "max_tokens": 2}))
    assert status == 200 and json.loads(b"".join(chunks))["model"] == MODEL_NAME  # none sent: the first


def test_a_caller_that_stops_reading_aborts_its_request_and_frees_its_blocks(server) -> None:
    async_engine, app = server

    async def read_two_chunks_then_leave() -> None:
        body = {"model": MODEL_NAME, "prompt": [5, 6, 7], "max_tokens": 400, "temperature": 0, "ignore_eos": True,
                "stream": True}
        answer = call_app(app, "POST", "/v1/completions", json.dumps(body).encode(),
                          {"content-type": "application/json"})
        assert (await answer.__anext__())[0] == 200
        await answer.__anext__()
        await answer.__anext__()
        assert async_engine.num_unfinished() == 1
        await answer.aclose()  # returns once the app has ended the request
        for _ in range(200):  # the abort lands at the engine's next step
            if async_engine.num_unfinished() == 0:
                break
            await asyncio.sleep(0.01)
        audit = await async_engine.audit()
        assert audit.ok, audit.error
        assert audit.num_unfinished == 0

    asyncio.run(read_two_chunks_then_leave())


def test_closing_early_delivers_a_disconnect_to_the_app() -> None:
    received: list[Message] = []

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        assert (scope["method"], scope["path"], scope["query_string"]) == ("POST", "/stream", b"n=3")
        received.append(await receive())
        await send({"type": "http.response.start", "status": 201, "headers": [(b"content-type", b"text/plain")]})
        await send({"type": "http.response.body", "body": b"first", "more_body": True})
        received.append(await receive())  # waits until the caller goes away

    async def leave_after_the_first_chunk() -> list[object]:
        answer = call_app(app, "POST", "/stream?n=3", b"payload")
        items = [await answer.__anext__(), await answer.__anext__()]
        await answer.aclose()
        return items

    assert asyncio.run(leave_after_the_first_chunk()) == [(201, "text/plain"), b"first"]
    assert received == [{"type": "http.request", "body": b"payload", "more_body": False}, {"type": "http.disconnect"}]
