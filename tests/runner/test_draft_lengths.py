"""The adaptive draft length (runner/draft_lengths.py): the cost fit, the acceptance estimate, the choice."""

from __future__ import annotations

import pytest

from kvserve.runner.draft_lengths import DraftLengthPolicy, LinearCost


def test_the_cost_fit_recovers_intercept_and_slope() -> None:
    cost = LinearCost()
    for rows in (4, 8, 16, 32, 8, 20):
        cost.observe(rows, 0.010 + 0.0005 * rows)
    intercept, slope = cost.coefficients()
    assert intercept == pytest.approx(0.010, rel=1e-6) and slope == pytest.approx(0.0005, rel=1e-6)
    assert not cost.narrow


def test_one_row_count_is_too_narrow_to_fit_and_gets_a_prior_slope() -> None:
    cost = LinearCost()
    for _ in range(5):
        cost.observe(16, 0.032)
    assert cost.narrow
    intercept, slope = cost.coefficients()
    assert slope > 0 and intercept + 16 * slope == pytest.approx(0.032)


def policy_with(intercept: float, slope: float, acceptance: float, **options) -> DraftLengthPolicy:
    policy = DraftLengthPolicy(4, **options)
    for rows in (1, 2, 4, 8, 16, 32, 64):
        policy.observe_step(rows, intercept + slope * rows)
    for _ in range(200):  # the method's acceptance: accepted runs of a geometric process
        accepted = 3 if acceptance > 0.7 else 0
        policy.observe_verified("warm-up", 4, accepted)
    policy.forget("warm-up")
    return policy


def test_cheap_rows_and_good_acceptance_draft_the_most() -> None:
    policy = policy_with(intercept=0.020, slope=0.0002, acceptance=0.9)
    assert policy.lengths(["a", "b"]) == [4, 4]


def test_rows_that_cost_their_full_share_draft_nothing() -> None:
    # A compute-bound batch: every row costs as much as a whole request's step.
    policy = policy_with(intercept=0.0, slope=0.004, acceptance=0.9)
    assert policy.lengths([f"r{i}" for i in range(16)]) == [0] * 16


def test_poor_acceptance_drafts_nothing() -> None:
    policy = policy_with(intercept=0.020, slope=0.002, acceptance=0.0)
    assert policy.lengths(["a"]) == [0]


def test_a_request_that_accepts_gets_more_drafts_than_one_that_rejects() -> None:
    policy = policy_with(intercept=0.020, slope=0.003, acceptance=0.9)
    for _ in range(10):
        policy.observe_verified("good", 4, 4)
        policy.observe_verified("bad", 4, 0)
    good, bad = policy.lengths(["good", "bad"])
    assert good > bad
    assert policy.acceptance("good") > 0.8 > 0.3 > policy.acceptance("bad")


def test_a_draft_model_pays_for_its_forwards() -> None:
    free = policy_with(intercept=0.020, slope=0.001, acceptance=0.9)
    costly = policy_with(intercept=0.020, slope=0.001, acceptance=0.9, uses_model=True)
    costly.observe_draft([(rows, 0.015 + 0.001 * rows) for rows in (1, 2, 4, 8)])
    assert sum(costly.lengths(["a", "b"])) < sum(free.lengths(["a", "b"]))


def test_fixed_lengths_when_not_adaptive() -> None:
    assert DraftLengthPolicy(3, adaptive=False).lengths(["a", "b"]) == [3, 3]


def test_before_any_measurement_a_plain_step_then_one_request_measures_the_draft() -> None:
    policy = DraftLengthPolicy(3, uses_model=True)
    assert policy.lengths(["a", "b", "c"], [300, 0, 0], [None] * 3) == [0, 0, 0]  # no step measured yet
    policy.observe_step(3, 0.030)
    # No draft forward measured: the request cheapest to onboard drafts alone, not all three prompts' prefills.
    assert policy.lengths(["a", "b", "c"], [300, 40, 90], [None] * 3) == [0, 3, 0]
    ngram = DraftLengthPolicy(3)
    assert ngram.lengths(["a", "b"]) == [0, 0]
    ngram.observe_step(2, 0.030)
    assert all(ngram.lengths(["a", "b"]))  # free drafts: the prior acceptance is enough


def onboarding_policy() -> DraftLengthPolicy:
    """Cheap target rows, good acceptance, a draft whose catch-up costs 1 ms a token."""
    policy = policy_with(intercept=0.020, slope=0.0002, acceptance=0.9, uses_model=True)
    policy.observe_draft([(rows, 0.002 + 0.0002 * rows) for rows in (1, 2, 4, 8)] + [(200, 0.2)])
    return policy


