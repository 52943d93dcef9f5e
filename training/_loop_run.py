"""The step loop of `training.loop.train`: steps, fast ticks, preemption, eval, checkpoints.

Live decisions (issue 10): at each fast tick the loop reads the run folder's live-control file
(`training.live_control`; each content once, recorded as a decision with its source and reason,
a bad one refused and recorded), re-tunes the checkpoint interval (the live one in seconds, else
with `checkpoint_autotune` Young/Daly from the observed hazard and the measured save cost, turned
into steps with the measured seconds per step), feeds the live preemption risk into the fast
policy's observation, and passes the notice state. A preemption notice is answered by the fast
policy and its answer honoured (`LoopRun._leave_on_notice`): checkpoint when the save fits,
migrate (stop with the last good checkpoint, status "migrated") when it does not.

Telemetry that cannot be written (disk full) does not lose the training: the first failed write
stops all further writes, the step boundary is finished as usual, a checkpoint is written
(reason "telemetry_failed") and `TrainingStoppedError` says where and what to do. Nor does it
lose the rows (issue 31, class 5): every record refused from the first failure on (the failing
step's step and eval rows, the checkpoint's, the run_end) goes into the run ledger as an
`unwritten` line, and the resumed process writes them into telemetry first, once
(`training.ledger.pending_telemetry`).

The run ledger (`training.ledger`, issue 31 class 4) gets its lines here: `start` when the
process begins, `step` before each step record (same clock), `mark` with each eval and
preemption record, `checkpoint` when a checkpoint is durable (its step, clock and sha256: what a
resume from it bills from), `end` with the run_end record; fsynced at each checkpoint and end.
"""

from __future__ import annotations

import dataclasses
import errno
import math
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch
from tqdm import tqdm

from controllers.fast_types import FastPolicy, PreemptionResponse
from telemetry.events import (
    CheckpointEvent,
    DecisionEvent,
    EvalEvent,
    Event,
    PreemptionEvent,
    RunEndEvent,
    StepEvent,
    to_record,
)
from telemetry.reader import read_run_events
from telemetry.writer import SegmentWriter, TelemetryWriteError
from training import _loop_fast as fast
from training._loop_config import TrainConfig, get_lr
from training._loop_persist import (
    CheckpointInfo,
    CheckpointPersister,
    PersistResult,
    snapshot_copy,
)
from training._loop_schedule import ScheduleInForce
from training._loop_schedule import switch as switch_schedule
from training._loop_state import RunState, build_state
from training._loop_step import (
    StepOutcome,
    evaluate,
    fixed_eval_batches,
    tokens_per_example,
    train_step,
)
from training.data_types import Curriculum, ExampleSet
from training.ledger import LedgerWriter
from training.live_control import LIVE_CONTROL_FILE
from training.model import CNNConfig, GPTConfig
from training.sampler import TrainSampler

Status = Literal["completed", "preempted", "stopped", "migrated"]
_FULL_DISK = {errno.ENOSPC, errno.EDQUOT}


def _device_of(path: Path) -> str:
    """`device MAJOR:MINOR mounted at /x` of the file system holding `path` (its nearest
    existing folder), for a message; '' when even that cannot be looked at."""
    folder = Path(os.path.abspath(path))
    while not folder.exists() and folder != folder.parent:
        folder = folder.parent
    try:
        device = os.stat(folder).st_dev
    except OSError:
        return ""
    mount = folder
    while mount != mount.parent and not os.path.ismount(mount):
        mount = mount.parent
    return f"device {os.major(device)}:{os.minor(device)} mounted at {mount}"


def _telemetry_fix(error: OSError, where: Path, resume: str) -> str:
    """What to do about a failed telemetry write, by its errno: "free disk space" for a folder
    someone removed, or a failing device, sends a person after the wrong cause."""
    if error.errno in _FULL_DISK:
        return f"Free disk space on the file system of {where}, {resume}"
    if error.errno == errno.ENOENT:
        return (f"The telemetry folder {where} (or a file in it) was removed while the trainer "
                "wrote it: something else (a clean-up job, `rm -rf`, a restore) is removing "
                f"files in the run folder. Stop it, {resume}")
    device = _device_of(where)
    cause = os.strerror(error.errno) if error.errno is not None else "an unknown error"
    return (f"The file system refused the write ({cause}"
            f"{f', on {device}' if device else ''}): not a full disk. Fix that file system or "
            f"device (permissions, a read-only mount, I/O errors in `dmesg`), {resume}")


