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
run reproduces the uninterrupted run's losses bit for bit (with the same thread count). Interval
checkpoints are snapshotted in memory and written in the background (`training._loop_persist`);
`on_checkpoint(CheckpointInfo)` is called once each one is durable on local disk.

Around the loop: one trainer per `out_dir` (`training.run_lock`); temp files of writers that were
killed are removed at start; `resume_from` may be a checkpoint or the checkpoint folder (the
newest checkpoint that passes its check; the ones skipped are warned about and recorded). A
resume bills from the newest elapsed time the run's ledger committed (`training.ledger`: the
trainer's own chained, optionally keyed record of its clock), not from the checkpoint's: the
seconds a killed process worked past its checkpoint were paid for (`RunStartEvent.lost_s`), and
the steps it committed past it are replayed (`replay_from_step`..`replay_to_step`). Telemetry is
only cross-checked: a figure there beyond the ledger is warned about and recorded
(`billing_warnings`), never billed. Telemetry records a full disk refused are kept in the ledger
and written first when the run resumes.

Statuses: "completed" (max_steps reached), "preempted" (SIGTERM), "stopped" (`stop_after_steps`
reached), "migrated" (the fast policy answered MIGRATE, or the measured save did not fit in the
notice). Every one but "migrated" ends with a new checkpoint; "migrated" leaves the last good one,
and `TrainResult.steps` is then the step reached, not the checkpoint's step (the replacement node
replays the difference)."""

from __future__ import annotations

import dataclasses
import time
import uuid
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from controllers.checkpoint_interval import using_rule
from controllers.fast_types import FastPolicy, NoOpFastPolicy
from telemetry.events import RunStartEvent
from telemetry.reader import latest_recorded
from telemetry.writer import SegmentWriter, rank_dir
from training import distributed
from training._loop_config import TrainConfig, get_lr
from training._loop_fast import request_stop
from training._loop_persist import CheckpointInfo, CheckpointWriteError
from training._loop_run import LoopRun, Status, TrainingStoppedError
from training._loop_state import RunState, check_examples_fit, default_model_config, restore_state
from training.checkpoint import (
    RunIdentity,
    clean_orphaned_temp_files,
    fork_problem,
    load_checkpoint,
    read_checksum,
    scan_checkpoints,
)
from training.consumption import consumption_path
from training.data_types import Curriculum, ExampleSet
from training.dynamic_pruning import DynamicPruningConfig
from training.ledger import (
    LedgerRead,
    LedgerWriter,
    committed_bill,
    ledger_path,
    pending_telemetry,
    read_ledger,
)
from training.model import (
    MODEL_KIND_FOR_DATA,
    CNNConfig,
    GPTConfig,
    build_model,
    config_dict,
    model_fingerprint,
)
from training.run_lock import RunFolderLock, RunFolderLockedError
from training.sampler import CurriculumSampler, DynamicPruningSampler, TrainSampler

__all__ = ["CheckpointInfo", "CheckpointWriteError", "RunFolderLockedError", "Status",
           "TrainConfig", "TrainResult", "TrainingStoppedError", "get_lr", "request_stop", "train"]


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


@dataclass(frozen=True)
class _Resume:
    state: dict[str, Any]
    path: Path  # the checkpoint file resumed from
    skipped: list[dict[str, str]]  # checkpoints of a resume folder that failed their check


def _load_resume(
    resume_from: Path, fingerprint: str, model_config: dict[str, Any], *,
    run_id: str | None = None, data_fingerprint: str | None = None, seed: int | None = None,
) -> _Resume:
    """Loads `resume_from`: a checkpoint file, or a folder's newest checkpoint that passes.

    Both are checked for origin (issue 31: the deployment's HMAC, the label, and that it is this
    run's: `run_id` when the config names one, data, model config, seed; `training.checkpoint`).
    A file the caller chose is refused on a mismatch (CheckpointError naming the file); in a
    folder a mismatching, hostile or forked checkpoint is skipped with its reason, the resume
    falls back to the previous good one, warns and records what it skipped."""
    identity = RunIdentity(run_id=run_id or None, data_fingerprint=data_fingerprint,
                           model_fingerprint=fingerprint, seed=seed)
    skipped: list[dict[str, str]] = []
    path = resume_from
    if resume_from.is_dir():
        good, tried_files = scan_checkpoints(resume_from, identity=identity)
        skipped = [{"path": str(p), "reason": why} for p, why in tried_files]
        if good is None:
            tried = "; ".join(f"{s['path']}: {s['reason']}" for s in skipped) or "none found"
            raise FileNotFoundError(
                f"no usable checkpoint in {resume_from} (checked: {tried}); pass a checkpoint "
                "file or a folder holding one, or start fresh (resume_from=None)"
            )
        if skipped:
            warnings.warn(
                f"resuming from {good.path}, an older checkpoint: the newer ones failed their "
                "check and were skipped (" + "; ".join(f"{s['path']}: {s['reason']}"
                                                      for s in skipped) + ")",
                RuntimeWarning, stacklevel=3,
            )
        path = good.path
    else:
        fork = fork_problem(path)  # a folder resume skips a fork; a file the caller chose: warn
        if fork:
            warnings.warn(f"resuming {path}, which the caller chose, although {fork}",
                          RuntimeWarning, stacklevel=3)
    # The model config is checked after the load (its message shows both configs); the rest of
    # the identity before it, from the signed manifest.
    state = load_checkpoint(
        path, expected_model_fingerprint=fingerprint, expected_model_config=model_config,
        identity=dataclasses.replace(identity, model_fingerprint=None),
    )
    if identity.run_id is None:
        warnings.warn(
            f"resuming {path}, a checkpoint of run {state.get('run_id')!r}, with a config that "
            "names no run_id: whose checkpoint it is cannot be checked (only that this "
            "deployment wrote it, for this data, model and seed). Set TrainConfig.run_id to the "
            "run's id to have a checkpoint of another run refused",
            RuntimeWarning, stacklevel=3,
        )
    return _Resume(state=state, path=path, skipped=skipped)


@dataclass(frozen=True)
class _Billing:
    replay_from_step: int | None = None
    replay_to_step: int | None = None
    lost_s: float | None = None
    warnings: tuple[str, ...] = ()  # what the bill ignored (RunStartEvent.billing_warnings)


def _telemetry_beyond_ledger(
    telemetry_run_dir: Path, billed_elapsed_s: float, committed_step: int
) -> list[str]:
    """The cross-check: telemetry figures past what the ledger commits, one sentence each.

    They are reported, never billed: telemetry is a folder anyone can add a sealed segment to."""
    try:
        recorded = latest_recorded(telemetry_run_dir) if telemetry_run_dir.is_dir() else None
    except (ValueError, OSError) as error:  # malformed telemetry must not stop the resume
        return [f"cannot read the telemetry of {telemetry_run_dir} ({error}); it was not "
                "cross-checked against the run ledger (the bill does not depend on it)"]
    if recorded is None:
        return []
    step, elapsed_s = recorded
    said = []
    if elapsed_s > billed_elapsed_s + 1e-6:
        said.append(f"telemetry of {telemetry_run_dir} records {elapsed_s:.3f} s, "
                    f"{elapsed_s - billed_elapsed_s:.3f} s past the {billed_elapsed_s:.3f} s the "
                    "run ledger commits: not billed (a segment there was planted or edited, or "
                    "the ledger lost lines: see its own warning)")
    if step > committed_step:
        said.append(f"telemetry of {telemetry_run_dir} records step {step}, past step "
                    f"{committed_step}, the newest the run ledger commits: not counted as replay")
    return said


def _bill_killed_work(run: RunState, ledger: LedgerRead, telemetry_run_dir: Path,
                      checkpoint_sha256: str | None = None) -> _Billing:
    """Moves a resumed run's clock to the newest time the run's ledger committed past its
    checkpoint (issue 31, class 4; `training.ledger`).

    A process killed after its checkpoint worked (and was paid) past it; the checkpoint's clock
    does not know, the ledger the trainer wrote does. The steps it committed past the checkpoint
    are done again: replay. Telemetry is only cross-checked: what it records beyond the ledger
    is warned about and recorded, never billed."""
    bill = committed_bill(ledger, state_step=run.step, state_elapsed_s=run.elapsed_s,
                          checkpoint_sha256=checkpoint_sha256)
    said = list(bill.warnings)
    said += _telemetry_beyond_ledger(telemetry_run_dir, bill.billed_elapsed_s,
                                     max(run.step, bill.newest_step or 0))
    for sentence in said:
        warnings.warn(f"resume bill: {sentence}", RuntimeWarning, stacklevel=3)
    if bill.lost_s is None:
        return _Billing(warnings=tuple(said))
    run.elapsed_s = bill.billed_elapsed_s
    if bill.replay_to_step is not None:
        return _Billing(replay_from_step=run.step, replay_to_step=bill.replay_to_step,
                        lost_s=bill.lost_s, warnings=tuple(said))
    return _Billing(lost_s=bill.lost_s, warnings=tuple(said))


def _checksum_or_none(path: Path) -> str | None:
    """The resumed checkpoint's sha256 from its manifest (it was verified when loaded)."""
    try:
        return read_checksum(path)
    except (ValueError, OSError, KeyError):
        return None


def _share_billing(billing: _Billing, run: RunState, ctx: distributed.DistContext | None,
                   ) -> _Billing:
    """Under torchrun rank 0 bills (from its ledger, the one its checkpoints hold the clock of)
    and every other rank takes its answer, so the gang goes on from one clock."""
    if ctx is None:
        return billing
    shared = distributed.broadcast_object(billing, ctx)
    if ctx.rank != 0 and shared.lost_s is not None:
        run.elapsed_s += shared.lost_s
    return shared


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
    on_checkpoint: Callable[[CheckpointInfo], None] | None = None,
    emulation: distributed.Emulation | None = None,
    on_start: Callable[[], None] | None = None,
) -> TrainResult:
    """Trains (or resumes) a run and returns where it stands; see the module docstring.

    `curriculum=None` trains on every train example at weight 1. `stop_after_steps` stops this
    call after that many steps with a checkpoint (status "stopped"). `pruning`: dynamic pruning
    (item 6 of the module docstring); None keeps the static curriculum sampler. `resume_from`:
    a checkpoint file or a checkpoint folder. `on_checkpoint`: called (from the persist thread
    for background checkpoints) once a checkpoint is durable; it must return quickly.
    `on_start`: called once the model is built, restored and its run start recorded, just
    before the first step of this call (the node's clock of `trainwise.gang` starts there).

    Under torchrun with more than one rank (torch.distributed initialised, e.g. by
    `training.ddp_worker`) every rank calls `train` with the same arguments and trains its
    share of each global batch (`training.distributed`); `grad_accum_steps` is then the global
    number of micro batches. `emulation` (benchmarks, torchrun only): emulated device time and
    a replayed straggler slowdown for this rank (`training.distributed.Emulation`).

    Raises RunFolderLockedError when another trainer holds `out_dir`, TrainingStoppedError when
    telemetry cannot be written (after checkpointing).
    """
    started = time.perf_counter()  # billing starts here: set-up is paid time too
    if stop_after_steps is not None and stop_after_steps < 0:
        raise ValueError(f"stop_after_steps={stop_after_steps} must be >= 0 or None")
    out_dir = Path(out_dir)
    model_kind = MODEL_KIND_FOR_DATA.get(examples.kind, "")
    model_config = config.model or default_model_config(examples)
    check_examples_fit(examples, model_config)
    telemetry_root = out_dir / "telemetry"
    if config.run_id:
        rank_dir(telemetry_root, config.run_id, 0)  # validates run_id before anything is written
    ctx = distributed.current()  # None unless torchrun started more than one rank
    if ctx is not None and pruning is not None:
        raise ValueError(
            "dynamic pruning under torchrun is not supported yet (its loss table would differ "
            "per rank); train with pruning=None or in a single process"
        )
    lock = (RunFolderLock(out_dir) if ctx is None
            else distributed.gang_lock(out_dir, ctx, lambda: RunFolderLock(out_dir)))
    # The schedule's checkpoint-interval rule for this call only (a live switch may change it
    # within; the process's rule is back when the call ends, whatever happened).
    with lock, using_rule(config.checkpoint_interval_rule):
        # Under the lock no other writer is alive: every temp file is an orphan of a killed one.
        if (out_dir / "checkpoints").is_dir() and (ctx is None or ctx.rank == 0):
            clean_orphaned_temp_files(out_dir / "checkpoints")
        if ctx is not None:
            ctx.emulation = emulation
        return _train_locked(
            config, examples, curriculum, out_dir, model_kind=model_kind,
            model_config=model_config, started=started, fast_policy=fast_policy,
            resume_from=resume_from, progress=progress, stop_after_steps=stop_after_steps,
            pruning=pruning, on_checkpoint=on_checkpoint, ctx=ctx, on_start=on_start,
        )


