"""Output tokens to text deltas, one engine step at a time: UTF-8 safe, and cut at stop strings."""

from __future__ import annotations

from collections.abc import Sequence

from kvserve.tokenizer import Tokenizer

# Prompt tokens decoded in front of the output so that the first output token decodes in context
# (SentencePiece drops the leading space of a sequence's first token): at least the first, more where the
# context would otherwise begin inside a character (byte-fallback vocabularies decode a run of byte tokens
# together, so a stray leading byte would corrupt the output's first character), at most the second.
_PROMPT_CONTEXT_TOKENS = 5
_MAX_PROMPT_CONTEXT_TOKENS = 24
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
        self._ids = self._prompt_context(prompt_token_ids)
        self._prefix_offset = 0
        # A prompt that ends inside a character leaves its last tokens unread: if the output's first bytes
        # finish that character, the text is theirs (as tokenizers' DecodeStream gives it); if not, it stays
        # the prompt's (``_unfinished``: the continuation bytes still wanted).
        tail, self._unfinished = self._incomplete_tail(self._ids)
        self._prompt_len = len(self._ids)
        self._read_offset = self._prompt_len - tail
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
        if self._unfinished:
            self._follow_unfinished(new_ids)
        self._ids.extend(int(i) for i in new_ids)
        return self._append(self._decode_pending(final=False), final=False, check_stop=check_stop)

    def flush(self) -> str:
        """At the end of the request: everything still held back (nothing once a stop string matched). A
        character the output ends inside of is left out (as vLLM does), never shown as U+FFFD."""
        if self.stopped is not None or self._finished:
            return ""
        self._finished = True
        return self._append(self._decode_pending(final=True), final=True)

    def _prompt_context(self, prompt_token_ids: Sequence[int]) -> list[int]:
        """The shortest tail of the prompt, of at least _PROMPT_CONTEXT_TOKENS, that begins a character."""
        for size in range(_PROMPT_CONTEXT_TOKENS, min(len(prompt_token_ids), _MAX_PROMPT_CONTEXT_TOKENS) + 1):
            first = self._tokenizer.token_bytes(prompt_token_ids[-size])
            if first and not _is_continuation(first[0]):
                return list(prompt_token_ids[-size:])
        return list(prompt_token_ids[-_PROMPT_CONTEXT_TOKENS:])

    def _incomplete_tail(self, ids: Sequence[int]) -> tuple[int, int]:
        """How many of ``ids``' last tokens hold a character their bytes do not finish, and how many bytes
        that character still wants ((0, 0): none)."""
        pieces = [self._tokenizer.token_bytes(i) for i in ids[-4:]]  # a character has at most four bytes
        data = b"".join(pieces)
        lead = next((i for i in range(len(data) - 1, -1, -1) if not _is_continuation(data[i])), None)
        if lead is None or len(data) - lead >= _utf8_length(data[lead]):
            return 0, 0
        end = len(data)
        for count, piece in enumerate(reversed(pieces), start=1):  # back to the token holding the lead byte
            end -= len(piece)
            if end <= lead:
                return count, _utf8_length(data[lead]) - (len(data) - lead)
        return 0, 0

    def _follow_unfinished(self, new_ids: Sequence[int]) -> None:
        """The output's first bytes against the prompt's unfinished character: finished, it is the output's;
        anything else, the prompt's tokens are all read and its text stays the prompt's."""
        for byte in b"".join(self._tokenizer.token_bytes(i) for i in new_ids):
            if not _is_continuation(byte):
                self._read_offset = self._prompt_len
                self._unfinished = 0
                return
            self._unfinished -= 1
            if not self._unfinished:
                return

    def _decode_pending(self, final: bool) -> str:
        decode = self._tokenizer.decode
        prefix_text = decode(self._ids[self._prefix_offset : self._read_offset], self._skip_special_tokens)
        full_text = decode(self._ids[self._prefix_offset :], self._skip_special_tokens)
        if final:  # the text before a character the output ends inside of; that character left out
            full_text = full_text.rstrip("\ufffd")
        if len(full_text) <= len(prefix_text) or full_text.endswith("\ufffd"):
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


def _is_continuation(byte: int) -> bool:
    """A UTF-8 byte that continues a character (0b10xxxxxx), never begins one."""
    return 0x80 <= byte < 0xC0


def _utf8_length(lead: int) -> int:
    """The bytes of the character a UTF-8 lead byte begins."""
    return 1 if lead < 0x80 else 2 if lead < 0xE0 else 3 if lead < 0xF0 else 4
