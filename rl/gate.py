"""Promotion gate: a candidate replaces the incumbent only when the held-out evaluation says so.

Rule (both must hold):
- cheaper by the margin: total candidate cost <= (1 - `margin`) x total incumbent cost over the
  same held-out cells (default margin 1 %);
- never more deadline misses than the incumbent (a miss is not traded for dollars).
The simulator has no model-quality signal (pruning is not a choice of these policies), so "never
a quality violation" reduces to the deadline rule here.

The decision carries its figures (totals, the cost ratio with a 95 % paired-bootstrap interval
over cells, misses) and is written as JSON by `record_decision`.

Slow policies are evaluated on cost-suite cells (`evaluate_slow`, USD); fast policies on held-out
FastEnv seeds (`evaluate_fast`), where the "cost" is wall-clock seconds per 100 ideal steps.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from benchmarks.cost.suite import Scenario
from cloud.simulator import simulate
from controllers.allocation_types import AllocationPolicy
from rl.cells import cell_label

DEFAULT_MARGIN = 0.01


@dataclass
class GateDecision:
    promote: bool
    reason: str
    margin: float
    candidate_total: float
    incumbent_total: float
    cost_ratio: float
    cost_ratio_ci95: tuple[float, float]
    candidate_misses: int
    incumbent_misses: int
    cells: int
    unit: str = "usd"
    per_cell: list[dict] = field(default_factory=list)

    def to_dict(self) -> dict:
        return asdict(self)


def evaluate_slow(make: Callable[[Scenario], AllocationPolicy], cells: Sequence[Scenario]) -> list[dict]:
    rows = []
    for cell in cells:
        result = simulate(make(cell), cell.job, cell.rules, cell.market, home_zone=cell.home_zone)
        rows.append({"cell": cell_label(cell), "cost": result.cost_usd,
                     "missed": not result.deadline_met})
    return rows


def evaluate_fast(make_policy_action: Callable, seeds: Sequence[int], env_kwargs: dict | None = None
                  ) -> list[dict]:
    """`make_policy_action()` returns a fresh `(obs_vector) -> action` callable per episode."""
    from rl.fast_env import FastEnv

    env = FastEnv(**(env_kwargs or {}))
    rows = []
    for seed in seeds:
        act = make_policy_action()
        obs, _ = env.reset(seed=int(seed))
        while True:
            obs, _, terminated, truncated, info = env.step(np.asarray(act(obs)))
            if terminated or truncated:
                break
        seconds = env.t * env.tick_s
        rows.append({"cell": f"fast/seed{seed}", "cost": seconds / max(info["progress"], 1e-9) * 100,
                     "missed": False})
    return rows


def _bootstrap_ratio(cand: np.ndarray, inc: np.ndarray, seed: int = 0, n: int = 2000
                     ) -> tuple[float, float]:
    rng = np.random.default_rng(seed)
    idx = rng.integers(0, len(cand), size=(n, len(cand)))
    ratios = cand[idx].sum(axis=1) / inc[idx].sum(axis=1)
    return float(np.percentile(ratios, 2.5)), float(np.percentile(ratios, 97.5))


def decide(candidate: list[dict], incumbent: list[dict], margin: float = DEFAULT_MARGIN,
           unit: str = "usd") -> GateDecision:
    if not 0 <= margin < 1:
        raise ValueError(f"margin={margin} must be in [0, 1)")
    if [r["cell"] for r in candidate] != [r["cell"] for r in incumbent] or not candidate:
        raise ValueError("candidate and incumbent must be evaluated on the same, non-empty cells")
    cand = np.array([r["cost"] for r in candidate], dtype=float)
    inc = np.array([r["cost"] for r in incumbent], dtype=float)
    if not (np.isfinite(cand).all() and np.isfinite(inc).all()):
        return GateDecision(False, "refused: non-finite cost in the evaluation", margin,
                            float("nan"), float("nan"), float("nan"), (float("nan"),) * 2, 0, 0,
                            len(cand), unit)
    c_miss = sum(r["missed"] for r in candidate)
    i_miss = sum(r["missed"] for r in incumbent)
    ratio = float(cand.sum() / inc.sum())
    ci = _bootstrap_ratio(cand, inc)
    if c_miss > i_miss:
        promote, reason = False, (f"refused: {c_miss} deadline misses vs the incumbent's {i_miss} "
                                  "(misses are never traded for cost)")
    elif ratio > 1 - margin:
        promote, reason = False, (f"refused: cost ratio {ratio:.4f} is not below 1 - margin = "
                                  f"{1 - margin:.4f}")
    else:
        promote, reason = True, (f"promoted: cost ratio {ratio:.4f} <= {1 - margin:.4f}, misses "
                                 f"{c_miss} <= {i_miss}")
    per_cell = [{"cell": a["cell"], "candidate": a["cost"], "incumbent": b["cost"],
                 "candidate_missed": a["missed"], "incumbent_missed": b["missed"]}
                for a, b in zip(candidate, incumbent)]
    return GateDecision(promote, reason, margin, float(cand.sum()), float(inc.sum()), ratio, ci,
                        int(c_miss), int(i_miss), len(cand), unit, per_cell)


def record_decision(decision: GateDecision, path: str | Path, extra: dict | None = None) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({**decision.to_dict(), **(extra or {})}, indent=2, default=str))
    return path
