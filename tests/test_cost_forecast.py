# ruff: noqa: F811  (the imported pytest fixtures are used as test arguments)
"""`cost_forecast` (issue 13, item 4): Monte Carlo over the spot traces for the next run under
the current schedule and each alternative, P50/P90 and deadline risk, a plot in the metadata,
the figures in MLflow. Issue 28, item 4: each registered job's own forecast (from its measured
throughput) in the metadata, and the check `p90_within_budget` blocks (ERROR) when a job's P90
exceeds the published schedule's budget; with no job sized it warns on the generic run's."""

import re
import shutil
from pathlib import Path

import dagster as dg
import pytest

from cloud import forecast as forecast_lib
from pipelines.definitions import defs
from tests.test_run_path_faults import PARTITION, built_state  # noqa: F401 - fixture
from trainwise import settings

SHARED_SPOT = settings.data_dir() / "spot" / "availability-1node-aws-2023-02"


def _materialize(instance, log_to_mlflow=False):
    from assets import forecast

    return dg.materialize(
        [forecast.cost_forecast, forecast.p90_within_budget], instance=instance,
        resources=defs.resources, raise_on_error=False,
        run_config={"ops": {"cost_forecast": {"config": {"log_to_mlflow": log_to_mlflow}}}})


@pytest.fixture
def instance():
    with dg.instance_for_test() as test_instance:
        yield test_instance


@pytest.fixture
def small(monkeypatch):
    monkeypatch.setenv("TRAINWISE_FORECAST_WORK_GPU_H", "2")
    monkeypatch.setenv("TRAINWISE_FORECAST_DEADLINE_H", "4")
    monkeypatch.setenv("TRAINWISE_FORECAST_SAMPLES", "6")


def test_forecast_percentiles_and_deadline_risk_on_the_embedded_market():
    source = forecast_lib.MarketSource(forecast_lib.embedded_market(), "embedded", True)
    results = forecast_lib.forecast({"od": ("on_demand", 2.0), "spot": ("greedy_spot", 2.0)},
                                    4 * 3600, source, samples=8)
    on_demand, spot = results["od"], results["spot"]
    assert on_demand.p50_usd == on_demand.p90_usd  # on-demand cost does not depend on the start
    assert on_demand.deadline_risk == 0.0
    # Completion: on-demand finishes the 2 GPU-h after one changeover (360 s) and the hourly
    # save (60 s) of the rules, from every start.
    assert on_demand.p50_h == on_demand.p90_h == pytest.approx(2.0 + (360 + 60) / 3600)
    assert on_demand.row()["p90_h"] == round(on_demand.p90_h, 3)
    assert spot.p50_usd <= spot.p90_usd
    assert len(spot.costs_usd) == 8
    # The risk is the share of the sampled starts that missed the deadline, not their count.
    two_of_eight = forecast_lib.PolicyForecast("p", 2.0, [1.0] * 8, deadline_missed=2)
    assert two_of_eight.deadline_risk == 0.25 and two_of_eight.row()["deadline_risk"] == 0.25
    assert forecast_lib.work_for_rate(10.0, 0.4) == pytest.approx(8.0)
    with pytest.raises(ValueError, match="longer than the trace"):
        forecast_lib.forecast({"od": ("on_demand", 2.0)}, 1e9, source, samples=1)


@pytest.mark.skipif(not SHARED_SPOT.is_dir(), reason=f"no shared traces at {SHARED_SPOT}")
def test_forecast_replays_the_real_traces():
    source = forecast_lib.load_market(SHARED_SPOT.parent, SHARED_SPOT.name)
    assert not source.embedded and "9 zones" in source.source
    # A job's forecast replays its region's zones; a region the traces lack keeps them all.
    west = forecast_lib.load_market(SHARED_SPOT.parent, SHARED_SPOT.name, region="us-west-2")
    assert "3 zones, region us-west-2" in west.source
    assert set(west.market.zones) == {"us-west-2a", "us-west-2b", "us-west-2c"}
    elsewhere = forecast_lib.load_market(SHARED_SPOT.parent, SHARED_SPOT.name, region="eu-west-1")
    assert "9 zones, no zone in eu-west-1" in elsewhere.source
    results = forecast_lib.forecast({"h": ("trainwise_heuristic", 2.0)}, 4 * 3600, source,
                                    samples=5)
    assert 0 < results["h"].p50_usd < 2.0 * 3.06 * 2  # below twice the on-demand bill


