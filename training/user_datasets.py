"""A team's own `datasets` data set from local files -> checksummed parquet shards (a partition).

Input (`DatasetSpec`, parsed from the team's project file by `trainwise.user_project`): a file or
a folder of files in one of `FORMATS`, or a folder written by `Dataset.save_to_disk` ("saved").
Read with Hugging Face `datasets`, offline: `load_dataset(<builder>, data_files=..., split="train")`
with a cache folder inside the build's staging folder (so a build never reads a stale cache of an
edited file, and a crash leaves nothing behind), or `load_from_disk` (read in place, never written).

Output rows: every column of the data set, plus
  example_id  int64. An integer id column is used as is. Any other id (a string column, or the
              row hash below) becomes the first 8 bytes of sha256(utf-8 of the id), big-endian, as
              a signed int64; two ids with one example_id are refused (a collision).
  is_eval     bool, from its own hash of the id: u = first 8 bytes of
              sha256("trainwise.is_eval/1\\0" + id) as an unsigned int; eval iff
              u < floor(eval_fraction * 2**64). It depends on the id alone, so adding or removing
              rows never moves an existing example between train and eval. (Its own salt: with the
              example_id hash, the eval rows would be the smallest ids, the first shards.)
Rows are sorted by example_id, so the shards do not depend on the order of the input rows.

`id_column = "row_content_sha256"`: the id of a row is the sha256 of its canonical JSON (sorted
keys, no whitespace; bytes, dates and decimals as tagged strings); duplicate rows are refused.
The hash is over the row as loaded, so a change of format or of a column's type changes the ids.

Shards: `shard-00000.parquet`, ... (examples_per_shard rows each, through `Dataset.to_parquet`),
published atomically with `manifest.json` by `_data_io.publish_folder`, like the built-in shards.
"""

from __future__ import annotations

import base64
import datetime as dt
import decimal
import hashlib
import json
import re
import shutil
import time
from collections.abc import Mapping
from dataclasses import dataclass
from fractions import Fraction
from pathlib import Path
from types import MappingProxyType
from typing import Any

import numpy as np

from training._data_io import publish_folder, read_json, sha256_file, sha256_json
from training.shards import MANIFEST_NAME, _import_datasets

MANIFEST_FORMAT = "trainwise.user_shards/1"
REMATERIALIZE = "re-materialize data_shards for this partition"
ROW_HASH_ID = "row_content_sha256"
RESERVED_COLUMNS = ("example_id", "is_eval")
EXAMPLES_PER_SHARD = 4096
_EVAL_SALT = b"trainwise.is_eval/1\0"
_INT64_MAX = 2**63 - 1

# format -> the `datasets` packaged builder that reads it (None: `load_from_disk`).
FORMATS: Mapping[str, str | None] = MappingProxyType({
    "json": "json", "jsonl": "json", "parquet": "parquet", "csv": "csv", "text": "text",
    "arrow": "arrow", "saved": None,
})
SUFFIXES: Mapping[str, str] = MappingProxyType({
    ".json": "json", ".jsonl": "jsonl", ".ndjson": "jsonl", ".parquet": "parquet", ".pq": "parquet",
    ".csv": "csv", ".txt": "text", ".text": "text", ".arrow": "arrow",
})
# `datasets` decompresses these itself; data.jsonl.gz is jsonl.
_COMPRESSION = (".gz", ".bz2", ".xz", ".zst")
# Files `save_to_disk` writes into its folder (a Dataset, or a DatasetDict).
_SAVED_MARKERS = ("state.json", "dataset_dict.json")


@dataclass(frozen=True)
class DatasetSpec:
    """One `[datasets.NAME]` of a project file, validated. Defined here, in the loader's room,
    because `training` may not import `trainwise` (tests/test_import_rules.py); the project file's
    parser (`trainwise.user_project`) builds it."""

    name: str
    path: Path  # absolute
    format: str  # a key of FORMATS
    id_column: str
    text_column: str | None = None
    eval_fraction: float = 0.1
    declared_in: Path | None = None  # the project file, named in every error

    def where(self) -> str:
        place = f" of {self.declared_in}" if self.declared_in else ""
        return f"dataset {self.name!r} ([datasets.{self.name}]{place}, {self.path})"


def _format_of_name(name: str) -> str | None:
    lower = name.lower()
    for compressed in _COMPRESSION:
        if lower.endswith(compressed):
            lower = lower[: -len(compressed)]
            break
    return SUFFIXES.get(Path(lower).suffix)


