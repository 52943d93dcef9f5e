"""Spot markets replayed from recorded traces (skypilot-org/spot-traces, NSDI'24 "Can't Be Late"
data, or any collection a user brings).

Each trace file is JSON `{"metadata": {"gap_seconds": N}, "data": [int, ...]}`: one integer per
tick. What the folder holds is stated in its `collection.toml` (`cloud/collections.py`): provider,
value meaning, nodes per file, and per file its zone, region, instance type, tick, start time and
prices when known. File and folder names are not parsed for meaning; a folder without
collection.toml is refused with an example of one.

What an integer means is NOT the same across the ecosystem: the traces' README says "number of
available instances", while simulators from the same group read 1 as "preempted" (see
`shared/data/spot/SEMANTICS.md`). So the meaning is stated per collection, and `FOLDER_MEANING`
pins it again for every folder we ship: a collection.toml that disagrees is refused. Reading a
90%-available zone as 10%-available would silently flip every savings figure.

A collection recording N-node clusters (`nodes_per_file = N`) loads as an N-node market, values
0..N, as recorded; with `up_if_at_least = K` a file records one node of N VMs instead, up when at
least K of them are (a 1-node market). Zones of one instance type are aligned by their real start
time when the collection gives one for every file; otherwise they are paired by tick index from
each file's first tick, every loaded trace says so in `alignment`, and zones of unequal length
paired so are warned about (`TraceAlignmentWarning`: the markets built from them keep the
shortest zone's ticks).

Spot prices recorded in a trace file (`"prices": [...]`, USD per node-hour) are billed when
collection.toml states no spot price (`cloud.prices.node_prices`): one price per zone, their mean,
with a warning when they vary (the replay bills one price per zone).
"""

from __future__ import annotations

import json
import warnings
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

from cloud import prices
from cloud.collections import (
    COLLECTION_FILE,
    CollectionError,
    CollectionMeta,
    TraceMeaning,
    read_collection,
    region_of_zone,
)

__all__ = [
    "ALIGNED_BY_START_TIME", "ALIGNED_AT_TICK_0", "FOLDER_MEANING", "MAX_TRACE_BYTES",
    "CollectionError", "SpotTrace", "TraceAlignmentWarning", "TraceCollection", "TraceMeaning",
    "TracePriceWarning", "align_by_start_time",
    "default_spot_dir", "group_by_shape", "load_collection", "load_folder", "load_trace",
    "read_trace_values", "region_of_zone", "scaled_availability", "window_of",
]

# Checked value for value against the raw collections (spot/SEMANTICS.md): all four folders count
# available instances. Their collection.toml must say the same.
FOLDER_MEANING: dict[str, TraceMeaning] = {
    "availability-1node-aws-2023-02": TraceMeaning.AVAILABLE,
    "availability-1node-aws-2022-10": TraceMeaning.AVAILABLE,
    "preemption-1node-aws-2023-04": TraceMeaning.AVAILABLE,
    "preemption-4node-aws-2023-08": TraceMeaning.AVAILABLE,
}

# The shipped files are ~100 KB; a trace this large is refused before it is read.
MAX_TRACE_BYTES = 64 << 20


class TraceAlignmentWarning(UserWarning):
    """Zones of unequal length paired at tick 0 (no start times): the longer ones are cut."""


class TracePriceWarning(UserWarning):
    """Spot prices recorded in a trace file that are not billed as recorded (varying: their
    mean is billed; not numbers, or not positive: not billed at all)."""


ALIGNED_BY_START_TIME = "start_time"
ALIGNED_AT_TICK_0 = (
    "tick_0: start times unknown, zones paired by tick index from each file's first tick"
)


