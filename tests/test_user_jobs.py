"""A registered job of a team's project file launched on the emulated provider's nodes
(trainwise.user_jobs): a reclaim from the replayed market SIGTERMs the job, the SDK checkpoints
to the object store and exits 143, the node is replaced (spot refused: on-demand), the job
restarts on an empty disk and resumes from the store, and it ends with the weights of a run that
met no notice (bit for bit: the checkpoint holds the model, optimizer, RNG and data position).
Bad entries and jobs that never report are refused with the fix."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from cloud import emulated as replay
from cloud.providers.emulated import EmulatedProvider
from trainwise import gang
from trainwise.sdk.spec import RunSpec, write_spec
from trainwise.user_jobs import UserJobError, UserJobLaunch, job_env, preflight, registered_job
from trainwise.user_project import load_project_file

torch.set_num_threads(1)
ZONE, INSTANCE = "us-east-1a", "p3.2xlarge"

TRAIN = """
import sys, time, torch, trainwise
torch.set_num_threads(1)
torch.manual_seed(0)
x = torch.randn(160, 6)
data = torch.utils.data.TensorDataset(x, x.sum(1, keepdim=True))
run = trainwise.init()
loader = run.dataloader(data, batch_size=8)
model = torch.nn.Sequential(torch.nn.Linear(6, 12), torch.nn.Tanh(), torch.nn.Linear(12, 1))
optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
model, optimizer = run.track(model, optimizer)
while not run.done:
    for xb, yb in loader:
        loss = torch.nn.functional.mse_loss(model(xb), yb)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        run.step(loss=loss)
        time.sleep(float(sys.argv[2]))
        if run.done:
            break
run.finish()
torch.save(model.state_dict(), sys.argv[1])
"""

SILENT = """
import time, trainwise
run = trainwise.init()
time.sleep(60)
"""


def _project(tmp_path: Path, jobs: str) -> Path:
    folder = tmp_path / "team"
    folder.mkdir()
    (folder / "train.py").write_text(TRAIN)
    (folder / "silent.py").write_text(SILENT)
    (folder / "rows.jsonl").write_text('{"id": 1, "text": "a"}\n{"id": 2, "text": "b"}\n')
    (folder / "trainwise.toml").write_text(
        '[datasets.rows]\npath = "rows.jsonl"\nid_column = "id"\n\n' + jobs)
    return folder / "trainwise.toml"


def _provider(available: list[int], seconds_per_tick: float) -> EmulatedProvider:
    market = replay.ReplayMarket(ZONE, INSTANCE, 195, np.asarray(available, dtype=np.int64), 0,
                                 "test window", 0.918, 3.06, "test")
    return EmulatedProvider([market], replay.ReplayClock(195.0, seconds_per_tick),
                            replay.default_rules())


def _launch(tmp_path, job, cloud, run_id="team-run", **options) -> UserJobLaunch:
    run_dir = tmp_path / "runs" / run_id
    session = gang.GangSession(cloud, gang.Allocation(market="spot", zone=ZONE, nodes=1,
                                                      reason="test", source="test"),
                               INSTANCE, run_dir, run_id)
    spec = RunSpec(run_id=run_id, run_dir=str(run_dir), max_steps=40, seed=2,
                   checkpoint_every_steps=15, store_root=str(tmp_path / "store"))
    return UserJobLaunch(job, tmp_path / "team", session, spec, **options)


def test_a_reclaim_is_answered_and_the_job_resumes_from_the_store_bit_identical(tmp_path):
    project = load_project_file(_project(tmp_path, (
        '[jobs.fit]\nentry = "train.py"\ndataset = "rows"\nargs = ["{out}", "0.05"]\n')))
    reference = tmp_path / "reference.pt"
    spec_path = write_spec(RunSpec(run_id="ref", run_dir=str(tmp_path / "ref"), max_steps=40,
                                   seed=2, checkpoint_every_steps=15), tmp_path / "ref.json")
    done = subprocess.run([sys.executable, str(project.jobs["fit"].script), str(reference), "0"],
                          env=job_env(tmp_path / "team", spec_path), capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr

    job = project.jobs["fit"]
    weights = tmp_path / "launched.pt"
    job = dataclasses.replace(job, args=(str(weights), "0.05"))
    # Spot capacity 1, then 0 from tick 4: the node is reclaimed a few steps in; the replacement's
    # spot launch is refused and it comes up on-demand.
    launch = _launch(tmp_path, job, _provider([1] * 4 + [0] * 10_000, seconds_per_tick=0.3))
    result = launch.run()
    assert result["status"] == "completed", result["failure"]
    assert result["reclaims"] == 1
    codes = [segment["returncode"] for segment in result["segments"]]
    assert codes == [143, 0]
    assert 0 < result["segments"][0]["step"] < 40
    assert result["cost_usd"] > 0
    record = gang.read_gang(launch.run_dir)
    assert any("on-demand" in fallback for fallback in record["fallbacks"])
    left = torch.load(reference, weights_only=True)
    right = torch.load(weights, weights_only=True)
    for key in left:
        assert torch.equal(left[key], right[key]), key


def test_an_entry_point_that_does_not_import_is_refused_before_a_node_is_launched(tmp_path):
    project = load_project_file(_project(tmp_path, (
        '[jobs.broken]\nentry = "team_code.train:main"\ndataset = "rows"\n')))
    (tmp_path / "team" / "team_code").mkdir()
    (tmp_path / "team" / "team_code" / "__init__.py").write_text("")
    (tmp_path / "team" / "team_code" / "train.py").write_text("import not_installed_pkg\n")
    with pytest.raises(UserJobError, match="does not import.*not_installed_pkg.*nothing was"):
        preflight(project.jobs["broken"], tmp_path / "team", None)
    (tmp_path / "team" / "team_code" / "train.py").write_text("def other():\n    pass\n")
    with pytest.raises(UserJobError, match="no callable 'main'"):
        preflight(project.jobs["broken"], tmp_path / "team", None)
    (tmp_path / "team" / "team_code" / "train.py").write_text("def main():\n    pass\n")
    preflight(project.jobs["broken"], tmp_path / "team", None)


def test_a_script_with_a_syntax_error_and_a_dataset_without_shards_are_refused(tmp_path):
    project = load_project_file(_project(tmp_path, (
        '[jobs.fit]\nentry = "train.py"\ndataset = "rows"\n')))
    with pytest.raises(UserJobError, match="materialize data_shards for partition 'rows'"):
        preflight(project.jobs["fit"], tmp_path / "team", tmp_path / "shards" / "rows")
    (tmp_path / "team" / "train.py").write_text("def broken(:\n")
    with pytest.raises(UserJobError, match="does not compile"):
        preflight(project.jobs["fit"], tmp_path / "team", None)


def test_a_job_that_never_calls_step_is_stopped_with_the_fix(tmp_path):
    project = load_project_file(_project(tmp_path, (
        '[jobs.silent]\nentry = "silent.py"\ndataset = "rows"\n')))
    launch = _launch(tmp_path, project.jobs["silent"], _provider([1] * 10_000, 0.3),
                     first_step_timeout_s=4.0)
    result = launch.run()
    assert result["status"] == "failed"
    assert "called run.step() not once in 4 s" in result["failure"]
    assert result["segments"][0]["returncode"] != 0  # it was killed, not left running


def test_an_unknown_job_name_lists_the_registered_ones(tmp_path):
    project = load_project_file(_project(tmp_path, (
        '[jobs.fit]\nentry = "train.py"\ndataset = "rows"\n')))
    with pytest.raises(UserJobError, match="registered: fit"):
        registered_job(project, "fitt")
