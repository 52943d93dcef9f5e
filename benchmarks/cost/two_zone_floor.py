"""How close to the multi-zone hindsight optimum can an online policy get on a two-zone market?
`python -m benchmarks.cost.two_zone_floor [--windows N] [--seeds S] [--out DIR] [--quick]`.

Issue 9 asks for <= 1.02x the multi-zone optimum. `cost_bound.md` runs trainwise_heuristic in a
world where its risk model is true, but its multi-zone rule is a heuristic (a score and a pooled
plan), so its model-world cost says how far THAT rule gets, not how far any online policy could.
For a single node on two zones the exact plan is solvable (`two_zone_plan.py`): backward
induction over both zones' states and run ages, holdings, slack and time, on the true model.
Its cost in the model world is what a policy that knows the model exactly and plans optimally
on it pays, up to the plan's approximations (the slack grid, phase-type aging, and either the
day averaged out or the hour-of-day factors applied step by step). Where that is far above 1.02x
the optimum, the goal asks for foresight, not for a better rule or model.

Cells: every single-node multi-zone cell of the cost suite whose collection has exactly two zones
of one instance type, both protocols; markets sampled by `bound.model_world_scenarios`, with more
windows than `cost_bound.md` by default (the exact plan's figure is the point here).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks.cost.bound import (
    BURN_IN_S,
    DEFAULT_OUT,
    MULTI,
    QUICK_BURN_IN_S,
    Cell,
    market_seed_of,
    model_world_scenarios,
    ratio_with_interval,
    real_figures,
    suite_cells,
    write_with_footer,
)
from benchmarks.cost.stats import BOOTSTRAP_DRAWS, BOOTSTRAP_SEED, block_bootstrap
from benchmarks.cost.suite import ScenarioOutcome, oracle_violations, progress_bar, run_scenarios
from benchmarks.cost.two_zone_plan import TwoZonePlanPolicy
from cloud.policy_registry import make_policy
from cloud.scenario_protocol import LOCO, LTO, at_window_start
from cloud.scenarios import SINGLE_NODE

ON_DEMAND, BASELINE, HEURISTIC = "on_demand", "uniform_progress", "trainwise_heuristic"
PLAN_DAY, PLAN_HOUR = "two_zone_plan_day_averaged", "two_zone_plan_hour_of_day"
POLICIES = (ON_DEMAND, BASELINE, HEURISTIC, PLAN_DAY, PLAN_HOUR)
GOAL_VS_ORACLE = 1.02
# Market windows and synthetic markets per cell (cost_bound: 16 and 4).
DEFAULT_WINDOWS_PER_CELL, DEFAULT_SEEDS_PER_CELL = 48, 8


def two_zone_cells(protocols: tuple[str, ...]) -> list[Cell]:
    return [c for c in suite_cells(protocols, (SINGLE_NODE.name,), (MULTI,))
            if len(c.template.trace_market.zones) == 2]


def factories(cell: Cell) -> dict[str, Any]:
    """Every trainwise variant given the cell's true model and the run in progress at the
    window's start (as the suite and `cost_bound` give it)."""
    def model(scenario):
        return at_window_start(cell.model, scenario.trace_market, scenario.start_tick)
    return {
        HEURISTIC: lambda s: make_policy(HEURISTIC, risk_model=model(s)),
        PLAN_DAY: lambda s: TwoZonePlanPolicy(model(s), time_of_day=False),
        PLAN_HOUR: lambda s: TwoZonePlanPolicy(model(s), time_of_day=True),
    }


