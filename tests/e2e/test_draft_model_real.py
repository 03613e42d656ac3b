"""Qwen2.5-Coder-0.5B drafting for Qwen2.5-Coder-1.5B (real weights, bf16): greedy output equals the 1.5B's
plain greedy decoding token for token, batched, chunked and on prefix-cache hits, with most drafts accepted.
Heavy: the 1.5B model is not in CI's model store."""

from __future__ import annotations

import pytest

from kvserve import LLM, SamplingParams
from tests.e2e.conftest import installed_model

TARGET, DRAFT = "qwen2.5-coder-1.5b", "qwen2.5-coder-0.5b"
MAX_TOKENS = 48
pytestmark = pytest.mark.heavy

QUESTIONS = [
    "Write a Python function that checks whether a string is a palindrome.",
    "Complete this Python function.\n\n```python\ndef fib(n: int) -> int:\n    \"\"\"Return the n-th Fibonacci "
    "number.\"\"\"\n```",
    "Write a function that merges two sorted lists into one sorted list.",
]


@pytest.fixture(scope="module")
def prompts() -> list[dict[str, list[int]]]:
    from kvserve.tokenizer import Tokenizer

    tok = Tokenizer.from_model_path(installed_model(TARGET))
    installed_model(DRAFT)
    texts = [tok.apply_chat_template([{"role": "user", "content": q}]) for q in QUESTIONS]
    return [{"prompt_token_ids": tok.encode(t, add_special_tokens=False)} for t in texts]


def test_greedy_with_the_draft_equals_plain_greedy(prompts) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)
    plain = LLM(TARGET, kv_cache_gb=0.5)
    expected = [o.outputs[0].token_ids for o in plain.generate(prompts, params)]
    del plain
    llm = LLM(TARGET, kv_cache_gb=0.5, max_num_batched_tokens=64,
              speculative_config={"method": "draft_model", "model": DRAFT, "num_speculative_tokens": 4,
                                  "adaptive": False})
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, params)] == expected
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, params)] == expected  # prefix-cache hits
    stats = llm.engine.stats()
    assert stats.prefix_cache_hits > 0
    assert stats.num_accepted_draft_tokens > 0.5 * stats.num_draft_tokens
