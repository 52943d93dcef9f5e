import dataclasses
import math

import pytest

from controllers.batch_scaling import BatchScalingConfig
from controllers.fast_heuristic import (
    FastHeuristicConfig,
    HeuristicFastPolicy,
    bad_observation_fields,
    safe_fast_action,
)
from controllers.fast_types import FastObservation, PreemptionResponse

BASE = FastObservation(
    step=100, elapsed_s=60.0, train_loss=2.5, grad_norm=1.2, grad_noise_scale=math.nan,
    micro_batch_size=16, grad_accum_steps=2, learning_rate=1e-3,
    rank_step_time_ms=(100.0, 100.0), dataloader_queue_depth=4, preemption_notice_s=None,
    preemption_risk=0.05, seconds_since_checkpoint=200.0, checkpoint_cost_s=10.0)


def obs(**changes) -> FastObservation:
    return dataclasses.replace(BASE, **changes)


def test_keeps_everything_while_noise_scale_is_unknown():
    a = HeuristicFastPolicy().act(BASE)
    assert (a.micro_batch_size, a.grad_accum_steps, a.learning_rate) == (16, 2, 1e-3)
    assert a.rank_work_shares == (0.5, 0.5)
    assert a.preemption_response is PreemptionResponse.CONTINUE
    assert "not estimated" in a.reason and "no notice" in a.reason


def test_batch_doubles_into_accumulation_under_the_memory_limit():
    policy = HeuristicFastPolicy(FastHeuristicConfig(batch=BatchScalingConfig(
        max_micro_batch_size=32, lr_rule="sqrt")))
    a = policy.act(obs(grad_noise_scale=1000.0))  # global 64 -> 128: 64 per rank, 2 x 32
    assert (a.micro_batch_size, a.grad_accum_steps) == (32, 2)
    assert a.learning_rate == pytest.approx(1e-3 * math.sqrt(2))
    assert a.numbers["global_batch_before"] == 64 and a.numbers["global_batch"] == 128
    assert "64->128" in a.reason


def test_batch_halves_with_linear_lr_rule():
    policy = HeuristicFastPolicy(FastHeuristicConfig(batch=BatchScalingConfig(lr_rule="linear"),
                                                     keep_start_batch_floor=False))
    a = policy.act(obs(grad_noise_scale=10.0))  # global 64 -> 32: 16 per rank, 2 x 8
    assert (a.micro_batch_size, a.grad_accum_steps) == (8, 2)
    assert a.learning_rate == pytest.approx(5e-4)


def test_batch_never_halves_below_the_run_start_under_a_step_budget():
    """Fewer samples in the same steps cost quality (the end-to-end benchmark's miss)."""
    policy = HeuristicFastPolicy()
    first = policy.act(obs(grad_noise_scale=10.0))  # the start batch, 64, is the floor
    assert (first.micro_batch_size, first.grad_accum_steps) == (16, 2)
    assert first.learning_rate == 1e-3 and "starting batch 64" in first.reason
    # The reason says the halving was refused, not that it happened.
    assert "kept at 64" in first.reason and "64->32" not in first.reason
    grown = policy.act(obs(grad_noise_scale=1000.0))  # growing adds samples: allowed
    assert grown.numbers["global_batch"] == 128
    back = policy.act(obs(micro_batch_size=grown.micro_batch_size,
                          grad_accum_steps=grown.grad_accum_steps, grad_noise_scale=1.0))
    assert back.numbers["global_batch"] >= 64  # back toward the start, never under it
    low = policy.act(obs(grad_noise_scale=1.0))
    assert low.numbers["global_batch"] == 64


def test_single_accumulation_step_is_split_so_the_noise_scale_can_be_measured():
    a = HeuristicFastPolicy(FastHeuristicConfig(min_grad_accum_steps=2)).act(
        obs(micro_batch_size=32, grad_accum_steps=1))
    assert (a.micro_batch_size, a.grad_accum_steps, a.learning_rate) == (16, 2, 1e-3)
    assert "measure the noise scale" in a.reason
    # The default keeps a single-step batch whole: splitting slows every step.
    kept = HeuristicFastPolicy().act(obs(micro_batch_size=32, grad_accum_steps=1))
    assert (kept.micro_batch_size, kept.grad_accum_steps) == (32, 1)


