"""Reading tool calls back out of a reply as it streams: what a parser gives (``ParsedToolCall``,
``ParsedDelta``), what every format's parser shares (``StreamingParser``), and the parser of JSON calls that
hermes's, Llama 3's and the tagged-list formats use (``JsonToolCallParser``). The formats themselves, and
their grammars, are in ``tool_calls.py`` and beside it."""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal

from kvserve.reasoning import partial_suffix

# The blanks the grammars allow before a call opens (``[ \t\n]``): a parser strips only these, so that a reply
# the grammar took for text (opening with another space character) is never read as calls.
CALL_BLANKS = " \t\n"


def new_openai_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


@dataclass(slots=True)
class ParsedToolCall:
    """A call read from the output. ``arguments`` is the JSON text of the arguments, as the model wrote it."""

    index: int
    name: str
    arguments: str
    id: str = field(default_factory=lambda: new_openai_call_id())


@dataclass(slots=True)
class ParsedDelta:
    """What one piece of streamed text adds: content, and per call its header (id and name, once) and
    argument text."""

    content: str = ""
    calls: list[tuple[ParsedToolCall, bool, str]] = field(default_factory=list)  # (call, is_new, arguments)

    def __bool__(self) -> bool:
        return bool(self.content or self.calls)


class StreamingParser:
    """What the formats' parsers share: the calls read so far, the content given out, and the text held back
    until the next piece tells what it is. A format's parser reads in ``_read`` (returning what it left for its
    next step, or holding it in ``_held``) and ends the reply in ``_finish``."""

    def __init__(self) -> None:
        self.calls: list[ParsedToolCall] = []
        self.incomplete = False  # the reply ended inside a call, or a call is not of the format
        self._held = ""  # text not yet given out
        self._content_parts: list[str] = []
        self._after_call = False  # no content since the last call closed

    @property
    def content(self) -> str:
        """All content given out so far."""
        return "".join(self._content_parts)

    def feed(self, text: str) -> ParsedDelta:
        delta = ParsedDelta()
        pending = self._held + text
        self._held = ""
        while pending:
            pending = self._read(pending, delta)
        self._content_parts.append(delta.content)
        return delta

    def finish(self) -> ParsedDelta:
        """The end of the reply: held text is content where it can be no call; a call cut short is incomplete."""
        delta = ParsedDelta()
        self._finish(delta)
        self._held = ""
        self._content_parts.append(delta.content)
        return delta

    def _read(self, pending: str, delta: ParsedDelta) -> str:
        raise NotImplementedError

    def _finish(self, delta: ParsedDelta) -> None:
        raise NotImplementedError

    def _emit(self, text: str, delta: ParsedDelta) -> None:
        if self._after_call:  # the whitespace between calls (or after the last) is not content
            text = text.lstrip(CALL_BLANKS)
            self._after_call = not text
        delta.content += text

    def _text_before(self, tag: str, pending: str, delta: ParsedDelta) -> str | None:
        """Text up to ``tag``, as content: what follows the tag, or None where it is not in ``pending`` (then
        what may be the start of it, and the blanks before that, wait for the next piece)."""
        at = pending.find(tag)
        if at >= 0:
            self._emit(pending[:at].rstrip(CALL_BLANKS), delta)  # whitespace before a tag is not content
            return pending[at + len(tag):]
        keep = partial_suffix(pending, tag)
        body = pending[: len(pending) - keep]
        text = body.rstrip(CALL_BLANKS)  # trailing whitespace waits: a tag may follow it
        self._emit(text, delta)
        self._held = body[len(text):] + pending[len(pending) - keep:]
        return None

    def _new_call(self, name: str, delta: ParsedDelta, call_id: str | None = None) -> ParsedToolCall:
        """A call whose name is read: its header goes out."""
        call = ParsedToolCall(len(self.calls), name, "", *(() if call_id is None else (call_id,)))
        self.calls.append(call)
        delta.calls.append((call, True, ""))
        return call

    def _add_arguments(self, text: str, delta: ParsedDelta) -> None:
        """More of the last call's arguments' JSON text."""
        call = self.calls[-1]
        call.arguments += text
        if delta.calls and delta.calls[-1][0] is call:
            entry = delta.calls[-1]
            delta.calls[-1] = (call, entry[1], entry[2] + text)
        else:
            delta.calls.append((call, False, text))


