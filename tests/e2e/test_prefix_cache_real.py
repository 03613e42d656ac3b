"""The prefix cache on the real model: identical greedy outputs on and off, real reuse, real sharing."""

from __future__ import annotations

import pytest

from kvserve import LLM, SamplingParams
from tests.e2e.conftest import LONG_DOCUMENT

pytestmark = pytest.mark.slow
GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)


def make_llm(prefix: bool, **kwargs) -> LLM:
    options = {"dtype": "float32", "num_kv_blocks": 1024, "max_num_batched_tokens": 4096} | kwargs
    return LLM(enable_prefix_caching=prefix, **options)


@pytest.fixture(scope="module")
def system_prompt_ids() -> list[int]:
    llm = make_llm(False, num_kv_blocks=16)
    ids = llm.get_tokenizer().encode(LONG_DOCUMENT, add_special_tokens=False)[:1000]
    assert len(ids) == 1000
    return ids


def shared_prefix_prompts(system_ids: list[int], tok, n: int = 16) -> list[dict]:
    return [{"prompt_token_ids": system_ids + tok.encode(f" Question {i}: what is block {i * 7}?",
                                                        add_special_tokens=False)} for i in range(n)]


def token_ids(outputs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outputs]


@pytest.mark.heavy  # for CI's time: the soak compares batched, cached answers with answers served alone
def test_eight_requests_sharing_a_system_prompt_match_with_cache_off(system_prompt_ids) -> None:
    off, on = make_llm(False), make_llm(True)
    system_ids = system_prompt_ids[:504]  # 31.5 blocks: the last system block is shared only in part
    prompts = shared_prefix_prompts(system_ids, on.get_tokenizer(), n=8)
    expected = token_ids(off.generate(prompts, GREEDY))
    assert token_ids(on.generate(prompts, GREEDY)) == expected
    again = on.generate(prompts, GREEDY)  # now every request finds the system prompt cached
    assert token_ids(again) == expected
    assert all(o.num_cached_tokens >= 496 for o in again)
    on.engine.check_invariants()


@pytest.mark.heavy  # CI: the reference match with the cache on, and the next turn over a partly filled block
def test_multi_turn_conversation_matches_with_cache_off() -> None:
    questions = ["Name a planet.", "Why is it interesting?", "How far away is it?", "Thanks! One more fact?"]
    transcripts = {}
    for prefix in (False, True):
        llm = make_llm(prefix)
        messages: list[dict[str, str]] = []
        replies, cached = [], []
        for question in questions:
            messages.append({"role": "user", "content": question})
            output = llm.chat(messages, SamplingParams(temperature=0.0, max_tokens=12))[0]
            replies.append(output.outputs[0].token_ids)
            cached.append(output.num_cached_tokens)
            messages.append({"role": "assistant", "content": output.outputs[0].text})
        transcripts[prefix] = replies
        if prefix:
            assert cached[0] == 0 and all(c > 0 for c in cached[1:]), cached
        else:
            assert cached == [0] * len(questions)
    assert transcripts[True] == transcripts[False]


def test_second_request_computes_only_its_suffix_and_shares_blocks(system_prompt_ids) -> None:
    llm = make_llm(True)
    engine = llm.engine
    tok = llm.get_tokenizer()
    first, second = shared_prefix_prompts(system_prompt_ids, tok, n=2)
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    a = engine.add_request(first, params)
    engine.step()  # prefills the whole first prompt (budget 4096) and inserts its blocks into the tree
    computed_before = engine.stats().num_prompt_tokens_computed
    b = engine.add_request(second, params)
    engine.step()
    suffix = len(b.prompt_token_ids) - 992  # 62 full blocks of 16 are shared
    assert b.num_cached_tokens == 992
    assert engine.stats().num_prompt_tokens_computed - computed_before == suffix
    shared = a.block_ids[:62]
    assert b.block_ids[:62] == shared  # physically the same blocks
    assert all(engine.kv_manager.pool.ref_counts[block] == 2 for block in shared)
    while engine.has_unfinished_requests():
        engine.step()
        engine.check_invariants()


def test_next_turn_takes_over_the_partly_filled_last_block(system_prompt_ids) -> None:
    """A conversation's next turn resends the reply, whose last block was never full: the request takes
    that block over and computes only what follows the previous turn's KV, with the same output."""
    llm = make_llm(True)
    engine = llm.engine
    tok = llm.get_tokenizer()
    first = system_prompt_ids + tok.encode(" Question: what comes next?", add_special_tokens=False)
    assert len(first) % 16 != 0
    params = SamplingParams(temperature=0.0, max_tokens=9, ignore_eos=True)
    a = engine.add_request({"prompt_token_ids": first}, params)
    while engine.has_unfinished_requests():
        engine.step()
    computed = len(first) + 8  # the last output token is never fed back
    (tail,) = engine.kv_manager.prefix_cache.tree.tail_blocks()
    assert list(tail.token_ids) == a.all_token_ids[computed // 16 * 16 : computed]
    second = first + list(a.output_token_ids) + tok.encode(" And after that?", add_special_tokens=False)
    b = engine.add_request({"prompt_token_ids": second}, params)
    engine.step()
    assert b.num_cached_tokens == computed  # 16-token blocks alone would give computed // 16 * 16
    assert b.block_ids[computed // 16] == tail.block_id
    assert engine.kv_manager.prefix_cache.tree.num_tail_blocks == 0
    engine.check_invariants()
    while engine.has_unfinished_requests():
        engine.step()
        engine.check_invariants()
    expected = make_llm(False).generate([{"prompt_token_ids": second}], params)
    assert list(b.output_token_ids) == expected[0].outputs[0].token_ids


@pytest.mark.heavy  # for CI's time: the soak serves under eviction and compares with answers served alone,
# and tests/cache checks LRU order and locked nodes on the radix tree itself
def test_memory_pressure_evicts_lru_never_locked_and_stays_correct(system_prompt_ids) -> None:
    tok = make_llm(False, num_kv_blocks=16).get_tokenizer()
    prompts = [{"prompt_token_ids": tok.encode(f"Topic {i}: " + LONG_DOCUMENT[i * 97 : i * 97 + 900],
                                              add_special_tokens=False)} for i in range(8)]
    expected = token_ids(make_llm(False).generate(prompts, GREEDY))
    # ~200 tokens per prompt, 8 prompts: ~110 blocks of working set in a 48-block pool.
    llm = make_llm(True, num_kv_blocks=48, max_num_batched_tokens=512, scheduling_policy="fcfs")
    for _ in range(2):
        assert token_ids(llm.generate(prompts, GREEDY)) == expected
        llm.engine.check_invariants()
    assert llm.engine.kv_manager.num_evicted_blocks > 0
    # The most recent prompt is still cached; the first (least recently used) was evicted.
    last, first = (llm.engine.kv_manager.cached_prefix_length(llm.engine.add_request(p, GREEDY))
                   for p in (prompts[-1], prompts[0]))
    assert last > 0 and first == 0
