"""OpenAI-compatible request schemas (pydantic v2), their mapping to SamplingParams, and error bodies (the
response bodies are in response_models.py).

Requests are validated strictly (``"max_tokens": "5"`` or ``"n": true`` is a 400, not a coercion) and
unknown fields are ignored, as OpenAI and vLLM do. Ranges are not checked here: ``SamplingParams``
owns them and raises ``InvalidSamplingParams`` naming the parameter.
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Sequence
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from kvserve.errors import InvalidRequest, InvalidSamplingParams
from kvserve.reasoning import template_message
from kvserve.sampling_params import SamplingParams, StructuredOutputsParams
from kvserve.serving_config import RESERVED_TEMPLATE_NAMES
from kvserve.tokenizer import message_text

DEFAULT_TEMPERATURE = 1.0  # OpenAI's and vLLM's default
MAX_N = 128  # OpenAI's limit on choices per request
MAX_STOP_STRINGS = 64  # every stop string is searched for after every generated token


def rename_param(exc: InvalidRequest, old: str, new: str) -> InvalidRequest:
    """The same error, naming the field the client sent (``max_completion_tokens``) instead of the engine's."""
    if exc.param != old or old == new:
        return exc
    renamed = copy.copy(exc)
    renamed.args = (str(exc).replace(old, new, 1),)
    renamed.param = new
    return renamed


_SURROGATE_MESSAGE = "contains an unpaired UTF-16 surrogate (\\ud800-\\udfff), which is not valid text"
MAX_JSON_DEPTH = 100  # lists and objects within each other; deeper values are refused, never walked recursively


def _check_text(value: Any) -> None:
    """ValueError if a string anywhere in a parsed JSON value holds an unpaired UTF-16 surrogate (JSON's
    "\ud800" escape decodes to one: it is not Unicode text, and neither the tokenizer nor UTF-8 takes it), or
    if the value nests deeper than MAX_JSON_DEPTH (what walks it later, a schema compiler or a template, may
    recurse). Walked with a stack of its own: a recursive walk would fail on the depth it is checking."""
    stack: list[tuple[Any, int]] = [(value, 0)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, str):
            try:
                item.encode("utf-8")
            except UnicodeEncodeError:
                raise ValueError(_SURROGATE_MESSAGE) from None
        elif isinstance(item, list | dict):
            if depth >= MAX_JSON_DEPTH:
                raise ValueError(f"nests lists and objects more than {MAX_JSON_DEPTH} deep")
            children = [*item.keys(), *item.values()] if isinstance(item, dict) else item
            stack.extend((child, depth + 1) for child in children)


class _Strict(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)


class StrictTextModel(_Strict):
    """A request whose every string must be Unicode text."""

    @field_validator("*", mode="before")
    @classmethod
    def _valid_unicode(cls, value: Any) -> Any:
        _check_text(value)
        return value


class StreamOptions(_Strict):
    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM's: with include_usage, every chunk carries the usage so far


class ContentPart(BaseModel):
    """One part of a message's content; only text parts are rendered (the tokenizer rejects others)."""

    model_config = ConfigDict(extra="allow", strict=True)
    type: str
    text: str | None = None


class ChatMessage(BaseModel):
    # Extra keys (tool_calls, tool_call_id, ...) are passed through to the chat template.
    model_config = ConfigDict(extra="allow", strict=True)
    role: str
    content: str | list[ContentPart] | None = None
    name: str | None = None


