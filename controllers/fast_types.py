"""Fast-layer observation and action: what the training loop hands the fast policy every N steps.

These types are the contract between `training/` (which fills the observation and applies the
action) and `controllers/` (which decides). Units are in the field names.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Protocol


class PreemptionResponse(enum.Enum):
    CONTINUE = "continue"
    CHECKPOINT_NOW = "checkpoint_now"
    MIGRATE = "migrate"


@dataclass(frozen=True)
class FastObservation:
    """What the loop knows at a fast tick. Every field is measured, none is estimated by the loop."""

    step: int
    elapsed_s: float
    train_loss: float
    grad_norm: float
    # Gradient noise scale B_simple (McCandlish et al. 2018); nan when not yet estimated.
    grad_noise_scale: float
    micro_batch_size: int
    grad_accum_steps: int
    learning_rate: float
    # Per-rank wall time of the last step, one entry per data-parallel rank.
    rank_step_time_ms: tuple[float, ...]
    dataloader_queue_depth: int
    # Seconds until the announced preemption; None when no notice is pending.
    preemption_notice_s: float | None
    # Probability of a preemption in the next slow interval, from the risk model (0..1).
    preemption_risk: float
    seconds_since_checkpoint: float
    # Seconds the last checkpoint took to write; nan until the first one has been measured.
    checkpoint_cost_s: float


@dataclass(frozen=True)
class FastAction:
    """What the fast policy asks of the loop; the loop applies it before the next step."""

    micro_batch_size: int
    grad_accum_steps: int
    learning_rate: float
    # Share of each global batch given to each rank (sums to 1).
    rank_work_shares: tuple[float, ...]
    preemption_response: PreemptionResponse = PreemptionResponse.CONTINUE
    reason: str = ""
    numbers: dict[str, float] = field(default_factory=dict)
    # Knobs beyond the fields above, one per registered lever that controls one
    # (`controllers.fast_levers`): lever name -> value, applied by that lever's `apply`. Empty:
    # every such knob stays as it is. Last with a default, so positional construction (rl/)
    # keeps working.
    extras: Mapping[str, float | int | str] = field(default_factory=dict)


class FastPolicy(Protocol):
    """A fast policy is a pure function of the observation (no I/O)."""

    name: str

    def act(self, observation: FastObservation) -> FastAction: ...


class NoOpFastPolicy:
    """Keeps everything as it is; the cold-start default before the controller is configured."""

    name = "noop"

    def act(self, observation: FastObservation) -> FastAction:
        ranks = max(1, len(observation.rank_step_time_ms))
        return FastAction(
            micro_batch_size=observation.micro_batch_size,
            grad_accum_steps=observation.grad_accum_steps,
            learning_rate=observation.learning_rate,
            rank_work_shares=tuple(1.0 / ranks for _ in range(ranks)),
            reason="no-op policy: keep batch, learning rate and shares",
        )
