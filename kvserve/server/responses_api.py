"""OpenAI's Responses API (``POST /v1/responses``) over the chat route: a request's input items become a
conversation, the chat route answers it, and its answer (a JSON body, or a stream of chat chunks) becomes a
response object (or the Responses API's typed stream events).

A response is stored (``store``, true by default, as OpenAI has it) in the server's response store
(server/response_store.py): a follow-up naming it as ``previous_response_id`` continues its conversation.
What kvserve does not keep is refused by name: stored conversations and prompts, background responses, item
references, non-text inputs and hosted tools (web search, file search, ...).
"""

from __future__ import annotations

import copy
import json
import re
import time
import uuid
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any, Literal

from pydantic import ConfigDict, ValidationError

from kvserve.errors import InvalidRequest
from kvserve.server import protocol as p

# Fields the chat route takes as they are (OpenAI's and vLLM's sampling and request extensions).
PASSED_TO_CHAT = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty", "presence_penalty",
                  "frequency_penalty", "seed", "stop", "ignore_eos", "min_tokens", "logit_bias", "allowed_token_ids",
                  "bad_words", "cache_salt", "user", "parallel_tool_calls", "chat_template_kwargs",
                  "stop_token_ids", "skip_special_tokens", "truncate_prompt_tokens", "priority",
                  "thinking_token_budget")
# OpenAI's fields that point at what OpenAI stores beyond responses (a conversation, a prompt, a response run in
# the background): kvserve keeps none of them, and answering without what they point at would be a wrong answer.
STORED_STATE = ("conversation", "prompt", "background")
_TEXT_PARTS = ("input_text", "output_text", "text", "refusal")
_ROLES = {"user": "user", "assistant": "assistant", "system": "system", "developer": "system"}
OUTPUT_LOGPROBS = "message.output_text.logprobs"  # the ``include`` value that asks for them
_ITEM_ID_PREFIXES = {"message": "msg", "function_call": "fc", "function_call_output": "fco", "reasoning": "rs"}


