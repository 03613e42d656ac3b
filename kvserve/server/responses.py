"""OpenAI response bodies built from a RequestRun's outputs: one JSON body, or the chunks of an SSE stream.

Logprobs are rendered here too (chat: ``content`` entries with bytes; completions: parallel lists with
text offsets); the engine's ``-inf`` becomes ``MIN_LOGPROB`` because JSON has no infinity.
"""

from __future__ import annotations

import json
import logging
import math
from collections.abc import AsyncIterator, Iterable
from typing import Any

from kvserve.errors import KVServeError
from kvserve.reasoning import (
    AnswerTokens,
    Phase,
    ReasoningMarkers,
    ReasoningSplitter,
    ReasoningTokens,
    split_reasoning,
)
from kvserve.request import RequestOutput
from kvserve.server import protocol as p
from kvserve.server import response_models as rm
from kvserve.server.metrics import ServerMetrics
from kvserve.server.request_run import EngineRequest, RequestRun
from kvserve.structured.tool_calls import ToolCallFormat, ToolCallParser
from kvserve.tokenizer import Tokenizer

logger = logging.getLogger(__name__)

MIN_LOGPROB = -9999.0  # JSON has no -inf


class ResponseBuilder:
    """Turns the outputs of a RequestRun into OpenAI chat or completion bodies.

    Keeps each token's text and bytes once decoded: logprobs name the same tokens over and over.
    """

    def __init__(self, tokenizer: Tokenizer, metrics: ServerMetrics,
                 reasoning_markers: ReasoningMarkers | None = None,
                 reasoning_tokens: ReasoningTokens | None = None) -> None:
        self.tokenizer = tokenizer
        self.metrics = metrics
        self.reasoning_markers = reasoning_markers  # a reasoning model's: chat replies part thoughts from answer
        self.reasoning_tokens = reasoning_tokens  # the same markers' tokens: which tokens are thoughts
        self._token_text: dict[int, str] = {}
        self._token_bytes: dict[int, list[int]] = {}

    def token_text(self, token_id: int) -> str:
        text = self._token_text.get(token_id)
        if text is None:
            text = self._token_text[token_id] = self.tokenizer.decode([token_id], skip_special_tokens=False)
        return text

    def token_bytes(self, token_id: int) -> list[int]:
        """The token's own bytes; for part of a character, not the U+FFFD its text decodes to alone."""
        data = self._token_bytes.get(token_id)
        if data is None:
            data = self._token_bytes[token_id] = list(self.tokenizer.token_bytes(token_id))
        return data

    # --- one JSON body ----------------------------------------------------------------------------------
    def full_response(self, run: RequestRun, body: Any, chat: bool, head: dict[str, Any],
                      tool_format: ToolCallFormat | None = None, reasoning: Phase | None = None) -> rm.OpenAIResponse:
        """``reasoning``: where the prompt leaves a reasoning model's output (None: no thoughts to part)."""
        usage = self._with_reasoning_tokens(run.usage(), run, reasoning)
        if chat:
            echoed = body.echoed_text
            choices = []
            for c in run.children:
                assert c.last is not None
                completion = c.last.outputs[0]
                logprobs = self._chat_logprobs(c, 0, len(completion.token_ids), body.top_logprobs or 0,
                                               body.return_tokens_as_token_ids)
                thoughts, text = None, completion.text
                if reasoning is not None and self.reasoning_markers is not None:
                    thoughts, text = split_reasoning(text, self.reasoning_markers, reasoning)
                message = rm.ChatMessageOut(content=None if thoughts is not None and not text else text)
                finish_reason = completion.finish_reason
                if tool_format is not None:
                    message, finish_reason = _with_tool_calls(tool_format, text, finish_reason, _named_tool(body))
                if thoughts is not None:
                    message.content = message.content or None  # a reply that ended in its thoughts: no answer
                    if body.include_reasoning:
                        message.reasoning = message.reasoning_content = thoughts
                    elif logprobs is not None:  # the thoughts left out: their tokens' logprobs too
                        logprobs.content = logprobs.content[c.num_thought_tokens:]
                message.role = body.reply_role
                if echoed and (message.content is not None or thoughts is not None):
                    message.content = echoed + (message.content or "")
                choices.append(rm.ChatChoice(index=c.index, message=message, logprobs=logprobs,
                                            finish_reason=finish_reason, stop_reason=completion.stop_reason))
            return rm.ChatCompletionResponse(**head, choices=choices, usage=usage,
                                            prompt_logprobs=self._prompt_logprobs(run.children[0], body))
        completion_choices = []
        for c in run.children:
            assert c.last is not None
            completion = c.last.outputs[0]
            echo, echo_logprobs = self._echo(c, body)
            logprobs = self._completion_logprobs(c, 0, len(completion.token_ids), body.logprobs, len(echo),
                                                 body.return_tokens_as_token_ids)
            completion_choices.append(rm.CompletionChoice(index=c.index, text=echo + completion.text,
                                                         logprobs=_joined(echo_logprobs, logprobs),
                                                         finish_reason=completion.finish_reason,
                                                         stop_reason=completion.stop_reason,
                                                         prompt_logprobs=self._prompt_logprobs(c, body)))
        return rm.CompletionResponse(**head, choices=completion_choices, usage=usage)

    # --- an SSE stream ----------------------------------------------------------------------------------
    async def stream(self, run: RequestRun, body: Any, chat: bool, head: dict[str, Any],
                     want_timings: bool, tool_format: ToolCallFormat | None = None,
                     reasoning: Phase | None = None) -> AsyncIterator[str]:
        chunk_type = rm.ChatCompletionChunk if chat else rm.CompletionResponse
        for child in run.children:
            if tool_format is not None:
                child.tool_parser = tool_format.parser()
            if reasoning is not None and self.reasoning_markers is not None:
                child.reasoning_splitter = ReasoningSplitter(self.reasoning_markers, reasoning)
                if chat and not body.include_reasoning and child.params.logprobs is not None \
                        and self.reasoning_tokens is not None:
                    child.answer_logprobs = AnswerTokens(self.reasoning_tokens, reasoning)
        try:
            try:
                if chat:  # OpenAI opens each choice with the role
                    for c in run.children:
                        opening = rm.DeltaMessage(role=body.reply_role, content=body.echoed_text)
                        role = rm.ChatChunkChoice(index=c.index, delta=opening)
                        usage = run.usage_of(c, sent=False) if body.continuous_usage else None
                        yield _sse(rm.ChatCompletionChunk(**head, choices=[role], usage=usage).to_json())
                while (item := await run.next()) is not None:
                    child, output = item
                    choice = self._chunk_choice(child, output, body, chat)
                    if choice is None:
                        continue
                    chunk = chunk_type(**head, choices=[choice],
                                       usage=run.usage_of(child) if body.continuous_usage else None)
                    if run.exhausted and want_timings and not body.include_usage:
                        chunk.timings = run.timings()
                    yield _sse(chunk.to_json())
                if body.include_usage:
                    chunk = chunk_type(**head, choices=[], usage=self._with_reasoning_tokens(run.usage(), run,
                                                                                             reasoning))
                    if want_timings:
                        chunk.timings = run.timings()
                    yield _sse(chunk.to_json())
            except KVServeError as exc:  # the engine died mid-stream: tell the client, then end the stream
                self.metrics.observe_error(exc.http_status, exc.code)
                yield _sse(_error_json(exc))
            except Exception as exc:  # a fault of this server mid-stream: said as such, never a dropped connection
                logger.exception("stream of %s failed", head.get("id"))
                self.metrics.observe_error(500, "internal_error")
                yield _sse(json.dumps(p.error_body(f"the server failed mid-stream: {exc!r}", "internal_error", None,
                                                   "internal_error")))
            yield "data: [DONE]\n\n"
        finally:
            run.close()

    def _chunk_choice(self, child: EngineRequest, output: RequestOutput, body: Any, chat: bool) -> Any:
        """The streamed choice for one output, or None when it carries nothing (text held back)."""
        completion = output.outputs[0]
        num_tokens = len(completion.token_ids)
        start = num_tokens - len(output.delta_token_ids)
        finish = completion.finish_reason if output.finished else None
        stop_reason = completion.stop_reason if output.finished else None
        if chat:
            logprobs = self._chat_logprobs(child, start, num_tokens, body.top_logprobs or 0,
                                           body.return_tokens_as_token_ids)
            if logprobs is not None and (answer := child.answer_logprobs) is not None:
                entries = [kept for token_id, entry in zip(completion.token_ids[start:], logprobs.content, strict=True)
                           for kept in answer.feed(token_id, entry)]
                entries += answer.finish() if finish is not None else []
                logprobs = rm.ChatLogprobs(content=entries) if entries else None
            text, thoughts = output.delta_text, ""
            if (splitter := child.reasoning_splitter) is not None:
                thoughts, text = splitter.feed(text)
                if finish is not None:
                    more_thoughts, more_text = splitter.finish()
                    thoughts, text = thoughts + more_thoughts, text + more_text
                thoughts = thoughts if body.include_reasoning else ""
            if child.tool_parser is not None:
                delta, finish = _tool_call_delta(child.tool_parser, text, finish, _named_tool(body))
                if thoughts:
                    delta = delta or rm.DeltaMessage()
                    delta.reasoning = delta.reasoning_content = thoughts
                if delta is None and finish is None and logprobs is None:
                    return None
                return rm.ChatChunkChoice(index=child.index, delta=delta or rm.DeltaMessage(), logprobs=logprobs,
                                         finish_reason=finish, stop_reason=stop_reason)
            if not text and not thoughts and finish is None and logprobs is None:
                return None
            delta = rm.DeltaMessage(content=text if text or not thoughts else None,
                                    reasoning=thoughts or None, reasoning_content=thoughts or None)
            return rm.ChatChunkChoice(index=child.index, delta=delta, logprobs=logprobs, finish_reason=finish,
                                     stop_reason=stop_reason)
        echo, echo_logprobs = ("", None) if child.echoed else self._echo(child, body)
        child.echoed = True
        child.next_text_offset += len(echo)
        # Offsets advance by each token's text, as in a whole answer: not by the text sent, which a stop string
        # or a character split across tokens holds back.
        generated = self._completion_logprobs(child, start, num_tokens, body.logprobs, child.next_text_offset,
                                              body.return_tokens_as_token_ids)
        if generated is not None and generated.tokens:
            child.next_text_offset = generated.text_offset[-1] + len(self.token_text(completion.token_ids[num_tokens - 1]))
        logprobs = _joined(echo_logprobs, generated)
        text = echo + output.delta_text
        if not text and finish is None and logprobs is None:
            return None
        return rm.CompletionChoice(index=child.index, text=text, logprobs=logprobs, finish_reason=finish,
                                   stop_reason=stop_reason)

    @staticmethod
    def _with_reasoning_tokens(usage: rm.Usage, run: RequestRun, reasoning: Phase | None) -> rm.Usage:
        """``usage`` with how many of the completion tokens were thoughts (each reply's count, taken when it
        ended), for a reasoning model's reply."""
        if reasoning is not None:
            thought = sum(c.num_thought_tokens for c in run.children)
            usage.completion_tokens_details = rm.CompletionTokensDetails(reasoning_tokens=thought)
        return usage

    def _echo(self, child: EngineRequest, body: Any) -> tuple[str, rm.CompletionLogprobs | None]:
        """A completion's echoed prompt (``echo``): its text, and with logprobs its tokens' (offsets from 0)."""
        if not body.echo:
            return "", None
        text = child.prompt if child.prompt is not None else self.tokenizer.decode(child.prompt_token_ids,
                                                                                   skip_special_tokens=False)
        if child.params.logprobs is None:
            return text, None
        last = (child.first_sample or child).last
        assert last is not None
        entries = last.prompt_logprobs or [None] * len(child.prompt_token_ids)
        return text, self._completion_entries(zip(child.prompt_token_ids, entries, strict=True), body.logprobs, 0,
                                              body.return_tokens_as_token_ids)

    def _prompt_logprobs(self, child: EngineRequest, body: Any) -> rm.PromptLogprobs | None:
        """``prompt_logprobs`` as vLLM renders them: at each prompt position the token there and the
        ``body.prompt_logprobs`` most likely ones, each with its rank (the engine's entries hold the most likely
        tokens in order, then the prompt's own token if it is not among them; that token's rank comes beside)."""
        if body.prompt_logprobs is None:
            return None
        last = (child.first_sample or child).last
        assert last is not None and last.prompt_logprobs is not None and last.prompt_token_ranks is not None
        rendered: rm.PromptLogprobs = []
        for token_id, entry, rank in zip(child.prompt_token_ids, last.prompt_logprobs, last.prompt_token_ranks,
                                         strict=True):
            if entry is None:
                rendered.append(None)
                continue
            top = list(entry.items())[:body.prompt_logprobs]
            ranks = {t: i + 1 for i, (t, _) in enumerate(top)} | {token_id: rank}
            rendered.append({str(t): rm.PromptLogprob(logprob=_finite(entry[t]), rank=r, decoded_token=self.token_text(t))
                             for t, r in ranks.items()})
        return rendered

    # --- logprobs: entries [start, end) of the child's output tokens ---------------------------------------
    def _token_logprobs(self, child: EngineRequest, start: int, end: int) -> list[tuple[int, dict[int, float]]]:
        assert child.last is not None
        completion = child.last.outputs[0]
        entries = completion.logprobs or []
        # The engine appends to ``entries`` as it samples; positions below len(token_ids) are final.
        return [(completion.token_ids[i], entries[i] if i < len(entries) else {}) for i in range(start, end)]

    def token_label(self, token_id: int, as_id: bool) -> str:
        """A logprob entry's token: its text, or ``token_id:<id>`` (vLLM's return_tokens_as_token_ids: the
        token exactly, where texts repeat or a piece of a character decodes to U+FFFD)."""
        return f"token_id:{token_id}" if as_id else self.token_text(token_id)

    def _chat_logprobs(self, child: EngineRequest, start: int, end: int, num_top: int,
                       as_ids: bool = False) -> rm.ChatLogprobs | None:
        if child.params.logprobs is None:
            return None
        content = []
        for token_id, entry in self._token_logprobs(child, start, end):
            text = self.token_label(token_id, as_ids)
            top = [rm.TopLogprob(token=self.token_label(t, as_ids), logprob=_finite(lp), bytes=self.token_bytes(t))
                   for t, lp in list(entry.items())[:num_top]]
            content.append(rm.TokenLogprob(token=text, logprob=_finite(entry.get(token_id, MIN_LOGPROB)),
                                          bytes=self.token_bytes(token_id), top_logprobs=top))
        return rm.ChatLogprobs(content=content)

    def _completion_logprobs(self, child: EngineRequest, start: int, end: int, num_top: int | None,
                             offset: int, as_ids: bool = False) -> rm.CompletionLogprobs | None:
        if child.params.logprobs is None:
            return None
        return self._completion_entries(self._token_logprobs(child, start, end), num_top, offset, as_ids)

    def _completion_entries(self, tokens: Iterable[tuple[int, dict[int, float] | None]], num_top: int | None,
                            offset: int, as_ids: bool = False) -> rm.CompletionLogprobs:
        """Completions' logprobs of these (token id, its entry) pairs, text offsets from ``offset`` (into the
        text, also where the tokens are given as ids); an entry of None (an echoed prompt's first token) has
        none."""
        out = rm.CompletionLogprobs()
        for token_id, entry in tokens:
            out.tokens.append(self.token_label(token_id, as_ids))
            out.token_logprobs.append(None if entry is None else _finite(entry.get(token_id, MIN_LOGPROB)))
            out.top_logprobs.append(None if entry is None else {self.token_label(t, as_ids): _finite(lp)
                                                                for t, lp in list(entry.items())[:num_top or 0]})
            out.text_offset.append(offset)
            offset += len(self.token_text(token_id))
        return out


