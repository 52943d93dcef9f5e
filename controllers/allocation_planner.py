"""Slack planner: backward induction over (time left, slack, holding, spot run state and age) on
the learned semi-Markov spot process, for one zone. The trainwise allocation heuristic reads its
decision table; its explicit safety net still has the last word.

Why a plan: in the Can't Be Late setting the binding resource is slack, and every use of it
competes: waiting idle for spot, the changeover into a spot run, the changeover back to on-demand
after the preemption. Whether a spot run that started 5 minutes ago is worth two changeovers of
slack depends on how much slack is left, how much time, and how runs of that age end
(`controllers/preemption_risk.py`). Backward induction (Bellman 1957; the finite-horizon MDP of
Puterman 1994, ch. 4) prices all of that at once; the model is fitted before the window, so the
plan knows the market's statistics, never its future.

Model (a step is `dt_s`, a multiple of the trace tick):
- Availability: up or down, each with an age bin; per step a run of bin i ends with probability
  1 - exp(-rate_i dt) and otherwise moves to the next bin with probability dt / width_i (a
  phase-type approximation of aging; the open last bin never moves). Time of day is averaged out.
- Holding: idle, on-demand, or spot (only while up). Idle costs a step of slack; a launch costs a
  changeover of slack (`changeover_s`), billed like a step; a spot run that ends costs the notice
  save and leaves the job idle; leaving a node set bills one checkpoint save on it.
- Slack = time left - (remaining training + its periodic saves): the state's second axis, on a
  grid of `slack_unit_s`, interpolated linearly. Negative slack misses the deadline: a penalty
  plus finishing on on-demand, as the simulator charges.
- Value = expected USD to the end; the table stores the cheapest action per state.
"""

from __future__ import annotations

import bisect
import math
from dataclasses import dataclass

import numpy as np

from controllers.preemption_risk import DOWN, UP, PreemptionRiskModel

IDLE, ON_DEMAND, SPOT = 0, 1, 2
ACTION_NAMES = ("idle", "on_demand", "spot")
# Dollars added to a missed deadline on top of finishing on on-demand, so that no saving buys it
# back: at least MISS_PENALTY_USD and at least this many on-demand bills of the plan's horizon.
# Why the bill: a fixed sum is a unit, not a constraint. A 16-node p4d.24xlarge gang bills about
# 27,000 USD in a 52 h window on on-demand, so its spot savings alone outweigh 1e4 USD and the plan
# would trade the deadline for them; prices scaled x300 changed a tight 4-node plan's moves. No
# saving exceeds the on-demand bill, so ten of them put the deadline out of any saving's reach.
MISS_PENALTY_USD = 1e4
MISS_PENALTY_ON_DEMAND_BILLS = 10.0


@dataclass(frozen=True)
class PlanInputs:
    """The job and market numbers a plan is solved for (one zone, one gang size)."""

    dt_s: float
    steps: int  # steps of dt_s from now to the deadline
    max_slack_s: float
    changeover_s: float
    save_s: float
    spot_usd_per_h: float  # the whole gang
    on_demand_usd_per_h: float  # the whole gang
    slack_unit_s: float = 60.0
    # Several zones as one composite process: when the ridden zone is preempted another zone has
    # spot with this probability (the job can hop at the cost of a changeover), and a spell with
    # no zone up ends when any of `zones` zones comes back (independent zones).
    hop_probability: float = 0.0
    zones: int = 1
    # Age bins narrower than a step up to this age, so that runs age one bin per step (the
    # phase-type aging of wide bins lets some young runs jump to old, safe bins too soon).
    fine_age_until_s: float = 0.0


def miss_penalty_usd(inputs: PlanInputs) -> float:
    """The penalty of a missed deadline for this plan (see MISS_PENALTY_ON_DEMAND_BILLS)."""
    horizon_h = inputs.steps * inputs.dt_s / 3600.0
    return max(MISS_PENALTY_USD,
               MISS_PENALTY_ON_DEMAND_BILLS * inputs.on_demand_usd_per_h * horizon_h)