class ResponsesRequest(p.StrictTextModel):
    """The request body of ``POST /v1/responses``. Unknown fields are kept for the chat route's extensions."""

    model_config = ConfigDict(extra="allow", strict=True)
    model: str | None = None
    input: str | list[Any] | None = None  # items are checked one by one, each error naming its item
    instructions: str | None = None
    max_output_tokens: int | None = None
    stream: bool = False
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    text: dict[str, Any] | None = None
    top_logprobs: int | None = None
    include: list[str] | None = None
    previous_response_id: str | None = None
    truncation: Literal["auto", "disabled"] | None = None  # auto: the oldest items dropped until it fits
    store: bool | None = None  # None: true, as OpenAI has it
    metadata: dict[str, Any] | None = None
    reasoning: dict[str, Any] | None = None  # OpenAI's effort and summary settings: taken, not acted on

    def chat_request(self, context: Sequence[dict[str, Any]] = ()) -> p.ChatCompletionRequest:
        """The same request as the chat route takes it, continuing the items of ``context`` (the stored
        conversation ``previous_response_id`` names); InvalidRequest for what kvserve does not do."""
        for name in STORED_STATE:
            if (self.model_extra or {}).get(name) not in (None, False):
                raise InvalidRequest(f"{name}: kvserve stores responses only (previous_response_id), no "
                                     "conversations, prompts or background responses; send the conversation in "
                                     "input", param=name)
        if self.input is None:
            raise InvalidRequest("input is required: the conversation's items, or a string", param="input")
        chat: dict[str, Any] = {k: v for k, v in (self.model_extra or {}).items() if k in PASSED_TO_CHAT}
        chat["messages"] = self.messages(context)
        if self.max_output_tokens is not None:
            chat["max_completion_tokens"] = self.max_output_tokens
        if self.tools:
            chat["tools"] = [_chat_tool(tool, i) for i, tool in enumerate(self.tools)]
        if self.tool_choice is not None:
            chat["tool_choice"] = _chat_tool_choice(self.tool_choice)
        if (response_format := _response_format(self.text)) is not None:
            chat["response_format"] = response_format
        if self.wants_logprobs:
            chat["logprobs"], chat["top_logprobs"] = True, self.top_logprobs or 0
        if self.stream:
            chat["stream"], chat["stream_options"] = True, {"include_usage": True}
        try:
            return p.ChatCompletionRequest.model_validate({"model": self.model, **chat})
        except ValidationError as exc:  # a passed-on field of the wrong type: the client's, named
            error = exc.errors()[0]
            where = ".".join(str(part) for part in error["loc"])
            raise InvalidRequest(f"{where}: {error['msg']}", param=where) from None

    @property
    def wants_logprobs(self) -> bool:
        """The reply text's logprobs were asked for (as OpenAI asks: ``include``, with ``top_logprobs`` beside)."""
        return OUTPUT_LOGPROBS in (self.include or [])

    def messages(self, context: Sequence[dict[str, Any]] = ()) -> list[dict[str, Any]]:
        """``instructions`` as the system message (a previous response's are not carried on, as OpenAI has it),
        then the items of ``context`` and the input items, as chat messages."""
        messages: list[dict[str, Any]] = []
        if self.instructions:
            messages.append({"role": "system", "content": self.instructions})
        for item in context:  # checked when they were stored
            _add_item(messages, item, "previous_response_id")
        for i, item in enumerate(self._items()):
            if not isinstance(item, dict):
                raise InvalidRequest(f"input[{i}] must be an object (an input item)", param=f"input[{i}]")
            _add_item(messages, item, f"input[{i}]")
        if not messages:
            raise InvalidRequest("input holds no message", param="input")
        return messages

    @property
    def num_input_items(self) -> int:
        return len(self._items())

    def cut_points(self, context: Sequence[dict[str, Any]]) -> list[int]:
        """Where the conversation ``truncation: "auto"`` keeps may begin (indices into ``context`` and the input
        items, in order): at a user's message, so that no call's output is kept without its call, nor a reply
        without what it answers (templates that insist on alternating roles refuse that); the last item where
        no user's message comes."""
        items = [*context, *self._items()]
        return [i for i, item in enumerate(items) if item.get("role") == "user"] or [len(items) - 1]

    def truncated(self, context: Sequence[dict[str, Any]], first: int) -> ResponsesRequest:
        """The request as if ``context`` and its input items from the ``first`` on were its whole input."""
        return self.model_copy(update={"input": [*context, *self._items()][first:]})

    def input_items(self) -> tuple[dict[str, Any], ...]:
        """The input items as a stored response lists them (OpenAI's ``input_items``): each with an id of its own
        (the client's where it gave a string not given before: the listing pages by id), a message's text as
        content parts. Called on a request whose items ``chat_request`` has checked."""
        seen: set[str] = set()
        listed = []
        for item in self._items():
            given = item.get("id")
            unique = given if isinstance(given, str) and given and given not in seen else None
            listed.append(_listed(item, unique))
            seen.add(listed[-1]["id"])
        return tuple(listed)

    def _items(self) -> list[Any]:
        if self.input is None:
            return []
        return [{"type": "message", "role": "user", "content": self.input}] if isinstance(self.input, str) \
            else self.input


def _listed(item: dict[str, Any], item_id: str | None) -> dict[str, Any]:
    kind = item.get("type", "message")
    listed = {**item, "type": kind, "id": item_id or f"{_ITEM_ID_PREFIXES.get(kind, 'item')}_{uuid.uuid4().hex}",
              "status": item.get("status") or "completed"}
    if kind == "message":
        content = item.get("content")
        if isinstance(content, str):
            assistant = item.get("role") == "assistant"
            listed["content"] = [_text_part(content, None) if assistant else {"type": "input_text", "text": content}]
        else:  # output text parts carry their annotations and logprobs, as OpenAI lists them
            listed["content"] = [{"annotations": [], "logprobs": [], **part} if part.get("type") == "output_text"
                                 else part for part in content]
    return listed


