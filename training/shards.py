"""data_shards: one partition of raw data -> checksummed parquet shards -> an `ExampleSet`.

Partitions (`SOURCES`):
  tinyshakespeare  text   <data_dir>/corpora/tinyshakespeare.txt (karpathy/char-rnn)
  mnist            image  <data_dir>/images/mnist/t10k-{images-idx3,labels-idx1}-ubyte.gz
  pystdlib         text   Python's own standard library (.py files, sorted, first 1e6 chars):
                          every machine has it, so the demo runs without the shared data.

Examples:
  text   non-overlapping chunks of block_size + 1 characters, in corpus order; example_id = chunk
         index; token ids index into `vocab`, the sorted set of the corpus's characters (the
         shakespeare_char encoding of nanoGPT). The tail shorter than a chunk is dropped.
  image  one image per example; example_id = its index in the IDX file.

Held-out split (fixed at build time, stored per example in the shards):
  text   the contiguous last max(1, floor(N * eval_fraction)) chunks: a tail of the corpus, so that
         no eval chunk is the neighbour of a train chunk except at one boundary.
  image  example i is eval iff floor((i+1) f) > floor(i f) with f = eval_fraction as an exact
         fraction: evenly spread, and for f = 0.1 exactly `i % 10 == 9`. (Why not the tail: the
         MNIST test file puts its two writer populations in its two halves.)

Shards: `shard-00000.parquet`, ... written with Hugging Face `datasets` (offline), examples_per_shard
consecutive examples each, published atomically with `manifest.json` (see `_data_io`).
"""

from __future__ import annotations

import hashlib
import os
import re
import time
from collections.abc import Mapping
from dataclasses import dataclass
from fractions import Fraction
from pathlib import Path
from types import MappingProxyType
from typing import Any, Literal

import numpy as np

from training._data_io import publish_folder, read_json, sha256_file, sha256_json
from training._data_sources import read_mnist, read_pystdlib_corpus, read_text_corpus
from training.data_types import ExampleSet

MANIFEST_NAME = "manifest.json"
MANIFEST_FORMAT = "trainwise.data_shards/1"
REMATERIALIZE = "re-materialize data_shards"
MNIST_SIDE_PX = 28


@dataclass(frozen=True)
class Source:
    """Where a partition's raw data comes from. `files` are relative to the data folder."""

    name: str
    kind: Literal["text", "image"]
    files: tuple[str, ...]
    description: str


SOURCES: Mapping[str, Source] = MappingProxyType({
    "tinyshakespeare": Source(
        "tinyshakespeare", "text", ("corpora/tinyshakespeare.txt",),
        "1.1 MB of Shakespeare, the shakespeare_char benchmark corpus (karpathy/char-rnn)"),
    "mnist": Source(
        "mnist", "image",
        ("images/mnist/t10k-images-idx3-ubyte.gz", "images/mnist/t10k-labels-idx1-ubyte.gz"),
        "MNIST test set: 10,000 28x28 handwritten digits with labels (LeCun, Cortes, Burges)"),
    "pystdlib": Source(
        "pystdlib", "text", (),
        "the first 1,000,000 characters of Python's standard library .py files, sorted by path"),
})
FALLBACK_PARTITION = "pystdlib"


@dataclass(frozen=True)
class ShardManifest:
    """What `build_shards` published: the content of manifest.json plus where it lies."""

    partition: str
    kind: Literal["text", "image"]
    fingerprint: str
    n_examples: int
    n_train: int
    n_eval: int
    block_size: int | None
    vocab: tuple[str, ...] | None
    eval_rule: str
    shards: tuple[dict, ...]  # per shard: file, rows, bytes, tokens|images, n_eval, sha256, ids
    source: dict
    path: Path  # manifest.json
    build_s: float = 0.0  # wall time of the build that returned this; 0 when read from disk

    @property
    def total_bytes(self) -> int:
        return sum(s["bytes"] for s in self.shards)

    def summary(self) -> dict[str, Any]:
        """Flat scalars for asset metadata: rows, bytes, tokens or images, checksum."""
        unit = "tokens" if self.kind == "text" else "images"
        return {
            "partition": self.partition, "kind": self.kind, "rows": self.n_examples,
            "train_rows": self.n_train, "eval_rows": self.n_eval, "shards": len(self.shards),
            "bytes": self.total_bytes, unit: sum(s[unit] for s in self.shards),
            "fingerprint": self.fingerprint, "eval_rule": self.eval_rule,
            "vocab_size": len(self.vocab) if self.vocab is not None else None,
            "manifest": str(self.path),
        }


