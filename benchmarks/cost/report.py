"""Turn suite outcomes into per-policy figures, markdown tables and the cost-vs-slack plot."""

from __future__ import annotations

import math
import os
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks.cost.suite import ScenarioOutcome
from benchmarks.results_io import current_umask

ORACLE = "oracle"


def _finite(value: float) -> float | None:
    return value if math.isfinite(value) else None


def summarize(outcomes: list[ScenarioOutcome], policies: tuple[str, ...]) -> list[dict[str, Any]]:
    """Per (setting, kind, policy): cost mean/median/p90, mean cost relative to the deadline-met
    oracle, share of deadlines met, spot share, waste share, utilization; plus an oracle row."""
    rows: list[dict[str, Any]] = []
    keys = sorted({(o.scenario.setting.name, o.scenario.kind) for o in outcomes})
    for setting, kind in keys:
        group = [
            o for o in outcomes if (o.scenario.setting.name, o.scenario.kind) == (setting, kind)
        ]
        oracle = np.array([o.oracle_met_usd for o in group])
        rows.append(_row(setting, kind, ORACLE, oracle, oracle, None))
        for name in policies:
            costs = np.array([o.results[name]["cost_usd"] for o in group])
            rows.append(_row(setting, kind, name, costs, oracle, [o.results[name] for o in group]))
    return rows


def _row(
    setting: str,
    kind: str,
    name: str,
    costs: np.ndarray,
    oracle: np.ndarray,
    results: list[dict[str, Any]] | None,
) -> dict[str, Any]:
    def mean_of(key: str) -> float | None:
        return None if results is None else float(np.mean([r[key] for r in results]))

    return {
        "setting": setting,
        "kind": kind,
        "policy": name,
        "scenarios": int(costs.size),
        "mean_usd": float(costs.mean()),
        "median_usd": float(np.median(costs)),
        "p90_usd": float(np.percentile(costs, 90)),
        "vs_oracle_mean": float(np.mean(costs / oracle)),
        "deadlines_met": 1.0 if results is None else mean_of("deadline_met"),
        "spot_share": mean_of("spot_share"),
        "waste_share": mean_of("waste_share"),
        "utilization": mean_of("utilization"),
    }


def by_folder(outcomes: list[ScenarioOutcome], policies: tuple[str, ...]) -> list[dict[str, Any]]:
    """Mean cost relative to the oracle and deadlines met, per setting, kind, folder and policy."""
    rows = []
    keys = sorted({(o.scenario.setting.name, o.scenario.kind, o.scenario.folder) for o in outcomes})
    for setting, kind, folder in keys:
        group = [
            o
            for o in outcomes
            if (o.scenario.setting.name, o.scenario.kind, o.scenario.folder)
            == (setting, kind, folder)
        ]
        oracle = np.array([o.oracle_met_usd for o in group])
        for name in policies:
            costs = np.array([o.results[name]["cost_usd"] for o in group])
            met = np.mean([o.results[name]["deadline_met"] for o in group])
            rows.append(
                {
                    "setting": setting,
                    "kind": kind,
                    "folder": folder,
                    "policy": name,
                    "scenarios": len(group),
                    "mean_usd": float(costs.mean()),
                    "oracle_mean_usd": float(oracle.mean()),
                    "vs_oracle_mean": float(np.mean(costs / oracle)),
                    "deadlines_met": float(met),
                }
            )
    return rows


TRAINWISE = "trainwise_heuristic"
BASELINE = "uniform_progress"