def _add_item(messages: list[dict[str, Any]], item: dict[str, Any], where: str) -> None:
    kind = item.get("type", "message")
    if kind == "message":
        given = item.get("role")
        role = _ROLES.get(given) if isinstance(given, str) else None
        if role is None:
            raise InvalidRequest(f"{where}.role must be one of {', '.join(_ROLES)}", param=f"{where}.role")
        text = _text(item.get("content"), f"{where}.content")
        last = messages[-1] if messages else None
        if role == "assistant" and last is not None and _thoughts_alone(last):  # its thoughts, then its text
            last["content"] = text
        else:
            messages.append({"role": role, "content": text})
    elif kind == "function_call":
        call = {"id": _string(item, "call_id", where), "type": "function",
                "function": {"name": _string(item, "name", where), "arguments": _string(item, "arguments", where)}}
        last = messages[-1] if messages else None
        if last is not None and last["role"] == "assistant":  # its text, then its calls: one chat message
            last.setdefault("tool_calls", []).append(call)
        else:
            messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
    elif kind == "function_call_output":
        output = item.get("output")
        messages.append({"role": "tool", "tool_call_id": _string(item, "call_id", where),
                         "content": output if isinstance(output, str) else _text(output, f"{where}.output")})
    elif kind == "reasoning":  # an earlier reply's thoughts: its message's reasoning_content, as chat sends them
        parts = item.get("content") if isinstance(item.get("content"), list) else []
        thoughts = "\n".join(part["text"] for part in parts if isinstance(part, dict)
                             and part.get("type") == "reasoning_text" and isinstance(part.get("text"), str))
        if thoughts:
            messages.append({"role": "assistant", "content": "", "reasoning_content": thoughts})
    else:
        raise InvalidRequest(f"{where}: items of type {kind!r} are not supported (message, function_call, "
                             "function_call_output)", param=where)


def _thoughts_alone(message: dict[str, Any]) -> bool:
    """A message made of a reasoning item so far: the reply's text and calls join it."""
    return message["role"] == "assistant" and "reasoning_content" in message and message["content"] == "" and (
        "tool_calls" not in message)


def _text(content: Any, where: str) -> str:
    """A message's content as text: a string, or its text parts joined; other parts (images, files) refused."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise InvalidRequest(f"{where} must be a string or a list of content parts", param=where)
    texts = []
    for part in content:
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in _TEXT_PARTS or not isinstance(part.get("text", part.get("refusal")), str):
            raise InvalidRequest(f"{where}: parts of type {kind!r} are not supported (the models served here read "
                                 "text)", param=where)
        texts.append(part.get("text", part.get("refusal")))
    return "\n".join(texts)


def _string(item: dict[str, Any], key: str, where: str) -> str:
    value = item.get(key)
    if not isinstance(value, str):
        raise InvalidRequest(f"{where}.{key} must be a string", param=f"{where}.{key}")
    return value


def _chat_tool(tool: dict[str, Any], index: int) -> dict[str, Any]:
    if tool.get("type") != "function":
        raise InvalidRequest(f"tools[{index}]: tools of type {tool.get('type')!r} are not supported (function "
                             "tools are)", param=f"tools[{index}]")
    function = {k: tool[k] for k in ("name", "description", "parameters", "strict") if tool.get(k) is not None}
    return {"type": "function", "function": function}


def _chat_tool_choice(choice: str | dict[str, Any]) -> str | dict[str, Any]:
    """The Responses API's ``{"type": "function", "name": ...}`` as chat's (which is taken as it is too)."""
    if isinstance(choice, dict) and choice.get("type") == "function" and "function" not in choice:
        return {"type": "function", "function": {"name": choice.get("name")}}
    return choice


def _response_format(text: dict[str, Any] | None) -> dict[str, Any] | None:
    fmt = (text or {}).get("format")
    if fmt is None:
        return None
    if not isinstance(fmt, dict):
        raise InvalidRequest("text.format must be an object ({\"type\": \"text\" | \"json_object\" | "
                             "\"json_schema\", ...})", param="text.format")
    if fmt.get("type", "text") == "text":
        return None
    if fmt.get("type") == "json_schema":
        schema = {k: fmt[k] for k in ("name", "schema", "strict", "description") if k in fmt}
        return {"type": "json_schema", "json_schema": schema}
    return {"type": fmt.get("type")}  # json_object, or what the chat route refuses by name


# The chat request's fields that the Responses API names otherwise.
# The longest chat name a field begins with is renamed (the later of two that match).
_CHAT_NAMES = {"max_completion_tokens": "max_output_tokens", "messages": "input", "response_format": "text.format",
               "response_format.json_schema": "text.format"}  # the Responses API's format holds its schema itself


_CHAT_TOOL = re.compile(r"^tools(?:\.|\[)(\d+)\]?\.function")


def in_responses_terms(exc: InvalidRequest) -> InvalidRequest:
    """The chat route's error about one of its fields, naming the field as the Responses API spells it (the
    message too, where it begins with the field's name)."""
    param = exc.param or ""
    renamed_param = _CHAT_TOOL.sub(r"tools[\1]", param)
    for chat_name, name in _CHAT_NAMES.items():
        if param == chat_name or param.startswith((f"{chat_name}.", f"{chat_name}[")):
            renamed_param = name + param[len(chat_name):]
    if renamed_param == param:
        return exc
    renamed = copy.copy(exc)
    text = str(exc)
    renamed.args = (renamed_param + text[len(param):] if text.startswith(param) else text,)
    renamed.param = renamed_param
    return renamed