def manifest_metadata(manifest: ShardManifest) -> dict[str, Any]:
    """Asset metadata of a build: rows, bytes, tokens or images, checksum, per-shard table.

    Only str/int/float and a list of dicts (shown as JSON): no None values.
    """
    unit = "tokens" if manifest.kind == "text" else "images"
    metadata = {k: v for k, v in manifest.summary().items() if v is not None}
    metadata["build_s"] = round(manifest.build_s, 3)
    metadata["shard_table"] = [
        {"file": s["file"], "rows": s["rows"], "bytes": s["bytes"], unit: s[unit],
         "n_eval": s["n_eval"], "sha256": s["sha256"]} for s in manifest.shards]
    return metadata


def validate_partition(partition: str) -> Source:
    """The Source of a partition name; refuses path-like and unknown names, listing valid ones."""
    valid = ", ".join(sorted(SOURCES))
    if not isinstance(partition, str) or not partition:
        raise ValueError(f"partition must be a non-empty name, one of: {valid}")
    separators = {"/", "\\", os.sep} | ({os.altsep} if os.altsep else set())
    if any(sep in partition for sep in separators) or partition in {".", ".."}:
        raise ValueError(f"partition {partition!r} contains a path separator; a partition is a "
                         f"plain name, one of: {valid}")
    if partition not in SOURCES:
        raise ValueError(f"unknown partition {partition!r}; valid partitions: {valid}")
    return SOURCES[partition]


def _validate_build_args(block_size: int, eval_fraction: float, examples_per_shard: int) -> None:
    if not isinstance(block_size, int) or isinstance(block_size, bool) or block_size < 1:
        raise ValueError(f"block_size must be a positive integer, got {block_size!r}")
    if not isinstance(eval_fraction, (int, float)) or not 0.0 < float(eval_fraction) < 1.0:
        raise ValueError(f"eval_fraction must be in (0, 1), got {eval_fraction!r}")
    if (not isinstance(examples_per_shard, int) or isinstance(examples_per_shard, bool)
            or examples_per_shard < 1):
        raise ValueError(f"examples_per_shard must be a positive integer, got {examples_per_shard!r}")


def _source_paths(source: Source, data_dir: Path) -> list[Path]:
    if not source.files:
        return []
    if not data_dir.is_dir():
        raise FileNotFoundError(
            f"data folder {data_dir} does not exist, so partition {source.name!r} cannot be built: "
            f"set TRAINWISE_DATA_DIR to the folder that holds corpora/ and images/ (the shared "
            f"data), or use the partition {FALLBACK_PARTITION!r}, which needs no data folder")
    paths = [data_dir / rel for rel in source.files]
    for path in paths:
        if not path.is_file():
            raise FileNotFoundError(
                f"{path} is missing from the data folder {data_dir} (partition {source.name!r}): "
                f"restore it, set TRAINWISE_DATA_DIR to a complete data folder, or use the "
                f"partition {FALLBACK_PARTITION!r}")
    return paths


def _eval_fraction_exact(eval_fraction: float) -> Fraction:
    # Exact arithmetic: 0.1 as a float is not 1/10, and floor((i+1) * 0.1) misplaces some i.
    return Fraction(eval_fraction).limit_denominator(10_000)


