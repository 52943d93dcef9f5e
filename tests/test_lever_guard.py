import math

import pytest

from controllers.lever_guard import (
    LeverGuard,
    default_levers,
    interpolate,
    judge_from_calibration,
    mean_interval95,
)

# The fixed schedule's eval loss against samples (calibration on the same workload).
REFERENCE = [(0, 4.0), (1000, 3.0), (2000, 2.5), (3000, 2.2), (4000, 2.0)]


def test_lever_that_costs_quality_during_the_run_is_switched_off_with_its_reason():
    guard = LeverGuard("prune_scored", REFERENCE, budget_samples=4000, patience=2)
    # Early evaluations are not judged (curves cross early).
    assert guard.observe_eval(500, 9.0) is None and guard.on
    assert guard.observe_eval(2000, 2.6) is None  # 4% above 2.5: first strike
    verdict = guard.observe_eval(2500, 2.5)  # 6.4% above 2.35: second strike -> off
    assert verdict is not None and not guard.on
    assert verdict.reason.startswith("costs quality") and "switched off" in verdict.reason
    assert verdict.numbers["reference_loss"] == pytest.approx(2.35)
    assert guard.record == [verdict]
    assert guard.observe_eval(3000, 9.0) is None  # recorded once, stays off


def test_lever_at_the_fixed_schedules_quality_stays_on():
    guard = LeverGuard("goodput", REFERENCE, budget_samples=4000, patience=2)
    for samples, loss in [(1000, 3.01), (2000, 2.52), (3000, 2.19), (4000, 1.99)]:
        assert guard.observe_eval(samples, loss) is None
    assert guard.on and guard.record == []


def test_nan_loss_counts_against_the_lever():
    guard = LeverGuard("goodput", REFERENCE, budget_samples=4000, patience=1)
    assert guard.observe_eval(3000, math.nan) is not None and not guard.on


def test_calibration_switches_off_a_lever_that_never_reaches_the_quality():
    verdict = judge_from_calibration("prune_scored", [0.8, None, 0.7])
    assert not verdict.on and "costs quality" in verdict.reason and "1 of 3" in verdict.reason


def test_calibration_switches_off_a_lever_that_costs_time_and_keeps_one_that_pays():
    slow = judge_from_calibration("noise_batch", [1.10, 1.16, 1.22])
    assert not slow.on and slow.reason.startswith("costs time")
    unsure = judge_from_calibration("goodput", [0.7, 1.2, 0.9])
    assert not unsure.on and unsure.reason.startswith("saving not sure")
    pays = judge_from_calibration("prune_scored", [0.70, 0.72, 0.74])
    assert pays.on and pays.numbers["cpu_ratio_high"] < 1.0


def test_default_is_the_fixed_schedule_without_calibration_or_a_paying_lever():
    assert default_levers([judge_from_calibration("goodput", [])]) == ()
    assert default_levers([judge_from_calibration("goodput", [1.1, 1.2])]) == ()
    best = default_levers([judge_from_calibration("a", [0.8, 0.9, 0.85]),
                           judge_from_calibration("b", [0.6, 0.61, 0.62])])
    assert best == ("b",)


def test_interval_and_interpolation():
    mean, low, high = mean_interval95([1.0, 2.0, 3.0])
    assert mean == 2.0 and high - mean == pytest.approx(4.303 * 1.0 / math.sqrt(3), rel=1e-3)
    assert interpolate(REFERENCE, 2500) == pytest.approx(2.35)
    assert interpolate(REFERENCE, 9000) == 2.0


def test_bad_guard_settings_are_refused():
    with pytest.raises(ValueError, match="budget_samples"):
        LeverGuard("x", REFERENCE, budget_samples=0)
