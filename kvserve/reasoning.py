"""Reasoning models' thoughts, told apart from their answers.

Qwen3, QwQ and DeepSeek-R1 (and its distills) think between two markers, ``<think>`` and ``</think>``,
before they answer. Where a block stands decides what a token is:

- ``THINKING``: inside an open block. A chat template may open it in the prompt (DeepSeek-R1's distills,
  Qwen3's thinking-only models end their generation prompt with ``<think>``), or the model itself.
- ``OPEN``: no block is open and the prompt does not end on a closed one: the output may open one at its
  very start (Qwen3's hybrid models decide themselves whether to think).
- ``ANSWER``: the answer: after the block closed, or when the prompt ends on a closed block (a template that
  turns thinking off writes an empty block, as Qwen3's does for ``enable_thinking: false``).

The engine follows this on token ids (``ReasoningTokens``, the runner's gate: a grammar starts where the
answer does, and a thinking budget forces the end marker); the server follows it on text
(``ReasoningSplitter``: ``reasoning_content`` apart from ``content``). Both read the prompt the same way.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from kvserve.errors import ConfigError


class Phase(enum.Enum):
    OPEN = "open"
    THINKING = "thinking"
    ANSWER = "answer"


@dataclass(frozen=True, slots=True)
class ReasoningMarkers:
    """The text that opens and closes a model's thoughts."""

    start: str = "<think>"
    end: str = "</think>"


# vLLM's parser names; kvserve reads both kinds the same way, from where the prompt leaves the block.
REASONING_PARSERS: dict[str, ReasoningMarkers] = {"deepseek_r1": ReasoningMarkers(), "qwen3": ReasoningMarkers()}


def markers_for(parser: str, chat_template: str | None) -> ReasoningMarkers | None:
    """The markers ``parser`` names (``--reasoning-parser``); ``auto``: ``<think>`` ... ``</think>`` when the
    chat template writes both (a reasoning model's does), else none."""
    if parser == "none":
        return None
    if parser == "auto":
        think = ReasoningMarkers()
        return think if chat_template and think.start in chat_template and think.end in chat_template else None
    markers = REASONING_PARSERS.get(parser)
    if markers is None:
        raise ConfigError(f"reasoning_parser must be auto, none or one of {', '.join(REASONING_PARSERS)}, got "
                          f"{parser!r}", "reasoning_parser")
    return markers


def phase_after_prompt(prompt: str, markers: ReasoningMarkers) -> Phase:
    """Where a prompt leaves its output: inside a block it opened, right after one it closed, or free to open one."""
    start, end = prompt.rfind(markers.start), prompt.rfind(markers.end)
    if start > end:
        return Phase.THINKING
    if end >= 0 and not prompt[end + len(markers.end):].strip():
        return Phase.ANSWER
    return Phase.OPEN


@dataclass(frozen=True, slots=True)
class ReasoningTokens:
    """The markers as the tokenizer writes them, for the engine, which follows token ids."""

    start_ids: tuple[int, ...]
    end_ids: tuple[int, ...]
    # Whether these tokens are only whitespace: a prompt that ends on a closed block and blanks is an answer's.
    is_blank: Callable[[Sequence[int]], bool]

    def phase_after_prompt(self, prompt_ids: Sequence[int]) -> Phase:
        """``phase_after_prompt`` on token ids (markers written as the tokenizer writes them)."""
        start, end = _last_index(prompt_ids, self.start_ids), _last_index(prompt_ids, self.end_ids)
        if start > end:
            return Phase.THINKING
        if end >= 0 and self.is_blank(prompt_ids[end + len(self.end_ids):]):
            return Phase.ANSWER
        return Phase.OPEN


def _last_index(ids: Sequence[int], pattern: tuple[int, ...]) -> int:
    """Where ``pattern`` last starts in ``ids`` (-1: nowhere)."""
    if not pattern:
        return -1
    last = pattern[-1]
    for i in range(len(ids) - 1, len(pattern) - 2, -1):
        if ids[i] == last and tuple(ids[i - len(pattern) + 1: i + 1]) == pattern:
            return i - len(pattern) + 1
    return -1


