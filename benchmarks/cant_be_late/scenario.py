"""The Can't Be Late setting (Wu et al., "Can't Be Late", NSDI'24), as a named scenario.

Setting: 1 node (p3.2xlarge, 1 GPU), 48 h of work, 52 h deadline, 0.1 h (360 s) changeover,
on-demand 3.06 and spot 0.9731 USD/h flat in every zone, no checkpoint saves, the collections
availability-2023-02 (9 zones, 195 s ticks) and preemption-2023-04 (4 zones, 32 s ticks), every
zone, and the start windows of the published reference (`../shared/data/peers/cant-be-late/`,
1,000 start offsets per collection, the same for every zone).

Accounting conventions (the published simulator's, reproduced by `cloud/simulator.py` with the
rules below):
- a tick is billed whole for whatever the node was during it (spot or on-demand price x tick);
  idle ticks cost nothing;
- the changeover (360 s) is paid at every launch: the first one, every spot <-> on-demand
  switch, every restart after a preemption; it is billed and trains nothing, and it spills over
  into the next tick when longer than a tick (195 s, 32 s here);
- a preemption is seen at a tick boundary; the tick before it counts in full, as work and as
  bill (no notice save: saves cost 0 s, and nothing is lost);
- the tick in which the work finishes is billed whole (`bill_finishing_tick_whole`; the
  project's default bills it up to the finish second, which is what the suite uses);
- the job must finish at a tick k with k x tick <= deadline (52 h is a whole number of ticks
  for both collections); all reference windows meet it, so no completion charge arises.
"""

from __future__ import annotations

import csv
import gzip
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

from cloud.simulator import ClusterRules, JobSpec, Market, market_from_traces
from cloud.traces import default_spot_dir, load_collection

WORK_GPU_H = 48.0
DEADLINE_H = 52.0
CHANGEOVER_S = 360.0
ON_DEMAND_USD_PER_HOUR = 3.06
SPOT_USD_PER_HOUR = 0.9731

JOB = JobSpec(work_gpu_h=WORK_GPU_H, deadline_s=DEADLINE_H * 3600.0, node_count=1)


def rules(bill_finishing_tick_whole: bool = True) -> ClusterRules:
    """The setting's rules; `bill_finishing_tick_whole=False` gives per-second billing of the
    last tick (the project's convention) for comparison."""
    return ClusterRules(
        changeover_s=CHANGEOVER_S,
        checkpoint_save_s=0.0,
        checkpoint_interval_s=float("inf"),
        notice_s=120.0,
        checkpoint_on_notice=True,
        bill_finishing_tick_whole=bill_finishing_tick_whole,
    )


# The reference's trace names -> the project's collection folders.
COLLECTIONS = {
    "availability/1-node/aws-02-15-2023": "availability-1node-aws-2023-02",
    "preemption/1-node/aws-04-22-2023": "preemption-1node-aws-2023-04",
}
# The reference's strategy names -> the project's policies.
STRATEGIES = {
    "on_demand": "on_demand",
    "greedy(strawman)": "greedy_spot",
    "uniform_progress(rc_cr_threshold)": "uniform_progress",
}


def peers_dir(spot_dir: Path | None = None) -> Path:
    base = Path(spot_dir) if spot_dir is not None else default_spot_dir()
    return base.parent / "peers" / "cant-be-late"


@dataclass(frozen=True)
class Reference:
    """The published costs: policy[(folder, file stem, offset, policy)] and the exact optima
    single[(folder, file stem, offset)], multi[(folder, offset)]."""

    policy: dict[tuple[str, str, int, str], float]
    single: dict[tuple[str, str, int], float]
    multi: dict[tuple[str, int], float]

    def offsets(self, folder: str) -> list[int]:
        return sorted({k[2] for k in self.single if k[0] == folder})


def _rows(path: Path) -> list[dict[str, str]]:
    if not path.exists():
        raise FileNotFoundError(
            f"{path} is missing: the Can't Be Late reference lives in "
            "../shared/data/peers/cant-be-late/ (see its README)"
        )
    with gzip.open(path, "rt", newline="") as f:
        return list(csv.DictReader(f))


def load_reference(spot_dir: Path | None = None) -> Reference:
    base = peers_dir(spot_dir)
    policy: dict[tuple[str, str, int, str], float] = {}
    for r in _rows(base / "policies-per-window.csv.gz"):
        key = (COLLECTIONS[r["trace"]], r["zone"], int(r["start_offset"]), STRATEGIES[r["strategy"]])
        policy[key] = float(r["cost"])
    single = {
        (COLLECTIONS[r["trace"]], r["zone"], int(r["start_offset"])): float(r["oracle_cost"])
        for r in _rows(base / "optimum-single-zone.csv.gz")
    }
    multi = {
        (COLLECTIONS[r["trace"]], int(r["start_offset"])): float(r["oracle_cost"])
        for r in _rows(base / "optimum-multi-zone.csv.gz")
    }
    return Reference(policy, single, multi)


def markets(folder: str, spot_dir: Path | None = None) -> dict[str, Market]:
    """Single-zone markets by file stem (the reference's zone names) plus "*" for all zones,
    paired tick by tick from each file's first tick, as the reference was run."""
    traces = list(load_collection(folder, spot_dir).traces)
    flat = len(traces)
    allzones = market_from_traces(
        traces, (SPOT_USD_PER_HOUR,) * flat, (ON_DEMAND_USD_PER_HOUR,) * flat
    )
    out = {Path(t.source_path).stem: allzones.zone_market(t.zone) for t in traces}
    out["*"] = allzones
    return out


def deadline_ticks(market: Market) -> int:
    return int(DEADLINE_H * 3600 // market.tick_s)


def group_keys(keys: list[tuple[str, str, int]]) -> dict[str, list[tuple[str, int]]]:
    by_folder: dict[str, list[tuple[str, int]]] = defaultdict(list)
    for folder, stem, offset in keys:
        by_folder[folder].append((stem, offset))
    return by_folder
