"""Figures of the data suite: per-method summaries, the markdown table, the plot, calibration."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks.data.suite import METHODS

CALIBRATION_FORMAT = "trainwise.pruning_calibration/1"
CALIBRATION_METHOD = "trainwise"
LOSS_TOLERANCE = 0.01  # the quality bar: final eval loss within 1% of full data's
ACCURACY_TOLERANCE = 0.003  # and accuracy within 0.3 points


def _mean_std(values: list[float]) -> tuple[float | None, float | None]:
    values = [v for v in values if v is not None]
    if not values:
        return None, None
    return float(np.mean(values)), float(np.std(values, ddof=1)) if len(values) > 1 else 0.0


def first_reach(curve: list[list], target: float) -> tuple[int | None, int | None]:
    """(sample passes, tokens) at the first evaluation with loss <= target, else (None, None)."""
    for _, samples, tokens, loss, _ in curve:
        if loss <= target:
            return samples, tokens
    return None, None


def summarize(results: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per (dataset, method): means and standard deviations over seeds.

    Target of a seed: the final eval loss of the full-data run with the same seed.
    `budget_fraction`: sample passes to first reach it / the full-data budget. `reach_vs_full`:
    sample passes to first reach it / the sample passes the full-data run itself needed to first
    reach it (robust to a budget longer than the model needs, where every run touches the
    target early). A seed that never reaches the target counts 1.0 in both (no saving).
    `same_quality_fraction`: the sample passes a run spent over the whole budget / the full-data
    budget, for a seed that ended within the quality bar (final eval loss within 1%, accuracy
    within 0.3 points of the same seed's full-data run), else 1.0 (no saving claimed).
    """
    full = {(r["dataset"], r["seed"]): r for r in results if r["method"] == "full"}
    rows = []
    for dataset in dict.fromkeys(r["dataset"] for r in results):
        for method in METHODS:
            runs = sorted((r for r in results if r["dataset"] == dataset and r["method"] == method),
                          key=lambda r: r["seed"])
            if not runs:
                continue
            reach_fraction, reach_samples, reach_tokens = [], [], []
            budget_fractions, work_fractions, quality_fractions, same_passes = [], [], [], []
            for run in runs:
                baseline = full.get((dataset, run["seed"]))
                if baseline is None:
                    continue
                target = baseline["final_eval_loss"]
                samples, tokens = first_reach(run["eval_curve"], target)
                full_samples, _ = first_reach(baseline["eval_curve"], target)
                reach_samples.append(samples)
                reach_tokens.append(tokens)
                fraction = samples / baseline["budget_samples"] if samples is not None else None
                reach_fraction.append(fraction)
                budget_fractions.append(1.0 if fraction is None else fraction)
                work_fractions.append(1.0 if samples is None else samples / full_samples)
                kept = run["final_eval_loss"] <= target * (1.0 + LOSS_TOLERANCE)
                if run["final_eval_accuracy"] is not None:
                    kept = kept and (run["final_eval_accuracy"]
                                     >= baseline["final_eval_accuracy"] - ACCURACY_TOLERANCE)
                quality_fractions.append(run["samples"] / baseline["budget_samples"]
                                         if kept else 1.0)
                # Data efficiency per pass: this run's final loss against the full-data run's
                # loss after as many sample passes (its curve interpolated there).
                full_curve = np.array([[p[1], p[3]] for p in baseline["eval_curve"]])
                at_same = float(np.interp(run["samples"], full_curve[:, 0], full_curve[:, 1]))
                same_passes.append(run["final_eval_loss"] / at_same - 1.0)
            pruned_epochs = [e for r in runs for e in r["epochs"] if e["skipped_count"]]
            row = {
                "dataset": dataset, "method": method, "seeds": [r["seed"] for r in runs],
                "run_ids": [r["run_id"] for r in runs],
                "budget_samples": runs[0]["budget_samples"],
                "reached": sum(f is not None for f in reach_fraction),
                "reach_samples": reach_samples, "reach_tokens": reach_tokens,
                "reach_fraction": reach_fraction,
            }
            for name, values in (
                ("samples", [r["samples"] for r in runs]),
                ("tokens", [r["tokens"] for r in runs]),
                ("samples_share", [r["samples"] / r["budget_samples"] for r in runs]),
                ("final_eval_loss", [r["final_eval_loss"] for r in runs]),
                ("final_eval_accuracy", [r["final_eval_accuracy"] for r in runs]),
                ("min_eval_loss", [min(p[3] for p in r["eval_curve"]) for r in runs]),
                ("wall_s", [r["wall_s"] for r in runs]),
                ("overhead_share", [r["overhead_share"] for r in runs]),
                ("budget_fraction", budget_fractions),
                ("reach_vs_full", work_fractions),
                ("same_quality_fraction", quality_fractions),
                ("loss_vs_full_same_passes", same_passes),
                ("pruned_epoch_rate", [e["rate"] for e in pruned_epochs]),
                ("pruned_epoch_skip_share", [e["skipped_count"] / (e["kept"] + e["skipped_count"])
                                             for e in pruned_epochs]),
            ):
                row[f"{name}_mean"], row[f"{name}_std"] = _mean_std(values)
            row["pruned_epochs_per_run"] = len(pruned_epochs) / len(runs)
            row["epochs_per_run"] = (np.mean([len(r["epochs"]) for r in runs])
                                     if runs[0]["epochs"] else None)
            rows.append(row)
    _add_deltas(rows)
    return rows


