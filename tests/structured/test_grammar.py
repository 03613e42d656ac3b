"""Compiling constraints: errors that name the field, the cache, the timeout, and masks that match the matcher."""

from __future__ import annotations

import threading

import pytest
import torch

from kvserve.config import StructuredOutputConfig
from kvserve.errors import InvalidRequest
from kvserve.model.cpu_kernels import load_cpu_kernels
from kvserve.model.loader import default_model_path
from kvserve.sampling_params import StructuredOutputsParams
from kvserve.structured import grammar as grammar_module
from kvserve.structured.grammar import GrammarCompiler, GrammarCompileTimeout
from kvserve.structured.masks import GrammarMasker
from kvserve.tokenizer import Tokenizer

PERSON = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
          "required": ["name", "age"], "additionalProperties": False}


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return Tokenizer.from_model_path(default_model_path())


@pytest.fixture
def compiler(tokenizer: Tokenizer) -> GrammarCompiler:
    compiler = GrammarCompiler(tokenizer, tokenizer.vocab_size, StructuredOutputConfig(compile_timeout_s=30))
    yield compiler
    compiler.close()


@pytest.mark.parametrize("spec, message", [
    (StructuredOutputsParams(json={"type": "strin"}, param="response_format"), "not a valid JSON Schema"),
    (StructuredOutputsParams(json='{"type": "object",', param="guided_json"), "not valid JSON"),
    (StructuredOutputsParams(json={"type": "integer", "minimum": 5, "maximum": 1}), "Unsatisfiable"),
    (StructuredOutputsParams(regex="(abc", param="guided_regex"), "unclosed group"),
    (StructuredOutputsParams(regex=r"[^\s\S]"), "matches no text"),
    (StructuredOutputsParams(grammar="start: undefined_rule"), "unknown name"),
])
def test_a_constraint_that_cannot_compile_is_a_400_naming_its_field(compiler: GrammarCompiler,
                                                                   spec: StructuredOutputsParams,
                                                                   message: str) -> None:
    with pytest.raises(InvalidRequest, match=message) as error:
        compiler.compile(spec)
    assert error.value.param == spec.param and error.value.http_status == 400
    assert compiler.stats.compile_errors == 1


def test_more_than_one_constraint_is_refused() -> None:
    with pytest.raises(InvalidRequest, match="exactly one"):
        StructuredOutputsParams(json=PERSON, regex="a+")
    with pytest.raises(InvalidRequest, match="exactly one"):
        StructuredOutputsParams()


def test_each_constraint_compiles_once(compiler: GrammarCompiler) -> None:
    first = compiler.compile(StructuredOutputsParams(json=PERSON, param="response_format"))
    again = compiler.compile(StructuredOutputsParams(json=dict(PERSON), param="guided_json"))  # same constraint
    assert again is first
    assert (compiler.stats.compiles, compiler.stats.cache_hits) == (1, 1)
    compiler.compile(StructuredOutputsParams(regex="[a-z]+"))
    assert compiler.stats.compiles == 2


