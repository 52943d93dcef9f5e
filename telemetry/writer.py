"""Append-only JSONL segment writer, one per training rank.

Layout: `<telemetry_dir>/<run_id>/rank<R>/segment-00000.jsonl`. A segment is open while it has no
`segment-00000.complete` marker beside it; the writer rolls to the next segment after
`events_per_segment` events and seals the full one by writing its marker (line count, bytes,
sha256) atomically. Each line is written with one `write` and flushed, so a process killed hard
loses at most the line it was writing, which then lacks its newline (a "torn" line that the
reader skips).

One writer per rank at a time. A writer that starts where an earlier process left an open
segment (it was killed) seals that segment as `recovered` and starts the next one: segments are
never appended to after their writer is gone, which keeps ingestion keys stable.

Why files and not a database: a training rank must never block on, or hold the lock of, a shared
database (DuckDB admits one writer per file); `telemetry.store.ingest` loads segments later.

A write that fails (disk full, I/O error) raises `TelemetryWriteError` after truncating the
segment back to its last complete line, so the file stays readable and no torn line is left;
the writer stays usable for `close()` (and for a retry once space is freed). Lines go straight to
the file descriptor (`os.write`, no user-space buffer), so nothing half-written can be flushed
later behind the truncation.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from pathlib import Path
from typing import Any, Self

from telemetry.events import Event, to_record

SEGMENT_PATTERN = re.compile(r"^segment-(\d{5})\.jsonl$")
_NAME_PATTERN = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")
_write_fd = os.write  # the one call that appends lines; fault-injection tests replace it


class TelemetryWriteError(OSError):
    """A telemetry line could not be written (ENOSPC, EIO, ...); the segment was truncated back
    to its last complete line. `errno` is the failed write's."""


def segment_name(index: int) -> str:
    return f"segment-{index:05d}.jsonl"


def marker_path(segment_path: Path) -> Path:
    """The completion marker beside a segment: `segment-00000.complete`."""
    return segment_path.with_suffix(".complete")


def rank_dir(telemetry_dir: Path, run_id: str, rank: int) -> Path:
    """`<telemetry_dir>/<run_id>/rank<R>`, with `run_id` checked to be one safe path part."""
    if not _NAME_PATTERN.match(run_id):
        raise ValueError(
            f"run_id {run_id!r} must be letters, digits, '.', '_' or '-' (no path separators), "
            "starting with a letter or digit; pick such a run id"
        )
    if rank < 0:
        raise ValueError(f"rank {rank} must be >= 0")
    return Path(telemetry_dir) / run_id / f"rank{rank}"


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    try:
        with open(tmp, "w", encoding="utf-8") as handle:
            handle.write(text)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)  # a full disk must not leave half a marker behind
        raise


def seal_segment(segment_path: Path, *, recovered: bool = False) -> dict[str, Any]:
    """Writes the completion marker of a segment: complete lines, their bytes and sha256.

    A torn trailing fragment (no newline) is left in the file but excluded from the count.
    """
    data = segment_path.read_bytes()
    complete = data[: data.rfind(b"\n") + 1]
    marker = {
        "lines": complete.count(b"\n"),
        "bytes": len(complete),
        "sha256": hashlib.sha256(complete).hexdigest(),
        "torn_bytes": len(data) - len(complete),
        "recovered": recovered,
    }
    _write_atomic(marker_path(segment_path), json.dumps(marker, sort_keys=True) + "\n")
    return marker


