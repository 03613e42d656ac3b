"""KV memory of a sliding-window model: window layers' pages freed past the window, against every layer keeping
every block (``--no-window-pages``), side by side in one run on the same KV budget.

    python benchmarks/window_kv.py [--model gemma-3-270m] [--requests 8] [--prompt-len 2048] [--gen-len 32]
        [--kv-cache-gb 0.08] [--dtype bfloat16] [--json out.json]

``--requests`` prompts of ``--prompt-len`` random token ids (distinct: no cache hits) are submitted at once to
an engine with a KV pool of ``--kv-cache-gb``, once with window pages and once without. Per mode: the most
requests running at once, preemptions, KV bytes held per running request at the peak, wall time and
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
    peak_kv_mib_per_request: float  # KV held at the step with the most running requests, per request
    wall_s: float
    tokens_per_s: float  # prompt and generated tokens


def run(model: str, window_pages: bool, prompts: list[list[int]], gen_len: int, kv_cache_gb: float,
        dtype: str) -> tuple[Run, list[list[int]]]:
    llm = LLM(model=model, dtype=dtype, kv_cache_gb=kv_cache_gb, enable_prefix_caching=False,
              window_pages=window_pages, max_num_seqs=len(prompts))
    engine = llm.engine
    kv, layout = engine.kv_manager, engine.kv_layout
    layer_bytes = engine.arch.kv_bytes_per_token(torch.empty(0, dtype=engine.dtype).element_size())
    page_bytes = layer_bytes * layout.layers_per_page // engine.arch.num_layers * kv.block_size
    llm.generate([{"prompt_token_ids": prompts[0][:32]}], SamplingParams(max_tokens=2))  # warm-up
    preempted_before = engine.scheduler.num_preemptions
    params = SamplingParams(temperature=0.0, max_tokens=gen_len, ignore_eos=True)
    requests = [engine.add_request({"prompt_token_ids": p}, params) for p in prompts]
    max_running, peak_bytes = 0, 0
    t0 = time.perf_counter()
    while engine.has_unfinished_requests():
        engine.step()
        running = engine.scheduler.num_running
        if running > max_running or (running == max_running and kv.pool.num_used * page_bytes > peak_bytes):
            max_running, peak_bytes = running, kv.pool.num_used * page_bytes
    wall = time.perf_counter() - t0
    tokens = sum(len(p) for p in prompts) + len(prompts) * gen_len
    result = Run(window_pages, max_running, engine.scheduler.num_preemptions - preempted_before,
                 peak_bytes / max(max_running, 1) / 2**20, wall, tokens / wall)
    outputs = [r.output_token_ids for r in requests]
    llm.close()
    return result, outputs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="gemma-3-270m")
    parser.add_argument("--requests", type=int, default=8)
    parser.add_argument("--prompt-len", type=int, default=2048)
    parser.add_argument("--gen-len", type=int, default=32)
    parser.add_argument("--kv-cache-gb", type=float, default=0.08)
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
              f"{result.preemptions} preemptions, {result.peak_kv_mib_per_request:.1f} MiB of KV per request at "
              f"the peak, {result.wall_s:.1f} s, {result.tokens_per_s:.0f} tok/s")
    same = sum(a == b for a, b in zip(*outputs, strict=True))
    print(f"requests with the same greedy tokens in both modes: {same} of {len(prompts)}")
    on, off = runs
    print(f"window pages on / off: {on.max_running / max(off.max_running, 1):.2f}x the requests at once, "
          f"{off.peak_kv_mib_per_request / max(on.peak_kv_mib_per_request, 1e-9):.2f}x less KV per request, "
          f"{on.tokens_per_s / off.tokens_per_s:.2f}x the tokens/s")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "runs": [asdict(r) for r in runs], "same_tokens": same}, f, indent=2)


if __name__ == "__main__":
    main()