@pytest.mark.parametrize("estimate", [-50.0, math.inf, 0.0])
def test_unusable_noise_scale_estimate_keeps_batch_without_a_fallback(estimate):
    policy = HeuristicFastPolicy()
    policy.act(obs(grad_noise_scale=60.0))
    a = policy.act(obs(grad_noise_scale=estimate, rank_step_time_ms=(100.0, 100.0)))
    assert not a.reason.startswith("fallback")
    assert "ignored" in a.reason and (a.micro_batch_size, a.grad_accum_steps) == (16, 2)
    assert policy.lever("batch_scaling").scaler.b_noise_ema == 60.0


def test_shares_follow_throughput_in_a_loop():
    policy = HeuristicFastPolicy()
    speeds = (1.0, 1.0, 1.0, 0.5)
    shares = (0.25,) * 4
    for step in range(40):
        times = tuple(400.0 * s / v for s, v in zip(shares, speeds))
        a = policy.act(obs(step=step * 10, elapsed_s=step * 5.0, rank_step_time_ms=times))
        shares = a.rank_work_shares
    assert shares == pytest.approx((2 / 7, 2 / 7, 2 / 7, 1 / 7), abs=0.01)
    assert sum(shares) == pytest.approx(1.0)


def test_notice_with_an_old_checkpoint_checkpoints_now():
    a = HeuristicFastPolicy().act(obs(preemption_notice_s=120.0, seconds_since_checkpoint=300.0))
    assert a.preemption_response is PreemptionResponse.CHECKPOINT_NOW
    assert a.numbers["preemption_notice_s"] == 120.0


def test_notice_covered_by_a_recent_checkpoint_continues():
    a = HeuristicFastPolicy().act(obs(preemption_notice_s=120.0, seconds_since_checkpoint=4.0))
    assert a.preemption_response is PreemptionResponse.CONTINUE
    assert "covers" in a.reason


def test_notice_too_short_to_checkpoint_migrates():
    a = HeuristicFastPolicy().act(obs(preemption_notice_s=8.0, checkpoint_cost_s=10.0))
    assert a.preemption_response is PreemptionResponse.MIGRATE
    assert "migrate" in a.reason and "200s" in a.reason


def test_last_chance_uses_the_measured_time_between_decisions():
    policy = HeuristicFastPolicy()
    policy.act(obs(elapsed_s=0.0))
    policy.act(obs(elapsed_s=30.0))  # decisions 30 s apart
    a = policy.act(obs(elapsed_s=60.0, preemption_notice_s=40.0, seconds_since_checkpoint=4.0))
    assert a.preemption_response is PreemptionResponse.CHECKPOINT_NOW  # next one: too late


@pytest.mark.parametrize("changes, field", [
    ({"train_loss": math.nan}, "train_loss"),
    ({"grad_norm": math.inf}, "grad_norm"),
    ({"rank_step_time_ms": (100.0, -3.0)}, "rank_step_time_ms[1]"),
    ({"rank_step_time_ms": (math.nan, 100.0)}, "rank_step_time_ms[0]"),
    ({"rank_step_time_ms": ()}, "rank_step_time_ms is empty"),
    ({"grad_noise_scale": "big"}, "grad_noise_scale"),
    ({"preemption_risk": 1.5}, "preemption_risk"),
    ({"seconds_since_checkpoint": -1.0}, "seconds_since_checkpoint"),
    ({"checkpoint_cost_s": -2.0}, "checkpoint_cost_s"),
    ({"learning_rate": math.nan}, "learning_rate"),
    ({"micro_batch_size": 0}, "micro_batch_size"),
    ({"dataloader_queue_depth": -1}, "dataloader_queue_depth"),
    ({"step": -1}, "step"),
    ({"elapsed_s": None}, "elapsed_s"),
])
def test_bad_input_falls_back_and_names_the_field(changes, field):
    policy = HeuristicFastPolicy()
    a = policy.act(obs(grad_noise_scale=5000.0, rank_step_time_ms=(100.0, 300.0), **changes)
                   if "rank_step_time_ms" not in changes and "grad_noise_scale" not in changes
                   else obs(**changes))
    assert a.reason.startswith("fallback:") and field in a.reason
    if field not in ("micro_batch_size", "learning_rate"):
        assert (a.micro_batch_size, a.grad_accum_steps, a.learning_rate) == (
            BASE.micro_batch_size, BASE.grad_accum_steps, BASE.learning_rate)
    ranks = max(1, len(changes.get("rank_step_time_ms", BASE.rank_step_time_ms)))
    assert a.rank_work_shares == pytest.approx((1 / ranks,) * ranks)
    assert a.preemption_response is PreemptionResponse.CONTINUE
    assert a.numbers["bad_fields"] >= 1