def _train_locked(
    config: TrainConfig,
    examples: ExampleSet,
    curriculum: Curriculum | None,
    out_dir: Path,
    *,
    model_kind: str,
    model_config: GPTConfig | CNNConfig,
    started: float,
    fast_policy: FastPolicy | None,
    resume_from: str | Path | None,
    progress: bool,
    stop_after_steps: int | None,
    pruning: DynamicPruningConfig | None,
    on_checkpoint: Callable[[CheckpointInfo], None] | None,
    ctx: distributed.DistContext | None = None,
    on_start: Callable[[], None] | None = None,
) -> TrainResult:
    fingerprint = model_fingerprint(model_kind, model_config)
    resume = None
    if resume_from is not None:
        resume = _load_resume(Path(resume_from), fingerprint, config_dict(model_config),
                              run_id=config.run_id, data_fingerprint=examples.fingerprint,
                              seed=config.seed)
    state = resume.state if resume else None
    run_id = config.run_id or (state["run_id"] if state else "")
    run_id = run_id or f"{model_kind}-{time.strftime('%Y%m%dT%H%M%S')}-{uuid.uuid4().hex[:6]}"
    if ctx is not None:
        run_id = distributed.broadcast_object(run_id, ctx)  # one run, one id on every rank
    telemetry_root = out_dir / "telemetry"
    rank_dir(telemetry_root, run_id, 0)  # validates run_id before anything is written
    previous_threads = torch.get_num_threads()
    torch.set_num_threads(config.num_threads)
    sampler: TrainSampler | None = None
    ledger: LedgerWriter | None = None
    try:
        torch.manual_seed(config.seed)
        model = build_model(model_kind, model_config)
        if ctx is not None:
            model = model.to(ctx.device)
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
        billing = _Billing()
        rank = ctx.rank if ctx else 0
        # The run ledger (training.ledger): read before this process appends to it.
        committed = read_ledger(ledger_path(out_dir, run_id, rank), run_id=run_id, rank=rank)
        if resume is not None:
            run = restore_state(
                resume.state, examples=examples, model=model, optimizer=optimizer,
                sampler=sampler, source=str(resume.path),
                rank=rank, world_size=ctx.world_size if ctx else 1,
            )
            run.run_id = run_id
            if rank == 0:
                billing = _bill_killed_work(run, committed, telemetry_root / run_id,
                                            _checksum_or_none(resume.path))
            billing = _share_billing(billing, run, ctx)
        ledger = LedgerWriter(out_dir, run_id, rank=rank, head=committed.head)
        parts: dict[str, Any] = dict(
            config=config, examples=examples, curriculum=curriculum, out_dir=out_dir,
            model_kind=model_kind, model_config=model_config, model=model, optimizer=optimizer,
            sampler=sampler, run=run, policy=fast_policy or NoOpFastPolicy(), started=started,
            on_checkpoint=on_checkpoint, ledger=ledger,
        )
        if ctx is None:
            loop = LoopRun(**parts)
        else:
            distributed.micro_counts(config.grad_accum_steps, [1.0] * ctx.world_size)  # checks
            loop = distributed.DistributedLoopRun(
                **parts, ctx=ctx, ddp=distributed.wrap_model(model, ctx)
            )
        with SegmentWriter(
            telemetry_root, run_id, events_per_segment=config.telemetry_events_per_segment,
            rank=ctx.rank if ctx else 0,
        ) as writer:
            loop.writer = writer
            # Records a full telemetry disk refused before (issue 31, class 5) go first, once.
            for record in pending_telemetry(committed, telemetry_root / run_id):
                loop.write(record)
            loop.write(RunStartEvent(
                run_id=run_id, rank=loop.rank, step=run.step, model_kind=model_kind,
                model_config=config_dict(model_config), model_fingerprint=fingerprint,
                train_config=dataclasses.asdict(config), data_fingerprint=examples.fingerprint,
                curriculum_version=curriculum.version if curriculum else None,
                instance_type=config.instance_type, price_usd_per_hour=config.price_usd_per_hour,
                resumed_from=str(resume.path) if resume is not None else None,
                previous_curriculum_version=state["curriculum_version"] if state else None,
                replay_from_step=billing.replay_from_step, replay_to_step=billing.replay_to_step,
                lost_s=billing.lost_s, skipped_checkpoints=resume.skipped if resume else [],
                billing_warnings=list(billing.warnings),
            ))
            try:
                if on_start is not None:
                    on_start()
                status = loop.execute(progress=progress, stop_after_steps=stop_after_steps)
            except BaseException as error:
                loop.drain()  # a background checkpoint in flight still becomes durable
                loop.write(loop.end_event("failed", error=repr(error)))
                raise
            loop.write(loop.end_event(status))
            if loop.telemetry_error is not None:  # the run's end could not be recorded
                raise loop.stopped_error()
    finally:
        torch.set_num_threads(previous_threads)
        if sampler is not None:
            sampler.close()  # flushes the consumption record, also when the run failed
        if ledger is not None:
            ledger.close()  # writes what a refusing disk held back, if it takes it now
    assert loop.checkpoint_path is not None and loop.checkpoint_sha256 is not None
    return TrainResult(
        status=status, run_id=run_id, steps=run.step, final_eval_loss=run.last_eval_loss,
        final_eval_accuracy=run.last_eval_accuracy, samples_seen=run.samples_seen,
        tokens_seen=run.tokens_seen, elapsed_s=run.elapsed_s, cost_usd=run.cost_usd,
        checkpoint_path=loop.checkpoint_path, checkpoint_sha256=loop.checkpoint_sha256,
        telemetry_dir=telemetry_root / run_id,
    )
