"""Every setting trainwise reads, in one place, each an environment variable with a default.

Only this module reads the environment for configuration, so the README's settings table can be
checked against `SETTINGS` (a test does). Secrets (AWS keys) are never read here: boto3 takes
them from its own environment chain, so they cannot leak into params or metadata.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

PROJECT_ROOT = Path(__file__).resolve().parent.parent


@dataclass(frozen=True)
class Setting:
    name: str
    default: str
    help: str

    @property
    def shown_default(self) -> str:
        """The default as the README shows it: relative to the project, "(empty)" if empty."""
        shown = self.default.replace(str(PROJECT_ROOT), "<project>")
        return shown.replace(str(PROJECT_ROOT.parent), "<project>/..") or "(empty)"


SETTINGS: tuple[Setting, ...] = (
    Setting("TRAINWISE_HOME", str(PROJECT_ROOT / ".trainwise"),
            "state folder: shards, curricula, checkpoints, telemetry, DuckDB, MLflow, Dagster"),
    Setting("TRAINWISE_DATA_DIR", str(PROJECT_ROOT.parent / "shared" / "data"),
            "real data (corpora, images, spot traces); when missing, the demo falls back to "
            "Python's own standard library as its corpus"),
    Setting("TRAINWISE_DUCKDB_PATH", "", "DuckDB file for telemetry; empty = $TRAINWISE_HOME/trainwise.duckdb"),
    Setting("TRAINWISE_MLFLOW_URI", "", "MLflow tracking URI (e.g. http://127.0.0.1:5000); "
            "empty = sqlite:///$TRAINWISE_HOME/mlflow.db"),
    Setting("TRAINWISE_S3_BUCKET", "", "S3 bucket for checkpoints; empty = local folder "
            "$TRAINWISE_HOME/objects"),
    Setting("TRAINWISE_S3_ENDPOINT_URL", "", "S3 endpoint override (moto_server, MinIO); empty = AWS"),
    Setting("TRAINWISE_S3_PREFIX", "trainwise", "key prefix inside the S3 bucket"),
    Setting("TRAINWISE_INSTANCE_TYPE", "p3.2xlarge", "instance type the emulated node stands for "
            "(sets the USD price)"),
    Setting("TRAINWISE_REGION", "us-west-2", "AWS region whose list prices bill the emulated node"),
    Setting("TRAINWISE_PRUNING_RATE", "0.3", "share of low-difficulty examples pruned per epoch; 0 keeps all"),
    Setting("TRAINWISE_DEMO_PARTITION", "", "data partition of the demo; empty = tinyshakespeare, "
            "or pystdlib when the shared data is missing"),
    Setting("TRAINWISE_TORCH_THREADS", "1", "torch intra-op threads in the trainer"),
)

_BY_NAME = {s.name: s for s in SETTINGS}


def get(name: str) -> str:
    """The value of a trainwise setting: the environment, else its documented default."""
    if name not in _BY_NAME:
        raise KeyError(f"unknown setting {name!r}; known: {', '.join(sorted(_BY_NAME))}")
    value = os.environ.get(name, "")
    return value if value != "" else _BY_NAME[name].default


def home_dir() -> Path:
    """The state folder (created on first use); everything trainwise writes lives under it."""
    path = Path(get("TRAINWISE_HOME")).expanduser().resolve()
    path.mkdir(parents=True, exist_ok=True)
    return path


def data_dir() -> Path:
    """Where the real shared data lives (may not exist: callers fall back)."""
    return Path(get("TRAINWISE_DATA_DIR")).expanduser().resolve()


def duckdb_path() -> Path:
    value = get("TRAINWISE_DUCKDB_PATH")
    return Path(value).expanduser().resolve() if value else home_dir() / "trainwise.duckdb"


def mlflow_uri() -> str:
    value = get("TRAINWISE_MLFLOW_URI")
    return value if value else f"sqlite:///{home_dir() / 'mlflow.db'}"
