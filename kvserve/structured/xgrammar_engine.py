"""JSON Schemas on xgrammar: token masks precomputed per grammar.

xgrammar compiles a grammar into per-state token sets ahead of time, so a mask costs a few microseconds
where llguidance's lexer walks the token trie each step (far more for strings with a length bound: no
precomputed set covers a bound). Its compile takes milliseconds per property where llguidance's takes
microseconds; ``GrammarCompiler.engine_for`` says which constraints come here.

Semantics follow llguidance's: JSON Schema's own defaults (undeclared properties allowed unless
``additionalProperties`` is false), compact separators, no free whitespace. Three things are done here
that xgrammar does not do itself:
- the tokenizer's special tokens are given to it as special (it would let ``<|im_start|>`` into a string);
- no token holding a raw control character is allowed (compact JSON has none; xgrammar's length-bounded
  strings let them in);
- text the grammar forces (``{"name": "`` at the start of an object whose first property is required) is
  written in its own tokens, the first of its tokenisation allowed alone, as llguidance does: xgrammar
  would allow any split (``{`` then ``"``), and a model led into a tokenisation it never saw writes worse.

xgrammar is optional: its wheel asks for triton, a GPU compiler the CPU path never imports, so
``scripts/install.sh`` installs it without its dependencies and adds those it imports (transformers,
apache-tvm-ffi). Without it, every constraint stays on llguidance.
"""

from __future__ import annotations

import functools
import importlib.util
import threading
from typing import TYPE_CHECKING, Any

import torch

from kvserve.tokenizer import Tokenizer

if TYPE_CHECKING:
    import xgrammar

SEPARATORS = (", ", ": ")  # llguidance's JSON_OPTIONS: the same compact JSON from either engine


class JsonVocabulary:
    """What every matcher of one tokenizer shares: the tokens compact JSON may hold (no raw control
    character), as a bool per token and as mask words, and the first token of forced text."""

    def __init__(self, allowed: list[bool], bitmask: torch.Tensor, tokenizer: Tokenizer,
                 decoded_vocab: list[bytes]) -> None:
        self.allowed = allowed
        self.bitmask = bitmask  # int32 [words]

        @functools.lru_cache(maxsize=4096)  # a schema forces few distinct texts (its keys, separators)
        def first_forced_token(text: str) -> int | None:
            tokens = tokenizer.encode(text, add_special_tokens=False)
            if len(tokens) < 2 or tokenizer.decode(tokens) != text:
                return None
            # The token's own bytes must start the text: a SentencePiece encoding of text alone starts with a
            # word-start marker (a space the decode drops) the grammar does not allow there.
            first = tokens[0]
            return first if first < len(decoded_vocab) and text.encode().startswith(decoded_vocab[first]) else None

        self.first_forced_token = first_forced_token


# JSON Schema keywords xgrammar enforces as written. It ignores some others with a warning (lookahead in a
# pattern, allOf, not, uniqueItems...) and its regex dialect is not llguidance's: a schema with any keyword
# outside these stays on llguidance, which refuses what it cannot enforce.
EXACT_KEYWORDS = frozenset({
    "type", "properties", "required", "additionalProperties", "items", "prefixItems", "enum", "const",
    "minItems", "maxItems", "minLength", "maxLength", "minimum", "maximum", "exclusiveMinimum",
    "exclusiveMaximum", "anyOf", "$ref", "$defs", "definitions", "title", "description", "default", "examples",
    "$schema", "$id", "$comment"})
_SCHEMA_MAPS = ("properties", "$defs", "definitions")  # name -> schema
_SCHEMA_LISTS = ("prefixItems", "anyOf")


def enforces_exactly(schema: object) -> bool:
    """Every keyword of ``schema`` (a JSON Schema, sub-schemas included) is one xgrammar enforces."""
    if isinstance(schema, bool):
        return True
    if not isinstance(schema, dict) or not set(schema) <= EXACT_KEYWORDS:
        return False
    return all(enforces_exactly(sub) for sub in _subschemas(schema))


