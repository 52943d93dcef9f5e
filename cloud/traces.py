"""Spot markets replayed from real traces (skypilot-org/spot-traces; NSDI'24 "Can't Be Late" data).

Each trace file is JSON `{"metadata": {"gap_seconds": N}, "data": [int, ...]}`: one integer per
tick, the tick being `gap_seconds` long. What an integer means is NOT the same across the
ecosystem: the traces' README says "number of available instances", while simulators from the
same group read 1 as "preempted" (see `shared/data/spot/SEMANTICS.md`). So the meaning is an
explicit setting per data set (`TraceMeaning`), and `FOLDER_MEANING` pins it for every folder we
ship; tests pin it again. Reading a 90%-available zone as 10%-available would silently flip every
savings figure.

The file name gives the zone and the node shape: `us-west-2a_v100_8.json` is zone us-west-2a,
nodes with 8 V100s. Folder names carry the cluster size (`1node`, `4node`): the largest value a
tick can take.
"""

from __future__ import annotations

import enum
import json
import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np


class TraceMeaning(enum.Enum):
    """How to read one integer of a trace."""

    # The value is the number of spot instances available (running) at that tick.
    AVAILABLE = "available"
    # The value is the number of instances preempted (not available) at that tick.
    PREEMPTED = "preempted"


# Checked value for value against the raw collections (spot/SEMANTICS.md): all four folders count
# available instances.
FOLDER_MEANING: dict[str, TraceMeaning] = {
    "availability-1node-aws-2023-02": TraceMeaning.AVAILABLE,
    "availability-1node-aws-2022-10": TraceMeaning.AVAILABLE,
    "preemption-1node-aws-2023-04": TraceMeaning.AVAILABLE,
    "preemption-4node-aws-2023-08": TraceMeaning.AVAILABLE,
}

_FILE_NAME = re.compile(r"^(?P<zone>[a-z]{2}-[a-z]+-\d[a-z])_(?P<shape>[a-z0-9]+_\d+)\.json$")
_NODES_IN_FOLDER = re.compile(r"(\d+)node")


@dataclass(frozen=True)
class SpotTrace:
    """Spot availability of one zone: `available[i]` nodes could be held during tick i."""

    folder: str
    zone: str
    # GPU model and GPUs per node, as in the file name ("v100_1", "k80_8").
    node_shape: str
    tick_s: int
    # Largest number of nodes a tick can report (the traced cluster size).
    capacity_nodes: int
    available: np.ndarray
    source_path: str
    # Spot price recorded alongside the trace, when the file has one (constant in these files).
    recorded_spot_price_usd_per_hour: float | None = None

    @property
    def region(self) -> str:
        return region_of_zone(self.zone)

    @property
    def n_ticks(self) -> int:
        return int(self.available.shape[0])

    @property
    def duration_s(self) -> int:
        return self.n_ticks * self.tick_s

    def window(self, start_tick: int, n_ticks: int) -> np.ndarray:
        """Availability for ticks [start_tick, start_tick + n_ticks); errors name valid starts."""
        return window_of(self.available, start_tick, n_ticks, what=f"trace {self.source_path}")


def region_of_zone(zone: str) -> str:
    """'us-west-2a' -> 'us-west-2' (AWS zone names are the region plus one letter)."""
    if len(zone) < 2 or not zone[-1].isalpha() or not zone[-2].isdigit():
        raise ValueError(f"zone {zone!r} is not an AWS zone name like 'us-west-2a'")
    return zone[:-1]


def window_of(values: np.ndarray, start_tick: int, n_ticks: int, what: str) -> np.ndarray:
    """Slice `values` to a window, refusing windows that do not fit (no wrap-around, no padding)."""
    length = int(values.shape[-1])
    if n_ticks <= 0:
        raise ValueError(f"window of {what}: n_ticks={n_ticks} must be positive")
    if start_tick < 0 or start_tick + n_ticks > length:
        raise ValueError(
            f"window of {what}: ticks [{start_tick}, {start_tick + n_ticks}) do not fit a trace of "
            f"{length} ticks; valid starts are 0..{length - n_ticks}"
            if n_ticks <= length
            else f"window of {what}: {n_ticks} ticks is longer than the trace ({length} ticks); "
            "use a shorter deadline or a longer trace"
        )
    return values[..., start_tick : start_tick + n_ticks]


def default_spot_dir() -> Path:
    """`<TRAINWISE_DATA_DIR>/spot`, from the project's settings module."""
    from trainwise import settings  # imported here so the loader itself stays settings-free

    return settings.data_dir() / "spot"


def capacity_from_folder(folder: str) -> int:
    """Cluster size from a folder name ('preemption-4node-aws-2023-08' -> 4)."""
    match = _NODES_IN_FOLDER.search(folder)
    if match is None:
        raise ValueError(
            f"folder {folder!r} does not say its cluster size ('<N>node'); pass capacity_nodes="
        )
    return int(match.group(1))


