"""The engine requests behind one HTTP request: one per (prompt, sample), started together, their outputs
merged into one stream, and what the response reports about them (usage, per-request pipeline timings).

A client that disconnects cancels its RequestRun, which closes its generators, which aborts its engine
requests: their KV blocks are freed at the next engine step.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

from kvserve.async_engine import AsyncEngine
from kvserve.errors import KVServeError
from kvserve.reasoning import AnswerTokens, Phase, ReasoningSplitter, count_reasoning_tokens
from kvserve.request import RequestOutput
from kvserve.sampling_params import SamplingParams
from kvserve.server import response_models as rm
from kvserve.server.metrics import ServerMetrics
from kvserve.structured.grammar import CompiledGrammar
from kvserve.structured.tool_calls import ToolCallParser


@dataclass(slots=True, eq=False)
class EngineRequest:
    """One engine request: prompt ``prompt_index``, sample ``index`` (the choice index) of the response."""

    index: int
    prompt_index: int
    request_id: str
    params: SamplingParams
    prompt_token_ids: list[int]
    prompt: str | None
    last: RequestOutput | None = None
    submitted: bool = False  # reached the engine (so an early exit aborts it there)
    finished: bool = False
    next_text_offset: int = 0  # completions logprobs: text_offset of the next streamed token
    echoed: bool = False  # a streamed completion with echo: the prompt went out in its first chunk
    tool_parser: ToolCallParser | None = None  # a streamed chat reply that may hold tool calls
    reasoning_splitter: ReasoningSplitter | None = None  # a reasoning model's streamed chat reply
    reasoning: Phase | None = None  # a reasoning model's chat reply: where its prompt left it
    num_thought_tokens: int = 0  # of its tokens, its thoughts' (counted when it ends)
    answer_logprobs: AnswerTokens[Any] | None = None  # streamed without its thoughts: their logprobs left out
    grammar: CompiledGrammar | None = None  # its constraint's, compiled before it was made
    first_sample: EngineRequest | None = None  # the sample of the same prompt that computed its prompt logprobs


class RequestRun:
    """Starts the engine requests of one HTTP request and merges their outputs into one stream.

    Each engine request's async generator is driven by a pump task that copies its outputs into one
    queue. ``close()`` is synchronous on purpose: it runs in ``finally`` blocks of cancelled tasks, where
    an await would be cancelled again. Cancelling a pump raises CancelledError inside its generator, whose
    ``finally`` aborts the engine request.
    """

    def __init__(self, engine: AsyncEngine, metrics: ServerMetrics, registry: set[RequestRun],
                 children: list[EngineRequest], received_at: float,
                 on_finished: Callable[[EngineRequest, float, str], None] | None = None) -> None:
        self.engine = engine
        self.metrics = metrics
        self.on_finished = on_finished  # (child, received_at, finish reason): the live stats' record
        self.registry = registry  # the server's in-flight runs: a run is in it from start() to close()
        self.children = children
        self.received_at = received_at
        # Outputs not read yet, in arrival order; a request's newest output merges into its entry still waiting
        # here (a slow client holds one output per request, not one per step).
        self._waiting: deque[list[Any]] = deque()  # [child, output or error]
        self._last_waiting: dict[int, list[Any]] = {}  # child index -> its output entry still in _waiting
        self._arrived = asyncio.Event()
        self._primed: deque[tuple[EngineRequest, RequestOutput]] = deque()  # first outputs, already observed
        self._pumps: list[asyncio.Task[None]] = []
        self._closed = False

    async def start(self) -> None:
        """Admit every engine request and wait for each one's first output; raise the first error."""
        engine = self.engine
        self.registry.add(self)
        gens = [engine.generate(c.prompt_token_ids, c.params, c.request_id, c.prompt, c.grammar)
                for c in self.children]
        firsts_pending = [asyncio.ensure_future(anext(g)) for g in gens]
        try:
            # The first error ends the wait: siblings already admitted are cancelled (which aborts them)
            # instead of being prefilled only for the request to fail (a 429 came seconds late).
            _, pending = await asyncio.wait(firsts_pending, return_when=asyncio.FIRST_EXCEPTION)
        except BaseException:  # cancelled (client gone): cancelling each generator aborts its request
            for task in firsts_pending:
                task.cancel()
            for child in self.children:
                child.submitted = True
            self.close()
            raise
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
        # Each child's first output, its error, or None where it was cancelled after a sibling's error.
        firsts = [None if task.cancelled() else task.exception() or task.result() for task in firsts_pending]
        for child, first in zip(self.children, firsts, strict=True):
            if isinstance(first, RequestOutput):
                child.submitted = True
                self._observe(child, first)
                self._primed.append((child, first))
        errors = [r for r in firsts if isinstance(r, BaseException)]
        if errors:
            await asyncio.gather(*(g.aclose() for g in gens), return_exceptions=True)  # aborts the admitted
            self.close()
            error = next((e for e in errors if isinstance(e, KVServeError)), errors[0])
            if isinstance(error, StopAsyncIteration):
                raise RuntimeError("an engine request ended without output")
            raise error
        # A pump per request, also for one already finished: it lets the generator run to its end.
        self._pumps = [asyncio.create_task(self._pump(child, gen)) for child, gen in zip(self.children, gens,
                                                                                          strict=True)]

    async def _pump(self, child: EngineRequest, gen: AsyncIterator[RequestOutput]) -> None:
        try:
            async for output in gen:
                entry = self._last_waiting.get(child.index)
                if entry is not None:
                    entry[1] = output.following(entry[1])
                else:
                    self._put(child, output)
        except Exception as exc:  # EngineDeadError, or the request's own error: the consumer raises it
            self._last_waiting.pop(child.index, None)
            self._put(child, exc)

    def _put(self, child: EngineRequest, item: RequestOutput | BaseException) -> None:
        entry = [child, item]
        self._waiting.append(entry)
        if isinstance(item, RequestOutput):
            self._last_waiting[child.index] = entry
        self._arrived.set()

    @property
    def done(self) -> bool:
        """Every engine request has finished (its final output may still be waiting to be read)."""
        return all(c.finished for c in self.children)

    @property
    def exhausted(self) -> bool:
        """Finished, and every output read: the next ``next()`` returns None."""
        return self.done and not self._primed

    async def next(self) -> tuple[EngineRequest, RequestOutput] | None:
        """The next output of any engine request, or None once all have finished."""
        if self._primed:
            return self._primed.popleft()
        if self.done:
            return None
        while not self._waiting:
            self._arrived.clear()
            await self._arrived.wait()
        entry = self._waiting.popleft()
        child, item = entry
        if self._last_waiting.get(child.index) is entry:
            del self._last_waiting[child.index]
        if isinstance(item, BaseException):
            raise item
        self._observe(child, item)
        return child, item

    async def wait(self) -> None:
        while await self.next() is not None:
            pass

    def _observe(self, child: EngineRequest, output: RequestOutput) -> None:
        metrics = self.metrics
        if child.last is None:
            metrics.observe_admitted(len(output.prompt_token_ids), output.num_cached_tokens)
        child.last = output
        if output.finished and not child.finished:
            child.finished = True
            completion = output.outputs[0]
            metrics.observe_finished(completion.finish_reason or "stop", len(completion.token_ids), output.metrics)
            self._observe_thoughts(child)
            if self.on_finished is not None:
                self.on_finished(child, self.received_at, completion.finish_reason or "stop")

    def _observe_thoughts(self, child: EngineRequest) -> None:
        """A reasoning model's ended reply: how many of its tokens were thoughts (aborted ones too, as their
        tokens count among the generated)."""
        if child.reasoning is None or child.last is None:
            return
        if (tokens := self.engine.engine.reasoning_tokens) is not None:
            child.num_thought_tokens = count_reasoning_tokens(child.last.outputs[0].token_ids, tokens, child.reasoning)
            self.metrics.reasoning_tokens.inc(child.num_thought_tokens)

    def abort(self) -> None:
        """Ask the engine to end every unfinished request; each stream then ends with finish_reason abort."""
        for child in self.children:
            if not child.finished:
                self.engine.abort(child.request_id)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        for pump in self._pumps:
            pump.cancel()
        for child in self.children:
            if child.submitted and not child.finished:
                child.finished = True
                num_tokens = len(child.last.outputs[0].token_ids) if child.last is not None else 0
                self.metrics.observe_finished("abort", num_tokens, None)
                self._observe_thoughts(child)
                if self.on_finished is not None:
                    self.on_finished(child, self.received_at, "abort")
        self.registry.discard(self)

    # --- what the response reports ----------------------------------------------------------------------
    def usage(self) -> rm.Usage:
        """Prompt tokens once per prompt (as OpenAI counts n > 1); cached tokens of each prompt's first sample."""
        firsts = {c.prompt_index: c for c in reversed(self.children)}
        prompt_tokens = sum(len(c.prompt_token_ids) for c in firsts.values())
        cached = sum(c.last.num_cached_tokens for c in firsts.values() if c.last is not None)
        completion = sum(len(c.last.outputs[0].token_ids) for c in self.children if c.last is not None)
        return rm.Usage.of(prompt_tokens, completion, cached)

    def usage_of(self, child: EngineRequest, sent: bool = True) -> rm.Usage:
        """One choice's usage so far, as vLLM's continuous usage counts it: its prompt's tokens and the tokens of
        its own that were sent (none before its first text, with ``sent`` false)."""
        last = child.last
        completion = len(last.outputs[0].token_ids) if last is not None and sent else 0
        return rm.Usage.of(len(child.prompt_token_ids), completion, last.num_cached_tokens if last is not None else 0)

    def timings(self) -> dict[str, Any]:
        """Choice 0's trip through the pipeline; with several choices, each one's under "choices"."""
        each = [request_timings(c, self.received_at) for c in self.children]
        result = dict(each[0])
        if len(each) > 1:
            result["choices"] = each
        return result


