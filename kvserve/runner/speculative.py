"""Speculative decoding: propose draft tokens cheaply, verify them in one forward, keep what the model agrees with.

A request with drafts d1..dk is scheduled as k+1 decode rows (its last token, then the drafts), so one
forward gives the logits after each of them. Verification then samples the target token at each row in
turn, exactly as plain decoding would, with the state holding the tokens accepted so far::

    row      0        1        2          ...  k
    token    last     d1       d2              dk
    sample   t0       t1       t2              tk
    accept   d1 if t0 == d1, then d2 if t1 == d2, ...; the first t_i that differs from d_(i+1) ends the step
             (all accepted: tk is a bonus token). New tokens: d1..d_i, then t_i.

That is exact for every sampling mode, not only greedy: each emitted token is one sample from the target
distribution given the tokens before it (accepting a deterministic draft iff the sample equals it is
rejection sampling with a one-hot proposal). Seeded requests even draw the same tokens as without
speculation, because their noise depends on the number of tokens so far, and each emitted token costs
exactly one draw.

Drafts a draft model *sampled* from its own distribution q (requests with a temperature) are verified by
the standard rule instead: accept draft d with probability min(1, p(d) / q(d)) under the target's p (the
same temperature, filters and penalties), and at the first rejection draw the token from max(0, p - q),
renormalised. Every token is still distributed exactly as under p, and more drafts are accepted than a
greedy draft would get. Its draws are seeded by a request's seed and position too, but which draws a token
takes depends on whether a draft stood there, i.e. on the draft lengths, which follow the load: so seeded
requests get greedy drafts and the rule above, and draw exactly their tokens without speculation.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

import torch

from kvserve.runner.sampler import Sampler, SamplingState


@dataclass(frozen=True, slots=True)
class ProposalRequest:
    """A request to draft for: its tokens so far, how its last drafts fared, and how many it may get."""

    request_id: str
    state: SamplingState
    verified: tuple[int, int] | None  # (drafts verified, of which accepted) in the step just run, if any
    max_tokens: int  # at most this many drafts (>= 1)


class Proposer(Protocol):
    """Offers draft tokens for requests' next step from the tokens they hold so far."""

    method: str  # as the speculative config names it: "ngram", "draft_model"

    def propose(self, requests: Sequence[ProposalRequest]) -> list[list[int]]:
        """Drafts per request, in order (an empty list: none)."""
        ...

    def forget(self, request_id: str) -> None: ...

    def onboarding_tokens(self, request_id: str, state: SamplingState) -> int:
        """Tokens a first proposal for the request computes before its first draft (a draft model's prefill of
        what its KV lacks); 0 once the proposer holds the request, and always for a model-free one."""
        ...

    def take_forward_timings(self) -> list[tuple[int, float]]:
        """(rows, seconds) of each forward the proposer ran since the last call; none for a model-free one."""
        ...

    def take_draft_probs(self) -> dict[str, torch.Tensor]:
        """Per request of the last ``propose`` whose drafts were sampled: the distributions they were sampled
        from, [num drafts, V]; requests absent had their drafts chosen deterministically."""
        ...

    def free_proposal(self, request: ProposalRequest) -> bool:
        """Whether the request's next proposal costs no model's forward: a model-free proposer's always, a draft
        model's where prompt lookup finds drafts. Asked once a step, before ``propose``, with the request's
        feedback (``propose`` then gets none for it)."""
        ...


@dataclass(slots=True)
class _NgramIndex:
    """Per request: every n-gram (n in min..max) of its tokens that has a continuation, mapped to the position
    right after its latest occurrence. Extended as tokens arrive, so a lookup costs one dict probe per n."""

    tokens: list[int] = field(default_factory=list)
    num_output_seen: int = 0
    latest: dict[tuple[int, ...], int] = field(default_factory=dict)
    max_drafts: int = 2  # how many to propose next; adapts to what the request's text accepts