def cell_row(cell: Cell, outcomes: list[ScenarioOutcome], real: dict[str, Any] | None
             ) -> dict[str, Any]:
    costs = {n: np.array([o.results[n]["cost_usd"] for o in outcomes]) for n in POLICIES}
    oracle = np.array([o.oracle_met_usd for o in outcomes])
    # One bootstrap unit per market window: its home zones share the market.
    units = [(market_seed_of(o.scenario), o.scenario.start_tick) for o in outcomes]
    index: dict[tuple, int] = {}
    blocks = np.array([index.setdefault(u, len(index)) for u in units])
    trainwise = (HEURISTIC, PLAN_DAY, PLAN_HOUR)
    return {
        "protocol": cell.protocol, "collection": cell.folder,
        "instance_type": cell.instance_type,
        "zones": list(cell.template.trace_market.zones), "windows": len(outcomes),
        "independent_windows": len(index),
        "mean_usd": {n: float(c.mean()) for n, c in costs.items()} | {
            "oracle": float(oracle.mean())},
        "vs_oracle": {n: block_bootstrap(costs[n], oracle, blocks).as_dict() for n in trainwise},
        "plan_hour_vs_heuristic": block_bootstrap(costs[PLAN_HOUR], costs[HEURISTIC],
                                                  blocks).as_dict(),
        "oracle_vs_uniform_progress": float(oracle.mean() / costs[BASELINE].mean()),
        "deadline_misses": {n: int(sum(not o.results[n]["deadline_met"] for o in outcomes))
                            for n in POLICIES},
        "real_heuristic_vs_oracle": None if real is None else real["vs_oracle"],
    }


def _ci(cell: dict[str, Any] | None) -> str:
    return "-" if cell is None else ratio_with_interval(cell)


NOTES = """What this is: for every single-node, two-zone cell of the cost suite (both protocols),
the cell's fitted risk model is taken as the truth and markets are sampled from it as in
`cost_bound.md` (the same sampler, cells and burn-in of {burn_in_d:g} days; {windows} market
windows per cell over {seeds} synthetic markets, each window scored once per home zone). On each window,
with that true model: trainwise_heuristic (its multi-zone score and pooled plan), and the exact
two-zone plan (`benchmarks/cost/two_zone_plan.py`; backward induction over both zones' up/down
states and run ages, the holding, slack and time) with the day's hazard factors averaged out
(as the product's single-zone plan does) and applied hour by hour. Each is trainwise's safety
net and checkpoint rules around that decision. Ratios: mean cost over mean multi-zone hindsight
optimum of the same windows, 95% percentile bootstrap over market windows ({draws} draws, seed
{seed}). REAL: trainwise_heuristic on the real windows of the cell (`cost.json`), for scale.

How to read it: the exact plan on the true model is what planning can do when the model is
right; what is left to the oracle is the price of not knowing the future in that world. The
plan's own approximations (a 120 s slack grid, phase-type aging inside wide age bins, hour-of-
day factors per step) are measured by refining them: averaged day vs hour by hour is the column
pair below; on the same windows (scratch at 384afd1, not a results file, day averaged), age
bins of one 600 s step up to 4 h moved the plan's cost / oracle by -0.6% to +0.4% across the
eight cells, and a 60 s slack grid (120 s here) by -0.1% to +2.4% (a finer grid is not always
cheaper on 48 windows: decisions near a tie flip and the windows' paths with them). Where the
refinements move the figure by well under the distance to {goal:.2f}x, planning on this model,
however fine, does not meet issue 9's multi-zone goal on that cell; that is a measurement, not
a proof that no online policy could. The model world has no cross-zone
correlation and no regime shifts (see `cost_bound.md`): a real market may be easier or harder."""


