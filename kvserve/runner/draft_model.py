"""A draft model proposes the drafts: a smaller model with the target's tokenizer, run in the same process on
its own paged KV, one batched forward per draft token for every request that drafts.

A step's drafting for requests r with confirmed tokens T_r (prompt and output) and draft lengths k_r::

    forward 1   each r: the tokens of T_r its KV lacks (the last one at least; a whole prompt on first
                sight, less what the draft's prefix cache holds)          → d1 = argmax of the last row
    forward j   each r with k_r >= j: d(j-1) at the next position          → dj

A request's first drafting waits for the step after its first token, so the draft's prefill of the prompt
never delays the first token. Drafts are the draft's greedy choices. The target verifies them by sampling its own token at each position
and accepting a draft while they agree (runner/speculative.py), which is exact for every sampling mode.
What the draft's KV holds is kept in ``DraftKV`` (the engine's, from kvserve/cache): rejected drafts' KV is
overwritten the next step, and a request that returns after a preemption starts from the draft's prefix
cache.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Protocol

import torch

from kvserve.batch import ScheduledRequest, SchedulerOutput
from kvserve.model.backends.base import Backend
from kvserve.model.llama import LlamaForCausalLM
from kvserve.runner.input_batch import build_inputs
from kvserve.runner.speculative import ProposalRequest


class DraftSlotsLike(Protocol):
    @property
    def num_computed(self) -> int: ...

    @property
    def block_ids(self) -> list[int]: ...


class DraftKV(Protocol):
    """What the draft proposer needs of the draft's KV bookkeeping (kvserve/cache/draft_kv.py has it)."""

    def holds(self, request_id: str) -> bool: ...

    def prepare(self, request_id: str, token_ids: Sequence[int], num_ahead: int) -> DraftSlotsLike | None: ...

    def computed(self, request_id: str, fed_drafts: Sequence[int]) -> None: ...

    def release(self, request_id: str) -> None: ...


class DraftModelProposer:
    method = "draft_model"

    def __init__(
        self,
        model: LlamaForCausalLM,
        backend: Backend,
        kv_caches: list[torch.Tensor],
        block_size: int,
        kv: DraftKV,
        max_model_len: int,
        vocab_size: int,
    ) -> None:
        self.model = model
        self.backend = backend
        self.kv_caches = kv_caches
        self.block_size = block_size
        self.kv = kv
        self.max_model_len = max_model_len  # the draft's context: no drafts past it
        self.vocab_size = vocab_size  # columns both models have: a draft is always a token the target can take
        self._timings: list[tuple[int, float]] = []
        self.forward_time_s = 0.0

    def forget(self, request_id: str) -> None:
        self.kv.release(request_id)

    def take_forward_timings(self) -> list[tuple[int, float]]:
        timings, self._timings = self._timings, []
        return timings

    @torch.inference_mode()
    def propose(self, requests: Sequence[ProposalRequest]) -> list[list[int]]:
        drafts: list[list[int]] = [[] for _ in requests]
        active: list[tuple[int, ScheduledRequest, int]] = []  # (index in requests, its row, drafts wanted)
        for i, r in enumerate(requests):
            state = r.state
            tokens = [*state.prompt_token_ids, *state.output_token_ids]
            num_drafts = min(r.max_tokens, self.max_model_len - len(tokens))
            if num_drafts < 1:
                continue
            if len(state.output_token_ids) <= 1 and not self.kv.holds(r.request_id):
                # The draft's prefill of a new prompt waits a step: run now, it would delay the first token.
                continue
            slots = self.kv.prepare(r.request_id, tokens, num_drafts - 1)
            if slots is None:
                continue  # the draft's pool is full: this request goes without drafts this step
            start = slots.num_computed
            active.append((i, ScheduledRequest(r.request_id, tokens[start:], start, slots.block_ids, True), num_drafts))
        while active:
            proposed = self._forward([row for _, row, _ in active])
            still: list[tuple[int, ScheduledRequest, int]] = []
            for (i, row, num_drafts), token_id in zip(active, proposed, strict=True):
                drafts[i].append(token_id)
                if len(drafts[i]) < num_drafts:
                    position = row.start_position + len(row.token_ids)
                    still.append((i, ScheduledRequest(row.request_id, [token_id], position, row.block_ids, True),
                                  num_drafts))
            active = still
        for r, request_drafts in zip(requests, drafts, strict=True):
            if request_drafts:
                self.kv.computed(r.request_id, request_drafts[:-1])  # the last draft was not fed back in
        return drafts

    def _forward(self, rows: list[ScheduledRequest]) -> list[int]:
        """One batched forward of the draft; its greedy token after each row's last position, in row order."""
        t0 = time.perf_counter()
        inputs = build_inputs(SchedulerOutput(scheduled=rows), self.block_size, self.model.device)
        meta = self.backend.build_metadata(inputs.rows)
        with self.model.thread_scope:
            hidden = self.model.forward(inputs.input_ids, inputs.positions, meta, self.kv_caches)
            logits = self.model.compute_logits(hidden[inputs.sample_rows])[:, : self.vocab_size]
            by_request = dict(zip(inputs.sample_request_ids, self.backend.argmax(logits).tolist(), strict=True))
        seconds = time.perf_counter() - t0
        self._timings.append((int(inputs.input_ids.shape[0]), seconds))
        self.forward_time_s += seconds
        return [by_request[row.request_id] for row in rows]
