"""The run path under bad input, unreachable services and preemption (issue 8: defects 2, 8, 9).

`run_training` is called for real on a small pystdlib state (shards built once per module, a
keep-everything curriculum): nothing here mocks the function under test. A fast policy that
hands the loop a SIGTERM notice (`tests._preemption.SigtermAt`) stands in for a spot reclaim.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import socket
import time
from pathlib import Path

import numpy as np
import pytest

from controllers.fast_types import NoOpFastPolicy
from tests._preemption import SigtermAt
from training import shards
from training.curriculum import keep_everything, write_curriculum
from trainwise import preflight, runs
from trainwise.object_store import LocalObjectStore

PARTITION = "pystdlib"


@pytest.fixture(scope="module")
def built_state(tmp_path_factory) -> Path:
    """Shards and a keep-everything curriculum of pystdlib, built once (about 4 s)."""
    root = tmp_path_factory.mktemp("run_path_state")
    out = root / "shards" / PARTITION
    shards.build_shards(PARTITION, root / "no-data", out)
    examples = shards.load_shards(out)
    write_curriculum(keep_everything(PARTITION, examples, anneal_fraction=0.25),
                     root / "curricula" / PARTITION)
    # MLflow's sqlite schema takes ~7 s of migrations: made once here, copied with the state.
    from mlflow.tracking import MlflowClient

    MlflowClient(tracking_uri=f"sqlite:///{root / 'mlflow.db'}").search_experiments()
    return root


@pytest.fixture
def state(built_state, tmp_path) -> Path:
    target = tmp_path / "state"
    shutil.copytree(built_state, target)
    return target


def request(**changes) -> runs.TrainRequest:
    base = runs.TrainRequest(
        partition=PARTITION, max_steps=6, micro_batch_size=4, grad_accum_steps=1,
        learning_rate=1e-3, eval_every_steps=50, seed=0, instance_type="p3.2xlarge",
        fast_policy="noop", run_id="run-a", fast_every_steps=2)
    return dataclasses.replace(base, **changes)


def run(state: Path, req: runs.TrainRequest, **overrides):
    kwargs = dict(state_dir=state, tracking_uri=f"sqlite:///{state / 'mlflow.db'}",
                  experiment="faults", store=LocalObjectStore(state / "objects"),
                  duckdb_path=state / "trainwise.duckdb", upload_timeout_s=30.0)
    kwargs.update(overrides)
    return runs.run_training(req, **kwargs)


def files_under(folder: Path) -> set[Path]:
    return {p for p in folder.rglob("*")}


def closed_port() -> int:
    """A loopback port nothing listens on (bound, then released)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


# --- defect 9: validation before writes -------------------------------------------------------
def test_run_id_escaping_the_state_folder_writes_nothing(state, tmp_path):
    before = files_under(tmp_path)
    with pytest.raises(ValueError, match=r"run_id.*'\.\./\.\./x'"):
        run(state, request(run_id="../../x"))
    assert files_under(tmp_path) == before
    assert not (tmp_path / "x").exists() and not (state.parent.parent / "x").exists()


def test_negative_seed_leaves_no_run_folder(state):
    with pytest.raises(ValueError, match=r"seed=-1"):
        run(state, request(seed=-1))
    assert not (state / "runs").exists()


def test_partition_given_as_a_path_is_refused(state, tmp_path):
    # A folder that looks like a partition's shards: it must never be read.
    fake = tmp_path / "elsewhere"
    shutil.copytree(state / "shards" / PARTITION, fake)
    with pytest.raises(ValueError, match="path separator.*pystdlib"):
        run(state, request(partition=str(fake)))
    with pytest.raises(ValueError, match="unknown partition 'nope'.*mnist"):
        run(state, request(partition="nope"))
    assert not (state / "runs").exists()


@pytest.mark.parametrize("field, value", [
    ("max_steps", 0), ("micro_batch_size", 0), ("grad_accum_steps", -1),
    ("eval_every_steps", 0), ("fast_every_steps", 0), ("learning_rate", float("nan")),
    ("learning_rate", 0.0), ("learning_rate", float("inf")), ("fast_policy", "greedy"),
    ("data_selection", "random"), ("seed", 2**40),
])
def test_bad_numbers_and_names_are_refused_before_any_write(state, field, value):
    with pytest.raises(ValueError, match=field):
        run(state, request(**{field: value}))
    assert not (state / "runs").exists()


