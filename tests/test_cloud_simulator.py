"""The trace-driven simulator: exact event traces and bills on small synthetic markets."""

from __future__ import annotations

import numpy as np
import pytest

from cloud.faults import FaultSampler, FaultTrace
from cloud.policies import GreedySpotPolicy, OnDemandPolicy, UniformProgressPolicy
from cloud.simulator import ClusterRules, JobSpec, Market, job_horizon, simulate
from controllers.allocation_types import AllocationAction

# 100 s ticks; spot 1.8 USD/h = 0.0005 USD/s, on-demand 3.6 USD/h = 0.001 USD/s per node.
RULES = ClusterRules(
    changeover_s=150, checkpoint_save_s=10, checkpoint_interval_s=1000, notice_s=120
)
JOB = JobSpec(work_gpu_h=0.25, deadline_s=3000)  # 900 s of training on one 1-GPU node


def market(*rows: list[int], zones: tuple[str, ...] = ("us-west-2a", "us-west-2b")) -> Market:
    available = np.array(rows, dtype=np.int64)
    n = available.shape[0]
    return Market(zones[:n], 100, available, (1.8,) * n, (3.6,) * n)


class Script:
    """Plays one action per tick, then repeats the last."""

    name = "script"

    def __init__(self, actions: list[AllocationAction]):
        self.actions = actions

    def act(self, obs):
        return self.actions[min(round(obs.time_s / obs.tick_s), len(self.actions) - 1)]


def spot(zone="us-west-2a", n=1):
    return AllocationAction(zone, n, 0)


def on_demand(zone="us-west-2a", n=1):
    return AllocationAction(zone, 0, n)


IDLE = AllocationAction.release("wait")


def test_on_demand_bill_is_changeover_plus_training_per_second():
    result = simulate(OnDemandPolicy(), JOB, RULES, market([0] * 30), record_events=True)
    # 150 s changeover, then 900 s of training: done 1050 s in, billed 1050 s at 0.001 USD/s.
    assert result.finish_s == pytest.approx(1050)
    assert result.cost_usd == pytest.approx(1.05)
    assert result.deadline_met and result.completion_usd == 0
    assert result.changeover_node_s == pytest.approx(150)
    assert result.spot_share == 0
    assert result.utilization == pytest.approx(0.25 / (1050 / 3600))
    assert [e[1] for e in result.events] == ["launch", "finish"]


def test_periodic_checkpoints_pause_training():
    rules = ClusterRules(changeover_s=150, checkpoint_save_s=10, checkpoint_interval_s=300)
    result = simulate(OnDemandPolicy(checkpoint_interval_s=300), JOB, rules, market([0] * 30))
    # Saves after 300 and 600 s of training (none at the end): 20 s more.
    assert result.finish_s == pytest.approx(1070)
    assert result.checkpoint_node_s == pytest.approx(20)
    assert result.waste_share == pytest.approx(170 / 1070)


def test_preemption_with_a_notice_save_loses_nothing_but_the_save():
    avail = [1, 1, 1, 1, 0, 0] + [1] * 24
    result = simulate(GreedySpotPolicy(), JOB, RULES, market(avail), record_events=True)
    # Spot from t=0 (training from 150 s): 250 s done by 400 s, minus the 10 s notice save.
    # Relaunch at 600 s, training from 750 s: 660 s more, done at 1410 s.
    assert [(t, kind) for t, kind, _ in result.events] == [
        (0, "launch"),
        (400, "preempted"),
        (600, "launch"),
        (1410, "finish"),
    ]
    assert result.cost_usd == pytest.approx((400 + 810) * 0.0005)
    assert result.lost_node_s == 0
    assert result.checkpoint_node_s == pytest.approx(10)
    assert result.changeover_node_s == pytest.approx(300)
    assert result.preemptions == 1 and result.spot_share == 1


def test_preemption_without_time_to_save_loses_the_unsaved_work():
    rules = ClusterRules(
        changeover_s=150, checkpoint_save_s=200, checkpoint_interval_s=1000, notice_s=120
    )
    avail = [1, 1, 1, 1, 0, 0] + [1] * 24
    result = simulate(GreedySpotPolicy(), JOB, rules, market(avail), record_events=True)
    assert result.lost_node_s == pytest.approx(250)
    # All 900 s again after the relaunch at 600 s: done at 600 + 150 + 900.
    assert result.finish_s == pytest.approx(1650)


