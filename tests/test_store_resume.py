# ruff: noqa: F811  (the imported pytest fixtures are used as test arguments)
"""Checkpoints outlive the node (issue 10, item 3): a run whose local folder is gone (a new node,
a fresh state folder) resumes from the object store's last committed checkpoint under the same
training run id, directly and through a Dagster re-execution; a completed run is never resumed.

`run_training` runs for real on the small pystdlib state of tests/test_run_path_faults.py; a fast
policy that hands the loop a SIGTERM notice (`tests._preemption.SigtermAt`) stands in for the
reclaim.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from controllers.fast_types import NoOpFastPolicy
from tests._preemption import SigtermAt
from tests.test_run_path_faults import (  # noqa: F401 - fixtures used by name
    PARTITION,
    _train_job,
    built_state,
    request,
    run,
    state,
)
from trainwise import runs
from trainwise.object_store import LocalObjectStore


def _store(state: Path) -> LocalObjectStore:
    return LocalObjectStore(state / "objects")


def test_preempted_run_resumes_from_the_store_after_its_folder_is_lost(state):
    with pytest.raises(runs.RunInterruptedError, match="preempted at step 2"):
        run(state, request(), fast_policy=SigtermAt(2))
    prefix = runs.checkpoint_prefix(PARTITION, "run-a")
    keys = _store(state).list_keys(prefix)
    assert f"{prefix}/step-0000002.pt.commit" in keys, keys  # uploaded and committed
    assert runs.store_status(_store(state), PARTITION, "run-a") == "resumable"

    shutil.rmtree(state / "runs" / "run-a")  # the node and its disk are gone
    # Local folders alone know nothing any more (the old behaviour); the store still does.
    assert runs.resumable_run_id(state, ["run-a"]) is None
    assert runs.resumable_run_id(state, ["run-a"], store=_store(state),
                                 partition=PARTITION) == "run-a"

    resumed = run(state, request(), fast_policy=NoOpFastPolicy())
    assert resumed.status == "completed" and resumed.steps == 6
    assert resumed.resumed_from_step == 2, "resumed at the stored step, not from step 0"
    assert (state / "runs" / "run-a" / "checkpoints" / "step-0000002.pt").exists()
    assert runs.store_status(_store(state), PARTITION, "run-a") == "completed"


def test_completed_run_in_the_store_is_never_trained_again(state):
    assert run(state, request(max_steps=2)).status == "completed"
    shutil.rmtree(state / "runs" / "run-a")
    assert runs.resumable_run_id(state, ["run-a"], store=_store(state),
                                 partition=PARTITION) is None
    with pytest.raises(ValueError, match=r"run_id 'run-a' already completed.*new run id"):
        run(state, request(max_steps=2))


def test_store_of_another_partition_is_not_this_runs_lineage(state):
    with pytest.raises(runs.RunInterruptedError):
        run(state, request(), fast_policy=SigtermAt(2))
    assert runs.resumable_run_id(state.parent / "empty", ["run-a"], store=_store(state),
                                 partition="tinyshakespeare") is None


def test_dagster_reexecution_on_a_new_node_resumes_from_the_store(state, monkeypatch):
    import dagster as dg

    monkeypatch.setenv("TRAINWISE_HOME", str(state))
    monkeypatch.setattr(runs, "fast_policy", lambda name: SigtermAt(2))
    run_config = {
        "ops": {"checkpoint": {"config": {"max_steps": 6, "micro_batch_size": 4,
                                          "eval_every_steps": 50, "fast_every_steps": 2}}},
    }
    with dg.instance_for_test() as instance:
        first = _train_job().execute_in_process(
            partition_key=PARTITION, instance=instance, run_config=run_config,
            raise_on_error=False)
        assert not first.success
        shutil.rmtree(state / "runs" / first.run_id)  # replacement node: no local run folder

        monkeypatch.setattr(runs, "fast_policy", lambda name: NoOpFastPolicy())
        again = dg.execute_job(
            dg.reconstructable(_train_job), instance, tags={"dagster/partition": PARTITION},
            reexecution_options=dg.ReexecutionOptions.from_failure(first.run_id, instance))
        assert again.success
        [materialization] = again.asset_materializations_for_node("checkpoint")
        meta = {k: v.value for k, v in materialization.metadata.items()}
        assert meta["run_id"] == first.run_id, "same lineage, same training run"
        assert meta["resumed_from_step"] == 2 and meta["steps"] == 6


@pytest.mark.integration
def test_resume_from_s3_on_moto_after_the_node_is_lost(state, tmp_path, monkeypatch):
    from tests.test_checkpoint_upload import BUCKET, Moto
    from trainwise.object_store import S3ObjectStore

    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    server = Moto(tmp_path)
    server.start()
    try:
        store = S3ObjectStore(server.client(), BUCKET)
        with pytest.raises(runs.RunInterruptedError):
            run(state, request(), store=store, fast_policy=SigtermAt(2))
        shutil.rmtree(state / "runs")  # a new node: no run folders at all
        assert runs.resumable_run_id(state, ["run-a"], store=store,
                                     partition=PARTITION) == "run-a"
        resumed = run(state, request(), store=store, fast_policy=NoOpFastPolicy())
        assert resumed.resumed_from_step == 2 and resumed.steps == 6
        assert resumed.checkpoint_uri.startswith("s3://")
    finally:
        server.stop()
