"""The OpenAI-compatible HTTP server: FastAPI routes over an AsyncEngine, and ``serve`` (uvicorn).

One HTTP request becomes one engine request per (prompt, sample)::

    POST /v1/chat/completions ── validate (pydantic, SamplingParams) ── chat template ── tokenize
        ── AsyncEngine.prepare (context check) ── RequestRun (request_run.py): one AsyncEngine.generate per
           prompt × n
        ── wait for every engine request's first output (admission errors become 4xx/5xx, not a
           broken stream) ── SSE chunks as outputs arrive, or one JSON body at the end

A client that disconnects (mid-stream or while waiting for a JSON body) cancels its RequestRun, which
closes its generators, which aborts its engine requests: their KV blocks are freed at the next step.

Shutdown (SIGTERM or SIGINT): new requests get 503 at once, in-flight ones get ``shutdown_grace_period_s`` to
finish and are then aborted (they end with finish_reason "abort"), and the process exits with status 0.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import logging
import math
import secrets
import signal
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from types import FrameType
from typing import Any, TypeVar

import uvicorn
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.background import BackgroundTask
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Receive, Scope, Send

from kvserve.async_engine import AsyncEngine
from kvserve.config import EngineConfig, ServerConfig
from kvserve.engine import Engine, expand_n
from kvserve.errors import (
    CapacityError,
    ContextLengthExceeded,
    EngineDeadError,
    InvalidRequest,
    KVServeError,
    ModelNotFound,
    RequestTooLarge,
    ServerShuttingDown,
    Unauthorized,
)
from kvserve.request import RequestOutput, SamplingParams
from kvserve.server import protocol as p
from kvserve.server.metrics import ServerMetrics
from kvserve.server.request_run import EngineRequest, RequestRun
from kvserve.tokenizer import LONG_TEXT_CHARS, Tokenizer

logger = logging.getLogger(__name__)

T = TypeVar("T")
RETRY_AFTER_S = 1
MIN_LOGPROB = -9999.0  # JSON has no -inf


class _ClientGone(Exception):
    """The client disconnected before its response was ready."""


# ---------------------------------------------------------------------------------------------------------
# App state and response building
# ---------------------------------------------------------------------------------------------------------
class _AppState:
    def __init__(self, engine: AsyncEngine, config: ServerConfig, tokenizer: Tokenizer, model_name: str,
                 max_model_len: int | None, model_root: str | None) -> None:
        self.engine = engine
        self.config = config
        self.tokenizer = tokenizer
        self.model_name = model_name
        self.max_model_len = max_model_len
        self.model_root = model_root
        self.metrics = ServerMetrics(engine.stats, lambda: engine.is_alive)
        self.runs: set[RequestRun] = set()
        self.draining = False
        self.created = int(time.time())
        self._token_text: dict[int, str] = {}
        self._token_bytes: dict[int, list[int]] = {}
        self._serial = itertools.count()

    def check_ready(self) -> None:
        if self.draining:
            raise ServerShuttingDown("the server is shutting down; retry on another replica")
        if not self.engine.is_alive:
            raise EngineDeadError(f"the engine loop has stopped: {self.engine.dead!r}")

    def check_model(self, name: str | None) -> None:
        if name is not None and name != self.model_name:
            error = ModelNotFound(f"the model '{name}' does not exist; this server serves '{self.model_name}'")
            error.param = "model"  # type: ignore[attr-defined]
            raise error

    async def drain(self, grace_s: float) -> None:
        """Refuse new requests, give in-flight ones ``grace_s`` to finish, then abort the rest."""
        self.draining = True
        deadline = time.monotonic() + grace_s
        while self.runs and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        if self.runs:
            logger.warning("aborting %d in-flight request(s) after the %.1fs grace period", len(self.runs), grace_s)
            for run in list(self.runs):
                run.abort()
            deadline = time.monotonic() + 2.0  # time for the aborted streams to send their last chunk
            while self.runs and time.monotonic() < deadline:
                await asyncio.sleep(0.05)

    def token_text(self, token_id: int) -> str:
        text = self._token_text.get(token_id)
        if text is None:
            text = self._token_text[token_id] = self.tokenizer.decode([token_id], skip_special_tokens=False)
        return text

    def token_bytes(self, token_id: int) -> list[int]:
        """The token's own bytes; for part of a character, not the U+FFFD its text decodes to alone."""
        data = self._token_bytes.get(token_id)
        if data is None:
            data = self._token_bytes[token_id] = list(self.tokenizer.token_bytes(token_id))
        return data

    # --- one request, end to end ----------------------------------------------------------------------------
    async def respond(self, http: Request, body: p.ChatCompletionRequest | p.CompletionRequest,
                      prompts: list[tuple[list[int], str | None]], params: SamplingParams, chat: bool,
                      received_at: float) -> Response:
        request_id = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        queue_limit = self.engine.max_waiting_requests
        if queue_limit is not None and len(prompts) * params.n > queue_limit:
            # Not a 429: retrying cannot help a request larger than the whole queue.
            raise InvalidRequest(
                f"this request needs {len(prompts) * params.n} sequences ({len(prompts)} prompt(s) x n={params.n}), "
                f"more than the {queue_limit} the server queues at once (--max-waiting-requests)",
                param="n" if params.n > 1 else "prompt")
        children = [
            EngineRequest(i * params.n + j, i, f"{request_id}-{i * params.n + j}", child_params, ids, text)
            for i, (ids, text) in enumerate(prompts)
            for j, child_params in enumerate(expand_n(params))
        ]
        run = RequestRun(self.engine, self.metrics, self.runs, children, received_at)
        try:
            await _until_disconnected(http, run.start())
        except _ClientGone:
            run.close()
            return Response(status_code=499)  # nobody reads it: nginx's "client closed request"
        want_timings = body.return_timings or http.headers.get("x-kvserve-timings", "").lower() in ("1", "true")
        head = {"id": request_id, "created": int(time.time()), "model": self.model_name}
        if body.stream:
            stream = self._stream(run, body, chat, head, want_timings)
            return StreamingResponse(stream, media_type="text/event-stream", background=BackgroundTask(run.close),
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        try:
            await _until_disconnected(http, run.wait())
        except _ClientGone:
            return Response(status_code=499)
        finally:
            run.close()
        response = self._full_response(run, body, chat, head)
        if want_timings:
            response.timings = run.timings()
        return Response(response.to_json(), media_type="application/json")

    def _full_response(self, run: RequestRun, body: Any, chat: bool, head: dict[str, Any]) -> p._Response:
        usage = run.usage()
        if chat:
            choices = []
            for c in run.children:
                assert c.last is not None
                completion = c.last.outputs[0]
                logprobs = self._chat_logprobs(c, 0, len(completion.token_ids), body.top_logprobs or 0)
                choices.append(p.ChatChoice(index=c.index, message=p.ChatMessageOut(content=completion.text),
                                            logprobs=logprobs, finish_reason=completion.finish_reason))
            return p.ChatCompletionResponse(**head, choices=choices, usage=usage)
        completion_choices = []
        for c in run.children:
            assert c.last is not None
            completion = c.last.outputs[0]
            logprobs = self._completion_logprobs(c, 0, len(completion.token_ids), body.logprobs, 0)
            completion_choices.append(p.CompletionChoice(index=c.index, text=completion.text, logprobs=logprobs,
                                                         finish_reason=completion.finish_reason))
        return p.CompletionResponse(**head, choices=completion_choices, usage=usage)

    async def _stream(self, run: RequestRun, body: Any, chat: bool, head: dict[str, Any],
                      want_timings: bool) -> AsyncIterator[str]:
        chunk_type = p.ChatCompletionChunk if chat else p.CompletionResponse
        try:
            try:
                if chat:  # OpenAI opens each choice with the role
                    for c in run.children:
                        role = p.ChatChunkChoice(index=c.index, delta=p.DeltaMessage(role="assistant", content=""))
                        yield _sse(p.ChatCompletionChunk(**head, choices=[role]).to_json())
                while (item := await run.next()) is not None:
                    child, output = item
                    choice = self._chunk_choice(child, output, body, chat)
                    if choice is None:
                        continue
                    chunk = chunk_type(**head, choices=[choice])
                    if run.exhausted and want_timings and not body.include_usage:
                        chunk.timings = run.timings()
                    yield _sse(chunk.to_json())
                if body.include_usage:
                    chunk = chunk_type(**head, choices=[], usage=run.usage())
                    if want_timings:
                        chunk.timings = run.timings()
                    yield _sse(chunk.to_json())
            except KVServeError as exc:  # the engine died mid-stream: tell the client, then end the stream
                self.metrics.observe_error(exc.http_status, exc.code)
                yield _sse(_error_json(exc))
            yield "data: [DONE]\n\n"
        finally:
            run.close()

    def _chunk_choice(self, child: EngineRequest, output: RequestOutput, body: Any, chat: bool) -> Any:
        """The streamed choice for one output, or None when it carries nothing (text held back)."""
        completion = output.outputs[0]
        num_tokens = len(completion.token_ids)
        start = num_tokens - len(output.delta_token_ids)
        finish = completion.finish_reason if output.finished else None
        if chat:
            logprobs = self._chat_logprobs(child, start, num_tokens, body.top_logprobs or 0)
            if not output.delta_text and finish is None and logprobs is None:
                return None
            return p.ChatChunkChoice(index=child.index, delta=p.DeltaMessage(content=output.delta_text),
                                     logprobs=logprobs, finish_reason=finish)
        logprobs = self._completion_logprobs(child, start, num_tokens, body.logprobs, child.num_chars_sent)
        child.num_chars_sent += len(output.delta_text)
        if not output.delta_text and finish is None and logprobs is None:
            return None
        return p.CompletionChoice(index=child.index, text=output.delta_text, logprobs=logprobs, finish_reason=finish)

    # --- logprobs: entries [start, end) of the child's output tokens ---------------------------------------
    def _token_logprobs(self, child: EngineRequest, start: int, end: int) -> list[tuple[int, dict[int, float]]]:
        assert child.last is not None
        completion = child.last.outputs[0]
        entries = completion.logprobs or []
        # The engine appends to ``entries`` as it samples; positions below len(token_ids) are final.
        return [(completion.token_ids[i], entries[i] if i < len(entries) else {}) for i in range(start, end)]

    def _chat_logprobs(self, child: EngineRequest, start: int, end: int, num_top: int) -> p.ChatLogprobs | None:
        if child.params.logprobs is None:
            return None
        content = []
        for token_id, entry in self._token_logprobs(child, start, end):
            text = self.token_text(token_id)
            top = [p.TopLogprob(token=self.token_text(t), logprob=_finite(lp), bytes=self.token_bytes(t))
                   for t, lp in list(entry.items())[:num_top]]
            content.append(p.TokenLogprob(token=text, logprob=_finite(entry.get(token_id, MIN_LOGPROB)),
                                          bytes=self.token_bytes(token_id), top_logprobs=top))
        return p.ChatLogprobs(content=content)

    def _completion_logprobs(self, child: EngineRequest, start: int, end: int, num_top: int | None,
                             offset: int) -> p.CompletionLogprobs | None:
        if child.params.logprobs is None:
            return None
        out = p.CompletionLogprobs()
        for token_id, entry in self._token_logprobs(child, start, end):
            text = self.token_text(token_id)
            out.tokens.append(text)
            out.token_logprobs.append(_finite(entry.get(token_id, MIN_LOGPROB)))
            out.top_logprobs.append({self.token_text(t): _finite(lp) for t, lp in list(entry.items())[:num_top or 0]})
            out.text_offset.append(offset)
            offset += len(text)
        return out


async def _off_loop_if_long(prompt: object, fn: Callable[..., T], *args: Any) -> T:
    """``fn(*args)``, in a worker thread when ``prompt`` is a long text: tokenizing it takes milliseconds
    per few thousand characters, during which the event loop would serve no stream."""
    if isinstance(prompt, str) and len(prompt) > LONG_TEXT_CHARS:
        return await asyncio.to_thread(fn, *args)
    return fn(*args)


def _finite(value: float) -> float:
    return value if math.isfinite(value) else MIN_LOGPROB


def _sse(data: str) -> str:
    return f"data: {data}\n\n"


def _error_json(exc: KVServeError) -> str:
    return json.dumps(p.error_body(str(exc), exc.error_type, getattr(exc, "param", None), exc.code))


async def _until_disconnected(http: Request, awaitable: Awaitable[T]) -> T:
    """Await ``awaitable`` unless the client disconnects first: then cancel it and raise _ClientGone."""
    task = asyncio.ensure_future(awaitable)

    async def disconnected() -> None:
        while (await http.receive())["type"] != "http.disconnect":
            pass

    listener = asyncio.ensure_future(disconnected())
    try:
        done, _ = await asyncio.wait({task, listener}, return_when=asyncio.FIRST_COMPLETED)
    except BaseException:  # we were cancelled ourselves
        task.cancel()
        listener.cancel()
        raise
    listener.cancel()
    if task in done:
        return task.result()
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)  # let it run its cleanup (which aborts)
    raise _ClientGone()


