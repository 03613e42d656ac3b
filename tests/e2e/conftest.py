"""Real-model fixtures: the default SmolLM2-135M-Instruct GGUF and a transformers reference on the same weights."""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import torch

from kvserve.model.loader import resolve_model_path

LONG_DOCUMENT = " ".join(
    f"Section {i}: the paged KV cache stores keys and values in fixed-size blocks, so memory is allocated on "
    f"demand and shared between requests with a common prefix; block {i} holds sixteen tokens."
    for i in range(24)
)

PLAIN_PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n    ",
    "Once upon a time, in a land far away, there lived a",
    LONG_DOCUMENT + "\nSummary of the text above:",
]
CHAT_QUESTIONS = [
    "What is 17 times 23?",
    "Write a haiku about autumn leaves.",
    "Explain in one paragraph why the sky is blue, for a ten-year-old who loves dinosaurs and trains.",
    "List three prime numbers.",
]


def hf_greedy(model, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
    """Plain greedy decoding with the reference model's own KV cache; never stops early."""
    ids = torch.tensor([prompt_ids])
    out: list[int] = []
    past = None
    with torch.no_grad():
        for _ in range(max_new_tokens):
            result = model(input_ids=ids, past_key_values=past, use_cache=True)
            past = result.past_key_values
            token = int(result.logits[0, -1].argmax())
            out.append(token)
            ids = torch.tensor([[token]])
    return out


# Set in CI (.ci/run pulls the models first): a known model that is not installed fails its tests instead of
# skipping them.
REQUIRE_MODELS_ENV = "KVSERVE_REQUIRE_MODELS"


def installed_model(name: str) -> Path:
    """The file of a known model from the store; skips the test when it is not pulled (fails in CI)."""
    from kvserve.errors import ModelNotFound

    try:
        return resolve_model_path(name)
    except ModelNotFound as e:
        if os.environ.get(REQUIRE_MODELS_ENV):
            pytest.fail(f"{REQUIRE_MODELS_ENV} is set and {name} is missing: {e}")
        pytest.skip(f"{name} is not pulled: {e}")


REQUIRE_BROWSER_ENV = "KVSERVE_REQUIRE_BROWSER"  # set by CI: a missing browser fails instead of skipping
BROWSER_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run", "--disable-sync",
                "--disable-background-networking", "--disable-component-update"]


@contextmanager
def headless_chromium() -> Iterator[Any | None]:
    """Debian's Chromium, headless, through Playwright; None where either is missing (a failure instead
    when KVSERVE_REQUIRE_BROWSER is set)."""
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        missing = "playwright is not installed (pip install playwright)"
    else:
        missing = None if chromium else "chromium is not installed (apt-get install chromium)"
    if missing:
        if os.environ.get(REQUIRE_BROWSER_ENV):
            pytest.fail(f"{REQUIRE_BROWSER_ENV} is set and {missing}")
        yield None
        return
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=chromium, args=BROWSER_ARGS)
        try:
            yield browser
        finally:
            browser.close()
