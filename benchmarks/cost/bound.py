"""Model-world bound: what trainwise_heuristic pays above the hindsight oracle when the market IS its
risk model. `python -m benchmarks.cost.bound [--settings ...] [--kinds ...] [--windows N]
[--seeds S] [--out DIR] [--quick]`.

For each cell of the cost suite in settings `single_node` and `gang_4node` (the real 4-node gang),
kinds single-zone and multi-zone (each protocol, collection and instance type), take the risk
model that cell's windows get (`cloud.scenarios.risk_model_for`), sample synthetic markets from THAT model
(`cloud/synthetic_market.py`: the cell's zones, tick and prices, a gang's zones at the gang's
level, several seeds, a burn-in discarded), cut windows of the cell's length back to back, and
run the suite's own machinery (`suite.run_scenarios`) on the cell's job and rules:
trainwise_heuristic given the same true model (with the run in progress at each window's start,
as the suite gives it), uniform_progress, on_demand and the hindsight oracle of the kind
(single-zone, or multi-zone over all the cell's zones; single-zone peers stay in the home zone).

trainwise_heuristic plans by backward induction on that model, so here it is close to the best an
online policy can do, and its cost / oracle is the price of not knowing the future in that world:
a floor for the real-trace figure only as far as the real market is like the model (see NOTES).
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

from benchmarks.cost.stats import BOOTSTRAP_DRAWS, BOOTSTRAP_SEED, block_bootstrap, robustness
from benchmarks.cost.suite import ScenarioOutcome, oracle_violations, progress_bar, run_scenarios
from benchmarks.results_io import provenance, write_results
from cloud.policy_registry import make_policy
from cloud.scenario_protocol import LOCO, LTO, at_window_start
from cloud.scenarios import (
    GANG_4NODE,
    SINGLE_NODE,
    Scenario,
    Setting,
    build_scenarios,
    discovered_settings,
    risk_model_for,
    rules_for,
)
from cloud.synthetic_market import synthetic_market
from controllers.allocation_heuristic import TrainwiseAllocationConfig
from controllers.preemption_risk import PreemptionRiskModel

DEFAULT_OUT = Path(__file__).resolve().parent.parent / "results"
TRAINWISE, BASELINE, ON_DEMAND = "trainwise_heuristic", "uniform_progress", "on_demand"
POLICIES = (ON_DEMAND, BASELINE, TRAINWISE)
SETTINGS = {s.name: s for s in (SINGLE_NODE, GANG_4NODE)}
SINGLE, MULTI = "single_zone", "multi_zone"
KINDS = (SINGLE, MULTI)
# Discarded before the first window: the sampler starts a fresh run at tick 0, the burn-in lets
# the state and run age at window starts settle toward the model's long-run mix.
BURN_IN_S = 3 * 86400.0
QUICK_BURN_IN_S = 86400.0
# (market windows per cell, seeds) by (setting, kind). A multi-zone window is one scenario per
# home zone on one market window (one independent draw; the single-node multi-zone cells take
# about half of the default run's ~3.5 min of one core). Gang windows are cheap (3 zones, 5-min
# ticks), and more of them resolve the "costlier than on-demand in <= 1% of windows" goal.
DEFAULT_WINDOWS = {(SINGLE_NODE.name, SINGLE): (16, 4), (SINGLE_NODE.name, MULTI): (16, 4),
                   (GANG_4NODE.name, SINGLE): (32, 4), (GANG_4NODE.name, MULTI): (32, 4)}
QUICK_WINDOWS, QUICK_ZONES = 2, {SINGLE: 1, MULTI: 2}


@dataclass
class Cell:
    """One cell of the suite (setting, kind, protocol, collection, instance type) and the model
    its windows are scored with."""

    setting: Setting
    kind: str
    protocol: str
    folder: str
    instance_type: str
    template: Scenario  # a real window of the cell: job, rules, prices, zones, split
    model: PreemptionRiskModel

    @property
    def key(self) -> tuple[str, str, str, str, str]:
        return (self.setting.name, self.kind, self.protocol, self.folder, self.instance_type)

    @property
    def nodes(self) -> int:
        return self.template.job.node_count

    def sampling_model(self) -> PreemptionRiskModel:
        """The model the gang's whole-gang availability is drawn from: the one trainwise plans a
        gang with (its level-N curves, extended above the fitted levels exactly as it does)."""
        if self.nodes == 1:
            return self.model
        return self.model.with_gang_levels((self.nodes,),
                                           TrainwiseAllocationConfig().gang_hazard_exponent)


def suite_cells(protocols: Iterable[str], settings: Iterable[str] = tuple(SETTINGS),
                kinds: Iterable[str] = KINDS) -> list[Cell]:
    """The cells as `build_scenarios` makes them (multi-zone only where a collection has several
    zones of one instance type), with their risk model (fitted on what the cell's split allows;
    the real run at the cutoff is replaced per synthetic window)."""
    cells = []
    # The folders of every collection in the spot data folder (cloud.scenarios.discovered_settings), so a
    # collection a user adds is in the model world too; a setting with none is skipped.
    found = {s.name: s for s in discovered_settings()}
    for name in settings:
        setting = found.get(name)
        if setting is None:
            continue
        for protocol in protocols:
            seen = set()
            for scenario in build_scenarios(setting, rules_for(setting), 1, kinds=tuple(kinds),
                                            protocol=protocol):
                key = (scenario.kind, scenario.source_folder, scenario.instance_type)
                if key not in seen:
                    seen.add(key)
                    cells.append(Cell(setting, scenario.kind, protocol, *key[1:], scenario,
                                      risk_model_for(scenario)))
    return cells


def market_seed_of(scenario: Scenario) -> int:
    """The seed of the synthetic market a window was cut from (kept in its oracle key)."""
    return scenario.oracle_key[-3]


def model_world_scenarios(cell: Cell, windows: int, seeds: int, burn_in_s: float,
                          max_zones: int | None = None) -> list[Scenario]:
    """`windows` market windows of the cell's length, spread over `seeds` synthetic markets
    sampled from the cell's model, back to back after the burn-in (no two overlap; zones are
    sampled independently). Single-zone: one scenario per zone and window (each an independent
    draw); multi-zone: one per home zone on the whole window (they share one oracle)."""
    if windows < 1 or seeds < 1:
        raise ValueError(f"windows={windows} and seeds={seeds} must be >= 1")
    real, template = cell.template.trace_market, cell.template
    zones = real.zones[:max_zones] if max_zones else real.zones
    if cell.kind == MULTI and len(zones) < 2:
        raise ValueError(f"a multi-zone cell needs >= 2 zones; max_zones={max_zones} leaves "
                         f"{len(zones)} of {cell.folder}")
    prices = {z: (real.spot_usd_per_hour[i], real.on_demand_usd_per_hour[i])
              for i, z in enumerate(real.zones)}
    window_ticks, model = template.window_ticks, cell.sampling_model()
    seeds = min(seeds, windows)
    per_seed = math.ceil(windows / seeds)
    burn_ticks = math.ceil(burn_in_s / real.tick_s)
    # Single-node cells keep the seeds of the first version (their folders are no gang's).
    seed_key = cell.key[2:] if cell.nodes == 1 else (cell.setting.name, *cell.key[2:])
    scenarios: list[Scenario] = []
    made = 0
    for s in range(seeds):
        seed = zlib.crc32("/".join(("bound", *seed_key, str(s))).encode())
        count = min(per_seed, windows - made)
        market = synthetic_market(model, zones, burn_ticks + count * window_ticks, real.tick_s,
                                  seed, [prices[z][0] for z in zones],
                                  [prices[z][1] for z in zones], spot_nodes=cell.nodes)
        for k in range(count):
            start = burn_ticks + k * window_ticks
            window = market.window(start, window_ticks)
            for zone in zones:
                single = cell.kind == SINGLE
                scenarios.append(Scenario(
                    setting=cell.setting, kind=cell.kind,
                    folder=f"model world: {cell.folder}", instance_type=cell.instance_type,
                    market=window.zone_market(zone) if single else window, home_zone=zone,
                    start_tick=start, job=template.job, rules=template.rules,
                    oracle_key=("bound", *cell.key, seed, start, zone if single else zones),
                    # Node faults (gangs) drawn per window, not repeated across a market's.
                    seed=zlib.crc32(f"{seed}/{zone}/{start}".encode()),
                    deadline_h=template.deadline_h, source_folder=cell.folder,
                    trace_market=market, fit_split=template.fit_split,
                    window_ticks=window_ticks))
        made += count
    return scenarios


def trainwise_with_true_model(models: dict[tuple[str, ...], PreemptionRiskModel]
                              ) -> Callable[[Scenario], Any]:
    """trainwise_heuristic given the model the market was sampled from, knowing the run in
    progress at the window's start (from the synthetic past, as the suite does from the trace)."""
    def build(scenario: Scenario) -> Any:
        model = models[(scenario.setting.name, scenario.kind, scenario.protocol,
                        scenario.source_folder, scenario.instance_type)]
        window_model = at_window_start(model, scenario.trace_market, scenario.start_tick)
        return make_policy(TRAINWISE, risk_model=window_model)
    return build