def test_a_launch_that_finds_no_spot_keeps_the_current_nodes():
    result = simulate(
        Script([on_demand(), on_demand(), spot()]), JOB, RULES, market([0] * 30), record_events=True
    )
    kinds = [kind for _, kind, _ in result.events]
    assert kinds[:2] == ["launch", "launch_failed"]
    # Spot asked from tick 2 to the finish in tick 10: nine failed launches, no changeover.
    assert result.changeovers == 1 and result.launch_failures == 9
    assert result.finish_s == pytest.approx(1050)


def test_a_voluntary_move_saves_first_on_the_old_nodes():
    # On-demand for 5 ticks, then spot: the save (10 s on-demand) precedes the move.
    actions = [on_demand()] * 5 + [spot()]
    result = simulate(Script(actions), JOB, RULES, market([1] * 30), record_events=True)
    assert result.checkpoint_node_s == pytest.approx(10)
    assert result.on_demand_node_s == pytest.approx(500 + 10)
    # 350 s trained on on-demand, 550 s more on spot after a 150 s changeover from 500 s.
    assert result.finish_s == pytest.approx(500 + 150 + 550)
    assert result.cost_usd == pytest.approx(510 * 0.001 + 700 * 0.0005)


def test_a_gang_is_released_when_one_member_is_preempted():
    job = JobSpec(work_gpu_h=0.5, deadline_s=3000, node_count=2)
    avail = [2, 2, 2, 1, 1] + [2] * 25
    result = simulate(Script([spot(n=2)]), job, RULES, market(avail), record_events=True)
    events = [(t, kind) for t, kind, _ in result.events if kind != "launch_failed"]
    assert events[:3] == [(0, "launch"), (300, "preempted"), (500, "launch")]
    assert result.launch_failures == 2  # ticks 3 and 4 have one spot node for a gang of two


def test_the_deadline_missed_is_finished_on_demand_and_charged():
    result = simulate(Script([IDLE]), JOB, RULES, market([1] * 30))
    assert not result.deadline_met
    assert result.window_cost_usd == 0
    assert result.completion_usd == pytest.approx((900 + 150) * 0.001)
    assert result.cost_usd == result.completion_usd


def test_stragglers_stretch_the_training():
    rules = ClusterRules(
        changeover_s=150, checkpoint_save_s=10, checkpoint_interval_s=1e9, step_slowdown=1.5
    )
    result = simulate(OnDemandPolicy(checkpoint_interval_s=1e9), JOB, rules, market([0] * 30))
    assert result.finish_s == pytest.approx(150 + 1350)
    assert result.utilization == pytest.approx(0.25 / (1500 / 3600))


def test_faults_are_deterministic_for_a_seed_and_cost_work():
    trace = FaultTrace(
        cluster_interarrival_s=np.array([400.0, 900.0]),
        repair_s=np.array([60.0]),
        cluster_nodes=1,
        span_s=1300.0,
        source_path="synthetic",
    )
    job = JobSpec(work_gpu_h=0.5, deadline_s=6000)
    one = simulate(
        OnDemandPolicy(), job, RULES, market([0] * 60), fault_sampler=FaultSampler(trace, 5)
    )
    two = simulate(
        OnDemandPolicy(), job, RULES, market([0] * 60), fault_sampler=FaultSampler(trace, 5)
    )
    clean = simulate(OnDemandPolicy(), job, RULES, market([0] * 60))
    assert one == two
    assert one.faults > 0 and one.lost_node_s > 0
    assert one.cost_usd > clean.cost_usd


def test_bad_actions_and_jobs_are_refused():
    with pytest.raises(ValueError, match="needs 0 or exactly node_count=2"):
        simulate(Script([spot(n=1)]), JobSpec(0.5, 3000, node_count=2), RULES, market([2] * 30))
    with pytest.raises(ValueError, match="asked for zone 'eu-west-1a'"):
        simulate(Script([spot(zone="eu-west-1a")]), JOB, RULES, market([1] * 30))
    with pytest.raises(ValueError, match="is shorter than the work"):
        job_horizon(JobSpec(0.25, 1000), RULES, market([1] * 30))
    with pytest.raises(ValueError, match="longer than the market window"):
        job_horizon(JobSpec(0.25, 5000), RULES, market([1] * 30))
    with pytest.raises(ValueError, match="home_zone 'x'"):
        simulate(GreedySpotPolicy(), JOB, RULES, market([1] * 30), home_zone="x")
    with pytest.raises(ValueError, match="work_gpu_h=0 must be positive"):
        JobSpec(0, 100)
    with pytest.raises(ValueError, match="step_slowdown"):
        ClusterRules(step_slowdown=0.9)


