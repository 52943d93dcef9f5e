"""The peers' allocation policies: the registry, each policy's rules, and deadline safety."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from cloud.policies import at_safety_point
from cloud.policy_registry import make_policy, policy_names, register_policy
from cloud.simulator import ClusterRules, JobSpec, Market, simulate
from controllers.allocation_types import AllocationAction, AllocationObservation

BUILTINS = ("on_demand", "managed_spot", "greedy_spot", "skypilot_failover", "uniform_progress")


def observation(**overrides) -> AllocationObservation:
    """Hour 10 of a 48 GPU-h, 52 h single-node job, idle, spot available in the home zone."""
    fields = {
        "time_s": 10 * 3600.0,
        "tick_s": 195.0,
        "trace_time_s": 0.0,
        "work_done_h": 10.0,
        "work_checkpointed_h": 10.0,
        "work_total_h": 48.0,
        "work_rate_gpu_h_per_h": 1.0,
        "deadline_s": 52 * 3600.0,
        "changeover_s": 360.0,
        "checkpoint_save_s": 60.0,
        "checkpoint_interval_s": 3600.0,
        "notice_s": 120.0,
        "node_count": 1,
        "zones": ("us-east-1a", "us-east-1c", "us-east-1d"),
        "home_zone": "us-east-1a",
        "zone": None,
        "spot_nodes": 0,
        "on_demand_nodes": 0,
        "in_changeover": False,
        "changeover_left_s": 0.0,
        "last_zone": None,
        "spot_available_by_zone": (1, 1, 1),
        "spot_price_usd_per_hour_by_zone": (0.9731,) * 3,
        "on_demand_price_usd_per_hour_by_zone": (3.06,) * 3,
        "since_checkpoint_s": 0.0,
        "since_launch_s": 0.0,
        "preemption_times_s": (),
        "launch_failed": False,
    }
    fields.update(overrides)
    return AllocationObservation(**fields)


def holding(kind: str, zone: str = "us-east-1a", **overrides) -> AllocationObservation:
    spot, od = (1, 0) if kind == "spot" else (0, 1)
    fields = {
        "zone": zone,
        "last_zone": zone,
        "spot_nodes": spot,
        "on_demand_nodes": od,
        "since_launch_s": 7200.0,
    }
    return observation(**{**fields, **overrides})


def plan(action: AllocationAction) -> tuple:
    return (action.zone, action.spot_nodes, action.on_demand_nodes)


def test_registry_lists_the_builtins_and_refuses_unknown_names():
    assert policy_names()[:5] == BUILTINS
    with pytest.raises(
        ValueError, match="unknown allocation policy 'magic'; valid: on_demand, managed_spot"
    ):
        make_policy("magic")
    with pytest.raises(ValueError, match="already registered"):
        register_policy("greedy_spot", lambda: None)
    first, second = make_policy("greedy_spot"), make_policy("greedy_spot")
    assert first is not second and first.name == "greedy_spot"


@pytest.mark.parametrize("name", BUILTINS)
def test_policies_are_pure_and_explain_themselves(name):
    policy = make_policy(name)
    for obs in (
        observation(),
        holding("spot"),
        holding("od"),
        observation(spot_available_by_zone=(0, 0, 0)),
    ):
        first, again = policy.act(obs), make_policy(name).act(obs)
        assert first == again
        assert first.reason
        assert first.node_total in (0, obs.node_count)


def test_on_demand_launches_and_keeps_on_demand_in_the_home_zone():
    policy = make_policy("on_demand", checkpoint_interval_s=1800.0)
    assert plan(policy.act(observation())) == ("us-east-1a", 0, 1)
    assert policy.act(observation()).checkpoint_interval_s == 1800.0
    assert plan(policy.act(holding("od"))) == ("us-east-1a", 0, 1)


def test_managed_spot_fills_with_on_demand_and_moves_back_after_the_rebalance_time():
    policy = make_policy("managed_spot")
    assert plan(policy.act(observation(spot_available_by_zone=(0, 1, 1)))) == ("us-east-1a", 0, 1)
    assert plan(policy.act(observation())) == ("us-east-1a", 1, 0)
    # On on-demand for 2 h and spot is back: move back; 10 min in: keep.
    assert plan(policy.act(holding("od"))) == ("us-east-1a", 1, 0)
    assert plan(policy.act(holding("od", since_launch_s=600.0))) == ("us-east-1a", 0, 1)
    # A 4-node gang with 3 spot nodes available: 3 spot + 1 on-demand.
    gang = observation(node_count=4, spot_available_by_zone=(3, 0, 0))
    assert plan(policy.act(gang)) == ("us-east-1a", 3, 1)


# With 9 GPU-h done, 39 h of run + 39 saves + a changeover + a notice save need 735 ticks of 195 s:
# the safety point is reached when 735 whole ticks are left (hour 12.19 of 52).
SAFETY = {"work_done_h": 9.0, "work_checkpointed_h": 9.0, "time_s": 52 * 3600.0 - 735 * 195}
BEFORE_SAFETY = {**SAFETY, "time_s": SAFETY["time_s"] - 195}


def test_safety_point_is_the_published_whole_tick_test():
    assert at_safety_point(observation(**SAFETY))
    assert not at_safety_point(observation(**BEFORE_SAFETY))
    # Two changeovers (Uniform Progress's net) need 736 ticks: reached one tick earlier.
    assert at_safety_point(observation(**BEFORE_SAFETY), changeovers=2)
    two_early = {**SAFETY, "time_s": SAFETY["time_s"] - 2 * 195}
    assert not at_safety_point(observation(**two_early), changeovers=2)


def test_greedy_waits_for_spot_until_the_safety_point():
    policy = make_policy("greedy_spot")
    assert plan(policy.act(observation())) == ("us-east-1a", 1, 0)
    no_spot = {"spot_available_by_zone": (0, 1, 1)}
    assert plan(policy.act(observation(**no_spot))) == (None, 0, 0)
    assert plan(policy.act(observation(**no_spot, **BEFORE_SAFETY))) == (None, 0, 0)
    assert plan(policy.act(observation(**no_spot, **SAFETY))) == ("us-east-1a", 0, 1)
    # Idle at the safety point with spot up: on-demand, not spot (a launch there is a risk).
    assert plan(policy.act(observation(**SAFETY))) == ("us-east-1a", 0, 1)
    assert plan(policy.act(holding("od", **SAFETY))) == ("us-east-1a", 0, 1)


def test_greedy_rides_a_running_spot_node_past_the_safety_point():
    """Published strawman: at the safety point a running spot node is kept until preempted
    (the project's first greedy left it for on-demand)."""
    policy = make_policy("greedy_spot")
    action = policy.act(holding("spot", **SAFETY))
    assert plan(action) == ("us-east-1a", 1, 0)
    assert "until preempted" in action.reason
    # Still in its changeover it has not proved itself: on-demand.
    in_changeover = holding("spot", in_changeover=True, changeover_left_s=100.0, **SAFETY)
    assert plan(policy.act(in_changeover)) == ("us-east-1a", 0, 1)


def test_uniform_progress_rule_1_on_demand_when_idle_and_behind_the_line():
    policy = make_policy("uniform_progress")
    # Hour 10 of 52: the line is at 48 * 10 / 52 = 9.23 GPU-h.
    behind = observation(work_done_h=9.0, work_checkpointed_h=9.0, spot_available_by_zone=(0, 1, 1))
    assert plan(policy.act(behind)) == ("us-east-1a", 0, 1)
    ahead = dataclasses.replace(behind, work_done_h=9.5, work_checkpointed_h=9.5)
    assert plan(policy.act(ahead)) == (None, 0, 0)


def test_uniform_progress_rule_2_takes_spot_whenever_available():
    policy = make_policy("uniform_progress")
    assert plan(policy.act(observation(work_done_h=9.0, work_checkpointed_h=9.0))) == (
        "us-east-1a",
        1,
        0,
    )
    assert plan(policy.act(holding("spot", work_done_h=9.0))) == ("us-east-1a", 1, 0)


def test_uniform_progress_rule_3_stays_on_demand_until_ahead_by_two_changeovers():
    policy = make_policy("uniform_progress")
    # Two changeovers (0.2 h) after hour 10 the line is at 48 * 10.2 / 52 = 9.415 GPU-h.
    just_ahead = holding("od", work_done_h=9.3, work_checkpointed_h=9.3)
    assert plan(policy.act(just_ahead)) == ("us-east-1a", 0, 1)
    far_ahead = dataclasses.replace(just_ahead, work_done_h=9.5, work_checkpointed_h=9.5)
    assert plan(policy.act(far_ahead)) == ("us-east-1a", 1, 0)


def test_uniform_progress_keeps_on_demand_while_spot_is_down_even_when_ahead():
    """Published rc_cr_threshold: on on-demand with spot down it keeps on-demand, however far
    ahead of the line (the project's first version released the node and waited)."""
    policy = make_policy("uniform_progress")
    far_ahead = holding("od", work_done_h=20.0, work_checkpointed_h=20.0,
                        spot_available_by_zone=(0, 0, 0))
    action = policy.act(far_ahead)
    assert plan(action) == ("us-east-1a", 0, 1)
    assert "spot is down" in action.reason


def test_uniform_progress_rule_4_safety_nets():
    policy = make_policy("uniform_progress")
    two_early = BEFORE_SAFETY
    # Idle or on on-demand at the two-changeover net: on-demand to the end, spot or not.
    assert plan(policy.act(observation(**two_early))) == ("us-east-1a", 0, 1)
    assert "safety net" in policy.act(observation(**two_early)).reason
    # Greedy still waits there.
    assert plan(make_policy("greedy_spot").act(observation(**two_early))) == ("us-east-1a", 1, 0)
    # On spot the two-changeover net does not apply, and at the one-changeover point a running
    # spot node rides until preempted, as in greedy.
    assert plan(policy.act(holding("spot", **two_early))) == ("us-east-1a", 1, 0)
    assert plan(policy.act(holding("spot", **SAFETY))) == ("us-east-1a", 1, 0)
    in_changeover = holding("spot", in_changeover=True, changeover_left_s=100.0, **SAFETY)
    assert plan(policy.act(in_changeover)) == ("us-east-1a", 0, 1)


def test_skypilot_failover_moves_to_the_next_zone_with_spot_and_tries_the_lost_zone_last():
    policy = make_policy("skypilot_failover")
    assert plan(policy.act(observation())) == ("us-east-1a", 1, 0)
    after_a = observation(last_zone="us-east-1a", preemption_times_s=(3600.0,))
    assert plan(policy.act(dataclasses.replace(after_a, spot_available_by_zone=(1, 0, 1)))) == (
        "us-east-1d",
        1,
        0,
    )
    assert plan(policy.act(dataclasses.replace(after_a, spot_available_by_zone=(1, 0, 0)))) == (
        "us-east-1a",
        1,
        0,
    )
    assert plan(policy.act(dataclasses.replace(after_a, spot_available_by_zone=(0, 0, 0)))) == (
        None,
        0,
        0,
    )
    assert plan(policy.act(holding("spot", zone="us-east-1c"))) == ("us-east-1c", 1, 0)


@pytest.mark.parametrize("name", ["on_demand", "greedy_spot", "uniform_progress"])
@pytest.mark.parametrize("seed", range(6))
def test_deadline_aware_policies_meet_every_deadline_on_random_markets(name, seed):
    rng = np.random.default_rng(seed)
    ticks = 120
    # Flapping availability: runs of random length, the hardest case for late switching.
    available = np.repeat(rng.integers(0, 2, size=ticks), rng.integers(1, 6, size=ticks))[:ticks]
    market = Market(("us-east-1a",), 195, available[None, :], (0.9731,), (3.06,))
    job = JobSpec(work_gpu_h=float(rng.uniform(3.0, 5.5)), deadline_s=ticks * 195.0)
    rules = ClusterRules(changeover_s=360.0, checkpoint_save_s=60.0, checkpoint_interval_s=3600.0)
    result = simulate(make_policy(name), job, rules, market)
    assert result.deadline_met, f"{name} missed the deadline on seed {seed}"
