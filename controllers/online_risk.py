"""Online update of a fitted preemption-risk model from the runs a policy sees in its own window.

The risk model (`controllers/preemption_risk.py`) is fitted before a job starts: on other
collections (leave-one-collection-out) or on the market's own past (leave-time-out). A market
that runs hotter or calmer than the fit keeps doing so for a while, and a job of two days sees
dozens of up and down runs of its own zones. This module lets that evidence in, with the
textbook model for it: a shared gamma frailty (Clayton 1978; Vaupel, Manton & Stallard 1979).
Each (state, zone, spot level) has an unknown multiplier Z on the fitted hazard, Z ~ Gamma(k, k)
(mean 1: the fit is right on average; `k` pseudo-events of confidence in it). Given the runs
observed since the window began, with O runs ended and E the events the fitted hazard expected
over the same exposure (run ages and time of day as they were), the posterior mean of Z is
(k + O) / (k + E). The curves keep their shape (age and time-of-day dependence); only their
level moves, and only as far as the evidence carries it.

Only runs whose start was seen count (a run already in progress at the window's first tick
counts when the monitor's history gives its age: `run_at_cutoff`); exposure is what the fitted
curve integrates over each observed interval, so a young run and an old one weigh as the fit
says they should. Everything here uses the past only: the multiplier at time t reads ticks <= t.
Pooled curves ('*', several zones planned as one) get the multiplier of all observed zones
together.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

from controllers.preemption_risk import DOWN, POOLED_ZONE, UP, HazardCurve, PreemptionRiskModel

# A zone's hazard is re-priced (and its plan re-solved) when its multiplier has moved by more
# than this share since the last re-pricing: re-solving on every tick would only chase noise.
DEFAULT_REPRICE_SHARE = 0.05


class ObservedRuns:
    """Events seen and events the fitted model expected, per (state, zone, spot level)."""

    def __init__(self, prior_events: float) -> None:
        if not (math.isfinite(prior_events) and prior_events > 0):
            raise ValueError(f"prior_events={prior_events} must be a positive number "
                             "(pseudo-events of confidence in the fitted model)")
        self.prior_events = float(prior_events)
        self.events: dict[tuple[str, str, int], float] = {}
        self.expected: dict[tuple[str, str, int], float] = {}

    def reset(self) -> None:
        self.events.clear()
        self.expected.clear()

    def expose(self, model: PreemptionRiskModel, zone: str, level: int, up: bool,
               age_s: float, dt_s: float, trace_time_s: float) -> None:
        """A run (state `up`) of known age `age_s` lasted `dt_s` more, from `trace_time_s`."""
        if dt_s <= 0:
            return
        state = UP if up else DOWN
        alive = model.survival(zone, max(0.0, float(age_s)), float(dt_s),
                               max(0.0, float(trace_time_s)), level, state)
        key = (state, zone, level)
        self.expected[key] = self.expected.get(key, 0.0) - math.log(max(alive, 1e-300))

    def end(self, zone: str, level: int, up: bool) -> None:
        """A run of known start ended (a preemption for `up`, a return for down)."""
        key = (UP if up else DOWN, zone, level)
        self.events[key] = self.events.get(key, 0.0) + 1.0

    def multipliers(self) -> dict[tuple[str, str, int], float]:
        """Posterior mean frailty (k + O) / (k + E) per observed key, plus the pooled ('*') one
        per (state, level) over all observed zones."""
        k = self.prior_events
        out: dict[tuple[str, str, int], float] = {}
        pooled: dict[tuple[str, int], list[float]] = {}
        for key, expected in self.expected.items():
            observed = self.events.get(key, 0.0)
            out[key] = (k + observed) / (k + expected)
            total = pooled.setdefault((key[0], key[2]), [0.0, 0.0])
            total[0] += observed
            total[1] += expected
        for (state, level), (observed, expected) in pooled.items():
            out[(state, POOLED_ZONE, level)] = (k + observed) / (k + expected)
        return out


def with_multipliers(model: PreemptionRiskModel,
                     multipliers: Iterable[tuple[tuple[str, str, int], float]]
                     ) -> PreemptionRiskModel:
    """`model` with the curve used for each (state, zone, level) scaled by its multiplier (a
    zone that read the pooled curve gets its own, scaled copy)."""
    curves = dict(model.curves)
    changed = False
    for (state, zone, level), factor in multipliers:
        if not (math.isfinite(factor) and factor > 0):
            raise ValueError(f"frailty multiplier for {(state, zone, level)} must be > 0, "
                             f"got {factor}")
        try:
            base = model.curve(zone, level, state)
        except ValueError:
            continue  # no curve to scale (a pooled key on a model without one)
        curves[(state, zone, level)] = HazardCurve(
            base.age_edges_s, tuple(r * factor for r in base.rate_per_h), base.hour_factor,
            base.events, base.exposure_h)
        changed = True
    if not changed:
        return model
    return PreemptionRiskModel(curves, model.utc_offset_s,
                               f"{model.fitted_on}; updated online (gamma frailty)",
                               model.run_at_cutoff)


def moved(new: dict[tuple[str, str, int], float], used: dict[tuple[str, str, int], float],
          share: float = DEFAULT_REPRICE_SHARE) -> bool:
    """Whether any multiplier moved by more than `share` from the one in use (a new key
    counts as moved from 1)."""
    return any(abs(value / used.get(key, 1.0) - 1.0) > share for key, value in new.items())
