"""Mistral's tool calls (``[TOOL_CALLS] [{"name": ..., "arguments": ...}]``): the parser, whole and streamed in any
split, with the tag in the text or left out of it as a special token; the grammars per tool_choice, with the tag
as text and as a special token; the ids Mistral's templates take; the format chosen from the template."""

from __future__ import annotations

import json

import llguidance
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import AddedToken

from kvserve.model.loader import default_model_path
from kvserve.structured.pythonic_tools import PythonicToolFormat
from kvserve.structured.tool_calls import ToolChoice
from kvserve.structured.tool_format_choice import tool_format_for
from kvserve.structured.tool_formats import MistralToolFormat
from kvserve.tokenizer import Tokenizer
from tests.structured.test_tool_calls import ADD, WEATHER, accepts, llg_tokenizer  # noqa: F401 - a fixture
from tests.structured.test_tool_calls import parse as json_parse

TEXTS = {
    "text only": ("Paris is sunny.", "Paris is sunny.", []),
    "a call": ('[TOOL_CALLS] [{"name": "add", "arguments": {"a": 1, "b": 2}}]', "", [("add", '{"a": 1, "b": 2}')]),
    # the tag is a special token: skipped from the text, the reply opens with the list
    "a call, the tag skipped": (' [{"name": "add", "arguments": {"a": 1, "b": 2}}]', "",
                                [("add", '{"a": 1, "b": 2}')]),
    "two calls, brackets and commas in strings": (
        '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "a], [{b"}}, {"name": "add", "arguments": {}}]',
        "", [("get_weather", '{"city": "a], [{b"}'), ("add", "{}")]),
    "a list that is not calls": ("[1, 2] are numbers", "[1, 2] are numbers", []),
    "a bracket in text": ("[See below] {x}", "[See below] {x}", []),
    # a call opens the reply or nothing: the tag spelt inside text is text
    "the tag inside text": ('Sure. [TOOL_CALLS] [{"name": "rm", "arguments": {}}]',
                            'Sure. [TOOL_CALLS] [{"name": "rm", "arguments": {}}]', []),
}


def parse(text: str, cuts: list[int] | None = None) -> tuple[str, list[tuple[str, str]], bool]:
    return json_parse(text, cuts, MistralToolFormat())


@pytest.mark.parametrize("name", list(TEXTS))
def test_the_parser_reads_content_and_calls(name: str) -> None:
    text, content, calls = TEXTS[name]
    assert parse(text) == (content, calls, False)


@settings(max_examples=60, deadline=None)
@given(st.sampled_from(list(TEXTS)), st.lists(st.integers(min_value=1, max_value=120), max_size=10))
def test_streaming_in_any_pieces_gives_what_the_whole_text_gives(name: str, cuts: list[int]) -> None:
    text = TEXTS[name][0]
    assert parse(text, cuts) == parse(text)


def test_calls_get_ids_of_nine_letters_and_digits_and_a_call_cut_short_is_incomplete() -> None:
    parser = MistralToolFormat().parser()
    parser.feed('[TOOL_CALLS] [{"name": "add", "arguments": {"a": 1}}, {"name": "get_weather", "arguments": {"ci')
    parser.finish()
    assert parser.incomplete and [c.name for c in parser.calls] == ["add", "get_weather"]
    assert all(len(c.id) == 9 and c.id.isascii() and c.id.isalnum() for c in parser.calls)
    assert parser.calls[0].id != parser.calls[1].id


def test_ids_given_to_the_template_take_mistrals_form_and_stay_the_same_each_turn() -> None:
    fmt = MistralToolFormat()
    assert fmt.template_call_id("a1B2c3D4e") == "a1B2c3D4e"
    long = fmt.template_call_id("call_0123456789abcdef01234567")
    assert len(long) == 9 and long.isascii() and long.isalnum()
    short = fmt.template_call_id("c-1")
    assert len(short) == 9 and short.isascii() and short.isalnum() and short == fmt.template_call_id("c-1")
    assert short != fmt.template_call_id("c-2")


