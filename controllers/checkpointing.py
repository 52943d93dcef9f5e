"""Checkpoint interval from the failure rate and the checkpoint cost, and the rule on a notice.

- Young (1974), "A first order approximation to the optimum checkpoint interval", CACM 17(9):
  with checkpoint cost C and mean time between failures M, the compute time between checkpoints
  that minimises the expected overhead C/T + T/(2M) is T = sqrt(2 C M).
- Daly (2006), "A higher order estimate of the optimum checkpoint interval for restart dumps",
  FGCS 22(3): T = sqrt(2 C M) [1 + sqrt(C/(2M))/3 + (C/(2M))/9] - C for C < 2M, else T = M.
- CheckFreq (Mohan et al., FAST'21): measure the checkpoint cost while training and re-tune the
  frequency when it changes. Here both inputs are running estimates: the checkpoint cost an EMA
  of measured costs, the mean time between failures a Gamma-Poisson posterior over observed
  preemptions/faults with exponential forgetting, so a market that turns calmer or wilder moves
  the interval within a few half-lives.
- On a preemption notice, `should_checkpoint_on_notice` asks for an immediate checkpoint when the
  last one is too old for the notice to cover (see its docstring for the exact rule).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from controllers.validation import require_number


def young_interval_s(checkpoint_cost_s: float, mtbf_s: float) -> float:
    """Young's first-order optimum: sqrt(2 * C * M) seconds of work between checkpoints."""
    cost = require_number("checkpoint_cost_s", checkpoint_cost_s, strictly_positive=True)
    mtbf = require_number("mtbf_s", mtbf_s, strictly_positive=True)
    return math.sqrt(2.0 * cost * mtbf)


def daly_interval_s(checkpoint_cost_s: float, mtbf_s: float) -> float:
    """Daly's higher-order optimum (FGCS 2006, eq. 37): better than Young when C is not << M."""
    cost = require_number("checkpoint_cost_s", checkpoint_cost_s, strictly_positive=True)
    mtbf = require_number("mtbf_s", mtbf_s, strictly_positive=True)
    if cost >= 2.0 * mtbf:
        return mtbf
    ratio = cost / (2.0 * mtbf)
    return math.sqrt(2.0 * cost * mtbf) * (1.0 + math.sqrt(ratio) / 3.0 + ratio / 9.0) - cost


def expected_overhead_fraction(interval_s: float, checkpoint_cost_s: float, mtbf_s: float) -> float:
    """First-order share of time lost to checkpoints and rework: C/T + (T + C)/(2M) (Young's model).

    The checkpoints cost C every T seconds of work; a failure lands on average half-way through a
    segment of length T + C and loses that half. Young's interval minimises this expression.
    """
    interval = require_number("interval_s", interval_s, strictly_positive=True)
    cost = require_number("checkpoint_cost_s", checkpoint_cost_s)
    mtbf = require_number("mtbf_s", mtbf_s, strictly_positive=True)
    return cost / interval + (interval + cost) / (2.0 * mtbf)


def mtbf_from_risk_s(risk: float, horizon_s: float) -> float:
    """Mean time between preemptions implied by P(preemption within horizon) under a Poisson model.

    P = 1 - exp(-horizon / M)  =>  M = -horizon / ln(1 - P). Risk 0 gives +inf (no preemption seen).
    """
    p = require_number("risk", risk, maximum=1.0)
    horizon = require_number("horizon_s", horizon_s, strictly_positive=True)
    if p <= 0.0:
        return math.inf
    if p >= 1.0:
        return horizon * 1e-3  # certain preemption: an MTBF far below the horizon
    return -horizon / math.log1p(-p)


