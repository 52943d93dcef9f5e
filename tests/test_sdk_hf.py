"""The Hugging Face Trainer under trainwise (`trainwise.sdk.hf`), through the example project
`examples/hf_trainer/train.py` run as a user would run it: a child process per start.

Each resume check stops a run with a real SIGTERM (or the node agent's notice file, or a SIGKILL
that leaves only the last interval checkpoint) mid-epoch, sees it exit 143 after committing a
checkpoint to the object store, starts it again (from the local checkpoint, or from the store
after the local folder is deleted) and compares the final checkpoint with an uninterrupted run's:
model, optimizer, LR scheduler, data position and the Trainer's own state (global step, epoch,
FLOs) equal bit for bit (torch.equal; CPU, one thread, the same thread count in every start).

The example's epoch is 17 batches (270 training passages, batch 16, the last one 14) and its run
40 steps with an evaluation every 20, so the stops below land mid-epoch and the run crosses two
epoch ends. With two accumulation steps an epoch is 9 optimizer steps, the last of one batch.
"""

from __future__ import annotations

import shutil
import signal
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("accelerate")  # the Trainer's own dependency

from tests._example_job import (  # noqa: E402
    ExampleJob,
    assert_same_weights_and_data,
    interrupt_twenty_times,
)

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "examples" / "hf_trainer" / "train.py"
MAX_STEPS = 40
BATCHES_PER_EPOCH = 17


def Job(base: Path, run_id: str = 'hf', extra: tuple[str, ...] = ()) -> ExampleJob:
    return ExampleJob(SCRIPT, base, run_id, max_steps=MAX_STEPS, extra=extra,
                      timeout_s=180.0)


def trainer_progress(state: dict) -> dict:
    kept = state["kept_state"]["hf_trainer"]["trainer_state"]
    return {key: kept[key] for key in ("global_step", "epoch", "max_steps", "num_train_epochs",
                                       "total_flos")}


def assert_same_training(resumed: dict, baseline: dict) -> None:
    assert_same_weights_and_data(resumed, baseline, MAX_STEPS)
    # The Trainer's own progress is equal too (its log history is not compared: a log due at
    # the step a notice stopped at is written by the stopping process only, and timings vary).
    assert trainer_progress(resumed) == trainer_progress(baseline)


@pytest.fixture(scope="module")
def baseline(tmp_path_factory) -> dict:
    job = Job(tmp_path_factory.mktemp("hf_baseline"))
    lines = job.run_to_end()
    assert "resumed False at step 0" in lines
    assert any(line.startswith(f"finished at step {MAX_STEPS} eval_loss ") for line in lines)
    outcome = job.outcome()
    assert outcome["status"] == "completed" and outcome["eval_loss"] is not None
    assert job.committed_steps() == [10, 20, 30, 40]
    state = job.final_state()
    # 40 steps of 17 batches an epoch: the 40th trained the 6th batch of the third epoch
    assert state["sampler"]["epoch"] == 2 and state["sampler"]["cursor"] == 6 * 16
    assert trainer_progress(state)["epoch"] == 2 + 6 / BATCHES_PER_EPOCH
    return state


def _resumed_line(lines: list[str]) -> str:
    return next(line for line in lines if line.startswith("resumed "))


def test_sigterm_mid_epoch_commits_and_resumes_bit_identical(tmp_path, baseline):
    job = Job(tmp_path)
    code, stopped_at, lines = job.interrupt(after_step=22)  # epoch 1, batch 5 of 17
    assert code == 143, "\n".join(lines[-30:])
    assert job.outcome()["status"] == "preempted"
    assert 23 <= stopped_at <= 25 and stopped_at % BATCHES_PER_EPOCH != 0, stopped_at
    assert stopped_at in job.committed_steps()  # the notice's checkpoint is in the store
    assert not any(line.startswith(f"step {stopped_at + 1} ") for line in lines)

    lines = job.run_to_end()
    assert _resumed_line(lines) == f"resumed True at step {stopped_at}"
    assert f"step {stopped_at + 1} epoch " in "\n".join(lines)
    assert job.outcome()["status"] == "completed"
    assert_same_training(job.final_state(), baseline)


def test_resume_from_the_store_after_the_local_folder_is_gone(tmp_path, baseline):
    job = Job(tmp_path)
    code, stopped_at, _ = job.interrupt(after_step=29)  # epoch 1, batch 12
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


def test_a_crash_after_an_evaluation_resumes_from_its_interval_checkpoint_bit_identical(
        tmp_path, baseline):
    """SIGKILL (no notice, no checkpoint of its own) after step 22: the newest checkpoint is the
    interval one of step 20, after which the first start evaluated. The resumed start does not
    repeat that evaluation, so it continues bit for bit only because an evaluation during
    training leaves the random streams (its loader draws a seed from torch's) as it found them."""
    job = Job(tmp_path)
    code, _, lines = job.interrupt(after_step=22, how="sigkill")
    assert code == -signal.SIGKILL
    assert any(line.startswith("{'eval_loss'") for line in lines)  # step 20's evaluation ran
    assert job.committed_steps() == [10, 20]

    lines = job.run_to_end()
    assert _resumed_line(lines) == "resumed True at step 20"
    assert_same_training(job.final_state(), baseline)


