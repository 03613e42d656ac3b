"""RequestRun over a fake engine: how the engine requests of one HTTP request are admitted together."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest

from kvserve.errors import CapacityError
from kvserve.request import SamplingParams
from kvserve.server.request_run import EngineRequest, RequestRun


class QueueFullAfterOne:
    """The first request is admitted and then waits in the queue (no output yet); the second is refused."""

    def __init__(self) -> None:
        self.aborted: list[str] = []

    async def generate(self, prompt_token_ids: list[int], params: SamplingParams, request_id: str,
                       prompt: str | None = None) -> AsyncIterator:
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
