"""The curriculum gate gates: a curriculum is a candidate until its blocking check passes, a
failed candidate is never trained on, and the check runs from the UI for one partition, a
range, or none."""

import os

import dagster as dg
import pytest

from assets import data
from assets.resources import StateResource, TelemetryStoreResource
from pipelines.definitions import defs
from training import curriculum as curriculum_lib
from trainwise import settings

PARTITION = "pystdlib"


@pytest.fixture
def instance():
    with dg.instance_for_test() as test_instance:
        yield test_instance


def _folder():
    return settings.home_dir() / "curricula" / PARTITION


def _refresh(instance, rate):
    return defs.resolve_job_def("curriculum_refresh").execute_in_process(
        partition_key=PARTITION, instance=instance, raise_on_error=False,
        run_config={"ops": {"curriculum": {"config": {"pruning_rate": rate}}}})


def _data_only(instance, rate):
    """Shards, scores and the gated curriculum, without training (fast)."""
    keys = [dg.AssetKey(k) for k in ("data_shards", "difficulty_scores", "curriculum")]
    return defs.resolve_job_def("demo").execute_in_process(
        partition_key=PARTITION, instance=instance, asset_selection=keys,
        run_config={"ops": {"curriculum": {"config": {"pruning_rate": rate}}}})


def _failing_coverage(monkeypatch):
    real = curriculum_lib.coverage_report

    def fail(examples, built):
        report = real(examples, built)
        return {**report, "passed": False, "failures": ["injected: keeps no shard 3"],
                "reason": "injected: keeps no shard 3"}

    monkeypatch.setattr(curriculum_lib, "coverage_report", fail)


def _check_only(instance, **kwargs):
    """Execute the check alone, as the UI's "Execute" on the check does."""
    job = dg.define_asset_job("check_only",
                              selection=dg.AssetSelection.checks(data.curriculum_coverage))
    check_defs = dg.Definitions(
        assets=[data.data_shards, data.difficulty_scores, data.curriculum],
        asset_checks=[data.curriculum_coverage], jobs=[job], resources={"state": StateResource()})
    return check_defs.resolve_job_def("check_only").execute_in_process(
        instance=instance, raise_on_error=False, **kwargs)


def test_failed_candidate_stays_unpublished_and_train_uses_the_old_one(instance, monkeypatch):
    assert _data_only(instance, 0.0).success
    good = curriculum_lib.current_version(_folder())
    assert good and curriculum_lib.read_candidate(_folder()) is None

    _failing_coverage(monkeypatch)
    failed = _refresh(instance, 0.5)
    assert not failed.success
    [check] = failed.get_asset_check_evaluations()
    assert not check.passed and check.partition == PARTITION
    bad = curriculum_lib.read_candidate(_folder())["version"]
    assert bad != good and curriculum_lib.current_version(_folder()) == good
    # The failed candidate is kept for inspection, and the rejection is recorded.
    assert curriculum_lib.load_curriculum(_folder(), bad).pruning_rate == 0.5
    assert curriculum_lib.read_history(_folder())[-1]["event"] == "rejected"

    train = defs.resolve_job_def("train").execute_in_process(
        partition_key=PARTITION, instance=instance,
        run_config={"ops": {"checkpoint": {"config": {"max_steps": 2}}}})
    assert train.success
    meta = train.asset_materializations_for_node("checkpoint")[0].metadata
    assert meta["curriculum_version"].value == good


def test_failing_gate_in_demo_skips_training(instance, monkeypatch):
    _failing_coverage(monkeypatch)
    demo = defs.resolve_job_def("demo").execute_in_process(
        partition_key=PARTITION, instance=instance, raise_on_error=False,
        run_config={"ops": {"checkpoint": {"config": {"max_steps": 2}}}})
    assert not demo.success
    assert not demo.asset_materializations_for_node("checkpoint")
    assert curriculum_lib.current_version(_folder()) is None


def test_passing_gate_publishes_the_candidate_with_a_record(instance):
    assert _data_only(instance, 0.0).success
    first = curriculum_lib.current_version(_folder())
    refresh = _refresh(instance, 0.4)
    assert refresh.success
    now = curriculum_lib.current_version(_folder())
    assert now != first and curriculum_lib.load_curriculum(_folder()).pruning_rate == 0.4
    record = curriculum_lib.read_history(_folder())[-1]
    assert record["event"] == "published" and (record["from"], record["to"]) == (first, now)
    assert "curriculum_coverage" in record["approved_by"]