def _add_deltas(rows: list[dict[str, Any]]) -> None:
    by_key = {(r["dataset"], r["method"]): r for r in rows}
    for row in rows:
        full = by_key.get((row["dataset"], "full"))
        random = by_key.get((row["dataset"], "random"))
        row["loss_vs_full_rel"] = (row["final_eval_loss_mean"] / full["final_eval_loss_mean"] - 1.0
                                   if full else None)
        row["accuracy_vs_full_points"] = (
            100.0 * (row["final_eval_accuracy_mean"] - full["final_eval_accuracy_mean"])
            if full and row["final_eval_accuracy_mean"] is not None else None)
        row["goal"] = {
            "fewer_samples_40pct": row["reach_vs_full_mean"] <= 0.6,
            "loss_within_1pct": row["loss_vs_full_rel"] is not None
            and row["loss_vs_full_rel"] <= 0.01,
            "accuracy_within_0p3": None if row["accuracy_vs_full_points"] is None
            else row["accuracy_vs_full_points"] >= -0.3,
            "beats_random": None if random is None or row["method"] in ("full", "random")
            else row["final_eval_loss_mean"] < random["final_eval_loss_mean"],
        }


def _fmt(mean: float | None, std: float | None, digits: int = 4, scale: float = 1.0) -> str:
    if mean is None:
        return "n/a"
    return f"{mean * scale:.{digits}f} ± {std * scale:.{digits}f}"


def render_table(rows: list[dict[str, Any]], dataset: str) -> str:
    lines = [("| method | sample passes (share of budget) | first reach of the full-data "
              "loss: share of budget | same, vs full data's own first reach (seeds reached) | "
              "final eval loss (vs full) | eval accuracy (vs full) | wall s | sampler overhead |"),
             "|---|---|---|---|---|---|---|---|"]
    for row in (r for r in rows if r["dataset"] == dataset):
        share = f"{row['samples_mean']:,.0f} ({row['samples_share_mean']:.1%})"
        budget = _fmt(row["budget_fraction_mean"], row["budget_fraction_std"], 3)
        reached = f"{budget} | {_fmt(row['reach_vs_full_mean'], row['reach_vs_full_std'], 3)} " \
                  f"({row['reached']}/{len(row['seeds'])})"
        loss = f"{_fmt(row['final_eval_loss_mean'], row['final_eval_loss_std'])} " \
               f"({row['loss_vs_full_rel']:+.2%})"
        if row["final_eval_accuracy_mean"] is None:
            accuracy = "n/a"
        else:
            mean = _fmt(row["final_eval_accuracy_mean"], row["final_eval_accuracy_std"], 2, 100)
            accuracy = f"{mean} % ({row['accuracy_vs_full_points']:+.2f} pts)"
        overhead = "none (plain sampler)" if row["method"] == "full" else \
            f"{row['overhead_share_mean']:.2%}"
        lines.append(f"| {row['method']} | {share} | {reached} | {loss} | {accuracy} | "
                     f"{_fmt(row['wall_s_mean'], row['wall_s_std'], 0)} | {overhead} |")
    return "\n".join(lines)


