"""The heuristic fast policy's three built-in levers: batch, straggler shares, preemption.

Each is a registered `controllers.fast_levers.FastLever`; `HeuristicFastPolicy.act` asks them in
order (batch 10, stragglers 20, preemption 30) and joins their reasons with "; ". What each
decides, and its references, is in `controllers.fast_heuristic`'s docstring; the code moved here
unchanged (same floats, same reason text: the lever split is a refactor, not a new policy).
`config` is the policy's `FastHeuristicConfig` (not imported: `fast_heuristic` imports this
module, and the registry must not run in a circle).
"""

from __future__ import annotations

import dataclasses
import math
from typing import TYPE_CHECKING

from controllers.batch_scaling import BatchScaler, scale_learning_rate, split_global_batch
from controllers.checkpointing import (
    mtbf_from_risk_s,
    should_checkpoint_on_notice,
    young_interval_s,
)
from controllers.fast_levers import FastLever, LeverProposal, register_lever
from controllers.fast_types import FastAction, FastObservation, PreemptionResponse
from controllers.stragglers import StragglerBalancer

if TYPE_CHECKING:
    from controllers.fast_heuristic import FastHeuristicConfig


@register_lever("batch_scaling", order=10)
class BatchScalingLever(FastLever):
    """Global batch from the gradient noise scale, learning rate by the scaling rule."""

    config: FastHeuristicConfig

    def __init__(self, config: FastHeuristicConfig) -> None:
        super().__init__(config)
        self.scaler = BatchScaler(config.batch)  # public: tests read its EMA
        self._start_global: int | None = None  # the run's batch at the first valid decision

    def propose(self, observation: FastObservation, draft: FastAction) -> LeverProposal:
        o, cfg = observation, self.config
        ranks = len(o.rank_step_time_ms)
        current_global = o.micro_batch_size * o.grad_accum_steps * ranks
        if self._start_global is None:
            self._start_global = current_global
        batch = self.scaler.update(o.grad_noise_scale, current_global)
        micro, accum, lr = o.micro_batch_size, o.grad_accum_steps, o.learning_rate
        new_global = current_global
        batch_reason = batch.reason
        if (cfg.keep_start_batch_floor and batch.direction < 0
                and batch.global_batch < self._start_global):
            # The scaler's text names the halving it proposed ("batch 32->16"); say it was not done.
            batch_reason = (f"{batch_reason.replace('->', ' would halve to ')}; kept at "
                            f"{current_global}: not below the run's starting batch "
                            f"{self._start_global}, with a step budget fewer samples would cost "
                            "quality")
            batch = dataclasses.replace(batch, direction=0, global_batch=current_global)
        if batch.direction != 0:
            # A run that measures its noise scale through accumulation keeps measuring it.
            accum_floor = max(cfg.min_grad_accum_steps, min(2, o.grad_accum_steps))
            micro, accum = split_global_batch(batch.global_batch, ranks,
                                              cfg.batch.max_micro_batch_size, accum_floor)
            new_global = micro * accum * ranks
            lr = scale_learning_rate(lr, current_global, new_global, cfg.batch.lr_rule,
                                     cfg.batch.max_learning_rate)
        elif accum < cfg.min_grad_accum_steps and micro * accum >= cfg.min_grad_accum_steps:
            # Same global batch, split so the noise scale can be measured (lr unchanged).
            micro, accum = split_global_batch(current_global, ranks,
                                              cfg.batch.max_micro_batch_size,
                                              cfg.min_grad_accum_steps)
            if micro * accum * ranks != current_global:  # no exact split: keep as it is
                micro, accum = o.micro_batch_size, o.grad_accum_steps
            else:
                batch_reason += (f", split into {accum} accumulation steps to measure the noise "
                                 "scale")
        return LeverProposal(
            changes={"micro_batch_size": micro, "grad_accum_steps": accum, "learning_rate": lr},
            reason=batch_reason,
            numbers={
                "grad_noise_scale": o.grad_noise_scale,
                "b_noise_ema": batch.b_noise_ema,
                "global_batch_before": float(current_global),
                "global_batch": float(new_global),
                "learning_rate": lr,
            },
        )


