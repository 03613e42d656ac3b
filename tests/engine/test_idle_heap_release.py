"""Going idle hands the heap's free memory back: ``release_free_heap`` shrinks a fragmented heap, and the
engine thread runs its idle hook once per busy spell, never while it works or before it has worked."""

from __future__ import annotations

import asyncio
import sys
import threading
import time
from types import SimpleNamespace

import pytest

from kvserve.async_engine import AsyncEngine
from kvserve.engine import EngineStats
from kvserve.heap import release_free_heap
from kvserve.request import CompletionOutput, RequestMetrics, RequestOutput
from kvserve.sampling_params import SamplingParams


def _resident_mib() -> float:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmRSS"):
                return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc_trim, read through /proc")
def test_release_free_heap_returns_the_free_pages_of_a_fragmented_heap() -> None:
    blocks = [bytearray(64 * 1024) for _ in range(3000)]  # below the mmap threshold: on the heap
    kept = blocks[::16]  # one block in 16 stays alive, so free() alone cannot shrink the heap
    del blocks
    before = _resident_mib()
    assert release_free_heap()
    after = _resident_mib()
    assert before - after > 100, (before, after)
    assert len(kept) == 188


class TwoStepEngine:
    """Each request finishes on its second step; counts the steps and when the idle hook ran."""

    max_model_len = 64

    def __init__(self) -> None:
        self.requests: dict[str, int] = {}
        self.num_steps = 0
        self.input_processor = SimpleNamespace()

    def stats(self) -> EngineStats:
        return EngineStats(num_running=len(self.requests), num_waiting=0, num_kv_blocks=8, num_used_blocks=0,
                           num_cached_blocks=0, num_free_blocks=8, num_evicted_blocks=0, num_preemptions=0,
                           prefix_cache_queries=0, prefix_cache_hits=0, num_prompt_tokens_computed=0,
                           num_generated_tokens=0, num_steps=self.num_steps, busy_time_s=0.0)

    def add_processed(self, processed, request_id: str) -> None:
        self.requests[request_id] = 0

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def unfinished_request_ids(self) -> list[str]:
        return list(self.requests)

    def step(self) -> list[RequestOutput]:
        self.num_steps += 1
        outputs = []
        for request_id in list(self.requests):
            self.requests[request_id] += 1
            finished = self.requests[request_id] == 2
            if finished:
                del self.requests[request_id]
            completion = CompletionOutput(index=0, text="a", token_ids=[7], finish_reason="length" if finished else None)
            outputs.append(RequestOutput(request_id, None, [1], [completion], finished, 0,
                                         RequestMetrics(arrival_time=time.monotonic()),
                                         delta_text="a", delta_token_ids=[7]))
        return outputs

    def abort_request(self, request_id: str) -> None:
        self.requests.pop(request_id, None)


def test_the_idle_hook_runs_once_after_each_busy_spell_and_never_before_work() -> None:
    engine = TwoStepEngine()
    idle_calls: list[int] = []
    went_idle = threading.Event()

    def on_idle() -> None:
        idle_calls.append(engine.num_steps)
        went_idle.set()

    async_engine = AsyncEngine(engine, on_idle=on_idle)  # type: ignore[arg-type]

    async def one_request(request_id: str) -> None:
        async for _ in async_engine.generate([1], SamplingParams(max_tokens=2), request_id):
            pass

    try:
        time.sleep(1.2)  # idle from the start: nothing has been done, so nothing to hand back
        assert idle_calls == []
        for spell in range(2):
            went_idle.clear()
            asyncio.run(one_request(f"r{spell}"))
            assert went_idle.wait(timeout=10)
            time.sleep(1.2)  # idle on: the hook does not run again
            assert idle_calls == [2 * (spell + 1)]
            idle_calls.clear()
    finally:
        async_engine.shutdown()
