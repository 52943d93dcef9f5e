"""The one checkpoint-interval chooser: every place that decides how often a job saves asks
`choose_checkpoint_interval(IntervalFacts) -> IntervalChoice` (issue 25).

Callers, each with the facts it has:
- the allocation heuristic (`controllers/allocation_heuristic.py`), every tick, with the
  deadline's slack: the interval of the cost suite's runs, applied by `cloud/simulator.py`
  through `interval_in_force_s`;
- the slow layer (`controllers/slow_heuristic.py`) and the in-loop autotune
  (`training/_loop_fast.py`, `tuner_for`), through `CheckpointIntervalTuner` below: running
  estimates of the save cost and of the interruptions seen, turned into facts at each re-tune.
  The slow layer's interval reaches the trainer through its live-control file
  (`trainwise/slow_tick.py`);
- the fallbacks (the slow heuristic on bad input, `MultiTimescaleController` when a slow policy
  raises): `fallback_choice()`, the answer when nothing is measured yet.

The rule in force, "trainwise" (`trainwise_rule`):
1. A gang (N > 1) with a deadline keeps its own interval (its fault reserve is sized on it;
   lengthening it freed slack that made a short 16-node job flip on-demand/spot, issue 9); when
   it keeps a fault reserve, the longest halving of its interval (down to `min_interval_s`)
   that leaves room for `1 / reserve_room_share - 1` reserves, else the roomiest one.
2. Otherwise: no measured save cost, a free save, or reclaims that lose work at a rate nobody
   estimated: the floor (the job's own interval when given, else `min_interval_s`).
3. Else Daly's interval (Young's with `use_daly=False`) for the interruptions that lose work:
   node faults always (no notice); reclaims only when a save does not fit in their notice. The
   Gamma-Poisson posterior over the losses observed refines that MTBF. Clamped to the floor and
   `max_interval_s`; nothing that loses work gives `max_interval_s`.
4. With a deadline, halved (not below the floor) until losing one interval plus a restart
   still fits the slack: a fault never costs the deadline.

Changing how the interval is chosen: edit `trainwise_rule` here, and every caller follows
(`tests/test_checkpoint_interval_chooser.py` proves that a swapped rule moves the simulator's
run, the slow layer's action and the in-loop autotune together). To try another rule beside it,
`@register_rule("name")` a function of IntervalFacts and `set_rule("name")` (or
`with using_rule("name"):`). The switch is per process: the slow layer runs in Dagster's
process, the trainer in its own, so a rule for both is made `DEFAULT_RULE`.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from controllers.checkpointing import (
    NODE_FAULT_RATE_PER_NODE_H,
    combined_mtbf_s,
    daly_interval_s,
    fault_mtbf_s,
    posterior_mtbf_s,
    young_interval_s,
)
from controllers.validation import require_number

# Bounds used where a caller gives none: never save more often than a minute (the write itself
# must stay small against the work), nor less often than six hours.
DEFAULT_MIN_INTERVAL_S = 60.0
DEFAULT_MAX_INTERVAL_S = 6 * 3600.0
# A gang's fault-reserve halvings start at most here (a longer interval is not worth halving).
_RESERVE_START_MAX_S = 4 * 3600.0


# The two inputs below are plain (not frozen) slotted dataclasses: the allocation heuristic builds
# both every tick of every simulated run, and a frozen one costs 3.5x as much to build. Treat them
# as values all the same: the chooser never changes them.


@dataclass(slots=True)
class DeadlineSlack:
    """A deadline's facts: how much slack an interval leaves, and what the slack must hold."""

    time_left_s: float  # until the deadline
    remaining_run_s: float  # training still needed (no saves, no changeovers)
    changeover_s: float  # a restart: launch + restore from the last checkpoint
    save_s: float  # one periodic save, counted in the slack for every interval of the run
    risk_s: float  # what a reclaim can lose before the next decision (the safety net's)
    # The job keeps one interval plus a changeover of slack against a node fault (gangs that
    # are likely to see one): the interval also sizes that reserve.
    fault_reserve: bool = False
    reserve_room_share: float = 0.25

    def slack_with_s(self, interval_s: float) -> float:
        """Slack left if on-demand ran from now to the end, saving every `interval_s`."""
        saves_s = math.floor(self.remaining_run_s / interval_s) * self.save_s
        return self.time_left_s - (self.changeover_s + self.remaining_run_s + saves_s)


