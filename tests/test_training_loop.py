"""The training loop on tiny synthetic data: it learns, resumes exactly, obeys SIGTERM and the
fast policy, and records it all in telemetry."""

from __future__ import annotations

import dataclasses
import itertools
import math
import os
import signal
import threading
import time

import numpy as np
import pytest
import torch

from controllers.fast_types import FastAction, FastObservation, PreemptionResponse
from telemetry.reader import read_run_events
from training.checkpoint import CheckpointMismatchError, load_checkpoint
from training.data_types import Curriculum, ExampleSet
from training.loop import TrainConfig, get_lr, train
from training.model import CNNConfig, GPTConfig

torch.set_num_threads(1)

VOCAB = tuple("abcdefgh")
TINY_GPT = GPTConfig(vocab_size=len(VOCAB), block_size=16, n_layer=1, n_head=2, n_embd=32)
TINY_CNN = CNNConfig(channels_1=4, channels_2=8, hidden=32)


def text_examples(n: int = 256, block: int = 16, seed: int = 0) -> ExampleSet:
    """Windows of the cycle abcdefgh from random offsets: predictable after the first token."""
    starts = np.random.default_rng(seed).integers(0, len(VOCAB), n)
    inputs = (starts[:, None] + np.arange(block + 1)[None, :]) % len(VOCAB)
    is_eval = np.zeros(n, dtype=bool)
    is_eval[::8] = True
    return ExampleSet(
        partition="cycle", kind="text", example_ids=np.arange(n, dtype=np.int64) * 3 + 1,
        is_eval=is_eval, inputs=inputs.astype(np.int64), labels=None, vocab=VOCAB,
        shard_index=np.zeros(n, dtype=np.int32), fingerprint="a" * 64,
    )


