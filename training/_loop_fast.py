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
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType
from typing import Any, Self

from controllers.checkpoint_interval import (
    DEFAULT_MAX_INTERVAL_S,
    CheckpointIntervalTuner,
    CheckpointTunerConfig,
)
from controllers.checkpointing import mtbf_from_risk_s
from controllers.fast_types import FastAction, FastObservation, PreemptionResponse
from controllers.lever_guard import LeverGuard, LeverVerdict, StepCostGuard
from training.live_control import RISK_HORIZON_S, LiveControl, read_live_control

# The loops noting notices in this process, innermost last (`request_stop` tells that one).
_ACTIVE_NOTICES: list[PreemptionSignal] = []


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
        _ACTIVE_NOTICES.append(self)  # first: whoever sees the handler may `request_stop`
        if threading.current_thread() is threading.main_thread():
            for signum in self.signals:
                self._previous[signum] = signal.signal(signum, self._handle)
        return self

    def __exit__(self, *exc_info: object) -> None:
        for signum, previous in self._previous.items():
            signal.signal(signum, previous)
        self._previous.clear()
        if self in _ACTIVE_NOTICES:
            _ACTIVE_NOTICES.remove(self)

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


def request_stop(reason: str) -> None:
    """The stop a SIGTERM asks of the running loop, without a signal: it checkpoints at the
    next step boundary and returns "preempted". For a caller in the same process that holds the
    node (the in-process engine's provider session), so no process signals itself; `reason` is
    what the preemption event records as the notice. Raises RuntimeError when no loop runs."""
    if not _ACTIVE_NOTICES:
        raise RuntimeError(f"request_stop({reason!r}): no training loop is running in this "
                           "process; stop a trainer process by SIGTERM to its pid instead")
    _ACTIVE_NOTICES[-1].notify(reason)


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
    # Extras are applied by their registered lever (controllers.fast_levers): a key no lever
    # applies would be recorded as decided but never honoured.
    from controllers.fast_levers import extras_problems
    problems = extras_problems(action.extras)
    if problems:
        raise ValueError(f"{where} {'; '.join(problems)}")


def action_record(action: FastAction) -> dict[str, Any]:
    record = dataclasses.asdict(action)
    record["preemption_response"] = action.preemption_response.value
    record["rank_work_shares"] = list(action.rank_work_shares)
    # Only an action that turns an extra knob records `extras`: the records of every other
    # action keep their shape (ingestion, dashboards).
    extras = record.pop("extras", None)
    if extras:
        record["extras"] = dict(extras)
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
    preemption_risk: float = 0.0,
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
        # From the live-control file (the slow layer's hazard model); 0.0 until one arrives.
        preemption_risk=preemption_risk,
        seconds_since_checkpoint=seconds_since_checkpoint,
        checkpoint_cost_s=checkpoint_cost_s,
    )


# -- live decisions: the live-control file and the trainer's own checkpoint interval -------------
@dataclass
class LiveDecisions:
    """Rank 0's view of the live-control file (`training.live_control`) and of the checkpoint
    interval in force, polled at fast ticks.

    The interval is kept in seconds (what Young/Daly and the slow layer reason in) and turned into
    steps with the measured wall seconds per step, re-measured every tick: a step that slows down
    (a bigger batch, a straggler) keeps the checkpoints the same seconds apart.
    """

    path: Path
    tuner: CheckpointIntervalTuner | None = None  # TrainConfig.checkpoint_autotune
    risk: float = 0.0
    live_interval_s: float | None = None
    tuned_interval_s: float | None = None
    step_time_s: float | None = None  # EMA of wall seconds per step (eval, saves included)
    _key: tuple | None = None
    _digest: str | None = None
    _last_tick: tuple[int, float] | None = None  # (step, elapsed_s) at the previous tick
    hazard_seeded: bool = False

    @property
    def interval_s(self) -> float | None:
        """The interval in force: the live one, else the autotuned one, else None (fixed steps)."""
        return self.live_interval_s if self.live_interval_s is not None else self.tuned_interval_s

    def interval_steps(self) -> int | None:
        interval = self.interval_s
        if interval is None or not self.step_time_s:
            return None
        return max(1, round(interval / self.step_time_s))

    def measure(self, step: int, elapsed_s: float, last_step_time_s: float) -> float:
        """Updates the seconds-per-step EMA; returns the elapsed seconds since the last tick."""
        if self._last_tick is None:
            sample, delta_s = last_step_time_s, 0.0
        else:
            steps, delta_s = step - self._last_tick[0], elapsed_s - self._last_tick[1]
            sample = delta_s / steps if steps > 0 else last_step_time_s
        self._last_tick = (step, elapsed_s)
        if sample > 0 and math.isfinite(sample):
            self.step_time_s = (sample if self.step_time_s is None
                                else 0.5 * self.step_time_s + 0.5 * sample)
        return max(0.0, delta_s)

    def poll(self) -> LiveControl | ValueError | None:
        """A new control to apply, the error of a new bad file, or None (absent / unchanged)."""
        try:
            stat = self.path.stat()
        except FileNotFoundError:
            return None
        key = (stat.st_mtime_ns, stat.st_size, stat.st_ino)
        if key == self._key:
            return None  # one stat() per tick while nothing changes
        self._key = key
        try:
            control = read_live_control(self.path)
        except (ValueError, FileNotFoundError) as error:
            return ValueError(str(error))
        if control.digest == self._digest:
            return None
        self._digest = control.digest
        if control.checkpoint_interval_s is not None:
            self.live_interval_s = control.checkpoint_interval_s
        if control.preemption_risk is not None:
            self.risk = control.preemption_risk
        return control

    def retune(self, *, exposure_s: float, past_interruptions: int,
               elapsed_before_s: float) -> tuple[float, bool] | None:
        """The checkpoint-interval chooser's answer (`controllers.checkpoint_interval`, the one
        the slow layer and the allocation heuristic ask too) from the observed hazard and the
        measured save cost (None: no tuner).

        Hazard: the run's preempted/migrated ends so far over its elapsed seconds (the reclaim
        prior, a calm market, is replaced by the live risk's MTBF when one is given)."""
        if self.tuner is None:
            return None
        if not self.hazard_seeded:
            self.tuner.observe_exposure(elapsed_before_s, past_interruptions)
            self.hazard_seeded = True
        self.tuner.observe_exposure(exposure_s)
        if self.risk > 0:
            self.tuner.set_prior_mtbf(mtbf_from_risk_s(self.risk, RISK_HORIZON_S))
        interval_s, changed = self.tuner.retune()
        self.tuned_interval_s = interval_s
        return interval_s, changed


