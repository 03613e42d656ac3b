"""What a request asks of its output: sampling parameters and the constraints on what it may generate
(vLLM's ``SamplingParams`` and ``StructuredOutputsParams``), each checked where it is made.

No torch here: the scheduler, the server and the offline API build and read them.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field, replace

from kvserve.errors import InvalidRequest, InvalidSamplingParams

MAX_LOGPROBS = 20


MAX_GRAMMAR_CHARS = 1 << 20  # a schema, regex or grammar longer than this is refused before compiling
MAX_CHOICES = 1024


@dataclass(frozen=True, slots=True)
class StructuredOutputsParams:
    """Constrain what a request may generate (vLLM's ``StructuredOutputsParams``). Exactly one of:

    - ``json``: a JSON Schema (JSON text, or a dict that is stored as JSON text in its own key order);
    - ``json_object``: any JSON object;
    - ``regex``: the whole output matches it;
    - ``choice``: the output is one of these strings;
    - ``grammar``: a Lark grammar (llguidance's dialect, which also embeds JSON Schemas with ``%json``) or
      GBNF/EBNF (llama.cpp's ``::=`` form).

    ``param`` names the request field it came from, for error messages; it is not part of its identity.
    """

    json: str | None = None
    json_object: bool = False
    regex: str | None = None
    choice: tuple[str, ...] | None = None
    grammar: str | None = None
    param: str = field(default="structured_outputs", compare=False)

    def __post_init__(self) -> None:
        if self.json is not None and not isinstance(self.json, str):
            object.__setattr__(self, "json", _schema_text(self.json, self.param))
        if self.choice is not None and not isinstance(self.choice, tuple):
            if not isinstance(self.choice, list):  # not a string's characters, nor a number's iteration
                raise InvalidRequest(f"{self.param}: choice must be a list of strings", param=self.param)
            object.__setattr__(self, "choice", tuple(self.choice))
        if not isinstance(self.json_object, bool):
            raise InvalidRequest(f"{self.param}: json_object must be true or false", param=self.param)
        given = [name for name in ("json", "regex", "choice", "grammar") if getattr(self, name) is not None]
        given += ["json_object"] if self.json_object else []
        if len(given) != 1:
            raise InvalidRequest(f"{self.param} takes exactly one of json, json_object, regex, choice and grammar; "
                                 f"got {', '.join(given) or 'none'}", param=self.param)
        for name in ("json", "regex", "grammar"):
            value = getattr(self, name)
            if value is None:
                continue
            if not isinstance(value, str) or not value.strip():
                raise InvalidRequest(f"{self.param}: {name} must be a non-empty string", param=self.param)
            if len(value) > MAX_GRAMMAR_CHARS:
                raise InvalidRequest(f"{self.param}: {name} has {len(value)} characters, more than the "
                                     f"{MAX_GRAMMAR_CHARS} kvserve compiles", param=self.param)
        if self.choice is not None:
            if not self.choice or len(self.choice) > MAX_CHOICES:
                raise InvalidRequest(f"{self.param}: choice takes 1 to {MAX_CHOICES} strings", param=self.param)
            if any(not isinstance(c, str) or not c for c in self.choice):
                raise InvalidRequest(f"{self.param}: every choice must be a non-empty string", param=self.param)

    @property
    def kind(self) -> str:
        """Which constraint this is: json, json_object, regex, choice or grammar."""
        if self.json_object:
            return "json_object"
        return next(name for name in ("json", "regex", "choice", "grammar") if getattr(self, name) is not None)


def _schema_text(schema: object, param: str) -> str:
    if not isinstance(schema, dict):
        raise InvalidRequest(f"{param}: a JSON schema must be an object, got {type(schema).__name__}", param=param)
    try:
        return json.dumps(schema, ensure_ascii=False)
    except (TypeError, ValueError, RecursionError) as exc:
        raise InvalidRequest(f"{param}: the JSON schema cannot be written as JSON: {exc}", param=param) from None


GREEDY_TEMPERATURE = 1e-5  # temperatures below this sample greedily
MAX_LOGIT_BIAS = 100.0  # OpenAI's range for a logit_bias value: [-100, 100]
MAX_LOGIT_BIAS_TOKENS = 1024
# Every stop string's possible start is searched for after each token, and each token checked against the
# stop ids: bounded, so that one request cannot stall a step for the rest of the batch.
MAX_STOP_STRING_CHARS = 1024
MAX_STOP_TOKEN_IDS = 1024
# Every bad word is matched against the output's end before each token, and tokenized when the request comes:
# bounded as stop strings are.
MAX_BAD_WORDS = 1024
MAX_BAD_WORDS_CHARS = 65536
MAX_ALLOWED_TOKEN_IDS = 262144  # the largest vocabulary served (Gemma 3's): a list past it repeats ids


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """How to pick the next token. Defaults follow vLLM's; invalid values raise InvalidSamplingParams."""

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: disabled
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    max_tokens: int | None = 16  # None: up to the context limit
    min_tokens: int = 0
    ignore_eos: bool = False
    logprobs: int | None = None  # number of top logprobs to return besides the sampled token's
    # The prompt's tokens' logprobs, each given the ones before it, with this many top logprobs beside (vLLM's
    # prompt_logprobs; the first token has none). The request then takes nothing from the prefix cache.
    prompt_logprobs: int | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    # Added to the logits before sampling (OpenAI's logit_bias): (token id, bias) pairs; a dict is accepted.
    logit_bias: tuple[tuple[int, float], ...] = ()
    # Only these tokens may be sampled (vLLM's allowed_token_ids); None: every token.
    allowed_token_ids: tuple[int, ...] | None = None
    # Words the output must not contain (vLLM's bad_words): a word's last token is refused wherever the output
    # ends with the tokens before it. ``bad_words_token_ids`` holds each word's tokens, as the input processor
    # tokenizes it (alone, and after a space, where that is other tokens); the sampler reads only those.
    bad_words: tuple[str, ...] = ()
    bad_words_token_ids: tuple[tuple[int, ...], ...] = ()
    # The request shares cached KV (every tier's, the draft model's too) only with requests of the same salt
    # (vLLM's cache_salt); None: with every request without one.
    cache_salt: str | None = None
    # Keep only the prompt's last this many tokens (vLLM's truncate_prompt_tokens); -1: as many as fit the context
    # with max_tokens after them (at least one); None: the whole prompt.
    truncate_prompt_tokens: int | None = None
    # Where the request queues under the priority scheduling policy (vLLM's priority): lower values are
    # admitted first and preempted last; every other policy takes only 0.
    priority: int = 0
    # The LoRA adapter to run with, by the name it was loaded under (vLLM's LoRARequest.lora_name); None: the
    # base model. Its KV is shared only with requests of the same adapter.
    lora_name: str | None = None
    # What the output must match (a JSON Schema, a regex, a grammar, ...); None: free text. A reasoning model's
    # answer matches it, after its thoughts.
    structured_outputs: StructuredOutputsParams | None = None
    # A reasoning model's thoughts take at most this many tokens; then the end marker is forced and the answer
    # follows (vLLM's thinking_token_budget); None: no limit.
    thinking_token_budget: int | None = None
    # Where the prompt leaves a reasoning model's reply (kvserve.reasoning.Phase's values: "thinking", "answer",
    # "open"), as the chat route reads it from what the generation prompt adds; None: from the prompt's last
    # markers, as written.
    reasoning_phase: str | None = None
    # Also return the model's final-norm hidden state at the prompt's last token (/v1/embeddings).
    return_hidden_state: bool = False

    def __post_init__(self) -> None:
        # Accept lists from callers; store tuples so the dataclass stays hashable and immutable.
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        elif not isinstance(self.stop, tuple):
            object.__setattr__(self, "stop", tuple(self.stop or ()))
        if not isinstance(self.stop_token_ids, tuple):
            object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids or ()))
        if isinstance(self.logit_bias, dict):
            object.__setattr__(self, "logit_bias", tuple(self.logit_bias.items()))
        elif not isinstance(self.logit_bias, tuple):
            object.__setattr__(self, "logit_bias", tuple(self.logit_bias or ()))
        if self.allowed_token_ids is not None and not isinstance(self.allowed_token_ids, tuple):
            object.__setattr__(self, "allowed_token_ids", tuple(self.allowed_token_ids))
        if isinstance(self.bad_words, str):
            object.__setattr__(self, "bad_words", (self.bad_words,))
        elif not isinstance(self.bad_words, tuple):
            object.__setattr__(self, "bad_words", tuple(self.bad_words or ()))
        if not isinstance(self.bad_words_token_ids, tuple):
            object.__setattr__(self, "bad_words_token_ids", tuple(tuple(w) for w in self.bad_words_token_ids))
        self._validate()

    def _validate(self) -> None:
        def bad(param: str, why: str) -> InvalidSamplingParams:
            return InvalidSamplingParams(f"{param} {why}, got {getattr(self, param)!r}", param=param)

        if not isinstance(self.n, int) or self.n < 1:
            raise bad("n", "must be an integer >= 1")
        if not _finite(self.temperature) or self.temperature < 0:
            raise bad("temperature", "must be a finite number >= 0")
        if not _finite(self.top_p) or not 0 < self.top_p <= 1:
            raise bad("top_p", "must be in (0, 1]")
        if not isinstance(self.top_k, int) or self.top_k < -1:
            raise bad("top_k", "must be -1 or 0 (disabled) or a positive integer")
        if not _finite(self.min_p) or not 0 <= self.min_p <= 1:
            raise bad("min_p", "must be in [0, 1]")
        if not _finite(self.repetition_penalty) or self.repetition_penalty <= 0:
            raise bad("repetition_penalty", "must be a finite number > 0")
        for name in ("frequency_penalty", "presence_penalty"):
            value = getattr(self, name)
            if not _finite(value) or not -2 <= value <= 2:
                raise bad(name, "must be in [-2, 2]")
        if self.seed is not None and not isinstance(self.seed, int):
            raise bad("seed", "must be an integer")
        if self.max_tokens is not None and (not isinstance(self.max_tokens, int) or self.max_tokens < 1):
            raise bad("max_tokens", "must be an integer >= 1")
        if not isinstance(self.min_tokens, int) or self.min_tokens < 0:
            raise bad("min_tokens", "must be an integer >= 0")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise bad("min_tokens", f"must be <= max_tokens ({self.max_tokens})")
        if self.logprobs is not None and (not isinstance(self.logprobs, int) or not 0 <= self.logprobs <= MAX_LOGPROBS):
            raise bad("logprobs", f"must be an integer in [0, {MAX_LOGPROBS}]")
        if self.prompt_logprobs is not None and (not isinstance(self.prompt_logprobs, int)
                                                 or not 0 <= self.prompt_logprobs <= MAX_LOGPROBS):
            raise bad("prompt_logprobs", f"must be an integer in [0, {MAX_LOGPROBS}]")
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise bad("stop", "must be non-empty strings")
        if any(len(s) > MAX_STOP_STRING_CHARS for s in self.stop):
            raise InvalidSamplingParams(f"each stop string takes at most {MAX_STOP_STRING_CHARS} characters",
                                        param="stop")
        if len(self.stop_token_ids) > MAX_STOP_TOKEN_IDS:
            raise InvalidSamplingParams(f"stop_token_ids takes at most {MAX_STOP_TOKEN_IDS} ids, got "
                                        f"{len(self.stop_token_ids)}", param="stop_token_ids")
        if any(not isinstance(t, int) or t < 0 for t in self.stop_token_ids):
            raise bad("stop_token_ids", "must be non-negative integers")
        if self.ignore_eos and self.structured_outputs is not None:
            raise InvalidSamplingParams("ignore_eos cannot be combined with a structured output constraint: the "
                                        "grammar decides where the output ends", param="ignore_eos")
        if len(self.logit_bias) > MAX_LOGIT_BIAS_TOKENS:
            raise InvalidSamplingParams(f"logit_bias takes at most {MAX_LOGIT_BIAS_TOKENS} tokens, got "
                                        f"{len(self.logit_bias)}", param="logit_bias")
        for pair in self.logit_bias:
            token, bias = pair if isinstance(pair, tuple) and len(pair) == 2 else (None, None)
            if not isinstance(token, int) or isinstance(token, bool) or token < 0:
                raise InvalidSamplingParams(f"logit_bias keys must be token ids (integers >= 0), got {token!r}",
                                            param="logit_bias")
            if not _finite(bias) or not -MAX_LOGIT_BIAS <= bias <= MAX_LOGIT_BIAS:
                raise InvalidSamplingParams(f"logit_bias values must be in [-100, 100], got {bias!r} for token "
                                            f"{token}", param="logit_bias")
        if self.allowed_token_ids is not None:
            if not self.allowed_token_ids:
                raise InvalidSamplingParams("allowed_token_ids must hold at least one token id (null: every token)",
                                            param="allowed_token_ids")
            if len(self.allowed_token_ids) > MAX_ALLOWED_TOKEN_IDS:
                raise InvalidSamplingParams(f"allowed_token_ids takes at most {MAX_ALLOWED_TOKEN_IDS} ids, got "
                                            f"{len(self.allowed_token_ids)}", param="allowed_token_ids")
            if any(not _token_id(t) for t in self.allowed_token_ids):
                raise bad("allowed_token_ids", "must be token ids (integers >= 0)")
        if len(self.bad_words) > MAX_BAD_WORDS:
            raise InvalidSamplingParams(f"bad_words takes at most {MAX_BAD_WORDS} words, got {len(self.bad_words)}",
                                        param="bad_words")
        if any(not isinstance(w, str) or not w.strip() or len(w) > MAX_STOP_STRING_CHARS for w in self.bad_words):
            raise InvalidSamplingParams(f"bad_words must be words of 1 to {MAX_STOP_STRING_CHARS} characters, not "
                                        "only spaces", param="bad_words")
        if sum(len(w) for w in self.bad_words) > MAX_BAD_WORDS_CHARS:
            raise InvalidSamplingParams(f"bad_words takes at most {MAX_BAD_WORDS_CHARS} characters in all",
                                        param="bad_words")
        if isinstance(self.priority, bool) or not isinstance(self.priority, int):
            raise bad("priority", "must be an integer")
        if self.cache_salt is not None and (not isinstance(self.cache_salt, str) or not self.cache_salt):
            raise bad("cache_salt", "must be a non-empty string")
        if self.lora_name is not None and (not isinstance(self.lora_name, str) or not self.lora_name):
            raise bad("lora_name", "must be a non-empty string")
        budget = self.thinking_token_budget
        if budget is not None and (not isinstance(budget, int) or isinstance(budget, bool) or budget < 0):
            raise bad("thinking_token_budget", "must be an integer >= 0")
        if self.reasoning_phase not in (None, "thinking", "answer", "open"):
            raise bad("reasoning_phase", "must be thinking, answer or open")
        keep = self.truncate_prompt_tokens
        if keep is not None and not (isinstance(keep, int) and not isinstance(keep, bool) and (keep >= 1 or keep == -1)):
            raise bad("truncate_prompt_tokens", "must be an integer >= 1, or -1 (as many as the context holds)")

    @property
    def is_greedy(self) -> bool:
        # A temperature this small is greedy in effect, and dividing float32 logits by it overflows (1e-40
        # is 0 in float32): vLLM draws the line at the same place.
        return self.temperature < GREEDY_TEMPERATURE

    @property
    def uses_penalties(self) -> bool:
        return self.repetition_penalty != 1.0 or self.frequency_penalty != 0.0 or self.presence_penalty != 0.0

    @property
    def restricts_tokens(self) -> bool:
        """Whether some tokens are refused outright (allowed_token_ids, bad_words), as a grammar refuses them."""
        return self.allowed_token_ids is not None or bool(self.bad_words_token_ids)


def _token_id(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _finite(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def expand_n(params: SamplingParams) -> list[SamplingParams]:
    """n samples of one prompt as n engine requests; seeded ones get seed, seed+1, ... so they differ. The
    prompt's logprobs are the same for every sample: the first computes them (its prompt rows all run), the
    others take the prefix cache."""
    if params.n == 1:
        return [params]
    return [replace(params, n=1, seed=None if params.seed is None else params.seed + i,
                    prompt_logprobs=params.prompt_logprobs if i == 0 else None) for i in range(params.n)]
