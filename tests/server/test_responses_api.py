"""OpenAI's Responses API (``POST /v1/responses``) through the official client against the shared server: the
answer is the chat route's, as a response object and as the Responses API's stream events."""

from __future__ import annotations

import json

import httpx
import openai
import pytest
from openai.types.responses import ResponseItem
from pydantic import TypeAdapter

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


def test_a_follow_up_continues_the_stored_conversation_as_if_it_were_sent_whole(client, model) -> None:
    """``previous_response_id`` continues the stored response's input and output (its instructions are not
    carried on, as OpenAI has it): the same answer and prompt as the whole conversation sent as input, on the KV
    the first turn left in the prefix cache; chained twice, streamed; each retrievable as it was answered."""
    question = "My name is Ada and I write programs. Say hello to me."
    first = client.responses.create(model=model, instructions="Answer in French.", input=question,
                                    max_output_tokens=12, temperature=0)
    assert first.store is True and first.previous_response_id is None
    follow_up = client.responses.create(model=model, previous_response_id=first.id, input="What is my name?",
                                        max_output_tokens=12, temperature=0)
    whole = client.responses.create(model=model, max_output_tokens=12, temperature=0, store=False, input=[
        {"role": "user", "content": question}, *[item.model_dump() for item in first.output],
        {"role": "user", "content": "What is my name?"}])
    assert follow_up.previous_response_id == first.id
    assert follow_up.output_text == whole.output_text
    assert follow_up.usage.input_tokens == whole.usage.input_tokens > first.usage.input_tokens
    assert whole.usage.input_tokens_details.cached_tokens > 0  # the follow-up's prompt, already computed

    events = list(client.responses.create(model=model, previous_response_id=follow_up.id, stream=True,
                                          input="And what do I do?", max_output_tokens=12, temperature=0))
    final = events[-1].response
    assert final.previous_response_id == follow_up.id and final.store is True
    assert final.usage.input_tokens > follow_up.usage.input_tokens
    assert client.responses.retrieve(final.id).model_dump() == final.model_dump()
    assert client.responses.retrieve(first.id).output_text == first.output_text


def test_stored_responses_list_their_input_items_and_are_deleted(client, model, base_url) -> None:
    turns = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"},
             {"role": "user", "content": "Bye"}]
    response = client.responses.create(model=model, input=turns, max_output_tokens=4, temperature=0)
    listed = client.responses.input_items.list(response.id)
    assert [(item.role, item.content[0].text) for item in listed.data] == [
        (turn["role"], turn["content"]) for turn in reversed(turns)]  # newest first, as OpenAI lists them
    assert all(item.id for item in listed.data) and len({item.id for item in listed.data}) == 3
    # Every kind of item as the openai package's own types hold it (checked strictly, not as the client reads).
    call = {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": "{}"}
    items = [{"role": "user", "content": "Weather?"}, call,
             {"type": "function_call_output", "call_id": "call_1", "output": "Sunny"},
             {"role": "assistant", "content": [{"type": "output_text", "text": "Sunny."}]}]
    with_calls = httpx.post(f"{base_url}/v1/responses", timeout=60, json={
        "input": items, "tools": [WEATHER], "max_output_tokens": 2, "store": None}).json()
    assert with_calls["store"] is True  # null: stored, as OpenAI's default
    page = httpx.get(f"{base_url}/v1/responses/{with_calls['id']}/input_items?order=asc", timeout=30).json()
    assert [item.type for item in TypeAdapter(list[ResponseItem]).validate_python(page["data"])] == [
        "message", "function_call", "function_call_output", "message"]
    # Ids the client gave twice (the listing pages by id): the second one made unique.
    twice = httpx.post(f"{base_url}/v1/responses", timeout=60, json={"max_output_tokens": 2, "input": [
        {"id": "msg_a", "role": "user", "content": "Hi"}, {"id": "msg_a", "role": "user", "content": "Again"}]}).json()
    ids = [item["id"] for item in httpx.get(f"{base_url}/v1/responses/{twice['id']}/input_items?order=asc",
                                            timeout=30).json()["data"]]
    assert ids[0] == "msg_a" and ids[1] != "msg_a"
    page = client.responses.input_items.list(response.id, order="asc", limit=2)
    assert [item.content[0].text for item in page.data] == ["Hi", "Hello!"] and page.has_more
    rest = client.responses.input_items.list(response.id, order="asc", limit=2, after=page.data[-1].id)
    assert [item.content[0].text for item in rest.data] == ["Bye"] and not rest.has_more

    client.responses.delete(response.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(response.id)
    with pytest.raises(openai.BadRequestError) as refused:
        client.responses.create(model=model, previous_response_id=response.id, input="Again?", max_output_tokens=4)
    error = refused.value.body
    assert error["code"] == "previous_response_not_found" and error["param"] == "previous_response_id"
    assert httpx.delete(f"{base_url}/v1/responses/{response.id}", timeout=30).status_code == 404

    unstored = client.responses.create(model=model, input="Hi", max_output_tokens=2, store=False)
    assert unstored.store is False
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unstored.id)


@pytest.mark.parametrize(("fields", "param"), [
    ({"previous_response_id": "resp_1"}, "previous_response_id"),  # never stored
    ({"conversation": "conv_1"}, "conversation"),
    ({"background": True}, "background"),
    ({"priority": 2}, "priority"),  # the shared server's policy is lpm
    ({"truncation": "middle"}, "truncation"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, "input[0].content"),
    ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "input[0]"),
    ({"input": [{"role": "moderator", "content": "hi"}]}, "input[0].role"),
    ({"tools": [{"type": "web_search"}]}, "tools[0]"),
    ({"temperature": "hot"}, "temperature"),
    ({"max_output_tokens": 0}, "max_output_tokens"),
    ({"text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": "strin"}}}}, "text.format.schema"),
])
def test_what_is_not_done_here_is_a_400_naming_the_field(base_url, fields, param) -> None:
    resp = httpx.post(f"{base_url}/v1/responses", json={"input": "Hello", **fields}, timeout=60)
    assert resp.status_code == 400, resp.text
    assert resp.json()["error"]["param"] == param


@pytest.mark.parametrize(("body", "param"), [({"prompt": {"id": "pmpt_1"}}, "prompt"), ({}, "input")])
def test_a_request_without_input_is_a_400_naming_what_it_sent_or_input(base_url, body, param) -> None:
    """A stored prompt in place of input is refused by its own name; nothing at all, as input missing."""
    resp = httpx.post(f"{base_url}/v1/responses", json=body, timeout=60)
    assert resp.status_code == 400 and resp.json()["error"]["param"] == param, resp.text
