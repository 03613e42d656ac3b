"""The hermes tool-call format: the parser, whole and streamed in any split, and the grammars per tool_choice."""

from __future__ import annotations

import json

import llguidance
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvserve.model.loader import default_model_path
from kvserve.structured.tool_calls import HermesToolFormat, ToolCallFormat, ToolChoice, ToolSpec
from kvserve.tokenizer import Tokenizer

WEATHER = ToolSpec("get_weather", {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]})
ADD = ToolSpec("add", {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                       "required": ["a", "b"], "additionalProperties": False})


def parse(text: str, cuts: list[int] | None = None,
          fmt: ToolCallFormat | None = None) -> tuple[str, list[tuple[str, str]], bool]:
    """(content, [(name, arguments)], incomplete) of ``text`` fed in pieces cut at ``cuts`` to ``fmt``'s parser
    (hermes's by default)."""
    parser = (fmt or HermesToolFormat(special_tags=True)).parser()
    bounds = [0, *sorted(set(c for c in cuts or [] if 0 < c < len(text))), len(text)]
    content = ""
    calls: dict[int, list[str]] = {}
    for start, end in zip(bounds, bounds[1:], strict=False):
        delta = parser.feed(text[start:end])
        content += delta.content
        for call, is_new, arguments in delta.calls:
            entry = calls.setdefault(call.index, ["", ""])
            if is_new:
                assert entry[0] == "", "a call's header is sent once"
                entry[0] = call.name
            entry[1] += arguments
    content += parser.finish().content
    assert content == parser.content
    return content, [(name, args) for name, args in calls.values()], parser.incomplete


TEXTS = {
    "text only": ("Hello world", "Hello world", []),
    "a call": ('<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>', "",
               [("add", '{"a": 1, "b": 2}')]),
    "text then two calls, a closing tag inside an argument": (
        'Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "</tool_call> \\" }"}}\n'
        '</tool_call>\n<tool_call>\n{"name": "add", "arguments": {}}\n</tool_call>',
        "Let me look.", [("get_weather", '{"city": "</tool_call> \\" }"}'), ("add", "{}")]),
    "arguments before the name": ('<tool_call>\n{"arguments": {"x": [1, {"y": 2}]}, "name": "f"}\n</tool_call>', "",
                                  [("f", '{"x": [1, {"y": 2}]}')]),
    "a bare call in a json fence": ('```json\n{"name": "add", "arguments": {"a": 2, "b": 40}}\n```', "",
                                    [("add", '{"a": 2, "b": 40}')]),
    "two bare calls": ('{"name": "a", "arguments": {}}\n{"name": "b", "arguments": {"s": "}{"}}', "",
                       [("a", "{}"), ("b", '{"s": "}{"}')]),
    "a code fence that is not json": ("```python\nprint(1)\n```", "```python\nprint(1)\n```", []),
    "the start of a tag that never comes": ("a < b <tool_ and <tool_call", "a < b <tool_ and <tool_call", []),
}


@pytest.mark.parametrize("name", list(TEXTS))
def test_the_parser_reads_content_and_calls(name: str) -> None:
    text, content, calls = TEXTS[name]
    assert parse(text) == (content, calls, False)
    for _, arguments in calls:
        json.loads(arguments)


@settings(max_examples=60, deadline=None)
@given(st.sampled_from(list(TEXTS)), st.lists(st.integers(min_value=1, max_value=200), max_size=12))
def test_streaming_in_any_pieces_gives_what_the_whole_text_gives(name: str, cuts: list[int]) -> None:
    text = TEXTS[name][0]
    assert parse(text, cuts) == parse(text)


def test_a_call_cut_short_is_incomplete() -> None:
    content, calls, incomplete = parse('<tool_call>\n{"name": "add", "arguments": {"a": 1')
    assert incomplete and calls == [("add", '{"a": 1')] and content == ""


@pytest.fixture(scope="module")
def llg_tokenizer() -> tuple[Tokenizer, llguidance.LLTokenizer]:
    tokenizer = Tokenizer.from_model_path(default_model_path())  # SmolLM2: the tags are text, not tokens
    return tokenizer, llguidance.LLTokenizer(tokenizer.backend.to_str(), n_vocab=tokenizer.vocab_size,
                                             eos_token=list(tokenizer.eos_token_ids))


def accepts(grammar: str, text: str, llg: tuple[Tokenizer, llguidance.LLTokenizer]) -> bool:
    tokenizer, llg_tokenizer = llg
    matcher = llguidance.LLMatcher(llg_tokenizer, grammar, log_level=0)
    assert not matcher.is_error(), matcher.get_error()
    ok = matcher.consume_tokens(tokenizer.encode(text, add_special_tokens=False))
    return bool(ok) and matcher.is_accepting()


CALL = '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>'
OTHER_CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'