class SlackPlan:
    """Decision table of a solved plan: `decide(...)` gives the cheapest action and its values."""

    def __init__(self, inputs: PlanInputs, age_edges_s: tuple[float, ...],
                 decisions: np.ndarray, values: np.ndarray) -> None:
        self.inputs = inputs
        self.age_edges_s = age_edges_s
        # decisions[k, mode, availability, slack] (int8), values[k, mode, availability, slack].
        self.decisions = decisions
        self.values = values
        # Looked up every tick: plain Python numbers (numpy calls on scalars cost microseconds).
        self._last_k = decisions.shape[0] - 1
        self._last_s = decisions.shape[3] - 1
        self._slack_unit_s = float(inputs.slack_unit_s)

    def _index(self, steps_left: float, slack_s: float, mode: int, up: bool, age_s: float
               ) -> tuple[int, int, int, int]:
        k = int(min(max(round(steps_left), 0), self._last_k))
        edges = self.age_edges_s
        bins = len(edges)
        # bisect_right on the sorted edges is np.searchsorted(side="right"), NaN included.
        age_bin = max(0, min(bins - 1, bisect.bisect_right(edges, age_s) - 1))
        a = age_bin if up else bins + age_bin
        s = int(min(max(math.floor(slack_s / self._slack_unit_s), 0), self._last_s))
        return k, mode, a, s

    def slack_value_usd_per_h(self, time_left_s: float, slack_s: float, mode: int, up: bool,
                              age_s: float, by_s: float) -> float:
        """What `by_s` seconds of slack are worth here (USD per hour of slack): the plan's value
        with that much less slack minus its value now."""
        k, m, a, s = self._index(time_left_s / self.inputs.dt_s, slack_s, mode, up, age_s)
        lower = max(0, s - max(1, round(by_s / self.inputs.slack_unit_s)))
        if lower == s:
            return 0.0
        gained = float(self.values[k, m, a, lower]) - float(self.values[k, m, a, s])
        return max(0.0, gained) * 3600.0 / ((s - lower) * self.inputs.slack_unit_s)

    def decide(self, time_left_s: float, slack_s: float, mode: int, up: bool, age_s: float
               ) -> tuple[int, float]:
        """(action, expected USD to the end) for the state; slack is floored to the grid."""
        idx = self._index(time_left_s / self.inputs.dt_s, slack_s, mode, up, age_s)
        return int(self.decisions[idx]), float(self.values[idx])


def _transitions(model: PreemptionRiskModel, zone: str, spot_nodes: int, dt_s: float,
                 age_edges: tuple[float, ...], hop_probability: float = 0.0, zones: int = 1
                 ) -> tuple[np.ndarray, np.ndarray]:
    """(P, end): P[a, a'] one-step availability transitions over 2B states (up bins, then down
    bins); end[a] the probability that the run in state a ends this step. With a composite of
    `zones` zones, an up run that ends is followed at once by another zone's run with
    `hop_probability`, and a down spell ends when any zone returns."""
    bins = len(age_edges)
    size = 2 * bins
    p = np.zeros((size, size))
    end = np.zeros(size)
    for side, state in enumerate((UP, DOWN)):
        curve = model.curve(zone, spot_nodes, state)
        mean_factor = sum(curve.hour_factor) / curve.hour_bins
        edges = curve.age_edges_s
        for i, lower in enumerate(age_edges):
            # The curve's rate at this bin's lower edge (the plan's bins are the curve's bins).
            j = int(np.searchsorted(edges, lower, side="right")) - 1
            rate_per_s = curve.rate_per_h[j] * mean_factor / 3600.0
            if state == DOWN:
                rate_per_s *= zones
            ends = -math.expm1(-rate_per_s * dt_s)
            a = side * bins + i
            other = (1 - side) * bins  # the other state's first bin
            end[a] = ends
            if state == UP:
                p[a, 0] += ends * hop_probability
                p[a, other] += ends * (1 - hop_probability)
            else:
                p[a, other] += ends
            if i + 1 < bins:
                advance = min(1.0, dt_s / (age_edges[i + 1] - lower))
                p[a, a + 1] += (1 - ends) * advance
                p[a, a] += (1 - ends) * (1 - advance)
            else:
                p[a, a] += 1 - ends
    return p, end


