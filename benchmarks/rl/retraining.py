"""How long one scheduled retraining takes on this machine (issue 14's goals: slow <= 30 min,
fast <= 10 min).

Runs the code the Dagster schedules run (`assets/policies.py` calls `rl.retrain.retrain_slow` /
`retrain_fast` with the `WEEKLY_SLOW` / `DAILY_FAST` budgets, then the blocking check calls
`apply_gate`) for one region partition, and records wall and CPU seconds (this process, every
thread, plus any children). Policy files go to a temporary TRAINWISE_HOME, so no real champion is
touched. MLflow registration (the asset's last step) is not timed: it is a few HTTP calls.

    nice -n 10 python -m benchmarks.rl.retraining [--region us-west-2] [--kinds slow,fast]
        [--slow-timesteps N] [--fast-timesteps N] [--out benchmarks/results]

Default region: us-west-2, the partition with the most held-out cells (116; the gate evaluates
candidate and incumbent on every one), so the slowest weekly run. Writes rl_retraining.{json,md}.
"""

from __future__ import annotations

import argparse
import os
import resource
import sys
import tempfile
import time
from dataclasses import asdict, replace
from pathlib import Path

from benchmarks.results_io import provenance, write_results

RESULTS_DIR = Path(__file__).resolve().parents[1] / "results"
GOAL_S = {"slow": 30 * 60.0, "fast": 10 * 60.0}
SCHEDULE = {"slow": "weekly_slow_policy_retraining", "fast": "daily_fast_policy_retraining"}


def _cpu_s() -> float:
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    return time.process_time() + children.ru_utime + children.ru_stime


def time_one(kind: str, region: str, timesteps: int | None) -> dict:
    """One retraining of `kind` for `region` with the scheduled budget (timesteps: override)."""
    from rl.retrain import DAILY_FAST, WEEKLY_SLOW, apply_gate, retrain_fast, retrain_slow

    budget = WEEKLY_SLOW if kind == "slow" else DAILY_FAST
    if timesteps is not None:
        budget = replace(budget, ppo_timesteps=timesteps)
    retrain = retrain_slow if kind == "slow" else retrain_fast
    wall0, cpu0 = time.perf_counter(), _cpu_s()
    out = retrain(region, budget)
    gate = apply_gate(kind, region)
    wall, cpu = time.perf_counter() - wall0, _cpu_s() - cpu0
    full = timesteps is None
    # Wall time on a shared machine includes waiting for a core; CPU time is the work itself.
    return {
        "kind": kind, "region": region, "schedule": SCHEDULE[kind], "budget": asdict(budget),
        "scheduled_budget": full, "wall_s": wall, "cpu_s": cpu, "goal_s": GOAL_S[kind],
        "goal_met": (wall <= GOAL_S[kind]) if full else None,
        "cpu_share_of_wall": cpu / wall if wall > 0 else None,
        "load_average_at_end": os.getloadavg()[0],
        "train_seconds": out["train_seconds"], "evaluate_and_gate_s": wall - out["train_seconds"],
        "train_cells": out["train_cells"], "held_out": out["decision"]["cells"],
        "gate": out["decision"]["reason"], "promoted": gate["champion_version"] is not None,
        "bc_agreement": out["bc_agreement"],
    }


def markdown(rows: list[dict], load: tuple[float, float, float], nice: int) -> str:
    lines = ["# Policy retraining time (issue 14)", "",
             "One scheduled retraining, the code the Dagster schedules run (`rl.retrain` with the "
             "scheduled budget, then the gate's `apply_gate`), one region partition, this machine "
             f"(niceness {nice}, {os.cpu_count()} cores, 1-min load average at start "
             f"{load[0]:.2f}). Wall time includes waiting for a core while other jobs run; "
             "the goal is judged on wall time as measured, and CPU time (the work itself, "
             "about the wall time on an idle machine: one torch thread) is given beside it.", "",
             "| schedule | region | PPO steps | wall s | CPU s | CPU / wall | load at end | "
             "train s | evaluate + gate s | held-out | goal | met |",
             "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---|---|"]
    for r in rows:
        met = "n/a (not the scheduled budget)" if r["goal_met"] is None else (
            "yes" if r["goal_met"] else "**no**")
        lines.append(
            f"| {r['schedule']} | {r['region']} | {r['budget']['ppo_timesteps']:,} | "
            f"{r['wall_s']:.0f} | {r['cpu_s']:.0f} | {r['cpu_share_of_wall'] or 0:.0%} | "
            f"{r['load_average_at_end']:.1f} | {r['train_seconds']:.0f} | "
            f"{r['evaluate_and_gate_s']:.0f} | {r['held_out']} | <= {r['goal_s'] / 60:.0f} min | "
            f"{met} |")
    lines += ["", "Gate decisions: " + "; ".join(f"{r['kind']}: {r['gate']}" for r in rows)]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.rl.retraining")
    parser.add_argument("--region", default="us-west-2")
    parser.add_argument("--kinds", default="slow,fast")
    parser.add_argument("--slow-timesteps", type=int, default=None,
                        help="override the weekly budget's PPO steps (the goal is then not judged)")
    parser.add_argument("--fast-timesteps", type=int, default=None)
    parser.add_argument("--out", default=str(RESULTS_DIR))
    args = parser.parse_args(argv)
    kinds = [k for k in args.kinds.split(",") if k]
    bad = [k for k in kinds if k not in GOAL_S]
    if bad:
        raise SystemExit(f"unknown kind {bad[0]!r}; valid: slow, fast")
    load = os.getloadavg()
    rows = []
    before = os.environ.get("TRAINWISE_HOME")
    with tempfile.TemporaryDirectory(prefix="trainwise-retrain-") as home:
        os.environ["TRAINWISE_HOME"] = home
        try:
            for kind in kinds:
                steps = args.slow_timesteps if kind == "slow" else args.fast_timesteps
                rows.append(time_one(kind, args.region, steps))
                print(rows[-1], flush=True)
        finally:  # the temporary home is gone after this block: do not leave it set
            if before is None:
                os.environ.pop("TRAINWISE_HOME", None)
            else:
                os.environ["TRAINWISE_HOME"] = before
    payload = {"load_average_at_start": load, "niceness": os.nice(0), "runs": rows}
    command = ["python", "-m", "benchmarks.rl.retraining",
               *(argv if argv is not None else sys.argv[1:])]
    _, md_path = write_results(args.out, "rl_retraining", payload,
                               markdown(rows, load, os.nice(0)), provenance(command))
    print(md_path.read_text())
    return rows


if __name__ == "__main__":
    main()
