"""Command line of the cost suite: `python -m benchmarks.cost [--quick] [--out DIR]`."""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable, Iterable
from dataclasses import asdict
from pathlib import Path

from benchmarks.cost import report
from benchmarks.cost.suite import (
    MULTI_NODE,
    SETTINGS,
    SINGLE_NODE,
    build_scenarios,
    default_policies,
    oracle_violations,
    rules_for,
    run_scenarios,
    time_full_trace,
)
from benchmarks.results_io import provenance, write_results
from cloud.policy_registry import policy_names
from cloud.risk_fit import PROTOCOL

DEFAULT_OUT = Path(__file__).resolve().parent.parent / "results"
SWEEP_FOLDER = "availability-1node-aws-2023-02"
SWEEP_DEADLINES_H = (50.0, 52.0, 56.0, 60.0, 66.0, 72.0)

NOTES = """Cost is USD per job: per-second billing of the nodes held in the window, plus, when the
deadline is missed, the charge to finish afterwards on on-demand (one changeover + the remaining
work). `vs oracle` is the mean over scenarios of cost / the deadline-met hindsight optimum of the
same window (single-zone or multi-zone oracle by kind); a policy that missed deadlines can land
below 1 (it did not do the same job); its bound is then the any-finish oracle, which it never
beats either (see `oracle_violations`). Spot share and waste share are shares of billed
node-hours in the window; waste = lost work + changeovers + checkpoint saves. Utilization =
reference GPU-hours of work kept / billed GPU-hours (stragglers lower it).

Rules for every policy: a gang of N nodes in one zone runs only whole; any change of the node set
costs a 0.1 h changeover (launch + restore), billed; a checkpoint save of 60 s every hour of
training; a 120 s spot notice in which the job saves; deadlines are rounded down to whole ticks.
Multi-node markets: SYNTHETIC (their folder reads "synthetic: ..." in every table, never
pooled with a recorded market): 16 nodes = 4 pools, each the 4-node trace shifted by 0, 1, 2
and 3 days (availability 0..16); the window length shrinks by 3 days accordingly. Zones of one
folder are paired by tick index from each file's first tick: no shipped collection.toml records
start times (the loader aligns zones by real start time when one does). Multi-zone
scenarios: the zones of one folder with the same node shape; each zone in turn is the home zone
(single-zone policies stay there; skypilot_failover moves). Prices: p3.2xlarge on-demand 3.06 and
spot 0.9731 USD/h (the Can't Be Late paper); other types AWS list price and the June 2025 Spot
Advisor saving of their region."""


TRAINWISE_NOTES = (
    "trainwise_heuristic (`controllers/allocation_heuristic.py`) gets, per scenario, a hazard "
    f"model fitted by `cloud/risk_fit.py` with this protocol: {PROTOCOL}. The fit never reads "
    "the scored window or anything after it in the same traces (a test pins it). Its design "
    "and its few settings (plan grid, switch margin, spot shares) were chosen by looking at "
    "this same suite: they were not tuned on held-out folders. Goals (issue 4), all deadlines "
    "met: single-zone at least 10% cheaper than uniform_progress on the same windows (ratio of "
    "mean costs); multi-zone mean cost / oracle at most 1.10. `oracle vs uniform_progress` is "
    "the best any policy could reach on the same windows."
)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.cost", description=__doc__)
    parser.add_argument(
        "--quick",
        action="store_true",
        help="a small version (1 window, 2 zones per folder, 2 deadlines) for tests",
    )
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="output folder")
    parser.add_argument(
        "--windows", type=int, default=None, help="start windows per zone (default 8; quick 1)"
    )
    parser.add_argument(
        "--sweep-windows",
        type=int,
        default=None,
        help="start windows per zone for the slack sweep (default 4; quick 1)",
    )
    parser.add_argument(
        "--policies",
        default=None,
        help=f"comma-separated policy names (default all: {', '.join(policy_names())})",
    )
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    return parser.parse_args(argv)


