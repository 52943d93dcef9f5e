"""Issue 10: the simulator and the emulated run must show the policy the same figures and model
the same reclaim. Two systematic differences made the fidelity outliers (single-zone
us-east-1a@556, us-east-1d@1676): the policy was shown the calibrated changeover in the
simulator and the provider's configured one in the emulated run (two slack plans), and the
emulated trainer finishes its step in flight inside a reclaim's notice where the simulator cut a
save from the work."""

from __future__ import annotations

import numpy as np
import pytest

from benchmarks.fidelity import SameView
from cloud.simulator import ClusterRules, JobSpec, Market, job_horizon, simulate
from controllers.allocation_types import AllocationAction

JOB = JobSpec(work_gpu_h=0.25, deadline_s=3000)  # 900 s of training on one 1-GPU node
STEP_S = 40.0
SAVE_S = 5.0


class SpotWhenUp:
    """Holds one spot node while the zone has one, else nothing; records what it is shown."""

    name = "spot_when_up"

    def __init__(self) -> None:
        self.seen: list = []

    def act(self, observation):
        self.seen.append(observation)
        up = observation.spot_available_by_zone[0] >= 1
        return AllocationAction(observation.zones[0], 1 if up else 0, 0)


def reclaimed_at_tick_3() -> Market:
    # 100 s ticks: spot for ticks 0-2 (300 s of training, 7.5 steps of 40 s), then gone.
    available = np.array([[1, 1, 1] + [0] * 40], dtype=np.int64)
    return Market(("us-west-2a",), 100, available, (1.0,), (3.0,))


def run(train_step_s: float) -> tuple[list, float]:
    rules = ClusterRules(changeover_s=0.0, checkpoint_save_s=SAVE_S, checkpoint_interval_s=5000.0,
                         notice_s=120.0, train_step_s=train_step_s)
    policy = SpotWhenUp()
    market = reclaimed_at_tick_3()
    simulate(policy, JOB, rules, market)
    return policy.seen, job_horizon(JOB, rules, market).run_s


def seconds(work_h: float, run_s: float) -> float:
    return work_h / JOB.work_gpu_h * run_s


def test_stepped_trainer_finishes_its_step_in_flight_inside_the_notice() -> None:
    seen, run_s = run(STEP_S)
    at_reclaim, after = seen[3], seen[4]
    # At the reclaim tick the policy sees the completed steps (7 of 40 s), as the emulated
    # trainer reports them; the 8th finishes inside the notice and is saved.
    assert seconds(at_reclaim.work_done_h, run_s) == pytest.approx(7 * STEP_S)
    assert seconds(after.work_done_h, run_s) == pytest.approx(8 * STEP_S)
    assert seconds(after.work_checkpointed_h, run_s) == pytest.approx(8 * STEP_S)


def test_continuous_rule_is_unchanged_by_default() -> None:
    seen, run_s = run(0.0)
    # The save is cut from the last tick's training (the notice fell inside it).
    assert seconds(seen[4].work_checkpointed_h, run_s) == pytest.approx(300.0 - SAVE_S)
    assert seconds(seen[2].work_done_h, run_s) == pytest.approx(200.0)


def test_stepped_rule_rejects_a_negative_step() -> None:
    with pytest.raises(ValueError, match="train_step_s"):
        ClusterRules(train_step_s=-1.0)


def test_same_view_shows_the_emulated_changeover_and_its_countdown() -> None:
    policy = SpotWhenUp()
    market = reclaimed_at_tick_3()
    rules = ClusterRules(changeover_s=376.5, checkpoint_save_s=SAVE_S)
    simulate(SameView(policy, SAVE_S, 600.0, JOB.work_gpu_h, changeover_s=360.0), JOB, rules,
             market)
    shown = policy.seen
    assert all(o.changeover_s == 360.0 for o in shown)
    # Launched at tick 0; at tick 1 (100 s) the emulated countdown is 360 - 100, not 376.5 - 100.
    assert shown[1].changeover_left_s == pytest.approx(260.0)
    assert shown[1].in_changeover
    assert shown[3].changeover_left_s == 0.0 and not shown[3].in_changeover  # nothing held


def test_same_view_without_a_changeover_keeps_the_simulators() -> None:
    policy = SpotWhenUp()
    rules = ClusterRules(changeover_s=376.5, checkpoint_save_s=SAVE_S)
    simulate(SameView(policy, SAVE_S, 600.0, JOB.work_gpu_h), JOB, rules, reclaimed_at_tick_3())
    assert policy.seen[1].changeover_s == 376.5
    assert policy.seen[1].changeover_left_s == pytest.approx(276.5)


def test_step_that_cannot_finish_inside_the_notice_is_lost() -> None:
    rules = ClusterRules(changeover_s=0.0, checkpoint_save_s=SAVE_S, checkpoint_interval_s=5000.0,
                         notice_s=120.0, train_step_s=250.0)  # 300 s: 1 step + 50 s; 200 s to go
    policy = SpotWhenUp()
    market = reclaimed_at_tick_3()
    simulate(policy, JOB, rules, market)
    run_s = job_horizon(JOB, rules, market).run_s
    assert seconds(policy.seen[4].work_checkpointed_h, run_s) == pytest.approx(250.0)
