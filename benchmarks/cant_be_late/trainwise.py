"""`python -m benchmarks.cant_be_late.trainwise [--stride N] [--jobs N] [--quick] [--out DIR]`:
trainwise_heuristic on the Can't Be Late setting exactly (issue 9's goal: >= 10% below the
PUBLISHED Uniform Progress), window by window against the published simulator's costs.

What it runs: every `stride`-th reference start offset of every zone of the two collections,
built exactly as `run.py` builds them (`scenario.rules()`, `scenario.JOB`, the zone market's
`window(offset, deadline ticks)`). The published Uniform Progress, greedy and on-demand costs and
the exact optimum of the same windows are read from the reference (`scenario.load_reference`),
not recomputed: `run.py` shows the project reproduces them to the reference's rounding.

What trainwise gets, with the cost suite's own code (`cloud/scenario_protocol.py`): per
collection, a risk model fitted leave-one-collection-out (`loco_split`, `fit_for_split`: the
OTHER collections of the spot data folder only, the held-out one's zone names with zero ticks),
and per window that model with the runs in progress at the window's start (`at_window_start` on
the collection's market at the window's offset), as `cloud.scenarios.risk_model_for` combines them.
The heuristic's own constants are NOT refitted: they were chosen on the cost suite, which holds
these collections (under other rules), so only the risk model is out of sample.

Intervals: a block bootstrap (`benchmarks/cost/stats.py`) whose blocks are one window length of
start ticks, every zone of an offset in the same block (windows at nearby offsets overlap).
"""

from __future__ import annotations

import argparse
import functools
import sys
import time
from collections.abc import Iterator
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import numpy as np

from benchmarks.cant_be_late import scenario as S
from benchmarks.cost.stats import block_bootstrap, independent_windows, robustness, time_blocks
from benchmarks.results_io import write_suite_results
from cloud.policy_registry import make_policy
from cloud.scenario_protocol import FitSplit, at_window_start, fit_for_split, loco_split
from cloud.scenarios import all_collections, cached_folder_histories
from cloud.simulator import Market, simulate
from controllers.preemption_risk import PreemptionRiskModel

DEFAULT_OUT = Path(__file__).resolve().parent.parent / "results"
RESULTS_STEM = "cant_be_late_trainwise"
POLICY = "trainwise_heuristic"
DEFAULT_STRIDE = 10
# --quick: 4 offsets x 2 zones per collection, a few seconds.
QUICK_STRIDE = 250
QUICK_ZONES = 2
# Offsets per worker task: small enough for a smooth progress bar, large enough to amortise.
OFFSETS_PER_TASK = 20
# Issue 9: trainwise <= 0.90x the published Uniform Progress (ratio of mean costs).
GOAL_VS_PUBLISHED_UP = 0.90
# The reference rounds costs to 4 decimals; `run.py` matches its optimum to 1e-3 USD.
OPTIMUM_TOLERANCE_USD = 1e-3

CAVEAT = (
    "Only the risk model is out of sample: the heuristic's own constants (plan grid, margins, "
    "spot shares) were chosen on the cost suite, which includes these two collections (with "
    "60 s hourly saves and per-second billing of the last tick, not these rules), and are not "
    "refitted per split."
)


@functools.cache
def _markets(folder: str) -> dict[str, Market]:
    return S.markets(folder)


_MODELS: dict[str, tuple[FitSplit, PreemptionRiskModel]] = {}


def collection_model(folder: str) -> tuple[FitSplit, PreemptionRiskModel]:
    """The leave-one-collection-out split of `folder` and the risk model fitted on it, once per
    process (the cost suite's `risk_model_for`, on this setting's all-zone market)."""
    if folder not in _MODELS:
        split = loco_split(folder, all_collections())
        model = fit_for_split(split, _markets(folder)["*"], folder, cached_folder_histories)
        _MODELS[folder] = (split, model)
    return _MODELS[folder]


