"""trainwise_heuristic in the cost suite: on every quick-suite scenario (both out-of-sample
protocols) the hindsight oracle is a lower bound on its cost, it meets every deadline, and its
risk model saw only what its split allows. Simulates every quick scenario: `slow`."""

from __future__ import annotations

import pytest

from benchmarks.cost import report
from benchmarks.cost.suite import oracle_violations, run_scenarios
from cloud.scenario_protocol import LOCO, LTO
from cloud.scenarios import SETTINGS, build_scenarios, risk_model_for, rules_for
from cloud.traces import default_spot_dir

pytestmark = [
    pytest.mark.skipif(not default_spot_dir().is_dir(), reason="shared spot data missing"),
    pytest.mark.slow,
]

POLICIES = ("trainwise_heuristic", "uniform_progress")


@pytest.fixture(scope="module")
def outcomes():
    """One window per zone (two zones per folder), every setting, both protocols (no time split
    of the synthetic market)."""
    found = []
    for protocol in (LOCO, LTO):
        for setting in SETTINGS:
            if protocol == LTO and setting.synthetic:
                continue
            scenarios = build_scenarios(setting, rules_for(setting), 1, max_zones=2,
                                        protocol=protocol)
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


def test_every_scenario_model_was_fitted_only_on_what_its_split_allows(outcomes):
    for outcome in outcomes:
        scenario = outcome.scenario
        split = scenario.fit_split
        model = risk_model_for(scenario)
        if split.protocol == LOCO:
            assert scenario.source_folder not in split.fit_collections
            assert model.fitted_on.startswith(f"{LOCO}: fitted on ")
            assert "ticks [0, 0)" in model.fitted_on  # the held-out market: no tick read
        else:
            assert split.fit_ticks <= scenario.start_tick
            assert f"ticks [0, {split.fit_ticks})" in model.fitted_on
            assert "prior: none" in model.fitted_on


def test_headline_rows_cover_every_cell(outcomes):
    rows = report.headline_rows(outcomes)
    keys = {report.cell_key(o) for o in outcomes}
    assert {(r["protocol"], r["setting"], r["kind"], r["collection"], r["instance_type"])
            for r in rows} == keys
    for row in rows:
        assert row["deadline_misses"] == 0
        # No policy beats the oracle: trainwise's ratio to uniform_progress is at least the
        # oracle's own.
        assert row["vs_uniform_progress"]["value"] >= row["oracle_vs_uniform_progress"] - 1e-9
        assert row["vs_oracle"]["value"] >= 1.0 - 1e-9
    assert "| trainwise USD [95%] |" in report.headline_table(rows)
