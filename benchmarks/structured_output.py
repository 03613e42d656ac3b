"""What constrained decoding costs: TPOT with and without a JSON Schema on the same prompts, at concurrency 1 and
16, and time to first token with a cold and a cached grammar. Offline engine, one process, rounds alternating
the two conditions, so that the machine's noise hits both alike; the figure is the ratio.

The schema asks for a long array of short strings, so that every request writes ``--max-tokens`` tokens in
both conditions (the unconstrained run ignores EOS): the same number of decode steps at the same batch
sizes, and only the grammar differs.

    python benchmarks/structured_output.py [--model smollm2-135m] [--rounds 3] [--out results.json]
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
from kvserve.engine import LLM
from kvserve.request import RequestOutput, SamplingParams, StructuredOutputsParams

LONG_SCHEMA = {"type": "object", "properties": {
    "words": {"type": "array", "items": {"type": "string", "maxLength": 12}, "minItems": 64}},
    "required": ["words"], "additionalProperties": False}
TOPICS = ["fruits", "colours", "animals", "cities", "tools", "planets", "rivers", "trees", "birds", "metals",
          "games", "fabrics", "spices", "flowers", "insects", "minerals"]


def prompt(i: int) -> list[dict[str, str]]:
    return [{"role": "user", "content": f"List many {TOPICS[i % len(TOPICS)]} as a JSON array of words."}]


def tpot_ms(output: RequestOutput) -> float:
    m = output.metrics
    tokens = len(output.outputs[0].token_ids)
    assert m.first_token_time is not None and m.last_token_time is not None and tokens > 1
    return (m.last_token_time - m.first_token_time) / (tokens - 1) * 1e3


def decode_run(llm: LLM, concurrency: int, constrained: bool, max_tokens: int) -> list[float]:
    """TPOT (ms) of each request: ``concurrency`` requests at a time, 16 in all."""
    spec = StructuredOutputsParams(json=LONG_SCHEMA) if constrained else None
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=not constrained,
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
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()

    llm = LLM(args.model, max_model_len=1024)
    llm.chat(prompt(0), SamplingParams(max_tokens=4))  # warm-up: kernels, first allocation
    first_view = ttft_ms(llm, cold=True)  # also builds the grammar engine's view of the vocabulary
    ttft_ms(llm, cold=False)
    results: dict[str, Any] = {}
    for concurrency in (1, 16):
        runs: dict[str, list[float]] = {"unconstrained": [], "constrained": []}
        for _ in range(args.rounds):
            for name in ("unconstrained", "constrained"):
                runs[name] += decode_run(llm, concurrency, name == "constrained", args.max_tokens)
        plain = statistics.median(runs["unconstrained"])
        constrained = statistics.median(runs["constrained"])
        results[f"c{concurrency}"] = {"tpot_ms_unconstrained": round(plain, 2),
                                      "tpot_ms_constrained": round(constrained, 2),
                                      "overhead_pct": round((constrained / plain - 1) * 100, 1)}
    cold = [ttft_ms(llm, cold=True) for _ in range(5)]
    cached = [ttft_ms(llm, cold=False) for _ in range(5)]
    stats = llm.engine.stats()
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    report = {
        "date": time.strftime("%Y-%m-%d"), "commit": commit, "cpu": cpu_description(),
        "model": args.model or "smollm2-135m", "max_tokens": args.max_tokens, "rounds": args.rounds,
        "decode": results,
        "ttft_ms": {"first_constraint_with_vocabulary_view": round(first_view, 1),
                    "cold_grammar_median": round(statistics.median(cold), 1),
                    "cached_grammar_median": round(statistics.median(cached), 1)},
        "mask_us_per_constrained_token": round(stats.grammar_mask_time_s / max(1, stats.num_constrained_tokens) * 1e6,
                                               1),
        "compile_ms_mean": round(stats.grammar.compile_time_s / max(1, stats.grammar.compiles) * 1e3, 2),
    }
    print(json.dumps(report, indent=2))
    if args.out:
        args.out.write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