def test_gradient_accumulation_resumes_mid_epoch_bit_identical(tmp_path):
    """Two micro-batches per step over a 17-batch epoch: the epoch's last step has one. A stop
    in the second epoch resumes with the same grouping (the Trainer is handed the resumed epoch
    as the batches left), ending with the uninterrupted run's weights."""
    reference = Job(tmp_path / "reference", extra=("--grad-accum", "2"))
    reference.run_to_end()
    expected = reference.final_state()
    # 9 steps an epoch: step 40 is the fourth of the fifth epoch, its batches 7 and 8
    assert expected["sampler"]["epoch"] == 4 and expected["sampler"]["cursor"] == 8 * 16

    job = Job(tmp_path / "interrupted", extra=("--grad-accum", "2"))
    code, stopped_at, lines = job.interrupt(after_step=12)
    assert code == 143, "\n".join(lines[-30:])
    assert 13 <= stopped_at <= 15, stopped_at  # epoch 1, mid-way
    lines = job.run_to_end()
    assert _resumed_line(lines) == f"resumed True at step {stopped_at}"
    assert_same_training(job.final_state(), expected)


@pytest.mark.slow
def test_twenty_interruptions_at_random_steps_stay_bit_identical(tmp_path, baseline):
    """One run stopped 20 times at steps drawn at random (seeded, so a failure replays), by
    SIGTERM and by the notice file in turn, every third resume from the store alone."""
    job = Job(tmp_path)
    stops = interrupt_twenty_times(job, seed=26)
    assert len(stops) >= 18, stops
    assert_same_training(job.final_state(), baseline)


# -- in this process: refusals before the first step, and a tiny run ------------------------------
class _Counting(torch.nn.Module):
    """A tiny model with the Trainer's calling convention (keyword inputs, a loss output)."""

    def __init__(self) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(2, 1)
        self.dropout = torch.nn.Dropout(0.2)  # draws from torch's generator every step

    def forward(self, x=None, labels=None):
        out = self.layer(self.dropout(x)).squeeze(-1)
        return {"loss": torch.nn.functional.mse_loss(out, labels), "logits": out}


def _data(n: int = 30):
    generator = torch.Generator().manual_seed(5)
    x = torch.randn(n, 2, generator=generator)
    return [{"x": x[i], "labels": x[i].sum(), "example_id": 100 + i} for i in range(n)]


class _Rows(torch.utils.data.Dataset):
    column_names = ("example_id", "x", "labels")

    def __init__(self, rows):
        self.rows = rows

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, key):
        if key == "example_id":
            return [row["example_id"] for row in self.rows]
        return self.rows[key]


def _trainer(tw, *, callbacks=(), **options):
    from trainwise.sdk.hf import TrainwiseTrainer

    options.setdefault("per_device_train_batch_size", 8)
    options.setdefault("learning_rate", 0.05)
    torch.manual_seed(0)
    return TrainwiseTrainer(model=_Counting(), args=tw.training_args(**options),
                            train_dataset=_Rows(_data()), callbacks=[tw, *callbacks])


def test_batch_scaling_is_refused_at_init_with_the_reason(tmp_path):
    from trainwise.sdk.hf import TrainwiseCallback
    from trainwise.sdk.spec import RunSpecError

    with pytest.raises(RunSpecError, match="batch_scaling: hf_trainer builds its own data loader"):
        TrainwiseCallback(run_id="refuse", run_dir=str(tmp_path),
                          fast_levers=("batch_scaling", "preemption"))


@pytest.mark.parametrize("case", ["max_steps", "resume_from_checkpoint", "plain_trainer",
                                  "auto_find_batch_size", "trial", "world_size"])
def test_what_cannot_apply_is_refused_before_training(tmp_path, case):
    from transformers import Trainer

    from trainwise.sdk.hf import TrainwiseCallback
    from trainwise.sdk.spec import RunSpecError

    before = signal.getsignal(signal.SIGTERM)
    ranks = {"world_size": 2} if case == "world_size" else {}
    tw = TrainwiseCallback(run_id=f"refuse-{case.replace('_', '-')}", run_dir=str(tmp_path),
                           max_steps=4, **ranks)
    expected = {"max_steps": "pass max_steps=tw.max_steps",
                "resume_from_checkpoint": "drop resume_from_checkpoint",
                "plain_trainer": "needs trainwise.sdk.hf.TrainwiseTrainer",
                "auto_find_batch_size": "leave auto_find_batch_size off",
                "trial": "call train\\(\\) without trial",
                "world_size": "run one process on one device per job"}[case]
    with pytest.raises(RunSpecError, match=expected):
        if case == "plain_trainer":
            Trainer(model=_Counting(), args=tw.training_args(), train_dataset=_Rows(_data()),
                    callbacks=[tw])
        elif case == "max_steps":
            _trainer(tw, max_steps=3).train()
        elif case == "auto_find_batch_size":
            _trainer(tw, auto_find_batch_size=True).train()
        elif case == "trial":
            _trainer(tw).train(trial={"learning_rate": 0.1})
        elif case == "world_size":  # a spec for two ranks: each would stop at its own step
            _trainer(tw).train()
        else:
            # A Trainer checkpoint folder that exists: it must not even be looked at.
            folder = tmp_path / "checkpoint-2"
            folder.mkdir()
            _trainer(tw).train(resume_from_checkpoint=str(folder))
    assert tw.run.status == "failed" and tw.run.step_count == 0
    assert signal.getsignal(signal.SIGTERM) == before  # the run put the handler back