# ---------------------------------------------------------------------------------------------------------
# The app
# ---------------------------------------------------------------------------------------------------------
def build_app(
    async_engine: AsyncEngine,
    config: ServerConfig,
    tokenizer: Tokenizer,
    *,
    model_name: str | None = None,
    max_model_len: int | None = None,
    model_root: str | None = None,
) -> FastAPI:
    """A FastAPI app over a running AsyncEngine. The caller owns the engine (and shuts it down)."""
    name = model_name or config.served_model_name or "kvserve"
    state = _AppState(async_engine, config, tokenizer, name, max_model_len, model_root)
    app = FastAPI(title="kvserve", version="0.1.0")
    app.state.kvserve = state
    app.add_middleware(_GateMiddleware, state=state)
    _add_error_handlers(app, state)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: p.ChatCompletionRequest, http: Request) -> Response:
        received_at = time.monotonic()
        state.check_ready()
        state.check_model(body.model)
        params = body.sampling_params()
        text = tokenizer.apply_chat_template(body.message_dicts(), add_generation_prompt=True)
        try:
            async_engine.check_text_fits(text)
            # The template already holds any BOS token: don't add special tokens twice.
            ids = await _off_loop_if_long(text, tokenizer.encode, text, False)
            token_ids, _ = async_engine.prepare({"prompt_token_ids": ids}, params)
        except ContextLengthExceeded as exc:
            raise p.rename_param(exc, "max_tokens", body.max_tokens_field) from None
        return await state.respond(http, body, [(token_ids, None)], params, True, received_at)

    @app.post("/v1/completions")
    async def completions(body: p.CompletionRequest, http: Request) -> Response:
        received_at = time.monotonic()
        state.check_ready()
        state.check_model(body.model)
        params = body.sampling_params()
        prompts = [await _off_loop_if_long(prompt, async_engine.prepare, prompt, params) for prompt in body.prompts()]
        return await state.respond(http, body, prompts, params, False, received_at)

    @app.get("/v1/models")
    async def models() -> Response:
        card = p.ModelCard(id=state.model_name, created=state.created, root=state.model_root,
                           max_model_len=state.max_model_len)
        return Response(p.ModelList(data=[card]).model_dump_json(), media_type="application/json")

    @app.get("/health")
    async def health() -> Response:
        if not async_engine.is_alive:
            return JSONResponse({"status": "dead", "error": f"the engine loop has stopped: {async_engine.dead!r}"},
                                status_code=503)
        if state.draining:
            return JSONResponse({"status": "draining"}, status_code=503)
        return JSONResponse({"status": "ok"})

    @app.get("/metrics")
    async def metrics() -> Response:
        content, content_type = state.metrics.render()
        return Response(content, media_type=content_type)

    return app