def test_check_alone_for_a_partition_has_its_partition(instance):
    assert _data_only(instance, 0.3).success
    result = _check_only(instance, tags={"dagster/partition": PARTITION})
    assert result.success
    [check] = result.get_asset_check_evaluations()
    assert check.passed and check.partition == PARTITION
    assert check.metadata["status"].value == "current version re-checked"
    assert check.metadata["partition"].value == PARTITION


def test_check_alone_without_partition_checks_every_partition(instance):
    # No dagster/partition tag (the old UI failure): every partition gets its own verdict.
    result = _check_only(instance)
    assert result.success
    [check] = result.get_asset_check_evaluations()
    assert check.passed
    assert {"tinyshakespeare", "mnist", "pystdlib"} <= set(check.metadata)
    assert "no curriculum yet" in check.metadata["pystdlib"].value["status"]


def test_check_alone_on_a_partition_range(instance):
    tags = {"dagster/asset_partition_range_start": "mnist",
            "dagster/asset_partition_range_end": "pystdlib"}
    result = _check_only(instance, tags=tags)
    assert result.success
    [check] = result.get_asset_check_evaluations()
    assert {"mnist", "pystdlib"} <= set(check.metadata)
    assert "tinyshakespeare" not in check.metadata


# ---- what the Launchpad shows: settings as env vars, choices as choices, a link to MLflow ------

def test_resources_show_their_env_vars_with_defaults_applied(monkeypatch):
    from assets.resources import launchpad_resources

    monkeypatch.delenv("TRAINWISE_S3_PREFIX", raising=False)
    monkeypatch.setenv("TRAINWISE_MLFLOW_URI", "http://127.0.0.1:5999")
    resources = launchpad_resources()
    config = {key: resource._get_non_default_public_field_values()  # noqa: SLF001
              for key, resource in resources.items()}
    assert config["state"]["home"] == dg.EnvVar("TRAINWISE_HOME")
    assert config["mlflow"]["tracking_uri"] == dg.EnvVar("TRAINWISE_MLFLOW_URI")
    assert config["object_store"]["prefix"] == dg.EnvVar("TRAINWISE_S3_PREFIX")
    assert os.environ["TRAINWISE_S3_PREFIX"] == "trainwise"  # the documented default, applied
    # A derived default (no bucket: a local folder) is an EnvVar too, set to '' so it resolves.
    assert config["object_store"]["bucket"] == dg.EnvVar("TRAINWISE_S3_BUCKET")
    assert os.environ["TRAINWISE_S3_BUCKET"] == ""


def test_resources_resolve_derived_defaults_at_run_time(monkeypatch, tmp_path):
    """An EnvVar set to '' resolves, and the resource derives its place from the state folder
    of the run's environment (not of the moment the code location loaded)."""
    from assets.resources import launchpad_resources

    monkeypatch.delenv("TRAINWISE_DUCKDB_PATH", raising=False)
    resources = launchpad_resources()
    monkeypatch.setenv("TRAINWISE_HOME", str(tmp_path / "later"))

    @dg.asset
    def where(telemetry_store: TelemetryStoreResource) -> str:
        return str(telemetry_store.db_path())

    result = dg.materialize([where], resources=resources)
    assert result.output_for_node("where") == str(tmp_path / "later" / "trainwise.duckdb")


def test_fast_policy_and_data_selection_are_choices_checked_by_the_schema():
    from typing import get_args

    from assets.training import TrainRunConfig
    from trainwise import runs

    # "schedule" (the default): the published schedule's fast policy (issue 28).
    assert get_args(TrainRunConfig.model_fields["fast_policy"].annotation) == (
        "schedule", *runs.FAST_POLICIES)
    assert (get_args(TrainRunConfig.model_fields["data_selection"].annotation)
            == runs.DATA_SELECTIONS)
    with pytest.raises(dg.DagsterInvalidConfigError, match="fancy"):
        defs.resolve_job_def("train").execute_in_process(
            partition_key=PARTITION,
            run_config={"ops": {"checkpoint": {"config": {"fast_policy": "fancy"}}}})


def test_mlflow_link_is_a_url_for_a_server_and_a_note_otherwise():
    from assets.training import mlflow_link

    link = mlflow_link("http://mlflow.internal:5000", "http://mlflow.internal:5000/#/runs/abc")
    assert isinstance(link, dg.UrlMetadataValue) and link.url.endswith("/runs/abc")
    note = mlflow_link("sqlite:///x/mlflow.db", "mlflow ui --backend-store-uri sqlite:///x "
                       "(then open run abc)")
    assert isinstance(note, dg.TextMetadataValue) and "no MLflow server" in note.text
