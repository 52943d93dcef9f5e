"""A run folder someone else also writes (issue 31, classes 2, 6, 7, 8): planted links at the
names the trainer writes, a lock file deleted or a folder replaced while a trainer holds it, the
work a kill loses with a background save in flight, and names, settings and SIGTERM at the edges.

Each test plants the hazard, calls the real function and checks that nothing outside the run
folder changed (a sentinel file) and that the refusal names the path.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import shutil
import stat
import subprocess
import sys
import threading
from argparse import Namespace
from pathlib import Path

import pytest
import torch

from telemetry.writer import SegmentWriter, TelemetryFolderError, rank_dir
from tests.test_training_loop import ScriptedPolicy, text_examples, tiny_config
from training import _loop_persist, run_lock
from training.consumption import ConsumptionWriter
from training.loop import train
from training.run_lock import (
    LOCK_NAME,
    RunFolderLock,
    RunFolderLockedError,
    RunFolderReplacedError,
)
from training.safe_files import UnsafeStatePathError
from trainwise import cli, emulated_worker, settings

torch.set_num_threads(1)
ROOT = Path(__file__).resolve().parents[1]
SENTINEL = b"a file outside the run folder that no trainer may change\n"


@pytest.fixture
def outside(tmp_path) -> Path:
    """A sentinel file beside (not inside) the run folder."""
    path = tmp_path / "outside" / "sentinel.txt"
    path.parent.mkdir()
    path.write_bytes(SENTINEL)
    return path


def step_event(run_id: str, step: int) -> dict:
    return {"type": "step", "run_id": run_id, "rank": 0, "step": step}


# --- class 2: writes must not follow links out of the run folder -----------------------------
@pytest.mark.parametrize("link", ["symlink", "hardlink"])
def test_a_linked_lock_record_is_replaced_not_written_through(tmp_path, outside, link):
    run = tmp_path / "run"
    run.mkdir()
    planted = run / LOCK_NAME
    os.symlink(outside, planted) if link == "symlink" else os.link(outside, planted)
    with RunFolderLock(run):
        assert outside.read_bytes() == SENTINEL
        assert not planted.is_symlink() and json.loads(planted.read_text())["pid"] == os.getpid()


def test_a_linked_lock_record_pointing_inside_the_folder_leaves_its_target_alone(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    keep = run / "notes.txt"
    keep.write_bytes(b"mine\n")
    os.symlink(keep, run / LOCK_NAME)
    with RunFolderLock(run):
        assert keep.read_bytes() == b"mine\n"


def test_the_marker_temp_name_is_not_predictable(tmp_path, outside):
    rank0 = tmp_path / "telemetry" / "r1" / "rank0"
    rank0.mkdir(parents=True)
    os.symlink(outside, rank0 / ".segment-00000.complete.tmp")  # the old fixed temp name
    with SegmentWriter(tmp_path / "telemetry", "r1", events_per_segment=2) as writer:
        writer.write(step_event("r1", 1))
        writer.write(step_event("r1", 2))  # rolls: the marker of segment 0 is written
    assert outside.read_bytes() == SENTINEL
    assert json.loads((rank0 / "segment-00000.complete").read_text())["lines"] == 2


def test_a_linked_marker_is_replaced_not_written_through(tmp_path, outside):
    rank0 = tmp_path / "telemetry" / "r1" / "rank0"
    rank0.mkdir(parents=True)
    os.symlink(outside, rank0 / "segment-00000.complete")
    with SegmentWriter(tmp_path / "telemetry", "r1") as writer:
        writer.write(step_event("r1", 1))
    assert outside.read_bytes() == SENTINEL
    assert not (rank0 / "segment-00000.complete").is_symlink()


def test_a_linked_segment_is_refused_not_read(tmp_path, outside):
    rank0 = tmp_path / "telemetry" / "r1" / "rank0"
    rank0.mkdir(parents=True)
    os.symlink(outside, rank0 / "segment-00000.jsonl")
    with pytest.raises(TelemetryFolderError, match="segment-00000.jsonl is a symbolic link"):
        SegmentWriter(tmp_path / "telemetry", "r1")
    assert outside.read_bytes() == SENTINEL


def test_a_run_telemetry_folder_linked_outside_is_refused(tmp_path, outside):
    (tmp_path / "telemetry").mkdir()
    os.symlink(outside.parent, tmp_path / "telemetry" / "r1")
    with pytest.raises(TelemetryFolderError, match="outside"):
        SegmentWriter(tmp_path / "telemetry", "r1")
    assert sorted(p.name for p in outside.parent.iterdir()) == ["sentinel.txt"]


@pytest.mark.parametrize("link", ["symlink", "hardlink", "inside"])
def test_a_linked_consumption_record_is_refused(tmp_path, outside, link):
    path = tmp_path / "telemetry" / "r1" / "consumption.jsonl"
    path.parent.mkdir(parents=True)
    target = outside
    if link == "inside":
        target = path.parent / "other.jsonl"
        target.write_bytes(SENTINEL)
    os.link(target, path) if link == "hardlink" else os.symlink(target, path)
    with pytest.raises(UnsafeStatePathError, match="consumption.jsonl"):
        ConsumptionWriter(path, start_step=0)
    assert target.read_bytes() == SENTINEL


def test_a_fifo_at_the_consumption_record_is_refused_without_blocking(tmp_path):
    path = tmp_path / "telemetry" / "r1" / "consumption.jsonl"
    path.parent.mkdir(parents=True)
    os.mkfifo(path)
    reader = os.open(path, os.O_RDONLY | os.O_NONBLOCK)  # so the old code would not hang
    try:
        with pytest.raises(UnsafeStatePathError, match="not a regular file"):
            ConsumptionWriter(path, start_step=0)
    finally:
        os.close(reader)


@pytest.mark.parametrize("folder", ["checkpoints", "telemetry"])
def test_a_state_folder_linked_outside_the_run_folder_is_refused(tmp_path, outside, folder):
    run = tmp_path / "run"
    run.mkdir()
    os.symlink(outside.parent, run / folder)
    with pytest.raises(UnsafeStatePathError, match=f"{folder}.*outside the run folder"):
        RunFolderLock(run).acquire()
    (run / folder).unlink()
    with RunFolderLock(run):  # the refused acquire let go of the folder
        pass
    assert sorted(p.name for p in outside.parent.iterdir()) == ["sentinel.txt"]


@pytest.mark.parametrize("planted", ["temp", "result"])
def test_the_worker_result_is_written_without_following_a_planted_link(tmp_path, outside,
                                                                        planted):
    result = tmp_path / "result.json"
    os.symlink(outside, tmp_path / ".result.json.tmp" if planted == "temp" else result)
    emulated_worker.write_json_atomic(result, {"status": "completed"})
    assert outside.read_bytes() == SENTINEL
    assert json.loads(result.read_text()) == {"status": "completed"}


# --- class 6: the lock must survive a clean-up of its file -------------------------------------
def test_deleting_the_lock_file_does_not_let_a_second_trainer_in(tmp_path):
    with RunFolderLock(tmp_path):
        (tmp_path / LOCK_NAME).unlink()  # a careless clean-up
        with pytest.raises(RunFolderLockedError, match="in use by another trainer") as refused:
            RunFolderLock(tmp_path).acquire()
        # The record is gone, not the lock; the holder is then named from the kernel's table.
        expected = f"pid {os.getpid()}" if os.access("/proc/locks", os.R_OK) \
            else "missing or unreadable"
        assert expected in str(refused.value)


def test_a_trainer_is_refused_when_the_holders_lock_file_was_deleted(tmp_path):
    """A second `train()` on a folder whose holder lost its `.run.lock` file: refused before it
    writes anything, so nothing is trained or billed twice."""
    ready_read, ready_write = os.pipe()
    release_read, release_write = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child holds the folder and never returns to pytest
        try:
            os.close(ready_read)
            os.close(release_write)
            with RunFolderLock(tmp_path):
                os.write(ready_write, b"held")
                os.read(release_read, 1)
        finally:
            os._exit(0)
    os.close(ready_write)
    os.close(release_read)
    try:
        assert os.read(ready_read, 4) == b"held"
        (tmp_path / LOCK_NAME).unlink()
        with pytest.raises(RunFolderLockedError):
            train(tiny_config(max_steps=2), text_examples(), None, tmp_path)
        assert not (tmp_path / "checkpoints").exists() and not (tmp_path / "telemetry").exists()
    finally:
        os.close(ready_read)
        os.close(release_write)
        os.waitpid(pid, 0)


def test_where_a_folder_cannot_be_flocked_a_lock_file_is_used_and_checked_by_inode(
        tmp_path, monkeypatch):
    """NFS emulates flock with byte-range locks, which a directory descriptor cannot take."""
    real_flock = fcntl.flock

    def nfs_flock(handle, operation):
        if stat.S_ISDIR(os.fstat(handle).st_mode):
            raise OSError(errno.EBADF, os.strerror(errno.EBADF))
        return real_flock(handle, operation)

    monkeypatch.setattr(run_lock.fcntl, "flock", nfs_flock)
    with RunFolderLock(tmp_path) as lock:
        with pytest.raises(RunFolderLockedError):
            RunFolderLock(tmp_path).acquire()
        lock.check()
        (tmp_path / run_lock.FALLBACK_LOCK_NAME).unlink()  # a clean-up
        with pytest.raises(RunFolderReplacedError, match="without its lock file"):
            lock.check()


@pytest.mark.parametrize("how", ["removed", "replaced"])
def test_a_holder_notices_its_folder_was_removed_or_replaced(tmp_path, how):
    run = tmp_path / "run"
    with RunFolderLock(run) as lock:
        lock.check()  # still the same folder
        if how == "removed":
            shutil.rmtree(run)
        else:
            run.rename(tmp_path / "moved-away")
            run.mkdir()
        with pytest.raises(RunFolderReplacedError, match=f"{how}.*not a full disk"):
            lock.check()
        with pytest.raises(RunFolderReplacedError):
            run_lock.check_folder_of(run / "checkpoints")
    run_lock.check_folder_of(run / "checkpoints")  # released: nothing is held any more


def test_a_checkpoint_into_a_removed_run_folder_says_so_not_free_disk_space(tmp_path):
    run = tmp_path / "run"
    persister = _loop_persist.CheckpointPersister(run / "checkpoints", keep=2)
    with RunFolderLock(run):
        shutil.rmtree(run)
        with pytest.raises(RunFolderReplacedError) as stopped:
            persister.persist_now({"step": 3}, step=3, reason="interval", elapsed_s=1.0,
                                  blocking_s=0.0, snapshot_s=0.0)
    assert "removed" in str(stopped.value) and "disk space" not in str(stopped.value).lower()
    assert not run.exists()  # not recreated under nobody's lock


def test_a_file_removed_during_a_checkpoint_write_is_not_called_a_full_disk(tmp_path,
                                                                          monkeypatch):
    def vanished(path, state):
        raise OSError(errno.ENOENT, os.strerror(errno.ENOENT), str(path))

    monkeypatch.setattr(_loop_persist, "save_checkpoint", vanished)
    persister = _loop_persist.CheckpointPersister(tmp_path / "checkpoints", keep=2)
    with pytest.raises(_loop_persist.CheckpointWriteError) as failed:
        persister.persist_now({"step": 3}, step=3, reason="interval", elapsed_s=1.0,
                              blocking_s=0.0, snapshot_s=0.0)
    assert "disappeared during the write" in str(failed.value)
    assert "Free disk space" not in str(failed.value)


# --- class 7: the work a kill loses, with a background save in flight --------------------------
def test_the_stated_bound_is_one_interval_plus_one_save_in_flight():
    assert _loop_persist.max_lost_steps(5, asynchronous=True) == 10
    assert _loop_persist.max_lost_steps(5, asynchronous=False) == 5


class Killed(Exception):
    """Stands for kill -9 at the moment the loop waits for the save in flight."""


def test_a_kill_while_a_save_is_in_flight_loses_at_most_the_stated_bound(tmp_path, monkeypatch):
    """The save of step 10 is held in flight (an event, no clock); training goes on and, at the
    next interval (step 15), must wait for it rather than start another. The kill lands there,
    the worst moment: the newest durable checkpoint is step 5."""
    interval = 5
    real_save = _loop_persist.save_checkpoint
    real_wait = _loop_persist.CheckpointPersister.wait
    release = threading.Event()
    seen: dict[str, int] = {}

    def save(path, state):
        if state["step"] == 2 * interval:
            assert release.wait(60), "the loop never waited for the save in flight"
            raise OSError(errno.EIO, "killed before this save was durable", str(path))
        return real_save(path, state)

    policy = ScriptedPolicy({})

    def wait(self):
        if self.in_flight_step == 2 * interval and "trained" not in seen:
            seen["trained"] = max(o.step for o in policy.seen)  # steps done at this moment
            release.set()
            raise Killed
        return real_wait(self)

    monkeypatch.setattr(_loop_persist, "save_checkpoint", save)
    monkeypatch.setattr(_loop_persist.CheckpointPersister, "wait", wait)
    with pytest.raises(Killed):
        train(tiny_config(max_steps=30, checkpoint_every_steps=interval, fast_every_steps=1,
                          async_checkpoints=True), text_examples(), None, tmp_path,
              fast_policy=policy)
    durable = sorted(p.name for p in (tmp_path / "checkpoints").glob("step-*.pt"))
    assert durable == ["step-0000005.pt"]
    lost = seen["trained"] - interval
    # The loop trained on while step 10 was in flight, and stopped at the next interval.
    assert seen["trained"] == 3 * interval
    assert lost <= _loop_persist.max_lost_steps(interval, asynchronous=True) == 2 * interval


# --- class 8: names, settings and signals at the edges -----------------------------------------
@pytest.mark.parametrize("run_id", ["tiny\n", "../tiny", "a/b", "..", ".hidden", "tiny\x00"])
def test_run_ids_that_are_not_one_plain_name_are_refused(tmp_path, run_id):
    with pytest.raises(ValueError, match="run_id"):
        rank_dir(tmp_path, run_id, 0)
    with pytest.raises(ValueError, match="run_id"):
        train(tiny_config(run_id=run_id), text_examples(), None, tmp_path / "run")
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("partition", ["../../etc", "..", "mnist\n", "a/b", ".mnist"])
def test_a_path_like_demo_partition_is_refused_with_the_other_settings(monkeypatch, partition):
    monkeypatch.setenv("TRAINWISE_DEMO_PARTITION", partition)
    with pytest.raises(settings.SettingError, match="TRAINWISE_DEMO_PARTITION"):
        settings.check_all()
    with pytest.raises(settings.SettingError, match="TRAINWISE_DEMO_PARTITION"):
        cli._check_demo_args(Namespace(partition="", steps=10))


def test_an_unknown_but_well_formed_demo_partition_is_refused_before_the_demo(monkeypatch):
    monkeypatch.setenv("TRAINWISE_DEMO_PARTITION", "imagenet")
    settings.check_all()  # the form is fine
    with pytest.raises(settings.SettingError, match="TRAINWISE_DEMO_PARTITION.*valid partitions"):
        cli._check_demo_args(Namespace(partition="", steps=10))
    monkeypatch.setenv("TRAINWISE_DEMO_PARTITION", "pystdlib")
    cli._check_demo_args(Namespace(partition="", steps=10))


# One interpreter, three SIGTERMs outside the loop; each triggered by raise_signal at a fixed
# point (no timing). Before the fix the first one killed the process without a word.
SIGTERM_SCRIPT = r"""
import json, signal, sys, time
from pathlib import Path
from trainwise import emulated_worker as worker
from training import loop, shards

