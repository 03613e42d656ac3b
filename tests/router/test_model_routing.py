"""Routing by difficulty: each policy's rule on fixed inputs, and the gateway routing the auto model over two
fake models' replicas (real HTTP on loopback, the official openai client)."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import numpy as np
import openai
import pytest
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from kvserve.cli import main
from kvserve.errors import ConfigError, InvalidRequest
from kvserve.evals.probe_training import train_probe
from kvserve.router.answers import answer_as_events, as_client_asked, combined_usage, for_cascade
from kvserve.router.model_policies import (
    CascadeRoute,
    Difficulty,
    GainProbe,
    LengthRoute,
    LogisticProbe,
    ProbeRoute,
    RandomRoute,
    confidence,
    load_probe,
    make_model_policy,
    oracle_size,
)
from kvserve.serving_config import RouterConfig
from tests.router.conftest import BackgroundGateway, FakeReplica

SMALL, LARGE = "coder-small", "coder-large"
HIDDEN = 4


# --- the rules -----------------------------------------------------------------------------------------------
def test_random_sends_its_share_to_the_large_model_and_repeats_with_its_seed() -> None:
    policy = RandomRoute(0.3, seed=7)
    sizes = [policy.choose(Difficulty(10)).size for _ in range(2000)]
    assert 0.27 < sizes.count("large") / len(sizes) < 0.33
    again = RandomRoute(0.3, seed=7)
    assert [again.choose(Difficulty(10)).size for _ in range(2000)] == sizes
    assert {RandomRoute(0.0).choose(Difficulty(10)).size for _ in range(100)} == {"small"}
    assert {RandomRoute(1.0).choose(Difficulty(10)).size for _ in range(100)} == {"large"}


def test_length_sends_prompts_longer_than_the_threshold_to_the_large_model() -> None:
    policy = LengthRoute(100)
    assert policy.choose(Difficulty(100)).size == "small"
    assert policy.choose(Difficulty(101)).size == "large"
    assert policy.choose(Difficulty(101)).score == 101.0


def test_cascade_keeps_a_confident_answer_and_escalates_the_rest() -> None:
    policy = CascadeRoute(-0.5)
    assert policy.choose(Difficulty(10)).size == "small"
    assert policy.accepts(-0.5) and policy.accepts(-0.1)
    assert not policy.accepts(-0.51)
    assert not policy.accepts(None)  # no logprobs: nothing to judge by


def test_confidence_signals_of_chat_and_completions_answers() -> None:
    chat = [{"logprobs": {"content": [
        {"token": "a", "logprob": -0.1, "top_logprobs": [{"token": "a", "logprob": -0.1},
                                                        {"token": "b", "logprob": -2.4}]},
        {"token": "c", "logprob": -0.7, "top_logprobs": [{"token": "c", "logprob": -0.7},
                                                        {"token": "d", "logprob": -0.7}]}]}}]
    completion = [{"logprobs": {"token_logprobs": [-0.1, -0.7],
                                "top_logprobs": [{"a": -0.1, "b": -2.4}, {"c": -0.7, "d": -0.7}]}}]
    for choices in (chat, completion):
        assert confidence(choices, "mean_logprob") == pytest.approx(-0.4)
        assert confidence(choices, "min_logprob") == pytest.approx(-0.7)
        p = np.exp([-0.1, -2.4]) / np.exp([-0.1, -2.4]).sum()
        two_way = -(p * np.log(p)).sum()
        assert confidence(choices, "mean_entropy") == pytest.approx(-(two_way + np.log(2)) / 2)
    assert confidence([{"logprobs": None}], "mean_logprob") is None


def test_probe_learns_a_separable_rule_and_survives_its_file(tmp_path: Path) -> None:
    rng = np.random.default_rng(0)
    features = rng.normal(size=(200, HIDDEN))
    labels = (features[:, 1] - 0.5 * features[:, 3] > 0).astype(float)  # 1: the small model fails
    probe = LogisticProbe.fit(SMALL, features, labels, l2=0.1)
    predicted = np.array([probe.predict(x) for x in features]) >= 0.5
    assert (predicted == labels.astype(bool)).mean() > 0.95
    path = tmp_path / "probe.json"
    probe.save(str(path))
    assert LogisticProbe.load(str(path)) == probe
    policy = ProbeRoute(LogisticProbe.load(str(path)), 0.5)
    hard = policy.choose(Difficulty(10, (0.0, 3.0, 0.0, 0.0)))
    easy = policy.choose(Difficulty(10, (0.0, -3.0, 0.0, 0.0)))
    assert (hard.size, easy.size) == ("large", "small")
    assert hard.score is not None and hard.score > 0.9
    assert policy.choose(Difficulty(10, None)).size == "large"  # no hidden state: the safe side
    assert policy.choose(Difficulty(10, (1.0, 2.0))).reason == "probe_unavailable"  # another model's
    path.write_text('{"kind": "something else"}')
    with pytest.raises(ConfigError, match="probe"):
        LogisticProbe.load(str(path))


def test_gain_probe_leaves_to_the_small_model_what_both_fail_and_survives_its_file(tmp_path: Path) -> None:
    rng = np.random.default_rng(0)
    features = rng.normal(size=(400, HIDDEN))
    small_fails = (features[:, 0] > 0).astype(float)
    large_fails = ((features[:, 0] > 0) & (features[:, 1] > 0)).astype(float)  # too hard for both
    gain = GainProbe(LogisticProbe.fit(SMALL, features, small_fails, l2=0.1),
                     LogisticProbe.fit(SMALL, features, large_fails, l2=0.1))
    path = tmp_path / "gain.json"
    gain.save(str(path))
    assert load_probe(str(path)) == gain
    policy = make_model_policy(RouterConfig(model_policy="gain", small_model=SMALL, large_model=LARGE,
                                            probe_path=str(path)))
    assert isinstance(policy, ProbeRoute) and (policy.name, policy.threshold) == ("gain", 0.15)
    large_helps = policy.choose(Difficulty(10, (3.0, -3.0, 0.0, 0.0)))
    both_fail = policy.choose(Difficulty(10, (3.0, 3.0, 0.0, 0.0)))
    both_pass = policy.choose(Difficulty(10, (-3.0, 0.0, 0.0, 0.0)))
    assert (large_helps.size, both_fail.size, both_pass.size) == ("large", "small", "small")
    assert large_helps.score is not None and large_helps.score > 0.9 and large_helps.reason == "gain"
    assert both_fail.score is not None and abs(both_fail.score) < 0.1
    # A probe of the failure then routes the prompts both fail to the large model, for nothing.
    failure = ProbeRoute(gain.small_fails, 0.5)
    assert failure.name == "probe" and failure.choose(Difficulty(10, (3.0, 3.0, 0.0, 0.0))).size == "large"
    with pytest.raises(ConfigError, match="not a probe of one model's failure"):
        LogisticProbe.load(str(path))
    gain.small_fails.save(str(tmp_path / "failure.json"))
    with pytest.raises(ConfigError, match="gain needs a gain probe"):
        make_model_policy(RouterConfig(model_policy="gain", small_model=SMALL, large_model=LARGE,
                                       probe_path=str(tmp_path / "failure.json")))
    with pytest.raises(ConfigError, match="probe needs a probe of the small model's failure"):
        make_model_policy(RouterConfig(model_policy="probe", small_model=SMALL, large_model=LARGE,
                                       probe_path=str(path)))
    with pytest.raises(ValueError, match="different hidden states"):
        GainProbe(gain.small_fails, LogisticProbe.fit(LARGE, features, large_fails, l2=0.1))


def test_oracle_pays_for_the_large_model_only_when_it_alone_passes() -> None:
    assert oracle_size(small_passed=False, large_passed=True) == "large"
    assert oracle_size(small_passed=True, large_passed=True) == "small"
    assert oracle_size(small_passed=False, large_passed=False) == "small"
    assert oracle_size(small_passed=True, large_passed=False) == "small"


def test_a_model_policy_needs_two_models_and_its_file() -> None:
    with pytest.raises(ConfigError, match="small-model"):
        RouterConfig(model_policy="length", small_model=SMALL)
    for needs_a_file in ("probe", "gain"):
        with pytest.raises(ConfigError, match=f"{needs_a_file} needs --probe"):
            RouterConfig(model_policy=needs_a_file, small_model=SMALL, large_model=LARGE)  # type: ignore[arg-type]
    policy = make_model_policy(RouterConfig(model_policy="length", small_model=SMALL, large_model=LARGE))
    assert isinstance(policy, LengthRoute) and policy.threshold == 256


def test_answer_shapes() -> None:
    request = {"model": "auto", "prompt": "x", "stream": True, "stream_options": {"include_usage": True}}
    first = for_cascade(request, "/v1/completions", SMALL)
    assert first == {"model": SMALL, "prompt": "x", "logprobs": 5}
    chat_first = for_cascade({"messages": [], "logprobs": True, "top_logprobs": 8}, "/v1/chat/completions", SMALL)
    assert (chat_first["logprobs"], chat_first["top_logprobs"]) == (True, 8)
    answer = {"choices": [{"index": 0, "text": "hi", "finish_reason": "stop",
                           "logprobs": {"token_logprobs": [-0.1], "top_logprobs": [{"a": -0.1, "b": -1.0}]}}]}
    trimmed = as_client_asked(json.loads(json.dumps(answer)), {"logprobs": 1}, "/v1/completions")
    assert trimmed["choices"][0]["logprobs"]["top_logprobs"] == [{"a": -0.1}]
    assert as_client_asked(answer, {}, "/v1/completions")["choices"][0]["logprobs"] is None
    events = answer_as_events({**answer, "usage": {"prompt_tokens": 1}}, "/v1/completions", include_usage=False)
    assert events[-1] == b"data: [DONE]\n\n" and len(events) == 2
    for bad in ("x", [1], -1, True):  # a count that is not one is the client's error, never the gateway's
        with pytest.raises(InvalidRequest) as info:
            for_cascade({"prompt": "x", "logprobs": bad}, "/v1/completions", SMALL)
        assert info.value.param == "logprobs"
        with pytest.raises(InvalidRequest):
            as_client_asked(answer, {"messages": [], "logprobs": True, "top_logprobs": bad}, "/v1/chat/completions")
    # A replayed tool call carries its index, as a streamed one does.
    call = {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    reply = {"choices": [{"index": 0, "message": {"role": "assistant", "content": None, "tool_calls": [call]},
                          "finish_reason": "tool_calls"}]}
    first = json.loads(answer_as_events(reply, "/v1/chat/completions", include_usage=False)[0][len(b"data: "):])
    assert first["choices"][0]["delta"]["tool_calls"] == [{"index": 0, **call}]
    # A chat reply keeps its role in the replayed stream (a reply continuing a user's message is the user's).
    for role in ("assistant", "user"):
        reply = {"choices": [{"index": 0, "message": {"role": role, "content": "hi"}, "finish_reason": "stop"}]}
        first = json.loads(answer_as_events(reply, "/v1/chat/completions", include_usage=False)[0][len(b"data: "):])
        assert first["choices"][0]["delta"] == {"role": role, "content": "hi"}
    usage = combined_usage({"prompt_tokens": 3, "completion_tokens": 5, "total_tokens": 8},
                           {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5}, SMALL, LARGE)
    assert (usage["prompt_tokens"], usage["completion_tokens"], usage["total_tokens"]) == (6, 7, 13)
    assert usage["models"][LARGE]["completion_tokens"] == 2


# --- the gateway ---------------------------------------------------------------------------------------------
class ModelReplica(FakeReplica):
    """A replica of one model: its answer is its model's name; a prompt with 'hard' in it gets low logprobs;
    /v1/embeddings returns (1, 0, 0, 0) for prompts starting with 'h' and (-1, 0, 0, 0) otherwise, with 1 as
    the second value for 'hopeless' prompts."""

    def __init__(self, model: str) -> None:
        self.model = model
        super().__init__(model)

    def _app(self) -> FastAPI:
        app = FastAPI()

        @app.get("/v1/models")
        async def models() -> Response:
            return JSONResponse({"object": "list", "data": [{"id": self.model, "object": "model"}]})

        @app.get("/health")
        async def health() -> Response:
            return JSONResponse({"status": "ok"})

        @app.post("/v1/embeddings")
        async def embeddings(http: Request) -> Response:
            body = await http.json()
            self.received.append({"route": "embeddings", **body})
            value = body["input"]  # texts, or the prompt's bytes as the gateway tokenizes for a replica without
            texts = [value] if isinstance(value, str) else [v if isinstance(v, str) else bytes(v).decode()  # a
                                                            for v in value]  # tokenizer
            vectors = [[1.0 if t.startswith("h") else -1.0, float("hopeless" in t), 0, 0] for t in texts]
            return JSONResponse({"object": "list", "model": self.model, "usage": {"prompt_tokens": len(texts)},
                                 "data": [{"object": "embedding", "index": i, "embedding": v}
                                          for i, v in enumerate(vectors)]})

        @app.post("/v1/responses")
        async def respond(http: Request) -> Response:
            body = await http.json()
            self.received.append({"route": http.url.path, **body})
            if body.get("model") not in (None, self.model):  # as a kvserve server judges the name
                return JSONResponse({"error": {"message": "no such model", "type": "invalid_request_error",
                                               "param": "model", "code": "model_not_found"}}, status_code=404)
            if body.get("previous_response_id") not in (None, *self.stored):
                return JSONResponse({"error": {"message": "not found", "type": "invalid_request_error",
                                               "param": "previous_response_id",
                                               "code": "previous_response_not_found"}}, status_code=400)
            answer = {"id": f"resp_{self.model}_{len(self.received)}", "object": "response", "model": self.model,
                      "status": "completed", "store": True, "usage": None,
                      "output": [{"type": "message", "id": "msg_1", "status": "completed", "role": "assistant",
                                  "content": [{"type": "output_text", "text": self.model, "annotations": []}]}]}
            self.stored[answer["id"]] = answer
            return JSONResponse(answer)

        @app.get("/v1/responses/{response_id}")
        async def stored(response_id: str) -> Response:
            return JSONResponse(self.stored[response_id]) if response_id in self.stored else JSONResponse(
                {"error": {"message": "no such response", "type": "invalid_request_error"}}, status_code=404)

        @app.post("/v1/completions")
        @app.post("/v1/chat/completions")
        async def generate(http: Request) -> Response:
            body = await http.json()
            self.received.append({"route": http.url.path, **body})
            chat = http.url.path.endswith("chat/completions")
            prompt = json.dumps(body.get("messages")) if chat else body["prompt"]
            logprob = -2.0 if "hard" in prompt else -0.05
            text = f"answer of {self.model}"
            usage = {"prompt_tokens": 10, "completion_tokens": 4, "total_tokens": 14}
            if chat:
                top = max(1, int(body.get("top_logprobs") or 0))
                logprobs = {"content": [{"token": "t", "logprob": logprob, "bytes": None,
                                         "top_logprobs": [{"token": "t", "logprob": logprob, "bytes": None}] * top}
                                        ] * 4} if body.get("logprobs") else None
                choice = {"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": logprobs,
                          "finish_reason": "stop"}
            else:
                n = body.get("logprobs")
                logprobs = {"tokens": ["t"] * 4, "token_logprobs": [logprob] * 4, "text_offset": [0] * 4,
                            "top_logprobs": [{f"t{i}": logprob for i in range(max(1, n))}] * 4} \
                    if n is not None else None
                choice = {"index": 0, "text": text, "logprobs": logprobs, "finish_reason": "stop"}
            answer = {"id": "x-1", "object": "chat.completion" if chat else "text_completion", "created": 1,
                      "model": self.model, "choices": [choice], "usage": usage}
            if not body.get("stream"):
                return JSONResponse(answer)
            return StreamingResponse(self._events(answer, chat, body), media_type="text/event-stream")

        return app

    async def _events(self, answer: dict, chat: bool, body: dict) -> AsyncIterator[bytes]:
        include_usage = bool((body.get("stream_options") or {}).get("include_usage"))
        for event in answer_as_events(answer, "/v1/chat/completions" if chat else "/v1/completions",
                                      include_usage):
            yield event


@pytest.fixture
def models() -> Iterator[tuple[ModelReplica, ModelReplica]]:
    small, large = ModelReplica(SMALL), ModelReplica(LARGE)
    yield small, large
    small.stop()
    large.stop()


@contextmanager
def routed(models: tuple[ModelReplica, ModelReplica], **options: object) -> Iterator[tuple[openai.OpenAI, str]]:
    """A gateway over both models with these options: its client and its URL."""
    config = RouterConfig(replicas=tuple(r.url for r in models), health_interval_s=0.1, startup_timeout_s=5,
                          uvicorn_log_level="warning", small_model=SMALL, large_model=LARGE,
                          **options)  # type: ignore[arg-type]
    gw = BackgroundGateway(config)
    try:
        yield openai.OpenAI(base_url=f"{gw.base_url}/v1", api_key="unused", max_retries=0), gw.base_url
    finally:
        gw.stop()


def test_length_policy_routes_auto_and_explicit_names_go_straight(models) -> None:
    small, large = models
    with routed(models, model_policy="length", route_threshold=5) as (c, url):
        assert {m.id for m in c.models.list().data} == {SMALL, LARGE, "auto"}
        short = c.completions.with_raw_response.create(model="auto", prompt="ab", max_tokens=4)
        assert short.headers["x-kvserve-model"] == SMALL and short.parse().model == SMALL
        assert short.headers["x-kvserve-route"] == "length:short_prompt"
        long = c.completions.with_raw_response.create(model="auto", prompt="a much longer prompt", max_tokens=4)
        assert long.headers["x-kvserve-model"] == LARGE and long.parse().choices[0].text == f"answer of {LARGE}"
        direct = c.completions.create(model=SMALL, prompt="a much longer prompt", max_tokens=4)
        assert direct.model == SMALL and small.received[-1]["model"] == SMALL
        assert [r["model"] for r in large.received] == [LARGE]
        with pytest.raises(openai.NotFoundError):
            c.completions.create(model="coder-medium", prompt="x", max_tokens=4)
        embedded = c.embeddings.create(model=LARGE, input="hard")  # the gateway forwards embeddings too
        assert embedded.data[0].embedding == [1.0, 0.0, 0.0, 0.0] and large.received[-1]["route"] == "embeddings"
        metrics = httpx.get(f"{url}/metrics").text
        assert f'kvserve_router:model_choices_total{{model="{LARGE}",policy="length",reason="long_prompt"}} 1.0' \
            in metrics


def test_a_follow_up_of_the_auto_model_goes_to_the_model_that_answered_before(models) -> None:
    """``auto`` picks a model per request, but a stored response lives on the replica that answered it: the
    follow-up goes there, as a request naming no model; one naming the other model is that replica's 404."""
    small, large = models
    with routed(models, model_policy="length", route_threshold=30) as (_, url):
        first = httpx.post(f"{url}/v1/responses", json={"model": "auto", "input": "ab"}, timeout=10).json()
        assert first["model"] == SMALL
        long_follow_up = {"model": "auto", "input": "a much longer prompt, which alone would go to the large model",
                          "previous_response_id": first["id"]}
        follow_up = httpx.post(f"{url}/v1/responses", json=long_follow_up, timeout=10)
        assert follow_up.status_code == 200 and follow_up.json()["model"] == SMALL
        assert follow_up.headers["x-kvserve-model"] == SMALL  # named as every auto answer is
        assert follow_up.headers["x-kvserve-route"] == "length:previous_response"
        assert "model" not in small.received[-1] and not large.received
        named = httpx.post(f"{url}/v1/responses", json={**long_follow_up, "model": LARGE}, timeout=10)
        assert named.status_code == 404 and named.json()["error"]["code"] == "model_not_found"
        assert not large.received


