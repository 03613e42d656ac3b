"""The HTTP API fuzzed from its own OpenAPI document (Schemathesis strategies driven by Hypothesis): bodies
that fit the schema and bodies that break it (wrong types, missing and extra fields, unicode edge cases,
numbers at and past their bounds) sent to a real server over loopback.

Every answer must be a 2xx with a well-formed body (JSON, or a server-sent event stream that ends) or a
4xx with an OpenAI-style error body: never a 5xx, a hang or a dropped connection. Afterwards the server
is healthy, no request is left running and the KV block accounting holds.

``FUZZ_EXAMPLES`` bodies per operation and mode run in CI; ``pytest -m heavy`` runs the long version.
"""

from __future__ import annotations

import json
import time
from collections import Counter
from collections.abc import Iterator

import httpx
import pytest

schemathesis = pytest.importorskip("schemathesis")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from schemathesis import GenerationMode  # noqa: E402

from kvserve.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig  # noqa: E402
from kvserve.server.serving import BackgroundServer  # noqa: E402
from kvserve.serving_config import ServerConfig  # noqa: E402
from tests.support.tiny_models import make_tiny_model  # noqa: E402

MODEL_NAME = "tiny"
FUZZ_EXAMPLES = 14
HEAVY_EXAMPLES = 1000
OPERATIONS = [("POST", "/v1/chat/completions"), ("POST", "/v1/completions"), ("POST", "/v1/responses"),
              ("POST", "/tokenize"), ("POST", "/detokenize"), ("GET", "/v1/models"),
              ("GET", "/v1/responses/{response_id}"), ("DELETE", "/v1/responses/{response_id}"),
              ("GET", "/v1/responses/{response_id}/input_items"), ("GET", "/health"), ("GET", "/metrics")]
RESPONSES_ENDS = ("response.completed", "response.incomplete", "response.failed")  # a Responses stream's last
TOKENIZER_ROUTES = ("/tokenize", "/detokenize")
TIMEOUT_S = 60.0  # per request: a hang fails the test instead of stalling it


@pytest.fixture(scope="module")
def fuzz_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[BackgroundServer]:
    model = make_tiny_model(tmp_path_factory.mktemp("fuzz"), "llama")
    config = EngineConfig(model=ModelConfig(model=str(model), dtype="float32", show_progress=False, max_model_len=96),
                          cache=CacheConfig(num_kv_blocks=48),
                          scheduler=SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=256))
    server = BackgroundServer(config, ServerConfig(port=0, served_model_name=MODEL_NAME))
    yield server
    server.stop()


def check_answer(response: httpx.Response, body: object) -> None:
    """A 2xx with a well-formed body, or a 4xx with an OpenAI-style error; anything else fails."""
    status = response.status_code
    assert status < 500, f"{status} for {body!r}: {response.text[:500]}"
    if status >= 400:
        error = response.json()["error"]
        assert isinstance(error["message"], str) and error["message"], response.text
        assert isinstance(error["type"], str), response.text
        return
    assert 200 <= status < 300, f"{status} for {body!r}"
    content_type = response.headers.get("content-type", "")
    if content_type.startswith("text/event-stream"):
        events = [line.removeprefix("data: ") for line in response.text.splitlines() if line.startswith("data: ")]
        if response.url.path.endswith("/responses"):  # typed events, no [DONE]
            assert events and json.loads(events[-1])["type"] in RESPONSES_ENDS, response.text[-500:]
            return
        assert events and events[-1] == "[DONE]", response.text[-500:]
        for event in events[:-1]:
            chunk = json.loads(event)
            assert "choices" in chunk or "error" in chunk, event
    elif content_type.startswith("application/json"):
        answer = response.json()
        if isinstance(body, dict) and "choices" in answer:
            assert isinstance(answer["choices"], list) and answer["usage"]["completion_tokens"] >= 0
    else:
        assert response.text  # /metrics: Prometheus text


def fuzz_operation(server: BackgroundServer, method: str, path: str, mode: GenerationMode,
                   num_examples: int, counts: Counter[int]) -> None:
    schema = schemathesis.openapi.from_url(f"{server.base_url}/openapi.json")
    operation = schema[path][method]
    strategy = operation.as_strategy(generation_mode=mode)
    if mode is GenerationMode.POSITIVE and method == "POST":
        # The schema says little of a prompt or a message (the server checks them by hand, for errors that
        # say what is wrong), so schema-valid bodies get a real one, and mostly name the served model;
        # every other field stays as generated, at and past its bounds.
        strategy = st.tuples(strategy, st.booleans(), PROMPTS, MESSAGES).map(lambda args: make_usable(*args))

    with httpx.Client(base_url=server.base_url, timeout=TIMEOUT_S) as client:

        @settings(max_examples=num_examples, deadline=None, database=None, derandomize=True,
                  suppress_health_check=list(HealthCheck))
        @given(case=strategy)
        def run(case) -> None:
            kwargs = case.as_transport_kwargs(base_url=server.base_url)
            request = client.build_request(kwargs["method"], kwargs["url"], headers=kwargs.get("headers"),
                                           params=kwargs.get("params"), json=kwargs.get("json"),
                                           content=kwargs.get("data"))
            response = client.send(request)
            counts[response.status_code] += 1
            check_answer(response, case.body)

        run()


