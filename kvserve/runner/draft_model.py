"""A draft model proposes the drafts: a smaller model with the target's tokenizer, run in the same process on
its own paged KV, one batched forward per draft token for every request that drafts.

A step's drafting for requests r with confirmed tokens T_r (prompt and output) and draft lengths k_r::

    forward 1   each r: the tokens of T_r its KV lacks (the last one at least; a whole prompt on first
                sight, less what the draft's prefix cache holds)          → d1 after the last of them
    forward j   each r with k_r >= j: d(j-1) at the next position          → dj

A request's first drafting waits for the step after its first token, so the draft's prefill of the prompt
never delays the first token.

Greedy requests get the draft's greedy choices, which the target accepts while its own choice agrees.
Requests with a temperature and no seed get samples from the draft's distribution q (processed as the
target's sampler processes p), kept for the verification's rejection sampling (runner/speculative.py).
Seeded requests get greedy drafts: their tokens then never depend on speculation.

With prompt lookup (``lookup``), a request whose own tokens hold a match for its last ones takes the
lookup's drafts that step, at no model's cost, and the draft model runs for the others only. The draft's KV
of a request the lookup served falls behind and is caught up in its next model draft's first forward.

What the draft's KV holds is kept by a ``DraftKV`` (the engine's, from kvserve/cache): rejected drafts' KV
is overwritten the next step, and a request that returns after a preemption starts from the draft's prefix
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
from kvserve.runner.draft_vocab import DraftVocabulary
from kvserve.runner.input_batch import build_inputs
from kvserve.runner.sampler import Sampler, SamplingState
from kvserve.runner.speculative import DRAFT_SALT, NgramProposer, ProposalRequest

_MAX_DECODE_CATCH_UP = 16  # tokens the draft catches up on as decode rows; more go as a prefill chunk


class DraftSlotsLike(Protocol):
    """Where a request's draft KV stands: KV held for its first ``num_computed`` tokens, and its blocks."""

    @property
    def num_computed(self) -> int: ...

    @property
    def block_ids(self) -> list[int]: ...


