"""Turn suite outcomes into out-of-sample figures, markdown tables and the cost-vs-slack plot.

Headline cells are one protocol x setting x kind x collection x instance type (one price, so a
ratio of means is not dominated by a pricier type); every figure carries its window count, its
independent-window count and a block-bootstrap 95% interval (`stats.py`). Synthetic markets get
rows of their own, marked, never pooled with recorded ones.
"""

from __future__ import annotations

import math
import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks.cost.stats import block_bootstrap, independent_windows, robustness, time_blocks
from benchmarks.cost.suite import ScenarioOutcome
from benchmarks.results_io import current_umask
from cloud.scenario_protocol import LOCO, LTO

ORACLE = "oracle"
TRAINWISE = "trainwise_heuristic"
LEARNED = "trainwise_learned"
BASELINE = "uniform_progress"
ON_DEMAND = "on_demand"


def _finite(value: float) -> float | None:
    return value if math.isfinite(value) else None


def _grouped(outcomes: list[ScenarioOutcome], key: Callable[[ScenarioOutcome], tuple]
             ) -> dict[tuple, list[ScenarioOutcome]]:
    groups: dict[tuple, list[ScenarioOutcome]] = {}
    for outcome in outcomes:
        groups.setdefault(key(outcome), []).append(outcome)
    return dict(sorted(groups.items(), key=lambda kv: tuple(map(str, kv[0]))))


def cell_key(o: ScenarioOutcome) -> tuple[str, str, str, str, str]:
    """A headline cell: one protocol, setting, kind, collection and instance type (one price)."""
    s = o.scenario
    return (s.protocol, s.setting.name, s.kind, s.folder, s.instance_type)


def window_blocks(group: list[ScenarioOutcome]) -> tuple[np.ndarray, int]:
    """(bootstrap block per window, independent windows) of a group; see stats.py."""
    collections = [o.scenario.source_folder or o.scenario.folder for o in group]
    starts = [o.scenario.start_tick for o in group]
    lengths = [max(1, o.scenario.window_ticks) for o in group]
    blocks = time_blocks(collections, starts, lengths)
    independent = 0
    for collection in dict.fromkeys(collections):
        mine = [i for i, c in enumerate(collections) if c == collection]
        independent += independent_windows([starts[i] for i in mine], lengths[mine[0]])
    return blocks, independent


def _costs(group: list[ScenarioOutcome], name: str) -> np.ndarray:
    return np.array([o.results[name]["cost_usd"] for o in group])


def goal_for(setting: str, kind: str, synthetic: bool) -> str:
    """Issue 9's goal for a cell, in words (evaluated by `goal_met`)."""
    if synthetic:
        return "none (synthetic)"
    if setting == "single_node":
        return ("/oracle <= 1.03 and /uniform_progress < 1" if kind == "single_zone"
                else "/oracle <= 1.02 and /uniform_progress < 1")
    gang = "/uniform_progress upper < 1, costlier than on-demand <= 1%"
    return gang if kind == "single_zone" else "/oracle <= 1.02, " + gang


def goal_met(row: dict[str, Any]) -> bool | None:
    if row["synthetic"]:
        return None
    ok = row["deadline_misses"] == 0
    vs_up, vs_oracle = row["vs_uniform_progress"], row["vs_oracle"]
    if row["setting"] == "single_node":
        limit = 1.03 if row["kind"] == "single_zone" else 1.02
        return bool(ok and vs_oracle["value"] <= limit and vs_up["value"] < 1.0)
    upper = vs_up["high"] if vs_up["high"] is not None else vs_up["value"]
    ok = ok and upper < 1.0 and (row["costlier_than_on_demand_share"] or 0.0) <= 0.01
    if row["kind"] == "multi_zone":
        ok = ok and vs_oracle["value"] <= 1.02
    return bool(ok)


