import math
import random

import pytest

from controllers.batch_scaling import (
    BatchScaler,
    BatchScalingConfig,
    GradientNoiseScaleEstimator,
    b_simple_from_two_batches,
    scale_learning_rate,
    split_global_batch,
)


def expected_sq_norm(batch: int, grad_sq: float = 4.0, trace_sigma: float = 400.0) -> float:
    """E|G_B|^2 = |G|^2 + tr(Sigma)/B (McCandlish et al. 2018, App. A)."""
    return grad_sq + trace_sigma / batch


def test_b_simple_from_two_batches_recovers_exact_moments():
    grad_sq, trace_sigma, b_simple = b_simple_from_two_batches(
        8, expected_sq_norm(8), 64, expected_sq_norm(64))
    assert grad_sq == pytest.approx(4.0)
    assert trace_sigma == pytest.approx(400.0)
    assert b_simple == pytest.approx(100.0)


def test_b_simple_rejects_equal_batches():
    with pytest.raises(ValueError, match="big_batch_size"):
        b_simple_from_two_batches(8, 1.0, 8, 1.0)


def test_estimator_smooths_noisy_samples_to_the_true_noise_scale():
    rng = random.Random(7)
    estimator = GradientNoiseScaleEstimator(ema_beta=0.98)
    assert math.isnan(estimator.b_simple)
    for _ in range(2000):
        small = expected_sq_norm(8) * rng.uniform(0.7, 1.3)
        big = expected_sq_norm(64) * rng.uniform(0.7, 1.3)
        estimator.update(8, small, 64, big)
    assert estimator.b_simple == pytest.approx(100.0, rel=0.2)


def run_scaler(scaler: BatchScaler, noise_scales, start_batch: int) -> list[int]:
    """Apply each decision, as the loop would; returns the batch after each."""
    batch, batches = start_batch, []
    for b_noise in noise_scales:
        batch = scaler.update(b_noise, batch).global_batch
        batches.append(batch)
    return batches


def test_batch_doubles_one_step_per_decision_to_the_noise_scale():
    batches = run_scaler(BatchScaler(), [300.0] * 10, 64)
    assert batches[:3] == [128, 256, 256]  # log2(300) = 8.2: 256 is the nearest power of two
    assert set(batches[2:]) == {256}


def test_batch_halves_when_noise_scale_is_small():
    batches = run_scaler(BatchScaler(), [20.0] * 10, 256)
    assert batches[:3] == [128, 64, 32]
    assert set(batches[3:]) == {32}  # 20 is inside 32's keep band [19, 54]
    # 40 is inside 64's band [38, 108]: the band keeps 64 though 32 is nearer in log scale
    assert set(run_scaler(BatchScaler(), [40.0] * 10, 64)) == {64}


@pytest.mark.parametrize("seed", range(5))
def test_hysteresis_keeps_batch_under_noise_that_straddles_the_midpoint(seed):
    # B = 128; up threshold 128 * 2**0.75 = 215, down 76. The midpoint to 256 is 181.
    rng = random.Random(seed)
    noise = [181.0 * math.exp(rng.gauss(0.0, 0.3)) for _ in range(500)]
    with_band = run_scaler(BatchScaler(), noise, 128)
    no_band = run_scaler(BatchScaler(BatchScalingConfig(hysteresis_octaves=0.0, ema_beta=0.0)),
                         noise, 128)
    changes = sum(a != b for a, b in zip([128] + with_band, with_band))
    changes_no_band = sum(a != b for a, b in zip([128] + no_band, no_band))
    assert changes <= 1
    assert changes_no_band > 50  # without band and EMA the batch flaps


def test_nan_noise_scale_keeps_batch_and_does_not_poison_the_ema():
    scaler = BatchScaler()
    d = scaler.update(math.nan, 64)
    assert d.global_batch == 64 and d.direction == 0 and "not estimated" in d.reason
    scaler.update(300.0, 64)
    scaler.update(math.nan, 128)
    assert scaler.b_noise_ema == 300.0


def test_batch_clamped_to_bounds():
    cfg = BatchScalingConfig(min_global_batch=16, max_global_batch=128)
    assert run_scaler(BatchScaler(cfg), [10_000.0] * 5, 64) == [128] * 5
    assert run_scaler(BatchScaler(cfg), [1.0] * 5, 64) == [32, 16, 16, 16, 16]
    assert BatchScaler(cfg).update(math.nan, 512).global_batch == 256  # back toward the max


