"""The scheduler <-> runner contract: what to compute this step, and what came out. Pure data."""

from __future__ import annotations

from dataclasses import dataclass, field

from kvserve.sampling_params import SamplingParams


@dataclass(slots=True)
class NewRequestData:
    """Sent the first step the runner sees a request (again, after a preemption): sampling state to set up."""

    request_id: str
    sampling_params: SamplingParams
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    eos_token_ids: tuple[int, ...]
    grammar: object | None = None  # the compiled structured-output constraint (kvserve.structured)
    lora: object | None = None  # the LoRA adapter it runs with (kvserve.model.lora); None: the base model


@dataclass(slots=True)
class ScheduledRequest:
    """One request's share of a step: compute KV for ``token_ids`` at positions start_position...

    ``block_ids`` is the request's whole block table (slot = block_id * block_size + offset);
    ``group_block_ids`` the tables of the other KV groups, when the model has them (kv_layout.py).
    ``sample`` is True when this chunk ends at the request's last known token, so a new token is sampled.
    ``draft_token_ids``: speculative tokens to verify after ``token_ids`` (a decode only): their KV goes into
    the next positions, and the runner samples after each of them. A rejected draft's KV is garbage that
    the next step overwrites; the table holds blocks for all of them.
    """

    request_id: str
    token_ids: list[int]
    start_position: int
    block_ids: list[int]
    sample: bool
    draft_token_ids: list[int] = field(default_factory=list)
    group_block_ids: list[list[int]] = field(default_factory=list)


@dataclass(slots=True)
class SchedulerOutput:
    """One step's work. The runner applies it in this order, which matters (a block id may be in both
    transfer lists: evicted, then reallocated for a load)::

        1. kv_offloads  copy each block's KV out (it was evicted or newly cached; it may be reused now)
        2. kv_loads     write each payload into its block (KV found in a lower tier)
        3. scheduled    the forward, which writes new KV into (possibly reused) blocks
    """

    scheduled: list[ScheduledRequest] = field(default_factory=list)
    new_requests: list[NewRequestData] = field(default_factory=list)
    # Requests the runner must forget (finished, aborted or preempted since the last step).
    finished_request_ids: list[str] = field(default_factory=list)
    # (block_id, serialised KV of the block) to write into device memory.
    kv_loads: list[tuple[int, bytes]] = field(default_factory=list)
    # (block_id, block_hash) to copy out of device memory; the runner returns them in RunnerOutput.offloaded.
    kv_offloads: list[tuple[int, bytes]] = field(default_factory=list)

    @property
    def num_batched_tokens(self) -> int:
        return sum(len(s.token_ids) for s in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


@dataclass(slots=True)
class RunnerOutput:
    """Sampled tokens for the scheduled requests whose ``sample`` flag was set, by request id."""

    sampled_token_ids: dict[str, int] = field(default_factory=dict)
    # Per request that verified drafts: how many of its scheduled drafts were accepted. Its new tokens are
    # those drafts, then the sampled token.
    num_accepted_drafts: dict[str, int] = field(default_factory=dict)
    # Per request: the drafts the proposer offers for the request's next step (it may drop or cut them).
    draft_token_ids: dict[str, list[int]] = field(default_factory=dict)
    # Per request: {token_id: logprob} for the sampled token plus the top-n, when logprobs were asked for.
    logprobs: dict[str, dict[int, float]] = field(default_factory=dict)
    # Per request that asked for it: the final-norm hidden state of the row its first token was sampled from.
    hidden_states: dict[str, list[float]] = field(default_factory=dict)
    # Per request asking for prompt logprobs whose prompt rows ran: (the prompt position of the first entry,
    # {token_id: logprob} of each next prompt token and the top ones, and that token's rank in its row's
    # distribution (1: the most likely), one per row).
    prompt_logprobs: dict[str, tuple[int, list[dict[int, float]], list[int]]] = field(default_factory=dict)
    # (block_hash, serialised KV) of each block in SchedulerOutput.kv_offloads, in that order.
    offloaded: list[tuple[bytes, bytes]] = field(default_factory=list)
