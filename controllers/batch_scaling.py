"""Batch size from the gradient noise scale, and the learning rate that goes with it.

- McCandlish, Kaplan, Amodei et al. (2018), "An Empirical Model of Large-Batch Training"
  (arXiv:1812.06162): the critical batch size is about the noise scale B_noise; below it a bigger
  batch buys almost linear speed-up, above it the returns fall off. Their cheap proxy B_simple =
  tr(Sigma) / |G|^2 is estimated from the gradient norms at two batch sizes (Appendix A), with the
  numerator and denominator smoothed separately before the ratio.
- The target global batch is the smoothed B_noise, clamped to [min, max], reached in power-of-two
  steps (one per decision) with a hysteresis band, so estimator noise does not move the batch.
- Learning rate: the linear scaling rule (Goyal et al. 2017, "Accurate, Large Minibatch SGD") for
  SGD; the square-root rule for Adam/AdamW (Malladi et al. NeurIPS'22, "On the SDEs and Scaling
  Rules for Adaptive Gradient Algorithms"; also Hoffer et al. 2017), because Adam normalises the
  update by the gradient's second moment, so the update noise falls as 1/sqrt(B), not 1/B. The
  trainer is nanoGPT-style AdamW, so "sqrt" is the default.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

from controllers.validation import require_number

LrRule = Literal["sqrt", "linear", "none"]
LR_RULE_EXPONENT: dict[str, float] = {"sqrt": 0.5, "linear": 1.0, "none": 0.0}


def b_simple_from_two_batches(small_batch_size: int, small_grad_sq_norm: float,
                              big_batch_size: int, big_grad_sq_norm: float
                              ) -> tuple[float, float, float]:
    """Unbiased |G|^2 and tr(Sigma) from squared gradient norms at two batch sizes, and their ratio.

    McCandlish et al. 2018, Appendix A, with E|G_B|^2 = |G|^2 + tr(Sigma)/B:
      |G|^2      ~ (B_big |G_big|^2 - B_small |G_small|^2) / (B_big - B_small)
      tr(Sigma)  ~ (|G_small|^2 - |G_big|^2) / (1/B_small - 1/B_big)
    Returns (grad_sq_norm, trace_sigma, b_simple = trace_sigma / grad_sq_norm). Single estimates
    are noisy and can be negative; smooth them with `GradientNoiseScaleEstimator`.
    """
    b_small = require_number("small_batch_size", small_batch_size, strictly_positive=True)
    b_big = require_number("big_batch_size", big_batch_size, strictly_positive=True)
    if not b_big > b_small:
        raise ValueError(
            f"big_batch_size={big_batch_size} must be > small_batch_size={small_batch_size}; "
            "e.g. the per-rank micro-batch and the global batch"
        )
    g_small = require_number("small_grad_sq_norm", small_grad_sq_norm)
    g_big = require_number("big_grad_sq_norm", big_grad_sq_norm)
    grad_sq = (b_big * g_big - b_small * g_small) / (b_big - b_small)
    trace_sigma = (g_small - g_big) / (1.0 / b_small - 1.0 / b_big)
    b_simple = trace_sigma / grad_sq if grad_sq != 0.0 else math.nan
    return grad_sq, trace_sigma, b_simple


class GradientNoiseScaleEstimator:
    """EMA of the |G|^2 and tr(Sigma) estimates; B_simple is the ratio of the two EMAs.

    McCandlish et al. smooth numerator and denominator separately because the ratio of two noisy
    estimates is biased and heavy-tailed. `b_simple` is nan until both EMAs are positive.
    """

    def __init__(self, ema_beta: float = 0.95) -> None:
        self.ema_beta = require_number("ema_beta", ema_beta, maximum=0.9999)
        self._grad_sq: float | None = None
        self._trace_sigma: float | None = None

    def update(self, small_batch_size: int, small_grad_sq_norm: float,
               big_batch_size: int, big_grad_sq_norm: float) -> float:
        grad_sq, trace_sigma, _ = b_simple_from_two_batches(
            small_batch_size, small_grad_sq_norm, big_batch_size, big_grad_sq_norm)
        beta = self.ema_beta
        if self._grad_sq is None or self._trace_sigma is None:
            self._grad_sq, self._trace_sigma = grad_sq, trace_sigma
        else:
            self._grad_sq = beta * self._grad_sq + (1 - beta) * grad_sq
            self._trace_sigma = beta * self._trace_sigma + (1 - beta) * trace_sigma
        return self.b_simple

    @property
    def b_simple(self) -> float:
        if self._grad_sq is None or self._trace_sigma is None:
            return math.nan
        if self._grad_sq <= 0.0 or self._trace_sigma <= 0.0:
            return math.nan
        return self._trace_sigma / self._grad_sq


@dataclass(frozen=True)
class BatchScalingConfig:
    """Bounds and smoothing of the batch controller (batch sizes in examples/sequences)."""

    min_global_batch: int = 8
    max_global_batch: int = 4096
    # Largest micro-batch one rank fits in memory; above it, gradient accumulation takes over.
    max_micro_batch_size: int = 64
    # Weight of the previous value in the EMA of the noise scale seen at each decision (about 10
    # decisions of memory: with the band below, a noise scale that jitters by 30 % per decision
    # moves the batch at most once; see tests/test_controllers_batch_scaling.py).
    ema_beta: float = 0.9
    # Hysteresis in octaves: double when B_noise >= B * 2**(0.5 + h), halve when
    # B_noise <= B / 2**(0.5 + h). With h = 0.25 a noise scale anywhere in [0.59 B, 1.68 B]
    # keeps B, and after a step the new batch sits inside its own keep band.
    hysteresis_octaves: float = 0.25
    lr_rule: LrRule = "sqrt"
    max_learning_rate: float | None = None

    def __post_init__(self) -> None:
        require_number("min_global_batch", self.min_global_batch, strictly_positive=True)
        if self.max_global_batch < self.min_global_batch:
            raise ValueError(
                f"max_global_batch={self.max_global_batch} must be >= min_global_batch="
                f"{self.min_global_batch}"
            )
        require_number("max_micro_batch_size", self.max_micro_batch_size, strictly_positive=True)
        require_number("ema_beta", self.ema_beta, maximum=0.9999)
        require_number("hysteresis_octaves", self.hysteresis_octaves)
        if self.lr_rule not in LR_RULE_EXPONENT:
            raise ValueError(f"lr_rule={self.lr_rule!r}; use one of {sorted(LR_RULE_EXPONENT)}")
        if self.max_learning_rate is not None:
            require_number("max_learning_rate", self.max_learning_rate, strictly_positive=True)


@dataclass(slots=True)
class BatchDecision:
    global_batch: int  # target global batch (examples per optimizer step)
    direction: int  # +1 doubled, -1 halved, 0 kept
    b_noise_ema: float  # smoothed noise scale (nan until a valid estimate arrived)
    reason: str


class BatchScaler:
    """Power-of-two batch steps toward the smoothed noise scale, with hysteresis (stateful EMA)."""

    def __init__(self, config: BatchScalingConfig | None = None) -> None:
        self.config = config or BatchScalingConfig()
        self._ema: float = math.nan
        band = 2.0 ** (0.5 + self.config.hysteresis_octaves)
        self._up_ratio = band
        self._down_ratio = 1.0 / band

    @property
    def b_noise_ema(self) -> float:
        return self._ema

    def reset(self) -> None:
        self._ema = math.nan

    def update(self, b_noise: float, current_global_batch: int) -> BatchDecision:
        """One decision. A `b_noise` that is nan (not yet estimated), <= 0 or infinite (noisy
        estimates can be) leaves the EMA as it is and is named in the reason.

        Clamping to [min, max] takes precedence over the noise scale: a current batch outside the
        bounds moves one step toward them.
        """
        if 0.0 < b_noise < math.inf:  # finite and positive (False for nan)
            ema = self._ema
            beta = self.config.ema_beta
            self._ema = b_noise if math.isnan(ema) else beta * ema + (1 - beta) * b_noise
            return self._decide(current_global_batch)
        decision = self._decide(current_global_batch)
        if not math.isnan(b_noise):
            decision.reason += f" (estimate {b_noise:.3g} ignored: not a positive number)"
        return decision

    def _decide(self, current: int) -> BatchDecision:
        cfg = self.config
        ema = self._ema
        if current > cfg.max_global_batch:
            return BatchDecision(max(cfg.max_global_batch, current // 2), -1, ema,
                                 f"batch {current} > max {cfg.max_global_batch}: halve")
        if current < cfg.min_global_batch:
            return BatchDecision(min(cfg.min_global_batch, current * 2), 1, ema,
                                 f"batch {current} < min {cfg.min_global_batch}: double")
        if math.isnan(ema):
            return BatchDecision(current, 0, ema, "noise scale not estimated yet: keep batch")
        if ema >= current * self._up_ratio and current * 2 <= cfg.max_global_batch:
            return BatchDecision(current * 2, 1, ema,
                                 f"B_noise {ema:.0f} >= {current * self._up_ratio:.0f}: "
                                 f"batch {current}->{current * 2}")
        if ema <= current * self._down_ratio and current // 2 >= cfg.min_global_batch:
            return BatchDecision(current // 2, -1, ema,
                                 f"B_noise {ema:.0f} <= {current * self._down_ratio:.0f}: "
                                 f"batch {current}->{current // 2}")
        return BatchDecision(current, 0, ema, f"B_noise {ema:.0f} within band of batch {current}")


def split_global_batch(global_batch: int, num_ranks: int, max_micro_batch_size: int,
                       min_accum_steps: int = 1) -> tuple[int, int]:
    """(micro_batch_size, grad_accum_steps) per rank for a global batch under a memory limit.

    The per-rank batch is global // num_ranks (at least 1). Accumulation takes the fewest steps
    (at least `min_accum_steps`, at most the per-rank batch) that keep the micro-batch <=
    max_micro_batch_size, preferring an exact split (within 2x the fewest steps); otherwise the
    micro-batch is floored (a slightly smaller effective batch).
    """
    if num_ranks <= 0 or max_micro_batch_size <= 0 or global_batch <= 0 or min_accum_steps <= 0:
        raise ValueError(
            f"global_batch={global_batch}, num_ranks={num_ranks}, max_micro_batch_size="
            f"{max_micro_batch_size}, min_accum_steps={min_accum_steps}: all must be positive "
            "integers"
        )
    per_rank = max(1, global_batch // num_ranks)
    fewest = min(per_rank, max(min_accum_steps, -(-per_rank // max_micro_batch_size)))  # ceil
    for accum in range(fewest, min(per_rank, 2 * fewest) + 1):
        if per_rank % accum == 0:
            return per_rank // accum, accum
    return per_rank // fewest, fewest


def scale_learning_rate(learning_rate: float, old_global_batch: int, new_global_batch: int,
                        rule: LrRule = "sqrt", max_learning_rate: float | None = None) -> float:
    """lr * (new/old)**p with p = 1/2 (sqrt, Adam), 1 (linear, SGD) or 0 (none); capped at max."""
    exponent = LR_RULE_EXPONENT[rule]
    if new_global_batch == old_global_batch or exponent == 0.0:
        scaled = learning_rate
    else:
        scaled = learning_rate * (new_global_batch / old_global_batch) ** exponent
    if max_learning_rate is not None and scaled > max_learning_rate:
        return max_learning_rate
    return scaled