class JsonToolCallParser(StreamingParser):
    """Reads one reply's JSON calls (hermes's, Llama 3's, Mistral's) as it streams: ``feed`` each new piece of
    text, then ``finish``.

    Text outside calls is content, except what may be the start of a tag, and whitespace that a tag may
    follow, which wait for the next piece. Inside a call the JSON is scanned character by character: the
    header (id, name) goes out once the name is read; argument text goes out as it arrives.
    """

    def __init__(self, open_tag: str | None, close_tag: str, arguments_key: str = "arguments",
                 openings: tuple[str, ...] = ("{", "```json"), separator: str | None = None,
                 call_list: bool = False, new_call_id: Callable[[], str] | None = None,
                 answer_opening: str | None = None, bare_call_key: str | None = None) -> None:
        """``open_tag``: what opens a call inside text (None: calls come only at the reply's start);
        ``openings``: what a reply that is a bare call opens with; ``separator``: what may stand between two
        bare calls besides whitespace; ``call_list``: the calls after an opening are a JSON list of them (each
        opening ends with the list's bracket, or with ``[{``); ``new_call_id``: the ids
        calls get (OpenAI's ``call_...`` by default); ``answer_opening``: a reply that opens with it is an answer
        (a response format's JSON), content to its end, unless its first key is ``bare_call_key`` (then it is a
        bare call)."""
        self.open_tag = open_tag
        self.close_tag = close_tag
        self.arguments_key = arguments_key
        self.openings = openings
        self.separator = separator
        self.call_list = call_list
        self.new_call_id = new_call_id or new_openai_call_id
        self.answer_opening = answer_opening
        self.bare_call_key = bare_call_key
        super().__init__()
        self._mode: Literal["text", "call", "close", "answer"] = "text"
        self._scanner: _CallScanner | None = None
        self._at_start = True  # nothing but whitespace read yet
        self._bare = False  # the current call has no tags
        self._list_closed = False  # call_list: the list's closing bracket was read

    def _read(self, pending: str, delta: ParsedDelta) -> str:
        if self._mode == "answer":
            return self._answer(pending, delta)
        if self._mode == "text":
            return self._text(pending, delta)
        if self._mode == "call":
            return self._call(pending, delta)
        return self._close(pending, delta)

    def _finish(self, delta: ParsedDelta) -> None:
        if self._mode in ("text", "answer"):
            self._emit(self._held.rstrip(CALL_BLANKS) if self.calls else self._held, delta)
        elif self._mode == "call" or (self._mode == "close" and self.call_list and not self._list_closed):
            self.incomplete = True  # inside a call, or a list of calls that never closed

    def _text(self, pending: str, delta: ParsedDelta) -> str:
        if self._at_start:  # a reply that opens with a JSON object (or a json fence) is a bare call
            stripped = pending.lstrip(CALL_BLANKS)
            if self.answer_opening is not None and stripped.startswith(self.answer_opening):
                if self.bare_call_key is not None:
                    key = _first_key(stripped)
                    if key is None:  # not yet read
                        self._held = pending
                        return ""
                    if key == self.bare_call_key:
                        return self._open_call(stripped, bare=True)
                self._mode = "answer"
                return pending
            opening = next((f for f in self.openings if stripped.startswith(f)), None)
            if opening is not None:
                if self.call_list:  # from the list's bracket (each opening ends with it, or with "[{")
                    return self._open_calls(stripped[len(opening) - (2 if opening.endswith("[{") else 1):])
                return self._open_call(stripped[len(opening):] if opening != "{" else stripped, bare=True)
            if not stripped or any(f.startswith(stripped) for f in self.openings) or (
                    self.answer_opening is not None and self.answer_opening.startswith(stripped)):
                self._held = pending
                return ""
            self._at_start = False
        if self.open_tag is None:  # text to the end: calls open only the reply
            self._emit(pending, delta)
            return ""
        rest = self._text_before(self.open_tag, pending, delta)
        if rest is None:
            return ""
        return self._open_calls(rest) if self.call_list else self._open_call(rest, bare=False)

    def _answer(self, pending: str, delta: ParsedDelta) -> str:
        self._emit(pending, delta)
        return ""

    def _open_calls(self, rest: str) -> str:
        """A list of calls opens: its bracket, calls and separators are read as between two bare calls."""
        self._at_start = False
        self._mode = "close"
        self._bare = True
        return rest

    def _open_call(self, rest: str, bare: bool) -> str:
        self._mode = "call"
        self._bare = bare
        self._scanner = _CallScanner(self.arguments_key)
        return rest.lstrip(CALL_BLANKS) if bare else rest

    def _call(self, pending: str, delta: ParsedDelta) -> str:
        scanner = self._scanner
        assert scanner is not None
        used = scanner.feed(pending)
        call = scanner.call
        if call is None and scanner.name is not None:
            call = scanner.call = self._new_call(scanner.name, delta, self.new_call_id())
        if call is not None and (new_arguments := scanner.arguments_text()[len(call.arguments):]):
            self._add_arguments(new_arguments, delta)
        if scanner.done:
            self._mode = "close"
        return pending[used:]

    def _close(self, pending: str, delta: ParsedDelta) -> str:
        stripped = pending.lstrip(CALL_BLANKS)
        if not stripped:
            self._held = pending
            return ""
        if self._bare:  # after a bare call: a closing fence, another bare call, or text
            if stripped.startswith("```"):
                return stripped[3:]
            if "```".startswith(stripped):
                self._held = pending
                return ""
            if stripped.startswith("{"):
                return self._open_call(stripped, bare=True)
            if self.separator and stripped.startswith(self.separator):
                return self._open_call(stripped[len(self.separator):], bare=True)
            if self.call_list and stripped[0] in "[]":  # the list's brackets (the grammar places them)
                self._list_closed = stripped[0] == "]"
                return stripped[1:]
            self._mode = "text"
            self._after_call = True
            return stripped
        if stripped.startswith(self.close_tag):
            self._mode = "text"
            self._scanner = None
            self._after_call = True
            return stripped[len(self.close_tag):]
        if self.close_tag.startswith(stripped):
            self._held = pending
            return ""
        self._mode = "text"  # no closing tag: what follows is text
        self._after_call = True
        return stripped


