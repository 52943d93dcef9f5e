"""More instances of issue 31's classes 2 and 8, found after the first fixes: a link planted at a
name trainwise writes by a predictable path (a run folder's records, control files and logs, a
state folder's histories), and names validated with `$`, which also matches before a final
newline.

Each write test plants a symbolic link to a sentinel file outside the folder at the predictable
name, calls the real function and checks that the sentinel is unchanged; each name test passes
the name with a trailing newline and checks that it is refused.
"""

from __future__ import annotations

import errno
import json
import os
import subprocess
from pathlib import Path
from types import SimpleNamespace

import pytest

from controllers.slow_types import SlowAction
from telemetry import prometheus
from telemetry.reader import read_run_events
from telemetry.writer import SegmentWriter
from training import _checkpoint_trust, _loop_run, checkpoint, curriculum
from training.run_lock import RunFolderLock
from training.safe_files import UnsafeStatePathError
from trainwise import (
    approvals,
    emulated_trainer,
    gang,
    mlflow_live,
    object_store,
    runs,
    settings,
    slow_tick,
    torchrun_gang,
)

SENTINEL = b"a file outside the folder that trainwise may not change\n"


@pytest.fixture
def outside(tmp_path) -> Path:
    """A sentinel file beside (not inside) the folder under test."""
    path = tmp_path / "outside" / "sentinel.txt"
    path.parent.mkdir()
    path.write_bytes(SENTINEL)
    return path


@pytest.fixture
def run(tmp_path) -> Path:
    folder = tmp_path / "state" / "runs" / "r1"
    folder.mkdir(parents=True)
    return folder


