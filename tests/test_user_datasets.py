"""A team's own data set from local files -> a data_shards partition (training.user_datasets,
trainwise.user_project, assets.data.data_shards_asset): every format builds shards whose rows are
the input rows plus example_id / is_eval; ids and the eval split follow the documented hashes and
do not depend on row order or on rows added later; a build is atomic and idempotent; every bad
input is refused with a message naming the thing and the fix; nothing reaches the network."""

from __future__ import annotations

import csv
import gzip
import hashlib
import json
import os
import random
import socket
from fractions import Fraction
from pathlib import Path

import dagster as dg
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import training._data_io as data_io
from assets import data as data_assets
from assets.data import CurriculumConfig, data_shards_asset
from assets.partitions import DATA_PARTITIONS, partitions_for
from assets.resources import StateResource
from training import user_datasets
from training.user_datasets import (
    DatasetSpec,
    build_user_shards,
    eval_flags,
    example_ids,
    load_user_dataset,
    load_user_shards,
    read_user_manifest,
)
from trainwise.user_project import EMPTY_PROJECT, load_project, load_project_file

REMAT = "re-materialize data_shards for this partition"
ADDED = ("example_id", "is_eval")


# ---- the documented rules, written out independently of the module ----------------------------

def int64_of(text: str) -> int:
    """example_id of a non-integer id: the first 8 bytes of sha256(utf-8), big-endian, signed."""
    return int.from_bytes(hashlib.sha256(text.encode("utf-8")).digest()[:8], "big", signed=True)


def is_eval_of(text: str, fraction: float) -> bool:
    digest = hashlib.sha256(b"trainwise.is_eval/1\0" + text.encode("utf-8")).digest()
    return int.from_bytes(digest[:8], "big") < int(Fraction(fraction) * 2**64)


def row_hash(row: dict) -> str:
    text = json.dumps(row, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


# ---- helpers ------------------------------------------------------------------------------------

def make_rows(n: int, start: int = 0) -> list[dict]:
    # score = i / 8: exact in binary, so a csv round trip gives the same float back
    return [{"id": i, "name": f"item-{i}", "label": i % 3, "score": i / 8}
            for i in range(start, start + n)]


def spec(path: Path, fmt: str, id_column: str = "id", *, name: str = "mine",
         eval_fraction: float = 0.25, text_column: str | None = None) -> DatasetSpec:
    return DatasetSpec(name=name, path=path, format=fmt, id_column=id_column,
                       text_column=text_column, eval_fraction=eval_fraction)


def out_for(root: Path, name: str = "mine") -> Path:
    return root / "state" / "shards" / name


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def write_json(path, rows):
    path.write_text(json.dumps(rows))
    return path


def write_jsonl_gz(path, rows):
    with gzip.open(path, "wt", encoding="utf-8") as out:
        out.writelines(json.dumps(r) + "\n" for r in rows)
    return path


def write_parquet(path, rows):
    pq.write_table(pa.Table.from_pylist(rows), path)
    return path


def write_csv(path, rows):
    with path.open("w", newline="") as out:
        writer = csv.DictWriter(out, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    return path


def write_arrow(path, rows):
    table = pa.Table.from_pylist(rows)
    with pa.ipc.new_stream(str(path), table.schema) as writer:  # what Dataset caches hold
        writer.write_table(table)
    return path


def write_saved(path, rows):
    import datasets

    datasets.Dataset.from_list(rows).save_to_disk(str(path))
    return path


def write_folder(path, rows):
    path.mkdir()
    for part in range(3):
        write_jsonl(path / f"part-{part}.jsonl", rows[part::3])
    (path / "README.md").write_text("not data: skipped")  # only files of the format are read
    return path


WRITERS = {  # case -> (file name, format, writer)
    "json": ("rows.json", "json", write_json),
    "jsonl": ("rows.jsonl", "jsonl", write_jsonl),
    "jsonl.gz": ("rows.jsonl.gz", "jsonl", write_jsonl_gz),
    "parquet": ("rows.parquet", "parquet", write_parquet),
    "csv": ("rows.csv", "csv", write_csv),
    "arrow": ("rows.arrow", "arrow", write_arrow),
    "saved": ("saved", "saved", write_saved),
    "folder": ("parts", "jsonl", write_folder),
}


def payload(row: dict) -> dict:
    return {k: v for k, v in row.items() if k not in ADDED}


def published_files(out_dir: Path) -> dict[str, bytes]:
    manifest = json.loads((out_dir / "manifest.json").read_text())
    folder = out_dir / manifest["folder"]
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir())}


def leftovers(out_dir: Path) -> list[str]:
    return [p.name for p in out_dir.iterdir() if p.name.startswith(".staging-")]


@pytest.fixture(autouse=True)
def no_network(monkeypatch):
    """Every test runs offline: an attempt to open an internet socket is recorded and refused."""
    attempts = []
    real_connect = socket.socket.connect

    def connect(self, address):
        if self.family in (socket.AF_INET, socket.AF_INET6):
            attempts.append(address)
            raise OSError(f"test: no network ({address})")
        return real_connect(self, address)

    monkeypatch.setattr(socket.socket, "connect", connect)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    yield attempts
    assert attempts == [], f"something tried the network: {attempts}"


