"""difficulty_scores: the proxies compute what they claim (checked against a direct computation),
fit on train only, a model's per-example loss is used when given, NaN is refused, and score files
round-trip atomically with checksums."""

from __future__ import annotations

import itertools
import math
from pathlib import Path

import numpy as np
import pytest
import torch

import training._data_io as data_io
from training.data_types import ExampleSet
from training.scoring import ScoreTable, difficulty_scores, read_scores, write_scores
from training.shards import build_shards, load_shards
from trainwise import settings

torch.set_num_threads(1)
DATA_DIR = settings.data_dir()


def text_examples(inputs: np.ndarray, is_eval: np.ndarray, vocab_size: int) -> ExampleSet:
    n = len(inputs)
    return ExampleSet(
        partition="synthetic", kind="text", example_ids=np.arange(n, dtype=np.int64),
        is_eval=is_eval.astype(bool), inputs=inputs.astype(np.int64), labels=None,
        vocab=tuple("abcdefghijklmnopqrstuvwxyz"[:vocab_size]),
        shard_index=(np.arange(n) // 4).astype(np.int32), fingerprint="f" * 64,
    )


def image_examples(n: int = 60, seed: int = 0) -> ExampleSet:
    rng = np.random.default_rng(seed)
    labels = np.arange(n) % 10
    images = rng.integers(0, 40, size=(n, 28, 28)).astype(np.uint8)
    for i, label in enumerate(labels):  # a bright bar whose row says the class
        images[i, 2 * label + 4, 4:24] = 250
    return ExampleSet(
        partition="synthetic-images", kind="image", example_ids=np.arange(n, dtype=np.int64),
        is_eval=np.arange(n) % 10 == 9, inputs=images, labels=labels.astype(np.int64), vocab=None,
        shard_index=(np.arange(n) // 20).astype(np.int32), fingerprint="e" * 64,
    )


def naive_bigram_nll(examples: ExampleSet) -> np.ndarray:
    vocab_size = len(examples.vocab)
    counts = np.zeros((vocab_size, vocab_size))
    for row in examples.inputs[examples.train_positions]:
        for a, b in itertools.pairwise(row):
            counts[a, b] += 1
    prob = (counts + 1) / (counts.sum(axis=1, keepdims=True) + vocab_size)
    return np.array([-np.mean([math.log(prob[a, b]) for a, b in itertools.pairwise(r)])
                     for r in examples.inputs])


@pytest.fixture(scope="module")
def pystdlib_examples(tmp_path_factory):
    out_dir = tmp_path_factory.mktemp("state") / "shards" / "pystdlib"
    build_shards("pystdlib", Path("/nonexistent"), out_dir)
    return load_shards(out_dir)


@pytest.fixture(scope="module")
def mnist_examples(tmp_path_factory):
    if not (DATA_DIR / "images" / "mnist").is_dir():
        pytest.skip(f"shared data folder {DATA_DIR} is absent")
    out_dir = tmp_path_factory.mktemp("state") / "shards" / "mnist"
    build_shards("mnist", DATA_DIR, out_dir)
    return load_shards(out_dir)


# ---- text proxy -------------------------------------------------------------------------------

def test_bigram_proxy_matches_direct_computation():
    rng = np.random.default_rng(1)
    examples = text_examples(rng.integers(0, 5, size=(12, 9)), np.arange(12) >= 10, 5)
    table = difficulty_scores(examples)
    np.testing.assert_allclose(table.loss, naive_bigram_nll(examples), rtol=1e-12)
    assert table.step is None and table.scorer == "bigram-add-one-proxy" and table.el2n is None


def test_bigram_proxy_is_fitted_on_train_only():
    rng = np.random.default_rng(2)
    inputs = rng.integers(0, 4, size=(10, 7))
    is_eval = np.arange(10) >= 8
    base = difficulty_scores(text_examples(inputs, is_eval, 4))
    changed = inputs.copy()
    changed[8:] = 3  # rewrite the eval examples only
    other = difficulty_scores(text_examples(changed, is_eval, 4))
    np.testing.assert_array_equal(base.loss[:8], other.loss[:8])
    assert not np.allclose(base.loss[8:], other.loss[8:])


def test_bigram_proxy_on_real_text(pystdlib_examples):
    table = difficulty_scores(pystdlib_examples)
    vocab_size = len(pystdlib_examples.vocab)
    assert len(table.loss) == len(pystdlib_examples.example_ids)
    # a bigram model beats the uniform model (log V nats) by a wide margin on real code
    assert 1.0 < table.loss.mean() < math.log(vocab_size) - 1.0
    assert np.isfinite(table.loss).all() and table.loss.std() > 0
    np.testing.assert_array_equal(table.shard_index, pystdlib_examples.shard_index)


# ---- image proxy ------------------------------------------------------------------------------

def test_logreg_proxy_is_deterministic_and_has_el2n():
    examples = image_examples()
    first, second = difficulty_scores(examples), difficulty_scores(examples)
    np.testing.assert_array_equal(first.loss, second.loss)
    assert first.scorer == "logreg-proxy" and first.el2n is not None
    assert (first.el2n >= 0).all() and (first.el2n <= math.sqrt(2) + 1e-9).all()
    # the bar makes the synthetic classes learnable: far below the chance loss log(10)
    assert first.loss[examples.train_positions].mean() < 0.5 * math.log(10)


def test_logreg_proxy_on_real_mnist(mnist_examples):
    table = difficulty_scores(mnist_examples)
    eval_loss = table.loss[mnist_examples.eval_positions].mean()
    assert 0.1 < eval_loss < 0.6  # logistic regression on MNIST: ~0.34 nats, ~91% accuracy
    spearman = np.corrcoef(np.argsort(np.argsort(table.loss)),
                           np.argsort(np.argsort(table.el2n)))[0, 1]
    assert spearman > 0.8  # loss and EL2N rank examples alike


# ---- scoring with a model ---------------------------------------------------------------------

class ZeroLogits(torch.nn.Module):
    """Uniform predictions: every example's loss is exactly log(number of classes)."""

    def __init__(self, n_out: int, image: bool, as_tuple: bool = False):
        super().__init__()
        self.bias = torch.nn.Parameter(torch.zeros(n_out))
        self.image, self.as_tuple = image, as_tuple

    def forward(self, x):
        shape = (x.shape[0], len(self.bias)) if self.image else (*x.shape, len(self.bias))
        logits = torch.zeros(shape) + self.bias
        return (logits, None) if self.as_tuple else logits


class BigramTorch(torch.nn.Module):
    def __init__(self, vocab_size: int):
        super().__init__()
        self.table = torch.nn.Embedding(vocab_size, vocab_size)

    def forward(self, x):
        return self.table(x)


def test_text_model_loss_is_per_example_mean_cross_entropy():
    torch.manual_seed(0)
    examples = text_examples(np.random.default_rng(3).integers(0, 6, size=(9, 11)),
                             np.arange(9) >= 8, 6)
    model = BigramTorch(6)
    model.train()
    table = difficulty_scores(examples, model, step=40, batch_size=4)
    x = torch.from_numpy(examples.inputs)
    expected = torch.nn.functional.cross_entropy(
        model(x[:, :-1]).reshape(-1, 6), x[:, 1:].reshape(-1), reduction="none"
    ).view(9, -1).mean(1)
    np.testing.assert_allclose(table.loss, expected.detach().numpy(), rtol=1e-5)
    assert table.step == 40 and table.scorer == "model@step=40"
    assert model.training  # the caller's mode is restored


def test_uniform_models_give_log_classes_and_known_el2n():
    text = text_examples(np.zeros((4, 5), dtype=np.int64), np.arange(4) == 3, 7)
    np.testing.assert_allclose(difficulty_scores(text, ZeroLogits(7, False, as_tuple=True),
                                                 step=1).loss, math.log(7))
    table = difficulty_scores(image_examples(), ZeroLogits(10, True), step=2)
    np.testing.assert_allclose(table.loss, math.log(10))
    np.testing.assert_allclose(table.el2n, math.sqrt(0.9 ** 2 + 9 * 0.1 ** 2))


def test_model_from_another_config_is_refused():
    text = text_examples(np.zeros((4, 5), dtype=np.int64), np.arange(4) == 3, 7)
    with pytest.raises(ValueError, match="another model config"):
        difficulty_scores(text, ZeroLogits(8, False), step=1)


def test_model_needs_its_step():
    with pytest.raises(ValueError, match="step="):
        difficulty_scores(image_examples(), ZeroLogits(10, True))


def test_nan_scores_are_refused():
    class Diverged(ZeroLogits):
        def forward(self, x):
            return super().forward(x) * float("nan")

    with pytest.raises(ValueError, match="NaN or infinite.*diverged"):
        difficulty_scores(image_examples(), Diverged(10, True), step=3)
    with pytest.raises(ValueError, match="NaN"):
        ScoreTable("p", "f", np.arange(2), np.zeros(2, np.int32), np.array([0.1, np.nan]),
                   None, None, "proxy")


# ---- storage ----------------------------------------------------------------------------------

def test_scores_round_trip_per_shard(tmp_path):
    examples = image_examples()
    table = difficulty_scores(examples)
    manifest = write_scores(table, tmp_path / "scores")
    assert [e["file"] for e in manifest["files"]] == [f"scores-{i:05d}.parquet" for i in range(3)]
    back = read_scores(tmp_path / "scores")
    for field in ("example_ids", "shard_index", "loss", "el2n"):
        np.testing.assert_array_equal(getattr(back, field), getattr(table, field))
    assert (back.step, back.scorer, back.data_fingerprint) == (None, "logreg-proxy", "e" * 64)
    assert write_scores(table, tmp_path / "scores")["fingerprint"] == manifest["fingerprint"]


def test_corrupt_score_file_is_named(tmp_path):
    manifest = write_scores(difficulty_scores(image_examples()), tmp_path / "scores")
    victim = tmp_path / "scores" / manifest["folder"] / "scores-00002.parquet"
    victim.write_bytes(victim.read_bytes()[:-9] + b"corrupted")
    with pytest.raises(ValueError, match=r"scores-00002\.parquet.*re-materialize difficulty_scores"):
        read_scores(tmp_path / "scores")


def test_failed_score_write_keeps_previous_scores(tmp_path, monkeypatch):
    examples = image_examples()
    first = difficulty_scores(examples)
    write_scores(first, tmp_path / "scores")

    def crash(*args, **kwargs):
        raise OSError("simulated crash")

    monkeypatch.setattr(data_io, "atomic_write_json", crash)
    with pytest.raises(OSError):
        write_scores(difficulty_scores(examples, ZeroLogits(10, True), step=5), tmp_path / "scores")
    back = read_scores(tmp_path / "scores")
    assert back.step is None
    np.testing.assert_array_equal(back.loss, first.loss)
