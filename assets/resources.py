"""External systems as Dagster resources, each with an embedded default and one switch.

The code location builds them with `launchpad_resources()`: each field that is a setting is a
`dg.EnvVar` naming that setting's variable, so the Launchpad and the resource page show where
the value comes from (not ''), and the defaults are applied in one place, `apply_setting_defaults`
(each documented default of `trainwise.settings` put into the environment unless already set).
A setting whose default is "derived" (empty: the DuckDB file, the MLflow store and the S3 bucket
default to places under the state folder) is an EnvVar too: `apply_setting_defaults` sets it to
'' when unset (Dagster refuses an EnvVar of an unset variable, not an empty one), and the
resource derives the place when used. A resource built by hand with no arguments (tests,
headless runs) falls back to the settings when used, as before.
"""

from __future__ import annotations

import os
from pathlib import Path

import dagster as dg

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
        # Imported here: dagster_aws's package import (0.7 s, its components pull in Dagster's
        # test utilities) was paid by every run process and code server, S3 or not.
        from dagster_aws.s3 import S3Resource

        client = S3Resource(endpoint_url=endpoint, region_name=self.region_name).get_client()
        return S3ObjectStore(client, bucket, self.prefix or settings.get("TRAINWISE_S3_PREFIX"))


# Resource field -> the setting that feeds it.
_FIELDS: dict[str, dict[str, str]] = {
    "state": {"home": "TRAINWISE_HOME"},
    "telemetry_store": {"duckdb_path": "TRAINWISE_DUCKDB_PATH"},
    "mlflow": {"tracking_uri": "TRAINWISE_MLFLOW_URI"},
    "object_store": {"bucket": "TRAINWISE_S3_BUCKET", "endpoint_url": "TRAINWISE_S3_ENDPOINT_URL",
                     "prefix": "TRAINWISE_S3_PREFIX"},
}
_CLASSES = {"state": StateResource, "telemetry_store": TelemetryStoreResource,
            "mlflow": MLflowResource, "object_store": ObjectStoreResource}


def apply_setting_defaults() -> None:
    """The one place defaults reach Dagster: every setting with a non-empty documented default
    that is unset (or empty) in the environment gets that default, and every other unset one
    gets '' (a derived default), so each EnvVar resolves."""
    for setting in settings.SETTINGS:
        if setting.default and not os.environ.get(setting.name):
            os.environ[setting.name] = setting.default
        else:
            os.environ.setdefault(setting.name, "")


def _value(name: str) -> str:
    # Always the EnvVar: the Launchpad shows the variable, never a bare '' (an empty value is a
    # derived default the resource works out from the state folder when used).
    return dg.EnvVar(name)


def launchpad_resources() -> dict[str, dg.ConfigurableResource]:
    """The code location's resources, each setting as a dg.EnvVar (see the module docstring)."""
    apply_setting_defaults()
    return {key: _CLASSES[key](**{field: _value(name) for field, name in fields.items()})
            for key, fields in _FIELDS.items()}
