"""OpenAI-compatible response bodies (pydantic v2): what the routes answer, whole or streamed (the requests
are in protocol.py; ResponseBuilder in responses.py fills these in)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, Field, model_serializer


class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0


class CompletionTokensDetails(BaseModel):
    reasoning_tokens: int = 0


class Usage(BaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    prompt_tokens_details: PromptTokensDetails = Field(default_factory=PromptTokensDetails)
    # A reasoning model's: how many of the completion tokens were its thoughts (left out for other models).
    completion_tokens_details: CompletionTokensDetails | None = None

    @model_serializer(mode="wrap")
    def _details_when_any(self, handler: Any) -> dict[str, Any]:
        data = handler(self)
        if data.get("completion_tokens_details") is None:
            data.pop("completion_tokens_details", None)
        return data

    @classmethod
    def of(cls, prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> Usage:
        return cls(
            prompt_tokens=prompt_tokens,
            completion_tokens=completion_tokens,
            total_tokens=prompt_tokens + completion_tokens,
            prompt_tokens_details=PromptTokensDetails(cached_tokens=cached_tokens),
        )


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatLogprobs(BaseModel):
    content: list[TokenLogprob] | None = None


class CompletionLogprobs(BaseModel):
    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)
    text_offset: list[int] = Field(default_factory=list)


class FunctionCallOut(BaseModel):
    name: str
    arguments: str  # JSON text, as OpenAI sends it


class ToolCallOut(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCallOut


class ChatMessageOut(BaseModel):
    role: str = "assistant"
    content: str | None
    tool_calls: list[ToolCallOut] | None = None
    # A reasoning model's thoughts, under both names clients read: vLLM's (reasoning) and DeepSeek's API's, which
    # SGLang and llama.cpp's server also write (reasoning_content).
    reasoning: str | None = None
    reasoning_content: str | None = None

    @model_serializer(mode="wrap")
    def _optional_fields_when_any(self, handler: Any) -> dict[str, Any]:
        data = handler(self)
        for name in ("tool_calls", "reasoning", "reasoning_content"):
            if data.get(name) is None:
                data.pop(name, None)
        return data


class _WithoutNulls(BaseModel):
    """A streamed piece whose unset fields are left out of the JSON, as OpenAI's deltas leave them."""

    @model_serializer(mode="wrap")
    def _without_nulls(self, handler: Any) -> dict[str, Any]:
        return {k: v for k, v in handler(self).items() if v is not None}


class FunctionCallDelta(_WithoutNulls):
    name: str | None = None
    arguments: str | None = None


class ToolCallDelta(_WithoutNulls):
    """A streamed piece of a tool call: index, id, type and name first, then argument fragments."""

    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: FunctionCallDelta


class ChatChoice(BaseModel):
    index: int
    message: ChatMessageOut
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None  # vLLM's: the stop string or stop token id that ended it (EOS: null)


class DeltaMessage(_WithoutNulls):
    role: str | None = None
    content: str | None = None
    reasoning: str | None = None  # a reasoning model's thoughts, under both names (ChatMessageOut)
    reasoning_content: str | None = None
    tool_calls: list[ToolCallDelta] | None = None


class ChatChunkChoice(BaseModel):
    index: int
    delta: DeltaMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class PromptLogprob(BaseModel):
    """One token's entry at a prompt position, as vLLM spells it."""

    logprob: float
    rank: int  # 1: the model's most likely token there
    decoded_token: str


# Per prompt token: its logprob and the most likely tokens' there, keyed by token id; the first token's None.
PromptLogprobs = list[dict[str, PromptLogprob] | None]


def _unset(value: object) -> bool:
    return value is None


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    prompt_logprobs: PromptLogprobs | None = Field(default=None, exclude_if=_unset)


class OpenAIResponse(BaseModel):
    """What every generation route answers with: a whole body or one streamed chunk."""

    id: str
    object: str  # each response type fixes it (a Literal default); declared here to come second in the JSON
    created: int
    model: str
    # Set only when asked for (include_usage / return_timings); left out of the JSON when None.
    usage: Usage | None = None
    timings: dict[str, Any] | None = None

    def to_json(self) -> str:
        exclude = {k for k in ("usage", "timings") if getattr(self, k) is None}
        return self.model_dump_json(exclude=exclude)


class ChatCompletionResponse(OpenAIResponse):
    object: Literal["chat.completion"] = "chat.completion"
    choices: list[ChatChoice]
    prompt_logprobs: PromptLogprobs | None = Field(default=None, exclude_if=_unset)  # the choices share a prompt


class ChatCompletionChunk(OpenAIResponse):
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    choices: list[ChatChunkChoice]


class CompletionResponse(OpenAIResponse):
    object: Literal["text_completion"] = "text_completion"
    choices: list[CompletionChoice]


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "kvserve"
    root: str | None = None
    parent: str | None = None  # a LoRA adapter's base model
    max_model_len: int | None = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]
