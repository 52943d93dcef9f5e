"""The promotion gate: cheaper by the margin and never more deadline misses, or refused."""

import json

import pytest

from cloud.policies import OnDemandPolicy, UniformProgressPolicy
from rl.cells import heuristic_for, make_split
from rl.gate import decide, evaluate_slow, record_decision
from tests.shared_data import needs_spot_data

pytestmark = needs_spot_data


@pytest.fixture(scope="module")
def cells():
    return make_split(region="us-west-2", windows_per_zone=6, kinds=("single_zone",)).held_out[:4]


def test_a_worse_candidate_is_refused_and_the_decision_is_recorded(cells, tmp_path):
    incumbent = evaluate_slow(heuristic_for, cells)
    worse = evaluate_slow(lambda cell: OnDemandPolicy(), cells)  # always on-demand: dearer
    decision = decide(worse, incumbent, margin=0.01)
    assert not decision.promote and "cost ratio" in decision.reason
    assert decision.cost_ratio > 1.5 and decision.cost_ratio_ci95[0] > 1.0
    path = record_decision(decision, tmp_path / "gate.json", {"region": "us-west-2"})
    saved = json.loads(path.read_text())
    assert saved["promote"] is False and saved["region"] == "us-west-2" and len(saved["per_cell"]) == 4


def test_a_cheaper_candidate_is_promoted_but_not_with_more_misses(cells):
    dear = evaluate_slow(lambda cell: OnDemandPolicy(), cells)
    cheap = evaluate_slow(lambda cell: UniformProgressPolicy(), cells)
    assert decide(cheap, dear).promote
    missed = [dict(r, missed=True) if i == 0 else r for i, r in enumerate(cheap)]
    decision = decide(missed, dear)
    assert not decision.promote and "deadline misses" in decision.reason


def test_the_same_policy_is_not_promoted_over_itself(cells):
    rows = evaluate_slow(heuristic_for, cells)
    assert not decide(rows, rows, margin=0.01).promote
    with pytest.raises(ValueError, match="same, non-empty cells"):
        decide(rows[:2], rows)
