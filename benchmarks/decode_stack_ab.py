"""Decode steps with the fused C++ decoder stack against the Python layers, interleaved step by step; or
(``--compare pool``) the kernels' worker threads against OpenMP's team.

    python benchmarks/decode_stack_ab.py [--concurrency 1 4 16] [--output docs/results/decode-stack-ab-CPU-DATE.json]
    python benchmarks/decode_stack_ab.py --compare pool [--output docs/results/worker-pool-ab-CPU-DATE.json]

Replays the agentic workload offline (the sessions ``kvserve bench --workload agentic`` sends: one long
system prompt with tool schemas, 64-token messages): each session's first turn with 32 output tokens, then
its second turn with 96, all sessions at once. Every engine step of the second turn alternates between the
fused stack (csrc/decode_stack.cpp) and the Python layers, so both see the same batch, the same contexts
and the same machine phase; the figures are the decode-only steps with every session running (median and
minimum per side). Greedy outputs are the same either way (tests/e2e/test_fused_decode.py checks the bits).

``--compare pool`` alternates how a step uses the threads, under the server's ``OMP_WAIT_POLICY=PASSIVE``:
the kernels' parallel regions on their worker threads (csrc/worker_pool.cpp) with torch's own ops on the
calling thread (``KernelThreadScope``, the default), or everything on OpenMP's team; on the same decode
steps, then on prefill steps (1,024-token prompts without the prefix cache, alternating too). The outputs
are bit for bit the same (tests/model/test_worker_pool.py).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from collections.abc import Callable
from contextlib import nullcontext
from pathlib import Path

# Per comparison, its two sides: the new path first, the one it replaces second.
SIDES = {"fused": ("fused", "python"), "pool": ("pool", "openmp")}


def measure(concurrency: int, compare: str) -> dict[str, float | int]:
    import torch

    from kvserve import LLM, SamplingParams
    from kvserve.bench.workloads import Conversation, Workload, WorkloadConfig

    llm = LLM(dtype="bfloat16", max_num_seqs=64, max_num_batched_tokens=1024)
    engine, model = llm.engine, llm.engine.runner.model
    stack = model.fused_decode
    if stack is None:
        raise SystemExit("no fused decode stack on this machine (it needs the AMX CPU kernels)")
    choose: Callable[[bool], None]
    if compare == "fused":
        def choose(first: bool) -> None:
            model.fused_decode = stack if first else None
    else:
        scope = model.thread_scope  # the pool side: torch's ops on the caller, the kernels on every thread

        def choose(first: bool) -> None:
            model.thread_scope = scope if first else nullcontext()
            torch.ops.kvserve.use_worker_pool(first)
    tok = llm.get_tokenizer()
    workload = Workload(WorkloadConfig(name="agentic", input_len=64, output_len=32, turns=4, seed=0))
    sessions = [workload.session(k) for k in range(concurrency)]
    conversations = [Conversation(s.system) for s in sessions]
    step_times: dict[bool, list[float]] = {True: [], False: []}
    for turn, max_tokens in ((0, 32), (1, 96)):
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        for i, session in enumerate(sessions):
            text = tok.apply_chat_template(conversations[i].with_turn(session.turns[turn].message))
            engine.add_request({"prompt_token_ids": tok.encode(text, add_special_tokens=False)}, params,
                               request_id=f"{turn}-{i}")
        replies: dict[str, str] = {}
        fused = False  # this step's side: the first of SIDES[compare]
        while engine.has_unfinished_requests():
            fused = not fused
            choose(fused)
            decode_only = not engine.scheduler.waiting and all(
                r.num_computed_tokens >= r.num_prompt_tokens for r in engine.scheduler.running)
            full = len(engine.scheduler.running) == concurrency
            start = time.perf_counter()
            outputs = engine.step()
            elapsed = time.perf_counter() - start
            if turn == 1 and decode_only and full:
                step_times[fused].append(elapsed)
            replies.update((o.request_id, o.outputs[0].text) for o in outputs if o.finished)
        for i, session in enumerate(sessions):
            conversations[i].append(session.turns[turn].message, replies[f"{turn}-{i}"])
    choose(True)
    row = summarise(concurrency, compare, step_times)
    if compare == "pool":
        row["prefill"] = prefill_steps(engine, SamplingParams, choose)
        choose(True)
    llm.close()
    return row


def summarise(concurrency: int, compare: str, step_times: dict[bool, list[float]]) -> dict[str, float | int]:
    first, second = SIDES[compare]
    a_ms = [t * 1e3 for t in step_times[True]]
    b_ms = [t * 1e3 for t in step_times[False]]
    return {"concurrency": concurrency, "steps_each": min(len(a_ms), len(b_ms)),
            f"{first}_median_ms": statistics.median(a_ms), f"{second}_median_ms": statistics.median(b_ms),
            f"{first}_min_ms": min(a_ms), f"{second}_min_ms": min(b_ms),
            "speedup_median": statistics.median(b_ms) / statistics.median(a_ms),
            "speedup_min": min(b_ms) / min(a_ms)}


def prefill_steps(engine, sampling_params, choose: Callable[[bool], None], pairs: int = 20) -> dict[str, float]:  # noqa: ANN001
    """Whole 1,024-token prefills (one engine step each, no cached prefix), the two sides alternating."""
    import torch

    generator = torch.Generator().manual_seed(0)
    params = sampling_params(max_tokens=1, temperature=0.0, ignore_eos=True)
    times: dict[bool, list[float]] = {True: [], False: []}
    for i in range(2 * pairs):
        side = i % 2 == 0
        choose(side)
        # Random ids: no prefix in the cache, and no two prompts alike.
        prompt = torch.randint(100, 40_000, (1024,), generator=generator).tolist()
        engine.add_request({"prompt_token_ids": prompt}, params, request_id=f"prefill-{i}")
        start = time.perf_counter()
        while engine.has_unfinished_requests():
            engine.step()
        times[side].append(time.perf_counter() - start)
    a, b = statistics.median(times[True]), statistics.median(times[False])
    return {"pairs": pairs, "first_median_ms": a * 1e3, "second_median_ms": b * 1e3, "speedup_median": b / a}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--concurrency", type=int, nargs="+", default=None,
                        help="sessions (default: 1 4 16; with --compare pool: 16)")
    parser.add_argument("--compare", choices=sorted(SIDES), default="fused",
                        help="fused: the C++ decoder stack vs the Python layers; pool: worker threads vs OpenMP")
    parser.add_argument("--output", default=None, help="write the figures as JSON")
    args = parser.parse_args()
    if args.compare == "pool":
        os.environ["OMP_WAIT_POLICY"] = "PASSIVE"  # as `kvserve serve` sets it; torch is not imported yet
    first, second = SIDES[args.compare]
    results = []
    for concurrency in args.concurrency or ([16] if args.compare == "pool" else [1, 4, 16]):
        row = measure(concurrency, args.compare)
        results.append(row)
        print(f"{concurrency:3d} sessions: decode step {row[f'{first}_median_ms']:.1f} ms {first}, "
              f"{row[f'{second}_median_ms']:.1f} ms {second} (median of {row['steps_each']} each): "
              f"{row['speedup_median']:.2f}x; minima {row['speedup_min']:.2f}x")
        if "prefill" in row:
            p = row["prefill"]
            print(f"     1,024-token prefill: {p['first_median_ms']:.0f} ms {first}, {p['second_median_ms']:.0f} ms "
                  f"{second} (median of {p['pairs']} each): {p['speedup_median']:.2f}x")
    if args.output:
        Path(args.output).write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
