"""Hugging Face `transformers` Trainer under trainwise: one callback, one Trainer class, one call
after `train`.

    tw = TrainwiseCallback(max_steps=40, checkpoint_every_steps=10)   # trainwise.init's fields
    args = tw.training_args(per_device_train_batch_size=16)          # max_steps, save_strategy="no"
    trainer = TrainwiseTrainer(model=model, args=args, train_dataset=dataset, callbacks=[tw])
    trainer.train()
    tw.raise_if_preempted()                      # a run that left on a notice exits 143

`TrainwiseTrainer` (or `TrainwiseTrainerMixin` before your own Trainer subclass) builds the train
loader with `run.dataloader` (trainwise's resumable order, the same batch size, collator and
column removal as the Trainer's own) instead of the Trainer's sampler.

What the callback does: every optimizer step goes to `run.step` (the micro-batches' summed loss,
their examples and the learning rate the step used; telemetry, the fast tick, a pending notice,
interval checkpoints uploaded to the object store with their commit marker); a notice (SIGTERM
or the spec's notice_file) is answered with a checkpoint and `control.should_training_stop`, and
that step's evaluation and Trainer save are skipped. A resumed run (local checkpoint, else the
store's) restores the weights, optimizer, LR scheduler, random streams and the data position
through `run.track` / `run.dataloader`, and the Trainer's own state (`TrainerState`: global step,
epoch, FLOs, input tokens, log history, best metric; stateful callbacks; the fp16 GradScaler) from
the same checkpoint, so it ends with the weights an uninterrupted run ends with, mid-epoch and
with gradient accumulation too. The Trainer never skips batches itself on a resume: the loader
starts at the checkpoint's position, and the resumed epoch is handed to the Trainer's epoch loop
as an epoch of the batches left, so its accumulation groups fall where they fell before.
Evaluation during `train` leaves the random streams as it found them (its data loader draws a
seed), so a resume that does not repeat an evaluation continues them exactly. Like the Trainer's
own resume, the first loss logged after a resume averages the steps since the resume.

The checkpoint is trainwise's (format trainwise-sdk/1, read back with torch.load(weights_only=True)
after its manifest is checked), never the Trainer's `checkpoint-N` folder (its RNG and optimizer
files are pickles): a file read from disk never runs code. `train(resume_from_checkpoint=...)` is
refused for that reason and because the run restores itself; `save_strategy` other than "no"
only warns (the Trainer may write its folders; a resume never reads them).

What cannot apply is refused at `train` with the reason: resume_from_checkpoint, a hyperparameter
search trial, more than one process or GPU (DDP, DataParallel, DeepSpeed, FSDP), a `max_steps`
that differs from the run spec's, `auto_find_batch_size` (it re-runs the loop with another batch
size), `load_best_model_at_end` (it loads a Trainer checkpoint), a length-grouped or rebalancing
`train_sampling_strategy` (trainwise's sampler draws the order), a Trainer that is not
`TrainwiseTrainer` (its loader has no position a checkpoint could hold); the fast layer's
`batch_scaling` is refused at init (the Trainer sizes its epochs once, from the loader's length).

This is the only module of trainwise that imports transformers.
"""

from __future__ import annotations

import math
import os
import warnings
from typing import Any

import torch

try:
    import accelerate  # noqa: F401 - the Trainer needs it; say so here, not deep inside train()
    from transformers import Trainer, TrainerCallback, TrainingArguments
    from transformers.trainer_callback import ExportableState, TrainerControl, TrainerState
except ImportError as error:  # pragma: no cover - depends on the environment
    raise ImportError("trainwise.sdk.hf needs transformers 5.x and accelerate (the Trainer's "
                      "own dependency): pip install 'transformers[torch]>=5,<6' (the rest of "
                      f"trainwise works without them); missing: {error.name}") from error

