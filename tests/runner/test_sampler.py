from __future__ import annotations

import dataclasses
import math
import random

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvserve.errors import InvalidSamplingParams
from kvserve.runner.sampler import (
    Sampler,
    SamplingState,
    apply_logit_bias,
    apply_penalties,
    apply_top_k_top_p_min_p,
    refuse_tokens,
    row_seed,
    suppress_stop_tokens,
)
from kvserve.sampling_params import SamplingParams

NEG_INF = float("-inf")
DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def state(
    prompt: list[int] | None = None,
    output: list[int] | None = None,
    eos: tuple[int, ...] = (),
    **params: object,
) -> SamplingState:
    return SamplingState(SamplingParams(**params), list(prompt or [0]), list(output or []), eos)


def kept(masked: torch.Tensor) -> list[set[int]]:
    return [set(torch.nonzero(torch.isfinite(row)).flatten().tolist()) for row in masked]


def log_probs(*probs: float) -> list[float]:
    # Powers of two: softmax of these logits is exact in float32, so mass boundaries are exact too.
    return [math.log(p) for p in probs]


def step_logits(key: int, step: int, vocab_size: int) -> torch.Tensor:
    """The logits a model would give request ``key`` at output step ``step``: a fixed function of both."""
    generator = torch.Generator().manual_seed(key * 1000 + step)
    return torch.randn(vocab_size, generator=generator) * 2.0  # [V]


def chi_square(token_ids: list[int], probs: torch.Tensor) -> float:
    counts = torch.bincount(torch.tensor(token_ids), minlength=probs.shape[0]).double()
    expected = probs.double() * len(token_ids)
    return float(((counts - expected) ** 2 / expected).sum())


# --- greedy ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_greedy_equals_argmax(device: str, dtype: torch.dtype) -> None:
    logits = torch.randn(8, 50, generator=torch.Generator().manual_seed(0)).to(device, dtype)
    out = Sampler(50)(logits, [state(temperature=0.0) for _ in range(8)])
    assert out.token_ids == logits.float().argmax(-1).tolist()
    assert out.logprobs == [None] * 8


def test_greedy_ties_pick_lowest_index_on_both_paths() -> None:
    logits = torch.tensor([[1.0, 3.0, 3.0, 0.0], [5.0, 5.0, 5.0, 5.0], [0.0, 0.0, 2.0, 2.0]])
    fast = Sampler(4)(logits, [state(temperature=0.0) for _ in range(3)])
    assert fast.token_ids == [1, 0, 2]
    # Logprobs force the general (float32, penalised) path: same answer.
    slow = Sampler(4)(logits, [state(temperature=0.0, logprobs=0) for _ in range(3)])
    assert slow.token_ids == [1, 0, 2]


def test_all_greedy_batch_takes_the_fast_path(monkeypatch: pytest.MonkeyPatch) -> None:
    def fail(*args: object) -> None:
        raise AssertionError("general path taken")

    sampler = Sampler(6)
    monkeypatch.setattr(sampler, "_sample", fail)
    logits = torch.tensor([[0.0, 1.0, 9.0, 2.0, 0.0, 0.0]] * 2)
    # min_tokens with nothing to suppress (no eos, no stop ids) and a reached min_tokens stay on the fast path.
    states = [
        state(temperature=0.0, min_tokens=3),
        state(output=[1, 1], eos=(2,), temperature=0.0, min_tokens=2),
    ]
    assert sampler(logits, states).token_ids == [2, 2]
    # An active min_tokens masks eos on the fast path too, on a copy: the caller's logits stay as they were.
    step_logits = logits[:1].clone()
    assert sampler(step_logits, [state(temperature=0.0, eos=(2,), min_tokens=1)]).token_ids == [3]
    assert torch.equal(step_logits, logits[:1])
    for params in ({"temperature": 0.0, "repetition_penalty": 1.2}, {"temperature": 0.0, "logprobs": 1},
                   {"temperature": 0.5}):
        with pytest.raises(AssertionError, match="general path"):
            sampler(logits[:1], [state(**params)])


def test_the_argmax_hook_replaces_torch_argmax() -> None:
    calls = []

    def argmax(logits: torch.Tensor) -> torch.Tensor:
        calls.append(tuple(logits.shape))
        return torch.tensor([1] * logits.shape[0])

    sampler = Sampler(6, argmax=argmax)
    logits = torch.tensor([[0.0, 1.0, 9.0, 2.0, 0.0, 0.0]] * 2)
    assert sampler(logits, [state(temperature=0.0)] * 2).token_ids == [1, 1]
    assert sampler(logits, [state(temperature=0.0, frequency_penalty=0.5)] * 2).token_ids == [1, 1]
    assert calls == [(2, 6), (2, 6)]