@pytest.mark.parametrize("global_batch, ranks, max_micro, expected", [
    (64, 1, 64, (64, 1)),
    (256, 2, 64, (64, 2)),
    (200, 1, 64, (50, 4)),
    (130, 1, 64, (26, 5)),
    (131, 1, 64, (43, 3)),  # prime: no exact split within 2x the fewest steps -> floor
    (3, 4, 64, (1, 1)),
])
def test_split_global_batch_respects_the_memory_limit(global_batch, ranks, max_micro, expected):
    micro, accum = split_global_batch(global_batch, ranks, max_micro)
    assert (micro, accum) == expected
    assert micro <= max_micro


@pytest.mark.parametrize("global_batch, min_accum, expected", [
    (32, 2, (16, 2)),
    (256, 2, (64, 4)),  # the memory limit needs 4 anyway
    (1, 2, (1, 1)),  # cannot split one example
    (6, 4, (1, 6)),  # 4 and 5 do not divide 6: the next exact split
])
def test_split_global_batch_keeps_a_minimum_accumulation(global_batch, min_accum, expected):
    assert split_global_batch(global_batch, 1, 64, min_accum_steps=min_accum) == expected


def test_learning_rate_scaling_rules():
    assert scale_learning_rate(1e-3, 64, 256, "sqrt") == pytest.approx(2e-3)
    assert scale_learning_rate(1e-3, 64, 256, "linear") == pytest.approx(4e-3)
    assert scale_learning_rate(1e-3, 256, 64, "sqrt") == pytest.approx(5e-4)
    assert scale_learning_rate(1e-3, 64, 256, "none") == 1e-3
    assert scale_learning_rate(1e-3, 64, 256, "linear", max_learning_rate=3e-3) == 3e-3


def test_config_rejects_bad_bounds():
    with pytest.raises(ValueError, match="max_global_batch"):
        BatchScalingConfig(min_global_batch=64, max_global_batch=32)
    with pytest.raises(ValueError, match="lr_rule"):
        BatchScalingConfig(lr_rule="cubic")  # type: ignore[arg-type]


# -- goodput (Pollux) ---------------------------------------------------------------------------
from controllers.batch_scaling import (  # noqa: E402
    GoodputBatchPolicy,
    GoodputConfig,
    choose_goodput_batch,
    statistical_efficiency,
)
from controllers.fast_types import FastObservation  # noqa: E402

# Fake throughput profiles (samples/s). GPU-like: per-sample time falls with the batch until the
# device is full. CPU-like (this machine): per-sample time is flat or rises.
GPU_LIKE = {32: 1000.0, 64: 1900.0, 128: 3400.0, 256: 5000.0}
CPU_LIKE = {32: 1000.0, 64: 1010.0, 128: 980.0, 256: 950.0}
GOODPUT = GoodputConfig(base_batch=32, max_batch_factor=8, max_micro_batch_size=64)


def fast_obs(**changes) -> FastObservation:
    values = dict(step=100, elapsed_s=10.0, train_loss=2.0, grad_norm=1.0,
                  grad_noise_scale=math.nan, micro_batch_size=32, grad_accum_steps=1,
                  learning_rate=1e-3, rank_step_time_ms=(32.0,), dataloader_queue_depth=0,
                  preemption_notice_s=None, preemption_risk=0.0, seconds_since_checkpoint=1.0,
                  checkpoint_cost_s=0.1)
    values.update(changes)
    return FastObservation(**values)


def test_statistical_efficiency_is_pollux_formula():
    assert statistical_efficiency(32, 32, 100.0) == 1.0
    assert statistical_efficiency(128, 32, 100.0) == pytest.approx(132 / 228)
    assert statistical_efficiency(128, 32, math.inf) == 1.0


def test_goodput_picks_a_bigger_batch_where_it_is_faster_per_sample_and_noise_is_large():
    choice = choose_goodput_batch(GPU_LIKE, noise_scale=2000.0, config=GOODPUT)
    assert choice.lever_on and choice.batch == 256
    # Small noise scale: a big batch wastes samples, so goodput stays at the base batch.
    assert choose_goodput_batch(GPU_LIKE, noise_scale=1.0, config=GOODPUT).batch == 32