def _error_response(state: _AppState, status: int, body: dict[str, Any],
                    headers: dict[str, str] | None = None) -> Response:
    state.metrics.observe_error(status, body["error"].get("code"))
    # ASCII JSON: a message that quotes the request (a model name) may hold what UTF-8 cannot encode.
    return Response(json.dumps(body), status_code=status, headers=headers, media_type="application/json")


def _add_error_handlers(app: FastAPI, state: _AppState) -> None:
    @app.exception_handler(RequestValidationError)
    async def on_validation_error(_: Request, exc: RequestValidationError) -> Response:
        return _error_response(state, 400, p.validation_error_body(exc.errors()))

    @app.exception_handler(KVServeError)
    async def on_kvserve_error(_: Request, exc: KVServeError) -> Response:
        headers = {"Retry-After": str(RETRY_AFTER_S)} if isinstance(exc, CapacityError | ServerShuttingDown) else None
        if exc.http_status >= 500:
            logger.warning("request failed: %s", exc)
        body = p.error_body(str(exc), exc.error_type, getattr(exc, "param", None), exc.code)
        return _error_response(state, exc.http_status, body, headers)

    @app.exception_handler(StarletteHTTPException)
    async def on_http_error(_: Request, exc: StarletteHTTPException) -> Response:
        error_type = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return _error_response(state, exc.status_code, p.error_body(str(exc.detail), error_type), exc.headers)

    @app.exception_handler(Exception)
    async def on_bug(_: Request, exc: Exception) -> Response:
        logger.exception("internal error")
        return _error_response(state, 500, p.error_body(f"internal error: {exc!r}", "internal_error"))


