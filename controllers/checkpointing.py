"""Checkpoint interval from the failure rate and the checkpoint cost, and the rule on a notice.

- Young (1974), "A first order approximation to the optimum checkpoint interval", CACM 17(9):
  with checkpoint cost C and mean time between failures M, the compute time between checkpoints
  that minimises the expected overhead C/T + T/(2M) is T = sqrt(2 C M).
- Daly (2006), "A higher order estimate of the optimum checkpoint interval for restart dumps",
  FGCS 22(3): T = sqrt(2 C M) [1 + sqrt(C/(2M))/3 + (C/(2M))/9] - C for C < 2M, else T = M.
- CheckFreq (Mohan et al., FAST'21): measure the checkpoint cost while training and re-tune the
  frequency when it changes. Both inputs are running estimates there: the checkpoint cost an EMA
  of measured costs, the mean time between failures a Gamma-Poisson posterior
  (`posterior_mtbf_s`) over observed interruptions with exponential forgetting
  (`CheckpointIntervalTuner` in `controllers/checkpoint_interval.py`).
- Which of these numbers set the interval, and how, is decided in one place only:
  `controllers/checkpoint_interval.py` (the chooser every caller asks). This module is the maths.
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


# The notice AWS gives before it reclaims a spot node (two minutes): the trainer's default.
SPOT_NOTICE_S = 120.0
# Node faults (no notice) per node-hour: the InfiniteHBD cluster's fault log in
# ../shared/data/cluster/faults, one fault per 5,679 node-hours. The allocation heuristic, the slow
# layer and the in-loop autotune all price faults at this rate (`controllers/checkpoint_interval`).
NODE_FAULT_RATE_PER_NODE_H = 1.0 / 5679.0


def fault_mtbf_s(fault_rate_per_node_h: float, node_count: int) -> float:
    """Mean time between node faults of a gang: any one of `node_count` nodes failing stops it.
    A rate of 0 gives +inf (faults not modelled)."""
    rate = require_number("fault_rate_per_node_h", fault_rate_per_node_h)
    if rate == 0.0:
        return math.inf
    return 3600.0 / (rate * node_count)


def combined_mtbf_s(first_s: float, second_s: float) -> float:
    """MTBF of two independent Poisson processes together: 1 / (1/M1 + 1/M2). An infinite one
    adds nothing, and the other comes back exactly (not via two divisions)."""
    if first_s == math.inf:
        return second_s
    if second_s == math.inf:
        return first_s
    return 1.0 / (1.0 / first_s + 1.0 / second_s)


def posterior_mtbf_s(prior_mtbf_s: float, prior_weight_events: float, exposure_s: float,
                     events: float) -> float:
    """Gamma-Poisson posterior MTBF: with a Gamma(a, b) prior on the rate (a = prior_weight_events,
    b = a * prior_mtbf_s), after `events` in `exposure_s` seconds the posterior mean rate is
    (a + events) / (b + exposure_s); this returns its inverse. No evidence returns the prior
    exactly. An infinite prior carries no weight (it would swamp every observation): the
    observed rate alone, +inf while nothing was observed."""
    if exposure_s == 0.0 and events == 0.0:
        return prior_mtbf_s
    if prior_mtbf_s == math.inf:
        return exposure_s / events if events > 0 else math.inf
    a = prior_weight_events
    return (a * prior_mtbf_s + exposure_s) / (a + events)


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