@dataclass(frozen=True)
class SpotTrace:
    """Spot availability of one zone: `available[i]` nodes could be held during tick i."""

    folder: str
    zone: str
    # Legacy label of the node type ("v100_1" for p3.2xlarge; the instance type when unlisted).
    node_shape: str
    tick_s: int
    # Largest number of nodes a tick can report (the recorded cluster size, nodes_per_file).
    capacity_nodes: int
    available: np.ndarray
    source_path: str
    # Spot price recorded in the trace file itself, when it has one (constant in these files).
    recorded_spot_price_usd_per_hour: float | None = None
    region: str = ""
    instance_type: str = ""
    gpus_per_node: int = 1
    provider: str = ""
    # Epoch seconds (UTC) of available[0], when the collection gives start times.
    start_time_s: float | None = None
    alignment: str = ALIGNED_AT_TICK_0
    # Ticks cut from the file's start to align it with the other zones of its type.
    offset_ticks: int = 0
    on_demand_usd_per_hour: float = 0.0
    spot_usd_per_hour: float = 0.0
    on_demand_price_source: str = ""
    spot_price_source: str = ""

    @property
    def n_ticks(self) -> int:
        return int(self.available.shape[0])

    @property
    def duration_s(self) -> int:
        return self.n_ticks * self.tick_s

    @property
    def prices_from_collection(self) -> bool:
        """Both prices were stated in collection.toml (not looked up)."""
        return self.on_demand_price_source == self.spot_price_source == COLLECTION_FILE

    @property
    def spot_price_stated(self) -> bool:
        """The spot price comes from the data (collection.toml or the prices recorded in the
        trace file), not from a table looked up."""
        return (self.spot_price_source == COLLECTION_FILE
                or self.spot_price_source.startswith(prices.RECORDED_IN_TRACE))

    def window(self, start_tick: int, n_ticks: int) -> np.ndarray:
        """Availability for ticks [start_tick, start_tick + n_ticks); errors name valid starts."""
        return window_of(self.available, start_tick, n_ticks, what=f"trace {self.source_path}")


@dataclass(frozen=True)
class TraceCollection:
    """A loaded folder: its metadata and its traces, aligned per instance type."""

    meta: CollectionMeta
    traces: tuple[SpotTrace, ...]

    @property
    def nodes_per_file(self) -> int:
        return self.meta.nodes_per_file

    @property
    def alignment(self) -> str:
        return ALIGNED_BY_START_TIME if self.meta.start_times_known else ALIGNED_AT_TICK_0


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


def _refuse_constant(name: str) -> None:
    raise ValueError(f"{name} is not a number")


def read_trace_values(path: str | Path) -> tuple[int | None, np.ndarray, float | None]:
    """(gap_seconds or None, the values, the mean recorded spot price or None) of one file.

    Data only: JSON parsed by the standard library, size-capped, no code run; errors name the
    file. Values are not interpreted here (see `load_trace`).
    """
    path = Path(path)
    try:
        size = path.stat().st_size
    except FileNotFoundError:
        raise FileNotFoundError(f"spot trace {path} does not exist; check TRAINWISE_DATA_DIR") from None
    if size > MAX_TRACE_BYTES:
        raise ValueError(f"spot trace {path} is {size} bytes, over the {MAX_TRACE_BYTES}-byte "
                         "limit; split it into files of one zone each")
    try:
        raw = json.loads(path.read_bytes().decode("utf-8"), parse_constant=_refuse_constant)
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError, ValueError) as error:
        reason = "nested too deeply" if isinstance(error, RecursionError) else str(error)[:200]
        raise ValueError(f"spot trace {path} is not valid trace JSON: {reason}") from None
    if not isinstance(raw, dict):
        raise ValueError(f'spot trace {path} must be a JSON object {{"metadata": ..., "data": ...}}')
    metadata = raw.get("metadata")
    gap = metadata.get("gap_seconds") if isinstance(metadata, dict) else None
    if gap is not None and (not isinstance(gap, int) or isinstance(gap, bool) or gap <= 0):
        raise ValueError(f"spot trace {path}: gap_seconds={gap!r} must be a positive integer")
    data = raw.get("data")
    if not isinstance(data, list) or len(data) == 0:
        raise ValueError(f"spot trace {path} has no data: 'data' must be a non-empty list of ints")
    try:
        values = np.asarray(data)
    except ValueError as error:
        raise ValueError(f"spot trace {path}: data must be a flat list of integers") from error
    if values.dtype.kind not in "iu" or values.ndim != 1:
        raise ValueError(
            f"spot trace {path}: data must be a flat list of integers, got dtype {values.dtype} "
            f"with {values.ndim} dimensions"
        )
    return gap, values, _recorded_price(path, raw.get("prices"))


