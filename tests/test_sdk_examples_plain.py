"""The plain-loop example project (`examples/plain_loop/`) under trainwise, run as a user runs it.

An uninterrupted run is the reference; another is stopped mid-epoch by a real SIGTERM (then by the
notice file), must exit 143 after committing its checkpoint to the object store, and its resume
(from the local folder, or from the store alone) must end with the reference's model, optimizer,
scheduler and data position bit for bit (torch.equal; CPU, one thread in every start).
The example's epoch is 14 batches (216 training rows, batch 16, the last one 8 rows).
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from tests._example_job import ExampleJob, assert_same_weights_and_data, interrupt_twenty_times
from trainwise.user_project import load_project_file

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "plain_loop"
MAX_STEPS = 40


def _job(base: Path) -> ExampleJob:
    return ExampleJob(EXAMPLE / "train.py", base, "plain", max_steps=MAX_STEPS, timeout_s=120.0)


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> dict:
    job = _job(tmp_path_factory.mktemp("plain_reference"))
    lines = job.run_to_end()
    assert lines[0] == "resumed False at step 0" and lines[-1].startswith("finished at step 40")
    assert job.committed_steps() == [10, 20, 30, 40]
    return job.final_state()


def test_project_file_declares_the_dataset_and_the_job():
    project = load_project_file(EXAMPLE / "trainwise.toml")
    job = project.jobs["blobs-classifier"]
    assert job.framework == "plain" and job.script == EXAMPLE / "train.py"
    assert project.datasets[job.dataset].path == EXAMPLE / "data" / "blobs.jsonl"


def test_sigterm_then_local_resume_is_bit_identical(tmp_path, reference):
    job = _job(tmp_path)
    code, stopped_at, _ = job.interrupt(after_step=17, how="sigterm")  # epoch 1, batch 3
    assert code == 143 and job.outcome()["status"] == "preempted"
    assert stopped_at in (18, 19) and stopped_at in job.committed_steps()
    lines = job.run_to_end()
    assert lines[0] == f"resumed True at step {stopped_at}"
    assert_same_weights_and_data(job.final_state(), reference, MAX_STEPS)


def test_notice_file_then_resume_from_the_store_alone_is_bit_identical(tmp_path, reference):
    job = _job(tmp_path)
    code, stopped_at, _ = job.interrupt(after_step=31, how="notice_file")
    assert code == 143 and job.outcome()["status"] == "preempted"
    assert stopped_at in job.committed_steps()
    shutil.rmtree(job.run_dir / "checkpoints")  # a new node: only the store is left
    lines = job.run_to_end()
    assert lines[0] == f"resumed True at step {stopped_at}"
    assert_same_weights_and_data(job.final_state(), reference, MAX_STEPS)


@pytest.mark.slow
def test_twenty_interruptions_at_random_steps_stay_bit_identical(tmp_path, reference):
    """SIGTERM and the notice file in turn at 20 seeded random steps, every third resume from
    the store alone: the run still ends with the reference's weights, bit for bit."""
    job = _job(tmp_path)
    stops = interrupt_twenty_times(job, seed=26)
    assert len(stops) >= 18, stops
    assert_same_weights_and_data(job.final_state(), reference, MAX_STEPS)
