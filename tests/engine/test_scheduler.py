from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from kvserve.cache.kv_manager import KVCacheManager
from kvserve.config import SchedulerConfig
from kvserve.request import FinishReason, Request
from kvserve.sampling_params import SamplingParams
from kvserve.scheduler import Scheduler
from tests.support.fake_runner import FakeRunner, reference_continuation


def make_engine(num_blocks: int, block_size: int = 4, budget: int = 16, max_seqs: int = 8, prefix: bool = True,
                policy: str = "fcfs", lpm_window: int = 64):
    kv = KVCacheManager(num_blocks, block_size, enable_prefix_caching=prefix)
    scheduler = Scheduler(SchedulerConfig(max_num_seqs=max_seqs, max_num_batched_tokens=budget, policy=policy,
                                          lpm_window=lpm_window), kv)
    return scheduler, FakeRunner(num_blocks, block_size)


def make_request(rid: str, prompt: list[int], max_tokens: int, order: int = 0, priority: int = 0) -> Request:
    return Request(rid, prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True, priority=priority),
                   max_total_tokens=len(prompt) + max_tokens, arrival_order=order)


def run_to_completion(scheduler: Scheduler, runner: FakeRunner, max_steps: int = 10_000) -> int:
    steps = 0
    while scheduler.has_unfinished():
        out = scheduler.schedule()
        scheduler.finish_requests(scheduler.update(out, runner.execute(out)))
        scheduler.check_invariants()
        steps += 1
        assert steps < max_steps, "no progress"
    return steps


def test_chunked_prefill_respects_budget_and_mixes_decodes() -> None:
    scheduler, runner = make_engine(num_blocks=64, budget=8)
    short = make_request("short", [1, 2, 3], 10)
    long = make_request("long", list(range(30)), 2, order=1)
    scheduler.add_request(short)
    scheduler.add_request(long)
    mixed = False
    while scheduler.has_unfinished():
        out = scheduler.schedule()
        assert out.num_batched_tokens <= 8
        lens = {s.request_id: len(s.token_ids) for s in out.scheduled}
        if lens.get("short") == 1 and lens.get("long", 0) > 1:
            mixed = True
        scheduler.finish_requests(scheduler.update(out, runner.execute(out)))
        scheduler.check_invariants()
    assert mixed, "a decode never shared a step with a prefill chunk"
    assert short.output_token_ids == reference_continuation([1, 2, 3], 10)
    assert long.output_token_ids == reference_continuation(list(range(30)), 2)
    assert long.metrics.num_prefill_chunks >= 4


def test_preemption_recomputes_and_oldest_finishes_first() -> None:
    scheduler, runner = make_engine(num_blocks=10, budget=64, prefix=False)
    requests = [make_request(f"r{i}", [i] * 5, 12, order=i) for i in range(4)]
    for request in requests:
        scheduler.add_request(request)
    finished_order = []
    while scheduler.has_unfinished():
        out = scheduler.schedule()
        scheduler.finish_requests(scheduler.update(out, runner.execute(out)))
        scheduler.check_invariants()
        finished_order += [r.request_id for r in requests if r.is_finished and r.request_id not in finished_order]
    assert scheduler.num_preemptions > 0
    assert finished_order[0] == "r0"
    for i, request in enumerate(requests):
        assert request.output_token_ids == reference_continuation([i] * 5, 12)
        assert request.finish_reason is FinishReason.LENGTH


def test_second_request_computes_only_its_suffix() -> None:
    scheduler, runner = make_engine(num_blocks=64, budget=256)
    shared = list(range(40))
    first = make_request("a", shared + [41], 3)
    scheduler.add_request(first)
    run_to_completion(scheduler, runner)
    before = runner.num_computed_tokens
    second = make_request("b", shared + [42, 43], 3)
    scheduler.add_request(second)
    run_to_completion(scheduler, runner)
    assert second.num_cached_tokens == 40
    assert runner.num_computed_tokens - before == 2 + 2  # the 2-token suffix, then 2 decode steps
    assert second.output_token_ids == reference_continuation(shared + [42, 43], 3)


