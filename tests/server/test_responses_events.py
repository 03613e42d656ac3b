"""The Responses API's layer over the chat route, on made-up chat answers: input items as chat messages, and
chat chunks as the Responses API's stream events (text around calls, logprobs of held-back text, a limit, an
error mid-stream)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

import pytest

from kvserve.errors import InvalidRequest
from kvserve.server.responses_api import ResponseEvents, ResponseShape, ResponsesRequest, in_responses_terms


def request(**fields: Any) -> ResponsesRequest:
    return ResponsesRequest.model_validate({"input": "hi", **fields})


def test_input_items_become_the_chat_conversation() -> None:
    chat = request(instructions="Be brief.", input=[
        {"role": "developer", "content": "Answer in French."},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Weather?"}]},
        {"type": "message", "id": "msg_1", "status": "completed", "role": "assistant",
         "content": [{"type": "output_text", "text": "Let me look.", "annotations": []}]},
        {"type": "function_call", "id": "fc_1", "status": "completed", "call_id": "c1", "name": "w", "arguments": "{}"},
        {"type": "function_call", "call_id": "c2", "name": "w", "arguments": "{\"x\": 1}"},
        {"type": "reasoning", "id": "rs_1", "summary": []},
        {"type": "function_call_output", "call_id": "c1", "output": [{"type": "input_text", "text": "Sunny"}]},
        {"type": "function_call_output", "call_id": "c2", "output": "Rain"}]).chat_request()
    assert chat.message_dicts() == [
        {"role": "system", "content": "Be brief."}, {"role": "system", "content": "Answer in French."},
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": "Let me look.", "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "w", "arguments": "{}"}},
            {"id": "c2", "type": "function", "function": {"name": "w", "arguments": "{\"x\": 1}"}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "Sunny"}, {"role": "tool", "tool_call_id": "c2",
                                                                      "content": "Rain"}]


@pytest.mark.parametrize(("fields", "param"), [
    ({"input": [{"role": ["user"], "content": "hi"}]}, "input[0].role"),
    ({"input": ["hi"]}, "input[0]"),
    ({"input": [{"role": "user", "content": None}]}, "input[0].content"),
    ({"conversation": "conv_1"}, "conversation"),
    ({"prompt": {"id": "pmpt_1"}}, "prompt"),
    ({"background": True}, "background"),
    ({"text": {"format": "json"}}, "text.format"),
    ({"tools": [{"type": "function", "parameters": {}}]}, "tools[0].name"),
])
def test_what_the_layer_cannot_answer_is_refused_by_name(fields: dict[str, Any], param: str) -> None:
    with pytest.raises(InvalidRequest) as info:
        request(**fields).chat_request()
    assert in_responses_terms(info.value).param == param


def test_chat_errors_name_the_responses_fields() -> None:
    error = in_responses_terms(InvalidRequest("max_completion_tokens must be >= 1", "max_completion_tokens"))
    assert (error.param, str(error)) == ("max_output_tokens", "max_output_tokens must be >= 1")
    prose = in_responses_terms(InvalidRequest("the chat template cannot render these messages", "messages"))
    assert (prose.param, str(prose)) == ("input", "the chat template cannot render these messages")
    # the Responses API's format holds its name and schema itself
    assert in_responses_terms(InvalidRequest("x", "response_format.json_schema")).param == "text.format"
    assert in_responses_terms(InvalidRequest("x", "response_format.json_schema.schema")).param == "text.format.schema"
    assert in_responses_terms(InvalidRequest("x", "response_format")).param == "text.format"


def chunk(content: str | None = None, calls: list[dict[str, Any]] | None = None, finish: str | None = None,
          logprobs: list[str] | None = None) -> str:
    delta = {k: v for k, v in (("content", content), ("tool_calls", calls)) if v is not None}
    choice = {"index": 0, "delta": delta, "finish_reason": finish,
              "logprobs": None if logprobs is None else {"content": [
                  {"token": t, "logprob": -0.5, "bytes": list(t.encode()), "top_logprobs": []} for t in logprobs]}}
    return f"data: {json.dumps({'choices': [choice]})}\n\n"


USAGE = "data: " + json.dumps({"choices": [], "usage": {"prompt_tokens": 5, "completion_tokens": 7,
                                                          "total_tokens": 12}}) + "\n\n"


def events_of(chunks: list[str], want_logprobs: bool = False) -> list[dict[str, Any]]:
    async def source() -> AsyncIterator[str]:
        for c in chunks:
            yield c

    async def collect() -> list[str]:
        shape = ResponseShape(request(), "m", stored=False)
        return [e async for e in ResponseEvents(shape, want_logprobs).events(source())]

    parsed = []
    for raw in asyncio.run(collect()):
        kind, data = raw.strip().split("\n")
        event = json.loads(data.removeprefix("data: "))
        assert kind == f"event: {event['type']}"
        parsed.append(event)
    assert [e["sequence_number"] for e in parsed] == list(range(len(parsed)))
    return parsed


def test_text_around_calls_opens_an_item_each_in_output_order() -> None:
    call = {"index": 0, "id": "c1", "type": "function", "function": {"name": "w", "arguments": "{\"a\""}}
    more = {"index": 0, "function": {"arguments": ": 1}"}}
    second = {"index": 1, "id": "c2", "type": "function", "function": {"name": "v", "arguments": "{}"}}
    events = events_of([chunk("Sure."), chunk(calls=[call]), chunk(calls=[more]), chunk(calls=[second]),
                        chunk("Done", finish="stop"), USAGE, "data: [DONE]\n\n"])
    added = [(e["output_index"], e["item"]["type"]) for e in events if e["type"] == "response.output_item.added"]
    assert added == [(0, "message"), (1, "function_call"), (2, "function_call"), (3, "message")]
    final = events[-1]["response"]
    assert events[-1]["type"] == "response.completed" and final["usage"]["output_tokens"] == 7
    assert [(i["type"], i.get("arguments")) for i in final["output"]] == [
        ("message", None), ("function_call", "{\"a\": 1}"), ("function_call", "{}"), ("message", None)]
    assert [i["content"][0]["text"] for i in final["output"] if i["type"] == "message"] == ["Sure.", "Done"]
    deltas = [e["delta"] for e in events if e["type"] == "response.function_call_arguments.delta"]
    assert deltas == ["{\"a\"", ": 1}", "{}"]


def test_logprobs_of_held_back_text_reach_the_next_delta_and_a_limit_makes_it_incomplete() -> None:
    events = events_of([chunk("He", logprobs=["He"]), chunk(None, logprobs=["l"]), chunk("llo", logprobs=["lo"]),
                        chunk(None, finish="length", logprobs=["!"]), USAGE], want_logprobs=True)
    deltas = [[t["token"] for t in e["logprobs"]] for e in events if e["type"] == "response.output_text.delta"]
    assert deltas == [["He"], ["l", "lo"]]
    done = next(e for e in events if e["type"] == "response.output_text.done")
    # A token that never became text (an end token, a stop string cut off) is left out, as OpenAI leaves it.
    assert [t["token"] for t in done["logprobs"]] == ["He", "l", "lo"] and done["text"] == "Hello"
    final = events[-1]
    assert final["type"] == "response.incomplete"
    assert final["response"]["incomplete_details"] == {"reason": "max_output_tokens"}
    assert final["response"]["output"][0]["status"] == "incomplete"


def test_an_error_mid_stream_ends_the_response_failed_with_what_came_before() -> None:
    error = "data: " + json.dumps({"error": {"message": "engine died", "type": "internal_error", "param": None,
                                             "code": "engine_dead"}}) + "\n\n"
    events = events_of([chunk("Partial"), error])
    assert [e["type"] for e in events][-5:] == ["error", "response.output_text.done", "response.content_part.done",
                                                "response.output_item.done", "response.failed"]
    failed = events[-1]["response"]
    assert failed["status"] == "failed" and failed["error"]["code"] == "engine_dead"
    assert failed["output"][0]["content"][0]["text"] == "Partial"
    deltas = [e for e in events if e["type"] == "response.output_text.delta"]
    assert all(e["logprobs"] == [] for e in deltas)  # always there, as the SDK's types require


def test_a_calls_markup_is_not_in_the_texts_logprobs() -> None:
    call = {"index": 0, "id": "c1", "type": "function", "function": {"name": "w", "arguments": "{}"}}
    events = events_of([chunk("Sure.", logprobs=["Sure", "."]), chunk(calls=[call], logprobs=["<tool_call>", "{"]),
                        chunk(None, finish="stop", logprobs=["}"]), USAGE], want_logprobs=True)
    done = next(e for e in events if e["type"] == "response.output_text.done")
    assert [t["token"] for t in done["logprobs"]] == ["Sure", "."]
