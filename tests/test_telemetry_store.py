"""DuckDB ingestion: idempotent, grows with an open segment, read-only queries."""

from __future__ import annotations

import json

import duckdb
import pytest

from telemetry.events import EvalEvent, StepEvent
from telemetry.store import TABLE, ingest, run_events, run_ids
from telemetry.writer import SegmentWriter


def _step(step: int, run_id: str = "run-1") -> StepEvent:
    return StepEvent(
        run_id=run_id, step=step, wall_time_s=1000.0 + step, train_loss=1.0 / step,
        learning_rate=1e-3, grad_norm=0.5, grad_noise_scale=float("nan"), micro_batch_size=8,
        grad_accum_steps=1, step_time_ms=10.0, samples_seen=8 * step, tokens_seen=0,
        elapsed_s=float(step), cost_usd=0.001 * step,
    )


def test_ingest_twice_counts_once(tmp_path):
    with SegmentWriter(tmp_path, "run-1", events_per_segment=2) as writer:
        for step in range(1, 6):
            writer.write(_step(step))
        writer.write(EvalEvent(run_id="run-1", step=5, eval_loss=0.7, eval_accuracy=None,
                               eval_examples=32, eval_ms=3.0))
    db = tmp_path / "db" / "telemetry.duckdb"
    assert ingest(tmp_path / "run-1", db) == 6
    assert ingest(tmp_path / "run-1", db) == 0
    records = run_events(db, "run-1")
    assert [r["step"] for r in records] == [1, 2, 3, 4, 5, 5]
    assert [r["type"] for r in run_events(db, "run-1", event_type="eval")] == ["eval"]
    assert records[0]["grad_noise_scale"] is None
    with duckdb.connect(str(db), read_only=True) as con:
        assert con.execute(f"SELECT count(*) FROM {TABLE}").fetchone() == (6,)
        loss = con.execute(
            f"SELECT json_extract(payload, '$.train_loss')::DOUBLE FROM {TABLE} WHERE step = 2"
        ).fetchone()
    assert loss == (0.5,)


def test_an_open_segment_ingested_as_it_grows_stores_each_line_once(tmp_path):
    db = tmp_path / "telemetry.duckdb"
    writer = SegmentWriter(tmp_path, "run-1")
    writer.write(_step(1))
    writer.write(_step(2))
    assert ingest(tmp_path / "run-1", db) == 2
    writer.write(_step(3))
    with open(writer.segment_path, "a", encoding="utf-8") as handle:
        handle.write('{"torn":')  # a line being written right now
    assert ingest(tmp_path / "run-1", db) == 1
    assert [r["step"] for r in run_events(db, "run-1")] == [1, 2, 3]


def test_runs_are_kept_apart_and_misplaced_files_refused(tmp_path):
    db = tmp_path / "telemetry.duckdb"
    for run_id in ("run-b", "run-a"):
        with SegmentWriter(tmp_path, run_id) as writer:
            writer.write(_step(1, run_id=run_id))
        ingest(tmp_path / run_id, db)
    assert run_ids(db) == ["run-a", "run-b"]
    assert len(run_events(db, "run-a")) == 1
    (tmp_path / "run-a").rename(tmp_path / "run-c")
    with pytest.raises(ValueError, match="belongs to run 'run-a'"):
        ingest(tmp_path / "run-c", db)
    with pytest.raises(FileNotFoundError, match="ingest a run first"):
        run_events(tmp_path / "none.duckdb", "run-a")


def test_read_only_queries_do_not_block_another_reader(tmp_path):
    db = tmp_path / "telemetry.duckdb"
    with SegmentWriter(tmp_path, "run-1") as writer:
        writer.write(_step(1))
    ingest(tmp_path / "run-1", db)
    with duckdb.connect(str(db), read_only=True):
        assert len(run_events(db, "run-1")) == 1


def _stored(db):
    with duckdb.connect(str(db), read_only=True) as con:
        return con.execute(f"SELECT * FROM {TABLE} ORDER BY ALL").fetchall()


def test_lines_stored_as_one_batch_equal_lines_encoded_one_by_one(tmp_path, monkeypatch):
    """The stored payload is each record's canonical text; a segment whose lines are canonical
    stores its lines as they are (`canonical_payloads`), others are re-encoded line by line."""
    import telemetry.store as store

    with SegmentWriter(tmp_path, "run-1", events_per_segment=3) as writer:
        for step in range(1, 8):
            writer.write(_step(step))
    # Hand-written lines (an open segment): spaces, non-ASCII, an escape, 1E2, a duplicate key.
    (tmp_path / "run-1" / "rank0" / "segment-00003.jsonl").write_bytes((
        '{"type": "note", "run_id": "run-1", "rank": 0, "step": 8, "text": "caf\u00e9 \\u0041"}\n'
        '{"type":"note","run_id":"run-1","rank":0,"step":9,"x":1E2,"x":0.10000000000000001}\n'
    ).encode("utf-8"))
    batch_db, single_db = tmp_path / "batch.duckdb", tmp_path / "single.duckdb"
    assert ingest(tmp_path / "run-1", batch_db) == 9
    monkeypatch.setattr(store, "canonical_payloads", lambda records, texts: [
        json.dumps(record, separators=(",", ":")) for record in records])  # the old per line
    assert ingest(tmp_path / "run-1", single_db) == 9
    assert _stored(batch_db) == _stored(single_db)
    payloads = [row[-1] for row in _stored(batch_db) if row[6] == "note"]
    assert '"text":"caf\\u00e9 A"' in payloads[0] and '"x":0.1}' in payloads[1]


def test_canonical_payloads_keeps_canonical_lines_and_reencodes_the_others():
    from telemetry.store import canonical_payload, canonical_payloads

    records = [{"a": 1.5, "b": "x y"}, {"c": [1, {"d": None}]}]
    texts = [canonical_payload(record) for record in records]
    assert canonical_payloads(records, texts) is texts
    spaced = ['{"a": 1.5, "b": "x y"}', texts[1]]
    assert canonical_payloads(records, spaced) == texts
    assert canonical_payloads(records, None) == texts


def test_a_new_database_appears_at_its_path_whole(tmp_path, monkeypatch):
    """Concurrent first ingests once met a file another process was still creating ("not a
    valid DuckDB database file"): the file is made under a temp name and linked in whole."""
    import os
    from pathlib import Path

    from telemetry import store

    linked = []
    real_link = os.link

    def checking_link(source, target):
        with duckdb.connect(str(source), read_only=True):  # already a valid database
            pass
        linked.append(Path(target).name)
        real_link(source, target)

    monkeypatch.setattr(store.os, "link", checking_link)
    db = tmp_path / "new.duckdb"
    with store.connect_with_retry(db) as con:
        con.execute("CREATE TABLE t (a INTEGER)")
    assert linked == ["new.duckdb"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["new.duckdb"]  # no temp file left
    with store.connect_with_retry(db) as con:  # an existing file is opened as it is
        assert con.execute("SELECT count(*) FROM t").fetchone() == (0,)
    assert linked == ["new.duckdb"]
