"""A dead engine loop, in process: the real AsyncEngine and app over a fake engine whose step() fails.

/health must say 503 and why; requests in flight end with an error instead of hanging, and new requests
get 503 (EngineDeadError) at once.
"""

from __future__ import annotations

import asyncio
import json
import time
from types import SimpleNamespace

import httpx
import pytest

from kvserve.async_engine import AsyncEngine
from kvserve.engine import EngineStats
from kvserve.request import CompletionOutput, ProcessedPrompt, RequestMetrics, RequestOutput
from kvserve.sampling_params import SamplingParams
from kvserve.server.openai_api import build_app
from kvserve.serving_config import ServerConfig


class PassThroughInputs:
    """Token-id prompts taken as they are: this engine has no tokenizer."""

    def __init__(self) -> None:
        self.num_calls = 0

    def resolve_params(self, params: SamplingParams) -> SamplingParams:
        return params

    def process(self, prompt: object, params: SamplingParams, compile_grammar: bool = True) -> ProcessedPrompt:
        self.num_calls += 1
        if isinstance(prompt, dict):
            prompt = prompt["prompt_token_ids"]
        assert isinstance(prompt, list)
        return ProcessedPrompt(list(prompt), None, params)

    def check_text_fits(self, text: str) -> None:
        self.num_calls += 1


class FailingEngine:
    """Emits one token per request on the first step, then fails on the step after ``fail_after`` steps."""

    max_model_len = 128

    def __init__(self, fail_after: int) -> None:
        self.fail_after = fail_after
        self.num_steps = 0
        self.num_added = 0
        self.scheduler = SimpleNamespace(requests={})
        self.input_processor = PassThroughInputs()
        self.loras: dict[str, object] = {}  # no LoRA adapters
        self.reasoning_markers = self.reasoning_tokens = None  # no thoughts apart from its answers

    def stats(self) -> EngineStats:
        n = len(self.scheduler.requests)
        return EngineStats(num_running=n, num_waiting=0, num_kv_blocks=8, num_used_blocks=n, num_cached_blocks=0,
                           num_free_blocks=8 - n, num_evicted_blocks=0, num_preemptions=0,
                           prefix_cache_queries=0, prefix_cache_hits=0, num_prompt_tokens_computed=0,
                           num_generated_tokens=0, num_steps=self.num_steps, busy_time_s=0.0)

    @property
    def num_consulted(self) -> int:
        """Calls that validate, tokenise or add a request."""
        return self.input_processor.num_calls + self.num_added

    def add_processed(self, processed: ProcessedPrompt, request_id: str) -> None:
        self.num_added += 1
        self.scheduler.requests[request_id] = SimpleNamespace(prompt=None, token_ids=processed.prompt_token_ids)

    def has_unfinished_requests(self) -> bool:
        return bool(self.scheduler.requests)

    def unfinished_request_ids(self) -> list[str]:
        return list(self.scheduler.requests)

    def step(self) -> list[RequestOutput]:
        self.num_steps += 1
        if self.num_steps > self.fail_after:
            raise RuntimeError("injected fault: device lost")
        outputs = []
        for request_id, request in self.scheduler.requests.items():
            metrics = RequestMetrics(arrival_time=time.monotonic())
            completion = CompletionOutput(index=0, text="a", token_ids=[7])
            outputs.append(RequestOutput(request_id, None, request.token_ids, [completion], False, 0, metrics,
                                         delta_text="a", delta_token_ids=[7]))
        time.sleep(0.05)
        return outputs

    def abort_request(self, request_id: str) -> RequestOutput | None:
        self.scheduler.requests.pop(request_id, None)
        return None


def _app(fail_after: int):
    async_engine = AsyncEngine(FailingEngine(fail_after))  # type: ignore[arg-type]
    app = build_app(async_engine, ServerConfig(), tokenizer=None, model_names=("fake",))  # type: ignore[arg-type]
    return async_engine, app


def _client(app) -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://testserver", timeout=10)


def test_request_during_failure_gets_503_then_health_says_dead() -> None:
    async_engine, app = _app(fail_after=0)

    async def run() -> None:
        async with _client(app) as c:
            assert (await c.get("/health")).status_code == 200
            resp = await c.post("/v1/completions", json={"prompt": [1, 2, 3], "max_tokens": 4})
            assert resp.status_code == 503
            assert resp.json()["error"]["code"] == "engine_dead"
            health = await c.get("/health")
            assert health.status_code == 503
            assert health.json()["status"] == "dead" and "injected fault" in health.json()["error"]
            # Later requests fail at once, before anything is queued: the engine never sees them.
            consulted = async_engine.engine.num_consulted
            resp = await c.post("/v1/completions", json={"prompt": [1, 2, 3], "max_tokens": 4, "stream": True})
            assert resp.status_code == 503 and async_engine.engine.num_consulted == consulted
            assert async_engine.num_unfinished() == 0
            assert "kvserve:engine_alive 0.0" in (await c.get("/metrics")).text

    try:
        asyncio.run(asyncio.wait_for(run(), 30))
    finally:
        async_engine.shutdown(timeout=5)


@pytest.mark.parametrize("stream", [True, False])
def test_engine_dying_mid_request_ends_it_with_an_error(stream: bool) -> None:
    async_engine, app = _app(fail_after=1)

    async def run() -> httpx.Response:
        async with _client(app) as c:
            return await c.post("/v1/completions", json={"prompt": [1, 2, 3], "max_tokens": 4, "stream": stream})

    try:
        resp = asyncio.run(asyncio.wait_for(run(), 30))
    finally:
        async_engine.shutdown(timeout=5)
    assert not async_engine.is_alive
    if not stream:
        assert resp.status_code == 503 and resp.json()["error"]["code"] == "engine_dead"
        return
    # The stream had started (one token): it ends with an error event and [DONE], not a hang.
    assert resp.status_code == 200
    events = [line[len("data: "):] for line in resp.text.splitlines() if line.startswith("data: ")]
    assert json.loads(events[0])["choices"][0]["text"] == "a"
    assert json.loads(events[-2])["error"]["code"] == "engine_dead"
    assert events[-1] == "[DONE]"


def test_a_fault_of_the_server_mid_stream_ends_it_with_an_error_event(monkeypatch) -> None:
    """Not the engine's death but a bug in building a chunk: the stream still ends with an error event and
    [DONE], not a dropped connection."""
    from kvserve.server.responses import ResponseBuilder

    async_engine, app = _app(fail_after=10)
    built = ResponseBuilder._chunk_choice
    calls = []

    def failing_second(self, *args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            raise RuntimeError("a bug")
        return built(self, *args, **kwargs)

    monkeypatch.setattr(ResponseBuilder, "_chunk_choice", failing_second)

    async def run() -> httpx.Response:
        async with _client(app) as c:
            return await c.post("/v1/completions", json={"prompt": [1, 2, 3], "max_tokens": 4, "stream": True})

    try:
        resp = asyncio.run(asyncio.wait_for(run(), 30))
    finally:
        async_engine.shutdown(timeout=5)
    events = [line[len("data: "):] for line in resp.text.splitlines() if line.startswith("data: ")]
    assert json.loads(events[0])["choices"][0]["text"] == "a"
    assert json.loads(events[-2])["error"]["code"] == "internal_error" and events[-1] == "[DONE]"