def infer_format(path: Path) -> str | None:
    """The format of a path from its suffix, or "saved" for a `save_to_disk` folder; None when it
    cannot be told (the project file must then say `format`)."""
    if path.is_dir():
        return "saved" if any((path / m).is_file() for m in _SAVED_MARKERS) else None
    return _format_of_name(path.name)


def data_files(spec: DatasetSpec) -> list[Path]:
    """The files `load_dataset` reads: the path itself, or the files of the spec's format in the
    folder (not recursive), sorted by name so the listing does not depend on the file system."""
    if not spec.path.exists():
        raise FileNotFoundError(f"{spec.where()}: {spec.path} does not exist; fix `path` in the "
                                "project file (relative to its folder) or restore the data")
    if spec.path.is_file():
        return [spec.path]
    wanted = {spec.format, "jsonl" if spec.format == "json" else spec.format}
    files = sorted(p for p in spec.path.iterdir() if p.is_file() and _format_of_name(p.name) in wanted)
    if not files:
        suffixes = ", ".join(s for s, f in SUFFIXES.items() if f in wanted)
        raise ValueError(f"{spec.where()}: the folder {spec.path} holds no {spec.format} files "
                         f"(names ending {suffixes}); put the data there, or point `path` at a file")
    return files


def _root_cause(error: BaseException) -> BaseException:
    seen = {id(error)}
    while (error.__cause__ or error.__context__) is not None:
        error = error.__cause__ or error.__context__
        if id(error) in seen:
            break
        seen.add(id(error))
    return error


def load_user_dataset(spec: DatasetSpec, cache_dir: Path):
    """The spec's data as one `datasets.Dataset` (offline), validated: rows, id column, text
    column. `cache_dir` receives the arrow cache of `load_dataset` (the caller removes it)."""
    datasets = _import_datasets(cache_dir)
    import pyarrow as pa

    if spec.format not in FORMATS:
        raise ValueError(f"{spec.where()}: unknown format {spec.format!r}; use one of "
                         f"{', '.join(FORMATS)}")
    if FORMATS[spec.format] is None:
        if not spec.path.is_dir():
            raise FileNotFoundError(f"{spec.where()}: format 'saved' needs the folder that "
                                    f"Dataset.save_to_disk wrote, and {spec.path} is not a folder; "
                                    "fix `path`, or set `format` to the file's format")
        try:
            loaded = datasets.load_from_disk(str(spec.path))
        except (FileNotFoundError, ValueError, OSError, pa.ArrowException) as error:
            raise ValueError(f"{spec.where()}: {spec.path} is not a folder written by "
                             f"Dataset.save_to_disk ({_root_cause(error)}); save it again, or set "
                             "`format` to the format of its files") from error
        if isinstance(loaded, datasets.DatasetDict):
            if "train" not in loaded:
                raise ValueError(f"{spec.where()}: the saved DatasetDict has splits "
                                 f"{sorted(loaded)}, no 'train'; save the split to use with "
                                 "Dataset.save_to_disk, or name it 'train'")
            loaded = loaded["train"]
    else:
        files = data_files(spec)
        bars_were_on = not datasets.utils.are_progress_bars_disabled()
        datasets.disable_progress_bars()
        try:
            loaded = datasets.load_dataset(FORMATS[spec.format], data_files=[str(f) for f in files],
                                           split="train", cache_dir=str(cache_dir))
        except (datasets.exceptions.DatasetsError, pa.ArrowException, ValueError,
                OSError, StopIteration) as error:  # StopIteration: the json builder, no rows
            if _holds_no_rows(spec.format, files):
                raise _no_rows_error(spec) from error
            cause = _root_cause(error)
            raise ValueError(f"{spec.where()}: {', '.join(f.name for f in files)} does not parse "
                             f"as {spec.format} ({type(cause).__name__}: {str(cause)[:300]}); fix "
                             "the file, or set `format` to the format it is in") from error
        finally:
            if bars_were_on:
                datasets.enable_progress_bars()
    _check_columns(spec, loaded)
    return loaded


def _no_rows_error(spec: DatasetSpec) -> ValueError:
    return ValueError(f"{spec.where()} has no rows; add rows to the data, or point `path` at the "
                      "data you mean")


