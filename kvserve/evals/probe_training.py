"""Training the ``probe`` and ``gain`` model policies offline: labelled prompts -> the small model's hidden
states (its server's /v1/embeddings) -> a logistic classifier of whether the small model fails (``probe``), and
with the large model's labels one of whether the large model fails too (``gain``), saved for the gateway.

Labelled examples are JSON lines ``{"prompt": text or token ids, "label": 1 if the small model fails else 0}``,
with ``"large_label"`` (1 if the large model fails) for a gain probe. From runs of the models on HumanEval or on
the LeetCode problems (``kvserve eval humaneval --out``, ``kvserve eval leetcode --out``) they are each
problem's prompt, labelled by each model's verdict.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import httpx
import numpy as np

from kvserve.errors import ConfigError
from kvserve.evals.humaneval import Problem
from kvserve.router.model_policies import GainProbe, LogisticProbe

EMBEDDING_BATCH = 16
FOLDS = 5
L2_GRID = (1.0, 10.0, 100.0, 1000.0, 10000.0)  # the regularisations cross-validation chooses among


def read_examples(path: str) -> list[dict[str, Any]]:
    examples = []
    try:
        lines = Path(path).read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"cannot read {path}: {exc}", "examples") from None
    for number, line in enumerate(lines, 1):
        if line.strip():
            try:
                example = json.loads(line)
            except (ValueError, RecursionError):
                example = None
            if not isinstance(example, dict) or not isinstance(example.get("prompt"), str | list) \
                    or example.get("label") not in (0, 1) or example.get("large_label", 0) not in (0, 1):
                raise ConfigError(f"{path}:{number}: an example is {{\"prompt\": ..., \"label\": 0 or 1}}, with "
                                  f"\"large_label\": 0 or 1 for a gain probe", "examples")
            examples.append(example)
    return examples


def run_examples(small_run: dict[str, Any], problems: Sequence[Problem],
                 large_run: dict[str, Any] | None = None) -> list[dict[str, Any]]:
    """Each problem of the small model's run (``kvserve eval humaneval`` or ``leetcode``, whose ``problems``
    these are), labelled 1 where it failed; with the large model's run of the same problems, ``large_label``
    1 where that one failed."""
    prompts = {p.task_id: p.prompt for p in problems}
    examples = [{"prompt": prompts[c["task_id"]], "label": int(not c["passed"])} for c in small_run["completions"]]
    if large_run is not None:
        large_fails = {c["task_id"]: int(not c["passed"]) for c in large_run["completions"]}
        missing = [c["task_id"] for c in small_run["completions"] if c["task_id"] not in large_fails]
        if missing:
            raise ConfigError(f"the large model's run has no verdict for {len(missing)} of the small model's "
                              f"problems ({', '.join(missing[:3])}...)", "large_run")
        for example, completion in zip(examples, small_run["completions"], strict=True):
            example["large_label"] = large_fails[completion["task_id"]]
    return examples


def hidden_states(base_url: str, model: str | None, prompts: Sequence[str | list[int]],
                  api_key: str | None = None, timeout_s: float = 600.0) -> np.ndarray:
    """The model's hidden state at each prompt's last token, as its server's /v1/embeddings gives it."""
    headers = {"authorization": f"Bearer {api_key}"} if api_key else {}
    vectors: list[list[float]] = []
    with httpx.Client(timeout=timeout_s, headers=headers) as client:
        for start in range(0, len(prompts), EMBEDDING_BATCH):
            body: dict[str, Any] = {"input": list(prompts[start:start + EMBEDDING_BATCH])}
            if model is not None:
                body["model"] = model
            response = client.post(f"{base_url}/v1/embeddings", json=body)
            response.raise_for_status()
            vectors.extend(d["embedding"] for d in sorted(response.json()["data"], key=lambda d: d["index"]))
    return np.array(vectors, dtype=np.float64)


def train_probe(base_url: str, model: str, examples: Sequence[dict[str, Any]], l2: float | None = None,
                api_key: str | None = None) -> LogisticProbe | GainProbe:
    """The probe of the small model's failure on the examples' hidden states, or where every example has a
    ``large_label`` the gain probe; ``l2`` None: each probe's chosen by cross-validation (``choose_l2``)."""
    with_large = sum("large_label" in e for e in examples)
    if with_large not in (0, len(examples)):
        raise ConfigError(f"{with_large} of {len(examples)} examples have a large_label: a gain probe needs it on "
                          "every one", "examples")
    label_sets = [("label", "the small")] + ([("large_label", "the large")] if with_large else [])
    labels = [np.array([float(e[key]) for e in examples]) for key, _ in label_sets]
    for (_, who), y in zip(label_sets, labels, strict=True):
        if len(set(y.tolist())) < 2:
            raise ConfigError(f"the examples need both labels: some where {who} model fails, some where it does "
                              "not", "examples")
    features = hidden_states(base_url, model, [e["prompt"] for e in examples], api_key)
    probes = [LogisticProbe.fit(model, features, y, l2=l2 if l2 is not None else choose_l2(features, y, model)[0])
              for y in labels]
    return GainProbe(*probes) if with_large else probes[0]


def cross_validated(features: np.ndarray, labels: np.ndarray, model: str, l2: float, seed: int = 0,
                    extra_features: np.ndarray | None = None, extra_labels: np.ndarray | None = None) -> np.ndarray:
    """Each example's P(the small model fails) from a probe trained on the other folds (``seed`` deals the
    examples into FOLDS) and on every extra example."""
    order = np.random.default_rng(seed).permutation(len(labels))
    out = np.zeros(len(labels))
    for fold in range(FOLDS):
        test = order[fold::FOLDS]
        train = np.setdiff1d(order, test)
        x, y = features[train], labels[train]
        if extra_features is not None and extra_labels is not None:
            x, y = np.vstack([x, extra_features]), np.concatenate([y, extra_labels])
        probe = LogisticProbe.fit(model, x, y, l2=l2)
        out[test] = [probe.predict(row) for row in features[test]]
    return out


def log_loss(p_fail: np.ndarray, labels: np.ndarray) -> float:
    p = np.clip(p_fail, 1e-9, 1 - 1e-9)
    return float(-np.mean(labels * np.log(p) + (1 - labels) * np.log(1 - p)))


def choose_l2(features: np.ndarray, labels: np.ndarray, model: str,
              grid: Sequence[float] = L2_GRID) -> tuple[float, dict[float, float]]:
    """The regularisation in ``grid`` of least cross-validated log loss on these examples, and each one's loss:
    how much to shrink depends on how many examples there are against the hidden state's width."""
    losses = {l2: log_loss(cross_validated(features, labels, model, l2), labels) for l2 in grid}
    return min(losses, key=lambda l2: losses[l2]), losses