def test_running_requests_share_blocks_physically() -> None:
    scheduler, runner = make_engine(num_blocks=64, budget=256)
    shared = list(range(32))
    first = make_request("a", shared + [1], 20)
    scheduler.add_request(first)
    for _ in range(2):  # prefill + one decode: first's prompt blocks are now in the tree
        out = scheduler.schedule()
        scheduler.finish_requests(scheduler.update(out, runner.execute(out)))
    second = make_request("b", shared + [2], 20, order=1)
    scheduler.add_request(second)
    out = scheduler.schedule()
    scheduler.finish_requests(scheduler.update(out, runner.execute(out)))
    assert second.num_cached_tokens == 32
    assert first.block_ids[:8] == second.block_ids[:8]
    assert all(scheduler.kv.pool.ref_counts[b] == 2 for b in first.block_ids[:8])
    run_to_completion(scheduler, runner)


def test_requests_arriving_together_compute_a_shared_prefix_once() -> None:
    """A prefix is cached as soon as its chunk is scheduled: requests admitted later (the same step or the
    next, while the first is still prefilling) share those blocks instead of computing them again."""
    scheduler, runner = make_engine(num_blocks=128, budget=48)
    shared = list(range(60))
    requests = [make_request(f"r{i}", shared + [100 + i, 200 + i], 2, order=i) for i in range(4)]
    for request in requests:
        scheduler.add_request(request)
    out = scheduler.schedule()
    assert [(s.request_id, s.start_position, len(s.token_ids)) for s in out.scheduled] == [("r0", 0, 48)]
    scheduler.finish_requests(scheduler.update(out, runner.execute(out)))
    out = scheduler.schedule()  # r0's last 14 tokens, then the others on the blocks r0 fills in this step
    assert [(s.request_id, s.start_position) for s in out.scheduled] == [("r0", 48), ("r1", 60), ("r2", 60),
                                                                        ("r3", 60)]
    scheduler.finish_requests(scheduler.update(out, runner.execute(out)))
    run_to_completion(scheduler, runner)
    assert [r.num_cached_tokens for r in requests] == [0, 60, 60, 60]
    assert runner.num_computed_tokens == 62 + 3 * 2 + 4 * 1  # the prefix once, the suffixes, one decode each
    for i, request in enumerate(requests):
        assert request.output_token_ids == reference_continuation(shared + [100 + i, 200 + i], 2)


def test_abort_frees_blocks_immediately() -> None:
    scheduler, runner = make_engine(num_blocks=16, prefix=False)
    request = make_request("a", list(range(10)), 50)
    scheduler.add_request(request)
    out = scheduler.schedule()
    scheduler.finish_requests(scheduler.update(out, runner.execute(out)))
    assert scheduler.kv.pool.num_used > 0
    scheduler.abort_request("a")
    assert scheduler.kv.pool.num_used == 0
    assert request.finish_reason is FinishReason.ABORT
    assert "a" in scheduler.schedule().finished_request_ids


def test_lpm_prefers_cached_prefix_but_ages() -> None:
    scheduler, runner = make_engine(num_blocks=64, budget=32, max_seqs=1, policy="lpm")
    shared = list(range(16))
    scheduler.add_request(make_request("warm", shared + [0], 1))
    run_to_completion(scheduler, runner)
    cold = [make_request(f"cold{i}", [50 + i] * 8, 1, order=i + 1) for i in range(3)]
    hot = make_request("hot", shared + [7], 1, order=10)
    for request in cold + [hot]:
        scheduler.add_request(request)
    out = scheduler.schedule()
    assert [s.request_id for s in out.scheduled] == ["hot"]
    scheduler.finish_requests(scheduler.update(out, runner.execute(out)))
    run_to_completion(scheduler, runner)
    assert all(r.is_finished for r in cold)


def test_lpm_compares_only_its_window_of_waiting_requests() -> None:
    scheduler, runner = make_engine(num_blocks=64, budget=32, max_seqs=1, policy="lpm", lpm_window=3)
    shared = list(range(16))
    scheduler.add_request(make_request("warm", shared + [0], 1))
    run_to_completion(scheduler, runner)
    cold = [make_request(f"cold{i}", [50 + i] * 8, 1, order=i + 1) for i in range(3)]
    hot = make_request("hot", shared + [7], 1, order=10)  # fourth in the queue: outside the window of 3
    for request in cold + [hot]:
        scheduler.add_request(request)
    out = scheduler.schedule()
    assert [s.request_id for s in out.scheduled] == ["cold0"]
    scheduler.finish_requests(scheduler.update(out, runner.execute(out)))
    out = scheduler.schedule()  # now in the window: its cached prefix wins
    assert [s.request_id for s in out.scheduled] == ["hot"]
    scheduler.finish_requests(scheduler.update(out, runner.execute(out)))
    run_to_completion(scheduler, runner)