def _holds_no_rows(fmt: str, files: list[Path]) -> bool:
    """After a failed load: whether the files just hold no rows. `load_dataset` fails on empty
    files with errors that do not say so (StopIteration for json, "corresponds to no data" for a
    csv header alone, a schema error for text, "BatchSize must be greater than 0" for parquet)."""
    for path in files:
        size = path.stat().st_size
        if size == 0:
            continue
        if fmt == "parquet":
            import pyarrow.parquet as pq

            try:
                if pq.read_metadata(path).num_rows == 0:
                    continue
            except Exception:  # noqa: BLE001 - unreadable: not "empty", the caller says so
                return False
            return False
        if (fmt not in ("json", "jsonl", "csv", "text") or size > 1 << 20
                or path.name.lower().endswith(_COMPRESSION)):
            return False  # arrow, compressed or large files: not known to be empty
        lines = [line for line in path.read_text(encoding="utf-8", errors="replace").splitlines()
                 if line.strip()]
        header_only = fmt == "csv" and len(lines) == 1
        empty_array = fmt == "json" and "".join(lines).replace(" ", "") == "[]"
        if lines and not header_only and not empty_array:
            return False
    return True


def _check_columns(spec: DatasetSpec, dataset) -> None:
    import pyarrow as pa

    columns = list(dataset.column_names)
    if len(dataset) == 0:
        raise _no_rows_error(spec)
    if spec.id_column != ROW_HASH_ID and spec.id_column not in columns:
        raise ValueError(f"{spec.where()} has no id column {spec.id_column!r}; its columns are "
                         f"{columns}: set `id_column` to one of them that holds a stable id per row, "
                         f"or to {ROW_HASH_ID!r} (a hash of each row's content)")
    schema = dataset.data.schema
    for reserved in RESERVED_COLUMNS:
        # An integer id column may itself be called example_id: it is used as is.
        if reserved in columns and not (reserved == "example_id" == spec.id_column
                                        and pa.types.is_integer(schema.field(reserved).type)):
            raise ValueError(f"{spec.where()} has a column {reserved!r}, a name the shards add "
                             "themselves; rename that column in the data")
    if spec.text_column is not None:
        if spec.text_column not in columns:
            raise ValueError(f"{spec.where()} has no text column {spec.text_column!r}; its columns "
                             f"are {columns}: set `text_column` to one of them, or remove it")
        kind = schema.field(spec.text_column).type
        if not (pa.types.is_string(kind) or pa.types.is_large_string(kind)):
            raise ValueError(f"{spec.where()}: text column {spec.text_column!r} holds {kind}, not "
                             "strings; set `text_column` to a column of strings, or remove it")


def _id_to_int64(text: str) -> int:
    return int.from_bytes(hashlib.sha256(text.encode("utf-8")).digest()[:8], "big", signed=True)


def _json_default(value: Any) -> str:
    # Tagged strings: JSON has no bytes or dates, and the hash must not depend on str() of a type.
    if isinstance(value, (bytes, bytearray)):
        return "bytes:" + base64.b64encode(bytes(value)).decode("ascii")
    if isinstance(value, (dt.datetime, dt.date, dt.time)):
        return f"{type(value).__name__}:{value.isoformat()}"
    if isinstance(value, dt.timedelta):
        return f"timedelta:{value.total_seconds()!r}"
    if isinstance(value, decimal.Decimal):
        return f"decimal:{value}"
    raise TypeError(f"a value of type {type(value).__name__}")


def _row_hashes(spec: DatasetSpec, dataset) -> list[str]:
    hashes = []
    arrow_rows = dataset.with_format("arrow")  # raw values: no image decoding, no numpy
    for batch in arrow_rows.iter(batch_size=1024):
        for row in batch.to_pylist():
            try:
                text = json.dumps(row, sort_keys=True, separators=(",", ":"), ensure_ascii=False,
                                  default=_json_default)
            except TypeError as error:
                raise ValueError(f"{spec.where()}: row {len(hashes)} holds {error}, which "
                                 f"{ROW_HASH_ID!r} cannot hash; set `id_column` to a column of "
                                 "ids instead") from error
            hashes.append(hashlib.sha256(text.encode("utf-8")).hexdigest())
    return hashes


def _first_repeat(keys: list) -> tuple[int, int] | None:
    first_row: dict = {}
    for row, key in enumerate(keys):
        if key in first_row:
            return first_row[key], row
        first_row[key] = row
    return None


