"""What one retraining trains on: the newest weeks of the market data the deployment holds for
its region, a record of it, and a seed that follows it.

The data: the single-node collections under `<TRAINWISE_DATA_DIR>/spot/` (a `collection.toml`
whose files load as 1-node markets) with a zone in the region. Each market (a collection's zones
of one instance type, all of them: a multi-zone cell may move out of the region) is placed in
real time, and this is the only way time order is established (file and folder names are never
read for it):
  1. `start_time` of its files in collection.toml (the aligned zones' common first tick), else
  2. `recorded_from_date` of the collection (00:00 UTC of that day), else
  3. nowhere: an undated collection cannot be called older or newer than another, so it is
     never trained on; its cells are held out.
A market covers [start, start + ticks x tick_s).

The window: the region's recorded spans are pooled (their union in time). The newest
`held_out_days` are held out, so the gate always judges a candidate on the freshest data; from
there `train_days` of RECORDED time are counted back, skipping the gaps between recordings, giving
[start_s, end_s). When a newer collection arrives or a trace grows, the window moves with it.

Slow split (`rolling_split`): training cells are 52 h windows (the cost suite's single-node job)
lying inside [start_s, end_s); held out are windows lying entirely before start_s or at or after
end_s, and every window of an undated collection. A window crossing either edge is in neither,
so the gate never scores time the policy trained on. (The heuristic's own risk model inside each
cell is still fitted leave-one-collection-out by `cloud.scenarios`, as for every policy.)

Fast statistics (`region_fast_stats`): the reclaim hazard of each of the region's zone traces
inside the newest `train_days` (no tail held out: the fast gate scores held-out seeds), the
figures `rl.fast_env.FastEnv` draws its notices from.

Fingerprint: sha256 over what training reads (collection, instance type, zones, tick, start, and
the int64 availability of the ticks used), so the same data gives the same fingerprint and any
changed value another. `derived_seed` adds its first 32 bits to the budget seed: the same data and
seed give the same policy, new data a new one.
"""

from __future__ import annotations

import datetime as dt
import hashlib
import math
from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np

from cloud import scenarios
from cloud.collections import CollectionMeta, read_collection
from cloud.scenarios import SINGLE_NODE, Scenario, ZoneGroup, build_scenarios, rules_for
from cloud.traces import SpotTrace, default_spot_dir, group_by_shape, load_folder

DAY_S = 86400.0
KINDS = ("single_zone", "multi_zone")
# How each market was placed in time (recorded with it).
BY_START_TIME = "start_time"
BY_RECORDED_FROM_DATE = "recorded_from_date"
UNDATED = "undated"


@dataclass(frozen=True, eq=False)  # holds an array: compared by identity
class MarketSpan:
    """One market of the region's data: all zones of one instance type of one collection."""

    collection: str
    instance_type: str
    zones: tuple[str, ...]
    home_zones: tuple[str, ...]  # the zones in the region (cells start there)
    tick_s: int
    available: np.ndarray  # zones x ticks, the market as the cells replay it
    start_s: float | None  # None: undated
    placed_by: str

    @property
    def n_ticks(self) -> int:
        return int(self.available.shape[1])

    @property
    def end_s(self) -> float | None:
        return None if self.start_s is None else self.start_s + self.n_ticks * self.tick_s

    def ticks_inside(self, start_s: float, end_s: float) -> tuple[int, int]:
        """[lo, hi): the ticks lying wholly inside [start_s, end_s), clipped to the market."""
        lo = math.ceil((start_s - self.start_s) / self.tick_s - 1e-9)
        hi = math.floor((end_s - self.start_s) / self.tick_s + 1e-9)
        return max(0, lo), min(self.n_ticks, hi)

    def ticks_before(self, time_s: float) -> int:
        """Ticks ending at or before `time_s`."""
        return max(0, min(self.n_ticks, math.floor((time_s - self.start_s) / self.tick_s + 1e-9)))

    def first_tick_from(self, time_s: float) -> int:
        """The first tick starting at or after `time_s`."""
        return max(0, min(self.n_ticks, math.ceil((time_s - self.start_s) / self.tick_s - 1e-9)))


@dataclass(frozen=True)
class TrainingWindow:
    region: str
    start_s: float
    end_s: float  # = where the held-out tail starts
    data_end_s: float  # the end of the newest recording of the region
    recorded_days: float  # recorded time inside [start_s, end_s) (gaps excluded)
    markets: tuple[MarketSpan, ...]  # every market of the region, dated or not

    def holds(self, start_s: float, end_s: float) -> bool:
        return self.start_s <= start_s and end_s <= self.end_s

    def overlaps(self, start_s: float, end_s: float) -> bool:
        return start_s < self.end_s and end_s > self.start_s


