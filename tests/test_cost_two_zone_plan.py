"""The exact two-zone plan (benchmarks/cost/two_zone_plan.py): it must be the single-zone plan
when the second zone never has spot, treat its two zones alike, and steer a real replay."""

from __future__ import annotations

import json

import numpy as np
import pytest

from benchmarks.cost.two_zone_plan import (
    IDLE,
    ON_DEMAND,
    SPOT_1,
    SPOT_2,
    TwoZonePlanPolicy,
    solve_two_zone_plan,
)
from cloud.simulator import ClusterRules, JobSpec, Market, simulate
from cloud.traces import default_spot_dir
from controllers.allocation_heuristic import TrainwiseAllocationPolicy
from controllers.allocation_planner import PlanInputs, solve_plan
from controllers.preemption_risk import DOWN, UP, HazardCurve, PreemptionRiskModel

EDGES = (0.0, 1800.0, 7200.0)
INPUTS = PlanInputs(dt_s=600.0, steps=30, max_slack_s=4800.0, changeover_s=360.0, save_s=60.0,
                    spot_usd_per_h=1.0, on_demand_usd_per_h=3.0, slack_unit_s=120.0)


def _model(**zone_rates: tuple[tuple[float, ...], tuple[float, ...]]) -> PreemptionRiskModel:
    curves = {}
    for zone, (up_rates, down_rates) in zone_rates.items():
        curves[(UP, zone, 1)] = HazardCurve(EDGES, up_rates)
        curves[(DOWN, zone, 1)] = HazardCurve(EDGES, down_rates)
    return PreemptionRiskModel(curves)


def test_a_zone_that_never_has_spot_leaves_the_single_zone_plan():
    # Zone b is down and never comes back (a return rate of 1e-12 per hour): the two-zone plan must decide
    # and price exactly as the single-zone plan of zone a, in every state of zone a.
    model = _model(a=((2.0, 0.6, 0.3), (1.5, 0.8, 0.4)), b=((1.0, 1.0, 1.0), (0.0, 0.0, 1e-12)))
    one = solve_plan(model, "a", 1, INPUTS)
    two = solve_two_zone_plan(model, ("a", "b"), INPUTS, (1.0, 1.0))
    bins = len(EDGES)
    b_down = bins  # zone b's first down bin
    for single_mode, two_mode in ((0, IDLE), (1, ON_DEMAND), (2, SPOT_1)):
        np.testing.assert_allclose(two.first_values[two_mode, :, b_down, :],
                                   one.values[INPUTS.steps, single_mode], rtol=1e-5, atol=1e-4)
        # Spot held while zone a is down cannot happen (the preemption released it).
        states = slice(0, bins) if two_mode == SPOT_1 else slice(None)
        expected = one.decisions[1:, single_mode, states]
        got = two.decisions[1:, two_mode, states, b_down, :].copy()
        got[got == SPOT_1] = 2  # the single-zone plan's SPOT
        # Idle and on-demand tie exactly at a few grid points (the same value either way), where
        # rounding picks either; every other decision, and every spot decision, is the same.
        differ = got != expected
        assert differ.mean() < 0.01, "decisions differ from the single-zone plan"
        assert set(got[differ]) | set(expected[differ]) <= {IDLE, ON_DEMAND}
    # Spot in zone b is never chosen while it has none.
    assert not (two.decisions[1:, :, :, b_down:, :] == SPOT_2).any()


def test_swapping_the_zones_swaps_the_plan():
    model = _model(a=((2.0, 0.6, 0.3), (1.5, 0.8, 0.4)), b=((0.8, 0.5, 0.2), (2.5, 1.0, 0.5)))
    ab = solve_two_zone_plan(model, ("a", "b"), INPUTS, (1.0, 1.2))
    ba = solve_two_zone_plan(model, ("b", "a"), INPUTS, (1.2, 1.0))
    swap = np.array([IDLE, ON_DEMAND, SPOT_2, SPOT_1])
    for holding in range(4):
        np.testing.assert_allclose(ab.first_values[holding],
                                   ba.first_values[swap[holding]].transpose(1, 0, 2), rtol=1e-5)
        got = ab.decisions[1:, holding]
        mirrored = swap[ba.decisions[1:, swap[holding]].transpose(0, 2, 1, 3)]
        differ = got != mirrored
        # Exact ties of idle and on-demand aside (see above), the same decisions.
        assert differ.mean() < 0.01, f"holding {holding}: {differ.mean():.2%} differ"
        assert set(got[differ]) | set(mirrored[differ]) <= {IDLE, ON_DEMAND}