# --- the answer ---------------------------------------------------------------------------------------------
class ResponseShape:
    """The response object of one request, filled from the chat route's answer."""

    def __init__(self, body: ResponsesRequest, model: str, stored: bool, created_at: int | None = None) -> None:
        self.body = body
        self.id = f"resp_{uuid.uuid4().hex}"
        self.model = model
        self.stored = stored  # kept in the response store once finished
        self.created_at = int(time.time()) if created_at is None else created_at  # when the request came

    def object(self, status: str, output: list[dict[str, Any]], usage: dict[str, Any] | None,
               finish_reason: str | None = None) -> dict[str, Any]:
        body, extra = self.body, self.body.model_extra or {}
        incomplete = {"reason": "max_output_tokens"} if finish_reason == "length" else None
        error = {"code": "server_error", "message": "the server stopped the response before it was complete"} \
            if finish_reason == "abort" else None  # shutting down, after its grace period
        return {
            "id": self.id, "object": "response", "created_at": self.created_at, "status": status,
            "model": self.model, "output": output, "usage": usage, "error": error,
            "incomplete_details": incomplete, "instructions": body.instructions,
            "max_output_tokens": body.max_output_tokens, "temperature": extra.get("temperature"),
            "top_p": extra.get("top_p"), "tools": body.tools or [], "tool_choice": body.tool_choice or "auto",
            "parallel_tool_calls": extra.get("parallel_tool_calls", True),
            "text": body.text or {"format": {"type": "text"}}, "previous_response_id": body.previous_response_id,
            "reasoning": None, "truncation": body.truncation or "disabled", "store": self.stored, "metadata": body.metadata or {},
        }

    def finished(self, output: list[dict[str, Any]], chat_usage: dict[str, Any] | None,
                 finish_reason: str | None) -> dict[str, Any]:
        status = {"length": "incomplete", "abort": "failed"}.get(finish_reason or "", "completed")
        return self.object(status, output, _usage(chat_usage), finish_reason)


