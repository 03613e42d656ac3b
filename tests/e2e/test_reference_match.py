"""Greedy output equals the transformers reference token for token on the real SmolLM2-135M-Instruct.

transformers' greedy output is recorded in tests/data (generating it live took a tenth of this file's time in
CI); the heavy test checks the recording against transformers live. The hidden-state and prompt-logprob
checks run transformers live."""

from __future__ import annotations

import pytest

from kvserve import LLM, SamplingParams
from tests.e2e.conftest import CHAT_QUESTIONS, PLAIN_PROMPTS, hf_greedy
from tests.support.recorded_reference import RecordedGreedy, check_or_record, load_recording

MAX_TOKENS = 20
MODEL = "smollm2-135m"
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def llm():
    return LLM(dtype="float32", num_kv_blocks=512, max_num_batched_tokens=2048, enable_prefix_caching=False)


@pytest.fixture(scope="module")
def prompt_ids(llm) -> list[list[int]]:
    tok = llm.get_tokenizer()
    ids = [tok.encode(p) for p in PLAIN_PROMPTS]
    for question in CHAT_QUESTIONS:
        text = tok.apply_chat_template([{"role": "user", "content": question}])
        ids.append(tok.encode(text, add_special_tokens=False))
    assert max(len(p) for p in ids) > 600, "one prompt must be over 600 tokens"
    assert len({len(p) for p in ids}) == len(ids), "prompts of different lengths"
    return ids


@pytest.fixture(scope="module")
def reference(prompt_ids) -> list[list[int]]:
    recorded = load_recording(MODEL)
    assert recorded.prompt_token_ids == prompt_ids and recorded.max_new_tokens == MAX_TOKENS
    return recorded.token_ids


@pytest.mark.heavy  # CI compares with the recording
def test_the_recorded_reference_is_transformers_own_greedy_output(hf_reference, prompt_ids) -> None:
    import transformers

    from kvserve.model_store.catalog import known_model

    entry = known_model(MODEL)
    assert entry is not None
    check_or_record(MODEL, RecordedGreedy(entry.sha256, transformers.__version__, MAX_TOKENS, prompt_ids,
                                          [hf_greedy(hf_reference, ids, MAX_TOKENS) for ids in prompt_ids]))


def greedy(max_tokens: int = MAX_TOKENS) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


def generate_ids(llm: LLM, prompt_ids: list[list[int]]) -> list[list[int]]:
    outputs = llm.generate([{"prompt_token_ids": ids} for ids in prompt_ids], greedy())
    return [o.outputs[0].token_ids for o in outputs]


def test_batched_greedy_matches_transformers(llm, prompt_ids, reference) -> None:
    assert generate_ids(llm, prompt_ids) == reference


def test_chunked_prefill_under_preemption_matches_transformers(prompt_ids, reference) -> None:
    # 64-token chunks split the long prompt; it alone needs ~67 blocks of 16, and a pool of 80 cannot hold
    # all eight requests at once.
    llm = LLM(dtype="float32", num_kv_blocks=80, max_num_batched_tokens=64, enable_prefix_caching=False)
    outputs = llm.generate([{"prompt_token_ids": ids} for ids in prompt_ids], greedy())
    assert [o.outputs[0].token_ids for o in outputs] == reference
    long_output = max(outputs, key=lambda o: len(o.prompt_token_ids))
    assert long_output.metrics.num_prefill_chunks >= 10
    assert llm.engine.scheduler.num_preemptions > 0


def test_prefix_cache_on_matches_transformers(prompt_ids, reference) -> None:
    llm = LLM(dtype="float32", num_kv_blocks=512, max_num_batched_tokens=128, enable_prefix_caching=True)
    first = generate_ids(llm, prompt_ids)
    again = generate_ids(llm, prompt_ids)  # second pass: prompts come from the cache
    assert first == reference and again == reference
    assert llm.engine.kv_manager.stats.hits > 0


NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 3,
         "adaptive": False}  # drafts every step: the timings-driven lengths could choose none


def test_torch_reference_paths_match_transformers(prompt_ids, reference) -> None:
    """The oracle itself: the same run with the C++ kernels off (torch attention and matmuls only), its
    decode steps verifying n-gram drafts where a prompt offers them and plain rows where it does not."""
    llm = LLM(dtype="float32", num_kv_blocks=512, max_num_batched_tokens=2048, enable_prefix_caching=False,
              cpu_kernels=False, speculative_config=NGRAM)
    assert generate_ids(llm, prompt_ids) == reference
    stats = llm.engine.stats()
    # Each decode row gives one token beyond its accepted drafts; a request's first token is its prefill's.
    decode_rows = stats.num_generated_tokens - stats.num_accepted_draft_tokens - len(prompt_ids)
    assert stats.num_accepted_draft_tokens > 0 and 0 < stats.num_draft_steps < decode_rows


