"""data_shards: real partitions build, load and verify; builds are atomic and idempotent; bad input
is refused with a message that names the input and the fix, and leaves nothing half-written."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import numpy as np
import pytest

import training._data_io as data_io
from training import shards
from training._data_sources import read_pystdlib_corpus
from training.shards import SOURCES, build_shards, load_shards, read_manifest, validate_partition
from trainwise import settings

DATA_DIR = settings.data_dir()
needs_shared_data = pytest.mark.skipif(
    not (DATA_DIR / "corpora" / "tinyshakespeare.txt").is_file(),
    reason=f"shared data folder {DATA_DIR} is absent (set TRAINWISE_DATA_DIR)",
)
MNIST_FIRST_TEST_LABELS = [7, 2, 1, 0, 4, 1, 4, 9, 5, 9]  # the well-known start of t10k-labels


def decode(vocab: tuple[str, ...], tokens: np.ndarray) -> str:
    return "".join(vocab[int(t)] for t in tokens)


def fake_data_dir(root: Path, text: str | bytes) -> Path:
    """A data folder whose tinyshakespeare.txt holds `text` (for bad-input and crash tests)."""
    corpus = root / "corpora" / "tinyshakespeare.txt"
    corpus.parent.mkdir(parents=True)
    corpus.write_bytes(text.encode("utf-8") if isinstance(text, str) else text)
    return root


def small_corpus(n_chars: int = 20_000, seed: int = 0) -> str:
    rng = np.random.default_rng(seed)
    return "".join(rng.choice(list("abcdefgh ij\n"), size=n_chars))


@pytest.fixture(scope="module")
def pystdlib_build(tmp_path_factory):
    out_dir = tmp_path_factory.mktemp("state") / "shards" / "pystdlib"
    manifest = build_shards("pystdlib", Path("/nonexistent-data-dir"), out_dir)
    return manifest, out_dir


@pytest.fixture(scope="module")
def shakespeare_build(tmp_path_factory):
    if not (DATA_DIR / "corpora" / "tinyshakespeare.txt").is_file():
        pytest.skip(f"shared data folder {DATA_DIR} is absent")
    out_dir = tmp_path_factory.mktemp("state") / "shards" / "tinyshakespeare"
    return build_shards("tinyshakespeare", DATA_DIR, out_dir), out_dir


@pytest.fixture(scope="module")
def mnist_build(tmp_path_factory):
    if not (DATA_DIR / "images" / "mnist").is_dir():
        pytest.skip(f"shared data folder {DATA_DIR} is absent")
    out_dir = tmp_path_factory.mktemp("state") / "shards" / "mnist"
    return build_shards("mnist", DATA_DIR, out_dir), out_dir


# ---- partition names --------------------------------------------------------------------------

@pytest.mark.parametrize("name", ["a/b", "../mnist", "mnist/", "x\\y", "..", "."])
def test_partition_with_path_separator_is_refused(name, tmp_path):
    with pytest.raises(ValueError, match="path separator|plain name"):
        build_shards(name, DATA_DIR, tmp_path / "x")
    assert not (tmp_path / "x").exists()


def test_unknown_partition_lists_valid_ones():
    with pytest.raises(ValueError, match="unknown partition 'imagenet'") as info:
        validate_partition("imagenet")
    for name in SOURCES:
        assert name in str(info.value)


def test_out_dir_must_be_named_after_partition(tmp_path):
    with pytest.raises(ValueError, match="partition's own folder"):
        build_shards("pystdlib", tmp_path, tmp_path / "shards")


@pytest.mark.parametrize("kwargs", [{"block_size": 0}, {"eval_fraction": 0.0},
                                    {"eval_fraction": 1.0}, {"examples_per_shard": 0}])
def test_bad_build_arguments_are_refused(kwargs, tmp_path):
    with pytest.raises(ValueError, match=next(iter(kwargs))):
        build_shards("pystdlib", tmp_path, tmp_path / "pystdlib", **kwargs)
    assert not (tmp_path / "pystdlib").exists()


# ---- the fallback corpus (always runs) ---------------------------------------------------------

def test_pystdlib_builds_loads_and_is_described(pystdlib_build):
    manifest, out_dir = pystdlib_build
    examples = load_shards(out_dir)
    assert examples.partition == "pystdlib" and examples.kind == "text"
    assert examples.inputs.dtype == np.int64 and examples.inputs.shape[1] == 65
    assert examples.labels is None
    assert examples.fingerprint == manifest.fingerprint
    # 1e6 characters in chunks of 65: the tail shorter than a chunk is dropped
    assert len(examples.example_ids) == 1_000_000 // 65
    assert decode(examples.vocab, examples.inputs[0]).startswith("# ---- __future__.py ----\n")
    assert list(examples.vocab) == sorted(examples.vocab)
    np.testing.assert_array_equal(examples.example_ids, np.arange(len(examples.example_ids)))
    # consecutive chunks are consecutive corpus text (non-overlapping)
    text, _ = read_pystdlib_corpus()
    assert decode(examples.vocab, examples.inputs[:3].ravel()) == text[: 3 * 65]
    assert decode(examples.vocab, examples.inputs[-1]) == text[(len(examples.inputs) - 1) * 65:][:65]


def test_text_eval_split_is_the_contiguous_tail(pystdlib_build):
    manifest, out_dir = pystdlib_build
    examples = load_shards(out_dir)
    n = len(examples.example_ids)
    n_eval = int(examples.is_eval.sum())
    assert n_eval == n // 10 == manifest.n_eval
    assert examples.is_eval[n - n_eval:].all() and not examples.is_eval[: n - n_eval].any()


def test_manifest_records_per_shard_rows_bytes_tokens_checksums(pystdlib_build):
    manifest, out_dir = pystdlib_build
    raw = json.loads((out_dir / "manifest.json").read_text())
    assert sum(s["rows"] for s in manifest.shards) == manifest.n_examples
    for entry in manifest.shards:
        path = out_dir / raw["folder"] / entry["file"]
        assert entry["bytes"] == path.stat().st_size
        assert entry["sha256"] == data_io.sha256_file(path)
        assert entry["tokens"] == entry["rows"] * 65
    assert [s["file"] for s in manifest.shards] == [
        f"shard-{i:05d}.parquet" for i in range(len(manifest.shards))]
    assert raw["vocab"] == list(manifest.vocab) and raw["block_size"] == 64
    assert "contiguous last" in raw["eval_rule"]
    summary = manifest.summary()
    assert summary["rows"] == manifest.n_examples and summary["tokens"] > 0


def test_rebuild_is_idempotent(pystdlib_build, tmp_path):
    manifest, out_dir = pystdlib_build
    before = (out_dir / "manifest.json").read_bytes()
    again = build_shards("pystdlib", tmp_path, out_dir)
    assert again.fingerprint == manifest.fingerprint
    assert (out_dir / "manifest.json").read_bytes() == before
    elsewhere = build_shards("pystdlib", tmp_path, tmp_path / "other" / "pystdlib")
    assert [s["sha256"] for s in elsewhere.shards] == [s["sha256"] for s in manifest.shards]


def test_corrupt_shard_is_named_with_the_fix(tmp_path):
    out_dir = tmp_path / "shards" / "tinyshakespeare"
    build_shards("tinyshakespeare", fake_data_dir(tmp_path / "data", small_corpus()), out_dir,
                 examples_per_shard=100)
    folder = json.loads((out_dir / "manifest.json").read_text())["folder"]
    victim = out_dir / folder / "shard-00001.parquet"
    data = bytearray(victim.read_bytes())
    data[len(data) // 2] ^= 0xFF
    victim.write_bytes(bytes(data))
    with pytest.raises(ValueError, match=r"shard-00001\.parquet.*re-materialize data_shards"):
        load_shards(out_dir)


def test_missing_manifest_says_materialize(tmp_path):
    with pytest.raises(FileNotFoundError, match="materialize data_shards"):
        load_shards(tmp_path / "pystdlib")


# ---- atomicity --------------------------------------------------------------------------------

def test_crash_mid_build_leaves_previous_shards_readable(tmp_path, monkeypatch):
    data_dir = fake_data_dir(tmp_path / "data", small_corpus())
    out_dir = tmp_path / "shards" / "tinyshakespeare"
    good = build_shards("tinyshakespeare", data_dir, out_dir, examples_per_shard=100)
    real_write = shards._write_shard
    calls = []

    def crash_on_third_shard(*args, **kwargs):
        calls.append(1)
        if len(calls) == 3:
            raise OSError("simulated crash: disk full")
        return real_write(*args, **kwargs)

    monkeypatch.setattr(shards, "_write_shard", crash_on_third_shard)
    with pytest.raises(OSError, match="simulated crash"):
        build_shards("tinyshakespeare", data_dir, out_dir, block_size=32, examples_per_shard=100)
    assert len(calls) == 3
    loaded = load_shards(out_dir)
    assert loaded.fingerprint == good.fingerprint and loaded.inputs.shape[1] == 65
    assert not [p for p in out_dir.iterdir() if p.name.startswith(".staging-")]


def test_crash_at_manifest_swap_leaves_previous_shards_readable(tmp_path, monkeypatch):
    data_dir = fake_data_dir(tmp_path / "data", small_corpus())
    out_dir = tmp_path / "shards" / "tinyshakespeare"
    good = build_shards("tinyshakespeare", data_dir, out_dir)

    def crash(*args, **kwargs):
        raise OSError("simulated crash before the manifest swap")

    monkeypatch.setattr(data_io, "atomic_write_json", crash)
    with pytest.raises(OSError, match="simulated crash"):
        build_shards("tinyshakespeare", data_dir, out_dir, block_size=16)
    assert load_shards(out_dir).fingerprint == good.fingerprint
    monkeypatch.undo()
    rebuilt = build_shards("tinyshakespeare", data_dir, out_dir, block_size=16)
    assert load_shards(out_dir).fingerprint == rebuilt.fingerprint != good.fingerprint


def test_crash_before_folder_rename_leaves_previous_shards_readable(tmp_path, monkeypatch):
    data_dir = fake_data_dir(tmp_path / "data", small_corpus())
    out_dir = tmp_path / "shards" / "tinyshakespeare"
    good = build_shards("tinyshakespeare", data_dir, out_dir)

    def crash(*args, **kwargs):
        raise OSError("simulated crash before the rename")

    monkeypatch.setattr(data_io, "_move_into_place", crash)
    with pytest.raises(OSError, match="simulated crash"):
        build_shards("tinyshakespeare", data_dir, out_dir, block_size=16)
    assert load_shards(out_dir).fingerprint == good.fingerprint
    assert sorted(p.name for p in out_dir.iterdir()) == ["manifest.json", f"v-{good.fingerprint[:16]}"]


def test_manifest_metadata_is_plain_values(pystdlib_build):
    manifest, _ = pystdlib_build
    metadata = shards.manifest_metadata(manifest)
    assert metadata["rows"] == manifest.n_examples and metadata["fingerprint"] == manifest.fingerprint
    assert len(metadata["shard_table"]) == len(manifest.shards)
    assert all(v is not None for v in metadata.values())


def test_staging_left_by_a_dead_process_is_cleaned(tmp_path):
    data_dir = fake_data_dir(tmp_path / "data", small_corpus())
    out_dir = tmp_path / "shards" / "tinyshakespeare"
    leftover = out_dir / ".staging-999999999-abc"  # no such pid
    leftover.mkdir(parents=True)
    (leftover / "shard-00000.parquet").write_bytes(b"half-written")
    build_shards("tinyshakespeare", data_dir, out_dir)
    assert not leftover.exists()
    assert sorted(p.name for p in out_dir.iterdir() if not p.name.startswith("v-")) == [
        "manifest.json"]


def test_old_versions_are_collected_keeping_the_previous_one(tmp_path):
    data_dir = fake_data_dir(tmp_path / "data", small_corpus())
    out_dir = tmp_path / "shards" / "tinyshakespeare"
    for block_size in (8, 16, 32):
        latest = build_shards("tinyshakespeare", data_dir, out_dir, block_size=block_size)
    versions = sorted(p.name for p in out_dir.iterdir() if p.name.startswith("v-"))
    assert len(versions) == 2 and f"v-{latest.fingerprint[:16]}" in versions


# ---- bad input: nothing half-written ---------------------------------------------------------

def test_missing_data_folder_names_setting_and_fallback(tmp_path):
    out_dir = tmp_path / "shards" / "tinyshakespeare"
    with pytest.raises(FileNotFoundError, match="TRAINWISE_DATA_DIR.*'pystdlib'"):
        build_shards("tinyshakespeare", tmp_path / "no-such-folder", out_dir)
    assert not out_dir.exists()


@pytest.mark.parametrize("content,match", [
    (b"", "is empty"),
    (b"  \n\n ", "is empty"),
    (b"hello \xff\xfe world" * 100, "not valid UTF-8"),
    (b"tiny corpus", "too small"),
])
def test_bad_corpus_is_refused_and_previous_shards_survive(tmp_path, content, match):
    out_dir = tmp_path / "shards" / "tinyshakespeare"
    good = build_shards("tinyshakespeare", fake_data_dir(tmp_path / "good", small_corpus()), out_dir)
    bad_dir = fake_data_dir(tmp_path / "bad", content)
    with pytest.raises(ValueError, match=match) as info:
        build_shards("tinyshakespeare", bad_dir, out_dir)
    assert "tinyshakespeare.txt" in str(info.value)
    assert load_shards(out_dir).fingerprint == good.fingerprint
    assert not [p for p in out_dir.iterdir() if p.name.startswith(".staging-")]


def _idx(magic: int, dims: tuple[int, ...], payload: bytes) -> bytes:
    header = magic.to_bytes(4, "big") + b"".join(d.to_bytes(4, "big") for d in dims)
    return gzip.compress(header + payload, mtime=0)


@pytest.mark.parametrize("images,labels,match", [
    (b"not gzip at all", _idx(0x801, (2,), bytes([1, 2])), "not a readable gzip"),
    (_idx(0x803, (2, 28, 28), bytes(784)), _idx(0x801, (2,), bytes([1, 2])), "truncated"),
    (_idx(0x999, (2, 28, 28), bytes(2 * 784)), _idx(0x801, (2,), bytes([1, 2])), "IDX magic"),
    (_idx(0x803, (2, 28, 28), bytes(2 * 784)), _idx(0x801, (3,), bytes([1, 2, 3])), "labels"),
    (_idx(0x803, (2, 28, 28), bytes(2 * 784)), _idx(0x801, (2,), bytes([1, 42])), "label 42"),
])
def test_corrupt_mnist_files_are_refused(tmp_path, images, labels, match):
    folder = tmp_path / "data" / "images" / "mnist"
    folder.mkdir(parents=True)
    (folder / "t10k-images-idx3-ubyte.gz").write_bytes(images)
    (folder / "t10k-labels-idx1-ubyte.gz").write_bytes(labels)
    out_dir = tmp_path / "shards" / "mnist"
    with pytest.raises(ValueError, match=match):
        build_shards("mnist", tmp_path / "data", out_dir)
    assert not out_dir.exists()


def test_image_eval_rule_is_exact_and_evenly_spread():
    images = np.zeros((1000, 28, 28), np.uint8)
    labels = np.arange(1000) % 10
    for fraction, expected in [(0.1, 100), (0.25, 250), (0.3, 300)]:
        _, _, is_eval, _, _ = shards._image_examples(images, labels, "x", fraction)
        assert is_eval.sum() == expected
        gaps = np.diff(np.flatnonzero(is_eval))
        assert gaps.max() - gaps.min() <= 1
    _, _, is_eval, _, _ = shards._image_examples(images, labels, "x", 0.1)
    np.testing.assert_array_equal(np.flatnonzero(is_eval), np.arange(9, 1000, 10))


# ---- the real shared data ---------------------------------------------------------------------

@needs_shared_data
def test_tinyshakespeare_shards(shakespeare_build):
    manifest, out_dir = shakespeare_build
    examples = load_shards(out_dir)
    assert len(examples.example_ids) == 1_115_394 // 65 == manifest.n_examples
    assert len(examples.vocab) == 65  # the shakespeare_char vocabulary
    assert decode(examples.vocab, examples.inputs[0]).startswith("First Citizen:\nBefore we")
    assert manifest.n_eval == len(examples.example_ids) // 10
    assert sum(s["tokens"] for s in manifest.shards) == manifest.n_examples * 65
    assert read_manifest(out_dir).fingerprint == manifest.fingerprint
    assert manifest.source["sha256"] == data_io.sha256_file(DATA_DIR / SOURCES[
        "tinyshakespeare"].files[0])


@needs_shared_data
def test_mnist_shards(mnist_build):
    manifest, out_dir = mnist_build
    examples = load_shards(out_dir)
    assert examples.inputs.shape == (10_000, 28, 28) and examples.inputs.dtype == np.uint8
    assert examples.labels.tolist()[:10] == MNIST_FIRST_TEST_LABELS
    np.testing.assert_array_equal(examples.eval_positions, np.arange(9, 10_000, 10))
    for positions in (examples.train_positions, examples.eval_positions):
        assert set(examples.labels[positions].tolist()) == set(range(10))
    assert sum(s["images"] for s in manifest.shards) == 10_000
    assert 0 < examples.inputs.mean() < 255
