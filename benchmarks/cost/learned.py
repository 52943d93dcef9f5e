"""`trainwise_learned` in the cost suite: one learned slow policy per held-out part, trained
without it (issue 14 item 3, on issue 9's protocol).

A fold is (protocol, held-out collection); every scenario of the suite belongs to exactly one
(`fold_of`), and is scored only with its fold's policy:

- leave-one-collection-out, collection C: trained on the single-node windows of every OTHER
  single-node collection (the only job shape the learner trains on; the 4-node collection's fold
  is therefore trained on all three single-node ones). The heuristic inside the learner's
  environment gets risk models fitted without C as well (`FitSplit` of the training window's own
  collection minus C), so not one tick of C reaches training, directly or through a feature.
- leave-time-out, collection C: trained on C's windows that END at or before the suite's split
  tick for that market (`protocol.lto_split_tick`, the same cut its scored windows start after),
  with the risk model of that split (ticks before the cut only); gangs train on gang windows.

Training: behaviour clone of the heuristic, then PPO (`rl.train.train_policy`) with a small fixed
budget (`SUITE_BUDGET`; the weekly retraining's is 20x larger). Each fold's policy is written as a
pickle-free npz (`rl.policy_file`) and the policy scored is the one loaded back from that file.
The fold records (what each policy was trained on) go into cost.json.
"""

from __future__ import annotations

import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from cloud.scenario_protocol import LOCO, LTO, FitSplit, lto_split, lto_split_tick
from cloud.scenarios import (
    SINGLE_NODE,
    Scenario,
    all_collections,
    build_scenarios,
    discovered_settings,
    policy_for,
    rules_for,
    setting_of,
)

LEARNED = "trainwise_learned"
HEURISTIC = "trainwise_heuristic"


@dataclass(frozen=True)
class LearnedBudget:
    ppo_timesteps: int = 10_000
    bc_states: int = 2000
    n_envs: int = 4
    n_steps: int = 256
    # Training windows per zone (leave-time-out: before the cut, about half of twice this many).
    windows_per_zone: int = 6
    max_zones: int | None = None
    seed: int = 0


SUITE_BUDGET = LearnedBudget()
# --quick and tests: the behaviour clone only (seconds).
QUICK_BUDGET = LearnedBudget(ppo_timesteps=0, bc_states=64, n_envs=1, n_steps=64,
                             windows_per_zone=2, max_zones=2)


@dataclass(frozen=True)
class Fold:
    protocol: str
    held_out: str  # the collection whose windows this fold's policy is scored on

    @property
    def file_stem(self) -> str:
        return f"{self.protocol}__{self.held_out}"


def fold_of(scenario: Scenario) -> Fold:
    if scenario.fit_split is None:
        raise ValueError("scenario has no out-of-sample split, so no learned policy is held out "
                         "from it; build it with build_scenarios")
    return Fold(scenario.fit_split.protocol, scenario.source_folder or scenario.folder)


def training_cells(fold: Fold, budget: LearnedBudget) -> list[Scenario]:
    """The cells fold `fold` trains on (module doc); never a window of its held-out part."""
    if fold.protocol == LOCO:
        single = next((s.folders for s in discovered_settings() if s.name == SINGLE_NODE.name),
                      ())
        folders = tuple(f for f in single if f != fold.held_out)
        cells = build_scenarios(SINGLE_NODE, rules_for(SINGLE_NODE), budget.windows_per_zone,
                                max_zones=budget.max_zones, folders=folders, protocol=LOCO)
        pool = tuple(c for c in all_collections() if c != fold.held_out)
        # The heuristic's risk model: the cell's own collection and the held-out one left out.
        return [replace(c, fit_split=FitSplit(LOCO, c.source_folder,
                                              tuple(p for p in pool if p != c.source_folder)))
                for c in cells]
    if fold.protocol != LTO:
        raise ValueError(f"fold protocol {fold.protocol!r} must be {LOCO!r} or {LTO!r}")
    setting = setting_of(fold.held_out)
    cells = build_scenarios(setting, rules_for(setting), 2 * budget.windows_per_zone,
                            max_zones=budget.max_zones, folders=(fold.held_out,), protocol=LOCO)
    kept = []
    for c in cells:
        # The suite's own cut for this market (build_scenarios, protocol LTO): scored windows
        # start at or after it, so a training window must end at or before it.
        cut = lto_split_tick(c.trace_market.n_ticks, c.window_ticks)
        if c.start_tick + c.window_ticks <= cut:
            kept.append(replace(c, fit_split=lto_split(fold.held_out, cut)))
    return kept