class DraftKV(Protocol):
    """What the draft proposer needs of the draft's KV bookkeeping (kvserve/cache/draft_kv.py has it)."""

    def holds(self, request_id: str) -> bool: ...

    def tokens_to_compute(self, request_id: str, token_ids: Sequence[int], salt: str | None = None) -> int: ...

    def prepare(self, request_id: str, token_ids: Sequence[int], num_ahead: int,
                salt: str | None = None) -> DraftSlotsLike | None: ...

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
        seed: int = 0,
        kept_ids: Sequence[int] | None = None,
        lookup: NgramProposer | None = None,
    ) -> None:
        self.model = model
        self.backend = backend
        self.kv_caches = kv_caches
        self.block_size = block_size
        self.kv = kv
        self.max_model_len = max_model_len  # the draft's context: no drafts past it
        self.vocab_size = vocab_size  # columns both models have: a draft is always a token the target can take
        # The ids the draft proposes from (draft_vocab.py): ``kept_ids`` (None: all) and the drafted prompts' ids.
        self.vocabulary = DraftVocabulary(model, vocab_size, kept_ids)
        self._timings: list[tuple[int, float]] = []
        self._probs: dict[str, torch.Tensor] = {}
        self._cached_on_sight: dict[str, int] = {}  # per request not held yet: its tokens the prefix cache holds
        self.lookup = lookup
        self._found: dict[str, list[int]] = {}  # this step's drafts prompt lookup found, by request
        # Samples the drafts of requests with a temperature, from the draft's distribution processed as the
        # target's sampler processes its own.
        self.sampler = Sampler(vocab_size, seed, argmax=backend.argmax)
        self.forward_time_s = 0.0

    def forget(self, request_id: str) -> None:
        self.kv.release(request_id)
        self.vocabulary.forget(request_id)
        self._cached_on_sight.pop(request_id, None)
        self._found.pop(request_id, None)
        if self.lookup is not None:
            self.lookup.forget(request_id)

    def onboarding_tokens(self, request_id: str, state: SamplingState) -> int:
        if self.kv.holds(request_id):
            return 0
        num_tokens = len(state.prompt_token_ids) + len(state.output_token_ids)
        cached = self._cached_on_sight.get(request_id)
        if cached is None:  # looked up once per request: hashing a long prompt every step would cost
            cached = num_tokens - self.kv.tokens_to_compute(request_id, [*state.prompt_token_ids,
                                                                          *state.output_token_ids],
                                                            state.params.cache_salt)
            self._cached_on_sight[request_id] = cached
        return num_tokens - cached

    def take_forward_timings(self) -> list[tuple[int, float]]:
        timings, self._timings = self._timings, []
        return timings

    def take_draft_probs(self) -> dict[str, torch.Tensor]:
        probs, self._probs = self._probs, {}
        return probs

    @torch.inference_mode()
    def measure_forwards(self, row_counts: Sequence[int] = (1, 2, 3, 4, 5), repeats: int = 2,
                         prefill_tokens: int = 64) -> list[tuple[int, float]]:
        """(rows, seconds) of draft forwards on made-up tokens: a prefill chunk and steps of ``row_counts`` decode
        rows, each ``repeats`` times after one untimed pass. The draft-length policy then starts from
        measured costs instead of onboarding a live request to measure them. Nothing stays in the draft's KV."""
        request_id = "\0draft-costs"
        prefill_tokens = min(prefill_tokens, self.max_model_len - max(row_counts) - 1)
        if prefill_tokens < 1:
            return []
        tokens = [i % self.vocab_size for i in range(prefill_tokens)]
        slots = self.kv.prepare(request_id, tokens, max(row_counts))
        if slots is None:
            return []
        forward_time_s = self.forward_time_s
        try:
            forwards = [ScheduledRequest(request_id, tokens, 0, slots.block_ids, True)] + [
                ScheduledRequest(request_id, tokens[-1:], prefill_tokens, slots.block_ids, True,
                                 draft_token_ids=tokens[: rows - 1]) for rows in row_counts]
            for row in forwards:  # untimed: the first forwards pay one-time costs (threads, packing, caches)
                self._forward([row], {})
            self.take_forward_timings()
            for _ in range(repeats):
                for row in forwards:
                    self._forward([row], {})
            return self.take_forward_timings()
        finally:
            self.kv.release(request_id)
            self.forward_time_s = forward_time_s

    def free_proposal(self, request: ProposalRequest) -> bool:
        if self.lookup is None:
            return False
        found = self.lookup.propose([request])[0]
        if found:
            self._found[request.request_id] = found
        else:
            self._found.pop(request.request_id, None)
        return bool(found)

    @torch.inference_mode()
    def propose(self, requests: Sequence[ProposalRequest]) -> list[list[int]]:
        drafts: list[list[int]] = [[] for _ in requests]
        self._probs = {}
        sampled_rows: dict[str, list[torch.Tensor]] = {}
        active: list[tuple[int, ScheduledRequest, int]] = []  # (index in requests, its row, drafts wanted)
        found = self._found
        self._found = {}
        for i, r in enumerate(requests):
            if r.request_id in found:
                drafts[i] = found[r.request_id][: r.max_tokens]
                continue
            state = r.state
            tokens = [*state.prompt_token_ids, *state.output_token_ids]
            num_drafts = min(r.max_tokens, self.max_model_len - len(tokens))
            if num_drafts < 1:
                continue
            if len(state.output_token_ids) <= 1 and not self.kv.holds(r.request_id):
                # The draft's prefill of a new prompt waits a step: run now, it would delay the first token.
                continue
            slots = self.kv.prepare(r.request_id, tokens, num_drafts - 1, state.params.cache_salt)
            if slots is None:
                continue  # the draft's pool is full: this request goes without drafts this step
            self.vocabulary.admit(r.request_id, state.prompt_token_ids)
            active.append((i, _catch_up_row(r.request_id, tokens, slots.num_computed, slots.block_ids), num_drafts))
            if _samples_drafts(state):
                sampled_rows[r.request_id] = []
        while active:
            # By position among this forward's rows: the requests whose drafts are sampled, as the draft sees them.
            sampled = {k: self._draft_state(requests[i].state, drafts[i])
                       for k, (i, row, _) in enumerate(active) if row.request_id in sampled_rows}
            proposed, probs = self._forward([row for _, row, _ in active], sampled)
            still: list[tuple[int, ScheduledRequest, int]] = []
            for (i, row, num_drafts), token_id in zip(active, proposed, strict=True):
                drafts[i].append(token_id)
                if row.request_id in probs:
                    sampled_rows[row.request_id].append(probs[row.request_id])
                if len(drafts[i]) < num_drafts:
                    position = row.start_position + len(row.token_ids) + len(row.draft_token_ids)
                    still.append((i, ScheduledRequest(row.request_id, [token_id], position, row.block_ids, True),
                                  num_drafts))
            active = still
        for r, request_drafts in zip(requests, drafts, strict=True):
            if request_drafts and r.request_id not in found:
                self.kv.computed(r.request_id, request_drafts[:-1])  # the last draft was not fed back in
        self._probs = {rid: torch.stack(rows) for rid, rows in sampled_rows.items() if rows}
        return drafts

    @staticmethod
    def _draft_state(state: SamplingState, drafts: list[int]) -> SamplingState:
        """The request as the draft sees it at this depth: its tokens, then the drafts so far (penalties and
        min_tokens count them); no grammar."""
        return SamplingState(state.params, state.prompt_token_ids, [*state.output_token_ids, *drafts],
                             state.eos_token_ids)

    def _forward(self, rows: list[ScheduledRequest], sampled: dict[int, SamplingState]
                 ) -> tuple[list[int], dict[str, torch.Tensor]]:
        """One batched forward of the draft: per row (in order) its next token after the row's last position,
        the greedy choice or, for the rows in ``sampled``, a sample from the draft's distribution (returned
        by request id: [V])."""
        t0 = time.perf_counter()
        inputs = build_inputs(SchedulerOutput(scheduled=rows), self.block_size, self.model.device)
        meta = self.backend.build_metadata(inputs.rows)
        with self.model.thread_scope:
            hidden = self.model.forward(inputs.input_ids, inputs.positions, meta, self.kv_caches)
            # Each request's last row (a catch-up laid out as decode rows samples after each of them).
            last_rows: dict[str, int] = {}
            offset = 0
            sample_rows = inputs.sample_rows.tolist()
            for request_id, extra in zip(inputs.sample_request_ids, inputs.sample_drafts, strict=True):
                offset += 1 + len(extra)
                last_rows[request_id] = sample_rows[offset - 1]
            index = torch.tensor([last_rows[row.request_id] for row in rows], device=hidden.device)
            logits, ids = self.vocabulary.logits(hidden[index], [row.request_id for row in rows])
            picked = self.sampler.argmax(logits)  # the backend's kernel where it has one
            tokens = (picked if ids is None else ids[picked]).tolist()
            probs: dict[str, torch.Tensor] = {}
            if sampled:
                index = torch.tensor(list(sampled), device=logits.device)
                sampled_states = list(sampled.values())
                # Ids the pruned draft cannot propose: probability 0 (penalties and filters leave -inf as it is).
                q_logits = self.vocabulary.full(logits[index], ids)
                q = self.sampler.probabilities(q_logits, sampled_states)  # [S, V]
                for k, token_id, row in zip(sampled, self.sampler.sample_from(q, sampled_states, DRAFT_SALT), q,
                                            strict=True):
                    tokens[k] = token_id
                    probs[rows[k].request_id] = row
        seconds = time.perf_counter() - t0
        self._timings.append((int(inputs.input_ids.shape[0]), seconds))
        self.forward_time_s += seconds
        return tokens, probs


def _catch_up_row(request_id: str, tokens: list[int], num_computed: int, block_ids: list[int]) -> ScheduledRequest:
    """The tokens the draft's KV lacks, as the first forward's row. A few (the drafts accepted last step and
    the target's own token) go as consecutive decode rows, as the target lays out drafts, so the step stays
    a decode step (the fused decode stack takes it); a whole prompt goes as a prefill chunk."""
    missing = tokens[num_computed:]
    if 1 < len(missing) <= _MAX_DECODE_CATCH_UP:
        return ScheduledRequest(request_id, missing[:1], num_computed, block_ids, True, draft_token_ids=missing[1:])
    return ScheduledRequest(request_id, missing, num_computed, block_ids, True)


def _samples_drafts(state: SamplingState) -> bool:
    """Drafts sampled from the draft's distribution, for rejection sampling: requests with a temperature and
    no seed. A seeded request gets greedy drafts, verified draw by draw, so its tokens are the ones it draws
    without speculation, whatever the draft lengths the load leads to."""
    return not state.params.is_greedy and state.params.seed is None