def test_priority_admits_the_most_urgent_first() -> None:
    scheduler, runner = make_engine(num_blocks=64, budget=32, max_seqs=1, policy="priority")
    requests = [make_request(f"r{i}", [i] * 6, 2, order=i, priority=p) for i, p in enumerate([5, 0, 5, -1])]
    for request in requests:
        scheduler.add_request(request)
    admitted: list[str] = []
    while scheduler.has_unfinished():
        out = scheduler.schedule()
        admitted += [s.request_id for s in out.scheduled if s.request_id not in admitted]
        scheduler.finish_requests(scheduler.update(out, runner.execute(out)))
        scheduler.check_invariants()
    assert admitted == ["r3", "r1", "r0", "r2"]


def test_priority_preempts_the_least_urgent_running_request_first() -> None:
    """Short of blocks, fcfs preempts the newest request; priority the least urgent, here the oldest (running
    before the others came)."""
    for policy, victim in (("fcfs", "r3"), ("priority", "r0")):
        scheduler, runner = make_engine(num_blocks=10, budget=64, prefix=False, policy=policy)
        requests = [make_request(f"r{i}", [i] * 5, 12, order=i, priority=p) for i, p in enumerate([3, 0, 1, 2])]
        scheduler.add_request(requests[0])
        out = scheduler.schedule()
        scheduler.finish_requests(scheduler.update(out, runner.execute(out)))
        for request in requests[1:]:
            scheduler.add_request(request)
        first_victim = None
        while scheduler.has_unfinished():
            out = scheduler.schedule()
            scheduler.finish_requests(scheduler.update(out, runner.execute(out)))
            scheduler.check_invariants()
            preempted = [r.request_id for r in requests if r.metrics.num_preemptions]
            first_victim = first_victim or (preempted[0] if preempted else None)
        assert first_victim == victim, policy
        for i, request in enumerate(requests):
            assert request.output_token_ids == reference_continuation([i] * 5, 12)


ops = st.lists(
    st.one_of(
        st.tuples(st.just("add"), st.lists(st.integers(0, 3), min_size=1, max_size=30), st.integers(1, 12)),
        st.tuples(st.just("abort"), st.integers(0, 30), st.just(0)),
        st.tuples(st.just("step"), st.integers(1, 3), st.just(0)),
    ),
    max_size=40,
)


@settings(max_examples=150, deadline=None)  # three policies share them
@given(ops=ops, num_blocks=st.integers(12, 40), budget=st.integers(4, 40), prefix=st.booleans(),
       policy=st.sampled_from(["fcfs", "lpm", "priority"]))
def test_random_add_abort_step_keeps_accounting_and_outputs(ops, num_blocks, budget, prefix, policy) -> None:
    scheduler, runner = make_engine(num_blocks=num_blocks, budget=budget, prefix=prefix, policy=policy)
    requests: list[Request] = []
    aborted: set[str] = set()
    for op, a, b in ops:
        if op == "add":
            request = make_request(f"r{len(requests)}", a, b, order=len(requests), priority=len(a) % 3)
            requests.append(request)
            scheduler.add_request(request)
        elif op == "abort" and a < len(requests):
            if scheduler.abort_request(requests[a].request_id) is not None:
                aborted.add(requests[a].request_id)
        else:
            for _ in range(a):
                out = scheduler.schedule()
                scheduler.finish_requests(scheduler.update(out, runner.execute(out)))
        scheduler.check_invariants()
    run_to_completion(scheduler, runner)
    pool = scheduler.kv.pool
    assert pool.num_used == 0 and pool.num_free + pool.num_evictable == num_blocks
    for request in requests:
        if request.request_id not in aborted:
            expected = reference_continuation(request.prompt_token_ids, request.sampling_params.max_tokens)
            assert request.output_token_ids == expected
