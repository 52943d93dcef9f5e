"""The Hugging Face Trainer example (`examples/hf_trainer/`) as a registered job of its project
file, launched through `trainwise.user_jobs.UserJobLaunch` on the emulated provider's node.

Its dataset is sharded as the `data_shards` partition would be (`build_user_shards`) and the job
reads it through `run.dataset()`. A reclaim from the replayed market SIGTERMs the job a few steps
in; the Trainer callback checkpoints to the object store and the job exits 143; the node is
replaced (spot refused: on-demand), the job restarts on an empty disk, resumes from the store,
and ends with the weights, optimizer, scheduler, data position and Trainer state of a run of the
same spec that met no notice, bit for bit."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("accelerate")

from cloud import emulated as replay  # noqa: E402
from cloud.providers.emulated import EmulatedProvider  # noqa: E402
from training.user_datasets import build_user_shards  # noqa: E402
from trainwise import gang  # noqa: E402
from trainwise.sdk.spec import RunSpec, write_spec  # noqa: E402
from trainwise.user_jobs import UserJobLaunch, job_env  # noqa: E402
from trainwise.user_project import load_project_file  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "hf_trainer"
JOB = "shakespeare-char-lm"
ZONE, INSTANCE = "us-east-1a", "p3.2xlarge"
MAX_STEPS = 40
# The Trainer sizes its epochs once, so the fast layer's batch lever cannot apply: a launcher
# leaves it out of a hf_trainer job's spec (a spec that asks for it is refused at init).
LEVERS = ("preemption",)


def _provider(available: list[int], seconds_per_tick: float) -> EmulatedProvider:
    market = replay.ReplayMarket(ZONE, INSTANCE, 195, np.asarray(available, dtype=np.int64), 0,
                                 "test window", 0.918, 3.06, "test")
    return EmulatedProvider([market], replay.ReplayClock(195.0, seconds_per_tick),
                            replay.default_rules())


def _final(run_dir: Path) -> dict:
    return torch.load(run_dir / "checkpoints" / "rank0" / f"step-{MAX_STEPS:07d}.pt",
                      map_location="cpu", weights_only=True)


def test_the_project_file_registers_the_hf_trainer_job():
    project = load_project_file(EXAMPLE / "trainwise.toml")
    job = project.jobs[JOB]
    assert job.framework == "hf_trainer" and job.script == EXAMPLE / "train.py"
    dataset = project.datasets[job.dataset]
    assert dataset.path == EXAMPLE / "data" / "passages.jsonl" and dataset.text_column == "text"
    assert dataset.path.stat().st_size < 50_000


def test_the_hf_trainer_job_survives_a_reclaim_and_resumes_from_the_store_bit_identical(
        tmp_path):
    project = load_project_file(EXAMPLE / "trainwise.toml")
    job = project.jobs[JOB]
    shards = tmp_path / "shards" / job.dataset
    build_user_shards(project.datasets[job.dataset], shards)

    # The reference: the same spec, one start, no notice.
    reference_dir = tmp_path / "ref"
    spec_path = write_spec(RunSpec(run_id="ref", run_dir=str(reference_dir), seed=2,
                                   fast_levers=LEVERS, dataset_dir=str(shards)),
                           tmp_path / "ref.json")
    done = subprocess.run([sys.executable, str(job.script), *job.args], cwd=EXAMPLE,
                          env=job_env(EXAMPLE, spec_path), capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    assert f"finished at step {MAX_STEPS}" in done.stdout

    # Spot capacity 1, then 0 from tick 4: the node is reclaimed a few steps in; the
    # replacement's spot launch is refused and it comes up on-demand.
    run_dir = tmp_path / "runs" / "hf-run"
    session = gang.GangSession(_provider([1] * 4 + [0] * 10_000, seconds_per_tick=0.3),
                               gang.Allocation(market="spot", zone=ZONE, nodes=1, reason="test",
                                               source="test"), INSTANCE, run_dir, "hf-run")
    spec = RunSpec(run_id="hf-run", run_dir=str(run_dir), seed=2, fast_levers=LEVERS,
                   store_root=str(tmp_path / "store"), dataset_dir=str(shards))
    slowed = dataclasses.replace(job, args=(*job.args, "--step-sleep-s", "0.1"))
    result = UserJobLaunch(slowed, EXAMPLE, session, spec).run()

    assert result["status"] == "completed", result["failure"]
    assert result["reclaims"] == 1
    assert [segment["returncode"] for segment in result["segments"]] == [143, 0]
    stopped_at = result["segments"][0]["step"]
    assert 0 < stopped_at < MAX_STEPS
    assert result["cost_usd"] > 0
    assert any("on-demand" in fallback for fallback in gang.read_gang(run_dir)["fallbacks"])
    committed = sorted((tmp_path / "store" / "runs" / "hf-run" / "checkpoints" / "rank0")
                       .glob("step-*.pt.commit"))
    assert f"step-{stopped_at:07d}.pt.commit" in [path.name for path in committed]
    log = Path(result["segments"][1]["log"]).read_text()
    assert f"resumed True at step {stopped_at}" in log  # from the store: the disk was empty

    launched, reference = _final(run_dir), _final(reference_dir)
    for name, tensor in reference["model"].items():
        assert torch.equal(launched["model"][name], tensor), f"model weight {name} differs"
    for index, state in reference["optimizer"]["state"].items():
        for key, value in state.items():
            assert torch.equal(torch.as_tensor(launched["optimizer"]["state"][index][key]),
                               torch.as_tensor(value)), f"optimizer state {index}.{key}"
    assert launched["scheduler"] == reference["scheduler"]
    assert launched["sampler"] == reference["sampler"]
    assert launched["data_fingerprint"] == reference["data_fingerprint"]
    progress = [{key: state["kept_state"]["hf_trainer"]["trainer_state"][key]
                 for key in ("global_step", "epoch", "total_flos")}
                for state in (launched, reference)]
    assert progress[0] == progress[1] and progress[0]["global_step"] == MAX_STEPS