class _GateMiddleware:
    """Before any route: 401 without the API key (on /v1 routes), 503 while shutting down, 413 for a body
    over the size limit.

    Plain ASGI rather than BaseHTTPMiddleware, which would get between the routes and ``receive`` and
    break disconnect detection.
    """

    def __init__(self, app: ASGIApp, state: _AppState) -> None:
        self.app = app
        self.state = state
        key = state.config.api_key
        self._expected = f"Bearer {key}".encode() if key else None
        self._max_body = state.config.max_request_body_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"].startswith("/v1/"):
            headers = dict(scope["headers"])
            error: KVServeError | None = None
            if self._expected is not None:
                given = headers.get(b"authorization", b"")
                if not secrets.compare_digest(given, self._expected):
                    error = Unauthorized("missing or invalid API key (send 'Authorization: Bearer <key>')")
            if error is None and self.state.draining:
                error = ServerShuttingDown("the server is shutting down; retry on another replica")
            if error is None and scope["method"] == "POST":
                receive, error = await self._limit_body(headers, receive)
            if error is not None:
                retry = {"Retry-After": str(RETRY_AFTER_S)} if isinstance(error, ServerShuttingDown) else None
                body = p.error_body(str(error), error.error_type, None, error.code)
                await _error_response(self.state, error.http_status, body, retry)(scope, receive, send)
                return
        await self.app(scope, receive, send)

    async def _limit_body(self, headers: dict[bytes, bytes], receive: Receive) -> tuple[Receive, KVServeError | None]:
        """413 for a body over the limit: at once from Content-Length; a chunked body (no length) is read
        here up to the limit and handed on to the route as if unread."""
        too_large = RequestTooLarge(f"the request body is larger than {self._max_body} bytes "
                                    f"(--max-request-body-bytes)")
        length = headers.get(b"content-length")
        if length is not None:
            return receive, (too_large if length.isdigit() and int(length) > self._max_body else None)
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] != "http.request":  # the client left: let the route see it
                return _replay([message], receive), None
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            if size > self._max_body:
                return receive, too_large
            if not message.get("more_body", False):
                return _replay([{"type": "http.request", "body": b"".join(chunks), "more_body": False}], receive), None


