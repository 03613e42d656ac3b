"""Waiting for something on behalf of an HTTP client that may leave: the server's routes and the gateway's both
wait this way. Imports nothing of the engine, so the gateway may use it."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from typing import TypeVar

from starlette.requests import Request

T = TypeVar("T")


class ClientGone(Exception):
    """The client disconnected before its response was ready."""


async def until_disconnected(http: Request, awaitable: Awaitable[T]) -> T:
    """Await ``awaitable`` unless the client disconnects first: then cancel it and raise ClientGone."""
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
    raise ClientGone()