def _recorded_price(path: Path, prices_raw: object) -> float | None:
    """The mean of the spot prices a trace file records (billed: `cloud.prices.node_prices`), or
    None where it records none; prices that cannot be billed are refused with a warning."""
    if prices_raw is None or prices_raw == []:
        return None
    numbers = [p for p in prices_raw if isinstance(p, (int, float)) and not isinstance(p, bool)
               ] if isinstance(prices_raw, list) else []
    if not numbers or len(numbers) != len(prices_raw) or min(numbers) <= 0:  # type: ignore[arg-type]
        warnings.warn(
            f"spot trace {path}: its 'prices' are not a list of positive numbers (USD per "
            "node-hour): NOT billed; the spot price comes from collection.toml or the Spot "
            "Advisor instead", TracePriceWarning, stacklevel=3)
        return None
    low, high, mean = min(numbers), max(numbers), float(np.mean(numbers))
    if high > low * 1.01:
        warnings.warn(
            f"spot trace {path}: its recorded spot prices vary ({low:g} to {high:g} USD/h); the "
            f"replay bills one price per zone: their mean, {mean:.4f} USD/h", TracePriceWarning,
            stacklevel=3)
    return mean


def load_trace(
    path: str | Path,
    meaning: TraceMeaning | None = None,
    capacity_nodes: int | None = None,
    collection: CollectionMeta | None = None,
) -> SpotTrace:
    """Read one trace file with what its folder's collection.toml says about it.

    `meaning` and `capacity_nodes`, when given, must agree with the collection (they are checks,
    kept for callers that pinned them). With `preempted_count`, a value v becomes
    `nodes_per_file - v` available nodes.
    """
    path = Path(path)
    if meaning is not None and not isinstance(meaning, TraceMeaning):
        raise TypeError(
            f"meaning must be a TraceMeaning ({[m.value for m in TraceMeaning]}), got {meaning!r}"
        )
    gap, values, recorded = read_trace_values(path)
    meta = collection if collection is not None else read_collection(path.parent)
    where = f"spot trace {path}"
    if meaning is not None and meaning is not meta.meaning:
        raise ValueError(
            f"{where}: the caller reads values as {meaning.value} but {meta.path} says "
            f"{meta.meaning.value}; fix whichever is wrong (spot/SEMANTICS.md)"
        )
    info = meta.files.get(path.name)
    if info is None:
        raise CollectionError(
            f"{where} is not described in {meta.path}; add a [files.\"{path.name}\"] table with "
            "zone and instance_type (see cloud/collections.py)"
        )
    capacity = info.nodes
    if capacity_nodes is not None and capacity_nodes != capacity:
        raise ValueError(f"{where}: capacity_nodes={capacity_nodes} but {meta.path} says "
                         f"nodes_per_file = {capacity}")
    tick_s = _tick_s(where, meta, info.tick_s, gap)
    if info.ticks is not None and info.ticks != values.shape[0]:
        raise ValueError(f"{where} holds {values.shape[0]} ticks but {meta.path} says ticks = "
                         f"{info.ticks}; fix the metadata or the file")
    _check_counts(where, values, capacity)
    available = values if meta.meaning is TraceMeaning.AVAILABLE else capacity - values
    if info.up_if_at_least is not None:
        # One node of `capacity` VMs, up when at least up_if_at_least of them are.
        available = (available >= info.up_if_at_least).astype(np.int64)
        capacity = 1
    gpus = info.gpus_per_node
    if gpus is None:
        if info.instance_type not in prices.INSTANCE_TYPES:
            raise CollectionError(
                f'{where}: instance type {info.instance_type!r} is not in cloud/prices.py; add '
                f'gpus_per_node = N to its [files."{path.name}"] table in {meta.path}'
            )
        gpus = prices.INSTANCE_TYPES[info.instance_type].gpus
    node_prices = prices.node_prices(
        info.instance_type, info.region, meta.provider, info.on_demand_usd_per_hour,
        info.spot_usd_per_hour, where=f"{where} ({info.instance_type} in {info.region})",
        file_name=path.name, recorded_spot_usd_per_hour=recorded,
    )
    return SpotTrace(
        folder=meta.folder,
        zone=info.zone,
        node_shape=prices.node_shape_of(info.instance_type),
        tick_s=tick_s,
        capacity_nodes=capacity,
        available=available.astype(np.int64),
        source_path=str(path),
        recorded_spot_price_usd_per_hour=recorded,
        region=info.region,
        instance_type=info.instance_type,
        gpus_per_node=gpus,
        provider=meta.provider,
        start_time_s=info.start_time_s,
        alignment=ALIGNED_BY_START_TIME if meta.start_times_known else ALIGNED_AT_TICK_0,
        on_demand_usd_per_hour=node_prices.on_demand_usd_per_hour,
        spot_usd_per_hour=node_prices.spot_usd_per_hour,
        on_demand_price_source=node_prices.on_demand_source,
        spot_price_source=node_prices.spot_source,
    )