def test_cascade_keeps_confident_answers_of_the_small_model(models) -> None:
    small, large = models
    with routed(models, model_policy="cascade", route_threshold=-0.5) as (c, url):
        answer = c.chat.completions.with_raw_response.create(
            model="auto", messages=[{"role": "user", "content": "easy"}], max_tokens=4)
        assert answer.headers["x-kvserve-route"] == "cascade:confident"
        parsed = answer.parse()
        assert parsed.model == SMALL and parsed.choices[0].message.content == f"answer of {SMALL}"
        assert parsed.choices[0].logprobs is None  # the client did not ask for them
        assert small.received[-1]["logprobs"] is True and not small.received[-1].get("stream")
        chunks = list(c.completions.create(model="auto", prompt="easy", max_tokens=4, stream=True,
                                           stream_options={"include_usage": True}))
        assert "".join(ch.choices[0].text for ch in chunks if ch.choices) == f"answer of {SMALL}"
        assert chunks[-1].usage.completion_tokens == 4
        assert large.received == []
        # The cascade reads chat's and completions' logprobs: a Responses API request names its model instead.
        refused = httpx.post(f"{url}/v1/responses", json={"model": "auto", "input": "easy"}, timeout=10)
        assert refused.status_code == 400 and refused.json()["error"]["param"] == "model"


