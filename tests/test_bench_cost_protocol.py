"""The cost suite's out-of-sample protocol and its statistics (issue 9 items 2, 3 and 6).

Pinned here, fast: the held-out collection never reaches the risk fit (a spy on what the fit
receives), leave-time-out fits only the ticks before its split and scores only windows after it,
independent-window counting, the block bootstrap (contains the estimate, narrows with more
windows, seeded), the robustness figures on a hand-built case, and synthetic markets never pooled
with real ones nor shown as headlines.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

import cloud.scenario_protocol as protocol
from benchmarks.cost import report
from benchmarks.cost.stats import (
    block_bootstrap,
    independent_windows,
    robustness,
    time_blocks,
)
from benchmarks.cost.suite import ScenarioOutcome
from cloud import scenarios as cloud_scenarios
from cloud.risk_fit import AvailabilityHistory
from cloud.risk_fit import fit_risk_model as real_fit
from cloud.scenario_protocol import (
    LOCO,
    LTO,
    FitSplit,
    at_window_start,
    fit_for_split,
    loco_split,
    lto_split,
    lto_split_tick,
    runs_before,
)
from cloud.scenarios import (
    MULTI_NODE,
    SINGLE_NODE,
    Scenario,
    build_scenarios,
    risk_model_for,
    rules_for,
)
from cloud.simulator import JobSpec, Market
from cloud.traces import default_spot_dir
from controllers.preemption_risk import DOWN, UP

needs_data = pytest.mark.skipif(not default_spot_dir().is_dir(), reason="shared spot data missing")

# A value no other test collection uses: if it reaches the fit, the held-out data leaked.
HELD_OUT_MARK = 7


def _market(values: list[list[int]], tick_s: int = 60) -> Market:
    zones = tuple(f"zone-{i}" for i in range(len(values)))
    return Market(zones, tick_s, np.array(values, dtype=np.int64), (1.0,) * len(values),
                  (3.0,) * len(values))


def _history(name: str, values: list[int]) -> AvailabilityHistory:
    return AvailabilityHistory(name, ("z",), 60.0, np.array([values]), max(1, max(values)))


class FitSpy:
    """Stands in for `fit_risk_model`: records what it is handed, then fits for real."""

    def __init__(self) -> None:
        self.calls: list[tuple[AvailabilityHistory, int, list[AvailabilityHistory]]] = []

    def __call__(self, target, cutoff_tick, prior=()):
        self.calls.append((target, cutoff_tick, list(prior)))
        return real_fit(target, cutoff_tick, prior)


# Splits -------------------------------------------------------------------------------------------


def test_loco_fit_receives_no_tick_of_the_held_out_collection():
    held_out = _market([[HELD_OUT_MARK, 0, HELD_OUT_MARK, HELD_OUT_MARK] * 50] * 2)
    others = {"b": [_history("b/v100", [1, 1, 0, 1] * 40)],
              "c": [_history("c/v100", [0, 1, 1, 1] * 40)]}
    asked: list[str] = []

    def histories(collection: str):
        asked.append(collection)
        if collection == "a":
            raise AssertionError("the held-out collection's history was requested")
        return others[collection]

    spy = FitSpy()
    model = fit_for_split(loco_split("a", ["a", "b", "c"]), held_out, "a/v100", histories, spy)
    (target, cutoff, prior), = spy.calls
    assert asked == ["b", "c"]
    assert cutoff == 0 and target.available.shape == (2, 0)
    assert [h.name for h in prior] == ["b/v100", "c/v100"]
    assert all(HELD_OUT_MARK not in h.available for h in prior)
    assert "none of a" in model.fitted_on and "fitted on b, c" in model.fitted_on


def test_a_split_that_fits_on_its_held_out_collection_is_refused():
    with pytest.raises(ValueError, match="holds out 'a' but also fits on it"):
        FitSplit(LOCO, "a", ("a", "b"))
    with pytest.raises(ValueError, match="reads no tick of the held-out"):
        FitSplit(LOCO, "a", ("b",), fit_ticks=10)
    with pytest.raises(ValueError, match="not among"):
        loco_split("a", ["b"])


def test_lto_fit_receives_only_the_ticks_before_the_split_and_no_other_collection():
    values = np.arange(40).reshape(2, 20) % 3
    market = _market(values.tolist())
    split = lto_split("a", lto_split_tick(market.n_ticks, window_ticks=5))
    spy = FitSpy()
    fit_for_split(split, market, "a/v100", lambda c: pytest.fail(f"asked for {c}"), spy)
    (target, cutoff, prior), = spy.calls
    assert split.fit_ticks == 10 and cutoff == 10 and prior == []
    np.testing.assert_array_equal(target.available, values[:, :10])
    # A copy: the fit cannot reach the later ticks through a view of the market.
    assert not np.shares_memory(target.available, market.spot_available)


def test_lto_split_tick_leaves_room_for_a_window_or_says_why():
    assert lto_split_tick(100, 30) == 50
    with pytest.raises(ValueError, match="leaves no room for a 60-tick window"):
        lto_split_tick(100, 60)


def test_window_start_runs_are_read_before_the_window_only():
    market = _market([[1, 1, 0, 0, 0, 1, 1], [0, 1, 1, 1, 1, 1, 0]])
    runs = runs_before(market, 5, levels=[1])
    assert runs == {("zone-0", 1): (DOWN, 3 * 60.0), ("zone-1", 1): (UP, 4 * 60.0)}
    # Changing the window itself (ticks >= 5) changes nothing.
    changed = replace(market, spot_available=np.array([[1, 1, 0, 0, 0, 0, 0],
                                                       [0, 1, 1, 1, 1, 0, 0]]))
    assert runs_before(changed, 5, levels=[1]) == runs
    assert runs_before(market, 0, levels=[1]) == {}
    model = real_fit(_history("b/v100", [1, 0] * 30), 0)
    windowed = at_window_start(model, market, 5)
    assert windowed.run_at_cutoff[("zone-0", 1)] == (DOWN, 180.0)
    assert model.run_at_cutoff == {} and windowed.curves is model.curves


@needs_data
def test_suite_never_hands_the_held_out_collection_to_the_fit(monkeypatch):
    """On real data: every LOCO window's fit sees no tick and no history of its collection."""
    spy = FitSpy()
    monkeypatch.setattr(protocol, "fit_risk_model", spy)
    monkeypatch.setattr(cloud_scenarios, "_RISK_MODELS", {})
    monkeypatch.setattr(cloud_scenarios, "_WINDOW_MODELS", {})
    held_out = "preemption-1node-aws-2023-04"
    scenarios = build_scenarios(SINGLE_NODE, rules_for(SINGLE_NODE), 2, max_zones=2,
                                folders=(held_out,), kinds=("single_zone",))
    assert {s.fit_split.protocol for s in scenarios} == {LOCO}
    for scenario in scenarios:
        model = risk_model_for(scenario)
        assert model.fitted_on.startswith(f"{LOCO}: fitted on ")
        assert risk_model_for(scenario) is model  # the policy and a caller share one object
    assert len(spy.calls) == 1  # one fit per split and market, shared by its windows
    target, cutoff, prior = spy.calls[0]
    assert cutoff == 0 and target.available.shape[1] == 0
    names = [h.name for h in prior]
    assert names and not any(name.startswith(held_out) for name in names)
    assert {name.split("/")[0] for name in names} == set(cloud_scenarios.all_collections()) - {held_out}


