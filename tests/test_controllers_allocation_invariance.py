"""trainwise's allocation does not depend on what a market is called or on its currency unit:
zones named as GCP or Azure names them decide exactly as AWS-named ones, and prices scaled by
one factor scale the bill by that factor with the same decisions at the same times (exactly
once the deadline penalty is set by the job's own bill, above 1e4 USD). Issue 9: a collection
from another cloud must run through the same policy, not a second one."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from cloud.risk_fit import AvailabilityHistory, fit_risk_model
from cloud.simulator import ClusterRules, JobSpec, Market, simulate
from controllers.allocation_heuristic import TrainwiseAllocationPolicy
from controllers.allocation_planner import MISS_PENALTY_USD, PlanInputs, miss_penalty_usd

TICK_S = 600
RULES = ClusterRules(changeover_s=360.0, checkpoint_save_s=60.0, checkpoint_interval_s=3600.0)
AWS = ("us-west-2a", "us-west-2b")
OTHER_CLOUDS = {"gcp": ("us-central1-a", "europe-west4-b"), "azure": ("eastus-1", "westeurope-3")}


def flapping_market(nodes: int, ticks: int = 800, seed: int = 3) -> np.ndarray:
    """Two zones whose spot comes and goes in runs of random length (a synthetic unit-test
    market: runs of 1-30 ticks up, 1-10 down; gangs see partial capacity too)."""
    rng = np.random.default_rng(seed)
    rows = []
    for _ in AWS:
        row, up = [], bool(rng.integers(2))
        while len(row) < ticks:
            length = int(rng.integers(1, 31 if up else 11))
            row += [nodes if up else int(rng.integers(0, nodes))] * length
            up = not up
        rows.append(row[:ticks])
    return np.asarray(rows, dtype=np.int64)


def fitted(rows: np.ndarray, zones: tuple[str, ...], nodes: int):
    """A model fitted on the first half of the market; the job runs on the second half."""
    half = rows.shape[1] // 2
    history = AvailabilityHistory("unit", zones, float(TICK_S), rows, nodes)
    return fit_risk_model(history, half), half


def run(rows, zones, nodes, spot=0.9731, od=3.06, deadline_h=26.0):
    model, half = fitted(rows, zones, nodes)
    window = rows[:, half:]
    market = Market(zones, TICK_S, window, (spot,) * len(zones), (od,) * len(zones),
                    trace_start_s=float(half * TICK_S))
    job = JobSpec(work_gpu_h=24.0 * nodes, deadline_s=deadline_h * 3600.0, node_count=nodes)
    policy = TrainwiseAllocationPolicy(risk_model=model)
    return simulate(policy, job, RULES, market, home_zone=zones[0], record_events=True)


def moves(result, zones: tuple[str, ...]) -> list[tuple[float, str, int, str]]:
    """When the job changed its holding, how, in which zone (by position) and to what node set
    (the reasons carry names and prices, so they are left out)."""
    out = []
    for at, kind, text in result.events:
        zone, _, rest = text.partition(": ")
        out.append((at, kind, zones.index(zone) if zone in zones else -1, rest.split(";")[0]
                    if kind == "launch" else ""))
    return out


@pytest.mark.parametrize("nodes, n_zones", [(1, 1), (1, 2), (4, 2)])
@pytest.mark.parametrize("cloud", sorted(OTHER_CLOUDS))
def test_zone_names_of_another_cloud_change_nothing(nodes, n_zones, cloud):
    rows = flapping_market(nodes)[:n_zones]
    aws = run(rows, AWS[:n_zones], nodes)
    other = run(rows, OTHER_CLOUDS[cloud][:n_zones], nodes)
    assert aws.changeovers > 2, "the market must make the policy move, or the test proves nothing"
    assert moves(other, OTHER_CLOUDS[cloud]) == moves(aws, AWS)
    assert other.cost_usd == pytest.approx(aws.cost_usd, rel=1e-12)


@pytest.mark.parametrize("nodes, n_zones", [(1, 1), (1, 2), (4, 1), (4, 2)])
@pytest.mark.parametrize("seed, deadline_h", [(3, 26.0), (5, 26.5), (8, 27.0)])
def test_prices_in_another_unit_scale_the_bill_and_keep_the_decisions(nodes, n_zones, seed,
                                                                      deadline_h):
    rows = flapping_market(nodes, seed=seed)[:n_zones]
    usd = run(rows, AWS[:n_zones], nodes, deadline_h=deadline_h)
    scaled = run(rows, AWS[:n_zones], nodes, spot=3 * 0.9731, od=3 * 3.06,
                 deadline_h=deadline_h)
    assert usd.spot_share > 0.05, "the policy must use spot here, or prices would not matter"
    assert moves(scaled, AWS) == moves(usd, AWS)
    assert scaled.cost_usd == pytest.approx(3 * usd.cost_usd, rel=1e-9)


def test_a_cheaper_spot_market_is_used_more():
    # The counter-check: prices do matter when their ratio changes.
    rows = flapping_market(1)[:1]
    dear = run(rows, AWS[:1], 1, spot=2.9)
    cheap = run(rows, AWS[:1], 1, spot=0.6)
    assert cheap.spot_share > dear.spot_share



@pytest.mark.parametrize("nodes, n_zones, seed, deadline_h",
                         [(4, 1, 5, 25.0), (1, 2, 5, 25.0), (4, 2, 3, 26.0)])
def test_a_dear_job_plans_as_a_cheap_one_does(nodes, n_zones, seed, deadline_h):
    # Prices x30 and x300: on-demand bills of about 10,000 to 1,000,000 USD a window (a large
    # p4d gang is in that range). A fixed-USD deadline penalty let the dearer job trade the
    # deadline for savings (x300 moved a tight 4-node plan); one scaled with the bill does not.
    rows = flapping_market(nodes, seed=seed)[:n_zones]
    dear = run(rows, AWS[:n_zones], nodes, spot=30 * 0.9731, od=30 * 3.06, deadline_h=deadline_h)
    dearer = run(rows, AWS[:n_zones], nodes, spot=300 * 0.9731, od=300 * 3.06,
                 deadline_h=deadline_h)
    assert dear.spot_share > 0.0
    assert moves(dearer, AWS) == moves(dear, AWS)
    assert dearer.deadline_met == dear.deadline_met


def test_the_deadline_penalty_outweighs_any_saving():
    small = PlanInputs(dt_s=400.0, steps=468, max_slack_s=4 * 3600.0, changeover_s=360.0,
                       save_s=60.0, spot_usd_per_h=0.9731, on_demand_usd_per_h=3.06)
    bill_usd = small.on_demand_usd_per_h * small.steps * small.dt_s / 3600.0
    assert miss_penalty_usd(small) == MISS_PENALTY_USD > 10 * bill_usd
    gang = dataclasses.replace(small, spot_usd_per_h=16 * 12.0, on_demand_usd_per_h=16 * 32.77)
    gang_bill_usd = gang.on_demand_usd_per_h * gang.steps * gang.dt_s / 3600.0
    assert gang_bill_usd > MISS_PENALTY_USD  # the case a fixed sum got wrong
    assert miss_penalty_usd(gang) == pytest.approx(10 * gang_bill_usd)
