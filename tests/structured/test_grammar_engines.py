"""llguidance and xgrammar behind one compiler: which engine a constraint gets, and that xgrammar's masks
keep to JSON (no special token, no raw control character), write forced text in its own tokens and agree
with its matcher."""

from __future__ import annotations

import json

import pytest
import torch

from kvserve.config import StructuredOutputConfig
from kvserve.errors import ConfigError, InvalidRequest
from kvserve.model.loader import default_model_path
from kvserve.sampling_params import StructuredOutputsParams
from kvserve.structured import grammar as grammar_module
from kvserve.structured.grammar import AUTO_XGRAMMAR_MAX_SCHEMAS, GrammarCompiler, LLGuidanceMatcher
from kvserve.structured.masks import GrammarMasker
from kvserve.structured.xgrammar_engine import (
    XGrammarMatcher,
    enforces_exactly,
    has_bounded_string,
    schema_size,
)
from kvserve.tokenizer import Tokenizer

pytest.importorskip("xgrammar")

PERSON = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 12}, "tags": {"type": "array", "items": {"enum": ["red", "blue"]}},
    "age": {"type": "integer", "minimum": 0}, "nick": {"type": ["string", "null"]}},
    "required": ["name", "tags", "age"]}
DOCUMENTS = [  # each matches PERSON, in the compact form both engines write
    {"name": "Ada", "tags": ["red", "blue"], "age": 36, "nick": None},
    {"name": "Grace Hopper", "tags": [], "age": 85, "extra": {"a": [1, 2.5e3, "ü \"q\"\n"]}},
]


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return Tokenizer.from_model_path(default_model_path())


def compiler_for(tokenizer: Tokenizer, engine: str) -> GrammarCompiler:
    return GrammarCompiler(tokenizer, tokenizer.vocab_size, StructuredOutputConfig(engine=engine,
                                                                                   compile_timeout_s=60))


def allowed_ids(masker: GrammarMasker, matcher, vocab_size: int) -> set[int]:
    words = masker.bitmask([matcher])[0]
    bits = ((words.unsqueeze(1) >> torch.arange(32)) & 1).flatten()[:vocab_size]
    return set(bits.nonzero().flatten().tolist())


def test_auto_gives_length_bounded_schemas_to_xgrammar_and_the_rest_to_llguidance(tokenizer: Tokenizer) -> None:
    compiler = compiler_for(tokenizer, "auto")
    try:
        bounded = StructuredOutputsParams(json=PERSON)
        assert {compiler.compile(bounded).engine for _ in range(3)} == {"xgrammar"}
        assert isinstance(compiler.compile(bounded).new_matcher(), XGrammarMatcher)
        plain = StructuredOutputsParams(json={"type": "object", "properties": {"a": {"type": "string"}}})
        wide = StructuredOutputsParams(json={"type": "object", "properties": {
            f"p{i}": {"type": "string", "maxLength": 8} for i in range(AUTO_XGRAMMAR_MAX_SCHEMAS)}})
        for spec in (plain, wide, StructuredOutputsParams(json_object=True),
                     StructuredOutputsParams(json={"type": "string", "pattern": "^a+$", "maxLength": 4}),
                     StructuredOutputsParams(regex="[a-z]{1,3}"), StructuredOutputsParams(grammar='start: "y" | "n"')):
            grammar = compiler.compile(spec)
            assert grammar.engine == compiler.engine_for(spec) == "llguidance", spec
            assert isinstance(grammar.new_matcher(), LLGuidanceMatcher)
        assert compiler.stats.compiles == 7 and compiler.stats.xgrammar_compiles == 1
    finally:
        compiler.close()


def test_llguidance_alone_when_asked(tokenizer: Tokenizer) -> None:
    compiler = compiler_for(tokenizer, "llguidance")
    try:
        assert compiler.compile(StructuredOutputsParams(json=PERSON)).engine == "llguidance"
    finally:
        compiler.close()