def _run_task(task: tuple[str, str, list[int]]) -> tuple[list[dict], str]:
    """trainwise on the windows of one zone at `offsets`; also the model's `fitted_on`."""
    folder, stem, offsets = task
    markets = _markets(folder)
    market, all_zones = markets[stem], markets["*"]
    ticks, rules = S.deadline_ticks(market), S.rules()
    _, model = collection_model(folder)
    rows = []
    for offset in offsets:
        policy = make_policy(POLICY, risk_model=at_window_start(model, all_zones, offset))
        result = simulate(policy, S.JOB, rules, market.window(offset, ticks))
        rows.append({"folder": folder, "zone": stem, "offset": offset,
                     "cost_usd": result.cost_usd, "deadline_met": result.deadline_met,
                     "spot_share": result.spot_share, "changeovers": result.changeovers,
                     "preemptions": result.preemptions})
    return rows, model.fitted_on


def _tasks(ref: S.Reference, stride: int, zones_limit: int | None
           ) -> list[tuple[str, str, list[int]]]:
    tasks = []
    for folder in S.COLLECTIONS.values():
        offsets = ref.offsets(folder)[::stride]
        stems = sorted({k[1] for k in ref.single if k[0] == folder})[:zones_limit]
        for stem in stems:
            tasks += [(folder, stem, offsets[i:i + OFFSETS_PER_TASK])
                      for i in range(0, len(offsets), OFFSETS_PER_TASK)]
    return tasks


def _results(tasks: list, jobs: int) -> Iterator[tuple[list[dict], str]]:
    if jobs > 1:
        with ProcessPoolExecutor(jobs) as pool:
            yield from pool.map(_run_task, tasks)
    else:
        yield from map(_run_task, tasks)


def run(stride: int = DEFAULT_STRIDE, jobs: int = 1, zones_limit: int | None = None,
        progress: bool = False) -> dict:
    """Rows (one per window: trainwise's cost and the reference's) and, per collection, the
    split and the `fitted_on` text of the model trainwise was given."""
    ref = S.load_reference()
    tasks = _tasks(ref, stride, zones_limit)
    bar = None
    if progress:
        try:
            from tqdm import tqdm
            bar = tqdm(total=sum(len(t[2]) for t in tasks), desc=POLICY, unit="window",
                       file=sys.stderr, leave=False)
        except ImportError:
            bar = None
    rows: list[dict] = []
    fitted_on: dict[str, set[str]] = {}
    for task_rows, text in _results(tasks, jobs):
        rows += task_rows
        fitted_on.setdefault(task_rows[0]["folder"], set()).add(text)
        if bar is not None:
            bar.update(len(task_rows))
    if bar is not None:
        bar.close()
    for row in rows:
        key = (row["folder"], row["zone"], row["offset"])
        row["uniform_progress_published_usd"] = ref.policy[(*key, "uniform_progress")]
        row["greedy_published_usd"] = ref.policy[(*key, "greedy_spot")]
        row["on_demand_published_usd"] = ref.policy[(*key, "on_demand")]
        row["optimum_exact_usd"] = ref.single[key]
    models = {}
    for folder, texts in fitted_on.items():
        if len(texts) != 1:
            raise RuntimeError(f"workers fitted different models for {folder}: {sorted(texts)}")
        split, _ = collection_model(folder)
        models[folder] = {"held_out": split.held_out, "protocol": split.protocol,
                          "fit_collections": list(split.fit_collections),
                          "fitted_on": texts.pop(),
                          "window_ticks": S.deadline_ticks(_markets(folder)["*"])}
    return {"rows": rows, "models": models}