def headline_rows(outcomes: list[ScenarioOutcome]) -> list[dict[str, Any]]:
    """trainwise_heuristic per cell: mean cost and its ratios of means to uniform_progress and to
    the deadline-met oracle on the same windows, each with a block-bootstrap 95% interval.
    Empty when trainwise_heuristic or uniform_progress did not run."""
    rows = []
    for (protocol, setting, kind, folder, instance_type), group in _grouped(
            outcomes, cell_key).items():
        if any(TRAINWISE not in o.results or BASELINE not in o.results for o in group):
            return []
        blocks, independent = window_blocks(group)
        tw, up = _costs(group, TRAINWISE), _costs(group, BASELINE)
        oracle = np.array([o.oracle_met_usd for o in group])
        finite = np.isfinite(oracle)
        met = np.array([o.results[TRAINWISE]["deadline_met"] for o in group])
        costlier = None
        if all(ON_DEMAND in o.results for o in group):
            costlier = robustness(tw, _costs(group, ON_DEMAND), met)[
                "costlier_than_on_demand_share"]
        row = {
            "protocol": protocol, "setting": setting, "kind": kind, "collection": folder,
            "instance_type": instance_type,
            "synthetic": group[0].scenario.setting.synthetic,
            "windows": len(group), "independent_windows": independent,
            "trainwise_mean_usd": block_bootstrap(tw, None, blocks).as_dict(),
            "vs_uniform_progress": block_bootstrap(tw, up, blocks).as_dict(),
            "vs_oracle": block_bootstrap(tw[finite], oracle[finite], blocks[finite]).as_dict(),
            "oracle_vs_uniform_progress": float(oracle[finite].sum() / up[finite].sum()),
            "deadline_misses": int((~met).sum()),
            "costlier_than_on_demand_share": costlier,
        }
        row["goal"] = goal_for(setting, kind, row["synthetic"])
        row["goal_met"] = goal_met(row)
        rows.append(row)
    return rows


def learned_goal(setting: str, synthetic: bool) -> str:
    """Issue 14's goal for the learned policy, out of sample."""
    if synthetic:
        return "none (synthetic)"
    return "/oracle <= 1.02" if setting == "single_node" else "/uniform_progress upper < 1"


def learned_rows(outcomes: list[ScenarioOutcome], folds: list[dict[str, Any]]
                 ) -> list[dict[str, Any]]:
    """trainwise_learned per headline cell, scored only with the policy of the cell's fold (a
    policy that never saw the cell's collection, or its later windows): mean cost and ratios of
    means to trainwise_heuristic, uniform_progress and the oracle on the same windows, with
    block-bootstrap intervals. Cells where it did not run are left out."""
    trained = {(f["protocol"], f["held_out"]): f for f in folds}
    rows = []
    for (protocol, setting, kind, folder, instance_type), group in _grouped(
            outcomes, cell_key).items():
        if any(n not in o.results for o in group for n in (LEARNED, TRAINWISE, BASELINE)):
            continue
        source = group[0].scenario.source_folder or folder
        fold = trained.get((protocol, source))
        first_start = min(o.scenario.start_tick for o in group)
        leaked = fold is not None and (
            (protocol == LOCO and source in fold["trained_on_collections"])
            or (protocol == LTO and fold["train_tick_span"].get(source, [0, 0])[1] > first_start))
        if fold is None or leaked:
            raise ValueError(f"cell {folder}/{instance_type} ({protocol}) has no fold record, or "
                             "its fold trained on it; the learned row must come from a policy "
                             "trained without the cell's collection (LOCO) or later windows (LTO)")
        blocks, independent = window_blocks(group)
        learned, heuristic = _costs(group, LEARNED), _costs(group, TRAINWISE)
        up = _costs(group, BASELINE)
        oracle = np.array([o.oracle_met_usd for o in group])
        finite = np.isfinite(oracle)
        met = np.array([o.results[LEARNED]["deadline_met"] for o in group])
        costlier = None
        if all(ON_DEMAND in o.results for o in group):
            costlier = robustness(learned, _costs(group, ON_DEMAND), met)[
                "costlier_than_on_demand_share"]
        synthetic = group[0].scenario.setting.synthetic
        row = {
            "protocol": protocol, "setting": setting, "kind": kind, "collection": folder,
            "instance_type": instance_type, "synthetic": synthetic, "held_out": True,
            "trained_on": fold["trained_on_collections"],
            "train_tick_span": fold["train_tick_span"],
            "windows": len(group), "independent_windows": independent,
            "learned_mean_usd": block_bootstrap(learned, None, blocks).as_dict(),
            "vs_heuristic": block_bootstrap(learned, heuristic, blocks).as_dict(),
            "vs_uniform_progress": block_bootstrap(learned, up, blocks).as_dict(),
            "vs_oracle": block_bootstrap(learned[finite], oracle[finite],
                                         blocks[finite]).as_dict(),
            "heuristic_vs_oracle": float(heuristic[finite].sum() / oracle[finite].sum()),
            "deadline_misses": int((~met).sum()),
            "costlier_than_on_demand_share": costlier,
            "goal": learned_goal(setting, synthetic),
        }
        if synthetic:
            row["goal_met"] = None
        elif setting == "single_node":
            row["goal_met"] = bool(row["deadline_misses"] == 0
                                   and row["vs_oracle"]["value"] <= 1.02)
        else:
            vs_up = row["vs_uniform_progress"]
            upper = vs_up["high"] if vs_up["high"] is not None else vs_up["value"]
            row["goal_met"] = bool(row["deadline_misses"] == 0 and upper < 1.0)
        rows.append(row)
    return rows


