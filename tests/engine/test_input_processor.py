"""The checks a prompt passes before anything is queued."""

from __future__ import annotations

from typing import cast

import pytest

from kvserve.errors import ContextLengthExceeded, InvalidRequest, InvalidSamplingParams
from kvserve.input_processor import InputProcessor
from kvserve.sampling_params import SamplingParams
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


def test_bad_words_are_tokenized_alone_and_after_a_space_and_ids_past_the_vocabulary_are_refused() -> None:
    tokenizer = smollm2_tokenizer()
    vocab = tokenizer.vocab_size
    processor = InputProcessor(tokenizer, vocab, 512, cast(GrammarCompiler, None))
    resolved = processor.resolve_params(SamplingParams(bad_words=("hello", " 5, 6", "hello")))
    hello, spaced = tokenizer.encode("hello", False), tokenizer.encode(" hello", False)
    assert len(hello) == len(spaced) == 1 and hello != spaced
    # " 5" is two tokens (a space, then the digit), not one: only the word as it begins the text is kept.
    assert tokenizer.encode(" 5, 6", False) == [216, *tokenizer.encode("5, 6", False)]
    assert resolved.bad_words_token_ids == (tuple(hello), tuple(spaced), tuple(tokenizer.encode("5, 6", False)))
    assert processor.resolve_params(resolved) is resolved  # once is enough: the route's and generate's
    narrow = InputProcessor(tokenizer, max(hello), 512, cast(GrammarCompiler, None))
    for params, field in ((SamplingParams(bad_words=("hello",)), "bad_words"),
                          (SamplingParams(allowed_token_ids=(1, max(hello))), "allowed_token_ids"),
                          (SamplingParams(logit_bias={max(hello): 1.0}), "logit_bias")):
        with pytest.raises(InvalidSamplingParams) as info:
            narrow.resolve_params(params)
        assert info.value.param == field


def test_truncate_prompt_tokens_keeps_the_prompts_last_tokens() -> None:
    tokenizer = smollm2_tokenizer()
    processor = InputProcessor(tokenizer, tokenizer.vocab_size, 32, cast(GrammarCompiler, None))
    text = "one two three four five six seven eight nine ten"
    ids = tokenizer.encode(text)
    kept = processor.process(text, SamplingParams(max_tokens=4, truncate_prompt_tokens=3))
    assert (kept.prompt_token_ids, kept.prompt) == (ids[-3:], None)  # the text is no longer the prompt's
    whole = processor.process(text, SamplingParams(max_tokens=4, truncate_prompt_tokens=len(ids)))
    assert (whole.prompt_token_ids, whole.prompt) == (ids, text)
    # -1: as many as fit with max_tokens after them; a prompt past the context is cut to fit instead of refused.
    long_ids = list(range(100, 140))
    with pytest.raises(ContextLengthExceeded):
        processor.process(long_ids, SamplingParams(max_tokens=4))
    assert processor.process(long_ids, SamplingParams(max_tokens=4, truncate_prompt_tokens=-1)
                             ).prompt_token_ids == long_ids[-28:]
    # A text longer than any prompt that fits is refused untokenized, unless it is to be cut.
    huge = "word " * (4 * 32 * tokenizer.max_token_chars)
    with pytest.raises(ContextLengthExceeded, match="characters"):
        processor.process(huge, SamplingParams(max_tokens=4))
    assert processor.process(huge, SamplingParams(max_tokens=4, truncate_prompt_tokens=8)
                             ).prompt_token_ids == tokenizer.encode(huge)[-8:]


def test_allowed_token_ids_that_nothing_else_allows_are_refused() -> None:
    """Every allowed token refused by a one-token bad word or, before min_tokens, ending the output: the first
    step would have no token to sample."""
    tokenizer = smollm2_tokenizer()
    processor = InputProcessor(tokenizer, tokenizer.vocab_size, 64, cast(GrammarCompiler, None))
    eos = tokenizer.eos_token_ids[0]
    five = tokenizer.encode("5", False)[0]
    for params in (SamplingParams(allowed_token_ids=(eos,), min_tokens=2),
                   SamplingParams(allowed_token_ids=(eos, 9), stop_token_ids=(9,), min_tokens=1),
                   SamplingParams(allowed_token_ids=(five,), bad_words=("5",)),
                   SamplingParams(allowed_token_ids=(five, eos), bad_words=("5",), min_tokens=1)):
        with pytest.raises(InvalidSamplingParams, match="no token could be sampled"):
            processor.resolve_params(params)
    for params in (SamplingParams(allowed_token_ids=(eos,)), SamplingParams(allowed_token_ids=(five, eos),
                                                                            bad_words=("5",)),
                   SamplingParams(allowed_token_ids=(five,), bad_words=("5, 6",))):
        processor.resolve_params(params)