def test_xgrammar_takes_every_schema_it_enforces_and_refuses_to_llguidance(tokenizer: Tokenizer) -> None:
    compiler = compiler_for(tokenizer, "xgrammar")
    try:
        assert compiler.compile(StructuredOutputsParams(json=PERSON)).engine == "xgrammar"
        assert compiler.compile(StructuredOutputsParams(json_object=True)).engine == "xgrammar"
        assert compiler.compile(StructuredOutputsParams(json={"type": "string", "pattern": "^a+$"})).engine == \
            "llguidance"
        # A schema xgrammar compiles to nothing goes to llguidance, whose error is the request's 400.
        with pytest.raises(InvalidRequest, match="Unsatisfiable") as error:
            compiler.compile(StructuredOutputsParams(json={"type": "integer", "minimum": 5, "maximum": 1},
                                                     param="response_format"))
        assert error.value.param == "response_format" and compiler.stats.xgrammar_refusals == 1
        with pytest.raises(InvalidRequest, match="not a valid JSON Schema"):
            compiler.compile(StructuredOutputsParams(json={"type": "strin"}))
    finally:
        compiler.close()


def test_xgrammar_asked_for_but_not_installed_is_a_config_error(tokenizer: Tokenizer, monkeypatch) -> None:
    monkeypatch.setattr(grammar_module, "xgrammar_installed", lambda: False)
    with pytest.raises(ConfigError, match="xgrammar is not installed"):
        compiler_for(tokenizer, "xgrammar")
    spec = StructuredOutputsParams(json=PERSON)
    assert compiler_for(tokenizer, "auto").engine_for(spec) == "llguidance"


def test_xgrammar_masks_allow_each_next_token_of_a_matching_document_and_nothing_outside_json(
        tokenizer: Tokenizer) -> None:
    compiler = compiler_for(tokenizer, "xgrammar")
    masker = GrammarMasker(compiler.mask_vocab_size)
    vocab = compiler.mask_vocab_size
    special = {i for i, added in tokenizer.backend.get_added_tokens_decoder().items() if added.special}
    eos = set(tokenizer.eos_token_ids)
    control = {i for i in range(tokenizer.vocab_size) if any(ord(c) < 0x20 for c in tokenizer.decode([i]))
               and i not in special}
    assert control and special - eos
    try:
        grammar = compiler.compile(StructuredOutputsParams(json=PERSON))
        for document in DOCUMENTS:
            matcher = grammar.new_matcher()
            text = json.dumps(document, separators=(", ", ": "), ensure_ascii=False)
            for token_id in tokenizer.encode(text, add_special_tokens=False):
                allowed = allowed_ids(masker, matcher, vocab)
                assert token_id in allowed, (text, tokenizer.decode([token_id]))
                assert not allowed & (special - eos) and not allowed & control
                assert matcher.accept(token_id)
            assert allowed_ids(masker, matcher, vocab) <= eos  # the object is closed: only the end
            assert matcher.accept(next(iter(eos)))
        # Inside a length-bounded string (where xgrammar itself would let control characters in).
        matcher = grammar.new_matcher()
        for token_id in tokenizer.encode('{"name": "A', add_special_tokens=False):
            assert matcher.accept(token_id)
        allowed = allowed_ids(masker, matcher, vocab)
        assert allowed and not allowed & control and not allowed & (special - eos)
        newline = tokenizer.encode("\n", add_special_tokens=False)
        assert matcher.valid_prefix(newline) == 0 and not matcher.accept(newline[0]) and matcher.is_error
    finally:
        compiler.close()


def test_valid_prefix_leaves_the_xgrammar_matcher_where_it_was(tokenizer: Tokenizer) -> None:
    compiler = compiler_for(tokenizer, "xgrammar")
    try:
        matcher = compiler.compile(StructuredOutputsParams(json=PERSON)).new_matcher()
        good = tokenizer.encode('{"name": "Ada", "tags": [', add_special_tokens=False)
        bad = good[:3] + tokenizer.encode("}", add_special_tokens=False)
        assert matcher.valid_prefix(good) == len(good)
        assert matcher.valid_prefix(bad) == 3  # '{"', 'name', '":', then no value
        # Forced text is written in its own tokens: "{" alone, where '{"' is its first, is refused.
        assert matcher.valid_prefix(tokenizer.encode("{", add_special_tokens=False)) == 0
        assert matcher.valid_prefix(good) == len(good)  # nothing was taken
        assert all(matcher.accept(t) for t in good) and not matcher.is_error
    finally:
        compiler.close()