def plant(path: Path, target: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    os.symlink(target, path)
    return path


def pid_temp(path: Path) -> Path:
    """The fixed temp name the writers used before (`.name.tmp-<pid>`)."""
    return path.with_name(f".{path.name}.tmp-{os.getpid()}")


# --- class 2: appends refuse a planted link ----------------------------------------------------
def test_slow_decisions_are_not_appended_through_a_planted_link(run, outside):
    plant(run / "slow_decisions.jsonl", outside)
    action = SlowAction(pruning_rate=0.0, pruning_upweight=1.0, checkpoint_interval_s=30.0,
                        reason="test")
    tick = slow_tick.SlowTick("pystdlib", run.name, action)
    with pytest.raises(UnsafeStatePathError, match="slow_decisions.jsonl.*symbolic link"):
        slow_tick.apply_run_decisions(run.parent.parent, tick)
    assert outside.read_bytes() == SENTINEL


def test_the_live_change_rule_history_is_not_appended_through_a_planted_link(tmp_path,
                                                                           outside):
    state = tmp_path / "state"
    plant(state / "governance" / "live_change_rule_history.jsonl", outside)
    with pytest.raises(UnsafeStatePathError, match="live_change_rule_history"):
        slow_tick.set_live_change_rule(state, auto_approve=False, set_by="me", why="test")
    assert outside.read_bytes() == SENTINEL


def test_the_curriculum_history_is_not_appended_through_a_planted_link(tmp_path, outside):
    folder = tmp_path / "curricula" / "pystdlib"
    plant(folder / curriculum.HISTORY_NAME, outside)
    with pytest.raises(UnsafeStatePathError, match="history.jsonl"):
        curriculum.append_history(folder, {"event": "test"})
    assert outside.read_bytes() == SENTINEL


def test_an_approval_record_is_not_appended_through_a_planted_link(tmp_path, outside):
    folder = tmp_path / "governance"
    plant(folder / "history.jsonl", outside)
    with pytest.raises(UnsafeStatePathError, match="history.jsonl"):
        approvals.propose(folder, {"pruning_rate": 0.2}, forecast_savings_usd=1.0,
                          eval_loss_change=None, evidence={}, reason="r", requested_by="me")
    assert outside.read_bytes() == SENTINEL


# --- class 2: whole files go through an unpredictable temp name --------------------------------
def test_the_allocation_file_is_not_written_through_its_old_temp_name(run, outside):
    path = run / gang.ALLOCATION_FILE
    plant(pid_temp(path), outside)
    gang.write_allocation(run, gang.Allocation(nodes=2))
    assert outside.read_bytes() == SENTINEL
    assert gang.read_allocation(run).nodes == 2


def test_the_gang_record_is_not_written_through_its_old_temp_name(run, outside):
    path = run / gang.GANG_FILE
    plant(pid_temp(path), outside)
    gang.GangSession._write_record(SimpleNamespace(run_dir=run), {"nodes": []})
    assert outside.read_bytes() == SENTINEL
    assert json.loads(path.read_text()) == {"nodes": []}


@pytest.mark.parametrize("at", ["temp", "name"])
def test_a_run_record_is_not_written_through_a_planted_link(run, outside, at):
    path = run / "fast_policy.json"
    plant(pid_temp(path) if at == "temp" else path, outside)
    runs._write_json_atomic(path, {"fast_policy": "heuristic"})
    assert outside.read_bytes() == SENTINEL
    assert not path.is_symlink() and json.loads(path.read_text())["fast_policy"] == "heuristic"


def test_the_cost_plot_is_not_written_through_a_planted_link(run, outside):
    path = plant(run / "eval_loss_vs_cost.png", outside)
    events = [{"type": "step", "step": 1, "cost_usd": 0.1},
              {"type": "eval", "step": 1, "eval_loss": 2.0}]
    runs.plot_cost_vs_loss(events, path)
    assert outside.read_bytes() == SENTINEL
    assert path.read_bytes().startswith(b"\x89PNG")


def test_the_decision_table_is_not_written_through_a_planted_link(run, outside):
    path = plant(run / mlflow_live.DECISIONS_NAME, outside)
    mlflow_live.LiveRun.write_decisions(SimpleNamespace(decisions=[{"step": 1}]), path)
    assert outside.read_bytes() == SENTINEL
    assert path.read_text().splitlines()[1].startswith(",1,")


def test_a_restored_object_is_not_written_through_a_planted_link(tmp_path, run, outside):
    store = object_store.LocalObjectStore(tmp_path / "store")
    store.put_bytes(b"checkpoint bytes", "p/r1/step-0000001.pt")
    partial = plant(run / "checkpoints" / ".step-0000001.pt.download", outside)
    store.get_file("p/r1/step-0000001.pt", partial)
    assert outside.read_bytes() == SENTINEL
    assert not partial.is_symlink() and partial.read_bytes() == b"checkpoint bytes"
    assert sorted(p.name for p in partial.parent.iterdir()) == [partial.name]


class _Spawned(Exception):
    """Raised in place of starting the child: the files it would read are written by then."""


def test_an_emulated_trainers_job_and_log_are_not_written_through_planted_links(
        run, outside, monkeypatch):
    folder = run / "emulated"
    plant(folder / "job-000.json", outside)
    plant(folder / "worker-000.log", outside)
    logs = []

    def popen(command, **kwargs):
        logs.append(kwargs["stdout"])
        raise _Spawned

    monkeypatch.setattr(emulated_trainer.subprocess, "Popen", popen)
    processes = SimpleNamespace(
        pids=[], run_dir=run, store_dir=None, checkpoint_path=None, shards_dir=run / "shards",
        train_config={}, trainer_ignores_notice=False, store_key_prefix="", fast_policy=None,
        job_extra={}, trainer_risk=lambda: None, workload=None)  # the built-in worker
    processes.worker_child = lambda *args: emulated_trainer._TrainerProcesses.worker_child(
        processes, *args)
    with pytest.raises(_Spawned):
        emulated_trainer._TrainerProcesses.spawn(processes)
    logs[0].close()
    assert outside.read_bytes() == SENTINEL
    assert json.loads((folder / "job-000.json").read_text())["run_dir"] == str(run)
    assert not (folder / "worker-000.log").is_symlink()


def test_a_torchrun_segments_spec_and_log_are_not_written_through_planted_links(
        run, outside, monkeypatch):
    from training import ddp_worker

    work_dir = run / "gang"
    plant(work_dir / "segment-0.json", outside)
    plant(work_dir / "segment-0.log", outside)

    def command(*args, **kwargs):
        raise _Spawned

    monkeypatch.setattr(ddp_worker, "torchrun_command", command)
    driver = SimpleNamespace(work_dir=work_dir, spec={}, uploader_spec=None,
                             store_root=run / "store", key_prefix="p/r1", nproc=0, _pids={},
                             _steps_seen=lambda rank: 0)
    with pytest.raises(_Spawned):
        torchrun_gang.TorchrunGang._segment(driver, 0, None)
    assert outside.read_bytes() == SENTINEL
    assert json.loads((work_dir / "segment-0.json").read_text())["store"]["key_prefix"] == "p/r1"
    assert not (work_dir / "segment-0.log").is_symlink()


def test_the_champion_is_not_copied_through_its_old_temp_name(tmp_path, outside):
    from rl import gate

    folder = tmp_path / "policies" / "fast" / "us-west-2"
    folder.mkdir(parents=True)
    (folder / "v1.npz").write_bytes(b"weights")
    champion = folder / "champion.npz"
    plant(champion.with_name(f".{champion.name}.{os.getpid()}.tmp"), outside)
    gate._copy_atomically(folder / "v1.npz", champion)
    assert outside.read_bytes() == SENTINEL and champion.read_bytes() == b"weights"


def test_the_policy_history_is_not_appended_through_a_planted_link(tmp_path, outside,
                                                                  monkeypatch):
    from rl import gate
    from rl.policy_folder import policy_dir

    monkeypatch.setenv("TRAINWISE_HOME", str(tmp_path / "home"))
    plant(policy_dir("fast", "us-west-2") / gate.HISTORY_NAME, outside)
    with pytest.raises(ValueError, match="history.jsonl is a link"):
        gate.append_history("fast", "us-west-2", {"event": "test"})
    assert outside.read_bytes() == SENTINEL


def test_a_gate_decision_is_not_written_through_a_planted_link(tmp_path, outside):
    from rl import gate

    path = plant(tmp_path / "policies" / "gate_v1.json", outside)
    decision = gate.GateDecision(True, "test", 0.05, 1.0, 2.0, 0.5, (0.4, 0.6), 0, 0, 1, "usd",
                                 [])
    gate.record_decision(decision, path)
    assert outside.read_bytes() == SENTINEL and json.loads(path.read_text())["promote"] is True


def test_the_ledger_folder_linked_outside_the_run_folder_is_refused(run, outside):
    os.symlink(outside.parent, run / "ledger")
    with pytest.raises(UnsafeStatePathError, match="ledger.*outside the run folder"):
        RunFolderLock(run).acquire()
    assert sorted(p.name for p in outside.parent.iterdir()) == ["sentinel.txt"]


# --- class 8: names with a trailing newline are refused ----------------------------------------
def test_a_rank_folder_with_a_trailing_newline_is_not_read(tmp_path):
    telemetry = tmp_path / "telemetry"
    with SegmentWriter(telemetry, "r1") as writer:
        writer.write({"type": "step", "run_id": "r1", "rank": 0, "step": 1})
    subprocess.run(["cp", "-r", str(telemetry / "r1" / "rank0"),
                    str(telemetry / "r1" / "rank0\n")], check=True)
    assert [e["step"] for e in read_run_events(telemetry / "r1")] == [1]


def test_the_prometheus_exporter_takes_no_name_with_a_trailing_newline():
    assert prometheus._RANK_PATTERN.match("rank0\n") is None
    assert prometheus._SEGMENT_PATTERN.match("segment-00000.jsonl\n") is None
    assert prometheus._RANK_PATTERN.match("rank0") is not None


def test_a_checkpoint_name_with_a_trailing_newline_is_not_a_checkpoint(tmp_path):
    (tmp_path / "step-0000001.pt\n").write_bytes(b"x")
    (tmp_path / "step-0000002.pt.manifest.json\n").write_bytes(b"x")
    assert checkpoint._steps_in(tmp_path) == {}
    assert checkpoint._SHA256.match("0" * 64 + "\n") is None
    assert checkpoint._TEMP_FILE.match(".step-0000001.pt.tmp-1\n") is None


def test_a_key_with_a_trailing_newline_is_not_64_hex_characters():
    assert _checkpoint_trust._HEX_KEY.fullmatch("a" * 64 + "\n") is None
    assert _checkpoint_trust._HEX_KEY.match("a" * 64 + "\n") is None


def test_a_zone_with_a_trailing_newline_is_refused():
    from cloud.collections import region_of_zone

    assert region_of_zone("us-west-2a") == "us-west-2"
    with pytest.raises(ValueError, match="is not a zone name"):
        region_of_zone("us-west-2a\n")


def test_a_policy_file_member_with_a_trailing_newline_is_not_ours():
    from rl import policy_file

    assert policy_file._MEMBER.match("wa.npy\n") is None
    assert policy_file._MEMBER.match("wa.npy") is not None


def test_the_demo_default_partition_is_read_through_the_validating_setting(monkeypatch):
    from pipelines import headless

    monkeypatch.setenv("TRAINWISE_DEMO_PARTITION", "pystdlib\n")
    with pytest.raises(settings.SettingError, match="TRAINWISE_DEMO_PARTITION"):
        headless.default_partition()
    monkeypatch.setenv("TRAINWISE_DEMO_PARTITION", "pystdlib")
    assert headless.default_partition() == "pystdlib"


# --- the stopped-telemetry message follows the errno ---------------------------------------------
@pytest.mark.parametrize(("code", "says", "not_says"), [
    (errno.ENOSPC, "Free disk space", "removed"),
    (errno.EDQUOT, "Free disk space", "removed"),
    (errno.ENOENT, "was removed while the trainer wrote it", "Free disk space"),
    (errno.EIO, "Input/output error, on device", "Free disk space"),
])
def test_the_telemetry_stop_message_depends_on_the_errno(tmp_path, code, says, not_says):
    fix = _loop_run._telemetry_fix(OSError(code, os.strerror(code)), tmp_path / "telemetry",
                                   "then resume")
    assert says in fix and not_says not in fix and fix.endswith("then resume")
