"""The hindsight optimum: the cheapest any policy could have done on a market window.

Dynamic programming over ticks with full knowledge of availability, under the simulator's rules
(`cloud/simulator.py`) relaxed only in the oracle's favour, so that its cost is a true lower
bound on every policy's cost in the simulator:

- A state is (node set, work done). A node set ("config") is (zone, s spot + N - s on-demand) for
  s = 1..N, or all on-demand (priced at the cheapest zone, which is never dearer than any zone), or
  nothing. A config with s spot nodes is allowed in a tick only if the zone has s available then,
  so the oracle is never preempted; it simply leaves spot when it knows spot will go.
- Every start of a config costs one changeover: billed, no training. Work is counted in units of
  q seconds; the changeover is rounded DOWN to whole units and the work needed is rounded DOWN
  too, so the oracle is credited with at least the simulator's work. It pays no checkpoints,
  loses no work, and its last tick is billed only for the training seconds it needs (or whole,
  with `ClusterRules.bill_finishing_tick_whole`: the Can't Be Late convention, under which,
  with an exact grid, the bound IS the exact optimum; see benchmarks/cant_be_late).
- The changeover is booked as a debt: starting a config moves work down by the changeover and
  every running tick moves it up by a tick. This is exact for runs at least one changeover long;
  a shorter run earns nothing in the simulator and is never better than idling, which the
  oracle can always do instead, so dropping the over-indebted states loses no better path.
- Work left at the deadline is finished on on-demand afterwards, as in the simulator, with the
  remaining work rounded down by the unpaid changeover debt (in the oracle's favour again).

Why it is a lower bound: map any simulator run to the oracle run that holds the same config in
every tick where the simulator held a full gang, and nothing otherwise. Its bill is no larger (no
checkpoint saves, no partial ticks), and it starts a config exactly when the simulator does (the
simulator's node set changed, so it paid a changeover too), so its credited work is no smaller at
every tick. Hence it finishes no later, and if the simulator met the deadline so does the oracle.

Two results per window: `cost_deadline_met_usd` (the cheapest run that meets the deadline: the
yardstick, `inf` if none) and `cost_any_usd` (over all runs, including ones that finish after
the deadline with the completion charge): the bound for policies that missed the deadline.

Single-zone and multi-zone variants are the same program on a one-zone or many-zone market.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from cloud.simulator import ClusterRules, JobSpec, Market, job_horizon

# Work levels kept per state; more levels cost time, fewer loosen the rounding (at most one unit
# of changeover per start and one unit of total work).
MAX_WORK_LEVELS = 6000


@dataclass(frozen=True)
class OracleResult:
    cost_deadline_met_usd: float
    cost_any_usd: float
    zones: tuple[str, ...]
    work_unit_s: float
    changeover_rounded_s: float

    @property
    def feasible(self) -> bool:
        return math.isfinite(self.cost_deadline_met_usd)


def _work_unit(
    tick_s: int, changeover_s: float, run_s: float, max_levels: int = MAX_WORK_LEVELS
) -> tuple[float, int, int]:
    """(q, ticks' worth of units T, changeover units D), q dividing the tick.

    q = gcd(tick, changeover, work) makes the changeover and the work exact when the levels stay
    few enough (whole seconds);
    otherwise q = tick / k with the largest k that keeps the levels under MAX_WORK_LEVELS.
    """
    if float(changeover_s).is_integer():
        q = float(math.gcd(int(tick_s), int(changeover_s)))
        if abs(run_s - round(run_s)) < 1e-6:
            # The work on the grid too (whole seconds), so that rounding it down loses nothing.
            q = float(math.gcd(int(q), round(run_s)))
        if q > 0 and run_s / q <= max_levels:
            return q, round(tick_s / q), round(changeover_s / q)
    k = max(1, int(tick_s * max_levels // max(run_s, 1.0)))
    q = tick_s / k
    return q, k, math.floor(changeover_s / q + 1e-9)


def hindsight_optimum(
    job: JobSpec, rules: ClusterRules, market: Market, max_work_levels: int = MAX_WORK_LEVELS
) -> OracleResult:
    """The lower bound over every zone of `market` (multi-zone when it has several).

    `max_work_levels` caps the work grid; when gcd(tick, changeover) fits under it the grid is
    exact and, with `rules.bill_finishing_tick_whole`, so is the optimum (the Can't Be Late
    benchmark passes a cap large enough for that)."""
    horizon = job_horizon(job, rules, market)
    n_nodes = job.node_count
    q, tick_units, debt_units = _work_unit(
        market.tick_s, rules.changeover_s, horizon.run_s, max_work_levels
    )
    need_units = max(1, math.floor(horizon.run_s / q + 1e-6))
    levels = need_units + debt_units  # index i holds work w = i - debt_units

    # Configs: (zone, s spot) for s = 1..N, then all on-demand at the cheapest zone.
    zone_of, spot_of, usd_per_s = [], [], []
    for z in range(len(market.zones)):
        for s in range(1, n_nodes + 1):
            zone_of.append(z)
            spot_of.append(s)
            usd_per_s.append(
                (s * market.spot_usd_per_hour[z] + (n_nodes - s) * market.on_demand_usd_per_hour[z])
                / 3600.0
            )
    od_usd_per_s = n_nodes * min(market.on_demand_usd_per_hour) / 3600.0
    zone_of.append(0)
    spot_of.append(0)
    usd_per_s.append(od_usd_per_s)
    price_s = np.asarray(usd_per_s)
    tick_cost = price_s * market.tick_s
    # Seconds billed for the finishing tick: the training seconds it needs (per-second billing),
    # or the whole tick (`bill_finishing_tick_whole`).
    whole = rules.bill_finishing_tick_whole
    feasible = (
        market.spot_available[np.asarray(zone_of), : horizon.ticks] >= np.asarray(spot_of)[:, None]
    )
    n_configs = len(usd_per_s)

    index = np.arange(levels, dtype=np.float64)
    # Bill of the finishing tick per config and level: only the training seconds still needed.
    # Continuing from level i (w = i - D): needs (W - w) units.
    finish_units_continue = need_units - (index - debt_units)
    # Starting from level i: the debt is added first, so it needs (W - (w - D)) units.
    finish_units_start = finish_units_continue + debt_units
    start_shift = tick_units - debt_units

    inf = np.inf
    states = np.full((n_configs, levels), inf)
    idle = np.full(levels, inf)
    idle[debt_units] = 0.0  # nothing held, no work, no cost
    done = inf
    shifted = np.empty_like(states)
    start_row = np.empty(levels)
    for t in range(horizon.ticks):
        best = np.minimum(idle, states.min(axis=0))
        ok = feasible[:, t]
        # Keep running the same config: +T units.
        if tick_units < levels:
            shifted[:, tick_units:] = states[:, : levels - tick_units]
        shifted[:, : min(tick_units, levels)] = inf
        tail = max(0, levels - tick_units)
        finish_candidates = [
            (states[:, tail:] + price_s[:, None] * q * finish_units_continue[tail:]).min(axis=1)
            if not whole else states[:, tail:].min(axis=1) + tick_cost
        ]
        # Start a config from the best state of the last tick: +T - D units.
        if start_shift >= 0:
            if start_shift < levels:
                start_row[start_shift:] = best[: levels - start_shift]
            start_row[: min(start_shift, levels)] = inf
            tail = max(0, levels - start_shift)
            finish_candidates.append(
                (best[tail:][None, :] + price_s[:, None] * q * finish_units_start[tail:]).min(
                    axis=1
                )
                if not whole else (best[tail:].min() if tail < levels else np.inf) + tick_cost
            )
        else:
            start_row[: levels + start_shift] = best[-start_shift:]
            start_row[levels + start_shift :] = inf
        np.minimum(shifted, start_row[None, :], out=shifted)
        shifted += tick_cost[:, None]
        shifted[~ok] = inf
        finishing = np.minimum.reduce(finish_candidates)
        finishing[~ok] = inf
        done = min(done, float(finishing.min()))
        states, shifted = shifted, states
        idle = best

    best = np.minimum(idle, states.min(axis=0))
    # Finish after the deadline on on-demand: one changeover plus the remaining work, the remaining
    # work counted with any unpaid changeover debt forgiven (never more than the simulator pays).
    remaining_s = np.maximum(0.0, need_units - index) * q
    late = (
        best
        + n_nodes * min(market.on_demand_usd_per_hour) * (remaining_s + rules.changeover_s) / 3600.0
    )
    cost_any = min(done, float(late.min()))
    return OracleResult(
        cost_deadline_met_usd=done,
        cost_any_usd=cost_any,
        zones=market.zones,
        work_unit_s=q,
        changeover_rounded_s=debt_units * q,
    )


def single_zone_optimum(
    job: JobSpec, rules: ClusterRules, market: Market, zone: str,
    max_work_levels: int = MAX_WORK_LEVELS,
) -> OracleResult:
    """The lower bound for a job that must stay in `zone` (the Can't Be Late setting)."""
    return hindsight_optimum(job, rules, market.zone_market(zone), max_work_levels)


def multi_zone_optimum(
    job: JobSpec, rules: ClusterRules, market: Market, max_work_levels: int = MAX_WORK_LEVELS
) -> OracleResult:
    """The lower bound for a job that may move among all zones of `market`, paying a changeover."""
    return hindsight_optimum(job, rules, market, max_work_levels)
