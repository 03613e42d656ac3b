"""Requests and what comes back: per-request state, outputs, stage timestamps.

No torch here: the scheduler and the cache work on these objects. A request owns its block arithmetic
(how many blocks it needs, which of its blocks are full) so that nobody else recomputes offsets.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field, replace

from kvserve.block_hash import BlockHash, block_identity, hash_block
from kvserve.sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"  # back in the waiting queue, KV freed, to be recomputed
    FINISHED = "finished"


class FinishReason(enum.StrEnum):
    STOP = "stop"  # EOS, a stop token id or a stop string
    LENGTH = "length"  # max_tokens or the context limit
    ABORT = "abort"  # cancelled by the client or the server


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
