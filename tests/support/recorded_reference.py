"""transformers' greedy output recorded in tests/data, for real models whose transformers load costs more of
CI's time than the check it feeds (transformers' GGUF loader parses a large vocabulary's metadata in Python).
Each recording names the file (by SHA256) and the transformers version that made it; a `heavy` test per model
computes the same output live and compares it with the recording, and rewrites it when asked to
(``KVSERVE_RECORD_REFERENCE=1 pytest -m heavy ...``)."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

DATA = Path(__file__).resolve().parents[1] / "data"
RECORD_ENV = "KVSERVE_RECORD_REFERENCE"


@dataclass(frozen=True, slots=True)
class RecordedGreedy:
    """transformers' float32 greedy continuation of each prompt, with what made it."""

    model_sha256: str
    transformers_version: str
    max_new_tokens: int
    prompt_token_ids: list[list[int]]
    token_ids: list[list[int]]


def recording_path(model: str) -> Path:
    return DATA / f"{model}-transformers-greedy.json"


def load_recording(model: str) -> RecordedGreedy:
    raw = json.loads(recording_path(model).read_text())
    return RecordedGreedy(raw["model_sha256"], raw["transformers_version"], raw["max_new_tokens"],
                          [p["prompt_token_ids"] for p in raw["prompts"]], [p["token_ids"] for p in raw["prompts"]])


def check_or_record(model: str, live: RecordedGreedy) -> None:
    """Compare a live transformers run with the recording (rewrite it instead with KVSERVE_RECORD_REFERENCE=1)."""
    if os.environ.get(RECORD_ENV) == "1":
        head = json.dumps({"model_sha256": live.model_sha256, "transformers_version": live.transformers_version,
                           "max_new_tokens": live.max_new_tokens})
        prompts = ",\n".join(json.dumps({"prompt_token_ids": p, "token_ids": t})
                             for p, t in zip(live.prompt_token_ids, live.token_ids, strict=True))
        recording_path(model).write_text(f'{head[:-1]}, "prompts": [\n{prompts}\n]}}\n')  # a prompt a line
        return
    recorded = load_recording(model)
    assert (recorded.model_sha256, recorded.max_new_tokens, recorded.prompt_token_ids) == (
        live.model_sha256, live.max_new_tokens, live.prompt_token_ids), \
        f"the recording of {model} is of other inputs: rerun with {RECORD_ENV}=1"
    assert recorded.token_ids == live.token_ids, (
        f"transformers {live.transformers_version} now answers otherwise than the recording (made with "
        f"{recorded.transformers_version}); if the new answers are right, rerun with {RECORD_ENV}=1")
