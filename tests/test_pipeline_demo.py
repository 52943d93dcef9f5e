"""The demo chain in-process against a real (temporary) Dagster instance, MLflow and DuckDB."""

import subprocess
import sys
from pathlib import Path

import dagster as dg
import duckdb
import pytest
from mlflow.tracking import MlflowClient

from pipelines.definitions import defs
from trainwise import cli, settings

ROOT = Path(__file__).resolve().parent.parent


def _run(instance, partition="pystdlib", **checkpoint_config):
    config = {"max_steps": 8, "eval_every_steps": 4, "fast_every_steps": 4,
              **checkpoint_config}
    return defs.resolve_job_def("demo").execute_in_process(
        partition_key=partition, instance=instance, raise_on_error=False,
        run_config={"ops": {"checkpoint": {"config": config}}},
    )


def _failure_text(result, node: str) -> str:
    """The step's error with its whole cause chain (Dagster wraps the user's exception)."""
    error, parts = result.failure_data_for_node(node).error, []
    while error is not None:
        parts.append(error.message)
        error = error.cause
    return "\n".join(parts)


@pytest.fixture(scope="module")
def instance():
    with dg.instance_for_test() as test_instance:
        yield test_instance


def test_definitions_validate():
    result = subprocess.run(
        [str(Path(sys.executable).parent / "dagster"), "definitions", "validate",
         "-w", str(ROOT / "workspace.yaml")],
        cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr


def test_demo_chain_trains_and_records_everywhere(instance):
    result = _run(instance, fast_policy="heuristic")
    assert result.success
    meta = {k: v.value for k, v in
            result.asset_materializations_for_node("checkpoint")[0].metadata.items()}
    assert meta["status"] == "completed" and meta["steps"] == 8
    assert meta["tokens_seen"] > 0 and meta["cost_usd"] > 0
    # The curriculum gate ran and passed in the same run.
    checks = result.get_asset_check_evaluations()
    assert [(c.check_name, c.passed) for c in checks] == [("curriculum_coverage", True)]

    run = MlflowClient(tracking_uri=settings.mlflow_uri()).get_run(meta["mlflow_run_id"])
    assert run.data.params["curriculum/version"] == meta["curriculum_version"]
    assert run.data.params["policy/fast"] == "heuristic_fast"
    assert run.data.params["cloud/instance_type"] == "p3.2xlarge"
    assert run.data.metrics["final/cost_usd"] == pytest.approx(meta["cost_usd"])
    history = MlflowClient(tracking_uri=settings.mlflow_uri()).get_metric_history(
        meta["mlflow_run_id"], "losses/train")
    assert [m.step for m in history] == list(range(1, 9))

    with duckdb.connect(str(settings.duckdb_path()), read_only=True) as con:
        counts = dict(con.execute("select event_type, count(*) from telemetry_events "
                                  "where run_id = ? group by 1", [result.run_id]).fetchall())
    assert counts["step"] == 8 and counts["run_end"] == 1 and counts["decision"] >= 1
    assert Path(meta["checkpoint_uri"].removeprefix("file://")).exists()


def test_explain_prints_the_runs_decisions(instance, capsys):
    result = _run(instance, fast_policy="heuristic")
    assert cli.main(["explain", result.run_id[:8]]) == 0
    out = capsys.readouterr().out
    assert "heuristic_fast" in out and "checkpoint written (final)" in out
    action_lines = [line for line in out.splitlines() if line.strip().startswith("action")]
    assert action_lines and not any("reason=" in line for line in action_lines)


def test_explain_unknown_run_is_a_clear_error(capsys):
    assert cli.main(["explain", "no-such-run"]) == 2
    assert "no-such-run" in capsys.readouterr().err


def test_unknown_instance_type_names_valid_ones(instance):
    result = _run(instance, instance_type="p9.mega")
    assert not result.success
    message = _failure_text(result, "checkpoint")
    assert "unknown instance type 'p9.mega'" in message and "p3.2xlarge" in message


def test_negative_pruning_rate_refused_and_last_curriculum_kept(instance):
    assert _run(instance).success
    curricula = settings.home_dir() / "curricula" / "pystdlib"
    before = sorted(p.name for p in curricula.iterdir())
    result = defs.resolve_job_def("demo").execute_in_process(
        partition_key="pystdlib", instance=instance, raise_on_error=False,
        run_config={"ops": {"curriculum": {"config": {"pruning_rate": -0.2}},
                            "checkpoint": {"config": {"max_steps": 2}}}})
    assert not result.success
    message = _failure_text(result, "curriculum")
    assert "-0.2" in message and "TRAINWISE_PRUNING_RATE" in message
    assert sorted(p.name for p in curricula.iterdir()) == before


def test_dynamic_data_selection_records_consumption(instance):
    result = _run(instance, data_selection="dynamic")
    assert result.success
    meta = {k: v.value for k, v in
            result.asset_materializations_for_node("checkpoint")[0].metadata.items()}
    params = MlflowClient(tracking_uri=settings.mlflow_uri()).get_run(
        meta["mlflow_run_id"]).data.params
    assert params["data/selection"] == "dynamic"
    assert params["policy/slow"] == "slow_policy_sensor"
    consumption = Path(meta["telemetry_dir"]) / "consumption.jsonl"
    assert consumption.exists() and consumption.stat().st_size > 0


def test_every_run_config_field_reaches_the_train_request():
    import dataclasses

    from assets.training import TrainRunConfig
    from trainwise.runs import TrainRequest

    request_fields = {f.name for f in dataclasses.fields(TrainRequest)}
    assert set(TrainRunConfig.model_fields) <= request_fields
    # The job fills three; the published schedule three more (trainwise.schedule, issue 28).
    assert request_fields - set(TrainRunConfig.model_fields) == {
        "partition", "run_id", "region", "schedule_version", "fast_levers",
        "checkpoint_interval_rule"}