def trainwise_goals(outcomes: list[ScenarioOutcome]) -> list[dict[str, Any]]:
    """trainwise_heuristic against issue 4's goals per setting, kind and folder, all deadlines
    met: single-zone, mean cost at least 10% under uniform_progress on the same windows;
    multi-zone, mean cost / oracle at most 1.10. Also the oracle's own ratio to uniform_progress
    (the best any policy could reach). Empty when either policy did not run."""
    rows = []
    keys = sorted({(o.scenario.setting.name, o.scenario.kind, o.scenario.folder) for o in outcomes})
    for setting, kind, folder in keys:
        group = [
            o for o in outcomes
            if (o.scenario.setting.name, o.scenario.kind, o.scenario.folder)
            == (setting, kind, folder)
        ]
        if any(TRAINWISE not in o.results or BASELINE not in o.results for o in group):
            return []
        tw = np.array([o.results[TRAINWISE]["cost_usd"] for o in group])
        up = np.array([o.results[BASELINE]["cost_usd"] for o in group])
        oracle = np.array([o.oracle_met_usd for o in group])
        met = float(np.mean([o.results[TRAINWISE]["deadline_met"] for o in group]))
        vs_up = float(tw.mean() / up.mean())
        vs_oracle = float(np.mean(tw / oracle))
        goal = vs_up <= 0.90 if kind == "single_zone" else vs_oracle <= 1.10
        rows.append({
            "setting": setting, "kind": kind, "folder": folder, "scenarios": len(group),
            "trainwise_mean_usd": float(tw.mean()), "uniform_progress_mean_usd": float(up.mean()),
            "oracle_mean_usd": float(oracle.mean()), "vs_uniform_progress": vs_up,
            "vs_uniform_progress_mean_ratio": float(np.mean(tw / up)),
            "oracle_vs_uniform_progress": float(oracle.mean() / up.mean()),
            "vs_oracle_mean": vs_oracle, "deadlines_met": met,
            "goal": "cost <= 0.90 x uniform_progress" if kind == "single_zone"
            else "cost / oracle <= 1.10",
            "goal_met": bool(goal and met == 1.0),
        })
    return rows


def goals_table(rows: list[dict[str, Any]]) -> str:
    lines = [
        "| setting | kind | folder | scenarios | trainwise USD | vs uniform_progress (ratio of "
        "means; mean of ratios) | oracle vs uniform_progress | vs oracle | deadlines met | goal "
        "| met |",
        "|---|---|---|---:|---:|---:|---:|---:|---:|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['setting']} | {r['kind']} | {r['folder']} | {r['scenarios']} | "
            f"{r['trainwise_mean_usd']:.2f} | {r['vs_uniform_progress']:.3f}; "
            f"{r['vs_uniform_progress_mean_ratio']:.3f} | {r['oracle_vs_uniform_progress']:.3f} | "
            f"{r['vs_oracle_mean']:.3f} | {r['deadlines_met']:.0%} | {r['goal']} | "
            f"{'yes' if r['goal_met'] else 'no'} |"
        )
    return "\n".join(lines)


def sweep_points(
    outcomes: list[ScenarioOutcome], policies: tuple[str, ...], train_h: float
) -> list[dict]:
    """Mean cost per policy (and oracle) per deadline: the cost-vs-slack curve."""
    points = []
    for deadline_h in sorted({o.scenario.deadline_h for o in outcomes}):
        group = [o for o in outcomes if o.scenario.deadline_h == deadline_h]
        slack = (deadline_h - train_h) / train_h
        points.append(
            {
                "deadline_h": deadline_h,
                "slack": slack,
                "policy": ORACLE,
                "mean_usd": float(np.mean([o.oracle_met_usd for o in group])),
                "deadlines_met": 1.0,
                "scenarios": len(group),
            }
        )
        for name in policies:
            points.append(
                {
                    "deadline_h": deadline_h,
                    "slack": slack,
                    "policy": name,
                    "mean_usd": float(np.mean([o.results[name]["cost_usd"] for o in group])),
                    "deadlines_met": float(
                        np.mean([o.results[name]["deadline_met"] for o in group])
                    ),
                    "scenarios": len(group),
                }
            )
    return points