from trainwise.sdk import state as sdk_state
from trainwise.sdk.data import TrackedLoader
from trainwise.sdk.run import Capabilities, Preempted, Run, init
from trainwise.sdk.spec import SPEC_ENV, RunSpecError

__all__ = ["HF_CAPABILITIES", "TrainerLoader", "TrainwiseCallback", "TrainwiseTrainer",
           "TrainwiseTrainerMixin"]

# The Trainer computes an epoch's length once, from len(loader), so a batch size changed mid-run
# cannot reach it: the fast layer's batch lever is refused by name at init.
# ranks=False: several processes are refused at train begin (`refusals`), so the SDK joins no
# process group for them.
HF_CAPABILITIES = Capabilities(framework="hf_trainer", batch_size=False, grad_accumulation=False,
                               work_shares=False, ranks=False)
_STATE_NAME = "hf_trainer"
# TrainerState fields a checkpoint keeps (plain data; the rest is derived from the arguments).
_STATE_FIELDS = ("epoch", "global_step", "max_steps", "num_train_epochs", "num_input_tokens_seen",
                 "total_flos", "log_history", "best_metric", "best_global_step",
                 "best_model_checkpoint")


def _option(value: Any) -> str:
    """A TrainingArguments choice (an enum member or its string) as its string."""
    return str(getattr(value, "value", value))