def _replay(messages: list[dict[str, Any]], receive: Receive) -> Receive:
    """A receive that yields ``messages`` first, then defers to ``receive`` (disconnects still arrive)."""
    pending = list(messages)

    async def replayed() -> dict[str, Any]:
        return pending.pop(0) if pending else await receive()

    return replayed


# ---------------------------------------------------------------------------------------------------------
# serve
# ---------------------------------------------------------------------------------------------------------
class _GracefulServer(uvicorn.Server):
    """uvicorn, with a drain before the shutdown: the first SIGTERM/SIGINT refuses new requests and
    waits (up to the grace period) for in-flight ones; a second one stops at once."""

    def __init__(self, config: uvicorn.Config, state: _AppState, grace_s: float) -> None:
        super().__init__(config)
        self._state = state
        self._grace_s = grace_s
        self._drain_requested = False
        self._drain_task: asyncio.Task[None] | None = None

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        # Not recorded in _captured_signals: uvicorn re-raises those after shutdown, and the process would
        # then die by the signal (status 143) instead of exiting cleanly with 0.
        if self._drain_requested:
            self.should_exit = True
            self.force_exit = sig == signal.SIGINT
            return
        logger.warning("signal %d: draining (grace period %.1fs)", sig, self._grace_s)
        self._drain_requested = True
        self._state.draining = True

    async def on_tick(self, counter: int) -> bool:
        if self._drain_requested and self._drain_task is None:
            self._drain_task = asyncio.create_task(self._drain())
        return await super().on_tick(counter)

    async def _drain(self) -> None:
        await self._state.drain(self._grace_s)
        self.should_exit = True


