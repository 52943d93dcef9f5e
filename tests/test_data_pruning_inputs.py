"""Bad input to dynamic pruning: rates outside [0, 1), NaN scores, scores of other data or of
another model, a bad control file, curricula or draws that would drop a whole class or shard."""

from __future__ import annotations

import json

import numpy as np
import pytest

from tests.test_data_pruning_draw import FINGERPRINT, synthetic_examples
from training.consumption import read_consumption
from training.data_types import Curriculum
from training.dynamic_pruning import (
    DynamicPruningConfig,
    check_initial_scores,
    draw_epoch,
    tag_scores,
    write_pruning_control,
)
from training.sampler import CurriculumSampler, DynamicPruningSampler
from training.scoring import ScoreTable

OTHER_MODEL = "0" * 64


def scores_for(examples, *, step=None, scorer="bigram-add-one-proxy", fingerprint=None):
    loss = np.linspace(0.5, 3.0, len(examples.example_ids))
    return ScoreTable(partition=examples.partition,
                      data_fingerprint=fingerprint or examples.fingerprint,
                      example_ids=examples.example_ids.copy(),
                      shard_index=examples.shard_index.copy(), loss=loss, el2n=None, step=step,
                      scorer=scorer)


def sampler_for(examples, curriculum=None, **config):
    return DynamicPruningSampler(examples, curriculum, config=DynamicPruningConfig(**config),
                                 seed=0, max_steps=100, samples_per_step=4,
                                 model_fingerprint=FINGERPRINT)


@pytest.mark.parametrize("rate", [1.0, 1.5, -0.1, float("nan"), True, "0.3x"])
def test_a_rate_outside_zero_one_is_refused_everywhere(tmp_path, rate):
    with pytest.raises(ValueError, match=r"outside \[0, 1\)"):
        DynamicPruningConfig(pruning_rate=rate)
    sampler = sampler_for(synthetic_examples())
    with pytest.raises(ValueError, match=r"outside \[0, 1\)"):
        sampler.set_pruning_rate(rate)
    assert sampler.rate == 0.5
    with pytest.raises(ValueError, match=r"outside \[0, 1\)"):
        write_pruning_control(tmp_path / "control.json", pruning_rate=rate)
    assert not (tmp_path / "control.json").exists()


def test_a_bad_control_file_is_refused_recorded_and_changes_nothing(tmp_path):
    examples = synthetic_examples()
    control = tmp_path / "control.json"
    control.write_text(json.dumps({"format": "trainwise.pruning_control/1", "pruning_rate": 1.5}))
    record = tmp_path / "consumption.jsonl"
    sampler = DynamicPruningSampler(
        examples, None, config=DynamicPruningConfig(control_path=control), seed=0, max_steps=100,
        samples_per_step=4, model_fingerprint=FINGERPRINT, consumption_path=record)
    sampler.next_batch(4, 0)
    sampler.on_fast_tick(1)
    sampler.on_fast_tick(2)  # unchanged file: not read again, not warned twice
    assert sampler.rate == 0.5
    sampler.close()
    warnings = [r for r in read_consumption(record) if r["type"] == "warning"]
    assert len(warnings) == 1 and "control file refused" in warnings[0]["message"]
    assert "outside [0, 1)" in warnings[0]["message"]


def test_nan_scores_are_refused():
    examples = synthetic_examples()
    table = scores_for(examples)
    table.loss[3] = np.nan  # ScoreTable refuses NaN when built; arrays can change afterwards
    with pytest.raises(ValueError, match="NaN or infinite"):
        check_initial_scores(table, examples, model_fingerprint=FINGERPRINT, run_step=0)
    with pytest.raises(ValueError, match="NaN or infinite"):
        draw_epoch(method="infobatch", pool_scores=np.array([1.0, np.nan]), rate=0.5,
                   rng=np.random.default_rng(0), anneal=False)
    # A diverged model's NaN losses reach the table: the next epoch draw refuses them.
    sampler = sampler_for(examples)
    positions, _ = sampler.next_batch(90, 0)
    sampler.observe_losses(positions, np.full(len(positions), np.nan))
    with pytest.raises(ValueError, match="NaN or infinite"):
        sampler.next_batch(4, 1)


