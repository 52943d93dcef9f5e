"""PyTorch Lightning under trainwise (`trainwise.sdk.lightning`), through the example project
`examples/lightning/train.py` run as a user would run it: a child process per start.

Each resume check stops a run with a real SIGTERM (or the node agent's notice file) mid-epoch,
sees it exit 143 after committing a checkpoint to the object store, starts it again (from the
local checkpoint, or from the store after the local folder is deleted) and compares the final
checkpoint with an uninterrupted run's: model, optimizer, scheduler and data position equal bit
for bit (torch.equal; CPU, one thread, the same thread count in every start).

The example's epoch is 12 batches (180 training rows, batch 16, the last one 4 rows) and its run
40 steps, so the stops below land mid-epoch and the run crosses three epoch ends.
"""

from __future__ import annotations

import shutil
import signal
from pathlib import Path

import pytest
import torch

pytest.importorskip("lightning")

from tests._example_job import (  # noqa: E402
    ExampleJob,
    assert_same_weights_and_data,
    interrupt_twenty_times,
)

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "examples" / "lightning" / "train.py"
MAX_STEPS = 40


def Job(base: Path, run_id: str = 'lit', extra: tuple[str, ...] = ()) -> ExampleJob:
    return ExampleJob(SCRIPT, base, run_id, max_steps=MAX_STEPS, extra=extra,
                      timeout_s=120.0)


def assert_same_training(resumed: dict, baseline: dict) -> None:
    assert_same_weights_and_data(resumed, baseline, MAX_STEPS)
    # Lightning's training progress (epoch, batch, optimizer and scheduler counts) is equal too.
    # Its validation counters are not compared: a notice on an epoch's last batch lets the
    # stopping process run that epoch's validation after the checkpoint, and the resumed epoch
    # then counts it among its own validation batches (bookkeeping only; no weights change).
    def training_progress(state: dict) -> dict:
        return {key: value for key, value in state["kept_state"]["lightning"]["fit_loop"].items()
                if not key.startswith("epoch_loop.val_loop")}

    assert training_progress(resumed) == training_progress(baseline)


@pytest.fixture(scope="module")
def baseline(tmp_path_factory) -> dict:
    job = Job(tmp_path_factory.mktemp("lightning_baseline"))
    lines = job.run_to_end()
    assert "resumed False at step 0" in lines and f"finished at step {MAX_STEPS}" in lines
    assert job.outcome()["status"] == "completed"
    assert job.committed_steps() == [10, 20, 30, 40]
    return job.final_state()


def _resumed_line(lines: list[str]) -> str:
    return next(line for line in lines if line.startswith("resumed "))


def test_sigterm_mid_epoch_commits_and_resumes_bit_identical(tmp_path, baseline):
    job = Job(tmp_path)
    code, stopped_at, lines = job.interrupt(after_step=16)  # epoch 1, batch 4 of 12
    assert code == 143, "\n".join(lines[-30:])
    assert job.outcome()["status"] == "preempted"
    assert 17 <= stopped_at <= 19 and stopped_at % 12 != 0, stopped_at
    assert stopped_at in job.committed_steps()  # the notice's checkpoint is in the store
    assert not any("SIGTERMException" in line for line in lines)  # Lightning's own answer off

    lines = job.run_to_end()
    assert _resumed_line(lines) == f"resumed True at step {stopped_at}"
    assert job.outcome()["status"] == "completed"
    assert_same_training(job.final_state(), baseline)


def test_resume_from_the_store_after_the_local_folder_is_gone(tmp_path, baseline):
    job = Job(tmp_path)
    code, stopped_at, _ = job.interrupt(after_step=27)  # epoch 2, batch 3
    assert code == 143 and stopped_at in job.committed_steps()
    shutil.rmtree(job.run_dir / "checkpoints")  # a new node: only the object store is left

    lines = job.run_to_end()
    assert _resumed_line(lines) == f"resumed True at step {stopped_at}"
    assert_same_training(job.final_state(), baseline)


def test_notice_file_stops_and_resumes_bit_identical(tmp_path, baseline):
    job = Job(tmp_path)
    code, stopped_at, _ = job.interrupt(after_step=5, how="notice_file")
    assert code == 143 and job.outcome()["status"] == "preempted"
    assert 6 <= stopped_at <= 8 and stopped_at in job.committed_steps()

    lines = job.run_to_end()
    assert _resumed_line(lines) == f"resumed True at step {stopped_at}"
    assert_same_training(job.final_state(), baseline)