def render_markdown(rows: list[dict[str, Any]], settings: dict[str, Any]) -> str:
    lines = ["# Two-zone floor: the exact plan on the true model vs the multi-zone optimum", "",
             NOTES.format(**settings), "",
             "| protocol | collection | type | windows (independent) | heuristic / oracle [95%] "
             "| exact plan, day averaged / oracle [95%] | exact plan, hour of day / oracle [95%] "
             "| exact plan (hour) / heuristic [95%] | oracle / uniform_progress | misses "
             "heuristic / plan day / plan hour | REAL heuristic / oracle [95%] | goal "
             f"<= {GOAL_VS_ORACLE:.2f}x reachable by the exact plan |",
             "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
    for r in rows:
        best = min(r["vs_oracle"][PLAN_DAY]["value"], r["vs_oracle"][PLAN_HOUR]["value"])
        misses = r["deadline_misses"]
        lines.append(
            f"| {r['protocol']} | {r['collection']} | {r['instance_type']} | {r['windows']} "
            f"({r['independent_windows']}) | {_ci(r['vs_oracle'][HEURISTIC])} | "
            f"{_ci(r['vs_oracle'][PLAN_DAY])} | {_ci(r['vs_oracle'][PLAN_HOUR])} | "
            f"{_ci(r['plan_hour_vs_heuristic'])} | {r['oracle_vs_uniform_progress']:.3f} | "
            f"{misses[HEURISTIC]} / {misses[PLAN_DAY]} / {misses[PLAN_HOUR]} | "
            f"{_ci(r['real_heuristic_vs_oracle'])} | "
            f"{'yes' if best <= GOAL_VS_ORACLE else 'no'} ({best:.3f}x) |")
    return "\n".join(lines)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.cost.two_zone_floor",
                                     description=__doc__)
    parser.add_argument("--windows", type=int, default=None,
                        help=f"market windows per cell (default {DEFAULT_WINDOWS_PER_CELL})")
    parser.add_argument("--seeds", type=int, default=None,
                        help=f"synthetic markets per cell (default {DEFAULT_SEEDS_PER_CELL})")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="output folder")
    parser.add_argument("--real", type=Path, default=DEFAULT_OUT / "cost.json",
                        help="the cost suite's results, for the REAL column")
    parser.add_argument("--quick", action="store_true",
                        help="one cell (leave-time-out, first two-zone cell), 2 windows, for tests")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    started = time.perf_counter()
    cells = two_zone_cells((LTO,) if args.quick else (LTO, LOCO))
    if args.quick:
        cells = cells[:1]
    if not cells:
        raise SystemExit("no single-node cell of the cost suite has a two-zone collection; "
                         "add one to the spot data folder (TRAINWISE_DATA_DIR)")
    windows, seeds = DEFAULT_WINDOWS_PER_CELL, DEFAULT_SEEDS_PER_CELL
    if args.quick:
        windows, seeds = 2, 1
    windows, seeds = args.windows or windows, args.seeds or seeds
    burn_in_s = QUICK_BURN_IN_S if args.quick else BURN_IN_S
    real = real_figures(args.real)
    rows, outcomes_all = [], []
    for cell in cells:
        scenarios = model_world_scenarios(cell, windows, min(seeds, windows), burn_in_s)
        outcomes = run_scenarios(
            scenarios, POLICIES,
            progress_bar(not args.no_progress, f"{cell.protocol} {cell.instance_type}"),
            factories(cell))
        outcomes_all += outcomes
        rows.append(cell_row(cell, outcomes, real.get(cell.key)))
    settings = {"burn_in_d": burn_in_s / 86400.0, "draws": BOOTSTRAP_DRAWS,
                "seed": BOOTSTRAP_SEED, "goal": GOAL_VS_ORACLE, "windows": windows,
                "seeds": min(seeds, windows)}
    violations = oracle_violations(outcomes_all)
    payload = {
        "notes": NOTES.format(**settings), "policies": list(POLICIES),
        "windows_per_cell": windows, "seeds_per_cell": seeds, "burn_in_s": burn_in_s,
        "quick": args.quick, "goal_vs_oracle": GOAL_VS_ORACLE, "rows": rows,
        "oracle_violations": violations,
        "timing": {"wall_s": time.perf_counter() - started},
    }
    return write_with_footer(args.out, "cost_two_zone_floor", "benchmarks.cost.two_zone_floor",
                             argv, payload, render_markdown(rows, settings), len(outcomes_all))


if __name__ == "__main__":
    sys.exit(main())