def has_bounded_string(schema: object) -> bool:
    """``schema`` (a JSON Schema xgrammar enforces exactly) bounds a string's length somewhere."""
    if not isinstance(schema, dict):
        return False
    return "maxLength" in schema or "minLength" in schema or any(map(has_bounded_string, _subschemas(schema)))


def schema_size(schema: object) -> int:
    """How many schemas ``schema`` holds, itself included (a JSON Schema xgrammar enforces exactly): what
    xgrammar's compile time grows with."""
    if not isinstance(schema, dict):
        return 1
    return 1 + sum(map(schema_size, _subschemas(schema)))


def _subschemas(schema: dict[str, Any]) -> list[object]:
    """The schemas directly inside ``schema``, by the keywords EXACT_KEYWORDS allows."""
    found: list[object] = []
    for key in _SCHEMA_MAPS:
        value = schema.get(key, {})
        found += list(value.values()) if isinstance(value, dict) else [value]
    for key in _SCHEMA_LISTS:
        value = schema.get(key, [])
        found += list(value) if isinstance(value, list) else [value]
    found += [schema[key] for key in ("items", "additionalProperties") if key in schema]
    return found


def xgrammar_installed() -> bool:
    return importlib.util.find_spec("xgrammar") is not None


class XGrammarMatcher:
    """One request's position in an xgrammar grammar (GrammarMatcher's interface)."""

    __slots__ = ("_matcher", "_vocabulary", "version", "_error")

    def __init__(self, matcher: xgrammar.GrammarMatcher, vocabulary: JsonVocabulary) -> None:
        self._matcher = matcher
        self._vocabulary = vocabulary
        self.version = 0
        self._error = ""

    def accept(self, token_id: int) -> bool:
        self.version += 1
        if self._error:
            return False
        if not self._takes(token_id):
            self._error = f"token {token_id} is not allowed here"
            return False
        return True

    def valid_prefix(self, token_ids: list[int]) -> int:
        """How many of ``token_ids`` the grammar allows in a row from here (taken, then rolled back)."""
        if self._error:
            return 0
        taken = 0
        for token_id in token_ids:
            if not self._takes(token_id):
                break
            taken += 1
        if taken:
            self._matcher.rollback(taken)
        return taken

    def _takes(self, token_id: int) -> bool:
        """Advance by ``token_id`` if the mask would allow it (else the state does not change)."""
        allowed = self._vocabulary.allowed
        if not (0 <= token_id < len(allowed) and allowed[token_id]):
            return False
        forced = self._forced_token()
        if forced is not None and token_id != forced:
            return False
        return bool(self._matcher.accept_token(token_id))

    def _forced_token(self) -> int | None:
        """The first token of the text the grammar forces from here, where that text is more than one token
        (a single token's text might be the start of a longer token with what follows)."""
        text = self._matcher.find_jump_forward_string()
        return self._vocabulary.first_forced_token(text) if text else None

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        fill_bitmasks([(self, row)], bitmask)


    @property
    def is_error(self) -> bool:
        return bool(self._error)

    @property
    def error(self) -> str:
        return self._error

    @property
    def is_finished(self) -> bool:
        return bool(self._matcher.is_terminated())


