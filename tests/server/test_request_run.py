"""RequestRun over a fake engine: how the engine requests of one HTTP request are admitted together, and how
the outputs of a reader that falls behind are merged."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest

from kvserve.async_engine import _Stream
from kvserve.errors import CapacityError
from kvserve.request import CompletionOutput, RequestMetrics, RequestOutput
from kvserve.sampling_params import SamplingParams
from kvserve.server.request_run import EngineRequest, RequestRun


class QueueFullAfterOne:
    """The first request is admitted and then waits in the queue (no output yet); the second is refused."""

    def __init__(self) -> None:
        self.aborted: list[str] = []

    async def generate(self, prompt_token_ids: list[int], params: SamplingParams, request_id: str,
                       prompt: str | None = None, grammar: object = None) -> AsyncIterator:
        if request_id.endswith("-1"):
            raise CapacityError("the waiting queue is full")
        try:
            await asyncio.Event().wait()  # queued behind other clients' requests: no first output
            yield None
        finally:
            self.aborted.append(request_id)


class NullMetrics:
    def observe_admitted(self, *args: object) -> None: ...
    def observe_finished(self, *args: object) -> None: ...


def test_a_refused_sibling_fails_the_request_at_once_and_aborts_the_admitted_one() -> None:
    """n=2 with room for one: the 429 must not wait for the admitted sibling's first token (it used to
    wait through its queueing and prefill), and that sibling must be aborted, not left to run."""
    engine = QueueFullAfterOne()
    registry: set[RequestRun] = set()
    children = [EngineRequest(i, 0, f"cmpl-x-{i}", SamplingParams(), [1, 2, 3], None) for i in range(2)]
    run = RequestRun(engine, NullMetrics(), registry, children, received_at=0.0)  # type: ignore[arg-type]

    async def start() -> None:
        await asyncio.wait_for(run.start(), timeout=10)  # a hang detector: the fix answers at once

    with pytest.raises(CapacityError):
        asyncio.run(start())
    assert engine.aborted == ["cmpl-x-0"]
    assert not registry


def output(request_id: str, tokens: list[int], new: int, finished: bool = False) -> RequestOutput:
    text = "".join(f"t{t} " for t in tokens)
    return RequestOutput(request_id, None, [1], [CompletionOutput(0, text, list(tokens))], finished, 0,
                         RequestMetrics(0.0), delta_text="".join(f"t{t} " for t in tokens[-new:]),
                         delta_token_ids=tokens[-new:])


class TwoSamplesTenSteps:
    """Two engine requests that produce ten tokens each, one a step, faster than anyone reads them."""

    async def generate(self, prompt_token_ids: list[int], params: SamplingParams, request_id: str,
                       prompt: str | None = None, grammar: object = None) -> AsyncIterator:
        for n in range(1, 11):
            yield output(request_id, list(range(n)), 1, finished=n == 10)


def test_a_reader_that_falls_behind_gets_each_requests_outputs_merged_not_queued() -> None:
    children = [EngineRequest(i, 0, f"cmpl-x-{i}", SamplingParams(), [1], None) for i in range(2)]
    run = RequestRun(TwoSamplesTenSteps(), NullMetrics(), set(), children, received_at=0.0)  # type: ignore

    async def read_late() -> list[tuple[int, RequestOutput]]:
        await run.start()
        await asyncio.sleep(0.05)  # every step has arrived meanwhile
        seen = []
        while (item := await run.next()) is not None:
            seen.append((item[0].index, item[1]))
        return seen

    seen = asyncio.run(read_late())
    assert len(seen) == 4  # each sample: its first output, then the other nine as one
    for index in (0, 1):
        mine = [o for i, o in seen if i == index]
        assert "".join(o.delta_text for o in mine) == mine[-1].outputs[0].text
        assert [t for o in mine for t in o.delta_token_ids] == list(range(10)) and mine[-1].finished


def test_an_engine_stream_merges_what_its_reader_has_not_read() -> None:
    async def run() -> list[RequestOutput | BaseException]:
        stream = _Stream(asyncio.get_running_loop())
        for n in range(1, 4):
            stream.put(output("r", list(range(n)), 1))
        stream.put(RuntimeError("the engine died"))
        await asyncio.sleep(0)  # the engine thread's call_soon_threadsafe callbacks run
        return [await stream.get(), await stream.get()]

    merged, error = asyncio.run(run())
    assert isinstance(merged, RequestOutput) and merged.delta_token_ids == [0, 1, 2]
    assert merged.delta_text == "t0 t1 t2 " and isinstance(error, RuntimeError)


def test_only_the_first_sample_of_a_prompt_computes_its_prompt_logprobs() -> None:
    from kvserve.sampling_params import expand_n

    samples = expand_n(SamplingParams(n=3, seed=7, prompt_logprobs=2))
    assert [s.prompt_logprobs for s in samples] == [2, None, None] and [s.seed for s in samples] == [7, 8, 9]


def test_an_embedding_input_the_queue_refuses_is_that_error_and_the_others_stop() -> None:
    from kvserve.server.embeddings import embed

    started: list[str] = []
    cancelled: list[str] = []

    class FullAfterOne:
        async def generate(self, ids, params, request_id, text=None, grammar=None):
            if request_id.endswith("-1"):
                raise CapacityError("the waiting queue is full")
            started.append(request_id)
            try:
                await asyncio.Event().wait()
                yield None
            except asyncio.CancelledError:
                cancelled.append(request_id)
                raise

    with pytest.raises(CapacityError):  # the typed error (a 429), not an exception group (a 500)
        asyncio.run(embed(FullAfterOne(), [([1], None), ([2], None)]))  # type: ignore[arg-type]
    assert started == cancelled == [started[0]]