class Result:
    def __init__(self, status, on_status=None):
        self._status, self._on_status = status, on_status
        self.run_id, self.steps, self.final_eval_loss = "sig", 4, 1.0
        self.checkpoint_path, self.checkpoint_sha256, self.elapsed_s = "ck", "0", 1.0
        self.final_eval_accuracy, self.tokens_seen, self.samples_seen = None, 0, 0
        self.cost_usd, self.telemetry_dir = 0.0, "tel"
    @property
    def status(self):
        if self._on_status:
            self._on_status(); self._on_status = None
        return self._status

def during_setup(*args, **kwargs):
    from training._loop_fast import PreemptionSignal
    signal.raise_signal(signal.SIGTERM)  # inside train(), before the loop's handler is up
    with PreemptionSignal() as notice:
        for _ in range(2000):
            if notice.pending:
                return Result("preempted")
            time.sleep(0.005)
    return Result("completed")

folder = Path(sys.argv[1])
job = {"shards_dir": "unused", "run_dir": str(folder / "run"), "resume_from": None,
       "train_config": {"max_steps": 4, "run_id": "sig"}}
scenarios = {
    "starting": (lambda p: signal.raise_signal(signal.SIGTERM), None),
    "after_train": (lambda p: None,
                    lambda *a, **k: Result("completed",
                                           lambda: signal.raise_signal(signal.SIGTERM))),
    "during_setup": (lambda p: None, during_setup),
}
for name, (load, fake_train) in scenarios.items():
    shards.load_shards = load
    if fake_train is not None:
        loop.train = fake_train
    path = folder / f"job-{name}.json"
    path.write_text(json.dumps({**job, "result_path": str(folder / f"result-{name}.json")}))
    code = worker.main([str(path)])
    print(json.dumps({"scenario": name, "code": code}), flush=True)
    print(f"--- end of {name}", file=sys.stderr, flush=True)
