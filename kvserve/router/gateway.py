"""The gateway: one OpenAI-compatible front over several replicas.

A generation request is parsed only as far as routing needs (its model, its rendered prompt), sent on
unchanged, and its answer passed back unchanged: a stream chunk for chunk as the replica sends it, a JSON
body whole, an error with its status and body. The router adds no request of its own and drops none:

- A replica that cannot be reached, or answers 502, 503 or 504, before anything of the answer came back is
  taken out (until a health check passes) and the request goes to another healthy replica; each replica is
  tried at most once per request. When none is left the answer is 503 with Retry-After. A 500 (a fault in
  the replica's handling of this request) is tried on another replica too, but takes none out: a request
  that every replica fails on must not empty the pool; when every replica answered 500, the client gets
  the last answer as it is.
- A stream cut after its first chunk cannot be replayed without sending the client text twice: it ends with
  an OpenAI-style error event (``data: {"error": ...}``) and no ``[DONE]``; the replica is taken out.
- A client that disconnects closes the upstream connection, which the replica reads as an abort.
- An answer that is not an OpenAI answer (not JSON, not an event stream) is a 502.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import anyio
import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from kvserve.errors import (
    BadUpstreamResponse,
    InvalidRequest,
    KVServeError,
    ModelNotFound,
    NoHealthyReplica,
    PreviousResponseNotFound,
    RequestTooLarge,
    ResponseNotFound,
    UpstreamTimeout,
)
from kvserve.router.adapters import ADAPTER_ROUTES, to_every_replica
from kvserve.router.answers import chat_usage, response_usage_event, stored_response_created, usage_event
from kvserve.router.difficulty import DifficultyRouter
from kvserve.router.kv_index import KVBlockIndex, KVEventFollower
from kvserve.router.live_stats import find_trip, gateway_snapshot
from kvserve.router.metrics import RouterMetrics
from kvserve.router.model_policies import make_model_policy
from kvserve.router.policies import Decision, RouteRequest, cache_salt_of, make_policy
from kvserve.router.prompt_tokens import PromptTokens
from kvserve.router.replicas import Replica, ReplicaPool
from kvserve.router.stored_responses import StoredResponses, passed_back, stored_response_path
from kvserve.server.dashboard import add_dashboard_routes
from kvserve.server.disconnect import ClientGone, until_disconnected
from kvserve.server.protocol import error_body
from kvserve.serving_config import RouterConfig

logger = logging.getLogger(__name__)

RETRY_AFTER_S = 1
LONG_BODY_BYTES = 64 * 1024  # bodies larger than this are rendered and tokenized off the event loop
FORWARDED_HEADERS = ("authorization", "x-kvserve-timings", "x-request-id", "openai-organization")
GENERATION_ROUTES = ("/v1/chat/completions", "/v1/completions", "/v1/responses", "/v1/embeddings")
TOKENIZER_ROUTES = ("/tokenize", "/detokenize")  # any replica of the model answers them alike
# A model no replica is known to serve makes the gateway read the replicas' lists again, at most this often.
MODELS_REFRESH_INTERVAL_S = 0.5



@dataclass(frozen=True, slots=True)
class _Retry:
    """An attempt failed before anything reached the client: try another replica. ``answer``: the replica's
    own error answer, given to the client if no replica is left to try."""

    reason: str
    answer: Response | None = None


class Gateway:
    """The replicas, the policy and the HTTP client; ``start`` checks the replicas, ``stop`` lets go."""

    def __init__(self, config: RouterConfig) -> None:
        self.config = config
        timeout = httpx.Timeout(config.request_timeout_s, connect=min(10.0, config.request_timeout_s))
        # Idle connections are dropped before uvicorn's keep-alive (5 s) closes them on the replica's side: a
        # request written on a connection the replica has just closed would fail like a dead replica.
        self.client = httpx.AsyncClient(timeout=timeout, limits=httpx.Limits(max_connections=None,
                                                                             max_keepalive_connections=256,
                                                                             keepalive_expiry=2.0))
        self.replica_headers = {"authorization": f"Bearer {config.replica_api_key}"} if config.replica_api_key else {}
        self.pool = ReplicaPool(config.replicas, self.client, config.health_interval_s, self.replica_headers)
        self.kv_events: KVEventFollower | None = None
        if config.policy == "kv_events":
            self.kv_events = KVEventFollower(self.client, self.replica_headers, KVBlockIndex(),
                                             lambda: self.pool.replicas, config.kv_events_interval_s)
        self.policy = make_policy(config, self.kv_events.index if self.kv_events else None)
        self.prompts = PromptTokens(self.client, self.replica_headers)
        self.stored = StoredResponses(self.pool, self.client)  # the replica each stored response is kept on
        self.metrics = RouterMetrics(lambda: self.pool.replicas)
        self.model_policy = make_model_policy(config)
        self.difficulty = DifficultyRouter(self, self.model_policy, config) if self.model_policy else None
        self.pool.on_change.append(self.policy.forget)

    async def start(self) -> None:
        await self.pool.check_all(self.config.startup_timeout_s)
        await self.prompts.learn(self.pool.replicas)
        if self.difficulty is not None:
            self.difficulty.check_models(self.pool.models())
        self.pool.start()
        if self.kv_events is not None:
            await self.kv_events.refresh()
            self.kv_events.start()

    async def stop(self) -> None:
        if self.kv_events is not None:
            await self.kv_events.stop()
        await self.pool.stop()
        await self.client.aclose()

    # --- one request --------------------------------------------------------------------------------------
    async def forward(self, path: str, http: Request) -> Response:
        body, payload, model = await self._read_request(http)
        previous = payload.get("previous_response_id") if path.endswith("/responses") else None
        if isinstance(previous, str):
            return await self._continue(previous, path, body, payload, model, http)
        if self.difficulty is not None and model == self.config.auto_model:
            return await self.difficulty.route(path, payload, len(body), http)
        await self._check_served(model)
        tokens = await self.tokens(path, payload, len(body))
        return await self.dispatch(model, path, body, tokens, bool(payload.get("stream")), http,
                                   cache_salt_of(payload))

    async def _continue(self, response_id: str, path: str, body: bytes, payload: dict[str, Any], model: str | None,
                        http: Request) -> Response:
        """A follow-up of a stored response, sent to the replica that stored it (which judges the client's key
        and the model it names); the auto model there is the model that answered before."""
        found = await self.stored.holder(response_id, self._upstream_headers(http))
        if isinstance(found, Response):
            return found
        if found is None:
            raise PreviousResponseNotFound(response_id)
        auto = self.difficulty if model == self.config.auto_model else None
        if auto is not None:
            body = json.dumps({k: v for k, v in payload.items() if k != "model"}).encode()
        # No routing key: the replica is given, and its prefix index must not learn a prompt it never rendered.
        answer = await self.dispatch(None, path, body, (), bool(payload.get("stream")), http, cache_salt_of(payload),
                                     pinned=found)
        # Named as every auto answer is (router/difficulty.py).
        return auto.named(answer, found.models[0], "previous_response") if auto is not None else answer

    async def to_holder(self, response_id: str, http: Request) -> Response:
        """``GET`` / ``DELETE /v1/responses/{id}`` (and its input items), passed to the replica that stored it
        and its answer passed back."""
        headers = self._upstream_headers(http)
        found = await self.stored.holder(response_id, headers)
        if isinstance(found, Response):
            return found
        if found is None:
            raise ResponseNotFound(f"no replica holds a response with id '{response_id}'")
        suffix = "/input_items" if http.url.path.endswith("/input_items") else ""
        url = found.url + stored_response_path(response_id, suffix) + (f"?{http.url.query}" if http.url.query else "")
        try:
            upstream = await self.client.request(http.method, url, headers=headers)
        except httpx.HTTPError as exc:
            self.pool.mark_down(found, f"{http.url.path}: {exc!r}")
            raise NoHealthyReplica(f"the replica that stored response '{response_id}' did not answer; retry "
                                   "later") from None
        if http.method == "DELETE" and upstream.status_code in (200, 404):
            self.stored.forget(response_id)
        return passed_back(upstream)

    async def relay(self, path: str, http: Request) -> Response:
        """A request every replica of its model answers alike (/tokenize, /detokenize): sent to the least
        loaded healthy one, its answer passed back as it is."""
        body, _, model = await self._read_request(http)
        if model == self.config.auto_model and self.model_policy is not None:
            raise InvalidRequest(f"'{self.config.auto_model}' picks a model per generation request; name one of "
                                 f"{', '.join(self.pool.models())}", param="model")
        await self._check_served(model)
        for replica in sorted(self.pool.healthy(model), key=lambda r: r.load):  # the next where one is unreachable
            try:
                upstream = await self.client.post(f"{replica.url}{path}", content=body,
                                                  headers=self._upstream_headers(http))
            except httpx.TimeoutException as exc:
                if not isinstance(exc, httpx.ConnectTimeout | httpx.PoolTimeout):
                    raise _timed_out(replica, path, exc) from None
                self.pool.mark_down(replica, f"{path}: {exc!r}")
            except httpx.TransportError as exc:
                self.pool.mark_down(replica, f"{path}: {exc!r}")
            else:
                return passed_back(upstream)
        raise NoHealthyReplica(f"no healthy replica serves {model or 'this request'}; retry later")

    async def to_every_replica(self, path: str, http: Request) -> Response:
        """Load or unload a LoRA adapter on every healthy replica (router/adapters.py)."""
        body = await _read_body(http, self.config.max_request_body_bytes)
        return await to_every_replica(self.pool, self.client, path, body, self._upstream_headers(http))

    async def refused_key(self, http: Request) -> Response | None:
        """Where the replicas require an API key (the gateway has one for its own calls), the client's key as one
        of them judges it: its refusal, passed back as it is, or None. The gateway's own routes (the model list)
        would otherwise answer clients the replicas refuse."""
        if not self.replica_headers:
            return None
        for replica in sorted(self.pool.healthy(), key=lambda r: r.load):  # the next one where one cannot judge
            try:
                upstream = await self.client.get(f"{replica.url}/v1/models", headers=self._upstream_headers(http),
                                                 timeout=5.0)
            except httpx.HTTPError as exc:
                self.pool.mark_down(replica, f"/v1/models: {exc!r}")
                continue
            if upstream.status_code in (401, 403):
                return passed_back(upstream)
            if upstream.status_code < 500:
                return None
        raise NoHealthyReplica("no healthy replica could check the API key; retry later")

    async def _read_request(self, http: Request) -> tuple[bytes, dict[str, Any], str | None]:
        """The body (within the size limit), parsed as a JSON object, and the model it names."""
        body = await _read_body(http, self.config.max_request_body_bytes)
        try:
            payload = json.loads(body)
        except ValueError as exc:
            raise InvalidRequest(f"the request body is not valid JSON: {exc}") from None
        if not isinstance(payload, dict):
            raise InvalidRequest("the request body must be a JSON object")
        model = payload.get("model")
        if model is not None and not isinstance(model, str):
            raise InvalidRequest("'model' must be a string", param="model")
        return body, payload, model

    async def _check_served(self, model: str | None) -> None:
        if model is not None and model not in self.pool.models():
            await self.pool.refresh_all(MODELS_REFRESH_INTERVAL_S)  # perhaps an adapter loaded since the last check
        if model is not None and model not in self.pool.models():
            error = ModelNotFound(f"the model '{model}' does not exist; the replicas serve "
                                  f"{', '.join(self.models()) or 'nothing'}")
            error.param = "model"  # type: ignore[attr-defined]
            raise error

    def models(self) -> list[str]:
        """What clients may ask for: the replicas' models, and the auto model when one is routed by difficulty."""
        served = self.pool.models()
        return served + [self.config.auto_model] if self.model_policy is not None else served

    async def tokens(self, path: str, payload: dict[str, Any], body_bytes: int) -> tuple[int, ...]:
        model = payload.get("model")
        if isinstance(model, str) and not self.prompts.knows(model):  # a LoRA adapter loaded since start-up
            await self.prompts.learn(self.pool.healthy(model))
        if body_bytes > LONG_BODY_BYTES:
            return await asyncio.to_thread(self.prompts.of, path, payload)
        return self.prompts.of(path, payload)

    async def dispatch(self, model: str | None, path: str, body: bytes, tokens: tuple[int, ...], stream: bool,
                       http: Request, cache_salt: str | None = None, pinned: Replica | None = None) -> Response:
        """Send a request to a healthy replica of ``model`` chosen by the replica policy; another one if that
        one fails before answering. ``cache_salt``: the body's, which keeps its KV apart on the replica;
        ``pinned``: the one replica that can answer it (it holds what the request continues)."""
        request = RouteRequest(model, tokens, cache_salt)
        headers = self._upstream_headers(http)
        tried: set[str] = set()
        last_answer: Response | None = None
        while True:
            candidates = [r for r in self.pool.healthy(model) if r.url not in tried and (pinned is None or r is pinned)]
            if not candidates and last_answer is not None:
                return last_answer
            if not candidates:
                raise NoHealthyReplica(f"no healthy replica serves {model or 'this request'}"
                                       f"{' (tried ' + ', '.join(sorted(tried)) + ')' if tried else ''}; retry later")
            decision = self.policy.choose(request, candidates)
            reason = decision.reason if pinned is None else "stored_response"  # the policy had no choice
            self.metrics.decisions.labels(policy=self.policy.name, reason=reason).inc()
            tried.add(decision.replica.url)
            uncached = max(0, len(tokens) - decision.estimated_cached_tokens)
            outcome = await self._attempt(decision, path, body, headers, stream, uncached, http)
            if isinstance(outcome, _Retry):
                self.metrics.retries.labels(reason=outcome.reason).inc()
                last_answer = outcome.answer or last_answer
                continue
            return outcome

    def _upstream_headers(self, http: Request) -> dict[str, str]:
        # identity: the answer's bytes are relayed as they come, and a stream is judged by its first bytes
        headers = {"content-type": "application/json", "accept-encoding": "identity"}
        for name in FORWARDED_HEADERS:
            if name in http.headers:
                headers[name] = http.headers[name]
        return headers

    async def _attempt(self, decision: Decision, path: str, body: bytes, headers: dict[str, str], stream: bool,
                       num_uncached_tokens: int, http: Request) -> Response | _Retry:
        replica = decision.replica
        in_flight = _InFlight(replica, num_uncached_tokens)
        sent_at = time.monotonic()
        try:
            upstream = await until_disconnected(
                http, self.client.send(self.client.build_request("POST", replica.url + path, content=body,
                                                                 headers=headers), stream=True))
        except ClientGone:
            in_flight.end()
            return Response(status_code=499)
        except httpx.TimeoutException as exc:
            in_flight.end()
            if isinstance(exc, httpx.ConnectTimeout | httpx.PoolTimeout):  # never reached it: another may answer
                self.pool.mark_down(replica, f"{path}: {exc!r}")
                return _Retry("unreachable")
            raise _timed_out(replica, path, exc) from None
        except httpx.TransportError as exc:
            in_flight.end()
            self.pool.mark_down(replica, f"{path}: {exc!r}")
            return _Retry("unreachable")
        if upstream.status_code in (502, 503, 504):
            await _close(upstream)
            in_flight.end()
            self.pool.mark_down(replica, f"{path} answered {upstream.status_code}")
            return _Retry(f"status_{upstream.status_code}")
        is_stream = upstream.headers.get("content-type", "").startswith("text/event-stream")
        if stream and upstream.status_code == 200 and is_stream:
            return await self._open_stream(decision, upstream, in_flight, http, sent_at)
        try:
            content = await until_disconnected(http, upstream.aread())
        except ClientGone:
            return Response(status_code=499)
        except httpx.TimeoutException as exc:
            raise _timed_out(replica, path, exc) from None
        except httpx.TransportError as exc:
            self.pool.mark_down(replica, f"{path}: {exc!r}")
            return _Retry("cut")
        finally:
            await _close(upstream)
            in_flight.end()
        passed = {k: v for k, v in upstream.headers.items() if k.lower() == "retry-after"}
        if upstream.status_code >= 500:  # a fault of this request on this replica (502-504 went above): try another
            self.metrics.requests.labels(replica=replica.url, status=str(upstream.status_code)).inc()
            return _Retry(f"status_{upstream.status_code}",
                          Response(content, status_code=upstream.status_code, headers=passed,
                                   media_type=upstream.headers.get("content-type", "application/json")))
        if upstream.status_code == 429:  # refused before it ran (a full queue): another replica may take it
            self.metrics.requests.labels(replica=replica.url, status="429").inc()
            return _Retry("status_429", Response(content, status_code=429, headers=passed,
                                                 media_type=upstream.headers.get("content-type", "application/json")))
        if upstream.status_code != 200:  # the replica's refusal, passed back as it gave it (JSON or not)
            self.metrics.requests.labels(replica=replica.url, status=str(upstream.status_code)).inc()
            return Response(content, status_code=upstream.status_code, headers=passed,
                            media_type=upstream.headers.get("content-type", "application/json"))
        answer = _json_object(content)
        listed = "data" if path.endswith("/embeddings") else "output" if path.endswith("/responses") else "choices"
        if answer is None or not isinstance(answer.get(listed), list):
            raise BadUpstreamResponse(f"replica {replica.url} answered {path} with {upstream.status_code} and a "
                                      f"body that is not an OpenAI answer: {content[:200]!r}")
        self.metrics.requests.labels(replica=replica.url, status=str(upstream.status_code)).inc()
        self._observe_usage(decision, answer.get("usage"))
        if listed == "output" and upstream.status_code == 200 and answer.get("store") is True:
            self.stored.record(answer.get("id"), replica.url)
        return Response(content, status_code=upstream.status_code, headers=passed, media_type="application/json")

    async def _open_stream(self, decision: Decision, upstream: httpx.Response, in_flight: _InFlight,
                           http: Request, sent_at: float) -> Response | _Retry:
        """Wait for the stream's first chunk (a replica that dies before it is retried), then relay."""
        replica = decision.replica
        chunks = upstream.aiter_raw()
        try:
            first = await until_disconnected(http, anext(chunks))
        except (ClientGone, StopAsyncIteration, httpx.TransportError) as exc:
            await _close(upstream)
            in_flight.end()
            if isinstance(exc, ClientGone):
                return Response(status_code=499)
            if isinstance(exc, httpx.TimeoutException):
                raise _timed_out(replica, "a stream's first chunk", exc) from None
            self.pool.mark_down(replica, f"stream ended before its first chunk: {exc!r}")
            return _Retry("cut")
        if not first.lstrip().startswith((b"data:", b":", b"event:", b"id:", b"retry:")):
            await _close(upstream)
            in_flight.end()
            raise BadUpstreamResponse(f"replica {replica.url} sent a stream that is not server-sent events: "
                                      f"{first[:200]!r}")
        in_flight.first_byte()
        self.policy.observe_ttft(decision, time.monotonic() - sent_at)
        self.metrics.requests.labels(replica=replica.url, status="200").inc()
        usage = _UsageScanner(lambda response_id: self.stored.record(response_id, replica.url))
        ended = False

        async def end() -> None:
            nonlocal ended
            if not ended:
                ended = True
                await _close(upstream)
                in_flight.end()
                self._observe_usage(decision, usage.last)

        return _RelayedStream(self._relay(decision, first, chunks, usage, end), end)

    async def _relay(self, decision: Decision, first: bytes, chunks: AsyncIterator[bytes], usage: _UsageScanner,
                     end: Callable[[], Awaitable[None]]) -> AsyncIterator[bytes]:
        try:
            usage.feed(first)
            yield first
            try:
                async for chunk in chunks:
                    usage.feed(chunk)
                    yield chunk
            except httpx.HTTPError as exc:
                self.pool.mark_down(decision.replica, f"stream cut: {exc!r}")
                self.metrics.stream_failures.labels(replica=decision.replica.url).inc()
                message = f"the replica's stream was cut after it had begun ({type(exc).__name__}); not retried"
                body = error_body(message, BadUpstreamResponse.error_type, None, "stream_cut")
                yield f"data: {json.dumps(body)}\n\n".encode()
        finally:
            with anyio.CancelScope(shield=True):  # a client that left cancels us: still close upstream
                await end()

    def _observe_usage(self, decision: Decision, usage: Any) -> None:
        replica = decision.replica.url
        self.metrics.estimated_cached_tokens.labels(replica=replica).inc(decision.estimated_cached_tokens)
        if not isinstance(usage, dict):
            return
        usage = chat_usage(usage)
        for key, counter in (("prompt_tokens", self.metrics.prompt_tokens),
                             ("completion_tokens", self.metrics.completion_tokens)):
            if isinstance(usage.get(key), int):
                counter.labels(replica=replica).inc(usage[key])
        details = usage.get("prompt_tokens_details")
        if isinstance(details, dict) and isinstance(details.get("cached_tokens"), int):
            self.metrics.cached_tokens.labels(replica=replica).inc(details["cached_tokens"])


