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

    def take_forward_timings(self) -> list[tuple[int, float]]:
        """(rows, seconds) of each forward the proposer ran since the last call; none for a model-free one."""
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

    def take_forward_timings(self) -> list[tuple[int, float]]:
        return []

    def propose(self, requests: Sequence[ProposalRequest]) -> list[list[int]]:
        return [self._propose_one(r.request_id, r.state, r.verified, r.max_tokens) for r in requests]

    def _propose_one(self, request_id: str, state: SamplingState, verified: tuple[int, int] | None,
                     max_tokens: int) -> list[int]:
        index = self._indexes.get(request_id)
        if index is None:
            index = self._indexes[request_id] = _NgramIndex(max_drafts=min(2, self.num_tokens))
            self._extend(index, state.prompt_token_ids)
        if verified is not None:
            num_verified, num_accepted = verified
            index.max_drafts = self.num_tokens if num_accepted == num_verified else num_accepted + 1
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


def sample_and_verify(
    sampler: Sampler, logits: torch.Tensor, states: list[SamplingState], drafts: list[list[int]]
) -> list[Verified]:
    """Sample each request's next token(s). ``logits`` [sum(1 + len(d)), V] holds each request's rows in order
    (see the module docstring); requests without drafts have one row. Appends every new token to its state.

    One sampler call per depth, over the requests still accepting, so the sampler sees exactly the states
    plain decoding would (min_tokens, penalties and seeds depend on the tokens so far)."""
    offsets: list[int] = []
    row = 0
    for request_drafts in drafts:
        offsets.append(row)
        row += 1 + len(request_drafts)
    assert row == logits.shape[0], (row, tuple(logits.shape))
    results: list[Verified | None] = [None] * len(states)
    alive = list(range(len(states)))
    depth = 0
    while alive:
        rows = [offsets[j] + depth for j in alive]
        depth_logits = logits if len(rows) == row else logits[torch.tensor(rows, device=logits.device)]
        sampled = sampler(depth_logits, [states[j] for j in alive])
        still: list[int] = []
        for j, token_id, logprobs in zip(alive, sampled.token_ids, sampled.logprobs, strict=True):
            states[j].append(token_id)
            if depth < len(drafts[j]) and token_id == drafts[j][depth]:
                still.append(j)
            else:
                results[j] = Verified(depth, token_id, logprobs)
        alive = still
        depth += 1
    return results  # type: ignore[return-value]
