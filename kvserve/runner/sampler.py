"""Turn one step's logits into next tokens: min_tokens, penalties, logprobs, filters, sampling.

The model runner calls ``Sampler`` once per engine step with the logits of every request that samples a
token this step (one row per request) and the ``SamplingState`` it keeps for each of them.

Order of operations (as vLLM does), all in float32 on the logits' device:

    logits [B, V] ──► grammar: tokens the request's constraint does not allow next → -inf
                 ──► allowed_token_ids: every other token → -inf; bad_words: a word's last token → -inf
                     where the output ends with the word's other tokens
                 ──► min_tokens: eos + stop_token_ids → -inf while len(output) < min_tokens
                 ──► logit_bias (OpenAI: added to the chosen tokens' logits)
                 ──► repetition penalty (prompt + output tokens, HF: logit > 0 → /p, else *p)
                 ──► frequency / presence penalties (output tokens, OpenAI: -= f*count + p*(count > 0))
                 ├─► logprobs = log_softmax(penalised logits)   (before temperature and filters)
                 ├─► greedy rows: argmax(penalised logits)      (ties → lowest index, as torch/HF)
                 └─► sampled rows: / temperature ──► top-k ──► top-p ──► min-p ──► softmax
                                   ──► argmax(probs / Exp(1) noise)   (the exponential race == sampling)

Randomness. A row whose request has a ``seed`` draws its noise from a generator seeded with a hash of
(seed, number of output tokens so far): the token depends only on the request, never on which other
requests share the batch or their order, and a preempted request that is replayed draws the same tokens.
Rows without a seed share one generator per device seeded from ``base_seed`` (one vectorised draw).

Host syncs: the fast path (all greedy, no logprobs or penalties) is one argmax and one ``.tolist()``. The
general path copies its small per-row parameter lists to the device without blocking and syncs only when
the results are read back at the end.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from itertools import chain

import torch
import torch.nn.functional as F

from kvserve.model.host_inputs import to_device
from kvserve.reasoning import Phase, ReasoningGate
from kvserve.sampling_params import SamplingParams
from kvserve.structured.grammar import CompiledGrammar, GrammarMatcher
from kvserve.structured.masks import GrammarMasker

logger = logging.getLogger(__name__)

ArgMax = Callable[[torch.Tensor], torch.Tensor]
_MASK64 = (1 << 64) - 1
_NEG_INF = float("-inf")
# Repetition penalties and temperatures, the logits' divisors, are clamped into this range (logits stay finite at
# any temperature >= 1e-5).
_MIN_DIVISOR, _MAX_DIVISOR = 1e-30, 1e30


@dataclass(slots=True)
class SamplingState:
    """One per request, kept by the runner across steps. The runner (not the sampler) appends each token."""

    params: SamplingParams
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    eos_token_ids: tuple[int, ...] = ()
    # Where the request is in its structured-output grammar (None: free text, or thoughts before it).
    matcher: GrammarMatcher | None = None
    # A reasoning model's: where its thoughts end, and the grammar its answer follows once they have.
    reasoning: ReasoningGate | None = None
    answer_grammar: CompiledGrammar | None = None
    # allowed_token_ids as a mask of the tokens it refuses ([V] bool), and bad_words by the token before each
    # word's last (None: words of one token), both built at the first step that needs them.
    refused_mask: torch.Tensor | None = None
    bad_words_by_previous: dict[int | None, list[tuple[int, ...]]] | None = None

    @property
    def suppresses_stop_tokens(self) -> bool:
        """min_tokens not reached yet and there is something to suppress.

        ``ignore_eos`` only changes when a request stops, not the logits: eos is suppressed here too. A
        request that follows a grammar ends where the grammar lets it end: min_tokens does not apply.
        """
        return self.matcher is None and len(self.output_token_ids) < self.params.min_tokens and bool(
            self.eos_token_ids or self.params.stop_token_ids
        ) and self.forced_token is None  # a forced token is never refused

    @property
    def forced_token(self) -> int | None:
        """The one token the next step may take (a spent thinking budget's end marker), or None."""
        return self.reasoning.forced_token if self.reasoning is not None else None

    @property
    def opening_token(self) -> int | None:
        """A token the next step may take beside what the grammar allows: the start marker (one token), while a
        reasoning model's reply may still open its thoughts (the grammar then waits for their end)."""
        gate = self.reasoning
        if gate is None or self.matcher is None or not gate.may_open or len(gate.start_ids) != 1:
            return None
        return gate.start_ids[0]

    def append(self, token_id: int, replayed: bool = False) -> None:
        """A token joins the output (and advances the grammar, after a reasoning model's thoughts).
        ``replayed``: a token the request had before a preemption, taken again."""
        self.output_token_ids.append(token_id)
        gate = self.reasoning
        if gate is not None and gate.phase is not Phase.ANSWER:
            opened = gate.phase is Phase.OPEN
            if gate.observe(token_id):
                self.matcher = self.answer_grammar.new_matcher() if self.answer_grammar is not None else None
                return  # the answer starts: its grammar from the next token
            if gate.phase is Phase.THINKING:
                self.matcher = None  # the thoughts, or the token that opened them: no grammar
                return
            if opened and gate.phase is Phase.OPEN and self.matcher is None:
                return  # blanks before the reply decides (no grammar to follow)
        if self.matcher is not None and not self.matcher.accept(token_id):
            # Only a row with every token masked can get here (or a replayed token that had left the grammar
            # before); the rest of it is generated unconstrained.
            if not replayed:
                logger.warning("a token left the request's grammar (%s); the rest of its output is unconstrained",
                               self.matcher.error)
            self.matcher = None


@dataclass(slots=True)
class SamplerOutput:
    token_ids: list[int]  # one per row
    # Per row, when params.logprobs is not None: {top-n ids (descending): lp, then the sampled id if absent}.
    logprobs: list[dict[int, float] | None]


class Sampler:
    """Samples one token per row. ``vocab_size`` columns are used; extra (padding) columns never win."""

    def __init__(self, vocab_size: int, base_seed: int = 0, argmax: ArgMax | None = None,
                 grammar_masker: GrammarMasker | None = None) -> None:
        if vocab_size < 1:
            raise ValueError(f"vocab_size must be >= 1, got {vocab_size}")
        self.vocab_size = vocab_size
        self.base_seed = base_seed
        # Masks the rows of requests with a grammar; a sampler without one is never given such a row.
        self.grammar_masker = grammar_masker
        # Row-wise argmax of [B, V] logits (int64 [B]); a kernel may replace torch's, which is slow on CPU.
        self.argmax: ArgMax = argmax or _torch_argmax
        # Per device: the generator of unseeded rows, and a scratch one re-seeded for each seeded row.
        self._shared_generators: dict[torch.device, torch.Generator] = {}
        self._row_generators: dict[torch.device, torch.Generator] = {}

    def __call__(self, logits: torch.Tensor, states: list[SamplingState]) -> SamplerOutput:
        assert logits.dim() == 2 and logits.shape[0] == len(states), (tuple(logits.shape), len(states))
        assert logits.shape[1] >= self.vocab_size, (tuple(logits.shape), self.vocab_size)
        logits = logits[:, : self.vocab_size]  # [B, V]; a view: padded vocab columns are never sampled
        logits, constrained = self._masked(logits, states)
        if not any(_needs_full_path(s) for s in states):
            # Hot path: every decode step of greedy requests. argmax is exact in any float dtype.
            if any(s.suppresses_stop_tokens for s in states):
                logits = logits if constrained else logits.clone()  # masked below; the caller's stays as it was
                suppress_stop_tokens(logits, states)
            return SamplerOutput(self.argmax(logits).tolist(), [None] * len(states))
        return self._sample(logits, states)

    def _masked(self, logits: torch.Tensor, states: list[SamplingState]) -> tuple[torch.Tensor, bool]:
        """``logits`` with the tokens a grammar, allowed_token_ids or bad_words refuse at -inf (a copy, when any
        row refuses some), and whether any row does."""
        constrained = [i for i, s in enumerate(states) if s.matcher is not None]
        restricted = [i for i, s in enumerate(states) if s.params.restricts_tokens]
        forced = [(i, token) for i, s in enumerate(states) if (token := s.forced_token) is not None]
        if not constrained and not restricted and not forced:
            return logits, False
        given, logits = logits, logits.clone()  # masked in place; the caller's tensor stays as it was
        if constrained:
            assert self.grammar_masker is not None, "a request with a grammar reached a sampler without a masker"
            matchers = [m for i in constrained if (m := states[i].matcher) is not None]
            self.grammar_masker.apply(logits, constrained, matchers)
            for i in constrained:  # a reasoning model may open its thoughts before the grammar's answer
                if (token := states[i].opening_token) is not None:
                    logits[i, token] = given[i, token]
        refuse_tokens(logits, states, restricted)
        for i, token in forced:  # every other token refused (its own logit kept: logprobs stay the model's order)
            kept = logits[i, token].clone()
            logits[i].fill_(_NEG_INF)
            logits[i, token] = kept if torch.isfinite(kept) else 0.0
        return logits, True

    @staticmethod
    def _penalised(logits: torch.Tensor, states: list[SamplingState]) -> torch.Tensor:
        """A float32 copy of ``logits`` after min_tokens, logit_bias and the penalties."""
        logits = logits.to(torch.float32, copy=True)
        suppress_stop_tokens(logits, states)
        apply_logit_bias(logits, states)
        return apply_penalties(logits, states)

    # --- distributions, for speculative decoding's rejection sampling ------------------------------------
    def probabilities(self, logits: torch.Tensor, states: list[SamplingState]) -> torch.Tensor:
        """Each row's sampling distribution, [B, V] float32: what ``__call__`` samples a non-greedy row from
        (grammar, min_tokens, logit_bias, penalties, temperature, top-k, top-p, min-p). Rows must not be greedy.
        A row that refuses every token (a draft model's, whose vocabulary holds none of allowed_token_ids) is all
        zeros: a draft drawn from it has no probability, and verification rejects it."""
        assert not any(s.params.is_greedy for s in states)
        logits, _ = self._masked(logits[:, : self.vocab_size], states)
        probs = self._filtered_probs(self._penalised(logits, states), states, list(range(len(states))))
        return probs.nan_to_num_(nan=0.0)

    def sample_from(self, probs: torch.Tensor, states: list[SamplingState], salt: int = 0) -> list[int]:
        """One token per row of ``probs`` [B, V] (any non-negative weights), with each row's noise drawn as
        ``__call__`` draws it (seeded rows: from the seed, ``salt`` and the tokens so far)."""
        noise = self._exponential_noise(probs.shape, states, probs.device, salt)
        return (probs / noise).argmax(dim=-1).tolist()

    def uniform(self, states: list[SamplingState], salt: int) -> list[float]:
        """One draw from U(0, 1) per row, seeded rows reproducibly (from the seed, ``salt`` and the tokens so
        far), the others from the shared generator."""
        device = torch.device("cpu")
        values = torch.rand(len(states), generator=self._shared_generator(device)).tolist()
        generator = self._row_generator(device)
        for j, s in enumerate(states):
            if s.params.seed is not None:
                generator.manual_seed(row_seed(s.params.seed ^ salt, len(s.output_token_ids)))
                values[j] = float(torch.rand(1, generator=generator))
        return values

    # --- general path -----------------------------------------------------------------------------------
    def _sample(self, logits: torch.Tensor, states: list[SamplingState]) -> SamplerOutput:
        num_rows = len(states)
        device = logits.device
        logits = self._penalised(logits, states)  # [B, V] float32

        greedy_rows = [i for i, s in enumerate(states) if s.params.is_greedy]
        sample_rows = [i for i, s in enumerate(states) if not s.params.is_greedy]
        if not sample_rows:
            token_ids = self.argmax(logits)  # [B]
        else:
            sampled = self._sample_rows(logits, states, sample_rows)  # [S]
            if not greedy_rows:
                token_ids = sampled
            else:
                token_ids = self.argmax(logits)  # [B]
                token_ids[_index(sample_rows, device)] = sampled

        logprob_rows = [i for i, s in enumerate(states) if s.params.logprobs is not None]
        if not logprob_rows:
            return SamplerOutput(token_ids.tolist(), [None] * num_rows)
        return self._with_logprobs(logits, token_ids, states, logprob_rows)

    def _sample_rows(
        self, logits: torch.Tensor, states: list[SamplingState], rows: list[int]
    ) -> torch.Tensor:
        """Sampled token ids for ``rows`` (non-greedy), from the penalised ``logits`` [B, V]. Returns [S]."""
        probs = self._filtered_probs(logits, states, rows)  # [S, V]
        noise = self._exponential_noise(probs.shape, [states[i] for i in rows], logits.device)  # [S, V]
        # argmax(p_i / E_i) with E_i ~ Exp(1) is distributed as Categorical(p): the exponential race.
        return probs.div_(noise).argmax(dim=-1)

    def _filtered_probs(self, logits: torch.Tensor, states: list[SamplingState], rows: list[int]) -> torch.Tensor:
        """Softmax of ``rows`` of the penalised ``logits`` [B, V] after temperature, top-k, top-p and min-p."""
        device = logits.device
        vocab_size = logits.shape[1]
        params = [states[i].params for i in rows]
        x = logits if len(rows) == logits.shape[0] else logits[_index(rows, device)]  # [S, V]
        # Clamped as the penalties are: past float32's range a temperature is inf, and -inf / inf (a masked
        # token) is NaN; 1e30 already flattens any logits to uniform.
        x = x / _column([p.temperature for p in params], device).clamp_(_MIN_DIVISOR, _MAX_DIVISOR)
        # Each filter runs only when some row uses it; a disabled row passes through it unchanged.
        top_k = top_p = min_p = None
        if any(0 < p.top_k < vocab_size for p in params):
            # Clamped first: a top_k of 2**63 (no filter) in a batch with a real one must not overflow.
            top_k = to_device([min(p.top_k, vocab_size) for p in params], device, torch.long)  # [S]
        if any(p.top_p < 1 for p in params):
            top_p = to_device([p.top_p for p in params], device, torch.float32)  # [S]
        if any(p.min_p > 0 for p in params):
            min_p = to_device([p.min_p for p in params], device, torch.float32)  # [S]
        return apply_top_k_top_p_min_p(x, top_k, top_p, min_p).softmax(dim=-1)

    def _exponential_noise(
        self, shape: torch.Size, states: list[SamplingState], device: torch.device, salt: int = 0
    ) -> torch.Tensor:
        num_rows, vocab_size = shape
        noise = torch.empty(num_rows, vocab_size, dtype=torch.float32, device=device)  # [S, V]
        seeded = [(j, s) for j, s in enumerate(states) if s.params.seed is not None]
        if len(seeded) < num_rows:
            noise.exponential_(generator=self._shared_generator(device))
        if seeded:
            generator = self._row_generator(device)
            for j, s in seeded:
                assert s.params.seed is not None
                generator.manual_seed(row_seed(s.params.seed ^ salt, len(s.output_token_ids)))
                # Always drawn as a standalone [V] tensor, so the values never depend on the batch.
                row = torch.empty(vocab_size, dtype=torch.float32, device=device)
                noise[j] = row.exponential_(generator=generator)
        # An exact 0 would give 0/0 = NaN for a filtered token, and argmax picks NaN.
        return noise.clamp_min_(torch.finfo(torch.float32).tiny)

    def _with_logprobs(
        self, logits: torch.Tensor, token_ids: torch.Tensor, states: list[SamplingState], rows: list[int]
    ) -> SamplerOutput:
        """Logprobs of the penalised logits (before temperature and the filters), for ``rows``."""
        device = logits.device
        index = _index(rows, device)
        logprobs = torch.log_softmax(logits[index], dim=-1)  # [L, V]
        chosen_lp = logprobs.gather(1, token_ids[index].unsqueeze(1)).squeeze(1)  # [L]
        num_top = min(max(states[i].params.logprobs or 0 for i in rows), logprobs.shape[1])
        top_lp, top_ids = logprobs.topk(num_top, dim=-1) if num_top else (None, None)  # [L, n], descending

        token_list = token_ids.tolist()  # the sync; the reads below find their results already computed
        chosen_list = chosen_lp.tolist()
        top_lp_list = top_lp.tolist() if top_lp is not None else None
        top_ids_list = top_ids.tolist() if top_ids is not None else None
        out: list[dict[int, float] | None] = [None] * len(states)
        for j, i in enumerate(rows):
            n = states[i].params.logprobs or 0
            entry: dict[int, float] = {}
            if n:
                assert top_ids_list is not None and top_lp_list is not None
                entry = dict(zip(top_ids_list[j][:n], top_lp_list[j][:n], strict=True))
            entry.setdefault(token_list[i], chosen_list[j])
            out[i] = entry
        return SamplerOutput(token_list, out)

    def _shared_generator(self, device: torch.device) -> torch.Generator:
        generator = self._shared_generators.get(device)
        if generator is None:
            generator = torch.Generator(device=device)
            generator.manual_seed(self.base_seed & _MASK64)
            self._shared_generators[device] = generator
        return generator

    def _row_generator(self, device: torch.device) -> torch.Generator:
        generator = self._row_generators.get(device)
        if generator is None:
            generator = torch.Generator(device=device)
            self._row_generators[device] = generator
        return generator


# --- pure steps (each testable on hand-built logits) ----------------------------------------------------
def refuse_tokens(logits: torch.Tensor, states: list[SamplingState], rows: list[int]) -> None:
    """In place, for ``rows``: every token outside allowed_token_ids, and each bad word's last token where the
    output ends with the word's other tokens, → -inf. [B, V]. Ids past V are left out (a draft model's
    vocabulary may be smaller than its target's)."""
    vocab_size = logits.shape[1]
    for i in rows:
        state = states[i]
        params, output = state.params, state.output_token_ids
        if params.allowed_token_ids is not None:
            mask = state.refused_mask
            if mask is None or mask.shape[0] != vocab_size or mask.device != logits.device:
                mask = torch.ones(vocab_size, dtype=torch.bool, device=logits.device)
                allowed = [t for t in params.allowed_token_ids if t < vocab_size]
                if allowed:
                    mask[_index(allowed, logits.device)] = False
                state.refused_mask = mask
            logits[i].masked_fill_(mask, _NEG_INF)
        if not params.bad_words_token_ids:
            continue
        by_previous = state.bad_words_by_previous
        if by_previous is None:
            by_previous = state.bad_words_by_previous = {}
            for word in params.bad_words_token_ids:
                by_previous.setdefault(word[-2] if len(word) > 1 else None, []).append(word)
        # Only the words whose last-but-one token ends the output can close here: a lookup, not a scan.
        candidates = [*by_previous.get(None, ()), *(by_previous.get(output[-1], ()) if output else ())]
        refused = [word[-1] for word in candidates
                   if word[-1] < vocab_size and (len(word) == 1 or (
                       len(word) - 1 <= len(output) and tuple(output[len(output) - len(word) + 1:]) == word[:-1]))]
        if refused:
            logits[i, _index(refused, logits.device)] = _NEG_INF


def suppress_stop_tokens(logits: torch.Tensor, states: list[SamplingState]) -> None:
    """In place: eos and stop_token_ids → -inf for rows that have not reached min_tokens. [B, V]."""
    vocab_size = logits.shape[1]
    rows: list[int] = []
    cols: list[int] = []
    for i, s in enumerate(states):
        if s.suppresses_stop_tokens:
            ids = {t for t in chain(s.eos_token_ids, s.params.stop_token_ids) if t < vocab_size}
            rows.extend([i] * len(ids))
            cols.extend(ids)
    if rows:
        logits[_index(rows, logits.device), _index(cols, logits.device)] = _NEG_INF


def apply_logit_bias(logits: torch.Tensor, states: list[SamplingState]) -> None:
    """In place: each request's logit_bias added to its row. [B, V] float32. Ids past V are left out: the
    engine checks them against the target's vocabulary, and a draft model's may be smaller."""
    rows: list[int] = []
    cols: list[int] = []
    biases: list[float] = []
    vocab_size = logits.shape[1]
    for i, s in enumerate(states):
        for token, bias in s.params.logit_bias:
            if token >= vocab_size:
                continue
            rows.append(i)
            cols.append(token)
            biases.append(bias)
    if rows:
        device = logits.device
        logits.index_put_((_index(rows, device), _index(cols, device)),
                          to_device(biases, device, torch.float32), accumulate=True)


def apply_penalties(logits: torch.Tensor, states: list[SamplingState]) -> torch.Tensor:
    """Repetition (prompt + output, HF), then frequency and presence (output only, OpenAI). [B, V] float32.

    Ids past V are left out (a draft model's vocabulary may be smaller than its target's, whose ids these are).
    """
    device = logits.device
    rows = [i for i, s in enumerate(states) if s.params.repetition_penalty != 1.0]
    if rows:
        seen = torch.zeros_like(logits, dtype=torch.bool)  # [B, V]: in the prompt or the output
        tokens = [chain(states[i].prompt_token_ids, states[i].output_token_ids) for i in rows]
        seen[_token_index(rows, tokens, device, logits.shape[1])] = True
        # Clamped so that a logit divided or multiplied by it, and then divided by any sampling temperature,
        # stays finite in float32 (1e-308 is 0 there); the effect at the bounds is already total.
        penalty = _column([s.params.repetition_penalty for s in states], device).clamp_(_MIN_DIVISOR, _MAX_DIVISOR)
        logits = torch.where(seen, torch.where(logits > 0, logits / penalty, logits * penalty), logits)
    rows = [
        i
        for i, s in enumerate(states)
        if (s.params.frequency_penalty != 0.0 or s.params.presence_penalty != 0.0) and s.output_token_ids
    ]
    if rows:
        counts = torch.zeros_like(logits)  # [B, V]: occurrences of each token in the output
        index = _token_index(rows, [states[i].output_token_ids for i in rows], device, logits.shape[1])
        counts.index_put_(index, torch.ones(index[0].shape[0], device=device), accumulate=True)
        frequency = _column([s.params.frequency_penalty for s in states], device)  # [B, 1]
        presence = _column([s.params.presence_penalty for s in states], device)  # [B, 1]
        logits = logits - frequency * counts - presence * (counts > 0)
    return logits


def apply_top_k_top_p_min_p(
    logits: torch.Tensor,
    top_k: torch.Tensor | None = None,
    top_p: torch.Tensor | None = None,
    min_p: torch.Tensor | None = None,
) -> torch.Tensor:
    """Mask (to -inf) the tokens each row may not sample; kept logits are unchanged. Not in place.

    logits [B, V] (already divided by the temperature); each of top_k [B] (long), top_p [B], min_p [B] may
    be None (disabled for every row). Per row:
      - top_k <= 0 or >= V: disabled; else exactly the k largest are kept. Ties at the boundary go to the
        lowest token id (a stable descending sort), so the kept set is exactly k and deterministic.
      - top_p: of what top-k kept (renormalised), the smallest prefix of the descending order whose mass
        reaches top_p: a token is kept iff the mass strictly before it is < top_p. The top token is always
        kept; top_p >= 1 keeps everything (no float-rounding losses in the tail).
      - min_p: drop tokens whose probability < min_p * (max probability); min_p = 0 keeps everything.
    """
    if top_k is not None or top_p is not None:
        logits = _apply_top_k_top_p(logits, top_k, top_p)
    if min_p is not None:
        probs = logits.softmax(dim=-1)  # [B, V]
        threshold = min_p.unsqueeze(1) * probs.amax(dim=-1, keepdim=True)  # [B, 1]
        logits = logits.masked_fill(probs < threshold, _NEG_INF)
    return logits


def _apply_top_k_top_p(
    logits: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor | None
) -> torch.Tensor:
    vocab_size = logits.shape[1]
    # Descending, ties in ascending token id order: position r of a row holds its r-th best token.
    sorted_logits, sorted_ids = logits.sort(dim=-1, descending=True, stable=True)  # [B, V] each
    if top_k is not None:
        k = torch.where(top_k > 0, top_k, vocab_size).clamp(max=vocab_size)  # [B]
        positions = torch.arange(vocab_size, device=logits.device)  # [V]
        sorted_logits = sorted_logits.masked_fill(positions.unsqueeze(0) >= k.unsqueeze(1), _NEG_INF)
    if top_p is not None:
        probs = sorted_logits.softmax(dim=-1)  # [B, V], renormalised over what top-k kept
        mass_before = F.pad(probs.cumsum(dim=-1)[:, :-1], (1, 0))  # [B, V]; exclusive cumsum, 0 at the top
        drop = (mass_before >= top_p.unsqueeze(1)) & (top_p < 1).unsqueeze(1)
        drop[:, 0] = False  # the top token stays, even for a top_p that is 0 in float32 (1e-300)
        sorted_logits = sorted_logits.masked_fill(drop, _NEG_INF)
    return torch.empty_like(logits).scatter_(1, sorted_ids, sorted_logits)


def row_seed(seed: int, step: int) -> int:
    """A generator seed from (request seed, output tokens so far): splitmix64 of splitmix64(seed) + step."""
    return _splitmix64((_splitmix64(seed & _MASK64) + step) & _MASK64)


def _splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


# --- helpers --------------------------------------------------------------------------------------------
def _needs_full_path(s: SamplingState) -> bool:
    p = s.params
    return not p.is_greedy or p.logprobs is not None or p.uses_penalties or bool(p.logit_bias)


def _torch_argmax(logits: torch.Tensor) -> torch.Tensor:
    return logits.argmax(dim=-1)


def _index(values: list[int], device: torch.device) -> torch.Tensor:
    return to_device(values, device, torch.long)


def _column(values: list[float], device: torch.device) -> torch.Tensor:
    return to_device(values, device, torch.float32).unsqueeze(1)  # [N, 1]


def _token_index(
    rows: list[int], token_lists: list[Iterable[int]], device: torch.device, vocab_size: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """(row index, token id) pairs for index_put: every token of token_lists[j] below ``vocab_size`` goes in
    row rows[j]."""
    row_ids: list[int] = []
    token_ids: list[int] = []
    for row, tokens in zip(rows, token_lists, strict=True):
        start = len(token_ids)
        token_ids.extend(t for t in tokens if t < vocab_size)
        row_ids.extend([row] * (len(token_ids) - start))
    return _index(row_ids, device), _index(token_ids, device)