def _joined(first: rm.CompletionLogprobs | None, then: rm.CompletionLogprobs | None) -> rm.CompletionLogprobs | None:
    """The echoed prompt's logprobs, then the completion's (either may be absent)."""
    if first is None or then is None:
        return then if first is None else first
    return rm.CompletionLogprobs(tokens=first.tokens + then.tokens,
                                token_logprobs=first.token_logprobs + then.token_logprobs,
                                top_logprobs=first.top_logprobs + then.top_logprobs,
                                text_offset=first.text_offset + then.text_offset)


def _named_tool(body: Any) -> bool:
    """Whether the request forced one named function (``tool_choice: {"type": "function", ...}``): its reply
    finishes with ``stop``, as OpenAI's and vLLM's do, not ``tool_calls``."""
    return isinstance(getattr(body, "tool_choice", None), dict)


def _with_tool_calls(tool_format: ToolCallFormat, text: str, finish_reason: str | None,
                     named: bool = False) -> tuple[rm.ChatMessageOut, str | None]:
    """A whole reply read for tool calls: its message, and ``tool_calls`` as the finish reason if it made any
    (unless ``named``). A reply cut off inside a call (max_tokens) is left as text, as vLLM leaves it."""
    parser = tool_format.parser()
    parser.feed(text)
    parser.finish()
    if not parser.calls or parser.incomplete:
        return rm.ChatMessageOut(content=text), finish_reason
    calls = [rm.ToolCallOut(id=c.id, function=rm.FunctionCallOut(name=c.name, arguments=c.arguments))
             for c in parser.calls]
    return (rm.ChatMessageOut(content=parser.content or None, tool_calls=calls),
            "tool_calls" if finish_reason == "stop" and not named else finish_reason)


def _tool_call_delta(parser: ToolCallParser, text: str, finish: str | None,
                     named: bool = False) -> tuple[rm.DeltaMessage | None, str | None]:
    """The streamed delta of ``text`` read for tool calls (None when it holds nothing yet), and the finish
    reason (``tool_calls`` for a reply that made calls, unless ``named``)."""
    delta = parser.feed(text)
    if finish is not None:
        end = parser.finish()
        delta.content += end.content
        if parser.calls and not parser.incomplete and finish == "stop" and not named:
            finish = "tool_calls"
    if not delta:
        return None, finish
    calls = [rm.ToolCallDelta(index=call.index, id=call.id if new else None, type="function" if new else None,
                             function=rm.FunctionCallDelta(name=call.name if new else None, arguments=arguments))
             for call, new, arguments in delta.calls]
    return rm.DeltaMessage(content=delta.content or None, tool_calls=calls or None), finish


def _finite(value: float) -> float:
    return value if math.isfinite(value) else MIN_LOGPROB


def _sse(data: str) -> str:
    return f"data: {data}\n\n"


def _error_json(exc: KVServeError) -> str:
    return json.dumps(p.error_body(str(exc), exc.error_type, getattr(exc, "param", None), exc.code))
