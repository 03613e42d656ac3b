"""The checks a prompt passes before anything is queued."""

from __future__ import annotations

from typing import cast

import pytest

from kvserve.errors import InvalidRequest
from kvserve.input_processor import InputProcessor
from kvserve.request import SamplingParams
from kvserve.structured.grammar import GrammarCompiler
from tests.support.tiny_models import smollm2_tokenizer


def test_a_text_whose_tokens_pass_the_models_vocabulary_is_refused_not_looked_up() -> None:
    """A tokenizer may know more tokens than the model has embedding rows (added tokens); a text holding one
    ended the engine at its lookup, where ids sent as ids were refused."""
    tokenizer = smollm2_tokenizer()
    ids = tokenizer.encode("Hello world")
    cut = max(ids)  # the model's vocabulary ends just below the text's largest id
    processor = InputProcessor(tokenizer, cut, 512, cast(GrammarCompiler, None))
    with pytest.raises(InvalidRequest, match=f"token id {cut}, which its tokenizer knows") as info:
        processor.process("Hello world", SamplingParams(max_tokens=4))
    assert info.value.param == "prompt"
    with pytest.raises(InvalidRequest, match=r"integers in \[0, "):
        processor.process(ids, SamplingParams(max_tokens=4))
    wide = InputProcessor(tokenizer, cut + 1, 512, cast(GrammarCompiler, None))
    assert wide.process("Hello world", SamplingParams(max_tokens=4)).prompt_token_ids == ids
