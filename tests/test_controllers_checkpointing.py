import math

import pytest

from controllers.checkpoint_interval import CheckpointIntervalTuner, CheckpointTunerConfig
from controllers.checkpointing import (
    daly_interval_s,
    expected_overhead_fraction,
    mtbf_from_risk_s,
    should_checkpoint_on_notice,
    young_interval_s,
)


def test_young_interval_matches_formula_values():
    assert young_interval_s(10.0, 3600.0) == pytest.approx(math.sqrt(72_000.0))  # 268.3 s
    assert young_interval_s(60.0, 86_400.0) == pytest.approx(3219.9, abs=0.1)


def test_young_interval_minimises_first_order_overhead():
    cost_s, mtbf_s = 30.0, 7200.0
    grid = [10.0 + i for i in range(5000)]
    best = min(grid, key=lambda t: expected_overhead_fraction(t, cost_s, mtbf_s))
    assert best == pytest.approx(young_interval_s(cost_s, mtbf_s), abs=1.0)


def test_daly_interval_values_and_limits():
    # C=10, M=3600: ratio = 10/7200; sqrt(2CM) * (1 + sqrt(r)/3 + r/9) - C
    r = 10.0 / 7200.0
    expected = math.sqrt(72_000.0) * (1 + math.sqrt(r) / 3 + r / 9) - 10.0
    assert daly_interval_s(10.0, 3600.0) == pytest.approx(expected)
    assert daly_interval_s(10.0, 3600.0) == pytest.approx(261.7, abs=0.1)
    # close to Young when C << M, and M itself once C >= 2M
    assert daly_interval_s(1.0, 1e6) == pytest.approx(young_interval_s(1.0, 1e6), rel=0.01)
    assert daly_interval_s(500.0, 200.0) == 200.0


@pytest.mark.parametrize("cost, mtbf, name", [(-1.0, 100.0, "checkpoint_cost_s"),
                                              (10.0, math.nan, "mtbf_s"),
                                              (0.0, 100.0, "checkpoint_cost_s")])
def test_bad_inputs_raise_naming_the_input(cost, mtbf, name):
    with pytest.raises(ValueError, match=name):
        young_interval_s(cost, mtbf)
    with pytest.raises(ValueError, match=name):
        daly_interval_s(cost, mtbf)


def test_mtbf_from_risk_inverts_poisson_probability():
    assert mtbf_from_risk_s(0.1, 600.0) == pytest.approx(-600.0 / math.log(0.9))
    assert mtbf_from_risk_s(0.0, 600.0) == math.inf
    with pytest.raises(ValueError, match="risk"):
        mtbf_from_risk_s(1.5, 600.0)


def test_tuner_uses_posterior_mtbf_and_measured_cost():
    # No separate node-fault term: the 4 h prior stands for every interruption here.
    tuner = CheckpointIntervalTuner(CheckpointTunerConfig(prior_mtbf_s=4 * 3600.0,
                                                          forget_half_life_s=None,
                                                          use_daly=False,
                                                          fault_rate_per_node_h=0.0))
    assert tuner.mtbf_s == 4 * 3600.0
    assert tuner.optimal_interval_s() == tuner.config.min_interval_s  # no cost measured yet
    tuner.observe_exposure(10 * 3600.0, interruptions=10)
    assert tuner.mtbf_s == pytest.approx((4 * 3600.0 + 10 * 3600.0) / 11)
    tuner.observe_checkpoint_cost(20.0)
    assert tuner.optimal_interval_s() == pytest.approx(young_interval_s(20.0, tuner.mtbf_s))


def test_tuner_retunes_when_cost_changes_and_holds_on_noise():
    tuner = CheckpointIntervalTuner(CheckpointTunerConfig(cost_ema_beta=0.0, use_daly=False))
    tuner.observe_checkpoint_cost(10.0)
    first, changed = tuner.retune()
    assert changed
    tuner.observe_checkpoint_cost(10.5)  # +5% cost -> +2.5% interval: inside the 10% band
    kept, changed = tuner.retune()
    assert not changed and kept == first
    tuner.observe_checkpoint_cost(40.0)  # 4x cost -> 2x interval
    moved, changed = tuner.retune()
    assert changed and moved == pytest.approx(2 * first, rel=0.01)


