"""Tool calls in the model's own format: the grammar that enforces them and the parser that reads them back.

A family's format is a ``ToolCallFormat`` (its grammar, its ``ToolCallParser``, how tools are written for a
template without them). This module holds the protocol, what the formats share, and the hermes style that
Qwen2.5 (and Hermes, and many fine-tunes) are trained on (the other formats are beside it; the parsers that
read calls back out of the text are in ``call_parsers.py``)::

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

``tool_choice`` maps to a grammar: ``required`` is one or more calls and nothing else, a named function is
one call of it (whatever ``parallel_tool_calls`` says), ``auto`` is free text or text followed by calls,
where everything after the opening tag is constrained (so an opened call is always a valid call of an
offered tool with arguments that match its schema). The parser reads text as it streams and never lets a
tag, or the start of one, out as content; it tracks JSON strings, so a closing tag inside an argument does
not end a call.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal, Protocol, Self

from kvserve.structured.call_parsers import JsonToolCallParser, ParsedDelta, ParsedToolCall
from kvserve.structured.grammar import JSON_OPTIONS

ToolChoiceMode = Literal["none", "auto", "required", "function"]


@dataclass(frozen=True, slots=True)
class ToolSpec:
    """An offered function: its name and the JSON Schema of its arguments (an object)."""

    name: str
    parameters: dict[str, Any]
    description: str | None = None


@dataclass(frozen=True, slots=True)
class ToolChoice:
    mode: ToolChoiceMode
    name: str | None = None  # mode "function": the function that must be called


class ToolCallParser(Protocol):
    """Reads one reply's text as it streams: content, and the calls in it."""

    calls: list[ParsedToolCall]
    incomplete: bool  # the reply ended inside a call

    @property
    def content(self) -> str: ...

    def feed(self, text: str) -> ParsedDelta: ...

    def finish(self) -> ParsedDelta: ...


class ToolCallFormat(Protocol):
    """How one model family writes tool calls: the grammar that enforces them, the parser that reads them
    back, and how tools and calls are written for a template that has no place for them.

    ``answer``: under ``tool_choice: auto``, a reply that makes no call is a JSON object of this schema (tools
    with a response format, as OpenAI's API combines them), not free text. ``with_answer`` gives the format so;
    a format whose calls open as a JSON object does (``can_answer`` is False for it)."""

    open_tag: str | None  # what opens the calls, where something does (biased against under tool_choice none)
    answer: dict[str, Any] | None
    can_answer: bool

    def with_answer(self, schema: dict[str, Any]) -> ToolCallFormat: ...

    def for_tools(self, tools: Sequence[ToolSpec]) -> ToolCallFormat: ...

    def grammar(self, tools: Sequence[ToolSpec], choice: ToolChoice, parallel: bool) -> str: ...

    def parser(self) -> ToolCallParser: ...

    def system_prompt(self, tools: Sequence[ToolSpec]) -> str: ...

    def render_calls(self, calls: Sequence[tuple[str, Any]]) -> str: ...

    def template_call_id(self, call_id: str) -> str: ...


class Answering:
    """What every format shares for a request's own copy of it: ``answer`` (see ``ToolCallFormat``), and the
    tools it offers (which a format whose calls are not JSON reads its values' types from)."""

    answer: dict[str, Any] | None = None
    can_answer = True
    tools: tuple[ToolSpec, ...] = ()

    def with_answer(self, schema: dict[str, Any]) -> Self:
        assert self.can_answer
        answering = copy.copy(self)
        answering.answer = schema
        return answering

    def for_tools(self, tools: Sequence[ToolSpec]) -> Self:
        offering = copy.copy(self)
        offering.tools = tuple(tools)
        return offering

    def answer_rules(self) -> list[str]:
        """The grammar's ``answer``: a JSON object of the schema, written as a response format's JSON is."""
        assert self.answer is not None
        return [f"answer: %json {json.dumps({**self.answer, 'x-guidance': JSON_OPTIONS})}"]


