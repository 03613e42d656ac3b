"""Fill-in-the-middle layouts (kvserve/infill.py) on a stand-in tokenizer: which spellings count, the order of the
parts, and the BOS token where the tokenizer adds one."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest

from kvserve.errors import InvalidRequest
from kvserve.infill import FimTokens, fim_tokens_or_error

STARCODER = {"<fim_prefix>": 1, "<fim_middle>": 2, "<fim_suffix>": 3, "<fim_pad>": 4, "<file_sep>": 5, "<s>": 9}


@dataclass
class StandIn:
    vocab: dict[str, int]
    special: set[str]
    add_bos_token: bool = False
    encoded: list[str] = field(default_factory=list)

    @property
    def all_special_ids(self) -> frozenset[int]:
        return frozenset(self.vocab[t] for t in self.special)

    @property
    def bos_token_id(self) -> int | None:
        return self.vocab.get("<s>")

    def token_to_id(self, token: str) -> int | None:
        return self.vocab.get(token)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        assert not add_special_tokens
        self.encoded.append(text)
        return [100 + len(text)]


def test_starcoders_spelling_in_prefix_suffix_middle_order_with_its_end_tokens() -> None:
    tokenizer = StandIn(STARCODER, set(STARCODER))
    fim = FimTokens.of(tokenizer)  # type: ignore[arg-type]
    assert fim == FimTokens(prefix=1, suffix=3, middle=2, ends=(4, 5))
    assert fim.prompt(tokenizer, "ab", "cde") == [1, 102, 3, 103, 2]  # type: ignore[arg-type]
    assert tokenizer.encoded == ["ab", "cde"]
    tokenizer.add_bos_token = True
    assert fim.prompt(tokenizer, "ab", "cde")[:2] == [9, 1]  # type: ignore[arg-type]


def test_fim_spellings_that_are_not_special_tokens_do_not_count() -> None:
    plain = StandIn(STARCODER, {"<s>"})  # the strings are in the vocabulary as ordinary text
    assert FimTokens.of(plain) is None  # type: ignore[arg-type]
    with pytest.raises(InvalidRequest, match="no fill-in-the-middle tokens") as info:
        fim_tokens_or_error(plain, "tiny")  # type: ignore[arg-type]
    assert info.value.param == "suffix"
