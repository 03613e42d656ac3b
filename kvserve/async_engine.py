"""The engine in a background thread, with a per-request asyncio stream, abort and back-pressure.

    asyncio side (server)                       engine thread
    ─────────────────────                       ─────────────
    prepare() ── validate, tokenize (once)
    generate() ──────────────────────► commands (add / abort) ──► Engine.add_processed / abort_request
        ▲                                                            Engine.step()
        └── per-request asyncio.Queue ◄── loop.call_soon_threadsafe ◄── RequestOutput

Validation and tokenisation happen once, on the caller's side, before anything is queued (the engine's
input processor), so bad input raises at once with a typed error and the engine thread only queues.
If the loop dies, every open stream and every later request gets EngineDeadError.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections import deque
from collections.abc import AsyncIterator, Callable
from concurrent.futures import Future
from dataclasses import dataclass

from kvserve.engine import Engine, EngineAudit, EngineStats, PromptType
from kvserve.errors import CapacityError, EngineDeadError, InvalidRequest, KVServeError
from kvserve.heap import release_free_heap
from kvserve.request import ProcessedPrompt, RequestOutput
from kvserve.sampling_params import SamplingParams, StructuredOutputsParams
from kvserve.structured.grammar import CompiledGrammar, GrammarCompiler, named_for

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class _Add:
    request_id: str
    prompt: ProcessedPrompt
    stream: _Stream


@dataclass(slots=True)
class _Abort:
    request_id: str


@dataclass(slots=True)
class _Audit:
    result: Future[EngineAudit]


class _Stream:
    """Outputs of one request, handed from the engine thread to the caller's event loop. Outputs the caller
    has not read yet are merged (``RequestOutput.following``): a slow reader holds one, not one per step."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self._items: deque[RequestOutput | BaseException] = deque()
        self._ready = asyncio.Event()

    def put(self, item: RequestOutput | BaseException) -> None:
        try:
            self.loop.call_soon_threadsafe(self._append, item)
        except RuntimeError:  # the caller's loop is closed: nobody is listening any more
            pass

    def _append(self, item: RequestOutput | BaseException) -> None:
        last = self._items[-1] if self._items else None
        if isinstance(item, RequestOutput) and isinstance(last, RequestOutput):
            self._items[-1] = item.following(last)
        else:
            self._items.append(item)
        self._ready.set()

    async def get(self) -> RequestOutput | BaseException:
        while not self._items:
            self._ready.clear()
            await self._ready.wait()
        return self._items.popleft()