def test_fallback_replaces_invalid_batch_and_lr_with_the_last_good_values():
    policy = HeuristicFastPolicy()
    good = policy.act(obs(grad_noise_scale=1000.0))  # 64 -> 128: 32 x 2 per rank, lr x sqrt 2
    a = policy.act(obs(micro_batch_size=0, learning_rate=math.nan))
    assert a.micro_batch_size == good.micro_batch_size == 32
    assert a.learning_rate == good.learning_rate
    fresh = HeuristicFastPolicy().act(obs(micro_batch_size=0, learning_rate=math.nan))
    assert (fresh.micro_batch_size, fresh.learning_rate) == (1, 0.0)


def test_fallback_checkpoints_when_a_notice_is_up_even_a_bad_one():
    for notice in (30.0, math.nan, -5.0):
        a = HeuristicFastPolicy().act(obs(train_loss=math.nan, preemption_notice_s=notice))
        assert a.preemption_response is PreemptionResponse.CHECKPOINT_NOW
        assert "checkpoint now" in a.reason


def test_bad_observation_does_not_poison_the_smoothing():
    policy = HeuristicFastPolicy()
    policy.act(obs(grad_noise_scale=100.0))
    policy.act(obs(grad_noise_scale=-1e9, train_loss=math.nan))
    assert policy.lever("batch_scaling").scaler.b_noise_ema == 100.0


def test_bad_observation_fields_lists_all_problems():
    bad = bad_observation_fields(obs(train_loss=math.nan, checkpoint_cost_s=-1.0))
    assert bad == ["train_loss=nan", "checkpoint_cost_s=-1 is < 0"]
    assert bad_observation_fields(BASE) == []


def test_safe_fast_action_shape():
    a = safe_fast_action(obs(rank_step_time_ms=(1.0, 1.0, 1.0)), "because")
    assert a.rank_work_shares == pytest.approx((1 / 3,) * 3) and a.reason == "because"


def test_every_action_has_a_reason_and_numbers():
    a = HeuristicFastPolicy().act(obs(grad_noise_scale=80.0, rank_step_time_ms=(90.0, 120.0)))
    batch, shares, preemption = a.reason.split("; ")
    assert batch.startswith("B_noise") and "shares" in shares and preemption == "no notice"
    assert {"b_noise_ema", "global_batch", "share_gain", "preemption_risk"} <= set(a.numbers)
    assert all(isinstance(v, float) for v in a.numbers.values())


def test_unmeasured_checkpoint_cost_is_not_bad_input():
    # The trainer sends nan until its first checkpoint: the policy assumes the configured prior
    # and keeps deciding (batch, shares), instead of falling back.
    policy = HeuristicFastPolicy()
    a = policy.act(obs(checkpoint_cost_s=math.nan, grad_noise_scale=5000.0))
    assert not a.reason.startswith("fallback:")
    assert a.numbers["checkpoint_cost_s"] == policy.config.unmeasured_checkpoint_cost_s
    # With the 30 s prior a 20 s notice cannot cover a save: the notice rule says so.
    b = HeuristicFastPolicy().act(obs(checkpoint_cost_s=math.nan, preemption_notice_s=20.0))
    assert b.preemption_response is PreemptionResponse.MIGRATE
