"""Pruning from epoch 0 on reference-model scores (issue 12, item 3): with initial scores from
`difficulty_scores`, the first epoch already leaves out below-mean examples, the kept ones are
weighted so that every example's expected weight is 1, and the last epochs anneal to full data."""

from __future__ import annotations

import numpy as np

from tests.test_data_pruning_draw import FINGERPRINT, synthetic_examples
from training.dynamic_pruning import DynamicPruningConfig
from training.sampler import DynamicPruningSampler
from training.scoring import ScoreTable


def reference_scores(examples) -> ScoreTable:
    """A reference model's per-example loss (the shape difficulty_scores writes: step None)."""
    loss = np.random.default_rng(3).exponential(1.0, len(examples.example_ids))
    return ScoreTable(partition=examples.partition, data_fingerprint=examples.fingerprint,
                      example_ids=examples.example_ids.copy(),
                      shard_index=examples.shard_index.copy(), loss=loss, el2n=None, step=None,
                      scorer="bigram-add-one-proxy")


def epoch_draws(sampler, n_train, epochs):
    """(positions, weights) of each whole epoch, drawn a batch of n_train at a time."""
    draws = []
    for epoch in range(epochs):
        positions, weights = sampler.next_batch(1, epoch)
        rest = len(sampler._order) - 1
        more_p, more_w = sampler.next_batch(rest, epoch) if rest else (positions[:0], weights[:0])
        draws.append((np.concatenate([positions, more_p]), np.concatenate([weights, more_w])))
    return draws


def test_epoch_zero_is_pruned_unbiased_and_the_end_anneals_to_full_data():
    examples = synthetic_examples(n=200)
    n_train = len(examples.train_positions)
    scores = reference_scores(examples)
    config = DynamicPruningConfig(pruning_rate=0.5, anneal_fraction=0.25, initial_scores=scores,
                                  record_consumption=False)
    sampler = DynamicPruningSampler(examples, None, config=config, seed=0, max_steps=4 * n_train,
                                    samples_per_step=1, model_fingerprint=FINGERPRINT)
    (first, first_w), _, _, (last, last_w) = epoch_draws(sampler, n_train, 4)
    train_scores = scores.loss[examples.train_positions]
    below = train_scores < train_scores.mean()
    n_below, n_pruned = int(below.sum()), int(0.5 * below.sum())
    # Epoch 0 already prunes: a uniform start would have kept everything.
    assert len(first) == n_train - n_pruned
    upweight = n_below / (n_below - n_pruned)
    by_position = dict(zip(first.tolist(), first_w.tolist(), strict=True))
    below_positions = set(examples.train_positions[below].tolist())
    assert all(abs(w - (upweight if p in below_positions else 1.0)) < 1e-12
               for p, w in by_position.items())
    # Unbiased: P(kept) x weight = 1 for the below-mean examples.
    assert abs((n_below - n_pruned) / n_below * upweight - 1.0) < 1e-12
    # The last epoch is the anneal: every train example at weight 1.
    assert sorted(last.tolist()) == sorted(examples.train_positions.tolist())
    assert np.all(last_w == 1.0) and sampler.phase == "anneal"
