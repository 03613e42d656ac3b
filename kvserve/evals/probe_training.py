"""Training the ``probe`` model policy offline: labelled prompts -> the small model's hidden states (its
server's /v1/embeddings) -> a logistic classifier of whether the small model fails, saved for the gateway.

Labelled examples are JSON lines ``{"prompt": text or token ids, "label": 1 if the small model fails else 0}``.
From a run of the small model on HumanEval or on the LeetCode problems (``kvserve eval humaneval --out``,
``kvserve eval leetcode --out``) they are each problem's prompt, labelled by its verdict.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

import httpx
import numpy as np

from kvserve.errors import ConfigError
from kvserve.evals.humaneval import Problem
from kvserve.router.model_policies import LogisticProbe

EMBEDDING_BATCH = 16
FOLDS = 5
L2_GRID = (1.0, 10.0, 100.0, 1000.0, 10000.0)  # the regularisations cross-validation chooses among


def read_examples(path: str) -> tuple[list[str | list[int]], np.ndarray]:
    prompts, labels = [], []
    with open(path, encoding="utf-8") as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            example = json.loads(line)
            if not isinstance(example.get("prompt"), str | list) or example.get("label") not in (0, 1):
                raise ConfigError(f"{path}:{number}: an example is {{\"prompt\": ..., \"label\": 0 or 1}}",
                                  "examples")
            prompts.append(example["prompt"])
            labels.append(float(example["label"]))
    return prompts, np.array(labels)


def run_examples(small_run: dict[str, Any], problems: Sequence[Problem]) -> list[dict[str, Any]]:
    """Each problem of the small model's run (``kvserve eval humaneval`` or ``leetcode``, whose ``problems``
    these are), labelled 1 where it failed."""
    prompts = {p.task_id: p.prompt for p in problems}
    return [{"prompt": prompts[c["task_id"]], "label": int(not c["passed"])} for c in small_run["completions"]]


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


def train_probe(base_url: str, model: str, prompts: Sequence[str | list[int]], labels: np.ndarray,
                l2: float | None = None, api_key: str | None = None) -> LogisticProbe:
    """The probe on the prompts' hidden states; ``l2`` None: chosen by cross-validation (``choose_l2``)."""
    features = hidden_states(base_url, model, prompts, api_key)
    if l2 is None:
        l2, _ = choose_l2(features, labels, model)
    return LogisticProbe.fit(model, features, labels, l2=l2)


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
