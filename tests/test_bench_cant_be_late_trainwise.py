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
    for folder, row in summary.items():
        offsets = len(S.load_reference().offsets(folder)[::T.QUICK_STRIDE])
        assert row["zones"] == T.QUICK_ZONES and row["windows"] == T.QUICK_ZONES * offsets
        ratio = row["vs_uniform_progress_published"]
        assert ratio["value"] == pytest.approx(
            row["mean_trainwise_usd"] / row["mean_uniform_progress_published_usd"])
        assert row["goal_met"] == (ratio["value"] <= T.GOAL_VS_PUBLISHED_UP)
        assert 0.0 <= row["costlier_than_uniform_progress_share"] <= 1.0
        assert row["independent_windows"] <= row["offsets"]
        zones = document["windows"]["cost_usd"][folder]
        assert sum(len(costs) for costs in zones.values()) == row["windows"]
        assert f"| {folder} | {row['windows']} (" in markdown
    assert "Only the risk model is out of sample" in markdown


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