def _text_examples(text: str, path_name: str, block_size: int, eval_fraction: float):
    codes = np.frombuffer(text.encode("utf-32-le"), dtype=np.uint32)
    alphabet, tokens = np.unique(codes, return_inverse=True)
    chunk = block_size + 1
    n_examples = len(codes) // chunk
    if n_examples < 2:
        raise ValueError(
            f"corpus {path_name} has {len(codes)} characters: too small for one train and one eval "
            f"example of block_size + 1 = {chunk} characters (needs at least {2 * chunk}); "
            "use a larger corpus or a smaller block_size")
    inputs = tokens[: n_examples * chunk].astype(np.int32).reshape(n_examples, chunk)
    f = _eval_fraction_exact(eval_fraction)
    n_eval = max(1, n_examples * f.numerator // f.denominator)
    is_eval = np.arange(n_examples) >= n_examples - n_eval
    vocab = tuple(chr(int(c)) for c in alphabet)
    rule = (f"text: the contiguous last max(1, floor(N * {eval_fraction})) of the N chunks are "
            f"eval (here ids >= {n_examples - n_eval})")
    return inputs, None, is_eval, vocab, rule


def _image_examples(images: np.ndarray, labels: np.ndarray, path_name: str, eval_fraction: float):
    ids = np.arange(len(images), dtype=np.int64)
    f = _eval_fraction_exact(eval_fraction)
    is_eval = (ids + 1) * f.numerator // f.denominator > ids * f.numerator // f.denominator
    if is_eval.all() or not is_eval.any():
        raise ValueError(f"{path_name} holds {len(images)} images: too few for one train and one "
                         f"eval example at eval_fraction {eval_fraction}")
    rule = (f"image: example i is eval iff floor((i+1)*f) > floor(i*f), f = {f} "
            f"(evenly spread; for f = 1/10: i % 10 == 9)")
    return images, labels, is_eval, None, rule


def _import_datasets(out_dir: Path):
    """Import `datasets` offline, its caches under the state folder (it reaches the hub otherwise)."""
    os.environ["HF_DATASETS_OFFLINE"] = "1"
    os.environ["HF_HUB_OFFLINE"] = "1"
    os.environ.setdefault("HF_HOME", str(out_dir.resolve().parent / ".hf_home"))
    import datasets

    datasets.config.HF_DATASETS_OFFLINE = True
    datasets.config.HF_HUB_OFFLINE = True
    return datasets


def _write_shard(datasets, path: Path, columns: dict[str, np.ndarray], kind: str) -> None:
    """One shard through `datasets`: Dataset.from_dict(...).to_parquet(path)."""
    from datasets import Features, List, Value

    if kind == "text":
        width = columns["tokens"].shape[1]
        features = Features({"example_id": Value("int64"), "is_eval": Value("bool"),
                             "tokens": List(Value("int32"), length=width)})
        data = dict(columns)
    else:
        features = Features({"example_id": Value("int64"), "is_eval": Value("bool"),
                             "label": Value("int64"), "pixels": Value("binary")})
        data = {k: v for k, v in columns.items() if k != "pixels"}
        data["pixels"] = [row.tobytes() for row in columns["pixels"]]
    dataset = datasets.Dataset.from_dict(data, features=features)
    bars_were_on = not datasets.utils.are_progress_bars_disabled()
    datasets.disable_progress_bars()  # one bar per 4k-row shard is noise in the demo's output
    try:
        dataset.to_parquet(str(path))
    finally:
        if bars_were_on:
            datasets.enable_progress_bars()


def build_shards(
    partition: str,
    data_dir: Path,
    out_dir: Path,
    *,
    block_size: int = 64,
    eval_fraction: float = 0.1,
    examples_per_shard: int = 4096,
) -> ShardManifest:
    """Build one partition's shards into `out_dir` (the partition's own folder) and publish them.

    Atomic for the whole partition: on any error (or a crash) the previously published shards
    stay in place and readable. Idempotent: the same input and arguments give byte-identical
    shards, the same checksums and the same fingerprint.
    Raises FileNotFoundError (missing data folder or file) or ValueError (bad argument, unknown
    or path-like partition, empty, corrupt or too-small corpus), each naming the input and the fix.
    """
    start_s = time.perf_counter()
    source = validate_partition(partition)
    _validate_build_args(block_size, eval_fraction, examples_per_shard)
    out_dir = Path(out_dir)
    if out_dir.name != partition:
        # Why: load_shards(out_dir) takes only the folder; one folder per partition keeps two
        # partitions from overwriting each other's manifest.
        raise ValueError(f"out_dir {out_dir} must be the partition's own folder, named "
                         f"{partition!r} (e.g. <state>/shards/{partition})")
    paths = _source_paths(source, Path(data_dir))
    # Read and validate everything before anything is written.
    if source.name == FALLBACK_PARTITION:
        text, described = read_pystdlib_corpus()
        origin = {"description": described,
                  "sha256": hashlib.sha256(text.encode("utf-8")).hexdigest()}
        examples = _text_examples(text, "pystdlib", block_size, eval_fraction)
    elif source.kind == "text":
        text = read_text_corpus(paths[0])
        origin = {"description": source.description, "path": str(paths[0]),
                  "sha256": sha256_file(paths[0])}
        examples = _text_examples(text, str(paths[0]), block_size, eval_fraction)
    else:
        images, labels, digest = read_mnist(paths[0], paths[1])
        origin = {"description": source.description, "path": [str(p) for p in paths],
                  "sha256": digest}
        examples = _image_examples(images, labels, str(paths[0]), eval_fraction)
    inputs, labels_or_none, is_eval, vocab, eval_rule = examples
    datasets = _import_datasets(out_dir)

    def write_files(staging: Path) -> dict:
        entries = []
        for index, first in enumerate(range(0, len(inputs), examples_per_shard)):
            last = min(first + examples_per_shard, len(inputs))
            ids = np.arange(first, last, dtype=np.int64)
            columns: dict[str, np.ndarray] = {"example_id": ids, "is_eval": is_eval[first:last]}
            if source.kind == "text":
                columns["tokens"] = inputs[first:last]
            else:
                columns["label"] = labels_or_none[first:last]
                columns["pixels"] = inputs[first:last]
            name = f"shard-{index:05d}.parquet"
            _write_shard(datasets, staging / name, columns, source.kind)
            rows = last - first
            size_key, size = (("tokens", rows * inputs.shape[1]) if source.kind == "text"
                              else ("images", rows))
            entries.append({
                "file": name, "rows": rows, "bytes": (staging / name).stat().st_size,
                size_key: size, "n_eval": int(is_eval[first:last].sum()),
                "first_example_id": first, "last_example_id": last - 1,
                "sha256": sha256_file(staging / name),
            })
        fingerprint = _fingerprint(partition, source.kind, block_size if source.kind == "text"
                                   else None, vocab, entries)
        return {
            "format": MANIFEST_FORMAT, "partition": partition, "kind": source.kind,
            "fingerprint": fingerprint, "n_examples": len(inputs),
            "n_train": int((~is_eval).sum()), "n_eval": int(is_eval.sum()),
            "block_size": block_size if source.kind == "text" else None,
            "vocab": list(vocab) if vocab is not None else None,
            "eval_fraction": float(eval_fraction), "eval_rule": eval_rule,
            "examples_per_shard": examples_per_shard, "source": origin, "files": entries,
        }

    manifest = publish_folder(out_dir, MANIFEST_NAME, write_files)
    return _manifest_from_dict(manifest, out_dir / MANIFEST_NAME,
                               build_s=time.perf_counter() - start_s)


def _fingerprint(partition: str, kind: str, block_size: int | None,
                 vocab: tuple[str, ...] | list[str] | None, entries: list[dict]) -> str:
    # Over the shard checksums plus what is not inside the shards (vocab, block size): two
    # corpora with the same token ids but other characters must not share a fingerprint.
    return sha256_json({
        "partition": partition, "kind": kind, "block_size": block_size,
        "vocab": list(vocab) if vocab is not None else None,
        "shards": [e["sha256"] for e in entries],
    })


def _manifest_from_dict(manifest: dict, path: Path, build_s: float = 0.0) -> ShardManifest:
    return ShardManifest(
        partition=manifest["partition"], kind=manifest["kind"],
        fingerprint=manifest["fingerprint"], n_examples=manifest["n_examples"],
        n_train=manifest["n_train"], n_eval=manifest["n_eval"],
        block_size=manifest["block_size"],
        vocab=tuple(manifest["vocab"]) if manifest["vocab"] is not None else None,
        eval_rule=manifest["eval_rule"], shards=tuple(manifest["files"]),
        source=manifest["source"], path=path, build_s=build_s,
    )


def read_manifest(out_dir: Path) -> ShardManifest:
    """The published manifest of a partition folder (no checksum verification: see load_shards)."""
    path = Path(out_dir) / MANIFEST_NAME
    manifest = read_json(path, what="shard manifest",
                         fix=f"materialize data_shards for this partition ({REMATERIALIZE})")
    if manifest.get("format") != MANIFEST_FORMAT:
        raise ValueError(f"shard manifest {path} has format {manifest.get('format')!r}, expected "
                         f"{MANIFEST_FORMAT!r}: {REMATERIALIZE}")
    try:
        return _manifest_from_dict(manifest, path)
    except KeyError as exc:
        raise ValueError(f"shard manifest {path} lacks {exc}: {REMATERIALIZE}") from exc


def load_shards(out_dir: Path) -> ExampleSet:
    """Every example of a published partition, after verifying each shard's sha256.

    A corrupt or missing shard raises ValueError / FileNotFoundError naming the file and the fix.
    """
    import pyarrow.parquet as pq

    out_dir = Path(out_dir)
    manifest = read_manifest(out_dir)
    raw = read_json(manifest.path, what="shard manifest", fix=REMATERIALIZE)
    folder = raw.get("folder")
    if not isinstance(folder, str) or not re.fullmatch(r"v-[0-9a-f]{16}", folder):
        raise ValueError(f"shard manifest {manifest.path} names no valid shard folder: {REMATERIALIZE}")
    if manifest.fingerprint != _fingerprint(manifest.partition, manifest.kind, manifest.block_size,
                                            manifest.vocab, list(manifest.shards)):
        raise ValueError(f"shard manifest {manifest.path} does not match its own fingerprint "
                         f"(edited or corrupt): {REMATERIALIZE}")
    ids, evals, inputs, labels, shard_of = [], [], [], [], []
    for index, entry in enumerate(manifest.shards):
        path = out_dir / folder / entry["file"]
        if not path.is_file():
            raise FileNotFoundError(f"shard {path} is missing: {REMATERIALIZE}")
        if sha256_file(path) != entry["sha256"]:
            raise ValueError(f"shard {path} fails its sha256 checksum (corrupt or modified on "
                             f"disk): {REMATERIALIZE}")
        table = pq.read_table(path)
        if table.num_rows != entry["rows"]:
            raise ValueError(f"shard {path} has {table.num_rows} rows, manifest says "
                             f"{entry['rows']}: {REMATERIALIZE}")
        ids.append(table.column("example_id").to_numpy())
        evals.append(table.column("is_eval").to_numpy(zero_copy_only=False))
        if manifest.kind == "text":
            flat = table.column("tokens").combine_chunks().values.to_numpy()
            inputs.append(flat.astype(np.int64).reshape(table.num_rows, -1))
        else:
            pixels = b"".join(table.column("pixels").to_pylist())
            side = MNIST_SIDE_PX
            inputs.append(np.frombuffer(pixels, np.uint8).reshape(table.num_rows, side, side))
            labels.append(table.column("label").to_numpy())
        shard_of.append(np.full(table.num_rows, index, dtype=np.int32))
    example_ids = np.concatenate(ids).astype(np.int64)
    if len(np.unique(example_ids)) != len(example_ids):
        raise ValueError(f"shards under {out_dir} repeat example ids: {REMATERIALIZE}")
    return ExampleSet(
        partition=manifest.partition, kind=manifest.kind, example_ids=example_ids,
        is_eval=np.concatenate(evals).astype(bool), inputs=np.concatenate(inputs),
        labels=np.concatenate(labels).astype(np.int64) if labels else None,
        vocab=manifest.vocab, shard_index=np.concatenate(shard_of), fingerprint=manifest.fingerprint,
    )