@dataclass(slots=True)
class IntervalFacts:
    """Everything a checkpoint interval is chosen from; units in the names."""

    # Seconds training stalls for one periodic save; None: not measured yet.
    checkpoint_cost_s: float | None
    # Mean time between reclaims (they come with a notice); inf: none expected (on-demand);
    # None: the caller does not estimate it.
    reclaim_mtbf_s: float | None
    # Mean time between interruptions without notice (node faults); inf: none expected.
    fault_mtbf_s: float
    # Notice a reclaim gives, and whether the on-notice save finishes inside it (then a reclaim
    # loses nothing and periodic saves only insure against faults).
    notice_s: float
    save_fits_notice: bool
    min_interval_s: float = DEFAULT_MIN_INTERVAL_S
    max_interval_s: float = math.inf
    # The interval the job was set up with (the floor the rule lengthens from); None: none.
    own_interval_s: float | None = None
    node_count: int = 1
    # Evidence: `losses` interruptions that lost work in `exposure_s` seconds of running (an
    # estimator's decayed counts), against the priors above weighing `prior_weight_events`.
    exposure_s: float = 0.0
    losses: float = 0.0
    prior_weight_events: float = 1.0
    use_daly: bool = True  # False: Young's first-order interval
    slack: DeadlineSlack | None = None  # None: no deadline to protect

    def __post_init__(self) -> None:
        # Plain comparisons (built every tick by the allocation heuristic); errors name the fix.
        if not self.min_interval_s > 0:
            raise ValueError(f"IntervalFacts.min_interval_s={self.min_interval_s!r} must be > 0 "
                             "seconds")
        if not self.max_interval_s >= self.min_interval_s:
            raise ValueError(f"IntervalFacts.max_interval_s={self.max_interval_s!r} must be >= "
                             f"min_interval_s={self.min_interval_s!r}")
        if self.own_interval_s is not None and not self.own_interval_s > 0:
            raise ValueError(f"IntervalFacts.own_interval_s={self.own_interval_s!r} must be > 0 "
                             "seconds (inf: no periodic saves) or None")
        if not self.fault_mtbf_s > 0 or (self.reclaim_mtbf_s is not None
                                         and not self.reclaim_mtbf_s > 0):
            raise ValueError(f"IntervalFacts MTBFs must be > 0 seconds (inf: none expected), got "
                             f"fault_mtbf_s={self.fault_mtbf_s!r}, reclaim_mtbf_s="
                             f"{self.reclaim_mtbf_s!r}")
        if isinstance(self.node_count, bool) or not isinstance(self.node_count, int) or (
                self.node_count < 1):
            raise ValueError(f"IntervalFacts.node_count={self.node_count!r} must be an int >= 1")


@dataclass(frozen=True, slots=True)
class IntervalChoice:
    """The chosen interval, the rule that chose it and why (one line, for the decision record)."""

    interval_s: float
    rule: str
    reason: str
    # The MTBF of work-losing interruptions the rule reckoned with, and its optimum before bounds
    # and slack (nan: not used).
    mtbf_s: float = math.nan
    optimum_s: float = math.nan


Rule = Callable[[IntervalFacts], IntervalChoice]
_RULES: dict[str, Rule] = {}
DEFAULT_RULE = "trainwise"
_active_rule = DEFAULT_RULE


def register_rule(name: str) -> Callable[[Rule], Rule]:
    """Decorator: makes `rule` choosable as `name` (by `set_rule` / `using_rule`)."""
    def register(rule: Rule) -> Rule:
        _RULES[name] = rule
        return rule
    return register


def set_rule(name: str) -> str:
    """Makes `name` the rule every caller in this process gets; returns the previous one."""
    global _active_rule
    if name not in _RULES:
        raise ValueError(f"no checkpoint-interval rule {name!r}; registered: "
                         f"{', '.join(sorted(_RULES))} (add one with @register_rule)")
    previous, _active_rule = _active_rule, name
    return previous


@contextmanager
def using_rule(name: str) -> Iterator[None]:
    """`set_rule(name)` for the block, the previous rule back afterwards."""
    previous = set_rule(name)
    try:
        yield
    finally:
        set_rule(previous)


def active_rule() -> str:
    return _active_rule


def registered_rules() -> tuple[str, ...]:
    """The rule names a schedule may choose (`trainwise.schedule`)."""
    return tuple(sorted(_RULES))


def choose_checkpoint_interval(facts: IntervalFacts) -> IntervalChoice:
    """The interval every caller uses: the active rule's answer to `facts`."""
    return _RULES[_active_rule](facts)