# --- defect 8: services and paths checked before the first step -------------------------------
def _refused_fast(state: Path, match: str, **overrides) -> None:
    waits = []  # any retry or backoff (ours, boto3's, MLflow's) sleeps through time.sleep
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(time, "sleep", waits.append)
        with pytest.raises(preflight.PreflightError, match=match):
            run(state, request(), **overrides)
    assert waits == [], "preflight fails at once: no retries, no backoff"
    assert not (state / "runs").exists(), "refused before any training step"


def test_unreachable_mlflow_server_is_refused_before_training(state):
    _refused_fast(state, r"TRAINWISE_MLFLOW_URI",
                  tracking_uri=f"http://127.0.0.1:{closed_port()}")


def test_unreachable_s3_endpoint_is_refused_before_training(state, monkeypatch):
    import boto3

    from trainwise.object_store import S3ObjectStore

    for name, value in (("AWS_ACCESS_KEY_ID", "testing"), ("AWS_SECRET_ACCESS_KEY", "testing"),
                        ("AWS_DEFAULT_REGION", "us-east-1")):
        monkeypatch.setenv(name, value)
    endpoint = f"http://127.0.0.1:{closed_port()}"
    client = boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1")
    _refused_fast(state, r"(?s)object store.*TRAINWISE_S3",
                  store=S3ObjectStore(client, "trainwise-bucket"))


def test_duckdb_path_that_is_a_folder_is_refused_before_training(state, tmp_path):
    folder = tmp_path / "a-folder.duckdb"
    folder.mkdir()
    _refused_fast(state, r"(?s)telemetry store.*TRAINWISE_DUCKDB_PATH", duckdb_path=folder)


def test_state_folder_that_is_a_file_is_refused(tmp_path):
    home = tmp_path / "home-file"
    home.write_text("not a folder")
    with pytest.raises(ValueError, match=r"TRAINWISE_HOME=.*home-file.*is a file"):
        preflight.check_state_dir(home)
    # Under a file nothing can be created: the same clear error, not a bare OSError.
    with pytest.raises(ValueError, match=r"TRAINWISE_HOME=.*cannot be created"):
        preflight.check_state_dir(home / "state")


def test_read_only_state_folder_is_refused(state, monkeypatch):
    # Through run_training. Tests run as root, for whom chmod does not make a folder read-only;
    # os.access answers as it does on a read-only mount (the real mount is the next test,
    # skipped where the sandbox forbids mounts).
    real_access = os.access

    def read_only(path, mode, *args, **kwargs):
        if Path(path) == state and mode & os.W_OK:
            return False
        return real_access(path, mode, *args, **kwargs)

    monkeypatch.setattr(preflight.os, "access", read_only)
    _refused_fast(state, r"(?s)state folder.*TRAINWISE_HOME=.*not writable")


def test_every_problem_is_listed_at_once(state, tmp_path):
    folder = tmp_path / "db-folder"
    folder.mkdir()
    with pytest.raises(preflight.PreflightError) as caught:
        run(state, request(), duckdb_path=folder,
            tracking_uri=f"http://127.0.0.1:{closed_port()}")
    assert len(caught.value.problems) == 2


# --- defect 2: preemption is not success, and resumes under the same run id -------------------
def test_preempted_before_first_eval_raises_keeps_checkpoint_and_resumes(state):
    with pytest.raises(runs.RunInterruptedError, match="preempted at step 2 of 6") as caught:
        run(state, request(), fast_policy=SigtermAt(2))
    summary = caught.value.summary
    assert summary.status == "preempted" and summary.steps == 2
    # The policy given to the call was in charge, not the one the request names ("noop").
    assert summary.fast_policy == "sigterm_at"
    assert json.loads((state / "runs" / "run-a" / "fast_policy.json").read_text()) == {
        "fast_policy": "sigterm_at", "reason": "given by the caller"}
    assert np.isnan(summary.final_eval_loss)  # no eval yet: no TypeError in MLflow logging
    assert summary.mlflow_run_id and summary.pending == ""
    kept = Path(summary.checkpoint_uri.removeprefix("file://"))
    assert kept.exists() and "run-a" in str(kept)
    local = state / "runs" / "run-a" / "checkpoints"
    assert any(local.glob("step-0000002.pt"))
    outcome = runs.read_outcome(state / "runs" / "run-a")
    assert outcome["status"] == "preempted"

    resumed = run(state, request(), fast_policy=NoOpFastPolicy())
    assert resumed.status == "completed" and resumed.resumed_from_step == 2
    assert resumed.steps == 6
    starts = [e for e in _events(resumed) if e["type"] == "run_start"]
    assert [s["step"] for s in starts] == [0, 2]  # the second call began at the checkpoint

    with pytest.raises(ValueError, match="already completed"):
        run(state, request())