class HermesToolFormat(Answering):
    """``<tool_call>`` JSON ``</tool_call>``. ``special_tags``: the tags are single special tokens of the
    vocabulary (Qwen2.5), written as tokens in the grammar; otherwise they are text."""

    open_tag = "<tool_call>"
    close_tag = "</tool_call>"
    bare_calls = True  # a reply that opens with a call's JSON, without the tags, is a call too

    def __init__(self, special_tags: bool) -> None:
        self.special_tags = special_tags

    def grammar(self, tools: Sequence[ToolSpec], choice: ToolChoice, parallel: bool) -> str:
        """The Lark grammar (llguidance's dialect) of a reply under ``choice`` ("none" has none)."""
        assert choice.mode != "none"
        offered = [t for t in tools if choice.mode != "function" or t.name == choice.name]
        functions = " | ".join(f"fn_{i}" for i in range(len(offered)))
        open_tag, close_tag = self._tag(self.open_tag), self._tag(self.close_tag)
        more = ' ("\\n" call)*' if parallel else ""
        lines = ["%llguidance {}", f'call: {open_tag} "\\n" fn "\\n" {close_tag}', f"fn: {functions}"]
        if choice.mode == "function":  # that function, called once
            lines.append('start: call "\\n"?')
        elif choice.mode == "required":
            lines.append(f'start: call{more} "\\n"?')
        elif self.answer is not None:  # the answer, or calls from the first token
            bare = self.bare_calls and self._bare_beside_answer  # and bare calls, told apart by their first key
            lines += [f'start: answer | call{more} "\\n"?' + (" | bare" if bare else ""), *self.answer_rules()]
            lines += ["bare: fn" + (' ("\\n" fn)*' if parallel else "")] if bare else []
        elif not self.bare_calls:
            lines += self._text_or_calls(more, "")
        else:
            # A reply that opens with a JSON object, bare or in a json code fence, is a call too: it is how
            # small models (Qwen2.5-Coder) often answer with tools. Text never opens that way.
            bare = ' ("\\n" fn)*' if parallel else ""
            lines += ['bare: FENCE? fn' + bare + ' FENCE_END?', 'FENCE: "```json\\n"', 'FENCE_END: "\\n```"']
            lines += self._text_or_calls(more, r" & ~/[ \t\n]*(```json[ \t\n]*)?\{(.|\n)*/")
        for i, tool in enumerate(offered):
            lines += self.function_rules(i, tool)
        return "\n".join(lines) + "\n"

    def _text_or_calls(self, more: str, not_bare: str) -> list[str]:
        """``start`` under auto: text, or text then calls (``| bare`` where ``not_bare`` keeps text from opening
        like a bare call)."""
        open_tag, close_tag = self._tag(self.open_tag), self._tag(self.close_tag)
        bare = " | bare" if not_bare else ""
        if self.special_tags:  # text cannot spell a special token: the tag alone decides
            return [f'start: TEXT | TEXT call{more} "\\n"?{bare}', r"TEXT: /(.|\n)*/" + not_bare]
        # the first tag ends the text (a lazy lexeme), and text alone never holds one
        return [f'start: TEXT | first{more} "\\n"?{bare}',
                f'first: trig "\\n" fn "\\n" {close_tag}',
                f"trig[lazy]: LEAD {open_tag}",
                r"LEAD: /(.|\n)*/" + not_bare,
                r"TEXT: /(.|\n)*/ & ~/(.|\n)*" + regex_literal(self.open_tag) + r"(.|\n)*/" + not_bare]

    def function_rules(self, index: int, tool: ToolSpec) -> list[str]:
        """``fn_<index>``: one call of ``tool`` between the tags."""
        return [f"fn_{index}: %json {json.dumps(call_schema(tool))}"]

    def _tag(self, tag: str) -> str:
        return tag if self.special_tags else json.dumps(tag)

    @property
    def _bare_beside_answer(self) -> bool:
        """A bare call (``{"name": ...``) can stand beside the answer: no answer's first key is ``name`` (the
        schema neither has it nor allows other properties), so the first key tells them apart."""
        assert self.answer is not None
        properties = self.answer.get("properties")
        return self.answer.get("additionalProperties") is False and not (isinstance(properties, dict)
                                                                         and "name" in properties)

    def parser(self) -> JsonToolCallParser:
        if self.answer is not None:  # a reply that opens with a JSON object is the answer, or a bare call
            return JsonToolCallParser(self.open_tag, self.close_tag, openings=(), answer_opening="{",
                                      bare_call_key="name" if self._bare_beside_answer else None)
        return JsonToolCallParser(self.open_tag, self.close_tag)

    def system_prompt(self, tools: Sequence[ToolSpec]) -> str:
        """How the tools are offered to a model whose chat template has no place for them (SmolLM2)."""
        listed = "\n".join(json.dumps({"type": "function", "function": function_json(t)}) for t in tools)
        return ("# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
                f"You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n{listed}\n"
                "</tools>\n\nFor each function call, return a json object with function name and arguments within "
                f"{self.open_tag}{self.close_tag} XML tags:\n{self.open_tag}\n"
                f'{{"name": <function-name>, "arguments": <args-json-object>}}\n{self.close_tag}')

    def render_calls(self, calls: Sequence[tuple[str, Any]]) -> str:
        """Calls (name, arguments) as the model writes them (an earlier assistant turn, for templates without
        tool support)."""
        return "\n".join(f"{self.open_tag}\n{json.dumps({'name': name, 'arguments': arguments})}\n{self.close_tag}"
                         for name, arguments in calls)

    def template_call_id(self, call_id: str) -> str:
        """A call's id as the chat template is given it: as sent."""
        return call_id


