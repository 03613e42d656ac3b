"""Structured output through the engine on the real SmolLM2: every output matches its constraint, and the
constraint composes with the prefix cache, speculation, batching and preemption without changing a token,
on either grammar engine."""

from __future__ import annotations

import json

import jsonschema
import pytest
import torch

from kvserve.config import StructuredOutputConfig
from kvserve.offline import LLM
from kvserve.sampling_params import SamplingParams, StructuredOutputsParams
from kvserve.structured.grammar import GrammarCompiler
from kvserve.structured.masks import GrammarMasker
from kvserve.tokenizer import Tokenizer
from tests.e2e.conftest import installed_model

pytestmark = pytest.mark.slow

SCHEMAS = [
    {"type": "object", "properties": {"name": {"type": "string", "maxLength": 24},
                                      "age": {"type": "integer", "minimum": 0, "maximum": 120}},
     "required": ["name", "age"], "additionalProperties": False},
    {"type": "object", "properties": {"colors": {"type": "array", "items": {"enum": ["red", "green", "blue"]},
                                                 "minItems": 1, "maxItems": 3}},
     "required": ["colors"], "additionalProperties": False},
    {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                      "temperature": {"type": "number", "minimum": -50, "maximum": 60},
                                      "sunny": {"type": "boolean"}},
     "required": ["city", "temperature", "sunny"], "additionalProperties": False},
]
QUESTIONS = ["Describe a person as JSON.", "Pick some colours.", "What is the weather like?"]
REGEX = r"[0-9]{4}-[0-9]{2}-[0-9]{2}"


def chats() -> list[list[dict[str, str]]]:
    return [[{"role": "user", "content": q}] for q in QUESTIONS]


def constrained(**options: object) -> list[SamplingParams]:
    return [SamplingParams(temperature=0.0, max_tokens=48, structured_outputs=StructuredOutputsParams(json=s),
                           **options) for s in SCHEMAS]


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(dtype="float32", num_kv_blocks=256, max_model_len=512)


@pytest.fixture(scope="module")
def greedy_texts(llm: LLM) -> list[str]:
    texts = [o.outputs[0].text for o in llm.chat(chats(), constrained())]
    for text, schema in zip(texts, SCHEMAS, strict=True):
        jsonschema.validate(json.loads(text), schema)
    return texts


def test_greedy_outputs_match_their_schemas(llm: LLM, greedy_texts: list[str]) -> None:
    unconstrained = [o.outputs[0].text for o in llm.chat(chats(), SamplingParams(temperature=0.0, max_tokens=48))]
    assert unconstrained != greedy_texts  # the constraint is what made them JSON
    stats = llm.engine.stats()
    assert stats.num_constrained_tokens > 0 and stats.grammar.compiles >= len(SCHEMAS)
    assert stats.grammar.xgrammar_compiles == 2  # the two schemas with length-bounded strings


def test_sampled_outputs_match_their_schemas(llm: LLM) -> None:
    for seed in range(2):
        params = [SamplingParams(temperature=1.0, top_p=0.95, seed=seed, max_tokens=64, repetition_penalty=1.1,
                                 logprobs=2, structured_outputs=StructuredOutputsParams(json=s)) for s in SCHEMAS]
        for output, schema in zip(llm.chat(chats(), params), SCHEMAS, strict=True):
            completion = output.outputs[0]
            if completion.finish_reason == "stop":
                jsonschema.validate(json.loads(completion.text), schema)
            assert all(lp[t] > float("-inf") for t, lp in zip(completion.token_ids, completion.logprobs, strict=True))


def test_regex_and_choice(llm: LLM) -> None:
    date, choice = llm.generate(["The date of the moon landing was", "Is the sky blue? Answer:"], [
        SamplingParams(temperature=0.0, max_tokens=16, structured_outputs=StructuredOutputsParams(regex=REGEX)),
        SamplingParams(temperature=0.0, max_tokens=8,
                       structured_outputs=StructuredOutputsParams(choice=("yes", "no"))),
    ])
    assert date.outputs[0].finish_reason == "stop"
    import re

    assert re.fullmatch(REGEX, date.outputs[0].text)
    assert choice.outputs[0].text in ("yes", "no")
    # min_tokens does not hold a constrained request past where its grammar ends (it was forced to EOS there,
    # step after step, until min_tokens).
    held = llm.generate(["Is the sky blue? Answer:"], SamplingParams(
        temperature=0.0, max_tokens=8, min_tokens=6, skip_special_tokens=False,
        structured_outputs=StructuredOutputsParams(choice=("yes", "no"))))[0].outputs[0]
    assert (held.text, held.finish_reason) == (choice.outputs[0].text, "stop")
    assert len(held.token_ids) == len(choice.outputs[0].token_ids)