@register_lever("straggler_shares", order=20)
class StragglerSharesLever(FastLever):
    """Per-rank work shares proportional to measured speed, with hysteresis."""

    config: FastHeuristicConfig

    def __init__(self, config: FastHeuristicConfig) -> None:
        super().__init__(config)
        self._balancer = StragglerBalancer(config.stragglers)

    def propose(self, observation: FastObservation, draft: FastAction) -> LeverProposal:
        times = observation.rank_step_time_ms
        shares = self._balancer.update(times)
        return LeverProposal(
            changes={"rank_work_shares": shares.shares},
            reason=shares.reason,
            numbers={
                "share_gain": shares.predicted_gain,
                "max_step_ms": max(times),
                "min_step_ms": min(times),
                "dataloader_queue_depth": float(observation.dataloader_queue_depth),
            },
        )

    def reset(self, observation: FastObservation) -> None:
        # Speeds measured before a bad tick may belong to another gang size: start equal.
        self._balancer.reset(max(1, len(observation.rank_step_time_ms or ())))


@register_lever("preemption", order=30)
class PreemptionResponseLever(FastLever):
    """Checkpoint, migrate or continue: Young's interval for the risk, the notice rule."""

    config: FastHeuristicConfig

    def __init__(self, config: FastHeuristicConfig) -> None:
        super().__init__(config)
        self._last_elapsed_s: float | None = None
        self._tick_s = 0.0  # EMA of the seconds between decisions (0 until two decisions)

    def propose(self, observation: FastObservation, draft: FastAction) -> LeverProposal:
        o, cfg = observation, self.config
        # Time between decisions, for the notice's "would the next decision be too late" test.
        if self._last_elapsed_s is not None and o.elapsed_s > self._last_elapsed_s:
            delta = o.elapsed_s - self._last_elapsed_s
            beta = cfg.tick_ema_beta
            self._tick_s = (delta if self._tick_s == 0.0
                            else beta * self._tick_s + (1 - beta) * delta)
        self._last_elapsed_s = o.elapsed_s

        notice = o.preemption_notice_s
        risk_interval_s = math.inf
        if o.preemption_risk > 0.0 and o.checkpoint_cost_s > 0.0:
            risk_interval_s = young_interval_s(
                o.checkpoint_cost_s, mtbf_from_risk_s(o.preemption_risk, cfg.risk_horizon_s))
        if notice is None and o.seconds_since_checkpoint > risk_interval_s:
            response = PreemptionResponse.CHECKPOINT_NOW
            preempt_reason = (f"no notice, but risk {o.preemption_risk:.2f} within "
                              f"{cfg.risk_horizon_s:.0f}s: last checkpoint "
                              f"{o.seconds_since_checkpoint:.1f}s ago > Young interval "
                              f"{risk_interval_s:.1f}s: checkpoint now")
        elif notice is None:
            response = PreemptionResponse.CONTINUE
            preempt_reason = "no notice"
        else:
            rule = should_checkpoint_on_notice(
                o.seconds_since_checkpoint, notice, o.checkpoint_cost_s,
                safety_margin_s=cfg.notice_safety_margin_s, next_decision_in_s=self._tick_s)
            if rule.checkpoint_now:
                response = PreemptionResponse.CHECKPOINT_NOW
                preempt_reason = rule.reason
            elif not rule.can_finish:
                response = PreemptionResponse.MIGRATE
                preempt_reason = (f"{rule.reason}: migrate now, losing "
                                  f"{o.seconds_since_checkpoint:.0f}s since the last checkpoint")
            else:
                response = PreemptionResponse.CONTINUE
                preempt_reason = rule.reason
        numbers = {
            "preemption_risk": o.preemption_risk,
            "risk_checkpoint_interval_s": risk_interval_s,
            "seconds_since_checkpoint": o.seconds_since_checkpoint,
            "checkpoint_cost_s": o.checkpoint_cost_s,
        }
        if notice is not None:
            numbers["preemption_notice_s"] = notice
        return LeverProposal({"preemption_response": response}, preempt_reason, numbers)