def test_padded_vocab_columns_are_never_sampled() -> None:
    logits = torch.zeros(4, 12)
    logits[:, 10:] = 100.0  # padding columns beyond the real vocabulary
    states = [
        state(temperature=0.0),
        state(temperature=1.0, seed=1),
        state(temperature=1.0),
        state(logprobs=20),
    ]
    out = Sampler(10)(logits, states)
    assert all(0 <= t < 10 for t in out.token_ids)
    assert out.logprobs[3] is not None and len(out.logprobs[3]) == 10  # clamped to the vocabulary


def test_sampler_mutates_neither_logits_nor_states() -> None:
    logits = torch.randn(3, 20, generator=torch.Generator().manual_seed(3))
    before = logits.clone()
    states = [
        state(
            prompt=[1, 2],
            output=[3, 3],
            eos=(4,),
            repetition_penalty=1.5,
            frequency_penalty=1.0,
            min_tokens=5,
        ),
        state(output=[5], temperature=0.9, top_k=5, top_p=0.8, min_p=0.1, seed=7, presence_penalty=0.5),
        state(temperature=0.0, logprobs=2),
    ]
    Sampler(20)(logits, states)
    assert torch.equal(logits, before)
    assert [s.output_token_ids for s in states] == [[3, 3], [5], []]


# --- top-k / top-p / min-p on hand-built logits -----------------------------------------------------------
def test_top_k_keeps_exactly_the_k_largest() -> None:
    logits = torch.tensor(
        [[1.0, 5.0, 3.0, 4.0], [5.0, 4.0, 4.0, 1.0], [2.0, 2.0, 2.0, 2.0], [1.0, 2.0, 3.0, 4.0]]
    )
    top_k = torch.tensor([2, 2, 3, 1])
    masked = apply_top_k_top_p_min_p(logits, top_k=top_k)
    # Ties at the boundary go to the lowest id: exactly k survive.
    assert kept(masked) == [{1, 3}, {0, 1}, {0, 1, 2}, {3}]
    survivors = torch.isfinite(masked)
    assert torch.equal(masked[survivors], logits[survivors])  # kept logits are untouched


def test_top_k_ties_are_broken_by_lowest_id_in_a_large_vocab() -> None:
    logits = torch.zeros(2, 5000)
    logits[1, 4000:] = 1.0  # 1000 tied leaders
    masked = apply_top_k_top_p_min_p(logits, top_k=torch.tensor([3, 2]))
    assert kept(masked) == [{0, 1, 2}, {4000, 4001}]
    # top-p ties too: 2/400 of the mass among 400 equal tokens needs exactly the first two
    masked = apply_top_k_top_p_min_p(torch.zeros(1, 400), top_p=torch.tensor([2 / 400]))
    assert kept(masked) == [{0, 1}]


def test_top_p_one_keeps_a_tail_that_float_rounding_would_lose() -> None:
    # p(0) rounds to exactly 1.0 in float32, so the mass before each tail token is already 1.0.
    logits = torch.tensor([[0.0, -20.0, -20.0, -25.0]])
    assert kept(apply_top_k_top_p_min_p(logits, top_p=torch.tensor([1.0]))) == [{0, 1, 2, 3}]
    assert kept(apply_top_k_top_p_min_p(logits, top_p=torch.tensor([0.999]))) == [{0}]


def test_disabled_filters_leave_logits_unchanged() -> None:
    logits = torch.randn(4, 9, generator=torch.Generator().manual_seed(1))
    masked = apply_top_k_top_p_min_p(
        logits,
        top_k=torch.tensor([0, -1, 9, 100]),
        top_p=torch.ones(4),
        min_p=torch.zeros(4),
    )
    assert torch.equal(masked, logits)


@pytest.mark.parametrize(
    ("top_p", "expected"),
    [
        (1e-6, {0}),
        (0.5, {0}),  # the top token alone reaches 0.5 exactly
        (0.5001, {0, 1}),
        (0.75, {0, 1}),  # 0.5 + 0.25 reaches it exactly: the third token is not needed
        (0.7501, {0, 1, 2}),
        (0.875, {0, 1, 2}),
        (0.9, {0, 1, 2, 3}),
        (1.0, {0, 1, 2, 3}),
    ],
)
def test_top_p_keeps_smallest_set_reaching_the_mass(top_p: float, expected: set[int]) -> None:
    # Shuffled order so the test also checks the sort and the scatter back.
    probs = {2: 0.5, 0: 0.25, 3: 0.125, 1: 0.125}
    logits = torch.tensor([log_probs(*(probs[i] for i in range(4)))])
    rank_to_id = [2, 0, 1, 3]  # descending, ties by lowest id
    masked = apply_top_k_top_p_min_p(logits, top_p=torch.tensor([top_p]))
    assert kept(masked) == [{rank_to_id[r] for r in expected}]