class _RelayedStream(StreamingResponse):
    """A replica's stream on its way to the client, ended (the upstream closed, the request's count ended)
    however the response ends. The relaying generator ends it too, but Starlette never starts the generator
    of a client that left before the first chunk was sent, and a generator that never started runs no
    ``finally``."""

    def __init__(self, content: AsyncIterator[bytes], end: Callable[[], Awaitable[None]]) -> None:
        super().__init__(content, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self._end = end

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            with anyio.CancelScope(shield=True):
                await self._end()


class _InFlight:
    """The router's count of one request on its replica, ended exactly once."""

    def __init__(self, replica: Replica, num_uncached_tokens: int) -> None:
        self._replica = replica
        self._tokens = num_uncached_tokens
        replica.in_flight += 1
        replica.queued_prompt_tokens += num_uncached_tokens
        self._queued = True
        self._ended = False

    def first_byte(self) -> None:
        if self._queued:
            self._replica.queued_prompt_tokens -= self._tokens
            self._queued = False

    def end(self) -> None:
        if not self._ended:
            self.first_byte()
            self._replica.in_flight -= 1
            self._ended = True


class _UsageScanner:
    """The last ``usage`` object of an event stream (the final chunk when the client asked for usage); a
    Responses API stream's stored response id, given to ``stored`` as soon as its first event says it."""

    def __init__(self, stored: Callable[[str], None]) -> None:
        self._partial = b""
        self._stored = stored
        self.last: dict[str, Any] | None = None

    def feed(self, chunk: bytes) -> None:
        *lines, self._partial = (self._partial + chunk).split(b"\n")
        for line in lines:
            if (response_id := stored_response_created(line)) is not None:
                self._stored(response_id)
            event = usage_event(line) or response_usage_event(line)
            if event is not None:
                self.last = event["usage"]


def _json_object(content: bytes) -> dict[str, Any] | None:
    try:
        value = json.loads(content)
    except ValueError:
        return None
    return value if isinstance(value, dict) else None


async def _close(upstream: httpx.Response) -> None:
    try:
        await upstream.aclose()
    except httpx.HTTPError:
        pass


async def _read_body(http: Request, limit: int) -> bytes:
    """The request body, or RequestTooLarge as soon as it is known to be over ``limit`` bytes."""
    too_large = RequestTooLarge(f"the request body is larger than {limit} bytes (--max-request-body-bytes)")
    length = http.headers.get("content-length")
    if length is not None and length.isdigit() and int(length) > limit:
        raise too_large
    chunks: list[bytes] = []
    size = 0
    async for chunk in http.stream():
        size += len(chunk)
        if size > limit:
            raise too_large
        chunks.append(chunk)
    return b"".join(chunks)


def build_router_app(gateway: Gateway) -> FastAPI:
    """The gateway's routes: the OpenAI generation routes forwarded, the rest answered here."""
    app = FastAPI(title="kvserve router", version="0.1.0")
    app.state.gateway = gateway
    created = int(time.time())

    @app.exception_handler(KVServeError)
    async def on_error(_: Request, exc: KVServeError) -> Response:
        headers = {"Retry-After": str(RETRY_AFTER_S)} if isinstance(exc, NoHealthyReplica) else None
        gateway.metrics.errors.labels(status=str(exc.http_status)).inc()
        if exc.http_status >= 500:
            logger.warning("request failed: %s", exc)
        body = error_body(str(exc), exc.error_type, getattr(exc, "param", None), exc.code)
        return JSONResponse(body, status_code=exc.http_status, headers=headers)

    for route in GENERATION_ROUTES:
        app.add_api_route(route, _bound(gateway.forward, route), methods=["POST"])
    for route in TOKENIZER_ROUTES:
        app.add_api_route(route, _bound(gateway.relay, route), methods=["POST"])
    for route in ADAPTER_ROUTES:
        app.add_api_route(route, _bound(gateway.to_every_replica, route), methods=["POST"])

    @app.get("/v1/responses/{response_id}")
    @app.delete("/v1/responses/{response_id}")
    @app.get("/v1/responses/{response_id}/input_items")
    async def stored_response(response_id: str, http: Request) -> Response:
        return await gateway.to_holder(response_id, http)

    def model_ids() -> list[str]:
        ids = list(dict.fromkeys(m for r in gateway.pool.healthy() for m in r.models))
        if gateway.model_policy is not None:
            ids.append(gateway.config.auto_model)
        return ids

    @app.get("/v1/models")
    async def models(http: Request) -> Response:
        if (refused := await gateway.refused_key(http)) is not None:
            return refused
        data = [{"id": m, "object": "model", "created": created, "owned_by": "kvserve"} for m in model_ids()]
        return JSONResponse({"object": "list", "data": data})

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str, http: Request) -> Response:
        if (refused := await gateway.refused_key(http)) is not None:
            return refused
        if model_id not in model_ids():
            raise ModelNotFound(f"the model '{model_id}' does not exist here")
        return JSONResponse({"id": model_id, "object": "model", "created": created, "owned_by": "kvserve"})

    @app.get("/health")
    async def health() -> Response:
        healthy = len(gateway.pool.healthy())
        status = 200 if healthy else 503
        headers = None if healthy else {"Retry-After": str(RETRY_AFTER_S)}
        return JSONResponse({"status": "ok" if healthy else "no_healthy_replica", "healthy_replicas": healthy,
                             "replicas": len(gateway.pool.replicas)}, status_code=status, headers=headers)

    @app.get("/metrics")
    async def metrics() -> Response:
        content, content_type = gateway.metrics.render()
        return Response(content, media_type=content_type)

    started_at = time.time()

    async def live_stats() -> dict[str, Any]:
        m = gateway.metrics
        return await gateway_snapshot(gateway.client, gateway.pool.replicas, gateway.replica_headers,
                                      gateway.policy.name, started_at, m.decisions, m.requests, m.retries)

    async def trip(request_id: str) -> dict[str, Any] | None:
        return await find_trip(gateway.client, gateway.pool.replicas, gateway.replica_headers, request_id)

    add_dashboard_routes(app, live_stats, trip)
    return app


def _bound(handle: Callable[[str, Request], Awaitable[Response]], path: str) -> Callable[[Request], Awaitable[Response]]:
    """A route handler that passes its path to ``handle``."""
    async def route(http: Request) -> Response:
        return await handle(path, http)

    return route


def _timed_out(replica: Replica, what: str, exc: Exception) -> UpstreamTimeout:
    """A replica that answers too slowly: a 504 for this request; the replica stays in (slow is not down) and the
    request is not sent elsewhere, where it would run a second time."""
    return UpstreamTimeout(f"replica {replica.url} did not answer {what} within the gateway's request timeout "
                           f"(--request-timeout-s): {exc!r}")