def test_preempted_after_an_eval_is_not_a_success_either(state):
    # Before the fix this returned normally with status "preempted": a false success.
    with pytest.raises(runs.RunInterruptedError, match="preempted at step 4") as caught:
        run(state, request(eval_every_steps=2), fast_policy=SigtermAt(4))
    assert np.isfinite(caught.value.summary.final_eval_loss)
    assert runs.is_resumable(state / "runs" / "run-a")


def _events(summary: runs.RunSummary) -> list[dict]:
    from telemetry.reader import read_run_events

    return read_run_events(Path(summary.telemetry_dir))


def test_every_checkpoint_is_uploaded_as_it_is_written(state):
    summary = run(state, request(max_steps=4, fast_every_steps=2))
    objects = state / "objects" / "checkpoints" / PARTITION / "run-a"
    assert summary.checkpoint_uri == (objects / "step-0000004.pt").as_uri()
    assert (objects / "step-0000004.pt").exists()


# --- after training a failing service never fails the finished training ---------------------
def test_busy_telemetry_store_after_training_is_pending_not_a_failure(state, monkeypatch):
    from telemetry import store as telemetry_store

    def busy(*args, **kwargs):
        raise telemetry_store.TelemetryStoreBusyError("DuckDB file is locked by pid 1")

    monkeypatch.setattr(telemetry_store, "ingest", busy)
    with pytest.warns(UserWarning, match="trainwise ingest run-a"):
        summary = run(state, request(max_steps=2))
    assert summary.status == "completed" and summary.events_ingested == 0
    assert "trainwise ingest run-a" in summary.pending
    marker = state / "runs" / "run-a" / runs.INGEST_PENDING_NAME
    assert "locked" in json.loads(marker.read_text())["error"]
    monkeypatch.undo()
    assert runs.reingest(state, "run-a", state / "trainwise.duckdb") > 0
    assert not marker.exists()


class FailingStore(LocalObjectStore):
    """An object store that went away after the preflight."""

    def check_reachable(self) -> None:
        return None

    def put_file(self, local_path, key):
        raise ConnectionRefusedError("object store went away")

    def put_checkpoint(self, path, manifest_path, key):
        raise ConnectionRefusedError("object store went away")


def test_upload_failure_after_training_keeps_the_local_checkpoint(state):
    summary = run(state, request(max_steps=2), store=FailingStore(state / "objects"),
                  upload_timeout_s=1.0)
    assert summary.status == "completed"
    local = Path(summary.checkpoint_uri.removeprefix("file://"))
    assert local.exists() and local.parent == state / "runs" / "run-a" / "checkpoints"
    assert "checkpoint upload failed" in summary.pending and str(local) in summary.pending


# --- defect 2 through Dagster: a preempted run fails, its re-execution resumes ----------------
def _train_job():
    """The `train` job, reconstructable (a re-execution needs it by module and name)."""
    from pipelines.definitions import defs

    return defs.resolve_job_def("train")


