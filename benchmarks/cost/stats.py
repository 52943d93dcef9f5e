"""Window statistics of the cost suite: independent windows, block bootstrap, robustness.

Windows of one collection overlap in time when their starts are closer than a window (the zones of
a collection share the same hours, so windows of different zones at the same time are not
independent either). Two consequences, both stated in the report:

- `independent_windows`: the largest set of pairwise non-overlapping windows, zones ignored
  (greedy interval scheduling over the start ticks, which is optimal for equal lengths), summed
  over collections.
- `block_bootstrap`: the resampling unit is a time block of one window length per collection
  (`time_blocks`: every window, of any zone, whose start falls in it). Windows in adjacent blocks
  can still overlap by less than one window, so the interval is, if anything, a little narrow.
  Percentile interval, seeded, `draws` resamples of as many blocks as the cell has.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

BOOTSTRAP_DRAWS = 2000
BOOTSTRAP_SEED = 20261201
# With 2 blocks a resample takes only 3 distinct values: no interval is given below this many.
MIN_BLOCKS = 3


def independent_windows(starts: Sequence[int], window_ticks: int) -> int:
    """How many of the windows [s, s + window_ticks) can be picked with no two overlapping."""
    if window_ticks < 1:
        raise ValueError(f"window_ticks={window_ticks} must be at least 1")
    count, free_from = 0, None
    for start in sorted(set(int(s) for s in starts)):
        if free_from is None or start >= free_from:
            count += 1
            free_from = start + window_ticks
    return count


def time_blocks(collections: Sequence[str], starts: Sequence[int],
                window_ticks: Sequence[int]) -> np.ndarray:
    """Block index per window: (collection, start // window length), numbered 0..B-1."""
    if not len(collections) == len(starts) == len(window_ticks):
        raise ValueError("collections, starts and window_ticks must have one entry per window")
    keys = [(c, int(s) // int(w)) for c, s, w in zip(collections, starts, window_ticks,
                                                     strict=True)]
    index = {k: i for i, k in enumerate(dict.fromkeys(keys))}
    return np.array([index[k] for k in keys], dtype=np.int64)


@dataclass(frozen=True)
class Interval:
    value: float
    low: float | None  # None: fewer than MIN_BLOCKS blocks, no interval
    high: float | None
    blocks: int

    def as_dict(self) -> dict[str, float | int | None]:
        return {"value": self.value, "low": self.low, "high": self.high, "blocks": self.blocks}


def block_bootstrap(numerator: Sequence[float], denominator: Sequence[float] | None,
                    blocks: Sequence[int], draws: int = BOOTSTRAP_DRAWS,
                    seed: int = BOOTSTRAP_SEED, level: float = 0.95,
                    min_blocks: int = MIN_BLOCKS) -> Interval:
    """sum(numerator) / sum(denominator) over the windows (the mean when `denominator` is None;
    a ratio of means otherwise), with a percentile interval from resampling whole blocks."""
    num = np.asarray(numerator, dtype=float)
    den = np.ones_like(num) if denominator is None else np.asarray(denominator, dtype=float)
    block = np.asarray(blocks, dtype=np.int64)
    if not num.size or num.shape != den.shape or num.shape != block.shape:
        raise ValueError(f"need one numerator, denominator and block per window; got "
                         f"{num.shape}, {den.shape}, {block.shape}")
    value = float(num.sum() / den.sum())
    _, block = np.unique(block, return_inverse=True)
    n_blocks = int(block.max()) + 1
    if n_blocks < max(2, min_blocks):
        return Interval(value, None, None, n_blocks)
    block_num = np.bincount(block, weights=num, minlength=n_blocks)
    block_den = np.bincount(block, weights=den, minlength=n_blocks)
    rng = np.random.default_rng(seed)
    picks = rng.integers(0, n_blocks, size=(draws, n_blocks))
    counts = np.zeros((draws, n_blocks))
    np.add.at(counts, (np.arange(draws)[:, None], picks), 1.0)
    stats = (counts @ block_num) / (counts @ block_den)
    tail = (1.0 - level) / 2.0
    low, high = np.quantile(stats, [tail, 1.0 - tail])
    return Interval(value, float(low), float(high), n_blocks)


def robustness(costs: Sequence[float], on_demand_costs: Sequence[float],
               deadline_met: Sequence[bool], tolerance: float = 1e-6) -> dict[str, float | int]:
    """Per policy over a cell's windows: the worst window (its cost / the on-demand cost of that
    same window), the share of windows costing more than on-demand there, deadline misses."""
    cost = np.asarray(costs, dtype=float)
    reference = np.asarray(on_demand_costs, dtype=float)
    met = np.asarray(deadline_met, dtype=bool)
    if not cost.size or cost.shape != reference.shape or cost.shape != met.shape:
        raise ValueError("need one cost, on-demand cost and deadline flag per window")
    if (reference <= 0).any():
        raise ValueError("on-demand costs must be positive to compare against")
    ratio = cost / reference
    return {
        "windows": int(cost.size),
        "worst_vs_on_demand": float(ratio.max()),
        "costlier_than_on_demand_share": float(np.mean(cost > reference * (1 + tolerance))),
        "deadline_misses": int((~met).sum()),
    }
