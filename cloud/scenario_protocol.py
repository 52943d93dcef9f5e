"""Out-of-sample protocols of the scenarios: what a fitted policy may learn from, per window.

Two splits, each reported on its own (issue 9):

- leave-one-collection-out (`LOCO`): a window of collection C is scored with a risk model fitted
  on the OTHER collections of `../shared/data/spot` only. Nothing of C reaches the fit: the
  target handed to `fit_risk_model` carries C's zone names and tick but zero ticks of data, so
  every zone reads the curves pooled from the other collections.
- leave-time-out (`LTO`): a collection's market is cut at `split_tick` (a share of its length);
  the fit reads only ticks [0, split_tick) of that same market (no other collection), and only
  windows starting at or after `split_tick` are scored.

In both, the policy starts a window knowing the state and age of each zone's current run (what a
monitor watching the zone before the window would know: `runs_before`); that is observation of the
past, not fitting, and never reads the window itself.

What is NOT refitted per split: the heuristic's own constants (plan grid, margins, spot shares).
They were chosen in earlier waves by looking at the whole suite, so for trainwise_heuristic the
splits make the risk model out of sample, not its design (the report says so).
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from cloud.risk_fit import AvailabilityHistory, fit_risk_model
from cloud.simulator import Market
from controllers.preemption_risk import DOWN, UP, PreemptionRiskModel

LOCO = "leave_one_collection_out"
LTO = "leave_time_out"
PROTOCOLS = (LOCO, LTO)
# Share of each market's ticks the leave-time-out fit may read; windows start after it.
LTO_FIT_SHARE = 0.5

FitFunction = Callable[..., PreemptionRiskModel]
HistorySource = Callable[[str], Sequence[AvailabilityHistory]]


@dataclass(frozen=True)
class FitSplit:
    """What the fit of one held-out part may read."""

    protocol: str
    # The collection whose windows are scored.
    held_out: str
    # Collections read in full as the fit's data (LOCO: every other one; LTO: none).
    fit_collections: tuple[str, ...]
    # LTO: ticks [0, fit_ticks) of the held-out market itself are read; LOCO: 0 (none).
    fit_ticks: int = 0

    def __post_init__(self) -> None:
        if self.protocol not in PROTOCOLS:
            raise ValueError(f"protocol {self.protocol!r} must be one of {PROTOCOLS}")
        if self.held_out in self.fit_collections:
            raise ValueError(
                f"split {self.protocol} holds out {self.held_out!r} but also fits on it; "
                "remove it from fit_collections"
            )
        if self.protocol == LOCO and self.fit_ticks:
            raise ValueError("a leave-one-collection-out split reads no tick of the held-out "
                             f"collection; fit_ticks={self.fit_ticks} must be 0")
        if self.protocol == LTO and (self.fit_ticks < 1 or self.fit_collections):
            raise ValueError("a leave-time-out split fits on ticks [0, fit_ticks >= 1) of the "
                             "held-out collection only; give fit_ticks and no fit_collections")

    def describe(self) -> str:
        if self.protocol == LOCO:
            return (f"{LOCO}: fitted on {', '.join(self.fit_collections) or 'nothing'}; "
                    f"none of {self.held_out}")
        return f"{LTO}: fitted on ticks [0, {self.fit_ticks}) of {self.held_out} only"


def loco_split(held_out: str, collections: Sequence[str]) -> FitSplit:
    if held_out not in collections:
        raise ValueError(f"held-out collection {held_out!r} is not among {list(collections)}")
    return FitSplit(LOCO, held_out, tuple(c for c in collections if c != held_out))


def lto_split_tick(n_ticks: int, window_ticks: int, share: float = LTO_FIT_SHARE) -> int:
    """First tick a leave-time-out window may start at; the fit reads the ticks before it."""
    if not 0.0 < share < 1.0:
        raise ValueError(f"share={share} must be strictly between 0 and 1")
    split = int(n_ticks * share)
    if split < 1 or split + window_ticks > n_ticks:
        raise ValueError(
            f"a {share:.0%} fit share of {n_ticks} ticks leaves no room for a {window_ticks}-tick "
            "window after it; use a longer collection or a smaller share"
        )
    return split


def lto_split(held_out: str, split_tick: int) -> FitSplit:
    return FitSplit(LTO, held_out, (), split_tick)


def fit_for_split(
    split: FitSplit,
    market: Market,
    name: str,
    histories: HistorySource,
    fit: FitFunction | None = None,
) -> PreemptionRiskModel:
    """The risk model of `split` for `market` (all zones of the held-out collection and shape).

    Only what the split allows is handed to `fit` (default `fit_risk_model`, looked up at call
    time so a test can watch it): LOCO, a zero-tick target (zone names only) plus the other
    collections' histories; LTO, the market's ticks before the split and no prior.
    """
    fit = fit or fit_risk_model
    zones = market.zones
    capacity = max(1, int(market.spot_available.max()))
    if split.protocol == LOCO:
        seen = np.zeros((len(zones), 0), dtype=market.spot_available.dtype)
        prior = [h for c in split.fit_collections for h in histories(c)]
        cutoff = 0
    else:
        if split.fit_ticks > market.n_ticks:
            raise ValueError(f"split at tick {split.fit_ticks} is past the market's "
                             f"{market.n_ticks} ticks")
        seen = market.spot_available[:, : split.fit_ticks].copy()
        prior = []
        cutoff = split.fit_ticks
    target = AvailabilityHistory(name, zones, float(market.tick_s), seen, capacity,
                                 market.trace_start_s)
    model = fit(target, cutoff, prior)
    model.fitted_on = f"{split.describe()} | {model.fitted_on}"
    return model


def runs_before(market: Market, start_tick: int, levels: Sequence[int]
                ) -> dict[tuple[str, int], tuple[str, float]]:
    """(zone, level) -> (state, age s) of the run in progress at `start_tick`, from the ticks
    before it (a run reaching back to tick 0 counts from tick 0). Empty at tick 0."""
    found: dict[tuple[str, int], tuple[str, float]] = {}
    if start_tick <= 0:
        return found
    for z, zone in enumerate(market.zones):
        past = market.spot_available[z, :start_tick]
        for level in levels:
            up = past >= level
            changes = np.flatnonzero(up[1:] != up[:-1])
            run_start = int(changes[-1]) + 1 if changes.size else 0
            found[(zone, level)] = (UP if up[-1] else DOWN,
                                    float((start_tick - run_start) * market.tick_s))
    return found


def at_window_start(model: PreemptionRiskModel, market: Market, start_tick: int
                    ) -> PreemptionRiskModel:
    """The split's model (shared curves) with the runs in progress at this window's start."""
    levels = range(1, max(1, int(market.spot_available.max())) + 1)
    windowed = copy.copy(model)
    windowed.run_at_cutoff = runs_before(market, start_tick, levels)
    return windowed