@dataclass(frozen=True)
class RollingSplit:
    train: tuple[Scenario, ...]
    held_out: tuple[Scenario, ...]  # newest first: the tail after the window, then older data
    region: str
    window: TrainingWindow
    data_sha256: str
    train_window: str  # one line for the policy header, the registry and the gate file
    train_data: dict  # the same, field by field (header `train_data`)


@dataclass(frozen=True)
class RegionFastStats:
    """Why a region's fast environment differs from another's: its measured reclaim hazards."""

    region: str
    hazards_per_h: tuple[float, ...]  # reclaims per spot-up hour, one per zone trace
    per_trace: tuple[dict, ...]
    collections: tuple[dict, ...]  # where they were measured: collection, zones, ticks, time
    reclaims: int
    spot_up_h: float
    window: TrainingWindow
    data_sha256: str

    @property
    def pooled_per_h(self) -> float:
        return self.reclaims / self.spot_up_h

    def describe(self) -> str:
        return (f"{self.region}: FastEnv notices at the reclaim hazard of {len(self.hazards_per_h)} "
                f"zone traces ({self.reclaims} reclaims in {self.spot_up_h:.1f} spot-up h, pooled "
                f"{self.pooled_per_h:.4f}/h) recorded in [{utc(self.window.start_s)}, "
                f"{utc(self.window.end_s)}); data sha256 {self.data_sha256[:16]}")

    def to_dict(self) -> dict:
        return {
            **window_record(self.window), "data_sha256": self.data_sha256,
            "collections": list(self.collections),
            "region_stats": {
                "reclaims_per_spot_up_h": [round(h, 6) for h in self.hazards_per_h],
                "pooled_reclaims_per_spot_up_h": round(self.pooled_per_h, 6),
                "reclaims": self.reclaims, "spot_up_h": round(self.spot_up_h, 3),
                "per_trace": list(self.per_trace),
                "stragglers": "Alibaba mini-batch traces (cloud.stragglers): they carry no "
                              "region, so they are the same in every region",
            },
            "why_regions_differ": (
                f"FastEnv draws preemption notices at {self.region}'s own reclaim hazards, "
                f"measured on its zones ({', '.join(sorted({t['zone'] for t in self.per_trace}))}"
                f"): pooled {self.pooled_per_h:.4f} per spot-up hour"),
        }


def utc(time_s: float) -> str:
    return dt.datetime.fromtimestamp(time_s, dt.UTC).strftime("%Y-%m-%dT%H:%MZ")


def derived_seed(budget_seed: int, data_sha256: str) -> int:
    """The budget seed plus the fingerprint's first 32 bits (mod 2**31, what numpy and sb3 take)."""
    return (int(budget_seed) + int(data_sha256[:8], 16)) % 2**31


# -- reading the region's markets ---------------------------------------------------------------
_SEEN_SIGNATURE: tuple | None = None


def _files_signature() -> tuple:
    """(path, size, mtime) of every file of every collection: what tells a long-lived process
    that the data changed (stat only, no read)."""
    base = default_spot_dir()
    return tuple((str(p), p.stat().st_size, p.stat().st_mtime_ns)
                 for p in sorted(base.glob("*/*")) if p.is_file())


def _forget_if_changed() -> None:
    """Fitted risk models and folder histories are cached by folder name in `cloud.scenarios`:
    when the data changed under them, drop them so the new data is what the cells replay."""
    global _SEEN_SIGNATURE
    signature = _files_signature()
    if signature != _SEEN_SIGNATURE:
        scenarios.forget_loaded_data()
        _SEEN_SIGNATURE = signature


def _placed(meta: CollectionMeta, traces: list[SpotTrace]) -> tuple[float | None, str]:
    """(start in epoch seconds or None, how): the order of the module doc."""
    if all(t.start_time_s is not None for t in traces):
        # Aligned by start time: every zone's first tick is the same instant (to the tick).
        return float(max(t.start_time_s for t in traces)), BY_START_TIME
    if meta.recorded_from_s is not None:
        return float(meta.recorded_from_s), BY_RECORDED_FROM_DATE
    return None, UNDATED