def fallback_choice(min_interval_s: float = DEFAULT_MIN_INTERVAL_S) -> IntervalChoice:
    """The answer when nothing is known yet (no save measured, no hazard): what a fallback uses."""
    return choose_checkpoint_interval(IntervalFacts(
        checkpoint_cost_s=None, reclaim_mtbf_s=None, fault_mtbf_s=math.inf, notice_s=0.0,
        save_fits_notice=False, min_interval_s=min_interval_s,
        max_interval_s=max(min_interval_s, DEFAULT_MAX_INTERVAL_S)))


def save_fits_notice(checkpoint_cost_s: float | None, notice_s: float,
                     margin_s: float = 0.0) -> bool:
    """Whether an on-notice save (`checkpoint_cost_s`, plus `margin_s`) ends inside the notice.
    An unmeasured cost does not fit (reclaims are then taken to lose work)."""
    if checkpoint_cost_s is None or not checkpoint_cost_s == checkpoint_cost_s:
        return False
    return notice_s > 0 and checkpoint_cost_s + margin_s <= notice_s


def work_losing_mtbf_s(facts: IntervalFacts) -> float | None:
    """MTBF of the interruptions that lose work: node faults, and reclaims when a save does not
    fit their notice; refined by the losses observed. None: reclaims lose work at a rate the
    caller does not estimate."""
    if facts.save_fits_notice:
        prior_s = facts.fault_mtbf_s
    elif facts.reclaim_mtbf_s is None:
        return None
    else:
        prior_s = combined_mtbf_s(facts.reclaim_mtbf_s, facts.fault_mtbf_s)
    return posterior_mtbf_s(prior_s, facts.prior_weight_events, facts.exposure_s, facts.losses)


def interval_in_force_s(current_s: float, asked_s: float | None, *, asked_by: str) -> float:
    """The interval a runner applies after a policy answered: None keeps `current_s`; a positive
    number (inf: no periodic saves) replaces it; anything else is refused, naming who asked."""
    if asked_s is None:
        return current_s
    if not asked_s > 0:
        raise ValueError(f"policy {asked_by!r} asked for checkpoint_interval_s={asked_s}; it "
                         "must be positive (inf: no periodic saves; None keeps the interval)")
    return float(asked_s)


# The rule -------------------------------------------------------------------------------------

@register_rule(DEFAULT_RULE)
def trainwise_rule(facts: IntervalFacts) -> IntervalChoice:
    """trainwise's rule (module docstring, steps 1-4)."""
    slack = facts.slack
    if slack is not None and facts.node_count > 1:
        return _gang_with_deadline(facts, slack)
    floor_s = facts.own_interval_s if facts.own_interval_s is not None else facts.min_interval_s
    floor_name = "the job's own interval" if facts.own_interval_s is not None else "the minimum"
    mtbf_s = work_losing_mtbf_s(facts)
    shown_mtbf_s = math.nan if mtbf_s is None else mtbf_s
    cost_s = facts.checkpoint_cost_s
    if cost_s is None or not cost_s == cost_s:
        return IntervalChoice(floor_s, DEFAULT_RULE, f"{floor_name} ({floor_s:.0f}s) until a save "
                              "is measured (save early, then measure)", shown_mtbf_s)
    if cost_s <= 0:
        return IntervalChoice(floor_s, DEFAULT_RULE, f"a save costs nothing: {floor_name} "
                              f"({floor_s:.0f}s)", shown_mtbf_s)
    if mtbf_s is None:
        return IntervalChoice(floor_s, DEFAULT_RULE, (
            f"a {cost_s:.0f} s save does not fit in the {facts.notice_s:.0f} s notice, so "
            f"reclaims lose work at a rate not estimated here: {floor_name}"), shown_mtbf_s)
    formula = daly_interval_s if facts.use_daly else young_interval_s
    optimum_s = math.inf if mtbf_s == math.inf else formula(cost_s, mtbf_s)
    interval_s = min(facts.max_interval_s, max(floor_s, optimum_s))
    name = "Daly" if facts.use_daly else "Young"
    if slack is not None and math.isfinite(interval_s) and interval_s > floor_s:
        interval_s = _halve_to_fit(interval_s, floor_s, slack)
    if slack is not None and facts.save_fits_notice:
        # Worded as the cost suite's decision records have read since the rule was measured.
        reason = (f"a {cost_s:.0f} s save fits in the {facts.notice_s:.0f} s notice, so only "
                  f"node faults need periodic saves ({name}'s interval {optimum_s / 3600:.1f} h, "
                  "halved until losing one still fits the slack)")
    else:
        hazard = ("node faults only: a save fits in the notice" if facts.save_fits_notice else
                  "reclaims and faults: a save does not fit in the notice")
        reason = (f"{name} on save {cost_s:.3g}s and MTBF {mtbf_s:.0f}s ({hazard}), clamped "
                  f"to [{floor_s:.0f}, {facts.max_interval_s:.0f}]s")
    return IntervalChoice(interval_s, DEFAULT_RULE, reason, mtbf_s, optimum_s)


