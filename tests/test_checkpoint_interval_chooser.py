"""One checkpoint-interval chooser (issue 25, item 4): the allocation heuristic (whose interval the
simulator and so the cost suite run with), the slow layer (whose interval reaches the trainer), the
in-loop autotune and the fallbacks all ask `controllers.checkpoint_interval`. Swapping its rule
moves all of them together; the same facts give the trainer's layers and the cost suite's policy
the same interval; and the rule's own steps (notice, faults, slack, gangs) hold."""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest

import controllers.checkpoint_interval as chooser
from cloud.simulator import ClusterRules, JobSpec, Market, simulate
from controllers.allocation_heuristic import TrainwiseAllocationPolicy
from controllers.allocation_types import AllocationObservation
from controllers.checkpoint_interval import (
    CheckpointTunerConfig,
    DeadlineSlack,
    IntervalChoice,
    IntervalFacts,
    choose_checkpoint_interval,
    interval_in_force_s,
    using_rule,
)
from controllers.checkpointing import (
    NODE_FAULT_RATE_PER_NODE_H,
    combined_mtbf_s,
    daly_interval_s,
    posterior_mtbf_s,
)
from controllers.fast_heuristic import HeuristicFastPolicy
from controllers.multi_timescale import MultiTimescaleController
from controllers.slow_heuristic import HeuristicSlowPolicy, SlowHeuristicConfig
from controllers.slow_types import ClusterSummary, DataSummary, LossCurve, Progress, SlowObservation
from training import _loop_fast
from trainwise import slow_tick

TICK_S = 195
RULES = ClusterRules(changeover_s=360.0, checkpoint_save_s=60.0, checkpoint_interval_s=3600.0,
                     notice_s=120.0)
FAULT_MTBF_S = 3600.0 / NODE_FAULT_RATE_PER_NODE_H  # one node: 5,679 h
SWAPPED_S = 1234.0


@chooser.register_rule("test_fixed_1234s")
def _fixed_rule(facts: IntervalFacts) -> IntervalChoice:
    return IntervalChoice(SWAPPED_S, "test_fixed_1234s", "a fixed interval, for the test")


def slow_observation(**cluster) -> SlowObservation:
    fields = {"nodes": 1, "spot_nodes": 1, "on_demand_nodes": 0, "preemptions_observed": 0,
              "observed_for_s": 600.0, "checkpoint_cost_s": 20.0}
    fields.update(cluster)
    return SlowObservation(
        time_s=600.0, step=1000,
        data=DataSummary(num_examples=10_000, mean_loss_score=2.0, std_loss_score=1.0,
                         share_below_mean=0.6),
        loss_curve=LossCurve(eval_losses=(3.0, 2.6, 2.3), eval_steps=(0, 500, 1000),
                             tokens_seen=1_000_000),
        progress=Progress(work_done=3e5, work_total=1e6, elapsed_s=600.0, time_left_s=3000.0),
        cluster=ClusterSummary(**fields))


def first_allocation_observation(**overrides) -> AllocationObservation:
    """The first tick of a 48 GPU-h single-node job due at 52 h, nothing held yet."""
    fields = {
        "time_s": 0.0, "tick_s": float(TICK_S), "trace_time_s": 0.0, "work_done_h": 0.0,
        "work_checkpointed_h": 0.0, "work_total_h": 48.0, "work_rate_gpu_h_per_h": 1.0,
        "deadline_s": 52 * 3600.0, "changeover_s": 360.0, "checkpoint_save_s": 60.0,
        "checkpoint_interval_s": 3600.0, "notice_s": 120.0, "node_count": 1,
        "zones": ("us-west-2a",), "home_zone": "us-west-2a", "zone": None, "spot_nodes": 0,
        "on_demand_nodes": 0, "in_changeover": False, "changeover_left_s": 0.0,
        "last_zone": None, "spot_available_by_zone": (0,),
        "spot_price_usd_per_hour_by_zone": (0.9731,),
        "on_demand_price_usd_per_hour_by_zone": (3.06,), "since_checkpoint_s": 0.0,
        "since_launch_s": 0.0, "preemption_times_s": (), "launch_failed": False,
    }
    fields.update(overrides)
    return AllocationObservation(**fields)


