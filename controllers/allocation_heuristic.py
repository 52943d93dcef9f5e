"""trainwise's node allocation heuristic ("trainwise_heuristic"): Can't Be Late's safety net,
with every other choice priced by a preemption-risk model learned from real spot traces.

References: Wu et al., "Can't Be Late: Optimizing Spot Instance Savings under Deadlines",
NSDI'24 (Uniform Progress, its safety net, the 0.1 h changeover setting); the hazard model of
`controllers/preemption_risk.py` (piecewise-exponential hazards by zone, run age and time of
day, fitted by `cloud/risk_fit.py`); backward induction in `controllers/allocation_planner.py`.

Why it beats Uniform Progress on the real traces (`benchmarks/results/cost.md`): Uniform Progress
stays on on-demand while spot is available until it is ahead of its line, and spends slack early.
Spot runs on AWS are mostly short (median under an hour) but heavy-tailed, and every change of
node set costs a changeover (0.1 h, billed, no progress) and the slack it eats. Slack is the
budget that pays for waiting and for changeovers; the policy prices it:

1. Single zone, single node (the Can't Be Late setting): a slack plan, solved once per job by
   backward induction over (time left, slack, holding, spot up/down and the run's age) on the
   fitted model, says idle, on-demand or spot. It rides a spot run only when the run's expected
   remaining length (its age matters: a run that has lasted hours will likely last hours more)
   pays for the two changeovers of slack it costs, waits idle only when the slack will not be
   needed for better rides, and leaves spot for on-demand before a likely preemption when the
   slack left cannot afford one more restart.
2. Several zones or a gang (N > 1): every node set (zone, s spot + N - s on-demand, with s a
   share of N from `spot_fractions`) is scored by its expected cost per hour of progress over the
   rest of the job: price x expected holding time, plus the restart after a preemption (a
   changeover on on-demand), plus the slack its changeovers eat at the plan's price of slack,
   divided by the expected progress (holding time minus changeover and notice save). The
   cheapest wins, a change only if it beats keeping the current set by `switch_margin`
   (hysteresis, so short runs elsewhere do not pull the job around). A composite plan (all
   zones as one process: a preempted job hops to another zone with the probability that one
   has spot) supplies the price of slack and says when to wait or stay on on-demand.
   Launching spot must also pay for itself as a bet (issue 9, thin slack): the expected cost of
   finishing when launching now (the spot set billed for its expected hold, changeover and
   saves at its checkpoint interval included, then a changeover and the rest on on-demand once
   its run ends) must beat on-demand from now (by `try_margin`); a held spot set is left for
   on-demand (no preemption) only when riding on is expected to cost more than on-demand from
   there, so a launch is never undone a tick later. Gangs are whole: a set of s spot nodes is
   up while all s are (the model's level-s curves; above the fitted sizes
   `PreemptionRiskModel.with_gang_levels`), and by default only whole-gang spot is tried.
3. Safety net (Can't Be Late's, widened like the simulator's peers): an action that could leave
   the job unable to finish on on-demand after one more tick and a preemption is refused; when
   nothing else is safe, on-demand to the end. Gangs (N > 1) also keep a fault reserve (one
   checkpoint interval plus a changeover) because node faults come without notice, while a
   fault before the end is likely enough (`fault_reserve_min_p`); when slack gets thin a spot
   gang asks for a shorter checkpoint interval (the longest halving that leaves room), with the
   extra saves counted in its slack. On-demand and waiting keep the job's own interval. Every
   interval comes from the one chooser (`controllers/checkpoint_interval.py`), asked each tick
   with this job's facts (save, notice, fault rate, its own interval, the deadline's slack).

Events (single zone, thin slack): spot (run 3 h old) -> preempted -> spot gone: on-demand (slack
kept for later rides) -> spot back, run 2 min old: stay on on-demand (too young to pay two
changeovers) -> run 40 min old: take spot -> ... -> slack at the net: on-demand to the end.

State: the policy remembers, from the observations it is given, when each zone's spot capacity
last changed (the age of the current availability run), starting from the model's
`run_at_cutoff` (history observed before the window), and the plan solved on the job's first
tick. It forgets both when the job clock goes back (a new run), so two runs over the same trace
make the same decisions.

Bad input (NaN, infinite or negative numbers, a zero-length window, inconsistent per-zone tuples):
on-demand for the whole gang in the current zone (else the home zone, else the first zone), with
a reason that starts with "fallback:" and names the bad fields. A gang size that is not a
positive int cannot be sized: the fallback is then to release (hold nothing).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import NamedTuple

from controllers.allocation_planner import (
    ACTION_NAMES,
    IDLE,
    ON_DEMAND,
    SPOT,
    PlanInputs,
    SlackPlan,
    solve_plan,
)
from controllers.allocation_types import AllocationAction, AllocationObservation
from controllers.checkpoint_interval import (
    DeadlineSlack,
    IntervalChoice,
    IntervalFacts,
    choose_checkpoint_interval,
)
from controllers.checkpointing import NODE_FAULT_RATE_PER_NODE_H, fault_mtbf_s
from controllers.online_risk import ObservedRuns, moved, with_multipliers
from controllers.preemption_risk import (
    DOWN,
    GANG_HAZARD_EXPONENT,
    POOLED_ZONE,
    UP,
    PreemptionRiskModel,
)
from controllers.validation import number_problem

# Caps on the plan grid (steps of time, levels of slack).
MAX_PLAN_STEPS = 1000
MAX_PLAN_SLACK_LEVELS = 240
# Uninformed prior when no fitted model is given: memoryless runs, 2 h up, 1 h down.
PRIOR_MEAN_UP_S = 7200.0
PRIOR_MEAN_DOWN_S = 3600.0


@dataclass(frozen=True)
class TrainwiseAllocationConfig:
    # A new node set must cost this share less per unit of progress than keeping the current one.
    switch_margin: float = 0.05
    # Gangs: leave spot early when P(preempt within `leave_horizon_ticks`) is above this and the
    # slack above the net is under `thin_slack_ticks` ticks (single node: the plan decides).
    leave_p_preempt: float = 0.5
    leave_horizon_ticks: float = 2.0
    thin_slack_ticks: float = 3.0
    # Slack kept against node faults (no notice); None: one checkpoint interval plus a
    # changeover for gangs (N > 1), 0 for a single node.
    fault_reserve_s: float | None = None
    # With that default, gangs short of slack checkpoint every `fault_room_share` of the slack
    # room left (not less than `min_checkpoint_interval_s`), so a fault still fits.
    fault_room_share: float = 0.25
    min_checkpoint_interval_s: float = 900.0
    # The reserve is kept only while P(a node fault before the job is done) is at least
    # `fault_reserve_min_p`, at `fault_rate_per_node_h` (the InfiniteHBD cluster's fault log in
    # ../shared/data/cluster/faults: one fault per 5,679 node-hours). Below it a fault is a risk
    # on-demand carries just the same, and reserving a whole interval for it priced short gang
    # jobs out of spot entirely.
    fault_rate_per_node_h: float = NODE_FAULT_RATE_PER_NODE_H
    fault_reserve_min_p: float = 0.02
    # The job's checkpoint interval, chosen rather than taken as given, by the one chooser
    # (`controllers/checkpoint_interval.py`, which the slow layer and the trainer ask too): when
    # a save fits in the preemption notice, a reclaim loses nothing whatever the interval, and
    # periodic saves only insure against node faults (no notice). Their interval is then Daly's
    # optimum for a node's fault rate (13.7 h against the fault log's 5,679 h MTBF, where the
    # suite's jobs save every hour), never shorter than the job's own, halved until losing one
    # interval and a restart still fits the slack, so a fault never costs the deadline. Gangs
    # keep the job's interval (shortened by the chooser when their fault reserve is thin).
    # False: a single node keeps the job's own interval. Cost suite at ec03a2b, node faults
    # billed to every policy: the
    # pooled single-node cost / oracle 1.099 -> 1.094 single-zone, 1.088 -> 1.077 multi-zone
    # (LOCO), 0 deadline misses; one cell dearer (LOCO p3.16xlarge single-zone, +0.4%).
    fault_checkpoint_interval: bool = True
    # Gangs larger than the model's fitted sizes: m groups of the largest fitted size count as
    # m ** this many independent ones (`PreemptionRiskModel.with_gang_levels`; 0.23 read off
    # the 4-node folder in ../shared/data, where capacity mostly goes in blocks).
    gang_hazard_exponent: float = GANG_HAZARD_EXPONENT
    # A spot launch's expected cost to finish must beat on-demand's by this share (0.05 cost
    # the 40 h / 52 h 4-node gang 2.4% more on the 4-node folder, 18 windows: 0.985x vs 0.962x
    # Uniform Progress; no change on the short gang job).
    try_margin: float = 0.0
    # Spot shares of the gang tried for node sets (N > 1). Whole-gang spot only by default: a
    # preemption of any spot node relaunches the whole gang, and partial counts flap far more
    # than whole-gang capacity (on the 4-node folder, 18 windows of the 40 h / 52 h gang: with
    # (1, .75, .5, .25) 1.013x Uniform Progress and 38 changeovers where it paid 17; whole-gang
    # only 0.962x). In-sample: the only real gang data in ../shared/data. Re-measured on the
    # cost suite (8 windows per zone): (1, .75, .5) costs the real 4-node gang 0.978x Uniform
    # Progress single-zone where whole-gang costs 0.956x (LOCO; LTO 0.984x vs 0.958x), and cuts
    # the SYNTHETIC 16-node gang to 0.817x from 0.983x (multi-zone 0.562x from 0.751x) while its
    # windows costlier than on-demand rise to 16.7% from 4.2%; a plan solved per set size did
    # not change that picture. A real large-gang market decides; until then, whole gangs.
    spot_fractions: tuple[float, ...] = (1.0,)
    # Single zone, single node: follow the slack plan (else score node sets as for many zones).
    use_plan: bool = True
    # Several zones or a gang: price slack and decide waiting with the composite plan (else with
    # the closed-form budget rule of `_slack_price` and `_wait_pays`).
    composite_plan: bool = True
    # Plan grid: the step (the trace tick times the whole number of ticks closest to this) and
    # the slack unit. Finer grids cost time and changed costs by under 1% on the suite. In the
    # model world (`benchmarks/cost/bound.py`: markets drawn from the model itself, so no held-out
    # data is touched) a 200 s step, 40 or 60 s slack units, one-step age bins up to 4 h, or a
    # time-of-day-aware plan moved the single-zone mean by 0.2% at most (the finest grid, at
    # 30x the CPU, was 0.5% worse): the plan is not where the gap to the oracle comes from.
    plan_step_s: float = 400.0
    plan_slack_unit_s: float = 120.0
    # Plan runs age one bin per step up to this age (0: the curve's own wide bins).
    plan_fine_age_until_s: float = 0.0
    # Release a running on-demand set to wait for spot while spot is down in every zone, when
    # the plan says so. False (default) keeps on-demand through such an outage, as the
    # published Uniform Progress does: a release pays a changeover to come back whenever the
    # outage outlasts the slack, and the fitted models, out of sample, expected spot back far
    # sooner than it came (issue 9: the 4-node gang paid more than on-demand in 8.3% / 16.7% of
    # its single-zone windows, LOCO / LTO, by such release-and-relaunch cycles; with the rule
    # 0% / 4.2%; no cell of the cost suite got dearer by more than 0.01%).
    release_on_demand_in_outage: bool = False
    # Online update of the fitted hazards from the runs seen in the job's own window (gamma
    # frailty, `controllers/online_risk.py`): the fit counts as this many pseudo-events. None
    # (default): the fitted model as given, for the whole job. Measured with 4 on every cell of
    # the cost suite, both protocols (single node and the 4-node gang, 8 windows per zone): mean
    # -0.02% across cells, single-zone cells -2.1% to +1.8%, multi-zone cells -7.5% to +5.4%
    # (the pooled update moves the composite plan): no consistent gain, so it stays off.
    online_prior_events: float | None = None
    # ... re-priced at most this often (each re-pricing re-solves the plan: ~20 ms).
    online_reprice_every_s: float = 4 * 3600.0
    # What "spot down" means for that rule: True counts a zone as down while it has fewer free
    # spot nodes than the smallest spot set tried (`spot_fractions`; the whole gang by default),
    # since the gang can no more launch spot there than in a zone with none. False: down only at
    # 0 free nodes, so 1 free node of a 4-node gang's zone let the plan release on-demand to
    # wait for a gang that never came back (issue 9, the 4-node gang's one LTO window costlier
    # than on-demand: us-east-2a from tick 2867, released at 46.5 h on 1 of 4 nodes, relaunched
    # on-demand at the safety net). A single node is unchanged (its smallest set is 1 node).
    outage_by_gang_level: bool = True

    def __post_init__(self) -> None:
        if not 0 <= self.switch_margin < 1:
            raise ValueError(f"switch_margin={self.switch_margin} must be in [0, 1)")
        if not 0 <= self.try_margin < 1:
            raise ValueError(f"try_margin={self.try_margin} must be in [0, 1)")
        if not 0 < self.leave_p_preempt <= 1:
            raise ValueError(f"leave_p_preempt={self.leave_p_preempt} must be in (0, 1]")
        if not self.spot_fractions or any(not 0 < f <= 1 for f in self.spot_fractions):
            raise ValueError(f"spot_fractions={self.spot_fractions} must be in (0, 1]")
        if self.fault_reserve_s is not None and not self.fault_reserve_s >= 0:
            raise ValueError(f"fault_reserve_s={self.fault_reserve_s} must be >= 0 or None")
        if not (self.plan_step_s > 0 and self.plan_slack_unit_s > 0):
            raise ValueError("plan_step_s and plan_slack_unit_s must be positive")


def bad_allocation_fields(obs: AllocationObservation) -> list[str]:
    """One description per unusable field of an allocation observation; empty when usable."""
    problems = [
        number_problem("time_s", obs.time_s),
        number_problem("tick_s", obs.tick_s, strictly_positive=True),
        number_problem("trace_time_s", obs.trace_time_s),
        number_problem("work_done_h", obs.work_done_h),
        number_problem("work_checkpointed_h", obs.work_checkpointed_h),
        number_problem("work_total_h", obs.work_total_h, strictly_positive=True),
        number_problem("work_rate_gpu_h_per_h", obs.work_rate_gpu_h_per_h,
                       strictly_positive=True),
        number_problem("deadline_s", obs.deadline_s, strictly_positive=True),
        number_problem("changeover_s", obs.changeover_s),
        number_problem("checkpoint_save_s", obs.checkpoint_save_s),
        # +inf is valid: no periodic saves (the Can't Be Late setting).
        None if obs.checkpoint_interval_s == math.inf else number_problem(
            "checkpoint_interval_s", obs.checkpoint_interval_s, strictly_positive=True),
        number_problem("notice_s", obs.notice_s),
        number_problem("changeover_left_s", obs.changeover_left_s),
        number_problem("since_checkpoint_s", obs.since_checkpoint_s),
        number_problem("since_launch_s", obs.since_launch_s),
        number_problem("spot_nodes", obs.spot_nodes),
        number_problem("on_demand_nodes", obs.on_demand_nodes),
    ]
    problems = [p for p in problems if p is not None]
    n_zones = len(obs.zones)
    if n_zones == 0:
        problems.append("zones is empty")
    for name in ("spot_available_by_zone", "spot_price_usd_per_hour_by_zone",
                 "on_demand_price_usd_per_hour_by_zone"):
        values = getattr(obs, name)
        if len(values) != n_zones:
            problems.append(f"{name} has {len(values)} values for {n_zones} zones")
            continue
        for zone, value in zip(obs.zones, values):
            problem = number_problem(f"{name}[{zone}]", value)
            if problem is not None:
                problems.append(problem)
    if obs.home_zone not in obs.zones:
        problems.append(f"home_zone {obs.home_zone!r} is not in zones")
    if obs.zone is not None and obs.zone not in obs.zones:
        problems.append(f"zone {obs.zone!r} is not in zones")
    return problems


def _plainly_usable(obs: AllocationObservation) -> bool:
    """Fast path of `bad_allocation_fields` (it runs every tick): True only when every number
    is a plain float or int, finite, >= 0 (> 0 where required) and the per-zone fields line up,
    so that `bad_allocation_fields` would find nothing. False means "look closer", not "bad"."""
    zones = obs.zones
    n_zones = len(zones)
    available = obs.spot_available_by_zone
    spot_prices = obs.spot_price_usd_per_hour_by_zone
    od_prices = obs.on_demand_price_usd_per_hour_by_zone
    if not (n_zones and len(available) == len(spot_prices) == len(od_prices) == n_zones
            and obs.home_zone in zones and (obs.zone is None or obs.zone in zones)):
        return False
    interval = obs.checkpoint_interval_s
    if type(interval) is float and interval == math.inf:
        interval = 1.0  # no periodic saves: valid (checked like any positive number otherwise)
    positive = (obs.tick_s, obs.work_total_h, obs.work_rate_gpu_h_per_h, obs.deadline_s,
                interval)
    values = (obs.time_s, obs.trace_time_s, obs.work_done_h, obs.work_checkpointed_h,
              obs.changeover_s, obs.checkpoint_save_s, obs.notice_s, obs.changeover_left_s,
              obs.since_checkpoint_s, obs.since_launch_s, obs.spot_nodes, obs.on_demand_nodes,
              *positive, *available, *spot_prices, *od_prices)
    # Exact types (bool, an int subclass, is refused); a NaN or infinity makes the sum
    # non-finite, and then min() is not trusted either.
    return (set(map(type, values)) <= _PLAIN_NUMBER_TYPES and math.isfinite(sum(values))
            and min(values) >= 0 and min(positive) > 0)


_PLAIN_NUMBER_TYPES = frozenset((float, int))


def _fallback(obs: AllocationObservation, problems: list[str]) -> AllocationAction:
    """On-demand for the whole gang: the action that can never be preempted."""
    n = obs.node_count
    reason = f"fallback: bad {'; '.join(problems)}"
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        return AllocationAction.release(
            f"{reason}; node_count={n!r} cannot size a gang: release", {"bad_fields": 1.0}
        )
    zones = tuple(obs.zones) if isinstance(obs.zones, tuple) else ()
    if obs.zone in zones:
        zone = obs.zone
    elif obs.home_zone in zones:
        zone = obs.home_zone
    elif zones:
        zone = zones[0]
    else:
        return AllocationAction.release(f"{reason}; no zone to run in: release",
                                        {"bad_fields": float(len(problems))})
    return AllocationAction(zone, 0, n, None, f"{reason}; on-demand (safe default)",
                            {"bad_fields": float(len(problems))})


@dataclass
class _Candidate:
    zone: str
    spot: int
    price_usd_per_h: float
    launch_s: float  # seconds of changeover before it trains (0 when kept)
    age_s: float  # age of the spot run it rides (0 for on-demand)
    score_usd_per_h: float  # expected cost per hour of progress, slack priced in
    expected_hold_s: float
    p_end: float  # P(preempted before the job is done)
    held: bool


class _RunTracker:
    """When each (zone, spot level) last changed state, from the observations seen so far; with
    `observed`, also the runs' evidence for the online risk update (`controllers/online_risk`)."""

    def __init__(self, observed: ObservedRuns | None = None) -> None:
        self.last_time_s: float | None = None
        self.runs: dict[tuple[str, int], tuple[bool, float]] = {}
        # Runs whose start was seen (or given by the history before the window).
        self.known: set[tuple[str, int]] = set()
        self.observed = observed

    def update(self, obs: AllocationObservation, levels: tuple[int, ...],
               model: PreemptionRiskModel) -> None:
        now = obs.time_s
        if self.last_time_s is None or now < self.last_time_s:
            self.runs = {}
            self.known = set()
            if self.observed is not None:
                self.observed.reset()
        first = not self.runs
        dt_s = 0.0 if first else now - self.last_time_s
        for zone, available in zip(obs.zones, obs.spot_available_by_zone):
            for level in levels:
                up = available >= level
                key = (zone, level)
                known = self.runs.get(key)
                if self.observed is not None and known is not None and key in self.known:
                    # The run in progress lasted until now (or ended since the last tick).
                    self.observed.expose(model, zone, level, known[0],
                                         self.last_time_s - known[1], dt_s,
                                         obs.trace_time_s - dt_s)
                    if known[0] != up:
                        self.observed.end(zone, level, known[0])
                if known is not None and known[0] == up:
                    continue
                start = now
                self.known.add(key)
                if first:
                    # The window's first tick: continue the run seen before the cutoff, if any.
                    state, age = model.run_at_cutoff.get(key, (None, 0.0))
                    if state == (UP if up else DOWN):
                        start = now - age
                    else:
                        self.known.discard(key)  # its start is unknown: no evidence
                self.runs[key] = (up, start)
        self.last_time_s = now

    def age_s(self, zone: str, level: int, now_s: float) -> float:
        known = self.runs.get((zone, level))
        return max(0.0, now_s - known[1]) if known is not None else 0.0