@needs_data
def test_suite_leave_time_out_scores_only_windows_after_its_fit(monkeypatch):
    spy = FitSpy()
    monkeypatch.setattr(protocol, "fit_risk_model", spy)
    monkeypatch.setattr(cloud_scenarios, "_RISK_MODELS", {})
    monkeypatch.setattr(cloud_scenarios, "_WINDOW_MODELS", {})
    scenarios = build_scenarios(SINGLE_NODE, rules_for(SINGLE_NODE), 3, max_zones=2,
                                folders=("preemption-1node-aws-2023-04",),
                                kinds=("single_zone",), protocol=LTO)
    split = scenarios[0].fit_split
    assert split.protocol == LTO and split.fit_collections == ()
    assert min(s.start_tick for s in scenarios) == split.fit_ticks
    for scenario in scenarios:
        risk_model_for(scenario)
    (target, cutoff, prior), = spy.calls
    assert prior == [] and cutoff == split.fit_ticks == target.available.shape[1]


@needs_data
def test_synthetic_market_refuses_a_time_split_and_is_labelled():
    with pytest.raises(ValueError, match="synthetic market; leave-time-out cannot split it"):
        build_scenarios(MULTI_NODE, rules_for(MULTI_NODE), 1, max_zones=1, protocol=LTO)
    assert MULTI_NODE.synthetic and not SINGLE_NODE.synthetic
    assert not cloud_scenarios.GANG_4NODE.synthetic and cloud_scenarios.GANG_4NODE.copies == 1


# Statistics ---------------------------------------------------------------------------------------


def test_independent_windows_counts_non_overlapping_spans_zones_once():
    assert independent_windows([0, 10, 20, 30], window_ticks=15) == 2
    assert independent_windows([0, 0, 0, 15, 15], window_ticks=15) == 2  # zones at the same hours
    assert independent_windows([30, 0, 45], window_ticks=15) == 3
    with pytest.raises(ValueError, match="window_ticks=0"):
        independent_windows([0], 0)


def test_time_blocks_group_windows_by_collection_and_window_length():
    blocks = time_blocks(["a", "a", "a", "b"], [0, 5, 12, 0], [10, 10, 10, 10])
    assert blocks.tolist() == [0, 0, 1, 2]


