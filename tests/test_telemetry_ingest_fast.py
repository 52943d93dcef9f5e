"""The fast ingestion path (issue 29): sealed segments decoded by msgspec and split by DuckDB store
exactly what the strict Python path stores, refuse every hostile line the strict path refuses
(naming the segment and the line), in batches that an error rolls back whole, idempotently
without a primary key."""

from __future__ import annotations

import dataclasses
import json
import pickle
import sys
import threading

import duckdb
import pytest

from telemetry import ingest_fast, store
from telemetry.events import EvalEvent, StepEvent
from telemetry.reader import TelemetryFormatError
from telemetry.writer import SegmentWriter, seal_segment


def _step(step: int, run_id: str = "run-1") -> StepEvent:
    return StepEvent(
        run_id=run_id, step=step, wall_time_s=1000.0 + step, train_loss=1.0 / step,
        learning_rate=1e-3, grad_norm=0.5, grad_noise_scale=float("nan"), micro_batch_size=8,
        grad_accum_steps=1, step_time_ms=10.0, samples_seen=8 * step, tokens_seen=0,
        elapsed_s=float(step), cost_usd=0.001 * step,
    )


def _table(db):
    with duckdb.connect(str(db), read_only=True) as con:
        return con.execute(f"SELECT * FROM {store.TABLE} ORDER BY ALL").fetchall()