def count_reasoning_tokens(output_ids: Sequence[int], tokens: ReasoningTokens, phase: Phase) -> int:
    """How many of an output's tokens are its thoughts (the markers included); ``phase``: where the prompt
    left it."""
    if phase is Phase.ANSWER:
        return 0
    if phase is Phase.OPEN:
        if tuple(output_ids[:len(tokens.start_ids)]) != tokens.start_ids:
            return 0
    begin = len(tokens.start_ids) if phase is Phase.OPEN else 0
    n = len(tokens.end_ids)
    for i in range(begin, len(output_ids) - n + 1):
        if tuple(output_ids[i:i + n]) == tokens.end_ids:
            return i + n
    return len(output_ids)


class ReasoningSplitter:
    """An output's text, fed as it streams, parted into thoughts and answer.

    ``feed`` returns the new (reasoning, content) text; what might still be the start of a marker is held back
    until the next piece tells. The thoughts are given without the blank lines around them, and the answer
    without the blanks between the block and itself. Any split of the text into pieces gives the same parts.
    """

    __slots__ = ("_markers", "_phase", "_held", "_blank_tail", "_thought_begun", "_after_block", "reasoning_seen")

    def __init__(self, markers: ReasoningMarkers, phase: Phase) -> None:
        self._markers = markers
        self._phase = phase
        self._held = ""  # text not given out yet: a marker's possible beginning
        self._blank_tail = ""  # blanks inside the thoughts, given out only when more thought follows
        self._thought_begun = False
        self._after_block = False  # the answer follows a block: its leading blanks are dropped
        self.reasoning_seen = phase is Phase.THINKING

    def feed(self, text: str) -> tuple[str, str]:
        reasoning: list[str] = []
        content: list[str] = []
        buffer = self._held + text
        self._held = ""
        while buffer:
            if self._phase is Phase.OPEN:
                stripped = buffer.lstrip()
                if self._markers.start.startswith(stripped):  # blanks, or the start marker begun: wait
                    self._held = buffer
                    break
                if stripped.startswith(self._markers.start):
                    self._phase, self.reasoning_seen = Phase.THINKING, True
                    buffer = stripped[len(self._markers.start):]
                else:
                    self._phase = Phase.ANSWER
            elif self._phase is Phase.THINKING:
                at = buffer.find(self._markers.end)
                if at >= 0:
                    reasoning.append(self._thought(buffer[:at], final=True))
                    self._phase, self._after_block = Phase.ANSWER, True
                    buffer = buffer[at + len(self._markers.end):]
                else:
                    keep = _partial_suffix(buffer, self._markers.end)
                    reasoning.append(self._thought(buffer[:len(buffer) - keep], final=False))
                    self._held = buffer[len(buffer) - keep:]
                    break
            else:
                if self._after_block:
                    buffer = buffer.lstrip()
                    if not buffer:
                        break
                    self._after_block = False
                content.append(buffer)
                break
        return "".join(reasoning), "".join(content)

    def finish(self) -> tuple[str, str]:
        """The text held back at the end of the output."""
        held, self._held = self._held, ""
        if self._phase is Phase.THINKING:
            return self._thought(held, final=True), ""
        if self._phase is Phase.OPEN:
            return "", held
        return "", held.lstrip() if self._after_block else held

    def _thought(self, text: str, final: bool) -> str:
        """Thought text to give out now: blanks at the block's start dropped, blanks at its end held until more
        thought follows them (dropped when the block ends)."""
        if not self._thought_begun:
            text = text.lstrip()
            if not text:
                return ""
            self._thought_begun = True
        text = self._blank_tail + text
        body = text.rstrip()
        self._blank_tail = "" if final else text[len(body):]
        return body


def _partial_suffix(text: str, marker: str) -> int:
    """The length of the longest end of ``text`` that begins ``marker`` (0: none)."""
    for size in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-size:]):
            return size
    return 0


def split_reasoning(text: str, markers: ReasoningMarkers, phase: Phase) -> tuple[str | None, str]:
    """A whole output's thoughts (None when it had no block) and its answer."""
    splitter = ReasoningSplitter(markers, phase)
    reasoning, content = splitter.feed(text)
    more_reasoning, more_content = splitter.finish()
    return (reasoning + more_reasoning if splitter.reasoning_seen else None), content + more_content
