"""Fit the preemption-risk model (`controllers/preemption_risk.py`) on real spot traces, honestly.

Estimator (per state "up"/"down", zone, and spot_nodes level: a run is "up" while the zone has at
least that many spot nodes):

1. Occurrence/exposure by age bin: every tick of a run adds `tick_s` hours at risk to the bin of
   the run's age at that tick, and the tick where the run ends adds one event. events / hours is
   the maximum-likelihood piecewise-constant hazard (Kalbfleisch & Prentice 2002, ch. 4; the
   binned form of Kaplan-Meier). The first run of a series is left-censored (its start is unknown)
   and is skipped, unless it is the series' only run (no change of state at all): then its
   hours count, aged from the series start, with no event, so a market that never ended a run
   reads as safe rather than inheriting the pool's hazard. The run cut by the cutoff is
   right-censored (hours at risk, no event).
2. Shrinkage (gamma-Poisson, empirical Bayes): a zone's rate in an age bin is
   (events + k) / (hours + k / prior_rate), with `k = prior_events` pseudo-events at the pooled
   rate, i.e. the posterior mean under a Gamma(k, k / prior_rate) prior. The zone shrinks
   toward the pool of all zones of its market (same spot_nodes), the pool toward the global
   curve of all series (prior folders included). The global curve's youngest bin shrinks toward
   its own flat rate and every older bin toward the bin before it (`age_chained_prior`), so an
   age no run of the fit reached reads the oldest ages seen, not an average young runs
   dominate. A sparse bin therefore reads the pooled estimate; a well-observed one reads its
   own.
3. Time of day: `hour_bins` equal bins of the day; factor = (events + k_tod * pooled_factor) /
   (events expected under the age curve + k_tod): proportional hazards, shrunk toward the pool
   and the pool toward 1.

Protocol (no peeking): `fit_risk_model(target, cutoff_tick, prior)` reads the target market only at
ticks < cutoff_tick (the evaluated window starts at cutoff_tick), plus `prior` series in full.
The cost suite passes as prior the traces of the OTHER folders (leave-one-folder-out), so a
window is scored with a model that saw the past of its own folder and other collections, never
its own window or the future of its own traces. A window at tick 0 is scored with the prior alone.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from cloud.traces import SpotTrace, group_by_shape, load_folder
from controllers.preemption_risk import (
    DAY_S,
    DEFAULT_AGE_EDGES_S,
    DOWN,
    POOLED_ZONE,
    STATES,
    UP,
    HazardCurve,
    PreemptionRiskModel,
    gang_curves,
)

PROTOCOL = (
    "hazards fitted on the window's own market before the window start (all zones of the "
    "folder and node shape, ticks < start) plus, as the prior, the full traces of the other "
    "trace folders (leave-one-folder-out); zone curves shrunk toward the market pool, the pool "
    "toward the global curve; which folders and ticks a fit may see is the caller's split "
    "(the cost suite's leave-one-collection-out and leave-time-out: benchmarks/cost/protocol.py)"
)
# Used when a fit has no data at all (cutoff 0 and no prior): memoryless, 2 h up, 1 h down.
FALLBACK_MEAN_UP_S = 7200.0
FALLBACK_MEAN_DOWN_S = 3600.0


@dataclass(frozen=True)
class RiskFitConfig:
    age_edges_s: tuple[float, ...] = DEFAULT_AGE_EDGES_S
    hour_bins: int = 6
    # Pseudo-events of the prior rate per age bin (strength of the shrinkage).
    prior_events: float = 2.0
    # Pseudo-events of the pooled factor per hour bin.
    tod_prior_events: float = 10.0
    utc_offset_s: float = 0.0
    # The prior of a gang of N nodes (levels above 1): the global curve of N ** this many
    # independent nodes (`_gang_prior`). 0 (default): the global curve at every level, so with
    # no ticks of its own (leave-one-collection-out) a 16-node gang is priced as one node.
    # Measured with 0.23 (`GANG_HAZARD_EXPONENT`), cost suite LOCO, 8 windows per zone: the
    # real 4-node gang unchanged (single-zone 0.956 -> 0.957x Uniform Progress, multi-zone
    # 0.550 -> 0.548x; LTO 0.958 -> 0.957x), the SYNTHETIC 16-node gang dearer (single-zone
    # 0.983 -> 1.014x, multi-zone 0.751 -> 0.776x): its truer, shorter whole-gang runs (0.7 h
    # expected where the market's zones show 0.6-1.6 h, against 2.8 h before) made the plan
    # take spot less, and those runs paid even so. Kept off until a real large-gang market
    # shows it pays.
    gang_hazard_exponent: float = 0.0
    # The global curve's age bins in order, each shrunk toward the rate of the bin before it
    # (the first toward the flat rate), not all toward the flat rate. Why: an age bin no run of
    # the fit reached (old runs of a calm spell the fit never saw) otherwise reads the flat
    # rate of all ages, which young runs dominate, so a run older than any seen is priced as
    # one minutes old. Found on the cost suite's worst window against Uniform Progress (LTO,
    # 2-zone p3.16xlarge from tick 2414: no run of the fit's half passed 8 h, so a zone up for
    # 14 h read 1.6 ends per hour and trainwise rode the other, flapping zone: 725 USD where
    # Uniform Progress paid 383; now 380). Cost suite at a13fd81: that cell 1.258 -> 1.138x
    # the oracle, LOCO 2023-04 multi-zone 1.139 -> 1.147x, every other cell within 0.3%, the
    # Can't Be Late windows within 0.02%.
    age_chained_prior: bool = True

    def __post_init__(self) -> None:
        if not 0.0 <= self.gang_hazard_exponent <= 1.0:
            raise ValueError(f"gang_hazard_exponent={self.gang_hazard_exponent} must be in "
                             "[0, 1] (0: a gang's runs as one node's; 1: independent nodes)")
        if self.hour_bins < 1 or DAY_S % self.hour_bins:
            raise ValueError(f"hour_bins={self.hour_bins} must divide a day into whole seconds")
        if not (self.prior_events > 0 and self.tod_prior_events > 0):
            raise ValueError("prior_events and tod_prior_events must be positive")


@dataclass(frozen=True)
class AvailabilityHistory:
    """Spot nodes available per zone and tick (zones x ticks), as in a `Market`."""

    name: str
    zones: tuple[str, ...]
    tick_s: float
    available: np.ndarray
    capacity_nodes: int
    # Seconds from the trace's first tick to column 0 (for the time of day).
    trace_start_s: float = 0.0

    def __post_init__(self) -> None:
        if self.available.ndim != 2 or self.available.shape[0] != len(self.zones):
            raise ValueError(
                f"available must be zones x ticks ({len(self.zones)} zones), got shape "
                f"{self.available.shape}"
            )
        if not self.tick_s > 0:
            raise ValueError(f"tick_s={self.tick_s} must be positive")
        if self.capacity_nodes < 1:
            raise ValueError(f"capacity_nodes={self.capacity_nodes} must be at least 1")


def history_from_traces(traces: Sequence[SpotTrace], name: str = "") -> AvailabilityHistory:
    """The traces of one folder and node shape side by side (cut to the shortest)."""
    if not traces:
        raise ValueError("history_from_traces needs at least one trace")
    length = min(t.n_ticks for t in traces)
    return AvailabilityHistory(
        name or f"{traces[0].folder}/{traces[0].node_shape}",
        tuple(t.zone for t in traces),
        float(traces[0].tick_s),
        np.stack([t.available[:length] for t in traces]),
        max(t.capacity_nodes for t in traces),
    )


@dataclass
class _Counts:
    """events and hours at risk, indexed [state, age_bin, hour_bin]."""

    events: np.ndarray
    hours: np.ndarray

    @classmethod
    def zeros(cls, config: RiskFitConfig) -> _Counts:
        shape = (len(STATES), len(config.age_edges_s), config.hour_bins)
        return cls(np.zeros(shape), np.zeros(shape))

    def __iadd__(self, other: _Counts) -> _Counts:
        self.events += other.events
        self.hours += other.hours
        return self


def count_runs(
    up: np.ndarray, tick_s: float, trace_start_s: float, config: RiskFitConfig
) -> tuple[_Counts, tuple[str, float] | None]:
    """Occurrence/exposure of one boolean series (True = up), and the state and age (s) of the
    run in progress at its end (None for an empty series)."""
    counts = _Counts.zeros(config)
    n = int(up.shape[0])
    if n == 0:
        return counts, None
    up = up.astype(bool)
    change = np.flatnonzero(up[1:] != up[:-1]) + 1  # first tick of each new run
    starts = np.concatenate(([0], change))
    run_id = np.cumsum(np.isin(np.arange(n), change))
    age_ticks = np.arange(n) - starts[run_id]
    last = (starts[-1], bool(up[-1]))
    age_at_end_s = float((n - last[0]) * tick_s)
    at_end = (UP if last[1] else DOWN, age_at_end_s)
    # The first run started before the series: its ages are unknown, so it is skipped (its
    # end, if any, would be placed at a wrong age). Except when it is the only run: a series
    # that never changes state (a calm market, a gang never down in the fitted ticks) would
    # then add no exposure at all and read another market's hazard, the dangerous one; its
    # hours count from the series start (a lower bound of the true ages), with no event, so
    # a market with no observed endings reads as safe as its length shows.
    known = run_id > 0 if change.size else np.ones(n, dtype=bool)
    ends = np.zeros(n, dtype=bool)
    ends[change - 1] = True  # the last tick of every run that ended inside the series
    age_bin = np.searchsorted(np.asarray(config.age_edges_s), age_ticks * tick_s, side="right") - 1
    phase = (trace_start_s + np.arange(n) * tick_s + config.utc_offset_s) % DAY_S
    hour_bin = np.minimum((phase // (DAY_S / config.hour_bins)).astype(int), config.hour_bins - 1)
    state = np.where(up, STATES.index(UP), STATES.index(DOWN))
    flat = np.ravel_multi_index((state, age_bin, hour_bin), counts.hours.shape)
    size = counts.hours.size
    counts.hours += (
        np.bincount(flat[known], minlength=size).reshape(counts.hours.shape) * tick_s / 3600.0
    )
    counts.events += np.bincount(flat[known & ends], minlength=size).reshape(counts.events.shape)
    return counts, at_end


def _shrunk(events: np.ndarray, hours: np.ndarray, prior: np.ndarray, k: float) -> np.ndarray:
    """Posterior-mean rates under Gamma(k, k / prior) priors, bin by bin."""
    prior = np.maximum(prior, 1e-6)
    return (events + k) / (hours + k / prior)


def _shrunk_chained(events: np.ndarray, hours: np.ndarray, first_prior: float, k: float
                    ) -> np.ndarray:
    """Posterior-mean rates with each age bin's Gamma prior centred on the bin before it (the
    first on `first_prior`): a sparse bin reads its younger neighbour, the smoothness prior of
    correlated piecewise hazards (Arjas & Gasbarra 1994)."""
    rates = np.empty(len(events))
    prior = first_prior
    for i, (e, h) in enumerate(zip(events, hours)):
        prior = rates[i] = (e + k) / (h + k / max(prior, 1e-6))
    return rates


def _curve(
    counts: np.ndarray, hours: np.ndarray, prior_rate: np.ndarray, prior_factor: np.ndarray,
    config: RiskFitConfig, chained: bool = False,
) -> tuple[HazardCurve, np.ndarray]:
    """One state's curve from [age, hour] counts, shrunk toward the prior (`chained`: the
    first bin toward prior_rate[0], each later bin toward the bin before it); also its
    factors."""
    by_age_events, by_age_hours = counts.sum(axis=1), hours.sum(axis=1)
    if chained:
        rate = _shrunk_chained(by_age_events, by_age_hours, float(prior_rate[0]),
                               config.prior_events)
    else:
        rate = _shrunk(by_age_events, by_age_hours, prior_rate, config.prior_events)
    expected = (hours * rate[:, None]).sum(axis=0)
    observed = counts.sum(axis=0)
    k_tod = config.tod_prior_events
    factor = (observed + k_tod * prior_factor) / (expected + k_tod)
    curve = HazardCurve(
        tuple(config.age_edges_s),
        tuple(float(r) for r in rate),
        tuple(float(f) for f in factor),
        float(by_age_events.sum()),
        float(by_age_hours.sum()),
    )
    return curve, factor


def fit_risk_model(
    target: AvailabilityHistory,
    cutoff_tick: int,
    prior: Sequence[AvailabilityHistory] = (),
    spot_levels: Sequence[int] | None = None,
    config: RiskFitConfig | None = None,
) -> PreemptionRiskModel:
    """Hazards for every zone of `target` from its ticks < `cutoff_tick` only, shrunk toward the
    pool of its zones and the global curve of target + `prior` (see the module docstring).

    `spot_levels` (default 1..target.capacity_nodes) are the gang sizes to fit: a run is up while
    the zone has at least that many spot nodes. Prior series count at their full capacity.
    """
    config = config or RiskFitConfig()
    if isinstance(cutoff_tick, bool) or not isinstance(cutoff_tick, (int, np.integer)):
        raise ValueError(f"cutoff_tick={cutoff_tick!r} must be an int")
    if not 0 <= cutoff_tick <= target.available.shape[1]:
        raise ValueError(
            f"cutoff_tick={cutoff_tick} must be within 0..{target.available.shape[1]} "
            f"(the target has {target.available.shape[1]} ticks)"
        )
    levels = sorted(set(spot_levels or range(1, target.capacity_nodes + 1)))
    if not levels or levels[0] < 1:
        raise ValueError(f"spot_levels={spot_levels} must be ints >= 1")
    # The only read of the target: its past. Nothing at or after the cutoff is touched below.
    seen = np.asarray(target.available[:, :cutoff_tick])

    global_counts = _Counts.zeros(config)
    for history in prior:
        for row in history.available:
            c, _ = count_runs(row >= history.capacity_nodes, history.tick_s,
                              history.trace_start_s, config)
            global_counts += c
    zone_counts: dict[tuple[str, int], _Counts] = {}
    run_at_cutoff: dict[tuple[str, int], tuple[str, float]] = {}
    for z, zone in enumerate(target.zones):
        for level in levels:
            c, at_end = count_runs(seen[z] >= level, target.tick_s, target.trace_start_s, config)
            zone_counts[(zone, level)] = c
            if at_end is not None:
                run_at_cutoff[(zone, level)] = at_end
            if level == target.capacity_nodes:
                global_counts += c

    description = (
        f"{PROTOCOL}; target {target.name} ticks [0, {cutoff_tick}) of "
        f"{target.available.shape[1]}, prior: {', '.join(h.name for h in prior) or 'none'}"
    )
    if global_counts.hours.sum() == 0 and all(c.hours.sum() == 0 for c in zone_counts.values()):
        model = PreemptionRiskModel.constant(
            FALLBACK_MEAN_UP_S, FALLBACK_MEAN_DOWN_S,
            fitted_on=f"no data before the cutoff: constant prior ({description})",
        )
        model.run_at_cutoff.update(run_at_cutoff)
        return model

    curves: dict[tuple[str, str, int], HazardCurve] = {}
    ones = np.ones(config.hour_bins)
    global_curves: dict[str, tuple[HazardCurve, np.ndarray]] = {}
    for s, state in enumerate(STATES):
        g_events, g_hours = global_counts.events[s], global_counts.hours[s]
        total_hours = g_hours.sum()
        flat = (g_events.sum() + config.prior_events) / (
            total_hours + config.prior_events * (
                FALLBACK_MEAN_UP_S if state == UP else FALLBACK_MEAN_DOWN_S) / 3600.0
        )
        global_curves[state] = _curve(
            g_events, g_hours, np.full(len(config.age_edges_s), flat), ones, config,
            chained=config.age_chained_prior,
        )
    for level in levels:
        level_prior = _gang_prior(global_curves, level, config)
        for s, state in enumerate(STATES):
            global_factor = global_curves[state][1]
            pool = _Counts.zeros(config)
            for zone in target.zones:
                pool += zone_counts[(zone, level)]
            pool_curve, pool_factor = _curve(
                pool.events[s], pool.hours[s], np.asarray(level_prior[state].rate_per_h),
                global_factor, config
            )
            curves[(state, POOLED_ZONE, level)] = pool_curve
            pool_rate = np.asarray(pool_curve.rate_per_h)
            for zone in target.zones:
                c = zone_counts[(zone, level)]
                curves[(state, zone, level)], _ = _curve(
                    c.events[s], c.hours[s], pool_rate, pool_factor, config
                )
    return PreemptionRiskModel(curves, config.utc_offset_s, description, run_at_cutoff)


def _gang_prior(global_curves: dict[str, tuple[HazardCurve, np.ndarray]], level: int,
                config: RiskFitConfig) -> dict[str, HazardCurve]:
    """The global curves as the prior of a `level`-node gang: `level` ** exponent independent
    single nodes (`gang_curves`). Why: the target's pool of each level shrinks toward this, so a
    market with few or no ticks of its own (leave-one-collection-out: none) can price a 16-node
    gang's runs as a 16-node gang's, not as if one node had to stay up (issue 9). Exponent 0:
    the global curves themselves."""
    up, down = global_curves[UP][0], global_curves[DOWN][0]
    k = float(level) ** config.gang_hazard_exponent
    if k == 1.0:  # a single node, or the prior off: no model to build
        return {UP: up, DOWN: down}
    unit = PreemptionRiskModel({(UP, POOLED_ZONE, 1): up, (DOWN, POOLED_ZONE, 1): down},
                               config.utc_offset_s, "global curves")
    gang_up, gang_down = gang_curves(up, down, unit.mean_run_s(POOLED_ZONE, 1, UP),
                                     unit.mean_run_s(POOLED_ZONE, 1, DOWN), k)
    return {UP: gang_up, DOWN: gang_down}


def log_likelihood(
    model: PreemptionRiskModel, history: AvailabilityHistory, start_tick: int, end_tick: int,
    spot_nodes: int = 1,
) -> tuple[float, float]:
    """Log-likelihood (per hour at risk) and hours of ticks [start, end) of `history` under the
    model's hazards, runs aged from the model's `run_at_cutoff` when the first run continues it.
    For checking a fit on held-out ticks (e.g. a window after the cutoff)."""
    total = hours = 0.0
    for z, zone in enumerate(history.zones):
        up = history.available[z, start_tick:end_tick] >= spot_nodes
        prior_state, prior_age = model.run_at_cutoff.get((zone, spot_nodes), (None, 0.0))
        age = prior_age if prior_state == (UP if up[0] else DOWN) else 0.0
        for i in range(len(up)):
            state = UP if up[i] else DOWN
            t = history.trace_start_s + (start_tick + i) * history.tick_s
            survive = model.survival(zone, age, history.tick_s, t, spot_nodes, state)
            ended = i + 1 < len(up) and up[i + 1] != up[i]
            total += math.log(max(1e-12, 1.0 - survive)) if ended else math.log(survive)
            hours += history.tick_s / 3600.0
            age = 0.0 if ended else age + history.tick_s
    return (total / hours if hours else 0.0), hours


def folder_histories(folder: str, spot_dir: str | None = None) -> list[AvailabilityHistory]:
    """One history per node shape of a trace folder (raw traces, not scaled)."""
    return [
        history_from_traces(traces)
        for traces in group_by_shape(load_folder(folder, spot_dir)).values()
    ]
