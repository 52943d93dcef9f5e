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
6. With `pruning=DynamicPruningConfig(...)` batches come from `DynamicPruningSampler` instead
   (InfoBatch-style dynamic pruning on a running loss table fed by the training batches' own
   per-example losses; the rate set by the slow layer at fast-tick boundaries). `max_steps` is
   then the full-data budget: the run covers the same epochs, pruned ones in fewer steps, and
   writes `<telemetry>/<run_id>/consumption.jsonl` (see `training.consumption`).

A checkpoint is written at step boundaries and holds everything to continue exactly: a resumed
run reproduces the uninterrupted run's losses bit for bit (with the same thread count).

Statuses: "completed" (max_steps reached), "preempted" (SIGTERM), "stopped" (`stop_after_steps`
reached), "migrated" (the fast policy answered MIGRATE). Every one ends with a checkpoint.
"""

from __future__ import annotations

import dataclasses
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

import torch

from controllers.fast_types import FastPolicy, NoOpFastPolicy
from telemetry.events import RunStartEvent
from telemetry.writer import SegmentWriter, rank_dir
from training._loop_config import TrainConfig, get_lr
from training._loop_run import LoopRun, Status
from training._loop_state import RunState, check_examples_fit, default_model_config, restore_state
from training.checkpoint import load_checkpoint
from training.consumption import consumption_path
from training.data_types import Curriculum, ExampleSet
from training.dynamic_pruning import DynamicPruningConfig
from training.model import MODEL_KIND_FOR_DATA, build_model, config_dict, model_fingerprint
from training.sampler import CurriculumSampler, DynamicPruningSampler, TrainSampler

__all__ = ["Status", "TrainConfig", "TrainResult", "get_lr", "train"]


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
    pruning: DynamicPruningConfig | None = None,
) -> TrainResult:
    """Trains (or resumes) a run and returns where it stands; see the module docstring.

    `curriculum=None` trains on every train example at weight 1. `stop_after_steps` stops this
    call after that many steps with a checkpoint (status "stopped"). `pruning`: dynamic pruning
    (item 6 of the module docstring); None keeps the static curriculum sampler.
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
    sampler: TrainSampler | None = None
    try:
        torch.manual_seed(config.seed)
        model = build_model(model_kind, model_config)
        optimizer = _make_optimizer(model, config)
        if pruning is None:
            sampler = CurriculumSampler(
                examples, curriculum, seed=config.seed, max_steps=config.max_steps
            )
        else:
            sampler = DynamicPruningSampler(
                examples, curriculum, config=pruning, seed=config.seed,
                max_steps=config.max_steps,
                samples_per_step=config.micro_batch_size * config.grad_accum_steps,
                model_fingerprint=fingerprint,
                consumption_path=consumption_path(telemetry_root, run_id),
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
        loop = LoopRun(
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
        if sampler is not None:
            sampler.close()  # flushes the consumption record, also when the run failed
    assert loop.checkpoint_path is not None and loop.checkpoint_sha256 is not None
    return TrainResult(
        status=status, run_id=run_id, steps=run.step, final_eval_loss=run.last_eval_loss,
        final_eval_accuracy=run.last_eval_accuracy, samples_seen=run.samples_seen,
        tokens_seen=run.tokens_seen, elapsed_s=run.elapsed_s, cost_usd=run.cost_usd,
        checkpoint_path=loop.checkpoint_path, checkpoint_sha256=loop.checkpoint_sha256,
        telemetry_dir=telemetry_root / run_id,
    )