@dataclass(frozen=True)
class CheckpointTunerConfig:
    """Settings of the running Young/Daly estimator."""

    # Prior belief about the mean time between job interruptions, before any is observed. Four
    # hours is a placeholder for a calm spot market; the slow policy replaces it with the risk
    # model's estimate when one is given.
    prior_mtbf_s: float = 4 * 3600.0
    # Weight of the prior, in pseudo-events: 1 means one observed interruption outweighs it.
    prior_weight_events: float = 1.0
    # Old exposure and events lose half their weight every this many seconds (None: never).
    forget_half_life_s: float | None = 6 * 3600.0
    # Weight of the previous cost estimate in the EMA of measured checkpoint costs.
    cost_ema_beta: float = 0.7
    # Bounds on the interval: never checkpoint more often than min, nor less often than max.
    min_interval_s: float = 60.0
    max_interval_s: float = 6 * 3600.0
    # Re-tune only when the optimum moved by more than this share (CheckFreq re-tunes on change;
    # the band keeps a noisy cost from moving the interval every tick).
    retune_rel_change: float = 0.10
    use_daly: bool = True

    def __post_init__(self) -> None:
        require_number("prior_mtbf_s", self.prior_mtbf_s, strictly_positive=True)
        require_number("prior_weight_events", self.prior_weight_events, strictly_positive=True)
        if self.forget_half_life_s is not None:
            require_number("forget_half_life_s", self.forget_half_life_s, strictly_positive=True)
        require_number("cost_ema_beta", self.cost_ema_beta, maximum=0.999)
        require_number("min_interval_s", self.min_interval_s, strictly_positive=True)
        if not self.max_interval_s >= self.min_interval_s:
            raise ValueError(
                f"max_interval_s={self.max_interval_s} must be >= min_interval_s="
                f"{self.min_interval_s}"
            )
        require_number("retune_rel_change", self.retune_rel_change)


class CheckpointIntervalTuner:
    """Running estimates of the checkpoint cost and the job's MTBF, and the interval they imply.

    MTBF estimate: with a Gamma(a, b) prior on the interruption rate (a = prior_weight_events,
    b = a * prior_mtbf_s), after `events` interruptions in `exposure_s` seconds the posterior mean
    rate is (a + events) / (b + exposure_s); its inverse is the MTBF used. Exposure and events
    decay with `forget_half_life_s`, so the estimate follows a changing market.
    """

    def __init__(self, config: CheckpointTunerConfig | None = None) -> None:
        self.config = config or CheckpointTunerConfig()
        self._prior_mtbf_s = self.config.prior_mtbf_s
        self._exposure_s = 0.0
        self._events = 0.0
        self._cost_s: float | None = None
        self._interval_s: float | None = None

    def set_prior_mtbf(self, mtbf_s: float) -> None:
        """Replace the prior MTBF (e.g. with the risk model's estimate); +inf means 'no risk'."""
        if mtbf_s == math.inf:
            value = math.inf
        else:
            value = require_number("mtbf_s", mtbf_s, strictly_positive=True)
        # An infinite prior would swamp every observation; cap it at 100x the longest interval.
        self._prior_mtbf_s = min(value, 100.0 * self.config.max_interval_s)

    def observe_exposure(self, duration_s: float, interruptions: int = 0) -> None:
        """Add `duration_s` s of running during which `interruptions` preemptions/faults hit."""
        duration = require_number("duration_s", duration_s)
        if isinstance(interruptions, bool) or not isinstance(interruptions, int) or (
                interruptions < 0):
            raise ValueError(f"interruptions={interruptions!r} must be an int >= 0")
        half_life = self.config.forget_half_life_s
        if half_life is not None and duration > 0:
            decay = 0.5 ** (duration / half_life)
            self._exposure_s *= decay
            self._events *= decay
        self._exposure_s += duration
        self._events += interruptions

    def observe_checkpoint_cost(self, cost_s: float) -> None:
        """Fold one measured checkpoint cost (seconds the training stalled) into the EMA."""
        cost = require_number("checkpoint_cost_s", cost_s, strictly_positive=True)
        beta = self.config.cost_ema_beta
        self._cost_s = cost if self._cost_s is None else beta * self._cost_s + (1 - beta) * cost

    @property
    def checkpoint_cost_s(self) -> float | None:
        return self._cost_s

    @property
    def mtbf_s(self) -> float:
        a = self.config.prior_weight_events
        b = a * self._prior_mtbf_s
        return (b + self._exposure_s) / (a + self._events)

    def optimal_interval_s(self) -> float:
        """Daly's (or Young's) interval at the current estimates, clamped to the bounds.

        Before any checkpoint cost is measured there is nothing to optimise: the minimum interval
        is returned (checkpoint early, then measure), as CheckFreq profiles the first checkpoint.
        """
        cfg = self.config
        if self._cost_s is None:
            return cfg.min_interval_s
        formula = daly_interval_s if cfg.use_daly else young_interval_s
        raw = formula(self._cost_s, self.mtbf_s)
        return min(cfg.max_interval_s, max(cfg.min_interval_s, raw))

    def retune(self) -> tuple[float, bool]:
        """(interval_s in force, changed): moves the interval only when the optimum moved enough."""
        optimum = self.optimal_interval_s()
        if self._interval_s is None:
            self._interval_s = optimum
            return optimum, True
        if abs(optimum - self._interval_s) > self.config.retune_rel_change * self._interval_s:
            self._interval_s = optimum
            return optimum, True
        return self._interval_s, False

    @property
    def interval_s(self) -> float | None:
        """The interval in force (None before the first `retune`)."""
        return self._interval_s


