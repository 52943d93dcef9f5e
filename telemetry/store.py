"""DuckDB store of telemetry: idempotent ingestion of segments and read-only queries.

One table, `telemetry_events`, one row per telemetry line.

Segment identity (issue 8, defect 3). Segment file names restart at `segment-00000` in every run
folder, so a key on (run_id, rank, segment index, line) silently dropped all rows of a second,
different run that reused a run id. Each segment is therefore identified by `segment_key`: the
first 16 hex digits of the sha256 of its first line's record (as stored in `payload`). The first
line of a segment never changes once written (segments are append-only, sealed ones are checked
against their marker) and it carries the writer's wall-clock time to the microsecond, so:
re-ingesting the same files (or an open segment as it grows) yields the same keys and stores
nothing new, while another run's segment 0 has another key and keeps its rows. A content key
needs no change to the file format, and old files get keys too. The primary key is
(run_id, rank, segment, segment_key, line_no).

Run instance and replays. `run_instance` is the `segment_key` of the first non-empty segment of
the rank: the same for every process that wrote into one run folder (a resumed process appends
segments to the same folder), different for an unrelated run reusing the id. A step (or eval)
event whose (run_id, run_instance, rank, type, step) already appeared earlier in (segment, line)
order was written again after a resume from an older checkpoint: it gets `is_replay = true`;
queries count its time as preemption waste, never as new training (dbt/models). The flag is
recomputed in SQL for every touched (run, instance, rank) after each insert, so ingestion stays
incremental and idempotent even when files arrive out of order.

Re-ingestion. A sealed segment whose lines the store already holds (same key, same count) is
checked against its marker and not parsed again (`_segment_lines`): re-ingesting a run costs
reading and hashing its files, not parsing them (benchmarks/ingestion.py measures both).
A first ingestion parses and validates every line with the standard library's C decoder (one
decoder for all lines) and checks the stored texts with one encoding per segment
(`canonical_payloads`); those two C calls are most of its time, the DuckDB insert the rest.

Locks. DuckDB admits one read-write process per file (and dbt needs that lock), so connections
are short-lived, the query helpers open the file `read_only=True`, and both wait on a held lock
with exponential backoff and jitter up to `lock_timeout_s`, then raise `TelemetryStoreBusyError`
naming the file and the holder's pid and program.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import re
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import duckdb
import pyarrow as pa

from telemetry.reader import Segment, list_segments, parse_line, parse_text, sealed_body

TABLE = "telemetry_events"
REPLAYABLE_EVENT_TYPES = ("step", "eval")  # repeated work when a resume replays steps

_CREATE = f"""
CREATE TABLE IF NOT EXISTS {TABLE} (
    run_id VARCHAR NOT NULL,
    run_instance VARCHAR NOT NULL,
    rank INTEGER NOT NULL,
    segment INTEGER NOT NULL,
    segment_key VARCHAR NOT NULL,
    line_no INTEGER NOT NULL,
    event_type VARCHAR NOT NULL,
    step BIGINT,
    wall_time_s DOUBLE,
    is_replay BOOLEAN NOT NULL DEFAULT false,
    payload JSON NOT NULL,
    PRIMARY KEY (run_id, rank, segment, segment_key, line_no)
)
"""
_COLUMNS = ("run_id", "run_instance", "rank", "segment", "segment_key", "line_no", "event_type",
            "step", "wall_time_s", "payload")
_SCHEMA = pa.schema([
    ("run_id", pa.string()), ("run_instance", pa.string()), ("rank", pa.int32()),
    ("segment", pa.int32()), ("segment_key", pa.string()), ("line_no", pa.int32()),
    ("event_type", pa.string()), ("step", pa.int64()), ("wall_time_s", pa.float64()),
    ("payload", pa.string()),
])
# Replays of touched (run, instance, rank) groups, recomputed from scratch: idempotent.
_MARK_REPLAYS = f"""
UPDATE {TABLE} AS t SET is_replay = r.replay
FROM (
    SELECT run_id, rank, segment, segment_key, line_no,
           row_number() OVER (
               PARTITION BY run_id, run_instance, rank, event_type, step
               ORDER BY segment, line_no) > 1 AS replay
    FROM {TABLE}
    WHERE event_type IN {REPLAYABLE_EVENT_TYPES}
      AND (run_id, run_instance, rank) IN (SELECT * FROM touched_groups)
) AS r
WHERE t.run_id = r.run_id AND t.rank = r.rank AND t.segment = r.segment
  AND t.segment_key = r.segment_key AND t.line_no = r.line_no
  AND t.is_replay IS DISTINCT FROM r.replay
