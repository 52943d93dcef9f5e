"""An exact plan for one node over two zones: backward induction over (time left, slack, holding,
and BOTH zones' spot state and run age), with the day's hazard factors step by step. A yardstick
for issue 9's multi-zone goal (<= 1.02x the multi-zone hindsight optimum), not a policy of the
product.

Why: trainwise_heuristic decides single-zone jobs with an exact plan (`controllers/
allocation_planner.py`), but several zones with a score and a composite plan (all zones pooled
into one process). In a world where its risk model is true (`benchmarks/cost/bound.py`) its
single-zone cost / oracle is close to the best any online policy can reach; its multi-zone cost
is not known to be. For two independent zones the exact plan is small enough to solve (two
zones of 2 x 8 age states each: 256 joint states, four holdings, ~100 slack levels, ~470
steps: under a second), so the multi-zone floor can be measured instead of guessed.

Model (as the single-zone plan, `allocation_planner`): per zone, an up/down run with an age bin
that ends with the curve's hazard (times the hour-of-day factor of the step, the model's own
clock) and otherwise ages (phase-type); the two zones move independently (the model has no
cross-zone term, and `cloud/synthetic_market.py` samples them that way). Holdings: idle,
on-demand, spot in zone 1, spot in zone 2. A launch costs a changeover of slack, billed; leaving
a set bills one checkpoint save on it; a preempted spot set saves in its notice and leaves the
job idle; idle costs a step of slack; on-demand is billed at the cheapest zone's price. Negative
slack misses the deadline: finishing on on-demand plus the planner's penalty.

`TwoZonePlanPolicy` is trainwise_heuristic with its multi-zone decision replaced by this plan on
single-node, two-zone markets (its safety net, checkpoint interval and bad-input fallback kept).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from controllers import allocation_planner as one_zone
from controllers.allocation_heuristic import (
    MAX_PLAN_SLACK_LEVELS,
    MAX_PLAN_STEPS,
    TrainwiseAllocationPolicy,
)
from controllers.allocation_planner import (
    PlanInputs,
    _plan_age_edges,
    _Shift,
    _transitions,
    miss_penalty_usd,
)
from controllers.allocation_types import AllocationAction, AllocationObservation
from controllers.preemption_risk import DAY_S, DOWN, UP, HazardCurve, PreemptionRiskModel

IDLE, ON_DEMAND, SPOT_1, SPOT_2 = 0, 1, 2, 3
ACTION_NAMES = ("idle", "on_demand", "spot_zone_1", "spot_zone_2")
_INFEASIBLE_USD = 1e18


def _joint_expectation(p1: np.ndarray, p2: np.ndarray, values: np.ndarray) -> np.ndarray:
    """E[values](a1, a2, s) = sum over b1, b2 of p1[a1, b1] p2[a2, b2] values[b1, b2, s]."""
    b1, b2, n = values.shape
    first = (p1 @ values.reshape(b1, b2 * n)).reshape(p1.shape[0], b2, n)
    return np.einsum("kl,ils->iks", p2, first)


@dataclass
class TwoZonePlan:
    """Decision table: decisions[k, holding, a1, a2, slack] (k steps left)."""

    inputs: PlanInputs
    age_edges_s: tuple[tuple[float, ...], tuple[float, ...]]
    decisions: np.ndarray
    # Values at the last solved step only (the plan's expected USD to the end from now).
    first_values: np.ndarray

    def _state(self, up: tuple[bool, bool], ages_s: tuple[float, float]) -> tuple[int, int]:
        out = []
        for z in range(2):
            edges = self.age_edges_s[z]
            b = max(0, min(len(edges) - 1, int(np.searchsorted(edges, ages_s[z], "right")) - 1))
            out.append(b if up[z] else len(edges) + b)
        return out[0], out[1]

    def _slack(self, slack_s: float) -> int:
        return int(min(max(math.floor(slack_s / self.inputs.slack_unit_s), 0),
                       self.decisions.shape[-1] - 1))

    def decide(self, time_left_s: float, slack_s: float, holding: int,
               up: tuple[bool, bool], ages_s: tuple[float, float]) -> int:
        k = int(min(max(round(time_left_s / self.inputs.dt_s), 0), self.decisions.shape[0] - 1))
        a1, a2 = self._state(up, ages_s)
        return int(self.decisions[k, holding, a1, a2, self._slack(slack_s)])

    def value_now(self, slack_s: float, holding: int, up: tuple[bool, bool],
                  ages_s: tuple[float, float]) -> float:
        """Expected USD to the end at the plan's first step."""
        a1, a2 = self._state(up, ages_s)
        return float(self.first_values[holding, a1, a2, self._slack(slack_s)])


