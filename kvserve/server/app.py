"""The FastAPI app: the OpenAI routes over an AsyncEngine, and the state one server keeps.

A route validates its body, tokenizes its prompt(s) and hands them to ``AppState.respond``, which starts
a RequestRun (one engine request per prompt x n), waits for every engine request's first output, and
answers with the stream or the JSON body ``responses.ResponseBuilder`` builds.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from collections.abc import Callable
from dataclasses import asdict, replace
from typing import Any, TypeVar

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.background import BackgroundTask

from kvserve.async_engine import AsyncEngine
from kvserve.errors import (
    ConfigError,
    ContextLengthExceeded,
    EngineDeadError,
    InvalidRequest,
    ModelNotFound,
    ServerShuttingDown,
)
from kvserve.infill import fim_tokens_or_error
from kvserve.reasoning import Phase, constrained_phase
from kvserve.sampling_params import MAX_LOGIT_BIAS, SamplingParams, expand_n
from kvserve.server import protocol as p
from kvserve.server import response_models as rm
from kvserve.server.dashboard import add_dashboard_routes
from kvserve.server.disconnect import ClientGone, until_disconnected
from kvserve.server.embeddings import embed, embedding_params, embedding_response, prepare_inputs
from kvserve.server.live_stats import ComputeModel, RecentRequests, stats_snapshot
from kvserve.server.lora_routes import add_lora_routes
from kvserve.server.metrics import ServerMetrics
from kvserve.server.middleware import GateMiddleware, add_error_handlers
from kvserve.server.request_run import EngineRequest, RequestRun
from kvserve.server.response_store import ResponseStore
from kvserve.server.responses import ResponseBuilder
from kvserve.server.responses_routes import add_responses_routes
from kvserve.server.tools import ToolRequest, template_messages, template_tools, tool_request
from kvserve.serving_config import ServerConfig
from kvserve.structured.grammar import CompiledGrammar
from kvserve.structured.tool_calls import HermesToolFormat, ToolCallFormat
from kvserve.structured.tool_format_choice import tool_format_for
from kvserve.tokenizer import LONG_TEXT_CHARS, Tokenizer, chat_reply_phase

logger = logging.getLogger(__name__)

T = TypeVar("T")



class AppState:
    """One server's engine, model identity, in-flight requests and drain flag."""

    def __init__(self, engine: AsyncEngine, config: ServerConfig, tokenizer: Tokenizer, model_names: tuple[str, ...],
                 max_model_len: int | None, model_root: str | None, compute: ComputeModel | None = None) -> None:
        self.engine = engine
        self.config = config
        self.tokenizer = tokenizer
        # Any of them is this server's model; a response names the one its request named (vLLM), else the first.
        self.model_names = model_names
        self.model_name = model_names[0]
        self.max_model_len = max_model_len
        self.model_root = model_root
        self.metrics = ServerMetrics(engine.stats, lambda: engine.is_alive)
        self.bodies = ResponseBuilder(tokenizer, self.metrics, engine.engine.reasoning_markers,
                                      engine.engine.reasoning_tokens)
        self.response_store = ResponseStore(config.response_store_mib * 2**20)  # for previous_response_id
        self.runs: set[RequestRun] = set()
        self.recent = RecentRequests(compute=compute)  # what the dashboard lists and draws
        self.draining = False
        self.created = int(time.time())
        self._tool_format: ToolCallFormat | None = None
        # --default-chat-template-kwargs: what a chat request's own chat_template_kwargs override
        self.default_template_variables: dict[str, Any] = json.loads(config.default_chat_template_kwargs or "{}")

    @property
    def template_has_tools(self) -> bool:
        """The chat template renders tools itself; else they go into the system message (tools.py)."""
        return "tools" in (self.tokenizer.chat_template or "")

    async def tool_format(self) -> ToolCallFormat:
        """The model's tool-call format (``--tool-call-parser``; by default read from the chat template). The
        first call builds the grammar engine's view of the vocabulary (seconds for a large one), off the event
        loop."""
        if self._tool_format is None:
            self._tool_format = await asyncio.to_thread(tool_format_for, self.config.tool_call_parser,
                                                        self.tokenizer.chat_template, self.engine.grammars.special_token_id)
        return self._tool_format

    async def chat_text(self, body: p.ChatCompletionRequest, tools: ToolRequest,
                        reply: bool = True) -> tuple[str, ToolCallFormat | None, Phase | None]:
        """The conversation as the chat template renders it (tools in the template, or in the system message
        where it has no place for them; the final message open where the body continues it), the tool-call
        format where tools are offered, and (with ``reply``) where it leaves a reasoning model's reply (None:
        not one)."""
        messages, tools_arg, tool_format = body.message_dicts(), None, None
        if tools.tools:
            tool_format = await self.tool_format()
            messages = template_messages(messages, tools, tool_format, self.template_has_tools)
            tools_arg = template_tools(tools) if self.template_has_tools else None
        variables = {**self.default_template_variables, **body.template_variables()}
        text = self.tokenizer.apply_chat_template(messages, add_generation_prompt=body.add_generation_prompt,
                                                  tools=tools_arg, continue_final_message=body.continue_final_message,
                                                  variables=variables)
        markers = self.engine.engine.reasoning_markers
        phase = None if markers is None or not reply else chat_reply_phase(
            self.tokenizer, text, messages, markers, add_generation_prompt=body.add_generation_prompt,
            continue_final_message=body.continue_final_message, tools=tools_arg, variables=variables)
        return text, tool_format, phase

    async def chat_prompt(self, body: p.ChatCompletionRequest) -> tuple[SamplingParams, ToolRequest,
                                                                        ToolCallFormat | None, str]:
        """The chat route's sampling parameters (with the tool-call constraint where calls may come), tools,
        tool-call format and rendered conversation."""
        params = self.sampling_params(body)
        tools = tool_request(body, params.structured_outputs)
        text, tool_format, phase = await self.chat_text(body, tools)
        if tool_format is not None:
            tool_format = tools.format_for(tool_format)
            if tools.calls_possible:
                params = replace(params, structured_outputs=tools.constraint(tool_format))
            elif (tag := self.single_token_open_tag) is not None:  # tool_choice none: no call is opened
                params = replace(params, logit_bias=(*params.logit_bias, (tag, -MAX_LOGIT_BIAS)))
        if phase is not None and (tokens := self.engine.engine.reasoning_tokens) is not None:
            # as the engine's grammar will see it, so that the text is parted as the reply was constrained
            phase = constrained_phase(phase, tokens, params.structured_outputs is not None)
            params = replace(params, reasoning_phase=phase.value)
        return params, tools, tool_format, text

    async def prompt_ids(self, text: str, params: SamplingParams) -> list[int]:
        """A rendered conversation's token ids as the engine takes them; ContextLengthExceeded where it does not
        fit with room for its output."""
        if params.truncate_prompt_tokens is None:  # else tokenized whole, then cut to its last tokens
            self.engine.check_text_fits(text)
        # The template already holds any BOS token: don't add special tokens twice.
        ids = await _off_loop_if_long(text, self.tokenizer.encode, text, False)
        token_ids, _ = self.engine.prepare({"prompt_token_ids": ids}, params)
        return token_ids

    @property
    def single_token_open_tag(self) -> int | None:
        """The id of the token that opens a tool call, where it is one token."""
        tag = (self._tool_format or HermesToolFormat).open_tag
        if tag is None or tag.isidentifier():  # a word (Phi-4-mini's functools) may be meant as text
            return None
        return self.tokenizer.token_to_id(tag)

    def sampling_params(self, body: p.ChatCompletionRequest | p.CompletionRequest) -> SamplingParams:
        """A generation request's sampling parameters as the engine takes them, with the LoRA adapter its
        model names (None: the base model)."""
        params = self.engine.resolve_params(body.sampling_params())
        return replace(params, lora_name=self.adapter_named(body.model))

    def adapter_named(self, name: str | None) -> str | None:
        """The LoRA adapter a request's ``model`` names (after ``check_admissible``: any name but the base
        model's; one unloaded since is the engine's 404), or None for the base model."""
        return name if name is not None and name not in self.model_names else None

    def check_admissible(self, name: str | None) -> None:
        """What a generation route checks first: the server is up and ``name`` (if given) is its model or one
        of its LoRA adapters."""
        if self.draining:
            raise ServerShuttingDown("the server is shutting down; retry on another replica")
        if not self.engine.is_alive:
            raise EngineDeadError(f"the engine loop has stopped: {self.engine.dead!r}")
        if name is not None and name not in self.model_names and name not in self.engine.engine.loras:
            error = ModelNotFound(f"the model '{name}' does not exist; {self.serves}")
            error.param = "model"  # type: ignore[attr-defined]
            raise error

    @property
    def serves(self) -> str:
        """What an error about a model name says this server serves."""
        adapters = sorted(self.engine.engine.loras)
        return (f"this server serves {', '.join(repr(n) for n in self.model_names)}"
                + (f" and the LoRA adapters {', '.join(repr(n) for n in adapters)}" if adapters else ""))

    async def drain(self, grace_s: float) -> None:
        """Refuse new requests, give in-flight ones ``grace_s`` to finish, then abort the rest."""
        self.draining = True
        deadline = time.monotonic() + grace_s
        while self.runs and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        if self.runs:
            logger.warning("aborting %d in-flight request(s) after the %.1fs grace period", len(self.runs), grace_s)
            for run in list(self.runs):
                run.abort()
            deadline = time.monotonic() + 2.0  # time for the aborted streams to send their last chunk
            while self.runs and time.monotonic() < deadline:
                await asyncio.sleep(0.05)

    def check_queue_fits(self, num_prompts: int, n: int, prompts_param: str) -> None:
        """A 400 for a request of more sequences than the server ever queues: not a 429, since retrying cannot
        help it. Checked before its prompts are tokenized."""
        queue_limit = self.engine.max_waiting_requests
        if queue_limit is not None and num_prompts * n > queue_limit:
            raise InvalidRequest(
                f"this request needs {num_prompts * n} sequences ({num_prompts} {prompts_param}(s) x n={n}), "
                f"more than the {queue_limit} the server queues at once (--max-waiting-requests)",
                param="n" if n > 1 else prompts_param)

    # --- one request, end to end ----------------------------------------------------------------------------
    async def respond(self, http: Request, body: p.ChatCompletionRequest | p.CompletionRequest,
                      prompts: list[tuple[list[int], str | None]], params: SamplingParams, chat: bool,
                      received_at: float, tool_format: ToolCallFormat | None = None,
                      grammar: CompiledGrammar | None = None, reasoning: Phase | None = None) -> Response:
        """``tool_format``: the reply may hold tool calls in this format (parsed out of the content);
        ``grammar``: the compiled constraint of ``params``; ``reasoning``: where the prompt leaves a reasoning
        model's reply (its thoughts are parted from its answer)."""
        request_id = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        self.check_queue_fits(len(prompts), params.n, "prompt")
        samples = expand_n(params)  # the first sample of each prompt computes its prompt logprobs
        if body.stream:  # a streamed sample's echo carries its prompt's logprobs in its own first chunk
            samples = [replace(sample, prompt_logprobs=params.prompt_logprobs) for sample in samples]
        children = [
            EngineRequest(i * params.n + j, i, f"{request_id}-{i * params.n + j}", child_params, ids, text,
                          grammar=grammar, reasoning=reasoning)
            for i, (ids, text) in enumerate(prompts)
            for j, child_params in enumerate(samples)
        ]
        if not body.stream:
            for child in children:
                child.first_sample = children[child.prompt_index * params.n]
        run = RequestRun(self.engine, self.metrics, self.runs, children, received_at, self.recent.record)
        try:
            await until_disconnected(http, run.start())
        except ClientGone:
            run.close()
            return Response(status_code=499)  # nobody reads it: nginx's "client closed request"
        want_timings = body.return_timings or http.headers.get("x-kvserve-timings", "").lower() in ("1", "true")
        head = {"id": request_id, "created": int(time.time()), "model": body.model or self.model_name}
        if body.stream:
            stream = self.bodies.stream(run, body, chat, head, want_timings, tool_format, reasoning)
            return StreamingResponse(stream, media_type="text/event-stream", background=BackgroundTask(run.close),
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        try:
            await until_disconnected(http, run.wait())
        except ClientGone:
            return Response(status_code=499)
        finally:
            run.close()
        response = self.bodies.full_response(run, body, chat, head, tool_format, reasoning)
        if want_timings:
            response.timings = run.timings()
        return Response(response.to_json(), media_type="application/json")


async def _off_loop_if_long(prompt: object, fn: Callable[..., T], *args: Any) -> T:
    """``fn(*args)``, in a worker thread when ``prompt`` is a long text: while it is tokenized the event
    loop would serve no stream (benchmarks/host_side_costs.py times tokenizing)."""
    if isinstance(prompt, str) and len(prompt) > LONG_TEXT_CHARS:
        return await asyncio.to_thread(fn, *args)
    return fn(*args)


def build_app(
    async_engine: AsyncEngine,
    config: ServerConfig,
    tokenizer: Tokenizer,
    *,
    model_names: tuple[str, ...] = (),
    max_model_len: int | None = None,
    model_root: str | None = None,
    compute: ComputeModel | None = None,
) -> FastAPI:
    """A FastAPI app over a running AsyncEngine. The caller owns the engine (and shuts it down).
    ``compute``: the cost model the dashboard's FLOP/s, bytes/s, MFU and MBU come from."""
    names = model_names or config.served_model_name or ("kvserve",)
    if clash := sorted(set(names) & set(async_engine.engine.loras)):
        raise ConfigError(f"the LoRA adapter name(s) {clash} are the base model's: give the adapters other names",
                          "lora_modules")
    state = AppState(async_engine, config, tokenizer, names, max_model_len, model_root, compute)
    app = FastAPI(title="kvserve", version="0.1.0")
    app.state.kvserve = state
    app.add_middleware(GateMiddleware, config=config, metrics=state.metrics, draining=lambda: state.draining)
    add_error_handlers(app, state.metrics)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: p.ChatCompletionRequest, http: Request) -> Response:
        received_at = time.monotonic()
        state.check_admissible(body.model)
        params, tools, tool_format, text = await state.chat_prompt(body)
        grammar = None
        if tools.answer_format is not None:  # its own errors, named for its own field
            await async_engine.compile_grammar(tools.answer_format)
        if params.structured_outputs is not None:
            grammar = await async_engine.compile_grammar(params.structured_outputs)
        try:
            token_ids = await state.prompt_ids(text, params)
        except ContextLengthExceeded as exc:
            raise p.rename_param(exc, "max_tokens", body.max_tokens_field) from None
        parser = tool_format if tools.calls_possible else None
        reasoning = Phase(params.reasoning_phase) if params.reasoning_phase is not None else None
        return await state.respond(http, body, [(token_ids, None)], params, True, received_at, parser, grammar,
                                   reasoning)

    async def prompt_fits(body: p.ChatCompletionRequest) -> bool:
        """Whether the chat route takes ``body``'s conversation with room for its output (as it checks it)."""
        params, _, _, text = await state.chat_prompt(body)
        try:
            await state.prompt_ids(text, params)
        except ContextLengthExceeded:
            return False
        return True

    add_responses_routes(app, chat_completions, prompt_fits, state.response_store, state.model_name)
    if config.allow_runtime_lora_updating:
        add_lora_routes(app, async_engine.engine, state.model_names)

    @app.post("/v1/completions")
    async def completions(body: p.CompletionRequest, http: Request) -> Response:
        received_at = time.monotonic()
        state.check_admissible(body.model)
        params = state.sampling_params(body)
        inputs: list[p.PromptInput | dict[str, list[int]]] = list(body.prompts())
        state.check_queue_fits(len(inputs), params.n, "prompt")
        if body.suffix is not None:  # fill in the middle: each prompt is the text before the gap
            fim = fim_tokens_or_error(tokenizer, state.model_name)
            params = replace(params, stop_token_ids=(*params.stop_token_ids, *fim.ends))
            for i, before in enumerate(inputs):
                text = f"{before}{body.suffix}"
                async_engine.check_text_fits(text)
                ids = await _off_loop_if_long(text, fim.prompt, tokenizer, str(before), body.suffix)
                inputs[i] = {"prompt_token_ids": ids}
        grammar = None
        if params.structured_outputs is not None:
            grammar = await async_engine.compile_grammar(params.structured_outputs)
        if len(inputs) > 1:  # a batch is tokenized in one go, off the event loop
            prompts = await asyncio.to_thread(lambda: [async_engine.prepare(prompt, params) for prompt in inputs])
        else:
            prompts = [await _off_loop_if_long(inputs[0], async_engine.prepare, inputs[0], params)]
        return await state.respond(http, body, prompts, params, False, received_at, grammar=grammar)

    @app.post("/v1/embeddings")
    async def embeddings(body: p.EmbeddingRequest, http: Request) -> Response:
        state.check_admissible(body.model)
        params = replace(embedding_params(body), lora_name=state.adapter_named(body.model))
        state.check_queue_fits(len(body.inputs()), 1, "input")
        prompts = await asyncio.to_thread(prepare_inputs, async_engine, body) if isinstance(body.input, list) \
            else await _off_loop_if_long(body.input, prepare_inputs, async_engine, body)
        try:
            vectors = await until_disconnected(http, embed(async_engine, prompts, params))
        except ClientGone:
            return Response(status_code=499)
        return JSONResponse(embedding_response(vectors, prompts, body.model or state.model_name, body.encoding_format))

    @app.post("/tokenize")
    async def tokenize(body: p.TokenizeRequest) -> Response:
        """A prompt's token ids as /v1/completions takes them, or a conversation's as /v1/chat/completions
        renders it (tools included): what a client counts against the context before it sends."""
        state.check_admissible(body.model)
        if (body.prompt is None) == (body.messages is None):
            raise InvalidRequest("send either prompt or messages", param="prompt" if body.prompt is None
                                 else "messages")
        if body.messages is not None:
            chat = body.chat_request()
            text, _, _ = await state.chat_text(chat, tool_request(chat, None), reply=False)
            add_special = bool(body.add_special_tokens)  # the template holds any BOS token
        else:
            text = body.prompt or ""
            add_special = body.add_special_tokens is not False
        ids = await _off_loop_if_long(text, tokenizer.encode, text, add_special)
        strs = tokenizer.convert_ids_to_tokens(ids) if body.return_token_strs else None
        return JSONResponse({"count": len(ids), "max_model_len": state.max_model_len, "tokens": ids,
                             "token_strs": strs})

    @app.post("/detokenize")
    async def detokenize(body: p.DetokenizeRequest) -> Response:
        state.check_admissible(body.model)
        vocab = tokenizer.vocab_size
        if bad := [t for t in body.tokens if not 0 <= t < vocab]:
            raise InvalidRequest(f"tokens holds ids outside the vocabulary (0 to {vocab - 1}): {bad[:8]}",
                                 param="tokens")
        text = tokenizer.decode(body.tokens, skip_special_tokens=False)
        return JSONResponse({"prompt": text})

    def model_card(name: str) -> rm.ModelCard:
        adapter = async_engine.engine.loras.get(name) if name not in state.model_names else None
        if adapter is not None:  # as vLLM lists an adapter: its path as root, the base model as parent
            return rm.ModelCard(id=name, created=state.created, root=adapter.path, parent=state.model_name,
                                max_model_len=state.max_model_len)
        return rm.ModelCard(id=name, created=state.created, root=state.model_root, max_model_len=state.max_model_len)

    @app.get("/v1/models")
    async def models() -> Response:
        """A card for each name the model is served under, then each LoRA adapter (as vLLM lists them)."""
        adapters = list(async_engine.engine.loras)  # a snapshot: a runtime load may add one meanwhile
        names = [*state.model_names, *(n for n in adapters if n not in state.model_names)]
        cards = [model_card(name) for name in names]
        return Response(rm.ModelList(data=cards).model_dump_json(), media_type="application/json")

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str) -> Response:
        """One model's card (OpenAI's ``models.retrieve``); a name this server does not serve is a 404."""
        if model_id not in state.model_names and model_id not in async_engine.engine.loras:
            raise ModelNotFound(f"the model '{model_id}' does not exist; {state.serves}")
        return Response(model_card(model_id).model_dump_json(), media_type="application/json")

    @app.get("/kvserve/info")
    async def replica_info() -> Response:
        """What a gateway (``kvserve route``) reads of a kvserve replica beyond the OpenAI routes."""
        stats = async_engine.stats()
        engine = async_engine.engine
        return JSONResponse({"model": state.model_name, "block_size": engine.config.cache.block_size,
                             "num_kv_blocks": stats.num_kv_blocks, "max_model_len": state.max_model_len,
                             "shared_kv_tier": engine.config.storage.redis_url is not None,
                             "shared_kv_group": engine.shared_kv_group,
                             "kv_events": engine.kv_events is not None,
                             "block_hash_extra": engine.block_hash_extra.hex(),
                             # what each LoRA adapter's requests add to their block hashes (their KV is apart)
                             "lora_cache_keys": {name: a.cache_key.hex() for name, a in engine.loras.items()}})

    @app.get("/kvserve/kv_events")
    async def kv_events(after: int = 0, epoch: str | None = None) -> Response:
        """The device prefix cache's block events after ``after`` (see cache/kv_events.py)."""
        events = async_engine.engine.kv_events
        if events is None:
            return JSONResponse(p.error_body("this server runs without a prefix cache: it has no KV events",
                                             "not_found_error"), status_code=404)
        return JSONResponse(events.read(after, epoch))

    @app.get("/kvserve/audit")
    async def audit() -> Response:
        """The engine's block accounting, checked between two steps: for soak runs and operators."""
        return JSONResponse(asdict(await async_engine.audit()))

    tokenizer_json: list[bytes] = []  # built on the first call: megabytes for a large vocabulary

    @app.get("/kvserve/tokenizer")
    async def tokenizer_description() -> Response:
        """The tokenizer, chat template and the template variables this server defaults, so that a gateway
        renders and tokenizes prompts as this server does."""
        if not tokenizer_json:
            description = {**tokenizer.describe(), "default_chat_template_kwargs": state.default_template_variables}
            tokenizer_json.append(json.dumps(description).encode())
        return Response(tokenizer_json[0], media_type="application/json")

    started_at = time.time()

    async def live_stats() -> dict[str, Any]:
        return stats_snapshot(async_engine.stats(), async_engine.is_alive, state.recent, state.model_name, started_at)

    async def trip(request_id: str) -> dict[str, Any] | None:
        return state.recent.trip(request_id)

    add_dashboard_routes(app, live_stats, trip)

    @app.get("/health")
    async def health() -> Response:
        if not async_engine.is_alive:
            return JSONResponse({"status": "dead", "error": f"the engine loop has stopped: {async_engine.dead!r}"},
                                status_code=503)
        if state.draining:
            return JSONResponse({"status": "draining"}, status_code=503)
        return JSONResponse({"status": "ok"})

    @app.get("/metrics")
    async def metrics() -> Response:
        content, content_type = state.metrics.render()
        return Response(content, media_type=content_type)

    return app