# ---- every format -------------------------------------------------------------------------------

@pytest.mark.parametrize("case", list(WRITERS))
def test_every_format_builds_shards_holding_the_input_rows(case, tmp_path, no_network):
    name, fmt, write = WRITERS[case]
    rows = make_rows(23)
    source = write(tmp_path / name, rows)
    out_dir = out_for(tmp_path)
    built = build_user_shards(spec(source, fmt), out_dir, examples_per_shard=5)

    assert built.n_examples == 23 and built.n_train + built.n_eval == 23
    assert built.columns == ("example_id", "is_eval", "id", "name", "label", "score")
    assert [s["rows"] for s in built.shards] == [5, 5, 5, 5, 3]
    loaded = load_user_shards(out_dir).to_list()
    # the same rows, nothing lost, nothing added but the two columns; an integer id is example_id
    assert sorted((payload(r) for r in loaded), key=lambda r: r["id"]) == rows
    assert all(r["example_id"] == r["id"] for r in loaded)
    assert [r["example_id"] for r in loaded] == sorted(r["id"] for r in rows)  # sorted by id
    assert [r["is_eval"] for r in loaded] == [is_eval_of(str(r["id"]), 0.25) for r in loaded]
    assert built.n_eval == sum(r["is_eval"] for r in loaded)
    # the manifest on disk says the same, and records the source's files and checksums
    again = read_user_manifest(out_dir)
    assert again.fingerprint == built.fingerprint and again.shards == built.shards
    assert built.source["format"] == fmt and built.source["files"]
    assert all(len(f["sha256"]) == 64 for f in built.source["files"])
    if case == "folder":
        assert [f["file"] for f in built.source["files"]] == [
            "part-0.jsonl", "part-1.jsonl", "part-2.jsonl"]
    assert leftovers(out_dir) == []
    assert os.environ["HF_DATASETS_OFFLINE"] == "1" and os.environ["HF_HUB_OFFLINE"] == "1"


def test_text_format_is_one_row_per_line_with_row_content_ids(tmp_path):
    lines = [f"line number {i}" for i in range(12)]
    source = tmp_path / "corpus.txt"
    source.write_text("\n".join(lines) + "\n")
    out_dir = out_for(tmp_path)
    built = build_user_shards(spec(source, "text", "row_content_sha256", text_column="text"),
                              out_dir)
    assert built.columns == ("example_id", "is_eval", "text") and built.text_column == "text"
    loaded = load_user_shards(out_dir).to_list()
    assert sorted(r["text"] for r in loaded) == sorted(lines)
    for r in loaded:
        digest = row_hash({"text": r["text"]})
        assert r["example_id"] == int64_of(digest)
        assert r["is_eval"] == is_eval_of(digest, 0.25)
    assert built.metadata()["text_column"] == "text"


def test_saved_dataset_dict_uses_its_train_split(tmp_path):
    import datasets

    folder = tmp_path / "saved_dict"
    datasets.DatasetDict({"train": datasets.Dataset.from_list(make_rows(10)),
                          "test": datasets.Dataset.from_list(make_rows(4, 100))}
                         ).save_to_disk(str(folder))
    built = build_user_shards(spec(folder, "saved"), out_for(tmp_path))
    assert built.n_examples == 10
    assert sorted(r["id"] for r in load_user_shards(out_for(tmp_path))) == list(range(10))


# ---- ids ----------------------------------------------------------------------------------------

def test_integer_ids_are_kept_as_is_also_in_a_column_named_example_id(tmp_path):
    rows = [{"example_id": i * 1000 - 7, "x": i} for i in (5, -3, 0, 2**40, 9, 11, -2**50, 4)]
    source = write_jsonl(tmp_path / "rows.jsonl", rows)
    built = build_user_shards(spec(source, "jsonl", "example_id", eval_fraction=0.5),
                              out_for(tmp_path))
    assert built.columns == ("example_id", "is_eval", "x")  # not twice
    loaded = load_user_shards(out_for(tmp_path)).to_list()
    assert [r["example_id"] for r in loaded] == sorted(r["example_id"] for r in rows)
    assert {r["example_id"]: r["x"] for r in loaded} == {r["example_id"]: r["x"] for r in rows}


def test_string_ids_hash_to_int64_stably(tmp_path):
    rows = [{"rid": f"review-{i}", "body": f"text {i}"} for i in range(30)]
    source = write_jsonl(tmp_path / "rows.jsonl", rows)
    s = spec(source, "jsonl", "rid")
    ids, texts = example_ids(s, load_user_dataset(s, tmp_path / "cache"))
    assert ids.dtype.name == "int64" and texts == [r["rid"] for r in rows]
    assert ids.tolist() == [int64_of(r["rid"]) for r in rows]
    # pinned: the rule may not drift between versions (the ids key scores and curricula)
    assert int64_of("review-1") == ids[1] == 1869950048180437849
    assert eval_flags([f"review-{i}" for i in range(6)], 0.5).tolist() == [True] * 5 + [False]
    build_user_shards(s, out_for(tmp_path))
    loaded = load_user_shards(out_for(tmp_path)).to_list()
    assert {r["rid"]: r["example_id"] for r in loaded} == {r["rid"]: int64_of(r["rid"])
                                                          for r in rows}


