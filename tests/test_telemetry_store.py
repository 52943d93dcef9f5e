"""DuckDB ingestion: idempotent, grows with an open segment, read-only queries."""

from __future__ import annotations

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
