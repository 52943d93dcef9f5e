from pathlib import Path

import pytest

from trainwise.object_store import LocalObjectStore, S3ObjectStore, sha256_of


def test_local_put_get_roundtrip(tmp_path):
    source = tmp_path / "ckpt.pt"
    source.write_bytes(b"weights" * 1000)
    store = LocalObjectStore(tmp_path / "objects")
    uri = store.put_file(source, "checkpoints/a/ckpt.pt")
    assert uri.startswith("file://") and store.exists("checkpoints/a/ckpt.pt")
    back = store.get_file("checkpoints/a/ckpt.pt", tmp_path / "back.pt")
    assert sha256_of(back) == sha256_of(source)
    # no temp files left next to the object
    assert [p.name for p in (tmp_path / "objects" / "checkpoints" / "a").iterdir()] == ["ckpt.pt"]


@pytest.mark.parametrize("key", ["", "/abs/key", "../escape", "a/../../b"])
def test_bad_keys_refused(tmp_path, key):
    with pytest.raises(ValueError, match="relative path"):
        LocalObjectStore(tmp_path).put_file(Path(__file__), key)


def test_failed_put_keeps_previous_object(tmp_path, monkeypatch):
    store = LocalObjectStore(tmp_path / "objects")
    good = tmp_path / "good"
    good.write_bytes(b"good")
    store.put_file(good, "k")

    def broken_copy(src, dst):
        Path(dst).write_bytes(b"half")
        raise OSError("disk full")

    monkeypatch.setattr("trainwise.object_store.shutil.copyfile", broken_copy)
    with pytest.raises(OSError):
        store.put_file(good, "k")
    assert (tmp_path / "objects" / "k").read_bytes() == b"good"
    assert sorted(p.name for p in (tmp_path / "objects").iterdir()) == ["k"]


def test_missing_object_names_the_key(tmp_path):
    with pytest.raises(FileNotFoundError, match="nope"):
        LocalObjectStore(tmp_path).get_file("nope", tmp_path / "x")


def test_short_bucket_refused():
    with pytest.raises(ValueError, match="TRAINWISE_S3_BUCKET"):
        S3ObjectStore(client=None, bucket="ab")
