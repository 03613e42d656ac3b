"""Tool calls as a Python list of calls, as Llama 3.2's and Llama 4's pythonic chat templates ask for them
(vLLM's ``pythonic`` parser reads the same)::

    [get_weather(city="Paris"), add(a=1, b=2)]

Keyword arguments only; values are Python literals (strings, numbers, ``True`` / ``False`` / ``None``, lists,
dicts), read with ``ast.literal_eval`` (never run) and given to the client as JSON. The grammar holds each
call to an offered function, its parameters by name in the schema's order (the required ones present), and
each value to its schema's type, enum or const; inside a value it does not hold string lengths, patterns or
numeric bounds. Function and parameter names must be Python identifiers, or the request is a 400.
"""

from __future__ import annotations

import ast
import json
import keyword
import re
import warnings
from collections.abc import Sequence
from typing import Any, Literal

from kvserve.errors import InvalidRequest
from kvserve.structured.call_parsers import CALL_BLANKS, ParsedDelta, StreamingParser
from kvserve.structured.tool_calls import Answering, ToolChoice, ToolSpec, function_json, ordered_parameters

_IDENTIFIER = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_OPENING = re.compile(r"\[[A-Za-z_][A-Za-z0-9_]*\(")
_OPENING_PREFIX = re.compile(r"\[([A-Za-z_][A-Za-z0-9_]*)?")
_ESCAPE = r"""\\(["'\\abfnrtv]|x[0-9a-fA-F]{2}|u([0-9a-cA-Ce-fE-F][0-9a-fA-F]{3}|[dD][0-7][0-9a-fA-F]{2}))"""
# Python values, written compactly (", " and ": "): a small model given free whitespace can spend its output on it.
_VALUE_RULES = [
    'pyval: PYSTR | PYNUM | "True" | "False" | "None" | pylist | pydict',
    'pylist: "[" (pyval (", " pyval)*)? "]"',
    'pydict: "{" (pyitem (", " pyitem)*)? "}"',
    'pyitem: PYSTR ": " pyval',
    # Escapes Python reads as one character of valid Unicode (no surrogate, no \N{...}, no octal), and no raw
    # line break, carriage return or NUL: every string the grammar allows is a Python literal of UTF-8 text.
    r"""PYSTR: /"([^"\\\n\r\x00]|ESC)*"|'([^'\\\n\r\x00]|ESC)*'/""".replace("ESC", _ESCAPE),
    "PYINT: /-?(0|[1-9][0-9]*)/",
    # an integer of any size, or a float well inside float's range (1e999 would be infinity, which JSON lacks)
    r"PYNUM: /-?(0|[1-9][0-9]*)|-?(0|[1-9][0-9]{0,15})(\.[0-9]+)?([eE][+-]?[0-9]{1,2})?/",
]
_TYPE_RULES = {"string": "PYSTR", "integer": "PYINT", "number": "PYNUM", "boolean": '("True" | "False")',
               "null": '"None"', "object": "pydict"}