def example_ids(spec: DatasetSpec, dataset) -> tuple[np.ndarray, list[str]]:
    """(example_id int64 per row, the id as text per row: what is_eval hashes). Refuses null,
    duplicate and colliding ids and id columns that are neither integers nor strings."""
    import pyarrow as pa

    if spec.id_column == ROW_HASH_ID:
        texts = _row_hashes(spec, dataset)
        repeat = _first_repeat(texts)
        if repeat:
            raise ValueError(f"{spec.where()}: rows {repeat[0]} and {repeat[1]} are identical, so "
                             f"{ROW_HASH_ID!r} gives them one id; remove the duplicate rows, or "
                             "set `id_column` to a column that tells them apart")
        return np.array([_id_to_int64(t) for t in texts], dtype=np.int64), texts
    column = dataset.data.column(spec.id_column)  # the whole column as arrow, without a copy
    if column.null_count:
        nulls = int(column.null_count)
        first = column.is_null().to_pylist().index(True)
        raise ValueError(f"{spec.where()}: id column {spec.id_column!r} is empty (null) in {nulls} "
                         f"row(s), the first at row {first}; give every row an id, or set "
                         f"`id_column` to {ROW_HASH_ID!r}")
    kind = column.type
    if pa.types.is_integer(kind):
        values = column.to_numpy()
        if values.dtype == np.uint64 and values.size and values.max() > _INT64_MAX:
            raise ValueError(f"{spec.where()}: id column {spec.id_column!r} holds values above "
                             f"2**63 - 1, which do not fit an int64 example_id; use smaller ids, or "
                             "store them as strings")
        ids = values.astype(np.int64)
        texts = [str(int(v)) for v in ids]
    elif pa.types.is_string(kind) or pa.types.is_large_string(kind):
        texts = column.to_pylist()
        ids = np.array([_id_to_int64(t) for t in texts], dtype=np.int64)
    else:
        raise ValueError(f"{spec.where()}: id column {spec.id_column!r} holds {kind}; an id column "
                         f"must hold integers or strings: convert it, or set `id_column` to "
                         f"{ROW_HASH_ID!r}")
    repeat = _first_repeat(texts)
    if repeat:
        raise ValueError(f"{spec.where()}: id {texts[repeat[1]]!r} of column {spec.id_column!r} "
                         f"repeats (rows {repeat[0]} and {repeat[1]}); ids must be unique: fix the "
                         f"data, or set `id_column` to {ROW_HASH_ID!r}")
    repeat = _first_repeat(ids.tolist())
    if repeat:  # distinct ids, one example_id: a 64-bit hash collision
        raise ValueError(f"{spec.where()}: ids {texts[repeat[0]]!r} and {texts[repeat[1]]!r} hash "
                         f"to the same example_id {int(ids[repeat[0]])}; change one of the two ids")
    return ids, texts


def eval_flags(id_texts: list[str], eval_fraction: float) -> np.ndarray:
    """is_eval per id, from the id alone (see the module docstring)."""
    threshold = int(Fraction(eval_fraction) * 2**64)  # exact: no float rounding at the boundary
    return np.array([
        int.from_bytes(hashlib.sha256(_EVAL_SALT + t.encode("utf-8")).digest()[:8], "big") < threshold
        for t in id_texts], dtype=bool)


@dataclass(frozen=True)
class UserShardManifest:
    """What `build_user_shards` published: manifest.json's content plus where it lies."""

    partition: str
    fingerprint: str
    n_examples: int
    n_train: int
    n_eval: int
    columns: tuple[str, ...]
    id_column: str
    text_column: str | None
    eval_rule: str
    shards: tuple[dict, ...]  # per shard: file, rows, bytes, n_eval, first/last example_id, sha256
    source: dict
    path: Path
    build_s: float = 0.0

    @property
    def total_bytes(self) -> int:
        return sum(s["bytes"] for s in self.shards)

    def metadata(self) -> dict[str, Any]:
        """Asset metadata: str/int/float and a list of dicts, no None."""
        meta = {"partition": self.partition, "kind": "user dataset", "rows": self.n_examples,
                "train_rows": self.n_train, "eval_rows": self.n_eval, "shards": len(self.shards),
                "bytes": self.total_bytes, "fingerprint": self.fingerprint,
                "id_column": self.id_column, "columns": ", ".join(self.columns),
                "eval_rule": self.eval_rule, "source": str(self.source["path"]),
                "source_format": self.source["format"], "manifest": str(self.path),
                "build_s": round(self.build_s, 3)}
        if self.text_column:
            meta["text_column"] = self.text_column
        meta["shard_table"] = [{k: s[k] for k in ("file", "rows", "bytes", "n_eval", "sha256")}
                               for s in self.shards]
        return meta