@pytest.mark.parametrize("options", [
    {"speculative_config": {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "adaptive": False}},
    {"num_kv_blocks": 30, "block_size": 4, "max_num_batched_tokens": 64},  # preempts, and chunks prefills
    # Each engine alone (the default sends the two length-bounded schemas to xgrammar, the other to
    # llguidance): the same JSON, token for token; the first with the prefix cache off.
    {"grammar_engine": "llguidance", "enable_prefix_caching": False},
    {"grammar_engine": "xgrammar", "speculative_config": {"method": "ngram", "num_speculative_tokens": 4,
                                                          "prompt_lookup_min": 1, "adaptive": False}},
])
def test_the_same_tokens_with_the_cache_off_speculation_and_preemption(greedy_texts: list[str],
                                                                       options: dict[str, object]) -> None:
    other = LLM(dtype="float32", max_model_len=512, **{"num_kv_blocks": 256, **options})
    twice = other.chat(chats() + chats(), constrained() + constrained())  # the second round hits the cache
    assert [o.outputs[0].text for o in twice] == greedy_texts + greedy_texts
    stats = other.engine.stats()
    if options.get("grammar_engine") == "xgrammar":
        assert stats.grammar.xgrammar_compiles == len(SCHEMAS)
    if options.get("grammar_engine") == "llguidance":
        assert stats.grammar.xgrammar_compiles == 0
    if "block_size" in options:
        assert stats.num_preemptions > 0
    if "speculative_config" in options:
        assert stats.num_draft_tokens > 0
    other.engine.check_invariants()


def allowed_tokens(masker: GrammarMasker, matcher) -> set[int]:
    words = masker.bitmask([matcher])[0]
    return set(((words.unsqueeze(1) >> torch.arange(32)) & 1).flatten().nonzero().flatten().tolist())


# Gemma 3's 262k-token vocabulary takes CI a fifth of a minute: it runs with the heavy checks; CI keeps the
# byte-level BPE vocabularies of SmolLM2 and Qwen.
@pytest.mark.parametrize("model", ["smollm2-135m", "qwen2.5-coder-0.5b",
                                   pytest.param("gemma-3-270m", marks=pytest.mark.heavy)])
def test_both_engines_follow_a_bounded_schema_on_each_real_vocabulary(model: str) -> None:
    """Byte-level BPE (SmolLM2, Qwen2.5) and SentencePiece with byte fallback (Gemma 3): every token of
    matching documents is in each engine's mask and taken, no special token but the end is ever allowed,
    and a closed object allows only the end."""
    tokenizer = Tokenizer.from_model_path(installed_model(model))
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 20},
                                               "tags": {"type": "array", "items": {"type": "string", "maxLength": 8}},
                                               "n": {"type": "integer"}}, "required": ["name", "tags", "n"]}
    documents = [{"name": "Ada Lovelace", "tags": ["math", "ü"], "n": 36}, {"name": "x", "tags": [], "n": -1}]
    eos = set(tokenizer.eos_token_ids)
    special = {i for i, added in tokenizer.backend.get_added_tokens_decoder().items() if added.special} - eos
    for engine in ("llguidance", "xgrammar"):
        compiler = GrammarCompiler(tokenizer, tokenizer.vocab_size, StructuredOutputConfig(engine=engine))
        try:
            grammar = compiler.compile(StructuredOutputsParams(json=schema))
            assert grammar.engine == engine
            masker = GrammarMasker(compiler.mask_vocab_size)
            for document in documents:
                matcher = grammar.new_matcher()
                text = json.dumps(document, separators=(", ", ": "), ensure_ascii=False)
                for token_id in tokenizer.encode(text, add_special_tokens=False):
                    now = allowed_tokens(masker, matcher)
                    assert token_id in now and not now & special, (engine, text, tokenizer.decode([token_id]))
                    assert matcher.accept(token_id)
                end = allowed_tokens(masker, matcher)
                assert end & eos and end <= eos, engine
        finally:
            compiler.close()