def test_a_trainer_saving_its_own_checkpoints_is_warned_about(tmp_path):
    from trainwise.sdk.hf import TrainwiseCallback

    tw = TrainwiseCallback(run_id="warn", run_dir=str(tmp_path), max_steps=2,
                           checkpoint_every_steps=None)
    trainer = _trainer(tw, save_strategy="steps", save_steps=100)
    with pytest.warns(UserWarning, match="a trainwise resume reads only its own"):
        trainer.train()
    assert tw.run.status == "completed"


def _stop_at(step: int):
    from transformers import TrainerCallback

    class StopAt(TrainerCallback):
        """The node agent's notice, given in-process as a step ends (before trainwise's turn)."""

        def __init__(self, tw):
            self.tw = tw

        def on_step_end(self, args, state, control, **kwargs):
            if state.global_step == step - 1:
                self.tw.run.notice("test")

    return StopAt


@pytest.mark.parametrize("accumulation,drop_last", [(1, False), (2, True), (3, False)])
def test_in_process_stop_and_resume_match_an_uninterrupted_run(tmp_path, accumulation,
                                                               drop_last):
    """30 rows, batch 8: 4 batches an epoch (3 with drop_last); with accumulation the epochs'
    last steps are short. Stopped at step 4 and resumed, the run ends as the uninterrupted one."""
    from trainwise.sdk.hf import TrainwiseCallback

    options = {"gradient_accumulation_steps": accumulation, "dataloader_drop_last": drop_last}
    fields = {"max_steps": 9, "checkpoint_every_steps": None}

    tw = TrainwiseCallback(run_id="whole", run_dir=str(tmp_path / "whole"), **fields)
    _trainer(tw, **options).train()
    tw.raise_if_preempted()  # returns: the run finished
    assert tw.run.status == "completed" and tw.run.step_count == 9
    expected = torch.load(tmp_path / "whole" / "checkpoints" / "rank0" / "step-0000009.pt",
                          weights_only=True)

    folder = tmp_path / "stopped"
    tw = TrainwiseCallback(run_id="stopped", run_dir=str(folder), **fields)
    trainer = _trainer(tw, **options)
    trainer.add_callback(_stop_at(5)(tw))
    trainer.train()
    with pytest.raises(SystemExit) as left:
        tw.raise_if_preempted()
    assert left.value.code == 143 and tw.run.step_count == 5

    tw = TrainwiseCallback(run_id="stopped", run_dir=str(folder), **fields)
    assert tw.run.resumed and tw.run.step_count == 5
    _trainer(tw, **options).train()
    assert tw.run.status == "completed"
    got = torch.load(folder / "checkpoints" / "rank0" / "step-0000009.pt", weights_only=True)
    for name, tensor in expected["model"].items():
        assert torch.equal(got["model"][name], tensor), name
    assert got["sampler"] == expected["sampler"] and got["scheduler"] == expected["scheduler"]
    kept = [state["kept_state"]["hf_trainer"]["trainer_state"] for state in (got, expected)]
    assert kept[0]["epoch"] == kept[1]["epoch"] and kept[0]["global_step"] == 9


def test_a_run_stopped_at_its_last_step_resumes_to_a_finish_without_training(tmp_path):
    """A notice during the last step: its checkpoint is the final weights; the next start
    trains nothing more (the Trainer's loop would train a batch before it looked)."""
    from trainwise.sdk.hf import TrainwiseCallback

    fields = {"max_steps": 6, "checkpoint_every_steps": None}
    tw = TrainwiseCallback(run_id="last", run_dir=str(tmp_path), **fields)
    trainer = _trainer(tw)
    trainer.add_callback(_stop_at(6)(tw))
    trainer.train()
    assert tw.preempted and tw.run.step_count == 6
    stopped = torch.load(tmp_path / "checkpoints" / "rank0" / "step-0000006.pt",
                         weights_only=True)

    tw = TrainwiseCallback(run_id="last", run_dir=str(tmp_path), **fields)
    assert tw.run.resumed and tw.run.done
    output = _trainer(tw).train()
    assert tw.run.status == "completed" and output.global_step == 6
    assert sorted(p.name for p in (tmp_path / "checkpoints" / "rank0").glob("*.pt")) == [
        "step-0000006.pt"]
    final = torch.load(tmp_path / "checkpoints" / "rank0" / "step-0000006.pt", weights_only=True)
    for name, tensor in stopped["model"].items():
        assert torch.equal(final["model"][name], tensor), name
