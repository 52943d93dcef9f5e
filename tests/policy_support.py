"""Policy files and a registry for tests that need learned policies without training one: tiny
random weights of the real layouts (what `rl.retrain` writes) and a migrated MLflow database."""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np

from rl.fast_obs import BATCH_CHOICES, FAST_OBS_LAYOUT, NOTICE_CHOICES, SHARE_CHOICES
from rl.policy_file import PolicyWeights
from rl.slow_obs import CHECKPOINT_CHOICES_S, SLOW_CHOICES, SLOW_OBS_LAYOUT


def tiny_policy(kind: str, version: int, region: str, window: str) -> PolicyWeights:
    """A valid policy of `kind` ("fast" or "slow"); each version has its own weights (and file
    hash), seeded by the version."""
    layout = FAST_OBS_LAYOUT if kind == "fast" else SLOW_OBS_LAYOUT
    nvec = ((len(SHARE_CHOICES), len(BATCH_CHOICES), len(NOTICE_CHOICES)) if kind == "fast"
            else (len(SLOW_CHOICES), len(CHECKPOINT_CHOICES_S)))
    rng = np.random.default_rng(version)
    hidden = [(rng.normal(size=(8, len(layout))).astype(np.float32) * 0.01,
               np.zeros(8, np.float32))]
    head = (rng.normal(size=(sum(nvec), 8)).astype(np.float32) * 0.01,
            np.zeros(sum(nvec), np.float32))
    return PolicyWeights(hidden, head, nvec, layout, kind, region, window, version)


def empty_mlflow_db(folder: Path) -> Path:
    """One migrated, empty MLflow database (migrations take seconds: copy it per test)."""
    from mlflow.tracking import MlflowClient

    path = Path(folder) / "empty.db"
    MlflowClient(tracking_uri=f"sqlite:///{path}").search_registered_models()
    return path


def use_registry_copy(empty_db: Path, folder: Path, monkeypatch) -> str:
    """A fresh copy of `empty_db` as this test's MLflow tracking URI; returns the URI."""
    shutil.copyfile(empty_db, Path(folder) / "registry.db")
    value = f"sqlite:///{Path(folder) / 'registry.db'}"
    monkeypatch.setenv("TRAINWISE_MLFLOW_URI", value)
    return value
