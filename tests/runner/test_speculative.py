"""The n-gram proposer and the verification step of speculative decoding (runner/speculative.py)."""

from __future__ import annotations

import argparse
import re
from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F

from kvserve.cli import parse_speculative_config
from kvserve.config import SpeculativeConfig
from kvserve.runner.sampler import Sampler, SamplingState
from kvserve.runner.speculative import (
    NgramProposer,
    ProposalRequest,
    drafts_within_grammar,
    sample_and_verify,
)
from kvserve.sampling_params import SamplingParams

VOCAB = 16


def state(prompt: list[int], output: list[int] | None = None, **params) -> SamplingState:
    params.setdefault("temperature", 0.0)
    return SamplingState(SamplingParams(**params), prompt, list(output or []))


def propose(proposer: NgramProposer, request_id: str, s: SamplingState, verified: tuple[int, int] | None = None,
            max_tokens: int = 16) -> list[int]:
    return proposer.propose([ProposalRequest(request_id, s, verified, max_tokens)])[0]


def test_proposes_what_followed_the_latest_longest_match() -> None:
    proposer = NgramProposer(num_tokens=4, min_n=2, max_n=3)
    # "1 2 3" occurs twice earlier; the latest occurrence was followed by 9 8 ...
    s = state([1, 2, 3, 4, 5, 1, 2, 3, 9, 8, 7, 6, 0, 1, 2, 3])
    assert propose(proposer, "a", s) == [9, 8]  # the first proposal is short (adaptive length)
    # After a step whose drafts were all accepted, proposals grow to num_tokens.
    assert propose(proposer, "a", s, verified=(2, 2)) == [9, 8, 7, 6]
    proposer.forget("a")  # a forgotten request starts over
    assert propose(proposer, "a", s) == [9, 8]


def test_prefers_the_longer_ngram_and_respects_min_n() -> None:
    proposer = NgramProposer(num_tokens=2, min_n=2, max_n=3)
    # suffix "5 6": the 3-gram "4 5 6" matched at the start wins over the later 2-gram "5 6".
    s = state([4, 5, 6, 10, 11, 3, 5, 6, 12, 13, 4, 5, 6])
    assert propose(proposer, "a", s) == [10, 11]
    # Only a 1-gram match ("6"): below min_n, nothing is proposed.
    assert propose(NgramProposer(2, 2, 3), "b", state([6, 1, 2, 6])) == []
    assert propose(NgramProposer(2, 1, 3), "c", state([6, 1, 2, 6])) == [1, 2]


def test_the_index_follows_new_output_tokens() -> None:
    proposer = NgramProposer(num_tokens=3, min_n=2, max_n=2)
    s = state([1, 2, 3, 4])
    assert propose(proposer, "a", s) == []
    s.output_token_ids += [7, 1, 2]  # "1 2" now ends the sequence; it was followed by 3 4 7
    assert propose(proposer, "a", s, verified=(3, 3)) == [3, 4, 7]
    s.output_token_ids += [3, 4, 7]
    assert propose(proposer, "a", s, verified=(3, 3)) == [1, 2, 3]  # the latest match: "4 7" -> 1 2 3


def test_draft_length_adapts_to_acceptance() -> None:
    proposer = NgramProposer(num_tokens=5, min_n=1, max_n=1)
    s = state([1, 2, 3, 4, 5, 6, 7, 8, 1])
    assert len(propose(proposer, "a", s)) == 2
    assert len(propose(proposer, "a", s, verified=(2, 2))) == 5
    assert len(propose(proposer, "a", s, verified=(5, 0))) == 1
    assert len(propose(proposer, "a", s, verified=(1, 1))) == 5
    assert len(propose(proposer, "a", s, verified=(5, 3))) == 4
    assert len(propose(proposer, "a", s)) == 4  # no verification this step: the length stays
    assert len(propose(proposer, "a", s, max_tokens=2)) == 2  # the draft-length policy's limit comes first