def simulated_run():
    """The cost suite's path: trainwise_heuristic in the simulator, every interval it asks."""
    asked: list[float] = []
    policy = TrainwiseAllocationPolicy()

    class Recorder:
        name = policy.name

        def act(self, observation):
            action = policy.act(observation)
            if action.checkpoint_interval_s is not None:
                asked.append(action.checkpoint_interval_s)
            return action

    job = JobSpec(work_gpu_h=48.0, deadline_s=80 * 3600.0, node_count=1)
    ticks = int(80 * 3600 // TICK_S)
    market = Market(("us-west-2a",), TICK_S, np.zeros((1, ticks), dtype=np.int64), (0.9731,),
                    (3.06,))  # on-demand all along: the interval alone sets the saves
    return simulate(Recorder(), job, RULES, market), sorted(set(asked))


def in_loop_autotune_s(tmp_path) -> float:
    live = _loop_fast.LiveDecisions(path=tmp_path / "no_live_control.json",
                                    tuner=_loop_fast.tuner_for(60.0))
    live.tuner.observe_checkpoint_cost(0.5)
    interval_s, _ = live.retune(exposure_s=600.0, past_interruptions=0, elapsed_before_s=0.0)
    return interval_s


class Raising:
    name = "raising"

    def act(self, observation):
        raise RuntimeError("boom")


def every_callers_interval(tmp_path) -> dict[str, object]:
    fallback = MultiTimescaleController(HeuristicFastPolicy(), Raising()).on_slow_tick(
        slow_observation(), now_s=0.0)
    result, asked = simulated_run()
    return {
        "simulator_asked_s": asked,
        "simulator_checkpoint_node_s": result.checkpoint_node_s,
        "simulator_cost_usd": result.cost_usd,
        "slow_layer_s": HeuristicSlowPolicy().act(slow_observation()).checkpoint_interval_s,
        "slow_layer_bad_input_s": HeuristicSlowPolicy().act(
            slow_observation(checkpoint_cost_s=-1.0)).checkpoint_interval_s,
        "in_loop_autotune_s": in_loop_autotune_s(tmp_path),
        "controller_fallback_s": fallback.checkpoint_interval_s,
    }


def test_a_swapped_rule_moves_every_caller_together(tmp_path):
    """The proof that the interval is chosen in one place: register a rule, switch to it, and
    the simulator's run (the cost suite's path), the slow layer's action (what the trainer gets
    through its live-control file), the in-loop autotune and the fallbacks all follow."""
    default = every_callers_interval(tmp_path)
    assert chooser.active_rule() == chooser.DEFAULT_RULE
    with using_rule("test_fixed_1234s"):
        swapped = every_callers_interval(tmp_path)
    assert chooser.active_rule() == chooser.DEFAULT_RULE  # switched back after the block
    assert swapped["simulator_asked_s"] == [SWAPPED_S]
    assert default["simulator_asked_s"] and SWAPPED_S not in default["simulator_asked_s"]
    # Saving every 1234 s instead of Daly's hours: more saves billed, a dearer run.
    assert swapped["simulator_checkpoint_node_s"] > 5 * default["simulator_checkpoint_node_s"]
    assert swapped["simulator_cost_usd"] > default["simulator_cost_usd"]
    for caller in ("slow_layer_s", "slow_layer_bad_input_s", "in_loop_autotune_s",
                   "controller_fallback_s"):
        assert default[caller] != SWAPPED_S, caller
        assert swapped[caller] == SWAPPED_S, caller
    assert every_callers_interval(tmp_path) == default  # and nothing stuck to the old rule


def test_set_rule_refuses_an_unknown_rule_and_names_the_registered_ones():
    with pytest.raises(ValueError, match="no checkpoint-interval rule 'nope'.*trainwise"):
        chooser.set_rule("nope")


def test_the_trainer_and_the_cost_suite_get_the_same_interval_from_the_same_facts():
    """A 60 s save, a 120 s notice, one node, nothing observed yet: the slow layer (the
    trainer's interval) and trainwise_heuristic with ample slack (the cost suite's) both choose
    Daly's interval for node faults, 13.75 h, to the bit."""
    allocation = TrainwiseAllocationPolicy().act(first_allocation_observation(
        deadline_s=80 * 3600.0)).checkpoint_interval_s
    slow = HeuristicSlowPolicy(SlowHeuristicConfig(checkpoint=CheckpointTunerConfig(
        max_interval_s=math.inf))).act(slow_observation(
            checkpoint_cost_s=60.0, notice_s=120.0, observed_for_s=0.0)).checkpoint_interval_s
    assert allocation == slow == daly_interval_s(60.0, FAULT_MTBF_S)
    assert slow == pytest.approx(13.75 * 3600.0, rel=0.01)


def test_the_slow_layer_knows_the_notice_so_saved_reclaims_do_not_shorten_the_interval():
    """A spot run whose saves (50 ms) fit the notice: the slow tick's observation carries the
    notice and the reclaims saved on notice, so reclaims lose nothing and only node faults set
    the interval, far longer than when every reclaim was taken to lose work."""
    events = [
        {"type": "step", "step": 100, "elapsed_s": 60.0, "tokens_seen": 1000},
        {"type": "checkpoint", "step": 50, "save_ms": 50.0, "reason": "interval"},
        {"type": "preemption", "step": 80, "notice_s": 118.0},
        {"type": "checkpoint", "step": 80, "save_ms": 50.0, "reason": "preemption"},
        {"type": "eval", "step": 100, "eval_loss": 2.0},
    ]
    data = DataSummary(num_examples=1000, mean_loss_score=2.0, std_loss_score=1.0,
                       share_below_mean=0.5)
    observation = slow_tick.observe(events, {"max_steps": 1000}, data,
                                    {"nodes": 1, "market": "spot"})
    cluster = observation.cluster
    assert (cluster.notice_s, cluster.preemptions_observed,
            cluster.preemptions_saved_by_notice) == (118.0, 1, 1)
    informed = HeuristicSlowPolicy().act(observation).checkpoint_interval_s
    blind = HeuristicSlowPolicy().act(dataclasses.replace(observation, cluster=dataclasses.replace(
        cluster, notice_s=0.0, preemptions_saved_by_notice=0))).checkpoint_interval_s
    assert informed > 10 * blind
    # Faults only: Daly on the node's fault MTBF (plus the 60 s seen), the 50 ms save.
    assert informed == pytest.approx(daly_interval_s(0.05, FAULT_MTBF_S + 60.0))


# The rule's steps ---------------------------------------------------------------------------

def facts(**overrides) -> IntervalFacts:
    fields = {"checkpoint_cost_s": 60.0, "reclaim_mtbf_s": 7200.0, "fault_mtbf_s": FAULT_MTBF_S,
              "notice_s": 120.0, "save_fits_notice": True}
    fields.update(overrides)
    return IntervalFacts(**fields)


def test_reclaims_count_only_when_a_save_does_not_fit_the_notice():
    fits = choose_checkpoint_interval(facts(max_interval_s=math.inf))
    assert fits.interval_s == daly_interval_s(60.0, FAULT_MTBF_S)
    assert choose_checkpoint_interval(facts(reclaim_mtbf_s=60.0, max_interval_s=math.inf)) == fits
    lossy = choose_checkpoint_interval(facts(save_fits_notice=False))
    assert lossy.mtbf_s == pytest.approx(combined_mtbf_s(7200.0, FAULT_MTBF_S))
    assert lossy.interval_s == pytest.approx(daly_interval_s(60.0, lossy.mtbf_s))
    assert "does not fit" in lossy.reason and lossy.rule == "trainwise"


def test_what_the_rule_does_without_the_numbers_it_needs():
    unmeasured = choose_checkpoint_interval(facts(checkpoint_cost_s=None, min_interval_s=90.0))
    assert unmeasured.interval_s == 90.0 and "until a save is measured" in unmeasured.reason
    # Reclaims lose work at a rate this caller does not estimate: the job's own interval.
    assert choose_checkpoint_interval(facts(save_fits_notice=False, reclaim_mtbf_s=None,
                                            own_interval_s=3600.0)).interval_s == 3600.0
    assert choose_checkpoint_interval(facts(checkpoint_cost_s=0.0,
                                            own_interval_s=3600.0)).interval_s == 3600.0
    # Nothing loses work (no faults, saves fit): as rarely as allowed.
    assert choose_checkpoint_interval(facts(fault_mtbf_s=math.inf,
                                            max_interval_s=7200.0)).interval_s == 7200.0


def test_observed_losses_shorten_the_interval_through_the_posterior():
    seen = choose_checkpoint_interval(facts(exposure_s=3600.0, losses=3.0))
    assert seen.mtbf_s == posterior_mtbf_s(FAULT_MTBF_S, 1.0, 3600.0, 3.0)
    assert seen.interval_s < choose_checkpoint_interval(facts()).interval_s / 1.9


def slack(**overrides) -> DeadlineSlack:
    fields = {"time_left_s": 52 * 3600.0, "remaining_run_s": 48 * 3600.0, "changeover_s": 360.0,
              "save_s": 60.0, "risk_s": 195.0 + 60.0}
    fields.update(overrides)
    return DeadlineSlack(**fields)


def test_a_deadline_halves_the_interval_until_losing_one_fits_the_slack():
    daly_s = daly_interval_s(60.0, FAULT_MTBF_S)
    roomy = choose_checkpoint_interval(facts(own_interval_s=3600.0,
                                             slack=slack(time_left_s=80 * 3600.0)))
    assert roomy.interval_s == daly_s and roomy.optimum_s == daly_s
    assert choose_checkpoint_interval(facts(own_interval_s=3600.0, slack=slack())).interval_s \
        == daly_s / 4  # 3.4 h: 4 h of slack less a restart and the saves
    thin = choose_checkpoint_interval(facts(own_interval_s=3600.0,
                                            slack=slack(time_left_s=49.9 * 3600.0)))
    assert thin.interval_s == 3600.0  # never below the job's own


def test_a_gang_with_a_deadline_keeps_its_interval_and_shortens_it_for_a_thin_reserve():
    gang = {"node_count": 16, "own_interval_s": 3600.0, "min_interval_s": 900.0}
    assert choose_checkpoint_interval(facts(**gang, slack=slack())).interval_s == 3600.0
    roomy = slack(fault_reserve=True, time_left_s=80 * 3600.0)
    assert choose_checkpoint_interval(facts(**gang, slack=roomy)).interval_s == 3600.0
    # 4 h of slack: one hour lost to a fault leaves too little room; half an hour does not.
    shorter = choose_checkpoint_interval(facts(**gang, slack=slack(fault_reserve=True)))
    assert shorter.interval_s == 1800.0 and "thin slack" in shorter.reason
    with pytest.raises(ValueError, match="own_interval_s"):
        choose_checkpoint_interval(facts(node_count=16, slack=slack()))


@pytest.mark.parametrize("overrides, field", [
    ({"min_interval_s": 0.0}, "min_interval_s"),
    ({"min_interval_s": 100.0, "max_interval_s": 50.0}, "max_interval_s"),
    ({"own_interval_s": -1.0}, "own_interval_s"),
    ({"fault_mtbf_s": 0.0}, "fault_mtbf_s"),
    ({"node_count": 0}, "node_count"),
])
def test_bad_facts_are_refused_naming_the_field(overrides, field):
    with pytest.raises(ValueError, match=field):
        facts(**overrides)


def test_interval_in_force_keeps_replaces_or_refuses():
    assert interval_in_force_s(3600.0, None, asked_by="p") == 3600.0
    assert interval_in_force_s(3600.0, 900, asked_by="p") == 900.0
    assert interval_in_force_s(3600.0, math.inf, asked_by="p") == math.inf
    with pytest.raises(ValueError, match="policy 'p' asked for checkpoint_interval_s=0"):
        interval_in_force_s(3600.0, 0.0, asked_by="p")


def test_hazard_maths_are_exact_where_one_side_is_absent():
    assert combined_mtbf_s(math.inf, 1234.5) == 1234.5 == combined_mtbf_s(1234.5, math.inf)
    assert combined_mtbf_s(100.0, 100.0) == pytest.approx(50.0)
    assert posterior_mtbf_s(1234.5, 0.3, 0.0, 0.0) == 1234.5
    assert posterior_mtbf_s(math.inf, 1.0, 600.0, 2.0) == 300.0  # an infinite prior has no say
    assert posterior_mtbf_s(math.inf, 1.0, 600.0, 0.0) == math.inf
