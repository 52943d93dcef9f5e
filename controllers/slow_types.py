"""Slow-layer observation and action: what the slow policy sees every few minutes and decides.

The slow policy runs in a Dagster sensor (real runs) or in the simulator's loop; both fill a
`SlowObservation` from telemetry and apply the `SlowAction` (the pruning rate goes to the
curriculum, the checkpoint interval to the trainer's control file, the allocation to a provider).
Units are in the field names. Node allocation is typed `object | None` here until
`controllers/allocation_types.py` defines it; the allocation policy fills it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Protocol


@dataclass(frozen=True)
class DataSummary:
    """Composition and difficulty of the training data, from the latest difficulty scores."""

    num_examples: int  # train examples scored
    mean_loss_score: float  # mean per-example loss (the difficulty score), nats
    std_loss_score: float  # standard deviation of the per-example loss, nats
    share_below_mean: float  # share of examples whose score is below the mean (0..1)


@dataclass(frozen=True)
class LossCurve:
    """Model phase: the recent eval losses, oldest first, and how far training has come."""

    eval_losses: tuple[float, ...]  # eval loss at each recent evaluation, nats; may be empty
    eval_steps: tuple[int, ...]  # training step of each evaluation (same length)
    tokens_seen: int  # tokens (or examples for image tasks) trained on so far


@dataclass(frozen=True)
class Progress:
    """Progress against the deadline. Work is counted in tokens (examples for image tasks)."""

    work_done: float
    work_total: float
    elapsed_s: float
    time_left_s: float  # until the deadline; <= 0 means the deadline has passed

    @property
    def fraction_done(self) -> float:
        return self.work_done / self.work_total if self.work_total > 0 else math.nan


@dataclass(frozen=True)
class ClusterSummary:
    """Cluster state as the slow layer sees it, cumulative over the run."""

    nodes: int
    spot_nodes: int
    on_demand_nodes: int
    # Interruptions of the job (spot preemptions and node faults) since the run started.
    preemptions_observed: int
    # Seconds the job has been running and exposed to interruptions since the run started.
    observed_for_s: float
    # Last measured checkpoint cost: seconds the training stalls to write one (nan: not yet).
    checkpoint_cost_s: float
    # P(interruption within risk_horizon_s) from the risk model; None when no model is given.
    preemption_risk: float | None = None
    risk_horizon_s: float = 600.0
    # Of preemptions_observed, those whose notice was long enough for the on-notice checkpoint
    # to complete (nothing lost). Periodic checkpoints need not guard against them, so the
    # Young/Daly interval counts only the others. 0 = count every interruption.
    preemptions_saved_by_notice: int = 0
    # Notice a reclaim gives the trainer (AWS: 120 s). When a save fits in it, reclaims lose
    # nothing and the checkpoint interval insures against node faults only
    # (`controllers/checkpoint_interval.py`). 0: none or unknown, reclaims are taken to lose work.
    notice_s: float = 0.0

    @property
    def mean_time_between_preemptions_s(self) -> float:
        """Observed mean time between interruptions; +inf while none has been observed."""
        if self.preemptions_observed <= 0:
            return math.inf
        return self.observed_for_s / self.preemptions_observed


@dataclass(frozen=True)
class SlowObservation:
    time_s: float  # run clock when observed (simulator or wall time since start)
    step: int  # training step when observed
    data: DataSummary
    loss_curve: LossCurve
    progress: Progress
    cluster: ClusterSummary
    # Prices and availability per zone for the allocation policy (filled by cloud/; opaque here).
    market: object | None = None


@dataclass(frozen=True)
class SlowAction:
    # InfoBatch rate: share of the below-mean (well-learned) examples left out this epoch (0..1).
    pruning_rate: float
    # Loss weight of the kept below-mean examples, 1 / (1 - pruning_rate): unbiased rescaling.
    pruning_upweight: float
    # Seconds of training between periodic checkpoints.
    checkpoint_interval_s: float
    # Node allocation (spot/on-demand counts, zone) from the allocation policy; None: keep as is.
    allocation: object | None = None
    reason: str = ""
    numbers: dict[str, float] = field(default_factory=dict)


class SlowPolicy(Protocol):
    """A slow policy maps the slow observation to an action (no I/O; may keep running estimates)."""

    name: str

    def act(self, observation: SlowObservation) -> SlowAction: ...
