"""The three worked projects of `examples/` (a plain PyTorch loop, a Hugging Face Trainer job, a
Lightning job) launched from Dagster as a team would launch them: the project file's dataset is
materialized as its `data_shards` partition, then `user_job_run` (the `train_user_job` job's
asset) launches the registered job on the emulated provider's spot node. The replayed market
reclaims the node a few steps in: the job checkpoints to the object store within the notice and
exits 143; the replacement (spot refused: on-demand) starts the job on an empty disk, it resumes
from the store and completes, with the model weights of a run of the same job that met no
notice, bit for bit (CPU, one thread).

The launcher picks the fast levers the framework can apply (`user_jobs.spec_for_framework`):
the Trainer and Lightning refuse `batch_scaling`, and a launch that asked for it failed at the
job's first line.
"""

from __future__ import annotations

import dataclasses
import subprocess
import sys
from pathlib import Path
from types import MappingProxyType

import dagster as dg
import numpy as np
import pytest
import torch

from assets.data import data_shards_asset
from assets.partitions import partitions_for
from assets.resources import MLflowResource, ObjectStoreResource, StateResource
from assets.user_jobs import user_job_defs
from cloud import emulated as replay
from cloud.providers.emulated import EmulatedProvider
from trainwise import gang
from trainwise.sdk.spec import RunSpec, write_spec
from trainwise.user_jobs import job_env, spec_for_framework
from trainwise.user_project import load_project_file

ROOT = Path(__file__).resolve().parents[1]
MAX_STEPS = 40  # each example's project file asks for 40 steps
EXAMPLES = {
    "plain_loop": (),
    "hf_trainer": ("transformers", "accelerate"),
    "lightning": ("lightning",),
}


def _provider(*_args, **_kwargs) -> EmulatedProvider:
    # Spot capacity 1, then none from tick 4: the job's node is reclaimed a few steps in and
    # the replacement comes up on-demand.
    market = replay.ReplayMarket("us-west-2a", "p3.2xlarge", 195,
                                 np.asarray([1] * 4 + [0] * 10_000, dtype=np.int64), 0,
                                 "test window", 0.918, 3.06, "test")
    return EmulatedProvider([market], replay.ReplayClock(195.0, 0.3), replay.default_rules())


def _final_model(run_dir: Path) -> dict[str, torch.Tensor]:
    state = torch.load(run_dir / "checkpoints" / "rank0" / f"step-{MAX_STEPS:07d}.pt",
                       map_location="cpu", weights_only=True)
    return state["model"]


@pytest.mark.parametrize("example", sorted(EXAMPLES))
def test_each_example_is_launched_from_dagster_reclaimed_and_resumed_bit_identical(
        example, tmp_path, monkeypatch):
    for module in EXAMPLES[example]:
        pytest.importorskip(module)
    folder = ROOT / "examples" / example
    project = load_project_file(folder / "trainwise.toml")
    [(name, job)] = project.jobs.items()
    # A slower job (its own --step-sleep-s), so the reclaim lands between its first and last
    # step on this machine, whatever its speed.
    slowed = dataclasses.replace(job, args=(*job.args, "--step-sleep-s", "0.1"))
    project = dataclasses.replace(project, jobs=MappingProxyType({name: slowed}))
    monkeypatch.setattr(gang, "provider_for_run", _provider)
    home = tmp_path / "home"
    monkeypatch.setenv("TRAINWISE_HOME", str(home))
    resources = {"state": StateResource(home=str(home)),
                 "object_store": ObjectStoreResource(local_root=str(tmp_path / "store")),
                 "mlflow": MLflowResource(tracking_uri=f"sqlite:///{tmp_path}/mlflow.db")}
    shards = data_shards_asset(partitions_for(project), project.datasets)
    assert dg.materialize([shards], partition_key=job.dataset, resources=resources).success
    [asset] = user_job_defs(project, shards)["assets"]

    result = dg.materialize(
        [shards.to_source_asset(), asset], resources=resources,
        run_config={"ops": {"user_job_run": {"config": {
            "job": name, "run_id": f"{example}-1", "seed": 3, "checkpoint_every_steps": 10}}}})
    assert result.success
    [materialization] = result.asset_materializations_for_node("user_job_run")
    meta = {k: v.value for k, v in materialization.metadata.items()}
    assert meta["status"] == "completed" and meta["reclaims"] == 1 and meta["cost_usd"] > 0
    segments = meta["segments"]
    assert [s["returncode"] for s in segments] == [143, 0], segments
    assert 0 < segments[0]["step"] < MAX_STEPS
    log = Path(segments[1]["log"]).read_text()
    assert f"resumed True at step {segments[0]['step']}" in log  # from the store: disk empty

    # The reference: the same job and spec (the levers its framework can apply), one start.
    reference_dir = tmp_path / "reference"
    spec = spec_for_framework(job, RunSpec(
        run_id="reference", run_dir=str(reference_dir), seed=3, checkpoint_every_steps=10,
        dataset_dir=str(home / "shards" / job.dataset)))
    spec_path = write_spec(spec, tmp_path / "reference.json")
    done = subprocess.run([sys.executable, str(job.script), *job.args], cwd=folder,
                          env=job_env(folder, spec_path), capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]

    launched = _final_model(home / "runs" / f"{example}-1")
    reference = _final_model(reference_dir)
    assert launched.keys() == reference.keys()
    for key, tensor in reference.items():
        assert torch.equal(launched[key], tensor), f"{example}: weight {key} differs"
