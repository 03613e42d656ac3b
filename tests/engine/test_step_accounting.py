"""Engine-wide counters add up, whichever step a request ends in."""

from __future__ import annotations

import pytest

from kvserve import LLM, SamplingParams
from tests.support.tiny_models import make_tiny_model


@pytest.fixture(scope="module")
def llm(tmp_path_factory) -> LLM:
    model_dir = make_tiny_model(tmp_path_factory.mktemp("tiny"), "llama")
    return LLM(str(model_dir), dtype="float32", num_kv_blocks=64, max_model_len=256, enable_prefix_caching=False)


def test_prompt_tokens_of_a_request_that_ends_on_its_first_token_are_counted(llm: LLM) -> None:
    """A request whose last prefill chunk also samples its only token finishes in that step: its prompt
    tokens were computed all the same."""
    before = llm.engine.stats().num_prompt_tokens_computed
    prompts = [{"prompt_token_ids": list(range(1, 1 + n))} for n in (5, 40, 17)]
    llm.generate(prompts, SamplingParams(max_tokens=1, temperature=0.0))
    assert llm.engine.stats().num_prompt_tokens_computed - before == 5 + 40 + 17


def test_prompt_and_generated_tokens_add_up_for_longer_requests(llm: LLM) -> None:
    stats = llm.engine.stats()
    prompts = [{"prompt_token_ids": list(range(3, 3 + n))} for n in (9, 33)]
    outputs = llm.generate(prompts, SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
    after = llm.engine.stats()
    assert after.num_prompt_tokens_computed - stats.num_prompt_tokens_computed == 9 + 33
    generated = sum(len(o.outputs[0].token_ids) for o in outputs)
    assert generated == 8
    assert after.num_generated_tokens - stats.num_generated_tokens == generated
