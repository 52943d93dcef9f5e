"""Telemetry under faults (issue 8, defects 3, 10, 11): malformed and hostile lines, a full disk,
a held DuckDB lock, concurrent ingests, a reused run id, steps replayed after a resume."""

from __future__ import annotations

import errno
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import duckdb
import pytest

from telemetry import writer as writer_module
from telemetry.events import EvalEvent, RunStartEvent, StepEvent
from telemetry.reader import TelemetryFormatError, latest_recorded, read_run_events
from telemetry.store import (
    TABLE,
    TelemetryStoreBusyError,
    check_db_path,
    ingest,
    replay_flags,
    run_events,
)
from telemetry.writer import SegmentWriter, TelemetryWriteError

REPO = Path(__file__).resolve().parent.parent


def _step(step: int, run_id: str = "run-1", wall_time_s: float | None = None) -> StepEvent:
    return StepEvent(
        run_id=run_id, step=step, wall_time_s=wall_time_s or time.time(), train_loss=1.0,
        learning_rate=1e-3, grad_norm=0.5, grad_noise_scale=1.0, micro_batch_size=8,
        grad_accum_steps=1, step_time_ms=10.0, samples_seen=8 * step, tokens_seen=0,
        elapsed_s=0.5 * step, cost_usd=0.001 * step,
    )


def _sealed_run(tmp_path: Path, steps: int = 3, run_id: str = "run-1") -> Path:
    with SegmentWriter(tmp_path, run_id) as writer:
        for step in range(1, steps + 1):
            writer.write(_step(step, run_id))
    return tmp_path / run_id / "rank0" / "segment-00000.jsonl"


def _open_segment(tmp_path: Path, body: bytes) -> Path:
    """An open segment (no marker) with two good lines then `body`."""
    good = _sealed_run(tmp_path, steps=2)
    good.with_suffix(".complete").unlink()
    good.write_bytes(good.read_bytes() + body)
    return good


# --- defect 10: malformed lines name the file, the line and the fix -------------------------

@pytest.mark.parametrize(
    ("body", "problem"),
    [
        (b"not json at all\n", "is not JSON"),
        (b'{"type":"step","run_id":"run-1","rank":0,"step":3,"x":"\xff\xfe"}\n', "is not UTF-8"),
        (b'[1, 2, 3]\n', "is a JSON list, not an object"),
        (b'"just a string"\n', "is a JSON str, not an object"),
        (b'{"type":"step","run_id":"run-1","rank":0,"step":' + b"9" * 40 + b"}\n", "has step"),
        (b'{"type":"step","run_id":"run-1","rank":0,"step":-1}\n', "has step"),
        (b'{"type":"step","run_id":"run-1","rank":0,"step":3.5}\n', "has step"),
        (b'{"type":"step","run_id":"run-1","rank":0,"step":3,"loss":NaN}\n', "is not JSON"),
        (b'{"type":"step","run_id":"run-1","rank":7,"step":3}\n', "has rank 7"),
        (b'{"run_id":"run-1","rank":0,"step":3}\n', "lacks the string fields"),
        (b"\n", "is not JSON"),
        (b"[" * 100_000 + b"\n", "is not JSON"),
    ],
)
def test_a_malformed_line_names_file_line_and_fix(tmp_path, body, problem):
    segment = _open_segment(tmp_path, body)
    with pytest.raises(TelemetryFormatError) as caught:
        read_run_events(tmp_path / "run-1")
    message = str(caught.value)
    assert str(segment) in message and "line 3 " + problem in message
    assert "re-ingest" in message and isinstance(caught.value, ValueError)
    db = tmp_path / "t.duckdb"
    with pytest.raises(TelemetryFormatError, match="line 3"):
        ingest(tmp_path / "run-1", db)
    assert not db.exists()  # the files are checked before the database is touched


def test_a_torn_last_line_of_an_open_segment_stays_skipped(tmp_path):
    _open_segment(tmp_path, b'{"type":"step","run_id":"run-1","rank":0,"st\xff')
    assert [r["step"] for r in read_run_events(tmp_path / "run-1")] == [1, 2]
    assert ingest(tmp_path / "run-1", tmp_path / "t.duckdb") == 2


