"""Gangs (issue 9, item 5): a gang of N runs only whole, so its decisions must use how long all N
spot nodes stay up, not whether one does; on the real 4-node collection (read through its
collection.toml) the policy is no costlier than Uniform Progress on a few windows."""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest

from cloud.policy_registry import make_policy
from cloud.risk_fit import AvailabilityHistory, fit_risk_model, folder_histories
from cloud.simulator import ClusterRules, JobSpec, market_from_traces, simulate
from cloud.traces import load_folder
from controllers.allocation_heuristic import TrainwiseAllocationPolicy
from controllers.allocation_types import AllocationObservation
from controllers.preemption_risk import DOWN, UP, PreemptionRiskModel
from tests.shared_data import needs_spot_data

pytestmark = needs_spot_data

FOLDER = "preemption-4node-aws-2023-08"
NODES = 4


@pytest.fixture(scope="module")
def four_node():
    """The real 4-node market (zones side by side) and its history."""
    traces = load_folder(FOLDER)  # through cloud/collections.py: collection.toml says 4 nodes
    assert {t.capacity_nodes for t in traces} == {NODES}
    market = market_from_traces(traces, (0.9731,) * len(traces), (3.06,) * len(traces))
    history = AvailabilityHistory(FOLDER, market.zones, float(market.tick_s),
                                  market.spot_available, NODES, 0.0)
    return market, history


def test_a_gang_above_the_fitted_sizes_gets_its_own_shorter_runs():
    prior = PreemptionRiskModel.constant(mean_up_s=7200.0, mean_down_s=3600.0)
    # Without it, a 16-node gang reads the 1-node curve: as if one node had to stay up.
    assert prior.curve("*", 16, UP) is prior.curve("*", 1, UP)
    gangs = prior.with_gang_levels([16, 8], exponent=0.5)
    assert gangs.curve("*", 1, UP) is prior.curve("*", 1, UP)
    assert gangs.mean_run_s("*", 16, UP) == pytest.approx(7200.0 / 4.0, rel=1e-3)
    assert gangs.mean_run_s("*", 8, UP) == pytest.approx(7200.0 / math.sqrt(8), rel=1e-3)
    # Its long-run share is the group's share to the power k (4 groups' worth here).
    assert gangs.availability_share("*", 16) == pytest.approx((2 / 3) ** 4, rel=1e-3)


def test_on_the_real_4node_trace_whole_gang_runs_are_its_own_and_shorter(four_node):
    _, history = four_node
    model = fit_risk_model(history, history.available.shape[1])
    for zone in history.zones:
        # The 4-node gang's curve is fitted on "all 4 up", and those runs are shorter.
        assert model.fitted_levels(zone) == (1, 2, 3, 4)
        assert model.mean_run_s(zone, 4, UP) < model.mean_run_s(zone, 1, UP)
    # A 16-node gang on this model: 4 groups of 4, their dependence read off levels 1..4.
    gangs = model.with_gang_levels([16])
    for zone in history.zones:
        assert gangs.curve(zone, 4, UP) is model.curve(zone, 4, UP)
        assert gangs.mean_run_s(zone, 16, UP) < gangs.mean_run_s(zone, 4, UP)
        assert gangs.mean_run_s(zone, 16, DOWN) >= gangs.mean_run_s(zone, 4, DOWN) * 0.999


def observation(market, zone_index: int, tick: int, nodes: int) -> AllocationObservation:
    zones = market.zones
    return AllocationObservation(
        time_s=0.0, tick_s=float(market.tick_s), trace_time_s=tick * float(market.tick_s),
        work_done_h=0.0, work_checkpointed_h=0.0, work_total_h=40.0 * nodes,
        work_rate_gpu_h_per_h=float(nodes), deadline_s=52 * 3600.0, changeover_s=360.0,
        checkpoint_save_s=60.0, checkpoint_interval_s=3600.0, notice_s=120.0, node_count=nodes,
        zones=zones[zone_index:zone_index + 1], home_zone=zones[zone_index], zone=None,
        spot_nodes=0, on_demand_nodes=0, in_changeover=False, changeover_left_s=0.0,
        last_zone=None,
        spot_available_by_zone=(int(market.spot_available[zone_index, tick]),),
        spot_price_usd_per_hour_by_zone=(0.9731,), on_demand_price_usd_per_hour_by_zone=(3.06,),
        since_checkpoint_s=0.0, since_launch_s=0.0, preemption_times_s=(), launch_failed=False)


def test_gang_decisions_price_the_whole_gang_survival(four_node):
    market, history = four_node
    zone = 1  # us-east-2a: long whole-gang runs
    row = market.spot_available[zone]
    tick = next(t for t in range(2000, row.size) if row[t] == NODES and row[t - 40:t].min()
                == NODES)
    model = fit_risk_model(history, tick, [h for f in ("availability-1node-aws-2023-02",)
                                           for h in folder_histories(f)])
    policy = TrainwiseAllocationPolicy(model)
    obs = observation(market, zone, tick, NODES)
    action = policy.act(obs)
    assert action.spot_nodes == NODES, action.reason
    name = market.zones[zone]
    state, age = model.run_at_cutoff[(name, NODES)]
    assert state == UP
    horizon = obs.remaining_run_s + obs.changeover_s
    p_gang = 1.0 - model.survival(name, age, horizon, obs.trace_time_s, NODES)
    p_one = 1.0 - model.survival(name, model.run_at_cutoff[(name, 1)][1], horizon,
                                 obs.trace_time_s, 1)
    assert action.numbers["best_p_preempt"] == pytest.approx(p_gang)
    assert p_gang != pytest.approx(p_one)
    # A 16-node gang asked of the same model reads 16-node curves, not the 4-node ones.
    policy.act(dataclasses.replace(obs, node_count=16, work_total_h=640.0,
                                   work_rate_gpu_h_per_h=16.0, spot_available_by_zone=(16,)))
    assert policy.model.mean_run_s(name, 16, UP) < model.mean_run_s(name, NODES, UP)


def test_not_costlier_than_uniform_progress_on_real_4node_windows(four_node):
    market, history = four_node
    rules = ClusterRules(changeover_s=360.0, checkpoint_save_s=60.0,
                         checkpoint_interval_s=3600.0, notice_s=120.0, step_slowdown=1.05)
    prior = [h for f in ("availability-1node-aws-2023-02",) for h in folder_histories(f)]
    job = JobSpec(work_gpu_h=4.0 * NODES, deadline_s=5.2 * 3600.0, node_count=NODES)
    ticks = int(job.deadline_s // market.tick_s)
    ours = peer = on_demand = 0.0
    for start in np.linspace(600, market.n_ticks - ticks, 4).astype(int):
        model = fit_risk_model(history, int(start), prior)
        window = market.window(int(start), ticks)
        for zone in window.zones:
            single = window.zone_market(zone)
            a = simulate(TrainwiseAllocationPolicy(model), job, rules, single)
            b = simulate(make_policy("uniform_progress"), job, rules, single)
            c = simulate(make_policy("on_demand"), job, rules, single)
            assert a.deadline_met
            assert a.cost_usd <= c.cost_usd * 1.1, (zone, start, a.cost_usd, c.cost_usd)
            ours, peer, on_demand = ours + a.cost_usd, peer + b.cost_usd, on_demand + c.cost_usd
    assert ours <= peer, (ours, peer, on_demand)