def plot_curves(results: list[dict[str, Any]], path: Path) -> None:
    """Eval loss against sample passes, every method (mean over seeds), one panel per dataset."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    datasets = list(dict.fromkeys(r["dataset"] for r in results))
    figure, axes = plt.subplots(1, len(datasets), figsize=(6.5 * len(datasets), 4.5), squeeze=False)
    for axis, dataset in zip(axes[0], datasets, strict=True):
        for method in METHODS:
            runs = [r for r in results if r["dataset"] == dataset and r["method"] == method]
            if not runs:
                continue
            # Common grid up to the shortest run; each seed's curve interpolated onto it.
            end = min(r["eval_curve"][-1][1] for r in runs)
            grid = np.unique(np.concatenate([[p[1] for p in r["eval_curve"] if p[1] <= end]
                                             for r in runs]))
            curves = [np.interp(grid, [p[1] for p in r["eval_curve"]],
                                [p[3] for p in r["eval_curve"]]) for r in runs]
            axis.plot(grid, np.mean(curves, axis=0), label=f"{method} ({len(runs)} seeds)")
        axis.set_title(dataset)
        axis.set_xlabel("sample passes (examples forward/backward)")
        axis.set_ylabel("eval loss (nats)")
        axis.set_yscale("log")
        axis.grid(alpha=0.3)
        axis.legend()
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=110)
    plt.close(figure)


def calibration(rows: list[dict[str, Any]], meta: dict[str, Any], source: str) -> dict[str, Any]:
    """The simulator's pruning calibration: per dataset, the trainwise method's work fraction."""
    datasets = {}
    for row in rows:
        if row["method"] != CALIBRATION_METHOD:
            continue
        datasets[row["dataset"]] = {
            "work_fraction": row["same_quality_fraction_mean"],
            "work_fraction_std": row["same_quality_fraction_std"],
            "first_reach_vs_full": row["reach_vs_full_mean"],
            "first_reach_vs_full_std": row["reach_vs_full_std"],
            "first_reach_of_budget": row["budget_fraction_mean"],
            "sample_passes_share_same_epochs": row["samples_share_mean"],
            "seeds": len(row["seeds"]), "seeds_reached": row["reached"],
            "per_seed_reach_fraction": row["reach_fraction"],
            "final_eval_loss_vs_full_rel": row["loss_vs_full_rel"],
            "budget_sample_passes": row["budget_samples"], "source_runs": row["run_ids"],
        }
    return {
        "format": CALIBRATION_FORMAT, "method": CALIBRATION_METHOD, "source": source,
        "command": meta.get("command"), "commit": meta.get("commit"),
        "date_utc": meta.get("date_utc"),
        "definition": "work_fraction: sample passes the trainwise run spent over the same "
                      "epochs as the full-data run, as a share of the full-data run's, for seeds "
                      "that ended at full-data quality (final eval loss within 1% and accuracy "
                      "within 0.3 points of the same seed's full-data run); a seed that did not "
                      "counts 1.0 (no saving); mean over seeds. This is the work a job running "
                      "the same schedule needs. first_reach_vs_full: sample passes to first "
                      "reach the full-data run's final eval loss over the passes the full-data "
                      "run itself needed to first reach it (never reached: 1.0). "
                      "first_reach_of_budget: the same numerator over the full-data budget "
                      "(misleading when the full-data run plateaus early)",
        "datasets": datasets,
    }


def finite(value: Any) -> Any:
    """NaN/inf become None for JSON."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value
