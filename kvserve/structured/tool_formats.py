"""Tool-call formats of JSON calls besides hermes's:

- ``llama3_json``: Llama 3.1 and 3.2's ``{"name": ..., "parameters": {...}}``, several joined by ``;``,
  optionally after ``<|python_tag|>``;
- ``mistral``: ``[TOOL_CALLS] [{"name": ..., "arguments": {...}}, ...]``, one JSON list after the
  ``[TOOL_CALLS]`` token, with ids of nine letters and digits (Mistral's templates refuse others); ``granite``
  and ``phi4_mini_json`` the same list after Granite's ``<|tool_call|>`` (``<tool_call>`` from 3.1) and
  Phi-4-mini's ``functools``.

Each is a ``ToolCallFormat`` (``tool_calls.py``): a call opens the reply or nothing, so text is never read as
a call, and under ``tool_choice: auto`` text may not open the way a call does. ``tool_format_choice.py``
chooses a format by name or from the chat template.
"""

from __future__ import annotations

import hashlib
import json
import secrets
import string
from collections.abc import Sequence
from typing import Any

from kvserve.structured.call_parsers import JsonToolCallParser, new_openai_call_id
from kvserve.structured.tool_calls import (
    Answering,
    ToolChoice,
    ToolSpec,
    call_schema,
    function_json,
    regex_literal,
)

_ALPHANUMERIC = string.ascii_letters + string.digits


class Llama3JsonToolFormat(Answering):
    """Llama 3.1 and 3.2's JSON calls, as their chat templates ask for them: ``{"name": ..., "parameters":
    {...}}``, the reply nothing but the call (several joined by ``;``, as vLLM's llama3_json parser reads
    them), optionally after ``<|python_tag|>``. Under ``auto`` a reply that opens with a JSON object is calls,
    so a JSON answer could not be told from them (``can_answer`` is False)."""

    open_tag = "<|python_tag|>"
    arguments_key = "parameters"
    can_answer = False

    def __init__(self, special_tag: bool = False) -> None:
        self.special_tag = special_tag  # <|python_tag|> is a special token of the vocabulary (Llama 3's)

    def grammar(self, tools: Sequence[ToolSpec], choice: ToolChoice, parallel: bool) -> str:
        """The Lark grammar (llguidance's dialect) of a reply under ``choice`` ("none" has none): the calls, after
        the python tag where it is a token; under auto, or text that neither opens with a JSON object nor spells
        the tag anywhere (a call is never read out of text)."""
        assert choice.mode != "none"
        offered = [t for t in tools if choice.mode != "function" or t.name == choice.name]
        lines = ["%llguidance {}", "fn: " + " | ".join(f"fn_{i}" for i in range(len(offered)))]
        calls = 'fn ("; " fn)*' if parallel and choice.mode != "function" else "fn"
        if self.special_tag:
            calls = f"{self.open_tag}? {calls}"
        if choice.mode == "auto":
            lines += [f"start: TEXT | {calls}",
                      r"TEXT: /(.|\n)*/ & ~/[ \t\n]*\{(.|\n)*/ & ~/(.|\n)*<\|python_tag\|>(.|\n)*/"]
        else:
            lines.append(f"start: {calls}")
        for i, tool in enumerate(offered):
            lines.append(f"fn_{i}: %json {json.dumps(call_schema(tool, self.arguments_key))}")
        return "\n".join(lines) + "\n"

    def parser(self) -> JsonToolCallParser:
        return JsonToolCallParser(None, "", arguments_key=self.arguments_key, openings=("{", self.open_tag),
                                  separator=";")

    def system_prompt(self, tools: Sequence[ToolSpec]) -> str:
        """How the tools are offered to a model whose chat template has no place for them, in Llama 3's words."""
        listed = "\n\n".join(json.dumps({"type": "function", "function": function_json(t)}, indent=4) for t in tools)
        return ("Given the following functions, please respond with a JSON for a function call with its proper "
                "arguments that best answers the given prompt.\n\nRespond in the format {\"name\": function name, "
                "\"parameters\": dictionary of argument name and its value}. Do not use variables.\n\n" + listed)

    def render_calls(self, calls: Sequence[tuple[str, Any]]) -> str:
        """Calls as the model writes them (an earlier assistant turn, for templates without tool support)."""
        return "; ".join(json.dumps({"name": name, self.arguments_key: arguments}) for name, arguments in calls)

    def template_call_id(self, call_id: str) -> str:
        return call_id


