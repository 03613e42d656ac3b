"""Output tokens to text deltas, one engine step at a time: UTF-8 safe, and cut at stop strings."""

from __future__ import annotations

from collections.abc import Sequence

from kvserve.tokenizer import Tokenizer

# Prompt tokens decoded in front of the output so that the first output token decodes in context
# (SentencePiece drops the leading space of a sequence's first token).
_PROMPT_CONTEXT_TOKENS = 5
_TRIM_AFTER = 64  # drop consumed ids once this many precede the decode window


class IncrementalDetokenizer:
    """Turns a request's output tokens into text deltas, one call per engine step.

    Each call decodes only a small window of recent tokens (as vLLM and TGI do)::

        ids:   ... | prefix_offset ......... read_offset ........ end
                     '-- already emitted --'  '-- new tokens --'
        delta = decode(ids[prefix:]) minus decode(ids[prefix:read])

    A delta never ends in a partial UTF-8 character: while the decoded window ends in U+FFFD the
    tokens are held back. With stop strings, text that could begin one is held back until it is
    clear whether it does; on a match ``stopped`` names the string and the text ends before it (or
    after it with ``include_stop_str_in_output``).
    """

    def __init__(
        self,
        tokenizer: Tokenizer,
        prompt_token_ids: Sequence[int],
        skip_special_tokens: bool = True,
        stop: tuple[str, ...] = (),
        include_stop_str_in_output: bool = False,
    ) -> None:
        self._tokenizer = tokenizer
        self._skip_special_tokens = skip_special_tokens
        self._stop = tuple(s for s in stop if s)
        self._include_stop = include_stop_str_in_output
        self._ids = list(prompt_token_ids[-_PROMPT_CONTEXT_TOKENS:])
        self._prefix_offset = 0
        self._read_offset = len(self._ids)
        self._text = ""  # output text decoded so far, complete characters only, cut at a stop string
        self._num_emitted = 0  # characters of _text already returned as deltas
        self._finished = False
        self.stopped: str | None = None

    @property
    def text(self) -> str:
        """All output text so far (including text held back for a possible stop string)."""
        return self._text

    def add_tokens(self, new_ids: Sequence[int], check_stop: bool = True) -> str:
        """Append sampled tokens; return the text they add that is now safe to show. ``check_stop=False``
        (the output is still short of ``min_tokens``): no stop string ends it yet, though text that could
        begin one is still held back, so a string completed once the check is on is cut cleanly."""
        if self.stopped is not None or self._finished or not new_ids:
            return ""
        self._ids.extend(int(i) for i in new_ids)
        return self._append(self._decode_pending(final=False), final=False, check_stop=check_stop)

    def flush(self) -> str:
        """At the end of the request: everything still held back (nothing once a stop string matched)."""
        if self.stopped is not None or self._finished:
            return ""
        self._finished = True
        return self._append(self._decode_pending(final=True), final=True)

    def _decode_pending(self, final: bool) -> str:
        decode = self._tokenizer.decode
        prefix_text = decode(self._ids[self._prefix_offset : self._read_offset], self._skip_special_tokens)
        full_text = decode(self._ids[self._prefix_offset :], self._skip_special_tokens)
        if len(full_text) <= len(prefix_text) or (full_text.endswith("\ufffd") and not final):
            return ""  # nothing new, or a character is still incomplete
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._ids)
        if self._prefix_offset >= _TRIM_AFTER:
            del self._ids[: self._prefix_offset]
            self._read_offset -= self._prefix_offset
            self._prefix_offset = 0
        return full_text[len(prefix_text) :]

    def _append(self, new_text: str, final: bool, check_stop: bool = True) -> str:
        previous_len = len(self._text)
        self._text += new_text
        hold = 0
        if self._stop:
            match = self._find_stop(previous_len) if check_stop else None
            if match is not None:
                index, stop = match
                self.stopped = stop
                self._text = self._text[: index + len(stop) if self._include_stop else index]
                return self._emit(len(self._text))
            if not final:
                hold = self._partial_stop_len()
        return self._emit(max(self._num_emitted, len(self._text) - hold))

    def _emit(self, end: int) -> str:
        delta = self._text[self._num_emitted : end]
        self._num_emitted = max(self._num_emitted, end)
        return delta

    def _find_stop(self, previous_len: int) -> tuple[int, str] | None:
        """The earliest stop string in the text; only matches that end in the new text are new."""
        best: tuple[int, str] | None = None
        for stop in self._stop:
            index = self._text.find(stop, max(0, previous_len - len(stop) + 1))
            if index >= 0 and (
                best is None or index < best[0] or (index == best[0] and len(stop) > len(best[1]))
            ):
                best = (index, stop)
        return best

    def _partial_stop_len(self) -> int:
        """Length of the longest text suffix that is a proper prefix of some stop string."""
        text = self._text
        longest = 0
        for stop in self._stop:
            for length in range(min(len(stop) - 1, len(text)), longest, -1):
                if text.endswith(stop[:length]):
                    longest = length
                    break
        return longest
