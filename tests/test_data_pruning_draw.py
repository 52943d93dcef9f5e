"""The InfoBatch epoch draw: keep probabilities, unbiased weights, the anneal, the random baseline,
the coverage clamp, and the sampler's epochs over a budget."""

from __future__ import annotations

import math

import numpy as np
import pytest

from training.data_types import ExampleSet
from training.dynamic_pruning import DynamicPruningConfig, draw_epoch, infobatch_keep_probabilities
from training.sampler import DynamicPruningSampler

FINGERPRINT = "f" * 64


def skewed_scores(n: int = 200, seed: int = 0) -> np.ndarray:
    """Most examples easy, a few hard: the loss shape InfoBatch prunes."""
    return np.random.default_rng(seed).exponential(1.0, n)


def synthetic_examples(n: int = 100, n_shards: int = 2, kind: str = "text") -> ExampleSet:
    is_eval = np.zeros(n, dtype=bool)
    is_eval[::10] = True
    labels = np.arange(n) % 10 if kind == "image" else None
    inputs = np.zeros((n, 28, 28), np.uint8) if kind == "image" else np.zeros((n, 5), np.int64)
    return ExampleSet(
        partition="synthetic", kind=kind, example_ids=np.arange(n, dtype=np.int64) + 1000,
        is_eval=is_eval, inputs=inputs, labels=labels, vocab=None if kind == "image" else ("a",),
        shard_index=(np.arange(n) * n_shards // n).astype(np.int32), fingerprint="d" * 64,
    )


def test_infobatch_prunes_a_rate_share_of_the_below_mean_examples_and_upweights_the_rest():
    scores = skewed_scores()
    below = scores < scores.mean()
    n_below = int(below.sum())
    draw = draw_epoch(method="infobatch", pool_scores=scores, rate=0.5,
                      rng=np.random.default_rng(1), anneal=False)
    assert len(draw.skipped) == math.floor(0.5 * n_below)
    assert below[draw.skipped].all()  # only well-learned examples are left out
    assert set(np.flatnonzero(~below)) <= set(draw.kept.tolist())  # every hard one is kept
    kept_below = below[draw.kept]
    assert np.allclose(draw.weights[kept_below], n_below / (n_below - len(draw.skipped)))
    assert np.all(draw.weights[~kept_below] == 1.0)
    # Unbiased in total: the kept weights sum to the pool size exactly, every draw.
    assert draw.weights.sum() == pytest.approx(len(scores), rel=1e-12)
    assert draw.reason == "pruned: below-mean loss, rate 0.5"


def test_keep_probability_times_weight_is_one_for_every_example():
    scores = skewed_scores(60, seed=3)
    rate = 0.3
    probabilities = infobatch_keep_probabilities(scores, rate)
    rng = np.random.default_rng(0)
    kept_count = np.zeros(len(scores))
    weighted = np.zeros(len(scores))
    trials = 4000
    for _ in range(trials):
        draw = draw_epoch(method="infobatch", pool_scores=scores, rate=rate, rng=rng, anneal=False)
        kept_count[draw.kept] += 1
        weighted[draw.kept] += draw.weights
    assert np.allclose(kept_count / trials, probabilities, atol=0.03)
    assert np.allclose(weighted / trials, 1.0, atol=0.05)  # E[1{kept} * weight] = 1
    assert set(np.unique(probabilities).round(6)) == {1.0, round(probabilities.min(), 6)}


def test_random_baseline_leaves_out_as_many_examples_uniformly_at_weight_one():
    scores = skewed_scores()
    n_below = int((scores < scores.mean()).sum())
    rng = np.random.default_rng(0)
    hard_skipped = 0
    for _ in range(200):
        draw = draw_epoch(method="random", pool_scores=scores, rate=0.5, rng=rng, anneal=False)
        assert len(draw.skipped) == math.floor(0.5 * n_below)
        assert np.all(draw.weights == 1.0)
        hard_skipped += int((scores[draw.skipped] >= scores.mean()).sum())
    assert hard_skipped > 0  # unlike InfoBatch, hard examples are left out too


def test_anneal_and_rate_zero_keep_everything_at_weight_one():
    scores = skewed_scores()
    for kwargs in ({"rate": 0.5, "anneal": True}, {"rate": 0.0, "anneal": False}):
        draw = draw_epoch(method="infobatch", pool_scores=scores, rng=np.random.default_rng(0),
                          **kwargs)
        assert len(draw.kept) == len(scores) and len(draw.skipped) == 0
        assert np.all(draw.weights == 1.0)
    anneal = draw_epoch(method="infobatch", pool_scores=scores, rate=0.5,
                        rng=np.random.default_rng(0), anneal=True)
    assert anneal.reason == "anneal: full data"


def test_equal_scores_prune_nothing_as_in_the_paper():
    draw = draw_epoch(method="infobatch", pool_scores=np.ones(50), rate=0.9,
                      rng=np.random.default_rng(0), anneal=False)
    assert len(draw.skipped) == 0 and "no example below the mean" in draw.reason


def test_a_draw_that_empties_a_group_is_clamped_with_a_warning():
    scores = np.array([0.1, 0.1, 5.0, 5.0, 5.0, 0.2])
    group = np.array([7, 7, 1, 1, 1, 2])  # groups 7 and 2 are all below the mean
    draw = draw_epoch(method="infobatch", pool_scores=scores, rate=0.99,
                      rng=np.random.default_rng(0), anneal=False, groups=(("class", group),))
    assert set(np.unique(group[draw.kept])) == {1, 2, 7}
    assert draw.warnings and "coverage clamp" in draw.warnings[0]
    clamped = np.isin(group[draw.kept], [g for g in (7, 2) if any(str(g) in w
                                                                   for w in draw.warnings)])
    assert np.all(draw.weights[clamped] == 1.0)  # probability 1, weight 1: still unbiased


def test_sampler_prunes_from_epoch_one_and_anneals_the_last_epoch():
    examples = synthetic_examples()
    n_train = len(examples.train_positions)  # 90
    # Budget: 8 epochs of 90 examples, one example per step (batches never span two epochs).
    sampler = DynamicPruningSampler(examples, None, config=DynamicPruningConfig(pruning_rate=0.5),
                                    seed=0, max_steps=8 * n_train, samples_per_step=1,
                                    model_fingerprint=FINGERPRINT)
    assert sampler.budget_epochs == 8
    rng = np.random.default_rng(0)
    drawn_per_epoch: dict[int, list[int]] = {}
    step = 0
    while sampler.progress_steps(step) < 8 * n_train:
        positions, _ = sampler.next_batch(1, step)
        drawn_per_epoch.setdefault(sampler.epoch, []).extend(positions.tolist())
        sampler.observe_losses(positions, rng.exponential(1.0, len(positions)))
        step += 1
    sizes = {epoch: len(p) for epoch, p in drawn_per_epoch.items()}
    assert all(len(set(p)) == len(p) for p in drawn_per_epoch.values())  # no repeats in an epoch
    assert sizes[0] == n_train  # equal start scores: nothing below the mean
    assert all(sizes[e] < n_train for e in range(1, 7))  # pruned epochs
    assert sizes[7] == n_train and sampler.phase == "anneal"  # last 1/8 of the budget
    assert sorted(sizes) == list(range(8))
    assert step == sum(sizes.values()) < 8 * n_train  # the same 8 epochs in fewer steps
    assert sampler.progress_steps(step) == pytest.approx(8 * n_train)