def test_goodput_reduces_to_the_fixed_batch_where_bigger_is_not_faster_per_sample():
    choice = choose_goodput_batch(CPU_LIKE, noise_scale=1e9, config=GOODPUT)
    assert not choice.lever_on and choice.batch == 32
    assert "not faster per sample" in choice.reason


def test_goodput_policy_on_cpu_like_profile_changes_nothing_and_never_splits():
    policy = GoodputBatchPolicy(CPU_LIKE, GOODPUT)
    for step in range(0, 2000, 10):  # 200 ticks, noise scale reported huge
        observation = fast_obs(step=step, grad_noise_scale=1e6)
        action = policy.act(observation)
        # Cost nothing: same batch, no accumulation split (no noise measurement), same lr.
        assert (action.micro_batch_size, action.grad_accum_steps, action.learning_rate) == (
            32, 1, 1e-3)


def test_goodput_policy_on_gpu_like_profile_measures_then_grows_with_sqrt_lr():
    policy = GoodputBatchPolicy(GPU_LIKE, GOODPUT)
    first = policy.act(fast_obs())
    assert (first.micro_batch_size, first.grad_accum_steps) == (16, 2)  # split to measure
    assert first.learning_rate == 1e-3
    grown = policy.act(fast_obs(micro_batch_size=16, grad_accum_steps=2, grad_noise_scale=3000.0,
                                rank_step_time_ms=(32.0,)))
    assert grown.micro_batch_size * grown.grad_accum_steps == 256
    assert grown.learning_rate == pytest.approx(1e-3 * math.sqrt(256 / 32))


def test_goodput_refresh_cannot_switch_the_lever_on_from_contention():
    policy = GoodputBatchPolicy(CPU_LIKE, GOODPUT)
    for _ in range(20):  # the machine is 3x slower than at profiling (other work)
        policy.act(fast_obs(rank_step_time_ms=(96.0,)))
    assert not choose_goodput_batch(policy.samples_per_s, 1e9, GOODPUT).lever_on


def test_noise_scale_is_measured_only_on_due_steps():
    import torch

    from training._loop_step import STEP_CPU, GradNoiseScale, train_step

    class Sampler:
        phase = "full"

        def next_batch(self, size, step):
            import numpy as np
            return np.arange(size), np.ones(size)

        def observe_losses(self, positions, losses):
            pass

    class Examples:
        kind = "image"
        inputs = torch.randn(8, 1, 28, 28).numpy()
        labels = torch.randint(0, 10, (8,)).numpy()

    class Tiny(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = torch.nn.Linear(28 * 28, 10)

        def forward(self, x, y, reduction="mean"):
            logits = self.fc(x.reshape(len(x), -1))
            return logits, torch.nn.functional.cross_entropy(logits, y, reduction=reduction)

    model = Tiny()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    noise = GradNoiseScale(every_steps=5)
    cpu_before, cpu_s = STEP_CPU.total_s, []
    for step in range(10):
        outcome = train_step(model=model, optimizer=optimizer, sampler=Sampler(),
                             examples=Examples(), step=step, learning_rate=0.1, micro_batch_size=4,
                             grad_accum_steps=2, grad_clip=1.0, noise_scale=noise)
        cpu_s.append(outcome.cpu_s)
    assert noise.updates == 2  # steps 0 and 5 only
    # Each step's CPU time is measured (not left at the 0.0 default) and added to the clock.
    assert sum(cpu_s) > 0.0
    assert STEP_CPU.total_s - cpu_before == pytest.approx(sum(cpu_s))


def test_throughput_profile_stops_where_a_bigger_batch_is_not_faster_per_sample():
    import torch

    from tests.test_data_pruning_draw import synthetic_examples
    from training._loop_step import profile_samples_per_s
    from training.model import CNNConfig, build_model

    examples = synthetic_examples(n=300, kind="image")
    model = build_model("cnn", CNNConfig(channels_1=2, channels_2=2, hidden=4))
    before = [p.detach().clone() for p in model.parameters()]
    # No batch is 10x faster per sample than half its size: only the first two are profiled.
    profile = profile_samples_per_s(model, examples, [8, 16, 32, 64], stop_below_speedup=9.0)
    assert sorted(profile) == [8, 16] and all(rate > 0 for rate in profile.values())
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))
    assert all(p.grad is None for p in model.parameters())
