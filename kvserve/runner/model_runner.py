"""Runs one step on the model: build inputs, forward, sample. Never sees the scheduler or the cache tree."""

from __future__ import annotations

import time

import torch

from kvserve.batch import NewRequestData, RunnerOutput, SchedulerOutput
from kvserve.config import MAX_SPECULATIVE_TOKENS
from kvserve.model.backends.base import Backend
from kvserve.model.llama import LlamaForCausalLM
from kvserve.model.lora import LoRAAdapter, StepLoRA
from kvserve.reasoning import Phase, ReasoningGate, ReasoningTokens, constrained_phase
from kvserve.runner.draft_lengths import DraftLengthPolicy
from kvserve.runner.input_batch import ModelInputs, build_inputs
from kvserve.runner.kv_transfer import read_blocks, start_read_blocks, write_blocks
from kvserve.runner.sampler import Sampler, SamplingState
from kvserve.runner.speculative import (
    ProposalRequest,
    Proposer,
    Verified,
    drafts_within_grammar,
    sample_and_verify,
)
from kvserve.structured.grammar import CompiledGrammar

# Prompt rows whose logits (rows x vocabulary, in float32) are made at once for prompt logprobs.
PROMPT_LOGPROB_ROWS = 256


class ModelRunner:
    def __init__(
        self,
        model: LlamaForCausalLM,
        backend: Backend,
        kv_caches: list[torch.Tensor],
        block_size: int,
        sampler: Sampler,
        proposer: Proposer | None = None,
        propose_below_batch_size: int | None = None,
        draft_lengths: DraftLengthPolicy | None = None,
        reasoning: ReasoningTokens | None = None,
    ) -> None:
        self.model = model
        self.backend = backend  # the model's: it turns each step's rows into its attention metadata
        self.kv_caches = kv_caches
        self.block_size = block_size
        self.sampler = sampler
        self.device = model.device
        self.states: dict[str, SamplingState] = {}
        self.reasoning = reasoning  # a reasoning model's markers: each request's thoughts are followed
        self._prompt_logprob_ids: set[str] = set()  # requests asking for prompt logprobs (most steps: none)
        self._adapters: dict[str, LoRAAdapter] = {}  # the requests that run a LoRA adapter (most: none)
        # Drafts for each request's next step (speculative decoding); None: no speculation.
        self.proposer = proposer
        self.propose_below_batch_size = propose_below_batch_size  # None: at any batch size
        # How many drafts each request may get (adaptive to acceptance and load; by default what the proposer
        # offers, up to the configuration's limit).
        self.draft_lengths = draft_lengths or DraftLengthPolicy(MAX_SPECULATIVE_TOKENS, adaptive=False)
        self.num_steps = 0  # steps that ran a forward, and the time they took
        self.busy_time_s = 0.0
        # Per request whose drafts were sampled: the distributions they came from, for the next verification.
        self._draft_probs: dict[str, torch.Tensor] = {}
        self.num_proposed_tokens = 0  # drafts the proposer offered, and the time it took to offer them
        self.propose_time_s = 0.0
        # Drafts that came from prompt lookup (all of n-gram's; a draft model's where lookup found a match):
        # the requests whose pending drafts are such, and how many of them were verified and accepted.
        self._lookup_pending: set[str] = set()
        self.num_lookup_draft_tokens = 0
        self.num_lookup_accepted_tokens = 0
        # Offloaded blocks' copies to the host run beside the step on CUDA.
        self._transfer_stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None

    @torch.inference_mode()
    def read_blocks(self, block_ids: list[int]) -> list[bytes]:
        """KV of whole blocks as bytes (for the storage tiers)."""
        return read_blocks(self.kv_caches, block_ids)

    def execute(self, out: SchedulerOutput) -> RunnerOutput:
        """KV transfers, then the forward and sampling of the scheduled tokens (none: transfers only)."""
        if out.is_empty:
            return self._execute(out)
        t0 = time.perf_counter()
        result = self._execute(out)
        self.busy_time_s += time.perf_counter() - t0
        self.num_steps += 1
        return result

    @torch.inference_mode()
    def _execute(self, out: SchedulerOutput) -> RunnerOutput:
        result = RunnerOutput()
        # KV transfers first, in this order: an offloaded block may be reused by a load or by this forward.
        # The offloads' copy to the host overlaps the step (on CUDA) and is read once the step is done.
        offloads = start_read_blocks(self.kv_caches, [block_id for block_id, _ in out.kv_offloads],
                                     self._transfer_stream)
        if out.kv_loads:
            write_blocks(self.kv_caches, out.kv_loads)
        self._step(out, result)
        result.offloaded = [(block_hash, payload)
                            for (_, block_hash), payload in zip(out.kv_offloads, offloads.result(), strict=True)]
        return result

    def _step(self, out: SchedulerOutput, result: RunnerOutput) -> None:
        """The step's forward, sampling and drafts, into ``result``."""
        for request_id in out.finished_request_ids:
            state = self.states.pop(request_id, None)
            self._prompt_logprob_ids.discard(request_id)
            self._adapters.pop(request_id, None)
            self._draft_probs.pop(request_id, None)
            self._lookup_pending.discard(request_id)
            if self.proposer is not None:
                self.proposer.forget(request_id)
                self.draft_lengths.forget(request_id, len(state.output_token_ids) if state is not None else None)
        for new in out.new_requests:
            self.states[new.request_id] = new_sampling_state(new, self.reasoning)
            if new.sampling_params.prompt_logprobs is not None:
                self._prompt_logprob_ids.add(new.request_id)
            if isinstance(new.lora, LoRAAdapter):
                self._adapters[new.request_id] = new.lora
        if out.is_empty and not out.kv_loads:
            return

        inputs = build_inputs(out, self.block_size, self.device)
        # Also how the backend learns which blocks this step rewrites, loads included.
        meta = self.backend.build_metadata(inputs.rows)
        group_metas = [self.backend.build_metadata(rows) for rows in inputs.group_rows]
        if out.is_empty:
            return
        masker = self.sampler.grammar_masker
        if masker is not None:  # the grammar masks of the rows sampled first are computed during the forward
            matchers = [m for rid in inputs.sample_request_ids if (m := self.states[rid].matcher) is not None]
            if matchers:
                masker.prefetch(matchers)
        t0 = time.perf_counter()
        with self.model.thread_scope:
            hidden = self.model.forward(inputs.input_ids, inputs.positions, meta, self.kv_caches, group_metas,
                                        lora=self._step_lora(inputs) if self._adapters else None)
            if self._prompt_logprob_ids:
                self._prompt_logprobs(hidden, inputs, result)
            if not inputs.sample_request_ids:
                return
            logits = self.model.compute_logits(hidden[inputs.sample_rows])  # [num_sample_rows, vocab]
            states = [self.states[rid] for rid in inputs.sample_request_ids]
            draft_probs = [self._draft_probs.pop(rid, None) for rid in inputs.sample_request_ids]
            verified = sample_and_verify(self.sampler, logits, states, inputs.sample_drafts, draft_probs)
            if any(state.params.return_hidden_state for state in states):
                result.hidden_states = self._hidden_states(hidden[inputs.sample_rows], inputs.sample_request_ids,
                                                           states, inputs.sample_drafts)
        if self.proposer is not None and not inputs.rows.prefills:  # the cost of decode rows, for draft lengths
            self.draft_lengths.observe_step(int(inputs.input_ids.shape[0]), time.perf_counter() - t0)
        for request_id, drafts, outcome in zip(inputs.sample_request_ids, inputs.sample_drafts, verified, strict=True):
            result.sampled_token_ids[request_id] = outcome.token_id
            if drafts:
                result.num_accepted_drafts[request_id] = outcome.num_accepted
                if request_id in self._lookup_pending:
                    self.num_lookup_draft_tokens += len(drafts)
                    self.num_lookup_accepted_tokens += outcome.num_accepted
            self._lookup_pending.discard(request_id)
            if outcome.logprobs is not None:
                result.logprobs[request_id] = outcome.logprobs
        limit = self.propose_below_batch_size
        if self.proposer is not None and (limit is None or len(states) < limit):
            self._propose(inputs.sample_request_ids, states, inputs.sample_drafts, verified, result)

    def _step_lora(self, inputs: ModelInputs) -> StepLoRA | None:
        """Which of the step's rows run which adapter (a request's rows: from its first to the next one's)."""
        num_rows = int(inputs.input_ids.shape[0])
        ends = [first_row for _, first_row, _, _ in inputs.spans[1:]] + [num_rows]
        spans = [(self._adapters.get(request_id), first_row, end - first_row)
                 for (request_id, first_row, _, _), end in zip(inputs.spans, ends, strict=True)]
        return StepLoRA.for_rows(spans, num_rows, self.device, self.model.ops.lora_add)

    def _prompt_logprobs(self, hidden: torch.Tensor, inputs: ModelInputs, result: RunnerOutput) -> None:
        """For the requests asking for them, each of this step's prompt rows' logprob of the next prompt token
        and the top ones (the model's own distribution: no temperature, penalty or bias applied)."""
        for request_id, first_row, start, count in inputs.spans:
            if request_id not in self._prompt_logprob_ids:
                continue
            state = self.states[request_id]
            num_top = state.params.prompt_logprobs
            prompt = state.prompt_token_ids
            stop = min(start + count, len(prompt) - 1)  # rows whose next token is still the prompt's
            if num_top is None or stop <= start:
                continue
            entries: list[dict[int, float]] = []
            ranks: list[int] = []
            for row0 in range(start, stop, PROMPT_LOGPROB_ROWS):  # [rows, vocab] a slice at a time
                row1 = min(row0 + PROMPT_LOGPROB_ROWS, stop)
                rows = hidden[first_row + row0 - start: first_row + row1 - start]
                logits = self.model.compute_logits(rows)[:, : self.sampler.vocab_size]  # padded columns: none
                logprobs = torch.log_softmax(logits.float(), dim=-1)
                targets = torch.tensor(prompt[row0 + 1: row1 + 1], device=logprobs.device)
                chosen_values = logprobs.gather(1, targets[:, None])
                chosen = chosen_values[:, 0].tolist()
                ranks += ((logprobs > chosen_values).sum(dim=-1) + 1).tolist()
                top_values, top_ids = logprobs.topk(num_top, dim=-1) if num_top else (None, None)
                for i, target in enumerate(targets.tolist()):
                    entry = {} if top_ids is None else dict(zip(top_ids[i].tolist(), top_values[i].tolist(),
                                                                strict=True))
                    entry.setdefault(target, chosen[i])
                    entries.append(entry)
            result.prompt_logprobs[request_id] = (start + 1, entries, ranks)

    def _hidden_states(self, sampled: torch.Tensor, request_ids: list[str], states: list[SamplingState],
                       drafts: list[list[int]]) -> dict[str, list[float]]:
        """The final-norm hidden state of each asking request's first sampled row (its last prompt token on
        its first step): what the output projection reads."""
        normed = self.model.final_hidden(sampled)
        found = {}
        row = 0
        for request_id, state, request_drafts in zip(request_ids, states, drafts, strict=True):
            if state.params.return_hidden_state:
                found[request_id] = normed[row].float().tolist()
            row += 1 + len(request_drafts)
        return found

    def _propose(self, request_ids: list[str], states: list[SamplingState], drafts: list[list[int]],
                 verified: list[Verified], result: RunnerOutput) -> None:
        """Drafts for the next step of the requests that just sampled, as many as the draft-length policy
        gives each. Requests asking for logprobs get none (logprobs come one token a step)."""
        assert self.proposer is not None
        policy = self.draft_lengths
        eligible: list[tuple[str, SamplingState, tuple[int, int] | None]] = []
        for request_id, state, request_drafts, outcome in zip(request_ids, states, drafts, verified, strict=True):
            feedback = (len(request_drafts), outcome.num_accepted) if request_drafts else None
            if feedback is not None:
                policy.observe_verified(request_id, *feedback)
            if state.params.logprobs is None:
                eligible.append((request_id, state, feedback))
        # Drafts prompt lookup finds (all of n-gram's) cost no model's forward: the proposer says which, with
        # each request's feedback, before the lengths are chosen.
        t0 = time.perf_counter()
        free = [self.proposer.free_proposal(ProposalRequest(request_id, state, feedback, policy.max_tokens))
                for request_id, state, feedback in eligible]
        lookup_s = time.perf_counter() - t0
        onboarding = remaining = None
        if policy.uses_model:
            onboarding = [0 if is_free else self.proposer.onboarding_tokens(request_id, state)
                          for (request_id, state, _), is_free in zip(eligible, free, strict=True)]
            remaining = [None if state.params.max_tokens is None else state.params.max_tokens - len(state.output_token_ids)
                         for _, state, _ in eligible]
        lengths = policy.lengths([request_id for request_id, _, _ in eligible], onboarding, remaining, free)
        wanted = [ProposalRequest(request_id, state, None, length)  # the feedback went to free_proposal
                  for (request_id, state, _), length in zip(eligible, lengths, strict=True) if length > 0]
        lookup = {request_id for (request_id, _, _), is_free in zip(eligible, free, strict=True) if is_free}
        if not wanted:
            self.propose_time_s += lookup_s
            return
        t0 = time.perf_counter()
        proposals = self.proposer.propose(wanted)
        seconds = time.perf_counter() - t0
        self.propose_time_s += seconds + lookup_s
        policy.observe_propose(seconds, [r.request_id for r, proposal in zip(wanted, proposals, strict=True) if proposal])
        policy.observe_draft(self.proposer.take_forward_timings())
        draft_probs = self.proposer.take_draft_probs()
        for request, proposal in zip(wanted, proposals, strict=True):
            matcher = request.state.matcher
            if proposal and matcher is not None:
                sampled = request.request_id in draft_probs and not request.state.params.is_greedy
                proposal = drafts_within_grammar(proposal, matcher.valid_prefix(proposal), sampled)
            if proposal:
                result.draft_token_ids[request.request_id] = proposal
                self.num_proposed_tokens += len(proposal)
                if request.request_id in lookup:
                    self._lookup_pending.add(request.request_id)
                if request.request_id in draft_probs:  # the scheduler may cut the drafts, never reorder them
                    self._draft_probs[request.request_id] = draft_probs[request.request_id]