class _Shift:
    """values[..., s - by_units] along the last axis, linearly interpolated; where that falls
    below the grid, the cost of a missed deadline applies. The index arithmetic is done once
    per shift amount."""

    def __init__(self, n: int, by_units: float) -> None:
        pos = np.arange(n) - by_units
        lo = np.floor(pos).astype(int)
        self.w = pos - lo
        self.one_minus_w = 1 - self.w
        self.inside = lo >= 0
        self.outside = ~self.inside
        self.any_outside = bool(self.outside.any())
        self.lo = np.clip(lo, 0, n - 1)
        self.hi = np.clip(lo + 1, 0, n - 1)
        # Usually the inside points read one contiguous run of the grid: slices then give the
        # same numbers as the gathers, without copying indices (the plan's inner loop).
        self.first = int(np.argmax(self.inside)) if self.inside.any() else n
        inner_lo, inner_hi = self.lo[self.first:], self.hi[self.first:]
        self.slices = None
        if (self.first < n and bool(self.outside[:self.first].all())
                and np.array_equal(inner_lo, np.arange(inner_lo[0], inner_lo[0] + inner_lo.size))
                and np.array_equal(inner_hi, inner_lo + 1)):
            start = int(inner_lo[0])
            self.slices = (slice(start, start + inner_lo.size),
                           slice(start + 1, start + 1 + inner_lo.size))
            self.inner_w = self.w[self.first:]
            self.inner_one_minus_w = self.one_minus_w[self.first:]

    def __call__(self, values: np.ndarray, floor_usd: float) -> np.ndarray:
        if self.slices is None:
            out = values[..., self.lo] * self.one_minus_w + values[..., self.hi] * self.w
            if self.any_outside:
                out[..., self.outside] = floor_usd
            return out
        lo, hi = self.slices
        out = np.empty(values.shape)
        out[..., :self.first] = floor_usd
        np.add(values[..., lo] * self.inner_one_minus_w, values[..., hi] * self.inner_w,
               out=out[..., self.first:])
        return out


def _plan_age_edges(edges: tuple[float, ...], dt_s: float, fine_until_s: float
                    ) -> tuple[float, ...]:
    """The curve's age edges, with every bin below `fine_until_s` split into steps of dt_s."""
    out: list[float] = []
    for i, lower in enumerate(edges):
        upper = edges[i + 1] if i + 1 < len(edges) else math.inf
        out.append(lower)
        if upper <= fine_until_s:
            age = lower + dt_s
            while age < upper - 1e-9:
                out.append(age)
                age += dt_s
    return tuple(out)