@pytest.mark.parametrize("mode, parallel, text, expected", [
    ("required", True, CALL, True),
    ("required", True, f"{CALL}\n{OTHER_CALL}", True),
    ("required", False, f"{CALL}\n{OTHER_CALL}", False),
    ("required", True, "Just text", False),
    ("required", True, '<tool_call>\n{"name": "add", "arguments": {"a": "1", "b": 2}}\n</tool_call>', False),
    ("required", True, '<tool_call>\n{"name": "mul", "arguments": {"a": 1, "b": 2}}\n</tool_call>', False),
    ("function", True, CALL, True),
    ("function", True, OTHER_CALL, False),
    ("auto", True, "Just text, no call.", True),
    ("auto", True, f"Let me add.{CALL}", True),
    ("auto", True, "Text <tool_call>\nnot a call", False),
    ("auto", True, '```json\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n```', True),
    ("auto", True, '{"name": "add", "arguments": {"a": 1}}', False),
    ("auto", False, f"{CALL}\n{OTHER_CALL}", False),
])
def test_the_grammar_of_each_tool_choice(mode: str, parallel: bool, text: str, expected: bool,
                                         llg_tokenizer: tuple[Tokenizer, llguidance.LLTokenizer]) -> None:
    choice = ToolChoice(mode, "add" if mode == "function" else None)  # type: ignore[arg-type]
    grammar = HermesToolFormat(special_tags=False).grammar([WEATHER, ADD], choice, parallel)
    assert accepts(grammar, text, llg_tokenizer) is expected


NESTED = ToolSpec("locate", {
    "type": "object", "properties": {"place": {"$ref": "#/$defs/Place"}}, "required": ["place"],
    "$defs": {"Place": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"],
                        "additionalProperties": False}}})


@pytest.mark.parametrize("text, expected", [
    ('<tool_call>\n{"name": "locate", "arguments": {"place": {"city": "Oslo"}}}\n</tool_call>', True),
    ('<tool_call>\n{"name": "locate", "arguments": {"place": {"town": "Oslo"}}}\n</tool_call>', False),
])
def test_a_tools_own_definitions_constrain_its_calls(text: str, expected: bool,
                                                     llg_tokenizer: tuple[Tokenizer, llguidance.LLTokenizer]) -> None:
    """Parameters with $defs and $ref, as pydantic and the OpenAI SDK write nested models: the references
    resolve from the call schema (they pointed at its root, which had no $defs: every such request was a 400)."""
    grammar = HermesToolFormat(special_tags=False).grammar([NESTED], ToolChoice("required", None), True)
    assert accepts(grammar, text, llg_tokenizer) is expected


ANSWER = {"type": "object", "properties": {"city": {"type": "string"}, "sunny": {"type": "boolean"}},
          "required": ["city", "sunny"], "additionalProperties": False}


@pytest.mark.parametrize("text, expected", [
    ('{"city": "Oslo", "sunny": true}', True),
    (CALL, True),
    (f"{CALL}\n{OTHER_CALL}", True),
    ('{"city": "Oslo"}', False),  # the answer's schema
    ("It is sunny in Oslo.", False),  # no free text: the answer or calls
    (f"Let me add.{CALL}", False),
])
def test_with_a_response_format_a_reply_is_the_answer_or_calls(text: str, expected: bool, llg_tokenizer) -> None:
    grammar = HermesToolFormat(special_tags=False).with_answer(ANSWER).grammar([WEATHER, ADD], ToolChoice("auto"),
                                                                               True)
    assert accepts(grammar, text, llg_tokenizer) is expected


@pytest.mark.parametrize("text, content, calls", [
    ('{"city": "<tool_call>\\n{", "sunny": true}', '{"city": "<tool_call>\\n{", "sunny": true}', []),
    (CALL, "", [("add", '{"a": 1, "b": 2}')]),
])
def test_with_a_response_format_the_answer_is_content_whatever_it_spells(text: str, content: str,
                                                                        calls: list[tuple[str, str]]) -> None:
    fmt = HermesToolFormat(special_tags=False).with_answer(ANSWER)
    assert parse(text, None, fmt) == (content, calls, False)
    assert parse(text, [1, 2, 3, 9, 20], fmt) == parse(text, None, fmt)
    assert HermesToolFormat(special_tags=False).answer is None  # the server's own format is left as it was


BARE = '{"name": "add", "arguments": {"a": 1, "b": 2}}'


@pytest.mark.parametrize("answer, text, read_as_calls", [
    (ANSWER, BARE, True),  # no answer opens with "name": a bare call, as Qwen2.5-Coder writes them
    (ANSWER, f"{BARE}\n{BARE}", True),
    ({"type": "object"}, BARE, False),  # any object: it is the answer, and calls need their tags
    ({**ANSWER, "properties": {**ANSWER["properties"], "name": {"type": "string"}}}, BARE, False),
])
def test_bare_calls_stand_beside_an_answer_whose_first_key_tells_them_apart(answer, text: str, read_as_calls: bool,
                                                                            llg_tokenizer) -> None:
    fmt = HermesToolFormat(special_tags=False).with_answer(answer)
    grammar = fmt.grammar([WEATHER, ADD], ToolChoice("auto"), True)
    if not read_as_calls:
        assert parse(text, None, fmt) == (text, [], False)
        assert not accepts(grammar, f"{BARE}\n{BARE}", llg_tokenizer)  # not two answers
        return
    assert accepts(grammar, text, llg_tokenizer)
    calls = [("add", '{"a": 1, "b": 2}')] * text.count(BARE)
    assert parse(text, None, fmt) == ("", calls, False)
    for cuts in ([1], [1, 2, 3, 4, 5, 6, 7, 8], [9, 30]):
        assert parse(text, cuts, fmt) == parse(text, None, fmt)
