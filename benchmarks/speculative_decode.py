"""Speculative decoding (n-gram prompt lookup) against plain decoding, side by side in one process.

    python benchmarks/speculative_decode.py [--sessions 32] [--turns 3] [--max-num-seqs 16] [--output-len 32]

1. Workloads. The agentic sessions of ``kvserve bench`` (the shared system prompt with tool schemas, task,
   tool results, and each reply fed back into the next turn) and chat requests go through two engines, one
   plain and one speculating, turn by turn, in alternating order. Both get identical prompts: conversations
   continue with the plain engine's replies. More sessions than ``--max-num-seqs`` slots, so continuous
   batching refills slots as requests finish. Reported per turn: output tokens/s of each engine (wall time of
   the whole turn, prefill included), the ratio, drafts accepted, tokens per decode step.
2. Cost of a draft. 16 requests with a shared 1,568-token prefix decode with k forced drafts each
   (k = 0..4, a proposer that always guesses): ms per step, so the price of every extra row is visible.
   Acceptance has to pay for it.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

from kvserve import LLM, SamplingParams
from kvserve.bench.workloads import Conversation, Workload, WorkloadConfig
from kvserve.runner.sampler import SamplingState


def chat_prompts(llm: LLM, conversations: list[list[dict[str, str]]]) -> list[dict[str, list[int]]]:
    tok = llm.get_tokenizer()
    return [{"prompt_token_ids": tok.encode(tok.apply_chat_template(c, add_generation_prompt=True),
                                            add_special_tokens=False)} for c in conversations]


def timed_generate(llm: LLM, prompts: list[dict], params: SamplingParams) -> tuple[float, list, dict[str, int]]:
    before = llm.engine.stats()
    t0 = time.perf_counter()
    outputs = llm.generate(prompts, params)
    seconds = time.perf_counter() - t0
    after = llm.engine.stats()
    counts = {"tokens": sum(len(o.outputs[0].token_ids) for o in outputs),
              "steps": after.num_steps - before.num_steps,
              "drafts": after.num_draft_tokens - before.num_draft_tokens,
              "accepted": after.num_accepted_draft_tokens - before.num_accepted_draft_tokens}
    return seconds, outputs, counts


def run_workload(name: str, plain: LLM, spec: LLM, args: argparse.Namespace) -> list[dict]:
    workload = Workload(WorkloadConfig(name=name, input_len=64, output_len=args.output_len, turns=args.turns))
    sessions = [workload.session(k) for k in range(args.sessions)]
    conversations = [Conversation(s.system) for s in sessions]
    params = SamplingParams(temperature=0.0, max_tokens=args.output_len, min_tokens=args.output_len,
                            ignore_eos=True)
    rows = []
    for turn in range(len(sessions[0].turns)):
        messages = [c.with_turn(s.turns[turn].message) for s, c in zip(sessions, conversations, strict=True)]
        prompts = chat_prompts(plain, messages)
        order = [("plain", plain), ("ngram", spec)] if turn % 2 == 0 else [("ngram", spec), ("plain", plain)]
        results = {label: timed_generate(llm, prompts, params) for label, llm in order}
        (t_plain, outputs, counts_plain), (t_spec, _, counts) = results["plain"], results["ngram"]
        row = {"workload": name, "turn": turn, "requests": len(prompts),
               "plain_tok_s": counts_plain["tokens"] / t_plain, "ngram_tok_s": counts["tokens"] / t_spec,
               "ratio": t_plain / t_spec, "steps_plain": counts_plain["steps"], "steps_ngram": counts["steps"],
               "drafts": counts["drafts"], "accepted": counts["accepted"]}
        rows.append(row)
        print(f"{name} turn {turn}: plain {row['plain_tok_s']:6.1f} tok/s, ngram {row['ngram_tok_s']:6.1f} tok/s "
              f"({row['ratio']:.2f}x); steps {row['steps_plain']} -> {row['steps_ngram']}; "
              f"accepted {counts['accepted']}/{counts['drafts']} drafts", flush=True)
        for session, conversation, output in zip(sessions, conversations, outputs, strict=True):
            conversation.append(session.turns[turn].message, output.outputs[0].text)
    return rows


class ForcedDrafts:
    """A proposer that always offers ``k`` drafts of a token the model never picks here (the vocabulary's last
    id), so every step verifies k rows per request and accepts none: the cost side of speculation."""

    def __init__(self, k: int, token_id: int) -> None:
        self.k = k
        self.token_id = token_id

    def propose(self, request_id: str, state: SamplingState, verified: tuple[int, int] | None = None) -> list[int]:
        return [self.token_id] * self.k

    def forget(self, request_id: str) -> None:
        pass


def draft_cost(spec: LLM, num_requests: int, prefix: int, suffix: int, steps: int) -> dict[int, float]:
    engine = spec.engine
    proposer = engine.runner.proposer
    shared = list(range(1000, 1000 + prefix))
    prompts = [{"prompt_token_ids": shared + list(range(5000 + suffix * i, 5000 + suffix * (i + 1)))}
               for i in range(num_requests)]
    spec.generate(prompts[:1], SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True))  # cache the prefix
    results: dict[int, list[float]] = {k: [] for k in range(5)}
    try:
        for _ in range(2):
            for k in results:
                engine.runner.proposer = ForcedDrafts(k, engine.arch.vocab_size - 1) if k else None
                params = SamplingParams(temperature=0.0, max_tokens=steps + 4, ignore_eos=True)
                requests = [engine.add_request(p, params) for p in prompts]
                while any(r.num_output_tokens < 2 for r in requests):  # prefill, then a first proposal
                    engine.step()
                times = []
                for _ in range(steps):
                    t0 = time.perf_counter()
                    engine.step()
                    times.append((time.perf_counter() - t0) * 1e3)
                while engine.has_unfinished_requests():
                    engine.step()
                assert not any(r.metrics.num_accepted_draft_tokens for r in requests), "a forced draft was accepted"
                results[k].append(statistics.median(times))
    finally:
        engine.runner.proposer = proposer
    return {k: min(v) for k, v in results.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sessions", type=int, default=32)
    parser.add_argument("--turns", type=int, default=3, help="agentic turns per session")
    parser.add_argument("--max-num-seqs", type=int, default=16)
    parser.add_argument("--output-len", type=int, default=32)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--num-speculative-tokens", type=int, default=4)
    parser.add_argument("--prompt-lookup-min", type=int, default=2)
    parser.add_argument("--prompt-lookup-max", type=int, default=4)
    parser.add_argument("--disable-by-batch-size", type=int, default=None)
    parser.add_argument("--skip-cost", action="store_true", help="only the workloads")
    parser.add_argument("--out", default="bench_results/speculative_decode.json")
    args = parser.parse_args()
    ngram = {"method": "ngram", "num_speculative_tokens": args.num_speculative_tokens,
             "prompt_lookup_min": args.prompt_lookup_min, "prompt_lookup_max": args.prompt_lookup_max,
             "disable_by_batch_size": args.disable_by_batch_size}

    def make(spec: dict | None) -> LLM:
        return LLM(dtype=args.dtype, max_num_seqs=args.max_num_seqs, kv_cache_gb=0.5, speculative_config=spec)

    plain, spec = make(None), make(ngram)
    warm = [{"prompt_token_ids": list(range(100, 400))}]
    for llm in (plain, spec):
        llm.generate(warm, SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))
    rows = run_workload("agentic", plain, spec, args) + run_workload("chat", plain, spec, args)
    cost = {} if args.skip_cost else draft_cost(spec, num_requests=16, prefix=1568, suffix=100, steps=12)
    if cost:
        print("decode step, 16 requests, 1,568 shared + 100 own tokens, k forced drafts each:")
        for k, ms in cost.items():
            print(f"  k={k}: {ms:6.1f} ms/step ({ms / cost[0]:.2f}x; {16 * (1 + k)} rows)")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"config": vars(args) | {"speculative": ngram}, "turns": rows,
                               "draft_cost_ms": cost}, indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
