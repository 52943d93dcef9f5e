"""The price-of-a-wrong-model benchmark (`benchmarks/cost/mismatch.py`) in its quick form: the
distortion is what it says, markets follow the distorted model, a right model costs exactly what
the true one does, and the oracle is a floor for every policy."""

from __future__ import annotations

import json

import numpy as np
import pytest

from benchmarks.cost import mismatch as M
from cloud.traces import default_spot_dir
from controllers.preemption_risk import DOWN, UP, HazardCurve, PreemptionRiskModel

pytestmark = pytest.mark.skipif(not default_spot_dir().is_dir(), reason="shared spot data missing")


def test_distortion_scales_each_state_hazard_and_keeps_the_run_in_progress():
    curve = HazardCurve((0.0, 3600.0), (2.0, 0.5))
    model = PreemptionRiskModel({(UP, "z", 1): curve, (DOWN, "z", 1): curve},
                                run_at_cutoff={("z", 1): (UP, 600.0)})
    wrong = M.distorted(model, 4.0, 0.25)
    assert wrong.curve("z", 1, UP).rate_per_h == (8.0, 2.0)
    assert wrong.curve("z", 1, DOWN).rate_per_h == (0.5, 0.125)
    assert wrong.run_at_cutoff == {("z", 1): (UP, 600.0)}
    with pytest.raises(ValueError, match="distortion factors"):
        M.distorted(model, 0.0, 1.0)


@pytest.fixture(scope="module")
def quick(tmp_path_factory):
    out = tmp_path_factory.mktemp("mismatch")
    assert M.main(["--quick", "--no-progress", "--out", str(out)]) == 0
    return json.loads((out / f"{M.RESULTS_STEM}.json").read_text())


def test_quick_report_rows_and_provenance(quick):
    assert quick["meta"]["command"].startswith("python -m benchmarks.cost.mismatch")
    assert [[r["up"], r["down"]] for r in quick["rows"]] == [list(d) for d in
                                                             M.QUICK_DISTORTIONS]
    assert all(r["windows"] == M.QUICK_WINDOWS for r in quick["rows"])


def test_a_right_model_costs_what_the_true_one_does_and_the_oracle_is_a_floor(quick):
    for w in quick["windows"]:
        for name in M.POLICIES:
            assert w[f"{name}_usd"] >= w["oracle_usd"] - 1e-6
        if (w["up"], w["down"]) == (1.0, 1.0):
            assert w[f"{M.FITTED}_usd"] == pytest.approx(w[f"{M.TRUE}_usd"], abs=1e-9)


def test_markets_follow_the_distorted_model():
    """Faster up and down hazards (4, 4) make a market flap: more, shorter runs than (1, 1)."""
    import dataclasses

    from benchmarks.cost import bound as B
    from cloud.scenario_protocol import LOCO
    from cloud.synthetic_market import run_lengths_s

    cell = B.suite_cells([LOCO], ["single_node"], [B.SINGLE])[-1]
    runs = {}
    for factor in (1.0, 4.0):
        world = dataclasses.replace(cell, model=M.distorted(cell.model, factor, factor))
        market = B.model_world_scenarios(world, 2, 1, B.QUICK_BURN_IN_S, 1)[0].trace_market
        runs[factor] = np.mean(run_lengths_s(market.spot_available[0], market.tick_s)[0])
    assert runs[4.0] < 0.5 * runs[1.0]
