"""Test-wide set-up: one torch thread, offline Hugging Face, and a private state folder."""

import os

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ["TRAINWISE_TORCH_THREADS"] = "1"
# One deployment key for the whole session: each test has its own TRAINWISE_HOME (and so its own
# state.key), but module-scoped runs trained under one test are resumed under another.
os.environ.setdefault("TRAINWISE_STATE_KEY", "5e" * 32)

try:
    import torch

    torch.set_num_threads(1)
except ImportError:  # pragma: no cover - torch is a dependency; keep collection clear if not
    pass


@pytest.fixture(autouse=True)
def _private_state(tmp_path_factory, monkeypatch):
    """Each test writes its state under a fresh folder, never into the project's .trainwise."""
    home = tmp_path_factory.mktemp("trainwise_home")
    monkeypatch.setenv("TRAINWISE_HOME", str(home))
    monkeypatch.setenv("HF_HOME", str(home / "hf"))
    # Empty, not deleted: '' is the derived default, and the code location's resources read
    # these through dg.EnvVar, which refuses an unset variable.
    for name in ("TRAINWISE_MLFLOW_URI", "TRAINWISE_POSTGRES_URL", "TRAINWISE_S3_BUCKET",
                 "TRAINWISE_DUCKDB_PATH"):
        monkeypatch.setenv(name, "")