def test_top_p_renormalises_after_top_k() -> None:
    logits = torch.tensor([log_probs(0.5, 0.25, 0.125, 0.125)] * 2)
    # After top-k = 2 the mass is [2/3, 1/3]: 0.6 is reached by the first token alone
    # (without renormalisation 0.5 < 0.6 would keep two).
    masked = apply_top_k_top_p_min_p(logits, top_k=torch.tensor([2, 0]), top_p=torch.tensor([0.6, 0.6]))
    assert kept(masked) == [{0}, {0, 1}]


@pytest.mark.parametrize(
    ("min_p", "expected"),
    [(0.0, {0, 1, 2, 3}), (0.25, {0, 1, 2, 3}), (0.3, {0, 1}), (0.5, {0, 1}), (0.51, {0}), (1.0, {0})],
)
def test_min_p_drops_tokens_below_fraction_of_max(min_p: float, expected: set[int]) -> None:
    logits = torch.tensor([log_probs(0.5, 0.25, 0.125, 0.125)])
    masked = apply_top_k_top_p_min_p(logits, min_p=torch.tensor([min_p]))
    assert kept(masked) == [expected]


def test_filters_are_per_row() -> None:
    logits = torch.tensor([log_probs(0.5, 0.25, 0.125, 0.125)] * 3)
    masked = apply_top_k_top_p_min_p(
        logits,
        top_k=torch.tensor([3, 0, 0]),
        top_p=torch.tensor([1.0, 0.7, 1.0]),
        min_p=torch.tensor([0.0, 0.0, 0.5]),
    )
    assert kept(masked) == [{0, 1, 2}, {0, 1}, {0, 1}]