def test_a_new_requests_prefill_in_the_draft_is_paid_only_where_its_remaining_output_repays_it() -> None:
    policy = onboarding_policy()
    held, new_long, new_short = policy.lengths(["held", "long", "short"], [0, 100, 100], [1000, 1000, 4])
    assert held == 4 and new_long > 0 and new_short == 0
    # A prompt's prefill (2 s) that a request's expected 128 tokens do not repay.
    assert policy.lengths(["new"], [2000], [None]) == [0]


def test_the_expected_remaining_output_follows_the_requests_that_left() -> None:
    policy = onboarding_policy()
    assert policy.lengths(["new"], [100], [1000])[0] > 0
    for k in range(40):
        policy.forget(f"done{k}", output_tokens=3)  # short replies: no prefill is repaid
    assert policy.lengths(["new"], [100], [1000]) == [0]
    assert policy.lengths(["held"], [0], [1000])[0] > 0


def test_an_onboarding_prefill_is_predicted_not_mistaken_for_a_slow_draft() -> None:
    policy = onboarding_policy()
    for _ in range(30):
        lengths = policy.lengths(["a", "b"], [100, 0], [1000, 1000])
        assert lengths[0] > 0
        predicted_forwards = policy._predicted_draft_s
        policy.observe_propose(predicted_forwards + 100 * 0.001, ["a", "b"])  # forwards, and a's prefill
        policy.forget("a")
    assert policy.draft_scale == pytest.approx(1.0, abs=0.05)


def test_a_narrow_fit_probes_another_row_count() -> None:
    policy = DraftLengthPolicy(4, probe_every=4)
    for _ in range(200):
        policy.observe_step(16, 0.05)  # one row count only
        policy.observe_verified("a", 4, 0)
        policy.observe_verified("b", 4, 0)
    chosen = [tuple(policy.lengths(["a", "b"])) for _ in range(8)]
    assert chosen.count((0, 0)) == 6 and chosen.count((1, 1)) == 2


def test_row_counts_past_a_tile_are_priced_as_measured() -> None:
    """Rows in tiles of 4: a fifth row costs a second pass over the weights. The policy stops at the tile."""
    policy = DraftLengthPolicy(4)
    for _ in range(3):
        for rows, seconds in ((1, 0.100), (2, 0.101), (3, 0.102), (4, 0.104), (5, 0.200)):
            policy.observe_step(rows, seconds)
    for _ in range(50):
        policy.observe_verified("a", 4, 4)
    assert policy.target_cost.predict(5) == pytest.approx(0.200)
    assert policy.lengths(["a"]) == [3]


def test_rows_past_the_widest_measured_step_cost_at_least_their_share_of_it() -> None:
    """Steps of 1 to 4 rows barely differ (reading the weights); 8 rows are not priced from their slope."""
    policy = DraftLengthPolicy(4)
    for _ in range(3):
        for rows, seconds in ((1, 0.040), (4, 0.044)):
            policy.observe_step(rows, seconds)
    assert policy.target_cost.predict(3) < 0.044
    assert policy.target_cost.predict(8) == pytest.approx(0.088)
    for _ in range(50):
        policy.observe_verified("a", 4, 4)
    # Four requests that accept nearly everything still draft nothing: 8 rows would cost twice 4.
    assert policy.lengths(["a", "b", "c", "d"]) == [0, 0, 0, 0]


def test_proposals_slower_than_their_forwards_predict_scale_the_draft_cost_up() -> None:
    policy = policy_with(intercept=0.020, slope=0.001, acceptance=0.9, uses_model=True)
    policy.observe_draft([(rows, 0.004 + 0.0005 * rows) for rows in (1, 2, 4, 8)])
    before = sum(policy.lengths(["a", "b"]))
    for _ in range(30):
        policy.lengths(["a", "b"])
        policy.observe_propose(4 * policy._predicted_draft_s)  # catch-up and prefills the fit does not see
    assert policy.draft_scale > 1.5
    assert sum(policy.lengths(["a", "b"])) < before


def test_a_draft_model_probes_only_requests_it_has_drafted_for() -> None:
    policy = DraftLengthPolicy(4, uses_model=True, probe_every=2)
    policy.observe_draft([(rows, 0.03) for rows in (1, 2, 4)])
    for _ in range(200):
        policy.observe_step(16, 0.05)
        policy.observe_verified("seen", 4, 0)
    policy.observe_propose(0.03, ["seen"])  # the draft holds "seen"
    chosen = [policy.lengths(["seen", "new"], [0, 100], [None, None]) for _ in range(4)]
    assert [0, 0] in chosen and [1, 0] in chosen and all(lengths[1] == 0 for lengths in chosen)