def one_hot_rows(token_ids: list[int]) -> torch.Tensor:
    logits = torch.zeros(len(token_ids), VOCAB)
    logits[torch.arange(len(token_ids)), torch.tensor(token_ids)] = 5.0
    return logits


def test_verification_accepts_the_agreeing_prefix_then_samples() -> None:
    sampler = Sampler(VOCAB)
    states = [state([1]), state([2]), state([3]), state([4])]
    drafts = [[5, 6, 7], [5, 6], [], [9]]
    # Target argmax per row: request 0 agrees on 5, 6 then says 8 (7 rejected); request 1 agrees with both
    # drafts and gets a bonus token; request 2 has no drafts; request 3 is rejected at once.
    logits = one_hot_rows([5, 6, 8, 0, 5, 6, 11, 12, 3, 14])
    verified = sample_and_verify(sampler, logits, states, drafts)
    assert [(v.num_accepted, v.token_id) for v in verified] == [(2, 8), (2, 11), (0, 12), (0, 3)]
    assert [s.output_token_ids for s in states] == [[5, 6, 8], [5, 6, 11], [12], [3]]


def test_verification_applies_min_tokens_per_depth() -> None:
    # EOS (token 0) is the argmax everywhere; min_tokens=2 masks it for the first two new tokens only.
    sampler = Sampler(VOCAB)
    logits = torch.zeros(3, VOCAB)
    logits[:, 0] = 9.0
    logits[:, 4] = 5.0
    s = SamplingState(SamplingParams(temperature=0.0, min_tokens=2), [1], [], eos_token_ids=(0,))
    verified = sample_and_verify(sampler, logits, [s], [[4, 4]])
    assert (verified[0].num_accepted, verified[0].token_id) == (2, 0)
    assert s.output_token_ids == [4, 4, 0]


def test_seeded_sampling_draws_the_same_tokens_with_or_without_drafts() -> None:
    torch.manual_seed(0)
    rows = torch.randn(6, VOCAB)
    params = dict(temperature=1.0, seed=1234)
    plain_state = state([1, 2], **params)
    plain = []
    sampler = Sampler(VOCAB)
    for row in rows:
        token = sampler(row[None], [plain_state]).token_ids[0]
        plain_state.output_token_ids.append(token)
        plain.append(token)
    # Drafts that are the plain tokens are all accepted; a wrong draft is rejected and replaced by the same
    # token plain sampling drew there.
    spec_state = state([1, 2], **params)
    verified = sample_and_verify(Sampler(VOCAB), rows[:4], [spec_state], [plain[:3]])
    assert (verified[0].num_accepted, verified[0].token_id) == (3, plain[3])
    wrong = [plain[0], (plain[1] + 1) % VOCAB]
    spec_state = state([1, 2], **params)
    verified = sample_and_verify(Sampler(VOCAB), rows[:3], [spec_state], [wrong])
    assert (verified[0].num_accepted, verified[0].token_id) == (1, plain[1])
    assert spec_state.output_token_ids == plain[:2]


@pytest.mark.parametrize("text, message", [
    ("ngram", "not JSON"),
    ('["ngram"]', "JSON object"),
    ('{"method": "eagle"}', "one of 'none', 'ngram', 'draft_model'"),
    ('{"method": "draft_model"}', "method 'draft_model' needs the draft's 'model'"),
    ('{"method": "draft_model", "model": "m", "num_speculative_tokens": 17}',
     "num_speculative_tokens must be between 1 and 16, got 17"),
    ('{"method": "ngram", "model": "m"}', "'model' is the draft's, of method 'draft_model'"),
    ('{"method": "draft_model", "model": "m", "quantization": "int4"}', "quantization must be one of 'auto', 'gguf', 'none', 'q4_0'"),
    ('{"method": "ngram", "adaptive": "yes"}', "adaptive must be true or false"),
    ('{"method": "ngram", "num_speculative_tokens": 0}', "num_speculative_tokens must be an integer >= 1"),
    ('{"method": "ngram", "prompt_lookup_min": 3, "prompt_lookup_max": 2}', "prompt_lookup_min (3) must be <="),
    ('{"method": "ngram", "draft_model": "x"}', "unknown speculative config field(s) draft_model"),
    ('{"method": "ngram", "disable_by_batch_size": 0}', "disable_by_batch_size must be an integer >= 1"),
    ('{"method": "draft_model", "model": "m", "draft_vocab_size": 0}', "draft_vocab_size must be an integer >= 1"),
    ('{"method": "ngram", "draft_vocab_size": 4096}', "'draft_vocab_size' is the draft's, of method 'draft_model'"),
    ('{"method": "ngram", "prompt_lookup": true}', "'prompt_lookup' is the draft's, of method 'draft_model'"),
    ('{"method": "draft_model", "model": "m", "prompt_lookup": 1}', "prompt_lookup must be true or false"),
])
def test_bad_speculative_configs_are_refused_by_name(text: str, message: str) -> None:
    with pytest.raises(argparse.ArgumentTypeError, match=re.escape(message)):
        parse_speculative_config(text)


