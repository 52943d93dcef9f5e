"""The plain-loop example project (`examples/plain_loop/`) under trainwise, run as a user runs it.

An uninterrupted run is the reference; another is stopped mid-epoch by a real SIGTERM (then by the
notice file), must exit 143 after committing its checkpoint to the object store, and its resume
(from the local folder, or from the store alone) must end with the reference's model, optimizer,
scheduler and data position bit for bit (torch.equal; CPU, one thread in every start).
The example's epoch is 14 batches (216 training rows, batch 16, the last one 8 rows).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from trainwise.user_project import load_project_file

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "plain_loop"
MAX_STEPS = 40
TIMEOUT_S = 120.0


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["OMP_NUM_THREADS"] = env["MKL_NUM_THREADS"] = "1"
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    env.pop("TRAINWISE_RUN_SPEC", None)
    return env


def _args(base: Path, sleep_s: float) -> list[str]:
    return [sys.executable, str(EXAMPLE / "train.py"), "--run-id", "plain", "--run-dir",
            str(base / "run"), "--store-root", str(base / "store"), "--notice-file",
            str(base / "notice"), "--max-steps", str(MAX_STEPS), "--checkpoint-every-steps",
            "10", "--step-sleep-s", str(sleep_s)]


def _run_to_end(base: Path) -> list[str]:
    done = subprocess.run(_args(base, 0.0), env=_env(), capture_output=True, text=True,
                          timeout=TIMEOUT_S)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return done.stdout.splitlines()


def _interrupt(base: Path, after_step: int, how: str) -> tuple[int, int]:
    """Starts the job, sends the notice once its line `step <after_step>` shows; returns the
    exit code and the step its outcome says it stopped at."""
    process = subprocess.Popen(_args(base, 0.1), env=_env(), stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT, text=True, bufsize=1)
    assert process.stdout is not None
    deadline = time.monotonic() + TIMEOUT_S
    for line in process.stdout:
        if line.strip() == f"step {after_step}" or time.monotonic() > deadline:
            if how == "sigterm":
                process.send_signal(signal.SIGTERM)
            else:
                (base / "notice").write_text("reclaim\n")
            break
    process.communicate(timeout=TIMEOUT_S)
    (base / "notice").unlink(missing_ok=True)
    outcome = json.loads((base / "run" / "outcome-rank0.json").read_text())
    assert outcome["status"] == "preempted", outcome
    return process.returncode, int(outcome["step"])


def _final(base: Path) -> dict:
    return torch.load(base / "run" / "checkpoints" / "rank0" / f"step-{MAX_STEPS:07d}.pt",
                      map_location="cpu", weights_only=True)


def _committed(base: Path) -> list[int]:
    folder = base / "store" / "runs" / "plain" / "checkpoints" / "rank0"
    return sorted(int(p.name[5:12]) for p in folder.glob("step-*.pt.commit"))


def _assert_same(resumed: dict, reference: dict) -> None:
    assert resumed["step"] == reference["step"] == MAX_STEPS
    for name, tensor in reference["model"].items():
        assert torch.equal(resumed["model"][name], tensor), f"model weight {name} differs"
    for index, state in reference["optimizer"]["state"].items():
        for key, value in state.items():
            assert torch.equal(torch.as_tensor(resumed["optimizer"]["state"][index][key]),
                               torch.as_tensor(value)), f"optimizer state {index}.{key}"
    assert resumed["scheduler"] == reference["scheduler"]
    assert resumed["sampler"] == reference["sampler"]


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> dict:
    base = tmp_path_factory.mktemp("plain_reference")
    lines = _run_to_end(base)
    assert lines[0] == "resumed False at step 0" and lines[-1].startswith("finished at step 40")
    assert _committed(base) == [10, 20, 30, 40]
    return _final(base)


def test_project_file_declares_the_dataset_and_the_job():
    project = load_project_file(EXAMPLE / "trainwise.toml")
    job = project.jobs["blobs-classifier"]
    assert job.framework == "plain" and job.script == EXAMPLE / "train.py"
    assert project.datasets[job.dataset].path == EXAMPLE / "data" / "blobs.jsonl"


def test_sigterm_then_local_resume_is_bit_identical(tmp_path, reference):
    code, stopped_at = _interrupt(tmp_path, after_step=17, how="sigterm")  # epoch 1, batch 3
    assert code == 143
    assert stopped_at in (18, 19) and stopped_at in _committed(tmp_path)
    lines = _run_to_end(tmp_path)
    assert lines[0] == f"resumed True at step {stopped_at}"
    _assert_same(_final(tmp_path), reference)


def test_notice_file_then_resume_from_the_store_alone_is_bit_identical(tmp_path, reference):
    code, stopped_at = _interrupt(tmp_path, after_step=31, how="notice_file")
    assert code == 143 and stopped_at in _committed(tmp_path)
    shutil.rmtree(tmp_path / "run" / "checkpoints")  # a new node: only the store is left
    lines = _run_to_end(tmp_path)
    assert lines[0] == f"resumed True at step {stopped_at}"
    _assert_same(_final(tmp_path), reference)
