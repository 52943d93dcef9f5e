"""Dynamic pruning inside the training loop: the consumption record, a mid-run rate change through
the control file, the in-process slow tick, and an exact resume."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from controllers.fast_types import FastAction, FastObservation
from controllers.pruning import PruningConfig
from tests.test_data_pruning_draw import FINGERPRINT, synthetic_examples
from tests.test_data_pruning_inputs import scores_for
from tests.test_training_loop import step_losses, text_examples, tiny_config
from training.consumption import epochs, example_history, read_consumption, trained_on
from training.curriculum import build_curriculum, write_curriculum
from training.dynamic_pruning import DynamicPruningConfig, write_pruning_control
from training.loop import train
from training.sampler import DynamicPruningSampler

torch.set_num_threads(1)

# 224 train examples, 16 per step: 70 full-data steps = 5 epochs.
BUDGET_STEPS = 70


def config(**changes):
    return tiny_config(max_steps=BUDGET_STEPS, eval_every_steps=10, **changes)


class ControlWriter:
    """A fast policy that, like the slow layer's sensor, writes the control file at one step."""

    name = "control_writer"

    def __init__(self, path, at_step: int, rate: float) -> None:
        self.path, self.at_step, self.rate = path, at_step, rate

    def act(self, observation: FastObservation) -> FastAction:
        if observation.step == self.at_step:
            write_pruning_control(self.path, pruning_rate=self.rate, reason="test: slow tick")
        return FastAction(
            micro_batch_size=observation.micro_batch_size,
            grad_accum_steps=observation.grad_accum_steps,
            learning_rate=observation.learning_rate, rank_work_shares=(1.0,), reason="keep")


def test_the_record_says_what_each_step_trained_on_and_what_each_epoch_skipped(tmp_path):
    examples = text_examples()
    result = train(config(), examples, None, tmp_path, pruning=DynamicPruningConfig())
    records = read_consumption(result.telemetry_dir)
    by_step = trained_on(records)
    assert sorted(by_step) == list(range(result.steps))
    assert sum(len(ids) for ids in by_step.values()) == result.samples_seen
    assert result.samples_seen < BUDGET_STEPS * 16  # pruned epochs are cheaper
    epoch_records = epochs(records)
    assert [e["epoch"] for e in epoch_records] == list(range(len(epoch_records)))
    assert epoch_records[0]["skipped_count"] == 0  # equal start scores: epoch 0 is full data
    pruned = [e for e in epoch_records if e["skipped_count"]]
    assert pruned and all(e["skipped"][0]["reason"] == "pruned: below-mean loss, rate 0.5"
                          for e in pruned)
    assert epoch_records[-1]["phase"] == "anneal"
    assert epoch_records[-1]["reason"] == "anneal: full data"
    # A skipped example is not trained on in that epoch, and its history says why.
    batches = [r for r in records if r["type"] == "batch"]
    first = pruned[0]
    skipped_id = first["skipped"][0]["ids"][0]
    in_epoch = {i for r in batches if r["epoch"] == first["epoch"] for i in r["ids"]}
    assert skipped_id not in in_epoch
    history = example_history(records, skipped_id)
    assert {"epoch": first["epoch"], "step": first["step"],
            "reason": "pruned: below-mean loss, rate 0.5"} in history["skipped"]
    assert history["trained_at_steps"]  # seen in other epochs
    train_ids = set(examples.example_ids[examples.train_positions].tolist())
    assert {i for ids in by_step.values() for i in ids.tolist()} == train_ids


def test_a_mid_run_rate_change_through_the_control_file_shows_in_the_record(tmp_path):
    examples = text_examples()
    control = tmp_path / "control.json"
    policy = ControlWriter(control, at_step=20, rate=0.2)
    pruning = DynamicPruningConfig(pruning_rate=0.8, control_path=control)
    result = train(config(), examples, None, tmp_path / "run", pruning=pruning, fast_policy=policy)
    records = read_consumption(result.telemetry_dir)
    (change,) = [r for r in records if r["type"] == "rate"]
    assert change["step"] == 20 and change["source"] == "control_file"
    assert change["rate"] == 0.2 and change["reason"] == "test: slow tick"
    by_epoch = {e["epoch"]: e for e in epochs(records)}
    assert by_epoch[change["applies_from_epoch"]]["step"] >= 20
    before = [e for e in by_epoch.values() if e["step"] < 20 and e["skipped_count"]]
    after = [e for e in by_epoch.values() if e["step"] >= 20 and e["phase"] == "curriculum"]
    assert before and all(e["rate"] == 0.8 for e in before)
    assert after and all(e["rate"] == 0.2 for e in after)
    # Read once: later ticks see the same file and change nothing.
    assert len([r for r in records if r["type"] == "rate"]) == 1


