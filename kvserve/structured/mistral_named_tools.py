"""Mistral's tool calls from its tokenizer v11 on (Magistral, Devstral, Mistral Small 3.2; the layout
mistral-common's chat templates write where they hold ``[ARGS]``): each call is ::

    [TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}

the tag, the function's name, the arguments tag and the arguments' JSON, several calls one after another. In
Mistral's vocabularies both tags are special tokens, so the text holds ``get_weather{"city": "Paris"}``: a reply
that opens with a name and a ``{`` is calls, and under ``tool_choice: auto`` text may not open that way.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Sequence
from typing import Any, Literal

from kvserve.structured.call_parsers import CALL_BLANKS, ParsedDelta, StreamingParser
from kvserve.structured.grammar import JSON_OPTIONS
from kvserve.structured.tool_calls import ToolChoice, ToolSpec
from kvserve.structured.tool_formats import MistralToolFormat

TOOL_CALLS_TAG = "[TOOL_CALLS]"
ARGS_TAG = "[ARGS]"
_NAME = re.compile(r"[A-Za-z0-9_-]+")


class MistralNamedToolFormat(MistralToolFormat):
    """``[TOOL_CALLS]name[ARGS]{...}``. ``tag_id`` / ``args_id``: the two tags' token ids where they are
    special tokens (then written as tokens, and not in the text)."""

    def __init__(self, tag_id: int | None = None, args_id: int | None = None) -> None:
        super().__init__(tag_id)
        self.args_id = args_id

    def grammar(self, tools: Sequence[ToolSpec], choice: ToolChoice, parallel: bool) -> str:
        """The Lark grammar (llguidance's dialect) of a reply under ``choice`` ("none" has none)."""
        assert choice.mode != "none"
        offered = [t for t in tools if choice.mode != "function" or t.name == choice.name]
        tag = f"<[{self.tag_id}]>" if self.tag_id is not None else json.dumps(self.open_tag)
        args = f"<[{self.args_id}]>" if self.args_id is not None else json.dumps(ARGS_TAG)
        lines = ["%llguidance {}", "fn: " + " | ".join(f"fn_{i}" for i in range(len(offered))),
                 f"call: {tag} fn", "calls: call+" if parallel and choice.mode != "function" else "calls: call"]
        if choice.mode == "auto" and self.answer is not None:
            lines += ["start: answer | calls", *self.answer_rules()]
        elif choice.mode == "auto":  # text neither opens like the calls (tags skipped) nor writes a tag
            lines += ["start: TEXT | calls",
                      r"TEXT: /(.|\n)*/ & ~/[ \t\n]*[A-Za-z0-9_\-]+\{(.|\n)*/ & ~/(.|\n)*\[(TOOL_CALLS|ARGS)\](.|\n)*/"]
        else:
            lines.append("start: calls")
        for i, tool in enumerate(offered):
            lines += [f"fn_{i}: {json.dumps(tool.name)} {args} fn_{i}_arguments",
                      f"fn_{i}_arguments: %json {json.dumps({**tool.parameters, 'x-guidance': JSON_OPTIONS})}"]
        return "\n".join(lines) + "\n"

    def parser(self) -> NamedCallParser:
        return NamedCallParser(self.new_call_id)

    def render_calls(self, calls: Sequence[tuple[str, Any]]) -> str:
        """Calls as the model writes them (an earlier assistant turn, for templates without tool support)."""
        return "".join(f"{self.open_tag}{name}{ARGS_TAG}{json.dumps(arguments)}" for name, arguments in calls)


class NamedCallParser(StreamingParser):
    """Reads one reply as it streams: ``feed`` each new piece, then ``finish``. A reply that opens with a name and
    ``{`` (after the tags, where they are in the text) is calls: each call's name goes out when its ``{`` is read,
    its arguments' JSON as it comes; any other reply is content."""

    def __init__(self, new_call_id: Callable[[], str]) -> None:
        super().__init__()
        self.new_call_id = new_call_id
        self._mode: Literal["between", "arguments", "text"] = "between"
        self._depth = 0
        self._in_string = False
        self._escaped = False

    def _read(self, pending: str, delta: ParsedDelta) -> str:
        if self._mode == "text":
            delta.content += pending
            return ""
        if self._mode == "between":
            return self._between(pending, delta)
        return self._arguments(pending, delta)

    def _finish(self, delta: ParsedDelta) -> None:
        if self._mode == "arguments":
            self.incomplete = True
        elif not self.calls:
            delta.content += self._held  # a beginning that never became a call

    def _between(self, pending: str, delta: ParsedDelta) -> str:
        """Before a call (the reply's start, or after a call): a call's opening, or text (after a call: ends)."""
        stripped = pending.lstrip(CALL_BLANKS).removeprefix(TOOL_CALLS_TAG)
        name = _NAME.match(stripped)  # a JSON answer (a response format's) opens with "{": no name, text
        rest = stripped[name.end():] if name is not None else stripped
        rest = rest.removeprefix(ARGS_TAG)
        if name is not None and rest.startswith("{"):
            self._new_call(name.group(), delta, self.new_call_id())
            self._mode = "arguments"
            return rest
        if not stripped or (name is not None and not rest) or _could_open(stripped):
            self._held = pending  # the name, or a tag, is still coming
            return ""
        self._mode = "text"
        return "" if self.calls else pending  # after calls the grammar writes nothing more

    def _arguments(self, pending: str, delta: ParsedDelta) -> str:
        """The current call's arguments' JSON, as it comes, to the end of its object."""
        for position, char in enumerate(pending):
            if self._in_string:
                if self._escaped:
                    self._escaped = False
                elif char == "\\":
                    self._escaped = True
                elif char == '"':
                    self._in_string = False
            elif char == '"':
                self._in_string = True
            elif char in "{[":
                self._depth += 1
            elif char in "}]":
                self._depth -= 1
                if self._depth == 0:
                    self._add_arguments(pending[: position + 1], delta)
                    self._mode = "between"
                    return pending[position + 1:]
        self._add_arguments(pending, delta)
        return ""


def _could_open(text: str) -> bool:
    """``text`` may still become a call's opening: a tag or part of one, then a name or part of one."""
    for tag in (TOOL_CALLS_TAG, ""):
        if tag.startswith(text):
            return True
        if text.startswith(tag):
            rest = text[len(tag):]
            name = _NAME.match(rest)
            after = rest[name.end():] if name is not None else rest
            if not rest or (name is not None and (not after or ARGS_TAG.startswith(after))):
                return True
    return False
