"""Prefix cache on vs off, offline through the engine: an agentic workload and a chat workload.

    python benchmarks/prefix_cache.py [--sessions 8] [--turns 6] [--policy fcfs|lpm] [--output FILE]
    python benchmarks/prefix_cache.py --compare-tails [--repeats 2]

agentic: one ~1,500-token system prompt with tool schemas shared by every session; each of 8 sessions
runs 6 turns, every turn resending the whole conversation plus a short new user message (a closed loop:
a session's next turn is submitted when its previous reply is done, all sessions at once).
chat: distinct prompts sharing nothing (the cache can only cost here).
Reported for each run: prompt tokens, cached tokens, hit rate, prefill tokens actually computed, mean
TTFT and output throughput; then the on/off ratios. Output lengths are fixed (ignore_eos).

``--compare-tails`` runs the agentic workload with the cache on twice over, alternating: as it is, and
with full blocks only (finished requests' partly filled last blocks not kept, as before tails existed),
to show what taking over those blocks saves: prefill tokens computed (exact) and time (noisy).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from dataclasses import asdict, dataclass

from kvserve import LLM, SamplingParams
from kvserve.bench.workloads import agent_system_prompt, words


@dataclass
class RunResult:
    workload: str
    prefix_caching: bool
    policy: str
    requests: int
    prompt_tokens: int
    cached_tokens: int
    prefill_tokens_computed: int
    output_tokens: int
    seconds: float
    mean_ttft_ms: float

    @property
    def hit_rate(self) -> float:
        return self.cached_tokens / self.prompt_tokens

    @property
    def output_tok_s(self) -> float:
        return self.output_tokens / self.seconds

    @property
    def total_tok_s(self) -> float:
        return (self.prompt_tokens + self.output_tokens) / self.seconds


def run_agentic(llm: LLM, sessions: int, turns: int, output_len: int, seed: int) -> tuple[int, int, list[float], int]:
    engine = llm.engine
    tok = llm.get_tokenizer()
    system = agent_system_prompt()
    rng = random.Random(seed)
    conversations = [[{"role": "system", "content": system}] for _ in range(sessions)]
    turns_done = [0] * sessions
    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    prompt_tokens = cached = 0
    ttfts: list[float] = []
    owner: dict[str, int] = {}

    def submit(s: int) -> None:
        nonlocal prompt_tokens
        conversations[s].append({"role": "user", "content": f"Session {s}, step {turns_done[s]}: " + words(rng, 40)})
        ids = tok.encode(tok.apply_chat_template(conversations[s]), add_special_tokens=False)
        prompt_tokens += len(ids)
        request = engine.add_request({"prompt_token_ids": ids}, params, request_id=f"s{s}-t{turns_done[s]}")
        owner[request.request_id] = s

    for s in range(sessions):
        submit(s)
    while engine.has_unfinished_requests():
        for output in engine.step():
            if not output.finished:
                continue
            s = owner.pop(output.request_id)
            cached += output.num_cached_tokens
            ttfts.append(output.metrics.first_token_time - output.metrics.arrival_time)
            conversations[s].append({"role": "assistant", "content": output.outputs[0].text})
            turns_done[s] += 1
            if turns_done[s] < turns:
                submit(s)
    return prompt_tokens, cached, ttfts, sessions * turns


def run_chat(llm: LLM, num_requests: int, output_len: int, seed: int) -> tuple[int, int, list[float], int]:
    rng = random.Random(seed)
    tok = llm.get_tokenizer()
    prompts = [tok.encode(f"Request {i}. " + words(rng, rng.randint(150, 500)), add_special_tokens=False)
               for i in range(num_requests)]
    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    ttfts = [o.metrics.first_token_time - o.metrics.arrival_time for o in outputs]
    return sum(map(len, prompts)), sum(o.num_cached_tokens for o in outputs), ttfts, num_requests


def measure(workload: str, prefix_caching: bool, args: argparse.Namespace, keep_tails: bool = True) -> RunResult:
    # keep_tails=False: full blocks only, the prefix cache never keeps a partly filled block.
    llm = LLM(dtype=args.dtype, enable_prefix_caching=prefix_caching, scheduling_policy=args.policy,
              kv_cache_gb=args.kv_cache_gb, max_num_batched_tokens=args.max_num_batched_tokens,
              keep_tails=keep_tails)
    start_computed = llm.engine.stats().num_prompt_tokens_computed
    t0 = time.perf_counter()
    if workload == "agentic":
        prompt_tokens, cached, ttfts, n = run_agentic(llm, args.sessions, args.turns, args.output_len, args.seed)
    else:
        prompt_tokens, cached, ttfts, n = run_chat(llm, args.chat_requests, args.output_len, args.seed)
    seconds = time.perf_counter() - t0
    stats = llm.engine.stats()
    return RunResult(workload, prefix_caching, args.policy, n, prompt_tokens, cached,
                     stats.num_prompt_tokens_computed - start_computed, n * args.output_len, seconds,
                     statistics.fmean(ttfts) * 1e3)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workloads", default="agentic,chat")
    parser.add_argument("--sessions", type=int, default=8)
    parser.add_argument("--turns", type=int, default=6)
    parser.add_argument("--chat-requests", type=int, default=48)
    parser.add_argument("--output-len", type=int, default=32)
    parser.add_argument("--policy", default="lpm", choices=["fcfs", "lpm"])
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--kv-cache-gb", type=float, default=1.0)
    parser.add_argument("--max-num-batched-tokens", type=int, default=1024)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--output", default=None)
    parser.add_argument("--compare-tails", action="store_true",
                        help="agentic, cache on: with partly filled blocks kept against full blocks only")
    parser.add_argument("--repeats", type=int, default=2, help="--compare-tails: runs of each, alternating")
    args = parser.parse_args()
    if args.compare_tails:
        compare_tails(args)
        return

    results = []
    header = (f"{'workload':<8} {'cache':<5} {'reqs':>4} {'prompt':>7} {'cached':>7} {'hit':>6} {'computed':>8} "
              f"{'TTFT ms':>8} {'out tok/s':>9} {'tot tok/s':>9}")
    print(header)
    for workload in args.workloads.split(","):
        pair = {}
        for on in (False, True):
            r = measure(workload, on, args)
            pair[on] = r
            results.append(asdict(r) | {"hit_rate": r.hit_rate, "output_tok_s": r.output_tok_s})
            print(f"{r.workload:<8} {'on' if on else 'off':<5} {r.requests:>4} {r.prompt_tokens:>7} "
                  f"{r.cached_tokens:>7} {r.hit_rate:>6.1%} {r.prefill_tokens_computed:>8} {r.mean_ttft_ms:>8.0f} "
                  f"{r.output_tok_s:>9.1f} {r.total_tok_s:>9.1f}", flush=True)
        ratio = pair[True].output_tok_s / pair[False].output_tok_s
        print(f"{workload}: cache on / off throughput = {ratio:.2f}x, "
              f"TTFT {pair[True].mean_ttft_ms / pair[False].mean_ttft_ms:.2f}x")
    if args.output:
        with open(args.output, "w") as f:
            json.dump(results, f, indent=2)


def compare_tails(args: argparse.Namespace) -> None:
    runs: dict[bool, list[RunResult]] = {True: [], False: []}
    for i in range(args.repeats):
        for keep in ((True, False) if i % 2 == 0 else (False, True)):
            r = measure("agentic", True, args, keep_tails=keep)
            runs[keep].append(r)
            print(f"{'tails' if keep else 'blocks only':<11} prompt {r.prompt_tokens:>6}  cached {r.cached_tokens:>6} "
                  f"({r.hit_rate:.1%})  computed {r.prefill_tokens_computed:>6}  mean TTFT {r.mean_ttft_ms:>5.0f} ms  "
                  f"{r.output_tok_s:>5.1f} out tok/s  {r.seconds:.1f} s", flush=True)
    with_tails, blocks = runs[True], runs[False]
    computed = statistics.fmean(r.prefill_tokens_computed for r in with_tails) / statistics.fmean(
        r.prefill_tokens_computed for r in blocks)
    speed = [t.output_tok_s / b.output_tok_s for t, b in zip(with_tails, blocks, strict=True)]
    print(f"tails / blocks only: prefill computed {computed:.3f}x, output tok/s per pair "
          + ", ".join(f"{x:.2f}x" for x in speed))
    if args.output:
        with open(args.output, "w") as f:
            json.dump({("tails" if keep else "blocks_only"): [asdict(r) | {"hit_rate": r.hit_rate,
                                                                       "output_tok_s": r.output_tok_s}
                                                          for r in rs] for keep, rs in runs.items()}, f, indent=2)


if __name__ == "__main__":
    main()
