"""Decode step time with and without the shared-prefix (cascade) attention path, side by side.

    python benchmarks/shared_prefix_decode.py [--requests 16] [--prefix 1500] [--suffix 100]

N requests share a cached prefix (an agent's system prompt) plus a suffix of their own; all decode
together. With the cascade path the shared blocks' KV is read once per step for the whole batch; without
it every request gathers its own copy. Runs plain, cascade, plain, cascade and reports ms per step.
"""

from __future__ import annotations

import argparse
import time

from kvserve import LLM, SamplingParams


def decode_ms_per_step(llm: LLM, prompts: list[dict], new_tokens: int) -> float:
    engine = llm.engine
    params = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)
    requests = [engine.add_request(p, params) for p in prompts]
    while any(r.num_output_tokens == 0 for r in requests):  # prefill (mostly cache hits) and first tokens
        engine.step()
    t0, steps = time.perf_counter(), 0
    while engine.has_unfinished_requests():
        engine.step()
        steps += 1
    return (time.perf_counter() - t0) / steps * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--prefix", type=int, default=1500)
    parser.add_argument("--suffix", type=int, default=100)
    parser.add_argument("--new-tokens", type=int, default=30)
    parser.add_argument("--dtype", default="bfloat16")
    args = parser.parse_args()
    # The same engine twice but for the cascade threshold: never, and the default.
    llms = {name: LLM(dtype=args.dtype, enable_prefix_caching=True, max_num_batched_tokens=2048,
                      cascade_min_tokens=threshold, shared_prefill_min_tokens=256)
            for name, threshold in (("plain", 10**9), ("cascade", 256))}
    shared = list(range(1000, 1000 + args.prefix))
    prompts = [{"prompt_token_ids": shared + list(range(5000 + args.suffix * i, 5000 + args.suffix * (i + 1)))}
               for i in range(args.requests)]
    for llm in llms.values():  # cache the prefix
        llm.generate(prompts[:1], SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True))
    results: dict[str, list[float]] = {"plain": [], "cascade": []}
    for _ in range(2):
        for name in ("plain", "cascade"):
            results[name].append(decode_ms_per_step(llms[name], prompts, args.new_tokens))
    plain, cascade = min(results["plain"]), min(results["cascade"])
    print(f"{args.requests} requests, {args.prefix}-token shared prefix + {args.suffix} own tokens, {args.dtype}:")
    print(f"  plain paged attention : {plain:7.1f} ms/step   (runs: {results['plain']})")
    print(f"  shared-prefix (cascade): {cascade:7.1f} ms/step   (runs: {results['cascade']})")
    print(f"  speed-up: {plain / cascade:.2f}x")


if __name__ == "__main__":
    main()
