"""Grammars for structured output: compile a request's constraint once, then follow it token by token.

A ``StructuredOutputsParams`` (a JSON Schema, a regex, a choice, a Lark or GBNF grammar) is compiled by
``GrammarCompiler`` into a ``CompiledGrammar`` for the model's tokenizer, on the compiler's own threads and
at most once per distinct constraint (an LRU cache keyed by the constraint). A caller waits for it at most
``compile_timeout_s``; past that the request gets a 400 and the compile goes on, so that a retry finds it
cached. Nothing here runs on the engine thread: the engine only copies a compiled grammar's start state
into each request's ``GrammarMatcher``.

Two engines (``StructuredOutputConfig.engine``). llguidance computes token masks lazily from a lexer over
the token trie: compiling costs microseconds, a mask tens of microseconds (hundreds for strings with a
length bound: no precomputed token set covers a bound), and it takes every kind of constraint. xgrammar
(xgrammar_engine.py) precomputes a JSON Schema's masks: its compile costs milliseconds per property, a mask
a few microseconds, bounded strings included. Each constraint goes to one engine, always the same
(``GrammarCompiler.engine_for``), so that a greedy request's output does not depend on what came before it.
JSON is generated compact (``", "`` and ``": "`` separators, no free whitespace) by both: a small model
given free whitespace can fill its whole output with it. benchmarks/structured_output.py measures what the
masks cost.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Protocol

import jsonschema
import llguidance
import torch

from kvserve.config import StructuredOutputConfig
from kvserve.errors import ConfigError, InvalidRequest
from kvserve.sampling_params import StructuredOutputsParams
from kvserve.structured.xgrammar_engine import (
    XGrammarEngine,
    XGrammarMatcher,
    enforces_exactly,
    has_bounded_string,
    schema_size,
    xgrammar_installed,
)
from kvserve.tokenizer import Tokenizer

logger = logging.getLogger(__name__)

# auto's bound on a schema for xgrammar: its compile grows by tens of milliseconds per schema inside
# (benchmarks/grammar_engines.py), and a larger one would keep its first request waiting longer than its
# masks save over llguidance's in a typical reply.
AUTO_XGRAMMAR_MAX_SCHEMAS = 16

JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


class GrammarCompileTimeout(InvalidRequest):
    """The constraint did not compile within the server's limit (--grammar-compile-timeout)."""

    code = "grammar_compile_timeout"


@dataclass(slots=True)
class GrammarStats:
    """The compiler's counters, read by /metrics."""

    compiles: int = 0  # constraints compiled (cache misses), successful or not
    compile_errors: int = 0
    compile_time_s: float = 0.0
    cache_hits: int = 0
    timeouts: int = 0
    xgrammar_compiles: int = 0  # constraints compiled on xgrammar (also counted in compiles)
    xgrammar_refusals: int = 0  # constraints xgrammar could not compile, compiled on llguidance instead


class GrammarMatcher(Protocol):
    """One request's position in its grammar: which tokens may come next, and the tokens it has taken."""

    version: int  # tokens accepted: a mask computed at one version is stale at the next

    def accept(self, token_id: int) -> bool:
        """Advance by one token; False if the grammar does not allow it (the matcher is then in error)."""

    def valid_prefix(self, token_ids: list[int]) -> int:
        """How many of ``token_ids`` the grammar allows in a row from here (the state does not change)."""

    @property
    def is_error(self) -> bool: ...

    @property
    def error(self) -> str: ...

    @property
    def is_finished(self) -> bool:
        """The grammar has taken its end (llguidance: it allows nothing more than end of sequence)."""


class LLGuidanceMatcher:
    """GrammarMatcher on llguidance."""

    __slots__ = ("_matcher", "version")

    def __init__(self, matcher: llguidance.LLMatcher) -> None:
        self._matcher = matcher
        self.version = 0  # tokens accepted: a mask computed at one version is stale at the next

    @property
    def llg_matcher(self) -> llguidance.LLMatcher:
        return self._matcher

    def accept(self, token_id: int) -> bool:
        self.version += 1
        return bool(self._matcher.consume_token(token_id))

    def valid_prefix(self, token_ids: list[int]) -> int:
        return int(self._matcher.validate_tokens(token_ids)) if token_ids else 0

    @property
    def is_error(self) -> bool:
        return bool(self._matcher.is_error())

    @property
    def error(self) -> str:
        return str(self._matcher.get_error())

    @property
    def is_finished(self) -> bool:
        return bool(self._matcher.is_stopped())


