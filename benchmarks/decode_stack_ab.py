"""Decode steps with the fused C++ decoder stack against the Python layers, interleaved step by step.

    python benchmarks/decode_stack_ab.py [--concurrency 1 4 16] [--output docs/decode_stack_ab.json]

Replays the agentic workload offline (the sessions ``kvserve bench --workload agentic`` sends: one long
system prompt with tool schemas, 64-token messages): each session's first turn with 32 output tokens, then
its second turn with 96, all sessions at once. Every engine step of the second turn alternates between the
fused stack (csrc/decode_stack.cpp) and the Python layers, so both see the same batch, the same contexts
and the same machine phase; the figures are the decode-only steps with every session running (median and
minimum per side). Greedy outputs are the same either way (tests/e2e/test_fused_decode.py checks the bits).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

from kvserve import LLM, SamplingParams
from kvserve.bench.workloads import Conversation, Workload, WorkloadConfig


def measure(concurrency: int) -> dict[str, float | int]:
    llm = LLM(dtype="bfloat16", max_num_seqs=64, max_num_batched_tokens=1024)
    engine, model = llm.engine, llm.engine.runner.model
    stack = model.fused_decode
    if stack is None:
        raise SystemExit("no fused decode stack on this machine (it needs the AMX CPU kernels)")
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
        fused = False
        while engine.has_unfinished_requests():
            fused = not fused
            model.fused_decode = stack if fused else None
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
    model.fused_decode = stack
    llm.close()
    fused_ms = [t * 1e3 for t in step_times[True]]
    python_ms = [t * 1e3 for t in step_times[False]]
    return {"concurrency": concurrency, "steps_each": min(len(fused_ms), len(python_ms)),
            "fused_median_ms": statistics.median(fused_ms), "python_median_ms": statistics.median(python_ms),
            "fused_min_ms": min(fused_ms), "python_min_ms": min(python_ms),
            "speedup_median": statistics.median(python_ms) / statistics.median(fused_ms),
            "speedup_min": min(python_ms) / min(fused_ms)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 16])
    parser.add_argument("--output", default=None, help="write the figures as JSON")
    args = parser.parse_args()
    results = []
    for concurrency in args.concurrency:
        row = measure(concurrency)
        results.append(row)
        print(f"{concurrency:3d} sessions: decode step {row['fused_median_ms']:.1f} ms fused, "
              f"{row['python_median_ms']:.1f} ms Python layers (median of {row['steps_each']} each): "
              f"{row['speedup_median']:.2f}x; minima {row['speedup_min']:.2f}x")
    if args.output:
        Path(args.output).write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
