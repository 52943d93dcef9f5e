"""`python -m benchmarks.cant_be_late.ceiling [--stride N] [--quick] [--out DIR]`: how far a
better risk model could take trainwise on the Can't Be Late setting (issue 9's goal there:
<= 0.90x the published Uniform Progress). A diagnostic, not a headline: two of its three models
read the scored windows' own market on purpose.

Same windows, job, rules and policy as `trainwise.py`; only the risk model changes:
- `leave_one_collection_out`: the headline's model (the other collections only).
- `in_sample`: fitted on every tick of the scored collection itself (all zones), no prior. It
  knows the collection's statistics, which no online policy can before seeing them.
- `window_statistics`: fitted on the scored window's own ticks (every zone of the collection over
  the window's hours), the whole collection as the prior. It knows how this window's market
  behaves (its run lengths by age), though not when each run ends: the best a semi-Markov model
  of this class could know.

If even `window_statistics` stays far above what the goal asks of trainwise / exact optimum, the
goal is out of reach for any policy that plans on such a model, however well fitted; what is
left is the value of knowing the exact future, which only the hindsight optimum has.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

from benchmarks.cant_be_late import scenario as S
from benchmarks.cant_be_late import trainwise as T
from benchmarks.cost.stats import block_bootstrap, independent_windows, time_blocks
from benchmarks.results_io import write_suite_results
from cloud.policy_registry import make_policy
from cloud.risk_fit import AvailabilityHistory, fit_risk_model
from cloud.scenario_protocol import at_window_start
from cloud.simulator import simulate
from controllers.preemption_risk import PreemptionRiskModel

RESULTS_STEM = "cant_be_late_ceiling"
SOURCES = ("leave_one_collection_out", "in_sample", "window_statistics")
DEFAULT_STRIDE = 20
QUICK_STRIDE = 250
QUICK_ZONES = 2


def _history(folder: str, available: np.ndarray, name: str | None = None
             ) -> AvailabilityHistory:
    market = T._markets(folder)["*"]
    return AvailabilityHistory(name or folder, market.zones, float(market.tick_s), available,
                               max(1, int(market.spot_available.max())), market.trace_start_s)


def in_sample_model(folder: str) -> PreemptionRiskModel:
    """Fitted on every tick of the scored collection (no prior): in-sample by construction."""
    market = T._markets(folder)["*"]
    return fit_risk_model(_history(folder, market.spot_available), market.n_ticks, [])


def window_model(folder: str, offset: int, window_ticks: int) -> PreemptionRiskModel:
    """Fitted on the window's own ticks (all zones), the whole collection as the prior."""
    market = T._markets(folder)["*"]
    own = market.spot_available[:, offset:offset + window_ticks]
    return fit_risk_model(_history(folder, own), own.shape[1],
                          [_history(folder, market.spot_available, f"{folder} (whole)")])


def run(stride: int, zones_limit: int | None = None, progress: bool = False) -> list[dict]:
    """One row per window: trainwise's cost under each model source, and the reference's."""
    ref = S.load_reference()
    tasks = T._tasks(ref, stride, zones_limit)
    bar = None
    if progress:
        try:
            from tqdm import tqdm
            bar = tqdm(total=sum(len(t[2]) for t in tasks), desc="ceiling", unit="window",
                       file=sys.stderr, leave=False)
        except ImportError:
            bar = None
    fitted: dict[str, PreemptionRiskModel] = {}
    rows = []
    for folder, stem, offsets in tasks:
        markets = T._markets(folder)
        market, all_zones = markets[stem], markets["*"]
        ticks = S.deadline_ticks(market)
        if folder not in fitted:
            fitted[folder] = in_sample_model(folder)
        loco = T.collection_model(folder)[1]
        for offset in offsets:
            models = {"leave_one_collection_out": loco, "in_sample": fitted[folder],
                      "window_statistics": window_model(folder, offset, ticks)}
            key = (folder, stem, offset)
            row = {"folder": folder, "zone": stem, "offset": offset, "window_ticks": ticks,
                   "uniform_progress_published_usd": ref.policy[(*key, "uniform_progress")],
                   "optimum_exact_usd": ref.single[key]}
            for source, model in models.items():
                policy = make_policy(T.POLICY, risk_model=at_window_start(model, all_zones,
                                                                          offset))
                result = simulate(policy, S.JOB, S.rules(), market.window(offset, ticks))
                row[f"{source}_usd"] = result.cost_usd
                row[f"{source}_missed"] = not result.deadline_met
            rows.append(row)
            if bar is not None:
                bar.update(1)
    if bar is not None:
        bar.close()
    return rows


