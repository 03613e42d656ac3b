"""OpenAI answers as the difficulty router reshapes them: the small model asked for the logprobs a cascade
judges by, its answer shown to the client as the client asked for it (logprobs as requested, streamed if the
client streams), and the usage of an escalated answer covering both models.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

from kvserve.errors import InvalidRequest

CASCADE_TOP_LOGPROBS = 5


def is_chat(path: str) -> bool:
    return path.endswith("/chat/completions")


def for_cascade(payload: dict[str, Any], path: str, model: str) -> dict[str, Any]:
    """The request as the small model gets it in a cascade: whole (not streamed), with its tokens' logprobs."""
    first = {k: v for k, v in payload.items() if k not in ("stream", "stream_options")}
    first["model"] = model
    if is_chat(path):
        first["logprobs"] = True
        first["top_logprobs"] = max(_count(payload, "top_logprobs"), CASCADE_TOP_LOGPROBS)
    else:
        first["logprobs"] = max(_count(payload, "logprobs"), CASCADE_TOP_LOGPROBS)
    return first


def _count(payload: dict[str, Any], field: str) -> int:
    """A logprobs count of the request (0 when unset); a 400 naming the field when it is not a whole number."""
    value = payload.get(field) or 0
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise InvalidRequest(f"{field} must be a non-negative integer", param=field)
    return value


def as_client_asked(answer: dict[str, Any], payload: dict[str, Any], path: str) -> dict[str, Any]:
    """The small model's answer with the logprobs the client asked for (none, or fewer top ones)."""
    if is_chat(path):
        wanted = _count(payload, "top_logprobs") if payload.get("logprobs") else None
    else:
        wanted = _count(payload, "logprobs") if payload.get("logprobs") is not None else None
    for choice in answer.get("choices", []):
        logprobs = choice.get("logprobs")
        if wanted is None or not isinstance(logprobs, dict):
            choice["logprobs"] = None
        elif is_chat(path):
            for token in logprobs.get("content") or []:
                token["top_logprobs"] = token.get("top_logprobs", [])[:wanted]
        else:
            logprobs["top_logprobs"] = [dict(sorted(top.items(), key=lambda kv: -kv[1])[:wanted]) if top else top
                                        for top in logprobs.get("top_logprobs") or []]
    return answer


def answer_as_events(answer: dict[str, Any], path: str, include_usage: bool) -> list[bytes]:
    """A whole answer as the event stream the client asked for: one chunk per choice with all its text, the
    usage chunk if asked for, and ``[DONE]``."""
    chat = is_chat(path)
    head = {"id": answer.get("id"), "object": "chat.completion.chunk" if chat else "text_completion",
            "created": answer.get("created"), "model": answer.get("model")}
    events = []
    for choice in answer.get("choices", []):
        if chat:
            message = choice.get("message") or {}
            delta = {"role": message.get("role") or "assistant",
                     **{k: v for k, v in message.items() if k != "role" and v is not None}}
            if isinstance(delta.get("tool_calls"), list):  # a streamed call carries its index
                delta["tool_calls"] = [{"index": i, **call} for i, call in enumerate(delta["tool_calls"])]
            body = {"index": choice.get("index", 0), "delta": delta, "logprobs": choice.get("logprobs"),
                    "finish_reason": choice.get("finish_reason")}
        else:
            body = {k: choice.get(k) for k in ("index", "text", "logprobs", "finish_reason")}
        events.append({**head, "choices": [body]})
    if include_usage and answer.get("usage") is not None:
        events.append({**head, "choices": [], "usage": answer["usage"]})
    return [f"data: {json.dumps(e)}\n\n".encode() for e in events] + [b"data: [DONE]\n\n"]


def wants_stream_usage(payload: dict[str, Any]) -> bool:
    options = payload.get("stream_options")
    return isinstance(options, dict) and bool(options.get("include_usage"))


def _data_event(line: bytes, *markers: bytes) -> dict[str, Any] | None:
    """The JSON object of an event-stream ``data:`` line holding every one of ``markers`` (checked before the
    line is parsed: most lines of a stream are text deltas that hold none)."""
    if not (line.startswith(b"data: {") and all(marker in line for marker in markers)):
        return None
    try:
        event = json.loads(line[len(b"data: "):])
    except ValueError:
        return None
    return event if isinstance(event, dict) else None


def usage_event(line: bytes) -> dict[str, Any] | None:
    """The event of one event-stream line, if it is a chunk that carries a ``usage`` object."""
    event = _data_event(line, b'"usage"')
    return event if event is not None and isinstance(event.get("usage"), dict) else None


def response_usage_event(line: bytes) -> dict[str, Any] | None:
    """A Responses API stream's final event (``response.completed`` and the like), as a chunk carrying its
    response's ``usage``."""
    response = (_data_event(line, b'"usage"', b'"response.') or {}).get("response")
    usage = response.get("usage") if isinstance(response, dict) else None
    return {"usage": usage} if isinstance(usage, dict) else None


def stored_response_created(line: bytes) -> str | None:
    """The response id of a Responses API stream's ``response.created`` event, where the response is stored."""
    response = (_data_event(line, b'"response.created"') or {}).get("response")
    if not isinstance(response, dict) or response.get("store") is not True or not isinstance(response.get("id"), str):
        return None
    return response["id"]


def chat_usage(usage: dict[str, Any]) -> dict[str, Any]:
    """A usage object in chat's terms: a Responses API usage (input and output tokens) renamed."""
    if "input_tokens" not in usage:
        return usage
    details = usage.get("input_tokens_details")
    return {"prompt_tokens": usage.get("input_tokens"), "completion_tokens": usage.get("output_tokens"),
            "total_tokens": usage.get("total_tokens"),
            "prompt_tokens_details": details if isinstance(details, dict) else None}


def combined_usage(first: dict[str, Any] | None, second: dict[str, Any] | None, first_model: str,
                   second_model: str) -> dict[str, Any] | None:
    """What both models cost: the second's usage with the first's tokens added, and each one's own usage
    under ``models``."""
    if not isinstance(second, dict):
        return second
    first = first if isinstance(first, dict) else {}
    total = dict(second)
    for key in ("prompt_tokens", "completion_tokens", "total_tokens"):
        if isinstance(second.get(key), int):
            total[key] = second[key] + int(first.get(key) or 0)
    total["models"] = {first_model: first, second_model: second}
    return total


async def with_usage_of(chunks: AsyncIterator[bytes], first: dict[str, Any] | None, first_model: str,
                        second_model: str) -> AsyncIterator[bytes]:
    """An event stream whose usage chunk also counts the first model's usage; other bytes pass unchanged."""
    partial = b""
    async for chunk in chunks:
        *lines, partial = (partial + chunk).split(b"\n")
        out = []
        for line in lines:
            event = usage_event(line)
            if event is not None:
                event["usage"] = combined_usage(first, event["usage"], first_model, second_model)
                line = b"data: " + json.dumps(event).encode()
            out.append(line + b"\n")
        if out:
            yield b"".join(out)
    if partial:
        yield partial
