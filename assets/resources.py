"""External systems as Dagster resources, each with an embedded default and one switch.

A field left empty falls back to its setting in `trainwise.settings` (read when the resource is
used, not when the code location loads), so a fresh clone runs with no servers and one
environment variable points each resource at the real thing.
"""

from __future__ import annotations

from pathlib import Path

import dagster as dg
from dagster_aws.s3 import S3Resource

from trainwise import settings
from trainwise.object_store import LocalObjectStore, ObjectStore, S3ObjectStore


class StateResource(dg.ConfigurableResource):
    """The state folder: shards, scores, curricula, checkpoints, telemetry."""

    home: str = ""

    def path(self, *parts: str) -> Path:
        """A folder under the state folder, created if missing; a state folder that is a file
        or read-only is a clear error naming TRAINWISE_HOME, not a bare OSError."""
        root = Path(self.home).resolve() if self.home else settings.home_dir()
        target = root.joinpath(*parts)
        try:
            target.mkdir(parents=True, exist_ok=True)
        except OSError as error:
            raise settings.SettingError(
                f"state folder {target} cannot be created ({error.strerror or error}); set "
                "TRAINWISE_HOME (or the state resource's `home`) to a writable folder"
            ) from error
        return target

    def data_dir(self) -> Path:
        return settings.data_dir()


class TelemetryStoreResource(dg.ConfigurableResource):
    """DuckDB file that telemetry segments are ingested into (TRAINWISE_DUCKDB_PATH)."""

    duckdb_path: str = ""

    def db_path(self) -> Path:
        return Path(self.duckdb_path).resolve() if self.duckdb_path else settings.duckdb_path()


class MLflowResource(dg.ConfigurableResource):
    """MLflow tracking: sqlite under the state folder by default, a server when
    TRAINWISE_MLFLOW_URI is set."""

    tracking_uri: str = ""
    experiment: str = "trainwise"

    def uri(self) -> str:
        return self.tracking_uri or settings.mlflow_uri()


class ObjectStoreResource(dg.ConfigurableResource):
    """Checkpoint store: a local folder by default, S3 (through dagster-aws) when a bucket is set."""

    bucket: str = ""
    endpoint_url: str = ""
    prefix: str = ""
    region_name: str = "us-east-1"
    local_root: str = ""

    def store(self) -> ObjectStore:
        bucket = self.bucket or settings.get("TRAINWISE_S3_BUCKET")
        if not bucket:
            root = Path(self.local_root) if self.local_root else settings.home_dir() / "objects"
            return LocalObjectStore(root)
        endpoint = self.endpoint_url or settings.get("TRAINWISE_S3_ENDPOINT_URL") or None
        client = S3Resource(endpoint_url=endpoint, region_name=self.region_name).get_client()
        return S3ObjectStore(client, bucket, self.prefix or settings.get("TRAINWISE_S3_PREFIX"))