TEXT = st.text(max_size=120)
PROMPTS = st.one_of(TEXT, st.lists(st.text(min_size=1, max_size=40), min_size=1, max_size=3),
                    st.lists(st.integers(0, 49151), min_size=1, max_size=80),
                    st.lists(st.lists(st.integers(0, 49151), min_size=1, max_size=20), min_size=1, max_size=2))
MESSAGES = st.lists(st.fixed_dictionaries({"role": st.sampled_from(["system", "user", "assistant"]),
                                           "content": TEXT}), min_size=1, max_size=4)


def make_usable(case, served: bool, prompt: object, messages: list[dict[str, str]]):
    if isinstance(case.body, dict):
        if served:
            case.body["model"] = MODEL_NAME
        if "input" in case.body:  # the Responses API: a text, or messages as input items
            case.body["input"] = prompt if isinstance(prompt, str) else messages
        else:
            case.body["prompt" if "prompt" in case.body else "messages"] = (
                prompt if "prompt" in case.body else messages)
    return case


def wait_idle(server: BackgroundServer, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        stats = server.async_engine.stats()
        if stats.num_running == 0 and stats.num_waiting == 0:
            return
        time.sleep(0.05)
    raise AssertionError(f"requests still in the engine after the fuzzing: {server.async_engine.stats()}")


def run_fuzz(server: BackgroundServer, num_examples: int) -> Counter[int]:
    counts: Counter[int] = Counter()
    for method, path in OPERATIONS:
        # The other routes take a path's id at most: nothing there can break the schema.
        modes = (GenerationMode.POSITIVE, GenerationMode.NEGATIVE) if method == "POST" else (GenerationMode.POSITIVE,)
        # The tokenizer routes run no model and share the generation routes' validation: fewer bodies.
        examples = num_examples // 4 if path in TOKENIZER_ROUTES else num_examples
        for mode in modes:
            fuzz_operation(server, method, path, mode, examples, counts)
    assert httpx.get(f"{server.base_url}/health", timeout=10).status_code == 200
    wait_idle(server)
    audit = httpx.get(f"{server.base_url}/kvserve/audit", timeout=30).json()
    # Cached blocks may stay; none is held, and no prefix is locked, with no request left.
    assert audit == {"ok": True, "error": None, "num_unfinished": 0, "num_used_blocks": 0, "num_locked_nodes": 0}
    return counts


def test_fuzzed_bodies_get_a_valid_answer_or_an_openai_error(fuzz_server: BackgroundServer) -> None:
    counts = run_fuzz(fuzz_server, FUZZ_EXAMPLES)
    assert sum(counts.values()) >= FUZZ_EXAMPLES * 6  # three POST routes, each valid and invalid bodies
    assert any(200 <= status < 300 for status in counts) and any(400 <= s < 500 for s in counts), counts


@pytest.mark.heavy
def test_thousands_of_fuzzed_bodies(fuzz_server: BackgroundServer) -> None:
    counts = run_fuzz(fuzz_server, HEAVY_EXAMPLES)
    print(f"fuzzed requests by status: {dict(sorted(counts.items()))}, total {sum(counts.values())}")


# Each bounded parameter at its bound (accepted) and just past it (a 400 naming it), on both routes.
BOUNDS = [("n", 128, 129), ("temperature", 0.0, -1e-9), ("top_p", 1.0, 1.0000001), ("top_k", -1, -2),
          ("min_p", 1.0, 1.01), ("presence_penalty", 2.0, 2.0001), ("frequency_penalty", -2.0, -2.0001),
          ("repetition_penalty", 1e-9, 0.0), ("max_tokens", 1, 0), ("min_tokens", 0, -1),
          ("seed", 2**63 - 1, "7"), ("stop", ["."] * 64, ["."] * 65), ("logit_bias", {"5": 100.0}, {"5": 100.5}),
          ("stop_token_ids", [0], [-1]), ("prompt_logprobs", 20, 21)]


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
@pytest.mark.parametrize(("param", "at", "past"), BOUNDS, ids=[b[0] for b in BOUNDS])
def test_each_parameter_at_its_bound_is_served_and_past_it_is_a_400_naming_it(
    fuzz_server: BackgroundServer, path: str, param: str, at: object, past: object
) -> None:
    base = {"model": MODEL_NAME, "max_tokens": 2}
    base.update({"prompt": "Hi"} if path == "/v1/completions" else {"messages": [{"role": "user", "content": "Hi"}]})
    with httpx.Client(base_url=fuzz_server.base_url, timeout=TIMEOUT_S) as client:
        ok = client.post(path, json={**base, param: at})
        assert ok.status_code == 200, ok.text
        bad = client.post(path, json={**base, param: past})
        assert bad.status_code == 400, bad.text
        assert bad.json()["error"]["param"] == param, bad.text