def test_bootstrap_contains_its_estimate_narrows_with_more_windows_and_is_seeded():
    rng = np.random.default_rng(0)
    widths = []
    for n in (8, 64, 512):
        costs = rng.gamma(4.0, 25.0, size=n)
        interval = block_bootstrap(costs, None, np.arange(n))
        assert interval.value == pytest.approx(costs.mean())
        assert interval.low < interval.value < interval.high
        widths.append(interval.high - interval.low)
        assert block_bootstrap(costs, None, np.arange(n)) == interval  # same seed, same answer
    assert widths[0] > widths[1] > widths[2]


def test_bootstrap_of_a_ratio_resamples_whole_blocks():
    num, den = np.array([1.0, 3.0, 2.0, 2.0]), np.array([2.0, 2.0, 2.0, 2.0])
    interval = block_bootstrap(num, den, [0, 0, 1, 1], min_blocks=2)
    assert interval.value == pytest.approx(8.0 / 8.0)
    # Each block's own ratio is 1.0: however blocks are drawn, the ratio stays 1.
    assert interval.low == pytest.approx(1.0) and interval.high == pytest.approx(1.0)
    few = block_bootstrap(num, den, [0, 0, 1, 1])
    assert few.low is None and few.blocks == 2


def test_robustness_on_a_hand_built_case():
    figures = robustness([10.0, 12.0, 8.0, 10.0], [10.0, 10.0, 10.0, 10.0],
                         [True, True, False, True])
    assert figures == {"windows": 4, "worst_vs_on_demand": pytest.approx(1.2),
                       "costlier_than_on_demand_share": 0.25, "deadline_misses": 1}
    with pytest.raises(ValueError, match="one cost, on-demand cost and deadline flag"):
        robustness([1.0], [1.0, 2.0], [True])


# Report: synthetic never pooled -------------------------------------------------------------------


def _outcome(setting, folder: str, start: int, costs: dict[str, float], oracle: float,
             split: FitSplit) -> ScenarioOutcome:
    market = _market([[1] * 10])
    scenario = Scenario(
        setting=setting, kind="single_zone", folder=folder, instance_type="p3.2xlarge",
        market=market, home_zone="zone-0", start_tick=start,
        job=JobSpec(work_gpu_h=1.0, deadline_s=600.0), rules=rules_for(SINGLE_NODE),
        oracle_key=(folder, start), seed=0, deadline_h=1.0,
        source_folder="preemption-4node-aws-2023-08", fit_split=split, window_ticks=10)
    results = {name: {"cost_usd": cost, "deadline_met": True, "spot_share": 0.5}
               for name, cost in costs.items()}
    return ScenarioOutcome(scenario, oracle, oracle, results)


def test_synthetic_cells_are_never_pooled_with_real_ones_nor_headlined():
    split = loco_split("preemption-4node-aws-2023-08", ["preemption-4node-aws-2023-08", "x"])
    real = [_outcome(cloud_scenarios.GANG_4NODE, "preemption-4node-aws-2023-08", 10 * i,
                     {"on_demand": 10.0, "uniform_progress": 8.0, "trainwise_heuristic": 6.0},
                     5.0, split) for i in range(4)]
    fake = [_outcome(MULTI_NODE, "synthetic: 4 x preemption-4node-aws-2023-08 shifted 1 d",
                     10 * i, {"on_demand": 10.0, "uniform_progress": 9.0,
                              "trainwise_heuristic": 1.0}, 0.5, split) for i in range(4)]
    rows = report.headline_rows(real + fake)
    assert [(r["setting"], r["synthetic"]) for r in rows] == [
        ("gang_4node", False), ("multi_node", True)]
    assert rows[0]["vs_uniform_progress"]["value"] == pytest.approx(0.75)  # the real cell alone
    assert rows[0]["windows"] == 4 and rows[0]["independent_windows"] == 4
    assert rows[1]["goal_met"] is None and "synthetic" in rows[1]["goal"]
    policies = ("on_demand", "uniform_progress", "trainwise_heuristic")
    prows = report.policy_rows(real + fake, policies)
    assert {(r["setting"], r["synthetic"]) for r in prows} == {
        ("gang_4node", False), ("multi_node", True)}
    payload = {
        "notes": "", "headline": rows, "policy_rows": prows, "sweep": [], "sweep_folder": "-",
        "settings": [{"name": s.name, "title": s.title, "synthetic": s.synthetic}
                     for s in (cloud_scenarios.GANG_4NODE, MULTI_NODE)],
        "timing": {"suite_wall_s": 0.0, "full_trace_s": {}}, "oracle_violations": [],
    }
    markdown = report.render_markdown(payload, policies)
    headline, synthetic_part = markdown.split("## SYNTHETIC market", 1)
    assert "synthetic:" not in headline
    assert "| multi_node | single_zone | synthetic: 4 x" in synthetic_part
