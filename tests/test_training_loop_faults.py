"""The training loop under faults (issue 8): a second trainer on the folder, orphaned temp files,
a corrupt newest checkpoint, a process killed past its checkpoint, a full telemetry disk and a
failing background checkpoint write."""

from __future__ import annotations

import errno
import os
import signal
import socket
from pathlib import Path

import pytest

import telemetry.writer
from telemetry.reader import read_run_events
from tests.test_training_loop import (
    ScriptedPolicy,
    events,
    step_losses,
    text_examples,
    tiny_config,
)
from training import _loop_persist
from training.checkpoint import load_checkpoint
from training.loop import RunFolderLockedError, TrainingStoppedError, train
from training.run_lock import RunFolderLock


class KilledAtStep20(ScriptedPolicy):
    """Kills its own process at step 20 (after that step's record): a lost node."""

    def act(self, observation):
        if observation.step == 20:
            os.kill(os.getpid(), signal.SIGKILL)  # no handler, no flush, no run_end
        return super().act(observation)


def train_in_a_process_killed_at_step_20(out_dir: Path) -> int:
    """A forked trainer (torch is imported already: no 10 s start-up); returns its wait status."""
    pid = os.fork()
    if pid == 0:  # the child never returns into pytest
        try:
            train(tiny_config(checkpoint_every_steps=8), text_examples(), None, out_dir,
                  fast_policy=KilledAtStep20({}))
        finally:
            os._exit(1)
    return os.waitpid(pid, 0)[1]


def run_start_events(out_dir: Path) -> list[dict]:
    return [e for e in read_run_events(out_dir / "telemetry" / "tiny") if e["type"] == "run_start"]


def hold_the_folder_in_another_process(out_dir: Path) -> tuple[int, int]:
    """Forks a process that holds `out_dir`'s lock until its pipe is closed: (pid, pipe fd)."""
    ready_read, ready_write = os.pipe()
    release_read, release_write = os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            os.close(ready_read)
            os.close(release_write)  # else the child's own copy keeps its pipe from closing
            with RunFolderLock(out_dir):
                os.write(ready_write, b"held")
                os.read(release_read, 1)  # returns when the test closes its end
        finally:
            os._exit(0)
    os.close(ready_write)
    os.close(release_read)
    assert os.read(ready_read, 4) == b"held"
    os.close(ready_read)
    return pid, release_write


def test_a_second_trainer_on_the_folder_is_refused_naming_the_holder(tmp_path):
    holder_pid, release = hold_the_folder_in_another_process(tmp_path)
    try:
        with pytest.raises(RunFolderLockedError) as refused:
            train(tiny_config(max_steps=2), text_examples(), None, tmp_path)
        message = str(refused.value)
        assert f"pid {holder_pid}" in message and socket.gethostname() in message
        assert str(tmp_path) in message and "another out_dir" in message
        assert refused.value.holder["pid"] == holder_pid
        assert not (tmp_path / "checkpoints").exists()  # refused before writing anything
    finally:
        os.close(release)
        os.waitpid(holder_pid, 0)
    # The holder is gone: the folder is free again.
    assert train(tiny_config(max_steps=2), text_examples(), None, tmp_path).status == "completed"


def test_temp_files_of_killed_writers_are_removed_at_start(tmp_path):
    folder = tmp_path / "checkpoints"
    folder.mkdir()
    orphans = [folder / ".step-0000010.pt.tmp-99999",
               folder / ".step-0000010.pt.manifest.json.tmp-99999"]
    for orphan in orphans:
        orphan.write_bytes(b"\0" * 1000)
    result = train(tiny_config(max_steps=2), text_examples(), None, tmp_path)
    assert not any(orphan.exists() for orphan in orphans)
    assert result.checkpoint_path.exists()