def test_one_batch_of_masks_from_both_engines(tokenizer: Tokenizer) -> None:
    auto = compiler_for(tokenizer, "auto")
    try:
        on_xgrammar = auto.compile(StructuredOutputsParams(json=PERSON)).new_matcher()
        on_llguidance = auto.compile(StructuredOutputsParams(json={"type": "object"})).new_matcher()
        regex = auto.compile(StructuredOutputsParams(regex="[0-9]{3}")).new_matcher()
        matchers = [on_xgrammar, on_llguidance, regex, on_xgrammar]
        masker = GrammarMasker(auto.mask_vocab_size)
        together = masker.bitmask(matchers).clone()
        for row, matcher in enumerate(matchers):
            assert torch.equal(together[row], masker.bitmask([matcher])[0]), row
        assert isinstance(on_xgrammar, XGrammarMatcher) and isinstance(on_llguidance, LLGuidanceMatcher)
        assert not torch.equal(together[1], together[2])
    finally:
        auto.close()


@pytest.mark.parametrize(("schema", "exact"), [
    (PERSON, True),
    ({"$defs": {"n": {"type": "object", "properties": {"c": {"type": "array", "items": {"$ref": "#/$defs/n"}}}}},
      "$ref": "#/$defs/n"}, True),
    ({"anyOf": [{"type": "integer"}, {"type": "string", "maxLength": 3}]}, True),
    ({"type": "string", "pattern": "^a+$"}, False),
    ({"type": "string", "format": "email"}, False),
    ({"type": "object", "properties": {"a": {"type": "array", "uniqueItems": True}}}, False),
    ({"anyOf": [{"type": "integer"}, {"not": {"type": "string"}}]}, False),
    ({"type": "object", "additionalProperties": {"type": "integer", "multipleOf": 2}}, False),
])
def test_which_schemas_xgrammar_enforces_exactly(schema: dict, exact: bool) -> None:
    assert enforces_exactly(schema) is exact


def test_schema_size_counts_every_schema_inside() -> None:
    assert schema_size({"type": "string"}) == 1
    assert schema_size(PERSON) == 6  # the object, its four properties and the tags' items
    assert schema_size({"anyOf": [{"type": "integer"}, {"prefixItems": [True, {}]}]}) == 5


def test_bounded_strings_are_found_anywhere_but_in_values() -> None:
    assert has_bounded_string(PERSON)
    assert has_bounded_string({"anyOf": [{"type": "integer"}, {"items": {"type": "string", "minLength": 1}}]})
    assert has_bounded_string({"$defs": {"s": {"maxLength": 2}}, "$ref": "#/$defs/s"})
    assert not has_bounded_string({"type": "object", "properties": {"maxLength": {"type": "integer"}},
                                   "default": {"maxLength": 3}})


def test_forced_text_is_never_started_with_a_token_the_grammar_refuses() -> None:
    """A SentencePiece encoding of forced JSON text alone starts with a word-start marker ('▁{"': a space the
    decode strips) that compact JSON does not allow there: forcing it dropped the request's constraint."""
    from tokenizers import Tokenizer as Backend
    from tokenizers import decoders, models, pre_tokenizers

    from kvserve.structured.xgrammar_engine import JsonVocabulary

    pieces = ["<unk>", "<s>", "</s>", "▁", "▁{", "{", '"', '{"', '▁{"', "n", "a", "m", "e", ":", " "]
    vocab = {p: i for i, p in enumerate(pieces)}
    backend = Backend(models.BPE(vocab, [("▁", "{"), ("{", '"'), ("▁{", '"')], unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first", split=False)
    backend.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.Strip(" ", 1, 0)])

    class Tokens:  # the two calls JsonVocabulary makes of kvserve's Tokenizer
        def __init__(self, tokenizer: Backend) -> None:
            self.tokenizer = tokenizer

        def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
            return self.tokenizer.encode(text, add_special_tokens=add_special_tokens).ids

        def decode(self, ids: list[int]) -> str:
            return self.tokenizer.decode(ids)

    def first_forced(tokens: Tokens, text: str) -> int | None:
        decoded = [p.replace("▁", " ").encode() for p in pieces]  # each token's bytes, as xgrammar has them
        return JsonVocabulary([True] * len(pieces), torch.zeros(1, dtype=torch.int32), tokens,
                              decoded).first_forced_token(text)

    forced = '{"name'
    sentencepiece = Tokens(backend)
    assert sentencepiece.decode(sentencepiece.encode(forced)) == forced
    assert pieces[sentencepiece.encode(forced)[0]] == '▁{"' and first_forced(sentencepiece, forced) is None
    plain = Backend(models.BPE(vocab, [("{", '"')], unk_token="<unk>"))  # no word-start marker
    plain.decoder = decoders.Fuse()
    assert first_forced(Tokens(plain), forced) == vocab['{"']
