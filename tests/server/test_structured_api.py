"""Structured output and tools through the OpenAI client against the shared server (SmolLM2: the grammar
mechanics; tests/e2e/test_tool_calling.py has a model trained on tools)."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from enum import StrEnum
from typing import Literal

import httpx
import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field

from tests.server.conftest import metric_value

MODEL = None  # the shared server's own model


class Colour(StrEnum):
    RED = "red"
    GREEN = "green"
    BLUE = "blue"


class Person(BaseModel):
    name: str = Field(max_length=20)
    age: int = Field(ge=0, le=120)


class Point(BaseModel):
    x: float
    y: float


class Team(BaseModel):
    name: str = Field(max_length=16)
    members: list[Person] = Field(max_length=2)


class Order(BaseModel):
    item: Literal["book", "pen", "lamp"]
    quantity: int = Field(ge=1, le=9)
    gift: bool


class Shape(BaseModel):
    kind: Colour
    corners: int = Field(ge=0, le=8)


class Review(BaseModel):
    stars: int = Field(ge=1, le=5)
    comment: str | None = Field(max_length=30)


class Tags(BaseModel):
    tags: list[Literal["a", "b", "c"]] = Field(max_length=3)


class Address(BaseModel):
    street: str = Field(max_length=20)
    number: int = Field(ge=1, le=999)


class Customer(BaseModel):
    person: Person
    address: Address


class Flag(BaseModel):
    on: bool


class Scores(BaseModel):
    scores: list[int] = Field(max_length=4)


class Temperature(BaseModel):
    celsius: float = Field(ge=-50, le=60)


class Line(BaseModel):
    start: Point
    end: Point


class Choice(BaseModel):
    answer: Literal["yes", "no"]


class Pair(BaseModel):
    left: str = Field(max_length=8)
    right: str = Field(max_length=8)


class Book(BaseModel):
    title: str = Field(max_length=24)
    year: int = Field(ge=1400, le=2030)
    genre: Literal["novel", "poetry", "essay"]


class Step(BaseModel):
    number: int = Field(ge=1, le=9)
    action: str = Field(max_length=16)


class Plan(BaseModel):
    steps: list[Step] = Field(max_length=2)


class Maybe(BaseModel):
    value: int | None = Field(ge=0, le=9)


class Weather(BaseModel):
    city: str = Field(max_length=16)
    colour: Colour
    wind: float = Field(ge=0, le=40)


MODELS = [Person, Point, Team, Order, Shape, Review, Tags, Address, Customer, Flag, Scores, Temperature, Line,
          Choice, Pair, Book, Plan, Maybe, Weather, Step]
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "The weather in a city",
                                      "parameters": {"type": "object", "properties": {
                                          "city": {"type": "string", "maxLength": 20},
                                          "unit": {"enum": ["celsius", "fahrenheit"]}},
                                          "required": ["city", "unit"], "additionalProperties": False}}},
    {"type": "function", "function": {"name": "add", "description": "Add two integers",
                                      "parameters": {"type": "object", "properties": {
                                          "a": {"type": "integer", "minimum": -999, "maximum": 999},
                                          "b": {"type": "integer", "minimum": -999, "maximum": 999}},
                                          "required": ["a", "b"], "additionalProperties": False}}},
]


@pytest.fixture
def client(base_url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0)


def ask(model: type[BaseModel]) -> list[dict[str, str]]:
    return [{"role": "user", "content": f"Give me an example of a {model.__name__} as JSON."}]


def parse_one(client: openai.OpenAI, model: type[BaseModel], stream: bool) -> BaseModel:
    options = {"model": MODEL, "messages": ask(model), "response_format": model, "max_tokens": 120,
               "temperature": 0.0}
    if not stream:
        reply = client.chat.completions.parse(**options)
        assert reply.choices[0].finish_reason == "stop"
        parsed = reply.choices[0].message.parsed
    else:
        with client.chat.completions.stream(**options) as events:
            final = events.get_final_completion()
        assert final.choices[0].finish_reason == "stop"
        parsed = final.choices[0].message.parsed
    assert isinstance(parsed, model)
    return parsed


# Streamed, the twenty run in `pytest -m heavy`: CI streams constrained output in the tests below.
@pytest.mark.parametrize("stream", [False, pytest.param(True, marks=pytest.mark.heavy)])
def test_parse_returns_objects_for_twenty_schemas(client: openai.OpenAI, base_url: str, stream: bool) -> None:
    with ThreadPoolExecutor(len(MODELS)) as pool:
        parsed = list(pool.map(lambda m: parse_one(client, m, stream), MODELS))
    assert [type(p) for p in parsed] == MODELS
    # Those with a length-bounded string (Person, Team, Review...) were on xgrammar, the rest on llguidance.
    assert metric_value(base_url, "kvserve:grammar_xgrammar_compiles_total") >= 5


def test_json_object_regex_choice_and_grammar(client: openai.OpenAI, base_url: str) -> None:
    reply = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": 'Reply with {"ok": true} and nothing else.'}],
        max_tokens=60, temperature=0, response_format={"type": "json_object"})
    assert reply.choices[0].finish_reason == "stop"
    assert isinstance(json.loads(reply.choices[0].message.content), dict)
    date = client.completions.create(model=MODEL, prompt="Today's date:", max_tokens=12, temperature=0,
                                     extra_body={"guided_regex": r"20[0-9]{2}-[01][0-9]-[0-3][0-9]"})
    assert len(date.choices[0].text) == 10 and date.choices[0].finish_reason == "stop"
    pick = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Cat or dog?"}],
                                          max_tokens=5, temperature=0.7, seed=1,
                                          extra_body={"structured_outputs": {"choice": ["cat", "dog"]}})
    assert pick.choices[0].message.content in ("cat", "dog")
    gbnf = client.completions.create(model=MODEL, prompt="Answer:", max_tokens=5, temperature=0,
                                     extra_body={"guided_grammar": 'root ::= "yes" | "no"'})
    assert gbnf.choices[0].text in ("yes", "no")
    assert metric_value(base_url, "kvserve:grammar_compiles_total") >= 3
    assert metric_value(base_url, "kvserve:grammar_constrained_tokens_total") > 0


def validates(call: object, tools: list[dict]) -> None:
    function = call.function  # type: ignore[attr-defined]
    schema = next(t["function"]["parameters"] for t in tools if t["function"]["name"] == function.name)
    jsonschema.validate(json.loads(function.arguments), schema)


def test_required_and_named_tool_choice_always_call_valid_tools(client: openai.OpenAI) -> None:
    """SmolLM2's template has no tools: they go into its system message; the grammar enforces the calls."""
    def call(seed: int):
        choice = "required" if seed % 2 else {"type": "function", "function": {"name": "add"}}
        return seed, client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "What is 3 plus 4?"}], tools=TOOLS,
            tool_choice=choice, temperature=1.0, seed=seed, max_tokens=80, parallel_tool_calls=seed % 4 == 1)

    with ThreadPoolExecutor(16) as pool:
        replies = list(pool.map(call, range(16)))
    for seed, reply in replies:
        choice = reply.choices[0]
        # required: tool_calls; a function forced by name: stop (as OpenAI and vLLM finish it)
        assert choice.finish_reason in ("tool_calls" if seed % 2 else "stop", "length"), choice
        if choice.finish_reason == "length":
            continue  # a sampled reply may run out of tokens mid-call
        assert choice.message.tool_calls
        for tool_call in choice.message.tool_calls:
            assert tool_call.id.startswith("call_") and tool_call.type == "function"
            validates(tool_call, TOOLS)
            if seed % 2 == 0:
                assert tool_call.function.name == "add"
    assert sum(r.choices[0].finish_reason in ("tool_calls", "stop") for _, r in replies) >= 12


