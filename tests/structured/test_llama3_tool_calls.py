"""Llama 3's JSON tool calls (``{"name": ..., "parameters": ...}``): the parser, whole and streamed in any
split, the grammars per tool_choice, and the format chosen from the chat template."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvserve.structured.tool_calls import HermesToolFormat, ToolChoice
from kvserve.structured.tool_format_choice import tool_format_for
from kvserve.structured.tool_formats import Llama3JsonToolFormat
from tests.structured.test_tool_calls import ADD, WEATHER, accepts, llg_tokenizer  # noqa: F401 - a fixture
from tests.structured.test_tool_calls import parse as hermes_parse

LLAMA3_TEMPLATE_LINE = ('Respond in the format {"name": function name, "parameters": dictionary of argument name and '
                        'its value}. Do not use variables.')


def parse(text: str, cuts: list[int] | None = None) -> tuple[str, list[tuple[str, str]], bool]:
    return hermes_parse(text, cuts, Llama3JsonToolFormat())


TEXTS = {
    "text only": ("The sum is 3.", "The sum is 3.", []),
    "a call": ('{"name": "add", "parameters": {"a": 1, "b": 2}}', "", [("add", '{"a": 1, "b": 2}')]),
    "after the python tag": ('<|python_tag|>{"name": "get_weather", "parameters": {"city": "Oslo"}}', "",
                             [("get_weather", '{"city": "Oslo"}')]),
    "two calls joined by ;": ('{"name": "add", "parameters": {"a": 1, "b": 2}}; {"name": "get_weather", '
                              '"parameters": {"city": "a;b}"}}', "",
                              [("add", '{"a": 1, "b": 2}'), ("get_weather", '{"city": "a;b}"}')]),
    "a brace in text": ("Use {x} here.", "Use {x} here.", []),
    # a call opens the reply or nothing: the tag spelt inside text is text
    "the tag inside text": ('Sure. <|python_tag|>{"name": "rm", "parameters": {}}',
                            'Sure. <|python_tag|>{"name": "rm", "parameters": {}}', []),
}


@pytest.mark.parametrize("name", list(TEXTS))
def test_the_parser_reads_content_and_calls(name: str) -> None:
    text, content, calls = TEXTS[name]
    assert parse(text) == (content, calls, False)


@settings(max_examples=60, deadline=None)
@given(st.sampled_from(list(TEXTS)),
       st.lists(st.integers(min_value=1, max_value=120), max_size=10))
def test_streaming_in_any_pieces_gives_what_the_whole_text_gives(name: str, cuts: list[int]) -> None:
    text = TEXTS[name][0]
    assert parse(text, cuts) == parse(text)


CALL = '{"name": "add", "parameters": {"a": 1, "b": 2}}'
OTHER = '{"name": "get_weather", "parameters": {"city": "Oslo"}}'


@pytest.mark.parametrize("mode, parallel, text, expected", [
    ("required", True, CALL, True),
    ("required", True, f"{CALL}; {OTHER}", True),
    ("required", False, f"{CALL}; {OTHER}", False),
    ("required", True, '{"name": "add", "arguments": {"a": 1, "b": 2}}', False),  # hermes's key
    ("required", True, "Just text", False),
    ("function", True, CALL, True),
    ("function", True, OTHER, False),
    ("auto", True, "Just text, no call.", True),
    ("auto", True, CALL, True),
    ("auto", True, '{"name": "add", "parameters": {"a": 1}}', False),
    ("auto", True, f"Sure. <|python_tag|>{CALL}", False),  # no call out of text, not even through the tag
    ("auto", True, "<|python_tag|>hello", False),
])
def test_the_grammar_of_each_tool_choice(mode: str, parallel: bool, text: str, expected: bool,
                                         llg_tokenizer) -> None:  # noqa: F811 - the fixture
    choice = ToolChoice(mode, "add" if mode == "function" else None)  # type: ignore[arg-type]
    grammar = Llama3JsonToolFormat().grammar([WEATHER, ADD], choice, parallel)
    assert accepts(grammar, text, llg_tokenizer) is expected


def test_the_format_comes_from_the_template() -> None:
    def never(tag: str) -> int | None:
        return None

    assert isinstance(tool_format_for("auto", "{{ x }} " + LLAMA3_TEMPLATE_LINE, never), Llama3JsonToolFormat)
    hermes = tool_format_for("auto", "{% if tools %}<tool_call>{% endif %}", lambda tag: 7)
    assert isinstance(hermes, HermesToolFormat) and hermes.special_tags
    assert isinstance(tool_format_for("auto", None, never), HermesToolFormat)
    llama = tool_format_for("llama3_json", None, lambda tag: 7 if tag == "<|python_tag|>" else None)
    assert isinstance(llama, Llama3JsonToolFormat) and llama.special_tag
    assert isinstance(tool_format_for("hermes", LLAMA3_TEMPLATE_LINE, never), HermesToolFormat)
    rendered = Llama3JsonToolFormat().render_calls([("add", {"a": 1}), ("f", {})])
    assert [json.loads(call) for call in rendered.split("; ")] == [{"name": "add", "parameters": {"a": 1}},
                                                                  {"name": "f", "parameters": {}}]
