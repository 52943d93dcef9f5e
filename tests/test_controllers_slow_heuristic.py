import dataclasses
import math

import pytest

from controllers.checkpoint_interval import CheckpointTunerConfig
from controllers.checkpointing import daly_interval_s, mtbf_from_risk_s
from controllers.slow_heuristic import HeuristicSlowPolicy, SlowHeuristicConfig
from controllers.slow_types import (
    ClusterSummary,
    DataSummary,
    LossCurve,
    Progress,
    SlowObservation,
)

BASE = SlowObservation(
    time_s=600.0, step=1000,
    data=DataSummary(num_examples=10_000, mean_loss_score=2.0, std_loss_score=1.0,
                     share_below_mean=0.6),
    loss_curve=LossCurve(eval_losses=(3.0, 2.6, 2.3), eval_steps=(0, 500, 1000),
                         tokens_seen=1_000_000),
    progress=Progress(work_done=3e5, work_total=1e6, elapsed_s=600.0, time_left_s=3000.0),
    cluster=ClusterSummary(nodes=4, spot_nodes=4, on_demand_nodes=0, preemptions_observed=0,
                           observed_for_s=600.0, checkpoint_cost_s=20.0),
)


def obs(cluster: dict | None = None, **changes) -> SlowObservation:
    if cluster:
        changes["cluster"] = dataclasses.replace(BASE.cluster, **cluster)
    return dataclasses.replace(BASE, **changes)


def no_forgetting_policy(**kwargs) -> HeuristicSlowPolicy:
    # No separate node-fault term: the 4 h prior stands for every interruption, as the numbers
    # below were worked out (the default adds the fault log's rate, 0.3% off at 4 nodes).
    config = SlowHeuristicConfig(checkpoint=CheckpointTunerConfig(
        forget_half_life_s=None, cost_ema_beta=0.0, prior_mtbf_s=4 * 3600.0,
        fault_rate_per_node_h=0.0))
    return HeuristicSlowPolicy(config, **kwargs)


def test_first_tick_prunes_and_sets_the_daly_interval():
    a = no_forgetting_policy().act(BASE)
    assert a.pruning_rate == pytest.approx(0.5) and a.pruning_upweight == pytest.approx(2.0)
    mtbf = (4 * 3600.0 + 600.0) / 1.0
    assert a.checkpoint_interval_s == pytest.approx(daly_interval_s(20.0, mtbf))
    assert a.allocation is None and "no allocation policy" in a.reason
    assert a.numbers["mtbf_s"] == pytest.approx(mtbf)


def test_interval_retunes_as_preemptions_are_observed():
    policy = no_forgetting_policy()
    calm = policy.act(BASE)
    wild = policy.act(obs(cluster={"preemptions_observed": 12, "observed_for_s": 3 * 3600.0}))
    assert wild.checkpoint_interval_s < calm.checkpoint_interval_s / 2
    assert "re-tuned" in wild.reason
    expected_mtbf = (4 * 3600.0 + 3 * 3600.0) / 13
    assert wild.numbers["mtbf_s"] == pytest.approx(expected_mtbf)
    steady = policy.act(obs(cluster={"preemptions_observed": 12, "observed_for_s": 3 * 3600.0}))
    assert "kept at" in steady.reason


def test_preemptions_saved_by_notice_do_not_shorten_the_interval():
    saved = no_forgetting_policy().act(obs(cluster={
        "preemptions_observed": 12, "preemptions_saved_by_notice": 12,
        "observed_for_s": 3 * 3600.0}))
    lossy = no_forgetting_policy().act(obs(cluster={
        "preemptions_observed": 12, "observed_for_s": 3 * 3600.0}))
    assert saved.numbers["mtbf_s"] == pytest.approx(4 * 3600.0 + 3 * 3600.0)
    assert saved.checkpoint_interval_s > 3 * lossy.checkpoint_interval_s