def test_row_content_ids_do_not_depend_on_key_order(tmp_path):
    rows = [{"a": i, "b": f"v{i}", "c": [i, i + 1]} for i in range(8)]
    first = write_jsonl(tmp_path / "one" / "rows.jsonl", rows)
    second = write_jsonl(tmp_path / "two" / "rows.jsonl",
                         [{"c": r["c"], "b": r["b"], "a": r["a"]} for r in rows])
    a = build_user_shards(spec(first, "jsonl", "row_content_sha256"), out_for(tmp_path / "one"))
    b = build_user_shards(spec(second, "jsonl", "row_content_sha256"), out_for(tmp_path / "two"))
    ids_a = sorted(r["example_id"] for r in load_user_shards(out_for(tmp_path / "one")))
    ids_b = sorted(r["example_id"] for r in load_user_shards(out_for(tmp_path / "two")))
    assert ids_a == ids_b == sorted(int64_of(row_hash(r)) for r in rows)
    assert a.id_column == b.id_column == "row_content_sha256"


def test_shards_do_not_depend_on_the_input_row_order(tmp_path):
    rows = [{"rid": f"r{i}", "v": i} for i in range(60)]
    shuffled = rows[:]
    random.Random(3).shuffle(shuffled)
    assert shuffled != rows
    a = build_user_shards(spec(write_jsonl(tmp_path / "a" / "rows.jsonl", rows), "jsonl", "rid"),
                          out_for(tmp_path / "a"), examples_per_shard=16)
    b = build_user_shards(spec(write_jsonl(tmp_path / "b" / "rows.jsonl", shuffled), "jsonl",
                               "rid"), out_for(tmp_path / "b"), examples_per_shard=16)
    assert a.fingerprint == b.fingerprint
    assert [s["sha256"] for s in a.shards] == [s["sha256"] for s in b.shards]
    assert published_files(out_for(tmp_path / "a")) == published_files(out_for(tmp_path / "b"))
    # the shards are consecutive ranges of example_id
    bounds = [(s["first_example_id"], s["last_example_id"]) for s in a.shards]
    assert all(lo <= hi for lo, hi in bounds)
    assert all(prev[1] < nxt[0] for prev, nxt in zip(bounds, bounds[1:]))


def test_adding_rows_never_moves_an_example_between_train_and_eval(tmp_path):
    out_dir = out_for(tmp_path)
    source = tmp_path / "rows.jsonl"
    old = [{"rid": f"user-{i}", "v": i} for i in range(300)]
    write_jsonl(source, old)
    build_user_shards(spec(source, "jsonl", "rid", eval_fraction=0.2), out_dir)
    before = {r["example_id"]: r["is_eval"] for r in load_user_shards(out_dir)}

    grown = old + [{"rid": f"new-{i}", "v": -i} for i in range(300)]
    random.Random(1).shuffle(grown)
    write_jsonl(source, grown)
    built = build_user_shards(spec(source, "jsonl", "rid", eval_fraction=0.2), out_dir)
    after = {r["example_id"]: r["is_eval"] for r in load_user_shards(out_dir)}
    assert built.n_examples == 600 and len(after) == 600
    assert {k: after[k] for k in before} == before


@pytest.mark.parametrize("fraction", [0.1, 0.3])
def test_eval_fraction_is_roughly_respected(fraction, tmp_path):
    rows = [{"rid": f"doc-{i}"} for i in range(2000)]
    source = write_jsonl(tmp_path / "rows.jsonl", rows)
    built = build_user_shards(spec(source, "jsonl", "rid", eval_fraction=fraction),
                              out_for(tmp_path))
    assert built.n_train + built.n_eval == 2000
    # binomial(2000, f): 4 standard deviations either side
    sd = (2000 * fraction * (1 - fraction)) ** 0.5
    assert abs(built.n_eval - 2000 * fraction) < 4 * sd
    assert built.n_eval == sum(is_eval_of(r["rid"], fraction) for r in rows)
    assert built.n_eval == sum(s["n_eval"] for s in built.shards)


def test_rebuild_of_unchanged_input_is_idempotent(tmp_path):
    source = write_jsonl(tmp_path / "rows.jsonl", make_rows(40))
    out_dir = out_for(tmp_path)
    first = build_user_shards(spec(source, "jsonl"), out_dir, examples_per_shard=8)
    manifest_bytes = (out_dir / "manifest.json").read_bytes()
    files = published_files(out_dir)
    second = build_user_shards(spec(source, "jsonl"), out_dir, examples_per_shard=8)
    assert second.fingerprint == first.fingerprint and second.shards == first.shards
    assert (out_dir / "manifest.json").read_bytes() == manifest_bytes
    assert published_files(out_dir) == files
    assert sorted(p.name for p in out_dir.iterdir()) == ["manifest.json", json.loads(
        manifest_bytes)["folder"]]  # one version folder, no staging, no cache


