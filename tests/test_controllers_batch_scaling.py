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