def real_figures(path: Path) -> dict[tuple[str, ...], dict[str, Any]]:
    """The suite's headline rows (cost.json), by cell; {} if absent."""
    if not path.is_file():
        return {}
    rows = json.loads(path.read_text()).get("headline", [])
    return {(r["setting"], r["kind"], r["protocol"], r["collection"], r["instance_type"]): r
            for r in rows if r["setting"] in SETTINGS}


def cell_row(cell: Cell, outcomes: list[ScenarioOutcome],
             real: dict[str, Any] | None) -> dict[str, Any]:
    costs = {n: np.array([o.results[n]["cost_usd"] for o in outcomes]) for n in POLICIES}
    oracle = np.array([o.oracle_met_usd for o in outcomes])
    # Bootstrap unit: one market window (single-zone: each zone's window is its own draw;
    # multi-zone: the home zones of one window share its market).
    units = [(market_seed_of(o.scenario), o.scenario.start_tick,
              o.scenario.home_zone if cell.kind == SINGLE else "") for o in outcomes]
    index: dict[tuple, int] = {}
    blocks = np.array([index.setdefault(u, len(index)) for u in units])
    markets = {id(o.scenario.trace_market): o.scenario.trace_market for o in outcomes}
    zones = sorted({o.scenario.home_zone for o in outcomes})
    model, nodes = cell.sampling_model(), cell.nodes
    per_window = costs[TRAINWISE] / oracle
    met = {n: [o.results[n]["deadline_met"] for o in outcomes] for n in POLICIES}
    row = {
        "setting": cell.setting.name, "kind": cell.kind, "protocol": cell.protocol,
        "collection": cell.folder, "instance_type": cell.instance_type, "nodes": nodes,
        "zones": len(zones), "seeds": len(markets), "windows": len(outcomes),
        "independent_windows": len(index),
        "tick_s": cell.template.market.tick_s, "window_ticks": cell.template.window_ticks,
        "mean_usd": {n: float(c.mean()) for n, c in costs.items()} | {
            "oracle": float(oracle.mean())},
        "trainwise_vs_oracle": block_bootstrap(costs[TRAINWISE], oracle, blocks).as_dict(),
        "trainwise_vs_uniform_progress": block_bootstrap(
            costs[TRAINWISE], costs[BASELINE], blocks).as_dict(),
        "oracle_vs_uniform_progress": block_bootstrap(oracle, costs[BASELINE], blocks).as_dict(),
        "trainwise_vs_oracle_worst_window": float(per_window.max()),
        "windows_within_3pct_of_oracle": float(np.mean(per_window <= 1.03)),
        # Issue 9's gang goal: never costlier than on-demand in more than 1% of windows.
        "robustness": {n: robustness(costs[n], costs[ON_DEMAND], met[n])
                       for n in (BASELINE, TRAINWISE)},
        "deadline_misses": {n: int(sum(not m for m in met[n])) for n in POLICIES},
        # Whole-gang availability: the share of ticks a zone holds all `nodes` spot nodes.
        "spot_up_share_sampled": float(np.mean(
            [(m.spot_available >= nodes).mean() for m in markets.values()])),
        "spot_up_share_model": float(np.mean([model.availability_share(z, nodes)
                                              for z in zones])),
        "model_fitted_on": model.fitted_on,
        "real": None,
    }
    if real is not None:
        bound_gap = row["trainwise_vs_oracle"]["value"] - 1.0
        real_gap = real["vs_oracle"]["value"] - 1.0
        row["real"] = {
            "windows": real["windows"], "trainwise_vs_oracle": real["vs_oracle"],
            "trainwise_vs_uniform_progress": real["vs_uniform_progress"],
            "oracle_vs_uniform_progress": real["oracle_vs_uniform_progress"],
            "costlier_than_on_demand_share": real.get("costlier_than_on_demand_share"),
            # Share of the real gap to the oracle that the model world also shows.
            "bound_share_of_real_gap": bound_gap / real_gap if real_gap > 0 else None,
        }
    return row