"""
_DUCKDB_MAGIC = b"DUCK"  # bytes 8..12 of every DuckDB database file
_HOLDER = re.compile(r"Conflicting lock is held in (.*?) \(PID (\d+)\)")


class TelemetryStoreBusyError(TimeoutError):
    """Another process held the DuckDB file's lock for longer than the timeout."""


# `json.dumps(record, separators=(",", ":"))` with one encoder instead of one per call.
_ENCODER = json.JSONEncoder(separators=(",", ":"))


def canonical_payload(record: dict[str, Any]) -> str:
    """The stored text of a record (and the input of `segment_key`)."""
    return _ENCODER.encode(record)


def canonical_payloads(records: list[dict[str, Any]], texts: list[str] | None) -> list[str]:
    """`canonical_payload` of each record, given the line texts they were parsed from (or None).

    The writer writes the canonical text, so one encoding of the whole list usually equals the
    lines joined, and then each line is its record's canonical text (a line is a complete JSON
    object: were line i longer or shorter than its record's text, one of the two would be an
    object followed by a comma, which `parse_text` refuses and `json.dumps` never writes). One
    C call and one comparison instead of one encoder per line; any other line is re-encoded.
    """
    if texts is not None and _ENCODER.encode(records) == f"[{','.join(texts)}]":
        return texts
    return [_ENCODER.encode(record) for record in records]


def segment_key(first_record: dict[str, Any]) -> str:
    return hashlib.sha256(canonical_payload(first_record).encode("utf-8")).hexdigest()[:16]


def check_db_path(path: str | Path) -> None:
    """Raises ValueError, naming the path and the fix, unless `path` can be a DuckDB database.

    Refused: a folder; a path whose nearest existing parent is not a folder or not writable (a
    file is created there to check, and removed); an existing file that is not a DuckDB database.
    A missing file is fine (ingest creates it, with its missing parents).
    """
    path = Path(path)
    setting = "set TRAINWISE_DUCKDB_PATH to a file path such as <state>/telemetry.duckdb"
    if path.is_dir():
        raise ValueError(f"telemetry database path {path} is a folder; {setting}")
    if path.exists():
        with open(path, "rb") as handle:
            header = handle.read(12)
        if header[8:12] != _DUCKDB_MAGIC:
            raise ValueError(
                f"telemetry database path {path} exists but is not a DuckDB database (empty or "
                f"another kind of file); move it away or {setting}"
            )
        if not os.access(path, os.R_OK | os.W_OK):
            raise ValueError(f"telemetry database {path} is not readable and writable; fix its "
                             f"permissions or {setting}")
        return
    parent = path.parent
    while not parent.exists() and parent != parent.parent:
        parent = parent.parent
    if not parent.is_dir():
        raise ValueError(f"telemetry database path {path}: {parent} is not a folder; {setting}")
    try:  # os.access says yes to root even on read-only mounts: really create a file
        with tempfile.NamedTemporaryFile(dir=parent, prefix=".trainwise-probe-"):
            pass
    except OSError as error:
        raise ValueError(
            f"telemetry database path {path}: cannot create files in {parent} ({error.strerror}); "
            f"make it writable or {setting}"
        ) from error


def _holder(message: str) -> str:
    match = _HOLDER.search(message)
    if not match:
        return "another process"
    program, pid = match.group(1), match.group(2)
    try:  # the command line says which: dbt, an ingest, a notebook
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(
            "utf-8", "replace").strip()
    except OSError:
        cmdline = ""
    return f"pid {pid} ({cmdline[:200] or program})"


def connect_with_retry(
    db_path: str | Path,
    *,
    read_only: bool = False,
    lock_timeout_s: float = 60.0,
    sleep: Callable[[float], None] = time.sleep,
) -> duckdb.DuckDBPyConnection:
    """`duckdb.connect`, waiting out a lock held by another process (backoff 50 ms .. 2 s)."""
    deadline = time.monotonic() + lock_timeout_s
    delay_s = 0.05
    while True:
        try:
            return duckdb.connect(str(db_path), read_only=read_only)
        except duckdb.IOException as error:
            message = str(error)
            if "Could not set lock" not in message:
                raise
            left_s = deadline - time.monotonic()
            if left_s <= 0:
                raise TelemetryStoreBusyError(
                    f"telemetry database {db_path} stayed locked for {lock_timeout_s:.0f} s by "
                    f"{_holder(message)}: DuckDB admits one read-write process per file, and a "
                    "reader in another process blocks writers too. The holder may be a dbt run, "
                    "another ingest or a notebook/reader with the file open; wait for it to "
                    "finish or close it, then ingest again (the ingest is idempotent)"
                ) from error
            sleep(min(delay_s * random.uniform(0.5, 1.5), left_s))  # jitter: no lock-step retries
            delay_s = min(delay_s * 2, 2.0)


