"""A registered job launched from Dagster (assets/user_jobs.py): the project file's dataset is
materialized as its data_shards partition, `user_job_run` launches the job on the emulated
provider's node, the replayed market reclaims it, and the job resumes from the object store on
the replacement and completes on the registered dataset's rows."""

from __future__ import annotations

import json

import dagster as dg
import numpy as np
import pytest

from assets.data import data_shards_asset
from assets.partitions import partitions_for
from assets.resources import MLflowResource, ObjectStoreResource, StateResource
from assets.user_jobs import JOB_NAME, user_job_defs
from cloud import emulated as replay
from cloud.providers.emulated import EmulatedProvider
from trainwise import gang
from trainwise.user_project import load_project_file

TRAIN = """
import json, sys, time, torch, trainwise
torch.set_num_threads(1)
run = trainwise.init()
rows = run.dataset("train")
x = torch.tensor([rows["a"], rows["b"]], dtype=torch.float32).T
data = torch.utils.data.TensorDataset(x, torch.tensor(rows["y"], dtype=torch.float32)[:, None])
loader = run.dataloader(data, batch_size=4)
torch.manual_seed(0)
model = torch.nn.Linear(2, 1)
optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
model, optimizer = run.track(model, optimizer)
while not run.done:
    for xb, yb in loader:
        loss = torch.nn.functional.mse_loss(model(xb), yb)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        run.step(loss=loss)
        time.sleep(0.05)
        if run.done:
            break
run.finish(eval_loss=float(loss.detach()))
print(json.dumps({"train_rows": len(rows), "eval_rows": len(run.dataset("eval"))}))
"""


def _provider(*_args, **_kwargs) -> EmulatedProvider:
    # Spot capacity 1 and then none: the job's node is reclaimed a few steps in.
    market = replay.ReplayMarket("us-west-2a", "p3.2xlarge", 195,
                                 np.asarray([1] * 4 + [0] * 10_000, dtype=np.int64), 0,
                                 "test window", 0.918, 3.06, "test")
    return EmulatedProvider([market], replay.ReplayClock(195.0, 0.3), replay.default_rules())


def write_project(folder):
    """A team's project folder: the points dataset and the `fit` job (TRAIN); its file."""
    folder.mkdir()
    (folder / "train.py").write_text(TRAIN)
    with (folder / "points.jsonl").open("w") as out:
        for i in range(60):
            out.write(json.dumps({"pid": f"p{i}", "a": i / 60, "b": (i % 7) / 7,
                                  "y": 2 * i / 60 - (i % 7) / 7}) + "\n")
    (folder / "trainwise.toml").write_text(
        '[datasets.points]\npath = "points.jsonl"\nid_column = "pid"\neval_fraction = 0.2\n\n'
        '[jobs.fit]\nentry = "train.py"\ndataset = "points"\n')
    return folder / "trainwise.toml"


@pytest.fixture
def project(tmp_path):
    return load_project_file(write_project(tmp_path / "team"))


def test_a_registered_job_is_launched_from_dagster_survives_a_reclaim_and_completes(
        tmp_path, project, monkeypatch):
    monkeypatch.setattr(gang, "provider_for_run", _provider)
    monkeypatch.setenv("TRAINWISE_HOME", str(tmp_path / "home"))
    shards = data_shards_asset(partitions_for(project), project.datasets)
    defs = user_job_defs(project, shards)
    [asset], [job] = defs["assets"], defs["jobs"]
    assert job.name == JOB_NAME
    resources = {"state": StateResource(home=str(tmp_path / "home")),
                 "object_store": ObjectStoreResource(local_root=str(tmp_path / "store")),
                 "mlflow": MLflowResource(tracking_uri=f"sqlite:///{tmp_path}/mlflow.db")}
    built = dg.materialize([shards], partition_key="points", resources=resources)
    assert built.success
    result = dg.materialize(
        [shards.to_source_asset(), asset], resources=resources,
        run_config={"ops": {"user_job_run": {"config": {"job": "fit", "run_id": "fit-1",
                                                       "max_steps": 30,
                                                       "checkpoint_every_steps": 10}}}})
    assert result.success
    [materialization] = result.asset_materializations_for_node("user_job_run")
    meta = {k: v.value for k, v in materialization.metadata.items()}
    assert meta["status"] == "completed" and meta["steps"] >= 30
    assert meta["reclaims"] == 1 and meta["cost_usd"] > 0
    segments = meta["segments"]
    assert [s["returncode"] for s in segments] == [143, 0]
    from mlflow.tracking import MlflowClient

    logged = MlflowClient(f"sqlite:///{tmp_path}/mlflow.db").get_run(meta["mlflow_run_id"])
    assert logged.data.metrics["cost/bill_usd"] == pytest.approx(meta["cost_usd"])
    assert "losses/eval" in logged.data.metrics and logged.data.params["job"] == "fit"
    assert logged.data.tags["trainwise/user_job"] == "fit"
    log = (tmp_path / "home" / "runs" / "fit-1" / "user_job" / "segment-1.log").read_text()
    counts = json.loads(log.strip().splitlines()[-1])
    assert counts["train_rows"] + counts["eval_rows"] == 60 and counts["eval_rows"] > 0


def test_the_launchpad_offers_only_registered_jobs_and_none_without_a_file(project):
    from trainwise.user_project import EMPTY_PROJECT

    assert user_job_defs(EMPTY_PROJECT) == {"assets": [], "jobs": []}
    [asset] = user_job_defs(project)["assets"]
    config_type = asset.op.config_schema.config_type
    job_field = config_type.fields["job"].config_type
    job_field = getattr(job_field, "inner_type", job_field)  # Noneable around the Enum
    assert [value.config_value for value in job_field.enum_values] == ["fit"]


def test_a_gang_is_refused_on_the_emulated_provider_before_anything_runs(tmp_path, project,
                                                                         monkeypatch):
    monkeypatch.setenv("TRAINWISE_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("TRAINWISE_PROVIDER", "emulated")
    [asset] = user_job_defs(project)["assets"]
    resources = {"state": StateResource(home=str(tmp_path / "home")),
                 "object_store": ObjectStoreResource(local_root=str(tmp_path / "store")),
                 "mlflow": MLflowResource(tracking_uri=f"sqlite:///{tmp_path}/mlflow.db")}
    result = dg.materialize(
        [asset], resources=resources, raise_on_error=False, selection=[asset.key],
        run_config={"ops": {"user_job_run": {"config": {"job": "fit", "nodes": 2}}}})
    assert not result.success
    [failure] = [e for e in result.all_events if e.event_type_value == "STEP_FAILURE"]
    message = failure.step_failure_data.error.message
    assert "nodes=2" in message and "TRAINWISE_PROVIDER=aws" in message
    assert "emulated provider runs the job as one process" in message
    assert not (tmp_path / "home" / "runs").exists()  # nothing launched, no run folder
