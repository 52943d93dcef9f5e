"""The cost suite end to end in its quick form: files written, oracle never beaten."""

from __future__ import annotations

import json

import pytest

from benchmarks.cost import main
from cloud.traces import default_spot_dir

pytestmark = pytest.mark.skipif(not default_spot_dir().is_dir(), reason="shared spot data missing")

POLICIES = {"on_demand", "managed_spot", "greedy_spot", "skypilot_failover", "uniform_progress",
            "trainwise_heuristic"}


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("cost")
    status = main(["--quick", "--out", str(out), "--no-progress"])
    return status, out


def test_quick_suite_writes_table_json_and_plot(quick_run):
    status, out = quick_run
    assert status == 0
    document = json.loads((out / "cost.json").read_text())
    assert document["meta"]["command"].startswith("python -m benchmarks.cost --quick")
    assert document["meta"]["machine"]["cpu_count"] >= 1
    assert set(document["policies"]) == POLICIES
    kinds = {(r["setting"], r["kind"]) for r in document["summary"]}
    assert kinds == {
        (s, k) for s in ("single_node", "multi_node") for k in ("single_zone", "multi_zone")
    }
    markdown = (out / "cost.md").read_text()
    assert "Can't Be Late setting" in markdown and "| uniform_progress |" in markdown
    assert "Does uniform_progress beat greedy_spot" in markdown
    assert (out / "cost_vs_slack.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert document["timing"]["full_trace_s"].keys() == POLICIES


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
    oracle_rows = [r for r in document["summary"] if r["policy"] == "oracle"]
    for row in oracle_rows:
        others = [
            r
            for r in document["summary"]
            if (r["setting"], r["kind"]) == (row["setting"], row["kind"])
            and r["policy"] != "oracle"
            and r["deadlines_met"] == 1.0
        ]
        assert all(row["mean_usd"] <= r["mean_usd"] + 1e-6 for r in others)


def test_unknown_policy_is_refused(tmp_path):
    with pytest.raises(SystemExit, match="unknown policy 'magic'; valid: on_demand"):
        main(["--quick", "--out", str(tmp_path), "--policies", "magic"])
