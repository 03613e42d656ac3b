"""What stands before and after the routes: the gate (API key, shutdown, body size) and the error handlers
that turn every exception into an OpenAI error body with its HTTP status.
"""

from __future__ import annotations

import json
import logging
import secrets
from collections.abc import Callable
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Receive, Scope, Send

from kvserve.errors import CapacityError, KVServeError, RequestTooLarge, ServerShuttingDown, Unauthorized
from kvserve.server import protocol as p
from kvserve.server.metrics import ServerMetrics
from kvserve.serving_config import ServerConfig

logger = logging.getLogger(__name__)

RETRY_AFTER_S = 1


def error_response(metrics: ServerMetrics, status: int, body: dict[str, Any],
                   headers: dict[str, str] | None = None) -> Response:
    metrics.observe_error(status, body["error"].get("code"))
    # ASCII JSON: a message that quotes the request (a model name) may hold what UTF-8 cannot encode.
    return Response(json.dumps(body), status_code=status, headers=headers, media_type="application/json")


def add_error_handlers(app: FastAPI, metrics: ServerMetrics) -> None:
    @app.exception_handler(RequestValidationError)
    async def on_validation_error(_: Request, exc: RequestValidationError) -> Response:
        return error_response(metrics, 400, p.validation_error_body(exc.errors()))

    @app.exception_handler(KVServeError)
    async def on_kvserve_error(_: Request, exc: KVServeError) -> Response:
        headers = {"Retry-After": str(RETRY_AFTER_S)} if isinstance(exc, CapacityError | ServerShuttingDown) else None
        if exc.http_status >= 500:
            logger.warning("request failed: %s", exc)
        body = p.error_body(str(exc), exc.error_type, getattr(exc, "param", None), exc.code)
        return error_response(metrics, exc.http_status, body, headers)

    @app.exception_handler(StarletteHTTPException)
    async def on_http_error(_: Request, exc: StarletteHTTPException) -> Response:
        error_type = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return error_response(metrics, exc.status_code, p.error_body(str(exc.detail), error_type), exc.headers)

    @app.exception_handler(Exception)
    async def on_bug(_: Request, exc: Exception) -> Response:
        logger.exception("internal error")
        return error_response(metrics, 500, p.error_body(f"internal error: {exc!r}", "internal_error"))


TOKENIZER_ROUTES = ("/tokenize", "/detokenize")


class GateMiddleware:
    """Before any route that serves clients (/v1, /tokenize, /detokenize): 401 without the API key, 503 while
    shutting down, 413 for a body over the size limit.

    Plain ASGI rather than BaseHTTPMiddleware, which would get between the routes and ``receive`` and
    break disconnect detection.
    """

    def __init__(self, app: ASGIApp, config: ServerConfig, metrics: ServerMetrics,
                 draining: Callable[[], bool]) -> None:
        self.app = app
        self.metrics = metrics
        self.draining = draining
        key = config.api_key
        self._expected = f"Bearer {key}".encode() if key else None
        self._max_body = config.max_request_body_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and (scope["path"].startswith("/v1/") or scope["path"] in TOKENIZER_ROUTES):
            headers = dict(scope["headers"])
            error: KVServeError | None = None
            if self._expected is not None:
                given = headers.get(b"authorization", b"")
                if not secrets.compare_digest(given, self._expected):
                    error = Unauthorized("missing or invalid API key (send 'Authorization: Bearer <key>')")
            if error is None and self.draining():
                error = ServerShuttingDown("the server is shutting down; retry on another replica")
            if error is None and scope["method"] == "POST":
                receive, error = await self._limit_body(headers, receive)
            if error is not None:
                retry = {"Retry-After": str(RETRY_AFTER_S)} if isinstance(error, ServerShuttingDown) else None
                body = p.error_body(str(error), error.error_type, None, error.code)
                await error_response(self.metrics, error.http_status, body, retry)(scope, receive, send)
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