def summarize(result: dict) -> list[dict]:
    """One row per collection: misses, ratios with block-bootstrap intervals, robustness."""
    out = []
    for folder, model in result["models"].items():
        rows = [r for r in result["rows"] if r["folder"] == folder]
        window_ticks = model["window_ticks"]
        offsets = [r["offset"] for r in rows]
        blocks = time_blocks([folder] * len(rows), offsets, [window_ticks] * len(rows))
        cost = np.array([r["cost_usd"] for r in rows])
        up = np.array([r["uniform_progress_published_usd"] for r in rows])
        greedy = np.array([r["greedy_published_usd"] for r in rows])
        on_demand = np.array([r["on_demand_published_usd"] for r in rows])
        optimum = np.array([r["optimum_exact_usd"] for r in rows])
        met = [r["deadline_met"] for r in rows]
        vs_up = block_bootstrap(cost, up, blocks)
        worst = int(np.argmax(cost / on_demand))
        out.append({
            "collection": folder,
            "windows": len(rows),
            "zones": len({r["zone"] for r in rows}),
            "offsets": len(set(offsets)),
            "independent_windows": independent_windows(offsets, window_ticks),
            "time_blocks": int(len(set(blocks.tolist()))),
            "mean_trainwise_usd": float(cost.mean()),
            "mean_uniform_progress_published_usd": float(up.mean()),
            "mean_greedy_published_usd": float(greedy.mean()),
            "mean_on_demand_published_usd": float(on_demand.mean()),
            "mean_optimum_exact_usd": float(optimum.mean()),
            "vs_uniform_progress_published": vs_up.as_dict(),
            "vs_greedy_published": block_bootstrap(cost, greedy, blocks).as_dict(),
            "vs_optimum_exact": block_bootstrap(cost, optimum, blocks).as_dict(),
            "costlier_than_uniform_progress_share": float(
                np.mean(cost > up + OPTIMUM_TOLERANCE_USD)),
            "below_optimum_windows": int(np.sum(cost < optimum - OPTIMUM_TOLERANCE_USD)),
            **robustness(cost, on_demand, met),
            "worst_window": f"{rows[worst]['zone']} @ {rows[worst]['offset']}",
            "goal_met": vs_up.value <= GOAL_VS_PUBLISHED_UP,
            "goal_met_interval_high": (vs_up.high is not None
                                       and vs_up.high <= GOAL_VS_PUBLISHED_UP),
        })
    return out


def compact_windows(rows: list[dict]) -> dict:
    """trainwise's cost per window as {collection: {zone: {offset: USD}}} (rounded like the
    reference, 4 decimals) and the missed windows: the reference holds the rest, and one record
    per window would make the JSON megabytes at stride 1."""
    costs: dict[str, dict[str, dict[str, float]]] = {}
    for r in rows:
        zone = costs.setdefault(r["folder"], {}).setdefault(r["zone"], {})
        zone[str(r["offset"])] = round(r["cost_usd"], 4)
    missed = [f"{r['folder']}/{r['zone']} @ {r['offset']}" for r in rows if not r["deadline_met"]]
    return {"cost_usd": costs, "deadline_missed": missed}


def _interval(stat: dict) -> str:
    if stat["low"] is None:
        return f"{stat['value']:.3f}x (no interval: {stat['blocks']} blocks)"
    return f"{stat['value']:.3f}x [{stat['low']:.3f}, {stat['high']:.3f}]"


