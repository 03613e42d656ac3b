"""Tool calls in Qwen3-Coder's XML (vLLM's ``qwen3_coder`` parser reads the same)::

    <tool_call>
    <function=get_weather>
    <parameter=city>
    Paris
    </parameter>
    </function>
    </tool_call>

A string parameter's value is its text as written, over several lines if need be (code, as a coding model
writes it, without JSON's escapes); any other value is JSON (numbers, ``true``, arrays, objects). The grammar
holds each call to an offered function, its parameters by name in the schema's order (the required ones
present), a string's value to its enum where it has one (not to a length, pattern or format: a string is
written as it is) and any other value to its schema; the parser, which
knows the offered tools, turns the values into the call's JSON arguments. Text may come before the calls, as
in the hermes format, whose tags and grammar these calls share.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from typing import Any, Literal

from kvserve.errors import InvalidRequest
from kvserve.structured.call_parsers import CALL_BLANKS, ParsedDelta, StreamingParser
from kvserve.structured.grammar import JSON_OPTIONS
from kvserve.structured.tool_calls import (
    HermesToolFormat,
    ToolChoice,
    ToolSpec,
    function_json,
    ordered_parameters,
)

ValueKind = Literal["text", "json"]
_FUNCTION = re.compile(r"<function=([^>\n]*)>\n")
_PARAMETER = re.compile(r"<parameter=([^>\n]*)>\n")
_PARAMETER_END = "\n</parameter>\n"
_FUNCTION_END = "</function>"
# A string's text: anything up to its end tag (a lazy lexeme ends at the first one).
_TEXT_VALUE = r"textval[lazy]: /(.|\n)*\n<\/parameter>\n/"


class XmlToolFormat(HermesToolFormat):
    """``<tool_call>`` and ``<function=name>`` with one ``<parameter=name>`` block per argument."""

    bare_calls = False

    def grammar(self, tools: Sequence[ToolSpec], choice: ToolChoice, parallel: bool) -> str:
        """The hermes format's grammar of a reply (tags, text, answer) with these calls inside the tags."""
        return super().grammar(tools, choice, parallel) + _TEXT_VALUE + "\n"

    def function_rules(self, index: int, tool: ToolSpec) -> list[str]:
        """``fn_<index>``: one call of ``tool``: its parameters in the schema's order, ``a_<i>_<j>`` the blocks
        from the j-th on."""
        properties, required = ordered_parameters(tool)
        names = list(properties)
        for name in names:
            if any(c in name for c in "<>\n"):
                raise InvalidRequest(f"Qwen3-Coder's tool-call format writes parameter names inside a tag: {name!r} "
                                     f"(in {tool.name!r}) holds '<', '>' or a line break", param="tools")
        definitions = {key: tool.parameters[key] for key in ("$defs", "definitions") if key in tool.parameters}
        lines = [f'fn_{index}: {json.dumps(f"<function={tool.name}>" + chr(10))} a_{index}_0 "{_FUNCTION_END}"',
                 f'a_{index}_{len(names)}: ""']
        for j, name in enumerate(names):
            block = f"p_{index}_{j}"
            schema = properties[name]
            opening = json.dumps(f"<parameter={name}>\n")
            if _kind(schema) == "text":
                enum = schema.get("enum") if isinstance(schema, dict) else None
                value = ("(" + " | ".join(json.dumps(f"{v}{_PARAMETER_END}") for v in enum) + ")"
                         if isinstance(enum, list) and enum else "textval")
                lines.append(f"{block}: {opening} {value}")
            else:  # JSON of the parameter's schema, with the tool's definitions beside it for its references
                lines.append(f"{block}: {opening} {block}_value {json.dumps(_PARAMETER_END)}")
                value_schema = {**(schema if isinstance(schema, dict) else {}), **definitions, "x-guidance": JSON_OPTIONS}
                lines.append(f"{block}_value: %json {json.dumps(value_schema)}")
            after = f"a_{index}_{j + 1}"
            lines.append(f"a_{index}_{j}: {block} {after}" if name in required else
                         f"a_{index}_{j}: {block} {after} | {after}")
        return lines

    def parser(self) -> XmlToolCallParser:
        kinds = {tool.name: {name: _kind(schema) for name, schema in ordered_parameters(tool)[0].items()}
                 for tool in self.tools}
        return XmlToolCallParser(self.open_tag, self.close_tag, kinds, answer_opening="{" if self.answer else None)

    def system_prompt(self, tools: Sequence[ToolSpec]) -> str:
        """How the tools are offered to a model whose chat template has no place for them."""
        listed = "\n".join(json.dumps({"type": "function", "function": function_json(t)}) for t in tools)
        return (f"# Tools\n\nYou can call these functions:\n<tools>\n{listed}\n</tools>\n\nTo call one, reply in this "
                "format, one <parameter> block per argument (a string as it is, anything else as JSON):\n"
                "<tool_call>\n<function=function_name>\n<parameter=parameter_name>\nvalue\n</parameter>\n"
                "</function>\n</tool_call>")

    def render_calls(self, calls: Sequence[tuple[str, Any]]) -> str:
        """Calls as the model writes them (an earlier assistant turn, for templates without tool support)."""
        written = []
        for name, arguments in calls:
            blocks = "".join(f"<parameter={key}>\n{value if isinstance(value, str) else json.dumps(value)}"
                             f"{_PARAMETER_END}" for key, value in (arguments.items()
                                                                    if isinstance(arguments, dict) else ()))
            written.append(f"{self.open_tag}\n<function={name}>\n{blocks}{_FUNCTION_END}\n{self.close_tag}")
        return "\n".join(written)


