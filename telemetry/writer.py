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

Links (issue 31, class 2): the rank folder must resolve inside the telemetry folder (a planted
link at `<run_id>` or `rank<R>` is refused); a segment is created `O_EXCL | O_NOFOLLOW`; a
marker is written to a temp file with an unpredictable name (`mkstemp`) and renamed over its
name, which replaces a planted link instead of writing through it; a segment that is a link or
not a regular file is refused, not read (a FIFO would block the trainer). The helpers of
`training.safe_files` cannot be used here (telemetry imports nothing of ours), hence the few
lines below. A write that fails because the rank folder was removed or replaced says so
instead of "free space".
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import re
import stat
import tempfile
from pathlib import Path
from typing import Any, Self

from telemetry.events import Event, to_record

# `\Z`, not `$`: `$` also matches before a final newline ("run\n" would pass). The reader
# matches SEGMENT_PATTERN with `.match`, so the anchors stay in the pattern.
SEGMENT_PATTERN = re.compile(r"^segment-(\d{5})\.jsonl\Z")
_NAME_PATTERN = re.compile(r"\A[A-Za-z0-9][A-Za-z0-9._-]*\Z")
# Marker temp files (`.segment-00000.complete.<random>.tmp`) a killed writer left behind.
_MARKER_TEMP_PATTERN = re.compile(r"\.segment-\d{5}\.complete\..+\.tmp")
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
    if not isinstance(run_id, str) or not _NAME_PATTERN.fullmatch(run_id):
        raise ValueError(
            f"run_id {run_id!r} must be letters, digits, '.', '_' or '-' (no path separators), "
            "starting with a letter or digit; pick such a run id"
        )
    if rank < 0:
        raise ValueError(f"rank {rank} must be >= 0")
    return Path(telemetry_dir) / run_id / f"rank{rank}"


class TelemetryFolderError(ValueError):
    """A path in a rank folder is a link, not a regular file, or resolves outside the telemetry
    folder; the message names it and the fix."""


def _write_atomic(path: Path, text: str) -> None:
    # An unpredictable temp name (O_EXCL inside mkstemp): a fixed `.name.tmp` could be a planted
    # link, and opening it would truncate the file it points to.
    handle, temp_name = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.",
                                         suffix=".tmp")
    try:
        try:
            os.fchmod(handle, 0o644)
            view = memoryview(text.encode("utf-8"))
            while view:
                view = view[os.write(handle, view):]
            os.fsync(handle)
        finally:
            os.close(handle)
        os.replace(temp_name, path)  # replaces a planted link itself, never its target
    except BaseException:
        try:  # a full disk must not leave half a marker behind
            os.unlink(temp_name)
        except FileNotFoundError:
            pass
        raise


def _read_segment(segment_path: Path) -> bytes:
    """The bytes of a segment that is a regular file (not a link, not a FIFO)."""
    try:
        handle = os.open(segment_path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as error:
        if error.errno == errno.ELOOP or segment_path.is_symlink():
            raise TelemetryFolderError(
                f"telemetry segment {segment_path} is a symbolic link; trainwise writes none. "
                "Remove it (or move it out of the run folder) and start again") from error
        raise
    try:
        if not stat.S_ISREG(os.fstat(handle).st_mode):
            raise TelemetryFolderError(
                f"telemetry segment {segment_path} is not a regular file; remove it (or move "
                "it out of the run folder) and start again")
        chunks = []
        while chunk := os.read(handle, 1 << 20):
            chunks.append(chunk)
        return b"".join(chunks)
    finally:
        os.close(handle)


def seal_segment(segment_path: Path, *, recovered: bool = False) -> dict[str, Any]:
    """Writes the completion marker of a segment: complete lines, their bytes and sha256.

    A torn trailing fragment (no newline) is left in the file but excluded from the count.
    """
    data = _read_segment(segment_path)
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


def _ensure_inside(folder: Path, path: Path) -> None:
    root = os.path.realpath(folder)
    resolved = os.path.realpath(path)
    if os.path.commonpath([root, resolved]) != root:
        raise TelemetryFolderError(
            f"telemetry folder {path} resolves to {resolved}, outside {root}: a link there "
            "would send this run's telemetry into another folder. Remove the link and start "
            "again (to keep telemetry on another disk, point the run folder itself there)")


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
        _ensure_inside(Path(telemetry_dir), self.directory)  # before mkdir follows a link
        self.directory.mkdir(parents=True, exist_ok=True)
        _ensure_inside(Path(telemetry_dir), self.directory)  # a link planted meanwhile
        folder = os.stat(self.directory)
        self._identity = (folder.st_dev, folder.st_ino)  # to tell a removed folder from a full disk
        self._fd: int | None = None
        self._lines_in_segment = 0
        self._good_bytes = 0  # bytes of complete lines in the open segment
        self._write_failed = False  # a TelemetryWriteError was raised: close() must not raise
        self._next_index = self._recover_and_next_index()
        self.segment_path: Path | None = None

    def _recover_and_next_index(self) -> int:
        indices = []
        for path in self.directory.iterdir():
            if _MARKER_TEMP_PATTERN.fullmatch(path.name):
                path.unlink(missing_ok=True)  # one writer per rank: a killed writer's temp
                continue
            match = SEGMENT_PATTERN.fullmatch(path.name)
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
        # (O_EXCL also refuses a planted link; O_NOFOLLOW says so for kernels that need it.)
        self._fd = os.open(self.segment_path,
                           os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
                           0o644)
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

    def _folder_gone(self) -> str | None:
        """How the rank folder changed since this writer opened it, None if it did not."""
        try:
            now = os.stat(self.directory)
        except FileNotFoundError:
            return "removed"
        except OSError:
            return None
        return None if (now.st_dev, now.st_ino) == self._identity else "replaced"

    def _failure(self, error: OSError, state: str) -> TelemetryWriteError:
        self._write_failed = True
        gone = self._folder_gone()
        if gone is not None:
            fix = (f"This is not a full disk: the folder {self.directory} was {gone} while the "
                   "trainer wrote it (a clean-up job, `rm -rf`, a restore). Stop whatever did "
                   "it, then resume the run")
        else:
            fix = ("Free space on that file system (or replace the failing device), then "
                   "resume the run")
        message = (
            f"could not write telemetry segment {self.segment_path} ({error.strerror or error}); "
            f"the segment was {state}. {fix}"
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
