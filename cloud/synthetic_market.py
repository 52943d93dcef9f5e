"""Synthetic spot markets sampled from a fitted `PreemptionRiskModel`: a world where the model is true.

Each zone's availability for a gang of `spot_nodes` nodes is the model's alternating process: an
"up" run (spot holds `spot_nodes` nodes), then a "down" run (it does not), each run's length drawn
from the model's age-dependent hazard for that state, zone and level, times its time-of-day factor.
Zones are sampled independently (the model has no cross-zone term), each from its own stream of
the seed, so a zone's path does not depend on which other zones are sampled with it.

Sampling scheme: per tick, Bernoulli. At the start of tick t a run of age a (seconds since its first
tick) ends at the next tick boundary with p = 1 - `model.survival(zone, a, tick_s, t * tick_s)`.
Why per tick and not an Exp(1) target walked through the continuous cumulative hazard: everything
that reads a market sees only the tick grid (the simulator preempts at tick boundaries, the fit in
`cloud/risk_fit.py` counts runs in whole ticks, the policy asks `survival` over whole ticks at ages
that are multiples of the tick). A continuous draw would then have to be rounded onto the grid
(runs shorter than a tick vanish or stretch), which the model says nothing about; the per-tick
draw makes P(the run outlasts k more ticks) exactly `survival(age, k * tick_s)`, the number the
policy computes, with no rounding. One consequence, stated for the tests: a fresh run lasts at
least one tick, and its mean length on the grid is tick_s * sum_{k>=0} S(k * tick_s), which exceeds
the continuous `model.mean_run_s` (the integral of S) by less than a tick (about half a tick when
the hazard changes slowly).

Time of day: tick t starts at trace time `start_s + t * tick_s`; the model turns trace time into a
phase with its own `utc_offset_s`, exactly as it does for a policy reading `trace_time_s` (a
`Market` built here has `trace_start_s = start_s`, and its windows keep counting from it).

The first tick starts a fresh run (age 0) in a state drawn from the model's long-run availability
share; callers that want the stationary regime discard a burn-in. Deterministic given the seed.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from cloud.simulator import Market
from controllers.preemption_risk import DOWN, UP, PreemptionRiskModel

SeedLike = int | np.random.Generator


def _generator(seed: SeedLike) -> np.random.Generator:
    if isinstance(seed, np.random.Generator):
        return seed
    if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)) or seed < 0:
        raise ValueError(f"seed={seed!r} must be an int >= 0 or a numpy Generator")
    return np.random.default_rng(int(seed))


def _check_grid(n_ticks: int, tick_s: float, spot_nodes: int, start_s: float) -> None:
    if isinstance(n_ticks, bool) or not isinstance(n_ticks, (int, np.integer)) or n_ticks < 1:
        raise ValueError(f"n_ticks={n_ticks!r} must be an int >= 1 (the market's length)")
    if not (isinstance(tick_s, (int, float)) and math.isfinite(tick_s) and tick_s > 0):
        raise ValueError(f"tick_s={tick_s!r} must be a positive number of seconds")
    if isinstance(spot_nodes, bool) or not isinstance(spot_nodes, (int, np.integer)) \
            or spot_nodes < 1:
        raise ValueError(f"spot_nodes={spot_nodes!r} must be an int >= 1 (the gang's size)")
    if not (isinstance(start_s, (int, float)) and math.isfinite(start_s) and start_s >= 0):
        raise ValueError(f"start_s={start_s!r} must be a finite number of seconds >= 0")


def sample_availability(
    model: PreemptionRiskModel,
    zone: str,
    n_ticks: int,
    tick_s: float,
    seed: SeedLike,
    spot_nodes: int = 1,
    start_s: float = 0.0,
    initial_up: bool | None = None,
) -> np.ndarray:
    """`n_ticks` ticks of one zone's spot availability: `spot_nodes` during up runs, 0 during down
    runs (capacity comes and goes in blocks of the gang's size; levels below it are not sampled).

    `initial_up`: the state of the first run (None: drawn with P(up) = the model's long-run share
    for that zone and level). Errors name the bad argument; a zone the model has no curve for
    (and no pooled curve) raises the model's own ValueError.
    """
    _check_grid(n_ticks, tick_s, spot_nodes, start_s)
    rng = _generator(seed)
    spot_nodes = int(spot_nodes)
    tick = float(tick_s)
    # Beyond its last age edge a curve's hazard no longer depends on age, so survival over a tick
    # at any older age equals that at the edge: capping keeps the model's memo small, exactly.
    cap_s = {state: model.curve(zone, spot_nodes, state).age_edges_s[-1] for state in (UP, DOWN)}
    if initial_up is None:
        up = bool(rng.random() < model.availability_share(zone, spot_nodes))
    else:
        up = bool(initial_up)
    draws = rng.random(n_ticks)
    out = np.empty(n_ticks, dtype=np.int64)
    run_start = 0
    survival = model.survival
    for t in range(n_ticks):
        out[t] = spot_nodes if up else 0
        state = UP if up else DOWN
        age = min((t - run_start) * tick, cap_s[state])
        stay = survival(zone, age, tick, start_s + t * tick, spot_nodes, state)
        if draws[t] >= stay:  # P = 1 - stay: the run ends at the end of tick t
            up = not up
            run_start = t + 1
    return out


def synthetic_market(
    model: PreemptionRiskModel,
    zones: Sequence[str],
    n_ticks: int,
    tick_s: int,
    seed: SeedLike,
    spot_usd_per_hour: Sequence[float],
    on_demand_usd_per_hour: Sequence[float],
    spot_nodes: int = 1,
    start_s: float = 0.0,
) -> Market:
    """A `Market` of `zones` (one price pair per zone) whose availability is sampled from `model`
    (`sample_availability`, each zone from its own child stream of `seed`)."""
    zones = tuple(zones)
    if not zones:
        raise ValueError("synthetic_market needs at least one zone")
    if len(spot_usd_per_hour) != len(zones) or len(on_demand_usd_per_hour) != len(zones):
        raise ValueError(
            f"give one spot and one on-demand price per zone ({len(zones)} zones), got "
            f"{len(spot_usd_per_hour)} and {len(on_demand_usd_per_hour)}"
        )
    if isinstance(tick_s, bool) or not isinstance(tick_s, (int, np.integer)) or tick_s < 1:
        raise ValueError(f"tick_s={tick_s!r} must be a whole number of seconds >= 1 (as a "
                         "Market's tick)")
    _check_grid(n_ticks, tick_s, spot_nodes, start_s)
    streams = _generator(seed).spawn(len(zones))
    rows = [sample_availability(model, zone, n_ticks, tick_s, stream, spot_nodes, start_s)
            for zone, stream in zip(zones, streams, strict=True)]
    return Market(
        zones=zones,
        tick_s=int(tick_s),
        spot_available=np.stack(rows),
        spot_usd_per_hour=tuple(float(p) for p in spot_usd_per_hour),
        on_demand_usd_per_hour=tuple(float(p) for p in on_demand_usd_per_hour),
        trace_start_s=float(start_s),
    )


def run_lengths_s(available: np.ndarray, tick_s: float, spot_nodes: int = 1
                  ) -> tuple[np.ndarray, np.ndarray]:
    """(up run lengths, down run lengths) in seconds of one zone's series, complete runs only:
    the first run (its start may precede the series) and the last (cut by its end) are left out."""
    up = np.asarray(available) >= spot_nodes
    change = np.flatnonzero(up[1:] != up[:-1]) + 1
    if change.size < 2:
        return np.empty(0), np.empty(0)
    lengths = np.diff(change) * float(tick_s)
    states = up[change[:-1]]
    return lengths[states], lengths[~states]