def image_examples(n: int = 320, seed: int = 0) -> ExampleSet:
    """Class k is a bright 6x6 square at its own place on a noisy background."""
    rng = np.random.default_rng(seed)
    labels = rng.integers(0, 10, n)
    images = rng.integers(0, 60, (n, 28, 28))
    for i, label in enumerate(labels):
        row, col = 2 + 12 * (label // 5), 1 + 5 * (label % 5)
        images[i, row : row + 6, col : col + 6] = 250
    is_eval = np.zeros(n, dtype=bool)
    is_eval[::5] = True
    return ExampleSet(
        partition="squares", kind="image", example_ids=np.arange(n, dtype=np.int64),
        is_eval=is_eval, inputs=images.astype(np.uint8), labels=labels.astype(np.int64),
        vocab=None, shard_index=np.zeros(n, dtype=np.int32), fingerprint="b" * 64,
    )


def curriculum_for(examples: ExampleSet, anneal_fraction: float = 0.25) -> Curriculum:
    """Keeps two thirds of the train examples, weight 1.5 (keep probability 2/3)."""
    train_ids = examples.example_ids[examples.train_positions]
    kept = train_ids[np.arange(len(train_ids)) % 3 != 0]
    return Curriculum(
        partition=examples.partition, version="c1", example_ids=kept,
        weights=np.full(len(kept), 1.5), pruning_rate=1 / 3,
        data_fingerprint=examples.fingerprint, scores_step=None, anneal_fraction=anneal_fraction,
    )


def tiny_config(**changes) -> TrainConfig:
    base = TrainConfig(
        max_steps=24, micro_batch_size=8, grad_accum_steps=2, learning_rate=3e-3,
        min_learning_rate=3e-4, warmup_steps=3, eval_every_steps=8, eval_batches=2,
        eval_batch_size=16, checkpoint_every_steps=0, keep_checkpoints=10, fast_every_steps=4,
        seed=7, price_usd_per_hour=3.06, instance_type="p3.2xlarge", run_id="tiny",
        model=TINY_GPT,
    )
    return dataclasses.replace(base, **changes)


def events(result, kind: str) -> list[dict]:
    return [e for e in read_run_events(result.telemetry_dir) if e["type"] == kind]


def step_losses(result) -> dict[int, float]:
    return {e["step"]: e["train_loss"] for e in events(result, "step")}


class ScriptedPolicy:
    """Returns a scripted change at given steps, else keeps everything (and can send SIGTERM)."""

    name = "scripted"

    def __init__(self, changes: dict[int, dict], sigterm_at: int | None = None) -> None:
        self.changes = changes
        self.sigterm_at = sigterm_at
        self.seen: list[FastObservation] = []

    def act(self, observation: FastObservation) -> FastAction:
        self.seen.append(observation)
        if observation.step == self.sigterm_at and observation.preemption_notice_s is None:
            os.kill(os.getpid(), signal.SIGTERM)
        values = {
            "micro_batch_size": observation.micro_batch_size,
            "grad_accum_steps": observation.grad_accum_steps,
            "learning_rate": observation.learning_rate, "rank_work_shares": (1.0,),
            "reason": f"scripted at step {observation.step}", "numbers": {"step": observation.step},
        }
        values.update(self.changes.get(observation.step, {}))
        return FastAction(**values)


def test_get_lr_warms_up_then_decays_to_the_floor():
    config = tiny_config(max_steps=100, warmup_steps=10)
    rates = [get_lr(step, config) for step in range(101)]
    assert rates[0] < rates[5] < rates[9] <= config.learning_rate
    assert rates[10] == pytest.approx(config.learning_rate)
    assert all(a >= b for a, b in itertools.pairwise(rates[10:]))
    assert rates[100] == config.min_learning_rate


def test_text_run_learns_and_reports_cost_and_telemetry(tmp_path):
    examples = text_examples()
    result = train(tiny_config(), examples, curriculum_for(examples), tmp_path)
    losses = step_losses(result)
    assert result.status == "completed" and result.steps == 24
    assert losses[24] < 0.7 * losses[1]
    assert result.final_eval_loss < 0.8 * math.log(len(VOCAB))
    assert result.samples_seen == 24 * 16 and result.tokens_seen == 24 * 16 * 16
    assert result.cost_usd == pytest.approx(result.elapsed_s * 3.06 / 3600)
    assert result.checkpoint_path.exists()
    assert load_checkpoint(result.checkpoint_path)["step"] == 24
    kinds = [e["type"] for e in read_run_events(result.telemetry_dir)]
    assert kinds[0] == "run_start" and kinds[-1] == "run_end"
    assert kinds.count("eval") == 3 and kinds.count("decision") == 6
    phases = [e["sampler_phase"] for e in events(result, "step")]
    assert phases[:18] == ["curriculum"] * 18 and phases[18:] == ["anneal"] * 6
    # grad_accum_steps = 2: the gradient noise scale is estimated (McCandlish et al.).
    assert all(e["grad_noise_scale"] is not None for e in events(result, "step"))


def test_image_run_learns(tmp_path):
    examples = image_examples()
    config = tiny_config(model=TINY_CNN, max_steps=30, grad_accum_steps=1, learning_rate=5e-3,
                         eval_every_steps=30, run_id="img")
    result = train(config, examples, None, tmp_path)
    losses = step_losses(result)
    assert result.final_eval_accuracy > 0.6
    assert losses[30] < 0.5 * losses[1]
    assert result.tokens_seen == 0 and result.samples_seen == 30 * 8
    # grad_accum_steps = 1: no noise-scale estimate.
    assert all(e["grad_noise_scale"] is None for e in events(result, "step"))


def test_resume_reproduces_the_uninterrupted_losses_exactly(tmp_path):
    examples = text_examples()
    curriculum = curriculum_for(examples)
    policy_changes = {8: {"micro_batch_size": 4, "grad_accum_steps": 3}}
    whole = train(tiny_config(), examples, curriculum, tmp_path / "whole",
                  fast_policy=ScriptedPolicy(policy_changes))
    first = train(tiny_config(), examples, curriculum, tmp_path / "split",
                  fast_policy=ScriptedPolicy(policy_changes), stop_after_steps=10)
    assert first.status == "stopped" and first.steps == 10
    second = train(tiny_config(), examples, curriculum, tmp_path / "split",
                   fast_policy=ScriptedPolicy(policy_changes), resume_from=first.checkpoint_path)
    assert second.status == "completed" and second.steps == 24
    whole_losses, split_losses = step_losses(whole), step_losses(second)
    assert len(whole_losses) == 24 and len(split_losses) == 24  # one run's telemetry, 2 processes
    assert split_losses == whole_losses  # bitwise: floats compared with ==
    assert second.final_eval_loss == whole.final_eval_loss
    assert second.samples_seen == whole.samples_seen
    # What the fast policy saw after the resume, gradient noise scale included, is the same.
    def seen(result):
        return {d["step"]: d["observation"]["grad_noise_scale"] for d in events(result, "decision")}
    assert seen(second) == seen(whole)
    whole_state = load_checkpoint(whole.checkpoint_path)["model"]
    split_state = load_checkpoint(second.checkpoint_path)["model"]
    assert all(torch.equal(whole_state[k], split_state[k]) for k in whole_state)


def test_sigterm_checkpoints_returns_preempted_and_resumes_exactly(tmp_path):
    examples = text_examples()
    whole = train(tiny_config(), examples, None, tmp_path / "whole")
    policy = ScriptedPolicy({}, sigterm_at=12)
    previous_handler = signal.getsignal(signal.SIGTERM)
    cut = train(tiny_config(), examples, None, tmp_path / "cut", fast_policy=policy)
    assert signal.getsignal(signal.SIGTERM) is previous_handler  # handler restored
    assert cut.status == "preempted" and cut.steps == 12
    assert load_checkpoint(cut.checkpoint_path)["step"] == 12
    (preemption,) = events(cut, "preemption")
    assert preemption["signal_name"] == "SIGTERM" and 0 < preemption["notice_s"] <= 120
    # The policy was asked with the notice, and its answer recorded.
    assert policy.seen[-1].preemption_notice_s is not None
    assert events(cut, "decision")[-1]["observation"]["preemption_notice_s"] is not None
    assert events(cut, "checkpoint")[-1]["reason"] == "preemption"
    resumed = train(tiny_config(), examples, None, tmp_path / "cut",
                    resume_from=cut.checkpoint_path)
    assert step_losses(resumed) == step_losses(whole)


def test_policy_changes_to_batch_and_rate_are_applied_and_recorded(tmp_path):
    examples = text_examples()
    policy = ScriptedPolicy({4: {"micro_batch_size": 4, "grad_accum_steps": 3}})
    result = train(tiny_config(max_steps=12), examples, None, tmp_path, fast_policy=policy)
    steps = events(result, "step")
    assert [(e["micro_batch_size"], e["grad_accum_steps"]) for e in steps[:4]] == [(8, 2)] * 4
    assert {(e["micro_batch_size"], e["grad_accum_steps"]) for e in steps[4:]} == {(4, 3)}
    assert result.samples_seen == 4 * 16 + 8 * 12
    decisions = events(result, "decision")
    assert [d["step"] for d in decisions] == [4, 8, 12]
    assert decisions[0]["policy"] == "scripted" and decisions[0]["layer"] == "fast"
    assert decisions[0]["action"]["micro_batch_size"] == 4
    assert decisions[0]["reason"] == "scripted at step 4" and decisions[0]["numbers"] == {"step": 4}
    assert policy.seen[1].micro_batch_size == 4 and policy.seen[1].grad_accum_steps == 3

    halved = ScriptedPolicy({4: {"learning_rate": get_lr(3, tiny_config(max_steps=12)) / 2}})
    result = train(tiny_config(max_steps=12), examples, None, tmp_path / "lr", fast_policy=halved)
    rates = [e["learning_rate"] for e in events(result, "step")]
    config = tiny_config(max_steps=12)
    assert rates[3] == pytest.approx(get_lr(3, config))
    assert rates[6] == pytest.approx(get_lr(6, config) / 2)  # the schedule continues, halved


def test_checkpoint_now_writes_a_checkpoint_at_that_step(tmp_path):
    examples = text_examples()
    policy = ScriptedPolicy({8: {"preemption_response": PreemptionResponse.CHECKPOINT_NOW}})
    result = train(tiny_config(max_steps=12), examples, None, tmp_path, fast_policy=policy)
    saved = {e["step"]: e["reason"] for e in events(result, "checkpoint")}
    assert saved == {8: "fast_policy", 12: "final"}
    assert load_checkpoint(tmp_path / "checkpoints" / "step-0000008.pt")["step"] == 8
    # The next observation knows when the last checkpoint was and what it cost.
    assert policy.seen[-1].checkpoint_cost_s > 0
    assert math.isnan(policy.seen[0].checkpoint_cost_s)


def test_resume_with_another_model_config_or_data_is_refused(tmp_path):
    examples = text_examples()
    first = train(tiny_config(max_steps=4), examples, None, tmp_path)
    bigger = dataclasses.replace(TINY_GPT, n_layer=2)
    with pytest.raises(CheckpointMismatchError, match="start fresh"):
        train(tiny_config(max_steps=8, model=bigger), examples, None, tmp_path,
              resume_from=first.checkpoint_path)
    other_data = dataclasses.replace(examples, fingerprint="c" * 64)
    with pytest.raises(ValueError, match="same shards or start fresh"):
        train(tiny_config(max_steps=8), other_data, None, tmp_path,
              resume_from=first.checkpoint_path)


def test_a_bad_policy_action_fails_the_run_and_is_recorded(tmp_path):
    examples = text_examples()
    policy = ScriptedPolicy({4: {"micro_batch_size": 0}})
    with pytest.raises(ValueError, match="fast policy 'scripted'.*micro_batch_size=0"):
        train(tiny_config(max_steps=8), examples, None, tmp_path, fast_policy=policy)
    ends = [e for e in read_run_events(tmp_path / "telemetry" / "tiny") if e["type"] == "run_end"]
    assert ends[-1]["status"] == "failed" and "micro_batch_size" in ends[-1]["error"]


@pytest.mark.parametrize(
    "changes, message",
    [({"max_steps": 0}, "max_steps"), ({"min_learning_rate": 1.0}, "min_learning_rate"),
     ({"run_id": "a/b"}, "path separators")],
)
def test_bad_config_is_refused(tmp_path, changes, message):
    with pytest.raises(ValueError, match=message):
        train(tiny_config(**changes), text_examples(), None, tmp_path)


def test_progress_bar_runs(tmp_path, capsys):
    result = train(tiny_config(max_steps=3), text_examples(), None, tmp_path, progress=True)
    assert result.status == "completed"
    assert "3/3" in capsys.readouterr().err


def test_background_checkpoints_resume_exactly_and_are_announced_once_durable(tmp_path, monkeypatch):
    """CheckFreq: interval checkpoints are snapshotted, then written while training goes on.

    A background write waits until training has run two more steps: a snapshot that shared
    memory with the live model or optimizer would save a later state, and the resume below
    would not reproduce the uninterrupted losses."""
    from training import _loop_persist
    from training import _loop_run as loop_run

    real_save, real_step = _loop_persist.save_checkpoint, loop_run.train_step
    stepped = threading.Condition()
    trained = [0]  # steps trained so far (the split run)
    during: list[int] = []  # per background write: the steps trained while it was held
    held_ms: list[float] = []  # per background write: how long it was held

    def counted_step(**kwargs):
        outcome = real_step(**kwargs)
        with stepped:
            trained[0] += 1
            stepped.notify_all()
        return outcome

    def slow_save(path, state):
        if threading.current_thread() is not threading.main_thread():
            began, held = trained[0], time.perf_counter()
            with stepped:  # the timeout only bounds a hang (the training thread stuck)
                stepped.wait_for(lambda: trained[0] >= began + 2, timeout=120)
                during.append(trained[0] - began)
            held_ms.append((time.perf_counter() - held) * 1000.0)
        return real_save(path, state)

    examples = text_examples()
    whole = train(tiny_config(), examples, None, tmp_path / "whole")
    monkeypatch.setattr(_loop_persist, "save_checkpoint", slow_save)
    monkeypatch.setattr(loop_run, "train_step", counted_step)
    announced = []

    def on_checkpoint(info):
        announced.append((info.step, info.reason, info.path.is_file(),
                          info.manifest_path.is_file(), threading.current_thread().name))

    config = tiny_config(checkpoint_every_steps=4, async_checkpoints=True)
    result = train(config, examples, None, tmp_path / "split", on_checkpoint=on_checkpoint)
    assert [a[:4] for a in announced] == [(s, "interval", True, True) for s in range(4, 24, 4)] + [
        (24, "final", True, True)]
    assert all(a[4] != "MainThread" for a in announced[:-1]) and announced[-1][4] == "MainThread"
    saved = events(result, "checkpoint")
    assert [e["step"] for e in saved] == [4, 8, 12, 16, 20, 24]
    assert [e["asynchronous"] for e in saved] == [True] * 5 + [False]
    assert len(during) == 5 and min(during) >= 2, during  # training went on during each write
    first = saved[0]
    # The persist time covers the whole write, the held part too; the loop was blocked only
    # for the snapshot.
    assert first["persist_ms"] >= held_ms[0] and first["save_ms"] < first["persist_ms"]
    assert first["snapshot_ms"] <= first["save_ms"]
    monkeypatch.setattr(_loop_persist, "save_checkpoint", real_save)
    resumed = train(config, examples, None, tmp_path / "split",
                    resume_from=tmp_path / "split" / "checkpoints" / "step-0000008.pt")
    losses = [(e["step"], e["train_loss"]) for e in events(resumed, "step")]
    whole_losses = step_losses(whole)
    assert all(loss == whole_losses[step] for step, loss in losses)  # bitwise, replays included
    assert resumed.final_eval_loss == whole.final_eval_loss