def summarize(rows: list[dict]) -> list[dict]:
    out = []
    for folder in sorted({r["folder"] for r in rows}):
        part = [r for r in rows if r["folder"] == folder]
        offsets = [r["offset"] for r in part]
        ticks = [r["window_ticks"] for r in part]
        blocks = time_blocks([folder] * len(part), offsets, ticks)
        up = np.array([r["uniform_progress_published_usd"] for r in part])
        optimum = np.array([r["optimum_exact_usd"] for r in part])
        entry = {"collection": folder, "windows": len(part),
                 "independent_windows": independent_windows(offsets, ticks[0]),
                 # What the goal asks, in trainwise / exact optimum: 0.90 x UP / optimum.
                 "goal_as_vs_optimum": T.GOAL_VS_PUBLISHED_UP * float(up.mean() / optimum.mean()),
                 "sources": {}}
        for source in SOURCES:
            cost = np.array([r[f"{source}_usd"] for r in part])
            entry["sources"][source] = {
                "mean_usd": float(cost.mean()),
                "vs_optimum_exact": block_bootstrap(cost, optimum, blocks).as_dict(),
                "vs_uniform_progress_published": block_bootstrap(cost, up, blocks).as_dict(),
                "deadline_misses": int(sum(r[f"{source}_missed"] for r in part)),
            }
        out.append(entry)
    return out


def markdown(summary: list[dict], stride: int, quick: bool, elapsed_s: float) -> str:
    subset = f"every {stride}th reference start offset" + (
        f", {QUICK_ZONES} zones per collection (--quick)" if quick else ", every zone")
    lines = [
        "# How far a better risk model could take trainwise on the Can't Be Late setting",
        "",
        "A diagnostic, not a headline (`benchmarks/cant_be_late/ceiling.py`): the setting, "
        "windows and policy of `cant_be_late_trainwise.md` (" + subset + "), run three times "
        "with three risk models. `leave_one_collection_out` is the headline's model. "
        "`in_sample` is fitted on every tick of the scored collection (it knows the "
        "collection's statistics before seeing them). `window_statistics` is fitted on the "
        "scored window's own ticks, every zone, with the whole collection as its prior: it "
        "knows how this window's market behaves (run lengths by age), not when each run ends.",
        "",
        "`goal as / optimum`: the goal (<= 0.90x the published Uniform Progress) restated as "
        "trainwise / exact optimum on these windows. Intervals: 95% block bootstrap as in "
        "`cant_be_late_trainwise.md`.",
        "",
        "| collection | windows (independent) | goal as / optimum | model | trainwise / exact "
        "optimum [95%] | trainwise / published UP [95%] | misses |",
        "|---|---|---|---|---|---|---|",
    ]
    for entry in summary:
        for source in SOURCES:
            s = entry["sources"][source]
            lines.append(
                f"| {entry['collection']} | {entry['windows']} ({entry['independent_windows']}) "
                f"| {entry['goal_as_vs_optimum']:.3f}x | {source} | "
                f"{T._interval(s['vs_optimum_exact'])} | "
                f"{T._interval(s['vs_uniform_progress_published'])} | {s['deadline_misses']} |")
    lines += ["", f"Run time: {elapsed_s:.0f} s.", ""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.cant_be_late.ceiling",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--stride", type=int, default=None,
                        help=f"every N-th reference start offset (default {DEFAULT_STRIDE})")
    parser.add_argument("--quick", action="store_true",
                        help=f"every {QUICK_STRIDE}th offset, {QUICK_ZONES} zones per collection")
    parser.add_argument("--out", type=Path, default=None,
                        help=f"results folder (default {T.DEFAULT_OUT}; --quick writes nothing "
                        "unless --out is given)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    args = parser.parse_args(argv)
    stride = args.stride if args.stride is not None else (
        QUICK_STRIDE if args.quick else DEFAULT_STRIDE)
    if stride < 1:
        parser.error(f"--stride {stride} must be 1 or more")
    started = time.perf_counter()
    rows = run(stride, QUICK_ZONES if args.quick else None, progress=not args.no_progress)
    elapsed = time.perf_counter() - started
    summary = summarize(rows)
    text = markdown(summary, stride, args.quick, elapsed)
    payload = {"policy": T.POLICY, "stride": stride, "quick": args.quick,
               "sources": list(SOURCES), "summary": summary, "elapsed_s": elapsed}
    write_suite_results(args.out, args.quick, T.DEFAULT_OUT, RESULTS_STEM,
                        "benchmarks.cant_be_late.ceiling", argv, payload, text)
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