def up_vs_greedy(summary: list[dict[str, Any]]) -> list[str]:
    """One sentence per (setting, kind): does uniform_progress beat greedy_spot at 100% met?"""
    lines = []
    for setting, kind in sorted({(r["setting"], r["kind"]) for r in summary}):
        rows = {r["policy"]: r for r in summary if (r["setting"], r["kind"]) == (setting, kind)}
        up, greedy = rows.get("uniform_progress"), rows.get("greedy_spot")
        if not up or not greedy:
            continue
        both_met = up["deadlines_met"] == 1.0 and greedy["deadlines_met"] == 1.0
        saving = 1.0 - up["mean_usd"] / greedy["mean_usd"]
        verdict = "beats" if saving > 0 else "does not beat"
        met_note = (
            "both meet 100% of deadlines"
            if both_met
            else f"deadlines met: uniform_progress {up['deadlines_met']:.1%}, "
            f"greedy_spot {greedy['deadlines_met']:.1%}"
        )
        lines.append(
            f"- {setting} / {kind}: uniform_progress {verdict} greedy_spot "
            f"({up['mean_usd']:.2f} vs {greedy['mean_usd']:.2f} USD mean, "
            f"{saving:+.1%}); {met_note}."
        )
    return lines


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{value:.1%}"


def summary_table(summary: list[dict[str, Any]], setting: str, kind: str) -> str:
    lines = [
        (
            "| policy | mean USD | median USD | p90 USD | vs oracle | deadlines met | spot share | "
            "waste share | utilization |"
        ),
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in summary:
        if (r["setting"], r["kind"]) != (setting, kind):
            continue
        lines.append(
            f"| {r['policy']} | {r['mean_usd']:.2f} | {r['median_usd']:.2f} | {r['p90_usd']:.2f} | "
            f"{r['vs_oracle_mean']:.3f} | {_pct(r['deadlines_met'])} | {_pct(r['spot_share'])} | "
            f"{_pct(r['waste_share'])} | {_pct(r['utilization'])} |"
        )
    return "\n".join(lines)


def folder_table(
    rows: list[dict[str, Any]], setting: str, kind: str, policies: tuple[str, ...]
) -> str:
    folders = sorted({r["folder"] for r in rows if (r["setting"], r["kind"]) == (setting, kind)})
    header = "| folder | scenarios | oracle USD | " + " | ".join(policies) + " |"
    lines = [header, "|---|---:|---:|" + "---:|" * len(policies)]
    for folder in folders:
        cells = {
            r["policy"]: r
            for r in rows
            if (r["setting"], r["kind"], r["folder"]) == (setting, kind, folder)
        }
        first = next(iter(cells.values()))
        lines.append(
            f"| {folder} | {first['scenarios']} | {first['oracle_mean_usd']:.2f} | "
            + " | ".join(
                f"{cells[p]['vs_oracle_mean']:.3f} ({cells[p]['deadlines_met']:.0%})"
                for p in policies
            )
            + " |"
        )
    return "\n".join(lines)


def render_markdown(payload: dict[str, Any], policies: tuple[str, ...]) -> str:
    summary = payload["summary"]
    parts = ["# Cost suite: peers vs the hindsight oracle on real spot traces", ""]
    parts.append(payload["notes"])
    for setting in payload["settings"]:
        for kind in ("single_zone", "multi_zone"):
            if not any((r["setting"], r["kind"]) == (setting["name"], kind) for r in summary):
                continue
            parts += [
                "",
                f"## {setting['title']} - {kind.replace('_', '-')}",
                "",
                summary_table(summary, setting["name"], kind),
                "",
                "Per folder: mean cost relative to the oracle (deadlines met):",
                "",
                folder_table(payload["by_folder"], setting["name"], kind, policies),
            ]
    if payload.get("trainwise_goals"):
        parts += [
            "",
            "## trainwise_heuristic against its goals, per trace folder",
            "",
            payload.get("trainwise_notes", ""),
            "",
            goals_table(payload["trainwise_goals"]),
        ]
    parts += ["", "## Does uniform_progress beat greedy_spot at 100% deadlines met?", ""]
    parts += payload["up_vs_greedy"]
    parts += [
        "",
        "## Cost vs deadline slack",
        "",
        (
            f"Single-node job, single-zone, folder {payload['sweep_folder']} "
            "(plot: `cost_vs_slack.png`)."
        ),
        "",
        "| deadline h | slack | " + " | ".join([ORACLE, *policies]) + " |",
        "|---:|---:|" + "---:|" * (len(policies) + 1),
    ]
    for deadline_h in sorted({p["deadline_h"] for p in payload["sweep"]}):
        cells = {p["policy"]: p for p in payload["sweep"] if p["deadline_h"] == deadline_h}
        slack = next(iter(cells.values()))["slack"]
        parts.append(
            f"| {deadline_h:g} | {slack:.1%} | "
            + " | ".join(
                f"{cells[n]['mean_usd']:.2f}"
                + (
                    ""
                    if cells[n]["deadlines_met"] == 1.0
                    else f" ({cells[n]['deadlines_met']:.0%} met)"
                )
                for n in [ORACLE, *policies]
            )
            + " |"
        )
    timing = payload["timing"]
    parts += [
        "",
        "## Timing",
        "",
        f"Suite wall time: {timing['suite_wall_s']:.1f} s. Replaying the whole 45-day trace "
        "(20,158 ticks, one zone) for one policy: "
        + ", ".join(f"{k} {v * 1000:.0f} ms" for k, v in timing["full_trace_s"].items())
        + ".",
    ]
    violations = payload["oracle_violations"]
    parts += ["", f"Oracle violations (a policy cheaper than its bound): {len(violations)}."]
    return "\n".join(parts) + "\n"


def plot_cost_vs_slack(points: list[dict[str, Any]], path: Path) -> None:
    """Mean cost vs deadline slack per policy, written atomically (Agg backend, no display)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(figsize=(7, 4.5))
    for name in dict.fromkeys(p["policy"] for p in points):
        mine = sorted((p for p in points if p["policy"] == name), key=lambda p: p["slack"])
        style = (
            {"color": "black", "linestyle": "--", "linewidth": 2}
            if name == ORACLE
            else {"marker": "o"}
        )
        (line,) = axes.plot(
            [100 * p["slack"] for p in mine], [p["mean_usd"] for p in mine], label=name, **style
        )
        # Hollow markers: points where the policy missed some deadlines (not the same job done).
        missed = [p for p in mine if p["deadlines_met"] < 1.0]
        if missed and name != ORACLE:
            axes.plot(
                [100 * p["slack"] for p in missed],
                [p["mean_usd"] for p in missed],
                "o",
                markersize=9,
                markerfacecolor="white",
                markeredgecolor=line.get_color(),
            )
    axes.set_xlabel("deadline slack (% of the training time); hollow = some deadlines missed")
    axes.set_ylabel("mean cost per job (USD)")
    axes.set_title("Single-node job, single-zone windows: cost vs slack")
    axes.grid(alpha=0.3)
    axes.legend(fontsize=8)
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    handle, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".png")
    os.fchmod(handle, 0o666 & ~current_umask())
    os.close(handle)
    try:
        figure.savefig(tmp, dpi=120)
        with open(tmp, "rb") as written:
            os.fsync(written.fileno())
        os.replace(tmp, path)
    finally:
        plt.close(figure)
        if os.path.exists(tmp):
            os.unlink(tmp)


def _rounded(row: dict[str, Any]) -> dict[str, Any]:
    """Four decimals are plenty for USD and shares, and keep cost.json small enough for git."""
    return {k: round(v, 4) if isinstance(v, float) else v for k, v in row.items()}


def scenario_records(outcomes: list[ScenarioOutcome]) -> list[dict[str, Any]]:
    return [
        {
            "setting": o.scenario.setting.name,
            "kind": o.scenario.kind,
            "folder": o.scenario.folder,
            "instance_type": o.scenario.instance_type,
            "zones": list(o.scenario.market.zones),
            "home_zone": o.scenario.home_zone,
            "start_tick": o.scenario.start_tick,
            "deadline_h": o.scenario.deadline_h,
            "oracle_met_usd": _finite(o.oracle_met_usd),
            "oracle_any_usd": _finite(o.oracle_any_usd),
            "results": {name: _rounded(row) for name, row in o.results.items()},
        }
        for o in outcomes
    ]
