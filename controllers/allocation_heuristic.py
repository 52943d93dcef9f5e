"""trainwise's node allocation heuristic: Can't Be Late's safety net, driven by a preemption-risk
model learned from real spot traces.

References: Wu et al., "Can't Be Late: Optimizing Spot Instance Savings under Deadlines",
NSDI'24 (Uniform Progress and its safety net); the hazard model in
`controllers/preemption_risk.py` (piecewise-exponential hazards by zone, run age and time of day).

Why it beats Uniform Progress (on the real traces, `benchmarks/results/cost.md`): Uniform
Progress stays on on-demand while spot is available until it is ahead of its line, and spends its
slack early. Spot runs on AWS are mostly short (median under an hour) but heavy-tailed, and every
change of node set costs a changeover (0.1 h, billed, no progress) plus the slack it eats. So:

1. Slack is a budget for changeovers. Each ride on spot from on-demand costs two changeovers of
   slack (on to spot, back after the preemption). The policy estimates how many rides the rest of
   the window offers (time left / mean availability cycle, from the model) and keeps that much
   slack in reserve; only slack beyond it is spent waiting idle for spot.
2. When the budget cannot fund every ride, it rations rides by age: it joins only runs that have
   already lasted `a*` (the smallest age whose surviving runs the budget can fund). With a
   decreasing hazard, a run that has survived is the one likely to last (a short run would cost
   its changeovers and save little).
3. Every candidate node set (zone, s spot + N - s on-demand) is scored by its expected cost per
   unit of progress over the rest of the job: price x expected holding time, plus the expected
   restart after a preemption (a changeover on on-demand), divided by the expected progress
   (holding time minus the changeover and the notice save). A change must beat keeping the
   current set by `switch_margin` (hysteresis). This picks zones in multi-zone markets (the
   zone whose current run is likely to last) and partial-spot gangs for multi-node jobs.
4. When slack is thin, spot is left before a likely preemption (P(preempt within the next
   ticks) above `leave_p_preempt`) instead of waiting to be preempted at the edge of the net.
5. Safety net (Can't Be Late's, widened like the simulator's peers): any action that could leave
   the job unable to finish on on-demand after one more tick and a preemption is refused; when
   nothing else is safe, on-demand to the end. Gangs (N > 1) also keep a fault reserve (one
   checkpoint interval plus a changeover) because node faults come without notice.

Events (single zone, thin slack): spot (age 3 h) -> preempted -> spot gone: on-demand (slack
kept for rides) -> spot back, age 0: stay on on-demand (rides rationed to runs older than 15 min)
-> age 15 min: switch to spot -> ... -> slack at the net: on-demand to the end.

State: the policy remembers, from the observations it has been given, when each zone's spot
capacity last changed (the age of the current availability run), starting from the model's
`run_at_cutoff` (the history observed before the window). Nothing else. It forgets when the job
clock goes back (a new run), so two runs over the same trace make the same decisions.

Bad input (NaN, infinite or negative numbers, a zero-length window, inconsistent per-zone tuples):
on-demand for the whole gang in the current zone (else the home zone, else the first zone),
with a reason that starts with "fallback:" and names the bad fields. A gang size that is not a
positive int cannot be sized: the fallback is then to release (hold nothing).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from controllers.allocation_types import AllocationAction, AllocationObservation
from controllers.preemption_risk import DOWN, UP, PreemptionRiskModel
from controllers.validation import number_problem

# Uninformed prior when no fitted model is given: memoryless runs, 2 h up, 1 h down.
PRIOR_MEAN_UP_S = 7200.0
PRIOR_MEAN_DOWN_S = 3600.0


@dataclass(frozen=True)
class TrainwiseAllocationConfig:
    # Slack kept per expected future ride, in units of the two changeovers a ride costs.
    ride_reserve_factor: float = 1.0
    # Candidate minimum run ages (s) for joining spot from on-demand, tried smallest first.
    join_ages_s: tuple[float, ...] = (0.0, 600.0, 1200.0, 1800.0, 3600.0, 7200.0, 14400.0)
    # A new node set must cost this share less per unit of progress than keeping the current one.
    switch_margin: float = 0.05
    # Leave spot early when P(preempt within `leave_horizon_ticks`) is above this and the slack
    # above the net is under `thin_slack_ticks` ticks.
    leave_p_preempt: float = 0.5
    leave_horizon_ticks: float = 2.0
    thin_slack_ticks: float = 3.0
    # Slack kept against node faults (no notice); None: one checkpoint interval plus a
    # changeover for gangs (N > 1), 0 for a single node.
    fault_reserve_s: float | None = None
    # Spot shares of the gang tried for partial-spot node sets (N > 1).
    spot_fractions: tuple[float, ...] = (1.0, 0.75, 0.5, 0.25)

    def __post_init__(self) -> None:
        if self.ride_reserve_factor < 0 or self.switch_margin < 0:
            raise ValueError("ride_reserve_factor and switch_margin must be >= 0")
        if not self.join_ages_s or any(a < 0 for a in self.join_ages_s):
            raise ValueError(f"join_ages_s={self.join_ages_s} must be non-empty and >= 0")
        if not 0 < self.leave_p_preempt <= 1:
            raise ValueError(f"leave_p_preempt={self.leave_p_preempt} must be in (0, 1]")
        if any(not 0 < f <= 1 for f in self.spot_fractions):
            raise ValueError(f"spot_fractions={self.spot_fractions} must be in (0, 1]")


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
        number_problem("checkpoint_interval_s", obs.checkpoint_interval_s,
                       strictly_positive=True),
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
    score_usd_per_h: float  # expected cost per hour of progress
    expected_hold_s: float
    p_end: float  # P(preempted before the job is done)
    held: bool


class _RunTracker:
    """When each (zone, spot level) last changed state, from the observations seen so far."""

    def __init__(self) -> None:
        self.last_time_s: float | None = None
        self.runs: dict[tuple[str, int], tuple[bool, float]] = {}

    def update(self, obs: AllocationObservation, levels: tuple[int, ...],
               model: PreemptionRiskModel) -> None:
        now = obs.time_s
        if self.last_time_s is None or now < self.last_time_s:
            self.runs = {}
        first = not self.runs
        for zone, available in zip(obs.zones, obs.spot_available_by_zone):
            for level in levels:
                up = available >= level
                known = self.runs.get((zone, level))
                if known is not None and known[0] == up:
                    continue
                start = now
                if first:
                    # The window's first tick: continue the run seen before the cutoff, if any.
                    state, age = model.run_at_cutoff.get((zone, level), (None, 0.0))
                    if state == (UP if up else DOWN):
                        start = now - age
                self.runs[(zone, level)] = (up, start)
        self.last_time_s = now

    def age_s(self, zone: str, level: int, now_s: float) -> float:
        known = self.runs.get((zone, level))
        return max(0.0, now_s - known[1]) if known is not None else 0.0


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
        self._tracker = _RunTracker()
        self._rides_per_h: dict[tuple[tuple[str, ...], int], float] = {}

    # Model summaries ----------------------------------------------------------------------------

    def _levels(self, n: int) -> tuple[int, ...]:
        levels = {n} | {max(1, min(n, round(n * f))) for f in self.config.spot_fractions}
        return tuple(sorted(levels, reverse=True))

    def _ride_rate_per_h(self, zones: tuple[str, ...], level: int) -> float:
        """Expected spot runs per hour the job could ride: P(some zone up) / longest mean run."""
        key = (zones, level)
        if key not in self._rides_per_h:
            none_up, longest_s = 1.0, 0.0
            for zone in zones:
                none_up *= 1.0 - self.model.availability_share(zone, level)
                longest_s = max(longest_s, self.model.mean_run_s(zone, level, UP))
            self._rides_per_h[key] = (1.0 - none_up) * 3600.0 / max(longest_s, 1.0)
        return self._rides_per_h[key]

    # The decision -------------------------------------------------------------------------------

    def act(self, observation: AllocationObservation) -> AllocationAction:
        problems = bad_allocation_fields(observation)
        if problems or not isinstance(observation.node_count, int) or observation.node_count < 1:
            return _fallback(observation, problems or [f"node_count={observation.node_count!r}"])
        return self._decide(observation)

    def _decide(self, obs: AllocationObservation) -> AllocationAction:
        cfg = self.config
        n = obs.node_count
        levels = self._levels(n)
        self._tracker.update(obs, levels, self.model)
        now, tick, c = obs.time_s, obs.tick_s, obs.changeover_s
        save = obs.checkpoint_save_s
        run_s = obs.remaining_run_s
        if run_s <= 0:
            return self._keep(obs, "work done: keep", {})
        saves_s = math.floor(run_s / obs.checkpoint_interval_s) * save
        # Slack if on-demand had to be (re)launched now and run to the end.
        slack_s = obs.time_left_s - (c + run_s + saves_s)
        if save <= obs.notice_s:
            risk_s = tick + save
        else:
            unsaved_s = (obs.work_done_h - obs.work_checkpointed_h) / obs.work_rate_gpu_h_per_h
            risk_s = tick + unsaved_s * 3600.0
        fault_s = cfg.fault_reserve_s
        if fault_s is None:
            fault_s = (obs.checkpoint_interval_s + c) if n > 1 else 0.0
        floor_s = risk_s + fault_s
        held_spot, held_od = obs.spot_nodes, obs.on_demand_nodes
        holding = obs.zone is not None and held_spot + held_od == n
        numbers = {"slack_s": slack_s, "net_s": floor_s, "time_left_s": obs.time_left_s,
                   "remaining_run_s": run_s}

        od_prices = obs.on_demand_price_usd_per_hour_by_zone
        cheapest_od = min(od_prices) * n
        # Rationing: how many rides the rest of the window offers, and the youngest run the
        # budget can afford to join from on-demand.
        budget_s = slack_s - floor_s
        rides_per_h = self._ride_rate_per_h(obs.zones, n)
        rides_left = rides_per_h * obs.time_left_s / 3600.0
        # Slack every future ride would take (two changeovers each): only slack beyond it is
        # spent waiting idle.
        all_rides_s = 2 * c * cfg.ride_reserve_factor * rides_left
        join_age_s = cfg.join_ages_s[-1]
        for age in cfg.join_ages_s:
            surviving = min((self.model.survival(z, 0.0, age, obs.trace_time_s, n)
                             for z in obs.zones), default=1.0)
            if all_rides_s * surviving <= budget_s:
                join_age_s = age
                break
        excess_s = budget_s - all_rides_s
        numbers.update(join_age_s=join_age_s, ride_reserve_s=all_rides_s, excess_slack_s=excess_s,
                       rides_left=rides_left)

        # Score every node set we could hold now.
        horizon_base_s = run_s + saves_s
        candidates: list[_Candidate] = []
        for z, zone in enumerate(obs.zones):
            available = obs.spot_available_by_zone[z]
            for level in levels:
                if available < level:
                    continue
                held = holding and obs.zone == zone and held_spot == level
                launch = obs.changeover_left_s if held else c
                age = self._tracker.age_s(zone, level, now)
                if held:
                    age = max(age, obs.since_launch_s)
                price = (level * obs.spot_price_usd_per_hour_by_zone[z]
                         + (n - level) * od_prices[z])
                candidates.append(self._score(obs, zone, level, price, launch, age,
                                              horizon_base_s, cheapest_od, held))
        if holding and held_spot == 0:
            od_zone, od_price = obs.zone, od_prices[obs.zones.index(obs.zone)] * n
            od_launch = obs.changeover_left_s
        else:
            od_zone = min(obs.zones, key=lambda zz: (od_prices[obs.zones.index(zz)],
                                                     zz != obs.home_zone))
            od_price, od_launch = cheapest_od, c
        od_hold = horizon_base_s + od_launch
        od = _Candidate(od_zone, 0, od_price, od_launch, 0.0,
                        od_price * od_hold / max(od_hold - od_launch, 1.0), od_hold, 0.0,
                        holding and held_spot == 0)
        numbers["on_demand_usd_per_h"] = od.score_usd_per_h

        # Safety net: which actions keep the deadline reachable on on-demand.
        may_hold_spot = slack_s >= floor_s
        may_launch_spot = slack_s - c >= floor_s
        may_idle = slack_s >= floor_s
        held_candidate = next((k for k in candidates if k.held), None)
        if holding and held_spot > 0 and held_candidate is None:
            # Held spot level no longer available (the simulator preempts at the boundary).
            held_candidate = None

        if holding and held_spot > 0 and not may_hold_spot:
            return self._on_demand(obs, od, "safety net: slack at the net, on-demand to the end",
                                   numbers)
        if not may_launch_spot and not (holding and held_spot > 0) and not may_idle:
            return self._on_demand(obs, od, "safety net: slack at the net, on-demand to the end",
                                   numbers)

        # (b) Leave spot before a likely preemption when the slack is thin.
        if held_candidate is not None and held_candidate.spot > 0:
            p_soon = self.model.p_preempt_within(
                held_candidate.zone, held_candidate.age_s, cfg.leave_horizon_ticks * tick,
                obs.trace_time_s, held_candidate.spot)
            numbers["p_preempt_soon"] = p_soon
            if budget_s < cfg.thin_slack_ticks * tick and p_soon >= cfg.leave_p_preempt:
                return self._on_demand(
                    obs, od, f"slack thin and P(preempt within {cfg.leave_horizon_ticks:g} "
                    f"ticks)={p_soon:.2f}: leave spot for on-demand", numbers)

        # Spot candidates worth riding: cheaper per unit of progress than on-demand.
        on_od = holding and held_spot == 0
        spot_options = []
        for k in candidates:
            if k.held:
                spot_options.append(k)
                continue
            if not may_launch_spot:
                continue
            if on_od and k.age_s < join_age_s:
                continue  # rationed: too young a run to pay two changeovers of slack
            spot_options.append(k)
        spot_options = [k for k in spot_options if k.score_usd_per_h < od.score_usd_per_h]
        best = min(spot_options, key=lambda k: k.score_usd_per_h, default=None)
        if best is not None:
            numbers.update(best_usd_per_h=best.score_usd_per_h, best_age_s=best.age_s,
                           best_p_preempt=best.p_end, best_expected_hold_s=best.expected_hold_s)
        if held_candidate is not None:
            numbers["keep_usd_per_h"] = held_candidate.score_usd_per_h
            if best is None or best is held_candidate or (
                    best.score_usd_per_h > held_candidate.score_usd_per_h
                    * (1.0 - cfg.switch_margin)):
                return self._keep(obs, (
                    f"keep {held_candidate.spot} spot in {held_candidate.zone}: "
                    f"{held_candidate.score_usd_per_h:.2f} USD/h of progress vs on-demand "
                    f"{od.score_usd_per_h:.2f}"), numbers)
        if best is not None and (not on_od or best.score_usd_per_h
                                 < od.score_usd_per_h * (1.0 - cfg.switch_margin)):
            what = "move to" if holding else "launch"
            return AllocationAction(
                best.zone, best.spot, n - best.spot, None,
                f"{what} {best.spot} spot in {best.zone}: run age {best.age_s / 60:.0f} min, "
                f"P(preempt before done)={best.p_end:.2f}, {best.score_usd_per_h:.2f} USD/h of "
                f"progress vs on-demand {od.score_usd_per_h:.2f}", numbers)

        # No spot worth riding: wait with excess slack, else on-demand.
        if on_od:
            # Releasing then relaunching costs a changeover: only with slack to spare.
            if may_idle and excess_s >= 2 * c + tick:
                return AllocationAction.release(
                    f"no spot worth riding; {excess_s / 3600:.2f} h of slack beyond the ride "
                    "reserve: release on-demand and wait", numbers)
            return self._keep(obs, "no spot worth riding; slack kept for rides: keep on-demand",
                              numbers)
        if may_idle and excess_s >= tick:
            if holding:
                return AllocationAction.release(
                    "spot lost its worth; slack to spare: release and wait", numbers)
            return AllocationAction.release(
                f"no spot worth riding; {excess_s / 3600:.2f} h of slack beyond the ride "
                "reserve: wait", numbers)
        return self._on_demand(obs, od, "no spot worth riding and no slack to wait: on-demand",
                               numbers)

    def _score(self, obs: AllocationObservation, zone: str, level: int, price: float,
               launch_s: float, age_s: float, horizon_base_s: float, relaunch_usd_per_h: float,
               held: bool) -> _Candidate:
        """Expected cost per hour of progress of holding (zone, level spot) until preempted or
        done, including its changeover, the notice save and the restart after a preemption."""
        horizon = horizon_base_s + launch_s
        hold_s = self.model.expected_run_s(zone, age_s, horizon, obs.trace_time_s, level)
        p_end = 1.0 - self.model.survival(zone, age_s, horizon, obs.trace_time_s, level)
        progress_s = hold_s - launch_s - p_end * obs.checkpoint_save_s
        cost = price * hold_s + p_end * obs.changeover_s * relaunch_usd_per_h
        score = cost / progress_s if progress_s > 1.0 else math.inf
        return _Candidate(zone, level, price, launch_s, age_s, score, hold_s, p_end, held)

    @staticmethod
    def _keep(obs: AllocationObservation, reason: str, numbers: dict[str, float]
              ) -> AllocationAction:
        return AllocationAction(obs.zone, obs.spot_nodes, obs.on_demand_nodes, None, reason,
                                numbers)

    @staticmethod
    def _on_demand(obs: AllocationObservation, od: _Candidate, reason: str,
                   numbers: dict[str, float]) -> AllocationAction:
        if od.held:
            return AllocationAction(obs.zone, 0, obs.node_count, None, reason, numbers)
        return AllocationAction(od.zone, 0, obs.node_count, None, reason, numbers)