"""


def test_sigterm_outside_the_training_loop_ends_with_the_usual_message(tmp_path):
    script = tmp_path / "sigterm.py"
    script.write_text(SIGTERM_SCRIPT)
    done = subprocess.run([sys.executable, str(script), str(tmp_path)], cwd=ROOT,
                          capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})
    codes = {r["scenario"]: r["code"] for r in map(json.loads, done.stdout.splitlines())}
    assert done.returncode == 0, done.stderr[-2000:]
    said = dict(zip(["starting", "after_train", "during_setup"],
                    done.stderr.split("--- end of ")[:3], strict=True))
    # During start-up: stops at once, says nothing was trained, no result file.
    assert codes["starting"] == emulated_worker.EXIT_SIGTERM
    assert "SIGTERM received while starting" in said["starting"]
    assert not (tmp_path / "result-starting.json").exists()
    # After train() returned: the result is still written, and the line says so.
    assert codes["after_train"] == 0
    assert "after the training loop had ended" in said["after_train"]
    assert json.loads((tmp_path / "result-after_train.json").read_text())["status"] == "completed"
    # Inside train() before the loop's handler: passed on to it, answered as a preemption.
    assert codes["during_setup"] == 0 and "stopped by SIGTERM" in said["during_setup"]
    assert json.loads((tmp_path / "result-during_setup.json").read_text())["status"] == \
        "preempted"


def test_sigterm_reaching_the_cli_says_so_and_exits_143(tmp_path):
    script = ("import signal, sys\nfrom trainwise import cli\n"
              "cli._cmd_settings = lambda args: signal.raise_signal(signal.SIGTERM)\n"
              "sys.exit(cli.main(['settings']))\n")
    done = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True,
                          text=True, timeout=60, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert done.returncode == cli.EXIT_SIGTERM, done.stderr[-2000:]
    assert "stopped by SIGTERM" in done.stderr
