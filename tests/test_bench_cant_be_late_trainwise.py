"""trainwise_heuristic on the Can't Be Late setting (`benchmarks/cant_be_late/trainwise.py`), in
its --quick mode: the report's structure, the exact optimum as a floor, every deadline met, and a
risk model fitted without the held-out collection."""

from __future__ import annotations

import json

import pytest

from benchmarks.cant_be_late import scenario as S
from benchmarks.cant_be_late import trainwise as T
from cloud import scenario_protocol as protocol
from tests.shared_data import needs_cant_be_late_reference

pytestmark = needs_cant_be_late_reference


@pytest.fixture
def fits(monkeypatch):
    """Every call of the risk fit, as (target name, target ticks, prior history names); the
    per-process model cache is emptied so the run fits afresh."""
    calls = []
    real_fit = protocol.fit_risk_model

    def watched(target, cutoff_tick, prior=(), *args, **kwargs):
        calls.append((target.name, target.available.shape[1], [h.name for h in prior]))
        return real_fit(target, cutoff_tick, prior, *args, **kwargs)

    monkeypatch.setattr(protocol, "fit_risk_model", watched)
    monkeypatch.setattr(T, "_MODELS", {})
    return calls


@pytest.fixture
def quick_report(tmp_path, fits):
    assert T.main(["--quick", "--no-progress", "--out", str(tmp_path)]) == 0
    document = json.loads((tmp_path / f"{T.RESULTS_STEM}.json").read_text())
    markdown = (tmp_path / f"{T.RESULTS_STEM}.md").read_text()
    return document, markdown, fits


def test_quick_report_structure(quick_report):
    document, markdown, _ = quick_report
    assert document["meta"]["command"].startswith("python -m benchmarks.cant_be_late.trainwise")
    assert document["stride"] == T.QUICK_STRIDE and document["quick"] is True
    summary = {r["collection"]: r for r in document["summary"]}
    assert set(summary) == set(S.COLLECTIONS.values())
    published = {key[:3]: usd for key, usd in S.load_reference().policy.items()
                 if key[3] == "uniform_progress"}
    for folder, row in summary.items():
        offsets = len(S.load_reference().offsets(folder)[::T.QUICK_STRIDE])
        assert row["zones"] == T.QUICK_ZONES and row["windows"] == T.QUICK_ZONES * offsets
        ratio = row["vs_uniform_progress_published"]
        assert ratio["value"] == pytest.approx(
            row["mean_trainwise_usd"] / row["mean_uniform_progress_published_usd"])
        # Issue 9's goal as the README states it: <= 0.90x the published Uniform Progress.
        assert row["goal_met"] == (ratio["value"] <= 0.90)
        high = ratio["high"]
        assert row["goal_met_interval_high"] == (high is not None and high <= 0.90)
        assert row["independent_windows"] <= row["offsets"]
        zones = document["windows"]["cost_usd"][folder]
        assert sum(len(costs) for costs in zones.values()) == row["windows"]
        # The share costlier than the published Uniform Progress, from the windows themselves
        # (trainwise's stored cost against the reference's figure for the same zone and start;
        # both are rounded to 4 decimals, the tolerance is the suite's 1e-3 USD).
        costlier = [cost > published[(folder, zone, int(offset))] + T.OPTIMUM_TOLERANCE_USD
                    for zone, costs in zones.items() for offset, cost in costs.items()]
        assert row["costlier_than_uniform_progress_share"] == sum(costlier) / row["windows"]
        assert f"| {folder} | {row['windows']} (" in markdown
    assert "Only the risk model is out of sample" in markdown
    assert "<= 0.90x" in markdown


def _made_up_result(trainwise_usd: float) -> dict:
    """One collection, 2 zones x 4 offsets, every window at the same costs (no processes)."""
    rows = [{"folder": "f", "zone": zone, "offset": offset, "cost_usd": trainwise_usd,
             "uniform_progress_published_usd": 100.0, "greedy_published_usd": 110.0,
             "on_demand_published_usd": 150.0, "optimum_exact_usd": 80.0, "deadline_met": True}
            for zone in ("a", "b") for offset in (0, 1000, 2000, 3000)]
    return {"rows": rows, "models": {"f": {"window_ticks": 500}}}


def test_the_goal_line_is_issue_9s_0_90x_of_the_published_uniform_progress():
    [at_goal] = T.summarize(_made_up_result(90.0))  # exactly 0.90x: met
    assert at_goal["vs_uniform_progress_published"]["value"] == 0.90
    assert at_goal["goal_met"] is True and at_goal["goal_met_interval_high"] is True
    [above] = T.summarize(_made_up_result(90.1))  # 0.901x: not met
    assert above["goal_met"] is False and above["goal_met_interval_high"] is False


def test_trainwise_never_beats_the_exact_optimum_and_meets_every_deadline():
    result = T.run(stride=T.QUICK_STRIDE, zones_limit=T.QUICK_ZONES)
    assert len(result["rows"]) == 2 * T.QUICK_ZONES * 4
    for row in result["rows"]:
        assert row["deadline_met"], row
        assert row["cost_usd"] >= row["optimum_exact_usd"] - T.OPTIMUM_TOLERANCE_USD, row
    summary = T.summarize(result)
    assert all(r["deadline_misses"] == 0 and r["below_optimum_windows"] == 0 for r in summary)


def test_each_collection_is_scored_with_a_model_fitted_without_it(quick_report):
    document, _, fits = quick_report
    models = document["models"]
    assert set(models) == set(S.COLLECTIONS.values())
    for held_out, model in models.items():
        assert model["protocol"] == protocol.LOCO and model["held_out"] == held_out
        assert held_out not in model["fit_collections"] and model["fit_collections"]
        assert model["fitted_on"].startswith(
            f"{protocol.LOCO}: fitted on {', '.join(model['fit_collections'])}; none of "
            f"{held_out}")
    # What the fit itself was handed: the held-out collection's zone names with zero ticks,
    # and prior histories of other collections only.
    assert sorted(name for name, _, _ in fits) == sorted(S.COLLECTIONS.values())
    for name, target_ticks, prior in fits:
        assert target_ticks == 0, name
        assert prior and not any(h.split("/")[0] == name for h in prior), (name, prior)
