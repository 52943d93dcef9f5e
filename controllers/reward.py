"""The mission reward: throughput per dollar minus waste, with model quality as a hard constraint.

Lexicographic, not weighted: first the quality constraint, then cost efficiency.
- Quality: relative regression of the eval loss over the reference (the full-data baseline, or
  the best loss so far) = (eval_loss - reference) / reference. Above `regression_threshold` the
  reward is  -violation_penalty - regression : below every reward a run that keeps quality can
  get, whatever it cost, and worse the bigger the regression.
- Otherwise: efficiency - waste_weight * waste, where
  efficiency = (useful tokens / cost_usd) / reference_tokens_per_usd (1.0 = as good as the
  reference setup) and waste = sum of five shares, each clipped to [0, 1]: idle time, straggler
  wait, checkpoint overhead and preemption loss (each over wall time) and redundant data (over
  tokens trained). So a satisfying reward is >= -5 * waste_weight > -violation_penalty, which the
  config checks: no cheapness can buy a quality violation back.
"""

from __future__ import annotations

from dataclasses import dataclass

from controllers.validation import require_number

WASTE_TERMS: tuple[str, ...] = ("idle", "straggler", "checkpoint", "preemption", "redundant_data")


@dataclass(frozen=True)
class RewardConfig:
    reference_tokens_per_usd: float  # throughput per dollar of the reference setup (normaliser)
    regression_threshold: float = 0.02  # relative eval-loss rise that violates quality
    waste_weight: float = 1.0
    violation_penalty: float = 1e6

    def __post_init__(self) -> None:
        require_number("reference_tokens_per_usd", self.reference_tokens_per_usd,
                       strictly_positive=True)
        require_number("regression_threshold", self.regression_threshold)
        require_number("waste_weight", self.waste_weight)
        require_number("violation_penalty", self.violation_penalty, strictly_positive=True)
        if not self.violation_penalty > len(WASTE_TERMS) * self.waste_weight:
            raise ValueError(
                f"violation_penalty={self.violation_penalty} must exceed {len(WASTE_TERMS)} x "
                f"waste_weight={self.waste_weight}, else a quality violation could outrank a "
                "wasteful run that keeps quality"
            )


@dataclass(frozen=True)
class RewardInputs:
    """One accounting interval (a slow tick, an RL step, or a whole run)."""

    tokens_trained: float  # tokens (examples for image tasks) trained on in the interval
    cost_usd: float  # what the interval cost (> 0)
    wall_s: float  # wall time of the interval (> 0)
    idle_s: float  # node time with nothing to run (waiting for nodes, data)
    straggler_s: float  # time fast ranks waited for the slowest one
    checkpoint_s: float  # time stalled writing checkpoints
    preemption_loss_s: float  # work redone after interruptions plus restart time
    redundant_tokens: float  # tokens trained that added nothing (duplicates, re-done work)
    eval_loss: float
    reference_eval_loss: float  # the loss the run must not regress from (> 0)


@dataclass(frozen=True)
class RewardBreakdown:
    reward: float
    quality_violated: bool
    regression: float  # relative eval-loss regression (negative: better than reference)
    tokens_per_usd: float
    efficiency: float
    waste: float  # sum of the clipped waste shares
    waste_shares: dict[str, float]
    reason: str


def _share(part: float, whole: float) -> float:
    return min(1.0, max(0.0, part / whole))


def mission_reward(inputs: RewardInputs, config: RewardConfig) -> RewardBreakdown:
    """The reward of one interval; a NaN or negative input raises ValueError naming it."""
    tokens = require_number("tokens_trained", inputs.tokens_trained)
    cost = require_number("cost_usd", inputs.cost_usd, strictly_positive=True)
    wall = require_number("wall_s", inputs.wall_s, strictly_positive=True)
    eval_loss = require_number("eval_loss", inputs.eval_loss)
    reference = require_number("reference_eval_loss", inputs.reference_eval_loss,
                               strictly_positive=True)
    waste_shares = {
        "idle": _share(require_number("idle_s", inputs.idle_s), wall),
        "straggler": _share(require_number("straggler_s", inputs.straggler_s), wall),
        "checkpoint": _share(require_number("checkpoint_s", inputs.checkpoint_s), wall),
        "preemption": _share(require_number("preemption_loss_s", inputs.preemption_loss_s), wall),
        "redundant_data": (_share(require_number("redundant_tokens", inputs.redundant_tokens),
                                  tokens) if tokens > 0 else 0.0),
    }
    waste = sum(waste_shares.values())
    tokens_per_usd = tokens / cost
    efficiency = tokens_per_usd / config.reference_tokens_per_usd
    regression = (eval_loss - reference) / reference
    if regression > config.regression_threshold:
        return RewardBreakdown(
            reward=-config.violation_penalty - regression,
            quality_violated=True, regression=regression, tokens_per_usd=tokens_per_usd,
            efficiency=efficiency, waste=waste, waste_shares=waste_shares,
            reason=f"quality violated: eval loss {regression:+.1%} vs reference > "
                   f"{config.regression_threshold:.1%}; cost does not count",
        )
    reward = efficiency - config.waste_weight * waste
    return RewardBreakdown(
        reward=reward, quality_violated=False, regression=regression,
        tokens_per_usd=tokens_per_usd, efficiency=efficiency, waste=waste,
        waste_shares=waste_shares,
        reason=f"efficiency {efficiency:.3g}x reference minus waste {waste:.3g}",
    )
