"""Speculative decoding in the scheduler, against the model-free runner: drafts ride on decodes, only the
accepted ones count as computed, and outputs, blocks and budgets stay exactly as without drafts."""

from __future__ import annotations

import pytest

from kvserve.cache.kv_manager import KVCacheManager
from kvserve.config import SchedulerConfig
from kvserve.request import FinishReason, Request
from kvserve.sampling_params import SamplingParams
from kvserve.scheduler import Scheduler
from tests.support.fake_runner import FakeRunner, noisy_drafts, reference_continuation


def make(num_blocks: int = 64, block_size: int = 4, budget: int = 32, prefix: bool = True, drafts: bool = True):
    kv = KVCacheManager(num_blocks, block_size, enable_prefix_caching=prefix)
    scheduler = Scheduler(SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=budget, policy="fcfs"), kv)
    return scheduler, FakeRunner(num_blocks, block_size, propose=noisy_drafts if drafts else None)


def request(rid: str, prompt: list[int], max_tokens: int, order: int = 0, **params) -> Request:
    params.setdefault("ignore_eos", True)
    return Request(rid, prompt, SamplingParams(max_tokens=max_tokens, **params),
                   max_total_tokens=len(prompt) + max_tokens, arrival_order=order)


def run(scheduler: Scheduler, runner: FakeRunner) -> int:
    steps = 0
    while scheduler.has_unfinished():
        out = scheduler.schedule()
        assert out.num_batched_tokens + sum(len(s.draft_token_ids) for s in out.scheduled) <= (
            scheduler.config.max_num_batched_tokens)
        for s in out.scheduled:
            assert not s.draft_token_ids or len(s.token_ids) == 1, "drafts only ride on a decode"
        scheduler.finish_requests(scheduler.update(out, runner.execute(out)))
        scheduler.check_invariants()
        steps += 1
        assert steps < 10_000
    return steps


def test_outputs_equal_plain_decoding_in_fewer_steps_and_no_block_leaks() -> None:
    prompts = [[i, i + 1, i + 2] * (i + 1) for i in range(5)]
    results = {}
    for drafts in (False, True):
        scheduler, runner = make(drafts=drafts)
        requests = [request(f"r{i}", p, 23, order=i) for i, p in enumerate(prompts)]
        for r in requests:
            scheduler.add_request(r)
        steps = run(scheduler, runner)
        results[drafts] = steps, [r.output_token_ids for r in requests], runner
        assert scheduler.kv.pool.num_used == 0
    assert results[True][1] == results[False][1] == [reference_continuation(p, 23) for p in prompts]
    runner = results[True][2]
    assert 0 < runner.num_drafts_accepted < runner.num_drafts_verified, "some drafts must win and some lose"
    assert results[True][0] < results[False][0]


def test_metrics_count_drafts_and_tokens_per_step() -> None:
    scheduler, runner = make()
    r = request("r", [5, 6, 7, 8], 30)
    scheduler.add_request(r)
    run(scheduler, runner)
    assert r.metrics.num_draft_tokens == runner.num_drafts_verified
    assert r.metrics.num_accepted_draft_tokens == runner.num_drafts_accepted > 0
    assert scheduler.num_accepted_draft_tokens == runner.num_drafts_accepted
    assert r.num_output_tokens == 30 and r.metrics.num_decode_steps < 29
    # One time per step that produced tokens (ITL is between streamed chunks, not zero inside one).
    assert len(r.metrics.token_times) == r.metrics.num_decode_steps + 1


def test_max_tokens_caps_the_drafts() -> None:
    for max_tokens in (1, 2, 3, 7):
        scheduler, runner = make()
        r = request("r", [1, 2, 3, 4, 5], max_tokens)
        scheduler.add_request(r)
        while scheduler.has_unfinished():
            out = scheduler.schedule()
            for s in out.scheduled:
                assert r.num_tokens + len(s.draft_token_ids) < r.max_total_tokens or not s.draft_token_ids
            scheduler.finish_requests(scheduler.update(out, runner.execute(out)))
            scheduler.check_invariants()
        assert r.output_token_ids == reference_continuation([1, 2, 3, 4, 5], max_tokens)
        assert r.finish_reason is FinishReason.LENGTH


def test_a_stop_token_inside_accepted_drafts_ends_the_output_there() -> None:
    prompt = [9, 8, 7]
    plain = reference_continuation(prompt, 40)
    stop = next(t for i, t in enumerate(plain) if i >= 6 and t not in plain[:i])
    cut = plain.index(stop)
    scheduler, runner = make()
    r = request("r", prompt, 40, ignore_eos=False, stop_token_ids=(stop,))
    scheduler.add_request(r)
    run(scheduler, runner)
    assert r.output_token_ids == plain[: cut + 1]
    assert r.finish_reason is FinishReason.STOP and r.stop_reason == stop
    assert scheduler.kv.pool.num_used == 0


