"""Pythonic tool calls (``[get_weather(city="Paris")]``): the parser, whole and streamed in any split; the grammar
per tool_choice and per parameter schema; values written back as Python literals; names that Python cannot
call refused."""

from __future__ import annotations

import ast
import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvserve.errors import InvalidRequest
from kvserve.structured.pythonic_tools import PythonicToolFormat, python_literal
from kvserve.structured.tool_calls import ToolChoice, ToolSpec
from tests.structured.test_tool_calls import ADD, WEATHER, accepts, llg_tokenizer  # noqa: F401 - a fixture
from tests.structured.test_tool_calls import parse as json_parse

TEXTS = {
    "text only": ("It is sunny in Paris.", "It is sunny in Paris.", []),
    "a call": ('[get_weather(city="Paris")]', "", [("get_weather", '{"city": "Paris"}')]),
    "two calls, brackets and quotes in strings": (
        "[get_weather(city='a)], [b'), add(a=1, b=-2.5e3)]", "",
        [("get_weather", '{"city": "a)], [b"}'), ("add", '{"a": 1, "b": -2500.0}')]),
    "nested values": ('[f(x=[1, {"k": (True, None)}], y="é\\n")]', "", [("f", '{"x": [1, {"k": [true, null]}], "y": "é\\n"}')]),
    "no arguments, text after the list": ("[f()]  Done.", "Done.", [("f", "{}")]),
    "a bracket in text": ("[Note] see f(x)", "[Note] see f(x)", []),
    "a list that is not calls": ("[1, 2]", "[1, 2]", []),
}


def parse(text: str, cuts: list[int] | None = None) -> tuple[str, list[tuple[str, str]], bool]:
    return json_parse(text, cuts, PythonicToolFormat())


@pytest.mark.parametrize("name", list(TEXTS))
def test_the_parser_reads_content_and_calls(name: str) -> None:
    text, content, calls = TEXTS[name]
    assert parse(text) == (content, calls, False)


@settings(max_examples=60, deadline=None)
@given(st.sampled_from(list(TEXTS)), st.lists(st.integers(min_value=1, max_value=60), max_size=10))
def test_streaming_in_any_pieces_gives_what_the_whole_text_gives(name: str, cuts: list[int]) -> None:
    text = TEXTS[name][0]
    assert parse(text, cuts) == parse(text)


@pytest.mark.parametrize("text", [
    "[f(a=1)",  # cut short
    "[f(1)]",  # a positional argument
    "[f(a=x)]",  # a variable, not a literal
    "[f(**kw)]",
    "[f(a=__import__('os'))]",  # nothing is run
])
def test_a_call_that_is_not_a_literal_keyword_call_is_incomplete(text: str) -> None:
    _, _, incomplete = parse(text)
    assert incomplete


JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False) | st.text(),
    lambda children: st.lists(children) | st.dictionaries(st.text(), children), max_leaves=12)


@settings(max_examples=80, deadline=None)
@given(JSON_VALUES)
def test_json_values_are_written_as_python_literals_of_the_same_value(value) -> None:
    assert ast.literal_eval(python_literal(value)) == value


def test_calls_written_back_read_as_they_were() -> None:
    calls = [("get_weather", {"city": "Oslo \"centre\""}), ("add", {"a": 1, "b": [2.5, None, True]})]
    written = PythonicToolFormat().render_calls(calls)
    assert written == '[get_weather(city="Oslo \\"centre\\""), add(a=1, b=[2.5, None, True])]'
    assert parse(written) == ("", [(name, json.dumps(arguments)) for name, arguments in calls], False)


SEARCH = ToolSpec("search", {"type": "object", "properties": {
    "query": {"type": "string"}, "limit": {"type": "integer"}, "exact": {"type": "boolean"},
    "tags": {"type": "array", "items": {"enum": ["a", "b"]}}, "unit": {"type": ["number", "null"]}},
    "required": ["query", "exact"]})


