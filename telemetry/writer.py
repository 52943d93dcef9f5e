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
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from pathlib import Path
from typing import Any, Self, TextIO

from telemetry.events import Event, to_record

SEGMENT_PATTERN = re.compile(r"^segment-(\d{5})\.jsonl$")
_NAME_PATTERN = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")


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
    with open(tmp, "w", encoding="utf-8") as handle:
        handle.write(text)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(tmp, path)


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
        self._handle: TextIO | None = None
        self._lines_in_segment = 0
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
        # "x": a segment is never reopened; an existing file here means two writers on one rank.
        # No context manager: the handle stays open across writes and _seal_current closes it.
        self._handle = open(self.segment_path, "x", encoding="utf-8")  # noqa: SIM115
        self._lines_in_segment = 0

    def _seal_current(self) -> None:
        if self._handle is None:
            return
        self._handle.flush()
        os.fsync(self._handle.fileno())
        self._handle.close()
        self._handle = None
        assert self.segment_path is not None
        seal_segment(self.segment_path)

    def write(self, event: Event | dict[str, Any]) -> None:
        """Appends one event as one flushed line; rolls the segment when it is full."""
        record = to_record(event) if isinstance(event, Event) else dict(event)
        if record.get("run_id") != self.run_id or record.get("rank") != self.rank:
            raise ValueError(
                f"event for run {record.get('run_id')!r} rank {record.get('rank')!r} given to the "
                f"writer of run {self.run_id!r} rank {self.rank}; write it with its own writer"
            )
        line = json.dumps(record, allow_nan=False, separators=(",", ":")) + "\n"
        if self._handle is None:
            self._open_next()
        assert self._handle is not None
        self._handle.write(line)
        self._handle.flush()
        self._lines_in_segment += 1
        if self._lines_in_segment >= self.events_per_segment:
            self._seal_current()

    def close(self) -> None:
        """Seals the open segment (if any). Further writes start a new segment."""
        self._seal_current()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()