def test_preempted_dagster_run_fails_and_its_reexecution_resumes(state, monkeypatch):
    import dagster as dg

    monkeypatch.setenv("TRAINWISE_HOME", str(state))
    monkeypatch.setattr(runs, "fast_policy", lambda name: SigtermAt(2))
    run_config = {
        # The code location's executor is in-process, so this process's fast policy (and its
        # notice) is the one that runs, in the re-execution below too.
        "ops": {"checkpoint": {"config": {"max_steps": 6, "micro_batch_size": 4,
                                          "eval_every_steps": 50, "fast_every_steps": 2}}},
    }
    with dg.instance_for_test() as instance:
        first = _train_job().execute_in_process(
            partition_key=PARTITION, instance=instance, run_config=run_config,
            raise_on_error=False)
        assert not first.success, "a preempted run is not a success"
        assert first.asset_materializations_for_node("checkpoint") == []
        failure = first.failure_data_for_node("checkpoint").user_failure_data
        meta = {k: v.value for k, v in failure.metadata.items()}
        assert meta["status"] == "preempted" and meta["steps"] == 2
        assert "re-execute" in meta["resume"]
        kept = Path(meta["checkpoint_uri"].removeprefix("file://"))
        assert kept.exists()

        monkeypatch.setattr(runs, "fast_policy", lambda name: NoOpFastPolicy())
        # "Re-execute from failure", as the UI does it (the UI also copies the partition tag).
        again = dg.execute_job(
            dg.reconstructable(_train_job), instance,
            tags={"dagster/partition": PARTITION},
            reexecution_options=dg.ReexecutionOptions.from_failure(first.run_id, instance))
        assert again.success
        assert instance.get_run_by_id(again.run_id).root_run_id == first.run_id
        [materialization] = again.asset_materializations_for_node("checkpoint")
        meta = {k: v.value for k, v in materialization.metadata.items()}
        assert meta["status"] == "completed" and meta["steps"] == 6
        assert meta["run_id"] == first.run_id and meta["resumed_from_step"] == 2
        assert instance.get_run_by_id(again.run_id).tags[
            "trainwise/training_run_id"] == first.run_id


def test_demo_command_checks_services_before_the_data_build(monkeypatch, capsys, tmp_path):
    from trainwise import cli, settings

    folder = tmp_path / "db-folder"
    folder.mkdir()
    monkeypatch.setenv("TRAINWISE_DUCKDB_PATH", str(folder))
    monkeypatch.setenv("TRAINWISE_MLFLOW_URI", f"http://127.0.0.1:{closed_port()}")
    assert cli.main(["demo", "--partition", PARTITION, "--steps", "2"]) == 2
    err = capsys.readouterr().err
    assert "TRAINWISE_MLFLOW_URI" in err and "TRAINWISE_DUCKDB_PATH" in err
    assert not (settings.home_dir() / "shards").exists(), "refused before the data build"


def test_only_committed_checkpoints_of_unfinished_runs_are_resumed(tmp_path):
    from training.checkpoint import manifest_path

    run_dir = tmp_path / "runs" / "r1"
    payload = run_dir / "checkpoints" / "step-0000002.pt"
    payload.parent.mkdir(parents=True)
    payload.write_bytes(b"payload of a writer killed before its manifest")
    assert not runs.is_resumable(run_dir), "an uncommitted payload is not a checkpoint"
    manifest_path(payload).write_text("{}")
    assert runs.is_resumable(run_dir)
    assert runs.resumable_run_id(tmp_path, ["../x", "r0", "r1"]) == "r1"
    (run_dir / runs.OUTCOME_NAME).write_text(json.dumps({"status": "completed"}))
    assert not runs.is_resumable(run_dir) and runs.resumable_run_id(tmp_path, ["r1"]) is None


def test_read_only_mount_as_state_folder_is_refused(tmp_path):
    """A real read-only file system (a read-only bind mount in a private mount namespace);
    skipped where the sandbox does not allow one."""
    import subprocess
    import sys

    if shutil.which("unshare") is None:
        pytest.skip("unshare is not available")
    home = tmp_path / "ro-home"
    home.mkdir()
    root = Path(__file__).resolve().parent.parent
    check = ("import sys; from trainwise import preflight\n"
             "try:\n    preflight.check_state_dir(sys.argv[1])\n"
             "except ValueError as error:\n    print(error); sys.exit(3)\n")
    script = (f'mount --bind -o ro "$1" "$1" || exit 42; '
              f'exec "{sys.executable}" -c \'{check}\' "$1"')
    done = subprocess.run(["unshare", "-m", "sh", "-c", script, "sh", str(home)], cwd=root,
                          capture_output=True, text=True, timeout=60)
    if done.returncode == 42 or "unshare failed" in done.stderr:
        pytest.skip(f"no read-only bind mount here: {done.stderr.strip()}")
    assert done.returncode == 3, done.stdout + done.stderr
    assert "TRAINWISE_HOME=" in done.stdout and "not writable" in done.stdout