def test_tuner_follows_a_market_that_turns_wild():
    # A weak prior (0.1 pseudo-events) so the data speaks; forgetting with a 1 h half-life.
    tuner = CheckpointIntervalTuner(CheckpointTunerConfig(forget_half_life_s=3600.0,
                                                          prior_weight_events=0.1))
    tuner.observe_checkpoint_cost(30.0)
    for _ in range(24):  # a calm day: one interruption in 24 h
        tuner.observe_exposure(3600.0, 0)
    tuner.observe_exposure(0.0, 1)
    calm_mtbf = tuner.mtbf_s
    calm_interval, _ = tuner.retune()
    for _ in range(12):  # then twelve hours with one interruption every 10 minutes
        tuner.observe_exposure(3600.0, 6)
    assert calm_mtbf > 3600.0
    assert tuner.mtbf_s == pytest.approx(600.0, rel=0.25)
    wild_interval, changed = tuner.retune()
    assert changed and wild_interval < calm_interval / 2


def test_tuner_without_forgetting_remembers_the_calm_day():
    tuner = CheckpointIntervalTuner(CheckpointTunerConfig(forget_half_life_s=None,
                                                          prior_weight_events=0.1))
    for _ in range(24):
        tuner.observe_exposure(3600.0, 0)
    tuner.observe_exposure(0.0, 1)
    for _ in range(2):
        tuner.observe_exposure(3600.0, 6)
    assert tuner.mtbf_s > 2 * 600.0  # the old calm exposure still dilutes the new rate


def test_tuner_interval_is_clamped():
    cfg = CheckpointTunerConfig(min_interval_s=120.0, max_interval_s=900.0)
    tuner = CheckpointIntervalTuner(cfg)
    tuner.observe_checkpoint_cost(1.0)
    tuner.observe_exposure(600.0, 50)  # very frequent failures -> tiny optimum
    assert tuner.optimal_interval_s() == 120.0
    tuner.set_prior_mtbf(math.inf)
    calm = CheckpointIntervalTuner(cfg)
    calm.set_prior_mtbf(math.inf)
    calm.observe_checkpoint_cost(600.0)
    assert calm.optimal_interval_s() == 900.0


def test_notice_checkpoints_when_last_checkpoint_is_too_old():
    d = should_checkpoint_on_notice(300.0, 120.0, 10.0)
    assert d.checkpoint_now and d.can_finish and d.too_old


def test_notice_covered_by_a_recent_checkpoint_continues():
    d = should_checkpoint_on_notice(5.0, 120.0, 10.0, next_decision_in_s=10.0)
    assert not d.checkpoint_now and d.can_finish and not d.too_old and not d.last_chance
    assert "covers" in d.reason


def test_notice_too_short_to_finish_never_starts_a_checkpoint():
    d = should_checkpoint_on_notice(3000.0, 12.0, 10.0, safety_margin_s=5.0)
    assert not d.checkpoint_now and not d.can_finish
    assert "could not finish" in d.reason


def test_notice_last_chance_saves_recent_work():
    # 20 s of notice, 10 s to checkpoint + 5 s margin; the next decision is in 10 s: too late then
    d = should_checkpoint_on_notice(5.0, 20.0, 10.0, safety_margin_s=5.0, next_decision_in_s=10.0)
    assert d.checkpoint_now and d.last_chance and not d.too_old
    nothing_to_save = should_checkpoint_on_notice(0.0, 20.0, 10.0, next_decision_in_s=10.0)
    assert not nothing_to_save.checkpoint_now


def test_notice_rejects_negative_inputs():
    with pytest.raises(ValueError, match="notice_s"):
        should_checkpoint_on_notice(10.0, -1.0, 10.0)
