"""One HTTP request to an ASGI app in this process, without a socket: how a Ray Serve replica calls the OpenAI
app over the engine it holds (server/ray_replica.py). The answer streams as the app sends it; a caller that
stops reading is a client that went away, as it would be over HTTP."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Mapping
from typing import Any

from starlette.types import ASGIApp, Message

logger = logging.getLogger(__name__)

# How long a request whose caller went away may take to end (its engine requests aborted, its background tasks
# run) before it is cancelled outright.
DISCONNECT_GRACE_S = 10.0


async def call_app(app: ASGIApp, method: str, path: str, body: bytes = b"",
                   headers: Mapping[str, str] | None = None) -> AsyncIterator[tuple[int, str] | bytes]:
    """Yields (status, content type) first, then the body's chunks as the app sends them. Closing the
    generator early delivers ``http.disconnect`` to the app, as a client closing its connection would."""
    path, _, query = path.partition("?")
    header_items = {**(headers or {}), "content-length": str(len(body))}
    scope: dict[str, Any] = {
        "type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"}, "http_version": "1.1",
        "method": method, "scheme": "http", "path": path, "raw_path": path.encode(), "query_string": query.encode(),
        "root_path": "", "client": ("127.0.0.1", 0), "server": ("127.0.0.1", 0),
        "headers": [(k.lower().encode("latin-1"), v.encode("latin-1")) for k, v in header_items.items()],
    }
    sent: asyncio.Queue[Message | None] = asyncio.Queue()
    gone = asyncio.Event()
    body_delivered = False

    async def receive() -> Message:
        nonlocal body_delivered
        if not body_delivered:
            body_delivered = True
            return {"type": "http.request", "body": body, "more_body": False}
        await gone.wait()
        return {"type": "http.disconnect"}

    async def run() -> None:
        try:
            await app(scope, receive, sent.put)
        finally:
            sent.put_nowait(None)

    task = asyncio.create_task(run())
    try:
        while (message := await sent.get()) is not None:
            if message["type"] == "http.response.start":
                content_type = next((v.decode("latin-1") for k, v in message.get("headers", ())
                                     if k.lower() == b"content-type"), "application/octet-stream")
                yield message["status"], content_type
            elif message["type"] == "http.response.body":
                if message.get("body"):
                    yield message["body"]
                if not message.get("more_body", False):
                    break
    finally:
        gone.set()
        try:
            await asyncio.wait_for(asyncio.shield(task), DISCONNECT_GRACE_S)
        except TimeoutError:
            logger.warning("%s %s did not end within %.0fs of its caller leaving: cancelled", method, path,
                           DISCONNECT_GRACE_S)
            task.cancel()
