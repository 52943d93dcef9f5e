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
needs no change to the file format, and old files get keys too. A row is identified by
(run_id, rank, segment, segment_key, line_no); see "Idempotence without a key".

Run instance and replays. `run_instance` is the `segment_key` of the first non-empty segment of
the rank: the same for every process that wrote into one run folder (a resumed process appends
segments to the same folder), different for an unrelated run reusing the id. A step (or eval)
event whose (run_id, run_instance, rank, type, step) already appeared earlier in (segment, line)
order was written again after a resume from an older checkpoint: it gets `is_replay = true`;
queries count its time as preemption waste, never as new training (dbt/models). Rows appended
after everything their (run, instance, rank) holds (the usual case) get their flag as they are
inserted (`ReplayFlags`); a group whose files arrived out of order has its flags recomputed in
SQL after the inserts (`_mark_replays`), so ingestion stays incremental and idempotent either
way.

Re-ingestion. A sealed segment whose lines the store already holds (same key, same count) is
checked against its marker and not decoded again (`_new_lines`): re-ingesting a run costs
reading and hashing its files, not parsing them (benchmarks/ingestion.py measures both).

First ingestion (issue 29). A sealed segment whose first line is canonical is decoded by
`telemetry.ingest_fast`: one msgspec call for its lines (strictly typed: it accepts nothing the
reader refuses), its text handed to DuckDB as the stored payloads without a copy per line, and
no line is parsed in Python. Open segments, and any sealed one the fast path refuses, take the strict path
(`_strict_columns`: the reader's checks line by line, canonical text stored), so a malformed
line is still refused by file and number. Rows go to DuckDB in batches of BATCH_LINES, all in
one transaction: memory holds a batch, not the run, and a malformed line anywhere stores
nothing.

Idempotence without a key (issue 29). The table of the first schemas had a primary key on
(run_id, rank, segment, segment_key, line_no), and ingestion relied on `INSERT OR IGNORE`. Its
index cost a third of the ingest's CPU, so a table created now has none: ingestion itself
stores exactly the lines a segment lacks. Lines stored of a segment are always a prefix (every
ingest stores whole bodies), so their count says which are new; it is read again inside the
write transaction, under DuckDB's one-writer lock (and `_write_lock` within a process), and the
files are decoded again if another ingest got there first. A table with the old key keeps it
(and the same inserts never conflict with it).

Locks. DuckDB admits one read-write process per file (and dbt needs that lock), so connections
are short-lived, the query helpers open the file `read_only=True`, and both wait on a held lock
with exponential backoff and jitter up to `lock_timeout_s`, then raise `TelemetryStoreBusyError`
naming the file and the holder's pid and program.
"""

from __future__ import annotations

import contextlib
import hashlib
import itertools
import json
import os
import random
import re
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import duckdb
import numpy as np
import pyarrow as pa

from telemetry.ingest_fast import (
    SegmentColumns,
    SegmentRows,
    equal_strings,
    float64_array,
    int64_array,
    int64_values,
    payload_array,
    rows_table,
    sealed_columns,
    string_array,
)
from telemetry.reader import (
    Segment,
    list_segments,
    newlines,
    parse_line,
    parse_text,
    segment_body,
)

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
    payload JSON NOT NULL
)
"""
_COLUMNS = ("run_id", "run_instance", "rank", "segment", "segment_key", "line_no", "event_type",
            "step", "wall_time_s", "payload")
# Replays of touched (run, instance, rank) groups, recomputed from scratch: idempotent. Only rows
# whose (type, step) key occurs twice in its group can be replays, or be flagged and stop being
# one, so the window runs over those (and over flagged rows): one hash aggregate finds their
# keys first, and the update goes by rowid (measured: 40% less CPU than sorting every row of the
# groups and joining back on the five key columns). A hash collision only adds a row whose
# window then says "first", which is what it is.
_REPLAY_CANDIDATES = f"""
    event_type IN {REPLAYABLE_EVENT_TYPES}
    AND (run_id, run_instance, rank) IN (SELECT * FROM touched_groups)
"""
_REPLAY_KEY = "hash(run_id, run_instance, rank, event_type, step)"
_MARK_REPLAYS = (
    f"""CREATE OR REPLACE TEMP TABLE replay_keys AS
        SELECT {_REPLAY_KEY} AS key FROM {TABLE} WHERE {_REPLAY_CANDIDATES}
        GROUP BY 1 HAVING count(*) > 1""",
    f"""UPDATE {TABLE} AS t SET is_replay = r.replay
        FROM (
            SELECT rowid AS row_id, is_replay AS was,
                   row_number() OVER (
                       PARTITION BY run_id, run_instance, rank, event_type, step
                       ORDER BY segment, line_no) > 1 AS replay
            FROM {TABLE}
            WHERE {_REPLAY_CANDIDATES}
              AND (is_replay OR {_REPLAY_KEY} IN (SELECT key FROM replay_keys))
        ) AS r
        WHERE t.rowid = r.row_id AND r.replay IS DISTINCT FROM r.was""",
)


def _mark_replays(con: duckdb.DuckDBPyConnection) -> None:
    """Recomputes `is_replay` for the groups in the temp table `touched_groups`."""
    for statement in _MARK_REPLAYS:
        con.execute(statement)


BATCH_LINES = 16_384  # rows per INSERT: memory holds one batch (~8 MiB of text), not the run
DUCKDB_MEMORY_LIMIT = "128MB"  # DuckDB's own buffers during an ingest (it spills past this)
DUCKDB_THREADS = 1
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


def _create_whole(db_path: Path) -> None:
    """Creates a missing database file whole: an empty DuckDB database made under a temp name,
    then hard-linked into place. A process that opens the path therefore never meets a file
    another process is still creating (seen as "exists, but it is not a valid DuckDB database
    file" when several ingests started on a new store at once); `os.link` never replaces a file
    that another process linked first."""
    if db_path.exists():
        return
    db_path.parent.mkdir(parents=True, exist_ok=True)
    handle, name = tempfile.mkstemp(prefix=f".{db_path.name}.", suffix=".new", dir=db_path.parent)
    os.close(handle)
    tmp = Path(name)
    try:
        tmp.unlink()  # DuckDB refuses an existing empty file: it must create the file itself
        duckdb.connect(str(tmp)).close()
        with contextlib.suppress(FileExistsError):
            os.link(tmp, db_path)
    finally:
        tmp.unlink(missing_ok=True)
        Path(f"{tmp}.wal").unlink(missing_ok=True)


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
    if not read_only:
        _create_whole(Path(db_path))
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
    """How many lines of each segment of a run the store holds, as a first look (empty without
    a store): `ingest` counts again under the write lock, and that count decides."""
    if not db_path.exists():
        return {}
    try:
        with connect_with_retry(db_path, read_only=True, lock_timeout_s=lock_timeout_s) as con:
            rows = con.execute(f"SELECT rank, segment, segment_key, count(*) FROM {TABLE} "
                               "WHERE run_id = ? GROUP BY ALL", [run_id]).fetchall()
    except duckdb.Error:  # no table yet, the first schema (no segment_key), or a file another
        return {}  # ingest is creating right now: decode all, the count under the lock decides
    return {(rank, segment, key): lines for rank, segment, key, lines in rows}


def _strict_columns(segment: Segment, body: bytes, first: dict[str, Any],
                    run_id: str) -> SegmentColumns:
    """Columns of a segment's lines through the strict path: every line parsed and checked in
    Python (`parse_text`, the reader's checks and errors) and stored as its canonical text.

    Taken by open segments (no seal vouches for their text) and by any sealed segment the fast
    path refused (`ingest_fast.sealed_columns`), so a malformed line is refused by number, and a
    valid but unusual one (non-ASCII text; any hand-edited line of an open segment) is stored
    as its canonical text.
    """
    raw_lines = body[:-1].split(b"\n")
    try:  # one decode for the body; "\n" is one byte in UTF-8 and never inside a character
        texts: list[str] | None = body[:-1].decode("utf-8").split("\n")
    except UnicodeDecodeError:  # each line decoded alone: the first bad one is named
        texts = None
    if texts is None:
        rest = [parse_line(segment, line_no, raw) for line_no, raw in enumerate(raw_lines[1:], 1)]
    else:
        rest = [parse_text(segment, line_no, text) for line_no, text in enumerate(texts[1:], 1)]
    records = [first, *rest]
    for line_no, record in enumerate(records):
        if record["run_id"] != run_id:
            raise ValueError(
                f"{segment.path} line {line_no + 1} belongs to run {record['run_id']!r}, not "
                f"{run_id!r}; move the file to its own run folder"
            )
    return SegmentColumns(
        event_type=string_array([record["type"] for record in records]),
        step=int64_array([record["step"] for record in records]),
        wall_time_s=float64_array([record.get("wall_time_s") for record in records]),
        payload=payload_array(canonical_payloads(records, texts)),
    )


def _new_lines(run_dir: Path, stored: StoredLines,
               torn: list[tuple[str, int]]) -> Iterator[SegmentRows]:
    """The lines of each segment of a run that the store lacks, segment by segment, in order.

    Every segment is read and checked (a sealed one against its marker: bytes, lines, sha256)
    and its first line parsed for its key. A sealed segment whose every line is stored already
    is not decoded further: its lines are what the store holds (same key, same count, and a
    sealed segment never changes). Otherwise a sealed segment whose first line is canonical
    takes the fast path (`ingest_fast.sealed_columns`), and any other segment, or one the fast
    path refuses, the strict one (`_strict_columns`). Raises
    `TelemetryFormatError` naming the file and line as `telemetry.reader` does. Appends
    (segment, bytes) to `torn` for each sealed segment that declares a torn line.
    """
    run_id = run_dir.name
    instance_of_rank: dict[int, str] = {}
    for segment in list_segments(run_dir):
        body, torn_bytes = segment_body(segment, segment.path.read_bytes())
        if torn_bytes and segment.complete:  # a killed writer's half line: lost for good
            torn.append((str(segment.path), torn_bytes))
        if not body:
            continue
        first_text = body[: body.index(b"\n")]
        first = parse_line(segment, 0, first_text)
        key = segment_key(first)
        instance = instance_of_rank.setdefault(segment.rank, key)
        done = stored.get((segment.rank, segment.index, key), 0)
        if done and segment.complete and done >= newlines(body):
            continue
        columns = None
        if segment.complete and canonical_payload(first).encode("utf-8") == first_text:
            columns = sealed_columns(body, run_id, segment.rank)
        if columns is None:
            columns = _strict_columns(segment, body, first, run_id)
        if done < len(columns):  # stored lines are always a prefix: an ingest stores whole bodies
            yield SegmentRows(segment.rank, segment.index, key, instance,
                              columns.tail(done) if done else columns)


@dataclass(frozen=True)
class Batch:
    rows: pa.Table  # the store's columns but `is_replay`
    groups: frozenset[tuple[str, str, int]]  # its (run_id, run_instance, rank)
    parts: tuple[SegmentRows, ...] = ()  # the segments' rows it holds, in order


def decoded_batches(run_dir: str | Path, stored: StoredLines | None = None,
                    torn: list[tuple[str, int]] | None = None) -> Iterator[Batch]:
    """The rows a run adds to a store holding `stored`, in batches of about BATCH_LINES rows
    (and, in `torn`, the sealed segments that declare a torn line, with its bytes). Files only,
    no database: `ingest` inserts each batch as it comes, so memory holds one batch, not the
    run."""
    run_id = Path(run_dir).name

    def batch(parts: list[SegmentRows]) -> Batch:
        return Batch(rows_table(run_id, parts),
                     frozenset((run_id, part.run_instance, part.rank) for part in parts),
                     tuple(parts))

    pending: list[SegmentRows] = []
    lines = 0
    for rows in _new_lines(Path(run_dir), stored or {}, [] if torn is None else torn):
        pending.append(rows)
        lines += len(rows.columns)
        if lines >= BATCH_LINES:
            yield batch(pending)
            pending, lines = [], 0
    if pending:
        yield batch(pending)


_WRITE_LOCKS: dict[str, threading.Lock] = {}
_WRITE_LOCKS_GUARD = threading.Lock()


@contextlib.contextmanager
def _write_lock(db_path: str | Path, lock_timeout_s: float) -> Iterator[None]:
    """One writer per database file in this process too. DuckDB's file lock keeps other
    processes out, but connections of one process share the file, and two ingests there would
    both count the same stored lines and both append the rest (a table created now has no key
    to refuse the second; see "Idempotence without a key" in the module docstring)."""
    with _WRITE_LOCKS_GUARD:
        lock = _WRITE_LOCKS.setdefault(os.path.realpath(db_path), threading.Lock())
    if not lock.acquire(timeout=lock_timeout_s):
        raise TelemetryStoreBusyError(
            f"telemetry database {db_path}: another ingest in this process held it for "
            f"{lock_timeout_s:.0f} s; wait for it to finish, then ingest again (the ingest is "
            "idempotent)")
    try:
        yield
    finally:
        lock.release()


def _configure(con: duckdb.DuckDBPyConnection) -> None:
    # Bounded memory: DuckDB spills past this; the default is 80% of the machine.
    con.execute(f"SET memory_limit = '{DUCKDB_MEMORY_LIMIT}'")
    # zstd, chosen outright: the automatic choice analyses every method first (measured: twice
    # the insert's CPU) and ends with a file 2.5x larger; DICT_FSST and no compression cost as
    # much CPU or more, for files 3x and 10x larger.
    con.execute("SET force_compression = 'zstd'")
    # One thread. Measured at 1M events on 2 cores: a second one costs 20% more CPU time for
    # a few percent less wall time.
    con.execute(f"SET threads = {DUCKDB_THREADS}")


def _stored_in(con: duckdb.DuckDBPyConnection, run_id: str) -> StoredLines:
    rows = con.execute(f"SELECT rank, segment, segment_key, count(*) FROM {TABLE} "
                       "WHERE run_id = ? GROUP BY ALL", [run_id]).fetchall()
    return {(rank, segment, key): lines for rank, segment, key, lines in rows}


def _insert(con: duckdb.DuckDBPyConnection, batch: Batch,
            is_replay: pa.Array | None = None) -> int:
    """Appends a batch's rows, with their `is_replay` flags when given (else false)."""
    # One chunk per column (not one per segment): measured a third less insert CPU. A relation,
    # not `register`: a view registered inside the transaction keeps its Arrow table alive until
    # the commit (measured: the whole run's text in memory at 1M events).
    rows, columns = batch.rows.combine_chunks(), _COLUMNS
    if is_replay is not None:
        rows, columns = rows.append_column("is_replay", is_replay), (*_COLUMNS, "is_replay")
    con.from_arrow(rows).query(
        "incoming_rows", f"INSERT INTO {TABLE} ({', '.join(columns)}) "
                         f"SELECT {', '.join(columns)} FROM incoming_rows")
    return batch.rows.num_rows


Group = tuple[str, int]  # (run_instance, rank) of one run


class ReplayFlags:
    """`is_replay` of the rows an ingest appends, computed before they are inserted (issue 29).

    Marking replays after the inserts (`_mark_replays`, an UPDATE) costs more than its query: an
    UPDATE of rows inserted in the same transaction makes DuckDB write their row groups again at
    the commit (measured at 1M events: 0.34 s of marking and 0.5 s of commit, a fifth of the
    ingest, for 80 flags). So the flags of appended rows are computed first and inserted with
    the rows, and nothing is updated.

    Appended: every new row of a (run_instance, rank) group comes after every row of that group
    the store holds, in (segment, line_no) order (the usual case: segments ingested as they are
    written, an open one's tail after its stored lines). Then the stored rows' flags stay what
    they are (no earlier row was added before them), and a new row of type step or eval is a
    replay exactly when an earlier row of its group has its (type, step): a stored one, one of an
    earlier batch of this ingest (inserted already), or an earlier one of its batch. Per group
    and type the largest step so far is kept: a row whose step is above it follows no row with
    its step, so only rows at or below it (after a resume, mostly the replays themselves) are
    looked up, in the store (one query per group and type of a batch that has any) and in the
    batch. Memory: the largest step and the last (segment, line) per group, and one batch.

    A group that is not appended (a segment arrived after later ones were stored), or whose
    rows needed more than MAX_LOOKUPS store queries in one ingest (steps that go back and forth
    all along: each query reads the run's rows), is left to `_mark_replays` after the inserts,
    as every group was before: `recompute` names them.
    """

    MAX_LOOKUPS = 32

    def __init__(self, con: duckdb.DuckDBPyConnection, run_id: str) -> None:
        self._con, self._run_id = con, run_id
        self._last: dict[Group, tuple[int, int]] = {
            (instance, rank): (last[0], last[1]) for instance, rank, last in con.execute(
                f"SELECT run_instance, rank, max([segment, line_no]) FROM {TABLE} "
                "WHERE run_id = ? GROUP BY ALL", [run_id]).fetchall()}
        self._top: dict[tuple[Group, str], int] = {
            ((instance, rank), kind): top for instance, rank, kind, top in con.execute(
                f"SELECT run_instance, rank, event_type, max(step) FROM {TABLE} "
                f"WHERE run_id = ? AND event_type IN {REPLAYABLE_EVENT_TYPES} "
                "AND step IS NOT NULL GROUP BY ALL", [run_id]).fetchall()}
        self.recompute: set[tuple[str, str, int]] = set()  # (run_id, run_instance, rank)
        self.lookups = 0  # store queries made (tests)

    def column(self, parts: tuple[SegmentRows, ...]) -> pa.Array | None:
        """The flags of a batch's rows (its segments' rows, in order), or None when none is a
        replay. Call it once per batch, in insertion order, before inserting the batch."""
        flags: np.ndarray | None = None
        earlier: dict[tuple[Group, str], list[np.ndarray]] = {}  # this batch's steps so far
        unresolved: dict[tuple[Group, str], list[tuple[np.ndarray, np.ndarray]]] = {}
        offset = 0
        for part in parts:
            group, count = (part.run_instance, part.rank), len(part.columns)
            first = part.columns.first
            last = self._last.get(group)
            if (self._run_id, *group) in self.recompute or (
                    last is not None and (part.segment, first) <= last):
                self.recompute.add((self._run_id, *group))
                offset += count
                continue
            self._last[group] = (part.segment, first + count - 1)
            steps = int64_values(part.columns.step)
            for kind in REPLAYABLE_EVENT_TYPES:
                where = np.flatnonzero(equal_strings(part.columns.event_type, kind))
                if not where.size:
                    continue
                key = (group, kind)
                values = steps[where]
                top = self._top.get(key, -1)
                # The largest step of the rows before each one: a row above it is no replay.
                before = np.maximum.accumulate(np.concatenate(([top], values[:-1])))
                self._top[key] = max(top, int(values.max()))
                maybe = values <= before
                if maybe.any():
                    replay = np.zeros(len(values), bool)
                    order = np.argsort(values, kind="stable")  # equal steps keep line order
                    replay[order[1:]] = values[order[1:]] == values[order[:-1]]  # in the part
                    if earlier.get(key):
                        replay |= maybe & np.isin(values, np.concatenate(earlier[key]))
                    if flags is None:
                        flags = np.zeros(sum(len(p.columns) for p in parts), bool)
                    flags[offset + where] = replay
                    lookup = maybe & ~replay  # in the store?
                    if lookup.any():
                        unresolved.setdefault(key, []).append(
                            (offset + where[lookup], values[lookup]))
                earlier.setdefault(key, []).append(values)
            offset += count
        for ((instance, rank), kind), found in unresolved.items():
            if (self._run_id, instance, rank) in self.recompute:
                continue
            if self.lookups >= self.MAX_LOOKUPS:
                self.recompute.add((self._run_id, instance, rank))
                continue
            positions = np.concatenate([at for at, _ in found])
            values = np.concatenate([value for _, value in found])
            self.lookups += 1
            stored = np.array([step for (step,) in self._con.execute(
                f"SELECT DISTINCT step FROM {TABLE} WHERE run_id = ? AND run_instance = ? "
                "AND rank = ? AND event_type = ? AND step BETWEEN ? AND ? "
                "AND step IN (SELECT unnest(?::BIGINT[]))",
                [self._run_id, instance, rank, kind, int(values.min()), int(values.max()),
                 values.tolist()]).fetchall()], np.int64)
            assert flags is not None
            flags[positions] |= np.isin(values, stored)
        if flags is None or not flags.any():
            return None
        return pa.Array.from_buffers(pa.bool_(), len(flags), [
            None, pa.py_buffer(np.packbits(flags, bitorder="little").tobytes())])


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
    _mark_replays(con)


@dataclass(frozen=True)
class IngestReport:
    new_rows: int
    # Torn lines the run's sealed segments declare: rows a killed writer left half-written,
    # lost for good (see `telemetry.reader`); they are never stored, and said here.
    torn_lines: int
    torn_bytes: int
    torn_segments: tuple[str, ...]


def ingest(run_dir: str | Path, db_path: str | Path, *, lock_timeout_s: float = 60.0) -> int:
    """Loads every complete line of a run's segments into DuckDB; returns how many were new.
    See `ingest_report`."""
    return ingest_report(run_dir, db_path, lock_timeout_s=lock_timeout_s).new_rows


def ingest_report(run_dir: str | Path, db_path: str | Path, *,
                  lock_timeout_s: float = 60.0) -> IngestReport:
    """Loads every complete line of a run's segments into DuckDB; says how many were new and
    which torn lines (declared by sealed segments' markers) could not be.

    `run_dir` is `<telemetry_dir>/<run_id>`; its folder name is the run id, and every record must
    carry it (a record of another run means a misplaced file and raises). Malformed files raise
    `telemetry.reader.TelemetryFormatError`, and nothing of the run is stored: the files of the
    first batch (BATCH_LINES lines, all of a small run) are checked before the database is
    opened, the later ones inside the write transaction, which an error rolls back. A lock held
    by another process is waited for (see `connect_with_retry`).
    """
    run_dir = Path(run_dir)
    run_id = run_dir.name
    check_db_path(db_path)
    # A short read-only look first: sealed segments stored already are not decoded again.
    stored = _stored_lines(run_id, Path(db_path), lock_timeout_s)
    torn: list[tuple[str, int]] = []
    batches = decoded_batches(run_dir, stored, torn)
    first = next(batches, None)
    inserted = 0
    Path(db_path).parent.mkdir(parents=True, exist_ok=True)
    with (_write_lock(db_path, lock_timeout_s),
          connect_with_retry(db_path, lock_timeout_s=lock_timeout_s) as con):
        _configure(con)
        con.execute("BEGIN TRANSACTION")
        try:
            con.execute(_CREATE)
            _migrate_v1(con)
            now = _stored_in(con, run_id)
            if now != stored:  # another ingest stored lines between the look and the lock
                batches.close()
                torn.clear()
                batches = decoded_batches(run_dir, now, torn)
                first = next(batches, None)
            replays = None if first is None else ReplayFlags(con, run_id)
            for batch in itertools.chain([] if first is None else [first], batches):
                assert replays is not None
                inserted += _insert(con, batch, replays.column(batch.parts))
            if replays is not None and replays.recompute:  # groups not simply appended to
                con.execute("CREATE OR REPLACE TEMP TABLE touched_groups "
                            "(run_id VARCHAR, run_instance VARCHAR, rank INTEGER)")
                con.executemany("INSERT INTO touched_groups VALUES (?, ?, ?)",
                                sorted(replays.recompute))
                _mark_replays(con)
            con.execute("COMMIT")
        except BaseException:
            with contextlib.suppress(duckdb.Error):  # the error that got here is the one to see
                con.execute("ROLLBACK")
            raise
    return IngestReport(inserted, len(torn), sum(size for _, size in torn),
                        tuple(path for path, _ in torn))


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
