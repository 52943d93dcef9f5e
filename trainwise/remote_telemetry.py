"""A remote run's telemetry, copied from the store into the launcher's run folder.

Each node agent copies its job's telemetry into the store under
`runs/<run_id>/agent/starts/<start_id>/telemetry/<run_id>/rank<R>/segment-NNNNN.jsonl` (and the
segments' `.complete` markers; `trainwise.agent.telemetry_sync`). `TelemetryMirror` copies them
into `<run_dir>/telemetry/<run_id>/rank<R>/`, the folder every reader of a local run reads
(`trainwise explain`, the slow-policy sensor, MLflow, the Prometheus exporter), so a run on
remote nodes is seen as a local one.

Each start writes its segments from 0 on (its disk is empty), so start k's segment N becomes
segment `k * SEGMENTS_PER_START + N` here: the reader orders them by start, then by the
start's own order. A segment is copied when its size in the store changed, always before its
marker (a reader that sees the marker finds the segment whole). Only names of the writer's
pattern are copied (a rank folder, a segment, its marker): anything else a node put there is
left in the store. The provider's own rank (`PROVIDER_RANK`, written here by the session) is
never taken from the store.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from training.safe_files import write_atomic

SEGMENTS_PER_START = 1000  # a start rotates far fewer segments (each holds thousands of lines)
MAX_STARTS = 99  # five-digit segment numbers
_KEY = re.compile(r"starts/(?P<start>[A-Za-z0-9._-]+)/telemetry/(?P<run>[A-Za-z0-9._-]+)/"
                  r"rank(?P<rank>[0-9]{1,4})/segment-(?P<index>[0-9]{5})"
                  r"\.(?:jsonl|(?P<marker>complete))")


class TelemetryMirror:
    def __init__(self, store: Any, run_id: str, run_dir: Path, *, provider_rank: int) -> None:
        self.store, self.run_id = store, run_id
        self.prefix = f"runs/{run_id}/agent"
        self.target = Path(run_dir) / "telemetry" / run_id
        self.provider_rank = provider_rank
        self._sizes: dict[str, int] = {}
        self._sealed: set[str] = set()
        self.copied = 0

    def _local(self, ordinal: int, rank: int, index: int, marker: bool) -> Path:
        name = f"segment-{ordinal * SEGMENTS_PER_START + index:05d}"
        return self.target / f"rank{rank}" / (name + (".complete" if marker else ".jsonl"))

    def sync(self) -> int:
        """Copies what is new or grew since the last sync; returns how many files."""
        found = []
        for key in self.store.list_keys(f"{self.prefix}/starts"):
            match = _KEY.fullmatch(key[len(self.prefix) + 1:])
            if (match is None or match["run"] != self.run_id
                    or int(match["rank"]) == self.provider_rank
                    or int(match["index"]) >= SEGMENTS_PER_START):
                continue
            found.append((match["start"], key, match))
        starts = sorted({start for start, _, _ in found})[:MAX_STARTS]
        ordinal = {start: number for number, start in enumerate(starts)}
        copied = 0
        # Segments before markers, so a marker never precedes its whole segment here.
        for start, key, match in sorted(found, key=lambda item: (bool(item[2]["marker"]),
                                                                  item[1])):
            if start not in ordinal or key in self._sealed:
                continue
            data = self.store.get_bytes(key)
            if self._sizes.get(key) == len(data):
                continue
            path = self._local(ordinal[start], int(match["rank"]), int(match["index"]),
                               bool(match["marker"]))
            path.parent.mkdir(parents=True, exist_ok=True)
            write_atomic(path, data)  # a reader sees the old copy or the new, never half
            self._sizes[key] = len(data)
            if match["marker"]:  # sealed: neither it nor its segment changes again
                self._sealed.update({key, key[:-len("complete")] + "jsonl"})
            copied += 1
        self.copied += copied
        return copied


__all__ = ["SEGMENTS_PER_START", "TelemetryMirror"]
