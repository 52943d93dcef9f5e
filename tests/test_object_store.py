import hashlib
import json
import threading
from pathlib import Path
from types import SimpleNamespace

import pytest

from trainwise.object_store import (
    CheckpointUploader,
    LocalObjectStore,
    S3ObjectStore,
    latest_committed_checkpoint,
    sha256_of,
)
from trainwise.services import Backoff, ServiceUnreachableError


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


# -- checkpoints: payload, manifest, commit marker last ------------------------------------------
FAST = Backoff(tries=4, first_delay_s=0.02, factor=2.0, max_delay_s=0.1)


def write_checkpoint(folder: Path, step: int, payload: bytes | None = None) -> SimpleNamespace:
    """A committed local checkpoint as training writes it: payload, then its manifest."""
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"step-{step:07d}.pt"
    path.write_bytes(payload if payload is not None else f"weights {step}".encode() * 500)
    digest = hashlib.sha256(path.read_bytes()).hexdigest()
    manifest = path.with_name(path.name + ".manifest.json")
    manifest.write_text(json.dumps({"format": "trainwise-checkpoint", "step": step,
                                    "sha256": digest, "bytes": path.stat().st_size}))
    return SimpleNamespace(path=path, manifest_path=manifest, step=step, sha256=digest,
                           reason="interval")


class RecordingStore(LocalObjectStore):
    """A local store that records the order of puts and can fail the first N of them."""

    def __init__(self, root: Path, fail_first: int = 0) -> None:
        super().__init__(root)
        self.order: list[str] = []
        self.fail_first = fail_first

    def _put_atomic(self, write, key):
        if self.fail_first > 0:
            self.fail_first -= 1
            raise ConnectionError("endpoint went away")
        self.order.append(key)
        return super()._put_atomic(write, key)


def test_put_checkpoint_commits_last(tmp_path):
    info = write_checkpoint(tmp_path / "local", 10)
    store = RecordingStore(tmp_path / "objects")
    uri = store.put_checkpoint(info.path, info.manifest_path, "ckpt/run1/step-0000010.pt")
    assert uri == store.uri("ckpt/run1/step-0000010.pt")
    assert store.order == ["ckpt/run1/step-0000010.pt", "ckpt/run1/step-0000010.pt.manifest.json",
                           "ckpt/run1/step-0000010.pt.commit"]
    commit = json.loads(store.get_bytes("ckpt/run1/step-0000010.pt.commit"))
    assert (commit["sha256"], commit["bytes"], commit["step"]) == (
        info.sha256, info.path.stat().st_size, 10)


def test_damaged_local_checkpoint_is_not_uploaded(tmp_path):
    info = write_checkpoint(tmp_path / "local", 10)
    info.path.write_bytes(b"bit rot")
    store = LocalObjectStore(tmp_path / "objects")
    with pytest.raises(ValueError, match="does not match its manifest"):
        store.put_checkpoint(info.path, info.manifest_path, "ckpt/step-0000010.pt")
    assert not store.exists("ckpt/step-0000010.pt.commit")


def test_reader_trusts_only_committed_and_verified_checkpoints(tmp_path):
    store = LocalObjectStore(tmp_path / "objects")
    for step in (10, 20):
        info = write_checkpoint(tmp_path / "local", step)
        store.put_checkpoint(info.path, info.manifest_path, f"ckpt/step-{step:07d}.pt")
    # step 30: the node died after the payload, before the commit marker
    newest = write_checkpoint(tmp_path / "local", 30)
    store.put_file(newest.path, "ckpt/step-0000030.pt")
    # step 20: committed, but the stored payload was damaged afterwards
    (tmp_path / "objects" / "ckpt" / "step-0000020.pt").write_bytes(b"truncated")

    found = latest_committed_checkpoint(store, "ckpt", tmp_path / "restore")
    assert found is not None and found.step == 10
    assert [key for key, _ in found.skipped] == ["ckpt/step-0000020.pt"]
    assert hashlib.sha256(found.path.read_bytes()).hexdigest() == found.sha256
    assert found.manifest_path.exists()
    assert sorted(p.name for p in (tmp_path / "restore").iterdir()) == [
        "step-0000010.pt", "step-0000010.pt.manifest.json"]
    assert latest_committed_checkpoint(store, "other", tmp_path / "restore") is None


def test_uploader_retries_then_uploads(tmp_path):
    store = RecordingStore(tmp_path / "objects", fail_first=2)
    uploader = CheckpointUploader(store, "ckpt/run1", backoff=FAST)
    info = write_checkpoint(tmp_path / "local", 10)
    uploader.submit(info)
    report = uploader.drain(timeout_s=10)
    assert report.uploaded == [store.uri("ckpt/run1/step-0000010.pt")] and report.ok
    assert store.exists("ckpt/run1/step-0000010.pt.commit")