_FIRST_KEY = re.compile(r'\{[ \t\n]*"((?:[^"\\]|\\.)*)"')
_KEY_UNREAD = re.compile(r'\{[ \t\n]*("(?:[^"\\]|\\.)*\\?)?')


def _first_key(text: str) -> str | None:
    """The first key of the JSON object ``text`` opens: "" where it has none (``{}``), None where it is not read
    yet."""
    if (found := _FIRST_KEY.match(text)) is not None:
        try:
            key = json.loads(f'"{found.group(1)}"')
        except ValueError:
            return ""
        return key if isinstance(key, str) else ""
    return None if _KEY_UNREAD.fullmatch(text) else ""


class _CallScanner:
    """Scans the JSON object of one call as it arrives: where its name and its arguments are, and its end.
    ``arguments_key``: the key the format writes the arguments under."""

    def __init__(self, arguments_key: str = "arguments") -> None:
        self.arguments_key = arguments_key
        self.raw = ""
        self.depth = 0
        self.in_string = False
        self.escaped = False
        self.done = False
        self.name: str | None = None
        self.call: ParsedToolCall | None = None
        self._key: str | None = None  # the depth-1 key whose value is being read
        self._key_start: int | None = None
        self._expect_key = False
        self._value_start: int | None = None
        self._arguments: tuple[int, int | None] | None = None  # [start, end) in raw

    def feed(self, text: str) -> int:
        """Consume characters of ``text`` up to the end of the object; returns how many were used."""
        for i, char in enumerate(text):
            if self.done:
                return i
            position = len(self.raw)
            self.raw += char
            self._step(char, position)
        return len(text)

    def _step(self, char: str, position: int) -> None:
        if self.in_string:
            if self.escaped:
                self.escaped = False
            elif char == "\\":
                self.escaped = True
            elif char == '"':
                self.in_string = False
                if self.depth == 1 and self._expect_key and self._key_start is not None:
                    self._key = json.loads(self.raw[self._key_start: position + 1])
                    self._key_start = None
                elif self.depth == 1 and self._key == "name" and self._value_start is not None:
                    name = json.loads(self.raw[self._value_start: position + 1])
                    self.name = name if isinstance(name, str) else None
            return
        if char == '"':
            self.in_string = True
            if self.depth == 1 and self._expect_key:
                self._key_start = position
            elif self.depth == 1 and self._value_start is None:
                self._begin_value(position)
            return
        if char in "{[":
            if self.depth == 1 and not self._expect_key and self._value_start is None:
                self._begin_value(position)
            self.depth += 1
            if self.depth == 1:
                self._expect_key = True
            return
        if char in "}]":
            self.depth -= 1
            if self.depth == 1 and self._key == self.arguments_key and self._arguments is not None:
                self._arguments = (self._arguments[0], position + 1)
            if self.depth == 0:
                self._end_value(position)
                self.done = True
            return
        if self.depth != 1 or char.isspace():
            return
        if char == ":":
            self._expect_key = False
        elif char == ",":
            self._end_value(position)
            self._expect_key = True
            self._key = None
            self._value_start = None
        elif self._value_start is None and not self._expect_key:
            self._begin_value(position)  # a number, true, false or null

    def _begin_value(self, position: int) -> None:
        self._value_start = position
        if self._key == self.arguments_key:
            self._arguments = (position, None)

    def _end_value(self, position: int) -> None:
        if self._key == self.arguments_key and self._arguments is not None and self._arguments[1] is None:
            self._arguments = (self._arguments[0], position)

    def arguments_text(self) -> str:
        """The arguments' JSON text read so far (all of it once their value has ended)."""
        if self._arguments is None or self.name is None:
            return ""
        start, end = self._arguments
        text = self.raw[start:end] if end is not None else self.raw[start:]
        return text.rstrip() if end is not None else text
