"""Reads a run's telemetry segments back, in order.

Order: rank, then segment index, then line. A sealed segment (it has its `.complete` marker) is
read up to the marker's line count and checked against the marker's sha256. An open segment (its
writer is running, or was killed) is read up to its last newline: a trailing fragment without a
newline is a torn line and is skipped. A newline-terminated line that is not JSON is corruption
and raises.
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from telemetry.writer import SEGMENT_PATTERN, marker_path

_RANK_PATTERN = re.compile(r"^rank(\d+)$")


@dataclass(frozen=True)
class Segment:
    rank: int
    index: int
    path: Path
    complete: bool


def list_segments(run_dir: str | Path) -> list[Segment]:
    """Every segment of a run folder (`<telemetry_dir>/<run_id>`), in reading order."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise FileNotFoundError(
            f"telemetry run folder {run_dir} does not exist; pass <telemetry_dir>/<run_id> of a "
            "run that has started"
        )
    found = []
    for rank_path in run_dir.iterdir():
        rank_match = _RANK_PATTERN.match(rank_path.name)
        if not rank_match or not rank_path.is_dir():
            continue
        for path in rank_path.iterdir():
            match = SEGMENT_PATTERN.match(path.name)
            if match:
                found.append(
                    Segment(
                        rank=int(rank_match.group(1)),
                        index=int(match.group(1)),
                        path=path,
                        complete=marker_path(path).exists(),
                    )
                )
    return sorted(found, key=lambda s: (s.rank, s.index))


def read_segment_lines(segment: Segment) -> list[tuple[int, dict[str, Any]]]:
    """(line_no from 0, record) for every complete line of one segment."""
    data = segment.path.read_bytes()
    if segment.complete:
        marker = json.loads(marker_path(segment.path).read_text(encoding="utf-8"))
        body = data[: int(marker["bytes"])]
        intact = hashlib.sha256(body).hexdigest() == marker["sha256"]
        if len(body) != int(marker["bytes"]) or not intact:
            raise ValueError(
                f"telemetry segment {segment.path} does not match its completion marker "
                "(truncated or edited after sealing); restore it or delete the run's telemetry"
            )
    else:
        body = data[: data.rfind(b"\n") + 1]  # drops a torn trailing fragment
    records = []
    for line_no, raw in enumerate(body.decode("utf-8").splitlines()):
        try:
            records.append((line_no, json.loads(raw)))
        except json.JSONDecodeError as error:
            raise ValueError(
                f"telemetry segment {segment.path} line {line_no} is not JSON ({error}); the file "
                "is corrupt: restore it or delete the run's telemetry"
            ) from error
    return records


def read_run_events(run_dir: str | Path, *, rank: int | None = None) -> list[dict[str, Any]]:
    """Every record of a run (or of one rank), in order (rank, segment, line)."""
    return [
        record
        for segment in list_segments(run_dir)
        if rank is None or segment.rank == rank
        for _, record in read_segment_lines(segment)
    ]
