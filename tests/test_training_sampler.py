"""CurriculumSampler: epochs, weights, the anneal phase, exact state round trip, bad curricula."""

from __future__ import annotations

import numpy as np
import pytest

from training.data_types import Curriculum, ExampleSet
from training.sampler import CurriculumSampler, anneal_start_step


def _examples(n: int = 40) -> ExampleSet:
    is_eval = np.zeros(n, dtype=bool)
    is_eval[::5] = True
    return ExampleSet(
        partition="tiny", kind="text", example_ids=np.arange(n, dtype=np.int64) * 10 + 7,
        is_eval=is_eval, inputs=np.zeros((n, 5), dtype=np.int64), labels=None, vocab=("a",),
        shard_index=np.zeros(n, dtype=np.int32), fingerprint="d" * 64,
    )


def _curriculum(examples: ExampleSet, keep_every: int = 2, anneal_fraction: float = 0.25):
    train_ids = examples.example_ids[examples.train_positions]
    kept = train_ids[::keep_every]
    weights = np.linspace(1.0, 3.0, len(kept))
    return Curriculum(
        partition=examples.partition, version="v1", example_ids=kept, weights=weights,
        pruning_rate=0.5, data_fingerprint=examples.fingerprint, scores_step=None,
        anneal_fraction=anneal_fraction,
    )


def test_each_epoch_visits_every_kept_example_once_with_its_weight():
    examples = _examples()
    curriculum = _curriculum(examples)
    sampler = CurriculumSampler(examples, curriculum, seed=0, max_steps=100)
    kept_positions = examples.positions_of(curriculum.example_ids)
    weight_of = dict(zip(kept_positions.tolist(), curriculum.weights.tolist(), strict=True))
    drawn, weights = [], []
    for _ in range(4):  # 16 kept examples in batches of 4 = one epoch
        positions, batch_weights = sampler.next_batch(4, step=0)
        drawn.extend(positions.tolist())
        weights.extend(batch_weights.tolist())
    assert sorted(drawn) == sorted(kept_positions.tolist())
    assert weights == [weight_of[p] for p in drawn]
    assert sampler.epoch == 0
    sampler.next_batch(4, step=1)
    assert sampler.epoch == 1


def test_a_batch_spans_the_epoch_boundary():
    examples = _examples()
    sampler = CurriculumSampler(examples, _curriculum(examples), seed=0, max_steps=100)
    positions, _ = sampler.next_batch(10, step=0)
    positions_2, _ = sampler.next_batch(10, step=0)  # 6 from epoch 0, 4 from epoch 1
    assert len(positions_2) == 10 and sampler.epoch == 1
    assert len(set(positions.tolist() + positions_2[:6].tolist())) == 16


def test_anneal_phase_uses_all_train_examples_at_weight_one():
    examples = _examples()
    curriculum = _curriculum(examples, anneal_fraction=0.25)
    assert anneal_start_step(100, 0.25) == 75
    sampler = CurriculumSampler(examples, curriculum, seed=0, max_steps=100)
    positions, weights = sampler.next_batch(32, step=75)
    assert sampler.phase == "anneal"
    assert sorted(positions.tolist()) == sorted(examples.train_positions.tolist())
    assert np.all(weights == 1.0)
    assert not examples.is_eval[positions].any()


def test_state_round_trip_draws_the_same_batches():
    examples = _examples()
    curriculum = _curriculum(examples)
    sampler = CurriculumSampler(examples, curriculum, seed=5, max_steps=20)
    for step in range(7):
        sampler.next_batch(3, step)
    state = sampler.state_dict()
    expected = [sampler.next_batch(3, step) for step in range(7, 20)]
    fresh = CurriculumSampler(examples, curriculum, seed=999, max_steps=20)
    fresh.load_state_dict(state)
    got = [fresh.next_batch(3, step) for step in range(7, 20)]
    for (want_pos, want_w), (got_pos, got_w) in zip(expected, got, strict=True):
        assert np.array_equal(want_pos, got_pos) and np.array_equal(want_w, got_w)


def test_resume_under_a_new_curriculum_draws_from_the_new_pool():
    examples = _examples()
    old = _curriculum(examples, keep_every=2)
    sampler = CurriculumSampler(examples, old, seed=1, max_steps=100)
    sampler.next_batch(3, 0)
    new = _curriculum(examples, keep_every=4)
    new = Curriculum(**{**new.__dict__, "version": "v2"})
    resumed = CurriculumSampler(examples, new, seed=1, max_steps=100)
    resumed.load_state_dict(sampler.state_dict())
    positions, _ = resumed.next_batch(8, 1)
    assert set(positions.tolist()) == set(examples.positions_of(new.example_ids).tolist())


@pytest.mark.parametrize(
    "change, message",
    [
        ({"data_fingerprint": "e" * 64}, "re-materialize the curriculum"),
        ({"partition": "other"}, "partition"),
        ({"example_ids": np.array([], dtype=np.int64), "weights": np.array([])}, "no examples"),
        ({"weights": np.zeros(16)}, "non-positive"),
        ({"example_ids": np.array([7], dtype=np.int64), "weights": np.ones(1)}, "held-out"),
    ],
)
def test_bad_curricula_are_refused(change, message):
    examples = _examples()
    bad = Curriculum(**{**_curriculum(examples).__dict__, **change})
    with pytest.raises(ValueError, match=message):
        CurriculumSampler(examples, bad, seed=0, max_steps=10)
