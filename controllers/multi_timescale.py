"""The multi-timescale controller: a fast layer every N steps (or seconds), a slow layer on its own
interval, every decision recorded with its layer, action, reason and numbers.

The same object serves the simulator, the emulated cloud and the real trainer:
- the trainer either calls `on_step(obs)` every step (the controller keeps the cadence) or takes
  the controller as its `FastPolicy` (`name`, `act(obs)`) and keeps the cadence itself;
- the slow driver (Dagster sensor, simulator loop) calls `on_slow_tick(obs, now_s)` as often as it
  likes; the slow layer runs once `slow_every_s` has passed since its last run.

A pending preemption notice cannot wait for the cadence: while one is up, the fast layer runs on
every `on_step` (it costs microseconds). If a policy raises, the controller records the error and
returns the safe action (fast: `fast_heuristic.safe_fast_action`; slow: full data, the last
checkpoint interval, allocation kept; before any slow action, the checkpoint-interval chooser's
answer with nothing measured, `controllers.checkpoint_interval.fallback_choice`) unless
`catch_policy_errors=False`.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from controllers.checkpoint_interval import fallback_choice
from controllers.decisions import Decision, DecisionLog
from controllers.fast_heuristic import safe_fast_action
from controllers.fast_types import FastAction, FastObservation, FastPolicy
from controllers.slow_types import SlowAction, SlowObservation, SlowPolicy
from controllers.validation import require_number


def fast_action_to_dict(action: FastAction) -> dict[str, Any]:
    return {
        "micro_batch_size": action.micro_batch_size,
        "grad_accum_steps": action.grad_accum_steps,
        "learning_rate": action.learning_rate,
        "rank_work_shares": list(action.rank_work_shares),
        "preemption_response": action.preemption_response.value,
    }


def _allocation_to_json(allocation: object | None) -> Any:
    if allocation is None:
        return None
    to_dict = getattr(allocation, "to_dict", None)
    if callable(to_dict):
        return to_dict()
    if dataclasses.is_dataclass(allocation) and not isinstance(allocation, type):
        return dataclasses.asdict(allocation)
    return repr(allocation)


def slow_action_to_dict(action: SlowAction) -> dict[str, Any]:
    return {
        "pruning_rate": action.pruning_rate,
        "pruning_upweight": action.pruning_upweight,
        "checkpoint_interval_s": action.checkpoint_interval_s,
        "allocation": _allocation_to_json(action.allocation),
    }


def _step_or_minus_one(step: object) -> int:
    """The step as an int for the record; -1 when the observation's step is not usable."""
    try:
        return int(step)  # type: ignore[call-overload]
    except (TypeError, ValueError, OverflowError):
        return -1


def _time_or_nan(value: object) -> float:
    try:
        return float(value)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        return float("nan")


