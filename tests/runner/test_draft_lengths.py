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


def test_fixed_lengths_when_not_adaptive_or_before_any_measurement() -> None:
    assert DraftLengthPolicy(3, adaptive=False).lengths(["a", "b"]) == [3, 3]
    assert DraftLengthPolicy(3).lengths(["a"]) == [3]  # nothing measured yet


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
    chosen = [policy.lengths(["seen", "new"]) for _ in range(4)]
    assert [0, 0] in chosen and [1, 0] in chosen and all(lengths[1] == 0 for lengths in chosen)
