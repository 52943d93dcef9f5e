"""Data pruning rate from the difficulty scores, with a quality guard.

InfoBatch (Qin et al., ICLR'24, "InfoBatch: Lossless Training Speed Up by Unbiased Dynamic Data
Pruning"): each epoch, leave out a random share r of the examples whose loss is below the mean
(the well-learned ones), give the kept below-mean examples loss weight 1/(1-r) so the expected
gradient is unchanged, and train on the full data in the last delta of training (delta = 0.875
of epochs pruned in the paper, i.e. anneal_fraction = 0.125). The curriculum applies r; this
module chooses it:

- base rate: max_rate scaled by how spread the difficulty scores are (coefficient of variation
  std/mean over `full_dispersion_cv`): when every example is about as hard, the loss says little
  about which examples are learned, so prune less;
- quality guard (the eval loss is the judge):
  - no eval loss yet: rate 0 (no baseline to guard against);
  - latest eval loss above the best earlier one by more than `regression_threshold` (relative):
    rate 0 until it recovers;
  - a smaller regression, or a flattening curve (relative improvement over the last
    `flat_window` evals below `flat_rel_improvement`): rate times `soft_factor` each; a flat curve
    is where the rare hard examples matter most;
- final anneal: rate 0 once fraction_done >= 1 - anneal_fraction.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from controllers.slow_types import DataSummary, LossCurve, Progress
from controllers.validation import number_problem, require_number


@dataclass(frozen=True)
class PruningConfig:
    max_rate: float = 0.5  # InfoBatch's default r
    full_dispersion_cv: float = 0.5  # score std/mean at or above which max_rate applies
    anneal_fraction: float = 0.125  # last share of the work trained on full data
    regression_threshold: float = 0.02  # relative eval-loss rise over the best that zeroes the rate
    flat_window: int = 3  # evaluations over which flattening is measured
    flat_rel_improvement: float = 0.005  # relative improvement over the window below which: flat
    soft_factor: float = 0.5  # rate multiplier on a small regression or a flat curve

    def __post_init__(self) -> None:
        require_number("max_rate", self.max_rate, maximum=0.95)
        require_number("full_dispersion_cv", self.full_dispersion_cv, strictly_positive=True)
        require_number("anneal_fraction", self.anneal_fraction, maximum=1.0)
        require_number("regression_threshold", self.regression_threshold)
        if self.flat_window < 1:
            raise ValueError(f"flat_window={self.flat_window} must be >= 1 evaluation")
        require_number("flat_rel_improvement", self.flat_rel_improvement)
        require_number("soft_factor", self.soft_factor, maximum=1.0)


@dataclass(frozen=True)
class PruningDecision:
    rate: float  # share of below-mean examples left out (handed to the curriculum)
    upweight: float  # loss weight of the kept below-mean examples: 1 / (1 - rate)
    reason: str
    numbers: dict[str, float] = field(default_factory=dict)


def check_pruning_inputs(data: DataSummary, curve: LossCurve, progress: Progress) -> list[str]:
    """Descriptions of the bad fields (NaN, negative, inconsistent); empty when all are usable."""
    problems = [
        number_problem("data.num_examples", data.num_examples),
        number_problem("data.mean_loss_score", data.mean_loss_score),
        number_problem("data.std_loss_score", data.std_loss_score),
        number_problem("data.share_below_mean", data.share_below_mean, maximum=1.0),
        number_problem("progress.work_done", progress.work_done),
        number_problem("progress.work_total", progress.work_total, strictly_positive=True),
        number_problem("progress.elapsed_s", progress.elapsed_s),
        number_problem("loss_curve.tokens_seen", curve.tokens_seen),
    ]
    problems += [number_problem(f"loss_curve.eval_losses[{i}]", v)
                 for i, v in enumerate(curve.eval_losses)]
    if len(curve.eval_steps) != len(curve.eval_losses):
        problems.append(f"loss_curve has {len(curve.eval_losses)} losses but "
                        f"{len(curve.eval_steps)} steps")
    return [p for p in problems if p is not None]


def decide_pruning_rate(data: DataSummary, curve: LossCurve, progress: Progress,
                        config: PruningConfig | None = None) -> PruningDecision:
    """The InfoBatch rate for the next epoch with the quality guard above.

    Bad inputs (NaN, negative) raise ValueError naming them; an empty loss history is not an error
    but the documented fallback: rate 0 until the first eval gives the guard a baseline.
    """
    cfg = config or PruningConfig()
    problems = check_pruning_inputs(data, curve, progress)
    if problems:
        raise ValueError(f"bad pruning inputs: {'; '.join(problems)}")
    fraction_done = min(1.0, progress.work_done / progress.work_total)
    numbers: dict[str, float] = {"fraction_done": fraction_done}

    def decision(rate: float, reason: str) -> PruningDecision:
        numbers["rate"] = rate
        numbers["pruned_share_of_data"] = rate * data.share_below_mean
        return PruningDecision(rate, 1.0 / (1.0 - rate), reason, numbers)

    if fraction_done >= 1.0 - cfg.anneal_fraction:
        return decision(0.0, f"final anneal ({fraction_done:.0%} done >= "
                             f"{1 - cfg.anneal_fraction:.0%}): full data")
    losses = curve.eval_losses
    if not losses:
        return decision(0.0, "no eval loss yet: full data until the guard has a baseline")
    latest = losses[-1]
    best_before = min(losses[:-1]) if len(losses) > 1 else latest
    regression = (latest - best_before) / best_before if best_before > 0 else 0.0
    numbers.update(latest_eval_loss=latest, best_eval_loss=best_before, regression_rel=regression)
    if regression > cfg.regression_threshold:
        return decision(0.0, f"eval loss regressed {regression:.1%} > "
                             f"{cfg.regression_threshold:.1%}: full data")
    if data.share_below_mean <= 0.0 or data.mean_loss_score <= 0.0:
        return decision(0.0, "no example scores below the mean: nothing to prune")
    cv = data.std_loss_score / data.mean_loss_score
    rate = cfg.max_rate * min(1.0, cv / cfg.full_dispersion_cv)
    numbers.update(score_cv=cv, base_rate=rate)
    notes = [f"score cv {cv:.2f}: base rate {rate:.2f}"]
    if regression > 0.0:
        rate *= cfg.soft_factor
        notes.append(f"eval loss up {regression:.1%} (within guard): x{cfg.soft_factor:g}")
    elif len(losses) > cfg.flat_window:  # a regression is already "not improving": count once
        before = losses[-1 - cfg.flat_window]
        improvement = (before - latest) / before if before > 0 else 0.0
        numbers["improvement_rel"] = improvement
        if improvement < cfg.flat_rel_improvement:
            rate *= cfg.soft_factor
            notes.append(f"curve flat ({improvement:.2%} over {cfg.flat_window} evals): "
                         f"x{cfg.soft_factor:g}")
    return decision(rate, "; ".join(notes))
