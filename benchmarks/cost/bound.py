"""Model-world bound: what trainwise_heuristic pays above the hindsight oracle when the market IS its
risk model. `python -m benchmarks.cost.bound [--windows N] [--seeds S] [--out DIR] [--quick]`.

For each single-node, single-zone cell of the cost suite (setting `single_node`; each protocol,
collection and instance type), take the risk model that cell's windows get
(`suite.risk_model_for`), sample synthetic markets from THAT model (`cloud/synthetic_market.py`: the
cell's zones, tick and prices, several seeds, a burn-in discarded), cut windows of the cell's length
back to back, and run the suite's own machinery (`suite.run_scenarios`) on the cell's job and rules:
trainwise_heuristic given the same true model (with the run in progress at each window's start, as
the suite gives it), uniform_progress, on_demand and the single-zone hindsight oracle.

trainwise_heuristic plans by backward induction on that model, so here it is close to the best an
online policy can do, and its cost / oracle is the price of not knowing the future in that world:
a floor for the real-trace figure only as far as the real market is like the model. The model
world has no correlation between zones or with anything the model leaves out; the real market
may be more predictable than the model (then the floor is not a floor) or less.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
import zlib
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks.cost.protocol import LOCO, LTO, at_window_start
from benchmarks.cost.stats import BOOTSTRAP_DRAWS, BOOTSTRAP_SEED, block_bootstrap
from benchmarks.cost.suite import (
    SINGLE_NODE,
    Scenario,
    ScenarioOutcome,
    build_scenarios,
    oracle_violations,
    risk_model_for,
    rules_for,
    run_scenarios,
)
from benchmarks.results_io import provenance, write_results
from cloud.policy_registry import make_policy
from cloud.synthetic_market import synthetic_market
from controllers.preemption_risk import PreemptionRiskModel

DEFAULT_OUT = Path(__file__).resolve().parent.parent / "results"
TRAINWISE, BASELINE, ON_DEMAND = "trainwise_heuristic", "uniform_progress", "on_demand"
POLICIES = (ON_DEMAND, BASELINE, TRAINWISE)
# Discarded before the first window: the sampler starts a fresh run at tick 0, the burn-in lets
# the state and run age at window starts settle toward the model's long-run mix.
BURN_IN_S = 3 * 86400.0
QUICK_BURN_IN_S = 86400.0
DEFAULT_WINDOWS, DEFAULT_SEEDS = 16, 4


@dataclass
class Cell:
    """One single-zone cell of the suite and the model its windows are scored with."""

    protocol: str
    folder: str
    instance_type: str
    template: Scenario  # a real window of the cell: job, rules, prices, zones, split
    model: PreemptionRiskModel

    @property
    def key(self) -> tuple[str, str, str]:
        return (self.protocol, self.folder, self.instance_type)


def suite_cells(protocols: Iterable[str]) -> list[Cell]:
    """The single-node single-zone cells, as `build_scenarios` makes them, with their risk model
    (curves fitted on what the cell's split allows; the real run at the cutoff is replaced per
    synthetic window)."""
    cells = []
    for protocol in protocols:
        scenarios = build_scenarios(SINGLE_NODE, rules_for(SINGLE_NODE), 1,
                                    kinds=("single_zone",), protocol=protocol)
        seen = set()
        for scenario in scenarios:
            key = (scenario.folder, scenario.instance_type)
            if key not in seen:
                seen.add(key)
                cells.append(Cell(protocol, *key, scenario, risk_model_for(scenario)))
    return cells


def model_world_scenarios(cell: Cell, windows_per_zone: int, seeds: int,
                          burn_in_s: float, max_zones: int | None = None) -> list[Scenario]:
    """`windows_per_zone` windows of the cell's length per zone, spread over `seeds` synthetic
    markets sampled from the cell's model, back to back after the burn-in (no two overlap; zones
    are sampled independently, so every window is an independent draw)."""
    if windows_per_zone < 1 or seeds < 1:
        raise ValueError(f"windows_per_zone={windows_per_zone} and seeds={seeds} must be >= 1")
    real, template = cell.template.trace_market, cell.template
    zones = real.zones[:max_zones] if max_zones else real.zones
    prices = {z: (real.spot_usd_per_hour[i], real.on_demand_usd_per_hour[i])
              for i, z in enumerate(real.zones)}
    window_ticks = template.window_ticks
    seeds = min(seeds, windows_per_zone)
    per_seed = math.ceil(windows_per_zone / seeds)
    burn_ticks = math.ceil(burn_in_s / real.tick_s)
    scenarios: list[Scenario] = []
    made = 0
    for s in range(seeds):
        seed = zlib.crc32("/".join(("bound", *cell.key, str(s))).encode())
        count = min(per_seed, windows_per_zone - made)
        market = synthetic_market(cell.model, zones, burn_ticks + count * window_ticks,
                                  real.tick_s, seed, [prices[z][0] for z in zones],
                                  [prices[z][1] for z in zones])
        for k in range(count):
            start = burn_ticks + k * window_ticks
            window = market.window(start, window_ticks)
            for zone in zones:
                scenarios.append(Scenario(
                    setting=SINGLE_NODE, kind="single_zone",
                    folder=f"model world: {cell.folder}", instance_type=cell.instance_type,
                    market=window.zone_market(zone), home_zone=zone, start_tick=start,
                    job=template.job, rules=template.rules,
                    oracle_key=("bound", *cell.key, s, zone, start), seed=seed,
                    deadline_h=template.deadline_h, source_folder=cell.folder,
                    trace_market=market, fit_split=template.fit_split,
                    window_ticks=window_ticks))
        made += count
    return scenarios


def trainwise_with_true_model(models: dict[tuple[str, str, str], PreemptionRiskModel]
                              ) -> Callable[[Scenario], Any]:
    """trainwise_heuristic given the model the market was sampled from, knowing the run in
    progress at the window's start (from the synthetic past, as the suite does from the trace)."""
    def build(scenario: Scenario) -> Any:
        model = models[(scenario.protocol, scenario.source_folder, scenario.instance_type)]
        window_model = at_window_start(model, scenario.trace_market, scenario.start_tick)
        return make_policy(TRAINWISE, risk_model=window_model)
    return build


