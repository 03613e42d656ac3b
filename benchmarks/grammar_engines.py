"""llguidance against xgrammar on kvserve's own tokenizers: set-up, compile and per-token mask time, side by side.

For each model's tokenizer: the time to build each engine's view of the vocabulary, then for each JSON
Schema the time to compile it (cold: a schema neither engine has seen) and the time to compute the token
mask at every position of a document that matches it (the per-step cost constrained decoding adds). One
thread, one process, alternating engines per schema, so the machine's noise hits both alike.

Each engine as kvserve runs it (kvserve/structured/): llguidance's matcher, and xgrammar through
``XGrammarEngine`` (its special tokens, control-character filter and forced-token rule included).
xgrammar is optional; ``scripts/install.sh`` installs it (without the triton its wheel names).

    python benchmarks/grammar_engines.py [--models smollm2-135m qwen2.5-coder-0.5b] [--out results.json]
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import llguidance
import torch
from llguidance.torch import allocate_token_bitmask, fill_next_token_bitmask

from kvserve.model.loader import resolve_model_path
from kvserve.structured.grammar import JSON_OPTIONS
from kvserve.structured.xgrammar_engine import xgrammar_installed
from kvserve.tokenizer import Tokenizer

SCHEMAS: dict[str, tuple[dict[str, Any], Any]] = {
    "flat object": ({"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
                     "required": ["name", "age"], "additionalProperties": False},
                    {"name": "Ada Lovelace", "age": 36}),
    "enum and array": ({"type": "object", "properties": {
        "tags": {"type": "array", "items": {"enum": ["red", "green", "blue"]}},
        "score": {"type": "number", "minimum": 0, "maximum": 10}}, "required": ["tags", "score"],
        "additionalProperties": False}, {"tags": ["red", "blue", "green", "red"], "score": 7.5}),
    "nested": ({"type": "object", "properties": {
        "person": {"type": "object", "properties": {"first": {"type": "string"}, "last": {"type": "string"}},
                   "required": ["first", "last"], "additionalProperties": False},
        "address": {"type": "object", "properties": {"street": {"type": "string"}, "zip": {"type": "string",
                                                                                          "pattern": "^[0-9]{5}$"}},
                    "required": ["street", "zip"], "additionalProperties": False}},
        "required": ["person", "address"], "additionalProperties": False},
        {"person": {"first": "Grace", "last": "Hopper"}, "address": {"street": "1 Navy Way", "zip": "20301"}}),
    "recursive tree": ({"$defs": {"node": {"type": "object", "properties": {
        "value": {"type": "integer"}, "children": {"type": "array", "items": {"$ref": "#/$defs/node"}}},
        "required": ["value", "children"], "additionalProperties": False}}, "$ref": "#/$defs/node"},
        {"value": 1, "children": [{"value": 2, "children": []}, {"value": 3, "children": [{"value": 4,
                                                                                            "children": []}]}]}),
    "bounded strings": ({"type": "object", "properties": {"words": {"type": "array", "items": {
        "type": "string", "maxLength": 12}}}, "required": ["words"], "additionalProperties": False},
        {"words": ["apple pie", "green tea", "hello world", "paged KV", "radix tree", "prefill"]}),
    "100 properties": ({"type": "object", "properties": {f"field_{i}": {"type": "integer"} for i in range(100)},
                        "required": [f"field_{i}" for i in range(100)], "additionalProperties": False},
                       {f"field_{i}": i for i in range(100)}),
}


def timed(fn: Callable[[], Any]) -> tuple[Any, float]:
    t0 = time.perf_counter()
    value = fn()
    return value, time.perf_counter() - t0


class Llguidance:
    name = "llguidance"

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = llguidance.LLTokenizer(tokenizer.backend.to_str(), n_vocab=tokenizer.vocab_size,
                                                eos_token=list(tokenizer.eos_token_ids))
        self.bitmask = allocate_token_bitmask(1, tokenizer.vocab_size)

    def compile(self, schema: dict[str, Any]) -> Any:
        grammar = llguidance.LLMatcher.grammar_from_json_schema(json.dumps(schema), defaults=JSON_OPTIONS)
        return llguidance.LLMatcher(self.tokenizer, grammar, log_level=0)

    def mask_times(self, matcher: Any, tokens: list[int]) -> list[float]:
        times = []
        for token in tokens:
            _, elapsed = timed(lambda: fill_next_token_bitmask(matcher, self.bitmask))
            times.append(elapsed)
            assert matcher.consume_token(token), matcher.get_error()
        return times


class Xgrammar:
    name = "xgrammar"

    def __init__(self, tokenizer: Tokenizer) -> None:
        from kvserve.structured.xgrammar_engine import XGrammarEngine

        self.engine = XGrammarEngine(tokenizer, tokenizer.vocab_size)
        self.engine.compile_json('{"type": "object"}')  # builds its view of the vocabulary, as set-up
        self.bitmask = torch.zeros(1, (tokenizer.vocab_size + 31) // 32, dtype=torch.int32)

    def compile(self, schema: dict[str, Any]) -> Any:
        return self.engine.new_matcher(self.engine.compile_json(json.dumps(schema)))

    def mask_times(self, matcher: Any, tokens: list[int]) -> list[float]:
        times = []
        for token in tokens:
            _, elapsed = timed(lambda: matcher.fill_bitmask(self.bitmask, 0))
            times.append(elapsed)
            assert matcher.accept(token), matcher.error
        return times


def engines() -> list[type]:
    found: list[type] = [Llguidance]
    if xgrammar_installed():
        found.append(Xgrammar)
    else:
        print("xgrammar is not installed: llguidance alone (scripts/install.sh installs it)")
    return found


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def run(model: str) -> dict[str, Any]:
    tokenizer = Tokenizer.from_model_path(resolve_model_path(model))
    result: dict[str, Any] = {"model": model, "vocab_size": tokenizer.vocab_size, "engines": {}}
    built = {}
    for engine in engines():
        instance, elapsed = timed(lambda e=engine: e(tokenizer))
        built[engine.name] = instance
        result["engines"][engine.name] = {"setup_s": round(elapsed, 3), "schemas": {}}
    for schema_name, (schema, document) in SCHEMAS.items():
        tokens = tokenizer.encode(json.dumps(document), add_special_tokens=False)
        for name, instance in built.items():
            matcher, compile_s = timed(lambda i=instance, s=schema: i.compile(s))
            times = instance.mask_times(matcher, tokens)
            result["engines"][name]["schemas"][schema_name] = {
                "compile_ms": round(compile_s * 1e3, 2), "tokens": len(tokens),
                "mask_us_median": round(statistics.median(times) * 1e6, 1),
                "mask_us_p90": round(sorted(times)[int(0.9 * (len(times) - 1))] * 1e6, 1),
                "mask_us_max": round(max(times) * 1e6, 1)}
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", default=["smollm2-135m", "qwen2.5-coder-0.5b"])
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    torch.set_num_threads(1)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    report = {"date": time.strftime("%Y-%m-%d"), "commit": commit, "cpu": cpu_name(),
              "results": [run(model) for model in args.models]}
    for result in report["results"]:
        print(f"\n{result['model']} (vocabulary {result['vocab_size']})")
        for name, engine in result["engines"].items():
            print(f"  {name}: set-up {engine['setup_s']:.2f} s")
            for schema_name, row in engine["schemas"].items():
                print(f"    {schema_name:16s} compile {row['compile_ms']:8.2f} ms   mask median "
                      f"{row['mask_us_median']:7.1f} us  p90 {row['mask_us_p90']:7.1f} us  max {row['mask_us_max']:8.1f} us")
    if args.out:
        args.out.write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
