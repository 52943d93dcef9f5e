"""DuckDB store of telemetry: idempotent ingestion of segments and read-only queries.

One table, `telemetry_events`, keyed on (run_id, rank, segment, line_no): ingesting a segment
twice, or an open segment now and again once it has grown, stores each line once. Connections
are short-lived (DuckDB admits one read-write process per file, and dbt needs that lock), and the
query helpers open the file `read_only=True`.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import duckdb
import pyarrow as pa

from telemetry.reader import list_segments, read_segment_lines

TABLE = "telemetry_events"

_CREATE = f"""
CREATE TABLE IF NOT EXISTS {TABLE} (
    run_id VARCHAR NOT NULL,
    rank INTEGER NOT NULL,
    segment INTEGER NOT NULL,
    line_no INTEGER NOT NULL,
    event_type VARCHAR NOT NULL,
    step BIGINT,
    wall_time_s DOUBLE,
    payload JSON NOT NULL,
    PRIMARY KEY (run_id, rank, segment, line_no)
)
"""


def ingest(run_dir: str | Path, db_path: str | Path) -> int:
    """Loads every complete line of a run's segments into DuckDB; returns how many were new.

    `run_dir` is `<telemetry_dir>/<run_id>`; its folder name is the run id, and every record must
    carry it (a record of another run means a misplaced file and raises).
    """
    run_dir = Path(run_dir)
    run_id = run_dir.name
    columns: dict[str, list[Any]] = {
        name: []
        for name in ("run_id", "rank", "segment", "line_no", "event_type", "step", "wall_time_s",
                     "payload")
    }
    for segment in list_segments(run_dir):
        for line_no, record in read_segment_lines(segment):
            if record.get("run_id") != run_id:
                raise ValueError(
                    f"{segment.path} line {line_no} belongs to run {record.get('run_id')!r}, not "
                    f"{run_id!r}; move the file to its own run folder"
                )
            columns["run_id"].append(run_id)
            columns["rank"].append(segment.rank)
            columns["segment"].append(segment.index)
            columns["line_no"].append(line_no)
            columns["event_type"].append(str(record.get("type", "")))
            columns["step"].append(record.get("step"))
            columns["wall_time_s"].append(record.get("wall_time_s"))
            columns["payload"].append(json.dumps(record, separators=(",", ":")))
    schema = pa.schema([
        ("run_id", pa.string()), ("rank", pa.int32()), ("segment", pa.int32()),
        ("line_no", pa.int32()), ("event_type", pa.string()), ("step", pa.int64()),
        ("wall_time_s", pa.float64()), ("payload", pa.string()),
    ])
    rows = pa.table(columns, schema=schema)
    Path(db_path).parent.mkdir(parents=True, exist_ok=True)
    with duckdb.connect(str(db_path)) as con:
        con.execute(_CREATE)
        if rows.num_rows == 0:
            return 0
        con.register("incoming_rows", rows)
        inserted = con.execute(
            f"INSERT OR IGNORE INTO {TABLE} SELECT * FROM incoming_rows"
        ).fetchone()
    return int(inserted[0]) if inserted else 0


def _connect_read_only(db_path: str | Path) -> duckdb.DuckDBPyConnection:
    if not Path(db_path).exists():
        raise FileNotFoundError(
            f"telemetry database {db_path} does not exist; ingest a run first "
            "(telemetry.store.ingest)"
        )
    return duckdb.connect(str(db_path), read_only=True)


def run_events(
    db_path: str | Path, run_id: str, *, event_type: str | None = None
) -> list[dict[str, Any]]:
    """The records of one run (optionally of one type), in order (rank, segment, line)."""
    query = f"SELECT payload FROM {TABLE} WHERE run_id = ?"
    params: list[Any] = [run_id]
    if event_type is not None:
        query += " AND event_type = ?"
        params.append(event_type)
    query += " ORDER BY rank, segment, line_no"
    with _connect_read_only(db_path) as con:
        return [json.loads(payload) for (payload,) in con.execute(query, params).fetchall()]


def run_ids(db_path: str | Path) -> list[str]:
    """Every run id in the store, sorted."""
    with _connect_read_only(db_path) as con:
        rows = con.execute(f"SELECT DISTINCT run_id FROM {TABLE} ORDER BY run_id").fetchall()
    return [run_id for (run_id,) in rows]