def _plain(value: Any) -> Any:
    """`value` as what a weights-only load reads: numbers, strings, lists, dicts, tensors."""
    if isinstance(value, bool | int | float | str | type(None)):
        return value
    if torch.is_tensor(value):
        return value.item() if value.numel() == 1 else value.detach().cpu()
    if isinstance(value, dict):
        return {str(key): _plain(item) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return [_plain(item) for item in value]
    if hasattr(value, "item"):  # numpy scalars
        return value.item()
    return str(value)


class TrainerLoader:
    """`run.dataloader`'s order for the Trainer: what it pulls, it trains.

    The Trainer draws each optimizer step's micro-batches just before training them and never
    reads ahead, so the TrackedLoader's "handed over" position is the trained one at
    `on_step_end`. `len()` is a full epoch's, also on a resume mid-epoch (the Trainer sizes its
    epochs once, from it); each `iter()` starts at the position after the last batch handed
    over, since the Trainer stops an epoch after len() batches without asking for the end.
    """

    def __init__(self, tracked: TrackedLoader) -> None:
        self.tracked = tracked
        self._samples = 0

    @property
    def dataset(self) -> Any:  # Trainer.num_examples reads it
        return self.tracked.loader.dataset

    @property
    def batch_size(self) -> int:
        return self.tracked.batch_size

    def __len__(self) -> int:
        return self.tracked.sampler.batches_per_epoch()

    def position(self) -> tuple[int, int]:
        """(epoch, batches of it already handed over) of the next batch."""
        epoch, cursor = self.tracked.delivered
        size = self.tracked.sampler.batch_size * self.tracked.sampler.world_size
        done = -(-cursor // size)
        if done >= len(self):  # a drop_last epoch ends before its order does
            return epoch + 1, 0
        return epoch, done

    def __iter__(self):  # noqa: ANN204 - a generator
        sampler = self.tracked.sampler
        epoch, done = self.position()
        sampler.epoch, sampler.cursor = epoch, done * sampler.batch_size * sampler.world_size
        self.tracked.delivered = (sampler.epoch, sampler.cursor)
        for batch in self.tracked:
            self._samples += len(self.tracked.last_indices)
            yield batch

    def take_samples(self) -> int:
        """Examples handed over since the last call (one optimizer step's micro-batches)."""
        samples, self._samples = self._samples, 0
        return samples

    def state_dict(self) -> dict[str, Any]:
        return self.tracked.state_dict()


class TrainwiseCallback(TrainerCallback):
    """Puts a `Trainer.train` under trainwise (see the module doc). `run`: a run built with
    `TrainwiseCallback.init_run(...)`, or keyword arguments for it (run-spec fields).
    `id_column`: the train dataset's column of stable example ids (the consumption record)."""

    def __init__(self, run: Run | None = None, *, eval_metric: str | None = "eval_loss",
                 id_column: str | None = "example_id", **spec_fields: Any) -> None:
        super().__init__()
        if run is not None and spec_fields:
            raise RunSpecError("TrainwiseCallback(run, ...): give a run or run-spec fields, not "
                               f"both (got {sorted(spec_fields)})")
        self.run = run if run is not None else self.init_run(**spec_fields)
        if self.run.on_notice != "stop" or self.run.capabilities.batch_size:
            raise RunSpecError("TrainwiseCallback(run): the run must answer a notice with "
                               "should_stop and refuse batch scaling; build it with "
                               "TrainwiseCallback.init_run(...) (or pass the fields instead)")
        self.eval_metric, self.id_column = eval_metric, id_column
        self._trainer: Trainer | None = None
        self._loader: TrainerLoader | None = None
        self._began = False
        self._step_lr: float | None = None
        self._eval_value: float | None = None

    @staticmethod
    def init_run(**spec_fields: Any) -> Run:
        """`trainwise.init` for the Trainer: a notice sets should_stop (the Trainer owns the
        loop)."""
        if not os.environ.get(SPEC_ENV):
            # A local run: leave out the lever the Trainer cannot apply. Under a launcher the spec
            # decides, and a spec asking for batch scaling is refused with the reason.
            spec_fields.setdefault("fast_levers", ("preemption",))
        return init(capabilities=HF_CAPABILITIES, on_notice="stop", **spec_fields)

    # -- what the user's script calls ------------------------------------------------------------
    @property
    def max_steps(self) -> int:
        """For `TrainingArguments(max_steps=...)`: the run spec's (-1, the Trainer's "count
        epochs instead", if none)."""
        return -1 if self.run.spec.max_steps is None else int(self.run.spec.max_steps)

    def training_args(self, **options: Any) -> TrainingArguments:
        """`TrainingArguments(**options)` with what trainwise expects where `options` does not
        say: the spec's max_steps and seed, no Trainer checkpoints (save_strategy "no"), no
        reporting integrations, no progress bar, the run's device and precision, loading in
        this process (dataloader_num_workers 0), output_dir inside the run's folder."""
        placement = self.run.placement
        options.setdefault("output_dir", os.path.join(self.run.spec.run_dir, "trainer"))
        options.setdefault("max_steps", self.max_steps)
        options.setdefault("seed", self.run.spec.seed)
        options.setdefault("save_strategy", "no")
        options.setdefault("report_to", [])
        options.setdefault("disable_tqdm", True)
        options.setdefault("dataloader_num_workers", 0)
        options.setdefault("use_cpu", placement.device.type == "cpu")
        if "bf16" not in options and "fp16" not in options:
            options["bf16"] = placement.precision == "bf16"
            options["fp16"] = placement.precision == "fp16"
        return TrainingArguments(**options)

    def dataloader(self, dataset: Any, batch_size: int, **options: Any) -> TrainerLoader:
        """`run.dataloader` (the same arguments) for the Trainer; TrainwiseTrainer calls it."""
        options.setdefault("id_column", self.id_column)
        self._loader = TrainerLoader(self.run.dataloader(dataset, batch_size, **options))
        return self._loader

    @property
    def eval_value(self) -> float | None:
        """The last `eval_metric` an evaluation during train() reported (the run's eval loss)."""
        return self._eval_value

    @property
    def preempted(self) -> bool:
        return self.run.status in ("preempted", "migrated")

    def raise_if_preempted(self) -> None:
        """After `trainer.train()`: a run that left on a notice raises Preempted (SystemExit
        143), what a launcher expects of a job a notice ended; a finished run returns."""
        if self.preempted:
            raise Preempted(f"run {self.run.run_id} left on a notice at step "
                            f"{self.run.step_count} ({self.run.status}); its checkpoint is "
                            "committed and the next start resumes it")

    # -- what TrainwiseTrainer tells the callback ------------------------------------------------
    def _attach(self, trainer: Trainer) -> None:
        if self._trainer is not None and self._trainer is not trainer:
            raise RunSpecError("this TrainwiseCallback already drives another Trainer; one "
                               "callback (one run) per Trainer")
        self._trainer = trainer

    def _fail(self, error: BaseException) -> None:
        if self.run.status is None:  # the outcome says failed, with the error
            self.run.__exit__(type(error), error, error.__traceback__)

    def refusals(self, args: TrainingArguments) -> list[str]:
        """What makes an exact resume of this training impossible (empty: nothing)."""
        why = []
        spec = self.run.spec
        processes = max(int(args.world_size), 1)
        if processes != 1 or spec.world_size != 1 or args.n_gpu > 1:
            why.append(f"{processes} process(es), {args.n_gpu} GPU(s) (spec world_size "
                       f"{spec.world_size}): multi-process and multi-GPU Trainer runs are not "
                       "supported yet (every rank must stop at the step a notice names); run "
                       "one process on one device per job (CUDA_VISIBLE_DEVICES=0)")
        if args.deepspeed or args.fsdp:
            why.append("DeepSpeed/FSDP keep optimizer state the trainwise checkpoint does not "
                       "hold: remove deepspeed/fsdp from the TrainingArguments")
        if spec.max_steps is not None and args.max_steps != spec.max_steps:
            why.append(f"TrainingArguments(max_steps={args.max_steps}) but the run spec says "
                       f"max_steps={spec.max_steps}: pass max_steps=tw.max_steps (or build the "
                       "arguments with tw.training_args(...))")
        if args.auto_find_batch_size:
            why.append("auto_find_batch_size re-runs the loop with a smaller batch size after an "
                       "out-of-memory error, past the order the checkpoint holds: set the batch "
                       "size yourself and leave auto_find_batch_size off")
        if args.load_best_model_at_end:
            why.append("load_best_model_at_end loads a Trainer checkpoint (pickled files) at the "
                       "end: leave it off and keep the best metric's step from the log history")
        strategy = _option(getattr(args, "train_sampling_strategy", "random"))
        if strategy not in ("random", "sequential"):
            why.append(f"train_sampling_strategy={strategy!r}: trainwise's sampler draws the "
                       "order a checkpoint holds (random or sequential); use one of those")
        return why

    # -- the Trainer's hooks ---------------------------------------------------------------------
    def on_init_end(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
                    **kwargs: Any) -> None:
        if self._trainer is None:
            error = RunSpecError(
                "TrainwiseCallback needs trainwise.sdk.hf.TrainwiseTrainer (or "
                "TrainwiseTrainerMixin before your Trainer subclass): a plain Trainer's loader "
                "has no position a checkpoint could hold; build TrainwiseTrainer(..., "
                "callbacks=[tw])")
            self._fail(error)
            raise error

    def on_train_begin(self, args: TrainingArguments, state: TrainerState,
                       control: TrainerControl, **kwargs: Any) -> None:
        trainer = self._trainer
        if trainer is None or self._loader is None \
                or kwargs.get("train_dataloader") is not self._loader:
            raise RunSpecError("the train loader is not trainwise's: build the Trainer as "
                               "TrainwiseTrainer(..., callbacks=[tw]) and leave "
                               "get_train_dataloader to it")
        if self._began:
            raise RunSpecError("trainer.train() a second time: one TrainwiseCallback drives one "
                               "run; build a new callback (another run_id) for another run")
        self._began = True
        optimizer = kwargs["optimizer"]
        optimizer = getattr(optimizer, "optimizer", optimizer)  # accelerate's wrapper
        # The optimizer and scheduler exist from here on (created inside train()); on a resume
        # this loads the model, optimizer, scheduler and random streams from the checkpoint,
        # after the Trainer's own seeding, so the streams continue where the checkpoint left.
        self.run.track(kwargs["model"], optimizer, scheduler=kwargs.get("lr_scheduler"))
        kept = self.run.keep_state(_STATE_NAME, self._trainer_state)
        if kept is not None:
            self._restore_trainer_state(trainer, state, kept)
        if state.global_step != self.run.step_count:
            raise RunSpecError(f"the Trainer's global step {state.global_step} is not the run's "
                               f"step {self.run.step_count} after the resume: the checkpoint's "
                               "Trainer state does not match it; start a new run (another "
                               "run_id)")

    def on_optimizer_step(self, args: TrainingArguments, state: TrainerState,
                          control: TrainerControl, **kwargs: Any) -> None:
        # Before the scheduler steps: the learning rate this step used.
        optimizer = kwargs.get("optimizer")
        if optimizer is not None and optimizer.param_groups:
            self._step_lr = float(optimizer.param_groups[0].get("lr", math.nan))

    def on_step_end(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
                    **kwargs: Any) -> None:
        if self.run.status is not None:  # the run ended (a notice): the Trainer is stopping
            return
        assert self._loader is not None and self._trainer is not None
        # The Trainer's epoch from trainwise's position (the same number the Trainer computes
        # in an uninterrupted run; a resumed epoch's own count starts at its first batch left).
        epoch, done = self._loader.position()
        state.epoch = epoch + done / len(self._loader)
        loss, tokens = self._trainer._trainwise_take_step()
        # The Trainer has stepped the optimizer and the scheduler, zeroed the gradients and
        # counted the step: a checkpoint here is one the next start continues from exactly.
        self.run.step(loss=loss, samples=self._loader.take_samples(), tokens=tokens,
                      learning_rate=self._step_lr)
        if self.run.should_stop or self.run.done:
            control.should_training_stop = True
        if self.run.status is not None:
            # Left on a notice: leave now, without this step's evaluation or Trainer save (its
            # checkpoint is committed; the resumed run continues after this step).
            control.should_evaluate = control.should_save = False

    def on_epoch_end(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
                     **kwargs: Any) -> None:
        if self.run.status is not None:
            control.should_evaluate = control.should_save = False

    def on_evaluate(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
                    metrics: dict[str, float] | None = None, **kwargs: Any) -> None:
        if self.eval_metric and metrics and self.eval_metric in metrics:
            self._eval_value = float(metrics[self.eval_metric])

    def on_train_end(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
                     **kwargs: Any) -> None:
        if self.run.status is None:
            self.run.finish(eval_loss=self._eval_value)

    # -- the Trainer's own state in trainwise's checkpoint ---------------------------------------
    def _trainer_state(self) -> dict[str, Any]:
        """Called by run.checkpoint(): tensors and plain data only (weights-only load)."""
        trainer = self._trainer
        assert trainer is not None
        state = trainer.state
        kept = {name: _plain(getattr(state, name)) for name in _STATE_FIELDS}
        # FLOs counted since the Trainer last folded them into the state (store_flos)
        kept["total_flos"] = float(state.total_flos) + float(getattr(trainer, "current_flos", 0))
        callbacks: dict[str, list[Any]] = {}
        for callback in trainer.callback_handler.callbacks:
            if isinstance(callback, ExportableState) and callback is not self:
                callbacks.setdefault(type(callback).__name__, []).append(
                    _plain(callback.state()))
        scaler = getattr(trainer.accelerator, "scaler", None)
        return {"trainer_state": kept, "callbacks": callbacks,
                "scaler": _plain(scaler.state_dict()) if scaler is not None else None}

    def _restore_trainer_state(self, trainer: Trainer, state: TrainerState,
                               kept: dict[str, Any]) -> None:
        # What the Trainer's own resume does (TrainerState, callback states, the scaler), from
        # trainwise's checkpoint; its loop then starts with the step after the checkpoint's.
        saved = kept["trainer_state"]
        for name in _STATE_FIELDS:
            if name in ("max_steps", "num_train_epochs"):
                continue  # derived from this start's arguments and loader (checked equal below)
            setattr(state, name, saved[name])
        if state.max_steps != saved["max_steps"]:
            raise RunSpecError(f"the Trainer plans {state.max_steps} steps, the checkpoint's run "
                               f"{saved['max_steps']}: resume with the arguments and dataset it "
                               "was trained with, or start a new run (another run_id)")
        if hasattr(trainer, "current_flos"):
            trainer.current_flos = 0
        # Like the Trainer's own resume: losses and throughput count this start's steps.
        for name in ("_globalstep_last_logged", "_initial_global_step"):
            if hasattr(trainer, name):
                setattr(trainer, name, state.global_step)
        if hasattr(trainer, "_initial_num_input_tokens_seen"):
            trainer._initial_num_input_tokens_seen = state.num_input_tokens_seen
        by_class: dict[str, list[Any]] = {}
        for callback in trainer.callback_handler.callbacks:
            if isinstance(callback, ExportableState) and callback is not self:
                by_class.setdefault(type(callback).__name__, []).append(callback)
        for name, states in kept["callbacks"].items():
            for callback, saved_state in zip(by_class.get(name, []), states, strict=False):
                for attribute, value in (saved_state.get("attributes") or {}).items():
                    setattr(callback, attribute, value)
        scaler = getattr(trainer.accelerator, "scaler", None)
        if scaler is not None and kept.get("scaler"):
            scaler.load_state_dict(kept["scaler"])


class TrainwiseTrainerMixin:
    """Put it before a Trainer class (`class MyTrainer(TrainwiseTrainerMixin, Trainer)`): the
    train loader is trainwise's, what cannot apply is refused at `train`, the callback sees each
    step's loss, and evaluation during training leaves the random streams as it found them.
    Pass the TrainwiseCallback as `callbacks=[tw, ...]` (a keyword argument)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        ours = [callback for callback in kwargs.get("callbacks") or ()
                if isinstance(callback, TrainwiseCallback)]
        if len(ours) != 1:
            raise RunSpecError(f"{type(self).__name__}(..., callbacks=[tw, ...]): exactly one "
                               f"TrainwiseCallback instance (got {len(ours)}); pass it as the "
                               "callbacks keyword argument")
        self.trainwise: TrainwiseCallback = ours[0]
        self._trainwise_loader: TrainerLoader | None = None
        self._trainwise_loss: torch.Tensor | None = None
        self._trainwise_tokens = 0
        ours[0]._attach(self)  # type: ignore[arg-type]
        super().__init__(*args, **kwargs)

    def train(self, resume_from_checkpoint: str | bool | None = None, trial: Any = None,
              **kwargs: Any) -> Any:
        tw = self.trainwise
        try:
            why = tw.refusals(self.args)  # type: ignore[attr-defined]
            if resume_from_checkpoint not in (None, False):
                why.insert(0, f"train(resume_from_checkpoint={resume_from_checkpoint!r}): "
                           "trainwise resumes the run from its own checkpoints (the Trainer's "
                           "checkpoint folder holds pickles that can run code when loaded); "
                           "drop resume_from_checkpoint")
            if trial is not None:
                why.append("a hyperparameter-search trial: one run is one trial under trainwise "
                           "(trainwise.hpo searches with runs of their own); call train() "
                           "without trial")
            if why:
                raise RunSpecError("TrainwiseTrainer: this training cannot run under trainwise: "
                                   + "; ".join(why))
            save_strategy = _option(getattr(self.args, "save_strategy", "no"))  # type: ignore[attr-defined]
            if save_strategy != "no":
                warnings.warn(
                    f"save_strategy={save_strategy!r} writes Trainer checkpoint "
                    "folders beside trainwise's checkpoints; a trainwise resume reads only its "
                    "own: pass save_strategy=\"no\" (tw.training_args does)", stacklevel=2)
            return super().train(trial=trial, **kwargs)  # type: ignore[misc]
        except BaseException as error:
            if not isinstance(error, Preempted):
                tw._fail(error)
            raise

    def get_train_dataloader(self) -> TrainerLoader:
        if self._trainwise_loader is None:
            if self.train_dataset is None:  # type: ignore[attr-defined]
                raise ValueError("Trainer: training requires a train_dataset.")
            args = self.args  # type: ignore[attr-defined]
            collate = self._get_collator_with_removed_columns(  # type: ignore[attr-defined]
                self.data_collator, description="training")  # type: ignore[attr-defined]
            options: dict[str, Any] = {}
            if args.dataloader_num_workers > 0:
                options.update(persistent_workers=args.dataloader_persistent_workers,
                               prefetch_factor=args.dataloader_prefetch_factor)
            self._trainwise_loader = self.trainwise.dataloader(
                self.train_dataset, args.train_batch_size,  # type: ignore[attr-defined]
                shuffle=_option(getattr(args, "train_sampling_strategy", "random")) != "sequential",
                drop_last=args.dataloader_drop_last, collate_fn=collate,
                num_workers=args.dataloader_num_workers,
                pin_memory=bool(args.dataloader_pin_memory) and torch.cuda.is_available(),
                **options)
        return self._trainwise_loader

    def _run_epoch(self, **kwargs: Any) -> Any:
        # The Trainer's epoch loop counts epochs from 0 and batches from the epoch's first; on a
        # resume the loader starts at the checkpoint's position instead. The resumed epoch is
        # handed over as what it is: its number, and an epoch of the batches left (so the
        # accumulation groups and the short last group fall as they fell before).
        if self.trainwise.run.done:
            # Resumed from the checkpoint of the last step (a notice during it): nothing is left
            # to train, and the Trainer's epoch loop would train a batch before it looked.
            self.control.should_training_stop = True  # type: ignore[attr-defined]
            return None
        loader = kwargs.get("train_dataloader")
        if isinstance(loader, TrainerLoader):
            epoch, done = loader.position()
            kwargs["epoch"] = epoch
            if done:
                left = kwargs["steps_in_epoch"] - done
                accumulation = self.args.gradient_accumulation_steps  # type: ignore[attr-defined]
                kwargs["steps_in_epoch"] = left
                kwargs["num_update_steps_per_epoch"] = -(-left // accumulation)
        return super()._run_epoch(**kwargs)  # type: ignore[misc]

    def training_step(self, model: torch.nn.Module, inputs: dict[str, Any],
                      num_items_in_batch: Any = None) -> torch.Tensor:
        loss = super().training_step(model, inputs, num_items_in_batch)  # type: ignore[misc]
        self._trainwise_loss = loss if self._trainwise_loss is None else self._trainwise_loss + loss
        ids = inputs.get("input_ids") if hasattr(inputs, "get") else None
        if torch.is_tensor(ids):
            self._trainwise_tokens += int(ids.numel())
        return loss

    def _trainwise_take_step(self) -> tuple[torch.Tensor | None, int]:
        """The step's loss (its micro-batches' losses summed, as the Trainer logs it) and input
        tokens."""
        loss, tokens = self._trainwise_loss, self._trainwise_tokens
        self._trainwise_loss, self._trainwise_tokens = None, 0
        return loss, tokens

    def evaluate(self, *args: Any, **kwargs: Any) -> dict[str, float]:
        if not getattr(self, "is_in_train", False):
            return super().evaluate(*args, **kwargs)  # type: ignore[misc]
        streams = sdk_state.capture_rng()
        try:
            return super().evaluate(*args, **kwargs)  # type: ignore[misc]
        finally:
            sdk_state.restore_rng(streams)


class TrainwiseTrainer(TrainwiseTrainerMixin, Trainer):
    """`transformers.Trainer` under trainwise (see the module doc); pass `callbacks=[tw]`."""
