"""OpenAI's Responses API (``POST /v1/responses``) through the official client against the shared server: the
answer is the chat route's, as a response object and as the Responses API's stream events."""

from __future__ import annotations

import json

import httpx
import openai
import pytest

from tests.server.conftest import chat

WEATHER = {"type": "function", "name": "get_weather", "description": "The weather in a city.",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}


@pytest.fixture(scope="module")
def client(base_url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def model(client: openai.OpenAI) -> str:
    return client.models.list().data[0].id


def test_a_response_is_the_chat_reply_whole_and_streamed(client, model) -> None:
    question = "What is the capital of France?"
    reply = client.chat.completions.create(model=model, messages=[{"role": "system", "content": "Be brief."},
                                                                   *chat(question)], max_tokens=12, temperature=0)
    response = client.responses.create(model=model, instructions="Be brief.", input=question, max_output_tokens=12,
                                       temperature=0)
    assert response.object == "response" and response.id.startswith("resp_") and response.model == model
    assert response.output_text == reply.choices[0].message.content
    assert [item.type for item in response.output] == ["message"]
    assert response.usage.input_tokens == reply.usage.prompt_tokens
    assert response.usage.output_tokens == reply.usage.completion_tokens
    assert response.status == ("incomplete" if reply.choices[0].finish_reason == "length" else "completed")

    events = list(client.responses.create(model=model, instructions="Be brief.", input=question,
                                          max_output_tokens=12, temperature=0, stream=True))
    kinds = [event.type for event in events]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert kinds[-4:-1] == ["response.output_text.done", "response.content_part.done", "response.output_item.done"]
    assert kinds[-1] == f"response.{response.status}"
    assert [event.sequence_number for event in events] == list(range(len(events)))
    deltas = "".join(event.delta for event in events if event.type == "response.output_text.delta")
    assert deltas == response.output_text == events[-1].response.output_text
    assert events[-1].response.usage.output_tokens == response.usage.output_tokens
    # The text's logprobs, where include asks for them: the chat reply's, token for token.
    with_logprobs = client.responses.create(model=model, instructions="Be brief.", input=question, temperature=0,
                                            max_output_tokens=12, top_logprobs=2,
                                            include=["message.output_text.logprobs"])
    scored = with_logprobs.output[0].content[0].logprobs
    assert all(len(t.top_logprobs) == 2 for t in scored)
    assert "".join(t.token for t in scored) == response.output_text  # the end token left out, as OpenAI does


def test_the_output_limit_makes_an_incomplete_response(client, model) -> None:
    response = client.responses.create(model=model, input="Tell me a long story about a dragon.",
                                       max_output_tokens=3, temperature=0)
    assert response.status == "incomplete" and response.incomplete_details.reason == "max_output_tokens"
    assert response.usage.output_tokens == 3


def test_function_calls_and_their_outputs_go_round(client, model) -> None:
    """A forced call comes back as a function_call item (whole and streamed); the call and its output, sent
    back as input items, make the next turn of the conversation."""
    asked = client.responses.create(model=model, input="What is the weather in Paris?", tools=[WEATHER],
                                    tool_choice="required", temperature=0, max_output_tokens=60)
    calls = [item for item in asked.output if item.type == "function_call"]
    assert calls and calls[0].name == "get_weather" and calls[0].call_id
    assert isinstance(json.loads(calls[0].arguments)["city"], str)
    events = list(client.responses.create(model=model, input="What is the weather in Paris?", tools=[WEATHER],
                                          tool_choice="required", temperature=0, max_output_tokens=60, stream=True))
    streamed = [event.item for event in events if event.type == "response.output_item.done"]
    assert [(item.type, item.name, item.arguments) for item in streamed if item.type == "function_call"] == [
        (c.type, c.name, c.arguments) for c in calls]
    arguments = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    assert arguments == "".join(c.arguments for c in calls)

    follow_up = client.responses.create(
        model=model, tools=[WEATHER], temperature=0, max_output_tokens=8,
        input=[{"role": "user", "content": "What is the weather in Paris?"},
               {"type": "function_call", "call_id": calls[0].call_id, "name": "get_weather",
                "arguments": calls[0].arguments},
               {"type": "function_call_output", "call_id": calls[0].call_id, "output": "Sunny, 24 C"}])
    assert follow_up.status in ("completed", "incomplete") and follow_up.usage.input_tokens > asked.usage.input_tokens


def test_a_json_schema_format_constrains_the_text(client, model) -> None:
    schema = {"type": "object", "properties": {"answer": {"type": "integer"}}, "required": ["answer"],
              "additionalProperties": False}
    response = client.responses.create(model=model, input="What is 2 + 2?", temperature=0, max_output_tokens=40,
                                       text={"format": {"type": "json_schema", "name": "sum", "schema": schema}})
    assert isinstance(json.loads(response.output_text)["answer"], int)


@pytest.mark.parametrize(("fields", "param"), [
    ({"previous_response_id": "resp_1"}, "previous_response_id"),  # nothing is stored
    ({"truncation": "auto"}, "truncation"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, "input[0].content"),
    ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "input[0]"),
    ({"input": [{"role": "moderator", "content": "hi"}]}, "input[0].role"),
    ({"tools": [{"type": "web_search"}]}, "tools[0]"),
    ({"temperature": "hot"}, "temperature"),
    ({"max_output_tokens": 0}, "max_output_tokens"),
])
def test_what_is_not_done_here_is_a_400_naming_the_field(base_url, fields, param) -> None:
    resp = httpx.post(f"{base_url}/v1/responses", json={"input": "Hello", **fields}, timeout=60)
    assert resp.status_code == 400, resp.text
    assert resp.json()["error"]["param"] == param