def _tick_s(where: str, meta: CollectionMeta, stated: int | None, gap: int | None) -> int:
    if stated is not None and gap is not None and stated != gap:
        raise ValueError(f"{where}: metadata.gap_seconds = {gap} but {meta.path} says "
                         f"tick_seconds = {stated}; fix whichever is wrong")
    tick_s = stated if stated is not None else gap
    if tick_s is None:
        raise ValueError(f"{where} has no metadata.gap_seconds and {meta.path} no tick_seconds: "
                         "the tick length (seconds per value) is required; add tick_seconds = N")
    return tick_s


def _check_counts(where: str, values: np.ndarray, capacity: int) -> None:
    if values.min() < 0:
        bad = int(np.argmax(values < 0))
        raise ValueError(f"{where}: negative value {int(values[bad])} at tick {bad}; values are "
                         "instance counts (0 or more)")
    if values.max() > capacity:
        bad = int(np.argmax(values > capacity))
        raise ValueError(
            f"{where}: value {int(values[bad])} at tick {bad} exceeds the cluster size "
            f"{capacity}; set nodes_per_file in collection.toml to the recorded cluster size"
        )


def load_collection(
    folder: str, spot_dir: str | Path | None = None, meaning: TraceMeaning | None = None
) -> TraceCollection:
    """Every trace of `spot_dir/folder`, as its collection.toml describes, aligned per instance
    type, sorted by (node shape, zone). `meaning`, when given, must agree with the collection."""
    base = Path(spot_dir) if spot_dir is not None else default_spot_dir()
    path = base / folder
    if not path.is_dir():
        known = sorted(p.parent.name for p in base.glob(f"*/{COLLECTION_FILE}"))
        raise FileNotFoundError(
            f"trace folder {path} does not exist; folders with a {COLLECTION_FILE} under "
            f"{base}: {', '.join(known) or 'none'}"
        )
    meta = read_collection(path)
    pinned = FOLDER_MEANING.get(folder)
    if pinned is not None and pinned is not meta.meaning:
        raise CollectionError(
            f"{meta.path} reads values as {meta.meaning.value}, but this folder was checked value "
            f"for value to count {pinned.value} nodes (spot/SEMANTICS.md); fix value_meaning"
        )
    on_disk = {p.name for p in path.glob("*.json")}
    unlisted = sorted(on_disk - meta.files.keys())
    if unlisted:
        raise CollectionError(
            f"{path} holds {', '.join(unlisted[:5])} with no [files.\"NAME\"] table in "
            f"{meta.path}; describe each trace file there or move it out"
        )
    absent = sorted(meta.files.keys() - on_disk)
    if absent:
        raise CollectionError(f"{meta.path} describes {', '.join(absent[:5])}, which {path} does "
                              "not hold; remove the table or add the file")
    raw = [load_trace(path / name, meaning, collection=meta) for name in sorted(meta.files)]
    traces: list[SpotTrace] = []
    for group in group_by_shape(raw).values():
        if meta.start_times_known:
            traces += align_by_start_time(group)
        else:
            _warn_unequal_at_tick_0(meta, group)
            traces += group
    return TraceCollection(meta, tuple(sorted(traces, key=lambda t: (t.node_shape, t.zone))))