StoredLines = dict[tuple[int, int, str], int]  # (rank, segment, segment_key) -> lines stored


def _stored_lines(run_id: str, db_path: Path, lock_timeout_s: float) -> StoredLines:
    """How many lines of each segment of a run the store holds (empty without a store)."""
    if not db_path.exists():
        return {}
    with connect_with_retry(db_path, read_only=True, lock_timeout_s=lock_timeout_s) as con:
        try:
            rows = con.execute(f"SELECT rank, segment, segment_key, count(*) FROM {TABLE} "
                               "WHERE run_id = ? GROUP BY ALL", [run_id]).fetchall()
        except duckdb.Error:  # no table yet, or the first schema (no segment_key): parse all
            return {}
    return {(rank, segment, key): lines for rank, segment, key, lines in rows}


def _segment_lines(
    segment: Segment, stored: StoredLines
) -> tuple[str | None, list[dict[str, Any]], list[str] | None]:
    """(segment_key, records still to store, their line texts) of one segment.

    Key None for an empty segment; texts None where the body is not UTF-8 (each line is then
    decoded alone, so the first bad line is refused by number, as `parse_line` does).
    Re-ingestion (the `telemetry` asset ingests a partition's runs at every materialization):
    a sealed segment whose every line is stored already is checked against its marker (bytes,
    lines, sha256) and its first line parsed for its key, and the other lines are not parsed
    again; they are what the store holds (their key and count match, and a sealed segment never
    changes). Records as `telemetry.reader.read_segment_lines` gives them, and the same errors.
    """
    data = segment.path.read_bytes()
    body = sealed_body(segment, data) if segment.complete else data[: data.rfind(b"\n") + 1]
    if not body:
        return None, [], None
    raw_lines = body[:-1].split(b"\n")
    first = parse_line(segment, 0, raw_lines[0])
    key = segment_key(first)
    if segment.complete and stored.get((segment.rank, segment.index, key)) == len(raw_lines):
        return key, [], None
    try:  # one decode for the body; "\n" is one byte in UTF-8 and never inside a character
        texts: list[str] | None = body[:-1].decode("utf-8").split("\n")
    except UnicodeDecodeError:
        texts = None
    if texts is None:
        rest = [parse_line(segment, line_no, raw) for line_no, raw in enumerate(raw_lines[1:], 1)]
    else:
        rest = [parse_text(segment, line_no, text) for line_no, text in enumerate(texts[1:], 1)]
    return key, [first, *rest], texts


def _rows(run_dir: Path, stored: StoredLines | None = None) -> pa.Table:
    run_id = run_dir.name
    columns: dict[str, list[Any]] = {name: [] for name in _COLUMNS}
    instance_of_rank: dict[int, str] = {}
    for segment in list_segments(run_dir):
        key, records, texts = _segment_lines(segment, stored or {})
        if key is None:
            continue
        instance = instance_of_rank.setdefault(segment.rank, key)
        if not records:
            continue
        wall_times_s = []
        for line_no, record in enumerate(records):
            if record["run_id"] != run_id:
                raise ValueError(
                    f"{segment.path} line {line_no + 1} belongs to run {record['run_id']!r}, not "
                    f"{run_id!r}; move the file to its own run folder"
                )
            wall_time_s = record.get("wall_time_s")
            wall_times_s.append(None if wall_time_s is None else float(wall_time_s))
        # Lines of a segment that are stored already are all its lines (see `_segment_lines`),
        # so the lines to store are 0..n-1: columns built a segment at a time.
        count = len(records)
        columns["run_id"].extend([run_id] * count)
        columns["run_instance"].extend([instance] * count)
        columns["rank"].extend([segment.rank] * count)
        columns["segment"].extend([segment.index] * count)
        columns["segment_key"].extend([key] * count)
        columns["line_no"].extend(range(count))
        columns["event_type"].extend([record["type"] for record in records])
        columns["step"].extend([record["step"] for record in records])
        columns["wall_time_s"].extend(wall_times_s)
        columns["payload"].extend(canonical_payloads(records, texts))
    return pa.table(columns, schema=_SCHEMA)