def _at_hour(model: PreemptionRiskModel, zones: tuple[str, str], phase_s: float
             ) -> PreemptionRiskModel:
    """The zones' single-node curves with the hour-of-day factor of `phase_s` (seconds into the
    model's day) as their only factor."""
    curves = {}
    for zone in zones:
        for state in (UP, DOWN):
            curve = model.curve(zone, 1, state)
            k = min(int(phase_s // (DAY_S / curve.hour_bins)), curve.hour_bins - 1)
            curves[(state, zone, 1)] = HazardCurve(curve.age_edges_s, curve.rate_per_h,
                                                   (curve.hour_factor[k],))
    return PreemptionRiskModel(curves, model.utc_offset_s)


def solve_two_zone_plan(model: PreemptionRiskModel, zones: tuple[str, str], inputs: PlanInputs,
                        spot_usd_per_h: tuple[float, float], start_trace_s: float | None = None
                        ) -> TwoZonePlan:
    """Backward induction (module docstring). `inputs.on_demand_usd_per_h`: the cheapest zone's
    on-demand price; `spot_usd_per_h`: each zone's spot price. `start_trace_s`: trace time of
    the plan's first step (hazards follow the hour of day step by step); None averages the day."""
    if len(zones) != 2 or len(spot_usd_per_h) != 2:
        raise ValueError(f"a two-zone plan needs exactly two zones and two spot prices, got "
                         f"{zones} and {spot_usd_per_h}")
    if inputs.steps < 1 or not inputs.dt_s > 0:
        raise ValueError(f"a plan needs steps >= 1 and dt_s > 0, got {inputs.steps}, "
                         f"{inputs.dt_s}")
    dt, steps = inputs.dt_s, inputs.steps
    edges = tuple(_plan_age_edges(tuple(model.curve(z, 1, UP).age_edges_s), dt,
                                  inputs.fine_age_until_s) for z in zones)
    up_masks = []
    for e in edges:
        mask = np.zeros(2 * len(e), dtype=bool)
        mask[:len(e)] = True
        up_masks.append(mask)
    by_phase: dict[float | None, tuple] = {}

    def transitions(k: int) -> tuple:
        """Both zones' step matrices for the step taken with k steps left."""
        phase = None
        if start_trace_s is not None:
            mid_s = start_trace_s + (steps - k + 0.5) * dt + model.utc_offset_s
            phase = float(mid_s % DAY_S)
            bin_s = 3600.0  # hour factors come in bins of whole hours or wider
            phase = (phase // bin_s) * bin_s
        if phase not in by_phase:
            # The planner's transitions average the day's factors: given a model whose curves
            # carry only this hour's factor, they are this hour's.
            step_model = model if phase is None else _at_hour(model, zones, phase)
            mats = []
            for z, zone in enumerate(zones):
                p, _ = _transitions(step_model, zone, 1, dt, edges[z])
                mats += [p, p * up_masks[z][None, :], p * (~up_masks[z])[None, :]]
            by_phase[phase] = tuple(mats)
        return by_phase[phase]

    a1_n, a2_n = (2 * len(e) for e in edges)
    unit = inputs.slack_unit_s
    n_slack = int(math.ceil(inputs.max_slack_s / unit)) + 2
    slack = np.arange(n_slack) * unit
    c, save = inputs.changeover_s, inputs.save_s
    od_usd_per_h = inputs.on_demand_usd_per_h
    step_od = od_usd_per_h * dt / 3600.0
    step_spot = [price * dt / 3600.0 for price in spot_usd_per_h]
    release = np.array([0.0, od_usd_per_h, *spot_usd_per_h]) * save / 3600.0
    penalty_usd = miss_penalty_usd(inputs)
    shift_dt, shift_c, shift_save = (_Shift(n_slack, x / unit) for x in (dt, c, save))
    up_1 = np.broadcast_to(up_masks[0][:, None, None], (a1_n, a2_n, 1))
    up_2 = np.broadcast_to(up_masks[1][None, :, None], (a1_n, a2_n, 1))
    # Idle with nothing left to train: start the cheapest set there is.
    first, second = (SPOT_1, SPOT_2) if spot_usd_per_h[0] <= spot_usd_per_h[1] else (SPOT_2,
                                                                                      SPOT_1)
    up_first, up_second = (up_1, up_2) if first == SPOT_1 else (up_2, up_1)
    cheapest = np.where(up_first, first, np.where(up_second, second, ON_DEMAND))
    decisions = np.zeros((steps + 1, 4, a1_n, a2_n, n_slack), dtype=np.int8)
    v = np.zeros((4, a1_n, a2_n, n_slack))
    options = np.empty((4, 4, a1_n, a2_n, n_slack))  # [option, holding, ...]
    for k in range(1, steps + 1):
        p1, p1_up, p1_down, p2, p2_up, p2_down = transitions(k)
        time_left = k * dt
        first_done = int(np.searchsorted(slack, time_left, side="left"))
        miss_usd = penalty_usd + od_usd_per_h * (time_left + c) / 3600.0
        ev_idle = _joint_expectation(p1, p2, v[IDLE])
        ev_od = _joint_expectation(p1, p2, v[ON_DEMAND])
        # Preempted: idle after the notice save, in the joint state the step led to.
        preempted = shift_save(v[IDLE], miss_usd)
        ev_spot_1 = (_joint_expectation(p1_up, p2, v[SPOT_1])
                     + _joint_expectation(p1_down, p2, preempted))
        ev_spot_2 = (_joint_expectation(p1, p2_up, v[SPOT_2])
                     + _joint_expectation(p1, p2_down, preempted))
        launch = (shift_dt(ev_idle, miss_usd),
                  step_od + shift_c(ev_od, miss_usd),
                  np.where(up_1, step_spot[0] + shift_c(ev_spot_1, miss_usd), _INFEASIBLE_USD),
                  np.where(up_2, step_spot[1] + shift_c(ev_spot_2, miss_usd), _INFEASIBLE_USD))
        for option in range(4):
            options[option] = launch[option][None] + release[:, None, None, None]
        options[IDLE, IDLE] = launch[IDLE]
        options[ON_DEMAND, ON_DEMAND] = step_od + ev_od  # keep on-demand
        options[SPOT_1, SPOT_1] = np.where(up_1, step_spot[0] + ev_spot_1, _INFEASIBLE_USD)
        options[SPOT_2, SPOT_2] = np.where(up_2, step_spot[1] + ev_spot_2, _INFEASIBLE_USD)
        best = np.argmin(options, axis=0).astype(np.int8)
        new_v = np.take_along_axis(options, best[None].astype(np.intp), axis=0)[0]
        if first_done < n_slack:
            new_v[..., first_done:] = 0.0
            # Nothing left to train: finish with what is held, else start the cheapest set.
            done_shape = best[IDLE, ..., first_done:].shape
            best[IDLE, ..., first_done:] = np.broadcast_to(cheapest, done_shape)
            best[ON_DEMAND, ..., first_done:] = ON_DEMAND
            best[SPOT_1, ..., first_done:] = np.broadcast_to(
                np.where(up_1, SPOT_1, cheapest), done_shape)
            best[SPOT_2, ..., first_done:] = np.broadcast_to(
                np.where(up_2, SPOT_2, cheapest), done_shape)
        # Spot held in a zone that is down cannot happen (the preemption released it).
        new_v[SPOT_1] = np.where(up_1, new_v[SPOT_1], new_v[IDLE])
        new_v[SPOT_2] = np.where(up_2, new_v[SPOT_2], new_v[IDLE])
        decisions[k] = best
        v = new_v
    return TwoZonePlan(inputs, edges, decisions, v.astype(np.float32))


# Solved plans shared by the windows of one cell (same model curves, job, prices and start
# hour): a benchmark replays many windows with one model, and a solve takes about 2 s. A few
# entries only: each is tens of MB.
_PLAN_CACHE: dict[tuple, tuple[tuple, TwoZonePlan]] = {}
_PLAN_CACHE_ENTRIES = 3


def _cached_plan(model: PreemptionRiskModel, zones: tuple[str, str], inputs: PlanInputs,
                 spot_usd_per_h: tuple[float, float], start_trace_s: float | None
                 ) -> TwoZonePlan:
    curves = tuple(model.curve(z, 1, state) for z in zones for state in (UP, DOWN))
    start_hour = None if start_trace_s is None else math.floor(
        (start_trace_s + model.utc_offset_s) / 3600.0)
    key = (tuple(map(id, curves)), zones, inputs, spot_usd_per_h, start_hour)
    hit = _PLAN_CACHE.get(key)
    if hit is None:
        plan = solve_two_zone_plan(model, zones, inputs, spot_usd_per_h,
                                   None if start_hour is None else start_hour * 3600.0
                                   - model.utc_offset_s)
        while len(_PLAN_CACHE) >= _PLAN_CACHE_ENTRIES:
            _PLAN_CACHE.pop(next(iter(_PLAN_CACHE)))
        # The curves ride along so that their ids in the key stay theirs.
        hit = _PLAN_CACHE[key] = (curves, plan)
    return hit[1]


class TwoZonePlanPolicy(TrainwiseAllocationPolicy):
    """trainwise_heuristic whose decision on a single-node, two-zone market follows the exact
    two-zone plan (solved on the job's first tick); any other market: the heuristic as is."""

    name = "trainwise_two_zone_plan"

    def __init__(self, risk_model: PreemptionRiskModel | None = None, config=None,
                 time_of_day: bool = True) -> None:
        super().__init__(risk_model, config)
        self.time_of_day = time_of_day
        self._two_zone: TwoZonePlan | None = None

    def _two_zone_plan(self, obs: AllocationObservation, slack_s: float) -> TwoZonePlan:
        if self._two_zone is None or obs.time_s == 0.0:
            cfg = self.config
            ticks = max(1, round(cfg.plan_step_s / obs.tick_s),
                        math.ceil(obs.time_left_s / (MAX_PLAN_STEPS * obs.tick_s)))
            dt = ticks * obs.tick_s
            max_slack = max(slack_s, 0.0) + obs.changeover_s + dt
            inputs = PlanInputs(
                dt_s=dt, steps=max(1, math.ceil(obs.time_left_s / dt)), max_slack_s=max_slack,
                changeover_s=obs.changeover_s, save_s=obs.checkpoint_save_s,
                spot_usd_per_h=min(obs.spot_price_usd_per_hour_by_zone),
                on_demand_usd_per_h=min(obs.on_demand_price_usd_per_hour_by_zone),
                slack_unit_s=max(cfg.plan_slack_unit_s, max_slack / MAX_PLAN_SLACK_LEVELS),
                fine_age_until_s=cfg.plan_fine_age_until_s)
            self._two_zone = _cached_plan(
                self.model, (obs.zones[0], obs.zones[1]), inputs,
                (obs.spot_price_usd_per_hour_by_zone[0], obs.spot_price_usd_per_hour_by_zone[1]),
                obs.trace_time_s if self.time_of_day else None)
        return self._two_zone

    def _score_and_plan(self, obs, sit, numbers):
        if not (len(obs.zones) == 2 and obs.node_count == 1):
            return super()._score_and_plan(obs, sit, numbers)
        c = obs.changeover_s
        # The plan's slack counts no changeover: add back the one `slack_s` reserves.
        plan = self._two_zone_plan(obs, sit.slack_s + c)
        holding = IDLE
        if sit.mode == one_zone.ON_DEMAND:
            holding = ON_DEMAND
        elif sit.mode == one_zone.SPOT:
            holding = SPOT_1 if obs.zone == obs.zones[0] else SPOT_2
        up = (obs.spot_available_by_zone[0] >= 1, obs.spot_available_by_zone[1] >= 1)
        ages = [self._tracker.age_s(zone, 1, obs.time_s) for zone in obs.zones]
        if holding in (SPOT_1, SPOT_2):
            ages[holding - SPOT_1] = max(ages[holding - SPOT_1], obs.since_launch_s)
        action = plan.decide(obs.time_left_s, sit.slack_s + c, holding, up, (ages[0], ages[1]))
        why = f"two-zone plan: {ACTION_NAMES[action]}"
        if action in (SPOT_1, SPOT_2):
            z = action - SPOT_1
            if up[z] and (holding == action or sit.slack_s - c >= sit.net_s):
                return AllocationAction(obs.zones[z], 1, 0, None, why, numbers)
        if (action == IDLE and sit.slack_s >= sit.net_s + obs.tick_s
                and not self._keep_through_outage(obs, sit)):
            return AllocationAction.release(why, numbers)
        return self._on_demand(obs, sit, f"{why} (or the safety net): on-demand", numbers)