def ratio_with_interval(cell: dict[str, Any]) -> str:
    """'1.234 [1.200, 1.260]' (or '[n/a]' where the bootstrap had too few blocks)."""
    if cell["low"] is None:
        return f"{cell['value']:.3f} [n/a]"
    return f"{cell['value']:.3f} [{cell['low']:.3f}, {cell['high']:.3f}]"


def _pct(share: float | None) -> str:
    return "-" if share is None else f"{share:.0%}" if share == 0 else f"{share:.1%}"


HEADER = ("| collection | type | windows (independent; zones x seeds) | trainwise / oracle [95%] | "
          "trainwise / uniform_progress [95%] | oracle / uniform_progress [95%] | within 3% of "
          "oracle | misses tw/up | tw costlier than on-demand / worst tw / on-demand | spot up "
          "share sampled / model | REAL trainwise / oracle [95%] | REAL trainwise / up | "
          "REAL oracle / up | REAL costlier than on-demand | bound / real gap |\n"
          "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")


def _table_line(r: dict[str, Any]) -> str:
    real = r["real"]
    real_cells = ["-"] * 5
    if real is not None:
        share = real["bound_share_of_real_gap"]
        real_cells = [ratio_with_interval(real["trainwise_vs_oracle"]),
                      f"{real['trainwise_vs_uniform_progress']['value']:.3f}",
                      f"{real['oracle_vs_uniform_progress']:.3f}",
                      _pct(real["costlier_than_on_demand_share"]),
                      "-" if share is None else f"{share:.0%}"]
    misses, tw = r["deadline_misses"], r["robustness"][TRAINWISE]
    return (f"| {r['collection']} | {r['instance_type']} | {r['windows']} "
            f"({r['independent_windows']}; {r['zones']} x {r['seeds']}) | "
            f"{ratio_with_interval(r['trainwise_vs_oracle'])} | "
            f"{ratio_with_interval(r['trainwise_vs_uniform_progress'])} | "
            f"{ratio_with_interval(r['oracle_vs_uniform_progress'])} | "
            f"{r['windows_within_3pct_of_oracle']:.0%} | {misses[TRAINWISE]}/{misses[BASELINE]} | "
            f"{_pct(tw['costlier_than_on_demand_share'])} / {tw['worst_vs_on_demand']:.3f} | "
            f"{r['spot_up_share_sampled']:.2f} / {r['spot_up_share_model']:.2f} | "
            + " | ".join(real_cells) + " |")