def tuner_for(min_interval_s: float, *, notice_s: float = 0.0,
              node_count: int = 1) -> CheckpointIntervalTuner:
    """The in-loop autotune's estimates for the one checkpoint-interval chooser.

    `notice_s`: the notice a reclaim gives the trainer (`TrainConfig.preemption_notice_s`); when
    the measured save fits in it, reclaims lose nothing and only node faults set the interval.
    The loop passes its `preemption_notice_s`; 0: unknown, so reclaims are taken to lose work."""
    tuner = CheckpointIntervalTuner(CheckpointTunerConfig(
        min_interval_s=min_interval_s,
        max_interval_s=max(min_interval_s, DEFAULT_MAX_INTERVAL_S)))
    tuner.set_situation(node_count=node_count, notice_s=notice_s)
    return tuner


BATCH_LEVER, PRUNING_LEVER = "batch", "pruning"
LEVERS = (BATCH_LEVER, PRUNING_LEVER)


@dataclass
class LeverGuards:
    """The lever guard inside a run (`TrainConfig.lever_guard`, controllers.lever_guard).

    Levers: "batch" (the fast policy changed the batch shape away from the config's) and
    "pruning" (dynamic pruning at a rate > 0). A lever is judged from the moment it acts:
    quality at every evaluation against the fixed schedule's curve at the same samples (when
    the config gives one), and the batch lever also by its own cost (seconds per sample of its
    shapes against the config's shape, `StepCostGuard`). A lever judged to cost quality or time
    is switched off: pruning gets rate 0 from the next epoch draw and the run's budget becomes
    the fixed schedule's samples (LoopRun._budget_left: what it skipped is given back at the
    end); the batch goes back to the config's shape and learning-rate scale and a later change
    is refused. The levers are not
    told apart when both act at once: a loss above the curve switches both off.
    `off` is RunState.levers_off, so a resumed run keeps them off."""

    config: Any  # TrainConfig (not imported: _loop_config imports nothing of the loop)
    sampler: Any
    off: dict[str, str]
    base_shape: tuple[int, int]
    quality: dict[str, LeverGuard] = field(default_factory=dict)
    cost: StepCostGuard | None = None
    engaged: set[str] = field(default_factory=set)
    _refused: set[tuple[int, int]] = field(default_factory=set)

    @classmethod
    def build(cls, config: Any, sampler: Any, off: dict[str, str]) -> LeverGuards | None:
        if not config.lever_guard:
            return None
        base = (int(config.micro_batch_size), int(config.grad_accum_steps))
        guards = cls(config=config, sampler=sampler, off=off, base_shape=base)
        if config.lever_guard_reference:
            for lever in LEVERS:
                guards.quality[lever] = LeverGuard(
                    lever, list(config.lever_guard_reference),
                    budget_samples=config.max_steps * base[0] * base[1],
                    loss_tolerance=config.lever_guard_loss_tolerance,
                    patience=config.lever_guard_patience,
                    warmup_fraction=config.lever_guard_warmup_fraction, on=lever not in off,
                    axis=("full-data samples (epochs covered)" if lever == PRUNING_LEVER
                          else "samples"))
        guards.cost = StepCostGuard(BATCH_LEVER, base,
                                    time_tolerance=config.lever_guard_time_tolerance,
                                    patience=config.lever_guard_patience,
                                    on=BATCH_LEVER not in off)
        guards._note_pruning()
        return guards

    @property
    def base_batch(self) -> int:
        return self.base_shape[0] * self.base_shape[1]

    def _note_pruning(self) -> None:
        if getattr(self.sampler, "kind", "") == "dynamic_pruning" and self.sampler.rate > 0 \
                and PRUNING_LEVER not in self.off:
            self.engaged.add(PRUNING_LEVER)

    def start_record(self) -> tuple[dict[str, Any], str]:
        """(action, reason) of the decision that says what the guard watches."""
        pruning = getattr(self.sampler, "kind", "") == "dynamic_pruning"
        watched = ["batch (when the fast policy changes the batch shape)"]
        if pruning:
            watched.append(f"pruning (rate {self.sampler.rate:g})")
        source = self.config.lever_guard_reference_source
        how = (f"eval loss against the fixed schedule's curve ({len(self.config.lever_guard_reference)}"
               f" points{', ' + source if source else ''}) at the same samples, and the batch"
               " lever's seconds per sample"
               if self.quality else "no reference curve: quality is not judged in this run, "
               "only the batch lever's seconds per sample")
        off = "; ".join(f"{k} off since before ({v})" for k, v in self.off.items())
        reason = f"lever guard watches {', '.join(watched)}: {how}" + (f"; {off}" if off else "")
        return ({"watching": sorted({*self.engaged, BATCH_LEVER} - set(self.off)),
                 "levers_off": dict(self.off), "base_batch": list(self.base_shape)}, reason)

    def observe_step(self, micro_batch: int, grad_accum: int, step_time_ms: float) -> None:
        if (micro_batch, grad_accum) != self.base_shape and BATCH_LEVER not in self.off:
            self.engaged.add(BATCH_LEVER)
        if self.cost is not None:
            self.cost.observe_step(micro_batch, grad_accum, step_time_ms)

    def on_eval(self, step: int, samples: float, progress_samples: float,
                eval_loss: float) -> list[LeverVerdict]:
        """Judges the engaged levers at an evaluation; the verdicts that switched one off.

        The batch lever is judged at the samples it has seen (a bigger batch must not need more
        samples than it saves in time). Pruning is judged at the full-data samples its progress
        stands for (`progress_samples`: the epochs covered): it ends the budget after those
        epochs, so it is lossless only if its loss there is the fixed schedule's at the same
        point (InfoBatch's protocol); a loss merely equal at the samples it drew means it will
        end the budget short of the fixed schedule's quality."""
        self._note_pruning()
        verdicts: list[LeverVerdict] = []
        for lever in sorted(self.engaged - set(self.off)):
            guard = self.quality.get(lever)
            at = progress_samples if lever == PRUNING_LEVER else samples
            verdict = guard.observe_eval(at, eval_loss) if guard is not None else None
            if verdict is None and lever == BATCH_LEVER and self.cost is not None:
                verdict = self.cost.check(step)
            if verdict is not None:
                verdicts.append(verdict)
        return verdicts

    def switch_off(self, verdict: LeverVerdict) -> None:
        """Applies an off verdict (every rank applies the same one)."""
        self.off[verdict.lever] = verdict.reason
        for guard in (self.quality.get(verdict.lever), self.cost):
            if guard is not None and guard.lever == verdict.lever:
                guard.on = False
        self.engaged.discard(verdict.lever)
        self.keep_pruning_off()

    def keep_pruning_off(self) -> None:
        """Pruning off: rate 0 from the next epoch draw (again if the slow tick or the control
        file set another rate since)."""
        if PRUNING_LEVER in self.off and getattr(self.sampler, "kind", "") == "dynamic_pruning" \
                and self.sampler.rate > 0:
            self.sampler.set_pruning_rate(0.0, reason=self.off[PRUNING_LEVER],
                                          source="lever_guard")

    def enforce_batch(self, run: Any) -> tuple[int, int] | None:
        """Batch lever off: puts the config's shape and learning-rate scale back. Returns a
        refused shape the first time it is seen (to record), else None."""
        if BATCH_LEVER not in self.off:
            return None
        shape = (int(run.micro_batch_size), int(run.grad_accum_steps))
        if shape == self.base_shape and run.lr_scale == 1.0:
            return None
        run.micro_batch_size, run.grad_accum_steps = self.base_shape
        run.lr_scale = 1.0
        if shape in self._refused:
            return None
        self._refused.add(shape)
        return shape
