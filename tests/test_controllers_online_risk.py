"""The online risk update (gamma frailty) learns a market's level from the runs it sees."""

from __future__ import annotations

import numpy as np
import pytest

from cloud.simulator import ClusterRules, JobSpec, Market, simulate
from controllers.allocation_heuristic import TrainwiseAllocationConfig, TrainwiseAllocationPolicy
from controllers.online_risk import ObservedRuns, moved, with_multipliers
from controllers.preemption_risk import DOWN, POOLED_ZONE, UP, PreemptionRiskModel

TICK_S = 600
RULES = ClusterRules(changeover_s=360.0, checkpoint_save_s=60.0, checkpoint_interval_s=3600.0,
                     notice_s=120.0)


def constant_model(mean_up_s: float = 4 * 3600.0, mean_down_s: float = 3600.0
                   ) -> PreemptionRiskModel:
    return PreemptionRiskModel.constant(mean_up_s, mean_down_s, fitted_on="test prior")


def test_the_posterior_mean_is_k_plus_observed_over_k_plus_expected():
    model = constant_model()  # up hazard 0.25 per hour
    runs = ObservedRuns(prior_events=2.0)
    for _ in range(8):  # 8 up runs of one hour each: 2 events expected, 8 seen
        runs.expose(model, "z", 1, True, 0.0, 3600.0, 0.0)
        runs.end("z", 1, True)
    found = runs.multipliers()
    assert found[(UP, "z", 1)] == pytest.approx((2 + 8) / (2 + 2.0), rel=1e-3)
    assert found[(UP, POOLED_ZONE, 1)] == pytest.approx(found[(UP, "z", 1)])
    assert (DOWN, "z", 1) not in found
    runs.reset()
    assert runs.multipliers() == {}


def test_no_evidence_keeps_the_fit_and_little_evidence_moves_it_little():
    model = constant_model()
    weak, strong = ObservedRuns(50.0), ObservedRuns(0.5)
    for runs in (weak, strong):
        runs.expose(model, "z", 1, True, 0.0, 4 * 3600.0, 0.0)  # 1 event expected, 3 seen
        for _ in range(3):
            runs.end("z", 1, True)
    assert 1.0 < weak.multipliers()[(UP, "z", 1)] < 1.05
    assert strong.multipliers()[(UP, "z", 1)] > 2.0


def test_multipliers_scale_the_zone_curve_and_keep_the_others():
    model = constant_model()
    updated = with_multipliers(model, [((UP, "z", 1), 3.0)])
    assert updated.hazard_per_h("z", 0.0) == pytest.approx(3 * model.hazard_per_h("z", 0.0))
    assert updated.hazard_per_h("other", 0.0) == pytest.approx(model.hazard_per_h("other", 0.0))
    assert updated.hazard_per_h("z", 0.0, state=DOWN) == pytest.approx(
        model.hazard_per_h("z", 0.0, state=DOWN))
    with pytest.raises(ValueError, match="multiplier"):
        with_multipliers(model, [((UP, "z", 1), 0.0)])
    with pytest.raises(ValueError, match="prior_events"):
        ObservedRuns(0.0)


def test_moved_ignores_small_changes():
    assert not moved({(UP, "z", 1): 1.02}, {})
    assert moved({(UP, "z", 1): 1.2}, {(UP, "z", 1): 1.0})
    assert not moved({(UP, "z", 1): 1.2}, {(UP, "z", 1): 1.19})


def flapping_market(ticks: int) -> Market:
    """Spot up for 2 ticks, down for 1, again and again: runs far shorter than the prior's."""
    row = np.array([1 if i % 3 != 2 else 0 for i in range(ticks)], dtype=np.int64)
    return Market(("us-east-2a",), TICK_S, row[None, :], (0.9731,), (3.06,))


def test_a_policy_learns_that_this_market_preempts_more_than_its_fit_said():
    ticks = int(52 * 3600 // TICK_S)
    job = JobSpec(work_gpu_h=30.0, deadline_s=52 * 3600.0, node_count=1)
    policy = TrainwiseAllocationPolicy(
        constant_model(), TrainwiseAllocationConfig(online_prior_events=2.0))
    first = simulate(policy, job, RULES, flapping_market(ticks))
    up = policy._multipliers_used[(UP, "us-east-2a", 1)]
    assert up > 5.0  # 20 min runs against a fitted 4 h mean
    assert policy.model.hazard_per_h("us-east-2a", 0.0) == pytest.approx(
        up * constant_model().hazard_per_h("us-east-2a", 0.0))
    # A rerun over the same market starts from the fit again and decides the same.
    again = simulate(policy, job, RULES, flapping_market(ticks))
    assert (again.cost_usd, again.changeovers) == (first.cost_usd, first.changeovers)
    fixed = TrainwiseAllocationPolicy(constant_model())
    simulate(fixed, job, RULES, flapping_market(ticks))
    assert fixed.model.hazard_per_h("us-east-2a", 0.0) == pytest.approx(0.25)


def test_the_run_in_progress_at_the_first_tick_counts_only_when_its_age_is_known():
    job = JobSpec(work_gpu_h=2.0, deadline_s=4 * 3600.0, node_count=1)
    market = Market(("z",), TICK_S, np.ones((1, 24), dtype=np.int64), (0.9731,), (3.06,))
    unknown = TrainwiseAllocationPolicy(constant_model(),
                                        TrainwiseAllocationConfig(online_prior_events=2.0))
    simulate(unknown, job, RULES, market)
    assert unknown._observed.expected == {}
    model = constant_model()
    model.run_at_cutoff[("z", 1)] = (UP, 7200.0)
    known = TrainwiseAllocationPolicy(model, TrainwiseAllocationConfig(online_prior_events=2.0))
    simulate(known, job, RULES, market)
    assert known._observed.expected[(UP, "z", 1)] > 0
    assert known._observed.events == {}