@pytest.mark.parametrize("budget", [3, 4, 6])
def test_a_small_budget_cuts_drafts_not_decodes(budget: int) -> None:
    scheduler, runner = make(budget=budget)
    requests = [request(f"r{i}", [i + 1], 12, order=i) for i in range(3)]  # one-token prompts: all admitted
    for r in requests:
        scheduler.add_request(r)
    num_drafts = 0
    while scheduler.has_unfinished():
        out = scheduler.schedule()
        # Every running request computes its token before any draft gets a slot of the budget.
        assert {s.request_id for s in out.scheduled} == {r.request_id for r in scheduler.running}
        assert out.num_batched_tokens + sum(len(s.draft_token_ids) for s in out.scheduled) <= budget
        num_drafts += sum(len(s.draft_token_ids) for s in out.scheduled)
        scheduler.finish_requests(scheduler.update(out, runner.execute(out)))
        scheduler.check_invariants()
    assert (num_drafts > 0) == (budget > 3)
    assert [r.output_token_ids for r in requests] == [reference_continuation([i + 1], 12) for i in range(3)]


def test_preemption_drops_drafts_and_replays_exactly() -> None:
    scheduler, runner = make(num_blocks=12, budget=64, prefix=False)
    prompts = [[i] * 6 for i in range(4)]
    requests = [request(f"r{i}", p, 14, order=i) for i, p in enumerate(prompts)]
    for r in requests:
        scheduler.add_request(r)
    run(scheduler, runner)
    assert scheduler.num_preemptions > 0
    assert [r.output_token_ids for r in requests] == [reference_continuation(p, 14) for p in prompts]
    assert scheduler.kv.pool.num_free == 12


def test_drafts_never_preempt_another_request() -> None:
    # Two 7-token prompts fill the 4-block pool; the first decode (position 7) still fits in each request's
    # second block, but drafts would need a fifth block: they are dropped, nobody is preempted for them.
    scheduler, runner = make(num_blocks=4, block_size=4, budget=64, prefix=False)
    requests = [request(f"r{i}", [i + 1] * 7, 9, order=i) for i in range(2)]  # alone, one fits the pool
    for r in requests:
        scheduler.add_request(r)
    for _ in range(2):
        out = scheduler.schedule()
        scheduler.finish_requests(scheduler.update(out, runner.execute(out)))
        scheduler.check_invariants()
    assert all(r.draft_token_ids for r in requests), "the runner proposed drafts"
    assert not any(s.draft_token_ids for s in out.scheduled) and len(out.scheduled) == 2
    assert scheduler.num_preemptions == 0
    run(scheduler, runner)
    assert [r.output_token_ids for r in requests] == [reference_continuation([i + 1] * 7, 9) for i in range(2)]


def test_drafts_never_take_the_block_another_decode_needs() -> None:
    # 5 blocks of 4: a (7 tokens) and b (8 tokens) hold 2 each, 1 is free. Next step a decodes position 7
    # (its own block), b position 8, which needs the free block; a's drafts would need it too.
    scheduler, runner = make(num_blocks=5, block_size=4, budget=64, prefix=False)
    a, b = request("a", [1] * 7, 9), request("b", [2] * 8, 8, order=1)
    for r in (a, b):
        scheduler.add_request(r)
    for _ in range(2):
        out = scheduler.schedule()
        scheduler.finish_requests(scheduler.update(out, runner.execute(out)))
        scheduler.check_invariants()
    assert a.metrics.num_draft_tokens == 0 and b.num_output_tokens >= 2, "b decoded; a's drafts got no block"
    assert scheduler.num_preemptions == 0


def test_drafts_never_evict_cached_blocks_and_shrink_to_the_free_room() -> None:
    # 6 blocks of 4; a finished request leaves 2 cached, 4 are free. r's 12-token prompt takes 3, its
    # outputs up to position 15 the 4th; it stops on a token before it needs a 5th. Drafts past position
    # 15 would need that 5th block: they must be cut to the free room, not evict a cached block for it.
    prompt = next(p for p in ([k, 2, 3] * 4 for k in range(1, 50))
                  if reference_continuation(p, 4)[3] not in reference_continuation(p, 4)[:3])
    stop = reference_continuation(prompt, 4)[3]
    scheduler, runner = make(num_blocks=6, block_size=4, budget=64)
    scheduler.add_request(request("cached", [99 % 50] * 8, 1))
    run(scheduler, runner)
    assert scheduler.kv.num_cached_blocks == 2
    r = request("r", prompt, 30, ignore_eos=False, stop_token_ids=(stop,), order=1)
    scheduler.add_request(r)
    run(scheduler, runner)
    assert r.output_token_ids == reference_continuation(prompt, 4) and r.finish_reason is FinishReason.STOP
    assert r.metrics.num_draft_tokens > 0
    assert scheduler.kv.num_evicted_blocks == 0, "drafts evicted a cached block"


def test_cached_blocks_never_hold_rejected_drafts() -> None:
    # The fake runner reads every position back through the block table: a cached block holding a
    # rejected draft's KV would change the second request's output.
    scheduler, runner = make(block_size=2)
    first = request("a", [3, 1, 4], 20)
    scheduler.add_request(first)
    run(scheduler, runner)
    assert runner.num_drafts_verified > runner.num_drafts_accepted
    second = request("b", first.all_token_ids[:-1], 1, order=1)
    scheduler.add_request(second)
    run(scheduler, runner)
    assert second.num_cached_tokens >= len(first.all_token_ids) - 3
    assert second.output_token_ids == first.all_token_ids[-1:]
