"""Run the Can't Be Late scenario over the reference windows and compare window by window."""

from __future__ import annotations

from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import numpy as np

from benchmarks.cant_be_late import scenario as S
from cloud.oracle import hindsight_optimum
from cloud.policy_registry import make_policy
from cloud.simulator import simulate

POLICIES = tuple(S.STRATEGIES.values())
# Work levels for the oracle: gcd(tick, changeover) = 15 s (195 s ticks) and 8 s (32 s ticks)
# give 11,520 and 21,600 levels; this cap keeps the grid exact for both.
EXACT_LEVELS = 100_000
POLICY_TOLERANCE = 0.01
ORACLE_TOLERANCE = 0.005


def _zone_windows(args: tuple[str, str, list[int], Path | None]) -> list[dict]:
    folder, stem, offsets, spot_dir = args
    market = S.markets(folder, spot_dir)[stem]
    ticks, rules = S.deadline_ticks(market), S.rules()
    rows = []
    for offset in offsets:
        window = market.window(offset, ticks)
        row = {"folder": folder, "zone": stem, "offset": offset}
        for name in POLICIES:
            result = simulate(make_policy(name), S.JOB, rules, window)
            row[name] = result.cost_usd
            row[f"{name}_met"] = result.deadline_met
        row["oracle"] = hindsight_optimum(S.JOB, rules, window, EXACT_LEVELS).cost_deadline_met_usd
        rows.append(row)
    return rows


def _multi_windows(args: tuple[str, list[int], Path | None]) -> list[dict]:
    folder, offsets, spot_dir = args
    market = S.markets(folder, spot_dir)["*"]
    ticks, rules = S.deadline_ticks(market), S.rules()
    return [
        {"folder": folder, "offset": offset, "oracle": hindsight_optimum(
            S.JOB, rules, market.window(offset, ticks), EXACT_LEVELS).cost_deadline_met_usd}
        for offset in offsets
    ]


def run(stride: int = 1, jobs: int = 1, spot_dir: Path | None = None,
        folders: tuple[str, ...] | None = None, zones_limit: int | None = None) -> dict:
    """Rows of our costs and the reference's, every `stride`-th reference offset."""
    ref = S.load_reference(spot_dir)
    single_tasks, multi_tasks = [], []
    for folder in folders or tuple(S.COLLECTIONS.values()):
        offsets = ref.offsets(folder)[::stride]
        stems = sorted({k[1] for k in ref.single if k[0] == folder})[:zones_limit]
        single_tasks += [(folder, stem, offsets, spot_dir) for stem in stems]
        if any(k[0] == folder for k in ref.multi):
            multi_tasks.append((folder, offsets, spot_dir))
    if jobs > 1:
        with ProcessPoolExecutor(jobs) as pool:
            single = [r for rows in pool.map(_zone_windows, single_tasks) for r in rows]
            multi = [r for rows in pool.map(_multi_windows, multi_tasks) for r in rows]
    else:
        single = [r for t in single_tasks for r in _zone_windows(t)]
        multi = [r for t in multi_tasks for r in _multi_windows(t)]
    for row in single:
        key = (row["folder"], row["zone"], row["offset"])
        for name in POLICIES:
            row[f"{name}_published"] = ref.policy[(*key, name)]
        row["oracle_exact"] = ref.single[key]
    for row in multi:
        row["oracle_exact"] = ref.multi[(row["folder"], row["offset"])]
    return {"single": single, "multi": multi}


def _ratio_stats(rows: list[dict], ours: str, theirs: str, tolerance: float) -> dict:
    ratio = np.array([r[ours] / r[theirs] for r in rows])
    worst = int(np.argmax(np.abs(ratio - 1.0)))
    where = rows[worst]
    return {
        "windows": len(rows),
        "share_within": float(np.mean(np.abs(ratio - 1.0) <= tolerance)),
        "tolerance": tolerance,
        "mean_ratio": float(ratio.mean()),
        "mean_ours_usd": float(np.mean([r[ours] for r in rows])),
        "mean_published_usd": float(np.mean([r[theirs] for r in rows])),
        "worst_ratio": float(ratio[worst]),
        "worst_window": f"{where.get('zone', 'all zones')} @ {where['offset']}",
        "max_abs_diff_usd": float(np.max(np.abs([r[ours] - r[theirs] for r in rows]))),
    }


def summarize(result: dict) -> list[dict]:
    """One row per (collection, what): the three policies and the oracle, single and multi."""
    out = []
    folders = sorted({r["folder"] for r in result["single"]})
    for folder in folders:
        rows = [r for r in result["single"] if r["folder"] == folder]
        for name in POLICIES:
            stats = _ratio_stats(rows, name, f"{name}_published", POLICY_TOLERANCE)
            stats["deadlines_met"] = float(np.mean([r[f"{name}_met"] for r in rows]))
            out.append({"collection": folder, "what": name, **stats})
        out.append({"collection": folder, "what": "oracle (single zone)",
                    **_ratio_stats(rows, "oracle", "oracle_exact", ORACLE_TOLERANCE)})
        multi = [r for r in result["multi"] if r["folder"] == folder]
        if multi:
            out.append({"collection": folder, "what": "oracle (multi-zone)",
                        **_ratio_stats(multi, "oracle", "oracle_exact", ORACLE_TOLERANCE)})
    return out