def load_trace(
    path: str | Path, meaning: TraceMeaning, capacity_nodes: int | None = None
) -> SpotTrace:
    """Read one trace file; `meaning` is required because the files do not say it themselves.

    With `TraceMeaning.PREEMPTED`, the value v becomes `capacity_nodes - v` available nodes.
    """
    path = Path(path)
    if not isinstance(meaning, TraceMeaning):
        raise TypeError(
            f"meaning must be a TraceMeaning ({[m.value for m in TraceMeaning]}), got {meaning!r}"
        )
    match = _FILE_NAME.match(path.name)
    if match is None:
        raise ValueError(
            f"trace file name {path.name!r} is not '<zone>_<gpu>_<n>.json', "
            "e.g. 'us-west-2a_v100_1.json'"
        )
    folder = path.parent.name
    capacity = capacity_nodes if capacity_nodes is not None else capacity_from_folder(folder)
    if capacity < 1:
        raise ValueError(f"capacity_nodes={capacity} must be at least 1")
    try:
        raw = json.loads(path.read_text())
    except FileNotFoundError:
        raise FileNotFoundError(f"spot trace {path} does not exist; check TRAINWISE_DATA_DIR") from None
    except json.JSONDecodeError as error:
        raise ValueError(f"spot trace {path} is not valid JSON: {error}") from error
    gap = (raw.get("metadata") or {}).get("gap_seconds") if isinstance(raw, dict) else None
    if gap is None:
        raise ValueError(
            f"spot trace {path} has no metadata.gap_seconds: the tick length is "
            "required (seconds per value)"
        )
    if not isinstance(gap, int) or isinstance(gap, bool) or gap <= 0:
        raise ValueError(f"spot trace {path}: gap_seconds={gap!r} must be a positive integer")
    data = raw.get("data")
    if not isinstance(data, list) or len(data) == 0:
        raise ValueError(f"spot trace {path} has no data: 'data' must be a non-empty list of ints")
    values = np.asarray(data)
    if values.dtype.kind not in "iu":
        raise ValueError(f"spot trace {path}: data must be integers, got dtype {values.dtype}")
    if values.min() < 0:
        bad = int(np.argmax(values < 0))
        raise ValueError(
            f"spot trace {path}: negative value {int(values[bad])} at tick {bad}; "
            "values are instance counts (0 or more)"
        )
    if values.max() > capacity:
        bad = int(np.argmax(values > capacity))
        raise ValueError(
            f"spot trace {path}: value {int(values[bad])} at tick {bad} exceeds the "
            f"cluster size {capacity}; pass the right capacity_nodes"
        )
    available = values if meaning is TraceMeaning.AVAILABLE else capacity - values
    prices = raw.get("prices")
    recorded_price = float(np.mean(prices)) if isinstance(prices, list) and prices else None
    return SpotTrace(
        folder=folder,
        zone=match.group("zone"),
        node_shape=match.group("shape"),
        tick_s=gap,
        capacity_nodes=capacity,
        available=available.astype(np.int64),
        source_path=str(path),
        recorded_spot_price_usd_per_hour=recorded_price,
    )


def load_folder(
    folder: str,
    spot_dir: str | Path | None = None,
    meaning: TraceMeaning | None = None,
) -> list[SpotTrace]:
    """All traces of one folder, sorted by (node shape, zone).

    `meaning` defaults to the pinned `FOLDER_MEANING[folder]`; a folder not in that table must say
    its meaning explicitly.
    """
    base = Path(spot_dir) if spot_dir is not None else default_spot_dir()
    if meaning is None:
        if folder not in FOLDER_MEANING:
            raise ValueError(
                f"trace folder {folder!r} has no pinned meaning; pass meaning= "
                f"explicitly or use one of: {', '.join(sorted(FOLDER_MEANING))}"
            )
        meaning = FOLDER_MEANING[folder]
    path = base / folder
    if not path.is_dir():
        raise FileNotFoundError(
            f"trace folder {path} does not exist; known folders: "
            f"{', '.join(sorted(FOLDER_MEANING))} under {base}"
        )
    traces = [load_trace(p, meaning) for p in sorted(path.glob("*.json"))]
    if not traces:
        raise ValueError(f"trace folder {path} holds no *.json traces")
    return sorted(traces, key=lambda t: (t.node_shape, t.zone))


def group_by_shape(traces: list[SpotTrace]) -> dict[str, list[SpotTrace]]:
    """Traces of the same node shape (same instance type), the zones a multi-zone job can use."""
    groups: dict[str, list[SpotTrace]] = {}
    for trace in traces:
        groups.setdefault(trace.node_shape, []).append(trace)
    return groups


def scaled_availability(available: np.ndarray, copies: int, offset_ticks: int) -> np.ndarray:
    """Availability of `copies` independent pools made of time-shifted copies of one trace.

    How the benchmarks build a 16-node market from the 4-node trace: pool k sees the trace shifted
    by k * offset_ticks, and the zone's availability is the sum. The result is shorter by
    (copies - 1) * offset_ticks ticks: no wrap-around, so no artificial seams.
    """
    if copies < 1:
        raise ValueError(f"copies={copies} must be at least 1")
    if offset_ticks < 0:
        raise ValueError(f"offset_ticks={offset_ticks} must be 0 or more")
    length = int(available.shape[0]) - (copies - 1) * offset_ticks
    if length <= 0:
        raise ValueError(
            f"{copies} copies offset by {offset_ticks} ticks do not fit a trace of "
            f"{available.shape[0]} ticks; use fewer copies or a smaller offset"
        )
    total = np.zeros(length, dtype=np.int64)
    for k in range(copies):
        total += available[k * offset_ticks : k * offset_ticks + length]
    return total