def real_figures(path: Path) -> dict[tuple[str, str, str], dict[str, Any]]:
    """The suite's single-node single-zone headline rows (cost.json), by cell; {} if absent."""
    if not path.is_file():
        return {}
    rows = json.loads(path.read_text()).get("headline", [])
    return {(r["protocol"], r["collection"], r["instance_type"]): r for r in rows
            if r["setting"] == SINGLE_NODE.name and r["kind"] == "single_zone"}


def cell_row(cell: Cell, outcomes: list[ScenarioOutcome],
             real: dict[str, Any] | None) -> dict[str, Any]:
    costs = {n: np.array([o.results[n]["cost_usd"] for o in outcomes]) for n in POLICIES}
    oracle = np.array([o.oracle_met_usd for o in outcomes])
    blocks = np.arange(len(outcomes))  # iid windows: each its own bootstrap unit
    markets = {id(o.scenario.trace_market): o.scenario.trace_market for o in outcomes}
    zones = sorted({o.scenario.home_zone for o in outcomes})
    sampled_share = float(np.mean([(m.spot_available >= 1).mean() for m in markets.values()]))
    model_share = float(np.mean([cell.model.availability_share(z) for z in zones]))
    per_window = costs[TRAINWISE] / oracle
    row = {
        "protocol": cell.protocol, "collection": cell.folder,
        "instance_type": cell.instance_type, "zones": len(zones),
        "seeds": len(markets), "windows": len(outcomes), "independent_windows": len(outcomes),
        "tick_s": cell.template.market.tick_s, "window_ticks": cell.template.window_ticks,
        "mean_usd": {n: float(c.mean()) for n, c in costs.items()} | {
            "oracle": float(oracle.mean())},
        "trainwise_vs_oracle": block_bootstrap(costs[TRAINWISE], oracle, blocks).as_dict(),
        "trainwise_vs_uniform_progress": block_bootstrap(
            costs[TRAINWISE], costs[BASELINE], blocks).as_dict(),
        "oracle_vs_uniform_progress": block_bootstrap(oracle, costs[BASELINE], blocks).as_dict(),
        "trainwise_vs_oracle_worst_window": float(per_window.max()),
        "windows_within_3pct_of_oracle": float(np.mean(per_window <= 1.03)),
        "deadline_misses": {n: int(sum(not o.results[n]["deadline_met"] for o in outcomes))
                            for n in POLICIES},
        "spot_up_share_sampled": sampled_share, "spot_up_share_model": model_share,
        "model_fitted_on": cell.model.fitted_on,
        "real": None,
    }
    if real is not None:
        bound_gap = row["trainwise_vs_oracle"]["value"] - 1.0
        real_gap = real["vs_oracle"]["value"] - 1.0
        row["real"] = {
            "windows": real["windows"], "trainwise_vs_oracle": real["vs_oracle"],
            "trainwise_vs_uniform_progress": real["vs_uniform_progress"],
            "oracle_vs_uniform_progress": real["oracle_vs_uniform_progress"],
            # Share of the real gap to the oracle that the model world also shows.
            "bound_share_of_real_gap": bound_gap / real_gap if real_gap > 0 else None,
        }
    return row