def _written_run(tmp_path, steps: int = 40, per_segment: int = 7):
    """A run with a resume (steps replayed), sealed segments and an open last one."""
    with SegmentWriter(tmp_path, "run-1", events_per_segment=per_segment) as writer:
        for step in range(1, steps // 2 + 1):
            writer.write(_step(step))
    killed = SegmentWriter(tmp_path, "run-1", events_per_segment=per_segment)
    for step in range(steps // 2 - 5, steps + 1):  # resumed from an older checkpoint
        killed.write(_step(step))
    return tmp_path / "run-1"


def test_fast_path_stores_what_the_strict_path_stores(tmp_path, monkeypatch):
    run = _written_run(tmp_path)
    fast_db, strict_db = tmp_path / "fast.duckdb", tmp_path / "strict.duckdb"
    assert store.ingest(run, fast_db) == 46
    monkeypatch.setattr(store, "sealed_columns", lambda body, run_id, rank: None)
    assert store.ingest(run, strict_db) == 46
    assert _table(fast_db) == _table(strict_db)
    assert sum(replay for _, _, replay in store.replay_flags(fast_db, "run-1")) == 6


def test_small_batches_store_the_same_rows_and_replays(tmp_path, monkeypatch):
    run = _written_run(tmp_path)
    whole = tmp_path / "whole.duckdb"
    store.ingest(run, whole)
    monkeypatch.setattr(store, "BATCH_LINES", 5)  # many batches, segments split across none
    batched = tmp_path / "batched.duckdb"
    assert store.ingest(run, batched) == 46
    assert _table(batched) == _table(whole)
    assert store.ingest(run, batched) == 0


def _sealed(tmp_path, lines: list[bytes], run_id: str = "r") -> tuple:
    """A run whose one segment holds `lines` and a marker that matches them (sha256 and all):
    the marker vouches for the bytes, not for what they say."""
    rank0 = tmp_path / run_id / "rank0"
    rank0.mkdir(parents=True)
    path = rank0 / "segment-00000.jsonl"
    path.write_bytes(b"".join(lines))
    seal_segment(path)
    return tmp_path / run_id, path


_GOOD = b'{"type":"step","run_id":"r","rank":0,"step":1,"wall_time_s":1.0}\n'


@pytest.mark.parametrize(("second", "problem"), [
    (pickle.dumps({"x": 1}) + b"\n", "line 2 is not"),
    (b'{"type":"step","run_id":"r","rank":0,"step":2,"x":"\xff"}\n', "line 2 is not UTF-8"),
    (b"[1, 2, 3]\n", "line 2 is a JSON list"),
    (b'{"type":"step","run_id":"r","rank":0,"step":' + b"9" * 40 + b"}\n", "line 2 has step"),
    (b'{"type":"step","run_id":"r","rank":0,"step":2.0}\n', "line 2 has step"),
    (b'{"type":"step","run_id":"r","rank":0,"step":2,"wall_time_s":NaN}\n', "line 2 is not JSON"),
    (b'{"type":"step","run_id":"r","rank":0,"step":2,"x":' + b"[" * 100_000 + b"]" * 100_000
     + b"}\n", "line 2 is not JSON"),
    (b'{"type":"step","run_id":"r","rank":0,"step":2,}\n', "line 2 is not JSON"),
    (b'{"type":"step","run_id":"r","rank":false,"step":2}\n', "line 2 has rank"),
    (b'{"type":"step","run_id":"r","rank":3,"step":2}\n', "line 2 has rank 3"),
    (b'{"run_id":"r","rank":0,"step":2}\n', "line 2 lacks the string fields"),
    (b"\n", "line 2 is not JSON"),
    (b'{"type":"step","run_id":"r","rank":0,"step":2}{"type":"step","run_id":"r","rank":0,'
     b'"step":3}\n', "line 2 is not JSON"),
    # A newline inside a value, paid back by two values on the next line: as many values as
    # lines, but line 2 is not JSON on its own.
    (b'{"type":"step","run_id":"r","rank":0,"step":2,"x":[\n'
     b']}{"type":"step","run_id":"r","rank":0,"step":3}\n', "line 2 is not JSON"),
])
def test_hostile_lines_of_a_sealed_segment_are_refused_by_segment_and_line(
        tmp_path, second, problem):
    run, path = _sealed(tmp_path, [_GOOD, second])
    db = tmp_path / "t.duckdb"
    with pytest.raises(TelemetryFormatError) as caught:
        store.ingest(run, db)
    assert str(path) in str(caught.value) and problem in str(caught.value)
    assert not db.exists()  # checked before the database is opened


def test_a_sealed_line_of_another_run_is_refused_as_misplaced(tmp_path):
    run, path = _sealed(tmp_path, [_GOOD, _GOOD.replace(b'"run_id":"r"', b'"run_id":"q"')])
    with pytest.raises(ValueError, match="line 2 belongs to run 'q'"):
        store.ingest(run, tmp_path / "t.duckdb")


def test_unusual_but_valid_sealed_lines_take_the_strict_path_and_are_stored_canonical(tmp_path):
    run, _ = _sealed(tmp_path, [_GOOD, '{"type":"note","run_id":"r","rank":0,"step":2,'
                                       '"text":"caf\u00e9"}\n'.encode()])
    db = tmp_path / "t.duckdb"
    assert store.ingest(run, db) == 2
    assert store.run_events(db, "r")[1]["text"] == "caf\u00e9"
    payloads = [row[-1] for row in _table(db)]
    assert '{"type":"note","run_id":"r","rank":0,"step":2,"text":"caf\\u00e9"}' in payloads


def test_a_malformed_line_in_a_later_batch_rolls_the_whole_ingest_back(tmp_path, monkeypatch):
    with SegmentWriter(tmp_path, "run-1", events_per_segment=5) as writer:
        for step in range(1, 21):
            writer.write(_step(step))
    db = tmp_path / "t.duckdb"
    assert store.ingest(tmp_path / "run-1", db) == 20
    with SegmentWriter(tmp_path, "run-1", events_per_segment=5) as writer:
        for step in range(21, 41):
            writer.write(_step(step))
    last = sorted((tmp_path / "run-1" / "rank0").glob("segment-*.jsonl"))[-1]
    last.write_bytes(last.read_bytes() + b"not json\n")  # an open segment now (no marker edit)
    last.with_suffix(".complete").unlink()
    monkeypatch.setattr(store, "BATCH_LINES", 5)
    with pytest.raises(TelemetryFormatError, match="line 6 is not JSON"):
        store.ingest(tmp_path / "run-1", db)
    assert len(_table(db)) == 20  # the batches before the bad line were rolled back too


def test_depth_near_the_recursion_limit_is_left_to_the_strict_path():
    def nested(depth: int) -> bytes:
        return (b'{"type":"step","run_id":"r","rank":0,"step":1,"x":' + b"[" * depth
                + b"]" * depth + b"}\n")
    deepest = 0  # what the standard library accepts from here
    for depth in range(sys.getrecursionlimit(), 0, -10):
        try:
            json.loads(nested(depth))
        except RecursionError:
            continue
        deepest = depth
        break
    assert ingest_fast.sealed_columns(nested(deepest + 10), "r", 0) is None
    assert ingest_fast.sealed_columns(nested(deepest - 40), "r", 0) is None  # the margin
    assert ingest_fast.sealed_columns(nested(10), "r", 0) is not None


def test_concurrent_ingests_in_one_process_store_each_line_once(tmp_path):
    run = _written_run(tmp_path, steps=200)
    db = tmp_path / "t.duckdb"
    added = []
    threads = [threading.Thread(target=lambda: added.append(store.ingest(run, db)))
               for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert sorted(added) == [0, 0, 0, 206]
    assert len(_table(db)) == 206


def test_a_store_with_the_old_primary_key_keeps_working(tmp_path):
    db = tmp_path / "old.duckdb"
    with duckdb.connect(str(db)) as con:
        con.execute(store._CREATE.replace(
            "payload JSON NOT NULL\n", "payload JSON NOT NULL,\n"
            "    PRIMARY KEY (run_id, rank, segment, segment_key, line_no)\n"))
    run = _written_run(tmp_path)
    assert store.ingest(run, db) == 46 and store.ingest(run, db) == 0
    fresh = tmp_path / "fresh.duckdb"
    store.ingest(run, fresh)
    assert _table(db) == _table(fresh)


def test_lines_stored_between_the_look_and_the_lock_are_not_stored_twice(tmp_path, monkeypatch):
    run = _written_run(tmp_path)
    db = tmp_path / "t.duckdb"
    assert store.ingest(run, db) == 46
    # As if another ingest stored them after this one's read-only look: it saw nothing stored.
    monkeypatch.setattr(store, "_stored_lines", lambda run_id, db_path, lock_timeout_s: {})
    assert store.ingest(run, db) == 0
    assert len(_table(db)) == 46


def test_ingest_report_names_the_torn_lines_sealed_segments_declare(tmp_path):
    killed = SegmentWriter(tmp_path, "run-1")
    for step in range(1, 4):
        killed.write(_step(step))
    with open(killed.segment_path, "ab") as handle:
        handle.write(b'{"type":"step","run_')  # the line it was writing when killed
    with SegmentWriter(tmp_path, "run-1") as resumed:  # seals the old segment as recovered
        resumed.write(_step(4))
    report = store.ingest_report(tmp_path / "run-1", tmp_path / "t.duckdb")
    assert report.new_rows == 4 and report.torn_lines == 1
    assert report.torn_bytes == len(b'{"type":"step","run_')
    assert report.torn_segments == (str(killed.segment_path),)
    assert store.ingest(tmp_path / "run-1", tmp_path / "t.duckdb") == 0


# --- replay flags set as rows are inserted; batches; integrity (issue 29) -------------------

_WRONG_FLAGS = f"""
    SELECT count(*) FROM (
        SELECT is_replay, event_type IN {store.REPLAYABLE_EVENT_TYPES} AND row_number() OVER (
            PARTITION BY run_id, run_instance, rank, event_type, step
            ORDER BY segment, line_no) > 1 AS replay
        FROM {store.TABLE})
    WHERE is_replay IS DISTINCT FROM replay"""


def _wrong_flags(db) -> int:
    """Rows whose `is_replay` differs from its definition, computed over the whole table."""
    with duckdb.connect(str(db), read_only=True) as con:
        return con.execute(_WRONG_FLAGS).fetchone()[0]


def _eval(step: int, run_id: str = "run-1", rank: int = 0) -> EvalEvent:
    return EvalEvent(run_id=run_id, rank=rank, step=step, wall_time_s=2000.0 + step,
                     eval_loss=1.0, eval_accuracy=None, eval_examples=8, eval_ms=1.0)


class _Recorder:
    """Counts `_mark_replays` calls and keeps every `ReplayFlags` an ingest makes."""

    def __init__(self, monkeypatch):
        self.marks, self.flags = 0, []
        real_mark, real_flags = store._mark_replays, store.ReplayFlags
        recorder = self

        def mark(con):
            recorder.marks += 1
            real_mark(con)

        class Flags(real_flags):
            def __init__(self, *args):
                super().__init__(*args)
                recorder.flags.append(self)

        monkeypatch.setattr(store, "_mark_replays", mark)
        monkeypatch.setattr(store, "ReplayFlags", Flags)


@pytest.mark.parametrize("seed", range(6))
def test_flags_set_on_insert_equal_their_definition_over_resumes_ranks_and_ingests(
        tmp_path, monkeypatch, seed):
    """Random runs: each rank resumed several times from an earlier step (its steps and evals
    written again), ingested after some of the processes, in small batches: every stored
    flag is what the window over the whole table says, and no UPDATE marked any."""
    import random

    rng = random.Random(seed)
    recorder = _Recorder(monkeypatch)
    monkeypatch.setattr(store, "BATCH_LINES", rng.choice([3, 8, 50]))
    db = tmp_path / "t.duckdb"
    step = dict.fromkeys(range(2), 0)
    stored = 0
    for _process in range(5):
        for rank in range(2):
            writer = SegmentWriter(tmp_path, "run-1", rank=rank,
                                   events_per_segment=rng.choice([2, 5, 9]))
            step[rank] = max(0, step[rank] - rng.randrange(0, 12))  # resumed from earlier
            for _ in range(rng.randrange(1, 25)):
                step[rank] += 1
                writer.write(dataclasses.replace(_step(step[rank]), rank=rank))
                if step[rank] % rng.choice([3, 4]) == 0:
                    writer.write(_eval(step[rank], rank=rank))
            if rng.random() < 0.5:
                writer.close()  # else left open: its tail is ingested as it grows
        if rng.random() < 0.7:
            stored += store.ingest(tmp_path / "run-1", db)
            assert _wrong_flags(db) == 0
    stored += store.ingest(tmp_path / "run-1", db)
    assert _wrong_flags(db) == 0
    assert len(_table(db)) == stored
    assert recorder.marks == 0  # every flag was set on insert
    assert sum(replay for _, _, replay in store.replay_flags(db, "run-1")) > 0


def test_replays_of_steps_an_earlier_ingest_stored_are_looked_up_in_the_store(tmp_path,
                                                                              monkeypatch):
    recorder = _Recorder(monkeypatch)
    db = tmp_path / "t.duckdb"
    with SegmentWriter(tmp_path, "run-1", events_per_segment=4) as first:
        for step in range(1, 11):
            first.write(_step(step))
            if step % 5 == 0:
                first.write(_eval(step))
    assert store.ingest(tmp_path / "run-1", db) == 12
    with SegmentWriter(tmp_path, "run-1", events_per_segment=4) as resumed:  # from step 5
        for step in range(6, 13):
            resumed.write(_step(step))
            if step % 5 == 0:
                resumed.write(_eval(step))
    assert store.ingest(tmp_path / "run-1", db) == 8
    assert recorder.marks == 0 and recorder.flags[-1].lookups == 2  # steps, then evals
    replays = [(kind, step) for kind, step, replay in store.replay_flags(db, "run-1") if replay]
    assert replays == [("step", step) for step in range(6, 11)] + [("eval", 10)]
    assert _wrong_flags(db) == 0


def test_a_segment_arriving_after_later_ones_were_stored_has_its_group_recomputed(
        tmp_path, monkeypatch):
    """Segment 1 is missing when 0 and 2 are ingested (copied late); once it arrives, rows of
    segment 2 that repeat its steps become replays: the group's flags are recomputed."""
    source = tmp_path / "source"
    with SegmentWriter(source, "run-1", events_per_segment=5) as first:
        for step in range(1, 11):  # segments 0 and 1
            first.write(_step(step))
    with SegmentWriter(source, "run-1", events_per_segment=5) as resumed:  # segment 2
        for step in range(4, 9):
            resumed.write(_step(step))
    late = tmp_path / "late" / "run-1" / "rank0"
    late.mkdir(parents=True)
    for name in ("segment-00000", "segment-00002"):
        for suffix in (".jsonl", ".complete"):
            (late / f"{name}{suffix}").write_bytes(
                (source / "run-1" / "rank0" / f"{name}{suffix}").read_bytes())
    recorder = _Recorder(monkeypatch)
    db = tmp_path / "t.duckdb"
    assert store.ingest(late.parent, db) == 10
    assert recorder.marks == 0 and _wrong_flags(db) == 0  # 4 and 5 are replays already
    for suffix in (".jsonl", ".complete"):
        (late / f"segment-00001{suffix}").write_bytes(
            (source / "run-1" / "rank0" / f"segment-00001{suffix}").read_bytes())
    assert store.ingest(late.parent, db) == 5
    assert recorder.marks == 1 and recorder.flags[-1].recompute == {(
        "run-1", _table(db)[0][1], 0)}
    assert _wrong_flags(db) == 0
    fresh = tmp_path / "fresh.duckdb"
    store.ingest(source / "run-1", fresh)
    assert _table(db) == _table(fresh)
    assert sum(replay for _, _, replay in store.replay_flags(db, "run-1")) == 5  # 4..8


def test_a_group_that_needs_too_many_store_lookups_is_recomputed(tmp_path, monkeypatch):
    recorder = _Recorder(monkeypatch)
    monkeypatch.setattr(store.ReplayFlags, "MAX_LOOKUPS", 0)
    db = tmp_path / "t.duckdb"
    with SegmentWriter(tmp_path, "run-1") as first:
        for step in range(1, 6):
            first.write(_step(step))
    store.ingest(tmp_path / "run-1", db)
    with SegmentWriter(tmp_path, "run-1") as resumed:
        for step in range(3, 8):
            resumed.write(_step(step))
    assert store.ingest(tmp_path / "run-1", db) == 5
    assert recorder.marks == 1 and recorder.flags[-1].lookups == 0
    assert _wrong_flags(db) == 0
    assert sum(replay for _, _, replay in store.replay_flags(db, "run-1")) == 3


def test_ingest_streams_the_run_in_batches_of_bounded_size(tmp_path, monkeypatch):
    """Memory holds one batch: batches are at most BATCH_LINES plus one segment less a line,
    and when a batch is inserted no segment after it has been read yet."""
    with SegmentWriter(tmp_path, "run-1", events_per_segment=7) as writer:
        for step in range(1, 101):  # 14 sealed segments of 7 lines and one open of 2
            writer.write(_step(step))
    monkeypatch.setattr(store, "BATCH_LINES", 20)
    read: list[int] = []
    real_body = store.segment_body
    monkeypatch.setattr(store, "segment_body", lambda segment, data: (
        read.append(segment.index), real_body(segment, data))[1])
    inserted: list[tuple[int, list[int], int]] = []  # (rows, segments in it, segments read)
    real_insert = store._insert
    monkeypatch.setattr(store, "_insert", lambda con, batch, flags=None: (
        inserted.append((batch.rows.num_rows, [part.segment for part in batch.parts],
                         len(read))), real_insert(con, batch, flags))[1])
    assert store.ingest(tmp_path / "run-1", tmp_path / "t.duckdb") == 100
    assert [rows for rows, _, _ in inserted] == [21, 21, 21, 21, 16]
    assert all(rows < 20 + 7 for rows, _, _ in inserted)
    segments_so_far = 0
    for _, segments, read_when_inserted in inserted:
        segments_so_far += len(segments)
        assert read_when_inserted == segments_so_far  # nothing read ahead of the batch
    assert read == list(range(15))


def test_a_sealed_segment_edited_after_sealing_is_refused_before_anything_is_stored(tmp_path):
    with SegmentWriter(tmp_path, "run-1", events_per_segment=5) as writer:
        for step in range(1, 11):
            writer.write(_step(step))
    second = tmp_path / "run-1" / "rank0" / "segment-00001.jsonl"
    data = second.read_bytes()
    edited = data.replace(b'"samples_seen":64', b'"samples_seen":65', 1)  # same length
    assert edited != data and len(edited) == len(data)
    second.write_bytes(edited)
    db = tmp_path / "t.duckdb"
    with pytest.raises(TelemetryFormatError, match="does not match its completion marker") as caught:
        store.ingest(tmp_path / "run-1", db)
    assert str(second) in str(caught.value)
    assert not db.exists()


@pytest.mark.parametrize(("field", "problem"), [
    (b'"step":7', b'"step":"7"'),
    (b'"wall_time_s":1007.0', b'"wall_time_s":"1007.0"'),
    (b'"rank":0', b'"rank":0.0'),
])
def test_a_sealed_line_off_the_schema_is_refused_by_file_and_line(tmp_path, field, problem):
    """A segment sealed over a line whose field has the wrong type (the marker's sha256 holds:
    it vouches for bytes, not for what they say) is refused, naming the file and the line."""
    with SegmentWriter(tmp_path, "run-1", events_per_segment=10) as writer:
        for step in range(1, 11):
            writer.write(_step(step))
    path = tmp_path / "run-1" / "rank0" / "segment-00000.jsonl"
    lines = path.read_bytes().split(b"\n")
    assert field in lines[6]
    lines[6] = lines[6].replace(field, problem)
    path.write_bytes(b"\n".join(lines))
    seal_segment(path)
    db = tmp_path / "t.duckdb"
    with pytest.raises(TelemetryFormatError, match="line 7 has") as caught:
        store.ingest(tmp_path / "run-1", db)
    assert str(path) in str(caught.value)
    assert not db.exists()
