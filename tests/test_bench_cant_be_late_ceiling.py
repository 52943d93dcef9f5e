"""The Can't Be Late ceiling diagnostic (`benchmarks/cant_be_late/ceiling.py`), in --quick mode:
each model source reads what it says it reads, and the report restates the goal correctly."""

from __future__ import annotations

import json

import numpy as np
import pytest

from benchmarks.cant_be_late import ceiling as C
from benchmarks.cant_be_late import scenario as S
from benchmarks.cant_be_late import trainwise as T
from tests.shared_data import needs_cant_be_late_reference

pytestmark = needs_cant_be_late_reference
FOLDER = "preemption-1node-aws-2023-04"


def test_window_statistics_fit_reads_the_window_and_the_whole_collection_as_prior(monkeypatch):
    seen = []
    real_fit = C.fit_risk_model

    def watched(target, cutoff_tick, prior=(), *args, **kwargs):
        seen.append((target.available.copy(), cutoff_tick, [h.available.shape for h in prior]))
        return real_fit(target, cutoff_tick, prior, *args, **kwargs)

    monkeypatch.setattr(C, "fit_risk_model", watched)
    market = T._markets(FOLDER)["*"]
    C.window_model(FOLDER, 500, 100)
    own, cutoff, priors = seen[-1]
    assert own.shape == (len(market.zones), 100) and cutoff == 100
    assert np.array_equal(own, market.spot_available[:, 500:600])
    assert priors == [market.spot_available.shape]
    C.in_sample_model(FOLDER)
    own, cutoff, priors = seen[-1]
    assert cutoff == market.n_ticks and priors == []


def test_quick_report(tmp_path):
    assert C.main(["--quick", "--no-progress", "--out", str(tmp_path)]) == 0
    document = json.loads((tmp_path / f"{C.RESULTS_STEM}.json").read_text())
    markdown = (tmp_path / f"{C.RESULTS_STEM}.md").read_text()
    assert document["meta"]["command"].startswith("python -m benchmarks.cant_be_late.ceiling")
    assert {e["collection"] for e in document["summary"]} == set(S.COLLECTIONS.values())
    ref = S.load_reference()
    for entry in document["summary"]:
        assert set(entry["sources"]) == set(C.SOURCES)
        offsets = ref.offsets(entry["collection"])[::C.QUICK_STRIDE]
        assert entry["windows"] == C.QUICK_ZONES * len(offsets)
        for source in entry["sources"].values():
            # The exact optimum is a floor for every model; no deadline is missed.
            assert source["vs_optimum_exact"]["value"] >= 1.0 - 1e-6
            assert source["deadline_misses"] == 0
        # The goal (0.90x UP) restated against the optimum: 0.90 * mean UP / mean optimum.
        stems = sorted({k[1] for k in ref.single if k[0] == entry["collection"]})[:C.QUICK_ZONES]
        keys = [(entry["collection"], z, o) for z in stems for o in offsets]
        up = np.mean([ref.policy[(*k, "uniform_progress")] for k in keys])
        optimum = np.mean([ref.single[k] for k in keys])
        assert entry["goal_as_vs_optimum"] == pytest.approx(0.90 * up / optimum)
    assert "window_statistics" in markdown and "not a headline" in markdown
