"""What constrained decoding costs: TPOT with and without a JSON Schema on the same prompts, at concurrency 1 and
16, and time to first token with a cold and a cached grammar. Offline engines, one process, rounds alternating
the conditions, so that the machine's noise hits all alike; the figure is the ratio.

Each ``--engines`` entry (a ``--grammar-engine`` setting) gets an engine of its own on the same model, with
its own unconstrained baseline; ``llguidance,xgrammar`` puts both schemas on each grammar engine (``auto``
sends the bounded strings to xgrammar and the plain ones to llguidance).

The schemas ask for a long array of strings (plain, and bounded in length), so that every request writes
``--max-tokens`` tokens in every condition (the unconstrained run ignores EOS): the same number of decode
steps at the same batch sizes, and only the grammar differs. Masks are computed during the forward (the
runner prefetches them), so what a constraint costs is what sampling waits for plus the CPU the grammar
engine takes from the model.

    python benchmarks/structured_output.py [--model smollm2-135m] [--engines llguidance,xgrammar] [--rounds 3]
                                           [--out results.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import time
import uuid
from pathlib import Path
from typing import Any

from benchmarks.serve_compare import cpu_description
from kvserve.offline import LLM
from kvserve.request import RequestOutput
from kvserve.sampling_params import SamplingParams, StructuredOutputsParams


def long_schema(max_length: int | None) -> dict[str, Any]:
    """An array of at least 64 words; ``max_length`` bounds each (a bounded string costs the grammar engine
    more per token: no precomputed token set covers it)."""
    item: dict[str, Any] = {"type": "string"} if max_length is None else {"type": "string", "maxLength": max_length}
    return {"type": "object", "properties": {"words": {"type": "array", "items": item, "minItems": 64}},
            "required": ["words"], "additionalProperties": False}


SCHEMAS = {"strings": long_schema(None), "bounded strings": long_schema(12)}
LONG_SCHEMA = SCHEMAS["strings"]
TOPICS = ["fruits", "colours", "animals", "cities", "tools", "planets", "rivers", "trees", "birds", "metals",
          "games", "fabrics", "spices", "flowers", "insects", "minerals"]


def prompt(i: int) -> list[dict[str, str]]:
    return [{"role": "user", "content": f"List many {TOPICS[i % len(TOPICS)]} as a JSON array of words."}]


def tpot_ms(output: RequestOutput) -> float:
    m = output.metrics
    tokens = len(output.outputs[0].token_ids)
    assert m.first_token_time is not None and m.last_token_time is not None and tokens > 1
    return (m.last_token_time - m.first_token_time) / (tokens - 1) * 1e3


def decode_run(llm: LLM, concurrency: int, schema: dict[str, Any] | None, max_tokens: int) -> list[float]:
    """TPOT (ms) of each request: ``concurrency`` requests at a time, 16 in all; no schema: unconstrained."""
    spec = StructuredOutputsParams(json=schema) if schema is not None else None
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=schema is None,
                            structured_outputs=spec)
    tpots: list[float] = []
    for start in range(0, 16, concurrency):
        outputs = llm.chat([prompt(i) for i in range(start, start + concurrency)], params)
        for output in outputs:
            assert len(output.outputs[0].token_ids) == max_tokens, output.outputs[0].text
            tpots.append(tpot_ms(output))
    return tpots


def ttft_ms(llm: LLM, cold: bool) -> float:
    """Time from submitting a request to its first token; a cold grammar is a schema never seen before."""
    schema = dict(LONG_SCHEMA, description=uuid.uuid4().hex if cold else "cached")
    params = SamplingParams(temperature=0.0, max_tokens=1, structured_outputs=StructuredOutputsParams(json=schema))
    t0 = time.perf_counter()
    llm.chat(prompt(0), params)
    return (time.perf_counter() - t0) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="a known model name or a path (default: SmolLM2-135M)")
    parser.add_argument("--engines", default="llguidance,xgrammar", help="--grammar-engine settings, side by side")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()

    engines = args.engines.split(",")
    llms = {engine: LLM(args.model, max_model_len=1024, grammar_engine=engine) for engine in engines}
    first_view: dict[str, float] = {}
    for engine, llm in llms.items():
        llm.chat(prompt(0), SamplingParams(max_tokens=4))  # warm-up: kernels, first allocation
        first_view[engine] = ttft_ms(llm, cold=True)  # also builds the grammar engine's view of the vocabulary
        ttft_ms(llm, cold=False)
    conditions: dict[str, dict[str, Any] | None] = {"unconstrained": None, **SCHEMAS}
    results: dict[str, Any] = {engine: {} for engine in engines}
    for concurrency in (1, 16):
        runs = {(engine, name): [] for engine in engines for name in conditions}
        for _ in range(args.rounds):
            for engine, llm in llms.items():
                for name, schema in conditions.items():
                    runs[engine, name] += decode_run(llm, concurrency, schema, args.max_tokens)
        for engine in engines:
            plain = statistics.median(runs[engine, "unconstrained"])
            row: dict[str, float] = {"tpot_ms_unconstrained": round(plain, 2)}
            for name in SCHEMAS:
                constrained = statistics.median(runs[engine, name])
                row[f"tpot_ms_{name.replace(' ', '_')}"] = round(constrained, 2)
                row[f"overhead_pct_{name.replace(' ', '_')}"] = round((constrained / plain - 1) * 100, 1)
            results[engine][f"c{concurrency}"] = row
    ttft: dict[str, Any] = {}
    for engine, llm in llms.items():
        cold: list[float] = []
        cached: list[float] = []
        for _ in range(9):  # alternating, so that a slow moment of the machine hits both
            cold.append(ttft_ms(llm, cold=True))
            cached.append(ttft_ms(llm, cold=False))
        stats = llm.engine.stats()
        ttft[engine] = {
            "first_constraint_with_vocabulary_view": round(first_view[engine], 1),
            "cold_grammar_median": round(statistics.median(cold), 1),
            "cached_grammar_median": round(statistics.median(cached), 1),
            "mask_us_per_constrained_token": round(
                stats.grammar_mask_time_s / max(1, stats.num_constrained_tokens) * 1e6, 1),
            "xgrammar_compiles": stats.grammar.xgrammar_compiles}
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    report = {
        "date": time.strftime("%Y-%m-%d"), "commit": commit, "cpu": cpu_description(),
        "model": args.model or "smollm2-135m", "max_tokens": args.max_tokens, "rounds": args.rounds,
        "decode": results, "first_token_and_masks": ttft,
    }
    print(json.dumps(report, indent=2))
    if args.out:
        args.out.write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
