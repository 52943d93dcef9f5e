"""The cold-start fast policy: batch scaling, straggler shares and preemption response.

`HeuristicFastPolicy.act` runs inside the training loop every N steps, so it is plain Python on
floats and small tuples (10-25 us a call for 1-8 ranks on the 2-core dev machine;
`benchmarks/controller_overhead.py` measures it).
Each part has its reference in its own module:

- batch: `controllers.batch_scaling` (gradient noise scale, McCandlish et al. 2018; learning rate
  by the square-root rule for Adam or the linear rule for SGD);
- shares: `controllers.stragglers` (speed-proportional shares with hysteresis);
- preemption: `controllers.checkpointing.should_checkpoint_on_notice`, then
  - no notice, last checkpoint older than Young's interval for the risk's MTBF -> CHECKPOINT_NOW
    (the risk is P(preemption within `risk_horizon_s`) from the hazard model; under a Poisson
    model M = -H / ln(1 - risk), and Young's T = sqrt(2 C M) with C the measured save cost: the
    riskier the market, the older a checkpoint may grow before saving pays; risk 0 never fires)
  - no notice otherwise                                  -> CONTINUE
  - a checkpoint can finish within the notice and the last one is too old for the notice to cover
    (or the next decision would come too late)           -> CHECKPOINT_NOW
  - a checkpoint can finish but the last one is recent   -> CONTINUE (decide again next tick)
  - the notice is too short for a checkpoint to finish   -> MIGRATE: a torn checkpoint is
    worthless, so the loop stops now and the job moves to a replacement node, resuming from the
    last complete checkpoint (the replacement starts launching during the notice instead of after
    the kill, as Parcae, Duan et al. NSDI'24, migrates ahead of preemptions); the work since that
    checkpoint is lost either way and is reported in the numbers.

The gradient noise scale is an estimate, not a measurement: NaN ("not yet estimated" in the
contract), a negative value or infinity (the ratio of two noisy EMAs can be either) keep the
batch and are named in the reason; the rest of the action is decided as usual.

Safe fallback (any other observation field NaN, infinite, negative or out of range): keep
micro-batch, gradient accumulation and learning rate as they are (an invalid one: the last good
action's value, see `safe_fast_action`), equal shares, CHECKPOINT_NOW if a notice is present
(whatever its value: without trustworthy numbers, saving is the safe side), CONTINUE otherwise.
The reason starts with "fallback:" and names the bad fields; the smoothing state is not fed the
bad values.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

from controllers.batch_scaling import (
    BatchScaler,
    BatchScalingConfig,
    scale_learning_rate,
    split_global_batch,
)
from controllers.checkpointing import (
    mtbf_from_risk_s,
    should_checkpoint_on_notice,
    young_interval_s,
)
from controllers.fast_types import FastAction, FastObservation, PreemptionResponse
from controllers.stragglers import StragglerBalancer, StragglerConfig
from controllers.validation import number_problem

_INF = math.inf


@dataclass(frozen=True)
class FastHeuristicConfig:
    batch: BatchScalingConfig = field(default_factory=BatchScalingConfig)
    stragglers: StragglerConfig = field(default_factory=StragglerConfig)
    # Seconds kept free at the end of a notice when judging whether a checkpoint can finish.
    notice_safety_margin_s: float = 5.0
    # Weight of the previous value in the EMA of the time between decisions.
    tick_ema_beta: float = 0.8
    # The trainer measures the noise scale from the micro-batches of one accumulation (small =
    # micro-batch, big = accumulated batch; McCandlish et al. App. A), so with one step there is
    # no estimate and the batch cannot move. 2 splits a single-step batch to keep the estimate
    # alive, at the price of smaller micro-batches on every step: in the end-to-end benchmark
    # that made trainwise's steps about 13% slower (more billed time) for an estimate that, with
    # the starting batch as the floor, can only grow the batch, which a step budget pays for and
    # does not need. 1 (default): the batch moves only where the run already gives two batch
    # sizes (gradient accumulation >= 2, or DDP ranks).
    min_grad_accum_steps: int = 1
    # Checkpoint cost assumed until the trainer has measured one (it sends nan before its first
    # checkpoint). Conservative: a long assumed save makes the notice rule act earlier.
    unmeasured_checkpoint_cost_s: float = 30.0
    # The horizon the observation's preemption_risk is stated for (the slow layer's
    # SlowObservation.risk_horizon_s, training.live_control.RISK_HORIZON_S).
    risk_horizon_s: float = 600.0
    # Never halve the global batch below the one the run started with. Training runs to a step
    # budget (`max_steps`), so a smaller batch means fewer samples seen, and quality is a hard
    # constraint: in the end-to-end benchmark an early noise-scale estimate (B_noise 2) halved
    # 16 to 8 and the run ended 2.5-3% above the fixed schedule's eval loss. Growing the batch
    # adds samples and stays allowed. False: the batch config's `min_global_batch` is the floor.
    keep_start_batch_floor: bool = True


def _observation_ok(o: FastObservation) -> bool:
    """True when every field is usable; chained comparisons are False for NaN (the fast check)."""
    try:
        notice = o.preemption_notice_s
        times = o.rank_step_time_ms
        return bool(
            o.step >= 0 and 0.0 <= o.elapsed_s < _INF and 0.0 <= o.train_loss < _INF
            and 0.0 <= o.grad_norm < _INF and isinstance(o.grad_noise_scale, (int, float))
            and o.micro_batch_size >= 1 and o.grad_accum_steps >= 1
            and 0.0 <= o.learning_rate < _INF and o.dataloader_queue_depth >= 0
            and (notice is None or 0.0 <= notice < _INF) and 0.0 <= o.preemption_risk <= 1.0
            and 0.0 <= o.seconds_since_checkpoint < _INF and 0.0 <= o.checkpoint_cost_s < _INF
            and times and all(0.0 < t < _INF for t in times)
        )
    except TypeError:  # a None or a string where a number belongs
        return False


def bad_observation_fields(o: FastObservation) -> list[str]:
    """One description per unusable field ("grad_norm=nan", "rank_step_time_ms[2]=-1"...)."""
    problems = [
        number_problem("step", o.step),
        number_problem("elapsed_s", o.elapsed_s),
        number_problem("train_loss", o.train_loss),
        number_problem("grad_norm", o.grad_norm),
        number_problem("micro_batch_size", o.micro_batch_size, minimum=1),
        number_problem("grad_accum_steps", o.grad_accum_steps, minimum=1),
        number_problem("learning_rate", o.learning_rate),
        number_problem("dataloader_queue_depth", o.dataloader_queue_depth),
        number_problem("preemption_risk", o.preemption_risk, maximum=1.0),
        number_problem("seconds_since_checkpoint", o.seconds_since_checkpoint),
        number_problem("checkpoint_cost_s", o.checkpoint_cost_s),
    ]
    gns = o.grad_noise_scale
    if isinstance(gns, bool) or not isinstance(gns, (int, float)):
        problems.append(f"grad_noise_scale={gns!r} is not a number")
    if o.preemption_notice_s is not None:
        problems.append(number_problem("preemption_notice_s", o.preemption_notice_s))
    times = o.rank_step_time_ms
    if not times:
        problems.append("rank_step_time_ms is empty")
    else:
        problems += [number_problem(f"rank_step_time_ms[{i}]", t, strictly_positive=True)
                     for i, t in enumerate(times)]
    return [p for p in problems if p is not None]


def _valid_count(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


def _valid_rate(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and (
        0.0 <= value < _INF)


def safe_fast_action(observation: FastObservation, reason: str,
                     numbers: dict[str, float] | None = None,
                     last_good: FastAction | None = None) -> FastAction:
    """The documented safe action: keep batch and lr, equal shares, checkpoint if a notice is up.

    "Keep" takes the observation's micro-batch, accumulation and learning rate when they are
    valid; an invalid one is replaced by the last good action's value, else by 1 (micro-batch,
    accumulation) or 0.0 (learning rate: no update is safer than a NaN one).
    """
    micro = observation.micro_batch_size
    accum = observation.grad_accum_steps
    lr = observation.learning_rate
    if not _valid_count(micro):
        micro = last_good.micro_batch_size if last_good is not None else 1
    if not _valid_count(accum):
        accum = last_good.grad_accum_steps if last_good is not None else 1
    if not _valid_rate(lr):
        lr = last_good.learning_rate if last_good is not None else 0.0
    ranks = max(1, len(observation.rank_step_time_ms or ()))
    notice = observation.preemption_notice_s
    response = PreemptionResponse.CONTINUE if notice is None else PreemptionResponse.CHECKPOINT_NOW
    return FastAction(
        micro_batch_size=micro,
        grad_accum_steps=accum,
        learning_rate=float(lr),
        rank_work_shares=tuple(1.0 / ranks for _ in range(ranks)),
        preemption_response=response,
        reason=reason,
        numbers=numbers if numbers is not None else {},
    )


class HeuristicFastPolicy:
    """Batch from the noise scale, shares from throughput, checkpoint/migrate on notices.

    Stateful (EMAs of the noise scale, per-rank speeds and the time between decisions): use one
    instance per training run.
    """

    name = "heuristic_fast"

    def __init__(self, config: FastHeuristicConfig | None = None) -> None:
        self.config = config or FastHeuristicConfig()
        self._batch = BatchScaler(self.config.batch)
        self._balancer = StragglerBalancer(self.config.stragglers)
        self._last_elapsed_s: float | None = None
        self._tick_s = 0.0  # EMA of the seconds between decisions (0 until two decisions)
        self._last_good: FastAction | None = None
        self._start_global: int | None = None  # the run's batch at the first valid decision

    def act(self, observation: FastObservation) -> FastAction:
        o = observation
        cost = o.checkpoint_cost_s
        if cost != cost:  # nan: no checkpoint measured yet, not bad input (see the config)
            o = dataclasses.replace(o, checkpoint_cost_s=self.config.unmeasured_checkpoint_cost_s)
        if not _observation_ok(o):
            bad = bad_observation_fields(o)
            self._balancer.reset(max(1, len(o.rank_step_time_ms or ())))
            response = "checkpoint now (notice up)" if o.preemption_notice_s is not None else (
                "continue")
            return safe_fast_action(
                o, f"fallback: bad {', '.join(bad)}: keep batch, equal shares, {response}",
                {"bad_fields": float(len(bad))}, self._last_good)
        cfg = self.config
        # Time between decisions, for the notice's "would the next decision be too late" test.
        if self._last_elapsed_s is not None and o.elapsed_s > self._last_elapsed_s:
            delta = o.elapsed_s - self._last_elapsed_s
            beta = cfg.tick_ema_beta
            self._tick_s = (delta if self._tick_s == 0.0
                            else beta * self._tick_s + (1 - beta) * delta)
        self._last_elapsed_s = o.elapsed_s

        # 1. Batch scale and learning rate.
        times = o.rank_step_time_ms
        ranks = len(times)
        current_global = o.micro_batch_size * o.grad_accum_steps * ranks
        if self._start_global is None:
            self._start_global = current_global
        batch = self._batch.update(o.grad_noise_scale, current_global)
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

        # 2. Straggler shares.
        shares = self._balancer.update(times)

        # 3. Preemption response.
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
            "grad_noise_scale": o.grad_noise_scale,
            "b_noise_ema": batch.b_noise_ema,
            "global_batch_before": float(current_global),
            "global_batch": float(new_global),
            "learning_rate": lr,
            "share_gain": shares.predicted_gain,
            "max_step_ms": max(times),
            "min_step_ms": min(times),
            "dataloader_queue_depth": float(o.dataloader_queue_depth),
            "preemption_risk": o.preemption_risk,
            "risk_checkpoint_interval_s": risk_interval_s,
            "seconds_since_checkpoint": o.seconds_since_checkpoint,
            "checkpoint_cost_s": o.checkpoint_cost_s,
        }
        if notice is not None:
            numbers["preemption_notice_s"] = notice
        action = FastAction(
            micro_batch_size=micro,
            grad_accum_steps=accum,
            learning_rate=lr,
            rank_work_shares=shares.shares,
            preemption_response=response,
            reason=f"{batch_reason}; {shares.reason}; {preempt_reason}",
            numbers=numbers,
        )
        self._last_good = action
        return action
