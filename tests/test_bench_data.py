"""The data suite end to end in its quick form: table, JSON with provenance, plot, calibration."""

from __future__ import annotations

import json

import pytest

from benchmarks.data import main
from benchmarks.results_io import machine
from benchmarks.run_all import SUITES
from training.consumption import read_consumption
from training.pruning_calibration import work_fraction
from trainwise import settings

pytestmark = pytest.mark.skipif(not (settings.data_dir() / "corpora").is_dir(),
                                reason="shared data missing")

METHODS = ["full", "random", "infobatch", "trainwise"]


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("data")
    status = main(["--quick", "--out", str(out), "--work", str(out / "work")])
    return status, out


def test_quick_suite_writes_table_json_plot_and_calibration(quick_run):
    status, out = quick_run
    assert status == 0
    document = json.loads((out / "data.json").read_text())
    assert document["meta"]["command"].startswith("python -m benchmarks.data --quick")
    assert "commit" in document["meta"] and document["meta"]["machine"] == machine()
    assert document["quick"] is True and document["methods"] == METHODS
    rows = {(r["dataset"], r["method"]): r for r in document["summary"]}
    assert set(rows) == {(d, m) for d in ("tinyshakespeare", "mnist") for m in METHODS}
    for dataset in ("tinyshakespeare", "mnist"):
        full = rows[(dataset, "full")]
        assert full["samples_mean"] == full["budget_samples"]  # full data spends the budget
        assert full["reach_vs_full_mean"] == 1.0 and full["reached"] == 1
        assert full["same_quality_fraction_mean"] == 1.0
        for method in ("random", "infobatch"):  # pruned epochs are cheaper at the same epochs
            assert rows[(dataset, method)]["samples_mean"] < full["budget_samples"]
    assert rows[("mnist", "full")]["final_eval_accuracy_mean"] is not None
    markdown = (out / "data.md").read_text()
    assert "| infobatch |" in markdown and "## What limits the savings" in markdown
    assert "Budget: the same number of epochs" in markdown
    assert (out / "data_eval_loss_vs_samples.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    calibration = json.loads((out / "data_work_fractions.json").read_text())
    assert not (out / "pruning_calibration.json").exists()  # the simulator's file is not ours
    assert set(calibration["datasets"]) == {"tinyshakespeare", "mnist"}
    entry = calibration["datasets"]["mnist"]
    assert entry["source_runs"] == ["data-mnist-trainwise-s0"]
    assert work_fraction("mnist", out / "data_work_fractions.json") == entry["work_fraction"]


def test_pruning_runs_leave_a_consumption_record(quick_run):
    _, out = quick_run
    document = json.loads((out / "data.json").read_text())
    run = next(r for r in document["runs"] if r["method"] == "infobatch")
    records = read_consumption(f"{run['run_dir']}/telemetry/{run['run_id']}")
    assert sum(len(r["ids"]) for r in records if r["type"] == "batch") == run["samples"]
    # The pruning sampler's own time is measured (a run without pruning records 0.0), and so is
    # a plain sampler's on the same batches, which the overhead share is taken against.
    (close,) = [r for r in records if r["type"] == "close"]
    assert run["sampler_s"] == close["sampler_s"] > 0 and run["plain_sampler_s"] > 0
    assert run["epochs"]


def test_the_suite_is_registered():
    assert SUITES["data"] == "benchmarks.data"


def test_render_only_recomputes_the_figures_from_the_stored_runs(quick_run):
    _, out = quick_run
    before = json.loads((out / "data.json").read_text())
    (out / "data.md").unlink()
    assert main(["--render-only", "--out", str(out)]) == 0
    after = json.loads((out / "data.json").read_text())
    assert after["meta"]["command"] == before["meta"]["command"]  # the runs' provenance stays
    assert after["meta"]["rendered_by"].endswith(f"--render-only --out {out}")
    assert after["summary"] == before["summary"] and after["runs"] == before["runs"]
    assert "| trainwise |" in (out / "data.md").read_text()