class SegmentWriter:
    """Writes one rank's events as JSONL segments; use as a context manager or call `close`."""

    def __init__(
        self,
        telemetry_dir: str | Path,
        run_id: str,
        *,
        rank: int = 0,
        events_per_segment: int = 1000,
    ) -> None:
        if events_per_segment < 1:
            raise ValueError(f"events_per_segment={events_per_segment} must be >= 1")
        self.run_id = run_id
        self.rank = rank
        self.events_per_segment = events_per_segment
        self.directory = rank_dir(Path(telemetry_dir), run_id, rank)
        self.directory.mkdir(parents=True, exist_ok=True)
        self._fd: int | None = None
        self._lines_in_segment = 0
        self._good_bytes = 0  # bytes of complete lines in the open segment
        self._write_failed = False  # a TelemetryWriteError was raised: close() must not raise
        self._next_index = self._recover_and_next_index()
        self.segment_path: Path | None = None

    def _recover_and_next_index(self) -> int:
        indices = []
        for path in self.directory.iterdir():
            match = SEGMENT_PATTERN.match(path.name)
            if not match:
                continue
            indices.append(int(match.group(1)))
            if not marker_path(path).exists():
                seal_segment(path, recovered=True)
        return max(indices) + 1 if indices else 0

    def _open_next(self) -> None:
        self.segment_path = self.directory / segment_name(self._next_index)
        self._next_index += 1
        # O_EXCL: a segment is never reopened; an existing file here means two writers on one rank.
        self._fd = os.open(self.segment_path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        self._lines_in_segment = 0
        self._good_bytes = 0

    def _seal_current(self) -> None:
        if self._fd is None:
            return
        fd, self._fd = self._fd, None
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        assert self.segment_path is not None
        seal_segment(self.segment_path)

    def _append(self, data: bytes) -> None:
        """Writes all of `data` at the end of the complete lines, or truncates back and raises."""
        assert self._fd is not None and self.segment_path is not None
        written = 0
        try:
            while written < len(data):
                written += _write_fd(self._fd, data[written:])
        except OSError as error:
            try:  # drop the partial line so the segment ends at a newline
                os.ftruncate(self._fd, self._good_bytes)
                os.lseek(self._fd, self._good_bytes, os.SEEK_SET)
            except OSError as cleanup_error:
                error.add_note(f"truncating {self.segment_path} back failed too: {cleanup_error}")
            raise self._failure(
                error, f"cut back to its last complete line ({self._good_bytes} bytes) and stays "
                "readable") from error
        self._good_bytes += len(data)

    def _failure(self, error: OSError, state: str) -> TelemetryWriteError:
        self._write_failed = True
        message = (
            f"could not write telemetry segment {self.segment_path} ({error.strerror or error}); "
            f"the segment was {state}. Free space on that file system (or replace the failing "
            "device), then resume the run"
        )
        if error.errno is None:
            return TelemetryWriteError(message)
        return TelemetryWriteError(error.errno, message)

    def write(self, event: Event | dict[str, Any]) -> None:
        """Appends one event as one line with one write; rolls the segment when it is full.

        Raises `TelemetryWriteError` when the write fails (see the module doc).
        """
        record = to_record(event) if isinstance(event, Event) else dict(event)
        if record.get("run_id") != self.run_id or record.get("rank") != self.rank:
            raise ValueError(
                f"event for run {record.get('run_id')!r} rank {record.get('rank')!r} given to the "
                f"writer of run {self.run_id!r} rank {self.rank}; write it with its own writer"
            )
        line = json.dumps(record, allow_nan=False, separators=(",", ":")) + "\n"
        if self._fd is None:
            try:
                self._open_next()
            except OSError as error:
                raise self._failure(error, "not created") from error
        self._append(line.encode("utf-8"))
        self._lines_in_segment += 1
        if self._lines_in_segment >= self.events_per_segment:
            try:
                self._seal_current()
            except OSError as error:  # the line is durable; only the marker could not be written
                raise self._failure(
                    error, "not sealed: its lines are intact and it is read as an open segment"
                ) from error

    def close(self) -> None:
        """Seals the open segment (if any). Further writes start a new segment.

        After a failed write, when sealing fails too (the disk is still full) the segment is left
        open, which readers handle (complete lines up to the last newline) and the next writer of
        this rank seals as recovered; close does not raise then, so it cannot mask the error being handled.
        """
        try:
            self._seal_current()
        except OSError:
            if not self._write_failed:
                raise

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()