class CompiledGrammar:
    """A constraint compiled for one tokenizer by one engine. Each request follows it in a matcher of its
    own, at the start state."""

    __slots__ = ("kind", "engine", "compile_time_s", "_new_matcher")

    def __init__(self, new_matcher: Callable[[], GrammarMatcher], kind: str, engine: str,
                 compile_time_s: float) -> None:
        self._new_matcher = new_matcher
        self.kind = kind
        self.engine = engine
        self.compile_time_s = compile_time_s

    def new_matcher(self) -> GrammarMatcher:
        return self._new_matcher()


def grammar_text(spec: StructuredOutputsParams) -> str:
    """The llguidance grammar of a constraint; InvalidRequest naming the field if it is malformed."""
    if spec.json is not None or spec.json_object:
        schema = json_schema_of(spec)
        return llguidance.LLMatcher.grammar_from_json_schema(json.dumps(schema), defaults=JSON_OPTIONS)
    if spec.regex is not None:
        return llguidance.LLMatcher.grammar_from_regex(spec.regex)
    if spec.choice is not None:
        return llguidance.LLMatcher.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in spec.choice))
    assert spec.grammar is not None
    try:
        return llguidance.grammar_from("grammar", spec.grammar)
    except ValueError as exc:  # GBNF that does not convert to Lark
        raise InvalidRequest(f"{spec.param}: {exc}", param=spec.param) from None


def json_schema_of(spec: StructuredOutputsParams) -> dict[str, object]:
    """The JSON Schema of a json / json_object constraint, checked against the JSON Schema meta-schema."""
    if spec.json_object:
        return {"type": "object"}
    assert spec.json is not None
    try:
        schema = json.loads(spec.json)
    except json.JSONDecodeError as exc:
        raise InvalidRequest(f"{spec.param}: the JSON schema is not valid JSON: {exc}", param=spec.param) from None
    except RecursionError:
        schema = None  # deeper than the parser's stack: refused below
    if schema is None or nesting_depth(schema) > MAX_NESTING:
        raise InvalidRequest(f"{spec.param}: the JSON schema nests lists and objects more than {MAX_NESTING} "
                             f"deep", param=spec.param)
    check_json_schema(schema, spec.param)
    return schema


def named_for(error: InvalidRequest, spec: StructuredOutputsParams) -> InvalidRequest:
    """A failed compile's error named for the field ``spec`` came in: compiles are cached by the constraint
    alone, and another request may have sent the same one in another field."""
    if error.param is None or error.param == spec.param:
        return error
    message = str(error)
    if message.startswith(f"{error.param}: "):
        message = f"{spec.param}: {message.removeprefix(f'{error.param}: ')}"
    return InvalidRequest(message, param=spec.param)


# As the request's own JSON values are bounded: what walks a schema (the meta-schema check, the compilers) recurses.
MAX_NESTING = 100


