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


# -- goodput (Pollux) -----------------------------------------------------------------------------
# Qiao, Choe, Subramanya et al., "Pollux: Co-adaptive Cluster Scheduling for Goodput-Optimized Deep
# Learning", OSDI'21, section 3: GOODPUT(M) = THROUGHPUT(M) x EFFICIENCY(M), with the statistical
# efficiency of batch M relative to the base batch M0 taken from the gradient noise scale phi:
#     EFFICIENCY(M) = (phi + M0) / (phi + M)
# (progress per sample at M over progress per sample at M0; <= 1 for M >= M0). So a bigger batch
# pays only where it is faster per sample by more than it loses in efficiency. Throughput is the
# measured samples per second at each candidate batch on the hardware the run is on (profiled at
# start, refreshed from the run's own step times), never assumed.


def statistical_efficiency(batch: int, base_batch: int, noise_scale: float) -> float:
    """Pollux's EFFICIENCY(M) = (phi + M0) / (phi + M); 1 at M0, and 1 for all M if phi is inf."""
    if batch < 1 or base_batch < 1:
        raise ValueError(f"batch={batch} and base_batch={base_batch} must be >= 1")
    if not noise_scale >= 0.0:  # nan or negative: no usable estimate
        raise ValueError(f"noise_scale={noise_scale!r} must be a number >= 0")
    if math.isinf(noise_scale):
        return 1.0
    return (noise_scale + base_batch) / (noise_scale + batch)


@dataclass(frozen=True)
class GoodputConfig:
    """How `GoodputBatchPolicy` chooses the global batch (examples per optimizer step)."""

    base_batch: int = 32  # M0: the fixed schedule's batch, whose learning rate was tuned
    max_batch_factor: int = 16  # candidates are M0 * 2**k up to M0 * this
    max_micro_batch_size: int = 64  # above it the global batch is reached by accumulation
    # A bigger batch must be faster per sample by more than this share before goodput is even
    # considered (profiling noise must not move the batch): below it the lever is off and the
    # noise scale is never measured, so it costs nothing.
    min_speedup_per_sample: float = 0.10
    # Ticks between noise-scale measurements once the lever is on; a measuring tick splits the
    # batch into 2 micro batches for one tick (the accumulated gradient is the same). A split step
    # costs about 35% more on a CPU (issue 12: 92 vs 68 ms), so 1 tick in 40 keeps the estimate
    # under 1% of step time; where the global batch needs accumulation anyway it is free.
    measure_every_ticks: int = 40
    throughput_ema_beta: float = 0.8  # refresh of the profiled throughput at the current batch
    lr_rule: LrRule = "sqrt"  # AdamW: square-root rule (Malladi et al. 2022)

    def __post_init__(self) -> None:
        for name in ("base_batch", "max_batch_factor", "max_micro_batch_size",
                     "measure_every_ticks"):
            if getattr(self, name) < 1:
                raise ValueError(f"GoodputConfig.{name}={getattr(self, name)} must be >= 1")
        if self.min_speedup_per_sample < 0:
            raise ValueError("GoodputConfig.min_speedup_per_sample must be >= 0")
        if self.lr_rule not in LR_RULE_EXPONENT:
            raise ValueError(f"lr_rule={self.lr_rule!r}; use one of {sorted(LR_RULE_EXPONENT)}")

    def candidates(self) -> list[int]:
        out, batch = [], self.base_batch
        while batch <= self.base_batch * self.max_batch_factor:
            out.append(batch)
            batch *= 2
        return out


@dataclass(frozen=True)
class GoodputChoice:
    batch: int
    goodput: dict[int, float]  # samples/s x efficiency per candidate (empty when the lever is off)
    lever_on: bool  # False: bigger is not faster per sample here, the batch stays M0
    reason: str