def region_markets(region: str) -> tuple[MarketSpan, ...]:
    """Every market of the region's single-node collections, oldest first (undated last)."""
    base = default_spot_dir()
    if not base.is_dir():
        raise FileNotFoundError(f"no spot data at {base}: retraining trains on the market data "
                                "the deployment holds there (set TRAINWISE_DATA_DIR)")
    _forget_if_changed()
    found: list[MarketSpan] = []
    regions: set[str] = set()
    for name in scenarios.all_collections():
        meta = read_collection(base / name)
        if meta.market_nodes != 1:  # gangs are not the slow policy's single-node job
            continue
        regions |= {f.region for f in meta.files.values()}
        if not any(f.region == region for f in meta.files.values()):
            continue
        for traces in group_by_shape(load_folder(name)).values():
            home = tuple(t.zone for t in traces if t.region == region)
            if not home:
                continue
            n_ticks = min(t.n_ticks for t in traces)  # a market keeps the common length
            start_s, placed_by = _placed(meta, traces)
            found.append(MarketSpan(
                name, traces[0].instance_type, tuple(t.zone for t in traces), home,
                traces[0].tick_s, np.stack([t.available[:n_ticks] for t in traces]), start_s,
                placed_by))
    if not found:
        raise ValueError(f"region {region!r} has no zone in a single-node spot collection under "
                         f"{base}; regions there: {', '.join(sorted(regions)) or 'none'}")
    return tuple(sorted(found, key=lambda m: (m.start_s is None, m.start_s or 0.0,
                                              m.collection, m.instance_type)))


def _recorded_union(markets: Iterable[MarketSpan]) -> list[tuple[float, float]]:
    spans = sorted((m.start_s, m.end_s) for m in markets if m.start_s is not None)
    union: list[list[float]] = []
    for start, end in spans:
        if union and start <= union[-1][1]:
            union[-1][1] = max(union[-1][1], end)
        else:
            union.append([start, end])
    return [(a, b) for a, b in union]


def training_window(region: str, train_days: float, held_out_days: float = 0.0
                    ) -> TrainingWindow:
    """The newest `train_days` of recorded time before the held-out tail (module doc)."""
    if not train_days > 0 or not held_out_days >= 0:
        raise ValueError(f"train_days={train_days} must be > 0 and held_out_days="
                         f"{held_out_days} >= 0")
    markets = region_markets(region)
    union = _recorded_union(markets)
    if not union:
        raise ValueError(
            f"no collection of region {region!r} says when it was recorded, so none can be "
            "called the newest: give start_time (per file) or recorded_from_date (the "
            f"collection) in its collection.toml ({', '.join(m.collection for m in markets)})")
    data_end_s = union[-1][1]
    end_s = data_end_s - held_out_days * DAY_S
    need_s, start_s = train_days * DAY_S, end_s
    for a, b in reversed(union):  # newest recording first, skipping the gaps between them
        b = min(b, end_s)
        if b <= a or need_s <= 0:
            continue
        take = min(need_s, b - a)
        start_s, need_s = b - take, need_s - take
    recorded_days = (train_days * DAY_S - need_s) / DAY_S
    if recorded_days <= 0:
        raise ValueError(f"region {region!r}: its recordings end {held_out_days} d after they "
                         "start or sooner, so nothing is left to train on before the held-out "
                         "tail; lower held_out_days or add data")
    return TrainingWindow(region, start_s, end_s, data_end_s, recorded_days, markets)


def window_record(window: TrainingWindow) -> dict:
    return {"region": window.region, "start_utc": utc(window.start_s),
            "end_utc": utc(window.end_s), "data_end_utc": utc(window.data_end_s),
            "recorded_days": round(window.recorded_days, 3),
            "time_order": "start_time in collection.toml, else recorded_from_date; undated "
                          "collections are never trained on"}


def _fingerprint(parts: Iterable[tuple[MarketSpan, int, int]], home_rows_only: bool) -> str:
    """sha256 of the ticks [lo, hi) read from each market: every zone's row for the slow
    policy (a multi-zone cell may move to any zone; its home zones are hashed too, since two
    regions train on different cells of one market), the region's rows only for the fast
    statistics (the hazards are measured there and nowhere else)."""
    digest = hashlib.sha256()
    for market, lo, hi in parts:
        rows = [z for z, zone in enumerate(market.zones)
                if not home_rows_only or zone in market.home_zones]
        digest.update(f"{market.collection}|{market.instance_type}|{','.join(market.zones)}|"
                      f"{','.join(market.home_zones)}|{market.tick_s}|{market.start_s}|{lo}|{hi}|"
                      f"{rows}\n".encode())
        digest.update(np.ascontiguousarray(market.available[rows, lo:hi], dtype=np.int64)
                      .tobytes())
    return digest.hexdigest()


