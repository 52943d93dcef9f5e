"""trainwise_learned in the cost suite (issue 14 item 3): each cell is scored with a policy trained
without it. Spies on what training receives (the cells handed to the trainer, and every risk fit
made while the learner's environment runs) show that no window of a fold's held-out collection
(leave-one-collection-out) and no tick after its cut (leave-time-out) reaches training; the report
refuses a learned row whose fold trained on its cell; policy files are pickle-free npz."""

from __future__ import annotations

import numpy as np
import pytest

import cloud.scenario_protocol as protocol
from benchmarks.cost import learned as learned_mod
from benchmarks.cost import report
from benchmarks.cost.learned import (
    LEARNED,
    Fold,
    LearnedBudget,
    LearnedPolicies,
    fold_of,
    ppo_trainer,
)
from benchmarks.cost.suite import ScenarioOutcome, run_scenarios
from cloud import scenarios
from cloud.risk_fit import fit_risk_model as real_fit
from cloud.scenario_protocol import LOCO, LTO, loco_split, lto_split_tick
from cloud.scenarios import GANG_4NODE, SINGLE_NODE, Scenario, build_scenarios, rules_for
from cloud.simulator import JobSpec, Market
from tests.shared_data import needs_spot_data

TINY = LearnedBudget(ppo_timesteps=0, bc_states=16, n_envs=1, n_steps=16, windows_per_zone=1,
                     max_zones=1)
HELD_OUT = "preemption-1node-aws-2023-04"


class Spies:
    """Records the cells the trainer gets and every risk fit made while it trains."""

    def __init__(self) -> None:
        self.cells: list[Scenario] = []
        self.fits: list[tuple] = []
        self.training = False

    def trainer(self, cells, budget):
        self.cells += list(cells)
        self.training = True
        try:
            return ppo_trainer(cells, budget)
        finally:
            self.training = False

    def fit(self, target, cutoff_tick, prior=()):
        if self.training:
            self.fits.append((target, cutoff_tick, list(prior)))
        return real_fit(target, cutoff_tick, prior)


@pytest.fixture
def spies(monkeypatch):
    spy = Spies()
    monkeypatch.setattr(protocol, "fit_risk_model", spy.fit)
    monkeypatch.setattr(scenarios, "_RISK_MODELS", {})
    monkeypatch.setattr(scenarios, "_WINDOW_MODELS", {})
    return spy


@needs_spot_data
def test_loco_fold_never_trains_on_its_held_out_collection(spies, tmp_path):
    policies = LearnedPolicies(TINY, tmp_path, spies.trainer)
    policies.network(Fold(LOCO, HELD_OUT))
    assert spies.cells and {c.source_folder for c in spies.cells} == (
        set(scenarios.SINGLE_NODE_FOLDERS) - {HELD_OUT})
    for cell in spies.cells:  # nor through the heuristic's risk model inside the environment
        assert HELD_OUT not in cell.fit_split.fit_collections
    assert spies.fits, "the learner's environment fitted no risk model: the spy saw nothing"
    for target, cutoff, prior in spies.fits:
        assert cutoff == 0 and target.available.shape[1] == 0  # LOCO: zone names, no tick
        names = [target.name] + [h.name for h in prior]
        assert not any(n.startswith(HELD_OUT) for n in names), names
    record = policies.records[Fold(LOCO, HELD_OUT)]
    assert HELD_OUT not in record["trained_on_collections"]
    assert record["held_out"] == HELD_OUT and record["train_cells"] == len(spies.cells)


@needs_spot_data
def test_lto_fold_trains_only_on_windows_that_end_before_the_cut(spies, tmp_path):
    policies = LearnedPolicies(TINY, tmp_path, spies.trainer)
    policies.network(Fold(LTO, HELD_OUT))
    scored = build_scenarios(SINGLE_NODE, rules_for(SINGLE_NODE), 2, max_zones=1,
                             folders=(HELD_OUT,), kinds=("single_zone",), protocol=LTO)
    cut = scored[0].fit_split.fit_ticks
    assert min(s.start_tick for s in scored) >= cut
    assert spies.cells and {c.source_folder for c in spies.cells} == {HELD_OUT}
    for cell in spies.cells:
        assert cell.start_tick + cell.window_ticks <= cut
        assert cell.market.n_ticks == cell.window_ticks  # the window is all the market it sees
        assert cell.fit_split.protocol == LTO and cell.fit_split.fit_ticks == cut
    assert spies.fits
    for target, cutoff, prior in spies.fits:
        assert prior == [] and cutoff == cut == target.available.shape[1]
    record = policies.records[Fold(LTO, HELD_OUT)]
    assert record["train_tick_span"][HELD_OUT][1] <= cut