def test_a_slow_compile_times_out_and_a_retry_finds_it_cached(compiler: GrammarCompiler,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    release = threading.Event()
    real = grammar_module.grammar_text

    def slow(spec: StructuredOutputsParams) -> str:
        release.wait(10)
        return real(spec)

    monkeypatch.setattr(grammar_module, "grammar_text", slow)
    spec = StructuredOutputsParams(regex="[0-9]+", param="guided_regex")
    with pytest.raises(GrammarCompileTimeout, match="did not compile within 0.05 s") as error:
        compiler.compile(spec, timeout_s=0.05)
    assert error.value.param == "guided_regex" and compiler.stats.timeouts == 1
    release.set()
    assert compiler.compile(spec, timeout_s=10).kind == "regex"
    assert compiler.stats.compiles == 1


def test_the_mask_allows_exactly_what_the_matcher_accepts(compiler: GrammarCompiler, tokenizer: Tokenizer) -> None:
    grammar = compiler.compile(StructuredOutputsParams(choice=("yes", "no", "maybe")))
    matchers = [grammar.new_matcher(), grammar.new_matcher()]
    assert matchers[1].accept(tokenizer.encode("ma", add_special_tokens=False)[0])
    vocab = tokenizer.vocab_size
    masker = GrammarMasker(compiler.mask_vocab_size)
    logits = torch.zeros(3, vocab + 7)  # padding columns past the vocabulary are never allowed
    masker.apply(logits, [0, 2], matchers)
    assert torch.isfinite(logits[1]).all()
    for row, matcher in ((0, matchers[0]), (2, matchers[1])):
        allowed = torch.isfinite(logits[row]).nonzero().flatten().tolist()
        assert allowed and all(t < vocab for t in allowed)
        sample = allowed[:: max(1, len(allowed) // 20)]
        assert all(matcher.valid_prefix([t]) == 1 for t in sample)
        refused = [t for t in range(0, vocab, 997) if t not in set(allowed)]
        assert all(matcher.valid_prefix([t]) == 0 for t in refused)
    assert masker.num_masked_rows == 2


def test_a_matcher_follows_a_document_to_its_end(compiler: GrammarCompiler, tokenizer: Tokenizer) -> None:
    matcher = compiler.compile(StructuredOutputsParams(json=PERSON)).new_matcher()
    tokens = tokenizer.encode('{"name": "Ada", "age": 36}', add_special_tokens=False)
    assert matcher.valid_prefix(tokens) == len(tokens)
    assert all(matcher.accept(t) for t in tokens)
    assert matcher.valid_prefix(tokenizer.encode(" more", add_special_tokens=False)) == 0
    assert matcher.accept(tokenizer.eos_token_ids[0]) and matcher.is_finished
    bad = compiler.compile(StructuredOutputsParams(json=PERSON)).new_matcher()
    assert not bad.accept(tokenizer.encode("[", add_special_tokens=False)[0]) and bad.is_error


@pytest.mark.skipif(load_cpu_kernels() is None, reason="the C++ kernels did not build")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_kernel_masks_exactly_as_the_torch_ops_do(compiler: GrammarCompiler, tokenizer: Tokenizer,
                                                      dtype: torch.dtype) -> None:
    grammars = [compiler.compile(StructuredOutputsParams(choice=("yes", "no"))),
                compiler.compile(StructuredOutputsParams(json=PERSON)),
                compiler.compile(StructuredOutputsParams(regex="[a-z ]+"))]
    matchers = [g.new_matcher() for g in grammars]
    assert matchers[1].accept(tokenizer.encode('{"', add_special_tokens=False)[0])
    logits = torch.randn(5, tokenizer.vocab_size + 37, generator=torch.Generator().manual_seed(0)).to(dtype)
    rows = [4, 0, 2]
    by_torch, by_kernel = logits.clone(), logits.clone()
    GrammarMasker(compiler.mask_vocab_size).apply(by_torch, rows, matchers)
    GrammarMasker(compiler.mask_vocab_size, torch.ops.kvserve.mask_logits).apply(by_kernel, rows, matchers)
    assert torch.equal(by_torch, by_kernel)
    assert torch.equal(by_kernel[[1, 3]], logits[[1, 3]])  # rows without a grammar are untouched
    assert all(0 < int(torch.isfinite(by_kernel[r]).sum()) < tokenizer.vocab_size for r in rows)


def test_a_prefetched_mask_serves_the_same_matchers_unchanged(compiler: GrammarCompiler, tokenizer: Tokenizer) -> None:
    grammar = compiler.compile(StructuredOutputsParams(choice=("yes", "no")))
    first, second = grammar.new_matcher(), grammar.new_matcher()
    masker = GrammarMasker(compiler.mask_vocab_size)
    masker.prefetch([first])
    prefetched = masker.bitmask([first])
    assert torch.equal(prefetched, masker.bitmask([first])) and masker.wait_for_prefetch() is None
    assert first.accept(tokenizer.encode("yes", add_special_tokens=False)[0])
    masker.prefetch([second])  # asked for other matchers: computed afresh, after the prefetch has finished
    assert not torch.equal(masker.bitmask([first]), prefetched)
    masker.prefetch([first])
    assert first.version == 1
    assert torch.equal(masker.bitmask([first]), masker.bitmask([first]))


def test_a_second_look_by_the_same_request_is_not_a_cache_hit(compiler: GrammarCompiler) -> None:
    spec = StructuredOutputsParams(regex="[a-z]+")
    compiler.compile(spec)
    compiler.compile(spec, count_hit=False)
    assert (compiler.stats.compiles, compiler.stats.cache_hits) == (1, 0)
    compiler.compile(spec)
    assert compiler.stats.cache_hits == 1