@pytest.mark.parametrize("mode, parallel, text, expected", [
    ("required", True, '[add(a=1, b=2)]', True),
    ("required", True, '[add(a=1, b=2), get_weather(city="Oslo")]', True),
    ("required", False, '[add(a=1, b=2), get_weather(city="Oslo")]', False),
    ("required", True, '[add(a=1)]', False),  # b is required
    ("required", True, '[add(a="1", b=2)]', False),
    ("required", True, '[mul(a=1, b=2)]', False),
    ("required", True, "Just text", False),
    ("function", True, '[add(a=1, b=2)]', True),
    ("function", True, '[get_weather(city="Oslo")]', False),
    ("auto", True, "Just text, no call.", True),
    ("auto", True, "[Note] text", True),
    ("auto", True, '[get_weather(city="Oslo")]', True),
    ("auto", True, "[get_weather(city=1)]", False),  # text never opens like a call
    # a schema's parameters: the required ones, in its order; types, items, type lists
    ("required", True, '[search(query="x", exact=True)]', True),
    ("required", True, "[search(query='x', limit=3, exact=False, tags=[\"a\", \"b\"], unit=None)]", True),
    ("required", True, '[search(query="x", exact=True, unit=2.5)]', True),
    ("required", True, '[search(exact=True, query="x")]', False),
    ("required", True, '[search(query="x")]', False),
    ("required", True, '[search(query="x", exact=true)]', False),  # JSON's spelling
    ("required", True, '[search(query="x", exact=True, tags=["c"])]', False),
    ("required", True, '[search(query="x", limit=1.5, exact=True)]', False),
])
def test_the_grammar_of_each_tool_choice_and_schema(mode: str, parallel: bool, text: str, expected: bool,
                                                    llg_tokenizer) -> None:  # noqa: F811 - the fixture
    choice = ToolChoice(mode, "add" if mode == "function" else None)  # type: ignore[arg-type]
    grammar = PythonicToolFormat().grammar([WEATHER, ADD, SEARCH], choice, parallel)
    assert accepts(grammar, text, llg_tokenizer) is expected


@pytest.mark.parametrize("tool", [
    ToolSpec("get-weather", {"type": "object", "properties": {}}),
    ToolSpec("f", {"type": "object", "properties": {"first-name": {"type": "string"}}}),
    ToolSpec("f", {"type": "object", "properties": {"class": {"type": "string"}}}),
])
def test_names_python_cannot_call_are_a_400(tool: ToolSpec) -> None:
    with pytest.raises(InvalidRequest) as raised:
        PythonicToolFormat().grammar([tool], ToolChoice("required"), True)
    assert raised.value.param == "tools"


NUMBERS = ToolSpec("f", {"type": "object", "properties": {"x": {"type": "number"}, "s": {"type": "string"}},
                         "required": ["x"]})


@pytest.mark.parametrize("text, expected", [
    ("[f(x=12345678901234567890)]", True),  # an integer of any size is JSON
    ("[f(x=-2.5e-12)]", True),
    ("[f(x=1e999)]", False),  # infinity: not JSON
    ("[f(x=" + "9" * 400 + ".0)]", False),
    ('[f(x=1, s="tab\\tquote\\"é\\u00e9\\x41")]', True),
    ('[f(x=1, s="\\ud800")]', False),  # a lone surrogate: no UTF-8 text
    ('[f(x=1, s="\\d")]', False),  # not an escape Python reads
    ('[f(x=1, s="\\N{BULLET}")]', False),
    ('[f(x=1, s="a\rb")]', False),
])
def test_every_value_the_grammar_allows_reads_as_json(text: str, expected: bool,
                                                      llg_tokenizer) -> None:  # noqa: F811 - the fixture
    grammar = PythonicToolFormat().grammar([NUMBERS], ToolChoice("required"), True)
    assert accepts(grammar, text, llg_tokenizer) is expected
    if expected:
        (_, arguments), = parse(text)[1]
        json.loads(arguments)


def test_a_required_parameter_the_schema_does_not_describe_takes_any_value(llg_tokenizer) -> None:  # noqa: F811
    tool = ToolSpec("f", {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a", "b"]})
    grammar = PythonicToolFormat().grammar([tool], ToolChoice("required"), True)
    assert accepts(grammar, '[f(a=1, b=[None, "x"])]', llg_tokenizer)
    assert not accepts(grammar, "[f(a=1)]", llg_tokenizer)


def test_a_reply_opening_with_another_space_character_is_text_not_calls(llg_tokenizer) -> None:  # noqa: F811
    text = "\r[rm(path='/')]"
    assert accepts(PythonicToolFormat().grammar([WEATHER, ADD], ToolChoice("auto"), True), text, llg_tokenizer)
    assert parse(text) == (text, [], False)