def test_a_streamed_call_arrives_header_first_then_arguments(client: openai.OpenAI) -> None:
    stream = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Weather in Oslo?"}], tools=TOOLS,
        tool_choice={"type": "function", "function": {"name": "get_weather"}}, temperature=0, max_tokens=60,
        stream=True, parallel_tool_calls=False)
    chunks = [c for c in stream if c.choices]
    calls = [d for c in chunks for d in (c.choices[0].delta.tool_calls or [])]
    assert calls[0].id and calls[0].function.name == "get_weather" and calls[0].index == 0
    assert all(d.id is None and d.function.name is None for d in calls[1:])
    arguments = "".join(d.function.arguments or "" for d in calls)
    jsonschema.validate(json.loads(arguments), TOOLS[0]["function"]["parameters"])
    assert not any(c.choices[0].delta.content for c in chunks)  # no tag ever leaks as content
    assert chunks[-1].choices[0].finish_reason == "stop"  # a named function, forced: OpenAI's and vLLM's finish


def test_tool_results_render_and_a_final_answer_follows(client: openai.OpenAI) -> None:
    first = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "What is 3 plus 4?"}], tools=TOOLS,
        tool_choice={"type": "function", "function": {"name": "add"}}, temperature=0, max_tokens=60)
    assert first.choices[0].finish_reason == "stop", first.choices[0]  # forced by name: as OpenAI, not tool_calls
    call = first.choices[0].message.tool_calls[0]
    messages = [{"role": "user", "content": "What is 3 plus 4?"}, first.choices[0].message.model_dump(),
                {"role": "tool", "tool_call_id": call.id, "content": "7"}]
    final = client.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS, tool_choice="none",
                                           temperature=0, max_tokens=30)
    assert final.choices[0].message.content and not final.choices[0].message.tool_calls


