"""One start after another of an `examples/` project, run as a user runs it: a child process per
start, stopped by a real SIGTERM, the node agent's notice file or SIGKILL at a step it printed.

Shared by the resume checks of the plain loop, the HF Trainer and the Lightning examples, whose
scripts take the same arguments (--run-id --run-dir --store-root --notice-file --max-steps
--checkpoint-every-steps --step-sleep-s) and print "resumed <bool> at step <n>" at start and a
line starting "step <n>" after each optimizer step.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
STEP_SLEEP_S = 0.1  # an interrupted start sleeps after each step, so a signal lands mid-run


def child_env() -> dict[str, str]:
    """This environment, one CPU thread (a bit-identical resume needs the same count in every
    start), nothing reaching a hub, no launcher's spec (the arguments name the run)."""
    env = dict(os.environ)
    env["OMP_NUM_THREADS"] = env["MKL_NUM_THREADS"] = "1"
    env["HF_HUB_OFFLINE"] = env["HF_DATASETS_OFFLINE"] = "1"
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    env.pop("TRAINWISE_RUN_SPEC", None)
    return env


def _is_step_line(line: str, step: int) -> bool:
    words = line.split()
    return len(words) >= 2 and words[0] == "step" and words[1] == str(step)


class ExampleJob:
    """One run of an example: its folders, and a start (child process) at a time."""

    def __init__(self, script: Path, base: Path, run_id: str, *, max_steps: int = 40,
                 extra: tuple[str, ...] = (), timeout_s: float = 180.0) -> None:
        self.script, self.run_id, self.extra = script, run_id, extra
        self.max_steps, self.timeout_s = max_steps, timeout_s
        self.run_dir, self.store = base / "run", base / "store"
        self.notice_file = base / "notice"

    def args(self, sleep_s: float) -> list[str]:
        return [sys.executable, str(self.script), "--run-id", self.run_id, "--run-dir",
                str(self.run_dir), "--store-root", str(self.store), "--notice-file",
                str(self.notice_file), "--max-steps", str(self.max_steps),
                "--checkpoint-every-steps", "10", "--step-sleep-s", str(sleep_s), *self.extra]

    def run_to_end(self) -> list[str]:
        done = subprocess.run(self.args(0.0), env=child_env(), capture_output=True, text=True,
                              timeout=self.timeout_s)
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
        return done.stdout.splitlines()

    def interrupt(self, after_step: int, *, how: str = "sigterm") -> tuple[int, int, list[str]]:
        """Starts the job, waits for its line of step `after_step` (or for its start when it
        resumes past that step), sends the notice (`sigterm`, `notice_file`) or `sigkill`, and
        returns (exit code, the step its outcome says it stopped at or -1, stdout lines)."""
        process = subprocess.Popen(self.args(STEP_SLEEP_S), env=child_env(),
                                   stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                   bufsize=1)
        lines: list[str] = []
        deadline = time.monotonic() + self.timeout_s
        assert process.stdout is not None
        for line in process.stdout:
            lines.append(line.rstrip("\n"))
            if time.monotonic() > deadline:
                break
            resumed_past = line.startswith("resumed ") and int(line.split()[-1]) >= after_step
            if _is_step_line(line, after_step) or resumed_past:
                if how == "sigterm":
                    process.send_signal(signal.SIGTERM)
                elif how == "sigkill":
                    process.kill()
                else:
                    self.notice_file.write_text("reclaim\n")
                break
        else:
            pytest.fail("the job ended before the step to interrupt at:\n" + "\n".join(lines))
        rest, _ = process.communicate(timeout=self.timeout_s)
        lines += rest.splitlines()
        outcome = self.outcome() if (self.run_dir / "outcome-rank0.json").exists() else {}
        if self.notice_file.exists():
            self.notice_file.unlink()  # the node agent's file is gone on the next node
        return process.returncode, int(outcome.get("step", -1)), lines

    def outcome(self) -> dict:
        return json.loads((self.run_dir / "outcome-rank0.json").read_text())

    def final_state(self) -> dict:
        path = self.run_dir / "checkpoints" / "rank0" / f"step-{self.max_steps:07d}.pt"
        return torch.load(path, map_location="cpu", weights_only=True)

    def committed_steps(self) -> list[int]:
        folder = self.store / "runs" / self.run_id / "checkpoints" / "rank0"
        return sorted(int(p.name[5:12]) for p in folder.glob("step-*.pt.commit"))


def assert_same_weights_and_data(resumed: dict, baseline: dict, max_steps: int = 40) -> None:
    """Model, optimizer, scheduler and data position equal bit for bit (torch.equal)."""
    assert resumed["step"] == baseline["step"] == max_steps
    for name, tensor in baseline["model"].items():
        assert torch.equal(resumed["model"][name], tensor), f"model weight {name} differs"
    for index, group in baseline["optimizer"]["state"].items():
        for key, value in group.items():
            other = resumed["optimizer"]["state"][index][key]
            assert torch.equal(torch.as_tensor(other), torch.as_tensor(value)), \
                f"optimizer state {index}.{key} differs"
    assert resumed["scheduler"] == baseline["scheduler"]
    assert resumed["sampler"] == baseline["sampler"]


def interrupt_twenty_times(job: ExampleJob, seed: int) -> list[int]:
    """One run stopped 20 times at steps drawn at random (seeded, so a failure replays), by
    SIGTERM and by the notice file in turn, every third resume from the store alone (the local
    checkpoints deleted, as on a new node); then run to its end. Returns the steps stopped at."""
    draw = random.Random(seed)
    targets = sorted(draw.sample(range(1, job.max_steps - 1), 20))
    stops = []
    for number, target in enumerate(targets):
        how = "sigterm" if number % 2 == 0 else "notice_file"
        code, stopped_at, lines = job.interrupt(after_step=target, how=how)
        if job.outcome()["status"] == "completed":  # the notice came after the last step
            break
        assert code == 143, "\n".join(lines[-30:])
        assert stopped_at in job.committed_steps()
        stops.append(stopped_at)
        if number % 3 == 2:
            shutil.rmtree(job.run_dir / "checkpoints")
    if job.outcome()["status"] != "completed":
        job.run_to_end()
    return stops