def solve_plan(model: PreemptionRiskModel, zone: str, spot_nodes: int, inputs: PlanInputs
               ) -> SlackPlan:
    """Backward induction over `inputs.steps` steps; see the module docstring for the model."""
    if inputs.steps < 1 or not inputs.dt_s > 0:
        raise ValueError(f"a plan needs steps >= 1 and dt_s > 0, got {inputs.steps}, "
                         f"{inputs.dt_s}")
    curve = model.curve(zone, spot_nodes, UP)
    age_edges = _plan_age_edges(tuple(curve.age_edges_s), inputs.dt_s, inputs.fine_age_until_s)
    bins = len(age_edges)
    p, end = _transitions(model, zone, spot_nodes, inputs.dt_s, age_edges,
                          inputs.hop_probability, inputs.zones)
    up_mask = np.zeros(2 * bins, dtype=bool)
    up_mask[:bins] = True
    # Transitions that keep spot: survive the step (the hop after an end is a new run).
    p_stay_up = p * up_mask[None, :]
    p_stay_up[np.arange(bins), 0] -= end[:bins] * inputs.hop_probability
    q_hop = inputs.hop_probability
    unit = inputs.slack_unit_s
    n_slack = int(math.ceil(inputs.max_slack_s / unit)) + 2
    slack = np.arange(n_slack) * unit
    dt, c, save = inputs.dt_s, inputs.changeover_s, inputs.save_s
    step_od = inputs.on_demand_usd_per_h * dt / 3600.0
    step_spot = inputs.spot_usd_per_h * dt / 3600.0
    release = np.array([0.0, inputs.on_demand_usd_per_h, inputs.spot_usd_per_h]) * save / 3600.0
    big = 1e18

    steps = inputs.steps
    penalty_usd = miss_penalty_usd(inputs)
    shift_dt, shift_c, shift_save = (_Shift(n_slack, x / unit) for x in (dt, c, save))
    decisions = np.zeros((steps + 1, 3, 2 * bins, n_slack), dtype=np.int8)
    values = np.zeros((steps + 1, 3, 2 * bins, n_slack), dtype=np.float32)
    v = np.zeros((3, 2 * bins, n_slack))  # k = 0: the deadline; anything left is missed
    down_up = ~up_mask
    # The three held modes are solved together, each elementwise step as in a loop over modes
    # (same arithmetic, same results): a mode's release cost, and which option keeps its set.
    release_by_mode = release[:, None, None]
    idle_done = np.where(up_mask, SPOT, ON_DEMAND)[:, None]
    # Slack levels at or above the time left have no training left (`done`): a tail of the grid.
    for k in range(1, steps + 1):
        time_left = k * dt
        first_done = int(np.searchsorted(slack, time_left, side="left"))
        # Below zero slack: the deadline is missed; finish on on-demand plus the penalty.
        miss_usd = penalty_usd + inputs.on_demand_usd_per_h * (time_left + c) / 3600.0
        ev_idle = p @ v[IDLE]
        ev_od = p @ v[ON_DEMAND]
        # Preempted: idle, after the notice save, with another zone up (hop) or none.
        after = q_hop * v[IDLE][0:1] + (1 - q_hop) * v[IDLE][bins:bins + 1]
        preempted = shift_save(after, miss_usd)
        ev_spot = p_stay_up @ v[SPOT] + end[:, None] * preempted
        q_idle = shift_dt(ev_idle, miss_usd)
        q_od_launch = step_od + shift_c(ev_od, miss_usd)
        q_spot_launch = step_spot + shift_c(ev_spot, miss_usd)
        q_spot_launch[down_up] = big
        # options[option][mode]: idle, on-demand, spot, from each held mode.
        opt_idle = q_idle + release_by_mode
        opt_od = q_od_launch + release_by_mode
        opt_od[ON_DEMAND] = step_od + ev_od  # keep on-demand
        opt_spot = q_spot_launch + release_by_mode
        opt_spot[SPOT] = step_spot + ev_spot  # keep spot
        opt_spot[SPOT][down_up] = big
        best = np.where(opt_od < opt_idle, ON_DEMAND, IDLE)
        best_v = np.minimum(opt_idle, opt_od)
        spot_better = opt_spot < best_v
        best[spot_better] = SPOT
        new_v = np.where(spot_better, opt_spot, best_v)
        decisions[k] = best
        if first_done < n_slack:
            new_v[:, :, first_done:] = 0.0
            # Done on the grid (less than a slack unit of training left): finish with what is
            # held, or start the cheapest set there is; never release a gang about to finish.
            decisions[k, ON_DEMAND, :, first_done:] = ON_DEMAND
            decisions[k, SPOT, :, first_done:] = SPOT
            decisions[k, IDLE, :, first_done:] = idle_done
        # Spot mode while down cannot happen (the preemption released it): same as idle.
        new_v[SPOT][down_up] = new_v[IDLE][down_up]
        v = new_v
        values[k] = v
    return SlackPlan(inputs, age_edges, decisions, values)
