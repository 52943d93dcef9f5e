"""PyTorch Lightning under trainwise: one callback, one data loader, one call after `fit`.

    tw = TrainwiseCallback(max_steps=40, checkpoint_every_steps=10)  # trainwise.init's fields
    loader = tw.dataloader(dataset, batch_size=16)                   # exact mid-epoch resume
    trainer = L.Trainer(max_steps=tw.max_steps, callbacks=[tw], enable_checkpointing=False)
    trainer.fit(model, train_dataloaders=loader)
    tw.raise_if_preempted()                      # a run that left on a notice exits 143

What the callback does: every optimizer step goes to `run.step` (telemetry, the fast tick, a
pending notice, interval checkpoints uploaded to the object store with their commit marker); a
notice (SIGTERM or the spec's notice_file) is answered with a checkpoint and `trainer.should_stop`.
A resumed run (local checkpoint, else the store's) restores the weights, optimizer, scheduler,
random streams and the data position through `run.track` / `run.dataloader`, and Lightning's own
loop progress (global step, epoch, batch index), other callbacks' states and precision state from
the same checkpoint, so it ends with the weights an uninterrupted run ends with, mid-epoch too.

The checkpoint is trainwise's (format trainwise-sdk/1, read back with torch.load(weights_only=True)
after its manifest is checked), never Lightning's `.ckpt` pickle: a file read from disk never
runs code. `trainer.fit(ckpt_path=...)` is refused for that reason and because the run restores
itself. Lightning's `ModelCheckpoint` may still write `.ckpt` files; a resume does not read them.

What cannot apply is refused at `setup` with the reason: more than one optimizer or scheduler,
multi-rank fits, `limit_train_batches`/`overfit_batches` (they cut an epoch the data order does
not know of), `min_steps`/`min_epochs` (a notice must stop the fit at once), SLURM auto-requeue
(Lightning's own SIGUSR1/SIGTERM answer), a train loader that is not `tw.dataloader(...)`, and a
`max_steps` that differs from the run spec's; the fast layer's `batch_scaling` is refused at init
(Lightning sizes its epoch once, from the loader's length).

This is the only module of trainwise that imports lightning.
"""

from __future__ import annotations

import collections
import math
import os
import signal
import threading
from typing import Any

try:
    import lightning.pytorch as pl
    from lightning.pytorch.callbacks import Callback
    from lightning.pytorch.utilities import rank_zero_warn
except ImportError as error:  # pragma: no cover - depends on the environment
    raise ImportError("trainwise.sdk.lightning needs PyTorch Lightning 2.x: pip install "
                      "'lightning>=2.2' (the rest of trainwise works without it)") from error

from trainwise.sdk.data import TrackedLoader
from trainwise.sdk.run import Capabilities, Preempted, Run, init
from trainwise.sdk.spec import SPEC_ENV, RunSpecError

__all__ = ["LIGHTNING_CAPABILITIES", "LightningLoader", "TrainwiseCallback"]

# Lightning computes an epoch's length once, from len(loader), so a batch size changed mid-run
# cannot reach it: the fast layer's batch lever is refused by name at init.
# ranks=False: multi-rank fits are refused at fit start (`_refusals`), so the SDK joins no
# process group for them.
LIGHTNING_CAPABILITIES = Capabilities(framework="lightning", batch_size=False,
                                      grad_accumulation=False, work_shares=False, ranks=False)
_STATE_NAME = "lightning"