@pytest.mark.parametrize(
    ("marker", "match"),
    [
        ("not json", "is malformed"),
        ('{"lines": 3}', "is malformed"),
        ('{"lines": 3, "bytes": "many", "sha256": "0"}', "is malformed"),
        ("[1]", "is malformed"),
        ('{"lines": 3, "bytes": -5, "sha256": "0"}', "negative count"),
        ('{"lines": 3, "bytes": 99999999, "sha256": "0"}', "does not match its completion marker"),
    ],
)
def test_a_bad_completion_marker_is_named(tmp_path, marker, match):
    segment = _sealed_run(tmp_path)
    segment.with_suffix(".complete").write_text(marker)
    with pytest.raises(TelemetryFormatError, match=match) as caught:
        read_run_events(tmp_path / "run-1")
    assert str(segment.with_suffix(".complete")) in str(caught.value)


def test_a_marker_with_a_wrong_line_count_or_bytes_after_the_seal_is_refused(tmp_path):
    segment = _sealed_run(tmp_path)
    marker_file = segment.with_suffix(".complete")
    marker = json.loads(marker_file.read_text())
    marker_file.write_text(json.dumps({**marker, "lines": 2}))
    with pytest.raises(TelemetryFormatError, match="does not match its completion marker"):
        read_run_events(tmp_path / "run-1")
    marker_file.write_text(json.dumps(marker))
    with open(segment, "ab") as handle:  # a second writer appended after the seal
        handle.write(json.dumps({"type": "step"}).encode() + b"\n")
    with pytest.raises(TelemetryFormatError, match="bytes after its sealed end"):
        read_run_events(tmp_path / "run-1")


# --- defect 11: a failed write leaves a readable segment and a usable writer ----------------

def _failing_write(fail_errno: int, *, after_calls: int):
    calls = {"n": 0}
    real_write = os.write

    def write(fd: int, data: bytes) -> int:
        calls["n"] += 1
        if calls["n"] > after_calls:
            raise OSError(fail_errno, os.strerror(fail_errno))
        if calls["n"] == after_calls:  # half a line lands on disk first, as on a full disk
            return real_write(fd, data[: len(data) // 2])
        return real_write(fd, data)

    return write


@pytest.mark.parametrize("fail_errno", [errno.ENOSPC, errno.EIO])
def test_a_failed_write_truncates_to_the_last_line_and_close_still_works(
    tmp_path, monkeypatch, fail_errno
):
    writer = SegmentWriter(tmp_path, "run-1")
    writer.write(_step(1))
    writer.write(_step(2))
    monkeypatch.setattr(writer_module, "_write_fd", _failing_write(fail_errno, after_calls=1))
    with pytest.raises(TelemetryWriteError) as caught:
        writer.write(_step(3))
    assert caught.value.errno == fail_errno and isinstance(caught.value, OSError)
    assert str(writer.segment_path) in str(caught.value) and "Free space" in str(caught.value)
    data = writer.segment_path.read_bytes()
    assert data.endswith(b"\n") and data.count(b"\n") == 2  # the partial line is gone
    assert [r["step"] for r in read_run_events(tmp_path / "run-1")] == [1, 2]
    monkeypatch.setattr(writer_module, "_write_fd", os.write)  # space freed: writing resumes
    writer.write(_step(3))
    writer.close()
    assert [r["step"] for r in read_run_events(tmp_path / "run-1")] == [1, 2, 3]


def test_close_after_a_failed_write_does_not_raise_when_sealing_fails_too(tmp_path, monkeypatch):
    writer = SegmentWriter(tmp_path, "run-1")
    writer.write(_step(1))
    monkeypatch.setattr(writer_module, "_write_fd", _failing_write(errno.ENOSPC, after_calls=0))
    with pytest.raises(TelemetryWriteError):
        writer.write(_step(2))

    def no_space(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(writer_module, "_write_atomic", no_space)
    writer.close()  # the loop closes the writer while handling the error: it must not mask it
    assert [r["step"] for r in read_run_events(tmp_path / "run-1")] == [1]  # open, readable
    monkeypatch.undo()
    with SegmentWriter(tmp_path, "run-1") as resumed:  # seals the open one as recovered
        resumed.write(_step(2))
    assert [r["step"] for r in read_run_events(tmp_path / "run-1")] == [1, 2]


def _mount_tmpfs(path: Path, size: str) -> bool:
    if os.geteuid() != 0 or not shutil.which("mount"):
        return False
    path.mkdir()
    result = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)],
                            capture_output=True, timeout=10)
    return result.returncode == 0