class ListToolFormat(Answering):
    """A tag, then one JSON list of calls, the reply nothing but them: ``TAG [{"name": ..., "arguments":
    {...}}, ...]`` (Granite 3.0's ``<|tool_call|>``, Phi-4-mini's ``functools``; Mistral's below). ``tag_id``:
    the tag's token id where it is a special token of the vocabulary (then it is not in the text, and a reply
    that opens with ``[{`` is the calls)."""

    def __init__(self, tag: str, tag_id: int | None = None) -> None:
        self.open_tag = tag
        self.tag_id = tag_id

    def grammar(self, tools: Sequence[ToolSpec], choice: ToolChoice, parallel: bool) -> str:
        """The Lark grammar (llguidance's dialect) of a reply under ``choice`` ("none" has none): the tag, then
        the list of calls; under auto, or text that neither opens with ``[{`` nor spells the tag anywhere."""
        assert choice.mode != "none"
        offered = [t for t in tools if choice.mode != "function" or t.name == choice.name]
        items = 'fn (", " fn)*' if parallel and choice.mode != "function" else "fn"
        if self.tag_id is not None:
            opening = f'<[{self.tag_id}]> " "? "["'
        else:  # one lexeme with the list's bracket: text, which may write the tag but not before a list, ends there
            opening = f"({json.dumps(self.open_tag + '[')} | {json.dumps(self.open_tag + ' [')})"
        lines = ["%llguidance {}", "fn: " + " | ".join(f"fn_{i}" for i in range(len(offered))),
                 f'calls: {opening} {items} "]"']
        if choice.mode == "auto" and self.answer is not None:
            lines += ["start: answer | calls", *self.answer_rules()]
        elif choice.mode == "auto":  # text neither opens like the list nor writes the tag before a list
            lines += ["start: TEXT | calls", r"TEXT: /(.|\n)*/ & ~/[ \t\n]*\[\{(.|\n)*/ & ~/(.|\n)*"
                      + regex_literal(self.open_tag) + r" ?\[(.|\n)*/"]
        else:
            lines.append("start: calls")
        for i, tool in enumerate(offered):
            lines.append(f"fn_{i}: %json {json.dumps(call_schema(tool))}")
        return "\n".join(lines) + "\n"

    def parser(self) -> JsonToolCallParser:
        return JsonToolCallParser(None, "", openings=(f"{self.open_tag}[", f"{self.open_tag} [", "[{"), separator=",",
                                  call_list=True,
                                  new_call_id=self.new_call_id,
                                  answer_opening="{" if self.answer is not None else None)

    def new_call_id(self) -> str:
        return new_openai_call_id()

    after_tag = ""  # what the family writes between the tag and the list

    def offered(self, listed: str) -> str:
        """The tools (``listed`` as JSON) as the family's prompt lays them out."""
        return f"You can call these tools: {listed}"

    def system_prompt(self, tools: Sequence[ToolSpec]) -> str:
        """How the tools are offered to a model whose chat template has no place for them."""
        listed = json.dumps([{"type": "function", "function": function_json(t)} for t in tools])
        return (f"{self.offered(listed)}\n\nTo call one or more of them, reply with {self.open_tag} and a JSON list "
                f'of the calls: {self.open_tag}{self.after_tag}[{{"name": tool name, "arguments": arguments '
                "object}, more calls].")

    def render_calls(self, calls: Sequence[tuple[str, Any]]) -> str:
        """Calls as the model writes them (an earlier assistant turn, for templates without tool support)."""
        listed = json.dumps([{"name": name, "arguments": arguments} for name, arguments in calls])
        return f"{self.open_tag}{self.after_tag}{listed}"

    def template_call_id(self, call_id: str) -> str:
        return call_id


class MistralToolFormat(ListToolFormat):
    """Mistral's calls, as the chat templates of Mistral 7B Instruct v0.3, Mixtral 8x22B, Nemo and Small write
    them: ``[TOOL_CALLS] [{"name": ..., "arguments": {...}}, ...]`` (as vLLM's mistral parser reads them), with
    ids of nine letters and digits, the only ids its templates take."""

    def __init__(self, tag_id: int | None = None) -> None:
        super().__init__("[TOOL_CALLS]", tag_id)

    after_tag = " "

    def new_call_id(self) -> str:
        return "".join(secrets.choice(_ALPHANUMERIC) for _ in range(9))

    def offered(self, listed: str) -> str:
        return f"[AVAILABLE_TOOLS] {listed}[/AVAILABLE_TOOLS]"

    def template_call_id(self, call_id: str) -> str:
        """A call's id as Mistral's templates take it: nine letters and digits. An id of that form is kept; any
        other becomes nine derived from all of it (not cut, as vLLM cuts it to its last nine: ``call_1_weather``
        and ``call_2_weather`` would meet), the same each time, so a conversation renders the same each turn."""
        if len(call_id) == 9 and all(c in _ALPHANUMERIC for c in call_id):
            return call_id
        digest = hashlib.sha256(call_id.encode()).digest()
        return "".join(_ALPHANUMERIC[b % len(_ALPHANUMERIC)] for b in digest[:9])