# --- top-k / top-p over many draws -----------------------------------------------------------------------
def test_top_k_draws_only_ever_produce_the_top_k() -> None:
    logits_row = torch.tensor([0.1, 2.0, -1.0, 1.9, 0.0, 1.8, 0.5, 1.7, -3.0, 0.2])
    top4 = {1, 3, 5, 7}
    num = 600
    states = [state(temperature=1.5, top_k=4, seed=i) for i in range(num // 2)]
    states += [state(temperature=1.5, top_k=4) for _ in range(num // 2)]
    out = Sampler(10, base_seed=0)(logits_row.repeat(num, 1), states)
    assert set(out.token_ids) == top4  # only the top 4, and each of them shows up


def test_top_p_draws_only_ever_produce_the_nucleus() -> None:
    logits_row = torch.tensor(log_probs(0.125, 0.5, 0.0625, 0.25, 0.0625))
    states = [state(top_p=0.8, seed=i) for i in range(400)]
    out = Sampler(5)(logits_row.repeat(400, 1), states)
    assert set(out.token_ids) == {1, 3, 0}  # 0.5 + 0.25 < 0.8, so the 0.125 token is needed too


# --- penalties -------------------------------------------------------------------------------------------
def test_penalties_match_hand_computed_logits() -> None:
    logits = torch.tensor([[2.0, -1.0, 0.5, 3.0, -2.0]] * 4)
    states = [
        # repetition 2 over prompt + output {0, 1, 2}: 2/2, -1*2, 0.5/2
        state(prompt=[0, 1], output=[1, 2, 2], repetition_penalty=2.0),
        # output counts {1: 1, 2: 2}: -= 0.5*count + 0.25; the prompt token 0 is not penalised
        state(prompt=[0, 1], output=[1, 2, 2], frequency_penalty=0.5, presence_penalty=0.25),
        # both, repetition first: 1 → -2 - 0.75, 2 → 0.25 - 1.25
        state(
            prompt=[0, 1],
            output=[1, 2, 2],
            repetition_penalty=2.0,
            frequency_penalty=0.5,
            presence_penalty=0.25,
        ),
        # negative presence (allowed by OpenAI) raises seen tokens; rep < 1 raises positives
        state(prompt=[3], output=[4], repetition_penalty=0.5, presence_penalty=-1.0),
    ]
    expected = torch.tensor(
        [
            [1.0, -2.0, 0.25, 3.0, -2.0],
            [2.0, -1.75, -0.75, 3.0, -2.0],
            [1.0, -2.75, -1.0, 3.0, -2.0],
            [2.0, -1.0, 0.5, 6.0, -0.0],
        ]
    )
    torch.testing.assert_close(apply_penalties(logits.clone(), states), expected)

    # The sampler's logprobs are the log-softmax of exactly these penalised logits.
    lp_states = [dataclasses.replace(s, params=dataclasses.replace(s.params, logprobs=5)) for s in states]
    out = Sampler(5)(logits, lp_states)
    for row, lp in zip(torch.log_softmax(expected, -1), out.logprobs, strict=True):
        assert lp is not None
        torch.testing.assert_close(torch.tensor([lp[i] for i in range(5)]), row)


def test_penalties_change_the_greedy_choice() -> None:
    logits = torch.tensor([[3.0, 2.9, 0.0]] * 3)
    states = [
        state(output=[0], temperature=0.0, presence_penalty=0.5),
        state(prompt=[0], temperature=0.0, repetition_penalty=1.1),
        state(prompt=[0], temperature=0.0, frequency_penalty=2.0),  # prompt tokens: no frequency penalty
    ]
    assert Sampler(3)(logits, states).token_ids == [1, 1, 0]


# --- logit_bias -----------------------------------------------------------------------------------------
def test_logit_bias_adds_to_the_chosen_logits_and_steers_greedy_and_logprobs() -> None:
    logits = torch.tensor([[3.0, 2.9, 0.0, 1.0]] * 3)
    states = [
        state(temperature=0.0, logit_bias={1: 0.5}),  # 2.9 + 0.5 beats 3.0
        state(temperature=0.0, logit_bias={0: -100.0, 3: 1.5}),  # 0 banned; 1.0 + 1.5 = 2.5 < 2.9
        state(temperature=0.0),  # no bias: its row is untouched
    ]
    biased = logits.clone()
    apply_logit_bias(biased, states)
    torch.testing.assert_close(biased, torch.tensor([[3.0, 3.4, 0.0, 1.0], [-97.0, 2.9, 0.0, 2.5],
                                                     [3.0, 2.9, 0.0, 1.0]]))
    assert Sampler(4)(logits, states).token_ids == [1, 1, 0]
    # Logprobs are of the biased logits (as OpenAI and vLLM report them); sampling at any temperature
    # never picks a token banned with -100 against a logit 100 below the rest.
    with_lp = [dataclasses.replace(s, params=dataclasses.replace(s.params, logprobs=4)) for s in states[:1]]
    lp = Sampler(4)(logits[:1], with_lp).logprobs[0]
    torch.testing.assert_close(torch.tensor([lp[i] for i in range(4)]), torch.log_softmax(biased[0], -1))
    hot = [state(temperature=1.0, seed=s, logit_bias={0: -100.0, 1: -100.0}) for s in range(200)]
    assert not {0, 1} & set(Sampler(4)(logits[:1].expand(200, 4), hot).token_ids)


@pytest.mark.parametrize("bias", [{0: 100.5}, {0: float("nan")}, {-1: 1.0}, {"3": 1.0}, {True: 1.0},
                                  {i: 1.0 for i in range(1025)}])
def test_invalid_logit_bias_is_refused(bias) -> None:
    with pytest.raises(InvalidSamplingParams) as info:
        SamplingParams(logit_bias=bias)
    assert info.value.param == "logit_bias"


# --- allowed_token_ids and bad_words ----------------------------------------------------------------------
def test_allowed_token_ids_and_bad_words_refuse_their_tokens_and_nothing_else() -> None:
    """allowed_token_ids keeps its tokens (ids past the logits, a smaller draft vocabulary's, left out); a bad
    word's last token is refused where the output ends with its other tokens, and only there."""
    logits = torch.arange(10.0).expand(5, 10).contiguous()
    words = ((9,), (7, 8), (1, 2, 6))
    states = [
        state(temperature=0.0, allowed_token_ids=(2, 5, 40)),
        state(temperature=0.0, output=[3, 7], bad_words_token_ids=words),  # ends with 7: 8 and 9 refused
        state(temperature=0.0, output=[2], bad_words_token_ids=words),  # 1, 2 not both there: 6 stays
        state(temperature=0.0, output=[1, 2], bad_words_token_ids=words, allowed_token_ids=(6, 8, 9)),
        state(temperature=0.0),  # neither: untouched
    ]
    refused = logits.clone()
    refuse_tokens(refused, states, [0, 1, 2, 3])
    assert kept(refused) == [{2, 5}, set(range(8)), set(range(9)), {8}, set(range(10))]
    assert Sampler(10)(logits, states).token_ids == [5, 7, 8, 8, 9]
    # Sampled rows, and their logprobs, see the same refusals; the caller's logits stay as they were.
    hot = [state(temperature=1.0, seed=s, logprobs=2, output=[7], bad_words_token_ids=words,
                 allowed_token_ids=(0, 8, 9)) for s in range(50)]
    out = Sampler(10)(logits[:1].expand(50, 10), hot)
    assert set(out.token_ids) == {0}
    assert all(lp[0] == 0.0 and all(v == NEG_INF for t, v in lp.items() if t != 0) for lp in out.logprobs)
    assert torch.equal(logits, torch.arange(10.0).expand(5, 10))


@pytest.mark.parametrize(("field", "value"), [("allowed_token_ids", ()), ("allowed_token_ids", (1, -2)),
                                              ("allowed_token_ids", (True,)), ("bad_words", ("ok", "  ")),
                                              ("bad_words", ("",)), ("bad_words", ("x" * 1025,)),
                                              ("bad_words", ("w",) * 1025), ("truncate_prompt_tokens", 0),
                                              ("truncate_prompt_tokens", -2), ("cache_salt", "")])
def test_invalid_token_restrictions_truncation_and_salt_are_refused(field: str, value: object) -> None:
    with pytest.raises(InvalidSamplingParams) as info:
        SamplingParams(**{field: value})
    assert info.value.param == field


# --- min_tokens ------------------------------------------------------------------------------------------
def test_min_tokens_suppresses_eos_and_stop_ids_until_reached() -> None:
    logits = torch.tensor([[0.0, 1.0, 2.0, 5.0, 0.0, 4.0]])  # eos 3 best, stop id 5 second
    sampler = Sampler(6)

    def pick(num_output: int, **params: object) -> int:
        s = state(
            output=[0] * num_output, eos=(3,), temperature=0.0, min_tokens=2, stop_token_ids=(5, 99), **params
        )
        return sampler(logits, [s]).token_ids[0]

    assert pick(0) == 2
    assert pick(1) == 2
    assert pick(2) == 3
    assert pick(0, ignore_eos=True) == 2  # ignore_eos changes stopping, not the logits

    masked = logits.clone()
    suppress_stop_tokens(masked, [state(eos=(3,), min_tokens=1, stop_token_ids=(5, 99))])
    assert kept(masked) == [{0, 1, 2, 4}]

    # Sampled rows never draw a suppressed token either, and report it as -inf when asked.
    states = [state(eos=(3,), min_tokens=1, stop_token_ids=(5,), seed=i, logprobs=6) for i in range(200)]
    out = sampler(logits.repeat(200, 1), states)
    assert not {3, 5} & set(out.token_ids)
    assert out.logprobs[0] is not None and out.logprobs[0][3] == NEG_INF


# --- seeds and distributions -----------------------------------------------------------------------------
def _run_alone(
    params: SamplingParams, key: int, num_steps: int, vocab_size: int, base_seed: int
) -> list[int]:
    sampler = Sampler(vocab_size, base_seed=base_seed)
    s = SamplingState(params, [1, 2, 3], [], (0,))
    for step in range(num_steps):
        s.output_token_ids.append(sampler(step_logits(key, step, vocab_size).unsqueeze(0), [s]).token_ids[0])
    return s.output_token_ids


@pytest.mark.parametrize("device", DEVICES)
def test_seeded_request_is_reproducible_in_any_batch_and_after_preemption(device: str) -> None:
    vocab_size, num_steps = 300, 20
    target = SamplingParams(temperature=0.8, top_k=50, top_p=0.95, seed=1234, repetition_penalty=1.1)
    alone = _run_alone(target, key=0, num_steps=num_steps, vocab_size=vocab_size, base_seed=0)

    others = [
        SamplingParams(temperature=1.0, seed=99),
        SamplingParams(temperature=0.5, top_k=3, min_p=0.2),  # unseeded: uses the shared generator
        SamplingParams(temperature=0.0, logprobs=2),
        SamplingParams(temperature=1.3, top_p=0.5, frequency_penalty=0.5),
    ]
    states = [SamplingState(target, [1, 2, 3], [], (0,))]
    states += [SamplingState(p, [4, 5], [], (0,)) for p in others]
    keys = list(range(len(states)))
    sampler = Sampler(vocab_size, base_seed=7)
    rng = random.Random(0)
    for step in range(num_steps):
        order = keys[:]
        rng.shuffle(order)
        logits = torch.stack([step_logits(k, step, vocab_size) for k in order]).to(device)
        out = sampler(logits, [states[k] for k in order])
        for k, token in zip(order, out.token_ids, strict=True):
            states[k].output_token_ids.append(token)
    assert states[0].output_token_ids == alone

    # Preempted after 10 tokens, replayed by a fresh sampler: the same continuation.
    replayed = SamplingState(target, [1, 2, 3], alone[:10], (0,))
    fresh = Sampler(vocab_size, base_seed=12345)
    for step in range(10, num_steps):
        logits = step_logits(0, step, vocab_size).unsqueeze(0).to(device)
        replayed.output_token_ids.append(fresh(logits, [replayed]).token_ids[0])
    assert replayed.output_token_ids == alone


def test_different_seeds_give_different_tokens() -> None:
    base = dict(temperature=1.0)
    runs = [
        _run_alone(SamplingParams(seed=seed, **base), key=0, num_steps=20, vocab_size=300, base_seed=0)
        for seed in (1, 2, 1)
    ]
    assert runs[0] == runs[2]
    assert runs[0] != runs[1]
    assert len({row_seed(seed, step) for seed in range(50) for step in range(50)}) == 2500


def test_seeded_noise_changes_from_step_to_step() -> None:
    # Same logits every step: a seed alone (without the step) would repeat the same token forever.
    sampler = Sampler(50)
    s = state(temperature=1.0, seed=3)
    for _ in range(20):
        s.output_token_ids.append(sampler(torch.zeros(1, 50), [s]).token_ids[0])
    assert len(set(s.output_token_ids)) > 10


def test_unseeded_rows_follow_the_base_seed() -> None:
    logits = torch.randn(16, 100, generator=torch.Generator().manual_seed(0))
    states = [state(temperature=1.0) for _ in range(16)]
    a = Sampler(100, base_seed=5)(logits, states).token_ids
    assert a == Sampler(100, base_seed=5)(logits, states).token_ids
    assert a != Sampler(100, base_seed=6)(logits, states).token_ids


@pytest.mark.parametrize("seeded", [False, True])
def test_temperature_sampling_matches_softmax(seeded: bool) -> None:
    logits_row = torch.tensor([2.0, 1.0, 0.5, 0.0, -0.5, -1.0])
    temperature, num = 0.7, 4000
    states = [state(temperature=temperature, seed=i if seeded else None) for i in range(num)]
    token_ids = Sampler(6, base_seed=0)(logits_row.repeat(num, 1), states).token_ids
    # Fixed seeds: deterministic, so this cannot flake. 5 degrees of freedom: P(chi2 > 25) ~ 1e-4.
    assert chi_square(token_ids, torch.softmax(logits_row / temperature, -1)) < 25
    # ...and the check has teeth: the same draws are far from the temperature-1 distribution.
    assert chi_square(token_ids, torch.softmax(logits_row, -1)) > 100


# --- logprobs --------------------------------------------------------------------------------------------
def test_logprobs_are_log_softmax_top_n_sorted_and_include_the_sampled_token() -> None:
    logits = torch.randn(4, 30, generator=torch.Generator().manual_seed(2)) * 3
    states = [
        state(temperature=0.5, logprobs=3, seed=1),  # before temperature: plain log_softmax
        state(temperature=0.0, logprobs=0),
        state(temperature=1.0),
        state(temperature=2.0, logprobs=5, top_k=20, seed=3),
    ]
    out = Sampler(30)(logits, states)
    expected = torch.log_softmax(logits, -1)
    assert out.logprobs[2] is None
    assert out.logprobs[1] == {out.token_ids[1]: pytest.approx(expected[1, out.token_ids[1]].item())}
    for i, n in ((0, 3), (3, 5)):
        lp = out.logprobs[i]
        assert lp is not None
        token = out.token_ids[i]
        assert token in lp
        top = list(lp.items())[:n]
        assert [t for t, _ in top] == expected[i].topk(n).indices.tolist()
        values = [v for _, v in top]
        assert values == sorted(values, reverse=True)
        assert len(lp) == n + (token not in dict(top))
        for t, v in lp.items():
            assert v == pytest.approx(expected[i, t].item(), abs=1e-5)


def test_logprobs_report_a_sampled_token_outside_the_top_n() -> None:
    logits = torch.tensor([[5.0, 4.0, 3.0, 2.0]] * 300)
    states = [state(temperature=2.0, logprobs=1, seed=i) for i in range(300)]
    out = Sampler(4)(logits, states)
    outside = [(t, lp) for t, lp in zip(out.token_ids, out.logprobs, strict=True) if t != 0]
    assert outside  # with temperature 2 some draws miss the top token
    for token, lp in outside:
        assert lp is not None and list(lp) == [0, token]


# --- property: whatever the params, the token is one the filters allow ------------------------------------
def _reference_allowed(logits: list[float], s: SamplingState) -> set[int]:
    """Independent float64 reference of what may be sampled, lenient by a tolerance at every boundary."""
    p, vocab_size, tol = s.params, len(logits), 1e-4
    x = list(logits)
    if len(s.output_token_ids) < p.min_tokens:
        for t in (*s.eos_token_ids, *p.stop_token_ids):
            if t < vocab_size:
                x[t] = NEG_INF
    seen = set(s.prompt_token_ids) | set(s.output_token_ids)
    for t in seen:
        if p.repetition_penalty != 1.0:
            x[t] = x[t] / p.repetition_penalty if x[t] > 0 else x[t] * p.repetition_penalty
    for t in set(s.output_token_ids):
        count = s.output_token_ids.count(t)
        x[t] -= p.frequency_penalty * count + p.presence_penalty
    finite = [i for i in range(vocab_size) if x[i] != NEG_INF]
    best = max(x[i] for i in finite)
    if p.is_greedy:
        return {i for i in finite if x[i] >= best - tol}
    y = {i: x[i] / p.temperature for i in finite}
    order = sorted(y, key=lambda i: (-y[i], i))
    k = len(order) if p.top_k <= 0 else min(p.top_k, len(order))
    allowed = {i for i in order if y[i] >= y[order[k - 1]] - tol}
    if p.top_p < 1:
        head = order[:k]
        weights = [math.exp(y[i] - y[head[0]]) for i in head]
        total, mass, nucleus = sum(weights), 0.0, set()
        for i, w in zip(head, weights, strict=True):
            if mass < p.top_p + tol:
                nucleus.add(i)
            mass += w / total
        floor = min(y[i] for i in nucleus)
        allowed &= {i for i in y if y[i] >= floor - tol}
    if p.min_p > 0:
        allowed &= {i for i in y if math.exp(y[i] - y[order[0]]) >= p.min_p - tol}
    return allowed


@st.composite
def batches(draw: st.DrawFn) -> tuple[torch.Tensor, list[SamplingState], int]:
    vocab_size = draw(st.integers(2, 24))
    num_rows = draw(st.integers(1, 4))
    value = st.one_of(st.integers(-4, 4).map(float), st.floats(-8, 8, allow_nan=False, width=32))
    rows = [draw(st.lists(value, min_size=vocab_size, max_size=vocab_size)) for _ in range(num_rows)]
    token = st.integers(0, vocab_size - 1)
    states = []
    for _ in range(num_rows):
        eos = tuple(draw(st.lists(token, max_size=2)))
        stop_ids = tuple(draw(st.lists(st.integers(0, vocab_size + 3), max_size=2)))
        if len({*eos, *stop_ids} & set(range(vocab_size))) >= vocab_size:
            eos, stop_ids = (), ()  # nothing left to sample: not a request a tokenizer produces
        params = SamplingParams(
            temperature=draw(st.one_of(st.just(0.0), st.floats(0.1, 2.0))),
            top_k=draw(st.integers(-1, vocab_size + 2)),
            top_p=draw(st.one_of(st.just(1.0), st.floats(0.05, 1.0))),
            min_p=draw(st.one_of(st.just(0.0), st.floats(0.0, 1.0))),
            repetition_penalty=draw(st.one_of(st.just(1.0), st.floats(0.5, 2.0))),
            frequency_penalty=draw(st.one_of(st.just(0.0), st.floats(-2.0, 2.0))),
            presence_penalty=draw(st.one_of(st.just(0.0), st.floats(-2.0, 2.0))),
            seed=draw(st.one_of(st.none(), st.integers(-(2**70), 2**70))),
            min_tokens=draw(st.integers(0, 3)),
            stop_token_ids=stop_ids,
            logprobs=draw(st.one_of(st.none(), st.integers(0, 20))),
        )
        states.append(
            SamplingState(
                params, draw(st.lists(token, min_size=1, max_size=6)), draw(st.lists(token, max_size=6)), eos
            )
        )
    padding = draw(st.integers(0, 3))
    logits = torch.tensor(rows)
    if padding:
        logits = torch.cat([logits, torch.full((num_rows, padding), 50.0)], dim=1)
    return logits, states, vocab_size


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(batches(), st.integers(0, 2**31))
def test_sampled_tokens_are_always_allowed(
    batch: tuple[torch.Tensor, list[SamplingState], int], base_seed: int
) -> None:
    logits, states, vocab_size = batch
    out = Sampler(vocab_size, base_seed=base_seed)(logits, states)
    assert len(out.token_ids) == len(states) == len(out.logprobs)
    for i, (token, s) in enumerate(zip(out.token_ids, states, strict=True)):
        assert 0 <= token < vocab_size
        assert token in _reference_allowed(logits[i, :vocab_size].tolist(), s)
        if s.params.logprobs is None:
            assert out.logprobs[i] is None
        else:
            lp = out.logprobs[i]
            assert lp is not None and token in lp
            assert all(0 <= t < vocab_size and v <= 1e-6 for t, v in lp.items())
            assert len(lp) - (token not in list(lp)[: s.params.logprobs]) == min(
                s.params.logprobs, vocab_size
            )


# --- extreme but valid parameters -----------------------------------------------------------------------
def test_a_huge_top_k_beside_a_real_one_samples_without_overflow() -> None:
    """top_k = 2**63 means no filter; batched with a row that filters, it must not overflow int64."""
    logits = torch.randn(2, 50, generator=torch.Generator().manual_seed(3))
    tokens = Sampler(50)(logits, [state(temperature=1.0, top_k=2**63), state(temperature=1.0, top_k=1)])
    assert 0 <= tokens.token_ids[0] < 50
    assert tokens.token_ids[1] == int(logits[1].argmax())


@pytest.mark.parametrize("params", [{"temperature": 1e-40}, {"temperature": 1e-6},
                                    {"temperature": 1.0, "top_p": 1e-300}])
def test_vanishing_temperature_or_top_p_picks_the_top_token(params: dict[str, float]) -> None:
    """Values that are 0 in float32 (or nearly) once divided into the logits: greedy, never NaN or token 0."""
    logits = torch.randn(4, 50, generator=torch.Generator().manual_seed(4))
    logits[:, 0] = -5.0
    tokens = Sampler(50)(logits, [state(**params) for _ in range(4)])
    assert tokens.token_ids == logits.argmax(dim=-1).tolist()


def test_a_vanishing_repetition_penalty_keeps_sampling_finite() -> None:
    """1e-308 is 0 in float32: the seen token's logit divided by it must not become inf (softmax NaN)."""
    logits = torch.full((1, 50), -1.0)
    logits[0, 7] = 0.5  # seen in the prompt, positive: the penalty below 1 boosts it without bound
    penalised = apply_penalties(logits, [state(prompt=[7], repetition_penalty=1e-308)])
    assert torch.isfinite(penalised).all()
    for seed in range(5):
        tokens = Sampler(50)(logits, [state(prompt=[7], temperature=1.0, seed=seed, repetition_penalty=1e-308)])
        assert tokens.token_ids == [7]


def test_ids_past_a_smaller_draft_vocabulary_are_left_out_of_bias_and_penalties() -> None:
    """A draft model's vocabulary may be smaller than its target's, whose ids a request's logit_bias and tokens
    are: those past it concern no column of the draft's logits (an index past them crashed the step)."""
    logits = torch.zeros(1, 8)
    s = state(prompt=[1, 20], output=[2, 30], logit_bias={3: 5.0, 12: 9.0}, repetition_penalty=2.0,
              frequency_penalty=0.5)
    apply_logit_bias(logits, [s])
    assert logits[0].tolist() == [0, 0, 0, 5.0, 0, 0, 0, 0]
    penalised = apply_penalties(torch.ones(1, 8), [s])
    assert penalised[0, 1].item() == 0.5 and penalised[0, 2].item() == 0.5 - 0.5 and penalised[0, 0].item() == 1.0


def test_a_temperature_past_float32s_range_samples_the_allowed_tokens_and_keeps_top_k() -> None:
    """1e300 is finite as a Python float and inf in float32: -inf / inf (EOS held back by min_tokens) was NaN,
    argmax of the NaN row token 0; and logits / inf all 0, so top_k kept the lowest ids, not the likeliest."""
    logits = torch.tensor([[5.0, 1.0, 2.0, 9.0, 8.0, 7.0]] * 64)
    held = Sampler(6)(logits, [state(eos=(3,), temperature=1e300, min_tokens=4, seed=i) for i in range(64)])
    assert 3 not in held.token_ids and len(set(held.token_ids)) > 2
    top = Sampler(6)(logits, [state(temperature=1e300, top_k=3, seed=i) for i in range(64)])
    assert set(top.token_ids) <= {3, 4, 5} and len(set(top.token_ids)) > 1
