"""Qwen2.5-Coder-0.5B-Instruct (qwen2: QKV bias, untied output, rope base 1e6, 14/2 heads): greedy output equals
transformers token for token in float32, loaded from the same Q4_K_M GGUF, chat-templated, batched, chunked,
preempted, with the prefix cache on and off. transformers' output is recorded in tests/data (its GGUF load of
this model costs CI half a minute); the heavy test checks the recording against transformers live."""

from __future__ import annotations

import pytest

from kvserve import LLM, SamplingParams
from tests.e2e.conftest import LONG_DOCUMENT, hf_greedy, installed_model
from tests.support.recorded_reference import RecordedGreedy, check_or_record, load_recording
from tests.support.transformers_gguf import hf_from_gguf

MODEL = "qwen2.5-coder-0.5b"
MAX_TOKENS = 12
pytestmark = pytest.mark.slow

PLAIN = [
    "def quicksort(items):\n    ",
    "# Return the n-th Fibonacci number\ndef fib(n):",
    LONG_DOCUMENT[:1400] + "\nIn one sentence, the text says that",
]
CHAT = [
    "Write a Python function that checks whether a string is a palindrome.",
    "What does `git rebase -i HEAD~3` do?",
]


@pytest.fixture(scope="module")
def model_path():
    return installed_model(MODEL)


@pytest.fixture(scope="module")
def prompt_ids(model_path) -> list[list[int]]:
    from kvserve.tokenizer import Tokenizer

    tok = Tokenizer.from_model_path(model_path)
    ids = [tok.encode(p) for p in PLAIN]
    for question in CHAT:
        text = tok.apply_chat_template([{"role": "user", "content": question}])
        assert text.startswith("<|im_start|>system\n") and text.endswith("<|im_start|>assistant\n")
        ids.append(tok.encode(text, add_special_tokens=False))
    assert len({len(p) for p in ids}) == len(ids) and max(len(p) for p in ids) > 250
    return ids


@pytest.fixture(scope="module")
def reference(prompt_ids) -> list[list[int]]:
    recorded = load_recording(MODEL)
    assert recorded.prompt_token_ids == prompt_ids and recorded.max_new_tokens == MAX_TOKENS
    return recorded.token_ids


def _generate(llm: LLM, prompt_ids: list[list[int]]):
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    return llm.generate([{"prompt_token_ids": ids} for ids in prompt_ids], params)


def test_chunked_preempted_prefix_cached_greedy_matches_transformers(model_path, prompt_ids, reference) -> None:
    # 64-token chunks split the long prompt; a pool of 26 blocks cannot hold all five requests as they grow.
    llm = LLM(model=MODEL, dtype="float32", num_kv_blocks=26, max_num_batched_tokens=64, enable_prefix_caching=True)
    first = _generate(llm, prompt_ids)
    assert [o.outputs[0].token_ids for o in first] == reference
    assert max(o.metrics.num_prefill_chunks for o in first) >= 4
    assert llm.engine.scheduler.num_preemptions > 0
    again = _generate(llm, prompt_ids)  # the prompts' blocks now come from the prefix cache
    assert [o.outputs[0].token_ids for o in again] == reference
    assert sum(o.num_cached_tokens for o in again) > 0


@pytest.mark.heavy  # the chunked, preempted, prefix-cached run above covers the model in CI
def test_batched_greedy_without_prefix_cache_matches_transformers(model_path, prompt_ids, reference) -> None:
    llm = LLM(model=str(model_path), dtype="float32", num_kv_blocks=256, max_num_batched_tokens=2048,
              enable_prefix_caching=False)
    outputs = _generate(llm, prompt_ids)
    assert [o.outputs[0].token_ids for o in outputs] == reference
    assert all(o.metrics.num_prefill_chunks == 1 for o in outputs)


@pytest.mark.heavy  # transformers' GGUF load of this model takes half a minute
def test_the_recorded_reference_is_transformers_own_greedy_output(model_path, prompt_ids) -> None:
    import transformers

    from kvserve.model_store.catalog import known_model

    hf = hf_from_gguf(model_path)
    entry = known_model(MODEL)
    assert entry is not None
    check_or_record(MODEL, RecordedGreedy(entry.sha256, transformers.__version__, MAX_TOKENS, prompt_ids,
                                          [hf_greedy(hf, ids, MAX_TOKENS) for ids in prompt_ids]))