def describe_training(fold: Fold, cells: Sequence[Scenario]) -> dict[str, Any]:
    """What a fold's policy was trained on, per collection: windows and tick span."""
    spans: dict[str, list[int]] = {}
    for c in cells:
        lo, hi = spans.setdefault(c.source_folder, [c.start_tick, c.start_tick + c.window_ticks])
        spans[c.source_folder] = [min(lo, c.start_tick), max(hi, c.start_tick + c.window_ticks)]
    return {
        "protocol": fold.protocol, "held_out": fold.held_out,
        "trained_on_collections": sorted(spans),
        "train_windows": {k: sum(c.source_folder == k for c in cells) for k in sorted(spans)},
        "train_tick_span": {k: spans[k] for k in sorted(spans)},
        "settings": sorted({c.setting.name for c in cells}),
        "risk_fits": sorted({c.fit_split.describe() for c in cells if c.fit_split}),
    }


def train_window_text(record: dict[str, Any]) -> str:
    spans = "; ".join(f"{k} ticks [{a}, {b})" for k, (a, b) in record["train_tick_span"].items())
    return f"{record['protocol']} fold, {record['held_out']} held out: {spans}"


Trainer = Callable[[Sequence[Scenario], LearnedBudget], tuple[Any, Any]]


def ppo_trainer(cells: Sequence[Scenario], budget: LearnedBudget) -> tuple[Any, Any]:
    """Behaviour clone + PPO on SlowEnv over `cells` (imports torch: only when a fold trains)."""
    from rl.slow_env import SlowEnv
    from rl.train import train_policy

    return train_policy(lambda: SlowEnv(cells), budget.ppo_timesteps, budget.n_envs,
                        budget.seed, budget.bc_states, budget.n_steps)


class LearnedPolicies:
    """Trains each fold once, on first use, and builds `trainwise_learned` per scenario."""

    def __init__(self, budget: LearnedBudget = SUITE_BUDGET, directory: str | Path | None = None,
                 trainer: Trainer | None = None):
        self.budget = budget
        self._tmp = None if directory else tempfile.TemporaryDirectory(prefix="trainwise-learned-")
        self.directory = Path(directory or self._tmp.name)
        self.trainer = trainer or ppo_trainer
        self.networks: dict[Fold, Any] = {}
        self.records: dict[Fold, dict[str, Any]] = {}

    def network(self, fold: Fold):
        if fold not in self.networks:
            self.networks[fold] = self._train(fold)
        return self.networks[fold]

    def _train(self, fold: Fold):
        from rl.fast_path import NumpyPolicy
        from rl.policy_file import load_policy, save_policy, weights_from_sb3
        from rl.slow_obs import SLOW_OBS_LAYOUT

        cells = training_cells(fold, self.budget)
        if not cells:
            raise ValueError(f"fold {fold} has no training window; give more windows_per_zone or "
                             "a longer collection")
        record = describe_training(fold, cells)
        start = time.perf_counter()
        model, report = self.trainer(cells, self.budget)
        seconds = time.perf_counter() - start
        weights = weights_from_sb3(model, "slow", SLOW_OBS_LAYOUT, None, train_window_text(record),
                                   figures={"bc_agreement": report.bc_agreement,
                                            "ppo_timesteps": report.ppo_timesteps})
        path = self.directory / f"{fold.file_stem}.npz"
        header = save_policy(weights, path)
        record.update(train_cells=len(cells), train_seconds=seconds,
                      bc_agreement=report.bc_agreement, ppo_timesteps=report.ppo_timesteps,
                      policy_file=path.name, weights_sha256=header["weights_sha256"])
        self.records[fold] = record
        # The policy scored is the file read back (pickle-free; a bad file is refused here).
        return NumpyPolicy(load_policy(path, "slow", SLOW_OBS_LAYOUT))

    def policy(self, scenario: Scenario):
        from rl.fast_path import LearnedAllocationPolicy

        return LearnedAllocationPolicy(self.network(fold_of(scenario)),
                                       policy_for(HEURISTIC, scenario))

    def summary(self) -> dict[str, Any]:
        return {"budget": asdict(self.budget),
                "folds": [self.records[f] for f in sorted(self.records, key=str)]}
