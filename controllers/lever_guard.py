"""The guard that turns off training levers that do not pay, with the reason recorded.

A lever (batch size by goodput, data pruning, ...) exists to reach the fixed schedule's quality
for less; quality is a hard constraint. The guard judges each lever in two ways:

1. From calibration on the same workload (`judge_from_calibration`): per seed, the lever's
   CPU-seconds to reach the fixed schedule's final eval loss over the fixed schedule's own. The
   lever stays on only if every seed reached that loss and the upper end of the 95% interval of
   the ratio is below 1 (it saves time even at the unlucky end). Otherwise it is off, and the
   reason names which of the two it failed and the numbers.
2. During the run (`LeverGuard.observe_eval`): the lever's eval loss at the samples seen so far is
   compared with the fixed schedule's curve at the same samples (from calibration). A lever
   whose loss stays above that curve by more than `loss_tolerance` for `patience` consecutive
   evaluations (after `warmup_fraction` of the budget) costs quality and is switched off, with
   the reason and the numbers recorded; it is not switched back on in the same run.

3. During the run, the batch lever by its own cost (`StepCostGuard`): seconds per sample of the
   steps at the lever's batch shapes against the fixed shape's, measured in the same run (a
   bigger or split batch needs at least as many samples, so being slower per sample cannot pay).

`training._loop_fast.LeverGuards` runs 2 and 3 inside the training loop at every evaluation
(`TrainConfig.lever_guard`), switches the lever off and records the verdict as a decision.

The default configuration is what the guard leaves on. With no calibration every lever is off,
which is the fixed schedule itself: the default can never be worse than it.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field

# Two-sided 95% Student t quantiles by degrees of freedom (n - 1); 1.96 beyond the table.
_T95 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306,
        9: 2.262, 10: 2.228, 15: 2.131, 20: 2.086, 30: 2.042}


def t95(dof: int) -> float:
    if dof < 1:
        raise ValueError(f"dof={dof}: a 95% interval needs at least 2 values")
    known = [d for d in _T95 if d <= dof]
    return _T95[max(known)] if dof <= 30 else 1.96


def mean_interval95(values: Sequence[float]) -> tuple[float, float, float]:
    """(mean, low, high) of the Student t 95% interval of the mean; (v, v, v) for one value."""
    if not values:
        raise ValueError("mean_interval95 needs at least one value")
    mean = statistics.fmean(values)
    if len(values) == 1:
        return mean, mean, mean
    half = t95(len(values) - 1) * statistics.stdev(values) / math.sqrt(len(values))
    return mean, mean - half, mean + half


@dataclass(frozen=True)
class LeverVerdict:
    lever: str
    on: bool
    reason: str
    numbers: dict[str, float] = field(default_factory=dict)


def judge_from_calibration(lever: str, cpu_ratios: Sequence[float | None],
                           max_ratio: float = 1.0) -> LeverVerdict:
    """On iff every seed reached the fixed schedule's loss (a None ratio = never reached) and the
    upper end of the 95% interval of CPU-seconds-to-that-loss over the fixed schedule's is below
    `max_ratio`."""
    if not cpu_ratios:
        return LeverVerdict(lever, False, "no calibration runs: off (the fixed schedule)")
    reached = [r for r in cpu_ratios if r is not None and math.isfinite(r)]
    numbers = {"seeds": float(len(cpu_ratios)), "seeds_reached": float(len(reached))}
    if len(reached) < len(cpu_ratios):
        return LeverVerdict(lever, False,
                            f"costs quality: {len(cpu_ratios) - len(reached)} of {len(cpu_ratios)} "
                            "seeds never reached the fixed schedule's final eval loss", numbers)
    mean, low, high = mean_interval95(reached)
    numbers.update(cpu_ratio_mean=mean, cpu_ratio_low=low, cpu_ratio_high=high)
    if len(reached) < 2:
        return LeverVerdict(lever, False, f"one seed only (ratio {mean:.3f}): no interval, off",
                            numbers)
    if high >= max_ratio:
        word = "costs time" if mean >= 1.0 else "saving not sure"
        return LeverVerdict(lever, False,
                            f"{word}: CPU-seconds to the fixed schedule's loss {mean:.3f}x "
                            f"[{low:.3f}, {high:.3f}], upper end >= {max_ratio:g}", numbers)
    return LeverVerdict(lever, True,
                        f"pays: CPU-seconds to the fixed schedule's loss {mean:.3f}x "
                        f"[{low:.3f}, {high:.3f}]", numbers)


def default_levers(verdicts: Sequence[LeverVerdict]) -> tuple[str, ...]:
    """The levers the default configuration uses: those judged on. When several are on, the one
    with the lowest upper interval end (levers are not assumed to compose)."""
    on = [v for v in verdicts if v.on]
    if not on:
        return ()
    return (min(on, key=lambda v: v.numbers.get("cpu_ratio_high", math.inf)).lever,)


def interpolate(curve: Sequence[tuple[float, float]], x: float) -> float:
    """Piecewise-linear y at x of a curve of (x, y) points sorted by x; ends held flat."""
    if not curve:
        raise ValueError("reference curve is empty")
    if x <= curve[0][0]:
        return curve[0][1]
    for (x0, y0), (x1, y1) in zip(curve, curve[1:], strict=False):
        if x <= x1:
            return y0 if x1 == x0 else y0 + (y1 - y0) * (x - x0) / (x1 - x0)
    return curve[-1][1]


@dataclass
class LeverGuard:
    """In-run guard of one lever against the fixed schedule's eval-loss-vs-samples curve."""

    lever: str
    reference: list[tuple[float, float]]  # (samples, eval loss) of the fixed schedule
    budget_samples: float
    loss_tolerance: float = 0.02  # relative: 2% above the reference at the same samples
    patience: int = 3  # consecutive evaluations above the tolerance before switching off
    warmup_fraction: float = 0.2  # early curves cross; judge only after this share of the budget
    on: bool = True
    axis: str = "samples"  # what the x of observe_eval counts (named in the reason)
    strikes: int = 0
    record: list[LeverVerdict] = field(default_factory=list)

    def __post_init__(self) -> None:
        if self.budget_samples <= 0 or self.patience < 1 or self.loss_tolerance < 0:
            raise ValueError(f"LeverGuard({self.lever!r}): budget_samples > 0, patience >= 1 and "
                             "loss_tolerance >= 0 are required")
        self.reference = sorted((float(s), float(v)) for s, v in self.reference)

    def observe_eval(self, samples: float, eval_loss: float) -> LeverVerdict | None:
        """Feeds one evaluation; returns the verdict that switched the lever off, once."""
        if not self.on or samples < self.warmup_fraction * self.budget_samples:
            return None
        expected = interpolate(self.reference, samples)
        excess = eval_loss / expected - 1.0 if expected > 0 else math.inf
        if not math.isfinite(eval_loss) or excess > self.loss_tolerance:
            self.strikes += 1
        else:
            self.strikes = 0
        if self.strikes < self.patience:
            return None
        self.on = False
        verdict = LeverVerdict(
            self.lever, False,
            f"costs quality: eval loss {eval_loss:.4f} at {samples:.0f} {self.axis} is "
            f"{excess:+.1%} against the fixed schedule's {expected:.4f} at the same {self.axis}, "
            f"above {self.loss_tolerance:.0%} for {self.patience} evaluations: switched off",
            {"samples": float(samples), "eval_loss": float(eval_loss),
             "reference_loss": expected, "excess": excess})
        self.record.append(verdict)
        return verdict


