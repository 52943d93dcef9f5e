"""Preemption risk: how likely a zone's spot capacity is to go (or come back), by zone, by the age
of the current availability run, and by time of day.

A zone's spot availability for a gang that needs `spot_nodes` nodes is an alternating process:
"up" runs (at least that many nodes available) and "down" runs (fewer). The model holds, for each
(state, zone, spot_nodes), a piecewise-constant hazard over the age of the current run, in events
per hour (an up run ends with a preemption, a down run ends with capacity coming back), times a
multiplicative time-of-day factor (proportional hazards, Cox 1972). Everything the policies ask is
computed exactly from those pieces:

- `hazard_per_h(...)`: the rate now;
- `survival(...)`: P(the run outlasts the next `horizon_s`), exp(-integral of the hazard);
- `p_preempt_within(...)`: 1 - survival of an up run;
- `expected_run_s(...)`: E[min(remaining run, horizon)], the integral of the survival;
- `mean_run_s(...)`, `availability_share(...)`: the long-run shape of the process.

The curves are estimated elsewhere (`cloud/risk_fit.py`, which reads the real traces) with the
occurrence/exposure estimator (events / hours at risk per age bin: the maximum-likelihood
piecewise-exponential hazard, the binned form of Kaplan-Meier; Kalbfleisch & Prentice, "The
Statistical Analysis of Failure Time Data", 2002, ch. 4) and shrunk toward pooled curves where a
zone's bins are sparse. This module only evaluates them: it is built from plain tuples and dicts
(`from_dict` / `to_dict`), imports nothing of ours, and has no I/O.

Spot traces are strongly age-dependent: on the real AWS traces most up runs last well under an
hour, but a run that has lasted a few hours tends to last many more (a decreasing hazard), which
is why the age of the run, not just the zone, decides whether a changeover to spot pays.

Time of day: the trace files carry no wall-clock start, so `utc_offset_s` (UTC seconds of the
trace's first tick, modulo a day) defaults to 0 and the hour bins are then hours since the trace's
first tick, modulo 24 h; a daily cycle is still a daily cycle.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

UP = "up"
DOWN = "down"
STATES = (UP, DOWN)
POOLED_ZONE = "*"
DAY_S = 86400.0
# A gang of N spot nodes counts as N ** this many independent single nodes where no curve of its
# own is fitted (`with_gang_levels`, `gang_curves`; 0.23 read off the 4-node folder in
# ../shared/data, where capacity mostly goes in blocks: a 4-node gang's up runs last 0.73x a
# single node's, pooled).
GANG_HAZARD_EXPONENT = 0.23
# Ages beyond which a run's hazard is taken as constant (the last bin is open-ended).
DEFAULT_AGE_EDGES_S = (0.0, 900.0, 1800.0, 3600.0, 7200.0, 14400.0, 28800.0, 57600.0)


@dataclass(frozen=True)
class HazardCurve:
    """One piecewise-constant hazard: `rate_per_h[i]` applies at run ages in
    [age_edges_s[i], age_edges_s[i + 1]) (the last bin is open-ended), multiplied by
    `hour_factor[k]` in the k-th of `len(hour_factor)` equal bins of the day."""

    age_edges_s: tuple[float, ...]
    rate_per_h: tuple[float, ...]
    hour_factor: tuple[float, ...] = (1.0,)
    # The evidence behind the curve (for reports and tests): events seen, hours at risk.
    events: float = 0.0
    exposure_h: float = 0.0

    def __post_init__(self) -> None:
        edges, rates = self.age_edges_s, self.rate_per_h
        if not edges or edges[0] != 0.0:
            raise ValueError(f"age_edges_s must start at 0, got {edges}")
        if any(b <= a for a, b in zip(edges, edges[1:])):
            raise ValueError(f"age_edges_s must increase strictly, got {edges}")
        if len(rates) != len(edges):
            raise ValueError(
                f"rate_per_h needs one rate per age bin ({len(edges)}), got {len(rates)}"
            )
        for name, values in (("rate_per_h", rates), ("hour_factor", self.hour_factor)):
            if not values or any(not (math.isfinite(v) and v >= 0) for v in values):
                raise ValueError(f"{name} must be finite and >= 0, got {values}")
        if rates[-1] <= 0:
            # A zero rate in the open-ended bin would make runs last forever.
            raise ValueError(f"the last age bin's rate must be > 0, got {rates[-1]}")

    @property
    def hour_bins(self) -> int:
        return len(self.hour_factor)

    def to_dict(self) -> dict[str, Any]:
        return {
            "age_edges_s": list(self.age_edges_s),
            "rate_per_h": list(self.rate_per_h),
            "hour_factor": list(self.hour_factor),
            "events": self.events,
            "exposure_h": self.exposure_h,
        }

    @classmethod
    def from_dict(cls, record: Mapping[str, Any]) -> HazardCurve:
        return cls(
            tuple(float(x) for x in record["age_edges_s"]),
            tuple(float(x) for x in record["rate_per_h"]),
            tuple(float(x) for x in record.get("hour_factor", (1.0,))),
            float(record.get("events", 0.0)),
            float(record.get("exposure_h", 0.0)),
        )


def _integrate(
    curve: HazardCurve, age_s: float, phase_s: float, horizon_s: float
) -> tuple[float, float]:
    """(cumulative hazard, expected seconds alive) over the next `horizon_s`, exactly: the hazard
    is constant on each piece between age-bin and hour-bin edges."""
    edges, rates, factors = curve.age_edges_s, curve.rate_per_h, curve.hour_factor
    bin_s = DAY_S / len(factors)
    cum = alive_s = done = 0.0
    age = age_s
    phase = phase_s % DAY_S
    i = bisect.bisect_right(edges, age) - 1
    k = min(int(phase // bin_s), len(factors) - 1)
    while done < horizon_s:
        step = horizon_s - done
        if i + 1 < len(edges):
            step = min(step, edges[i + 1] - age)
        if len(factors) > 1:
            step = min(step, (k + 1) * bin_s - phase)
        step = max(step, 1e-9)
        rate_per_s = rates[i] * factors[k] / 3600.0
        survive = math.exp(-cum)
        if rate_per_s > 0:
            alive_s += survive * -math.expm1(-rate_per_s * step) / rate_per_s
        else:
            alive_s += survive * step
        cum += rate_per_s * step
        done += step
        age += step
        phase += step
        if i + 1 < len(edges) and age >= edges[i + 1] - 1e-9:
            i += 1
        if phase >= (k + 1) * bin_s - 1e-9:
            k += 1
            if k == len(factors):
                k, phase = 0, phase - DAY_S
        if cum > 60.0:  # survival below e^-60: nothing more to add
            break
    return cum, alive_s


class PreemptionRiskModel:
    """Hazards of spot availability runs per (state, zone, spot_nodes), with fallbacks.

    Lookup order for a (state, zone, spot_nodes) curve: the zone's own curve; else the pooled
    curve (`zone="*"`) for those spot_nodes; for spot_nodes without a curve, the nearest larger
    level that has one (needing more nodes is never safer), else the largest. Unknown states or an
    empty model raise ValueError.
    """

    def __init__(
        self,
        curves: Mapping[tuple[str, str, int], HazardCurve],
        utc_offset_s: float = 0.0,
        fitted_on: str = "",
        run_at_cutoff: Mapping[tuple[str, int], tuple[str, float]] | None = None,
    ) -> None:
        if not curves:
            raise ValueError("a PreemptionRiskModel needs at least one hazard curve")
        for state, _zone, nodes in curves:
            if state not in STATES:
                raise ValueError(f"curve state {state!r} must be one of {STATES}")
            if not isinstance(nodes, int) or nodes < 1:
                raise ValueError(f"curve spot_nodes {nodes!r} must be an int >= 1")
        if not math.isfinite(utc_offset_s):
            raise ValueError(f"utc_offset_s={utc_offset_s} must be finite")
        self.curves = dict(curves)
        self.utc_offset_s = float(utc_offset_s)
        # How and on what the curves were estimated (the protocol, in words).
        self.fitted_on = fitted_on
        # State and age (s) of each (zone, spot_nodes) run at the fit's cutoff: the history a
        # policy may start from (it was observed before the window began).
        self.run_at_cutoff = dict(run_at_cutoff or {})
        self._levels: dict[tuple[str, str], list[int]] = {}
        for state, zone, nodes in self.curves:
            self._levels.setdefault((state, zone), []).append(nodes)
        for levels in self._levels.values():
            levels.sort()
        self._cache: dict[tuple, tuple[float, float]] = {}
        self._found: dict[tuple[str, int, str], HazardCurve] = {}

    # Lookup -------------------------------------------------------------------------------------

    def _level(self, state: str, zone: str, spot_nodes: int) -> tuple[str, int] | None:
        levels = self._levels.get((state, zone))
        if not levels:
            return None
        i = bisect.bisect_left(levels, spot_nodes)
        return zone, levels[min(i, len(levels) - 1)]

    def curve(self, zone: str, spot_nodes: int = 1, state: str = UP) -> HazardCurve:
        """The curve used for (zone, spot_nodes, state), after the documented fallbacks."""
        # Asked every tick: answers already found are kept (a plain int, so True is never
        # taken for 1; the key's state was valid when it was stored).
        if type(spot_nodes) is int:
            found_curve = self._found.get((zone, spot_nodes, state))
            if found_curve is not None:
                return found_curve
        if state not in STATES:
            raise ValueError(f"state {state!r} must be one of {STATES}")
        if isinstance(spot_nodes, bool) or not isinstance(spot_nodes, int) or spot_nodes < 1:
            raise ValueError(f"spot_nodes={spot_nodes!r} must be an int >= 1")
        found = self._level(state, zone, spot_nodes) or self._level(
            state, POOLED_ZONE, spot_nodes
        )
        if found is None:
            raise ValueError(
                f"no {state} hazard for zone {zone!r} and no pooled ('*') curve to fall back "
                "on; fit the model with that zone or with a pooled curve"
            )
        found_curve = self.curves[(state, found[0], found[1])]
        if type(spot_nodes) is int:
            self._found[(zone, spot_nodes, state)] = found_curve
        return found_curve

    def has_curve(self, zone: str, spot_nodes: int = 1) -> bool:
        """True when `zone` has its own curves (both states) at some level (no pooled
        fallback needed)."""
        return all(self._level(state, zone, spot_nodes) is not None for state in STATES)

    def _phase_s(self, trace_time_s: float) -> float:
        return (trace_time_s + self.utc_offset_s) % DAY_S

    @staticmethod
    def _check(name: str, value: float) -> float:
        if not (isinstance(value, (int, float)) and math.isfinite(value) and value >= 0):
            raise ValueError(f"{name}={value!r} must be a finite number >= 0")
        return float(value)

    def _integral(
        self, zone: str, age_s: float, horizon_s: float, trace_time_s: float,
        spot_nodes: int, state: str,
    ) -> tuple[float, float]:
        inf = math.inf
        # `_check` only when a value is not plainly a finite float >= 0 (the common case).
        if type(age_s) is not float or not 0.0 <= age_s < inf:
            age_s = self._check("age_s", age_s)
        if type(horizon_s) is not float or not 0.0 <= horizon_s < inf:
            horizon_s = self._check("horizon_s", horizon_s)
        if type(trace_time_s) is not float or not 0.0 <= trace_time_s < inf:
            trace_time_s = self._check("trace_time_s", trace_time_s)
        curve = self.curve(zone, spot_nodes, state)
        phase = self._phase_s(trace_time_s)
        if curve.hour_bins > 1:
            phase = round(phase / 60.0) * 60.0
        # Policies ask the same questions tick after tick: a small memo keeps replays fast.
        key = (id(curve), round(age_s), round(horizon_s), phase if curve.hour_bins > 1 else 0.0)
        hit = self._cache.get(key)
        if hit is None:
            if len(self._cache) > 200_000:
                self._cache.clear()
            hit = _integrate(curve, key[1], phase, key[2])
            self._cache[key] = hit
        return hit

    # Questions ----------------------------------------------------------------------------------

    def hazard_per_h(
        self, zone: str, age_s: float, trace_time_s: float = 0.0, spot_nodes: int = 1,
        state: str = UP,
    ) -> float:
        """Events per hour now for a run of age `age_s` (preemptions for UP, returns for DOWN)."""
        curve = self.curve(zone, spot_nodes, state)
        age_s = self._check("age_s", age_s)
        i = bisect.bisect_right(curve.age_edges_s, age_s) - 1
        phase = self._phase_s(self._check("trace_time_s", trace_time_s))
        k = min(int(phase // (DAY_S / curve.hour_bins)), curve.hour_bins - 1)
        return curve.rate_per_h[i] * curve.hour_factor[k]

    def survival(
        self, zone: str, age_s: float, horizon_s: float, trace_time_s: float = 0.0,
        spot_nodes: int = 1, state: str = UP,
    ) -> float:
        """P(a run now `age_s` old lasts at least `horizon_s` more)."""
        cum, _ = self._integral(zone, age_s, horizon_s, trace_time_s, spot_nodes, state)
        return math.exp(-cum)

    def p_preempt_within(
        self, zone: str, age_s: float, horizon_s: float, trace_time_s: float = 0.0,
        spot_nodes: int = 1,
    ) -> float:
        """P(spot capacity for `spot_nodes` nodes goes within `horizon_s`), given it has been up
        for `age_s`."""
        return 1.0 - self.survival(zone, age_s, horizon_s, trace_time_s, spot_nodes, UP)

    def p_return_within(
        self, zone: str, age_s: float, horizon_s: float, trace_time_s: float = 0.0,
        spot_nodes: int = 1,
    ) -> float:
        """P(capacity comes back within `horizon_s`), given it has been gone for `age_s`."""
        return 1.0 - self.survival(zone, age_s, horizon_s, trace_time_s, spot_nodes, DOWN)

    def expected_run_s(
        self, zone: str, age_s: float, horizon_s: float, trace_time_s: float = 0.0,
        spot_nodes: int = 1, state: str = UP,
    ) -> float:
        """E[min(remaining run, horizon_s)] in seconds for a run now `age_s` old."""
        _, alive = self._integral(zone, age_s, horizon_s, trace_time_s, spot_nodes, state)
        return alive

    def mean_run_s(self, zone: str, spot_nodes: int = 1, state: str = UP,
                   horizon_s: float = 30 * DAY_S) -> float:
        """Mean length of a fresh run (time of day averaged out by the day-long bins), capped
        at `horizon_s`."""
        curve = self.curve(zone, spot_nodes, state)
        key = ("mean", id(curve), horizon_s)
        if key in self._cache:
            return self._cache[key][1]
        flat = HazardCurve(curve.age_edges_s, curve.rate_per_h)
        mean_factor = sum(curve.hour_factor) / curve.hour_bins
        if mean_factor > 0:
            flat = HazardCurve(
                curve.age_edges_s, tuple(r * mean_factor for r in curve.rate_per_h)
            )
        self._cache[key] = _integrate(flat, 0.0, 0.0, horizon_s)
        return self._cache[key][1]

    def availability_share(self, zone: str, spot_nodes: int = 1) -> float:
        """Long-run share of time the zone has `spot_nodes` spot nodes: mean up / mean cycle."""
        up = self.mean_run_s(zone, spot_nodes, UP)
        down = self.mean_run_s(zone, spot_nodes, DOWN)
        return up / (up + down)

    def fitted_levels(self, zone: str, state: str = UP) -> tuple[int, ...]:
        """Gang sizes with a curve of their own for (zone, state) (the pool's when the zone has
        none)."""
        return tuple(self._levels.get((state, zone)) or self._levels.get((state, POOLED_ZONE))
                     or ())

    def with_gang_levels(self, levels: Sequence[int], exponent: float = GANG_HAZARD_EXPONENT
                         ) -> PreemptionRiskModel:
        """This model plus curves for gang sizes above the largest fitted one, per zone.

        A gang of N spot nodes runs only whole: it is up while all N are. Fitted levels come
        from the recorded counts (a 4-node trace gives the 4-node gang's own curve). Above the
        largest fitted level L, a gang of N is m = N / L groups of L. Independent groups would
        end up runs m times as fast (survival S_L^m); real capacity goes in blocks, so the
        groups count as k = m^rho: rho is read from the zone's own fitted levels when it has
        several (mean up run of level 1 vs level L: S_L = S_1^(L^rho)), else `exponent` (0.23:
        on the 4-node folder a 4-node gang's up runs last 0.73x a single node's, pooled). Its
        long-run share is a^k (a: the group's share), so its down spells are
        mean_up / k x (1 - a^k) / a^k long, the down hazard scaled to match. (`curve()` alone
        reads the largest level's curve: a 16-node gang priced as if 1 node had to stay up.)
        Levels already fitted are left as they are."""
        curves = dict(self.curves)
        zones = {zone for _, zone, _ in self.curves}
        added = False
        for zone in zones:
            top = max(self._levels.get((UP, zone), ()) or (0,))
            top_down = max(self._levels.get((DOWN, zone), ()) or (0,))
            top = min(top, top_down)
            if top < 1:
                continue
            up_curve, down_curve = self.curves[(UP, zone, top)], self.curves[(DOWN, zone, top)]
            up_s, down_s = self.mean_run_s(zone, top, UP), self.mean_run_s(zone, top, DOWN)
            rho = exponent
            if top > 1 and (UP, zone, 1) in self.curves:
                ratio = self.mean_run_s(zone, 1, UP) / up_s
                rho = min(1.0, max(0.0, math.log(max(ratio, 1.0)) / math.log(top)))
            for level in sorted(set(levels)):
                if level <= top or (UP, zone, level) in curves:
                    continue
                curves[(UP, zone, level)], curves[(DOWN, zone, level)] = gang_curves(
                    up_curve, down_curve, up_s, down_s, (level / top) ** rho)
                added = True
        if not added:
            return self
        return PreemptionRiskModel(
            curves, self.utc_offset_s,
            f"{self.fitted_on}; gangs above the fitted levels: independent groups",
            self.run_at_cutoff)

    # Serialization ------------------------------------------------------------------------------

    def to_dict(self) -> dict[str, Any]:
        return {
            "utc_offset_s": self.utc_offset_s,
            "fitted_on": self.fitted_on,
            "curves": [
                {"state": s, "zone": z, "spot_nodes": n, **c.to_dict()}
                for (s, z, n), c in sorted(self.curves.items())
            ],
            "run_at_cutoff": [
                {"zone": z, "spot_nodes": n, "state": st, "age_s": age}
                for (z, n), (st, age) in sorted(self.run_at_cutoff.items())
            ],
        }

    @classmethod
    def from_dict(cls, record: Mapping[str, Any]) -> PreemptionRiskModel:
        """Reads back `to_dict`; a missing key raises ValueError naming it."""
        if "curves" not in record:
            raise ValueError("risk model record lacks 'curves'; expected a dict from to_dict()")
        curves = {
            (c["state"], c["zone"], int(c["spot_nodes"])): HazardCurve.from_dict(c)
            for c in record["curves"]
        }
        run_at_cutoff = {
            (r["zone"], int(r["spot_nodes"])): (r["state"], float(r["age_s"]))
            for r in record.get("run_at_cutoff", [])
        }
        return cls(curves, float(record.get("utc_offset_s", 0.0)),
                   str(record.get("fitted_on", "")), run_at_cutoff)

    @classmethod
    def constant(
        cls, mean_up_s: float, mean_down_s: float, zones: Sequence[str] = (POOLED_ZONE,),
        spot_nodes: int = 1, fitted_on: str = "constant prior",
    ) -> PreemptionRiskModel:
        """A memoryless model (exponential runs) with the given means: the uninformed prior."""
        for name, value in (("mean_up_s", mean_up_s), ("mean_down_s", mean_down_s)):
            if not (math.isfinite(value) and value > 0):
                raise ValueError(f"{name}={value} must be a positive number of seconds")
        curves = {}
        for zone in zones:
            for state, mean_s in ((UP, mean_up_s), (DOWN, mean_down_s)):
                curves[(state, zone, spot_nodes)] = HazardCurve((0.0,), (3600.0 / mean_s,))
        return cls(curves, fitted_on=fitted_on)


def gang_curves(up_curve: HazardCurve, down_curve: HazardCurve, mean_up_s: float,
                mean_down_s: float, k: float) -> tuple[HazardCurve, HazardCurve]:
    """(up, down) curves of a gang that counts as `k` independent copies of the unit whose
    curves and mean runs are given: up runs end k times as fast (survival S^k), and the long-run
    share falls to a^k (a: the unit's share), so down spells last mean_up / k x (1 - a^k) / a^k
    and the down hazard is scaled to match. k = 1 returns the unit's curves unchanged."""
    if k == 1.0:
        return up_curve, down_curve
    share = mean_up_s / (mean_up_s + mean_down_s)
    gang_share = max(share ** k, 1e-9)
    gang_down_s = mean_up_s / k * (1.0 - gang_share) / gang_share
    return (scaled_curve(up_curve, k),
            scaled_curve(down_curve, mean_down_s / max(gang_down_s, 1e-9)))


def scaled_curve(curve: HazardCurve, factor: float) -> HazardCurve:
    """`curve` with every age bin's rate times `factor` (time of day kept)."""
    return HazardCurve(curve.age_edges_s, tuple(r * factor for r in curve.rate_per_h),
                       curve.hour_factor, curve.events, curve.exposure_h)


def observed_reclaim_risk(reclaims: int, observed_s: float, spot_nodes: int,
                    horizon_s: float = 600.0) -> float:
    """P(a reclaim within `horizon_s`) from the run's observed hazard (Poisson): reclaims per
    second of training seen so far, with half a reclaim added while none has been seen (a spot
    run that was not reclaimed yet is not risk-free). On-demand only: 0."""
    if spot_nodes <= 0:
        return 0.0
    count = reclaims if reclaims > 0 else 0.5
    hazard_per_s = count / max(observed_s, horizon_s)
    return float(1.0 - math.exp(-hazard_per_s * horizon_s))
