"""trainwise_heuristic in the cost suite: on every quick-suite scenario the hindsight oracle is a
lower bound on its cost, it meets every deadline, and its risk model saw only the past."""

from __future__ import annotations

import pytest

from benchmarks.cost import report
from benchmarks.cost.suite import (
    SETTINGS,
    build_scenarios,
    oracle_violations,
    risk_model_for,
    rules_for,
    run_scenarios,
)
from cloud.traces import default_spot_dir

pytestmark = pytest.mark.skipif(not default_spot_dir().is_dir(), reason="shared spot data missing")

POLICIES = ("trainwise_heuristic", "uniform_progress")


@pytest.fixture(scope="module")
def outcomes():
    """The quick suite's scenarios (one window, two zones per folder), both settings."""
    found = []
    for setting in SETTINGS:
        scenarios = build_scenarios(setting, rules_for(setting), 1, max_zones=2)
        found += run_scenarios(scenarios, POLICIES)
    return found


def test_oracle_is_at_most_trainwise_on_every_quick_scenario(outcomes):
    assert len(outcomes) >= 20
    assert oracle_violations(outcomes) == []
    for outcome in outcomes:
        row = outcome.results["trainwise_heuristic"]
        where = (outcome.scenario.kind, outcome.scenario.folder, outcome.scenario.home_zone)
        assert row["deadline_met"], where
        assert outcome.oracle_met_usd <= row["cost_usd"] + 1e-6, where


def test_every_scenario_model_was_fitted_before_its_window_and_on_other_folders(outcomes):
    for outcome in outcomes:
        scenario = outcome.scenario
        model = risk_model_for(scenario)
        assert f"ticks [0, {scenario.start_tick})" in model.fitted_on
        prior = model.fitted_on.split("prior:", 1)[1]
        assert scenario.source_folder not in prior


def test_goal_rows_cover_every_folder_and_kind(outcomes):
    rows = report.trainwise_goals(outcomes)
    keys = {(o.scenario.setting.name, o.scenario.kind, o.scenario.folder) for o in outcomes}
    assert {(r["setting"], r["kind"], r["folder"]) for r in rows} == keys
    for row in rows:
        assert row["deadlines_met"] == 1.0
        # No policy beats the oracle: the goal's ceiling is the oracle's own ratio.
        assert row["vs_uniform_progress"] >= row["oracle_vs_uniform_progress"] - 1e-9
        assert row["vs_oracle_mean"] >= 1.0 - 1e-9
    assert "| trainwise USD |" in report.goals_table(rows)