def choose_goodput_batch(samples_per_s: dict[int, float], noise_scale: float,
                         config: GoodputConfig) -> GoodputChoice:
    """argmax over candidates of THROUGHPUT(M) x EFFICIENCY(M); M0 where bigger is not faster
    per sample by `min_speedup_per_sample`, or while the noise scale is unknown (nan)."""
    base = config.base_batch
    if base not in samples_per_s:
        raise ValueError(f"throughput profile {sorted(samples_per_s)} lacks the base batch {base}; "
                         "profile it (training._loop_step.profile_samples_per_s)")
    measured = [b for b in config.candidates() if b in samples_per_s]
    base_rate = samples_per_s[base]
    best_rate = max(samples_per_s[b] for b in measured)
    if best_rate < base_rate * (1.0 + config.min_speedup_per_sample):
        return GoodputChoice(base, {}, False,
                             f"bigger batches are not faster per sample here (best "
                             f"{best_rate / base_rate:.2f}x the samples/s of batch {base}, need "
                             f">= {1 + config.min_speedup_per_sample:.2f}x): fixed batch {base}, "
                             "noise scale not measured")
    if not noise_scale >= 0.0:
        return GoodputChoice(base, {}, True, f"noise scale not estimated yet: batch {base}")
    goodput = {b: samples_per_s[b] * statistical_efficiency(b, base, noise_scale)
               for b in measured}
    batch = max(goodput, key=lambda b: (goodput[b], -b))
    return GoodputChoice(batch, goodput, True,
                         f"goodput argmax: batch {batch} ({goodput[batch]:.0f} vs "
                         f"{goodput[base]:.0f} efficient samples/s at {base}; noise scale "
                         f"{noise_scale:.0f})")


class GoodputBatchPolicy:
    """A fast policy (controllers.fast_types.FastPolicy) that sets the batch by goodput.

    Single process (one rank). `samples_per_s` is the profile measured at start; each tick
    refreshes the entry of the batch the last steps ran at from their step time. Where the profile
    says bigger is not faster per sample the policy returns the observation's batch, accumulation
    and learning rate unchanged and never asks for a split: it reduces to the fixed batch and
    costs nothing. Learning rate: lr(M) = lr(M0) x (M / M0)**p, p from `lr_rule`.
    """

    name = "goodput_batch"

    def __init__(self, samples_per_s: dict[int, float], config: GoodputConfig | None = None
                 ) -> None:
        self.config = config or GoodputConfig()
        self.samples_per_s = dict(samples_per_s)
        self._estimator = GradientNoiseScaleEstimator(ema_beta=0.8)
        self._noise = math.nan
        self._ticks = 0
        self.decisions: list[tuple[int, int, str]] = []  # (step, batch, reason)

    def act(self, observation):  # FastObservation -> FastAction
        from controllers.fast_types import FastAction

        o = observation
        cfg = self.config
        current = o.micro_batch_size * o.grad_accum_steps
        times = o.rank_step_time_ms
        if times and 0.0 < times[0] < math.inf and current in self.samples_per_s:
            # Refresh: the machine got faster or slower (other work, thermal, a new node). The
            # whole profile moves by the factor seen at the current batch, so contention alone
            # cannot make an unmeasured batch look faster per sample and switch the lever on.
            old = self.samples_per_s[current]
            rate = current / (times[0] / 1000.0)
            beta = cfg.throughput_ema_beta
            factor = (beta * old + (1 - beta) * rate) / old
            self.samples_per_s = {b: r * factor for b, r in self.samples_per_s.items()}
        gns = o.grad_noise_scale
        if o.grad_accum_steps >= 2 and isinstance(gns, float) and 0.0 < gns < math.inf:
            self._noise = gns if math.isnan(self._noise) else 0.8 * self._noise + 0.2 * gns
        choice = choose_goodput_batch(self.samples_per_s, self._noise, cfg)
        self._ticks += 1
        if not choice.lever_on and current == cfg.base_batch:
            self.decisions.append((o.step, current, choice.reason))
            return FastAction(o.micro_batch_size, o.grad_accum_steps, o.learning_rate, (1.0,),
                              reason=choice.reason, numbers={"global_batch": float(current)})
        measure = choice.lever_on and self._ticks % cfg.measure_every_ticks == 1
        micro, accum = split_global_batch(choice.batch, 1, cfg.max_micro_batch_size,
                                          2 if measure and choice.batch >= 2 else 1)
        new_global = micro * accum
        lr = o.learning_rate if new_global == current else scale_learning_rate(
            o.learning_rate, current, new_global, cfg.lr_rule)
        reason = choice.reason + (", split in 2 to measure the noise scale" if accum >= 2
                                  and measure else "")
        self.decisions.append((o.step, new_global, reason))
        return FastAction(micro, accum, lr, (1.0,), reason=reason,
                          numbers={"global_batch": float(new_global),
                                   "noise_scale": self._noise})