def test_manifest_and_metadata(tmp_path):
    source = write_jsonl(tmp_path / "rows.jsonl", make_rows(12))
    built = build_user_shards(spec(source, "jsonl", eval_fraction=0.5), out_for(tmp_path),
                              examples_per_shard=5)
    raw = json.loads(built.path.read_text())
    assert raw["format"] == "trainwise.user_shards/1" and raw["kind"] == "user"
    assert raw["partition"] == "mine" and raw["eval_fraction"] == 0.5
    assert raw["examples_per_shard"] == 5 and raw["folder"] == "v-" + built.fingerprint[:16]
    assert raw["features"]["example_id"] == {"dtype": "int64", "_type": "Value"}
    meta = built.metadata()
    assert meta["kind"] == "user dataset" and meta["rows"] == 12 and meta["shards"] == 3
    assert meta["train_rows"] + meta["eval_rows"] == 12
    assert meta["bytes"] == sum((out_for(tmp_path) / raw["folder"] / s["file"]).stat().st_size
                                for s in raw["files"])
    assert meta["source_format"] == "jsonl" and meta["id_column"] == "id"
    assert all(v is not None for v in meta.values())
    assert [row["file"] for row in meta["shard_table"]] == [
        "shard-00000.parquet", "shard-00001.parquet", "shard-00002.parquet"]


# ---- refusals: each names the thing and the fix -------------------------------------------------

def _refused(tmp_path, s, error=ValueError, **kwargs) -> str:
    out_dir = out_for(tmp_path, s.name)
    with pytest.raises(error) as info:
        build_user_shards(s, out_dir, **kwargs)
    message = str(info.value)
    assert not (out_dir / "manifest.json").exists()
    assert not out_dir.exists() or leftovers(out_dir) == []
    return message


def test_missing_id_column_is_named_with_the_columns_and_the_fix(tmp_path):
    source = write_jsonl(tmp_path / "rows.jsonl", make_rows(5))
    message = _refused(tmp_path, spec(source, "jsonl", "review_id"))
    assert "dataset 'mine'" in message and "no id column 'review_id'" in message
    assert "['id', 'name', 'label', 'score']" in message
    assert "set `id_column`" in message and "'row_content_sha256'" in message


@pytest.mark.parametrize("values, repeated", [([1, 2, 3, 2, 5], "'2'"),
                                              (["a", "b", "a", "c", "d"], "'a'")])
def test_duplicate_ids_are_refused(values, repeated, tmp_path):
    source = write_jsonl(tmp_path / "rows.jsonl", [{"id": v, "n": i} for i, v in enumerate(values)])
    message = _refused(tmp_path, spec(source, "jsonl"))
    assert f"id {repeated} of column 'id' repeats" in message
    assert "ids must be unique" in message and "fix the data" in message


def test_identical_rows_are_refused_with_row_content_ids(tmp_path):
    source = write_jsonl(tmp_path / "rows.jsonl", [{"a": 1}, {"a": 2}, {"a": 1}])
    message = _refused(tmp_path, spec(source, "jsonl", "row_content_sha256"))
    assert "rows 0 and 2 are identical" in message and "remove the duplicate rows" in message


def test_null_and_unusable_ids_are_refused(tmp_path):
    source = write_jsonl(tmp_path / "nulls.jsonl", [{"id": "a"}, {"id": None}, {"id": "c"}])
    message = _refused(tmp_path, spec(source, "jsonl"))
    assert "is empty (null) in 1 row(s), the first at row 1" in message
    assert "give every row an id" in message
    source = write_jsonl(tmp_path / "floats.jsonl", [{"id": 0.5}, {"id": 1.5}])
    message = _refused(tmp_path / "f", spec(source, "jsonl"))
    assert "must hold integers or strings" in message and "convert it" in message
    pq.write_table(pa.table({"id": pa.array([1, 2**63 + 5], pa.uint64())}),
                   tmp_path / "big.parquet")
    message = _refused(tmp_path / "b", spec(tmp_path / "big.parquet", "parquet"))
    assert "above 2**63 - 1" in message and "store them as strings" in message


def test_an_id_collision_is_refused(tmp_path, monkeypatch):
    # A real 64-bit collision is out of reach; the check is reached with a hash that collides.
    monkeypatch.setattr(user_datasets, "_id_to_int64", lambda text: 42)
    source = write_jsonl(tmp_path / "rows.jsonl", [{"id": "x"}, {"id": "y"}])
    message = _refused(tmp_path, spec(source, "jsonl"))
    assert "ids 'x' and 'y' hash to the same example_id 42" in message
    assert "change one of the two ids" in message


@pytest.mark.parametrize("rows, id_column, column", [
    ([{"id": 1, "is_eval": True}, {"id": 2, "is_eval": False}], "id", "is_eval"),
    ([{"id": 1, "example_id": 7}, {"id": 2, "example_id": 8}], "id", "example_id"),
    ([{"example_id": "a"}, {"example_id": "b"}], "example_id", "example_id"),
])
def test_reserved_column_names_are_refused(rows, id_column, column, tmp_path):
    source = write_jsonl(tmp_path / "rows.jsonl", rows)
    message = _refused(tmp_path, spec(source, "jsonl", id_column))
    assert f"has a column {column!r}, a name the shards add themselves" in message
    assert "rename that column in the data" in message