def _ci(cell: dict[str, Any]) -> str:
    if cell["low"] is None:
        return f"{cell['value']:.3f} [n/a]"
    return f"{cell['value']:.3f} [{cell['low']:.3f}, {cell['high']:.3f}]"


def render_markdown(rows: list[dict[str, Any]], settings: dict[str, Any]) -> str:
    lines = ["# Model-world bound: trainwise_heuristic vs the hindsight oracle when the market is "
             "its own risk model", "", NOTES.format(**settings), ""]
    for protocol in (LTO, LOCO):
        mine = [r for r in rows if r["protocol"] == protocol]
        if not mine:
            continue
        lines += [f"## {protocol}", "",
                  "| collection | type | windows (zones x seeds) | trainwise / oracle [95%] | "
                  "trainwise / uniform_progress [95%] | oracle / uniform_progress [95%] | "
                  "within 3% of oracle | misses tw/up | spot up share sampled / model | "
                  "REAL trainwise / oracle [95%] | REAL trainwise / up | REAL oracle / up | "
                  "bound / real gap |",
                  "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
        for r in mine:
            real = r["real"]
            real_cells = ["-", "-", "-", "-"]
            if real is not None:
                share = real["bound_share_of_real_gap"]
                real_cells = [_ci(real["trainwise_vs_oracle"]),
                              f"{real['trainwise_vs_uniform_progress']['value']:.3f}",
                              f"{real['oracle_vs_uniform_progress']:.3f}",
                              "-" if share is None else f"{share:.0%}"]
            misses = r["deadline_misses"]
            lines.append(
                f"| {r['collection']} | {r['instance_type']} | {r['windows']} ({r['zones']} x "
                f"{r['seeds']}) | {_ci(r['trainwise_vs_oracle'])} | "
                f"{_ci(r['trainwise_vs_uniform_progress'])} | "
                f"{_ci(r['oracle_vs_uniform_progress'])} | "
                f"{r['windows_within_3pct_of_oracle']:.0%} | "
                f"{misses[TRAINWISE]}/{misses[BASELINE]} | {r['spot_up_share_sampled']:.2f} / "
                f"{r['spot_up_share_model']:.2f} | " + " | ".join(real_cells) + " |")
        lines.append("")
    return "\n".join(lines)


NOTES = """What this is. For each single-node single-zone cell of the cost suite (`benchmarks/cost`,
setting single_node: 1 node, 48 h of work, 52 h deadline, the suite's rules and prices), the risk
model that cell's windows are scored with (`suite.risk_model_for`: fitted only on what the cell's
protocol allows) is taken as the TRUTH: spot markets are sampled from it
(`cloud/synthetic_market.py`: alternating up/down runs, per-tick end probability 1 - S(age, tick)
with its age-dependent hazard and time-of-day factor; the cell's zones, each independent; the
cell's tick and prices; {seeds} seeds per cell; a {burn_in_d:g}-day burn-in discarded; windows
of the cell's length back to back, so none overlap). On every window: trainwise_heuristic GIVEN
THAT SAME MODEL (and the run in progress at the window start, as in the suite), uniform_progress,
on_demand and the single-zone hindsight oracle (deadline met), all through `suite.run_scenarios`.
Windows are independent draws, so the 95% intervals are a plain (one window per block)
percentile bootstrap of the ratio of mean costs, {draws} draws, seed {seed}.

What it means. trainwise plans by backward induction on that model, so in this world its cost /
oracle is what it pays for not knowing the future when its model is exactly right; were it
Bayes-optimal, that would be the floor for any online policy. Where the real-trace figure (REAL
columns, from `cost.json`, same cell, protocol and job) is near this one, the real gap is not
model error: closing it needs a better decision rule (which this model world can test without
touching held-out data) or a market more predictable than the model. "bound / real gap" is
(bound - 1) / (real - 1): the share of the real gap that the model world shows too (over 100%:
the real market was easier for trainwise than its own model world).

What it does not mean. It is a bound only for a world where the model is true:
zones independent, no regime shifts, no structure the model leaves out. The real market may be
more predictable than the model (longer, more regular runs, daily patterns at finer grain than 6
bins: then a better model could beat this "floor") or less (then the floor is optimistic). The
policy is not exactly Bayes-optimal either (its plan grid, margins and safety net), so the bound
is what THIS policy achieves under its own model, an upper estimate of the true model-world floor.
"spot up share sampled / model" checks the sampler against the model's long-run share (they
differ by time-of-day effects, the tick grid and sampling error)."""


def _progress(enabled: bool, label: str) -> Callable[[Iterable], Iterable] | None:
    if not enabled:
        return None
    try:
        from tqdm import tqdm
    except ImportError:
        return None
    return lambda items: tqdm(items, desc=label, file=sys.stderr, leave=False)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.cost.bound",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--windows", type=int, default=None,
                        help=f"windows per zone (default {DEFAULT_WINDOWS}; quick 2)")
    parser.add_argument("--seeds", type=int, default=None,
                        help=f"synthetic markets per cell (default {DEFAULT_SEEDS}; quick 1)")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="output folder")
    parser.add_argument("--real", type=Path, default=DEFAULT_OUT / "cost.json",
                        help="the suite's cost.json to set the real-trace figures beside")
    parser.add_argument("--quick", action="store_true",
                        help="seconds, for tests: leave-time-out only, 1 zone per cell, 2 windows")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    started = time.perf_counter()
    windows = args.windows or (2 if args.quick else DEFAULT_WINDOWS)
    seeds = args.seeds or (1 if args.quick else DEFAULT_SEEDS)
    burn_in_s = QUICK_BURN_IN_S if args.quick else BURN_IN_S
    protocols = (LTO,) if args.quick else (LTO, LOCO)
    max_zones = 1 if args.quick else None
    cells = suite_cells(protocols)
    models = {cell.key: cell.model for cell in cells}
    by_cell = {cell.key: model_world_scenarios(cell, windows, seeds, burn_in_s, max_zones)
               for cell in cells}
    scenarios = [s for cell in cells for s in by_cell[cell.key]]
    outcomes = run_scenarios(scenarios, POLICIES, _progress(not args.no_progress, "bound"),
                             {TRAINWISE: trainwise_with_true_model(models)})
    real = real_figures(args.real)
    rows, position = [], 0
    for cell in cells:
        mine = outcomes[position:position + len(by_cell[cell.key])]
        position += len(mine)
        rows.append(cell_row(cell, mine, real.get(cell.key)))
    settings = {"seeds": seeds, "burn_in_d": burn_in_s / 86400.0, "draws": BOOTSTRAP_DRAWS,
                "seed": BOOTSTRAP_SEED}
    violations = oracle_violations(outcomes)
    payload = {
        "notes": NOTES.format(**settings),
        "setting": SINGLE_NODE.name, "kind": "single_zone", "policies": list(POLICIES),
        "windows_per_zone": windows, "seeds_per_cell": seeds, "burn_in_s": burn_in_s,
        "quick": args.quick, "protocols": list(protocols),
        "real_source": str(args.real) if real else None,
        "rows": rows, "oracle_violations": violations,
        "windows": [{"protocol": o.scenario.protocol, "collection": o.scenario.source_folder,
                     "instance_type": o.scenario.instance_type, "zone": o.scenario.home_zone,
                     "seed": o.scenario.seed, "start_tick": o.scenario.start_tick,
                     "oracle_usd": o.oracle_met_usd,
                     **{f"{n}_usd": o.results[n]["cost_usd"] for n in POLICIES}}
                    for o in outcomes],
        "timing": {"wall_s": time.perf_counter() - started},
    }
    markdown = render_markdown(rows, settings)
    markdown += f"\n\nOracle violations: {len(violations)}. Wall time " \
                f"{payload['timing']['wall_s']:.0f} s for {len(outcomes)} windows."
    command = ["python", "-m", "benchmarks.cost.bound",
               *(argv if argv is not None else sys.argv[1:])]
    json_path, md_path = write_results(args.out, "cost_bound", payload, markdown,
                                       provenance(command))
    print(markdown)
    print(f"wrote {md_path} and {json_path}")
    return 1 if violations else 0


if __name__ == "__main__":
    sys.exit(main())
