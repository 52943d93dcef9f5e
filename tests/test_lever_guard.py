import math

import pytest

from controllers.lever_guard import (
    LeverGuard,
    StepCostGuard,
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


def feed(guard: StepCostGuard, shape: tuple[int, int], ms_per_step: float, steps: int) -> None:
    for _ in range(steps):
        guard.observe_step(shape[0], shape[1], ms_per_step)


def test_a_batch_split_that_is_slower_per_sample_is_switched_off_for_its_cost():
    # The noise heuristic's 6x2 split: 92 ms for 12 samples against 68 ms for the fixed 12x1.
    guard = StepCostGuard("batch", base_shape=(12, 1), patience=2)
    feed(guard, (12, 1), 68.0, 10)
    feed(guard, (6, 2), 92.0, 5)
    assert guard.check(step=20) is None and guard.strikes == 1
    feed(guard, (6, 2), 92.0, 5)
    verdict = guard.check(step=30)
    assert verdict is not None and not guard.on
    assert verdict.reason.startswith("costs time") and "6x2" in verdict.reason
    assert verdict.numbers["time_ratio"] == pytest.approx(92 / 68)


def test_a_bigger_batch_that_is_faster_per_sample_is_not_struck_for_time():
    guard = StepCostGuard("batch", base_shape=(12, 1), patience=1)
    feed(guard, (12, 1), 68.0, 10)
    feed(guard, (48, 1), 200.0, 5)  # 4.2 ms per sample against 5.7
    assert guard.check(step=20) is None and guard.on and guard.strikes == 0
    assert guard.check(step=30) is None  # no lever steps since the last check: not judged


def test_a_slow_judgement_followed_by_a_fast_one_resets_the_strikes():
    guard = StepCostGuard("batch", base_shape=(12, 1), patience=2)
    feed(guard, (12, 1), 68.0, 10)
    feed(guard, (6, 2), 92.0, 5)
    assert guard.check(step=20) is None and guard.strikes == 1
    feed(guard, (24, 1), 120.0, 5)
    assert guard.check(step=30) is None and guard.strikes == 0 and guard.on


def ttq_block(ratios, verdict_on):
    """A time_to_quality summary block for prune_scored with these per-seed samples ratios."""
    return {"levers": {"prune_scored": {"seeds": {
        str(i): {"samples_ratio": r} for i, r in enumerate(ratios)}}},
        "guard_all_seeds": [{"lever": "prune_scored", "on": verdict_on,
                             "reason": "pays" if verdict_on else "costs quality"}]}


def test_calibration_gives_the_simulator_no_saving_for_a_lever_the_guard_turns_off():
    from benchmarks.time_to_quality.calibration import derive

    document = {"meta": {"commit": "c", "tree_dirty": False}, "summary": {
        "shakespeare_multi": ttq_block([0.7, 0.8, 0.75], True),
        "shakespeare_short": ttq_block([0.9, 0.95, 0.92], True),
        "mnist": ttq_block([None, 0.6, 0.7], False)}}
    calibration = derive(document, "time_to_quality.json")
    shakespeare = calibration["datasets"]["tinyshakespeare"]
    assert shakespeare["work_fraction"] == pytest.approx(0.9233, abs=1e-4)  # the larger regime
    assert shakespeare["workloads"]["shakespeare_multi"]["work_fraction"] == pytest.approx(0.75)
    mnist = calibration["datasets"]["mnist"]
    assert mnist["work_fraction"] == 1.0  # guarded off: full data
    assert mnist["workloads"]["mnist"]["samples_ratio_mean"] == pytest.approx(0.7667, abs=1e-4)
    assert mnist["workloads"]["mnist"]["seeds_reached"] == 2


def test_calibration_file_is_read_by_the_simulators_loader(tmp_path):
    import json

    from benchmarks.time_to_quality.calibration import derive
    from training.pruning_calibration import work_fraction

    document = {"summary": {"mnist": ttq_block([0.5, 0.6], True)}}
    path = tmp_path / "c.json"
    path.write_text(json.dumps(derive(document, "x.json")))
    assert work_fraction("mnist", path) == pytest.approx(0.55)


def test_a_guarded_lever_is_judged_against_the_other_seeds_fixed_runs():
    from benchmarks.time_to_quality.suite import fixed_reference

    def run(lever, seed, losses):
        return {"workload": "w", "lever": lever, "seed": seed,
                "eval_curve": [[i, 100 * i, 0.1 * i, v] for i, v in enumerate(losses)]}

    runs = [run("fixed", 0, [3.0, 2.0]), run("fixed", 1, [3.2, 2.2]), run("fixed", 2, [9, 9]),
            run("prune_scored", 0, [1.0, 1.0])]
    assert fixed_reference(runs, "w", seed=2) == ((0.0, 3.1), (100.0, 2.1))
    assert fixed_reference(runs, "other", seed=0) == ()