def test_drafts_prompt_lookup_finds_cost_the_draft_model_nothing() -> None:
    """A request whose drafts prompt lookup finds pays no draft forward and no onboarding: where the draft
    model's forwards cost as much as a target step (nothing pays), it still drafts, and the draft's cost scale
    compares the proposal's time with the other requests' forwards only."""
    policy = policy_with(intercept=0.020, slope=0.001, acceptance=0.9, uses_model=True)
    policy.observe_draft([(rows, 0.030) for rows in (1, 2, 4, 8)])  # a draft forward costs more than a step
    assert policy.lengths(["model", "lookup"], [0, 0], [None, None], [False, False]) == [0, 0]
    lengths = policy.lengths(["model", "lookup"], [0, 500], [None, None], [False, True])
    assert lengths[0] == 0 and lengths[1] > 0  # no onboarding charged for the lookup's drafts either
    assert policy._predicted_draft_s == 0
    policy.observe_propose(0.0005, ["lookup"])  # the lookup's time: nothing to compare with the forwards
    assert policy.draft_scale == 1.0


def test_before_the_draft_is_measured_free_drafts_go_ahead_and_one_paid_request_measures_it() -> None:
    policy = DraftLengthPolicy(4, uses_model=True)
    policy.observe_step(1, 0.02)
    assert policy.lengths(["a", "b", "c"], [50, 10, 0], [None] * 3, [False, False, True]) == [0, 4, 4]


def test_a_request_prompt_lookup_mostly_serves_is_not_onboarded_into_the_draft_model() -> None:
    """Onboarding is repaid only by the steps the draft model drafts: a request whose drafts prompt lookup
    found on most of its steps is expected to need the model on few, and its prefill in the draft waits."""
    policy = onboarding_policy()
    for _ in range(20):
        policy.lengths(["lookup", "plain"], [0, 0], [1000, 1000], [True, False])
    lengths = policy.lengths(["lookup", "plain"], [100, 100], [1000, 1000], [False, False])
    assert lengths[0] == 0 and lengths[1] > 0


def test_with_the_drafts_costs_measured_at_start_up_one_request_still_measures_acceptance() -> None:
    """The engine measures the draft's forwards at start-up, but not how often its drafts are accepted: until a
    draft is verified one request drafts, the cheapest to onboard, even where the prior acceptance would
    not pay for drafting (the policy would otherwise never learn better)."""
    policy = DraftLengthPolicy(4, uses_model=True, prior_acceptance=0.3)
    policy.observe_draft([(rows, 0.006) for rows in (1, 2, 3, 4, 5)] + [(64, 0.2)])
    policy.observe_step(1, 0.035)
    assert policy.lengths(["a", "b"], [200, 50], [None, None]) == [0, 4]
    policy.observe_verified("b", 4, 4)
    assert policy.lengths(["a", "b"], [200, 0], [None, None])[0] == 0


def test_acceptance_is_learnt_only_where_drafts_accepted_every_time_would_repay_the_onboarding() -> None:
    """Before a draft is verified, the cheapest request drafts to measure acceptance, but not where its
    drafts could not pay even if every one were accepted: a long prompt's prefill in the draft (the agentic
    system prompts), or a batch whose extra rows cost their full share of compute."""
    def measured(step_rows: int, step_s: float) -> DraftLengthPolicy:
        policy = DraftLengthPolicy(8, uses_model=True)
        policy.observe_draft([(rows, 0.010) for rows in (1, 2, 3, 4, 5)] + [(64, 0.1)])  # 1.6 ms a prompt token
        policy.observe_step(step_rows, step_s)
        return policy

    # One request, 37 ms a step: a 200-token prompt's prefill in the draft is repaid, a 1,600-token one is not.
    assert measured(1, 0.037).lengths(["a"], [200], [None]) == [8]
    assert measured(1, 0.037).lengths(["a"], [1600], [None]) == [0]
    # Sixteen requests whose step is bound by compute: even a short prompt's drafts would not pay.
    policy = measured(16, 0.140)
    policy.observe_step(32, 0.280)
    assert policy.lengths([f"r{i}" for i in range(16)], [200] * 16, [None] * 16) == [0] * 16
    # Once the prefix cache holds the long prompt, onboarding is cheap and the probe goes ahead.
    assert measured(1, 0.037).lengths(["a"], [16], [None]) == [8]
