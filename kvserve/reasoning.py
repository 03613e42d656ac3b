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
import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, AnyStr, Generic, TypeVar

from kvserve.errors import ConfigError

if TYPE_CHECKING:
    from kvserve.tokenizer import Tokenizer

# What counts as blank around markers: ASCII whitespace, the same in text (the server) and in bytes (the engine).
BLANKS = " \t\n\r\x0b\x0c"


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
    if end >= 0 and not prompt[end + len(markers.end):].strip(BLANKS):
        return Phase.ANSWER
    return Phase.OPEN


@dataclass(frozen=True, slots=True)
class ReasoningTokens:
    """The markers for the engine, which follows each reply token by token: as the tokenizer writes them (one
    special token each in Qwen3's and DeepSeek-R1's vocabularies), and each token's bytes, since a model may
    write a marker in other pieces than the tokenizer would."""

    markers: ReasoningMarkers
    start_ids: tuple[int, ...]
    end_ids: tuple[int, ...]
    token_bytes: Callable[[int], bytes]
    encode: Callable[[str], tuple[int, ...]]  # text -> token ids, nothing added

    @classmethod
    def of(cls, markers: ReasoningMarkers | None, tokenizer: Tokenizer) -> ReasoningTokens | None:
        """The markers as ``tokenizer`` writes them, and its tokens' bytes (cached: the runner reads one per
        thought token); None without markers."""
        if markers is None:
            return None

        def encode(text: str) -> tuple[int, ...]:
            return tuple(tokenizer.encode(text, add_special_tokens=False))

        start_ids, end_ids = encode(markers.start), encode(markers.end)
        if not start_ids or not end_ids:
            raise ConfigError(f"the tokenizer writes the reasoning markers {markers.start!r} / {markers.end!r} as no "
                              "tokens", "reasoning_parser")
        return cls(markers, start_ids, end_ids, functools.lru_cache(maxsize=1 << 16)(tokenizer.token_bytes), encode)

    def is_blank(self, ids: Sequence[int]) -> bool:
        return all(not self.token_bytes(t).strip() for t in ids)

    def phase_after_prompt(self, prompt_ids: Sequence[int]) -> Phase:
        """``phase_after_prompt`` on a prompt's token ids (its markers as the tokenizer writes them): for prompts
        given as they are (completions, offline), where no chat template says what its generation prompt adds."""
        start, end = _last_index(prompt_ids, self.start_ids), _last_index(prompt_ids, self.end_ids)
        if start > end:
            return Phase.THINKING
        if end >= 0 and self.is_blank(prompt_ids[end + len(self.end_ids):]):
            return Phase.ANSWER
        return Phase.OPEN


def constrained_phase(phase: Phase, tokens: ReasoningTokens, constrained: bool) -> Phase:
    """``phase`` as a grammar sees it: a constrained reply free to open a block whose start marker is several
    tokens answers at once (only a one-token marker is allowed beside a grammar's tokens)."""
    if constrained and phase is Phase.OPEN and len(tokens.start_ids) != 1:
        return Phase.ANSWER
    return phase


def _last_index(ids: Sequence[int], pattern: tuple[int, ...]) -> int:
    """Where ``pattern`` last starts in ``ids`` (-1: nowhere)."""
    backwards = list(reversed(ids))
    at = 0
    while pattern:
        try:
            at = backwards.index(pattern[-1], at)
        except ValueError:
            break
        last = len(backwards) - 1 - at
        first = last - len(pattern) + 1
        if first >= 0 and tuple(ids[first:last + 1]) == pattern:
            return first
        at += 1
    return -1


class ReasoningGate:
    """One reply's place in its thoughts, token by token: where its answer (and its grammar) begins, and the
    end marker forced once its thinking budget is spent (``thinking_token_budget``, vLLM's; llama.cpp's
    ``--reasoning-budget``). Markers are found in the tokens' bytes, however the model splits them."""

    __slots__ = ("_tokens", "phase", "budget", "num_thought_tokens", "_seen", "_forced")

    def __init__(self, tokens: ReasoningTokens, phase: Phase, budget: int | None = None) -> None:
        self._tokens = tokens
        self.phase = phase
        self.budget = budget  # thought tokens before the end marker is forced (None: no limit)
        self.num_thought_tokens = 0
        # OPEN: the reply so far (blanks, the start marker begun); THINKING: the thoughts' last bytes, as many as
        # the end marker could have begun in
        self._seen = b""
        self._forced: list[int] = []  # the end marker's tokens still to force, once the budget is spent

    @property
    def forced_token(self) -> int | None:
        """The token the next step must take (the end marker's next, once the budget is spent), or None."""
        if self.phase is not Phase.THINKING or self.budget is None or self.num_thought_tokens < self.budget:
            return None
        if not self._forced:
            self._forced = list(self._rest_of_end())
        return self._forced[0]

    def _rest_of_end(self) -> tuple[int, ...]:
        """The tokens that close the block: the end marker as the tokenizer writes it (one token in Qwen3's and
        DeepSeek-R1's vocabularies: the one the model was trained to close with), or, for a marker of several
        tokens the thoughts already began, the tokens that finish it where they spell exactly its rest."""
        tokens = self._tokens
        end = tokens.markers.end.encode()
        begun = partial_suffix(self._seen, end) if len(tokens.end_ids) > 1 else 0
        if begun:
            rest = tokens.encode(end[begun:].decode())
            if rest and b"".join(tokens.token_bytes(t) for t in rest) == end[begun:]:
                return rest
        return tokens.end_ids

    def observe(self, token_id: int) -> bool:
        """A token joins the reply; True when it closed the block (the answer starts with the next token)."""
        if self.phase is Phase.ANSWER:
            return False
        data = self._tokens.token_bytes(token_id)
        markers = self._tokens.markers
        if self.phase is Phase.OPEN:
            seen = (self._seen + data).lstrip()
            start = markers.start.encode()
            if seen.startswith(start):
                self.phase, self._seen = Phase.THINKING, b""
                return self._thought(seen[len(start):])
            if start.startswith(seen):  # blanks, or the start marker begun
                self._seen = seen
            else:
                self.phase = Phase.ANSWER
            return False
        self.num_thought_tokens += 1
        if self._forced and self._forced[0] == token_id:
            self._forced.pop(0)
        return self._thought(data)

    def _thought(self, data: bytes) -> bool:
        end = self._tokens.markers.end.encode()
        window = self._seen + data
        if end in window:
            self.phase, self._seen, self._forced = Phase.ANSWER, b"", []
            return True
        self._seen = window[-(len(end) - 1):] if len(end) > 1 else b""
        return False

    @property
    def start_ids(self) -> tuple[int, ...]:
        return self._tokens.start_ids

    @property
    def may_open(self) -> bool:
        """The reply may still open a block with its next token (nothing but blanks so far)."""
        return self.phase is Phase.OPEN and not self._seen