def policy_rows(outcomes: list[ScenarioOutcome], policies: tuple[str, ...]
                ) -> list[dict[str, Any]]:
    """Per protocol, setting, kind and policy: mean of per-window cost / oracle (scale-free, so
    cells of different prices can share a row) with its interval, spot share, and robustness:
    worst window vs on-demand, share of windows costlier than on-demand, deadline misses."""
    rows = []
    key = lambda o: (o.scenario.protocol, o.scenario.setting.name, o.scenario.kind)  # noqa: E731
    for (protocol, setting, kind), group in _grouped(outcomes, key).items():
        blocks, independent = window_blocks(group)
        oracle = np.array([o.oracle_met_usd for o in group])
        finite = np.isfinite(oracle)
        has_on_demand = all(ON_DEMAND in o.results for o in group)
        for name in policies:
            if any(name not in o.results for o in group):
                continue  # a policy not run on these cells (e.g. no held-out fold for them)
            costs = _costs(group, name)
            met = np.array([o.results[name]["deadline_met"] for o in group])
            row = {
                "protocol": protocol, "setting": setting, "kind": kind, "policy": name,
                "synthetic": group[0].scenario.setting.synthetic,
                "windows": len(group), "independent_windows": independent,
                "vs_oracle_mean_of_ratios": block_bootstrap(
                    costs[finite] / oracle[finite], None, blocks[finite]).as_dict(),
                "spot_share": float(np.mean([o.results[name]["spot_share"] for o in group])),
                "deadline_misses": int((~met).sum()),
                "worst_vs_on_demand": None, "costlier_than_on_demand_share": None,
            }
            if has_on_demand:
                row.update(robustness(costs, _costs(group, ON_DEMAND), met))
            rows.append(row)
    return rows


def _ci(cell: dict[str, Any], digits: int = 3) -> str:
    value = f"{cell['value']:.{digits}f}"
    if cell["low"] is None:
        return f"{value} [n/a: {cell['blocks']} blocks]"
    return f"{value} [{cell['low']:.{digits}f}, {cell['high']:.{digits}f}]"


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{value:.1%}"


def headline_table(rows: list[dict[str, Any]]) -> str:
    lines = [
        "| setting | kind | collection | type | windows | independent | trainwise USD [95%] | "
        "/ uniform_progress [95%] | / oracle [95%] | oracle / uniform_progress | misses | "
        "costlier than on-demand | goal | met |",
        "|---|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---|---|",
    ]
    for r in rows:
        met = "-" if r["goal_met"] is None else ("yes" if r["goal_met"] else "no")
        lines.append(
            f"| {r['setting']} | {r['kind']} | {r['collection']} | {r['instance_type']} | "
            f"{r['windows']} | {r['independent_windows']} | {_ci(r['trainwise_mean_usd'], 2)} | "
            f"{_ci(r['vs_uniform_progress'])} | {_ci(r['vs_oracle'])} | "
            f"{r['oracle_vs_uniform_progress']:.3f} | {r['deadline_misses']} | "
            f"{_pct(r['costlier_than_on_demand_share'])} | {r['goal']} | {met} |")
    return "\n".join(lines)


def _trained_on(row: dict[str, Any]) -> str:
    if row["protocol"] == LTO:
        (collection, (_, end)), = row["train_tick_span"].items()
        return f"{collection} ticks < {end}"
    return ", ".join(row["trained_on"])