# CI's time: the shared server speculates with the prefix cache on, and its tests reuse speculated requests' blocks
# against the offline engine's output; the check under preemption below stays in CI too.
@pytest.mark.heavy
def test_speculative_decoding_matches_transformers(prompt_ids, reference) -> None:
    """n-gram drafts verified in the batch, with the prefix cache on and a budget that cuts drafts short."""
    llm = LLM(dtype="float32", num_kv_blocks=512, max_num_batched_tokens=24, enable_prefix_caching=True,
              speculative_config=NGRAM)
    assert generate_ids(llm, prompt_ids) == reference
    again = generate_ids(llm, prompt_ids)  # from the cache: blocks written next to rejected drafts
    assert again == reference
    stats = llm.engine.stats()
    assert 0 < stats.num_accepted_draft_tokens < stats.num_draft_tokens
    assert stats.num_generated_tokens == 2 * len(prompt_ids) * MAX_TOKENS  # each token counted once


def test_speculative_decoding_under_preemption_matches_transformers(prompt_ids, reference) -> None:
    llm = LLM(dtype="float32", num_kv_blocks=80, max_num_batched_tokens=2048, enable_prefix_caching=False,
              speculative_config=NGRAM)
    assert generate_ids(llm, prompt_ids) == reference
    assert llm.engine.scheduler.num_preemptions > 0
    assert llm.engine.stats().num_accepted_draft_tokens > 0


def test_returned_hidden_state_is_transformers_last_hidden_state(llm, prompt_ids, hf_reference) -> None:
    """What /v1/embeddings serves: the final-norm hidden state at each prompt's last token, prompts batched,
    equals transformers' last_hidden_state there."""
    import torch

    params = SamplingParams(temperature=0.0, max_tokens=1, return_hidden_state=True)
    outputs = llm.generate([{"prompt_token_ids": ids} for ids in prompt_ids], params)
    for ids, output in zip(prompt_ids, outputs, strict=True):
        with torch.no_grad():
            expected = hf_reference(torch.tensor([ids]), output_hidden_states=True).hidden_states[-1][0, -1]
        got = torch.tensor(output.outputs[0].hidden_state)
        assert got.shape == expected.shape
        torch.testing.assert_close(got, expected.float(), rtol=1e-3, atol=1e-3)


def test_prompt_logprobs_are_transformers_log_softmax_chunked_preempted_and_never_cached(
        prompt_ids, reference, hf_reference) -> None:
    """Each prompt token's logprob given the ones before it (and the top 3), as transformers' float32
    log-softmax gives them: the long prompt in 64-token chunks, in a pool too small for every request (so some
    are preempted and computed again), after the same prompts ran without them and left their blocks in the
    prefix cache, which these requests must not use (every prompt row has to run) nor lock beside their own.
    Greedy output stays the reference's."""
    import torch

    prompts, expected_tokens = prompt_ids[:5], [tokens[:4] for tokens in reference[:5]]  # the long one is 4th
    llm = LLM(dtype="float32", num_kv_blocks=68, max_num_batched_tokens=64, enable_prefix_caching=True)
    plain = llm.generate([{"prompt_token_ids": ids} for ids in prompts], greedy(4))
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True, prompt_logprobs=3)
    engine = llm.engine
    request_ids = [engine.add_request({"prompt_token_ids": ids}, params).request_id for ids in prompts]
    finished = {}
    for _ in range(1000):  # about 40 steps are needed: a scheduler that makes no progress fails, not hangs
        finished.update({o.request_id: o for o in engine.step() if o.finished})
        if len(finished) == len(prompts):
            break
    assert len(finished) == len(prompts), "the requests asking for prompt logprobs made no progress"
    outputs = [finished[request_id] for request_id in request_ids]
    assert [o.outputs[0].token_ids for o in plain] == [o.outputs[0].token_ids for o in outputs] == expected_tokens
    assert all(o.num_cached_tokens == 0 for o in outputs) and llm.engine.kv_manager.num_cached_blocks > 0
    assert llm.engine.scheduler.num_preemptions > 0
    for ids, output in zip(prompts, outputs, strict=True):
        with torch.no_grad():
            expected = torch.log_softmax(hf_reference(torch.tensor([ids])).logits[0].float(), dim=-1)
        entries, ranks = output.prompt_logprobs, output.prompt_token_ranks
        assert entries is not None and len(entries) == len(ids) and entries[0] is None
        assert ranks is not None and ranks[0] is None
        for position in range(1, len(ids)):
            entry, row = entries[position], expected[position - 1]
            assert entry is not None and abs(entry[ids[position]] - row[ids[position]].item()) < 1e-4
            assert set(row.topk(3).indices.tolist()) <= set(entry) and len(entry) <= 4
            # The token's rank in transformers' distribution, within the tokens whose logprobs are a near-tie.
            above = (row > row[ids[position]] + 1e-4).sum().item() + 1
            level = (row >= row[ids[position]] - 1e-4).sum().item()
            assert above <= ranks[position] <= level, (position, ranks[position], above, level)