class AsyncEngine:
    def __init__(self, engine: Engine, max_waiting_requests: int | None = None,
                 on_idle: Callable[[], object] = release_free_heap) -> None:
        """``on_idle`` runs on the engine thread once each time the engine has had nothing to do for a
        moment after working (by default it hands the heap's free memory back to the OS)."""
        self.engine = engine
        self.max_waiting_requests = max_waiting_requests
        self._on_idle = on_idle
        self._commands: queue.SimpleQueue[_Add | _Abort | _Audit | None] = queue.SimpleQueue()
        self._wakeup = threading.Event()
        self._streams: dict[str, _Stream] = {}
        self._num_pending_adds = 0  # queued but not yet seen by the engine thread
        self._lock = threading.Lock()
        self._stopping = False
        self.dead: BaseException | None = None
        self._stats: EngineStats = engine.stats()
        self.last_step_time = time.monotonic()
        self._thread = threading.Thread(target=self._run, name="kvserve-engine", daemon=True)
        self._thread.start()

    # --- caller side ----------------------------------------------------------------------------------------
    @property
    def is_alive(self) -> bool:
        return self.dead is None and self._thread.is_alive()

    def stats(self) -> EngineStats:
        """The snapshot the engine thread took after its last step (never races the step itself)."""
        return self._stats

    def num_unfinished(self) -> int:
        """Requests with an open stream (queued, running, or finishing)."""
        return len(self._streams)

    def check_text_fits(self, text: str) -> None:
        """Raise ContextLengthExceeded for a text that cannot fit the context, without tokenizing it."""
        self.engine.input_processor.check_text_fits(text)

    @property
    def grammars(self) -> GrammarCompiler:
        return self.engine.grammars

    async def compile_grammar(self, spec: StructuredOutputsParams) -> CompiledGrammar:
        """Compile a constraint on the compiler's threads while the event loop serves other requests;
        GrammarCompileTimeout past the limit (the compile goes on, for a retry), InvalidRequest if it fails.
        The caller hands the result to ``generate``: the cache may have dropped it by then."""
        compiler = self.engine.grammars
        future = compiler.submit(spec)
        limit = compiler.config.compile_timeout_s
        try:
            # Shielded: the compile is shared with other requests for the same constraint, and cached.
            return await asyncio.wait_for(asyncio.shield(asyncio.wrap_future(future)), limit)
        except TimeoutError:
            raise compiler.timeout_error(spec, limit) from None
        except InvalidRequest as exc:
            raise named_for(exc, spec) from None

    def resolve_params(self, params: SamplingParams) -> SamplingParams:
        """``params`` checked against the model, with what needs its tokenizer filled in (the bad words'
        tokens): what ``generate`` takes."""
        return self.engine.input_processor.resolve_params(params)

    def prepare(self, prompt: PromptType, params: SamplingParams) -> tuple[list[int], str | None]:
        """Tokenize and validate without queueing anything: raises the typed error the caller reports. A
        structured-output constraint is compiled apart (``compile_grammar``), its result given to ``generate``."""
        self._check_alive()
        processed = self.engine.input_processor.process(prompt, params, compile_grammar=False)
        return processed.prompt_token_ids, processed.prompt

    async def generate(
        self, prompt_token_ids: list[int], params: SamplingParams, request_id: str, prompt: str | None = None,
        grammar: CompiledGrammar | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """Stream a request's outputs; leaving the iteration early (client gone) aborts the request.

        ``prompt_token_ids`` must come from ``prepare`` with the same parameters (``params`` may differ from
        them only in ``n`` and ``seed``, as the fan-out of n > 1 does), and ``params`` from ``resolve_params``:
        they are not checked again. ``grammar``: ``compile_grammar``'s result for the request's constraint
        (without it the engine thread looks it up)."""
        assert not params.bad_words or params.bad_words_token_ids, "generate takes params from resolve_params"
        self._check_alive()
        with self._lock:
            if self.max_waiting_requests is not None:
                waiting = self._stats.num_waiting + self._num_pending_adds
                if waiting >= self.max_waiting_requests:
                    raise CapacityError(
                        f"the server is at capacity ({waiting} requests waiting); retry shortly"
                    )
            self._num_pending_adds += 1
        stream = _Stream(asyncio.get_running_loop())
        self._streams[request_id] = stream
        self._send(_Add(request_id, ProcessedPrompt(prompt_token_ids, prompt, params, grammar), stream))
        if not self.is_alive:
            # The loop died after the check above, possibly before it could see this stream to fail it:
            # nothing would ever answer it. (A stream registered before the loop sets ``dead`` is failed by it.)
            self._streams.pop(request_id, None)
            raise EngineDeadError(f"the engine loop has stopped: {self.dead!r}")
        finished = False
        try:
            while True:
                item = await stream.get()
                if isinstance(item, BaseException):
                    raise item
                if item.finished:
                    finished = True
                yield item
                if finished:
                    return
        finally:
            if not finished:
                self.abort(request_id)
            self._streams.pop(request_id, None)

    def abort(self, request_id: str) -> None:
        self._send(_Abort(request_id))

    async def audit(self, timeout_s: float = 30.0) -> EngineAudit:
        """``Engine.audit``, run on the engine thread between two steps (the only place it sees a
        consistent state)."""
        self._check_alive()
        result: Future[EngineAudit] = Future()
        self._send(_Audit(result))
        return await asyncio.wait_for(asyncio.wrap_future(result), timeout_s)

    def _send(self, command: _Add | _Abort | _Audit | None) -> None:
        self._commands.put(command)
        self._wakeup.set()

    def _check_alive(self) -> None:
        if self._stopping:
            raise EngineDeadError("the server is shutting down")
        if not self.is_alive:
            raise EngineDeadError(f"the engine loop has stopped: {self.dead!r}")

    def shutdown(self, timeout: float = 10.0) -> bool:
        """Stop the engine thread; whether it stopped within ``timeout`` (if not, it may still change the
        engine's state: the engine must not persist its cache then)."""
        self._stopping = True
        self._send(None)
        self._thread.join(timeout)
        return not self._thread.is_alive()

    # --- engine thread --------------------------------------------------------------------------------------
    def _run(self) -> None:
        engine = self.engine
        worked_since_idle = False
        try:
            while True:
                if not self._drain_commands():
                    break
                if not engine.has_unfinished_requests():
                    woken = self._wakeup.wait(timeout=0.5)
                    self._wakeup.clear()
                    if not woken and worked_since_idle:
                        worked_since_idle = False
                        self._on_idle()
                    continue
                worked_since_idle = True
                outputs = engine.step()
                self._stats = engine.stats()
                self.last_step_time = time.monotonic()
                for output in outputs:
                    stream = self._streams.get(output.request_id)
                    if stream is not None:
                        stream.put(output)
        except BaseException as exc:  # the loop must never die silently
            logger.exception("engine loop died")
            self.dead = exc
            error = EngineDeadError(f"the engine loop has stopped: {exc!r}")
            for stream in list(self._streams.values()):
                stream.put(error)
        finally:
            self._abort_everything()

    def _drain_commands(self) -> bool:
        """Apply queued adds and aborts. Returns False on the shutdown sentinel."""
        while True:
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return True
            if command is None:
                return False
            if isinstance(command, _Audit):
                command.result.set_result(self.engine.audit())
                continue
            if isinstance(command, _Abort):
                output = self.engine.abort_request(command.request_id)
                stream = self._streams.get(command.request_id)
                if output is not None and stream is not None:
                    stream.put(output)
                # The abort freed blocks: refresh the snapshot now, the engine may have no step left to run.
                self._stats = self.engine.stats()
                continue
            with self._lock:
                self._num_pending_adds -= 1
            try:
                self.engine.add_processed(command.prompt, request_id=command.request_id)
            except KVServeError as exc:  # one request's problem, never the loop's
                command.stream.put(exc)
            except ValueError as exc:
                command.stream.put(exc)
            self._stats = self.engine.stats()

    def _abort_everything(self) -> None:
        for request_id in self.engine.unfinished_request_ids():
            self.engine.abort_request(request_id)