def _fingerprint(partition: str, features: dict, id_column: str, eval_fraction: float,
                 shard_sha256: list[str]) -> str:
    # Over the shard checksums and what decides them; not over the source's path, so a moved
    # checkout with the same data has the same fingerprint.
    return sha256_json({"format": MANIFEST_FORMAT, "partition": partition, "features": features,
                        "id_column": id_column, "eval_fraction": eval_fraction,
                        "shards": shard_sha256})


def _source_record(spec: DatasetSpec) -> dict:
    root = spec.path
    files = ([root] if root.is_file() else data_files(spec) if FORMATS[spec.format]
             else sorted(p for p in root.rglob("*") if p.is_file()))
    return {"name": spec.name, "path": str(root), "format": spec.format,
            "declared_in": str(spec.declared_in) if spec.declared_in else None,
            "files": [{"file": p.relative_to(root).as_posix() if p != root else p.name,
                       "bytes": p.stat().st_size, "sha256": sha256_file(p)} for p in files]}


def build_user_shards(spec: DatasetSpec, out_dir: Path, *,
                      examples_per_shard: int = EXAMPLES_PER_SHARD) -> UserShardManifest:
    """Load, validate and shard one registered data set into `out_dir` (its own folder, named
    after it), published atomically: on any error the previous shards stay readable.
    Idempotent: the same data gives byte-identical shards, manifest and fingerprint.
    Raises ValueError / FileNotFoundError naming the data set, the thing and the fix."""
    start_s = time.perf_counter()
    out_dir = Path(out_dir)
    if out_dir.name != spec.name:
        raise ValueError(f"out_dir {out_dir} must be the partition's own folder, named "
                         f"{spec.name!r} (e.g. <state>/shards/{spec.name})")
    if (not isinstance(examples_per_shard, int) or isinstance(examples_per_shard, bool)
            or examples_per_shard < 1):
        raise ValueError(f"examples_per_shard must be a positive integer, got {examples_per_shard!r}")
    datasets = _import_datasets(out_dir)
    import pyarrow as pa

    def write_files(staging: Path) -> dict:
        # The load's arrow cache lives in the staging folder: removed on error with the rest,
        # and removed below before the folder is published.
        cache = staging / ".hf-cache"
        try:
            dataset = load_user_dataset(spec, cache)
            ids, texts = example_ids(spec, dataset)
            is_eval = eval_flags(texts, spec.eval_fraction)
            if is_eval.all() or not is_eval.any():
                raise ValueError(
                    f"{spec.where()}: {len(ids)} rows at eval_fraction {spec.eval_fraction} give "
                    f"{int(is_eval.sum())} eval and {int((~is_eval).sum())} train rows; both need "
                    "at least one: add rows, or change `eval_fraction`")
            order = np.argsort(ids, kind="stable")
            table = dataset.with_format("arrow")[:].take(pa.array(order))
            if "example_id" in table.column_names:  # the integer id column is example_id itself
                table = table.drop_columns(["example_id"])
            table = (table.add_column(0, "example_id", pa.array(ids[order], pa.int64()))
                     .add_column(1, "is_eval", pa.array(is_eval[order], pa.bool_())))
            features = datasets.Features({"example_id": datasets.Value("int64"),
                                          "is_eval": datasets.Value("bool"),
                                          **{k: v for k, v in dataset.features.items()
                                             if k != "example_id"}})
            entries = _write_shards(datasets, staging, table, features, examples_per_shard)
            del dataset  # its memory maps point into the cache removed next
        finally:
            shutil.rmtree(cache, ignore_errors=True)
        features_dict = features.to_dict()
        rule = (f"is_eval iff the first 8 bytes of sha256('trainwise.is_eval/1\\0' + id) < "
                f"{spec.eval_fraction} * 2**64 (per id: stable when rows are added)")
        return {
            "format": MANIFEST_FORMAT, "partition": spec.name, "kind": "user",
            "fingerprint": _fingerprint(spec.name, features_dict, spec.id_column,
                                        float(spec.eval_fraction), [e["sha256"] for e in entries]),
            "n_examples": len(ids), "n_train": int((~is_eval).sum()), "n_eval": int(is_eval.sum()),
            "columns": list(features), "features": features_dict, "id_column": spec.id_column,
            "text_column": spec.text_column, "eval_fraction": float(spec.eval_fraction),
            "eval_rule": rule, "examples_per_shard": examples_per_shard,
            "source": _source_record(spec), "files": entries,
        }

    manifest = publish_folder(out_dir, MANIFEST_NAME, write_files)
    return _manifest_from_dict(manifest, out_dir / MANIFEST_NAME, time.perf_counter() - start_s)


