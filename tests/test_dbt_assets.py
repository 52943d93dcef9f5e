"""Telemetry and the dbt models as Dagster assets (issue 13, item 5): `telemetry` ingests a
partition's runs idempotently, the dbt models load through dagster-dbt downstream of it, and
the dbt tests are asset checks."""

import json

import dagster as dg
import duckdb
import pytest

from assets import analytics
from pipelines.definitions import defs
from telemetry import events
from telemetry.writer import SegmentWriter
from trainwise import settings

PARTITION = "pystdlib"
MODELS = {"cost_per_token", "waste_breakdown", "decisions", "utilization"}


def _fake_run(run_id: str, partition: str) -> None:
    """A run folder as the trainer leaves it: request.json and its telemetry segments."""
    run_dir = settings.home_dir() / "runs" / run_id
    run_dir.mkdir(parents=True)
    (run_dir / "request.json").write_text(json.dumps({"partition": partition}))
    with SegmentWriter(run_dir / "telemetry", run_id) as writer:
        for step in (1, 2):
            writer.write(events.StepEvent(
                run_id=run_id, step=step, train_loss=2.0, learning_rate=1e-3, grad_norm=1.0,
                grad_noise_scale=float("nan"), micro_batch_size=8, grad_accum_steps=1,
                step_time_ms=100.0, samples_seen=8 * step, tokens_seen=1000 * step,
                elapsed_s=0.1 * step, cost_usd=0.5 * step))


def test_dbt_models_are_assets_downstream_of_telemetry_with_tests_as_checks():
    graph = defs.resolve_asset_graph()
    keys = {k.to_user_string() for k in graph.get_all_asset_keys()}
    assert MODELS | {"telemetry"} <= keys
    for model in MODELS:
        assert dg.AssetKey("telemetry") in graph.get(dg.AssetKey(model)).parent_keys
    checks = {c.name for c in graph.asset_check_keys if c.asset_key.path == ["cost_per_token"]}
    assert "not_null_cost_per_token_run_id" in checks
    util_checks = {c.name for c in graph.asset_check_keys if c.asset_key.path == ["utilization"]}
    assert {"utilization_shares_sum_to_one", "in_range_utilization_compute_share__1__0"} <= util_checks
    assert analytics.dbt_project.manifest_path.is_file()


def test_telemetry_asset_ingests_only_its_partition_idempotently():
    _fake_run("run-a", PARTITION)
    _fake_run("run-b", "mnist")
    first = dg.materialize([analytics.telemetry], partition_key=PARTITION,
                           resources=defs.resources)
    meta = first.asset_materializations_for_node("telemetry")[0].metadata
    assert meta["runs"].value == 1 and meta["run_ids"].value == "run-a"
    assert meta["new_events"].value == 2
    again = dg.materialize([analytics.telemetry], partition_key=PARTITION,
                           resources=defs.resources)
    assert again.asset_materializations_for_node("telemetry")[0].metadata["new_events"].value == 0


@pytest.mark.integration
def test_dbt_build_runs_from_dagster_on_the_settings_duckdb(monkeypatch, tmp_path):
    db = tmp_path / "elsewhere" / "t.duckdb"
    monkeypatch.setenv("TRAINWISE_DUCKDB_PATH", str(db))
    _fake_run("run-a", PARTITION)
    assert dg.materialize([analytics.telemetry], partition_key=PARTITION,
                          resources=defs.resources).success
    result = dg.materialize([analytics.dbt_models], resources=defs.resources)
    assert result.success
    built = {e.asset_key.to_user_string() for e in result.get_asset_materialization_events()}
    assert MODELS <= built
    assert {e.check_name for e in result.get_asset_check_evaluations() if e.passed} >= {
        "not_null_cost_per_token_run_id"}
    with duckdb.connect(str(db), read_only=True) as con:
        assert con.execute("select steps, cost_usd from cost_per_token").fetchall() == [(2, 1.0)]


@pytest.mark.integration
def test_a_fresh_checkout_parses_its_manifest_at_load_offline(tmp_path):
    import shutil

    from dagster_dbt import DbtProject

    copy = tmp_path / "dbt"
    shutil.copytree(analytics.DBT_DIR, copy, ignore=shutil.ignore_patterns("target", "logs"))
    project = DbtProject(project_dir=copy)
    assert not project.manifest_path.exists()
    manifest = analytics.ensure_manifest(project)
    assert "model.trainwise.cost_per_token" in json.loads(manifest.read_text())["nodes"]
    assert analytics.ensure_manifest(project).stat().st_mtime == manifest.stat().st_mtime