def test_resume_from_a_folder_falls_back_past_a_corrupt_checkpoint_and_says_so(tmp_path):
    examples = text_examples()
    whole = train(tiny_config(), examples, None, tmp_path / "whole")
    config = tiny_config(checkpoint_every_steps=8)
    first = train(config, examples, None, tmp_path / "run", stop_after_steps=16)
    newest = tmp_path / "run" / "checkpoints" / "step-0000016.pt"
    assert first.checkpoint_path == newest
    data = bytearray(newest.read_bytes())
    data[len(data) // 2] ^= 0xFF  # one flipped byte: the digest no longer matches
    newest.write_bytes(bytes(data))
    with pytest.warns(RuntimeWarning, match="step-0000016.pt"):
        resumed = train(config, examples, None, tmp_path / "run",
                        resume_from=tmp_path / "run" / "checkpoints")
    assert resumed.status == "completed" and resumed.steps == 24
    start = run_start_events(tmp_path / "run")[-1]
    assert start["resumed_from"].endswith("step-0000008.pt")
    (skipped,) = start["skipped_checkpoints"]
    assert skipped["path"].endswith("step-0000016.pt") and skipped["reason"]
    # Steps 9..16 were recorded by the first process and are done again.
    assert (start["replay_from_step"], start["replay_to_step"]) == (8, 16)
    whole_losses = step_losses(whole)
    assert all(e["train_loss"] == whole_losses[e["step"]] for e in events(resumed, "step"))


def test_work_of_a_killed_process_is_billed_and_its_steps_recorded_as_replay(tmp_path):
    status = train_in_a_process_killed_at_step_20(tmp_path)
    assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL
    recorded = [e for e in read_run_events(tmp_path / "telemetry" / "tiny") if e["type"] == "step"]
    assert max(e["step"] for e in recorded) == 20
    killed_elapsed_s = max(e["elapsed_s"] for e in recorded)
    checkpoint_elapsed_s = load_checkpoint(tmp_path / "checkpoints" / "step-0000016.pt")["elapsed_s"]

    # The killed process held the folder's lock: the kernel released it with the process.
    resumed = train(tiny_config(checkpoint_every_steps=8), text_examples(), None, tmp_path,
                    resume_from=tmp_path / "checkpoints")
    assert resumed.status == "completed" and resumed.steps == 24
    start = run_start_events(tmp_path)[-1]
    assert (start["replay_from_step"], start["replay_to_step"]) == (16, 20)
    assert start["lost_s"] == pytest.approx(killed_elapsed_s - checkpoint_elapsed_s)
    assert start["lost_s"] > 0
    # The clock goes on from the killed process's last record, not from the checkpoint's.
    first_new_step = [e for e in events(resumed, "step") if e["wall_time_s"] > start["wall_time_s"]][0]
    assert first_new_step["step"] == 17 and first_new_step["elapsed_s"] > killed_elapsed_s
    assert resumed.elapsed_s > killed_elapsed_s
    assert resumed.cost_usd == pytest.approx(resumed.elapsed_s * 3.06 / 3600)


class TelemetryDiskFull:
    """An `os.write` that fails with ENOSPC for files under `root` after `budget` writes there."""

    def __init__(self, root: Path, budget: int) -> None:
        self.root = str(root)
        self.budget = budget
        self.full = True
        self.real_write = os.write

    def __call__(self, fd: int, data: bytes) -> int:
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            target = ""
        if self.full and target.startswith(self.root):
            if self.budget <= 0:
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
            self.budget -= 1
        return self.real_write(fd, data)


def test_full_telemetry_disk_checkpoints_then_stops_and_the_run_resumes_exactly(
    tmp_path, monkeypatch
):
    examples = text_examples()
    whole = train(tiny_config(), examples, None, tmp_path / "whole")
    out_dir = tmp_path / "run"
    disk = TelemetryDiskFull(out_dir / "telemetry", budget=20)
    monkeypatch.setattr(telemetry.writer, "_write_fd", disk)  # the writer's one append call
    with pytest.raises(TrainingStoppedError, match="Free disk space") as stopped:
        train(tiny_config(), examples, None, out_dir)
    message = str(stopped.value)
    assert str(out_dir / "telemetry" / "tiny") in message and "resume" in message
    saved = stopped.value.checkpoint_path
    assert saved is not None and saved.exists()
    state = load_checkpoint(saved)
    # The segment stays readable; the checkpoint holds the boundary where the write failed.
    recorded = read_run_events(out_dir / "telemetry" / "tiny")
    last_step = max(e["step"] for e in recorded if e["type"] == "step")
    assert state["step"] in (last_step, last_step + 1) and 0 < state["step"] < 24

    disk.full = False  # space freed
    resumed = train(tiny_config(), examples, None, out_dir, resume_from=out_dir / "checkpoints")
    assert resumed.status == "completed" and resumed.steps == 24
    whole_losses = step_losses(whole)
    assert all(e["train_loss"] == whole_losses[e["step"]] for e in events(resumed, "step"))
    # Only the record whose write failed is missing (its step is in the checkpoint).
    assert set(range(1, 25)) - set(step_losses(resumed)) <= {state["step"]}


def test_a_failed_background_checkpoint_write_fails_the_run_and_is_recorded(tmp_path, monkeypatch):
    real_save = _loop_persist.save_checkpoint

    def save(path, state):
        if state["step"] == 8:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))
        return real_save(path, state)

    monkeypatch.setattr(_loop_persist, "save_checkpoint", save)
    with pytest.raises(OSError, match="No space left"):
        train(tiny_config(checkpoint_every_steps=4), text_examples(), None, tmp_path)
    ends = [e for e in read_run_events(tmp_path / "telemetry" / "tiny") if e["type"] == "run_end"]
    assert ends[-1]["status"] == "failed" and "step-0000008.pt" in ends[-1]["error"]
    assert ends[-1]["checkpoint_path"].endswith("step-0000004.pt")  # the newest durable one


def test_records_written_before_the_new_fields_still_parse():
    from telemetry.events import CheckpointEvent, RunStartEvent, event_from_record

    start = event_from_record({
        "type": "run_start", "schema_version": 1, "run_id": "r", "rank": 0, "step": 0,
        "wall_time_s": 1.0, "model_kind": "gpt", "model_config": {}, "model_fingerprint": "f",
        "train_config": {}, "data_fingerprint": "d", "curriculum_version": None,
        "instance_type": "local", "price_usd_per_hour": 0.0,
    })
    assert isinstance(start, RunStartEvent)
    assert (start.replay_from_step, start.replay_to_step, start.lost_s) == (None, None, None)
    assert start.skipped_checkpoints == []
    saved = event_from_record({
        "type": "checkpoint", "schema_version": 1, "run_id": "r", "rank": 0, "step": 4,
        "wall_time_s": 1.0, "path": "p", "sha256": "0", "size_bytes": 1, "save_ms": 2.0,
        "reason": "interval",
    })
    assert isinstance(saved, CheckpointEvent) and saved.persist_ms is None
    assert saved.asynchronous is False