def test_cascade_escalation_returns_only_the_large_answer_and_both_costs(models) -> None:
    small, large = models
    with routed(models, model_policy="cascade", route_threshold=-0.5) as (c, url):
        answer = c.completions.with_raw_response.create(model="auto", prompt="hard one", max_tokens=4)
        assert answer.headers["x-kvserve-route"] == "cascade:escalated"
        parsed = answer.parse()
        assert parsed.model == LARGE and parsed.choices[0].text == f"answer of {LARGE}"
        assert (parsed.usage.prompt_tokens, parsed.usage.completion_tokens) == (20, 8)
        assert parsed.usage.model_extra["models"][SMALL]["completion_tokens"] == 4
        stream = c.chat.completions.create(model="auto", messages=[{"role": "user", "content": "hard one"}],
                                           max_tokens=4, stream=True, stream_options={"include_usage": True})
        chunks = list(stream)
        text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
        assert text == f"answer of {LARGE}" and SMALL not in text
        assert large.received[-1]["stream"] is True  # streamed from the large model itself
        assert chunks[-1].usage.total_tokens == 28
        assert chunks[-1].usage.model_extra["models"][LARGE]["total_tokens"] == 14
        assert len(small.received) == 2 and len(large.received) == 2


def test_probe_routes_on_the_small_models_hidden_state(models, tmp_path: Path) -> None:
    small, large = models
    features = np.array([[1.0, 0, 0, 0], [-1.0, 0, 0, 0]] * 10)
    probe = LogisticProbe.fit(SMALL, features, np.array([1.0, 0.0] * 10))
    path = tmp_path / "probe.json"
    probe.save(str(path))
    with routed(models, model_policy="probe", probe_path=str(path)) as (c, url):
        hard = c.completions.with_raw_response.create(model="auto", prompt="hard", max_tokens=4)
        easy = c.completions.with_raw_response.create(model="auto", prompt="easy", max_tokens=4)
        assert (hard.headers["x-kvserve-model"], easy.headers["x-kvserve-model"]) == (LARGE, SMALL)
        embedded = [r for r in small.received if r["route"] == "embeddings"]
        assert len(embedded) == 2 and embedded[0]["model"] == SMALL