def _market_record(market: MarketSpan, lo: int, hi: int) -> dict:
    """Where in one market training read: ticks [lo, hi) and the real time they cover."""
    return {"collection": market.collection, "instance_type": market.instance_type,
            "zones": list(market.zones), "home_zones": list(market.home_zones),
            "ticks": [lo, hi], "tick_s": market.tick_s,
            "start_utc": utc(market.start_s + lo * market.tick_s),
            "end_utc": utc(market.start_s + hi * market.tick_s), "placed_by": market.placed_by}


# -- the slow policy's split --------------------------------------------------------------------
def _even_starts(lo: int, hi: int, window_ticks: int, count: int) -> list[int]:
    """Up to `count` evenly spaced starts of windows lying inside ticks [lo, hi)."""
    if hi - lo < window_ticks or count < 1:
        return []
    return [lo + s for s in scenarios.window_starts(hi - lo, window_ticks, count)]


def _cells(market: MarketSpan, starts: list[int], kinds: tuple[str, ...]) -> list[Scenario]:
    if not starts:
        return []

    def starts_for(group: ZoneGroup, window_ticks: int) -> list[int]:
        return starts if group.instance_type == market.instance_type else []

    built = build_scenarios(SINGLE_NODE, rules_for(SINGLE_NODE), 1, kinds=kinds,
                            folders=(market.collection,), starts_for=starts_for, skipped=[])
    return [c for c in built if c.home_zone in market.home_zones
            and c.instance_type == market.instance_type]


def cell_span_s(cell: Scenario, market: MarketSpan) -> tuple[float, float]:
    """The real time a cell replays: [start, end)."""
    start = market.start_s + cell.start_tick * market.tick_s
    return start, start + cell.market.n_ticks * market.tick_s


def _window_ticks(market: MarketSpan) -> int:
    return math.floor(SINGLE_NODE.deadline_h * 3600.0 / market.tick_s + 1e-9)


def _train_cells(market: MarketSpan, window: TrainingWindow, windows_per_zone: int,
                 kinds: tuple[str, ...]) -> tuple[list[Scenario], tuple[int, int] | None]:
    """The market's windows inside the training window: their count is the market's share of
    `windows_per_zone` by the recorded time it covers; also the ticks they read ([lo, hi))."""
    w = _window_ticks(market)
    lo, hi = market.ticks_inside(window.start_s, window.end_s)
    share = (hi - lo) * market.tick_s / (window.recorded_days * DAY_S) if hi > lo else 0.0
    starts = _even_starts(lo, hi, w, max(1, round(windows_per_zone * share)))
    cells = _cells(market, starts, kinds)
    return cells, ((min(starts), max(starts) + w) if cells else None)


def _held_cells(market: MarketSpan, window: TrainingWindow, per_trace: int,
                kinds: tuple[str, ...]) -> tuple[list[Scenario], list[Scenario]]:
    """(after, before): the market's windows wholly after the training window and wholly before
    it, newest first; an undated market's windows all count as before."""
    w = _window_ticks(market)
    if market.start_s is None:
        return [], _cells(market, _even_starts(0, market.n_ticks, w, per_trace), kinds)
    early = market.ticks_before(window.start_s)
    late = market.first_tick_from(window.end_s)
    before = _cells(market, _even_starts(0, early, w, _held_count(early, market.n_ticks,
                                                                  per_trace)), kinds)
    after = _cells(market, _even_starts(late, market.n_ticks, w, _held_count(
        market.n_ticks - late, market.n_ticks, per_trace)), kinds)
    return _newest_first(after), _newest_first(before)


def _newest_first(cells: list[Scenario]) -> list[Scenario]:
    return sorted(cells, key=lambda c: -c.start_tick)  # stable: zones keep their order


def _held_count(ticks: int, n_ticks: int, per_trace: int) -> int:
    """Held-out windows for a part of a trace: its share of `per_trace`, at least one."""
    return max(1, round(per_trace * ticks / max(n_ticks, 1)))