def test_a_missing_file_is_named(tmp_path):
    missing = tmp_path / "gone.jsonl"
    message = _refused(tmp_path, spec(missing, "jsonl"), FileNotFoundError)
    assert str(missing) in message and "does not exist" in message
    assert "fix `path` in the project file" in message


def test_a_folder_without_files_of_the_format_is_named(tmp_path):
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "rows.csv").write_text("id\n1\n")
    message = _refused(tmp_path, spec(tmp_path / "data", "jsonl"))
    assert "holds no jsonl files" in message and ".jsonl" in message
    assert "point `path` at a file" in message


def test_an_unknown_format_lists_the_known_ones(tmp_path):
    source = write_jsonl(tmp_path / "rows.xlsx", make_rows(3))
    message = _refused(tmp_path, spec(source, "xlsx"))
    assert "unknown format 'xlsx'" in message
    assert "use one of json, jsonl, parquet, csv, text, arrow, saved" in message


def test_a_file_that_does_not_parse_names_the_file_and_the_fix(tmp_path):
    source = tmp_path / "rows.jsonl"
    source.write_text('{"id": 1}\n{not json\n')
    message = _refused(tmp_path, spec(source, "jsonl"))
    assert "rows.jsonl does not parse as jsonl" in message and "fix the file" in message


def test_saved_format_needs_a_save_to_disk_folder(tmp_path):
    source = write_jsonl(tmp_path / "rows.jsonl", make_rows(3))
    message = _refused(tmp_path, spec(source, "saved"), FileNotFoundError)
    assert "needs the folder that Dataset.save_to_disk wrote" in message
    (tmp_path / "plain").mkdir()
    message = _refused(tmp_path / "p", spec(tmp_path / "plain", "saved"))
    assert "is not a folder written by Dataset.save_to_disk" in message


@pytest.mark.parametrize("name, content", [
    ("empty.jsonl", ""), ("blank.jsonl", "\n\n"), ("header.csv", "id,name\n"), ("empty.txt", ""),
    ("empty.json", "[]"), ("zero.parquet", None)])
def test_an_empty_dataset_is_refused_as_empty(name, content, tmp_path):
    source = tmp_path / name
    if content is None:
        pq.write_table(pa.table({"id": pa.array([], pa.int64())}), source)
    else:
        source.write_text(content)
    fmt = user_datasets.infer_format(source)
    message = _refused(tmp_path, spec(source, fmt))
    assert f"dataset 'mine' ([datasets.mine], {source}) has no rows" in message
    assert "add rows to the data" in message


def test_too_few_rows_for_both_splits_is_refused(tmp_path):
    source = write_jsonl(tmp_path / "rows.jsonl", make_rows(1))
    message = _refused(tmp_path, spec(source, "jsonl"))
    assert "both need at least one" in message and "change `eval_fraction`" in message


def test_a_bad_text_column_is_refused(tmp_path):
    source = write_jsonl(tmp_path / "rows.jsonl", make_rows(4))
    message = _refused(tmp_path, spec(source, "jsonl", text_column="body"))
    assert "no text column 'body'" in message and "set `text_column`" in message
    message = _refused(tmp_path / "t", spec(source, "jsonl", text_column="label"))
    assert "text column 'label' holds int64, not strings" in message


def test_out_dir_must_be_the_partitions_own_folder(tmp_path):
    source = write_jsonl(tmp_path / "rows.jsonl", make_rows(4))
    with pytest.raises(ValueError, match="must be the partition's own folder, named 'mine'"):
        build_user_shards(spec(source, "jsonl"), tmp_path / "shards" / "other")


# ---- atomic publication, verified reads ---------------------------------------------------------

@pytest.fixture
def published(tmp_path):
    """A partition published from 30 rows (6 shards), and its rows as read back."""
    source = write_jsonl(tmp_path / "rows.jsonl", make_rows(30))
    out_dir = out_for(tmp_path)
    build_user_shards(spec(source, "jsonl"), out_dir, examples_per_shard=5)
    return source, out_dir, load_user_shards(out_dir).to_list()


@pytest.mark.parametrize("where", ["second shard", "manifest swap"])
def test_a_crash_mid_build_leaves_the_previous_shards_readable(where, published, monkeypatch):
    import datasets

    source, out_dir, rows_before = published
    manifest_before = (out_dir / "manifest.json").read_bytes()
    write_jsonl(source, make_rows(50))  # new data, whose build crashes
    if where == "second shard":
        real, calls = datasets.Dataset.to_parquet, []

        def crash(self, *args, **kwargs):
            calls.append(args)
            if len(calls) == 2:
                raise RuntimeError("disk gone")
            return real(self, *args, **kwargs)

        monkeypatch.setattr(datasets.Dataset, "to_parquet", crash)
    else:
        def crash(*_args, **_kwargs):
            raise RuntimeError("disk gone")

        monkeypatch.setattr(data_io, "atomic_write_json", crash)
    with pytest.raises(RuntimeError, match="disk gone"):
        build_user_shards(spec(source, "jsonl"), out_dir, examples_per_shard=5)
    assert (out_dir / "manifest.json").read_bytes() == manifest_before
    assert load_user_shards(out_dir).to_list() == rows_before
    assert leftovers(out_dir) == []
    assert not list(out_dir.rglob(".hf-cache"))