def test_asset_without_shared_data_uses_the_embedded_market_and_warns_over_budget(
        instance, small, monkeypatch, tmp_path):
    monkeypatch.setenv("TRAINWISE_DATA_DIR", str(tmp_path / "missing"))
    monkeypatch.setenv("TRAINWISE_BUDGET_USD", "0.01")
    result = _materialize(instance)
    assert result.success
    meta = result.asset_materializations_for_node("cost_forecast")[0].metadata
    assert meta["embedded_market"].value is True and "embedded" in meta["market"].value
    table = meta["forecast"].value
    assert "data:image/png;base64," in table and "| current |" in table
    assert "| on_demand |" in table  # every alternative policy has a row
    assert Path(meta["plot"].value).is_file()
    assert meta["current_p50_usd"].value <= meta["current_p90_usd"].value
    # No partition has runs or shards here: no job is sized, each says why, and the check
    # warns on the generic run (it blocks only on a job's own forecast).
    assert "not sized: no runs yet and no shards" in meta["jobs"].value
    assert meta["jobs_max_p90_usd"].value == 0.0
    [check] = result.get_asset_check_evaluations()
    assert not check.passed and check.severity == dg.AssetCheckSeverity.WARN
    assert "no job sized" in check.description and "exceeds the budget" in check.description


@pytest.mark.skipif(not SHARED_SPOT.is_dir(), reason=f"no shared traces at {SHARED_SPOT}")
def test_asset_on_real_traces_within_budget_logs_to_mlflow(instance, small, monkeypatch,
                                                           tmp_path):
    monkeypatch.setenv("TRAINWISE_BUDGET_USD", "1000")
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    monkeypatch.chdir(cwd)
    result = _materialize(instance, log_to_mlflow=True)
    # The plot is an artifact next to the tracking database, not in <cwd>/mlruns.
    assert list(cwd.iterdir()) == []
    assert list(settings.home_dir().glob("**/mlflow-artifacts/**/cost_forecast.png"))
    assert result.success
    meta = result.asset_materializations_for_node("cost_forecast")[0].metadata
    assert meta["embedded_market"].value is False
    assert re.fullmatch(r"[0-9a-f]{32}", meta["mlflow_run"].value), meta["mlflow_run"].value
    [check] = result.get_asset_check_evaluations()
    assert check.passed


def test_pending_proposal_is_forecast_too(instance, small, monkeypatch, tmp_path):
    from trainwise import approvals

    monkeypatch.setenv("TRAINWISE_DATA_DIR", str(tmp_path / "missing"))
    folder = settings.home_dir() / "governance" / "schedule"
    proposal = approvals.propose(folder, {**approvals.default_schedule(), "pruning_rate": 0.5},
                                 forecast_savings_usd=1.0, eval_loss_change=0.0, evidence={},
                                 reason="", requested_by="t")
    result = _materialize(instance)
    assert f"| proposal {proposal['hash']} |" in (
        result.asset_materializations_for_node("cost_forecast")[0].metadata["forecast"].value)


def test_each_job_is_forecast_from_its_throughput_and_the_check_blocks_over_budget(
        instance, small, monkeypatch, tmp_path, built_state):
    from assets import forecast
    from assets.resources import StateResource

    monkeypatch.setenv("TRAINWISE_DATA_DIR", str(tmp_path / "missing"))
    monkeypatch.setenv("TRAINWISE_BUDGET_USD", "0.001")
    shutil.copytree(built_state, settings.home_dir(), dirs_exist_ok=True)  # pystdlib's shards
    result = dg.materialize(
        [forecast.cost_forecast, forecast.p90_within_budget], instance=instance,
        resources=defs.resources, raise_on_error=False, run_config={"ops": {"cost_forecast": {
            "config": {"log_to_mlflow": False, "max_steps": 20, "deadline_h": 4.0}}}})
    meta = result.asset_materializations_for_node("cost_forecast")[0].metadata
    job = meta[f"job/{PARTITION}"].value
    assert job["throughput_source"] == "probe of 3 steps" and job["steps"] == 20
    assert 0 < job["p50_usd"] <= job["p90_usd"] and 0 < job["p50_h"] <= job["p90_h"]
    assert meta["jobs_max_p90_usd"].value == job["p90_usd"]
    table = meta["jobs"].value
    assert f"| {PARTITION} | 20 | {job['p50_usd']:.2f} | {job['p90_usd']:.2f} |" in table
    assert "probe of 3 steps" in table and "| mnist | - |" in table  # mnist: no shards
    [check] = result.get_asset_check_evaluations()
    assert not check.passed and check.severity == dg.AssetCheckSeverity.ERROR
    assert f"{PARTITION} P90 {job['p90_usd']:.2f} USD" in check.description
    assert "budget 0.001 USD" in check.description and "schedule_override_reason" in (
        check.description)
    assert check.metadata[f"{PARTITION}_p90_usd"].value == job["p90_usd"]
    # The same saved forecast under a budget that holds it passes.
    monkeypatch.setenv("TRAINWISE_BUDGET_USD", "1000")
    held = forecast.p90_within_budget(state=StateResource())
    assert held.passed and "within the budget 1000 USD" in held.description
