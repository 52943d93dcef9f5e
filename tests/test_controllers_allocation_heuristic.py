"""trainwise's allocation heuristic: deadlines always met, changeovers that do not pay avoided,
the safer zone chosen, bad input handled, and the slow layer recording its decisions."""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest

from cloud.policy_registry import make_policy
from cloud.risk_fit import AvailabilityHistory, fit_risk_model
from cloud.simulator import ClusterRules, JobSpec, Market, simulate
from controllers.allocation_adapter import SlowAllocationAdapter
from controllers.allocation_heuristic import TrainwiseAllocationConfig, TrainwiseAllocationPolicy
from controllers.allocation_types import AllocationAction, AllocationObservation
from controllers.fast_heuristic import HeuristicFastPolicy
from controllers.multi_timescale import MultiTimescaleController
from controllers.preemption_risk import DOWN, UP, HazardCurve, PreemptionRiskModel
from controllers.slow_heuristic import HeuristicSlowPolicy
from controllers.slow_types import ClusterSummary, DataSummary, LossCurve, Progress, SlowObservation

TICK_S = 195
RULES = ClusterRules(changeover_s=360.0, checkpoint_save_s=60.0, checkpoint_interval_s=3600.0)
ZONES = ("us-west-2a", "us-west-2b")


def observation(**overrides) -> AllocationObservation:
    """Hour 10 of a 48 GPU-h single-node job due at 52 h, on on-demand in us-west-2a."""
    fields = {
        "time_s": 10 * 3600.0, "tick_s": float(TICK_S), "trace_time_s": 10 * 3600.0,
        "work_done_h": 10.0, "work_checkpointed_h": 10.0, "work_total_h": 48.0,
        "work_rate_gpu_h_per_h": 1.0, "deadline_s": 52 * 3600.0, "changeover_s": 360.0,
        "checkpoint_save_s": 60.0, "checkpoint_interval_s": 3600.0, "notice_s": 120.0,
        "node_count": 1, "zones": ZONES[:1], "home_zone": ZONES[0], "zone": ZONES[0],
        "spot_nodes": 0, "on_demand_nodes": 1, "in_changeover": False, "changeover_left_s": 0.0,
        "last_zone": ZONES[0], "spot_available_by_zone": (1,),
        "spot_price_usd_per_hour_by_zone": (0.9731,),
        "on_demand_price_usd_per_hour_by_zone": (3.06,), "since_checkpoint_s": 0.0,
        "since_launch_s": 3600.0, "preemption_times_s": (), "launch_failed": False,
    }
    fields.update(overrides)
    return AllocationObservation(**fields)


def two_rate_model(zones, young_per_h, old_per_h, down_per_h=2.0, up_age_s=None):
    """Up runs end at `young_per_h` before 30 min of age and `old_per_h` after."""
    curves = {}
    for zone in zones:
        curves[(UP, zone, 1)] = HazardCurve((0.0, 1800.0), (young_per_h, old_per_h))
        curves[(DOWN, zone, 1)] = HazardCurve((0.0,), (down_per_h,))
    ages = {(z, 1): (UP, up_age_s) for z in zones} if up_age_s is not None else None
    return PreemptionRiskModel(curves, run_at_cutoff=ages)


def market(rows, zones=None, od=3.06, spot=0.9731) -> Market:
    rows = np.atleast_2d(np.asarray(rows, dtype=np.int64))
    zones = zones or ZONES[: rows.shape[0]]
    return Market(tuple(zones), TICK_S, rows, (spot,) * len(zones), (od,) * len(zones))


