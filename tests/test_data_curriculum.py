"""curriculum: InfoBatch-style pruning prunes only below-mean examples, is unbiased in expectation,
never drops a whole class or shard, refuses bad rates and stale scores, and is published as a
versioned manifest with an atomic LATEST pointer."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

import training._data_io as data_io
import training.curriculum as curriculum_module
from training.curriculum import (
    build_curriculum,
    load_curriculum,
    summarize_curriculum,
    write_curriculum,
)
from training.data_types import ExampleSet
from training.scoring import ScoreTable, difficulty_scores
from training.shards import build_shards, load_shards
from trainwise import settings

DATA_DIR = settings.data_dir()


def image_set(labels: np.ndarray, shards: np.ndarray | None = None) -> ExampleSet:
    n = len(labels)
    return ExampleSet(
        partition="synthetic-images", kind="image", example_ids=np.arange(100, 100 + n),
        is_eval=np.arange(n) % 10 == 9, inputs=np.zeros((n, 28, 28), np.uint8),
        labels=labels.astype(np.int64), vocab=None,
        shard_index=(shards if shards is not None else np.arange(n) // 50).astype(np.int32),
        fingerprint="d" * 64,
    )


def table_for(examples: ExampleSet, loss: np.ndarray, step: int | None = None) -> ScoreTable:
    return ScoreTable(examples.partition, examples.fingerprint, examples.example_ids.copy(),
                      examples.shard_index.copy(), loss.astype(float), None, step, "test")


@pytest.fixture()
def examples_and_scores():
    rng = np.random.default_rng(0)
    examples = image_set(rng.permutation(np.arange(400) % 10))  # every class in train and eval
    loss = rng.exponential(1.0, size=400)
    return examples, table_for(examples, loss)


# ---- the rule ---------------------------------------------------------------------------------

def test_rate_zero_keeps_every_train_example_with_weight_one(examples_and_scores):
    examples, scores = examples_and_scores
    c = build_curriculum(examples, scores, 0.0)
    np.testing.assert_array_equal(c.example_ids, examples.example_ids[examples.train_positions])
    np.testing.assert_array_equal(c.weights, np.ones(len(c.example_ids)))
    assert c.pruning_rate == 0.0 and c.scores_step is None and c.anneal_fraction == 0.125


def test_only_below_mean_examples_are_pruned_and_rescaled(examples_and_scores):
    examples, scores = examples_and_scores
    rate = 0.4
    c = build_curriculum(examples, scores, rate, seed=3)
    train = examples.train_positions
    train_ids, train_loss = examples.example_ids[train], scores.loss[train]
    below = train_loss < train_loss.mean()
    kept = np.isin(train_ids, c.example_ids)
    assert kept[~below].all()  # no above-mean example is ever dropped
    n_below, n_dropped = int(below.sum()), int((~kept).sum())
    assert abs(n_dropped - rate * n_below) < 4 * np.sqrt(n_below * rate * (1 - rate))
    weight_of = dict(zip(c.example_ids.tolist(), c.weights.tolist()))
    for example_id, is_below in zip(train_ids[kept], below[kept]):
        assert weight_of[example_id] == pytest.approx(1 / (1 - rate) if is_below else 1.0)
    assert not np.isin(c.example_ids, examples.example_ids[examples.eval_positions]).any()


def test_weights_are_unbiased_over_seeds(examples_and_scores):
    examples, scores = examples_and_scores
    rate, seeds = 0.5, 400
    n_train = len(examples.train_positions)
    per_example = np.zeros(n_train)
    sums = []
    train_ids = examples.example_ids[examples.train_positions]
    for seed in range(seeds):
        c = build_curriculum(examples, scores, rate, seed=seed)
        sums.append(c.weights.sum())
        per_example[np.searchsorted(train_ids, c.example_ids)] += c.weights
    below = scores.loss[examples.train_positions] < scores.loss[examples.train_positions].mean()
    # sum of weights: variance n_below * r / (1 - r) per draw
    standard_error = np.sqrt(below.sum() * rate / (1 - rate) / seeds)
    assert abs(np.mean(sums) - n_train) < 4 * standard_error
    # each example's mean weight is 1 (weight 2 with probability 1/2 for below-mean ones)
    assert np.abs(per_example / seeds - 1).max() < 4 * np.sqrt(1 / seeds)


def test_same_seed_same_version_and_other_seed_other_version(examples_and_scores):
    examples, scores = examples_and_scores
    first = build_curriculum(examples, scores, 0.3, seed=1)
    assert build_curriculum(examples, scores, 0.3, seed=1).version == first.version
    assert build_curriculum(examples, scores, 0.3, seed=2).version != first.version
    assert build_curriculum(examples, scores, 0.31, seed=1).version != first.version
    assert len(first.version) == 12


@pytest.mark.parametrize("rate", [-0.1, 1.0, 1.5, float("nan"), "abc", None, True])
def test_rate_outside_unit_interval_names_the_setting(examples_and_scores, rate):
    examples, scores = examples_and_scores
    with pytest.raises(ValueError, match="TRAINWISE_PRUNING_RATE"):
        build_curriculum(examples, scores, rate)


def test_a_draw_that_drops_a_whole_class_is_refused():
    labels = np.arange(200) % 10
    labels[labels == 7] = 6
    labels[3] = 7  # class 7: a single (train) example
    examples = image_set(labels)
    loss = np.ones(200)
    loss[3] = 0.0  # below the mean: eligible for pruning
    scores = table_for(examples, loss)
    outcomes = []
    for seed in range(20):
        try:
            c = build_curriculum(examples, scores, 0.9, seed=seed)
            assert 100 + 3 in c.example_ids
            outcomes.append("kept")
        except ValueError as exc:
            assert "class 7" in str(exc) and "TRAINWISE_PRUNING_RATE" in str(exc)
            outcomes.append("refused")
    assert "refused" in outcomes and "kept" in outcomes


def test_a_draw_that_drops_a_whole_shard_is_refused():
    shards = np.zeros(60, int)
    shards[40:] = 1
    examples = image_set(np.arange(60) % 10, shards)
    loss = np.ones(60)
    loss[40:] = 0.0  # every example of shard 1 is below the mean
    refusals = []
    for seed in range(10):
        try:
            c = build_curriculum(examples, table_for(examples, loss), 0.99, seed=seed)
            assert (examples.shard_index[examples.positions_of(c.example_ids)] == 1).any()
        except ValueError as exc:
            refusals.append(str(exc))
    assert refusals and all("shard 1" in message for message in refusals)


def test_stale_and_incomplete_scores_are_refused(examples_and_scores):
    examples, scores = examples_and_scores
    stale = ScoreTable(scores.partition, "0" * 64, scores.example_ids, scores.shard_index,
                       scores.loss, None, None, "test")
    with pytest.raises(ValueError, match="re-materialize difficulty_scores"):
        build_curriculum(examples, stale, 0.3)
    partial = ScoreTable(scores.partition, scores.data_fingerprint, scores.example_ids[:-20],
                         scores.shard_index[:-20], scores.loss[:-20], None, None, "test")
    with pytest.raises(ValueError, match="miss .* train examples"):
        build_curriculum(examples, partial, 0.3)


def test_real_mnist_keeps_every_class_at_a_high_rate(tmp_path):
    if not (DATA_DIR / "images" / "mnist").is_dir():
        pytest.skip(f"shared data folder {DATA_DIR} is absent")
    build_shards("mnist", DATA_DIR, tmp_path / "mnist")
    examples = load_shards(tmp_path / "mnist")
    c = build_curriculum(examples, difficulty_scores(examples), 0.9)
    kept_labels = examples.labels[examples.positions_of(c.example_ids)]
    assert set(kept_labels.tolist()) == set(range(10))
    assert len(c.example_ids) < 0.5 * len(examples.train_positions)


# ---- publication ------------------------------------------------------------------------------

def test_write_and_load_versions_with_latest_pointer(tmp_path, examples_and_scores):
    examples, scores = examples_and_scores
    first = build_curriculum(examples, scores, 0.3, seed=0)
    second = build_curriculum(examples, scores, 0.5, seed=0)
    first_json = write_curriculum(first, tmp_path, summary=summarize_curriculum(first, examples,
                                                                                scores))
    write_curriculum(second, tmp_path)
    assert (tmp_path / "LATEST").read_text().strip() == second.version
    assert load_curriculum(tmp_path).version == second.version
    old = load_curriculum(tmp_path, version=first.version)
    np.testing.assert_array_equal(old.example_ids, first.example_ids)
    np.testing.assert_array_equal(old.weights, first.weights)
    assert load_curriculum(first_json).version == first.version
    assert load_curriculum(first_json.with_suffix(".parquet")).version == first.version
    summary = json.loads(first_json.read_text())
    n_train = len(examples.train_positions)
    assert summary["kept"] + summary["pruned"] == n_train
    assert summary["rate"] == 0.3 and summary["data_fingerprint"] == examples.fingerprint
    assert "below-mean" in summary["why"]


def test_crash_before_latest_swap_keeps_previous_latest(tmp_path, examples_and_scores,
                                                        monkeypatch):
    examples, scores = examples_and_scores
    first = build_curriculum(examples, scores, 0.3)
    write_curriculum(first, tmp_path)
    real_write = data_io.atomic_write_bytes

    def crash_on_latest(path, data):
        if Path(path).name == "LATEST":
            raise OSError("simulated crash")
        return real_write(path, data)

    monkeypatch.setattr(curriculum_module, "atomic_write_bytes", crash_on_latest)
    with pytest.raises(OSError):
        write_curriculum(build_curriculum(examples, scores, 0.6), tmp_path)
    assert load_curriculum(tmp_path).version == first.version
    assert not [p for p in tmp_path.iterdir() if ".tmp-" in p.name]


def test_tampered_files_are_refused(tmp_path, examples_and_scores):
    examples, scores = examples_and_scores
    c = build_curriculum(examples, scores, 0.3)
    json_path = write_curriculum(c, tmp_path)
    manifest = json.loads(json_path.read_text())
    manifest["pruning_rate"] = 0.1  # edited by hand: no longer what the content hashes to
    json_path.write_text(json.dumps(manifest))
    with pytest.raises(ValueError, match="does not hash to its version"):
        load_curriculum(tmp_path)
    parquet_path = json_path.with_suffix(".parquet")
    parquet_path.write_bytes(parquet_path.read_bytes()[:-4] + b"XXXX")
    with pytest.raises(ValueError, match=r"curriculum-.*\.parquet.*re-materialize curriculum"):
        load_curriculum(tmp_path)


def test_missing_curriculum_says_materialize(tmp_path):
    with pytest.raises(FileNotFoundError, match="materialize curriculum"):
        load_curriculum(tmp_path)
    with pytest.raises(ValueError, match="hex digits"):
        load_curriculum(tmp_path, version="../../etc")


# ---- the gate ---------------------------------------------------------------------------------

def test_coverage_report_passes_a_good_curriculum(examples_and_scores):
    examples, scores = examples_and_scores
    report = curriculum_module.coverage_report(examples, build_curriculum(examples, scores, 0.3))
    assert report["passed"] and report["failures"] == []
    assert report["classes_covered"] == report["classes_with_train_examples"] == 10
    assert report["kept_share"] >= report["min_kept_share"] > 0.6
    assert None not in report.values()


def test_coverage_report_fails_stale_or_lopsided_curricula(examples_and_scores):
    examples, scores = examples_and_scores
    good = build_curriculum(examples, scores, 0.3)
    other_shards = ExampleSet(**{**examples.__dict__, "fingerprint": "c" * 64})
    report = curriculum_module.coverage_report(other_shards, good)
    assert not report["passed"] and "other shards" in report["reason"]
    # a hand-made curriculum that keeps only class 0 and only a tenth of the data
    keep = examples.train_positions[examples.labels[examples.train_positions] == 0]
    lopsided = type(good)(**{**good.__dict__, "example_ids": examples.example_ids[keep],
                              "weights": np.ones(len(keep))})
    report = curriculum_module.coverage_report(examples, lopsided)
    assert not report["passed"]
    assert any("classes" in f for f in report["failures"])
    assert any("below" in f for f in report["failures"])


# ---- write, audit, publish --------------------------------------------------------------------

def test_a_proposal_leaves_latest_until_promoted(tmp_path, examples_and_scores):
    examples, scores = examples_and_scores
    first = build_curriculum(examples, scores, 0.3)
    write_curriculum(first, tmp_path)
    second = build_curriculum(examples, scores, 0.5)
    curriculum_module.propose_curriculum(second, tmp_path, reason="slow policy", requested_by="s")
    assert load_curriculum(tmp_path).version == first.version  # training still reads the first
    assert curriculum_module.read_candidate(tmp_path)["version"] == second.version
    record = curriculum_module.promote_candidate(tmp_path, second.version, approved_by="gate")
    assert (record["from"], record["to"], record["why"]) == (first.version, second.version,
                                                            "slow policy")
    assert load_curriculum(tmp_path).version == second.version
    assert curriculum_module.read_candidate(tmp_path) is None


def test_a_stale_check_cannot_promote_a_newer_candidate(tmp_path, examples_and_scores):
    examples, scores = examples_and_scores
    checked = build_curriculum(examples, scores, 0.3)
    curriculum_module.propose_curriculum(checked, tmp_path)
    newer = build_curriculum(examples, scores, 0.6)
    curriculum_module.propose_curriculum(newer, tmp_path)
    with pytest.raises(ValueError, match="run curriculum_coverage again"):
        curriculum_module.promote_candidate(tmp_path, checked.version, approved_by="gate")
    assert curriculum_module.current_version(tmp_path) is None


def test_a_rejected_candidate_is_kept_and_recorded(tmp_path, examples_and_scores):
    examples, scores = examples_and_scores
    first = build_curriculum(examples, scores, 0.3)
    write_curriculum(first, tmp_path)
    bad = build_curriculum(examples, scores, 0.5)
    curriculum_module.propose_curriculum(bad, tmp_path)
    curriculum_module.reject_candidate(tmp_path, bad.version, ["keeps no shard 3"])
    assert load_curriculum(tmp_path).version == first.version
    assert load_curriculum(tmp_path, version=bad.version).version == bad.version
    record = curriculum_module.read_history(tmp_path)[-1]
    assert record["event"] == "rejected" and record["current"] == first.version