def _usage(chat: dict[str, Any] | None) -> dict[str, Any] | None:
    if chat is None:
        return None
    cached = (chat.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
    thoughts = (chat.get("completion_tokens_details") or {}).get("reasoning_tokens", 0)
    return {"input_tokens": chat["prompt_tokens"], "input_tokens_details": {"cached_tokens": cached},
            "output_tokens": chat["completion_tokens"], "output_tokens_details": {"reasoning_tokens": thoughts},
            "total_tokens": chat["total_tokens"]}


def _message_item(item_id: str, text: str, logprobs: list[dict[str, Any]] | None, status: str) -> dict[str, Any]:
    return {"type": "message", "id": item_id, "status": status, "role": "assistant",
            "content": [_text_part(text, logprobs)]}


def _reasoning_item(item_id: str, text: str, status: str) -> dict[str, Any]:
    return {"type": "reasoning", "id": item_id, "summary": [], "status": status,
            "content": [{"type": "reasoning_text", "text": text}]}


def _text_part(text: str, logprobs: list[dict[str, Any]] | None) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": logprobs or []}


def _call_item(item_id: str, call_id: str, name: str, arguments: str, status: str) -> dict[str, Any]:
    return {"type": "function_call", "id": item_id, "call_id": call_id, "name": name, "arguments": arguments,
            "status": status}


def _logprobs(chat_logprobs: dict[str, Any] | None) -> list[dict[str, Any]] | None:
    if chat_logprobs is None:
        return None
    return [{"token": t["token"], "logprob": t["logprob"], "bytes": t.get("bytes") or [],
             "top_logprobs": [{"token": top["token"], "logprob": top["logprob"], "bytes": top.get("bytes") or []}
                              for top in t.get("top_logprobs") or []]}
            for t in chat_logprobs.get("content") or []]


def _spelling_start(logprobs: list[dict[str, Any]], text: str) -> list[dict[str, Any]]:
    """The last entries of ``logprobs`` from the first whose tokens, with all after them, spell the start of
    ``text`` (or all of it and what a stop string holds back after it): the answer's, without the tokens that
    closed the thoughts before it."""
    encoded = text.encode()
    for first in range(len(logprobs)):
        spelt = b"".join(bytes(entry.get("bytes") or []) for entry in logprobs[first:])
        common = min(len(spelt), len(encoded))
        if common and spelt[:common] == encoded[:common]:
            return logprobs[first:]
    return []


def _of_text(logprobs: list[dict[str, Any]], text: str) -> list[dict[str, Any]]:
    """The leading entries whose tokens spell the start of ``text`` (by their bytes, which also hold a piece of a
    character): the text's own, without the tool-call markup or the end token that follow it."""
    encoded, end, kept = text.encode(), 0, []
    for entry in logprobs:
        piece = bytes(entry.get("bytes") or [])
        if not piece or encoded[end:end + len(piece)] != piece:
            break
        kept.append(entry)
        end += len(piece)
    return kept


def response_of(shape: ResponseShape, chat: dict[str, Any], want_logprobs: bool) -> dict[str, Any]:
    """The response object of a whole chat completion's JSON: a reasoning model's thoughts as a reasoning item,
    its text as one message item (before the calls, where a stream gives each stretch of text between calls an
    item of its own), then each call."""
    choice = chat["choices"][0]
    message = choice["message"]
    output: list[dict[str, Any]] = []
    if message.get("reasoning_content"):
        output.append(_reasoning_item(f"rs_{uuid.uuid4().hex}", message["reasoning_content"], "completed"))
    if message.get("content"):
        logprobs = None
        if want_logprobs:  # the answer's own: after the thoughts' tokens and the blanks that close them
            entries = _logprobs(choice.get("logprobs")) or []
            thought = ((chat.get("usage") or {}).get("completion_tokens_details") or {}).get("reasoning_tokens", 0)
            logprobs = _of_text(_spelling_start(entries[thought:], message["content"]), message["content"])
        output.append(_message_item(f"msg_{uuid.uuid4().hex}", message["content"], logprobs, "completed"))
    for call in message.get("tool_calls") or []:
        output.append(_call_item(f"fc_{uuid.uuid4().hex}", call["id"], call["function"]["name"],
                                 call["function"]["arguments"], "completed"))
    if output and choice.get("finish_reason") == "length":  # the item the limit cut
        output[-1]["status"] = "incomplete"
    return shape.finished(output, chat.get("usage"), choice.get("finish_reason"))


class ResponseEvents:
    """The Responses API's stream events of a streamed chat completion's chunks. Each output item (the reply's
    text, then each function call) is opened when its first delta comes and closed when the next item opens or
    the stream ends."""

    def __init__(self, shape: ResponseShape, want_logprobs: bool,
                 on_finished: Callable[[dict[str, Any]], None] | None = None) -> None:
        self.shape = shape
        self.want_logprobs = want_logprobs
        self.on_finished = on_finished  # given the final response object before its event is sent
        self.sequence = 0
        self.done: list[dict[str, Any]] = []  # items closed, in output order
        self.open: dict[str, Any] | None = None  # the item being streamed, and its output index
        self.text: list[str] = []
        self.token_logprobs: list[dict[str, Any]] = []
        self.pending_logprobs: list[dict[str, Any]] = []  # come, not yet sent with a text delta
        self.calls: dict[int, dict[str, Any]] = {}  # chat tool-call index -> its function_call item
        self.finish_reason: str | None = None
        self.usage: dict[str, Any] | None = None
        self.thought = False  # a reasoning item came: the answer's first logprobs follow the thoughts' end

    async def events(self, chunks: AsyncIterator[str | bytes]) -> AsyncIterator[str]:
        yield self._event("response.created", response=self.shape.object("in_progress", [], None))
        yield self._event("response.in_progress", response=self.shape.object("in_progress", [], None))
        async for raw in chunks:
            for line in (raw.decode() if isinstance(raw, bytes) else raw).splitlines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line.removeprefix("data: "))
                if "error" in chunk:  # the engine failed mid-stream: said, and the response ends failed
                    error = chunk["error"]
                    yield self._event("error", code=error.get("code"), message=error.get("message"),
                                      param=error.get("param"))
                    for event in self._close(status="incomplete"):
                        yield event
                    failed = self.shape.object("failed", self.done, _usage(self.usage))
                    failed["error"] = {"code": error.get("code") or "server_error", "message": error.get("message")}
                    yield self._final(failed)
                    return
                for event in self._chunk(chunk):
                    yield event
        for event in self._close("incomplete" if self.finish_reason == "length" else "completed"):
            yield event
        yield self._final(self.shape.finished(self.done, self.usage, self.finish_reason))

    def _final(self, response: dict[str, Any]) -> str:
        if self.on_finished is not None:  # stored before the client can read the id and follow it up
            self.on_finished(response)
        return self._event(f"response.{response['status']}", response=response)

    def _chunk(self, chunk: dict[str, Any]) -> list[str]:
        if chunk.get("usage") is not None:
            self.usage = chunk["usage"]
        events: list[str] = []
        for choice in chunk.get("choices") or []:
            delta = choice.get("delta") or {}
            if self.want_logprobs:  # also a chunk's whose text is held back (a stop string, a split character)
                self.pending_logprobs += _logprobs(choice.get("logprobs")) or []
            if delta.get("reasoning_content"):  # a chunk with the answer's start too keeps its logprobs for it
                events += self._reasoning_delta(delta["reasoning_content"], answer_follows=bool(delta.get("content")))
            if delta.get("content"):
                events += self._text_delta(delta["content"])
            for call in delta.get("tool_calls") or []:
                events += self._call_delta(call)
            if choice.get("finish_reason") is not None:
                self.finish_reason = choice["finish_reason"]
        return events

    def _text_delta(self, text: str) -> list[str]:
        events = []
        if self.open is None or self.open["type"] != "message":
            events += self._close()
            self.text, self.token_logprobs = [], []
            self.open = {**_message_item(f"msg_{uuid.uuid4().hex}", "", None, "in_progress"), "content": [],
                         "output_index": len(self.done)}
            events.append(self._event("response.output_item.added", output_index=self.open["output_index"],
                                      item=_public(self.open)))
            events.append(self._event("response.content_part.added", item_id=self.open["id"],
                                      output_index=self.open["output_index"], content_index=0,
                                      part=_text_part("", None)))
        logprobs, self.pending_logprobs = self.pending_logprobs, []
        if self.thought and not self.text:  # the end marker's and the blanks' tokens come before the answer's
            logprobs = _spelling_start(logprobs, text)
        self.text.append(text)
        self.token_logprobs += logprobs
        events.append(self._event("response.output_text.delta", item_id=self.open["id"],
                                  output_index=self.open["output_index"], content_index=0, delta=text,
                                  logprobs=logprobs))
        return events

    def _reasoning_delta(self, text: str, answer_follows: bool = False) -> list[str]:
        events = []
        if self.open is None or self.open["type"] != "reasoning":
            events += self._close()
            self.text = []
            self.open = {**_reasoning_item(f"rs_{uuid.uuid4().hex}", "", "in_progress"), "content": [],
                         "output_index": len(self.done)}
            events.append(self._event("response.output_item.added", output_index=self.open["output_index"],
                                      item=_public(self.open)))
        if not answer_follows:
            self.pending_logprobs = []  # the thoughts': no text's
        self.thought = True
        self.text.append(text)
        events.append(self._event("response.reasoning_text.delta", item_id=self.open["id"],
                                  output_index=self.open["output_index"], content_index=0, delta=text))
        return events

    def _call_delta(self, call: dict[str, Any]) -> list[str]:
        function = call.get("function") or {}
        events = []
        item = self.calls.get(call.get("index", 0))
        if item is None:
            events += self._close()
            self.pending_logprobs = []  # the call's markup: no text's
            item = self.open = self.calls[call.get("index", 0)] = {
                **_call_item(f"fc_{uuid.uuid4().hex}", call.get("id") or f"call_{uuid.uuid4().hex}",
                             function.get("name") or "", "", "in_progress"), "output_index": len(self.done)}
            events.append(self._event("response.output_item.added", output_index=item["output_index"],
                                      item=_public(item)))
        if function.get("arguments"):
            item["arguments"] += function["arguments"]
            events.append(self._event("response.function_call_arguments.delta", item_id=item["id"],
                                      output_index=item["output_index"], delta=function["arguments"]))
        return events

    def _close(self, status: str = "completed") -> list[str]:
        """The open item's closing events (none open: none); ``incomplete`` where a limit or an error cut it."""
        item, self.open = self.open, None
        if item is None:
            return []
        index = item["output_index"]
        if item["type"] == "function_call":
            done = {**_public(item), "status": status}
            self.done.append(done)
            return [self._event("response.function_call_arguments.done", item_id=item["id"], output_index=index,
                                arguments=item["arguments"]),
                    self._event("response.output_item.done", output_index=index, item=done)]
        text = "".join(self.text)
        if item["type"] == "reasoning":
            done = {**_public(item), "status": status, "content": [{"type": "reasoning_text", "text": text}]}
            self.done.append(done)
            return [self._event("response.reasoning_text.done", item_id=item["id"], output_index=index,
                                content_index=0, text=text),
                    self._event("response.output_item.done", output_index=index, item=done)]
        self.token_logprobs = _of_text(self.token_logprobs + self.pending_logprobs, text)
        self.pending_logprobs = []
        part = _text_part(text, self.token_logprobs)
        done = {**_public(item), "status": status, "content": [part]}
        self.done.append(done)
        return [self._event("response.output_text.done", item_id=item["id"], output_index=index, content_index=0,
                            text=text, logprobs=part["logprobs"]),
                self._event("response.content_part.done", item_id=item["id"], output_index=index, content_index=0,
                            part=part),
                self._event("response.output_item.done", output_index=index, item=done)]

    def _event(self, kind: str, **fields: Any) -> str:
        data = {"type": kind, "sequence_number": self.sequence, **fields}
        self.sequence += 1
        return f"event: {kind}\ndata: {json.dumps(data)}\n\n"


def _public(item: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in item.items() if k != "output_index"}