def test_a_tampered_shard_is_refused_naming_rematerialization(published):
    _, out_dir, _ = published
    shard = out_dir / json.loads((out_dir / "manifest.json").read_text())["folder"] / \
        "shard-00002.parquet"
    content = bytearray(shard.read_bytes())
    content[len(content) // 2] ^= 0x01
    shard.write_bytes(bytes(content))
    with pytest.raises(ValueError) as info:
        load_user_shards(out_dir)
    assert "shard-00002.parquet fails its sha256 checksum" in str(info.value)
    assert REMAT in str(info.value)


def test_a_missing_shard_or_an_edited_manifest_is_refused(published):
    _, out_dir, _ = published
    manifest_path = out_dir / "manifest.json"
    raw = json.loads(manifest_path.read_text())
    edited = dict(raw, eval_fraction=0.5)  # would change which rows are eval
    manifest_path.write_text(json.dumps(edited))
    with pytest.raises(ValueError, match="does not match its own fingerprint") as info:
        load_user_shards(out_dir)
    assert REMAT in str(info.value)
    manifest_path.write_text(json.dumps(raw))
    (out_dir / raw["folder"] / "shard-00005.parquet").unlink()
    with pytest.raises(FileNotFoundError, match="shard-00005.parquet is missing") as info:
        load_user_shards(out_dir)
    assert REMAT in str(info.value)


def test_no_manifest_or_a_builtin_manifest_names_rematerialization(tmp_path):
    with pytest.raises(FileNotFoundError) as info:
        load_user_shards(out_for(tmp_path))
    assert "no shard manifest" in str(info.value) and REMAT in str(info.value)
    out_dir = out_for(tmp_path)
    out_dir.mkdir(parents=True)
    (out_dir / "manifest.json").write_text(json.dumps({"format": "trainwise.data_shards/1"}))
    with pytest.raises(ValueError, match="expected 'trainwise.user_shards/1'"):
        read_user_manifest(out_dir)


# ---- the project file ---------------------------------------------------------------------------

GOOD = """
[jobs.fit]                 # a job may come before its dataset
entry = "train.py"
dataset = "reviews"
args = ["--epochs", "3"]
framework = "lightning"

[jobs.tune]
entry = "team.train:main"
dataset = "docs"

[datasets.reviews]
path = "data/reviews.jsonl"
id_column = "rid"
text_column = "body"
eval_fraction = 0.2

[datasets.docs]
path = "data/docs"
format = "parquet"
id_column = "row_content_sha256"
"""


@pytest.fixture
def team(tmp_path):
    folder = tmp_path / "team"
    write_jsonl(folder / "data" / "reviews.jsonl",
                [{"rid": f"r{i}", "body": f"review {i}", "stars": i % 5} for i in range(40)])
    (folder / "data" / "docs").mkdir()
    write_parquet(folder / "data" / "docs" / "a.parquet", make_rows(6))
    (folder / "train.py").write_text("print('hi')\n")
    return folder


def write_project(folder: Path, text: str) -> Path:
    path = folder / "trainwise.toml"
    path.write_text(text)
    return path


def test_a_good_project_file_parses(team):
    path = write_project(team, GOOD)
    project = load_project_file(path)
    assert list(project.datasets) == ["reviews", "docs"] and project.path == path.resolve()
    reviews = project.datasets["reviews"]
    assert reviews.path == (team / "data" / "reviews.jsonl").resolve() and reviews.path.is_absolute()
    assert reviews.format == "jsonl"  # from the suffix
    assert (reviews.id_column, reviews.text_column, reviews.eval_fraction) == ("rid", "body", 0.2)
    assert reviews.declared_in == path.resolve()
    docs = project.datasets["docs"]
    assert (docs.format, docs.id_column, docs.text_column, docs.eval_fraction) == (
        "parquet", "row_content_sha256", None, 0.1)
    fit, tune = project.jobs["fit"], project.jobs["tune"]
    assert (fit.entry_kind, fit.script, fit.args, fit.framework) == (
        "script", (team / "train.py").resolve(), ("--epochs", "3"), "lightning")
    assert (tune.entry_kind, tune.script, tune.dataset, tune.framework) == (
        "module", None, "docs", "plain")
    assert list(partitions_for(project).get_partition_keys()) == [*DATA_PARTITIONS, "reviews",
                                                                  "docs"]
    assert list(partitions_for(EMPTY_PROJECT).get_partition_keys()) == list(DATA_PARTITIONS)


def test_the_project_file_comes_from_the_setting(team, monkeypatch):
    monkeypatch.setenv("TRAINWISE_PROJECT_FILE", "")
    assert load_project() is EMPTY_PROJECT
    monkeypatch.setenv("TRAINWISE_PROJECT_FILE", str(write_project(team, GOOD)))
    assert list(load_project().datasets) == ["reviews", "docs"]
    monkeypatch.setenv("TRAINWISE_PROJECT_FILE", str(team / "nope.toml"))
    with pytest.raises(ValueError, match="does not exist or is not a file") as info:
        load_project()
    assert "point TRAINWISE_PROJECT_FILE at your project's TOML file" in str(info.value)


REVIEWS = '[datasets.reviews]\npath = "data/reviews.jsonl"\nid_column = "rid"\n'


@pytest.mark.parametrize("text, key, fix", [
    ("[dataset.reviews]\npath = 'x'\n", "dataset: unknown section",
     "use only [datasets.NAME] and [jobs.NAME]"),
    (REVIEWS + "idcolumn = 'rid'\n", "datasets.reviews.idcolumn: unknown key",
     "use only path, format, id_column, text_column, eval_fraction"),
    (REVIEWS + "[jobs.fit]\nentry = 'train.py'\ndataset = 'reviews'\ngpus = 2\n",
     "jobs.fit.gpus: unknown key", "use only entry, dataset, args, framework"),
    ('[datasets.Reviews]\npath = "data/reviews.jsonl"\nid_column = "rid"\n',
     "[datasets.Reviews]: the name is not", "rename it"),
    ('[datasets."my data"]\npath = "data/reviews.jsonl"\nid_column = "rid"\n',
     "[datasets.my data]: the name is not", "rename it"),
    ('[datasets.mnist]\npath = "data/reviews.jsonl"\nid_column = "rid"\n',
     "[datasets.mnist]: the name is a built-in partition's", "choose another name"),
    ('[datasets.reviews]\nid_column = "rid"\n', "datasets.reviews.path: missing",
     'add path = "..."'),
    ('[datasets.reviews]\npath = "data/gone.jsonl"\nid_column = "rid"\n',
     "datasets.reviews.path: ", "does not exist; fix the path"),
    ('[datasets.reviews]\npath = ""\nid_column = "rid"\n',
     "datasets.reviews.path: must be a non-empty string", "set it to the data's file or folder"),
    (REVIEWS + 'format = "xlsx"\n', "datasets.reviews.format: unknown format 'xlsx'",
     "use one of json, jsonl, parquet, csv, text, arrow, saved"),
    ('[datasets.reviews]\npath = "data/docs"\nid_column = "rid"\n',
     "datasets.reviews.format: cannot be told from 'docs'", "add format = one of"),
    (REVIEWS + 'format = "saved"\n', "datasets.reviews.format: 'saved' needs the folder",
     "fix path, or set the file's format"),
    ('[datasets.reviews]\npath = "data/reviews.jsonl"\n', "datasets.reviews.id_column: missing",
     'or "row_content_sha256" to hash each row'),
    (REVIEWS + "eval_fraction = 1.0\n", "datasets.reviews.eval_fraction: must be a number in (0, 1)",
     "set it to e.g. 0.1"),
    (REVIEWS + "eval_fraction = true\n", "datasets.reviews.eval_fraction: must be a number",
     "set it to e.g. 0.1"),
    (REVIEWS + 'text_column = ""\n', "datasets.reviews.text_column: must be a non-empty string",
     "name a column of strings, or remove the key"),
    (REVIEWS + "[jobs.fit]\nentry = 'train.py'\ndataset = 'nope'\n",
     "jobs.fit.dataset: 'nope' is not a declared dataset",
     "name one of the [datasets.NAME] of this file (declared: reviews)"),
    (REVIEWS + "[jobs.fit]\nentry = 'train.py'\n", "jobs.fit.dataset: missing", "add dataset ="),
    (REVIEWS + "[jobs.fit]\ndataset = 'reviews'\n", "jobs.fit.entry: missing", "add entry ="),
    (REVIEWS + "[jobs.fit]\nentry = 'gone.py'\ndataset = 'reviews'\n",
     "jobs.fit.entry: script", "does not exist; fix the path"),
    (REVIEWS + "[jobs.fit]\nentry = 'not an entry'\ndataset = 'reviews'\n",
     "jobs.fit.entry: 'not an entry' is neither", 'write e.g. "myteam.train:main"'),
    (REVIEWS + "[jobs.fit]\nentry = 'train.py'\ndataset = 'reviews'\nargs = [1]\n",
     "jobs.fit.args: must be a list of strings", 'write e.g. args = ["--epochs", "3"]'),
    (REVIEWS + "[jobs.fit]\nentry = 'train.py'\ndataset = 'reviews'\nframework = 'jax'\n",
     "jobs.fit.framework: unknown framework 'jax'", "use one of plain, hf_trainer, lightning"),
    ("datasets = 3\n", "datasets: is a int, not a table", "write it as [datasets.NAME] sections"),
    ("[datasets]\nreviews = 'data/reviews.jsonl'\n", "datasets.reviews: is a str, not a table",
     "write it as a [datasets.reviews] section"),
])
def test_a_bad_project_file_names_the_key_and_the_fix(text, key, fix, team):
    path = write_project(team, text)
    with pytest.raises(ValueError) as info:
        load_project_file(path)
    message = str(info.value)
    assert message.startswith(f"project file {path.resolve()}: ")
    assert key in message and fix in message


def test_a_save_to_disk_folder_is_told_by_its_files(team):
    write_saved(team / "data" / "saved", make_rows(4))
    path = write_project(team, '[datasets.kept]\npath = "data/saved"\nid_column = "id"\n')
    assert load_project_file(path).datasets["kept"].format == "saved"


def test_invalid_toml_is_named(team):
    path = write_project(team, "[datasets.reviews\npath = 1\n")
    with pytest.raises(ValueError, match="is not valid TOML") as info:
        load_project_file(path)
    assert str(path.resolve()) in str(info.value) and "fix the syntax" in str(info.value)


def test_parsing_reads_no_data(team, monkeypatch):
    """The file is checked when the code location loads; the data only at materialization."""
    monkeypatch.setattr(user_datasets, "load_user_dataset",
                        lambda *a, **k: pytest.fail("the parser read the data"))
    (team / "data" / "reviews.jsonl").write_text("{not json at all\n")
    assert load_project_file(write_project(team, GOOD)).datasets["reviews"].format == "jsonl"


# ---- Dagster ------------------------------------------------------------------------------------

@pytest.fixture
def project(team):
    return load_project_file(write_project(team, GOOD))


def _failure_message(result: dg.ExecuteInProcessResult) -> str:
    failures = [e for e in result.all_events if e.is_step_failure]
    assert failures, "the run did not fail"
    return failures[0].step_failure_data.error.message


def test_data_shards_materializes_a_registered_partition(project, tmp_path):
    shards_asset = data_shards_asset(partitions_for(project), project.datasets)
    resources = {"state": StateResource(home=str(tmp_path / "home"))}
    result = dg.materialize([shards_asset], partition_key="reviews", resources=resources)
    assert result.success
    [materialization] = result.asset_materializations_for_node("data_shards")
    assert materialization.partition == "reviews"
    meta = {k: v.value for k, v in materialization.metadata.items()}
    out_dir = tmp_path / "home" / "shards" / "reviews"
    manifest = read_user_manifest(out_dir)
    assert meta["kind"] == "user dataset" and meta["partition"] == "reviews"
    assert meta["rows"] == 40 == meta["train_rows"] + meta["eval_rows"]
    assert meta["fingerprint"] == manifest.fingerprint and meta["manifest"] == str(manifest.path)
    assert meta["id_column"] == "rid" and meta["text_column"] == "body"
    assert meta["source_format"] == "jsonl" and meta["eval_rows"] == manifest.n_eval
    rows = load_user_shards(out_dir).to_list()
    assert sorted(r["rid"] for r in rows) == sorted(f"r{i}" for i in range(40))
    assert all(r["is_eval"] == is_eval_of(r["rid"], 0.2) for r in rows)


def test_a_bad_registered_dataset_fails_the_run_with_the_fix(project, tmp_path):
    (project.datasets["reviews"].path).write_text("")
    shards_asset = data_shards_asset(partitions_for(project), project.datasets)
    result = dg.materialize([shards_asset], partition_key="reviews", raise_on_error=False,
                            resources={"state": StateResource(home=str(tmp_path / "home"))})
    assert not result.success
    message = _failure_message(result)
    assert "dataset 'reviews'" in message and "has no rows; add rows to the data" in message


def test_scores_and_curriculum_refuse_a_registered_partition(project, tmp_path):
    state = StateResource(home=str(tmp_path / "home"))
    shards_asset = data_shards_asset(partitions_for(project), project.datasets)
    assert dg.materialize([shards_asset], partition_key="reviews",
                          resources={"state": state}).success
    expected = ("partition 'reviews' is a registered dataset (TRAINWISE_PROJECT_FILE); {asset} "
                "supports only the built-in partitions (tinyshakespeare, mnist, pystdlib)")
    # The module's own assets, invoked for the partition...
    with dg.build_asset_context(partition_key="reviews") as context, \
            pytest.raises(dg.Failure) as info:
        data_assets.difficulty_scores(context, state=state)
    assert expected.format(asset="difficulty_scores") in info.value.description
    with dg.build_asset_context(partition_key="reviews") as context, \
            pytest.raises(dg.Failure) as info:
        data_assets.curriculum(context, config=CurriculumConfig(), state=state)
    assert expected.format(asset="curriculum") in info.value.description
    # ...and a Dagster run of the same body over the project's partitions (the code location's
    # partitions come from TRAINWISE_PROJECT_FILE when it loads).
    scores = dg.asset(name="difficulty_scores", partitions_def=partitions_for(project),
                      deps=[shards_asset])(data_assets.difficulty_scores.op.compute_fn.decorated_fn)
    result = dg.materialize([shards_asset.to_source_asset(), scores], partition_key="reviews",
                            resources={"state": state}, raise_on_error=False)
    assert not result.success
    assert expected.format(asset="difficulty_scores") in _failure_message(result)
    assert not (tmp_path / "home" / "scores" / "reviews").exists()
