"""Price of a wrong model: what trainwise_heuristic pays when the market is NOT its risk model.
`python -m benchmarks.cost.mismatch [--windows N] [--seeds S] [--quick] [--out DIR]`.

Issue 9 asks for a policy that holds on markets nobody here has seen. No held-out market can be
brought in, so this measures the same thing in the model world (`bound.py`): for every
single-node single-zone cell of the cost suite (leave-one-collection-out), the cell's fitted
model is distorted (every up-run hazard times `up`, every down-spell hazard times `down`:
runs 4x shorter, outages 4x longer, both faster, both slower), synthetic markets are sampled
from the DISTORTED model, and on the same windows run:

- `trainwise_fitted`: trainwise with the cell's fitted model, which is now wrong by that much;
- `trainwise_online`: the same, with the online hazard update on (`online_prior_events`=4,
  `controllers/online_risk.py`), which learns the market's level from the runs it sees;
- `trainwise_true`: trainwise given the distorted model the market was drawn from;
- `uniform_progress` and `on_demand` (no model), and the hindsight oracle.

`trainwise_fitted / trainwise_true` is the price of the wrong model; `/ oracle` and
`/ uniform_progress` say whether the advantage holds. Distortion (1, 1) is the model world of
`cost_bound.md` itself (fitted = true). Every window is an independent draw (bootstrap unit).
"""

from __future__ import annotations

import argparse
import dataclasses
import time
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks.cost import bound as B
from benchmarks.cost.stats import block_bootstrap, robustness
from benchmarks.cost.suite import progress_bar, run_scenarios
from benchmarks.results_io import write_suite_results
from cloud.scenario_protocol import LOCO, at_window_start
from cloud.scenarios import SINGLE_NODE, Scenario
from controllers.allocation_heuristic import TrainwiseAllocationConfig, TrainwiseAllocationPolicy
from controllers.preemption_risk import UP, PreemptionRiskModel, scaled_curve

DEFAULT_OUT = Path(__file__).resolve().parent.parent / "results"
RESULTS_STEM = "cost_mismatch"
# (up-run hazard factor, down-spell hazard factor) of the market against the fitted model.
DISTORTIONS = ((1.0, 1.0), (2.0, 0.5), (0.5, 2.0), (4.0, 0.25), (0.25, 4.0), (4.0, 4.0),
               (0.25, 0.25))
QUICK_DISTORTIONS = ((1.0, 1.0), (4.0, 4.0))
FITTED, ONLINE, TRUE = "trainwise_fitted", "trainwise_online", "trainwise_true"
BASELINE, ON_DEMAND = "uniform_progress", "on_demand"
POLICIES = (ON_DEMAND, BASELINE, FITTED, ONLINE, TRUE)
ONLINE_PRIOR_EVENTS = 4.0
DEFAULT_WINDOWS, DEFAULT_SEEDS = 8, 2
QUICK_WINDOWS, QUICK_CELLS = 2, 1


def distorted(model: PreemptionRiskModel, up: float, down: float) -> PreemptionRiskModel:
    """`model` with every up-run hazard times `up` and every down-spell hazard times `down`."""
    if not (up > 0 and down > 0):
        raise ValueError(f"distortion factors must be > 0, got up={up}, down={down}")
    curves = {key: scaled_curve(curve, up if key[0] == UP else down)
              for key, curve in model.curves.items()}
    return PreemptionRiskModel(curves, model.utc_offset_s,
                               f"{model.fitted_on}; up hazards x{up:g}, down hazards x{down:g}",
                               dict(model.run_at_cutoff))


def _trainwise(models: dict[tuple, PreemptionRiskModel], online: bool = False):
    """trainwise with the model of the scenario's cell (fitted or true), run in progress at the
    window's start as the suite gives it."""
    config = TrainwiseAllocationConfig(online_prior_events=ONLINE_PRIOR_EVENTS if online
                                       else None)

    def build(scenario: Scenario) -> Any:
        model = models[scenario.oracle_key[1:6]]
        return TrainwiseAllocationPolicy(
            at_window_start(model, scenario.trace_market, scenario.start_tick), config)
    return build


def run(cells: list[B.Cell], distortions, windows: int, seeds: int, burn_in_s: float,
        max_zones: int | None, progress: bool) -> list[dict]:
    """One record per (distortion, window): every policy's cost and the oracle's."""
    records = []
    for up, down in distortions:
        truth = {cell.key: distorted(cell.model, up, down) for cell in cells}
        scenarios = [s for cell in cells for s in B.model_world_scenarios(
            dataclasses.replace(cell, model=truth[cell.key]), windows, seeds, burn_in_s,
            max_zones)]
        fitted = {cell.key: cell.model for cell in cells}
        outcomes = run_scenarios(
            scenarios, POLICIES, progress_bar(progress, f"up x{up:g} down x{down:g}"),
            {FITTED: _trainwise(fitted), ONLINE: _trainwise(fitted, online=True),
             TRUE: _trainwise(truth)})
        for o in outcomes:
            s = o.scenario
            records.append({
                "up": up, "down": down, "collection": s.source_folder,
                "instance_type": s.instance_type, "zone": s.home_zone,
                "market_seed": B.market_seed_of(s), "start_tick": s.start_tick,
                "oracle_usd": o.oracle_met_usd,
                **{f"{n}_usd": o.results[n]["cost_usd"] for n in POLICIES},
                **{f"{n}_met": o.results[n]["deadline_met"] for n in POLICIES}})
    return records