def nesting_depth(value: object) -> int:
    """How deep lists and objects nest in ``value`` (a scalar: 0), walked without recursion."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        item, depth = stack.pop()
        children = item.values() if isinstance(item, dict) else item if isinstance(item, list) else None
        if children is not None:
            deepest = max(deepest, depth)
            stack.extend((child, depth + 1) for child in children)
    return deepest


def check_json_schema(schema: object, param: str) -> None:
    """InvalidRequest naming ``param`` unless ``schema`` is a valid JSON Schema (draft 2020-12) object."""
    if not isinstance(schema, dict):
        raise InvalidRequest(f"{param}: a JSON schema must be an object, got {type(schema).__name__}", param=param)
    try:
        jsonschema.Draft202012Validator.check_schema(schema)
    except jsonschema.SchemaError as exc:
        where = "/".join(str(p) for p in exc.path)
        raise InvalidRequest(f"{param}: not a valid JSON Schema{f' at {where}' if where else ''}: {exc.message}",
                             param=param) from None


class GrammarCompiler:
    """Compiles constraints for one model's tokenizer on its own threads, with a cache and a timeout."""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int, config: StructuredOutputConfig) -> None:
        self.config = config
        # Masks cover every logit column of the model and every token of the tokenizer.
        self.mask_vocab_size = max(vocab_size, tokenizer.vocab_size)
        self._tokenizer = tokenizer
        self._llg_tokenizer: llguidance.LLTokenizer | None = None
        self._tokenizer_lock = threading.Lock()
        if config.engine == "xgrammar" and not xgrammar_installed():
            raise ConfigError("--grammar-engine xgrammar: xgrammar is not installed (scripts/install.sh installs "
                              "it: pip install --no-deps xgrammar apache-tvm-ffi, and transformers)", "engine")
        use_xgrammar = config.engine == "xgrammar" or (config.engine == "auto" and xgrammar_installed())
        self._xgrammar = XGrammarEngine(tokenizer, self.mask_vocab_size) if use_xgrammar else None
        self._pool = ThreadPoolExecutor(max_workers=config.compile_threads, thread_name_prefix="kvserve-grammar")
        self._lock = threading.Lock()
        self._cache: OrderedDict[StructuredOutputsParams, Future[CompiledGrammar]] = OrderedDict()
        self.stats = GrammarStats()

    def engine_for(self, spec: StructuredOutputsParams) -> str:
        """The engine ``spec`` compiles on. ``auto``: xgrammar for a JSON Schema of at most
        AUTO_XGRAMMAR_MAX_SCHEMAS schemas whose every keyword it enforces, with a length-bounded string in
        it, where llguidance's lexer costs most per token; llguidance for everything else, where the two
        cost about the same per token and llguidance compiles in microseconds against xgrammar's
        milliseconds per property. ``xgrammar``: every JSON Schema whose keywords it enforces."""
        if self._xgrammar is None or self.config.engine == "llguidance":
            return "llguidance"
        if spec.json_object:  # {"type": "object"}: enforced by xgrammar, no bounded string in it
            return "xgrammar" if self.config.engine == "xgrammar" else "llguidance"
        if spec.json is None:
            return "llguidance"
        try:
            schema = json.loads(spec.json)
        except (json.JSONDecodeError, RecursionError):  # the compile says what is wrong with it
            return "llguidance"
        if nesting_depth(schema) > MAX_NESTING:
            return "llguidance"
        if not enforces_exactly(schema):
            return "llguidance"
        if self.config.engine == "xgrammar":
            return "xgrammar"
        small = schema_size(schema) <= AUTO_XGRAMMAR_MAX_SCHEMAS
        return "xgrammar" if small and has_bounded_string(schema) else "llguidance"

    # --- compiling ------------------------------------------------------------------------------------------
    def submit(self, spec: StructuredOutputsParams, count_hit: bool = True) -> Future[CompiledGrammar]:
        """The compile of ``spec``: a cached one (finished, failed or still running) or a new one.
        ``count_hit``: False for a request's second look at a constraint it compiled before."""
        with self._lock:
            future = self._cache.get(spec)
            if future is not None:
                self._cache.move_to_end(spec)
                self.stats.cache_hits += count_hit
                return future
            on_xgrammar = self.engine_for(spec) == "xgrammar"
            future = self._pool.submit(self._compile_xgrammar if on_xgrammar else self._compile, spec)
            self._cache[spec] = future
            while len(self._cache) > self.config.cache_size:
                self._cache.popitem(last=False)
            return future

    def compile(self, spec: StructuredOutputsParams, timeout_s: float | None = None,
                count_hit: bool = True) -> CompiledGrammar:
        """Wait for the compile of ``spec``: GrammarCompileTimeout past the limit, InvalidRequest if it fails."""
        future = self.submit(spec, count_hit)
        limit = self.config.compile_timeout_s if timeout_s is None else timeout_s
        try:
            return future.result(timeout=limit)
        except TimeoutError:
            raise self.timeout_error(spec, limit) from None
        except InvalidRequest as exc:
            raise named_for(exc, spec) from None

    def timeout_error(self, spec: StructuredOutputsParams, limit_s: float) -> GrammarCompileTimeout:
        """The error of a caller that waited ``limit_s`` for ``spec`` (counted)."""
        with self._lock:
            self.stats.timeouts += 1
        return GrammarCompileTimeout(
            f"{spec.param}: the {spec.kind} constraint did not compile within {limit_s:g} s; simplify it (the "
            f"compile goes on, and a retry of the same constraint uses it once it is done)", param=spec.param)

    def _compile(self, spec: StructuredOutputsParams) -> CompiledGrammar:
        t0 = time.perf_counter()
        try:
            grammar = grammar_text(spec)
            problem = llguidance.LLMatcher.validate_grammar(grammar, self.llg_tokenizer())
            if problem:
                raise InvalidRequest(f"{spec.param}: {_short(problem)}", param=spec.param)
            start = llguidance.LLMatcher(self.llg_tokenizer(), grammar, log_level=0)
            if not _allows_anything(start):
                raise InvalidRequest(f"{spec.param}: the {spec.kind} constraint matches no text this model can "
                                     "write", param=spec.param)
        except Exception:
            self._count(time.perf_counter() - t0, failed=True)
            raise
        elapsed = time.perf_counter() - t0
        self._count(elapsed, failed=False)
        return CompiledGrammar(lambda: LLGuidanceMatcher(start.deep_copy()), spec.kind, "llguidance", elapsed)

    def _compile_xgrammar(self, spec: StructuredOutputsParams) -> CompiledGrammar:
        """A JSON constraint on xgrammar; one xgrammar cannot compile goes to llguidance (which refuses what
        neither can)."""
        assert self._xgrammar is not None
        engine = self._xgrammar
        t0 = time.perf_counter()
        try:
            compiled = engine.compile_json(json.dumps(json_schema_of(spec)))
            if not _allows_anything_xgrammar(engine.new_matcher(compiled), self.mask_vocab_size):
                raise ValueError("no token is allowed at the start")
        except Exception as exc:  # xgrammar's own errors (RuntimeError, ValueError, InvalidJSONError...)
            with self._lock:
                self.stats.xgrammar_refusals += 1
            logger.info("structured output: xgrammar refused a %s constraint (%s); compiling it on llguidance",
                        spec.kind, _short(str(exc), 200))
            return self._compile(spec)
        elapsed = time.perf_counter() - t0
        self._count(elapsed, failed=False)
        with self._lock:
            self.stats.xgrammar_compiles += 1
        return CompiledGrammar(lambda: engine.new_matcher(compiled), spec.kind, "xgrammar", elapsed)

    def _count(self, elapsed_s: float, failed: bool) -> None:
        with self._lock:
            self.stats.compiles += 1
            self.stats.compile_time_s += elapsed_s
            self.stats.compile_errors += failed

    def llg_tokenizer(self) -> llguidance.LLTokenizer:
        """The tokenizer as llguidance sees it (token bytes and a trie), built on first use: it takes seconds
        for a large vocabulary, and most servers never see a constraint."""
        with self._tokenizer_lock:
            if self._llg_tokenizer is None:
                t0 = time.perf_counter()
                self._llg_tokenizer = llguidance.LLTokenizer(
                    self._tokenizer.backend.to_str(), n_vocab=self.mask_vocab_size,
                    eos_token=list(self._tokenizer.eos_token_ids))
                logger.info("structured output: the tokenizer's grammar view built in %.2f s",
                            time.perf_counter() - t0)
            return self._llg_tokenizer

    def special_token_id(self, token: str) -> int | None:
        """The id of ``token`` where it is one token of the vocabulary that the grammar engine treats as special
        (written ``<name>`` or ``<[id]>`` in a grammar; text cannot spell it), else None."""
        token_id = self._tokenizer.token_to_id(token)
        return token_id if token_id is not None and self.llg_tokenizer().is_special_token(token_id) else None

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


def _allows_anything(matcher: llguidance.LLMatcher) -> bool:
    """Some token is allowed at the start (end of sequence counts: the empty output is allowed)."""
    return any(matcher.compute_bitmask()) and not matcher.is_error()


def _allows_anything_xgrammar(matcher: XGrammarMatcher, vocab_size: int) -> bool:
    bitmask = torch.zeros(1, (vocab_size + 31) // 32, dtype=torch.int32)
    matcher.fill_bitmask(bitmask, 0)
    return bool(bitmask.any())


def _short(error: str, limit: int = 600) -> str:
    text = " ".join(line.strip() for line in error.strip().splitlines() if line.strip())
    return text if len(text) <= limit else text[: limit - 3] + "..."
