"""``kvserve eval humaneval``: argparse and printing (the CLI may print)."""

from __future__ import annotations

import argparse
import json
import sys

from tqdm import tqdm

from kvserve.evals.humaneval import Completion, EvalConfig, evaluate
from kvserve.evals.sandbox import SandboxLimits


def add_eval_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="eval_command", required=True)
    p = sub.add_parser("humaneval", help="HumanEval pass@1 (greedy) against an OpenAI-compatible endpoint")
    p.add_argument("--base-url", default="http://127.0.0.1:8000", help="the endpoint (without /v1)")
    p.add_argument("--model", default=None, help="the model field of each request (default: the server's own)")
    p.add_argument("--max-tokens", type=int, default=512)
    p.add_argument("--concurrency", type=int, default=8, help="requests in flight at once")
    p.add_argument("--limit", type=int, default=None, help="only the first N problems")
    p.add_argument("--task-id", action="append", default=[], help="only these problems (repeat the flag)")
    p.add_argument("--timeout", type=float, default=10.0, help="seconds each program may run")
    p.add_argument("--api-key", default=None)
    p.add_argument("--out", default=None, help="write every completion and verdict to this JSON file")
    p.add_argument("--quiet", action="store_true", help="no progress bar")


def run_eval_command(args: argparse.Namespace) -> int:
    config = EvalConfig(args.base_url.rstrip("/"), args.model, args.max_tokens, args.concurrency, args.limit,
                        tuple(args.task_id), args.api_key, sandbox=SandboxLimits(timeout_s=args.timeout))
    bar = None if args.quiet else tqdm(desc="humaneval", unit="problem", file=sys.stderr)

    def progress(stage: str, record: Completion) -> None:
        if bar is not None and stage == "verdict":
            bar.update(1)

    result = evaluate(config, progress=progress)
    if bar is not None:
        bar.close()
    failed_to_generate = sum(1 for r in result.completions if r.error)
    print(f"pass@1 {result.pass_at_1:.4f} ({result.num_passed}/{result.num_problems}) in {result.seconds:.1f} s"
          + (f"; {failed_to_generate} not generated" if failed_to_generate else ""))
    if args.out:
        with open(args.out, "w", encoding="utf-8") as f:
            json.dump(result.to_json(), f, indent=1)
    return 0 if not failed_to_generate else 1