class LightningLoader:
    """`run.dataloader`'s order for Lightning: the position a checkpoint holds is the one after
    the last batch *trained on*.

    Lightning's fetcher reads one batch ahead (to know the last batch of an epoch), so the
    TrackedLoader's "handed over" position is a batch ahead of the model at `on_train_batch_end`;
    here each batch's position waits in `_pending` until the callback's `on_train_batch_start`
    says Lightning is training it. `len()` is a full epoch's, also on a resume mid-epoch: Lightning
    restores the batch index and counts the epoch's remaining batches from it.
    Lightning sees `state_dict`/`load_state_dict` (its stateful-loader protocol) and keeps the
    position in its loop state too; both say the same position.
    """

    def __init__(self, tracked: TrackedLoader) -> None:
        self.tracked = tracked
        self._pending: collections.deque[tuple[tuple[int, int], list[int]]] = collections.deque()

    @property
    def batch_size(self) -> int:
        return self.tracked.batch_size

    def __len__(self) -> int:
        return self.tracked.sampler.batches_per_epoch()

    def __iter__(self):  # noqa: ANN204 - a generator
        sampler = self.tracked.sampler
        # Each epoch starts from the position after the last batch trained on: Lightning takes
        # len() batches through islice and never asks for the one after the last, so the
        # sampler's generator is not run to its end and has not turned the epoch itself; and an
        # epoch Lightning left early (a stop) leaves batches read ahead that were not trained.
        sampler.epoch, sampler.cursor = self.tracked.delivered
        self._pending.clear()
        for batch in self.tracked.loader:
            self._pending.append(sampler.positions.popleft())
            yield batch

    def batch_started(self) -> int:
        """Lightning trains the oldest batch read: its position becomes the delivered one (and
        its examples go to the consumption record). Returns its number of examples."""
        if not self._pending:
            raise RuntimeError("Lightning started a training batch that trainwise's loader did "
                               "not yield: pass train_dataloaders=tw.dataloader(...) to fit")
        position, indices = self._pending.popleft()
        self.tracked.delivered, self.tracked.last_indices = position, indices
        record = getattr(self.tracked, "_on_batch", None)  # the run's consumption record
        if record is not None:
            record(self.tracked)
        return len(indices)

    def state_dict(self) -> dict[str, Any]:
        return self.tracked.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.tracked.load_state_dict(state)
        self._pending.clear()


