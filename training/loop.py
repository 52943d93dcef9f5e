"""The training loop: curriculum batches, weighted loss, eval, checkpoints, fast-policy hook.

nanoGPT-flat (karpathy/nanoGPT `train.py`): one config dataclass, `get_lr`, a plain loop. What a
cost-aware trainer adds:

1. Batches come from `CurriculumSampler` (kept examples with loss weights, full data at the end).
2. Every `fast_every_steps` the fast policy sees a `FastObservation` and its `FastAction` is
   applied before the next step; the decision goes to telemetry with its reason and numbers.
3. SIGTERM (emulated spot preemption) is noted by a handler; at the next step boundary the loop
   asks the policy (recorded), checkpoints and returns status "preempted".
4. Cost is billed on elapsed seconds at `price_usd_per_hour`, across resumes.
5. Telemetry goes to append-only JSONL segments; the loop never opens a database.

A checkpoint is written at step boundaries and holds everything to continue exactly: a resumed
run reproduces the uninterrupted run's losses bit for bit (with the same thread count).

Statuses: "completed" (max_steps reached), "preempted" (SIGTERM), "stopped" (`stop_after_steps`
reached), "migrated" (the fast policy answered MIGRATE). Every one ends with a checkpoint.
"""

from __future__ import annotations

import dataclasses
import math
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch
from tqdm import tqdm

from controllers.fast_types import FastPolicy, NoOpFastPolicy, PreemptionResponse
from telemetry.events import (
    CheckpointEvent,
    DecisionEvent,
    EvalEvent,
    PreemptionEvent,
    RunEndEvent,
    RunStartEvent,
    StepEvent,
)
from telemetry.writer import SegmentWriter, rank_dir
from training import _loop_fast as fast
from training._loop_state import (
    RunState,
    build_state,
    check_examples_fit,
    default_model_config,
    restore_state,
)
from training._loop_step import evaluate, fixed_eval_batches, tokens_per_example, train_step
from training.checkpoint import checkpoint_name, load_checkpoint, prune_checkpoints, save_checkpoint
from training.data_types import Curriculum, ExampleSet
from training.model import (
    MODEL_KIND_FOR_DATA,
    CNNConfig,
    GPTConfig,
    build_model,
    config_dict,
    model_fingerprint,
)
from training.sampler import CurriculumSampler

Status = Literal["completed", "preempted", "stopped", "migrated"]


@dataclass(frozen=True)
class TrainConfig:
    max_steps: int = 300
    """optimizer steps of the whole run; a resumed run continues toward the same number"""
    micro_batch_size: int = 32
    """examples per forward/backward pass at the start (the fast policy may change it)"""
    grad_accum_steps: int = 1
    """micro batches per optimizer step at the start; >= 2 also yields the gradient noise scale"""
    learning_rate: float = 1e-3
    """peak learning rate, reached after warmup"""
    min_learning_rate: float = 1e-4
    """floor of the cosine decay (nanoGPT: about learning_rate / 10)"""
    warmup_steps: int = 20
    """linear warmup steps"""
    lr_decay_steps: int | None = None
    """step where the cosine reaches min_learning_rate; None = max_steps"""
    weight_decay: float = 0.1
    """AdamW weight decay on matrices (not on biases, norms)"""
    beta1: float = 0.9
    """AdamW beta1"""
    beta2: float = 0.99
    """AdamW beta2 (nanoGPT's choice for small char models)"""
    grad_clip: float = 1.0
    """clip the global gradient norm to this; 0 disables clipping"""
    eval_every_steps: int = 50
    """evaluate on the fixed held-out batches every this many steps (and at the end)"""
    eval_batches: int = 4
    """number of fixed held-out batches per evaluation"""
    eval_batch_size: int = 64
    """examples per held-out batch"""
    checkpoint_every_steps: int = 100
    """periodic checkpoint interval; 0 = only on stop, preemption, policy request and the end"""
    keep_checkpoints: int = 2
    """newest step checkpoints kept in <out_dir>/checkpoints (older ones are deleted)"""
    fast_every_steps: int = 10
    """call the fast policy every this many steps"""
    seed: int = 1337
    """seeds model init (torch) and the sampler's shuffles (numpy)"""
    price_usd_per_hour: float = 0.0
    """price of the instance the run stands for; set by the caller from the price list"""
    instance_type: str = "local"
    """instance type the price is for (recorded only)"""
    num_threads: int = 1
    """torch intra-op threads during training (restored afterwards)"""
    run_id: str = ""
    """telemetry/run name; empty = the checkpoint's run id on resume, else a new one"""
    model: GPTConfig | CNNConfig | None = None
    """model architecture; None = the default for the data (GPT over its vocab, or the CNN)"""
    preemption_notice_s: float = 120.0
    """notice a spot preemption gives (AWS: two minutes); reported to the fast policy"""
    telemetry_events_per_segment: int = 1000
    """events per telemetry segment before it is sealed and the next one starts"""

    def __post_init__(self) -> None:
        positive = ("max_steps", "micro_batch_size", "grad_accum_steps", "eval_every_steps",
                    "eval_batches", "eval_batch_size", "keep_checkpoints", "fast_every_steps",
                    "num_threads", "telemetry_events_per_segment")
        for name in positive:
            if getattr(self, name) < 1:
                raise ValueError(f"TrainConfig.{name}={getattr(self, name)} must be >= 1")
        for name in ("warmup_steps", "checkpoint_every_steps", "weight_decay", "grad_clip",
                     "price_usd_per_hour", "preemption_notice_s"):
            if getattr(self, name) < 0:
                raise ValueError(f"TrainConfig.{name}={getattr(self, name)} must be >= 0")
        if not 0 < self.min_learning_rate <= self.learning_rate:
            raise ValueError(
                f"TrainConfig needs 0 < min_learning_rate ({self.min_learning_rate}) <= "
                f"learning_rate ({self.learning_rate})"
            )


