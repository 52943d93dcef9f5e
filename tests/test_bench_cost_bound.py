"""The model-world bound in its quick form (seconds): files written with provenance, one row per
single-node single-zone cell of the suite, the oracle never beaten in any window, trainwise never
below the oracle, and windows that are really sampled from each cell's model."""

from __future__ import annotations

import json

import pytest

from benchmarks.cost.bound import main
from cloud.traces import default_spot_dir

pytestmark = pytest.mark.skipif(not default_spot_dir().is_dir(), reason="shared spot data missing")

CELLS = {("availability-1node-aws-2023-02", "p3.2xlarge"),
         ("preemption-1node-aws-2023-04", "p3.2xlarge"),
         *{("availability-1node-aws-2022-10", t)
           for t in ("p2.xlarge", "p2.8xlarge", "p3.2xlarge", "p3.16xlarge")}}
POLICIES = ("on_demand", "uniform_progress", "trainwise_heuristic")


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("bound")
    status = main(["--quick", "--out", str(out), "--no-progress"])
    return status, out


def test_quick_bound_writes_rows_per_cell_with_provenance(quick_run):
    status, out = quick_run
    assert status == 0
    document = json.loads((out / "cost_bound.json").read_text())
    meta = document["meta"]
    assert meta["command"].startswith("python -m benchmarks.cost.bound --quick")
    assert meta["machine"]["cpu_count"] >= 1 and "tree_dirty" in meta and "commit" in meta
    rows = document["rows"]
    assert {(r["collection"], r["instance_type"]) for r in rows} == CELLS
    assert {r["protocol"] for r in rows} == {"leave_time_out"}
    for row in rows:
        assert row["windows"] == row["independent_windows"] == 2
        ratio = row["trainwise_vs_oracle"]
        assert ratio["value"] >= 1.0 - 1e-9
        assert ratio["low"] is None or ratio["low"] <= ratio["value"] <= ratio["high"]
        assert 0.0 < row["oracle_vs_uniform_progress"]["value"] <= 1.0 + 1e-9
        assert row["mean_usd"]["oracle"] <= min(row["mean_usd"][p] for p in POLICIES) + 1e-9
        assert 0.0 <= row["spot_up_share_sampled"] <= 1.0
        assert "leave_time_out" in row["model_fitted_on"]
    markdown = (out / "cost_bound.md").read_text()
    assert markdown.startswith("<!-- written by `python -m benchmarks.cost.bound --quick")
    assert "## leave_time_out" in markdown and "What it does not mean" in markdown


def test_quick_bound_oracle_is_below_every_policy_in_every_window(quick_run):
    _, out = quick_run
    document = json.loads((out / "cost_bound.json").read_text())
    assert document["oracle_violations"] == []
    windows = document["windows"]
    assert len(windows) == 2 * len(CELLS)
    for window in windows:
        for policy in POLICIES:
            assert window["oracle_usd"] <= window[f"{policy}_usd"] + 1e-6, (policy, window)
    # Windows of one zone of one synthetic market never share a start (back to back).
    starts = {}
    for window in windows:
        starts.setdefault((window["collection"], window["instance_type"], window["zone"],
                           window["seed"]), []).append(window["start_tick"])
    assert all(len(set(s)) == len(s) for s in starts.values())


def test_model_world_windows_come_from_the_cells_model():
    """The synthetic market keeps the cell's zones, tick, prices and job; trainwise gets the
    sampled market's run in progress, not the real trace's."""
    from benchmarks.cost.bound import model_world_scenarios, suite_cells, trainwise_with_true_model

    cell = next(c for c in suite_cells(("leave_time_out",))
                if c.folder == "availability-1node-aws-2022-10")
    scenarios = model_world_scenarios(cell, windows_per_zone=2, seeds=2, burn_in_s=86400.0)
    real = cell.template.trace_market
    assert len(scenarios) == 2 * len(real.zones)
    for scenario in scenarios:
        assert scenario.market.tick_s == real.tick_s
        assert scenario.market.n_ticks == cell.template.window_ticks
        assert scenario.job == cell.template.job and scenario.rules == cell.template.rules
        z = real.zones.index(scenario.home_zone)
        assert scenario.market.spot_usd_per_hour == (real.spot_usd_per_hour[z],)
        assert scenario.trace_market is not real
    policy = trainwise_with_true_model({cell.key: cell.model})(scenarios[0])
    sampled = scenarios[0].trace_market
    assert policy.model.curves is cell.model.curves
    state, age_s = policy.model.run_at_cutoff[(scenarios[0].home_zone, 1)]
    z = sampled.zones.index(scenarios[0].home_zone)
    before = sampled.spot_available[z, :scenarios[0].start_tick]
    assert state == ("up" if before[-1] >= 1 else "down")
    assert age_s > 0 and age_s % sampled.tick_s == 0