class TrainingStoppedError(RuntimeError):
    """Training stopped because its telemetry could not be written; the work is checkpointed
    (unless the checkpoint failed too, which the message then says)."""

    def __init__(self, message: str, *, telemetry_dir: Path, checkpoint_path: Path | None):
        super().__init__(message)
        self.telemetry_dir = telemetry_dir
        self.checkpoint_path = checkpoint_path


@dataclass
class LoopRun:
    """One process working on a run: the loop and its parts as small methods."""

    config: TrainConfig
    examples: ExampleSet
    curriculum: Curriculum | None
    out_dir: Path
    model_kind: str
    model_config: GPTConfig | CNNConfig
    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    sampler: TrainSampler
    run: RunState
    policy: FastPolicy
    started: float  # time.perf_counter() when this process began on the run
    on_checkpoint: Callable[[CheckpointInfo], None] | None = None
    writer: SegmentWriter | None = None
    checkpoint_path: Path | None = None  # the newest durable checkpoint
    checkpoint_sha256: str | None = None
    telemetry_error: TelemetryWriteError | None = None  # the first failed telemetry write
    _checkpoint_step: int | None = None  # the newest snapshot's step (durable or in flight)
    _checkpoint_error: OSError | None = None
    _last: dict[str, Any] | None = None  # the latest step's figures, for the fast policy
    rank: int = 0  # torchrun rank (training.distributed.DistributedLoopRun); 0 alone
    ledger: LedgerWriter | None = None  # the run ledger (training.ledger); None: none kept

    def __post_init__(self) -> None:
        self._elapsed_before_s = self.run.elapsed_s
        if self.ledger is not None:  # set-up is done: from here on the ledger has the clock
            self._tick_clock()
            self.ledger.commit("start", step=self.run.step, elapsed_s=self.run.elapsed_s,
                               price_usd_per_hour=float(self.config.price_usd_per_hour))
        self.persister = CheckpointPersister(
            self.out_dir / "checkpoints", keep=self.config.keep_checkpoints,
            on_checkpoint=self.on_checkpoint,
        )
        self._eval_batches = fixed_eval_batches(
            self.examples, self.config.eval_batches, self.config.eval_batch_size
        )
        self._tokens_per_example = tokens_per_example(self.examples)
        # Live decisions (training.live_control): rank 0 reads the file and tunes the interval;
        # every rank applies what rank 0 decided (_live_tick), so a gang saves at the same steps.
        live_path = Path(self.config.live_control_path or self.out_dir / LIVE_CONTROL_FILE)
        self.live = fast.LiveDecisions(
            path=live_path,
            # The notice the trainer gets: when a measured save fits in it, a reclaim loses
            # nothing and only node faults set the interval (the one chooser's rule).
            tuner=(fast.tuner_for(self.config.checkpoint_min_interval_s,
                                  notice_s=self.config.preemption_notice_s)
                   if self.config.checkpoint_autotune else None),
        )
        self._interval_steps: int | None = None  # None: config.checkpoint_every_steps
        self._risk = 0.0  # fed to the fast policy's observation
        self._start_step = self.run.step
        # The lever guard (TrainConfig.lever_guard): None when off.
        self.guards = fast.LeverGuards.build(self.config, self.sampler, self.run.levers_off)
        # The published schedule's levers and interval rule (training._loop_schedule).
        self.schedule = ScheduleInForce.at_start(self.config, self.policy)

    # -- bookkeeping ------------------------------------------------------------------------
    def _tick_clock(self) -> None:
        self.run.elapsed_s = self._elapsed_before_s + (time.perf_counter() - self.started)
        self.run.cost_usd = self.run.elapsed_s * self.config.price_usd_per_hour / 3600.0

    def write(self, event: Any) -> None:
        """Writes one event (its ledger line first); after a failed write, writes nothing more
        to telemetry (the step boundary is finished and checkpointed first, see the module
        docstring) and keeps each refused record in the ledger instead."""
        assert self.writer is not None
        if isinstance(event, DecisionEvent) and not event.schedule_version:
            # Every decision names the schedule it was made under (issue 28).
            event = dataclasses.replace(event, schedule_version=self.schedule.version)
        self._commit_clock(event)
        if self.telemetry_error is not None:
            self._keep_unwritten(event)
            return
        try:
            self.writer.write(event)
        except TelemetryWriteError as error:
            self.telemetry_error = error
            self._keep_unwritten(event)

    def _commit_clock(self, event: Any) -> None:
        """The ledger line of an event: the clock the resume of a killed process bills from."""
        if self.ledger is None or not isinstance(event, Event):
            return
        if isinstance(event, StepEvent):
            self.ledger.commit("step", step=event.step, elapsed_s=event.elapsed_s)
        elif isinstance(event, RunEndEvent):
            self.ledger.commit("end", step=self.run.step, elapsed_s=event.elapsed_s, sync=True)
        elif isinstance(event, (EvalEvent, PreemptionEvent)):
            # An eval may take long: its end moves the committed clock (a checkpoint's record
            # has its own line, see `_record`).
            self._tick_clock()
            self.ledger.commit("mark", step=self.run.step, elapsed_s=self.run.elapsed_s)

    def _keep_unwritten(self, event: Any) -> None:
        if self.ledger is not None:
            record = to_record(event) if isinstance(event, Event) else dict(event)
            self.ledger.commit("unwritten", step=self.run.step, elapsed_s=self.run.elapsed_s,
                               record=record)

    def _progress_steps(self) -> float:
        # The budget's clock: optimizer steps, or with dynamic pruning full-data-equivalent
        # steps (a pruned epoch counts whole but takes fewer optimizer steps).
        return self.sampler.progress_steps(self.run.step)

    def _budget_left(self) -> bool:
        if self._progress_steps() < self.config.max_steps - 1e-9:
            return True
        # Pruning switched off by the guard: the budget is the fixed schedule's samples, so the
        # samples it skipped before are given back at the end (at the schedule's floor rate).
        return (self.guards is not None and fast.PRUNING_LEVER in self.run.levers_off
                and self.run.samples_seen < self.config.max_steps * self.guards.base_batch)

    def _learning_rate(self) -> float:
        return get_lr(self._progress_steps(), self.config) * self.run.lr_scale

    def end_event(self, status: str, error: str | None = None) -> RunEndEvent:
        self._tick_clock()
        return RunEndEvent(
            run_id=self.run.run_id, rank=self.rank, step=self.run.step, status=status,
            elapsed_s=self.run.elapsed_s, cost_usd=self.run.cost_usd,
            samples_seen=self.run.samples_seen, tokens_seen=self.run.tokens_seen,
            final_eval_loss=self.run.last_eval_loss,
            final_eval_accuracy=self.run.last_eval_accuracy,
            checkpoint_path=str(self.checkpoint_path) if self.checkpoint_path else None,
            checkpoint_sha256=self.checkpoint_sha256, error=error,
        )

    # -- the loop ---------------------------------------------------------------------------
    def execute(self, *, progress: bool, stop_after_steps: int | None) -> Status:
        self._guard_start()
        status = self._execute(progress=progress, stop_after_steps=stop_after_steps)
        self._guard_summary(status)
        if self.telemetry_error is not None:
            raise self.stopped_error()
        return status

    def _stop_for_telemetry(self) -> bool:
        """At a step boundary after a failed telemetry write: checkpoint, True = stop."""
        if not self._telemetry_failed():
            return False
        try:
            self._checkpoint("telemetry_failed")
        except OSError as error:  # the same full disk may refuse the checkpoint too
            self._checkpoint_error = error
        return True

    # Hooks a torchrun gang overrides so that every rank stops at the same boundary.
    def _telemetry_failed(self) -> bool:
        return self.telemetry_error is not None

    def _notice_pending(self, notice: fast.PreemptionSignal) -> bool:
        return notice.pending

    def stopped_error(self) -> TrainingStoppedError:
        assert self.writer is not None and self.telemetry_error is not None
        where = self.writer.directory
        if self._checkpoint_error is None:
            saved = f"the work is saved in checkpoint {self.checkpoint_path} (step {self.run.step})"
        else:
            saved = (f"the checkpoint could not be written either ({self._checkpoint_error}); "
                     f"the newest good checkpoint is {self.checkpoint_path or 'none'}")
        resume = f"then resume (resume_from={self.out_dir / 'checkpoints'})"
        return TrainingStoppedError(
            f"training of run {self.run.run_id!r} stopped: its telemetry could not be written "
            f"to {where} ({self.telemetry_error}); {saved}. "
            f"{_telemetry_fix(self.telemetry_error, where, resume)}",
            telemetry_dir=where.parent, checkpoint_path=self.checkpoint_path,
        )

    def drain(self) -> None:
        """Waits for a background persist (the run is failing); records it if it succeeded."""
        try:
            self._record(self.persister.wait())
        except Exception:  # noqa: BLE001 - the run's own error is the one to raise
            pass

    def _execute(self, *, progress: bool, stop_after_steps: int | None) -> Status:
        status: Status = "completed"
        steps_this_call = 0
        bar = tqdm(total=self.config.max_steps, initial=self.run.step, desc=self.run.run_id,
                   unit="step", disable=not progress, dynamic_ncols=True)
        with bar, fast.PreemptionSignal() as notice:
            while self._budget_left():
                # Step boundary: everything below is in the checkpoint, so stopping here is exact.
                self._record(self.persister.poll())
                if self._stop_for_telemetry():
                    return "stopped"
                if self._notice_pending(notice):
                    return self._leave_on_notice(notice, None)
                if stop_after_steps is not None and steps_this_call >= stop_after_steps:
                    self._checkpoint("stop")
                    return "stopped"
                last = self._step()
                steps_this_call += 1
                if self.guards is not None:
                    self.guards.observe_step(int(last.get("micro_batch_size", 0)),
                                             int(last.get("grad_accum_steps", 0)),
                                             float(last.get("step_time_ms", math.nan)))
                bar.update(self._progress_steps() - bar.n)
                bar.set_postfix(loss=f"{last['train_loss']:.3f}", usd=f"{self.run.cost_usd:.4f}",
                                refresh=False)
                answered: PreemptionResponse | None = None  # a notice's answer at this tick
                if self.run.step % self.config.fast_every_steps == 0:
                    self._live_tick(last)
                    # The tick passes the notice state: a notice that came during the step is
                    # answered here (and acted on at the end of this boundary, after the eval).
                    pending = self._notice_pending(notice)
                    notice_s = self._notice_left_s(notice) if pending else None
                    response = self._fast_tick(last, notice_s=notice_s, apply=True)
                    self._guard_enforce()
                    if pending:
                        answered = response
                    elif response is PreemptionResponse.CHECKPOINT_NOW:
                        self._checkpoint("fast_policy")
                    elif response is PreemptionResponse.MIGRATE:
                        status = "migrated"
                if self.run.step % self.config.eval_every_steps == 0 or not self._budget_left():
                    self._evaluate()
                if self.run.step % self.config.fast_every_steps == 0:
                    # After the eval, so that a slow tick in the sampler sees the latest loss.
                    self.sampler.on_fast_tick(self.run.step)
                if answered is not None:
                    return self._leave_on_notice(notice, answered)
                if status == "migrated":
                    self._checkpoint("migrate")  # no notice: the policy's own move, saved first
                    return status
                if self._interval_due() and self._budget_left():
                    self._checkpoint("interval")  # (at the end, the final one follows at once)
            if self.run.last_eval_step != self.run.step:
                self._evaluate()
            if self._stop_for_telemetry():
                return "stopped"
            self._checkpoint("final")
        return status

    def _step(self) -> dict[str, Any]:
        """One optimizer step: the update (`_update`, the hook a torchrun rank overrides), the
        counters, the step event. The rest of the step boundary is `_execute`'s."""
        began = time.perf_counter()
        learning_rate = self._learning_rate()
        micro, accum = self.run.micro_batch_size, self.run.grad_accum_steps
        outcome, noise, event_extra = self._update(learning_rate, micro, accum)
        self.run.step += 1
        self.run.samples_seen += micro * accum
        self.run.tokens_seen += micro * accum * self._tokens_per_example
        step_time_ms = (time.perf_counter() - began) * 1000.0
        self._tick_clock()
        last = {
            "train_loss": outcome.train_loss, "learning_rate": learning_rate,
            "grad_norm": outcome.grad_norm, "grad_noise_scale": noise, "micro_batch_size": micro,
            "grad_accum_steps": accum, "step_time_ms": step_time_ms,
        }
        self.write(StepEvent(
            run_id=self.run.run_id, rank=self.rank, step=self.run.step,
            samples_seen=self.run.samples_seen, tokens_seen=self.run.tokens_seen,
            elapsed_s=self.run.elapsed_s, cost_usd=self.run.cost_usd,
            sampler_phase=self.sampler.phase, **event_extra, **last,
        ))
        self._last = last
        return last

    # Hooks a torchrun rank (training.distributed.DistributedLoopRun) overrides; the loop
    # itself (`_execute`, `_step`, `_fast_tick`) is written once.
    def _update(self, learning_rate: float, micro: int,
                accum: int) -> tuple[StepOutcome, float, dict[str, Any]]:
        """The model update of one step: (outcome, gradient noise scale, extra step-event
        fields). One process: the whole global batch, noise measured when accum >= 2."""
        outcome = train_step(
            model=self.model, optimizer=self.optimizer, sampler=self.sampler,
            examples=self.examples, step=self.run.step, learning_rate=learning_rate,
            micro_batch_size=micro, grad_accum_steps=accum, grad_clip=self.config.grad_clip,
            noise_scale=self.run.noise_scale,
        )
        noise = self.run.noise_scale.value if accum >= 2 else math.nan
        return outcome, noise, {}

    def _observation(self, last: dict[str, Any], notice_s: float | None) -> Any:
        """What the fast policy sees at a tick (a gang adds every rank's step time)."""
        return fast.build_observation(
            step=self.run.step, elapsed_s=self.run.elapsed_s, train_loss=last["train_loss"],
            grad_norm=last["grad_norm"], grad_noise_scale=last["grad_noise_scale"],
            micro_batch_size=self.run.micro_batch_size,
            grad_accum_steps=self.run.grad_accum_steps, learning_rate=last["learning_rate"],
            step_time_ms=last["step_time_ms"], preemption_notice_s=notice_s,
            seconds_since_checkpoint=self.run.elapsed_s - self.run.last_checkpoint_elapsed_s,
            checkpoint_cost_s=self.run.last_checkpoint_cost_s, preemption_risk=self._risk,
        )

    def _decide(self, observation: Any) -> tuple[Any, dict[str, float] | None]:
        """The fast policy's action, validated, and the extra numbers of its decision record
        (None: this process does not write the record; a gang's rank 0 writes it)."""
        action = self.policy.act(observation)
        fast.validate_action(action, self._policy_name())
        return action, {}

    def _apply_fast(self, action: Any, learning_rate: float) -> None:
        """The action's levers, in force from the next step."""
        self.run.micro_batch_size = int(action.micro_batch_size)
        self.run.grad_accum_steps = int(action.grad_accum_steps)
        # The policy's rate rescales the schedule, so warmup/cosine carry on around it;
        # an unchanged rate gives a factor of exactly 1.0 (bitwise no-op).
        if action.learning_rate != learning_rate:
            self.run.lr_scale *= action.learning_rate / learning_rate
        # Knobs beyond FastAction's fields: each registered lever applies its own key
        # (controllers.fast_levers); an action without extras (most policies) changes nothing.
        from controllers.fast_levers import apply_extras
        apply_extras(self, getattr(action, "extras", None) or {})

    def _gang_share(self, value: Any) -> Any:
        """Rank 0's value on every rank (a gang broadcasts it); a single process keeps its own."""
        return value

    def _policy_name(self) -> str:
        return str(getattr(self.policy, "name", type(self.policy).__name__))

    def _fast_tick(
        self, last: dict[str, Any], *, notice_s: float | None, apply: bool
    ) -> PreemptionResponse:
        """Asks the fast policy, applies its action if `apply`, records the decision."""
        self._tick_clock()
        observation = self._observation(last, notice_s)
        action, numbers = self._decide(observation)
        if apply:  # before the record: a failed write must not leave the decision unapplied
            self._apply_fast(action, last["learning_rate"])
        if numbers is not None:
            self.write(DecisionEvent(
                run_id=self.run.run_id, rank=self.rank, step=self.run.step, layer="fast",
                policy=self._policy_name(), action=fast.action_record(action),
                reason=action.reason, numbers={**action.numbers, **numbers},
                observation=fast.observation_record(observation),
            ))
        return action.preemption_response

    def _notice_left_s(self, notice: fast.PreemptionSignal) -> float:
        left = notice.notice_left_s(self.config.preemption_notice_s)
        # Under torchrun the notice may have reached another rank: assume the whole notice.
        return self.config.preemption_notice_s if left is None else left

    def _leave_on_notice(
        self, notice: fast.PreemptionSignal, response: PreemptionResponse | None
    ) -> Status:
        """A preemption notice (SIGTERM): the node goes; the fast policy says how to leave, and
        its answer is honoured:

        - CHECKPOINT_NOW: save this boundary, status "preempted";
        - MIGRATE: the save does not fit in the notice; start none (a torn save is worthless),
          stop at once with the last good checkpoint, status "migrated" (the provider side
          replaces the node, which replays the steps since that checkpoint);
        - CONTINUE (or a policy not asked yet): no preference, so the loop's default: save when
          the measured save fits in the notice left, else migrate as above.

        A migration with no good checkpoint at all is a recorded fallback: it saves anyway (the
        atomic write leaves nothing worse if the kill tears it). `response` is the answer a
        periodic tick already gave with the notice; None asks now. No batch change is applied
        here, so a save equals the state an uninterrupted run has at this boundary."""
        notice_s = self._notice_left_s(notice)
        if response is None and self._last is not None:
            response = self._fast_tick(self._last, notice_s=notice_s, apply=False)
        said = response.value if response is not None else "no step yet"
        self._record(self.persister.wait())  # a save in flight becomes the last good one
        save_s = self.run.last_checkpoint_cost_s  # the measured cost of a save (nan: none yet)
        fits = not (math.isfinite(save_s) and save_s > notice_s)
        if response is PreemptionResponse.MIGRATE or (
                response is not PreemptionResponse.CHECKPOINT_NOW and not fits):
            leave, why = "migrate", (
                f"save of {save_s:.3f}s measured does not fit the notice of {notice_s:.3f}s left"
                if not fits else f"the policy judged a save would not fit in the "
                f"{notice_s:.3f}s left (measured save {save_s:.3f}s)")
        elif math.isfinite(save_s):
            leave, why = "checkpoint", f"save of {save_s:.3f}s fits the {notice_s:.3f}s left"
        else:
            leave, why = "checkpoint", f"no save measured yet: saving in the {notice_s:.3f}s left"
        if leave == "migrate" and self.checkpoint_path is None:
            leave, why = "fallback", f"{why}; no good checkpoint yet, so it saves anyway"
        # Rank 0 measured the saves: under torchrun every rank leaves the way it decided.
        leave, why = self._gang_share((leave, why))
        if leave == "migrate":
            kept = self._checkpoint_step if self._checkpoint_step is not None else self.run.step
            why += (f"; stops with the last good checkpoint (step {kept}, {self.checkpoint_path}),"
                    f" steps {kept + 1}..{self.run.step} to replay")
        response_text = {"checkpoint": "checkpoint_and_exit", "migrate": "migrate",
                         "fallback": "fallback_checkpoint_and_migrate"}[leave]
        self.write(PreemptionEvent(
            run_id=self.run.run_id, rank=self.rank, step=self.run.step,
            signal_name=notice.signal_name or "", notice_s=notice_s,
            received_wall_time_s=notice.received_wall_time_s or math.nan,
            response=f"{response_text} (policy said {said}): {why}",
        ))
        if leave == "checkpoint":
            self._checkpoint("preemption")
            return "preempted"
        if leave == "fallback":
            self._checkpoint("migrate_fallback")
        return "migrated"

    # -- live decisions (training.live_control) -------------------------------------------------
    def _interval_due(self) -> bool:
        if self._interval_steps is None:
            every = self.config.checkpoint_every_steps
            return bool(every) and self.run.step % every == 0
        last = self._checkpoint_step if self._checkpoint_step is not None else self._start_step
        return self.run.step - last >= self._interval_steps

    def _past_interruptions(self) -> int:
        """Preempted or migrated ends this run recorded before (the observed hazard)."""
        if self.writer is None:
            return 0
        try:
            ends = read_run_events(self.writer.directory.parent, rank=self.rank)
        except (ValueError, OSError):  # unreadable telemetry: the prior alone
            return 0
        return sum(1 for e in ends if e.get("type") == "run_end"
                   and e.get("status") in ("preempted", "migrated"))

    def _live_tick(self, last: dict[str, Any]) -> None:
        """At a fast tick: apply a new live-control file once, re-tune and re-convert the
        checkpoint interval; every change is recorded as a decision with its source and reason."""
        if self.rank == 0:
            self._tick_clock()
            exposure_s = self.live.measure(self.run.step, self.run.elapsed_s,
                                           last["step_time_ms"] / 1000.0)
            control = self.live.poll()
            if isinstance(control, ValueError):
                self._live_decision("live_control", {"refused": True}, (
                    f"live-control file refused, nothing changed: {control}"), {})
            elif control is not None and control.schedule is not None and (
                    control.schedule["version"] != self.schedule.version):
                self.policy, self.schedule, action, reason = switch_schedule(
                    self.schedule, self.policy, control.schedule)
                self._live_decision(control.source or "live_control", action,
                                    f"{reason} ({control.reason})" if control.reason else reason,
                                    {})
            if control is not None and not isinstance(control, ValueError) and (
                    control.checkpoint_interval_s is not None
                    or control.preemption_risk is not None):
                steps = self.live.interval_steps()
                self._live_decision(control.source or "live_control", {
                    "checkpoint_interval_s": control.checkpoint_interval_s,
                    "checkpoint_every_steps": steps if control.checkpoint_interval_s else None,
                    "preemption_risk": control.preemption_risk,
                    "digest": control.digest,
                }, control.reason, {"step_time_s": self.live.step_time_s or math.nan})
            seeding = self.live.tuner is not None and not self.live.hazard_seeded
            tuned = self.live.retune(  # the telemetry is read once, at the first tick
                exposure_s=exposure_s,
                past_interruptions=self._past_interruptions() if seeding else 0,
                elapsed_before_s=self._elapsed_before_s)
            if tuned is not None and tuned[1] and self.live.live_interval_s is None:
                tuner = self.live.tuner
                assert tuner is not None
                cost = tuner.checkpoint_cost_s
                self._live_decision("checkpoint_autotune", {
                    "checkpoint_interval_s": tuned[0],
                    "checkpoint_every_steps": self.live.interval_steps(),
                }, (f"Young/Daly: save cost {cost if cost is not None else math.nan:.4f}s "
                    f"(measured), MTBF {tuner.mtbf_s:.0f}s (observed hazard) -> checkpoint every "
                    f"{tuned[0]:.1f}s"), {
                    "checkpoint_cost_s": cost if cost is not None else math.nan,
                    "mtbf_s": tuner.mtbf_s, "step_time_s": self.live.step_time_s or math.nan,
                }, layer="fast")
            shared = (self.live.interval_steps(), self.live.risk)
        else:
            shared = None
        self._interval_steps, self._risk = self._gang_share(shared)

    def _live_decision(self, policy: str, action: dict[str, Any], reason: str,
                       numbers: dict[str, float], layer: str = "slow") -> None:
        self.write(DecisionEvent(
            run_id=self.run.run_id, rank=self.rank, step=self.run.step, layer=layer,
            policy=policy, action=action, reason=reason, numbers=numbers,
            observation={"live_control_path": str(self.live.path)},
        ))

    def _evaluate(self) -> None:
        began = time.perf_counter()
        loss, accuracy, count = evaluate(self.model, self.examples, self._eval_batches)
        self.run.last_eval_loss, self.run.last_eval_accuracy = loss, accuracy
        self.run.last_eval_step = self.run.step
        self.sampler.observe_eval(self.run.step, loss)
        self._guard_eval(loss)
        self.write(EvalEvent(
            run_id=self.run.run_id, rank=self.rank, step=self.run.step, eval_loss=loss,
            eval_accuracy=accuracy,
            eval_examples=count, eval_ms=(time.perf_counter() - began) * 1000.0,
        ))

    # -- the lever guard (controllers.lever_guard, fast.LeverGuards) ---------------------------
    def _guard_decision(self, action: dict[str, Any], reason: str,
                        numbers: dict[str, float]) -> None:
        # Every decision of the guard carries what the run has drawn so far against the fixed
        # schedule: samples seen, the full-data samples the same budget progress stands for
        # (pruning skips the difference) and the samples the fixed batch takes in these steps.
        assert self.guards is not None
        base = self.guards.base_batch
        self.write(DecisionEvent(
            run_id=self.run.run_id, rank=self.rank, step=self.run.step, layer="slow",
            policy="lever_guard", action=action, reason=reason, numbers={
                **numbers, "samples_seen": float(self.run.samples_seen),
                "full_data_samples": float(self._progress_steps() * base),
                "fixed_batch_samples": float(self.run.step * base),
                "elapsed_s": float(self.run.elapsed_s)},
            observation={"eval_loss": self.run.last_eval_loss, "step": self.run.step},
        ))

    def _guard_start(self) -> None:
        if self.guards is not None:
            self._tick_clock()
            action, reason = self.guards.start_record()
            self._guard_decision({"guard": "start", **action}, reason, {})

    def _guard_eval(self, eval_loss: float) -> None:
        """At an evaluation: the guard judges the levers; one that costs quality or time is
        switched off here, with its reason recorded (rank 0's verdicts under torchrun)."""
        if self.guards is None:
            return
        verdicts = self._gang_share(self.guards.on_eval(
            self.run.step, float(self.run.samples_seen),
            float(self._progress_steps() * self.guards.base_batch), eval_loss))
        self.guards.keep_pruning_off()
        for verdict in verdicts:
            self.guards.switch_off(verdict)
            self._tick_clock()
            self._guard_decision({"guard": "switch_off", "lever": verdict.lever, "on": False},
                                 verdict.reason, dict(verdict.numbers))
        if verdicts:
            self._guard_enforce()

    def _guard_enforce(self) -> None:
        """The batch lever is off: the config's batch shape, whatever the fast policy asked."""
        if self.guards is None:
            return
        refused = self.guards.enforce_batch(self.run)
        if refused is not None:
            base = self.guards.base_shape
            self._guard_decision(
                {"guard": "refuse_batch", "lever": fast.BATCH_LEVER,
                 "refused": list(refused), "micro_batch_size": base[0],
                 "grad_accum_steps": base[1]},
                f"batch shape {refused[0]}x{refused[1]} refused, back to the fixed "
                f"{base[0]}x{base[1]}: the batch lever is off ({self.run.levers_off.get('batch')})",
                {})

    def _guard_summary(self, status: str) -> None:
        """What the levers did in this call, against the fixed schedule (explain, MLflow)."""
        if self.guards is None:
            return
        self._tick_clock()
        on = sorted(self.guards.engaged - set(self.run.levers_off))
        self._guard_decision(
            {"guard": "summary", "status": status, "levers_on": on,
             "levers_off": dict(self.run.levers_off)},
            f"levers at the end of this call: on {', '.join(on) or 'none'}; off "
            + (", ".join(self.run.levers_off) or "none"), {"steps": float(self.run.step)})

    def _checkpoint(self, reason: str) -> None:
        """Checkpoints this step boundary. Interval checkpoints (with `async_checkpoints`) are
        snapshotted and persisted in the background; the rest are durable on return."""
        began = time.perf_counter()
        self._record(self.persister.wait())  # one persist at a time, durable in step order
        if self._checkpoint_step == self.run.step and self.checkpoint_path is not None:
            return  # this boundary is already saved
        background = self.config.async_checkpoints and reason == "interval"
        self._tick_clock()
        snapshot_began = time.perf_counter()
        # The state records the cost of the checkpoint before this one; this one's cost is
        # known only after writing it, and is recorded in telemetry and in the next one.
        state = build_state(
            run=self.run, model_kind=self.model_kind, model_config=self.model_config,
            train_config=dataclasses.asdict(self.config), examples=self.examples,
            curriculum=self.curriculum, model=self.model, optimizer=self.optimizer,
            sampler=self.sampler,
        )
        if background:
            state = snapshot_copy(state)  # training changes the live tensors from the next step
        now = time.perf_counter()
        timing = {"step": self.run.step, "reason": reason, "elapsed_s": self.run.elapsed_s,
                  "blocking_s": now - began, "snapshot_s": now - snapshot_began}
        self._checkpoint_step = self.run.step
        if background:
            self.persister.submit(state, **timing)
        else:
            self._record(self.persister.persist_now(state, **timing))

    def _record(self, result: PersistResult | None) -> None:
        """A checkpoint became durable: it is the one to resume from; record what it cost."""
        if result is None:
            return
        info = result.info
        self.checkpoint_path, self.checkpoint_sha256 = info.path, info.sha256
        self.run.last_checkpoint_cost_s = result.snapshot_s + result.persist_s
        self.run.last_checkpoint_elapsed_s = result.elapsed_s
        if self.live.tuner is not None and result.blocking_s > 0:
            # Young/Daly's C: the seconds the training stalled for this save (CheckFreq).
            self.live.tuner.observe_checkpoint_cost(result.blocking_s)
        if self.ledger is not None:
            # Which checkpoint, with which clock, became durable when: a resume from it bills
            # from this line (training.ledger.committed_bill). fsync: it outlives a crash too.
            self._tick_clock()
            self.ledger.commit("checkpoint", step=self.run.step, elapsed_s=self.run.elapsed_s,
                               sync=True, checkpoint_step=info.step,
                               checkpoint_elapsed_s=result.elapsed_s, sha256=info.sha256)
        self.write(CheckpointEvent(
            run_id=self.run.run_id, rank=self.rank, step=info.step, path=str(info.path),
            sha256=info.sha256,
            size_bytes=result.size_bytes, save_ms=result.blocking_s * 1000.0, reason=info.reason,
            snapshot_ms=result.snapshot_s * 1000.0, persist_ms=result.persist_s * 1000.0,
            asynchronous=result.asynchronous,
        ))