@pytest.mark.slow
def test_twenty_interruptions_at_random_steps_stay_bit_identical(tmp_path, baseline):
    """One run stopped 20 times at steps drawn at random (seeded, so a failure replays), by
    SIGTERM and by the notice file in turn, every third resume from the store alone."""
    job = Job(tmp_path)
    stops = interrupt_twenty_times(job, seed=26)
    assert len(stops) >= 18, stops
    assert_same_training(job.final_state(), baseline)


# -- refusals at start (in this process: they fail before the first step) ------------------------
def _module_and_data():
    import lightning.pytorch as pl

    class Tiny(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.layer = torch.nn.Linear(2, 1)

        def training_step(self, batch, batch_idx):
            return self.layer(batch[0]).pow(2).mean()

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    return Tiny(), torch.utils.data.TensorDataset(torch.randn(32, 2))


def _trainer(callback, **options):
    import lightning.pytorch as pl

    options.setdefault("max_steps", callback.max_steps)
    return pl.Trainer(accelerator="cpu", devices=1, callbacks=[callback], logger=False,
                      enable_progress_bar=False, enable_checkpointing=False,
                      enable_model_summary=False, **options)


def test_batch_scaling_is_refused_at_init_with_the_reason(tmp_path):
    from trainwise.sdk.lightning import TrainwiseCallback
    from trainwise.sdk.spec import RunSpecError

    with pytest.raises(RunSpecError, match="batch_scaling: lightning builds its own data loader"):
        TrainwiseCallback(run_id="refuse", run_dir=str(tmp_path),
                          fast_levers=("batch_scaling", "preemption"))


@pytest.mark.parametrize("case", ["max_steps", "foreign_loader", "ckpt_path", "limit_batches"])
def test_what_cannot_apply_is_refused_before_training(tmp_path, case):
    from trainwise.sdk.lightning import TrainwiseCallback
    from trainwise.sdk.spec import RunSpecError

    before = signal.getsignal(signal.SIGTERM)
    tw = TrainwiseCallback(run_id=f"refuse-{case.replace('_', '-')}", run_dir=str(tmp_path),
                           max_steps=4)
    model, data = _module_and_data()
    loader = tw.dataloader(data, batch_size=8)
    fit: dict = {"train_dataloaders": loader}
    options: dict = {}
    expected = {"max_steps": "pass Trainer\\(max_steps=tw.max_steps\\)",
                "foreign_loader": "the train loader is not tw.dataloader",
                "ckpt_path": "drop ckpt_path", "limit_batches": "limit_train_batches"}[case]
    if case == "max_steps":
        options["max_steps"] = 3
    elif case == "foreign_loader":
        fit["train_dataloaders"] = torch.utils.data.DataLoader(data, batch_size=8)
    elif case == "ckpt_path":
        import lightning.pytorch as pl

        other = pl.Trainer(accelerator="cpu", max_steps=1, logger=False,
                           enable_progress_bar=False, enable_checkpointing=False,
                           default_root_dir=str(tmp_path / "lightning"))
        other.fit(model, torch.utils.data.DataLoader(data, batch_size=8))
        other.save_checkpoint(tmp_path / "lightning.ckpt")
        fit["ckpt_path"] = str(tmp_path / "lightning.ckpt")
    else:
        options["limit_train_batches"] = 0.5
    with pytest.raises(RunSpecError, match=expected):
        _trainer(tw, **options).fit(model, **fit)
    assert tw.run.status == "failed" and tw.run.step_count == 0
    assert signal.getsignal(signal.SIGTERM) == before  # the run put the handler back


def test_callback_without_a_notice_finishes_the_run(tmp_path):
    from trainwise.sdk.lightning import TrainwiseCallback

    tw = TrainwiseCallback(run_id="tiny", run_dir=str(tmp_path), max_steps=6,
                           checkpoint_every_steps=None)
    model, data = _module_and_data()
    _trainer(tw).fit(model, train_dataloaders=tw.dataloader(data, batch_size=8))
    tw.raise_if_preempted()  # returns: the run finished
    assert tw.run.status == "completed" and tw.run.step_count == 6
    state = torch.load(tmp_path / "checkpoints" / "rank0" / "step-0000006.pt",
                       weights_only=True)
    assert "epoch_progress" in state["kept_state"]["lightning"]["fit_loop"]
    # 4 batches an epoch: the sixth step trained the second batch of the second epoch
    assert state["sampler"]["epoch"] == 1 and state["sampler"]["cursor"] == 16
