# ruff: noqa: F811  (the imported pytest fixtures are used as test arguments)
"""The train job under trainwise's allocation policy (issue 25, one run driver): `run_training`
with an allocation policy runs the engine the emulated benchmarks measure (a real trace window
replayed, the trainer as a child process, SIGTERM on a reclaim, resume from the store), and
records it as any run: the provider's bill in the summary and MLflow, the policy's decisions in
the telemetry, the final checkpoint uploaded, the events ingested.

The window is the real 2023-02 us-east-1a V100 trace where spot is up for 4 ticks and then
reclaimed (tests/test_cloud_emulated.py's `_window_start`; its synthetic fallback without the
shared data also drops spot at tick 4).
"""

from __future__ import annotations

import json

import pytest

from controllers.fast_types import NoOpFastPolicy
from telemetry.reader import read_run_events
from tests.test_cloud_emulated import FOLDER, ZONE_FILE, _window_start
from tests.test_run_path_faults import (  # noqa: F401 - fixtures used by name
    built_state,
    request,
    run,
    state,
)
from trainwise import runs, supervised_run
from trainwise.emulated import ReplaySpec

STEPS = 40


def replay_spec(**changes) -> ReplaySpec:
    base = dict(trace_folder=FOLDER, zone_files=(ZONE_FILE,), window_start_tick=_window_start(),
                seconds_per_tick=0.2, max_wall_s=240.0)
    base.update(changes)
    return ReplaySpec(**base)


@pytest.fixture(scope="module")
def supervised(built_state, tmp_path_factory):
    """One run of the train job's driver under trainwise_heuristic (about 40 s)."""
    import shutil

    state = tmp_path_factory.mktemp("supervised") / "state"
    shutil.copytree(built_state, state)
    summary = run(state, request(max_steps=STEPS, eval_every_steps=10, fast_policy="heuristic",
                                 allocation_policy="trainwise_heuristic"),
                  replay=replay_spec())
    return state, summary


def test_the_policy_holds_spot_answers_the_reclaim_and_the_run_completes(supervised):
    state, summary = supervised
    assert summary.status == "completed" and summary.steps == STEPS
    record = json.loads((state / "runs" / "run-a" / supervised_run.RECORD_FILE).read_text())
    figures = record["figures"]
    assert record["engine"] == "supervised" and record["allocation_policy"] == "trainwise_heuristic"
    assert figures["preemptions"] >= 1 and figures["resumes"] >= 1, "the window reclaims spot"
    assert figures["spot_node_s"] > 0, "the policy rode spot while the trace had it"


def test_the_bill_in_the_summary_is_the_providers(supervised):
    state, summary = supervised
    figures = json.loads((state / "runs" / "run-a" / supervised_run.RECORD_FILE).read_text())[
        "figures"]
    billed_usd = sum(h["price_usd_per_hour"] * (h["end_s"] - h["launch_s"]) / 3600.0
                     for h in figures["holdings"])
    assert summary.cost_usd == pytest.approx(billed_usd, rel=1e-9)
    assert summary.provider == "emulated" and summary.spot_share == figures["spot_share"]
    # The engine wrote the bill into the telemetry as it grew; its final one is this bill (what
    # MLflow's cost/usd and Prometheus's trainwise_cost_usd show, telemetry.bill).
    bills = [e for e in read_run_events(state / "runs" / "run-a" / "telemetry" / "run-a")
             if e["type"] == "bill"]
    assert len(bills) >= 2 and bills[-1]["final"]
    assert bills[-1]["bill_usd"] == pytest.approx(billed_usd, rel=1e-9)
    assert all(a["bill_usd"] <= b["bill_usd"] for a, b in zip(bills, bills[1:]))
    assert summary.reclaims == figures["preemptions"]
    # Waste is at least every changeover after the first and every notice-to-down stretch; the
    # fixed schedule is the rest of the billed node time, bought on demand.
    billed_s = figures["spot_node_s"] + figures["on_demand_node_s"]
    assert summary.preemption_waste_node_s >= (
        (figures["launches"] - 1) * 360.0 + figures["stopping_node_s"] - 1e-6)
    assert summary.fixed_on_demand_usd == pytest.approx(
        figures["on_demand_usd_per_hour"] * (billed_s - summary.preemption_waste_node_s) / 3600.0)
    assert summary.fixed_on_demand_usd > summary.cost_usd, "spot was cheaper here"


def test_decisions_checkpoints_and_mlflow_are_recorded_as_for_any_run(supervised):
    state, summary = supervised
    telemetry = state / "runs" / "run-a" / "telemetry" / "run-a"
    decisions = [e for e in read_run_events(telemetry) if e["type"] == "decision"]
    assert {"slow", "fast"} <= {d["layer"] for d in decisions}
    assert any(d["policy"] == "trainwise_heuristic" for d in decisions)
    assert summary.events_ingested > 0 and not summary.pending
    assert summary.checkpoint_uri.startswith((state / "objects").as_uri())
    from mlflow.tracking import MlflowClient

    logged = MlflowClient(tracking_uri=f"sqlite:///{state / 'mlflow.db'}").get_run(
        summary.mlflow_run_id)
    assert logged.data.metrics["final/cost_usd"] == pytest.approx(summary.cost_usd)
    assert logged.info.status == "FINISHED"
    # Where every dollar went, as an MLflow artifact: the table whose money rows are the bill.
    client = MlflowClient(tracking_uri=f"sqlite:///{state / 'mlflow.db'}")
    assert runs.COST_SUMMARY_NAME in {a.path for a in client.list_artifacts(
        summary.mlflow_run_id)}
    from trainwise import cost_summary

    table = cost_summary.summarize(state / "runs" / "run-a")
    assert table.bill_usd == pytest.approx(summary.cost_usd, abs=0.01)
    written = (state / "runs" / "run-a" / runs.COST_SUMMARY_NAME).read_text()
    assert written.splitlines()[0] == table.markdown().splitlines()[0]  # same bill, same run


def test_what_the_engine_cannot_run_is_refused_before_anything_is_launched(state):
    with pytest.raises(ValueError, match=r"data_selection='dynamic'.*object cannot reach"):
        run(state, request(allocation_policy="trainwise_heuristic", data_selection="dynamic"),
            fast_policy=NoOpFastPolicy())
    assert not (state / "runs" / "run-a").exists()


def test_an_unknown_allocation_policy_is_refused_by_name(state):
    with pytest.raises(ValueError, match=r"allocation_policy='nope'.*trainwise_heuristic"):
        runs.validate_request(request(allocation_policy="nope"))


def test_the_demo_states_the_saving_against_the_fixed_schedule_from_the_bill(supervised):
    """The one line a user repeats (issue 28, item 2): the bill, the fixed on-demand schedule's
    cost for the same steps, and the saving between them; the trainer's estimate is labelled."""
    _, summary = supervised
    bill, fixed = summary.cost_usd, summary.fixed_on_demand_usd
    assert bill > 0 and fixed > 0
    line = summary.saving_line()
    assert f"trainwise {bill:.4f} USD" in line and f"{fixed:.4f} USD" in line
    saving = (fixed - bill) / fixed
    assert f"{abs(saving):.1%}" in line
    assert ("a saving" in line) == (saving >= 0)
    report = summary.report(1.0, "dagster-run")
    assert line in report and "compute estimate, not the bill" in report