def markdown(summary: list[dict], models: dict, stride: int, quick: bool, elapsed_s: float) -> str:
    lines = ["# trainwise_heuristic on the Can't Be Late setting, against the published "
             "Uniform Progress", ""]
    subset = (f"every {stride}th reference start offset" if stride > 1 else
              "every reference start offset") + (f", {QUICK_ZONES} zones per collection "
                                                 "(--quick smoke run)" if quick else ", every zone")
    lines += [
        "Setting: 1 node, 48 h of work, 52 h deadline, 0.1 h changeover paid at every launch, "
        "on-demand 3.06 / spot 0.9731 USD/h flat, no checkpoint saves, finishing tick billed "
        "whole (`benchmarks/cant_be_late/scenario.py`). Windows: " + subset + ". Published "
        "Uniform Progress, greedy, on-demand and the exact single-zone optimum are the "
        "reference's own figures for the same windows (`../shared/data/peers/cant-be-late/`).",
        "",
        "Protocol (out of sample, leave-one-collection-out, the cost suite's "
        "`cloud/scenario_protocol.py`): each collection's windows are run with a risk model "
        "fitted on the other collections of the spot data folder only; each window gets the "
        "runs in progress at its start (`at_window_start`). " + CAVEAT,
        "",
        f"Goal (issue 9): trainwise <= {GOAL_VS_PUBLISHED_UP:.2f}x the published Uniform "
        "Progress (ratio of mean costs). Intervals: 95% block bootstrap, blocks of one window "
        "length of start ticks with every zone of an offset together.",
        "",
        "| collection | windows (independent) | deadline misses | trainwise / published UP "
        "[95%] | trainwise / exact optimum [95%] | trainwise / published greedy | costlier than "
        "published UP | worst window vs on-demand | mean USD trainwise / UP / optimum | goal "
        f"<= {GOAL_VS_PUBLISHED_UP:.2f}x |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in summary:
        high_note = "" if r["goal_met_interval_high"] else " (interval's upper end above)"
        goal = ("yes" + high_note) if r["goal_met"] else "NO"
        lines.append(
            f"| {r['collection']} | {r['windows']} ({r['independent_windows']}) | "
            f"{r['deadline_misses']} | {_interval(r['vs_uniform_progress_published'])} | "
            f"{_interval(r['vs_optimum_exact'])} | "
            f"{r['vs_greedy_published']['value']:.3f}x | "
            f"{r['costlier_than_uniform_progress_share']:.1%} | "
            f"{r['worst_vs_on_demand']:.3f}x ({r['worst_window']}) | "
            f"{r['mean_trainwise_usd']:.2f} / {r['mean_uniform_progress_published_usd']:.2f} / "
            f"{r['mean_optimum_exact_usd']:.2f} | {goal} |")
    blocks = ", ".join(f"{r['collection']} {r['time_blocks']}" for r in summary)
    lines += ["", f"Bootstrap time blocks: {blocks}. A collection spanning few window lengths "
              "has few blocks, and its interval is coarse (a resample of 3 blocks takes few "
              "distinct values); windows at nearby offsets share most of their hours, so the "
              "independent-window count, not the window count, is the sample size."]
    lines += ["", "Risk model per held-out collection (`fitted_on`):", ""]
    lines += [f"- {folder}: {m['fitted_on']}" for folder, m in models.items()]
    below = sum(r["below_optimum_windows"] for r in summary)
    lines += ["", f"Windows where trainwise cost less than the exact optimum (beyond "
              f"{OPTIMUM_TOLERANCE_USD} USD, the reference's rounding): {below}.",
              "", f"Run time: {elapsed_s:.0f} s.", ""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.cant_be_late.trainwise")
    parser.add_argument("--stride", type=int, default=None,
                        help=f"every N-th reference start offset (default {DEFAULT_STRIDE}; "
                        f"--quick {QUICK_STRIDE}; 1 = all 1,000)")
    parser.add_argument("--jobs", type=int, default=1, help="worker processes")
    parser.add_argument("--quick", action="store_true",
                        help=f"every {QUICK_STRIDE}th offset, {QUICK_ZONES} zones per collection")
    parser.add_argument("--out", type=Path, default=None,
                        help=f"results folder (default {DEFAULT_OUT}; --quick writes nothing "
                        "unless --out is given)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    args = parser.parse_args(argv)
    stride = args.stride if args.stride is not None else (
        QUICK_STRIDE if args.quick else DEFAULT_STRIDE)
    if stride < 1 or args.jobs < 1:
        parser.error(f"--stride {stride} and --jobs {args.jobs} must be 1 or more")
    started = time.perf_counter()
    result = run(stride, args.jobs, QUICK_ZONES if args.quick else None,
                 progress=not args.no_progress)
    elapsed = time.perf_counter() - started
    summary = summarize(result)
    payload = {"policy": POLICY, "stride": stride, "quick": args.quick, "caveat": CAVEAT,
               "goal_vs_published_uniform_progress": GOAL_VS_PUBLISHED_UP,
               "optimum_tolerance_usd": OPTIMUM_TOLERANCE_USD, "models": result["models"],
               "summary": summary, "windows": compact_windows(result["rows"]), "elapsed_s": elapsed}
    text = markdown(summary, result["models"], stride, args.quick, elapsed)
    write_suite_results(args.out, args.quick, DEFAULT_OUT, RESULTS_STEM,
                        "benchmarks.cant_be_late.trainwise", argv, payload, text)
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
