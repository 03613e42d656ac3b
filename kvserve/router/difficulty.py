"""The gateway's requests for the auto model: routed to the small or the large model by a ModelPolicy
(model_policies.py), each then to one of its model's replicas by the replica policy.

Every answer names the model that gave it: its ``model`` field (the replica's own) and ``X-KVServe-Model``;
``X-KVServe-Route`` says the policy's reason. In a cascade the small model answers first, whole and with
logprobs; if its answer stands the client gets it as it asked for it (streamed if it streams, with only the
logprobs it asked for). Otherwise the client gets only the large model's answer, streamed from the large
model as it comes, and its usage counts both models' tokens (each one's own under ``usage.models``).
"""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from kvserve.errors import ConfigError, InvalidRequest, KVServeError
from kvserve.router.answers import (
    answer_as_events,
    as_client_asked,
    combined_usage,
    for_cascade,
    wants_stream_usage,
    with_usage_of,
)
from kvserve.router.model_policies import Difficulty, ModelChoice, ModelPolicy, ProbeRoute, confidence
from kvserve.router.policies import cache_salt_of
from kvserve.serving_config import RouterConfig

if TYPE_CHECKING:
    from kvserve.router.gateway import Gateway

logger = logging.getLogger(__name__)


class DifficultyRouter:
    def __init__(self, gateway: Gateway, policy: ModelPolicy, config: RouterConfig) -> None:
        assert config.small_model is not None and config.large_model is not None
        self.gateway = gateway
        self.policy = policy
        self.small = config.small_model
        self.large = config.large_model
        self.signal = config.cascade_signal

    def check_models(self, served: list[str]) -> None:
        missing = [m for m in (self.small, self.large) if m not in served]
        if missing:
            raise ConfigError(f"no replica serves {', '.join(missing)} (the replicas serve {', '.join(served)})",
                              "model_policy")
        if isinstance(self.policy, ProbeRoute) and self.policy.probe.model != self.small:
            raise ConfigError(f"the probe was trained on {self.policy.probe.model}'s hidden states, not the small "
                              f"model {self.small}'s", "probe_path")

    def model(self, choice: ModelChoice) -> str:
        return self.small if choice.size == "small" else self.large

    async def route(self, path: str, payload: dict[str, Any], body_bytes: int, http: Request) -> Response:
        gateway = self.gateway
        small_payload = {**payload, "model": self.small}
        tokens = await gateway.tokens(path, small_payload, body_bytes)
        if self.policy.cascades:
            if path.endswith("/responses"):  # the cascade reads the chat and completions answers' logprobs
                raise InvalidRequest(f"the cascade answers '{gateway.config.auto_model}' on /v1/chat/completions and "
                                     "/v1/completions; name a model for /v1/responses", param="model")
            return await self._cascade(path, payload, tokens, body_bytes, http)
        hidden = (await self._hidden_state(tokens, http, cache_salt_of(payload)) if self.policy.needs_hidden_state
                  else None)
        choice = self.policy.choose(Difficulty(len(tokens), hidden))
        model = self.model(choice)
        chosen = {**payload, "model": model}
        if model != self.small:
            tokens = await gateway.tokens(path, chosen, body_bytes)
        response = await gateway.dispatch(model, path, json.dumps(chosen).encode(), tokens,
                                          bool(payload.get("stream")), http, cache_salt_of(payload))
        return self.named(response, model, choice.reason)

    async def _cascade(self, path: str, payload: dict[str, Any], tokens: tuple[int, ...], body_bytes: int,
                       http: Request) -> Response:
        gateway = self.gateway
        first = await gateway.dispatch(self.small, path, json.dumps(for_cascade(payload, path, self.small)).encode(),
                                       tokens, False, http, cache_salt_of(payload))
        answer = _answer(first)
        if first.status_code != 200 or answer is None:
            return self.named(first, self.small, "cascade_error")  # the large model would refuse it too
        score = confidence(answer.get("choices") or [], self.signal)
        if self.policy.accepts(score):
            shown = as_client_asked(answer, payload, path)
            if payload.get("stream"):
                events = answer_as_events(shown, path, wants_stream_usage(payload))
                response: Response = StreamingResponse(_replay(events), media_type="text/event-stream",
                                                       headers={"Cache-Control": "no-cache"})
            else:
                response = JSONResponse(shown)
            return self.named(response, self.small, "confident")
        large_payload = {**payload, "model": self.large}
        large_tokens = await gateway.tokens(path, large_payload, body_bytes)
        second = await gateway.dispatch(self.large, path, json.dumps(large_payload).encode(), large_tokens,
                                        bool(payload.get("stream")), http, cache_salt_of(payload))
        small_usage = answer.get("usage")
        if isinstance(second, StreamingResponse):
            second.body_iterator = with_usage_of(second.body_iterator, small_usage, self.small, self.large)
        elif (large_answer := _answer(second)) is not None and second.status_code == 200:
            large_answer["usage"] = combined_usage(small_usage, large_answer.get("usage"), self.small, self.large)
            second = JSONResponse(large_answer)
        return self.named(second, self.large, "escalated")

    async def _hidden_state(self, tokens: tuple[int, ...], http: Request,
                            cache_salt: str | None) -> tuple[float, ...] | None:
        """The small model's hidden state at the prompt's last token (its replica's /v1/embeddings, last-token
        pooling); None when it cannot be had. Under the request's cache salt: its prompt's KV stays its own."""
        request = {"model": self.small, "input": [list(tokens)]} | ({"cache_salt": cache_salt} if cache_salt else {})
        try:
            response = await self.gateway.dispatch(self.small, "/v1/embeddings", json.dumps(request).encode(), tokens,
                                                   False, http, cache_salt)
        except KVServeError as exc:  # the probe then routes to the large model; the request goes on
            logger.warning("no hidden state from %s: %r", self.small, exc)
            return None
        answer = _answer(response)
        if response.status_code != 200 or answer is None or not answer.get("data"):
            return None
        return tuple(answer["data"][0]["embedding"])

    def named(self, response: Response, model: str, reason: str) -> Response:
        """The answer, its model and route in headers and counted."""
        response.headers["x-kvserve-model"] = model
        response.headers["x-kvserve-route"] = f"{self.policy.name}:{reason}"
        self.gateway.metrics.model_choices.labels(policy=self.policy.name, model=model, reason=reason).inc()
        return response


def _answer(response: Response) -> dict[str, Any] | None:
    if isinstance(response, StreamingResponse):
        return None
    try:
        value = json.loads(response.body)
    except ValueError:
        return None
    return value if isinstance(value, dict) else None


async def _replay(events: list[bytes]) -> AsyncIterator[bytes]:
    for event in events:
        yield event
