"""The Responses API's routes: ``POST /v1/responses`` answered by the chat route, and the stored responses'
``GET`` / ``DELETE /v1/responses/{id}`` and ``GET /v1/responses/{id}/input_items``."""

from __future__ import annotations

import json
import time
from collections.abc import Awaitable, Callable
from typing import Any, Literal

from fastapi import FastAPI, Query, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from kvserve.errors import ContextLengthExceeded, InvalidRequest, PreviousResponseNotFound, ResponseNotFound
from kvserve.server import protocol as p
from kvserve.server.response_store import ResponseStore, StoredResponse
from kvserve.server.responses_api import (
    ResponseEvents,
    ResponseShape,
    ResponsesRequest,
    in_responses_terms,
    response_of,
)

ChatRoute = Callable[[p.ChatCompletionRequest, Request], Awaitable[Response]]
PromptFits = Callable[[p.ChatCompletionRequest], Awaitable[bool]]


def add_responses_routes(app: FastAPI, chat_route: ChatRoute, prompt_fits: PromptFits, store: ResponseStore,
                         model_name: str) -> None:
    """The routes, over ``chat_route`` (the server's chat completions handler), ``prompt_fits`` (whether the
    chat route takes a conversation with room for its output) and ``store``; responses name ``model_name``
    where their request names no model."""

    async def answered(body: ResponsesRequest, context: list[dict[str, Any]], http: Request) -> Response:
        """The chat route's answer to the conversation; where it is too long for the context and ``truncation``
        is ``"auto"``, to its latest items that fit, from one of its user's messages (the fewest dropped from its
        start, found by halving: each try renders and tokenizes it)."""
        try:
            return await chat_route(body.chat_request(context), http)
        except ContextLengthExceeded:
            if body.truncation != "auto":
                raise
        starts = body.cut_points(context)
        too_long, fits = -1, len(starts) - 1  # indices into starts; a start at 0 is the whole, too long
        while too_long + 1 < fits:
            middle = (too_long + fits) // 2
            if starts[middle] > 0 and await prompt_fits(body.truncated(context, starts[middle]).chat_request()):
                fits = middle
            else:
                too_long = middle
        # Where no shorter part fitted, the last start's: the chat route's error says why.
        return await chat_route(body.truncated(context, starts[fits]).chat_request(), http)

    @app.post("/v1/responses")
    async def responses(body: ResponsesRequest, http: Request) -> Response:
        """OpenAI's Responses API, answered by the chat route (server/responses_api.py)."""
        created_at = int(time.time())
        previous = None
        if body.previous_response_id is not None:
            previous = store.get(body.previous_response_id)
            if previous is None:
                raise PreviousResponseNotFound(body.previous_response_id)
        try:
            answer = await answered(body, previous.context if previous is not None else [], http)
        except InvalidRequest as exc:
            raise in_responses_terms(exc) from None
        keep = body.store is not False and store.enabled
        shape = ResponseShape(body, body.model or model_name, stored=keep, created_at=created_at)
        input_items = body.input_items() if keep else ()

        def stored(response: dict[str, Any]) -> None:
            if keep and not store.put(response, input_items, previous):
                response["store"] = False  # larger than the whole budget (a stream's first event said true)

        if isinstance(answer, StreamingResponse):
            events = ResponseEvents(shape, body.wants_logprobs, on_finished=stored).events(answer.body_iterator)
            return StreamingResponse(events, media_type="text/event-stream", background=answer.background,
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        if answer.status_code != 200:  # 499: the client left
            return answer
        response = response_of(shape, json.loads(answer.body), body.wants_logprobs)
        stored(response)
        return JSONResponse(response)

    def find(response_id: str) -> StoredResponse:
        entry = store.get(response_id)
        if entry is None:
            raise ResponseNotFound(f"no response with id '{response_id}' is stored here (it was not stored, was "
                                   "deleted, or was dropped for newer ones: --response-store-mib)")
        return entry

    @app.get("/v1/responses/{response_id}")
    async def retrieve(response_id: str, stream: bool = False) -> Response:
        entry = find(response_id)
        if stream:  # the events of a response still running in the background: none here
            raise InvalidRequest("stream: responses are not run in the background here; retrieve it whole",
                                 param="stream")
        return JSONResponse(entry.response)

    @app.delete("/v1/responses/{response_id}")
    async def delete(response_id: str) -> Response:
        find(response_id)
        store.delete(response_id)
        return JSONResponse({"id": response_id, "object": "response", "deleted": True})

    @app.get("/v1/responses/{response_id}/input_items")
    async def input_items(response_id: str, limit: int = Query(20, ge=1, le=100),
                          order: Literal["asc", "desc"] = "desc", after: str | None = None) -> Response:
        """The input items of a stored response's request, a page at a time (OpenAI's cursor list)."""
        items = list(find(response_id).input_items)
        if order == "desc":
            items.reverse()
        if after is not None:
            ids = [item["id"] for item in items]
            if after not in ids:
                raise InvalidRequest(f"after: no input item of '{response_id}' has the id '{after}'", param="after")
            items = items[ids.index(after) + 1:]
        page = items[:limit]
        return JSONResponse({"object": "list", "data": page, "first_id": page[0]["id"] if page else None,
                             "last_id": page[-1]["id"] if page else None, "has_more": len(items) > limit})