def _median(values: Sequence[float]) -> float:
    return statistics.median(values) if values else math.nan


@dataclass
class StepCostGuard:
    """In-run guard of the batch lever by its own cost: seconds per sample of the steps at the
    lever's batch shape against those at the fixed schedule's shape, measured in this run.

    Why this is enough to judge it: a bigger batch never needs fewer samples to a given loss
    (statistical efficiency <= 1, Pollux), and splitting a step into micro batches to measure the
    gradient noise computes the same samples in more passes. So a shape that is slower per sample
    than the fixed one by more than `time_tolerance` costs time whatever it does to the loss.
    Each evaluation judges the steps since the previous one (at least `min_steps` of them);
    `patience` consecutive slow judgements switch the lever off."""

    lever: str
    base_shape: tuple[int, int]  # (micro batch, accumulation steps) of the fixed schedule
    time_tolerance: float = 0.05
    patience: int = 3
    min_steps: int = 3
    skip_first_steps: int = 2  # the first steps pay warm-up (allocations, caches)
    max_base_steps: int = 64  # the newest base-shape steps kept for the median
    on: bool = True
    strikes: int = 0
    record: list[LeverVerdict] = field(default_factory=list)
    _seen: int = 0
    _base_ms: list[float] = field(default_factory=list)  # ms per sample, base shape
    _lever_ms: list[float] = field(default_factory=list)  # ms per sample, since the last check
    _lever_shapes: set[tuple[int, int]] = field(default_factory=set)

    def __post_init__(self) -> None:
        if self.patience < 1 or self.time_tolerance < 0 or self.min_steps < 1:
            raise ValueError(f"StepCostGuard({self.lever!r}): patience >= 1, min_steps >= 1 and "
                             "time_tolerance >= 0 are required")

    def observe_step(self, micro_batch: int, grad_accum: int, step_time_ms: float) -> None:
        self._seen += 1
        if self._seen <= self.skip_first_steps or not math.isfinite(step_time_ms):
            return
        per_sample = step_time_ms / max(1, micro_batch * grad_accum)
        if (micro_batch, grad_accum) == self.base_shape:
            self._base_ms.append(per_sample)
            del self._base_ms[:-self.max_base_steps]
        elif self.on:
            self._lever_ms.append(per_sample)
            self._lever_shapes.add((micro_batch, grad_accum))

    def check(self, step: int) -> LeverVerdict | None:
        """At an evaluation: judges the lever's steps since the last check; the verdict that
        switched it off, once."""
        if not self.on or len(self._lever_ms) < self.min_steps or len(self._base_ms) < 3:
            return None
        base, lever = _median(self._base_ms), _median(self._lever_ms)
        shapes = sorted(self._lever_shapes)
        self._lever_ms, self._lever_shapes = [], set()
        ratio = lever / base if base > 0 else math.inf
        self.strikes = self.strikes + 1 if ratio > 1.0 + self.time_tolerance else 0
        if self.strikes < self.patience:
            return None
        self.on = False
        shown = ", ".join(f"{m}x{a}" for m, a in shapes)
        verdict = LeverVerdict(
            self.lever, False,
            f"costs time: at step {step} its batch shapes ({shown}, micro x accumulation) take "
            f"{lever:.3f} ms per sample against {base:.3f} ms at the fixed schedule's "
            f"{self.base_shape[0]}x{self.base_shape[1]} ({ratio - 1.0:+.1%}), above "
            f"{self.time_tolerance:.0%} for {self.patience} evaluations; a bigger or split "
            "batch needs at least as many samples, so it cannot pay: switched off",
            {"ms_per_sample": lever, "base_ms_per_sample": base, "time_ratio": ratio,
             "step": float(step)})
        self.record.append(verdict)
        return verdict