def test_with_spot_up_for_good_in_one_zone_the_plan_rides_it():
    # Zone a's spot runs are short, zone b's never end: the plan launches zone b's spot, and a
    # replay of the policy bills the job at spot price plus its launch.
    model = _model(a=((6.0, 6.0, 6.0), (1.0, 1.0, 1.0)), b=((0.0, 0.0, 1e-12), (1.0, 1.0, 1.0)))
    plan = solve_two_zone_plan(model, ("a", "b"), INPUTS, (1.0, 1.0))
    assert plan.decide(INPUTS.steps * INPUTS.dt_s, 3000.0, IDLE, (True, True),
                       (0.0, 3600.0)) == SPOT_2
    ticks = 60
    market = Market(("a", "b"), 600, np.ones((2, ticks), dtype=int), (1.0, 1.0), (3.0, 3.0))
    job = JobSpec(work_gpu_h=4.0, deadline_s=6 * 3600.0, node_count=1, gpus_per_node=1)
    rules = ClusterRules(changeover_s=360.0, checkpoint_save_s=60.0,
                         checkpoint_interval_s=3600.0, notice_s=120.0)
    result = simulate(TwoZonePlanPolicy(model), job, rules, market, home_zone="a")
    assert result.deadline_met and result.spot_share == pytest.approx(1.0)
    assert result.cost_usd == pytest.approx((4.0 + 0.1) * 1.0, rel=0.02)


def test_other_markets_get_the_heuristic_unchanged():
    # Three zones: not a two-zone market, so the policy is trainwise_heuristic as is.
    model = PreemptionRiskModel.constant(7200.0, 3600.0, zones=("a", "b", "c"))
    market = Market(("a", "b", "c"), 600, np.ones((3, 60), dtype=int), (1.0,) * 3, (3.0,) * 3)
    job = JobSpec(work_gpu_h=4.0, deadline_s=6 * 3600.0, node_count=1, gpus_per_node=1)
    rules = ClusterRules(changeover_s=360.0, checkpoint_save_s=60.0,
                         checkpoint_interval_s=3600.0, notice_s=120.0)
    ours = simulate(TwoZonePlanPolicy(model), job, rules, market, home_zone="a",
                    record_events=True)
    theirs = simulate(TrainwiseAllocationPolicy(model), job, rules, market, home_zone="a",
                      record_events=True)
    assert ours.cost_usd == theirs.cost_usd and ours.events == theirs.events


@pytest.mark.skipif(not default_spot_dir().is_dir(), reason="shared spot data missing")
def test_quick_two_zone_floor_writes_a_row_the_oracle_bounds(tmp_path):
    from benchmarks.cost.two_zone_floor import POLICIES, main

    assert main(["--quick", "--out", str(tmp_path), "--no-progress"]) == 0
    document = json.loads((tmp_path / "cost_two_zone_floor.json").read_text())
    assert document["meta"]["command"].startswith("python -m benchmarks.cost.two_zone_floor")
    (row,) = document["rows"]
    assert len(row["zones"]) == 2 and row["protocol"] == "leave_time_out"
    # The home zones of one market window are one draw.
    assert row["windows"] == 4 and row["independent_windows"] == 2
    assert row["mean_usd"]["oracle"] <= min(row["mean_usd"][p] for p in POLICIES) + 1e-9
    for ratio in row["vs_oracle"].values():
        assert ratio["value"] >= 1.0 - 1e-9
    markdown = (tmp_path / "cost_two_zone_floor.md").read_text()
    assert "| leave_time_out | availability-1node-aws-2022-10 |" in markdown



def _day_night_model(factor_day: float, factor_night: float) -> PreemptionRiskModel:
    """Two zones whose spot runs end at `factor` times the base rate by half day (12 h bins)."""
    hours = (factor_day, factor_night)
    curves = {}
    for zone in ("a", "b"):
        curves[(UP, zone, 1)] = HazardCurve(EDGES, (2.0, 0.6, 0.3), hours)
        curves[(DOWN, zone, 1)] = HazardCurve(EDGES, (1.5, 0.8, 0.4), hours)
    return PreemptionRiskModel(curves)


def test_the_plan_by_hour_of_day_reads_the_clock_and_only_the_clock():
    # Flat factors: the hour-by-hour plan is the day-averaged plan. A quiet and a busy half
    # day: the plan started in the quiet half values the job below the one started in the busy
    # half (spot lasts longer while it runs), and the day-averaged plan sits between them.
    flat = _day_night_model(1.0, 1.0)
    averaged = solve_two_zone_plan(flat, ("a", "b"), INPUTS, (1.0, 1.0))
    hourly = solve_two_zone_plan(flat, ("a", "b"), INPUTS, (1.0, 1.0), start_trace_s=7 * 3600.0)
    np.testing.assert_allclose(hourly.first_values, averaged.first_values, rtol=1e-6)
    assert np.array_equal(hourly.decisions, averaged.decisions)
    contrast = _day_night_model(0.2, 1.8)
    state = (IDLE, (True, True), (0.0, 0.0))
    quiet, busy, middle = (
        solve_two_zone_plan(contrast, ("a", "b"), INPUTS, (1.0, 1.0), start_trace_s=start)
        .value_now(2400.0, *state) for start in (0.0, 12 * 3600.0, None))
    assert quiet < middle < busy