def summarize(records: list[dict]) -> list[dict]:
    rows = []
    for up, down in dict.fromkeys((r["up"], r["down"]) for r in records):
        part = [r for r in records if (r["up"], r["down"]) == (up, down)]
        units = np.arange(len(part))  # every window an independent draw
        cost = {n: np.array([r[f"{n}_usd"] for r in part]) for n in POLICIES}
        oracle = np.array([r["oracle_usd"] for r in part])
        rows.append({
            "up": up, "down": down, "windows": len(part),
            "cells": len({(r["collection"], r["instance_type"]) for r in part}),
            "vs_oracle": {n: block_bootstrap(cost[n], oracle, units).as_dict()
                          for n in (BASELINE, FITTED, ONLINE, TRUE)},
            "fitted_vs_true": block_bootstrap(cost[FITTED], cost[TRUE], units).as_dict(),
            "online_vs_fitted": block_bootstrap(cost[ONLINE], cost[FITTED], units).as_dict(),
            "fitted_vs_uniform_progress": block_bootstrap(cost[FITTED], cost[BASELINE],
                                                          units).as_dict(),
            "robustness": {n: robustness(cost[n], cost[ON_DEMAND],
                                         [r[f"{n}_met"] for r in part])
                           for n in (BASELINE, FITTED, ONLINE, TRUE)},
        })
    return rows


def _ci(stat: dict) -> str:
    if stat["low"] is None:
        return f"{stat['value']:.3f} [n/a]"
    return f"{stat['value']:.3f} [{stat['low']:.3f}, {stat['high']:.3f}]"


def markdown(rows: list[dict], windows: int, seeds: int, quick: bool, elapsed_s: float) -> str:
    lines = [
        "# Price of a wrong model: trainwise on markets that are not its risk model", "",
        __doc__.split("\n\n", 1)[1].strip(), "",
        f"Windows: {windows} market windows per cell and zone over {seeds} synthetic markets per "
        "cell" + (" (--quick: one cell, one zone)" if quick else "") + ". Ratios are of mean "
        "costs over the same windows; 95% bootstrap intervals over windows.", "",
        "| up x | down x | windows | fitted / true [95%] | online / fitted [95%] | fitted / "
        "uniform_progress [95%] | uniform_progress / oracle | fitted / oracle | online / "
        "oracle | true / oracle | misses (fitted, online, true) | costlier than on-demand "
        "(fitted) |",
        "|---:|---:|---:|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        vo, rob = r["vs_oracle"], r["robustness"]
        misses = ", ".join(str(rob[n]["deadline_misses"]) for n in (FITTED, ONLINE, TRUE))
        lines.append(
            f"| {r['up']:g} | {r['down']:g} | {r['windows']} | {_ci(r['fitted_vs_true'])} | "
            f"{_ci(r['online_vs_fitted'])} | {_ci(r['fitted_vs_uniform_progress'])} | "
            f"{vo[BASELINE]['value']:.3f} | {vo[FITTED]['value']:.3f} | "
            f"{vo[ONLINE]['value']:.3f} | {vo[TRUE]['value']:.3f} | {misses} | "
            f"{rob[FITTED]['costlier_than_on_demand_share']:.1%} |")
    lines += ["", f"Run time: {elapsed_s:.0f} s.", ""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.cost.mismatch",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--windows", type=int, default=None,
                        help=f"market windows per cell (default {DEFAULT_WINDOWS}; quick "
                        f"{QUICK_WINDOWS})")
    parser.add_argument("--seeds", type=int, default=None,
                        help=f"synthetic markets per cell (default {DEFAULT_SEEDS}; quick 1)")
    parser.add_argument("--quick", action="store_true",
                        help=f"seconds, for tests: {QUICK_CELLS} cell, 1 zone, {QUICK_WINDOWS} "
                        f"windows, distortions {QUICK_DISTORTIONS}")
    parser.add_argument("--out", type=Path, default=None,
                        help=f"results folder (default {DEFAULT_OUT}; --quick writes nothing "
                        "unless --out is given)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    args = parser.parse_args(argv)
    windows = args.windows or (QUICK_WINDOWS if args.quick else DEFAULT_WINDOWS)
    seeds = min(args.seeds or (1 if args.quick else DEFAULT_SEEDS), windows)
    if windows < 1 or seeds < 1:
        parser.error("--windows and --seeds must be 1 or more")
    started = time.perf_counter()
    cells = B.suite_cells([LOCO], [SINGLE_NODE.name], [B.SINGLE])
    cells = cells[-QUICK_CELLS:] if args.quick else cells
    distortions = QUICK_DISTORTIONS if args.quick else DISTORTIONS
    records = run(cells, distortions, windows, seeds,
                  B.QUICK_BURN_IN_S if args.quick else B.BURN_IN_S, 1 if args.quick else None,
                  not args.no_progress)
    rows = summarize(records)
    elapsed = time.perf_counter() - started
    text = markdown(rows, windows, seeds, args.quick, elapsed)
    payload = {"policies": list(POLICIES), "distortions": [list(d) for d in distortions],
               "online_prior_events": ONLINE_PRIOR_EVENTS, "windows_per_cell": windows,
               "seeds_per_cell": seeds, "quick": args.quick,
               "cells": [list(c.key) for c in cells], "rows": rows, "windows": records,
               "elapsed_s": elapsed}
    write_suite_results(args.out, args.quick, DEFAULT_OUT, RESULTS_STEM,
                        "benchmarks.cost.mismatch", argv, payload, text)
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