class _SamplingRequest(StrictTextModel):
    """Fields common to chat and completions."""

    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    n: int = 1
    stop: str | list[str] | None = None
    seed: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    logit_bias: dict[str, float] | None = None  # token id (as a string, as OpenAI sends it) -> bias
    # Extensions (vLLM spells them the same way).
    ignore_eos: bool = False
    min_tokens: int = 0
    repetition_penalty: float | None = None
    stop_token_ids: list[int] | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    # Each prompt token's logprob given the ones before it, with this many of the most likely tokens there
    # (vLLM's extension: in each completion choice, or once in a chat response). Not with stream.
    prompt_logprobs: int | None = None
    return_timings: bool = False  # kvserve: a per-request trip through the pipeline (also X-KVServe-Timings: 1)
    return_tokens_as_token_ids: bool = False  # vLLM's: logprob entries name their tokens "token_id:<id>"
    # Structured output: OpenAI's response_format, and vLLM's spellings (one of them per request).
    response_format: dict[str, Any] | None = None
    structured_outputs: dict[str, Any] | None = None
    guided_json: str | dict[str, Any] | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    # vLLM's token restrictions: only these tokens may be sampled; these words never appear in the output.
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    # vLLM's: keep only the prompt's last this many tokens (-1: as many as the context holds).
    truncate_prompt_tokens: int | None = None
    # vLLM's: requests sharing a salt share cached KV with each other only (tenants that must not learn from
    # each other's cache hits, by timing, send different salts).
    cache_salt: str | None = None
    # Where the request queues under --scheduling-policy priority (lower first); other policies refuse other
    # values than 0 (vLLM's too).
    priority: int = 0
    # vLLM's: a reasoning model thinks at most this many tokens, then its end marker is forced and it answers.
    thinking_token_budget: int | None = None
    # Declared to be refused (vLLM's engine refuses them too): ignored, they would give the client one ordinary
    # sample where it asked for the best of several, or a beam.
    best_of: int | None = None
    use_beam_search: bool = False

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    @property
    def continuous_usage(self) -> bool:
        return self.include_usage and self.stream_options is not None and self.stream_options.continuous_usage_stats

    def _params(self, max_tokens: int | None, max_tokens_field: str, logprobs: int | None,
                logprobs_field: str) -> SamplingParams:
        def opt(value: Any, default: Any) -> Any:
            return default if value is None else value

        if self.stream_options is not None and not self.stream:
            raise InvalidRequest("stream_options is only allowed when stream is true", param="stream_options")
        if self.prompt_logprobs is not None and self.stream:
            raise InvalidRequest("prompt_logprobs is not available with stream: send the request unstreamed",
                                 param="prompt_logprobs")
        if self.n > MAX_N:
            raise InvalidSamplingParams(f"n must be <= {MAX_N}, got {self.n}", param="n")
        if self.best_of not in (None, 1):
            raise InvalidRequest("best_of is not supported: ask for n samples and keep the best yourself",
                                 param="best_of")
        if self.use_beam_search:
            raise InvalidRequest("use_beam_search: beam search is not supported", param="use_beam_search")
        if isinstance(self.stop, list) and len(self.stop) > MAX_STOP_STRINGS:
            raise InvalidSamplingParams(f"stop takes at most {MAX_STOP_STRINGS} strings, got {len(self.stop)}",
                                        param="stop")
        logit_bias: dict[int, float] = {}
        for key, bias in (self.logit_bias or {}).items():
            try:
                logit_bias[int(key)] = bias
            except ValueError:
                raise InvalidSamplingParams(f"logit_bias keys must be token ids, got {key!r}",
                                            param="logit_bias") from None
        try:
            return SamplingParams(
                n=self.n,
                temperature=opt(self.temperature, DEFAULT_TEMPERATURE),
                top_p=opt(self.top_p, 1.0),
                top_k=opt(self.top_k, 0),
                min_p=opt(self.min_p, 0.0),
                repetition_penalty=opt(self.repetition_penalty, 1.0),
                frequency_penalty=opt(self.frequency_penalty, 0.0),
                presence_penalty=opt(self.presence_penalty, 0.0),
                seed=self.seed,
                stop=tuple([self.stop] if isinstance(self.stop, str) else self.stop or ()),
                stop_token_ids=tuple(self.stop_token_ids or ()),
                max_tokens=max_tokens,  # None: the rest of the context
                min_tokens=self.min_tokens,
                ignore_eos=self.ignore_eos,
                logprobs=logprobs,
                prompt_logprobs=self.prompt_logprobs,
                include_stop_str_in_output=self.include_stop_str_in_output,
                skip_special_tokens=self.skip_special_tokens,
                logit_bias=logit_bias,
                allowed_token_ids=None if self.allowed_token_ids is None else tuple(self.allowed_token_ids),
                bad_words=tuple(self.bad_words or ()),
                truncate_prompt_tokens=self.truncate_prompt_tokens,
                cache_salt=self.cache_salt,
                priority=self.priority,
                thinking_token_budget=self.thinking_token_budget,
                structured_outputs=self.structured_outputs_params(),
            )
        except InvalidSamplingParams as exc:
            # Report the field the client actually sent, not the engine's name for it.
            exc = rename_param(exc, "max_tokens", max_tokens_field)
            raise rename_param(exc, "logprobs", logprobs_field) from None

    def structured_outputs_params(self) -> StructuredOutputsParams | None:
        """The request's output constraint, from whichever field it came in (at most one may be set)."""
        given: list[tuple[str, StructuredOutputsParams]] = []
        kind = (self.response_format or {}).get("type", "text")
        if kind != "text":
            given.append(("response_format", _response_format(self.response_format or {})))
        if self.structured_outputs is not None:
            fields = {k: v for k, v in self.structured_outputs.items() if v is not None}
            unknown = sorted(set(fields) - {"json", "regex", "choice", "grammar", "json_object"})
            if unknown:
                raise InvalidRequest(f"structured_outputs: unknown field {unknown[0]!r}; kvserve takes json, regex, "
                                     "choice, grammar and json_object", param="structured_outputs")
            given.append(("structured_outputs", StructuredOutputsParams(**fields, param="structured_outputs")))
        for name, key in (("guided_json", "json"), ("guided_regex", "regex"), ("guided_choice", "choice"),
                          ("guided_grammar", "grammar")):
            value = getattr(self, name)
            if value is not None:
                given.append((name, StructuredOutputsParams(**{key: value}, param=name)))  # type: ignore[arg-type]
        if len(given) > 1:
            raise InvalidRequest(f"{given[0][0]} and {given[1][0]} both constrain the output; send one of them",
                                 param=given[1][0])
        return given[0][1] if given else None


