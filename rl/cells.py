"""Cells (one job on one market window, a cost-suite `Scenario`) and the out-of-sample split.

The split never lets evaluation see what training saw:
- training: the `TRAIN_FOLDER` collection, windows that END before `split_frac` of its trace;
- held out: the same collection's windows that START after that point (later time), and every
  other single-node collection (collections and zones never used in training).
`region` restricts both sides to home zones of one region (the Dagster partition key).
This fixed split is the benchmark's (`benchmarks/rl`: comparable between versions); scheduled
retraining trains on the region's newest data instead (`rl.training_data.rolling_split`).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

from cloud.collections import region_of_zone
from cloud.scenarios import (
    SINGLE_NODE,
    SINGLE_NODE_FOLDERS,
    Scenario,
    build_scenarios,
    policy_for,
    rules_for,
)
from controllers.allocation_types import AllocationPolicy

TRAIN_FOLDER = "availability-1node-aws-2023-02"
HELD_OUT_FOLDERS = tuple(f for f in SINGLE_NODE_FOLDERS if f != TRAIN_FOLDER)
HEURISTIC = "trainwise_heuristic"


@dataclass(frozen=True)
class Split:
    train: tuple[Scenario, ...]
    held_out: tuple[Scenario, ...]
    region: str | None
    split_tick: int
    # What a policy file records as its training window.
    train_window: str


def cell_region(cell: Scenario) -> str:
    return region_of_zone(cell.home_zone)


def cell_label(cell: Scenario) -> str:
    return f"{cell.kind}/{cell.folder}/{cell.instance_type}/{cell.home_zone}@{cell.start_tick}"


@functools.cache
def _scenarios(folder: str, windows_per_zone: int) -> tuple[Scenario, ...]:
    return tuple(
        build_scenarios(SINGLE_NODE, rules_for(SINGLE_NODE), windows_per_zone, folders=(folder,))
    )


# The Dagster partition keys: the regions of the training collection's zones, fixed here so the
# code location loads (and `make demo` runs) on a clone without ../shared/data; a test checks it
# against the collection itself.
PARTITION_REGIONS = ("us-east-1", "us-east-2", "us-west-2")


def regions() -> tuple[str, ...]:
    """Regions of the home zones in the training collection (the partition keys)."""
    return tuple(sorted({cell_region(c) for c in _scenarios(TRAIN_FOLDER, 1)}))


def make_split(
    region: str | None = None,
    windows_per_zone: int = 12,
    split_frac: float = 0.5,
    kinds: tuple[str, ...] = ("single_zone", "multi_zone"),
    held_out_windows_per_zone: int = 4,
) -> Split:
    """The out-of-sample split (see the module doc); errors name the valid regions."""
    if region is not None and region not in regions():
        raise ValueError(f"region {region!r} has no zones in {TRAIN_FOLDER}; valid: {regions()}")
    if not 0 < split_frac < 1:
        raise ValueError(f"split_frac={split_frac} must be between 0 and 1")
    cells = [c for c in _scenarios(TRAIN_FOLDER, windows_per_zone) if c.kind in kinds]
    n_ticks = cells[0].trace_market.n_ticks
    split_tick = int(n_ticks * split_frac)

    def keep(c: Scenario) -> bool:
        return region is None or cell_region(c) == region

    train = [c for c in cells if keep(c) and c.start_tick + c.market.n_ticks <= split_tick]
    held = [c for c in cells if keep(c) and c.start_tick >= split_tick]
    for folder in HELD_OUT_FOLDERS:
        held += [c for c in _scenarios(folder, held_out_windows_per_zone)
                 if c.kind in kinds and keep(c)]
    if not train:
        raise ValueError(
            f"no training cells for region {region!r} with split_frac={split_frac}; raise "
            "split_frac or windows_per_zone"
        )
    start_s = cells[0].trace_market.trace_start_s
    tick_s = cells[0].trace_market.tick_s
    window = (f"{TRAIN_FOLDER} ticks [0, {split_tick}) = first "
              f"{(split_tick * tick_s - start_s) / 86400:.1f} days")
    return Split(tuple(train), tuple(held), region, split_tick, window)


def heuristic_for(cell: Scenario, name: str = HEURISTIC) -> AllocationPolicy:
    """A fresh incumbent heuristic for a cell (the cost suite's per-scenario arguments)."""
    return policy_for(name, cell)