class PythonicToolFormat(Answering):
    """``[f(a=1), g(b="x")]``: the reply nothing but the list. Under ``auto`` text may not open with ``[name(``
    (a JSON answer, which opens with ``{``, is read as text)."""

    open_tag = None  # no token opens the calls: tool_choice none biases nothing

    def grammar(self, tools: Sequence[ToolSpec], choice: ToolChoice, parallel: bool) -> str:
        """The Lark grammar (llguidance's dialect) of a reply under ``choice`` ("none" has none)."""
        assert choice.mode != "none"
        offered = [t for t in tools if choice.mode != "function" or t.name == choice.name]
        more = ' (", " fn)*' if parallel and choice.mode != "function" else ""
        # The list's bracket and the first call's name and parenthesis are one lexeme: text, which may open with
        # "[" but not with "[name(", ends where that lexeme does (the lexer does not go back to a shorter one).
        lines = ["%llguidance {}", "fn: " + " | ".join(f"fn_{i}" for i in range(len(offered))),
                 "first: " + " | ".join(f"first_{i}" for i in range(len(offered))),
                 f'calls: first{more} "]"', *_VALUE_RULES]
        if choice.mode == "auto" and self.answer is not None:
            lines += ["start: answer | calls", *self.answer_rules()]
        elif choice.mode == "auto":
            lines += ["start: TEXT | calls", r"TEXT: /(.|\n)*/ & ~/[ \t\n]*\[[A-Za-z_][A-Za-z0-9_]*\((.|\n)*/"]
        else:
            lines.append("start: calls")
        for i, tool in enumerate(offered):
            lines += _function_rules(i, tool)
        return "\n".join(lines) + "\n"

    def parser(self) -> PythonicToolParser:
        return PythonicToolParser()

    def system_prompt(self, tools: Sequence[ToolSpec]) -> str:
        """How the tools are offered to a model whose chat template has no place for them."""
        listed = "\n\n".join(json.dumps({"type": "function", "function": function_json(t)}, indent=4) for t in tools)
        return ("You can call the functions below. To call functions, reply with nothing but a Python list of the "
                "calls, with keyword arguments: [func_name1(param_name1=value1, param_name2=value2), "
                "func_name2(param=value)]. Do not use variables.\n\n" + listed)

    def render_calls(self, calls: Sequence[tuple[str, Any]]) -> str:
        """Calls as the model writes them (an earlier assistant turn, for templates without tool support)."""
        written = []
        for name, arguments in calls:
            pairs = arguments.items() if isinstance(arguments, dict) else ()
            written.append(f"{name}({', '.join(f'{key}={python_literal(value)}' for key, value in pairs)})")
        return "[" + ", ".join(written) + "]"

    def template_call_id(self, call_id: str) -> str:
        return call_id


def python_literal(value: Any) -> str:
    """A JSON value as a Python literal."""
    if value is None or isinstance(value, bool):
        return repr(value)
    if isinstance(value, int | float):
        return repr(value)
    if isinstance(value, str):
        return json.dumps(value, ensure_ascii=False)  # a double-quoted JSON string is a Python string literal
    if isinstance(value, list):
        return "[" + ", ".join(python_literal(item) for item in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{python_literal(str(k))}: {python_literal(v)}" for k, v in value.items()) + "}"
    raise TypeError(f"not a JSON value: {type(value).__name__}")


def _function_rules(index: int, tool: ToolSpec) -> list[str]:
    """``fn_<index>``: one call of ``tool`` (``first_<index>``: the same opening the list). Its arguments in the schema's order: ``a_<i>_<j>`` is the arguments
    from the j-th parameter on, the first written without a comma, ``r_<i>_<j>`` the same each after ", "."""
    properties, required = ordered_parameters(tool)
    names = list(properties)
    for name in [tool.name, *names]:
        if not _IDENTIFIER.fullmatch(name) or keyword.iskeyword(name):
            raise InvalidRequest(f"the pythonic tool-call format writes calls as Python: {name!r} (in {tool.name!r}) "
                                 "is not a Python identifier", param="tools")
    count = len(names)
    lines = [f"fn_{index}: {json.dumps(tool.name + '(')} a_{index}_0 \")\"",
             f"first_{index}: {json.dumps('[' + tool.name + '(')} a_{index}_0 \")\"",
             f'a_{index}_{count}: ""', f'r_{index}_{count}: ""']
    for j in reversed(range(count)):
        keyword_rule, after = f"kw_{index}_{j}", f"r_{index}_{j + 1}"
        lines.append(f"{keyword_rule}: {json.dumps(names[j] + '=')} {_value(properties[names[j]])}")
        if names[j] in required:
            lines += [f"a_{index}_{j}: {keyword_rule} {after}", f'r_{index}_{j}: ", " {keyword_rule} {after}']
        else:
            lines += [f"a_{index}_{j}: {keyword_rule} {after} | a_{index}_{j + 1}",
                      f'r_{index}_{j}: (", " {keyword_rule})? {after}']
    return lines


def _value(schema: Any) -> str:
    """The grammar expression of a value of ``schema``: its const or enum, its branches, its types; any
    Python value where the schema says no more."""
    if not isinstance(schema, dict):
        return "pyval"
    if "const" in schema:
        return json.dumps(python_literal(schema["const"]))
    if isinstance(schema.get("enum"), list) and schema["enum"]:
        return "(" + " | ".join(json.dumps(python_literal(v)) for v in schema["enum"]) + ")"
    for key in ("anyOf", "oneOf"):
        if isinstance(schema.get(key), list) and schema[key]:
            return "(" + " | ".join(_value(branch) for branch in schema[key]) + ")"
    types = schema.get("type")
    types = [types] if isinstance(types, str) else types
    if not isinstance(types, list) or not types:
        return "pyval"
    return "(" + " | ".join(_typed_value(t, schema) for t in types) + ")"