def test_a_really_full_disk_gives_a_readable_segment(tmp_path):
    mount_point = tmp_path / "small"
    if not _mount_tmpfs(mount_point, "16k"):
        pytest.skip("needs root and permission to mount a 16 KiB tmpfs; the injected-fault "
                    "tests above cover the same path")
    try:
        writer = SegmentWriter(mount_point, "run-1", events_per_segment=10_000)
        written = 0
        with pytest.raises(TelemetryWriteError) as caught:
            for step in range(1, 10_000):
                writer.write(_step(step))
                written += 1
        assert caught.value.errno == errno.ENOSPC and written > 10
        writer.close()
        records = read_run_events(mount_point / "run-1")
        assert [r["step"] for r in records] == list(range(1, written + 1))
        assert writer.segment_path.read_bytes().endswith(b"\n")
    finally:
        subprocess.run(["umount", str(mount_point)], check=True, timeout=30)


# --- defect 3: locks, reused run ids, replays, database paths -------------------------------

# Holds the file's lock until a line arrives on its stdin (or it is killed).
_HOLD = ("import duckdb, sys\n"
         "con = duckdb.connect(sys.argv[1])\n"
         "con.execute('create table if not exists held (x int)')\n"
         "print('held', flush=True)\n"
         "sys.stdin.readline()\n"
         "con.close()\n")
# Says "locked" on stderr when it first finds the file locked (and waits to retry).
_INGEST = ("import sys, time\n"
           "from telemetry import store\n"
           "real_connect = store.connect_with_retry\n"
           "said = []\n"
           "def wait(seconds):\n"
           "    if not said:\n"
           "        print('locked', file=sys.stderr, flush=True)\n"
           "        said.append(seconds)\n"
           "    time.sleep(seconds)\n"
           "store.connect_with_retry = lambda *a, **k: real_connect(*a, sleep=wait, **k)\n"
           "print(store.ingest(sys.argv[1], sys.argv[2], lock_timeout_s=60))\n")