T = TypeVar("T")


class AnswerTokens(Generic[T]):
    """Keeps what comes with each of a reply's answer tokens (a logprob entry) and drops its thoughts' (the
    markers and any blanks before the block included), token by token as the engine's gate reads them;
    ``phase``: where the prompt left the reply. A token read before the reply has chosen between a block and
    an answer (blanks, a start marker begun) is held until it chooses, or until the reply ends."""

    __slots__ = ("_gate", "_held")

    def __init__(self, tokens: ReasoningTokens, phase: Phase) -> None:
        self._gate = ReasoningGate(tokens, phase)
        self._held: list[T] = []

    def feed(self, token_id: int, item: T) -> list[T]:
        """What to send now: ``item`` if its token is the answer's, with any held before it."""
        gate = self._gate
        if gate.phase is Phase.ANSWER:
            return [item]
        closed = gate.observe(token_id)
        if gate.phase is Phase.OPEN:
            self._held.append(item)
            return []
        if closed or gate.phase is Phase.THINKING:
            self._held.clear()
            return []
        held, self._held = self._held, []  # answered without a block: what came before it is the answer's
        return [*held, item]

    def finish(self) -> list[T]:
        """At the reply's end: what is still held, unless it ended in its thoughts."""
        held, self._held = self._held, []
        return held if self._gate.phase is not Phase.THINKING else []


def count_reasoning_tokens(output_ids: Sequence[int], tokens: ReasoningTokens, phase: Phase) -> int:
    """How many of a reply's tokens are its thoughts (the markers included), as the engine's gate counts them;
    ``phase``: where the prompt left the reply."""
    answer: AnswerTokens[None] = AnswerTokens(tokens, phase)
    kept = sum(len(answer.feed(token_id, None)) for token_id in output_ids) + len(answer.finish())
    return len(output_ids) - kept


def template_message(message: dict[str, Any]) -> dict[str, Any]:
    """A chat message as a template reads it: an earlier reply's thoughts as ``reasoning_content`` (the name
    reasoning models' templates read), whichever name the client sent them under (vLLM's ``reasoning``)."""
    if "reasoning" in message and "reasoning_content" not in message:
        message = {k: v for k, v in message.items() if k != "reasoning"} | {"reasoning_content": message["reasoning"]}
    return message


def phase_of_reply(rendered: str, without_generation_prompt: str | None, markers: ReasoningMarkers,
                   continued: str | None = None) -> Phase:
    """Where a rendered chat leaves its reply, from what the generation prompt added to the conversation (a
    marker inside a message, a user's literal ``<think>``, says nothing of the reply). ``continued``: the final
    message's text, for a reply that continues it (thoughts only where that text opened a block)."""
    if continued is not None:
        return Phase.THINKING if phase_after_prompt(continued, markers) is Phase.THINKING else Phase.ANSWER
    if without_generation_prompt is not None and rendered.startswith(without_generation_prompt):
        return phase_after_prompt(rendered[len(without_generation_prompt):], markers)
    return phase_after_prompt(rendered, markers)  # a template that renders the conversation otherwise


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
                stripped = buffer.lstrip(BLANKS)
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
                    keep = partial_suffix(buffer, self._markers.end)
                    reasoning.append(self._thought(buffer[:len(buffer) - keep], final=False))
                    self._held = buffer[len(buffer) - keep:]
                    break
            else:
                if self._after_block:
                    buffer = buffer.lstrip(BLANKS)
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
        return "", held.lstrip(BLANKS) if self._after_block else held

    def _thought(self, text: str, final: bool) -> str:
        """Thought text to give out now: blanks at the block's start dropped, blanks at its end held until more
        thought follows them (dropped when the block ends)."""
        if not self._thought_begun:
            text = text.lstrip(BLANKS)
            if not text:
                return ""
            self._thought_begun = True
        text = self._blank_tail + text
        body = text.rstrip(BLANKS)
        self._blank_tail = "" if final else text[len(body):]
        return body


def partial_suffix(text: AnyStr, marker: AnyStr) -> int:
    """The length of the longest end of ``text`` that is a proper beginning of ``marker`` (0: none): what a
    stream holds back until the next piece says whether the marker (or a tag) comes."""
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