def fill_bitmasks(rows: list[tuple[XGrammarMatcher, int]], bitmask: torch.Tensor) -> None:
    """Row ``j`` of ``bitmask`` (int32 [R, words]) for each (matcher, j): its tokens allowed next."""
    unforced: list[int] = []
    with torch.inference_mode():  # the runner's buffers may be inference tensors, and this thread is not in it
        for matcher, row in rows:
            forced = matcher._forced_token()
            if forced is None:
                matcher._matcher.fill_next_token_bitmask(bitmask, row)
                unforced.append(row)
            else:
                bitmask[row].zero_()
                bitmask[row, forced // 32] = 1 << (forced % 32) if forced % 32 < 31 else -(1 << 31)
        if not unforced:
            return
        json_tokens = rows[0][0]._vocabulary.bitmask  # the same for every matcher of one tokenizer
        if len(unforced) == 1:
            bitmask[unforced[0]].bitwise_and_(json_tokens)
        else:
            index = torch.tensor(unforced)
            bitmask[index] = bitmask[index] & json_tokens


class XGrammarEngine:
    """xgrammar's compiler for one tokenizer, built on first use (its view of the vocabulary takes a
    fraction of a second to seconds)."""

    def __init__(self, tokenizer: Tokenizer, mask_vocab_size: int) -> None:
        self._tokenizer = tokenizer
        self._vocab_size = mask_vocab_size
        self._compiler: Any = None
        self._vocabulary: JsonVocabulary | None = None
        self._lock = threading.Lock()

    def _grammar_compiler(self) -> Any:
        with self._lock:
            if self._compiler is None:
                info = self._tokenizer_info()
                allowed, bitmask = _json_tokens(info.decoded_vocab, self._vocab_size)
                self._vocabulary = JsonVocabulary(allowed, bitmask, self._tokenizer, info.decoded_vocab)
                # kvserve keeps its own cache of compiled constraints; one thread per compile, as requests come.
                self._compiler = xgrammar_module().GrammarCompiler(info, max_threads=1, cache_enabled=False)
            return self._compiler

    def _tokenizer_info(self) -> xgrammar.TokenizerInfo:
        import transformers

        xgr = xgrammar_module()
        backend = self._tokenizer.backend
        stop_token_ids = list(self._tokenizer.eos_token_ids)
        # xgrammar reads the vocabulary's encoding (byte-level, byte fallback, raw) from the tokenizer...
        detected = xgr.TokenizerInfo.from_huggingface(
            transformers.PreTrainedTokenizerFast(tokenizer_object=backend), vocab_size=self._vocab_size,
            stop_token_ids=stop_token_ids)
        # ...but not which tokens are special: an empty string is how it is told.
        vocab = [""] * self._vocab_size
        for text, token_id in backend.get_vocab(with_added_tokens=True).items():
            if token_id < self._vocab_size:
                vocab[token_id] = text
        for token_id, added in backend.get_added_tokens_decoder().items():
            if added.special and token_id < self._vocab_size:
                vocab[token_id] = ""
        return xgr.TokenizerInfo(vocab, detected.vocab_type, vocab_size=self._vocab_size,
                                 stop_token_ids=stop_token_ids, add_prefix_space=detected.add_prefix_space)

    def compile_json(self, schema_text: str) -> xgrammar.CompiledGrammar:
        """Raises whatever xgrammar raises for a schema it cannot compile."""
        return self._grammar_compiler().compile_json_schema(
            schema_text, any_whitespace=False, separators=SEPARATORS, strict_mode=False)

    def new_matcher(self, compiled: xgrammar.CompiledGrammar) -> XGrammarMatcher:
        assert self._vocabulary is not None  # set with the compiler that compiled ``compiled``
        return XGrammarMatcher(xgrammar_module().GrammarMatcher(compiled), self._vocabulary)


def xgrammar_module() -> Any:
    import xgrammar

    return xgrammar


def _json_tokens(decoded_vocab: list[bytes], vocab_size: int) -> tuple[list[bool], torch.Tensor]:
    """Which tokens compact JSON may hold: none with a raw control character (special tokens, empty here,
    stay allowed: the grammar itself allows only the stop tokens among them)."""
    allowed = [not any(byte < 0x20 for byte in token) for token in decoded_vocab[:vocab_size]]
    allowed += [False] * (vocab_size - len(allowed))
    bits = torch.zeros((vocab_size + 31) // 32 * 32, dtype=torch.int64)
    bits[:vocab_size] = torch.tensor(allowed, dtype=torch.int64)
    words = (bits.view(-1, 32) << torch.arange(32)).sum(dim=1)  # bit i of word w: token 32 w + i
    return allowed, words.to(torch.uint32).view(torch.int32)
