"""Requests and what comes back: sampling parameters, per-request state, outputs, stage timestamps.

No torch here: the scheduler and the cache work on these objects. A request owns its block arithmetic
(how many blocks it needs, which of its blocks are full) so that nobody else recomputes offsets.
"""

from __future__ import annotations

import enum
import hashlib
import json
import math
import time
from array import array
from collections.abc import Sequence
from dataclasses import dataclass, field, replace

from kvserve.errors import InvalidRequest, InvalidSamplingParams

MAX_LOGPROBS = 20


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"  # back in the waiting queue, KV freed, to be recomputed
    FINISHED = "finished"


class FinishReason(enum.StrEnum):
    STOP = "stop"  # EOS, a stop token id or a stop string
    LENGTH = "length"  # max_tokens or the context limit
    ABORT = "abort"  # cancelled by the client or the server


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


# ---------------------------------------------------------------------------------------------------------
# Chained block hashes: key(block i) = H(key(block i-1) || token ids of block i || extra keys).
# Stable across processes (blake2b, not Python's hash), so lower storage tiers can share them.
# ---------------------------------------------------------------------------------------------------------
BlockHash = bytes


def block_identity(parent: BlockHash | None, token_ids: Sequence[int]) -> bytes:
    """What a full block is: its parent's chained hash and its token ids (what ``hash_block`` digests, less
    the request's extra keys). The tiers below device memory store it with the block's KV and compare it on
    every load, so a hit there never rests on the hash alone."""
    return (parent or b"\0" * 16) + array("I", token_ids).tobytes()


def salted_hash_extra(extra: bytes, salt: str | None, adapter_key: bytes = b"") -> bytes:
    """What a request mixes into its block hashes: the engine's ``extra`` (its model fingerprint), its LoRA
    adapter's key where it runs one, then its cache salt where it has one, so that its blocks match only those
    of requests with that adapter and salt. The adapter's key comes before the salt: no salt can spell it."""
    extra += adapter_key
    return extra if salt is None else extra + b"\0cache_salt:" + salt.encode("utf-8", "surrogatepass")


def hash_block(parent: BlockHash | None, token_ids: Sequence[int], extra: bytes = b"") -> BlockHash:
    h = hashlib.blake2b(digest_size=16)
    h.update(block_identity(parent, token_ids))
    h.update(extra)
    return h.digest()


@dataclass(frozen=True, slots=True)
class RequestLatencies:
    """A request's latencies in seconds (None for a stage it never reached), as /metrics and the dashboard
    both report them: TPOT is decode time over output tokens after the first; ITLs are the gaps between
    the steps that produced tokens."""

    queue_s: float | None
    ttft_s: float | None
    prefill_s: float | None
    decode_s: float | None
    e2e_s: float | None
    tpot_s: float | None
    itls_s: tuple[float, ...]


@dataclass(slots=True)
class RequestMetrics:
    """A timestamp per pipeline stage (time.monotonic seconds) plus counts of what each stage did."""

    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None
    num_cached_tokens: int = 0  # found in the prefix cache at admission (any tier)
    num_prefill_chunks: int = 0
    num_prefill_tokens_computed: int = 0
    num_decode_steps: int = 0
    num_preemptions: int = 0
    num_draft_steps: int = 0  # decode steps that verified speculative drafts, and the drafts they verified
    num_draft_tokens: int = 0
    num_accepted_draft_tokens: int = 0
    cached_tokens_by_tier: dict[str, int] = field(default_factory=dict)
    # When each step that produced output tokens ended (for ITL): one entry per step, so the accepted
    # speculative drafts of a step arrive together, as a client sees them in one streamed chunk.
    token_times: list[float] = field(default_factory=list)
    # When each prefill chunk's step ended, with the chunk's tokens, and when each preemption happened.
    prefill_chunk_ends: list[tuple[float, int]] = field(default_factory=list)
    preemption_times: list[float] = field(default_factory=list)

    def latencies(self, num_output_tokens: int) -> RequestLatencies:
        queue = None if self.first_scheduled_time is None else self.first_scheduled_time - self.arrival_time
        first = self.first_token_time
        if first is None:
            return RequestLatencies(queue, None, None, None, None, None, ())
        last = self.last_token_time if self.last_token_time is not None else first
        end = self.finished_time if self.finished_time is not None else last
        prefill = None if self.first_scheduled_time is None else first - self.first_scheduled_time
        tpot = (last - first) / (num_output_tokens - 1) if num_output_tokens > 1 else None
        itls = tuple(b - a for a, b in zip(self.token_times, self.token_times[1:], strict=False))
        return RequestLatencies(queue, first - self.arrival_time, prefill, last - first, end - self.arrival_time,
                                tpot, itls)