def rolling_split(region: str, train_days: float, held_out_days: float,
                  windows_per_zone: int = 12, held_out_windows_per_zone: int = 4,
                  kinds: tuple[str, ...] = KINDS) -> RollingSplit:
    """Training cells inside the window, held-out cells outside it (module doc). Start windows
    per zone: `windows_per_zone` over the training window (shared by its markets in proportion
    to the time each covers), `held_out_windows_per_zone` over a whole trace held out. Held-out
    cells come newest first: the tail after the window (from the newest market down), then
    older data, then undated collections."""
    window = training_window(region, train_days, held_out_days)
    dated = [m for m in window.markets if m.start_s is not None]  # oldest first
    train: list[Scenario] = []
    used: list[tuple[MarketSpan, int, int]] = []
    for market in dated:
        cells, ticks = _train_cells(market, window, windows_per_zone, kinds)
        train += cells
        used += [(market, *ticks)] if ticks else []
    # (after, before) per market; markets are oldest first, undated last.
    held = [_held_cells(m, window, held_out_windows_per_zone, kinds) for m in window.markets]
    newest = [parts for m, parts in reversed(list(zip(window.markets, held, strict=True)))
              if m.start_s is not None]
    held_out = ([c for after, _ in newest for c in after]
                + [c for _, before in newest for c in before]
                + [c for m, (_, before) in zip(window.markets, held, strict=True)
                   if m.start_s is None for c in before])
    if not train:
        raise ValueError(
            f"region {region!r}: no {SINGLE_NODE.deadline_h:g} h window fits the training window "
            f"[{utc(window.start_s)}, {utc(window.end_s)}) ({window.recorded_days:.1f} d "
            "recorded); raise train_days or add data")
    fingerprint = _fingerprint(used, home_rows_only=False)
    records = [_market_record(m, lo, hi) for m, lo, hi in used]
    record = {**window_record(window), "train_days": train_days, "held_out_days": held_out_days,
              "collections": records, "data_sha256": fingerprint, "train_cells": len(train),
              "held_out_cells": len(held_out)}
    return RollingSplit(tuple(train), tuple(held_out), region, window, fingerprint,
                        _summary(window, records, fingerprint), record)


def _summary(window: TrainingWindow, records: list[dict], fingerprint: str) -> str:
    """The one line a header's train_window, the registry and the gate file show."""
    parts = ", ".join(f"{r['collection']} {r['instance_type']} ({', '.join(r['home_zones'])}) "
                      f"ticks [{r['ticks'][0]}, {r['ticks'][1]})" for r in records)
    return (f"{window.region}: {window.recorded_days:.1f} d recorded in [{utc(window.start_s)}, "
            f"{utc(window.end_s)}) from {parts}; held out: from {utc(window.end_s)} and before "
            f"{utc(window.start_s)}; data sha256 {fingerprint[:16]}")


# -- the fast policy's region statistics --------------------------------------------------------
def region_fast_stats(region: str, days: float) -> RegionFastStats:
    """Reclaims per spot-up hour of each of the region's zone traces in its newest `days` of
    recorded data (a reclaim: a tick with the node up followed by one with it down)."""
    window = training_window(region, days, 0.0)
    hazards, per_trace, used, records = [], [], [], []
    reclaims, up_h = 0, 0.0
    for market in window.markets:
        if market.start_s is None:
            continue
        lo, hi = market.ticks_inside(window.start_s, window.end_s)
        if hi - lo < 2:
            continue
        used.append((market, lo, hi))
        records.append(_market_record(market, lo, hi))
        for z, zone in enumerate(market.zones):
            if zone not in market.home_zones:
                continue
            a = market.available[z, lo:hi]
            drops = int(((a[:-1] >= 1) & (a[1:] == 0)).sum())
            hours = float((a >= 1).sum()) * market.tick_s / 3600.0
            per_trace.append({"collection": market.collection, "zone": zone,
                              "instance_type": market.instance_type, "reclaims": drops,
                              "spot_up_h": round(hours, 3), "tick_s": market.tick_s,
                              "reclaims_per_spot_up_h": round(drops / hours, 6) if hours else None})
            if hours > 0:
                hazards.append(drops / hours)
                reclaims, up_h = reclaims + drops, up_h + hours
    if not hazards:
        raise ValueError(f"region {region!r}: no spot-up time in [{utc(window.start_s)}, "
                         f"{utc(window.end_s)}), so no reclaim hazard can be measured; raise "
                         "the days or add data")
    return RegionFastStats(region, tuple(hazards), tuple(per_trace), tuple(records), reclaims,
                           up_h, window, _fingerprint(used, home_rows_only=True))
