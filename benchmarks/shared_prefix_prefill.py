"""Prefill chunks over a shared system prompt: its keys packed once per layer and kept, against packed by
every work item of every chunk, side by side in one process.

    python benchmarks/shared_prefix_prefill.py [--sessions 16] [--turns 2] [--repeats 6] [--output FILE]

The agentic load of `kvserve bench` offline: each session's turns resend the conversation (the shared
~1,560-token tool-schema system prompt, earlier messages and replies) plus a new message; all sessions
submit a turn together and the next turn starts when every reply is done. Two engines (bfloat16, the AMX
kernels) run the same conversations, their order alternating per repetition; each repetition starts the
system prompt with a fresh nonce, so both compute it once. In one engine the runner's threshold for a
shared prefill prefix is out of reach, so every (chunk, KV head) work item of the attention kernel packs
all its keys into the tile layouts; in the other the keys every chunk holds in the same blocks are packed
once per layer and kept across steps while the blocks are unchanged. Reports each repetition's wall time
for both, the ratio, and whether the greedy outputs are identical (they must be: the kernel gives the
same bits either way).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

from kvserve import LLM, SamplingParams
from kvserve.bench.workloads import Conversation, Workload, WorkloadConfig


def run(llm: LLM, workload: Workload, sessions: int, turns: int, nonce: int) -> tuple[float, dict[str, list[int]]]:
    engine, tok = llm.engine, llm.get_tokenizer()
    params = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
    specs = [workload.session(k) for k in range(sessions)]
    conversations = [Conversation(f"[{nonce}] {spec.system}") for spec in specs]
    outputs: dict[str, list[int]] = {}
    t0 = time.perf_counter()
    for turn in range(turns):
        for k, spec in enumerate(specs):
            text = tok.apply_chat_template(conversations[k].with_turn(spec.turns[turn].message),
                                           add_generation_prompt=True)
            engine.add_request({"prompt_token_ids": tok.encode(text, add_special_tokens=False)}, params,
                               request_id=f"{nonce}-{k}-{turn}")
        while engine.has_unfinished_requests():
            for output in engine.step():
                if output.finished:
                    outputs[output.request_id] = output.outputs[0].token_ids
                    k = int(output.request_id.split("-")[1])
                    conversations[k].append(specs[k].turns[turn].message, output.outputs[0].text)
    return time.perf_counter() - t0, outputs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sessions", type=int, default=16)
    parser.add_argument("--turns", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=6)
    parser.add_argument("--output", default=None)
    args = parser.parse_args()

    llms = {"kept": LLM(dtype="bfloat16"), "per item": LLM(dtype="bfloat16")}
    llms["per item"].engine.runner.shared_prefill_min_tokens = 1 << 30  # never: every item packs its keys
    workload = Workload(WorkloadConfig(name="agentic", seed=0, input_len=64, output_len=32, turns=max(4, args.turns)))
    rows = []
    for rep in range(args.repeats):
        order = ("kept", "per item") if rep % 2 == 0 else ("per item", "kept")
        results = {name: run(llms[name], workload, args.sessions, args.turns, 1000 + rep) for name in order}
        same = results["kept"][1] == results["per item"][1]
        ratio = results["per item"][0] / results["kept"][0]
        rows.append({"kept_s": results["kept"][0], "per_item_s": results["per item"][0], "speedup": ratio,
                     "identical_outputs": same})
        print(f"rep {rep}: kept {results['kept'][0]:.2f} s, per item {results['per item'][0]:.2f} s, "
              f"{ratio:.3f}x, identical outputs: {same}", flush=True)
    print(f"median {statistics.median(r['speedup'] for r in rows):.3f}x over {len(rows)} repetitions")
    if args.output:
        with open(args.output, "w") as f:
            json.dump(rows, f, indent=2)


if __name__ == "__main__":
    main()