def serve(engine_config: EngineConfig, server_config: ServerConfig) -> int:
    """Load the model, start the engine thread and serve until SIGTERM/SIGINT. Returns the exit status."""
    engine = Engine(engine_config)
    async_engine = AsyncEngine(engine, max_waiting_requests=server_config.max_waiting_requests)
    name = server_config.served_model_name or engine_config.model.model or engine.model_path.stem
    app = build_app(async_engine, server_config, engine.tokenizer, model_name=name,
                    max_model_len=engine.max_model_len, model_root=str(engine.model_path))
    uv_config = uvicorn.Config(app, host=server_config.host, port=server_config.port,
                               log_level=server_config.uvicorn_log_level,
                               lifespan="off", timeout_graceful_shutdown=2)
    server = _GracefulServer(uv_config, app.state.kvserve, server_config.shutdown_grace_period_s)
    logger.info("serving %s on http://%s:%d", name, server_config.host, server_config.port)
    try:
        server.run()
    finally:
        async_engine.shutdown()
        engine.close()
    return 0 if server.started else 1


class BackgroundServer:
    """The server on a free loopback port in a thread of this process (``kvserve trace --in-process``)."""

    def __init__(self, engine_config: EngineConfig, server_config: ServerConfig | None = None) -> None:
        import socket
        import threading

        config = server_config or ServerConfig()
        if config.port == 0 or server_config is None:
            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                config = ServerConfig(host="127.0.0.1", port=s.getsockname()[1],
                                      served_model_name=config.served_model_name)
        self.engine = Engine(engine_config)
        self.async_engine = AsyncEngine(self.engine, max_waiting_requests=config.max_waiting_requests)
        app = build_app(self.async_engine, config, self.engine.tokenizer,
                        model_name=config.served_model_name or self.engine.model_path.stem,
                        max_model_len=self.engine.max_model_len, model_root=str(self.engine.model_path))
        self._server = uvicorn.Server(uvicorn.Config(app, host=config.host, port=config.port, log_level="warning",
                                                     lifespan="off"))
        self._thread = threading.Thread(target=self._server.run, name="kvserve-http", daemon=True)
        self._thread.start()
        deadline = time.monotonic() + 30
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the in-process server did not start")
            time.sleep(0.02)
        self.base_url = f"http://{config.host}:{config.port}"

    def stop(self) -> None:
        self._server.should_exit = True
        self._thread.join(timeout=10)
        self.async_engine.shutdown()
        self.engine.close()