def call_schema(tool: ToolSpec, arguments_key: str = "arguments") -> dict[str, Any]:
    """The JSON Schema of one call: the name, then the arguments under ``arguments_key`` (the order the model
    writes them in). The
    parameters' definitions (``$defs``, ``definitions``, as pydantic writes nested models) move to the call
    schema's root, where their references (``#/$defs/...``) are resolved; other references into the
    parameters (``#``, ``#/properties/...``) are made to point into ``arguments``."""
    parameters = dict(tool.parameters)
    definitions = {key: parameters.pop(key) for key in ("$defs", "definitions") if key in parameters}
    under = f"/properties/{arguments_key}"
    return {
        "type": "object",
        "properties": {"name": {"const": tool.name}, arguments_key: _refs_under(parameters, under)},
        "required": ["name", arguments_key],
        "additionalProperties": False,
        **_refs_under(definitions, under),
        "x-guidance": JSON_OPTIONS,
    }


def _refs_under(schema: Any, prefix: str) -> Any:
    """``schema`` with each local ``$ref`` outside the definitions moved under ``prefix`` (a copy)."""
    if isinstance(schema, list):
        return [_refs_under(item, prefix) for item in schema]
    if not isinstance(schema, dict):
        return schema
    out = {key: _refs_under(value, prefix) for key, value in schema.items()}
    ref = schema.get("$ref")
    if isinstance(ref, str) and ref.startswith("#") and not ref.startswith(("#/$defs/", "#/definitions/")):
        out["$ref"] = "#" + prefix + ref[1:]
    return out


def ordered_parameters(tool: ToolSpec) -> tuple[dict[str, Any], set[str]]:
    """A tool's parameters in the schema's order, each with its schema (a required one the schema does not
    describe takes any value, as JSON Schema has it), and the names of the required ones: what a format that
    writes arguments one by one (not as a JSON object) lays out."""
    properties = tool.parameters.get("properties")
    properties = dict(properties) if isinstance(properties, dict) else {}
    required = [name for name in tool.parameters.get("required") or [] if isinstance(name, str)]
    properties.update({name: {} for name in required if name not in properties})
    return properties, set(required)


def function_json(tool: ToolSpec) -> dict[str, Any]:
    out: dict[str, Any] = {"name": tool.name}
    if tool.description:
        out["description"] = tool.description
    out["parameters"] = tool.parameters
    return out


def regex_literal(text: str) -> str:
    """``text`` inside a Lark /regex/: its regex metacharacters (and the delimiter) escaped."""
    return "".join(f"\\{c}" if c in "\\.^$*+?()[]{}|/" else c for c in text)