def test_scores_of_other_shards_or_another_model_are_refused():
    examples = synthetic_examples()
    with pytest.raises(ValueError, match="other|re-materialize"):
        check_initial_scores(scores_for(examples, fingerprint="e" * 64), examples,
                             model_fingerprint=FINGERPRINT, run_step=0)
    untagged = scores_for(examples, step=0, scorer="model@step=0")
    with pytest.raises(ValueError, match="not named"):
        check_initial_scores(untagged, examples, model_fingerprint=FINGERPRINT, run_step=0)
    other = tag_scores(untagged, OTHER_MODEL)
    with pytest.raises(ValueError, match="another model"):
        check_initial_scores(other, examples, model_fingerprint=FINGERPRINT, run_step=0)
    later = tag_scores(scores_for(examples, step=500, scorer="model@step=500"), FINGERPRINT)
    with pytest.raises(ValueError, match="another run"):
        check_initial_scores(later, examples, model_fingerprint=FINGERPRINT, run_step=10)
    own = tag_scores(untagged, FINGERPRINT)
    train_scores = check_initial_scores(own, examples, model_fingerprint=FINGERPRINT, run_step=0)
    assert len(train_scores) == len(examples.train_positions)
    with pytest.raises(ValueError, match="another model"):
        sampler_for(examples, initial_scores=other)


def test_a_sampler_state_scored_by_another_model_is_refused():
    examples = synthetic_examples()
    state = sampler_for(examples).state_dict()
    state["model_fingerprint"] = OTHER_MODEL
    with pytest.raises(ValueError, match="another model"):
        sampler_for(examples).load_state_dict(state)


def _curriculum_without_class(examples, label: int) -> Curriculum:
    train = examples.train_positions
    kept = train[examples.labels[train] != label]
    return Curriculum(partition=examples.partition, version="drop" + str(label),
                      example_ids=examples.example_ids[kept], weights=np.ones(len(kept)),
                      pruning_rate=0.1, data_fingerprint=examples.fingerprint, scores_step=None)


def test_a_curriculum_that_drops_a_class_or_shard_is_refused():
    images = synthetic_examples(kind="image")
    curriculum = _curriculum_without_class(images, 3)
    with pytest.raises(ValueError, match="keeps no train example of class 3"):
        CurriculumSampler(images, curriculum, seed=0, max_steps=10)
    with pytest.raises(ValueError, match="keeps no train example of class 3"):
        sampler_for(images, curriculum)
    sampler = sampler_for(images)
    with pytest.raises(ValueError, match="class 3"):
        sampler.set_curriculum(curriculum)
    text = synthetic_examples(n_shards=2)
    train = text.train_positions
    kept = train[text.shard_index[train] == 0]
    no_shard_1 = Curriculum(partition=text.partition, version="noshard1",
                            example_ids=text.example_ids[kept], weights=np.ones(len(kept)),
                            pruning_rate=0.1, data_fingerprint=text.fingerprint, scores_step=None)
    with pytest.raises(ValueError, match="keeps no train example of shard 1"):
        CurriculumSampler(text, no_shard_1, seed=0, max_steps=10)


def test_a_draw_that_would_drop_a_class_is_clamped_and_recorded(tmp_path):
    images = synthetic_examples(n=300, kind="image")
    # Class 0 is easy (all below the mean) and small enough that rate 0.99 empties it.
    labels = images.labels.copy()
    labels[labels == 0] = 1
    labels[images.train_positions[:2]] = 0
    images = type(images)(**{**images.__dict__, "labels": labels})
    record = tmp_path / "consumption.jsonl"
    sampler = DynamicPruningSampler(images, None, config=DynamicPruningConfig(pruning_rate=0.99),
                                    seed=0, max_steps=1000, samples_per_step=10,
                                    model_fingerprint=FINGERPRINT, consumption_path=record)
    positions, _ = sampler.next_batch(len(images.train_positions), 0)  # epoch 0: full data
    losses = np.where(labels[positions] == 0, 0.01, 1.0)
    losses[:: 7] = 0.02  # other easy examples: below the mean as well
    sampler.observe_losses(positions, losses)
    positions, _weights = sampler.next_batch(50, 1)  # epoch 1 is drawn
    sampler.close()
    records = read_consumption(record)
    (warning,) = [r for r in records if r["type"] == "warning"]
    assert "coverage clamp" in warning["message"] and "class 0" in warning["message"]
    epoch_1 = next(r for r in records if r["type"] == "epoch" and r["epoch"] == 1)
    skipped = set(epoch_1["skipped"][0]["ids"])
    class_0_ids = set(images.example_ids[images.train_positions[:2]].tolist())
    assert not skipped & class_0_ids and epoch_1["skipped_count"] > 0