@register_rule("fixed")
def fixed_rule(facts: IntervalFacts) -> IntervalChoice:
    """No tuning: the job's own interval (else the minimum), whatever is measured. The schedule
    a team chooses when it wants the saves it configured and nothing the hazard suggests."""
    floor_s = facts.own_interval_s if facts.own_interval_s is not None else facts.min_interval_s
    return IntervalChoice(floor_s, "fixed", f"fixed rule: the job's own interval "
                          f"({floor_s:.0f}s), not tuned")


def _halve_to_fit(interval_s: float, floor_s: float, slack: DeadlineSlack) -> float:
    """The longest of `interval_s` and its halvings (down to the floor) whose loss to a fault,
    plus the restart, still leaves the slack above the net; the floor when none does."""
    while interval_s > floor_s:
        if slack.slack_with_s(interval_s) - (slack.risk_s + slack.changeover_s + interval_s) >= 0:
            return interval_s
        interval_s /= 2.0
    return floor_s


def _gang_with_deadline(facts: IntervalFacts, slack: DeadlineSlack) -> IntervalChoice:
    own_s = facts.own_interval_s
    if own_s is None:
        raise ValueError("IntervalFacts for a gang with a deadline need own_interval_s (the "
                         "job's interval its fault reserve is sized on)")
    if not slack.fault_reserve:
        return IntervalChoice(own_s, DEFAULT_RULE, "a gang keeps its own interval (its fault "
                              "reserve is sized on it)")
    # The room above the net (slack minus risk, changeover and one interval lost to a fault,
    # saves counted) must hold this many more reserves.
    need = 1.0 / slack.reserve_room_share - 1.0
    floor_s = facts.min_interval_s
    candidates = [own_s] if math.isfinite(own_s) else []
    interval_s = min(own_s, _RESERVE_START_MAX_S)
    while interval_s > floor_s:
        interval_s /= 2.0
        candidates.append(max(interval_s, floor_s))
    if not candidates:
        return IntervalChoice(own_s, DEFAULT_RULE, "a gang keeps its own interval")
    best_s, best_room = candidates[0], -math.inf
    for candidate_s in candidates:
        room = slack.slack_with_s(candidate_s) - slack.risk_s - slack.changeover_s - candidate_s
        if room >= need * candidate_s:
            return IntervalChoice(candidate_s, DEFAULT_RULE, _reserve_reason(candidate_s, own_s))
        if room > best_room:
            best_s, best_room = candidate_s, room
    return IntervalChoice(best_s, DEFAULT_RULE, _reserve_reason(best_s, own_s) + " (the roomiest)")


def _reserve_reason(interval_s: float, own_s: float) -> str:
    if interval_s >= own_s:
        return "a gang keeps its own interval: the slack holds its fault reserve"
    return f"checkpoint every {interval_s / 60:.0f} min so a node fault fits the thin slack"


# The running estimates of the slow layer and the in-loop autotune -----------------------------

@dataclass(frozen=True)
class CheckpointTunerConfig:
    """Settings of the running estimates that feed the chooser."""

    # Prior mean time between reclaims, before any is observed. Four hours is a placeholder for
    # a calm spot market; the slow policy replaces it with the risk model's estimate when given.
    prior_mtbf_s: float = 4 * 3600.0
    # Weight of the prior, in pseudo-events: 1 means one observed interruption outweighs it.
    prior_weight_events: float = 1.0
    # Old exposure and events lose half their weight every this many seconds (None: never).
    forget_half_life_s: float | None = 6 * 3600.0
    # Weight of the previous cost estimate in the EMA of measured checkpoint costs.
    cost_ema_beta: float = 0.7
    # Bounds on the interval: never checkpoint more often than min, nor less often than max.
    min_interval_s: float = DEFAULT_MIN_INTERVAL_S
    max_interval_s: float = DEFAULT_MAX_INTERVAL_S
    # Re-tune only when the optimum moved by more than this share (CheckFreq re-tunes on change;
    # the band keeps a noisy cost from moving the interval every tick).
    retune_rel_change: float = 0.10
    use_daly: bool = True
    # Node faults (no notice) per node-hour; 0: not modelled apart (left in prior_mtbf_s).
    fault_rate_per_node_h: float = NODE_FAULT_RATE_PER_NODE_H
    # A save fits a reclaim's notice when it ends this long before the notice does (the fast
    # heuristic's `notice_safety_margin_s`).
    notice_margin_s: float = 5.0

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
        require_number("fault_rate_per_node_h", self.fault_rate_per_node_h)
        require_number("notice_margin_s", self.notice_margin_s)


