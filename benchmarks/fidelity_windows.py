"""The scored windows of `benchmarks/fidelity.py`: the kinds (single-zone, multi-zone, gang-4),
the trace files they come from, the calibration windows kept apart from them, and the rule that
picks each window (a reclaim soon after the start, fixed before any run).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from cloud import emulated as replay
from cloud.traces import FOLDER_MEANING, load_trace
from trainwise import settings


@dataclass(frozen=True)
class Window:
    """One scored window: a trace file (the home zone), the tick the replay starts at, the other
    zones replayed with it (multi-zone) and the gang's node count."""

    folder: str
    zone_file: str
    start_tick: int
    kind: str  # SINGLE_ZONE, MULTI_ZONE or "gang-N"; why it was picked in `picked_for`
    picked_for: str
    other_zone_files: tuple[str, ...] = ()
    nodes: int = 1

    @property
    def zone_files(self) -> list[str]:
        """Every zone replayed, the home zone first."""
        return [self.zone_file, *self.other_zone_files]

    @property
    def label(self) -> str:
        extra = f" +{len(self.other_zone_files)} zones" if self.other_zone_files else ""
        return f"{self.folder}/{self.zone_file}{extra} @{self.start_tick}"


SINGLE_ZONE, MULTI_ZONE = "single-zone", "multi-zone"
KINDS = (SINGLE_ZONE, MULTI_ZONE, "gang-4")
# Multi-zone windows: every zone of this folder replayed together, homes in scored zones.
MULTI_ZONE_FOLDER = "availability-1node-aws-2023-02"
MULTI_ZONE_HOMES = (("us-east-1a_v100_1.json", 200), ("us-east-1d_v100_1.json", 2000),
                    ("us-west-2a_v100_1.json", 4000))
# 4-node gang windows: the 4-node trace (0..4 nodes up a tick), one zone each (the folder's files
# are not known to start at the same instant, so they are not replayed side by side).
GANG_FOLDER = "preemption-4node-aws-2023-08"
GANG_NODES = 4
GANG_FILES = (("us-east-1f_v100_1.json", 0), ("us-west-2c_v100_1.json", 0),
              ("us-east-1f_v100_1.json", 1000))


# Scored zones and calibration zones are disjoint (calibration runs on_demand, so the trace does
# not matter to it, but keeping them apart makes that plain).
CALIBRATION_WINDOWS = (("availability-1node-aws-2023-02", "us-west-2c_v100_1.json", 300),
                       ("availability-1node-aws-2023-02", "us-east-2b_v100_1.json", 900),
                       ("availability-1node-aws-2023-02", "us-west-2c_v100_1.json", 3000))
SCORED_FILES = (("availability-1node-aws-2023-02", "us-east-1a_v100_1.json"),
                ("availability-1node-aws-2023-02", "us-east-1c_v100_1.json"),
                ("availability-1node-aws-2023-02", "us-east-1d_v100_1.json"),
                ("availability-1node-aws-2023-02", "us-east-1f_v100_1.json"),
                ("availability-1node-aws-2023-02", "us-east-2a_v100_1.json"),
                ("availability-1node-aws-2023-02", "us-west-2a_v100_1.json"),
                ("availability-1node-aws-2023-02", "us-west-2b_v100_1.json"),
                ("availability-1node-aws-2022-10", "us-west-2a_v100_1.json"),
                ("availability-1node-aws-2022-10", "us-west-2b_v100_1.json"),
                ("preemption-1node-aws-2023-04", "us-east-1c_v100_1.json"),
                ("preemption-1node-aws-2023-04", "us-west-2b_v100_1.json"),
                ("preemption-1node-aws-2023-04", "us-east-1f_v100_1.json"))


def spot_dir() -> Path:
    return settings.data_dir() / "spot"


def pick_windows(count: int) -> list[Window]:
    """`count` windows, one per scored trace file in order, then a second pass: the first
    window after tick 200 (pass 2: after tick 2000) where spot is up a few ticks and then
    reclaimed (`find_drop_window`), so most windows meet a preemption; a file without one gives
    its tick-200 window (steady market)."""
    windows: list[Window] = []
    passes = ((4, 200), (6, 2000), (3, 4000))
    for up_ticks, min_start in passes:
        for folder, zone_file in SCORED_FILES:
            if len(windows) == count:
                return windows
            path = spot_dir() / folder / zone_file
            if not path.is_file():
                continue
            trace = load_trace(path, FOLDER_MEANING[folder])
            try:
                start = replay.find_drop_window(trace.available, up_ticks=up_ticks,
                                                max_down_ticks=10, min_start=min_start)
                why = f"spot up {up_ticks} ticks then reclaimed (first after tick {min_start})"
            except ValueError:
                start, why = min_start, "no drop window: steady market from tick " f"{min_start}"
            windows.append(Window(folder, zone_file, start, SINGLE_ZONE, why))
    return windows


def pick_multi_zone_windows(count: int) -> list[Window]:
    """`count` windows over every zone of MULTI_ZONE_FOLDER at once: the home zone's first window
    after its `min_start` where spot is up 4 ticks then reclaimed (other zones may still have
    spot, so a policy can move)."""
    folder = spot_dir() / MULTI_ZONE_FOLDER
    if not folder.is_dir():
        return []
    files = sorted(p.name for p in folder.glob("*.json"))
    windows = []
    for home, min_start in MULTI_ZONE_HOMES[:count]:
        trace = load_trace(folder / home, FOLDER_MEANING[MULTI_ZONE_FOLDER])
        start = replay.find_drop_window(trace.available, up_ticks=4, max_down_ticks=10,
                                        min_start=min_start)
        windows.append(Window(MULTI_ZONE_FOLDER, home, start, MULTI_ZONE,
                              f"home zone's spot up 4 ticks then reclaimed (first after tick "
                              f"{min_start}); all {len(files)} zones replayed",
                              tuple(f for f in files if f != home)))
    return windows


def gang_drop_start(available: np.ndarray, nodes: int, min_start: int) -> int:
    """First tick s >= `min_start` where all `nodes` were up for 4 ticks from s (fewer at s - 1)
    and then exactly one node went: a one-node reclaim of a full gang."""
    values = np.asarray(available)
    for s in range(max(1, min_start), values.shape[0] - 5):
        if values[s - 1] < nodes and values[s: s + 4].min() >= nodes and values[s + 4] == nodes - 1:
            return s
    raise ValueError(f"no one-node drop of a full {nodes}-node gang after tick {min_start}")


def pick_gang_windows(count: int) -> list[Window]:
    """`count` 4-node gang windows on GANG_FOLDER: all 4 nodes up 4 ticks, then one reclaimed."""
    windows = []
    for zone_file, min_start in GANG_FILES[:count]:
        path = spot_dir() / GANG_FOLDER / zone_file
        if not path.is_file():
            continue
        trace = load_trace(path, FOLDER_MEANING[GANG_FOLDER])
        start = gang_drop_start(trace.available, GANG_NODES, min_start)
        windows.append(Window(GANG_FOLDER, zone_file, start, f"gang-{GANG_NODES}",
                              f"all {GANG_NODES} nodes up 4 ticks, then one reclaimed (first "
                              f"after tick {min_start})", (), GANG_NODES))
    return windows