def test_interval_retunes_when_checkpoint_cost_changes():
    policy = no_forgetting_policy()
    first = policy.act(BASE)
    slower = policy.act(obs(cluster={"checkpoint_cost_s": 80.0}))
    assert slower.checkpoint_interval_s == pytest.approx(2 * first.checkpoint_interval_s, rel=0.05)


def test_risk_model_sets_the_prior():
    policy = no_forgetting_policy()
    a = policy.act(obs(cluster={"preemption_risk": 0.5, "risk_horizon_s": 600.0,
                                "observed_for_s": 0.0}))
    assert a.numbers["mtbf_s"] == pytest.approx(mtbf_from_risk_s(0.5, 600.0))


def test_counters_that_go_back_start_a_new_count():
    policy = no_forgetting_policy()
    policy.act(obs(cluster={"preemptions_observed": 5, "observed_for_s": 3600.0}))
    a = policy.act(obs(cluster={"preemptions_observed": 1, "observed_for_s": 600.0}))
    assert a.numbers["mtbf_s"] == pytest.approx((4 * 3600.0 + 3600.0 + 600.0) / 7)


def test_no_measured_cost_checkpoints_at_the_minimum_interval():
    a = no_forgetting_policy().act(obs(cluster={"checkpoint_cost_s": math.nan}))
    assert a.checkpoint_interval_s == CheckpointTunerConfig().min_interval_s
    assert "until a checkpoint cost is measured" in a.reason


def test_final_anneal_and_regression_zero_the_rate():
    policy = no_forgetting_policy()
    late = policy.act(obs(progress=Progress(9.5e5, 1e6, 3000.0, 100.0)))
    assert late.pruning_rate == 0.0 and "anneal" in late.reason
    worse = policy.act(obs(loss_curve=LossCurve((3.0, 2.3, 2.6), (0, 500, 1000), 10)))
    assert worse.pruning_rate == 0.0 and "regressed" in worse.reason


class FixedAllocation:
    name = "fixed_test_allocation"

    def __init__(self) -> None:
        self.seen: list[SlowObservation] = []

    def act(self, observation: SlowObservation) -> object:
        self.seen.append(observation)
        return {"spot": 3, "on_demand": 1, "zone": "us-west-2a"}


def test_allocation_comes_from_the_pluggable_policy():
    allocation = FixedAllocation()
    a = no_forgetting_policy(allocation_policy=allocation).act(BASE)
    assert a.allocation == {"spot": 3, "on_demand": 1, "zone": "us-west-2a"}
    assert allocation.seen == [BASE] and "fixed_test_allocation" in a.reason


@pytest.mark.parametrize("changes, field", [
    ({"cluster": {"nodes": -1, "spot_nodes": -1}}, "cluster.nodes"),
    ({"cluster": {"spot_nodes": 3}}, "spot_nodes 3 + on_demand_nodes 0 != nodes 4"),
    ({"cluster": {"observed_for_s": math.nan}}, "cluster.observed_for_s"),
    ({"cluster": {"preemption_risk": -0.1}}, "cluster.preemption_risk"),
    ({"cluster": {"checkpoint_cost_s": -3.0}}, "cluster.checkpoint_cost_s"),
    ({"cluster": {"preemptions_saved_by_notice": 2}}, "preemptions_saved_by_notice=2 is > 0"),
    ({"data": DataSummary(10, math.nan, 1.0, 0.5)}, "data.mean_loss_score"),
    ({"progress": Progress(1.0, 0.0, 1.0, 1.0)}, "progress.work_total"),
    ({"loss_curve": LossCurve((2.0,), (), 10)}, "1 losses but 0 steps"),
])
def test_bad_input_falls_back_and_names_the_field(changes, field):
    allocation = FixedAllocation()
    policy = no_forgetting_policy(allocation_policy=allocation)
    good = policy.act(BASE)
    a = policy.act(obs(**changes))
    assert a.reason.startswith("fallback:") and field in a.reason
    assert a.pruning_rate == 0.0 and a.pruning_upweight == 1.0 and a.allocation is None
    assert a.checkpoint_interval_s == good.checkpoint_interval_s
    assert len(allocation.seen) == 1  # the allocation policy never sees a bad observation