def _response_format(value: dict[str, Any]) -> StructuredOutputsParams:
    kind = value.get("type")
    if kind == "json_object":
        return StructuredOutputsParams(json_object=True, param="response_format")
    if kind != "json_schema":
        raise InvalidRequest(f"response_format type must be 'text', 'json_object' or 'json_schema', got {kind!r}",
                             param="response_format")
    spec = value.get("json_schema")
    if not isinstance(spec, dict) or not isinstance(spec.get("name"), str) or not spec["name"]:
        raise InvalidRequest("response_format.json_schema must be an object with a 'name' (and a 'schema')",
                             param="response_format.json_schema")
    strict = spec.get("strict")
    if strict is not None and not isinstance(strict, bool):
        raise InvalidRequest("response_format.json_schema.strict must be a boolean", param="response_format")
    schema = spec.get("schema")
    if schema is None:  # OpenAI's default: any JSON object
        return StructuredOutputsParams(json_object=True, param="response_format")
    # strict or not, the schema is enforced: every token is checked against it.
    return StructuredOutputsParams(json=schema, param="response_format.json_schema.schema")


class FunctionDefinition(_Strict):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ToolDefinition(_Strict):
    type: str = "function"
    function: FunctionDefinition


class ChatCompletionRequest(_SamplingRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list[ToolDefinition] | None = None
    tool_choice: str | dict[str, Any] | None = None  # none | auto | required | {"type": "function", ...}
    parallel_tool_calls: bool = True
    # OpenAI's deprecated spelling of tools: refused by name rather than ignored (the model would see no tools).
    functions: list[Any] | None = None
    function_call: str | dict[str, Any] | None = None
    # vLLM's template controls: with continue_final_message (and add_generation_prompt false) the final
    # message is continued rather than answered: a reply prefilled with its first words. echo puts that
    # message's text before the reply's content where the reply is of its role (as vLLM: without a generation
    # prompt the reply continues the final message; with one, the reply is the assistant's).
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    echo: bool = False
    # vLLM's: more variables for the chat template (``{"enable_thinking": false}``), and documents for
    # templates that lay them out (retrieval). A template of the request's own is refused, as vLLM refuses it
    # unless told to trust requests' templates: the model's template renders every conversation.
    chat_template_kwargs: dict[str, Any] | None = None
    documents: list[dict[str, Any]] | None = None
    chat_template: str | None = None
    # vLLM's: false leaves a reasoning model's thoughts out of the reply (they are still generated).
    include_reasoning: bool = True

    @property
    def reply_role(self) -> str:
        """The reply's role: the assistant's after a generation prompt; without one the reply continues the
        final message, and is of its role (as vLLM)."""
        return "assistant" if self.add_generation_prompt else self.messages[-1].role

    @property
    def echoed_text(self) -> str:
        """What the reply's content starts with: with echo, the final message's text where the reply is of its role."""
        final = self.messages[-1]
        if not self.echo or final.role != self.reply_role:
            return ""
        return message_text(final.model_dump(exclude_none=True))

    @property
    def max_tokens_field(self) -> str:
        """The field the output limit came from (``max_completion_tokens`` wins over ``max_tokens``)."""
        return "max_completion_tokens" if self.max_completion_tokens is not None else "max_tokens"

    def sampling_params(self) -> SamplingParams:
        for legacy in ("functions", "function_call"):
            if getattr(self, legacy) is not None:
                raise InvalidRequest(f"{legacy} is OpenAI's deprecated form of tools; send tools and tool_choice",
                                     param=legacy)
        if self.top_logprobs is not None and not self.logprobs:
            raise InvalidRequest("top_logprobs requires logprobs to be true", param="top_logprobs")
        max_tokens = self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens
        logprobs = (self.top_logprobs or 0) if self.logprobs else None
        return self._params(max_tokens, self.max_tokens_field, logprobs, "top_logprobs")

    def message_dicts(self) -> list[dict[str, Any]]:
        """The messages as the chat template reads them. An earlier reply's thoughts come back as
        ``reasoning_content`` (the name reasoning models' templates read), whichever name the client sent."""
        return [template_message(m.model_dump(exclude_none=True)) for m in self.messages]

    def template_variables(self) -> dict[str, Any]:
        """What the chat template gets beside the messages and tools: ``documents`` and ``chat_template_kwargs``."""
        if self.chat_template is not None:
            raise InvalidRequest("chat_template: a request's own template is not accepted; the model's template "
                                 "renders the messages", param="chat_template")
        reserved = sorted(set(self.chat_template_kwargs or {}) & RESERVED_TEMPLATE_NAMES)
        if reserved:
            raise InvalidRequest(f"chat_template_kwargs: {reserved[0]!r} is set by the request itself, not passed to "
                                 "the template", param="chat_template_kwargs")
        return {**(self.chat_template_kwargs or {}), "documents": self.documents}


PromptInput = str | list[int]


def _as_prompts(value: Any) -> list[PromptInput]:
    """A checked prompt value (``_prompt_value``) as a list of prompts: a string, or token ids, each."""
    if isinstance(value, str) or all(isinstance(t, int) for t in value):
        return [value]
    return list(value)


def _prompt_value(value: Any, name: str) -> Any:
    """A prompt as the completions and embeddings routes take it: str | list[str] | list[int] | list[list[int]]."""
    def is_ids(v: Any) -> bool:
        return isinstance(v, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in v)

    _check_text(value)  # a plain validator: the model's before-validators do not run here
    if isinstance(value, str):
        return value
    if isinstance(value, list) and value:
        if all(isinstance(p, str) for p in value) or is_ids(value):
            return value
        if all(is_ids(p) for p in value):
            return value
    raise ValueError(
        f"{name} must be a string, a non-empty list of strings, a list of token ids or a list of token-id lists"
    )


class CompletionRequest(_SamplingRequest):
    # str | list[str] | list[int] | list[list[int]]; checked by hand for an error message that says so.
    prompt: Any
    max_tokens: int | None = 16  # OpenAI's and vLLM's default for completions; null: the rest of the context
    logprobs: int | None = None
    # The prompt before the completion in each choice's text and, with logprobs, its tokens' logprobs first
    # (the first token's None): what evaluation harnesses read a prompt's likelihood from.
    echo: bool = False
    # Fill in the middle: the completion is what goes between the prompt and this text (code models with FIM
    # tokens; kvserve/infill.py).
    suffix: str | None = None

    @field_validator("prompt", mode="plain")
    @classmethod
    def _check_prompt(cls, value: Any) -> Any:
        return _prompt_value(value, "prompt")

    def prompts(self) -> list[PromptInput]:
        """The prompt as a list of prompts (a string, or a list of token ids, each)."""
        prompts = _as_prompts(self.prompt)
        if self.suffix is not None:
            if self.echo:
                raise InvalidRequest("echo and suffix cannot be used together", param="echo")
            if not all(isinstance(prompt, str) for prompt in prompts):
                raise InvalidRequest("suffix takes a text prompt, not token ids: the gap is laid out from text",
                                     param="suffix")
            if self.truncate_prompt_tokens is not None:  # the cut would take the gap's opening token with it
                raise InvalidRequest("truncate_prompt_tokens and suffix cannot be used together",
                                     param="truncate_prompt_tokens")
        return prompts

    def sampling_params(self) -> SamplingParams:
        params = self._params(self.max_tokens, "max_tokens", self.logprobs, "logprobs")
        if self.echo and self.logprobs is not None:  # the echoed prompt's logprobs come from the same entries
            params = dataclasses.replace(params, prompt_logprobs=max(self.logprobs, self.prompt_logprobs or 0))
        return params


class EmbeddingRequest(_Strict):
    """OpenAI's embeddings request. The vector is the model's final-norm hidden state at the input's last
    token (last-token pooling), L2-normalised: the only pooling a causal language model gives directly."""

    model: str | None = None
    input: Any  # str | list[str] | list[int] | list[list[int]], checked as completions' prompt is
    encoding_format: Literal["float", "base64"] = "float"  # base64: little-endian float32 (the openai client's)
    dimensions: int | None = None
    user: str | None = None
    truncate_prompt_tokens: int | None = None  # vLLM's: embed only each input's last this many tokens
    cache_salt: str | None = None  # vLLM's: the inputs' KV is shared only with requests of the same salt
    priority: int = 0  # vLLM's: the inputs' place in the queue under --scheduling-policy priority

    @field_validator("input", mode="plain")
    @classmethod
    def _check_input(cls, value: Any) -> Any:
        return _prompt_value(value, "input")

    @field_validator("dimensions", mode="after")
    @classmethod
    def _no_dimensions(cls, value: int | None) -> int | None:
        if value is not None:
            raise ValueError("dimensions is not supported: the vectors have the model's hidden size")
        return value

    def inputs(self) -> list[PromptInput]:
        return _as_prompts(self.input)


class TokenizeRequest(StrictTextModel):
    """vLLM's /tokenize: either a ``prompt``, tokenized as /v1/completions tokenizes it (special tokens added
    unless ``add_special_tokens`` is false), or ``messages``, rendered by the chat template as
    /v1/chat/completions renders them, ``tools`` included (no special tokens added unless asked: the template
    holds them)."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = Field(default=None, min_length=1)
    tools: list[ToolDefinition] | None = None
    tool_choice: str | dict[str, Any] | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    documents: list[dict[str, Any]] | None = None
    chat_template: str | None = None
    add_special_tokens: bool | None = None
    return_token_strs: bool = False

    def chat_request(self) -> ChatCompletionRequest:
        """The messages, tools and template controls as the chat route takes them."""
        return ChatCompletionRequest(messages=self.messages or [], tools=self.tools, tool_choice=self.tool_choice,
                                     add_generation_prompt=self.add_generation_prompt,
                                     continue_final_message=self.continue_final_message,
                                     chat_template_kwargs=self.chat_template_kwargs, documents=self.documents,
                                     chat_template=self.chat_template)


class DetokenizeRequest(_Strict):
    """vLLM's /detokenize: token ids back to text, special tokens kept."""

    model: str | None = None
    tokens: list[int]


# ---------------------------------------------------------------------------------------------------------
# Errors
# ---------------------------------------------------------------------------------------------------------
def error_body(message: str, error_type: str, param: str | None = None, code: str | None = None) -> dict[str, Any]:
    """OpenAI's error shape: ``{"error": {"message", "type", "param", "code"}}``."""
    return {"error": {"message": message, "type": error_type, "param": param, "code": code}}


def validation_error_body(errors: Sequence[Any]) -> dict[str, Any]:
    """A 400 body from FastAPI's RequestValidationError: the first error, naming its field."""
    if not errors:
        return error_body("invalid request body", "invalid_request_error")
    first = errors[0]
    loc = [p for p in first.get("loc", ()) if p != "body"]
    if first.get("type") == "json_invalid":
        ctx = first.get("ctx") or {}
        detail = ctx.get("error") or first.get("msg", "")
        return error_body(f"the request body is not valid JSON: {detail}", "invalid_request_error",
                          code="invalid_json")
    param = _field_path(loc) or None
    msg = first.get("msg", "invalid value")
    if msg.startswith("Value error, "):
        msg = msg[len("Value error, "):]
    if param is None:
        message = f"invalid request body: {msg}"
    else:
        message = f"invalid value for '{param}': {msg}"
        if first.get("type") == "missing":
            message = f"'{param}' is required"
    more = len(errors) - 1
    if more:
        message += f" (and {more} more error{'s' if more > 1 else ''})"
    return error_body(message, "invalid_request_error", param=param, code="invalid_value")


def _field_path(loc: Sequence[Any]) -> str:
    """('messages', 0, 'content') -> 'messages[0].content'; union branch names (str, list[...]) dropped."""
    path = ""
    for part in loc:
        if isinstance(part, int):
            path += f"[{part}]"
        elif isinstance(part, str) and not _is_type_tag(part):
            path += f".{part}" if path else part
    return path


def _is_type_tag(part: str) -> bool:
    # pydantic names union branches in loc: 'str', 'list[str]', 'function-plain[...]', 'ContentPart', ...
    return part in ("str", "int", "float", "bool") or "[" in part or part[:1].isupper()