class NgramProposer:
    """Prompt lookup: find the request's last ``n`` tokens earlier in its own tokens (longest n first, the
    latest occurrence), and propose the tokens that followed. Costs no model; pays off where outputs repeat
    their context (tool calls quoting schemas, code edits, a conversation's own earlier replies).

    Every draft costs a row of compute whether accepted or not (on a small CPU, about a third to half of a
    request's share of a decode step), so the draft length adapts per request: after a step that accepted
    every draft the next proposal may be ``num_tokens`` long, otherwise one more than were accepted. In a
    replay of the agentic and chat benchmark outputs that cost less per token than a fixed length
    (benchmarks/speculative_decode.py measures the real thing)."""

    def __init__(self, num_tokens: int, min_n: int, max_n: int) -> None:
        assert 1 <= min_n <= max_n and num_tokens >= 1
        self.num_tokens = num_tokens
        self.min_n = min_n
        self.max_n = max_n
        self._indexes: dict[str, _NgramIndex] = {}

    method = "ngram"

    def forget(self, request_id: str) -> None:
        self._indexes.pop(request_id, None)

    def onboarding_tokens(self, request_id: str, state: SamplingState) -> int:
        return 0

    def take_forward_timings(self) -> list[tuple[int, float]]:
        return []

    def take_draft_probs(self) -> dict[str, torch.Tensor]:
        return {}

    def free_proposal(self, request: ProposalRequest) -> bool:
        self._index(request.request_id, request.state, request.verified)
        return True

    def propose(self, requests: Sequence[ProposalRequest]) -> list[list[int]]:
        return [self._propose_one(r.request_id, r.state, r.verified, r.max_tokens) for r in requests]

    def _index(self, request_id: str, state: SamplingState, verified: tuple[int, int] | None) -> _NgramIndex:
        """The request's index, its draft length following the feedback."""
        index = self._indexes.get(request_id)
        if index is None:
            index = self._indexes[request_id] = _NgramIndex(max_drafts=min(2, self.num_tokens))
            self._extend(index, state.prompt_token_ids)
        if verified is not None:
            num_verified, num_accepted = verified
            index.max_drafts = self.num_tokens if num_accepted == num_verified else num_accepted + 1
        return index

    def _propose_one(self, request_id: str, state: SamplingState, verified: tuple[int, int] | None,
                     max_tokens: int) -> list[int]:
        index = self._index(request_id, state, verified)
        outputs = state.output_token_ids
        if len(outputs) > index.num_output_seen:
            self._extend(index, outputs[index.num_output_seen:])
            index.num_output_seen = len(outputs)
        tokens = index.tokens
        for n in range(min(self.max_n, len(tokens) - 1), self.min_n - 1, -1):
            start = index.latest.get(tuple(tokens[-n:]))
            if start is not None:
                return tokens[start : start + min(index.max_drafts, max_tokens)]
        return []

    def _extend(self, index: _NgramIndex, new_tokens: Sequence[int]) -> None:
        tokens, latest = index.tokens, index.latest
        for token in new_tokens:
            # The token at position p continues every n-gram that ends at p - 1.
            p = len(tokens)
            for n in range(self.min_n, min(self.max_n, p) + 1):
                latest[tuple(tokens[p - n : p])] = p
            tokens.append(token)


@dataclass(slots=True)
class Verified:
    """One request's outcome of a step: how many drafts were accepted, then the token sampled after them."""

    num_accepted: int
    token_id: int
    logprobs: dict[int, float] | None


# Salts of the seeded draws of speculative decoding, so that none of them repeats another's noise.
DRAFT_SALT = 0x5EED_D4AF
ACCEPT_SALT = 0x5EED_ACC7
RESIDUAL_SALT = 0x5EED_2E51


def drafts_within_grammar(proposal: list[int], num_valid: int, sampled: bool) -> list[int]:
    """The drafts to verify for a request that follows a grammar, which allows the first ``num_valid``. Chosen
    drafts stop there. Sampled ones keep the first refused draft: verification rejects it (the grammar leaves
    it no probability) and samples the residual max(0, p - q) in its place, as exact rejection sampling does.
    Cut there instead, the token in its place would be a fresh sample of p, and the tokens emitted would be
    skewed by the odds of the draft's own sample being refused."""
    return proposal[: num_valid + 1 if sampled and num_valid < len(proposal) else num_valid]


