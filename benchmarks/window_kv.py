"""KV memory of a sliding-window model: window layers' pages freed past the window, against every layer keeping
every block (``--no-window-pages``), side by side in one run on the same KV budget.

    python benchmarks/window_kv.py [--model gemma-3-270m] [--requests 8] [--prompt-len 3072] [--gen-len 128]
        [--kv-cache-gb 0.12] [--dtype bfloat16] [--json out.json]

``--requests`` prompts of ``--prompt-len`` random token ids (distinct: no shared prefix) are submitted at once to
an engine with a KV pool of ``--kv-cache-gb``, once with window pages and once without. Per mode: the most
requests running at once, preemptions, the most KV held per running request while all of them decode, wall
time and
tokens/s, and how many requests got the same greedy tokens in both modes (batches differ between the modes,
and bf16 kernels round by batch width, so a late token may differ). The default budget holds two such
requests with one table for every layer.
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import asdict, dataclass

import torch

from kvserve import LLM, SamplingParams


@dataclass
class Run:
    window_pages: bool
    max_running: int
    preemptions: int
    # The most KV held per running request in a step where every running request was decoding.
    decode_kv_mib_per_request: float
    wall_s: float
    tokens_per_s: float  # prompt and generated tokens


def run(model: str, window_pages: bool, prompts: list[list[int]], gen_len: int, kv_cache_gb: float,
        dtype: str) -> tuple[Run, list[list[int]]]:
    # The prefix cache stays on, as by default: the prompts share nothing, but a preempted request resumes
    # from the blocks it had computed while they are still cached.
    llm = LLM(model=model, dtype=dtype, kv_cache_gb=kv_cache_gb, window_pages=window_pages,
              max_num_seqs=len(prompts))
    engine = llm.engine
    kv, layout = engine.kv_manager, engine.kv_layout
    layer_bytes = engine.arch.kv_bytes_per_token(torch.empty(0, dtype=engine.dtype).element_size())
    page_bytes = layer_bytes * layout.layers_per_page // engine.arch.num_layers * kv.block_size
    llm.generate([{"prompt_token_ids": prompts[0][:32]}], SamplingParams(max_tokens=2))  # warm-up
    preempted_before = engine.scheduler.num_preemptions
    params = SamplingParams(temperature=0.0, max_tokens=gen_len, ignore_eos=True)
    requests = [engine.add_request({"prompt_token_ids": p}, params) for p in prompts]
    max_running, per_request = 0, 0.0
    t0 = time.perf_counter()
    while engine.has_unfinished_requests():
        engine.step()
        running = [r for r in requests if r.block_ids]
        max_running = max(max_running, len(running))
        if running and all(r.num_computed_tokens > r.num_prompt_tokens for r in running):
            per_request = max(per_request, kv.pool.num_used * page_bytes / len(running))
    wall = time.perf_counter() - t0
    tokens = sum(len(p) for p in prompts) + len(prompts) * gen_len
    result = Run(window_pages, max_running, engine.scheduler.num_preemptions - preempted_before,
                 per_request / 2**20, wall, tokens / wall)
    outputs = [r.output_token_ids for r in requests]
    llm.close()
    return result, outputs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="gemma-3-270m")
    parser.add_argument("--requests", type=int, default=8)
    parser.add_argument("--prompt-len", type=int, default=3072)
    parser.add_argument("--gen-len", type=int, default=128)
    parser.add_argument("--kv-cache-gb", type=float, default=0.12)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()

    generator = torch.Generator().manual_seed(0)
    prompts = torch.randint(1000, 30000, (args.requests, args.prompt_len), generator=generator).tolist()
    runs, outputs = [], []
    for window_pages in (True, False):
        result, tokens = run(args.model, window_pages, prompts, args.gen_len, args.kv_cache_gb, args.dtype)
        runs.append(result)
        outputs.append(tokens)
        print(f"window pages {'on ' if window_pages else 'off'}: at most {result.max_running} running, "
              f"{result.preemptions} preemptions, at most {result.decode_kv_mib_per_request:.1f} MiB of KV per "
              f"decoding request, {result.wall_s:.1f} s, {result.tokens_per_s:.0f} tok/s")
    same = sum(a == b for a, b in zip(*outputs, strict=True))
    print(f"requests with the same greedy tokens in both modes: {same} of {len(prompts)}")
    on, off = runs
    print(f"window pages on / off: {on.max_running / max(off.max_running, 1):.2f}x the requests at once, "
          f"{off.decode_kv_mib_per_request / max(on.decode_kv_mib_per_request, 1e-9):.2f}x less KV per request, "
          f"{on.tokens_per_s / off.tokens_per_s:.2f}x the tokens/s")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "runs": [asdict(r) for r in runs], "same_tokens": same}, f, indent=2)


if __name__ == "__main__":
    main()