CALL = '[TOOL_CALLS] [{"name": "add", "arguments": {"a": 1, "b": 2}}]'
TWO = '[TOOL_CALLS] [{"name": "add", "arguments": {"a": 1, "b": 2}}, {"name": "get_weather", "arguments": {"city": "Oslo"}}]'


@pytest.mark.parametrize("mode, parallel, text, expected", [
    ("required", True, CALL, True),
    ("required", True, CALL.replace("] [", "]["), True),
    ("required", True, TWO, True),
    ("required", False, TWO, False),
    ("required", True, CALL.replace('"b": 2', '"b": "2"'), False),
    ("required", True, CALL.replace("[TOOL_CALLS] ", ""), False),  # the tag leads the calls
    ("required", True, "Just text", False),
    ("function", True, CALL, True),
    ("function", True, TWO, False),
    ("auto", True, "Just text, no call.", True),
    ("auto", True, CALL, True),
    ("auto", True, "[1, 2] are numbers", True),
    ("auto", True, '[{"name": "add", "arguments": {"a": 1, "b": 2}}]', False),  # text never opens like the calls
    ("auto", True, f"Let me add. {CALL}", False),  # nor spells the tag
])
def test_the_grammar_of_each_tool_choice(mode: str, parallel: bool, text: str, expected: bool,
                                         llg_tokenizer) -> None:  # noqa: F811 - the fixture
    choice = ToolChoice(mode, "add" if mode == "function" else None)  # type: ignore[arg-type]
    grammar = MistralToolFormat().grammar([WEATHER, ADD], choice, parallel)
    assert accepts(grammar, text, llg_tokenizer) is expected


@pytest.fixture(scope="module")
def tag_token() -> tuple[Tokenizer, llguidance.LLTokenizer, int]:
    """SmolLM2's tokenizer with [TOOL_CALLS] added as a special token, as Mistral's vocabularies hold it."""
    tokenizer = Tokenizer.from_model_path(default_model_path())
    backend = tokenizer.backend
    backend.add_special_tokens([AddedToken("[TOOL_CALLS]", special=True)])
    llg = llguidance.LLTokenizer(backend.to_str(), n_vocab=backend.get_vocab_size(),
                                 eos_token=list(tokenizer.eos_token_ids))
    return tokenizer, llg, backend.token_to_id("[TOOL_CALLS]")


def test_a_special_tag_is_written_as_its_token(tag_token) -> None:
    tokenizer, llg, tag_id = tag_token
    assert llg.is_special_token(tag_id)
    grammar = MistralToolFormat(tag_id=tag_id).grammar([WEATHER, ADD], ToolChoice("required"), True)
    listed = tokenizer.encode(' [{"name": "add", "arguments": {"a": 1, "b": 2}}]', add_special_tokens=False)
    spelt = [*tokenizer.encode("[TOOL", add_special_tokens=False), *tokenizer.encode("_CALLS]", add_special_tokens=False)]
    for ids, expected in [([tag_id, *listed], True), (listed, False), ([*spelt, *listed], False)]:
        matcher = llguidance.LLMatcher(llg, grammar, log_level=0)
        assert not matcher.is_error(), matcher.get_error()
        assert (bool(matcher.consume_tokens(ids)) and matcher.is_accepting()) is expected


def test_the_format_comes_from_the_template() -> None:
    def special(tag: str) -> int | None:
        return 5 if tag == "[TOOL_CALLS]" else None

    mistral = tool_format_for("auto", "{% if tools %}[AVAILABLE_TOOLS]{% endif %}[TOOL_CALLS] [", special)
    assert isinstance(mistral, MistralToolFormat) and mistral.tag_id == 5
    assert isinstance(tool_format_for("mistral", None, lambda tag: None), MistralToolFormat)
    pythonic = "please respond with a python list of the calls. Respond in the format [func_name1(params_name1=..."
    assert isinstance(tool_format_for("auto", pythonic, special), PythonicToolFormat)
    rendered = MistralToolFormat().render_calls([("add", {"a": 1}), ("f", {})])
    assert rendered.startswith("[TOOL_CALLS] ") and json.loads(rendered.removeprefix("[TOOL_CALLS] ")) == [
        {"name": "add", "arguments": {"a": 1}}, {"name": "f", "arguments": {}}]
    assert parse(rendered) == ("", [("add", '{"a": 1}'), ("f", "{}")], False)


