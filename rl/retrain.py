"""One retraining of one region's slow or fast policy: train, export, gate, keep the champion.

Files under `<TRAINWISE_HOME>/policies/<kind>/<region>/`:
    v<N>.npz        every candidate, with its header (training window, version, figures)
    champion.npz    the policy in charge (absent: the heuristic is in charge)
    gate_v<N>.json  the gate's decision and figures for candidate N
`retrain_*` write the candidate and its decision; `apply_gate` (the blocking asset check) then
replaces the champion only when the decision promotes; a refused candidate stays on disk for
inspection and the incumbent (champion or heuristic) stays in charge. `load_champion_*` fall back
to the heuristic (return None) when there is no champion or its file is refused.

What each trains on (`rl.training_data`): the slow policy on the newest `train_days` of the
region's single-node market data before a held-out tail of `held_out_days` (gated on the tail and
the older data); the fast policy in a FastEnv whose notices come at the reclaim hazards measured
on the region's newest `train_days`. Both train with `derived_seed` (the budget seed plus the
data's fingerprint), so new data gives a new policy and the same data and seed the same one; the
header's `train_window` and `train_data` record what was used.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from controllers.fast_heuristic import HeuristicFastPolicy
from rl._files import write_atomic
from rl.cells import heuristic_for
from rl.fast_obs import FAST_OBS_LAYOUT
from rl.fast_path import LearnedAllocationPolicy, NumpyPolicy
from rl.gate import DEFAULT_MARGIN, decide, evaluate_fast, evaluate_slow, record_decision
from rl.policy_file import PolicyFileError, load_policy, save_policy, weights_from_sb3
from rl.policy_folder import policy_dir
from rl.slow_obs import SLOW_OBS_LAYOUT
from rl.training_data import derived_seed, region_fast_stats, rolling_split


@dataclass(frozen=True)
class Budget:
    ppo_timesteps: int
    bc_states: int
    n_envs: int = 4
    n_steps: int = 256
    windows_per_zone: int = 12
    # Held-out cells (slow) / seeds (fast) the gate evaluates on; 0 = all held-out cells.
    held_out: int = 0
    fast_episode_ticks: int = 240
    seed: int = 0
    # Recorded days of the region's newest market data trained on (slow: before the held-out
    # tail; fast: the days its reclaim hazards are measured over). Two weeks: long enough for
    # several 52 h windows per zone, short enough that a week of new data moves it by half.
    train_days: float = 14.0
    # The newest days held out for the slow gate; at least the 52 h job window, so the tail
    # holds one held-out window per zone.
    held_out_days: float = 3.0


TINY = Budget(ppo_timesteps=256, bc_states=128, n_envs=2, n_steps=128, windows_per_zone=6,
              held_out=2, fast_episode_ticks=24)
WEEKLY_SLOW = Budget(ppo_timesteps=200_000, bc_states=4000, held_out=0)
DAILY_FAST = Budget(ppo_timesteps=100_000, bc_states=4000, held_out=30, train_days=7.0)


def _next_version(folder: Path) -> int:
    found = [int(p.stem[1:]) for p in folder.glob("v*.npz") if p.stem[1:].isdigit()]
    return max(found, default=0) + 1


def load_champion_slow(region: str) -> NumpyPolicy | None:
    path = policy_dir("slow", region) / "champion.npz"
    if not path.exists():
        return None
    try:
        return NumpyPolicy(load_policy(path, "slow", SLOW_OBS_LAYOUT, region))
    except PolicyFileError:
        return None


def load_champion_fast(region: str) -> NumpyPolicy | None:
    path = policy_dir("fast", region) / "champion.npz"
    if not path.exists():
        return None
    try:
        return NumpyPolicy(load_policy(path, "fast", FAST_OBS_LAYOUT, region))
    except PolicyFileError:
        return None


def retrain_slow(region: str, budget: Budget, log: Callable | None = None) -> dict:
    # gymnasium and stable-baselines3 cost seconds; the code location imports this module.
    from rl.slow_env import SlowEnv
    from rl.train import train_policy

    split = rolling_split(region, budget.train_days, budget.held_out_days,
                          windows_per_zone=budget.windows_per_zone)
    train_cells = split.train
    seed = derived_seed(budget.seed, split.data_sha256)
    model, report = train_policy(lambda: SlowEnv(train_cells), budget.ppo_timesteps, budget.n_envs,
                                 seed, budget.bc_states, budget.n_steps, log=log)
    held = split.held_out[: budget.held_out] if budget.held_out else split.held_out
    folder = policy_dir("slow", region)
    version = _next_version(folder)
    weights = weights_from_sb3(model, "slow", SLOW_OBS_LAYOUT, region, split.train_window, version)
    weights.train_data = {**split.train_data, "seed": seed, "budget_seed": budget.seed}
    candidate = NumpyPolicy(weights)
    champion = load_champion_slow(region)
    cand_rows = evaluate_slow(lambda c: LearnedAllocationPolicy(candidate, heuristic_for(c)), held)
    if champion is None:
        inc_rows, incumbent = evaluate_slow(heuristic_for, held), "trainwise_heuristic"
    else:
        inc_rows = evaluate_slow(lambda c: LearnedAllocationPolicy(champion, heuristic_for(c)), held)
        incumbent = f"champion v{champion.weights.version}"
    decision = decide(cand_rows, inc_rows, DEFAULT_MARGIN)
    weights.figures = {"cost_ratio": decision.cost_ratio, "held_out_cells": decision.cells,
                       "bc_agreement": report.bc_agreement, "train_seconds": report.seconds}
    return _finish(folder, version, weights, decision, incumbent, report, len(train_cells))


def retrain_fast(region: str, budget: Budget, log: Callable | None = None) -> dict:
    """The region's fast environment differs from another region's by its notice hazards,
    measured on the region's newest `budget.train_days` of spot data (`region_fast_stats`);
    straggling comes from region-free traces. Training and the gate use the same environment."""
    # gymnasium and stable-baselines3 cost seconds; the code location imports this module.
    from rl.fast_env import FastEnv
    from rl.train import train_policy

    stats = region_fast_stats(region, budget.train_days)
    seed = derived_seed(budget.seed, stats.data_sha256)
    env_kwargs = {"episode_ticks": budget.fast_episode_ticks, "hazards_per_h": stats.hazards_per_h}
    model, report = train_policy(lambda: FastEnv(**env_kwargs), budget.ppo_timesteps,
                                 budget.n_envs, seed, budget.bc_states, budget.n_steps, log=log)
    folder = policy_dir("fast", region)
    version = _next_version(folder)
    weights = weights_from_sb3(model, "fast", FAST_OBS_LAYOUT, region, stats.describe(), version)
    weights.train_data = {**stats.to_dict(), "seed": seed, "budget_seed": budget.seed,
                          "env": {"episode_ticks": budget.fast_episode_ticks}}
    candidate = NumpyPolicy(weights)
    champion = load_champion_fast(region)
    # Held-out seeds: fixed, apart from training's (sb3 seeds envs from the derived seed upward;
    # a derived seed within a few dozen of 10,000 is about one chance in 10^7).
    seeds = [10_000 + i for i in range(budget.held_out or 20)]

    def acting(net: NumpyPolicy | None):
        return lambda: (lambda obs: np.zeros(3, np.int64) if net is None else np.asarray(net.predict(obs)))

    cand_rows = evaluate_fast(acting(candidate), seeds, env_kwargs)
    inc_rows = evaluate_fast(acting(champion), seeds, env_kwargs)
    incumbent = "heuristic_fast" if champion is None else f"champion v{champion.weights.version}"
    decision = decide(cand_rows, inc_rows, DEFAULT_MARGIN, unit="s per 100 ideal steps")
    weights.figures = {"cost_ratio": decision.cost_ratio, "held_out_seeds": len(seeds),
                       "bc_agreement": report.bc_agreement, "train_seconds": report.seconds}
    _ = HeuristicFastPolicy  # the incumbent inside FastEnv is HeuristicFastPolicy
    return _finish(folder, version, weights, decision, incumbent, report, 0)


def _finish(folder: Path, version: int, weights, decision, incumbent: str, report,
            train_cells: int) -> dict:
    path = folder / f"v{version}.npz"
    header = save_policy(weights, path)
    gate_path = record_decision(decision, folder / f"gate_v{version}.json",
                                {"candidate": path.name, "incumbent": incumbent,
                                 "train_window": weights.train_window,
                                 "train_data_sha256": weights.train_data.get("data_sha256")})
    return {"path": str(path), "version": version, "header": header, "gate_path": str(gate_path),
            "decision": decision.to_dict(), "incumbent": incumbent, "promoted": decision.promote,
            "bc_agreement": report.bc_agreement, "train_seconds": report.seconds,
            "ppo_timesteps": report.ppo_timesteps, "train_cells": train_cells}


def apply_gate(kind: str, region: str) -> dict:
    """Acts on the latest candidate's recorded decision: a promoted candidate becomes the champion
    (after its file passes `load_policy` again); otherwise the incumbent stays. Returns the
    decision with `champion_version` (None: the heuristic is in charge)."""
    folder = policy_dir(kind, region)
    version = _next_version(folder) - 1
    gate_path = folder / f"gate_v{version}.json"
    if version < 1 or not gate_path.exists():
        raise FileNotFoundError(f"no candidate for {kind}/{region} under {folder}; materialize "
                                f"the {kind}_policy asset for partition {region!r} first")
    decision = json.loads(gate_path.read_text())
    layout = SLOW_OBS_LAYOUT if kind == "slow" else FAST_OBS_LAYOUT
    if decision["promote"]:
        load_policy(folder / f"v{version}.npz", kind, layout, region)  # refuses a bad file
        # Not shutil.copyfile: it opens the target following a link planted at its name.
        write_atomic(folder / "champion.npz", (folder / f"v{version}.npz").read_bytes())
    champion = (load_champion_slow if kind == "slow" else load_champion_fast)(region)
    decision["champion_version"] = None if champion is None else champion.weights.version
    decision["candidate_version"] = version
    return decision
