"""A full telemetry disk loses no rows (issue 31, class 5): the records the disk refused (the
failing step's step and eval rows, the stop's checkpoint and run_end) are kept in the run
ledger and written first when the run resumes, so they reach DuckDB exactly once."""

from __future__ import annotations

from collections import Counter

import duckdb
import pytest

import telemetry.writer
from telemetry.reader import read_run_events
from telemetry.store import ingest
from tests.test_training_loop import text_examples, tiny_config
from tests.test_training_loop_faults import TelemetryDiskFull
from training.loop import TrainingStoppedError, train

MAX_STEPS = 24  # tiny_config: evals at 8, 16, 24


def stored(db_path, run_id: str = "tiny") -> list[tuple[str, int, bool, float]]:
    with duckdb.connect(str(db_path), read_only=True) as con:
        return con.execute(
            "SELECT event_type, step, is_replay, CAST(payload ->> 'wall_time_s' AS DOUBLE) "
            "FROM telemetry_events WHERE run_id = ?", [run_id]).fetchall()


def fresh_steps(rows, kind: str) -> Counter:
    return Counter(step for event_type, step, replay, _ in rows if event_type == kind and not replay)


def run_through_a_full_disk(tmp_path, monkeypatch, budget: int, *, full_resumes: int = 0):
    """Trains until the telemetry disk refuses a write after `budget` writes, resumes
    `full_resumes` times with the disk still full, then frees it and resumes to the end."""
    out_dir = tmp_path / "run"
    disk = TelemetryDiskFull(out_dir / "telemetry", budget=budget)
    monkeypatch.setattr(telemetry.writer, "_write_fd", disk)
    with pytest.raises(TrainingStoppedError):
        train(tiny_config(), text_examples(), None, out_dir)
    for _ in range(full_resumes):
        disk.budget = 1  # room for one more line: the resume stops again at once
        with pytest.raises(TrainingStoppedError):
            train(tiny_config(), text_examples(), None, out_dir,
                  resume_from=out_dir / "checkpoints")
    disk.full = False  # space freed
    result = train(tiny_config(), text_examples(), None, out_dir,
                   resume_from=out_dir / "checkpoints")
    assert result.status == "completed" and result.steps == MAX_STEPS
    return out_dir, result


@pytest.mark.parametrize("budget", [3, 11, 20, 31, 33])  # 31: the last step, 33: the final eval
def test_the_failing_steps_rows_reach_the_store_after_the_resume(tmp_path, monkeypatch, budget):
    out_dir, result = run_through_a_full_disk(tmp_path, monkeypatch, budget)
    db = tmp_path / "t.duckdb"
    lines = len(read_run_events(result.telemetry_dir))
    assert ingest(result.telemetry_dir, db) == lines
    assert ingest(result.telemetry_dir, db) == 0  # idempotent
    rows = stored(db)
    steps = fresh_steps(rows, "step")
    assert sorted(steps) == list(range(1, MAX_STEPS + 1)) and set(steps.values()) == {1}
    evals = fresh_steps(rows, "eval")
    assert {8, 16, 24} <= set(evals) and set(evals.values()) == {1}
    # Every record kept for the resume landed once: no two rows share type, step and clock.
    identities = Counter((kind, step, wall) for kind, step, _, wall in rows)
    assert max(identities.values()) == 1
    ends = [e for e in read_run_events(result.telemetry_dir) if e["type"] == "run_end"]
    assert [e["status"] for e in ends] == ["failed", "completed"]  # the stop is recorded too


def test_rows_kept_across_a_resume_the_full_disk_stops_again_land_once(tmp_path, monkeypatch):
    _, result = run_through_a_full_disk(tmp_path, monkeypatch, budget=20, full_resumes=2)
    db = tmp_path / "t.duckdb"
    ingest(result.telemetry_dir, db)
    rows = stored(db)
    steps = fresh_steps(rows, "step")
    assert sorted(steps) == list(range(1, MAX_STEPS + 1)) and set(steps.values()) == {1}
    identities = Counter((kind, step, wall) for kind, step, _, wall in rows)
    assert max(identities.values()) == 1