@dataclass(frozen=True)
class TrainResult:
    status: Status
    run_id: str
    steps: int
    final_eval_loss: float | None
    final_eval_accuracy: float | None  # images only
    samples_seen: int
    tokens_seen: int  # text only (0 for images)
    elapsed_s: float  # across resumes
    cost_usd: float  # elapsed_s billed at price_usd_per_hour
    checkpoint_path: Path
    checkpoint_sha256: str
    telemetry_dir: Path  # <out_dir>/telemetry/<run_id>: pass to telemetry.store.ingest


def get_lr(step: int, config: TrainConfig) -> float:
    """Linear warmup, then cosine decay to min_learning_rate (nanoGPT's `get_lr`)."""
    decay_steps = config.lr_decay_steps or config.max_steps
    if step < config.warmup_steps:
        return config.learning_rate * (step + 1) / (config.warmup_steps + 1)
    if step >= decay_steps:
        return config.min_learning_rate
    ratio = (step - config.warmup_steps) / max(1, decay_steps - config.warmup_steps)
    coeff = 0.5 * (1.0 + math.cos(math.pi * ratio))
    return config.min_learning_rate + coeff * (config.learning_rate - config.min_learning_rate)


def _make_optimizer(model: torch.nn.Module, config: TrainConfig) -> torch.optim.Optimizer:
    # nanoGPT: decay matrices (embeddings, weights), not biases and norm gains.
    params = list(model.parameters())
    groups = [
        {"params": [p for p in params if p.dim() >= 2], "weight_decay": config.weight_decay},
        {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
    ]
    return torch.optim.AdamW(groups, lr=config.learning_rate, betas=(config.beta1, config.beta2))


def train(
    config: TrainConfig,
    examples: ExampleSet,
    curriculum: Curriculum | None,
    out_dir: str | Path,
    *,
    fast_policy: FastPolicy | None = None,
    resume_from: str | Path | None = None,
    progress: bool = False,
    stop_after_steps: int | None = None,
) -> TrainResult:
    """Trains (or resumes) a run and returns where it stands; see the module docstring.

    `curriculum=None` trains on every train example at weight 1. `stop_after_steps` stops this
    call after that many steps with a checkpoint (status "stopped").
    """
    started = time.perf_counter()  # billing starts here: set-up is paid time too
    if stop_after_steps is not None and stop_after_steps < 0:
        raise ValueError(f"stop_after_steps={stop_after_steps} must be >= 0 or None")
    out_dir = Path(out_dir)
    model_kind = MODEL_KIND_FOR_DATA.get(examples.kind, "")
    model_config = config.model or default_model_config(examples)
    check_examples_fit(examples, model_config)
    fingerprint = model_fingerprint(model_kind, model_config)
    state = None
    if resume_from is not None:
        state = load_checkpoint(
            resume_from,
            expected_model_fingerprint=fingerprint,
            expected_model_config=config_dict(model_config),
        )
    run_id = config.run_id or (state["run_id"] if state else "")
    run_id = run_id or f"{model_kind}-{time.strftime('%Y%m%dT%H%M%S')}-{uuid.uuid4().hex[:6]}"
    telemetry_root = out_dir / "telemetry"
    rank_dir(telemetry_root, run_id, 0)  # validates run_id before anything is written
    previous_threads = torch.get_num_threads()
    torch.set_num_threads(config.num_threads)
    try:
        torch.manual_seed(config.seed)
        model = build_model(model_kind, model_config)
        optimizer = _make_optimizer(model, config)
        sampler = CurriculumSampler(
            examples, curriculum, seed=config.seed, max_steps=config.max_steps
        )
        run = RunState(
            run_id=run_id,
            micro_batch_size=config.micro_batch_size,
            grad_accum_steps=config.grad_accum_steps,
        )
        if state is not None:
            run = restore_state(
                state, examples=examples, model=model, optimizer=optimizer, sampler=sampler,
                source=str(resume_from),
            )
            run.run_id = run_id
        loop = _Loop(
            config=config, examples=examples, curriculum=curriculum, out_dir=out_dir,
            model_kind=model_kind, model_config=model_config, model=model, optimizer=optimizer,
            sampler=sampler, run=run, policy=fast_policy or NoOpFastPolicy(), started=started,
        )
        with SegmentWriter(
            telemetry_root, run_id, events_per_segment=config.telemetry_events_per_segment
        ) as writer:
            loop.writer = writer
            writer.write(RunStartEvent(
                run_id=run_id, step=run.step, model_kind=model_kind,
                model_config=config_dict(model_config), model_fingerprint=fingerprint,
                train_config=dataclasses.asdict(config), data_fingerprint=examples.fingerprint,
                curriculum_version=curriculum.version if curriculum else None,
                instance_type=config.instance_type, price_usd_per_hour=config.price_usd_per_hour,
                resumed_from=str(resume_from) if resume_from is not None else None,
                previous_curriculum_version=state["curriculum_version"] if state else None,
            ))
            try:
                status = loop.execute(progress=progress, stop_after_steps=stop_after_steps)
            except BaseException as error:
                writer.write(loop.end_event("failed", error=repr(error)))
                raise
            writer.write(loop.end_event(status))
    finally:
        torch.set_num_threads(previous_threads)
    assert loop.checkpoint_path is not None and loop.checkpoint_sha256 is not None
    return TrainResult(
        status=status, run_id=run_id, steps=run.step, final_eval_loss=run.last_eval_loss,
        final_eval_accuracy=run.last_eval_accuracy, samples_seen=run.samples_seen,
        tokens_seen=run.tokens_seen, elapsed_s=run.elapsed_s, cost_usd=run.cost_usd,
        checkpoint_path=loop.checkpoint_path, checkpoint_sha256=loop.checkpoint_sha256,
        telemetry_dir=telemetry_root / run_id,
    )


@dataclass
class _Loop:
    """The loop's working set, so its parts can be small methods."""

    config: TrainConfig
    examples: ExampleSet
    curriculum: Curriculum | None
    out_dir: Path
    model_kind: str
    model_config: GPTConfig | CNNConfig
    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    sampler: CurriculumSampler
    run: RunState
    policy: FastPolicy
    started: float  # time.perf_counter() when this process began on the run
    writer: SegmentWriter | None = None
    checkpoint_path: Path | None = None
    checkpoint_sha256: str | None = None
    _checkpoint_step: int | None = None
    _last: dict[str, Any] | None = None  # the latest step's figures, for the fast policy

    def __post_init__(self) -> None:
        self._elapsed_before_s = self.run.elapsed_s
        self._eval_batches = fixed_eval_batches(
            self.examples, self.config.eval_batches, self.config.eval_batch_size
        )
        self._tokens_per_example = tokens_per_example(self.examples)

    # -- bookkeeping ------------------------------------------------------------------------
    def _tick_clock(self) -> None:
        self.run.elapsed_s = self._elapsed_before_s + (time.perf_counter() - self.started)
        self.run.cost_usd = self.run.elapsed_s * self.config.price_usd_per_hour / 3600.0

    def _write(self, event: Any) -> None:
        assert self.writer is not None
        self.writer.write(event)

    def _learning_rate(self) -> float:
        return get_lr(self.run.step, self.config) * self.run.lr_scale

    def end_event(self, status: str, error: str | None = None) -> RunEndEvent:
        self._tick_clock()
        return RunEndEvent(
            run_id=self.run.run_id, step=self.run.step, status=status,
            elapsed_s=self.run.elapsed_s, cost_usd=self.run.cost_usd,
            samples_seen=self.run.samples_seen, tokens_seen=self.run.tokens_seen,
            final_eval_loss=self.run.last_eval_loss,
            final_eval_accuracy=self.run.last_eval_accuracy,
            checkpoint_path=str(self.checkpoint_path) if self.checkpoint_path else None,
            checkpoint_sha256=self.checkpoint_sha256, error=error,
        )

    # -- the loop ---------------------------------------------------------------------------
    def execute(self, *, progress: bool, stop_after_steps: int | None) -> Status:
        status: Status = "completed"
        steps_this_call = 0
        bar = tqdm(total=self.config.max_steps, initial=self.run.step, desc=self.run.run_id,
                   unit="step", disable=not progress, dynamic_ncols=True)
        with bar, fast.PreemptionSignal() as notice:
            while self.run.step < self.config.max_steps:
                # Step boundary: everything below is in the checkpoint, so stopping here is exact.
                if notice.pending:
                    self._on_preemption(notice)
                    return "preempted"
                if stop_after_steps is not None and steps_this_call >= stop_after_steps:
                    self._checkpoint("stop")
                    return "stopped"
                last = self._step()
                steps_this_call += 1
                bar.update(1)
                bar.set_postfix(loss=f"{last['train_loss']:.3f}", usd=f"{self.run.cost_usd:.4f}",
                                refresh=False)
                if self.run.step % self.config.fast_every_steps == 0:
                    response = self._fast_tick(last, notice_s=None, apply=True)
                    if response is PreemptionResponse.CHECKPOINT_NOW:
                        self._checkpoint("fast_policy")
                    elif response is PreemptionResponse.MIGRATE:
                        status = "migrated"
                if (self.run.step % self.config.eval_every_steps == 0
                        or self.run.step == self.config.max_steps):
                    self._evaluate()
                if status == "migrated":
                    self._checkpoint("migrate")
                    return status
                every = self.config.checkpoint_every_steps
                if every and self.run.step % every == 0:
                    self._checkpoint("interval")
            if self.run.last_eval_step != self.run.step:
                self._evaluate()
            self._checkpoint("final")
        return status

    def _step(self) -> dict[str, Any]:
        began = time.perf_counter()
        learning_rate = self._learning_rate()
        micro, accum = self.run.micro_batch_size, self.run.grad_accum_steps
        outcome = train_step(
            model=self.model, optimizer=self.optimizer, sampler=self.sampler,
            examples=self.examples, step=self.run.step, learning_rate=learning_rate,
            micro_batch_size=micro, grad_accum_steps=accum, grad_clip=self.config.grad_clip,
            noise_scale=self.run.noise_scale,
        )
        self.run.step += 1
        self.run.samples_seen += micro * accum
        self.run.tokens_seen += micro * accum * self._tokens_per_example
        step_time_ms = (time.perf_counter() - began) * 1000.0
        self._tick_clock()
        noise = self.run.noise_scale.value if accum >= 2 else math.nan
        last = {
            "train_loss": outcome.train_loss, "learning_rate": learning_rate,
            "grad_norm": outcome.grad_norm, "grad_noise_scale": noise, "micro_batch_size": micro,
            "grad_accum_steps": accum, "step_time_ms": step_time_ms,
        }
        self._write(StepEvent(
            run_id=self.run.run_id, step=self.run.step, samples_seen=self.run.samples_seen,
            tokens_seen=self.run.tokens_seen, elapsed_s=self.run.elapsed_s,
            cost_usd=self.run.cost_usd, sampler_phase=self.sampler.phase, **last,
        ))
        self._last = last
        return last

    def _fast_tick(
        self, last: dict[str, Any], *, notice_s: float | None, apply: bool
    ) -> PreemptionResponse:
        """Asks the fast policy, records the decision, applies it if `apply`."""
        self._tick_clock()
        observation = fast.build_observation(
            step=self.run.step, elapsed_s=self.run.elapsed_s, train_loss=last["train_loss"],
            grad_norm=last["grad_norm"], grad_noise_scale=last["grad_noise_scale"],
            micro_batch_size=self.run.micro_batch_size,
            grad_accum_steps=self.run.grad_accum_steps, learning_rate=last["learning_rate"],
            step_time_ms=last["step_time_ms"], preemption_notice_s=notice_s,
            seconds_since_checkpoint=self.run.elapsed_s - self.run.last_checkpoint_elapsed_s,
            checkpoint_cost_s=self.run.last_checkpoint_cost_s,
        )
        name = str(getattr(self.policy, "name", type(self.policy).__name__))
        action = self.policy.act(observation)
        fast.validate_action(action, name)
        self._write(DecisionEvent(
            run_id=self.run.run_id, step=self.run.step, layer="fast", policy=name,
            action=fast.action_record(action), reason=action.reason,
            numbers=dict(action.numbers), observation=fast.observation_record(observation),
        ))
        if apply:
            self.run.micro_batch_size = int(action.micro_batch_size)
            self.run.grad_accum_steps = int(action.grad_accum_steps)
            # The policy's rate rescales the schedule, so warmup/cosine carry on around it;
            # an unchanged rate gives a factor of exactly 1.0 (bitwise no-op).
            if action.learning_rate != observation.learning_rate:
                self.run.lr_scale *= action.learning_rate / observation.learning_rate
        return action.preemption_response

    def _on_preemption(self, notice: fast.PreemptionSignal) -> None:
        """SIGTERM: the node is being reclaimed. The policy is asked and its answer recorded,
        but the loop checkpoints and exits whatever it says, and applies no batch change, so
        the checkpoint equals the state an uninterrupted run has at this boundary."""
        notice_s = notice.notice_left_s(self.config.preemption_notice_s)
        if self._last is not None:
            response = self._fast_tick(self._last, notice_s=notice_s, apply=False).value
        else:
            response = "no step yet"
        self._write(PreemptionEvent(
            run_id=self.run.run_id, step=self.run.step, signal_name=notice.signal_name or "",
            notice_s=notice_s if notice_s is not None else math.nan,
            received_wall_time_s=notice.received_wall_time_s or math.nan,
            response=f"checkpoint_and_exit (policy said {response})",
        ))
        self._checkpoint("preemption")

    def _evaluate(self) -> None:
        began = time.perf_counter()
        loss, accuracy, count = evaluate(self.model, self.examples, self._eval_batches)
        self.run.last_eval_loss, self.run.last_eval_accuracy = loss, accuracy
        self.run.last_eval_step = self.run.step
        self._write(EvalEvent(
            run_id=self.run.run_id, step=self.run.step, eval_loss=loss, eval_accuracy=accuracy,
            eval_examples=count, eval_ms=(time.perf_counter() - began) * 1000.0,
        ))

    def _checkpoint(self, reason: str) -> None:
        if self._checkpoint_step == self.run.step and self.checkpoint_path is not None:
            return  # this boundary is already saved
        began = time.perf_counter()
        self._tick_clock()
        # The state records the cost of the checkpoint before this one; this one's cost is
        # known only after writing it, and is recorded in telemetry and in the next one.
        state = build_state(
            run=self.run, model_kind=self.model_kind, model_config=self.model_config,
            train_config=dataclasses.asdict(self.config), examples=self.examples,
            curriculum=self.curriculum, model=self.model, optimizer=self.optimizer,
            sampler=self.sampler,
        )
        directory = self.out_dir / "checkpoints"
        path = directory / checkpoint_name(self.run.step)
        checksum = save_checkpoint(path, state)
        prune_checkpoints(directory, self.config.keep_checkpoints)
        save_s = time.perf_counter() - began
        self._tick_clock()
        self.run.last_checkpoint_cost_s = save_s
        self.run.last_checkpoint_elapsed_s = self.run.elapsed_s
        self.checkpoint_path, self.checkpoint_sha256 = path, checksum
        self._checkpoint_step = self.run.step
        self._write(CheckpointEvent(
            run_id=self.run.run_id, step=self.run.step, path=str(path), sha256=checksum,
            size_bytes=path.stat().st_size, save_ms=save_s * 1000.0, reason=reason,
        ))
