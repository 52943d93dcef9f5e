"""Time to quality: from the runs to the figures (ratios, intervals, the guard's default, plots).

Per seed, the target is the fixed schedule's final eval loss (same seed) + TARGET_TOLERANCE. A run's samples and
CPU-seconds to the target are read off its eval curve at the first evaluation at or below the
target, interpolated linearly from the evaluation before it (evaluations are every few percent of
the run; the interpolation removes most of that resolution). The fixed schedule's own first reach
is the denominator of every ratio, so a ratio < 1 is a saving at equal quality. A run that never
reaches the target has no ratio and is counted as such.

The default configuration is the guard's: for each seed, `controllers.lever_guard` judges every
lever from the other seeds' runs (leave-one-out, so no seed judges itself) and the default takes
the lever it leaves on, or the fixed schedule when none pays; that seed's default ratio is then
the chosen lever's ratio on that seed (1.0 exactly for the fixed schedule: the trainer with every
lever off runs the fixed schedule's code path, bit for bit).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from controllers.lever_guard import default_levers, judge_from_calibration, mean_interval95


def first_reach(curve: list[list[float]], target: float) -> tuple[float, float] | None:
    """(samples, cpu_s) where the eval curve first gets to `target`, interpolated; None if never.
    Curve rows: [step, samples, cpu_s, eval_loss]."""
    previous = None
    for row in curve:
        _, samples, cpu_s, loss = row
        if loss <= target:
            if previous is None or previous[3] <= loss:
                return float(samples), float(cpu_s)
            share = (previous[3] - target) / (previous[3] - loss)
            return (previous[1] + share * (samples - previous[1]),
                    previous[2] + share * (cpu_s - previous[2]))
        previous = row
    return None


# The target is the fixed schedule's final eval loss plus this: the fixed held-out windows give
# a loss that is stable to about 0.002 between runs of equal quality (issue 12), and a lever that
# changes only float summation order (a split batch) must not count as "never reached".
TARGET_TOLERANCE = 0.002


def seed_ratios(runs: list[dict[str, Any]], workload: str, lever: str
                ) -> dict[int, dict[str, Any]]:
    """Per seed: target, the lever's reach and its ratios to the fixed schedule's reach."""
    by = {(r["lever"], r["seed"]): r for r in runs if r["workload"] == workload}
    out = {}
    for (name, seed), run in sorted(by.items()):
        if name != lever or ("fixed", seed) not in by:
            continue
        fixed = by[("fixed", seed)]
        target = fixed["final_eval_loss"] + TARGET_TOLERANCE
        base = first_reach(fixed["eval_curve"], target)
        reach = first_reach(run["eval_curve"], target)
        row = {"target": target, "final_eval_loss": run["final_eval_loss"],
               "samples": None, "cpu_s": None, "samples_ratio": None, "cpu_ratio": None}
        if reach is not None and base is not None:
            row.update(samples=reach[0], cpu_s=reach[1],
                       samples_ratio=reach[0] / base[0] if base[0] else None,
                       cpu_ratio=reach[1] / base[1] if base[1] else None)
        out[seed] = row
    return out


def _interval(values: list[float | None]) -> dict[str, Any]:
    reached = [v for v in values if v is not None]
    if not reached:
        return {"mean": None, "low": None, "high": None, "reached": 0, "seeds": len(values)}
    mean, low, high = mean_interval95(reached)
    return {"mean": mean, "low": low, "high": high, "reached": len(reached),
            "seeds": len(values)}


def summarize(runs: list[dict[str, Any]], levers: tuple[str, ...], price_usd_per_hour: float
              ) -> dict[str, Any]:
    workloads = sorted({r["workload"] for r in runs}, key=lambda w: [r["workload"] for r in runs
                                                                      ].index(w))
    summary: dict[str, Any] = {}
    for workload in workloads:
        per_lever = {lever: seed_ratios(runs, workload, lever) for lever in levers}
        rows = {}
        for lever, seeds in per_lever.items():
            cpu = [s["cpu_s"] for s in seeds.values()]
            rows[lever] = {
                "seeds": seeds,
                "cpu_ratio": _interval([s["cpu_ratio"] for s in seeds.values()]),
                "samples_ratio": _interval([s["samples_ratio"] for s in seeds.values()]),
                "cpu_s": _interval(cpu),
                "usd": _interval([None if c is None else c * price_usd_per_hour / 3600
                                  for c in cpu]),
                "samples": _interval([s["samples"] for s in seeds.values()]),
                "final_eval_loss": _interval([s["final_eval_loss"] for s in seeds.values()]),
            }
        rows["default"] = default_rows(per_lever, levers)
        verdicts = [judge_from_calibration(lever, [s["cpu_ratio"] for s in per_lever[lever]
                                                   .values()])
                    for lever in levers if lever != "fixed"]
        summary[workload] = {"levers": rows,
                             "guard_all_seeds": [v.__dict__ for v in verdicts]}
    return summary


def default_rows(per_lever: dict[str, dict[int, dict[str, Any]]], levers: tuple[str, ...]
                 ) -> dict[str, Any]:
    """Leave-one-out: each seed's default is judged on the other seeds' runs."""
    seeds = sorted(per_lever["fixed"])
    chosen, cpu, samples = {}, [], []
    for seed in seeds:
        verdicts = [judge_from_calibration(lever, [row["cpu_ratio"] for s, row in
                                                   per_lever[lever].items() if s != seed])
                    for lever in levers if lever != "fixed"]
        picked = default_levers(verdicts)
        lever = picked[0] if picked else "fixed"
        row = per_lever[lever][seed]
        chosen[seed] = {"lever": lever,
                        "reasons": {v.lever: v.reason for v in verdicts}}
        cpu.append(row["cpu_ratio"])
        samples.append(row["samples_ratio"])
    return {"chosen": chosen, "cpu_ratio": _interval(cpu), "samples_ratio": _interval(samples)}


def fmt_interval(value: dict[str, Any], digits: int = 3) -> str:
    if value["mean"] is None:
        return f"never reached (0/{value['seeds']})"
    text = f"{value['mean']:.{digits}f} [{value['low']:.{digits}f}, {value['high']:.{digits}f}]"
    if value["reached"] < value["seeds"]:
        text += f" ({value['reached']}/{value['seeds']} reached)"
    return text


def render_table(rows: dict[str, Any]) -> str:
    lines = ["| setting | CPU-s to target (ratio to fixed) | samples to target (ratio) | "
             "CPU-s to target | USD to target | final eval loss |",
             "|---|---|---|---|---|---|"]
    for lever, row in rows.items():
        if lever == "default":
            picks = ", ".join(f"s{s}: {c['lever']}" for s, c in row["chosen"].items())
            lines.append(f"| **default** (guard, leave-one-out: {picks}) | "
                         f"{fmt_interval(row['cpu_ratio'])} | "
                         f"{fmt_interval(row['samples_ratio'])} | | | |")
            continue
        if not row["seeds"]:  # a lever not run on this workload (a partial --reuse)
            lines.append(f"| {lever} | not run | | | | |")
            continue
        lines.append(f"| {lever} | {fmt_interval(row['cpu_ratio'])} | "
                     f"{fmt_interval(row['samples_ratio'])} | {fmt_interval(row['cpu_s'], 1)} | "
                     f"{fmt_interval(row['usd'], 6)} | "
                     f"{fmt_interval(row['final_eval_loss'], 4)} |")
    return "\n".join(lines)


def plot(runs: list[dict[str, Any]], path: Path) -> Path | None:
    """Eval loss against CPU-seconds (top) and samples (bottom), one column per workload."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    workloads = list(dict.fromkeys(r["workload"] for r in runs))
    levers = list(dict.fromkeys(r["lever"] for r in runs))
    fig, axes = plt.subplots(2, len(workloads), figsize=(5 * len(workloads), 7), squeeze=False)
    colors = dict(zip(levers, plt.rcParams["axes.prop_cycle"].by_key()["color"], strict=False))
    for col, workload in enumerate(workloads):
        for run in (r for r in runs if r["workload"] == workload):
            curve = run["eval_curve"]
            label = run["lever"] if run["seed"] == min(r["seed"] for r in runs) else None
            for row, x in ((0, 2), (1, 1)):
                axes[row][col].plot([c[x] for c in curve], [c[3] for c in curve],
                                    color=colors[run["lever"]], alpha=0.7, label=label)
        axes[0][col].set_title(workload)
        axes[0][col].set_xlabel("train-step CPU-seconds")
        axes[1][col].set_xlabel("samples")
        for row in (0, 1):
            axes[row][col].set_ylabel("eval loss")
            losses = [c[3] for r in runs if r["workload"] == workload for c in r["eval_curve"]]
            finals = [r["final_eval_loss"] for r in runs if r["workload"] == workload]
            if losses and all(math.isfinite(v) for v in finals):
                low = min(finals)
                axes[row][col].set_ylim(low - 0.05 * abs(low), low + 4 * (max(finals) - low)
                                        + 0.15 * abs(low))
        axes[0][col].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path
