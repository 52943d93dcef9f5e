"""`trainwise.init()`: a user's own training loop under trainwise, in four calls.

    run = trainwise.init(max_steps=1000)
    loader = run.dataloader(dataset, batch_size=32)      # exact resume order, consumption record
    model, optimizer = run.track(model, optimizer)       # restored here when the run resumes
    while not run.done:
        for batch in loader:
            loss = train_step(model, optimizer, batch)
            run.step(loss=loss, samples=len(batch))      # telemetry, fast tick, notice
            if run.done:
                break
    run.finish()

What `step` does, in order: the step event goes to telemetry; a pending notice (SIGTERM, or the
node agent's notice file) is answered (checkpoint within the notice when the measured save fits,
then leave); every `fast_every_steps` the fast policy decides and its decision is recorded and
applied (the batch size reaches the loop through `run.dataloader`); an interval checkpoint is
written and uploaded to the object store with its commit marker.

Leaving on a notice raises `Preempted` (a SystemExit, exit code 143 as for a SIGTERM), which
passes through a loop's `except Exception`; the launcher resumes the run, and `init` restores the
newest checkpoint that passes its check (local, else the store's). Integrations that own the loop
(HF Trainer, Lightning) pass `on_notice="stop"` and read `run.should_stop` instead.

What a framework cannot apply is refused at `init` with the reason (`Capabilities`): a fast lever
that needs a loop the SDK does not drive is refused by name, never silently ignored.

Several ranks (torchrun, `world_size > 1`): `init` joins the process group (`trainwise.sdk.ranks`),
`step` agrees on a notice across the ranks so that all save the same step and leave together,
and a resume takes the newest step every rank holds (`trainwise.sdk.resume`).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import secrets
import signal
import threading
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from controllers.fast_heuristic import HeuristicFastPolicy
from controllers.fast_types import FastAction, FastObservation, NoOpFastPolicy, PreemptionResponse
from telemetry.events import (
    CheckpointEvent,
    DecisionEvent,
    PreemptionEvent,
    RunEndEvent,
    RunStartEvent,
    StepEvent,
)
from telemetry.writer import SegmentWriter
from training import checkpoint as ckpt
from training._checkpoint_trust import RunIdentity
from training.consumption import ConsumptionWriter, consumption_path
from training.safe_files import write_atomic
from trainwise.sdk import device as sdk_device
from trainwise.sdk import ranks as sdk_ranks
from trainwise.sdk import resume as sdk_resume
from trainwise.sdk import state as sdk_state
from trainwise.sdk.data import DataChangedError, ResumableBatchSampler, TrackedLoader, ids_fingerprint
from trainwise.sdk.spec import PREEMPTED_EXIT_CODE, RunSpec, RunSpecError, resolve_spec


class Preempted(SystemExit):
    """The run left on a notice after its checkpoint was committed; the launcher resumes it."""

    def __init__(self, message: str) -> None:
        super().__init__(PREEMPTED_EXIT_CODE)
        self.message = message

    def __str__(self) -> str:
        return self.message


class ModelChangedError(ValueError):
    """A resume found a checkpoint written for another model architecture."""


@dataclass(frozen=True)
class Capabilities:
    """What the framework driving the loop lets the fast layer change."""

    framework: str = "plain"
    batch_size: bool = True  # through run.dataloader's sampler
    grad_accumulation: bool = False
    work_shares: bool = False
    # The SDK joins the ranks' process group and keeps them at one step (trainwise.sdk.ranks);
    # False for a framework that refuses several ranks itself (HF Trainer, Lightning).
    ranks: bool = True

    def refusals(self, levers: tuple[str, ...]) -> list[str]:
        why = []
        if "batch_scaling" in levers and not self.batch_size:
            why.append(f"batch_scaling: {self.framework} builds its own data loader once, so a "
                       "batch size chosen mid-run cannot reach it; leave the lever out of "
                       "fast_levers")
        if "straggler_shares" in levers and not self.work_shares:
            why.append(f"straggler_shares: {self.framework} under the SDK gives every rank an "
                       "equal share of each batch (uneven shares need the built-in trainer's "
                       "DDP loop); leave the lever out of fast_levers")
        return why


class Run:
    """One process's part of a run (see the module doc); build it with `trainwise.init`."""

    def __init__(self, spec: RunSpec, *, capabilities: Capabilities | None = None,
                 on_notice: str = "exit", install_signal_handler: bool = True) -> None:
        if on_notice not in ("exit", "stop"):
            raise RunSpecError(f"on_notice={on_notice!r}: use 'exit' (raise Preempted) or "
                               "'stop' (set run.should_stop for a framework's own loop)")
        self.spec, self.on_notice = spec, on_notice
        self.capabilities = capabilities or Capabilities()
        refused = self.capabilities.refusals(spec.fast_levers)
        if refused:
            raise RunSpecError("trainwise.init(): the fast layer cannot act here: "
                               + "; ".join(refused))
        self.run_id, self.rank = spec.run_id, spec.rank
        try:
            self.placement = sdk_device.choose(spec.device, spec.precision, spec.cpu_threads)
        except sdk_device.DeviceError as error:
            raise RunSpecError(f"trainwise.init(): {error}") from error
        self._ranks = (sdk_ranks.join(spec, self.placement.device) if self.capabilities.ranks
                       else None)
        self._start_id = self._draw_start_id()
        spec.checkpoint_dir.mkdir(parents=True, exist_ok=True)
        ckpt.clean_orphaned_temp_files(spec.checkpoint_dir)
        self.store = self._open_store()
        self.step_count = 0
        self.samples_seen = self.tokens_seen = 0
        self.done = self.should_stop = False
        self.status: str | None = None
        self.lineage = uuid.uuid4().hex
        self._model: torch.nn.Module | None = None
        self._optimizer: torch.optim.Optimizer | None = None
        self._scheduler: Any = None
        self._extra: dict[str, Any] = {}
        # name -> provider() of an integration's own state (Lightning's loop progress), saved
        # in every checkpoint beside the tracked objects; see keep_state
        self._kept_state: dict[str, Any] = {}
        self._loader: TrackedLoader | None = None
        self._data_fingerprint = ""
        self._elapsed_before_s = 0.0
        self._start_wall_s = time.time()
        self._last_step_t = time.perf_counter()
        self._last_checkpoint_t = time.perf_counter()
        self._last_checkpoint_step: int | None = None
        self._last_checkpoint_path: Path | None = None
        self._last_checkpoint_sha256: str | None = None
        self._checkpoint_cost_s = math.nan
        self._notice_wall_s: float | None = None
        self._rebalance_seen_ns: int | None = None  # mtime of the rebalance file answered
        self._notice_signal: str | None = None
        self._started = False
        self._closed = False
        self._decisions = 0
        self._last_train_loss = math.nan
        self.fast_policy = (NoOpFastPolicy() if spec.fast_policy == "noop"
                            else HeuristicFastPolicy(levers=spec.fast_levers))
        try:
            self._resume = self._find_resume()
        except BaseException:
            self._close_ranks()
            raise
        if self._resume is not None:
            state = self._resume["state"]
            self.step_count = int(state["step"])
            self.lineage = str(state.get("lineage") or self.lineage)
            self.samples_seen = int(state.get("samples_seen", 0))
            self.tokens_seen = int(state.get("tokens_seen", 0))
            self._elapsed_before_s = float(state.get("elapsed_s", 0.0))
            self._last_checkpoint_step = self.step_count
            self._last_checkpoint_path = self._resume["path"]
            if spec.max_steps is not None and self.step_count >= spec.max_steps:
                self.done = True
        self._rng_restored = False
        self.writer = SegmentWriter(spec.telemetry_dir, spec.run_id, rank=spec.rank)
        self.consumption = ConsumptionWriter(consumption_path(spec.telemetry_dir, spec.run_id)
                                             .with_name(f"consumption-rank{spec.rank}.jsonl")
                                             if spec.world_size > 1 else
                                             consumption_path(spec.telemetry_dir, spec.run_id),
                                             start_step=self.step_count, source="trainwise.sdk")
        self._previous_handler = None
        if install_signal_handler and threading.current_thread() is threading.main_thread():
            self._previous_handler = signal.signal(signal.SIGTERM, self._on_sigterm)

    # -- set-up --------------------------------------------------------------------------------
    def _open_store(self) -> Any:
        if self.spec.store_root is None:
            return None
        from trainwise.object_store import store_at

        return store_at(self.spec.store_root)  # a folder, or s3://bucket/prefix

    def _identity(self) -> RunIdentity:
        return RunIdentity(run_id=self.spec.run_id, seed=self.spec.seed)

    def _draw_start_id(self) -> int:
        """This start of the run, the same on every rank (rank 0's draw): its checkpoints carry
        it, so a resume never takes one rank's step from another history than the others'."""
        start_id = secrets.randbits(62) + 1
        if self._ranks is not None:
            [start_id] = self._ranks.from_rank0([start_id])
        return start_id

    def _find_resume(self) -> dict[str, Any] | None:
        if self._ranks is not None:
            return self._agreed_resume()
        found = self._own_resume()
        problem = sdk_resume.resume_problem(found, self.spec.world_size)
        if problem:
            raise RunSpecError(problem)
        return found

    def _own_resume(self) -> dict[str, Any] | None:
        """The newest good checkpoint, local or in the store (downloaded beside the local ones)."""
        folder = self.spec.checkpoint_dir
        local = ckpt.latest_good_checkpoint(folder, identity=self._identity())
        if self.store is not None:
            from trainwise.object_store import latest_committed_checkpoint

            prefix = sdk_resume.store_prefix(self.spec.checkpoint_key_prefix, self.rank)
            remote_steps = sdk_resume.store_steps(self.store, prefix)
            if remote_steps and (local is None or max(remote_steps) > local.step):
                fetched = latest_committed_checkpoint(self.store, prefix, folder)
                if fetched is not None:
                    local = ckpt.latest_good_checkpoint(folder, identity=self._identity())
        if local is None:
            return None
        return {"path": local.path,
                "state": ckpt.load_checkpoint(local.path, identity=self._identity())}

    def _agreed_resume(self) -> dict[str, Any] | None:
        """The newest step every rank holds (a crash between two ranks' commits leaves the newest
        step on some ranks only), refused on every rank when one rank's checkpoint says the run
        had another rank count."""
        assert self._ranks is not None
        folder = self.spec.checkpoint_dir
        prefix = sdk_resume.store_prefix(self.spec.checkpoint_key_prefix, self.rank)
        steps = sdk_resume.held_steps(folder, self.store, prefix)

        def load(step: int) -> dict[str, Any] | None:
            return sdk_resume.load_step(step, folder, self.store, prefix, self._identity())

        agreed = sdk_ranks.agree_on_step(self._ranks, steps, load,
                                         tag=lambda found: int(found["state"].get("start_id", 0)))
        found = agreed[1] if agreed is not None else None
        # No common step: this rank's newest checkpoint still says whether the rank count changed
        # (a run resumed with more ranks has ranks that hold nothing).
        checked = found if agreed is not None or not steps else load(max(steps))
        problem = sdk_resume.resume_problem(checked, self.spec.world_size)
        if self._ranks.any_true(problem is not None):
            raise RunSpecError(problem or f"trainwise.init(): rank {self.rank} cannot resume: "
                               "another rank refused the run's checkpoints (its error says why)")
        sdk_resume.drop_local_after(folder, agreed[0] if agreed is not None else -1)
        return found

    def _on_sigterm(self, signum: int, frame: Any) -> None:
        if self._notice_wall_s is None:
            self._notice_wall_s, self._notice_signal = time.time(), "SIGTERM"

    def notice(self, signal_name: str = "notice") -> None:
        """A notice from outside the signal path (a node agent's watcher, a test)."""
        if self._notice_wall_s is None:
            self._notice_wall_s, self._notice_signal = time.time(), signal_name

    @property
    def resumed(self) -> bool:
        return self._resume is not None

    @property
    def world_size(self) -> int:
        return self.spec.world_size

    @property
    def distributed(self) -> bool:
        """The run's ranks share a process group (several ranks under torchrun): wrap the model
        with `run.ddp(model)`."""
        return self._ranks is not None

    def ddp(self, model: torch.nn.Module, **options: Any) -> torch.nn.Module:
        """`model` in DistributedDataParallel when the run has several ranks, unchanged for one
        process, so one script runs both ways; `options` go to DistributedDataParallel. Pass
        the wrapped model to `run.track`: its checkpoints hold the inner module's state."""
        if self._ranks is None:
            return model
        if self.device.type == "cuda":
            options.setdefault("device_ids", [self.device.index])
        return torch.nn.parallel.DistributedDataParallel(model, **options)

    # -- what the user's script calls ------------------------------------------------------------
    @property
    def device(self) -> torch.device:
        """The device the job trains on (`trainwise.sdk.device`): move the model there."""
        return self.placement.device

    def autocast(self) -> Any:
        """The forward pass's mixed-precision context (a no-op at fp32)."""
        return self.placement.autocast()

    def grad_scaler(self) -> torch.amp.GradScaler:
        """A GradScaler, enabled only under fp16 autocast."""
        return self.placement.grad_scaler()

    def to_device(self, batch: Any) -> Any:
        """`batch` (tensors in dicts, lists, tuples) on the run's device, non-blocking."""
        return self.placement.to_device(batch)

    def dataset(self, split: str = "train") -> Any:
        """The registered dataset the launcher named (its data_shards partition, checked
        against its manifest) as a `datasets.Dataset` with `example_id`; split "train", "eval"
        or "all"."""
        if self.spec.dataset_dir is None:
            raise RunSpecError("run.dataset(): this run names no dataset (a registered job's "
                               "launcher sets dataset_dir); load your data yourself, or launch "
                               "the job from its project file")
        if split not in ("train", "eval", "all"):
            raise RunSpecError(f"run.dataset(split={split!r}): use train, eval or all")
        from training.user_datasets import load_user_shards  # datasets: loaded when asked

        rows = load_user_shards(Path(self.spec.dataset_dir))
        if split == "all":
            return rows
        wanted = split == "eval"
        return rows.filter(lambda flags: [bool(f) == wanted for f in flags],
                           input_columns="is_eval", batched=True)

    def dataloader(self, dataset: Any, batch_size: int, *, shuffle: bool = True,
                   drop_last: bool = False, select: Any = None, collate_fn: Any = None,
                   num_workers: int = 0, pin_memory: bool | None = None,
                   id_column: str | None = "example_id", **loader_options: Any) -> TrackedLoader:
        """A DataLoader over `dataset` (a map-style torch Dataset or a `datasets.Dataset`) whose
        order the run's checkpoints hold; `select`: the example indices to train on."""
        if self._loader is not None:
            raise RunSpecError("run.dataloader() was called twice; one run has one data order "
                               "(build the second loader yourself for evaluation)")
        try:
            n_examples = len(dataset)
        except TypeError as error:
            raise DataChangedError(f"{type(dataset).__name__} has no len(): run.dataloader "
                                   "needs a map-style dataset (an iterable one has no order a "
                                   "checkpoint could hold)") from error
        ids = None
        columns = getattr(dataset, "column_names", None)
        if id_column and columns is not None and id_column in columns:
            ids = np.asarray(dataset[id_column])
        self._check_rank_batches(n_examples if select is None else len(set(select)), batch_size,
                                 drop_last)
        sampler = ResumableBatchSampler(n_examples, batch_size, seed=self.spec.seed,
                                        shuffle=shuffle, drop_last=drop_last, select=select,
                                        rank=self.rank, world_size=self.spec.world_size)
        if pin_memory is None:
            pin_memory = torch.cuda.is_available()
        # Its own generator: a DataLoader draws a seed at every iter() from the global one
        # otherwise, and a resumed run starts an iter() mid-epoch that the first run did not.
        loader_options.setdefault("generator", torch.Generator().manual_seed(self.spec.seed))
        loader = torch.utils.data.DataLoader(dataset, batch_sampler=sampler,
                                             collate_fn=collate_fn, num_workers=num_workers,
                                             pin_memory=pin_memory, **loader_options)
        self._loader = TrackedLoader(loader, sampler, ids, on_batch=self._record_batch)
        self._data_fingerprint = ids_fingerprint(n_examples, ids, sampler.indices
                                                 if select is not None else None)
        if self._resume is not None:
            state = self._resume["state"]
            if state.get("data_fingerprint") != self._data_fingerprint:
                raise DataChangedError(
                    f"checkpoint {self._resume['path']} was trained on other data "
                    f"(fingerprint {str(state.get('data_fingerprint'))[:12]}, this dataset "
                    f"{self._data_fingerprint[:12]}: {n_examples} examples); resume with the "
                    "dataset it was trained on, or start a new run (another run_id)")
            self._loader.load_state_dict(state["sampler"])
        return self._loader

    def _check_rank_batches(self, n_selected: int, batch_size: int, drop_last: bool) -> None:
        """Every rank gets a batch of each global batch: a rank without one in an epoch's last
        global batch would take one step fewer than the others and block their next all-reduce."""
        world = self.spec.world_size
        left = n_selected % (batch_size * world)
        if self._ranks is None or drop_last or left == 0 or left > (world - 1) * batch_size:
            return
        empty = world - 1 - (left - 1) // batch_size
        raise RunSpecError(
            f"run.dataloader(): {n_selected} examples in global batches of {batch_size} x "
            f"{world} ranks leave the epoch's last global batch ({left} examples) without a "
            f"batch for {empty} rank(s), which would stop taking steps with the others: pass "
            "drop_last=True, or a batch size that leaves every rank some of the last batch")

    def track(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None, *,
              scheduler: Any = None, extra: dict[str, Any] | None = None) -> tuple[Any, Any]:
        """Registers what a checkpoint holds; on a resume, loads it into them now. A model in
        DistributedDataParallel (or DataParallel) is returned as it came, but its checkpoints
        hold the inner module's state, so they load into a plain model too."""
        given, model = model, _inner_module(model)
        self._model, self._optimizer, self._scheduler = model, optimizer, scheduler
        self._extra = dict(extra or {})
        sdk_state.check_saveable("model.state_dict()", model.state_dict())
        if optimizer is not None:
            sdk_state.check_saveable("optimizer.state_dict()", optimizer.state_dict())
        if scheduler is not None:
            sdk_state.check_saveable("scheduler.state_dict()", scheduler.state_dict())
        sdk_state.check_saveable("extra", self._extra)
        if self._resume is not None:
            state, path = self._resume["state"], self._resume["path"]
            mine = sdk_state.model_fingerprint(model)
            if state.get("model_fingerprint") != mine:
                raise ModelChangedError(
                    f"checkpoint {path} was written for model {state.get('model_summary')} "
                    f"(fingerprint {str(state.get('model_fingerprint'))[:12]}); this run's "
                    f"model is {sdk_state.model_summary(model)} (fingerprint {mine[:12]}): "
                    "resume with the architecture it was trained with, or start a new run")
            model.load_state_dict(state["model"])
            if optimizer is not None:
                if state.get("optimizer") is None:
                    raise ModelChangedError(f"checkpoint {path} holds no optimizer state; track "
                                            "the same objects the run was started with")
                optimizer.load_state_dict(state["optimizer"])
            if scheduler is not None and state.get("scheduler") is not None:
                scheduler.load_state_dict(state["scheduler"])
            self._extra = dict(state.get("extra") or {})
        self._restore_rng()
        return given, optimizer

    def _restore_rng(self) -> None:
        # After the user built the model (its initialisation draws from the same generators);
        # the random streams continue where the checkpoint stopped them.
        if self._resume is not None and not self._rng_restored:
            sdk_state.restore_rng(self._resume["state"]["rng"])
        self._rng_restored = True

    def keep_state(self, name: str, provide: Any) -> Any:
        """An integration's own state in every checkpoint under `name`: `provide()` (tensors and
        plain data) is called at each save. Returns what the resumed checkpoint kept under `name`
        (None on a fresh run, or when it kept nothing there)."""
        self._kept_state[name] = provide
        if self._resume is None:
            return None
        return (self._resume["state"].get("kept_state") or {}).get(name)

    @property
    def extra(self) -> dict[str, Any]:
        """Plain data the job keeps in its checkpoints (restored on a resume)."""
        return self._extra

    def step(self, loss: Any = None, *, samples: int | None = None, tokens: int = 0,
             learning_rate: float | None = None) -> None:
        """One optimizer step is done (see the module doc for what happens here)."""
        if self._closed:
            raise RunSpecError("run.step() after run.finish(): the run is closed")
        if not self._started:
            self._start()
        now = time.perf_counter()
        step_ms = (now - self._last_step_t) * 1e3
        self._last_step_t = now
        self.step_count += 1
        batch = samples if samples is not None else (self._loader.batch_size
                                                     if self._loader is not None else 0)
        self.samples_seen += int(batch)
        self.tokens_seen += int(tokens)
        if loss is not None:
            self._last_train_loss = float(loss.detach() if torch.is_tensor(loss) else loss)
        self.writer.write(StepEvent(
            run_id=self.run_id, rank=self.rank, step=self.step_count,
            train_loss=self._last_train_loss, learning_rate=self._lr(learning_rate),
            grad_norm=math.nan, grad_noise_scale=math.nan,
            micro_batch_size=self._loader.batch_size if self._loader is not None else int(batch),
            grad_accum_steps=1, step_time_ms=step_ms, samples_seen=self.samples_seen,
            tokens_seen=self.tokens_seen, elapsed_s=self.elapsed_s(), cost_usd=self.cost_usd(),
            world_size=self.spec.world_size, share=1.0 / self.spec.world_size))
        if self._agreed_notice():
            self._leave_on_notice(step_ms)
            return
        if self.spec.max_steps is not None and self.step_count >= self.spec.max_steps:
            self.done = True
            return
        risk_checkpoint = rebalance = False
        if self.step_count % self.spec.fast_every_steps == 0:
            action = self._fast_tick(step_ms)
            # No notice, but the risk the launcher observed says the last checkpoint is older
            # than Young's interval for it: the fast layer asks for one now.
            risk_checkpoint = action.preemption_response is PreemptionResponse.CHECKPOINT_NOW
            rebalance = self._agreed_rebalance()
        every = self.spec.checkpoint_every_steps
        if every and self.step_count % every == 0:
            self.checkpoint("interval")
        elif rebalance and self._model is not None:
            self.checkpoint("rebalance")
        elif risk_checkpoint:
            self.checkpoint("risk")

    def finish(self, *, eval_loss: float | None = None) -> Path | None:
        """The job is done: final checkpoint, outcome, telemetry sealed. Returns the checkpoint."""
        if self._closed:
            return self._last_checkpoint_path
        if not self._started:
            self._start()
        if self._model is not None and self._last_checkpoint_step != self.step_count:
            self.checkpoint("final")
        self._end("completed", eval_loss=eval_loss)
        return self._last_checkpoint_path

    def __enter__(self) -> Run:
        return self

    def __exit__(self, kind: Any, error: Any, traceback: Any) -> None:
        if self._closed:
            return
        if error is None:
            self.finish()
        elif not isinstance(error, Preempted):
            self._end("failed", error=repr(error))

    # -- checkpoints -----------------------------------------------------------------------------
    def checkpoint(self, reason: str = "manual") -> Path:
        if self._model is None:
            raise RunSpecError("run.checkpoint() before run.track(model, ...): nothing to save")
        started = time.perf_counter()
        state = {
            "format": "trainwise-sdk/1", "step": self.step_count, "run_id": self.run_id,
            "lineage": self.lineage, "train_config": {"seed": self.spec.seed},
            "model_fingerprint": sdk_state.model_fingerprint(self._model),
            "model_summary": sdk_state.model_summary(self._model),
            "data_fingerprint": self._data_fingerprint,
            "model": self._model.state_dict(),
            "optimizer": self._optimizer.state_dict() if self._optimizer is not None else None,
            "scheduler": self._scheduler.state_dict() if self._scheduler is not None else None,
            "sampler": self._loader.state_dict() if self._loader is not None else None,
            "rng": sdk_state.capture_rng(), "extra": self._extra,
            "kept_state": {name: provide() for name, provide in self._kept_state.items()},
            "samples_seen": self.samples_seen, "tokens_seen": self.tokens_seen,
            "elapsed_s": self.elapsed_s(),
            # a resume refuses another rank count; ranks resume only from one start's step
            "world_size": self.spec.world_size, "start_id": self._start_id,
        }
        path = self.spec.checkpoint_dir / ckpt.checkpoint_name(self.step_count)
        self.consumption.flush(durable=True)
        sha256 = ckpt.save_checkpoint(path, state)
        if self.store is not None:
            key = f"{self.spec.checkpoint_key_prefix}/rank{self.rank}/{path.name}"
            self.store.put_checkpoint(path, ckpt.manifest_path(path), key, step=self.step_count,
                                      sha256=sha256)
        save_s = time.perf_counter() - started
        self._checkpoint_cost_s = save_s
        self._last_checkpoint_t = time.perf_counter()
        self._last_checkpoint_step, self._last_checkpoint_path = self.step_count, path
        self._last_checkpoint_sha256 = sha256
        ckpt.prune_checkpoints(self.spec.checkpoint_dir, self.spec.keep_checkpoints)
        self.writer.write(CheckpointEvent(
            run_id=self.run_id, rank=self.rank, step=self.step_count, path=str(path),
            sha256=sha256, size_bytes=path.stat().st_size, save_ms=save_s * 1e3, reason=reason))
        return path

    # -- the fast layer --------------------------------------------------------------------------
    def _notice_pending(self) -> bool:
        if self._notice_wall_s is None and self.spec.notice_file is not None:
            if os.path.exists(self.spec.notice_file):
                self.notice("notice_file")
        return self._notice_wall_s is not None

    def _agreed_notice(self) -> bool:
        """Whether any rank has a notice pending; a rank without its own takes the earliest
        rank's (its age rides on the same all-reduce, so every rank counts the same time left).

        Asked at every step, not every k: a notice leaves `notice_s` (EC2: 120 s) and one step of
        a large job can take many seconds, so waiting k steps spends k steps of the notice before
        the save starts, and k cannot be sized before the step time is known. The cost is one
        8-byte all-reduce a step, small beside the step's own gradient all-reduce."""
        pending = self._notice_pending()
        if self._ranks is None:
            return pending
        own_age_s = time.time() - self._notice_wall_s if self._notice_wall_s is not None else -1.0
        age_s = self._ranks.max_float(own_age_s)
        if age_s < 0:
            return False
        if not pending:
            self._notice_wall_s, self._notice_signal = time.time() - age_s, "another rank's notice"
        return True

    def _agreed_rebalance(self) -> bool:
        """Whether a rebalance recommendation came since the last one answered, on any rank (a
        gang checkpoints one step on every rank: one all-reduce, at fast ticks only)."""
        path = self.spec.rebalance_file
        if path is None:  # no node agent: every rank's spec names none, so no all-reduce
            return False
        fresh = False
        try:
            changed_ns = os.stat(path).st_mtime_ns
        except OSError:
            changed_ns = None
        if changed_ns is not None and changed_ns != self._rebalance_seen_ns:
            self._rebalance_seen_ns, fresh = changed_ns, True
        if self._ranks is None:
            return fresh
        return self._ranks.max_float(1.0 if fresh else 0.0) > 0.0

    def _notice_left_s(self) -> float:
        assert self._notice_wall_s is not None
        return max(0.0, self.spec.notice_s - (time.time() - self._notice_wall_s))

    def _observation(self, step_ms: float, notice_s: float | None) -> FastObservation:
        return FastObservation(
            step=self.step_count, elapsed_s=self.elapsed_s(), train_loss=self._last_train_loss,
            grad_norm=self._grad_norm(), grad_noise_scale=math.nan,
            micro_batch_size=self._loader.batch_size if self._loader is not None else 1,
            grad_accum_steps=1, learning_rate=self._lr(None),
            rank_step_time_ms=(step_ms,), dataloader_queue_depth=0,
            preemption_notice_s=notice_s, preemption_risk=self.spec.preemption_risk,
            seconds_since_checkpoint=time.perf_counter() - self._last_checkpoint_t,
            checkpoint_cost_s=self._checkpoint_cost_s)

    def _fast_tick(self, step_ms: float, notice_s: float | None = None) -> FastAction:
        observation = self._observation(step_ms, notice_s)
        action = self._agreed_action(self.fast_policy.act(observation))
        applied: dict[str, Any] = {"preemption_response": action.preemption_response.value}
        if (self._loader is not None and self.capabilities.batch_size
                and action.micro_batch_size != self._loader.batch_size and notice_s is None):
            applied["micro_batch_size"] = int(action.micro_batch_size)
            self._loader.sampler.batch_size = int(action.micro_batch_size)
        if action.grad_accum_steps != observation.grad_accum_steps:
            applied["grad_accum_steps_refused"] = int(action.grad_accum_steps)
        self._decisions += 1
        self.writer.write(DecisionEvent(
            run_id=self.run_id, rank=self.rank, step=self.step_count, layer="fast",
            policy=self.fast_policy.name, action=applied, reason=action.reason,
            numbers={k: float(v) for k, v in action.numbers.items()},
            observation={"step_time_ms": step_ms, "micro_batch_size": observation.micro_batch_size,
                         "preemption_notice_s": notice_s,
                         "checkpoint_cost_s": observation.checkpoint_cost_s},
            schedule_version=self.spec.schedule_version))
        return action

    def _agreed_action(self, action: FastAction) -> FastAction:
        """Rank 0's batch size and notice response, on every rank: each rank's policy sees its
        own step time and save cost, and ranks that applied different answers would train on
        different global batches, or save at different steps."""
        if self._ranks is None:
            return action
        responses = list(PreemptionResponse)
        micro, response = self._ranks.from_rank0([int(action.micro_batch_size),
                                                  responses.index(action.preemption_response)])
        return dataclasses.replace(action, micro_batch_size=micro,
                                   preemption_response=responses[response])

    def _leave_on_notice(self, step_ms: float) -> None:
        notice_s = self._notice_left_s()
        action = self._fast_tick(step_ms, notice_s=notice_s)
        save_s = self._checkpoint_cost_s
        fits = not (math.isfinite(save_s) and save_s > notice_s)
        migrate = (action.preemption_response is PreemptionResponse.MIGRATE
                   or (action.preemption_response is not PreemptionResponse.CHECKPOINT_NOW
                       and not fits)) and self._last_checkpoint_path is not None
        if self._ranks is not None:
            # Every rank saves or none does: a step that only some ranks saved is no resume point.
            migrate = self._ranks.any_true(migrate)
        if migrate:
            response = (f"migrate: a save ({save_s:.3f} s measured) does not fit the "
                        f"{notice_s:.3f} s left; the last good checkpoint is step "
                        f"{self._last_checkpoint_step}")
        else:
            response = f"checkpoint_and_exit: saving in the {notice_s:.3f} s left"
        self.writer.write(PreemptionEvent(
            run_id=self.run_id, rank=self.rank, step=self.step_count,
            signal_name=self._notice_signal or "", notice_s=notice_s,
            received_wall_time_s=self._notice_wall_s or math.nan, response=response))
        if not migrate and self._model is not None:
            self.checkpoint("preemption")
        if self._ranks is not None:
            # Leave together: torchrun stops every rank when the first one exits, and a rank
            # still committing its checkpoint then would be killed mid-upload.
            self._ranks.all_true(True)
        status = "migrated" if migrate else "preempted"
        self._end(status)
        self.should_stop = True
        if self.on_notice == "exit":
            raise Preempted(f"run {self.run_id} left on a notice at step {self.step_count} "
                            f"({response})")

    # -- bookkeeping -----------------------------------------------------------------------------
    def _record_batch(self, loader: TrackedLoader) -> None:
        indices = loader.last_indices
        ids = loader.example_ids(indices)
        if not all(isinstance(i, int | np.integer) for i in ids):
            ids = indices  # the record holds integers; string ids are named by their index
        self.consumption.batch(self.step_count, loader.delivered[0] if loader.delivered[1]
                               else loader.delivered[0] - 1, np.asarray(ids, dtype=np.int64),
                               np.ones(len(ids)))

    def _lr(self, given: float | None) -> float:
        if given is not None:
            return float(given)
        if self._optimizer is not None and self._optimizer.param_groups:
            return float(self._optimizer.param_groups[0].get("lr", math.nan))
        return math.nan

    def _grad_norm(self) -> float:
        if self._model is None:
            return math.nan
        grads = [p.grad.detach() for p in self._model.parameters() if p.grad is not None]
        if not grads:
            return math.nan
        return float(torch.linalg.vector_norm(torch.stack(
            [torch.linalg.vector_norm(g.float()) for g in grads])))

    def elapsed_s(self) -> float:
        return self._elapsed_before_s + (time.time() - self._start_wall_s)

    def cost_usd(self) -> float:
        """The compute estimate (elapsed time x list price), not the provider's bill."""
        return self.elapsed_s() * self.spec.price_usd_per_hour / 3600.0

    def _start(self) -> None:
        self._started = True
        self._restore_rng()
        model = self._model
        self.writer.write(RunStartEvent(
            run_id=self.run_id, rank=self.rank, step=self.step_count,
            model_kind="user:" + (sdk_state.model_summary(model)["class"] if model else "?"),
            model_config=sdk_state.model_summary(model) if model else {},
            model_fingerprint=sdk_state.model_fingerprint(model) if model else "",
            train_config={"seed": self.spec.seed, "max_steps": self.spec.max_steps,
                          "framework": self.capabilities.framework,
                          "fast_policy": self.spec.fast_policy,
                          "checkpoint_every_steps": self.spec.checkpoint_every_steps,
                          **self.placement.record()},
            data_fingerprint=self._data_fingerprint, curriculum_version=None,
            instance_type=self.spec.instance_type,
            price_usd_per_hour=self.spec.price_usd_per_hour,
            resumed_from=str(self._resume["path"]) if self._resume else None))

    def _end(self, status: str, *, eval_loss: float | None = None,
             error: str | None = None) -> None:
        self.status, self._closed = status, True
        self.writer.write(RunEndEvent(
            run_id=self.run_id, rank=self.rank, step=self.step_count, status=status,
            elapsed_s=self.elapsed_s(), cost_usd=self.cost_usd(),
            samples_seen=self.samples_seen, tokens_seen=self.tokens_seen,
            final_eval_loss=eval_loss, final_eval_accuracy=None,
            checkpoint_path=str(self._last_checkpoint_path) if self._last_checkpoint_path
            else None, checkpoint_sha256=self._last_checkpoint_sha256, error=error))
        self.writer.close()
        self.consumption.close({"type": "close", "step": self.step_count, "status": status})
        outcome = {"run_id": self.run_id, "rank": self.rank, "status": status,
                   "step": self.step_count, "checkpoint": str(self._last_checkpoint_path or ""),
                   "fast_decisions": self._decisions, "elapsed_s": round(self.elapsed_s(), 3),
                   "eval_loss": eval_loss, "error": error}
        write_atomic(Path(self.spec.run_dir) / f"outcome-rank{self.rank}.json",
                     (json.dumps(outcome, indent=1) + "\n").encode())
        if self._previous_handler is not None:
            # Ranks leaving on a notice ignore SIGTERM from here: torchrun SIGTERMs every rank as
            # soon as the first one exits, and a rank still on its way out would die of it (-15)
            # instead of exiting 143. Ignored, not handled: Python puts the default action back
            # for its own handlers when it shuts down.
            leaving = self._ranks is not None and status in ("preempted", "migrated")
            signal.signal(signal.SIGTERM, signal.SIG_IGN if leaving else self._previous_handler)
            self._previous_handler = None
        self._close_ranks()

    def _close_ranks(self) -> None:
        if self._ranks is not None:
            self._ranks.close()


def _inner_module(model: torch.nn.Module) -> torch.nn.Module:
    """The module inside DistributedDataParallel / DataParallel (their state_dict's keys carry a
    `module.` prefix that a plain model's would not)."""
    wrappers = (torch.nn.parallel.DistributedDataParallel, torch.nn.DataParallel)
    while isinstance(model, wrappers):
        model = model.module
    return model


def init(*, capabilities: Capabilities | None = None, on_notice: str = "exit",
         install_signal_handler: bool = True, **spec_fields: Any) -> Run:
    """The run a launcher started (`TRAINWISE_RUN_SPEC`), or a local run; keyword arguments are
    run-spec fields (`trainwise.sdk.spec.RunSpec`: run_id, max_steps, seed,
    checkpoint_every_steps, store_root, ...) and override the launcher's."""
    return Run(resolve_spec(**spec_fields), capabilities=capabilities, on_notice=on_notice,
               install_signal_handler=install_signal_handler)