class _Situation(NamedTuple):
    """The numbers every rule of one decision shares (a NamedTuple: built every tick, cheaply)."""

    slack_s: float  # slack if on-demand had to be (re)launched now and run to the end
    net_s: float  # slack below which only on-demand is safe
    # Slack above the net to spend on waiting and changeovers (on on-demand, its launch is paid).
    budget_s: float
    mode: int  # IDLE, ON_DEMAND or SPOT (what is held now)
    holding: bool
    # Checkpoint interval a spot gang asks for (thin slack), None: the job's own interval.
    checkpoint_interval_s: float | None = None
    # The job's own interval (on-demand and waiting go back to it).
    base_interval_s: float = math.inf
    # The chooser's answer this tick (None: the job's own interval, not asked).
    choice: IntervalChoice | None = None


class TrainwiseAllocationPolicy:
    """Hazard-aware spot/on-demand allocation with Can't Be Late's safety net (module docstring).

    `risk_model`: a fitted `PreemptionRiskModel` (see `cloud/risk_fit.py`); None uses a
    memoryless prior (2 h up, 1 h down) for every zone.
    """

    name = "trainwise_heuristic"

    def __init__(self, risk_model: PreemptionRiskModel | None = None,
                 config: TrainwiseAllocationConfig | None = None) -> None:
        self.model = risk_model or PreemptionRiskModel.constant(
            PRIOR_MEAN_UP_S, PRIOR_MEAN_DOWN_S, fitted_on="memoryless prior (no fitted model)")
        self.config = config or TrainwiseAllocationConfig()
        self._observed = (None if self.config.online_prior_events is None
                          else ObservedRuns(self.config.online_prior_events))
        self._tracker = _RunTracker(self._observed)
        # The multipliers baked into `self.model` by the online update (empty: none).
        self._multipliers_used: dict[tuple[str, str, int], float] = {}
        self._model_generation = 0
        self._repriced_at_s = 0.0
        self._plan: SlackPlan | None = None
        self._plan_key: tuple | None = None
        self._levels_by_n: dict[int, tuple[int, ...]] = {}
        self._fault_mtbf_by_n: dict[int, float] = {}
        self._base_interval: float | None = None
        self._base_model = self.model
        self._prior_model = self.model
        self._gang_models: dict[int, PreemptionRiskModel] = {}

    def act(self, observation: AllocationObservation) -> AllocationAction:
        # The detailed check only when the fast one is not sure (same result, ~10x cheaper).
        problems = [] if _plainly_usable(observation) else bad_allocation_fields(observation)
        n = observation.node_count
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            problems.append(f"node_count={n!r} is not an int >= 1")
        if problems:
            return _fallback(observation, problems)
        if n > 1 and n not in self._gang_models:
            # Gangs above the model's fitted sizes: whole-gang curves (N-node survival).
            self._gang_models[n] = self._base_model.with_gang_levels(
                self._levels(n), self.config.gang_hazard_exponent)
        prior = self._gang_models.get(n, self._base_model)
        if self._observed is None:
            self.model = prior
        elif self._tracker.last_time_s is None or observation.time_s < self._tracker.last_time_s:
            self.model, self._multipliers_used = prior, {}  # a new job: the fit as given
            self._repriced_at_s = observation.time_s
        self._prior_model = prior
        return self._decide(observation)

    def _update_online(self) -> None:
        """Re-price the hazards from the runs seen so far when a multiplier has moved enough
        (the plan is re-solved on the next decision that needs it)."""
        now = self._tracker.last_time_s
        if now - self._repriced_at_s < self.config.online_reprice_every_s:
            return
        new = self._observed.multipliers()
        if not moved(new, self._multipliers_used):
            return
        self._repriced_at_s = now
        self.model = with_multipliers(self._prior_model, new.items())
        self._multipliers_used = new
        self._model_generation += 1

    # Shared pieces ------------------------------------------------------------------------------

    def _levels(self, n: int) -> tuple[int, ...]:
        levels = self._levels_by_n.get(n)
        if levels is None:  # the config is frozen: one tuple per gang size
            found = {n} | {max(1, min(n, round(n * f))) for f in self.config.spot_fractions}
            levels = self._levels_by_n[n] = tuple(sorted(found, reverse=True))
        return levels

    def _base_interval_s(self, obs: AllocationObservation) -> float:
        """The job's own checkpoint interval (the one in force at its first tick, set in
        `_decide`): what on-demand and waiting use; only a spot gang with thin slack asks for a
        shorter one."""
        return obs.checkpoint_interval_s if self._base_interval is None else self._base_interval

    def _situation(self, obs: AllocationObservation) -> _Situation:
        cfg, n, c = self.config, obs.node_count, obs.changeover_s
        run_s = obs.remaining_run_s
        own_s = self._base_interval_s(obs)
        # What a spot gang can lose before the next decision (as the peers' `spot_risk_s`).
        if obs.checkpoint_save_s <= obs.notice_s:
            risk_s = obs.tick_s + obs.checkpoint_save_s
        else:
            unsaved_h = (obs.work_done_h - obs.work_checkpointed_h) / obs.work_rate_gpu_h_per_h
            risk_s = obs.tick_s + unsaved_h * 3600.0
        p_fault = -math.expm1(-n * cfg.fault_rate_per_node_h * run_s / 3600.0)
        # A gang keeps a fault reserve (a node fault, no notice, loses up to one checkpoint
        # interval plus a restart) while a fault before the end is likely enough.
        reserve = cfg.fault_reserve_s is None and n > 1 and p_fault >= cfg.fault_reserve_min_p
        slack = DeadlineSlack(obs.time_left_s, run_s, c, obs.checkpoint_save_s, risk_s, reserve,
                              cfg.fault_room_share)
        choice = None
        if n > 1 or cfg.fault_checkpoint_interval:
            # The interval comes from the one chooser; the saves it implies and (for gangs) the
            # reserve it sizes are counted with it, the interval that will be in force (asking
            # for one interval while reckoning slack with another made a launch pass the net
            # and the next tick's saves push it under: the launch-then-on-demand flip of issue 9).
            choice = choose_checkpoint_interval(self._interval_facts(obs, own_s, slack))
        interval_s = own_s if choice is None else choice.interval_s
        # A single node's chosen interval is its own from here (on-demand and waiting use it);
        # a gang's shorter one is asked for on spot only (`_with_interval`).
        base_s = interval_s if n == 1 else own_s
        fault_s = interval_s + c if reserve else (cfg.fault_reserve_s or 0.0)
        slack_s = slack.slack_with_s(interval_s)
        holding = obs.zone is not None and obs.spot_nodes + obs.on_demand_nodes == n
        mode = IDLE
        if holding:
            mode = SPOT if obs.spot_nodes > 0 else ON_DEMAND
        paid_s = c - obs.changeover_left_s if mode == ON_DEMAND else 0.0
        net_s = risk_s + fault_s
        return _Situation(slack_s, net_s, slack_s + paid_s - net_s, mode, holding,
                          interval_s if interval_s < base_s else None, base_s, choice)

    def _interval_facts(self, obs: AllocationObservation, own_s: float,
                        slack: DeadlineSlack) -> IntervalFacts:
        """What this policy knows for the chooser: the save and notice of the rules, the fault
        log's rate, the job's own interval, the deadline's slack. It does not estimate the
        reclaim rate (None): where a reclaim loses work, the job's own interval stands."""
        cfg, n = self.config, obs.node_count
        faults_s = self._fault_mtbf_by_n.get(n)
        if faults_s is None:
            faults_s = self._fault_mtbf_by_n[n] = fault_mtbf_s(cfg.fault_rate_per_node_h, n)
        return IntervalFacts(
            checkpoint_cost_s=obs.checkpoint_save_s, reclaim_mtbf_s=None, fault_mtbf_s=faults_s,
            notice_s=obs.notice_s, save_fits_notice=obs.checkpoint_save_s <= obs.notice_s,
            min_interval_s=cfg.min_checkpoint_interval_s, own_interval_s=own_s, node_count=n,
            slack=slack)

    def _solve(self, obs: AllocationObservation, sit: _Situation, zone: str, zones: int,
               hop_probability: float, spot_usd_per_h: float, od_usd_per_h: float) -> SlackPlan:
        """The slack plan of this job (solved on its first decision, kept while it runs)."""
        key = (obs.deadline_s, obs.work_total_h, obs.work_rate_gpu_h_per_h, obs.changeover_s,
               obs.tick_s, obs.zones, obs.node_count, spot_usd_per_h, od_usd_per_h,
               self._model_generation)
        if self._plan is None or key != self._plan_key or obs.time_s == 0.0:
            # Long windows get a coarser grid, so a plan stays a few MB and well under a second.
            ticks = max(1, round(self.config.plan_step_s / obs.tick_s),
                        math.ceil(obs.time_left_s / (MAX_PLAN_STEPS * obs.tick_s)))
            dt = ticks * obs.tick_s
            max_slack = max(sit.slack_s, 0.0) + obs.changeover_s + dt
            inputs = PlanInputs(
                dt_s=dt, steps=max(1, math.ceil(obs.time_left_s / dt)), max_slack_s=max_slack,
                changeover_s=obs.changeover_s, save_s=obs.checkpoint_save_s,
                spot_usd_per_h=spot_usd_per_h, on_demand_usd_per_h=od_usd_per_h,
                slack_unit_s=max(self.config.plan_slack_unit_s, max_slack / MAX_PLAN_SLACK_LEVELS),
                hop_probability=hop_probability, zones=zones,
                fine_age_until_s=self.config.plan_fine_age_until_s)
            self._plan = solve_plan(self.model, zone, obs.node_count, inputs)
            self._plan_key = key
        return self._plan

    def _decide(self, obs: AllocationObservation) -> AllocationAction:
        n = obs.node_count
        last_s = self._tracker.last_time_s
        if self._base_interval is None or last_s is None or obs.time_s < last_s:
            # A new job (or a rerun).
            self._base_interval = obs.checkpoint_interval_s
        self._tracker.update(obs, self._levels(n),
                             self._prior_model if self._observed is not None else self.model)
        if self._observed is not None:
            self._update_online()
        sit = self._situation(obs)
        return self._with_interval(obs, sit, self._decide_in(obs, sit))

    def _decide_in(self, obs: AllocationObservation, sit: _Situation) -> AllocationAction:
        n = obs.node_count
        run_s = obs.remaining_run_s
        numbers = {"slack_s": sit.slack_s, "net_s": sit.net_s, "time_left_s": obs.time_left_s,
                   "remaining_run_s": run_s}
        if run_s <= 0:
            return _keep(obs, "work done: keep", numbers)
        if sit.mode == SPOT and sit.slack_s < sit.net_s:
            return self._on_demand(obs, sit, "safety net: slack at the net, on-demand to the end",
                                   numbers)
        if self.config.use_plan and len(obs.zones) == 1 and n == 1:
            return self._follow_plan(obs, sit, numbers)
        return self._score_and_plan(obs, sit, numbers)

    def _with_interval(self, obs: AllocationObservation, sit: _Situation,
                       action: AllocationAction) -> AllocationAction:
        """Spot gangs with thin slack checkpoint more often; on-demand and waiting go back to
        the job's own interval (more saves there buy no safety from preemptions and bill
        every node: the on-demand peer does not pay them either)."""
        if action.checkpoint_interval_s is not None:
            return action
        if action.spot_nodes > 0 and sit.checkpoint_interval_s is not None:
            want_s = sit.checkpoint_interval_s
            why = f"checkpoint every {want_s / 60:.0f} min so a node fault fits the thin slack"
        else:
            want_s = sit.base_interval_s
            why = f"back to the job's checkpoint interval ({want_s / 60:.0f} min)"
            if sit.choice is not None and want_s > self._base_interval_s(obs):
                why = f"checkpoint every {want_s / 3600:.1f} h: {sit.choice.reason}"
        if want_s == obs.checkpoint_interval_s:
            return action
        action.numbers["checkpoint_interval_s"] = want_s
        return dataclasses.replace(action, checkpoint_interval_s=want_s,
                                   reason=f"{action.reason}; {why}")

    # Single zone, single node: the plan decides -------------------------------------------------

    def _follow_plan(self, obs: AllocationObservation, sit: _Situation,
                     numbers: dict[str, float]) -> AllocationAction:
        n, zone, c = obs.node_count, obs.zones[0], obs.changeover_s
        plan = self._solve(obs, sit, zone, 1, 0.0,
                           n * obs.spot_price_usd_per_hour_by_zone[0],
                           n * obs.on_demand_price_usd_per_hour_by_zone[0])
        up = obs.spot_available_by_zone[0] >= n
        age = self._tracker.age_s(zone, n, obs.time_s)
        if sit.mode == SPOT:
            age = max(age, obs.since_launch_s)
        # The plan's slack counts no changeover: add back the one `slack_s` reserves.
        action, value = plan.decide(obs.time_left_s, sit.slack_s + c, sit.mode, up, age)
        numbers.update(plan_usd_to_end=value, run_age_s=age, spot_up=float(up),
                       p_preempt_1h=self.model.p_preempt_within(zone, age, 3600.0,
                                                                obs.trace_time_s, n) if up
                       else math.nan)
        state = (f"spot {'up' if up else 'down'} for {age / 60:.0f} min, slack "
                 f"{sit.slack_s / 3600:.2f} h, {value:.2f} USD expected to the end")
        if action == SPOT and up and (sit.mode == SPOT or sit.slack_s - c >= sit.net_s):
            verb = "keep spot" if sit.mode == SPOT else "take spot"
            return AllocationAction(zone, n, 0, None, f"plan: {verb} ({state})", numbers)
        if action == IDLE and sit.slack_s >= sit.net_s and not self._keep_through_outage(obs, sit):
            verb = "wait for spot" if sit.mode == IDLE else "release and wait for spot"
            return AllocationAction.release(f"plan: {verb} ({state})", numbers)
        why = "plan" if action == ON_DEMAND else (
            f"safety net overrides the plan's {ACTION_NAMES[action]}")
        if action == IDLE and self._keep_through_outage(obs, sit) and sit.slack_s >= sit.net_s:
            why = ("spot down: on-demand kept through the outage rather than released to wait "
                   "(coming back would cost a changeover)")
        if sit.mode == SPOT and action == ON_DEMAND and up:
            why = "plan: leave spot before a likely preemption"
        verb = "keep on-demand" if sit.mode == ON_DEMAND else "on-demand"
        return self._on_demand(obs, sit, f"{why}: {verb} ({state})", numbers)

    # Several zones or a gang: score node sets, slack priced by the plan -------------------------

    def _score_and_plan(self, obs: AllocationObservation, sit: _Situation,
                        numbers: dict[str, float]) -> AllocationAction:
        cfg, n, c = self.config, obs.node_count, obs.changeover_s
        zones = obs.zones
        od_prices = obs.on_demand_price_usd_per_hour_by_zone
        spot_prices = obs.spot_price_usd_per_hour_by_zone
        shares = [self.model.availability_share(z, n) for z in zones]
        mean_share = sum(shares) / len(shares)
        hop = 1.0 - (1.0 - mean_share) ** (len(zones) - 1)
        run_left_s = obs.remaining_run_s
        # Spot node sets available now: (zone, level, run age, held).
        raw: list[tuple[str, int, float, bool]] = []
        for z, zone in enumerate(zones):
            for level in self._levels(n):
                if obs.spot_available_by_zone[z] < level:
                    continue
                held = sit.holding and obs.zone == zone and obs.spot_nodes == level
                age = self._tracker.age_s(zone, level, obs.time_s)
                if held:
                    age = max(age, obs.since_launch_s)
                raw.append((zone, level, age, held))
        slack_usd_per_h, hold_needed_s = self._slack_price(
            obs, sit, hop, n * min(spot_prices), n * min(od_prices))
        plan_action = None
        if cfg.composite_plan:
            plan_zone = zones[0] if len(zones) == 1 else POOLED_ZONE
            if not self.model.has_curve(plan_zone, n):
                plan_zone = zones[0]
            plan = self._solve(obs, sit, plan_zone, len(zones), hop, n * min(spot_prices),
                               n * min(od_prices))
            up = bool(raw)
            age = max((self.model.expected_run_s(z, a, run_left_s, obs.trace_time_s, lv), a)
                      for z, lv, a, _ in raw)[1] if raw else 0.0
            plan_action, value = plan.decide(obs.time_left_s, sit.slack_s + c, sit.mode, up, age)
            slack_usd_per_h = plan.slack_value_usd_per_h(obs.time_left_s, sit.slack_s + c,
                                                         sit.mode, up, age, c)
            numbers["plan_usd_to_end"] = value
        numbers.update(slack_usd_per_h=slack_usd_per_h, hold_needed_s=hold_needed_s,
                       hop_probability=hop)
        relaunch = n * min(od_prices)
        candidates = [
            self._score(obs, zone, level, level * spot_prices[zones.index(zone)]
                        + (n - level) * od_prices[zones.index(zone)],
                        obs.changeover_left_s if held else c, age_s, held, relaunch,
                        slack_usd_per_h)
            for zone, level, age_s, held in raw
        ]
        od = self._od_candidate(obs, sit, slack_usd_per_h)
        numbers["on_demand_usd_per_h"] = od.score_usd_per_h
        may_launch_spot = sit.slack_s - c >= sit.net_s
        options = [k for k in candidates if k.held or may_launch_spot]
        held = next((k for k in options if k.held), None)
        if od.held:
            held = od
        best = min(options + [od], key=lambda k: k.score_usd_per_h)
        if held is not None and best is not held and (
                best.score_usd_per_h > held.score_usd_per_h * (1.0 - cfg.switch_margin)):
            best = held  # hysteresis: a change must pay for itself by a margin
        try_note = ""
        held_spot = held if held is not None and held.spot > 0 else None
        if held_spot is not None and best.spot == 0:
            # Leaving a spot set for on-demand, with no preemption: only when riding on is
            # expected to cost more than on-demand from here (the launch test, from the other
            # side), so a launch is not undone a tick later by a shift in the slack price.
            stay_usd, od_now_usd = self._try_spot_usd(obs, sit, held_spot, od, hop)
            numbers.update(stay_spot_usd=stay_usd, on_demand_now_usd=od_now_usd)
            if stay_usd < od_now_usd:
                best = held_spot
                try_note = (f"; riding on is {stay_usd:.2f} USD expected vs {od_now_usd:.2f} "
                            "on-demand now")
        if best.spot > 0 and not best.held:
            # Thin slack, short jobs: launching spot must pay for its own changeovers (in, and
            # back to on-demand when it ends) and its saves, against on-demand now.
            try_usd, od_now_usd = self._try_spot_usd(obs, sit, best, od, hop)
            numbers.update(try_spot_usd=try_usd, on_demand_now_usd=od_now_usd)
            if try_usd >= od_now_usd * (1.0 - cfg.try_margin):
                try_note = (f"; trying spot costs {try_usd:.2f} USD expected (changeover in, "
                            f"on-demand after it ends) vs {od_now_usd:.2f} on-demand now")
                best = od
        numbers.update(best_usd_per_h=best.score_usd_per_h, best_p_preempt=best.p_end,
                       best_expected_hold_s=best.expected_hold_s)

        # (b) Leave spot before a likely preemption when the slack is thin.
        if sit.mode == SPOT and best.held and best.spot > 0:
            p_soon = self.model.p_preempt_within(best.zone, best.age_s,
                                                 cfg.leave_horizon_ticks * obs.tick_s,
                                                 obs.trace_time_s, best.spot)
            numbers["p_preempt_soon"] = p_soon
            if (sit.slack_s - sit.net_s < cfg.thin_slack_ticks * obs.tick_s
                    and p_soon >= cfg.leave_p_preempt):
                return self._on_demand(obs, sit, (
                    f"slack thin and P(preempt within {cfg.leave_horizon_ticks:g} ticks)="
                    f"{p_soon:.2f}: leave spot for on-demand"), numbers)

        plan_text = f"slack {sit.slack_s / 3600:.2f} h worth {slack_usd_per_h:.2f} USD/h{try_note}"
        if plan_action is None:
            plan_text += f": rides must last {hold_needed_s / 3600:.2f} h"
        if plan_action is not None:
            if plan_action == IDLE and sit.slack_s >= sit.net_s + obs.tick_s and not (
                    best.spot and best.held) and not self._keep_through_outage(obs, sit):
                verb = "wait for spot" if not sit.holding else "release and wait for spot"
                return AllocationAction.release(f"{verb}: the plan waits; {plan_text}", numbers)
            if plan_action == ON_DEMAND and not (best.spot and best.held):
                best = od
            if plan_action == IDLE and self._keep_through_outage(obs, sit):
                plan_text += ("; spot down in every zone (for this set): on-demand kept "
                              "through the outage "
                              "rather than released to wait (coming back costs a changeover)")
        elif best.spot == 0 and not od.held and sit.slack_s >= sit.net_s + obs.tick_s:
            wait, gap_s = self._wait_pays(obs, slack_usd_per_h, n * min(od_prices), run_left_s)
            numbers["expected_wait_s"] = gap_s
            if wait:
                verb = "wait for spot" if not sit.holding else "release and wait for spot"
                return AllocationAction.release(
                    f"{verb}: spot expected back in {gap_s / 3600:.2f} h; {plan_text}", numbers)
        if best.spot == 0:
            if not may_launch_spot and not od.held:
                return self._on_demand(obs, sit, "safety net: on-demand to the end", numbers)
            verb = "keep on-demand" if od.held else "on-demand"
            return self._on_demand(obs, sit, (
                f"{verb}: {od.score_usd_per_h:.2f} USD per hour of progress beats every spot "
                f"set; {plan_text}"), numbers)
        verb = "keep" if best.held else ("move to" if sit.holding else "launch")
        return AllocationAction(best.zone, best.spot, n - best.spot, None, (
            f"{verb} {best.spot} spot + {n - best.spot} on-demand in {best.zone}: run age "
            f"{best.age_s / 60:.0f} min, P(preempt before done)={best.p_end:.2f}, "
            f"{best.score_usd_per_h:.2f} USD per hour of progress vs on-demand "
            f"{od.score_usd_per_h:.2f}; {plan_text}"), numbers)

    def _keep_through_outage(self, obs: AllocationObservation, sit: _Situation) -> bool:
        """Hold a running on-demand set while no zone has spot (`release_on_demand_in_outage`);
        with `outage_by_gang_level`, while no zone has free nodes for the smallest spot set
        tried."""
        if self.config.release_on_demand_in_outage or sit.mode != ON_DEMAND:
            return False
        level = self._levels(obs.node_count)[-1] if self.config.outage_by_gang_level else 1
        return not any(free >= level for free in obs.spot_available_by_zone)

    def _try_spot_usd(self, obs: AllocationObservation, sit: _Situation, spot: _Candidate,
                      od: _Candidate, hop: float) -> tuple[float, float]:
        """(expected USD to finish when launching `spot` now and finishing on on-demand once
        its run ends, USD to finish on on-demand from now). The spot set is billed for its
        expected hold (changeover and saves at its interval included); after a preemption the
        gang pays a changeover and the work left: on spot in another zone with the `hop`
        probability, else on on-demand. Later rides in the same zone are not counted: with thin
        slack there is no room for them, so this errs toward on-demand."""
        run_s, save_s = obs.remaining_run_s, obs.checkpoint_save_s
        spot_interval_s = sit.checkpoint_interval_s or sit.base_interval_s
        spot_len_s = spot.launch_s + run_s + math.floor(run_s / spot_interval_s) * save_s
        hold_s = self.model.expected_run_s(spot.zone, spot.age_s, spot_len_s,
                                           obs.trace_time_s, spot.spot)
        p_end = 1.0 - self.model.survival(spot.zone, spot.age_s, spot_len_s,
                                          obs.trace_time_s, spot.spot)
        od_usd_per_h = od.price_usd_per_h
        after_usd_per_h = hop * spot.price_usd_per_h + (1.0 - hop) * od_usd_per_h
        try_usd = (spot.price_usd_per_h * hold_s + after_usd_per_h * (
            p_end * (obs.changeover_s + save_s) + max(0.0, spot_len_s - hold_s))) / 3600.0
        od_len_s = od.launch_s + run_s + math.floor(run_s / sit.base_interval_s) * save_s
        return try_usd, od_usd_per_h * od_len_s / 3600.0

    def _slack_price(self, obs: AllocationObservation, sit: _Situation, hop: float,
                     spot_usd_per_h: float, od_usd_per_h: float) -> tuple[float, float]:
        """(USD per hour of slack, the hold a ride must average): each ride costs one changeover
        of slack (a hop) or two (on-demand in between); for the slack left above the net to last
        the rest of the window, rides must average `hold` = slack per ride x time left / slack.
        The price makes a ride of exactly that hold break even against on-demand."""
        per_ride_s = obs.changeover_s * (2.0 - hop)
        budget_s = max(sit.budget_s, 1.0)
        hold_s = per_ride_s * obs.time_left_s / budget_s
        saving = (od_usd_per_h - spot_usd_per_h) * hold_s - od_usd_per_h * per_ride_s
        return max(0.0, saving / per_ride_s), hold_s

    def _wait_pays(self, obs: AllocationObservation, slack_usd_per_h: float,
                   od_usd_per_h: float, horizon_s: float) -> tuple[bool, float]:
        """Waiting idle vs on-demand while no spot is worth riding: waiting eats the expected
        gap of slack; on-demand eats one more changeover and bills the gap. (wait?, gap_s)."""
        level = self._levels(obs.node_count)[-1]  # the smallest spot share tried
        if any(a >= level for a in obs.spot_available_by_zone):
            return False, 0.0  # spot is there but not worth riding: waiting would not change it
        gap_s = min(
            self.model.expected_run_s(z, self._tracker.age_s(z, level, obs.time_s), horizon_s,
                                      obs.trace_time_s, level, DOWN)
            for z in obs.zones)
        c = obs.changeover_s
        spot_usd_per_h = obs.node_count * min(obs.spot_price_usd_per_hour_by_zone)
        # On-demand: a changeover of slack and of billing, and the gap's work done at the
        # on-demand premium instead of on spot later.
        wait_usd = slack_usd_per_h * gap_s
        od_usd = (slack_usd_per_h + od_usd_per_h) * c + (od_usd_per_h - spot_usd_per_h) * gap_s
        return wait_usd <= od_usd, gap_s

    def _score(self, obs: AllocationObservation, zone: str, level: int, price: float,
               launch_s: float, age_s: float, held: bool, relaunch_usd_per_h: float,
               slack_usd_per_h: float) -> _Candidate:
        """Expected cost per hour of progress of holding (zone, level spot) until preempted or
        done: price x expected hold, the restart after a preemption (a changeover on on-demand),
        and the slack its changeovers eat (priced by the plan), over the expected progress."""
        horizon = obs.remaining_run_s + launch_s
        hold_s = self.model.expected_run_s(zone, age_s, horizon, obs.trace_time_s, level)
        p_end = 1.0 - self.model.survival(zone, age_s, horizon, obs.trace_time_s, level)
        progress_s = hold_s - launch_s - p_end * obs.checkpoint_save_s
        slack_used_s = launch_s + p_end * obs.changeover_s
        cost = (price * hold_s + p_end * obs.changeover_s * relaunch_usd_per_h
                + slack_usd_per_h * slack_used_s) / 3600.0
        score = cost * 3600.0 / progress_s if progress_s > 1.0 else math.inf
        return _Candidate(zone, level, price, launch_s, age_s, score, hold_s, p_end, held)

    def _od_candidate(self, obs: AllocationObservation, sit: _Situation,
                      slack_usd_per_h: float) -> _Candidate:
        n = obs.node_count
        od_prices = obs.on_demand_price_usd_per_hour_by_zone
        if sit.mode == ON_DEMAND:
            zone, launch = obs.zone, obs.changeover_left_s
        else:
            zone = min(obs.zones, key=lambda z: (od_prices[obs.zones.index(z)],
                                                 z != obs.zone, z != obs.home_zone))
            launch = obs.changeover_s
        price = od_prices[obs.zones.index(zone)] * n
        hold = obs.remaining_run_s + launch
        cost = price * hold + slack_usd_per_h * launch
        return _Candidate(zone, 0, price, launch, 0.0, cost / max(hold - launch, 1.0), hold,
                          0.0, sit.mode == ON_DEMAND)

    def _on_demand(self, obs: AllocationObservation, sit: _Situation, reason: str,
                   numbers: dict[str, float]) -> AllocationAction:
        if sit.mode == ON_DEMAND:
            return AllocationAction(obs.zone, 0, obs.node_count, None, reason, numbers)
        od = self._od_candidate(obs, sit, 0.0)
        return AllocationAction(od.zone, 0, obs.node_count, None, reason, numbers)


def _keep(obs: AllocationObservation, reason: str, numbers: dict[str, float]) -> AllocationAction:
    return AllocationAction(obs.zone, obs.spot_nodes, obs.on_demand_nodes, None, reason, numbers)