def test_observation_tells_the_policy_what_happened():
    seen = []

    class Recorder:
        name = "recorder"

        def act(self, obs):
            seen.append(obs)
            return spot()

    avail = [1, 1, 1, 0, 1] + [1] * 25
    simulate(Recorder(), JOB, RULES, market(avail, [0] * 30))
    first, after = seen[0], seen[3]
    assert first.zones == ("us-west-2a", "us-west-2b") and first.spot_available_by_zone == (1, 0)
    assert first.zone is None and first.last_zone is None and first.deadline_s == 3000
    assert (
        after.preemption_times_s == (300.0,)
        and after.zone is None
        and after.last_zone == "us-west-2a"
    )
    assert after.launch_failed is False and seen[4].launch_failed is True
    assert seen[2].in_changeover is False and seen[1].in_changeover is True
    assert seen[2].work_done_h == pytest.approx(50 / 3600)


# The Can't Be Late accounting on 100 s ticks: 100 s changeover, no saves, finishing tick billed
# whole. 900 s of work due in 30 ticks: 9 ticks of running, 1 of changeover, 20 of slack.
CBL_RULES = ClusterRules(
    changeover_s=100, checkpoint_save_s=0, checkpoint_interval_s=float("inf"),
    bill_finishing_tick_whole=True,
)


def test_finishing_tick_is_billed_whole_when_the_rules_say_so():
    # 150 s changeover + 900 s of training end 50 s into tick 10: 1050 s per second, 1100 s whole.
    whole = ClusterRules(changeover_s=150, checkpoint_save_s=0, checkpoint_interval_s=1000,
                         bill_finishing_tick_whole=True)
    per_second = simulate(OnDemandPolicy(), JOB, RULES, market([0] * 30))
    billed_whole = simulate(OnDemandPolicy(), JOB, whole, market([0] * 30))
    assert per_second.cost_usd == pytest.approx(1.05)
    assert billed_whole.cost_usd == pytest.approx(1.10)
    assert billed_whole.finish_s == pytest.approx(1050)


def test_greedy_rides_spot_past_the_safety_point_until_preempted():
    """Spot is down for 19 ticks, back at tick 19: greedy launches it (changeover in tick 19).
    At tick 20 the remaining 900 s plus a changeover fill the 10 ticks left: the safety point.
    The published greedy keeps the running spot node; the project's first one left for
    on-demand (a second changeover and 9 ticks at twice the price, ending exactly on time)."""
    rides = simulate(GreedySpotPolicy(), JOB, CBL_RULES, market([0] * 19 + [1] * 11),
                     record_events=True)
    assert [e[1] for e in rides.events] == ["launch", "finish"]
    assert rides.on_demand_node_s == 0
    assert rides.cost_usd == pytest.approx(10 * 100 * 0.0005)  # changeover + 9 spot ticks
    # Preempted at tick 25 while riding: on-demand, and the deadline still holds (to the tick).
    preempted = simulate(GreedySpotPolicy(), JOB, CBL_RULES,
                         market([0] * 19 + [1] * 6 + [0] * 5), record_events=True)
    assert [e[1] for e in preempted.events] == ["launch", "preempted", "launch", "finish"]
    assert preempted.deadline_met and preempted.finish_s == pytest.approx(3000)


def test_uniform_progress_keeps_on_demand_ahead_of_the_line_while_spot_is_down():
    """No spot at all: Uniform Progress falls behind the line at tick 1 and launches on-demand;
    it soon runs ahead of the line, but with spot down the published policy keeps on-demand to
    the finish (one launch). The project's first version released and relaunched, paying a
    changeover each time it fell behind again."""
    result = simulate(UniformProgressPolicy(), JOB, CBL_RULES, market([0] * 30),
                      record_events=True)
    assert [e[1] for e in result.events] == ["launch", "finish"]
    assert result.changeovers == 1
    assert result.finish_s == pytest.approx(1100)  # launched at 100 s, 100 s changeover, 900 s
    assert result.cost_usd == pytest.approx(10 * 100 * 0.001)