class TrainwiseCallback(Callback):
    """Puts a `Trainer.fit` under trainwise (see the module doc). `run`: a run built with
    `TrainwiseCallback.init_run(...)`, or keyword arguments for it (run-spec fields)."""

    def __init__(self, run: Run | None = None, *, eval_metric: str | None = "val_loss",
                 **spec_fields: Any) -> None:
        super().__init__()
        if run is not None and spec_fields:
            raise RunSpecError("TrainwiseCallback(run, ...): give a run or run-spec fields, not "
                               f"both (got {sorted(spec_fields)})")
        # The SIGTERM handler to put back once the run has ended (the run's own, if installed,
        # restores the one it displaced; Lightning's teardown would restore the run's).
        self._handler_before = signal.getsignal(signal.SIGTERM)
        self.run = run if run is not None else self.init_run(**spec_fields)
        if run is not None and self._handler_before == getattr(run, "_on_sigterm", None):
            self._handler_before = getattr(run, "_previous_handler", None) or signal.SIG_DFL
        if self.run.on_notice != "stop" or self.run.capabilities.batch_size:
            raise RunSpecError("TrainwiseCallback(run): the run must answer a notice with "
                               "should_stop and refuse batch scaling; build it with "
                               "TrainwiseCallback.init_run(...) (or pass the fields instead)")
        self.eval_metric = eval_metric
        self._loader: LightningLoader | None = None
        self._trainer: pl.Trainer | None = None
        self._last_global_step = 0
        self._samples_since_step = 0

    @staticmethod
    def init_run(**spec_fields: Any) -> Run:
        """`trainwise.init` for Lightning: a notice sets should_stop (Lightning owns the loop)."""
        if not os.environ.get(SPEC_ENV):
            # A local run: leave out the lever Lightning cannot apply. Under a launcher the spec
            # decides, and a spec asking for batch scaling is refused with the reason.
            spec_fields.setdefault("fast_levers", ("preemption",))
        return init(capabilities=LIGHTNING_CAPABILITIES, on_notice="stop", **spec_fields)

    # -- what the user's script calls ------------------------------------------------------------
    @property
    def max_steps(self) -> int:
        """For `Trainer(max_steps=...)`: the run spec's (-1, Lightning's "no limit", if none)."""
        return -1 if self.run.spec.max_steps is None else int(self.run.spec.max_steps)

    def dataloader(self, dataset: Any, batch_size: int, **options: Any) -> LightningLoader:
        """`run.dataloader` (the same arguments) for `trainer.fit(train_dataloaders=...)`."""
        self._loader = LightningLoader(self.run.dataloader(dataset, batch_size, **options))
        return self._loader

    @property
    def preempted(self) -> bool:
        return self.run.status in ("preempted", "migrated")

    def raise_if_preempted(self) -> None:
        """After `trainer.fit`: a run that left on a notice raises Preempted (SystemExit 143),
        what a launcher expects of a job a notice ended; a finished run returns."""
        if self.preempted:
            raise Preempted(f"run {self.run.run_id} left on a notice at step "
                            f"{self.run.step_count} ({self.run.status}); its checkpoint is "
                            "committed and the next start resumes it")

    # -- Lightning's hooks -----------------------------------------------------------------------
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        self._trainer = trainer
        refused = self._refusals(trainer)
        if refused:
            raise RunSpecError("TrainwiseCallback: this fit cannot run under trainwise: "
                               + "; ".join(refused))
        if any(type(cb).__name__ == "ModelCheckpoint" for cb in trainer.callbacks):
            # Not refused (it is Lightning's default), but the run never reads what it writes.
            rank_zero_warn(
                "ModelCheckpoint writes Lightning .ckpt files beside trainwise's checkpoints; a "
                "trainwise resume reads only its own: pass Trainer(enable_checkpointing=False)")

    def _refusals(self, trainer: pl.Trainer) -> list[str]:
        why = []
        spec = self.run.spec
        if trainer.world_size != 1 or spec.world_size != 1:
            why.append(f"world_size {trainer.world_size} (spec {spec.world_size}): multi-rank "
                       "Lightning fits are not supported yet (every rank must stop at the step "
                       "a notice names); run one process per job")
        if spec.max_steps is not None and trainer.max_steps != spec.max_steps:
            why.append(f"Trainer(max_steps={trainer.max_steps}) but the run spec says "
                       f"max_steps={spec.max_steps}: pass Trainer(max_steps=tw.max_steps)")
        if trainer.limit_train_batches not in (1.0, None) or trainer.overfit_batches:
            why.append("limit_train_batches/overfit_batches cut an epoch short of the order the "
                       "checkpoint holds: leave them at their defaults (select examples with "
                       "tw.dataloader(..., select=indices) instead)")
        if trainer.fit_loop.min_steps or trainer.fit_loop.min_epochs:
            why.append("min_steps/min_epochs keep a fit running after should_stop, past the "
                       "checkpoint a notice wrote: remove them")
        environment = trainer._accelerator_connector.cluster_environment
        if getattr(environment, "auto_requeue", False):
            why.append("SLURM auto-requeue answers SIGTERM/SIGUSR1 with Lightning's own .ckpt "
                       "and requeue: pass plugins=[SLURMEnvironment(auto_requeue=False)]")
        return why

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.ckpt_path:
            raise RunSpecError(f"trainer.fit(ckpt_path={trainer.ckpt_path!r}): trainwise resumes "
                               "the run from its own checkpoints (Lightning's .ckpt is a pickle "
                               "that can run code when loaded); drop ckpt_path")
        if len(trainer.optimizers) != 1:
            raise RunSpecError(f"{len(trainer.optimizers)} optimizers: the Lightning callback "
                               "tracks exactly one (return one from configure_optimizers)")
        if len(trainer.lr_scheduler_configs) > 1:
            raise RunSpecError(f"{len(trainer.lr_scheduler_configs)} LR schedulers: the "
                               "Lightning callback tracks at most one")
        scheduler = (trainer.lr_scheduler_configs[0].scheduler
                     if trainer.lr_scheduler_configs else None)
        # The optimizers exist from here on (strategy.setup); on a resume this loads the model,
        # optimizer, scheduler and random streams from the checkpoint.
        self.run.track(pl_module, trainer.optimizers[0], scheduler=scheduler)
        kept = self.run.keep_state(_STATE_NAME, self._lightning_state)
        if kept is not None:
            self._restore_lightning_state(trainer, pl_module, kept)
        self._last_global_step = trainer.global_step
        if trainer.global_step != self.run.step_count:
            raise RunSpecError(f"Lightning's global step {trainer.global_step} is not the run's "
                               f"step {self.run.step_count} after the resume: the checkpoint's "
                               "loop state does not match it; start a new run (another run_id)")

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # Lightning's SignalConnector registered its SIGTERM handler just before this hook (it
        # chains ours): left in place it raises SIGTERMException (a SystemExit with code 0) at
        # the end of the batch, after our checkpoint but skipping the run's outcome and the
        # 143 a launcher expects. trainwise answers the notice itself, so its handler replaces
        # Lightning's for the fit; Lightning's teardown puts back the handlers it found.
        if threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGTERM, self._on_sigterm)
        connector = getattr(trainer, "_signal_connector", None)
        if connector is not None:
            if connector.received_sigterm:
                # A SIGTERM between Lightning's registration and here reached both handlers:
                # the run has the notice; Lightning must not raise on it as well.
                connector.received_sigterm = False
            originals = getattr(connector, "_original_handlers", None)
            if isinstance(originals, dict) and signal.SIGTERM in originals:
                # Lightning's teardown (also after an exception) puts back what it found, the
                # run's handler; after the run a SIGTERM must do what it did before the run.
                originals[signal.SIGTERM] = self._handler_before
        if self._loader is None or trainer.train_dataloader is not self._loader:
            raise RunSpecError("the train loader is not tw.dataloader(...): trainwise keeps the "
                               "data position only for its own loader; pass "
                               "trainer.fit(model, train_dataloaders=tw.dataloader(dataset, "
                               "batch_size))")

    def _on_sigterm(self, signum: int, frame: Any) -> None:
        self.run.notice("SIGTERM")

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule,
                             batch: Any, batch_idx: int) -> None:
        assert self._loader is not None
        self._samples_since_step += self._loader.batch_started()

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule,
                           outputs: Any, batch: Any, batch_idx: int) -> None:
        if self.run.status is not None:  # the run ended (a notice): Lightning is stopping
            return
        if trainer.global_step == self._last_global_step:
            return  # accumulating gradients: the optimizer has not stepped yet
        self._last_global_step = trainer.global_step
        loss = outputs.get("loss") if isinstance(outputs, dict) else outputs
        samples, self._samples_since_step = self._samples_since_step, 0
        # Lightning has stepped the optimizer and the step-interval schedulers, and counted the
        # batch processed: a checkpoint here is one Lightning itself resumes from exactly
        # ("restarted on train batch end").
        self.run.step(loss=loss, samples=samples, learning_rate=self._lr(trainer))
        if self.run.should_stop or self.run.done:
            trainer.should_stop = True

    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.run.status is None:
            self.run.finish(eval_loss=self._eval_loss(trainer))

    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule,
                     exception: BaseException) -> None:
        if self.run.status is None:  # the outcome says failed, with the error
            self.run.__exit__(type(exception), exception, exception.__traceback__)

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        # Lightning's teardown put back the handler it found (trainwise's): once the run has
        # ended, a SIGTERM must again do what it did before the run.
        if (stage == "fit" and self.run.status is not None
                and threading.current_thread() is threading.main_thread()
                and signal.getsignal(signal.SIGTERM) in (self._on_sigterm,
                                                         getattr(self.run, "_on_sigterm", None))):
            signal.signal(signal.SIGTERM, self._handler_before)

    # -- Lightning's own state in trainwise's checkpoint -------------------------------------------
    def _lightning_state(self) -> dict[str, Any]:
        """Called by run.checkpoint(): tensors and plain data only (weights-only load)."""
        trainer = self._trainer
        assert trainer is not None
        callbacks = {}
        for callback in trainer.callbacks:
            if callback is not self and (state := callback.state_dict()):
                callbacks[callback.state_key] = state
        module_extra: dict[str, Any] = {}
        trainer.lightning_module.on_save_checkpoint(module_extra)  # the user's own additions
        datamodule = trainer.datamodule
        return {"fit_loop": trainer.fit_loop.state_dict(), "callbacks": callbacks,
                "precision": trainer.precision_plugin.state_dict(), "module": module_extra,
                "datamodule": datamodule.state_dict() if datamodule is not None else {}}

    def _restore_lightning_state(self, trainer: pl.Trainer, pl_module: pl.LightningModule,
                                 kept: dict[str, Any]) -> None:
        # What Lightning's checkpoint connector does in restore_loops / restore_callbacks /
        # restore_precision_plugin_state, from trainwise's checkpoint: the loops then restart
        # "on train batch end" (the batch counted, the next one first) with the loader already
        # at that batch's position (run.dataloader restored it).
        trainer.fit_loop.load_state_dict(kept["fit_loop"])
        for callback in trainer.callbacks:
            if callback is not self and callback.state_key in kept["callbacks"]:
                callback.load_state_dict(kept["callbacks"][callback.state_key])
        if kept.get("precision"):
            trainer.precision_plugin.load_state_dict(kept["precision"])
        if kept.get("module"):
            pl_module.on_load_checkpoint(kept["module"])
        if kept.get("datamodule") and trainer.datamodule is not None:
            trainer.datamodule.load_state_dict(kept["datamodule"])

    # -- numbers for the telemetry ---------------------------------------------------------------
    @staticmethod
    def _lr(trainer: pl.Trainer) -> float | None:
        if trainer.optimizers and trainer.optimizers[0].param_groups:
            return float(trainer.optimizers[0].param_groups[0].get("lr", math.nan))
        return None

    def _eval_loss(self, trainer: pl.Trainer) -> float | None:
        if self.eval_metric is None:
            return None
        value = trainer.callback_metrics.get(self.eval_metric)
        return None if value is None else float(value)
