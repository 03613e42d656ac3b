"""Qwen3-Coder's XML tool calls (``<function=name>`` with ``<parameter=name>`` blocks): the parser, whole and
streamed in any split, strings as written and other values as JSON; the grammar per tool_choice and per
parameter schema; the format chosen from the template."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvserve.structured.tool_calls import ToolChoice, ToolSpec
from kvserve.structured.tool_format_choice import tool_format_for
from kvserve.structured.xml_tools import XmlToolFormat
from tests.structured.test_tool_calls import ADD, WEATHER, accepts, llg_tokenizer  # noqa: F401 - a fixture
from tests.structured.test_tool_calls import parse as json_parse

WRITE = ToolSpec("write_file", {"type": "object", "properties": {
    "path": {"type": "string"}, "content": {"type": "string"}, "mode": {"enum": ["w", "a"]},
    "lines": {"type": "array", "items": {"type": "integer"}}, "force": {"type": "boolean"}},
    "required": ["path", "content"]})
FORMAT = XmlToolFormat(special_tags=False).for_tools([WEATHER, ADD, WRITE])


def call(name: str, **values: str) -> str:
    blocks = "".join(f"<parameter={key}>\n{value}\n</parameter>\n" for key, value in values.items())
    return f"<tool_call>\n<function={name}>\n{blocks}</function>\n</tool_call>"


CODE = 'def f(x):\n    return "<tag>" + x\n'
TEXTS = {
    "text only": ("I can answer that directly.", "I can answer that directly.", []),
    "a call": (call("add", a="1", b="2"), "", [("add", '{"a": 1, "b": 2}')]),
    "text, then two calls, code as written": (
        "Let me write it.\n" + call("write_file", path="f.py", content=CODE, lines="[1, 2]", force="true") + "\n"
        + call("get_weather", city="Oslo"),
        "Let me write it.",
        [("write_file", json.dumps({"path": "f.py", "content": CODE, "lines": [1, 2], "force": True})),
         ("get_weather", '{"city": "Oslo"}')]),
    "no parameters": ("<tool_call>\n<function=get_weather>\n</function>\n</tool_call>", "", [("get_weather", "{}")]),
    "an empty string": (call("get_weather", city=""), "", [("get_weather", '{"city": ""}')]),
    "the start of a tag that never comes": ("a <tool and <tool_cal", "a <tool and <tool_cal", []),
}


def parse(text: str, cuts: list[int] | None = None, fmt: XmlToolFormat = FORMAT):
    return json_parse(text, cuts, fmt)


@pytest.mark.parametrize("name", list(TEXTS))
def test_the_parser_reads_content_and_calls(name: str) -> None:
    text, content, calls = TEXTS[name]
    assert parse(text) == (content, calls, False)


@settings(max_examples=80, deadline=None)
@given(st.sampled_from(list(TEXTS)), st.lists(st.integers(min_value=1, max_value=200), max_size=12))
def test_streaming_in_any_pieces_gives_what_the_whole_text_gives(name: str, cuts: list[int]) -> None:
    text = TEXTS[name][0]
    assert parse(text, cuts) == parse(text)


def test_a_call_cut_short_is_incomplete_and_its_arguments_so_far_are_json_prefixes() -> None:
    content, calls, incomplete = parse(call("add", a="1", b="2")[:-40])
    assert incomplete and calls == [("add", '{"a": 1')] and content == ""


CALL = call("add", a="1", b="2")


@pytest.mark.parametrize("mode, text, expected", [
    ("required", CALL, True),
    ("required", CALL + "\n" + call("get_weather", city="Oslo\nNorway"), True),
    ("required", call("add", a="1"), False),  # b is required
    ("required", call("add", b="2", a="1"), False),  # the schema's order
    ("required", call("add", a='"1"', b="2"), False),  # a JSON integer
    ("required", call("write_file", path="x", content=CODE), True),
    ("required", call("write_file", path="x", content="y", mode="w", force="false"), True),
    ("required", call("write_file", path="x", content="y", mode="r"), False),  # the enum
    ("required", call("write_file", path="x", content="y", lines='["a"]'), False),
    ("required", call("write_file", path="x", content="a\n</parameter>\nb"), False),  # a string ends at its tag
    ("required", "Just text", False),
    ("function", CALL, True),
    ("function", call("get_weather", city="Oslo"), False),
    ("auto", "Just text, no call.", True),
    ("auto", f"Let me add.\n{CALL}", True),
    ("auto", "Text <tool_call>\nnot a call", False),
])
def test_the_grammar_of_each_tool_choice_and_schema(mode: str, text: str, expected: bool,
                                                    llg_tokenizer) -> None:  # noqa: F811 - the fixture
    choice = ToolChoice(mode, "add" if mode == "function" else None)  # type: ignore[arg-type]
    assert accepts(FORMAT.grammar([WEATHER, ADD, WRITE], choice, True), text, llg_tokenizer) is expected


def test_the_format_comes_from_the_template_and_calls_written_back_read_as_they_were() -> None:
    fmt = tool_format_for("auto", "<tool_call>\n<function=example_function_name>\n<parameter=x>", lambda t: None)
    assert type(fmt) is XmlToolFormat and not fmt.special_tags
    calls = [("write_file", {"path": "f.py", "content": CODE, "lines": [1, 2]}), ("add", {"a": 1, "b": 2})]
    written = FORMAT.render_calls(calls)
    assert parse(written) == ("", [(name, json.dumps(arguments)) for name, arguments in calls], False)


LOCATE = ToolSpec("locate", {
    "type": "object", "properties": {
        "place": {"$ref": "#/$defs/Place"}, "note": {"description": "free text"},
        "city": {"anyOf": [{"type": "string"}, {"type": "null"}]}, "zip": {"type": ["string", "null"]},
        "scale": {"type": "number"}},
    "required": ["place"],
    "$defs": {"Place": {"type": "object", "properties": {"lat": {"type": "number"}}, "required": ["lat"],
                        "additionalProperties": False}}})


def test_values_by_schema_references_untyped_and_optional_strings(llg_tokenizer) -> None:  # noqa: F811
    fmt = XmlToolFormat(special_tags=False).for_tools([LOCATE])
    grammar = fmt.grammar([LOCATE], ToolChoice("required"), True)
    text = call("locate", place='{"lat": 1.5}', note="near the <b>port</b>", city="Oslo", zip="0150", scale="1E5")
    assert accepts(grammar, text, llg_tokenizer)
    assert not accepts(grammar, call("locate", place='{"lon": 1}'), llg_tokenizer)  # the referenced definition
    # strings as written (also where the schema says nothing, or allows null), JSON as written (1E5 stays so)
    assert parse(text, None, fmt)[1] == [("locate", '{"place": {"lat": 1.5}, "note": "near the <b>port</b>", '
                                                   '"city": "Oslo", "zip": "0150", "scale": 1E5}')]


def test_a_parameter_name_the_tags_cannot_hold_is_a_400() -> None:
    from kvserve.errors import InvalidRequest

    tool = ToolSpec("f", {"type": "object", "properties": {"a>b": {"type": "string"}}})
    with pytest.raises(InvalidRequest) as raised:
        XmlToolFormat(special_tags=False).grammar([tool], ToolChoice("required"), True)
    assert raised.value.param == "tools"