def request_timings(child: EngineRequest, received_at: float) -> dict[str, Any]:
    """Milliseconds between the stages of one engine request (None for a stage it never reached)."""
    assert child.last is not None
    m = child.last.metrics

    def ms(start: float | None, end: float | None) -> float | None:
        return None if start is None or end is None else round((end - start) * 1e3, 3)

    num_output = len(child.last.outputs[0].token_ids)
    return {
        "index": child.index,
        "received_to_queued_ms": ms(received_at, m.arrival_time),  # validation, tokenizing, hand-off
        "queued_ms": ms(m.arrival_time, m.first_scheduled_time),
        "cache_lookup": {
            "prompt_tokens": len(child.prompt_token_ids),
            "cached_tokens": m.num_cached_tokens,
            "cached_tokens_by_tier": dict(m.cached_tokens_by_tier),
        },
        "prefill": {
            "tokens_computed": m.num_prefill_tokens_computed,
            "chunks": m.num_prefill_chunks,
            "ms": ms(m.first_scheduled_time, m.first_token_time),
        },
        "first_token_ms": ms(m.arrival_time, m.first_token_time),
        "decode": {"steps": m.num_decode_steps, "tokens": max(0, num_output - 1),
                   "ms": ms(m.first_token_time, m.last_token_time)},
        "finished_ms": ms(m.arrival_time, m.finished_time),
        "preemptions": m.num_preemptions,
        "speculative": {
            "steps": m.num_draft_steps,  # decodes that verified drafts
            "drafts": m.num_draft_tokens,
            "accepted": m.num_accepted_draft_tokens,
            "acceptance_rate": round(m.num_accepted_draft_tokens / m.num_draft_tokens, 4) if m.num_draft_tokens else None,
            "mean_draft_length": round(m.num_draft_tokens / m.num_draft_steps, 3) if m.num_draft_steps else None,
        },
        "finish_reason": child.last.outputs[0].finish_reason,
    }