def _migrate_v1(con: duckdb.DuckDBPyConnection) -> None:
    """Rewrites a table of the first schema (no segment_key) into this one, keys included."""
    names = {row[0] for row in con.execute(f"DESCRIBE {TABLE}").fetchall()}
    if "segment_key" in names:
        return
    con.execute(f"ALTER TABLE {TABLE} RENAME TO {TABLE}_v1")
    con.execute(_CREATE)
    # A v1 payload is the canonical text, so sha256 in SQL gives the same key as `segment_key`.
    con.execute(f"""
        INSERT INTO {TABLE} ({', '.join(_COLUMNS)})
        WITH keys AS (
            SELECT run_id, rank, segment, left(sha256(payload::VARCHAR), 16) AS segment_key
            FROM {TABLE}_v1 WHERE line_no = 0
        ), instances AS (
            SELECT run_id, rank, arg_min(segment_key, segment) AS run_instance
            FROM keys GROUP BY run_id, rank
        )
        SELECT v.run_id, i.run_instance, v.rank, v.segment, k.segment_key, v.line_no,
               v.event_type, v.step, v.wall_time_s, v.payload
        FROM {TABLE}_v1 v JOIN keys k USING (run_id, rank, segment)
        JOIN instances i USING (run_id, rank)
    """)
    con.execute(f"DROP TABLE {TABLE}_v1")
    con.execute(f"CREATE OR REPLACE TEMP TABLE touched_groups AS "
                f"SELECT DISTINCT run_id, run_instance, rank FROM {TABLE}")
    con.execute(_MARK_REPLAYS)


def ingest(run_dir: str | Path, db_path: str | Path, *, lock_timeout_s: float = 60.0) -> int:
    """Loads every complete line of a run's segments into DuckDB; returns how many were new.

    `run_dir` is `<telemetry_dir>/<run_id>`; its folder name is the run id, and every record must
    carry it (a record of another run means a misplaced file and raises). Malformed files raise
    `telemetry.reader.TelemetryFormatError` before the database is opened. A lock held by
    another process is waited for (see `connect_with_retry`).
    """
    run_dir = Path(run_dir)
    check_db_path(db_path)
    # Files first: the write lock is held only for the insert. Sealed segments stored already
    # are not parsed again (a short read-only look at the store first; see `_segment_lines`).
    rows = _rows(run_dir, _stored_lines(run_dir.name, Path(db_path), lock_timeout_s))
    Path(db_path).parent.mkdir(parents=True, exist_ok=True)
    with connect_with_retry(db_path, lock_timeout_s=lock_timeout_s) as con:
        con.execute("BEGIN TRANSACTION")
        con.execute(_CREATE)
        _migrate_v1(con)
        if rows.num_rows == 0:
            con.execute("COMMIT")
            return 0
        con.register("incoming_rows", rows)
        inserted = con.execute(
            f"INSERT OR IGNORE INTO {TABLE} ({', '.join(_COLUMNS)}) "
            f"SELECT {', '.join(_COLUMNS)} FROM incoming_rows"
        ).fetchone()
        con.execute("CREATE OR REPLACE TEMP TABLE touched_groups AS "
                    "SELECT DISTINCT run_id, run_instance, rank FROM incoming_rows")
        con.execute(_MARK_REPLAYS)
        con.execute("COMMIT")
    return int(inserted[0]) if inserted else 0


def _connect_read_only(
    db_path: str | Path, lock_timeout_s: float = 60.0
) -> duckdb.DuckDBPyConnection:
    if not Path(db_path).exists():
        raise FileNotFoundError(
            f"telemetry database {db_path} does not exist; ingest a run first "
            "(telemetry.store.ingest)"
        )
    return connect_with_retry(db_path, read_only=True, lock_timeout_s=lock_timeout_s)


def run_events(
    db_path: str | Path, run_id: str, *, event_type: str | None = None
) -> list[dict[str, Any]]:
    """The records of one run (optionally of one type), in order (rank, segment, line).

    Every record is returned, replays included; `replay_flags` says which are replays.
    """
    query = f"SELECT payload FROM {TABLE} WHERE run_id = ?"
    params: list[Any] = [run_id]
    if event_type is not None:
        query += " AND event_type = ?"
        params.append(event_type)
    query += " ORDER BY run_instance, rank, segment, line_no"
    with _connect_read_only(db_path) as con:
        return [json.loads(payload) for (payload,) in con.execute(query, params).fetchall()]


def replay_flags(db_path: str | Path, run_id: str) -> list[tuple[str, int, bool]]:
    """(event_type, step, is_replay) of a run's step and eval events, in stored order."""
    with _connect_read_only(db_path) as con:
        return [
            (kind, step, bool(replay))
            for kind, step, replay in con.execute(
                f"SELECT event_type, step, is_replay FROM {TABLE} WHERE run_id = ? "
                f"AND event_type IN {REPLAYABLE_EVENT_TYPES} "
                "ORDER BY run_instance, rank, segment, line_no",
                [run_id],
            ).fetchall()
        ]


def run_ids(db_path: str | Path) -> list[str]:
    """Every run id in the store, sorted."""
    with _connect_read_only(db_path) as con:
        rows = con.execute(f"SELECT DISTINCT run_id FROM {TABLE} ORDER BY run_id").fetchall()
    return [run_id for (run_id,) in rows]