@needs_spot_data
def test_gang_lto_fold_trains_on_gang_windows_before_the_cut(tmp_path):
    cells = learned_mod.training_cells(Fold(LTO, scenarios.MULTI_NODE_FOLDER), TINY)
    assert cells and {c.setting.name for c in cells} == {GANG_4NODE.name}
    for cell in cells:
        cut = lto_split_tick(cell.trace_market.n_ticks, cell.window_ticks)
        assert cell.start_tick + cell.window_ticks <= cut


@needs_spot_data
def test_suite_scores_each_cell_with_its_own_folds_file(tmp_path):
    """run_scenarios with the learned factory: one file per fold, pickle-free, naming what it was
    trained on; the learned rows say it; version 1 (the clone) meets every deadline."""
    policies = LearnedPolicies(TINY, tmp_path)
    scenarios = []
    for prot in (LOCO, LTO):
        scenarios += build_scenarios(SINGLE_NODE, rules_for(SINGLE_NODE), 1, max_zones=1,
                                     folders=("availability-1node-aws-2022-10",),
                                     kinds=("single_zone",), protocol=prot)[:1]
    names = ("on_demand", "uniform_progress", "trainwise_heuristic", LEARNED)
    outcomes = run_scenarios(scenarios, names, factories={LEARNED: policies.policy})
    assert set(policies.records) == {fold_of(s) for s in scenarios}
    for fold, record in policies.records.items():
        path = tmp_path / record["policy_file"]
        with np.load(path, allow_pickle=False) as data:  # no object arrays: nothing to unpickle
            assert "header" in data.files
        assert fold.held_out in learned_mod.train_window_text(record)
    rows = report.learned_rows(outcomes, policies.summary()["folds"])
    assert {r["protocol"] for r in rows} == {LOCO, LTO}
    for row in rows:
        assert row["held_out"] and row["deadline_misses"] == 0
        if row["protocol"] == LOCO:
            assert row["collection"] not in row["trained_on"]
    assert all(o.results[LEARNED]["deadline_met"] for o in outcomes)


def _outcome(start: int, split) -> ScenarioOutcome:
    market = Market(("z",), 60, np.ones((1, 10), dtype=np.int64), (1.0,), (3.0,))
    scenario = Scenario(
        setting=SINGLE_NODE, kind="single_zone", folder="a", instance_type="p3.2xlarge",
        market=market, home_zone="z", start_tick=start, job=JobSpec(1.0, 600.0),
        rules=rules_for(SINGLE_NODE), oracle_key=("a", start), seed=0, deadline_h=1.0,
        source_folder="a", fit_split=split, window_ticks=10)
    costs = {"on_demand": 3.0, "uniform_progress": 2.0, "trainwise_heuristic": 1.5, LEARNED: 1.2}
    results = {n: {"cost_usd": c, "deadline_met": True, "spot_share": 0.5}
               for n, c in costs.items()}
    return ScenarioOutcome(scenario, 1.0, 1.0, results)


def test_learned_row_is_refused_when_its_fold_trained_on_the_cell():
    outcomes = [_outcome(10 * i, loco_split("a", ["a", "b"])) for i in range(4)]
    fold = {"protocol": LOCO, "held_out": "a", "trained_on_collections": ["b"],
            "train_tick_span": {"b": [0, 50]}}
    (row,) = report.learned_rows(outcomes, [fold])
    assert row["vs_heuristic"]["value"] == pytest.approx(0.8)
    assert row["vs_oracle"]["value"] == pytest.approx(1.2) and row["goal_met"] is False
    leaky = {**fold, "trained_on_collections": ["a", "b"]}
    with pytest.raises(ValueError, match="its fold trained on it"):
        report.learned_rows(outcomes, [leaky])
    with pytest.raises(ValueError, match="no fold record"):
        report.learned_rows(outcomes, [])
