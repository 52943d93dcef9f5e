"""The model-world bound in its quick form (seconds): files written with provenance, one row per
cell of the suite (single node and the 4-node gang, single- and multi-zone), the oracle never
beaten in any window, trainwise never below the oracle, and windows that are really sampled from
each cell's model (a gang's at the gang's level)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from benchmarks.cost.bound import main
from benchmarks.results_io import machine
from cloud.traces import default_spot_dir

pytestmark = pytest.mark.skipif(not default_spot_dir().is_dir(), reason="shared spot data missing")

SINGLE_NODE_CELLS = {("availability-1node-aws-2023-02", "p3.2xlarge"),
                     ("preemption-1node-aws-2023-04", "p3.2xlarge"),
                     *{("availability-1node-aws-2022-10", t)
                       for t in ("p2.xlarge", "p2.8xlarge", "p3.2xlarge", "p3.16xlarge")}}
GANG_CELL = ("preemption-4node-aws-2023-08", "p3.2xlarge")
CELLS = {(setting, kind, *cell)
         for kind in ("single_zone", "multi_zone")
         for setting, cells in (("single_node", SINGLE_NODE_CELLS), ("gang_4node", {GANG_CELL}))
         for cell in cells}
POLICIES = ("on_demand", "uniform_progress", "trainwise_heuristic")
# Quick: 2 market windows per cell; single-zone cells keep 1 zone, multi-zone cells 2.
QUICK_ZONES = {"single_zone": 1, "multi_zone": 2}


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("bound")
    status = main(["--quick", "--out", str(out), "--no-progress"])
    return status, json.loads((out / "cost_bound.json").read_text()), out


def test_quick_bound_writes_rows_per_cell_with_provenance(quick_run):
    status, document, out = quick_run
    assert status == 0
    meta = document["meta"]
    assert meta["command"].startswith("python -m benchmarks.cost.bound --quick")
    assert meta["machine"] == machine() and "tree_dirty" in meta and "commit" in meta
    rows = document["rows"]
    assert len(rows) == len(CELLS)
    assert {(r["setting"], r["kind"], r["collection"], r["instance_type"]) for r in rows} == CELLS
    assert {r["protocol"] for r in rows} == {"leave_time_out"}
    for row in rows:
        zones = QUICK_ZONES[row["kind"]]
        assert row["zones"] == zones and row["windows"] == 2 * zones
        # Multi-zone: the home zones of one market window are one draw, not several.
        assert row["independent_windows"] == (2 if row["kind"] == "multi_zone" else 2 * zones)
        assert row["nodes"] == (4 if row["setting"] == "gang_4node" else 1)
        ratio = row["trainwise_vs_oracle"]
        assert ratio["value"] >= 1.0 - 1e-9
        assert ratio["low"] is None or ratio["low"] <= ratio["value"] <= ratio["high"]
        assert 0.0 < row["oracle_vs_uniform_progress"]["value"] <= 1.0 + 1e-9
        assert row["mean_usd"]["oracle"] <= min(row["mean_usd"][p] for p in POLICIES) + 1e-9
        assert "leave_time_out" in row["model_fitted_on"]
        # Robustness from the row's own windows: the share costing more than on-demand in that
        # same window, and the worst window's cost / on-demand's.
        mine = [w for w in document["windows"]
                if (w["setting"], w["kind"], w["collection"], w["instance_type"])
                == (row["setting"], row["kind"], row["collection"], row["instance_type"])]
        assert len(mine) == row["windows"]
        for policy in ("uniform_progress", "trainwise_heuristic"):
            figures = row["robustness"][policy]
            costlier = [w[f"{policy}_usd"] > w["on_demand_usd"] * (1 + 1e-6) for w in mine]
            assert figures["windows"] == len(mine)
            assert figures["costlier_than_on_demand_share"] == sum(costlier) / len(mine)
            assert figures["worst_vs_on_demand"] == pytest.approx(
                max(w[f"{policy}_usd"] / w["on_demand_usd"] for w in mine))
    # Whole-gang availability of the markets the windows were cut from, drawn again from each
    # cell's model: the share of ticks a zone holds all of the cell's nodes on spot.
    for row in rows:
        assert row["spot_up_share_sampled"] == pytest.approx(_sampled_up_share(row))
    markdown = (out / "cost_bound.md").read_text()
    assert markdown.startswith("<!-- written by `python -m benchmarks.cost.bound --quick")
    for section in ("## single_node, single_zone, leave_time_out",
                    "## single_node, multi_zone, leave_time_out",
                    "## gang_4node, single_zone, leave_time_out",
                    "## gang_4node, multi_zone, leave_time_out"):
        assert section in markdown
    assert "What it does not mean" in markdown and "Zones are sampled independently" in markdown


def test_quick_bound_oracle_is_below_every_policy_in_every_window(quick_run):
    _, document, _ = quick_run
    assert document["oracle_violations"] == []
    windows = document["windows"]
    assert len(windows) == sum(r["windows"] for r in document["rows"])
    for window in windows:
        for policy in POLICIES:
            assert window["oracle_usd"] <= window[f"{policy}_usd"] + 1e-6, (policy, window)
    # Windows of one zone of one synthetic market never share a start (back to back).
    starts = {}
    for window in windows:
        starts.setdefault((window["setting"], window["kind"], window["collection"],
                           window["instance_type"], window["zone"], window["market_seed"]),
                          []).append(window["start_tick"])
    assert all(len(set(s)) == len(s) for s in starts.values())


def test_settings_and_kinds_select_the_cells(tmp_path):
    status = main(["--quick", "--settings", "gang_4node", "--kinds", "multi_zone",
                   "--out", str(tmp_path), "--no-progress"])
    assert status == 0
    rows = json.loads((tmp_path / "cost_bound.json").read_text())["rows"]
    assert [(r["setting"], r["kind"]) for r in rows] == [("gang_4node", "multi_zone")]


def _cell(setting: str, kind: str, folder: str):
    from benchmarks.cost.bound import suite_cells

    return next(c for c in suite_cells(("leave_time_out",), (setting,), (kind,))
                if c.folder == folder)


def _sampled_up_share(row: dict) -> float:
    """The quick run's synthetic markets of `row`'s cell, sampled again (same seeds): the mean
    over them of the share of ticks with at least the cell's nodes free on spot."""
    from benchmarks.cost.bound import (
        QUICK_BURN_IN_S,
        QUICK_WINDOWS,
        model_world_scenarios,
        suite_cells,
    )

    cell = next(c for c in suite_cells(("leave_time_out",), (row["setting"],), (row["kind"],))
                if (c.folder, c.instance_type) == (row["collection"], row["instance_type"]))
    scenarios = model_world_scenarios(cell, QUICK_WINDOWS, 1, QUICK_BURN_IN_S,
                                      QUICK_ZONES[row["kind"]])
    markets = {id(s.trace_market): s.trace_market for s in scenarios}
    return float(np.mean([(m.spot_available >= row["nodes"]).mean() for m in markets.values()]))