def _progress(enabled: bool, label: str) -> Callable[[Iterable], Iterable] | None:
    if not enabled:
        return None
    try:
        from tqdm import tqdm
    except ImportError:
        return None
    return lambda items: tqdm(items, desc=label, file=sys.stderr, leave=False)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    started = time.perf_counter()
    policies = tuple(args.policies.split(",")) if args.policies else default_policies()
    unknown = [p for p in policies if p not in policy_names()]
    if unknown:
        raise SystemExit(f"unknown policy {unknown[0]!r}; valid: {', '.join(policy_names())}")
    windows = args.windows or (1 if args.quick else 8)
    sweep_windows = args.sweep_windows or (1 if args.quick else 4)
    max_zones = 2 if args.quick else None
    sweep_deadlines = (52.0, 66.0) if args.quick else SWEEP_DEADLINES_H
    show = not args.no_progress

    outcomes = []
    for setting in SETTINGS:
        rules = rules_for(setting)
        scenarios = build_scenarios(setting, rules, windows, max_zones=max_zones)
        outcomes += run_scenarios(scenarios, policies, _progress(show, setting.name))
    sweep_outcomes = []
    rules = rules_for(SINGLE_NODE)
    for deadline_h in sweep_deadlines:
        scenarios = build_scenarios(
            SINGLE_NODE,
            rules,
            sweep_windows,
            kinds=("single_zone",),
            deadline_h=deadline_h,
            max_zones=max_zones,
            folders=(SWEEP_FOLDER,),
            starts_deadline_h=max(sweep_deadlines),
        )
        sweep_outcomes += run_scenarios(
            scenarios, policies, _progress(show, f"sweep {deadline_h:g} h")
        )
    full_trace_s = time_full_trace(policies, repeats=1 if args.quick else 3)

    summary = report.summarize(outcomes, policies)
    violations = oracle_violations(outcomes) + oracle_violations(sweep_outcomes)
    payload = {
        "notes": NOTES
        + (
            f"\n\nMulti-node gang: each step waits for the slowest of 16 ranks, a mean "
            f"{rules_for(MULTI_NODE).step_slowdown:.3f}x the median rank (Alibaba PAI mini-batch "
            "times), and node faults come from the InfiniteHBD fault log (no notice: the work "
            "since the last checkpoint is lost and the gang restarts), seeded per scenario. "
            f"Start windows per zone: {windows}, evenly spaced over each trace."
        ),
        "settings": [
            {**asdict(s), "rules": asdict(rules_for(s))} for s in (SINGLE_NODE, MULTI_NODE)
        ],
        "policies": list(policies),
        "windows_per_zone": windows,
        "quick": args.quick,
        "summary": summary,
        "by_folder": report.by_folder(outcomes, policies),
        "trainwise_goals": report.trainwise_goals(outcomes),
        "trainwise_notes": TRAINWISE_NOTES,
        "up_vs_greedy": report.up_vs_greedy(summary),
        "sweep_folder": SWEEP_FOLDER,
        "sweep": report.sweep_points(sweep_outcomes, policies, SINGLE_NODE.train_h),
        "oracle_violations": violations,
        "scenarios": report.scenario_records(outcomes),
        "timing": {"suite_wall_s": 0.0, "full_trace_s": full_trace_s},
    }
    report.plot_cost_vs_slack(payload["sweep"], args.out / "cost_vs_slack.png")
    payload["timing"]["suite_wall_s"] = time.perf_counter() - started
    markdown = report.render_markdown(payload, policies)
    json_path, md_path = write_results(
        args.out,
        "cost",
        payload,
        markdown,
        provenance(
            ["python", "-m", "benchmarks.cost", *(argv if argv is not None else sys.argv[1:])]
        ),
    )
    print(markdown)
    print(
        f"wrote {md_path}, {json_path} and {args.out / 'cost_vs_slack.png'} "
        f"in {payload['timing']['suite_wall_s']:.1f} s"
    )
    return 1 if violations else 0


if __name__ == "__main__":
    sys.exit(main())