def new_sampling_state(new: NewRequestData, reasoning: ReasoningTokens | None = None) -> SamplingState:
    """A request's sampling state, its grammar matcher and its place in its thoughts caught up with the tokens
    it already has (a request that returns after a preemption). A reasoning model's grammar starts where its
    answer does: after the end marker, or at once where the prompt leaves no thoughts to come. A reply free to
    open a block follows its grammar from the first token, the start marker allowed beside it where that is one
    token (else the grammar decides alone)."""
    params = new.sampling_params
    state = SamplingState(params, new.prompt_token_ids, [], new.eos_token_ids)
    grammar = new.grammar if isinstance(new.grammar, CompiledGrammar) else None
    phase = Phase.ANSWER
    if reasoning is not None and (grammar is not None or params.thinking_token_budget is not None):
        # (a reply with neither has nothing to follow: the server reads its thoughts from the text); the engine
        # read the phase when the request came
        phase = Phase(params.reasoning_phase) if params.reasoning_phase else constrained_phase(
            reasoning.phase_after_prompt(new.prompt_token_ids), reasoning, grammar is not None)
    if reasoning is not None and phase is not Phase.ANSWER:
        state.reasoning = ReasoningGate(reasoning, phase, params.thinking_token_budget)
        state.answer_grammar = grammar
    if grammar is not None and phase is not Phase.THINKING:
        state.matcher = grammar.new_matcher()
    for token_id in new.output_token_ids:
        state.append(token_id, replayed=True)
    return state
