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
from kvserve.router.model_policies import LogisticProbe

EMBEDDING_BATCH = 16


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


def run_examples(small_run: dict[str, Any], benchmark: str = "humaneval") -> list[dict[str, Any]]:
    """Each problem of the small model's run of ``benchmark`` (``kvserve eval humaneval`` or ``leetcode``),
    labelled 1 where it failed."""
    if benchmark == "leetcode":
        from kvserve.evals.leetcode import load_problems
    else:
        from kvserve.evals.humaneval import load_problems

    prompts = {p.task_id: p.prompt for p in load_problems()}
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
                l2: float = 1.0, api_key: str | None = None) -> LogisticProbe:
    return LogisticProbe.fit(model, hidden_states(base_url, model, prompts, api_key), labels, l2=l2)