@dataclass(slots=True)
class NoticeDecision:
    """What to do about a pending preemption notice, and why."""

    checkpoint_now: bool
    can_finish: bool  # a checkpoint started now ends before the notice runs out
    too_old: bool  # the work since the last checkpoint is worth more than a checkpoint costs
    last_chance: bool  # waiting for the next decision would leave too little notice
    reason: str


def should_checkpoint_on_notice(seconds_since_checkpoint: float, notice_s: float,
                                checkpoint_cost_s: float, *, safety_margin_s: float = 5.0,
                                next_decision_in_s: float = 0.0) -> NoticeDecision:
    """Whether to checkpoint immediately on a preemption notice.

    Rule (all in seconds):
    - can_finish: notice_s >= checkpoint_cost_s + safety_margin_s. If not, a checkpoint started
      now would be torn by the kill; never start one (the caller migrates or accepts the loss).
    - too_old: seconds_since_checkpoint > checkpoint_cost_s, i.e. the last checkpoint does not
      cover the notice: the work it would lose is worth more than the stall of saving it.
    - last_chance: notice_s - next_decision_in_s < checkpoint_cost_s + safety_margin_s, i.e. at
      the next decision it would be too late. Whatever work is unsaved then is saved now: the node
      dies anyway, so the stall costs nothing that is not already lost.
    checkpoint_now = can_finish and ((too_old) or (last_chance and seconds_since_checkpoint > 0)).
    """
    since = require_number("seconds_since_checkpoint", seconds_since_checkpoint)
    notice = require_number("notice_s", notice_s)
    cost = require_number("checkpoint_cost_s", checkpoint_cost_s)
    margin = require_number("safety_margin_s", safety_margin_s)
    wait = require_number("next_decision_in_s", next_decision_in_s)
    needed = cost + margin
    can_finish = notice >= needed
    too_old = since > cost
    last_chance = notice - wait < needed
    if not can_finish:
        return NoticeDecision(False, False, too_old, last_chance,
                              f"notice {notice:.0f}s < checkpoint {cost:.0f}s + margin "
                              f"{margin:.0f}s: a checkpoint could not finish")
    if too_old:
        return NoticeDecision(True, True, True, last_chance,
                              f"notice {notice:.0f}s, last checkpoint {since:.0f}s ago > its cost "
                              f"{cost:.0f}s: checkpoint now")
    if last_chance and since > 0:
        return NoticeDecision(True, True, False, True,
                              f"notice {notice:.0f}s would be too short by the next decision in "
                              f"{wait:.0f}s: checkpoint now")
    return NoticeDecision(False, True, False, last_chance,
                          f"notice {notice:.0f}s, last checkpoint {since:.0f}s ago <= its cost "
                          f"{cost:.0f}s: it covers the notice")