def test_train_probe_with_the_large_models_labels_makes_a_gain_policy_the_gateway_routes_by(
        models, tmp_path: Path) -> None:
    small, _ = models
    examples = tmp_path / "examples.jsonl"  # 'hard': the large model helps; 'hopeless': both fail
    rows = [{"prompt": f"{kind} {i}", "label": int(kind != "easy"), "large_label": int(kind == "hopeless")}
            for i in range(6) for kind in ("hard", "hopeless", "easy")]
    examples.write_text("".join(json.dumps(row) + "\n" for row in rows))
    out = tmp_path / "gain.json"
    assert main(["eval", "train-probe", "--base-url", small.url, "--model", SMALL, "--examples", str(examples),
                 "--out", str(out)]) == 0
    probe = load_probe(str(out))
    assert isinstance(probe, GainProbe) and probe.model == SMALL
    with routed(models, model_policy="gain", probe_path=str(out)) as (c, url):
        routes = {prompt: c.completions.with_raw_response.create(model="auto", prompt=prompt, max_tokens=4).headers
                  for prompt in ("hard", "hopeless", "easy")}
        assert {p: h["x-kvserve-model"] for p, h in routes.items()} == {"hard": LARGE, "hopeless": SMALL,
                                                                          "easy": SMALL}
        assert routes["hard"]["x-kvserve-route"] == "gain:gain"
    rows[0].pop("large_label")
    with pytest.raises(ConfigError, match="17 of 18 examples have a large_label"):
        train_probe(small.url, SMALL, rows[1:] + rows[:1])
