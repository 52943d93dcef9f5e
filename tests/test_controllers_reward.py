import dataclasses
import math
import random

import pytest

from controllers.reward import RewardConfig, RewardInputs, mission_reward

CONFIG = RewardConfig(reference_tokens_per_usd=1e6, regression_threshold=0.02)


BASE = RewardInputs(tokens_trained=1e7, cost_usd=10.0, wall_s=3600.0, idle_s=0.0, straggler_s=0.0,
                    checkpoint_s=0.0, preemption_loss_s=0.0, redundant_tokens=0.0, eval_loss=2.0,
                    reference_eval_loss=2.0)


def inputs(**overrides) -> RewardInputs:
    return dataclasses.replace(BASE, **overrides)


def test_efficiency_minus_waste():
    r = mission_reward(inputs(idle_s=360.0, checkpoint_s=180.0, redundant_tokens=1e6), CONFIG)
    assert not r.quality_violated
    assert r.efficiency == pytest.approx(1.0)
    assert r.waste == pytest.approx(0.1 + 0.05 + 0.1)
    assert r.reward == pytest.approx(1.0 - 0.25)


def test_cheaper_is_better_when_quality_holds():
    assert mission_reward(inputs(cost_usd=5.0), CONFIG).reward > mission_reward(
        inputs(cost_usd=10.0), CONFIG).reward


def test_regression_beyond_threshold_violates():
    r = mission_reward(inputs(eval_loss=2.1), CONFIG)  # +5%
    assert r.quality_violated and r.reward < -CONFIG.violation_penalty
    assert "quality violated" in r.reason
    assert not mission_reward(inputs(eval_loss=2.03), CONFIG).quality_violated  # +1.5%


def random_inputs(rng: random.Random, violated: bool) -> RewardInputs:
    """Extreme ranges: costs from a micro-cent to a fortune, waste from none to all of it."""
    reference = rng.uniform(0.1, 5.0)
    if violated:
        eval_loss = reference * (1 + CONFIG.regression_threshold + rng.uniform(1e-9, 2.0))
    else:
        eval_loss = reference * (1 + rng.uniform(-0.5, CONFIG.regression_threshold))
    wall_s = 10 ** rng.uniform(0, 6)
    tokens = 10 ** rng.uniform(0, 12)
    return RewardInputs(
        tokens_trained=tokens, cost_usd=10 ** rng.uniform(-9, 6), wall_s=wall_s,
        idle_s=rng.uniform(0, 2) * wall_s, straggler_s=rng.uniform(0, 2) * wall_s,
        checkpoint_s=rng.uniform(0, 2) * wall_s, preemption_loss_s=rng.uniform(0, 2) * wall_s,
        redundant_tokens=rng.uniform(0, 2) * tokens, eval_loss=eval_loss,
        reference_eval_loss=reference)


def test_quality_violation_cannot_be_bought_back_with_cheapness():
    """Property: any violating interval ranks below any interval that keeps quality."""
    rng = random.Random(20240601)
    for _ in range(5000):
        bad = mission_reward(random_inputs(rng, violated=True), CONFIG)
        good = mission_reward(random_inputs(rng, violated=False), CONFIG)
        assert bad.quality_violated and not good.quality_violated
        assert bad.reward < good.reward


def test_worst_keeping_run_beats_best_violating_run():
    cheapest_violation = mission_reward(
        inputs(cost_usd=1e-12, tokens_trained=1e15, eval_loss=2.0 * 1.0201), CONFIG)
    wasteful_keeper = mission_reward(
        inputs(cost_usd=1e9, tokens_trained=1.0, idle_s=1e9, straggler_s=1e9, checkpoint_s=1e9,
               preemption_loss_s=1e9, redundant_tokens=1.0), CONFIG)
    assert cheapest_violation.reward < wasteful_keeper.reward


def test_bigger_regression_is_worse_whatever_it_cost():
    rng = random.Random(5)
    for _ in range(2000):
        small, big = sorted(rng.uniform(0.021, 3.0) for _ in range(2))
        if big - small < 1e-6:
            continue
        cheap_big = mission_reward(inputs(eval_loss=2.0 * (1 + big), cost_usd=1e-9), CONFIG)
        dear_small = mission_reward(inputs(eval_loss=2.0 * (1 + small), cost_usd=1e9,
                                           idle_s=3600.0), CONFIG)
        assert cheap_big.reward < dear_small.reward


def test_config_refuses_a_penalty_that_waste_could_reach():
    with pytest.raises(ValueError, match="violation_penalty"):
        RewardConfig(reference_tokens_per_usd=1.0, waste_weight=10.0, violation_penalty=40.0)


@pytest.mark.parametrize("field, value", [("cost_usd", 0.0), ("eval_loss", math.nan),
                                          ("idle_s", -1.0), ("reference_eval_loss", 0.0)])
def test_bad_inputs_raise_naming_the_field(field, value):
    with pytest.raises(ValueError, match=field):
        mission_reward(inputs(**{field: value}), CONFIG)
