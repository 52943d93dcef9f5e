"""The windows of `benchmarks/end_to_end.py` and what a trainer is told in each: the full mode's
windows by a rule fixed before any run (`windows_by_rule`, never by outcome), the quick mode's
first window of that rule (`default_window`), and the notice a trainer really gets in wall
seconds (`notice_wall_s`).
"""

from __future__ import annotations

from cloud import emulated as replay
from cloud.traces import FOLDER_MEANING, load_trace
from trainwise import settings

# The full mode's windows (see `benchmarks/end_to_end.py`'s docstring): zones, windows per
# zone, the search. The zones: the first two V100 1-node zone files (file order) of each of the
# two availability collections; the first two entries were the whole list until wave 6 (4
# windows gave intervals too wide to read), so the first 4 windows are the earlier runs' ones.
WINDOW_ZONES: tuple[tuple[str, str], ...] = (
    ("availability-1node-aws-2023-02", "us-east-1a_v100_1.json"),
    ("availability-1node-aws-2022-10", "us-west-2a_v100_1.json"),
    ("availability-1node-aws-2023-02", "us-east-1c_v100_1.json"),
    ("availability-1node-aws-2022-10", "us-west-2b_v100_1.json"),
)
WINDOWS_PER_ZONE = 2
WINDOW_GAP_TICKS = 200  # the next search starts this far after a window: no overlap at 120 steps
WINDOW_SEARCH = {"up_ticks": 4, "max_down_ticks": 10, "min_start": 200}  # default_window's
MIN_NOTICE_WALL_S = 10.0  # run_emulated's min_notice_wall_s default


def windows_by_rule(zones: tuple[tuple[str, str], ...] = WINDOW_ZONES,
                    per_zone: int = WINDOWS_PER_ZONE,
                    gap_ticks: int = WINDOW_GAP_TICKS) -> list[tuple[str, str, int]]:
    """(trace folder, zone file, start tick) of the full mode's windows: in each zone the first
    `per_zone` reclaim windows of the search, each search `gap_ticks` after the last window."""
    windows = []
    for folder, zone_file in zones:
        path = settings.data_dir() / "spot" / folder / zone_file
        if not path.exists():
            raise FileNotFoundError(f"spot trace {path} is missing: the full mode's windows are "
                                    "in the shared data (TRAINWISE_DATA_DIR); run --quick")
        available = load_trace(path, FOLDER_MEANING[folder]).available
        start = WINDOW_SEARCH["min_start"]
        for _ in range(per_zone):
            tick = replay.find_drop_window(available, WINDOW_SEARCH["up_ticks"],
                                           WINDOW_SEARCH["max_down_ticks"], start)
            windows.append((folder, zone_file, tick))
            start = tick + gap_ticks
    return windows


def default_window(folder: str, zone_file: str) -> int:
    """The first window of the rule (`benchmarks.emulated_run.default_window`'s search); 0 when
    the trace is missing (the synthetic fallback, named in trace_source)."""
    if not (settings.data_dir() / "spot" / folder / zone_file).exists():
        return 0
    return windows_by_rule(((folder, zone_file),), per_zone=1)[0][2]


def notice_wall_s(tick_s: float, seconds_per_tick: float) -> float:
    """The notice a trainer really gets, in wall seconds (`run_emulated`'s rule)."""
    return max(MIN_NOTICE_WALL_S, replay.default_rules().notice_s * seconds_per_tick / tick_s)
