import dataclasses
import math

import pytest

from controllers.decisions import DecisionLog, format_timeline
from controllers.fast_heuristic import HeuristicFastPolicy
from controllers.fast_types import (
    FastAction,
    FastObservation,
    FastPolicy,
    NoOpFastPolicy,
    PreemptionResponse,
)
from controllers.multi_timescale import MultiTimescaleController
from controllers.slow_heuristic import HeuristicSlowPolicy
from controllers.slow_types import (
    ClusterSummary,
    DataSummary,
    LossCurve,
    Progress,
    SlowObservation,
)

FAST = FastObservation(
    step=0, elapsed_s=0.0, train_loss=2.5, grad_norm=1.2, grad_noise_scale=math.nan,
    micro_batch_size=16, grad_accum_steps=1, learning_rate=1e-3,
    rank_step_time_ms=(100.0, 100.0), dataloader_queue_depth=4, preemption_notice_s=None,
    preemption_risk=0.05, seconds_since_checkpoint=0.0, checkpoint_cost_s=10.0)

SLOW = SlowObservation(
    time_s=0.0, step=0, data=DataSummary(10_000, 2.0, 1.0, 0.6),
    loss_curve=LossCurve((3.0, 2.6), (0, 100), 10_000),
    progress=Progress(1e5, 1e6, 60.0, 3600.0),
    cluster=ClusterSummary(2, 2, 0, 0, 60.0, 10.0))


def controller(**kwargs) -> MultiTimescaleController:
    kwargs.setdefault("fast_every_steps", 10)
    kwargs.setdefault("slow_every_s", 300.0)
    return MultiTimescaleController(HeuristicFastPolicy(), HeuristicSlowPolicy(), **kwargs)


def test_fast_layer_runs_every_n_steps():
    c = controller()
    ran = [s for s in range(30) if c.on_step(dataclasses.replace(FAST, step=s)) is not None]
    assert ran == [0, 10, 20]
    assert [d.step for d in c.decision_log.of_layer("fast")] == [0, 10, 20]


def test_fast_layer_also_runs_every_n_seconds_when_set():
    c = controller(fast_every_steps=1000, fast_every_s=5.0)
    ran = [s for s in range(30)
           if c.on_step(dataclasses.replace(FAST, step=s, elapsed_s=s * 0.5)) is not None]
    assert ran == [0, 10, 20]


def test_a_notice_does_not_wait_for_the_cadence():
    c = controller()
    c.on_step(FAST)
    a = c.on_step(dataclasses.replace(FAST, step=3, preemption_notice_s=120.0,
                                      seconds_since_checkpoint=300.0))
    assert a is not None and a.preemption_response is PreemptionResponse.CHECKPOINT_NOW


def test_slow_layer_runs_on_its_own_interval():
    c = controller(slow_every_s=300.0)
    ran = [t for t in range(0, 1000, 50) if c.on_slow_tick(SLOW, float(t)) is not None]
    assert ran == [0, 300, 600, 900]
    assert len(c.decision_log.of_layer("slow")) == 4


def test_controller_is_a_fast_policy():
    c = controller()
    policy: FastPolicy = c  # the trainer takes it as its fast policy
    assert policy.name == "multi_timescale"
    action = policy.act(FAST)
    assert isinstance(action, FastAction)
    assert c.decision_log.decisions[-1].policy == "heuristic_fast"


class Exploding:
    name = "exploding"

    def act(self, observation):
        raise RuntimeError("weights file corrupt")


def test_a_raising_fast_policy_falls_back_and_is_recorded():
    c = MultiTimescaleController(Exploding(), None, 1, 60.0)
    a = c.act(dataclasses.replace(FAST, preemption_notice_s=30.0))
    assert a.preemption_response is PreemptionResponse.CHECKPOINT_NOW
    assert a.rank_work_shares == (0.5, 0.5)
    record = c.decision_log.decisions[-1]
    assert "exploding raised RuntimeError: weights file corrupt" in record.reason
    with pytest.raises(RuntimeError):
        MultiTimescaleController(Exploding(), None, 1, 60.0, catch_policy_errors=False).act(FAST)


def test_a_raising_slow_policy_keeps_the_last_interval():
    c = MultiTimescaleController(NoOpFastPolicy(), HeuristicSlowPolicy(), 1, 60.0)
    good = c.on_slow_tick(SLOW, 0.0)
    c.slow_policy = Exploding()
    a = c.on_slow_tick(SLOW, 100.0)
    assert a.checkpoint_interval_s == good.checkpoint_interval_s and a.pruning_rate == 0.0
    assert "fallback: slow policy exploding raised" in c.decision_log.decisions[-1].reason


def test_constructor_rejects_bad_cadences():
    with pytest.raises(ValueError, match="fast_every_steps"):
        MultiTimescaleController(NoOpFastPolicy(), None, 0, 60.0)
    with pytest.raises(ValueError, match="slow_every_s"):
        MultiTimescaleController(NoOpFastPolicy(), None, 10, -1.0)


def test_a_simulated_run_scales_batch_rebalances_and_checkpoints_on_notice():
    """A toy loop: the noise scale grows, rank 1 is 1.5x slower, a notice arrives at step 150."""
    sink: list = []
    c = controller(decision_log=DecisionLog(sink=sink.append))
    micro, accum, lr, shares = 16, 1, 1e-3, (0.5, 0.5)
    last_checkpoint_s, elapsed_s = 0.0, 0.0
    responses = []
    for step in range(200):
        times = (400.0 * shares[0], 600.0 * shares[1])
        elapsed_s += max(times) / 1000.0
        notice = 60.0 if step >= 150 else None
        o = dataclasses.replace(
            FAST, step=step, elapsed_s=elapsed_s, grad_noise_scale=32.0 + 2.0 * step,
            micro_batch_size=micro, grad_accum_steps=accum, learning_rate=lr,
            rank_step_time_ms=times, preemption_notice_s=notice,
            seconds_since_checkpoint=elapsed_s - last_checkpoint_s)
        a = c.on_step(o)
        if step % 50 == 0:
            c.on_slow_tick(SLOW, elapsed_s)
        if a is None:
            continue
        micro, accum, lr, shares = (a.micro_batch_size, a.grad_accum_steps, a.learning_rate,
                                    a.rank_work_shares)
        responses.append(a.preemption_response)
        if a.preemption_response is PreemptionResponse.CHECKPOINT_NOW:
            last_checkpoint_s = elapsed_s
            break
    assert micro * accum * 2 > 32  # the batch grew with the noise scale
    assert lr > 1e-3
    assert shares[1] == pytest.approx(0.4, abs=0.02)  # speeds 1/400 : 1/600 -> 0.6 : 0.4
    assert responses[-1] is PreemptionResponse.CHECKPOINT_NOW
    assert len(sink) == c.decision_log.recorded_total
    timeline = format_timeline(c.decision_log.to_dict()["decisions"])
    assert "checkpoint now" in timeline and "re-balance" in timeline and "batch 32->64" in timeline
    assert " slow  heuristic_slow: pruning" in timeline