def test_the_slow_tick_sets_the_rate_from_the_loss_curve(tmp_path):
    examples = text_examples()
    pruning = DynamicPruningConfig(pruning_rate=0.0, slow_policy=PruningConfig(),
                                   slow_every_steps=8)
    result = train(config(), examples, None, tmp_path, pruning=pruning)
    decisions = [r for r in read_consumption(result.telemetry_dir) if r["type"] == "rate"]
    assert decisions and all(d["source"] == "slow_policy" for d in decisions)
    assert decisions[0]["rate"] == 0.0 and "no eval loss yet" in decisions[0]["reason"]
    assert any(d["rate"] > 0 for d in decisions)  # once the guard has a baseline
    assert all("fraction_done" in d["numbers"] for d in decisions)


@pytest.mark.parametrize("method", ["infobatch", "random"])
def test_resume_reproduces_the_losses_and_the_record_exactly(tmp_path, method):
    examples = text_examples()
    control = tmp_path / "control.json"
    write_pruning_control(control, pruning_rate=0.3, reason="before the run")

    def pruning():
        return DynamicPruningConfig(method=method, pruning_rate=0.6, control_path=control,
                                    slow_policy=PruningConfig(), slow_every_steps=20)

    whole = train(config(), examples, None, tmp_path / "whole", pruning=pruning())
    # The split run checkpoints at step 30, goes on to 36 and "dies"; the resume from step 30
    # redoes 30..35 and its records supersede the dead process's.
    first = train(config(checkpoint_every_steps=30), examples, None, tmp_path / "split",
                  pruning=pruning(), stop_after_steps=36)
    assert first.status == "stopped"
    checkpoint = tmp_path / "split" / "checkpoints" / "step-0000030.pt"
    second = train(config(), examples, None, tmp_path / "split", pruning=pruning(),
                   resume_from=checkpoint)
    assert second.status == "completed" and second.steps == whole.steps
    assert step_losses(second) == step_losses(whole)  # bitwise
    assert second.final_eval_loss == whole.final_eval_loss
    whole_records = read_consumption(whole.telemetry_dir)
    split_records = read_consumption(second.telemetry_dir)
    whole_steps, split_steps = trained_on(whole_records), trained_on(split_records)
    assert whole_steps.keys() == split_steps.keys()
    assert all(np.array_equal(whole_steps[s], split_steps[s]) for s in whole_steps)

    def decisions(records):
        return [(r["step"], r["rate"], r["source"]) for r in records if r["type"] == "rate"]

    assert decisions(split_records) == decisions(whole_records)


def test_a_plain_checkpoint_is_not_resumed_with_pruning_nor_the_reverse(tmp_path):
    examples = text_examples()
    plain = train(tiny_config(max_steps=4), examples, None, tmp_path / "plain")
    with pytest.raises(ValueError, match="without dynamic pruning"):
        train(tiny_config(max_steps=8), examples, None, tmp_path / "plain",
              resume_from=plain.checkpoint_path, pruning=DynamicPruningConfig())
    pruned = train(tiny_config(max_steps=4), examples, None, tmp_path / "pruned",
                   pruning=DynamicPruningConfig())
    with pytest.raises(ValueError, match="with dynamic pruning"):
        train(tiny_config(max_steps=8), examples, None, tmp_path / "pruned",
              resume_from=pruned.checkpoint_path)
    other = dataclasses.replace(DynamicPruningConfig(), method="random")
    with pytest.raises(ValueError, match="same method"):
        train(tiny_config(max_steps=8), examples, None, tmp_path / "pruned",
              resume_from=pruned.checkpoint_path, pruning=other)


def test_a_new_curriculum_version_is_picked_up_at_a_fast_tick(tmp_path):
    examples = synthetic_examples()
    curriculum = build_curriculum(examples, scores_for(examples), 0.5, seed=0)
    write_curriculum(curriculum, tmp_path / "curricula")
    control = tmp_path / "control.json"
    record = tmp_path / "consumption.jsonl"
    sampler = DynamicPruningSampler(
        examples, None, config=DynamicPruningConfig(pruning_rate=0.0, control_path=control),
        seed=0, max_steps=1000, samples_per_step=10, model_fingerprint=FINGERPRINT,
        consumption_path=record)
    n_train = len(examples.train_positions)
    sampler.next_batch(10, 0)
    write_pruning_control(control, curriculum_dir=tmp_path / "curricula", reason="re-materialized")
    sampler.on_fast_tick(1)
    positions, weights = sampler.next_batch(n_train - 10 + len(curriculum.example_ids), 1)
    epoch_1 = positions[n_train - 10:]
    assert set(epoch_1.tolist()) == set(examples.positions_of(curriculum.example_ids).tolist())
    assert set(weights[n_train - 10:].tolist()) == set(curriculum.weights.tolist())
    sampler.close()
    records = read_consumption(record)
    (change,) = [r for r in records if r["type"] == "curriculum"]
    assert change["version"] == curriculum.version and change["source"] == "control_file"
    assert change["step"] == 1 and change["applies_from_epoch"] == 1
    epoch_record = epochs(records)[1]
    assert epoch_record["curriculum_version"] == curriculum.version
    reasons = {group["reason"]: len(group["ids"]) for group in epoch_record["skipped"]}
    outside = n_train - len(curriculum.example_ids)
    assert reasons[f"not in curriculum {curriculum.version}"] == outside