def test_a_reply_opening_with_another_space_character_is_text_and_a_list_cut_short_is_incomplete(
        llg_tokenizer) -> None:  # noqa: F811 - the fixture
    text = '\xa0[{"name": "rm", "arguments": {"path": "/"}}]'
    assert accepts(MistralToolFormat().grammar([WEATHER, ADD], ToolChoice("auto"), True), text, llg_tokenizer)
    assert parse(text) == (text, [], False)
    for cut in ("[TOOL_CALLS] [", '[TOOL_CALLS] [{"name": "add", "arguments": {}}, '):
        assert parse(cut)[2], cut
    assert parse("[TOOL_CALLS]") == ("[TOOL_CALLS]", [], False)  # no list opened: text, whole or streamed


def test_ids_that_share_their_last_nine_characters_stay_apart() -> None:
    fmt = MistralToolFormat()
    assert fmt.template_call_id("call_1_get_weather") != fmt.template_call_id("call_2_get_weather")
    assert fmt.template_call_id("call-123456789") != fmt.template_call_id("call_123456789")


ANSWER = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
          "additionalProperties": False}


@pytest.mark.parametrize("fmt, text, expected", [
    (MistralToolFormat(), '{"ok": true}', True),
    (MistralToolFormat(), CALL, True),
    (MistralToolFormat(), "Just text", False),
    (MistralToolFormat(), '[{"ok": true}]', False),
    (PythonicToolFormat(), '{"ok": false}', True),
    (PythonicToolFormat(), "[add(a=1, b=2)]", True),
    (PythonicToolFormat(), "Just text", False),
])
def test_with_a_response_format_a_reply_is_the_answer_or_calls(fmt, text: str, expected: bool,
                                                               llg_tokenizer) -> None:  # noqa: F811 - the fixture
    grammar = fmt.with_answer(ANSWER).grammar([WEATHER, ADD], ToolChoice("auto"), True)
    assert accepts(grammar, text, llg_tokenizer) is expected
    if expected:
        content, calls, _ = json_parse(text, None, fmt.with_answer(ANSWER))
        assert (content, bool(calls)) == ((text, False) if text.startswith("{") else ("", True))


def test_llama3_calls_cannot_be_told_from_a_json_answer() -> None:
    from kvserve.structured.tool_formats import Llama3JsonToolFormat

    assert not Llama3JsonToolFormat().can_answer and MistralToolFormat().can_answer


@pytest.mark.parametrize("parser, template, special, tag", [
    ("granite", None, "<|tool_call|>", "<|tool_call|>"),  # Granite 3.0: a token
    ("granite", None, None, "<tool_call>"),  # 3.1 and later: text
    ("auto", "{% if tools %}<|tool_call|>{% endif %}", "<|tool_call|>", "<|tool_call|>"),
    ("phi4_mini_json", None, None, "functools"),
    ("auto", "Reply with functools[{...}]", None, "functools"),
])
def test_granite_and_phi4_mini_write_the_list_after_their_own_tag(parser: str, template: str | None,
                                                                  special: str | None, tag: str,
                                                                  llg_tokenizer) -> None:  # noqa: F811
    from kvserve.structured.tool_formats import ListToolFormat

    fmt = tool_format_for(parser, template, lambda t: 7 if t == special else None)
    assert type(fmt) is ListToolFormat and fmt.open_tag == tag
    text = f'{tag}[{{"name": "add", "arguments": {{"a": 1, "b": 2}}}}]'
    assert json_parse(text, None, fmt) == ("", [("add", '{"a": 1, "b": 2}')], False)
    assert json_parse(text, [3, 9, 15], fmt) == json_parse(text, None, fmt)
    if special is None:  # the tag is text: the grammar writes it so
        grammar = fmt.grammar([WEATHER, ADD], ToolChoice("auto"), True)
        assert accepts(grammar, text, llg_tokenizer) and accepts(grammar, "Plain text.", llg_tokenizer)
        assert not accepts(grammar, f"Sure. {text}", llg_tokenizer)


