"""Telemetry and the dbt models as assets (issue 13, item 5).

`telemetry` ingests the segments of every training run of a data partition into DuckDB (the
telemetry store; idempotent, so re-materializing stores nothing twice). The dbt project in dbt/
is loaded through dagster-dbt: each model (cost_per_token, waste_breakdown, decisions, utilization) is an
asset downstream of `telemetry`, and each dbt test is an asset check.

dagster-dbt needs a manifest.json when the code location loads. `ensure_manifest` runs
`dbt parse` (offline: no packages, anonymous stats off) when dbt/target/manifest.json is missing
or older than the project's files, so a fresh checkout, `dagster dev` and a test all load
without a prior `make` step. The DuckDB file comes from the settings (TRAINWISE_DUCKDB_PATH, or
the state folder's default): dbt runs with a profiles.yml written next to that file, so dbt and
trainwise always use the same database without an environment variable to export.
"""

import fcntl
import shutil
import sys
import tempfile
import time
from pathlib import Path

import dagster as dg
from dagster_dbt import DagsterDbtTranslator, DbtCliResource, DbtProject, dbt_assets

from assets.partitions import data_partitions
from assets.resources import StateResource, TelemetryStoreResource
from assets.training import checkpoint
from telemetry import store
from trainwise import settings
from trainwise.ledger_bill import store_ledger_bills

DBT_DIR = settings.PROJECT_ROOT / "dbt"
PROFILE = """# Written by trainwise (assets/analytics.py) for each dbt invocation; do not edit.
trainwise:
  target: local
  outputs:
    local:
      type: duckdb
      path: "{path}"
      threads: 1
"""


def dbt_executable() -> str:
    """The venv's dbt (next to this Python): `dagster dev` or a test need not activate it."""
    beside = Path(sys.executable).parent / "dbt"
    return str(beside) if beside.is_file() else (shutil.which("dbt") or "dbt")


def write_profiles(folder: Path, duckdb_path: Path) -> Path:
    """A profiles.yml for dbt pointing at `duckdb_path`; returns its folder."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "profiles.yml").write_text(PROFILE.format(path=duckdb_path.as_posix()))
    return folder


def _newest_source_mtime(project_dir: Path) -> float:
    files = [project_dir / "dbt_project.yml", *project_dir.glob("models/**/*"),
             *project_dir.glob("tests/**/*")]
    return max(p.stat().st_mtime for p in files if p.is_file())


def _fresh(manifest: Path, project_dir: Path) -> bool:
    return manifest.is_file() and manifest.stat().st_mtime >= _newest_source_mtime(project_dir)


def ensure_manifest(project: DbtProject) -> Path:
    """`dbt parse` when the manifest is missing or stale (see the module docstring). A file lock
    keeps processes loading at once (the UI's code server, test workers) from parsing over each
    other and reading a half-written manifest."""
    manifest = project.manifest_path
    if _fresh(manifest, project.project_dir):
        return manifest
    lock_path = project.project_dir / project.target_path / ".trainwise-parse.lock"
    lock_path.parent.mkdir(parents=True, exist_ok=True)
    with lock_path.open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if _fresh(manifest, project.project_dir):  # another process parsed while we waited
            return manifest
        with tempfile.TemporaryDirectory() as scratch:
            # parse renders the profile but never opens the database: any path will do.
            profiles = write_profiles(Path(scratch), Path(scratch) / "parse.duckdb")
            invocation = DbtCliResource(project_dir=project, profiles_dir=str(profiles),
                                        dbt_executable=dbt_executable()).cli(
                ["parse", "--quiet"], target_path=project.target_path, raise_on_error=False)
            invocation.wait()
    if not manifest.is_file():
        raise RuntimeError(f"dbt parse wrote no {manifest}; run `dbt parse --project-dir "
                           f"{project.project_dir}` to see why")
    return manifest


dbt_project = DbtProject(project_dir=DBT_DIR)
ensure_manifest(dbt_project)


def partition_runs(state_dir: Path, partition: str) -> list[Path]:
    """Telemetry folders (`runs/<id>/telemetry/<id>`) of the runs of one data partition."""
    import json

    found = []
    for request in sorted(state_dir.glob("runs/*/request.json")):
        try:
            if json.loads(request.read_text()).get("partition") != partition:
                continue
        except (OSError, ValueError):
            continue  # a half-written request file: that run is picked up next time
        folder = request.parent / "telemetry" / request.parent.name
        if folder.is_dir():
            found.append(folder)
    return found


@dg.asset(partitions_def=data_partitions, group_name="analytics", deps=[checkpoint],
          kinds={"duckdb"})
def telemetry(context: dg.AssetExecutionContext, state: StateResource,
              telemetry_store: TelemetryStoreResource) -> dg.MaterializeResult:
    """The telemetry segments of every training run of this partition, in DuckDB
    (table telemetry_events; idempotent ingestion)."""
    db = telemetry_store.db_path()
    folders = partition_runs(state.path(), context.partition_key)
    began = time.perf_counter()
    if folders:
        new = 0
        for folder in folders:
            new += store.ingest(folder, db)
            store_ledger_bills(folder, db)  # the bill dbt reports (issue 31, class 4)
    else:  # still create the table, so the dbt models build (to empty views)
        with tempfile.TemporaryDirectory() as scratch:
            (Path(scratch) / "none").mkdir()
            new = store.ingest(Path(scratch) / "none", db)
            store_ledger_bills(Path(scratch) / "none", db)
    seconds = time.perf_counter() - began
    return dg.MaterializeResult(metadata={
        "runs": len(folders), "run_ids": ", ".join(f.name for f in folders) or "none",
        "new_events": new, "ingest_s": round(seconds, 3),
        "ingest_events_per_s": round(new / seconds, 1) if seconds > 0 and new else 0.0,
        "duckdb": dg.MetadataValue.path(str(db))})


class TelemetryTranslator(DagsterDbtTranslator):
    """dbt's source `telemetry.telemetry_events` is the `telemetry` asset; models in analytics.
    (Source `telemetry.ledger_bills` is written by the same asset, but Dagster wants one dbt
    resource per key: it stays its own key, `telemetry/ledger_bills`.)"""

    def get_asset_key(self, dbt_resource_props) -> dg.AssetKey:
        if (dbt_resource_props.get("resource_type") == "source"
                and dbt_resource_props.get("name") == store.TABLE):
            return dg.AssetKey("telemetry")
        return super().get_asset_key(dbt_resource_props)

    def get_group_name(self, dbt_resource_props) -> str:
        return "analytics"


@dbt_assets(manifest=dbt_project.manifest_path, project=dbt_project,
            dagster_dbt_translator=TelemetryTranslator())
def dbt_models(context: dg.AssetExecutionContext, telemetry_store: TelemetryStoreResource):
    """cost_per_token, waste_breakdown, decisions and utilization over the telemetry; dbt tests as checks."""
    db = telemetry_store.db_path()
    profiles = write_profiles(db.parent / "dbt_profiles", db)
    dbt = DbtCliResource(project_dir=dbt_project, profiles_dir=str(profiles),
                         dbt_executable=dbt_executable())
    yield from dbt.cli(["build"], context=context).stream()