class MultiTimescaleController:
    """Runs the fast and the slow policy at their cadences and records every decision."""

    name = "multi_timescale"

    def __init__(self, fast_policy: FastPolicy, slow_policy: SlowPolicy | None,
                 fast_every_steps: int = 10, slow_every_s: float = 300.0,
                 decision_log: DecisionLog | None = None, *, fast_every_s: float | None = None,
                 catch_policy_errors: bool = True,
                 fallback_checkpoint_interval_s: float | None = None) -> None:
        if isinstance(fast_every_steps, bool) or not isinstance(fast_every_steps, int) or (
                fast_every_steps < 1):
            raise ValueError(f"fast_every_steps={fast_every_steps!r} must be an int >= 1")
        self.slow_every_s = require_number("slow_every_s", slow_every_s, strictly_positive=True)
        if fast_every_s is not None:
            require_number("fast_every_s", fast_every_s, strictly_positive=True)
        self.fast_policy = fast_policy
        self.slow_policy = slow_policy
        self.fast_every_steps = fast_every_steps
        self.fast_every_s = fast_every_s
        self.decision_log = decision_log if decision_log is not None else DecisionLog()
        self.catch_policy_errors = catch_policy_errors
        # None: the chooser decides at fall-back time (a swapped rule reaches the fallback too).
        self.fallback_checkpoint_interval_s = None if fallback_checkpoint_interval_s is None else (
            require_number("fallback_checkpoint_interval_s", fallback_checkpoint_interval_s,
                           strictly_positive=True))
        self._last_fast_step: int | None = None
        self._last_fast_elapsed_s = 0.0
        self._last_slow_s: float | None = None
        self.last_fast_action: FastAction | None = None
        self.last_slow_action: SlowAction | None = None

    # Fast layer ---------------------------------------------------------------------------------

    def act(self, observation: FastObservation) -> FastAction:
        """Run the fast policy now and record the decision (the `FastPolicy` protocol)."""
        policy_name = self.fast_policy.name
        try:
            action = self.fast_policy.act(observation)
        except Exception as error:  # a learned or new policy must not stop training
            if not self.catch_policy_errors:
                raise
            action = safe_fast_action(
                observation, f"fallback: fast policy {policy_name} raised "
                             f"{type(error).__name__}: {error}")
        self._last_fast_step = observation.step
        self._last_fast_elapsed_s = observation.elapsed_s
        self.last_fast_action = action
        self.decision_log.record(Decision(
            time_s=_time_or_nan(observation.elapsed_s), step=_step_or_minus_one(observation.step),
            layer="fast",
            policy=policy_name, action=fast_action_to_dict(action), reason=action.reason,
            numbers=action.numbers))
        return action

    def fast_due(self, observation: FastObservation) -> bool:
        if self._last_fast_step is None or observation.preemption_notice_s is not None:
            return True
        if observation.step - self._last_fast_step >= self.fast_every_steps:
            return True
        return self.fast_every_s is not None and (
            observation.elapsed_s - self._last_fast_elapsed_s >= self.fast_every_s)

    def on_step(self, observation: FastObservation) -> FastAction | None:
        """The fast action when the fast layer is due (every N steps/seconds, or a notice is up)."""
        if not self.fast_due(observation):
            return None
        return self.act(observation)

    # Slow layer ---------------------------------------------------------------------------------

    def _safe_slow_action(self, reason: str) -> SlowAction:
        last = self.last_slow_action
        if last is not None:
            interval = last.checkpoint_interval_s
        elif self.fallback_checkpoint_interval_s is not None:
            interval = self.fallback_checkpoint_interval_s
        else:
            choice = fallback_choice()
            interval = choice.interval_s
            reason = f"{reason}; checkpoint every {interval:.0f}s ({choice.rule}: {choice.reason})"
        return SlowAction(pruning_rate=0.0, pruning_upweight=1.0, checkpoint_interval_s=interval,
                          allocation=None, reason=reason,
                          numbers={"checkpoint_interval_s": interval})

    def on_slow_tick(self, observation: SlowObservation, now_s: float) -> SlowAction | None:
        """The slow action when `slow_every_s` has passed since the last one (or on the first)."""
        if self.slow_policy is None:
            return None
        if self._last_slow_s is not None and now_s - self._last_slow_s < self.slow_every_s:
            return None
        policy_name = self.slow_policy.name
        try:
            action = self.slow_policy.act(observation)
        except Exception as error:
            if not self.catch_policy_errors:
                raise
            action = self._safe_slow_action(
                f"fallback: slow policy {policy_name} raised {type(error).__name__}: {error}; "
                "full data, checkpoint interval kept, allocation kept")
        self._last_slow_s = now_s
        self.last_slow_action = action
        self.decision_log.record(Decision(
            time_s=_time_or_nan(now_s), step=_step_or_minus_one(observation.step), layer="slow",
            policy=policy_name,
            action=slow_action_to_dict(action), reason=action.reason, numbers=action.numbers))
        return action
