"""Slow-layer node allocation: what a policy sees at a tick and what it asks for.

These types are the contract between whatever runs the cluster (the trace-driven simulator in
`cloud/simulator.py`, the emulated cloud, AWS) and the allocation policies (`cloud/policies.py`,
later the trainwise hazard-aware heuristic and learned policies). A policy is a pure
`act(observation) -> action` object with no I/O, so the simulator, the benchmarks, the trainer and
the tests all call the same code.

Conventions:
- Units are in the field names (`_s` seconds, `_h` hours, `_usd_per_hour`).
- Work is GPU-hours at the job's reference throughput (one rank at the median speed of its peers).
- A job runs as one synchronous data-parallel gang of `node_count` nodes in one zone: an action
  asks for 0 nodes (release everything) or exactly `node_count` nodes, split between spot and
  on-demand. Per-zone tuples are aligned with `zones`.
- Every change of the node set (launch, zone move, spot/on-demand swap, restart after a
  preemption) pauses training for `changeover_s` (launch + restore from the last checkpoint),
  billed on the new nodes.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol


@dataclass(frozen=True, slots=True)
class AllocationObservation:
    """What the slow layer knows at the start of a tick. All times are since the job started."""

    time_s: float
    tick_s: float
    # Seconds since the first tick of the market trace (for time-of-day or trace-age hazards).
    trace_time_s: float
    # Progress so far, including work not yet covered by a checkpoint (lost on a hard failure).
    work_done_h: float
    work_checkpointed_h: float
    work_total_h: float
    # GPU-hours of work gained per wall-clock hour while the full gang runs (after stragglers).
    work_rate_gpu_h_per_h: float
    # The deadline as the runner applies it (the simulator rounds it down to whole ticks).
    deadline_s: float
    changeover_s: float
    checkpoint_save_s: float
    checkpoint_interval_s: float
    notice_s: float
    node_count: int
    zones: tuple[str, ...]
    # The zone the user asked for; single-zone policies stay there.
    home_zone: str
    # Current holding: zone is None when no nodes are held.
    zone: str | None
    spot_nodes: int
    on_demand_nodes: int
    in_changeover: bool
    changeover_left_s: float
    # Zone of the most recent holding (None before the first launch); failover policies use it.
    last_zone: str | None
    # Spot nodes that could be held now, per zone (counts, aligned with `zones`).
    spot_available_by_zone: tuple[int, ...]
    spot_price_usd_per_hour_by_zone: tuple[float, ...]
    on_demand_price_usd_per_hour_by_zone: tuple[float, ...]
    since_checkpoint_s: float
    # Seconds since the current node set was launched; 0 when nothing is held.
    since_launch_s: float
    # Job times (s) of the preemptions seen so far in this job, oldest first.
    preemption_times_s: tuple[float, ...]
    # True when the previous tick's request could not be granted (not enough spot capacity).
    launch_failed: bool

    @property
    def remaining_work_h(self) -> float:
        return max(0.0, self.work_total_h - self.work_done_h)

    @property
    def remaining_run_s(self) -> float:
        """Seconds of full-gang running still needed, not counting checkpoints or changeovers."""
        return self.remaining_work_h / self.work_rate_gpu_h_per_h * 3600.0

    @property
    def time_left_s(self) -> float:
        return self.deadline_s - self.time_s

    @property
    def holding(self) -> bool:
        return self.zone is not None

    def zone_index(self, zone: str) -> int:
        """Position of `zone` in the per-zone tuples; ValueError names the valid zones."""
        try:
            return self.zones.index(zone)
        except ValueError:
            raise ValueError(
                f"zone {zone!r} is not in this market; valid: {', '.join(self.zones)}") from None

    def spot_available(self, zone: str) -> int:
        return self.spot_available_by_zone[self.zone_index(zone)]


@dataclass(frozen=True, slots=True)
class AllocationAction:
    """What the slow layer asks for; the runner applies it at the start of the tick.

    `spot_nodes + on_demand_nodes` is 0 (release all) or the job's `node_count`. Asking for the
    set already held keeps it (no changeover). `checkpoint_interval_s=None` keeps the interval.
    """

    zone: str | None
    spot_nodes: int
    on_demand_nodes: int
    checkpoint_interval_s: float | None = None
    reason: str = ""
    numbers: dict[str, float] = field(default_factory=dict)

    @staticmethod
    def release(reason: str, numbers: dict[str, float] | None = None) -> AllocationAction:
        """Hold no nodes (wait)."""
        return AllocationAction(None, 0, 0, None, reason, numbers or {})

    @property
    def node_total(self) -> int:
        return self.spot_nodes + self.on_demand_nodes


class AllocationPolicy(Protocol):
    """A node allocation policy: a pure function of the observation (no I/O, no clock).

    A policy may keep no hidden state that changes what it does: everything it needs to decide is
    in the observation, so two runs over the same trace make the same decisions.
    """

    name: str

    def act(self, observation: AllocationObservation) -> AllocationAction: ...
