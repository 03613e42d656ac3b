"""A JSON POST to an OpenAI app called in-process (no socket): its status and its JSON answer."""

from __future__ import annotations

import asyncio
import json
from typing import Any

from kvserve.server.in_process import call_app


def post(app: object, path: str, body: dict[str, Any]) -> tuple[int, Any]:
    async def call() -> tuple[int, Any]:
        answer = call_app(app, "POST", path, json.dumps(body).encode(), {"content-type": "application/json"})
        status, _ = await answer.__anext__()
        return status, json.loads(b"".join([chunk async for chunk in answer]))
    return asyncio.run(call())