def test_speculative_config_in_vllm_spelling() -> None:
    config = parse_speculative_config('{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 5}')
    assert config == SpeculativeConfig(method="ngram", num_speculative_tokens=3, prompt_lookup_min=2,
                                       prompt_lookup_max=5)
    assert config.enabled and not SpeculativeConfig().enabled


def total_variation(counts: torch.Tensor, probs: torch.Tensor) -> float:
    return 0.5 * float((counts / counts.sum() - probs).abs().sum())


@pytest.mark.parametrize("draft_vocab", [VOCAB, VOCAB // 2], ids=["whole-vocabulary", "pruned-draft-vocabulary"])
def test_rejection_sampling_leaves_the_target_distribution_exact(draft_vocab: int) -> None:
    """Drafts sampled from a distribution q unlike the target's p: the tokens emitted (the first, and the
    second where the first draft was accepted) are distributed as p, over 30,000 seeded trials. A draft with
    a pruned vocabulary gives q over the first ids only: the others still come, from the residual."""
    generator = torch.Generator().manual_seed(0)
    num = 30_000
    target_logits = torch.randn(3, VOCAB, generator=generator) * 2  # depths 0, 1 and the bonus row
    params = SamplingParams(temperature=0.8, top_k=6, max_tokens=8)
    sampler = Sampler(VOCAB, base_seed=1)
    p = sampler.probabilities(target_logits, [SamplingState(params, [1], []) for _ in range(3)])
    # q puts mass where p has none (top_k drops two tokens): those drafts must always be rejected.
    q = torch.softmax(torch.randn(2, VOCAB, generator=generator)[:, :draft_vocab], dim=-1)
    drafts = torch.multinomial(q, num, replacement=True, generator=generator).T.tolist()  # [num, 2]
    states = [SamplingState(params, [1], []) for _ in range(num)]
    verified = sample_and_verify(sampler, target_logits.repeat(num, 1), states, drafts, [q] * num)

    first = torch.bincount(torch.tensor([s.output_token_ids[0] for s in states]), minlength=VOCAB).float()
    second = torch.bincount(torch.tensor([s.output_token_ids[1] for s in states if len(s.output_token_ids) > 1]),
                            minlength=VOCAB).float()
    assert total_variation(first, p[0]) < 0.015
    assert total_variation(second, p[1]) < 0.02
    assert second.sum() > 3_000  # enough first drafts were accepted to judge the second token
    # The test has power: taking the drafts as they come would give q, far from p.
    assert 0.5 * float((F.pad(q[0], (0, VOCAB - draft_vocab)) - p[0]).abs().sum()) > 0.2
    assert all(v.num_accepted + 1 == len(s.output_token_ids) for v, s in zip(verified, states, strict=True))


def test_rejection_sampling_is_reproducible_for_seeded_requests() -> None:
    generator = torch.Generator().manual_seed(3)
    target_logits = torch.randn(3, VOCAB, generator=generator)
    q = torch.softmax(torch.randn(2, VOCAB, generator=generator), dim=-1)
    drafts = [[int(t) for t in torch.multinomial(q, 1, generator=generator).squeeze(1)] for _ in range(64)]

    def run(base_seed: int) -> list[list[int]]:
        states = [SamplingState(SamplingParams(temperature=1.0, seed=100 + i), [1], []) for i in range(64)]
        sample_and_verify(Sampler(VOCAB, base_seed), target_logits.repeat(64, 1), states, drafts, [q] * 64)
        return [s.output_token_ids for s in states]

    first = run(0)
    assert run(1) == first  # another base seed: seeded requests do not depend on it
    assert len({tuple(tokens) for tokens in first}) > 10


def test_sampled_drafts_a_grammar_refuses_are_verified_not_cut() -> None:
    """Drafts sampled from q, which puts mass on tokens a grammar refuses (here 6 and 7: the target's masked
    logits give them no probability). Keeping the first refused draft for verification leaves the emitted
    token distributed as p; cutting it (the next token then sampled afresh) would not."""
    generator = torch.Generator().manual_seed(3)
    num = 30_000
    target_logits = torch.randn(2, VOCAB, generator=generator) * 2
    target_logits[:, 6:] = float("-inf")  # what the grammar's mask leaves of the target's logits
    params = SamplingParams(temperature=1.0, max_tokens=8)
    sampler = Sampler(VOCAB, base_seed=2)
    p = sampler.probabilities(target_logits[:1], [SamplingState(params, [1], [])])[0]
    # The draft: half its mass on the token the target likes most, half on what the grammar refuses.
    q = torch.zeros(1, VOCAB)
    q[0, int(torch.argmax(p))] = 0.5
    q[0, 6:] = 0.5 / (VOCAB - 6)
    sampled = torch.multinomial(q, num, replacement=True, generator=generator)[0].tolist()

    def emitted(cut: Callable[[list[int]], list[int]]) -> torch.Tensor:
        drafts = [cut([d]) for d in sampled]
        states = [SamplingState(params, [1], []) for _ in range(num)]
        rows = torch.cat([target_logits[: 1 + len(d)] for d in drafts])
        sample_and_verify(sampler, rows, states, drafts, [q if d else None for d in drafts])
        return torch.bincount(torch.tensor([s.output_token_ids[0] for s in states]), minlength=VOCAB).float()

    def num_valid(d: list[int]) -> int:
        return 0 if d[0] >= 6 else 1

    kept = emitted(lambda d: drafts_within_grammar(d, num_valid(d), sampled=True))
    assert total_variation(kept, p) < 0.015
    cut = emitted(lambda d: d[: num_valid(d)])  # the refused draft cut: the next token sampled afresh
    assert total_variation(cut, p) > 0.1


def test_a_draft_vocabulary_without_any_allowed_token_drafts_nothing_that_is_kept() -> None:
    """allowed_token_ids past a (pruned) draft vocabulary leave the draft's row no token: its distribution is
    all zeros (softmax over -inf everywhere was NaN, and the NaN residual then emitted token 0). The draft
    drawn from it is rejected and the token comes from the target's own distribution: an allowed one."""
    params = SamplingParams(temperature=0.9, allowed_token_ids=(VOCAB - 2, VOCAB - 1), max_tokens=4)
    draft_states = [SamplingState(params, [1], []) for _ in range(50)]
    q = Sampler(VOCAB // 2).probabilities(torch.randn(50, VOCAB // 2), draft_states)
    assert torch.equal(q, torch.zeros(50, VOCAB // 2))
    drafts = [[token] for token in Sampler(VOCAB // 2).sample_from(q, draft_states)]
    states = [SamplingState(params, [1], []) for _ in range(50)]
    sample_and_verify(Sampler(VOCAB), torch.randn(2, VOCAB).repeat(50, 1), states, drafts, list(q[:, None, :]))
    emitted = {token for s in states for token in s.output_token_ids}
    assert emitted <= {VOCAB - 2, VOCAB - 1} and len(emitted) == 2