def adversarial_markets(ticks: int, nodes: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    t = np.arange(ticks)
    full = nodes
    return {
        "flapping every tick": (t % 2 == 0) * full,
        "short bursts": ((t % 6) < 2) * full,
        "all day, then gone for good": (t < ticks * 0.85) * full,
        "gone, then back at the very end": (t > ticks * 0.8) * full,
        "never": np.zeros(ticks, dtype=int),
        "random 70%": (rng.random(ticks) < 0.7) * full,
        "random partial": rng.integers(0, full + 1, ticks),
    }


@pytest.mark.parametrize("nodes, zones", [(1, 1), (1, 2), (4, 1), (4, 2)])
def test_safety_net_meets_every_deadline_on_adversarial_availability(nodes, zones):
    ticks = 200
    job = JobSpec(work_gpu_h=9.5 * nodes, deadline_s=ticks * TICK_S, node_count=nodes)
    # A model that trusts spot far too much: the safety net must not depend on it.
    optimist = PreemptionRiskModel.constant(mean_up_s=1e6, mean_down_s=60.0)
    for name, pattern in adversarial_markets(ticks, nodes).items():
        rows = [pattern] + [np.roll(pattern, 3 * k) for k in range(1, zones)]
        for model in (None, optimist):
            result = simulate(TrainwiseAllocationPolicy(model), job, RULES, market(rows))
            assert result.deadline_met, (name, nodes, zones, model)


def test_every_action_carries_a_reason_and_numbers():
    ticks = 200
    job = JobSpec(work_gpu_h=9.0, deadline_s=ticks * TICK_S)
    policy = TrainwiseAllocationPolicy()
    actions: list[AllocationAction] = []
    original = policy.act
    policy.act = lambda obs: actions.append(original(obs)) or actions[-1]  # type: ignore
    simulate(policy, job, RULES, market([adversarial_markets(ticks, 1)["short bursts"]]))
    assert actions and all(a.reason and a.numbers for a in actions)
    assert all(math.isfinite(v) or math.isnan(v) for a in actions for v in a.numbers.values())


def test_a_young_run_is_not_worth_two_changeovers_but_an_old_one_is():
    # On on-demand, 10 h into the job with 0.9 h of slack left: young runs die fast here.
    tight = {"work_done_h": 10.0, "deadline_s": (10 + 38 + 0.6 + 0.4) * 3600.0 + 38 * 60.0}
    young = TrainwiseAllocationPolicy(two_rate_model(ZONES[:1], 8.0, 0.05, up_age_s=0.0))
    action = young.act(observation(**tight))
    assert action.spot_nodes == 0 and action.on_demand_nodes == 1, action.reason
    old = TrainwiseAllocationPolicy(two_rate_model(ZONES[:1], 8.0, 0.05, up_age_s=3 * 3600.0))
    action = old.act(observation(**tight))
    assert action.spot_nodes == 1, action.reason
    assert "spot up for 180 min" in action.reason and action.numbers["run_age_s"] == 3 * 3600.0


def test_short_bursts_of_spot_are_not_chased():
    # Spot comes for 2 ticks in every 6: each ride would cost two changeovers for ~7 minutes.
    ticks = 600
    pattern = ((np.arange(2 * ticks) % 6) < 2).astype(int)
    history = AvailabilityHistory("bursts", ZONES[:1], float(TICK_S), pattern[None, :], 1)
    model = fit_risk_model(history, cutoff_tick=ticks)  # learned on the past half only
    window = market([pattern[ticks:]])
    job = JobSpec(work_gpu_h=30.0, deadline_s=ticks * TICK_S)
    peer = simulate(make_policy("uniform_progress"), job, RULES, window)
    # Hourly saves, and saves for faults only (the default): bursts are not chased either way.
    for config in (TrainwiseAllocationConfig(fault_checkpoint_interval=False),
                   TrainwiseAllocationConfig()):
        ours = simulate(TrainwiseAllocationPolicy(model, config), job, RULES, window)
        assert ours.deadline_met and peer.deadline_met
        assert ours.changeovers <= 3 < peer.changeovers
        assert ours.cost_usd < peer.cost_usd


def test_prefers_the_zone_whose_runs_last():
    for risky, safe in (ZONES, ZONES[::-1]):
        curves = {}
        for zone, rate in ((risky, 6.0), (safe, 0.05)):
            curves[(UP, zone, 1)] = HazardCurve((0.0,), (rate,))
            curves[(DOWN, zone, 1)] = HazardCurve((0.0,), (1.0,))
        policy = TrainwiseAllocationPolicy(PreemptionRiskModel(curves))
        obs = observation(zones=ZONES, zone=None, on_demand_nodes=0, since_launch_s=0.0,
                          last_zone=None, spot_available_by_zone=(1, 1),
                          spot_price_usd_per_hour_by_zone=(0.9731,) * 2,
                          on_demand_price_usd_per_hour_by_zone=(3.06,) * 2)
        action = policy.act(obs)
        assert (action.zone, action.spot_nodes) == (safe, 1), action.reason


def test_holding_spot_it_does_not_move_for_a_marginal_gain():
    curves = {}
    for zone, rate in ((ZONES[0], 0.30), (ZONES[1], 0.29)):
        curves[(UP, zone, 1)] = HazardCurve((0.0,), (rate,))
        curves[(DOWN, zone, 1)] = HazardCurve((0.0,), (1.0,))
    policy = TrainwiseAllocationPolicy(PreemptionRiskModel(curves))
    obs = observation(zones=ZONES, spot_nodes=1, on_demand_nodes=0,
                      spot_available_by_zone=(1, 1), spot_price_usd_per_hour_by_zone=(0.9731,) * 2,
                      on_demand_price_usd_per_hour_by_zone=(3.06,) * 2)
    action = policy.act(obs)
    assert (action.zone, action.spot_nodes) == (ZONES[0], 1), action.reason
    assert action.reason.startswith("keep")


@pytest.mark.parametrize("overrides, bad", [
    ({"time_s": math.nan}, "time_s=nan"),
    ({"work_done_h": -1.0}, "work_done_h=-1"),
    ({"deadline_s": 0.0}, "deadline_s=0"),
    ({"tick_s": 0.0}, "tick_s=0"),
    ({"spot_available_by_zone": (1, 1)}, "spot_available_by_zone has 2 values"),
    ({"on_demand_price_usd_per_hour_by_zone": (-3.0,)}, "on_demand_price_usd_per_hour_by_zone"),
])
def test_bad_input_falls_back_to_on_demand_and_says_why(overrides, bad):
    action = TrainwiseAllocationPolicy().act(observation(**overrides))
    assert (action.zone, action.spot_nodes, action.on_demand_nodes) == (ZONES[0], 0, 1)
    assert action.reason.startswith("fallback:") and bad in action.reason
    assert "on-demand" in action.reason


def test_a_gang_size_that_cannot_be_sized_releases():
    action = TrainwiseAllocationPolicy().act(observation(node_count=0))
    assert action.node_total == 0 and action.reason.startswith("fallback:")
    assert "node_count=0" in action.reason


def test_registered_for_the_suite():
    policy = make_policy("trainwise_heuristic")
    assert isinstance(policy, TrainwiseAllocationPolicy)
    assert policy.name == "trainwise_heuristic"


def slow_observation(market_view) -> SlowObservation:
    return SlowObservation(
        time_s=0.0, step=0, data=DataSummary(10_000, 2.0, 1.0, 0.6),
        loss_curve=LossCurve((3.0, 2.6), (0, 100), 10_000),
        progress=Progress(1e5, 1e6, 60.0, 3600.0),
        cluster=ClusterSummary(1, 0, 1, 0, 60.0, 10.0), market=market_view)


def controller() -> MultiTimescaleController:
    slow = HeuristicSlowPolicy(
        allocation_policy=SlowAllocationAdapter(TrainwiseAllocationPolicy()))
    return MultiTimescaleController(HeuristicFastPolicy(), slow, slow_every_s=300.0)


def test_the_slow_layer_records_the_allocation_with_its_reason():
    c = controller()
    obs = observation(spot_available_by_zone=(0,))
    action = c.on_slow_tick(slow_observation(obs), now_s=0.0)
    expected = TrainwiseAllocationPolicy().act(obs)
    assert isinstance(action.allocation, AllocationAction)
    assert action.allocation.reason == expected.reason
    decision = c.decision_log.of_layer("slow")[-1]
    assert "allocation by trainwise_heuristic" in decision.reason
    recorded = decision.action["allocation"]
    assert recorded["reason"] == expected.reason and recorded["numbers"]
    assert (recorded["zone"], recorded["spot_nodes"], recorded["on_demand_nodes"]) == (
        expected.zone, expected.spot_nodes, expected.on_demand_nodes)


def test_the_slow_layer_keeps_nodes_without_a_market_and_survives_a_wrong_one():
    c = controller()
    assert c.on_slow_tick(slow_observation(None), now_s=0.0).allocation is None
    wrong = dataclasses.replace(slow_observation(None), market={"zone": "us-west-2a"})
    action = c.on_slow_tick(wrong, now_s=600.0)
    assert action.allocation is None and action.reason.startswith("fallback:")
    assert "AllocationObservation" in c.decision_log.of_layer("slow")[-1].reason


def test_no_periodic_saves_is_a_valid_interval_not_bad_input():
    # The Can't Be Late scenario runs with checkpoint_interval_s=inf (no saves); the policy used
    # to take it for bad input and sit on on-demand for the whole window.
    action = TrainwiseAllocationPolicy().act(observation(checkpoint_interval_s=math.inf,
                                                         checkpoint_save_s=0.0))
    assert not action.reason.startswith("fallback:"), action.reason
    action = TrainwiseAllocationPolicy().act(observation(checkpoint_interval_s=-math.inf))
    assert action.reason.startswith("fallback:") and "checkpoint_interval_s" in action.reason


def first_interval_s(policy, **overrides) -> tuple[float | None, str]:
    action = policy.act(observation(time_s=0.0, work_done_h=0.0, work_checkpointed_h=0.0,
                                    **overrides))
    return action.checkpoint_interval_s, action.reason


def test_periodic_saves_only_insure_against_faults_when_the_notice_covers_a_save():
    """A 60 s save fits in the 120 s notice: a reclaim loses nothing, so the job checkpoints for
    node faults only: Daly's interval (13.7 h at one fault per 5,679 node-hours), halved until
    losing one interval and a restart still fits the slack (4 h here: 13.7 / 4 = 3.4 h)."""
    interval, reason = first_interval_s(TrainwiseAllocationPolicy())
    assert interval == pytest.approx(13.75 * 3600.0 / 4, rel=0.01)
    assert "fits in the 120 s notice" in reason and "Daly" in reason
    # Ample slack: the whole Daly interval.
    interval, _ = first_interval_s(TrainwiseAllocationPolicy(), deadline_s=80 * 3600.0)
    assert interval == pytest.approx(13.75 * 3600.0, rel=0.01)
    # Thin slack (losing 2 h would cost the deadline): the job's own hourly interval.
    assert first_interval_s(TrainwiseAllocationPolicy(), deadline_s=49.9 * 3600.0)[0] is None
    # A save longer than the notice: reclaims lose work, so the job's own interval stands.
    interval, _ = first_interval_s(TrainwiseAllocationPolicy(), checkpoint_save_s=300.0)
    assert interval is None
    off = TrainwiseAllocationPolicy(config=TrainwiseAllocationConfig(
        fault_checkpoint_interval=False))
    assert first_interval_s(off)[0] is None


def test_a_fault_never_costs_the_deadline():
    """One node fault (no notice) at the worst moment, just before a save would land: the job
    still finishes in time, because the interval shrinks with the slack."""
    ticks = int(52 * 3600 // TICK_S)
    job = JobSpec(work_gpu_h=48.0, deadline_s=52 * 3600.0, node_count=1)
    window = market([np.zeros(ticks, dtype=int)])  # on-demand all along
    for fault_at_h in (3.3, 10.0, 20.0, 30.0, 40.0, 46.0):
        class OneFault:  # the simulator's fault sampler, with one fault at a chosen instant
            def __init__(self, at_s: float) -> None:
                self.at_s = at_s

            def fault_times_s(self, horizon_s: float, nodes: int) -> list[float]:
                return [self.at_s]

        result = simulate(TrainwiseAllocationPolicy(), job, RULES, window,
                          fault_sampler=OneFault(fault_at_h * 3600.0))
        assert result.faults == 1 and result.deadline_met, fault_at_h


@pytest.mark.parametrize("nodes, hours", [(16, 48.0), (16, 2.0)])
def test_a_gang_keeps_the_job_interval(nodes, hours):
    """Gangs size their fault reserve on the job's interval; none asks for a longer one, likely
    fault (16 nodes, 48 h: p ~ 13%) or not (2 h: p ~ 0.6%)."""
    gang = {"node_count": nodes, "work_total_h": hours * nodes, "work_rate_gpu_h_per_h": nodes,
            "on_demand_nodes": nodes, "spot_available_by_zone": (nodes,),
            "deadline_s": hours * 1.1 * 3600.0}
    interval, reason = first_interval_s(TrainwiseAllocationPolicy(), **gang)
    assert interval is None or interval <= 3600.0, reason
