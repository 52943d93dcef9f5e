"""The cost suite end to end in its quick form (minutes, so `slow`): files written, headlines only
out of sample with intervals and independent-window counts, synthetic apart, oracle never beaten.
"""

from __future__ import annotations

import json

import pytest

from benchmarks.cost import main
from benchmarks.results_io import machine
from cloud.traces import default_spot_dir

pytestmark = pytest.mark.skipif(not default_spot_dir().is_dir(), reason="shared spot data missing")

REGISTRY_POLICIES = {"on_demand", "managed_spot", "greedy_spot", "skypilot_failover",
                     "uniform_progress", "trainwise_heuristic"}
POLICIES = REGISTRY_POLICIES | {"trainwise_learned"}


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("cost")
    status = main(["--quick", "--out", str(out), "--no-progress"])
    return status, out


@pytest.mark.slow
def test_quick_suite_writes_table_json_and_plot(quick_run):
    status, out = quick_run
    assert status == 0
    document = json.loads((out / "cost.json").read_text())
    assert document["meta"]["command"].startswith("python -m benchmarks.cost --quick")
    assert document["meta"]["machine"] == machine()
    assert set(document["policies"]) == POLICIES
    headline = document["headline"]
    cells = {(r["protocol"], r["setting"], r["kind"], r["synthetic"]) for r in headline}
    real = {(p, s, k, False) for p in ("leave_one_collection_out", "leave_time_out")
            for s in ("single_node", "gang_4node") for k in ("single_zone", "multi_zone")}
    synthetic = {("leave_one_collection_out", "multi_node", k, True)
                 for k in ("single_zone", "multi_zone")}
    assert cells == real | synthetic
    for row in headline:
        assert row["independent_windows"] <= row["windows"]
        for figure in ("trainwise_mean_usd", "vs_uniform_progress", "vs_oracle"):
            cell = row[figure]
            assert cell["low"] is None or cell["low"] <= cell["value"] <= cell["high"]
    # Cells never mix prices: the 2022-10 folder's four instance types are four cells.
    types = {r["instance_type"] for r in headline
             if r["collection"] == "availability-1node-aws-2022-10"}
    assert types == {"p2.xlarge", "p2.8xlarge", "p3.2xlarge", "p3.16xlarge"}
    # Each policy row's robustness from its own windows' results: misses are the results that
    # finish after the deadline (or never), the worst window is the highest cost / on-demand.
    for row in document["policy_rows"]:
        mine = [s for s in document["scenarios"]
                if (s["protocol"], s["setting"], s["kind"]) == (row["protocol"], row["setting"],
                                                                 row["kind"])]
        assert len(mine) == row["windows"]
        late = [s for s in mine if s["results"][row["policy"]]["finish_h"] is None
                or s["results"][row["policy"]]["finish_h"] > s["deadline_h"]]
        assert row["deadline_misses"] == len(late), row["policy"]
        assert row["worst_vs_on_demand"] == pytest.approx(max(
            s["results"][row["policy"]]["cost_usd"] / s["results"]["on_demand"]["cost_usd"]
            for s in mine), rel=1e-4), row["policy"]
    markdown = (out / "cost.md").read_text()
    headlines, synthetic_part = markdown.split("## SYNTHETIC market", 1)
    assert "## Headline, leave-one-collection-out" in headlines
    assert "## Headline, leave-time-out" in headlines
    assert "synthetic:" not in headlines and "synthetic: 4 x" in synthetic_part
    assert "in_sample" not in markdown and "| uniform_progress |" in markdown
    assert (out / "cost_vs_slack.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # The short gang job (issue 9's thin-slack case): apart from the headline, both protocols.
    short = document["short_jobs"]
    assert {(r["protocol"], r["setting"], r["kind"]) for r in short["headline"]} == {
        (p, "gang_4node_short", k) for p in ("leave_one_collection_out", "leave_time_out")
        for k in ("single_zone", "multi_zone")}
    assert "trainwise_learned" not in short["policies"]
    assert all(r["setting"] != "gang_4node_short" for r in headline)
    assert "## Short gang job" in markdown
    # The learned policy has no whole-trace replay: it needs a held-out fold.
    assert document["timing"]["full_trace_s"].keys() == REGISTRY_POLICIES


@pytest.mark.slow
def test_oracle_is_at_most_every_policy_in_every_scenario(quick_run):
    _, out = quick_run
    document = json.loads((out / "cost.json").read_text())
    assert document["oracle_violations"] == []
    assert len(document["scenarios"]) >= 20
    for scenario in document["scenarios"]:
        for name, result in scenario["results"].items():
            bound = (
                scenario["oracle_met_usd"] if result["deadline_met"] else scenario["oracle_any_usd"]
            )
            # Costs are stored to 4 decimals; the suite itself checks the unrounded ones.
            assert bound <= result["cost_usd"] + 1e-3, (
                name,
                scenario["folder"],
                scenario["home_zone"],
            )
    for row in document["policy_rows"]:
        if row["deadline_misses"] == 0:
            assert row["vs_oracle_mean_of_ratios"]["value"] >= 1.0 - 1e-6, row["policy"]


def test_unknown_policy_is_refused(tmp_path):
    with pytest.raises(SystemExit, match="unknown policy 'magic'; valid: on_demand"):
        main(["--quick", "--out", str(tmp_path), "--policies", "magic"])


@pytest.mark.slow
def test_learned_row_covers_every_headline_cell_from_a_fold_that_never_saw_it(quick_run):
    _, out = quick_run
    document = json.loads((out / "cost.json").read_text())
    learned = document["learned"]
    cells = {(r["protocol"], r["setting"], r["kind"], r["collection"], r["instance_type"])
             for r in document["headline"]}
    rows = {(r["protocol"], r["setting"], r["kind"], r["collection"], r["instance_type"]): r
            for r in learned["rows"]}
    assert rows.keys() == cells
    folds = {(f["protocol"], f["held_out"]): f for f in learned["folds"]}
    for row in rows.values():
        assert row["held_out"]
        for figure in ("learned_mean_usd", "vs_heuristic", "vs_uniform_progress", "vs_oracle"):
            cell = row[figure]
            assert cell["low"] is None or cell["low"] <= cell["value"] <= cell["high"]
    for (protocol, held_out), fold in folds.items():
        if protocol == "leave_one_collection_out":
            assert held_out not in fold["trained_on_collections"]
        else:
            assert fold["trained_on_collections"] == [held_out]
    markdown = (out / "cost.md").read_text()
    assert "## trainwise_learned, held-out cells only" in markdown
    assert "### What each learned policy was trained on" in markdown
