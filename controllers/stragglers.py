"""Per-rank work shares proportional to measured throughput, with hysteresis.

In synchronous data parallelism every step waits for the slowest rank, so giving each rank a share
of the global batch proportional to its speed equalises their step times (the speed-proportional
assignment of LB-BSP: Chen et al. SoCC'20, "Semi-Dynamic Load Balancing: Efficient Distributed
Learning in Non-Dedicated Environments"; work re-assignment in FlexRR, Harlap et al. SoCC'16).
AntMan (Xiao et al. OSDI'20) shows the per-worker mini-batch time spread this corrects; its trace
is in ../shared/data/cluster/stragglers.

- Speed of rank i = its share / its step time (share per ms): the measured time already reflects
  the share it was given, so 1/step_time alone would mistake a rank with a big share for a slow
  one. Speeds are smoothed with an EMA.
- Hysteresis: the shares change only when the predicted step time (max_i share_i / speed_i) falls
  by more than `min_gain` (5 % by default); measurement noise then cannot make the shares flap.
- Floor: no rank gets less than `min_share_fraction` of an equal share, so a rank that looked slow
  once keeps being measured and can earn its share back.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from controllers.validation import require_number

_INF = float("inf")


@dataclass(frozen=True)
class StragglerConfig:
    # Weight of the previous speed in the EMA (0 = use the latest step only). 0.9 keeps 5 %
    # per-step timing noise from re-balancing more than a few times in 600 decisions, and still
    # follows the straggler that appears mid-run in the Alibaba job-1 trace.
    ema_beta: float = 0.9
    # Re-balance only when the predicted step time falls by more than this share.
    min_gain: float = 0.05
    # A rank's share never drops below this fraction of the equal share 1/n.
    min_share_fraction: float = 0.25

    def __post_init__(self) -> None:
        require_number("ema_beta", self.ema_beta, maximum=0.9999)
        require_number("min_gain", self.min_gain, maximum=0.999)
        require_number("min_share_fraction", self.min_share_fraction, maximum=1.0)


def proportional_shares(speeds: Sequence[float], min_share: float) -> tuple[float, ...]:
    """Shares proportional to `speeds`, none below `min_share`, summing to 1 (water-filling).

    Ranks that would fall under the floor are pinned at it and the rest is split in proportion
    among the others; repeated until no free rank falls under the floor (at most n rounds).
    """
    n = len(speeds)
    if n == 0:
        raise ValueError("speeds is empty; pass one speed per rank")
    if min_share * n > 1.0 + 1e-12:
        raise ValueError(f"min_share={min_share} times {n} ranks exceeds 1")
    total = sum(speeds)
    if total > 0.0:
        shares = [v / total for v in speeds]
        if min(shares) >= min_share:  # the common case: nobody under the floor
            return tuple(shares)
    pinned = [False] * n
    shares = [0.0] * n
    while True:
        free_mass = 1.0 - min_share * sum(pinned)
        free_speed = sum(s for s, p in zip(speeds, pinned) if not p)
        free_count = n - sum(pinned)
        changed = False
        for i in range(n):
            if pinned[i]:
                shares[i] = min_share
                continue
            share = (free_mass * speeds[i] / free_speed if free_speed > 0
                     else free_mass / free_count)
            if share < min_share:
                pinned[i] = True
                changed = True
            shares[i] = share
        if not changed:
            return tuple(shares)


@dataclass(slots=True)
class ShareDecision:
    shares: tuple[float, ...]
    changed: bool
    predicted_gain: float  # share of step time saved by the proposed shares vs the current ones
    reason: str


class StragglerBalancer:
    """Keeps the shares it handed out and the EMA of each rank's speed; proposes new shares."""

    def __init__(self, config: StragglerConfig | None = None) -> None:
        self.config = config or StragglerConfig()
        self._shares: list[float] = []
        self._speeds: list[float] = []

    @property
    def shares(self) -> tuple[float, ...]:
        return tuple(self._shares)

    def reset(self, num_ranks: int) -> None:
        self._shares = [1.0 / num_ranks] * num_ranks
        self._speeds = []

    def update(self, rank_step_time_ms: Sequence[float]) -> ShareDecision:
        """Fold in one step's per-rank times (each > 0) and decide whether to re-balance.

        A change in the number of ranks (elastic resize) resets to equal shares.
        """
        times = rank_step_time_ms
        n = len(times)
        if n == 0:
            raise ValueError("rank_step_time_ms is empty; pass one time per data-parallel rank")
        if not all(0.0 < t < _INF for t in times):  # False for nan too
            bad = next(t for t in times if not 0.0 < t < _INF)
            raise ValueError(f"rank_step_time_ms has {bad!r}; every time must be finite and > 0")
        if n != len(self._shares):
            self.reset(n)
            if n > 1:
                self._speeds = [s / t for s, t in zip(self._shares, times)]
                return ShareDecision(tuple(self._shares), True, 0.0,
                                     f"{n} ranks (new or resized): equal shares")
        if n == 1:
            return ShareDecision((1.0,), False, 0.0, "one rank: share 1")
        cfg = self.config
        shares = self._shares
        if not self._speeds:
            speeds = [s / t for s, t in zip(shares, times)]
        else:
            beta = cfg.ema_beta
            alpha = 1.0 - beta
            speeds = [beta * v + alpha * s / t for v, s, t in zip(self._speeds, shares, times)]
        self._speeds = speeds
        current_ms = max([s / v for s, v in zip(shares, speeds)])
        proposed = proportional_shares(speeds, cfg.min_share_fraction / n)
        proposed_ms = max([s / v for s, v in zip(proposed, speeds)])
        gain = 1.0 - proposed_ms / current_ms
        if gain > cfg.min_gain:
            self._shares = list(proposed)
            slowest = speeds.index(min(speeds))
            return ShareDecision(proposed, True, gain,
                                 f"re-balance: predicted step {current_ms:.0f}->"
                                 f"{proposed_ms:.0f} ms (-{gain:.0%} > {cfg.min_gain:.0%}), "
                                 f"slowest rank {slowest}")
        return ShareDecision(tuple(shares), False, gain,
                             f"keep shares: gain {gain:.1%} <= {cfg.min_gain:.0%}")