_TYPING_KEYWORDS = ("type", "enum", "const", "anyOf", "oneOf", "allOf", "$ref", "properties", "items")


def _kind(schema: Any) -> ValueKind:
    """``text``: a value written as it is: a string, one that may be a string (``["string", "null"]``, an
    ``anyOf`` with a string branch, as pydantic writes ``Optional[str]``), or a schema that says nothing of its
    type (a string, as vLLM reads it); ``json``: written as JSON."""
    if not isinstance(schema, dict) or not any(key in schema for key in _TYPING_KEYWORDS):
        return "text"
    enum = schema.get("enum")
    if isinstance(enum, list) and enum:
        return "text" if all(isinstance(v, str) and "\n</parameter>" not in v for v in enum) else "json"
    types = schema.get("type")
    if types == "string" or (isinstance(types, list) and "string" in types):
        return "text"
    branches = [b for key in ("anyOf", "oneOf") for b in schema.get(key) or [] if isinstance(b, dict)]
    return "text" if any(_kind(branch) == "text" and branch for branch in branches) else "json"


class XmlToolCallParser(StreamingParser):
    """Reads one reply as it streams: ``feed`` each new piece of text, then ``finish``. Text outside the tags is
    content (what may be the start of a tag waits); inside, each call's name goes out when its ``<function=``
    line is read and its arguments a parameter at a time, as JSON, when each ``</parameter>`` is."""

    def __init__(self, open_tag: str, close_tag: str, kinds: dict[str, dict[str, ValueKind]],
                 answer_opening: str | None = None) -> None:
        super().__init__()
        self.open_tag = open_tag
        self.close_tag = close_tag
        self.kinds = kinds
        self.answer_opening = answer_opening
        self._mode: Literal["start", "text", "call", "answer", "broken"] = "start"
        self._call_name: str | None = None  # the current call's, once its function line is read
        self._written = 0  # parameters written into its arguments; -1 once its function has ended

    def _read(self, pending: str, delta: ParsedDelta) -> str:
        if self._mode == "start":  # a response format's answer opens the reply, or nothing does
            stripped = pending.lstrip(CALL_BLANKS)
            if not stripped:
                self._held = pending
                return ""
            answers = self.answer_opening is not None and stripped.startswith(self.answer_opening)
            self._mode = "answer" if answers else "text"
        if self._mode == "answer":
            self._emit(pending, delta)
            return ""
        if self._mode == "text":
            return self._text(pending, delta)
        return self._call(pending, delta) if self._mode == "call" else ""

    def _finish(self, delta: ParsedDelta) -> None:
        if self._mode in ("start", "text", "answer"):
            self._emit(self._held.rstrip(CALL_BLANKS) if self.calls else self._held, delta)
        elif self._mode == "call":
            self.incomplete = True

    def _text(self, pending: str, delta: ParsedDelta) -> str:
        rest = self._text_before(self.open_tag, pending, delta)
        if rest is not None:
            self._mode = "call"
            self._call_name = None
        return rest or ""

    def _call(self, pending: str, delta: ParsedDelta) -> str:
        """One step inside ``<tool_call>``: the function line, a parameter block, the function's end or the
        call's; what is not whole yet waits."""
        stripped = pending.lstrip(CALL_BLANKS)
        if self._call_name is None:
            found = _FUNCTION.match(stripped)
            if found is None:
                return self._wait_or_break(pending, stripped, "<function=")
            self._call_name = found.group(1)
            self._new_call(self._call_name, delta)
            self._written = 0
            return stripped[found.end():]
        if stripped.startswith("<parameter="):
            found = _PARAMETER.match(stripped)
            end = stripped.find(_PARAMETER_END, found.end()) if found is not None else -1
            if found is None or end < 0:
                self._held = pending
                return ""
            value = stripped[found.end():end]
            if not self._add(found.group(1), value, delta):
                return ""
            return stripped[end + len(_PARAMETER_END):]
        if stripped.startswith(_FUNCTION_END):
            self._add_arguments("{}" if self._written == 0 else "}", delta)
            self._written = -1  # the function has ended: its call's tag is next
            return stripped[len(_FUNCTION_END):]
        if self._written == -1 and stripped.startswith(self.close_tag):
            self._mode = "text"
            self._after_call = True
            return stripped[len(self.close_tag):]
        expected = (self.close_tag,) if self._written == -1 else ("<parameter=", _FUNCTION_END)
        return self._wait_or_break(pending, stripped, *expected)

    def _wait_or_break(self, pending: str, stripped: str, *expected: str) -> str:
        """Wait for more where ``stripped`` may still become (or has begun) one of ``expected``."""
        if any(e.startswith(stripped) or stripped.startswith(e) for e in expected):
            self._held = pending
            return ""
        self._mode = "broken"  # not this format: the grammar never writes it
        self.incomplete = True
        return ""

    def _add(self, name: str, value: str, delta: ParsedDelta) -> bool:
        kind = self.kinds.get(self.calls[-1].name, {}).get(name, "text")
        if kind == "json":  # the JSON as written (read back, numbers would change their spelling)
            try:
                json.loads(value)
            except ValueError:
                self._mode = "broken"
                self.incomplete = True
                return False
            written = value.strip()
        else:
            written = json.dumps(value, ensure_ascii=False)
        self._add_arguments(("{" if self._written == 0 else ", ") + json.dumps(name, ensure_ascii=False) + ": " + written,
                       delta)
        self._written += 1
        return True