def _write_shards(datasets, staging: Path, table, features, examples_per_shard: int) -> list[dict]:
    from datasets.table import InMemoryTable

    info = datasets.DatasetInfo(features=features)
    bars_were_on = not datasets.utils.are_progress_bars_disabled()
    datasets.disable_progress_bars()
    entries = []
    try:
        for index, first in enumerate(range(0, table.num_rows, examples_per_shard)):
            part = table.slice(first, examples_per_shard)
            name = f"shard-{index:05d}.parquet"
            datasets.Dataset(InMemoryTable(part), info=info).to_parquet(str(staging / name))
            ids = part.column("example_id")
            entries.append({
                "file": name, "rows": part.num_rows, "bytes": (staging / name).stat().st_size,
                "n_eval": sum(part.column("is_eval").to_pylist()),
                "first_example_id": ids[0].as_py(), "last_example_id": ids[-1].as_py(),
                "sha256": sha256_file(staging / name)})
    finally:
        if bars_were_on:
            datasets.enable_progress_bars()
    return entries


def _manifest_from_dict(manifest: dict, path: Path, build_s: float = 0.0) -> UserShardManifest:
    return UserShardManifest(
        partition=manifest["partition"], fingerprint=manifest["fingerprint"],
        n_examples=manifest["n_examples"], n_train=manifest["n_train"], n_eval=manifest["n_eval"],
        columns=tuple(manifest["columns"]), id_column=manifest["id_column"],
        text_column=manifest["text_column"], eval_rule=manifest["eval_rule"],
        shards=tuple(manifest["files"]), source=manifest["source"], path=path, build_s=build_s)


def read_user_manifest(out_dir: Path) -> UserShardManifest:
    """The published manifest of a registered partition (no checksum check: load_user_shards)."""
    path = Path(out_dir) / MANIFEST_NAME
    raw = read_json(path, what="shard manifest", fix=REMATERIALIZE)
    if raw.get("format") != MANIFEST_FORMAT:
        raise ValueError(f"shard manifest {path} has format {raw.get('format')!r}, expected "
                         f"{MANIFEST_FORMAT!r} (a registered dataset's shards): {REMATERIALIZE}")
    try:
        return _manifest_from_dict(raw, path)
    except KeyError as error:
        raise ValueError(f"shard manifest {path} lacks {error}: {REMATERIALIZE}") from error


def load_user_shards(out_dir: Path):
    """Every row of a published registered partition as one `datasets.Dataset` (with example_id
    and is_eval), after checking the manifest's fingerprint and each shard's sha256."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    out_dir = Path(out_dir)
    manifest = read_user_manifest(out_dir)
    raw = read_json(manifest.path, what="shard manifest", fix=REMATERIALIZE)
    folder = raw.get("folder")
    if not isinstance(folder, str) or not re.fullmatch(r"v-[0-9a-f]{16}", folder):
        raise ValueError(f"shard manifest {manifest.path} names no valid shard folder: {REMATERIALIZE}")
    if manifest.fingerprint != _fingerprint(manifest.partition, raw.get("features"),
                                            manifest.id_column, raw.get("eval_fraction"),
                                            [s["sha256"] for s in manifest.shards]):
        raise ValueError(f"shard manifest {manifest.path} does not match its own fingerprint "
                         f"(edited or corrupt): {REMATERIALIZE}")
    tables = []
    for entry in manifest.shards:
        path = out_dir / folder / entry["file"]
        if not path.is_file():
            raise FileNotFoundError(f"shard {path} is missing: {REMATERIALIZE}")
        if sha256_file(path) != entry["sha256"]:
            raise ValueError(f"shard {path} fails its sha256 checksum (corrupt or modified on "
                             f"disk): {REMATERIALIZE}")
        tables.append(pq.read_table(path))
    table = pa.concat_tables(tables)
    if table.num_rows != manifest.n_examples:
        raise ValueError(f"shards under {out_dir} hold {table.num_rows} rows, the manifest says "
                         f"{manifest.n_examples}: {REMATERIALIZE}")
    datasets = _import_datasets(out_dir)
    from datasets.table import InMemoryTable

    features = datasets.Features.from_dict(raw["features"])
    return datasets.Dataset(InMemoryTable(table), info=datasets.DatasetInfo(features=features))
