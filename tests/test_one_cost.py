# ruff: noqa: F811  (the imported pytest fixtures are used as test arguments)
"""One cost, the bill (issue 28, item 2): for the same run, the cost MLflow shows (live
`cost/usd` and `final/cost_usd`), the cost Prometheus exports (`trainwise_cost_usd`), the
eval-loss-vs-cost plot's x axis and the demo summary's saving line are the provider's bill in
`gang.json`, not the trainer's wall time x the list price (which is shown, labelled, beside it).

`run_training` runs for real on the small pystdlib state of tests/test_run_path_faults.py, on an
`EmulatedProvider` whose clock runs faster than the trainer's wall time (as the default one
does), so the bill and the estimate differ by orders of magnitude and cannot be confused.
"""

from __future__ import annotations

import pytest
from mlflow.tracking import MlflowClient
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from telemetry.bill import BillCurve, last_bill_usd
from telemetry.prometheus import TelemetryCollector
from telemetry.reader import read_run_events
from tests.test_run_path_faults import (  # noqa: F401 - fixtures used by name
    PARTITION,
    built_state,
    request,
    run,
    state,
)
from tests.test_train_job_provider import market, provider
from trainwise import gang, runs


def _exported(runs_root, name: str, run_id: str) -> list[float]:
    registry = CollectorRegistry()
    registry.register(TelemetryCollector(runs_root))
    text = generate_latest(registry).decode("utf-8")
    return [sample.value for family in text_string_to_metric_families(text)
            for sample in family.samples
            if sample.name == name and sample.labels.get("run_id") == run_id]


def test_mlflow_prometheus_plot_and_summary_show_the_providers_bill(state):
    cloud = provider(market("us-east-1a", [1] * 100_000), seconds_per_tick=0.05)
    summary = run(state, request(market="spot", zone="us-east-1a"), provider=cloud)
    assert summary.status == "completed"
    run_dir = state / "runs" / "run-a"
    bill = gang.read_gang(run_dir)["cost_usd"]
    assert bill == pytest.approx(cloud.bill_usd()) and bill > 0
    # The trainer's own estimate is another, much smaller figure: it must not be what is shown.
    assert summary.compute_estimate_usd > 0
    assert abs(summary.compute_estimate_usd - bill) > 0.5 * bill
    assert summary.cost_usd == pytest.approx(bill)

    # The telemetry holds the bill as it grew; the last one is final and is gang.json's.
    events = read_run_events(run_dir / "telemetry" / "run-a")
    bills = [e for e in events if e["type"] == "bill"]
    assert bills and bills[-1]["final"] and last_bill_usd(events) == pytest.approx(bill)
    assert all(a["bill_usd"] <= b["bill_usd"] for a, b in zip(bills, bills[1:]))

    # MLflow: the live metric ends at the bill, the final metric is the bill, the estimate is
    # logged under its own name.
    client = MlflowClient(tracking_uri=f"sqlite:///{state / 'mlflow.db'}")
    logged = client.get_run(summary.mlflow_run_id)
    assert logged.data.metrics["final/cost_usd"] == pytest.approx(bill)
    assert logged.data.metrics["cost/usd"] == pytest.approx(bill)
    history = client.get_metric_history(summary.mlflow_run_id, "cost/usd")
    assert max(m.value for m in history) == pytest.approx(bill)
    assert logged.data.metrics["final/compute_estimate_usd"] == pytest.approx(
        summary.compute_estimate_usd)
    assert logged.data.metrics["cost/compute_estimate_usd"] <= summary.compute_estimate_usd

    # Prometheus: trainwise_cost_usd is the bill; the estimate has its own name.
    assert _exported(state / "runs", "trainwise_cost_usd", "run-a") == [pytest.approx(bill)]
    estimate = _exported(state / "runs", "trainwise_compute_estimate_usd", "run-a")
    assert estimate == [pytest.approx(summary.compute_estimate_usd)]

    # The plot: eval loss against the bill at each eval's wall time, never beyond the bill.
    points, x_label = runs.cost_vs_loss_points(events)
    assert "bill" in x_label and points
    curve = BillCurve(events)
    evals = [e for e in events if e["type"] == "eval" and e.get("eval_loss") is not None]
    assert [p[0] for p in points] == [curve.at(e["wall_time_s"]) for e in evals]
    assert all(0 <= p[0] <= bill for p in points)

    # The demo's one line names the bill.
    assert f"trainwise {bill:.4f} USD" in summary.saving_line()
    assert f"bill {bill:.4f} USD" in summary.one_line()
    assert "compute estimate, not the bill" in summary.report(1.0, "dagster-run")


def test_a_run_without_bill_records_plots_the_estimate_labelled_as_such():
    events = [
        {"type": "step", "step": 1, "wall_time_s": 1.0, "cost_usd": 0.25},
        {"type": "eval", "step": 1, "wall_time_s": 1.5, "eval_loss": 2.0},
    ]
    points, x_label = runs.cost_vs_loss_points(events)
    assert points == [(0.25, 2.0)] and "not the bill" in x_label
    events.append({"type": "bill", "step": 1, "wall_time_s": 1.2, "bill_usd": 7.0})
    points, x_label = runs.cost_vs_loss_points(events)
    assert points == [(7.0, 2.0)] and "bill" in x_label and "not" not in x_label
