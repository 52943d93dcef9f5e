"""The fast-policy hook of `training.loop`: the preemption signal, the observation, the action.

Emulated spot preemption: the emulated provider sends SIGTERM to the trainer, as a real spot
node's shutdown does after AWS's two-minute interruption notice. The handler only records that
the notice arrived (a signal handler must not do work); the loop acts on it at the next step
boundary.
"""

from __future__ import annotations

import dataclasses
import math
import signal
import threading
import time
from types import FrameType
from typing import Any, Self

from controllers.fast_types import FastAction, FastObservation, PreemptionResponse


class PreemptionSignal:
    """Context manager: while active, SIGTERM sets a flag instead of killing the process.

    The handler is only installed from the main thread (Python allows no other); elsewhere the
    flag can still be set with `notify`, and SIGTERM keeps its previous meaning.
    """

    def __init__(self, signals: tuple[signal.Signals, ...] = (signal.SIGTERM,)) -> None:
        self.signals = signals
        self._previous: dict[signal.Signals, Any] = {}
        self.signal_name: str | None = None
        self.received_wall_time_s: float | None = None
        self._received_monotonic: float | None = None

    def __enter__(self) -> Self:
        if threading.current_thread() is threading.main_thread():
            for signum in self.signals:
                self._previous[signum] = signal.signal(signum, self._handle)
        return self

    def __exit__(self, *exc_info: object) -> None:
        for signum, previous in self._previous.items():
            signal.signal(signum, previous)
        self._previous.clear()

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        self.notify(signal.Signals(signum).name)

    def notify(self, signal_name: str) -> None:
        """Records a preemption notice (the first one wins)."""
        if self._received_monotonic is None:
            self.signal_name = signal_name
            self.received_wall_time_s = time.time()
            self._received_monotonic = time.monotonic()

    @property
    def pending(self) -> bool:
        return self._received_monotonic is not None

    def notice_left_s(self, notice_s: float) -> float | None:
        """Seconds left of a `notice_s` notice, None if no notice arrived."""
        if self._received_monotonic is None:
            return None
        return max(0.0, notice_s - (time.monotonic() - self._received_monotonic))


def validate_action(action: FastAction, policy_name: str, world_size: int = 1) -> None:
    """Refuses an action the loop cannot apply, naming the policy and the field."""
    where = f"fast policy {policy_name!r} returned"
    if not isinstance(action, FastAction):
        raise TypeError(f"{where} a {type(action).__name__}; return a FastAction")
    if int(action.micro_batch_size) < 1 or int(action.grad_accum_steps) < 1:
        raise ValueError(
            f"{where} micro_batch_size={action.micro_batch_size}, "
            f"grad_accum_steps={action.grad_accum_steps}; both must be >= 1"
        )
    if not (math.isfinite(action.learning_rate) and action.learning_rate > 0):
        raise ValueError(f"{where} learning_rate={action.learning_rate}; it must be finite and > 0")
    if len(action.rank_work_shares) != world_size or not math.isclose(
        sum(action.rank_work_shares), 1.0, abs_tol=1e-6
    ):
        raise ValueError(
            f"{where} rank_work_shares={action.rank_work_shares}; give {world_size} shares "
            "summing to 1"
        )
    if not isinstance(action.preemption_response, PreemptionResponse):
        raise TypeError(f"{where} preemption_response={action.preemption_response!r}")


def action_record(action: FastAction) -> dict[str, Any]:
    record = dataclasses.asdict(action)
    record["preemption_response"] = action.preemption_response.value
    record["rank_work_shares"] = list(action.rank_work_shares)
    return record


def observation_record(observation: FastObservation) -> dict[str, Any]:
    record = dataclasses.asdict(observation)
    record["rank_step_time_ms"] = list(observation.rank_step_time_ms)
    return record


def build_observation(
    *,
    step: int,
    elapsed_s: float,
    train_loss: float,
    grad_norm: float,
    grad_noise_scale: float,
    micro_batch_size: int,
    grad_accum_steps: int,
    learning_rate: float,
    step_time_ms: float,
    preemption_notice_s: float | None,
    seconds_since_checkpoint: float,
    checkpoint_cost_s: float,
) -> FastObservation:
    return FastObservation(
        step=step,
        elapsed_s=elapsed_s,
        train_loss=train_loss,
        grad_norm=grad_norm,
        grad_noise_scale=grad_noise_scale,
        micro_batch_size=micro_batch_size,
        grad_accum_steps=grad_accum_steps,
        learning_rate=learning_rate,
        rank_step_time_ms=(step_time_ms,),  # one rank until torchrun/DDP lands
        dataloader_queue_depth=0,  # batches are cut from memory synchronously: no queue
        preemption_notice_s=preemption_notice_s,
        preemption_risk=0.0,  # no risk model is wired into the trainer yet
        seconds_since_checkpoint=seconds_since_checkpoint,
        checkpoint_cost_s=checkpoint_cost_s,
    )
