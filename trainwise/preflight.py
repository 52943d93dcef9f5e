"""Checks every path and service a training run needs BEFORE its first step.

A run that finds an unreachable MLflow server, an S3 endpoint that refuses connections or a
DuckDB path that is a folder only after training wastes the whole training (issue 8, defect 8).
The same goes for a compute provider that is not registered or whose settings are wrong
(`check_provider`). `check_services` runs each check once, quickly (no retries: retries belong
to the upload and logging after training), and raises one `PreflightError` listing every problem
with the setting that controls it and how to fix it.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

# Seconds a service may take to answer the preflight; a closed port answers at once.
DEFAULT_TIMEOUT_S = 5.0


class PreflightError(RuntimeError):
    """One or more paths or services a run needs are not usable; `problems` lists each."""

    def __init__(self, problems: list[str]) -> None:
        self.problems = list(problems)
        listed = "\n".join(f"  - {p}" for p in self.problems)
        super().__init__(f"refusing to start training: {len(self.problems)} problem(s) found "
                         f"before the first step (nothing was trained):\n{listed}")


def check_state_dir(state_dir: Path, setting: str = "TRAINWISE_HOME") -> None:
    """The state folder exists (or can be created), is a folder and takes a file.

    The write probe matters: as root `os.access` says yes to a read-only mount, and a folder
    can be writable by mode yet on a full or read-only file system."""
    state_dir = Path(state_dir)
    fix = f"set {setting} to a writable folder"
    if state_dir.exists() and not state_dir.is_dir():
        raise ValueError(f"{setting}={str(state_dir)!r} is a file, not a folder; {fix}")
    try:
        state_dir.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        raise ValueError(f"{setting}={str(state_dir)!r} cannot be created "
                         f"({error.strerror or error}); {fix}") from error
    if not os.access(state_dir, os.W_OK | os.X_OK):
        raise ValueError(f"{setting}={str(state_dir)!r} is not writable; {fix}")
    try:
        with tempfile.NamedTemporaryFile(dir=state_dir, prefix=".preflight-") as probe:
            probe.write(b"ok")
            probe.flush()
    except OSError as error:
        raise ValueError(f"{setting}={str(state_dir)!r} is not writable "
                         f"({error.strerror or error}); {fix}") from error


def check_duckdb_path(duckdb_path: Path) -> None:
    """TRAINWISE_DUCKDB_PATH is a DuckDB file (or can become one) in a writable folder."""
    from telemetry import store as telemetry_store

    try:
        telemetry_store.check_db_path(Path(duckdb_path))
    except ValueError as error:
        text = str(error)
        if "TRAINWISE_DUCKDB_PATH" not in text:
            text = f"{text} (set TRAINWISE_DUCKDB_PATH to a DuckDB file in a writable folder)"
        raise ValueError(text) from error


def check_tracking(tracking_uri: str, timeout_s: float = DEFAULT_TIMEOUT_S) -> None:
    """The MLflow tracking URI answers (raises ServiceUnreachableError naming
    TRAINWISE_MLFLOW_URI)."""
    from trainwise import tracking

    tracking.check_reachable(tracking_uri, timeout_s=timeout_s)


def check_object_store(store: Any) -> None:
    """The checkpoint store answers (raises ServiceUnreachableError naming bucket, endpoint and
    the TRAINWISE_S3_* settings). A store without a check (a test double) passes."""
    check = getattr(store, "check_reachable", None)
    if check is not None:
        check()


def check_provider(name: str | None = None) -> None:
    """The compute provider TRAINWISE_PROVIDER (or `name`) selects is registered (the modules of
    TRAINWISE_PROVIDER_MODULES import and register) and its class's own `preflight` passes
    (aws: the TRAINWISE_EC2_ENDPOINT_URL override is a URL). Errors name the setting."""
    from cloud.providers import provider_class, provider_name

    provider_class(provider_name(name)).preflight()


def check_services(
    *,
    state_dir: Path,
    duckdb_path: Path,
    tracking_uri: str,
    store: Any,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    provider: str | None = None,
) -> None:
    """Every check above; raises one PreflightError listing all that failed. `provider`: the
    provider name to check (default: the TRAINWISE_PROVIDER setting)."""
    checks: list[tuple[str, Callable[[], None]]] = [
        ("state folder", lambda: check_state_dir(state_dir)),
        ("telemetry store", lambda: check_duckdb_path(duckdb_path)),
        ("MLflow", lambda: check_tracking(tracking_uri, timeout_s)),
        ("object store", lambda: check_object_store(store)),
        ("compute provider", lambda: check_provider(provider)),
    ]
    problems = []
    for label, check in checks:
        try:
            check()
        except (ValueError, OSError, RuntimeError) as error:
            # RuntimeError covers ServiceUnreachableError (trainwise.services).
            problems.append(f"{label}: {error}")
    if problems:
        raise PreflightError(problems)