def test_uploader_reports_failure_after_bounded_retries(tmp_path):
    store = RecordingStore(tmp_path / "objects", fail_first=100)
    uploader = CheckpointUploader(store, "ckpt/run1", backoff=FAST)
    uploader.submit(write_checkpoint(tmp_path / "local", 10))
    report = uploader.drain(timeout_s=10)
    assert report.uploaded == []
    [(key, why)] = report.failed
    assert key == "ckpt/run1/step-0000010.pt"
    assert "4 tries" in why and "endpoint went away" in why and "TRAINWISE_S3_BUCKET" in why
    with pytest.raises(RuntimeError, match="after drain"):
        uploader.submit(write_checkpoint(tmp_path / "local", 20))


def test_uploader_fails_at_once_on_a_non_transient_error(tmp_path):
    # The text looks transient; the type (a refused request, not a lost connection) is not.
    class DeniedStore(RecordingStore):
        tries = 0

        def _put_atomic(self, write, key):
            DeniedStore.tries += 1
            raise PermissionError(13, "AccessDenied (connection refused, 503)")

    uploader = CheckpointUploader(DeniedStore(tmp_path / "objects"), "ckpt", backoff=FAST)
    uploader.submit(write_checkpoint(tmp_path / "local", 10))
    report = uploader.drain(timeout_s=10)
    [(key, why)] = report.failed
    assert DeniedStore.tries == 1, "not retried"
    assert "PermissionError" in why and "not retried" in why and "TRAINWISE_S3_BUCKET" in why


def test_s3_clients_retry_through_botocore_standard_mode():
    pytest.importorskip("boto3")
    from trainwise.object_store import s3_client, s3_client_config

    assert s3_client_config(3).retries == {"mode": "standard", "total_max_attempts": 3}
    client = s3_client("http://127.0.0.1:9", "us-east-1", total_attempts=2)
    assert client.meta.config.retries == {"mode": "standard", "total_max_attempts": 2}
    assert client.meta.endpoint_url == "http://127.0.0.1:9"


def test_uploader_skips_superseded_checkpoints(tmp_path):
    gate, entered = threading.Event(), threading.Event()

    class SlowStore(LocalObjectStore):
        def put_checkpoint(self, *args, **kwargs):
            entered.set()
            gate.wait(10)
            return super().put_checkpoint(*args, **kwargs)

    store = SlowStore(tmp_path / "objects")
    uploader = CheckpointUploader(store, "ckpt", backoff=FAST)
    infos = [write_checkpoint(tmp_path / "local", step) for step in (10, 20, 30, 40)]
    uploader.submit(infos[0])
    assert entered.wait(10)
    for info in infos[1:]:
        uploader.submit(info)  # queued while step 10 is still uploading
    gate.set()
    report = uploader.drain(timeout_s=10)
    assert report.uploaded == [store.uri("ckpt/step-0000010.pt"), store.uri("ckpt/step-0000040.pt")]
    assert [key for key, _ in report.skipped] == ["ckpt/step-0000020.pt", "ckpt/step-0000030.pt"]
    assert report.failed == []


def test_drain_timeout_reports_what_is_left(tmp_path):
    store = RecordingStore(tmp_path / "objects", fail_first=100)
    slow = Backoff(tries=3, first_delay_s=5.0, factor=1.0, max_delay_s=5.0)
    uploader = CheckpointUploader(store, "ckpt", backoff=slow)
    uploader.submit(write_checkpoint(tmp_path / "local", 10))
    report = uploader.drain(timeout_s=0.3)
    assert [key for key, _ in report.failed] == ["ckpt/step-0000010.pt"]
    assert "drain timeout" in report.failed[0][1]


def test_uploader_takes_the_trainers_checkpoint_info(tmp_path):
    from training._loop_persist import CheckpointInfo

    local = write_checkpoint(tmp_path / "local", 5)
    info = CheckpointInfo(path=local.path, manifest_path=local.manifest_path, step=5,
                          sha256=local.sha256, reason="final")
    store = LocalObjectStore(tmp_path / "objects")
    uploader = CheckpointUploader(store, "ckpt")
    uploader.submit(info)
    assert uploader.drain(timeout_s=10).uploaded == [store.uri("ckpt/step-0000005.pt")]


def test_local_store_reachability(tmp_path):
    LocalObjectStore(tmp_path / "new" / "objects").check_reachable()
    (tmp_path / "afile").write_text("")
    with pytest.raises(ServiceUnreachableError, match="TRAINWISE_HOME"):
        LocalObjectStore(tmp_path / "afile" / "objects").check_reachable()