class Request:
    """One sequence being generated. Owns its token list, block table and block arithmetic."""

    __slots__ = (
        "request_id", "prompt_token_ids", "sampling_params", "eos_token_ids", "status", "all_token_ids",
        "num_prompt_tokens", "num_computed_tokens", "block_ids", "group_block_ids", "num_cached_tokens", "block_hashes",
        "hash_extra", "metrics", "finish_reason", "stop_reason", "max_total_tokens", "lpm_skips",
        "prompt", "cache_handle", "arrival_order", "output_logprobs", "prompt_logprobs", "prompt_token_ranks",
        "draft_token_ids", "grammar", "lora", "hidden_state",
    )

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams,
        *,
        eos_token_ids: tuple[int, ...] = (),
        max_total_tokens: int,
        arrival_time: float | None = None,
        arrival_order: int = 0,
        hash_extra: bytes = b"",
        prompt: str | None = None,
        grammar: object | None = None,
        lora: object | None = None,
    ) -> None:
        self.request_id = request_id
        self.prompt = prompt
        self.prompt_token_ids = list(prompt_token_ids)
        self.sampling_params = sampling_params
        self.eos_token_ids = eos_token_ids
        self.status = RequestStatus.WAITING
        self.all_token_ids: list[int] = list(prompt_token_ids)
        self.num_prompt_tokens = len(prompt_token_ids)
        self.num_computed_tokens = 0
        self.block_ids: list[int] = []
        # The block tables of the KV groups after the first (kv_layout.py), each as long as ``block_ids``;
        # empty for a model whose layers all read ``block_ids``.
        self.group_block_ids: list[list[int]] = []
        self.num_cached_tokens = 0
        self.block_hashes: list[BlockHash] = []
        self.hash_extra = hash_extra
        self.metrics = RequestMetrics(arrival_time=time.monotonic() if arrival_time is None else arrival_time)
        self.finish_reason: FinishReason | None = None
        self.stop_reason: int | str | None = None
        # prompt + max output, capped by the model's context length
        self.max_total_tokens = max_total_tokens
        self.lpm_skips = 0
        self.cache_handle: object | None = None  # owned by the KV manager (locked radix node)
        self.arrival_order = arrival_order
        self.output_logprobs: list[dict[int, float]] | None = [] if sampling_params.logprobs is not None else None
        # By position in the prompt (None at 0): a chunk computed again after a preemption writes the same.
        self.prompt_logprobs: list[dict[int, float] | None] | None = (
            [None] * len(prompt_token_ids) if sampling_params.prompt_logprobs is not None else None)
        self.prompt_token_ranks: list[int | None] | None = (
            [None] * len(prompt_token_ids) if sampling_params.prompt_logprobs is not None else None)
        self.hidden_state: list[float] | None = None  # when sampling_params.return_hidden_state
        # Speculative tokens proposed for the next step (verified by the runner, not part of the sequence).
        self.draft_token_ids: list[int] = []
        # The compiled constraint of params.structured_outputs (opaque here; the runner makes its matcher).
        self.grammar = grammar
        self.lora = lora  # the LoRA adapter it runs with (kvserve.model.lora), resolved from its params' name

    # --- token arithmetic -------------------------------------------------------------------------------
    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.all_token_ids) - self.num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.all_token_ids[self.num_prompt_tokens :]

    @property
    def num_tokens_to_compute(self) -> int:
        """Tokens whose KV is not yet in the cache: the whole prompt at first, then one per decode step."""
        return self.num_tokens - self.num_computed_tokens

    @property
    def is_finished(self) -> bool:
        return self.status is RequestStatus.FINISHED

    def append_token(self, token_id: int) -> None:
        self.all_token_ids.append(token_id)

    def truncate(self, num_tokens: int) -> None:
        """Drop the tokens after the first ``num_tokens`` (a stop string matched before the step's last
        token); their KV, if computed, is forgotten with them. The block hashes need no trim: they cover
        only blocks that were full when the step was scheduled, before any of the dropped tokens."""
        assert num_tokens >= self.num_prompt_tokens, (num_tokens, self.num_prompt_tokens)
        del self.all_token_ids[num_tokens:]
        self.num_computed_tokens = min(self.num_computed_tokens, num_tokens)

    def max_draft_tokens(self) -> int:
        """Drafts worth verifying: one step emits the accepted drafts plus one token, within max_total_tokens."""
        return max(0, self.max_total_tokens - self.num_tokens - 1)

    # --- block arithmetic -------------------------------------------------------------------------------
    def num_blocks_needed(self, num_tokens: int, block_size: int) -> int:
        """Blocks this request's table must hold to store KV for its first ``num_tokens`` tokens."""
        return -(-num_tokens // block_size)

    def full_block_hashes(self, block_size: int) -> list[BlockHash]:
        """Chained hashes of every full block of ``all_token_ids``, extended incrementally."""
        num_full = self.num_tokens // block_size
        hashes = self.block_hashes
        while len(hashes) < num_full:
            i = len(hashes)
            parent = hashes[-1] if hashes else None
            hashes.append(hash_block(parent, self.all_token_ids[i * block_size : (i + 1) * block_size], self.hash_extra))
        return hashes

    def block_identities(self, block_size: int, start: int, stop: int) -> list[bytes]:
        """``block_identity`` of full blocks ``start..stop``."""
        hashes = self.full_block_hashes(block_size)
        tokens = self.all_token_ids
        return [block_identity(hashes[i - 1] if i else None, tokens[i * block_size : (i + 1) * block_size])
                for i in range(start, stop)]

    def __repr__(self) -> str:
        return (
            f"Request({self.request_id!r}, {self.status.value}, tokens={self.num_tokens}, "
            f"computed={self.num_computed_tokens}, blocks={len(self.block_ids)})"
        )


@dataclass(frozen=True, slots=True)
class LoRARequest:
    """A LoRA adapter for offline requests, as vLLM's ``LoRARequest`` names one: ``LLM.generate`` loads it from
    ``lora_path`` (a PEFT adapter directory) the first time it sees ``lora_name``. ``lora_int_id`` is accepted
    for vLLM's callers; the name identifies the adapter."""

    lora_name: str
    lora_int_id: int = 0
    lora_path: str = ""


@dataclass(frozen=True, slots=True)
class ProcessedPrompt:
    """A prompt validated and tokenised once, on the caller's side, ready for the engine to queue."""

    prompt_token_ids: list[int]
    prompt: str | None  # the text it came from, when it came as text
    sampling_params: SamplingParams
    grammar: object | None = None  # sampling_params.structured_outputs, compiled (kvserve.structured)


@dataclass(frozen=True, slots=True)
class Finish:
    """How a request ends. ``num_tokens``: the sequence is cut to its first ``num_tokens`` tokens first (a stop
    string ended it before the last token a step brought)."""

    reason: FinishReason
    stop_reason: int | str | None = None
    num_tokens: int | None = None


@dataclass(frozen=True, slots=True)
class StepUpdate:
    """A request that got tokens this step: how many, and how it ends if it does (the scheduler's own checks:
    EOS, stop tokens, length; the output processor may replace it with a stop string's). Nothing is finished
    until the scheduler applies the final decisions."""

    request: Request
    num_new_tokens: int
    finish: Finish | None = None


@dataclass(slots=True)
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    logprobs: list[dict[int, float]] | None = None
    cumulative_logprob: float | None = None
    hidden_state: list[float] | None = None  # final-norm, at the prompt's last token, when asked for


@dataclass(slots=True)
class RequestOutput:
    """What the engine hands back for a request: cumulative so far, plus the delta since the last output."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int
    metrics: RequestMetrics
    delta_text: str = ""
    delta_token_ids: list[int] = field(default_factory=list)
    # Per prompt token (None for the first), when SamplingParams.prompt_logprobs asked: {token_id: logprob} for
    # the prompt's token and the top ones, and the prompt token's rank there (1: the most likely).
    prompt_logprobs: list[dict[int, float] | None] | None = None
    prompt_token_ranks: list[int | None] | None = None

    def following(self, older: RequestOutput) -> RequestOutput:
        """This output and an earlier one not yet read, as one: cumulative as this one, with both deltas. A
        reader that falls behind then holds one output of its request, not one per step it missed."""
        return replace(self, delta_text=older.delta_text + self.delta_text,
                       delta_token_ids=older.delta_token_ids + self.delta_token_ids)