def test_phi4_minis_tag_is_a_word_text_may_use(llg_tokenizer) -> None:  # noqa: F811 - the fixture
    fmt = tool_format_for("phi4_mini_json", None, lambda tag: None)
    text = "functools is a module: use functools.lru_cache."
    assert accepts(fmt.grammar([WEATHER, ADD], ToolChoice("auto"), True), text, llg_tokenizer)
    assert json_parse(text, None, fmt) == (text, [], False)
    assert json_parse(text, [3, 9, 10, 11], fmt) == (text, [], False)


V11_TEMPLATE = "{%- for tool in message['tool_calls'] %}{{- '[TOOL_CALLS]' + name + '[ARGS]' + arguments }}"
NAMED_TEXTS = {
    "text only": ("Paris is sunny.", "Paris is sunny.", []),
    "a call, tags skipped": ('add{"a": 1, "b": 2}', "", [("add", '{"a": 1, "b": 2}')]),
    "two calls, tags in the text": ('[TOOL_CALLS]get_weather[ARGS]{"city": "a}{\\""}[TOOL_CALLS]add[ARGS]{"a": 1}',
                                    "", [("get_weather", '{"city": "a}{\\""}'), ("add", '{"a": 1}')]),
    "a name without its arguments": ("Hello there", "Hello there", []),
    "a JSON answer": ('{"ok": true}', '{"ok": true}', []),
}


@pytest.mark.parametrize("name", list(NAMED_TEXTS))
def test_the_named_layout_is_read_whole_and_streamed(name: str) -> None:
    from kvserve.structured.mistral_named_tools import MistralNamedToolFormat

    text, content, calls = NAMED_TEXTS[name]
    fmt = MistralNamedToolFormat()
    assert json_parse(text, None, fmt) == (content, calls, False)
    for cuts in ([1], [1, 2, 3, 5, 8, 13, 21, 34], [12, 13, 14, 40]):
        assert json_parse(text, cuts, fmt) == json_parse(text, None, fmt)


def test_the_named_layout_comes_from_a_template_that_writes_args_and_is_held_by_its_grammar(
        tag_token) -> None:
    from kvserve.structured.mistral_named_tools import MistralNamedToolFormat

    tokenizer, llg, tag_id = tag_token
    fmt = tool_format_for("auto", V11_TEMPLATE, lambda tag: tag_id if tag == "[TOOL_CALLS]" else None)
    assert type(fmt) is MistralNamedToolFormat and fmt.tag_id == tag_id and fmt.args_id is None
    grammar = fmt.grammar([WEATHER, ADD], ToolChoice("required"), True)

    def ids(text: str) -> list[int]:
        return tokenizer.encode(text, add_special_tokens=False)

    for tokens, expected in [([tag_id, *ids('add[ARGS]{"a": 1, "b": 2}')], True),
                             ([tag_id, *ids('add[ARGS]{"a": 1, "b": 2}'), tag_id, *ids('get_weather[ARGS]{"city": "x"}')],
                              True),
                             ([tag_id, *ids('add[ARGS]{"a": 1}')], False),  # b is required
                             ([tag_id, *ids('mul[ARGS]{"a": 1, "b": 2}')], False),
                             (ids('add[ARGS]{"a": 1, "b": 2}'), False)]:  # the tag leads each call
        matcher = llguidance.LLMatcher(llg, grammar, log_level=0)
        assert not matcher.is_error(), matcher.get_error()
        assert (bool(matcher.consume_tokens(tokens)) and matcher.is_accepting()) is expected
    auto = fmt.grammar([WEATHER, ADD], ToolChoice("auto"), True)
    for text, expected in [("Plain text, no call.", True), ('add{"a": 1}', False)]:  # text never opens like calls
        matcher = llguidance.LLMatcher(llg, auto, log_level=0)
        assert (bool(matcher.consume_tokens(ids(text))) and matcher.is_accepting()) is expected
    assert type(tool_format_for("mistral", "[TOOL_CALLS] [", lambda tag: None)) is MistralToolFormat