def load_folder(
    folder: str,
    spot_dir: str | Path | None = None,
    meaning: TraceMeaning | None = None,
) -> list[SpotTrace]:
    """All traces of one folder (`load_collection(...).traces`), sorted by (node shape, zone)."""
    return list(load_collection(folder, spot_dir, meaning).traces)


def align_by_start_time(traces: list[SpotTrace]) -> list[SpotTrace]:
    """The traces cut to the span they all cover, so tick i is the same instant in every zone.

    Offsets are rounded to whole ticks (a recording's clock need not fall on the others' grid).
    """
    if not traces:
        return []
    missing = [t.source_path for t in traces if t.start_time_s is None]
    if missing:
        raise ValueError(f"cannot align by start time: no start_time for {', '.join(missing)}")
    ticks = {t.tick_s for t in traces}
    if len(ticks) != 1:
        raise ValueError(
            f"zones of {traces[0].instance_type} in {traces[0].folder} have different ticks "
            f"({sorted(ticks)} s); a market needs one tick: resample or split the collection"
        )
    tick_s = ticks.pop()
    start = max(t.start_time_s for t in traces)  # type: ignore[type-var]
    offsets = [round((start - t.start_time_s) / tick_s) for t in traces]  # type: ignore[operator]
    length = min(t.n_ticks - o for t, o in zip(traces, offsets, strict=True))
    if length <= 0:
        raise ValueError(
            f"the zones of {traces[0].instance_type} in {traces[0].folder} never record at the "
            "same time (no overlap between their start_time spans); check start_time"
        )
    return [
        replace(
            t,
            available=t.available[o : o + length],
            start_time_s=t.start_time_s + o * tick_s,  # type: ignore[operator]
            alignment=ALIGNED_BY_START_TIME,
            offset_ticks=o,
        )
        for t, o in zip(traces, offsets, strict=True)
    ]


def _warn_unequal_at_tick_0(meta: CollectionMeta, group: list[SpotTrace]) -> None:
    """Zones paired by tick index that do not cover the same span: say so, naming them."""
    lengths = {t.n_ticks for t in group}
    if len(lengths) < 2:
        return
    shortest = min(lengths)
    zones = ", ".join(f"{t.zone} ({Path(t.source_path).name}): {t.n_ticks} ticks"
                      for t in sorted(group, key=lambda t: (t.n_ticks, t.zone)))
    warnings.warn(
        f"{meta.folder}: the {group[0].instance_type} zones have unequal lengths and no "
        f"start_time, so they are paired at tick 0 and a market of them keeps the first "
        f"{shortest} ticks: {zones}. Give start_time for every file in {meta.path} to align them "
        "by real time", TraceAlignmentWarning, stacklevel=3)


def group_by_shape(traces: list[SpotTrace]) -> dict[str, list[SpotTrace]]:
    """Traces of the same node shape (same instance type), the zones a multi-zone job can use."""
    groups: dict[str, list[SpotTrace]] = {}
    for trace in traces:
        groups.setdefault(trace.node_shape, []).append(trace)
    return groups


def scaled_availability(available: np.ndarray, copies: int, offset_ticks: int) -> np.ndarray:
    """Availability of `copies` pools made of time-shifted copies of one trace: a SYNTHETIC
    market, to be labelled so wherever it is reported.

    How the cost suite builds its labelled synthetic 16-node market from the 4-node trace: pool k
    sees the trace shifted by k * offset_ticks, and the zone's availability is the sum. The result
    is shorter by (copies - 1) * offset_ticks ticks: no wrap-around, so no artificial seams.
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