def test_tools_beside_a_response_format_give_calls_or_the_formats_json(client: openai.OpenAI) -> None:
    """As OpenAI's API combines them: the model calls a tool or answers in the format, never in free text."""
    for question in ("What is the weather in Paris?", "Say hello."):
        reply = client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": question}], tools=TOOLS, temperature=0,
            max_tokens=80, response_format={"type": "json_object"}, parallel_tool_calls=False)
        message = reply.choices[0].message
        if message.tool_calls:
            assert reply.choices[0].finish_reason == "tool_calls" and not message.content
            assert all(isinstance(json.loads(call.function.arguments), dict) for call in message.tool_calls)
        else:
            assert reply.choices[0].finish_reason == "stop" and isinstance(json.loads(message.content), dict)


BAD = [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "strin"}}}},
     "response_format.json_schema.schema"),
    ({"guided_regex": "(unclosed"}, "guided_regex"),
    ({"guided_regex": r"[^\s\S]"}, "guided_regex"),  # matches nothing
    ({"guided_grammar": "start: missing_rule"}, "guided_grammar"),
    ({"guided_json": "{not json"}, "guided_json"),
    ({"guided_regex": "a+", "guided_choice": ["a"]}, "guided_choice"),  # two constraints at once
    ({"structured_outputs": {"xml": "<a/>"}}, "structured_outputs"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "not_offered"}}}, "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),  # no tools
    ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": 5}}}]},
     "tools[0].function.parameters"),
    ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]}, "tools[0].function.name"),
    ({"tools": [TOOLS[0], TOOLS[0]]}, "tools[1].function.name"),
    ({"tools": TOOLS, "guided_regex": "a+"}, "guided_regex"),  # beside tools, only a JSON object's format
    ({"tools": TOOLS, "guided_regex": "a+", "tool_choice": "required"}, "guided_regex"),
    # a schema the grammar engine cannot compile, beside tools: named for its own field
    ({"tools": TOOLS, "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "object", "properties": {"a": {"type": "string", "pattern": "(?<=x)a"}}}}}},
     "response_format.json_schema.schema"),
    ({"tools": TOOLS, "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "array"}}}}, "response_format.json_schema.schema"),
    # under required, where the reply is calls, a format that cannot compile is still refused
    ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "object", "properties": {"a": {"type": "string", "pattern": "(?<=x)a"}}}}}},
     "response_format.json_schema.schema"),
    ({"guided_choice": ["a", "b"], "ignore_eos": True}, "ignore_eos"),
]


@pytest.mark.parametrize(("fields", "param"), BAD)
def test_a_constraint_that_cannot_be_honoured_is_a_400_naming_the_field(base_url: str, fields: dict,
                                                                       param: str) -> None:
    body = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4, **fields}
    response = httpx.post(f"{base_url}/v1/chat/completions", json=body, timeout=60)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and error["type"] == "invalid_request_error", error


def test_recursive_and_wide_schemas_compile_and_hold(client: openai.OpenAI) -> None:
    tree = {"$defs": {"node": {"type": "object", "properties": {
        "value": {"type": "integer", "minimum": 0, "maximum": 9},
        "children": {"type": "array", "items": {"$ref": "#/$defs/node"}, "maxItems": 2}},
        "required": ["value", "children"], "additionalProperties": False}}, "$ref": "#/$defs/node"}
    wide = {"type": "object", "properties": {f"p{i}": {"type": "integer"} for i in range(1000)}}
    for schema in (tree, wide):
        reply = client.chat.completions.create(
            model=MODEL, messages=ask(Person), max_tokens=40, temperature=0,
            response_format={"type": "json_schema", "json_schema": {"name": "s", "schema": schema}})
        choice = reply.choices[0]
        if choice.finish_reason == "stop":
            jsonschema.validate(json.loads(choice.message.content), schema)
        else:
            assert choice.finish_reason == "length"