def learned_table(rows: list[dict[str, Any]]) -> str:
    lines = [
        "| setting | kind | collection | type | windows | independent | trained on | "
        "learned USD [95%] | / heuristic [95%] | / uniform_progress [95%] | / oracle [95%] | "
        "heuristic / oracle | misses | costlier than on-demand | goal (issue 14) | met |",
        "|---|---|---|---|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|---|---|",
    ]
    for r in rows:
        met = "-" if r["goal_met"] is None else ("yes" if r["goal_met"] else "no")
        lines.append(
            f"| {r['setting']} | {r['kind']} | {r['collection']} | {r['instance_type']} | "
            f"{r['windows']} | {r['independent_windows']} | {_trained_on(r)} | "
            f"{_ci(r['learned_mean_usd'], 2)} | {_ci(r['vs_heuristic'])} | "
            f"{_ci(r['vs_uniform_progress'])} | {_ci(r['vs_oracle'])} | "
            f"{r['heuristic_vs_oracle']:.3f} | {r['deadline_misses']} | "
            f"{_pct(r['costlier_than_on_demand_share'])} | {r['goal']} | {met} |")
    return "\n".join(lines)


def fold_table(folds: list[dict[str, Any]]) -> str:
    lines = ["| protocol | held out | trained on (windows, tick span) | training cells | "
             "clone agreement | PPO steps | train s | policy file |",
             "|---|---|---|---:|---:|---:|---:|---|"]
    for f in folds:
        on = "; ".join(f"{k}: {f['train_windows'][k]} [{a}, {b})"
                       for k, (a, b) in f["train_tick_span"].items())
        lines.append(f"| {f['protocol']} | {f['held_out']} | {on} | {f['train_cells']} | "
                     f"{f['bc_agreement']:.3f} | {f['ppo_timesteps']:,} | "
                     f"{f['train_seconds']:.0f} | {f['policy_file']} |")
    return "\n".join(lines)


LEARNED_NOTE = """One learned slow policy per fold (`benchmarks/cost/learned.py`), each scoring
only the cells it never saw: leave-one-collection-out, a policy trained on the single-node windows
of the OTHER single-node collections (risk models inside its environment fitted without the
held-out one too); leave-time-out, a policy trained on the collection's windows that end before
the cut its scored windows start after. Behaviour clone of trainwise_heuristic, then PPO with a
small fixed budget (below); the policy scored is its pickle-free npz file read back. Ratios are of
mean costs on the same windows, with the block bootstrap of the headline."""