class CheckpointIntervalTuner:
    """Running estimates (CheckFreq-style) turned into `IntervalFacts` for the chooser.

    Estimates: the save cost (an EMA of measured costs); the reclaim MTBF prior (the config's,
    or the risk model's via `set_prior_mtbf`); the interruptions that lost work over the time
    exposed, with exponential forgetting. Situation: node count and the reclaim notice
    (`set_situation`; notice 0 = none or unknown: reclaims are taken to lose work).
    """

    def __init__(self, config: CheckpointTunerConfig | None = None) -> None:
        self.config = config or CheckpointTunerConfig()
        self._prior_mtbf_s = self.config.prior_mtbf_s
        self._exposure_s = 0.0
        self._events = 0.0
        self._cost_s: float | None = None
        self._interval_s: float | None = None
        self.node_count = 1
        self.notice_s = 0.0
        self.last_choice: IntervalChoice | None = None

    def set_prior_mtbf(self, mtbf_s: float) -> None:
        """Replace the reclaim MTBF prior (e.g. the risk model's estimate); +inf: 'no risk'."""
        if mtbf_s == math.inf:
            value = math.inf
        else:
            value = require_number("mtbf_s", mtbf_s, strictly_positive=True)
        # An infinite prior would swamp every observation; cap it at 100x the longest interval.
        self._prior_mtbf_s = min(value, 100.0 * self.config.max_interval_s)

    def set_situation(self, *, node_count: int, notice_s: float) -> None:
        """The gang size (faults scale with it) and the notice a reclaim gives (0: none)."""
        if isinstance(node_count, bool) or not isinstance(node_count, int) or node_count < 1:
            raise ValueError(f"node_count={node_count!r} must be an int >= 1")
        self.node_count = node_count
        self.notice_s = require_number("notice_s", notice_s)

    def observe_exposure(self, duration_s: float, interruptions: int = 0) -> None:
        """Add `duration_s` s of running during which `interruptions` losses of work happened."""
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

    def facts(self) -> IntervalFacts:
        cfg = self.config
        return IntervalFacts(
            checkpoint_cost_s=self._cost_s, reclaim_mtbf_s=self._prior_mtbf_s,
            fault_mtbf_s=fault_mtbf_s(cfg.fault_rate_per_node_h, self.node_count),
            notice_s=self.notice_s,
            save_fits_notice=save_fits_notice(self._cost_s, self.notice_s, cfg.notice_margin_s),
            min_interval_s=cfg.min_interval_s, max_interval_s=cfg.max_interval_s,
            node_count=self.node_count, exposure_s=self._exposure_s, losses=self._events,
            prior_weight_events=cfg.prior_weight_events, use_daly=cfg.use_daly)

    @property
    def mtbf_s(self) -> float:
        """MTBF of the interruptions that lose work, as the chooser reckons it now."""
        mtbf = work_losing_mtbf_s(self.facts())
        return math.nan if mtbf is None else mtbf

    def choice(self) -> IntervalChoice:
        return choose_checkpoint_interval(self.facts())

    def optimal_interval_s(self) -> float:
        """The chooser's interval at the current estimates (no hysteresis)."""
        return self.choice().interval_s

    def retune(self) -> tuple[float, bool]:
        """(interval_s in force, changed): moves the interval only when the optimum moved enough."""
        self.last_choice = self.choice()
        optimum = self.last_choice.interval_s
        if self._interval_s is None or abs(optimum - self._interval_s) > (
                self.config.retune_rel_change * self._interval_s):
            self._interval_s = optimum
            return optimum, True
        return self._interval_s, False

    @property
    def interval_s(self) -> float | None:
        """The interval in force (None before the first `retune`)."""
        return self._interval_s