def sample_and_verify(
    sampler: Sampler,
    logits: torch.Tensor,
    states: list[SamplingState],
    drafts: list[list[int]],
    draft_probs: Sequence[torch.Tensor | None] | None = None,
) -> list[Verified]:
    """Sample each request's next token(s). ``logits`` [sum(1 + len(d)), V] holds each request's rows in order
    (see the module docstring); requests without drafts have one row. Appends every new token to its state.

    ``draft_probs``: per request, the distributions its drafts were sampled from ([>= len(drafts), V'] with
    V' <= V columns), or None where they were chosen deterministically. A sampled request's sampled drafts
    are verified by rejection sampling: draft d is accepted with probability min(1, p(d) / q(d)); at the
    first rejection the token is drawn from max(0, p - q), renormalised. Either rule leaves each token
    distributed exactly as the target's own sampling would.

    One sampler call per depth, over the requests still accepting, so the sampler sees exactly the states
    plain decoding would (min_tokens, penalties and seeds depend on the tokens so far)."""
    offsets: list[int] = []
    row = 0
    for request_drafts in drafts:
        offsets.append(row)
        row += 1 + len(request_drafts)
    assert row == logits.shape[0], (row, tuple(logits.shape))
    probs = list(draft_probs) if draft_probs is not None else [None] * len(states)
    results: list[Verified | None] = [None] * len(states)
    alive = list(range(len(states)))
    depth = 0
    while alive:
        by_ratio = [j for j in alive if probs[j] is not None and depth < len(drafts[j])
                    and not states[j].params.is_greedy]
        if by_ratio:
            ratio_rows = set(by_ratio)
            alive = [j for j in alive if j not in ratio_rows]
            still = _verify_by_ratio(sampler, logits, states, drafts, probs, offsets, by_ratio, depth, results)
        else:
            still = []
        if alive:
            rows = [offsets[j] + depth for j in alive]
            depth_logits = logits if len(rows) == row else logits[torch.tensor(rows, device=logits.device)]
            sampled = sampler(depth_logits, [states[j] for j in alive])
            for j, token_id, logprobs in zip(alive, sampled.token_ids, sampled.logprobs, strict=True):
                states[j].append(token_id)
                if depth < len(drafts[j]) and token_id == drafts[j][depth]:
                    still.append(j)
                else:
                    results[j] = Verified(depth, token_id, logprobs)
        alive = sorted(still)
        depth += 1
    return results  # type: ignore[return-value]


def _verify_by_ratio(
    sampler: Sampler,
    logits: torch.Tensor,
    states: list[SamplingState],
    drafts: list[list[int]],
    probs: list[torch.Tensor | None],
    offsets: list[int],
    rows: list[int],
    depth: int,
    results: list[Verified | None],
) -> list[int]:
    """Rejection sampling of the ``depth``-th draft of requests ``rows``; returns those that accepted it."""
    row_states = [states[j] for j in rows]
    target = sampler.probabilities(logits[torch.tensor([offsets[j] + depth for j in rows], device=logits.device)],
                                   row_states)  # [S, V]
    vocab_size = target.shape[1]
    proposal = torch.stack([_draft_row(probs[j], depth, vocab_size) for j in rows]).to(target.device)  # [S, V]
    tokens = torch.tensor([drafts[j][depth] for j in rows], device=target.device)
    p = target.gather(1, tokens[:, None]).squeeze(1).tolist()
    q = proposal.gather(1, tokens[:, None]).squeeze(1).tolist()
    uniforms = sampler.uniform(row_states, ACCEPT_SALT)
    accepted: list[int] = []
    rejected: list[int] = []
    for i, (j, p_d, q_d, u) in enumerate(zip(rows, p, q, uniforms, strict=True)):
        if q_d > 0 and u * q_d < p_d:
            states[j].append(drafts[j][depth])
            accepted.append(j)
        else:
            rejected.append(i)
    if rejected:
        index = torch.tensor(rejected, device=target.device)
        residual = (target[index] - proposal[index]).clamp_min_(0)  # [R, V]
        # Nothing left over means p <= q everywhere, i.e. p == q: no draft is rejected then but by rounding.
        empty = residual.sum(dim=1) <= 0
        if bool(empty.any()):
            residual[empty] = target[index][empty]
        token_ids = sampler.sample_from(residual, [row_states[i] for i in rejected], RESIDUAL_SALT)
        for i, token_id in zip(rejected, token_ids, strict=True):
            states[rows[i]].append(token_id)
            results[rows[i]] = Verified(depth, token_id, None)
    return accepted


def _draft_row(probs: torch.Tensor | None, depth: int, vocab_size: int) -> torch.Tensor:
    assert probs is not None
    row = probs[depth]
    return torch.nn.functional.pad(row, (0, vocab_size - row.shape[0])) if row.shape[0] < vocab_size else row