def policy_table(rows: list[dict[str, Any]]) -> str:
    lines = [
        "| policy | windows | independent | cost / oracle, mean of ratios [95%] | spot share | "
        "worst window / on-demand | costlier than on-demand | deadline misses |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        worst = "-" if r["worst_vs_on_demand"] is None else f"{r['worst_vs_on_demand']:.3f}"
        lines.append(
            f"| {r['policy']} | {r['windows']} | {r['independent_windows']} | "
            f"{_ci(r['vs_oracle_mean_of_ratios'])} | {_pct(r['spot_share'])} | {worst} | "
            f"{_pct(r['costlier_than_on_demand_share'])} | {r['deadline_misses']} |")
    return "\n".join(lines)


PROTOCOL_TITLES = {
    LOCO: "leave-one-collection-out (risk model fitted on the other collections only)",
    LTO: "leave-time-out (risk model fitted on the first half of the same collection; windows "
         "start in the second half)",
}


def render_markdown(payload: dict[str, Any], policies: tuple[str, ...]) -> str:
    heads, prows = payload["headline"], payload["policy_rows"]
    titles = {s["name"]: s["title"] for s in payload["settings"]}
    parts = ["# Cost suite: out-of-sample cost of every policy against the hindsight oracle",
             "", payload["notes"]]
    for protocol in (LOCO, LTO):
        real = [r for r in heads if r["protocol"] == protocol and not r["synthetic"]]
        if real:
            parts += ["", f"## Headline, {PROTOCOL_TITLES[protocol]}", "",
                      headline_table(real)]
    for protocol in (LOCO, LTO):
        for setting in payload["settings"]:
            if setting["synthetic"]:
                continue
            for kind in ("single_zone", "multi_zone"):
                mine = [r for r in prows if (r["protocol"], r["setting"], r["kind"])
                        == (protocol, setting["name"], kind)]
                if mine:
                    parts += ["", f"### Every policy, {protocol}: {titles[setting['name']]} - "
                              f"{kind.replace('_', '-')}", "", policy_table(mine)]
    learned = payload.get("learned")
    if learned and learned.get("rows"):
        budget = learned["budget"]
        parts += ["", "## trainwise_learned, held-out cells only (issue 14)", "", LEARNED_NOTE,
                  "", f"Budget per fold: behaviour clone on {budget['bc_states']:,} heuristic "
                  f"states, then {budget['ppo_timesteps']:,} PPO steps ({budget['n_envs']} "
                  f"environments), seed {budget['seed']}."]
        for protocol in (LOCO, LTO):
            real = [r for r in learned["rows"] if r["protocol"] == protocol and not r["synthetic"]]
            if real:
                parts += ["", f"### trainwise_learned, {PROTOCOL_TITLES[protocol]}", "",
                          learned_table(real)]
        parts += ["", "### What each learned policy was trained on", "",
                  fold_table(learned["folds"])]
    synthetic = [r for r in heads if r["synthetic"]]
    if synthetic:
        parts += ["", "## SYNTHETIC market (not a headline, never pooled with a real one)", "",
                  "Built from shifted copies of the 4-node trace; leave-one-collection-out only "
                  "(a time split of a shifted-copy market would leak).", "",
                  headline_table(synthetic)]
        synthetic_learned = [r for r in (learned or {}).get("rows", []) if r["synthetic"]]
        if synthetic_learned:
            parts += ["", "trainwise_learned on the SYNTHETIC market (held out):", "",
                      learned_table(synthetic_learned)]
        for r in synthetic:
            mine = [p for p in prows if (p["protocol"], p["setting"], p["kind"])
                    == (r["protocol"], r["setting"], r["kind"])]
            parts += ["", f"### Every policy, SYNTHETIC {r['setting']} - {r['kind']}", "",
                      policy_table(mine)]
    parts += short_jobs_markdown(payload.get("short_jobs"))
    parts += [] if not payload["sweep"] else [
        "", "## Cost vs deadline slack (leave-one-collection-out)", "",
        f"Single-node job, single-zone, folder {payload['sweep_folder']} "
        "(plot: `cost_vs_slack.png`); mean USD per job.", "",
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
                + ("" if cells[n]["deadlines_met"] == 1.0
                   else f" ({cells[n]['deadlines_met']:.0%} met)")
                for n in [ORACLE, *policies])
            + " |")
    skipped = payload.get("skipped") or []
    if skipped:
        parts += ["", "## Not scored", "",
                  "Collections left out of a setting (too short for its window, or too small "
                  "for the gang asked for); every other cell above was scored.", ""]
        parts += [f"- {cell['reason']}" for cell in skipped]
    selection = payload.get("selection") or {}
    if any(selection.values()):
        parts += ["", "Chosen on the command line: " + "; ".join(
            f"{key} {', '.join(value) if isinstance(value, (list, tuple)) else value}"
            for key, value in selection.items() if value) + "."]
    timing = payload["timing"]
    parts += [
        "", "## Timing", "",
        f"Suite wall time: {timing['suite_wall_s']:.1f} s. Replaying the whole 45-day trace "
        "(20,158 ticks, one zone) for one policy: "
        + ", ".join(f"{k} {v * 1000:.0f} ms" for k, v in timing["full_trace_s"].items()) + ".",
        "", f"Oracle violations (a policy cheaper than its bound): "
        f"{len(payload['oracle_violations'])}.",
    ]
    return "\n".join(parts) + "\n"


def short_jobs_markdown(short: dict[str, Any] | None) -> list[str]:
    """The short gang job's section: per cell as in the headline (not counted in it), then every
    policy per protocol and kind."""
    if not short or not short["headline"]:
        return []
    parts = ["", "## Short gang job: issue 9's thin-slack case (not in the headline count)", "",
             "; ".join(s["title"] for s in short["settings"]) + f". Start windows per zone: "
             f"{short['windows_per_zone']}. The gang goal applies: below Uniform Progress "
             "(upper end included), costlier than on-demand in at most 1% of windows. The "
             "learned policy is not run (it is trained on 48 h single-node windows)."]
    for protocol in (LOCO, LTO):
        cells = [r for r in short["headline"] if r["protocol"] == protocol]
        if cells:
            parts += ["", f"### Short gang job, {PROTOCOL_TITLES[protocol]}", "",
                      headline_table(cells)]
        for kind in ("single_zone", "multi_zone"):
            mine = [r for r in short["policy_rows"]
                    if (r["protocol"], r["kind"]) == (protocol, kind)]
            if mine:
                parts += ["", f"### Every policy, short gang job, {protocol} - "
                          f"{kind.replace('_', '-')}", "", policy_table(mine)]
    return parts


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
            "protocol": o.scenario.protocol,
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