def render_markdown(rows: list[dict[str, Any]], settings: dict[str, Any],
                    sizes: dict[tuple[str, str], tuple[int, int]]) -> str:
    lines = ["# Model-world bound: trainwise_heuristic vs the hindsight oracle when the market is "
             "its own risk model", "", NOTES.format(**settings), ""]
    for (setting, kind), (windows, seeds) in sizes.items():
        for protocol in (LTO, LOCO):
            mine = [r for r in rows if (r["setting"], r["kind"], r["protocol"]) ==
                    (setting, kind, protocol)]
            if mine:
                lines += [f"## {setting}, {kind}, {protocol}", "",
                          f"{windows} market windows per cell from {seeds} synthetic market(s).",
                          "", HEADER, *map(_table_line, mine), ""]
    return "\n".join(lines)


NOTES = """What this is. For each cell of the cost suite (`benchmarks/cost`) in settings single_node
(1 node, 48 h of work, 52 h deadline) and gang_4node (4 x p3.2xlarge as one synchronous gang, 160
GPU-h, 52 h deadline, stragglers and node faults as in the suite), kinds single-zone and
multi-zone, with the suite's rules and prices, the risk model that cell's windows are scored with
(`cloud.scenarios.risk_model_for`: fitted only on what the cell's protocol allows) is taken as the TRUTH:
spot markets are sampled from it (`cloud/synthetic_market.py`: alternating up/down runs, per-tick
end probability 1 - S(age, tick) with its age-dependent hazard and time-of-day factor; the cell's
zones, tick and prices; a {burn_in_d:g}-day burn-in discarded; windows of the cell's length back to
back, so none overlap). On every window: trainwise_heuristic GIVEN THAT SAME MODEL (and the run in
progress at the window start, as in the suite), uniform_progress, on_demand and the hindsight
oracle (deadline met; multi-zone: over all the cell's zones, each zone in turn the home zone,
where uniform_progress stays), all through `suite.run_scenarios`. 95% intervals: percentile
bootstrap of the ratio of mean costs, resampling market windows (a single-zone window is its own
draw; the home zones of one multi-zone window form one block), {draws} draws, seed {seed}.

Simplifications. Zones are sampled independently (the model has no cross-zone term); real zones
may be correlated (one outage taking several), which this world does not have. A gang's zone is
sampled at the gang's level only: all 4 nodes free or none, from the level-4 curves trainwise
plans the gang with (leave-one-collection-out: the other collections' single-node curves, as no
4-node data reaches that fit). The model has a marginal curve per level and no joint law across
levels, so partial capacity (1-3 free nodes, about 6% of the real 4-node trace's ticks) is not
sampled. trainwise and uniform_progress launch whole-gang spot only, so it takes nothing from
them, but the oracle can run s spot + 4-s on-demand nodes on partial capacity; here it cannot, so
gang trainwise / oracle is on that count lower than in a world with partial capacity.

What it means. trainwise plans by backward induction on that model, so in this world its cost /
oracle is what it pays for not knowing the future when its model is exactly right; were it
Bayes-optimal, that would be the floor for any online policy. Where the real-trace figure (REAL
columns, from `cost.json`, same cell, protocol and job) is near this one, the real gap is not
model error: closing it needs a better decision rule (which this model world can test without
touching held-out data) or a market more predictable than the model. "bound / real gap" is
(bound - 1) / (real - 1): the share of the real gap that the model world shows too (over 100%:
the real market was easier for trainwise than its own model world). Issue 9's goals (single node
<= 1.03x the oracle, multi-zone <= 1.02x, gangs below uniform_progress and costlier than on-demand
in <= 1% of windows) that fail here fail with an exact model: a more accurate risk model alone
cannot meet them.

What it does not mean. It is a bound only for a world where the model is true: zones
independent, no regime shifts, no structure the model leaves out. The real market may be more
predictable than the model (longer, more regular runs, daily patterns at finer grain than 6 bins:
then a better model could beat this "floor") or less (then the floor is optimistic). The policy is
not exactly Bayes-optimal either (its plan grid, margins and safety net), so the bound is what
THIS policy achieves under its own model, an upper estimate of the true model-world floor. "spot up
share sampled / model" checks the sampler against the model's long-run share of whole-gang
availability (they differ by time-of-day effects, the tick grid and sampling error)."""


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.cost.bound",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--settings", nargs="+", choices=tuple(SETTINGS),
                        default=list(SETTINGS), help="suite settings to run (default: all)")
    parser.add_argument("--kinds", nargs="+", choices=KINDS, default=list(KINDS),
                        help="scenario kinds to run (default: both)")
    parser.add_argument("--windows", type=int, default=None,
                        help="market windows per cell (default by setting and kind: "
                        f"{ {f'{s}/{k}': w for (s, k), (w, _) in DEFAULT_WINDOWS.items()} }; "
                        f"quick {QUICK_WINDOWS})")
    parser.add_argument("--seeds", type=int, default=None,
                        help="synthetic markets per cell (default 4; quick 1)")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="output folder")
    parser.add_argument("--real", type=Path, default=DEFAULT_OUT / "cost.json",
                        help="the suite's cost.json to set the real-trace figures beside")
    parser.add_argument("--quick", action="store_true",
                        help="seconds, for tests: leave-time-out only, 1 zone per single-zone "
                        f"cell and 2 per multi-zone cell, {QUICK_WINDOWS} windows, 1 seed")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    started = time.perf_counter()
    burn_in_s = QUICK_BURN_IN_S if args.quick else BURN_IN_S
    protocols = (LTO,) if args.quick else (LTO, LOCO)
    cells = suite_cells(protocols, args.settings, args.kinds)
    sizes: dict[tuple[str, str], tuple[int, int]] = {}
    for cell in cells:
        windows, seeds = (QUICK_WINDOWS, 1) if args.quick else DEFAULT_WINDOWS[cell.key[:2]]
        sizes[cell.key[:2]] = (args.windows or windows, min(args.seeds or seeds,
                                                            args.windows or windows))
    by_cell = {cell.key: model_world_scenarios(
        cell, *sizes[cell.key[:2]], burn_in_s, QUICK_ZONES[cell.kind] if args.quick else None)
        for cell in cells}
    scenarios = [s for cell in cells for s in by_cell[cell.key]]
    outcomes = run_scenarios(scenarios, POLICIES, progress_bar(not args.no_progress, "bound"),
                             {TRAINWISE: trainwise_with_true_model(
                                 {cell.key: cell.model for cell in cells})})
    real = real_figures(args.real)
    rows, position = [], 0
    for cell in cells:
        mine = outcomes[position:position + len(by_cell[cell.key])]
        position += len(mine)
        rows.append(cell_row(cell, mine, real.get(cell.key)))
    settings = {"burn_in_d": burn_in_s / 86400.0, "draws": BOOTSTRAP_DRAWS,
                "seed": BOOTSTRAP_SEED}
    violations = oracle_violations(outcomes)
    payload = {
        "notes": NOTES.format(**settings), "settings": args.settings, "kinds": args.kinds,
        "policies": list(POLICIES),
        "windows_and_seeds_per_cell": {f"{s}/{k}": list(v) for (s, k), v in sizes.items()},
        "burn_in_s": burn_in_s, "quick": args.quick, "protocols": list(protocols),
        "real_source": str(args.real) if real else None,
        "rows": rows, "oracle_violations": violations,
        "windows": [{"setting": o.scenario.setting.name, "kind": o.scenario.kind,
                     "protocol": o.scenario.protocol, "collection": o.scenario.source_folder,
                     "instance_type": o.scenario.instance_type, "zone": o.scenario.home_zone,
                     "market_seed": market_seed_of(o.scenario),
                     "start_tick": o.scenario.start_tick, "oracle_usd": o.oracle_met_usd,
                     **{f"{n}_usd": o.results[n]["cost_usd"] for n in POLICIES}}
                    for o in outcomes],
        "timing": {"wall_s": time.perf_counter() - started},
    }
    return write_with_footer(args.out, "cost_bound", "benchmarks.cost.bound", argv, payload,
                             render_markdown(rows, settings, sizes), len(outcomes))


def write_with_footer(out: Path, name: str, module: str, argv: list[str] | None,
                      payload: dict[str, Any], markdown: str, windows: int) -> int:
    """Write a model-world suite's results (oracle violations and wall time under the table)
    with the command that made them; 1 when the oracle was beaten anywhere, else 0."""
    violations = payload["oracle_violations"]
    markdown += (f"\n\nOracle violations: {len(violations)}. Wall time "
                 f"{payload['timing']['wall_s']:.0f} s for {windows} windows.")
    command = ["python", "-m", module, *(argv if argv is not None else sys.argv[1:])]
    json_path, md_path = write_results(out, name, payload, markdown, provenance(command))
    print(markdown)
    print(f"wrote {md_path} and {json_path}")
    return 1 if violations else 0


if __name__ == "__main__":
    sys.exit(main())