def test_model_world_windows_come_from_the_cells_model():
    """The synthetic market keeps the cell's zones, tick, prices and job; trainwise gets the
    sampled market's run in progress, not the real trace's."""
    from benchmarks.cost.bound import model_world_scenarios, trainwise_with_true_model

    cell = _cell("single_node", "single_zone", "availability-1node-aws-2022-10")
    scenarios = model_world_scenarios(cell, windows=2, seeds=2, burn_in_s=86400.0)
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


def test_multi_zone_windows_hold_every_zone_and_share_one_oracle_per_window():
    from benchmarks.cost.bound import model_world_scenarios

    cell = _cell("single_node", "multi_zone", "preemption-1node-aws-2023-04")
    real = cell.template.trace_market
    scenarios = model_world_scenarios(cell, windows=2, seeds=1, burn_in_s=86400.0)
    assert len(scenarios) == 2 * len(real.zones)
    for scenario in scenarios:
        assert scenario.kind == "multi_zone" and scenario.market.zones == real.zones
        assert scenario.market.spot_usd_per_hour == real.spot_usd_per_hour
    by_start = {}
    for scenario in scenarios:
        by_start.setdefault(scenario.start_tick, []).append(scenario)
    assert len(by_start) == 2
    for same_window in by_start.values():
        assert {s.home_zone for s in same_window} == set(real.zones)
        assert len({s.oracle_key for s in same_window}) == 1
    # The multi-zone cell samples the same markets as the single-zone cell of its collection
    # (same seeds), so the two kinds are compared on the same draws.
    single = _cell("single_node", "single_zone", "preemption-1node-aws-2023-04")
    single_scenarios = model_world_scenarios(single, windows=2, seeds=1, burn_in_s=86400.0)
    assert np.array_equal(single_scenarios[0].trace_market.spot_available,
                          scenarios[0].trace_market.spot_available)


def test_gang_windows_are_sampled_at_the_gangs_level():
    """A 4-node gang's zone holds all 4 spot nodes or none; the job, rules (stragglers) and faults
    are the suite's; trainwise plans with the level-4 curves the market was drawn from."""
    from benchmarks.cost.bound import model_world_scenarios, trainwise_with_true_model

    cell = _cell("gang_4node", "single_zone", "preemption-4node-aws-2023-08")
    assert cell.nodes == 4 and cell.template.rules.step_slowdown > 1.0
    scenarios = model_world_scenarios(cell, windows=2, seeds=1, burn_in_s=86400.0)
    values = set(np.unique(scenarios[0].trace_market.spot_available).tolist())
    assert values <= {0, 4} and 4 in values
    assert scenarios[0].setting.faults and len({s.seed for s in scenarios}) == len(scenarios)
    policy = trainwise_with_true_model({cell.key: cell.model})(scenarios[0])
    assert policy.model.curve(scenarios[0].home_zone, 4) is \
        cell.sampling_model().curve(scenarios[0].home_zone, 4)
