"""The cold-start fast policy: batch scaling, straggler shares and preemption response.

`HeuristicFastPolicy.act` runs inside the training loop every N steps, so it is plain Python on
floats and small tuples (10-25 us a call for 1-8 ranks on the 2-core dev machine;
`benchmarks/controller_overhead.py` measures it). Each part is a registered lever
(`controllers.fast_levers`, the built-ins in `controllers.fast_levers_builtin`) that `act` asks
in order; composing them costs about 1.4x the former inline code (31 -> 44 us a call, 4 ranks,
on a loaded dev machine), a few microseconds at a tick every N steps of ~100 ms.
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
from collections.abc import Iterable
from dataclasses import dataclass, field

# Importing the built-ins registers them (batch 10, stragglers 20, preemption 30).
import controllers.fast_levers_builtin  # noqa: F401
from controllers.batch_scaling import BatchScalingConfig
from controllers.fast_levers import (
    FastLever,
    action_with,
    fold_proposal,
    keep_everything,
    registered_levers,
)
from controllers.fast_types import FastAction, FastObservation, PreemptionResponse
from controllers.stragglers import StragglerConfig
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

    The decisions are the registered levers' (`controllers.fast_levers`; the three built-ins in
    `controllers.fast_levers_builtin`), asked in order on a valid observation; this class checks
    the observation, folds the proposals into one action and owns the safe fallback, which a
    lever that raises also gets (the loop must never stop on a policy bug).

    Stateful (EMAs of the noise scale, per-rank speeds and the time between decisions, on the
    levers): use one instance per training run. The levers are the ones registered when it is
    built.
    """

    name = "heuristic_fast"

    def __init__(self, config: FastHeuristicConfig | None = None,
                 levers: Iterable[str] | None = None) -> None:
        self.config = config or FastHeuristicConfig()
        self.levers: tuple[FastLever, ...] = tuple(cls(self.config) for cls in registered_levers())
        self._last_good: FastAction | None = None
        if levers:
            self.set_levers(levers)

    def set_levers(self, names: Iterable[str]) -> tuple[str, ...]:
        """Only the registered levers named act from the next tick (the schedule's
        `fast_levers`); a lever kept keeps its state, one switched back on starts afresh.
        Returns the names in force; an unregistered name is refused by name."""
        wanted = set(names)
        known = {cls.name: cls for cls in registered_levers()}
        unknown = wanted - set(known)
        if unknown:
            raise ValueError(f"fast levers {sorted(unknown)} are not registered; registered: "
                             f"{', '.join(sorted(known))}")
        mine = {lever.name: lever for lever in self.levers}
        self.levers = tuple(mine.get(name) or known[name](self.config)
                            for name in known if name in wanted)
        return tuple(lever.name for lever in self.levers)

    def lever(self, name: str) -> FastLever:
        """This policy's instance of the registered lever `name` (its state, for tests)."""
        for lever in self.levers:
            if lever.name == name:
                return lever
        raise KeyError(f"policy has no fast lever {name!r}; it has "
                       f"{[lever.name for lever in self.levers]}")

    def _fallback(self, o: FastObservation, why: str, numbers: dict[str, float]) -> FastAction:
        for lever in self.levers:
            lever.reset(o)
        response = "checkpoint now (notice up)" if o.preemption_notice_s is not None else (
            "continue")
        return safe_fast_action(o, f"fallback: {why}: keep batch, equal shares, {response}",
                                numbers, self._last_good)

    def act(self, observation: FastObservation) -> FastAction:
        o = observation
        cost = o.checkpoint_cost_s
        if cost != cost:  # nan: no checkpoint measured yet, not bad input (see the config)
            o = dataclasses.replace(o, checkpoint_cost_s=self.config.unmeasured_checkpoint_cost_s)
        if not _observation_ok(o):
            bad = bad_observation_fields(o)
            return self._fallback(o, f"bad {', '.join(bad)}", {"bad_fields": float(len(bad))})
        ranks = len(o.rank_step_time_ms)
        # The draft every lever starts from: keep everything (a lever changes only its knobs).
        draft = keep_everything(o.micro_batch_size, o.grad_accum_steps, o.learning_rate, ranks)
        reasons: list[str] = []
        numbers: dict[str, float] = {}
        lever: FastLever | None = None
        try:
            for lever in self.levers:
                draft = fold_proposal(lever, draft, lever.propose(o, draft), reasons, numbers)
        except Exception as error:  # noqa: BLE001 - a lever bug must not stop the training
            name = lever.name if lever is not None else "?"
            return self._fallback(o, f"lever {name!r} failed ({type(error).__name__}: {error})",
                                  {"lever_failed": 1.0})
        action = action_with(draft, {"reason": "; ".join(reasons), "numbers": numbers})
        self._last_good = action
        return action