def _hold_lock(db: Path) -> subprocess.Popen:
    holder = subprocess.Popen([sys.executable, "-c", _HOLD, str(db)],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert holder.stdout is not None and holder.stdout.readline().strip() == "held"
    return holder


def test_a_lock_held_past_the_timeout_names_the_file_and_the_holder(tmp_path):
    _sealed_run(tmp_path)
    db = tmp_path / "t.duckdb"
    holder = _hold_lock(db)
    try:
        started = time.monotonic()
        with pytest.raises(TelemetryStoreBusyError) as caught:
            ingest(tmp_path / "run-1", db, lock_timeout_s=0.6)
        waited_s = time.monotonic() - started
    finally:
        holder.kill()
        holder.wait()
    message = str(caught.value)
    assert str(db) in message and f"pid {holder.pid}" in message and "dbt" in message
    assert 0.6 <= waited_s < 10
    assert ingest(tmp_path / "run-1", db) == 3  # lock released: the same call succeeds


def test_four_concurrent_ingests_into_one_file_all_succeed(tmp_path):
    runs = [f"run-{i}" for i in range(4)]
    for run_id in runs:
        _sealed_run(tmp_path, steps=50, run_id=run_id)
    db = tmp_path / "t.duckdb"
    holder = _hold_lock(db)
    ingests = [
        subprocess.Popen([sys.executable, "-c", _INGEST, str(tmp_path / run_id), str(db)],
                         cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for run_id in runs
    ]
    try:  # every ingest meets the held lock first; then it is released
        assert [process.stderr.readline().strip() for process in ingests] == ["locked"] * 4
    finally:
        holder.communicate("release\n", timeout=30)
    outputs = [process.communicate(timeout=120) for process in ingests]
    assert [process.returncode for process in ingests] == [0] * 4, [err for _, err in outputs]
    assert [int(out) for out, _ in outputs] == [50] * 4
    with duckdb.connect(str(db), read_only=True) as con:
        assert con.execute(f"SELECT count(*), count(DISTINCT run_id) FROM {TABLE}").fetchone() \
            == (200, 4)


def test_a_second_run_reusing_a_run_id_keeps_its_rows(tmp_path):
    db = tmp_path / "t.duckdb"
    first, second = tmp_path / "first", tmp_path / "second"
    _sealed_run(first, steps=3, run_id="reused")
    _sealed_run(second, steps=5, run_id="reused")  # same id, same file names, other run
    assert ingest(first / "reused", db) == 3
    assert ingest(second / "reused", db) == 5  # the old key (run, rank, segment, line) lost all 5
    assert ingest(first / "reused", db) == 0 and ingest(second / "reused", db) == 0
    assert len(run_events(db, "reused")) == 8
    assert not any(replay for _, _, replay in replay_flags(db, "reused"))  # not a resume
    with duckdb.connect(str(db), read_only=True) as con:
        instances = con.execute(f"SELECT run_instance, count(*) FROM {TABLE} GROUP BY 1 "
                                "ORDER BY 2").fetchall()
    assert [count for _, count in instances] == [3, 5]


def test_steps_replayed_after_a_resume_are_labelled_not_lost_not_duplicated(tmp_path):
    db = tmp_path / "t.duckdb"
    with SegmentWriter(tmp_path, "run-1") as killed:  # checkpoint at 2, killed after step 4
        for step in range(1, 5):
            killed.write(_step(step))
        killed.write(EvalEvent(run_id="run-1", step=4, eval_loss=1.0, eval_accuracy=None,
                               eval_examples=8, eval_ms=5.0))
    assert ingest(tmp_path / "run-1", db) == 5  # ingested while the run was down
    with SegmentWriter(tmp_path, "run-1") as resumed:  # resumes from step 2
        for step in range(3, 7):
            resumed.write(_step(step))
            if step == 4:
                resumed.write(EvalEvent(run_id="run-1", step=4, eval_loss=1.0,
                                        eval_accuracy=None, eval_examples=8, eval_ms=5.0))
    assert ingest(tmp_path / "run-1", db) == 5
    assert ingest(tmp_path / "run-1", db) == 0
    flags = replay_flags(db, "run-1")
    assert flags == [("step", 1, False), ("step", 2, False), ("step", 3, False),
                     ("step", 4, False), ("eval", 4, False), ("step", 3, True),
                     ("step", 4, True), ("eval", 4, True), ("step", 5, False),
                     ("step", 6, False)]
    assert latest_recorded(tmp_path / "run-1") == (6, 3.0)


def test_a_real_resumed_run_stores_every_line_once_with_replays_labelled(tmp_path):
    import numpy as np

    from training.data_types import ExampleSet
    from training.loop import TrainConfig, train
    from training.model import GPTConfig

    vocab = tuple("abcdefgh")
    starts = np.random.default_rng(0).integers(0, len(vocab), 128)
    is_eval = np.zeros(128, dtype=bool)
    is_eval[::8] = True
    examples = ExampleSet(
        partition="cycle", kind="text", example_ids=np.arange(128, dtype=np.int64),
        is_eval=is_eval, inputs=((starts[:, None] + np.arange(17)[None, :]) % 8).astype(np.int64),
        labels=None, vocab=vocab, shard_index=np.zeros(128, dtype=np.int32), fingerprint="a" * 64)
    config = TrainConfig(
        max_steps=12, micro_batch_size=4, grad_accum_steps=1, learning_rate=3e-3,
        eval_every_steps=6, eval_batches=1, eval_batch_size=8, checkpoint_every_steps=4,
        keep_checkpoints=10, fast_every_steps=4, seed=1, price_usd_per_hour=3.6,
        instance_type="p3.2xlarge", run_id="resumed",
        model=GPTConfig(vocab_size=8, block_size=16, n_layer=1, n_head=2, n_embd=16))
    out_dir = tmp_path / "out"
    first = train(config, examples, None, out_dir, stop_after_steps=10)
    # The process "died" after step 10; resume from the older checkpoint at step 4.
    train(config, examples, None, out_dir,
          resume_from=out_dir / "checkpoints" / "step-0000004.pt")
    lines = read_run_events(first.telemetry_dir)
    db = tmp_path / "t.duckdb"
    assert ingest(first.telemetry_dir, db) == len(lines)  # 0 lost
    assert ingest(first.telemetry_dir, db) == 0  # 0 duplicated
    steps = [(step, replay) for kind, step, replay in replay_flags(db, "resumed") if kind == "step"]
    assert [s for s, replay in steps if not replay] == list(range(1, 13))
    assert [s for s, replay in steps if replay] == list(range(5, 11))
    assert latest_recorded(first.telemetry_dir)[0] == 12


def test_ingest_migrates_a_table_of_the_first_schema(tmp_path):
    _sealed_run(tmp_path, steps=3)
    db = tmp_path / "t.duckdb"
    with duckdb.connect(str(db)) as con:  # what the first ingest wrote: no segment identity
        con.execute(f"CREATE TABLE {TABLE} (run_id VARCHAR NOT NULL, rank INTEGER NOT NULL, "
                    "segment INTEGER NOT NULL, line_no INTEGER NOT NULL, event_type VARCHAR NOT "
                    "NULL, step BIGINT, wall_time_s DOUBLE, payload JSON NOT NULL, "
                    "PRIMARY KEY (run_id, rank, segment, line_no))")
        for line_no, record in enumerate(read_run_events(tmp_path / "run-1")):
            con.execute(f"INSERT INTO {TABLE} VALUES ('run-1', 0, 0, ?, 'step', ?, ?, ?)",
                        [line_no, record["step"], record["wall_time_s"],
                         json.dumps(record, separators=(",", ":"))])
    assert ingest(tmp_path / "run-1", db) == 0  # same keys as a fresh ingest
    assert [r["step"] for r in run_events(db, "run-1")] == [1, 2, 3]


def test_check_db_path_refuses_folders_foreign_files_and_unwritable_places(tmp_path):
    with pytest.raises(ValueError, match="is a folder; set TRAINWISE_DUCKDB_PATH"):
        check_db_path(tmp_path)
    foreign = tmp_path / "notes.duckdb"
    foreign.write_text("hello")
    with pytest.raises(ValueError, match="not a DuckDB database"):
        check_db_path(foreign)
    empty = tmp_path / "empty.duckdb"
    empty.touch()
    with pytest.raises(ValueError, match="not a DuckDB database"):
        check_db_path(empty)
    with pytest.raises(ValueError, match="is not a folder"):
        check_db_path(foreign / "t.duckdb")
    with pytest.raises(ValueError, match="cannot create files in /proc"):
        check_db_path("/proc/trainwise.duckdb")  # refused even to root
    _sealed_run(tmp_path)
    with pytest.raises(ValueError, match="is a folder"):
        ingest(tmp_path / "run-1", tmp_path)
    check_db_path(tmp_path / "new" / "deeper" / "t.duckdb")  # missing parents are created later
    ingest(tmp_path / "run-1", tmp_path / "good.duckdb")
    check_db_path(tmp_path / "good.duckdb")


def test_latest_recorded_reads_steps_and_elapsed(tmp_path):
    assert latest_recorded(tmp_path / "missing") is None
    with SegmentWriter(tmp_path, "run-1") as writer:
        writer.write(RunStartEvent(
            run_id="run-1", step=0, model_kind="gpt", model_config={}, model_fingerprint="f",
            train_config={}, data_fingerprint="d", curriculum_version=None, instance_type="x",
            price_usd_per_hour=1.0))
    assert latest_recorded(tmp_path / "run-1") is None
    _sealed_run(tmp_path, steps=4)
    assert latest_recorded(tmp_path / "run-1") == (4, 2.0)