def _typed_value(type_name: Any, schema: dict[str, Any]) -> str:
    if type_name == "array":
        item = _value(schema["items"]) if isinstance(schema.get("items"), dict) else "pyval"
        return f'("[" ({item} (", " {item})*)? "]")'
    return _TYPE_RULES.get(type_name, "pyval") if isinstance(type_name, str) else "pyval"


class PythonicToolParser(StreamingParser):
    """Reads one reply as it streams: ``feed`` each new piece of text, then ``finish``. A reply that opens with
    ``[name(`` is calls: each call's name goes out when its ``(`` is read, its arguments (as JSON) when its
    ``)`` is; text after the list is content. Any other reply is content, given out as it comes (only a
    beginning that may still open the calls waits)."""

    def __init__(self) -> None:
        super().__init__()  # incomplete also where a call is not valid Python
        self._mode: Literal["start", "text", "calls", "broken"] = "start"
        self._call_text = ""  # the current call as written, from its name
        self._depth = 0  # brackets open: 1 inside the list, 2 or more inside a call
        self._quote: str | None = None  # the quote of the string being read
        self._escaped = False

    def _read(self, pending: str, delta: ParsedDelta) -> str:
        if self._mode == "start":
            stripped = pending.lstrip(CALL_BLANKS)
            if _OPENING.match(stripped):
                self._mode = "calls"
                return stripped
            if not stripped or _OPENING_PREFIX.fullmatch(stripped):
                self._held = pending
                return ""
            self._mode = "text"
        if self._mode == "calls":
            return self._scan(pending, delta)
        if self._mode == "text":
            self._emit(pending, delta)  # after the list, its blanks are not content
        return ""

    def _finish(self, delta: ParsedDelta) -> None:
        if self._mode == "start":
            delta.content += self._held
        elif self._mode == "calls":
            self.incomplete = True

    def _scan(self, text: str, delta: ParsedDelta) -> str:
        """Reads the calls in ``text``; returns what follows the list."""
        for position, char in enumerate(text):
            if self._quote is not None:
                self._call_text += char
                if self._escaped:
                    self._escaped = False
                elif char == "\\":
                    self._escaped = True
                elif char == self._quote:
                    self._quote = None
                continue
            if char in "([{":
                self._depth += 1
                if self._depth > 1:
                    self._call_text += char
                if char == "(" and self._depth == 2:
                    self._new_call(self._call_text[:-1], delta)
                continue
            if char in ")]}":
                self._depth -= 1
                if self._depth == 0:
                    self._mode = "text"
                    self._after_call = True
                    return text[position + 1:]
                self._call_text += char
                if self._depth == 1 and not self._end_call(delta):
                    self._mode = "broken"
                    return ""
                continue
            if self._depth == 1 and (char == "," or char.isspace()):
                continue  # between calls
            if char in "\"'":
                self._quote = char
            self._call_text += char
        return ""

    def _end_call(self, delta: ParsedDelta) -> bool:
        """The current call is written: its arguments as JSON. False (and the reply incomplete) where it is not a
        call with keyword arguments of literal values."""
        call, text = self.calls[-1], self._call_text
        self._call_text = ""
        try:
            with warnings.catch_warnings():  # an invalid escape is a SyntaxWarning, not an error, before 3.14
                warnings.simplefilter("ignore", SyntaxWarning)
                node = ast.parse(text, mode="eval").body
            if (not isinstance(node, ast.Call) or not isinstance(node.func, ast.Name) or node.func.id != call.name
                    or node.args or any(k.arg is None for k in node.keywords)):
                raise ValueError(text)
            values = {k.arg: ast.literal_eval(k.value) for k in node.keywords}
            # JSON has no infinity (1e999), and the client's JSON no lone surrogate
            arguments = json.dumps(values, ensure_ascii=False, allow_nan=False)
            arguments.encode()
        except (SyntaxError, ValueError, TypeError, RecursionError, MemoryError):
            self.incomplete = True
            return False
        self._add_arguments(arguments, delta)
        return True
